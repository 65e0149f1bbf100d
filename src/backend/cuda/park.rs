//! Errors that happen where they cannot be returned (in `Drop`, on an abort's thread, in a wait
//! that must hand its work back still in flight), kept for the next fallible call.
//!
//! The park keeps each error's message: the layers that park errors (NCCL communicators, device
//! memory, streams) sit below the backend's error type, and a parked error is only reported.
//!
//! The backend's teardown reports what was parked until then and **closes** the park
//! ([`ErrorPark::close`]): the resources dropped after it (the pool, the staging, the streams,
//! the communicators, the device, and whatever outlives the backend) still park their errors,
//! and a closed park logs each one at once (`tracing::error!`, target `collsched::init`)
//! instead of keeping it for a call that will never come.

use std::fmt::Display;
use std::sync::{Arc, Mutex};

/// Errors parked since the last check: reported by the next fallible call.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("{count} CUDA error(s) reported late (from releasing resources, an abort, or a wait that handed its work back); first: {first}")]
pub struct Parked {
    /// How many.
    pub count: usize,
    /// The first one's message.
    pub first: String,
}

#[derive(Debug, Default)]
struct State {
    errors: Vec<String>,
    /// Set by [`ErrorPark::close`]: nobody will read the park any more.
    closed: bool,
}

/// A shared place for errors of `Drop`s (freeing memory, destroying a stream, an event or a
/// communicator) and of work that cannot return them. The backend drains it at its next
/// fallible call ([`ErrorPark::check`]), so a failure is reported, never panicked on and never
/// lost.
#[derive(Clone, Debug, Default)]
pub struct ErrorPark(Arc<Mutex<State>>);

impl ErrorPark {
    /// An empty park.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps `e` for later (logs it at once if the park is closed).
    pub fn park(&self, e: impl Display) {
        let message = e.to_string();
        let mut state = self.lock();
        if state.closed {
            drop(state);
            tracing::error!(target: "collsched::init", "CUDA error after the backend's teardown: {message}");
            return;
        }
        tracing::warn!(target: "collsched::alloc", "parked CUDA error: {message}");
        state.errors.push(message);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock only means a thread panicked while pushing; the list is still valid.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes every parked error's message.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.lock().errors)
    }

    /// Takes every parked error's message and closes the park: from now on [`ErrorPark::park`]
    /// logs instead of keeping (teardown, once nobody will call [`ErrorPark::check`] again).
    pub fn close(&self) -> Vec<String> {
        let mut state = self.lock();
        state.closed = true;
        std::mem::take(&mut state.errors)
    }

    /// Whether [`ErrorPark::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// `Err` with the parked errors, if any (and forgets them).
    ///
    /// # Errors
    /// [`Parked`] when something was parked.
    pub fn check(&self) -> Result<(), Parked> {
        let mut errors = self.take();
        if errors.is_empty() {
            return Ok(());
        }
        Err(Parked { count: errors.len(), first: errors.swap_remove(0) })
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorPark;

    #[test]
    fn a_closed_park_hands_over_what_it_kept_and_keeps_nothing_more() {
        let park = ErrorPark::new();
        park.park("cuMemFree failed");
        let clone = park.clone();
        assert_eq!(park.close(), ["cuMemFree failed"]);
        assert!(clone.is_closed(), "a clone shares the park");
        // A resource dropped after the teardown (logged, not kept for a call that never comes).
        clone.park("cuStreamDestroy failed");
        assert_eq!(park.check(), Ok(()));
        assert!(park.take().is_empty());
    }
}
