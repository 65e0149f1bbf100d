//! The demo's definition checked twice, on the standard model: the sharded run against the
//! f32 reference of `tests/support/reference.rs` (no code shared with the library; exact, as in
//! `tests/demo_parity.rs`), and that reference against the same training done in f64 here,
//! written from the mathematics rather than from the f32 order of operations. The second check
//! is what catches a mistake the f32 reference could share with the library by following its
//! order: a wrong formula differs by orders of magnitude more than f32 rounding, which stays
//! near 1e-7 (see the tolerances below).

use collsched::buckets::Sharding;
use collsched::demo::{sharded_run, DemoConfig, ShardedOptions};

#[path = "support/reference.rs"]
mod reference;
use reference::{assert_matches, SplitMix64};

/// Uniform in [-1, 1), as the definition draws it (exact in f32 and in f64).
fn uniform(rng: &mut SplitMix64) -> f64 {
    f64::from(rng.uniform())
}

/// The model: `dims`, weights `[out][in]` row-major, then biases, per layer.
struct Net {
    dims: Vec<usize>,
    /// `w[l]` (out x in, row-major) and `b[l]`.
    w: Vec<Vec<f64>>,
    b: Vec<Vec<f64>>,
}

impl Net {
    fn init(dims: &[usize], seed: u64) -> Net {
        let mut rng = SplitMix64(seed ^ 0x1417_5EED);
        let (mut w, mut b) = (Vec::new(), Vec::new());
        for l in 0..dims.len() - 1 {
            // Values are drawn, then scaled, in f32 as the definition says; f64 from there on.
            let scale = 1.0 / (dims[l] as f32).sqrt();
            w.push((0..dims[l] * dims[l + 1]).map(|_| f64::from(rng.uniform() * scale)).collect());
            b.push((0..dims[l + 1]).map(|_| f64::from(rng.uniform() * 0.1f32)).collect());
        }
        Net { dims: dims.to_vec(), w, b }
    }

    /// Activations of every layer (input first) for one sample.
    fn forward(&self, x: &[f64]) -> Vec<Vec<f64>> {
        let mut acts = vec![x.to_vec()];
        let layers = self.dims.len() - 1;
        for l in 0..layers {
            let (ni, no) = (self.dims[l], self.dims[l + 1]);
            let input = &acts[l];
            let out: Vec<f64> = (0..no)
                .map(|o| {
                    let z = self.b[l][o] + (0..ni).map(|i| self.w[l][o * ni + i] * input[i]).sum::<f64>();
                    if l + 1 == layers {
                        z
                    } else {
                        z.tanh()
                    }
                })
                .collect();
            acts.push(out);
        }
        acts
    }

    /// Mean squared error over a batch (mean over samples and outputs) and its gradient.
    fn loss_and_grad(&self, xs: &[Vec<f64>], ys: &[Vec<f64>]) -> (f64, Vec<Vec<f64>>, Vec<Vec<f64>>) {
        let layers = self.dims.len() - 1;
        let n = (xs.len() * self.dims[layers]) as f64;
        let mut gw: Vec<Vec<f64>> = self.w.iter().map(|w| vec![0.0; w.len()]).collect();
        let mut gb: Vec<Vec<f64>> = self.b.iter().map(|b| vec![0.0; b.len()]).collect();
        let mut loss = 0.0;
        for (x, y) in xs.iter().zip(ys) {
            let acts = self.forward(x);
            let pred = &acts[layers];
            let mut g: Vec<f64> = pred.iter().zip(y).map(|(p, t)| 2.0 * (p - t) / n).collect();
            loss += pred.iter().zip(y).map(|(p, t)| (p - t) * (p - t)).sum::<f64>();
            for l in (0..layers).rev() {
                let (ni, no) = (self.dims[l], self.dims[l + 1]);
                let gz: Vec<f64> =
                    (0..no)
                        .map(|o| {
                            if l + 1 == layers {
                                g[o]
                            } else {
                                g[o] * (1.0 - acts[l + 1][o] * acts[l + 1][o])
                            }
                        })
                        .collect();
                let mut gx = vec![0.0; ni];
                for o in 0..no {
                    gb[l][o] += gz[o];
                    for i in 0..ni {
                        gw[l][o * ni + i] += gz[o] * acts[l][i];
                        gx[i] += gz[o] * self.w[l][o * ni + i];
                    }
                }
                g = gx;
            }
        }
        (loss / n, gw, gb)
    }
}

/// A batch as the demo defines it: inputs uniform in [-1, 1), targets `sin(sum_i x_i ((i + o)
/// mod 3) / sqrt(in))`, computed here in f64 from the same f32 inputs.
fn batch(dims: &[usize], seed: u64, step: u64, shard: u64, n: usize) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let mut rng = SplitMix64(seed.wrapping_mul(0x9E37_79B9) ^ (step << 20) ^ (shard << 40) ^ 0xBA7C);
    let (ni, no) = (dims[0], dims[dims.len() - 1]);
    let xs: Vec<Vec<f64>> = (0..n).map(|_| (0..ni).map(|_| uniform(&mut rng)).collect()).collect();
    let ys = xs
        .iter()
        .map(|x| {
            (0..no)
                .map(|o| {
                    let s: f64 = x.iter().enumerate().map(|(i, v)| v * ((i + o) % 3) as f64).sum();
                    (s / (ni as f64).sqrt()).sin()
                })
                .collect()
        })
        .collect();
    (xs, ys)
}

/// The run in f64: per step, every rank's gradient summed over the micro-batches, averaged over
/// ranks, SGD on the layers not frozen at that step; evaluations on the held-out batch.
fn reference_f64(dims: &[usize], world: usize, steps: usize, seed: u64) -> (Vec<f64>, Vec<Option<f64>>, Net) {
    let (micro, per_rank, lr, eval_every) = (2usize, 8usize, 0.2f64, 3usize);
    let frozen = |layer: usize, step: usize| layer == 2 && (steps / 3..2 * steps / 3).contains(&step);
    let mut net = Net::init(dims, seed);
    let (mut losses, mut evals) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let mut sum_w: Vec<Vec<f64>> = net.w.iter().map(|w| vec![0.0; w.len()]).collect();
        let mut sum_b: Vec<Vec<f64>> = net.b.iter().map(|b| vec![0.0; b.len()]).collect();
        let mut loss = 0.0;
        for m in 0..micro {
            for rank in 0..world {
                let (xs, ys) = batch(dims, seed, (step * micro + m) as u64, rank as u64, per_rank);
                let (l, gw, gb) = net.loss_and_grad(&xs, &ys);
                loss += l;
                for (s, g) in sum_w.iter_mut().flatten().zip(gw.iter().flatten()) {
                    *s += g;
                }
                for (s, g) in sum_b.iter_mut().flatten().zip(gb.iter().flatten()) {
                    *s += g;
                }
            }
        }
        for l in 0..dims.len() - 1 {
            if frozen(l, step) {
                continue;
            }
            for (w, s) in net.w[l].iter_mut().zip(&sum_w[l]) {
                *w -= lr * s / world as f64;
            }
            for (b, s) in net.b[l].iter_mut().zip(&sum_b[l]) {
                *b -= lr * s / world as f64;
            }
        }
        losses.push(loss / (world * micro) as f64);
        evals.push(((step + 1) % eval_every == 0).then(|| {
            let (xs, ys) = batch(dims, seed, u64::MAX, u64::MAX, 4 * per_rank);
            net.loss_and_grad(&xs, &ys).0
        }));
    }
    (losses, evals, net)
}

/// Largest differences between the f32 reference and the f64 one: on the losses relative to
/// the loss (floored at 1e-3), on the parameters absolute (they are O(0.1..1)). `None` when the
/// two disagree on the steps, the evaluations or the parameters' shapes, or on a NaN.
fn f32_against_f64(
    got: &collsched::demo::RunRecord,
    (losses, evals, net): &(Vec<f64>, Vec<Option<f64>>, Net),
) -> Option<(f64, f64)> {
    let rel = |g: f32, w: f64| {
        let d = (f64::from(g) - w).abs() / w.abs().max(1e-3);
        (!d.is_nan()).then_some(d)
    };
    let mut loss = 0f64;
    if got.steps.len() != losses.len() {
        return None;
    }
    for (step, (want, eval)) in got.steps.iter().zip(losses.iter().zip(evals)) {
        loss = loss.max(rel(step.loss, *want)?);
        match (step.eval_loss, eval) {
            (Some(g), Some(w)) => loss = loss.max(rel(g, *w)?),
            (None, None) => {}
            _ => return None,
        }
    }
    let want: Vec<&Vec<f64>> = net.w.iter().zip(&net.b).flat_map(|(w, b)| [w, b]).collect();
    let mut param = 0f64;
    if got.params.len() != want.len() {
        return None;
    }
    for (g, w) in got.params.iter().zip(want) {
        if g.len() != w.len() {
            return None;
        }
        for (a, b) in g.iter().zip(w) {
            let d = (f64::from(*a) - b).abs();
            param = param.max((!d.is_nan()).then_some(d)?);
        }
    }
    Some((loss, param))
}

/// How far the f32 reference's losses may be from the f64 ones, relative. Largest seen on
/// these four configurations: 3.4e-7. One loss is a mean of 8 x 5 squared errors after 6
/// layers of f32 dot products (up to 129 terms), whose rounding bound is a few 1e-6; 2e-6
/// leaves that room and little more, while a wrong formula (a missing factor, a wrong sign, a
/// wrong average) is off by orders of magnitude more.
const LOSS_ROUNDING: f64 = 2e-6;

/// How far the f32 reference's final parameters may be from the f64 ones (absolute; they are
/// O(0.1..1), where an f32 step is 6e-9..6e-8). Largest seen: 4.4e-8, about one f32 step;
/// 5e-7 allows the rounding of 9 updates to pile up tenfold.
const PARAM_ROUNDING: f64 = 5e-7;

#[test]
fn sharded_runs_match_the_reference_and_the_reference_matches_f64() {
    let (steps, seed) = (9, 7);
    for (world, sharding) in
        [(1, Sharding::EvenSplit), (3, Sharding::Flat), (4, Sharding::Greedy), (4, Sharding::Hybrid(2))]
    {
        let cfg = DemoConfig::standard(world, steps, seed);
        assert_eq!(
            cfg.model.dims,
            [17, 63, 129, 65, 33, 31, 5],
            "the f64 reference assumes the standard model"
        );
        let run = sharded_run(&cfg, &ShardedOptions { sharding, ..ShardedOptions::default() })
            .expect("sharded run");
        let want = reference::reference(&cfg, sharding);
        // Exact: the local backend sums in the plan's order, and so does the reference.
        assert_matches(&run.record, &want, 0.0, &format!("{sharding} on {world} ranks"));
        let f64_run = reference_f64(&cfg.model.dims, world, steps, seed);
        let (loss, param) = f32_against_f64(&want, &f64_run).unwrap_or_else(|| {
            panic!("{world} {sharding}: the f32 and f64 references disagree on shape or NaN")
        });
        assert!(
            loss <= LOSS_ROUNDING && param <= PARAM_ROUNDING,
            "{world} {sharding}: the f32 reference is {loss:e} (losses, relative) and {param:e} (parameters) \
             from the f64 one"
        );
    }
}
