//! [`SchedulerConfig`]: every knob of the scheduler, with its default.

use crate::buckets::{BucketId, DType};

use super::error::ScheduleError;
use super::input::ScheduleInput;

/// Default of [`SchedulerConfig::prefetch_bytes`]: 2 GiB launched ahead (the first bucket
/// ahead is admitted whatever its size, and counts), half of [`DEFAULT_MAX_LIVE_BYTES`]:
/// room for one transformer block in use and the next one ahead, the memory FSDP2's
/// one-module-ahead prefetch takes.
///
/// Measured in the simulator (64 ranks of dgx-h100, trace replay, 64 MiB buckets at layer
/// boundaries, `benches/README.md`): with 256 MiB the large
/// presets kept most of their all-gathers exposed, because a block of 7-9 buckets of 100-470
/// MB each got only one bucket ahead (`llama-70b` 800 ms, `roberta-50b` 682 ms, `roberta-10b`
/// 121 ms exposed per step); 1 GiB still left 475 / 440 ms; 2 GiB hides nearly all of it
/// (16 / 19 / 8 ms) with a peak of at most 3.5 GiB gathered, and more changes nothing. Small
/// models never reach the budget, so it changes nothing for them; `max_live_bytes` stays the
/// memory limit.
pub const DEFAULT_PREFETCH_BYTES: usize = 2 << 30;
/// Default of [`SchedulerConfig::max_inflight`]: 16 launched-but-unconsumed gathers.
///
/// A transformer block is about 8 gather buckets in the simulator's workloads; 16 lets a whole
/// block's buckets be launched ahead of its fetch (FSDP2 prefetches one module ahead) with room for
/// the start of the next one. The count only bounds how many gathered buffers exist ahead of use;
/// memory is bounded by `prefetch_bytes` and `max_live_bytes`, which stay the binding limits for
/// large buckets.
pub const DEFAULT_MAX_INFLIGHT: usize = 16;
/// Default of [`SchedulerConfig::max_live_bytes`]: 4 GiB of gathered parameters.
pub const DEFAULT_MAX_LIVE_BYTES: usize = 4 << 30;

/// Default of [`SchedulerConfig::trace_rerecord_after`]: 2 steps.
pub const DEFAULT_TRACE_RERECORD_AFTER: u32 = 2;

/// The built-in prefetch policy a scheduler starts with (replace it with
/// [`Scheduler::set_policy`](super::Scheduler::set_policy), e.g. for
/// [`Explicit`](super::Explicit)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// Launch nothing ahead.
    None,
    /// Record the first step's bucket fetch order and replay it ([`TraceReplay`](super::TraceReplay)).
    #[default]
    TraceReplay,
}

/// How one gradient bucket is reduced (see [`ReduceSpec`](super::ReduceSpec)).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GradReduce {
    /// Element type of the reduction; `None` = the bucket's own dtype.
    pub dtype: Option<DType>,
    /// Divide each contribution by this before summing; `None` = 1.
    pub pre_divide: Option<f64>,
    /// Divide the sum by this after reducing; `None` = world size / pre_divide, so the result
    /// is the mean over all ranks.
    pub post_divide: Option<f64>,
}

/// Every knob of a [`Scheduler`](super::Scheduler).
///
/// **The budgets count deterministic state only** (what was launched and not yet fetched,
/// what is gathered and not yet released), never completion timing: every rank must issue the
/// same collectives in the same order. See the module docs of [`scheduler`](super).
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Prefetch policy to start with. Default [`PolicyKind::TraceReplay`].
    pub policy: PolicyKind,
    /// `prefetch_bytes`: bound on the gathered bytes launched ahead of their fetch
    /// (prefetched by this scheduler and not yet fetched), the first bucket ahead counted.
    /// When nothing is launched ahead, the next bucket is admitted whatever its size (so a
    /// bucket larger than this is still prefetched one ahead, like DeepSpeed's
    /// check-before-add and FSDP2's one-module-ahead); once one is ahead, a further bucket is
    /// admitted only if the bytes ahead stay within `prefetch_bytes`. Hence: with two or more
    /// buckets ahead, their bytes are at most `prefetch_bytes`; with one, it may be larger.
    /// `max_inflight` and `max_live_bytes` bound every prefetch, the first included. 0 means
    /// at most one bucket ahead. Bytes of a bucket are its
    /// [`BucketInput::memory_bytes`](super::BucketInput::memory_bytes) (gathered buffer plus
    /// unpacked copy). Default [`DEFAULT_PREFETCH_BYTES`] (2 GiB).
    pub prefetch_bytes: usize,
    /// `max_inflight`: at most this many gathers launched ahead and not yet fetched (this
    /// scheduler's). Default [`DEFAULT_MAX_INFLIGHT`] (16: one transformer block's buckets,
    /// see the constant). 0 disables prefetch.
    pub max_inflight: usize,
    /// `max_live_bytes`: bound on the gathered parameter memory of the registry (all
    /// schedulers sharing it). A prefetch never exceeds it; a fetch that would, first evicts
    /// this scheduler's unused prefetches (newest first) and then proceeds anyway (the engine
    /// needs the parameters), counting an overrun. A gathered bucket counts its
    /// [`BucketInput::memory_bytes`](super::BucketInput::memory_bytes): the gathered buffer
    /// and the unpacked copy a driver keeps beside it. Default [`DEFAULT_MAX_LIVE_BYTES`]
    /// (4 GiB).
    pub max_live_bytes: usize,
    /// `trace_rerecord_after`: with [`PolicyKind::TraceReplay`], record the trace again after
    /// this many consecutive steps with fetches the trace does not have ahead of its position
    /// (skips within the trace are re-synced and do not count). 0: never. Default
    /// [`DEFAULT_TRACE_RERECORD_AFTER`] (2).
    pub trace_rerecord_after: u32,
    /// `check_trainable`: at each step boundary compare the mask given by
    /// [`Event::SetTrainable`](super::Event::SetTrainable) with the plan's and refresh when it
    /// differs. Off: the mask is only recorded, and the engine calls
    /// [`Scheduler::refresh_trainable`](super::Scheduler::refresh_trainable) itself. Default on.
    pub check_trainable: bool,
    /// `reduce`: how gradient buckets are reduced, unless overridden in `reduce_per_bucket`.
    /// Default: the bucket's dtype, mean over the world.
    pub reduce: GradReduce,
    /// `reduce_per_bucket`: overrides of `reduce`, keyed by **gather** bucket id (stable across
    /// trainability refreshes, unlike gradient bucket ids). Default empty.
    pub reduce_per_bucket: Vec<(BucketId, GradReduce)>,
    /// `split_f16_divide`: a gradient bucket reduced in f16 whose `pre_divide` is not given
    /// divides its contributions before the sum by a power of two near the square root of the
    /// whole factor, and the sum by the rest ([`split_divide`]; FSDP2 does the same for f16,
    /// whose sum NCCL keeps in f16, where a sum of large gradients overflows). Off: the whole
    /// factor divides the sum. Default off.
    pub split_f16_divide: bool,
}

/// The `(pre_divide, post_divide)` of FSDP2's guard for a reduction in f16 dividing by
/// `factor` in all (its `_get_gradient_divide_factors`): `pre` doubles from 1 while `factor` is
/// a multiple of it and `factor / pre` exceeds it, about the square root of `factor`; `post` is
/// `factor / pre`. `split_divide(8.0)` is `(4.0, 2.0)`, `split_divide(2.0)` is `(2.0, 1.0)`,
/// `split_divide(1.5)` is `(1.0, 1.5)`.
pub fn split_divide(factor: f64) -> (f64, f64) {
    let mut pre = 1.0_f64;
    while factor % pre == 0.0 && factor / pre > pre {
        pre *= 2.0;
    }
    (pre, factor / pre)
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            policy: PolicyKind::TraceReplay,
            prefetch_bytes: DEFAULT_PREFETCH_BYTES,
            max_inflight: DEFAULT_MAX_INFLIGHT,
            max_live_bytes: DEFAULT_MAX_LIVE_BYTES,
            trace_rerecord_after: DEFAULT_TRACE_RERECORD_AFTER,
            check_trainable: true,
            reduce: GradReduce::default(),
            reduce_per_bucket: Vec::new(),
            split_f16_divide: false,
        }
    }
}

impl SchedulerConfig {
    /// Checks the knobs against the plan: divide factors finite and positive, per-bucket
    /// overrides naming gather buckets of the plan.
    pub(crate) fn validate(&self, input: &ScheduleInput) -> Result<(), ScheduleError> {
        let all = std::iter::once((None, &self.reduce))
            .chain(self.reduce_per_bucket.iter().map(|(b, r)| (Some(*b), r)));
        for (bucket, r) in all {
            let place = match bucket {
                Some(b) => format!("reduce_per_bucket[gather bucket {b}]"),
                None => "reduce".to_string(),
            };
            for (name, v) in [("pre_divide", r.pre_divide), ("post_divide", r.post_divide)] {
                if let Some(v) = v {
                    if !(v.is_finite() && v > 0.0) {
                        return Err(ScheduleError::BadConfig {
                            what: format!(
                                "{place}.{name} = {v}; use a finite factor > 0 (or None for the default)"
                            ),
                        });
                    }
                }
            }
            if let Some(b) = bucket {
                if !input.gather.iter().any(|g| g.id == b) {
                    return Err(ScheduleError::BadConfig {
                        what: format!(
                            "{place}: bucket {b} is not a gather bucket of the plan (it has {} gather buckets); key overrides by gather bucket id",
                            input.gather.len()
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}
