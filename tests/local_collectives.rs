//! Every collective of the local backend, for 1..=8, 13 and 64 ranks, odd sizes and every element
//! type, checked element by element against a reference computed here.

use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalRank, LocalWorld};
use collsched::backend::{Backend, BackendError, CollDesc, Collective, RankGroup, Stream};
use collsched::kernels::{ElemType, ReduceOp, Scaling};
use half::{bf16, f16};

const SIZES: [usize; 4] = [1, 17, 257, 4099];
const TYPES: [ElemType; 3] = [ElemType::F32, ElemType::F16, ElemType::BF16];
const WAIT: Duration = Duration::from_secs(60);

/// A value of rank `r`, element `i`: a multiple of 1/8 below 32 in magnitude, exact in every
/// element type (8 significant bits), while sums over many ranks are not exact in f16/bf16 — so
/// a kernel that accumulated in the narrow type, or rounded twice, would show.
fn value(_ty: ElemType, r: usize, i: usize, salt: usize) -> f32 {
    let h = (r.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503) ^ salt.wrapping_mul(97)) % 511;
    (h as f32 - 255.0) / 8.0
}

fn round(ty: ElemType, x: f32) -> f32 {
    match ty {
        ElemType::F32 => x,
        ElemType::F16 => f16::from_f32(x).to_f32(),
        ElemType::BF16 => bf16::from_f32(x).to_f32(),
    }
}

fn encode(ty: ElemType, v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * ty.size());
    for &x in v {
        match ty {
            ElemType::F32 => out.extend_from_slice(&x.to_le_bytes()),
            ElemType::F16 => out.extend_from_slice(&f16::from_f32(x).to_le_bytes()),
            ElemType::BF16 => out.extend_from_slice(&bf16::from_f32(x).to_le_bytes()),
        }
    }
    out
}

fn decode(ty: ElemType, b: &[u8]) -> Vec<f32> {
    b.chunks_exact(ty.size())
        .map(|c| match ty {
            ElemType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            ElemType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            ElemType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        })
        .collect()
}

/// The reduction as the contract defines it: f32, rank order, pre-divide each, post-divide the
/// sum (times n for avg), rounded once to `ty`.
fn reduce_ref(ty: ElemType, op: ReduceOp, s: Scaling, xs: impl Iterator<Item = f32>, n: usize) -> f32 {
    let mut acc = 0.0f32;
    for x in xs {
        acc += x / s.pre_divide;
    }
    let post = match op {
        ReduceOp::Sum => s.post_divide,
        ReduceOp::Avg => s.post_divide * n as f32,
    };
    round(ty, acc / post)
}

fn compare(what: &str, ty: ElemType, got: &[u8], want: &[f32], wrong: &mut Vec<String>) {
    let got = decode(ty, got);
    let want_bits: Vec<f32> = want.iter().map(|&x| round(ty, x)).collect();
    if got.len() != want_bits.len() {
        wrong.push(format!("{what}: {} elements, want {}", got.len(), want_bits.len()));
        return;
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want_bits[i].to_bits()) {
        wrong.push(format!("{what}: element {i} is {}, want {}", got[i], want_bits[i]));
    }
}

fn run_one(
    rank: &LocalRank,
    stream: Stream,
    c: Collective<collsched::backend::local::LocalBuffer>,
) -> Result<Vec<u8>, BackendError> {
    let f = rank.launch(stream, &[], c).map_err(|e| e.error)?;
    let mut done = f.wait(WAIT).map_err(|e| e.into_error())?;
    let c = done.pop().expect("one collective back");
    let out = c.output.as_bytes().to_vec();
    rank.free(c.output, None);
    if let Some(i) = c.input {
        rank.free(i, None);
    }
    Ok(out)
}

/// Runs every collective, size and type on one rank; returns descriptions of wrong results.
fn exercise(rank: LocalRank) -> Result<Vec<String>, BackendError> {
    let n = rank.world_size();
    let me = rank.rank();
    let group = RankGroup::world(n);
    let mut wrong = Vec::new();
    let scalings =
        [(ReduceOp::Sum, Scaling::default()), (ReduceOp::Avg, Scaling { pre_divide: 2.0, post_divide: 1.5 })];
    for ty in TYPES {
        let es = ty.size();
        for count in SIZES {
            // all-gather, out of place and in place
            let shard: Vec<f32> = (0..count).map(|i| value(ty, me, i, 1)).collect();
            let want: Vec<f32> = (0..n).flat_map(|r| (0..count).map(move |i| value(ty, r, i, 1))).collect();
            let mut input = rank.alloc(count * es)?;
            rank.write_from_host(&mut input, 0, &encode(ty, &shard))?;
            let output = rank.alloc(n * count * es)?;
            let desc = CollDesc::all_gather(group.clone(), ty, count).with_tag(count as u64);
            let got = run_one(
                &rank,
                Stream::AllGather,
                Collective { desc: desc.clone(), input: Some(input), output },
            )?;
            compare(&format!("all_gather n={n} {count} x {}", ty.name()), ty, &got, &want, &mut wrong);

            let mut output = rank.alloc(n * count * es)?;
            rank.write_from_host(&mut output, me * count * es, &encode(ty, &shard))?;
            let got = run_one(&rank, Stream::AllGather, Collective { desc, input: None, output })?;
            compare(
                &format!("all_gather in place n={n} {count} x {}", ty.name()),
                ty,
                &got,
                &want,
                &mut wrong,
            );

            // reduce-scatter and all-reduce, with sum and avg + scaling
            for (k, &(op, s)) in scalings.iter().enumerate() {
                let full: Vec<f32> = (0..n * count).map(|i| value(ty, me, i, 2 + k)).collect();
                let want: Vec<f32> = (0..count)
                    .map(|i| reduce_ref(ty, op, s, (0..n).map(|r| value(ty, r, me * count + i, 2 + k)), n))
                    .collect();
                let mut input = rank.alloc(n * count * es)?;
                rank.write_from_host(&mut input, 0, &encode(ty, &full))?;
                let output = rank.alloc(count * es)?;
                let desc = CollDesc::reduce_scatter(group.clone(), ty, count).with_reduce(op, s);
                let got =
                    run_one(&rank, Stream::ReduceScatter, Collective { desc, input: Some(input), output })?;
                compare(
                    &format!("reduce_scatter {op:?} n={n} {count} x {}", ty.name()),
                    ty,
                    &got,
                    &want,
                    &mut wrong,
                );

                let mine: Vec<f32> = (0..count).map(|i| value(ty, me, i, 5 + k)).collect();
                let want: Vec<f32> = (0..count)
                    .map(|i| reduce_ref(ty, op, s, (0..n).map(|r| value(ty, r, i, 5 + k)), n))
                    .collect();
                let mut input = rank.alloc(count * es)?;
                rank.write_from_host(&mut input, 0, &encode(ty, &mine))?;
                let output = rank.alloc(count * es)?;
                let desc = CollDesc::all_reduce(group.clone(), ty, count).with_reduce(op, s);
                let got =
                    run_one(&rank, Stream::ReduceScatter, Collective { desc, input: Some(input), output })?;
                compare(
                    &format!("all_reduce {op:?} n={n} {count} x {}", ty.name()),
                    ty,
                    &got,
                    &want,
                    &mut wrong,
                );
            }

            // broadcast from the last rank, in place on the root
            let root = n - 1;
            let data: Vec<f32> = (0..count).map(|i| value(ty, root, i, 9)).collect();
            let mut output = rank.alloc(count * es)?;
            if me == root {
                rank.write_from_host(&mut output, 0, &encode(ty, &data))?;
            }
            let desc = CollDesc::broadcast(group.clone(), ty, count, root);
            let got = run_one(&rank, Stream::Compute, Collective { desc, input: None, output })?;
            compare(&format!("broadcast n={n} {count} x {}", ty.name()), ty, &got, &data, &mut wrong);
        }
    }
    Ok(wrong)
}

fn check_world(n: usize) {
    check_world_with(n, LocalConfig::default().piece_bytes);
}

/// [`check_world`] with reductions shared in pieces of `piece_bytes`.
fn check_world_with(n: usize, piece_bytes: usize) {
    let config = LocalConfig { timeout: Duration::from_secs(60), piece_bytes, ..LocalConfig::default() };
    let world = LocalWorld::with_config(n, config).expect("world");
    for (r, outcome) in world.run(exercise).expect("ranks").into_iter().enumerate() {
        let wrong =
            outcome.unwrap_or_else(|_| panic!("rank {r} of {n} panicked")).unwrap_or_else(|e| panic!("{e}"));
        assert!(wrong.is_empty(), "rank {r} of {n}: {wrong:#?}");
    }
}

#[test]
fn every_collective_1_to_8_ranks() {
    for n in 1..=8 {
        check_world(n);
    }
}

#[test]
fn every_collective_13_ranks() {
    check_world(13);
}

#[test]
fn every_collective_64_ranks() {
    check_world(64);
}

/// Reductions cut into many pieces (a few elements each, not a whole number of f16 elements for
/// 6 bytes), which the members' threads share: every piece lands where it belongs.
#[test]
fn reductions_shared_in_small_pieces() {
    for n in [2, 3, 5] {
        check_world_with(n, 6);
    }
    check_world_with(13, 100);
}

/// Several collectives of different sizes and types as one group, and a subgroup of the world
/// (odd ranks) next to the world group.
#[test]
fn grouped_launch_and_subgroups() {
    let n = 5;
    let world =
        LocalWorld::with_config(n, LocalConfig { timeout: WAIT, ..LocalConfig::default() }).expect("world");
    let out = world
        .run(|rank| -> Result<(), BackendError> {
            let me = rank.rank();
            let odd = RankGroup::new(vec![1, 3])?;
            let mut ops = Vec::new();
            let mut wants = Vec::new();
            for (k, (ty, count)) in
                [(ElemType::F32, 17), (ElemType::BF16, 4099), (ElemType::F16, 1)].into_iter().enumerate()
            {
                let mut input = rank.alloc(count * ty.size())?;
                rank.write_from_host(
                    &mut input,
                    0,
                    &encode(ty, &(0..count).map(|i| value(ty, me, i, k)).collect::<Vec<_>>()),
                )?;
                let output = rank.alloc(n * count * ty.size())?;
                ops.push(Collective {
                    desc: CollDesc::all_gather(RankGroup::world(n), ty, count).with_tag(k as u64),
                    input: Some(input),
                    output,
                });
                wants.push((
                    ty,
                    (0..n).flat_map(|r| (0..count).map(move |i| value(ty, r, i, k))).collect::<Vec<f32>>(),
                ));
            }
            let group_flight = rank.launch_group(Stream::AllGather, &[], ops).map_err(|e| e.error)?;
            // Meanwhile the odd ranks all-reduce among themselves on another stream.
            let sub = if let Some(pos) = odd.position(me) {
                let _ = pos;
                let ty = ElemType::F32;
                let mut input = rank.alloc(257 * 4)?;
                rank.write_from_host(
                    &mut input,
                    0,
                    &encode(ty, &(0..257).map(|i| value(ty, me, i, 11)).collect::<Vec<_>>()),
                )?;
                let output = rank.alloc(257 * 4)?;
                let desc = CollDesc::all_reduce(odd.clone(), ty, 257);
                Some(
                    rank.launch(Stream::ReduceScatter, &[], Collective { desc, input: Some(input), output })
                        .map_err(|e| e.error)?,
                )
            } else {
                None
            };
            let done = group_flight.wait(WAIT).map_err(|e| e.into_error())?;
            for (c, (ty, want)) in done.iter().zip(&wants) {
                let mut wrong = Vec::new();
                compare("grouped all_gather", *ty, c.output.as_bytes(), want, &mut wrong);
                assert!(wrong.is_empty(), "rank {me}: {wrong:?}");
            }
            if let Some(f) = sub {
                let done = f.wait(WAIT).map_err(|e| e.into_error())?;
                let ty = ElemType::F32;
                let want: Vec<f32> = (0..257)
                    .map(|i| {
                        reduce_ref(
                            ty,
                            ReduceOp::Sum,
                            Scaling::default(),
                            [1usize, 3].iter().map(|&r| value(ty, r, i, 11)),
                            2,
                        )
                    })
                    .collect();
                let mut wrong = Vec::new();
                compare("subgroup all_reduce", ty, done[0].output.as_bytes(), &want, &mut wrong);
                assert!(wrong.is_empty(), "rank {me}: {wrong:?}");
            }
            Ok(())
        })
        .expect("ranks");
    for (r, o) in out.into_iter().enumerate() {
        o.unwrap_or_else(|_| panic!("rank {r} panicked")).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A deterministic pseudo-random program of collectives over random subgroups, on two streams,
/// all launched before any is waited for: every rank follows the same program (skipping the
/// collectives it is not a member of), so streams and channels interleave freely.
#[test]
fn random_programs_over_subgroups_and_streams() {
    const N: usize = 6;
    const STEPS: usize = 60;
    struct Step {
        group: Vec<usize>,
        stream: Stream,
        kind: u8,
        ty: ElemType,
        count: usize,
        salt: usize,
    }
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move |m: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % m) as usize
    };
    let program: Vec<Step> = (0..STEPS)
        .map(|salt| {
            let mask = 1 + next((1 << N) - 1);
            let group: Vec<usize> = (0..N).filter(|r| mask & (1 << r) != 0).collect();
            Step {
                group,
                stream: if next(2) == 0 { Stream::AllGather } else { Stream::ReduceScatter },
                kind: next(4) as u8,
                ty: TYPES[next(3)],
                count: [1, 17, 257][next(3)],
                salt,
            }
        })
        .collect();
    let world = world_of(N);
    let out = world
        .run(|rank| -> Result<Vec<String>, BackendError> {
            let me = rank.rank();
            let mut flights = Vec::new();
            for s in program.iter().filter(|s| s.group.contains(&me)) {
                let group = RankGroup::new(s.group.clone())?;
                let (n, pos, ty, count, es) =
                    (s.group.len(), group.position(me).unwrap_or(0), s.ty, s.count, s.ty.size());
                let (c, want): (_, Vec<f32>) = match s.kind {
                    0 => {
                        let mut input = rank.alloc(count * es)?;
                        rank.write_from_host(
                            &mut input,
                            0,
                            &encode(ty, &(0..count).map(|i| value(ty, me, i, s.salt)).collect::<Vec<_>>()),
                        )?;
                        let want = s
                            .group
                            .iter()
                            .flat_map(|&r| (0..count).map(move |i| value(ty, r, i, s.salt)))
                            .collect();
                        (
                            Collective {
                                desc: CollDesc::all_gather(group, ty, count),
                                input: Some(input),
                                output: rank.alloc(n * count * es)?,
                            },
                            want,
                        )
                    }
                    1 => {
                        let mut input = rank.alloc(n * count * es)?;
                        rank.write_from_host(
                            &mut input,
                            0,
                            &encode(
                                ty,
                                &(0..n * count).map(|i| value(ty, me, i, s.salt)).collect::<Vec<_>>(),
                            ),
                        )?;
                        let want = (0..count)
                            .map(|i| {
                                reduce_ref(
                                    ty,
                                    ReduceOp::Sum,
                                    Scaling::default(),
                                    s.group.iter().map(|&r| value(ty, r, pos * count + i, s.salt)),
                                    n,
                                )
                            })
                            .collect();
                        (
                            Collective {
                                desc: CollDesc::reduce_scatter(group, ty, count),
                                input: Some(input),
                                output: rank.alloc(count * es)?,
                            },
                            want,
                        )
                    }
                    2 => {
                        let mut input = rank.alloc(count * es)?;
                        rank.write_from_host(
                            &mut input,
                            0,
                            &encode(ty, &(0..count).map(|i| value(ty, me, i, s.salt)).collect::<Vec<_>>()),
                        )?;
                        let want = (0..count)
                            .map(|i| {
                                reduce_ref(
                                    ty,
                                    ReduceOp::Avg,
                                    Scaling::default(),
                                    s.group.iter().map(|&r| value(ty, r, i, s.salt)),
                                    n,
                                )
                            })
                            .collect();
                        let desc = CollDesc::all_reduce(group, ty, count)
                            .with_reduce(ReduceOp::Avg, Scaling::default());
                        (Collective { desc, input: Some(input), output: rank.alloc(count * es)? }, want)
                    }
                    _ => {
                        let root = s.group[s.salt % n];
                        let data: Vec<f32> = (0..count).map(|i| value(ty, root, i, s.salt)).collect();
                        let input = if me == root {
                            let mut b = rank.alloc(count * es)?;
                            rank.write_from_host(&mut b, 0, &encode(ty, &data))?;
                            Some(b)
                        } else {
                            None
                        };
                        (
                            Collective {
                                desc: CollDesc::broadcast(group, ty, count, root),
                                input,
                                output: rank.alloc(count * es)?,
                            },
                            data,
                        )
                    }
                };
                let f = rank.launch(s.stream, &[], c).map_err(|e| e.error)?;
                flights.push((s.salt, ty, f, want));
            }
            let mut wrong = Vec::new();
            for (salt, ty, f, want) in flights {
                let done = f.wait(WAIT).map_err(|e| e.into_error())?;
                compare(&format!("step {salt}"), ty, done[0].output.as_bytes(), &want, &mut wrong);
            }
            Ok(wrong)
        })
        .expect("ranks");
    for (r, o) in out.into_iter().enumerate() {
        let wrong = o.unwrap_or_else(|_| panic!("rank {r} panicked")).unwrap_or_else(|e| panic!("{e}"));
        assert!(wrong.is_empty(), "rank {r}: {wrong:#?}");
    }
}

fn world_of(n: usize) -> LocalWorld {
    LocalWorld::with_config(n, LocalConfig { timeout: WAIT, ..LocalConfig::default() }).expect("world")
}
