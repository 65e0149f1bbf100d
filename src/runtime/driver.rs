//! The driver: runs the scheduler's actions on a [`Backend`] and feeds completions back.
//!
//! What the driver does with each action:
//! - `Launch` (gather): copy this rank's shard into a pool buffer (copy-in), allocate the
//!   gathered buffer (and, for a bucket with parameters not contiguous in it, the unpacked
//!   buffer; on a backend that places pieces, only the unpacked one, which the all-gather fills
//!   directly), launch the bucket's all-gather (or broadcast) as one group on the all-gather
//!   stream after the fences.
//! - `Launch` (reduce): zero what no gradient wrote in the bucket's gradient buffer (or copy
//!   the host staging buffer into it), launch the reduce-scatter (or all-reduce) on the
//!   reduce-scatter stream; for hybrid sharding the all-reduce across groups is chained right
//!   behind it on the same stream (`Backend::launch_then`, no host wait).
//! - `Wait`: host wait (with the backend's timeout) for the launch, then finish it.
//! - `Free` (gather): drop the launch if still in flight and unviewed (the backend frees its
//!   buffers when it completes), else give the gathered and unpacked buffers back to the pool
//!   after the fences: the engine events the consumers gave to `release_after` and the
//!   unpack's event (one pending event: `backend.free(buf, Some(&event))`; several: kept in a
//!   deferred list until all but one completed). `Free` (gradient): nothing (the gradient buffer
//!   is the reduce-scatter's input, freed when it completes).
//! - `AllocGrad`: take the bucket's gradient buffer from the pool, zero its padding (host memory;
//!   on a device, zero a host staging buffer reused across steps).
//! - `CopyGradIn`: copy-in of the fresh gradient (cast from the parameters' dtype to the
//!   reduction dtype per run), the accumulator, or both added, into the gradient buffer.
//! - `AccumulateGrad`: add into the parameter's full-size accumulator, in the reduction dtype
//!   (the kernels' `accumulate`; `accumulate_cast` when the dtypes differ).
//!
//! Engine events (the scheduler's [`EngineEvent`](collsched_schedule::EngineEvent)s) are named per
//! coordinator (one engine queue each, increasing sequence numbers) and mapped back to the backend
//! events the engine gave, per gather bucket (the latest per queue, as the scheduler keeps them).
//! The fence of a `CopyGradIn` / `AccumulateGrad` is complete when the action runs:
//! `grad_ready_after` waited for it before the scheduler saw the gradient.
//!
//! Finishing a launch (a `Wait`, a fetch that needs the data, `end_step`, or without blocking
//! [`Coordinator::poll`](super::Coordinator::poll)) is the gather side's (`gather.rs`) or the
//! reduce side's (`reduce.rs`); each feeds `OpDone` to the scheduler.
//!
//! Steady-state steps allocate nothing here: host buffers grow once and are reused, backend
//! buffers come from the backend's pool, the per-bucket consumer lists and the deferred list
//! keep their capacity, and the `Vec`s of collectives handed to the backend come back with the
//! completed launch and are reused.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use collsched_buckets::BucketId;
use collsched_schedule::{Action, Fence, Role, Scheduler};

use super::flight::DriverCounters;
use super::gather::How;
use super::reduce::{Fresh, ReduceSide};
use super::state::RankState;
use super::tables::{GatherTables, GradTables};
use super::RuntimeError;
use crate::backend::Backend;

/// The number of the next engine made in this process (from 1).
static NEXT_ENGINE: AtomicU32 = AtomicU32::new(1);

/// The per-coordinator part of the driver: the action list, the reduce side (gradient
/// buffers, reductions in flight), the counters, and the engine's number its collectives carry
/// into the flight record ([`Origin`](crate::backend::Origin)).
pub(crate) struct Driver<B: Backend> {
    pub(crate) engine: u32,
    pub(crate) actions: Vec<Action>,
    pub(crate) reduce: ReduceSide<B>,
    events: Vec<B::Event>,
    pub(crate) counters: DriverCounters,
}

/// Everything a run of actions needs, borrowed for the call.
pub(crate) struct RankParts<'a, B: Backend> {
    pub(crate) backend: &'a B,
    pub(crate) tables: &'a GatherTables,
    pub(crate) grad: &'a Arc<GradTables>,
    pub(crate) st: &'a mut RankState<B>,
    pub(crate) sched: &'a mut Scheduler,
}

impl<B: Backend> Driver<B> {
    pub(crate) fn new(rank: usize, n_grad: usize) -> Self {
        Driver {
            engine: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
            actions: Vec::with_capacity(256),
            reduce: ReduceSide::new(rank, n_grad),
            events: Vec::with_capacity(8),
            counters: DriverCounters::default(),
        }
    }

    /// Runs `self.actions` in order (and clears them). `fresh` is the gradient handed to the
    /// `grad_ready` call that produced them.
    pub(crate) fn run(
        &mut self,
        cx: &mut RankParts<'_, B>,
        fresh: Option<Fresh<'_, B>>,
    ) -> Result<(), RuntimeError> {
        let actions = std::mem::take(&mut self.actions);
        let mut result = Ok(());
        for a in &actions {
            // Running the rest after a failure would leave buffers dangling: stop at the first
            // failure and report it (the scheduler's state is already advanced, the backend's
            // failure is sticky and the next call reports it too).
            if let Err(e) = self.run_one(cx, a, fresh) {
                result = Err(e);
                break;
            }
        }
        self.actions = actions;
        self.actions.clear();
        result
    }

    fn run_one(
        &mut self,
        cx: &mut RankParts<'_, B>,
        a: &Action,
        fresh: Option<Fresh<'_, B>>,
    ) -> Result<(), RuntimeError> {
        let rank = cx.tables.rank;
        let be = cx.backend;
        let counters = &mut self.counters;
        match a {
            Action::Launch(l) if l.id.role == Role::Gather => {
                let g = cx.tables.position(l.buffer.bucket).ok_or_else(|| RuntimeError::Internal {
                    rank,
                    what: format!(
                        "gather launch names bucket {}, which is not a gather bucket",
                        l.buffer.bucket
                    ),
                })?;
                cx.st.launch_gather(be, cx.tables, g, l, self.engine, counters)
            }
            Action::Launch(l) => {
                let j = grad_position(cx, l.buffer.bucket)?;
                if let Some(Fresh::Batch(grads, _)) = fresh {
                    // The bucket's copy-ins put off by this call go first, in one pack.
                    self.reduce.pack_deferred(be, cx.grad, grads, Some(j))?;
                }
                // Fences: launches still in flight (finished ones need no wait; engine events
                // are complete by construction).
                self.events.clear();
                for f in &l.after {
                    if let Fence::Op(id) = f {
                        let e = cx.st.gather().pending_event(*id).or_else(|| self.reduce.pending_event(*id));
                        self.events.extend(e.cloned());
                    }
                }
                self.reduce.launch(be, cx.grad, j, l, self.engine, &self.events, counters)
            }
            Action::Wait { fence: Fence::Op(id), .. } => match id.role {
                Role::Gather => {
                    cx.st.finish_gather(be, cx.tables, cx.sched, *id, How::OnStream, counters).map(|_| ())
                }
                Role::Reduce => {
                    let (store, mut done) = cx.st.for_reduce(cx.sched);
                    self.reduce.finish(be, cx.grad, store, *id, true, counters, &mut done).map(|_| ())
                }
            },
            // The scheduler puts engine events on frees and gradient copies (handled there),
            // never on waits.
            Action::Wait { fence: Fence::Engine(_), .. } => Ok(()),
            Action::Free { buffer, after } => match cx.tables.position(buffer.bucket) {
                Some(g) => cx.st.free_gathered(be, cx.tables, cx.sched, g, buffer.serial, after, counters),
                None => Ok(()),
            },
            Action::AllocGrad { buffer, .. } => {
                let j = grad_position(cx, buffer.bucket)?;
                self.reduce.alloc_grad(be, cx.grad, j)
            }
            Action::CopyGradIn { param, buffer, source, .. } => {
                let j = grad_position(cx, buffer.bucket)?;
                self.reduce.copy_grad_in(be, cx.grad, cx.st.grads_mut(), j, *param, *source, fresh)
            }
            Action::AccumulateGrad { param, .. } => {
                self.reduce.accumulate_grad(cx.grad, cx.st.grads_mut(), *param, fresh)
            }
        }
    }

    /// Finishes every reduction that already completed, without blocking.
    pub(crate) fn poll_reduces(&mut self, cx: &mut RankParts<'_, B>) -> Result<(), RuntimeError> {
        let (store, mut done) = cx.st.for_reduce(cx.sched);
        self.reduce.poll(cx.backend, cx.grad, store, &mut self.counters, &mut done)
    }

    /// Waits for every reduction in flight.
    pub(crate) fn drain_reduces(&mut self, cx: &mut RankParts<'_, B>) -> Result<(), RuntimeError> {
        let (store, mut done) = cx.st.for_reduce(cx.sched);
        self.reduce.drain(cx.backend, cx.grad, store, &mut self.counters, &mut done)
    }
}

fn grad_position<B: Backend>(cx: &RankParts<'_, B>, bucket: BucketId) -> Result<usize, RuntimeError> {
    cx.grad.position(bucket).ok_or_else(|| RuntimeError::Internal {
        rank: cx.tables.rank,
        what: format!("gradient bucket {bucket} of an action is not in the driver's tables"),
    })
}
