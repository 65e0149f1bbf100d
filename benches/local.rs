//! Criterion benches of the local backend: all-gather and reduce-scatter between 2 ranks at a
//! small and a large size, against a single-thread memcpy of the same bytes in the same run.

use std::hint::black_box;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use collsched::backend::local::{LocalRank, LocalWorld};
use collsched::backend::{Backend, CollDesc, Collective, RankGroup, Stream};
use collsched::kernels::ElemType;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

const WAIT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy)]
enum Op {
    AllGather,
    ReduceScatter,
}

/// Runs `iters` collectives of `bytes` (whole buffer) on `rank`, one at a time, returns the time.
fn run(rank: &LocalRank, op: Op, bytes: usize, iters: u64) -> Duration {
    let n = rank.world_size();
    let count = bytes / 4 / n;
    let group = RankGroup::world(n);
    let make = || match op {
        Op::AllGather => Collective {
            desc: CollDesc::all_gather(group.clone(), ElemType::F32, count),
            input: None,
            output: rank.alloc(n * count * 4).expect("alloc"),
        },
        Op::ReduceScatter => Collective {
            desc: CollDesc::reduce_scatter(group.clone(), ElemType::F32, count),
            input: Some(rank.alloc(n * count * 4).expect("alloc")),
            output: rank.alloc(count * 4).expect("alloc"),
        },
    };
    let stream = match op {
        Op::AllGather => Stream::AllGather,
        Op::ReduceScatter => Stream::ReduceScatter,
    };
    let mut c = make();
    let start = Instant::now();
    for _ in 0..iters {
        let f = rank.launch(stream, &[], c).expect("launch");
        c = f.wait(WAIT).expect("done").pop().expect("one");
    }
    start.elapsed()
}

fn collectives(crit: &mut Criterion) {
    let world = LocalWorld::new(2).expect("world");
    let rank0 = world.rank(0).expect("rank 0");
    let rank1 = world.rank(1).expect("rank 1");
    // Rank 1 mirrors whatever rank 0 runs.
    let (tx, rx) = mpsc::channel::<(Op, usize, u64)>();
    let helper = std::thread::spawn(move || {
        while let Ok((op, bytes, iters)) = rx.recv() {
            run(&rank1, op, bytes, iters);
        }
    });
    let mut g = crit.benchmark_group("local_2_ranks");
    g.sample_size(10);
    for bytes in [4usize << 10, 16 << 20] {
        g.throughput(Throughput::Bytes(bytes as u64));
        for (name, op) in [("all_gather", Op::AllGather), ("reduce_scatter", Op::ReduceScatter)] {
            g.bench_with_input(BenchmarkId::new(name, bytes), &bytes, |b, &bytes| {
                b.iter_custom(|iters| {
                    tx.send((op, bytes, iters)).expect("helper alive");
                    run(&rank0, op, bytes, iters)
                })
            });
        }
        let src = vec![1u8; bytes];
        let mut dst = vec![0u8; bytes];
        g.bench_with_input(BenchmarkId::new("memcpy", bytes), &bytes, |b, _| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
            })
        });
    }
    g.finish();
    drop(tx);
    helper.join().expect("helper");
}

criterion_group!(benches, collectives);
criterion_main!(benches);
