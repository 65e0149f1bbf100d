//! Per-rank tables derived once from a plan: collective descriptions, copy-out lists of the
//! gather buckets, copy-in lists and shard runs of the gradient buckets. Built when a model
//! state is created (gather side) or a plan is refreshed (gradient side), so that steady-state
//! steps only index into them.
//!
//! Index names used throughout the runtime: `g` is a gather bucket's position in
//! `GatherTables::gather`, `j` a gradient bucket's position in `GradTables::grad`, `p` a
//! parameter's index; `position(BucketId)` translates a layout's bucket id.

use std::sync::Arc;

use collsched_buckets::{BucketId, DType, ParamId};
use collsched_kernels::{CopySegment, ElemType, ReduceOp, Scaling};
use collsched_schedule::{BufferRole, CollectiveKind, Plan, Scheduler};

use super::RuntimeError;
use crate::backend::{CollDesc, GatherUnpack, RankGroup};

/// The collective element type of a bucket dtype.
pub(crate) fn elem_of(dtype: DType, rank: usize, bucket: BucketId) -> Result<ElemType, RuntimeError> {
    match dtype {
        DType::F32 => Ok(ElemType::F32),
        DType::F16 => Ok(ElemType::F16),
        DType::BF16 => Ok(ElemType::BF16),
        other => Err(RuntimeError::Unsupported {
            rank,
            what: format!(
                "bucket {bucket} has dtype {other}; collectives move f32, f16 and bf16 only (keep other \
                 parameters out of the sharded set)"
            ),
        }),
    }
}

/// The element type a bucket of `dtype` gradients is reduced in, for `GradReduce::dtype`
/// `reduce`; `Err` says why the pair is refused and what to do.
///
/// Supported: the bucket's own dtype; f16 or bf16 gradients reduced in f32 (mixed precision:
/// the cast is exact); f32 gradients reduced in f16 or bf16 (half the traffic, rounded once
/// at copy-in). Refused: a reduction dtype the kernels do not reduce (f64, u8, i8), and
/// f16 <-> bf16, which loses range one way and precision the other.
pub(crate) fn reduce_elem(dtype: DType, reduce: DType) -> Result<ElemType, String> {
    let of = |d: DType| match d {
        DType::F32 => Some(ElemType::F32),
        DType::F16 => Some(ElemType::F16),
        DType::BF16 => Some(ElemType::BF16),
        _ => None,
    };
    match (of(dtype), of(reduce)) {
        (Some(p), Some(r)) if p == r || p == ElemType::F32 || r == ElemType::F32 => Ok(r),
        (Some(_), Some(_)) => Err(format!(
            "{dtype} gradients reduced in {reduce} would lose {}; reduce in f32 or in {dtype}",
            if reduce == DType::F16 { "range" } else { "precision" }
        )),
        (Some(_), None) => Err(format!(
            "collectives reduce in f32, f16 or bf16, not {reduce}; set GradReduce::dtype to one of them \
             (or None for {dtype})"
        )),
        (None, _) => Err(format!("collectives move f32, f16 and bf16 gradients only, not {dtype}")),
    }
}

fn group_of(plan: &Plan, op: collsched_schedule::OpId, rank: usize) -> Result<RankGroup, RuntimeError> {
    let o = plan.op(op).ok_or_else(|| RuntimeError::Unsupported {
        rank,
        what: format!("plan op {op} does not exist (a plan and its tables disagree)"),
    })?;
    let ranks: Vec<usize> = o.groups().ranks_of(rank as u32).map(|r| r as usize).collect();
    RankGroup::new(ranks).map_err(|source| RuntimeError::Backend {
        rank,
        op: "plan",
        bucket: Some(o.bucket()),
        source: source.into(),
    })
}

/// One gather bucket on this rank.
#[derive(Debug)]
pub(crate) struct GatherTable {
    pub(crate) id: BucketId,
    pub(crate) elem: ElemType,
    pub(crate) shard_bytes: usize,
    pub(crate) gathered_bytes: usize,
    /// The all-gather (or broadcast) this rank posts.
    pub(crate) desc: CollDesc,
    /// Whether this rank gives an input (always, except a broadcast's non-roots).
    pub(crate) sends: bool,
    /// Copy-out: gathered buffer -> the bucket's unpacked buffer, in elements, for the
    /// parameters that are not one contiguous run of the gathered buffer (one after the
    /// other, in bucket order). Empty for Flat, Greedy and single-owner buckets.
    pub(crate) copy_out: Vec<CopySegment>,
    /// Bytes of the unpacked buffer (0: every view points into the gathered buffer; otherwise
    /// every view points into the unpacked one).
    pub(crate) unpacked_bytes: usize,
    /// For an unpacked all-gather bucket: `desc` with `copy_out` as its output layout, which
    /// gathers straight into the unpacked buffer on backends that place pieces.
    pub(crate) unpacking: Option<CollDesc>,
}

/// Where a parameter lives on this rank.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ParamSlot {
    /// Gather bucket position.
    pub(crate) gather: usize,
    /// First element of the parameter's full value: in the bucket's unpacked buffer when
    /// `unpacked`, else in the gathered buffer (the parameter is one contiguous run there).
    pub(crate) base: usize,
    /// Whether the view is in the unpacked buffer (see `base`).
    pub(crate) unpacked: bool,
    /// Elements.
    pub(crate) numel: usize,
    /// Element size in bytes.
    pub(crate) elem_size: usize,
    /// Runs of this parameter in this rank's shard of its gather bucket: `shard_runs[lo..hi]`.
    pub(crate) shard_runs: (u32, u32),
}

/// A run of a parameter inside a shard: elements `param_offset..param_offset + numel` sit at
/// `shard_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ShardRun {
    pub(crate) param_offset: usize,
    pub(crate) numel: usize,
    pub(crate) shard_offset: usize,
}

impl GatherTable {
    /// The all-gather that places the pieces (`unpacking`), when `backend` can run it and
    /// this rank sends a shard: what the launch runs, and what the budgets count
    /// (`ScheduleInput::placing`; every rank of an all-gather sends, so all answer alike).
    pub(crate) fn placing(&self, backend: &impl crate::backend::Backend) -> Option<&CollDesc> {
        self.unpacking.as_ref().filter(|_| self.sends && backend.gathers_unpacked())
    }
}

/// The gather side: fixed for the life of a model state.
#[derive(Debug)]
pub(crate) struct GatherTables {
    pub(crate) rank: usize,
    pub(crate) gather: Vec<GatherTable>,
    pub(crate) params: Vec<ParamSlot>,
    pub(crate) shard_runs: Vec<ShardRun>,
    /// Gather bucket position by bucket id index (`u32::MAX`: not a gather bucket).
    pub(crate) by_id: Vec<u32>,
}

impl GatherTables {
    pub(crate) fn new(plan: &Plan, rank: usize) -> Result<GatherTables, RuntimeError> {
        let layout = plan.layout();
        let n = layout.params().len();
        let mut params =
            vec![
                ParamSlot { gather: 0, base: 0, unpacked: false, numel: 0, elem_size: 0, shard_runs: (0, 0) };
                n
            ];
        let mut shard_runs = Vec::new();
        let mut gather = Vec::with_capacity(layout.gather_buckets().len());
        let max_id = layout.buckets().iter().map(|b| b.id().index() + 1).max().unwrap_or(0);
        let mut by_id = vec![u32::MAX; max_id];
        for (g, b) in layout.gather_buckets().iter().enumerate() {
            by_id[b.id().index()] = g as u32;
            let elem = elem_of(b.dtype(), rank, b.id())?;
            let op_id = plan.gather_op(b.id()).ok_or_else(|| RuntimeError::Unsupported {
                rank,
                what: format!("gather bucket {} has no gather op in the plan", b.id()),
            })?;
            let op = plan.op(op_id).ok_or_else(|| RuntimeError::Unsupported {
                rank,
                what: format!("gather bucket {} names a missing op {op_id}", b.id()),
            })?;
            let group = group_of(plan, op_id, rank)?;
            let (desc, sends) = match op.kind() {
                CollectiveKind::Broadcast => {
                    let pos = op.root().unwrap_or(0) as usize;
                    let root = group.ranks().get(pos).copied().unwrap_or(0);
                    (CollDesc::broadcast(group, elem, b.shard_numel(), root), root == rank)
                }
                _ => (CollDesc::all_gather(group, elem, b.shard_numel()), true),
            };
            // A bucket with any parameter that is not one run of the gathered buffer is unpacked
            // whole: its gathered buffer is then freed as soon as the unpack is done.
            let unpack_all = b.unpacked_numel() > 0;
            let mut base = 0usize;
            for (i, (&p, &numel)) in b.params().iter().zip(b.param_numels()).enumerate() {
                let lo = shard_runs.len() as u32;
                for r in plan.runs(op_id, rank as u32, BufferRole::Shard).filter(|r| r.param == p) {
                    shard_runs.push(ShardRun {
                        param_offset: r.param_offset,
                        numel: r.numel,
                        shard_offset: r.offset,
                    });
                }
                let hi = shard_runs.len() as u32;
                let (at, unpacked) = match b.contiguous_offset(i) {
                    Some(at) if !unpack_all => (at, false),
                    _ => (base, true),
                };
                params[p.index()] = ParamSlot {
                    gather: g,
                    base: at,
                    unpacked,
                    numel,
                    elem_size: b.dtype().size(),
                    shard_runs: (lo, hi),
                };
                if unpacked {
                    base += numel;
                }
            }
            let copy_out: Vec<CopySegment> = plan
                .runs(op_id, rank as u32, BufferRole::Gathered)
                .filter(|r| params[r.param.index()].unpacked)
                .map(|r| CopySegment {
                    buffer: 0,
                    buffer_offset: params[r.param.index()].base + r.param_offset,
                    packed_offset: r.offset,
                    len: r.numel,
                })
                .collect();
            let desc = desc.with_tag(u64::from(b.id().0));
            let unpacking = match desc.kind {
                CollectiveKind::AllGather if base > 0 => {
                    let u = GatherUnpack::new(&copy_out, desc.count, desc.group.len()).map_err(|what| {
                        RuntimeError::Unsupported { rank, what: format!("gather bucket {}: {what}", b.id()) }
                    })?;
                    Some(desc.clone().with_unpack(Arc::new(u)))
                }
                _ => None,
            };
            gather.push(GatherTable {
                id: b.id(),
                elem,
                shard_bytes: b.shard_bytes(),
                gathered_bytes: b.gathered_bytes(),
                desc,
                sends,
                copy_out,
                unpacked_bytes: base * b.dtype().size(),
                unpacking,
            });
        }
        Ok(GatherTables { rank, gather, params, shard_runs, by_id })
    }

    /// Gather bucket position of a bucket id.
    pub(crate) fn position(&self, id: BucketId) -> Option<usize> {
        match self.by_id.get(id.index()) {
            Some(&g) if g != u32::MAX => Some(g as usize),
            _ => None,
        }
    }

    /// This rank's runs of a parameter in its gather shard.
    pub(crate) fn runs_of(&self, p: ParamId) -> &[ShardRun] {
        let (lo, hi) = self.params[p.index()].shard_runs;
        &self.shard_runs[lo as usize..hi as usize]
    }
}

/// One gradient bucket on this rank.
#[derive(Debug)]
pub(crate) struct GradTable {
    pub(crate) id: BucketId,
    /// The reduction's element type (`GradReduce::dtype`): of the gradient buffer, the
    /// collectives, the no_sync accumulators and the reduced shard.
    pub(crate) elem: ElemType,
    /// The parameters' (and so the engine's gradients') element type; cast to `elem` at
    /// copy-in.
    pub(crate) param_elem: ElemType,
    /// Bytes of the full-size gradient buffer, in `elem`.
    pub(crate) gathered_bytes: usize,
    /// Bytes of this rank's reduced shard, in `elem`.
    pub(crate) shard_bytes: usize,
    /// The collectives, run one after the other (reduce-scatter; for hybrid then the
    /// all-reduce across groups; or one all-reduce).
    pub(crate) stages: Vec<CollDesc>,
    /// The bucket's parameters (a gradient that never arrives is zeros in the buffer).
    pub(crate) params: Vec<ParamId>,
    /// Byte ranges of the gradient buffer no parameter's copy-in covers (padding): zeros.
    pub(crate) gaps: Vec<(usize, usize)>,
}

/// Where a trainable parameter's gradient goes on this rank.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GradSlot {
    /// Gradient bucket position (`u32::MAX`: frozen).
    pub(crate) bucket: u32,
    /// Copy-in segments (`copy_in[lo..hi]`, `buffer` 0 = the gradient).
    pub(crate) copy_in: (u32, u32),
    /// Runs of its reduced gradient in this rank's gradient shard (`shard_runs[lo..hi]`).
    pub(crate) shard_runs: (u32, u32),
}

/// The gradient side of one plan (rebuilt when trainability changes).
#[derive(Debug)]
pub(crate) struct GradTables {
    pub(crate) grad: Vec<GradTable>,
    pub(crate) params: Vec<GradSlot>,
    pub(crate) copy_in: Vec<CopySegment>,
    pub(crate) shard_runs: Vec<ShardRun>,
    /// Gradient bucket position by bucket id index.
    pub(crate) by_id: Vec<u32>,
}

impl GradTables {
    /// Tables for the scheduler's current gradient buckets (`plan` must be the plan with the
    /// scheduler's trainability mask).
    pub(crate) fn new(plan: &Plan, sched: &Scheduler, rank: usize) -> Result<GradTables, RuntimeError> {
        let n = plan.layout().params().len();
        let mut params = vec![GradSlot { bucket: u32::MAX, ..GradSlot::default() }; n];
        let mut copy_in = Vec::new();
        let mut shard_runs = Vec::new();
        let mut grad = Vec::new();
        let max_id = plan.layout().buckets().iter().map(|b| b.id().index() + 1).max().unwrap_or(0);
        let mut by_id = vec![u32::MAX; max_id];
        for (j, input) in sched.grad_buckets().iter().enumerate() {
            let b = plan.layout().bucket(input.id).ok_or_else(|| RuntimeError::Unsupported {
                rank,
                what: format!("gradient bucket {} of the scheduler is not in the plan", input.id),
            })?;
            by_id[b.id().index()] = j as u32;
            let param_elem = elem_of(b.dtype(), rank, b.id())?;
            let spec = sched.reduce_spec(j).ok_or_else(|| RuntimeError::Unsupported {
                rank,
                what: format!("gradient bucket {} has no reduce spec", b.id()),
            })?;
            let elem = reduce_elem(b.dtype(), spec.dtype).map_err(|what| RuntimeError::ReduceDtype {
                rank,
                bucket: b.id(),
                gather_bucket: input.partner,
                dtype: b.dtype(),
                reduce: spec.dtype,
                what,
            })?;
            let ops = plan.grad_ops(b.id());
            let mut stages = Vec::with_capacity(ops.len());
            let last = ops.len().saturating_sub(1);
            for (k, &op_id) in ops.iter().enumerate() {
                let op = plan.op(op_id).ok_or_else(|| RuntimeError::Unsupported {
                    rank,
                    what: format!("gradient bucket {} names a missing op {op_id}", b.id()),
                })?;
                let group = group_of(plan, op_id, rank)?;
                let pre = if k == 0 { spec.pre_divide as f32 } else { 1.0 };
                let post = if k == last { spec.post_divide as f32 } else { 1.0 };
                let desc = match op.kind() {
                    CollectiveKind::ReduceScatter => CollDesc::reduce_scatter(group, elem, b.shard_numel()),
                    _ => CollDesc::all_reduce(group, elem, b.shard_numel()),
                };
                let scaling = Scaling { pre_divide: pre, post_divide: post };
                stages.push(desc.with_reduce(ReduceOp::Sum, scaling).with_tag(u64::from(b.id().0)));
            }
            let (Some(&first), Some(&final_op)) = (ops.first(), ops.last()) else {
                return Err(RuntimeError::Unsupported {
                    rank,
                    what: format!("gradient bucket {} has no op in the plan", b.id()),
                });
            };
            let bucket_segments = copy_in.len();
            for &p in b.params() {
                let lo = copy_in.len() as u32;
                for r in plan.runs(first, rank as u32, BufferRole::Gathered).filter(|r| r.param == p) {
                    copy_in.push(CopySegment {
                        buffer: 0,
                        buffer_offset: r.param_offset,
                        packed_offset: r.offset,
                        len: r.numel,
                    });
                }
                let hi = copy_in.len() as u32;
                let slo = shard_runs.len() as u32;
                for r in plan.runs(final_op, rank as u32, BufferRole::Shard).filter(|r| r.param == p) {
                    shard_runs.push(ShardRun {
                        param_offset: r.param_offset,
                        numel: r.numel,
                        shard_offset: r.offset,
                    });
                }
                let shi = shard_runs.len() as u32;
                params[p.index()] = GradSlot { bucket: j as u32, copy_in: (lo, hi), shard_runs: (slo, shi) };
            }
            let in_reduce = |bytes: usize| bytes / param_elem.size() * elem.size();
            let gathered_bytes = in_reduce(b.gathered_bytes());
            let gaps = gaps(&copy_in[bucket_segments..], elem.size(), gathered_bytes);
            grad.push(GradTable {
                id: b.id(),
                elem,
                param_elem,
                gathered_bytes,
                shard_bytes: in_reduce(b.shard_bytes()),
                stages,
                params: b.params().to_vec(),
                gaps,
            });
        }
        Ok(GradTables { grad, params, copy_in, shard_runs, by_id })
    }

    /// Gradient bucket position of a bucket id.
    pub(crate) fn position(&self, id: BucketId) -> Option<usize> {
        match self.by_id.get(id.index()) {
            Some(&j) if j != u32::MAX => Some(j as usize),
            _ => None,
        }
    }
}

/// The byte ranges of `0..len` that no segment's packed range covers (`segments` count
/// elements of `elem_size` bytes).
fn gaps(segments: &[CopySegment], elem_size: usize, len: usize) -> Vec<(usize, usize)> {
    let mut covered: Vec<(usize, usize)> = segments
        .iter()
        .map(|s| (s.packed_offset * elem_size, (s.packed_offset + s.len) * elem_size))
        .collect();
    covered.sort_unstable();
    let mut out = Vec::new();
    let mut at = 0;
    for (lo, hi) in covered {
        if lo > at {
            out.push((at, lo.min(len)));
        }
        at = at.max(hi);
    }
    if at < len {
        out.push((at, len));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(packed_offset: usize, len: usize) -> CopySegment {
        CopySegment { buffer: 0, buffer_offset: 0, packed_offset, len }
    }

    #[test]
    fn gaps_are_the_uncovered_bytes() {
        assert_eq!(gaps(&[], 4, 12), vec![(0, 12)]);
        assert_eq!(gaps(&[seg(0, 3)], 4, 12), Vec::<(usize, usize)>::new());
        // Out of order, touching, overlapping, a hole in the middle and padding at the end.
        let segs = [seg(5, 2), seg(0, 2), seg(2, 1), seg(1, 1), seg(9, 1)];
        assert_eq!(gaps(&segs, 2, 24), vec![(6, 10), (14, 18), (20, 24)]);
    }
}
