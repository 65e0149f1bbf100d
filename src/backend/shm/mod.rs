//! The `shm` backend: ranks as separate processes on one machine (one process per rank, as
//! torchrun and mpirun start them), at the local backend's speed.
//!
//! A rank of this backend is a [`LocalRank`]: the same stream threads, events, pool, launch
//! checks and data movement as the local backend. Two things differ:
//! - **buffers** come from the rank's arena, a memory file every process of the job maps
//!   (`arena.rs`, `segment.rs`), so peers read and write them in place;
//! - **members meet** in a control block in shared memory (`place.rs`) instead of under a
//!   mutex, and a peer that is gone is seen through its process (a pidfd) or its shared
//!   "departed" flag.
//!
//! ```no_run
//! use collsched::backend::shm::{join, ShmConfig};
//! use collsched::backend::Backend;
//! use collsched::bootstrap::LaunchEnv;
//! // Under `torchrun --nproc-per-node 2 ...` or `mpirun -np 2 ...`:
//! let (rank, _hub) = join(&LaunchEnv::from_env()?, &ShmConfig::from_env()?)?;
//! assert_eq!(rank.world_size(), 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Nothing is left behind: every segment is an anonymous memory file (no name in `/dev/shm`
//! or anywhere), gone when the last process holding it ends, whatever way it ends.
//!
//! # Knobs
//! | variable | default | meaning |
//! |---|---|---|
//! | `COLLSCHED_SHM_ARENA_BYTES` | the machine's memory ([`default_arena_bytes`]) | address space of each rank's buffer arena (sparse: memory is used as buffers are) |
//! | `COLLSCHED_TIMEOUT_SECS` | 300 | [`LocalConfig::timeout`]: how long a member waits for the others |
//! | `COLLSCHED_SPIN_US` | 50 | [`LocalConfig::spin`]: how long a waiter (a collective's member, a host wait on an event) spins before it sleeps; 0: never |
//! | see [`crate::bootstrap`] | | how the processes meet |

mod arena;
mod layout;
mod place;
mod segment;

use std::sync::Arc;
use std::time::Duration;

use arena::Arena;
use place::ShmMeeting;
use segment::Segment;

use super::local::{LocalConfig, LocalRank, LocalWorld};
use super::BackendError;
use crate::bootstrap::{EnvError, Hub, HubConfig, LaunchEnv, Liveness};

pub use layout::{CHANNELS, MAX_OPS};

/// Knobs of the shm backend.
#[derive(Clone, Debug, PartialEq)]
pub struct ShmConfig {
    /// Stream threads, spinning, timeouts and reduction pieces, as for the local backend.
    pub local: LocalConfig,
    /// Address space of each rank's buffer arena. Default [`default_arena_bytes`].
    pub arena_bytes: usize,
    /// How the processes meet.
    pub hub: HubConfig,
}

/// Default of [`ShmConfig::arena_bytes`]: the machine's physical memory (each rank could use it
/// all; the arena is sparse, so only what buffers use is memory), at least 1 GiB.
pub fn default_arena_bytes() -> usize {
    let pages = rustix::param::page_size();
    // sysconf(_SC_PHYS_PAGES) is not in rustix; /proc/meminfo is on every Linux.
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        })
        .map_or(16 << 30, |kb| kb.saturating_mul(1024));
    total.max(1 << 30).next_multiple_of(pages)
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            local: LocalConfig::default(),
            arena_bytes: default_arena_bytes(),
            hub: HubConfig::default(),
        }
    }
}

impl ShmConfig {
    /// The defaults, with `COLLSCHED_SHM_ARENA_BYTES`, `COLLSCHED_TIMEOUT_SECS`,
    /// `COLLSCHED_SPIN_US` and the bootstrap's knobs applied.
    ///
    /// # Errors
    /// [`EnvError`] for a malformed value.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`ShmConfig::from_env`], reading through `lookup`.
    ///
    /// # Errors
    /// [`EnvError`] for a malformed value.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let mut c = ShmConfig { hub: HubConfig::from_lookup(&lookup)?, ..ShmConfig::default() };
        if let Some(v) = lookup("COLLSCHED_SHM_ARENA_BYTES") {
            c.arena_bytes = crate::units::parse_size(&v).ok().filter(|&b| b >= 1 << 20).ok_or(EnvError {
                var: "COLLSCHED_SHM_ARENA_BYTES",
                value: v,
                what: "expected a size of at least 1M (e.g. 8G)".into(),
            })?;
        }
        if let Some(t) = timeout_from_lookup(&lookup)? {
            c.local.timeout = t;
        }
        if let Some(s) = spin_from_lookup(&lookup)? {
            c.local.spin = s;
        }
        Ok(c)
    }
}

/// `COLLSCHED_SPIN_US` ([`LocalConfig::spin`] of the multi-process backends: microseconds a
/// waiter spins before it sleeps, 0 for never), if set.
///
/// # Errors
/// [`EnvError`] for a value that is not a number of microseconds from 0 to 1000000.
pub(crate) fn spin_from_lookup(
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<Option<Duration>, EnvError> {
    let ok = |us: f64| (0.0..=1e6).contains(&us);
    duration_from_lookup(lookup, "COLLSCHED_SPIN_US", 1e-6, ok, "expected microseconds from 0 to 1000000")
}

/// `COLLSCHED_TIMEOUT_SECS` ([`LocalConfig::timeout`] of the multi-process backends), if set.
///
/// # Errors
/// [`EnvError`] for a value that is not a positive number of seconds.
pub(crate) fn timeout_from_lookup(
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<Option<Duration>, EnvError> {
    let ok = |s: f64| s > 0.0 && s <= 1e7;
    duration_from_lookup(lookup, "COLLSCHED_TIMEOUT_SECS", 1.0, ok, "expected seconds")
}

/// Variable `var`, a number of units of `unit` seconds that `ok` accepts, if set.
fn duration_from_lookup(
    lookup: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    unit: f64,
    ok: impl Fn(f64) -> bool,
    what: &str,
) -> Result<Option<Duration>, EnvError> {
    let Some(v) = lookup(var) else { return Ok(None) };
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|&x| x.is_finite() && ok(x))
        .map(|x| Some(Duration::from_secs_f64(x * unit)))
        .ok_or(EnvError { var, value: v, what: what.into() })
}

fn io(rank: usize, what: &str) -> impl FnOnce(std::io::Error) -> BackendError + '_ {
    move |e| BackendError::OutOfMemory { rank, bytes: 0, what: format!("{what}: {e}") }
}

/// Joins the job `env` describes as its rank (collective: every process of the job calls it):
/// meets the other processes, maps every rank's arena and the shared control block. Returns
/// this rank's backend, and the hub (for the caller's own small exchanges; dropping it is
/// fine).
///
/// # Errors
/// [`BackendError::Bootstrap`] when the processes cannot meet (a rank that never starts is
/// named, after [`HubConfig::timeout`]); [`BackendError::OutOfMemory`] when a segment cannot be
/// created or mapped.
pub fn join(env: &LaunchEnv, config: &ShmConfig) -> Result<(LocalRank, Hub), BackendError> {
    let rank = env.rank;
    let world = env.world;
    let mut hub = Hub::connect(env, &config.hub)?;
    let arena_bytes = config.arena_bytes.next_multiple_of(rustix::param::page_size());
    let own = Segment::create(&format!("collsched-arena-r{rank}"), arena_bytes)
        .map_err(io(rank, "creating the shared-memory arena (COLLSCHED_SHM_ARENA_BYTES)"))?;
    let fds = hub.all_gather_fds(own.fd())?;
    let mut maps = Vec::with_capacity(world);
    for (r, fd) in fds.into_iter().enumerate() {
        if r == rank {
            drop(fd);
            continue;
        }
        maps.push((r, Segment::map(fd).map_err(io(rank, "mapping a peer's arena"))?));
    }
    let mut ordered: Vec<Option<Segment>> = (0..world).map(|_| None).collect();
    ordered[rank] = Some(own);
    for (r, s) in maps {
        ordered[r] = Some(s);
    }
    let maps: Vec<Segment> = ordered.into_iter().flatten().collect();
    let arena = Arc::new(Arena::new(rank, maps));
    // The control block: rank 0 creates and initialises it, everyone maps rank 0's.
    let mine = match rank {
        0 => {
            let c = Segment::create("collsched-control", layout::Layout::new(world).bytes())
                .map_err(io(rank, "creating the shared control block"))?;
            ShmMeeting::init(&c, world);
            Some(c)
        }
        _ => None,
    };
    // Only rank 0's descriptor matters; the others send their arena's to fill their turn.
    let fds = hub.all_gather_fds(mine.as_ref().map_or_else(|| arena.own_fd(), Segment::fd))?;
    let control = match mine {
        Some(c) => c,
        None => {
            let fd = fds.into_iter().next().ok_or_else(|| BackendError::Internal {
                what: format!("rank {rank}: no control block from rank 0"),
            })?;
            Segment::map(fd).map_err(io(rank, "mapping the shared control block"))?
        }
    };
    if !ShmMeeting::check(&control, world) {
        return Err(BackendError::Internal {
            what: format!(
                "rank {rank}: rank 0's control block is not one of this collsched for world {world}"
            ),
        });
    }
    let liveness = Liveness::new(rank, hub.liveness().pids().to_vec());
    let meeting = ShmMeeting::new(control, world, Arc::clone(&arena), liveness);
    let local = LocalWorld::with_meeting(world, config.local.clone(), Box::new(meeting))?;
    let backend = local.rank_in(rank, Some(arena))?;
    hub.barrier()?;
    Ok((backend, hub))
}
