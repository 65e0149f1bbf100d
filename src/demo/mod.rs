//! The demo model and its unsharded reference run.
//!
//! `collsched demo` trains [`model::Mlp`] data-parallel over `world` ranks. [`reference_run`]
//! runs the same arithmetic on one thread, unsharded: every "rank" computes its micro-batch's
//! gradient on whole parameters, gradients are accumulated locally over the micro-batches of a
//! step (what `no_sync` does), averaged over ranks in the order the plan reduces them (f32 sums
//! in rank order; for `hybrid:G` the sums of each group of `G` consecutive ranks, then those
//! sums in group order; divided by the world at the end) with the kernel the sharded run
//! reduces with (`collsched_kernels::reduce`), and applied by plain SGD to the parameters that
//! are trainable at that step. A sharded run that is right therefore produces bit-identical
//! parameters and losses on the CPU backends.
//!
//! This reference is the CLI's own check, and it shares the model code ([`model`],
//! [`loss_and_grads`]) and the reduction kernel with the run it checks: a bug in either would
//! be on both sides. The tests compare the sharded run with a reference of their own instead
//! (`tests/support/reference.rs`: the model, the data and the averaging written again from
//! their definition, no code of this crate), reading what `collsched demo --record-out`
//! writes where the run is the CLI's.
//!
//! [`sharded_run`] is that sharded run: the same steps over a local world through the
//! runtime's coordinators (see [`sharded`]).

pub mod model;
pub mod sharded;

#[cfg(feature = "cuda")]
pub use sharded::sharded_run_cuda;
pub use sharded::{
    max_differences, sharded_run, sharded_run_process, sharded_run_wrapped, DemoError, ShardedOptions,
    ShardedRun, StepCost,
};

use collsched_buckets::Sharding;
use collsched_kernels::{reduce, ElemType, ReduceOp, Scaling};

use self::model::{LayerCache, Mlp};

/// What the demo does, step by step; shared by the reference and the sharded run.
#[derive(Clone, Debug, PartialEq)]
pub struct DemoConfig {
    /// The model.
    pub model: Mlp,
    /// Data-parallel ranks.
    pub world: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// Micro-batches per step; all but the last run under `no_sync` (local accumulation).
    pub micro_batches: usize,
    /// Samples per micro-batch per rank.
    pub batch: usize,
    /// SGD learning rate.
    pub lr: f32,
    /// Seed of the initial parameters and the data.
    pub seed: u64,
    /// Layer frozen (`requires_grad = false`) from step `freeze.1` until step `freeze.2`
    /// (exclusive): `(layer, from, until)`.
    pub freeze: Option<(usize, usize, usize)>,
    /// An evaluation pass (forward only, on a held-out batch) after every this many steps
    /// (0: never).
    pub eval_every: usize,
}

impl DemoConfig {
    /// The demo's default: 6 layers of odd widths, 4 ranks, 12 steps of 2 micro-batches, layer 2
    /// frozen for steps 4..8, an evaluation every 3 steps.
    pub fn standard(world: usize, steps: usize, seed: u64) -> Self {
        DemoConfig {
            model: Mlp { dims: vec![17, 63, 129, 65, 33, 31, 5] },
            world,
            steps,
            micro_batches: 2,
            batch: 8,
            lr: 0.2,
            seed,
            freeze: Some((2, steps / 3, 2 * steps / 3)),
            eval_every: 3,
        }
    }

    /// Whether parameter `k` (in [`Mlp::params`] order) is trainable during `step`.
    pub fn trainable(&self, k: usize, step: usize) -> bool {
        match self.freeze {
            Some((layer, from, until)) => !(k / 2 == layer && (from..until).contains(&step)),
            None => true,
        }
    }

    /// Whether an evaluation pass follows `step`.
    pub fn evaluates_after(&self, step: usize) -> bool {
        self.eval_every != 0 && (step + 1).is_multiple_of(self.eval_every)
    }
}

/// Per-step outcome of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    /// Mean training loss over ranks and micro-batches, summed in (micro-batch, rank) order.
    pub loss: f32,
    /// Evaluation loss after the step, when the step has one.
    pub eval_loss: Option<f32>,
}

/// Outcome of a whole run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRecord {
    /// One record per step.
    pub steps: Vec<StepRecord>,
    /// The final parameters, in [`Mlp::params`] order.
    pub params: Vec<Vec<f32>>,
}

/// Forward pass of the whole model on `x`, keeping every layer's cache.
pub fn forward(model: &Mlp, params: &[Vec<f32>], x: &[f32]) -> Vec<LayerCache> {
    let mut caches: Vec<LayerCache> = Vec::with_capacity(model.layers());
    for l in 0..model.layers() {
        let input = caches.last().map_or(x, |c| &c.output[..]);
        let c = model.layer_forward(l, &params[2 * l], &params[2 * l + 1], input);
        caches.push(c);
    }
    caches
}

/// Loss and per-parameter gradients of one micro-batch.
pub fn loss_and_grads(model: &Mlp, params: &[Vec<f32>], x: &[f32], y: &[f32]) -> (f32, Vec<Vec<f32>>) {
    let caches = forward(model, params, x);
    let out = caches.last().map_or(x, |c| &c.output[..]);
    let (loss, mut g) = Mlp::mse(out, y);
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    for l in (0..model.layers()).rev() {
        let (gw, gb) = grads[2 * l..].split_at_mut(1);
        g = model.layer_backward(l, &params[2 * l], &caches[l], &g, &mut gw[0], &mut gb[0]);
    }
    (loss, grads)
}

/// The demo as a simulator workload (`collsched sim --workload FILE` reads it, written by
/// `collsched demo --workload-out FILE`): one layer `lL` per MLP layer holding `lL.weight` and
/// `lL.bias` (f32, trainable, module `lL`), a micro-batch of `cfg.batch` samples per rank, in
/// the forward and backward orders the demo fetches them. FLOPs follow the simulator's rule
/// (`2 * batch * in * out` forward for the weight multiply, twice that backward; biases and
/// `tanh` are not counted). One simulated step is one micro-batch's forward and backward: the
/// demo's step when it runs with `--micro-batches 1 --eval-every 0`.
pub fn workload(cfg: &DemoConfig) -> crate::sim::workload::Workload {
    use crate::sim::workload::{Layer, ParamRecord, Workload};
    let model = &cfg.model;
    let mut params = Vec::with_capacity(2 * model.layers());
    let mut layers = Vec::with_capacity(model.layers());
    for (l, pair) in model.params().chunks(2).enumerate() {
        let name = format!("l{l}");
        for p in pair {
            params.push(ParamRecord {
                name: p.name.clone(),
                shape: p.shape.iter().map(|&d| d as u64).collect(),
                dtype: "f32".to_owned(),
                trainable: true,
                module: Some(name.clone()),
            });
        }
        let forward = 2.0 * cfg.batch as f64 * (model.dims[l] * model.dims[l + 1]) as f64;
        layers.push(Layer {
            name,
            params: pair.iter().map(|p| p.name.clone()).collect(),
            forward_flops: forward,
            backward_flops: 2.0 * forward,
            recompute_flops: 0.0,
            keep: false,
        });
    }
    Workload::in_layer_order("demo-mlp", params, layers)
}

/// Evaluation loss on the held-out batch (sample and shard index `u64::MAX`, never trained on),
/// the same batch at every step so that the numbers are comparable.
pub fn eval_loss(cfg: &DemoConfig, params: &[Vec<f32>]) -> f32 {
    let (x, y) = cfg.model.batch(cfg.seed, u64::MAX, u64::MAX, 4 * cfg.batch);
    let caches = forward(&cfg.model, params, &x);
    Mlp::mse(&caches[caches.len() - 1].output, &y).0
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// Ranks whose gradients the first stage of the reduction sums together under `sharding` over
/// `world` ranks: `G` consecutive ranks for `hybrid:G` (its reduce-scatter inside the group;
/// an all-reduce across the groups follows), every rank otherwise (one stage). Never 0.
pub fn sum_group(world: usize, sharding: Sharding) -> usize {
    match sharding {
        Sharding::Hybrid(g) if g > 0 && world.is_multiple_of(g as usize) => g as usize,
        _ => world.max(1),
    }
}

/// The average of one parameter's gradients over the ranks (`per_rank`, in rank order), summed
/// as the plan reduces them: each group of `group` consecutive ranks in rank order, then the
/// groups' sums in group order, divided by the number of ranks at the end; `None` without
/// ranks.
fn average(per_rank: &[&[f32]], group: usize) -> Option<Vec<f32>> {
    let len = per_rank.first()?.len();
    let sum = |inputs: &[&[f32]], post: f32| -> Option<Vec<f32>> {
        let bytes: Vec<&[u8]> = inputs.iter().map(|g| f32_bytes(g)).collect();
        let mut out = vec![0f32; len];
        let scaling = Scaling { pre_divide: 1.0, post_divide: post };
        reduce(ElemType::F32, ReduceOp::Sum, scaling, bytemuck::cast_slice_mut(&mut out), &bytes).ok()?;
        Some(out)
    };
    let partials = per_rank.chunks(group.max(1)).map(|g| sum(g, 1.0)).collect::<Option<Vec<_>>>()?;
    let partials: Vec<&[f32]> = partials.iter().map(Vec::as_slice).collect();
    sum(&partials, per_rank.len() as f32)
}

/// Runs the demo unsharded on one thread: the reference the sharded run with `sharding` must
/// match bit for bit on the CPU backends (`sharding` decides only the order in which the
/// ranks' gradients are summed, see [`sum_group`]).
pub fn reference_run(cfg: &DemoConfig, sharding: Sharding) -> RunRecord {
    let model = &cfg.model;
    let group = sum_group(cfg.world, sharding);
    let mut params = model.init(cfg.seed);
    let mut steps = Vec::with_capacity(cfg.steps);
    let mut progress = crate::progress::Progress::new("demo (reference)", cfg.steps as u64);
    for step in 0..cfg.steps {
        progress.tick(step as u64);
        // accumulated[rank][param]
        let mut accumulated: Vec<Vec<Vec<f32>>> = Vec::with_capacity(cfg.world);
        let mut loss_sum = 0f32;
        for micro in 0..cfg.micro_batches {
            for rank in 0..cfg.world {
                let sample = (step * cfg.micro_batches + micro) as u64;
                let (x, y) = model.batch(cfg.seed, sample, rank as u64, cfg.batch);
                let (loss, grads) = loss_and_grads(model, &params, &x, &y);
                loss_sum += loss;
                if micro == 0 {
                    accumulated.push(grads);
                } else {
                    for (acc, g) in accumulated[rank].iter_mut().zip(&grads) {
                        for (a, v) in acc.iter_mut().zip(g) {
                            *a += v;
                        }
                    }
                }
            }
        }
        for (k, p) in params.iter_mut().enumerate() {
            if !cfg.trainable(k, step) {
                continue;
            }
            let per_rank: Vec<&[f32]> = accumulated.iter().map(|r| &r[k][..]).collect();
            // No average without ranks (a world of 0, or no micro-batches): no rank computed a
            // gradient and the parameter stays as it is.
            let Some(avg) = average(&per_rank, group) else {
                continue;
            };
            for (w, g) in p.iter_mut().zip(&avg) {
                *w -= cfg.lr * g;
            }
        }
        let loss = loss_sum / (cfg.world * cfg.micro_batches) as f32;
        let eval = cfg.evaluates_after(step).then(|| eval_loss(cfg, &params));
        steps.push(StepRecord { loss, eval_loss: eval });
    }
    RunRecord { steps, params }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NaN, a missing step, parameter or element, or an evaluation on one side only is an
    /// infinite difference, never 0.
    #[test]
    fn max_differences_fail_on_nan_and_on_anything_missing() {
        let step = |loss: f32, eval: Option<f32>| StepRecord { loss, eval_loss: eval };
        let good =
            RunRecord { steps: vec![step(1.0, Some(0.5)), step(0.5, None)], params: vec![vec![1.0, 2.0]] };
        assert_eq!(max_differences(&good, &good), (0.0, 0.0));
        let mut nan_loss = good.clone();
        nan_loss.steps[1].loss = f32::NAN;
        assert_eq!(max_differences(&nan_loss, &nan_loss).0, f32::INFINITY, "NaN on both sides");
        assert_eq!(max_differences(&good, &nan_loss).0, f32::INFINITY);
        let mut nan_eval = good.clone();
        nan_eval.steps[0].eval_loss = Some(f32::NAN);
        assert_eq!(max_differences(&good, &nan_eval).0, f32::INFINITY);
        let mut no_eval = good.clone();
        no_eval.steps[0].eval_loss = None;
        assert_eq!(max_differences(&good, &no_eval).0, f32::INFINITY);
        let mut short = good.clone();
        short.steps.pop();
        assert_eq!(max_differences(&good, &short).0, f32::INFINITY);
        let mut nan_param = good.clone();
        nan_param.params[0][1] = f32::NAN;
        assert_eq!(max_differences(&nan_param, &nan_param).1, f32::INFINITY);
        let mut missing_tensor = good.clone();
        missing_tensor.params.clear();
        assert_eq!(max_differences(&good, &missing_tensor).1, f32::INFINITY);
        let mut missing_elem = good.clone();
        missing_elem.params[0].pop();
        assert_eq!(max_differences(&good, &missing_elem).1, f32::INFINITY);
        let mut off = good.clone();
        off.params[0][0] = 1.5;
        assert_eq!(max_differences(&good, &off).1, 0.5);
    }

    /// The average sums as the plan reduces: `hybrid:2` on 4 ranks adds the two pairs' sums,
    /// the other strategies add the ranks one after the other, and the two differ where f32
    /// rounding makes the order matter.
    #[test]
    fn the_average_sums_in_the_plans_order() {
        assert_eq!(sum_group(4, Sharding::Hybrid(2)), 2);
        assert_eq!(sum_group(4, Sharding::Flat), 4);
        assert_eq!(sum_group(4, Sharding::Hybrid(3)), 4, "a group that does not divide: no layout");
        assert_eq!(sum_group(0, Sharding::Greedy), 1);
        let grads: [&[f32]; 4] = [&[1.0], &[1e8], &[-1e8], &[1.0]];
        // ((1 + 1e8) + -1e8) + 1 = 1; (1 + 1e8) + (-1e8 + 1) = 0 (1e8 + 1 rounds to 1e8).
        assert_eq!(average(&grads, 4), Some(vec![0.25]));
        assert_eq!(average(&grads, 2), Some(vec![0.0]));
        assert_eq!(average(&grads, 1), Some(vec![0.25]));
        assert_eq!(average(&[], 2), None);
    }

    #[test]
    fn reference_training_lowers_the_loss() {
        let cfg = DemoConfig::standard(4, 12, 3);
        let before = eval_loss(&cfg, &cfg.model.init(cfg.seed));
        let run = reference_run(&cfg, Sharding::EvenSplit);
        let after = eval_loss(&cfg, &run.params);
        assert!(after < 0.9 * before, "held-out loss went from {before} to {after}");
    }

    #[test]
    fn a_world_of_zero_ranks_trains_nothing_and_does_not_panic() {
        let mut cfg = DemoConfig::standard(0, 2, 1);
        cfg.eval_every = 0;
        let run = reference_run(&cfg, Sharding::EvenSplit);
        assert_eq!(run.params, cfg.model.init(cfg.seed), "no rank computed a gradient");
        assert!(run.steps.iter().all(|s| s.loss.is_nan()), "a mean over zero samples is NaN");
    }

    /// The workload names every parameter of the model once, with its shape, in layers the
    /// simulator accepts, and counts the weight multiplies' FLOPs.
    #[test]
    fn the_demo_workload_matches_the_model() {
        let cfg = DemoConfig::standard(2, 4, 1);
        let w = workload(&cfg);
        w.validate().expect("a valid workload");
        let params = cfg.model.params();
        assert_eq!(w.params.len(), params.len());
        for (r, p) in w.params.iter().zip(&params) {
            assert_eq!(r.name, p.name);
            assert_eq!(r.numel(), p.numel() as u64, "{}", p.name);
        }
        assert_eq!(w.layers.len(), cfg.model.layers());
        let dims = &cfg.model.dims;
        let macs: usize = dims.windows(2).map(|d| d[0] * d[1]).sum();
        assert_eq!(w.model_flops(), 6.0 * (cfg.batch * macs) as f64);
        assert_eq!(w.backward_order.first(), w.forward_order.last());
        let back = crate::sim::workload::Workload::from_json(&w.to_json()).expect("reads back");
        assert_eq!(back, w);
    }

    #[test]
    fn frozen_layer_does_not_move_while_frozen() {
        let mut cfg = DemoConfig::standard(2, 4, 1);
        cfg.freeze = Some((1, 0, 4));
        let run = reference_run(&cfg, Sharding::EvenSplit);
        let init = cfg.model.init(cfg.seed);
        assert_eq!(run.params[2], init[2], "l1.weight moved while frozen");
        assert_eq!(run.params[3], init[3], "l1.bias moved while frozen");
        assert_ne!(run.params[0], init[0], "l0.weight should train");
    }
}
