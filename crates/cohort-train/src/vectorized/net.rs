//! LeNet-5 with a leading client dimension: K clients' weights stacked, one
//! batched computation for all of them.
//!
//! Every layer is a matrix product per client: a convolution is an im2col
//! gather (`select` with a fixed index per output position, padding read from
//! an appended zero column) followed by `[K, B·L, Cin·k²] × [K, Cin·k², Cout]`,
//! a linear layer `[K, B, in] × [K, in, out]`. Activations stay channels-last
//! (`[N, H, W, C]`, N = K·B), so no permutation is needed between layers and a
//! 2×2 max-pool is two `max_dim` on a reshaped view.
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

use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use cohort_core::config::ModelName;

/// One layer of the stacked network.
pub(crate) struct Layer {
    /// The parameter prefix in the tree (`conv1`, `fc4`, …).
    pub(crate) name: &'static str,
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
        relu: bool,
        /// `[h, w, c]` of a channels-last input with more than one position:
        /// PyTorch flattens channels-first, so the input is permuted first.
        channels_last: Option<[usize; 3]>,
    },
}

struct Conv {
    /// Output positions.
    positions: [usize; 2],
    pool: bool,
    padded: bool,
    /// For each output position and `(c, ky, kx)`, the input element it reads
    /// (`h·w·c` is the appended zero column).
    indices: Tensor<1, Int>,
}

/// Shape of the activations between layers, channels-last.
#[derive(Clone, Copy)]
struct Shape {
    h: usize,
    w: usize,
    c: usize,
}

pub(crate) struct StackedNet {
    pub(crate) layers: Vec<Layer>,
    pub(crate) classes: usize,
}

impl StackedNet {
    /// The stacked form of `model`, or `None` for a model it has no form for.
    pub(crate) fn new(
        model: ModelName,
        classes: usize,
        image: [usize; 2],
        device: &Device,
    ) -> Option<Self> {
        let mut shape = Shape {
            h: image[0],
            w: image[1],
            c: 1,
        };
        let mut conv = |name, out, pad, pool| conv_layer(name, &mut shape, out, pad, pool, device);
        let mut layers = match model {
            ModelName::Lenet5 => vec![
                conv("conv1", 6, 2, true),
                conv("conv2", 16, 0, true),
                conv("conv3", 120, 0, false),
            ],
            ModelName::Lenet5Compact => {
                vec![conv("conv1", 6, 0, true), conv("conv2", 16, 0, true)]
            }
            ModelName::CnnBn => return None,
        };
        let flat = shape.h * shape.w * shape.c;
        let channels_last = (shape.h * shape.w > 1).then_some([shape.h, shape.w, shape.c]);
        let linears: &[(&'static str, usize)] = match model {
            ModelName::Lenet5 => &[("fc4", 84), ("fc5", classes)],
            _ => &[("fc3", 120), ("fc4", 84), ("fc5", classes)],
        };
        let mut inputs = flat;
        for (index, &(name, outputs)) in linears.iter().enumerate() {
            layers.push(Layer {
                name,
                fan_in: inputs,
                fan_out: outputs,
                weight_shape: vec![outputs, inputs],
                kind: Kind::Linear {
                    relu: index + 1 < linears.len(),
                    channels_last: if index == 0 { channels_last } else { None },
                },
            });
            inputs = outputs;
        }
        Some(Self { layers, classes })
    }

    /// Logits `[K, B, classes]` of `images` (`[K·B, h·w]`) under `params`
    /// (weight and bias of each layer, in order).
    pub(crate) fn forward(&self, params: &[Tensor<3>], images: Tensor<2>, k: usize) -> Tensor<3> {
        let n = images.dims()[0];
        let batch = n / k;
        let mut x = images;
        for (layer, pair) in self.layers.iter().zip(params.chunks(2)) {
            let (weight, bias) = (pair[0].clone(), pair[1].clone());
            x = match &layer.kind {
                Kind::Conv(conv) => {
                    let x = if conv.padded {
                        let zero = Tensor::<2>::zeros([n, 1], &x.device());
                        Tensor::cat(vec![x, zero], 1)
                    } else {
                        x
                    };
                    let [oh, ow] = conv.positions;
                    let patches = x.select(1, conv.indices.clone()).reshape([
                        k,
                        batch * oh * ow,
                        layer.fan_in,
                    ]);
                    let y = relu(patches.matmul(weight) + bias);
                    match conv.pool {
                        true => max_pool_channels_last(y, n, oh, ow, layer.fan_out),
                        false => y.reshape([n, oh * ow * layer.fan_out]),
                    }
                }
                Kind::Linear {
                    relu: activate,
                    channels_last,
                } => {
                    let x = match channels_last {
                        Some([h, w, c]) => x
                            .reshape([n, *h, *w, *c])
                            .permute([0, 3, 1, 2])
                            .reshape([n, layer.fan_in]),
                        None => x,
                    };
                    let y = x.reshape([k, batch, layer.fan_in]).matmul(weight) + bias;
                    let y = if *activate { relu(y) } else { y };
                    y.reshape([n, layer.fan_out])
                }
            };
        }
        x.reshape([k, batch, self.classes])
    }

    /// Elements of the activations of one sample, forward, summed over layers
    /// (im2col patches included): what memory grows with per client.
    pub(crate) fn activation_elements(&self) -> usize {
        self.layers
            .iter()
            .map(|layer| match &layer.kind {
                Kind::Conv(conv) => {
                    let positions = conv.positions[0] * conv.positions[1];
                    // Patches, the product, ReLU and pooling temporaries.
                    positions * (layer.fan_in + 3 * layer.fan_out)
                }
                Kind::Linear { .. } => 2 * (layer.fan_in + layer.fan_out),
            })
            .sum()
    }

    pub(crate) fn parameter_count(&self) -> usize {
        self.layers.iter().map(|l| (l.fan_in + 1) * l.fan_out).sum()
    }
}

/// A 5×5 (valid or zero-padded) convolution with `out` filters on the
/// channels-last input `shape`, optionally followed by a 2×2 max-pool;
/// updates `shape` to the layer's output.
fn conv_layer(
    name: &'static str,
    shape: &mut Shape,
    out: usize,
    pad: usize,
    pool: bool,
    device: &Device,
) -> Layer {
    const KERNEL: usize = 5;
    let Shape { h, w, c } = *shape;
    let (oh, ow) = (h + 2 * pad + 1 - KERNEL, w + 2 * pad + 1 - KERNEL);
    let zero_column = (h * w * c) as i64;
    let mut indices = Vec::with_capacity(oh * ow * c * KERNEL * KERNEL);
    for oy in 0..oh {
        for ox in 0..ow {
            for channel in 0..c {
                for ky in 0..KERNEL {
                    for kx in 0..KERNEL {
                        let (iy, ix) =
                            ((oy + ky) as i64 - pad as i64, (ox + kx) as i64 - pad as i64);
                        let inside = (0..h as i64).contains(&iy) && (0..w as i64).contains(&ix);
                        indices.push(match inside {
                            true => (iy * w as i64 + ix) * c as i64 + channel as i64,
                            false => zero_column,
                        });
                    }
                }
            }
        }
    }
    let length = indices.len();
    let indices = Tensor::<1, Int>::from_data(TensorData::new(indices, [length]), device);
    *shape = match pool {
        true => Shape {
            h: oh / 2,
            w: ow / 2,
            c: out,
        },
        false => Shape {
            h: oh,
            w: ow,
            c: out,
        },
    };
    Layer {
        name,
        fan_in: c * KERNEL * KERNEL,
        fan_out: out,
        weight_shape: vec![out, c, KERNEL, KERNEL],
        kind: Kind::Conv(Conv {
            positions: [oh, ow],
            pool,
            padded: pad > 0,
            indices,
        }),
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
