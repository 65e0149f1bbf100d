//! Gradient reduction in a dtype other than the parameters' (bf16 or f16 parameters reduced in
//! f32, f32 parameters reduced in bf16 or f16), against an unsharded reference computed here
//! that does the same casts and sums in the reduce-scatter's order; a parameter without a
//! gradient reduced as zeros; refused dtype pairs; and
//! hybrid sharding's cross-group all-reduce chained behind the in-group reduce-scatter in
//! stream order (launched before the reduce-scatter completed; a failure of the first stage
//! reported on every rank).

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalRank, LocalWorld};
use collsched::backend::{BackendError, Stream};
use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::kernels::ElemType;
use collsched::runtime::{Coordinator, GradRegion, ModelState, RuntimeError};
use collsched::schedule::{GradReduce, Plan, SchedulerConfig};
use half::{bf16, f16};

/// Odd sizes, several buckets of 64 bytes.
const SIZES: [usize; 6] = [17, 35, 5, 33, 3, 18];
const STEPS: usize = 3;
const MICRO: usize = 3;
const LR: f32 = 0.125;

fn elem(d: DType) -> ElemType {
    match d {
        DType::F32 => ElemType::F32,
        DType::F16 => ElemType::F16,
        DType::BF16 => ElemType::BF16,
        other => panic!("no element type for {other}"),
    }
}

/// `v` rounded to `t` (round to nearest even), as f32.
fn round(t: ElemType, v: f32) -> f32 {
    match t {
        ElemType::F32 => v,
        ElemType::F16 => f16::from_f32(v).to_f32(),
        ElemType::BF16 => bf16::from_f32(v).to_f32(),
    }
}

fn encode(t: ElemType, v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| match t {
            ElemType::F32 => x.to_le_bytes().to_vec(),
            ElemType::F16 => f16::from_f32(x).to_le_bytes().to_vec(),
            ElemType::BF16 => bf16::from_f32(x).to_le_bytes().to_vec(),
        })
        .collect()
}

fn decode(t: ElemType, b: &[u8]) -> Vec<f32> {
    b.chunks_exact(t.size())
        .map(|c| match t {
            ElemType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            ElemType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            ElemType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A deterministic gradient value (before rounding to the parameters' dtype): magnitudes from
/// 2^-14 to 8 so that casts and sums round.
fn grad_value(step: usize, micro: usize, rank: usize, param: usize, i: usize) -> f32 {
    let mut h =
        (step as u64) << 48 ^ (micro as u64) << 40 ^ (rank as u64) << 32 ^ (param as u64) << 20 ^ i as u64;
    h = h.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^= h >> 29;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 32;
    let mant = (h & 0xFFFF) as f32 / 65536.0 * 2.0 - 1.0;
    let scale = [8.0, 1.0, 0.3, 2f32.powi(-9), 2f32.powi(-14)][((h >> 16) % 5) as usize];
    mant * scale
}

#[derive(Clone, Copy, Debug)]
struct Case {
    dtype: DType,
    reduce: DType,
    world: usize,
    sharding: Sharding,
    pre: Option<f64>,
    post: Option<f64>,
    /// On the last step parameter `MISSING` gets no gradient on any rank (a parameter the
    /// forward did not use): reduced as zeros, in a gradient buffer an earlier step wrote.
    missing: bool,
}

/// The parameter without a gradient on the last step of a `missing` case.
const MISSING: usize = 3;

/// Whether parameter `k` gets a gradient on `step`.
fn has_grad(case: &Case, step: usize, k: usize) -> bool {
    !(case.missing && step == STEPS - 1 && k == MISSING)
}

impl Case {
    fn config(&self) -> SchedulerConfig {
        SchedulerConfig {
            reduce: GradReduce { dtype: Some(self.reduce), pre_divide: self.pre, post_divide: self.post },
            ..SchedulerConfig::default()
        }
    }

    /// f32 parameters reduced in f32, evenly split over `world` ranks, no scaling.
    fn f32_even(world: usize) -> Case {
        let (pre, post) = (None, None);
        Case {
            dtype: DType::F32,
            reduce: DType::F32,
            world,
            sharding: Sharding::EvenSplit,
            pre,
            post,
            missing: false,
        }
    }

    /// Every parameter's initial value, encoded in the parameters' dtype.
    fn init_bytes(&self) -> Vec<Vec<u8>> {
        self.init().iter().map(|v| encode(elem(self.dtype), v)).collect()
    }

    fn plan(&self) -> Plan {
        let specs = SIZES
            .iter()
            .enumerate()
            .map(|(k, &n)| ParamSpec::new(format!("p{k}"), [n], self.dtype))
            .collect();
        let set = ParamSet::new(specs).expect("params");
        let layout = LayoutBuilder::new(&set, self.sharding, self.world as u32)
            .bucket_bytes(64)
            .build()
            .expect("layout");
        Plan::new(layout)
    }

    fn init(&self) -> Vec<Vec<f32>> {
        let p = elem(self.dtype);
        SIZES
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|i| round(p, (k as f32 + 1.0) * 0.37 - i as f32 * 0.0625)).collect())
            .collect()
    }

    /// The shard groups of the first reduction stage, and whether a second stage (all-reduce
    /// across them) follows: hybrid sharding over several groups.
    fn groups(&self) -> Vec<Vec<usize>> {
        match self.sharding {
            Sharding::Hybrid(g) if (g as usize) < self.world => {
                let g = g as usize;
                (0..self.world / g).map(|b| (b * g..(b + 1) * g).collect()).collect()
            }
            _ => vec![(0..self.world).collect()],
        }
    }
}

/// The reference: the unsharded run doing the driver's casts. Per rank, the micro-batch
/// gradients (in the parameters' dtype) accumulate in the reduction dtype (the first cast,
/// each later one added in f32 and rounded); then the contributions are summed in f32 in
/// rank order within each shard group, each divided by `pre`, the sum divided by `post` (by
/// 1 for hybrid's first stage, whose results are then summed across groups in group order
/// and divided by `post`), each stage rounded to the reduction dtype. Returns per step the
/// reduced gradients, and the parameters after the SGD steps.
fn reference(case: &Case) -> (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>) {
    let (p, r) = (elem(case.dtype), elem(case.reduce));
    let pre = case.pre.unwrap_or(1.0);
    let post = case.post.unwrap_or(case.world as f64 / pre) as f32;
    let pre = pre as f32;
    let groups = case.groups();
    let mut params = case.init();
    let mut grads = Vec::new();
    for step in 0..STEPS {
        let mut step_grads = Vec::new();
        for (k, w) in params.iter_mut().enumerate() {
            let mut red = vec![0f32; w.len()];
            for (i, out) in red.iter_mut().enumerate() {
                let contribution = |rank: usize| {
                    let g = |m: usize| {
                        if has_grad(case, step, k) {
                            round(p, grad_value(step, m, rank, k, i))
                        } else {
                            0.0
                        }
                    };
                    (1..MICRO).fold(round(r, g(0)), |acc, m| round(r, acc + g(m)))
                };
                let stage = |group: &[usize], post: f32| {
                    let mut s = 0f32;
                    for &rank in group {
                        s += contribution(rank) / pre;
                    }
                    round(r, s / post)
                };
                *out = if groups.len() == 1 {
                    stage(&groups[0], post)
                } else {
                    let mut s = 0f32;
                    for g in &groups {
                        s += stage(g, 1.0) / 1.0;
                    }
                    round(r, s / post)
                };
            }
            for (x, g) in w.iter_mut().zip(&red) {
                *x = round(p, *x - LR * g);
            }
            step_grads.push(red);
        }
        grads.push(step_grads);
    }
    (grads, params)
}

/// What one rank saw: per step, the gradient runs its optimizer hook got (parameter, offset,
/// values), and the parameters it fetched at the end.
type Seen = (Vec<Vec<Run>>, Vec<Vec<f32>>);

/// A gradient run an optimizer hook got: parameter, offset, values.
type Run = (usize, usize, Vec<f32>);

fn world(n: usize) -> LocalWorld {
    LocalWorld::with_config(n, LocalConfig { timeout: Duration::from_secs(30), ..LocalConfig::default() })
        .expect("world")
}

/// Backward of one micro-batch: per parameter in reverse, fetch, hand the gradient, release.
fn backward(
    c: &mut Coordinator<LocalRank>,
    case: &Case,
    step: usize,
    micro: usize,
) -> Result<(), RuntimeError> {
    let p = elem(case.dtype);
    for k in (0..SIZES.len()).rev() {
        let id = ParamId(k as u32);
        c.fetch(&[id])?;
        if has_grad(case, step, k) {
            let g: Vec<f32> =
                (0..SIZES[k]).map(|i| grad_value(step, micro, c.model().rank(), k, i)).collect();
            c.grad_ready(id, &encode(p, &g))?;
        }
        c.release(&[id])?;
    }
    Ok(())
}

fn sgd_hook(seen: &mut Vec<Run>) -> impl FnMut(collsched::runtime::ShardUpdate<'_>) + '_ {
    move |u| {
        let g = decode(u.grad_elem, u.grad);
        let w = decode(u.elem, u.values);
        let new: Vec<f32> = w.iter().zip(&g).map(|(x, g)| x - LR * g).collect();
        u.values.copy_from_slice(&encode(u.elem, &new));
        seen.push((u.param.index(), u.param_offset, g));
    }
}

fn sharded(case: &Case) -> Vec<Seen> {
    let plan = case.plan();
    let init = case.init();
    let bytes: Vec<Vec<u8>> = init.iter().map(|v| encode(elem(case.dtype), v)).collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let results = world(case.world)
        .run(|rank| -> Result<Seen, RuntimeError> {
            let state = ModelState::new(Arc::new(rank), &plan, &refs)?;
            let mut c = state.coordinator(case.config())?;
            let mut steps = Vec::new();
            for step in 0..STEPS {
                for micro in 0..MICRO - 1 {
                    let mut g = c.no_sync()?;
                    backward(&mut g, case, step, micro)?;
                    g.end_step()?;
                }
                backward(&mut c, case, step, MICRO - 1)?;
                c.end_step()?;
                let mut seen = Vec::new();
                c.update_shards(sgd_hook(&mut seen))?;
                steps.push(seen);
            }
            let all: Vec<ParamId> = (0..SIZES.len() as u32).map(ParamId).collect();
            let v = c.fetch(&all)?;
            let t = elem(case.dtype);
            let fin = all.iter().map(|&p| v.bytes(p).map(|b| decode(t, b))).collect::<Result<Vec<_>, _>>()?;
            drop(v);
            c.release(&all)?;
            c.end_step()?;
            Ok((steps, fin))
        })
        .expect("ranks");
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| {
            x.unwrap_or_else(|_| panic!("{case:?}: rank {r} panicked"))
                .unwrap_or_else(|e| panic!("{case:?}: rank {r}: {e}"))
        })
        .collect()
}

/// Every rank's gradients and final parameters equal the reference's bit for bit, and every
/// gradient element reached exactly one optimizer per shard group.
fn check(case: &Case) {
    check_runs(case, &sharded(case));
}

/// `case`'s reduced gradients and final parameters from `ranks` equal the reference's bit for
/// bit, and every gradient element reached exactly one optimizer per shard group.
fn check_runs(case: &Case, ranks: &[Seen]) {
    let (grads, params) = reference(case);
    for (step, want) in grads.iter().enumerate() {
        let mut cover: Vec<Vec<usize>> = SIZES.iter().map(|&n| vec![0; n]).collect();
        for (r, (steps, _)) in ranks.iter().enumerate() {
            for (p, off, g) in &steps[step] {
                assert_eq!(
                    bits(g),
                    bits(&want[*p][*off..off + g.len()]),
                    "{case:?}: step {step}, rank {r}, parameter p{p} at {off}: reduced gradient differs"
                );
                cover[*p][*off..off + g.len()].iter_mut().for_each(|c| *c += 1);
            }
        }
        let copies = case.groups().len();
        for (p, c) in cover.iter().enumerate() {
            assert!(
                c.iter().all(|&n| n == copies),
                "{case:?}: step {step}: p{p} covered {c:?} times, want {copies}"
            );
        }
    }
    for (r, (_, fin)) in ranks.iter().enumerate() {
        for (k, (got, want)) in fin.iter().zip(&params).enumerate() {
            assert_eq!(bits(got), bits(want), "{case:?}: rank {r}: final p{k} differs");
        }
    }
}

fn strategies(world: usize) -> Vec<Sharding> {
    let mut s = vec![Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy];
    s.extend((1..world).filter(|g| world.is_multiple_of(*g)).map(|g| Sharding::Hybrid(g as u32)));
    s
}

fn all_cases(dtype: DType, reduce: DType) {
    for world in 1..=5 {
        for (k, sharding) in strategies(world).into_iter().enumerate() {
            // Alternate the divide factors: the defaults (mean), a pre-divide, both given.
            let (pre, post) = [(None, None), (Some(2.0), None), (Some(4.0), Some(0.75))][(world + k) % 3];
            check(&Case { dtype, reduce, world, sharding, pre, post, missing: false });
        }
    }
}

#[test]
fn bf16_params_reduced_in_f32_match_the_reference() {
    all_cases(DType::BF16, DType::F32);
}

#[test]
fn f16_params_reduced_in_f32_match_the_reference() {
    all_cases(DType::F16, DType::F32);
}

#[test]
fn f32_params_reduced_in_bf16_match_their_reference() {
    all_cases(DType::F32, DType::BF16);
}

#[test]
fn f32_params_reduced_in_f16_match_their_reference() {
    for world in [2, 4] {
        for sharding in [Sharding::EvenSplit, Sharding::Hybrid(2)] {
            check(&Case {
                dtype: DType::F32,
                reduce: DType::F16,
                world,
                sharding,
                pre: Some(2.0),
                post: None,
                missing: false,
            });
        }
    }
}

/// A gradient that never comes is reduced as zeros, though the bucket's gradient buffer comes
/// from the pool with an earlier step's gradients in it.
#[test]
fn a_parameter_without_a_gradient_is_reduced_as_zeros_in_a_reused_buffer() {
    for (dtype, reduce) in [(DType::F32, DType::F32), (DType::BF16, DType::F32)] {
        for world in 1..=4 {
            for sharding in strategies(world) {
                check(&Case { dtype, reduce, world, sharding, pre: None, post: None, missing: true });
            }
        }
    }
}

#[test]
fn the_optimizer_gets_the_gradient_in_the_reduction_dtype_and_update_shards_f32_widens_it() {
    let case = Case {
        dtype: DType::F32,
        reduce: DType::BF16,
        world: 2,
        sharding: Sharding::EvenSplit,
        pre: None,
        post: None,
        missing: false,
    };
    let plan = case.plan();
    let init = case.init();
    let (grads, _) = reference(&case);
    let out = world(2)
        .run(|rank| -> Result<Vec<Run>, RuntimeError> {
            let state = ModelState::from_f32(Arc::new(rank), &plan, &init)?;
            let mut c = state.coordinator(case.config())?;
            for micro in 0..MICRO - 1 {
                let mut g = c.no_sync()?;
                backward(&mut g, &case, 0, micro)?;
                g.end_step()?;
            }
            backward(&mut c, &case, 0, MICRO - 1)?;
            c.end_step()?;
            let mut seen = Vec::new();
            c.update_shards_f32(|p, off, _, g| seen.push((p.index(), off, g.to_vec())))?;
            // Consumed: a second call visits nothing.
            assert_eq!(c.update_shards(|_| {})?, 0);
            Ok(seen)
        })
        .expect("ranks");
    let mut runs = 0;
    for (r, seen) in out.into_iter().enumerate() {
        for (p, off, g) in seen.expect("rank thread").expect("rank") {
            assert_eq!(bits(&g), bits(&grads[0][p][off..off + g.len()]), "rank {r}, p{p} at {off}");
            runs += 1;
        }
    }
    assert!(runs >= SIZES.len(), "every parameter has at least one run, got {runs}");
}

#[test]
fn refused_dtype_pairs_name_the_bucket_and_both_dtypes() {
    for (dtype, reduce, words) in [
        (DType::BF16, DType::F16, "range"),
        (DType::F16, DType::BF16, "precision"),
        (DType::F32, DType::F64, "f32, f16 or bf16"),
        (DType::BF16, DType::I8, "f32, f16 or bf16"),
    ] {
        let case = Case {
            dtype,
            reduce,
            world: 2,
            sharding: Sharding::EvenSplit,
            pre: None,
            post: None,
            missing: false,
        };
        let plan = case.plan();
        let gather = plan.layout().gather_buckets()[1].id();
        // Only one gather bucket's override is bad: the error names its gradient bucket.
        let config = SchedulerConfig {
            reduce_per_bucket: vec![(gather, GradReduce { dtype: Some(reduce), ..GradReduce::default() })],
            ..SchedulerConfig::default()
        };
        let bytes: Vec<Vec<u8>> = case.init().iter().map(|v| encode(elem(dtype), v)).collect();
        let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        let out = world(2)
            .run(|rank| {
                let state = ModelState::new(Arc::new(rank), &plan, &refs).expect("state");
                state.coordinator(config.clone()).map(|_| ())
            })
            .expect("ranks");
        for (r, res) in out.into_iter().enumerate() {
            let e = res.expect("rank thread").expect_err("a refused pair");
            let msg = e.to_string();
            match e {
                RuntimeError::ReduceDtype { rank, gather_bucket, dtype: d, reduce: rd, .. } => {
                    assert_eq!((rank, gather_bucket, d, rd), (r, Some(gather), dtype, reduce), "{msg}");
                }
                other => panic!("{dtype}/{reduce}: expected ReduceDtype, got {other}"),
            }
            for w in
                ["gradient bucket", &format!("gather bucket {gather}"), dtype.name(), reduce.name(), words]
            {
                assert!(msg.contains(w), "{dtype}/{reduce}: message lacks {w:?}: {msg}");
            }
        }
    }
}

/// Blocks rank's reduce-scatter stream until the test says go (`true`) or fail (`false`).
fn gate(rank: &LocalRank) -> mpsc::Sender<bool> {
    let (tx, rx) = mpsc::channel::<bool>();
    rank.enqueue_host(Stream::ReduceScatter, move || match rx.recv() {
        Ok(false) => {
            Err(BackendError::Unsupported { what: "injected failure before the reduce-scatter".into() })
        }
        _ => Ok(()),
    })
    .expect("gate");
    tx
}

fn hybrid_case() -> Case {
    Case {
        dtype: DType::BF16,
        reduce: DType::F32,
        world: 4,
        sharding: Sharding::Hybrid(2),
        pre: None,
        post: None,
        missing: false,
    }
}

/// All gradients of one step (no fetches) with the reduce-scatter stream gated: every
/// reduction, both stages, is launched while no reduce-scatter can have run.
fn gated_step(c: &mut Coordinator<LocalRank>, case: &Case) -> Result<usize, RuntimeError> {
    let p = elem(case.dtype);
    for k in (0..SIZES.len()).rev() {
        let g: Vec<f32> = (0..SIZES[k]).map(|i| grad_value(0, 0, c.model().rank(), k, i)).collect();
        c.grad_ready(ParamId(k as u32), &encode(p, &g))?;
    }
    c.poll()?;
    Ok(c.reductions_in_flight())
}

#[test]
fn hybrid_all_reduce_is_launched_before_the_reduce_scatter_completed() {
    let case = Case { pre: Some(2.0), ..hybrid_case() };
    let plan = case.plan();
    let n_grad = plan.layout().grad_buckets().len();
    assert!(n_grad >= 3, "want several gradient buckets, got {n_grad}");
    let bytes = case.init_bytes();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let out = world(4)
        .run(|rank| -> Result<(u64, usize, Vec<Run>), RuntimeError> {
            let state = ModelState::new(Arc::new(rank), &plan, &refs)?;
            let mut c = state.coordinator(SchedulerConfig { ..case.config() })?;
            let go = gate(state.backend());
            let in_flight = gated_step(&mut c, &case)?;
            // Both stages of every bucket were issued while the stream was held.
            let launched = c.driver_counters().collectives;
            go.send(true).expect("gate");
            c.end_step()?;
            let mut seen = Vec::new();
            c.update_shards(sgd_hook(&mut seen))?;
            Ok((launched, in_flight, seen))
        })
        .expect("ranks");
    // The reference of this single micro-batch step, by the rule of `reference`.
    let groups = case.groups();
    let post = (4.0 / 2.0) as f32;
    let mut runs = 0;
    for (r, res) in out.into_iter().enumerate() {
        let (launched, in_flight, seen) =
            res.expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(in_flight, n_grad, "rank {r}: a reduction finished while its stream was gated");
        assert_eq!(
            launched,
            2 * n_grad as u64,
            "rank {r}: all-reduces not launched before the reduce-scatters ran"
        );
        runs += seen.len();
        for (p, off, g) in seen {
            let want: Vec<f32> = (off..off + g.len())
                .map(|i| {
                    let stage = |group: &[usize]| {
                        let mut s = 0f32;
                        for &q in group {
                            s += round(ElemType::BF16, grad_value(0, 0, q, p, i)) / 2.0;
                        }
                        s
                    };
                    let mut s = 0f32;
                    for grp in &groups {
                        s += stage(grp);
                    }
                    s / post
                })
                .collect();
            assert_eq!(bits(&g), bits(&want), "rank {r}: p{p} at {off}");
        }
    }
    // (With 64-byte buckets of bf16 and the layout's alignment, some ranks own only padding.)
    assert!(runs >= 2 * SIZES.len(), "every parameter reached an optimizer in both groups: {runs} runs");
}

#[test]
fn a_backward_s_fetch_finishes_the_reductions_that_completed() {
    // Their buffers go back before the step's end: a backward holds the inputs of the
    // reductions still running, not every bucket's.
    let case = Case::f32_even(2);
    let plan = case.plan();
    let bytes = case.init_bytes();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let out = world(2)
        .run(|rank| -> Result<(usize, usize, usize), RuntimeError> {
            let state = ModelState::new(Arc::new(rank), &plan, &refs)?;
            let mut c = state.coordinator(case.config())?;
            let be = Arc::clone(state.backend());
            for k in (1..SIZES.len()).rev() {
                let id = ParamId(k as u32);
                c.fetch(&[id])?;
                let g: Vec<f32> = (0..SIZES[k]).map(|i| grad_value(0, 0, be.rank(), k, i)).collect();
                c.grad_ready(id, &encode(ElemType::F32, &g))?;
                c.release(&[id])?;
            }
            let launched = c.reductions_in_flight();
            // Everything queued on the reduce-scatter stream so far has run once this is seen.
            let (tx, rx) = mpsc::channel();
            be.enqueue_host(Stream::ReduceScatter, move || {
                tx.send(()).expect("test thread");
                Ok(())
            })
            .map_err(backend)?;
            rx.recv().expect("stream");
            c.fetch(&[ParamId(0)])?;
            let after_fetch = c.reductions_in_flight();
            let g: Vec<f32> = (0..SIZES[0]).map(|i| grad_value(0, 0, be.rank(), 0, i)).collect();
            c.grad_ready(ParamId(0), &encode(ElemType::F32, &g))?;
            c.release(&[ParamId(0)])?;
            c.end_step()?;
            let mut seen = Vec::new();
            let runs = c.update_shards(sgd_hook(&mut seen))?;
            Ok((launched, after_fetch, runs))
        })
        .expect("ranks");
    let mut runs = 0;
    for (r, res) in out.into_iter().enumerate() {
        let (launched, after_fetch, n) =
            res.expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(launched >= 1, "rank {r}: no bucket without p0 was reduced during the backward");
        assert_eq!(
            after_fetch, 0,
            "rank {r}: {after_fetch} completed reductions left unfinished by the fetch"
        );
        runs += n;
    }
    assert!(runs >= SIZES.len(), "every parameter's gradient reached an optimizer: {runs} runs");
}

#[test]
fn a_failed_first_stage_is_reported_on_every_rank_naming_the_op_and_bucket() {
    let case = hybrid_case();
    let plan = case.plan();
    let bytes = case.init_bytes();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let out = world(4)
        .run(|rank| {
            let state = ModelState::new(Arc::new(rank), &plan, &refs).expect("state");
            let mut c = state.coordinator(case.config()).expect("coordinator");
            let go = gate(state.backend());
            gated_step(&mut c, &case).expect("launches");
            // Rank 0's reduce-scatter stream fails before its first reduce-scatter.
            go.send(state.rank() != 0).expect("gate");
            c.end_step().map(|_| ())
        })
        .expect("ranks");
    for (r, res) in out.into_iter().enumerate() {
        let e = res.expect("rank thread").expect_err("every rank reports the failure");
        let msg = e.to_string();
        match e {
            RuntimeError::Backend { rank, op, bucket, source } => {
                assert_eq!(rank, r);
                assert!(bucket.is_some(), "{msg}");
                // Ranks 0 and 1 share the failed reduce-scatter; ranks 2 and 3 completed
                // theirs and fail in the all-reduce with the failed peers.
                let want = if r < 2 { "reduce_scatter" } else { "all_reduce" };
                assert_eq!(op, want, "rank {r}: {msg}");
                assert!(
                    !matches!(source, BackendError::PeerTimeout { .. } | BackendError::EventTimeout { .. }),
                    "rank {r}: a timeout instead of the failure: {msg}"
                );
                assert!(msg.contains("bucket"), "{msg}");
            }
            other => panic!("rank {r}: expected a backend error, got {other}"),
        }
    }
}

#[path = "support/device.rs"]
mod device;
use collsched::backend::Backend;
use device::OnDevice;

/// `sharded` with the gradients in the memory of a device backend, one rank of it on `be`: the
/// engine accumulates the micro-batches itself (in the reduction dtype, as the reference does)
/// and hands the sum over in the last one (`grad_ready_on_device`). Step 0's optimizer reads
/// the gradients through `update_shards` (copied to the host), later steps' through
/// `take_grad_shards` (where they are; `read` copies a region to the host; step 1 then
/// gives their memory back, `release_grad_shards`) and write the shards with `write_shard`.
/// `batched`: the last micro-batch fetches every parameter and hands all their gradients in
/// one `grad_ready_many_on_device` call (one pack a bucket).
fn device_rank<B: Backend>(
    case: &Case,
    plan: &Plan,
    refs: &[&[u8]],
    be: B,
    read: &dyn Fn(&B, &GradRegion) -> Vec<u8>,
    batched: bool,
) -> Result<Seen, RuntimeError> {
    let (p, r) = (elem(case.dtype), elem(case.reduce));
    let state = ModelState::new(Arc::new(be), plan, refs)?;
    let be = Arc::clone(state.backend());
    let me = be.rank();
    let mut c = state.coordinator(case.config())?;
    let mut steps = Vec::new();
    for step in 0..STEPS {
        for _ in 0..MICRO - 1 {
            let mut g = c.no_sync()?;
            for k in (0..SIZES.len()).rev() {
                g.fetch(&[ParamId(k as u32)])?;
                g.release(&[ParamId(k as u32)])?;
            }
            g.end_step()?;
        }
        let mut held = Vec::new();
        for k in (0..SIZES.len()).rev() {
            let id = ParamId(k as u32);
            c.fetch(&[id])?;
            if has_grad(case, step, k) {
                let g = |m: usize, i: usize| round(p, grad_value(step, m, me, k, i));
                let sum: Vec<f32> = (0..SIZES[k])
                    .map(|i| (1..MICRO).fold(round(r, g(0, i)), |acc, m| round(r, acc + g(m, i))))
                    .collect();
                let mut buf = be.alloc(SIZES[k] * r.size()).map_err(backend)?;
                be.write_from_host(&mut buf, 0, &encode(r, &sum)).map_err(backend)?;
                if batched {
                    held.push((id, buf));
                    continue;
                }
                c.grad_ready_on_device(id, &buf)?;
                be.free(buf, Some(&be.record(Stream::Compute).map_err(backend)?));
            }
            if !batched {
                c.release(&[id])?;
            }
        }
        if batched {
            let lent: Vec<(ParamId, &B::Buffer)> = held.iter().map(|(id, b)| (*id, b)).collect();
            c.grad_ready_many_on_device(&lent)?;
            let after = be.record(Stream::Compute).map_err(backend)?;
            for (_, b) in held {
                be.free(b, Some(&after));
            }
            let all: Vec<ParamId> = (0..SIZES.len() as u32).rev().map(ParamId).collect();
            c.release(&all)?;
        }
        c.end_step()?;
        let mut seen = Vec::new();
        if step == 0 {
            c.update_shards(sgd_hook(&mut seen))?;
        } else {
            c.take_grad_shards(|g| {
                assert_eq!(g.device, be.device(), "a gradient given on the device left it");
                seen.push((g.param.index(), g.param_offset, decode(g.elem, &read(&be, &g))));
            })?;
            if step == 1 {
                // Their memory back to the pool now: the next step's reductions land elsewhere.
                c.release_grad_shards()?;
            }
            for (k, off, g) in &seen {
                state.write_shard(ParamId(*k as u32), |at, w| {
                    assert_eq!(at, *off);
                    let new: Vec<f32> = decode(p, w).iter().zip(g).map(|(x, g)| x - LR * g).collect();
                    w.copy_from_slice(&encode(p, &new));
                })?;
            }
        }
        steps.push(seen);
    }
    let all: Vec<ParamId> = (0..SIZES.len() as u32).map(ParamId).collect();
    let v = c.fetch(&all)?;
    let mut fin = Vec::new();
    for &id in &all {
        let mut host = vec![0; SIZES[id.index()] * p.size()];
        v.copy_to_host(id, &mut host)?;
        fin.push(decode(p, &host));
    }
    drop(v);
    c.release(&all)?;
    c.end_step()?;
    Ok((steps, fin))
}

#[test]
fn device_gradients_given_back_unread_are_not_handed_out() {
    let case = Case::f32_even(2);
    let plan = case.plan();
    let bytes = case.init_bytes();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let out = world(2)
        .run(|rank| -> Result<(usize, usize), RuntimeError> {
            let state = ModelState::new(Arc::new(OnDevice(rank)), &plan, &refs)?;
            let be = Arc::clone(state.backend());
            let mut c = state.coordinator(case.config())?;
            for k in (0..SIZES.len()).rev() {
                let id = ParamId(k as u32);
                c.fetch(&[id])?;
                let g: Vec<f32> = (0..SIZES[k]).map(|i| grad_value(0, 0, be.rank(), k, i)).collect();
                let mut buf = be.alloc(SIZES[k] * 4).map_err(backend)?;
                be.write_from_host(&mut buf, 0, &encode(ElemType::F32, &g)).map_err(backend)?;
                c.grad_ready_on_device(id, &buf)?;
                be.free(buf, Some(&be.record(Stream::Compute).map_err(backend)?));
                c.release(&[id])?;
            }
            c.end_step()?;
            c.release_grad_shards()?;
            let taken = c.take_grad_shards(|_| ())?;
            let updated = c.update_shards(|_| ())?;
            Ok((taken, updated))
        })
        .expect("ranks");
    for (r, res) in out.into_iter().enumerate() {
        let (taken, updated) = res.expect("rank thread").unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!((taken, updated), (0, 0), "rank {r}: gradients given back were handed out again");
    }
}

/// [`device_rank`] on every rank of `case`'s world of `OnDevice` local ranks.
fn sharded_on_device(case: &Case, batched: bool) -> Vec<Seen> {
    let plan = case.plan();
    let bytes = case.init_bytes();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let read = |_: &OnDevice<LocalRank>, g: &GradRegion| {
        // SAFETY: OnDevice's device addresses are the local backend's host addresses; the
        // region is valid until the next call into the coordinator.
        unsafe { std::slice::from_raw_parts(g.ptr, g.numel * g.elem.size()) }.to_vec()
    };
    let results = world(case.world)
        .run(|rank| device_rank(case, &plan, &refs, OnDevice(rank), &read, batched))
        .expect("ranks");
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| {
            x.unwrap_or_else(|_| panic!("{case:?}: rank {r} panicked"))
                .unwrap_or_else(|e| panic!("{case:?}: rank {r} on a device backend: {e}"))
        })
        .collect()
}

fn backend(e: BackendError) -> RuntimeError {
    RuntimeError::Plan { rank: 0, what: format!("test backend call: {e}") }
}

#[test]
fn gradients_given_on_a_device_match_the_reference_and_stay_there() {
    // Every strategy; f32, and bf16 parameters reduced in f32; a parameter without a gradient.
    for world in [1, 2, 3, 4] {
        for (k, sharding) in strategies(world).into_iter().enumerate() {
            let (dtype, reduce) = [(DType::F32, DType::F32), (DType::BF16, DType::F32)][k % 2];
            let case = Case { dtype, reduce, world, sharding, pre: None, post: None, missing: world == 3 };
            check_runs(&case, &sharded_on_device(&case, false));
        }
    }
}

#[test]
fn gradients_given_on_a_device_in_one_call_match_the_reference() {
    // As above, every gradient of the step in one call: buckets fill during the call (their
    // packs go before their reductions) and after it.
    for world in [1, 2, 3, 4] {
        for (k, sharding) in strategies(world).into_iter().enumerate() {
            let (dtype, reduce) = [(DType::F32, DType::F32), (DType::BF16, DType::F32)][k % 2];
            let case = Case { dtype, reduce, world, sharding, pre: None, post: None, missing: world == 3 };
            check_runs(&case, &sharded_on_device(&case, true));
        }
    }
}

/// The same on GPUs (one per rank, NCCL): exact at 1 and 2 ranks, where NCCL's f32 sum is one
/// addition (see `tests/gpu_demo.rs`).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: COLLSCHED_GPU=1 cargo nextest run --all-features --run-ignored only (fails without a device)"]
fn gradients_given_on_gpus_match_the_reference_and_stay_there() {
    use collsched::backend::cuda::{CudaBackend, CudaBuffer, CudaWorld};
    let n = gpu::gpus("gradients_given_on_gpus_match_the_reference_and_stay_there", 2);
    // One gradient a call, and every gradient of a step in one call (one pack a bucket).
    for (world, batched) in (1..=n).flat_map(|w| [(w, false), (w, true)]) {
        for (k, sharding) in [Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy].into_iter().enumerate() {
            let (dtype, reduce) = [(DType::F32, DType::F32), (DType::BF16, DType::F32)][k % 2];
            let case = Case { dtype, reduce, world, sharding, pre: None, post: None, missing: k == 2 };
            let plan = case.plan();
            let bytes = case.init_bytes();
            let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
            let read = |be: &CudaBackend, g: &GradRegion| {
                let mut host = vec![0; g.numel * g.elem.size()];
                // SAFETY: the region is device memory of this rank, valid until the next call
                // into the coordinator; the view is dropped before that.
                let view = unsafe { CudaBuffer::from_raw(g.ptr as u64, host.len()) };
                be.read_to_host(&view, 0, &mut host).expect("gradient region to the host");
                host
            };
            let ranks: Vec<Seen> = CudaWorld::new(world)
                .expect("CUDA world")
                .run(|be| device_rank(&case, &plan, &refs, be, &read, batched))
                .expect("ranks")
                .into_iter()
                .enumerate()
                .map(|(r, x)| {
                    x.unwrap_or_else(|_| panic!("{case:?}: rank {r} panicked"))
                        .unwrap_or_else(|e| panic!("{case:?} (batched: {batched}): rank {r} on a GPU: {e}"))
                })
                .collect();
            check_runs(&case, &ranks);
        }
    }
}

#[cfg(feature = "cuda")]
#[path = "support/gpu.rs"]
mod gpu;

#[test]
fn device_gradients_under_no_sync_mixed_with_host_ones_or_short_are_refused() {
    let case = Case {
        dtype: DType::F32,
        reduce: DType::F32,
        world: 2,
        sharding: Sharding::Flat,
        pre: None,
        post: None,
        missing: false,
    };
    // One bucket for every parameter.
    let specs =
        SIZES.iter().enumerate().map(|(k, &n)| ParamSpec::new(format!("p{k}"), [n], DType::F32)).collect();
    let set = ParamSet::new(specs).expect("params");
    let plan =
        Plan::new(LayoutBuilder::new(&set, Sharding::Flat, 2).bucket_bytes(4096).build().expect("layout"));
    let bytes: Vec<Vec<u8>> = case.init().iter().map(|v| encode(ElemType::F32, v)).collect();
    let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
    let out = world(2)
        .run(|rank| -> Result<Vec<String>, RuntimeError> {
            let state = ModelState::new(Arc::new(OnDevice(rank)), &plan, &refs)?;
            let be = Arc::clone(state.backend());
            let mut c = state.coordinator(case.config())?;
            let mut errors = Vec::new();
            let (a, b) = (ParamId(0), ParamId(1));
            let buf = |n: usize| -> Result<_, RuntimeError> {
                let mut x = be.alloc(n * 4).map_err(backend)?;
                be.write_from_host(&mut x, 0, &vec![0; n * 4]).map_err(backend)?;
                Ok(x)
            };
            let (ga, short) = (buf(SIZES[0])?, buf(SIZES[0] - 1)?);
            {
                let mut g = c.no_sync()?;
                g.fetch(&[a])?;
                errors.push(g.grad_ready_on_device(a, &ga).expect_err("under no_sync").to_string());
                g.release(&[a])?;
                g.end_step()?;
            }
            c.fetch(&[a, b])?;
            errors.push(c.grad_ready_on_device(a, &short).expect_err("short").to_string());
            c.grad_ready(a, &vec![0; SIZES[0] * 4])?;
            let gb = buf(SIZES[1])?;
            errors.push(c.grad_ready_on_device(b, &gb).expect_err("mixed").to_string());
            // Refused before anything changed: the same gradient given on the host is taken
            // (a gradient counted and then dropped would make this a second one).
            c.grad_ready(b, &vec![0; SIZES[1] * 4])?;
            c.release(&[a, b])?;
            c.end_step()?;
            for x in [ga, short, gb] {
                be.free(x, None);
            }
            Ok(errors)
        })
        .expect("ranks");
    for r in out {
        let errors = r.expect("rank thread").expect("rank");
        assert!(errors[0].contains("no_sync") && errors[0].contains("p0"), "{}", errors[0]);
        assert!(errors[1].contains("p0") && errors[1].contains("expected"), "{}", errors[1]);
        assert!(errors[2].contains("other kind") && errors[2].contains("bucket"), "{}", errors[2]);
    }
}
