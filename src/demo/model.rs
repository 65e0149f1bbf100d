//! A small multi-layer perceptron with hand-written forward and backward passes, the model the
//! demo trains.
//!
//! Everything is layer-wise so that a sharded run can fetch a layer's parameters, run that
//! layer, and release them (ZeRO-3), while [`super::reference_run`] (the CLI's own parity
//! check) runs the very same functions on whole parameters. All arithmetic is `f32` in a fixed
//! order, so two runs that see the same parameter values compute bit-identical results; the
//! parity tests hold this code to a reference of their own (`tests/support/reference.rs`)
//! that follows the same order.

/// The model's shape: `dims[0]` inputs, `dims[last]` outputs, a `tanh` hidden layer between
/// each pair, and a linear last layer. Layer `i` has `weight` of shape `[dims[i+1], dims[i]]`
/// (row-major, output-major) and `bias` of shape `[dims[i+1]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mlp {
    /// Width of each activation, input first.
    pub dims: Vec<usize>,
}

/// One parameter of the model: its name and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlpParam {
    /// `l{layer}.weight` or `l{layer}.bias`.
    pub name: String,
    /// Row-major shape.
    pub shape: Vec<usize>,
}

impl MlpParam {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// What a layer's forward pass keeps for its backward pass.
#[derive(Clone, Debug, Default)]
pub struct LayerCache {
    /// The layer's input (`batch x in`).
    pub input: Vec<f32>,
    /// The layer's output after its activation (`batch x out`).
    pub output: Vec<f32>,
}

impl Mlp {
    /// Number of layers (weight + bias pairs).
    pub fn layers(&self) -> usize {
        self.dims.len().saturating_sub(1)
    }

    /// The parameters in execution order: `l0.weight, l0.bias, l1.weight, ...`.
    pub fn params(&self) -> Vec<MlpParam> {
        (0..self.layers())
            .flat_map(|l| {
                let (i, o) = (self.dims[l], self.dims[l + 1]);
                [
                    MlpParam { name: format!("l{l}.weight"), shape: vec![o, i] },
                    MlpParam { name: format!("l{l}.bias"), shape: vec![o] },
                ]
            })
            .collect()
    }

    /// Deterministic initial values for every parameter (scaled uniform), from `seed`.
    pub fn init(&self, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = SplitMix64::new(seed ^ 0x1417_5EED);
        self.params()
            .iter()
            .enumerate()
            .map(|(k, p)| {
                let fan_in = self.dims[k / 2] as f32;
                let scale = if k % 2 == 0 { 1.0 / fan_in.sqrt() } else { 0.1 };
                (0..p.numel()).map(|_| rng.uniform() * scale).collect()
            })
            .collect()
    }

    /// Forward pass of layer `l` on `input` (`batch x dims[l]`), with `tanh` on every layer but
    /// the last.
    pub fn layer_forward(&self, l: usize, weight: &[f32], bias: &[f32], input: &[f32]) -> LayerCache {
        let (ni, no) = (self.dims[l], self.dims[l + 1]);
        let batch = input.len() / ni;
        let last = l + 1 == self.layers();
        let mut output = vec![0f32; batch * no];
        for b in 0..batch {
            let x = &input[b * ni..(b + 1) * ni];
            for o in 0..no {
                let w = &weight[o * ni..(o + 1) * ni];
                let mut acc = bias[o];
                for (wi, xi) in w.iter().zip(x) {
                    acc += wi * xi;
                }
                output[b * no + o] = if last { acc } else { acc.tanh() };
            }
        }
        LayerCache { input: input.to_vec(), output }
    }

    /// Backward pass of layer `l`: from the gradient of the loss with respect to the layer's
    /// output, writes the weight and bias gradients and returns the gradient with respect to the
    /// layer's input.
    pub fn layer_backward(
        &self,
        l: usize,
        weight: &[f32],
        cache: &LayerCache,
        grad_output: &[f32],
        grad_weight: &mut [f32],
        grad_bias: &mut [f32],
    ) -> Vec<f32> {
        let (ni, no) = (self.dims[l], self.dims[l + 1]);
        let batch = cache.input.len() / ni;
        let last = l + 1 == self.layers();
        grad_weight.fill(0.0);
        grad_bias.fill(0.0);
        let mut grad_input = vec![0f32; batch * ni];
        for b in 0..batch {
            let x = &cache.input[b * ni..(b + 1) * ni];
            let gx = &mut grad_input[b * ni..(b + 1) * ni];
            for o in 0..no {
                let y = cache.output[b * no + o];
                // d tanh(z) / dz = 1 - tanh(z)^2
                let gz = if last { grad_output[b * no + o] } else { grad_output[b * no + o] * (1.0 - y * y) };
                grad_bias[o] += gz;
                let w = &weight[o * ni..(o + 1) * ni];
                let gw = &mut grad_weight[o * ni..(o + 1) * ni];
                for i in 0..ni {
                    gw[i] += gz * x[i];
                    gx[i] += gz * w[i];
                }
            }
        }
        grad_input
    }

    /// Mean squared error over a batch, and its gradient with respect to the prediction.
    pub fn mse(prediction: &[f32], target: &[f32]) -> (f32, Vec<f32>) {
        let n = prediction.len().max(1) as f32;
        let mut loss = 0f32;
        let grad = prediction
            .iter()
            .zip(target)
            .map(|(p, t)| {
                let d = p - t;
                loss += d * d;
                2.0 * d / n
            })
            .collect();
        (loss / n, grad)
    }

    /// A deterministic synthetic batch: inputs uniform in [-1, 1), targets a smooth function of
    /// them, different for every `(seed, step, shard)` triple.
    pub fn batch(&self, seed: u64, step: u64, shard: u64, batch: usize) -> (Vec<f32>, Vec<f32>) {
        let mut rng = SplitMix64::new(seed.wrapping_mul(0x9E37_79B9) ^ (step << 20) ^ (shard << 40) ^ 0xBA7C);
        let (ni, no) = (self.dims[0], self.dims[self.layers()]);
        let x: Vec<f32> = (0..batch * ni).map(|_| rng.uniform()).collect();
        let mut y = vec![0f32; batch * no];
        for b in 0..batch {
            for o in 0..no {
                let s: f32 =
                    x[b * ni..(b + 1) * ni].iter().enumerate().map(|(i, v)| v * ((i + o) % 3) as f32).sum();
                y[b * no + o] = (s / (ni as f32).sqrt()).sin();
            }
        }
        (x, y)
    }
}

/// SplitMix64: a tiny, well-known deterministic generator (enough for synthetic data).
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The analytic gradient matches a central finite difference of the loss.
    #[test]
    fn backward_matches_finite_differences() {
        let m = Mlp { dims: vec![3, 5, 2] };
        let params = m.init(7);
        let (x, y) = m.batch(1, 0, 0, 4);
        let loss_of = |p: &[Vec<f32>]| {
            let mut h = x.clone();
            for l in 0..m.layers() {
                h = m.layer_forward(l, &p[2 * l], &p[2 * l + 1], &h).output;
            }
            Mlp::mse(&h, &y).0
        };
        // analytic
        let mut caches = Vec::new();
        let mut h = x.clone();
        for l in 0..m.layers() {
            let c = m.layer_forward(l, &params[2 * l], &params[2 * l + 1], &h);
            h = c.output.clone();
            caches.push(c);
        }
        let (_, mut g) = Mlp::mse(&h, &y);
        let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        for l in (0..m.layers()).rev() {
            let (gw, rest) = grads[2 * l..].split_at_mut(1);
            g = m.layer_backward(l, &params[2 * l], &caches[l], &g, &mut gw[0], &mut rest[0]);
        }
        let eps = 1e-2f32;
        for (k, p) in params.iter().enumerate() {
            for i in 0..p.len() {
                let mut plus = params.clone();
                plus[k][i] += eps;
                let mut minus = params.clone();
                minus[k][i] -= eps;
                let fd = (loss_of(&plus) - loss_of(&minus)) / (2.0 * eps);
                assert!(
                    (fd - grads[k][i]).abs() < 2e-3,
                    "param {k}[{i}]: analytic {} vs numeric {fd}",
                    grads[k][i]
                );
            }
        }
    }
}
