//! Per-step counters and the end-of-step report.

use crate::buckets::ParamId;
use crate::CollectiveKind;

/// What one step did. Reset at each [`Event::EndStep`](super::Event::EndStep).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepCounters {
    /// Gather launches (one per bucket gathered; each runs the bucket's ops).
    pub all_gathers: u64,
    /// Reduce launches (one per gradient bucket reduced).
    pub reduce_scatters: u64,
    /// Plan ops (collectives) issued by those launches: one per launch, except hybrid
    /// sharding's reduce-scatter + cross-group all-reduce (two).
    pub ops_issued: u64,
    /// Plan ops issued, by kind: `[all_gather, reduce_scatter, all_reduce, broadcast]` (see
    /// [`StepCounters::ops_of_kind`]).
    pub ops_by_kind: [u64; 4],
    /// Bytes of gathered buffers produced by all-gathers.
    pub gathered_bytes: u64,
    /// Bytes of full-size gradient buffers reduced, in their reduction dtype.
    pub reduced_bytes: u64,
    /// Gathers launched ahead by the prefetch policy.
    pub prefetch_launches: u64,
    /// Fetches that found their bucket in flight or available thanks to a prefetch.
    pub prefetch_hits: u64,
    /// Fetches that had to launch their bucket's gather themselves.
    pub prefetch_misses: u64,
    /// Fetches that found their bucket gathered by an earlier fetch still held (this or
    /// another scheduler).
    pub already_gathered: u64,
    /// `Wait` actions emitted (fetches whose gather was not known complete).
    pub waits: u64,
    /// Unused prefetches freed to make room for a fetch under `max_live_bytes`.
    pub evictions: u64,
    /// Unused prefetches freed because the policy skipped past them (trace divergence).
    pub discarded_prefetches: u64,
    /// Fetches that had to exceed `max_live_bytes` because held buckets fill it.
    pub live_overruns: u64,
    /// Highest gathered bytes of the registry during the step: gathered buffers and their
    /// unpacked copies ([`BucketInput::memory_bytes`](super::BucketInput::memory_bytes)).
    pub peak_gathered_bytes: u64,
    /// Parameters of prefetched-but-unused buckets drained at the end of the step.
    pub drained_params: u64,
    /// Parameters whose gradient was missing at the end of the step, reduced as zeros.
    pub zero_filled_params: u64,
    /// Gradients accumulated locally under no_sync.
    pub accumulated_grads: u64,
}

/// The end of the last step: its counters and the parameters worth reporting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Step number (0 for the first step).
    pub step: u64,
    /// The step's counters.
    pub counters: StepCounters,
    /// Parameters of buckets that were prefetched and never fetched, drained (waited on and
    /// freed) at the end of the step, instead of a "still in flight" crash.
    pub drained: Vec<ParamId>,
    /// Parameters that gave no gradient in a step that reduced gradients: reduced as zeros so
    /// every rank issues the same collectives.
    pub zero_filled: Vec<ParamId>,
    /// Parameters this scheduler fetched and did not release by the end of the step (still
    /// gathered, not freed).
    pub held: Vec<ParamId>,
}

impl StepCounters {
    /// Plan ops of `kind` issued in the step.
    pub fn ops_of_kind(&self, kind: CollectiveKind) -> u64 {
        self.ops_by_kind[kind_slot(kind)]
    }
}

pub(crate) fn kind_slot(kind: CollectiveKind) -> usize {
    match kind {
        CollectiveKind::AllGather => 0,
        CollectiveKind::ReduceScatter => 1,
        CollectiveKind::AllReduce => 2,
        CollectiveKind::Broadcast => 3,
    }
}
