//! Where the members of a collective meet: the seam between the host backend's stream threads
//! and the memory its ranks share. In one process the ranks are threads and meet in a
//! [`Channel`] under a mutex (`rendezvous.rs`); across processes they meet in shared memory
//! (`backend::shm`). Both move the data with the same code (`moves.rs`).

use std::sync::Arc;

use super::rendezvous::{Arrival, Caller, Channel, Channels};
use crate::backend::{BackendError, CollRef, RankGroup, Stream};

/// A world's meeting places.
pub(crate) trait Meeting: Send + Sync {
    /// The meeting place of collectives of `group` on `stream` (created on first use).
    fn place(&self, stream: Stream, group: &RankGroup) -> Arc<dyn Place>;
    /// `rank` will post nothing more on `stream` (its stream thread left, or never started):
    /// members waiting for it stop waiting.
    fn departed(&self, rank: usize, stream: Stream);
    /// `rank`'s handle is being dropped while its thread unwinds from a panic.
    fn panicked(&self, rank: usize);
    /// Whether this place moves all-gathers with `moves.rs` (which places a
    /// [`GatherUnpack`](crate::backend::GatherUnpack)'s pieces); MPI's own all-gather does not.
    fn gathers_unpacked(&self) -> bool {
        true
    }
}

/// One (group, stream)'s meeting place.
pub(crate) trait Place: Send + Sync {
    /// Takes part in collective number `seq` of this place: returns once this member's part is
    /// done and every member departed, or with the error every member gets.
    fn run(&self, caller: &Caller<'_>, seq: u64, arrival: Arrival, op: &CollRef) -> Result<(), BackendError>;
}

impl Meeting for Channels {
    fn place(&self, stream: Stream, group: &RankGroup) -> Arc<dyn Place> {
        self.get(stream, group)
    }

    fn departed(&self, rank: usize, stream: Stream) {
        self.departures().set_departed(rank, stream);
        self.poke(rank, stream);
    }

    fn panicked(&self, rank: usize) {
        self.departures().set_panicked(rank);
    }
}

impl Place for Channel {
    fn run(&self, caller: &Caller<'_>, seq: u64, arrival: Arrival, op: &CollRef) -> Result<(), BackendError> {
        Channel::run(self, caller, seq, arrival, op)
    }
}
