//! Host waits on a CUDA backend's events ([`BackendEvent`] for [`CudaEvent`]): the device's
//! word (`cuEventQuery`), polled as [`super::wait`] says, and the event's [`Watch`](super::comms::Watch)
//! (its communicators' failures, [`super::comms`]).
//!
//! - `query` says complete, pending, or failed: the work before it failed on the device, NCCL
//!   reports an asynchronous error for its communicators (which aborts every communicator of
//!   the rank), or, for a collective's event, its communicator was aborted (unless it was seen
//!   complete before: what completed stays so).
//! - An event recorded **on a stream** (a stream-wide watch: [`Backend::record`](crate::backend::Backend::record),
//!   the fences of host copies) says that the stream is quiet: once complete it reports
//!   complete, even after an abort (the failure is the collectives' own events' and every later
//!   launch's to report), and while pending after an abort it reports pending (the abort ends
//!   the work). So a rank can still read its shards and save them after a peer failure.
//! - `wait(timeout)` polls the device, checking the communicators every
//!   [`WATCH_EVERY`](super::wait::WATCH_EVERY). A new failure they report aborts them, which
//!   ends their kernels; the wait returns that failure once the device is done with the work
//!   (so that the buffers an [`InFlight`](crate::backend::InFlight) hands back with a failure
//!   are safe to reuse). If the work is not done by the timeout it returns
//!   [`BackendError::EventTimeout`], as the contract of [`InFlight::wait`](crate::backend::InFlight::wait)
//!   wants (the value comes back still in flight: its buffers may still be in use), and a
//!   failure it saw is not lost: it is parked, so the rank's next fallible call reports it,
//!   and the communicators keep it as the cause of every later `Aborted`. A wait that gives up
//!   after at least the backend's timeout aborts the communicators (a shorter one, such as
//!   [`InFlight::try_finish`](crate::backend::InFlight::try_finish)'s zero, only says the work
//!   is pending).
//! - [`wait_quiet`]: the fences' wait; only the device's word counts (see its docs).

use std::time::Duration;

use super::wait::{wait_until, HostClock};
use super::CudaEvent;
use crate::backend::{BackendError, BackendEvent};

/// A failure the watch reports that no one reported before (an `Aborted` says an earlier one
/// was seen already, by this wait or another).
fn new_failure(e: &CudaEvent) -> Option<BackendError> {
    match e.watch()?.check() {
        Ok(()) | Err(BackendError::Aborted { .. }) => None,
        Err(f) => Some(f),
    }
}

/// The event's state; `watch_pending`: also check the communicators when pending.
fn status(e: &CudaEvent, watch_pending: bool) -> Result<bool, BackendError> {
    if e.seen_done() {
        return Ok(true);
    }
    let done = e.is_complete().map_err(|err| err.into_backend(e.rank()))?;
    if let Some(w) = e.watch() {
        // After the device's word: work that an abort ended reads as complete, and the abort
        // was marked before it (see `CommTable::abort_all`), so it is seen here. A stream's
        // event says only that the stream is quiet (see the module docs).
        if !w.scope().is_stream_wide() {
            if let Some(aborted) = w.aborted() {
                return Err(aborted);
            }
        }
        if !done && watch_pending {
            if let Some(f) = new_failure(e) {
                return Err(f);
            }
        }
    }
    if done {
        e.mark_done();
    }
    Ok(done)
}

/// Waits at most `timeout` for the stream before `e` to be quiet: `Ok(true)` once the device
/// says the work before it ended, `Ok(false)` at the timeout. The communicators are watched
/// while pending, so that a peer's failure aborts them (their kernels exit and the stream
/// drains) instead of the wait running to its timeout; the failure itself (and an earlier
/// abort) does not fail the wait: a fence of a host copy needs only the stream quiet, and the
/// failure stays with the communicators for every later launch to report.
///
/// # Errors
/// The device's failure (`cuEventQuery`).
pub(super) fn wait_quiet(e: &CudaEvent, timeout: Duration) -> Result<bool, BackendError> {
    wait_until(
        timeout,
        &mut HostClock::start(),
        || e.is_complete().map_err(|err| err.into_backend(e.rank())),
        || {
            let _ = new_failure(e);
            Ok(())
        },
    )
}

impl BackendEvent for CudaEvent {
    fn query(&self) -> Result<bool, BackendError> {
        status(self, true)
    }

    fn wait(&self, timeout: Duration) -> Result<(), BackendError> {
        // The first new failure the watch sees (it aborts the communicators, so the work ends).
        let mut failure: Option<BackendError> = None;
        let finished = wait_until(
            timeout,
            &mut HostClock::start(),
            || self.is_complete().map_err(|e| e.into_backend(self.rank())),
            || {
                if failure.is_none() {
                    failure = new_failure(self);
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
            // EventTimeout keeps the value in flight (its buffers may still be in use); the
            // failure goes to the rank's next fallible call.
            self.device().park().park(format!(
                "rank {}: the work before an event failed and had not ended {timeout:?} later (the wait \
                 returned EventTimeout, so its buffers stayed in flight): {f}",
                self.rank()
            ));
        }
        Err(BackendError::EventTimeout { waited: timeout })
    }
}
