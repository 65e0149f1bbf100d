//! `collsched calibrate`: measure this machine's collective costs on a backend and write a cost
//! profile that `collsched sim --cost FILE` reads (what is measured: [`crate::calibrate`]; the
//! fit and the file format: `collsched_topo::calibration`).
//!
//! Output (rank 0), one table of every measured point beside its fit:
//! `kind ranks bytes measured_us fit_us residual`, then per kind one line `# KIND: fixed X us,
//! per byte Y ns (Z GB/s), max |residual| R%` or `# KIND: no fit: REASON` (the kind is then
//! left out of the profile), the launch and host costs, and the file written. The exit status
//! is 1 when no kind could be fitted.

use std::process::ExitCode;
use std::sync::Mutex;

use collsched_topo::CostProfile;

use super::bench::{parse_size, BenchBackend};
use super::launch::{self, LaunchRole};
use super::CliError;
use crate::backend::local::{LocalConfig, LocalWorld};
use crate::backend::shm::{self, ShmConfig};
use crate::bench::{Collector, ProcessRows};
use crate::calibrate::{fit_profile, host_seconds_per_collective, measure_rank, CalibrateSpec, Measured};
use crate::demo::{DemoConfig, ShardedOptions, ShardedRun};

/// Flags of `collsched calibrate`.
#[derive(Debug, Clone, clap::Args)]
pub struct CalibrateArgs {
    /// Backend measured: `local` (threads), `shm` (processes; alone it starts them), `mpi`
    /// (under mpirun; feature `mpi`) or `cuda` (one GPU per rank; feature `cuda`).
    #[arg(long, value_enum, default_value = "local")]
    pub backend: BenchBackend,
    /// Ranks (under torchrun or mpirun: the launcher's). Default 2.
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Smallest size of the whole buffer (`4K`, `1M`).
    #[arg(short = 'b', long = "minbytes", value_parser = parse_size, default_value = "4K")]
    pub min_bytes: usize,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", value_parser = parse_size, default_value = "1M")]
    pub max_bytes: usize,
    /// Factor between successive sizes (at least 2).
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    pub factor: usize,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    /// Untimed iterations per size before the timed ones.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Timed launch calls (the launch cost).
    #[arg(long, default_value_t = 200)]
    pub launch_iters: usize,
    /// Steps of the demo's training run that measures the host cost per collective; 0 leaves
    /// it out of the profile (`null`).
    #[arg(long, default_value_t = 20, value_name = "S")]
    pub demo_steps: usize,
    /// Bucket cap in KiB of that run.
    #[arg(long, default_value_t = 4.0, value_name = "KIB")]
    pub demo_bucket_kb: f64,
    /// Where to write the profile.
    #[arg(long, default_value = "cost-profile.json", value_name = "FILE.json")]
    pub out: std::path::PathBuf,
}

impl CalibrateArgs {
    fn spec(&self, ranks: usize) -> CalibrateSpec {
        CalibrateSpec {
            ranks,
            min_bytes: self.min_bytes,
            max_bytes: self.max_bytes,
            factor: self.factor,
            iters: self.iters,
            warmup: self.warmup,
            launch_iters: self.launch_iters,
        }
    }

    /// The demo run that measures the host cost, or `None` with `--demo-steps 0`.
    fn demo(&self, ranks: usize) -> Result<Option<(DemoConfig, ShardedOptions)>, CliError> {
        if self.demo_steps == 0 {
            return Ok(None);
        }
        if !(self.demo_bucket_kb.is_finite() && self.demo_bucket_kb > 0.0 && self.demo_bucket_kb <= 1e9) {
            return Err(
                format!("--demo-bucket-kb {}: give a positive number of KiB", self.demo_bucket_kb).into()
            );
        }
        let mut cfg = DemoConfig::standard(ranks, self.demo_steps.min(super::demo::MAX_STEPS), 1);
        cfg.micro_batches = 1;
        cfg.eval_every = 0;
        cfg.freeze = None;
        let bucket_bytes = ((self.demo_bucket_kb * 1024.0).round() as usize).max(1);
        Ok(Some((cfg, ShardedOptions { bucket_bytes, ..ShardedOptions::default() })))
    }

    /// Checks the flags before any rank starts.
    fn check(&self, ranks: usize) -> Result<(), CliError> {
        if ranks < 2 {
            return Err(
                format!("--ranks {ranks}: a collective needs at least 2 ranks to cost anything").into()
            );
        }
        if ranks > super::demo::MAX_RANKS {
            return Err(format!("--ranks {ranks} is above the limit of {}", super::demo::MAX_RANKS).into());
        }
        let spec = self.spec(ranks);
        for (op, _) in crate::calibrate::KINDS {
            spec.plan(op)?;
        }
        self.demo(ranks)?;
        Ok(())
    }
}

/// Runs `collsched calibrate`.
///
/// # Errors
/// Bad flags, a backend failure, a backend this build lacks (`mpi`, `cuda`) or that has no
/// device, an unwritable `--out`, or no collective kind that could be fitted; one line each.
pub fn run(args: CalibrateArgs) -> Result<ExitCode, CliError> {
    match args.backend {
        BenchBackend::Local => {
            let ranks = args.ranks.unwrap_or(2);
            args.check(ranks)?;
            let world = LocalWorld::with_config(ranks, LocalConfig::default())?;
            let collector = Collector::new(ranks);
            let spec = args.spec(ranks);
            let measured = first_measured(world.run(|rank| measure_rank(&rank, &spec, &collector))?)?;
            drop(world);
            let run = match args.demo(ranks)? {
                Some((cfg, opts)) => Some(crate::demo::sharded_run(&cfg, &opts)?),
                None => None,
            };
            finish(&args, "local", ranks, &measured, run.as_ref())
        }
        BenchBackend::Shm => {
            match launch::role(Some(args.ranks.unwrap_or(2)).filter(|_| !launch::launched()))? {
                LaunchRole::Standalone(n) => {
                    args.check(n)?;
                    launch::standalone(n)
                }
                LaunchRole::Rank(env) => {
                    args.check(env.world)?;
                    let (rank, hub) = shm::join(&env, &ShmConfig::from_env()?)?;
                    let rows = ProcessRows(Mutex::new(hub));
                    let measured = measure_rank(&rank, &args.spec(env.world), &rows)?;
                    let mut hub =
                        rows.0.into_inner().map_err(|_| "the job's exchange was poisoned by a panic")?;
                    let run = match args.demo(env.world)? {
                        Some((cfg, opts)) => crate::demo::sharded_run_process(&cfg, &opts, rank, &mut hub)?,
                        None => None,
                    };
                    match measured {
                        Some(m) => finish(&args, "shm", env.world, &m, run.as_ref()),
                        None => Ok(ExitCode::SUCCESS),
                    }
                }
            }
        }
        BenchBackend::Mpi => run_mpi(&args),
        BenchBackend::Cuda => run_cuda(&args),
    }
}

/// Rank 0's measurements out of a world's outcomes, or the first failure.
fn first_measured(
    outcomes: Vec<std::thread::Result<Result<Option<Measured>, String>>>,
) -> Result<Measured, CliError> {
    let mut first = None;
    for (r, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(Ok(m)) => first = first.or(m),
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(format!("rank {r} panicked").into()),
        }
    }
    first.ok_or_else(|| "rank 0 returned no measurement (a bug; please report it)".into())
}

#[cfg(feature = "mpi")]
fn run_mpi(args: &CalibrateArgs) -> Result<ExitCode, CliError> {
    use crate::backend::mpi::{self, MpiConfig};
    let (rank, job) = mpi::join(&MpiConfig::from_env()?)?;
    let world = job.world();
    if args.ranks.is_some_and(|n| n != world) {
        return Err(format!(
            "--ranks {} differs from the MPI job's {world} processes",
            args.ranks.unwrap_or(0)
        )
        .into());
    }
    args.check(world)?;
    let rows = ProcessRows(Mutex::new(job));
    let measured = measure_rank(&rank, &args.spec(world), &rows)?;
    let mut job = rows.0.into_inner().map_err(|_| "the job's exchange was poisoned by a panic")?;
    let run = match args.demo(world)? {
        Some((cfg, opts)) => crate::demo::sharded_run_process(&cfg, &opts, rank, &mut job)?,
        None => None,
    };
    drop(job);
    match measured {
        Some(m) => finish(args, "mpi", world, &m, run.as_ref()),
        None => Ok(ExitCode::SUCCESS),
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &CalibrateArgs) -> Result<ExitCode, CliError> {
    Err(super::bench::NO_MPI.replace("--backend mpi", "collsched calibrate --backend mpi").into())
}

#[cfg(feature = "cuda")]
fn run_cuda(args: &CalibrateArgs) -> Result<ExitCode, CliError> {
    let ranks = args.ranks.unwrap_or(2);
    args.check(ranks)?;
    let world = crate::backend::cuda::CudaWorld::new(ranks)
        .map_err(|e| format!("collsched calibrate --backend cuda: {e} (it needs one GPU per rank)"))?;
    let collector = Collector::new(ranks);
    let spec = args.spec(ranks);
    let measured = first_measured(world.run(|b| measure_rank(&b, &spec, &collector))?)?;
    drop(world);
    let run = match args.demo(ranks)? {
        Some((cfg, opts)) => Some(crate::demo::sharded_run_cuda(&cfg, &opts)?),
        None => None,
    };
    finish(args, "cuda", ranks, &measured, run.as_ref())
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &CalibrateArgs) -> Result<ExitCode, CliError> {
    Err("collsched calibrate --backend cuda: this collsched was built without the `cuda` feature; rebuild with \
         `cargo build --release --features cuda` on a machine with one GPU per rank, or calibrate --backend local or shm"
        .into())
}

/// Rank 0: fits, prints the table, writes the profile.
fn finish(
    args: &CalibrateArgs,
    backend: &str,
    ranks: usize,
    measured: &Measured,
    run: Option<&ShardedRun>,
) -> Result<ExitCode, CliError> {
    let host = run.and_then(|r| host_seconds_per_collective(&r.cost));
    let (profile, refused) = fit_profile(backend, ranks, measured, host);
    print_table(args, &profile, measured, &refused, run);
    if profile.collectives.is_empty() {
        return Err("no collective kind could be fitted (see the lines above); nothing written".into());
    }
    std::fs::write(&args.out, profile.to_json() + "\n")
        .map_err(|e| format!("--out {}: {e}", args.out.display()))?;
    println!("# wrote {} (collsched sim --cost {} ...)", args.out.display(), args.out.display());
    Ok(ExitCode::SUCCESS)
}

fn print_table(
    args: &CalibrateArgs,
    profile: &CostProfile,
    measured: &Measured,
    refused: &[collsched_topo::CalibrationError],
    run: Option<&ShardedRun>,
) {
    println!(
        "# collsched calibrate: backend {}, {} ranks, {}; sizes {}..{} x{}, {} timed iterations each (after {}), one collective in flight",
        profile.backend, profile.ranks, profile.machine, args.min_bytes, args.max_bytes, args.factor, args.iters, args.warmup
    );
    println!(
        "# {:<15} {:>5} {:>10} {:>12} {:>12} {:>9}",
        "kind", "ranks", "bytes", "measured_us", "fit_us", "residual"
    );
    for (kind, pts) in &measured.points {
        let fit = profile.collectives.iter().find(|c| c.kind == *kind);
        for &(bytes, secs) in pts {
            let (fit_us, res) = match fit {
                Some(c) => {
                    let f = c.fit.time(bytes);
                    (format!("{:.2}", f * 1e6), format!("{:+.1}%", (f - secs) / secs * 100.0))
                }
                None => ("-".to_owned(), "-".to_owned()),
            };
            println!(
                "  {:<15} {:>5} {:>10} {:>12.2} {:>12} {:>9}",
                kind.name(),
                profile.ranks,
                bytes,
                secs * 1e6,
                fit_us,
                res
            );
        }
    }
    for c in profile.collectives.iter().filter(|c| c.fit.latency_only()) {
        println!(
            "# {}: latency only: fixed {:.2} us; the time does not grow with the size over these sizes (max \
             |residual| {:.1}%), the bandwidth is beyond what they show",
            c.kind,
            c.fit.fixed_s * 1e6,
            c.fit.max_residual() * 100.0
        );
    }
    for c in profile.collectives.iter().filter(|c| !c.fit.latency_only()) {
        println!(
            "# {}: fixed {:.2} us, per byte {:.4} ns ({:.2} GB/s of the whole buffer), max |residual| {:.1}%",
            c.kind,
            c.fit.fixed_s * 1e6,
            c.fit.per_byte_s * 1e9,
            c.fit.bandwidth_gbs(),
            c.fit.max_residual() * 100.0
        );
    }
    for e in refused {
        println!("# no fit: {e}");
    }
    println!("# launch: {:.2} us per launch call (host time, mean of the ranks)", profile.launch_s * 1e6);
    let opt = |x: Option<f64>, digits: usize| {
        x.map_or_else(|| "not measured".to_owned(), |v| format!("{v:.digits$}"))
    };
    println!(
        "# sharing: compute_slowdown {} (a compute burst with every rank computing / with rank 0 alone); compute_overlap {} \
         (the fraction of collective time hidden behind compute)",
        opt(profile.compute_slowdown, 2),
        opt(profile.compute_overlap, 2)
    );
    match (profile.host_per_collective_s, run) {
        (Some(h), Some(r)) => println!(
            "# host: {:.2} us per collective launched (the demo's training step on {}, {} steps, median after the first; {} collectives a step)",
            h * 1e6,
            profile.backend,
            r.cost.len(),
            r.cost.last().map_or(0, |c| c.collectives)
        ),
        _ => println!("# host: not measured (--demo-steps 0, or no step after the first); the profile says null"),
    }
}
