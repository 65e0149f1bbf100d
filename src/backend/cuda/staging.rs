//! Pinned host staging for the kernels' argument tables.
//!
//! A kernel's argument table (its copy pieces, its input pointers) is built on the host and must
//! reach device memory before the kernel runs. `cuMemcpyHtoDAsync` from pageable memory copies
//! through a driver buffer and may block the host (until the stream reaches the copy, or until
//! a staging buffer frees up), which on a busy stream stalls every pack, unpack and reduction.
//! So tables go through **pinned** host memory (`cuMemHostAlloc`), which the copy engine reads
//! directly and the copy call never waits for:
//!
//! 1. the table is written into an idle pinned block of a [`StagingRing`];
//! 2. `cuMemcpyHtoDAsync` copies it, on the kernel's stream, into a device scratch buffer of
//!    the pool (which goes back to the pool behind the kernel's event, as before);
//! 3. an event recorded on the stream right behind the copy fences the block: the block goes
//!    back to the ring with it, and the ring hands it out again only once `cuEventQuery` says
//!    the copy completed. A block is never overwritten while the copy engine may still read it,
//!    and the host never waits for one: when no idle block fits, a new one is allocated.
//!
//! Blocks have power-of-two sizes of at least [`MIN_BLOCK`] bytes; a request takes the smallest
//! idle block that fits. In steady state the ring holds as many blocks as copies are pending at
//! once (a handful) and allocates nothing. Pinned memory goes back to the driver only when the
//! backend is dropped (`cuMemFreeHost` may synchronize the device), and then only the blocks
//! whose copies completed; on a wedged device ([`Device::wedge`]) none.
//!
//! The ring's bookkeeping is generic over a [`Fence`], so the tests run it on fake fences.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use collsched_kernels::cuda::{check, DriverCallError};
use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;

use super::device::{lock, CudaEvent, Device, StreamHandle};
use super::error::CudaError;

/// The smallest staging block, in bytes.
pub const MIN_BLOCK: usize = 4096;

/// Something that says when the device is done reading a staging block.
pub trait Fence {
    /// `Ok(true)` once passed; `Err` when it can no longer say (the work before it failed).
    ///
    /// # Errors
    /// The failure, as words.
    fn passed(&self) -> Result<bool, String>;
}

impl Fence for CudaEvent {
    fn passed(&self) -> Result<bool, String> {
        self.is_complete().map_err(|e| e.to_string())
    }
}

/// A pinned host block: its address and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// The host address.
    pub addr: usize,
    /// Its size in bytes.
    pub size: usize,
}

/// What [`StagingRing::take`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// An idle block that fits, now the caller's.
    Idle(Block),
    /// None fits: allocate a block of this size (and tell [`StagingRing::adopt`]).
    Allocate(usize),
}

/// The bookkeeping of the staging blocks: idle ones, and ones a copy may still read (with the
/// fence that says when it is done). See the module docs.
#[derive(Debug)]
pub struct StagingRing<F> {
    idle: Vec<Block>,
    pending: Vec<(Block, F)>,
    blocks: usize,
    leaked: usize,
}

impl<F> Default for StagingRing<F> {
    fn default() -> Self {
        StagingRing { idle: Vec::new(), pending: Vec::new(), blocks: 0, leaked: 0 }
    }
}

/// The block size for a request of `bytes`.
pub fn block_size(bytes: usize) -> usize {
    bytes.max(MIN_BLOCK).next_power_of_two()
}

impl<F: Fence> StagingRing<F> {
    /// Moves the blocks whose fences passed to the idle list. A block whose fence failed is
    /// leaked (whether its copy ever ran is unknown); the failure goes to `errors`.
    pub fn reclaim(&mut self, errors: &mut Vec<String>) {
        let mut i = 0;
        while i < self.pending.len() {
            match self.pending[i].1.passed() {
                Ok(true) => {
                    let (b, _) = self.pending.swap_remove(i);
                    self.idle.push(b);
                }
                Ok(false) => i += 1,
                Err(e) => {
                    self.pending.swap_remove(i);
                    self.leaked += 1;
                    errors.push(e);
                }
            }
        }
    }

    /// A block for `bytes`: the smallest idle one that fits (after reclaiming), else what to
    /// allocate. Never waits.
    pub fn take(&mut self, bytes: usize, errors: &mut Vec<String>) -> Take {
        self.reclaim(errors);
        let size = block_size(bytes);
        let best = self.idle.iter().enumerate().filter(|(_, b)| b.size >= size).min_by_key(|(_, b)| b.size);
        match best.map(|(i, _)| i) {
            Some(i) => Take::Idle(self.idle.swap_remove(i)),
            None => Take::Allocate(size),
        }
    }

    /// Counts a block the caller allocated after [`Take::Allocate`] (it is the caller's now).
    pub fn adopt(&mut self) {
        self.blocks += 1;
    }

    /// Gives back a block a copy reads until `fence` passed.
    pub fn give_back(&mut self, block: Block, fence: F) {
        self.pending.push((block, fence));
    }

    /// Gives back a block no copy reads (the copy was refused).
    pub fn give_back_unused(&mut self, block: Block) {
        self.idle.push(block);
    }

    /// Forgets a block that a copy may read with no fence to say when it is done: it is never
    /// handed out or freed again.
    pub fn leak(&mut self, _block: Block) {
        self.leaked += 1;
    }

    /// Blocks owned: idle, pending and handed out (leaked ones not counted).
    pub fn blocks(&self) -> usize {
        self.blocks - self.leaked
    }

    /// Blocks given up on so far ([`StagingRing::leak`], failed fences).
    pub fn leaked(&self) -> usize {
        self.leaked
    }

    /// Teardown: reclaims, then hands out the idle blocks (to free) and the number of blocks
    /// still pending (to leak).
    pub fn release(&mut self, errors: &mut Vec<String>) -> (Vec<Block>, usize) {
        self.reclaim(errors);
        let still = self.pending.len();
        self.pending.clear();
        self.leaked += still;
        (std::mem::take(&mut self.idle), still)
    }
}

/// The pinned staging of one rank's kernel tables (see the module docs).
#[derive(Debug)]
pub struct PinnedStaging {
    device: Arc<Device>,
    ring: Mutex<StagingRing<CudaEvent>>,
    fresh: AtomicU64,
}

impl PinnedStaging {
    /// An empty staging on `device`.
    pub fn new(device: Arc<Device>) -> Self {
        PinnedStaging { device, ring: Mutex::new(StagingRing::default()), fresh: AtomicU64::new(0) }
    }

    /// How many pinned blocks were allocated so far (steady-state steps add none).
    pub fn fresh_blocks(&self) -> u64 {
        self.fresh.load(Ordering::Relaxed)
    }

    fn allocate(&self, size: usize) -> Result<Block, CudaError> {
        self.device.bind()?;
        // SAFETY: the context is bound; the block is written before the copy engine reads it.
        let p = unsafe { cu::malloc_host(size, cusys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(|e| {
            CudaError::driver(
                format!("device {}: allocating {size} bytes of pinned staging", self.device.ordinal()),
                DriverCallError::new("cuMemHostAlloc", e),
            )
        })?;
        let blocks = {
            let mut ring = lock(&self.ring);
            ring.adopt();
            ring.blocks()
        };
        self.fresh.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(target: "collsched::alloc", "cuMemHostAlloc {size} bytes of staging ({blocks} blocks)");
        Ok(Block { addr: p as usize, size })
    }

    /// Copies `bytes` to device address `dst` on `stream` through a pinned block; returns
    /// without waiting for the copy (see the module docs).
    ///
    /// # Errors
    /// A driver error (allocating, copying or recording the fence).
    ///
    /// # Safety
    /// `dst` has at least `bytes.len()` writable bytes of this device's memory, alive until the
    /// copy completed on `stream`.
    pub unsafe fn copy_to_device(
        &self,
        stream: &StreamHandle,
        dst: u64,
        bytes: &[u8],
    ) -> Result<(), CudaError> {
        if bytes.is_empty() {
            return Ok(());
        }
        let mut errors = Vec::new();
        let take = lock(&self.ring).take(bytes.len(), &mut errors);
        for e in errors {
            self.device.park().park(format!("a staging copy's fence failed; its block is leaked: {e}"));
        }
        let block = match take {
            Take::Idle(b) => b,
            Take::Allocate(size) => self.allocate(size)?,
        };
        // SAFETY: `block` has `size >= bytes.len()` bytes of pinned memory that nothing reads:
        // an idle block's last copy completed (its fence passed), a fresh one is new.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), block.addr as *mut u8, bytes.len()) };
        // SAFETY: the block's first `bytes.len()` bytes were just written and stay untouched
        // until the fence recorded below passed.
        let src = unsafe { std::slice::from_raw_parts(block.addr as *const u8, bytes.len()) };
        // SAFETY: `dst` holds `bytes.len()` bytes (the caller's promise); `src` is pinned and
        // stays unwritten until the copy completed (the fence).
        let r = unsafe { cu::memcpy_htod_async(dst, src, stream.raw()) };
        if let Err(e) = check("cuMemcpyHtoDAsync", r) {
            lock(&self.ring).give_back_unused(block);
            return Err(CudaError::driver(
                format!("device {}: staging a kernel table", self.device.ordinal()),
                e,
            ));
        }
        match stream.record_with(None) {
            Ok(fence) => {
                lock(&self.ring).give_back(block, fence);
                Ok(())
            }
            Err(e) => {
                lock(&self.ring).leak(block);
                Err(e)
            }
        }
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        let park = self.device.park().clone();
        let mut errors = Vec::new();
        let (idle, pending, leaked) = {
            let mut ring = lock(&self.ring);
            let (idle, pending) = ring.release(&mut errors);
            (idle, pending, ring.leaked())
        };
        if leaked > pending {
            tracing::warn!(target: "collsched::alloc", "device {}: {} pinned staging blocks were given up on (their copies' fences failed)", self.device.ordinal(), leaked - pending);
        }
        for e in errors {
            park.park(e);
        }
        if self.device.is_wedged() {
            park.park(format!(
                "device {}: {} pinned staging blocks are left to the process's exit (the device is wedged)",
                self.device.ordinal(),
                idle.len() + pending
            ));
            return;
        }
        if pending > 0 {
            park.park(format!(
                "device {}: {pending} pinned staging blocks a copy may still read are left to the process's exit",
                self.device.ordinal()
            ));
        }
        if idle.is_empty() {
            return;
        }
        if let Err(e) = self.device.bind() {
            park.park(e);
            return;
        }
        for b in idle {
            // SAFETY: an idle block came from cuMemHostAlloc, its last copy completed, and it is
            // freed once (the ring gave it up).
            if let Err(e) = unsafe { cu::free_host(b.addr as *mut std::ffi::c_void) } {
                park.park(CudaError::driver(
                    "freeing pinned staging",
                    DriverCallError::new("cuMemFreeHost", e),
                ));
            }
        }
    }
}

#[cfg(test)]
#[path = "staging_tests.rs"]
mod tests;
