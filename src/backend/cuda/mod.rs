//! The CUDA backend: NCCL on dedicated streams, NVRTC kernels, and raw pointers and streams
//! for engines that own their memory (feature `cuda`).
//!
//! One [`CudaBackend`] is one rank: a CUDA device, four streams (all-gather and reduce-scatter
//! at high priority, a copy stream, and the compute stream — the engine's, borrowed, or our
//! own), a device [`BufferPool`] with deferred frees, and one NCCL communicator per
//! (rank group, stream), so that collectives on different streams never wait for each other
//! and the k-th collective of a (group, stream) meets the k-th of every member, as the
//! [`Backend`] contract says.
//!
//! Layers (STYLE 5), bottom up: [`collsched_kernels::cuda::loader`] (dlopen without panics),
//! cudarc's `driver::result` (CUDA calls), [`nccl`] (our NCCL layer over `cudarc::nccl::sys`
//! types), [`comms`] (the communicators of a rank and their failures), [`wait`] (how the host
//! waits), [`device`] (device, streams, events), [`pool`] (device memory), the pinned staging of
//! kernel tables, then [`CudaBackend`].
//!
//! Without a GPU every constructor returns `no CUDA driver found: ...` (as
//! [`CudaError::Load`]); nothing panics. The backend's kernels (NVRTC compiles them, the driver
//! loads them) are loaded when it is built, so a missing or unfit NVRTC is the constructor's
//! error, and no launch compiles or loads anything (which could synchronize the context while
//! a stream is busy, or fail after a collective was numbered).
//!
//! # Semantics the CUDA backend adds to the trait's
//! - Rank groups other than the world are **declared at construction** ([`CudaConfig::groups`]):
//!   `ncclCommSplit` is collective over the world, so a sub-communicator cannot be made when a
//!   group first appears on some ranks only. A launch on an undeclared group is refused.
//! - A reduce-scatter or all-reduce with `pre_divide != 1` divides its **input in place** before
//!   the collective (FSDP does the same to its gradient buffer); the post-divide (and the `1/n`
//!   of an average) is applied to the output after it. Both use the same `f32` division as the
//!   CPU kernels; NCCL's sum itself runs in the element type in NCCL's order, so f16/bf16 sums
//!   differ from the CPU's f32-accumulated ones by rounding.
//! - [`Backend::launch_then`] (hybrid's all-reduce chained behind its reduce-scatter) is the
//!   trait's stream-ordered implementation: the second NCCL call is enqueued right behind the
//!   first on the same stream (its `cuStreamWaitEvent` on the first's event is already
//!   satisfied by stream order), and the first's other buffers go back to the pool with that
//!   event as their deferred-free fence; no host synchronization between them. Every rank
//!   enqueues the stages in the same order on one stream, so the two communicators cannot
//!   deadlock each other.
//! - Mismatched collectives across ranks cannot be detected by NCCL (they hang or corrupt):
//!   the plan fingerprint exchange above the backend is what guards against them; a hang ends
//!   with [`BackendError::EventTimeout`] on the host side.
//! - **Failures of NCCL** ([`comms`]): a host wait on an event of a collective (or of a stream
//!   with collectives) checks NCCL's asynchronous errors while it waits, so a dead peer ends it
//!   with an error naming the collective rather than at the timeout; that error and a wait that
//!   gave up after the backend's timeout (a peer's failure) abort every communicator of the
//!   rank, an NCCL call failing at launch its own (group, stream) (`ncclCommAbort`, each on a
//!   thread of its own: it can block until the device is idle), after which every collective
//!   on an aborted (group, stream) fails with [`BackendError::Aborted`].
//! - **Host copies are fenced**: [`Backend::read_to_host`] and [`Backend::write_from_host`]
//!   run on the copy stream after everything queued so far on the rank's other streams (a
//!   `cuStreamWaitEvent` of an event recorded on each), so a host read never sees a buffer a
//!   gather or the compute stream is still writing, and a write never overwrites one a queued
//!   gather still reads. The host waits for those events first, bounded by the backend's
//!   timeout and watching their communicators (a copy into pageable memory returns only once
//!   done, so enqueuing it behind a hung stream would block inside the driver without a
//!   bound), then for the copy; host copies run one at a time per rank, and a fence needs
//!   only its stream quiet, so they still run after a peer's failure. A copy that outlives
//!   the timeout wedges the device (below): the DMA may still reach the caller's memory.
//! - **Teardown is bounded**: dropping the backend waits for its streams at most the backend's
//!   timeout; if they have not drained by then (or NCCL reports a failure), it starts the abort
//!   of every communicator and waits [`wait::ABORT_GRACE`] more for the streams and the aborts.
//!   A device still busy after that (or after a host copy that timed out) is marked wedged:
//!   its memory, pinned staging, events and context are left to the process's exit instead of
//!   freed under running work. At the process's exit, with the driver already shut down, it
//!   calls nothing of NCCL's and leaks everything. Errors of the teardown, and of the
//!   resources dropped after it, are logged (`collsched::init`).
//!
//! # Embedding (an engine that owns memory and streams)
//! Compiled in CI, run only where a GPU is (`no_run`):
//! ```no_run
//! use collsched::backend::cuda::{CudaBackend, CudaBuffer, CudaConfig, RawStream, UniqueId};
//! use collsched::backend::{Backend, CollDesc, Collective, RankGroup, Stream};
//! use collsched::kernels::ElemType;
//! # fn engine() -> (u64, u64, u64, Vec<u8>) { (0, 0, 0, vec![0; 128]) }
//! // From the engine: its stream (`torch.cuda.current_stream().cuda_stream`), two tensors'
//! // `data_ptr()`s, and the NCCL id it exchanged itself (e.g. through torch.distributed).
//! let (stream, shard_ptr, full_ptr, id_bytes) = engine();
//! let id = UniqueId::from_bytes(&id_bytes)?;
//! // SAFETY: the stream belongs to device 0's primary context and outlives the backend.
//! let rank = unsafe { CudaBackend::with_compute_stream(CudaConfig::new(0, 1, 0), &id, stream as RawStream) }?;
//! let n = 1024;
//! // SAFETY: the engine keeps both tensors alive until the all-gather completed; we never free them.
//! let (shard, full) = unsafe { (CudaBuffer::from_raw(shard_ptr, n * 2), CudaBuffer::from_raw(full_ptr, n * 2)) };
//! let desc = CollDesc::all_gather(RankGroup::world(1), ElemType::BF16, n).with_tag(0);
//! let done = rank.launch(Stream::AllGather, &[], Collective { desc, input: Some(shard), output: full })
//!     .map_err(|e| e.error)?;
//! // The engine's stream waits for the all-gather; the host does not.
//! rank.wait_event(Stream::Compute, done.event())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Knobs
//! | variable | default | meaning |
//! |---|---|---|
//! | `COLLSCHED_CUDA_TIMEOUT_SECS` | 300 | [`Backend::timeout`] of a CUDA backend built from the environment |
//! | see [`collsched_kernels::cuda::loader`], [`rendezvous`] | | where the libraries are, the rendezvous |

pub mod comms;
pub mod device;
pub mod error;
mod events;
mod fences;
mod kernels;
mod launch;
pub mod nccl;
pub mod park;
pub mod pool;
pub mod rendezvous;
mod staging;
pub mod wait;
pub mod world;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use collsched_kernels::cuda::KernelModule;
use collsched_kernels::CopySegment;
use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;

pub use comms::CommTable;
pub use device::{device_count, CudaEvent, Device, StreamHandle, StreamRole};
pub use error::CudaError;
pub use nccl::{CallSite, Communicator, Group, NcclCallError, NcclError, NcclOp, UniqueId};
pub use park::ErrorPark;
pub use pool::{BufferPool, CudaBuffer, PoolStats};
pub use rendezvous::{FileRendezvous, RendezvousError};
pub use world::CudaWorld;

use super::{
    Backend, BackendBuffer, BackendError, Collective, InFlight, LaunchError, OnDrop, RankGroup, Stream,
};
use crate::bootstrap::{EnvError, LaunchEnv};
use comms::{Scope, Watch};
use staging::PinnedStaging;

/// A raw CUDA stream handle (`CUstream`, the same as the runtime's `cudaStream_t`).
pub type RawStream = cusys::CUstream;

/// Default of [`CudaConfig::timeout`] and `COLLSCHED_CUDA_TIMEOUT_SECS`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// How to build one rank of a CUDA world.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaConfig {
    /// This rank.
    pub rank: usize,
    /// Ranks in the world.
    pub world: usize,
    /// The CUDA device ordinal this rank uses (normally `LOCAL_RANK`).
    pub device: usize,
    /// Rank groups besides the world that collectives will use (hybrid sharding's shard and
    /// replica groups). Every rank passes the same list in the same order.
    pub groups: Vec<RankGroup>,
    /// [`Backend::timeout`]: how long host waits last before failing.
    pub timeout: Duration,
}

impl CudaConfig {
    /// Rank `rank` of `world` on device `device`, no extra groups, the default timeout.
    pub fn new(rank: usize, world: usize, device: usize) -> Self {
        CudaConfig { rank, world, device, groups: Vec::new(), timeout: DEFAULT_TIMEOUT }
    }
}

fn to_backend(rank: usize, e: CudaError) -> BackendError {
    match e {
        CudaError::Load(l) => BackendError::Unsupported {
            what: format!("rank {rank}: {l}; use the local backend on this machine"),
        },
        CudaError::Driver { context, source } => {
            BackendError::Device { rank, api: source.api, detail: format!("{context}: {source}") }
        }
        CudaError::Nccl(n) => {
            let api = if let NcclError::Call(c) = &*n { c.api } else { "NCCL" };
            BackendError::Device { rank, api, detail: n.to_string() }
        }
        // A copy segment refused before anything ran, as the trait's `pack` / `unpack` say.
        e @ CudaError::KernelInput { .. } => BackendError::OutOfRange { rank, what: e.to_string() },
        other => BackendError::Device { rank, api: "CUDA backend", detail: other.to_string() },
    }
}

impl CudaError {
    /// The [`BackendError`] a [`CudaBackend`] of `rank` reports for this error: a missing
    /// library becomes [`BackendError::Unsupported`] (with the loader's message), driver and
    /// NCCL failures [`BackendError::Device`] naming the API.
    pub fn into_backend(self, rank: usize) -> BackendError {
        to_backend(rank, self)
    }
}

impl BackendBuffer for CudaBuffer {
    fn len(&self) -> usize {
        CudaBuffer::len(self)
    }

    /// Its device address, which the pool hands out again ([`Backend::alloc_preferring`]).
    fn key(&self) -> usize {
        usize::try_from(self.ptr()).unwrap_or(0)
    }
}

/// One rank of a CUDA world. See the module docs.
pub struct CudaBackend {
    rank: usize,
    world: usize,
    timeout: Duration,
    device: Arc<Device>,
    /// Indexed by [`Stream::index`].
    streams: [Arc<StreamHandle>; 3],
    copy: Arc<StreamHandle>,
    pool: Arc<BufferPool>,
    staging: PinnedStaging,
    comms: Arc<CommTable>,
    park: ErrorPark,
    on_drop: OnDrop<CudaBackend>,
    /// Held by a host copy from its fences through its drain ([`CudaBackend::host_copy`]) and
    /// by a device copy on the copy stream: one at a time.
    host_copies: Mutex<()>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .field("pool", &self.pool)
            .finish()
    }
}

impl CudaBackend {
    /// Builds rank `config.rank`: opens the device, loads the kernels, creates the streams and
    /// the pool, joins the NCCL world named by `id` and splits one communicator per (group,
    /// stream). Every rank of the world calls this (concurrently: it blocks until all joined).
    ///
    /// # Errors
    /// `no CUDA driver found: ...` without a driver ([`CudaError::Load`]); no NVRTC (also
    /// [`CudaError::Load`], naming it) or kernels NVRTC cannot compile or the driver cannot
    /// load ([`CudaError::Invalid`], naming NVRTC); no NCCL, a bad device ordinal, a group that
    /// does not fit the world, an NCCL or driver failure.
    pub fn new(config: CudaConfig, id: &UniqueId) -> Result<Self, CudaError> {
        Self::build(config, id, None)
    }

    /// As [`CudaBackend::new`], with the engine's compute stream (e.g. PyTorch's current stream)
    /// as [`Stream::Compute`]; it is never destroyed by us.
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    ///
    /// # Safety
    /// `compute` is a live stream of the primary context of `config.device` and outlives the
    /// backend and every buffer allocated from it.
    pub unsafe fn with_compute_stream(
        config: CudaConfig,
        id: &UniqueId,
        compute: cusys::CUstream,
    ) -> Result<Self, CudaError> {
        Self::build(config, id, Some(compute))
    }

    /// Builds the rank a launcher describes ([`LaunchEnv`]: torchrun's `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK` as the device, or Open MPI's) with the given extra groups. Rank 0 creates
    /// NCCL's unique id and hands it out through the file `COLLSCHED_RENDEZVOUS_FILE` when set
    /// (jobs across machines), else through the bootstrap hub (one machine).
    ///
    /// # Errors
    /// [`CudaError::Bootstrap`] for a missing or malformed variable or a late rank 0; as
    /// [`CudaBackend::new`] otherwise.
    pub fn from_launch_env(groups: Vec<RankGroup>) -> Result<Self, CudaError> {
        let launch = LaunchEnv::from_env().map_err(RendezvousError::from)?;
        let lookup = |k: &str| std::env::var(k).ok();
        let timeout = match lookup("COLLSCHED_CUDA_TIMEOUT_SECS") {
            None => DEFAULT_TIMEOUT,
            Some(v) => v.trim().parse::<u64>().map(Duration::from_secs).map_err(|_| {
                RendezvousError::Env(EnvError {
                    var: "COLLSCHED_CUDA_TIMEOUT_SECS",
                    value: v.clone(),
                    what: "expected whole seconds, e.g. 300".into(),
                })
            })?,
        };
        // Fail on a missing driver before waiting for the rendezvous.
        device_count()?;
        let id = if lookup("COLLSCHED_RENDEZVOUS_FILE").is_some_and(|f| !f.is_empty()) {
            // Across machines: a file every rank sees.
            FileRendezvous::from_launch(&launch, lookup)?.exchange(launch.rank, UniqueId::generate)?
        } else {
            // One machine: the shared bootstrap's hub, as the shm backend meets.
            let config = crate::bootstrap::HubConfig::from_env().map_err(RendezvousError::from)?;
            let mut hub =
                crate::bootstrap::Hub::connect(&launch, &config).map_err(|e| CudaError::Invalid {
                    op: format!("rank {}: meeting the other processes", launch.rank),
                    what: e.to_string(),
                })?;
            let mine = if launch.rank == 0 { UniqueId::generate()?.0.to_vec() } else { Vec::new() };
            let all = hub.all_gather(&mine).map_err(|e| CudaError::Invalid {
                op: format!("rank {}: exchanging the NCCL unique id", launch.rank),
                what: e.to_string(),
            })?;
            UniqueId::from_bytes(all.first().map_or(&[][..], Vec::as_slice))?
        };
        let config =
            CudaConfig { rank: launch.rank, world: launch.world, device: launch.local_rank, groups, timeout };
        Self::new(config, &id)
    }

    fn build(config: CudaConfig, id: &UniqueId, compute: Option<cusys::CUstream>) -> Result<Self, CudaError> {
        let CudaConfig { rank, world, device, groups, timeout } = config;
        let invalid =
            |what: String| CudaError::Invalid { op: format!("rank {rank}: creating the CUDA backend"), what };
        if world == 0 || rank >= world {
            return Err(invalid(format!("rank {rank} is not in a world of {world} ranks")));
        }
        for g in &groups {
            if let Some(&r) = g.ranks().iter().find(|&&r| r >= world) {
                return Err(invalid(format!("group {g} names rank {r}, but the world has {world} ranks")));
            }
        }
        let park = ErrorPark::new();
        let device = Device::open(device, park.clone())?;
        // Before NCCL: a rank that cannot run its kernels fails before the others wait for it.
        device.load_kernels().map_err(|e| match e {
            CudaError::Load(l) => CudaError::Load(l),
            other => CudaError::Invalid {
                op: format!(
                    "rank {rank}: creating the CUDA backend: loading its kernels on device {} (sm_{})",
                    device.ordinal(),
                    device.arch()
                ),
                what: format!(
                    "{other}; NVRTC compiles them: point COLLSCHED_NVRTC_LIB (or COLLSCHED_CUDA_SEARCH) at \
                     an NVRTC no newer than the driver's CUDA version"
                ),
            },
        })?;
        let mk = |role| StreamHandle::new(&device, rank, role).map(Arc::new);
        let compute = match compute {
            // SAFETY: guaranteed by `with_compute_stream`'s caller.
            Some(raw) => Arc::new(unsafe { StreamHandle::borrowed(&device, rank, raw, StreamRole::Compute) }),
            None => mk(StreamRole::Compute)?,
        };
        let streams = [mk(StreamRole::AllGather)?, mk(StreamRole::ReduceScatter)?, compute];
        let copy = mk(StreamRole::Copy)?;
        let pool = BufferPool::new(Arc::clone(&device), timeout);
        let mut fences: Vec<Arc<StreamHandle>> = streams.to_vec();
        fences.push(Arc::clone(&copy));
        pool.set_fence_streams(fences);

        // One communicator per (group, stream), split from one world communicator; every rank
        // makes the same splits in the same order.
        let base = Communicator::init_rank(id, world, rank, park.clone())?;
        let mut all_groups = vec![RankGroup::world(world)];
        for g in groups {
            if !all_groups.contains(&g) {
                all_groups.push(g);
            }
        }
        let mut comms = HashMap::new();
        for (gi, g) in all_groups.iter().enumerate() {
            let color = g.position(rank).map(|_| gi as u32);
            for s in Stream::ALL {
                if let Some(c) = base.split(color, rank as u32)? {
                    comms.insert((g.clone(), s), c);
                }
            }
        }
        drop(base);
        let comms = Arc::new(CommTable::new(rank, comms, park.clone()));
        // Events recorded on a stream watch its communicators (the copy stream has none).
        for s in Stream::ALL {
            streams[s.index()].set_watch(Watch::new(&comms, Scope::streams(&[s]), timeout));
        }
        tracing::info!(target: "collsched::init", "CUDA backend rank {rank}/{world} on device {}: {} communicators", device.ordinal(), comms.len());

        let pool_for_drop = Arc::clone(&pool);
        let on_drop: OnDrop<CudaBackend> =
            Arc::new(move |ops: Vec<Collective<CudaBuffer>>, event: &CudaEvent| {
                for op in ops {
                    if let Some(input) = op.input {
                        pool_for_drop.free_after(input, std::slice::from_ref(event));
                    }
                    pool_for_drop.free_after(op.output, std::slice::from_ref(event));
                }
            });
        let staging = PinnedStaging::new(Arc::clone(&device));
        Ok(CudaBackend {
            rank,
            world,
            timeout,
            device,
            staging,
            streams,
            copy,
            pool,
            comms,
            park,
            on_drop,
            host_copies: Mutex::new(()),
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The pool (for statistics: [`BufferPool::fresh_allocations`], deferred blocks).
    pub fn pool(&self) -> &Arc<BufferPool> {
        &self.pool
    }

    /// How many pinned staging blocks the kernels' argument tables used so far (steady-state
    /// steps add none).
    pub fn staging_blocks(&self) -> u64 {
        self.staging.fresh_blocks()
    }

    /// Seconds one device-to-device copy of `bytes` bytes takes on this rank's device, the
    /// best of `iters` after one warm-up (`cuMemcpyDtoDAsync` on the copy stream, the host
    /// waiting for each): what `collsched bench --backend cuda` compares a collective with.
    ///
    /// # Errors
    /// An allocation, copy or wait failure, or a copy that outlasts the backend's timeout.
    pub fn device_copy_seconds(&self, bytes: usize, iters: usize) -> Result<f64, BackendError> {
        let mut best = f64::INFINITY;
        self.timed_copies(bytes, |copy| {
            for i in 0..=iters.max(1) {
                let t0 = std::time::Instant::now();
                copy(1, false)?;
                if i > 0 {
                    best = best.min(t0.elapsed().as_secs_f64());
                }
            }
            Ok(())
        })?;
        Ok(best)
    }

    /// Seconds per copy of `bytes` bytes on this rank's device when `iters` copies run back to
    /// back after `warmup` untimed ones, the host polling once, after the last, without a pause:
    /// what `collsched bench --op copy_in|copy_out` compares the copy kernels with, timed as
    /// they are.
    ///
    /// # Errors
    /// As [`CudaBackend::device_copy_seconds`].
    pub fn device_copies_seconds(
        &self,
        bytes: usize,
        warmup: usize,
        iters: usize,
    ) -> Result<f64, BackendError> {
        let mut seconds = f64::NAN;
        self.timed_copies(bytes, |copy| {
            copy(warmup.max(1), true)?;
            let t0 = std::time::Instant::now();
            copy(iters.max(1), true)?;
            seconds = t0.elapsed().as_secs_f64() / iters.max(1) as f64;
            Ok(())
        })?;
        Ok(seconds)
    }

    /// Runs `timing` with a call that queues `n` copies of `bytes` bytes between two buffers of
    /// this rank on the copy stream, then waits for them: a host wait, or with `spin` polling an
    /// event recorded after them without a pause (both bounded by the backend's timeout).
    fn timed_copies(
        &self,
        bytes: usize,
        timing: impl FnOnce(&mut dyn FnMut(usize, bool) -> Result<(), BackendError>) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let (src, dst) = (self.alloc(bytes)?, self.alloc(bytes)?);
        let failed = |e: CudaError| to_backend(self.rank, e);
        let timeout = BackendError::EventTimeout { waited: self.timeout };
        let result = {
            // The copy stream is the host copies' too: one at a time (see `host_copy`).
            let _one_at_a_time = device::lock(&self.host_copies);
            let mut copy = |n: usize, spin: bool| -> Result<(), BackendError> {
                self.device.bind().map_err(failed)?;
                for _ in 0..n {
                    // SAFETY: both buffers are this rank's, at least `bytes` long, and nothing
                    // else uses them: they go back to the pool once the copy stream drained, or
                    // behind an event recorded after these copies.
                    unsafe { cu::memcpy_dtod_async(dst.ptr(), src.ptr(), bytes, self.copy.raw()) }.map_err(
                        |e| {
                            failed(CudaError::driver(
                                format!("rank {}: a timed device copy of {bytes} bytes", self.rank),
                                collsched_kernels::cuda::DriverCallError::new("cuMemcpyDtoDAsync", e),
                            ))
                        },
                    )?;
                }
                if spin {
                    let done = self.copy.record().map_err(failed)?;
                    let start = std::time::Instant::now();
                    while !done.is_complete().map_err(failed)? {
                        if start.elapsed() > self.timeout {
                            return Err(timeout.clone());
                        }
                        std::hint::spin_loop();
                    }
                } else if !self.copy.drain(self.timeout).map_err(failed)? {
                    return Err(timeout.clone());
                }
                Ok(())
            };
            timing(&mut copy)
        };
        // Every copy was waited for; after a failure one may still run: the buffers go back to
        // the pool behind an event recorded after the copies, or are leaked without one.
        let after = match &result {
            Ok(()) => None,
            Err(_) => match self.copy.record() {
                Ok(event) => Some(event),
                Err(_) => {
                    std::mem::forget((src, dst));
                    return result;
                }
            },
        };
        self.free(src, after.as_ref());
        self.free(dst, after.as_ref());
        result
    }

    /// The raw CUDA stream behind `stream` (to hand to an engine).
    pub fn raw_stream(&self, stream: Stream) -> cusys::CUstream {
        self.streams[stream.index()].raw()
    }

    fn stream(&self, s: Stream) -> &StreamHandle {
        &self.streams[s.index()]
    }

    fn be(&self, e: CudaError) -> BackendError {
        to_backend(self.rank, e)
    }

    fn ready(&self) -> Result<(), BackendError> {
        self.park.check().map_err(|e| self.be(e.into()))?;
        self.device.bind().map_err(|e| self.be(e))
    }

    /// The kernels a launch of `ops` needs (the divides around a reduction), fetched before
    /// the collective is numbered: loaded when the backend was built, never here.
    fn launch_kernels(&self, ops: &[Collective<CudaBuffer>]) -> Result<Option<&KernelModule>, BackendError> {
        if !ops.iter().any(|op| launch::needs_kernels(&op.desc)) {
            return Ok(None);
        }
        self.device.kernels().map(Some).map_err(|e| self.be(e))
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Event = CudaEvent;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuffer, BackendError> {
        self.alloc_preferring(bytes, 0)
    }

    fn alloc_preferring(&self, bytes: usize, key: usize) -> Result<CudaBuffer, BackendError> {
        self.ready()?;
        self.pool.alloc_preferring(bytes, key as u64).map_err(|e| match e {
            CudaError::Driver { context, source } if source.name == "CUDA_ERROR_OUT_OF_MEMORY" => {
                BackendError::OutOfMemory { rank: self.rank, bytes, what: format!("{context}: {source}") }
            }
            e => self.be(e),
        })
    }

    fn free(&self, buffer: CudaBuffer, after: Option<&CudaEvent>) {
        self.pool.free_after(buffer, after.map(std::slice::from_ref).unwrap_or(&[]));
    }

    fn write_from_host(
        &self,
        buffer: &mut CudaBuffer,
        offset: usize,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.ready()?;
        if offset.checked_add(src.len()).is_none_or(|end| end > buffer.len()) {
            return Err(BackendError::OutOfRange {
                rank: self.rank,
                what: format!(
                    "write of {} bytes at {offset} into a buffer of {} bytes",
                    src.len(),
                    buffer.len()
                ),
            });
        }
        if src.is_empty() {
            return Ok(());
        }
        let op = format!("rank {}: write_from_host of {} bytes at {offset}", self.rank, src.len());
        let dst = buffer.ptr() + offset as u64;
        self.host_copy(&op, "cuMemcpyHtoDAsync", |copy| {
            // SAFETY: range checked; the buffer is not read or written by other streams before
            // their fences (see `host_copy`). `src` is read until the copy completed: from
            // pageable memory the driver stages it before the call returns; from pinned memory
            // the DMA reads it later, and `host_copy` returns only once the copy stream
            // drained, or else (a drain that timed out or failed) wedges the device and tells
            // the caller that `src` may still be read.
            unsafe { cu::memcpy_htod_async(dst, src, copy) }
        })
    }

    fn read_to_host(&self, buffer: &CudaBuffer, offset: usize, dst: &mut [u8]) -> Result<(), BackendError> {
        self.ready()?;
        if offset.checked_add(dst.len()).is_none_or(|end| end > buffer.len()) {
            return Err(BackendError::OutOfRange {
                rank: self.rank,
                what: format!(
                    "read of {} bytes at {offset} from a buffer of {} bytes",
                    dst.len(),
                    buffer.len()
                ),
            });
        }
        if dst.is_empty() {
            return Ok(());
        }
        let op = format!("rank {}: read_to_host of {} bytes at {offset}", self.rank, dst.len());
        let src = buffer.ptr() + offset as u64;
        self.host_copy(&op, "cuMemcpyDtoHAsync", |copy| {
            // SAFETY: range checked; the buffer is not written by other streams before their
            // fences (see `host_copy`). `dst` is written until the copy completed: into
            // pageable memory the call returns only then; into pinned memory the DMA writes it
            // later, and `host_copy` returns only once the copy stream drained, or else (a
            // drain that timed out or failed) wedges the device and tells the caller that
            // `dst` may still be written.
            unsafe { cu::memcpy_dtoh_async(dst, src, copy) }
        })
    }

    fn device(&self) -> Option<usize> {
        Some(self.device.ordinal())
    }

    fn device_address(&self, buffer: &CudaBuffer) -> Option<u64> {
        Some(buffer.ptr())
    }

    /// The copy-out kernel on `stream` ([`CudaBackend::copy_out`]); the event follows it.
    fn unpack(
        &self,
        stream: Stream,
        dst: &mut CudaBuffer,
        packed: &CudaBuffer,
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<Option<CudaEvent>, BackendError> {
        self.copy_out(stream, &[&*dst], packed, segments, elem_size).map(Some).map_err(|e| self.be(e))
    }

    /// The copy-in kernel on `stream` ([`CudaBackend::copy_in`]); the event follows it.
    fn pack(
        &self,
        stream: Stream,
        packed: &mut CudaBuffer,
        sources: &[&CudaBuffer],
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<Option<CudaEvent>, BackendError> {
        self.copy_in(stream, packed, sources, segments, elem_size).map(Some).map_err(|e| self.be(e))
    }

    /// `cuMemsetD8Async` on `stream`.
    fn zero(
        &self,
        stream: Stream,
        buffer: &mut CudaBuffer,
        offset: usize,
        len: usize,
    ) -> Result<(), BackendError> {
        self.ready()?;
        if offset.checked_add(len).is_none_or(|end| end > buffer.len()) {
            return Err(BackendError::OutOfRange {
                rank: self.rank,
                what: format!("zeroing {len} bytes at {offset} of a buffer of {} bytes", buffer.len()),
            });
        }
        if len == 0 {
            return Ok(());
        }
        self.device.bind().map_err(|e| self.be(e))?;
        // SAFETY: the range was checked against the buffer, which the caller keeps alive and
        // unread by other streams until the stream passed this point.
        let r =
            unsafe { cu::memset_d8_async(buffer.ptr() + offset as u64, 0, len, self.stream(stream).raw()) };
        collsched_kernels::cuda::check("cuMemsetD8Async", r)
            .map_err(|e| self.be(CudaError::driver("zeroing a buffer", e)))
    }

    fn record(&self, stream: Stream) -> Result<CudaEvent, BackendError> {
        self.ready()?;
        self.stream(stream).record().map_err(|e| self.be(e))
    }

    fn wait_event(&self, stream: Stream, event: &CudaEvent) -> Result<(), BackendError> {
        self.ready()?;
        self.stream(stream).wait(event).map_err(|e| self.be(e))
    }

    fn launch_group(
        &self,
        stream: Stream,
        after: &[CudaEvent],
        ops: Vec<Collective<CudaBuffer>>,
    ) -> Result<InFlight<Self>, LaunchError<CudaBuffer>> {
        if let Err(error) = self.ready().and_then(|()| self.validate(stream, &ops)) {
            return Err(LaunchError { error, ops });
        }
        let kernels = match self.launch_kernels(&ops) {
            Ok(k) => k,
            Err(error) => return Err(LaunchError { error, ops }),
        };
        let s = self.stream(stream);
        for e in after {
            if let Err(e) = s.wait(e) {
                return Err(LaunchError { error: self.be(e), ops });
            }
        }
        // From here on the collective has its sequence number on (group, stream): a failure
        // leaves this rank out of step with the others there, so it aborts the (group, stream).
        let launching = match self.comms.launch(&ops[0].desc, stream) {
            Ok(l) => l,
            Err(error) => return Err(LaunchError { error, ops }),
        };
        let op = launching.op.clone();
        let enqueued = match launching.comm() {
            Some(comm) => self.enqueue(stream, &ops, comm, kernels),
            None => Err(CudaError::Invalid {
                op: format!("rank {}: {op}", self.rank),
                what: "the communicator was aborted during the launch".into(),
            }),
        };
        drop(launching);
        let scope = Scope::collective(op.clone());
        let watch = Watch::new(&self.comms, scope.clone(), self.timeout);
        match enqueued.and_then(|()| s.record_with(Some(watch))) {
            Ok(event) => Ok(InFlight::new(ops, event, Arc::clone(&self.on_drop))),
            Err(e) => {
                let error = match self.be(e) {
                    BackendError::Device { rank, api, detail } => BackendError::Device {
                        rank,
                        api,
                        detail: format!(
                            "{op}: {detail}; its communicator was aborted, so later collectives on group {} \
                             stream {stream} fail; rebuild the world",
                            op.desc.group
                        ),
                    },
                    other => other,
                };
                self.comms.abort(&scope, error.clone());
                // Part of the work may be queued: let it drain (bounded) before the buffers go back.
                if !self.drain_stream(s) {
                    self.park.park(format!(
                        "rank {}: {op}: the {stream} stream did not drain after a failed launch; its buffers \
                         may still be in use",
                        self.rank
                    ));
                }
                Err(LaunchError { error, ops })
            }
        }
    }
}
