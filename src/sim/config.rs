//! The simulator's knobs ([`SimConfig`], [`Policy`]) and errors ([`SimError`]).

use std::str::FromStr;

use collsched_buckets::{Boundary, DEFAULT_BUCKET_BYTES};
use collsched_schedule::scheduler::{DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_LIVE_BYTES, DEFAULT_PREFETCH_BYTES};
use collsched_schedule::{LaunchId, ScheduleError};
use collsched_topo::constants::{ZERO3_2021_GATHER_PRE_LAUNCH_S, ZERO3_2021_LIST_LAUNCH_S};
use collsched_topo::{CostModel, CostProfile, Topology};

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
/// 331 ms; `benches/README.md`, "What the simulator shows"). The library and `collsched plan` keep
/// [`Boundary::Size`].
pub const DEFAULT_SIM_BOUNDARY: Boundary = Boundary::LAYER;
/// The most ranks a simulation runs (2^20): every rank has its own scheduler and registry.
pub const MAX_WORLD: u32 = 1 << 20;

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
    /// DeepSpeed ZeRO-3 as its 2021 code ran a step (v0.5.4, before DeepSpeed PR #1453 batched
    /// it): one all-gather per non-persistent parameter at every fetch (recomputed layers
    /// fetched again), no prefetch, host-device syncs before each all-gather, after each fetch,
    /// in the norm logging, at each release and in the optimizer step, list-form copies on the
    /// collective streams, one reduce-scatter per gradient. Each cost is a named constant of
    /// `collsched_topo::constants` with its source; see the `zero3` module of the simulator.
    Zero3_2021,
}

impl Policy {
    /// Every policy.
    pub const ALL: [Policy; 5] =
        [Policy::Naive, Policy::Coalesced, Policy::Trace, Policy::Explicit, Policy::Zero3_2021];

    /// The policies of the library's own engine ([`Policy::ALL`] but [`Policy::Zero3_2021`],
    /// a model of another engine).
    pub const LIBRARY: [Policy; 4] = [Policy::Naive, Policy::Coalesced, Policy::Trace, Policy::Explicit];

    /// The `--policy` name.
    pub const fn name(self) -> &'static str {
        match self {
            Policy::Naive => "naive",
            Policy::Coalesced => "coalesced",
            Policy::Trace => "trace",
            Policy::Explicit => "explicit",
            Policy::Zero3_2021 => "zero3-2021",
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
            message: format!("`{s}` is unknown; use naive, coalesced, trace, explicit or zero3-2021"),
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
    /// The cost model pricing collectives (when [`SimConfig::profile`] is `None`).
    pub cost: CostModel,
    /// `cost`: a measured cost profile (`collsched calibrate`, `sim --cost FILE`). When set it
    /// prices every collective instead of [`SimConfig::cost`] (each op of a group call at its
    /// own fit: a fit includes the launch), and its `host_per_collective_s` is the host
    /// overhead when [`SimConfig::host_overhead_s`] is `None`. Default `None`.
    pub profile: Option<CostProfile>,
    /// `tflops`: achieved compute throughput per rank in TFLOPS (10^12 FLOP/s). Default from
    /// [`SimConfig::for_topology`]: [`DEFAULT_EFFICIENCY`] x the GPU's peak.
    pub tflops: f64,
    /// `policy`. Default [`Policy::Trace`].
    pub policy: Policy,
    /// `bucket_bytes`: the layout's bucket cap. Default 64 MiB (ignored by [`Policy::Naive`]
    /// and [`Policy::Zero3_2021`], which put every parameter in its own bucket).
    pub bucket_bytes: usize,
    /// `bucket_by`: where buckets end
    /// ([`LayoutBuilder::boundary`](collsched_buckets::LayoutBuilder::boundary)). Default
    /// [`DEFAULT_SIM_BOUNDARY`] (ignored by [`Policy::Naive`] and [`Policy::Zero3_2021`]).
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
    /// launches. `None`: the profile's `host_per_collective_s` when [`SimConfig::profile`] has
    /// one, else [`NAIVE_HOST_OVERHEAD_S`] for [`Policy::Naive`], else 0. [`Policy::Zero3_2021`]
    /// prices its own launches (all-gather and reduce-scatter apart) unless this is set.
    pub host_overhead_s: Option<f64>,
    /// `wait_overhead_s`: seconds a rank loses each time it blocks on a collective, beyond the
    /// collective's end (the others' late arrival on shared cores, waking up). `None`: 0 (a
    /// profile does not measure it: see `benches/README.md`, "The simulator against real runs").
    pub wait_overhead_s: Option<f64>,
    /// `compute_slowdown`: compute durations are multiplied by it (every rank computing at
    /// once on shared cores). `None`: the profile's, else 1.
    pub compute_slowdown: Option<f64>,
    /// `compute_overlap`: the fraction of collective time that proceeds alongside a rank's
    /// compute; a compute op is stretched by the rest of the time the rank's resolved
    /// collectives run during it (with [`shared_link`](Self::shared_link), not counting a
    /// collective's wait for the link). `None`: the profile's, else 1 (free overlap, as on a GPU).
    pub compute_overlap: Option<f64>,
    /// `shared_link`: the all-gather and the reduce-scatter streams share one link, as two
    /// streams over one network adapter do. A collective's transfer (its price beyond the same
    /// collective's at 0 bytes: the latency and launch terms are not shared) runs only while
    /// the other stream's transfers leave the link free, so two running together take as long
    /// as one after the other; the one priced first keeps the link. Default off: each stream
    /// has a link of its own (the model's default, which the calibrated tables in
    /// `benches/README.md` were made with).
    pub shared_link: bool,
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
            profile: None,
            tflops,
            policy: Policy::default(),
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            boundary: DEFAULT_SIM_BOUNDARY,
            prefetch_bytes: DEFAULT_PREFETCH_BYTES,
            max_inflight: DEFAULT_MAX_INFLIGHT,
            max_live_bytes: DEFAULT_MAX_LIVE_BYTES,
            steps: DEFAULT_STEPS,
            host_overhead_s: None,
            wait_overhead_s: None,
            compute_slowdown: None,
            compute_overlap: None,
            shared_link: false,
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

    /// The host overhead per launched collective in effect (seconds); for
    /// [`Policy::Zero3_2021`] without `host_overhead_s`, that of an all-gather.
    pub fn host_overhead(&self) -> f64 {
        if self.policy == Policy::Zero3_2021 && self.host_overhead_s.is_none() {
            return ZERO3_2021_GATHER_PRE_LAUNCH_S + ZERO3_2021_LIST_LAUNCH_S;
        }
        let measured = self.profile.as_ref().and_then(|p| p.host_per_collective_s);
        self.host_overhead_s.or(measured).unwrap_or(if self.policy == Policy::Naive {
            NAIVE_HOST_OVERHEAD_S
        } else {
            0.0
        })
    }

    /// The seconds lost per blocking wait in effect.
    pub fn wait_overhead(&self) -> f64 {
        self.wait_overhead_s.unwrap_or(0.0)
    }

    /// The compute slowdown in effect.
    pub fn compute_slowdown(&self) -> f64 {
        self.compute_slowdown.or(self.profile.as_ref().and_then(|p| p.compute_slowdown)).unwrap_or(1.0)
    }

    /// The compute overlap in effect.
    pub fn compute_overlap(&self) -> f64 {
        self.compute_overlap.or(self.profile.as_ref().and_then(|p| p.compute_overlap)).unwrap_or(1.0)
    }

    pub(crate) fn validate(&self) -> Result<(), SimError> {
        let bad = |knob, message: String| Err(SimError::Config { knob, message });
        if self.world == 0 {
            return bad("world", "is 0; give at least 1 rank".into());
        }
        if self.world > MAX_WORLD {
            return bad(
                "world",
                format!("is {}, above the simulator's limit of {MAX_WORLD} ranks (each rank runs its own scheduler)", self.world),
            );
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
        let w = self.wait_overhead();
        if !(w.is_finite() && (0.0..=1.0).contains(&w)) {
            return bad(
                "wait-overhead-us",
                format!("is {}; give a finite number of us within 0..1e6", w * 1e6),
            );
        }
        let slow = self.compute_slowdown();
        if !(slow.is_finite() && slow >= 1.0) {
            return bad("compute-slowdown", format!("is {slow}; give a factor >= 1"));
        }
        let overlap = self.compute_overlap();
        if !(0.0..=1.0).contains(&overlap) {
            return bad("compute-overlap", format!("is {overlap}; give a fraction within 0..1"));
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
