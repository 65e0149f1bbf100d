//! The device buffer pool of one rank, with deferred frees.
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
//! driver. A caller may name the block it wants back ([`BufferPool::alloc_preferring`]: a
//! bucket gathered again lands where it was, and the tensors a framework made over it stay
//! right); else the class's last freed block is handed out. When `cuMemAlloc` fails, the pool waits (at most its timeout, watching the
//! communicators of the work, so a peer's failure aborts them and the work ends) for its
//! deferred blocks and for everything queued on the rank's streams so far, and reuses what it
//! can. Only if all of that ended does it return its cached blocks to the driver and try once
//! more: `cuMemFree` may wait for the device to go idle, which work still pending (a collective
//! whose peer is gone) could put off forever. Otherwise the allocation fails as out of memory.
//!
//! # Teardown
//! Dropping the pool waits for its deferred blocks' events at most the backend's timeout, then
//! aborts the communicators their work uses and waits [`ABORT_GRACE`] more
//! ([`super::wait::drain`]); if they still have not completed (or the backend's own teardown
//! found the device wedged: [`BufferPool::leak_on_drop`]), it frees **nothing** and says so: a
//! block freed under running work could be handed to someone else by the driver, and
//! `cuMemFree` could wait for that work without a bound. The memory goes back at the process's
//! exit.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use collsched_kernels::cuda::DriverCallError;
use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;

use super::device::{lock, CudaEvent, Device, StreamHandle};
use super::error::CudaError;
use super::wait::{drain, wait_until, Drained, HostClock, ABORT_GRACE};
use crate::backend::BackendError;

/// Size class of a request: 8 classes per power of two, at least 512 bytes. A class is the
/// request rounded up to an eighth of the power of two at or below it, so it wastes at most
/// 12.5% (and 511 bytes of a small one).
pub fn size_class(bytes: usize) -> usize {
    let b = bytes.max(512);
    let below = 1usize << (usize::BITS - 1 - b.leading_zeros());
    let step = (below / 8).max(512);
    b.div_ceil(step) * step
}

/// The block to hand out of a size class's free list: the one at `key` if the list holds it
/// (0: none preferred), else the last one freed.
pub fn take_free(free: &mut Vec<u64>, key: u64) -> Option<u64> {
    let at = if key == 0 { None } else { free.iter().rposition(|&p| p == key) };
    match at {
        Some(i) => Some(free.remove(i)),
        None => free.pop(),
    }
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

/// What a rank's pool holds, in bytes of whole blocks ([`BufferPool::stats`]): device memory
/// outside any other allocator's count (torch's `memory_reserved()` does not see it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Every block the pool got from the driver and has not returned.
    pub reserved_bytes: usize,
    /// Blocks handed out: buffers alive (shards, gathered buckets, gradients, scratch).
    pub in_use_bytes: usize,
    /// Blocks given back whose work has not yet been seen complete.
    pub deferred_bytes: usize,
    /// Blocks free for reuse ([`BufferPool::empty_cache`] returns them to the driver).
    pub free_bytes: usize,
    /// Blocks got from `cuMemAlloc` so far.
    pub fresh_allocations: u64,
}

/// The device memory pool of one rank.
pub struct BufferPool {
    device: Arc<Device>,
    state: Mutex<PoolState>,
    /// How long waits for deferred blocks last (the backend's timeout).
    timeout: Duration,
    /// Set when teardown found the device wedged: the pool's `Drop` frees nothing.
    leak: AtomicBool,
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
    /// An empty pool on `device`; its waits for deferred blocks last at most `timeout` (the
    /// backend's).
    pub fn new(device: Arc<Device>, timeout: Duration) -> Arc<Self> {
        Arc::new(BufferPool {
            device,
            timeout,
            leak: AtomicBool::new(false),
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

    /// Makes the pool's `Drop` free nothing (the backend's teardown found work that may still
    /// run on the device).
    pub fn leak_on_drop(&self) {
        self.leak.store(true, Ordering::SeqCst);
    }

    /// How many blocks came from `cuMemAlloc` so far (steady-state steps add none).
    pub fn fresh_allocations(&self) -> u64 {
        lock(&self.state).fresh_allocations
    }

    /// What the pool holds now (deferred blocks whose work completed count as free).
    pub fn stats(&self) -> PoolStats {
        self.reclaim();
        let s = lock(&self.state);
        let free_bytes = s.free.iter().map(|(class, v)| class * v.len()).sum();
        let deferred_bytes = s.deferred.iter().map(|d| d.class).sum();
        PoolStats {
            reserved_bytes: s.cached_bytes,
            in_use_bytes: s.cached_bytes.saturating_sub(free_bytes + deferred_bytes),
            deferred_bytes,
            free_bytes,
            fresh_allocations: s.fresh_allocations,
        }
    }

    /// Returns the free blocks to the driver, as `torch.cuda.empty_cache()` does torch's, once
    /// the rank's streams are quiet (everything queued on them so far completed, waited for at
    /// most the pool's timeout, watching their communicators); blocks in use or deferred stay.
    /// Returns the bytes returned.
    ///
    /// `cuMemFree` synchronizes the whole context: work of other libraries (torch's streams,
    /// its own NCCL communicators) that never ends, a collective whose peer died, blocks it
    /// without a bound. Call it between steps, as `torch.cuda.empty_cache()`.
    ///
    /// # Errors
    /// A wedged device, streams still busy after the timeout (nothing is returned then:
    /// `cuMemFree` could wait for their work without a bound), or the driver's error.
    pub fn empty_cache(&self) -> Result<usize, CudaError> {
        if self.device.is_wedged() || self.leak.load(Ordering::SeqCst) {
            return Err(CudaError::Invalid {
                op: format!("device {}: empty_cache", self.device.ordinal()),
                what:
                    "the device is wedged (work that did not end after a failure): its memory stays with the \
                       process until it exits"
                        .into(),
            });
        }
        if !self.wait_for_pending()? {
            return Err(CudaError::Invalid {
                op: format!("device {}: empty_cache", self.device.ordinal()),
                what: format!(
                    "the rank's streams or its deferred blocks were still busy after {:?}; nothing was \
                     returned to the driver (cuMemFree could wait for that work without a bound); call it \
                     between steps, once the work queued so far can complete",
                    self.timeout
                ),
            });
        }
        self.reclaim();
        self.trim()
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
                        self.device.park().park(err);
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
        self.alloc_preferring(bytes, 0)
    }

    /// As [`BufferPool::alloc`], taking the free block at device address `key` when its class
    /// holds it (a bucket gathered again lands where it was: the views a framework made of it
    /// stay right); the last block freed otherwise ([`take_free`]).
    ///
    /// # Errors
    /// As [`BufferPool::alloc`].
    pub fn alloc_preferring(self: &Arc<Self>, bytes: usize, key: u64) -> Result<CudaBuffer, CudaError> {
        let class = size_class(bytes);
        self.reclaim();
        if let Some(ptr) = lock(&self.state).free.get_mut(&class).and_then(|free| take_free(free, key)) {
            return Ok(CudaBuffer { ptr, len: bytes, owner: Owner::Pool { pool: Arc::clone(self), class } });
        }
        self.device.bind()?;
        let mut attempt = 0;
        // Whether the deferred blocks' events and the rank's streams all passed (attempt 1).
        let mut quiet = false;
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
                        // Wait for deferred blocks and the rank's streams (all together, at
                        // most the timeout) and reuse a block of the class if there is one.
                        quiet = self.wait_for_pending()?;
                        if !quiet {
                            tracing::warn!(target: "collsched::alloc", "device {}: deferred blocks or the rank's streams still busy after {:?}; allocating {bytes} bytes without them", self.device.ordinal(), self.timeout);
                        }
                        self.reclaim();
                        if let Some(ptr) =
                            lock(&self.state).free.get_mut(&class).and_then(|free| take_free(free, key))
                        {
                            return Ok(CudaBuffer {
                                ptr,
                                len: bytes,
                                owner: Owner::Pool { pool: Arc::clone(self), class },
                            });
                        }
                    } else {
                        self.reclaim();
                        let deferred = lock(&self.state).deferred.len();
                        if quiet && deferred == 0 {
                            self.trim()?;
                            continue;
                        }
                        return Err(CudaError::driver(
                            format!(
                                "device {}: allocating {bytes} bytes (class {class}); the cached blocks were \
                                 not returned to the driver, since {deferred} deferred blocks or the rank's \
                                 streams were still busy after {:?} (cuMemFree could wait for them without a \
                                 bound); free buffers, or wait for the work using them, and retry",
                                self.device.ordinal(),
                                self.timeout
                            ),
                            DriverCallError::new("cuMemAlloc", e),
                        ));
                    }
                }
                Err(e) => {
                    return Err(CudaError::driver(
                        format!("device {}: allocating {bytes} bytes (class {class})", self.device.ordinal()),
                        DriverCallError::new("cuMemAlloc", e),
                    ))
                }
            }
        }
    }

    /// After an allocation failed, or before [`BufferPool::empty_cache`]: waits at most the
    /// pool's timeout for the deferred blocks' events and for an event recorded now on each of
    /// the rank's streams, watching their communicators (a failure aborts them, so the work ends; it stays theirs to report).
    /// Returns whether all of them passed.
    ///
    /// # Errors
    /// A driver error recording or querying an event (the work before it failed).
    fn wait_for_pending(&self) -> Result<bool, CudaError> {
        let mut pending: Vec<CudaEvent> =
            lock(&self.state).deferred.iter().flat_map(|d| d.after.clone()).collect();
        for s in self.fence_streams.get().map(Vec::as_slice).unwrap_or(&[]) {
            pending.push(s.record()?);
        }
        let all_done = || -> Result<bool, CudaError> {
            for ev in &pending {
                if !ev.is_complete()? {
                    return Ok(false);
                }
            }
            Ok(true)
        };
        let watch = || -> Result<(), CudaError> {
            for w in pending.iter().filter_map(CudaEvent::watch) {
                let _ = w.check();
            }
            Ok(())
        };
        wait_until(self.timeout, &mut HostClock::start(), all_done, watch)
    }

    /// Returns every cached free block to the driver (deferred blocks stay); the bytes returned.
    /// `cuMemFree` may wait for the device to go idle: call it only when nothing of the rank is
    /// pending. A block the driver refuses to free is leaked (it stays counted as reserved).
    ///
    /// # Errors
    /// The first `cuMemFree` error.
    pub fn trim(&self) -> Result<usize, CudaError> {
        self.device.bind()?;
        let blocks: Vec<(usize, u64)> = std::mem::take(&mut lock(&self.state).free)
            .into_iter()
            .flat_map(|(c, v)| v.into_iter().map(move |p| (c, p)))
            .collect();
        let (mut first, mut freed) = (None, 0);
        for (class, ptr) in blocks {
            // SAFETY: a free-list block is ours, idle (its events completed) and freed once.
            match unsafe { cu::free_sync(ptr) } {
                Ok(()) => freed += class,
                Err(e) => {
                    first.get_or_insert(CudaError::driver(
                        "returning pooled memory",
                        DriverCallError::new("cuMemFree", e),
                    ));
                }
            }
        }
        lock(&self.state).cached_bytes -= freed;
        first.map_or(Ok(freed), Err)
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
                    Err(e) => self.device.park().park(e),
                }
            }
        }
        lock(&self.state).deferred.push(Deferred { ptr, class, after });
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        let park = self.device.park().clone();
        let deferred = std::mem::take(&mut lock(&self.state).deferred);
        let events: Vec<&CudaEvent> = deferred.iter().flat_map(|d| d.after.iter()).collect();
        let wedged = if self.leak.load(Ordering::SeqCst) || self.device.is_wedged() {
            Drained::Wedged
        } else {
            // Wait for the deferred blocks' events, bounded (see the module docs).
            let mut errors = Vec::new();
            let all_done = || -> Result<bool, String> {
                for e in &events {
                    if !e.is_complete().map_err(|e| e.to_string())? {
                        return Ok(false);
                    }
                }
                Ok(true)
            };
            let watch_all = || -> Result<(), String> {
                for e in &events {
                    if let Some(w) = e.watch() {
                        w.check().map_err(|e| e.to_string())?;
                    }
                }
                Ok(())
            };
            let abort_all = || {
                let cause = BackendError::Shutdown {
                    rank: events.first().map_or(0, |e| e.rank()),
                    what: format!(
                        "the buffer pool was dropped with work pending after {:?}; its communicators were aborted",
                        self.timeout
                    ),
                };
                for e in &events {
                    if let Some(w) = e.watch() {
                        w.abort(cause.clone());
                    }
                }
            };
            let d = drain(
                self.timeout,
                ABORT_GRACE.min(self.timeout),
                &mut HostClock::start(),
                all_done,
                watch_all,
                abort_all,
                &mut errors,
            );
            for e in errors {
                park.park(e);
            }
            d
        };
        if wedged == Drained::Wedged {
            let s = lock(&self.state);
            park.park(format!(
                "device {}: the buffer pool was dropped while the device may still use its memory; {} bytes \
                 in {} blocks are left to the process's exit instead of freed",
                self.device.ordinal(),
                s.cached_bytes,
                s.free.values().map(Vec::len).sum::<usize>() + deferred.len()
            ));
            self.device.wedge();
            return;
        }
        for d in deferred {
            lock(&self.state).free.entry(d.class).or_default().push(d.ptr);
        }
        if let Err(e) = self.trim() {
            park.park(e);
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
    use super::{size_class, take_free};

    #[test]
    fn a_preferred_block_is_taken_where_the_list_holds_it_else_the_last_freed() {
        let mut free = vec![0x1000, 0x2000, 0x3000];
        assert_eq!(take_free(&mut free, 0x1000), Some(0x1000));
        assert_eq!(free, [0x2000, 0x3000], "the others keep their order");
        assert_eq!(take_free(&mut free, 0x9000), Some(0x3000), "not held: the last freed");
        assert_eq!(take_free(&mut free, 0), Some(0x2000), "none preferred: the last freed");
        assert_eq!(take_free(&mut free, 0x2000), None);
        assert!(free.is_empty());
    }

    #[test]
    fn size_classes_cover_the_request_with_little_waste() {
        for bytes in [
            0usize,
            1,
            511,
            512,
            513,
            4096,
            4097,
            1 << 20,
            (1 << 20) + 1,
            3 << 27,
            123_456_789,
            (1 << 30) + 1,
        ] {
            let c = size_class(bytes);
            assert!(c >= bytes && c >= 512, "{bytes} -> {c}");
            assert!(
                c - bytes.max(512) < 512 || c as f64 <= bytes as f64 * 1.125,
                "{bytes} -> {c} wastes too much"
            );
            assert_eq!(size_class(c), c, "a class is its own class");
        }
    }
}
