//! Where the ranks of a local collective meet, and the copies and reductions they then do on
//! each other's memory.
//!
//! # Protocol (one slot per sequence number of a (group, stream) channel)
//! 1. **Arrive.** Each member posts raw pointers to its buffers and its descriptions. A post
//!    that disagrees with the first one aborts the slot at once (`Mismatch`). The last arriver
//!    switches the slot to `Running` and freezes the posts.
//! 2. **Wait for everyone.** A member waits (spinning briefly, then sleeping) until the slot is
//!    `Running` or `Aborted`. If the timeout passes, or a missing member's stream has left for
//!    good, the waiter aborts the slot. A slot is aborted only while `Collecting`, so **no
//!    member has read anything** when it is: every post is withdrawn untouched.
//! 3. **Move data** (`moves.rs`). Each member copies into its own output (all-gather,
//!    broadcast, all-reduce's second half) and reads peers' inputs and, for all-gather in place
//!    and all-reduce's second half, chunks of peers' outputs that their owner does not write.
//!    Reductions are shared: every member's part is cut into pieces that any member's stream
//!    thread may take once done with its own, so a member may write pieces of a peer's output;
//!    each piece is written by exactly one thread. All-reduce has a middle barrier between its
//!    reduce-scatter half and its all-gather half.
//! 4. **Depart.** A member counts itself done and waits until every member is done: only then
//!    may its buffers be reused (its completion event fires after this). This wait has no
//!    timeout and needs none: every member in `Running` is a stream thread doing bounded copies,
//!    with panics caught.
//!
//! After an abort the channel stays poisoned: later collectives on it fail at once.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use super::moves::{self, Post};
use super::sync::{AtomicBool, AtomicU64, AtomicUsize, Condvar, Mutex, MutexGuard, SPIN};
use super::LocalConfig;
use crate::backend::CollectiveKind;
use crate::backend::{BackendError, CollRef, RankGroup, Stream};

/// What a member brings to a slot (the post inline: boxing it would allocate per collective).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Arrival {
    /// Its collectives.
    Ops(Post),
    /// It cannot take part (its stream failed before): abort the slot.
    Failed(BackendError),
}

#[derive(Clone, Debug)]
enum Abort {
    Mismatch(String),
    Timeout { missing: Vec<usize> },
    PeerFailed { missing: Vec<usize>, reason: String },
}

enum Phase {
    Collecting,
    /// Every member's post and the shared work counters (shared while the members move data).
    Running(Arc<Running>),
    Aborted(Abort),
}

/// What the members of a running collective share while they move data.
#[derive(Default)]
struct Running {
    /// Every member's post, in member order.
    posts: Vec<Post>,
    /// Per member: the next piece of the reductions into its output that nobody took yet (see
    /// [`reduce_shared`]).
    next: Vec<AtomicUsize>,
}

impl Running {
    fn with_capacity(n: usize) -> Self {
        Running { posts: Vec::with_capacity(n), next: Vec::with_capacity(n) }
    }

    /// Refills from a slot's posts (allocation-free once the vectors have grown to the group).
    fn fill(&mut self, posts: &mut [Option<Post>]) {
        self.posts.clear();
        self.posts.extend(posts.iter_mut().map(|p| p.take().unwrap_or_default()));
        self.next.clear();
        self.next.resize_with(posts.len(), AtomicUsize::default);
    }
}

struct Slot {
    seq: u64,
    posts: Vec<Option<Post>>,
    first: Option<usize>,
    arrived: usize,
    phase: Phase,
    mid: usize,
    done: usize,
    left: usize,
    /// The first member that failed while moving data, and its error: with reductions shared
    /// between the members, its failure may have left another member's output incomplete.
    failed: Option<(usize, BackendError)>,
}

#[derive(Default)]
struct ChanState {
    slots: Vec<Slot>,
    /// Retired slots' `posts` vectors and running posts lists, kept for reuse so that a
    /// steady-state collective allocates nothing.
    spare_posts: Vec<Vec<Option<Post>>>,
    spare_running: Vec<Arc<Running>>,
    /// The first aborted sequence number, its reason and the error its aborter reported.
    poisoned: Option<(u64, Abort, BackendError)>,
    /// Threads asleep on the condvar (no wake-up system call when there are none).
    sleepers: usize,
}

/// Per-world bookkeeping the channels consult: which (rank, stream) left for good.
pub(super) struct Departures {
    departed: Vec<[AtomicBool; 3]>,
    panicked: Vec<AtomicBool>,
}

impl Departures {
    pub(super) fn new(n: usize) -> Self {
        Departures {
            departed: (0..n).map(|_| Default::default()).collect(),
            panicked: (0..n).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    pub(super) fn set_panicked(&self, rank: usize) {
        self.panicked[rank].store(true, Ordering::SeqCst);
    }

    pub(super) fn set_departed(&self, rank: usize, stream: Stream) {
        self.departed[rank][stream.index()].store(true, Ordering::SeqCst);
    }

    fn departed(&self, rank: usize, stream: Stream) -> bool {
        self.departed.get(rank).is_some_and(|d| d[stream.index()].load(Ordering::SeqCst))
    }

    fn reason(&self, ranks: &[usize], stream: Stream) -> String {
        let panicked: Vec<usize> =
            ranks.iter().copied().filter(|&r| self.panicked[r].load(Ordering::SeqCst)).collect();
        if panicked.is_empty() {
            format!("their handles were dropped and their {stream} streams finished")
        } else {
            format!("ranks {panicked:?} panicked (their handles were dropped while unwinding)")
        }
    }
}

/// The meeting place of one (group, stream).
pub(super) struct Channel {
    group: RankGroup,
    departures: Arc<Departures>,
    stream: Stream,
    state: Mutex<ChanState>,
    cv: Condvar,
    epoch: AtomicU64,
}

/// Who is calling, for error messages and waits.
pub(crate) struct Caller<'a> {
    pub rank: usize,
    pub config: &'a LocalConfig,
    /// Whether spinning makes sense (the group fits the machine's cores).
    pub spin: bool,
}

impl Channel {
    pub(super) fn new(group: RankGroup, stream: Stream, departures: Arc<Departures>) -> Self {
        let n = group.len();
        let state = ChanState {
            slots: Vec::with_capacity(super::PREFILL),
            spare_posts: (0..super::PREFILL).map(|_| Vec::with_capacity(n)).collect(),
            spare_running: (0..super::PREFILL).map(|_| Arc::new(Running::with_capacity(n))).collect(),
            ..ChanState::default()
        };
        Channel {
            group,
            departures,
            stream,
            state: Mutex::new(state),
            cv: Condvar::new(),
            epoch: AtomicU64::new(0),
        }
    }

    pub(super) fn stream(&self) -> Stream {
        self.stream
    }

    pub(super) fn group(&self) -> &RankGroup {
        &self.group
    }

    fn lock(&self) -> MutexGuard<'_, ChanState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes every waiter: spinners through the epoch, sleepers through the condvar. Called with
    /// the state changed and the lock held (`st` is the locked state).
    fn notify(&self, st: &ChanState) {
        self.epoch.fetch_add(1, Ordering::Release);
        if st.sleepers > 0 {
            self.cv.notify_all();
        }
    }

    /// Wakes waiters so they re-check departures.
    pub(super) fn poke(&self) {
        let g = self.lock();
        self.notify(&g);
        drop(g);
    }

    /// Waits until `ready` holds or `deadline` passes (returns whether it held).
    fn wait_until<'a>(
        &'a self,
        mut g: MutexGuard<'a, ChanState>,
        caller: &Caller<'_>,
        deadline: Option<Instant>,
        mut ready: impl FnMut(&mut ChanState) -> bool,
    ) -> (MutexGuard<'a, ChanState>, bool) {
        let spin_until = (SPIN && caller.spin).then(|| Instant::now() + caller.config.spin);
        loop {
            if ready(&mut g) {
                return (g, true);
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return (g, false);
            }
            if let Some(until) = spin_until.filter(|&u| now < u) {
                let epoch = self.epoch.load(Ordering::Acquire);
                drop(g);
                // Spin politely: yielding lets a peer (or the engine) that shares our core run,
                // which matters when ranks outnumber cores.
                while self.epoch.load(Ordering::Acquire) == epoch && Instant::now() < until {
                    for _ in 0..16 {
                        std::hint::spin_loop();
                    }
                    std::thread::yield_now();
                }
                g = self.lock();
                continue;
            }
            let left = deadline.map_or(Duration::from_secs(3600), |d| d - now);
            g.sleepers += 1;
            g = self.cv.wait_timeout(g, left).unwrap_or_else(PoisonError::into_inner).0;
            g.sleepers -= 1;
        }
    }

    fn abort_error(
        &self,
        caller: &Caller<'_>,
        op: &CollRef,
        abort: &Abort,
        waited: Duration,
    ) -> BackendError {
        let op = Box::new(op.clone());
        let rank = caller.rank;
        match abort.clone() {
            Abort::Mismatch(detail) => BackendError::Mismatch { rank, op, detail },
            Abort::Timeout { missing } => BackendError::PeerTimeout { rank, op, missing, waited },
            Abort::PeerFailed { missing, reason } => BackendError::PeerFailed { rank, op, missing, reason },
        }
    }

    fn poison(&self, st: &mut ChanState, seq: u64, abort: Abort, error: &BackendError) {
        if st.poisoned.as_ref().is_none_or(|(s, _, _)| seq < *s) {
            st.poisoned = Some((seq, abort, error.clone()));
        }
    }

    /// Takes part in collective number `seq` of this channel; returns once this member's part is
    /// done and every member departed (or with the error every member gets). The four steps of
    /// the module docs, one method each.
    pub(super) fn run(
        &self,
        caller: &Caller<'_>,
        seq: u64,
        arrival: Arrival,
        op: &CollRef,
    ) -> Result<(), BackendError> {
        let Some(me) = self.group.position(caller.rank) else {
            return Err(BackendError::InvalidCollective {
                rank: caller.rank,
                op: Box::new(op.clone()),
                what: "this rank is not a member of the group".into(),
            });
        };
        let start = Instant::now();
        let st = self.arrive(caller, seq, me, arrival, op, start)?;
        let running = self.await_members(st, caller, seq, op, start)?;
        let result = self.move_data(caller, seq, me, running, op);
        self.depart(caller, seq, result, op)
    }

    /// Step 1, arrive: posts this member's collectives (or its failure) in slot `seq`; the last
    /// arriver starts the slot running. Returns the channel's lock, still held.
    fn arrive(
        &self,
        caller: &Caller<'_>,
        seq: u64,
        me: usize,
        arrival: Arrival,
        op: &CollRef,
        start: Instant,
    ) -> Result<MutexGuard<'_, ChanState>, BackendError> {
        let n = self.group.len();
        let mut st = self.lock();
        if let Some((pseq, abort, first)) = st.poisoned.clone() {
            if pseq <= seq {
                return Err(if pseq == seq {
                    self.abort_error(caller, op, &abort, start.elapsed())
                } else {
                    BackendError::Aborted {
                        rank: caller.rank,
                        op: Some(Box::new(op.clone())),
                        cause: Box::new(first),
                    }
                });
            }
        }
        let idx = match st.slots.iter().position(|s| s.seq == seq) {
            Some(i) => i,
            None => {
                let mut posts = st.spare_posts.pop().unwrap_or_default();
                posts.clear();
                posts.resize_with(n, || None);
                st.slots.push(Slot {
                    seq,
                    posts,
                    first: None,
                    arrived: 0,
                    phase: Phase::Collecting,
                    mid: 0,
                    done: 0,
                    left: 0,
                    failed: None,
                });
                st.slots.len() - 1
            }
        };
        match arrival {
            Arrival::Failed(cause) => {
                let abort = Abort::PeerFailed {
                    missing: vec![caller.rank],
                    reason: format!("it failed earlier: {cause}"),
                };
                let slot = &mut st.slots[idx];
                slot.arrived += 1;
                if matches!(slot.phase, Phase::Collecting) {
                    slot.phase = Phase::Aborted(abort.clone());
                }
                let err = BackendError::Aborted {
                    rank: caller.rank,
                    op: Some(Box::new(op.clone())),
                    cause: Box::new(cause),
                };
                self.poison(&mut st, seq, abort, &err);
                self.retire(&mut st, seq, false);
                self.notify(&st);
                return Err(err);
            }
            Arrival::Ops(post) => {
                let slot = &mut st.slots[idx];
                if matches!(slot.phase, Phase::Collecting) {
                    if let Some(f) = slot.first {
                        if let Some(detail) = self.compare(f, slot.posts[f].as_ref(), me, &post) {
                            slot.phase = Phase::Aborted(Abort::Mismatch(detail));
                        }
                    } else {
                        slot.first = Some(me);
                    }
                    slot.posts[me] = Some(post);
                    slot.arrived += 1;
                    if slot.arrived == n && matches!(slot.phase, Phase::Collecting) {
                        let mut running = st.spare_running.pop().unwrap_or_default();
                        let slot = &mut st.slots[idx];
                        match Arc::get_mut(&mut running) {
                            Some(r) => r.fill(&mut slot.posts),
                            None => {
                                let mut r = Running::with_capacity(n);
                                r.fill(&mut slot.posts);
                                running = Arc::new(r);
                            }
                        }
                        slot.phase = Phase::Running(running);
                    }
                    let slot = &st.slots[idx];
                    if !matches!(slot.phase, Phase::Collecting) {
                        self.notify(&st);
                    }
                } else {
                    slot.arrived += 1;
                }
            }
        }
        Ok(st)
    }

    /// Step 2: waits until every member arrived (or the slot aborted: a mismatch, a timeout, a
    /// member that will never come); returns the running slot's posts.
    fn await_members(
        &self,
        st: MutexGuard<'_, ChanState>,
        caller: &Caller<'_>,
        seq: u64,
        op: &CollRef,
        start: Instant,
    ) -> Result<Arc<Running>, BackendError> {
        let n = self.group.len();
        let deadline = start.checked_add(caller.config.timeout);
        let (mut st, ready) = self.wait_until(st, caller, deadline, |st| {
            let Some(slot) = st.slots.iter_mut().find(|s| s.seq == seq) else { return true };
            if !matches!(slot.phase, Phase::Collecting) {
                return true;
            }
            let gone: Vec<usize> = (0..n)
                .filter(|&q| slot.posts[q].is_none())
                .map(|q| self.group.ranks()[q])
                .filter(|&r| self.departures.departed(r, self.stream))
                .collect();
            if gone.is_empty() {
                return false;
            }
            let reason = self.departures.reason(&gone, self.stream);
            slot.phase = Phase::Aborted(Abort::PeerFailed { missing: gone, reason });
            true
        });
        let Some(slot) = st.slots.iter_mut().find(|s| s.seq == seq) else {
            return Err(BackendError::Internal {
                what: format!("rank {}: {op}: local rendezvous slot vanished", caller.rank),
            });
        };
        if !ready {
            let missing: Vec<usize> =
                (0..n).filter(|&q| slot.posts[q].is_none()).map(|q| self.group.ranks()[q]).collect();
            slot.phase = Phase::Aborted(Abort::Timeout { missing });
        }
        let running = match &slot.phase {
            Phase::Running(running) => running.clone(),
            Phase::Aborted(abort) => {
                let abort = abort.clone();
                let err = self.abort_error(caller, op, &abort, start.elapsed());
                self.poison(&mut st, seq, abort, &err);
                self.retire(&mut st, seq, false);
                self.notify(&st);
                return Err(err);
            }
            Phase::Collecting => {
                return Err(BackendError::Internal {
                    what: format!("rank {}: {op}: local rendezvous woke while collecting", caller.rank),
                })
            }
        };
        drop(st);
        Ok(running)
    }

    /// Step 3: moves this member's share of the data (`moves.rs`), with the middle barrier of an
    /// all-reduce; a panic is caught and reported as this member's failure.
    fn move_data(
        &self,
        caller: &Caller<'_>,
        seq: u64,
        me: usize,
        running: Arc<Running>,
        op: &CollRef,
    ) -> Result<(), BackendError> {
        let posts = &running.posts;
        let needs_mid = posts[me].iter().any(|o| o.desc.kind == CollectiveKind::AllReduce);
        let mut result = guarded(caller, op, || {
            moves::first_half(me, posts)?;
            let next = |q: usize| running.next[q].fetch_add(1, Ordering::Relaxed);
            moves::reduce_shared(me, posts, &next, caller.config.piece_bytes, caller.rank, op)
        });
        if needs_mid {
            self.barrier(caller, seq, |s| &mut s.mid, &result);
            if result.is_ok() {
                result = guarded(caller, op, || moves::second_half(me, posts));
            }
        }
        // Our reference goes before we count ourselves done, so that the last member out holds
        // the only one and can keep it for reuse.
        drop(running);
        result
    }

    /// Step 4, depart: counts this member done and waits for every member; a peer's failure while
    /// writing part of this member's output fails it too.
    fn depart(
        &self,
        caller: &Caller<'_>,
        seq: u64,
        mut result: Result<(), BackendError>,
        op: &CollRef,
    ) -> Result<(), BackendError> {
        self.barrier(caller, seq, |s| &mut s.done, &result);
        let mut st = self.lock();
        if result.is_ok() {
            // A peer's failure may have left part of our output unwritten.
            if let Some((peer, cause)) = st.slots.iter().find(|s| s.seq == seq).and_then(|s| s.failed.clone())
            {
                result = Err(BackendError::PeerKernel {
                    rank: caller.rank,
                    op: Box::new(op.clone()),
                    peer,
                    cause: Box::new(cause),
                });
            }
        }
        self.retire(&mut st, seq, true);
        drop(st);
        result
    }

    /// Counts this member into a barrier of slot `seq` and waits for all members.
    /// `result` is this member's outcome so far: a failure is recorded for the others.
    fn barrier(
        &self,
        caller: &Caller<'_>,
        seq: u64,
        counter: impl Fn(&mut Slot) -> &mut usize,
        result: &Result<(), BackendError>,
    ) {
        let n = self.group.len();
        let mut st = self.lock();
        if let Some(slot) = st.slots.iter_mut().find(|s| s.seq == seq) {
            if let (Err(e), None) = (result, &slot.failed) {
                slot.failed = Some((caller.rank, e.clone()));
            }
            let c = counter(slot);
            *c += 1;
            if *c == n {
                self.notify(&st);
            }
        }
        let (g, _) = self.wait_until(st, caller, None, |st| {
            st.slots.iter_mut().find(|s| s.seq == seq).is_none_or(|s| *counter(s) >= n)
        });
        drop(g);
    }

    /// Counts a member out of slot `seq`; the last one out removes it.
    fn retire(&self, st: &mut ChanState, seq: u64, ran: bool) {
        if let Some(i) = st.slots.iter().position(|s| s.seq == seq) {
            let slot = &mut st.slots[i];
            slot.left += 1;
            let all = if ran { self.group.len() } else { slot.arrived };
            if slot.left >= all {
                let slot = st.slots.swap_remove(i);
                st.spare_posts.push(slot.posts);
                if let Phase::Running(running) = slot.phase {
                    st.spare_running.push(running);
                }
            }
        }
    }

    /// Describes how post `b` of position `pb` differs from post `a` of position `pa`, if it does.
    fn compare(&self, pa: usize, a: Option<&Post>, pb: usize, b: &Post) -> Option<String> {
        let a = a?;
        let ra = self.group.ranks()[pa];
        let rb = self.group.ranks()[pb];
        let list = |p: &Post| p.iter().map(|o| o.desc.to_string()).collect::<Vec<_>>().join(", ");
        if a.len() != b.len() || a.iter().zip(b.iter()).any(|(x, y)| !x.desc.matches(&y.desc)) {
            return Some(format!("rank {ra} posted [{}], rank {rb} posted [{}]", list(a), list(b)));
        }
        None
    }
}

/// Runs `f`, turning a panic into an error (so the member still departs).
pub(crate) fn guarded(
    caller: &Caller<'_>,
    op: &CollRef,
    f: impl FnOnce() -> Result<(), BackendError>,
) -> Result<(), BackendError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(BackendError::Internal { what: format!("rank {}: {op}: a kernel panicked: {msg}", caller.rank) })
    })
}

/// The world's channels, created on first use, and who has left: the in-process
/// [`Meeting`](super::meeting::Meeting).
pub(super) struct Channels {
    map: Mutex<HashMap<(Stream, RankGroup), Arc<Channel>>>,
    departures: Arc<Departures>,
}

impl Channels {
    pub(super) fn new(n: usize) -> Self {
        Channels { map: Mutex::default(), departures: Arc::new(Departures::new(n)) }
    }

    pub(super) fn get(&self, stream: Stream, group: &RankGroup) -> Arc<Channel> {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        map.entry((stream, group.clone()))
            .or_insert_with(|| Arc::new(Channel::new(group.clone(), stream, Arc::clone(&self.departures))))
            .clone()
    }

    pub(super) fn departures(&self) -> &Departures {
        &self.departures
    }

    /// Wakes every channel of `stream` that `rank` belongs to (it just left).
    pub(super) fn poke(&self, rank: usize, stream: Stream) {
        let chans: Vec<Arc<Channel>> = {
            let map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
            map.values()
                .filter(|c| c.stream() == stream && c.group().position(rank).is_some())
                .cloned()
                .collect()
        };
        for c in chans {
            c.poke();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::backend::local::{LocalConfig, LocalWorld};
    use crate::backend::{Backend, BackendError, CollDesc, Collective, RankGroup, Stream, WaitError};
    use collsched_kernels::ElemType;

    /// A reduce-scatter with this tag panics in whichever thread takes piece 0 of member 0.
    use super::super::moves::FAIL_TAG;

    /// A member whose piece of a shared reduction fails (a kernel panic, caught) fails, and so
    /// does every other member, naming it: any output may lack that piece.
    #[test]
    fn a_failed_piece_fails_every_member() {
        let wait = Duration::from_secs(20);
        let config = LocalConfig { timeout: wait, piece_bytes: 64, ..LocalConfig::default() };
        let world = LocalWorld::with_config(3, config).expect("world");
        let out = world
            .run(|rank| {
                let (n, count) = (rank.world_size(), 1000);
                let input = rank.alloc(n * count * 4).expect("alloc");
                let output = rank.alloc(count * 4).expect("alloc");
                let desc =
                    CollDesc::reduce_scatter(RankGroup::world(n), ElemType::F32, count).with_tag(FAIL_TAG);
                let f = rank
                    .launch(Stream::ReduceScatter, &[], Collective { desc, input: Some(input), output })
                    .map_err(|e| e.error)
                    .expect("launch");
                match f.wait(wait) {
                    Err(WaitError::Failed { error, .. }) => error,
                    Ok(_) => panic!("rank {}: the collective succeeded", rank.rank()),
                    Err(e) => panic!("rank {}: {e}", rank.rank()),
                }
            })
            .expect("ranks");
        let errors: Vec<BackendError> = out.into_iter().map(|r| r.expect("no rank panicked")).collect();
        let failed: Vec<usize> = (0..3)
            .filter(|&r| {
                !matches!(errors[r], BackendError::PeerKernel { .. })
                    && errors[r].to_string().contains("injected failure")
            })
            .collect();
        assert_eq!(failed.len(), 1, "exactly one thread took the failing piece: {errors:#?}");
        let culprit = failed[0];
        for (r, e) in errors.iter().enumerate().filter(|&(r, _)| r != culprit) {
            match e {
                BackendError::PeerKernel { rank, peer, cause, .. } => {
                    assert_eq!((*rank, *peer), (r, culprit));
                    assert!(cause.to_string().contains("injected failure"), "{cause}");
                }
                other => panic!("rank {r}: expected PeerKernel, got {other}"),
            }
        }
    }
}
