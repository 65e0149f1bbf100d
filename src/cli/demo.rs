//! `collsched demo`: trains the demo model sharded over local ranks and, in the same process,
//! unsharded on one thread, prints both loss curves, and checks parity.
//!
//! The last line is `parity: max |loss difference| = X over S steps`; the exit status is
//! non-zero when the losses or the final parameters differ by more than the tolerance. That is
//! 0 (bit-identical) on the CPU backends (`local`, `shm`, `mpi`) for every strategy: the
//! reference sums the ranks' gradients in the order the plan reduces them (for `hybrid:G`
//! within each group, then across the groups; see [`crate::demo::reference_run`]), with the
//! kernels the backends reduce with. `--backend cuda` (feature `cuda`, one GPU per rank) is
//! held to 0 where every stage of the reduction adds at most two ranks' values (NCCL computes
//! `a + b` once, as the reference does), and to [`REORDERED_SUM_TOLERANCE`] elsewhere, where
//! NCCL's ring or tree sums in an order of its own.
//!
//! `--record-out FILE.json` writes what the sharded run produced (per-step losses, evaluation
//! losses, final parameters) with the settings that produced it, for a check outside the
//! program: the tests compare it with a reference that shares no code with the library.

use std::process::ExitCode;
use std::time::Instant;

use collsched_buckets::Sharding;
use collsched_schedule::PolicyKind;

use super::bench::BenchBackend;
use super::launch::{self, LaunchRole};
use super::CliError;
use crate::backend::shm::{self, ShmConfig};
use crate::demo::{
    max_differences, reference_run, sharded_run, sharded_run_process, sum_group, DemoConfig, RunRecord,
    ShardedOptions,
};

/// Most ranks `collsched demo` runs.
pub const MAX_RANKS: usize = 256;
/// Most steps `collsched demo` runs.
pub const MAX_STEPS: usize = 100_000;

/// Most micro-batches per step `collsched demo` runs.
pub const MAX_MICRO_BATCHES: usize = 1024;

/// Largest difference (absolute, on every loss and every final parameter; both are O(0.1..1))
/// accepted where the backend sums the ranks' gradients in an order other than the
/// reference's: `--backend cuda` where a reduction stage adds more than two ranks' values.
/// Such a reordering changes a sum in its last bit, now and then, and training carries that
/// along without amplifying it: the same reordering on the CPU (`hybrid:2` on 4 ranks and
/// `hybrid:4` on 8, checked against a reference that sums in plain rank order) differs by at
/// most 6e-8 on the losses and 3e-7 on the parameters after 1000 steps of the demo's model.
pub const REORDERED_SUM_TOLERANCE: f32 = 1e-5;

/// `format` of the file `--record-out` writes.
pub const RECORD_FORMAT: &str = "collsched-demo-record";
/// `version` of the file `--record-out` writes.
pub const RECORD_VERSION: u32 = 1;

/// Flags of `collsched demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Ranks: threads (`local`), GPUs (`cuda`) or processes (`shm`; under torchrun or mpirun
    /// the launcher's world size; `mpi`: the MPI job's). Default 4.
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 12)]
    pub steps: usize,
    /// Sharding strategy: even, flat, greedy or hybrid:G.
    #[arg(long, default_value = "even")]
    pub strategy: Sharding,
    /// Seed of the initial parameters and the data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Prefetch policy: none or trace (record the first step's order, replay it).
    #[arg(long, default_value = "trace", value_parser = parse_policy)]
    pub policy: PolicyKind,
    /// Backend: `local` (threads of this process), `shm` (one process per rank; alone it
    /// starts them), `mpi` (the processes of `mpirun`, on one machine or many; needs a build with
    /// `--features mpi`) or `cuda` (one GPU per rank, NCCL; needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value = "local")]
    pub backend: BenchBackend,
    /// Bucket cap in KiB (the layout's `bucket_bytes`; the demo's parameters are 1-33 KiB).
    #[arg(long, default_value_t = (crate::demo::sharded::DEFAULT_DEMO_BUCKET_BYTES >> 10) as f64, value_name = "KIB")]
    pub bucket_kb: f64,
    /// Micro-batches per optimizer step; all but the last run under `no_sync` (gradients
    /// accumulate locally, one reduction per step).
    #[arg(long, default_value_t = 2, value_name = "M")]
    pub micro_batches: usize,
    /// An evaluation pass (forward only, through a second coordinator) after every this many
    /// steps; 0: never.
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub eval_every: usize,
    /// Train every layer at every step (by default layer 2 is frozen for the middle third of
    /// the steps, to exercise trainability changes).
    #[arg(long)]
    pub no_freeze: bool,
    /// Write the demo as a simulator workload (`collsched sim --workload FILE`; one simulated
    /// step is one micro-batch: compare with `--micro-batches 1 --eval-every 0`).
    #[arg(long, value_name = "FILE.json")]
    pub workload_out: Option<std::path::PathBuf>,
    /// Write the sharded run's results as JSON (rank 0 writes it under `shm` and `mpi`):
    /// `format` ("collsched-demo-record"), `version` (1), `config` (the settings: `dims`,
    /// `world`, `steps`, `micro_batches`, `batch`, `lr`, `seed`, `freeze` as `[layer, from,
    /// until]` or null, `eval_every`, `strategy`, `policy`, `backend`), `steps` (per step
    /// `loss` and `eval_loss`, null without an evaluation) and `params` (per parameter `name`
    /// and `values`, row-major). Every number computed in f32 is written as the f64 of that
    /// f32, so any JSON reader gets it back bit for bit by rounding to f32.
    #[arg(long, value_name = "FILE.json")]
    pub record_out: Option<std::path::PathBuf>,
    /// Each rank writes its flight record (its collectives, when each was launched, reached
    /// and ended) into DIR at the end of the run, as `rank-R.json`: `collsched flight DIR
    /// --trace-out REAL.json` draws it, `collsched sim ... --against REAL.json` compares it.
    /// The local, shm and mpi backends; the last `COLLSCHED_FLIGHT_ENTRIES` (2000) collectives.
    #[arg(long, value_name = "DIR")]
    pub flight_out: Option<std::path::PathBuf>,
}

fn parse_policy(s: &str) -> Result<PolicyKind, String> {
    match s {
        "none" => Ok(PolicyKind::None),
        "trace" => Ok(PolicyKind::TraceReplay),
        _ => Err(format!("unknown policy `{s}`: use none or trace")),
    }
}

fn fmt_opt(x: Option<f32>) -> String {
    x.map_or_else(|| "-".to_string(), |v| format!("{v:.6}"))
}

#[cfg(feature = "cuda")]
fn run_cuda(cfg: &DemoConfig, opts: &ShardedOptions) -> Result<crate::demo::ShardedRun, CliError> {
    Ok(crate::demo::sharded_run_cuda(cfg, opts)?)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &DemoConfig, _: &ShardedOptions) -> Result<crate::demo::ShardedRun, CliError> {
    Err("collsched demo --backend cuda: this collsched was built without the `cuda` feature; \
         rebuild with `cargo build --release --features cuda` on a machine with GPUs, or use --backend local"
        .into())
}

/// This process's rank of an MPI job and the job (feature `mpi`).
#[cfg(feature = "mpi")]
type MpiRank = (crate::backend::local::LocalRank, crate::backend::mpi::MpiJob);
#[cfg(not(feature = "mpi"))]
type MpiRank = std::convert::Infallible;

/// Joins the MPI job this process was started in: its size, and this rank.
#[cfg(feature = "mpi")]
fn join_mpi() -> Result<(usize, MpiRank), CliError> {
    use crate::backend::mpi::{join, MpiConfig};
    let (rank, job) = join(&MpiConfig::from_env()?)?;
    Ok((job.world(), (rank, job)))
}

#[cfg(not(feature = "mpi"))]
fn join_mpi() -> Result<(usize, MpiRank), CliError> {
    Err(super::bench::NO_MPI.into())
}

/// This rank's part of the demo over MPI; rank 0 gets the record.
#[cfg(feature = "mpi")]
fn run_mpi(
    cfg: &DemoConfig,
    opts: &ShardedOptions,
    (rank, mut job): MpiRank,
) -> Result<Option<crate::demo::ShardedRun>, CliError> {
    let run = sharded_run_process(cfg, opts, rank, &mut job)?;
    drop(job);
    Ok(run)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(
    _: &DemoConfig,
    _: &ShardedOptions,
    never: MpiRank,
) -> Result<Option<crate::demo::ShardedRun>, CliError> {
    match never {}
}

/// The parity tolerance of a run (see the module docs): 0 but on `cuda` where a reduction
/// stage adds more than two ranks' values.
fn tolerance(backend: BenchBackend, world: usize, strategy: Sharding) -> f32 {
    let group = sum_group(world, strategy);
    let most_added = group.max(world / group);
    if backend == BenchBackend::Cuda && most_added > 2 {
        REORDERED_SUM_TOLERANCE
    } else {
        0.0
    }
}

/// The file `--record-out` writes (its format is the flag's documentation).
fn record_json(cfg: &DemoConfig, args: &DemoArgs, record: &RunRecord) -> String {
    use serde_json::json;
    let name = |v: Option<clap::builder::PossibleValue>| v.map(|v| v.get_name().to_owned());
    let steps: Vec<serde_json::Value> = record
        .steps
        .iter()
        .map(|s| json!({ "loss": f64::from(s.loss), "eval_loss": s.eval_loss.map(f64::from) }))
        .collect();
    let params: Vec<serde_json::Value> = cfg
        .model
        .params()
        .iter()
        .zip(&record.params)
        .map(|(p, v)| {
            let values: Vec<f64> = v.iter().map(|&x| f64::from(x)).collect();
            json!({ "name": p.name, "values": values })
        })
        .collect();
    json!({
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "config": {
            "dims": cfg.model.dims,
            "world": cfg.world,
            "steps": cfg.steps,
            "micro_batches": cfg.micro_batches,
            "batch": cfg.batch,
            "lr": f64::from(cfg.lr),
            "seed": cfg.seed,
            "freeze": cfg.freeze.map(|(layer, from, until)| [layer, from, until]),
            "eval_every": cfg.eval_every,
            "strategy": args.strategy.to_string(),
            "policy": if args.policy == PolicyKind::None { "none" } else { "trace" },
            "backend": name(clap::ValueEnum::to_possible_value(&args.backend)),
        },
        "steps": steps,
        "params": params,
    })
    .to_string()
}

/// Prints rank 0's mean step time over the steps after the first (which records the prefetch
/// trace, as `collsched sim` leaves out its first step) in its parts: compute, waits for
/// collectives, evaluation passes, and host time (the rest: scheduling, copies in and out, the
/// update); then what
/// they make as the simulator's inputs: the compute rate in its FLOP count (`--tflops`) and
/// the host time per collective launched (`--host-overhead-us`).
fn print_step_time(cfg: &DemoConfig, cost: &[crate::demo::StepCost]) {
    let timed = if cost.len() > 1 { &cost[1..] } else { cost };
    if timed.is_empty() {
        return;
    }
    let n = timed.len() as f64;
    let wall = timed.iter().map(|c| c.wall.as_secs_f64()).sum::<f64>() / n;
    let compute = timed.iter().map(|c| c.compute.as_secs_f64()).sum::<f64>() / n;
    let wait = timed.iter().map(|c| c.wait_time.as_secs_f64()).sum::<f64>() / n;
    let launches = timed.iter().map(|c| c.collectives as f64).sum::<f64>() / n;
    let eval = timed.iter().map(|c| c.eval.as_secs_f64()).sum::<f64>() / n;
    let host = (wall - compute - wait - eval).max(0.0);
    let flops = crate::demo::workload(cfg).model_flops() * cfg.micro_batches as f64;
    let rate = if compute > 0.0 { flops / compute } else { f64::INFINITY };
    println!(
        "step time: {:.3} ms, compute {:.3} ms, waits {:.3} ms, evaluation {:.3} ms, host {:.3} ms (rank 0, mean of {} step(s){})",
        wall * 1e3,
        compute * 1e3,
        wait * 1e3,
        eval * 1e3,
        host * 1e3,
        timed.len(),
        if cost.len() > 1 { " after the first" } else { "" },
    );
    println!(
        "as simulator inputs: compute rate {:.3} GFLOP/s = sim --tflops {:.6e}; host {:.1} us per collective launched = sim --host-overhead-us {:.1}",
        rate / 1e9,
        rate / 1e12,
        host / launches.max(1.0) * 1e6,
        host / launches.max(1.0) * 1e6
    );
}

/// Runs `collsched demo`.
///
/// # Errors
/// Bad flags (zero ranks or steps, a hybrid group that does not divide the ranks) or a failed
/// rank, as one line for the user.
pub fn run(args: DemoArgs) -> Result<ExitCode, CliError> {
    let mut ranks = args.ranks.unwrap_or(4);
    let mut process = None;
    let mut mpi = None;
    if args.backend == BenchBackend::Mpi {
        let (world, joined) = join_mpi()?;
        ranks = world;
        mpi = Some(joined);
    }
    if args.backend == BenchBackend::Shm {
        match launch::role(Some(ranks).filter(|_| args.ranks.is_some() || !launch::launched()))? {
            LaunchRole::Standalone(n) => return launch::standalone(n),
            LaunchRole::Rank(env) => {
                ranks = env.world;
                process = Some(env);
            }
        }
    }
    if ranks == 0 || args.steps == 0 {
        return Err(format!("--ranks and --steps must be at least 1 (got {ranks} and {})", args.steps).into());
    }
    if ranks > MAX_RANKS {
        return Err(format!(
            "--ranks {ranks} is above the demo's limit of {MAX_RANKS} (each rank is a thread or process with up \
             to three stream threads of its own)"
        )
        .into());
    }
    if args.steps > MAX_STEPS {
        return Err(format!(
            "--steps {} is above the demo's limit of {MAX_STEPS} (every step's losses are kept to compare)",
            args.steps
        )
        .into());
    }
    if args.micro_batches == 0 || args.micro_batches > MAX_MICRO_BATCHES {
        return Err(format!(
            "--micro-batches {} is out of range: give 1 to {MAX_MICRO_BATCHES}",
            args.micro_batches
        )
        .into());
    }
    let mut cfg = DemoConfig::standard(ranks, args.steps, args.seed);
    cfg.micro_batches = args.micro_batches;
    cfg.eval_every = args.eval_every;
    if args.no_freeze {
        cfg.freeze = None;
    }
    if let Some(path) = &args.workload_out {
        std::fs::write(path, crate::demo::workload(&cfg).to_json())
            .map_err(|e| format!("--workload-out {}: {e}", path.display()))?;
    }
    if !(args.bucket_kb.is_finite() && args.bucket_kb > 0.0 && args.bucket_kb <= 1e9) {
        return Err(format!("--bucket-kb {}: give a positive number of KiB, e.g. 4", args.bucket_kb).into());
    }
    let bucket_bytes = ((args.bucket_kb * 1024.0).round() as usize).max(1);
    let opts = ShardedOptions {
        sharding: args.strategy,
        policy: args.policy,
        bucket_bytes,
        flight_out: args.flight_out.clone(),
        ..ShardedOptions::default()
    };
    if args.flight_out.is_some() && args.backend == BenchBackend::Cuda {
        return Err("--flight-out: the cuda backend keeps no flight record (local, shm and mpi do)".into());
    }
    let t0 = Instant::now();
    let reference = reference_run(&cfg, args.strategy);
    let t1 = Instant::now();
    let sharded = match (args.backend, process) {
        (BenchBackend::Local, _) => sharded_run(&cfg, &opts)?,
        (BenchBackend::Cuda, _) => run_cuda(&cfg, &opts)?,
        (BenchBackend::Shm, Some(env)) => {
            let (rank, mut hub) = shm::join(&env, &ShmConfig::from_env()?)?;
            match sharded_run_process(&cfg, &opts, rank, &mut hub)? {
                Some(run) => run,
                None => return Ok(ExitCode::SUCCESS),
            }
        }
        (BenchBackend::Shm, None) => return Err("collsched demo --backend shm: no rank to run".into()),
        (BenchBackend::Mpi, _) => match run_mpi(&cfg, &opts, mpi.take().ok_or("no MPI rank to run")?)? {
            Some(run) => run,
            None => return Ok(ExitCode::SUCCESS),
        },
    };
    let t2 = Instant::now();
    println!(
        "collsched demo: MLP {:?}, {} ranks, strategy {}, policy {}, {} steps x {} micro-batches (all but the last under no_sync)",
        cfg.model.dims,
        cfg.world,
        args.strategy,
        if args.policy == PolicyKind::None { "none" } else { "trace" },
        cfg.steps,
        cfg.micro_batches
    );
    if let Some((layer, from, until)) = cfg.freeze {
        println!("layer {layer} frozen for steps {from}..{until}; evaluation through a second coordinator every {} steps", cfg.eval_every);
    }
    println!(
        "{} gather buckets, {} gradient buckets; reference {:.1} ms, sharded {:.1} ms",
        sharded.buckets.0,
        sharded.buckets.1,
        (t1 - t0).as_secs_f64() * 1e3,
        (t2 - t1).as_secs_f64() * 1e3
    );
    println!(
        "{:>4}  {:>12} {:>12} {:>10}  {:>10} {:>10}  {:>5} {:>5} {:>5} {:>5} {:>5} {:>9} {:>9} {:>9} {:>9}",
        "step",
        "ref loss",
        "sharded",
        "|diff|",
        "ref eval",
        "sh. eval",
        "ag",
        "rs",
        "coll",
        "hit",
        "miss",
        "peak KiB",
        "wait ms",
        "comp ms",
        "step ms"
    );
    for (i, ((r, s), c)) in reference.steps.iter().zip(&sharded.record.steps).zip(&sharded.cost).enumerate() {
        println!(
            "{:>4}  {:>12.7} {:>12.7} {:>10.3e}  {:>10} {:>10}  {:>5} {:>5} {:>5} {:>5} {:>5} {:>9.1} {:>9.3} {:>9.3} {:>9.3}",
            i,
            r.loss,
            s.loss,
            (r.loss - s.loss).abs(),
            fmt_opt(r.eval_loss),
            fmt_opt(s.eval_loss),
            c.all_gathers,
            c.reduce_scatters,
            c.collectives,
            c.prefetch_hits,
            c.prefetch_misses,
            c.peak_gathered_bytes as f64 / 1024.0,
            c.wait_time.as_secs_f64() * 1e3,
            c.compute.as_secs_f64() * 1e3,
            c.wall.as_secs_f64() * 1e3
        );
    }
    print_step_time(&cfg, &sharded.cost);
    if let Some(path) = &args.record_out {
        std::fs::write(path, record_json(&cfg, &args, &sharded.record))
            .map_err(|e| format!("--record-out {}: {e}", path.display()))?;
    }
    let (loss_diff, param_diff) = max_differences(&reference, &sharded.record);
    let tolerance = tolerance(args.backend, cfg.world, args.strategy);
    println!("final parameters: max |difference| = {param_diff:e} (tolerance {tolerance:e})");
    let ok = loss_diff <= tolerance && param_diff <= tolerance;
    if !ok {
        eprintln!("error: parity failed (tolerance {tolerance:e})");
    }
    println!("parity: max |loss difference| = {loss_diff:e} over {} steps", cfg.steps);
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
