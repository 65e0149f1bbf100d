//! One rank's side of the bench: its buffers, timed iterations, and the check of the results.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::{BenchOp, BenchPlan, BreakOnPanic, Printer, RankRow, RowExchange};
use crate::backend::{Backend, BackendError, CollDesc, Collective, InFlight, RankGroup, Stream};
use crate::kernels::ElemType;

/// A rank-dependent value, exact in every element type (a multiple of 1/8 below 32).
pub(super) fn value(rank: usize, i: usize) -> f32 {
    let h = (rank.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)) % 511;
    (h as f32 - 255.0) / 8.0
}

pub(super) fn encode_into(ty: ElemType, out: &mut Vec<u8>, v: impl Iterator<Item = f32>) {
    out.clear();
    for x in v {
        match ty {
            ElemType::F32 => out.extend_from_slice(&x.to_le_bytes()),
            ElemType::F16 => out.extend_from_slice(&f16::from_f32(x).to_le_bytes()),
            ElemType::BF16 => out.extend_from_slice(&bf16::from_f32(x).to_le_bytes()),
        }
    }
}

fn decode(ty: ElemType, b: &[u8]) -> impl Iterator<Item = f32> + '_ {
    b.chunks_exact(ty.size()).map(move |c| match ty {
        ElemType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        ElemType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
        ElemType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
    })
}

fn round(ty: ElemType, x: f32) -> f32 {
    match ty {
        ElemType::F32 => x,
        ElemType::F16 => f16::from_f32(x).to_f32(),
        ElemType::BF16 => bf16::from_f32(x).to_f32(),
    }
}

/// A copy kernel's op given to the collective bench (its engine is [`super::kernel`]).
fn kernel_op<B: Backend>(b: &B, plan: &BenchPlan) -> BackendError {
    BackendError::Unsupported {
        what: format!(
            "rank {}: --op {:?} is a copy kernel, which bench::kernel measures, not a collective",
            b.rank(),
            plan.op
        ),
    }
}

type Ops<B> = Vec<Collective<<B as Backend>::Buffer>>;

/// One rank's buffers and descriptions for one size: `coalesce` collectives.
fn make_ops<B: Backend>(
    b: &B,
    plan: &BenchPlan,
    size: usize,
    tensor_base: usize,
) -> Result<Ops<B>, BackendError> {
    let n = plan.ranks;
    let me = b.rank();
    let ty = plan.elem;
    let es = ty.size();
    let count = plan.count_per_tensor(size);
    let group = RankGroup::world(n);
    let mut host = Vec::new();
    let mut ops = Vec::with_capacity(plan.coalesce);
    for t in 0..plan.coalesce {
        let tag = (tensor_base + t) as u64;
        // Element indices are global over the coalesced tensors so every tensor differs.
        let base = t * count;
        let c = match plan.op {
            BenchOp::CopyIn | BenchOp::CopyOut => return Err(kernel_op(b, plan)),
            BenchOp::AllGather => {
                let mut output = b.alloc(n * count * es)?;
                encode_into(ty, &mut host, (0..count).map(|i| value(me, base + i)));
                b.write_from_host(&mut output, me * count * es, &host)?;
                Collective {
                    desc: CollDesc::all_gather(group.clone(), ty, count).with_tag(tag),
                    input: None,
                    output,
                }
            }
            BenchOp::ReduceScatter => {
                let mut input = b.alloc(n * count * es)?;
                encode_into(ty, &mut host, (0..n * count).map(|i| value(me, n * base + i)));
                b.write_from_host(&mut input, 0, &host)?;
                let output = b.alloc(count * es)?;
                let desc = CollDesc::reduce_scatter(group.clone(), ty, count).with_tag(tag);
                Collective { desc, input: Some(input), output }
            }
            BenchOp::AllReduce => {
                let mut input = b.alloc(count * es)?;
                encode_into(ty, &mut host, (0..count).map(|i| value(me, base + i)));
                b.write_from_host(&mut input, 0, &host)?;
                let output = b.alloc(count * es)?;
                Collective {
                    desc: CollDesc::all_reduce(group.clone(), ty, count).with_tag(tag),
                    input: Some(input),
                    output,
                }
            }
        };
        ops.push(c);
    }
    Ok(ops)
}

/// Counts wrong output elements of `ops` against the reference.
fn count_wrong<B: Backend>(b: &B, plan: &BenchPlan, ops: &Ops<B>) -> Result<u64, BackendError> {
    let n = plan.ranks;
    let me = b.rank();
    let ty = plan.elem;
    let mut wrong = 0u64;
    // Sum in f32 in rank order, rounded once: the reduction contract of `kernels::reduce`.
    let sum = |xs: &mut dyn Iterator<Item = f32>| round(ty, xs.fold(0.0f32, |acc, x| acc + x));
    for (t, c) in ops.iter().enumerate() {
        let count = c.desc.count;
        let base = t * count;
        let mut host = vec![0u8; c.desc.output_count() * ty.size()];
        b.read_to_host(&c.output, 0, &mut host)?;
        let got = decode(ty, &host);
        match plan.op {
            BenchOp::CopyIn | BenchOp::CopyOut => return Err(kernel_op(b, plan)),
            BenchOp::AllGather => {
                for (k, g) in got.enumerate() {
                    let (r, i) = (k / count.max(1), k % count.max(1));
                    wrong += u64::from(g.to_bits() != round(ty, value(r, base + i)).to_bits());
                }
            }
            BenchOp::ReduceScatter => {
                for (i, g) in got.enumerate() {
                    let want = sum(&mut (0..n).map(|r| value(r, n * base + me * count + i)));
                    wrong += u64::from(g.to_bits() != want.to_bits());
                }
            }
            BenchOp::AllReduce => {
                for (i, g) in got.enumerate() {
                    let want = sum(&mut (0..n).map(|r| value(r, base + i)));
                    wrong += u64::from(g.to_bits() != want.to_bits());
                }
            }
        }
    }
    Ok(wrong)
}

/// Launches one iteration: one group of every op, or one launch per op.
fn launch<B: Backend>(
    b: &B,
    stream: Stream,
    ops: Ops<B>,
    grouped: bool,
) -> Result<Vec<InFlight<B>>, BackendError> {
    if grouped {
        return Ok(vec![b.launch_group(stream, &[], ops).map_err(|e| e.error)?]);
    }
    ops.into_iter().map(|op| b.launch(stream, &[], op).map_err(|e| e.error)).collect()
}

fn finish<B: Backend>(flights: Vec<InFlight<B>>, timeout: Duration) -> Result<Ops<B>, BackendError> {
    let mut ops = Vec::new();
    for f in flights {
        ops.extend(f.wait(timeout).map_err(|e| e.into_error())?);
    }
    Ok(ops)
}

/// Runs `warmup + iters` iterations with `plan.inflight` in flight; returns seconds per timed
/// iteration and, of them, the seconds per iteration spent in the launch calls (the buffers of
/// the last iteration stay in `sets`).
fn time_iterations<B: Backend>(
    b: &B,
    plan: &BenchPlan,
    sets: &mut [Option<Ops<B>>],
    grouped: bool,
    collector: &dyn RowExchange,
) -> Result<(f64, f64), String> {
    let stream = match plan.op {
        BenchOp::AllGather => Stream::AllGather,
        _ => Stream::ReduceScatter,
    };
    let timeout = b.timeout();
    let depth = sets.len();
    let mut flights: Vec<Option<Vec<InFlight<B>>>> = (0..depth).map(|_| None).collect();
    // Returns the time spent in the launch calls.
    let mut run =
        |count: usize, flights: &mut Vec<Option<Vec<InFlight<B>>>>| -> Result<Duration, BackendError> {
            let mut launching = Duration::ZERO;
            for i in 0..count {
                let k = i % depth;
                if let Some(f) = flights[k].take() {
                    sets[k] = Some(finish(f, timeout)?);
                }
                let ops = sets[k].take().unwrap_or_default();
                let t0 = Instant::now();
                flights[k] = Some(launch(b, stream, ops, grouped)?);
                launching += t0.elapsed();
            }
            for k in 0..depth {
                if let Some(f) = flights[k].take() {
                    sets[k] = Some(finish(f, timeout)?);
                }
            }
            Ok(launching)
        };
    run(plan.warmup, &mut flights).map_err(|e| e.to_string())?;
    collector.exchange(b.rank(), RankRow::default())?;
    let start = Instant::now();
    let launching = run(plan.iters, &mut flights).map_err(|e| e.to_string())?;
    let total = start.elapsed().as_secs_f64();
    let n = plan.iters as f64;
    Ok((total / n, launching.as_secs_f64() / n))
}

/// A rank's whole bench as a world runs it on each rank: [`bench_rank`], printing on rank 0
/// through `printer`; a failure or a panic breaks `collector`, so no other rank waits for this
/// one.
///
/// # Errors
/// This rank's failure, or another rank's.
pub fn run_rank<B: Backend>(
    b: &B,
    plan: &BenchPlan,
    collector: &dyn RowExchange,
    printer: &Printer,
) -> Result<(), String> {
    guarded(b, plan, collector, &|i, rows: &[RankRow]| printer.row(plan.sizes[i], rows))
}

/// A rank's whole bench as [`run_rank`] runs it, the rows kept instead of printed: every
/// size's rows of every rank on rank 0 (empty elsewhere), for a caller that prints them later
/// beside other measurements.
///
/// # Errors
/// This rank's failure, or another rank's.
pub fn collect_rank<B: Backend>(
    b: &B,
    plan: &BenchPlan,
    collector: &dyn RowExchange,
) -> Result<Vec<Vec<RankRow>>, String> {
    let all = Mutex::new(vec![Vec::new(); plan.sizes.len()]);
    let record = |i: usize, rows: &[RankRow]| {
        if let Some(slot) = all.lock().unwrap_or_else(PoisonError::into_inner).get_mut(i) {
            *slot = rows.to_vec();
        }
    };
    guarded(b, plan, collector, &record)?;
    Ok(all.into_inner().unwrap_or_else(PoisonError::into_inner))
}

/// [`bench_rank`] with `collector` broken on a failure or a panic of this rank.
fn guarded<B: Backend>(
    b: &B,
    plan: &BenchPlan,
    collector: &dyn RowExchange,
    print: &(dyn Fn(usize, &[RankRow]) + Sync),
) -> Result<(), String> {
    let r = b.rank();
    let _guard = BreakOnPanic { collector, rank: r };
    let result = bench_rank(b, plan, collector, print);
    if let Err(e) = &result {
        collector.break_with(format!("rank {r}: {e}"));
    }
    result
}

/// One rank's whole bench: every size of `plan`, handing rows to `collector`; `print` is called
/// on rank 0 with every rank's row of size `i`.
///
/// # Errors
/// A backend failure, or another rank's (through the collector).
pub fn bench_rank<B: Backend>(
    b: &B,
    plan: &BenchPlan,
    collector: &dyn RowExchange,
    print: &(dyn Fn(usize, &[RankRow]) + Sync),
) -> Result<(), String> {
    let me = b.rank();
    let fail = |e: BackendError| e.to_string();
    for (i, &size) in plan.sizes.iter().enumerate() {
        let mut sets: Vec<Option<Ops<B>>> = Vec::with_capacity(plan.inflight);
        for k in 0..plan.inflight {
            sets.push(Some(make_ops(b, plan, size, k * plan.coalesce).map_err(fail)?));
        }
        let (grouped, launch) = time_iterations(b, plan, &mut sets, true, collector)?;
        let separate = if plan.coalesce > 1 {
            Some(time_iterations(b, plan, &mut sets, false, collector)?.0)
        } else {
            None
        };
        let mut wrong = 0;
        if plan.check {
            // Every run of iterations starts at set 0: a set ran only if some run had more
            // iterations than its index (`--iters 1 --warmup 1` never touches set 1).
            let used = plan.iters.max(plan.warmup).min(plan.inflight);
            for ops in sets.iter().take(used).flatten() {
                wrong += count_wrong(b, plan, ops).map_err(fail)?;
            }
        }
        // Buffers of this size are dropped (not pooled): the next size needs other ones.
        drop(sets);
        let rows = collector.exchange(me, RankRow { grouped, separate, wrong, launch })?;
        if me == 0 {
            print(i, &rows);
        }
    }
    Ok(())
}
