//! Holding one of a rank's streams from the host, for tests and benchmarks that must show what
//! the host does while work it queued cannot have run (a fetch returning before its gather
//! completed, say), without relying on a kernel being slow enough.
//!
//! [`CudaBackend::hold_stream`] enqueues a host function (`cuLaunchHostFunc`) that blocks
//! until the returned [`StreamHold`] is released or dropped; everything queued on the stream
//! behind it waits. The function makes no CUDA call (the driver forbids it) and waits on a
//! channel only, which the holder's thread releases without waiting for CUDA work.
//!
//! A held stream delays the backend's other host functions (the driver runs them on one
//! thread), and a host wait on the stream (a host copy's fence, a drain) lasts until the hold
//! ends or the backend's timeout: release it before anything waits for the stream.

use std::ffi::c_void;
use std::sync::mpsc;

use collsched_kernels::cuda::DriverCallError;
use cudarc::driver::result as cu;

use super::{CudaBackend, CudaError};
use crate::backend::{BackendError, Stream};

/// A stream held by [`CudaBackend::hold_stream`]: the stream goes on once this is released or
/// dropped.
#[derive(Debug)]
pub struct StreamHold {
    go: Option<mpsc::Sender<()>>,
}

impl StreamHold {
    /// Lets the stream go on.
    pub fn release(mut self) {
        self.go.take();
    }
}

impl Drop for StreamHold {
    fn drop(&mut self) {
        // Dropping the sender ends the host function's wait.
        self.go.take();
    }
}

/// The host function: waits until its `StreamHold` is released or dropped.
///
/// # Safety
/// `arg` is a `Box<mpsc::Receiver<()>>` turned into a raw pointer by `hold_stream`, passed to
/// this function once.
unsafe extern "C" fn held(arg: *mut c_void) {
    // SAFETY: by the contract above, this reclaims the box `hold_stream` leaked, once.
    let rx = unsafe { Box::from_raw(arg.cast::<mpsc::Receiver<()>>()) };
    // A message or a disconnected sender both end the wait.
    let _ = rx.recv();
}

impl CudaBackend {
    /// Holds `stream`: work queued on it after this call waits until the returned
    /// [`StreamHold`] is released or dropped (see the module docs).
    ///
    /// # Errors
    /// The backend's failure, or the driver refusing the host function (nothing is held then).
    pub fn hold_stream(&self, stream: Stream) -> Result<StreamHold, BackendError> {
        self.ready()?;
        let failed = |e: CudaError| self.be(e);
        self.device.bind().map_err(failed)?;
        let (tx, rx) = mpsc::channel::<()>();
        let arg = Box::into_raw(Box::new(rx)).cast::<c_void>();
        // SAFETY: `held` takes back the box behind `arg` once, when the stream reaches it; the
        // stream is this rank's and lives as long as the backend, whose teardown waits for it.
        let r = unsafe { cu::stream::launch_host_function(self.stream(stream).raw(), held, arg) };
        if let Err(e) = r {
            // SAFETY: the driver refused the function, so it never runs: the box is ours again.
            drop(unsafe { Box::from_raw(arg.cast::<mpsc::Receiver<()>>()) });
            return Err(failed(CudaError::driver(
                format!("rank {}: holding stream {stream}", self.rank),
                DriverCallError::new("cuLaunchHostFunc", e),
            )));
        }
        Ok(StreamHold { go: Some(tx) })
    }
}
