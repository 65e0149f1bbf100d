//! What the gradient-reduction tests share (`tests/runtime_reduce.rs`, the host's gradients;
//! `tests/runtime_reduce_device.rs`, a device's): the parameters, the gradients of every step,
//! rank and micro-batch, the unsharded reference that does the same casts and sums in the
//! reduce-scatter's order, a sharded run on the local backend, and the check of a run against
//! the reference. Included with `#[path]`.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use collsched::backend::local::{LocalConfig, LocalRank, LocalWorld};
use collsched::backend::BackendError;
use collsched::buckets::{DType, LayoutBuilder, ParamId, ParamSet, ParamSpec, Sharding};
use collsched::kernels::ElemType;
use collsched::runtime::{Coordinator, ModelState, RuntimeError};
use collsched::schedule::{GradReduce, Plan, SchedulerConfig};
use half::{bf16, f16};

/// Odd sizes, several buckets of 64 bytes.
pub const SIZES: [usize; 6] = [17, 35, 5, 33, 3, 18];
pub const STEPS: usize = 3;
pub const MICRO: usize = 3;
pub const LR: f32 = 0.125;

pub fn elem(d: DType) -> ElemType {
    match d {
        DType::F32 => ElemType::F32,
        DType::F16 => ElemType::F16,
        DType::BF16 => ElemType::BF16,
        other => panic!("no element type for {other}"),
    }
}

/// `v` rounded to `t` (round to nearest even), as f32.
pub fn round(t: ElemType, v: f32) -> f32 {
    match t {
        ElemType::F32 => v,
        ElemType::F16 => f16::from_f32(v).to_f32(),
        ElemType::BF16 => bf16::from_f32(v).to_f32(),
    }
}

pub fn encode(t: ElemType, v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| match t {
            ElemType::F32 => x.to_le_bytes().to_vec(),
            ElemType::F16 => f16::from_f32(x).to_le_bytes().to_vec(),
            ElemType::BF16 => bf16::from_f32(x).to_le_bytes().to_vec(),
        })
        .collect()
}

pub fn decode(t: ElemType, b: &[u8]) -> Vec<f32> {
    b.chunks_exact(t.size())
        .map(|c| match t {
            ElemType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            ElemType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            ElemType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        })
        .collect()
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A deterministic gradient value (before rounding to the parameters' dtype): magnitudes from
/// 2^-14 to 8 so that casts and sums round.
pub fn grad_value(step: usize, micro: usize, rank: usize, param: usize, i: usize) -> f32 {
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
pub struct Case {
    pub dtype: DType,
    pub reduce: DType,
    pub world: usize,
    pub sharding: Sharding,
    pub pre: Option<f64>,
    pub post: Option<f64>,
    /// On the last step parameter `MISSING` gets no gradient on any rank (a parameter the
    /// forward did not use): reduced as zeros, in a gradient buffer an earlier step wrote.
    pub missing: bool,
}

/// The parameter without a gradient on the last step of a `missing` case.
pub const MISSING: usize = 3;

/// Whether parameter `k` gets a gradient on `step`.
pub fn has_grad(case: &Case, step: usize, k: usize) -> bool {
    !(case.missing && step == STEPS - 1 && k == MISSING)
}

impl Case {
    pub fn config(&self) -> SchedulerConfig {
        SchedulerConfig {
            reduce: GradReduce { dtype: Some(self.reduce), pre_divide: self.pre, post_divide: self.post },
            ..SchedulerConfig::default()
        }
    }

    /// f32 parameters reduced in f32, evenly split over `world` ranks, no scaling.
    pub fn f32_even(world: usize) -> Case {
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
    pub fn init_bytes(&self) -> Vec<Vec<u8>> {
        self.init().iter().map(|v| encode(elem(self.dtype), v)).collect()
    }

    pub fn plan(&self) -> Plan {
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

    pub fn init(&self) -> Vec<Vec<f32>> {
        let p = elem(self.dtype);
        SIZES
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|i| round(p, (k as f32 + 1.0) * 0.37 - i as f32 * 0.0625)).collect())
            .collect()
    }

    /// The shard groups of the first reduction stage, and whether a second stage (all-reduce
    /// across them) follows: hybrid sharding over several groups.
    pub fn groups(&self) -> Vec<Vec<usize>> {
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
pub fn reference(case: &Case) -> (Vec<Vec<Vec<f32>>>, Vec<Vec<f32>>) {
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
pub type Seen = (Vec<Vec<Run>>, Vec<Vec<f32>>);

/// A gradient run an optimizer hook got: parameter, offset, values.
pub type Run = (usize, usize, Vec<f32>);

pub fn world(n: usize) -> LocalWorld {
    LocalWorld::with_config(n, LocalConfig { timeout: Duration::from_secs(30), ..LocalConfig::default() })
        .expect("world")
}

/// Backward of one micro-batch: per parameter in reverse, fetch, hand the gradient, release.
pub fn backward(
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

pub fn sgd_hook(seen: &mut Vec<Run>) -> impl FnMut(collsched::runtime::ShardUpdate<'_>) + '_ {
    move |u| {
        let g = decode(u.grad_elem, u.grad);
        let w = decode(u.elem, u.values);
        let new: Vec<f32> = w.iter().zip(&g).map(|(x, g)| x - LR * g).collect();
        u.values.copy_from_slice(&encode(u.elem, &new));
        seen.push((u.param.index(), u.param_offset, g));
    }
}

pub fn sharded(case: &Case) -> Vec<Seen> {
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
    each_rank(case, results, "")
}

/// Every rank's run of `case`, by rank; a rank that panicked or failed fails the test, naming
/// the case, the rank and `on` (where it ran, e.g. " on a device backend").
pub fn each_rank(
    case: &Case,
    results: Vec<std::thread::Result<Result<Seen, RuntimeError>>>,
    on: &str,
) -> Vec<Seen> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| {
            x.unwrap_or_else(|_| panic!("{case:?}: rank {r} panicked"))
                .unwrap_or_else(|e| panic!("{case:?}: rank {r}{on}: {e}"))
        })
        .collect()
}

/// Every rank's gradients and final parameters equal the reference's bit for bit, and every
/// gradient element reached exactly one optimizer per shard group.
pub fn check(case: &Case) {
    check_runs(case, &sharded(case));
}

/// `case`'s reduced gradients and final parameters from `ranks` equal the reference's bit for
/// bit, and every gradient element reached exactly one optimizer per shard group.
pub fn check_runs(case: &Case, ranks: &[Seen]) {
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

pub fn strategies(world: usize) -> Vec<Sharding> {
    let mut s = vec![Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy];
    s.extend((1..world).filter(|g| world.is_multiple_of(*g)).map(|g| Sharding::Hybrid(g as u32)));
    s
}

/// A test's own backend call's failure, as the runtime's error type.
pub fn backend(e: BackendError) -> RuntimeError {
    RuntimeError::Plan { rank: 0, what: format!("test backend call: {e}") }
}
