//! The demo's unsharded reference, written from the demo's definition and sharing no code with
//! the library (no `collsched::demo` model code, no `collsched_kernels`): the data, the initial
//! values, the model (a `tanh` MLP with a linear last layer, mean squared error), its forward
//! and backward passes, the gradient averaging, SGD and the freeze and evaluation schedule are
//! plain f32 loops here. Only the settings (`DemoConfig`'s fields) and the result type
//! (`RunRecord`) are the library's. Included with `#[path]` by the parity tests
//! (`tests/demo_parity.rs`, `tests/demo_independent.rs`, `tests/gpu_demo.rs`,
//! `tests/gpu_no_driver.rs`, `tests/cli_demo.rs`, `tests/mpi.rs`).
//!
//! The definition fixes the order of every f32 operation, so a sharded run that computes what
//! the definition says matches this reference bit for bit wherever its backend sums the ranks'
//! gradients in the plan's order (every CPU backend). The order is:
//! - data: SplitMix64; a uniform is `(bits >> 40) / 2^24 * 2 - 1`; the inputs of a batch are
//!   drawn sample by sample, input by input, from the seed
//!   `seed * 0x9E3779B9 ^ step << 20 ^ shard << 40 ^ 0xBA7C` (shard = rank; the held-out
//!   evaluation batch has step and shard `u64::MAX` and 4 times the samples); target `o` of a
//!   sample is `sin(sum_i x_i ((i + o) mod 3) / sqrt(inputs))`, summed in input order;
//! - initial values: one SplitMix64 from `seed ^ 0x14175EED`, parameter by parameter (weight
//!   `[out][in]` row-major, then bias, per layer): a weight is a uniform times
//!   `1 / sqrt(inputs)`, a bias a uniform times 0.1;
//! - forward: `bias[o]`, then `+ w[o][i] * x[i]` in input order, then `tanh` but on the last
//!   layer; loss: the squared differences summed sample by sample, output by output, divided
//!   by their count `n`; its gradient `2 (p - t) / n`;
//! - backward, sample by sample and output by output: `gz = g` on the last layer, else
//!   `g (1 - y^2)`; the bias gradient adds `gz`, the weight gradient `gz x[i]`, the input
//!   gradient `gz w[o][i]`, each in that order (so every sum runs over samples, or for the
//!   input gradient over outputs, in order);
//! - a step: every micro-batch, every rank (micro-batch major), its gradient added to the
//!   rank's sum of the step's earlier micro-batches; the ranks' sums averaged as the plan
//!   reduces them: summed in rank order within each group of consecutive ranks (`G` for
//!   `hybrid:G`, all of them otherwise), those sums added in group order, the total divided by
//!   the number of ranks; `w -= lr * average` for every parameter not frozen at that step; the
//!   loss of the step is the micro-batch losses added in the same (micro-batch, rank) order,
//!   divided by their count.
#![allow(dead_code)]

use collsched::buckets::Sharding;
use collsched::demo::{DemoConfig, RunRecord, StepRecord};

/// SplitMix64, as the data and the initial values are defined.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1): 24 random bits (exact in f32).
    pub fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// The initial values of every parameter (weight, then bias, per layer) of the MLP `dims`.
pub fn init(dims: &[usize], seed: u64) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64(seed ^ 0x1417_5EED);
    let mut params = Vec::new();
    for l in 0..dims.len() - 1 {
        let scale = 1.0 / (dims[l] as f32).sqrt();
        params.push((0..dims[l] * dims[l + 1]).map(|_| rng.uniform() * scale).collect());
        params.push((0..dims[l + 1]).map(|_| rng.uniform() * 0.1).collect());
    }
    params
}

/// A batch of `n` samples: inputs (`n x dims[0]`) and targets (`n x dims[last]`), row-major.
pub fn batch(dims: &[usize], seed: u64, step: u64, shard: u64, n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix64(seed.wrapping_mul(0x9E37_79B9) ^ (step << 20) ^ (shard << 40) ^ 0xBA7C);
    let (ni, no) = (dims[0], dims[dims.len() - 1]);
    let x: Vec<f32> = (0..n * ni).map(|_| rng.uniform()).collect();
    let mut y = Vec::with_capacity(n * no);
    for sample in x.chunks(ni) {
        for o in 0..no {
            let mut s = 0f32;
            for (i, v) in sample.iter().enumerate() {
                s += v * ((i + o) % 3) as f32;
            }
            y.push((s / (ni as f32).sqrt()).sin());
        }
    }
    (x, y)
}

/// Every layer's activations for the batch `x` (input first), row-major.
fn forward(dims: &[usize], params: &[Vec<f32>], x: &[f32]) -> Vec<Vec<f32>> {
    let layers = dims.len() - 1;
    let mut acts = vec![x.to_vec()];
    for l in 0..layers {
        let (ni, no) = (dims[l], dims[l + 1]);
        let (w, b) = (&params[2 * l], &params[2 * l + 1]);
        let mut out = Vec::with_capacity(acts[l].len() / ni * no);
        for input in acts[l].chunks(ni) {
            for o in 0..no {
                let mut z = b[o];
                for i in 0..ni {
                    z += w[o * ni + i] * input[i];
                }
                out.push(if l + 1 == layers { z } else { z.tanh() });
            }
        }
        acts.push(out);
    }
    acts
}

/// Mean squared error of the prediction `p` against the targets `t`, and its gradient.
fn mse(p: &[f32], t: &[f32]) -> (f32, Vec<f32>) {
    let n = p.len() as f32;
    let mut loss = 0f32;
    let mut grad = Vec::with_capacity(p.len());
    for (a, b) in p.iter().zip(t) {
        let d = a - b;
        loss += d * d;
        grad.push(2.0 * d / n);
    }
    (loss / n, grad)
}

/// Loss of one batch and the gradient of every parameter.
fn loss_and_grads(dims: &[usize], params: &[Vec<f32>], x: &[f32], y: &[f32]) -> (f32, Vec<Vec<f32>>) {
    let layers = dims.len() - 1;
    let acts = forward(dims, params, x);
    let (loss, mut g) = mse(&acts[layers], y);
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0f32; p.len()]).collect();
    for l in (0..layers).rev() {
        let (ni, no) = (dims[l], dims[l + 1]);
        let w = &params[2 * l];
        let samples = acts[l].len() / ni;
        let mut gx = vec![0f32; samples * ni];
        for s in 0..samples {
            let input = &acts[l][s * ni..(s + 1) * ni];
            for o in 0..no {
                let y = acts[l + 1][s * no + o];
                let gz = if l + 1 == layers { g[s * no + o] } else { g[s * no + o] * (1.0 - y * y) };
                grads[2 * l + 1][o] += gz;
                for i in 0..ni {
                    grads[2 * l][o * ni + i] += gz * input[i];
                    gx[s * ni + i] += gz * w[o * ni + i];
                }
            }
        }
        g = gx;
    }
    (loss, grads)
}

/// The ranks whose gradients are summed first: `G` for `hybrid:G`, every rank otherwise.
fn group_size(world: usize, sharding: Sharding) -> usize {
    match sharding {
        Sharding::Hybrid(g) => g as usize,
        _ => world,
    }
}

/// The average of the ranks' gradients (`per_rank[rank][element]`): summed within each group of
/// `group` consecutive ranks, the sums added in group order, divided by the number of ranks.
fn average(per_rank: &[Vec<f32>], group: usize) -> Vec<f32> {
    let len = per_rank[0].len();
    let mut total = vec![0f32; len];
    for members in per_rank.chunks(group) {
        let mut sum = vec![0f32; len];
        for g in members {
            for (s, v) in sum.iter_mut().zip(g) {
                *s += v;
            }
        }
        for (t, s) in total.iter_mut().zip(&sum) {
            *t += s;
        }
    }
    let world = per_rank.len() as f32;
    total.iter().map(|t| t / world).collect()
}

/// The demo `cfg` run unsharded, its gradients averaged in the order `sharding`'s plan sums
/// them (see the module docs).
///
/// # Panics
/// On a world of 0, a `hybrid:G` with `G` not dividing the world, or no micro-batches (settings
/// no sharded run accepts).
pub fn reference(cfg: &DemoConfig, sharding: Sharding) -> RunRecord {
    let dims = &cfg.model.dims;
    let group = group_size(cfg.world, sharding);
    assert!(
        cfg.world > 0 && cfg.micro_batches > 0 && group > 0 && cfg.world.is_multiple_of(group),
        "reference: {} ranks, {} micro-batches, {sharding}",
        cfg.world,
        cfg.micro_batches
    );
    let frozen = |k: usize, step: usize| {
        cfg.freeze.is_some_and(|(layer, from, until)| k / 2 == layer && from <= step && step < until)
    };
    let mut params = init(dims, cfg.seed);
    let mut steps = Vec::with_capacity(cfg.steps);
    for step in 0..cfg.steps {
        // sums[rank][param]: the rank's gradient summed over the step's micro-batches.
        let mut sums: Vec<Vec<Vec<f32>>> = Vec::with_capacity(cfg.world);
        let mut loss = 0f32;
        for micro in 0..cfg.micro_batches {
            for rank in 0..cfg.world {
                let sample = (step * cfg.micro_batches + micro) as u64;
                let (x, y) = batch(dims, cfg.seed, sample, rank as u64, cfg.batch);
                let (l, grads) = loss_and_grads(dims, &params, &x, &y);
                loss += l;
                if micro == 0 {
                    sums.push(grads);
                    continue;
                }
                for (sum, g) in sums[rank].iter_mut().zip(&grads) {
                    for (s, v) in sum.iter_mut().zip(g) {
                        *s += v;
                    }
                }
            }
        }
        for (k, p) in params.iter_mut().enumerate() {
            if frozen(k, step) {
                continue;
            }
            let per_rank: Vec<Vec<f32>> = sums.iter().map(|r| r[k].clone()).collect();
            for (w, g) in p.iter_mut().zip(average(&per_rank, group)) {
                *w -= cfg.lr * g;
            }
        }
        let eval_loss = (cfg.eval_every != 0 && (step + 1).is_multiple_of(cfg.eval_every)).then(|| {
            let (x, y) = batch(dims, cfg.seed, u64::MAX, u64::MAX, 4 * cfg.batch);
            mse(&forward(dims, &params, &x)[dims.len() - 1], &y).0
        });
        steps.push(StepRecord { loss: loss / (cfg.world * cfg.micro_batches) as f32, eval_loss });
    }
    RunRecord { steps, params }
}

/// Compares a run with the reference: every loss, evaluation loss and final parameter within
/// `tolerance` (absolute; 0: equal as f32 values). A NaN, a missing or extra step, evaluation,
/// parameter or element is a difference. `Err` names the first difference and the largest
/// ones.
pub fn compare(got: &RunRecord, want: &RunRecord, tolerance: f32) -> Result<(), String> {
    let mut first: Option<String> = None;
    let (mut loss_max, mut param_max) = (0f32, 0f32);
    let mut differ = |what: String, g: f32, w: f32, max: &mut f32| {
        let d = (g - w).abs();
        *max = if d.is_nan() { f32::INFINITY } else { max.max(d) };
        if d.is_nan() || d > tolerance {
            first.get_or_insert_with(|| {
                format!("{what}: {g:e} ({:#010x}) vs {w:e} ({:#010x})", g.to_bits(), w.to_bits())
            });
        }
    };
    if got.steps.len() != want.steps.len() {
        return Err(format!("{} steps, the reference has {}", got.steps.len(), want.steps.len()));
    }
    for (s, (g, w)) in got.steps.iter().zip(&want.steps).enumerate() {
        differ(format!("step {s} loss"), g.loss, w.loss, &mut loss_max);
        match (g.eval_loss, w.eval_loss) {
            (Some(a), Some(b)) => differ(format!("step {s} evaluation loss"), a, b, &mut loss_max),
            (None, None) => {}
            other => return Err(format!("step {s}: evaluation {other:?} (run, reference)")),
        }
    }
    if got.params.len() != want.params.len() {
        return Err(format!("{} parameters, the reference has {}", got.params.len(), want.params.len()));
    }
    for (k, (g, w)) in got.params.iter().zip(&want.params).enumerate() {
        if g.len() != w.len() {
            return Err(format!("parameter {k}: {} elements, the reference has {}", g.len(), w.len()));
        }
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            differ(format!("parameter {k}[{i}]"), *a, *b, &mut param_max);
        }
    }
    match first {
        None => Ok(()),
        Some(f) => Err(format!(
            "first difference over {tolerance:e}: {f}; largest differences: losses {loss_max:e}, \
             parameters {param_max:e}"
        )),
    }
}

/// Panics with `what` and the difference unless [`compare`] accepts `got`.
pub fn assert_matches(got: &RunRecord, want: &RunRecord, tolerance: f32, what: &str) {
    if let Err(e) = compare(got, want, tolerance) {
        panic!("{what}: the run differs from the reference: {e}");
    }
}
