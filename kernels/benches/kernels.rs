//! Throughput of the CPU kernels against a plain `memcpy` of the same size, in the same run.
//!
//! `size` is the byte length of each kernel's output buffer (the packed buffer for copy-in, the
//! per-parameter buffers together for copy-out, the reduced buffer, the cast's destination);
//! criterion's throughput is that size per second, so `kernel / memcpy` ratios read directly.
//! A reduction of k inputs moves (k + 1) x size bytes; a cast f32 -> bf16 reads 2 x size.
//!
//! Run: `cargo bench -p collsched-kernels -- --warm-up-time 1 --measurement-time 2`.

use std::hint::black_box;

use collsched_kernels::{
    cast, copy_in, copy_out, reduce, reference, CopySegment, ElemType, ReduceOp, Scaling,
};
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};

const SIZES: [(usize, &str); 2] = [(1 << 20, "1MiB"), (64 << 20, "64MiB")];

/// Segments per bucket for copy-in / copy-out: a bucket of many parameters' shards.
const SEGMENTS: usize = 512;

/// Deterministic, varied segment lengths (in elements) summing to `total`.
fn segment_lens(total: usize) -> Vec<usize> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let weights: Vec<u64> = (0..SEGMENTS)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            1 + state % 64
        })
        .collect();
    let sum: u64 = weights.iter().sum();
    let mut lens: Vec<usize> = weights.iter().map(|&w| (total as u64 * w / sum) as usize).collect();
    let short = total - lens.iter().sum::<usize>();
    lens[0] += short;
    lens
}

/// `n` bytes of varied, finite values of type `ty`.
fn filled(ty: ElemType, n: usize, seed: u32) -> Vec<u8> {
    let f: Vec<u8> = (0..n / ty.size())
        .map(|i| ((i as u32 ^ seed) % 1000) as f32 * 0.37 - 100.0)
        .flat_map(f32::to_le_bytes)
        .collect();
    let mut out = vec![0u8; n];
    cast(ElemType::F32, &f, ty, &mut out).expect("lengths match");
    out
}

fn memcpy(g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>, size: usize) {
    let src = vec![1u8; size];
    let mut dst = vec![0u8; size];
    g.bench_function("memcpy", |b| b.iter(|| dst.copy_from_slice(black_box(&src))));
}

fn copies(g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>, size: usize) {
    let elem = 4;
    let lens = segment_lens(size / elem);
    let shards: Vec<Vec<u8>> = lens.iter().map(|&n| vec![3u8; n * elem]).collect();
    let mut at = 0;
    let segs: Vec<CopySegment> = lens
        .iter()
        .enumerate()
        .map(|(buffer, &len)| {
            let s = CopySegment { buffer, buffer_offset: 0, packed_offset: at, len };
            at += len;
            s
        })
        .collect();
    let sources: Vec<&[u8]> = shards.iter().map(|s| &s[..]).collect();
    let mut packed = vec![0u8; size];
    g.bench_function(format!("copy_in/{SEGMENTS}seg"), |b| {
        b.iter(|| copy_in(&mut packed, black_box(&sources), &segs, elem).expect("valid segments"))
    });
    let mut outs = shards.clone();
    let mut dests: Vec<&mut [u8]> = outs.iter_mut().map(|s| &mut s[..]).collect();
    g.bench_function(format!("copy_out/{SEGMENTS}seg"), |b| {
        b.iter(|| copy_out(&mut dests, black_box(&packed), &segs, elem).expect("valid segments"))
    });
}

fn reductions(g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>, size: usize) {
    for ty in [ElemType::F32, ElemType::BF16] {
        for k in [2usize, 8] {
            let inputs: Vec<Vec<u8>> = (0..k).map(|r| filled(ty, size, r as u32)).collect();
            let refs: Vec<&[u8]> = inputs.iter().map(|v| &v[..]).collect();
            let mut out = vec![0u8; size];
            // FSDP-style scaling: pre-divide by 2, average over the inputs.
            let s = Scaling { pre_divide: 2.0, post_divide: 1.0 };
            g.bench_function(format!("reduce_avg/{}/{k}in", ty.name()), |b| {
                b.iter(|| reduce(ty, ReduceOp::Avg, s, &mut out, black_box(&refs)).expect("lengths match"))
            });
            if size <= 1 << 20 && k == 2 {
                g.bench_function(format!("reduce_avg/{}/{k}in/scalar_reference", ty.name()), |b| {
                    b.iter(|| {
                        reference::reduce(ty, ReduceOp::Avg, s, &mut out, black_box(&refs))
                            .expect("lengths match")
                    })
                });
            }
        }
    }
}

fn casts(g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>, size: usize) {
    for (from, to) in [(ElemType::F32, ElemType::BF16), (ElemType::BF16, ElemType::F32)] {
        let n = size / to.size();
        let src = filled(from, n * from.size(), 7);
        let mut dst = vec![0u8; size];
        g.bench_function(format!("cast/{}_to_{}", from.name(), to.name()), |b| {
            b.iter(|| cast(from, black_box(&src), to, &mut dst).expect("lengths match"))
        });
    }
}

fn kernels(c: &mut Criterion) {
    for (size, name) in SIZES {
        let mut g = c.benchmark_group(format!("kernels_{name}"));
        g.throughput(Throughput::Bytes(size as u64));
        if size > 8 << 20 {
            g.sample_size(10);
        }
        memcpy(&mut g, size);
        copies(&mut g, size);
        reductions(&mut g, size);
        casts(&mut g, size);
        g.finish();
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
