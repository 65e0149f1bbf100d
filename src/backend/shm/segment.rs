//! Shared memory between processes: the one place of the `shm` backend with `unsafe` code.
//!
//! A [`Segment`] is an anonymous memory file (`memfd_create`) mapped shared into this process.
//! It has no name in any filesystem: it lives as long as some process holds its descriptor or a
//! mapping of it, so a job that ends in any way (a SIGKILL included) leaves nothing behind.
//! Other processes get the descriptor through the bootstrap hub and map it with
//! [`Segment::map`].
//!
//! The rest of the backend touches a segment only through safe views: [`Segment::words`] (the
//! control block: every word an atomic, 64-bit words then the 32-bit words futexes wait on) and [`Segment::ptr_at`] (a bounds-checked raw pointer
//! into a buffer, dereferenced by the collectives under the rendezvous protocol, as the local
//! backend's pointers are).

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use rustix::mm::{MapFlags, ProtFlags};

/// A shared mapping of a memory file.
#[derive(Debug)]
pub(crate) struct Segment {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping is plain shared memory owned by this value; sending it to another thread
// moves that ownership. Access goes through atomics (`words`) or through raw pointers whose
// use the rendezvous protocol orders (`ptr_at`).
unsafe impl Send for Segment {}
// SAFETY: `&Segment` only hands out atomics and raw pointers, both fine to share.
unsafe impl Sync for Segment {}

impl Segment {
    /// A new memory file of `len` bytes (zeroed, sparse: pages are allocated when written),
    /// mapped shared.
    pub(crate) fn create(name: &str, len: usize) -> io::Result<Segment> {
        let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        Self::map_len(fd, len)
    }

    /// Maps a memory file another process created (its whole length).
    pub(crate) fn map(fd: OwnedFd) -> io::Result<Segment> {
        let len = usize::try_from(rustix::fs::fstat(&fd)?.st_size).map_err(|_| io::ErrorKind::InvalidData)?;
        Self::map_len(fd, len)
    }

    fn map_len(fd: OwnedFd, len: usize) -> io::Result<Segment> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a shared segment needs at least one byte",
            ));
        }
        // SAFETY: a fresh shared mapping of `len` bytes of a memory file at an address the kernel
        // chooses: it overlaps nothing of this process. The file is at least `len` long.
        let raw = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )?
        };
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Segment { ptr, len, fd })
    }

    /// The memory file, to hand to another process.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// `len` bytes at `offset`, if they lie inside the segment.
    pub(crate) fn ptr_at(&self, offset: usize, len: usize) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| self.ptr.as_ptr().wrapping_add(offset))
    }

    /// The offset of `ptr` in this segment, if it points into it.
    pub(crate) fn offset_of(&self, ptr: *const u8) -> Option<usize> {
        let off = (ptr as usize).checked_sub(self.ptr.as_ptr() as usize)?;
        (off < self.len).then_some(off)
    }

    /// The segment as atomic words (the control block of a job): its first `wide` 64-bit
    /// words (fewer if the segment is shorter), then the rest as 32-bit words (what a futex
    /// waits on). The two parts do not overlap.
    pub(crate) fn words(&self, wide: usize) -> (&[AtomicU64], &[AtomicU32]) {
        let wide = wide.min(self.len / 8);
        let narrow = (self.len - wide * 8) / 4;
        // SAFETY: the mapping is page aligned, so word `wide` (8-byte aligned) is 4-byte
        // aligned too; `wide` 8-byte words and then `narrow` 4-byte words lie inside it, one
        // after the other; it lives as long as `self`; and every process accesses these words
        // only as atomics of these sizes (this view, with the same `wide` in every process of
        // a job, is the only one the backend makes of the control segment).
        unsafe {
            let base = self.ptr.as_ptr();
            (
                std::slice::from_raw_parts(base.cast::<AtomicU64>(), wide),
                std::slice::from_raw_parts(base.add(wide * 8).cast::<AtomicU32>(), narrow),
            )
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map_len`, unmapped once; nothing borrowed from it (the
        // `words` view and raw pointers) outlives `self` in this backend: buffers keep their
        // arena (and so its segments) alive through an `Arc`.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!(target: "collsched::alloc", "munmap of a shared segment failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::Segment;

    #[test]
    fn the_wide_and_narrow_words_split_the_segment_without_overlap() {
        let seg = Segment::create("collsched-test", 4096 + 64).unwrap();
        let (wide, narrow) = seg.words(100);
        assert_eq!(wide.len(), 100);
        assert_eq!(narrow.len(), (4096 + 64 - 800) / 4);
        for v in narrow {
            v.store(u32::MAX, Ordering::Relaxed);
        }
        assert!(wide.iter().all(|w| w.load(Ordering::Relaxed) == 0), "a narrow word overlaps a wide one");
        wide[99].store(u64::MAX, Ordering::Relaxed);
        assert_eq!(narrow[0].load(Ordering::Relaxed), u32::MAX);
        // More wide words than the segment holds: all of it is wide.
        let (wide, narrow) = seg.words(1 << 20);
        assert_eq!((wide.len(), narrow.len()), ((4096 + 64) / 8, 0));
    }
}
