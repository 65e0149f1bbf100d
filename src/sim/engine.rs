//! The simulated backend: every rank's real [`Scheduler`] driven by a workload on a virtual
//! clock, collectives priced by [`CostModel`], compute by FLOPs over an achieved throughput.
//!
//! # Model
//! - **Clock**: integer nanoseconds (deterministic; no float accumulation across events).
//! - **Ranks**: each has its own [`Scheduler`] and [`InflightRegistry`], fed by the engine
//!   program of the workload: per step, forward over the layers (`Fetch` -> compute ->
//!   `Release`), then backward in reverse (`Fetch` -> recompute under checkpointing -> backward
//!   compute -> `GradReady` for each trainable parameter whose last use this is -> `Release`),
//!   then `EndStep`.
//! - **The engine is synchronous with its compute stream**: each engine call happens when the
//!   rank's compute stream reached it (no CPU run-ahead), so every engine event recorded after
//!   a compute op is complete when the next call is made. Overlap therefore comes from the
//!   scheduler's prefetch only, which is what the simulator studies.
//! - **Streams**: the compute stream is the rank's clock; the all-gather and reduce-scatter
//!   streams are FIFO timelines. A collective starts when every rank launched it (at its host
//!   time, after its fences) and the previous collective of that stream ended, and lasts
//!   [`CostModel::time`] (or [`CostModel::group_call_time`] when a launch holds several plan
//!   ops); a group of one rank moves nothing and costs 0. All ranks issue the same collectives
//!   in the same order (the scheduler's determinism rule), which the simulator checks.
//! - **Actions**: `Launch` queues the collective (and allocates a gathered buffer);
//!   `Wait` on compute stalls the rank until the fence (the stall is *exposed communication*);
//!   `Free` releases the buffer's memory once its fences completed; `AllocGrad`, `CopyGradIn`
//!   and `AccumulateGrad` cost nothing (copy kernels are not priced). `OpDone` is fed back before
//!   each engine call for every collective that ended by then.
//! - **Compute**: FLOPs / [`SimConfig::tflops`] (achieved, per rank), times `1 + jitter * u`
//!   with `u` in `[0, 1)` drawn from a hash of (`seed`, rank, step, program position): a
//!   deterministic straggler model.
//! - **Host overhead**: [`SimConfig::host_overhead_s`] is added to the rank's compute timeline
//!   for every collective it launches (per-parameter Python hooks for [`Policy::Naive`]).
//!
//! All ranks run in lock-step in one thread: each rank advances until it must wait for a
//! collective some rank has not launched yet, then the next rank runs. Every rank is simulated
//! (no representative-rank shortcut): a 64-rank step of `roberta-50b` takes well under the
//! issue's 2 seconds.

use std::str::FromStr;

use collsched_buckets::{
    Boundary, BucketId, DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding, DEFAULT_BUCKET_BYTES,
};
use collsched_schedule::scheduler::{DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_LIVE_BYTES, DEFAULT_PREFETCH_BYTES};
use collsched_schedule::{
    Action, EngineEvent, Explicit, Fence, Fences, InflightRegistry, LaunchId, OpKind, Plan, PolicyKind, Role,
    ScheduleError, ScheduleInput, Scheduler, SchedulerConfig, Stream, WaitOn,
};
use collsched_topo::{CollectiveKind, CostModel, GroupShape, Topology};

use super::workload::Workload;

/// Default achieved fraction of the GPU's peak dense bf16 throughput (`--tflops` overrides
/// it): 0.4, a typical model FLOPs utilisation of large sharded training runs.
pub const DEFAULT_EFFICIENCY: f64 = 0.4;
/// Default per-collective host overhead of [`Policy::Naive`] (seconds): 20 us, an estimate of
/// a Python hook plus a collective launch per parameter. The other policies default to 0.
pub const NAIVE_HOST_OVERHEAD_S: f64 = 20e-6;
/// Default bucket boundaries of the simulator ([`SimConfig::boundary`], `--bucket-by`):
/// [`Boundary::LAYER`], a new bucket at every transformer block, as FSDP2 wraps models. On the
/// five presets at 64 ranks of dgx-h100 it never issues more all-gathers than size bucketing
/// and never takes longer (`gpt2-1.5b`: 104 instead of 198 all-gathers, step 283 instead of
/// 331 ms); see ARCHITECTURE.md, "The simulator". The library and `collsched plan` keep
/// [`Boundary::Size`].
pub const DEFAULT_SIM_BOUNDARY: Boundary = Boundary::LAYER;
/// Default simulated steps.
pub const DEFAULT_STEPS: u32 = 3;
/// The engine queue (compute stream) the simulated engine records its events on.
pub const COMPUTE_QUEUE: u32 = 0;

/// What went wrong setting up or running a simulation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimError {
    /// A knob is out of range.
    #[error("sim: `{knob}` {message}")]
    Config {
        /// The knob (flag name).
        knob: &'static str,
        /// What is wrong and what would do.
        message: String,
    },
    /// The workload's parameters cannot be made into a parameter set.
    #[error("sim: workload `{workload}`: {message}")]
    Params {
        /// The workload.
        workload: String,
        /// What is wrong (names the parameter).
        message: String,
    },
    /// The layout cannot be built.
    #[error("sim: layout: {0}")]
    Layout(#[from] collsched_buckets::LayoutError),
    /// A scheduler refused an event.
    #[error("sim: rank {rank}, step {step}: {source}")]
    Schedule {
        /// The rank.
        rank: u32,
        /// The step (0-based).
        step: u32,
        /// The scheduler's error.
        #[source]
        source: ScheduleError,
    },
    /// Two ranks launched different collectives at the same position of a stream (a real
    /// backend would hang).
    #[error("sim: rank {rank} launched {got} as collective #{index} of its {stream} stream, where another rank launched {expected}")]
    Diverged {
        /// The rank.
        rank: u32,
        /// `all_gather` or `reduce_scatter`.
        stream: &'static str,
        /// Position on the stream.
        index: usize,
        /// What the first rank launched there.
        expected: LaunchId,
        /// What this rank launched.
        got: LaunchId,
    },
    /// No rank can advance (a bug: the scheduler's determinism rule makes this impossible).
    #[error("sim: no rank can advance at step {step}; rank {rank} waits for {waiting}")]
    Stalled {
        /// A blocked rank.
        rank: u32,
        /// Its step.
        step: u32,
        /// What it waits for.
        waiting: String,
    },
}

/// How collectives are built and launched ahead (`--policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Policy {
    /// One all-gather per parameter and one reduce-scatter per gradient (every parameter its
    /// own bucket), no prefetch, plus a host overhead per collective: a per-parameter-hook
    /// engine.
    Naive,
    /// The library's buckets, no prefetch.
    Coalesced,
    /// The library's buckets with trace-replay prefetch (the library default).
    #[default]
    Trace,
    /// The library's buckets with explicit rules: after a layer is fetched, prefetch the next
    /// layer's buckets (forward and backward rules, switched at the forward/backward boundary).
    Explicit,
}

impl Policy {
    /// Every policy.
    pub const ALL: [Policy; 4] = [Policy::Naive, Policy::Coalesced, Policy::Trace, Policy::Explicit];

    /// The `--policy` name.
    pub const fn name(self) -> &'static str {
        match self {
            Policy::Naive => "naive",
            Policy::Coalesced => "coalesced",
            Policy::Trace => "trace",
            Policy::Explicit => "explicit",
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, SimError> {
        Policy::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| SimError::Config {
            knob: "policy",
            message: format!("`{s}` is unknown; use naive, coalesced, trace or explicit"),
        })
    }
}

/// Every knob of a simulation, with its default.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// `world`: ranks simulated.
    pub world: u32,
    /// `ranks_per_node`: ranks per node (rank `r` is on node `r / ranks_per_node`).
    pub ranks_per_node: u32,
    /// The cost model pricing collectives.
    pub cost: CostModel,
    /// `tflops`: achieved compute throughput per rank in TFLOPS (10^12 FLOP/s). Default from
    /// [`SimConfig::for_topology`]: [`DEFAULT_EFFICIENCY`] x the GPU's peak.
    pub tflops: f64,
    /// `policy`. Default [`Policy::Trace`].
    pub policy: Policy,
    /// `bucket_bytes`: the layout's bucket cap. Default 64 MiB (ignored by [`Policy::Naive`],
    /// which puts every parameter in its own bucket).
    pub bucket_bytes: usize,
    /// `bucket_by`: where buckets end ([`LayoutBuilder::boundary`]). Default
    /// [`DEFAULT_SIM_BOUNDARY`] (ignored by [`Policy::Naive`]).
    pub boundary: Boundary,
    /// `prefetch_bytes`: the scheduler's prefetch budget. Default the scheduler's
    /// `DEFAULT_PREFETCH_BYTES` (2 GiB).
    pub prefetch_bytes: usize,
    /// `max_inflight`: the scheduler's bound on gathers launched ahead. Default the scheduler's
    /// `DEFAULT_MAX_INFLIGHT` (16).
    pub max_inflight: usize,
    /// `max_live_bytes`: the scheduler's bound on gathered memory. Default 4 GiB.
    pub max_live_bytes: usize,
    /// `steps`: steps simulated. Default [`DEFAULT_STEPS`]. Reports cover steps 2.. when there
    /// is more than one (step 1 records the prefetch trace).
    pub steps: u32,
    /// `host_overhead_s`: host seconds added to a rank's compute timeline per collective it
    /// launches. `None`: [`NAIVE_HOST_OVERHEAD_S`] for [`Policy::Naive`], else 0.
    pub host_overhead_s: Option<f64>,
    /// `jitter`: compute durations are multiplied by `1 + jitter * u`, `u` uniform in `[0, 1)`
    /// per rank and compute op (stragglers). Default 0.
    pub jitter: f64,
    /// `seed` of the jitter. Default 0.
    pub seed: u64,
    /// Record every span for traces and pictures. Default off.
    pub timeline: bool,
}

impl SimConfig {
    /// A configuration with the defaults for `world` ranks, `ranks_per_node` per node, a cost
    /// model and an achieved throughput in TFLOPS per rank.
    pub fn new(world: u32, ranks_per_node: u32, cost: CostModel, tflops: f64) -> SimConfig {
        SimConfig {
            world,
            ranks_per_node,
            cost,
            tflops,
            policy: Policy::default(),
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            boundary: DEFAULT_SIM_BOUNDARY,
            prefetch_bytes: DEFAULT_PREFETCH_BYTES,
            max_inflight: DEFAULT_MAX_INFLIGHT,
            max_live_bytes: DEFAULT_MAX_LIVE_BYTES,
            steps: DEFAULT_STEPS,
            host_overhead_s: None,
            jitter: 0.0,
            seed: 0,
            timeline: false,
        }
    }

    /// The defaults for `world` ranks on `topology` (as many nodes as needed), achieving
    /// [`DEFAULT_EFFICIENCY`] of the GPU's peak ([`peak_tflops`]).
    ///
    /// # Errors
    /// [`SimError::Config`] when the GPU's peak is unknown (give `tflops` yourself with
    /// [`SimConfig::new`]) or `world` is 0.
    pub fn for_topology(topology: &Topology, world: u32) -> Result<SimConfig, SimError> {
        let peak = peak_tflops(topology).ok_or_else(|| SimError::Config {
            knob: "tflops",
            message: format!(
                "the peak throughput of topology `{}`'s devices is unknown; pass --tflops",
                topology.name
            ),
        })?;
        Self::with_topology(topology, world, DEFAULT_EFFICIENCY * peak)
    }

    /// `world` ranks on `topology` with `tflops` achieved per rank.
    ///
    /// # Errors
    /// [`SimError::Config`] when `world` is 0.
    pub fn with_topology(topology: &Topology, world: u32, tflops: f64) -> Result<SimConfig, SimError> {
        if world == 0 {
            return Err(SimError::Config { knob: "world", message: "is 0; give at least 1 rank".into() });
        }
        let rpn = (topology.ranks_per_node() as u32).clamp(1, world);
        Ok(SimConfig::new(world, rpn, CostModel::for_topology(topology), tflops))
    }

    /// The host overhead per launched collective in effect (seconds).
    pub fn host_overhead(&self) -> f64 {
        self.host_overhead_s.unwrap_or(if self.policy == Policy::Naive { NAIVE_HOST_OVERHEAD_S } else { 0.0 })
    }

    fn validate(&self) -> Result<(), SimError> {
        let bad = |knob, message: String| Err(SimError::Config { knob, message });
        if self.world == 0 {
            return bad("world", "is 0; give at least 1 rank".into());
        }
        if self.ranks_per_node == 0 {
            return bad("ranks_per_node", "is 0".into());
        }
        if !(self.tflops.is_finite() && self.tflops > 0.0) {
            return bad(
                "tflops",
                format!("is {}; give a positive throughput, e.g. --tflops 400", self.tflops),
            );
        }
        if self.steps == 0 {
            return bad("steps", "is 0; simulate at least 1 step".into());
        }
        if self.bucket_bytes == 0 {
            return bad("bucket-mb", "is 0; give a positive bucket cap".into());
        }
        let h = self.host_overhead();
        if !(h.is_finite() && h >= 0.0) {
            return bad("host-overhead-us", format!("is {}; give a finite number >= 0", h * 1e6));
        }
        if !(self.jitter.is_finite() && self.jitter >= 0.0) {
            return bad("jitter", format!("is {}; give a finite fraction >= 0, e.g. 0.05", self.jitter));
        }
        Ok(())
    }
}

/// Peak dense bf16/fp16 tensor throughput (TFLOPS) of one rank of `topology`, for the GPUs the
/// library knows (H100 SXM 989, A100 312, V100 125 — NVIDIA data sheets, without sparsity),
/// or an estimate for CPU-only machines (1 TFLOPS per rank). `None` for other GPUs.
pub fn peak_tflops(topology: &Topology) -> Option<f64> {
    let Some(gpu) = topology.machine.gpus.first() else { return Some(1.0) };
    let model = gpu.model.as_deref().unwrap_or("");
    let by_model = [("H100", 989.0), ("H200", 989.0), ("A100", 312.0), ("V100", 125.0)];
    if let Some((_, t)) = by_model.iter().find(|(m, _)| model.contains(m)) {
        return Some(*t);
    }
    match gpu.device_id {
        0x2330 | 0x2331 => Some(989.0),
        0x20b0..=0x20b5 => Some(312.0),
        0x1db1 | 0x1db4 | 0x1db5 | 0x1db6 | 0x1df6 => Some(125.0),
        _ => None,
    }
}

/// The streams of a rank's timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Lane {
    /// The engine's compute stream.
    Compute,
    /// The all-gather stream.
    AllGather,
    /// The reduce-scatter stream.
    ReduceScatter,
}

impl Lane {
    /// The lanes, in display order.
    pub const ALL: [Lane; 3] = [Lane::Compute, Lane::AllGather, Lane::ReduceScatter];

    /// `compute`, `all_gather`, `reduce_scatter` (the `comm_ms` keys).
    pub const fn name(self) -> &'static str {
        match self {
            Lane::Compute => "compute",
            Lane::AllGather => "all_gather",
            Lane::ReduceScatter => "reduce_scatter",
        }
    }
}

/// What a compute-lane span is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpanKind {
    /// A layer's forward.
    Forward,
    /// A layer's forward recomputed during backward (activation checkpointing).
    Recompute,
    /// A layer's backward.
    Backward,
    /// The compute stream waiting for a collective (exposed communication).
    Wait,
    /// Host overhead of launching a collective.
    Host,
    /// An all-gather (comm lanes).
    AllGather,
    /// A reduce-scatter (comm lanes).
    ReduceScatter,
}

impl SpanKind {
    /// A short name.
    pub const fn name(self) -> &'static str {
        match self {
            SpanKind::Forward => "forward",
            SpanKind::Recompute => "recompute",
            SpanKind::Backward => "backward",
            SpanKind::Wait => "wait",
            SpanKind::Host => "host",
            SpanKind::AllGather => "all_gather",
            SpanKind::ReduceScatter => "reduce_scatter",
        }
    }
}

/// One interval of a timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Start (ns since the simulation began).
    pub start_ns: u64,
    /// Duration (ns).
    pub dur_ns: u64,
    /// What it is.
    pub kind: SpanKind,
    /// The layer (compute spans; index into [`Workload::layers`]) or the bucket (collectives).
    pub index: u32,
    /// Step (0-based).
    pub step: u32,
    /// For collectives: launched ahead by prefetch.
    pub prefetch: bool,
}

/// Every span of a simulation (recorded with [`SimConfig::timeline`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    /// Per rank: its compute-lane spans (compute, waits, host overhead) in time order.
    pub compute: Vec<Vec<Span>>,
    /// Collectives, the same on every rank (a collective runs on all ranks at once), by lane:
    /// `[all_gather, reduce_scatter]`.
    pub collectives: [Vec<Span>; 2],
    /// Per rank, per step: (start, end) in ns.
    pub steps: Vec<Vec<(u64, u64)>>,
    /// Layer names (for compute span labels).
    pub layer_names: Vec<String>,
}

/// What one simulated step cost.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Wall time of the step: from the end of the previous step (the last rank's) to the end
    /// of this one (the last rank's), ns.
    pub step_ns: u64,
    /// Compute time (forward, recompute, backward), mean over ranks, ns.
    pub compute_ns: f64,
    /// Time the compute stream waited for collectives, mean over ranks, ns.
    pub exposed_ns: f64,
    /// Host overhead added to the compute timeline, mean over ranks, ns.
    pub host_ns: f64,
    /// Busy time of the all-gather and reduce-scatter streams, ns.
    pub comm_ns: [u64; 2],
    /// All-gather launches.
    pub all_gathers: u64,
    /// Reduce-scatter launches.
    pub reduce_scatters: u64,
    /// Prefetch launches (rank 0's scheduler counters).
    pub prefetch_launches: u64,
    /// Fetches served by a prefetch (rank 0).
    pub prefetch_hits: u64,
    /// Fetches that exceeded `max_live_bytes` (rank 0).
    pub live_overruns: u64,
}

/// The outcome of a simulation.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// Workload name.
    pub workload: String,
    /// Ranks.
    pub world: u32,
    /// The policy.
    pub policy: Policy,
    /// The layout's bucket boundaries (`size` for [`Policy::Naive`], whatever was asked).
    pub boundary: Boundary,
    /// Every simulated step.
    pub steps: Vec<StepStats>,
    /// Index of the first reported step: 1 when more than one step ran (step 1 records the
    /// trace), else 0.
    pub reported_from: usize,
    /// Highest gathered-parameter memory of any rank over the run, counting a buffer from its
    /// launch to the completion of its deferred free's fences, bytes.
    pub peak_gathered_bytes: u64,
    /// Model FLOPs per rank per step (recomputation excluded).
    pub model_flops: f64,
    /// Gather buckets of the layout.
    pub gather_buckets: usize,
    /// Gradient buckets of the layout.
    pub grad_buckets: usize,
    /// Scheduler calls made (all ranks; fetch, release, grad_ready, op_done, end_step).
    pub scheduler_events: u64,
    /// Spans, when recorded.
    pub timeline: Option<Timeline>,
}

impl SimReport {
    /// The reported (steady-state) steps.
    pub fn reported(&self) -> &[StepStats] {
        &self.steps[self.reported_from.min(self.steps.len())..]
    }

    fn mean(&self, f: impl Fn(&StepStats) -> f64) -> f64 {
        let r = self.reported();
        if r.is_empty() {
            return 0.0;
        }
        r.iter().map(f).sum::<f64>() / r.len() as f64
    }

    /// Mean step time of the reported steps, ms.
    pub fn step_ms(&self) -> f64 {
        self.mean(|s| s.step_ns as f64) / 1e6
    }

    /// Mean compute time per step, ms.
    pub fn compute_ms(&self) -> f64 {
        self.mean(|s| s.compute_ns) / 1e6
    }

    /// Mean exposed communication per step (compute waiting on collectives), ms.
    pub fn exposed_comm_ms(&self) -> f64 {
        self.mean(|s| s.exposed_ns) / 1e6
    }

    /// Mean host overhead per step, ms.
    pub fn host_ms(&self) -> f64 {
        self.mean(|s| s.host_ns) / 1e6
    }

    /// Mean busy time per step of a communication lane, ms (0 for compute).
    pub fn comm_ms(&self, lane: Lane) -> f64 {
        match lane {
            Lane::Compute => 0.0,
            Lane::AllGather => self.mean(|s| s.comm_ns[0] as f64) / 1e6,
            Lane::ReduceScatter => self.mean(|s| s.comm_ns[1] as f64) / 1e6,
        }
    }

    /// Achieved model TFLOPS per GPU: model FLOPs (no recomputation) over the step time.
    pub fn tflops_per_gpu(&self) -> f64 {
        let ms = self.step_ms();
        if ms <= 0.0 {
            return 0.0;
        }
        self.model_flops / (ms * 1e-3) / 1e12
    }

    /// Collectives per step (all-gathers + reduce-scatters), mean over reported steps.
    pub fn collectives(&self) -> f64 {
        self.mean(|s| (s.all_gathers + s.reduce_scatters) as f64)
    }

    /// The `--json` object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "workload": self.workload,
            "world": self.world,
            "policy": self.policy.name(),
            "bucket_by": self.boundary.to_string(),
            "steps_reported": self.reported().len(),
            "step_ms": self.step_ms(),
            "compute_ms": self.compute_ms(),
            "exposed_comm_ms": self.exposed_comm_ms(),
            "host_ms": self.host_ms(),
            "comm_ms": {
                "all_gather": self.comm_ms(Lane::AllGather),
                "reduce_scatter": self.comm_ms(Lane::ReduceScatter),
            },
            "tflops_per_gpu": self.tflops_per_gpu(),
            "peak_gathered_bytes": self.peak_gathered_bytes,
            "collectives": count(self.collectives()),
            "all_gathers": count(self.mean(|s| s.all_gathers as f64)),
            "reduce_scatters": count(self.mean(|s| s.reduce_scatters as f64)),
            "prefetch_hits": count(self.mean(|s| s.prefetch_hits as f64)),
            "gather_buckets": self.gather_buckets,
            "grad_buckets": self.grad_buckets,
            "scheduler_events": self.scheduler_events,
        })
    }
}

/// A per-step mean of a count: an integer when every reported step had the same count.
fn count(mean: f64) -> serde_json::Value {
    if mean.fract() == 0.0 && (0.0..9.0e15).contains(&mean) {
        serde_json::Value::from(mean as u64)
    } else {
        serde_json::Value::from(mean)
    }
}

/// One call of the engine program.
#[derive(Clone, Copy, Debug)]
enum Call {
    Phase { backward: bool },
    Fetch(u32),
    Compute(u32, SpanKind),
    Release(u32),
    Grad(ParamId),
    EndStep,
}

/// What every rank shares: the plan, the program, the prices.
struct Shared {
    plan: Plan,
    layer_params: Vec<Vec<ParamId>>,
    program: Vec<Call>,
    /// Per program position: compute ns before jitter.
    compute_ns: Vec<f64>,
    /// Explicit rules for forward and backward.
    rules: Option<[Explicit; 2]>,
    /// Launch duration cache by bucket id (u64::MAX: not priced yet).
    price: Vec<u64>,
    cost: CostModel,
    host_ns: u64,
    rpn: u32,
    world: u32,
    jitter: f64,
    seed: u64,
    steps: u32,
    timeline: bool,
}

struct Coll {
    id: LaunchId,
    dur: u64,
    issued: u32,
    ready: u64,
    start: u64,
    end: u64,
    resolved: bool,
    prefetch: bool,
    step: u32,
}

#[derive(Default)]
struct Colls {
    all: Vec<Coll>,
    by_serial: Vec<u32>,
    lane: [Vec<u32>; 2],
    resolved: [usize; 2],
}

impl Colls {
    fn get(&self, id: LaunchId) -> Option<&Coll> {
        let i = *self.by_serial.get(id.serial as usize)?;
        self.all.get(i as usize)
    }

    fn try_resolve(&mut self, s: usize, world: u32) {
        while let Some(&i) = self.lane[s].get(self.resolved[s]) {
            if self.all[i as usize].issued < world {
                break;
            }
            let prev = match self.resolved[s] {
                0 => 0,
                k => self.all[self.lane[s][k - 1] as usize].end,
            };
            let c = &mut self.all[i as usize];
            c.start = prev.max(c.ready);
            c.end = c.start + c.dur;
            c.resolved = true;
            self.resolved[s] += 1;
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Acc {
    compute: u64,
    exposed: u64,
    host: u64,
    start: u64,
    end: u64,
}

struct RankState {
    sched: Scheduler,
    reg: InflightRegistry,
    acts: Vec<Action>,
    act_pos: usize,
    in_actions: bool,
    pc: usize,
    step: u32,
    clock: u64,
    seq: u64,
    finished: bool,
    issued: [usize; 2],
    fed: [usize; 2],
    not_before: [u64; 2],
    acc: Acc,
    per_step: Vec<Acc>,
    counters: Vec<collsched_schedule::StepCounters>,
    mem: Vec<(u64, i64)>,
    pending_free: Vec<(u64, usize, Fences)>,
    /// Bytes of each live gathered buffer, by buffer serial (0: none).
    gbuf: Vec<usize>,
    spans: Vec<Span>,
    events: u64,
}

enum Flow {
    Done,
    Blocked,
}

/// A simulation of one workload on one configuration.
pub struct Simulation {
    shared: Shared,
    ranks: Vec<RankState>,
    colls: Colls,
    config: SimConfig,
    workload: String,
    layer_names: Vec<String>,
    model_flops: f64,
}

impl std::fmt::Debug for Simulation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulation").field("workload", &self.workload).field("config", &self.config).finish()
    }
}

/// Runs `workload` under `config`: see the module docs.
///
/// # Errors
/// [`SimError`]: a bad knob, a workload whose parameters cannot be laid out, a scheduler error
/// (naming rank and step), ranks diverging.
///
/// # Examples
/// ```
/// use collsched::sim::engine::{simulate, SimConfig};
/// use collsched::sim::workload::TransformerConfig;
/// let mut c = TransformerConfig::preset("gpt2-1.5b")?;
/// c.layers = 2;
/// let w = c.workload()?;
/// let topo = collsched::topo::preset("dgx-h100")?;
/// let report = simulate(&w, &SimConfig::for_topology(&topo, 8)?)?;
/// assert!(report.step_ms() >= report.compute_ms());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn simulate(workload: &Workload, config: &SimConfig) -> Result<SimReport, SimError> {
    Simulation::new(workload, config)?.run()
}

impl Simulation {
    /// Builds the layout, plan, program and one scheduler per rank.
    ///
    /// # Errors
    /// As [`simulate`].
    pub fn new(workload: &Workload, config: &SimConfig) -> Result<Simulation, SimError> {
        config.validate()?;
        let params_err = |message: String| SimError::Params { workload: workload.name.clone(), message };
        let mut specs = Vec::with_capacity(workload.params.len());
        for p in &workload.params {
            let dtype: DType =
                p.dtype.parse().map_err(|e| params_err(format!("parameter `{}`: {e}", p.name)))?;
            let shape: Vec<usize> = p.shape.iter().map(|&d| d as usize).collect();
            let spec = ParamSpec::new(p.name.clone(), shape, dtype).trainable(p.trainable);
            specs.push(match &p.module {
                Some(m) => spec.module(m.clone()),
                None => spec,
            });
        }
        let set = ParamSet::new(specs).map_err(|e| params_err(e.to_string()))?;
        let id = |name: &str| set.id(name).ok_or_else(|| params_err(format!("unknown parameter `{name}`")));
        let mut layer_params = Vec::with_capacity(workload.layers.len());
        for l in &workload.layers {
            let mut ids: Vec<ParamId> = Vec::with_capacity(l.params.len());
            for n in &l.params {
                let p = id(n)?;
                if !ids.contains(&p) {
                    ids.push(p);
                }
            }
            layer_params.push(ids);
        }
        let layer_index =
            |name: &String| workload.layers.iter().position(|l| &l.name == name).unwrap_or(0) as u32;
        let fwd: Vec<u32> = workload.forward_order.iter().map(layer_index).collect();
        let bwd: Vec<u32> = workload.backward_order.iter().map(layer_index).collect();
        // Bucket in forward execution order.
        let mut order = Vec::with_capacity(set.len());
        let mut seen = vec![false; set.len()];
        for &l in &fwd {
            for &p in &layer_params[l as usize] {
                if !std::mem::replace(&mut seen[p.index()], true) {
                    order.push(p);
                }
            }
        }
        let (bucket_bytes, boundary) = match config.policy {
            Policy::Naive => (1, Boundary::Size),
            _ => (config.bucket_bytes, config.boundary),
        };
        let layout = LayoutBuilder::new(&set, Sharding::EvenSplit, config.world)
            .bucket_bytes(bucket_bytes)
            .boundary(boundary)
            .order(order)
            .build()?;
        let plan = Plan::new(layout);

        // The program of one step and its compute durations.
        let ns_per_flop = 1e9 / (config.tflops * 1e12);
        let mut program = Vec::new();
        let mut compute_ns = Vec::new();
        let mut push = |c: Call, ns: f64| {
            program.push(c);
            compute_ns.push(ns);
        };
        // Gradients are ready after the last layer (in backward order) that uses the parameter.
        let mut last_use = vec![u32::MAX; set.len()];
        for (k, &l) in bwd.iter().enumerate() {
            for &p in &layer_params[l as usize] {
                last_use[p.index()] = k as u32;
            }
        }
        push(Call::Phase { backward: false }, 0.0);
        for &l in &fwd {
            let layer = &workload.layers[l as usize];
            push(Call::Fetch(l), 0.0);
            push(Call::Compute(l, SpanKind::Forward), layer.forward_flops * ns_per_flop);
            push(Call::Release(l), 0.0);
        }
        push(Call::Phase { backward: true }, 0.0);
        for (k, &l) in bwd.iter().enumerate() {
            let layer = &workload.layers[l as usize];
            push(Call::Fetch(l), 0.0);
            if layer.recompute_flops > 0.0 {
                push(Call::Compute(l, SpanKind::Recompute), layer.recompute_flops * ns_per_flop);
            }
            push(Call::Compute(l, SpanKind::Backward), layer.backward_flops * ns_per_flop);
            for &p in &layer_params[l as usize] {
                if last_use[p.index()] == k as u32 && set.is_trainable(p) {
                    push(Call::Grad(p), 0.0);
                }
            }
            push(Call::Release(l), 0.0);
        }
        push(Call::EndStep, 0.0);

        let input = ScheduleInput::from_plan(&plan);
        let rules = (config.policy == Policy::Explicit).then(|| {
            let bucket_of = |p: ParamId| input.gather[gather_pos(&input, p)].id;
            let layer_buckets = |l: u32| {
                let mut v: Vec<BucketId> = Vec::new();
                for &p in &layer_params[l as usize] {
                    let b = bucket_of(p);
                    if !v.contains(&b) {
                        v.push(b);
                    }
                }
                v
            };
            let make = |order: &[u32]| {
                let mut e = Explicit::default();
                // A tied embedding's bucket ends two layers of each pass.
                e.once_per_step(true);
                for w in order.windows(2) {
                    if let Some(&last) = layer_buckets(w[0]).last() {
                        e.after(last, &layer_buckets(w[1]));
                    }
                }
                e
            };
            [make(&fwd), make(&bwd)]
        });
        let sched_config = SchedulerConfig {
            policy: match config.policy {
                Policy::Trace => PolicyKind::TraceReplay,
                _ => PolicyKind::None,
            },
            prefetch_bytes: config.prefetch_bytes,
            max_inflight: config.max_inflight,
            max_live_bytes: config.max_live_bytes,
            ..SchedulerConfig::default()
        };
        let mut ranks = Vec::with_capacity(config.world as usize);
        for r in 0..config.world {
            let mut reg = InflightRegistry::new(&input);
            let sched = Scheduler::new(&input, r, sched_config.clone(), &mut reg)
                .map_err(|source| SimError::Schedule { rank: r, step: 0, source })?;
            ranks.push(RankState {
                sched,
                reg,
                acts: Vec::with_capacity(256),
                act_pos: 0,
                in_actions: false,
                pc: 0,
                step: 0,
                clock: 0,
                seq: 0,
                finished: false,
                issued: [0; 2],
                fed: [0; 2],
                not_before: [0; 2],
                acc: Acc::default(),
                per_step: Vec::with_capacity(config.steps as usize),
                counters: Vec::with_capacity(config.steps as usize),
                mem: Vec::new(),
                pending_free: Vec::new(),
                gbuf: Vec::new(),
                spans: Vec::new(),
                events: 0,
            });
        }
        let n_buckets = plan.layout().buckets().len();
        Ok(Simulation {
            shared: Shared {
                plan,
                layer_params,
                program,
                compute_ns,
                rules,
                price: vec![u64::MAX; n_buckets],
                cost: config.cost,
                host_ns: (config.host_overhead() * 1e9).round() as u64,
                rpn: config.ranks_per_node.max(1),
                world: config.world,
                jitter: config.jitter,
                seed: config.seed,
                steps: config.steps,
                timeline: config.timeline,
            },
            ranks,
            colls: Colls::default(),
            config: config.clone(),
            workload: workload.name.clone(),
            layer_names: workload.layers.iter().map(|l| l.name.clone()).collect(),
            model_flops: workload.model_flops(),
        })
    }

    /// Runs every step on every rank and reports.
    ///
    /// # Errors
    /// As [`simulate`].
    pub fn run(mut self) -> Result<SimReport, SimError> {
        loop {
            let mut progressed = false;
            let mut all_done = true;
            for r in 0..self.ranks.len() {
                progressed |= advance(&mut self.shared, &mut self.colls, &mut self.ranks[r])?;
                all_done &= self.ranks[r].finished;
            }
            if all_done {
                break;
            }
            if !progressed {
                let (rank, st) =
                    self.ranks.iter().enumerate().find(|(_, s)| !s.finished).unwrap_or((0, &self.ranks[0]));
                let waiting = match st.acts.get(st.act_pos) {
                    Some(a) => format!("{a:?}"),
                    None => "nothing".into(),
                };
                return Err(SimError::Stalled { rank: rank as u32, step: st.step, waiting });
            }
        }
        Ok(self.report())
    }

    fn report(mut self) -> SimReport {
        let steps_n = self.shared.steps as usize;
        let world = self.ranks.len().max(1) as f64;
        let mut steps = vec![StepStats::default(); steps_n];
        let mut prev_end = 0u64;
        for (s, st) in steps.iter_mut().enumerate() {
            let end = self.ranks.iter().map(|r| r.per_step[s].end).max().unwrap_or(0);
            st.step_ns = end.saturating_sub(prev_end);
            prev_end = end;
            st.compute_ns = self.ranks.iter().map(|r| r.per_step[s].compute as f64).sum::<f64>() / world;
            st.exposed_ns = self.ranks.iter().map(|r| r.per_step[s].exposed as f64).sum::<f64>() / world;
            st.host_ns = self.ranks.iter().map(|r| r.per_step[s].host as f64).sum::<f64>() / world;
            if let Some(c) = self.ranks[0].counters.get(s) {
                st.prefetch_launches = c.prefetch_launches;
                st.prefetch_hits = c.prefetch_hits;
                st.live_overruns = c.live_overruns;
            }
        }
        for c in &self.colls.all {
            let st = &mut steps[(c.step as usize).min(steps_n - 1)];
            match c.id.role {
                Role::Gather => {
                    st.comm_ns[0] += c.dur;
                    st.all_gathers += 1;
                }
                Role::Reduce => {
                    st.comm_ns[1] += c.dur;
                    st.reduce_scatters += 1;
                }
            }
        }
        // Memory: frees take effect when their fences completed.
        let mut peak = 0i64;
        for r in &mut self.ranks {
            let mut mem = std::mem::take(&mut r.mem);
            for (issue, bytes, after) in &r.pending_free {
                let t = after.iter().fold(*issue, |t, f| match f {
                    Fence::Op(id) => self.colls.get(*id).map_or(t, |c| t.max(c.end)),
                    Fence::Engine(_) => t,
                });
                mem.push((t, -(*bytes as i64)));
            }
            mem.sort_unstable();
            let mut live = 0i64;
            for (_, d) in mem {
                live += d;
                peak = peak.max(live);
            }
        }
        let timeline = self.shared.timeline.then(|| {
            let mut colls: [Vec<Span>; 2] = [Vec::new(), Vec::new()];
            for c in &self.colls.all {
                let (lane, kind) = match c.id.role {
                    Role::Gather => (0, SpanKind::AllGather),
                    Role::Reduce => (1, SpanKind::ReduceScatter),
                };
                colls[lane].push(Span {
                    start_ns: c.start,
                    dur_ns: c.dur,
                    kind,
                    index: c.id.bucket.0,
                    step: c.step,
                    prefetch: c.prefetch,
                });
            }
            Timeline {
                compute: self.ranks.iter_mut().map(|r| std::mem::take(&mut r.spans)).collect(),
                collectives: colls,
                steps: self
                    .ranks
                    .iter()
                    .map(|r| r.per_step.iter().map(|a| (a.start, a.end)).collect())
                    .collect(),
                layer_names: self.layer_names.clone(),
            }
        });
        let layout = self.shared.plan.layout();
        SimReport {
            workload: self.workload,
            world: self.config.world,
            policy: self.config.policy,
            boundary: layout.boundary(),
            steps,
            reported_from: usize::from(steps_n > 1),
            peak_gathered_bytes: peak.max(0) as u64,
            model_flops: self.model_flops,
            gather_buckets: layout.gather_buckets().len(),
            grad_buckets: layout.grad_buckets().len(),
            scheduler_events: self.ranks.iter().map(|r| r.events).sum(),
            timeline,
        }
    }
}

fn gather_pos(input: &ScheduleInput, p: ParamId) -> usize {
    input.gather.iter().position(|b| b.params.contains(&p)).unwrap_or(0)
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finaliser.
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn jitter_factor(sh: &Shared, rank: u32, step: u32, pc: usize) -> f64 {
    if sh.jitter == 0.0 {
        return 1.0;
    }
    let h = mix(mix(mix(mix(sh.seed) ^ u64::from(rank)) ^ u64::from(step)) ^ pc as u64);
    let u = (h >> 11) as f64 / (1u64 << 53) as f64;
    1.0 + sh.jitter * u
}

fn sched_err(st: &RankState) -> impl Fn(ScheduleError) -> SimError + '_ {
    move |source| SimError::Schedule { rank: st.sched.rank(), step: st.step, source }
}

/// Feeds `OpDone` for every collective that ended by the rank's clock.
fn feed_done(colls: &Colls, st: &mut RankState) -> Result<(), SimError> {
    for s in 0..2 {
        while st.fed[s] < colls.resolved[s] {
            let c = &colls.all[colls.lane[s][st.fed[s]] as usize];
            if c.end > st.clock {
                break;
            }
            st.sched.op_done(&mut st.reg, c.id).map_err(|source| SimError::Schedule {
                rank: st.sched.rank(),
                step: st.step,
                source,
            })?;
            st.events += 1;
            st.fed[s] += 1;
        }
    }
    Ok(())
}

/// Runs a rank until it blocks or finishes; returns whether it advanced.
fn advance(sh: &mut Shared, colls: &mut Colls, st: &mut RankState) -> Result<bool, SimError> {
    let mut progressed = false;
    loop {
        if st.finished {
            return Ok(progressed);
        }
        if st.in_actions {
            let from = st.act_pos;
            let flow = exec(sh, colls, st)?;
            progressed |= st.act_pos > from;
            match flow {
                Flow::Blocked => return Ok(progressed),
                Flow::Done => {
                    progressed = true;
                    st.in_actions = false;
                    st.acts.clear();
                    st.act_pos = 0;
                    if matches!(sh.program[st.pc - 1], Call::EndStep) {
                        end_step(sh, st);
                    }
                    continue;
                }
            }
        }
        progressed = true;
        feed_done(colls, st)?;
        let pc = st.pc;
        st.pc += 1;
        let after = Some(EngineEvent { queue: COMPUTE_QUEUE, seq: st.seq });
        match sh.program[pc] {
            Call::Phase { backward } => {
                if let Some(rules) = &sh.rules {
                    st.sched.set_policy(Box::new(rules[usize::from(backward)].clone()));
                }
            }
            Call::Fetch(l) => {
                st.sched
                    .fetch(&mut st.reg, &sh.layer_params[l as usize], &mut st.acts)
                    .map_err(sched_err(st))?;
                st.events += 1;
                st.in_actions = true;
            }
            Call::Compute(l, kind) => {
                let ns = (sh.compute_ns[pc] * jitter_factor(sh, st.sched.rank(), st.step, pc)).round() as u64;
                if sh.timeline && ns > 0 {
                    st.spans.push(Span {
                        start_ns: st.clock,
                        dur_ns: ns,
                        kind,
                        index: l,
                        step: st.step,
                        prefetch: false,
                    });
                }
                st.clock += ns;
                st.acc.compute += ns;
                st.seq += 1;
            }
            Call::Release(l) => {
                st.sched
                    .release(&mut st.reg, &sh.layer_params[l as usize], after, &mut st.acts)
                    .map_err(sched_err(st))?;
                st.events += 1;
                st.in_actions = true;
            }
            Call::Grad(p) => {
                st.sched.grad_ready(&mut st.reg, p, after, &mut st.acts).map_err(sched_err(st))?;
                st.events += 1;
                st.in_actions = true;
            }
            Call::EndStep => {
                st.sched.end_step(&mut st.reg, &mut st.acts).map_err(sched_err(st))?;
                st.events += 1;
                st.in_actions = true;
            }
        }
    }
}

fn end_step(sh: &Shared, st: &mut RankState) {
    st.acc.end = st.clock;
    st.per_step.push(st.acc);
    st.counters.push(st.sched.last_step().counters.clone());
    st.acc = Acc { start: st.clock, ..Acc::default() };
    st.step += 1;
    st.pc = 0;
    if st.step >= sh.steps {
        st.finished = true;
    }
}

fn lane_of(stream: Stream) -> Option<usize> {
    match stream {
        Stream::AllGather => Some(0),
        Stream::ReduceScatter => Some(1),
        Stream::Compute => None,
    }
}

/// Executes the rank's pending actions from `act_pos`.
fn exec(sh: &mut Shared, colls: &mut Colls, st: &mut RankState) -> Result<Flow, SimError> {
    while st.act_pos < st.acts.len() {
        match &st.acts[st.act_pos] {
            Action::Launch(l) => {
                let mut ready = st.clock;
                for f in &l.after {
                    if let Fence::Op(id) = f {
                        match colls.get(*id) {
                            Some(c) if c.resolved => ready = ready.max(c.end),
                            _ => return Ok(Flow::Blocked),
                        }
                    }
                }
                if sh.host_ns > 0 {
                    if sh.timeline {
                        st.spans.push(Span {
                            start_ns: st.clock,
                            dur_ns: sh.host_ns,
                            kind: SpanKind::Host,
                            index: l.id.bucket.0,
                            step: st.step,
                            prefetch: false,
                        });
                    }
                    st.clock += sh.host_ns;
                    st.acc.host += sh.host_ns;
                    ready = ready.max(st.clock);
                }
                let Some(s) = lane_of(l.stream) else {
                    return Err(SimError::Config {
                        knob: "policy",
                        message: format!("{} was launched on the compute stream", l.id),
                    });
                };
                ready = ready.max(st.not_before[s]);
                let k = st.issued[s];
                st.issued[s] += 1;
                let idx = if let Some(&i) = colls.lane[s].get(k) {
                    let expected = colls.all[i as usize].id;
                    if expected != l.id {
                        return Err(SimError::Diverged {
                            rank: st.sched.rank(),
                            stream: Lane::ALL[s + 1].name(),
                            index: k,
                            expected,
                            got: l.id,
                        });
                    }
                    i as usize
                } else {
                    let dur = price(sh, l.id.bucket, &l.ops);
                    let i = colls.all.len();
                    colls.all.push(Coll {
                        id: l.id,
                        dur,
                        issued: 0,
                        ready: 0,
                        start: 0,
                        end: 0,
                        resolved: false,
                        prefetch: l.prefetch,
                        step: st.step,
                    });
                    colls.lane[s].push(i as u32);
                    let serial = l.id.serial as usize;
                    if colls.by_serial.len() <= serial {
                        colls.by_serial.resize(serial + 1, u32::MAX);
                    }
                    colls.by_serial[serial] = i as u32;
                    i
                };
                let c = &mut colls.all[idx];
                c.issued += 1;
                c.ready = c.ready.max(ready);
                if c.issued == sh.world {
                    colls.try_resolve(s, sh.world);
                }
                if l.id.role == Role::Gather {
                    let k = l.buffer.serial as usize;
                    if st.gbuf.len() <= k {
                        st.gbuf.resize(k + 1, 0);
                    }
                    st.gbuf[k] = l.bytes;
                    st.mem.push((st.clock, l.bytes as i64));
                }
            }
            Action::Wait { fence, on } => {
                if let Fence::Op(id) = fence {
                    let end = match colls.get(*id) {
                        Some(c) if c.resolved => c.end,
                        _ => return Ok(Flow::Blocked),
                    };
                    match on {
                        WaitOn::Stream(Stream::Compute) | WaitOn::Host => {
                            if end > st.clock {
                                let stall = end - st.clock;
                                if sh.timeline {
                                    st.spans.push(Span {
                                        start_ns: st.clock,
                                        dur_ns: stall,
                                        kind: SpanKind::Wait,
                                        index: id.bucket.0,
                                        step: st.step,
                                        prefetch: false,
                                    });
                                }
                                st.acc.exposed += stall;
                                st.clock = end;
                            }
                        }
                        WaitOn::Stream(other) => {
                            if let Some(s) = lane_of(*other) {
                                st.not_before[s] = st.not_before[s].max(end);
                            }
                        }
                    }
                }
            }
            Action::Free { buffer, after } => {
                if let Some(bytes) = st.gbuf.get_mut(buffer.serial as usize).map(std::mem::take) {
                    if bytes > 0 {
                        // The memory is reusable once every fence completed: now if they are
                        // known, else when the report is made (all collectives resolved by then).
                        let mut t = Some(st.clock);
                        for f in after {
                            if let (Some(tt), Fence::Op(id)) = (t, f) {
                                t = colls.get(*id).filter(|c| c.resolved).map(|c| tt.max(c.end));
                            }
                        }
                        match t {
                            Some(t) => st.mem.push((t, -(bytes as i64))),
                            None => st.pending_free.push((st.clock, bytes, after.clone())),
                        }
                    }
                }
            }
            Action::AllocGrad { .. } | Action::CopyGradIn { .. } | Action::AccumulateGrad { .. } => {}
        }
        st.act_pos += 1;
    }
    Ok(Flow::Done)
}

/// Nanoseconds of one launch of `bucket` running plan `ops`, cached per bucket.
fn price(sh: &mut Shared, bucket: BucketId, ops: &[collsched_schedule::OpId]) -> u64 {
    if let Some(&p) = sh.price.get(bucket.index()) {
        if p != u64::MAX {
            return p;
        }
    }
    let mut calls: Vec<(CollectiveKind, u64, GroupShape)> = Vec::with_capacity(ops.len());
    for &o in ops {
        let Some(op) = sh.plan.op(o) else { continue };
        let g = op.groups();
        let n = g.group_size();
        if n <= 1 {
            continue;
        }
        let mut nodes: Vec<u32> = g.ranks_of(0).map(|r| r / sh.rpn).collect();
        nodes.dedup();
        let per = op.bytes_per_rank() as u64;
        let (kind, bytes) = match op.kind() {
            OpKind::AllGather => (CollectiveKind::AllGather, per * u64::from(n)),
            OpKind::ReduceScatter => (CollectiveKind::ReduceScatter, per * u64::from(n)),
            OpKind::AllReduce => (CollectiveKind::AllReduce, per),
            OpKind::Broadcast => (CollectiveKind::Broadcast, per),
        };
        calls.push((kind, bytes, GroupShape { ranks: n as usize, nodes: nodes.len().max(1) }));
    }
    let secs = match calls.len() {
        0 => 0.0,
        1 => sh.cost.time(calls[0].0, calls[0].1, calls[0].2),
        _ => sh.cost.group_call_time(&calls),
    };
    let ns = (secs * 1e9).round().max(0.0) as u64;
    if let Some(p) = sh.price.get_mut(bucket.index()) {
        *p = ns;
    }
    ns
}
