//! [`ModelState`]: one rank's share of one model (its shards, gradient shards, no_sync
//! accumulators, in-flight registry and gathered buffers), shared by every
//! [`Coordinator`](super::Coordinator) of that rank on that model.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use collsched_buckets::{BucketId, ParamId};
use collsched_kernels::{copy_in, ElemType};
use collsched_schedule::{
    EngineEvent, Fence, InflightRegistry, Launch, LaunchId, Plan, ScheduleInput, Scheduler,
};

use super::bytes::Bytes;
use super::flight::{backend_err, DriverCounters};
use super::gather::{Finish, GatherSide, How};
use super::reduce::GradStore;
use super::shards::{device_address, Shards};
use super::tables::{GatherTables, GradTables, ShardRun};
use super::RuntimeError;
use crate::backend::{Backend, Stream};

/// What the coordinators of one rank on one model share, behind one lock: the in-flight
/// registry, this rank's shards, the gather side and the gradient store. The driver works on
/// it through the operations below, which keep the registry and the buffers in step.
pub(crate) struct RankState<B: Backend> {
    /// The in-flight registry: one per rank per model.
    registry: InflightRegistry,
    /// This rank's shard of every gather bucket (the parameters the optimizer owns).
    shards: Shards<B>,
    /// Gathered buffers: launches in flight, gathered (and unpacked) buffers held until their
    /// `Free`, consumer events, deferred frees.
    gather: GatherSide<B>,
    /// Reduced gradient shards and no_sync accumulators.
    grads: GradStore<B>,
}

/// `OpDone` of a finished launch, for the scheduler.
fn op_done<'a>(
    sched: &'a mut Scheduler,
    registry: &'a mut InflightRegistry,
) -> impl FnMut(LaunchId) -> Result<(), RuntimeError> + 'a {
    move |id| Ok(sched.op_done(registry, id)?)
}

impl<B: Backend> RankState<B> {
    /// The in-flight registry.
    pub(crate) fn registry(&self) -> &InflightRegistry {
        &self.registry
    }

    /// The in-flight registry, for a scheduler call.
    pub(crate) fn registry_mut(&mut self) -> &mut InflightRegistry {
        &mut self.registry
    }

    /// The gather side (launches in flight, gathered buffers).
    pub(crate) fn gather(&self) -> &GatherSide<B> {
        &self.gather
    }

    /// The gradient store.
    pub(crate) fn grads_mut(&mut self) -> &mut GradStore<B> {
        &mut self.grads
    }

    /// A new engine queue id (one per coordinator).
    pub(crate) fn new_queue(&mut self) -> u32 {
        self.gather.new_queue()
    }

    /// Records that the engine's use of gather bucket `g` ends at `event`.
    pub(crate) fn add_consumer(&mut self, g: usize, id: EngineEvent, event: &B::Event) {
        self.gather.add_consumer(g, id, event);
    }

    /// Launches gather `l` of bucket `g` from this rank's shard.
    pub(crate) fn launch_gather(
        &mut self,
        be: &B,
        tables: &GatherTables,
        g: usize,
        l: &Launch,
        engine: u32,
        counters: &mut DriverCounters,
    ) -> Result<(), RuntimeError> {
        let shards = &self.shards;
        let copy_in = |input: &mut B::Buffer| shards.copy_into(be, g, l.stream, input);
        self.gather.launch(be, g, &tables.gather[g], copy_in, l, engine, counters)
    }

    /// Finishes gather `id` (`how`) and reports it to the scheduler.
    pub(crate) fn finish_gather(
        &mut self,
        be: &B,
        tables: &GatherTables,
        sched: &mut Scheduler,
        id: LaunchId,
        how: How,
        counters: &mut DriverCounters,
    ) -> Result<Finish, RuntimeError> {
        self.gather.finish(be, tables, id, how, counters, &mut op_done(sched, &mut self.registry))
    }

    /// The scheduler's `Free` of gather bucket `g`'s launch `serial`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn free_gathered(
        &mut self,
        be: &B,
        tables: &GatherTables,
        sched: &mut Scheduler,
        g: usize,
        serial: u64,
        after: &[Fence],
        counters: &mut DriverCounters,
    ) -> Result<(), RuntimeError> {
        self.gather.free(be, tables, g, serial, after, counters, &mut op_done(sched, &mut self.registry))
    }

    /// Finishes every gather that already completed, without blocking.
    pub(crate) fn poll_gathers(
        &mut self,
        be: &B,
        tables: &GatherTables,
        sched: &mut Scheduler,
        counters: &mut DriverCounters,
    ) -> Result<(), RuntimeError> {
        self.gather.poll(be, tables, counters, &mut op_done(sched, &mut self.registry))
    }

    /// Makes sure the gathers holding `params` finished (waiting for them if needed; on a
    /// device backend the compute stream waits instead of the host), so that views of them
    /// can be handed out.
    pub(crate) fn ensure_gathered(
        &mut self,
        be: &B,
        tables: &GatherTables,
        sched: &mut Scheduler,
        params: &[ParamId],
        counters: &mut DriverCounters,
    ) -> Result<(), RuntimeError> {
        for &p in params {
            let g = tables.params[p.index()].gather;
            let current = self.registry.gathered_by(p);
            if let Some(id) = current {
                if self.gather.gathered(g, current).is_none() {
                    self.finish_gather(be, tables, sched, id, How::OnStream, counters)?;
                }
            }
        }
        Ok(())
    }

    /// The reduce side's view of this state: the gradient store and the scheduler's `OpDone`.
    pub(crate) fn for_reduce<'a>(
        &'a mut self,
        sched: &'a mut Scheduler,
    ) -> (&'a mut GradStore<B>, impl FnMut(LaunchId) -> Result<(), RuntimeError> + 'a) {
        (&mut self.grads, op_done(sched, &mut self.registry))
    }

    /// The optimizer hook's walk (see
    /// [`Coordinator::update_shards`](super::Coordinator::update_shards)): `f` on every run of
    /// every trainable parameter with a reduced gradient; the gradients are consumed.
    pub(crate) fn update_shards(
        &mut self,
        be: &B,
        t: &GatherTables,
        f: &mut dyn FnMut(ShardUpdate<'_>),
    ) -> Result<usize, RuntimeError> {
        let rank = t.rank;
        if let Some((bucket, _, users)) = self.registry.gathered().next() {
            return Err(RuntimeError::Plan {
                rank,
                what: format!(
                    "update_shards: gather bucket {bucket} is still gathered ({users} users); release every \
                     parameter and end the step before updating the shards"
                ),
            });
        }
        let Some(grad) = self.grads.tables().cloned() else { return Ok(0) };
        self.grads.bring_to_host(be).map_err(backend_err(
            rank,
            "update_shards (the gradients to the host)",
            None,
        ))?;
        let grads = &self.grads;
        let visited = self.shards.with_host(be, "update_shards", |shards| {
            each_run(
                t,
                &grad,
                |j| grads.shard(j).is_some(),
                |p, j, pr, gr| {
                    let g = t.params[p.index()].gather;
                    let (elem, grad_elem) = (t.gather[g].elem, grad.grad[j].elem);
                    let (es, gs) = (elem.size(), grad_elem.size());
                    let gshard = grads.shard(j).unwrap_or_default();
                    f(ShardUpdate {
                        param: p,
                        param_offset: pr.param_offset,
                        values: &mut shards.get(g)[pr.shard_offset * es..(pr.shard_offset + pr.numel) * es],
                        grad: &gshard[gr.shard_offset * gs..(gr.shard_offset + gr.numel) * gs],
                        elem,
                        grad_elem,
                    });
                    Ok(())
                },
            )
        })?;
        self.grads.consume();
        Ok(visited)
    }
}

/// Every run of every trainable parameter whose gradient bucket `j` `has` a reduced shard:
/// `f(parameter, j, its run in the gather shard, its run in the gradient shard)`, the two
/// checked to cover the same elements. Returns how many runs `f` got.
fn each_run(
    t: &GatherTables,
    grad: &GradTables,
    has: impl Fn(usize) -> bool,
    mut f: impl FnMut(ParamId, usize, &ShardRun, &ShardRun) -> Result<(), RuntimeError>,
) -> Result<usize, RuntimeError> {
    let mut visited = 0;
    for (i, slot) in grad.params.iter().enumerate() {
        let j = slot.bucket as usize;
        if slot.bucket == u32::MAX || !has(j) {
            continue;
        }
        let p = ParamId(i as u32);
        let gruns = &grad.shard_runs[slot.shard_runs.0 as usize..slot.shard_runs.1 as usize];
        let pruns = t.runs_of(p);
        let same = |(a, b): (&ShardRun, &ShardRun)| a.param_offset == b.param_offset && a.numel == b.numel;
        if gruns.len() != pruns.len() || !pruns.iter().zip(gruns).all(same) {
            let g = t.params[i].gather;
            return Err(mismatch(t.rank, p, t.gather[g].id, grad.grad[j].id));
        }
        for (pr, gr) in pruns.iter().zip(gruns) {
            f(p, j, pr, gr)?;
            visited += 1;
        }
    }
    Ok(visited)
}

impl<B: Backend> RankState<B> {
    /// See [`Coordinator::take_grad_shards`](super::Coordinator::take_grad_shards).
    pub(crate) fn take_grad_shards(
        &mut self,
        be: &B,
        t: &GatherTables,
        f: &mut dyn FnMut(GradRegion),
    ) -> Result<usize, RuntimeError> {
        let Some(grad) = self.grads.tables().cloned() else { return Ok(0) };
        let grads = &self.grads;
        let has = |j| grads.device_shard(j).is_some() || grads.shard(j).is_some();
        let visited = each_run(t, &grad, has, |p, j, _, gr| {
            let (base, device) = match (grads.device_shard(j), grads.shard(j)) {
                (Some(d), _) => (device_address(be, d)?, be.device()),
                (None, h) => (h.unwrap_or_default().as_ptr() as usize, None),
            };
            let elem = grad.grad[j].elem;
            let ptr = (base + gr.shard_offset * elem.size()) as *const u8;
            f(GradRegion { param: p, param_offset: gr.param_offset, numel: gr.numel, elem, ptr, device });
            Ok(())
        })?;
        self.grads.consume();
        Ok(visited)
    }
}

/// One run of a parameter's reduced gradient shard
/// ([`Coordinator::take_grad_shards`](super::Coordinator::take_grad_shards)).
#[derive(Clone, Copy, Debug)]
pub struct GradRegion {
    /// The parameter.
    pub param: ParamId,
    /// First element of the flattened parameter the run covers.
    pub param_offset: usize,
    /// Elements in the run.
    pub numel: usize,
    /// Element type (the reduction dtype).
    pub elem: ElemType,
    /// Address of the first element, on `device` when that is `Some`, else in host memory.
    pub ptr: *const u8,
    /// The device the gradient lives on ([`Backend::device`]), `None` for host memory.
    pub device: Option<usize>,
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

/// One trainable parameter's shard, handed to the optimizer hook
/// ([`Coordinator::update_shards`](super::Coordinator::update_shards)).
///
/// The gradient comes **in the reduction dtype** (`GradReduce::dtype`, by default the
/// parameter's): the reduced shard exactly as the collective left it, never rounded again.
/// With bf16 parameters reduced in f32 the optimizer gets the f32 gradient (as FSDP2 does when
/// the sharded gradient's dtype is set to the reduction's, avoiding a lossy round trip), and
/// with f32 parameters reduced in bf16 it gets the bf16 gradient (widening it to f32 is
/// exact; [`Coordinator::update_shards_f32`](super::Coordinator::update_shards_f32) does that).
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

pub(crate) struct ModelInner<B: Backend> {
    pub(crate) backend: Arc<B>,
    pub(crate) plan: Plan,
    /// The plan's scheduling tables as this driver runs them (buckets whose all-gather places
    /// the pieces hold no gathered buffer): the registry's and every coordinator's.
    pub(crate) input: ScheduleInput,
    pub(crate) tables: GatherTables,
    pub(crate) state: Mutex<RankState<B>>,
}

impl<B: Backend> Drop for ModelInner<B> {
    /// Waits (at most the backend's timeout per stream) until this rank's streams finished
    /// their work: collectives still in flight (drained prefetches, whose buffers the backend
    /// frees once they complete) read and write memory of this rank's pool, which must not go
    /// away under them when the backend handle is dropped after this.
    fn drop(&mut self) {
        let timeout = self.backend.timeout();
        for s in [Stream::AllGather, Stream::ReduceScatter, Stream::Compute] {
            if let Err(e) = self.backend.synchronize(s, timeout) {
                tracing::warn!(target: "collsched::coll", rank = self.tables.rank, stream = %s, error = %e,
                    "model state dropped while collectives failed or were still running");
            }
        }
        let backend = &*self.backend;
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        state.gather.shut_down(backend);
        state.shards.release(backend);
    }
}

impl<B: Backend> ModelInner<B> {
    pub(crate) fn lock(&self) -> MutexGuard<'_, RankState<B>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One rank's share of one model: its shard of every gather bucket (the parameters its
/// optimizer owns), its reduced gradient shards, its no_sync accumulators and its
/// [`InflightRegistry`], behind one lock. Cheap to clone (a shared handle).
///
/// Every [`Coordinator`](super::Coordinator) made from it (a training and an evaluation one, say)
/// shares all of that, so they neither gather a bucket twice nor free one under each other (DESIGN:
/// "the registry belongs to the parameter set").
///
/// # Examples
/// ```
/// use std::sync::Arc;
/// use collsched::backend::local::LocalWorld;
/// use collsched::buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
/// use collsched::schedule::{Plan, SchedulerConfig};
/// use collsched::runtime::ModelState;
///
/// let set = ParamSet::new(vec![ParamSpec::new("w", [5], DType::F32)])?;
/// let plan = Plan::new(LayoutBuilder::new(&set, Sharding::EvenSplit, 2).build()?);
/// let w: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, 5.0];
/// let world = LocalWorld::new(2)?;
/// let got = world.run(|rank| -> Result<Vec<f32>, collsched::runtime::RuntimeError> {
///     let state = ModelState::new(Arc::new(rank), &plan, &[bytemuck::cast_slice(&w)])?;
///     let mut train = state.coordinator(SchedulerConfig::default())?;
///     let id = set.id("w").unwrap();
///     let full = train.fetch(&[id])?.f32(id)?.to_vec();
///     train.release(&[id])?;
///     train.end_step()?;
///     Ok(full)
/// })?;
/// for r in got {
///     assert_eq!(r.expect("rank thread")?, w);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ModelState<B: Backend> {
    pub(crate) shared: Arc<ModelInner<B>>,
}

impl<B: Backend> Clone for ModelState<B> {
    fn clone(&self) -> Self {
        ModelState { shared: Arc::clone(&self.shared) }
    }
}

impl<B: Backend> std::fmt::Debug for ModelState<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelState")
            .field("rank", &self.shared.tables.rank)
            .field("fingerprint", &self.shared.plan.fingerprint())
            .finish()
    }
}

impl<B: Backend> ModelState<B> {
    /// This rank's state of the model planned by `plan`, its shards cut from `full` (the full
    /// value of every parameter, by [`ParamId`], as little-endian bytes of its dtype).
    ///
    /// # Errors
    /// [`RuntimeError::Param`] if `full` does not have one buffer per parameter of the right
    /// size; [`RuntimeError::Unsupported`] for a dtype collectives cannot move;
    /// [`RuntimeError::Plan`] if the plan's world is not the backend's.
    pub fn new(backend: Arc<B>, plan: &Plan, full: &[&[u8]]) -> Result<ModelState<B>, RuntimeError> {
        Self::with_values(backend, plan, Some(full))
    }

    /// This rank's state of the model planned by `plan`, its shards zero-filled: for a model
    /// whose values are written into the shards afterwards (a model built on torch's meta
    /// device, loaded from a checkpoint), so that no rank ever holds a full value.
    ///
    /// # Errors
    /// As [`ModelState::new`], but for the initial values.
    pub fn zeroed(backend: Arc<B>, plan: &Plan) -> Result<ModelState<B>, RuntimeError> {
        Self::with_values(backend, plan, None)
    }

    fn with_values(
        backend: Arc<B>,
        plan: &Plan,
        full: Option<&[&[u8]]>,
    ) -> Result<ModelState<B>, RuntimeError> {
        let rank = backend.rank();
        let layout = plan.layout();
        if layout.world() as usize != backend.world_size() {
            return Err(RuntimeError::Plan {
                rank,
                what: format!(
                    "the plan is for a world of {} ranks, the backend has {}; build the layout with the \
                     backend's world size",
                    layout.world(),
                    backend.world_size()
                ),
            });
        }
        let set = layout.params();
        if let Some(full) = full {
            check_values(rank, set, full)?;
        }
        let tables = GatherTables::new(plan, rank)?;
        let mut shards = Vec::with_capacity(tables.gather.len());
        for (g, b) in layout.gather_buckets().iter().enumerate() {
            let mut shard = Bytes::zeroed(tables.gather[g].shard_bytes);
            if let Some(full) = full {
                cut_shard(rank, &tables, b, full, shard.as_bytes_mut())?;
            }
            shards.push(shard);
        }
        let shards = Shards::new(&*backend, shards).map_err(backend_err(rank, "placing the shards", None))?;
        // What a gathered bucket holds, as the launch will take it (`GatherTable::placing`).
        let input = ScheduleInput::from_plan(plan)
            .placing(|id| tables.position(id).is_some_and(|g| tables.gather[g].placing(&*backend).is_some()));
        let registry = InflightRegistry::new(&input);
        let gather = GatherSide::new(&tables);
        let n = set.len();
        let state = RankState { registry, shards, gather, grads: GradStore::new(n) };
        Ok(ModelState {
            shared: Arc::new(ModelInner {
                backend,
                plan: plan.clone(),
                input,
                tables,
                state: Mutex::new(state),
            }),
        })
    }

    /// [`ModelState::new`] for a model whose parameters are all `f32`.
    ///
    /// # Errors
    /// As [`ModelState::new`].
    pub fn from_f32(backend: Arc<B>, plan: &Plan, full: &[Vec<f32>]) -> Result<ModelState<B>, RuntimeError> {
        let bufs: Vec<&[u8]> = full.iter().map(|v| bytemuck::cast_slice(v)).collect();
        Self::new(backend, plan, &bufs)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.tables.rank
    }

    /// The plan the model state was built with (its gather buckets never change).
    pub fn plan(&self) -> &Plan {
        &self.shared.plan
    }

    /// The memory each gather bucket takes on this rank while gathered, as the scheduler's
    /// budgets count it ([`BucketInput::memory_bytes`](crate::schedule::BucketInput::memory_bytes):
    /// the unpacked copy alone where the all-gather places the pieces), in plan order.
    pub fn gather_memory(&self) -> impl Iterator<Item = (BucketId, usize)> + '_ {
        self.shared.input.gather.iter().map(|b| (b.id, b.memory_bytes()))
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.shared.backend
    }

    /// Gathered bytes currently live on this rank (all coordinators), from the registry.
    pub fn live_bytes(&self) -> usize {
        self.shared.lock().registry().live_bytes()
    }

    /// The state of a parameter in the shared registry.
    pub fn param_state(&self, param: ParamId) -> collsched_schedule::ParamState {
        self.shared.lock().registry().param_state(param)
    }

    /// Launches of gathers not yet finished by the driver (in flight on the backend).
    pub fn gathers_in_flight(&self) -> usize {
        self.shared.lock().gather().in_flight()
    }

    /// Calls `f` with this rank's elements of `param` (`param_offset` and the bytes of its run;
    /// empty when it holds none), read under the model state's lock.
    ///
    /// # Errors
    /// As [`shard_region`](Self::shard_region).
    pub fn read_shard<R>(
        &self,
        param: ParamId,
        f: impl FnOnce(usize, &[u8]) -> R,
    ) -> Result<R, RuntimeError> {
        let (param_offset, (g, range)) = self.run_bytes(param)?;
        let st = self.shared.lock();
        let be = &*self.shared.backend;
        st.shards.read(be, g, range, |b| f(param_offset, b)).map_err(backend_err(
            self.rank(),
            "read_shard",
            None,
        ))
    }

    /// Calls `f` with this rank's elements of `param` to overwrite (a checkpoint's load), under
    /// the model state's lock.
    ///
    /// # Errors
    /// As [`shard_region`](Self::shard_region); [`RuntimeError::Plan`] while a bucket is
    /// gathered (its copies would keep the old values): release everything and end the step.
    pub fn write_shard<R>(
        &self,
        param: ParamId,
        f: impl FnOnce(usize, &mut [u8]) -> R,
    ) -> Result<R, RuntimeError> {
        let (param_offset, (g, range)) = self.run_bytes(param)?;
        let mut st = self.shared.lock();
        Self::none_gathered(self.rank(), &st)?;
        let be = &*self.shared.backend;
        st.shards.write(be, g, range, |b| f(param_offset, b)).map_err(backend_err(
            self.rank(),
            "write_shard",
            None,
        ))
    }

    /// Whether the shards may be overwritten now ([`write_shard`](Self::write_shard)): no
    /// bucket gathered on this rank.
    ///
    /// # Errors
    /// [`RuntimeError::Plan`] naming a gathered bucket and what to do.
    pub fn check_writable(&self) -> Result<(), RuntimeError> {
        Self::none_gathered(self.rank(), &self.shared.lock())
    }

    fn none_gathered(rank: usize, st: &RankState<B>) -> Result<(), RuntimeError> {
        match st.registry().gathered().next() {
            None => Ok(()),
            Some((bucket, _, users)) => Err(RuntimeError::Plan {
                rank,
                what: format!(
                    "gather bucket {bucket} is gathered ({users} users) while shards are overwritten; release \
                     every parameter and end the step first"
                ),
            }),
        }
    }

    /// This rank's one run of `param`: its first element, and (gather bucket position, byte
    /// range in that bucket's shard).
    fn run_bytes(&self, param: ParamId) -> Result<(usize, (usize, std::ops::Range<usize>)), RuntimeError> {
        let t = &self.shared.tables;
        let set = self.shared.plan.layout().params();
        let Some(slot) = t.params.get(param.index()) else {
            return Err(RuntimeError::Param {
                rank: t.rank,
                param: None,
                what: format!("parameter id {param} is not in the plan ({} parameters)", set.len()),
            });
        };
        let (param_offset, numel, shard_offset) = match t.runs_of(param) {
            [] => (0, 0, 0),
            [r] => (r.param_offset, r.numel, r.shard_offset),
            runs => {
                return Err(RuntimeError::Param {
                    rank: t.rank,
                    param: Some(set.name(param).to_string()),
                    what: format!(
                        "its shard on this rank is {} separate runs of its elements; a shard viewed as one \
                         tensor needs one run per rank (strategies even, flat, greedy, hybrid:G)",
                        runs.len()
                    ),
                });
            }
        };
        let es = slot.elem_size;
        Ok((param_offset, (slot.gather, shard_offset * es..(shard_offset + numel) * es)))
    }

    /// All-gathers `words` (the same count on every rank) over the world: the small
    /// collective agreements of checkpoints. `op` names it in errors.
    pub(crate) fn all_gather_words(&self, words: &[u64], op: &'static str) -> Result<Vec<u64>, RuntimeError> {
        super::agreement::all_gather_words(&*self.shared.backend, words, op)
    }

    /// Where this rank's shard of `param` lives, for an engine that keeps its optimizer's
    /// view of the shard in this memory (the Python package's sharded parameters are tensors
    /// over it): the elements `param_offset..param_offset + numel` of the flattened
    /// parameter, at `ptr`.
    ///
    /// The memory is the model state's own: its address never changes while any handle of
    /// this model state lives, the runtime writes it only in
    /// [`Coordinator::update_shards`](super::Coordinator::update_shards) and reads it only
    /// when a coordinator launches a gather (copy-in, inside `fetch` and its prefetches). An
    /// engine may write it between its calls into the runtime, from the thread that makes them.
    ///
    /// # Errors
    /// [`RuntimeError::Param`] for an id the plan does not have, or a parameter whose shard on
    /// this rank is more than one run of its elements (no strategy of this crate cuts one so).
    pub fn shard_region(&self, param: ParamId) -> Result<ShardRegion, RuntimeError> {
        let (param_offset, (g, range)) = self.run_bytes(param)?;
        let elem = self.shared.tables.gather[g].elem;
        let numel = range.len() / elem.size();
        let mut st = self.shared.lock();
        let (ptr, device) = st.shards.address(&*self.shared.backend, g, range)?;
        Ok(ShardRegion { param_offset, numel, elem, ptr, device })
    }
}

/// This rank's shard of one parameter in the model state's memory
/// ([`ModelState::shard_region`]).
#[derive(Clone, Copy, Debug)]
pub struct ShardRegion {
    /// First element of the flattened parameter held here.
    pub param_offset: usize,
    /// Elements held here (0 when this rank holds none of the parameter).
    pub numel: usize,
    /// Element type (the parameter's dtype).
    pub elem: ElemType,
    /// Address of the first element (`numel * elem.size()` bytes follow), on `device` when
    /// that is `Some`.
    pub ptr: *mut u8,
    /// The device the shard lives on ([`Backend::device`]), `None` for host memory.
    pub device: Option<usize>,
}

/// Checks `full` has one buffer per parameter of `set`, each of the parameter's bytes.
fn check_values(rank: usize, set: &collsched_buckets::ParamSet, full: &[&[u8]]) -> Result<(), RuntimeError> {
    if full.len() != set.len() {
        return Err(RuntimeError::Param {
            rank,
            param: None,
            what: format!(
                "got {} initial parameter buffers, the model has {} parameters; give one per parameter, by id",
                full.len(),
                set.len()
            ),
        });
    }
    for (id, (spec, buf)) in set.ids().zip(set.specs().iter().zip(full)) {
        let want = set.numel(id) * spec.dtype.size();
        if buf.len() != want {
            return Err(RuntimeError::Param {
                rank,
                param: Some(spec.name.clone()),
                what: format!(
                    "initial value has {} bytes, expected {want} ({} x {})",
                    buf.len(),
                    set.numel(id),
                    spec.dtype
                ),
            });
        }
    }
    Ok(())
}

/// Cuts this rank's shard of gather bucket `b` from the parameters' full values.
fn cut_shard(
    rank: usize,
    tables: &GatherTables,
    b: &collsched_buckets::Bucket,
    full: &[&[u8]],
    shard: &mut [u8],
) -> Result<(), RuntimeError> {
    let sources: Vec<&[u8]> = b.params().iter().map(|p| full[p.index()]).collect();
    let mut segs = Vec::new();
    for (k, &p) in b.params().iter().enumerate() {
        for r in tables.runs_of(p) {
            segs.push(collsched_kernels::CopySegment {
                buffer: k,
                buffer_offset: r.param_offset,
                packed_offset: r.shard_offset,
                len: r.numel,
            });
        }
    }
    copy_in(shard, &sources, &segs, b.dtype().size()).map_err(|e| RuntimeError::Param {
        rank,
        param: None,
        what: format!("cutting the shard of gather bucket {}: {e}", b.id()),
    })
}
