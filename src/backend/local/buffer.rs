//! Host buffers of the local backend and the per-rank pool they come from.

use std::alloc::{self, Layout};
use std::collections::HashMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use super::event::LocalEvent;
use super::sync::{Mutex, MutexGuard};
use crate::backend::{BackendBuffer, BackendError, BackendEvent};

/// Alignment of every local buffer: a cache line, so vectorized kernels start aligned.
pub const BUFFER_ALIGN: usize = 64;

/// Where a pool's buffers come from when not from the process heap: memory other processes
/// map too (the `shm` backend's arena). Every block is [`BUFFER_ALIGN`]-aligned, `cap` bytes,
/// and stays valid while the memory value lives (storages keep it alive).
pub(crate) trait HostMemory: Send + Sync + fmt::Debug {
    /// A block of `cap` bytes (a multiple of [`BUFFER_ALIGN`], not 0).
    ///
    /// # Errors
    /// [`BackendError::OutOfMemory`] naming the limit.
    fn alloc(&self, rank: usize, cap: usize) -> Result<NonNull<u8>, BackendError>;
    /// Takes a block back.
    fn release(&self, ptr: NonNull<u8>, cap: usize);
    /// Whether `len` bytes at `ptr` lie in this memory (so that peers can read them).
    fn contains(&self, ptr: *const u8, len: usize) -> bool;
}

/// Bytes owned through a raw pointer (not a `Box`), so that moving the owner around while
/// stream threads of other ranks read or write the bytes asserts nothing about uniqueness.
/// From the process heap, or from a [`HostMemory`] (kept alive by the storage).
struct Storage {
    ptr: NonNull<u8>,
    cap: usize,
    memory: Option<Arc<dyn HostMemory>>,
    /// Memory the caller owns ([`LocalBuffer::borrowed`]): never freed nor pooled here.
    borrowed: bool,
}

// SAFETY: `Storage` owns its allocation exclusively, like a `Box<[u8]>`; sending it to another
// thread moves that ownership. Concurrent access from stream threads goes through raw pointers
// under the rendezvous protocol in `rendezvous.rs`, never through `&Storage`.
unsafe impl Send for Storage {}
// SAFETY: `&Storage` only hands out `&[u8]` (through `LocalBuffer::as_bytes`), which is sound to
// share; mutation needs `&mut`.
unsafe impl Sync for Storage {}

impl Storage {
    fn layout(cap: usize) -> Layout {
        // `cap` is a multiple of BUFFER_ALIGN that fit in an isize when requested (checked in
        // `Storage::new`); this cannot fail then.
        Layout::from_size_align(cap, BUFFER_ALIGN).unwrap_or(Layout::new::<u8>())
    }

    fn new(rank: usize, cap: usize, memory: Option<&Arc<dyn HostMemory>>) -> Result<Self, BackendError> {
        if cap == 0 {
            return Ok(Storage {
                ptr: NonNull::<[u8; BUFFER_ALIGN]>::dangling().cast(),
                cap: 0,
                memory: None,
                borrowed: false,
            });
        }
        if let Some(m) = memory {
            return Ok(Storage {
                ptr: m.alloc(rank, cap)?,
                cap,
                memory: Some(Arc::clone(m)),
                borrowed: false,
            });
        }
        let layout = Layout::from_size_align(cap, BUFFER_ALIGN).map_err(|e| BackendError::OutOfMemory {
            rank,
            bytes: cap,
            what: e.to_string(),
        })?;
        // SAFETY: `layout` has a non-zero size (cap > 0).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| BackendError::OutOfMemory {
            rank,
            bytes: cap,
            what: "the system allocator returned null".into(),
        })?;
        Ok(Storage { ptr, cap, memory: None, borrowed: false })
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        if self.borrowed {
            return;
        }
        match &self.memory {
            Some(m) => m.release(self.ptr, self.cap),
            // SAFETY: allocated in `Storage::new` with exactly this layout, freed once.
            None if self.cap > 0 => unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) },
            None => {}
        }
    }
}

/// A host buffer of the local backend, from a rank's pool. Aligned to [`BUFFER_ALIGN`] bytes.
///
/// Its contents can be read and written directly while the caller owns it (not while a
/// collective has it: then it lives inside an [`crate::backend::InFlight`]).
pub struct LocalBuffer {
    storage: Storage,
    len: usize,
}

impl fmt::Debug for LocalBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalBuffer").field("len", &self.len).field("ptr", &self.storage.ptr).finish()
    }
}

impl LocalBuffer {
    /// A buffer over `len` bytes at `ptr` that the caller owns: a collective reads or writes
    /// them in place (a tensor of the engine's, say), and freeing the buffer only forgets it.
    ///
    /// Peers read a collective's inputs, so on the `shm` backend an input must lie in this
    /// rank's arena (memory its pool handed out); an output outside it is written by its
    /// owner alone, which the launch allows for all-gathers and broadcasts with an input and
    /// for reduce-scatters, and refuses for all-reduces.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes, must not be read or written by
    /// anyone else while a collective has the buffer, and must stay valid until every
    /// collective given the buffer completed (not merely until the buffer came back: a
    /// dropped [`crate::backend::InFlight`] may still run).
    pub unsafe fn borrowed(ptr: NonNull<u8>, len: usize) -> LocalBuffer {
        LocalBuffer { storage: Storage { ptr, cap: len, memory: None, borrowed: true }, len }
    }

    /// Whether the buffer is caller memory ([`LocalBuffer::borrowed`]).
    pub fn is_borrowed(&self) -> bool {
        self.storage.borrowed
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `storage` holds `cap >= len` initialized (zeroed at allocation) bytes, aligned,
        // owned by `self`; no stream thread touches them while the caller holds `&self` (buffers
        // in flight are owned by an `InFlight`, which exposes no access to them).
        unsafe { std::slice::from_raw_parts(self.storage.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.storage.ptr.as_ptr(), self.len) }
    }

    pub(super) fn as_ptr(&self) -> *const u8 {
        self.storage.ptr.as_ptr()
    }

    pub(super) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.storage.ptr.as_ptr()
    }
}

impl BackendBuffer for LocalBuffer {
    fn len(&self) -> usize {
        self.len
    }

    fn key(&self) -> usize {
        self.storage.ptr.as_ptr() as usize
    }
}

/// Sizes up to this are pooled by their exact (aligned) size.
const EXACT_CLASSES: usize = 1 << 20;

/// The capacity a request of `bytes` gets: its size rounded up to [`BUFFER_ALIGN`], and above
/// [`EXACT_CLASSES`] further up to one of 8 steps per power of two (at most 12.5% more), so
/// that buffers of nearly equal sizes (a bucket's gathered buffer, its unpacked copy, the
/// gradient bucket beside it) share one free list instead of each keeping its own.
fn class_of(bytes: usize) -> usize {
    let aligned = bytes.div_ceil(BUFFER_ALIGN).saturating_mul(BUFFER_ALIGN);
    if aligned <= EXACT_CLASSES {
        return aligned;
    }
    let step = (1usize << (usize::BITS - 1 - aligned.leading_zeros())) / 8;
    aligned.div_ceil(step).saturating_mul(step)
}

#[derive(Default)]
struct PoolInner {
    /// Free storage by capacity.
    free: HashMap<usize, Vec<Storage>>,
    /// Storage waiting for an event before it is free; `true` parks the event's failure.
    pending: Vec<(LocalEvent, Storage, bool)>,
    /// Fresh allocations so far (for tests and logs).
    allocations: u64,
}

impl PoolInner {
    /// Storage whose last use completed: onto its free list, or (the caller's memory,
    /// [`LocalBuffer::borrowed`]) forgotten.
    fn keep(&mut self, storage: Storage) {
        if !storage.borrowed {
            self.free.entry(storage.cap).or_default().push(storage);
        }
    }
}

/// One rank's buffer pool: exact size classes (rounded up to [`BUFFER_ALIGN`]), deferred frees,
/// and the parked error of a dropped in-flight collective.
pub(super) struct Pool {
    rank: usize,
    /// How long dropping the pool waits for a deferred free's event (the world's timeout).
    timeout: Duration,
    inner: Mutex<PoolInner>,
    parked: Mutex<Option<BackendError>>,
    /// Where fresh buffers come from: `None` for the process heap.
    memory: Option<Arc<dyn HostMemory>>,
}

impl Drop for Pool {
    /// Storage waiting for an event may still be read by peers (a deferred free's event
    /// completes only once every peer finished reading): wait for each event, bounded by the
    /// world's timeout, and leak the storage whose event did not complete cleanly rather than
    /// hand memory back that a peer thread may still touch.
    fn drop(&mut self) {
        let pending = std::mem::take(&mut self.lock().pending);
        for (event, storage, _) in pending {
            if let Err(e) = event.wait(self.timeout) {
                tracing::warn!(
                    target: "collsched::alloc",
                    rank = self.rank,
                    bytes = storage.cap,
                    "leaking a buffer whose deferred free did not complete before the pool was dropped: {e}"
                );
                std::mem::forget(storage);
            }
        }
    }
}

impl Pool {
    pub(super) fn new(rank: usize, timeout: Duration, memory: Option<Arc<dyn HostMemory>>) -> Self {
        let inner = PoolInner { pending: Vec::with_capacity(super::PREFILL), ..PoolInner::default() };
        Pool { rank, timeout, inner: Mutex::new(inner), parked: Mutex::new(None), memory }
    }

    fn lock(&self) -> MutexGuard<'_, PoolInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn park(&self, error: BackendError) {
        let mut p = self.parked.lock().unwrap_or_else(PoisonError::into_inner);
        if p.is_none() {
            *p = Some(error);
        }
    }

    pub(super) fn take_parked(&self) -> Result<(), BackendError> {
        match self.parked.lock().unwrap_or_else(PoisonError::into_inner).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn reap(&self, inner: &mut PoolInner) {
        let mut i = 0;
        while i < inner.pending.len() {
            match inner.pending[i].0.query() {
                Ok(false) => i += 1,
                done => {
                    let (_, s, park) = inner.pending.swap_remove(i);
                    if let (Err(e), true) = (done, park) {
                        self.park(e);
                    }
                    inner.keep(s);
                }
            }
        }
    }

    /// A buffer of `bytes`: the free one at address `key` if there is one of the size class,
    /// else the last one freed, else fresh storage.
    pub(super) fn alloc(&self, bytes: usize, key: usize) -> Result<LocalBuffer, BackendError> {
        let class = class_of(bytes);
        let mut inner = self.lock();
        if !inner.pending.is_empty() {
            self.reap(&mut inner);
        }
        if let Some(free) = inner.free.get_mut(&class) {
            let at = if key == 0 { None } else { free.iter().rposition(|s| s.ptr.as_ptr() as usize == key) };
            if let Some(storage) = at.map(|i| free.swap_remove(i)).or_else(|| free.pop()) {
                return Ok(LocalBuffer { storage, len: bytes });
            }
        }
        inner.allocations += 1;
        drop(inner);
        tracing::debug!(target: "collsched::alloc", rank = self.rank, bytes, "fresh local buffer");
        Ok(LocalBuffer { storage: Storage::new(self.rank, class, self.memory.as_ref())?, len: bytes })
    }

    /// Returns `buffer` now or once `after` completed. With `park`, a failure of `after` is
    /// parked for the rank's next fallible call (an in-flight collective dropped unfinished).
    pub(super) fn free(&self, buffer: LocalBuffer, after: Option<&LocalEvent>, park: bool) {
        let mut inner = self.lock();
        match after.map(|e| (e, e.query())) {
            Some((e, Ok(false))) => inner.pending.push((e.clone(), buffer.storage, park)),
            other => {
                if let (Some((_, Err(e))), true) = (other, park) {
                    self.park(e);
                }
                inner.keep(buffer.storage);
            }
        }
    }

    /// Whether peers of this rank can read `len` bytes at `ptr`: any memory of this process
    /// when the ranks are its threads, only the pool's memory when they are processes.
    pub(super) fn peers_can_read(&self, ptr: *const u8, len: usize) -> bool {
        self.memory.as_ref().is_none_or(|m| m.contains(ptr, len))
    }

    pub(super) fn allocations(&self) -> u64 {
        self.lock().allocations
    }
}

#[cfg(test)]
mod class_tests {
    use super::{class_of, BUFFER_ALIGN, EXACT_CLASSES};

    #[test]
    fn classes_cover_the_request_waste_at_most_an_eighth_and_group_near_sizes() {
        let mut last = 0;
        for bytes in (1..64 << 20).step_by(4093) {
            let c = class_of(bytes);
            assert!(c >= bytes && c.is_multiple_of(BUFFER_ALIGN), "{bytes} -> {c}");
            assert!(c >= last, "classes must not shrink as requests grow: {bytes} -> {c} after {last}");
            if bytes > EXACT_CLASSES {
                assert!(c as f64 <= bytes as f64 * 1.125 + BUFFER_ALIGN as f64, "{bytes} -> {c}");
            } else {
                assert!(c < bytes + BUFFER_ALIGN);
            }
            last = c;
        }
        // A 12.6 MB gathered buffer with padding and the 12.6 MB copy of its parameters.
        assert_eq!(class_of(12_600_000), class_of(12_603_392));
        assert_eq!(class_of(usize::MAX / 2), usize::MAX / 2 / BUFFER_ALIGN * BUFFER_ALIGN + BUFFER_ALIGN);
    }
}
