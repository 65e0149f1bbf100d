//! `collsched bench`: flags into a [`BenchSpec`], then the backend-generic engine of
//! [`crate::bench`] on the chosen backend's ranks.

use std::process::ExitCode;

use std::sync::Mutex;

use super::launch::{self, LaunchRole};
use super::CliError;
use crate::backend::local::{LocalConfig, LocalWorld};
use crate::backend::shm::{self, ShmConfig};
use crate::bench::{
    first_failure, memcpy_bandwidth, memcpy_concurrent_bandwidth, run_rank, BenchOp, BenchPlan, BenchSpec,
    Collector, Printer, ProcessRows, CONCURRENT_MIN_BYTES,
};
use crate::bootstrap::LaunchEnv;
use crate::kernels::ElemType;

/// Element type on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchType {
    /// f32.
    F32,
    /// bf16.
    Bf16,
    /// f16.
    F16,
}

impl From<BenchType> for ElemType {
    fn from(t: BenchType) -> Self {
        match t {
            BenchType::F32 => ElemType::F32,
            BenchType::Bf16 => ElemType::BF16,
            BenchType::F16 => ElemType::F16,
        }
    }
}

/// Which backend runs the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchBackend {
    /// Threads of this process (`LocalWorld`).
    Local,
    /// CUDA devices through NCCL (feature `cuda`), one thread per GPU.
    Cuda,
    /// Processes of one machine, one per rank, over shared memory: under torchrun or mpirun
    /// each process is a rank; alone, `--ranks N` starts N processes of this program.
    Shm,
    /// The processes of an MPI job (`mpirun -np N collsched ...`), on one machine or many,
    /// through MPI (feature `mpi`).
    Mpi,
}

/// Flags of `collsched bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// The collective.
    #[arg(long, value_enum)]
    pub op: BenchOp,
    /// Number of ranks (with `--backend shm` under torchrun or mpirun: the launcher's).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Smallest size in bytes of the whole buffer (`1K`, `16M`, `1G` are powers of 1024).
    #[arg(short = 'b', long = "minbytes", value_parser = parse_size, default_value = "32M")]
    pub min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", value_parser = parse_size, default_value = "32M")]
    pub max_bytes: usize,
    /// Factor between successive sizes (at least 2).
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub factor: usize,
    /// Backend.
    #[arg(long, value_enum, default_value = "local")]
    pub backend: BenchBackend,
    /// Element type.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: BenchType,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Untimed iterations per size before the timed ones.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Fill inputs with rank-dependent values and count wrong output elements.
    #[arg(long)]
    pub check: bool,
    /// Split each size into T tensors: one grouped launch against T separate launches.
    #[arg(long, default_value_t = 1)]
    pub coalesce: usize,
    /// Iterations each rank keeps in flight (each on its own buffers); 1 times every collective
    /// alone (its latency), more overlap one with the next.
    #[arg(long, default_value_t = crate::bench::DEFAULT_INFLIGHT, value_name = "K")]
    pub inflight: usize,
    /// With `--backend mpi` and every process on one machine, leave out the comparison with
    /// `--backend shm` (by default the same processes run the same sizes over shm after the mpi
    /// part, printed as `shm_*` columns; it doubles the run's time).
    #[arg(long)]
    pub no_shm_compare: bool,
}

impl BenchArgs {
    /// The flags as the engine's input, for `ranks` ranks.
    pub fn spec(&self, ranks: usize) -> BenchSpec {
        BenchSpec {
            op: self.op,
            ranks,
            elem: self.dtype.into(),
            min_bytes: self.min_bytes,
            max_bytes: self.max_bytes,
            factor: self.factor,
            iters: self.iters,
            warmup: self.warmup,
            check: self.check,
            coalesce: self.coalesce,
            inflight: self.inflight,
        }
    }
}

pub use crate::units::parse_size;

/// Runs `collsched bench`.
///
/// # Errors
/// Bad flags, a backend failure, as one line for the user.
pub fn run(args: BenchArgs) -> Result<ExitCode, CliError> {
    if args.op.is_kernel() {
        return run_kernel(&args);
    }
    if args.backend == BenchBackend::Shm {
        return match launch::role(args.ranks)? {
            LaunchRole::Standalone(n) => {
                // Checked here too, so a bad request is one error, not one per rank.
                let plan = BenchPlan::new(&args.spec(n))?;
                if let Some(available) = crate::units::memory_available() {
                    plan.check_memory(available)?;
                }
                launch::standalone(n)
            }
            LaunchRole::Rank(env) => run_shm(&args, &env),
        };
    }
    if args.backend == BenchBackend::Mpi {
        return run_mpi(&args);
    }
    let ranks = args.ranks.ok_or("--ranks is required (the number of ranks)")?;
    let plan = BenchPlan::new(&args.spec(ranks))?;
    if let Some(available) = crate::units::memory_available() {
        plan.check_memory(available)?;
    }
    match args.backend {
        BenchBackend::Local => run_local(&plan),
        BenchBackend::Cuda => run_cuda(&plan),
        BenchBackend::Shm | BenchBackend::Mpi => unreachable!("handled above"),
    }
}

/// What a copy kernel's bench says to a backend that runs no kernels of its own.
const KERNEL_BACKENDS: &str =
    "--op copy_in and --op copy_out measure one device's copy kernels: use --backend local \
     (the host's kernels) or --backend cuda (the GPU's); shm and mpi run the host's kernels, as local does";

/// `--op copy_in|copy_out`: one rank's copy kernel against a copy of the same bytes
/// ([`crate::bench::kernel`]).
fn run_kernel(args: &BenchArgs) -> Result<ExitCode, CliError> {
    use crate::bench::kernel::{bench_kernel, footer, header, host_copy_seconds, row, warmup_launches};
    let plan = BenchPlan::new(&args.spec(args.ranks.unwrap_or(1)))?;
    if let Some(available) = crate::units::memory_available() {
        plan.check_memory(available)?;
    }
    let print = |r: &crate::bench::kernel::KernelRow| row(&plan, r);
    let rows = match args.backend {
        BenchBackend::Local => {
            header(&plan, "local", "a host memcpy (one thread)");
            let world = LocalWorld::with_config(1, LocalConfig::default())?;
            let host = |size: usize| Ok(host_copy_seconds(size, warmup_launches(&plan), plan.iters));
            let mut outcomes = world.run(|rank| bench_kernel(&rank, &plan, &host, &mut |r| print(r)))?;
            outcomes.pop().ok_or("rank 0 did not run")?.map_err(|_| "rank 0 panicked")??
        }
        BenchBackend::Cuda => kernel_cuda(&plan, &print)?,
        BenchBackend::Shm | BenchBackend::Mpi => return Err(KERNEL_BACKENDS.into()),
    };
    Ok(if footer(&rows) { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

#[cfg(feature = "cuda")]
fn kernel_cuda(
    plan: &BenchPlan,
    print: &(dyn Fn(&crate::bench::kernel::KernelRow) + Sync),
) -> Result<Vec<crate::bench::kernel::KernelRow>, CliError> {
    let world = crate::backend::cuda::CudaWorld::new(1)?;
    crate::bench::kernel::header(plan, "cuda", "device-to-device copies (cuMemcpyDtoDAsync) on GPU 0");
    let mut outcomes = world.run(|b| {
        let copy = |size: usize| {
            b.device_copies_seconds(size, crate::bench::kernel::warmup_launches(plan), plan.iters)
                .map_err(|e| e.to_string())
        };
        crate::bench::kernel::bench_kernel(&b, plan, &copy, &mut |r| print(r))
    })?;
    Ok(outcomes.pop().ok_or("rank 0 did not run")?.map_err(|_| "rank 0 panicked")??)
}

#[cfg(not(feature = "cuda"))]
fn kernel_cuda(
    _plan: &BenchPlan,
    _print: &(dyn Fn(&crate::bench::kernel::KernelRow) + Sync),
) -> Result<Vec<crate::bench::kernel::KernelRow>, CliError> {
    Err(NO_CUDA.into())
}

/// The reference lines of a table measured on this machine: single-thread memcpy and, from
/// [`CONCURRENT_MIN_BYTES`] up, one copy per core at once.
fn printer_for(plan: &BenchPlan, backend: &'static str) -> Printer {
    let largest = plan.sizes.last().copied().unwrap_or(0);
    let memcpy = memcpy_bandwidth(largest);
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let threads = plan.ranks.min(cores);
    let mut printer = Printer::new(plan, backend, memcpy);
    printer.concurrent = (threads > 1 && largest >= CONCURRENT_MIN_BYTES)
        .then(|| (threads, memcpy_concurrent_bandwidth(largest, threads)));
    printer
}

/// `--backend shm`, this process being rank `env.rank`: rank 0 measures the references and
/// prints; the rows travel through the bootstrap hub.
fn run_shm(args: &BenchArgs, env: &LaunchEnv) -> Result<ExitCode, CliError> {
    let plan = BenchPlan::new(&args.spec(env.world))?;
    if let Some(available) = crate::units::memory_available() {
        plan.check_memory(available)?;
    }
    let config = ShmConfig::from_env()?;
    let printer = if env.rank == 0 { printer_for(&plan, "shm") } else { Printer::new(&plan, "shm", 0.0) };
    let (rank, hub) = shm::join(env, &config)?;
    if env.rank == 0 {
        printer.header();
    }
    let rows = ProcessRows(Mutex::new(hub));
    run_rank(&rank, &plan, &rows, &printer)?;
    Ok(if env.rank == 0 { printer.footer() } else { ExitCode::SUCCESS })
}

/// `--backend mpi`: this process is a rank of the MPI job it was started in; rank 0 measures
/// the references and prints; the rows travel over MPI.
#[cfg(feature = "mpi")]
fn run_mpi(args: &BenchArgs) -> Result<ExitCode, CliError> {
    use crate::backend::mpi::{self, MpiConfig};
    use crate::backend::CollectiveKind;
    use crate::bench::Reference;
    let (rank, job) = mpi::join(&MpiConfig::from_env()?)?;
    let (me, world) = (job.rank(), job.world());
    if args.ranks.is_some_and(|n| n != world) {
        return Err(format!(
            "--ranks {} differs from the MPI job's {world} processes",
            args.ranks.unwrap_or(0)
        )
        .into());
    }
    let plan = BenchPlan::new(&args.spec(world))?;
    if let Some(available) = crate::units::memory_available() {
        plan.check_memory(available)?;
    }
    let mut printer = if me == 0 { printer_for(&plan, "mpi") } else { Printer::new(&plan, "mpi", 0.0) };
    // MPI's own collective in the same run, where it has one (f32 sums).
    if plan.elem == ElemType::F32 {
        let (op, name) = match plan.op {
            BenchOp::AllGather => (CollectiveKind::AllGather, "MPI_Allgather (out of place)"),
            BenchOp::ReduceScatter => (CollectiveKind::ReduceScatter, "MPI_Reduce_scatter_block (sum)"),
            BenchOp::AllReduce => (CollectiveKind::AllReduce, "MPI_Allreduce (sum)"),
            BenchOp::CopyIn | BenchOp::CopyOut => return Err(KERNEL_BACKENDS.into()),
        };
        let times = plan
            .sizes
            .iter()
            .map(|&bytes| job.time_reference(op, bytes, plan.warmup, plan.iters))
            .collect::<Result<Vec<f64>, _>>()?;
        printer.references.push(Reference { tag: "ref", name: name.to_owned(), times });
    }
    let rows = ProcessRows(Mutex::new(job));
    let result = crate::bench::collect_rank(&rank, &plan, &rows);
    // The rank first (its streams finish), then the job (MPI_Finalize).
    drop(rank);
    drop(rows);
    let table = result?;
    // The shm backend after MPI's part: every row is printed once both are measured.
    if let Some(times) = if args.no_shm_compare { None } else { shm_times(&plan)? } {
        let name = "--backend shm, the same processes over shared memory".to_owned();
        printer.references.push(Reference { tag: "shm", name, times });
    }
    if me != 0 {
        return Ok(ExitCode::SUCCESS);
    }
    printer.header();
    for (&size, rows) in plan.sizes.iter().zip(&table) {
        printer.row(size, rows);
    }
    Ok(printer.footer())
}

/// With every process of the MPI job on this machine, the same bench (timed, unchecked) over the
/// `shm` backend by the same processes: each size's slowest rank's seconds per iteration (on
/// rank 0, which prints). `None` when the job spans machines (or Open MPI does not say).
#[cfg(feature = "mpi")]
fn shm_times(plan: &BenchPlan) -> Result<Option<Vec<f64>>, CliError> {
    let env = LaunchEnv::from_env()?;
    if env.local_world != Some(env.world) {
        return Ok(None);
    }
    let timing = BenchPlan { check: false, ..plan.clone() };
    let (rank, hub) = shm::join(&env, &ShmConfig::from_env()?)?;
    let rows = ProcessRows(Mutex::new(hub));
    let all =
        crate::bench::collect_rank(&rank, &timing, &rows).map_err(|e| format!("the shm comparison: {e}"))?;
    Ok(Some(all.iter().map(|r| r.iter().map(|r| r.grouped).fold(f64::NAN, f64::max)).collect()))
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_args: &BenchArgs) -> Result<ExitCode, CliError> {
    Err(NO_MPI.into())
}

/// What `--backend mpi` says in a build without the feature.
#[cfg(not(feature = "mpi"))]
pub(crate) const NO_MPI: &str = "--backend mpi: this collsched was built without the `mpi` feature; rebuild with \
     `cargo build --release --features mpi` (needs libopenmpi-dev and libclang-dev), and start it with mpirun";

fn run_local(plan: &BenchPlan) -> Result<ExitCode, CliError> {
    let printer = printer_for(plan, "local");
    printer.header();
    let world = LocalWorld::with_config(plan.ranks, LocalConfig::default())?;
    let collector = Collector::new(plan.ranks);
    first_failure(world.run(|rank| run_rank(&rank, plan, &collector, &printer))?)?;
    Ok(printer.footer())
}

/// `--backend cuda`: one thread per GPU of this process.
#[cfg(feature = "cuda")]
fn run_cuda(plan: &BenchPlan) -> Result<ExitCode, CliError> {
    use crate::backend::Backend;
    let world = crate::backend::cuda::CudaWorld::new(plan.ranks)?;
    // The reference measured in the same run: a device-to-device copy of each size's whole
    // buffer on rank 0's GPU (what one GPU's memory moves; a collective's own copy at one rank).
    let copies = world.run(|b| {
        (b.rank() == 0)
            .then(|| plan.sizes.iter().map(|&s| b.device_copy_seconds(s.max(4), plan.iters)).collect())
            .transpose()
    })?;
    let times: Vec<f64> = match copies.into_iter().next() {
        Some(Ok(Ok(Some(t)))) => t,
        Some(Ok(Err(e))) => return Err(format!("rank 0: the device copy reference failed: {e}").into()),
        _ => return Err("rank 0: the device copy reference did not run".into()),
    };
    let largest = plan.sizes.last().copied().unwrap_or(0);
    let copy_bw = times.last().map_or(f64::NAN, |t| largest.max(4) as f64 / t);
    let mut printer = Printer::new(plan, "cuda", copy_bw);
    printer.copy_name = "device-to-device copy (cuMemcpyDtoDAsync) on GPU 0".to_string();
    printer.references.push(crate::bench::Reference {
        tag: "d2d",
        name: "a device-to-device copy of the whole buffer on GPU 0 (cuMemcpyDtoDAsync)".to_string(),
        times,
    });
    printer.header();
    let collector = Collector::new(plan.ranks);
    first_failure(world.run(|b| run_rank(&b, plan, &collector, &printer))?)?;
    Ok(printer.footer())
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_plan: &BenchPlan) -> Result<ExitCode, CliError> {
    Err(NO_CUDA.into())
}

/// What `--backend cuda` says in a build without the feature.
#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "collsched bench --backend cuda: this collsched was built without the `cuda` feature; \
     rebuild with `cargo build --release --features cuda` on a machine with a GPU, or use --backend local";
