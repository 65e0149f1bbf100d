//! The `mpi` backend (feature `mpi`): ranks as the processes of an MPI job (`mpirun`), on one
//! machine or many, collectives through MPI (rsmpi over Open MPI).
//!
//! A rank of this backend is a [`LocalRank`], like the `shm` backend's: the same stream threads
//! (ordered queues), events, pool with deferred frees, launch checks, flight recorder and
//! `launch_then`. What differs is where the members meet (`place.rs`): on one MPI communicator
//! per (group, stream), made on first use, where each collective is first agreed on (a
//! mismatch, a member that failed or never comes is an error naming them, never an MPI hang)
//! and then moved by non-blocking MPI collectives, with every reduction done by the library's
//! kernels (bit for bit the other backends' results). Buffers come from the process heap.
//!
//! MPI runs at `MPI_THREAD_MULTIPLE` (each stream thread calls it); a job that initialized MPI
//! itself at a lower level is refused with a message saying so. Errors are returned
//! (`MPI_ERRORS_RETURN` on every communicator made here), named by MPI call, collective and
//! rank, with MPI's error string.
//!
//! ```no_run
//! use collsched::backend::mpi::{join, MpiConfig};
//! use collsched::backend::Backend;
//! // Under `mpirun -np 2 ...`:
//! let (rank, job) = join(&MpiConfig::from_env()?)?;
//! assert_eq!(rank.world_size(), job.world());
//! drop(rank); // the rank first: its streams finish, then the job closes MPI
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A process that dies: peers on the same machine see it at once (its pid, exchanged at
//! [`join`]); elsewhere they wait out the timeout. Open MPI's `mpirun` itself ends the whole job
//! when a process exits abnormally (its default), usually after the survivors reported but
//! not always (its abort and their report race); `mpirun --mca orte_enable_recovery 1` lets
//! the survivors finish and report (a rank whose job did not break then waits in
//! `MPI_Finalize` for peers that left without it: the job must end such a rank itself).
//!
//! # Knobs
//! | variable | default | meaning |
//! |---|---|---|
//! | `COLLSCHED_TIMEOUT_SECS` | 300 | [`LocalConfig::timeout`]: how long a member waits for the others' headers, and for a collective's transfers |

mod ffi;
mod place;

use std::sync::Arc;

use place::{Job, MpiMeeting};

use super::local::{LocalConfig, LocalRank, LocalWorld};
use super::{BackendError, CollectiveKind};
use crate::bootstrap::{EnvError, Liveness};

/// Knobs of the mpi backend.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MpiConfig {
    /// Stream threads, timeouts and the flight recorder, as for the local backend (spinning and
    /// reduction pieces do not apply).
    pub local: LocalConfig,
}

impl MpiConfig {
    /// The defaults, with `COLLSCHED_TIMEOUT_SECS` applied, and spinning waits as
    /// [`MpiConfig::from_lookup`] decides.
    ///
    /// # Errors
    /// [`EnvError`] for a malformed value.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`MpiConfig::from_env`], reading through `lookup`.
    ///
    /// Spinning (`local.spin`): a thread that waits for a collective by spinning takes a core
    /// from the stream threads that move the data (MPI moves a transfer only while they test
    /// it). So waits spin ([`LocalConfig::spin`]'s default) only when this machine has a core for
    /// the waiting and the working thread of each of its processes (`2 x
    /// OMPI_COMM_WORLD_LOCAL_SIZE <= cores`), else they sleep at once. `COLLSCHED_SPIN_US` sets
    /// it (microseconds, 0: never spin). Measured at 2 ranks on 2 cores: a 1 MiB all-gather
    /// takes 110 us without spinning, 130-145 with (benches/README.md).
    ///
    /// # Errors
    /// [`EnvError`] for a malformed value.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let mut c = MpiConfig::default();
        if let Some(t) = super::shm::timeout_from_lookup(&lookup)? {
            c.local.timeout = t;
        }
        let local =
            lookup("OMPI_COMM_WORLD_LOCAL_SIZE").and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(1);
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        if 2 * local > cores {
            c.local.spin = std::time::Duration::ZERO;
        }
        if let Some(s) = super::shm::spin_from_lookup(&lookup)? {
            c.local.spin = s;
        }
        Ok(c)
    }
}

/// This process's part of an MPI job: MPI itself (finalized when dropped, if [`join`]
/// initialized it) and a communicator for the caller's small exchanges. Drop it after the
/// rank, on the thread that called [`join`].
pub struct MpiJob {
    job: Arc<Job>,
    control: Option<ffi::Comm>,
    rank: usize,
    world: usize,
    /// How long a control exchange or barrier waits for the other ranks (the backend's
    /// timeout, `COLLSCHED_TIMEOUT_SECS`).
    timeout: std::time::Duration,
    /// Set when [`join`] initialized MPI: dropping it finalizes MPI.
    universe: Option<mpi::environment::Universe>,
}

impl std::fmt::Debug for MpiJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiJob")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("initialized_mpi", &self.universe.is_some())
            .finish()
    }
}

impl MpiJob {
    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Processes in the job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Every rank's `mine` (any length), in rank order: a blocking exchange for small things
    /// (a bench's rows, an agreement), collective over the job.
    ///
    /// # Errors
    /// [`BackendError::Device`] naming the MPI call that failed.
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BackendError> {
        let control = self.control()?;
        let err = |e| self.control_failed(e);
        let lens =
            control.all_gather_blocking(&(mine.len() as u64).to_le_bytes(), self.timeout).map_err(err)?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()) as usize)
            .collect();
        let width = lens.iter().copied().max().unwrap_or(0);
        let mut padded = mine.to_vec();
        padded.resize(width, 0);
        let all = control.all_gather_blocking(&padded, self.timeout).map_err(err)?;
        Ok(lens.iter().enumerate().map(|(r, &len)| all[r * width..r * width + len].to_vec()).collect())
    }

    /// MPI's own `op` on f32 (sum) over the job, timed for comparison: `bytes` is the whole
    /// buffer (an all-gather's output, a reduce-scatter's input, an all-reduce's buffer), run
    /// `warmup` times untimed then `iters` times; returns the slowest rank's seconds per call
    /// (every rank gets the same). Collective over the job.
    ///
    /// # Errors
    /// [`BackendError::Device`] naming the MPI call that failed.
    pub fn time_reference(
        &self,
        op: CollectiveKind,
        bytes: usize,
        warmup: usize,
        iters: usize,
    ) -> Result<f64, BackendError> {
        let control = self.control()?;
        let err = |e| self.control_failed(e);
        let n = self.world;
        let whole = bytes / 4;
        let (send, recv) = match op {
            CollectiveKind::AllGather => (whole / n, whole / n * n),
            CollectiveKind::ReduceScatter => (whole / n * n, whole / n),
            CollectiveKind::AllReduce | CollectiveKind::Broadcast => (whole, whole),
        };
        let input: Vec<f32> = (0..send).map(|i| (i % 251) as f32).collect();
        let mut output = vec![0f32; recv];
        for _ in 0..warmup {
            control.reference_f32(op, &input, &mut output).map_err(err)?;
        }
        control.barrier(self.timeout).map_err(err)?;
        let t = std::time::Instant::now();
        for _ in 0..iters.max(1) {
            control.reference_f32(op, &input, &mut output).map_err(err)?;
        }
        let mine = t.elapsed().as_secs_f64() / iters.max(1) as f64;
        let all = self.all_gather_bytes(&mine.to_le_bytes())?;
        Ok(all
            .iter()
            .filter_map(|b| b.as_slice().try_into().ok().map(f64::from_le_bytes))
            .fold(0.0, f64::max))
    }

    /// A blocking barrier over the job.
    ///
    /// # Errors
    /// [`BackendError::Device`] naming the MPI call that failed.
    pub fn barrier(&self) -> Result<(), BackendError> {
        self.control()?.barrier(self.timeout).map_err(|e| self.control_failed(e))
    }

    /// The error of a failed call on the control communicator, which breaks the job: a request
    /// of it may still be pending (a rank that never came), so MPI is not finalized.
    fn control_failed(&self, e: ffi::MpiError) -> BackendError {
        let err = BackendError::Device { rank: self.rank, api: e.api, detail: e.text };
        self.job.set_broken(err.to_string());
        err
    }

    fn control(&self) -> Result<&ffi::Comm, BackendError> {
        self.control
            .as_ref()
            .ok_or_else(|| BackendError::Shutdown { rank: self.rank, what: "the MPI job is closed".into() })
    }
}

impl crate::backend::Exchange for MpiJob {
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, BackendError> {
        MpiJob::all_gather_bytes(self, mine)
    }
}

impl Drop for MpiJob {
    fn drop(&mut self) {
        // No collective runs after this (running ones end first); communicators are left to
        // MPI_Finalize (freeing one is collective over its members, in no agreed order here).
        self.job.close();
        self.control = None;
        // Then MPI_Finalize, if this process's join initialized MPI; not in a broken job:
        // requests still pending (a stalled or dead peer) could keep it waiting for ever. The
        // process then ends without finalizing, which mpirun reports as the job's failure.
        if let Some(why) = self.job.broken() {
            tracing::warn!(target: "collsched::coll", rank = self.rank, "MPI left unfinalized: {why}");
            std::mem::forget(self.universe.take());
        } else {
            drop(self.universe.take());
        }
    }
}

fn mpi_err(rank: usize) -> impl Fn(ffi::MpiError) -> BackendError {
    move |e| BackendError::Device { rank, api: e.api, detail: e.text }
}

/// This machine and pid namespace, so that peers can tell which ranks' pids they may watch.
fn host_key() -> u64 {
    let node = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let ns =
        std::fs::read_link("/proc/self/ns/pid").map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    (node + "/" + &ns)
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Joins the MPI job this process belongs to (collective: every process calls it): initializes
/// MPI at `MPI_THREAD_MULTIPLE` unless it already is (then it must be at that level), makes a
/// communicator per stream, and learns which peers share this machine. Returns this rank's
/// backend and the job handle; drop the rank first.
///
/// # Errors
/// [`BackendError::Unsupported`] when MPI cannot give `MPI_THREAD_MULTIPLE`;
/// [`BackendError::Device`] naming a failed MPI call.
pub fn join(config: &MpiConfig) -> Result<(LocalRank, MpiJob), BackendError> {
    let multiple = ffi::thread_multiple();
    let universe =
        match ffi::thread_level() {
            Some(level) if level == multiple => None,
            Some(level) => {
                return Err(BackendError::Unsupported {
                    what: format!(
                    "MPI was initialized at thread level {level}; the mpi backend needs MPI_THREAD_MULTIPLE \
                     ({multiple}): initialize MPI with it (or let collsched initialize MPI)"
                ),
                })
            }
            None => {
                let (universe, provided) = mpi::initialize_with_threading(mpi::Threading::Multiple)
                    .ok_or_else(|| BackendError::Unsupported {
                        what: "MPI could not be initialized (was it finalized already in this process?)"
                            .into(),
                    })?;
                if provided != mpi::Threading::Multiple {
                    return Err(BackendError::Unsupported {
                        what: format!(
                        "this MPI provides {provided:?} threading, the mpi backend needs MPI_THREAD_MULTIPLE \
                         (Open MPI: built with thread support, as Debian's is)"
                    ),
                    });
                }
                Some(universe)
            }
        };
    let control = ffi::Comm::world_dup().map_err(mpi_err(0))?;
    let rank = control.rank().map_err(mpi_err(0))?;
    let world = control.size().map_err(mpi_err(rank))?;
    let parents =
        (0..3).map(|_| ffi::Comm::world_dup()).collect::<Result<Vec<_>, _>>().map_err(mpi_err(rank))?;
    let mut mine = host_key().to_le_bytes().to_vec();
    mine.extend_from_slice(&u64::from(std::process::id()).to_le_bytes());
    let all = control.all_gather_blocking(&mine, config.local.timeout).map_err(mpi_err(rank))?;
    let pids: Vec<u32> = all
        .chunks_exact(16)
        .map(|c| {
            let same_host = c[..8] == mine[..8];
            let pid = u64::from_le_bytes(c[8..16].try_into().unwrap_or_default()) as u32;
            if same_host {
                pid
            } else {
                0
            }
        })
        .collect();
    let job = Arc::new(Job::new(world, parents, Liveness::new(rank, pids)));
    let meeting = MpiMeeting { job: Arc::clone(&job) };
    let local = LocalWorld::with_meeting(world, config.local.clone(), Box::new(meeting))?;
    let backend = local.rank_in(rank, None)?;
    let handle = MpiJob { job, control: Some(control), rank, world, timeout: config.local.timeout, universe };
    handle.barrier()?;
    Ok((backend, handle))
}
