//! The data files: safetensors written with the `safetensors` crate, read piece by piece
//! (each rank reads only the byte ranges it needs).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, View};
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

/// A 1-D tensor to write: borrowed bytes.
pub(crate) struct Piece<'a> {
    pub(crate) dtype: Dtype,
    pub(crate) shape: [usize; 1],
    pub(crate) data: &'a [u8],
}

impl View for &Piece<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes `pieces` to `path` (through a temporary name, synced, then renamed).
pub(crate) fn write(path: &Path, pieces: &[(String, Piece<'_>)]) -> Result<(), CheckpointError> {
    let tmp = path.with_extension("safetensors.tmp");
    let io = |what: &str, e: std::io::Error| CheckpointError::Io {
        path: tmp.clone(),
        what: format!("{what}: {e}"),
    };
    safetensors::serialize_to_file(pieces.iter().map(|(n, p)| (n.as_str(), p)), None, &tmp)
        .map_err(|e| CheckpointError::Io { path: tmp.clone(), what: format!("writing: {e}") })?;
    File::open(&tmp).and_then(|f| f.sync_all()).map_err(|e| io("syncing", e))?;
    std::fs::rename(&tmp, path).map_err(|e| io("renaming into place", e))
}

#[derive(Deserialize)]
struct Entry {
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
    tensors: HashMap<String, Entry>,
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
        tensors.remove("__metadata__");
        let tensors: HashMap<String, Entry> = tensors
            .into_iter()
            .map(|(k, v)| serde_json::from_value(v).map(|e| (k, e)))
            .collect::<Result<_, _>>()
            .map_err(|e| bad(format!("header entry: {e}")))?;
        let base = 8 + n;
        for (name, e) in &tensors {
            let [a, b] = e.data_offsets;
            if a > b || base + b as u64 > len {
                return Err(bad(format!(
                    "tensor {name}: bytes {a}..{b} beyond the file's {} (truncated?)",
                    len - base
                )));
            }
        }
        Ok(Reader { path: path.to_path_buf(), file, base, tensors })
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
        let bad = |what: String| CheckpointError::Corrupt { path: self.path.clone(), what };
        let e =
            self.tensors.get(name).ok_or_else(|| bad(format!("no tensor {name} (the index names it)")))?;
        if e.dtype != format!("{dtype:?}")
            || e.shape != [numel]
            || e.data_offsets[1] - e.data_offsets[0] != numel * size
        {
            return Err(bad(format!(
                "tensor {name} is {} {:?}, the index says {dtype:?} [{numel}]",
                e.dtype, e.shape
            )));
        }
        let at = self.base + (e.data_offsets[0] + from * size) as u64;
        self.file.read_exact_at(out, at).map_err(|err| bad(format!("reading tensor {name}: {err}")))
    }

    /// Every tensor's name and byte length, for `collsched ckpt inspect`.
    pub(crate) fn tensors(&self) -> impl Iterator<Item = (&str, usize)> {
        self.tensors.iter().map(|(k, e)| (k.as_str(), e.data_offsets[1] - e.data_offsets[0]))
    }
}
