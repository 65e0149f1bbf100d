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
//! - **how compute shares the machine**: a compute burst (dependent multiply-adds) timed with
//!   rank 0 alone and with every rank at once, each from a barrier to the next (their ratio:
//!   `compute_slowdown`, rank 0's, from bursts 8 times as long as the next probe's; medians of
//!   3), and 64 all-gathers of 4 KiB per rank timed alone and launched just
//!   before a burst as long as they take (`compute_overlap`,
//!   `collsched_topo::calibration::overlap_fraction`); medians of 9.
//!
//! Rank 0 then fits each kind ([`fit_profile`]) and writes the profile. Broadcast is not
//! measured (the bench engine has no broadcast); the simulator's even sharding never issues one.

use std::time::{Duration, Instant};

use collsched_topo::calibration::{fit_latency_only, fit_linear, CalibrationError, CollectiveFit};
use collsched_topo::{CollectiveKind, CostProfile};

use crate::backend::{Backend, CollDesc, Collective, RankGroup, Stream};
use crate::bench::{collect_rank, BenchOp, BenchPlan, BenchSpec, RankRow, RowExchange};
use crate::demo::StepCost;
use crate::kernels::ElemType;

/// The kinds `collsched calibrate` measures, each with the bench op that times it.
pub const KINDS: [(BenchOp, CollectiveKind); 3] = [
    (BenchOp::AllGather, CollectiveKind::AllGather),
    (BenchOp::ReduceScatter, CollectiveKind::ReduceScatter),
    (BenchOp::AllReduce, CollectiveKind::AllReduce),
];

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

/// What rank 0 measured: per kind its `(bytes, seconds)` points, the launch time, and how
/// compute shares the machine.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measured {
    /// Per kind, the slowest rank's seconds per collective at each size.
    pub points: Vec<(CollectiveKind, Vec<(f64, f64)>)>,
    /// Mean host seconds of one launch call, over the ranks.
    pub launch_s: f64,
    /// A compute burst's time with every rank computing over its time with rank 0 alone (as
    /// rank 0 sees them: from a barrier to the next, all ranks done); `None` when not
    /// measurable.
    pub compute_slowdown: Option<f64>,
    /// The fraction of collective time hidden behind compute (mean over the ranks;
    /// [`collsched_topo::calibration::overlap_fraction`]); `None` when not measurable.
    pub compute_overlap: Option<f64>,
}

/// Collectives launched back to back in the overlap probe.
const OVERLAP_COLLECTIVES: usize = 64;
/// Elements per rank of each of them (16 KiB of f32 gathered on 4 ranks).
const OVERLAP_COUNT: usize = 1024;
/// Repetitions of each overlap measurement (the median is kept).
const OVERLAP_REPEATS: usize = 9;

/// A compute burst: `iters` dependent multiply-adds (a core busy, no memory traffic).
fn burn(iters: u64) -> f64 {
    let mut x = 1.0f64;
    for _ in 0..iters {
        x = std::hint::black_box(x * 1.000_000_1 + 1e-9);
    }
    x
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// How compute shares this machine with the other ranks and with collectives, this rank's
/// view: `(burst with every rank computing, compute slowdown, overlap fraction)`. Every rank
/// calls it; `rows` is its barrier.
fn measure_sharing<B: Backend>(
    b: &B,
    ranks: usize,
    rows: &dyn RowExchange,
) -> Result<(f64, f64, f64), String> {
    let me = b.rank();
    let barrier = || rows.exchange(me, RankRow::default()).map(drop);
    let fail = |e: crate::backend::BackendError| format!("rank {me}: {e}");
    let bytes = ranks * OVERLAP_COUNT * ElemType::F32.size();
    let mut bufs =
        (0..OVERLAP_COLLECTIVES).map(|_| b.alloc(bytes)).collect::<Result<Vec<_>, _>>().map_err(fail)?;
    let mut tag = 1u64 << 40;
    // Launches every buffer's all-gather, runs `work` meanwhile, waits for all: seconds.
    let mut collectives = |bufs: &mut Vec<B::Buffer>, work: &dyn Fn()| -> Result<f64, String> {
        let t0 = Instant::now();
        let mut flights = Vec::with_capacity(bufs.len());
        for out in bufs.drain(..) {
            tag += 1;
            let desc =
                CollDesc::all_gather(RankGroup::world(ranks), ElemType::F32, OVERLAP_COUNT).with_tag(tag);
            flights.push(
                b.launch(Stream::AllGather, &[], Collective { desc, input: None, output: out })
                    .map_err(|e| fail(e.error))?,
            );
        }
        work();
        for f in flights {
            bufs.extend(f.wait(b.timeout()).map_err(|e| fail(e.into_error()))?.into_iter().map(|c| c.output));
        }
        Ok(t0.elapsed().as_secs_f64())
    };
    let mut comm = Vec::new();
    for _ in 0..OVERLAP_REPEATS {
        barrier()?;
        comm.push(collectives(&mut bufs, &|| ())?);
    }
    let comm = median(comm);
    // A burst as long as the collectives: the most overlap there can be.
    let probe = 20_000u64;
    let t0 = Instant::now();
    std::hint::black_box(burn(probe));
    let per_iter = t0.elapsed().as_secs_f64().max(1e-9) / probe as f64;
    let mine = ((comm / per_iter) as u64).clamp(1000, 1 << 32);
    // Every rank burns the same work: the longest any rank asks for.
    let asks = rows.exchange(me, RankRow { grouped: mine as f64, ..RankRow::default() })?;
    let iters = asks.iter().map(|r| r.grouped as u64).max().unwrap_or(mine).max(mine);
    // Bursts are timed from one barrier to the next (less an empty round), so a burst that
    // waits for a core counts: the ranks' bursts may run one after another without any one of
    // them being slowed.
    let round = |work: &dyn Fn()| -> Result<f64, String> {
        barrier()?;
        let t0 = Instant::now();
        work();
        barrier()?;
        Ok(t0.elapsed().as_secs_f64())
    };
    let mut empty = Vec::new();
    let mut all = Vec::new();
    for _ in 0..OVERLAP_REPEATS {
        empty.push(round(&|| ())?);
        all.push(round(&|| {
            std::hint::black_box(burn(iters));
        })?);
    }
    let empty = median(empty);
    let all = (median(all) - empty).max(1e-9);
    // The slowdown from bursts 8 times as long, so that ranks leaving a barrier a little apart
    // (or a scheduler running whole bursts one after another) weigh little.
    let long = iters.saturating_mul(8);
    let (mut alone_long, mut all_long) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        alone_long.push(round(&|| {
            if me == 0 {
                std::hint::black_box(burn(long));
            }
        })?);
        all_long.push(round(&|| {
            std::hint::black_box(burn(long));
        })?);
    }
    let slow = (median(all_long) - empty).max(1e-9) / (median(alone_long) - empty).max(1e-9);
    let mut both = Vec::new();
    for _ in 0..OVERLAP_REPEATS {
        barrier()?;
        both.push(collectives(&mut bufs, &|| {
            std::hint::black_box(burn(iters));
        })?);
    }
    let both = median(both);
    let phi = collsched_topo::calibration::overlap_fraction(all, comm, both).unwrap_or(f64::NAN);
    Ok((all, slow, phi))
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
    for (op, kind) in KINDS {
        let plan = spec.plan(op)?;
        let table = collect_rank(b, &plan, rows)?;
        if b.rank() == 0 {
            let pts = plan
                .sizes
                .iter()
                .zip(&table)
                .map(|(&s, r)| (s as f64, r.iter().map(|r| r.grouped).fold(f64::NAN, f64::max)))
                .collect();
            measured.points.push((kind, pts));
        }
    }
    let mine =
        launch_seconds(b, spec.ranks, spec.launch_iters).map_err(|e| format!("rank {}: {e}", b.rank()))?;
    let all = rows.exchange(b.rank(), RankRow { grouped: mine, ..RankRow::default() })?;
    let (busy, slowdown, phi) = measure_sharing(b, spec.ranks, rows)?;
    let sharing =
        rows.exchange(b.rank(), RankRow { grouped: busy, separate: Some(phi), ..RankRow::default() })?;
    if b.rank() != 0 {
        return Ok(None);
    }
    let n = all.len().max(1) as f64;
    measured.launch_s = all.iter().map(|r| r.grouped).sum::<f64>() / n;
    let mean = |f: &dyn Fn(&RankRow) -> f64| sharing.iter().map(f).sum::<f64>() / sharing.len().max(1) as f64;
    measured.compute_slowdown = (slowdown.is_finite() && slowdown > 0.0).then_some(slowdown.max(1.0));
    let overlap = mean(&|r| r.separate.unwrap_or(f64::NAN));
    measured.compute_overlap = overlap.is_finite().then_some(overlap.clamp(0.0, 1.0));
    Ok(Some(measured))
}

/// Mean host seconds of `iters` launch calls of a 4 KiB-per-rank all-gather (each waited for
/// before the next, untimed).
fn launch_seconds<B: Backend>(
    b: &B,
    ranks: usize,
    iters: usize,
) -> Result<f64, crate::backend::BackendError> {
    let bytes = ranks * LAUNCH_PROBE_COUNT * ElemType::F32.size();
    let mut output = Some(b.alloc(bytes)?);
    let mut total = Duration::ZERO;
    let iters = iters.max(1);
    for i in 0..iters {
        let Some(out) = output.take() else { break };
        let desc = CollDesc::all_gather(RankGroup::world(ranks), ElemType::F32, LAUNCH_PROBE_COUNT)
            .with_tag(i as u64);
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
            let host = c.wall.as_secs_f64()
                - c.compute.as_secs_f64()
                - c.wait_time.as_secs_f64()
                - c.eval.as_secs_f64();
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
    profile.compute_slowdown = measured.compute_slowdown;
    profile.compute_overlap = measured.compute_overlap;
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    profile.machine = format!("{cores} core(s)");
    let mut refused = Vec::new();
    for (kind, pts) in &measured.points {
        // A kind whose time is flat over the sizes is priced by its latency alone.
        let fit = match fit_linear(&format!("{kind} on {ranks} ranks"), pts) {
            Err(e @ CalibrationError::AbsurdBandwidth { .. }) => fit_latency_only(pts).ok_or(e),
            other => other,
        };
        match fit {
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

    /// A sloped all-gather (5 us + 0.1 ns/B) and a reduce-scatter of `reduce_scatter`'s points.
    fn measured(reduce_scatter: Vec<(f64, f64)>) -> Measured {
        let good: Vec<(f64, f64)> =
            [4096.0, 16384.0, 65536.0].iter().map(|&s| (s, 5e-6 + s * 1e-10)).collect();
        Measured {
            points: vec![(CollectiveKind::AllGather, good), (CollectiveKind::ReduceScatter, reduce_scatter)],
            launch_s: 1e-6,
            ..Measured::default()
        }
    }

    #[test]
    fn a_flat_kind_is_priced_by_its_latency_alone() {
        let m = measured(vec![(4096.0, 2e-4), (16384.0, 2.1e-4), (65536.0, 1.9e-4)]);
        let (p, refused) = fit_profile("local", 2, &m, None);
        assert!(refused.is_empty(), "{refused:?}");
        let kinds: Vec<_> = p.collectives.iter().map(|c| (c.kind, c.fit.latency_only())).collect();
        assert_eq!(kinds, [(CollectiveKind::AllGather, false), (CollectiveKind::ReduceScatter, true)]);
        let rs = &p.collectives[1].fit;
        assert!((rs.fixed_s - 2e-4).abs() < 1e-5 && rs.max_residual() < 0.06, "{rs:?}");
    }

    #[test]
    fn a_kind_that_cannot_be_fitted_is_left_out_with_its_reason() {
        // Falling by half over the sizes: no slope, and no flat line within a quarter.
        let m = measured(vec![(4096.0, 2e-4), (16384.0, 1.5e-4), (65536.0, 1e-4)]);
        let (p, refused) = fit_profile("local", 2, &m, Some(2e-5));
        assert_eq!(p.collectives.len(), 1);
        assert_eq!(p.collectives[0].kind, CollectiveKind::AllGather);
        assert_eq!(refused.len(), 1);
        assert!(refused[0].to_string().contains("reduce_scatter on 2 ranks"), "{}", refused[0]);
        assert_eq!(p.host_per_collective_s, Some(2e-5));
    }
}
