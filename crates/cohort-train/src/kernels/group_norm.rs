//! GroupNorm (affine) as one burn operation on the CPU, forward and backward,
//! in place of burn-nn's composition of a dozen tensor operations, each a
//! pass over the activations with its own autodiff node.
//!
//! For each image `b` and group `g`, over the `n = C/G · H · W` values of the
//! group: `x̂ = (x − μ) / √(σ² + ε)` (biased variance, as burn and PyTorch)
//! and `y = γ_c · x̂ + β_c`. The way back, with `ĝ = γ_c · dy`:
//! `dx = (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂)) / √(σ² + ε)`,
//! `dγ_c = Σ dy · x̂`, `dβ_c = Σ dy` (over images and positions). The
//! statistics are summed in f64 and recomputed in the backward pass from the
//! saved input rather than kept; every sum runs in [`LANES`] interleaved
//! partial sums, so it vectorizes in an order fixed by the shapes.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Backend, Flex, backend_extension, tensor::FloatTensor};
use burn::nn::GroupNorm;
use burn::tensor::{DType, Tensor, activation};

use super::flex::{host, owned, register_gradients, tensor, values_mut};

/// The shapes of one GroupNorm: `[batch, channels, spatial]` in `groups`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Shape {
    pub batch: usize,
    pub channels: usize,
    pub spatial: usize,
    pub groups: usize,
    pub epsilon: f64,
}

impl Shape {
    fn group_len(&self) -> usize {
        self.channels / self.groups * self.spatial
    }
}

/// Partial sums kept side by side, so a sum vectorizes while its order
/// stays fixed by the length alone.
const LANES: usize = 16;

/// `Σ term(v)` over `values`, in [`LANES`] interleaved partial sums added
/// in lane order at the end.
#[inline(always)]
pub(crate) fn lane_sum<T: Copy + Default + std::ops::Add<Output = T>>(
    values: &[f32],
    term: impl Fn(f32) -> T,
) -> T {
    let mut lanes = [T::default(); LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = *lane + term(v);
        }
    }
    for (lane, &v) in lanes.iter_mut().zip(tail) {
        *lane = *lane + term(v);
    }
    lanes.into_iter().fold(T::default(), |sum, lane| sum + lane)
}

/// `Σ dy · x̂` along one row (`x̂ = (x − mean) · rstd`), in [`LANES`]
/// partial sums.
#[inline(always)]
pub(crate) fn row_dot(src: &[f32], dy: &[f32], mean: f32, rstd: f32) -> f32 {
    let (mut lanes, mut tail) = ([0.0f32; LANES], 0.0f32);
    let (src_chunks, dy_chunks) = (src.chunks_exact(LANES), dy.chunks_exact(LANES));
    for (&v, &d) in src_chunks.remainder().iter().zip(dy_chunks.remainder()) {
        tail += d * ((v - mean) * rstd);
    }
    for (src, dy) in src_chunks.zip(dy_chunks) {
        for ((lane, &v), &d) in lanes.iter_mut().zip(src).zip(dy) {
            *lane += d * ((v - mean) * rstd);
        }
    }
    lanes.into_iter().fold(tail, |sum, lane| sum + lane)
}

/// Mean and `1/√(σ² + ε)` of one group's values.
#[inline(always)]
fn statistics(values: &[f32], epsilon: f64) -> (f32, f32) {
    let n = values.len().max(1) as f64;
    let mean = lane_sum(values, |v| v as f64) / n;
    let var = lane_sum(values, |v| (v as f64 - mean).powi(2)) / n;
    (mean as f32, (1.0 / (var + epsilon).sqrt()) as f32)
}

/// Each image and group of `x` (`[B, C, S]`) with its channels' `γ`, `β`.
fn groups<'a>(
    s: &Shape,
    x: &'a [f32],
) -> impl Iterator<Item = (usize, &'a [f32], std::ops::Range<usize>)> + 'a {
    let (len, per) = (s.group_len(), s.channels / s.groups);
    let groups = s.groups;
    x.chunks_exact(len.max(1))
        .enumerate()
        .map(move |(i, chunk)| {
            let g = i % groups;
            (i, chunk, g * per..(g + 1) * per)
        })
}

/// Whether burn's ReLU lets `y` through: above zero, or NaN (PyTorch's
/// ReLU propagates NaN; burn flex's too).
#[inline(always)]
pub(crate) fn relu_passes(y: f32) -> bool {
    y.is_nan() || y > 0.0
}

/// `v · scale + shift` for each `v` of `src`, through ReLU where `relu`,
/// appended to `out` (so the output is never zeroed before it is written).
#[inline(always)]
pub(crate) fn affine_into(out: &mut Vec<f32>, src: &[f32], scale: f32, shift: f32, relu: bool) {
    if relu {
        out.extend(src.iter().map(|&v| {
            let y = v * scale + shift;
            if relu_passes(y) { y } else { 0.0 }
        }));
    } else {
        out.extend(src.iter().map(|&v| v * scale + shift));
    }
}

/// ReLU's way back: each of `dy` whose output ReLU stopped made 0, as
/// burn's `relu_backward` does. Every value is written back through a bit
/// mask: written as "0 where stopped", the loop compiles to AVX2's masked
/// store, which Zen 4 runs many times slower than a plain one.
#[inline(always)]
pub(crate) fn relu_mask(dy: &mut [f32], output: &[f32]) {
    for (d, &y) in dy.iter_mut().zip(output) {
        let keep = (relu_passes(y) as u32).wrapping_neg();
        *d = f32::from_bits(d.to_bits() & keep);
    }
}

/// The normalized `x`, through ReLU where `relu`, appended to `out`
/// (empty, with room for it); returns each image's and group's mean and
/// `1/√(σ² + ε)`, image-major. Each group's statistics are taken just
/// before it is written, while its values are still in cache.
#[inline(always)]
pub(crate) fn forward(
    s: &Shape,
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    relu: bool,
    out: &mut Vec<f32>,
) -> Vec<(f32, f32)> {
    assert_eq!(x.len(), s.batch * s.channels * s.spatial, "input length");
    assert!(out.is_empty(), "output written from its start");
    let mut stats = Vec::with_capacity(s.batch * s.groups);
    for (_, group, channels) in groups(s, x) {
        let (mean, rstd) = statistics(group, s.epsilon);
        stats.push((mean, rstd));
        for (src, c) in group.chunks_exact(s.spatial).zip(channels) {
            let (scale, shift) = (gamma[c] * rstd, beta[c] - gamma[c] * rstd * mean);
            affine_into(out, src, scale, shift, relu);
        }
    }
    stats
}

/// The gradients of [`forward`]: `grad` holds the output's on entry and
/// the input's on return; `d_gamma` and `d_beta` (`[C]`) overwritten.
/// `output` is the forward pass's where it went through ReLU; `stats`
/// what it returned.
#[inline(always)]
#[allow(clippy::too_many_arguments)] // one per tensor of the formula
pub(crate) fn backward(
    s: &Shape,
    x: &[f32],
    gamma: &[f32],
    stats: &[(f32, f32)],
    output: Option<&[f32]>,
    grad: &mut [f32],
    d_gamma: &mut [f32],
    d_beta: &mut [f32],
) {
    d_gamma.fill(0.0);
    d_beta.fill(0.0);
    let len = s.group_len();
    for ((i, group, channels), &(mean, rstd)) in groups(s, x).zip(stats) {
        let dy = &mut grad[i * len..][..len];
        if let Some(output) = output {
            relu_mask(dy, &output[i * len..][..len]);
        }
        // Σ ĝ and Σ ĝ·x̂ over the group, and each channel's sums for γ, β.
        let (mut sum_g, mut sum_gx) = (0.0f64, 0.0f64);
        let rows = group
            .chunks_exact(s.spatial)
            .zip(dy.chunks_exact(s.spatial));
        for ((src, dy), c) in rows.zip(channels.clone()) {
            let dy_sum = lane_sum(dy, |d| d);
            let dyx_sum = row_dot(src, dy, mean, rstd);
            d_beta[c] += dy_sum;
            d_gamma[c] += dyx_sum;
            sum_g += (gamma[c] * dy_sum) as f64;
            sum_gx += (gamma[c] * dyx_sum) as f64;
        }
        let n = len.max(1) as f64;
        let (mean_g, mean_gx) = ((sum_g / n) as f32, (sum_gx / n) as f32);
        let rows = group
            .chunks_exact(s.spatial)
            .zip(dy.chunks_exact_mut(s.spatial));
        for ((src, dy), c) in rows.zip(channels) {
            for (d, &v) in dy.iter_mut().zip(src) {
                let xhat = (v - mean) * rstd;
                *d = (gamma[c] * *d - mean_g - xhat * mean_gx) * rstd;
            }
        }
    }
}

/// GroupNorm on burn's CPU backend, with or without autodiff.
#[backend_extension(Flex, Autodiff)]
pub trait NativeGroupNorm: Backend {
    /// `x` `[B, C, …]` normalized in `groups` groups, scaled by `gamma`
    /// and shifted by `beta` (`[C]`), and through ReLU where `relu`.
    fn native_group_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        groups: usize,
        epsilon: f64,
        relu: bool,
    ) -> FloatTensor<Self>;
}

/// `norm.forward(x)`, through cohort's kernel where it applies (float32 on
/// burn's CPU device with the native kernels on, an affine GroupNorm), else
/// through burn's.
pub fn group_norm(norm: &GroupNorm, x: Tensor<4>) -> Tensor<4> {
    group_norm_with(norm, x, false)
}

/// `relu(norm.forward(x))` as one operation where [`group_norm`]'s kernel
/// applies: the ReLU's pass over the output, and its pass back, are folded
/// into the normalization's.
pub fn group_norm_relu(norm: &GroupNorm, x: Tensor<4>) -> Tensor<4> {
    group_norm_with(norm, x, true)
}

fn group_norm_with(norm: &GroupNorm, x: Tensor<4>, relu: bool) -> Tensor<4> {
    let burns = |x: Tensor<4>| {
        let y = norm.forward(x);
        if relu { activation::relu(y) } else { y }
    };
    let (Some(gamma), Some(beta)) = (&norm.gamma, &norm.beta) else {
        return burns(x);
    };
    let channels = x.dims()[1];
    if !super::enabled_on(&x.device())
        || x.dtype() != DType::F32
        || channels != norm.num_channels
        || norm.num_groups == 0
        || !channels.is_multiple_of(norm.num_groups)
    {
        return burns(x);
    }
    type D = burn::backend::Dispatch;
    Tensor::from_dispatch(<D as NativeGroupNorm>::native_group_norm(
        x.into_dispatch(),
        gamma.val().into_dispatch(),
        beta.val().into_dispatch(),
        norm.num_groups,
        norm.epsilon,
        relu,
    ))
}

fn shape_of(x: &FlexTensor, groups: usize, epsilon: f64) -> (Shape, Vec<usize>) {
    let [batch, channels, h, w] = x.layout().shape().dims();
    let shape = Shape {
        batch,
        channels,
        spatial: h * w,
        groups,
        epsilon,
    };
    (shape, vec![batch, channels, h, w])
}

/// The normalized `x` (through ReLU where `relu`) and the statistics it
/// was normalized by, which the way back reuses.
fn normalize(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    groups: usize,
    epsilon: f64,
    relu: bool,
) -> (FlexTensor, Vec<(f32, f32)>) {
    let (s, dims) = shape_of(&x, groups, epsilon);
    let (x, gamma, beta) = (
        x.to_contiguous(),
        gamma.to_contiguous(),
        beta.to_contiguous(),
    );
    let mut out = Vec::with_capacity(host(&x).len());
    let stats = super::simd::dispatch(
        #[inline(always)]
        || forward(&s, host(&x), host(&gamma), host(&beta), relu, &mut out),
    );
    (tensor(out, dims), stats)
}

impl NativeGroupNorm for Flex {
    fn native_group_norm(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        groups: usize,
        epsilon: f64,
        relu: bool,
    ) -> FlexTensor {
        normalize(x, gamma, beta, groups, epsilon, relu).0
    }
}

#[derive(Debug, Clone)]
struct Saved {
    x: NodeId,
    gamma: NodeId,
    groups: usize,
    epsilon: f64,
    stats: Vec<(f32, f32)>,
    /// The output, where it went through ReLU: the tensor the next layer
    /// keeps as its input anyway.
    relu_output: Option<FlexTensor>,
}

#[derive(Debug)]
struct GroupNormBackward;

impl Backward<Flex, 3> for GroupNormBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let mut d_x = owned(grads.consume::<Flex>(&ops.node));
        let saved = ops.state;
        let x = checkpointer.retrieve_node_output::<FlexTensor>(saved.x);
        let gamma = checkpointer.retrieve_node_output::<FlexTensor>(saved.gamma);
        let (s, _) = shape_of(&x, saved.groups, saved.epsilon);
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

impl<C: CheckpointStrategy> NativeGroupNorm for Autodiff<Flex, C> {
    fn native_group_norm(
        x: AdTensor,
        gamma: AdTensor,
        beta: AdTensor,
        groups: usize,
        epsilon: f64,
        relu: bool,
    ) -> AdTensor {
        let forward = || {
            let (p, g, b) = (
                x.primitive().clone(),
                gamma.primitive().clone(),
                beta.primitive().clone(),
            );
            normalize(p, g, b, groups, epsilon, relu)
        };
        match GroupNormBackward
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let (output, stats) = forward();
                let state = Saved {
                    x: prep.checkpoint(&x),
                    gamma: prep.checkpoint(&gamma),
                    groups,
                    epsilon,
                    stats,
                    relu_output: relu.then(|| output.clone()),
                };
                prep.finish(state, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward().0),
        }
    }
}

#[cfg(test)]
mod tests {
    //! Against burn-nn's GroupNorm under autodiff, on random inputs and
    //! parameters: output and every gradient to `2e-5` of the largest
    //! magnitude of burn's values (the sums differ only in order and in the
    //! f64 statistics), the same bits twice, and the folded ReLU's bits
    //! those of burn's ReLU after the kernel.

    use crate::kernels::flex::testing::{assert_close, values as host};
    use burn::module::Param;
    use burn::nn::GroupNormConfig;
    use burn::tensor::activation::relu;
    use burn::tensor::{Tensor, TensorData};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    /// How [`run`] computes the layer.
    #[derive(Clone, Copy, PartialEq)]
    enum Through {
        Burn,
        Native,
        /// cohort's kernel, then burn's ReLU.
        NativeThenRelu,
        /// cohort's kernel with the ReLU folded in.
        NativeRelu,
    }

    /// Output, input, γ and β gradients of one GroupNorm.
    fn run(shape: [usize; 4], groups: usize, seed: u64, through: Through) -> Vec<Vec<f32>> {
        let device = crate::device::cpu().autodiff();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let channels = shape[1];
        let mut norm = GroupNormConfig::new(groups, channels).init(&device);
        let param = |rng: &mut ChaCha8Rng| {
            let values = random(channels, rng);
            Param::from_tensor(Tensor::<1>::from_data(
                TensorData::new(values, [channels]),
                &device,
            ))
        };
        norm.gamma = Some(param(&mut rng));
        norm.beta = Some(param(&mut rng));
        let len = shape.iter().product();
        let x = Tensor::<4>::from_data(TensorData::new(random(len, &mut rng), shape), &device)
            .require_grad();
        let out = match through {
            Through::Burn => norm.forward(x.clone()),
            Through::Native => super::group_norm(&norm, x.clone()),
            Through::NativeThenRelu => relu(super::group_norm(&norm, x.clone())),
            Through::NativeRelu => super::group_norm_relu(&norm, x.clone()),
        };
        let r = Tensor::<4>::from_data(TensorData::new(random(len, &mut rng), shape), &device);
        let grads = (out.clone() * r).sum().backward();
        let grad =
            |p: &Option<Param<Tensor<1>>>| host(p.as_ref().unwrap().val().grad(&grads).unwrap());
        vec![
            host(out),
            host(x.grad(&grads).unwrap()),
            grad(&norm.gamma),
            grad(&norm.beta),
        ]
    }

    #[test]
    fn output_and_gradients_match_burns_group_norm() {
        let cases = [
            ([2, 16, 8, 8], 2),
            ([3, 6, 5, 7], 3),
            ([1, 4, 1, 1], 4),
            ([4, 64, 4, 4], 1),
            ([2, 32, 16, 16], 2),
        ];
        for (i, (shape, groups)) in cases.into_iter().enumerate() {
            let ours = run(shape, groups, i as u64, Through::Native);
            let theirs = run(shape, groups, i as u64, Through::Burn);
            for (what, (a, b)) in [
                "output",
                "input gradient",
                "gamma gradient",
                "beta gradient",
            ]
            .iter()
            .zip(ours.iter().zip(&theirs))
            {
                assert_close(
                    a,
                    b,
                    2e-5,
                    &format!("{what} of {shape:?} in {groups} groups"),
                );
            }
        }
    }

    fn bits(r: Vec<Vec<f32>>) -> Vec<Vec<u32>> {
        r.iter()
            .map(|v| v.iter().map(|f| f.to_bits()).collect())
            .collect()
    }

    #[test]
    fn the_same_inputs_give_the_same_bits() {
        let first = bits(run([4, 16, 8, 8], 2, 7, Through::Native));
        assert_eq!(first, bits(run([4, 16, 8, 8], 2, 7, Through::Native)));
    }

    /// The folded ReLU changes where values are computed, not how: the
    /// output and every gradient are those of burn's ReLU after the kernel,
    /// bit for bit (and a ReLU that stopped nothing would fail the check
    /// on the zeros it must write).
    #[test]
    fn relu_folded_in_gives_the_bits_of_relu_after() {
        for (i, (shape, groups)) in [([2, 16, 8, 8], 2), ([3, 6, 5, 7], 3), ([2, 8, 1, 1], 4)]
            .into_iter()
            .enumerate()
        {
            let folded = run(shape, groups, i as u64, Through::NativeRelu);
            let after = run(shape, groups, i as u64, Through::NativeThenRelu);
            assert!(
                folded[0].contains(&0.0) && folded[0].iter().any(|&v| v > 0.0),
                "{shape:?}"
            );
            assert_eq!(bits(folded), bits(after), "{shape:?} in {groups} groups");
        }
    }
}
