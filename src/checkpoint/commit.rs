//! Putting a saved checkpoint in place: what a save may replace, the commit (the index, then two
//! renames), and finishing a commit that was interrupted between its renames.

use std::path::{Path, PathBuf};

use super::{io, sibling, CheckpointError, Index};

/// Whether a save may replace what is at `path`: nothing, an empty directory, or a checkpoint
/// (a directory with an index); anything else is refused, so that a save never moves aside
/// and removes a directory of other files.
pub(super) fn replaceable(path: &Path) -> Result<(), CheckpointError> {
    let refuse = |what: &str| {
        Err(CheckpointError::Io {
            path: path.to_path_buf(),
            what: format!(
                "{what}: a save replaces what is there, and this is not a checkpoint (no index.json); give \
                 another path, or move it away"
            ),
        })
    };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(path, "looking at the checkpoint's path")(e)),
        Ok(m) if m.file_type().is_symlink() => refuse("a symbolic link (give the directory it points to)"),
        Ok(m) if !m.is_dir() => refuse("a file"),
        Ok(_) if path.join("index.json").is_file() => Ok(()),
        Ok(_) => match std::fs::read_dir(path).map(|mut d| d.next().is_none()) {
            Ok(true) => Ok(()),
            Ok(false) => refuse("a directory of other files"),
            Err(e) => Err(io(path, "listing")(e)),
        },
    }
}

/// `PATH.partial` when it holds a whole checkpoint (its index is written last) and nothing is
/// at `PATH`: a commit stopped between its two renames.
pub(super) fn stopped_commit(path: &Path) -> Option<PathBuf> {
    let partial = sibling(path, ".partial");
    (!path.exists() && partial.join("index.json").is_file()).then_some(partial)
}

/// A commit interrupted between its two renames (the previous checkpoint moved aside, the new
/// one not yet in place) is finished: `PATH.partial` holds a whole checkpoint once its index is
/// there (written last), so it goes to `PATH` and `PATH.previous` is removed. Nothing happens
/// otherwise. A save's rank 0 calls it (loads read `PATH.partial` instead, see `resolve`).
pub(super) fn finish_commit(path: &Path) -> Result<(), CheckpointError> {
    let Some(partial) = stopped_commit(path) else { return Ok(()) };
    if let Err(e) = std::fs::rename(&partial, path) {
        if !path.join("index.json").is_file() {
            return Err(io(path, "finishing an interrupted commit (renaming PATH.partial into place)")(e));
        }
    }
    tracing::warn!(target: "collsched::checkpoint", "{}: finished a commit that was interrupted", path.display());
    let _ = std::fs::remove_dir_all(sibling(path, ".previous"));
    Ok(())
}

/// Rank 0: the index into the partial directory, then the directory into place.
pub(super) fn commit(path: &Path, partial: &Path, index: &Index) -> Result<(), CheckpointError> {
    let tmp = partial.join("index.json.tmp");
    let text = serde_json::to_vec_pretty(index)
        .map_err(|e| CheckpointError::Io { path: tmp.clone(), what: e.to_string() })?;
    std::fs::write(&tmp, text).map_err(io(&tmp, "writing"))?;
    std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(io(&tmp, "syncing"))?;
    std::fs::rename(&tmp, partial.join("index.json"))
        .map_err(io(partial, "renaming the index into place"))?;
    std::fs::File::open(partial).and_then(|d| d.sync_all()).map_err(io(partial, "syncing"))?;
    let previous = sibling(path, ".previous");
    let aside = path.exists();
    if aside {
        let _ = std::fs::remove_dir_all(&previous);
        std::fs::rename(path, &previous).map_err(io(path, "moving the previous checkpoint aside"))?;
    }
    if let Err(e) = std::fs::rename(partial, path) {
        // The previous checkpoint goes back where it was (the failed save's directory is then
        // removed as any failed save's is).
        let back = if aside { std::fs::rename(&previous, path).err() } else { None };
        let what = match back {
            None => "renaming the new checkpoint into place".to_string(),
            Some(b) => format!(
                "renaming the new checkpoint into place, and the previous one back from PATH.previous \
                 ({b}); the new one is whole in PATH.partial, which the next save or load puts in place"
            ),
        };
        return Err(io(path, &what)(e));
    }
    // The renames reach the disk with the parent directory (a power loss would undo them); the
    // checkpoint is in place either way, so a failure here is only said.
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if let Err(e) = std::fs::File::open(parent).and_then(|d| d.sync_all()) {
        tracing::warn!(target: "collsched::checkpoint", "{}: syncing the renames: {e}", parent.display());
    }
    if aside {
        // The new checkpoint is in place: a previous one that cannot be removed is only left over.
        if let Err(e) = std::fs::remove_dir_all(&previous) {
            tracing::warn!(target: "collsched::checkpoint", "{}: {e}; remove it by hand", previous.display());
        }
    }
    Ok(())
}
