//! The sans-IO [`Scheduler`]: engine events in, actions out.
//!
//! # The rule that keeps ranks in step
//! **Every launch decision is a pure function of the engine's event sequence** (`Fetch`,
//! `Release`, `GradReady`, `EndStep`, `SetNoSync`, `SetTrainable`, `ShardsUpdated`), never of
//! completion timing. All ranks must issue the same collectives in the same order, or NCCL
//! hangs; completions arrive at different times on different ranks. So:
//! - the budgets count deterministic state only: bytes and gathers *launched and not yet
//!   fetched* (`prefetch_bytes`, `max_inflight`) and bytes *gathered and not yet released*
//!   (`max_live_bytes`); the first bucket ahead is admitted whatever its size, further ones
//!   within `prefetch_bytes` (see [`SchedulerConfig::prefetch_bytes`]);
//! - [`Event::OpDone`] only moves a bucket from in flight to available; it changes whether a
//!   fetch needs a [`Action::Wait`], never what is launched or freed.
//!
//! A test feeds two schedulers the same events with completions at different points and checks
//! that they launch identical sequences.
//!
//! # How a driver runs it
//! One [`InflightRegistry`] per rank per model; one or more schedulers attached to it. For each
//! engine call, the driver calls [`Scheduler::handle`] (or the named shortcuts) with the
//! registry and a reused `Vec<Action>`, then runs the pushed actions in order:
//! [`Action::Launch`] on the named stream (allocating the gathered buffer of a gather launch),
//! [`Action::Wait`], [`Action::Free`] deferred until its fences completed,
//! [`Action::AllocGrad`] / [`Action::CopyGradIn`] / [`Action::AccumulateGrad`] for gradients.
//! When a launch completes, the driver may feed [`Event::OpDone`] back (optional: without it
//! every fetch of an in-flight bucket emits a `Wait`, which is always correct).
//!
//! ```
//! use collsched_schedule::buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
//! use collsched_schedule::{Action, Event, InflightRegistry, Plan, Role, ScheduleInput, Scheduler, SchedulerConfig};
//! let set = ParamSet::new((0..4).map(|i| ParamSpec::new(format!("l{i}.w"), [256], DType::F32)).collect())?;
//! let plan = Plan::new(LayoutBuilder::new(&set, Sharding::EvenSplit, 2).bucket_bytes(1024).build()?);
//! let mut registry = InflightRegistry::new(&ScheduleInput::from_plan(&plan)); // one per rank per model
//! let mut sched = Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut registry)?;
//! let mut actions = Vec::with_capacity(256); // reused: steady-state steps allocate nothing
//! let mut completed = Vec::new();
//! for _step in 0..3 {
//!     let ids: Vec<_> = set.ids().collect();
//!     for &p in ids.iter().chain(ids.iter().rev()) {
//!         sched.handle(&mut registry, Event::Fetch(&[p]), &mut actions)?;
//!         // ... the driver runs the actions, then the engine computes with
//!         // registry.buffer_of(p) ...
//!         sched.handle(&mut registry, Event::Release { params: &[p], after: None }, &mut actions)?;
//!     }
//!     sched.handle(&mut registry, Event::EndStep, &mut actions)?;
//!     for a in actions.drain(..) {
//!         if let Action::Launch(l) = a {
//!             completed.push(l.id); // the backend reports completion later...
//!         }
//!     }
//!     for id in completed.drain(..) {
//!         sched.handle(&mut registry, Event::OpDone(id), &mut actions)?; // ...and it flows back
//!     }
//! }
//! // Steps after the first replay the recorded order: only the first fetch misses.
//! assert_eq!(sched.last_step().counters.prefetch_misses, 1);
//! assert_eq!(registry.live_bytes(), 0);
//! # let _ = Role::Gather;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! After `Fetch(params)` returns and its actions ran, the parameters are gathered once the
//! compute stream passed the emitted waits. `Release(params, after)` says the engine's use
//! ends at `after`. Steady-state steps allocate nothing when the action `Vec` has capacity.
//!
//! # Gradients
//! A gradient goes into its gradient bucket's full-size buffer; the bucket's reduce launches
//! when its last trainable parameter's gradient arrived, so buckets reduce in the order they
//! fill. Under no_sync gradients accumulate locally and nothing is reduced; the next step
//! without no_sync adds the accumulators into the buckets. At `EndStep` of a step that had
//! gradients (or has accumulated ones) every bucket not yet reduced is reduced in bucket
//! order with missing gradients as zeros, so every rank issues the same collectives; the
//! parameters are reported in [`StepReport::zero_filled`].

mod action;
mod config;
mod error;
mod input;
mod prefetch;
mod refresh;
mod registry;
mod report;
mod state;
mod tables;

pub use action::{
    Action, BufferId, EngineEvent, Event, Fence, Fences, GradSource, Launch, LaunchId, Ops, ReduceSpec, Role,
    Stream, WaitOn,
};
pub use config::{
    split_divide, GradReduce, PolicyKind, SchedulerConfig, DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_LIVE_BYTES,
    DEFAULT_PREFETCH_BYTES, DEFAULT_TRACE_RERECORD_AFTER,
};
pub use error::ScheduleError;
pub use input::{BucketInput, PlanDigests, ScheduleInput};
pub use prefetch::{Explicit, NoPrefetch, Offer, PrefetchPolicy, TraceReplay};
pub use registry::{InflightRegistry, ParamState};
pub use report::{StepCounters, StepReport};

use std::collections::VecDeque;

use crate::buckets::{BucketId, ParamId, ParamSet};
use crate::plan::Plan;
use state::Core;
use tables::{Tables, NONE};

/// The sans-IO scheduler of one engine (coordinator) on one rank: see the module docs.
///
/// # Examples
/// ```
/// use collsched_schedule::buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
/// use collsched_schedule::{Action, Event, InflightRegistry, Plan, ScheduleInput, Scheduler, SchedulerConfig};
/// let set = ParamSet::new(vec![ParamSpec::new("w", [1024], DType::F32), ParamSpec::new("b", [16], DType::F32)])?;
/// let plan = Plan::new(LayoutBuilder::new(&set, Sharding::EvenSplit, 4).build()?);
/// let mut registry = InflightRegistry::new(&ScheduleInput::from_plan(&plan));
/// let mut sched = Scheduler::from_plan(&plan, 0, SchedulerConfig::default(), &mut registry)?;
/// let (w, b) = (set.id("w").unwrap(), set.id("b").unwrap());
/// let mut actions = Vec::with_capacity(64);
/// sched.handle(&mut registry, Event::Fetch(&[w, b]), &mut actions)?;
/// // Both live in one bucket: one all-gather, then the compute stream waits for it.
/// assert!(matches!(actions[0], Action::Launch(_)));
/// assert!(matches!(actions[1], Action::Wait { .. }));
/// actions.clear();
/// sched.handle(&mut registry, Event::Release { params: &[w, b], after: None }, &mut actions)?;
/// assert!(matches!(actions[0], Action::Free { .. }));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Scheduler {
    core: Core,
    policy: Box<dyn PrefetchPolicy>,
}

impl Scheduler {
    /// A scheduler for the plan described by `input`, on `rank`, attached to `registry` (which
    /// must have been created for the same gather buckets).
    ///
    /// # Errors
    /// [`ScheduleError::BadInput`] for inconsistent tables, [`ScheduleError::WrongRegistry`]
    /// for a registry of other buckets.
    pub fn new(
        input: &ScheduleInput,
        rank: u32,
        config: SchedulerConfig,
        registry: &mut InflightRegistry,
    ) -> Result<Scheduler, ScheduleError> {
        config.validate(input)?;
        let t = Tables::new(input, &config)?;
        let n = t.params.len();
        if !registry.fits(&t.param_gather, &t.gather) {
            return Err(ScheduleError::WrongRegistry {
                rank,
                what: "the registry was created for other gather buckets".to_string(),
            });
        }
        let owner = registry.attach();
        let (n_gather, n_grad) = (t.gather.len(), t.grad.len());
        let policy: Box<dyn PrefetchPolicy> = match config.policy {
            PolicyKind::None => Box::new(NoPrefetch),
            PolicyKind::TraceReplay => {
                Box::new(TraceReplay::with_rerecord_after(config.trace_rerecord_after))
            }
        };
        let mask = t.params.trainable_mask();
        Ok(Scheduler {
            core: Core {
                rank,
                registry: registry.uid(),
                owner,
                source: None,
                my_users: vec![0; n],
                released: vec![false; n],
                grad_seen: vec![false; n],
                accumulated: vec![false; n],
                n_accumulated: 0,
                mask,
                mask_pending: false,
                my_bucket_users: vec![0; n_gather],
                waited: vec![None; n_gather],
                held_over: vec![false; n_gather],
                pending: VecDeque::with_capacity(n_gather),
                grad_arrived: vec![0; n_grad],
                grad_buffer: vec![None; n_grad],
                grad_launched: vec![false; n_grad],
                reduce_slot: vec![NONE; n_grad],
                reduces: Vec::with_capacity(n_grad),
                grads_this_step: 0,
                fetched_this_step: false,
                no_sync: false,
                counters: StepCounters::default(),
                report: StepReport {
                    drained: Vec::with_capacity(n),
                    zero_filled: Vec::with_capacity(n),
                    held: Vec::with_capacity(n),
                    ..StepReport::default()
                },
                step: 0,
                config,
                t,
            },
            policy,
        })
    }

    /// A scheduler for a plan, which it keeps (cheaply: the layout is shared) to refresh the
    /// gradient buckets when trainability changes.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn from_plan(
        plan: &Plan,
        rank: u32,
        config: SchedulerConfig,
        registry: &mut InflightRegistry,
    ) -> Result<Scheduler, ScheduleError> {
        Scheduler::from_plan_input(plan, &ScheduleInput::from_plan(plan), rank, config, registry)
    }

    /// As [`from_plan`](Self::from_plan), with the plan's tables as the driver adjusted them
    /// (`input`: [`ScheduleInput::from_plan`] of `plan`, e.g. [`ScheduleInput::placing`]; the
    /// registry was made from the same).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn from_plan_input(
        plan: &Plan,
        input: &ScheduleInput,
        rank: u32,
        config: SchedulerConfig,
        registry: &mut InflightRegistry,
    ) -> Result<Scheduler, ScheduleError> {
        let mut s = Scheduler::new(input, rank, config, registry)?;
        s.core.source = Some(plan.clone());
        Ok(s)
    }

    /// Replaces the prefetch policy (e.g. with [`Explicit`] rules). Takes effect at the next
    /// fetch; call it between steps.
    pub fn set_policy(&mut self, policy: Box<dyn PrefetchPolicy>) {
        self.policy = policy;
    }

    /// The engine's backward pass of this step begins (an engine event, as deterministic as
    /// the others): the prefetch policy is told, so that one with backward rules
    /// ([`Explicit::after_in_backward`](crate::Explicit::after_in_backward)) switches to them.
    /// Nothing is launched or freed by it.
    pub fn begin_backward(&mut self) {
        // A bucket still held from the forward (a unit kept into its backward): its first
        // fetch in the backward is the policy's to observe, as one held over from the last
        // step is (explicit backward rules fire on it; trace replay goes on past it).
        let c = &mut self.core;
        for (held, &users) in c.held_over.iter_mut().zip(&c.my_bucket_users) {
            *held |= users > 0;
        }
        self.policy.begin_backward();
    }

    /// The prefetch policy.
    pub fn policy(&self) -> &dyn PrefetchPolicy {
        &*self.policy
    }

    /// Feeds one event; pushes the resulting actions onto `out` (never clears it).
    ///
    /// # Errors
    /// [`ScheduleError`] naming the parameter, bucket, op and rank. A failed event changes no
    /// state and pushes no action (except `EndStep`: see [`ScheduleError`]).
    pub fn handle(
        &mut self,
        registry: &mut InflightRegistry,
        event: Event<'_>,
        out: &mut Vec<Action>,
    ) -> Result<(), ScheduleError> {
        match event {
            Event::Fetch(params) => self.fetch(registry, params, out),
            Event::Release { params, after } => self.release(registry, params, after, out),
            Event::GradReady { param, after } => self.grad_ready(registry, param, after, out),
            Event::OpDone(id) => self.op_done(registry, id),
            Event::ShardsUpdated(ev) => self.shards_updated(registry, ev, out),
            Event::EndStep => self.end_step(registry, out),
            Event::SetNoSync(on) => self.set_no_sync(on),
            Event::SetTrainable(mask) => self.set_trainable(mask),
        }
    }

    /// [`Event::Fetch`]: gathers the buckets of `params` (one collective per bucket not
    /// gathered yet) and makes the compute stream wait for those in flight; then prefetches.
    ///
    /// # Errors
    /// [`ScheduleError::UnknownParam`]; nothing changes.
    pub fn fetch(
        &mut self,
        registry: &mut InflightRegistry,
        params: &[ParamId],
        out: &mut Vec<Action>,
    ) -> Result<(), ScheduleError> {
        let c = &mut self.core;
        c.check_registry(registry)?;
        c.check_ids("fetch", params)?;
        let mut acquired = false;
        c.fetched_this_step = true;
        for &p in params {
            let g = c.t.param_gather[p.index()] as usize;
            if c.my_bucket_users[g] == 0 {
                acquired = true;
                c.acquire(registry, g, out);
                self.policy.observe_fetch(c.t.gather[g].id);
                self.policy.take_skipped(&mut |b| c.discard_prefetch(registry, b, out));
            } else if std::mem::take(&mut c.held_over[g]) {
                // Held since the last step: gathered already, and where this step's order
                // has it (the policy's replay goes on past it).
                acquired = true;
                c.counters.already_gathered += 1;
                self.policy.observe_fetch(c.t.gather[g].id);
                self.policy.take_skipped(&mut |b| c.discard_prefetch(registry, b, out));
            }
            c.my_bucket_users[g] += 1;
            c.my_users[p.index()] += 1;
            c.released[p.index()] = false;
            registry.add_user(p, g);
        }
        // Neither the policy nor the budgets changed unless a bucket was acquired.
        if acquired {
            self.prefetch(registry, out);
        }
        Ok(())
    }

    /// [`Event::Release`]: the engine is done with `params` after `after`; buckets whose last
    /// user this was are freed after the consumers' events.
    ///
    /// # Errors
    /// [`ScheduleError::UnknownParam`], [`ScheduleError::NotFetched`] (never fetched by this
    /// scheduler, or released twice); nothing changes.
    pub fn release(
        &mut self,
        registry: &mut InflightRegistry,
        params: &[ParamId],
        after: Option<EngineEvent>,
        out: &mut Vec<Action>,
    ) -> Result<(), ScheduleError> {
        let c = &mut self.core;
        c.check_registry(registry)?;
        c.check_ids("release", params)?;
        for (i, &p) in params.iter().enumerate() {
            if c.my_users[p.index()] == 0 {
                let twice = c.released[p.index()] || params[..i].contains(&p);
                for &q in &params[..i] {
                    c.my_users[q.index()] += 1;
                }
                return Err(ScheduleError::NotFetched {
                    rank: c.rank,
                    param: p,
                    name: c.t.params.name(p).to_string(),
                    bucket: c.t.gather[c.t.param_gather[p.index()] as usize].id,
                    twice,
                });
            }
            c.my_users[p.index()] -= 1;
        }
        let mut freed = false;
        for &p in params {
            if c.my_users[p.index()] == 0 {
                c.released[p.index()] = true;
            }
            let g = c.t.param_gather[p.index()] as usize;
            c.my_bucket_users[g] -= 1;
            if c.my_bucket_users[g] == 0 {
                c.held_over[g] = false;
            }
            if registry.release_user(p, g, after) {
                c.free_slot(registry, g, out);
                freed = true;
            }
        }
        // Between steps (what the last step held, released) nothing is prefetched: the
        // next step's first fetch starts its prefetching.
        if freed && c.fetched_this_step {
            self.prefetch(registry, out);
        }
        Ok(())
    }

    /// [`Event::GradReady`]: the gradient of `param` is complete after `after`.
    ///
    /// # Errors
    /// [`ScheduleError::UnknownParam`], [`ScheduleError::GradOfFrozen`],
    /// [`ScheduleError::GradTwice`]; nothing changes.
    pub fn grad_ready(
        &mut self,
        registry: &mut InflightRegistry,
        param: ParamId,
        after: Option<EngineEvent>,
        out: &mut Vec<Action>,
    ) -> Result<(), ScheduleError> {
        let c = &mut self.core;
        c.check_registry(registry)?;
        c.check_ids("grad_ready", std::slice::from_ref(&param))?;
        let i = param.index();
        let j = c.t.param_grad[i];
        if j == NONE {
            return Err(ScheduleError::GradOfFrozen {
                rank: c.rank,
                param,
                name: c.t.params.name(param).to_string(),
                bucket: c.t.gather[c.t.param_gather[i] as usize].id,
            });
        }
        let j = j as usize;
        if c.grad_seen[i] {
            return Err(ScheduleError::GradTwice {
                rank: c.rank,
                param,
                name: c.t.params.name(param).to_string(),
                bucket: c.t.grad[j].id,
            });
        }
        c.grad_seen[i] = true;
        c.grads_this_step += 1;
        if c.no_sync {
            out.push(Action::AccumulateGrad { param, after });
            if !c.accumulated[i] {
                c.accumulated[i] = true;
                c.n_accumulated += 1;
            }
            c.counters.accumulated_grads += 1;
            return Ok(());
        }
        let buffer = c.open_grad(registry, j, out);
        let source = if c.accumulated[i] {
            c.accumulated[i] = false;
            c.n_accumulated -= 1;
            GradSource::FreshPlusAccumulated
        } else {
            GradSource::Fresh
        };
        out.push(Action::CopyGradIn { param, buffer, source, after });
        c.grad_arrived[j] += 1;
        if c.grad_arrived[j] as usize == c.t.grad[j].params.len() {
            c.launch_reduce(registry, j, out);
        }
        Ok(())
    }

    /// [`Event::OpDone`]: a launch completed. Stale ids (of buffers already freed) are
    /// ignored.
    ///
    /// # Errors
    /// [`ScheduleError::UnknownLaunch`] for an id never issued by the registry.
    pub fn op_done(&mut self, registry: &mut InflightRegistry, id: LaunchId) -> Result<(), ScheduleError> {
        let c = &mut self.core;
        c.check_registry(registry)?;
        if id.serial >= registry.issued() {
            return Err(ScheduleError::UnknownLaunch { rank: c.rank, launch: id, issued: registry.issued() });
        }
        match id.role {
            Role::Gather => {
                if let Some(g) = c.t.gather_index(id.bucket) {
                    registry.complete(g, id);
                }
            }
            Role::Reduce => {
                let slot = c.t.grad_index(id.bucket).and_then(|j| c.reduce_slot.get(j)).copied();
                if let Some(r) = slot.and_then(|k| c.reduces.get_mut(k as usize)).filter(|r| r.0 == id) {
                    r.1 = true;
                }
            }
        }
        Ok(())
    }

    /// [`Event::ShardsUpdated`]: the optimizer wrote the shards (complete after `ev`). Gathers
    /// launched from now on wait for `ev`; unused prefetches of any scheduler on the registry
    /// hold the old values and are freed.
    ///
    /// # Errors
    /// [`ScheduleError::WrongRegistry`].
    pub fn shards_updated(
        &mut self,
        registry: &mut InflightRegistry,
        ev: EngineEvent,
        out: &mut Vec<Action>,
    ) -> Result<(), ScheduleError> {
        let c = &mut self.core;
        c.check_registry(registry)?;
        registry.set_shards_fence(ev);
        for g in 0..registry.buckets() {
            if registry.unused_prefetch(g, None) {
                c.free_slot(registry, g, out);
                c.counters.discarded_prefetches += 1;
            }
        }
        c.pending.clear();
        Ok(())
    }

    /// [`Event::EndStep`]: drains this scheduler's unused prefetches, reduces unfilled
    /// gradient buckets (missing gradients as zeros) in bucket order, makes the compute stream
    /// wait for the step's reductions, resets the step, and applies a changed trainability
    /// mask. The step's report is then in [`last_step`](Self::last_step).
    ///
    /// # Errors
    /// [`ScheduleError::RefreshWithUnsynced`] if the mask changed while no_sync-accumulated
    /// gradients exist (the step still ended; its actions are pushed and must run; the mask
    /// stays pending), and the other refresh errors of
    /// [`refresh_trainable`](Self::refresh_trainable).
    pub fn end_step(
        &mut self,
        registry: &mut InflightRegistry,
        out: &mut Vec<Action>,
    ) -> Result<(), ScheduleError> {
        let c = &mut self.core;
        c.check_registry(registry)?;
        c.report.drained.clear();
        c.report.zero_filled.clear();
        c.report.held.clear();
        for k in 0..c.pending.len() {
            let g = c.pending[k] as usize;
            if registry.prefetched_by(g, c.owner) {
                c.report.drained.extend_from_slice(&c.t.gather[g].params);
                c.free_slot(registry, g, out);
            }
        }
        c.pending.clear();
        for (g, &u) in c.my_bucket_users.iter().enumerate() {
            c.held_over[g] = u > 0;
            if u > 0 {
                let held = c.t.gather[g].params.iter().filter(|p| c.my_users[p.index()] > 0);
                c.report.held.extend(held);
            }
        }
        if !c.no_sync && (c.grads_this_step > 0 || c.n_accumulated > 0) {
            for j in 0..c.t.grad.len() {
                if c.grad_launched[j] {
                    continue;
                }
                let buffer = c.open_grad(registry, j, out);
                for k in 0..c.t.grad[j].params.len() {
                    let p = c.t.grad[j].params[k];
                    if c.grad_seen[p.index()] {
                        continue;
                    }
                    if c.accumulated[p.index()] {
                        c.accumulated[p.index()] = false;
                        c.n_accumulated -= 1;
                        out.push(Action::CopyGradIn {
                            param: p,
                            buffer,
                            source: GradSource::Accumulated,
                            after: None,
                        });
                    } else {
                        c.report.zero_filled.push(p);
                    }
                }
                c.launch_reduce(registry, j, out);
            }
        }
        for &(id, done) in &c.reduces {
            if !done {
                out.push(Action::Wait { fence: Fence::Op(id), on: WaitOn::Stream(Stream::Compute) });
                c.counters.waits += 1;
            }
        }
        c.reduces.clear();
        c.grad_launched.iter_mut().for_each(|x| *x = false);
        c.grad_arrived.iter_mut().for_each(|x| *x = 0);
        c.grad_seen.iter_mut().for_each(|x| *x = false);
        c.grads_this_step = 0;
        c.fetched_this_step = false;
        c.counters.drained_params = c.report.drained.len() as u64;
        c.counters.zero_filled_params = c.report.zero_filled.len() as u64;
        c.report.step = c.step;
        c.report.counters = std::mem::take(&mut c.counters);
        c.counters.peak_gathered_bytes = registry.live_bytes() as u64;
        c.step += 1;
        self.policy.end_step();
        if c.config.check_trainable && c.mask_pending {
            let mask = std::mem::take(&mut c.mask);
            let r = self.refresh_trainable(&mask);
            self.core.mask = mask;
            r?;
            self.core.mask_pending = false;
        }
        Ok(())
    }

    /// [`Event::SetNoSync`]: accumulate gradients locally (on) or reduce them (off).
    ///
    /// # Errors
    /// [`ScheduleError::NoSyncMidStep`] when switching after the step's first gradient.
    pub fn set_no_sync(&mut self, on: bool) -> Result<(), ScheduleError> {
        let c = &mut self.core;
        if on != c.no_sync && c.grads_this_step > 0 {
            return Err(ScheduleError::NoSyncMidStep {
                rank: c.rank,
                current: c.no_sync,
                arrived: c.grads_this_step,
            });
        }
        c.no_sync = on;
        Ok(())
    }

    /// [`Event::SetTrainable`]: records the engine's `requires_grad` mask; with
    /// `check_trainable` on, the next `EndStep` refreshes the plan if it differs.
    ///
    /// # Errors
    /// [`ScheduleError::MaskLength`].
    pub fn set_trainable(&mut self, mask: &[bool]) -> Result<(), ScheduleError> {
        let c = &mut self.core;
        if mask.len() != c.t.params.len() {
            return Err(ScheduleError::MaskLength {
                rank: c.rank,
                got: mask.len(),
                expected: c.t.params.len(),
            });
        }
        c.mask.clear();
        c.mask.extend_from_slice(mask);
        c.mask_pending = true;
        Ok(())
    }

    /// Detaches this scheduler from the registry for good (a coordinator going away): frees its
    /// unused prefetches, releases every parameter it still holds (freeing buckets no other
    /// scheduler uses), and returns those parameters, once per unreleased fetch. Gradients
    /// not yet reduced are dropped (no collective is launched).
    ///
    /// # Errors
    /// [`ScheduleError::WrongRegistry`].
    pub fn close(
        mut self,
        registry: &mut InflightRegistry,
        out: &mut Vec<Action>,
    ) -> Result<Vec<ParamId>, ScheduleError> {
        let c = &mut self.core;
        c.check_registry(registry)?;
        // No more prefetching: the releases below must not launch anything.
        c.config.max_inflight = 0;
        for k in 0..c.pending.len() {
            let g = c.pending[k] as usize;
            if registry.prefetched_by(g, c.owner) {
                c.free_slot(registry, g, out);
            }
        }
        c.pending.clear();
        let held: Vec<ParamId> = (0..c.my_users.len() as u32)
            .flat_map(|i| std::iter::repeat_n(ParamId(i), c.my_users[i as usize] as usize))
            .collect();
        for b in c.grad_buffer.iter_mut() {
            if let Some(buffer) = b.take() {
                out.push(Action::Free { buffer, after: Fences::new() });
            }
        }
        self.release(registry, &held, None, out)?;
        Ok(held)
    }

    /// This plan's fingerprint (to exchange with the peers when the plan is built or
    /// refreshed).
    pub fn fingerprint(&self) -> u64 {
        self.core.t.digests.fingerprint
    }

    /// This plan's digests (fingerprint and per-bucket digests), to send to the peers.
    pub fn digests(&self) -> &PlanDigests {
        &self.core.t.digests
    }

    /// Checks the digests received from peer ranks against this plan.
    ///
    /// # Errors
    /// [`ScheduleError::PlanMismatch`] for the first peer that differs, naming the first
    /// differing bucket.
    pub fn check_peers<'a>(
        &self,
        peers: impl IntoIterator<Item = (u32, &'a PlanDigests)>,
    ) -> Result<(), ScheduleError> {
        let mine = &self.core.t.digests;
        for (peer, theirs) in peers {
            if theirs.fingerprint == mine.fingerprint {
                continue;
            }
            let first = mine.buckets.iter().zip(&theirs.buckets).position(|(a, b)| a != b);
            let bucket = match first {
                Some(i) => Some(BucketId(i as u32)),
                None if mine.buckets.len() != theirs.buckets.len() => {
                    Some(BucketId(mine.buckets.len().min(theirs.buckets.len()) as u32))
                }
                None => None,
            };
            return Err(ScheduleError::PlanMismatch {
                rank: self.core.rank,
                peer,
                mine: mine.fingerprint,
                theirs: theirs.fingerprint,
                bucket,
            });
        }
        Ok(())
    }

    /// Counters of the step in progress.
    pub fn counters(&self) -> &StepCounters {
        &self.core.counters
    }

    /// The report of the last ended step.
    pub fn last_step(&self) -> &StepReport {
        &self.core.report
    }

    /// This scheduler's rank.
    pub fn rank(&self) -> u32 {
        self.core.rank
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.core.config
    }

    /// The parameters with the trainability mask of the current plan.
    pub fn params(&self) -> &ParamSet {
        &self.core.t.params
    }

    /// Whether no_sync is on.
    pub fn is_no_sync(&self) -> bool {
        self.core.no_sync
    }

    /// Parameters holding no_sync-accumulated gradients not yet reduced.
    pub fn unsynced_grads(&self) -> usize {
        self.core.n_accumulated
    }

    /// The gather bucket of a parameter.
    pub fn gather_bucket_of(&self, param: ParamId) -> Option<BucketId> {
        let g = *self.core.t.param_gather.get(param.index())?;
        Some(self.core.t.gather[g as usize].id)
    }

    /// The gradient bucket of a parameter (`None` if frozen).
    pub fn grad_bucket_of(&self, param: ParamId) -> Option<BucketId> {
        let j = *self.core.t.param_grad.get(param.index())?;
        self.core.t.grad.get(j as usize).map(|b| b.id)
    }

    /// The gather buckets (by position; `BucketInput::id` is the layout's id).
    pub fn gather_buckets(&self) -> &[BucketInput] {
        &self.core.t.gather
    }

    /// The gradient buckets of the current plan.
    pub fn grad_buckets(&self) -> &[BucketInput] {
        &self.core.t.grad
    }

    /// How a gradient bucket (by position in [`grad_buckets`](Self::grad_buckets)) is reduced.
    pub fn reduce_spec(&self, index: usize) -> Option<ReduceSpec> {
        self.core.t.grad_reduce.get(index).copied()
    }

    fn prefetch(&mut self, registry: &mut InflightRegistry, out: &mut Vec<Action>) {
        let c = &mut self.core;
        if c.config.max_inflight == 0 {
            return;
        }
        self.policy.candidates(&mut |b| c.offer(registry, b, out));
    }
}
