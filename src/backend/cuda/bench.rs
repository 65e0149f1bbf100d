//! `collsched bench --backend cuda`: the CLI's backend-generic bench ([`bench_rank`]) on a
//! [`CudaWorld`], one thread per GPU, printing the same nccl-tests columns as `--backend local`.
//!
//! `crate::cli::bench::run_cuda` calls [`run`] (wiring left to the CLI's owner).

use std::process::ExitCode;

use super::CudaWorld;
use crate::backend::Backend;
use crate::cli::bench::{bench_rank, memcpy_bandwidth, BenchPlan, Collector, Printer, RankRow};
use crate::cli::CliError;

/// Runs the bench of `plan` on `plan.ranks` GPUs of this process.
///
/// # Errors
/// `no CUDA driver found: ...` (and the like) before anything is printed; a rank's failure.
pub fn run(plan: &BenchPlan) -> Result<ExitCode, CliError> {
    let world = CudaWorld::new(plan.ranks)?;
    let largest = plan.sizes.last().copied().unwrap_or(0);
    let printer = Printer::new(plan, "cuda", memcpy_bandwidth(largest));
    printer.header();
    let collector = Collector::new(plan.ranks);
    let outcomes = world.run(|b| {
        let r = b.rank();
        let result =
            bench_rank(&b, plan, &collector, &|i, rows: &[RankRow]| printer.row(plan.sizes[i], rows));
        if let Err(e) = &result {
            collector.break_with(format!("rank {r}: {e}"));
        }
        result
    })?;
    for (r, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(format!("rank {r} panicked").into()),
        }
    }
    Ok(printer.footer())
}
