//! The control block's layout: every word's place (a job's processes share it; nothing in it is
//! a pointer). 64-bit atomics first: per channel, key, stream, poison record, sleepers, group
//! bitmap, then a ring of slots; per slot: sequence number, state, counters, abort record,
//! barrier bitmaps, piece counters, then every member's post (its collectives and buffer
//! offsets). Then one 32-bit word per channel, on a cache line of its own: the channel's wake
//! counter, which sleeping members wait on (a futex).

pub(super) const MAGIC: u64 = 0x636f_6c6c_7368_6d02; // "collshm", version 2
/// Collectives one group launch may hold on this backend.
pub const MAX_OPS: usize = 8;
pub(super) const OP_WORDS: usize = 7;
pub(super) const POST_WORDS: usize = 2 + MAX_OPS * OP_WORDS;
/// Distinct (group, stream) pairs a job may use.
pub const CHANNELS: usize = 128;
/// Sequence numbers of one channel in flight at once.
pub(super) const SLOTS: usize = 8;

// Slot words.
pub(super) const SEQ: usize = 0;
pub(super) const STATE: usize = 1;
pub(super) const ARRIVED: usize = 2;
pub(super) const MID: usize = 3;
pub(super) const DONE: usize = 4;
pub(super) const LEFT: usize = 5;
pub(super) const FAILED: usize = 6;
pub(super) const AKIND: usize = 7;
pub(super) const ADETAIL: usize = 8;
pub(super) const AMISS: usize = 9;
// Channel words.
pub(super) const KEY: usize = 0;
pub(super) const READY: usize = 1;
pub(super) const CSTREAM: usize = 2;
pub(super) const POISON: usize = 3;
pub(super) const PKIND: usize = 4;
pub(super) const PDETAIL: usize = 5;
/// Members of the channel asleep on its wake counter (or about to be).
pub(super) const SLEEPERS: usize = 6;
pub(super) const GROUP: usize = 7;
const _: () = assert!(SLEEPERS < GROUP, "the channel header's words come before its group bitmap");
/// 32-bit words from one channel's wake counter to the next (a cache line).
const WAKE_STRIDE: usize = 16;

pub(super) const COLLECTING: u64 = 0;
pub(super) const RUNNING: u64 = 1;
pub(super) const ABORTED: u64 = 2;

// Why a slot aborted (AKIND) or a channel is poisoned (PKIND).
pub(super) const MISMATCH: u64 = 1;
pub(super) const TIMEOUT: u64 = 2;
pub(super) const EXITED: u64 = 3;
pub(super) const DEPARTED: u64 = 4;
pub(super) const ARRIVED_FAILED: u64 = 5;
pub(super) const MOVE_FAILED: u64 = 6;

/// Bit of the `departed` word of a rank whose handle was dropped while panicking.
pub(super) const PANICKED_BIT: u64 = 1 << 8;

/// Where everything sits in the control block of a job of `world` ranks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    pub(super) world: usize,
    /// Words of a rank bitmap.
    pub(super) gw: usize,
    hdr: usize,
    chan_hdr: usize,
    slot_words: usize,
    chan_words: usize,
}

impl Layout {
    pub(crate) fn new(world: usize) -> Self {
        let gw = world.div_ceil(64);
        let hdr = (8 + world).next_multiple_of(8);
        let chan_hdr = (GROUP + gw).next_multiple_of(8);
        let slot_words = (AMISS + 3 * gw + world + world * POST_WORDS).next_multiple_of(8);
        let chan_words = chan_hdr + SLOTS * slot_words;
        Layout { world, gw, hdr, chan_hdr, slot_words, chan_words }
    }

    /// 64-bit words of the control block (the 32-bit wake counters follow them).
    pub(crate) fn wide(&self) -> usize {
        self.hdr + CHANNELS * self.chan_words
    }

    /// Bytes of the control block.
    pub(crate) fn bytes(&self) -> usize {
        self.wide() * 8 + CHANNELS * WAKE_STRIDE * 4
    }

    /// Channel `c`'s wake counter, among the 32-bit words.
    pub(super) fn wake(&self, c: usize) -> usize {
        c * WAKE_STRIDE
    }

    pub(super) fn departed(&self, rank: usize) -> usize {
        8 + rank
    }

    pub(super) fn chan(&self, c: usize) -> usize {
        self.hdr + c * self.chan_words
    }

    pub(super) fn slot(&self, c: usize, seq: u64) -> usize {
        self.chan(c) + self.chan_hdr + (seq % SLOTS as u64) as usize * self.slot_words
    }

    /// The bitmap of the members (group positions) past barrier `which` (`MID` or `DONE`).
    pub(super) fn passed(&self, slot: usize, which: usize) -> usize {
        slot + AMISS + self.gw * if which == MID { 1 } else { 2 }
    }

    pub(super) fn next(&self, slot: usize) -> usize {
        slot + AMISS + 3 * self.gw
    }

    pub(super) fn post(&self, slot: usize, q: usize) -> usize {
        slot + AMISS + 3 * self.gw + self.world + q * POST_WORDS
    }
}

#[cfg(test)]
mod tests {
    use super::{Layout, CHANNELS, WAKE_STRIDE};

    #[test]
    fn wake_counters_follow_the_wide_words_each_on_a_line_of_its_own() {
        for world in [1, 2, 3, 64, 65, 300] {
            let l = Layout::new(world);
            // The last channel's last word ends before the wake counters start.
            assert!(l.chan(CHANNELS - 1) + l.chan_words <= l.wide(), "world {world}");
            let end = l.wide() * 8 + (l.wake(CHANNELS - 1) + 1) * 4;
            assert!(
                end <= l.bytes(),
                "world {world}: the last wake counter ends at {end}, past {}",
                l.bytes()
            );
            let lines: std::collections::HashSet<usize> =
                (0..CHANNELS).map(|c| (l.wide() * 8 + l.wake(c) * 4) / 64).collect();
            assert_eq!(
                lines.len(),
                CHANNELS,
                "world {world}: two channels' wake counters share a cache line"
            );
            assert_eq!(l.wake(1) - l.wake(0), WAKE_STRIDE);
        }
    }
}
