//! Measuring a cost profile on this machine (`collsched calibrate`): the measuring half; the
//! fit and the profile file are `collsched_topo::calibration`'s (pure code).
//!
//! Per rank, over any [`Backend`]:
//! - **each collective kind** (all-gather, reduce-scatter, all-reduce; f32, in place as
//!   `collsched bench` runs them) at every size of the spec, one collective in flight, so each
//!   time is one collective's from launch to completion, the slowest rank's mean over the timed
//!   iterations ([`crate::bench::collect_rank`]);
//! - **the launch cost**: the host time of one `Backend::launch` call (a 4 KiB all-gather per
//!   rank), this rank's mean;
//! - **the host cost per collective** of a training step: the demo's sharded run
//!   ([`crate::demo`]: one micro-batch per step, no evaluation, no freezing, the spec's bucket
//!   cap and trace-replay prefetch) on the same backend, its rank 0's step time less compute and
//!   waits, per collective launched ([`host_seconds_per_collective`]; the median over the steps
//!   after the first).
//!
//! Rank 0 then fits each kind ([`fit_profile`]) and writes the profile. Broadcast is not
//! measured (the bench engine has no broadcast); the simulator's even sharding never issues one.

use std::time::{Duration, Instant};

use collsched_topo::calibration::{fit_linear, CalibrationError, CollectiveFit};
use collsched_topo::{CollectiveKind, CostProfile};

use crate::backend::{Backend, CollDesc, Collective, RankGroup, Stream};
use crate::bench::{collect_rank, BenchOp, BenchPlan, BenchSpec, RankRow, RowExchange};
use crate::demo::StepCost;
use crate::kernels::ElemType;

/// The kinds `collsched calibrate` measures.
pub const KINDS: [BenchOp; 3] = [BenchOp::AllGather, BenchOp::ReduceScatter, BenchOp::AllReduce];

/// Elements per rank of the all-gather whose launch is timed (4 KiB of f32).
const LAUNCH_PROBE_COUNT: usize = 1024;

/// What to measure.
#[derive(Clone, Debug, PartialEq)]
pub struct CalibrateSpec {
    /// Ranks.
    pub ranks: usize,
    /// Smallest size (bytes of the whole buffer).
    pub min_bytes: usize,
    /// Largest size.
    pub max_bytes: usize,
    /// Factor between sizes.
    pub factor: usize,
    /// Timed iterations per size.
    pub iters: usize,
    /// Untimed iterations per size.
    pub warmup: usize,
    /// Timed launch calls.
    pub launch_iters: usize,
}

impl CalibrateSpec {
    /// The bench of `op` this spec runs: f32, unchecked, one collective in flight.
    ///
    /// # Errors
    /// A message naming the flag out of range (as `collsched bench` words it).
    pub fn plan(&self, op: BenchOp) -> Result<BenchPlan, String> {
        BenchPlan::new(&BenchSpec {
            op,
            ranks: self.ranks,
            elem: ElemType::F32,
            min_bytes: self.min_bytes,
            max_bytes: self.max_bytes,
            factor: self.factor,
            iters: self.iters,
            warmup: self.warmup,
            check: false,
            coalesce: 1,
            inflight: 1,
        })
        .map_err(|e| e.to_string())
    }
}

/// What rank 0 measured: per kind its `(bytes, seconds)` points, and the launch time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measured {
    /// Per kind, the slowest rank's seconds per collective at each size.
    pub points: Vec<(CollectiveKind, Vec<(f64, f64)>)>,
    /// Mean host seconds of one launch call, over the ranks.
    pub launch_s: f64,
}

/// The collective kind of a bench op.
pub fn kind_of(op: BenchOp) -> CollectiveKind {
    match op {
        BenchOp::AllGather => CollectiveKind::AllGather,
        BenchOp::ReduceScatter => CollectiveKind::ReduceScatter,
        BenchOp::AllReduce => CollectiveKind::AllReduce,
    }
}

/// This rank's part of the collective and launch measurements; rank 0 gets every rank's
/// results, the others `None`. Every rank of the world calls it with the same spec.
///
/// # Errors
/// A backend failure on this rank or another (through `rows`), as one line.
pub fn measure_rank<B: Backend>(
    b: &B,
    spec: &CalibrateSpec,
    rows: &dyn RowExchange,
) -> Result<Option<Measured>, String> {
    let mut measured = Measured::default();
    for op in KINDS {
        let plan = spec.plan(op)?;
        let table = collect_rank(b, &plan, rows)?;
        if b.rank() == 0 {
            let pts = plan
                .sizes
                .iter()
                .zip(&table)
                .map(|(&s, r)| (s as f64, r.iter().map(|r| r.grouped).fold(f64::NAN, f64::max)))
                .collect();
            measured.points.push((kind_of(op), pts));
        }
    }
    let mine = launch_seconds(b, spec.ranks, spec.launch_iters).map_err(|e| format!("rank {}: {e}", b.rank()))?;
    let all = rows.exchange(b.rank(), RankRow { grouped: mine, separate: None, wrong: 0 })?;
    if b.rank() != 0 {
        return Ok(None);
    }
    measured.launch_s = all.iter().map(|r| r.grouped).sum::<f64>() / all.len().max(1) as f64;
    Ok(Some(measured))
}

/// Mean host seconds of `iters` launch calls of a 4 KiB-per-rank all-gather (each waited for
/// before the next, untimed).
fn launch_seconds<B: Backend>(b: &B, ranks: usize, iters: usize) -> Result<f64, crate::backend::BackendError> {
    let bytes = ranks * LAUNCH_PROBE_COUNT * ElemType::F32.size();
    let mut output = Some(b.alloc(bytes)?);
    let mut total = Duration::ZERO;
    let iters = iters.max(1);
    for i in 0..iters {
        let Some(out) = output.take() else { break };
        let desc = CollDesc::all_gather(RankGroup::world(ranks), ElemType::F32, LAUNCH_PROBE_COUNT).with_tag(i as u64);
        let t0 = Instant::now();
        let flight = b.launch(Stream::AllGather, &[], Collective { desc, input: None, output: out });
        total += t0.elapsed();
        let done = flight.map_err(|e| e.error)?.wait(b.timeout()).map_err(|e| e.into_error())?;
        output = done.into_iter().next().map(|c| c.output);
    }
    Ok(total.as_secs_f64() / iters as f64)
}

/// Host seconds per collective launched of a run's steps (rank 0's): for each step after the
/// first (which records the prefetch trace), its wall time less compute, waits and evaluation,
/// over its collectives; the median of those. `None` without such a step or collective.
pub fn host_seconds_per_collective(cost: &[StepCost]) -> Option<f64> {
    let mut per: Vec<f64> = cost
        .iter()
        .skip(usize::from(cost.len() > 1))
        .filter(|c| c.collectives > 0)
        .map(|c| {
            let host = c.wall.as_secs_f64() - c.compute.as_secs_f64() - c.wait_time.as_secs_f64() - c.eval.as_secs_f64();
            host.max(0.0) / c.collectives as f64
        })
        .collect();
    if per.is_empty() {
        return None;
    }
    per.sort_by(f64::total_cmp);
    Some(per[per.len() / 2])
}

/// The profile of `measured` on `backend`: one fit per kind that can be fitted; the kinds that
/// cannot, with the reason (printed by the caller, left out of the profile).
pub fn fit_profile(
    backend: &str,
    ranks: usize,
    measured: &Measured,
    host_per_collective_s: Option<f64>,
) -> (CostProfile, Vec<CalibrationError>) {
    let mut profile = CostProfile::new(backend, ranks);
    profile.launch_s = measured.launch_s;
    profile.host_per_collective_s = host_per_collective_s;
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    profile.machine = format!("{cores} core(s)");
    let mut refused = Vec::new();
    for (kind, pts) in &measured.points {
        match fit_linear(&format!("{kind} on {ranks} ranks"), pts) {
            Ok(fit) => profile.collectives.push(CollectiveFit { kind: *kind, ranks, fit }),
            Err(e) => refused.push(e),
        }
    }
    (profile, refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(wall_ms: u64, compute_ms: u64, wait_ms: u64, collectives: u64) -> StepCost {
        StepCost {
            wall: Duration::from_millis(wall_ms),
            compute: Duration::from_millis(compute_ms),
            wait_time: Duration::from_millis(wait_ms),
            collectives,
            ..StepCost::default()
        }
    }

    #[test]
    fn host_per_collective_is_the_median_after_the_first_step() {
        // The first step (trace recording) is left out; medians of 1, 10, 2 ms per 10.
        let cost = [step(100, 0, 0, 1), step(13, 2, 1, 10), step(103, 2, 1, 10), step(23, 2, 1, 10)];
        let h = host_seconds_per_collective(&cost).unwrap();
        assert!((h - 2e-3).abs() < 1e-12, "{h}");
        assert_eq!(host_seconds_per_collective(&[]), None);
        assert_eq!(host_seconds_per_collective(&[step(1, 0, 0, 0), step(1, 0, 0, 0)]), None);
    }

    #[test]
    fn a_kind_that_cannot_be_fitted_is_left_out_with_its_reason() {
        let good: Vec<(f64, f64)> = [4096.0, 16384.0, 65536.0].iter().map(|&s| (s, 5e-6 + s * 1e-10)).collect();
        let flat = vec![(4096.0, 1e-4), (16384.0, 1e-4), (65536.0, 1e-4)];
        let m = Measured {
            points: vec![(CollectiveKind::AllGather, good), (CollectiveKind::ReduceScatter, flat)],
            launch_s: 1e-6,
        };
        let (p, refused) = fit_profile("local", 2, &m, Some(2e-5));
        assert_eq!(p.collectives.len(), 1);
        assert_eq!(p.collectives[0].kind, CollectiveKind::AllGather);
        assert_eq!(refused.len(), 1);
        assert!(refused[0].to_string().contains("reduce_scatter on 2 ranks"), "{}", refused[0]);
        assert_eq!(p.host_per_collective_s, Some(2e-5));
    }
}
