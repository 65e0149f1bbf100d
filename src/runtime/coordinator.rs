//! [`Coordinator`]: the engine-facing API (DESIGN's `fetch` / `release` / `grad_ready` /
//! `no_sync` / `end_step`), one per engine per rank per model.

use std::borrow::Cow;
use std::ops::{Deref, DerefMut, Range};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use collsched_buckets::{BucketId, ParamId};
use collsched_kernels::ElemType;
use collsched_schedule::{EngineEvent, PlanDigests, Scheduler, SchedulerConfig, StepCounters, StepReport};

use super::driver::{ensure_gathered, poll_gathers, Ctx, Driver, DriverCounters, Gathered};
use super::state::{ModelState, RankState};
use super::tables::GradTables;
use super::RuntimeError;
use crate::backend::{Backend, BackendEvent, CollDesc, Collective, RankGroup, Stream};

/// What one step did: the scheduler's counters and the driver's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Step number (0 for the first step).
    pub step: u64,
    /// The scheduler's counters: gathers and reductions launched, bytes, prefetch launches,
    /// hits and misses, waits, drained parameters, peak gathered bytes, ...
    pub schedule: StepCounters,
    /// Collectives issued on the backend, bytes they carried, time the host waited.
    pub driver: DriverCounters,
}

impl StepStats {
    /// Collectives issued on the backend (group launches).
    pub fn collectives(&self) -> u64 {
        self.driver.collectives
    }

    /// Bytes the collectives carried.
    pub fn bytes_moved(&self) -> u64 {
        self.driver.bytes_moved
    }

    /// Time the host waited for collectives.
    pub fn wait_time(&self) -> Duration {
        self.driver.wait_time
    }

    /// Highest gathered bytes of the rank during the step (gathered buffers and their
    /// unpacked copies).
    pub fn peak_gathered_bytes(&self) -> u64 {
        self.schedule.peak_gathered_bytes
    }
}

/// One engine's handle on one rank's model state: runs a [`Scheduler`] and its actions on the
/// backend. Use it from the rank's thread.
///
/// Several coordinators on one [`ModelState`] (a training and an evaluation one) share the
/// in-flight registry and the gathered buffers: a bucket one of them gathered is used, not
/// gathered again, by the other, and freed only when both released it.
///
/// **Engine events.** [`release`](Self::release) and [`grad_ready`](Self::grad_ready) are the
/// host-synchronous forms: the engine's use of the parameters, or its gradient, is complete
/// when it calls (true of host compute on the local backend). An engine that overlaps (a CUDA
/// engine queues kernels and returns) uses [`release_after`](Self::release_after) and
/// [`grad_ready_after`](Self::grad_ready_after) with an event it recorded after that work
/// (e.g. `backend.record(Stream::Compute)`): buffers are freed, and reused by a later gather,
/// only after it. Events given to one coordinator must complete in the order given (record
/// them on one stream): a later one stands for the earlier ones. See the module docs for the
/// call order of a training step.
pub struct Coordinator<B: Backend> {
    state: ModelState<B>,
    sched: Scheduler,
    driver: Driver<B>,
    grad: Arc<GradTables>,
    parked: Option<RuntimeError>,
    stats: StepStats,
    /// `update_shards_f32`'s widened gradient (grows once, reused).
    wide: Vec<f32>,
    /// This coordinator's engine queue (for the scheduler's engine events) and the next
    /// sequence number on it.
    queue: u32,
    next_seq: u64,
}

impl<B: Backend> std::fmt::Debug for Coordinator<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("rank", &self.state.rank())
            .field("fingerprint", &format_args!("{:016x}", self.sched.fingerprint()))
            .finish()
    }
}

/// Gathered parameters, valid until the next call on the coordinator (the views borrow it and
/// hold the rank's model-state lock, so no buffer they show can be freed or reused under
/// them).
///
/// Each parameter's full value is one contiguous byte range of a backend buffer:
/// - of the **gathered buffer itself** when the parameter is one contiguous run of it (Flat
///   and Greedy layouts, single-owner buckets, any layout on a group of one): nothing is
///   copied after the collective;
/// - of an **unpacked buffer** otherwise (EvenSplit and Hybrid: every shard holds a chunk of
///   every parameter, so the chunks of one parameter lie a shard apart, as in FSDP2, which
///   copies out too). The driver unpacks such parameters once, straight from the gathered
///   buffer (the kernels' `copy_out` on the backend: no host staging), into a buffer taken
///   from the backend's pool with the gathered one and freed with it; the scheduler counts
///   both in its budgets and in live and peak gathered bytes.
///
/// Both buffers exist only while the bucket is gathered (from its gather to the `Free` after
/// its last release): nothing of the model's full size is kept across steps.
///
/// Host backends (the local one) read the bytes directly ([`Views::bytes`], [`Views::f32`]);
/// device backends hand out the buffer and range ([`Views::buffer`]: a CUDA engine takes the
/// device pointer of the buffer plus the range's start), or copy to the host
/// ([`Views::copy_to_host`], [`Views::read_f32`]). Views are **read-only**: writing through
/// a device pointer obtained from one is not allowed (other coordinators on the model see the
/// same buffers, and the shards are the parameters' truth: update them with
/// [`Coordinator::update_shards`]). No collective reads a buffer a view shows: the gathered
/// buffer is the output of a completed collective, and the pool hands it to a new gather only
/// after its `Free` and the events that free waits for.
pub struct Views<'a, B: Backend> {
    st: MutexGuard<'a, RankState<B>>,
    state: &'a ModelState<B>,
}

/// Where a viewed parameter is: its finished gather, the buffer and the byte range.
type Located<'v, B> = (&'v Gathered<B>, &'v <B as Backend>::Buffer, Range<usize>);

impl<B: Backend> Views<'_, B> {
    fn name(&self, param: ParamId) -> Option<String> {
        Some(self.state.plan().layout().params().name(param).to_string())
    }

    /// The finished gather holding `param`, the buffer its value is in and the byte range.
    fn locate(&self, param: ParamId) -> Result<Located<'_, B>, RuntimeError> {
        let t = &self.state.shared.tables;
        let rank = t.rank;
        let slot = t.params.get(param.index()).copied().ok_or_else(|| RuntimeError::Param {
            rank,
            param: Some(format!("id {param}")),
            what: format!("not a parameter of this model ({} parameters)", t.params.len()),
        })?;
        let current = self.st.registry.gathered_by(param);
        let not_gathered = || RuntimeError::Param {
            rank,
            param: self.name(param),
            what: format!(
                "not gathered (gather bucket {}); fetch it before reading it",
                t.gather[slot.gather].id
            ),
        };
        let held = self.st.gather.gathered(slot.gather, current).ok_or_else(not_gathered)?;
        let buffer =
            if slot.unpacked { held.unpacked.as_ref().ok_or_else(not_gathered)? } else { &held.buffer };
        let es = slot.elem_size;
        Ok((held, buffer, slot.base * es..(slot.base + slot.numel) * es))
    }

    /// Where the full value of `param` is: a backend buffer and the byte range in it
    /// (little-endian bytes of its dtype). The backend-generic form: a CUDA engine reads the
    /// parameter at the buffer's device pointer plus `range.start` on its compute stream
    /// (which already waits for any unpack). Read-only (see [`Views`]).
    ///
    /// # Errors
    /// [`RuntimeError::Param`] if the parameter is unknown or not gathered (not fetched).
    pub fn buffer(&self, param: ParamId) -> Result<(&B::Buffer, Range<usize>), RuntimeError> {
        self.locate(param).map(|(_, b, r)| (b, r))
    }

    /// The full value of `param` (little-endian bytes of its dtype), for backends whose
    /// buffers are host memory.
    ///
    /// # Errors
    /// [`RuntimeError::Param`] if the parameter is unknown or not gathered (not fetched);
    /// [`RuntimeError::Unsupported`] on a device backend (use [`Views::buffer`], or copy with
    /// [`Views::copy_to_host`] / [`Views::read_f32`]).
    pub fn bytes(&self, param: ParamId) -> Result<&[u8], RuntimeError> {
        let (_, buffer, range) = self.locate(param)?;
        let be = &*self.state.shared.backend;
        be.host_bytes(buffer).and_then(|b| b.get(range)).ok_or_else(|| RuntimeError::Unsupported {
            rank: be.rank(),
            what: format!(
                "parameter {}: the backend's buffers are device memory, not host bytes; use Views::buffer \
                 (the buffer and byte range, for device code) or Views::copy_to_host / Views::read_f32",
                self.name(param).unwrap_or_default()
            ),
        })
    }

    /// The full value of an `f32` parameter, for backends whose buffers are host memory.
    ///
    /// # Errors
    /// As [`Views::bytes`], and [`RuntimeError::Param`] if the parameter is not `f32`.
    pub fn f32(&self, param: ParamId) -> Result<&[f32], RuntimeError> {
        self.check_f32(param)?;
        let b = self.bytes(param)?;
        // Buffers are 64-byte (local) or 256-byte (CUDA) aligned and f32 runs start at
        // multiples of 4 bytes.
        bytemuck::try_cast_slice(b).map_err(|e| RuntimeError::Param {
            rank: self.state.rank(),
            param: Some(format!("id {param}")),
            what: format!("cannot view as f32: {e}"),
        })
    }

    fn check_f32(&self, param: ParamId) -> Result<(), RuntimeError> {
        let t = &self.state.shared.tables;
        let Some(slot) = t.params.get(param.index()) else { return Ok(()) };
        let elem = t.gather[slot.gather].elem;
        if elem != ElemType::F32 {
            return Err(RuntimeError::Param {
                rank: t.rank,
                param: self.name(param),
                what: format!("is {}, not f32; read it with Views::bytes or Views::buffer", elem.name()),
            });
        }
        Ok(())
    }

    /// Copies the full value of `param` into `dst` (any backend; on a device backend after
    /// waiting for the unpack, at most the backend's timeout).
    ///
    /// # Errors
    /// As [`Views::buffer`]; [`RuntimeError::Param`] if `dst` does not have the parameter's
    /// size; [`RuntimeError::Backend`] if the copy failed.
    pub fn copy_to_host(&self, param: ParamId, dst: &mut [u8]) -> Result<(), RuntimeError> {
        let (held, buffer, range) = self.locate(param)?;
        let be = &*self.state.shared.backend;
        let rank = be.rank();
        if dst.len() != range.len() {
            return Err(RuntimeError::Param {
                rank,
                param: self.name(param),
                what: format!(
                    "copy_to_host: destination has {} bytes, the parameter {}",
                    dst.len(),
                    range.len()
                ),
            });
        }
        let err = |source| RuntimeError::Backend { rank, op: "view copy to host", bucket: None, source };
        if let Some(e) = &held.ready {
            e.wait(be.timeout()).map_err(err)?;
        }
        be.read_to_host(buffer, range.start, dst).map_err(err)
    }

    /// The full value of an `f32` parameter on the host: borrowed from the buffer on host
    /// backends, a copy on device backends.
    ///
    /// # Errors
    /// As [`Views::f32`] and [`Views::copy_to_host`].
    pub fn read_f32(&self, param: ParamId) -> Result<Cow<'_, [f32]>, RuntimeError> {
        self.check_f32(param)?;
        let (_, buffer, range) = self.locate(param)?;
        if self.state.shared.backend.host_bytes(buffer).is_some() {
            return self.f32(param).map(Cow::Borrowed);
        }
        let mut v = vec![0f32; range.len() / 4];
        self.copy_to_host(param, bytemuck::cast_slice_mut(&mut v))?;
        Ok(Cow::Owned(v))
    }
}

/// One trainable parameter's shard, handed to the optimizer hook
/// ([`Coordinator::update_shards`]).
///
/// The gradient comes **in the reduction dtype** (`GradReduce::dtype`, by default the
/// parameter's): the reduced shard exactly as the collective left it, never rounded again.
/// With bf16 parameters reduced in f32 the optimizer gets the f32 gradient (as FSDP2 does when
/// the sharded gradient's dtype is set to the reduction's, avoiding a lossy round trip), and
/// with f32 parameters reduced in bf16 it gets the bf16 gradient (widening it to f32 is
/// exact; [`Coordinator::update_shards_f32`] does that).
#[derive(Debug)]
pub struct ShardUpdate<'a> {
    /// The parameter.
    pub param: ParamId,
    /// First element of the parameter (flattened) this run covers.
    pub param_offset: usize,
    /// This rank's elements of the parameter (little-endian bytes of `elem`), to update.
    pub values: &'a mut [u8],
    /// The reduced gradient of exactly those elements (little-endian bytes of `grad_elem`).
    pub grad: &'a [u8],
    /// Element type of `values` (the parameter's dtype).
    pub elem: ElemType,
    /// Element type of `grad` (the reduction dtype).
    pub grad_elem: ElemType,
}

/// The no_sync guard ([`Coordinator::no_sync`]): gradients accumulate locally until it is
/// dropped. Derefs to the coordinator.
pub struct NoSync<'a, B: Backend> {
    coord: &'a mut Coordinator<B>,
}

impl<B: Backend> Deref for NoSync<'_, B> {
    type Target = Coordinator<B>;
    fn deref(&self) -> &Coordinator<B> {
        self.coord
    }
}

impl<B: Backend> DerefMut for NoSync<'_, B> {
    fn deref_mut(&mut self) -> &mut Coordinator<B> {
        self.coord
    }
}

impl<B: Backend> Drop for NoSync<'_, B> {
    fn drop(&mut self) {
        if let Err(e) = self.coord.sched.set_no_sync(false) {
            // Reported by the next fallible call (STYLE 8).
            if self.coord.parked.is_none() {
                self.coord.parked = Some(e.into());
            }
        }
    }
}

macro_rules! ctx {
    ($self:ident, $st:ident) => {
        Ctx {
            backend: &*$self.state.shared.backend,
            tables: &$self.state.shared.tables,
            grad: &$self.grad,
            st: &mut $st,
            sched: &mut $self.sched,
        }
    };
}

impl<B: Backend> Coordinator<B> {
    pub(crate) fn new(state: ModelState<B>, config: SchedulerConfig) -> Result<Coordinator<B>, RuntimeError> {
        let rank = state.rank();
        let (sched, queue) = {
            let mut st = state.shared.lock();
            let sched = Scheduler::from_plan(&state.shared.plan, rank as u32, config, &mut st.registry)?;
            (sched, st.gather.new_queue())
        };
        let grad = Arc::new(GradTables::new(&state.shared.plan, &sched, rank)?);
        let driver = Driver::new(grad.grad.len());
        let mut c = Coordinator {
            state,
            sched,
            driver,
            grad,
            parked: None,
            stats: StepStats::default(),
            wide: Vec::new(),
            queue,
            next_seq: 0,
        };
        c.exchange_fingerprints()?;
        Ok(c)
    }

    fn take_parked(&mut self) -> Result<(), RuntimeError> {
        match self.parked.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The model state this coordinator works on.
    pub fn model(&self) -> &ModelState<B> {
        &self.state
    }

    /// The scheduler (its configuration, plan tables, counters, policy).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// Replaces the prefetch policy (between steps).
    pub fn set_policy(&mut self, policy: Box<dyn collsched_schedule::PrefetchPolicy>) {
        self.sched.set_policy(policy);
    }

    /// Gathers `params` (their whole buckets, one collective per bucket not yet gathered,
    /// prefetching what the policy says) and returns views of their full values.
    ///
    /// # Errors
    /// [`RuntimeError::Schedule`] (an unknown parameter: nothing changed),
    /// [`RuntimeError::Backend`] naming the op and bucket if a collective failed.
    pub fn fetch(&mut self, params: &[ParamId]) -> Result<Views<'_, B>, RuntimeError> {
        self.take_parked()?;
        let shared = &self.state.shared;
        let mut st = shared.lock();
        {
            let mut cx = ctx!(self, st);
            poll_gathers(&mut cx, &mut self.driver.counters)?;
            cx.sched.fetch(&mut cx.st.registry, params, &mut self.driver.actions)?;
            self.driver.run(&mut cx, None)?;
            ensure_gathered(&mut cx, params, &mut self.driver.counters)?;
        }
        Ok(Views { st, state: &self.state })
    }

    /// The engine is done with `params`, now (host-synchronous): buckets whose last user this
    /// was are freed.
    ///
    /// # Errors
    /// [`RuntimeError::Schedule`] with `NotFetched` for a parameter this coordinator did not
    /// fetch or already released (nothing changed); backend failures.
    pub fn release(&mut self, params: &[ParamId]) -> Result<(), RuntimeError> {
        self.release_inner(params, None)
    }

    /// The engine's use of `params` ends at `event` (recorded by the engine after the work
    /// that reads them, e.g. `backend.record(Stream::Compute)`): buckets whose last user this
    /// was are freed once `event` (and every other user's event) completed, never before:
    /// until then their buffers are neither reused by a later gather nor overwritten. Returns
    /// at once.
    ///
    /// # Errors
    /// As [`release`](Self::release).
    pub fn release_after(&mut self, params: &[ParamId], event: &B::Event) -> Result<(), RuntimeError> {
        self.release_inner(params, Some(event))
    }

    /// The next engine event name on this coordinator's queue.
    fn engine_event(&mut self) -> EngineEvent {
        let e = EngineEvent { queue: self.queue, seq: self.next_seq };
        self.next_seq += 1;
        e
    }

    fn release_inner(&mut self, params: &[ParamId], event: Option<&B::Event>) -> Result<(), RuntimeError> {
        self.take_parked()?;
        let id = event.map(|_| self.engine_event());
        let shared = &self.state.shared;
        let mut st = shared.lock();
        let mut cx = ctx!(self, st);
        cx.sched.release(&mut cx.st.registry, params, id, &mut self.driver.actions)?;
        if let (Some(id), Some(event)) = (id, event) {
            for p in params {
                cx.st.gather.add_consumer(cx.tables.params[p.index()].gather, id, event);
            }
        }
        self.driver.run(&mut cx, None)
    }

    /// The gradient of `param` is complete: copied into its gradient bucket (or accumulated
    /// under no_sync); the bucket's reduce-scatter launches when its last gradient arrived.
    ///
    /// # Errors
    /// [`RuntimeError::Param`] if `grad` has the wrong size (nothing changed);
    /// [`RuntimeError::Schedule`] for a frozen parameter or a second gradient in one step;
    /// backend failures.
    pub fn grad_ready(&mut self, param: ParamId, grad: &[u8]) -> Result<(), RuntimeError> {
        self.grad_ready_inner(param, grad, None)
    }

    /// [`grad_ready`](Self::grad_ready) for a gradient that is complete only once `event`
    /// completed (e.g. the engine queued the device-to-host copy of `grad` on its stream and
    /// recorded `event` after it). The gradient is a host slice borrowed for this call only,
    /// so the call waits for `event` on the host (at most the backend's timeout; counted as
    /// waiting time) **before** anything changes, then proceeds as `grad_ready`: the copy into
    /// the gradient bucket (or the no_sync accumulation) reads `grad` after `event`. The
    /// scheduler gets the event too (its `CopyGradIn` / `AccumulateGrad` actions name it,
    /// complete by then).
    ///
    /// # Errors
    /// As [`grad_ready`](Self::grad_ready); [`RuntimeError::Backend`] if `event` failed or
    /// did not complete within the timeout: then nothing was changed (the gradient was not
    /// taken; call again once the event can complete).
    pub fn grad_ready_after(
        &mut self,
        param: ParamId,
        grad: &[u8],
        event: &B::Event,
    ) -> Result<(), RuntimeError> {
        self.grad_ready_inner(param, grad, Some(event))
    }

    fn grad_ready_inner(
        &mut self,
        param: ParamId,
        grad: &[u8],
        event: Option<&B::Event>,
    ) -> Result<(), RuntimeError> {
        self.take_parked()?;
        let t = &self.state.shared.tables;
        if let Some(slot) = t.params.get(param.index()) {
            let want = slot.numel * slot.elem_size;
            if grad.len() != want {
                return Err(RuntimeError::Param {
                    rank: t.rank,
                    param: Some(self.state.plan().layout().params().name(param).to_string()),
                    what: format!(
                        "grad_ready: gradient has {} bytes, expected {want} ({} elements of {} bytes); \
                         nothing was changed",
                        grad.len(),
                        slot.numel,
                        slot.elem_size
                    ),
                });
            }
        }
        if let Some(e) = event {
            // The gradient is complete only after the engine's event: wait before anything
            // changes, so a failure or timeout leaves the step as it was.
            let be = &*self.state.shared.backend;
            let start = Instant::now();
            let r = e.wait(be.timeout());
            self.driver.counters.wait_time += start.elapsed();
            r.map_err(|source| RuntimeError::Backend {
                rank: be.rank(),
                op: "grad_ready_after (waiting for the engine's event; nothing was changed)",
                bucket: self.sched.grad_bucket_of(param),
                source,
            })?;
        }
        let id = event.map(|_| self.engine_event());
        let shared = &self.state.shared;
        let mut st = shared.lock();
        let mut cx = ctx!(self, st);
        cx.sched.grad_ready(&mut cx.st.registry, param, id, &mut self.driver.actions)?;
        self.driver.run(&mut cx, Some(grad))
    }

    /// [`grad_ready`](Self::grad_ready) for an `f32` gradient.
    ///
    /// # Errors
    /// As [`grad_ready`](Self::grad_ready).
    pub fn grad_ready_f32(&mut self, param: ParamId, grad: &[f32]) -> Result<(), RuntimeError> {
        self.grad_ready(param, bytemuck::cast_slice(grad))
    }

    /// Turns no_sync on until the guard is dropped: gradients accumulate locally (full size)
    /// and nothing is reduced; the first step after it reduces them. Drop the guard between
    /// steps (after `end_step`); a failure to turn it off is reported by the next call.
    ///
    /// # Errors
    /// `NoSyncMidStep` if gradients already arrived in this step.
    pub fn no_sync(&mut self) -> Result<NoSync<'_, B>, RuntimeError> {
        self.take_parked()?;
        self.sched.set_no_sync(true)?;
        Ok(NoSync { coord: self })
    }

    /// Ends the step: drains unused prefetches, reduces unfilled gradient buckets (missing
    /// gradients as zeros), waits for the step's reductions (their shards are then ready for
    /// [`update_shards`](Self::update_shards)), applies a pending trainability mask (and then
    /// exchanges the new plan fingerprint with the peers). Details of the step (drained, held,
    /// zero-filled parameters) are in [`last_report`](Self::last_report).
    ///
    /// # Errors
    /// Scheduler errors (e.g. `RefreshWithUnsynced`: the step still ended); backend failures;
    /// `PlanMismatch` after a refresh.
    pub fn end_step(&mut self) -> Result<StepStats, RuntimeError> {
        self.take_parked()?;
        let before = self.sched.fingerprint();
        let shared = &self.state.shared;
        let mut st = shared.lock();
        let r = {
            let mut cx = ctx!(self, st);
            let r = cx.sched.end_step(&mut cx.st.registry, &mut self.driver.actions);
            // The actions are pushed even when the refresh at the end failed: run them.
            self.driver.run(&mut cx, None)?;
            self.driver.drain_reduces(&mut cx)?;
            poll_gathers(&mut cx, &mut self.driver.counters)?;
            r
        };
        drop(st);
        let report = self.sched.last_step();
        self.stats = StepStats {
            step: report.step,
            schedule: report.counters.clone(),
            driver: std::mem::take(&mut self.driver.counters),
        };
        if self.sched.fingerprint() != before {
            self.rebuild_grad_tables()?;
            self.exchange_fingerprints()?;
        }
        r?;
        Ok(self.stats.clone())
    }

    /// The last step's scheduler report: drained, zero-filled and held parameters.
    pub fn last_report(&self) -> &StepReport {
        self.sched.last_step()
    }

    /// The last step's counters.
    pub fn last_stats(&self) -> &StepStats {
        &self.stats
    }

    /// The scheduler's counters of the step in progress.
    pub fn counters(&self) -> &StepCounters {
        self.sched.counters()
    }

    /// Records the engine's `requires_grad` mask; with `check_trainable` on (the default) the
    /// next `end_step` switches to the refreshed plan if it differs.
    ///
    /// # Errors
    /// `MaskLength`.
    pub fn set_trainable(&mut self, mask: &[bool]) -> Result<(), RuntimeError> {
        self.take_parked()?;
        Ok(self.sched.set_trainable(mask)?)
    }

    /// Switches to the plan for `mask` now (between steps), keeping gather buckets and shards,
    /// and exchanges the new fingerprint with the peers (a collective: every rank calls it).
    /// Returns whether anything changed.
    ///
    /// # Errors
    /// `RefreshWithUnsynced` (no_sync gradients not yet reduced), `RefreshMidStep`,
    /// `MaskLength`; `PlanMismatch` if the ranks' refreshed plans differ.
    pub fn refresh_trainable(&mut self, mask: &[bool]) -> Result<bool, RuntimeError> {
        self.take_parked()?;
        let changed = self.sched.refresh_trainable(mask)?;
        if changed {
            self.rebuild_grad_tables()?;
            self.exchange_fingerprints()?;
        }
        Ok(changed)
    }

    fn rebuild_grad_tables(&mut self) -> Result<(), RuntimeError> {
        let mask = self.sched.params().trainable_mask();
        let rank = self.state.rank();
        let (plan, _) = self
            .state
            .shared
            .plan
            .with_trainable(&mask)
            .map_err(|e| RuntimeError::Plan { rank, what: format!("refreshing the plan: {e}") })?;
        self.grad = Arc::new(GradTables::new(&plan, &self.sched, rank)?);
        Ok(())
    }

    /// Finishes, without blocking, every collective of this rank that already completed
    /// (copy-out, gradient shards, `OpDone`), so that later fetches need no waits.
    ///
    /// # Errors
    /// Backend failures of the finished collectives.
    pub fn poll(&mut self) -> Result<(), RuntimeError> {
        self.take_parked()?;
        let shared = &self.state.shared;
        let mut st = shared.lock();
        let mut cx = ctx!(self, st);
        poll_gathers(&mut cx, &mut self.driver.counters)?;
        self.driver.poll_reduces(&mut cx)
    }

    /// Reductions of this coordinator still in flight.
    pub fn reductions_in_flight(&self) -> usize {
        self.driver.reduces_in_flight()
    }

    /// The driver's counters of the step in progress (collectives issued so far, bytes, host
    /// wait time); [`end_step`](Self::end_step) returns and resets them.
    pub fn driver_counters(&self) -> &DriverCounters {
        &self.driver.counters
    }

    /// The optimizer hook: calls `f` once per run of every trainable parameter this rank
    /// holds, with the parameter's shard elements (mutable) and the reduced gradient of the
    /// same elements from the last synchronized step. The layout guarantees a gradient
    /// element is owned by the rank that owns the parameter element. Returns the number of
    /// runs visited; the gradients are consumed (a second call visits nothing until the next
    /// synchronized step).
    ///
    /// Call it after `end_step`, with nothing gathered (gathered copies would be stale).
    ///
    /// # Errors
    /// [`RuntimeError::Plan`] if buckets are still gathered (release them and end the step
    /// first) or a gradient run does not match its parameter run.
    pub fn update_shards<F>(&mut self, mut f: F) -> Result<usize, RuntimeError>
    where
        F: FnMut(ShardUpdate<'_>),
    {
        self.take_parked()?;
        let shared = &self.state.shared;
        let t = &shared.tables;
        let rank = t.rank;
        let mut guard = shared.lock();
        let st = &mut *guard;
        if let Some((bucket, _, users)) = st.registry.gathered().next() {
            return Err(RuntimeError::Plan {
                rank,
                what: format!(
                    "update_shards: gather bucket {bucket} is still gathered ({users} users); release every \
                     parameter and end the step before updating the shards"
                ),
            });
        }
        let Some(grad) = st.grad_tables.clone() else { return Ok(0) };
        let mut visited = 0;
        for (i, slot) in grad.params.iter().enumerate() {
            let j = slot.bucket as usize;
            if slot.bucket == u32::MAX || !st.grad_valid.get(j).copied().unwrap_or(false) {
                continue;
            }
            let p = ParamId(i as u32);
            let pslot = t.params[i];
            let g = pslot.gather;
            let es = pslot.elem_size;
            let elem = t.gather[g].elem;
            let grad_elem = grad.grad[j].elem;
            let gs = grad_elem.size();
            let (glo, ghi) = slot.shard_runs;
            let gruns = &grad.shard_runs[glo as usize..ghi as usize];
            let pruns = t.runs_of(p);
            if gruns.len() != pruns.len() {
                return Err(mismatch(rank, p, t.gather[g].id, grad.grad[j].id));
            }
            for (pr, gr) in pruns.iter().zip(gruns) {
                if pr.param_offset != gr.param_offset || pr.numel != gr.numel {
                    return Err(mismatch(rank, p, t.gather[g].id, grad.grad[j].id));
                }
                let values =
                    &mut st.shards[g].as_bytes_mut()[pr.shard_offset * es..(pr.shard_offset + pr.numel) * es];
                let gbytes =
                    &st.grad_shards[j].as_bytes()[gr.shard_offset * gs..(gr.shard_offset + gr.numel) * gs];
                f(ShardUpdate {
                    param: p,
                    param_offset: pr.param_offset,
                    values,
                    grad: gbytes,
                    elem,
                    grad_elem,
                });
                visited += 1;
            }
        }
        st.grad_valid.iter_mut().for_each(|v| *v = false);
        Ok(visited)
    }

    /// [`update_shards`](Self::update_shards) for `f32` parameters: `f(param, param_offset,
    /// values, grad)`. A gradient reduced in f16 or bf16 is widened to f32 (exactly).
    ///
    /// # Errors
    /// As [`update_shards`](Self::update_shards); [`RuntimeError::Param`] for a parameter that
    /// is not `f32` (earlier runs were updated).
    pub fn update_shards_f32<F>(&mut self, mut f: F) -> Result<usize, RuntimeError>
    where
        F: FnMut(ParamId, usize, &mut [f32], &[f32]),
    {
        let rank = self.state.rank();
        let mut bad = None;
        let mut wide = std::mem::take(&mut self.wide);
        let n = self.update_shards(|u| {
            if bad.is_some() {
                return;
            }
            let grad: Result<&[f32], _> = if u.grad_elem == ElemType::F32 {
                bytemuck::try_cast_slice::<u8, f32>(u.grad).map_err(|_| ())
            } else {
                wide.clear();
                wide.resize(u.grad.len() / u.grad_elem.size(), 0.0);
                collsched_kernels::cast(
                    u.grad_elem,
                    u.grad,
                    ElemType::F32,
                    bytemuck::cast_slice_mut(&mut wide),
                )
                .map(|()| &wide[..])
                .map_err(|_| ())
            };
            match (u.elem, bytemuck::try_cast_slice_mut::<u8, f32>(u.values), grad) {
                (ElemType::F32, Ok(w), Ok(g)) => f(u.param, u.param_offset, w, g),
                _ => bad = Some(u.param),
            }
        });
        self.wide = wide;
        let n = n?;
        match bad {
            Some(p) => Err(RuntimeError::Param {
                rank,
                param: Some(self.state.plan().layout().params().name(p).to_string()),
                what: "update_shards_f32: not an f32 parameter; use update_shards".into(),
            }),
            None => Ok(n),
        }
    }

    /// Exchanges this plan's digests with every rank (an all-gather on the compute stream)
    /// and checks them: a mismatch names the first differing bucket.
    fn exchange_fingerprints(&mut self) -> Result<(), RuntimeError> {
        let be = &*self.state.shared.backend;
        let n = be.world_size();
        if n == 1 {
            return Ok(());
        }
        let rank = be.rank();
        let mine = self.sched.digests().clone();
        let header = [mine.fingerprint, mine.buckets.len() as u64];
        let all = all_gather_words(be, &header)?;
        let fps: Vec<u64> = all.chunks(2).map(|c| c[0]).collect();
        if fps.iter().all(|&f| f == mine.fingerprint) {
            return Ok(());
        }
        let longest = all.chunks(2).map(|c| c[1] as usize).max().unwrap_or(0);
        let mut words = mine.buckets.clone();
        words.resize(longest, 0);
        let digests = all_gather_words(be, &words)?;
        let peers: Vec<(u32, PlanDigests)> = (0..n)
            .filter(|&r| r != rank)
            .map(|r| {
                let len = (all[2 * r + 1] as usize).min(longest);
                let buckets = digests[r * longest..r * longest + len].to_vec();
                (r as u32, PlanDigests { fingerprint: fps[r], buckets })
            })
            .collect();
        Ok(self.sched.check_peers(peers.iter().map(|(r, d)| (*r, d)))?)
    }
}

fn mismatch(rank: usize, p: ParamId, gather: BucketId, grad: BucketId) -> RuntimeError {
    RuntimeError::Plan {
        rank,
        what: format!(
            "parameter id {p}: its shard runs in gather bucket {gather} and gradient bucket {grad} differ; the \
             layout must give a gradient element to the rank owning the parameter element"
        ),
    }
}

/// All-gathers `words` (the same count on every rank) over the world on the compute stream.
fn all_gather_words<B: Backend>(be: &B, words: &[u64]) -> Result<Vec<u64>, RuntimeError> {
    let rank = be.rank();
    let n = be.world_size();
    let err = |source| RuntimeError::Backend { rank, op: "plan fingerprint exchange", bucket: None, source };
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    // Words travel as pairs of f32 bit patterns: an all-gather copies them untouched.
    let desc = CollDesc::all_gather(RankGroup::world(n), ElemType::F32, 2 * words.len()).with_tag(0xF1_4E6E);
    let mut input = be.alloc(bytes.len().max(1)).map_err(err)?;
    be.write_from_host(&mut input, 0, &bytes).map_err(err)?;
    let output = be.alloc((bytes.len() * n).max(1)).map_err(err)?;
    if words.is_empty() {
        be.free(input, None);
        be.free(output, None);
        return Ok(Vec::new());
    }
    let flight = be
        .launch(Stream::Compute, &[], Collective { desc, input: Some(input), output })
        .map_err(|e| err(e.error))?;
    let _ = flight.event().query();
    let mut done = flight.wait(be.timeout()).map_err(|e| err(e.into_error()))?;
    let mut host = vec![0u8; bytes.len() * n];
    let r = be.read_to_host(&done[0].output, 0, &mut host);
    for c in done.drain(..) {
        if let Some(i) = c.input {
            be.free(i, None);
        }
        be.free(c.output, None);
    }
    r.map_err(err)?;
    Ok(host.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
}
