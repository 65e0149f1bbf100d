//! Property tests of plans: op counts, groups, copy lists, frozen parameters, fingerprints.

use std::collections::HashMap;

use collsched_buckets::{BucketKind, DType, LayoutBuilder, ParamSet, ParamSpec, Sharding};

const BOUNDARIES: [Boundary; 5] = [
    Boundary::Size,
    Boundary::LAYER,
    Boundary::Module { key: ModuleKey::Layer, pack: true },
    Boundary::Module { key: ModuleKey::Depth(1), pack: false },
    Boundary::Module { key: ModuleKey::Depth(3), pack: true },
];
use proptest::prelude::*;

use super::*;

#[derive(Clone, Debug)]
struct Case {
    ps: Vec<(String, Vec<usize>, DType, bool)>,
    world: u32,
    sharding: Sharding,
    align: usize,
    bucket_bytes: usize,
    boundary: Boundary,
}

fn case(max_params: usize, max_world: u32) -> impl Strategy<Value = Case> {
    let numel = (0u32..=20).prop_flat_map(|e| 1usize..=(1usize << e));
    let param = (numel, prop::sample::select(DType::ALL.to_vec()), any::<bool>());
    (prop::collection::vec(param, 1..=max_params), 1..=max_world)
        .prop_flat_map(|(ps, world)| {
            let divisors: Vec<u32> = (1..=world).filter(|g| world.is_multiple_of(*g)).collect();
            let sharding = prop_oneof![
                Just(Sharding::EvenSplit),
                Just(Sharding::Flat),
                Just(Sharding::Greedy),
                prop::sample::select(divisors).prop_map(Sharding::Hybrid),
            ];
            (
                Just(ps),
                Just(world),
                sharding,
                prop::sample::select(vec![8usize, 64, 256]),
                8u32..=22,
                prop::sample::select(BOUNDARIES.to_vec()),
            )
        })
        .prop_map(|(ps, world, sharding, align, cap, boundary)| Case {
            // Modules of three parameters (`l.{i / 3}` at layer keys).
            ps: ps
                .into_iter()
                .enumerate()
                .map(|(i, (n, d, t))| (format!("l.{}.p{i}.w", i / 3), vec![n], d, t))
                .collect(),
            world,
            sharding,
            align,
            bucket_bytes: 1 << cap,
            boundary,
        })
}

fn plan_of(c: &Case) -> Plan {
    let specs =
        c.ps.iter().map(|(n, s, d, t)| ParamSpec::new(n.clone(), s.clone(), *d).trainable(*t)).collect();
    let set = ParamSet::new(specs).unwrap();
    let layout = LayoutBuilder::new(&set, c.sharding, c.world)
        .align(c.align)
        .bucket_bytes(c.bucket_bytes)
        .boundary(c.boundary)
        .build()
        .unwrap();
    Plan::new(layout)
}

type Observable = (
    u32,
    String,
    String,
    Vec<(String, usize, DType, bool)>,
    Vec<(BucketKind, DType, Vec<ParamId>, usize, Vec<Vec<(ParamId, usize, usize, usize)>>)>,
    Vec<(CollectiveKind, BucketId, Vec<u32>, usize)>,
);

/// Everything the plan shows (what `collsched plan --json` prints), materialized.
fn observable(plan: &Plan) -> Observable {
    let l = plan.layout();
    let params = l
        .params()
        .specs()
        .iter()
        .zip(l.params().numels())
        .map(|(s, &n)| (s.name.clone(), n, s.dtype, s.trainable))
        .collect();
    let buckets = l
        .buckets()
        .iter()
        .map(|b| {
            let shards = (0..l.world())
                .map(|r| b.segments(r).map(|s| (s.param, s.param_offset, s.numel, s.shard_offset)).collect())
                .collect();
            (b.kind(), b.dtype(), b.params().to_vec(), b.shard_numel(), shards)
        })
        .collect();
    let mut ops = Vec::new();
    for op in plan.ops() {
        for g in 0..op.groups().count() {
            ops.push((op.kind(), op.bucket(), op.groups().ranks(g).collect(), op.bytes_per_rank()));
        }
    }
    (l.world(), l.sharding().to_string(), l.boundary().to_string(), params, buckets, ops)
}

/// A second case derived from `c`: possibly equal, possibly differing in one input.
fn perturbed(c: &Case, what: u8, pick: usize, value: usize) -> Case {
    let mut d = c.clone();
    let i = pick % d.ps.len();
    match what {
        0 => {}
        1 => d.ps[i].1 = vec![value % 3000 + 1],
        2 => d.ps[i].3 = !d.ps[i].3,
        3 => d.align = [8, 64, 256][value % 3],
        4 => d.bucket_bytes = 1 << (8 + value % 15),
        5 => d.ps[i].0 = format!("q{}", value % 4),
        6 => d.world = (value % 16) as u32 + 1,
        7 => d.ps[i].2 = DType::ALL[value % 6],
        8 => {
            // Same element count, other shape: nothing that moves changes.
            let n: usize = d.ps[i].1.iter().product();
            d.ps[i].1 = vec![1, n];
        }
        9 => d.boundary = BOUNDARIES[value % BOUNDARIES.len()],
        _ => {
            d.sharding =
                [Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy, Sharding::Hybrid(1)][value % 4]
        }
    }
    if let Sharding::Hybrid(g) = d.sharding {
        if !d.world.is_multiple_of(g) {
            d.sharding = Sharding::Hybrid(1);
        }
    }
    d
}

fn valid(c: &Case) -> bool {
    let mut names: Vec<&str> = c.ps.iter().map(|p| p.0.as_str()).collect();
    names.sort_unstable();
    names.windows(2).all(|w| w[0] != w[1]) && c.ps.iter().all(|p| c.align.is_multiple_of(p.2.size()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn ops_cover_every_bucket_once_per_group(c in case(300, 64)) {
        let plan = plan_of(&c);
        let l = plan.layout();
        let g = l.group_size();
        let mut gathers = 0;
        for b in l.buckets() {
            let ops: Vec<&Op> = plan.ops_of(b.id()).iter().map(|&o| plan.op(o).unwrap()).collect();
            prop_assert!(ops.iter().all(|o| o.bucket() == b.id() && o.bytes_per_rank() == b.shard_bytes()));
            match b.kind() {
                BucketKind::Gather => {
                    gathers += 1;
                    prop_assert_eq!(ops.len(), 1);
                    prop_assert_eq!(plan.gather_op(b.id()), Some(ops[0].id()));
                    prop_assert!(plan.grad_ops(b.id()).is_empty());
                    let want = if b.single_owner().is_some() { CollectiveKind::Broadcast } else { CollectiveKind::AllGather };
                    prop_assert_eq!(ops[0].kind(), want);
                    prop_assert_eq!(ops[0].root(), b.single_owner());
                }
                BucketKind::Grad => {
                    prop_assert_eq!(plan.gather_op(b.id()), None);
                    prop_assert_eq!(plan.grad_ops(b.id()), plan.ops_of(b.id()));
                    let kinds: Vec<CollectiveKind> = ops.iter().map(|o| o.kind()).collect();
                    let want = match (b.single_owner(), c.sharding) {
                        (Some(_), _) => vec![CollectiveKind::AllReduce],
                        (None, Sharding::Hybrid(h)) if h < c.world => vec![CollectiveKind::ReduceScatter, CollectiveKind::AllReduce],
                        (None, _) => vec![CollectiveKind::ReduceScatter],
                    };
                    prop_assert_eq!(kinds, want);
                    // Exactly one op of the chain unpacks into the gradient shards.
                    prop_assert_eq!(ops.iter().filter(|o| o.copy_out()).count(), 1);
                    prop_assert!(ops.last().unwrap().copy_out());
                }
            }
            // Every op's groups partition the world.
            for o in &ops {
                let mut seen = vec![0u32; c.world as usize];
                for k in 0..o.groups().count() {
                    let ranks: Vec<u32> = o.groups().ranks(k).collect();
                    prop_assert_eq!(ranks.len() as u32, o.groups().group_size());
                    for &r in &ranks {
                        seen[r as usize] += 1;
                        prop_assert_eq!(o.groups().group_of(r), Some(k));
                        prop_assert!(o.groups().ranks_of(r).eq(ranks.iter().copied()));
                    }
                }
                prop_assert!(seen.iter().all(|&n| n == 1));
                let size = if o.groups().is_strided() { c.world / g } else { g };
                prop_assert_eq!(o.groups().group_size(), size);
            }
        }
        prop_assert_eq!(gathers, l.gather_buckets().len());
        prop_assert_eq!(plan.ops().iter().enumerate().all(|(i, o)| o.id().index() == i), true);
    }

    #[test]
    fn copy_lists_cover_the_buffers(c in case(200, 32)) {
        let plan = plan_of(&c);
        let l = plan.layout();
        for op in plan.ops() {
            let b = l.bucket(op.bucket()).unwrap();
            for r in 0..c.world {
                for role in [BufferRole::Shard, BufferRole::Gathered] {
                    let cap = if role == BufferRole::Shard { b.shard_numel() } else { b.gathered_numel() };
                    let runs: Vec<CopyRun> = plan.runs(op.id(), r, role).collect();
                    for run in &runs {
                        // Gradient ops never touch frozen parameters.
                        if b.kind() == BucketKind::Grad {
                            prop_assert!(l.params().is_trainable(run.param), "op {} touches frozen {}", op.id(), run.param);
                        }
                        prop_assert!(run.offset + run.numel <= cap);
                        prop_assert!(run.param_offset + run.numel <= l.params().numel(run.param));
                    }
                    if role == BufferRole::Gathered {
                        // The gathered buffer holds every parameter of the bucket entirely.
                        let mut total: HashMap<ParamId, usize> = HashMap::new();
                        for run in &runs {
                            *total.entry(run.param).or_default() += run.numel;
                        }
                        for (&p, &n) in b.params().iter().zip(b.param_numels()) {
                            prop_assert_eq!(total.get(&p).copied(), Some(n));
                        }
                    }
                }
            }
            prop_assert_eq!(plan.runs(op.id(), c.world, BufferRole::Shard).count(), 0);
        }
    }

    #[test]
    fn fingerprint_changes_exactly_when_the_plan_does(
        c in case(40, 16),
        what in 0u8..11,
        pick in any::<usize>(),
        value in any::<usize>(),
    ) {
        let d = perturbed(&c, what, pick, value);
        prop_assume!(valid(&d));
        let (a, b) = (plan_of(&c), plan_of(&d));
        let same = observable(&a) == observable(&b);
        prop_assert_eq!(same, a.fingerprint() == b.fingerprint(), "perturbation {}", what);
        // Rebuilding gives the same fingerprint (no hidden state, no randomness).
        prop_assert_eq!(plan_of(&c).fingerprint(), a.fingerprint());
        // Bucket digests agree with bucket contents when the layouts line up.
        if same {
            for bk in a.layout().buckets() {
                prop_assert_eq!(a.bucket_digest(bk.id()), b.bucket_digest(bk.id()));
            }
        }
    }

    #[test]
    fn trainability_change_keeps_gather_ops(c in case(100, 16), flips in prop::collection::vec(any::<bool>(), 100)) {
        let plan = plan_of(&c);
        let mask: Vec<bool> = c.ps.iter().zip(&flips).map(|(p, &f)| p.3 ^ f).collect();
        let (next, _) = plan.with_trainable(&mask).unwrap();
        for b in plan.layout().gather_buckets() {
            let (o, n) = (plan.gather_op(b.id()).unwrap(), next.gather_op(b.id()).unwrap());
            prop_assert_eq!(o, n);
            prop_assert_eq!(plan.op(o), next.op(n));
        }
        let changed = mask.iter().zip(&c.ps).any(|(&m, p)| m != p.3);
        prop_assert_eq!(changed, plan.fingerprint() != next.fingerprint());
    }
}

#[test]
fn fingerprint_covers_the_boundary_knob() {
    // One module (no dots): module boundaries give the same buckets, but another fingerprint,
    // with equal per-bucket digests (so a mismatch names no bucket: the settings differ).
    let set =
        ParamSet::new(vec![ParamSpec::new("a", [64], DType::F32), ParamSpec::new("b", [64], DType::F32)])
            .unwrap();
    let plan = |b: Boundary| {
        Plan::new(LayoutBuilder::new(&set, Sharding::EvenSplit, 2).boundary(b).build().unwrap())
    };
    let fingerprints: Vec<PlanFingerprint> = BOUNDARIES.iter().map(|&b| plan(b).fingerprint()).collect();
    for (i, f) in fingerprints.iter().enumerate() {
        assert!(!fingerprints[..i].contains(f), "boundary {} repeats a fingerprint", BOUNDARIES[i]);
    }
    let (size, layer) = (plan(Boundary::Size), plan(Boundary::LAYER));
    assert_eq!(size.layout().buckets(), layer.layout().buckets());
    for b in size.layout().buckets() {
        assert_eq!(size.bucket_digest(b.id()), layer.bucket_digest(b.id()));
    }
}

#[test]
fn hybrid_ops_are_listed_per_group() {
    let set = ParamSet::new(vec![ParamSpec::new("w", [1000], DType::F32)]).unwrap();
    let plan = Plan::new(LayoutBuilder::new(&set, Sharding::Hybrid(2), 6).build().unwrap());
    let grad = plan.layout().grad_buckets()[0].id();
    let ops = plan.grad_ops(grad);
    let ar = plan.op(ops[1]).unwrap();
    let groups: Vec<Vec<u32>> = (0..ar.groups().count()).map(|k| ar.groups().ranks(k).collect()).collect();
    // Replicas of position i across the 3 groups of 2: {i, i+2, i+4}.
    let want: Vec<Vec<u32>> = (0..2).map(|i| (0..3).map(|j| i + 2 * j).collect()).collect();
    assert_eq!(groups, want);
    let rs = plan.op(ops[0]).unwrap();
    assert_eq!(rs.groups().count(), 3);
    assert!(!rs.copy_out() && ar.copy_out() && !ar.copy_in());
}

/// Value of element `i` of parameter `p` (gather) or of rank `r`'s gradient of it.
fn value(p: ParamId, i: usize, rank: Option<u32>) -> u64 {
    let base = (u64::from(p.0) << 32) | i as u64;
    match rank {
        None => base + 1,
        Some(r) => base.wrapping_mul(u64::from(r) + 3).wrapping_add(17),
    }
}

/// Runs a bucket's ops on plain vectors, exactly as the op metadata says (copy-in from the
/// given input role, the collective per group, copy-out into the output role), and checks
/// every unpacked element against the reference: the parameter itself for a gather bucket, the
/// sum of every rank's gradient for a gradient bucket. Returns how often each element was
/// unpacked over the whole world.
fn simulate(plan: &Plan, bucket: BucketId) -> Result<HashMap<(ParamId, usize), u32>, TestCaseError> {
    let l = plan.layout();
    let b = l.bucket(bucket).unwrap();
    let world = l.world();
    let grad = b.kind() == BucketKind::Grad;
    let size = |role| if role == BufferRole::Shard { b.shard_numel() } else { b.gathered_numel() };
    let mut bufs: Vec<Vec<u64>> = Vec::new();
    let mut seen = HashMap::new();
    for &id in plan.ops_of(bucket) {
        let op = plan.op(id).unwrap();
        let groups = op.groups();
        if op.copy_in() {
            bufs = (0..world)
                .map(|r| {
                    let mut buf = vec![0u64; size(op.input())];
                    let packs = op.root().is_none_or(|root| groups.position(r) == Some(root));
                    if packs {
                        for run in plan.runs(id, r, op.input()) {
                            for j in 0..run.numel {
                                buf[run.offset + j] =
                                    value(run.param, run.param_offset + j, grad.then_some(r));
                            }
                        }
                    }
                    buf
                })
                .collect();
        }
        prop_assert!(bufs.iter().all(|x| x.len() == size(op.input())), "op {}: input size", id);
        let out: Vec<Vec<u64>> = (0..world)
            .map(|r| {
                let members: Vec<u32> = groups.ranks_of(r).collect();
                let pos = groups.position(r).unwrap() as usize;
                match op.kind() {
                    CollectiveKind::AllGather => {
                        members.iter().flat_map(|&m| bufs[m as usize].clone()).collect()
                    }
                    CollectiveKind::Broadcast => bufs[members[op.root().unwrap() as usize] as usize].clone(),
                    CollectiveKind::ReduceScatter | CollectiveKind::AllReduce => {
                        let n = size(op.output());
                        let start = if op.kind() == CollectiveKind::ReduceScatter { pos * n } else { 0 };
                        (0..n)
                            .map(|k| {
                                members.iter().fold(0u64, |a, &m| a.wrapping_add(bufs[m as usize][start + k]))
                            })
                            .collect()
                    }
                }
            })
            .collect();
        bufs = out;
        prop_assert!(bufs.iter().all(|x| x.len() == size(op.output())), "op {}: output size", id);
        if op.copy_out() {
            for r in 0..world {
                for run in plan.runs(id, r, op.output()) {
                    for j in 0..run.numel {
                        let i = run.param_offset + j;
                        let want = if grad {
                            (0..world).fold(0u64, |a, q| a.wrapping_add(value(run.param, i, Some(q))))
                        } else {
                            value(run.param, i, None)
                        };
                        prop_assert_eq!(
                            bufs[r as usize][run.offset + j],
                            want,
                            "op {} rank {} {} [{}]",
                            id,
                            r,
                            run.param,
                            i
                        );
                        *seen.entry((run.param, i)).or_insert(0) += 1;
                    }
                }
            }
        }
    }
    Ok(seen)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// The plan run on vectors reproduces an unsharded reference: every rank gathers every
    /// parameter exactly; every gradient element is summed over the whole world and lands on
    /// exactly one rank per shard group.
    #[test]
    fn plans_move_data_correctly(c in case(24, 12)) {
        let mut c = c;
        for p in &mut c.ps {
            p.1 = vec![p.1[0] % 1500 + 1];
        }
        let plan = plan_of(&c);
        let l = plan.layout();
        for b in l.buckets() {
            let seen = simulate(&plan, b.id())?;
            let want = match b.kind() {
                BucketKind::Gather => l.world(),
                BucketKind::Grad => l.world() / b.group_size(),
            };
            for (&p, &n) in b.params().iter().zip(b.param_numels()) {
                for i in 0..n {
                    prop_assert_eq!(seen.get(&(p, i)).copied(), Some(want), "bucket {} {}[{}]", b.id(), p, i);
                }
            }
            prop_assert_eq!(seen.len(), b.param_numel());
        }
    }
}

#[test]
fn fuzz_entry_maps_knob_bytes() {
    let text = r#"{"params": [{"name": "h.0.w", "shape": [100], "dtype": "f32"},
        {"name": "h.1.w", "shape": [100], "dtype": "f32", "module": "h.1"}]}"#;
    // even over 4 ranks: two ops, each with shard and gathered runs on ranks 0 and 3.
    let runs = super::fuzz_build_plan(text, 0, 4, 1 << 20, 256, 0).unwrap();
    assert!(runs > 0);
    // hybrid:0 and hybrid:3 over 4 ranks are layout errors, world 0 too.
    assert!(matches!(super::fuzz_build_plan(text, 3, 4, 1 << 20, 256, 0), Err(PlanInputError::Layout(_))));
    assert!(matches!(
        super::fuzz_build_plan(text, 3 | (3 << 2), 4, 1 << 20, 256, 0),
        Err(PlanInputError::Layout(_))
    ));
    assert!(matches!(super::fuzz_build_plan(text, 0, 0, 1 << 20, 256, 0), Err(PlanInputError::Layout(_))));
    assert!(matches!(super::fuzz_build_plan("{", 0, 4, 1 << 20, 256, 0), Err(PlanInputError::Params(_))));
    // Module boundaries: layer keys, depth 2, packing; depth 0 is a layout error.
    for b in [1, 2 | (2 << 3), 1 | 4, 2 | 4 | (1 << 3)] {
        assert_eq!(super::fuzz_build_plan(text, 0, 4, 1 << 20, 256, b).unwrap(), runs, "boundary byte {b}");
    }
    assert!(matches!(super::fuzz_build_plan(text, 0, 4, 1 << 20, 256, 2), Err(PlanInputError::Layout(_))));
}
