//! LeNet-5 (both variants) forward and backward on host buffers: two
//! convolution stages ([`super::conv`]) and three dense layers, softmax
//! cross-entropy, every buffer owned by a [`Workspace`] that is reused from
//! step to step.
//!
//! Parameters are burn's, in burn's layouts and in the order a
//! [`burn::module::ModuleVisitor`] meets them: conv1 weight, bias, conv2
//! weight, bias, then each dense layer's weight and bias. A dense weight is
//! burn's `[in, out]` for a `Linear` and `[out, in]` (as `[out, C, 5, 5]`) for
//! LeNet-5's conv3, which sees a 5×5 input and so is a dense layer.

use super::conv::{self, ConvShape, K};
use super::gemm::{MatRef, Strides, matmul};
use crate::model::LeNetVariant;

/// How a dense layer's weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WeightLayout {
    /// burn's `Linear`: `[in, out]`.
    InOut,
    /// A convolution over its whole input: `[out, in]`.
    OutIn,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DenseShape {
    pub inputs: usize,
    pub outputs: usize,
    pub layout: WeightLayout,
}

impl DenseShape {
    /// The weight as the `[in, out]` right operand of `x · W`.
    fn as_rhs(&self) -> Strides {
        match self.layout {
            WeightLayout::InOut => Strides::row_major(self.outputs),
            WeightLayout::OutIn => Strides::row_major(self.inputs).t(),
        }
    }
}

/// A LeNet: two conv stages, then dense layers with ReLU between them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Arch {
    pub convs: [ConvShape; 2],
    pub dense: [DenseShape; 3],
}

impl Arch {
    /// The architecture of the LeNet `lenet` with `classes` outputs.
    pub(crate) fn of(lenet: LeNetVariant, classes: usize) -> Self {
        let dense = |inputs, outputs, layout| DenseShape {
            inputs,
            outputs,
            layout,
        };
        let conv = |c_in, c_out, size, pad| ConvShape {
            c_in,
            c_out,
            size,
            pad,
        };
        let (convs, first) = match lenet {
            LeNetVariant::Padded => (
                [conv(1, 6, 28, 2), conv(6, 16, 14, 0)],
                dense(400, 120, WeightLayout::OutIn),
            ),
            LeNetVariant::Compact => (
                [conv(1, 6, 28, 0), conv(6, 16, 12, 0)],
                dense(256, 120, WeightLayout::InOut),
            ),
        };
        Self {
            convs,
            dense: [
                first,
                dense(120, 84, WeightLayout::InOut),
                dense(84, classes, WeightLayout::InOut),
            ],
        }
    }

    /// Element counts of every parameter, in visit order.
    pub(crate) fn param_lens(&self) -> Vec<usize> {
        let mut lens = Vec::new();
        for c in &self.convs {
            lens.extend([c.c_out * c.patch(), c.c_out]);
        }
        for d in &self.dense {
            lens.extend([d.inputs * d.outputs, d.outputs]);
        }
        lens
    }

    pub(crate) fn image_len(&self) -> usize {
        self.convs[0].input_len()
    }

    pub(crate) fn classes(&self) -> usize {
        self.dense[2].outputs
    }

    /// Shapes chain: each stage's pooled output is the next one's input.
    fn check(&self) {
        let [c1, c2] = &self.convs;
        assert!(c1.out() % 2 == 0 && c2.out() % 2 == 0, "odd pooling input");
        assert_eq!(c1.pooled_len(), c2.input_len());
        assert_eq!(c1.c_out, c2.c_in);
        assert_eq!(c2.pad, 0, "only the first stage may pad");
        assert_eq!(c2.pooled_len(), self.dense[0].inputs);
        assert_eq!(self.dense[0].outputs, self.dense[1].inputs);
        assert_eq!(self.dense[1].outputs, self.dense[2].inputs);
    }
}

/// Every buffer one forward and backward pass needs, for up to `capacity`
/// images; grown (never shrunk) when a larger batch comes.
#[derive(Default)]
pub(crate) struct Workspace {
    capacity: usize,
    /// The first stage's input with its zero border.
    padded: Vec<f32>,
    col: [Vec<f32>; 2],
    z: [Vec<f32>; 2],
    pooled: [Vec<f32>; 2],
    /// Post-activation outputs of the dense layers; the last holds logits.
    act: [Vec<f32>; 3],
    d_dense: [Vec<f32>; 2],
    d_pooled: [Vec<f32>; 2],
    d_z: Vec<f32>,
    d_col: Vec<f32>,
}

impl Workspace {
    fn reserve(&mut self, arch: &Arch, batch: usize) {
        if batch <= self.capacity {
            return;
        }
        self.capacity = batch;
        let grow = |v: &mut Vec<f32>, n: usize| v.resize(n, 0.0);
        let first = &arch.convs[0];
        grow(
            &mut self.padded,
            batch * first.c_in * first.padded() * first.padded(),
        );
        for (s, c) in arch.convs.iter().enumerate() {
            grow(&mut self.col[s], c.patch() * batch * c.positions());
            grow(&mut self.z[s], c.c_out * batch * c.positions());
            grow(&mut self.pooled[s], batch * c.pooled_len());
            grow(&mut self.d_pooled[s], batch * c.pooled_len());
        }
        let z_max = arch
            .convs
            .iter()
            .map(|c| c.c_out * batch * c.positions())
            .max()
            .unwrap_or(0);
        grow(&mut self.d_z, z_max);
        grow(
            &mut self.d_col,
            arch.convs[1].patch() * batch * arch.convs[1].positions(),
        );
        for (l, d) in arch.dense.iter().enumerate() {
            grow(&mut self.act[l], batch * d.outputs);
        }
        let widest = arch.dense.iter().map(|d| d.inputs.max(d.outputs)).max();
        for buffer in &mut self.d_dense {
            grow(buffer, batch * widest.unwrap_or(0));
        }
    }
}

/// The native LeNet: its architecture and working memory.
pub(crate) struct NativeLeNet {
    arch: Arch,
    work: Workspace,
}

impl NativeLeNet {
    pub(crate) fn new(arch: Arch) -> Self {
        arch.check();
        Self {
            arch,
            work: Workspace::default(),
        }
    }

    pub(crate) fn arch(&self) -> &Arch {
        &self.arch
    }

    /// Logits of `batch` images (`[B, 1, 28, 28]`), `[B, classes]` row-major.
    pub(crate) fn forward(&mut self, params: &[Vec<f32>], images: &[f32], batch: usize) -> &[f32] {
        super::simd::dispatch(
            #[inline(always)]
            || self.forward_here(params, images, batch),
        )
    }

    #[inline(always)]
    fn forward_here(&mut self, params: &[Vec<f32>], images: &[f32], batch: usize) -> &[f32] {
        let arch = &self.arch;
        assert_eq!(params.len(), 10, "LeNet has ten parameter tensors");
        assert_eq!(images.len(), batch * arch.image_len());
        self.work.reserve(arch, batch);
        let w = &mut self.work;
        for (s, shape) in arch.convs.iter().enumerate() {
            let (done, rest) = w.pooled.split_at_mut(s);
            let input = match (s, shape.pad) {
                (0, 0) => images,
                (0, _) => {
                    conv::pad(shape, batch, images, &mut w.padded);
                    &w.padded[..]
                }
                _ => &done[s - 1][..],
            };
            conv_forward(
                shape,
                batch,
                input,
                &params[2 * s],
                &mut w.col[s],
                &mut w.z[s],
            );
            conv::bias_relu_pool(shape, batch, &w.z[s], &params[2 * s + 1], &mut rest[0]);
        }
        for (l, shape) in arch.dense.iter().enumerate() {
            let (done, rest) = w.act.split_at_mut(l);
            let input = match l {
                0 => &w.pooled[1][..batch * shape.inputs],
                _ => &done[l - 1][..batch * shape.inputs],
            };
            let out = &mut rest[0][..batch * shape.outputs];
            dense_forward(
                shape,
                batch,
                input,
                &params[4 + 2 * l],
                &params[5 + 2 * l],
                out,
            );
            if l + 1 < arch.dense.len() {
                out.iter_mut().for_each(|v| *v = v.max(0.0));
            }
        }
        &w.act[2][..batch * arch.classes()]
    }

    /// Mean softmax cross-entropy of the last [`Self::forward`]'s logits
    /// against `labels`, and the gradient of every parameter into `grads`
    /// (overwritten, in visit order). Call right after `forward` on the same
    /// batch.
    pub(crate) fn backward(
        &mut self,
        params: &[Vec<f32>],
        labels: &[i64],
        grads: &mut [Vec<f32>],
    ) -> f32 {
        super::simd::dispatch(
            #[inline(always)]
            || self.backward_here(params, labels, grads),
        )
    }

    #[inline(always)]
    fn backward_here(
        &mut self,
        params: &[Vec<f32>],
        labels: &[i64],
        grads: &mut [Vec<f32>],
    ) -> f32 {
        let arch = &self.arch;
        let batch = labels.len();
        let w = &mut self.work;
        for (g, len) in grads.iter_mut().zip(arch.param_lens()) {
            g.resize(len, 0.0);
        }
        let classes = arch.classes();
        let loss = softmax_cross_entropy(
            &w.act[2][..batch * classes],
            labels,
            &mut w.d_dense[0][..batch * classes],
        );
        // Dense layers, last to first; `d_dense[0]` holds the gradient of
        // the current layer's output, `d_dense[1]` receives its input's.
        for l in (0..arch.dense.len()).rev() {
            let shape = &arch.dense[l];
            let input: &[f32] = if l == 0 {
                &w.pooled[1][..batch * shape.inputs]
            } else {
                &w.act[l - 1][..batch * shape.inputs]
            };
            let (gw, gb) = pair(grads, 4 + 2 * l);
            let [d_out, d_in] = &mut w.d_dense;
            dense_backward(shape, batch, input, &params[4 + 2 * l], d_out, d_in, gw, gb);
            if l > 0 {
                // Through the ReLU that produced this layer's input.
                for (d, a) in d_in[..batch * shape.inputs].iter_mut().zip(input) {
                    if *a <= 0.0 {
                        *d = 0.0;
                    }
                }
            }
            w.d_dense.swap(0, 1);
        }
        let first = batch * arch.dense[0].inputs;
        let [d_out, _] = &w.d_dense;
        w.d_pooled[1][..first].copy_from_slice(&d_out[..first]);
        for s in (0..arch.convs.len()).rev() {
            let shape = &arch.convs[s];
            let (gw, gb) = pair(grads, 2 * s);
            let bias = &params[2 * s + 1];
            conv::pool_backward(shape, batch, &w.z[s], bias, &w.d_pooled[s], &mut w.d_z, gb);
            let width = batch * shape.positions();
            let d_z = MatRef {
                data: &w.d_z[..shape.c_out * width],
                strides: Strides::row_major(width),
            };
            // The forward pass's column matrix is still in place.
            let col_t = MatRef {
                data: &w.col[s][..shape.patch() * width],
                strides: Strides::row_major(width).t(),
            };
            let dims = (shape.c_out, shape.patch(), width);
            matmul(
                dims,
                gw,
                Strides::row_major(shape.patch()),
                false,
                d_z,
                col_t,
            );
            if s > 0 {
                let weight_t = MatRef {
                    data: &params[2 * s],
                    strides: Strides::row_major(shape.patch()).t(),
                };
                let d_col = &mut w.d_col[..shape.patch() * width];
                let dims = (shape.patch(), width, shape.c_out);
                matmul(dims, d_col, Strides::row_major(width), false, weight_t, d_z);
                let (below, _) = w.d_pooled.split_at_mut(s);
                conv::col2im(shape, batch, d_col, &mut below[s - 1]);
            }
        }
        loss
    }
}

/// Two consecutive gradient buffers (a layer's weight and bias).
#[inline(always)]
fn pair(grads: &mut [Vec<f32>], at: usize) -> (&mut [f32], &mut [f32]) {
    let (weight, rest) = grads[at..].split_at_mut(1);
    (&mut weight[0], &mut rest[0])
}

#[inline(always)]
fn conv_forward(
    shape: &ConvShape,
    batch: usize,
    input: &[f32],
    weight: &[f32],
    col: &mut [f32],
    z: &mut [f32],
) {
    conv::im2col(shape, batch, input, col);
    let width = batch * shape.positions();
    let weight = MatRef {
        data: &weight[..shape.c_out * shape.patch()],
        strides: Strides::row_major(shape.patch()),
    };
    let col = MatRef {
        data: &col[..shape.patch() * width],
        strides: Strides::row_major(width),
    };
    let dims = (shape.c_out, width, shape.patch());
    matmul(dims, z, Strides::row_major(width), false, weight, col);
    debug_assert_eq!(shape.patch(), shape.c_in * K * K);
}

/// `out = input · W + bias` for `batch` rows.
#[inline(always)]
fn dense_forward(
    shape: &DenseShape,
    batch: usize,
    input: &[f32],
    weight: &[f32],
    bias: &[f32],
    out: &mut [f32],
) {
    for row in out.chunks_exact_mut(shape.outputs) {
        row.copy_from_slice(bias);
    }
    let x = MatRef {
        data: input,
        strides: Strides::row_major(shape.inputs),
    };
    let w = MatRef {
        data: weight,
        strides: shape.as_rhs(),
    };
    let dims = (batch, shape.outputs, shape.inputs);
    matmul(dims, out, Strides::row_major(shape.outputs), true, x, w);
}

/// Weight and bias gradients of a dense layer from its output's gradient
/// `d_out`, and its input's gradient into `d_in`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn dense_backward(
    shape: &DenseShape,
    batch: usize,
    input: &[f32],
    weight: &[f32],
    d_out: &[f32],
    d_in: &mut [f32],
    d_weight: &mut [f32],
    d_bias: &mut [f32],
) {
    let d_out = &d_out[..batch * shape.outputs];
    d_bias.fill(0.0);
    for row in d_out.chunks_exact(shape.outputs) {
        for (b, g) in d_bias.iter_mut().zip(row) {
            *b += g;
        }
    }
    let dy = MatRef {
        data: d_out,
        strides: Strides::row_major(shape.outputs),
    };
    let x_t = MatRef {
        data: input,
        strides: Strides::row_major(shape.inputs).t(),
    };
    let dims = (shape.inputs, shape.outputs, batch);
    matmul(dims, d_weight, shape.as_rhs(), false, x_t, dy);
    let w_t = MatRef {
        data: weight,
        strides: shape.as_rhs().t(),
    };
    let dims = (batch, shape.inputs, shape.outputs);
    let d_in = &mut d_in[..batch * shape.inputs];
    matmul(dims, d_in, Strides::row_major(shape.inputs), false, dy, w_t);
}

/// Mean cross-entropy of softmax(`logits`) against `labels`, and its
/// gradient with respect to the logits into `d_logits`.
#[inline(always)]
fn softmax_cross_entropy(logits: &[f32], labels: &[i64], d_logits: &mut [f32]) -> f32 {
    let batch = labels.len();
    let classes = logits.len() / batch.max(1);
    let scale = 1.0 / batch as f32;
    let mut total = 0.0f32;
    for ((row, d), &label) in logits
        .chunks_exact(classes)
        .zip(d_logits.chunks_exact_mut(classes))
        .zip(labels)
    {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (di, &v) in d.iter_mut().zip(row) {
            *di = (v - max).exp();
            sum += *di;
        }
        let label = label as usize;
        total += sum.ln() + max - row[label];
        for di in d.iter_mut() {
            *di *= scale / sum;
        }
        d[label] -= scale;
    }
    total * scale
}
