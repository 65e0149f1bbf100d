//! What a simulation reports: per-step statistics, per-rank timelines of spans, JSON.

use collsched_buckets::Boundary;

use super::config::Policy;

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
    /// The step's compute between its forward and its backward outside every layer (the
    /// workload's `loss_flops`).
    Loss,
    /// The step's compute after its gradients are reduced (the workload's `update_flops`).
    Update,
    /// The compute stream waiting for a collective (exposed communication).
    Wait,
    /// Host overhead of launching a collective.
    Host,
    /// Host work of an engine hook outside launches (a layer's, or a device drain's), with
    /// the host-device syncs it makes ([`Policy::Zero3_2021`]).
    Hook,
    /// An all-gather (comm lanes).
    AllGather,
    /// A reduce-scatter (comm lanes).
    ReduceScatter,
}

impl SpanKind {
    /// Whether it is compute (a layer's, or the step's loss or update), not a wait, host time
    /// or a collective.
    pub const fn is_compute(self) -> bool {
        matches!(
            self,
            SpanKind::Forward | SpanKind::Recompute | SpanKind::Backward | SpanKind::Loss | SpanKind::Update
        )
    }

    /// Every kind.
    pub const ALL: [SpanKind; 10] = [
        SpanKind::Forward,
        SpanKind::Recompute,
        SpanKind::Backward,
        SpanKind::Loss,
        SpanKind::Update,
        SpanKind::Wait,
        SpanKind::Host,
        SpanKind::Hook,
        SpanKind::AllGather,
        SpanKind::ReduceScatter,
    ];

    /// The kind a short name ([`SpanKind::name`]) stands for.
    pub fn from_name(name: &str) -> Option<SpanKind> {
        SpanKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// A short name.
    pub const fn name(self) -> &'static str {
        match self {
            SpanKind::Forward => "forward",
            SpanKind::Recompute => "recompute",
            SpanKind::Backward => "backward",
            SpanKind::Loss => "loss",
            SpanKind::Update => "update",
            SpanKind::Wait => "wait",
            SpanKind::Host => "host",
            SpanKind::Hook => "hook",
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
    /// The layer (compute spans; index into
    /// [`Workload::layers`](super::workload::Workload::layers)) or the bucket (collectives).
    pub index: u32,
    /// Step (0-based).
    pub step: u32,
    /// For collectives: launched ahead by prefetch.
    pub prefetch: bool,
}

/// Every span of a simulation (recorded with [`SimConfig::timeline`](super::SimConfig::timeline)).
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
    /// By bucket id: the bytes of that bucket's collective output on a rank (an all-gather's
    /// gathered buffer, a reduce-scatter's reduced shard), as a real record's `bytes` counts them.
    pub bucket_bytes: Vec<u64>,
}

/// What one simulated step cost.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimStepStats {
    /// Wall time of the step: from the end of the previous step (the last rank's) to the end
    /// of this one (the last rank's), ns.
    pub step_ns: u64,
    /// Compute time (forward, recompute, backward, the loss and the update), mean over ranks, ns.
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
    /// Host-device synchronizations the engine made (rank 0; only [`Policy::Zero3_2021`]
    /// makes any).
    pub host_syncs: u64,
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
    pub steps: Vec<SimStepStats>,
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
    pub fn reported(&self) -> &[SimStepStats] {
        &self.steps[self.reported_from.min(self.steps.len())..]
    }

    fn mean(&self, f: impl Fn(&SimStepStats) -> f64) -> f64 {
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
            "host_syncs": count(self.mean(|s| s.host_syncs as f64)),
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

#[cfg(test)]
mod tests {
    use super::SpanKind;

    /// Every kind is in [`SpanKind::ALL`] once (the match below fails to compile when a kind is
    /// added without a place) and reads back from its name.
    #[test]
    fn every_kind_is_listed_and_reads_back_from_its_name() {
        let place = |k: SpanKind| match k {
            SpanKind::Forward => 0,
            SpanKind::Recompute => 1,
            SpanKind::Backward => 2,
            SpanKind::Loss => 3,
            SpanKind::Update => 4,
            SpanKind::Wait => 5,
            SpanKind::Host => 6,
            SpanKind::Hook => 7,
            SpanKind::AllGather => 8,
            SpanKind::ReduceScatter => 9,
        };
        for (i, k) in SpanKind::ALL.into_iter().enumerate() {
            assert_eq!(place(k), i, "{k:?}");
            assert_eq!(SpanKind::from_name(k.name()), Some(k));
        }
        assert_eq!(SpanKind::from_name("lunch"), None);
    }
}
