//! The flight recorder: every rank keeps its last collectives in a fixed ring, so that when a
//! job fails or hangs each rank can say what it launched, what ran and what did not, and
//! `collsched flight DIR` can put the ranks' records side by side ([`verdict`]).
//!
//! An entry is made when a collective (a group launch) is launched, with its sequence number on
//! its (group, stream) (the number it meets its peers by); the stream thread marks it started
//! when it reaches it, and completed or failed when it is done. The ring is allocated once: a
//! steady-state launch allocates nothing (an entry holds the collective's description, whose
//! group is shared, not copied); only a failure's message is a new string.
//!
//! # Knobs
//! | variable | default | meaning |
//! |---|---|---|
//! | `COLLSCHED_FLIGHT_ENTRIES` | 2000 | collectives each rank keeps ([`FlightConfig::entries`]; 0 records nothing) |
//! | `COLLSCHED_FLIGHT_RECORDER` | unset | a directory: on a collective's failure (a mismatch, a dead or late peer, a failed kernel) each rank writes its record there as `rank-R.json` ([`FlightConfig::dir`]) |
//!
//! The record can also be taken at any time ([`FlightRecorder::dump`]; in Python,
//! `collsched.torch.flight_record()`).

pub mod trace;
pub mod verdict;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::{BackendError, CollDesc, RankGroup, Stream};
use collsched_kernels::ReduceOp;

/// Default of [`FlightConfig::entries`].
pub const DEFAULT_ENTRIES: usize = 2000;

/// Knobs of the flight recorder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlightConfig {
    /// Collectives each rank keeps (the last ones); 0 turns the recorder off. Default
    /// [`DEFAULT_ENTRIES`], `COLLSCHED_FLIGHT_ENTRIES`.
    pub entries: usize,
    /// Where each rank writes its record (`rank-R.json`) when a collective fails; `None`: it
    /// does not. Default `COLLSCHED_FLIGHT_RECORDER`, else `None`.
    pub dir: Option<PathBuf>,
}

impl Default for FlightConfig {
    fn default() -> Self {
        FlightConfig { entries: DEFAULT_ENTRIES, dir: None }
    }
}

impl FlightConfig {
    /// The defaults with `COLLSCHED_FLIGHT_ENTRIES` and `COLLSCHED_FLIGHT_RECORDER` applied (a
    /// malformed entry count keeps the default and says so in the log).
    pub fn from_env() -> Self {
        let mut c = FlightConfig::default();
        if let Ok(v) = std::env::var("COLLSCHED_FLIGHT_ENTRIES") {
            match v.trim().parse::<usize>() {
                Ok(n) if n <= 1 << 24 => c.entries = n,
                _ => tracing::warn!(
                    target: "collsched::coll",
                    "COLLSCHED_FLIGHT_ENTRIES={v:?} is not a count up to 16777216; keeping {DEFAULT_ENTRIES}"
                ),
            }
        }
        c.dir = std::env::var_os("COLLSCHED_FLIGHT_RECORDER").filter(|d| !d.is_empty()).map(PathBuf::from);
        c
    }
}

/// Where a recorded collective got to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FlightState {
    /// Launched; its stream has not reached it.
    Launched,
    /// Its stream reached it: waiting for its peers, or moving data.
    Started,
    /// Done.
    Completed,
    /// Failed (see the entry's error).
    Failed,
}

/// One recorded collective (a group launch, described by its first collective).
#[derive(Clone, Debug)]
struct Entry {
    id: u64,
    seq: u64,
    stream: Stream,
    desc: CollDesc,
    ops: usize,
    bytes: usize,
    state: FlightState,
    launched_ns: u64,
    started_ns: u64,
    ended_ns: u64,
    error: Option<(String, &'static str, bool)>,
}

struct Ring {
    /// Entries by `id % capacity`, filled up to `capacity` once.
    entries: Vec<Entry>,
    /// The id the next launch gets.
    next_id: u64,
    /// The next sequence number of each (group, stream), as the stream threads count them.
    next_seq: HashMap<(RankGroup, Stream), u64>,
}

/// One rank's flight recorder (cheap to share between its launching thread and its streams).
pub struct FlightRecorder {
    rank: usize,
    world: usize,
    config: FlightConfig,
    ring: Mutex<Ring>,
}

impl std::fmt::Debug for FlightRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlightRecorder").field("rank", &self.rank).field("config", &self.config).finish()
    }
}

/// The flight records' clock: nanoseconds since the Unix epoch (0 before it), the time base of
/// every entry's and [`ComputeSpan`]'s times.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl FlightRecorder {
    /// The recorder of rank `rank` of `world`.
    pub fn new(rank: usize, world: usize, config: FlightConfig) -> Self {
        let ring = Ring { entries: Vec::with_capacity(config.entries), next_id: 0, next_seq: HashMap::new() };
        FlightRecorder { rank, world, config, ring: Mutex::new(ring) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a launch of `ops` collectives moving `bytes` (this rank's outputs), described
    /// by `first`, on `stream`; returns its id for the stream's updates. Call in launch order.
    pub fn launched(&self, stream: Stream, first: &CollDesc, ops: usize, bytes: usize) -> u64 {
        let cap = self.config.entries;
        let mut ring = self.lock();
        let id = ring.next_id;
        ring.next_id += 1;
        let seq = match ring.next_seq.get_mut(&(first.group.clone(), stream)) {
            Some(s) => {
                *s += 1;
                *s - 1
            }
            None => {
                ring.next_seq.insert((first.group.clone(), stream), 1);
                0
            }
        };
        if cap == 0 {
            return id;
        }
        let entry = Entry {
            id,
            seq,
            stream,
            desc: first.clone(),
            ops,
            bytes,
            state: FlightState::Launched,
            launched_ns: now_ns(),
            started_ns: 0,
            ended_ns: 0,
            error: None,
        };
        let slot = (id % cap as u64) as usize;
        if slot < ring.entries.len() {
            ring.entries[slot] = entry;
        } else {
            ring.entries.push(entry);
        }
        id
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut Entry)) {
        let cap = self.config.entries;
        if cap == 0 {
            return;
        }
        let mut ring = self.lock();
        if let Some(e) = ring.entries.get_mut((id % cap as u64) as usize).filter(|e| e.id == id) {
            f(e);
        }
    }

    /// The stream reached launch `id`.
    pub fn started(&self, id: u64) {
        self.update(id, |e| {
            e.state = FlightState::Started;
            e.started_ns = now_ns();
        });
    }

    /// Launch `id` is done, with `result`. A failure writes the record to
    /// [`FlightConfig::dir`] when one is set.
    pub fn ended(&self, id: u64, result: &Result<(), BackendError>) {
        let now = now_ns();
        self.update(id, |e| {
            e.ended_ns = now;
            match result {
                Ok(()) => e.state = FlightState::Completed,
                Err(err) => {
                    e.state = FlightState::Failed;
                    e.error = Some((err.to_string(), err.kind(), err.is_peers()));
                }
            }
        });
        if let Err(err) = result {
            self.write_if_configured(&err.to_string());
        }
    }

    /// Writes the record, taken because of `reason`, to [`FlightConfig::dir`] if one is set
    /// (what a failure does; an engine calls it when a wait of its own times out). Returns the
    /// file written.
    pub fn write_if_configured(&self, reason: &str) -> Option<PathBuf> {
        let dir = self.config.dir.as_ref()?;
        match self.dump(reason).write_to(dir) {
            Ok(path) => Some(path),
            Err(io) => {
                tracing::warn!(target: "collsched::coll", rank = self.rank, "flight recorder: {io}");
                None
            }
        }
    }

    /// The record as it is now, oldest first; `reason` says why it was taken.
    pub fn dump(&self, reason: &str) -> FlightDump {
        let ring = self.lock();
        let mut entries: Vec<&Entry> = ring.entries.iter().collect();
        entries.sort_by_key(|e| e.id);
        FlightDump {
            rank: self.rank,
            world: self.world,
            pid: std::process::id(),
            reason: reason.to_string(),
            dumped_ns: now_ns(),
            capacity: self.config.entries,
            dropped: ring.next_id.saturating_sub(ring.entries.len() as u64),
            entries: entries.into_iter().map(FlightEntry::from).collect(),
            compute: Vec::new(),
        }
    }
}

/// One collective of a [`FlightDump`] (the JSON record's entries).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlightEntry {
    /// This rank's launch count when it was launched.
    pub id: u64,
    /// Its sequence number on its (group, stream): the number its peers meet it by.
    pub seq: u64,
    /// The stream (`all_gather`, `reduce_scatter`, `compute`).
    pub stream: String,
    /// The collective (`all_gather`, `reduce_scatter`, `all_reduce`, `broadcast`; the first of
    /// a group launch).
    pub op: String,
    /// Its tag (the bucket).
    pub tag: u64,
    /// The group's ranks.
    pub group: Vec<usize>,
    /// Elements (per member for all-gather input and reduce-scatter output).
    pub count: usize,
    /// Element type.
    pub dtype: String,
    /// Reduction (`sum`, `avg`), for reductions.
    pub reduce: Option<String>,
    /// A broadcast's root.
    pub root: Option<usize>,
    /// Collectives in the group launch.
    pub ops: usize,
    /// Bytes of this rank's outputs.
    pub bytes: usize,
    /// Where it got to.
    pub state: FlightState,
    /// When it was launched, reached by its stream and done (nanoseconds since the Unix
    /// epoch; 0: not yet).
    pub launched_ns: u64,
    /// See `launched_ns`.
    pub started_ns: u64,
    /// See `launched_ns`.
    pub ended_ns: u64,
    /// The failure, if it failed.
    pub error: Option<String>,
    /// The failure's kind (`BackendError::kind`: `"Kernel"`, `"PeerTimeout"`, ...).
    #[serde(default)]
    pub error_kind: Option<String>,
    /// Whether it failed because of another rank (a peer dead, late or failed before it).
    #[serde(default)]
    pub peers_fault: bool,
    /// The runtime engine that launched it (its [`Origin`](crate::backend::Origin)'s number);
    /// none for a collective launched outside an engine (a benchmark's, a plan agreement's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<u32>,
    /// That engine's step it belongs to (0-based), beside `engine`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
}

impl FlightEntry {
    /// What every member must agree on, as text (op, tag, count, dtype, reduction, root, ops).
    pub fn what(&self) -> String {
        let mut s = format!("{}(tag {}, {} x {}", self.op, self.tag, self.count, self.dtype);
        if let Some(r) = &self.reduce {
            s.push_str(", ");
            s.push_str(r);
        }
        if let Some(r) = self.root {
            s.push_str(&format!(", root {r}"));
        }
        s.push(')');
        if self.ops > 1 {
            s.push_str(&format!(" + {} more", self.ops - 1));
        }
        s
    }
}

impl From<&Entry> for FlightEntry {
    fn from(e: &Entry) -> Self {
        let d = &e.desc;
        FlightEntry {
            id: e.id,
            seq: e.seq,
            stream: e.stream.name().to_string(),
            op: d.kind.name().to_string(),
            tag: d.tag,
            group: d.group.ranks().to_vec(),
            count: d.count,
            dtype: d.elem.name().to_string(),
            reduce: d.kind.reduces().then(|| {
                match d.op {
                    ReduceOp::Sum => "sum",
                    ReduceOp::Avg => "avg",
                }
                .to_string()
            }),
            root: (d.kind == super::CollectiveKind::Broadcast).then_some(d.root),
            ops: e.ops,
            bytes: e.bytes,
            state: e.state,
            launched_ns: e.launched_ns,
            started_ns: e.started_ns,
            ended_ns: e.ended_ns,
            error: e.error.as_ref().map(|x| x.0.clone()),
            error_kind: e.error.as_ref().map(|x| x.1.to_string()),
            peers_fault: e.error.as_ref().is_some_and(|x| x.2),
            engine: d.origin.map(|o| o.engine),
            step: d.origin.map(|o| o.step),
        }
    }
}

/// One rank's record, as written to `rank-R.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlightDump {
    /// The rank.
    pub rank: usize,
    /// Ranks in its world.
    pub world: usize,
    /// Its process.
    pub pid: u32,
    /// Why the record was taken (the failure, or the caller's words).
    pub reason: String,
    /// When (nanoseconds since the Unix epoch).
    pub dumped_ns: u64,
    /// Entries the ring holds.
    pub capacity: usize,
    /// Older entries no longer held.
    pub dropped: u64,
    /// The entries, oldest first.
    pub entries: Vec<FlightEntry>,
    /// The compute its caller recorded beside the collectives (the demo's layer arithmetic
    /// with `--flight-out`), oldest first; none in a record of a failure.
    #[serde(default)]
    pub compute: Vec<ComputeSpan>,
}

/// A span of compute on a rank (a layer's forward or backward), on the clock of [`now_ns`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComputeSpan {
    /// What it computed: `"forward L"` or `"backward L"` for layer `L`.
    pub name: String,
    /// The training step it belongs to (0-based).
    #[serde(default)]
    pub step: u64,
    /// When it began (nanoseconds since the Unix epoch).
    pub start_ns: u64,
    /// When it ended.
    pub end_ns: u64,
}

impl FlightDump {
    /// Puts `spans` (oldest first) on the record's compute track, those of them that end before
    /// its oldest collective left out where its ring dropped entries (the compute of steps
    /// whose collectives it no longer holds).
    pub fn set_compute(&mut self, mut spans: Vec<ComputeSpan>) {
        if self.dropped > 0 {
            let oldest = self.entries.iter().map(|e| e.launched_ns).filter(|&t| t > 0).min().unwrap_or(0);
            spans.retain(|c| c.end_ns >= oldest);
        }
        self.compute = spans;
    }

    /// Writes the record to `dir/rank-R.json` (through a temporary file renamed into place, so
    /// a reader never sees half a record); creates `dir` if needed. Returns the file's path.
    ///
    /// # Errors
    /// The file system's, naming the path.
    pub fn write_to(&self, dir: &Path) -> std::io::Result<PathBuf> {
        let named =
            |e: std::io::Error, p: &Path| std::io::Error::new(e.kind(), format!("{}: {e}", p.display()));
        std::fs::create_dir_all(dir).map_err(|e| named(e, dir))?;
        let path = dir.join(format!("rank-{}.json", self.rank));
        let tmp = dir.join(format!(".rank-{}.json.{}.tmp", self.rank, self.pid));
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, text).map_err(|e| named(e, &tmp))?;
        std::fs::rename(&tmp, &path).map_err(|e| named(e, &path))?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests;
