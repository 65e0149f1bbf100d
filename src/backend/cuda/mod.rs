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
//! types), [`device`] (device, streams, events, pool), then [`CudaBackend`].
//!
//! Without a GPU every constructor returns `no CUDA driver found: ...` (as
//! [`CudaError::Load`]); nothing panics.
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

pub mod device;
pub mod error;
pub mod nccl;
pub mod park;
pub mod rendezvous;
pub mod world;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use collsched_kernels::cuda::{device_segments, reduce_post_divisor, DeviceRegion, DeviceSegment};
use collsched_kernels::{CopySegment, ElemType, ReduceOp, Scaling};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;

pub use device::{device_count, BufferPool, CudaBuffer, CudaEvent, Device, StreamHandle, StreamRole};
pub use error::CudaError;
pub use nccl::{CallSite, Communicator, Group, NcclCallError, NcclError, NcclOp, UniqueId};
pub use park::ErrorPark;
pub use rendezvous::{BootstrapError, FileRendezvous, LaunchEnv};
pub use world::CudaWorld;

use super::{
    Backend, BackendBuffer, BackendError, BackendEvent, CollKind, CollRef, Collective, InFlight, LaunchError,
    OnDrop, RankGroup, Stream,
};

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

impl BackendEvent for CudaEvent {
    fn query(&self) -> Result<bool, BackendError> {
        self.is_complete().map_err(|e| to_backend(self.rank(), e))
    }

    fn wait(&self, timeout: Duration) -> Result<(), BackendError> {
        match self.wait_for(timeout) {
            Ok(true) => Ok(()),
            Ok(false) => Err(BackendError::EventTimeout { waited: timeout }),
            Err(e) => Err(to_backend(self.rank(), e)),
        }
    }
}

impl BackendBuffer for CudaBuffer {
    fn len(&self) -> usize {
        CudaBuffer::len(self)
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
    comms: Mutex<HashMap<(RankGroup, Stream), Communicator>>,
    park: ErrorPark,
    on_drop: OnDrop<CudaBackend>,
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
    /// Builds rank `config.rank`: opens the device, creates the streams and the pool, joins the
    /// NCCL world named by `id` and splits one communicator per (group, stream). Every rank of
    /// the world calls this (concurrently: it blocks until all joined).
    ///
    /// # Errors
    /// `no CUDA driver found: ...` without a driver ([`CudaError::Load`]); no NCCL, a bad device
    /// ordinal, a group that does not fit the world, an NCCL or driver failure.
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

    /// Builds the rank a torchrun-style launch describes ([`LaunchEnv`]: `RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK` as the device, `COLLSCHED_RENDEZVOUS_FILE` for the unique id; rank 0
    /// creates it) with the given extra groups.
    ///
    /// # Errors
    /// [`CudaError::Bootstrap`] for a missing or malformed variable or a late rank 0; as
    /// [`CudaBackend::new`] otherwise.
    pub fn from_launch_env(groups: Vec<RankGroup>) -> Result<Self, CudaError> {
        let launch = LaunchEnv::from_env()?;
        let lookup = |k: &str| std::env::var(k).ok();
        let timeout = match lookup("COLLSCHED_CUDA_TIMEOUT_SECS") {
            None => DEFAULT_TIMEOUT,
            Some(v) => v.trim().parse::<u64>().map(Duration::from_secs).map_err(|_| BootstrapError::Env {
                var: "COLLSCHED_CUDA_TIMEOUT_SECS",
                value: v.clone(),
                what: "expected whole seconds, e.g. 300".into(),
            })?,
        };
        // Fail on a missing driver before waiting for the rendezvous.
        device_count()?;
        let rendezvous = launch.rendezvous(lookup)?;
        let id = rendezvous.exchange(launch.rank, UniqueId::generate)?;
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
        let mk = |role| StreamHandle::new(&device, rank, role).map(Arc::new);
        let compute = match compute {
            // SAFETY: guaranteed by `with_compute_stream`'s caller.
            Some(raw) => Arc::new(unsafe { StreamHandle::borrowed(&device, rank, raw, StreamRole::Compute) }),
            None => mk(StreamRole::Compute)?,
        };
        let streams = [mk(StreamRole::AllGather)?, mk(StreamRole::ReduceScatter)?, compute];
        let copy = mk(StreamRole::Copy)?;
        let pool = BufferPool::new(Arc::clone(&device));
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
        Ok(CudaBackend {
            rank,
            world,
            timeout,
            device,
            streams,
            copy,
            pool,
            comms: Mutex::new(comms),
            park,
            on_drop,
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

    fn invalid(&self, desc: &super::CollDesc, stream: Stream, what: String) -> BackendError {
        BackendError::InvalidCollective {
            rank: self.rank,
            op: Box::new(CollRef { desc: desc.clone(), stream, seq: None }),
            what,
        }
    }

    fn validate(&self, stream: Stream, ops: &[Collective<CudaBuffer>]) -> Result<(), BackendError> {
        let Some(first) = ops.first() else {
            return Err(BackendError::Unsupported {
                what: format!("rank {}: launch_group with no collectives", self.rank),
            });
        };
        let comms = self.comms.lock().unwrap_or_else(|p| p.into_inner());
        for op in ops {
            let d = &op.desc;
            if d.group != first.desc.group {
                return Err(self.invalid(
                    d,
                    stream,
                    format!(
                        "mixes groups {} and {} in one launch; launch them separately",
                        first.desc.group, d.group
                    ),
                ));
            }
            if d.group.position(self.rank).is_none() {
                return Err(self.invalid(
                    d,
                    stream,
                    format!("rank {} is not a member of group {}", self.rank, d.group),
                ));
            }
            if !comms.contains_key(&(d.group.clone(), stream)) {
                return Err(self.invalid(
                    d,
                    stream,
                    format!(
                        "group {} was not declared in CudaConfig::groups when the backend was built",
                        d.group
                    ),
                ));
            }
            let es = d.elem.size();
            let need_out = d.output_count().checked_mul(es);
            if need_out.is_none_or(|n| n > op.output.len()) {
                return Err(self.invalid(
                    d,
                    stream,
                    format!(
                        "output has {} bytes, the collective needs {} x {es}",
                        op.output.len(),
                        d.output_count()
                    ),
                ));
            }
            match (&op.input, d.kind) {
                (Some(i), _) => {
                    if d.input_count().checked_mul(es).is_none_or(|n| n > i.len()) {
                        return Err(self.invalid(
                            d,
                            stream,
                            format!(
                                "input has {} bytes, the collective needs {} x {es}",
                                i.len(),
                                d.input_count()
                            ),
                        ));
                    }
                    if let CollKind::Broadcast { root } = d.kind {
                        if root != self.rank {
                            return Err(self.invalid(
                                d,
                                stream,
                                format!("only the root (rank {root}) may pass an input to a broadcast"),
                            ));
                        }
                    }
                }
                (None, CollKind::ReduceScatter | CollKind::AllReduce) => {
                    return Err(self.invalid(
                        d,
                        stream,
                        "reduce-scatter and all-reduce need an input distinct from the output".into(),
                    ));
                }
                (None, _) => {}
            }
            if let CollKind::Broadcast { root } = d.kind {
                if d.group.position(root).is_none() {
                    return Err(self.invalid(
                        d,
                        stream,
                        format!("broadcast root {root} is not in group {}", d.group),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Enqueues the ops (validated) on `stream`: pre-divides, one NCCL group, post-divides.
    fn enqueue(&self, stream: Stream, ops: &[Collective<CudaBuffer>]) -> Result<(), CudaError> {
        let s = self.stream(stream).raw();
        let needs_kernels = ops.iter().any(|op| {
            op.desc.kind.reduces()
                && (op.desc.scaling.pre_divide != 1.0
                    || reduce_post_divisor(op.desc.op, op.desc.scaling, op.desc.group.len()) != 1.0)
        });
        let kernels = if needs_kernels { Some(self.device.kernels()?) } else { None };
        let kdrv = |what: &str| {
            let what = format!("rank {}: {what}", self.rank);
            move |e| CudaError::driver(what, e)
        };
        for op in ops.iter().filter(|op| op.desc.kind.reduces() && op.desc.scaling.pre_divide != 1.0) {
            let (Some(k), Some(input)) = (kernels, op.input.as_ref()) else { continue };
            // SAFETY: validated: the input holds input_count elements, alive until the returned
            // InFlight's event completed (it owns the buffer).
            unsafe {
                k.divide(
                    s,
                    op.desc.elem,
                    input.ptr(),
                    op.desc.input_count() as u64,
                    op.desc.scaling.pre_divide,
                )
            }
            .map_err(kdrv(&format!("pre-divide of {}", op.desc)))?;
        }
        let comms = self.comms.lock().unwrap_or_else(|p| p.into_inner());
        let group = Group::start(self.park.clone())?;
        for op in ops {
            let d = &op.desc;
            let comm = comms.get(&(d.group.clone(), stream)).ok_or_else(|| CudaError::Invalid {
                op: format!("rank {}: {d}", self.rank),
                what: format!("no communicator for group {} on stream {stream}; declare the group in CudaConfig::groups", d.group),
            })?;
            let pos = d.group.position(self.rank).unwrap_or(0);
            let site = CallSite::op(d.kind.name()).bucket(d.tag as usize).rank(self.rank);
            let es = d.elem.size() as u64;
            let out = op.output.ptr();
            let nop = match d.op {
                ReduceOp::Sum | ReduceOp::Avg => NcclOp::Sum,
            };
            // SAFETY (all four): validated sizes; the buffers are owned by the ops, which the
            // InFlight returned from this launch keeps until the stream's event completed.
            match d.kind {
                CollKind::AllGather => {
                    let send =
                        op.input.as_ref().map_or(out + pos as u64 * d.count as u64 * es, CudaBuffer::ptr);
                    // SAFETY: see above: validated sizes, buffers owned by the returned InFlight.
                    unsafe { comm.all_gather(site, send, out, d.count, d.elem, s) }?;
                }
                CollKind::ReduceScatter => {
                    let send = op.input.as_ref().map_or(0, CudaBuffer::ptr);
                    // SAFETY: see above: validated sizes, buffers owned by the returned InFlight.
                    unsafe { comm.reduce_scatter(site, send, out, d.count, d.elem, nop, s) }?;
                }
                CollKind::AllReduce => {
                    let send = op.input.as_ref().map_or(0, CudaBuffer::ptr);
                    // SAFETY: see above: validated sizes, buffers owned by the returned InFlight.
                    unsafe { comm.all_reduce(site, send, out, d.count, d.elem, nop, s) }?;
                }
                CollKind::Broadcast { root } => {
                    let send = op.input.as_ref().map_or(out, CudaBuffer::ptr);
                    let root_pos = d.group.position(root).unwrap_or(0);
                    // SAFETY: see above: validated sizes, buffers owned by the returned InFlight.
                    unsafe { comm.broadcast(site, send, out, d.count * d.elem.size(), root_pos, s) }?;
                }
            }
        }
        group.end()?;
        drop(comms);
        for op in ops.iter().filter(|op| op.desc.kind.reduces()) {
            let post = reduce_post_divisor(op.desc.op, op.desc.scaling, op.desc.group.len());
            if post == 1.0 {
                continue;
            }
            let Some(k) = kernels else { continue };
            // SAFETY: validated: the output holds output_count elements, kept alive as above.
            unsafe { k.divide(s, op.desc.elem, op.output.ptr(), op.desc.output_count() as u64, post) }
                .map_err(kdrv(&format!("post-divide of {}", op.desc)))?;
        }
        Ok(())
    }

    fn upload<T: bytemuck::Pod>(&self, stream: &StreamHandle, data: &[T]) -> Result<CudaBuffer, CudaError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let buf = self.pool.alloc(bytes.len().max(1))?;
        if !bytes.is_empty() {
            // SAFETY: `buf` has at least `bytes.len()` bytes; a copy from pageable memory
            // returns once the source was staged, so `data` may go away afterwards.
            let r = unsafe { cu::memcpy_htod_async(buf.ptr(), bytes, stream.raw()) };
            collsched_kernels::cuda::check("cuMemcpyHtoDAsync", r)
                .map_err(|e| CudaError::driver(format!("rank {}: uploading a kernel table", self.rank), e))?;
        }
        Ok(buf)
    }

    fn finish_kernel(&self, stream: &StreamHandle, scratch: Vec<CudaBuffer>) -> Result<CudaEvent, CudaError> {
        let event = stream.record()?;
        for b in scratch {
            self.pool.free_after(b, std::slice::from_ref(&event));
        }
        Ok(event)
    }

    /// Copy-in on `stream`: packs runs of `sources` into `packed` ([`collsched_kernels::copy_in`]
    /// semantics, one launch for every segment); offsets count elements of `elem_size` bytes.
    /// Returns the event after the copy.
    ///
    /// # Errors
    /// [`CudaError::KernelInput`] for the same bad segments the CPU kernel refuses (nothing is
    /// launched then); kernel or driver errors.
    pub fn copy_in(
        &self,
        stream: Stream,
        packed: &CudaBuffer,
        sources: &[&CudaBuffer],
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<CudaEvent, CudaError> {
        self.copy(stream, "copy_in", packed, sources, segments, elem_size)
    }

    /// Copy-out on `stream`: unpacks runs of `packed` into `destinations`
    /// ([`collsched_kernels::copy_out`] semantics). Returns the event after the copy.
    ///
    /// # Errors
    /// As [`CudaBackend::copy_in`].
    pub fn copy_out(
        &self,
        stream: Stream,
        destinations: &[&CudaBuffer],
        packed: &CudaBuffer,
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<CudaEvent, CudaError> {
        self.copy(stream, "copy_out", packed, destinations, segments, elem_size)
    }

    fn copy(
        &self,
        stream: Stream,
        kernel: &'static str,
        packed: &CudaBuffer,
        many: &[&CudaBuffer],
        segments: &[CopySegment],
        elem_size: usize,
    ) -> Result<CudaEvent, CudaError> {
        self.park.check()?;
        self.device.bind()?;
        let es = elem_size.max(1);
        let regions: Vec<DeviceRegion> =
            many.iter().map(|b| DeviceRegion { ptr: b.ptr(), len: b.len() / es }).collect();
        let table: Vec<DeviceSegment> =
            device_segments(kernel, segments, &regions, packed.len() / es, es).map_err(|source| {
                CudaError::KernelInput { context: format!("rank {}", self.rank), source: Box::new(source) }
            })?;
        let count = u32::try_from(table.len()).map_err(|_| CudaError::Invalid {
            op: format!("rank {}: {kernel}", self.rank),
            what: format!("{} copy pieces do not fit one launch; split the bucket", table.len()),
        })?;
        let k = self.device.kernels()?;
        let s = self.stream(stream);
        let t = self.upload(s, &table)?;
        // SAFETY: the table and every run were checked against the buffers' lengths; the
        // buffers are the caller's and must stay alive until the returned event completed (the
        // table is freed after it).
        let r = unsafe {
            if kernel == "copy_in" {
                k.copy_in(s.raw(), t.ptr(), count, packed.ptr())
            } else {
                k.copy_out(s.raw(), t.ptr(), count, packed.ptr())
            }
        };
        r.map_err(|e| CudaError::driver(format!("rank {}: {kernel}", self.rank), e))?;
        self.finish_kernel(s, vec![t])
    }

    /// Reduce on `stream`: `out = (sum_k inputs[k] / pre) / post` element-wise
    /// ([`collsched_kernels::reduce`] semantics, bit for bit except NaN payloads; `out` may be
    /// one of the inputs). Returns the event after it.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for no inputs or lengths that differ; kernel or driver errors.
    pub fn reduce(
        &self,
        stream: Stream,
        ty: ElemType,
        op: ReduceOp,
        scaling: Scaling,
        out: &CudaBuffer,
        inputs: &[&CudaBuffer],
    ) -> Result<CudaEvent, CudaError> {
        self.park.check()?;
        self.device.bind()?;
        let bad = |what: String| CudaError::Invalid { op: format!("rank {}: reduce", self.rank), what };
        if inputs.is_empty() {
            return Err(bad("no inputs".into()));
        }
        if !out.len().is_multiple_of(ty.size()) {
            return Err(bad(format!(
                "the output has {} bytes, not a multiple of {} ({})",
                out.len(),
                ty.size(),
                ty.name()
            )));
        }
        if let Some((k, i)) = inputs.iter().enumerate().find(|(_, i)| i.len() != out.len()) {
            return Err(bad(format!("input {k} has {} bytes, the output {}", i.len(), out.len())));
        }
        let count = u32::try_from(inputs.len()).map_err(|_| bad("too many inputs".into()))?;
        let k = self.device.kernels()?;
        let s = self.stream(stream);
        let ptrs: Vec<u64> = inputs.iter().map(|b| b.ptr()).collect();
        let t = self.upload(s, &ptrs)?;
        let n = (out.len() / ty.size()) as u64;
        let post = reduce_post_divisor(op, scaling, inputs.len());
        // SAFETY: lengths checked above; the buffers must stay alive until the event completed.
        unsafe { k.reduce(s.raw(), ty, out.ptr(), t.ptr(), count, n, scaling.pre_divide, post) }
            .map_err(|e| CudaError::driver(format!("rank {}: reduce", self.rank), e))?;
        self.finish_kernel(s, vec![t])
    }

    /// Accumulate on `stream`: `acc += src` ([`collsched_kernels::accumulate`] semantics).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for lengths that differ; kernel or driver errors.
    pub fn accumulate(
        &self,
        stream: Stream,
        ty: ElemType,
        acc: &CudaBuffer,
        src: &CudaBuffer,
    ) -> Result<CudaEvent, CudaError> {
        self.park.check()?;
        self.device.bind()?;
        if acc.len() != src.len() || !acc.len().is_multiple_of(ty.size()) {
            return Err(CudaError::Invalid {
                op: format!("rank {}: accumulate", self.rank),
                what: format!(
                    "source has {} bytes, the accumulator {} ({})",
                    src.len(),
                    acc.len(),
                    ty.name()
                ),
            });
        }
        let k = self.device.kernels()?;
        let s = self.stream(stream);
        // SAFETY: lengths checked; the buffers must stay alive until the event completed.
        unsafe { k.accumulate(s.raw(), ty, acc.ptr(), src.ptr(), (acc.len() / ty.size()) as u64) }
            .map_err(|e| CudaError::driver(format!("rank {}: accumulate", self.rank), e))?;
        self.finish_kernel(s, Vec::new())
    }

    /// Cast on `stream`: `dst = to(from(src))`, round to nearest even ([`collsched_kernels::cast`]).
    ///
    /// # Errors
    /// [`CudaError::Invalid`] for element counts that differ; kernel or driver errors.
    pub fn cast(
        &self,
        stream: Stream,
        from: ElemType,
        src: &CudaBuffer,
        to: ElemType,
        dst: &CudaBuffer,
    ) -> Result<CudaEvent, CudaError> {
        self.park.check()?;
        self.device.bind()?;
        let n = src.len() / from.size();
        if !src.len().is_multiple_of(from.size()) || dst.len() != n * to.size() {
            return Err(CudaError::Invalid {
                op: format!("rank {}: cast", self.rank),
                what: format!(
                    "source has {} bytes of {}, destination {} bytes of {}",
                    src.len(),
                    from.name(),
                    dst.len(),
                    to.name()
                ),
            });
        }
        let k = self.device.kernels()?;
        let s = self.stream(stream);
        // SAFETY: lengths checked; the buffers must stay alive until the event completed.
        unsafe { k.cast(s.raw(), from, src.ptr(), to, dst.ptr(), n as u64) }
            .map_err(|e| CudaError::driver(format!("rank {}: cast", self.rank), e))?;
        self.finish_kernel(s, Vec::new())
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
        self.ready()?;
        self.pool.alloc(bytes).map_err(|e| match e {
            CudaError::Driver { source, .. } if source.name == "CUDA_ERROR_OUT_OF_MEMORY" => {
                BackendError::OutOfMemory { rank: self.rank, bytes, what: source.to_string() }
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
        // SAFETY: range checked; the copy stream is synchronized before returning.
        let r = unsafe { cu::memcpy_htod_async(buffer.ptr() + offset as u64, src, self.copy.raw()) };
        collsched_kernels::cuda::check("cuMemcpyHtoDAsync", r)
            .map_err(|e| CudaError::driver("writing from the host", e))
            .and_then(|()| self.copy.synchronize())
            .map_err(|e| self.be(e))
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
        // SAFETY: range checked; the copy stream is synchronized before `dst` is used.
        let r = unsafe { cu::memcpy_dtoh_async(dst, buffer.ptr() + offset as u64, self.copy.raw()) };
        collsched_kernels::cuda::check("cuMemcpyDtoHAsync", r)
            .map_err(|e| CudaError::driver("reading to the host", e))
            .and_then(|()| self.copy.synchronize())
            .map_err(|e| self.be(e))
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
        let s = self.stream(stream);
        for e in after {
            if let Err(e) = s.wait(e) {
                return Err(LaunchError { error: self.be(e), ops });
            }
        }
        let enqueued = self.enqueue(stream, &ops).and_then(|()| s.record());
        match enqueued {
            Ok(event) => Ok(InFlight::new(ops, event, Arc::clone(&self.on_drop))),
            Err(e) => {
                // Part of the work may be queued: let it drain before the buffers go back.
                let _ = s.synchronize();
                Err(LaunchError { error: self.be(e), ops })
            }
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Let queued work finish before communicators and streams go away.
        for s in self.streams.iter().chain(std::iter::once(&self.copy)) {
            if let Err(e) = s.synchronize() {
                self.park.park(e);
            }
        }
        let leftover = self.park.take();
        for e in leftover {
            tracing::error!(target: "collsched::init", "rank {}: CUDA error while shutting down: {e}", self.rank);
        }
    }
}
