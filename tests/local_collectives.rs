//! Every collective of the local backend, for 1..=8, 13 and 64 ranks, odd sizes and every element
//! type, checked element by element against a reference computed here.

use std::time::Duration;

#[path = "support/collectives.rs"]
mod collectives;
use collectives::*;

use collsched::backend::local::{LocalConfig, LocalWorld};
use collsched::backend::BackendError;

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

/// [`random_program`] on 6 ranks.
#[test]
fn random_programs_over_subgroups_and_streams() {
    let out = world_of(6).run(|rank| random_program(&rank)).expect("ranks");
    for (r, o) in out.into_iter().enumerate() {
        let wrong = o.unwrap_or_else(|_| panic!("rank {r} panicked")).unwrap_or_else(|e| panic!("{e}"));
        assert!(wrong.is_empty(), "rank {r}: {wrong:#?}");
    }
}

fn world_of(n: usize) -> LocalWorld {
    LocalWorld::with_config(n, LocalConfig { timeout: WAIT, ..LocalConfig::default() }).expect("world")
}

/// An all-gather told that this member's part is in place already leaves that part as it
/// was (here deliberately unlike the input, to see it untouched) while the peers get the
/// input; the flag on anything but an all-gather with an input and no unpack layout is
/// refused at launch, naming it.
#[test]
fn an_own_part_in_place_is_not_copied_and_the_flag_is_checked() {
    use collsched::backend::{Backend, CollDesc, Collective, RankGroup, Stream};
    use collsched::kernels::ElemType;
    let n = 3;
    let count = 5;
    let out = world_of(n)
        .run(|rank| -> Result<(), BackendError> {
            let me = rank.rank();
            let group = RankGroup::world(n);
            let ty = ElemType::F32;
            let sent: Vec<f32> = (0..count).map(|i| value(ty, me, i, 1)).collect();
            let kept: Vec<f32> = (0..count).map(|i| -1.0 - i as f32).collect();
            let mut input = rank.alloc(count * 4)?;
            rank.write_from_host(&mut input, 0, &encode(ty, &sent))?;
            let mut output = rank.alloc(n * count * 4)?;
            rank.write_from_host(&mut output, me * count * 4, &encode(ty, &kept))?;
            let desc = CollDesc::all_gather(group.clone(), ty, count).with_own_part_in_place();
            let got = run_one(&rank, Stream::AllGather, Collective { desc, input: Some(input), output })?;
            let want: Vec<f32> = (0..n)
                .flat_map(|r| {
                    (0..count).map(move |i| if r == me { -1.0 - i as f32 } else { value(ty, r, i, 1) })
                })
                .collect();
            let mut wrong = Vec::new();
            compare("own part in place", ty, &got, &want, &mut wrong);
            assert!(wrong.is_empty(), "rank {me}: {wrong:?}");

            let refused = [
                Collective {
                    desc: CollDesc::reduce_scatter(group.clone(), ty, count).with_own_part_in_place(),
                    input: Some(rank.alloc(n * count * 4)?),
                    output: rank.alloc(count * 4)?,
                },
                Collective {
                    desc: CollDesc::all_gather(group.clone(), ty, count).with_own_part_in_place(),
                    input: None,
                    output: rank.alloc(n * count * 4)?,
                },
            ];
            for c in refused {
                let kind = c.desc.kind;
                let e = rank.launch(Stream::AllGather, &[], c).map(|_| ()).expect_err("refused");
                let text = e.error.to_string();
                assert!(
                    matches!(e.error, BackendError::InvalidCollective { .. })
                        && text.contains("own_part_in_place"),
                    "{kind:?}: {text}"
                );
            }
            Ok(())
        })
        .expect("ranks");
    for (r, o) in out.into_iter().enumerate() {
        o.unwrap_or_else(|_| panic!("rank {r} panicked")).unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A reduce-scatter told where this member's own chunk of the input is reads it there, not
/// from the input buffer (whose bytes there are NaN here), also when peers' threads help
/// with the pieces (small pieces); the chunk on another kind, or too short, is refused.
#[test]
fn a_reduce_scatter_reads_its_own_chunk_where_told_and_misuse_is_refused() {
    use collsched::backend::{Backend, CollDesc, Collective, OwnChunk, RankGroup, Stream};
    use collsched::kernels::ElemType;
    let n = 3;
    let count = 4099;
    let config = LocalConfig { timeout: WAIT, piece_bytes: 64, ..LocalConfig::default() };
    let world = LocalWorld::with_config(n, config).expect("world");
    let out = world
        .run(|rank| -> Result<(), BackendError> {
            let me = rank.rank();
            let group = RankGroup::world(n);
            let ty = ElemType::F32;
            let full: Vec<f32> = (0..n * count).map(|i| value(ty, me, i, 3)).collect();
            let mut staged = full.clone();
            staged[me * count..(me + 1) * count].fill(f32::NAN);
            let own_values = encode(ty, &full[me * count..(me + 1) * count]);
            let mut input = rank.alloc(n * count * 4)?;
            rank.write_from_host(&mut input, 0, &encode(ty, &staged))?;
            let ptr = std::ptr::NonNull::new(own_values.as_ptr().cast_mut()).expect("a Vec's pointer");
            // SAFETY: `own_values` outlives the collective, waited for below, and is not written.
            let own = unsafe { OwnChunk::new(ptr, own_values.len()) };
            let desc = CollDesc::reduce_scatter(group.clone(), ty, count).with_own_chunk(own);
            let got = run_one(
                &rank,
                Stream::ReduceScatter,
                Collective { desc, input: Some(input), output: rank.alloc(count * 4)? },
            )?;
            let want: Vec<f32> =
                (0..count).map(|i| (0..n).map(|r| value(ty, r, me * count + i, 3)).sum::<f32>()).collect();
            let mut wrong = Vec::new();
            compare("reduce_scatter with its own chunk apart", ty, &got, &want, &mut wrong);
            assert!(wrong.is_empty(), "rank {me}: {wrong:?}");

            // SAFETY: as above; these launches are refused before anything reads the bytes.
            let short = unsafe { OwnChunk::new(ptr, 4) };
            let refused = [
                (
                    Collective {
                        desc: CollDesc::all_gather(group.clone(), ty, count).with_own_chunk(own),
                        input: Some(rank.alloc(count * 4)?),
                        output: rank.alloc(n * count * 4)?,
                    },
                    "own_chunk is for a reduce-scatter",
                ),
                (
                    Collective {
                        desc: CollDesc::reduce_scatter(group.clone(), ty, count).with_own_chunk(short),
                        input: Some(rank.alloc(n * count * 4)?),
                        output: rank.alloc(count * 4)?,
                    },
                    "own_chunk has 4 bytes",
                ),
            ];
            for (c, says) in refused {
                let e = rank.launch(Stream::ReduceScatter, &[], c).map(|_| ()).expect_err("refused");
                let text = e.error.to_string();
                assert!(
                    matches!(e.error, BackendError::InvalidCollective { .. }) && text.contains(says),
                    "{text}"
                );
            }
            Ok(())
        })
        .expect("ranks");
    for (r, o) in out.into_iter().enumerate() {
        o.unwrap_or_else(|_| panic!("rank {r} panicked")).unwrap_or_else(|e| panic!("{e}"));
    }
}
