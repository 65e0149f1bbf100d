//! Devices, streams, events and the device buffer pool with deferred frees.
//!
//! # Deferred frees (the safe form of `record_stream`)
//! PyTorch's `record_stream` keeps a block away from its allocator until *every* stream that
//! used it has passed the point of the record, judged at the next allocation on the owning
//! stream, which over-allocates when consumers run late. Here a freed buffer carries the events
//! it must wait for ([`BufferPool::free_after`]); the pool hands it out again only once
//! `cuEventQuery` says every one of them completed, and nothing is ever returned to the driver
//! while in use. A buffer dropped or freed without events is fenced by one event on each stream
//! of its rank, recorded at the free: conservative, never unsafe.
//!
//! # Pool
//! Sizes are rounded up to size classes (8 per power of two, at least 512 bytes), so a
//! steady-state step reuses the blocks of the step before and allocates nothing from the
//! driver. When `cuMemAlloc` fails, the pool waits for its deferred blocks, reuses what it can,
//! then returns its cached blocks to the driver and tries once more.
//!
//! # Memory the library does not own
//! [`CudaBuffer::from_raw`] wraps an engine's device pointer; such a buffer is never freed or
//! pooled by us. [`StreamHandle::borrowed`] wraps an engine's stream; it is never destroyed.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use collsched_kernels::cuda::{check, loader, DriverCallError, KernelModule};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;

use super::error::CudaError;
use super::park::ErrorPark;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a thread panicked while holding it; the data is still valid.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One CUDA device: its primary context, its kernels (loaded once), and a pool of events.
pub struct Device {
    ordinal: usize,
    device: cusys::CUdevice,
    ctx: cusys::CUcontext,
    arch: u32,
    priority_range: (i32, i32),
    kernels: OnceLock<KernelModule>,
    free_events: Mutex<Vec<cusys::CUevent>>,
    park: ErrorPark,
}

// SAFETY: the context and device handles are process-wide driver handles valid on any thread;
// mutable state is behind mutexes, and every use binds the context first.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device").field("ordinal", &self.ordinal).field("arch", &self.arch).finish()
    }
}

/// Number of CUDA devices the driver sees.
///
/// # Errors
/// `no CUDA driver found: ...` ([`CudaError::Load`]) without a driver; the driver's error
/// (e.g. `CUDA_ERROR_NO_DEVICE`) otherwise.
pub fn device_count() -> Result<usize, CudaError> {
    loader::driver()?;
    check("cuInit", cu::init()).map_err(|e| CudaError::driver("initializing the CUDA driver", e))?;
    let n = cu::device::get_count().map_err(|e| {
        CudaError::driver("counting CUDA devices", DriverCallError::new("cuDeviceGetCount", e))
    })?;
    Ok(n.max(0) as usize)
}

impl Device {
    /// Opens device `ordinal`: loads the driver (without panicking), retains the primary context
    /// and makes it current on this thread.
    ///
    /// # Errors
    /// [`CudaError::Load`] (`no CUDA driver found: ...`), [`CudaError::NoSuchDevice`], or a
    /// driver error.
    pub fn open(ordinal: usize, park: ErrorPark) -> Result<Arc<Device>, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let ctx_err = |api: &'static str| {
            move |e| CudaError::driver(format!("opening CUDA device {ordinal}"), DriverCallError::new(api, e))
        };
        let device = cu::device::get(ordinal as i32).map_err(ctx_err("cuDeviceGet"))?;
        // SAFETY: `device` came from cuDeviceGet.
        let ctx = unsafe { cu::primary_ctx::retain(device) }.map_err(ctx_err("cuDevicePrimaryCtxRetain"))?;
        let this = Device {
            ordinal,
            device,
            ctx,
            arch: 0,
            priority_range: (0, 0),
            kernels: OnceLock::new(),
            free_events: Mutex::new(Vec::new()),
            park,
        };
        // From here on Drop releases the context.
        this.bind()?;
        use cusys::CUdevice_attribute::{
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
        };
        // SAFETY: `device` came from cuDeviceGet.
        let major =
            unsafe { cu::device::get_attribute(device, MAJOR) }.map_err(ctx_err("cuDeviceGetAttribute"))?;
        // SAFETY: as above.
        let minor =
            unsafe { cu::device::get_attribute(device, MINOR) }.map_err(ctx_err("cuDeviceGetAttribute"))?;
        let priority_range =
            cu::stream::get_priority_range().map_err(ctx_err("cuCtxGetStreamPriorityRange"))?;
        let mut this = this;
        this.arch = (major.max(0) * 10 + minor.max(0)) as u32;
        this.priority_range = priority_range;
        tracing::info!(target: "collsched::init", "CUDA device {ordinal}: sm_{}", this.arch);
        Ok(Arc::new(this))
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Compute capability as a number (80 for sm_80).
    pub fn arch(&self) -> u32 {
        self.arch
    }

    /// The park that collects this device's `Drop` errors.
    pub fn park(&self) -> &ErrorPark {
        &self.park
    }

    /// Makes this device's context current on the calling thread (cheap; every entry point
    /// calls it).
    ///
    /// # Errors
    /// A driver error.
    pub fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `ctx` is the retained primary context, alive until Drop.
        let r = unsafe { cu::ctx::set_current(self.ctx) };
        check("cuCtxSetCurrent", r)
            .map_err(|e| CudaError::driver(format!("binding CUDA device {}", self.ordinal), e))
    }

    /// The kernels, compiled (once per process and architecture) and loaded (once per device).
    ///
    /// # Errors
    /// [`CudaError::Kernels`] (NVRTC missing, a compile or load error).
    pub fn kernels(&self) -> Result<&KernelModule, CudaError> {
        if let Some(k) = self.kernels.get() {
            return Ok(k);
        }
        self.bind()?;
        let k = KernelModule::load(self.arch)?;
        Ok(self.kernels.get_or_init(|| k))
    }

    fn take_event(&self) -> Result<cusys::CUevent, CudaError> {
        if let Some(e) = lock(&self.free_events).pop() {
            return Ok(e);
        }
        self.bind()?;
        cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| {
            CudaError::driver(
                format!("device {}: creating an event", self.ordinal),
                DriverCallError::new("cuEventCreate", e),
            )
        })
    }

    fn give_event(&self, e: cusys::CUevent) {
        lock(&self.free_events).push(e);
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Kernels and events need the context current; the context is released regardless.
        if self.bind().is_ok() {
            drop(self.kernels.take());
            for e in lock(&self.free_events).drain(..) {
                // SAFETY: pooled events are handles of this context no one else holds; destroyed once.
                if let Err(err) = unsafe { cu::event::destroy(e) } {
                    self.park.park(CudaError::driver(
                        "destroying an event",
                        DriverCallError::new("cuEventDestroy", err),
                    ));
                }
            }
        }
        // SAFETY: the context was retained once in `open`; released once here.
        if let Err(err) = unsafe { cu::primary_ctx::release(self.device) } {
            self.park.park(CudaError::driver(
                format!("releasing device {}", self.ordinal),
                DriverCallError::new("cuDevicePrimaryCtxRelease", err),
            ));
        }
    }
}

/// What a stream is for; decides its priority.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamRole {
    /// Parameter all-gathers: the highest priority (compute waits for them).
    AllGather,
    /// Gradient reduce-scatters: high priority.
    ReduceScatter,
    /// Host-device copies and the backend's own bookkeeping: normal priority.
    Copy,
    /// Compute (normally the engine's stream, borrowed): normal priority.
    Compute,
}

/// A CUDA stream: ours (destroyed on drop) or an engine's (borrowed, never destroyed).
pub struct StreamHandle {
    raw: cusys::CUstream,
    rank: usize,
    owned: bool,
    role: StreamRole,
    device: Arc<Device>,
}

// SAFETY: a CUstream may be used from any thread with its context bound; the handle is not
// mutated after creation.
unsafe impl Send for StreamHandle {}
// SAFETY: as above.
unsafe impl Sync for StreamHandle {}

impl fmt::Debug for StreamHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamHandle").field("role", &self.role).field("owned", &self.owned).finish()
    }
}

impl StreamHandle {
    /// A new non-blocking stream with the role's priority.
    ///
    /// # Errors
    /// A driver error.
    pub fn new(device: &Arc<Device>, rank: usize, role: StreamRole) -> Result<Self, CudaError> {
        device.bind()?;
        // Numerically smaller is higher priority: `greatest` is the highest.
        let (least, greatest) = device.priority_range;
        let priority = match role {
            StreamRole::AllGather => greatest,
            StreamRole::ReduceScatter => (greatest + 1).min(least),
            StreamRole::Copy | StreamRole::Compute => least,
        };
        let raw =
            cu::stream::create_with_priority(cu::stream::StreamKind::NonBlocking, priority).map_err(|e| {
                CudaError::driver(
                    format!("device {}: creating the {role:?} stream", device.ordinal),
                    DriverCallError::new("cuStreamCreateWithPriority", e),
                )
            })?;
        Ok(StreamHandle { raw, rank, owned: true, role, device: Arc::clone(device) })
    }

    /// Wraps a stream the engine owns (e.g. `torch.cuda.current_stream().cuda_stream`).
    ///
    /// # Safety
    /// `raw` is a live stream of `device`'s primary context (or the null stream), and stays
    /// alive as long as this handle, the backend it is given to, and every buffer allocated
    /// from that backend.
    pub unsafe fn borrowed(
        device: &Arc<Device>,
        rank: usize,
        raw: cusys::CUstream,
        role: StreamRole,
    ) -> Self {
        StreamHandle { raw, rank, owned: false, role, device: Arc::clone(device) }
    }

    /// The raw handle.
    pub fn raw(&self) -> cusys::CUstream {
        self.raw
    }

    /// Its role.
    pub fn role(&self) -> StreamRole {
        self.role
    }

    /// Records a fresh event on this stream.
    ///
    /// # Errors
    /// A driver error.
    pub fn record(&self) -> Result<CudaEvent, CudaError> {
        let raw = self.device.take_event()?;
        let event =
            CudaEvent(Arc::new(EventInner { raw, rank: self.rank, device: Arc::clone(&self.device) }));
        self.device.bind()?;
        // SAFETY: `raw` is a live event and `self.raw` a live stream of the bound context.
        let r = unsafe { cu::event::record(raw, self.raw) };
        check("cuEventRecord", r)
            .map_err(|e| CudaError::driver(format!("recording an event on the {:?} stream", self.role), e))?;
        Ok(event)
    }

    /// Makes this stream wait for `event` (no host blocking).
    ///
    /// # Errors
    /// A driver error.
    pub fn wait(&self, event: &CudaEvent) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: both handles are live; the event was recorded (or never, which is a no-op).
        let r = unsafe {
            cu::stream::wait_event(self.raw, event.0.raw, cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        };
        check("cuStreamWaitEvent", r)
            .map_err(|e| CudaError::driver(format!("making the {:?} stream wait", self.role), e))
    }

    /// Blocks the host until the stream is idle.
    ///
    /// # Errors
    /// A driver error (including a failure of earlier work).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: `self.raw` is a live stream.
        let r = unsafe { cu::stream::synchronize(self.raw) };
        check("cuStreamSynchronize", r)
            .map_err(|e| CudaError::driver(format!("synchronizing the {:?} stream", self.role), e))
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let r = self.device.bind().and_then(|()| {
            // SAFETY: we created the stream and destroy it once; pending work still completes.
            let r = unsafe { cu::stream::destroy(self.raw) };
            check("cuStreamDestroy", r).map_err(|e| CudaError::driver("destroying a stream", e))
        });
        if let Err(e) = r {
            self.device.park.park(e);
        }
    }
}

struct EventInner {
    raw: cusys::CUevent,
    rank: usize,
    device: Arc<Device>,
}

// SAFETY: a CUevent is a driver handle usable from any thread; it is only recorded once, at
// creation, and only queried afterwards.
unsafe impl Send for EventInner {}
// SAFETY: as above.
unsafe impl Sync for EventInner {}

impl Drop for EventInner {
    fn drop(&mut self) {
        // Back to the device's event pool; a recorded-but-pending event may be re-recorded
        // later, which the driver allows (a record replaces the previous one).
        self.device.give_event(self.raw);
    }
}

/// A completion fence recorded on a stream. Cheap to clone.
#[derive(Clone)]
pub struct CudaEvent(Arc<EventInner>);

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaEvent({:p})", self.0.raw)
    }
}

/// How often [`CudaEvent::wait_for`] polls.
pub const EVENT_POLL: Duration = Duration::from_micros(50);

impl CudaEvent {
    /// `true` once the work before it completed.
    ///
    /// # Errors
    /// A driver error (a failure of the work before it).
    pub fn is_complete(&self) -> Result<bool, CudaError> {
        self.0.device.bind()?;
        // SAFETY: the event is live.
        match unsafe { cu::event::query(self.0.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == cusys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(CudaError::driver("querying an event", DriverCallError::new("cuEventQuery", e))),
        }
    }

    /// Polls until complete or `timeout`; `Ok(false)` on timeout.
    ///
    /// # Errors
    /// As [`CudaEvent::is_complete`].
    pub fn wait_for(&self, timeout: Duration) -> Result<bool, CudaError> {
        let start = Instant::now();
        loop {
            if self.is_complete()? {
                return Ok(true);
            }
            if start.elapsed() >= timeout {
                return Ok(false);
            }
            std::thread::sleep(EVENT_POLL);
        }
    }

    /// Blocks the host until complete (`cuEventSynchronize`).
    ///
    /// # Errors
    /// A driver error.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.0.device.bind()?;
        // SAFETY: the event is live.
        let r = unsafe { cu::event::synchronize(self.0.raw) };
        check("cuEventSynchronize", r).map_err(|e| CudaError::driver("waiting for an event", e))
    }

    /// The raw handle.
    pub fn raw(&self) -> cusys::CUevent {
        self.0.raw
    }

    /// The rank whose stream recorded it.
    pub fn rank(&self) -> usize {
        self.0.rank
    }
}

/// Size class of a request: 8 classes per power of two, at least 512 bytes.
pub fn size_class(bytes: usize) -> usize {
    let b = bytes.max(512);
    let step = (b.next_power_of_two() / 8).max(512);
    b.div_ceil(step) * step
}

struct Deferred {
    ptr: u64,
    class: usize,
    after: Vec<CudaEvent>,
}

struct PoolState {
    free: BTreeMap<usize, Vec<u64>>,
    deferred: Vec<Deferred>,
    fresh_allocations: u64,
    cached_bytes: usize,
}

/// The device memory pool of one rank.
pub struct BufferPool {
    device: Arc<Device>,
    state: Mutex<PoolState>,
    /// Streams fencing a free without events (one event each, recorded at the free).
    fence_streams: OnceLock<Vec<Arc<StreamHandle>>>,
}

impl fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = lock(&self.state);
        f.debug_struct("BufferPool")
            .field("cached_bytes", &s.cached_bytes)
            .field("deferred", &s.deferred.len())
            .field("fresh_allocations", &s.fresh_allocations)
            .finish()
    }
}

impl BufferPool {
    /// An empty pool on `device`.
    pub fn new(device: Arc<Device>) -> Arc<Self> {
        Arc::new(BufferPool {
            device,
            state: Mutex::new(PoolState {
                free: BTreeMap::new(),
                deferred: Vec::new(),
                fresh_allocations: 0,
                cached_bytes: 0,
            }),
            fence_streams: OnceLock::new(),
        })
    }

    /// Sets the streams that fence a free without events (the rank's streams). Once.
    pub fn set_fence_streams(&self, streams: Vec<Arc<StreamHandle>>) {
        let _ = self.fence_streams.set(streams);
    }

    /// How many blocks came from `cuMemAlloc` so far (steady-state steps add none).
    pub fn fresh_allocations(&self) -> u64 {
        lock(&self.state).fresh_allocations
    }

    /// Blocks waiting for their events.
    pub fn deferred_count(&self) -> usize {
        lock(&self.state).deferred.len()
    }

    /// Moves deferred blocks whose events all completed to the free lists. A failing event
    /// (the work before it failed) keeps its block and parks the error.
    pub fn reclaim(&self) {
        let mut s = lock(&self.state);
        let mut keep = Vec::new();
        for d in std::mem::take(&mut s.deferred) {
            let mut done = true;
            for e in &d.after {
                match e.is_complete() {
                    Ok(true) => {}
                    Ok(false) => {
                        done = false;
                        break;
                    }
                    Err(err) => {
                        self.device.park.park(err);
                        done = false;
                        break;
                    }
                }
            }
            if done {
                s.free.entry(d.class).or_default().push(d.ptr);
            } else {
                keep.push(d);
            }
        }
        s.deferred = keep;
    }

    /// A buffer of `bytes` bytes (contents unspecified), from the pool if possible.
    ///
    /// # Errors
    /// [`CudaError::Driver`] with `CUDA_ERROR_OUT_OF_MEMORY` when even an emptied pool cannot
    /// get the memory.
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<CudaBuffer, CudaError> {
        let class = size_class(bytes);
        self.reclaim();
        if let Some(ptr) = lock(&self.state).free.get_mut(&class).and_then(Vec::pop) {
            return Ok(CudaBuffer { ptr, len: bytes, owner: Owner::Pool { pool: Arc::clone(self), class } });
        }
        self.device.bind()?;
        let mut attempt = 0;
        loop {
            // SAFETY: the context is bound; the memory is handed out uninitialised, as documented.
            match unsafe { cu::malloc_sync(class) } {
                Ok(ptr) => {
                    let mut s = lock(&self.state);
                    s.fresh_allocations += 1;
                    s.cached_bytes += class;
                    tracing::debug!(target: "collsched::alloc", "cuMemAlloc {class} bytes (request {bytes})");
                    return Ok(CudaBuffer {
                        ptr,
                        len: bytes,
                        owner: Owner::Pool { pool: Arc::clone(self), class },
                    });
                }
                Err(e) if e.0 == cusys::CUresult::CUDA_ERROR_OUT_OF_MEMORY && attempt < 2 => {
                    attempt += 1;
                    if attempt == 1 {
                        // Wait for deferred blocks and reuse one of the class if there is one.
                        let pending: Vec<CudaEvent> =
                            lock(&self.state).deferred.iter().flat_map(|d| d.after.clone()).collect();
                        for ev in pending {
                            ev.synchronize()?;
                        }
                        self.reclaim();
                        if let Some(ptr) = lock(&self.state).free.get_mut(&class).and_then(Vec::pop) {
                            return Ok(CudaBuffer {
                                ptr,
                                len: bytes,
                                owner: Owner::Pool { pool: Arc::clone(self), class },
                            });
                        }
                    } else {
                        self.trim()?;
                    }
                }
                Err(e) => {
                    return Err(CudaError::driver(
                        format!("device {}: allocating {bytes} bytes (class {class})", self.device.ordinal),
                        DriverCallError::new("cuMemAlloc", e),
                    ))
                }
            }
        }
    }

    /// Returns every cached free block to the driver (deferred blocks stay).
    ///
    /// # Errors
    /// The first `cuMemFree` error.
    pub fn trim(&self) -> Result<(), CudaError> {
        self.device.bind()?;
        let blocks: Vec<(usize, u64)> = {
            let mut s = lock(&self.state);
            let blocks = std::mem::take(&mut s.free)
                .into_iter()
                .flat_map(|(c, v)| v.into_iter().map(move |p| (c, p)))
                .collect::<Vec<_>>();
            s.cached_bytes -= blocks.iter().map(|(c, _)| c).sum::<usize>();
            blocks
        };
        let mut first = None;
        for (_, ptr) in blocks {
            // SAFETY: a free-list block is ours, idle (its events completed) and freed once.
            if let Err(e) = unsafe { cu::free_sync(ptr) } {
                first.get_or_insert(CudaError::driver(
                    "returning pooled memory",
                    DriverCallError::new("cuMemFree", e),
                ));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Gives `buffer` back once every event in `after` completed. With no events, fences it
    /// with one event per stream of the rank, recorded now.
    pub fn free_after(&self, buffer: CudaBuffer, after: &[CudaEvent]) {
        let mut buffer = buffer;
        let owner = std::mem::replace(&mut buffer.owner, Owner::Borrowed);
        if let Owner::Pool { class, .. } = owner {
            self.defer(buffer.ptr, class, after.to_vec());
        }
    }

    fn defer(&self, ptr: u64, class: usize, mut after: Vec<CudaEvent>) {
        if after.is_empty() {
            for s in self.fence_streams.get().map(Vec::as_slice).unwrap_or(&[]) {
                match s.record() {
                    Ok(e) => after.push(e),
                    Err(e) => self.device.park.park(e),
                }
            }
        }
        lock(&self.state).deferred.push(Deferred { ptr, class, after });
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        // Wait for deferred blocks (their events), then free everything.
        let deferred = std::mem::take(&mut lock(&self.state).deferred);
        for d in deferred {
            for e in &d.after {
                if let Err(err) = e.synchronize() {
                    self.device.park.park(err);
                }
            }
            lock(&self.state).free.entry(d.class).or_default().push(d.ptr);
        }
        if let Err(e) = self.trim() {
            self.device.park.park(e);
        }
    }
}

enum Owner {
    Pool { pool: Arc<BufferPool>, class: usize },
    Borrowed,
}

/// Device memory: from a rank's pool (given back on drop, fenced by the rank's streams), or an
/// engine's (never freed by us).
pub struct CudaBuffer {
    ptr: u64,
    len: usize,
    owner: Owner,
}

impl fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if matches!(self.owner, Owner::Borrowed) { "borrowed" } else { "pooled" };
        write!(f, "CudaBuffer({:#x}, {} bytes, {kind})", self.ptr, self.len)
    }
}

impl CudaBuffer {
    /// Wraps memory an engine owns (a tensor's `data_ptr()`); never freed or pooled by us.
    ///
    /// # Safety
    /// `ptr` is device memory of the rank's device with at least `len` bytes, valid (and not
    /// freed by its owner) while this buffer or any work using it is alive.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        CudaBuffer { ptr, len, owner: Owner::Borrowed }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes (of the request; the block may be larger).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the engine owns it ([`CudaBuffer::from_raw`]).
    pub fn is_borrowed(&self) -> bool {
        matches!(self.owner, Owner::Borrowed)
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        if let Owner::Pool { pool, class } = std::mem::replace(&mut self.owner, Owner::Borrowed) {
            pool.defer(self.ptr, class, Vec::new());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_cover_the_request_with_little_waste() {
        for bytes in [0usize, 1, 511, 512, 513, 4096, 4097, 1 << 20, (1 << 20) + 1, 3 << 27, 123_456_789] {
            let c = size_class(bytes);
            assert!(c >= bytes && c >= 512, "{bytes} -> {c}");
            assert!(c as f64 <= (bytes.max(512) as f64) * 1.25 + 512.0, "{bytes} -> {c} wastes too much");
            assert_eq!(size_class(c), c, "a class is its own class");
        }
    }
}
