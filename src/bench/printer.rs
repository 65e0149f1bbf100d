//! The table in nccl-tests columns and its reference lines (single-thread and concurrent copy
//! bandwidth, the memory bound), measured in the same run.

use std::process::ExitCode;
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use super::{BenchOp, BenchPlan, RankRow, BOUND_MIN_BYTES};
use crate::kernels::ElemType;

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
        // The copying threads time themselves: with as many threads as cores, the spawning
        // thread may not run again until they are done, so its clock would read nothing.
        let barrier = std::sync::Barrier::new(threads);
        let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
            let handles: Vec<_> = bufs
                .iter_mut()
                .map(|(src, dst)| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        let start = Instant::now();
                        let (n, src) = (dst.len(), std::hint::black_box(&src[..]));
                        // Equal lengths: cannot fail.
                        let _ = crate::kernels::copy_piece(dst, src, n);
                        (start, Instant::now())
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        let first = spans.iter().map(|s| s.0).min();
        let last = spans.iter().map(|s| s.1).max();
        if let (Some(a), Some(b)) = (first, last) {
            best = best.min((b - a).as_secs_f64());
        }
    }
    (bytes * threads) as f64 / best
}

/// Prints the table (rank 0's thread prints each row once every rank handed it in).
pub struct Printer {
    plan: BenchPlan,
    backend: &'static str,
    memcpy: f64,
    /// What the copy reference is (the header's line): a single-thread host copy by default.
    pub copy_name: String,
    /// Optional second reference: (threads, aggregate bytes/s of that many concurrent copies).
    pub concurrent: Option<(usize, f64)>,
    /// Columns of other implementations of the same collective, measured in the same run, in
    /// the order they are printed.
    pub references: Vec<Reference>,
    state: Mutex<PrinterState>,
}

/// Another implementation's times, printed as three columns after the table's own:
/// `{tag}_time`, `{tag}_busbw` and `x_{tag}` (its time over this one's: above 1, this one is
/// faster).
#[derive(Clone, Debug, PartialEq)]
pub struct Reference {
    /// The columns' prefix (`ref`, `shm`).
    pub tag: &'static str,
    /// What it is, for the line above the table.
    pub name: String,
    /// Seconds per iteration at each size (`plan.sizes` order; NaN where it has none).
    pub times: Vec<f64>,
}

#[derive(Default)]
struct PrinterState {
    wrong: u64,
    busbw_sum: f64,
    rows: usize,
    last_busbw: f64,
    /// Each row's slowest rank's launch time and iteration time (seconds).
    launch: Vec<(f64, f64)>,
}

fn type_name(e: ElemType) -> &'static str {
    e.name()
}

impl Printer {
    /// A printer for `plan`, with the memcpy reference (bytes/s).
    pub fn new(plan: &BenchPlan, backend: &'static str, memcpy: f64) -> Self {
        Printer {
            plan: plan.clone(),
            backend,
            memcpy,
            copy_name: "single-thread copy".to_string(),
            concurrent: None,
            references: Vec::new(),
            state: Mutex::default(),
        }
    }

    /// The lines before the table.
    pub fn header(&self) {
        let p = &self.plan;
        let op = match p.op {
            BenchOp::AllGather => "all_gather (in place)",
            BenchOp::ReduceScatter => "reduce_scatter (sum, out of place)",
            BenchOp::AllReduce => "all_reduce (sum, out of place)",
            BenchOp::CopyIn => "copy_in",
            BenchOp::CopyOut => "copy_out",
        };
        println!(
            "# collsched bench: {op}, {} ranks ({} backend), {}, {} iterations after {} warm-up, {} in flight{}",
            p.ranks,
            self.backend,
            p.elem.name(),
            p.iters,
            p.warmup,
            p.inflight,
            if p.check { ", checked" } else { "" }
        );
        let largest = p.sizes.last().copied().unwrap_or(0).max(4096);
        println!(
            "# memcpy reference: {} of {} bytes: {:.2} GB/s",
            self.copy_name,
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
        for r in &self.references {
            let tag = r.tag;
            println!("# {tag}_*: {}, the same sizes in the same run; x_{tag}: its time / this time", r.name);
            h1 += &format!(
                " {:>10} {:>9} {:>6}",
                format!("{tag}_time"),
                format!("{tag}_busbw"),
                format!("x_{tag}")
            );
            h2 += &format!(" {:>10} {:>9} {:>6}", "(us)", "(GB/s)", "");
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
        let at = p.sizes.iter().position(|&s| s == size);
        for reference in &self.references {
            match at.and_then(|i| reference.times.get(i)).filter(|r| r.is_finite()) {
                Some(&r) => {
                    let rb = size as f64 / r / 1e9 * p.bus_factor();
                    line += &format!(" {:>10.2} {:>9.2} {:>6.2}", r * 1e6, rb, r / t);
                }
                None => line += &format!(" {:>10} {:>9} {:>6}", "-", "-", "-"),
            }
        }
        println!("{line}");
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.wrong += wrong;
        st.busbw_sum += busbw;
        st.rows += 1;
        st.last_busbw = busbw;
        st.launch.push((rows.iter().map(|r| r.launch).fold(0.0, f64::max), t));
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
        if !st.launch.is_empty() {
            let each: Vec<String> =
                st.launch.iter().map(|(l, t)| format!("{:.2}/{:.2}", l * 1e6, t * 1e6)).collect();
            println!(
                "# host in launch calls / iteration time (us, each the largest over ranks, per row): {}",
                each.join(" ")
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two threads copying at once cannot move more than a small multiple of what one moves:
    /// the spawning thread once timed nothing (starved on a machine with as many cores as
    /// threads) and printed bandwidths of hundreds of TB/s.
    #[test]
    fn concurrent_copies_are_timed_by_the_copying_threads() {
        let one = memcpy_bandwidth(16 << 20);
        let two = memcpy_concurrent_bandwidth(16 << 20, 2);
        assert!(one.is_finite() && two.is_finite() && one > 0.0 && two > 0.0, "{one} {two}");
        assert!(two < 20.0 * one, "two threads {two:e} B/s against one {one:e} B/s");
    }
}
