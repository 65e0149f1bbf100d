//! `collsched bench`: collective bandwidth and latency in nccl-tests columns.
//!
//! For every size from `-b` to `-e` (multiplied by `-f`), every rank runs `--warmup` untimed and
//! `--iters` timed iterations of the collective, keeping `--inflight` iterations in flight (each
//! on its own set of buffers: a launch owns its buffers until it completes; default
//! [`DEFAULT_INFLIGHT`]; 1 times each collective alone, its latency). The time of a size is
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
//! copy-in leaves it); reduce-scatters and all-reduces out of place (sum). Sizes are rounded
//! down to whole elements per rank (and per tensor with `--coalesce`). `--check` fills inputs
//! with rank-dependent values exact in every type and counts output elements that differ
//! (bitwise) from a reference summed in f32 in rank order and rounded once; any wrong element
//! makes the exit status 1.
//!
//! Reference lines, measured in the same run: from a largest size of
//! [`CONCURRENT_MIN_BYTES`] up, the aggregate bandwidth of one streaming copy of the largest
//! size per core at once; from [`BOUND_MIN_BYTES`] up, the op's **memory bound**: with every
//! byte moved once with streaming stores, S bytes cost 2(n-1)S of traffic for an all-gather,
//! (n+1)S for a reduce-scatter and (3n-1)S for an all-reduce, against 2 bytes of traffic per
//! byte copied ([`BenchPlan::memory_bound_busbw`]). Measurements: `benches/README.md`.
//!
//! The engine is generic over [`Backend`](crate::backend::Backend): a backend's command line
//! builds its ranks, runs [`run_rank`] on each with one shared [`Collector`] and [`Printer`],
//! and reports [`first_failure`]. `src/cli/bench.rs` only parses flags into a [`BenchSpec`].

mod collector;
pub mod kernel;
mod printer;
mod rank;

pub use collector::{BreakOnPanic, Collector, ProcessRows, RowExchange};
pub use printer::{memcpy_bandwidth, memcpy_concurrent_bandwidth, Printer, Reference};
pub use rank::{bench_rank, collect_rank, run_rank};

use crate::kernels::ElemType;

/// The second reference line (concurrent memcpy) is printed from this largest size up.
pub const CONCURRENT_MIN_BYTES: usize = 16 << 20;

/// The memory-bound line is printed from this largest size up (256 MiB): the copies it is
/// computed from must not fit in the last-level cache (105 MiB on the machine these numbers
/// come from), or it is a cache bound that no collective of that size reaches.
pub const BOUND_MIN_BYTES: usize = 256 << 20;

/// Default of `--inflight`: iterations kept in flight by each rank (each needs its own set of
/// buffers).
pub const DEFAULT_INFLIGHT: usize = 2;
/// Most iterations `--inflight` keeps in flight.
pub const MAX_INFLIGHT: usize = 64;

/// The collective (or copy kernel) to measure.
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
    /// The copy-in kernel on one device: `--coalesce` pieces packed into one buffer
    /// ([`kernel`]).
    #[value(name = "copy_in")]
    CopyIn,
    /// The copy-out kernel on one device: one buffer's `--coalesce` pieces unpacked into another
    /// ([`kernel`]).
    #[value(name = "copy_out")]
    CopyOut,
}

impl BenchOp {
    /// Whether this is a copy kernel of one device rather than a collective.
    pub fn is_kernel(self) -> bool {
        matches!(self, BenchOp::CopyIn | BenchOp::CopyOut)
    }
}

/// What to measure, as given (flags or a caller's values); [`BenchPlan::new`] checks it.
#[derive(Clone, Debug)]
pub struct BenchSpec {
    /// The collective.
    pub op: BenchOp,
    /// Number of ranks.
    pub ranks: usize,
    /// Element type.
    pub elem: ElemType,
    /// Smallest size in bytes of the whole buffer.
    pub min_bytes: usize,
    /// Largest size in bytes.
    pub max_bytes: usize,
    /// Factor between successive sizes (at least 2).
    pub factor: usize,
    /// Timed iterations per size.
    pub iters: usize,
    /// Untimed iterations per size before the timed ones.
    pub warmup: usize,
    /// Fill inputs with rank-dependent values and count wrong output elements.
    pub check: bool,
    /// Split each size into this many tensors: one grouped launch against as many separate ones.
    pub coalesce: usize,
    /// Iterations kept in flight (1 to [`MAX_INFLIGHT`]; [`DEFAULT_INFLIGHT`]).
    pub inflight: usize,
}

/// A message naming the setting that is out of range, or a rank's failure.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BenchError(pub String);

impl From<String> for BenchError {
    fn from(s: String) -> Self {
        BenchError(s)
    }
}

impl From<&str> for BenchError {
    fn from(s: &str) -> Self {
        BenchError(s.to_owned())
    }
}

/// What every rank measures: a checked [`BenchSpec`] with its list of sizes.
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
    /// Iterations in flight.
    pub inflight: usize,
}

impl BenchPlan {
    /// Validates the flags and lists the sizes.
    ///
    /// # Errors
    /// A message naming the flag that is out of range.
    pub fn new(a: &BenchSpec) -> Result<Self, BenchError> {
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
        if !(1..=MAX_INFLIGHT).contains(&a.inflight) {
            return Err(format!("--inflight {} is out of range: give 1 to {MAX_INFLIGHT}", a.inflight).into());
        }
        let elem = a.elem;
        // The smallest unit a size is rounded down to: whole elements per rank and per tensor.
        if a.op.is_kernel() && a.ranks != 1 {
            return Err(format!(
                "--op {:?} measures one device's copy kernel: give --ranks 1 (or leave --ranks out), not {}",
                a.op, a.ranks
            )
            .into());
        }
        let unit = match a.op {
            BenchOp::AllReduce => elem.size() * a.coalesce,
            // Whole aligned pieces.
            BenchOp::CopyIn | BenchOp::CopyOut => kernel::ALIGN * a.coalesce,
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
            inflight: a.inflight,
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
            BenchOp::CopyIn | BenchOp::CopyOut => return None,
        };
        // algbw = S / t with t = traffic / (2 copy).
        Some(2.0 * copy / traffic_per_byte * self.bus_factor())
    }

    /// Bytes the whole bench holds at once at its largest size, over every rank: each rank's
    /// `inflight` sets of buffers (an all-gather's output, a reduce-scatter's input and
    /// output, an all-reduce's input and output) and the two buffers of the memcpy reference;
    /// for a copy kernel, its two sides and the reference's.
    pub fn memory_needed(&self) -> usize {
        let size = self.sizes.last().copied().unwrap_or(0);
        if self.op.is_kernel() {
            // One packed buffer, its pieces (or a second buffer), and the reference's two.
            return size.saturating_mul(4);
        }
        let per_set = match self.op {
            BenchOp::AllGather => size,
            BenchOp::ReduceScatter => size.saturating_add(size / self.ranks.max(1)),
            BenchOp::AllReduce | BenchOp::CopyIn | BenchOp::CopyOut => size.saturating_mul(2),
        };
        per_set
            .saturating_mul(self.inflight)
            .saturating_mul(self.ranks)
            .saturating_add(size.saturating_mul(2))
    }

    /// Refuses a bench that needs more memory than `available` (the machine's available
    /// memory), naming `-e` and the limit, before anything is allocated.
    ///
    /// # Errors
    /// [`BenchError`] saying how much it needs and how much there is.
    pub fn check_memory(&self, available: usize) -> Result<(), BenchError> {
        let need = self.memory_needed();
        if need > available && self.op.is_kernel() {
            return Err(format!(
                "-e/--maxbytes {}: the bench would hold {need} bytes at once (the kernel's two sides and the \
                 reference's), more than the {available} bytes of memory available; use a smaller -e",
                self.sizes.last().copied().unwrap_or(0)
            )
            .into());
        }
        if need > available {
            return Err(format!(
                "-e/--maxbytes {}: the bench would hold {need} bytes at once ({} ranks x {} buffer sets, and \
                 the memcpy reference), more than the {available} bytes of memory available; use a smaller -e or \
                 fewer ranks or --inflight",
                self.sizes.last().copied().unwrap_or(0),
                self.ranks,
                self.inflight
            )
            .into());
        }
        Ok(())
    }

    /// Elements per tensor (shard per rank for all-gather / reduce-scatter) at `size` bytes.
    pub(crate) fn count_per_tensor(&self, size: usize) -> usize {
        let per = size / self.elem.size() / self.coalesce;
        match self.op {
            BenchOp::AllReduce | BenchOp::CopyIn | BenchOp::CopyOut => per,
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
    /// Seconds per iteration the host spent in the launch calls (grouped launch): a call
    /// returns once its collective is queued, so on a device this stays below `grouped`.
    pub launch: f64,
}

/// The first failure among the ranks' outcomes (as a world's `run` returns them), if any.
///
/// # Errors
/// A rank's error, or `rank R panicked`.
pub fn first_failure(outcomes: Vec<std::thread::Result<Result<(), String>>>) -> Result<(), BenchError> {
    for (r, o) in outcomes.into_iter().enumerate() {
        match o {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(format!("rank {r} panicked").into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
                    inflight: DEFAULT_INFLIGHT,
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
                    BenchOp::CopyIn | BenchOp::CopyOut => unreachable!("not a collective"),
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
    fn memory_needed_counts_every_rank_and_the_reference() {
        let plan = |op, ranks| BenchPlan {
            op,
            ranks,
            elem: ElemType::F32,
            sizes: vec![1 << 20, 1 << 30],
            iters: 1,
            warmup: 0,
            check: false,
            coalesce: 1,
            inflight: DEFAULT_INFLIGHT,
        };
        let g = 1usize << 30;
        assert_eq!(plan(BenchOp::AllGather, 4).memory_needed(), 4 * DEFAULT_INFLIGHT * g + 2 * g);
        assert_eq!(
            plan(BenchOp::ReduceScatter, 4).memory_needed(),
            4 * DEFAULT_INFLIGHT * (g + g / 4) + 2 * g
        );
        assert_eq!(plan(BenchOp::AllReduce, 2).memory_needed(), 2 * DEFAULT_INFLIGHT * 2 * g + 2 * g);
        let p = plan(BenchOp::AllGather, 2);
        assert!(p.check_memory(p.memory_needed()).is_ok());
        let e = p.check_memory(p.memory_needed() - 1).unwrap_err();
        assert!(e.to_string().contains("-e/--maxbytes"), "{e}");
    }
}
