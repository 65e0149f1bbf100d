//! The CUDA backend's host-side waits: the fences of host copies, the drain of a stream after
//! a failed launch, and the bounded teardown (see the module docs of [`super`]).

use std::time::Instant;

use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;

use super::comms::Scope;
use super::wait::{drain, Drained, HostClock, ABORT_GRACE};
use super::{CudaBackend, CudaError, StreamHandle};
use crate::backend::{BackendError, BackendEvent, Stream};

impl CudaBackend {
    /// Orders the copy stream after everything queued so far on the rank's other streams: on
    /// the device (`cuStreamWaitEvent` of an event recorded on each), and on the host, which
    /// waits for those events (watching their communicators) at most the backend's timeout in
    /// all before anything is enqueued behind them. A stream that does not get there in time
    /// has its communicators aborted (see [`super::comms`]).
    pub(super) fn fence_copy_stream(&self, op: &str) -> Result<(), BackendError> {
        let mut fences = Vec::with_capacity(Stream::ALL.len());
        for s in Stream::ALL {
            let e = self.stream(s).record().map_err(|e| self.be(e))?;
            self.copy.wait(&e).map_err(|e| self.be(e))?;
            fences.push((s, e));
        }
        let start = Instant::now();
        for (s, e) in fences {
            match e.wait(self.timeout.saturating_sub(start.elapsed())) {
                Ok(()) => {}
                Err(BackendError::EventTimeout { .. }) => {
                    let aborted = e.watch().is_some_and(|w| w.abort_after_timeout(self.timeout));
                    return Err(BackendError::Device {
                        rank: self.rank,
                        api: "cuEventQuery",
                        detail: format!(
                            "{op}: the {s} stream did not reach the point the copy must follow within {:?} \
                             (the backend's timeout){}; a peer is missing or stuck, or the engine's work \
                             on that stream is (raise COLLSCHED_CUDA_TIMEOUT_SECS if it is merely slow)",
                            self.timeout,
                            if aborted { ", so its communicators were aborted" } else { "" }
                        ),
                    });
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// A host copy on the copy stream, fenced ([`CudaBackend::fence_copy_stream`]) and
    /// complete on return (waited for at most the backend's timeout).
    pub(super) fn host_copy(
        &self,
        op: &str,
        api: &'static str,
        enqueue: impl FnOnce(cusys::CUstream) -> Result<(), cu::DriverError>,
    ) -> Result<(), BackendError> {
        self.fence_copy_stream(op)?;
        collsched_kernels::cuda::check(api, enqueue(self.copy.raw()))
            .map_err(|e| self.be(CudaError::driver(op.to_string(), e)))?;
        match self.copy.drain(self.timeout) {
            Ok(true) => Ok(()),
            Ok(false) => Err(BackendError::Device {
                rank: self.rank,
                api,
                detail: format!(
                    "{op}: the copy did not complete within {:?} (the backend's timeout); the device may be hung",
                    self.timeout
                ),
            }),
            Err(e) => Err(self.be(e)),
        }
    }

    /// After a failed launch (its (group, stream) already aborted, so NCCL's kernels exit):
    /// waits for `stream` to drain, at most the backend's timeout. Returns whether it drained
    /// (a failure to say goes to the park).
    pub(super) fn drain_stream(&self, stream: &StreamHandle) -> bool {
        match stream.drain(self.timeout) {
            Ok(drained) => drained,
            Err(e) => {
                self.park.park(e);
                false
            }
        }
    }
}

impl Drop for CudaBackend {
    /// Bounded (see the module docs): waits for the streams at most the backend's timeout,
    /// aborts the communicators if they have not drained (or NCCL reports a failure), waits
    /// [`ABORT_GRACE`] more, and leaks the device's memory if it is still busy after that.
    fn drop(&mut self) {
        let all = Scope::streams(&Stream::ALL);
        let cause = BackendError::Shutdown {
            rank: self.rank,
            what: format!(
                "the backend was dropped with work pending (its streams had not drained within {:?}, or \
                 NCCL reported a failure); the communicators were aborted",
                self.timeout
            ),
        };
        let mut fences = Vec::new();
        let mut unknowable = false;
        for s in self.streams.iter().chain(std::iter::once(&self.copy)) {
            match s.record_with(None) {
                Ok(e) => fences.push(e),
                Err(e) => {
                    self.park.park(e);
                    unknowable = true;
                }
            }
        }
        let drained = if unknowable {
            self.comms.abort_all(cause.clone());
            Drained::Wedged
        } else {
            let mut errors = Vec::new();
            let all_done = || -> Result<bool, String> {
                for e in &fences {
                    if !e.is_complete().map_err(|e| e.to_string())? {
                        return Ok(false);
                    }
                }
                Ok(true)
            };
            let d = drain(
                self.timeout,
                ABORT_GRACE.min(self.timeout),
                &mut HostClock::start(),
                all_done,
                || self.comms.check(&all).map_err(|e| e.to_string()),
                || self.comms.abort_all(cause.clone()),
                &mut errors,
            );
            for e in errors {
                self.park.park(e);
            }
            d
        };
        match drained {
            Drained::Clean => {}
            Drained::AfterAbort => self.park.park(format!(
                "rank {}: the streams drained only after the communicators were aborted at teardown",
                self.rank
            )),
            Drained::Wedged => {
                self.park.park(format!(
                    "rank {}: the streams had not drained {:?} after the communicators were aborted; the \
                     device's memory, pinned staging, events and context are left to the process's exit",
                    self.rank,
                    ABORT_GRACE.min(self.timeout)
                ));
                self.pool.leak_on_drop();
                self.device.wedge();
            }
        }
        let leftover = self.park.take();
        for e in leftover {
            tracing::error!(target: "collsched::init", "rank {}: CUDA error while shutting down: {e}", self.rank);
        }
    }
}
