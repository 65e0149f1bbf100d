//! [`ScheduleInput`]: the compact tables the scheduler runs on, built once from a plan.
//!
//! This is the only place that reads the plan/layout API; everything else in the scheduler
//! works on these tables.

use crate::buckets::{BucketId, DType, ParamId, ParamSet};
use crate::plan::Plan;
use crate::CollectiveKind;
use smallvec::SmallVec;

use super::action::Ops;
use super::error::ScheduleError;

/// One bucket as the scheduler sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketInput {
    /// The bucket's id in the layout.
    pub id: BucketId,
    /// Element type of its parameters.
    pub dtype: DType,
    /// Its parameters, in bucket order.
    pub params: Vec<ParamId>,
    /// Bytes of the gathered (full-size) buffer.
    pub gathered_bytes: usize,
    /// Bytes of one rank's shard (the per-rank payload).
    pub shard_bytes: usize,
    /// Bytes a driver holds beside the gathered buffer while the bucket is gathered: the
    /// unpacked copy of the parameters that are not one contiguous run of it
    /// ([`Bucket::unpacked_numel`](crate::buckets::Bucket::unpacked_numel); EvenSplit and
    /// Hybrid gather buckets). 0 for gradient buckets and for Flat, Greedy and single-owner
    /// gather buckets, whose views point into the gathered buffer.
    pub unpacked_bytes: usize,
    /// The plan ops that move it, run in order on one stream.
    pub ops: Ops,
    /// The kind of each op of `ops` (for per-kind counters).
    pub kinds: SmallVec<[CollectiveKind; 2]>,
    /// For a gradient bucket: its gather bucket.
    pub partner: Option<BucketId>,
    /// For a gather bucket with an unpacked copy: the driver's all-gather writes every
    /// parameter straight to its unpacked place, so no gathered buffer is held beside it
    /// ([`ScheduleInput::placing`]). `false` from a plan.
    pub placed: bool,
}

/// A digest of a plan: one 64-bit fingerprint of everything, and one digest per bucket (by
/// bucket id), so a mismatch between ranks can name the first differing bucket.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PlanDigests {
    /// Digest of the whole plan (parameters, strategy, every bucket).
    pub fingerprint: u64,
    /// Digest of each bucket, by bucket id.
    pub buckets: Vec<u64>,
}

impl PlanDigests {
    /// The digests of a plan: its fingerprint and [`Plan::bucket_digest`] of every bucket.
    pub fn of_plan(plan: &Plan) -> PlanDigests {
        let buckets =
            plan.layout().buckets().iter().map(|b| plan.bucket_digest(b.id()).unwrap_or(0)).collect();
        PlanDigests { fingerprint: plan.fingerprint().0, buckets }
    }
}

impl BucketInput {
    /// Memory the bucket takes while gathered: the gathered buffer and the unpacked copy
    /// (`gathered_bytes + unpacked_bytes`), or the unpacked copy alone when the all-gather
    /// places the pieces ([`BucketInput::placed`]). What `max_live_bytes`, `prefetch_bytes`,
    /// live and peak gathered bytes count.
    pub fn memory_bytes(&self) -> usize {
        if self.placed {
            self.unpacked_bytes
        } else {
            self.gathered_bytes + self.unpacked_bytes
        }
    }
}

/// Everything the scheduler needs from a plan: the parameters (names, trainability), the
/// gather buckets, the gradient buckets, the group size and the digests.
#[derive(Clone, Debug)]
pub struct ScheduleInput {
    /// The parameters (names for errors; the trainability mask the gradient buckets were
    /// built for).
    pub params: ParamSet,
    /// Ranks contributing a gradient to every gradient bucket (the world: the default divisor
    /// of a mean, also under hybrid sharding where the reduction spans the groups).
    pub world: u32,
    /// Gather buckets; every parameter is in exactly one.
    pub gather: Vec<BucketInput>,
    /// Gradient buckets; every trainable parameter is in exactly one, frozen ones in none.
    pub grad: Vec<BucketInput>,
    /// Plan digests for agreement checks.
    pub digests: PlanDigests,
}

impl ScheduleInput {
    /// The tables of a plan: its buckets, their ops, its digests.
    ///
    /// # Examples
    /// ```
    /// use collsched_schedule::buckets::{DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};
    /// use collsched_schedule::{Plan, ScheduleInput};
    /// let set = ParamSet::new(vec![ParamSpec::new("w", [64], DType::F32)]).unwrap();
    /// let plan = Plan::new(LayoutBuilder::new(&set, Sharding::EvenSplit, 2).build().unwrap());
    /// let input = ScheduleInput::from_plan(&plan);
    /// assert_eq!((input.gather.len(), input.grad.len()), (1, 1));
    /// ```
    pub fn from_plan(plan: &Plan) -> ScheduleInput {
        let layout = plan.layout();
        let conv = |b: &crate::buckets::Bucket| BucketInput {
            id: b.id(),
            dtype: b.dtype(),
            params: b.params().to_vec(),
            gathered_bytes: b.gathered_bytes(),
            shard_bytes: b.shard_bytes(),
            unpacked_bytes: match b.kind() {
                crate::buckets::BucketKind::Gather => b.unpacked_numel() * b.dtype().size(),
                _ => 0,
            },
            ops: plan.ops_of(b.id()).iter().copied().collect(),
            kinds: plan.ops_of(b.id()).iter().filter_map(|&o| plan.op(o).map(|op| op.kind())).collect(),
            partner: b.gather_bucket(),
            placed: false,
        };
        ScheduleInput {
            params: layout.params().clone(),
            world: layout.world(),
            gather: layout.gather_buckets().iter().map(conv).collect(),
            grad: layout.grad_buckets().iter().map(conv).collect(),
            digests: PlanDigests::of_plan(plan),
        }
    }

    /// These tables for a driver whose all-gather of gather bucket `id` writes the parameters
    /// straight to their unpacked places when `places(id)` (the local and shm backends: no
    /// gathered buffer is held, [`BucketInput::placed`]); buckets without an unpacked copy
    /// are left as they are. Every rank of a job must give the same answers: the budgets
    /// count these bytes, and prefetch decisions follow the budgets.
    #[must_use]
    pub fn placing(mut self, places: impl Fn(BucketId) -> bool) -> ScheduleInput {
        for b in &mut self.gather {
            b.placed = b.unpacked_bytes > 0 && places(b.id);
        }
        self
    }

    /// Checks the tables: every parameter in exactly one gather bucket, every trainable one
    /// in exactly one gradient bucket and no frozen one, ids in range, ops present.
    pub(crate) fn validate(&self) -> Result<(), ScheduleError> {
        let n = self.params.len();
        let bad = |what: String| Err(ScheduleError::BadInput { what });
        let mut seen = vec![false; n];
        for (kind, list) in [("gather", &self.gather), ("gradient", &self.grad)] {
            seen.iter_mut().for_each(|s| *s = false);
            for b in list {
                if b.ops.is_empty() || b.kinds.len() != b.ops.len() {
                    return bad(format!(
                        "{kind} bucket {} has {} ops and {} op kinds; give each bucket its ops and their kinds",
                        b.id,
                        b.ops.len(),
                        b.kinds.len()
                    ));
                }
                for &p in &b.params {
                    let Some(s) = seen.get_mut(p.index()) else {
                        return bad(format!(
                            "{kind} bucket {} lists parameter id {p}, the set has {n}",
                            b.id
                        ));
                    };
                    if *s {
                        return bad(format!(
                            "parameter `{}` is in two {kind} buckets (second: {})",
                            self.params.name(p),
                            b.id
                        ));
                    }
                    *s = true;
                    if kind == "gradient" && !self.params.is_trainable(p) {
                        return bad(format!(
                            "frozen parameter `{}` is in gradient bucket {}",
                            self.params.name(p),
                            b.id
                        ));
                    }
                }
            }
            for (i, &s) in seen.iter().enumerate() {
                let p = ParamId(i as u32);
                let wanted = kind == "gather" || self.params.is_trainable(p);
                if wanted && !s {
                    return bad(format!("parameter `{}` is in no {kind} bucket", self.params.name(p)));
                }
            }
        }
        Ok(())
    }
}
