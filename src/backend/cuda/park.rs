//! Errors that happen where they cannot be returned (in `Drop`), kept for the next fallible call.
//!
//! The park keeps each error's message: the layers that park errors (NCCL communicators, device
//! memory, streams) sit below the backend's error type, and a parked error is only reported.

use std::fmt::Display;
use std::sync::{Arc, Mutex};

/// Errors parked since the last check: reported by the next fallible call.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("{count} CUDA error(s) while releasing resources; first: {first}")]
pub struct Parked {
    /// How many.
    pub count: usize,
    /// The first one's message.
    pub first: String,
}

/// A shared place for errors of `Drop`s (freeing memory, destroying a stream, an event or a
/// communicator). The backend drains it at its next fallible call ([`ErrorPark::check`]), so a
/// failure is reported, never panicked on and never lost.
#[derive(Clone, Debug, Default)]
pub struct ErrorPark(Arc<Mutex<Vec<String>>>);

impl ErrorPark {
    /// An empty park.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps `e` for later.
    pub fn park(&self, e: impl Display) {
        let message = e.to_string();
        tracing::warn!(target: "collsched::alloc", "parked CUDA error: {message}");
        self.lock().push(message);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        // A poisoned lock only means a thread panicked while pushing; the list is still valid.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes every parked error's message.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.lock())
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
