//! Devices, streams and events.
//!
//! The device memory pool with deferred frees is [`super::pool`]; how host waits poll is
//! [`super::wait`]; what an event's [`Watch`] checks while the host waits is [`super::comms`].
//!
//! # Memory and streams the library does not own
//! [`CudaBuffer::from_raw`](super::CudaBuffer::from_raw) wraps an engine's device pointer; such
//! a buffer is never freed or pooled by us. [`StreamHandle::borrowed`] wraps an engine's
//! stream; it is never destroyed.
//!
//! # Bounded waits only
//! Nothing here blocks the host without a bound: there is no `cuStreamSynchronize` or
//! `cuEventSynchronize`. [`CudaEvent::wait_for`] and [`StreamHandle::drain`] poll as
//! [`super::wait`] says and give up at their timeout. A device whose streams could not drain at
//! teardown (or whose host copy timed out) is marked *wedged* ([`Device::wedge`]): its `Drop`
//! then leaks its kernels, events and context, and its streams are not destroyed, instead of
//! destroying them under running work.
//!
//! The kernels are compiled and loaded once, when the backend is built
//! ([`Device::load_kernels`]); launches only fetch them ([`Device::kernels`]).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use collsched_kernels::cuda::{check, loader, DriverCallError, KernelModule};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;

use super::comms::Watch;
use super::error::CudaError;
use super::park::ErrorPark;
use super::wait::{wait_until, HostClock};

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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
    /// Set when work may still run on the device at teardown ([`Device::wedge`]).
    wedged: AtomicBool,
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
            wedged: AtomicBool::new(false),
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

    /// Compiles (once per process and architecture) and loads (once per device) the kernels;
    /// the backend does it when it is built, so that no launch ever compiles or loads (which
    /// may synchronize the context, behind whatever its streams run).
    ///
    /// # Errors
    /// [`CudaError::Load`] (NVRTC missing), [`CudaError::Kernels`] (a compile or load error).
    pub fn load_kernels(&self) -> Result<&KernelModule, CudaError> {
        if let Some(k) = self.kernels.get() {
            return Ok(k);
        }
        self.bind()?;
        let k = KernelModule::load(self.arch)?;
        Ok(self.kernels.get_or_init(|| k))
    }

    /// The kernels [`Device::load_kernels`] loaded; never compiles or loads.
    ///
    /// # Errors
    /// [`CudaError::Invalid`] if they were not loaded (a bug: the backend loads them when it
    /// is built).
    pub fn kernels(&self) -> Result<&KernelModule, CudaError> {
        self.kernels.get().ok_or_else(|| CudaError::Invalid {
            op: format!("device {}: launching a kernel", self.ordinal),
            what: "the kernels were not loaded when the backend was built (a bug in collsched; please \
                   report it)"
                .into(),
        })
    }

    /// Marks the device wedged: teardown could not drain its streams (or a host copy did not
    /// complete in time), so work may still run on it. Its `Drop` then leaks its kernels,
    /// events and context, the streams and the pool free nothing (destroying them could wait
    /// for that work without a bound); the process should exit.
    pub fn wedge(&self) {
        self.wedged.store(true, Ordering::SeqCst);
    }

    /// Whether [`Device::wedge`] was called.
    pub fn is_wedged(&self) -> bool {
        self.wedged.load(Ordering::SeqCst)
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
        if self.is_wedged() {
            tracing::error!(target: "collsched::init", "CUDA device {}: work may still run on it after a failed teardown; its kernels, events and context are left to the process's exit", self.ordinal);
            // Unloading the module could wait for that work: leave it loaded.
            std::mem::forget(self.kernels.take());
            return;
        }
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
    /// What events recorded here watch by default (the communicators of this stream).
    watch: OnceLock<Watch>,
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
        Ok(StreamHandle { raw, rank, owned: true, role, device: Arc::clone(device), watch: OnceLock::new() })
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
        StreamHandle { raw, rank, owned: false, role, device: Arc::clone(device), watch: OnceLock::new() }
    }

    /// The raw handle.
    pub fn raw(&self) -> cusys::CUstream {
        self.raw
    }

    /// Its role.
    pub fn role(&self) -> StreamRole {
        self.role
    }

    /// Sets what events recorded here watch by default ([`StreamHandle::record`]). Once.
    pub fn set_watch(&self, watch: Watch) {
        let _ = self.watch.set(watch);
    }

    /// Records a fresh event on this stream, watching this stream's communicators (if set:
    /// [`StreamHandle::set_watch`]).
    ///
    /// # Errors
    /// A driver error.
    pub fn record(&self) -> Result<CudaEvent, CudaError> {
        self.record_with(self.watch.get().cloned())
    }

    /// Records a fresh event on this stream that watches `watch` (nothing with `None`: work
    /// that uses no communicator).
    ///
    /// # Errors
    /// A driver error.
    pub fn record_with(&self, watch: Option<Watch>) -> Result<CudaEvent, CudaError> {
        let raw = self.device.take_event()?;
        let event = CudaEvent(Arc::new(EventInner {
            raw,
            rank: self.rank,
            device: Arc::clone(&self.device),
            watch,
            seen_done: AtomicBool::new(false),
        }));
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

    /// Waits (on the host, at most `timeout`) until everything queued on the stream so far
    /// completed: `Ok(false)` if it had not by then. Polls as [`super::wait`] says; checks no
    /// communicator (callers that want that wait on a [`StreamHandle::record`]ed event).
    ///
    /// # Errors
    /// A driver error (including a failure of earlier work).
    pub fn drain(&self, timeout: Duration) -> Result<bool, CudaError> {
        self.record_with(None)?.wait_for(timeout)
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        // A wedged device's streams are left to the process's exit with its context (and a
        // driver shut down at the exit would only refuse).
        if !self.owned || self.device.is_wedged() {
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
    watch: Option<Watch>,
    /// Set once a query saw it complete (what comes after cannot undo that).
    seen_done: AtomicBool,
}

// SAFETY: a CUevent is a driver handle usable from any thread; it is only recorded once, at
// creation, and only queried afterwards; the other fields are Send and Sync.
unsafe impl Send for EventInner {}
// SAFETY: as above.
unsafe impl Sync for EventInner {}

impl Drop for EventInner {
    fn drop(&mut self) {
        // A wedged device's events may still be pending forever: leave them be.
        if self.device.is_wedged() {
            return;
        }
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

impl CudaEvent {
    /// `true` once the work before it completed (the device's word alone: `cuEventQuery`;
    /// [`BackendEvent::query`](crate::backend::BackendEvent::query) adds the watch).
    ///
    /// # Errors
    /// A driver error (a failure of the work before it).
    pub fn is_complete(&self) -> Result<bool, CudaError> {
        if self.0.seen_done.load(Ordering::Acquire) {
            return Ok(true);
        }
        self.0.device.bind()?;
        // SAFETY: the event is live.
        match unsafe { cu::event::query(self.0.raw) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == cusys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(CudaError::driver("querying an event", DriverCallError::new("cuEventQuery", e))),
        }
    }

    /// Polls until complete or `timeout` (as [`super::wait`] says: spin, yield, then capped
    /// sleeps); `Ok(false)` on timeout. Checks no communicator.
    ///
    /// # Errors
    /// As [`CudaEvent::is_complete`].
    pub fn wait_for(&self, timeout: Duration) -> Result<bool, CudaError> {
        wait_until(timeout, &mut HostClock::start(), || self.is_complete(), || Ok(()))
    }

    /// The communicators its work uses, if any (see [`super::comms`]).
    pub fn watch(&self) -> Option<&Watch> {
        self.0.watch.as_ref()
    }

    /// Whether a query already saw it complete.
    pub fn seen_done(&self) -> bool {
        self.0.seen_done.load(Ordering::Acquire)
    }

    /// Remembers that a query saw it complete (and no failure of its communicators before).
    pub(crate) fn mark_done(&self) {
        self.0.seen_done.store(true, Ordering::Release);
    }

    /// The raw handle.
    pub fn raw(&self) -> cusys::CUevent {
        self.0.raw
    }

    /// The rank whose stream recorded it.
    pub fn rank(&self) -> usize {
        self.0.rank
    }

    /// The device it was recorded on.
    pub fn device(&self) -> &Arc<Device> {
        &self.0.device
    }
}
