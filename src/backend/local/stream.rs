//! Stream threads of the local backend: one thread per (rank, stream), running its work in
//! order.

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use crossbeam::utils::Backoff;
use smallvec::SmallVec;

use super::event::LocalEvent;
use super::meeting::Place;
use super::moves::Post;
use super::rendezvous::{Arrival, Caller};
use super::sync::{AtomicUsize, Condvar, Mutex, MutexGuard, SPIN};
use super::WorldShared;
use crate::backend::flight::FlightRecorder;
use crate::backend::{BackendError, BackendEvent, CollDesc, CollRef, RankGroup, Stream};

/// Host work enqueued on a stream.
pub(super) type HostFn = Box<dyn FnOnce() -> Result<(), BackendError> + Send>;

/// One item of a stream's queue. Collectives carry their post inline, not boxed, so that a
/// launch allocates nothing (the queue keeps its capacity).
#[allow(clippy::large_enum_variant)]
pub(super) enum Work {
    /// A (group of) collective(s).
    Coll {
        group: RankGroup,
        first: CollDesc,
        post: Post,
        after: SmallVec<[LocalEvent; 4]>,
        event: LocalEvent,
        /// Its flight recorder entry.
        flight: u64,
    },
    /// Complete an event when reached.
    Record(LocalEvent),
    /// Wait for an event before going on.
    Wait(LocalEvent),
    /// Run host code.
    Host { f: HostFn, event: LocalEvent },
}

/// The work queue of one stream thread: a deque that keeps its capacity, so that steady-state
/// sends allocate nothing (a linked channel would allocate a block every few dozen items).
pub(super) struct Queue {
    state: Mutex<QueueState>,
    cv: Condvar,
    /// Items in the deque (read without the lock while the thread spins for work).
    len: AtomicUsize,
}

#[derive(Default)]
struct QueueState {
    items: VecDeque<Work>,
    /// No more items will come (the rank's handle was dropped).
    closed: bool,
    /// The thread is gone (it could not start, or it died): sends fail.
    gone: bool,
    /// The thread is asleep on `cv` (a send must wake it).
    sleeping: bool,
}

impl Queue {
    pub(super) fn new() -> Self {
        let state = QueueState { items: VecDeque::with_capacity(super::PREFILL), ..QueueState::default() };
        Queue { state: Mutex::new(state), cv: Condvar::new(), len: AtomicUsize::new(0) }
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends `work`; drops it and fails if the thread is gone.
    pub(super) fn send(&self, work: Work) -> Result<(), QueueGone> {
        let mut st = self.lock();
        if st.gone {
            return Err(QueueGone);
        }
        st.items.push_back(work);
        self.len.store(st.items.len(), Ordering::Release);
        if st.sleeping {
            self.cv.notify_one();
        }
        Ok(())
    }

    /// No more items will come: the thread finishes the queue, then leaves.
    pub(super) fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        self.cv.notify_one();
    }

    fn set_gone(&self) {
        let mut st = self.lock();
        st.gone = true;
        // Whatever was queued will never run; dropping it drops its events' clones (waiters
        // time out, as they would on any stuck stream).
        st.items.clear();
        self.len.store(0, Ordering::Release);
    }

    /// The next item, or `None` once the queue is closed and empty. Spins briefly (as a
    /// channel would) before sleeping, so that back-to-back small launches need no wake-up.
    pub(super) fn recv(&self) -> Option<Work> {
        let backoff = Backoff::new();
        while SPIN && self.len.load(Ordering::Acquire) == 0 && !backoff.is_completed() {
            backoff.snooze();
        }
        let mut st = self.lock();
        loop {
            if let Some(w) = st.items.pop_front() {
                self.len.store(st.items.len(), Ordering::Release);
                return Some(w);
            }
            if st.closed {
                return None;
            }
            st.sleeping = true;
            st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
            st.sleeping = false;
        }
    }
}

/// The stream thread of a [`Queue`] is gone.
#[derive(Debug)]
pub(super) struct QueueGone;

/// Marks the queue gone when the thread leaves, even by unwinding.
struct GoneOnDrop(Arc<Queue>);

impl Drop for GoneOnDrop {
    fn drop(&mut self) {
        self.0.set_gone();
    }
}

/// Starts the thread of (`rank`, `stream`) and returns its queue. If the thread cannot be
/// started, the queue is gone at once (launches then fail with `Shutdown`).
pub(super) fn spawn(
    rank: usize,
    stream: Stream,
    shared: Arc<WorldShared>,
    flight: Arc<FlightRecorder>,
) -> Arc<Queue> {
    let queue = Arc::new(Queue::new());
    let rx = Arc::clone(&queue);
    let name = format!("collsched-r{rank}-{stream}");
    let started = std::thread::Builder::new().name(name).spawn(move || {
        let _gone = GoneOnDrop(Arc::clone(&rx));
        StreamThread { rank, stream, shared, flight, poison: None, places: HashMap::new() }.run(&rx)
    });
    if let Err(e) = started {
        tracing::error!(target: "collsched::init", rank, %stream, error = %e, "cannot start stream thread");
        queue.set_gone();
    }
    queue
}

struct StreamThread {
    rank: usize,
    stream: Stream,
    shared: Arc<WorldShared>,
    flight: Arc<FlightRecorder>,
    /// The first failure on this stream: every later item fails with it (CUDA's sticky errors).
    poison: Option<BackendError>,
    /// Channels used so far and the next sequence number on each.
    places: HashMap<RankGroup, (Arc<dyn Place>, u64)>,
}

impl StreamThread {
    fn run(mut self, rx: &Queue) {
        while let Some(work) = rx.recv() {
            self.step(work);
        }
        // Every collective this (rank, stream) will ever post has been posted: tell waiters.
        self.shared.meeting.departed(self.rank, self.stream);
    }

    fn fail(&mut self, e: BackendError) {
        if self.poison.is_none() {
            tracing::warn!(target: "collsched::coll", rank = self.rank, stream = %self.stream, error = %e, "stream failed");
            self.poison = Some(e);
        }
    }

    fn wait_for(&mut self, event: &LocalEvent) -> Result<(), BackendError> {
        match event.wait(self.shared.config.timeout) {
            Err(BackendError::EventTimeout { waited }) => {
                Err(BackendError::StreamWaitTimeout { rank: self.rank, stream: self.stream, waited })
            }
            other => other,
        }
    }

    fn step(&mut self, work: Work) {
        match work {
            Work::Record(event) => event.complete(self.poison.clone().map_or(Ok(()), Err)),
            Work::Wait(event) => {
                if self.poison.is_none() {
                    if let Err(e) = self.wait_for(&event) {
                        self.fail(e);
                    }
                }
            }
            Work::Host { f, event } => {
                let result = match self.poison.clone() {
                    Some(p) => Err(p),
                    None => catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
                        Err(BackendError::Internal {
                            what: format!("rank {}: host work on stream {} panicked", self.rank, self.stream),
                        })
                    }),
                };
                if let Err(e) = &result {
                    self.fail(e.clone());
                }
                event.complete(result);
            }
            Work::Coll { group, first, post, after, event, flight } => {
                self.flight.started(flight);
                let shared = Arc::clone(&self.shared);
                let spin = group.len() <= shared.cores;
                let entry = self
                    .places
                    .entry(group)
                    .or_insert_with_key(|g| (shared.meeting.place(self.stream, g), 0));
                let place = Arc::clone(&entry.0);
                let seq = entry.1;
                entry.1 += 1;
                let op = CollRef { desc: first, stream: self.stream, seq: Some(seq) };
                tracing::trace!(target: "collsched::coll", rank = self.rank, %op, ops = post.len(), "collective starts");
                let arrival = match self.poison.clone() {
                    Some(p) => Arrival::Failed(p),
                    None => match after.iter().try_for_each(|e| self.wait_for(e)) {
                        Ok(()) => Arrival::Ops(post),
                        Err(e) => Arrival::Failed(e),
                    },
                };
                let caller = Caller { rank: self.rank, config: &shared.config, spin };
                let result = place.run(&caller, seq, arrival, &op);
                if let Err(e) = &result {
                    self.fail(e.clone());
                }
                self.flight.ended(flight, &result);
                event.complete(result);
            }
        }
    }
}
