//! Checkpoints of a sharded model: every rank saves its own shards, in safetensors, and any
//! layout loads them (another world size, strategy or bucket size).
//!
//! A checkpoint is a directory:
//! - `rank-R.safetensors`: the 1-D pieces rank R held (`name@offset`: the parameter's
//!   elements from `offset` on), each element saved once (replicas of hybrid sharding save
//!   nothing the first group holds);
//! - `index.json` ([`Index`]): world, strategy, fingerprint, step, and for every parameter its
//!   shape, dtype and pieces. Written last. The save's id is in it and in every data file's
//!   metadata: a file of another save (read while the checkpoint is replaced, or copied in
//!   from another checkpoint of the same layout) is refused as damage.
//!
//! [`save`] is collective: the files go to `PATH.partial`, rank 0 writes the index there and
//! renames the directory to `PATH` (the previous checkpoint at `PATH` is replaced only then),
//! so a save that dies midway leaves the previous checkpoint whole and no index in the new one.
//! Ranks agree after each stage through a small all-gather: a rank that fails is named by all,
//! one that never calls makes the others fail after the backend's timeout, naming it.
//! [`load`] reads only the ranges this rank's shards need, straight into them, after checking
//! the index against the model (names, shapes, dtypes) and every file's header against the
//! index, and after every rank agreed that its checks passed: a checkpoint that does not fit or
//! is damaged changes nothing anywhere (only a read that fails after those checks, a disk
//! error, leaves that rank's shards partly loaded; the error names the file, and every rank
//! fails, so that none goes on with the checkpoint's values while another does not).
//!
//! A save replaces only a checkpoint, an empty directory or nothing (never a directory of
//! other files). A commit interrupted between its two renames (the previous checkpoint moved to
//! `PATH.previous`, the whole new one still at `PATH.partial`) is read from `PATH.partial` by
//! loads and finished by the next save of `PATH` (rank 0 renames; readers never do).

mod commit;
mod file;
mod full;
mod index;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use collsched_buckets::ParamId;
use collsched_schedule::{BufferRole, Plan};

pub use full::save_full;
pub use index::{tensor_name, Index, IndexParam, Piece, FORMAT};

use crate::backend::Backend;
use crate::runtime::{ModelState, RuntimeError};
use commit::{commit, finish_commit, replaceable, stopped_commit};

/// An error of a checkpoint: names the path, parameter, rank or stage, and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A file could not be read or written.
    #[error("{}: {what}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What failed.
        what: String,
    },
    /// A file is not what the index says (truncated, corrupted, another checkpoint's).
    #[error("{}: {what}; the checkpoint is damaged: load another one", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// No index: the save that made the directory did not finish.
    #[error(
        "{}: no index.json: not a checkpoint, or a save that did not finish{}",
        path.display(),
        if previous.is_some() {
            " (a commit stopped after moving the previous checkpoint aside: it is whole at PATH.previous)"
        } else {
            " (a save replaces a checkpoint only once its own is whole: the previous one, if any, is where it was)"
        }
    )]
    Incomplete {
        /// The directory.
        path: PathBuf,
        /// A previous checkpoint left beside it by an interrupted commit.
        previous: Option<PathBuf>,
    },
    /// The checkpoint's parameters are not the model's.
    #[error("the checkpoint at {} does not fit this model: {}; nothing was loaded", path.display(), what.join("; "))]
    Mismatch {
        /// The directory.
        path: PathBuf,
        /// Every difference, one per parameter.
        what: Vec<String>,
    },
    /// Other ranks failed at a stage (this rank's part succeeded).
    #[error("rank {rank}: checkpoint {stage}: ranks {failed:?} failed (their own errors name the cause); {outcome}")]
    Peers {
        /// This rank.
        rank: usize,
        /// The stage (`save: writing`, `load: reading`, ...).
        stage: &'static str,
        /// The ranks that failed.
        failed: Vec<usize>,
        /// What was left (`nothing was loaded`, `no index was written`, ...).
        outcome: &'static str,
    },
    /// The runtime failed (a collective of the agreement, a shard access).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

/// The pieces each rank saves: its runs of every parameter, each element once (the first rank
/// holding a run saves it), by rank.
fn pieces(plan: &Plan) -> Vec<Vec<(ParamId, usize, usize)>> {
    let layout = plan.layout();
    let mut seen = HashSet::new();
    (0..layout.world())
        .map(|r| {
            let mut mine = Vec::new();
            for b in layout.gather_buckets() {
                let Some(op) = plan.gather_op(b.id()) else { continue };
                for run in plan.runs(op, r, BufferRole::Shard) {
                    if run.numel > 0 && seen.insert((run.param, run.param_offset)) {
                        mine.push((run.param, run.param_offset, run.numel));
                    }
                }
            }
            mine
        })
        .collect()
}

fn file_name(rank: usize) -> String {
    format!("rank-{rank}.safetensors")
}

fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(suffix);
    path.with_file_name(name)
}

fn io(path: &Path, what: &str) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    let what = what.to_string();
    move |e| CheckpointError::Io { path, what: format!("{what}: {e}") }
}

/// Every rank's outcome of a stage, after which this rank's own error (if any) comes first,
/// then the others' failures.
fn agree<B: Backend, T>(
    state: &ModelState<B>,
    mine: Result<T, CheckpointError>,
    stage: &'static str,
    outcome: &'static str,
) -> Result<T, CheckpointError> {
    let all = state.all_gather_words(&[u64::from(mine.is_err())], "checkpoint agreement");
    let value = mine?;
    let failed: Vec<usize> = all?.iter().enumerate().filter(|(_, &w)| w != 0).map(|(r, _)| r).collect();
    if failed.is_empty() {
        Ok(value)
    } else {
        Err(CheckpointError::Peers { rank: state.rank(), stage, failed, outcome })
    }
}

/// A per-parameter state this rank saves beside its shard of the parameter (an optimizer's
/// moment): `data` holds the state of exactly this rank's elements of `param`, in `dtype`.
#[derive(Clone, Debug)]
pub struct ExtraState {
    /// The state's name (`exp_avg`); saved as `param#name`.
    pub name: String,
    /// The parameter it belongs to.
    pub param: ParamId,
    /// Its element type.
    pub dtype: collsched_buckets::DType,
    /// Its bytes: one element per element of this rank's run of the parameter.
    pub data: Vec<u8>,
}

/// Saves the model's shards to the directory `path` (collective: every rank calls it, with
/// nothing gathered). Returns the index written. [`save_with`] also saves per-parameter
/// states and the caller's metadata.
///
/// # Errors
/// [`CheckpointError::Io`] naming the file this rank could not write; [`CheckpointError::Peers`]
/// naming the ranks that failed; a runtime error when the ranks cannot agree (a rank that never
/// calls makes the others fail after the backend's timeout, naming it); `path` holding
/// something else than a checkpoint (or an empty directory) is refused. A failed save leaves
/// `path` as it was (the previous checkpoint, if any), and rank 0 removes `PATH.partial`, but
/// for a whole one with nothing at `PATH` (its last rename failed: loads read it there, the
/// next save puts it in place).
pub fn save<B: Backend>(state: &ModelState<B>, path: &Path, step: u64) -> Result<Index, CheckpointError> {
    save_with(state, path, step, &[], serde_json::Value::Null)
}

/// [`save`], with this rank's per-parameter states (`extras`: each rank gives the states of its
/// own elements; a state only some ranks have covers only their elements) and `meta` (kept as
/// given by rank 0, in the index).
///
/// # Errors
/// As [`save`]; [`CheckpointError::Mismatch`] for a state whose size is not this rank's
/// elements of its parameter.
pub fn save_with<B: Backend>(
    state: &ModelState<B>,
    path: &Path,
    step: u64,
    extras: &[ExtraState],
    meta: serde_json::Value,
) -> Result<Index, CheckpointError> {
    let me = state.rank();
    let partial = sibling(path, ".partial");
    let prepared = if me == 0 {
        finish_commit(path).and_then(|()| replaceable(path)).and_then(|()| {
            match std::fs::remove_dir_all(&partial) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(io(&partial, "removing a stale partial save")(e))
                }
                _ => std::fs::create_dir_all(&partial).map_err(io(&partial, "creating")),
            }
        })
    } else {
        Ok(())
    };
    let saved = agree(state, prepared, "save: preparing the directory", "nothing was written")
        .and_then(|()| save_stages(state, path, &partial, step, extras, meta));
    // Nothing of a failed save stays on disk (the ranks agreed it failed, or one is gone), but
    // for a whole checkpoint in PATH.partial with none at PATH (a commit interrupted between
    // its renames), which the next save or load puts in place.
    if saved.is_err() && me == 0 && stopped_commit(path).is_none() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    saved
}

/// [`save_with`] once the partial directory exists: every rank's file, the index, the commit.
fn save_stages<B: Backend>(
    state: &ModelState<B>,
    path: &Path,
    partial: &Path,
    step: u64,
    extras: &[ExtraState],
    meta: serde_json::Value,
) -> Result<Index, CheckpointError> {
    let me = state.rank();
    let plan = state.plan();
    let all = pieces(plan);
    // The save's id, rank 0's, in every file and in the index.
    let mine = if me == 0 { save_id() } else { String::new() };
    let id = all_gather_bytes(state, mine.as_bytes())?.into_iter().next().unwrap_or_default();
    let id = String::from_utf8_lossy(&id).into_owned();
    let written = write_mine(state, partial, &id, &all[me], extras);
    let wrote = agree(
        state,
        written,
        "save: writing shards",
        "no index was written; the previous checkpoint is intact",
    )?;
    // Which states each rank wrote (rank 0 indexes them).
    let wrote = all_gather_bytes(state, &serde_json::to_vec(&wrote).unwrap_or_default())?;
    let wrote: Vec<Vec<(u32, String, String)>> =
        wrote.iter().map(|b| serde_json::from_slice(b).unwrap_or_default()).collect();
    // A state is one dtype on every rank (every rank sees the same lists: all fail alike).
    let mut dtypes: HashMap<(u32, &str), (&str, usize)> = HashMap::new();
    for (r, list) in wrote.iter().enumerate() {
        for (p, name, dtype) in list {
            let (first, by) = *dtypes.entry((*p, name)).or_insert((dtype, r));
            if first != dtype {
                let param = plan.layout().params().name(ParamId(*p)).to_string();
                return Err(CheckpointError::Mismatch {
                    path: path.to_path_buf(),
                    what: vec![format!(
                        "state {name:?} of parameter {param} is {first} on rank {by} and {dtype} on rank {r}: give it \
                         in one dtype on every rank"
                    )],
                });
            }
        }
    }
    let mut index = index_of(plan, &all, step, &wrote);
    index.meta = meta;
    index.save = id;
    let committed = if me == 0 { commit(path, partial, &index) } else { Ok(()) };
    agree(state, committed, "save: committing", "the previous checkpoint is intact")?;
    Ok(index)
}

/// An id for a save, unique on this machine and most likely beyond: the time, the process and
/// a count of this process's saves.
fn save_id() -> String {
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let n = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{:x}-{:x}-{n}", now.as_nanos(), std::process::id())
}

/// This rank's file: its pieces of the parameters and of their states. Returns the states
/// written, as (parameter index, state, dtype).
fn write_mine<B: Backend>(
    state: &ModelState<B>,
    dir: &Path,
    save: &str,
    mine: &[(ParamId, usize, usize)],
    extras: &[ExtraState],
) -> Result<Vec<(u32, String, String)>, CheckpointError> {
    let set = state.plan().layout().params();
    let mut entries = Vec::with_capacity(mine.len() + extras.len());
    // What each entry's bytes are: a parameter's run (read from the shard while writing) or a
    // state the caller gave.
    let mut sources: Vec<Result<ParamId, &[u8]>> = Vec::with_capacity(entries.capacity());
    let mut wrote = Vec::new();
    let st_of = |dtype: collsched_buckets::DType, what: &str| {
        file::st_dtype(dtype.name()).ok_or_else(|| CheckpointError::Io {
            path: dir.to_path_buf(),
            what: format!("{what}: dtype {} has no safetensors name", dtype.name()),
        })
    };
    for &(p, offset, numel) in mine {
        let dtype = set.specs()[p.index()].dtype;
        let bytes = numel * dtype.size();
        let (at, len) = state.read_shard(p, |at, b| (at, b.len()))?;
        if at != offset || len != bytes {
            return Err(RuntimeError::Internal {
                rank: state.rank(),
                what: format!(
                    "checkpoint: parameter {}: this rank's run is not the plan's piece at {offset}",
                    set.name(p)
                ),
            }
            .into());
        }
        let dtype = st_of(dtype, &format!("parameter {}", set.name(p)))?;
        entries.push(file::Entry { name: tensor_name(set.name(p), offset), dtype, numel, bytes });
        sources.push(Ok(p));
    }
    for e in extras {
        let Some(&(p, offset, numel)) = mine.iter().find(|m| m.0 == e.param) else {
            // Another rank saves these elements (a replica of hybrid sharding), or none exist.
            continue;
        };
        let name = set.name(p);
        if e.data.len() != numel * e.dtype.size() || e.name.is_empty() || e.name.contains(['#', '@']) {
            return Err(CheckpointError::Mismatch {
                path: dir.to_path_buf(),
                what: vec![format!(
                    "state {:?} of parameter {name}: {} bytes for this rank's {numel} elements of {} (give a name \
                     without '#' or '@', one element per element)",
                    e.name,
                    e.data.len(),
                    e.dtype
                )],
            });
        }
        if wrote.iter().any(|(q, n, _)| *q == p.0 && *n == e.name) {
            return Err(CheckpointError::Mismatch {
                path: dir.to_path_buf(),
                what: vec![format!(
                    "state {:?} of parameter {name} given twice: give each state once",
                    e.name
                )],
            });
        }
        let dtype = st_of(e.dtype, &format!("state {} of {name}", e.name))?;
        let tensor = tensor_name(&format!("{name}#{}", e.name), offset);
        entries.push(file::Entry { name: tensor, dtype, numel, bytes: e.data.len() });
        sources.push(Err(&e.data));
        wrote.push((p.0, e.name.clone(), e.dtype.name().to_string()));
    }
    if entries.is_empty() {
        return Ok(wrote);
    }
    let path = dir.join(file_name(state.rank()));
    let io_err =
        |e: std::io::Error| CheckpointError::Io { path: path.clone(), what: format!("writing: {e}") };
    file::write(&path, save, &entries, &mut |i, out| match sources[i] {
        Ok(p) => state.read_shard(p, |_, b| out.write_all(b))?.map_err(io_err),
        Err(bytes) => out.write_all(bytes).map_err(io_err),
    })?;
    Ok(wrote)
}

/// Every rank's `bytes` (any length), by rank.
fn all_gather_bytes<B: Backend>(
    state: &ModelState<B>,
    bytes: &[u8],
) -> Result<Vec<Vec<u8>>, CheckpointError> {
    let lens = state.all_gather_words(&[bytes.len() as u64], "checkpoint agreement")?;
    let words = lens.iter().map(|&l| (l as usize).div_ceil(8)).max().unwrap_or(0);
    let mut mine = vec![0u64; words];
    for (i, c) in bytes.chunks(8).enumerate() {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        mine[i] = u64::from_le_bytes(w);
    }
    let all = state.all_gather_words(&mine, "checkpoint agreement")?;
    Ok(lens
        .iter()
        .enumerate()
        .map(|(r, &l)| {
            let b: Vec<u8> = all[r * words..(r + 1) * words].iter().flat_map(|w| w.to_le_bytes()).collect();
            b[..(l as usize).min(b.len())].to_vec()
        })
        .collect())
}

fn index_of(
    plan: &Plan,
    all: &[Vec<(ParamId, usize, usize)>],
    step: u64,
    wrote: &[Vec<(u32, String, String)>],
) -> Index {
    let layout = plan.layout();
    let set = layout.params();
    let ranks: Vec<usize> = (0..all.len()).filter(|&r| !all[r].is_empty()).collect();
    let file_of: HashMap<usize, u32> = ranks.iter().enumerate().map(|(i, &r)| (r, i as u32)).collect();
    let mut by_param: Vec<Vec<Piece>> = vec![Vec::new(); set.len()];
    for (r, mine) in all.iter().enumerate() {
        for &(p, offset, numel) in mine {
            by_param[p.index()].push(Piece {
                file: file_of[&r],
                tensor: tensor_name(set.name(p), offset),
                offset,
                numel,
            });
        }
    }
    let params = set
        .ids()
        .zip(by_param)
        .map(|(p, mut pieces)| {
            pieces.sort_by_key(|x| x.offset);
            let spec = &set.specs()[p.index()];
            IndexParam {
                name: spec.name.clone(),
                shape: spec.shape.to_vec(),
                dtype: spec.dtype.name().to_string(),
                pieces,
            }
        })
        .collect();
    // States: (parameter, name) -> dtype and pieces, from the ranks that wrote them.
    let mut extras: std::collections::BTreeMap<(u32, String), (String, Vec<Piece>)> = Default::default();
    for (r, list) in wrote.iter().enumerate() {
        for (p, name, dtype) in list {
            let Some(&(_, offset, numel)) = all[r].iter().find(|m| m.0 .0 == *p) else { continue };
            let Some(&file) = file_of.get(&r) else { continue };
            let pname = set.name(ParamId(*p));
            let e = extras.entry((*p, name.clone())).or_insert_with(|| (dtype.clone(), Vec::new()));
            e.1.push(Piece { file, tensor: tensor_name(&format!("{pname}#{name}"), offset), offset, numel });
        }
    }
    let extras = extras
        .into_iter()
        .map(|((p, name), (dtype, mut pieces))| {
            pieces.sort_by_key(|x| x.offset);
            let spec = &set.specs()[p as usize];
            IndexParam { name: format!("{}#{name}", spec.name), shape: spec.shape.to_vec(), dtype, pieces }
        })
        .collect();
    Index {
        format: FORMAT.to_string(),
        world: layout.world(),
        strategy: layout.sharding().to_string(),
        fingerprint: plan.fingerprint().to_string(),
        step,
        files: ranks.iter().map(|&r| file_name(r)).collect(),
        params,
        extras,
        meta: serde_json::Value::Null,
        save: String::new(),
    }
}

/// The directory that holds the checkpoint at `path`: `path`, or `PATH.partial` while a commit
/// is stopped between its renames (no `PATH`, a whole checkpoint there: the next save puts it
/// in place). Readers never rename: a save of another job may be committing.
pub fn resolve(path: &Path) -> PathBuf {
    stopped_commit(path).unwrap_or_else(|| path.to_path_buf())
}

/// Reads and checks the index of the checkpoint at `path` (see [`resolve`]).
///
/// # Errors
/// [`CheckpointError::Incomplete`] without an index; [`CheckpointError::Corrupt`] for an index
/// that does not parse or whose pieces do not cover every element once.
pub fn read_index(path: &Path) -> Result<Index, CheckpointError> {
    let dir = resolve(path);
    let at = dir.join("index.json");
    let text = match std::fs::read(&at) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let previous = sibling(path, ".previous");
            return Err(CheckpointError::Incomplete {
                path: path.to_path_buf(),
                previous: previous.exists().then_some(previous),
            });
        }
        Err(e) => return Err(io(&at, "reading")(e)),
    };
    let index: Index = serde_json::from_slice(&text)
        .map_err(|e| CheckpointError::Corrupt { path: at.clone(), what: e.to_string() })?;
    index.check().map_err(|what| CheckpointError::Corrupt { path: at, what })?;
    Ok(index)
}

/// Loads the checkpoint at `path` into the model's shards, whatever layout saved it
/// (collective: every rank calls it, with nothing gathered). Returns its index.
///
/// # Errors
/// [`CheckpointError::Mismatch`] listing every parameter missing, extra, or of another shape or
/// dtype; [`CheckpointError::Incomplete`], [`CheckpointError::Corrupt`] naming the file;
/// [`CheckpointError::Peers`] when another rank could not read its part; a runtime error
/// while a bucket is gathered on some rank. Those errors come before any shard changes; a disk
/// error while reading after them leaves that rank's shards partly loaded (the error names the
/// file) and every other rank fails too ([`CheckpointError::Peers`]): load again.
pub fn load<B: Backend>(state: &ModelState<B>, path: &Path) -> Result<Index, CheckpointError> {
    load_with(state, path, &[]).map(|(index, _)| index)
}

/// A per-parameter state as [`load_with`] reads it: its dtype and this rank's elements.
pub type LoadedState = Option<(collsched_buckets::DType, Vec<u8>)>;

/// [`load`], also reading the states `wanted` (parameter, state name) for this rank's elements
/// of each parameter: `None` where the checkpoint does not hold the state for every one of
/// them (a state the saving ranks did not have).
///
/// # Errors
/// As [`load`].
pub fn load_with<B: Backend>(
    state: &ModelState<B>,
    path: &Path,
    wanted: &[(ParamId, String)],
) -> Result<(Index, Vec<LoadedState>), CheckpointError> {
    let mut slot = None;
    let dir = resolve(path);
    let path = dir.as_path();
    let checked = (|| {
        state.check_writable()?;
        let index = read_index(path)?;
        check_fits(state, path, &index)?;
        let checked = {
            let mut files = Files { dir: path, index: &index, readers: HashMap::new() };
            (check_mine(state, &mut files)?, read_states(state, &mut files, wanted)?)
        };
        slot = Some(index);
        Ok(checked)
    })();
    let (mine, extras) = agree(state, checked, "load: reading", "nothing was loaded")?;
    let index = slot.ok_or_else(|| RuntimeError::Internal {
        rank: state.rank(),
        what: "checkpoint load: the index vanished after it was checked".into(),
    })?;
    // Every file and piece was checked on every rank: read straight into the shards.
    let mut files = Files { dir: path, index: &index, readers: HashMap::new() };
    let saved: HashMap<&str, &IndexParam> = index.params.iter().map(|p| (p.name.as_str(), p)).collect();
    let set = state.plan().layout().params();
    let written = mine.into_iter().try_for_each(|(p, from, numel)| {
        let spec = &set.specs()[p.index()];
        let size = spec.dtype.size();
        state
            .write_shard(p, |_, dst| {
                files.fill(saved[spec.name.as_str()], from, from + numel, size, Some(dst))
            })?
            .map(drop)
    });
    // Every rank says whether it loaded all of its part: a rank whose read failed midway makes
    // every rank fail, not only itself (the others' shards are the checkpoint's, its own partly).
    agree(
        state,
        written,
        "load: writing shards",
        "the shards of the ranks that failed are partly loaded: load again on every rank",
    )?;
    Ok((index, extras))
}

/// The data files of a checkpoint, opened as pieces are read.
struct Files<'a> {
    dir: &'a Path,
    index: &'a Index,
    readers: HashMap<u32, file::Reader>,
}

impl Files<'_> {
    /// Elements `lo..hi` of `saved` (elements of `size` bytes), or `None` if its pieces do not
    /// hold them all.
    fn range(
        &mut self,
        saved: &IndexParam,
        lo: usize,
        hi: usize,
        size: usize,
    ) -> Result<Option<Vec<u8>>, CheckpointError> {
        let mut bytes = vec![0u8; (hi - lo) * size];
        let covered = self.fill(saved, lo, hi, size, Some(&mut bytes))?;
        Ok((covered == hi - lo).then_some(bytes))
    }

    /// Reads elements `lo..hi` of `saved` into `out` (or, without `out`, only checks that the
    /// files hold them as the index says); returns how many of them the pieces hold.
    fn fill(
        &mut self,
        saved: &IndexParam,
        lo: usize,
        hi: usize,
        size: usize,
        mut out: Option<&mut [u8]>,
    ) -> Result<usize, CheckpointError> {
        let st = file::st_dtype(&saved.dtype).ok_or_else(|| CheckpointError::Corrupt {
            path: self.dir.join("index.json"),
            what: format!("{}: unknown dtype {}", saved.name, saved.dtype),
        })?;
        let mut covered = 0;
        for piece in &saved.pieces {
            let (a, b) = (piece.offset.max(lo), (piece.offset + piece.numel).min(hi));
            if a >= b {
                continue;
            }
            let reader = match self.readers.entry(piece.file) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let at = self.dir.join(&self.index.files[piece.file as usize]);
                    e.insert(file::Reader::open_of(&at, &self.index.save)?)
                }
            };
            match out.as_deref_mut() {
                Some(out) => {
                    let dst = &mut out[(a - lo) * size..(b - lo) * size];
                    reader.read(&piece.tensor, (st, size), piece.numel, a - piece.offset, dst)?;
                }
                None => reader.check(&piece.tensor, (st, size), piece.numel)?,
            }
            covered += b - a;
        }
        Ok(covered)
    }
}

fn check_fits<B: Backend>(state: &ModelState<B>, path: &Path, index: &Index) -> Result<(), CheckpointError> {
    let set = state.plan().layout().params();
    let saved: HashMap<&str, &IndexParam> = index.params.iter().map(|p| (p.name.as_str(), p)).collect();
    let mut what = Vec::new();
    for p in set.ids() {
        let spec = &set.specs()[p.index()];
        match saved.get(spec.name.as_str()) {
            None => what.push(format!("parameter {} is not in the checkpoint", spec.name)),
            Some(s) if s.shape != spec.shape.to_vec() || s.dtype != spec.dtype.name() => what.push(format!(
                "parameter {}: the model has {:?} {}, the checkpoint {:?} {}",
                spec.name,
                spec.shape.to_vec(),
                spec.dtype.name(),
                s.shape,
                s.dtype
            )),
            Some(_) => {}
        }
    }
    let mine: HashSet<&str> = set.specs().iter().map(|s| s.name.as_str()).collect();
    for p in &index.params {
        if !mine.contains(p.name.as_str()) {
            what.push(format!("the checkpoint's parameter {} is not in the model", p.name));
        }
    }
    if what.is_empty() {
        Ok(())
    } else {
        Err(CheckpointError::Mismatch { path: path.to_path_buf(), what })
    }
}

/// This rank's run of every parameter (id, first element, elements), checked to be held by
/// the checkpoint's files as its index says.
fn check_mine<B: Backend>(
    state: &ModelState<B>,
    files: &mut Files<'_>,
) -> Result<Vec<(ParamId, usize, usize)>, CheckpointError> {
    let set = state.plan().layout().params();
    let saved: HashMap<&str, &IndexParam> = files.index.params.iter().map(|p| (p.name.as_str(), p)).collect();
    let mut out = Vec::new();
    for p in set.ids() {
        let spec = &set.specs()[p.index()];
        let (from, len) = state.read_shard(p, |at, b| (at, b.len()))?;
        let numel = len / spec.dtype.size();
        if numel == 0 {
            continue;
        }
        if files.fill(saved[spec.name.as_str()], from, from + numel, spec.dtype.size(), None)? != numel {
            return Err(CheckpointError::Corrupt {
                path: files.dir.join("index.json"),
                what: format!(
                    "parameter {}: its pieces do not hold elements {from}..{}",
                    spec.name,
                    from + numel
                ),
            });
        }
        out.push((p, from, numel));
    }
    Ok(out)
}

/// The states `wanted` of this rank's elements of their parameters.
fn read_states<B: Backend>(
    state: &ModelState<B>,
    files: &mut Files<'_>,
    wanted: &[(ParamId, String)],
) -> Result<Vec<LoadedState>, CheckpointError> {
    let set = state.plan().layout().params();
    let index = files.index;
    let mut out = Vec::with_capacity(wanted.len());
    for (p, name) in wanted {
        let Some(spec) = set.specs().get(p.index()) else {
            return Err(RuntimeError::Param {
                rank: state.rank(),
                param: None,
                what: format!("parameter id {p} is not in the plan"),
            }
            .into());
        };
        let full = format!("{}#{name}", spec.name);
        let Some(saved) = index.extras.iter().find(|e| e.name == full) else {
            out.push(None);
            continue;
        };
        let Ok(dtype) = saved.dtype.parse::<collsched_buckets::DType>() else {
            out.push(None);
            continue;
        };
        let (from, len) = state.read_shard(*p, |at, b| (at, b.len()))?;
        let numel = len / spec.dtype.size();
        out.push(files.range(saved, from, from + numel, dtype.size())?.map(|b| (dtype, b)));
    }
    Ok(out)
}

/// What `collsched ckpt inspect` checks: the index, and every piece it names (of the
/// parameters and of their states) present in its file with its dtype and size, as a load
/// checks them. Returns the index and the bytes of each file's pieces.
///
/// # Errors
/// As [`read_index`]; [`CheckpointError::Corrupt`] naming the file and tensor that is missing,
/// truncated or of another dtype or size.
pub fn inspect(path: &Path) -> Result<(Index, Vec<u64>), CheckpointError> {
    let dir = resolve(path);
    let path = dir.as_path();
    let index = read_index(path)?;
    let mut sizes = vec![0u64; index.files.len()];
    let readers: Vec<file::Reader> = index
        .files
        .iter()
        .map(|f| file::Reader::open_of(&path.join(f), &index.save))
        .collect::<Result<_, _>>()?;
    for p in index.params.iter().chain(&index.extras) {
        let dtype = p.dtype.parse::<collsched_buckets::DType>().ok();
        let st = dtype.and_then(|d| file::st_dtype(d.name()).map(|st| (st, d.size())));
        let Some(st) = st else {
            return Err(CheckpointError::Corrupt {
                path: path.join("index.json"),
                what: format!("{}: dtype {:?} is none a checkpoint holds", p.name, p.dtype),
            });
        };
        for piece in &p.pieces {
            let f = piece.file as usize;
            readers[f].check(&piece.tensor, st, piece.numel)?;
            sizes[f] += (piece.numel * st.1) as u64;
        }
    }
    Ok((index, sizes))
}
