//! Events of the local backend: one-shot completion fences shared across threads.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use super::sync::{AtomicU8, Condvar, Mutex, SPIN};
use crate::backend::{BackendError, BackendEvent};

const PENDING: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;

struct Inner {
    state: AtomicU8,
    error: OnceLock<BackendError>,
    /// Threads asleep on `cv` (no wake-up system call when there are none).
    lock: Mutex<usize>,
    cv: Condvar,
    /// How long a host wait spins before it sleeps.
    spin: Duration,
}

/// A completion fence of the local backend: pending until the stream that recorded it reaches
/// it, then done or failed, for good. Cheap to clone; any thread (any rank) may wait on it.
#[derive(Clone)]
pub struct LocalEvent(Arc<Inner>);

impl fmt::Debug for LocalEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.0.state.load(Ordering::Acquire) {
            PENDING => "pending",
            DONE => "done",
            _ => "failed",
        };
        write!(f, "LocalEvent({state})")
    }
}

/// Events a rank keeps for reuse, so that steady-state records and launches allocate nothing.
///
/// An event is reused once this pool holds its only reference (every clone handed out, to
/// streams, waiters, `InFlight` values, was dropped): nobody can observe the reset.
pub(super) struct EventPool {
    events: Mutex<Vec<Arc<Inner>>>,
    spin: Duration,
}

/// Events an [`EventPool`] keeps at most; beyond that (a caller holding on to many events),
/// new events are allocated unpooled.
pub(super) const EVENT_POOL_CAP: usize = 256;

impl EventPool {
    pub(super) fn new(spin: Duration) -> Self {
        let mut events = Vec::with_capacity(EVENT_POOL_CAP);
        events.extend((0..super::PREFILL).map(|_| LocalEvent::new(spin).0));
        EventPool { events: Mutex::new(events), spin }
    }

    /// A pending event: a reused one if some pooled event is no longer referenced elsewhere.
    pub(super) fn get(&self) -> LocalEvent {
        let mut events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        for e in events.iter_mut() {
            if let Some(inner) = Arc::get_mut(e) {
                inner.state = AtomicU8::new(PENDING);
                inner.error = OnceLock::new();
                inner.lock = Mutex::new(0);
                return LocalEvent(Arc::clone(e));
            }
        }
        let e = LocalEvent::new(self.spin);
        if events.len() < EVENT_POOL_CAP {
            events.push(Arc::clone(&e.0));
        }
        e
    }
}

impl LocalEvent {
    pub(super) fn new(spin: Duration) -> Self {
        LocalEvent(Arc::new(Inner {
            state: AtomicU8::new(PENDING),
            error: OnceLock::new(),
            lock: Mutex::new(0),
            cv: Condvar::new(),
            spin,
        }))
    }

    /// An event that is already complete.
    pub fn completed() -> Self {
        let e = Self::new(Duration::ZERO);
        e.complete(Ok(()));
        e
    }

    /// Completes the event (first call wins).
    pub(super) fn complete(&self, result: Result<(), BackendError>) {
        let state = match result {
            Ok(()) => DONE,
            Err(e) => {
                let _ = self.0.error.set(e);
                FAILED
            }
        };
        // Publish the error (set above) and everything the stream did before this point.
        let _ = self.0.state.compare_exchange(PENDING, state, Ordering::AcqRel, Ordering::Acquire);
        // Taking the lock orders this after a sleeper's last check of the state (it counts itself
        // and checks under the lock).
        let sleepers = self.0.lock.lock().unwrap_or_else(PoisonError::into_inner);
        if *sleepers > 0 {
            self.0.cv.notify_all();
        }
    }

    fn check(&self) -> Result<bool, BackendError> {
        match self.0.state.load(Ordering::Acquire) {
            PENDING => Ok(false),
            DONE => Ok(true),
            _ => Err(self.0.error.get().cloned().unwrap_or(BackendError::Internal {
                what: "local backend: an event failed without an error".into(),
            })),
        }
    }
}

impl BackendEvent for LocalEvent {
    fn query(&self) -> Result<bool, BackendError> {
        self.check()
    }

    fn wait(&self, timeout: Duration) -> Result<(), BackendError> {
        if self.check()? {
            return Ok(());
        }
        let start = Instant::now();
        let spin_until = start + if SPIN { self.0.spin.min(timeout) } else { Duration::ZERO };
        // Spin politely (yield each round) so the stream threads we wait for can run.
        while Instant::now() < spin_until {
            for _ in 0..16 {
                std::hint::spin_loop();
            }
            if self.check()? {
                return Ok(());
            }
            std::thread::yield_now();
        }
        let deadline = start.checked_add(timeout);
        let mut guard = self.0.lock.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if self.check()? {
                return Ok(());
            }
            let now = Instant::now();
            let left = match deadline {
                Some(d) if now >= d => return Err(BackendError::EventTimeout { waited: now - start }),
                Some(d) => d - now,
                None => Duration::from_secs(3600),
            };
            *guard += 1;
            guard = self.0.cv.wait_timeout(guard, left).unwrap_or_else(PoisonError::into_inner).0;
            *guard -= 1;
        }
    }
}
