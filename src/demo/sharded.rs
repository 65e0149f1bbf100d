//! The sharded run of the demo: [`DemoConfig`] trained ZeRO-3 style over a [`LocalWorld`]
//! ([`sharded_run`]) or, with feature `cuda`, over one GPU per rank (`sharded_run_cuda`, a
//! `CudaWorld`), through [`Coordinator`]s, with any sharding strategy. The per-rank loop is the
//! same code on any [`Backend`].
//!
//! Per rank and step: the trainability mask of the step is applied with
//! [`Coordinator::refresh_trainable`] when it changed; every micro-batch but the last runs
//! under [`Coordinator::no_sync`]; a micro-batch is a forward pass layer by layer (fetch the
//! layer's weight and bias, compute, release) and a backward pass in reverse (fetch, backward,
//! `grad_ready` for each trainable parameter, release), then `end_step`; after the last one
//! SGD runs on this rank's shards through [`Coordinator::update_shards_f32`]. After the steps
//! [`DemoConfig::evaluates_after`] names, a second coordinator on the same model state runs the
//! evaluation pass. Losses are combined across ranks in the reference's order (micro-batch
//! major, then rank).

use std::sync::Arc;
use std::time::{Duration, Instant};

use collsched_buckets::{DType, LayoutBuilder, LayoutError, ParamId, ParamSet, ParamSpec, Sharding};
use collsched_schedule::{Plan, PolicyKind, SchedulerConfig};

use super::model::Mlp;
use super::{DemoConfig, RunRecord, StepRecord};
use crate::backend::flight::{now_ns, ComputeSpan};
use crate::backend::local::{LocalConfig, LocalRank, LocalWorld};
use crate::backend::{Backend, BackendError};
use crate::runtime::{Coordinator, ModelState, RuntimeError, StepStats};

/// Default of [`ShardedOptions::bucket_bytes`]: 4 KiB, small so the demo model spreads over
/// many buckets.
pub const DEFAULT_DEMO_BUCKET_BYTES: usize = 4 << 10;

/// How the sharded run is laid out and scheduled.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedOptions {
    /// Sharding strategy. Default [`Sharding::EvenSplit`].
    pub sharding: Sharding,
    /// Prefetch policy of both coordinators. Default [`PolicyKind::TraceReplay`].
    pub policy: PolicyKind,
    /// Bucket size cap in bytes. Default [`DEFAULT_DEMO_BUCKET_BYTES`].
    pub bucket_bytes: usize,
    /// Backend timeout (collectives waiting for peers). Default 120 s.
    pub timeout: Duration,
    /// Where each rank writes its flight record at the end of the run (`rank-R.json`, what
    /// `collsched flight DIR --trace-out` draws); `None` (the default) writes nothing.
    pub flight_out: Option<std::path::PathBuf>,
}

impl Default for ShardedOptions {
    fn default() -> Self {
        ShardedOptions {
            sharding: Sharding::EvenSplit,
            policy: PolicyKind::TraceReplay,
            bucket_bytes: DEFAULT_DEMO_BUCKET_BYTES,
            timeout: Duration::from_secs(120),
            flight_out: None,
        }
    }
}

/// What one optimizer step cost on rank 0, summed over its micro-batches.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepCost {
    /// All-gathers launched (scheduler count: one per bucket gathered).
    pub all_gathers: u64,
    /// Gradient bucket reductions launched.
    pub reduce_scatters: u64,
    /// Collectives issued on the backend.
    pub collectives: u64,
    /// Bytes the collectives carried.
    pub bytes_moved: u64,
    /// Fetches served by a prefetch.
    pub prefetch_hits: u64,
    /// Fetches that launched their own gather.
    pub prefetch_misses: u64,
    /// Host time spent waiting for collectives.
    pub wait_time: Duration,
    /// Highest gathered bytes.
    pub peak_gathered_bytes: u64,
    /// Wall time of the step on rank 0: its micro-batches, the optimizer update and the
    /// evaluation pass when the step has one.
    pub wall: Duration,
    /// Time of the training micro-batches' layer arithmetic (forward and backward, not the
    /// evaluation pass): what the simulator's compute stands for.
    pub compute: Duration,
    /// Wall time of the step's evaluation pass (zero without one).
    pub eval: Duration,
}

impl StepCost {
    fn add(&mut self, s: &StepStats) {
        self.all_gathers += s.schedule.all_gathers;
        self.reduce_scatters += s.schedule.reduce_scatters;
        self.collectives += s.collectives();
        self.bytes_moved += s.bytes_moved();
        self.prefetch_hits += s.schedule.prefetch_hits;
        self.prefetch_misses += s.schedule.prefetch_misses;
        self.wait_time += s.wait_time();
        self.peak_gathered_bytes = self.peak_gathered_bytes.max(s.peak_gathered_bytes());
    }
}

/// Outcome of a sharded run.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedRun {
    /// Losses per step and the final parameters (gathered back), comparable with
    /// [`super::reference_run`].
    pub record: RunRecord,
    /// Rank 0's cost per step.
    pub cost: Vec<StepCost>,
    /// Gather buckets and gradient buckets of the layout.
    pub buckets: (usize, usize),
}

/// Why a sharded run failed.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The layout could not be built (e.g. `hybrid:G` with `G` not dividing the world).
    #[error("layout: {0}")]
    Layout(#[from] LayoutError),
    /// The parameter list is invalid.
    #[error("parameters: {0}")]
    Params(#[from] collsched_buckets::ParamError),
    /// The local world could not be made.
    #[error("local world: {0}")]
    World(#[from] BackendError),
    /// A rank failed.
    #[error("{0}")]
    Runtime(#[from] RuntimeError),
    /// The CUDA world could not be made or a rank's CUDA backend could not be built (no CUDA
    /// driver, no NCCL, fewer GPUs than ranks, ...).
    #[cfg(feature = "cuda")]
    #[error("CUDA backend: {0}")]
    Cuda(#[from] crate::backend::cuda::CudaError),
    /// A rank's flight record could not be written (`ShardedOptions::flight_out`).
    #[error("flight record: {0}")]
    Flight(String),
    /// A rank thread panicked.
    #[error("rank {rank} panicked: {what}")]
    Panicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        what: String,
    },
}

/// The demo model's parameters as a [`ParamSet`] (all `f32`, trainable), in [`Mlp::params`]
/// order.
///
/// # Errors
/// [`DemoError::Params`] for a model with a zero width.
pub fn param_set(model: &Mlp) -> Result<ParamSet, DemoError> {
    let specs = model.params().into_iter().map(|p| ParamSpec::new(p.name, p.shape, DType::F32)).collect();
    Ok(ParamSet::new(specs)?)
}

/// The plan of the demo model over `cfg.world` ranks.
///
/// # Errors
/// [`DemoError::Layout`], [`DemoError::Params`].
pub fn plan(cfg: &DemoConfig, opts: &ShardedOptions) -> Result<Plan, DemoError> {
    let set = param_set(&cfg.model)?;
    let layout =
        LayoutBuilder::new(&set, opts.sharding, cfg.world as u32).bucket_bytes(opts.bucket_bytes).build()?;
    Ok(Plan::new(layout))
}

struct RankOutcome {
    losses: Vec<f32>,
    evals: Vec<f32>,
    params: Vec<Vec<f32>>,
    cost: Vec<StepCost>,
    /// The layer arithmetic's spans (with `--flight-out`).
    compute: Vec<ComputeSpan>,
}

/// Runs the demo sharded over a local world of `cfg.world` ranks.
///
/// # Errors
/// [`DemoError`]: the first failing rank's error.
pub fn sharded_run(cfg: &DemoConfig, opts: &ShardedOptions) -> Result<ShardedRun, DemoError> {
    sharded_run_wrapped(cfg, opts, |rank| rank)
}

/// [`sharded_run`] with each rank of the local world handed to `wrap` first: the run goes
/// through the backend it makes (tests run a backend that adds to the local one this way).
///
/// # Errors
/// As [`sharded_run`].
pub fn sharded_run_wrapped<B: Backend>(
    cfg: &DemoConfig,
    opts: &ShardedOptions,
    wrap: impl Fn(LocalRank) -> B + Sync,
) -> Result<ShardedRun, DemoError> {
    let plan = plan(cfg, opts)?;
    let buckets = (plan.layout().gather_buckets().len(), plan.layout().grad_buckets().len());
    let world =
        LocalWorld::with_config(cfg.world, LocalConfig { timeout: opts.timeout, ..LocalConfig::default() })?;
    let init = cfg.model.init(cfg.seed);
    let failed = std::sync::Mutex::new(Vec::new());
    let outcomes = world.run(|rank| {
        let backend = Arc::new(wrap(rank));
        let mut out = run_rank(cfg, opts, &plan, &init, Arc::clone(&backend));
        if let Err(e) = write_flight(opts, &*backend, &mut out) {
            failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(e);
        }
        out
    })?;
    let run = combine(cfg, outcomes, buckets)?;
    match failed.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner).pop() {
        Some(e) => Err(e),
        None => Ok(run),
    }
}

/// Runs this process's rank of the demo in a multi-process job (the `shm` or `mpi` backend:
/// `backend` is this rank, `hub` the job's exchange). Every rank trains; the losses are
/// gathered through the exchange; rank 0 gets the run's record, the other ranks `None`.
///
/// # Errors
/// This rank's failure, or a peer's seen through the hub.
pub fn sharded_run_process<B: Backend>(
    cfg: &DemoConfig,
    opts: &ShardedOptions,
    backend: B,
    hub: &mut impl crate::backend::Exchange,
) -> Result<Option<ShardedRun>, DemoError> {
    let plan = plan(cfg, opts)?;
    let buckets = (plan.layout().gather_buckets().len(), plan.layout().grad_buckets().len());
    let init = cfg.model.init(cfg.seed);
    let me = backend.rank();
    let backend = Arc::new(backend);
    // The record is written after a failed run too (what went wrong is in it).
    let mut mine = run_rank(cfg, opts, &plan, &init, Arc::clone(&backend));
    let wrote = write_flight(opts, &*backend, &mut mine);
    let mine = mine?;
    wrote?;
    let bytes: Vec<u8> = mine.losses.iter().flat_map(|l| l.to_le_bytes()).collect();
    let all = hub.all_gather_bytes(&bytes)?;
    if me != 0 {
        return Ok(None);
    }
    let mut first = Some(mine);
    let outcomes: Vec<std::thread::Result<Result<RankOutcome, RuntimeError>>> = all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let losses = b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let o = match (r, first.take()) {
                (0, Some(mut o)) => {
                    o.losses = losses;
                    o
                }
                _ => RankOutcome {
                    losses,
                    evals: Vec::new(),
                    params: Vec::new(),
                    cost: Vec::new(),
                    compute: Vec::new(),
                },
            };
            Ok(Ok(o))
        })
        .collect();
    combine(cfg, outcomes, buckets).map(Some)
}

/// Runs the demo sharded over `cfg.world` GPUs of this process (device `r` for rank `r`, one
/// thread per GPU, one NCCL world; hybrid sharding's shard and replica groups are declared to
/// the backends from the plan). Same steps and result as [`sharded_run`]; the reductions go
/// through NCCL, whose summation order may differ from the local backend's where a reduction
/// stage adds more than two ranks' values (two are one commutative `a + b`).
///
/// # Errors
/// [`DemoError::Cuda`] when there is no CUDA driver (`no CUDA driver found: ...`), no NCCL,
/// fewer devices than `cfg.world`, or a rank's backend cannot be built; otherwise as
/// [`sharded_run`].
#[cfg(feature = "cuda")]
pub fn sharded_run_cuda(cfg: &DemoConfig, opts: &ShardedOptions) -> Result<ShardedRun, DemoError> {
    use crate::backend::cuda::CudaWorld;
    let plan = plan(cfg, opts)?;
    let buckets = (plan.layout().gather_buckets().len(), plan.layout().grad_buckets().len());
    let world = CudaWorld::new(cfg.world)?.with_groups(extra_groups(&plan)?).with_timeout(opts.timeout);
    let init = cfg.model.init(cfg.seed);
    let outcomes = world.run(|backend| run_rank(cfg, opts, &plan, &init, Arc::new(backend)))?;
    combine(cfg, outcomes, buckets)
}

/// The rank groups other than the world that the plan's collectives use (hybrid sharding's
/// shard and replica groups), each once, in plan order (the same list on every rank).
#[cfg(feature = "cuda")]
fn extra_groups(plan: &Plan) -> Result<Vec<crate::backend::RankGroup>, DemoError> {
    use crate::backend::RankGroup;
    let world = RankGroup::world(plan.layout().world() as usize);
    let mut out: Vec<RankGroup> = Vec::new();
    for op in plan.ops() {
        let groups = op.groups();
        for g in 0..groups.count() {
            let group = RankGroup::new(groups.ranks(g).map(|r| r as usize).collect::<Vec<_>>())
                .map_err(BackendError::from)?;
            if group != world && !out.contains(&group) {
                out.push(group);
            }
        }
    }
    Ok(out)
}

/// The ranks' outcomes (in rank order) combined into the run's record: the first failing
/// rank's error, else losses summed in the reference's order and rank 0's parameters and cost.
fn combine(
    cfg: &DemoConfig,
    outcomes: Vec<std::thread::Result<Result<RankOutcome, RuntimeError>>>,
    buckets: (usize, usize),
) -> Result<ShardedRun, DemoError> {
    let mut per_rank = Vec::with_capacity(cfg.world);
    for (r, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(Ok(o)) => per_rank.push(o),
            Ok(Err(e)) => return Err(e.into()),
            Err(p) => {
                let what = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                return Err(DemoError::Panicked { rank: r, what });
            }
        }
    }
    let m = cfg.micro_batches;
    let mut steps = Vec::with_capacity(cfg.steps);
    let mut eval_k = 0;
    for step in 0..cfg.steps {
        let mut sum = 0f32;
        for micro in 0..m {
            for o in &per_rank {
                sum += o.losses[step * m + micro];
            }
        }
        let loss = sum / (cfg.world * m) as f32;
        let eval_loss = cfg.evaluates_after(step).then(|| {
            let e = per_rank[0].evals[eval_k];
            eval_k += 1;
            e
        });
        steps.push(StepRecord { loss, eval_loss });
    }
    let first = per_rank.swap_remove(0);
    Ok(ShardedRun { record: RunRecord { steps, params: first.params }, cost: first.cost, buckets })
}

fn layer_ids(l: usize) -> [ParamId; 2] {
    [ParamId(2 * l as u32), ParamId(2 * l as u32 + 1)]
}

/// One micro-batch on one rank: forward and backward through the coordinator. Returns the
/// loss.
fn micro_step<B: Backend>(
    c: &mut Coordinator<B>,
    model: &Mlp,
    mask: &[bool],
    x: &[f32],
    y: &[f32],
    compute: &mut Compute<'_>,
) -> Result<f32, RuntimeError> {
    let layers = model.layers();
    let mut caches = Vec::with_capacity(layers);
    for l in 0..layers {
        let [w, b] = layer_ids(l);
        let cache = {
            let v = c.fetch(&[w, b])?;
            let input = caches.last().map_or(x, |c: &super::model::LayerCache| &c.output[..]);
            let (w, b) = (v.read_f32(w)?, v.read_f32(b)?);
            compute.time("forward", l, || model.layer_forward(l, &w, &b, input))
        };
        c.release(&[w, b])?;
        caches.push(cache);
    }
    let (loss, mut g) = Mlp::mse(&caches[layers - 1].output, y);
    for l in (0..layers).rev() {
        let [w, b] = layer_ids(l);
        let (ni, no) = (model.dims[l], model.dims[l + 1]);
        let mut gw = vec![0f32; ni * no];
        let mut gb = vec![0f32; no];
        g = {
            let v = c.fetch(&[w, b])?;
            let w = v.read_f32(w)?;
            compute.time("backward", l, || model.layer_backward(l, &w, &caches[l], &g, &mut gw, &mut gb))
        };
        c.release(&[w, b])?;
        if mask[w.index()] {
            c.grad_ready_f32(w, &gw)?;
        }
        if mask[b.index()] {
            c.grad_ready_f32(b, &gb)?;
        }
    }
    Ok(loss)
}

/// Where a micro-batch's layer arithmetic is counted: its time, added to `total`, and with a
/// flight record asked for, its spans (`spans`), for the record's compute track.
struct Compute<'a> {
    total: &'a mut Duration,
    spans: Option<&'a mut Vec<ComputeSpan>>,
    step: usize,
}

impl Compute<'_> {
    /// Runs `f`, the `what` ("forward", "backward") of layer `layer`, counting its time.
    fn time<T>(&mut self, what: &str, layer: usize, f: impl FnOnce() -> T) -> T {
        let (t, start_ns) = (Instant::now(), self.spans.as_ref().map(|_| now_ns()));
        let out = f();
        *self.total += t.elapsed();
        if let (Some(spans), Some(start_ns)) = (self.spans.as_mut(), start_ns) {
            let (name, step) = (format!("{what} {layer}"), self.step as u64);
            spans.push(ComputeSpan { name, step, start_ns, end_ns: now_ns() });
        }
        out
    }
}

fn eval_pass<B: Backend>(c: &mut Coordinator<B>, cfg: &DemoConfig) -> Result<f32, RuntimeError> {
    let model = &cfg.model;
    let (x, y) = model.batch(cfg.seed, u64::MAX, u64::MAX, 4 * cfg.batch);
    let mut h = x;
    for l in 0..model.layers() {
        let [w, b] = layer_ids(l);
        h = {
            let v = c.fetch(&[w, b])?;
            model.layer_forward(l, &v.read_f32(w)?, &v.read_f32(b)?, &h).output
        };
        c.release(&[w, b])?;
    }
    c.end_step()?;
    Ok(Mlp::mse(&h, &y).0)
}

/// Writes `backend`'s flight record where `opts.flight_out` says, if it says.
/// `out`'s compute spans go into the record (none where the run failed).
fn write_flight<B: Backend>(
    opts: &ShardedOptions,
    backend: &B,
    out: &mut Result<RankOutcome, RuntimeError>,
) -> Result<(), DemoError> {
    let Some(dir) = &opts.flight_out else { return Ok(()) };
    let rank = backend.rank();
    let mut dump = backend.flight_dump("the demo's end (--flight-out)").ok_or_else(|| {
        DemoError::Flight(format!("rank {rank}: this backend keeps no flight record (local, shm and mpi do)"))
    })?;
    if let Ok(o) = out {
        dump.set_compute(std::mem::take(&mut o.compute));
    }
    dump.write_to(dir).map(drop).map_err(|e| DemoError::Flight(format!("rank {rank}: {e}")))
}

/// One rank's whole run on its backend (a local world's rank or one GPU).
fn run_rank<B: Backend>(
    cfg: &DemoConfig,
    opts: &ShardedOptions,
    plan: &Plan,
    init: &[Vec<f32>],
    backend: Arc<B>,
) -> Result<RankOutcome, RuntimeError> {
    let r = backend.rank();
    let state = ModelState::from_f32(backend, plan, init)?;
    let config = SchedulerConfig { policy: opts.policy, ..SchedulerConfig::default() };
    let mut train = state.coordinator(config.clone())?;
    let mut eval = state.coordinator(config)?;
    let n = plan.layout().params().len();
    let mut mask_now = vec![true; n];
    let m = cfg.micro_batches.max(1);
    let mut losses = Vec::with_capacity(cfg.steps * m);
    let mut evals = Vec::new();
    let mut cost = Vec::with_capacity(cfg.steps);
    let lr = cfg.lr;
    let mut progress = (r == 0).then(|| crate::progress::Progress::new("demo (sharded)", cfg.steps as u64));
    // The layer arithmetic's spans, for the flight record's compute track.
    let mut spans = opts.flight_out.is_some().then(Vec::new);
    for step in 0..cfg.steps {
        if let Some(p) = progress.as_mut() {
            p.tick(step as u64);
        }
        let mask: Vec<bool> = (0..n).map(|k| cfg.trainable(k, step)).collect();
        if mask != mask_now {
            train.refresh_trainable(&mask)?;
            mask_now = mask;
        }
        let mut step_cost = StepCost::default();
        let started = Instant::now();
        for micro in 0..m {
            let sample = (step * m + micro) as u64;
            let (x, y) = cfg.model.batch(cfg.seed, sample, r as u64, cfg.batch);
            let mut compute = Compute { total: &mut step_cost.compute, spans: spans.as_mut(), step };
            let (loss, stats) = if micro + 1 < m {
                let mut g = train.no_sync()?;
                let loss = micro_step(&mut g, &cfg.model, &mask_now, &x, &y, &mut compute)?;
                (loss, g.end_step()?)
            } else {
                let loss = micro_step(&mut train, &cfg.model, &mask_now, &x, &y, &mut compute)?;
                (loss, train.end_step()?)
            };
            step_cost.add(&stats);
            losses.push(loss);
        }
        train.update_shards_f32(|_, _, w, g| {
            for (wi, gi) in w.iter_mut().zip(g) {
                *wi -= lr * gi;
            }
        })?;
        if cfg.evaluates_after(step) {
            let t = Instant::now();
            evals.push(eval_pass(&mut eval, cfg)?);
            step_cost.eval = t.elapsed();
        }
        step_cost.wall = started.elapsed();
        cost.push(step_cost);
    }
    let ids: Vec<ParamId> = (0..n as u32).map(ParamId).collect();
    let params = {
        let v = train.fetch(&ids)?;
        ids.iter().map(|&p| v.read_f32(p).map(std::borrow::Cow::into_owned)).collect::<Result<Vec<_>, _>>()?
    };
    train.release(&ids)?;
    train.end_step()?;
    Ok(RankOutcome { losses, evals, params, cost, compute: spans.unwrap_or_default() })
}

/// The largest absolute difference between two runs' losses (training and evaluation), and
/// between their final parameters. A NaN anywhere (in either run), an evaluation in one run
/// only, or a missing step, parameter or element counts as an infinite difference: a broken run
/// never passes for a matching one.
pub fn max_differences(a: &RunRecord, b: &RunRecord) -> (f32, f32) {
    fn worse(acc: f32, x: f32, y: f32) -> f32 {
        let d = (x - y).abs();
        if d.is_nan() {
            f32::INFINITY
        } else {
            acc.max(d)
        }
    }
    let mut loss = if a.steps.len() == b.steps.len() { 0f32 } else { f32::INFINITY };
    for (x, y) in a.steps.iter().zip(&b.steps) {
        loss = worse(loss, x.loss, y.loss);
        match (x.eval_loss, y.eval_loss) {
            (Some(p), Some(q)) => loss = worse(loss, p, q),
            (None, None) => {}
            _ => loss = f32::INFINITY,
        }
    }
    let mut param = if a.params.len() == b.params.len() { 0f32 } else { f32::INFINITY };
    for (p, q) in a.params.iter().zip(&b.params) {
        if p.len() != q.len() {
            param = f32::INFINITY;
        }
        for (x, y) in p.iter().zip(q) {
            param = worse(param, *x, *y);
        }
    }
    (loss, param)
}
