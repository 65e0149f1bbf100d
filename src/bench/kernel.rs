//! `collsched bench --op copy_in|copy_out`: the copy kernels of one device against a plain copy
//! of the same bytes on it, measured in the same run.
//!
//! For every size the bytes are split into `--coalesce` pieces (a unit's parameters), each a
//! whole number of [`ALIGN`] bytes (sizes are rounded down to that). `copy_in` packs the
//! pieces, each in a buffer of its own after [`ALIGN`] bytes of padding, into one buffer
//! ([`Backend::pack`], FSDP's copy-in before an all-gather); `copy_out` unpacks one buffer's
//! pieces into another at other offsets ([`Backend::unpack`]). The pieces land in reverse
//! order, so a kernel that ignored an offset on either side would be counted wrong.
//!
//! Timing: [`warmup_launches`] untimed launches, then `--iters` timed launches back to back on
//! the compute stream, the host polling once, after the last, without a pause: the time is the
//! total over the launches (what a queue of copies sustains), and `launch` the host's time in
//! the launch calls, which on a device stays below it. The reference copies the same bytes the
//! same way, as many times (the caller's: a host `memcpy` for `local`, `cuMemcpyDtoDAsync` for
//! `cuda`).
//!
//! With `--check` the result is zeroed before the timed launches, then every element of it is
//! compared with the pieces put together on the host by slicing; any wrong element makes the
//! exit status 1, as does a time that is not a positive number.

use std::time::{Duration, Instant};

use super::rank::{encode_into, value};
use super::{BenchOp, BenchPlan};
use crate::backend::{Backend, BackendBuffer, BackendError, BackendEvent, Stream};
use crate::kernels::CopySegment;

/// The kernels' bandwidth is compared with the reference's from this size up (the goal: at
/// least 0.8x of a device copy from 64 MiB).
pub const KERNEL_GOAL_MIN_BYTES: usize = 64 << 20;

/// Every piece is a whole number of these bytes, and starts at a multiple of them (parameters'
/// storage is at least this aligned; the CUDA copy kernels move 16 bytes at a time where
/// both sides allow it).
pub const ALIGN: usize = 16;

/// One size's measurement.
#[derive(Clone, Debug)]
pub struct KernelRow {
    /// Bytes of the packed buffer.
    pub size: usize,
    /// Seconds per launch of the kernel (`iters` back to back, waited for once).
    pub time: f64,
    /// Seconds per launch the host spent in the launch calls.
    pub launch: f64,
    /// Seconds per copy of the reference, timed the same way.
    pub reference: f64,
    /// Wrong elements (with `--check`; 0 otherwise).
    pub wrong: u64,
}

impl KernelRow {
    /// The kernel's bandwidth as a fraction of the reference's.
    pub fn vs_reference(&self) -> f64 {
        self.reference / self.time
    }
}

/// Elements of padding before each piece in its own source buffer (copy_in): 16 bytes, so a
/// kernel that ignored a source offset is counted wrong and the pieces stay 16-byte aligned.
fn source_pad(plan: &BenchPlan) -> usize {
    ALIGN / plan.elem.size()
}

/// Where each piece of `size` bytes lands: `pieces` runs of equal length, piece `k` of the many
/// side at the packed offset of piece `pieces - 1 - k`. Offsets count elements.
fn segments(plan: &BenchPlan, size: usize) -> Vec<CopySegment> {
    let pieces = plan.coalesce;
    let len = size / plan.elem.size() / pieces;
    let pad = source_pad(plan);
    (0..pieces)
        .map(|k| match plan.op {
            // One source buffer per piece, the piece after `pad` elements of it.
            BenchOp::CopyIn => {
                CopySegment { buffer: k, buffer_offset: pad, packed_offset: (pieces - 1 - k) * len, len }
            }
            // One destination buffer, the pieces at other offsets of it.
            _ => {
                CopySegment { buffer: 0, buffer_offset: k * len, packed_offset: (pieces - 1 - k) * len, len }
            }
        })
        .collect()
}

/// Waits for `event` by polling it without a pause (a host wait's backoff would add up to a
/// millisecond to the time), at most `timeout`.
fn spin<E: BackendEvent>(event: &E, timeout: Duration) -> Result<(), BackendError> {
    let start = Instant::now();
    while !event.query()? {
        if start.elapsed() > timeout {
            return Err(BackendError::EventTimeout { waited: timeout });
        }
        std::hint::spin_loop();
    }
    Ok(())
}

/// One size on `b`: buffers filled, the kernel warmed up, the result zeroed, the kernel timed,
/// the result checked, buffers freed.
fn measure<B: Backend>(b: &B, plan: &BenchPlan, size: usize) -> Result<(f64, f64, u64), BackendError> {
    let es = plan.elem.size();
    let segs = segments(plan, size);
    let len = segs.first().map_or(0, |s| s.len);
    let mut host = Vec::new();
    // The many side's bytes on the host: piece k (copy_in: source k; copy_out: the packed run
    // at k's packed offset) holds values of "rank" k.
    let piece = |k: usize, host: &mut Vec<u8>| encode_into(plan.elem, host, (0..len).map(|i| value(k, i)));
    let mut packed = b.alloc(size)?;
    let (mut sources, mut dst) = (Vec::new(), None);
    match plan.op {
        BenchOp::CopyIn => {
            let pad = source_pad(plan);
            for k in 0..plan.coalesce {
                let mut src = b.alloc((pad + len) * es)?;
                piece(k, &mut host);
                b.write_from_host(&mut src, pad * es, &host)?;
                sources.push(src);
            }
        }
        _ => {
            for (k, s) in segs.iter().enumerate() {
                piece(k, &mut host);
                b.write_from_host(&mut packed, s.packed_offset * es, &host)?;
            }
            dst = Some(b.alloc(size)?);
        }
    }
    let refs: Vec<&B::Buffer> = sources.iter().collect();
    let timeout = b.timeout();
    let run =
        |n: usize, packed: &mut B::Buffer, dst: &mut Option<B::Buffer>| -> Result<Duration, BackendError> {
            let (mut launching, mut last) = (Duration::ZERO, None);
            for _ in 0..n {
                let t0 = Instant::now();
                let event = match dst {
                    None => b.pack(Stream::Compute, packed, &refs, &segs, es)?,
                    Some(d) => b.unpack(Stream::Compute, d, packed, &segs, es)?,
                };
                launching += t0.elapsed();
                last = event.or(last);
            }
            if let Some(e) = last {
                spin(&e, timeout)?;
            }
            Ok(launching)
        };
    run(warmup_launches(plan), &mut packed, &mut dst)?;
    // The result zeroed: what the check finds was written by the timed launches.
    let out = dst.as_mut().unwrap_or(&mut packed);
    let out_len = out.len();
    b.zero(Stream::Compute, out, 0, out_len)?;
    b.synchronize(Stream::Compute, timeout)?;
    let start = Instant::now();
    let launching = run(plan.iters, &mut packed, &mut dst)?;
    let total = start.elapsed().as_secs_f64();
    let out = dst.as_ref().unwrap_or(&packed);
    let wrong = if plan.check { count_wrong(b, plan, &segs, out)? } else { 0 };
    drop(refs);
    b.free(packed, None);
    for m in sources.into_iter().chain(dst) {
        b.free(m, None);
    }
    let n = plan.iters as f64;
    Ok((total / n, launching.as_secs_f64() / n, wrong))
}

/// Elements of `out` (copy_in: the packed buffer; copy_out: the destination) that differ
/// (bitwise) from the pieces put together on the host.
fn count_wrong<B: Backend>(
    b: &B,
    plan: &BenchPlan,
    segs: &[CopySegment],
    out: &B::Buffer,
) -> Result<u64, BackendError> {
    let es = plan.elem.size();
    let mut got = vec![0u8; out.len()];
    b.read_to_host(out, 0, &mut got)?;
    let mut want = vec![0u8; out.len()];
    let mut host = Vec::new();
    for (k, s) in segs.iter().enumerate() {
        let at = match plan.op {
            BenchOp::CopyIn => s.packed_offset,
            _ => s.buffer_offset,
        };
        encode_into(plan.elem, &mut host, (0..s.len).map(|i| value(k, i)));
        want[at * es..(at + s.len) * es].copy_from_slice(&host);
    }
    Ok(got.chunks_exact(es).zip(want.chunks_exact(es)).filter(|(g, w)| g != w).count() as u64)
}

/// The whole kernel bench on `b` (one rank's device): every size of `plan`, each row handed to
/// `print` with `reference(size)`, the reference's seconds per copy of `size` bytes. Returns
/// the rows.
///
/// # Errors
/// A backend failure, the reference's, or a time that is not a positive number (a short or
/// broken run), naming the size.
pub fn bench_kernel<B: Backend>(
    b: &B,
    plan: &BenchPlan,
    reference: &dyn Fn(usize) -> Result<f64, String>,
    print: &mut dyn FnMut(&KernelRow),
) -> Result<Vec<KernelRow>, String> {
    let mut rows = Vec::with_capacity(plan.sizes.len());
    for &size in &plan.sizes {
        let (time, launch, wrong) = measure(b, plan, size).map_err(|e| format!("{size} bytes: {e}"))?;
        let reference = reference(size)?;
        for (what, t) in [("the kernel's time", time), ("the reference's time", reference)] {
            if !(t.is_finite() && t > 0.0) {
                return Err(format!("{size} bytes: {what} per launch is {t} s, not a positive number"));
            }
        }
        let row = KernelRow { size, time, launch, reference, wrong };
        print(&row);
        rows.push(row);
    }
    Ok(rows)
}

/// Untimed launches before the timed ones, for the kernels and the references alike: `--warmup`,
/// but at least as many as timed (the pool and the staging of the argument tables grow to what
/// the timed launches need before the clock starts).
pub fn warmup_launches(plan: &BenchPlan) -> usize {
    plan.warmup.max(plan.iters).max(1)
}

/// A host copy of `bytes` bytes timed as the kernels are (`warmup` untimed, then `iters` back
/// to back): the reference of the `local` backend, whose kernels run on the calling thread.
pub fn host_copy_seconds(bytes: usize, warmup: usize, iters: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    for _ in 0..warmup.max(1) {
        dst.copy_from_slice(std::hint::black_box(&src));
    }
    let start = Instant::now();
    for _ in 0..iters.max(1) {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    start.elapsed().as_secs_f64() / iters.max(1) as f64
}

/// The table's lines before the rows.
pub fn header(plan: &BenchPlan, backend: &str, reference: &str) {
    let op = match plan.op {
        BenchOp::CopyIn => "copy_in (pieces packed into one buffer)",
        _ => "copy_out (one buffer's pieces unpacked into another)",
    };
    println!(
        "# collsched bench: {op}, {} pieces of whole {ALIGN}-byte multiples, {} backend, {}, {} launches back to \
         back after {} untimed",
        plan.coalesce,
        backend,
        plan.elem.name(),
        plan.iters,
        warmup_launches(plan)
    );
    println!("# reference, measured in the same run: {reference}, the same bytes timed the same way");
    println!(
        "# {:>12} {:>12} {:>5} {:>7} {:>10} {:>8} {:>10} {:>10} {:>8} {:>7} {:>7}",
        "size",
        "count",
        "type",
        "pieces",
        "time(us)",
        "GB/s",
        "launch(us)",
        "ref(us)",
        "ref_GB/s",
        "vs_ref",
        "#wrong"
    );
}

/// One row of the table.
pub fn row(plan: &BenchPlan, r: &KernelRow) {
    let bw = |t: f64| r.size as f64 / t / 1e9;
    println!(
        "  {:>12} {:>12} {:>5} {:>7} {:>10.2} {:>8.2} {:>10.2} {:>10.2} {:>8.2} {:>7.3} {:>7}",
        r.size,
        r.size / plan.elem.size(),
        plan.elem.name(),
        plan.coalesce,
        r.time * 1e6,
        bw(r.time),
        r.launch * 1e6,
        r.reference * 1e6,
        bw(r.reference),
        r.vs_reference(),
        if plan.check { r.wrong.to_string() } else { "N/A".to_string() }
    );
}

/// The lines after the table: the wrong elements, and from [`KERNEL_GOAL_MIN_BYTES`] up the
/// kernel's bandwidth against the reference's. `true` when nothing was wrong.
pub fn footer(rows: &[KernelRow]) -> bool {
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    println!("# wrong elements: {wrong}");
    let big: Vec<f64> =
        rows.iter().filter(|r| r.size >= KERNEL_GOAL_MIN_BYTES).map(KernelRow::vs_reference).collect();
    match (big.iter().copied().reduce(f64::min), big.iter().copied().reduce(f64::max)) {
        (Some(lo), Some(hi)) => println!(
            "# from {} MiB up: the kernel's bandwidth is {lo:.3}x-{hi:.3}x of the reference's (goal: at least 0.8x)",
            KERNEL_GOAL_MIN_BYTES >> 20
        ),
        _ => println!("# no size of {} MiB or more: no comparison against the goal", KERNEL_GOAL_MIN_BYTES >> 20),
    }
    wrong == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ElemType;

    fn plan(op: BenchOp, pieces: usize) -> BenchPlan {
        BenchPlan {
            op,
            ranks: 1,
            elem: ElemType::BF16,
            sizes: vec![2 * 6 * pieces],
            iters: 1,
            warmup: 0,
            check: true,
            coalesce: pieces,
            inflight: 1,
        }
    }

    /// The check counts an element the kernel left wrong, and only that one.
    #[test]
    fn the_check_counts_a_wrong_element() {
        use crate::backend::local::{LocalConfig, LocalWorld};
        let world = LocalWorld::with_config(1, LocalConfig::default()).unwrap();
        let counts = world
            .run(|b| {
                let mut p = plan(BenchOp::CopyIn, 3);
                p.elem = ElemType::F32;
                p.sizes = vec![4 * 6 * 3];
                let segs = segments(&p, p.sizes[0]);
                let mut sources = Vec::new();
                let mut host = Vec::new();
                let pad = source_pad(&p);
                for k in 0..3 {
                    let mut src = b.alloc((pad + 6) * 4).unwrap();
                    encode_into(p.elem, &mut host, (0..6).map(|i| value(k, i)));
                    b.write_from_host(&mut src, pad * 4, &host).unwrap();
                    sources.push(src);
                }
                let mut packed = b.alloc(p.sizes[0]).unwrap();
                let refs: Vec<_> = sources.iter().collect();
                assert!(b.pack(Stream::Compute, &mut packed, &refs, &segs, 4).unwrap().is_none());
                let right = count_wrong(&b, &p, &segs, &packed).unwrap();
                b.write_from_host(&mut packed, 4 * 7, &1234.5f32.to_le_bytes()).unwrap();
                (right, count_wrong(&b, &p, &segs, &packed).unwrap())
            })
            .unwrap();
        assert_eq!(counts.into_iter().map(|c| c.unwrap()).collect::<Vec<_>>(), vec![(0, 1)]);
    }

    /// Every element of the packed side is covered exactly once, by reversed pieces.
    #[test]
    fn the_pieces_tile_both_sides_in_reverse() {
        for op in [BenchOp::CopyIn, BenchOp::CopyOut] {
            for pieces in [1, 2, 5] {
                let p = plan(op, pieces);
                let segs = segments(&p, p.sizes[0]);
                assert_eq!(segs.len(), pieces);
                let mut packed = vec![0u32; 6 * pieces];
                let mut many = vec![0u32; 6 * pieces];
                for (k, s) in segs.iter().enumerate() {
                    assert_eq!(s.len, 6);
                    if op == BenchOp::CopyIn {
                        assert_eq!(s.buffer_offset, ALIGN / 2, "bf16: 16 bytes of padding first");
                    }
                    assert_eq!(s.packed_offset, (pieces - 1 - k) * 6);
                    packed[s.packed_offset..s.packed_offset + s.len].iter_mut().for_each(|x| *x += 1);
                    let at = if op == BenchOp::CopyIn { s.len * s.buffer } else { s.buffer_offset };
                    many[at..at + s.len].iter_mut().for_each(|x| *x += 1);
                }
                assert!(packed.iter().chain(&many).all(|&x| x == 1), "{op:?} {pieces}: {packed:?} {many:?}");
            }
        }
    }
}
