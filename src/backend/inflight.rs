//! [`InFlight`]: a launch's buffers and completion event in one value.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::{Backend, BackendError, BackendEvent, CollDesc, Collective};

/// What a backend does with the collectives of an [`InFlight`] dropped unfinished: defer their
/// buffers to the pool until the event completed, and park a failure.
pub type OnDrop<B> =
    Arc<dyn Fn(Vec<Collective<<B as Backend>::Buffer>>, &<B as Backend>::Event) + Send + Sync>;

/// Collectives in flight: their buffers and their completion event in one value (STYLE 8).
///
/// Get the buffers back with [`InFlight::wait`] (or [`InFlight::try_finish`] after polling).
/// **Dropping** it never blocks: the buffers go back to the pool once the event completes, and
/// if the collective failed, the failure is parked and reported by the rank's next fallible call
/// ([`Backend::alloc`], [`Backend::record`], a launch).
pub struct InFlight<B: Backend> {
    pub(super) ops: Vec<Collective<B::Buffer>>,
    pub(super) event: B::Event,
    pub(super) backend: Option<OnDrop<B>>,
}

impl<B: Backend> fmt::Debug for InFlight<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let descs: Vec<String> = self.ops.iter().map(|c| c.desc.to_string()).collect();
        f.debug_struct("InFlight").field("ops", &descs).field("event", &self.event).finish()
    }
}

/// Why [`InFlight::wait`] gave no buffers.
pub enum WaitError<B: Backend> {
    /// Still running after the timeout: here it is back, still in flight.
    TimedOut {
        /// The collectives, still in flight.
        in_flight: InFlight<B>,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The collectives failed; their buffers are safe to reuse and come back here.
    Failed {
        /// The failure.
        error: BackendError,
        /// The collectives, with their buffers.
        ops: Vec<Collective<B::Buffer>>,
    },
}

impl<B: Backend> WaitError<B> {
    /// The error, dropping what it carries (a timed-out [`InFlight`] is dropped, which defers
    /// its buffers to the pool).
    pub fn into_error(self) -> BackendError {
        match self {
            WaitError::TimedOut { in_flight, waited } => {
                drop(in_flight);
                BackendError::EventTimeout { waited }
            }
            WaitError::Failed { error, .. } => error,
        }
    }
}

impl<B: Backend> fmt::Display for WaitError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitError::TimedOut { in_flight, waited } => {
                write!(f, "collectives still in flight after waiting {waited:?}: {in_flight:?}")
            }
            WaitError::Failed { error, .. } => write!(f, "{error}"),
        }
    }
}

impl<B: Backend> fmt::Debug for WaitError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WaitError::TimedOut { in_flight, waited } => {
                f.debug_struct("TimedOut").field("in_flight", in_flight).field("waited", waited).finish()
            }
            WaitError::Failed { error, ops } => {
                f.debug_struct("Failed").field("error", error).field("ops", &ops.len()).finish()
            }
        }
    }
}

impl<B: Backend> std::error::Error for WaitError<B> {}

impl<B: Backend> InFlight<B> {
    /// Wraps launched collectives and their completion event. For backends: `on_drop` is called
    /// with the ops and event if the value is dropped unfinished (it must defer the buffers to
    /// the pool until the event completed, and park a failure).
    pub fn new(ops: Vec<Collective<B::Buffer>>, event: B::Event, on_drop: OnDrop<B>) -> Self {
        InFlight { ops, event, backend: Some(on_drop) }
    }

    /// The completion event (clone it to make other streams wait on it).
    pub fn event(&self) -> &B::Event {
        &self.event
    }

    /// The collectives in flight (their descriptions; their buffers are not to be touched).
    pub fn descs(&self) -> impl Iterator<Item = &CollDesc> {
        self.ops.iter().map(|c| &c.desc)
    }

    /// Polls the event without blocking.
    ///
    /// # Errors
    /// The collectives' failure.
    pub fn is_done(&self) -> Result<bool, BackendError> {
        self.event.query()
    }

    /// Waits at most `timeout` for completion and returns the collectives with their buffers.
    ///
    /// # Errors
    /// [`WaitError::TimedOut`] gives the value back still in flight; [`WaitError::Failed`] gives
    /// the failure and the buffers.
    pub fn wait(mut self, timeout: Duration) -> Result<Vec<Collective<B::Buffer>>, WaitError<B>> {
        match self.event.wait(timeout) {
            Ok(()) => Ok(self.take()),
            Err(BackendError::EventTimeout { waited }) => {
                Err(WaitError::TimedOut { in_flight: self, waited })
            }
            Err(error) => Err(WaitError::Failed { error, ops: self.take() }),
        }
    }

    /// Returns the buffers if the event completed, or gives the value back if it is pending.
    ///
    /// # Errors
    /// As [`InFlight::wait`].
    pub fn try_finish(self) -> Result<Vec<Collective<B::Buffer>>, WaitError<B>> {
        self.wait(Duration::ZERO)
    }

    /// The collectives with their buffers and the completion event, **before** completion:
    /// for a caller that hands the outputs to work ordered after the event on a stream (a
    /// device engine's compute stream waiting for it) instead of waiting on the host. From then
    /// on the caller keeps what this value kept: no buffer may be freed without the event
    /// ([`Backend::free`] with it) or read by the host before it completed, and a failure is
    /// the event's to report ([`BackendEvent::query`]).
    pub fn hand_out(mut self) -> (Vec<Collective<B::Buffer>>, B::Event) {
        let event = self.event.clone();
        (self.take(), event)
    }

    /// This launch as one of backend `C`, which has the same buffers and events (a backend that
    /// wraps this one and hands its launches on).
    pub fn rebind<C>(mut self) -> InFlight<C>
    where
        C: Backend<Buffer = B::Buffer, Event = B::Event>,
    {
        let backend: Option<OnDrop<C>> = self.backend.take();
        InFlight { ops: std::mem::take(&mut self.ops), event: self.event.clone(), backend }
    }

    fn take(&mut self) -> Vec<Collective<B::Buffer>> {
        self.backend = None;
        std::mem::take(&mut self.ops)
    }
}

impl<B: Backend> Drop for InFlight<B> {
    fn drop(&mut self) {
        if let Some(on_drop) = self.backend.take() {
            on_drop(std::mem::take(&mut self.ops), &self.event);
        }
    }
}
