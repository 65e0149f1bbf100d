//! Errors that happen where they cannot be returned (in `Drop`), kept for the next fallible call.

use std::sync::{Arc, Mutex};

use super::error::CudaError;

/// A shared place for errors of `Drop`s (freeing memory, destroying a stream, an event or a
/// communicator). The backend drains it at its next fallible call ([`ErrorPark::check`]), so a
/// failure is reported, never panicked on and never lost.
#[derive(Clone, Debug, Default)]
pub struct ErrorPark(Arc<Mutex<Vec<CudaError>>>);

impl ErrorPark {
    /// An empty park.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps `e` for later.
    pub fn park(&self, e: CudaError) {
        tracing::warn!(target: "collsched::alloc", "parked CUDA error: {e}");
        self.lock().push(e);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<CudaError>> {
        // A poisoned lock only means a thread panicked while pushing; the list is still valid.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes every parked error.
    pub fn take(&self) -> Vec<CudaError> {
        std::mem::take(&mut *self.lock())
    }

    /// `Err` with the parked errors, if any (and forgets them).
    ///
    /// # Errors
    /// [`CudaError::Parked`] when something was parked.
    pub fn check(&self) -> Result<(), CudaError> {
        let mut errors = self.take();
        if errors.is_empty() {
            return Ok(());
        }
        let count = errors.len();
        Err(CudaError::Parked { count, first: Box::new(errors.swap_remove(0)) })
    }
}
