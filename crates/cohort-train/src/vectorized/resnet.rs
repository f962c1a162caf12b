//! `resnet_20` with GroupNorm, stacked: K clients' ResNets as one batched
//! computation, the model of `model::resnet_20` (He et al.'s CIFAR ResNet,
//! option-A shortcuts) layer for layer.
//!
//! The same formulation as the sequential nets ([`super::net`]): activations
//! channels-last (`[N, h·w·c]`), a convolution an im2col gather and one
//! product per client, the backward pass written out so that no step
//! scatters. What a ResNet adds:
//!
//! * **GroupNorm per client.** Each sample is normalized over the positions
//!   and channels of each of its groups (`[N, positions, groups, c/groups]`),
//!   which does not mix clients; the scale and shift are `[K, 1, c]`, one
//!   per client. Its gradient is GroupNorm's usual closed form (see
//!   `kernels::group_norm`).
//! * **Residual blocks.** The block's output gradient flows into both the
//!   convolutions and the shortcut, whose input gradients add.
//! * **Option A's shortcut** (subsample, zero channels on both sides) is a
//!   1×1 gather with the block's stride; its gradient keeps the middle
//!   channels and gathers them back, like a convolution's input gradient.
//!
//! BatchNorm is not stacked: its running statistics are state outside the
//! parameters, and `norm = "batch"` trains alone.

use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use super::net::{Gather, Layout, Param, Shape, conv_weight_grad, sum_rows};
use super::product::{Role, product};

/// Channels of the three stages, as `model::resnet_20`.
const WIDTHS: [usize; 3] = [16, 32, 64];
/// Blocks per stage.
const BLOCKS: usize = 3;
/// GroupNorm's ε (PyTorch's and burn's default, and the model's).
const EPSILON: f32 = 1e-5;
/// Parameters of a convolution and its normalization: weight, scale, shift.
const CONV_NORM: usize = 3;

/// A 3×3 convolution without bias, then GroupNorm.
struct ConvNorm {
    /// The tree's names of the convolution and of the normalization.
    conv: String,
    norm: String,
    gather: Gather,
    channels: usize,
    groups: usize,
}

/// What the backward pass needs of a [`ConvNorm`].
struct ConvSaved {
    /// `[K, B·positions, fan_in]`.
    patches: Tensor<3>,
    /// `[K, B·positions, c]`: the normalized values, before scale and shift.
    normalized: Tensor<3>,
    /// `[N, 1, groups, 1]`: `1 / √(σ² + ε)` of each sample's groups.
    inv_std: Tensor<4>,
}

impl ConvNorm {
    fn new(names: (String, String), input: Shape, output: Output, device: &Device) -> Self {
        Self {
            conv: names.0,
            norm: names.1,
            gather: Gather::new(input, 3, output.stride, 1, output.layout, device),
            channels: output.channels,
            groups: output.groups,
        }
    }

    /// Elements of a sample's output.
    fn outputs(&self) -> usize {
        self.gather.positions() * self.channels
    }

    fn params(&self) -> [Param; CONV_NORM] {
        let fan_in = self.gather.fan_in;
        [
            Param::weight(
                &self.conv,
                fan_in,
                self.channels,
                &[self.channels, fan_in / 9, 3, 3],
            ),
            Param::vector(format!("{}.weight", self.norm), self.channels),
            Param::vector(format!("{}.bias", self.norm), self.channels),
        ]
    }

    /// `[K, B·positions, c]` normalized outputs of `x` (`[N, inputs]`).
    fn forward(&self, params: &[Tensor<3>], x: Tensor<2>, k: usize) -> (Tensor<3>, ConvSaved) {
        let n = x.dims()[0];
        let patches = self.gather.patches(x, k);
        let z = patches.clone().matmul(params[0].clone());
        let (y, normalized, inv_std) = group_norm(z, &params[1], &params[2], n, self.groups);
        let saved = ConvSaved {
            patches,
            normalized,
            inv_std,
        };
        (y, saved)
    }

    /// Fills `grads` (weight, scale, shift) from the output's gradient
    /// `y_grad` (`[K, B·positions, c]`); returns the product's gradient,
    /// from which [`ConvNorm::input_gradient`] continues.
    fn parameter_gradients(
        &self,
        params: &[Tensor<3>],
        saved: ConvSaved,
        y_grad: Tensor<3>,
        grads: &mut [Option<Tensor<3>>],
    ) -> Tensor<3> {
        let n = saved.inv_std.dims()[0];
        let k = y_grad.dims()[0];
        let (z_grad, scale_grad, shift_grad) = group_norm_backward(
            y_grad,
            &params[1],
            saved.normalized,
            saved.inv_std,
            self.groups,
        );
        let positions = self.gather.positions();
        grads[0] = Some(conv_weight_grad(&saved.patches, &z_grad, n / k, positions));
        grads[1] = Some(scale_grad);
        grads[2] = Some(shift_grad);
        z_grad
    }

    /// The input's gradient (`[N, inputs]`) from the product's `z_grad`.
    fn input_gradient(&self, params: &[Tensor<3>], z_grad: Tensor<3>) -> Tensor<2> {
        let [k, rows, _] = z_grad.dims();
        let n = k * (rows / self.gather.positions());
        let patches_grad = product(
            z_grad,
            params[0].clone().swap_dims(1, 2),
            Role::ConvInputGradient,
        )
        .reshape([n, self.gather.positions() * self.gather.fan_in]);
        self.gather.col2im(patches_grad, n)
    }
}

/// What a [`ConvNorm`] makes of its input.
#[derive(Clone, Copy)]
struct Output {
    channels: usize,
    stride: usize,
    groups: usize,
    /// The input's layout.
    layout: Layout,
}

/// He et al.'s option A: the input subsampled by the block's stride and
/// zero-padded by `pad` channels on each side.
struct Subsample {
    gather: Gather,
    pad: usize,
    input_channels: usize,
}

/// A basic block: conv, norm, ReLU, conv, norm, plus the shortcut, ReLU.
struct Block {
    first: ConvNorm,
    second: ConvNorm,
    /// `None`: the identity.
    shortcut: Option<Subsample>,
}

struct BlockSaved {
    first: ConvSaved,
    /// `[K, B·positions, c]`: 1 where the first ReLU is open.
    first_open: Tensor<3>,
    second: ConvSaved,
    /// The same for the block's output ReLU.
    open: Tensor<3>,
}

impl Block {
    fn forward(&self, params: &[Tensor<3>], x: Tensor<2>, k: usize) -> (Tensor<2>, BlockSaved) {
        let n = x.dims()[0];
        let (y, first) = self.first.forward(&params[..CONV_NORM], x.clone(), k);
        let first_open = y.clone().greater_elem(0.0).float();
        let hidden = relu(y).reshape([n, self.first.outputs()]);
        let (y, second) = self.second.forward(&params[CONV_NORM..], hidden, k);
        let sum = y + self.shortcut(x, k);
        let open = sum.clone().greater_elem(0.0).float();
        let saved = BlockSaved {
            first,
            first_open,
            second,
            open,
        };
        (relu(sum).reshape([n, self.second.outputs()]), saved)
    }

    /// `[K, B·positions, c]`: what the shortcut adds to the block's output.
    fn shortcut(&self, x: Tensor<2>, k: usize) -> Tensor<3> {
        let rows = x.dims()[0] / k * self.second.gather.positions();
        let Some(subsample) = &self.shortcut else {
            return x.reshape([k, rows, self.second.channels]);
        };
        let kept = subsample.gather.patches(x, k);
        let zeros = Tensor::<3>::zeros([k, rows, subsample.pad], &kept.device());
        Tensor::cat(vec![zeros.clone(), kept, zeros], 2)
    }

    /// The block input's gradient (`[N, inputs]`) from its output's
    /// (`[N, outputs]`); fills the block's six gradients.
    fn backward(
        &self,
        params: &[Tensor<3>],
        saved: BlockSaved,
        upstream: Tensor<2>,
        grads: &mut [Option<Tensor<3>>],
    ) -> Tensor<2> {
        let [k, rows, channels] = saved.open.dims();
        let n = upstream.dims()[0];
        let sum_grad = upstream.reshape([k, rows, channels]) * saved.open;
        let (first_grads, second_grads) = grads.split_at_mut(CONV_NORM);
        let (first_params, second_params) = params.split_at(CONV_NORM);
        let z_grad = self.second.parameter_gradients(
            second_params,
            saved.second,
            sum_grad.clone(),
            second_grads,
        );
        let hidden_grad = self.second.input_gradient(second_params, z_grad);
        let [_, first_rows, first_channels] = saved.first_open.dims();
        let y_grad = hidden_grad.reshape([k, first_rows, first_channels]) * saved.first_open;
        let z_grad = self
            .first
            .parameter_gradients(first_params, saved.first, y_grad, first_grads);
        let main = self.first.input_gradient(first_params, z_grad);
        let shortcut = match &self.shortcut {
            None => sum_grad.reshape([n, rows / (n / k) * channels]),
            Some(subsample) => {
                let kept = sum_grad.narrow(2, subsample.pad, subsample.input_channels);
                let positions = subsample.gather.positions();
                let kept = kept.reshape([n, positions * subsample.input_channels]);
                subsample.gather.col2im(kept, n)
            }
        };
        main + shortcut
    }
}

/// The stacked `resnet_20` with GroupNorm.
pub(crate) struct ResNet {
    stem: ConvNorm,
    blocks: Vec<Block>,
    classes: usize,
}

/// What [`ResNet::backward`] needs of a forward pass.
pub(crate) struct Tape {
    stem: ConvSaved,
    stem_open: Tensor<3>,
    blocks: Vec<BlockSaved>,
    /// `[K, B, 64]`: the pooled features the linear layer reads.
    features: Tensor<3>,
}

impl ResNet {
    /// For images of `image` (`[channels, height, width]`, any size: a
    /// stride-2 layer keeps the odd row, as PyTorch's does) and GroupNorm
    /// with `groups`, which divides every width (checked by the model).
    pub(crate) fn new(groups: usize, classes: usize, image: [usize; 3], device: &Device) -> Self {
        let [channels, h, w] = image;
        let input = Shape { h, w, c: channels };
        let output = |channels, stride, layout| Output {
            channels,
            stride,
            groups,
            layout,
        };
        let stem = ConvNorm::new(
            ("conv1".into(), "bn1".into()),
            input,
            output(WIDTHS[0], 1, Layout::ChannelsFirst),
            device,
        );
        let mut shape = stem.gather.output(WIDTHS[0]);
        let mut blocks = Vec::with_capacity(WIDTHS.len() * BLOCKS);
        for (stage, &width) in WIDTHS.iter().enumerate() {
            for index in 0..BLOCKS {
                let stride = if stage > 0 && index == 0 { 2 } else { 1 };
                let name = |layer: &str| format!("layer{}.{index}.{layer}", stage + 1);
                let layout = Layout::ChannelsLast;
                let first = ConvNorm::new(
                    (name("conv1"), name("bn1")),
                    shape,
                    output(width, stride, layout),
                    device,
                );
                let after = first.gather.output(width);
                let second = ConvNorm::new(
                    (name("conv2"), name("bn2")),
                    after,
                    output(width, 1, layout),
                    device,
                );
                let shortcut = (stride != 1 || shape.c != width).then(|| Subsample {
                    gather: Gather::new(shape, 1, stride, 0, layout, device),
                    pad: (width - shape.c) / 2,
                    input_channels: shape.c,
                });
                blocks.push(Block {
                    first,
                    second,
                    shortcut,
                });
                shape = after;
            }
        }
        Self {
            stem,
            blocks,
            classes,
        }
    }

    pub(crate) fn classes(&self) -> usize {
        self.classes
    }

    fn width() -> usize {
        WIDTHS[WIDTHS.len() - 1]
    }

    /// Positions of the last block's output, which the pooling averages.
    fn pooled_positions(&self) -> usize {
        let last = self.blocks.last().map_or(&self.stem, |b| &b.second);
        last.gather.positions()
    }

    fn conv_norms(&self) -> impl Iterator<Item = &ConvNorm> {
        std::iter::once(&self.stem).chain(self.blocks.iter().flat_map(|b| [&b.first, &b.second]))
    }

    /// The stem's three, each block's six, then the linear layer's weight
    /// and bias.
    pub(crate) fn params(&self) -> Vec<Param> {
        let mut params: Vec<Param> = self.conv_norms().flat_map(ConvNorm::params).collect();
        let width = Self::width();
        params.push(Param::weight(
            "linear",
            width,
            self.classes,
            &[self.classes, width],
        ));
        params.push(Param::vector("linear.bias".into(), self.classes));
        params
    }

    fn linear_at(&self) -> usize {
        CONV_NORM * (1 + 2 * self.blocks.len())
    }

    pub(crate) fn forward_train(
        &self,
        params: &[Tensor<3>],
        images: Tensor<2>,
        k: usize,
    ) -> (Tensor<3>, Tape) {
        let n = images.dims()[0];
        let (y, stem) = self.stem.forward(&params[..CONV_NORM], images, k);
        let stem_open = y.clone().greater_elem(0.0).float();
        let mut x = relu(y).reshape([n, self.stem.outputs()]);
        let mut saved = Vec::with_capacity(self.blocks.len());
        let block_params = params[CONV_NORM..self.linear_at()].chunks(2 * CONV_NORM);
        for (block, params) in self.blocks.iter().zip(block_params) {
            let (output, block_saved) = block.forward(params, x, k);
            x = output;
            saved.push(block_saved);
        }
        let (positions, width) = (self.pooled_positions(), Self::width());
        let features = x
            .reshape([n, positions, width])
            .mean_dim(1)
            .reshape([k, n / k, width]);
        let linear = &params[self.linear_at()..];
        let logits = features.clone().matmul(linear[0].clone()) + linear[1].clone();
        let tape = Tape {
            stem,
            stem_open,
            blocks: saved,
            features,
        };
        (logits, tape)
    }

    pub(crate) fn backward(
        &self,
        params: &[Tensor<3>],
        tape: Tape,
        logits_grad: Tensor<3>,
    ) -> Vec<Tensor<3>> {
        let [k, batch, _] = logits_grad.dims();
        let n = k * batch;
        let mut grads: Vec<Option<Tensor<3>>> = vec![None; params.len()];
        let at = self.linear_at();
        grads[at] = Some(product(
            tape.features.swap_dims(1, 2),
            logits_grad.clone(),
            Role::LinearWeightGradient,
        ));
        grads[at + 1] = Some(logits_grad.clone().sum_dim(1));
        let (positions, width) = (self.pooled_positions(), Self::width());
        let features_grad = product(
            logits_grad,
            params[at].clone().swap_dims(1, 2),
            Role::LinearInputGradient,
        );
        let mut upstream = features_grad
            .reshape([n, 1, width])
            .div_scalar(positions as f32)
            .repeat_dim(1, positions)
            .reshape([n, positions * width]);
        let blocks = self.blocks.iter().zip(tape.blocks).enumerate().rev();
        for (index, (block, saved)) in blocks {
            let start = CONV_NORM + 2 * CONV_NORM * index;
            let range = start..start + 2 * CONV_NORM;
            upstream = block.backward(&params[range.clone()], saved, upstream, &mut grads[range]);
        }
        let [_, rows, channels] = tape.stem_open.dims();
        let y_grad = upstream.reshape([k, rows, channels]) * tape.stem_open;
        let stem_grads = &mut grads[..CONV_NORM];
        // The images' gradient is not needed.
        self.stem
            .parameter_gradients(&params[..CONV_NORM], tape.stem, y_grad, stem_grads);
        grads
            .into_iter()
            .map(|g| g.expect("every parameter has its gradient"))
            .collect()
    }

    /// Per sample, for each convolution: its patches, and the outputs a step
    /// keeps or makes beside them (the product, normalized values, scaled
    /// output, ReLU and its gate, a block's sum).
    pub(crate) fn activation_elements(&self) -> usize {
        self.conv_norms()
            .map(|layer| layer.gather.positions() * layer.gather.fan_in + 6 * layer.outputs())
            .sum()
    }

    pub(crate) fn largest_tensor_elements(&self, batch: usize) -> usize {
        self.conv_norms()
            .map(|layer| {
                (batch * layer.gather.largest_per_sample())
                    .max(layer.gather.fan_in * layer.channels)
            })
            .max()
            .unwrap_or(0)
    }
}

/// GroupNorm of the product `z` (`[K, B·positions, c]`) with each client's
/// `scale` and `shift` (`[K, 1, c]`): the output, the normalized values and
/// `1 / √(σ² + ε)` of each sample's groups (`[N, 1, groups, 1]`).
fn group_norm(
    z: Tensor<3>,
    scale: &Tensor<3>,
    shift: &Tensor<3>,
    n: usize,
    groups: usize,
) -> (Tensor<3>, Tensor<3>, Tensor<4>) {
    let [k, rows, channels] = z.dims();
    let grouped = z.reshape([n, rows * k / n, groups, channels / groups]);
    let mean = grouped.clone().mean_dim(3).mean_dim(1);
    let centered = grouped - mean;
    let variance = centered.clone().square().mean_dim(3).mean_dim(1);
    let inv_std = variance.add_scalar(EPSILON).sqrt().recip();
    let normalized = (centered * inv_std.clone()).reshape([k, rows, channels]);
    let y = normalized.clone() * scale.clone() + shift.clone();
    (y, normalized, inv_std)
}

/// GroupNorm's way back: with `ĝ = scale · dy`, over each sample's group,
/// `dz = (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂)) / √(σ² + ε)`; the scale's
/// gradient `Σ dy · x̂` and the shift's `Σ dy` over each client's samples
/// and positions.
fn group_norm_backward(
    y_grad: Tensor<3>,
    scale: &Tensor<3>,
    normalized: Tensor<3>,
    inv_std: Tensor<4>,
    groups: usize,
) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
    let [k, rows, channels] = y_grad.dims();
    let n = inv_std.dims()[0];
    let grouped = [n, rows * k / n, groups, channels / groups];
    let scale_grad = sum_rows(y_grad.clone() * normalized.clone());
    let shift_grad = sum_rows(y_grad.clone());
    let scaled = (y_grad * scale.clone()).reshape(grouped);
    let normalized = normalized.reshape(grouped);
    let mean = scaled.clone().mean_dim(3).mean_dim(1);
    let correlation = (scaled.clone() * normalized.clone())
        .mean_dim(3)
        .mean_dim(1);
    let z_grad = (scaled - mean - normalized * correlation) * inv_std;
    (z_grad.reshape([k, rows, channels]), scale_grad, shift_grad)
}
