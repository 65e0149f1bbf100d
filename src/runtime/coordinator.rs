//! [`Coordinator`]: the engine-facing API (DESIGN's `fetch` / `release` / `grad_ready` /
//! `no_sync` / `end_step`), one per engine per rank per model.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

use collsched_buckets::ParamId;
use collsched_kernels::ElemType;
use collsched_schedule::{EngineEvent, Scheduler, SchedulerConfig, StepCounters, StepReport};

use super::agreement::exchange_fingerprints;
use super::driver::{Driver, RankParts};
use super::flight::DriverCounters;
use super::reduce::Fresh;
use super::state::{GradRegion, ModelState, ShardUpdate};
use super::tables::GradTables;
use super::views::Views;
use super::RuntimeError;
use crate::backend::{Backend, BackendBuffer, BackendEvent};

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

impl<B: Backend> ModelState<B> {
    /// A new coordinator (engine) on this model, sharing its registry. Every rank must create
    /// its coordinators in the same order: creation exchanges the plan fingerprint with the
    /// peers (a collective on the compute stream).
    ///
    /// # Errors
    /// [`RuntimeError::Schedule`] (e.g. `PlanMismatch` naming the first differing bucket when
    /// ranks built different plans), [`RuntimeError::Backend`] if the exchange failed.
    pub fn coordinator(&self, config: SchedulerConfig) -> Result<Coordinator<B>, RuntimeError> {
        Coordinator::new(self.clone(), config)
    }
}

macro_rules! ctx {
    ($self:ident, $st:ident) => {
        RankParts {
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
            let shared = &state.shared;
            let sched = Scheduler::from_plan_input(
                &shared.plan,
                &shared.input,
                rank as u32,
                config,
                st.registry_mut(),
            )?;
            (sched, st.new_queue())
        };
        let grad = Arc::new(GradTables::new(&state.shared.plan, &sched, rank)?);
        let driver = Driver::new(rank, grad.grad.len());
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
        exchange_fingerprints(&*c.state.shared.backend, &mut c.sched)?;
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

    /// The engine's backward pass of this step begins
    /// ([`Scheduler::begin_backward`]): a policy with backward rules switches to them.
    pub fn begin_backward(&mut self) {
        self.sched.begin_backward();
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
            cx.st.poll_gathers(cx.backend, cx.tables, cx.sched, &mut self.driver.counters)?;
            if self.driver.reduce.in_flight() > 0 {
                // Reductions that completed give their input buffers back now (a backward's
                // fetches), not all at the step's end: completions change no launch.
                self.driver.poll_reduces(&mut cx)?;
            }
            cx.sched.fetch(cx.st.registry_mut(), params, &mut self.driver.actions)?;
            self.driver.run(&mut cx, None)?;
            cx.st.ensure_gathered(cx.backend, cx.tables, cx.sched, params, &mut self.driver.counters)?;
        }
        Ok(Views::new(st, &self.state))
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
        cx.sched.release(cx.st.registry_mut(), params, id, &mut self.driver.actions)?;
        if let (Some(id), Some(event)) = (id, event) {
            for p in params {
                cx.st.add_consumer(cx.tables.params[p.index()].gather, id, event);
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
        self.grad_ready_inner(param, Fresh::Host(grad), None)
    }

    /// [`grad_ready`](Self::grad_ready) for a gradient in the backend's memory (a device
    /// backend: the engine's gradient tensor as a buffer), **in the reduction dtype**
    /// (`GradReduce::dtype`; the engine casts it), complete once the work the compute stream
    /// holds now is: it is packed into its gradient bucket on the compute stream, without a
    /// host wait, so the engine may free or reuse `grad`'s memory for later work on that stream
    /// as soon as this returns. The bucket's reduction follows the compute stream, and its
    /// reduced shard stays in the backend's memory
    /// ([`take_grad_shards`](Self::take_grad_shards)). The library does not accumulate such
    /// gradients under `no_sync` (the engine keeps the sum, as FSDP2 keeps the unsharded
    /// gradient, and hands it over in the synchronized micro-batch), and one bucket takes
    /// gradients of one kind per step.
    ///
    /// # Errors
    /// As [`grad_ready`](Self::grad_ready) (`grad` shorter than the parameter in the reduction
    /// dtype; nothing changed); [`RuntimeError::Param`] under `no_sync` (nothing changed) or
    /// for a bucket that already took a host gradient this step on a backend without host
    /// buffers.
    pub fn grad_ready_on_device(&mut self, param: ParamId, grad: &B::Buffer) -> Result<(), RuntimeError> {
        self.grad_ready_inner(param, Fresh::Device(grad), None)
    }

    /// [`grad_ready_on_device`](Self::grad_ready_on_device) for each `(param, grad)` of
    /// `grads`, in order (a unit's gradients at its post-backward), with one copy-in launch
    /// per gradient bucket where one a gradient would launch as many: the copy-ins are put
    /// off until the bucket's reduction launches or the call ends, and go as one pack of the
    /// bucket's gradients of this call. Every `grad` must stay alive and unchanged by the host
    /// until the call returns (then, as for one gradient, the compute stream orders the rest).
    ///
    /// # Errors
    /// As [`grad_ready_on_device`](Self::grad_ready_on_device), for the first gradient that
    /// fails: those before it are taken (and packed), it and those after it are not.
    pub fn grad_ready_many_on_device(&mut self, grads: &[(ParamId, &B::Buffer)]) -> Result<(), RuntimeError> {
        let buffers: Vec<&B::Buffer> = grads.iter().map(|g| g.1).collect();
        let mut result = Ok(());
        for (k, &(param, _)) in grads.iter().enumerate() {
            result = self.grad_ready_inner(param, Fresh::Batch(&buffers, k), None);
            if result.is_err() {
                break;
            }
        }
        // What the call took goes in, also after a failure (the scheduler counts it copied).
        let shared = &self.state.shared;
        let _st = shared.lock();
        let packed = self.driver.reduce.pack_deferred(&*shared.backend, &self.grad, &buffers, None);
        result.and(packed)
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
        self.grad_ready_inner(param, Fresh::Host(grad), Some(event))
    }

    fn grad_ready_inner(
        &mut self,
        param: ParamId,
        grad: Fresh<'_, B>,
        event: Option<&B::Event>,
    ) -> Result<(), RuntimeError> {
        self.take_parked()?;
        let t = &self.state.shared.tables;
        let name = || self.state.plan().layout().params().name(param).to_string();
        if let (Some(_), true) = (grad.device_buffer(), self.sched.is_no_sync()) {
            return Err(RuntimeError::Param {
                rank: t.rank,
                param: Some(name()),
                what: "grad_ready_on_device under no_sync: the library does not accumulate gradients in the \
                       backend's memory; accumulate in the engine and hand the sum over in the synchronized \
                       micro-batch (nothing was changed)"
                    .into(),
            });
        }
        if let Some(slot) = t.params.get(param.index()) {
            // A device gradient comes in the reduction dtype (a frozen parameter has no bucket:
            // the scheduler refuses it below).
            let (len, elem_size, exact) = match (grad, grad.device_buffer()) {
                (Fresh::Host(g), _) => (g.len(), slot.elem_size, true),
                (_, b) => {
                    let g = self.grad.params.get(param.index()).map(|s| s.bucket as usize);
                    let reduced =
                        g.and_then(|j| self.grad.grad.get(j)).map_or(slot.elem_size, |t| t.elem.size());
                    (b.map_or(0, |b| b.len()), reduced, false)
                }
            };
            let want = slot.numel * elem_size;
            if (exact && len != want) || len < want {
                return Err(RuntimeError::Param {
                    rank: t.rank,
                    param: Some(name()),
                    what: format!(
                        "grad_ready: gradient has {len} bytes, expected {want} ({} elements of {elem_size} \
                         bytes); nothing was changed",
                        slot.numel,
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
        // A gradient its bucket cannot take now is refused before the scheduler counts it
        // (taken, then dropped, it would be reduced as zeros).
        let on_device = grad.device_buffer().is_some();
        if let Some(e) =
            self.driver.reduce.refuses(&*shared.backend, st.grads_mut(), &self.grad, param, on_device)
        {
            return Err(e);
        }
        let mut cx = ctx!(self, st);
        cx.sched.grad_ready(cx.st.registry_mut(), param, id, &mut self.driver.actions)?;
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

    /// no_sync without a guard, for engines that hold the flag themselves (a Python module's
    /// `set_requires_gradient_sync`): `true` accumulates gradients locally from the next
    /// gradient on, `false` reduces them (with everything accumulated) at the next synchronized
    /// step. Change it between steps, as with [`no_sync`](Self::no_sync).
    ///
    /// # Errors
    /// `NoSyncMidStep` if gradients already arrived in this step.
    pub fn set_no_sync(&mut self, on: bool) -> Result<(), RuntimeError> {
        self.take_parked()?;
        self.sched.set_no_sync(on)?;
        Ok(())
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
            let r = cx.sched.end_step(cx.st.registry_mut(), &mut self.driver.actions);
            // The actions are pushed even when the refresh at the end failed: run them.
            self.driver.run(&mut cx, None)?;
            self.driver.drain_reduces(&mut cx)?;
            cx.st.poll_gathers(cx.backend, cx.tables, cx.sched, &mut self.driver.counters)?;
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
            exchange_fingerprints(&*self.state.shared.backend, &mut self.sched)?;
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
            exchange_fingerprints(&*self.state.shared.backend, &mut self.sched)?;
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
        cx.st.poll_gathers(cx.backend, cx.tables, cx.sched, &mut self.driver.counters)?;
        self.driver.poll_reduces(&mut cx)
    }

    /// Reductions of this coordinator still in flight.
    pub fn reductions_in_flight(&self) -> usize {
        self.driver.reduce.in_flight()
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
        shared.lock().update_shards(&*shared.backend, &shared.tables, &mut f)
    }

    /// The reduced gradient shards of the last synchronized step, consumed, for an engine whose
    /// optimizer runs elsewhere (on the device, over [`ModelState::shard_region`]): `f` on
    /// every run of every trainable parameter with a reduced gradient, as a [`GradRegion`] (in
    /// the backend's memory where the gradients were given there,
    /// [`grad_ready_on_device`](Self::grad_ready_on_device); in host memory otherwise). The
    /// regions stay valid until the next call into this coordinator: an engine copies them out
    /// before (for device memory, work it queues on the compute stream by then is enough: the
    /// buffers go back to the pool only after that stream passed
    /// [`release_grad_shards`](Self::release_grad_shards) or the next reduction of their
    /// bucket). Returns how many runs it visited.
    ///
    /// # Errors
    /// A parked backend failure; [`RuntimeError::Plan`] if a parameter's gradient runs differ
    /// from its shard's.
    pub fn take_grad_shards<F>(&mut self, mut f: F) -> Result<usize, RuntimeError>
    where
        F: FnMut(GradRegion),
    {
        self.take_parked()?;
        let shared = &self.state.shared;
        shared.lock().take_grad_shards(&*shared.backend, &shared.tables, &mut f)
    }

    /// Gives the memory of the reduced gradient shards [`take_grad_shards`](Self::take_grad_shards)
    /// handed out back to the backend's pool now, behind the work queued on the compute stream
    /// so far (the engine's copies out of them), instead of at their bucket's next reduction:
    /// on a device, one step's gradients in the reduction dtype held until the next step ends.
    /// The regions are invalid after it, and no later call hands these gradients out again.
    ///
    /// # Errors
    /// A parked backend failure.
    pub fn release_grad_shards(&mut self) -> Result<(), RuntimeError> {
        self.take_parked()?;
        let shared = &self.state.shared;
        shared.lock().grads_mut().release_device(&*shared.backend);
        Ok(())
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
}
