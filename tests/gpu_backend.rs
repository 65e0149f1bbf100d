//! GPU tests of the CUDA backend: every kernel and collective against the CPU kernels, events,
//! deferred frees and the pool's steady state.
//!
//! They run only with `COLLSCHED_GPU=1` and a CUDA device (and NCCL for the collectives:
//! `COLLSCHED_NCCL_LIB`); otherwise each prints `skipped: ...` and passes without checking
//! anything. Collectives run on a world of every visible GPU (at most 4), one thread per GPU.
#![cfg(feature = "cuda")]

use std::time::Duration;

use collsched::backend::cuda::{CudaBackend, CudaBuffer, CudaConfig, UniqueId};
use collsched::backend::{Backend, BackendBuffer, BackendEvent, CollDesc, Collective, RankGroup, Stream};
use collsched_kernels::{
    accumulate, cast, copy_in, copy_out, reduce, CopySegment, ElemType, ReduceOp, Scaling,
};
use half::{bf16, f16};

const WAIT: Duration = Duration::from_secs(60);

#[path = "support/gpu.rs"]
mod gpu;
#[path = "support/hold.rs"]
mod hold;
use hold::{block_stream, STALLED};

/// Number of GPUs to use (at most 4), or `None` (and a printed reason) when the GPU tests must skip.
fn gpus(test: &str) -> usize {
    gpu::gpus(test, 4)
}

/// A one-rank backend on device 0 (NCCL world of one).
fn single() -> CudaBackend {
    let id = UniqueId::generate().expect("ncclGetUniqueId (is COLLSCHED_NCCL_LIB set?)");
    CudaBackend::new(CudaConfig::new(0, 1, 0), &id).expect("one-rank CUDA backend")
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        ((self.next() % 2_000_001) as f32 - 1_000_000.0) / 1000.0
    }
}

fn encode(ty: ElemType, v: &[f32]) -> Vec<u8> {
    match ty {
        ElemType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ElemType::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
        ElemType::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
    }
}

/// Equal bytes, except that two NaNs of the element type count as equal (payloads may differ).
fn assert_same(ty: ElemType, got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let es = ty.size();
    for (i, (g, w)) in got.chunks(es).zip(want.chunks(es)).enumerate() {
        if g == w {
            continue;
        }
        let nan = |b: &[u8]| match ty {
            ElemType::F32 => f32::from_le_bytes(b.try_into().unwrap()).is_nan(),
            ElemType::F16 => f16::from_le_bytes(b.try_into().unwrap()).is_nan(),
            ElemType::BF16 => bf16::from_le_bytes(b.try_into().unwrap()).is_nan(),
        };
        assert!(nan(g) && nan(w), "{what}: element {i} is {g:?} on the GPU, {w:?} on the CPU");
    }
}

fn upload(b: &CudaBackend, bytes: &[u8]) -> CudaBuffer {
    let mut buf = b.alloc(bytes.len()).unwrap();
    b.write_from_host(&mut buf, 0, bytes).unwrap();
    buf
}

fn download(b: &CudaBackend, buf: &CudaBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.len()];
    b.read_to_host(buf, 0, &mut out).unwrap();
    out
}

const TYPES: [ElemType; 3] = [ElemType::F32, ElemType::F16, ElemType::BF16];

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gpu_copy_in_and_copy_out_match_the_cpu() {
    gpus("gpu_copy_in_and_copy_out_match_the_cpu");
    let b = single();
    let mut rng = Rng(0x5eed);
    // Odd sizes, unaligned offsets, and one run long enough to be split into pieces.
    let lens = [17usize, 257, 4099, 300_000];
    let sources: Vec<Vec<u8>> =
        lens.iter().map(|&n| (0..n * 2).map(|_| rng.next() as u8).collect()).collect();
    let mut segments = Vec::new();
    let mut packed_at = 0;
    for (i, &n) in lens.iter().enumerate() {
        let (off, len) = (i % 3, n - i % 3 - 1);
        segments.push(CopySegment { buffer: i, buffer_offset: off, packed_offset: packed_at, len });
        packed_at += len + 1;
    }
    let packed_len = packed_at * 2;
    let mut want = vec![0u8; packed_len];
    copy_in(&mut want, &sources.iter().map(Vec::as_slice).collect::<Vec<_>>(), &segments, 2).unwrap();

    let dev_sources: Vec<CudaBuffer> = sources.iter().map(|s| upload(&b, s)).collect();
    let packed = upload(&b, &vec![0u8; packed_len]);
    let refs: Vec<&CudaBuffer> = dev_sources.iter().collect();
    b.copy_in(Stream::Compute, &packed, &refs, &segments, 2).unwrap().wait(WAIT).unwrap();
    assert_eq!(download(&b, &packed), want, "copy_in");

    let mut cpu_dest: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n * 2]).collect();
    let mut dests: Vec<&mut [u8]> = cpu_dest.iter_mut().map(Vec::as_mut_slice).collect();
    copy_out(&mut dests, &want, &segments, 2).unwrap();
    let dev_dest: Vec<CudaBuffer> = lens.iter().map(|&n| upload(&b, &vec![0u8; n * 2])).collect();
    let refs: Vec<&CudaBuffer> = dev_dest.iter().collect();
    b.copy_out(Stream::Compute, &refs, &packed, &segments, 2).unwrap().wait(WAIT).unwrap();
    for (i, d) in dev_dest.iter().enumerate() {
        assert_eq!(download(&b, d), cpu_dest[i], "copy_out buffer {i}");
    }

    // The same refusal as the CPU kernel, and nothing launched.
    let bad = [CopySegment { buffer: 0, buffer_offset: 10, packed_offset: 0, len: 10 }];
    let e = b.copy_in(Stream::Compute, &packed, &refs[..1], &bad, 2).unwrap_err();
    assert!(e.to_string().contains("overruns"), "{e}");
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gpu_reduce_accumulate_and_cast_match_the_cpu_bit_for_bit() {
    gpus("gpu_reduce_accumulate_and_cast_match_the_cpu_bit_for_bit");
    let b = single();
    let mut rng = Rng(42);
    let n = 4099;
    for ty in TYPES {
        let inputs: Vec<Vec<u8>> =
            (0..3).map(|_| encode(ty, &(0..n).map(|_| rng.f32()).collect::<Vec<_>>())).collect();
        let dev_in: Vec<CudaBuffer> = inputs.iter().map(|i| upload(&b, i)).collect();
        let refs: Vec<&CudaBuffer> = dev_in.iter().collect();
        for (op, scaling) in [
            (ReduceOp::Sum, Scaling::default()),
            (ReduceOp::Avg, Scaling::default()),
            (ReduceOp::Avg, Scaling { pre_divide: 3.0, post_divide: 1.5 }),
            (ReduceOp::Sum, Scaling { pre_divide: 0.7, post_divide: 11.0 }),
        ] {
            let mut want = vec![0u8; n * ty.size()];
            reduce(ty, op, scaling, &mut want, &inputs.iter().map(Vec::as_slice).collect::<Vec<_>>())
                .unwrap();
            let out = b.alloc(n * ty.size()).unwrap();
            b.reduce(Stream::Compute, ty, op, scaling, &out, &refs).unwrap().wait(WAIT).unwrap();
            assert_same(ty, &download(&b, &out), &want, &format!("reduce {ty:?} {op:?} {scaling:?}"));
        }
        let mut acc_cpu = inputs[0].clone();
        accumulate(ty, &mut acc_cpu, &inputs[1]).unwrap();
        b.accumulate(Stream::Compute, ty, &dev_in[0], &dev_in[1]).unwrap().wait(WAIT).unwrap();
        assert_same(ty, &download(&b, &dev_in[0]), &acc_cpu, &format!("accumulate {ty:?}"));
    }
    // Casts over random bit patterns: every rounding case, subnormals, infinities, NaNs.
    let bits: Vec<u8> = (0..n * 4).map(|_| rng.next() as u8).collect();
    for from in TYPES {
        let src_bytes = &bits[..n * from.size()];
        let src = upload(&b, src_bytes);
        for to in TYPES {
            let mut want = vec![0u8; n * to.size()];
            cast(from, src_bytes, to, &mut want).unwrap();
            let dst = b.alloc(n * to.size()).unwrap();
            b.cast(Stream::Compute, from, &src, to, &dst).unwrap().wait(WAIT).unwrap();
            assert_same(to, &download(&b, &dst), &want, &format!("cast {from:?} -> {to:?}"));
        }
    }
}

/// Values whose sums are exact in every element type, so NCCL's summation order cannot matter.
fn exact_values(rank: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + rank * 13) % 31) as f32 - 15.0).collect()
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gpu_collectives_match_the_cpu_on_every_visible_gpu() {
    let world = gpus("gpu_collectives_match_the_cpu_on_every_visible_gpu");
    let id = UniqueId::generate().expect("ncclGetUniqueId (is COLLSCHED_NCCL_LIB set?)");
    let count = 1031;
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            std::thread::spawn(move || {
                let b = CudaBackend::new(CudaConfig::new(rank, world, rank), &id).expect("CUDA backend");
                let group = RankGroup::world(world);
                for ty in TYPES {
                    let es = ty.size();
                    // all-gather, out of place and in place
                    let mine = encode(ty, &exact_values(rank, count));
                    let want: Vec<u8> =
                        (0..world).flat_map(|r| encode(ty, &exact_values(r, count))).collect();
                    let op = Collective {
                        desc: CollDesc::all_gather(group.clone(), ty, count).with_tag(1),
                        input: Some(upload(&b, &mine)),
                        output: b.alloc(count * world * es).unwrap(),
                    };
                    let done = b
                        .launch(Stream::AllGather, &[], op)
                        .map_err(|e| e.error)
                        .unwrap()
                        .wait(WAIT)
                        .unwrap();
                    assert_eq!(download(&b, &done[0].output), want, "all_gather {ty:?} rank {rank}");
                    let mut inplace = b.alloc(count * world * es).unwrap();
                    b.write_from_host(&mut inplace, rank * count * es, &mine).unwrap();
                    let op = Collective {
                        desc: CollDesc::all_gather(group.clone(), ty, count).with_tag(2),
                        input: None,
                        output: inplace,
                    };
                    let done = b
                        .launch(Stream::AllGather, &[], op)
                        .map_err(|e| e.error)
                        .unwrap()
                        .wait(WAIT)
                        .unwrap();
                    assert_eq!(download(&b, &done[0].output), want, "in-place all_gather {ty:?} rank {rank}");

                    // reduce-scatter and all-reduce with avg and pre/post divide, against the CPU
                    let full: Vec<Vec<u8>> =
                        (0..world).map(|r| encode(ty, &exact_values(r, count * world))).collect();
                    let scaling = Scaling { pre_divide: 2.0, post_divide: 1.0 };
                    for op_kind in [ReduceOp::Sum, ReduceOp::Avg] {
                        let chunk =
                            |r: usize, p: usize| full[r][p * count * es..(p + 1) * count * es].to_vec();
                        let mut want = vec![0u8; count * es];
                        let ins: Vec<Vec<u8>> = (0..world).map(|r| chunk(r, rank)).collect();
                        reduce(
                            ty,
                            op_kind,
                            scaling,
                            &mut want,
                            &ins.iter().map(Vec::as_slice).collect::<Vec<_>>(),
                        )
                        .unwrap();
                        let op = Collective {
                            desc: CollDesc::reduce_scatter(group.clone(), ty, count)
                                .with_tag(3)
                                .with_reduce(op_kind, scaling),
                            input: Some(upload(&b, &full[rank])),
                            output: b.alloc(count * es).unwrap(),
                        };
                        let done = b
                            .launch(Stream::ReduceScatter, &[], op)
                            .map_err(|e| e.error)
                            .unwrap()
                            .wait(WAIT)
                            .unwrap();
                        assert_same(
                            ty,
                            &download(&b, &done[0].output),
                            &want,
                            &format!("reduce_scatter {ty:?} {op_kind:?} rank {rank}"),
                        );

                        let ins: Vec<Vec<u8>> = (0..world).map(|r| chunk(r, 0)).collect();
                        reduce(
                            ty,
                            op_kind,
                            scaling,
                            &mut want,
                            &ins.iter().map(Vec::as_slice).collect::<Vec<_>>(),
                        )
                        .unwrap();
                        let op = Collective {
                            desc: CollDesc::all_reduce(group.clone(), ty, count)
                                .with_tag(4)
                                .with_reduce(op_kind, scaling),
                            input: Some(upload(&b, &chunk(rank, 0))),
                            output: b.alloc(count * es).unwrap(),
                        };
                        let done = b
                            .launch(Stream::ReduceScatter, &[], op)
                            .map_err(|e| e.error)
                            .unwrap()
                            .wait(WAIT)
                            .unwrap();
                        assert_same(
                            ty,
                            &download(&b, &done[0].output),
                            &want,
                            &format!("all_reduce {ty:?} {op_kind:?} rank {rank}"),
                        );
                    }

                    // broadcast from the last rank, in place on the root
                    let root = world - 1;
                    let data = encode(ty, &exact_values(root, count));
                    let mut out = b.alloc(count * es).unwrap();
                    if rank == root {
                        b.write_from_host(&mut out, 0, &data).unwrap();
                    }
                    let op = Collective {
                        desc: CollDesc::broadcast(group.clone(), ty, count, root).with_tag(5),
                        input: None,
                        output: out,
                    };
                    let done = b
                        .launch(Stream::AllGather, &[], op)
                        .map_err(|e| e.error)
                        .unwrap()
                        .wait(WAIT)
                        .unwrap();
                    assert_eq!(download(&b, &done[0].output), data, "broadcast {ty:?} rank {rank}");
                }
                // A group of several collectives, ordered after an event of another stream.
                let gate = b.record(Stream::Compute).unwrap();
                let ops: Vec<_> = (0..3)
                    .map(|t| Collective {
                        desc: CollDesc::all_gather(group.clone(), ElemType::F32, 17).with_tag(10 + t),
                        input: Some(upload(&b, &encode(ElemType::F32, &exact_values(rank + t as usize, 17)))),
                        output: b.alloc(17 * 4 * world).unwrap(),
                    })
                    .collect();
                let done = b
                    .launch_group(Stream::AllGather, &[gate], ops)
                    .map_err(|e| e.error)
                    .unwrap()
                    .wait(WAIT)
                    .unwrap();
                for (t, c) in done.iter().enumerate() {
                    let want: Vec<u8> =
                        (0..world).flat_map(|r| encode(ElemType::F32, &exact_values(r + t, 17))).collect();
                    assert_eq!(download(&b, &c.output), want, "grouped all_gather {t} rank {rank}");
                }
                // A refused launch gives its buffers back and names the problem.
                let small = b.alloc(4).unwrap();
                let op = Collective {
                    desc: CollDesc::all_gather(group.clone(), ElemType::F32, 17),
                    input: None,
                    output: small,
                };
                let err = b.launch(Stream::AllGather, &[], op).unwrap_err();
                assert_eq!(err.ops.len(), 1);
                assert!(err.error.to_string().contains("output has 4 bytes"), "{}", err.error);
            })
        })
        .collect();
    for h in handles {
        h.join().expect("rank thread");
    }
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gpu_events_and_deferred_frees_wait_for_their_consumers() {
    gpus("gpu_events_and_deferred_frees_wait_for_their_consumers");
    let b = single();
    let bytes = 3 << 20;
    let buf = b.alloc(bytes).unwrap();
    let first_ptr = buf.ptr();
    // A consumer on the compute stream that cannot finish until we let it.
    b.record(Stream::Compute).unwrap(); // bind the context on this thread
    let release = block_stream(&b, Stream::Compute);
    let consumer_done = b.record(Stream::Compute).unwrap();
    assert!(!consumer_done.query().unwrap(), "the blocked stream's event completed");
    assert!(
        consumer_done.wait(Duration::from_millis(20)).is_err(),
        "waiting on a blocked event must time out"
    );
    b.free(buf, Some(&consumer_done));
    assert_eq!(b.pool().deferred_count(), 1);
    let fresh_before = b.pool().fresh_allocations();
    let other = b.alloc(bytes).unwrap();
    assert_ne!(other.ptr(), first_ptr, "a buffer still in use by a pending consumer was handed out again");
    assert_eq!(b.pool().fresh_allocations(), fresh_before + 1);

    // A stream made to wait on the pending event does not run ahead.
    b.wait_event(Stream::AllGather, &consumer_done).unwrap();
    let after_wait = b.record(Stream::AllGather).unwrap();
    assert!(!after_wait.query().unwrap(), "the all-gather stream ran past an event it waits on");

    release.send(()).expect(STALLED);
    consumer_done.wait(WAIT).unwrap();
    after_wait.wait(WAIT).unwrap();
    let again = b.alloc(bytes).unwrap();
    assert_eq!(again.ptr(), first_ptr, "the freed block was not reused once its consumer completed");
    assert_eq!(b.pool().fresh_allocations(), fresh_before + 1, "reuse must not allocate");
    drop((other, again));

    // Steady state: the same step twice allocates nothing new the second time.
    let step = |b: &CudaBackend| {
        let op = Collective {
            desc: CollDesc::all_gather(RankGroup::world(1), ElemType::BF16, 4099).with_tag(0),
            input: Some(b.alloc(4099 * 2).unwrap()),
            output: b.alloc(4099 * 2).unwrap(),
        };
        let f = b.launch(Stream::AllGather, &[], op).map_err(|e| e.error).unwrap();
        let ev = f.event().clone();
        drop(f); // buffers go back to the pool after the event
        ev.wait(WAIT).unwrap();
    };
    step(&b);
    b.synchronize(Stream::Compute, WAIT).unwrap();
    let fresh = b.pool().fresh_allocations();
    for _ in 0..3 {
        step(&b);
        b.synchronize(Stream::Compute, WAIT).unwrap();
    }
    assert_eq!(b.pool().fresh_allocations(), fresh, "steady-state steps allocated from the driver");

    // Memory the engine owns is never freed or pooled by us.
    let owned = b.alloc(4096).unwrap();
    let deferred = b.pool().deferred_count();
    // SAFETY: `owned` stays alive (and is not used elsewhere) while the borrowed view exists.
    let view = unsafe { CudaBuffer::from_raw(owned.ptr(), 4096) };
    assert!(view.is_borrowed());
    drop(view);
    assert_eq!(b.pool().deferred_count(), deferred, "a borrowed buffer went into the pool");
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gpu_hybrid_groups_reduce_within_their_members_only() {
    let world = gpus("gpu_hybrid_groups_reduce_within_their_members_only");
    // Shard groups of consecutive ranks and replica groups across them (hybrid sharding); on
    // one or two GPUs some groups are single ranks, which NCCL handles as well.
    let shard = world.div_ceil(2);
    let shard_groups: Vec<RankGroup> = (0..world)
        .step_by(shard)
        .map(|s| RankGroup::new((s..(s + shard).min(world)).collect::<Vec<_>>()).unwrap())
        .collect();
    let replica_groups: Vec<RankGroup> =
        (0..shard).map(|p| RankGroup::new((p..world).step_by(shard).collect::<Vec<_>>()).unwrap()).collect();
    let groups: Vec<RankGroup> = shard_groups.iter().chain(&replica_groups).cloned().collect();
    let cuda_world =
        collsched::backend::cuda::CudaWorld::new(world).expect("CUDA world").with_groups(groups.clone());
    let count = 257;
    let results = cuda_world
        .run(|b| {
            let rank = b.rank();
            for g in groups.iter().filter(|g| g.position(rank).is_some()) {
                let mine = encode(ElemType::F32, &exact_values(rank, count));
                let inputs: Vec<Vec<u8>> =
                    g.ranks().iter().map(|&r| encode(ElemType::F32, &exact_values(r, count))).collect();
                let mut want = vec![0u8; count * 4];
                reduce(
                    ElemType::F32,
                    ReduceOp::Sum,
                    Scaling::default(),
                    &mut want,
                    &inputs.iter().map(Vec::as_slice).collect::<Vec<_>>(),
                )
                .unwrap();
                let op = Collective {
                    desc: CollDesc::all_reduce(g.clone(), ElemType::F32, count).with_tag(7),
                    input: Some(upload(&b, &mine)),
                    output: b.alloc(count * 4).unwrap(),
                };
                let done = b
                    .launch(Stream::ReduceScatter, &[], op)
                    .map_err(|e| e.error)
                    .unwrap()
                    .wait(WAIT)
                    .unwrap();
                assert_eq!(download(&b, &done[0].output), want, "all_reduce over {g} on rank {rank}");
            }
            // A group that was not declared is refused, with its buffers given back.
            if world >= 3 {
                let odd = RankGroup::new(vec![0, world - 1]).unwrap();
                if !groups.contains(&odd) && odd.position(rank).is_some() {
                    let op = Collective {
                        desc: CollDesc::all_gather(odd.clone(), ElemType::F32, 1),
                        input: None,
                        output: b.alloc(8).unwrap(),
                    };
                    let err = b.launch(Stream::AllGather, &[], op).unwrap_err();
                    assert!(err.error.to_string().contains("not declared"), "{}", err.error);
                }
            }
        })
        .expect("building the ranks");
    for (r, res) in results.into_iter().enumerate() {
        res.unwrap_or_else(|_| panic!("rank {r} panicked"));
    }
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gpu_pool_stats_count_every_block_and_empty_cache_returns_the_free_ones() {
    gpus("gpu_pool_stats_count_every_block_and_empty_cache_returns_the_free_ones");
    let b = single();
    let pool = b.pool();
    let start = pool.stats();
    // Two blocks kept, two given back; sizes of other classes than any block already cached.
    let kept: Vec<CudaBuffer> = [5 << 20, 7 << 20].iter().map(|&n| b.alloc(n).unwrap()).collect();
    let given: Vec<CudaBuffer> = [9 << 20, 11 << 20].iter().map(|&n| b.alloc(n).unwrap()).collect();
    let class = |n: usize| collsched::backend::cuda::pool::size_class(n);
    let kept_bytes = class(5 << 20) + class(7 << 20);
    let given_bytes = class(9 << 20) + class(11 << 20);
    for g in given {
        b.free(g, None);
    }
    b.synchronize(Stream::Compute, WAIT).unwrap();
    let s = pool.stats();
    assert_eq!(s.reserved_bytes, start.reserved_bytes + kept_bytes + given_bytes, "{s:?}");
    assert_eq!(s.fresh_allocations, start.fresh_allocations + 4, "{s:?}");
    assert_eq!(s.reserved_bytes, s.in_use_bytes + s.deferred_bytes + s.free_bytes, "{s:?}");
    // Freed without events, a block waits for an event on each of the rank's streams: free, or
    // deferred while one of those still reads as pending.
    assert!(s.free_bytes + s.deferred_bytes >= given_bytes && s.in_use_bytes >= kept_bytes, "{s:?}");
    let freed = pool.empty_cache().unwrap();
    assert_eq!(freed, s.free_bytes + s.deferred_bytes, "every idle block returned: {s:?}");
    let after = pool.stats();
    assert_eq!((after.free_bytes, after.deferred_bytes), (0, 0), "{after:?}");
    assert_eq!(after.reserved_bytes, s.reserved_bytes - freed, "{after:?}");
    assert_eq!(after.in_use_bytes, s.in_use_bytes, "blocks in use stay: {after:?}");
    // The kept buffers still work, and a new one comes from the driver.
    let bytes: Vec<u8> = (0..(5 << 20)).map(|i| (i % 251) as u8).collect();
    let mut k = kept.into_iter();
    let mut first = k.next().unwrap();
    b.write_from_host(&mut first, 0, &bytes).unwrap();
    assert!(download(&b, &first) == bytes, "a buffer in use lost its contents");
    let again = b.alloc(9 << 20).unwrap();
    assert_eq!(pool.stats().fresh_allocations, after.fresh_allocations + 1);
    drop((first, k, again));
}

#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gpu_a_preferred_block_is_handed_out_again_where_it_was() {
    gpus("gpu_a_preferred_block_is_handed_out_again_where_it_was");
    let b = single();
    // Three blocks of one class, given back; each asked for by its address comes back there,
    // whichever was freed last (a bucket gathered again keeps the views made of it).
    let n = 13 << 20;
    let blocks: Vec<CudaBuffer> = (0..3).map(|_| b.alloc(n).unwrap()).collect();
    let keys: Vec<usize> = blocks.iter().map(BackendBuffer::key).collect();
    assert!(keys.iter().all(|&k| k != 0), "{keys:?}");
    for blk in blocks {
        b.free(blk, None);
    }
    b.synchronize(Stream::Compute, WAIT).unwrap();
    b.synchronize(Stream::AllGather, WAIT).unwrap();
    b.synchronize(Stream::ReduceScatter, WAIT).unwrap();
    let first = b.alloc_preferring(n, keys[0]).unwrap();
    let second = b.alloc_preferring(n - 4096, keys[1]).unwrap();
    assert_eq!((first.key(), second.key()), (keys[0], keys[1]));
    let other = b.alloc_preferring(n, 0).unwrap();
    assert_eq!(other.key(), keys[2], "the one left");
    drop((first, second, other));
}
