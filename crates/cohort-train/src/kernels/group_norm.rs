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
use burn::tensor::{DType, Tensor};

use super::flex::{host, register_gradients, tensor};

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

#[inline(always)]
pub(crate) fn forward(s: &Shape, x: &[f32], gamma: &[f32], beta: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), s.batch * s.channels * s.spatial, "input length");
    assert_eq!(out.len(), x.len(), "output length");
    for (i, group, channels) in groups(s, x) {
        let (mean, rstd) = statistics(group, s.epsilon);
        let dst = &mut out[i * s.group_len()..][..s.group_len()];
        let rows = group
            .chunks_exact(s.spatial)
            .zip(dst.chunks_exact_mut(s.spatial));
        for ((src, dst), c) in rows.zip(channels) {
            let (scale, shift) = (gamma[c] * rstd, beta[c] - gamma[c] * rstd * mean);
            for (d, &v) in dst.iter_mut().zip(src) {
                *d = v * scale + shift;
            }
        }
    }
}

/// The gradients of [`forward`]: `d_x` overwritten, `d_gamma` and `d_beta`
/// (`[C]`) overwritten.
#[inline(always)]
pub(crate) fn backward(
    s: &Shape,
    x: &[f32],
    gamma: &[f32],
    d_out: &[f32],
    d_x: &mut [f32],
    d_gamma: &mut [f32],
    d_beta: &mut [f32],
) {
    d_gamma.fill(0.0);
    d_beta.fill(0.0);
    let len = s.group_len();
    for (i, group, channels) in groups(s, x) {
        let (mean, rstd) = statistics(group, s.epsilon);
        let dy = &d_out[i * len..][..len];
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
        let dst = &mut d_x[i * len..][..len];
        let rows = group
            .chunks_exact(s.spatial)
            .zip(dy.chunks_exact(s.spatial));
        for (((src, dy), dst), c) in rows.zip(dst.chunks_exact_mut(s.spatial)).zip(channels) {
            for ((d, &v), &g) in dst.iter_mut().zip(src).zip(dy) {
                let xhat = (v - mean) * rstd;
                *d = (gamma[c] * g - mean_g - xhat * mean_gx) * rstd;
            }
        }
    }
}

/// GroupNorm on burn's CPU backend, with or without autodiff.
#[backend_extension(Flex, Autodiff)]
pub trait NativeGroupNorm: Backend {
    /// `x` `[B, C, …]` normalized in `groups` groups, scaled by `gamma`
    /// and shifted by `beta` (`[C]`).
    fn native_group_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        groups: usize,
        epsilon: f64,
    ) -> FloatTensor<Self>;
}

/// `norm.forward(x)`, through cohort's kernel where it applies (float32 on
/// burn's CPU device with the native kernels on, an affine GroupNorm), else
/// through burn's.
pub fn group_norm(norm: &GroupNorm, x: Tensor<4>) -> Tensor<4> {
    let (Some(gamma), Some(beta)) = (&norm.gamma, &norm.beta) else {
        return norm.forward(x);
    };
    let channels = x.dims()[1];
    if !super::enabled_on(&x.device())
        || x.dtype() != DType::F32
        || channels != norm.num_channels
        || norm.num_groups == 0
        || !channels.is_multiple_of(norm.num_groups)
    {
        return norm.forward(x);
    }
    type D = burn::backend::Dispatch;
    Tensor::from_dispatch(<D as NativeGroupNorm>::native_group_norm(
        x.into_dispatch(),
        gamma.val().into_dispatch(),
        beta.val().into_dispatch(),
        norm.num_groups,
        norm.epsilon,
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

impl NativeGroupNorm for Flex {
    fn native_group_norm(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        groups: usize,
        epsilon: f64,
    ) -> FlexTensor {
        let (s, dims) = shape_of(&x, groups, epsilon);
        let (x, gamma, beta) = (
            x.to_contiguous(),
            gamma.to_contiguous(),
            beta.to_contiguous(),
        );
        let mut out = vec![0.0f32; host(&x).len()];
        super::simd::dispatch(
            #[inline(always)]
            || forward(&s, host(&x), host(&gamma), host(&beta), &mut out),
        );
        tensor(out, dims)
    }
}

#[derive(Debug, Clone)]
struct Saved {
    x: NodeId,
    gamma: NodeId,
    groups: usize,
    epsilon: f64,
}

#[derive(Debug)]
struct GroupNormBackward;

impl Backward<Flex, 3> for GroupNormBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node).to_contiguous();
        let saved = ops.state;
        let x = checkpointer.retrieve_node_output::<FlexTensor>(saved.x);
        let gamma = checkpointer.retrieve_node_output::<FlexTensor>(saved.gamma);
        let (s, dims) = shape_of(&x, saved.groups, saved.epsilon);
        let (x, gamma) = (x.to_contiguous(), gamma.to_contiguous());
        let mut d_x = vec![0.0f32; host(&x).len()];
        let (mut d_gamma, mut d_beta) = (vec![0.0f32; s.channels], vec![0.0f32; s.channels]);
        super::simd::dispatch(
            #[inline(always)]
            || {
                backward(
                    &s,
                    host(&x),
                    host(&gamma),
                    host(&grad),
                    &mut d_x,
                    &mut d_gamma,
                    &mut d_beta,
                )
            },
        );
        let gradients = [
            (Some(d_x), dims),
            (Some(d_gamma), vec![s.channels]),
            (Some(d_beta), vec![s.channels]),
        ];
        register_gradients(grads, ops.parents.map(|p| p.map(|n| n.id)), gradients);
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
    ) -> AdTensor {
        let forward = || {
            let (p, g, b) = (
                x.primitive().clone(),
                gamma.primitive().clone(),
                beta.primitive().clone(),
            );
            Flex::native_group_norm(p, g, b, groups, epsilon)
        };
        match GroupNormBackward
            .prepare::<C>([x.node(), gamma.node(), beta.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = Saved {
                    x: prep.checkpoint(&x),
                    gamma: prep.checkpoint(&gamma),
                    groups,
                    epsilon,
                };
                prep.finish(state, forward())
            }
            OpsKind::UnTracked(prep) => prep.finish(forward()),
        }
    }
}

#[cfg(test)]
mod tests {
    //! Against burn-nn's GroupNorm under autodiff, on random inputs and
    //! parameters: output and every gradient to `2e-5` of the largest
    //! magnitude of burn's values (the sums differ only in order and in the
    //! f64 statistics), and the same bits twice.

    use crate::kernels::flex::testing::{assert_close, values as host};
    use burn::module::Param;
    use burn::nn::GroupNormConfig;
    use burn::tensor::{Tensor, TensorData};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect()
    }

    /// Output, input, γ and β gradients of one GroupNorm through `native` or burn's.
    fn run(shape: [usize; 4], groups: usize, seed: u64, native: bool) -> Vec<Vec<f32>> {
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
        let out = if native {
            super::group_norm(&norm, x.clone())
        } else {
            norm.forward(x.clone())
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
            let ours = run(shape, groups, i as u64, true);
            let theirs = run(shape, groups, i as u64, false);
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

    #[test]
    fn the_same_inputs_give_the_same_bits() {
        let bits = |r: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
            r.iter()
                .map(|v| v.iter().map(|f| f.to_bits()).collect())
                .collect()
        };
        let first = bits(run([4, 16, 8, 8], 2, 7, true));
        assert_eq!(first, bits(run([4, 16, 8, 8], 2, 7, true)));
    }
}
