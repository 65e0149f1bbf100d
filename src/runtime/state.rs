//! [`ModelState`]: one rank's share of one model (its shards, gradient shards, no_sync
//! accumulators, in-flight registry and gathered buffers), shared by every [`Coordinator`] of
//! that rank on that model.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use collsched_buckets::ParamId;
use collsched_kernels::copy_in;
use collsched_schedule::{InflightRegistry, Plan, ScheduleInput, SchedulerConfig};

use super::coordinator::Coordinator;
use super::driver::GatherSide;
use super::tables::GatherTables;
use super::RuntimeError;
use crate::backend::{Backend, Stream};

/// A byte buffer aligned to 8 bytes (so it can be viewed as `f32`, `f16` or `bf16`), grown
/// but never shrunk, so reuse allocates nothing.
#[derive(Clone, Debug, Default)]
pub(crate) struct Bytes {
    words: Vec<u64>,
    len: usize,
}

impl Bytes {
    pub(crate) fn zeroed(len: usize) -> Bytes {
        Bytes { words: vec![0; len.div_ceil(8)], len }
    }

    /// Sets the length to `len` bytes, all zero (allocates only when growing).
    pub(crate) fn reset_zeroed(&mut self, len: usize) {
        let words = len.div_ceil(8);
        self.words.clear();
        self.words.resize(words, 0);
        self.len = len;
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    pub(crate) fn as_bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..len]
    }
}

/// What the coordinators of one rank on one model share, behind one lock.
pub(crate) struct RankState<B: Backend> {
    /// The in-flight registry: one per rank per model.
    pub(crate) registry: InflightRegistry,
    /// This rank's shard of every gather bucket (the parameters the optimizer owns).
    pub(crate) shards: Vec<Bytes>,
    /// Gathered buffers: launches in flight, gathered (and unpacked) buffers held until their
    /// `Free`, consumer events, deferred frees.
    pub(crate) gather: GatherSide<B>,
    /// Reduced gradient shards of the last synchronized step, by gradient bucket of the plan
    /// they were reduced with (`grad_plan`).
    pub(crate) grad_shards: Vec<Bytes>,
    /// Whether `grad_shards[j]` holds the gradient of the last synchronized step.
    pub(crate) grad_valid: Vec<bool>,
    /// The gradient tables (plan) `grad_shards` belong to.
    pub(crate) grad_tables: Option<Arc<super::tables::GradTables>>,
    /// no_sync accumulators (full size), by parameter; `accumulated[p]` tells whether live.
    pub(crate) accumulators: Vec<Bytes>,
    pub(crate) accumulated: Vec<bool>,
}

pub(crate) struct Shared<B: Backend> {
    pub(crate) backend: Arc<B>,
    pub(crate) plan: Plan,
    pub(crate) tables: GatherTables,
    pub(crate) state: Mutex<RankState<B>>,
}

impl<B: Backend> Drop for Shared<B> {
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
        self.state.get_mut().unwrap_or_else(PoisonError::into_inner).gather.shut_down(backend);
    }
}

impl<B: Backend> Shared<B> {
    pub(crate) fn lock(&self) -> MutexGuard<'_, RankState<B>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One rank's share of one model: its shard of every gather bucket (the parameters its
/// optimizer owns), its reduced gradient shards, its no_sync accumulators and its
/// [`InflightRegistry`], behind one lock. Cheap to clone (a shared handle).
///
/// Every [`Coordinator`] made from it (a training and an evaluation one, say) shares all of
/// that, so they neither gather a bucket twice nor free one under each other (DESIGN: "the
/// registry belongs to the parameter set").
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
    pub(crate) shared: Arc<Shared<B>>,
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
        if full.len() != set.len() {
            return Err(RuntimeError::Param {
                rank,
                param: None,
                what: format!(
                    "got {} initial parameter buffers, the model has {} parameters; give one per parameter, \
                     by id",
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
        let tables = GatherTables::new(plan, rank)?;
        let mut shards = Vec::with_capacity(tables.gather.len());
        for (g, b) in layout.gather_buckets().iter().enumerate() {
            let mut shard = Bytes::zeroed(tables.gather[g].shard_bytes);
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
            copy_in(shard.as_bytes_mut(), &sources, &segs, b.dtype().size()).map_err(|e| {
                RuntimeError::Param {
                    rank,
                    param: None,
                    what: format!("cutting the shard of gather bucket {}: {e}", b.id()),
                }
            })?;
            shards.push(shard);
        }
        let registry = InflightRegistry::new(&ScheduleInput::from_plan(plan));
        let gather = GatherSide::new(&tables);
        let n = set.len();
        let state = RankState {
            registry,
            shards,
            gather,
            grad_shards: Vec::new(),
            grad_valid: Vec::new(),
            grad_tables: None,
            accumulators: vec![Bytes::default(); n],
            accumulated: vec![false; n],
        };
        Ok(ModelState {
            shared: Arc::new(Shared { backend, plan: plan.clone(), tables, state: Mutex::new(state) }),
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

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.tables.rank
    }

    /// The plan the model state was built with (its gather buckets never change).
    pub fn plan(&self) -> &Plan {
        &self.shared.plan
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.shared.backend
    }

    /// Gathered bytes currently live on this rank (all coordinators), from the registry.
    pub fn live_bytes(&self) -> usize {
        self.shared.lock().registry.live_bytes()
    }

    /// The state of a parameter in the shared registry.
    pub fn param_state(&self, param: ParamId) -> collsched_schedule::ParamState {
        self.shared.lock().registry.param_state(param)
    }

    /// Launches of gathers not yet finished by the driver (in flight on the backend).
    pub fn gathers_in_flight(&self) -> usize {
        self.shared.lock().gather.in_flight()
    }
}
