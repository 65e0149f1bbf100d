//! One rank's NCCL communicators, one per (group, stream), and what their failures do.
//!
//! # Failure handling
//! NCCL reports a failure of a collective that already returned (a peer that died, a network
//! error, a timeout inside NCCL) only when asked (`ncclCommGetAsyncError`), and a collective
//! whose peer is gone never completes: without asking, a host wait would end only at the
//! backend's timeout, and teardown would hang in `ncclCommDestroy` or a stream synchronize.
//! So:
//! - **watched waits**: an event carries a [`Watch`] of the communicators its work uses (the
//!   (group, stream) of the collective a launch recorded it behind; every group's on the
//!   stream for an event recorded on a stream). A host wait on it checks their asynchronous
//!   errors while it waits ([`super::wait`] says how often): an error aborts the rank's
//!   communicators (below), so the work ends, and the wait then returns a
//!   [`BackendError::Device`] naming the collective, its rank, stream and NCCL's words, instead
//!   of waiting for the timeout.
//! - **abort**: a failure of a peer (such an asynchronous error, or a host wait that gave up
//!   after at least the backend's timeout, [`Watch::patience`]) aborts **every** communicator
//!   of the rank ([`CommTable::abort_all`]): a dead peer leaves kernels of every communicator
//!   it is a member of spinning, and the world is rebuilt after a failure anyway (the
//!   collective-matching rule). An NCCL call failing at launch aborts its own (group, stream)
//!   ([`CommTable::abort`]): that rank alone is out of step there.
//! - **aborts run off the caller's thread**: `ncclCommAbort` frees NCCL's pinned host memory
//!   (`cudaFreeHost`), which waits for the device to go idle; with kernels of another
//!   communicator still spinning that wait never ends. So an abort marks its (group, stream)
//!   aborted and takes the communicator out of the table on the caller's thread, then runs
//!   `ncclCommAbort` on a thread of its own (`collsched-abort-...`), its error parked in the
//!   [`ErrorPark`]. Every abort of a failure is started before any is waited for; nobody waits
//!   for one but teardown, bounded ([`CommTable::aborts_pending`], [`CommTable::wait_aborts`]),
//!   and a process about to exit ([`wait_for_aborts`]).
//! - **afterwards**: every launch on an aborted (group, stream) fails with
//!   [`BackendError::Aborted`] carrying the first failure, and every collective's event
//!   watching it reports `Aborted` too (unless it was seen complete before), as the
//!   collective-matching rule of the backend contract says: a world that lost a rank is
//!   rebuilt, not patched. An event recorded on a stream (a stream-wide watch) once complete
//!   says only that the stream is quiet (see the module docs of `events`), so a rank can
//!   still read its shards after a peer failure.
//!
//! Only communicators that launched something are checked through a stream-wide watch (a
//! stream's other groups have nothing of theirs to fail), and a stream-wide wait that timed out
//! aborts only if its streams launched a collective; teardown aborts them all.
//!
//! # Locks
//! Each communicator has its own mutex. A launch holds it from `ncclGroupStart` to
//! `ncclGroupEnd`; a watch only `try_lock`s it (a busy communicator is checked at the next
//! poll), and so does an abort (a busy communicator is taken out by the abort's thread once
//! the launch let go), so neither a waiting thread nor an aborting one blocks behind a launch.
//! The table of communicators is fixed when the backend is built; a [`Watch`] holds it weakly,
//! so events that outlive the backend keep no communicator alive.
//!
//! The logic is generic over [`Comm`] (a real [`Communicator`], or a fake in the tests).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::nccl::{CallSite, Communicator, NcclError};
use super::park::ErrorPark;
use crate::backend::{BackendError, CollDesc, CollRef, RankGroup, Stream};

/// What the table needs of a communicator.
pub trait Comm: Send + 'static {
    /// `ncclCommGetAsyncError`: `Err` with the failure of a collective that already returned.
    ///
    /// # Errors
    /// The asynchronous error (or the query's own failure).
    fn async_error(&self, site: CallSite) -> Result<(), NcclError>;

    /// `ncclCommAbort`: ends the communicator without waiting for its pending collectives. May
    /// block (NCCL frees pinned host memory, which waits for the device): the table calls it on
    /// a thread of its own.
    ///
    /// # Errors
    /// NCCL's failure to abort.
    fn abort(self) -> Result<(), NcclError>;
}

impl Comm for Communicator {
    fn async_error(&self, site: CallSite) -> Result<(), NcclError> {
        Communicator::async_error(self, site)
    }

    fn abort(self) -> Result<(), NcclError> {
        Communicator::abort(self)
    }
}

/// Which communicators a watch or an abort concerns: the (group, stream) of one collective, or
/// every group's on some streams.
#[derive(Clone, Debug, PartialEq)]
pub struct Scope {
    /// The streams.
    pub streams: Vec<Stream>,
    /// The group, when the work is one collective's.
    pub group: Option<RankGroup>,
    /// The collective, when the work is one collective's (for errors).
    pub op: Option<CollRef>,
}

impl Scope {
    /// Every group's communicators on `streams`.
    pub fn streams(streams: &[Stream]) -> Self {
        Scope { streams: streams.to_vec(), group: None, op: None }
    }

    /// The communicator of one collective (its group, its stream).
    pub fn collective(op: CollRef) -> Self {
        Scope { streams: vec![op.stream], group: Some(op.desc.group.clone()), op: Some(op) }
    }

    /// Whether the scope is every group's on its streams (an event recorded on a stream), not
    /// one collective's.
    pub fn is_stream_wide(&self) -> bool {
        self.group.is_none()
    }

    fn covers(&self, key: &(RankGroup, Stream)) -> bool {
        self.streams.contains(&key.1) && self.group.as_ref().is_none_or(|g| *g == key.0)
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.op, &self.group) {
            (Some(op), _) => write!(f, "{op}"),
            (None, Some(g)) => write!(f, "work over group {g} on stream {}", self.streams[0]),
            (None, None) => {
                let names: Vec<String> = self.streams.iter().map(ToString::to_string).collect();
                write!(f, "work on stream {}", names.join(" and "))
            }
        }
    }
}

struct Slot<C> {
    comm: Mutex<Option<C>>,
    /// The first failure; set once, before the communicator is aborted.
    aborted: OnceLock<BackendError>,
    /// Collectives launched so far (the next one's sequence number).
    launched: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a thread panicked while holding it; the handle is still valid.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How many aborts are still running on their threads.
#[derive(Default)]
struct Aborts {
    running: Mutex<usize>,
    ended: Condvar,
}

impl Aborts {
    const fn new() -> Self {
        Aborts { running: Mutex::new(0), ended: Condvar::new() }
    }

    fn start(&self) {
        *lock(&self.running) += 1;
    }

    fn end(&self) {
        let mut n = lock(&self.running);
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.ended.notify_all();
        }
    }

    fn running(&self) -> usize {
        *lock(&self.running)
    }

    fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut n = lock(&self.running);
        while *n > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            n = match self.ended.wait_timeout(n, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        true
    }
}

/// Every abort of the process still running, whatever its table (which may be gone).
static ALL_ABORTS: Aborts = Aborts::new();

/// How many `ncclCommAbort`s of the process still run on their threads (their tables may be
/// gone: a backend's teardown does not wait for them past its grace).
pub fn aborts_running() -> usize {
    ALL_ABORTS.running()
}

/// Waits at most `timeout` for every `ncclCommAbort` of the process started so far to end;
/// returns whether they did. For a process about to exit (an abort that runs while the CUDA
/// runtime shuts down may fail or crash) and for tests.
pub fn wait_for_aborts(timeout: Duration) -> bool {
    ALL_ABORTS.wait(timeout)
}

/// The communicators of one rank, one per (group, stream). See the module docs.
pub struct CommTable<C: Comm = Communicator> {
    rank: usize,
    slots: HashMap<(RankGroup, Stream), Arc<Slot<C>>>,
    park: ErrorPark,
    aborts: Arc<Aborts>,
}

impl<C: Comm> fmt::Debug for CommTable<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CommTable")
            .field("rank", &self.rank)
            .field("communicators", &self.slots.len())
            .field("aborts_pending", &self.aborts_pending())
            .finish()
    }
}

/// A launch holding its (group, stream)'s communicator: [`CommTable::launch`].
pub struct Launching<'a, C> {
    guard: MutexGuard<'a, Option<C>>,
    /// The collective, with its sequence number on (group, stream).
    pub op: CollRef,
}

impl<C> Launching<'_, C> {
    /// The communicator (live: [`CommTable::launch`] checked it).
    pub fn comm(&self) -> Option<&C> {
        self.guard.as_ref()
    }
}

impl<C: Comm> CommTable<C> {
    /// The table of `rank`'s communicators; a failure to abort one is parked in `park`.
    pub fn new(rank: usize, comms: HashMap<(RankGroup, Stream), C>, park: ErrorPark) -> Self {
        let slots = comms
            .into_iter()
            .map(|(k, c)| {
                let slot =
                    Slot { comm: Mutex::new(Some(c)), aborted: OnceLock::new(), launched: AtomicU64::new(0) };
                (k, Arc::new(slot))
            })
            .collect();
        CommTable { rank, slots, park, aborts: Arc::default() }
    }

    /// How many communicators (one per (group, stream) this rank is a member of).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether there is a communicator for (group, stream) (aborted or not).
    pub fn contains(&self, group: &RankGroup, stream: Stream) -> bool {
        self.slots.contains_key(&(group.clone(), stream))
    }

    fn aborted_error(&self, op: Option<&CollRef>, cause: &BackendError) -> BackendError {
        BackendError::Aborted {
            rank: self.rank,
            op: op.cloned().map(Box::new),
            cause: Box::new(cause.clone()),
        }
    }

    /// Starts a launch of `desc` on (its group, `stream`): holds the communicator and numbers
    /// the collective.
    ///
    /// # Errors
    /// [`BackendError::Aborted`] (with the first failure) if the (group, stream) was aborted;
    /// [`BackendError::Internal`] if it has no communicator (the launch's checks come first).
    pub fn launch(&self, desc: &CollDesc, stream: Stream) -> Result<Launching<'_, C>, BackendError> {
        let key = (desc.group.clone(), stream);
        let unnumbered = CollRef { desc: desc.clone(), stream, seq: None };
        let Some(slot) = self.slots.get(&key) else {
            return Err(BackendError::Internal {
                what: format!(
                    "rank {}: {unnumbered}: no communicator, yet the launch was accepted",
                    self.rank
                ),
            });
        };
        let guard = lock(&slot.comm);
        if let Some(cause) = slot.aborted.get() {
            return Err(self.aborted_error(Some(&unnumbered), cause));
        }
        if guard.is_none() {
            return Err(BackendError::Internal {
                what: format!(
                    "rank {}: {unnumbered}: the communicator is gone but was never aborted",
                    self.rank
                ),
            });
        }
        let seq = slot.launched.fetch_add(1, Ordering::Relaxed);
        Ok(Launching { guard, op: CollRef { seq: Some(seq), ..unnumbered } })
    }

    fn in_scope<'a>(
        &'a self,
        scope: &'a Scope,
    ) -> impl Iterator<Item = (&'a (RankGroup, Stream), &'a Slot<C>)> {
        // A stream-wide scope leaves out communicators that never launched anything.
        self.slots
            .iter()
            .filter(move |(k, s)| {
                scope.covers(k) && (scope.group.is_some() || s.launched.load(Ordering::Relaxed) > 0)
            })
            .map(|(k, s)| (k, &**s))
    }

    /// `Some(Aborted)` if a communicator of `scope` was aborted.
    pub fn aborted(&self, scope: &Scope) -> Option<BackendError> {
        self.in_scope(scope)
            .find_map(|(_, s)| s.aborted.get())
            .map(|cause| self.aborted_error(scope.op.as_ref(), cause))
    }

    /// How many communicators of `scope` a stream-wide watch looks at (every one of a
    /// collective's scope; on a stream, those that launched something).
    pub fn watched(&self, scope: &Scope) -> usize {
        self.in_scope(scope).count()
    }

    /// Checks the asynchronous errors of `scope`'s communicators (each one not busy with a
    /// launch); the first error is a failure of a peer: it aborts every communicator of the
    /// rank ([`CommTable::abort_all`]).
    ///
    /// # Errors
    /// [`BackendError::Aborted`] if the scope was aborted before; [`BackendError::Device`]
    /// naming the work, the (group, stream) and NCCL's words for a new failure.
    pub fn check(&self, scope: &Scope) -> Result<(), BackendError> {
        if let Some(e) = self.aborted(scope) {
            return Err(e);
        }
        let mut site = CallSite::op("async_error").rank(self.rank);
        if let Some(op) = &scope.op {
            site = site.bucket(op.desc.tag as usize);
        }
        for ((g, s), slot) in self.in_scope(scope) {
            let failure = match slot.comm.try_lock() {
                Ok(guard) => guard.as_ref().and_then(|c| c.async_error(site).err()),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    p.into_inner().as_ref().and_then(|c| c.async_error(site).err())
                }
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            if let Some(e) = failure {
                let api = if let NcclError::Call(c) = &e { c.api } else { "ncclCommGetAsyncError" };
                let error = BackendError::Device {
                    rank: self.rank,
                    api,
                    detail: format!(
                        "{scope}: NCCL reports a failure of the communicator of group {g} on stream {s}: {e}; \
                         every communicator of the rank was aborted, so later collectives fail; rebuild the \
                         world (a peer may have died)"
                    ),
                };
                self.abort_all(error.clone());
                return Err(error);
            }
        }
        Ok(())
    }

    /// Aborts the communicators of `scope` with `cause` as their failure (the first cause of
    /// each stays); returns how many the scope had. Never blocks: `ncclCommAbort` runs on a
    /// thread of its own (see the module docs).
    pub fn abort(&self, scope: &Scope, cause: BackendError) -> usize {
        let keys: Vec<&(RankGroup, Stream)> = self.in_scope(scope).map(|(k, _)| k).collect();
        for k in &keys {
            self.abort_slot(k, &cause);
        }
        keys.len()
    }

    /// Aborts every communicator of the rank (a failure of a peer; teardown that could not
    /// drain): each is marked and taken out, and every `ncclCommAbort` is started, each on its
    /// own thread, before any is waited for. Never blocks.
    pub fn abort_all(&self, cause: BackendError) {
        for k in self.slots.keys() {
            self.abort_slot(k, &cause);
        }
    }

    fn abort_slot(&self, key: &(RankGroup, Stream), cause: &BackendError) {
        let Some(slot) = self.slots.get(key) else { return };
        let _ = slot.aborted.set(cause.clone());
        // Taken out under the lock, unless a launch holds it: then the abort's thread takes it
        // once the launch let go (a launch that comes later sees `aborted` and gives up).
        let taken = match slot.comm.try_lock() {
            Ok(mut guard) => match guard.take() {
                Some(c) => Some(c),
                None => return,
            },
            Err(std::sync::TryLockError::Poisoned(p)) => match p.into_inner().take() {
                Some(c) => Some(c),
                None => return,
            },
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        let (rank, group, stream) = (self.rank, key.0.clone(), key.1);
        tracing::error!(target: "collsched::coll", "rank {rank}: aborting the communicator of group {group} on stream {stream}: {cause}");
        // The communicator travels through `handoff`, so that a thread that cannot start gives
        // it back instead of dropping it (which would call ncclCommDestroy here).
        let handoff = Arc::new(Mutex::new(taken));
        let (thread_handoff, thread_slot) = (Arc::clone(&handoff), Arc::clone(slot));
        let (park, aborts) = (self.park.clone(), Arc::clone(&self.aborts));
        let thread_aborts = Arc::clone(&aborts);
        aborts.start();
        ALL_ABORTS.start();
        let spawned =
            std::thread::Builder::new().name(format!("collsched-abort-r{rank}-{stream}")).spawn(move || {
                let comm = lock(&thread_handoff).take().or_else(|| lock(&thread_slot.comm).take());
                if let Some(c) = comm {
                    if let Err(e) = c.abort() {
                        park.park(format!(
                            "rank {rank}: aborting the communicator of group {group} on stream {stream}: {e}"
                        ));
                    }
                }
                thread_aborts.end();
                ALL_ABORTS.end();
            });
        if let Err(e) = spawned {
            aborts.end();
            ALL_ABORTS.end();
            // Never aborted, never destroyed: its kernels may spin until the process exits,
            // and teardown, finding the streams busy, leaks the device's memory.
            let comm = lock(&handoff).take().or_else(|| lock(&slot.comm).take());
            let left = comm.is_some();
            std::mem::forget(comm);
            self.park.park(format!(
                "rank {rank}: could not start a thread to abort the communicator of group {} on stream {}: {e}; {}",
                key.0,
                key.1,
                if left { "it is left to the process's exit (exit the process)" } else { "it was gone already" }
            ));
        }
    }

    /// How many `ncclCommAbort`s are still running on their threads.
    pub fn aborts_pending(&self) -> usize {
        self.aborts.running()
    }

    /// Waits at most `timeout` for every abort started so far to end; returns whether they
    /// did. Only for teardown and tests: nothing else waits for an abort.
    pub fn wait_aborts(&self, timeout: Duration) -> bool {
        self.aborts.wait(timeout)
    }

    /// Forgets every communicator still in the table, calling nothing of NCCL's (teardown at
    /// the process's exit, with the CUDA driver already shut down: an NCCL call could crash or
    /// hang there). Returns how many were left.
    pub fn leak_all(&self) -> usize {
        let mut left = 0;
        for slot in self.slots.values() {
            if let Some(c) = lock(&slot.comm).take() {
                std::mem::forget(c);
                left += 1;
            }
        }
        left
    }

    /// Whether any communicator was aborted.
    pub fn any_aborted(&self) -> bool {
        self.slots.values().any(|s| s.aborted.get().is_some())
    }
}

/// What a [`Watch`] asks of a table, whatever its communicators.
trait Watched: Send + Sync {
    fn check(&self, scope: &Scope) -> Result<(), BackendError>;
    fn aborted(&self, scope: &Scope) -> Option<BackendError>;
    fn abort(&self, scope: &Scope, cause: BackendError) -> usize;
    fn abort_all(&self, cause: BackendError);
    fn watched(&self, scope: &Scope) -> usize;
    fn rank(&self) -> usize;
}

impl<C: Comm> Watched for CommTable<C> {
    fn check(&self, scope: &Scope) -> Result<(), BackendError> {
        CommTable::check(self, scope)
    }
    fn aborted(&self, scope: &Scope) -> Option<BackendError> {
        CommTable::aborted(self, scope)
    }
    fn abort(&self, scope: &Scope, cause: BackendError) -> usize {
        CommTable::abort(self, scope, cause)
    }
    fn abort_all(&self, cause: BackendError) {
        CommTable::abort_all(self, cause);
    }
    fn watched(&self, scope: &Scope) -> usize {
        CommTable::watched(self, scope)
    }
    fn rank(&self) -> usize {
        self.rank
    }
}

/// The communicators an event's work uses, for host waits on it (see the module docs).
#[derive(Clone)]
pub struct Watch {
    table: Weak<dyn Watched>,
    scope: Scope,
    patience: Duration,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field("scope", &self.scope.to_string())
            .field("patience", &self.patience)
            .finish()
    }
}

impl Watch {
    /// A watch of `scope` in `table`; a wait that gave up after `patience` (the backend's
    /// timeout) or longer aborts the scope.
    pub fn new<C: Comm>(table: &Arc<CommTable<C>>, scope: Scope, patience: Duration) -> Self {
        let table: Arc<dyn Watched> = Arc::clone(table) as Arc<dyn Watched>;
        Watch { table: Arc::downgrade(&table), scope, patience }
    }

    /// What it watches.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The backend's timeout: how long a wait must have lasted for its timeout to abort.
    pub fn patience(&self) -> Duration {
        self.patience
    }

    /// As [`CommTable::check`] (nothing once the backend is gone).
    ///
    /// # Errors
    /// As [`CommTable::check`].
    pub fn check(&self) -> Result<(), BackendError> {
        self.table.upgrade().map_or(Ok(()), |t| t.check(&self.scope))
    }

    /// As [`CommTable::aborted`].
    pub fn aborted(&self) -> Option<BackendError> {
        self.table.upgrade().and_then(|t| t.aborted(&self.scope))
    }

    /// Whether a host wait that gave up after `waited` aborts the scope: only a wait as long
    /// as the backend's timeout (a poll, or a short wait, says only that the work is pending).
    pub fn aborts_after(&self, waited: Duration) -> bool {
        waited >= self.patience
    }

    /// After a wait of `waited` that gave up (see [`Watch::aborts_after`]): a peer is missing
    /// or stuck, so every communicator of the rank is aborted, if the scope has any (a stream
    /// that launched no collective waits for nobody). Returns whether it aborted.
    pub fn abort_after_timeout(&self, waited: Duration) -> bool {
        if !self.aborts_after(waited) {
            return false;
        }
        let Some(t) = self.table.upgrade() else { return false };
        if t.watched(&self.scope) == 0 {
            return false;
        }
        let cause = BackendError::Device {
            rank: t.rank(),
            api: "ncclCommAbort",
            detail: format!(
                "{}: not complete after {waited:?} (the backend's timeout): a peer is missing or stuck; \
                 every communicator of the rank was aborted, so later collectives fail; rebuild the world \
                 (or raise COLLSCHED_CUDA_TIMEOUT_SECS if the peers are merely slow)",
                self.scope
            ),
        };
        t.abort_all(cause);
        true
    }

    /// Aborts the scope with `cause` (teardown).
    pub fn abort(&self, cause: BackendError) {
        if let Some(t) = self.table.upgrade() {
            t.abort(&self.scope, cause);
        }
    }
}

#[cfg(test)]
#[path = "comms_tests.rs"]
mod tests;
