//! The CUDA backend's host-side waits: the fences of host copies, the drain of a stream after
//! a failed launch, and the bounded teardown (see the module docs of [`super`]).
//!
//! - **Host copies** are serialized (one at a time per rank, [`CudaBackend::host_copy`]): two
//!   threads' copies would queue behind each other on the copy stream, and a copy to or from
//!   pageable memory blocks inside the driver until the stream reaches it, without a bound.
//!   Each copy is fenced on every stream of the rank and on the copy stream's own earlier
//!   work, waited for on the host (bounded) before the copy is enqueued. A fence needs only
//!   the stream quiet ([`super::events::wait_quiet`]): after a peer's failure aborted the
//!   communicators, host copies still run, so a rank can save its shards.
//! - A copy that does not complete within the backend's timeout **wedges** the device
//!   ([`Device::wedge`](super::Device::wedge)): nothing the device may use is freed at
//!   teardown, and the error says that the caller's host memory may still be read or written
//!   by the device (pinned memory is reached by DMA directly).
//! - **Teardown** ([`Drop`]) waits for the streams at most the backend's timeout; if they have
//!   not drained (or NCCL reports a failure), it starts the abort of every communicator (none
//!   runs on the dropping thread, [`super::comms`]), waits at most [`ABORT_GRACE`] more for
//!   the streams and the aborts, and leaks the device's memory if either is still busy. With
//!   the CUDA driver already shut down (the process's exit: `CUDA_ERROR_DEINITIALIZED`) it
//!   calls nothing of NCCL's and leaks everything. What went wrong is logged
//!   (`collsched::init`), including the errors of the resources dropped after it (the park is
//!   closed, [`super::park`]).

use std::time::Instant;

use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;

use super::comms::Scope;
use super::device::lock;
use super::events::wait_quiet;
use super::wait::{drain, Drained, HostClock, ABORT_GRACE};
use super::{CudaBackend, CudaError, CudaEvent, StreamHandle};
use crate::backend::{BackendError, Stream};

/// Whether `e` says the CUDA driver was shut down (the process is exiting).
fn deinitialized(e: &CudaError) -> bool {
    matches!(e, CudaError::Driver { source, .. } if source.name == "CUDA_ERROR_DEINITIALIZED")
}

impl CudaBackend {
    /// Orders the copy stream after everything queued so far on the rank's other streams: on
    /// the device (`cuStreamWaitEvent` of an event recorded on each), and on the host, which
    /// waits for those events and for the copy stream's own earlier work (the stream quiet:
    /// [`wait_quiet`], watching the communicators) at most the backend's timeout in all before
    /// anything is enqueued behind them. A stream with collectives that does not get there in
    /// time has every communicator of the rank aborted (see [`super::comms`]).
    pub(super) fn fence_copy_stream(&self, op: &str) -> Result<(), BackendError> {
        // First the copy stream's own earlier work (a copy or device copy that timed out).
        let tail = self.copy.record_with(None).map_err(|e| self.be(e))?;
        let mut fences: Vec<(Option<Stream>, CudaEvent)> = Vec::with_capacity(Stream::ALL.len() + 1);
        for s in Stream::ALL {
            let e = self.stream(s).record().map_err(|e| self.be(e))?;
            self.copy.wait(&e).map_err(|e| self.be(e))?;
            fences.push((Some(s), e));
        }
        fences.push((None, tail));
        let start = Instant::now();
        for (s, e) in fences {
            if wait_quiet(&e, self.timeout.saturating_sub(start.elapsed()))? {
                continue;
            }
            let aborted = e.watch().is_some_and(|w| w.abort_after_timeout(self.timeout));
            let which = match s {
                Some(s) => format!("the {s} stream did not reach the point the copy must follow"),
                None => {
                    "the copy stream's earlier work (a host or device copy that timed out) did not end".into()
                }
            };
            return Err(BackendError::Device {
                rank: self.rank,
                api: "cuEventQuery",
                detail: format!(
                    "{op}: {which} within {:?} (the backend's timeout){}; nothing was copied; a peer is \
                     missing or stuck, or the engine's work on that stream is (raise \
                     COLLSCHED_CUDA_TIMEOUT_SECS if it is merely slow)",
                    self.timeout,
                    if aborted { ", so every communicator of the rank was aborted" } else { "" }
                ),
            });
        }
        Ok(())
    }

    /// A host copy on the copy stream, fenced ([`CudaBackend::fence_copy_stream`]) and
    /// complete on return (waited for at most the backend's timeout). One at a time per rank:
    /// the lock is held from the fence through the copy's drain (each holder's waits are
    /// bounded by the timeout, so a waiting thread's are too).
    ///
    /// A copy that did not complete in time (or whose completion the device cannot tell)
    /// wedges the device: the DMA may still read or write the caller's host memory and the
    /// device memory, so nothing is freed at teardown, and the error says so.
    pub(super) fn host_copy(
        &self,
        op: &str,
        api: &'static str,
        enqueue: impl FnOnce(cusys::CUstream) -> Result<(), cu::DriverError>,
    ) -> Result<(), BackendError> {
        let _one_at_a_time = lock(&self.host_copies);
        self.fence_copy_stream(op)?;
        collsched_kernels::cuda::check(api, enqueue(self.copy.raw()))
            .map_err(|e| self.be(CudaError::driver(op.to_string(), e)))?;
        let wedged = "the device is marked wedged (nothing it may use is freed at teardown), and the host \
                      memory given to this call may still be read or written by the device (pinned memory \
                      is reached by DMA directly): do not reuse it; exit the process";
        match self.copy.drain(self.timeout) {
            Ok(true) => Ok(()),
            Ok(false) => {
                self.device.wedge();
                Err(BackendError::Device {
                    rank: self.rank,
                    api,
                    detail: format!(
                        "{op}: the copy did not complete within {:?} (the backend's timeout); {wedged}",
                        self.timeout
                    ),
                })
            }
            Err(e) => {
                self.device.wedge();
                Err(BackendError::Device {
                    rank: self.rank,
                    api,
                    detail: format!("{op}: cannot tell whether the copy completed ({e}); {wedged}"),
                })
            }
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

    /// Teardown at the process's exit, the driver shut down: no CUDA or NCCL call can be made
    /// safely, so everything is left to the exit.
    fn leak_at_exit(&self) {
        let comms = self.comms.leak_all();
        self.pool.leak_on_drop();
        self.device.wedge();
        tracing::warn!(target: "collsched::init", "rank {}: the CUDA driver was already shut down (the process is exiting): {comms} NCCL communicators, the device's memory, pinned staging, events and context are left to the process's exit", self.rank);
    }
}

impl Drop for CudaBackend {
    /// Bounded (see the module docs): waits for the streams at most the backend's timeout,
    /// starts the abort of every communicator if they have not drained (or NCCL reports a
    /// failure), waits [`ABORT_GRACE`] more for the streams and the aborts, and leaks the
    /// device's memory if either is still busy after that.
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
        let (mut unknowable, mut exiting) = (false, false);
        for s in self.streams.iter().chain(std::iter::once(&self.copy)) {
            match s.record_with(None) {
                Ok(e) => fences.push(e),
                Err(e) if deinitialized(&e) => exiting = true,
                Err(e) => {
                    self.park.park(e);
                    unknowable = true;
                }
            }
        }
        let drained = if exiting {
            self.leak_at_exit();
            None
        } else if unknowable {
            self.comms.abort_all(cause.clone());
            Some(Drained::Wedged)
        } else {
            let mut errors = Vec::new();
            // Done when the streams drained and no abort still runs (an abort's thread uses
            // the communicator, the device and NCCL's host memory).
            let all_done = || -> Result<bool, String> {
                for e in &fences {
                    if !e.is_complete().map_err(|e| e.to_string())? {
                        return Ok(false);
                    }
                }
                Ok(self.comms.aborts_pending() == 0)
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
            Some(d)
        };
        match drained {
            None | Some(Drained::Clean) => {}
            Some(Drained::AfterAbort) => self.park.park(format!(
                "rank {}: the streams drained only after the communicators were aborted at teardown",
                self.rank
            )),
            Some(Drained::Wedged) => {
                self.park.park(format!(
                    "rank {}: the streams had not drained, or {} aborts of communicators had not ended, {:?} \
                     after the communicators were aborted; the device's memory, pinned staging, events and \
                     context are left to the process's exit",
                    self.rank,
                    self.comms.aborts_pending(),
                    ABORT_GRACE.min(self.timeout)
                ));
                self.pool.leak_on_drop();
                self.device.wedge();
            }
        }
        // Closed: the fields dropped after this (pool, staging, streams, communicators, the
        // device) and whatever outlives the backend log their errors themselves.
        for e in self.park.close() {
            tracing::error!(target: "collsched::init", "rank {}: CUDA error while shutting down: {e}", self.rank);
        }
    }
}
