//! The data files, in the safetensors format (the `safetensors` crate's `Dtype` names the
//! element types; its reader reads them): written streaming, straight from the shards, and read
//! piece by piece (each rank reads only the byte ranges it needs).

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use serde::Deserialize;

use super::CheckpointError;

/// The safetensors name of a dtype of ours.
pub(crate) fn st_dtype(dtype: &str) -> Option<Dtype> {
    Some(match dtype {
        "f32" => Dtype::F32,
        "bf16" => Dtype::BF16,
        "f16" => Dtype::F16,
        "f64" => Dtype::F64,
        "u8" => Dtype::U8,
        "i8" => Dtype::I8,
        "i32" => Dtype::I32,
        "i64" => Dtype::I64,
        _ => return None,
    })
}

/// One 1-D tensor of a file to write: its name, dtype, elements and bytes.
pub(crate) struct Entry {
    pub(crate) name: String,
    pub(crate) dtype: Dtype,
    pub(crate) numel: usize,
    /// Its length in bytes (the caller's `fill` writes them, given the entry's position).
    pub(crate) bytes: usize,
}

/// Writes a safetensors file of `entries` to `path` (through a temporary name, synced, then
/// renamed): the header, then each entry's bytes as `fill(i, file)` writes them, streamed
/// straight from where they are (no copy of the whole file in memory).
pub(crate) fn write(
    path: &Path,
    save: &str,
    entries: &[Entry],
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> Result<(), CheckpointError>,
) -> Result<(), CheckpointError> {
    let tmp = path.with_extension("safetensors.tmp");
    let io = |what: &str, e: std::io::Error| CheckpointError::Io {
        path: tmp.clone(),
        what: format!("{what}: {e}"),
    };
    let mut header = serde_json::Map::new();
    header.insert(METADATA.into(), serde_json::json!({ SAVE_KEY: save }));
    let mut at = 0usize;
    for e in entries {
        header.insert(
            e.name.clone(),
            serde_json::json!({"dtype": format!("{:?}", e.dtype), "shape": [e.numel], "data_offsets": [at, at + e.bytes]}),
        );
        at += e.bytes;
    }
    let mut text = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap_or_default();
    // The data starts 8-aligned, as the format's writers keep it.
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let written = (|| {
        let mut f =
            std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp).map_err(|e| io("creating", e))?);
        f.write_all(&(text.len() as u64).to_le_bytes())
            .and_then(|()| f.write_all(&text))
            .map_err(|e| io("writing", e))?;
        for i in 0..entries.len() {
            fill(i, &mut f)?;
        }
        let f = f.into_inner().map_err(|e| io("writing", e.into_error()))?;
        f.sync_all().map_err(|e| io("syncing", e))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| io("renaming into place", e))
}

/// The safetensors header's metadata entry, and the key of the save that wrote a file in it.
const METADATA: &str = "__metadata__";
const SAVE_KEY: &str = "collsched.save";

#[derive(Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

/// One data file opened for reading: its header, and the file to read ranges from.
pub(crate) struct Reader {
    path: PathBuf,
    file: File,
    /// Start of the data section.
    base: u64,
    tensors: HashMap<String, HeaderEntry>,
    /// The save that wrote it (its metadata's `collsched.save`), if it says.
    save: Option<String>,
}

/// The largest header a file may have (as the format's reference reader allows).
const MAX_HEADER: u64 = 100_000_000;

impl Reader {
    /// Opens `path` and reads its header (checked against the file's length).
    pub(crate) fn open(path: &Path) -> Result<Reader, CheckpointError> {
        let bad = |what: String| CheckpointError::Corrupt { path: path.to_path_buf(), what };
        let mut file = File::open(path)
            .map_err(|e| CheckpointError::Io { path: path.to_path_buf(), what: format!("opening: {e}") })?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(|_| bad("shorter than a header".into()))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || n + 8 > len {
            return Err(bad(format!("header of {n} bytes in a file of {len} bytes (truncated?)")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(|e| bad(format!("reading the header: {e}")))?;
        let mut tensors: HashMap<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
        let save = tensors
            .remove(METADATA)
            .and_then(|m| m.get(SAVE_KEY).and_then(|v| v.as_str()).map(str::to_string));
        let tensors: HashMap<String, HeaderEntry> = tensors
            .into_iter()
            .map(|(k, v)| serde_json::from_value(v).map(|e| (k, e)))
            .collect::<Result<_, _>>()
            .map_err(|e| bad(format!("header entry: {e}")))?;
        let base = 8 + n;
        for (name, e) in &tensors {
            let [a, b] = e.data_offsets;
            // (Checked: offsets come from the file, and a wrapped sum would pass.)
            if a > b || u64::try_from(b).ok().and_then(|b| b.checked_add(base)).is_none_or(|end| end > len) {
                return Err(bad(format!(
                    "tensor {name}: bytes {a}..{b} beyond the file's {} (truncated?)",
                    len - base
                )));
            }
        }
        Ok(Reader { path: path.to_path_buf(), file, base, tensors, save })
    }

    /// Opens `path` as a file of the save `index_save` (its index's; empty: not checked).
    ///
    /// # Errors
    /// As [`Reader::open`]; [`CheckpointError::Corrupt`] for a file another save wrote.
    pub(crate) fn open_of(path: &Path, index_save: &str) -> Result<Reader, CheckpointError> {
        let r = Reader::open(path)?;
        if !index_save.is_empty() && r.save.as_deref() != Some(index_save) {
            return Err(CheckpointError::Corrupt {
                path: path.to_path_buf(),
                what: format!(
                    "written by save {}, the index by save {index_save}: the checkpoint was replaced while it \
                     was read (load again), or files of two checkpoints were mixed",
                    r.save.as_deref().unwrap_or("(none)")
                ),
            });
        }
        Ok(r)
    }

    /// Reads elements `from..from + out.len() / size` of 1-D tensor `name` (of `dtype`, whose
    /// elements are `size` bytes, and `numel` elements, as the index says) into `out`.
    pub(crate) fn read(
        &self,
        name: &str,
        (dtype, size): (Dtype, usize),
        numel: usize,
        from: usize,
        out: &mut [u8],
    ) -> Result<(), CheckpointError> {
        let e = self.entry(name, dtype, size, numel)?;
        let bad = |what: String| CheckpointError::Corrupt { path: self.path.clone(), what };
        let at = self.base + (e.data_offsets[0] + from * size) as u64;
        self.file.read_exact_at(out, at).map_err(|err| bad(format!("reading tensor {name}: {err}")))
    }

    /// Checks that 1-D tensor `name` is there as the index says (`dtype` of `size`-byte
    /// elements, `numel` of them), without reading it.
    pub(crate) fn check(
        &self,
        name: &str,
        (dtype, size): (Dtype, usize),
        numel: usize,
    ) -> Result<(), CheckpointError> {
        self.entry(name, dtype, size, numel).map(|_| ())
    }

    fn entry(
        &self,
        name: &str,
        dtype: Dtype,
        size: usize,
        numel: usize,
    ) -> Result<&HeaderEntry, CheckpointError> {
        let bad = |what: String| CheckpointError::Corrupt { path: self.path.clone(), what };
        let e =
            self.tensors.get(name).ok_or_else(|| bad(format!("no tensor {name} (the index names it)")))?;
        if e.dtype != format!("{dtype:?}")
            || e.shape != [numel]
            || numel.checked_mul(size) != Some(e.data_offsets[1] - e.data_offsets[0])
        {
            return Err(bad(format!(
                "tensor {name} is {} {:?}, the index says {dtype:?} [{numel}]",
                e.dtype, e.shape
            )));
        }
        Ok(e)
    }
}
