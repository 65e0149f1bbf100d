//! Host waits on a CUDA backend's events ([`BackendEvent`] for [`CudaEvent`]): the device's
//! word (`cuEventQuery`), polled as [`super::wait`] says, and the event's [`Watch`](super::comms::Watch)
//! (its communicators' failures, [`super::comms`]).
//!
//! - `query` says complete, pending, or failed: the work before it failed on the device, its
//!   communicators were aborted (unless it was seen complete before: what completed stays
//!   so), or NCCL reports an asynchronous error for them (which aborts them).
//! - `wait(timeout)` polls the device, checking the communicators every
//!   [`WATCH_EVERY`](super::wait::WATCH_EVERY). A failure they report aborts them, which ends
//!   their kernels; the wait returns that failure once the device is done with the work (so
//!   that the buffers an [`InFlight`](crate::backend::InFlight) hands back with a failure are
//!   safe to reuse), or [`BackendError::EventTimeout`] if it is not done by the timeout (the
//!   value is handed back still in flight). A wait that gives up after at least the backend's
//!   timeout aborts the communicators (a shorter one, such as
//!   [`InFlight::try_finish`](crate::backend::InFlight::try_finish)'s zero, only says the work
//!   is pending).

use std::time::Duration;

use super::wait::{wait_until, HostClock};
use super::CudaEvent;
use crate::backend::{BackendError, BackendEvent};

/// The event's state; `watch_pending`: also check the communicators when pending.
fn status(e: &CudaEvent, watch_pending: bool) -> Result<bool, BackendError> {
    if e.seen_done() {
        return Ok(true);
    }
    let done = e.is_complete().map_err(|err| err.into_backend(e.rank()))?;
    if let Some(w) = e.watch() {
        // After the device's word: work that an abort ended reads as complete, and the abort
        // was marked before it (see `CommTable::abort`), so it is seen here.
        if let Some(aborted) = w.aborted() {
            return Err(aborted);
        }
        if !done && watch_pending {
            w.check()?;
        }
    }
    if done {
        e.mark_done();
    }
    Ok(done)
}

impl BackendEvent for CudaEvent {
    fn query(&self) -> Result<bool, BackendError> {
        status(self, true)
    }

    fn wait(&self, timeout: Duration) -> Result<(), BackendError> {
        // The first failure the watch sees (it aborts the communicators, so the work ends).
        let mut failure: Option<BackendError> = None;
        let finished = wait_until(
            timeout,
            &mut HostClock::start(),
            || self.is_complete().map_err(|e| e.into_backend(self.rank())),
            || {
                if failure.is_none() {
                    failure = self.watch().and_then(|w| w.check().err());
                }
                Ok(())
            },
        )?;
        if finished {
            // The device is done with the work: now report what its communicators say.
            return match (status(self, false), failure) {
                (_, Some(first)) => Err(first),
                (Ok(_), None) => Ok(()),
                (Err(e), None) => Err(e),
            };
        }
        if let Some(w) = self.watch() {
            w.abort_after_timeout(timeout);
        }
        if let Some(f) = failure {
            tracing::error!(target: "collsched::coll", "rank {}: the work before an event failed and had not ended {timeout:?} later: {f}", self.rank());
        }
        Err(BackendError::EventTimeout { waited: timeout })
    }
}
