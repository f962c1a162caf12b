//! BatchNorm in training mode: normalized by each channel's batch
//! statistics as one burn operation on the CPU, forward and backward, and
//! the running statistics kept as PyTorch keeps them, on every device.
//!
//! For each channel `c`, over the `n = B · H · W` values of the batch:
//! `x̂ = (x − μ_c) / √(σ²_c + ε)` (biased variance) and `y = γ_c · x̂ + β_c`;
//! the way back: `dx = γ_c / √(σ²_c + ε) · (dy − mean(dy) − x̂ · mean(dy · x̂))`,
//! `dγ_c = Σ dy · x̂`, `dβ_c = Σ dy`. burn's own operation sums in float32,
//! one value after another; these sums run in f64 across images and in
//! 16 interleaved float32 partial sums along a row, so a deep
//! BatchNorm network's gradients stay as close to float64's as PyTorch's do
//! (`tests/pytorch_twins.rs` trains every model against its twin).
//!
//! The running variance takes the batch's unbiased variance (`σ² · n/(n−1)`,
//! Bessel's correction), as PyTorch's does; burn-nn's BatchNorm takes the
//! biased one, so its running variance, and every evaluation with it, drifts
//! from PyTorch's by up to `n/(n−1)`: 3 % for a 4×4 map at batch 2.

use burn::backend::AutodiffBackend;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Backend, Flex, backend_extension, tensor::FloatTensor};
use burn::nn::BatchNorm;
use burn::tensor::{DType, Tensor, activation};

use super::flex::{host, owned, register_gradients, tensor, values_mut};
use super::group_norm::{affine_into, lane_sum, relu_mask, row_dot};

/// The shapes of one BatchNorm: `[batch, channels, spatial]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Shape {
    pub batch: usize,
    pub channels: usize,
    pub spatial: usize,
    pub epsilon: f64,
}

impl Shape {
    /// Channel `c`'s row of each image in `values` (`[B, C, S]`).
    fn rows<'a>(&self, values: &'a [f32], c: usize) -> impl Iterator<Item = &'a [f32]> + 'a {
        let (channels, spatial) = (self.channels, self.spatial);
        (0..self.batch).map(move |b| &values[(b * channels + c) * spatial..][..spatial])
    }

    fn count(&self) -> usize {
        self.batch * self.spatial
    }
}

/// Each channel's batch mean and biased variance, summed in f64.
#[inline(always)]
pub(crate) fn statistics(s: &Shape, x: &[f32]) -> Vec<(f64, f64)> {
    let n = s.count().max(1) as f64;
    (0..s.channels)
        .map(|c| {
            let mean = s.rows(x, c).map(|r| lane_sum(r, |v| v as f64)).sum::<f64>() / n;
            let var = s
                .rows(x, c)
                .map(|r| lane_sum(r, |v| (v as f64 - mean).powi(2)))
                .sum::<f64>()
                / n;
            (mean, var)
        })
        .collect()
}

fn mean_and_rstd((mean, var): (f64, f64), epsilon: f64) -> (f32, f32) {
    (mean as f32, (1.0 / (var + epsilon).sqrt()) as f32)
}

/// The normalized `x`, through ReLU where `relu`, appended to `out`
/// (empty, with room for it); `stats` from [`statistics`].
#[inline(always)]
pub(crate) fn forward(
    s: &Shape,
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    stats: &[(f64, f64)],
    relu: bool,
    out: &mut Vec<f32>,
) {
    assert_eq!(x.len(), s.batch * s.channels * s.spatial, "input length");
    assert!(out.is_empty(), "output written from its start");
    for (row, src) in x.chunks_exact(s.spatial).enumerate() {
        let c = row % s.channels;
        let (mean, rstd) = mean_and_rstd(stats[c], s.epsilon);
        let (scale, shift) = (gamma[c] * rstd, beta[c] - gamma[c] * rstd * mean);
        affine_into(out, src, scale, shift, relu);
    }
}

/// The gradients of [`forward`]: `grad` holds the output's on entry and
/// the input's on return; `d_gamma` and `d_beta` (`[C]`) overwritten.
/// `output` is the forward pass's where it went through ReLU.
#[inline(always)]
#[allow(clippy::too_many_arguments)] // one per tensor of the formula
pub(crate) fn backward(
    s: &Shape,
    x: &[f32],
    gamma: &[f32],
    stats: &[(f64, f64)],
    output: Option<&[f32]>,
    grad: &mut [f32],
    d_gamma: &mut [f32],
    d_beta: &mut [f32],
) {
    let n = s.count().max(1) as f64;
    let mut means = Vec::with_capacity(s.channels);
    for c in 0..s.channels {
        let (mean, rstd) = mean_and_rstd(stats[c], s.epsilon);
        let (mut dy_sum, mut dyx_sum) = (0.0f64, 0.0f64);
        for b in 0..s.batch {
            let at = (b * s.channels + c) * s.spatial..(b * s.channels + c + 1) * s.spatial;
            let dy = &mut grad[at.clone()];
            if let Some(output) = output {
                relu_mask(dy, &output[at.clone()]);
            }
            dy_sum += lane_sum(dy, |d| d) as f64;
            dyx_sum += row_dot(&x[at], dy, mean, rstd) as f64;
        }
        d_beta[c] = dy_sum as f32;
        d_gamma[c] = dyx_sum as f32;
        means.push(((dy_sum / n) as f32, (dyx_sum / n) as f32));
    }
    let rows = x
        .chunks_exact(s.spatial)
        .zip(grad.chunks_exact_mut(s.spatial));
    for (row, (src, dy)) in rows.enumerate() {
        let c = row % s.channels;
        let (mean, rstd) = mean_and_rstd(stats[c], s.epsilon);
        let (mean_dy, mean_dyx) = means[c];
        let scale = gamma[c] * rstd;
        for (d, &v) in dy.iter_mut().zip(src) {
            let xhat = (v - mean) * rstd;
            *d = scale * (*d - mean_dy - xhat * mean_dyx);
        }
    }
}

/// BatchNorm's training-mode normalization on burn's CPU backend, with or
/// without autodiff.
#[backend_extension(Flex, Autodiff)]
pub trait NativeBatchNorm: Backend {
    /// `x` `[B, C, H, W]` normalized by each channel's batch statistics,
    /// scaled by `gamma` and shifted by `beta` (`[C]`), and through ReLU
    /// where `relu`; with those statistics, `[2, C]`: each channel's mean,
    /// then its biased variance (untracked).
    fn native_batch_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
        relu: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// `norm.forward(x)`, with PyTorch's running statistics: in training (an
/// autodiff device and the layer not frozen), normalized by the batch's
/// statistics through cohort's kernel where it applies (float32 on burn's
/// CPU device with the native kernels on), else through burn's operation,
/// and the running mean and unbiased variance moved by `momentum`; in
/// evaluation, burn's normalization by the running statistics.
pub fn batch_norm(norm: &BatchNorm, x: Tensor<4>) -> Tensor<4> {
    let native = super::enabled_on(&x.device());
    batch_norm_with(norm, x, native, false)
}

/// `relu(batch_norm(norm, x))`, as one operation where [`batch_norm`]'s
/// kernel applies: the ReLU's pass over the output, and its pass back, are
/// folded into the normalization's.
pub fn batch_norm_relu(norm: &BatchNorm, x: Tensor<4>) -> Tensor<4> {
    let native = super::enabled_on(&x.device());
    batch_norm_with(norm, x, native, true)
}

/// [`batch_norm`], through cohort's kernel only where `native` allows it,
/// and through ReLU where `relu`.
fn batch_norm_with(norm: &BatchNorm, x: Tensor<4>, native: bool, relu: bool) -> Tensor<4> {
    let device = x.device();
    let relu_if = |y: Tensor<4>| if relu { activation::relu(y) } else { y };
    if !(device.is_autodiff() && norm.training.is_enabled()) {
        return relu_if(norm.forward(x));
    }
    let [batch, channels, h, w] = x.dims();
    let native =
        native && x.dtype() == DType::F32 && channels == norm.gamma.dims()[0] && batch * h * w > 0;
    let (output, mean, variance) = if native {
        type D = burn::backend::Dispatch;
        let (output, stats) = <D as NativeBatchNorm>::native_batch_norm(
            x.into_dispatch(),
            norm.gamma.val().into_dispatch(),
            norm.beta.val().into_dispatch(),
            norm.epsilon,
            relu,
        );
        let [mean, variance] = Tensor::<2>::from_dispatch(stats)
            .chunk(2, 0)
            .try_into()
            .expect("two rows of statistics");
        (
            Tensor::from_dispatch(output),
            mean.reshape([channels]),
            variance.reshape([channels]),
        )
    } else {
        let trained = burn::tensor::module::batch_norm_train(
            x,
            norm.gamma.val(),
            norm.beta.val(),
            norm.epsilon,
        );
        (
            relu_if(trained.output),
            trained.mean.detach(),
            trained.variance.detach(),
        )
    };
    // Bessel's correction, as PyTorch's running variance has it (a batch of
    // one value a channel, which PyTorch refuses to train on, keeps the
    // biased variance, 0).
    let count = batch * h * w;
    let unbiased = variance.mul_scalar(count as f64 / count.saturating_sub(1).max(1) as f64);
    let momentum = norm.momentum;
    let running_mean = norm.running_mean.value_sync().to_device(&device);
    let running_var = norm.running_var.value_sync().to_device(&device);
    norm.running_mean.update(
        running_mean
            .mul_scalar(1.0 - momentum)
            .add(mean.mul_scalar(momentum))
            .detach(),
    );
    norm.running_var.update(
        running_var
            .mul_scalar(1.0 - momentum)
            .add(unbiased.mul_scalar(momentum))
            .detach(),
    );
    output
}

fn shape_of(x: &FlexTensor, epsilon: f64) -> (Shape, Vec<usize>) {
    let [batch, channels, h, w] = x.layout().shape().dims();
    let shape = Shape {
        batch,
        channels,
        spatial: h * w,
        epsilon,
    };
    (shape, vec![batch, channels, h, w])
}

/// The normalized `x` (through ReLU where `relu`) and each channel's
/// batch mean and biased variance, which the way back reuses.
fn normalize(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    epsilon: f64,
    relu: bool,
) -> (FlexTensor, Vec<(f64, f64)>) {
    let (s, dims) = shape_of(&x, epsilon);
    let (x, gamma, beta) = (
        x.to_contiguous(),
        gamma.to_contiguous(),
        beta.to_contiguous(),
    );
    let mut out = Vec::with_capacity(host(&x).len());
    let stats = super::simd::dispatch(
        #[inline(always)]
        || {
            let stats = statistics(&s, host(&x));
            forward(
                &s,
                host(&x),
                host(&gamma),
                host(&beta),
                &stats,
                relu,
                &mut out,
            );
            stats
        },
    );
    (tensor(out, dims), stats)
}

/// `[2, C]`: the means, then the variances, in float32.
fn statistics_tensor(stats: &[(f64, f64)]) -> FlexTensor {
    let means = stats.iter().map(|s| s.0 as f32);
    let variances = stats.iter().map(|s| s.1 as f32);
    tensor(means.chain(variances).collect(), vec![2, stats.len()])
}

impl NativeBatchNorm for Flex {
    fn native_batch_norm(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        epsilon: f64,
        relu: bool,
    ) -> (FlexTensor, FlexTensor) {
        let (output, stats) = normalize(x, gamma, beta, epsilon, relu);
        (output, statistics_tensor(&stats))
    }
}

#[derive(Debug, Clone)]
struct Saved {
    x: NodeId,
    gamma: NodeId,
    epsilon: f64,
    stats: Vec<(f64, f64)>,
    /// The output, where it went through ReLU: the tensor the next layer
    /// keeps as its input anyway.
    relu_output: Option<FlexTensor>,
}

#[derive(Debug)]
struct BatchNormBackward;

impl Backward<Flex, 3> for BatchNormBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let mut d_x = owned(grads.consume::<Flex>(&ops.node));
        let saved = ops.state;
        let x = checkpointer.retrieve_node_output::<FlexTensor>(saved.x);
        let gamma = checkpointer.retrieve_node_output::<FlexTensor>(saved.gamma);
        let (s, _) = shape_of(&x, saved.epsilon);
        let (x, gamma) = (x.to_contiguous(), gamma.to_contiguous());
        let output = saved.relu_output.map(|output| output.to_contiguous());
        let (mut d_gamma, mut d_beta) = (vec![0.0f32; s.channels], vec![0.0f32; s.channels]);
        super::simd::dispatch(
            #[inline(always)]
            || {
                backward(
                    &s,
                    host(&x),
                    host(&gamma),
                    &saved.stats,
                    output.as_ref().map(host),
                    values_mut(&mut d_x),
                    &mut d_gamma,
                    &mut d_beta,
                )
            },
        );
        let [x_parent, gamma_parent, beta_parent] = ops.parents.map(|p| p.map(|n| n.id));
        if let Some(id) = x_parent {
            grads.register::<Flex>(id, d_x);
        }
        let gradients = [
            (Some(d_gamma), vec![s.channels]),
            (Some(d_beta), vec![s.channels]),
        ];
        register_gradients(grads, [gamma_parent, beta_parent], gradients);
    }
}

type AdTensor = FloatTensor<Autodiff<Flex>>;

impl<C: CheckpointStrategy> NativeBatchNorm for Autodiff<Flex, C> {
    fn native_batch_norm(
        x: AdTensor,
        gamma: AdTensor,
        beta: AdTensor,
        epsilon: f64,
        relu: bool,
    ) -> (AdTensor, AdTensor) {
        let forward = || {
            let (p, g, b) = (
                x.primitive().clone(),
                gamma.primitive().clone(),
                beta.primitive().clone(),
            );
            normalize(p, g, b, epsilon, relu)
        };
        let untracked = |stats: &[(f64, f64)]| {
            <Autodiff<Flex, C> as AutodiffBackend>::from_inner(statistics_tensor(stats))
        };
        match BatchNormBackward
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let (output, stats) = forward();
                let statistics = untracked(&stats);
                let state = Saved {
                    x: prep.checkpoint(&x),
                    gamma: prep.checkpoint(&gamma),
                    epsilon,
                    stats,
                    relu_output: relu.then(|| output.clone()),
                };
                (prep.finish(state, output), statistics)
            }
            OpsKind::UnTracked(prep) => {
                let (output, stats) = forward();
                (prep.finish(output), untracked(&stats))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Against burn-nn's BatchNorm under autodiff, on random inputs and
    //! parameters: output and every gradient to `2e-5` of the largest
    //! magnitude of burn's values (the sums differ in order and precision),
    //! the same bits twice, the running statistics PyTorch's: the mean
    //! and the unbiased variance, by `momentum`, and the folded ReLU's bits
    //! those of burn's ReLU after the kernel.

    use crate::kernels::flex::testing::{assert_close, values as host};
    use burn::module::Param;
    use burn::nn::{BatchNorm, BatchNormConfig};
    use burn::tensor::{Tensor, TensorData, activation};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    /// Output, input, γ and β gradients of one BatchNorm in training
    /// through burn-nn's forward or [`super::batch_norm_with`] (`Some`: on
    /// cohort's kernel or not), and the layer after it.
    fn run(shape: [usize; 4], seed: u64, ours: Option<bool>) -> (Vec<Vec<f32>>, BatchNorm) {
        run_with(shape, seed, ours, Relu::None)
    }

    /// Where a ReLU follows the normalization in [`run_with`].
    #[derive(Clone, Copy, PartialEq)]
    enum Relu {
        None,
        After,
        FoldedIn,
    }

    fn run_with(
        shape: [usize; 4],
        seed: u64,
        ours: Option<bool>,
        relu: Relu,
    ) -> (Vec<Vec<f32>>, BatchNorm) {
        let device = crate::device::cpu().autodiff();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let channels = shape[1];
        let mut norm = BatchNormConfig::new(channels).init(&device);
        let param = |rng: &mut ChaCha8Rng| {
            let values = random(channels, rng);
            Param::from_tensor(Tensor::<1>::from_data(
                TensorData::new(values, [channels]),
                &device,
            ))
        };
        norm.gamma = param(&mut rng);
        norm.beta = param(&mut rng);
        let len = shape.iter().product();
        let x = Tensor::<4>::from_data(TensorData::new(random(len, &mut rng), shape), &device)
            .require_grad();
        let out = match ours {
            Some(native) => {
                super::batch_norm_with(&norm, x.clone(), native, relu == Relu::FoldedIn)
            }
            None => norm.forward(x.clone()),
        };
        let out = if relu == Relu::After {
            activation::relu(out)
        } else {
            out
        };
        let r = Tensor::<4>::from_data(TensorData::new(random(len, &mut rng), shape), &device);
        let grads = (out.clone() * r).sum().backward();
        let grad = |p: &Param<Tensor<1>>| host(p.val().grad(&grads).unwrap());
        let values = vec![
            host(out),
            host(x.grad(&grads).unwrap()),
            grad(&norm.gamma),
            grad(&norm.beta),
        ];
        (values, norm)
    }

    const SHAPES: [[usize; 4]; 5] = [
        [2, 16, 8, 8],
        [3, 6, 5, 7],
        [2, 4, 1, 1],
        [4, 64, 4, 4],
        [10, 32, 16, 16],
    ];

    #[test]
    fn output_and_gradients_match_burns_batch_norm() {
        for (i, shape) in SHAPES.into_iter().enumerate() {
            let (ours, _) = run(shape, i as u64, Some(true));
            let (theirs, _) = run(shape, i as u64, None);
            let names = [
                "output",
                "input gradient",
                "gamma gradient",
                "beta gradient",
            ];
            for (what, (a, b)) in names.iter().zip(ours.iter().zip(&theirs)) {
                assert_close(a, b, 2e-5, &format!("{what} of {shape:?}"));
            }
        }
    }

    /// PyTorch's update, by hand: `(1 − m) · old + m · batch`, the batch's
    /// variance unbiased (`n/(n−1)`); burn-nn's own is biased.
    #[test]
    fn running_statistics_are_pytorchs() {
        for (i, shape) in SHAPES.into_iter().enumerate() {
            for native in [true, false] {
                {
                    let (_, norm) = run(shape, i as u64, Some(native));
                    let mut rng = ChaCha8Rng::seed_from_u64(i as u64);
                    let channels = shape[1];
                    // The draws `run` made before the input: γ and β.
                    let _ = (random(channels, &mut rng), random(channels, &mut rng));
                    let x = random(shape.iter().product(), &mut rng);
                    let spatial = shape[2] * shape[3];
                    let n = (shape[0] * spatial) as f64;
                    let (mut means, mut vars) = (Vec::new(), Vec::new());
                    for c in 0..channels {
                        let values: Vec<f64> = (0..shape[0])
                            .flat_map(|b| &x[(b * channels + c) * spatial..][..spatial])
                            .map(|&v| v as f64)
                            .collect();
                        let mean = values.iter().sum::<f64>() / n;
                        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>()
                            / (n - 1.0).max(1.0);
                        means.push((0.1 * mean) as f32);
                        vars.push((0.9 + 0.1 * var) as f32);
                    }
                    let what = format!("{shape:?}, native kernels {native}");
                    // burn's operation sums in float32, one value after another.
                    let tolerance = if native { 1e-6 } else { 1e-5 };
                    let running =
                        |state: &burn::module::RunningState<Tensor<1>>| host(state.value_sync());
                    assert_close(&running(&norm.running_mean), &means, tolerance, &what);
                    assert_close(&running(&norm.running_var), &vars, tolerance, &what);
                }
            }
        }
    }

    #[test]
    fn the_same_inputs_give_the_same_bits() {
        let bits = |r: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
            r.iter()
                .map(|v| v.iter().map(|f| f.to_bits()).collect())
                .collect()
        };
        let first = bits(run([4, 16, 8, 8], 7, Some(true)).0);
        assert_eq!(first, bits(run([4, 16, 8, 8], 7, Some(true)).0));
    }

    /// The folded ReLU changes where values are computed, not how: output,
    /// gradients and running statistics are those of burn's ReLU after the
    /// kernel, bit for bit; through burn's operation (`native` off) it is
    /// burn's ReLU, to burn's own bits.
    #[test]
    fn relu_folded_in_gives_the_bits_of_relu_after() {
        let bits = |(values, norm): (Vec<Vec<f32>>, BatchNorm)| -> Vec<Vec<u32>> {
            let running = [
                norm.running_mean.value_sync(),
                norm.running_var.value_sync(),
            ];
            values
                .into_iter()
                .chain(running.map(host))
                .map(|v| v.iter().map(|f| f.to_bits()).collect())
                .collect()
        };
        for native in [true, false] {
            for (i, shape) in SHAPES.into_iter().enumerate() {
                let folded = run_with(shape, i as u64, Some(native), Relu::FoldedIn);
                assert!(folded.0[0].contains(&0.0), "{shape:?}: nothing stopped");
                let after = run_with(shape, i as u64, Some(native), Relu::After);
                assert_eq!(bits(folded), bits(after), "{shape:?}, native {native}");
            }
        }
    }
}
