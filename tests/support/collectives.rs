//! The backend-generic collective suite: every collective, odd sizes, every element type,
//! checked element by element against a reference computed here (shared by the local and shm
//! backends' tests).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use collsched::backend::{
    Backend, BackendBuffer, BackendError, CollDesc, Collective, GatherUnpack, RankGroup, Stream,
};
use collsched::kernels::{CopySegment, ElemType, ReduceOp, Scaling};
use half::{bf16, f16};

pub const SIZES: [usize; 4] = [1, 17, 257, 4099];
pub const TYPES: [ElemType; 3] = [ElemType::F32, ElemType::F16, ElemType::BF16];
pub const WAIT: Duration = Duration::from_secs(60);

/// A value of rank `r`, element `i`: a multiple of 1/8 below 32 in magnitude, exact in every
/// element type (8 significant bits), while sums over many ranks are not exact in f16/bf16 — so
/// a kernel that accumulated in the narrow type, or rounded twice, would show.
pub fn value(_ty: ElemType, r: usize, i: usize, salt: usize) -> f32 {
    let h = (r.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503) ^ salt.wrapping_mul(97)) % 511;
    (h as f32 - 255.0) / 8.0
}

pub fn round(ty: ElemType, x: f32) -> f32 {
    match ty {
        ElemType::F32 => x,
        ElemType::F16 => f16::from_f32(x).to_f32(),
        ElemType::BF16 => bf16::from_f32(x).to_f32(),
    }
}

pub fn encode(ty: ElemType, v: &[f32]) -> Vec<u8> {
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

pub fn decode(ty: ElemType, b: &[u8]) -> Vec<f32> {
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
pub fn reduce_ref(ty: ElemType, op: ReduceOp, s: Scaling, xs: impl Iterator<Item = f32>, n: usize) -> f32 {
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

pub fn compare(what: &str, ty: ElemType, got: &[u8], want: &[f32], wrong: &mut Vec<String>) {
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

pub fn run_one<B: Backend>(
    rank: &B,
    stream: Stream,
    c: Collective<B::Buffer>,
) -> Result<Vec<u8>, BackendError> {
    let f = rank.launch(stream, &[], c).map_err(|e| e.error)?;
    let mut done = f.wait(WAIT).map_err(|e| e.into_error())?;
    let c = done.pop().expect("one collective back");
    let mut out = vec![0u8; c.output.len()];
    rank.read_to_host(&c.output, 0, &mut out)?;
    rank.free(c.output, None);
    if let Some(i) = c.input {
        rank.free(i, None);
    }
    Ok(out)
}

/// Runs every collective, size and type on one rank; returns descriptions of wrong results.
pub fn exercise<B: Backend>(rank: &B) -> Result<Vec<String>, BackendError> {
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
                rank,
                Stream::AllGather,
                Collective { desc: desc.clone(), input: Some(input), output },
            )?;
            compare(&format!("all_gather n={n} {count} x {}", ty.name()), ty, &got, &want, &mut wrong);

            unpacking_all_gather(rank, &desc, &shard, &want, &mut wrong)?;

            // with an input that is a copy of our part, already in place in the output
            let mut input = rank.alloc(count * es)?;
            rank.write_from_host(&mut input, 0, &encode(ty, &shard))?;
            let mut output = rank.alloc(n * count * es)?;
            rank.write_from_host(&mut output, me * count * es, &encode(ty, &shard))?;
            let own = desc.clone().with_own_part_in_place();
            let got = run_one(rank, Stream::AllGather, Collective { desc: own, input: Some(input), output })?;
            compare(
                &format!("all_gather own part in place n={n} {count} x {}", ty.name()),
                ty,
                &got,
                &want,
                &mut wrong,
            );

            let mut output = rank.alloc(n * count * es)?;
            rank.write_from_host(&mut output, me * count * es, &encode(ty, &shard))?;
            let got = run_one(rank, Stream::AllGather, Collective { desc, input: None, output })?;
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
                    run_one(rank, Stream::ReduceScatter, Collective { desc, input: Some(input), output })?;
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
                    run_one(rank, Stream::ReduceScatter, Collective { desc, input: Some(input), output })?;
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
            let got = run_one(rank, Stream::Compute, Collective { desc, input: None, output })?;
            compare(&format!("broadcast n={n} {count} x {}", ty.name()), ty, &got, &data, &mut wrong);
        }
    }
    Ok(wrong)
}

/// An all-gather of `desc` (`shard` from this rank; `gathered`: the whole result member
/// after member) into an unpack layout: runs of 3 elements of the gathered order (some across
/// two members' shards) placed in reverse order. Checked against `gathered` rearranged here;
/// a backend that cannot place pieces must refuse the launch.
fn unpacking_all_gather<B: Backend>(
    rank: &B,
    desc: &CollDesc,
    shard: &[f32],
    gathered: &[f32],
    wrong: &mut Vec<String>,
) -> Result<(), BackendError> {
    let (n, count, ty) = (desc.group.len(), desc.count, desc.elem);
    let total = n * count;
    let mut segments = Vec::new();
    let mut want = vec![f32::NAN; total];
    let mut at = 0;
    for a in (0..total).step_by(3).rev() {
        let len = 3.min(total - a);
        segments.push(CopySegment { buffer: 0, buffer_offset: at, packed_offset: a, len });
        want[at..at + len].copy_from_slice(&gathered[a..a + len]);
        at += len;
    }
    let what = format!("unpacking all_gather n={n} {count} x {}", ty.name());
    let unpack = match GatherUnpack::new(&segments, count, n) {
        Ok(u) => Arc::new(u),
        Err(e) => {
            wrong.push(format!("{what}: layout refused: {e}"));
            return Ok(());
        }
    };
    let mut input = rank.alloc(count * ty.size())?;
    rank.write_from_host(&mut input, 0, &encode(ty, shard))?;
    let output = rank.alloc(total * ty.size())?;
    let c = Collective { desc: desc.clone().with_unpack(unpack), input: Some(input), output };
    if rank.gathers_unpacked() {
        let got = run_one(rank, Stream::AllGather, c)?;
        compare(&what, ty, &got, &want, wrong);
        return Ok(());
    }
    match rank.launch(Stream::AllGather, &[], c) {
        Ok(_) => wrong.push(format!("{what}: launched on a backend that cannot place pieces")),
        Err(refused) => {
            let msg = refused.error.to_string();
            if !matches!(refused.error, BackendError::InvalidCollective { .. }) || !msg.contains("unpack") {
                wrong.push(format!(
                    "{what}: refused with {msg}, want an invalid collective naming the unpack"
                ));
            }
            for c in refused.ops {
                c.input.into_iter().for_each(|b| rank.free(b, None));
                rank.free(c.output, None);
            }
        }
    }
    Ok(())
}

/// A group launch of three all-gathers (three types, odd sizes) over the world on one stream,
/// while the odd ranks all-reduce among themselves on another; returns wrong results.
pub fn grouped_launch_and_subgroup<B: Backend>(rank: &B) -> Result<Vec<String>, BackendError> {
    let mut wrong = Vec::new();
    let me = rank.rank();
    let n = rank.world_size();
    let odd_ranks: Vec<usize> = (1..n).step_by(2).collect();
    let odd = RankGroup::new(odd_ranks.clone()).unwrap_or_else(|_| RankGroup::world(1));
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
    let sub = if !odd_ranks.is_empty() && odd.position(me).is_some() {
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
        let mut got = vec![0u8; c.output.len()];
        rank.read_to_host(&c.output, 0, &mut got)?;
        compare(&format!("rank {me}: grouped all_gather"), *ty, &got, want, &mut wrong);
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
                    odd_ranks.iter().map(|&r| value(ty, r, i, 11)),
                    odd_ranks.len(),
                )
            })
            .collect();
        let mut got = vec![0u8; done[0].output.len()];
        rank.read_to_host(&done[0].output, 0, &mut got)?;
        compare(&format!("rank {me}: subgroup all_reduce"), ty, &got, &want, &mut wrong);
    }
    Ok(wrong)
}

/// A deterministic pseudo-random program of collectives over random subgroups of the world, on
/// two streams, all launched before any is waited for: every rank follows the same program
/// (skipping the collectives it is not a member of), so streams and channels interleave freely.
/// Returns wrong results.
pub fn random_program<B: Backend>(rank: &B) -> Result<Vec<String>, BackendError> {
    const STEPS: usize = 60;
    let n_world = rank.world_size();
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
            let mask = 1 + next((1 << n_world) - 1);
            let group: Vec<usize> = (0..n_world).filter(|r| mask & (1 << r) != 0).collect();
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
                let want =
                    s.group.iter().flat_map(|&r| (0..count).map(move |i| value(ty, r, i, s.salt))).collect();
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
                    &encode(ty, &(0..n * count).map(|i| value(ty, me, i, s.salt)).collect::<Vec<_>>()),
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
                let desc =
                    CollDesc::all_reduce(group, ty, count).with_reduce(ReduceOp::Avg, Scaling::default());
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
        let mut got = vec![0u8; done[0].output.len()];
        rank.read_to_host(&done[0].output, 0, &mut got)?;
        compare(&format!("rank {me}: step {salt}"), ty, &got, &want, &mut wrong);
    }
    Ok(wrong)
}

/// The whole suite on one rank of a multi-process job ([`exercise`],
/// [`grouped_launch_and_subgroup`], [`random_program`]): `Ok("suite")`, or what was wrong.
pub fn suite<B: Backend>(rank: &B) -> Result<String, String> {
    let mut wrong = exercise(rank).map_err(|e| e.to_string())?;
    wrong.extend(grouped_launch_and_subgroup(rank).map_err(|e| e.to_string())?);
    wrong.extend(random_program(rank).map_err(|e| e.to_string())?);
    if wrong.is_empty() {
        Ok("suite".into())
    } else {
        Err(format!("wrong results: {wrong:?}"))
    }
}
