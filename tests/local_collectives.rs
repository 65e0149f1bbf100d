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
    for (r, outcome) in world.run(|r| exercise(&r)).expect("ranks").into_iter().enumerate() {
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
            let wrong = grouped_launch_and_subgroup(&rank)?;
            assert!(wrong.is_empty(), "{wrong:?}");
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
