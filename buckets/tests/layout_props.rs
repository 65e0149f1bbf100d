//! Property tests of layouts: random parameter lists (1 to 2,000 parameters, 1 to 2^28
//! elements, mixed dtypes, random frozen masks, runs of modules), worlds 1 to 128, every
//! strategy, every bucket boundary.
//!
//! Nothing is materialized: ownership is checked on the segment intervals, so a case with
//! 2^28-element parameters costs no more than one with 4-element ones.

use std::collections::HashMap;

use collsched_buckets::{
    Boundary, Bucket, BucketKind, DType, Layout, LayoutBuilder, ModuleKey, ParamId, ParamSet, ParamSpec,
    Segment, Sharding,
};
use proptest::prelude::*;

/// A parameter list in a form proptest can shrink: (numel, dtype, trainable).
fn params(max: usize) -> impl Strategy<Value = Vec<(usize, DType, bool)>> {
    let numel = (0u32..=28).prop_flat_map(|e| 1usize..=(1usize << e));
    let dtype = prop::sample::select(DType::ALL.to_vec());
    prop::collection::vec((numel, dtype, any::<bool>()), 1..=max)
}

/// Parameter `i` of module `m` is named `l.{m}.p{i}.w`; every fifth one also names its module
/// explicitly (`x{m}`), which wins over the name.
fn set_of(c: &Case) -> ParamSet {
    let specs =
        c.ps.iter()
            .enumerate()
            .map(|(i, &(n, d, t))| {
                // Vary the rank of shapes; the element count is what matters.
                let shape = if i % 3 == 0 { vec![1, n] } else { vec![n] };
                let m = c.modules[i];
                let spec = ParamSpec::new(format!("l.{m}.p{i}.w"), shape, d).trainable(t);
                if i % 5 == 4 {
                    spec.module(format!("x{m}"))
                } else {
                    spec
                }
            })
            .collect();
    ParamSet::new(specs).expect("generated parameters are valid")
}

/// The module of a parameter under `boundary`, written independently of the library: the
/// explicit module, else the name split at dots without its last part, cut as the key says.
fn module_of(set: &ParamSet, p: ParamId, boundary: Boundary) -> Option<String> {
    let Boundary::Module { key, .. } = boundary else { return None };
    let spec = set.get(p).unwrap();
    if let Some(m) = &spec.module {
        return Some(m.clone());
    }
    let mut parts: Vec<&str> = spec.name.split('.').collect();
    parts.pop();
    let keep = match key {
        ModuleKey::Layer => parts
            .iter()
            .position(|c| !c.is_empty() && c.chars().all(|x| x.is_ascii_digit()))
            .map_or(1, |i| i + 1),
        ModuleKey::Depth(d) => d as usize,
    };
    parts.truncate(keep);
    Some(parts.join("."))
}

/// Per position of the bucketing order: the index of its module run (consecutive parameters
/// with the same module), or all 0 when bucketing by size.
fn runs_of(set: &ParamSet, order: &[ParamId], boundary: Boundary) -> Vec<usize> {
    let mut runs = Vec::with_capacity(order.len());
    let mut prev: Option<String> = None;
    let mut run = 0;
    for (i, &p) in order.iter().enumerate() {
        let m = module_of(set, p, boundary);
        if i > 0 && m != prev {
            run += 1;
        }
        runs.push(run);
        prev = m;
    }
    runs
}

fn boundary() -> impl Strategy<Value = Boundary> {
    let key = prop_oneof![Just(ModuleKey::Layer), (1u32..=4).prop_map(ModuleKey::Depth)];
    prop_oneof![
        Just(Boundary::Size),
        (key, any::<bool>()).prop_map(|(key, pack)| Boundary::Module { key, pack })
    ]
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
    /// Module index of each parameter (non-decreasing: runs of modules).
    modules: Vec<u32>,
    world: u32,
    sharding: Sharding,
    align: usize,
    bucket_bytes: usize,
    boundary: Boundary,
}

fn case(max_params: usize) -> impl Strategy<Value = Case> {
    (params(max_params), 1u32..=128, any::<u64>())
        .prop_flat_map(|(ps, world, seed)| {
            (
                Just(ps),
                Just(world),
                sharding(world),
                prop::sample::select(vec![8usize, 16, 64, 256, 4096]),
                (10u32..=32).prop_map(|e| 1usize << e),
                boundary(),
                Just(seed),
            )
        })
        .prop_map(|(ps, world, sharding, align, bucket_bytes, boundary, seed)| {
            // A new module starts before about one parameter in four (from the seed's bits).
            let mut m = 0;
            let modules = (0..ps.len())
                .map(|i| {
                    if i > 0 && (seed.rotate_left(i as u32 * 2) & 3) == 0 {
                        m += 1;
                    }
                    m
                })
                .collect();
            Case { ps, modules, world, sharding, align, bucket_bytes, boundary }
        })
}

fn build(c: &Case) -> Layout {
    LayoutBuilder::new(&set_of(c), c.sharding, c.world)
        .align(c.align)
        .bucket_bytes(c.bucket_bytes)
        .boundary(c.boundary)
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
    let mut split = false;
    for (i, &p) in b.params().iter().enumerate() {
        let mut runs: Vec<_> = got.iter().filter(|r| r.1 == p).map(|r| (r.2, r.3, r.4)).collect();
        runs.sort_unstable();
        let back_to_back = runs.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0 && w[0].2 + w[0].1 == w[1].2);
        let want = back_to_back.then(|| runs[0].2);
        prop_assert_eq!(b.contiguous_offset(i), want, "bucket {} param {}", b.id(), p);
        split |= want.is_none();
    }
    // A bucket with any split parameter is unpacked whole.
    let unpacked = if split { b.param_numels().iter().sum() } else { 0 };
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

/// Module boundaries, for a layout bucketed in `order`: without packing every bucket holds
/// one module run; with packing a run of consecutive whole modules; either way a module whose
/// bytes of a dtype fit under the cap sit in one bucket of that dtype.
fn check_modules(c: &Case, layout: &Layout, order: &[ParamId]) -> Result<(), TestCaseError> {
    prop_assert_eq!(layout.boundary(), c.boundary);
    let set = layout.params();
    let runs = runs_of(set, order, c.boundary);
    let mut run_of = vec![0; set.len()];
    for (&p, &r) in order.iter().zip(&runs) {
        run_of[p.index()] = r;
    }
    // Per (run, dtype): its bytes and the gather buckets holding it.
    let mut per: HashMap<(usize, DType), (usize, Vec<u32>)> = HashMap::new();
    for b in layout.gather_buckets() {
        let rs: Vec<usize> = b.params().iter().map(|p| run_of[p.index()]).collect();
        let pack = matches!(c.boundary, Boundary::Module { pack: true, .. });
        if !pack {
            prop_assert!(rs.iter().all(|&r| r == rs[0]), "bucket {} mixes module runs {:?}", b.id(), rs);
        } else {
            // Consecutive runs, each with parameters of this dtype (a run without any closes
            // the bucket).
            prop_assert!(
                rs.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1),
                "bucket {} skips a module: {:?}",
                b.id(),
                rs
            );
        }
        for (&p, &r) in b.params().iter().zip(&rs) {
            let e = per.entry((r, b.dtype())).or_default();
            e.0 += set.numel(p) * b.dtype().size();
            if e.1.last() != Some(&b.id().0) {
                e.1.push(b.id().0);
            }
        }
    }
    if c.boundary != Boundary::Size {
        for ((r, d), (bytes, buckets)) in &per {
            if *bytes <= c.bucket_bytes {
                prop_assert_eq!(
                    buckets.len(),
                    1,
                    "module run {} ({} B of {}) split over buckets {:?}",
                    r,
                    bytes,
                    d,
                    buckets
                );
            }
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
        check_modules(&c, &layout, &layout.params().ids().collect::<Vec<_>>())?;
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
        let set = set_of(&c);
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
            .align(c.align).bucket_bytes(c.bucket_bytes).boundary(c.boundary).order(order.clone()).build().unwrap();
        check_layout(&c, &layout)?;
        // Within a bucket parameters follow the order; buckets are numbered by first use.
        let mut full = order.clone();
        full.extend(set.ids().filter(|p| !order.contains(p)));
        check_modules(&c, &layout, &full)?;
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Module boundaries with a single module (names without a dot: the root module) give
    /// exactly the layout bucketed by size; and packing never makes more buckets than not
    /// packing.
    #[test]
    fn one_module_is_bucketing_by_size(c in case(300)) {
        let specs = c.ps.iter().enumerate().map(|(i, &(n, d, t))| ParamSpec::new(format!("p{i}"), [n], d).trainable(t)).collect();
        let set = ParamSet::new(specs).unwrap();
        let with = |b: Boundary| LayoutBuilder::new(&set, c.sharding, c.world).align(c.align).bucket_bytes(c.bucket_bytes).boundary(b).build().unwrap();
        let by_size = with(Boundary::Size);
        for key in [ModuleKey::Layer, ModuleKey::Depth(1), ModuleKey::Depth(3)] {
            for pack in [false, true] {
                let by_module = with(Boundary::Module { key, pack });
                prop_assert_eq!(by_module.buckets(), by_size.buckets());
            }
        }
        let full = build(&c);
        if let Boundary::Module { key, pack: false } = c.boundary {
            let packed = LayoutBuilder::new(&set_of(&c), c.sharding, c.world).align(c.align).bucket_bytes(c.bucket_bytes).boundary(Boundary::Module { key, pack: true }).build().unwrap();
            prop_assert!(packed.gather_buckets().len() <= full.gather_buckets().len());
        }
    }
}

#[test]
fn module_boundaries_split_at_layers() {
    // Two blocks of an HF-style model and a head; 4-byte elements, a 10 KiB cap.
    let mut specs = vec![ParamSpec::new("model.embed_tokens.weight", [512], DType::F32)];
    for l in 0..2 {
        for (n, numel) in
            [("input_layernorm.weight", 16), ("self_attn.q_proj.weight", 1024), ("mlp.up_proj.weight", 1024)]
        {
            specs.push(ParamSpec::new(format!("model.layers.{l}.{n}"), [numel], DType::F32));
        }
    }
    specs.push(ParamSpec::new("model.norm.weight", [16], DType::F32));
    specs.push(ParamSpec::new("lm_head.weight", [512], DType::F32));
    let set = ParamSet::new(specs).unwrap();
    let names = |l: &Layout| -> Vec<Vec<String>> {
        l.gather_buckets()
            .iter()
            .map(|b| b.params().iter().map(|&p| set.name(p).to_string()).collect())
            .collect()
    };
    let build = |b: Boundary| {
        LayoutBuilder::new(&set, Sharding::EvenSplit, 4).bucket_bytes(10 << 10).boundary(b).build().unwrap()
    };
    // By size: the first bucket takes the embedding and most of layer 0, and so on.
    assert_eq!(build(Boundary::Size).gather_buckets().len(), 3);
    // By layer: embedding | layer 0 | layer 1 | final norm | head.
    let by_layer = names(&build(Boundary::LAYER));
    assert_eq!(by_layer.len(), 5, "{by_layer:?}");
    assert_eq!(by_layer[1].len(), 3);
    assert!(by_layer[1].iter().all(|n| n.starts_with("model.layers.0.")));
    assert_eq!(by_layer[3], ["model.norm.weight"]);
    // Packed: the final norm (64 B) joins layer 1's bucket (8.06 KiB), the head (2 KiB) no
    // longer fits there; the embedding and layer 0 do not fit together (2 + 8.06 > 10 KiB).
    let packed = names(&build(Boundary::Module { key: ModuleKey::Layer, pack: true }));
    assert_eq!(packed.len(), 4, "{packed:?}");
    assert_eq!(packed[2].last().unwrap(), "model.norm.weight");
    assert_eq!(packed[3], ["lm_head.weight"]);
    // Depth 1 (`model` / `lm_head`): the decoder's consecutive parameters are one module,
    // split by the cap only; the head is apart.
    let depth1 = names(&build(Boundary::Module { key: ModuleKey::Depth(1), pack: false }));
    assert_eq!(depth1.last().unwrap(), &["lm_head.weight"]);
    // A module larger than the cap is split by the cap: 4 KiB + 4 KiB + 64 B at a 6 KiB cap.
    let small_cap = LayoutBuilder::new(&set, Sharding::EvenSplit, 4)
        .bucket_bytes(6 << 10)
        .boundary(Boundary::LAYER)
        .build()
        .unwrap();
    let layer0: Vec<usize> = small_cap
        .gather_buckets()
        .iter()
        .filter(|b| set.name(b.params()[0]).starts_with("model.layers.0."))
        .map(|b| b.params().len())
        .collect();
    assert_eq!(layer0, [2, 1]);
    // Depth 0 is refused.
    let err = LayoutBuilder::new(&set, Sharding::EvenSplit, 4)
        .boundary(Boundary::Module { key: ModuleKey::Depth(0), pack: false })
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("module depth 0"), "{err}");
}

#[test]
fn explicit_modules_override_names() {
    // Names say one module; the explicit field says two (e.g. a shared weight that a
    // different block uses).
    let set = ParamSet::new(vec![
        ParamSpec::new("h.0.a", [64], DType::F32),
        ParamSpec::new("h.0.b", [64], DType::F32).module("h.1"),
        ParamSpec::new("h.0.c", [64], DType::F32).module("h.1"),
    ])
    .unwrap();
    let l = LayoutBuilder::new(&set, Sharding::Flat, 2).boundary(Boundary::LAYER).build().unwrap();
    let sizes: Vec<usize> = l.gather_buckets().iter().map(|b| b.params().len()).collect();
    assert_eq!(sizes, [1, 2]);
    // By size they share one bucket.
    assert_eq!(LayoutBuilder::new(&set, Sharding::Flat, 2).build().unwrap().gather_buckets().len(), 1);
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
