//! Property tests of layouts: random parameter lists (1 to 2,000 parameters, 1 to 2^28
//! elements, mixed dtypes, random frozen masks), worlds 1 to 128, every strategy.
//!
//! Nothing is materialized: ownership is checked on the segment intervals, so a case with
//! 2^28-element parameters costs no more than one with 4-element ones.

use std::collections::HashMap;

use collsched_buckets::{
    Bucket, BucketKind, DType, Layout, LayoutBuilder, ParamId, ParamSet, ParamSpec, Segment, Sharding,
};
use proptest::prelude::*;

/// A parameter list in a form proptest can shrink: (numel, dtype, trainable).
fn params(max: usize) -> impl Strategy<Value = Vec<(usize, DType, bool)>> {
    let numel = (0u32..=28).prop_flat_map(|e| 1usize..=(1usize << e));
    let dtype = prop::sample::select(DType::ALL.to_vec());
    prop::collection::vec((numel, dtype, any::<bool>()), 1..=max)
}

fn set_of(ps: &[(usize, DType, bool)]) -> ParamSet {
    let specs = ps
        .iter()
        .enumerate()
        .map(|(i, &(n, d, t))| {
            // Vary the rank of shapes; the element count is what matters.
            let shape = if i % 3 == 0 { vec![1, n] } else { vec![n] };
            ParamSpec::new(format!("p{i}"), shape, d).trainable(t)
        })
        .collect();
    ParamSet::new(specs).expect("generated parameters are valid")
}

fn sharding(world: u32) -> impl Strategy<Value = Sharding> {
    let divisors: Vec<u32> = (1..=world).filter(|g| world.is_multiple_of(*g)).collect();
    prop_oneof![
        Just(Sharding::EvenSplit),
        Just(Sharding::Flat),
        Just(Sharding::Greedy),
        prop::sample::select(divisors).prop_map(Sharding::Hybrid),
    ]
}

#[derive(Clone, Debug)]
struct Case {
    ps: Vec<(usize, DType, bool)>,
    world: u32,
    sharding: Sharding,
    align: usize,
    bucket_bytes: usize,
}

fn case(max_params: usize) -> impl Strategy<Value = Case> {
    (params(max_params), 1u32..=128)
        .prop_flat_map(|(ps, world)| {
            (
                Just(ps),
                Just(world),
                sharding(world),
                prop::sample::select(vec![8usize, 16, 64, 256, 4096]),
                (10u32..=32).prop_map(|e| 1usize << e),
            )
        })
        .prop_map(|(ps, world, sharding, align, bucket_bytes)| Case {
            ps,
            world,
            sharding,
            align,
            bucket_bytes,
        })
}

fn build(c: &Case) -> Layout {
    LayoutBuilder::new(&set_of(&c.ps), c.sharding, c.world)
        .align(c.align)
        .bucket_bytes(c.bucket_bytes)
        .build()
        .expect("valid inputs build")
}

/// Per parameter of `b`: the (group position, param_offset, numel) runs, sorted.
fn ownership(b: &Bucket) -> HashMap<ParamId, Vec<(usize, usize, u32)>> {
    let mut own: HashMap<ParamId, Vec<(usize, usize, u32)>> = HashMap::new();
    for q in 0..b.group_size() {
        for s in b.segments(q) {
            own.entry(s.param).or_default().push((s.param_offset, s.numel, q));
        }
    }
    for v in own.values_mut() {
        v.sort_unstable();
    }
    own
}

/// Every bucket invariant that does not depend on other buckets.
fn check_bucket(layout: &Layout, b: &Bucket) -> Result<(), TestCaseError> {
    let set = layout.params();
    let ae = layout.align() / b.dtype().size();
    prop_assert_eq!(b.shard_numel() % ae, 0, "bucket {} shard not aligned", b.id());
    for (&p, &n) in b.params().iter().zip(b.param_numels()) {
        prop_assert_eq!(set.get(p).unwrap().dtype, b.dtype(), "one dtype per bucket");
        prop_assert_eq!(set.numel(p), n);
    }
    // Each shard: runs inside the shard, aligned starts, no overlap.
    for q in 0..b.group_size() {
        let mut segs: Vec<Segment> = b.segments(q).collect();
        segs.sort_by_key(|s| s.shard_offset);
        let mut end = 0;
        for s in &segs {
            prop_assert!(s.numel > 0);
            prop_assert_eq!(s.shard_offset % ae, 0, "bucket {} rank {}: unaligned segment", b.id(), q);
            prop_assert!(s.shard_offset >= end, "bucket {} rank {}: overlap", b.id(), q);
            end = s.shard_offset + s.numel;
            prop_assert!(end <= b.shard_numel(), "bucket {} rank {}: past the shard", b.id(), q);
        }
        // Replicas across hybrid groups hold the same shard.
        let mut r = q + b.group_size();
        while r < layout.world() {
            prop_assert!(b.segments(r).eq(b.segments(q)), "rank {} differs from its replica {}", r, q);
            r += b.group_size();
        }
    }
    prop_assert_eq!(b.segments(layout.world()).count(), 0, "ranks outside the world hold nothing");
    // The O(1) per-parameter lookup agrees with the shard's segment list.
    for r in [0, layout.world() / 2, layout.world() - 1] {
        let segs: Vec<Segment> = b.segments(r).collect();
        for (i, &p) in b.params().iter().enumerate() {
            let want: Vec<Segment> = segs.iter().filter(|s| s.param == p).copied().collect();
            prop_assert!(want.len() <= 1, "param {} has {} runs on rank {}", p, want.len(), r);
            prop_assert_eq!(b.param_segment(i, r), want.first().copied());
            if b.kind() == BucketKind::Gather {
                prop_assert_eq!(layout.owned(p, r), want.first().copied());
            }
        }
    }
    prop_assert_eq!(b.param_segment(b.params().len(), 0), None);
    // Every element of every parameter is owned by exactly one group position.
    let own = ownership(b);
    prop_assert_eq!(own.len(), b.params().len());
    for (&p, &n) in b.params().iter().zip(b.param_numels()) {
        let mut at = 0;
        for &(off, len, _) in &own[&p] {
            prop_assert_eq!(off, at, "param {} of bucket {}: gap or overlap at {}", p, b.id(), at);
            at += len;
        }
        prop_assert_eq!(at, n, "param {} of bucket {}: not fully owned", p, b.id());
    }
    // The gathered buffer is the shards rank-major (or the single owner's shard).
    let mut expect = Vec::new();
    let positions: Vec<u32> = match b.single_owner() {
        Some(o) => vec![o],
        None => (0..b.group_size()).collect(),
    };
    for (k, &q) in positions.iter().enumerate() {
        for s in b.segments(q) {
            expect.push((q, s.param, s.param_offset, s.numel, k * b.shard_numel() + s.shard_offset));
        }
    }
    let got: Vec<_> =
        b.gathered_segments().map(|g| (g.rank, g.param, g.param_offset, g.numel, g.offset)).collect();
    // contiguous_offset: Some(o) exactly when the parameter's runs, in parameter order, are
    // back to back in the gathered buffer starting at o.
    let mut unpacked = 0;
    for (i, &p) in b.params().iter().enumerate() {
        let mut runs: Vec<_> = got.iter().filter(|r| r.1 == p).map(|r| (r.2, r.3, r.4)).collect();
        runs.sort_unstable();
        let back_to_back = runs.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0 && w[0].2 + w[0].1 == w[1].2);
        let want = back_to_back.then(|| runs[0].2);
        prop_assert_eq!(b.contiguous_offset(i), want, "bucket {} param {}", b.id(), p);
        if want.is_none() {
            unpacked += b.param_numels()[i];
        }
    }
    prop_assert_eq!(b.unpacked_numel(), unpacked);
    prop_assert_eq!(got, expect);
    prop_assert_eq!(b.gathered_numel(), positions.len() * b.shard_numel());
    if let Some(o) = b.single_owner() {
        for q in (0..b.group_size()).filter(|&q| q != o) {
            prop_assert_eq!(b.segments(q).count(), 0);
        }
    }
    Ok(())
}

fn check_layout(c: &Case, layout: &Layout) -> Result<(), TestCaseError> {
    let set = layout.params();
    for b in layout.buckets() {
        check_bucket(layout, b)?;
    }
    // Caps: a bucket over the cap holds a single parameter.
    for b in layout.gather_buckets() {
        prop_assert_eq!(b.kind(), BucketKind::Gather);
        let bytes = b.param_numel() * b.dtype().size();
        prop_assert!(bytes <= c.bucket_bytes || b.params().len() == 1, "bucket {} over the cap", b.id());
    }
    // Each parameter in exactly one gather bucket; gradient buckets hold the trainable ones.
    let mut gather_seen = vec![0u32; set.len()];
    for b in layout.gather_buckets() {
        for (i, &p) in b.params().iter().enumerate() {
            gather_seen[p.index()] += 1;
            let pl = layout.placement(p).unwrap();
            prop_assert_eq!((pl.gather, pl.gather_index as usize), (b.id(), i));
        }
    }
    prop_assert!(gather_seen.iter().all(|&n| n == 1));
    let mut grad_seen = vec![0u32; set.len()];
    for b in layout.grad_buckets() {
        prop_assert_eq!(b.kind(), BucketKind::Grad);
        let gather = layout.bucket(b.gather_bucket().unwrap()).unwrap();
        prop_assert_eq!(layout.grad_bucket_for(gather.id()), Some(b.id()));
        let (g_own, own) = (ownership(gather), ownership(b));
        for (i, &p) in b.params().iter().enumerate() {
            prop_assert!(set.is_trainable(p), "frozen param {} in grad bucket {}", p, b.id());
            grad_seen[p.index()] += 1;
            prop_assert_eq!(layout.placement(p).unwrap().grad, Some((b.id(), i as u32)));
            // Same owner for every element as in the gather bucket (optimizer state fits).
            prop_assert_eq!(&own[&p], &g_own[&p], "param {}: grad ownership differs", p);
        }
    }
    for p in set.ids() {
        prop_assert_eq!(grad_seen[p.index()], u32::from(set.is_trainable(p)));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn layouts_own_every_element_once(c in case(2000)) {
        let layout = build(&c);
        check_layout(&c, &layout)?;
        // Deterministic.
        prop_assert_eq!(&build(&c), &layout);
    }

    #[test]
    fn trainability_change_moves_no_shard(c in case(300), flips in prop::collection::vec(any::<bool>(), 300)) {
        let layout = build(&c);
        let mask: Vec<bool> = c.ps.iter().zip(&flips).map(|(&(_, _, t), &f)| t ^ f).collect();
        let (next, diff) = layout.with_trainable(&mask).unwrap();
        prop_assert_eq!(next.gather_buckets(), layout.gather_buckets());
        prop_assert_eq!(next.params().trainable_mask(), mask.clone());
        let case = Case { ps: c.ps.iter().zip(&mask).map(|(&(n, d, _), &t)| (n, d, t)).collect(), ..c.clone() };
        check_layout(&case, &next)?;
        // The same as building with the new mask from scratch.
        prop_assert_eq!(&next, &build(&case));
        // The diff lists exactly the flipped parameters.
        let flipped: Vec<ParamId> = layout.params().ids().filter(|p| mask[p.index()] != c.ps[p.index()].2).collect();
        let mut listed: Vec<ParamId> = diff.now_trainable.iter().chain(&diff.now_frozen).copied().collect();
        listed.sort();
        prop_assert_eq!(&listed, &flipped);
        prop_assert_eq!(diff.is_empty(), flipped.is_empty());
        // Grad buckets reported changed are exactly those whose parameter list changed.
        for g in layout.gather_buckets() {
            let old = layout.grad_bucket_for(g.id()).map(|id| layout.bucket(id).unwrap().params().to_vec());
            let new = next.grad_bucket_for(g.id()).map(|id| next.bucket(id).unwrap().params().to_vec());
            prop_assert_eq!(old != new, diff.grad_changed.contains(&g.id()));
        }
    }

    #[test]
    fn execution_order_groups_in_that_order(c in case(200), seed in any::<u64>()) {
        let set = set_of(&c.ps);
        // A permutation of a prefix: listed parameters first, the rest after.
        let mut order: Vec<ParamId> = set.ids().collect();
        let mut x = seed | 1;
        for i in (1..order.len()).rev() {
            x ^= x << 13; x ^= x >> 7; x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
        let listed = order.len() / 2 + 1;
        order.truncate(listed);
        let layout = LayoutBuilder::new(&set, c.sharding, c.world)
            .align(c.align).bucket_bytes(c.bucket_bytes).order(order.clone()).build().unwrap();
        check_layout(&c, &layout)?;
        // Within a bucket parameters follow the order; buckets are numbered by first use.
        let mut full = order.clone();
        full.extend(set.ids().filter(|p| !order.contains(p)));
        let pos: HashMap<ParamId, usize> = full.iter().enumerate().map(|(i, &p)| (p, i)).collect();
        let mut last_first = None;
        for b in layout.gather_buckets() {
            let ps: Vec<usize> = b.params().iter().map(|p| pos[p]).collect();
            prop_assert!(ps.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(last_first < Some(ps[0]));
            last_first = Some(ps[0]);
        }
    }
}

#[test]
fn even_split_matches_the_rank_major_formula() {
    // 10 f32 elements over 4 ranks, 16-byte alignment: chunks of 3, padded to 4.
    let set =
        ParamSet::new(vec![ParamSpec::new("w", [10], DType::F32), ParamSpec::new("b", [3], DType::F32)])
            .unwrap();
    let layout = LayoutBuilder::new(&set, Sharding::EvenSplit, 4).align(16).build().unwrap();
    let b = &layout.gather_buckets()[0];
    let chunk = 10usize.div_ceil(4).next_multiple_of(4);
    assert_eq!(b.shard_numel(), chunk + 4);
    for r in 0..4u32 {
        let segs: Vec<Segment> = b.segments(r).collect();
        let off = r as usize * chunk;
        let want_w = (off < 10).then(|| (off, chunk.min(10 - off)));
        let got_w = segs.iter().find(|s| s.param == ParamId(0)).map(|s| (s.param_offset, s.numel));
        assert_eq!(got_w, want_w, "rank {r}");
    }
}

#[test]
fn greedy_single_parameter_buckets_have_a_single_owner() {
    let set = ParamSet::new(vec![ParamSpec::new("big", [1 << 20], DType::F32)]).unwrap();
    let layout = LayoutBuilder::new(&set, Sharding::Greedy, 8).bucket_bytes(1024).build().unwrap();
    let b = &layout.gather_buckets()[0];
    let owner = b.single_owner().expect("one parameter, one owner");
    assert_eq!(b.gathered_numel(), b.shard_numel());
    assert_eq!(b.segments(owner).map(|s| s.numel).sum::<usize>(), 1 << 20);
}
