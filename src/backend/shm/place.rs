//! Where the processes of a collective meet: a control block in shared memory (one memory file
//! of rank 0's, mapped by every process), in which every (group, stream) has a channel and every
//! channel a ring of slots, one per sequence number in flight.
//!
//! The protocol is the local backend's (`backend/local/rendezvous.rs`) with atomics in place of
//! a mutex, and process liveness (pidfds) in place of dropped handles:
//! 1. **Arrive.** A member waits until its slot serves its sequence number, writes its post
//!    (each collective's description and the offsets of its buffers in its arena) and counts
//!    itself arrived. The last arriver compares every post with the first: a mismatch aborts
//!    the slot, else it starts running.
//! 2. **Wait for everyone.** A member waits until the slot runs or aborts. A member that never
//!    arrives aborts it: at once when its process exited or its backend was dropped, else after
//!    the timeout. Aborting is one compare-and-swap from `collecting`, so a slot runs or
//!    aborts, never both, and nobody read anything of an aborted slot.
//! 3. **Move data** with the local backend's code (`moves.rs`), on pointers translated into
//!    this process's mappings of the members' arenas; the shared reductions' piece counters
//!    live in the slot.
//! 4. **Depart.** A member counts itself done and waits until every member is done or dead;
//!    the last one out resets the slot for sequence number + ring size.
//!
//! A failed or aborted collective poisons its channel: later collectives on it fail at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use collsched_kernels::{ReduceOp, Scaling};
use rustix::thread::futex;
use rustix::time::Timespec;
use smallvec::SmallVec;

use super::arena::Arena;
use super::segment::Segment;
use crate::backend::desc::{elem_code, elem_of, kind_code, kind_of};
use crate::backend::local::meeting::{Meeting, Place};
use crate::backend::local::moves::{self, OpPost, Post, RawPtr, POST_INLINE};
use crate::backend::local::rendezvous::{guarded, Arrival, Caller};
use crate::backend::{
    BackendError, CollDesc, CollRef, CollectiveKind, GatherUnpack, OwnChunk, RankGroup, Stream,
};
use crate::bootstrap::Liveness;

use super::layout::*;

/// How often a waiting member runs its slower liveness checks (peers' processes, departures).
/// What a member's collective keeps to itself (not in the shared post): an all-gather's
/// unpack layout, a reduce-scatter's own chunk.
type Own = (Option<Arc<GatherUnpack>>, Option<OwnChunk>);

const SLOW_CHECKS: Duration = Duration::from_millis(10);
/// The longest sleep of a waiting member between two polls.
const SLEEP_MAX: Duration = SLOW_CHECKS;

/// What the places of one process share.
#[derive(Debug)]
struct Job {
    control: Segment,
    layout: Layout,
    arena: Arc<Arena>,
    liveness: Liveness,
}

impl Job {
    fn w(&self) -> &[AtomicU64] {
        self.control.words(self.layout.wide()).0
    }

    /// Channel `c`'s wake counter.
    fn wake_counter(&self, c: usize) -> &AtomicU32 {
        &self.control.words(self.layout.wide()).1[self.layout.wake(c)]
    }

    fn dead(&self, rank: usize) -> bool {
        self.liveness.is_dead(rank)
    }

    fn departed(&self, rank: usize, stream: Stream) -> bool {
        self.w()[self.layout.departed(rank)].load(Ordering::Acquire) & (1 << stream.index()) != 0
    }
}

/// The cross-process [`Meeting`] of a job.
#[derive(Debug)]
pub(crate) struct ShmMeeting {
    job: Arc<Job>,
    places: Mutex<HashMap<(Stream, RankGroup), Arc<ShmPlace>>>,
}

impl ShmMeeting {
    /// The meeting over `control` (rank 0 initialises it before the others map it).
    pub(crate) fn new(control: Segment, world: usize, arena: Arc<Arena>, liveness: Liveness) -> Self {
        let layout = Layout::new(world);
        ShmMeeting { job: Arc::new(Job { control, layout, arena, liveness }), places: Mutex::default() }
    }

    /// Writes the header of a fresh control block (rank 0, before handing it out).
    pub(crate) fn init(control: &Segment, world: usize) {
        let layout = Layout::new(world);
        let w = control.words(layout.wide()).0;
        w[1].store(world as u64, Ordering::Relaxed);
        w[2].store(CHANNELS as u64, Ordering::Relaxed);
        w[3].store(SLOTS as u64, Ordering::Relaxed);
        for c in 0..CHANNELS {
            for i in 0..SLOTS {
                w[layout.slot(c, i as u64) + SEQ].store(i as u64, Ordering::Relaxed);
            }
        }
        w[0].store(MAGIC, Ordering::Release);
    }

    /// Whether a mapped control block is one of this version for `world` ranks.
    pub(crate) fn check(control: &Segment, world: usize) -> bool {
        let layout = Layout::new(world);
        let w = control.words(layout.wide()).0;
        control.len() >= layout.bytes()
            && w[0].load(Ordering::Acquire) == MAGIC
            && w[1].load(Ordering::Relaxed) == world as u64
    }

    fn find_channel(&self, stream: Stream, group: &RankGroup) -> Option<usize> {
        let (w, l) = (self.job.w(), &self.job.layout);
        let mut bits = vec![0u64; l.gw];
        for &r in group.ranks() {
            bits[r / 64] |= 1 << (r % 64);
        }
        let key = bits.iter().fold(0xcbf2_9ce4_8422_2325u64 ^ stream.index() as u64, |h, &b| {
            (h ^ b).wrapping_mul(0x100_0000_01b3)
        }) | 1 << 63;
        for probe in 0..CHANNELS {
            let c = (key as usize).wrapping_add(probe) % CHANNELS;
            let base = l.chan(c);
            match w[base + KEY].compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    w[base + CSTREAM].store(stream.index() as u64, Ordering::Relaxed);
                    for (i, b) in bits.iter().enumerate() {
                        w[base + GROUP + i].store(*b, Ordering::Relaxed);
                    }
                    w[base + READY].store(1, Ordering::Release);
                    return Some(c);
                }
                Err(k) if k == key => {
                    let t = Instant::now();
                    while w[base + READY].load(Ordering::Acquire) == 0 && t.elapsed() < Duration::from_secs(5)
                    {
                        std::thread::yield_now();
                    }
                    let same = w[base + CSTREAM].load(Ordering::Relaxed) == stream.index() as u64
                        && bits
                            .iter()
                            .enumerate()
                            .all(|(i, b)| w[base + GROUP + i].load(Ordering::Relaxed) == *b);
                    if same {
                        return Some(c);
                    }
                }
                Err(_) => {}
            }
        }
        None
    }
}

impl Meeting for ShmMeeting {
    fn place(&self, stream: Stream, group: &RankGroup) -> Arc<dyn Place> {
        let mut places = self.places.lock().unwrap_or_else(PoisonError::into_inner);
        let place = places.entry((stream, group.clone())).or_insert_with(|| {
            Arc::new(ShmPlace {
                job: Arc::clone(&self.job),
                chan: self.find_channel(stream, group),
                group: group.clone(),
                stream,
                scratch: Mutex::new(Vec::new()),
            })
        });
        Arc::clone(place) as Arc<dyn Place>
    }

    fn departed(&self, rank: usize, stream: Stream) {
        self.job.w()[self.job.layout.departed(rank)].fetch_or(1 << stream.index(), Ordering::AcqRel);
    }

    fn panicked(&self, rank: usize) {
        self.job.w()[self.job.layout.departed(rank)].fetch_or(PANICKED_BIT, Ordering::AcqRel);
    }
}

/// One (group, stream)'s channel in the control block.
#[derive(Debug)]
struct ShmPlace {
    job: Arc<Job>,
    /// The channel, or `None` when the table is full.
    chan: Option<usize>,
    group: RankGroup,
    stream: Stream,
    /// Every member's post, translated into this process (reused: steady state allocates
    /// nothing here).
    scratch: Mutex<Vec<Post>>,
}

impl ShmPlace {
    fn w(&self) -> &[AtomicU64] {
        self.job.w()
    }

    fn bad(&self, rank: usize, op: &CollRef, what: impl Into<String>) -> BackendError {
        BackendError::InvalidCollective { rank, op: Box::new(op.clone()), what: what.into() }
    }

    /// Writes this member's post at word `at`.
    fn write_post(&self, at: usize, post: &Post, rank: usize, op: &CollRef) -> Result<(), BackendError> {
        if post.len() > MAX_OPS {
            return Err(self.bad(
                rank,
                op,
                format!(
                    "a group launch of {} collectives; the shm backend carries at most {MAX_OPS}",
                    post.len()
                ),
            ));
        }
        let w = self.w();
        let offset = |p: RawPtr, what: &str| -> Result<u64, BackendError> {
            self.job.arena.offset_of(p.0).map(|o| o as u64).ok_or_else(|| {
                self.bad(rank, op, format!("the {what} buffer is not from this rank's shared-memory pool"))
            })
        };
        for (i, o) in post.iter().enumerate() {
            let d = &o.desc;
            let has_src = !o.src.0.is_null();
            let src = if has_src { offset(o.src, "input")? } else { 0 };
            // An output outside the arena (memory of this process alone, `LocalBuffer::borrowed`)
            // goes by its address, for this process: only collectives whose peers never touch
            // the output may have one.
            // A reduce-scatter reading its own chunk apart is reduced by its owner alone: its
            // output goes as private, which keeps peers from taking pieces of it.
            let (dst, private) = match self.job.arena.offset_of(o.dst.0) {
                Some(off) if d.own_chunk.is_none() => (off as u64, false),
                _ => {
                    let peers_read_it = match d.kind {
                        CollectiveKind::AllGather => !has_src,
                        CollectiveKind::Broadcast => !has_src && d.root == rank,
                        CollectiveKind::AllReduce => true,
                        CollectiveKind::ReduceScatter => false,
                    };
                    if peers_read_it {
                        return Err(self.bad(
                            rank,
                            op,
                            "the output buffer is not from this rank's shared-memory pool, and peers read it \
                             (an all-reduce, or in place); allocate it from the backend",
                        ));
                    }
                    (o.dst.0 as u64, true)
                }
            };
            let op_code = match d.op {
                ReduceOp::Sum => 0,
                ReduceOp::Avg => 1,
            };
            let words = [
                kind_code(d.kind)
                    | elem_code(d.elem) << 8
                    | op_code << 16
                    | u64::from(has_src) << 24
                    | u64::from(private) << 25
                    | u64::from(d.own_part_in_place) << 26,
                d.root as u64,
                d.count as u64,
                u64::from(d.scaling.pre_divide.to_bits()) | u64::from(d.scaling.post_divide.to_bits()) << 32,
                d.tag,
                src,
                dst,
            ];
            for (k, v) in words.into_iter().enumerate() {
                w[at + 2 + i * OP_WORDS + k].store(v, Ordering::Relaxed);
            }
        }
        w[at + 1].store(post.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Collective `i` of the post at word `at`: its description and buffer offsets.
    fn read_op(&self, at: usize, i: usize) -> Option<(CollDesc, Option<usize>, usize, bool)> {
        let w = self.w();
        let v = |k: usize| w[at + 2 + i * OP_WORDS + k].load(Ordering::Relaxed);
        let w0 = v(0);
        let kind = kind_of(w0 & 0xff)?;
        let elem = elem_of((w0 >> 8) & 0xff)?;
        let op = if (w0 >> 16) & 0xff == 1 { ReduceOp::Avg } else { ReduceOp::Sum };
        let scaling = Scaling {
            pre_divide: f32::from_bits(v(3) as u32),
            post_divide: f32::from_bits((v(3) >> 32) as u32),
        };
        let desc = CollDesc {
            kind,
            root: v(1) as usize,
            group: self.group.clone(),
            elem,
            count: v(2) as usize,
            op,
            scaling,
            tag: v(4),
            unpack: None,
            own_part_in_place: (w0 >> 26) & 1 == 1,
            own_chunk: None,
            origin: None,
        };
        let src = ((w0 >> 24) & 1 == 1).then_some(v(5) as usize);
        Some((desc, src, v(6) as usize, (w0 >> 25) & 1 == 1))
    }

    fn descs(&self, at: usize) -> Vec<CollDesc> {
        let n = self.w()[at + 1].load(Ordering::Relaxed) as usize;
        (0..n.min(MAX_OPS)).filter_map(|i| self.read_op(at, i).map(|o| o.0)).collect()
    }

    /// The first group position whose post differs from position 0's, if any.
    fn first_mismatch(&self, slot: usize) -> Option<usize> {
        let (w, l) = (self.w(), &self.job.layout);
        let first = l.post(slot, 0);
        let len = w[first + 1].load(Ordering::Relaxed) as usize;
        // Compared op by op, allocating nothing (this runs on every collective).
        (1..self.group.len()).find(|&q| {
            let at = l.post(slot, q);
            w[at + 1].load(Ordering::Relaxed) as usize != len
                || (0..len.min(MAX_OPS)).any(|i| match (self.read_op(first, i), self.read_op(at, i)) {
                    (Some(a), Some(b)) => !a.0.matches(&b.0),
                    _ => true,
                })
        })
    }

    /// Every member's post as pointers into this process's mappings; this member's own
    /// collectives get back their unpack layouts and own chunks (`owns`, by collective, or
    /// empty).
    fn read_posts(
        &self,
        slot: usize,
        out: &mut Vec<Post>,
        rank: usize,
        owns: &[Own],
    ) -> Result<(), BackendError> {
        let l = &self.job.layout;
        out.resize_with(self.group.len(), SmallVec::new);
        for (q, post) in out.iter_mut().enumerate() {
            post.clear();
            let at = l.post(slot, q);
            let owner = self.group.ranks()[q];
            let n = self.w()[at + 1].load(Ordering::Relaxed) as usize;
            for i in 0..n.min(MAX_OPS) {
                let bad = || BackendError::Internal {
                    what: format!(
                        "rank {rank}: the post of rank {owner} in the shared control block is unreadable"
                    ),
                };
                let (mut desc, src, dst, private) = self.read_op(at, i).ok_or_else(bad)?;
                if let (true, Some((unpack, own))) = (owner == rank, owns.get(i)) {
                    desc.unpack = unpack.clone();
                    desc.own_chunk = *own;
                }
                let es = desc.elem.size();
                let src = match src {
                    Some(off) => {
                        self.job.arena.resolve(owner, off, desc.input_count() * es).ok_or_else(bad)?
                    }
                    None => std::ptr::null_mut(),
                };
                let dst = match (private, owner == rank) {
                    // This process's own memory, by its address here.
                    (true, true) => dst as *mut u8,
                    // Another process's: never touched here (`OpPost::private`).
                    (true, false) => std::ptr::null_mut(),
                    _ => self.job.arena.resolve(owner, dst, desc.output_count() * es).ok_or_else(bad)?,
                };
                post.push(OpPost { desc, src: RawPtr(src), dst: RawPtr(dst), private });
            }
        }
        Ok(())
    }

    /// Waits until `poll` gives a value (its argument: whether to run the slower liveness
    /// checks now), or `deadline` passes (`None`). Spins for the configured time when the
    /// machine has a core for every member, then sleeps on the channel's wake counter, which
    /// every change a member waits for bumps ([`ShmPlace::wake`]); a sleep lasts at most
    /// [`SLEEP_MAX`], so that the liveness checks still run.
    fn wait<T>(
        &self,
        caller: &Caller<'_>,
        deadline: Option<Instant>,
        mut poll: impl FnMut(bool) -> Option<T>,
    ) -> Option<T> {
        let start = Instant::now();
        let mut last_check = start;
        let mut nap = Duration::from_micros(20);
        loop {
            // Read before polling: a change after the poll moves the counter past `seen`, and
            // the sleep below then returns at once.
            let seen = self.chan.map(|c| self.job.wake_counter(c).load(Ordering::SeqCst));
            let now = Instant::now();
            let slow = now.duration_since(last_check) >= SLOW_CHECKS;
            if slow {
                last_check = now;
            }
            if let Some(v) = poll(slow) {
                return Some(v);
            }
            if deadline.is_some_and(|d| now >= d) {
                return None;
            }
            if caller.spin && now.duration_since(start) < caller.config.spin {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
                std::thread::yield_now();
            } else if let (Some(c), Some(seen)) = (self.chan, seen) {
                let left = deadline.map_or(SLEEP_MAX, |d| d.saturating_duration_since(now)).min(SLEEP_MAX);
                self.sleep(c, seen, left);
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
    }

    /// Sleeps on channel `c`'s wake counter while it still reads `seen`, at most `left`.
    fn sleep(&self, c: usize, seen: u32, left: Duration) {
        let sleepers = &self.w()[self.job.layout.chan(c) + SLEEPERS];
        let counter = self.job.wake_counter(c);
        // Counted in before the counter is read again, as a waker bumps the counter before it
        // reads the count: either this reads the bump or the waker sees this sleeper. (A
        // member whose process dies asleep stays counted: wakers then make a needless call.)
        sleepers.fetch_add(1, Ordering::SeqCst);
        if counter.load(Ordering::SeqCst) == seen {
            let timeout = Timespec { tv_sec: left.as_secs() as i64, tv_nsec: i64::from(left.subsec_nanos()) };
            // Woken, timed out, interrupted, or the counter had moved: every outcome is "poll
            // again", so the result says nothing the caller needs.
            let _ = futex::wait(counter, futex::Flags::empty(), seen, Some(&timeout));
        }
        sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Tells the channel's waiting members that something they may wait for changed: bumps
    /// its wake counter and wakes its sleepers, if any.
    fn wake(&self) {
        let Some(c) = self.chan else { return };
        self.job.wake_counter(c).fetch_add(1, Ordering::SeqCst);
        if self.w()[self.job.layout.chan(c) + SLEEPERS].load(Ordering::SeqCst) != 0 {
            // Shared (not process-private): the sleepers are other processes. A failure
            // leaves them to their timeout.
            let _ = futex::wake(self.job.wake_counter(c), futex::Flags::empty(), i32::MAX as u32);
        }
    }

    fn rank_list(&self, slot: usize) -> Vec<usize> {
        let w = self.w();
        (0..self.job.layout.world)
            .filter(|&r| w[slot + AMISS + r / 64].load(Ordering::Relaxed) & (1 << (r % 64)) != 0)
            .collect()
    }

    /// Aborts slot `slot` (if still collecting) for the members at `positions`.
    fn abort(&self, slot: usize, kind: u64, detail: u64, ranks: &[usize]) {
        let w = self.w();
        if w[slot + STATE].compare_exchange(COLLECTING, ABORTED, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            w[slot + AKIND].store(kind, Ordering::Relaxed);
            w[slot + ADETAIL].store(detail, Ordering::Relaxed);
            for &r in ranks {
                w[slot + AMISS + r / 64].fetch_or(1 << (r % 64), Ordering::Relaxed);
            }
            self.wake();
        }
    }

    fn poison(&self, c: usize, seq: u64, kind: u64, detail: u64) {
        let w = self.w();
        let base = self.job.layout.chan(c);
        if w[base + POISON].compare_exchange(0, seq + 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            w[base + PKIND].store(kind, Ordering::Relaxed);
            w[base + PDETAIL].store(detail, Ordering::Relaxed);
            self.wake();
        }
    }

    /// `Aborted` when an earlier collective of the channel failed.
    fn check_poison(&self, c: usize, seq: u64, rank: usize, op: &CollRef) -> Result<(), BackendError> {
        let w = self.w();
        let base = self.job.layout.chan(c);
        let p = w[base + POISON].load(Ordering::Acquire);
        if p == 0 || p > seq {
            return Ok(());
        }
        let detail = w[base + PDETAIL].load(Ordering::Relaxed) as usize;
        let reason = match w[base + PKIND].load(Ordering::Relaxed) {
            MISMATCH => "mismatched collectives".to_string(),
            TIMEOUT => "members did not arrive in time".to_string(),
            EXITED => format!("rank {detail}'s process exited"),
            DEPARTED => format!("rank {detail} dropped its backend"),
            ARRIVED_FAILED => format!("rank {detail} had failed earlier"),
            _ => format!("rank {detail} failed while moving data"),
        };
        let cause = BackendError::PeerFailed {
            rank,
            op: Box::new(CollRef { seq: Some(p - 1), ..op.clone() }),
            missing: vec![detail],
            reason,
        };
        Err(BackendError::Aborted { rank, op: Some(Box::new(op.clone())), cause: Box::new(cause) })
    }

    fn abort_error(&self, slot: usize, rank: usize, op: &CollRef, waited: Duration) -> BackendError {
        let w = self.w();
        let op = Box::new(op.clone());
        let detail = w[slot + ADETAIL].load(Ordering::Relaxed) as usize;
        let missing = self.rank_list(slot);
        match w[slot + AKIND].load(Ordering::Relaxed) {
            MISMATCH => {
                let l = &self.job.layout;
                let list = |q: usize| {
                    self.descs(l.post(slot, q)).iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
                };
                let (ra, rb) = (self.group.ranks()[0], self.group.ranks().get(detail).copied().unwrap_or(0));
                let detail = format!("rank {ra} posted [{}], rank {rb} posted [{}]", list(0), list(detail));
                BackendError::Mismatch { rank, op, detail }
            }
            TIMEOUT => BackendError::PeerTimeout { rank, op, missing, waited },
            EXITED => BackendError::PeerFailed { rank, op, missing, reason: "their processes exited".into() },
            DEPARTED => {
                let panicked = missing
                    .iter()
                    .any(|&r| w[self.job.layout.departed(r)].load(Ordering::Relaxed) & PANICKED_BIT != 0);
                let reason = if panicked {
                    "they panicked (their backends were dropped while unwinding)"
                } else {
                    "their backends were dropped and their streams finished"
                };
                BackendError::PeerFailed { rank, op, missing, reason: reason.into() }
            }
            _ => BackendError::PeerFailed {
                rank,
                op,
                missing: vec![detail],
                reason: "it failed earlier (its stream was poisoned)".into(),
            },
        }
    }

    /// Counts this member (position `me`) into barrier `which` of `slot` and waits until every
    /// member passed it or died before passing it; returns such a member.
    fn barrier(
        &self,
        caller: &Caller<'_>,
        slot: usize,
        me: usize,
        which: usize,
        result: &Result<(), BackendError>,
    ) -> Option<usize> {
        let (w, l) = (self.w(), &self.job.layout);
        let n = self.group.len() as u64;
        if result.is_err() {
            let _ = w[slot + FAILED].compare_exchange(
                0,
                caller.rank as u64 + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        let bits = l.passed(slot, which);
        w[bits + me / 64].fetch_or(1 << (me % 64), Ordering::AcqRel);
        if w[slot + which].fetch_add(1, Ordering::AcqRel) + 1 == n {
            self.wake();
        }
        let mut dead = None;
        self.wait(caller, None, |slow| {
            let count = w[slot + which].load(Ordering::Acquire);
            if count >= n {
                return Some(());
            }
            if slow {
                let gone = || {
                    (0..self.group.len())
                        .filter(|&q| w[bits + q / 64].load(Ordering::Acquire) & (1 << (q % 64)) == 0)
                        .map(|q| self.group.ranks()[q])
                        .filter(|&r| self.job.dead(r))
                };
                if let Some(r) = gone().next() {
                    dead.get_or_insert(r);
                }
                if count + gone().count() as u64 >= n {
                    return Some(());
                }
            }
            None
        });
        dead
    }
}

impl Place for ShmPlace {
    fn run(&self, caller: &Caller<'_>, seq: u64, arrival: Arrival, op: &CollRef) -> Result<(), BackendError> {
        let rank = caller.rank;
        let Some(c) = self.chan else {
            return Err(self.bad(
                rank,
                op,
                format!("the job uses more than {CHANNELS} distinct (group, stream) pairs, the shm backend's limit"),
            ));
        };
        let Some(me) = self.group.position(rank) else {
            return Err(self.bad(rank, op, "this rank is not a member of the group"));
        };
        let (w, l) = (self.w(), self.job.layout);
        let n = self.group.len();
        let start = Instant::now();
        let deadline = start.checked_add(caller.config.timeout);
        self.check_poison(c, seq, rank, op)?;
        let slot = l.slot(c, seq);

        // 1. Arrive: wait for the slot, post, count in.
        let dead_member = || self.group.ranks().iter().copied().find(|&r| r != rank && self.job.dead(r));
        if w[slot + SEQ].load(Ordering::Acquire) != seq {
            let got = self.wait(caller, deadline, |slow| {
                if w[slot + SEQ].load(Ordering::Acquire) == seq {
                    return Some(Ok(()));
                }
                if slow {
                    if let Err(e) = self.check_poison(c, seq, rank, op) {
                        return Some(Err(e));
                    }
                    if let Some(d) = dead_member() {
                        return Some(Err(BackendError::PeerFailed {
                            rank,
                            op: Box::new(op.clone()),
                            missing: vec![d],
                            reason: "its process exited".into(),
                        }));
                    }
                }
                None
            });
            match got {
                Some(r) => r?,
                None => {
                    return Err(BackendError::PeerTimeout {
                        rank,
                        op: Box::new(op.clone()),
                        missing: Vec::new(),
                        waited: start.elapsed(),
                    })
                }
            }
        }
        let at = l.post(slot, me);
        // The post in shared memory says what every member agreed on; an all-gather's unpack
        // layout and a reduce-scatter's own chunk are this member's alone and stay here.
        let owns: SmallVec<[Own; POST_INLINE]> = match &arrival {
            Arrival::Ops(post)
                if post.iter().any(|o| o.desc.unpack.is_some() || o.desc.own_chunk.is_some()) =>
            {
                post.iter().map(|o| (o.desc.unpack.clone(), o.desc.own_chunk)).collect()
            }
            _ => SmallVec::new(),
        };
        let failure = match arrival {
            Arrival::Failed(e) => Some(e),
            Arrival::Ops(post) => self.write_post(at, &post, rank, op).err(),
        };
        if let Some(cause) = failure {
            w[at].store(2, Ordering::Release);
            w[slot + ARRIVED].fetch_add(1, Ordering::AcqRel);
            self.abort(slot, ARRIVED_FAILED, rank as u64, &[rank]);
            self.poison(c, seq, ARRIVED_FAILED, rank as u64);
            return Err(BackendError::Aborted {
                rank,
                op: Some(Box::new(op.clone())),
                cause: Box::new(cause),
            });
        }
        w[at].store(1, Ordering::Release);
        if w[slot + ARRIVED].fetch_add(1, Ordering::AcqRel) + 1 == n as u64 {
            match self.first_mismatch(slot) {
                Some(q) => self.abort(slot, MISMATCH, q as u64, &[]),
                None => {
                    if w[slot + STATE]
                        .compare_exchange(COLLECTING, RUNNING, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        self.wake();
                    }
                }
            }
        }

        // 2. Wait for everyone.
        let not_arrived = || {
            (0..n).filter(|&q| w[l.post(slot, q)].load(Ordering::Acquire) == 0).map(|q| self.group.ranks()[q])
        };
        let state = self.wait(caller, deadline, |slow| {
            let st = w[slot + STATE].load(Ordering::Acquire);
            if st != COLLECTING {
                return Some(st);
            }
            if slow {
                // Lists are made only once something is wrong: waiting allocates nothing.
                if let Some(first) = not_arrived().find(|&r| self.job.dead(r)) {
                    let exited: Vec<usize> = not_arrived().filter(|&r| self.job.dead(r)).collect();
                    self.abort(slot, EXITED, first as u64, &exited);
                    return Some(w[slot + STATE].load(Ordering::Acquire));
                }
                if let Some(first) = not_arrived().find(|&r| self.job.departed(r, self.stream)) {
                    let gone: Vec<usize> =
                        not_arrived().filter(|&r| self.job.departed(r, self.stream)).collect();
                    self.abort(slot, DEPARTED, first as u64, &gone);
                    return Some(w[slot + STATE].load(Ordering::Acquire));
                }
            }
            None
        });
        let state = state.unwrap_or_else(|| {
            let missing: Vec<usize> = not_arrived().collect();
            self.abort(slot, TIMEOUT, missing.first().copied().unwrap_or(0) as u64, &missing);
            w[slot + STATE].load(Ordering::Acquire)
        });
        if state != RUNNING {
            let err = self.abort_error(slot, rank, op, start.elapsed());
            let kind = w[slot + AKIND].load(Ordering::Relaxed);
            self.poison(c, seq, kind, w[slot + ADETAIL].load(Ordering::Relaxed));
            return Err(err);
        }

        // 3. Move data.
        let mut posts = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        let mut result = self.read_posts(slot, &mut posts, rank, &owns);
        let next = |q: usize| w[l.next(slot) + q].fetch_add(1, Ordering::Relaxed) as usize;
        if result.is_ok() {
            result = guarded(caller, op, || {
                moves::first_half(me, &posts)?;
                moves::reduce_shared(me, &posts, &next, caller.config.piece_bytes, rank, op)
            });
        }
        let needs_mid =
            posts.get(me).is_some_and(|p| p.iter().any(|o| o.desc.kind == CollectiveKind::AllReduce));
        let mut dead = None;
        if needs_mid {
            dead = self.barrier(caller, slot, me, MID, &result);
            if result.is_ok() && dead.is_none() {
                result = guarded(caller, op, || moves::second_half(me, &posts));
            }
        }
        drop(posts);

        // 4. Depart.
        dead = self.barrier(caller, slot, me, DONE, &result).or(dead);
        if result.is_ok() {
            if let Some(peer) = dead {
                result = Err(BackendError::PeerFailed {
                    rank,
                    op: Box::new(op.clone()),
                    missing: vec![peer],
                    reason: "its process exited during the collective".into(),
                });
                self.poison(c, seq, EXITED, peer as u64);
            } else {
                let f = w[slot + FAILED].load(Ordering::Acquire);
                if f != 0 && f - 1 != rank as u64 {
                    let peer = (f - 1) as usize;
                    result = Err(BackendError::PeerKernel {
                        rank,
                        op: Box::new(op.clone()),
                        peer,
                        cause: Box::new(BackendError::Internal {
                            what: format!("rank {peer} failed while moving its part of the collective"),
                        }),
                    });
                }
            }
        }
        if result.is_err() {
            self.poison(c, seq, MOVE_FAILED, rank as u64);
        }
        if w[slot + LEFT].fetch_add(1, Ordering::AcqRel) + 1 == n as u64 {
            // Everyone is out: reset the slot for its next sequence number.
            for k in STATE..AMISS + 3 * l.gw {
                w[slot + k].store(0, Ordering::Relaxed);
            }
            for q in 0..n {
                w[l.next(slot) + q].store(0, Ordering::Relaxed);
                w[l.post(slot, q)].store(0, Ordering::Relaxed);
            }
            w[slot + SEQ].store(seq + SLOTS as u64, Ordering::Release);
            self.wake();
        }
        result
    }
}
