//! Holding a CUDA stream from the host, for the GPU tests of ordering (`tests/gpu_backend.rs`,
//! `tests/gpu_fences.rs`, `tests/runtime_device.rs`; included with `#[path]`): a host callback on the stream waits until
//! the test lets it go, at most [`GATE`].

use std::ffi::c_void;
use std::sync::mpsc;
use std::time::Duration;

use collsched::backend::cuda::CudaBackend;
use collsched::backend::{Backend, Stream};

/// How long a held stream stays held at most: well inside `gpu/run.sh`'s time for a whole GPU
/// test binary (60 s and more), so a stall behind it fails the sender's `send` (the gate let go
/// by itself) instead of outliving the step.
pub const GATE: Duration = Duration::from_secs(20);

/// What a held stream's sender says when the gate let go by itself.
pub const STALLED: &str = "the gate let go by itself after 20 s: something stalled behind the held stream";

struct Gate(mpsc::Receiver<()>);

unsafe extern "C" fn hold_stream(arg: *mut c_void) {
    // SAFETY: `arg` is the `Box<Gate>` leaked by `block_stream`, reclaimed once, here.
    let gate = unsafe { Box::from_raw(arg.cast::<Gate>()) };
    let _ = gate.0.recv_timeout(GATE);
}

/// Blocks `stream` (a host callback that waits, at most [`GATE`]) until the returned sender is
/// used or dropped; a `send` fails if the gate let go by itself.
pub fn block_stream(b: &CudaBackend, stream: Stream) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel();
    let arg = Box::into_raw(Box::new(Gate(rx))).cast::<c_void>();
    b.record(stream).expect("bind the context on this thread");
    // SAFETY: the stream is the backend's (its context is bound by the call above); the
    // callback owns `arg` and never calls CUDA.
    unsafe { cudarc::driver::result::stream::launch_host_function(b.raw_stream(stream), hold_stream, arg) }
        .expect("cuLaunchHostFunc");
    tx
}
