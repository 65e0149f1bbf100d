//! The demo's sharded run against a reference that shares none of its code: the model (a tanh
//! MLP with a linear last layer, mean squared error), the data, the initial values, the
//! freeze/evaluation schedule and the averaging are written out again here, plainly, in f64.
//! The sharded run computes in f32, so the comparison has a tolerance: a relative 1e-4 on the
//! losses and 1e-4 (absolute, parameters are O(0.1..1)) on the final parameters. A bug shared by
//! the library's own reference and the sharded run (`tests/demo_parity.rs` compares those two bit
//! for bit) shows here.

use collsched::buckets::Sharding;
use collsched::demo::{sharded_run, DemoConfig, ShardedOptions};

/// SplitMix64, as the data and the initial values are defined.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1): 24 random bits, as the demo defines it (exact in f32).
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 40) as f64 / (1u64 << 24) as f64) * 2.0 - 1.0
    }
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
        let mut rng = Rng(seed ^ 0x1417_5EED);
        let (mut w, mut b) = (Vec::new(), Vec::new());
        for l in 0..dims.len() - 1 {
            // Values are drawn, then scaled, in f32 as the definition says; f64 from there on.
            let scale = 1.0 / (dims[l] as f32).sqrt();
            w.push((0..dims[l] * dims[l + 1]).map(|_| f64::from(rng.uniform() as f32 * scale)).collect());
            b.push((0..dims[l + 1]).map(|_| f64::from(rng.uniform() as f32 * 0.1f32)).collect());
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
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9) ^ (step << 20) ^ (shard << 40) ^ 0xBA7C);
    let (ni, no) = (dims[0], dims[dims.len() - 1]);
    let xs: Vec<Vec<f64>> = (0..n).map(|_| (0..ni).map(|_| rng.uniform()).collect()).collect();
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
fn reference(dims: &[usize], world: usize, steps: usize, seed: u64) -> (Vec<f64>, Vec<Option<f64>>, Net) {
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

#[test]
fn sharded_runs_match_an_f64_reference_written_from_scratch() {
    let (steps, seed) = (9, 7);
    for (world, sharding) in
        [(1, Sharding::EvenSplit), (3, Sharding::Flat), (4, Sharding::Greedy), (4, Sharding::Hybrid(2))]
    {
        let cfg = DemoConfig::standard(world, steps, seed);
        assert_eq!(
            cfg.model.dims,
            [17, 63, 129, 65, 33, 31, 5],
            "the reference below assumes the standard model"
        );
        let run = sharded_run(&cfg, &ShardedOptions { sharding, ..ShardedOptions::default() })
            .expect("sharded run");
        let (losses, evals, net) = reference(&cfg.model.dims, world, steps, seed);
        let got = &run.record;
        assert_eq!(got.steps.len(), losses.len(), "{world} {sharding}: steps");
        for (s, (step, (want, eval))) in got.steps.iter().zip(losses.iter().zip(&evals)).enumerate() {
            let close =
                |g: f32, w: f64| g.is_finite() && ((f64::from(g) - w).abs() <= 1e-4 * w.abs().max(1e-3));
            assert!(close(step.loss, *want), "{world} {sharding}: step {s} loss {} vs {want}", step.loss);
            match (step.eval_loss, eval) {
                (Some(g), Some(w)) => assert!(close(g, *w), "{world} {sharding}: step {s} eval {g} vs {w}"),
                (None, None) => {}
                other => panic!("{world} {sharding}: step {s}: evaluation {other:?}"),
            }
        }
        let want: Vec<&Vec<f64>> = net.w.iter().zip(&net.b).flat_map(|(w, b)| [w, b]).collect();
        assert_eq!(got.params.len(), want.len(), "{world} {sharding}: parameter count");
        for (k, (g, w)) in got.params.iter().zip(want).enumerate() {
            assert_eq!(g.len(), w.len(), "{world} {sharding}: parameter {k} length");
            for (i, (a, b)) in g.iter().zip(w).enumerate() {
                assert!(
                    a.is_finite() && (f64::from(*a) - b).abs() <= 1e-4,
                    "{world} {sharding}: parameter {k}[{i}] {a} vs {b}"
                );
            }
        }
    }
}
