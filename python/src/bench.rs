//! `bench`: the collective bench of `collsched bench --backend local` (or `cuda`), returning
//! its rows.

use std::sync::Mutex;

use collsched::backend::local::{LocalConfig, LocalWorld};
use collsched::backend::Backend;
use collsched::bench::{
    bench_rank, first_failure, memcpy_bandwidth, BenchOp, BenchPlan, BenchSpec, Collector,
};
use collsched::kernels::ElemType;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors;

/// One size: bytes, the slowest rank's seconds (grouped, separate), wrong elements.
type Row = (usize, f64, Option<f64>, u64);

/// Measures `op` ("all_gather", "reduce_scatter", "all_reduce") over `ranks` threads of this
/// process, as `collsched bench` does, on `backend`: "local" (threads over host memory) or
/// "cuda" (a thread per GPU, NCCL on the library's streams; a build with the cuda feature): one dict per size with `bytes`,
/// `elements`, `time_us` (the slowest rank's), `algbw` and `busbw` (GB/s, nccl-tests'
/// definitions), `wrong` (with `check`), `memcpy` (this machine's single-thread copy, GB/s,
/// at the largest size: what the table compares with), and `sep_time_us` with `coalesce > 1`.
#[pyfunction]
#[pyo3(signature = (op, ranks, min_bytes=32<<20, max_bytes=32<<20, factor=2, dtype="f32", iters=20, warmup=5, check=false, coalesce=1, inflight=2, backend="local"))]
#[allow(clippy::too_many_arguments)]
pub fn bench<'py>(
    py: Python<'py>,
    op: &str,
    ranks: usize,
    min_bytes: usize,
    max_bytes: usize,
    factor: usize,
    dtype: &str,
    iters: usize,
    warmup: usize,
    check: bool,
    coalesce: usize,
    inflight: usize,
    backend: &str,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    let op = match op {
        "all_gather" => BenchOp::AllGather,
        "reduce_scatter" => BenchOp::ReduceScatter,
        "all_reduce" => BenchOp::AllReduce,
        other => {
            return Err(errors::other(format!(
                "bench: op {other:?}; expected \"all_gather\", \"reduce_scatter\" or \"all_reduce\""
            )))
        }
    };
    let elem = match dtype {
        "f32" => ElemType::F32,
        "bf16" => ElemType::BF16,
        "f16" => ElemType::F16,
        other => {
            return Err(errors::other(format!(
                "bench: dtype {other:?}; expected \"f32\", \"bf16\" or \"f16\""
            )))
        }
    };
    let spec =
        BenchSpec { op, ranks, elem, min_bytes, max_bytes, factor, iters, warmup, check, coalesce, inflight };
    let plan = BenchPlan::new(&spec).map_err(errors::other)?;
    if let Some(available) = collsched::units::memory_available() {
        plan.check_memory(available).map_err(errors::other)?;
    }
    let collector = Collector::new(plan.ranks);
    let rows: Mutex<Vec<Row>> = Mutex::new(Vec::new());
    let record = |i: usize, r: &[collsched::bench::RankRow]| {
        let slowest = r.iter().map(|x| x.grouped).fold(0.0, f64::max);
        let sep = r.iter().filter_map(|x| x.separate).reduce(f64::max);
        let wrong = r.iter().map(|x| x.wrong).sum();
        rows.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((
            plan.sizes[i],
            slowest,
            sep,
            wrong,
        ));
    };
    // One rank's run; a failure breaks the others' waits.
    let body = |rank: usize, r: Result<(), String>| {
        if let Err(e) = &r {
            collector.break_with(format!("rank {rank}: {e}"));
        }
        r
    };
    let outcomes = match backend {
        "local" => {
            let world =
                LocalWorld::with_config(plan.ranks, LocalConfig::default()).map_err(errors::backend)?;
            world
                .run(|rank| body(rank.rank(), bench_rank(&rank, &plan, &collector, &record)))
                .map_err(errors::backend)?
        }
        #[cfg(feature = "cuda")]
        "cuda" => {
            let world = collsched::backend::cuda::CudaWorld::new(plan.ranks).map_err(errors::other)?;
            world
                .run(|rank| body(rank.rank(), bench_rank(&rank, &plan, &collector, &record)))
                .map_err(errors::other)?
        }
        other => {
            return Err(errors::other(format!(
                "bench: backend {other:?}; expected \"local\"{}",
                if cfg!(feature = "cuda") { " or \"cuda\"" } else { " (this build has no cuda backend)" }
            )))
        }
    };
    first_failure(outcomes).map_err(errors::other)?;
    let memcpy = memcpy_bandwidth(plan.sizes.last().copied().unwrap_or(0)) / 1e9;
    let rows = rows.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    rows.into_iter()
        .map(|(bytes, t, sep, wrong)| {
            let d = PyDict::new(py);
            let algbw = bytes as f64 / t / 1e9;
            d.set_item("bytes", bytes)?;
            d.set_item("elements", bytes / elem.size())?;
            d.set_item("time_us", t * 1e6)?;
            d.set_item("algbw", algbw)?;
            d.set_item("busbw", algbw * plan.bus_factor())?;
            d.set_item("wrong", if check { Some(wrong) } else { None })?;
            d.set_item("memcpy", memcpy)?;
            d.set_item("sep_time_us", sep.map(|s| s * 1e6))?;
            Ok(d)
        })
        .collect()
}
