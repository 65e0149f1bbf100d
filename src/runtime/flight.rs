//! Launching a group of collectives and waiting for it: what the gather side and the reduce
//! side of the driver share, and the counters they keep.

use std::time::{Duration, Instant};

use collsched_buckets::BucketId;

use super::RuntimeError;
use crate::backend::{Backend, BackendError, Collective, InFlight, LaunchError, Origin, Stream, WaitError};

/// Driver counters of the step in progress (the scheduler counts the rest).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCounters {
    /// Collectives (group launches) issued on the backend: one per gather, one per reduction
    /// stage (two for hybrid sharding's reduce-scatter + all-reduce).
    pub collectives: u64,
    /// Bytes the collectives carried: the gathered buffer of a gather, the input of a
    /// reduction stage.
    pub bytes_moved: u64,
    /// Time the host spent blocked waiting for collectives.
    pub wait_time: Duration,
    /// Waits that found their collectives still running (the host blocked).
    pub blocked_waits: u64,
}

/// Maps a backend error to the runtime's, naming rank, op and bucket.
pub(crate) fn backend_err(
    rank: usize,
    op: &'static str,
    bucket: Option<BucketId>,
) -> impl FnOnce(BackendError) -> RuntimeError {
    move |source| RuntimeError::Backend { rank, op, bucket, source }
}

/// Gives every buffer of `ops` back to the backend's pool (no fence: nothing reads them).
pub(crate) fn free_ops<B: Backend>(be: &B, ops: impl IntoIterator<Item = Collective<B::Buffer>>) {
    for c in ops {
        if let Some(i) = c.input {
            be.free(i, None);
        }
        be.free(c.output, None);
    }
}

/// Launches `ops` as one group on `stream` after `after`, each marked with `origin` (the engine
/// and step, for the flight record); a refused launch frees their buffers and names the op and
/// bucket.
pub(crate) fn launch<B: Backend>(
    be: &B,
    stream: Stream,
    after: &[B::Event],
    mut ops: Vec<Collective<B::Buffer>>,
    bucket: BucketId,
    origin: Origin,
    op: &'static str,
) -> Result<InFlight<B>, RuntimeError> {
    for c in &mut ops {
        c.desc.origin = Some(origin);
    }
    be.launch_group(stream, after, ops).map_err(|LaunchError { error, ops }| {
        free_ops(be, ops);
        RuntimeError::Backend { rank: be.rank(), op, bucket: Some(bucket), source: error }
    })
}

/// Why [`wait_flight`] returned no buffers.
pub(crate) enum Waited<B: Backend> {
    /// Not complete (only when not blocking): the launch, handed back.
    Pending(InFlight<B>),
    /// Failed, or timed out while blocking; the buffers are freed.
    Failed(BackendError),
}

/// Waits for `flight` (at most the backend's timeout, counted as wait time) when `block`,
/// else takes it only if complete.
pub(crate) fn wait_flight<B: Backend>(
    flight: InFlight<B>,
    block: bool,
    be: &B,
    counters: &mut DriverCounters,
) -> Result<Vec<Collective<B::Buffer>>, Waited<B>> {
    let r = if block {
        let start = Instant::now();
        let r = if matches!(flight.is_done(), Ok(true)) {
            flight.try_finish()
        } else {
            counters.blocked_waits += 1;
            flight.wait(be.timeout())
        };
        counters.wait_time += start.elapsed();
        r
    } else {
        match flight.is_done() {
            Ok(false) => return Err(Waited::Pending(flight)),
            _ => flight.try_finish(),
        }
    };
    match r {
        Ok(ops) => Ok(ops),
        Err(WaitError::TimedOut { in_flight, waited }) => {
            if block {
                drop(in_flight);
                Err(Waited::Failed(BackendError::EventTimeout { waited }))
            } else {
                Err(Waited::Pending(in_flight))
            }
        }
        Err(WaitError::Failed { error, ops }) => {
            free_ops(be, ops);
            Err(Waited::Failed(error))
        }
    }
}
