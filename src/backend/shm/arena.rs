//! Every rank's buffer memory: one memory file per rank (its arena), mapped by every process of
//! the job, so that a collective reads and writes peers' buffers in place, as the local backend
//! does between threads.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Mutex, PoisonError};

use super::segment::Segment;
use crate::backend::local::HostMemory;
use crate::backend::BackendError;

/// This process's view of the job's arenas: its own (which its pool allocates from) and every
/// peer's.
#[derive(Debug)]
pub(crate) struct Arena {
    rank: usize,
    /// Every rank's arena mapped here, by rank (this rank's own included).
    maps: Vec<Segment>,
    state: Mutex<ArenaState>,
}

#[derive(Debug, Default)]
struct ArenaState {
    /// First byte never handed out.
    bump: usize,
    /// Blocks given back, by size.
    free: HashMap<usize, Vec<usize>>,
}

impl Arena {
    /// The arenas of a job, `maps[r]` being rank `r`'s, `rank` this process's.
    pub(crate) fn new(rank: usize, maps: Vec<Segment>) -> Self {
        Arena { rank, maps, state: Mutex::default() }
    }

    /// This rank's arena's memory file.
    pub(crate) fn own_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.maps[self.rank].fd()
    }

    /// Where this rank's `ptr` lies in its own arena, if there.
    pub(crate) fn offset_of(&self, ptr: *const u8) -> Option<usize> {
        self.maps.get(self.rank)?.offset_of(ptr)
    }

    /// `len` bytes at `offset` of rank `rank`'s arena, in this process, if inside it.
    pub(crate) fn resolve(&self, rank: usize, offset: usize, len: usize) -> Option<*mut u8> {
        self.maps.get(rank)?.ptr_at(offset, len)
    }
}

impl HostMemory for Arena {
    fn alloc(&self, rank: usize, cap: usize) -> Result<NonNull<u8>, BackendError> {
        let own = &self.maps[self.rank];
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let offset = match st.free.get_mut(&cap).and_then(Vec::pop) {
            Some(off) => off,
            None => {
                let off = st.bump;
                match off.checked_add(cap).filter(|&end| end <= own.len()) {
                    Some(end) => st.bump = end,
                    None => {
                        return Err(BackendError::OutOfMemory {
                            rank,
                            bytes: cap,
                            what: format!(
                                "the rank's shared-memory arena holds {} bytes and {} are in use or pooled; raise \
                                 COLLSCHED_SHM_ARENA_BYTES",
                                own.len(),
                                st.bump
                            ),
                        })
                    }
                }
                off
            }
        };
        own.ptr_at(offset, cap).and_then(NonNull::new).ok_or_else(|| BackendError::Internal {
            what: format!("rank {rank}: arena block at {offset} of {cap} bytes outside the arena"),
        })
    }

    fn contains(&self, ptr: *const u8, len: usize) -> bool {
        self.offset_of(ptr).is_some_and(|off| self.maps[self.rank].ptr_at(off, len).is_some())
    }

    fn release(&self, ptr: NonNull<u8>, cap: usize) {
        if let Some(off) = self.offset_of(ptr.as_ptr()) {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            st.free.entry(cap).or_default().push(off);
        }
    }
}
