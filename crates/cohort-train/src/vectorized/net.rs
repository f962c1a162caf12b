//! The stackable models (the LeNets, McMahan et al.'s CNN, the multilayer
//! perceptron; `resnet_20` in [`super::resnet`]) with a leading client
//! dimension: K clients' weights stacked, one batched computation for all
//! of them.
//!
//! Every layer is a matrix product per client: a convolution is an im2col
//! gather (`select` with a fixed index per output position, padding read from
//! an appended zero column) followed by `[K, B·L, Cin·k²] × [K, Cin·k², Cout]`,
//! a linear layer `[K, B, in] × [K, in, out]`. Activations stay channels-last
//! (`[N, H, W, C]`, N = K·B), so no permutation is needed between layers and a
//! 2×2 max-pool is two `max_dim` on a reshaped view.
//!
//! The backward pass is written out ([`StackedNet::backward`]) rather than
//! recorded by autodiff: every step of it is a gather, a matrix product or
//! an elementwise product, none a scatter.
//!
//! Why not burn's grouped `conv2d` (clients stacked along channels,
//! `groups = K`): its weight gradient on burn-cubecl (the wgpu backend)
//! launches one kernel per group (`conv_weight_grad_groups` in
//! `kernel/conv/backward_weight/fallback.rs`; the implicit-GEMM path refuses
//! `groups != 1`), and so does burn's default on flex
//! (`conv2d_weight_grad_groups` in burn-backend). With K = 100 that is
//! hundreds of launches per step; the formulation here launches the same
//! number of kernels whatever K is.
//!
//! Parameters are stored as `weight [K, fan_in, fan_out]` and
//! `bias [K, 1, fan_out]`: PyTorch's `[out, in, …]` weight flattened to
//! `[out, fan_in]` and transposed, with `fan_in` in PyTorch's `(c, ky, kx)`
//! order, so a client's slice converts to the tree's layout by a transpose.

use super::product::{Role, product};
use super::resnet::ResNet;
use crate::model::{LeNetVariant, Stackable};
use burn::tensor::activation::{relu, tanh};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// A stacked network: what the vectorized trainer asks of one.
pub(crate) enum StackedNet {
    Sequential(Sequential),
    ResNet(Box<ResNet>),
}

/// What a stacked network's forward pass keeps for its backward pass.
pub(crate) enum Tape {
    Sequential(Vec<Saved>),
    ResNet(Box<super::resnet::Tape>),
}

impl StackedNet {
    /// The stacked form of `model` for inputs of `image` (`[channels,
    /// height, width]`; `[1, 1, values]` for rows that are not images).
    pub(crate) fn new(
        model: &Stackable,
        classes: usize,
        image: [usize; 3],
        device: &Device,
    ) -> Self {
        match model {
            Stackable::ResNet20 { groups } => {
                Self::ResNet(Box::new(ResNet::new(*groups, classes, image, device)))
            }
            _ => Self::Sequential(Sequential::new(model, classes, image, device)),
        }
    }

    /// Every stacked parameter, in the order the forward pass takes them
    /// and the backward pass gives their gradients.
    pub(crate) fn params(&self) -> Vec<Param> {
        match self {
            Self::Sequential(net) => net.params(),
            Self::ResNet(net) => net.params(),
        }
    }

    pub(crate) fn classes(&self) -> usize {
        match self {
            Self::Sequential(net) => net.classes,
            Self::ResNet(net) => net.classes(),
        }
    }

    /// Logits `[K, B, classes]` of `images` (`[K·B, values]`) under
    /// `params`, with what [`StackedNet::backward`] needs.
    pub(crate) fn forward_train(
        &self,
        params: &[Tensor<3>],
        images: Tensor<2>,
        k: usize,
    ) -> (Tensor<3>, Tape) {
        match self {
            Self::Sequential(net) => {
                let (logits, saved) = net.forward_train(params, images, k);
                (logits, Tape::Sequential(saved))
            }
            Self::ResNet(net) => {
                let (logits, tape) = net.forward_train(params, images, k);
                (logits, Tape::ResNet(Box::new(tape)))
            }
        }
    }

    /// The gradient of every parameter, in order, given the logits'
    /// gradient `[K, B, classes]` and the forward pass's tape.
    pub(crate) fn backward(
        &self,
        params: &[Tensor<3>],
        tape: Tape,
        logits_grad: Tensor<3>,
    ) -> Vec<Tensor<3>> {
        match (self, tape) {
            (Self::Sequential(net), Tape::Sequential(saved)) => {
                net.backward(params, saved, logits_grad)
            }
            (Self::ResNet(net), Tape::ResNet(tape)) => net.backward(params, *tape, logits_grad),
            _ => unreachable!("a net's tape is its own"),
        }
    }

    /// The logits as a graph burn's autodiff can differentiate: the
    /// reference the written-out backward passes are tested against, and
    /// the path `COHORT_VECTORIZED_AUTODIFF=1` takes.
    pub(crate) fn forward(&self, params: &[Tensor<3>], images: Tensor<2>, k: usize) -> Tensor<3> {
        match self {
            Self::Sequential(net) => net.forward(params, images, k),
            Self::ResNet(net) => net.forward_train(params, images, k).0,
        }
    }

    /// Elements of the activations of one sample, forward, summed over
    /// layers (im2col patches included): what memory grows with per client.
    pub(crate) fn activation_elements(&self) -> usize {
        match self {
            Self::Sequential(net) => net.activation_elements(),
            Self::ResNet(net) => net.activation_elements(),
        }
    }

    /// Elements of the largest single tensor a step holds for one client of
    /// `batch` samples: a GPU buffer has a size limit of its own, below the
    /// device's memory.
    pub(crate) fn largest_tensor_elements(&self, batch: usize) -> usize {
        match self {
            Self::Sequential(net) => net.largest_tensor_elements(batch),
            Self::ResNet(net) => net.largest_tensor_elements(batch),
        }
    }

    pub(crate) fn parameter_count(&self) -> usize {
        self.params().iter().map(|p| p.rows * p.cols).sum()
    }
}

/// One stacked parameter, `[K, rows, cols]` on the device, and where it
/// lives in the tree.
pub(crate) struct Param {
    /// Its path in the tree (`conv1.weight`, `layer1.0.bn2.bias`, …).
    pub(crate) name: String,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// PyTorch's shape, the tree's.
    pub(crate) torch_shape: Vec<usize>,
    /// Stored as the transpose of the tree's `[cols, rows]` (a weight's
    /// `[out, fan_in]`, flattened from PyTorch's `[out, in, …]`).
    pub(crate) transposed: bool,
}

impl Param {
    /// A weight stored `[fan_in, fan_out]`.
    pub(crate) fn weight(layer: &str, fan_in: usize, fan_out: usize, torch: &[usize]) -> Self {
        Self {
            name: format!("{layer}.weight"),
            rows: fan_in,
            cols: fan_out,
            torch_shape: torch.to_vec(),
            transposed: true,
        }
    }

    /// A bias or a normalization's scale or shift, stored `[1, len]`.
    pub(crate) fn vector(name: String, len: usize) -> Self {
        Self {
            name,
            rows: 1,
            cols: len,
            torch_shape: vec![len],
            transposed: false,
        }
    }
}

/// How a convolution's input lays out a sample.
#[derive(Clone, Copy)]
pub(super) enum Layout {
    /// `[h, w, c]`: the activations between stacked layers.
    ChannelsLast,
    /// `[c, h, w]`: the data set's images.
    ChannelsFirst,
}

/// A convolution's im2col gather and its transpose: for each output
/// position and `(c, ky, kx)` (PyTorch's order of a filter), the input
/// element it reads, padding read from an appended zero column.
pub(super) struct Gather {
    /// Output positions.
    pub(super) positions: [usize; 2],
    /// `c · kernel²`, a patch's length.
    pub(super) fan_in: usize,
    /// Whether some patch entry reads padding.
    padded: bool,
    indices: Tensor<1, Int>,
    /// The same map read the other way, for the backward pass: for each input
    /// element, the `readers` patch entries (`position·fan_in + f`) that read
    /// it, padded with the appended zero column (`positions·fan_in`).
    readers_of: Tensor<1, Int>,
    readers: usize,
    /// Input elements `h·w·c`.
    inputs: usize,
}

impl Gather {
    pub(super) fn new(
        input: Shape,
        kernel: usize,
        stride: usize,
        pad: usize,
        layout: Layout,
        device: &Device,
    ) -> Self {
        let Shape { h, w, c } = input;
        let (oh, ow) = (
            (h + 2 * pad - kernel) / stride + 1,
            (w + 2 * pad - kernel) / stride + 1,
        );
        let element = |iy: usize, ix: usize, channel: usize| -> i64 {
            let index = match layout {
                Layout::ChannelsLast => (iy * w + ix) * c + channel,
                Layout::ChannelsFirst => (channel * h + iy) * w + ix,
            };
            index as i64
        };
        let zero_column = (h * w * c) as i64;
        let mut indices = Vec::with_capacity(oh * ow * c * kernel * kernel);
        for oy in 0..oh {
            for ox in 0..ow {
                for channel in 0..c {
                    for ky in 0..kernel {
                        let iy = (oy * stride + ky).checked_sub(pad).filter(|&y| y < h);
                        for kx in 0..kernel {
                            let ix = (ox * stride + kx).checked_sub(pad).filter(|&x| x < w);
                            indices.push(match (iy, ix) {
                                (Some(iy), Some(ix)) => element(iy, ix, channel),
                                _ => zero_column,
                            });
                        }
                    }
                }
            }
        }
        let padded = indices.contains(&zero_column);
        let entries = indices.len();
        let (readers_of, readers) = invert(&indices, h * w * c, entries);
        let int = |values: Vec<i64>| {
            let length = values.len();
            Tensor::<1, Int>::from_data(TensorData::new(values, [length]), device)
        };
        Self {
            positions: [oh, ow],
            fan_in: c * kernel * kernel,
            padded,
            indices: int(indices),
            readers_of: int(readers_of),
            readers,
            inputs: h * w * c,
        }
    }

    pub(super) fn positions(&self) -> usize {
        self.positions[0] * self.positions[1]
    }

    /// The channels-last shape of an output of `channels`.
    pub(super) fn output(&self, channels: usize) -> Shape {
        Shape {
            h: self.positions[0],
            w: self.positions[1],
            c: channels,
        }
    }

    /// `[K, B·positions, fan_in]` im2col patches of `x` (`[N, inputs]`).
    pub(super) fn patches(&self, x: Tensor<2>, k: usize) -> Tensor<3> {
        let n = x.dims()[0];
        let x = match self.padded {
            true => {
                let zero = Tensor::<2>::zeros([n, 1], &x.device());
                Tensor::cat(vec![x, zero], 1)
            }
            false => x,
        };
        x.select(1, self.indices.clone())
            .reshape([k, n / k * self.positions(), self.fan_in])
    }

    /// The transpose of [`Gather::patches`]: each input element's gradient is
    /// the sum of its readers' patch gradients (`[N, positions·fan_in]`),
    /// gathered, so no two threads write one element.
    pub(super) fn col2im(&self, patches_grad: Tensor<2>, n: usize) -> Tensor<2> {
        let zero = Tensor::<2>::zeros([n, 1], &patches_grad.device());
        Tensor::cat(vec![patches_grad, zero], 1)
            .select(1, self.readers_of.clone())
            .reshape([n, self.inputs, self.readers])
            .sum_dim(2)
            .reshape([n, self.inputs])
    }

    /// Elements a sample has in the larger of the patches (`+ 1`: the zero
    /// column appended before each gather) and the gather that sums them
    /// back.
    pub(super) fn largest_per_sample(&self) -> usize {
        (self.positions() * self.fan_in + 1).max(self.inputs * self.readers)
    }
}

/// One layer of the stacked network.
pub(crate) struct Layer {
    /// The parameter prefix in the tree (`conv1`, `fc4`, `layers.0`, …).
    pub(crate) name: String,
    pub(crate) fan_in: usize,
    pub(crate) fan_out: usize,
    /// PyTorch's shape of the weight (`[out, in, k, k]` or `[out, in]`).
    pub(crate) weight_shape: Vec<usize>,
    kind: Kind,
}

// A handful of layers built once per trainer: boxing buys nothing.
#[allow(clippy::large_enum_variant)]
enum Kind {
    Conv(Conv),
    Linear {
        activation: Option<Activation>,
        /// `[h, w, c]` of a channels-last input with more than one position:
        /// PyTorch flattens channels-first, so the input is permuted first.
        channels_last: Option<[usize; 3]>,
    },
}

/// The nonlinearity after a dense layer.
#[derive(Clone, Copy)]
enum Activation {
    Relu,
    Tanh,
}

impl Activation {
    fn apply(self, z: Tensor<3>) -> Tensor<3> {
        match self {
            Activation::Relu => relu(z),
            Activation::Tanh => tanh(z),
        }
    }

    /// The output `y` and what the backward pass multiplies the output's
    /// gradient by: ReLU's open gate, or tanh's `1 − y²`.
    fn apply_with_derivative(self, z: Tensor<3>) -> (Tensor<3>, Tensor<3>) {
        match self {
            Activation::Relu => (relu(z.clone()), z.greater_elem(0.0).float()),
            Activation::Tanh => {
                let y = tanh(z);
                let derivative = y.clone().powi_scalar(2).neg().add_scalar(1.0);
                (y, derivative)
            }
        }
    }
}

struct Conv {
    gather: Gather,
    pool: bool,
}

/// Shape of a sample's activations between layers (channels-last) or of
/// its image (channels-first).
#[derive(Clone, Copy)]
pub(super) struct Shape {
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) c: usize,
}

/// A stacked network of layers in sequence: the LeNets, the CNNs and the
/// perceptron.
pub(crate) struct Sequential {
    layers: Vec<Layer>,
    classes: usize,
}

impl Sequential {
    /// The stacked form of `model` for inputs of `image` (`[channels,
    /// height, width]`; the convolutional models read one channel, a
    /// perceptron reads all the values).
    fn new(model: &Stackable, classes: usize, image: [usize; 3], device: &Device) -> Self {
        let mut shape = Shape {
            h: image[1],
            w: image[2],
            c: image[0],
        };
        let mut conv = |name, out, pad, pool| conv_layer(name, &mut shape, out, pad, pool, device);
        let named = |widths: &[(&str, usize)]| -> Vec<(String, usize)> {
            widths.iter().map(|&(n, w)| (n.to_owned(), w)).collect()
        };
        let (mut layers, widths, activation) = match model {
            Stackable::LeNet(LeNetVariant::Padded) => (
                vec![
                    conv("conv1", 6, 2, true),
                    conv("conv2", 16, 0, true),
                    conv("conv3", 120, 0, false),
                ],
                named(&[("fc4", 84), ("fc5", classes)]),
                Activation::Relu,
            ),
            Stackable::LeNet(LeNetVariant::Compact) => (
                vec![conv("conv1", 6, 0, true), conv("conv2", 16, 0, true)],
                named(&[("fc3", 120), ("fc4", 84), ("fc5", classes)]),
                Activation::Relu,
            ),
            Stackable::Cnn { dense } => (
                vec![conv("conv1", 32, 2, true), conv("conv2", 64, 2, true)],
                named(&[("fc1", *dense), ("fc2", classes)]),
                Activation::Relu,
            ),
            Stackable::ResNet20 { .. } => unreachable!("StackedNet::new builds the ResNet"),
            Stackable::Multilayer { hidden, tanh } => (
                Vec::new(),
                hidden
                    .iter()
                    .chain([&classes])
                    .enumerate()
                    .map(|(i, &width)| (format!("layers.{i}"), width))
                    .collect(),
                if *tanh {
                    Activation::Tanh
                } else {
                    Activation::Relu
                },
            ),
        };
        let flat = shape.h * shape.w * shape.c;
        // PyTorch flattens channels-first: convolutions' channels-last
        // outputs are permuted (one channel needs no permutation); images
        // are channels-first already.
        let convolved = !layers.is_empty();
        let channels_last = (convolved && shape.h * shape.w > 1 && shape.c > 1)
            .then_some([shape.h, shape.w, shape.c]);
        let mut inputs = flat;
        let last = widths.len() - 1;
        for (index, (name, outputs)) in widths.into_iter().enumerate() {
            layers.push(Layer {
                name,
                fan_in: inputs,
                fan_out: outputs,
                weight_shape: vec![outputs, inputs],
                kind: Kind::Linear {
                    activation: (index < last).then_some(activation),
                    channels_last: if index == 0 { channels_last } else { None },
                },
            });
            inputs = outputs;
        }
        Self { layers, classes }
    }

    /// Logits `[K, B, classes]` of `images` (`[K·B, h·w]`) under `params`
    /// (weight and bias of each layer, in order), with what
    /// [`StackedNet::backward`] needs of each layer.
    fn forward_train(
        &self,
        params: &[Tensor<3>],
        images: Tensor<2>,
        k: usize,
    ) -> (Tensor<3>, Vec<Saved>) {
        let n = images.dims()[0];
        let batch = n / k;
        let mut x = images;
        let mut saved = Vec::with_capacity(self.layers.len());
        for (layer, pair) in self.layers.iter().zip(params.chunks(2)) {
            let (weight, bias) = (pair[0].clone(), pair[1].clone());
            x = match &layer.kind {
                Kind::Conv(conv) => {
                    let patches = conv.gather.patches(x, k);
                    let z = conv_forward_product(patches.clone(), weight) + bias;
                    let open = z.clone().greater_elem(0.0).float();
                    let y = relu(z);
                    let [oh, ow] = conv.gather.positions;
                    let (out, gate) = match conv.pool {
                        true => {
                            let (pooled, winners) = max_pool_with_winners(y, n, oh, ow);
                            (pooled, winners * open)
                        }
                        false => (y.reshape([n, oh * ow * layer.fan_out]), open),
                    };
                    saved.push(Saved::Conv { patches, gate });
                    out
                }
                Kind::Linear {
                    activation,
                    channels_last,
                } => {
                    let input = channels_first(x, *channels_last).reshape([k, batch, layer.fan_in]);
                    let z = product(input.clone(), weight, Role::LinearForward) + bias;
                    let (y, gate) = match activation {
                        Some(activation) => {
                            let (y, derivative) = activation.apply_with_derivative(z);
                            (y, Some(derivative))
                        }
                        None => (z, None),
                    };
                    saved.push(Saved::Linear { input, gate });
                    y.reshape([n, layer.fan_out])
                }
            };
        }
        (x.reshape([k, batch, self.classes]), saved)
    }

    /// The gradient of every parameter (weight and bias of each layer, in
    /// order) given the gradient of the logits `[K, B, classes]`, from what
    /// [`Sequential::forward_train`] saved. Written out instead of recorded by
    /// autodiff so that no step needs a scatter: the transpose of the im2col
    /// gather is another gather ([`Gather::col2im`]), where autodiff would
    /// scatter-add with atomics (emulated by compare-and-swap loops on wgpu),
    /// and a convolution's weight gradient is split by sample where a sample
    /// has many positions, so that its long reduction runs as many small
    /// products ([`conv_weight_grad`]).
    fn backward(
        &self,
        params: &[Tensor<3>],
        saved: Vec<Saved>,
        logits_grad: Tensor<3>,
    ) -> Vec<Tensor<3>> {
        let [k, batch, _] = logits_grad.dims();
        let n = k * batch;
        let mut grads = Vec::with_capacity(params.len());
        let mut upstream = logits_grad.reshape([n, self.classes]);
        let layers = self.layers.iter().zip(params.chunks(2)).zip(saved);
        for (index, ((layer, pair), saved)) in layers.enumerate().rev() {
            let transposed = pair[0].clone().swap_dims(1, 2);
            let (fan_in, fan_out) = (layer.fan_in, layer.fan_out);
            let input_grad = match (&layer.kind, saved) {
                (Kind::Conv(conv), Saved::Conv { patches, gate }) => {
                    let [oh, ow] = conv.gather.positions;
                    let positions = oh * ow;
                    let z_grad = match conv.pool {
                        true => unpool(upstream, gate, n, oh, ow, fan_out),
                        false => upstream.reshape([k, batch * positions, fan_out]) * gate,
                    };
                    let weight_grad = conv_weight_grad(&patches, &z_grad, batch, positions);
                    grads.push(sum_rows(z_grad.clone()));
                    grads.push(weight_grad);
                    (index > 0).then(|| {
                        let patches_grad = product(z_grad, transposed, Role::ConvInputGradient)
                            .reshape([n, positions * fan_in]);
                        conv.gather.col2im(patches_grad, n)
                    })
                }
                (Kind::Linear { channels_last, .. }, Saved::Linear { input, gate }) => {
                    let z_grad = upstream.reshape([k, batch, fan_out]);
                    let z_grad = match gate {
                        Some(gate) => z_grad * gate,
                        None => z_grad,
                    };
                    grads.push(sum_rows(z_grad.clone()));
                    grads.push(product(
                        input.swap_dims(1, 2),
                        z_grad.clone(),
                        Role::LinearWeightGradient,
                    ));
                    (index > 0).then(|| {
                        let input_grad = product(z_grad, transposed, Role::LinearInputGradient)
                            .reshape([n, fan_in]);
                        channels_last_again(input_grad, *channels_last)
                    })
                }
                _ => unreachable!("forward_train saves each layer as its kind"),
            };
            // The first layer's input is the images: nothing flows further.
            let Some(input_grad) = input_grad else { break };
            upstream = input_grad;
        }
        // Pushed bias then weight from the last layer down.
        grads.reverse();
        grads
    }

    /// Logits `[K, B, classes]` of `images` (`[K·B, h·w]`) under `params`
    /// (weight and bias of each layer, in order), as a graph autodiff can
    /// differentiate: the reference [`Sequential::backward`] is tested against,
    /// and the path `COHORT_VECTORIZED_AUTODIFF=1` takes.
    fn forward(&self, params: &[Tensor<3>], images: Tensor<2>, k: usize) -> Tensor<3> {
        let n = images.dims()[0];
        let batch = n / k;
        let mut x = images;
        for (layer, pair) in self.layers.iter().zip(params.chunks(2)) {
            let (weight, bias) = (pair[0].clone(), pair[1].clone());
            x = match &layer.kind {
                Kind::Conv(conv) => {
                    let [oh, ow] = conv.gather.positions;
                    let y = relu(conv.gather.patches(x, k).matmul(weight) + bias);
                    match conv.pool {
                        true => max_pool_channels_last(y, n, oh, ow, layer.fan_out),
                        false => y.reshape([n, oh * ow * layer.fan_out]),
                    }
                }
                Kind::Linear {
                    activation,
                    channels_last,
                } => {
                    let x = channels_first(x, *channels_last);
                    let y = x.reshape([k, batch, layer.fan_in]).matmul(weight) + bias;
                    let y = match activation {
                        Some(activation) => activation.apply(y),
                        None => y,
                    };
                    y.reshape([n, layer.fan_out])
                }
            };
        }
        x.reshape([k, batch, self.classes])
    }

    /// Elements of the activations of one sample, forward, summed over layers
    /// (im2col patches included): what memory grows with per client.
    fn activation_elements(&self) -> usize {
        self.layers
            .iter()
            .map(|layer| match &layer.kind {
                Kind::Conv(conv) => {
                    let positions = conv.gather.positions();
                    // Patches, the product, ReLU and pooling temporaries.
                    positions * (layer.fan_in + 3 * layer.fan_out)
                }
                Kind::Linear { .. } => 2 * (layer.fan_in + layer.fan_out),
            })
            .sum()
    }

    /// Elements of the largest single tensor a step holds for one client of
    /// `batch` samples: a convolution's patches (and their gradient, the same
    /// size), the gather that sums them back into the input's gradient
    /// ([`Gather::col2im`]), or a stacked weight. A GPU buffer has a size limit
    /// of its own, below the device's memory.
    fn largest_tensor_elements(&self, batch: usize) -> usize {
        self.layers
            .iter()
            .map(|layer| match &layer.kind {
                Kind::Conv(conv) => {
                    (batch * conv.gather.largest_per_sample()).max(layer.fan_in * layer.fan_out)
                }
                Kind::Linear { .. } => (batch * layer.fan_in).max(layer.fan_in * layer.fan_out),
            })
            .max()
            .unwrap_or(0)
    }

    /// Weight then bias of each layer, in order.
    fn params(&self) -> Vec<Param> {
        self.layers
            .iter()
            .flat_map(|layer| {
                [
                    Param::weight(
                        &layer.name,
                        layer.fan_in,
                        layer.fan_out,
                        &layer.weight_shape,
                    ),
                    Param::vector(format!("{}.bias", layer.name), layer.fan_out),
                ]
            })
            .collect()
    }
}

/// What the backward pass needs of one layer.
pub(crate) enum Saved {
    Conv {
        /// `[K, B·positions, fan_in]` im2col patches.
        patches: Tensor<3>,
        /// `[K, B·positions, fan_out]`: 1 where an output's gradient flows
        /// back (its ReLU is open and, with pooling, it won its window), else 0.
        gate: Tensor<3>,
    },
    Linear {
        /// `[K, B, fan_in]` input.
        input: Tensor<3>,
        /// `[K, B, fan_out]`: the activation's derivative (ReLU's gate,
        /// tanh's `1 − y²`), for a layer with one.
        gate: Option<Tensor<3>>,
    },
}

/// Below this many output positions a convolution's weight gradient is one
/// product per client: split by sample, conv3's single position would make
/// `[K·B, fan_in, fan_out]` partial products (614 MB a step at K = 100) only
/// to sum them.
const SPLIT_BY_SAMPLE_FROM: usize = 16;

/// Outputs of a weight gradient (`fan_in × fan_out`) up to which a GPU
/// computes it as one scaled copy of the patches per output channel, summed
/// over rows, rather than as products split by sample.
///
/// Why: burn's matrix product without the autotuner (cubek's `SimpleUnit`)
/// gives each product tiles larger than such an output, and most of their
/// threads idle. LeNet-5's first layer (25 × 6 outputs, 3,200 products of
/// `[25 × 784] · [784 × 6]` a step for 100 clients at batch 32) took 6.76 ms
/// of a 14.58 ms step that way on an H100; six scaled copies and their
/// two-stage sums take 2.15 ms, each pass as fast as memory moves the
/// patches (about 2 TB/s). The second layer (150 × 16 outputs) is faster
/// as products (1.93 ms against 4.45 ms as 16 passes), so the bound lies
/// between the two (`bench/gpu_kernel_profile.sh`). The CPU's products run
/// at full speed at any shape, so it always multiplies. Each column holds a
/// temporary the size of the patches (251 MB at 100 clients), which
/// [`super::clients_for_memory`] does not count: `"auto"` leaves half the
/// device's memory to such things and to the autotuner.
const SCALED_COPIES_UP_TO: usize = 256;

/// Outputs of a weight gradient (`fan_in × fan_out`) up to which a GPU with
/// the thin products switched on
/// ([`crate::switches::TrainSwitches::thin_gpu_products`]) sums it in chunks
/// of rows ([`super::thin_products`]) rather than by columns
/// ([`SCALED_COPIES_UP_TO`]) or as products split by sample.
///
/// Why: burn's matrix product without the autotuner (cubek's `SimpleUnit`)
/// gives each product tiles larger than such an output, and most of their
/// threads idle: LeNet-5's first layer (25 × 6 outputs, 3,200 products of
/// `[25 × 784] · [784 × 6]` a step for 100 clients at batch 32) took 6.76
/// ms of a 14.58 ms step that way on an H100, the second (150 × 16) 1.93
/// ms. The chunked sums give every output of every chunk a thread, which
/// reads its rows from the caches; past a few thousand outputs a tiled
/// product reuses its operands better. The CPU's products run at full speed
/// at any shape, so it always multiplies.
const CHUNKED_UP_TO: usize = 4096;

/// A convolution's patches times its weight (`[K, B·positions, fan_in] ·
/// [K, fan_in, fan_out]`): with the thin products switched on, on a GPU one
/// thread an output element where the patch and the output are both short
/// ([`NARROW_UP_TO`]), else a product of [`Role::ConvForward`].
fn conv_forward_product(patches: Tensor<3>, weight: Tensor<3>) -> Tensor<3> {
    let [_, fan_in, fan_out] = weight.dims();
    let thin = crate::switches::get().thin_gpu_products;
    if thin && fan_in * fan_out <= NARROW_UP_TO && !crate::device::is_cpu(&patches.device()) {
        return super::thin_products::narrow_product(patches, weight);
    }
    product(patches, weight, Role::ConvForward)
}

/// Weights (`fan_in × fan_out`) up to which a GPU with the thin products
/// switched on computes a convolution's forward product one thread an output
/// element: a first layer's (LeNet-5 25 × 6, cnn 25 × 32), whose output is
/// narrower than the tiles of burn's product without the autotuner
/// (LeNet-5's first forward product took 1.36 ms of a 10.27 ms step on an
/// H100 that way). Each thread reads `fan_in` values of a patch and of the
/// weight, so longer patches go to the tiled product.
const NARROW_UP_TO: usize = 1024;

/// `patchesᵀ · z_grad` per client (`[K, fan_in, fan_out]`). Where each
/// sample has many positions the reduction over `B·positions` is long and
/// the output small, so it is split by sample (`B` times more, shorter
/// products, then a sum over the batch) to give the GPU parallel work, or,
/// on a GPU for a small output, summed column by column
/// ([`SCALED_COPIES_UP_TO`]) or in chunks of rows ([`CHUNKED_UP_TO`]).
pub(super) fn conv_weight_grad(
    patches: &Tensor<3>,
    z_grad: &Tensor<3>,
    batch: usize,
    positions: usize,
) -> Tensor<3> {
    let [k, _, fan_in] = patches.dims();
    let fan_out = z_grad.dims()[2];
    if positions < SPLIT_BY_SAMPLE_FROM {
        return product(
            patches.clone().swap_dims(1, 2),
            z_grad.clone(),
            Role::ConvWeightGradient,
        );
    }
    let on_gpu = !crate::device::is_cpu(&patches.device());
    if on_gpu && fan_in * fan_out <= CHUNKED_UP_TO && crate::switches::get().thin_gpu_products {
        return super::thin_products::transposed_product(patches.clone(), z_grad.clone());
    }
    if on_gpu && fan_in * fan_out <= SCALED_COPIES_UP_TO {
        return weight_grad_by_columns(patches, z_grad);
    }
    let n = k * batch;
    let by_sample = patches
        .clone()
        .reshape([n, positions, fan_in])
        .swap_dims(1, 2);
    product(
        by_sample,
        z_grad.clone().reshape([n, positions, fan_out]),
        Role::ConvWeightGradient,
    )
    .reshape([k, batch, fan_in * fan_out])
    .sum_dim(1)
    .reshape([k, fan_in, fan_out])
}

/// `patchesᵀ · z_grad` per client as `fan_out` sums over rows: for each
/// output channel, the patches scaled by that channel's gradient row by row.
pub(super) fn weight_grad_by_columns(patches: &Tensor<3>, z_grad: &Tensor<3>) -> Tensor<3> {
    let [k, rows, _] = patches.dims();
    let fan_out = z_grad.dims()[2];
    let columns: Vec<Tensor<3>> = (0..fan_out)
        .map(|o| {
            let gradient = z_grad.clone().slice([0..k, 0..rows, o..o + 1]);
            sum_rows(patches.clone() * gradient)
        })
        .collect();
    Tensor::cat(columns, 1).swap_dims(1, 2)
}

/// Rows from which [`sum_rows`] sums in two stages.
const SUM_IN_TWO_STAGES_FROM: usize = 512;

/// The sum of `x` (`[K, rows, columns]`) over its rows, `[K, 1, columns]`:
/// a bias or norm gradient, whose rows are every position of every sample
/// (25,088 for LeNet-5's first layer at batch 32) and whose outputs are few
/// (600 for 100 clients of 6 channels). Without the autotuner burn reduces
/// with one GPU thread per output, so those few threads would each add up
/// thousands of values in sequence while the rest of the GPU waits; split
/// into `outer × inner` rows (`inner` the divisor of `rows` nearest its
/// square root from below), the first stage gives `outer` times more
/// threads a short sum each and the second adds `outer` partial sums.
pub(super) fn sum_rows(x: Tensor<3>) -> Tensor<3> {
    let [k, rows, columns] = x.dims();
    let Some(inner) = two_stage_inner(rows) else {
        return x.sum_dim(1);
    };
    x.reshape([k, rows / inner, inner, columns])
        .sum_dim(2)
        .sum_dim(1)
        .reshape([k, 1, columns])
}

/// The inner length of [`sum_rows`]'s first stage: the largest divisor of
/// `rows` not above its square root, or `None` where one stage is as good
/// (few rows, or no divisor above 1: a prime count of rows).
fn two_stage_inner(rows: usize) -> Option<usize> {
    if rows < SUM_IN_TWO_STAGES_FROM {
        return None;
    }
    let root = rows.isqrt();
    (2..=root).rev().find(|d| rows.is_multiple_of(*d))
}

/// PyTorch flattens channels-first: a channels-last input with more than
/// one position (`[h, w, c]`) is permuted before a linear layer.
fn channels_first(x: Tensor<2>, channels_last: Option<[usize; 3]>) -> Tensor<2> {
    match channels_last {
        Some([h, w, c]) => {
            let n = x.dims()[0];
            x.reshape([n, h, w, c])
                .permute([0, 3, 1, 2])
                .reshape([n, h * w * c])
        }
        None => x,
    }
}

/// The inverse permutation of [`channels_first`], for gradients.
fn channels_last_again(x: Tensor<2>, channels_last: Option<[usize; 3]>) -> Tensor<2> {
    match channels_last {
        Some([h, w, c]) => {
            let n = x.dims()[0];
            x.reshape([n, c, h, w])
                .permute([0, 2, 3, 1])
                .reshape([n, h * w * c])
        }
        None => x,
    }
}

/// 2×2 max-pool of channels-last `[K, N/K·h·w, c]` activations, flattened to
/// `[N, h/2·w/2·c]`, with a `[K, N/K·h·w, c]` mask of each window's winner:
/// the one autodiff's `max_dim` would route the gradient to (the maximum
/// over the window's rows of each column, then over the two columns; the
/// first on ties).
fn max_pool_with_winners(x: Tensor<3>, n: usize, h: usize, w: usize) -> (Tensor<2>, Tensor<3>) {
    let shape = x.dims();
    let c = shape[2];
    let (rows, row_winner) = x
        .reshape([n * h / 2, 2, w / 2, 2, c])
        .max_dim_with_indices(1);
    let (pooled, column_winner) = rows.max_dim_with_indices(3);
    let one_hot = |winner: Tensor<5, Int>, dim: usize| {
        let second = winner.float();
        let first = second.clone().neg().add_scalar(1.0);
        Tensor::cat(vec![first, second], dim)
    };
    // [·, 2, w/2, 2, c] (which row won in each column) times [·, 1, w/2, 2, c]
    // (which column won).
    let winners = one_hot(row_winner, 1) * one_hot(column_winner, 3);
    (
        pooled.reshape([n, (h / 2) * (w / 2) * c]),
        winners.reshape(shape),
    )
}

/// The gradient of a pooled layer's pre-activations `[K, N/K·h·w, c]` from
/// the pooled output's `[N, h/2·w/2·c]`: each window's gradient goes where
/// `gate` (winner and open ReLU) says.
fn unpool(
    upstream: Tensor<2>,
    gate: Tensor<3>,
    n: usize,
    h: usize,
    w: usize,
    c: usize,
) -> Tensor<3> {
    let shape = gate.dims();
    let upstream = upstream.reshape([n * h / 2, 1, w / 2, 1, c]);
    (gate.reshape([n * h / 2, 2, w / 2, 2, c]) * upstream).reshape(shape)
}

/// A 5×5 (valid or zero-padded) convolution with `out` filters on the
/// channels-last input `shape`, optionally followed by a 2×2 max-pool;
/// updates `shape` to the layer's output.
fn conv_layer(
    name: &str,
    shape: &mut Shape,
    out: usize,
    pad: usize,
    pool: bool,
    device: &Device,
) -> Layer {
    const KERNEL: usize = 5;
    let c = shape.c;
    let gather = Gather::new(*shape, KERNEL, 1, pad, Layout::ChannelsLast, device);
    let [oh, ow] = gather.positions;
    *shape = match pool {
        true => Shape {
            h: oh / 2,
            w: ow / 2,
            c: out,
        },
        false => gather.output(out),
    };
    Layer {
        name: name.to_owned(),
        fan_in: gather.fan_in,
        fan_out: out,
        weight_shape: vec![out, c, KERNEL, KERNEL],
        kind: Kind::Conv(Conv { gather, pool }),
    }
}

/// 2×2 max-pool, stride 2, of channels-last `[K, N/K·h·w, c]` activations,
/// flattened to `[N, h/2·w/2·c]`.
fn max_pool_channels_last(x: Tensor<3>, n: usize, h: usize, w: usize, c: usize) -> Tensor<2> {
    // Row-major [n, h, w, c] is [n·h/2, 2, w/2, 2, c]: the window's two rows
    // are dimension 1, its two columns dimension 3.
    x.reshape([n * h / 2, 2, w / 2, 2, c])
        .max_dim(1)
        .max_dim(3)
        .reshape([n, (h / 2) * (w / 2) * c])
}

/// The im2col map `indices` (patch entry → input element, `inputs` meaning
/// none) read the other way: for each input element, the patch entries that
/// read it, each list padded to the longest with `entries` (the index of an
/// appended zero column). Returns the flat lists and their common length.
fn invert(indices: &[i64], inputs: usize, entries: usize) -> (Vec<i64>, usize) {
    let mut lists: Vec<Vec<i64>> = vec![Vec::new(); inputs];
    for (entry, &input) in indices.iter().enumerate() {
        if let Some(list) = lists.get_mut(input as usize) {
            list.push(entry as i64);
        }
    }
    let readers = lists.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut flat = Vec::with_capacity(inputs * readers);
    for list in &lists {
        flat.extend_from_slice(list);
        flat.extend(std::iter::repeat_n(entries as i64, readers - list.len()));
    }
    (flat, readers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_first_stage_divides_the_rows_at_most_at_their_root(rows in 1usize..200_000) {
            match two_stage_inner(rows) {
                Some(inner) => {
                    prop_assert!(rows >= SUM_IN_TWO_STAGES_FROM);
                    prop_assert_eq!(rows % inner, 0);
                    prop_assert!(inner >= 2 && inner * inner <= rows);
                    // No larger divisor fits below the root.
                    prop_assert!((inner + 1..=rows.isqrt()).all(|d| rows % d != 0));
                }
                None => prop_assert!(
                    rows < SUM_IN_TWO_STAGES_FROM || (2..=rows.isqrt()).all(|d| rows % d != 0)
                ),
            }
        }
    }

    #[test]
    fn two_stages_sum_what_one_sums() {
        let device = crate::device::cpu();
        // LeNet-5's first layer at batch 32 (25,088 rows: 196 sums of 128,
        // then one of 196), a prime count of rows and a short one (one stage
        // each).
        for (k, rows, columns) in [(3, 25_088, 6), (2, 1_009, 5), (4, 32, 7)] {
            let values: Vec<f32> = (0..k * rows * columns)
                .map(|i| ((i * 7_919) % 1_000) as f32 / 500.0 - 1.0)
                .collect();
            let x = Tensor::<3>::from_data(
                TensorData::new(values.clone(), [k, rows, columns]),
                &device,
            );
            let summed = sum_rows(x).into_data().try_to_vec::<f32>().unwrap();
            assert_eq!(summed.len(), k * columns);
            for client in 0..k {
                for column in 0..columns {
                    let exact: f64 = (0..rows)
                        .map(|row| f64::from(values[(client * rows + row) * columns + column]))
                        .sum();
                    let got = f64::from(summed[client * columns + column]);
                    assert!(
                        (got - exact).abs() <= 1e-6 * rows as f64,
                        "client {client}, column {column}: {got} against {exact}"
                    );
                }
            }
        }
    }

    /// The GPU's column-by-column weight gradient is the per-client product
    /// `patchesᵀ · z_grad` (LeNet-5's first layer: 25 inputs, 6 outputs).
    #[test]
    fn weight_gradient_by_columns_is_the_product() {
        let device = crate::device::cpu();
        let (k, rows, fan_in, fan_out) = (3, 2 * 784, 25, 6);
        let values = |count: usize, seed: usize| -> Vec<f32> {
            (0..count)
                .map(|i| (((i + seed) * 7_919) % 1_000) as f32 / 500.0 - 1.0)
                .collect()
        };
        let patches = Tensor::<3>::from_data(
            TensorData::new(values(k * rows * fan_in, 1), [k, rows, fan_in]),
            &device,
        );
        let z_grad = Tensor::<3>::from_data(
            TensorData::new(values(k * rows * fan_out, 2), [k, rows, fan_out]),
            &device,
        );
        let product = patches.clone().swap_dims(1, 2).matmul(z_grad.clone());
        let by_columns = weight_grad_by_columns(&patches, &z_grad);
        assert_eq!(by_columns.dims(), [k, fan_in, fan_out]);
        let (a, b) = (
            product.into_data().try_to_vec::<f32>().unwrap(),
            by_columns.into_data().try_to_vec::<f32>().unwrap(),
        );
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            assert!((a - b).abs() <= 1e-6 * rows as f32, "{i}: {a} against {b}");
        }
    }
}
