//! `collsched bench`: collective bandwidth and latency in nccl-tests columns.
//!
//! For every size from `-b` to `-e` (multiplied by `-f`), every rank runs `--warmup` untimed and
//! `--iters` timed iterations of the collective, keeping [`PIPELINE`] iterations in flight (each
//! on its own set of buffers: a launch owns its buffers until it completes). The time of a size is
//! the slowest rank's average per iteration. Before the table, a reference line gives the
//! single-thread `memcpy` bandwidth of this machine at the largest size, measured in the same run.
//!
//! Columns (nccl-tests): `size` = bytes of the whole (gathered / unreduced) buffer, `count` =
//! its elements, `type`, `redop`, `root`, `time` (µs), `algbw` = size / time (GB/s),
//! `busbw` = algbw x (n-1)/n (x 2(n-1)/n for all-reduce), `#wrong` (with `--check`; `N/A`
//! otherwise). With `--coalesce T > 1` every size is split into T tensors: the main columns are
//! one grouped launch of the T collectives, and `sep_time sep_algbw sep_busbw` follow for T
//! separate launches.
//!
//! All-gathers run in place (each rank's shard already sits in its slot of the output, as FSDP's
//! copy-in leaves it); reduce-scatters and all-reduces out of place (sum).

use std::process::ExitCode;
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use super::CliError;
use crate::backend::local::{LocalConfig, LocalWorld};
use crate::backend::{Backend, BackendError, CollDesc, Collective, InFlight, RankGroup, Stream};
use crate::kernels::ElemType;

/// The second reference line (concurrent memcpy) is printed from this largest size up.
pub const CONCURRENT_MIN_BYTES: usize = 16 << 20;

/// The memory-bound line is printed from this largest size up (256 MiB): the copies it is
/// computed from must not fit in the last-level cache (105 MiB on the machine these numbers
/// come from), or it is a cache bound that no collective of that size reaches.
pub const BOUND_MIN_BYTES: usize = 256 << 20;

/// Iterations kept in flight by each rank (each needs its own set of buffers).
pub const PIPELINE: usize = 2;

/// The collective to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchOp {
    /// All-gather (in place).
    #[value(name = "all_gather")]
    AllGather,
    /// Reduce-scatter (sum).
    #[value(name = "reduce_scatter")]
    ReduceScatter,
    /// All-reduce (sum).
    #[value(name = "all_reduce")]
    AllReduce,
}

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
    /// CUDA devices through NCCL (feature `cuda`).
    Cuda,
}

/// Flags of `collsched bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The collective.
    #[arg(long, value_enum)]
    pub op: BenchOp,
    /// Number of ranks.
    #[arg(long)]
    pub ranks: usize,
    /// Smallest size in bytes of the whole buffer (`1K`, `16M`, `1G` are powers of 1024).
    #[arg(short = 'b', long = "minbytes", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest size in bytes.
    #[arg(short = 'e', long = "maxbytes", value_parser = parse_size)]
    pub max_bytes: usize,
    /// Factor between successive sizes (at least 2).
    #[arg(short = 'f', long = "stepfactor")]
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
}

/// Parses `4096`, `4K`, `16M`, `1G` (powers of 1024; a trailing `B` or `iB` is accepted).
///
/// # Errors
/// A message naming the text if it is not such a size.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let n: usize =
        num.parse().map_err(|_| format!("size `{s}`: expected a number with an optional K, M or G"))?;
    n.checked_mul(1usize << shift).ok_or_else(|| format!("size `{s}` does not fit in memory addresses"))
}

/// What every rank measures: validated flags.
#[derive(Clone, Debug)]
pub struct BenchPlan {
    /// The collective.
    pub op: BenchOp,
    /// Ranks.
    pub ranks: usize,
    /// Element type.
    pub elem: ElemType,
    /// Sizes in bytes of the whole buffer (already rounded to whole elements per rank and tensor).
    pub sizes: Vec<usize>,
    /// Timed iterations.
    pub iters: usize,
    /// Untimed iterations.
    pub warmup: usize,
    /// Whether to check results.
    pub check: bool,
    /// Tensors per size.
    pub coalesce: usize,
}

impl BenchPlan {
    /// Validates the flags and lists the sizes.
    ///
    /// # Errors
    /// A message naming the flag that is out of range.
    pub fn new(a: &Args) -> Result<Self, CliError> {
        if a.ranks == 0 {
            return Err("--ranks must be at least 1".into());
        }
        if a.factor < 2 {
            return Err(format!("-f/--stepfactor must be at least 2, got {}", a.factor).into());
        }
        if a.min_bytes > a.max_bytes {
            return Err(format!("-b ({}) is larger than -e ({})", a.min_bytes, a.max_bytes).into());
        }
        if a.iters == 0 {
            return Err("--iters must be at least 1".into());
        }
        if a.coalesce == 0 {
            return Err("--coalesce must be at least 1".into());
        }
        let elem = ElemType::from(a.dtype);
        // The smallest unit a size is rounded down to: whole elements per rank and per tensor.
        let unit = match a.op {
            BenchOp::AllReduce => elem.size() * a.coalesce,
            _ => elem.size() * a.coalesce * a.ranks,
        };
        let mut sizes = Vec::new();
        let mut s = a.min_bytes.max(1);
        loop {
            let rounded = (s / unit).max(1) * unit;
            if sizes.last() != Some(&rounded) {
                sizes.push(rounded);
            }
            match s.checked_mul(a.factor) {
                Some(next) if next <= a.max_bytes => s = next,
                _ => break,
            }
        }
        Ok(BenchPlan {
            op: a.op,
            ranks: a.ranks,
            elem,
            sizes,
            iters: a.iters,
            warmup: a.warmup,
            check: a.check,
            coalesce: a.coalesce,
        })
    }

    /// The bus bandwidth factor: (n-1)/n, or 2(n-1)/n for all-reduce.
    pub fn bus_factor(&self) -> f64 {
        let n = self.ranks as f64;
        match self.op {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            _ => (n - 1.0) / n,
        }
    }

    /// The busbw (bytes/s) the memory system allows this op at its rank count, given `copy`, the
    /// bytes per second that copying threads move in all when every core copies at once (with
    /// streaming stores: 2 bytes of traffic per byte copied); `None` for one rank. It assumes
    /// every byte is moved once with streaming stores, as the local backend does for big
    /// buffers: for S bytes, an all-gather moves 2(n-1)S in all, a reduce-scatter (n+1)S (every
    /// input read once, every output written once), an all-reduce (3n-1)S (its reduce-scatter,
    /// then an all-gather of the n chunks).
    pub fn memory_bound_busbw(&self, copy: f64) -> Option<f64> {
        if self.ranks < 2 {
            return None;
        }
        let n = self.ranks as f64;
        let traffic_per_byte = match self.op {
            BenchOp::AllGather => 2.0 * (n - 1.0),
            BenchOp::ReduceScatter => n + 1.0,
            BenchOp::AllReduce => 3.0 * n - 1.0,
        };
        // algbw = S / t with t = traffic / (2 copy).
        Some(2.0 * copy / traffic_per_byte * self.bus_factor())
    }

    /// Elements per tensor (shard per rank for all-gather / reduce-scatter) at `size` bytes.
    fn count_per_tensor(&self, size: usize) -> usize {
        let per = size / self.elem.size() / self.coalesce;
        match self.op {
            BenchOp::AllReduce => per,
            _ => per / self.ranks,
        }
    }
}

/// One rank's measurement of one size.
#[derive(Clone, Debug, Default)]
pub struct RankRow {
    /// Seconds per iteration, grouped launch.
    pub grouped: f64,
    /// Seconds per iteration, separate launches (with `--coalesce T > 1`).
    pub separate: Option<f64>,
    /// Wrong elements (with `--check`).
    pub wrong: u64,
}

/// A barrier of the rank threads that a failing rank breaks instead of leaving the others
/// waiting, and that collects each rank's row.
pub struct Collector {
    n: usize,
    state: Mutex<CollectorState>,
    cv: Condvar,
}

#[derive(Default)]
struct CollectorState {
    rows: Vec<Option<RankRow>>,
    arrived: usize,
    generation: u64,
    broken: Option<String>,
    last: Vec<RankRow>,
}

impl Collector {
    /// A collector for `n` ranks.
    pub fn new(n: usize) -> Self {
        Collector {
            n,
            state: Mutex::new(CollectorState { rows: vec![None; n], ..Default::default() }),
            cv: Condvar::new(),
        }
    }

    /// Marks the run failed: every waiter returns an error.
    pub fn break_with(&self, why: String) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.broken.get_or_insert(why);
        self.cv.notify_all();
    }

    /// Hands in `row` for `rank` and waits for every rank; returns all rows (in rank order).
    ///
    /// # Errors
    /// The failure of another rank.
    pub fn exchange(&self, rank: usize, row: RankRow) -> Result<Vec<RankRow>, String> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(b) = &st.broken {
            return Err(b.clone());
        }
        st.rows[rank] = Some(row);
        st.arrived += 1;
        let generation = st.generation;
        if st.arrived == self.n {
            st.last = st.rows.iter_mut().map(|r| r.take().unwrap_or_default()).collect();
            st.arrived = 0;
            st.generation += 1;
            self.cv.notify_all();
        }
        while st.generation == generation {
            if let Some(b) = &st.broken {
                return Err(b.clone());
            }
            st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        Ok(st.last.clone())
    }
}

/// Breaks the collector if its rank's thread unwinds, so the other ranks stop waiting for it.
pub struct BreakOnPanic<'a> {
    /// The collector to break.
    pub collector: &'a Collector,
    /// The rank this guard belongs to.
    pub rank: usize,
}

impl Drop for BreakOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.collector.break_with(format!("rank {} panicked", self.rank));
        }
    }
}

/// Runs `collsched bench`.
///
/// # Errors
/// Bad flags, a backend failure, as one line for the user.
pub fn run(args: Args) -> Result<ExitCode, CliError> {
    let plan = BenchPlan::new(&args)?;
    match args.backend {
        BenchBackend::Local => run_local(&plan),
        BenchBackend::Cuda => run_cuda(&plan),
    }
}

/// `--backend cuda`: for the CUDA backend to fill in (build its ranks, call [`bench_rank`] on
/// each with a shared [`Collector`], print with [`Printer`]).
///
/// # Errors
/// Until then, always: a message saying what is missing.
pub fn run_cuda(plan: &BenchPlan) -> Result<ExitCode, CliError> {
    #[cfg(feature = "cuda")]
    {
        crate::backend::cuda::bench::run(plan)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = plan;
        Err("collsched bench --backend cuda: this collsched was built without the `cuda` feature; \
             rebuild with `cargo build --release --features cuda` on a machine with a GPU, or use --backend local"
            .into())
    }
}

fn run_local(plan: &BenchPlan) -> Result<ExitCode, CliError> {
    let largest = plan.sizes.last().copied().unwrap_or(0);
    let memcpy = memcpy_bandwidth(largest);
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let threads = plan.ranks.min(cores);
    let concurrent = (threads > 1 && largest >= CONCURRENT_MIN_BYTES)
        .then(|| (threads, memcpy_concurrent_bandwidth(largest, threads)));
    let mut printer = Printer::new(plan, "local", memcpy);
    printer.concurrent = concurrent;
    printer.header();
    let world = LocalWorld::with_config(plan.ranks, LocalConfig::default())?;
    let collector = Collector::new(plan.ranks);
    let outcomes = world.run(|rank| {
        let r = rank.rank();
        let _guard = BreakOnPanic { collector: &collector, rank: r };
        let result =
            bench_rank(&rank, plan, &collector, &|i, rows: &[RankRow]| printer.row(plan.sizes[i], rows));
        if let Err(e) = &result {
            collector.break_with(format!("rank {r}: {e}"));
        }
        result
    })?;
    let mut first_error = None;
    for (r, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(format!("rank {r} panicked"));
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e.into());
    }
    Ok(printer.footer())
}

/// Single-thread `memcpy` bandwidth (bytes copied per second) at `bytes`, best of a few runs.
pub fn memcpy_bandwidth(bytes: usize) -> f64 {
    let bytes = bytes.max(4096);
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src); // touch every page first
    let runs = if bytes >= 64 << 20 { 5 } else { 20 };
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best
}

/// Aggregate bandwidth (bytes copied per second, all threads together) of `threads` threads each
/// copying `bytes` at the same time, best of a few runs: how much more than one thread the
/// machine's memory gives to several cores, printed beside the single-thread reference. The
/// copies stream from 8 MiB on (`kernels::copy_piece`, as the local collectives copy), so the
/// traffic is 2 bytes per byte copied whatever `memcpy` would choose for that size.
pub fn memcpy_concurrent_bandwidth(bytes: usize, threads: usize) -> f64 {
    let bytes = bytes.max(4096);
    let threads = threads.max(1);
    let mut bufs: Vec<(Vec<u8>, Vec<u8>)> =
        (0..threads).map(|_| (vec![1u8; bytes], vec![0u8; bytes])).collect();
    let runs = if bytes >= 64 << 20 { 5 } else { 20 };
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        let barrier = std::sync::Barrier::new(threads + 1);
        let t = std::thread::scope(|s| {
            for (src, dst) in bufs.iter_mut() {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    let (n, src) = (dst.len(), std::hint::black_box(&src[..]));
                    // Equal lengths: cannot fail.
                    let _ = crate::kernels::copy_piece(dst, src, n);
                });
            }
            barrier.wait();
            Instant::now()
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    (bytes * threads) as f64 / best
}

/// Prints the table (rank 0's thread prints each row once every rank handed it in).
pub struct Printer {
    plan: BenchPlan,
    backend: &'static str,
    memcpy: f64,
    /// Optional second reference: (threads, aggregate bytes/s of that many concurrent copies).
    pub concurrent: Option<(usize, f64)>,
    state: Mutex<PrinterState>,
}

#[derive(Default)]
struct PrinterState {
    wrong: u64,
    busbw_sum: f64,
    rows: usize,
    last_busbw: f64,
}

fn type_name(e: ElemType) -> &'static str {
    e.name()
}

impl Printer {
    /// A printer for `plan`, with the memcpy reference (bytes/s).
    pub fn new(plan: &BenchPlan, backend: &'static str, memcpy: f64) -> Self {
        Printer { plan: plan.clone(), backend, memcpy, concurrent: None, state: Mutex::default() }
    }

    /// The lines before the table.
    pub fn header(&self) {
        let p = &self.plan;
        let op = match p.op {
            BenchOp::AllGather => "all_gather (in place)",
            BenchOp::ReduceScatter => "reduce_scatter (sum, out of place)",
            BenchOp::AllReduce => "all_reduce (sum, out of place)",
        };
        println!(
            "# collsched bench: {op}, {} ranks ({} backend), {}, {} iterations after {} warm-up, {} in flight{}",
            p.ranks,
            self.backend,
            p.elem.name(),
            p.iters,
            p.warmup,
            PIPELINE,
            if p.check { ", checked" } else { "" }
        );
        let largest = p.sizes.last().copied().unwrap_or(0).max(4096);
        println!(
            "# memcpy reference: single-thread copy of {} bytes: {:.2} GB/s",
            largest,
            self.memcpy / 1e9
        );
        if let Some((threads, bw)) = self.concurrent {
            println!(
                "# copy, {threads} threads at once ({} bytes each, streaming stores): {:.2} GB/s in all",
                largest,
                bw / 1e9
            );
        }
        if p.coalesce > 1 {
            println!(
                "# coalesce: each size is {} tensors; time/algbw/busbw for one grouped launch, sep_* for {} separate launches",
                p.coalesce, p.coalesce
            );
        }
        let mut h1 = format!(
            "#{:>11} {:>12} {:>6} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}",
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"
        );
        let mut h2 = format!(
            "#{:>11} {:>12} {:>6} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}",
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
        );
        if p.coalesce > 1 {
            h1 += &format!(" {:>10} {:>9} {:>9}", "sep_time", "sep_algbw", "sep_busbw");
            h2 += &format!(" {:>10} {:>9} {:>9}", "(us)", "(GB/s)", "(GB/s)");
        }
        println!("{h1}");
        println!("{h2}");
    }

    /// Prints the row of `size` from every rank's measurement.
    pub fn row(&self, size: usize, rows: &[RankRow]) {
        let p = &self.plan;
        let t = rows.iter().map(|r| r.grouped).fold(0.0, f64::max);
        let algbw = size as f64 / t / 1e9;
        let busbw = algbw * p.bus_factor();
        let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
        let redop = if p.op == BenchOp::AllGather { "none" } else { "sum" };
        let wrong_s = if p.check { wrong.to_string() } else { "N/A".into() };
        let mut line = format!(
            "{:>12} {:>12} {:>6} {:>6} {:>5} {:>10.2} {:>8.2} {:>8.2} {:>7}",
            size,
            size / p.elem.size(),
            type_name(p.elem),
            redop,
            -1,
            t * 1e6,
            algbw,
            busbw,
            wrong_s
        );
        if p.coalesce > 1 {
            let ts = rows.iter().filter_map(|r| r.separate).fold(0.0, f64::max);
            let a = size as f64 / ts / 1e9;
            line += &format!(" {:>10.2} {:>9.2} {:>9.2}", ts * 1e6, a, a * p.bus_factor());
        }
        println!("{line}");
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.wrong += wrong;
        st.busbw_sum += busbw;
        st.rows += 1;
        st.last_busbw = busbw;
    }

    /// The lines after the table; the exit code (failure if anything was wrong).
    pub fn footer(&self) -> ExitCode {
        let st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if self.plan.check {
            println!("# out of bounds values : {} {}", st.wrong, if st.wrong == 0 { "OK" } else { "FAILED" });
        }
        if st.rows > 0 {
            println!("# avg bus bandwidth    : {:.3} GB/s", st.busbw_sum / st.rows as f64);
            println!(
                "# busbw at the largest size: {:.2} GB/s = {:.0}% of the memcpy reference",
                st.last_busbw,
                100.0 * st.last_busbw * 1e9 / self.memcpy
            );
        }
        let largest = self.plan.sizes.last().copied().unwrap_or(0);
        if let (Some((threads, copy)), true) = (self.concurrent, st.rows > 0 && largest >= BOUND_MIN_BYTES) {
            if let Some(bound) = self.plan.memory_bound_busbw(copy) {
                println!(
                    "# memory bound at the largest size: {:.2} GB/s busbw, {:.0}% of it reached (each byte \
                     moved once with streaming stores, at the {threads}-thread copy bandwidth above)",
                    bound / 1e9,
                    100.0 * st.last_busbw * 1e9 / bound
                );
            }
        }
        if st.wrong > 0 {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        }
    }
}

/// A rank-dependent value, exact in every element type (a multiple of 1/8 below 32).
fn value(rank: usize, i: usize) -> f32 {
    let h = (rank.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)) % 511;
    (h as f32 - 255.0) / 8.0
}

fn encode_into(ty: ElemType, out: &mut Vec<u8>, v: impl Iterator<Item = f32>) {
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

/// Runs `warmup + iters` iterations with [`PIPELINE`] in flight; returns seconds per timed
/// iteration and the buffers of the last iteration.
fn time_iterations<B: Backend>(
    b: &B,
    plan: &BenchPlan,
    sets: &mut [Option<Ops<B>>],
    grouped: bool,
    collector: &Collector,
) -> Result<f64, BackendError> {
    let stream = match plan.op {
        BenchOp::AllGather => Stream::AllGather,
        _ => Stream::ReduceScatter,
    };
    let timeout = b.timeout();
    let depth = sets.len();
    let mut flights: Vec<Option<Vec<InFlight<B>>>> = (0..depth).map(|_| None).collect();
    let mut run = |count: usize, flights: &mut Vec<Option<Vec<InFlight<B>>>>| -> Result<(), BackendError> {
        for i in 0..count {
            let k = i % depth;
            if let Some(f) = flights[k].take() {
                sets[k] = Some(finish(f, timeout)?);
            }
            let ops = sets[k].take().unwrap_or_default();
            flights[k] = Some(launch(b, stream, ops, grouped)?);
        }
        for k in 0..depth {
            if let Some(f) = flights[k].take() {
                sets[k] = Some(finish(f, timeout)?);
            }
        }
        Ok(())
    };
    run(plan.warmup, &mut flights)?;
    collector.exchange(b.rank(), RankRow::default()).map_err(|what| BackendError::Unsupported { what })?;
    let start = Instant::now();
    run(plan.iters, &mut flights)?;
    Ok(start.elapsed().as_secs_f64() / plan.iters as f64)
}

/// One rank's whole bench: every size of `plan`, handing rows to `collector`; `print` is called
/// on rank 0 with every rank's row of size `i`.
///
/// # Errors
/// A backend failure, or another rank's (through the collector).
pub fn bench_rank<B: Backend>(
    b: &B,
    plan: &BenchPlan,
    collector: &Collector,
    print: &(dyn Fn(usize, &[RankRow]) + Sync),
) -> Result<(), String> {
    let me = b.rank();
    let fail = |e: BackendError| e.to_string();
    for (i, &size) in plan.sizes.iter().enumerate() {
        let mut sets: Vec<Option<Ops<B>>> = Vec::with_capacity(PIPELINE);
        for k in 0..PIPELINE {
            sets.push(Some(make_ops(b, plan, size, k * plan.coalesce).map_err(fail)?));
        }
        let grouped = time_iterations(b, plan, &mut sets, true, collector).map_err(fail)?;
        let separate = if plan.coalesce > 1 {
            Some(time_iterations(b, plan, &mut sets, false, collector).map_err(fail)?)
        } else {
            None
        };
        let mut wrong = 0;
        if plan.check {
            for ops in sets.iter().flatten() {
                wrong += count_wrong(b, plan, ops).map_err(fail)?;
            }
        }
        // Buffers of this size are dropped (not pooled): the next size needs other ones.
        drop(sets);
        let rows = collector.exchange(me, RankRow { grouped, separate, wrong })?;
        if me == 0 {
            print(i, &rows);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_collector_releases_every_waiter() {
        let c = Collector::new(3);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| c.exchange(0, RankRow::default()));
            let panicker = s.spawn(|| {
                let _g = BreakOnPanic { collector: &c, rank: 2 };
                panic!("rank 2 falls over");
            });
            assert!(panicker.join().is_err());
            let e = waiter.join().expect("no panic").expect_err("broken");
            assert!(e.contains("rank 2 panicked"), "{e}");
        });
        assert!(c.exchange(1, RankRow::default()).is_err());
    }

    /// The bound against byte counts tallied here, rank by rank, from what each collective reads
    /// and writes (every byte once, streaming stores: traffic = reads + writes).
    #[test]
    fn memory_bound_counts_every_rank_reading_and_writing_once() {
        let copy = 12e9;
        for n in 1..=9usize {
            let s = 1e9; // bytes of the whole buffer
            let shard = s / n as f64;
            for op in [BenchOp::AllGather, BenchOp::ReduceScatter, BenchOp::AllReduce] {
                let plan = BenchPlan {
                    op,
                    ranks: n,
                    elem: ElemType::F32,
                    sizes: vec![1 << 30],
                    iters: 1,
                    warmup: 0,
                    check: false,
                    coalesce: 1,
                };
                // Per rank: (bytes read, bytes written).
                let per_rank = match op {
                    // In place: the n-1 peer shards, read from the peers, written into ours.
                    BenchOp::AllGather => ((n - 1) as f64 * shard, (n - 1) as f64 * shard),
                    // Our chunk of every rank's input, then our shard of output.
                    BenchOp::ReduceScatter => (n as f64 * shard, shard),
                    // Reduce-scatter of chunks, then copy the n-1 other chunks.
                    BenchOp::AllReduce => {
                        (n as f64 * shard + (n - 1) as f64 * shard, shard + (n - 1) as f64 * shard)
                    }
                };
                let traffic = n as f64 * (per_rank.0 + per_rank.1);
                // The copy bandwidth moves 2 x copy bytes of traffic per second.
                let t = traffic / (2.0 * copy);
                let want = s / t * plan.bus_factor();
                match plan.memory_bound_busbw(copy) {
                    None => assert_eq!(n, 1),
                    Some(got) => assert!((got - want).abs() <= 1e-9 * want, "{op:?} n={n}: {got} vs {want}"),
                }
            }
        }
    }

    #[test]
    fn sizes_parse_like_nccl_tests() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert!(parse_size("lots").unwrap_err().contains("lots"));
    }
}
