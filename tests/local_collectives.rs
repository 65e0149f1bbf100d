//! Every collective of the local backend, for 1..=8, 13 and 64 ranks, odd sizes and every element
//! type, checked element by element against a reference computed here.

use std::time::Duration;

#[path = "support/collectives.rs"]
mod collectives;
use collectives::*;

use collsched::backend::local::{LocalConfig, LocalWorld};
use collsched::backend::{Backend, BackendError, CollDesc, Collective, RankGroup, Stream};
use collsched::kernels::{ElemType, ReduceOp, Scaling};

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
