//! [`save_full`]: the full parameters in one safetensors file, for export.

use std::io::Write;
use std::path::Path;

use super::{agree, file, io, sibling, CheckpointError};
use crate::backend::Backend;
use crate::runtime::ModelState;

/// Writes every parameter's full value to one safetensors file at `path` (a plain
/// `safetensors` load gives the unsharded model's parameters by name), gathering one bucket at
/// a time so that the extra memory is one bucket (collective: every rank calls it, between
/// steps; rank 0 writes, through a temporary name renamed into place).
///
/// # Errors
/// [`CheckpointError::Io`] naming the file rank 0 could not write (every rank reports it);
/// runtime errors of the gathers.
pub fn save_full<B: Backend>(state: &ModelState<B>, path: &Path) -> Result<(), CheckpointError> {
    let plan = state.plan();
    let layout = plan.layout();
    let set = layout.params();
    // The header first: every parameter in bucket order, so the data streams out bucket by bucket.
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for b in layout.gather_buckets() {
        for &p in b.params() {
            let spec = &set.specs()[p.index()];
            let len = set.numel(p) * spec.dtype.size();
            let dtype = file::st_dtype(spec.dtype.name()).map(|d| format!("{d:?}")).unwrap_or_default();
            header.insert(
                spec.name.clone(),
                serde_json::json!({"dtype": dtype, "shape": spec.shape.to_vec(), "data_offsets": [at, at + len]}),
            );
            at += len;
        }
    }
    let mut text = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap_or_default();
    // The data starts 8-aligned, as the format's writers keep it.
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let tmp = sibling(path, ".tmp");
    let mut out = if state.rank() == 0 {
        let f = std::fs::File::create(&tmp).map_err(io(&tmp, "creating"));
        let f = f.and_then(|mut f| {
            f.write_all(&(text.len() as u64).to_le_bytes())
                .and_then(|()| f.write_all(&text))
                .map_err(io(&tmp, "writing"))?;
            Ok(std::io::BufWriter::new(f))
        });
        Some(f)
    } else {
        None
    };
    let gathered = gather_into(state, &mut out, &tmp);
    if gathered.is_err() && out.is_some() {
        // A gather failed (a peer gone): no file of it stays behind.
        let _ = std::fs::remove_file(&tmp);
    }
    gathered?;
    let written = match out {
        Some(Ok(w)) => w
            .into_inner()
            .map_err(|e| io(&tmp, "writing")(e.into_error()))
            .and_then(|f| f.sync_all().map_err(io(&tmp, "syncing")))
            .and_then(|()| std::fs::rename(&tmp, path).map_err(io(path, "renaming into place"))),
        Some(Err(e)) => Err(e),
        None => Ok(()),
    };
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    agree(state, written, "save_full: writing", "no file was written")
}

/// Gathers every bucket in turn, rank 0 writing each parameter's full value to `out` (a
/// failed write is kept in `out`, the gathers go on so that the ranks stay in step).
fn gather_into<B: Backend>(
    state: &ModelState<B>,
    out: &mut Option<Result<std::io::BufWriter<std::fs::File>, CheckpointError>>,
    tmp: &Path,
) -> Result<(), CheckpointError> {
    let layout = state.plan().layout();
    let set = layout.params();
    let mut c = state.coordinator(collsched_schedule::SchedulerConfig {
        policy: collsched_schedule::PolicyKind::None,
        ..Default::default()
    })?;
    for b in layout.gather_buckets() {
        let ids = b.params().to_vec();
        {
            let views = c.fetch(&ids)?;
            if let Some(Ok(w)) = out.as_mut() {
                for &p in &ids {
                    let mut host = vec![0u8; set.numel(p) * set.specs()[p.index()].dtype.size()];
                    views.copy_to_host(p, &mut host)?;
                    if let Err(e) = w.write_all(&host) {
                        *out = Some(Err(io(tmp, "writing")(e)));
                        break;
                    }
                }
            }
        }
        c.release(&ids)?;
        c.end_step()?;
    }
    Ok(())
}
