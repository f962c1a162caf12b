//! The general convolution as a burn operation, with its own backward
//! pass: a backend extension implemented for burn's CPU backend (flex) and
//! for autodiff over it, so a model's parameters stay burn `Param`s and
//! every optimizer, gradient term and clipping sees ordinary gradients.
//!
//! burn flex computes a convolution's weight gradient as a convolution whose
//! kernel is the size of the feature map and its input gradient as a
//! transposed convolution (burn-backend's defaults), each much slower on one
//! thread than the matrix products used here. Each pass goes the way that
//! is fastest for its shapes ([`Route`]): Winograd's F(2 × 2, 3 × 3)
//! ([`super::winograd`]), the column-free kernel ([`super::direct`]), one
//! product per kernel offset over shifted copies ([`super::shifted`]), or
//! im2col and one product ([`super::im2col`]).
//!
//! [`conv2d`] is the entry point for models: it takes burn's [`Conv2d`] as it
//! is and falls back to burn's own path wherever this one does not apply (a
//! GPU, `TrainSwitches::native_kernels` off, dilation or groups, a dtype
//! other than float32).

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Backend, Flex, backend_extension, tensor::FloatTensor};
use burn::nn::PaddingConfig2d;
use burn::nn::conv::Conv2d;
use burn::tensor::{DType, Tensor};

use super::flex::{host, tensor};
use super::im2col::{self, Geometry, Grads};
use super::{direct, shifted, winograd};

/// The convolution on burn's CPU backend, with or without autodiff. Two
/// operations, since the extension macro of burn 0.22 does not pass an
/// optional tensor through to the backend.
#[backend_extension(Flex, Autodiff)]
pub trait NativeConv2d: Backend {
    /// `x` `[B, C_in, H, W]` convolved with `weight` `[C_out, C_in, kh, kw]`
    /// at `stride` with zero `padding` `[(top, bottom), (left, right)]`.
    fn native_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        stride: [usize; 2],
        padding: [(usize, usize); 2],
    ) -> FloatTensor<Self>;

    /// [`NativeConv2d::native_conv2d`] plus `bias` `[C_out]`.
    fn native_conv2d_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        stride: [usize; 2],
        padding: [(usize, usize); 2],
    ) -> FloatTensor<Self>;
}

/// The native convolution of dispatch tensors (`bias` optional).
pub(crate) fn native(
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    stride: [usize; 2],
    padding: [(usize, usize); 2],
) -> Tensor<4> {
    type D = burn::backend::Dispatch;
    let (x, weight) = (x.into_dispatch(), weight.into_dispatch());
    Tensor::from_dispatch(match bias {
        Some(bias) => <D as NativeConv2d>::native_conv2d_bias(
            x,
            weight,
            bias.into_dispatch(),
            stride,
            padding,
        ),
        None => <D as NativeConv2d>::native_conv2d(x, weight, stride, padding),
    })
}

/// `conv.forward(x)`, through cohort's convolution where it applies (float32
/// on burn's CPU device with the native kernels on, dilation 1, one group),
/// else through burn's. The same numbers either way, up to rounding.
pub fn conv2d(conv: &Conv2d, x: Tensor<4>) -> Tensor<4> {
    let device = x.device();
    let applies = super::enabled_on(&device)
        && conv.dilation == [1, 1]
        && conv.groups == 1
        && x.dtype() == DType::F32
        && conv.weight.val().dtype() == DType::F32;
    if !applies {
        return conv.forward(x);
    }
    let [_, _, height, width] = x.dims();
    let padding = padding_pairs(
        &conv.padding,
        [height, width],
        conv.kernel_size,
        conv.stride,
    );
    let bias = conv.bias.as_ref().map(|b| b.val());
    native(x, conv.weight.val(), bias, conv.stride, padding)
}

/// burn's `Conv2d` padding as `[(top, bottom), (left, right)]` for an input
/// of `size`: what burn-nn computes in `Conv2d::forward` (crate-private
/// there), "same" putting an odd extra row or column at the end as ONNX does.
fn padding_pairs(
    padding: &PaddingConfig2d,
    size: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
) -> [(usize, usize); 2] {
    let same = |size: usize, kernel: usize, stride: usize| {
        let out = size.div_ceil(stride);
        let total = if out > 0 {
            ((out - 1) * stride + kernel).saturating_sub(size)
        } else {
            0
        };
        (total / 2, total - total / 2)
    };
    match padding {
        PaddingConfig2d::Valid => [(0, 0), (0, 0)],
        PaddingConfig2d::Same => [
            same(size[0], kernel[0], stride[0]),
            same(size[1], kernel[1], stride[1]),
        ],
        PaddingConfig2d::Explicit(top, left, bottom, right) => [(*top, *bottom), (*left, *right)],
    }
}

/// The geometry of `x` and `weight`.
///
/// # Panics
/// When the shapes do not make a convolution (burn's own `conv2d` panics on
/// the same shapes).
fn geometry(
    x: &FlexTensor,
    weight: &FlexTensor,
    stride: [usize; 2],
    pad: [(usize, usize); 2],
) -> Geometry {
    let [batch, c_in, height, width] = x.layout().shape().dims();
    let [c_out, w_in, kh, kw] = weight.layout().shape().dims();
    assert_eq!(
        c_in, w_in,
        "conv2d: input has {c_in} channels, weight {w_in}"
    );
    let g = Geometry {
        batch,
        c_in,
        height,
        width,
        c_out,
        kernel: [kh, kw],
        stride,
        pad,
    };
    assert!(
        g.output().is_some(),
        "conv2d: kernel {kh}×{kw} does not fit input {height}×{width} with padding {pad:?}"
    );
    g
}

/// The values of a float32 tensor, contiguous.
fn values(tensor: &FlexTensor) -> FlexTensor {
    tensor.to_contiguous()
}

impl NativeConv2d for Flex {
    fn native_conv2d(
        x: FlexTensor,
        weight: FlexTensor,
        stride: [usize; 2],
        padding: [(usize, usize); 2],
    ) -> FlexTensor {
        flex_forward(x, weight, None, stride, padding)
    }

    fn native_conv2d_bias(
        x: FlexTensor,
        weight: FlexTensor,
        bias: FlexTensor,
        stride: [usize; 2],
        padding: [(usize, usize); 2],
    ) -> FlexTensor {
        flex_forward(x, weight, Some(bias), stride, padding)
    }
}

fn flex_forward(
    x: FlexTensor,
    weight: FlexTensor,
    bias: Option<FlexTensor>,
    stride: [usize; 2],
    padding: [(usize, usize); 2],
) -> FlexTensor {
    let g = geometry(&x, &weight, stride, padding);
    let [out_h, out_w] = g.output().expect("checked by geometry");
    let (x, weight) = (values(&x), values(&weight));
    let bias = bias.as_ref().map(values);
    let mut out = vec![0.0f32; g.batch * g.output_len()];
    let (x, weight, bias) = (host(&x), host(&weight), bias.as_ref().map(host));
    let route = Route::input(&g);
    timed("forward", &g, (route, None), || {
        super::simd::dispatch(
            #[inline(always)]
            || route.forward(&g, x, weight, bias, &mut out),
        );
    });
    tensor(out, vec![g.batch, g.c_out, out_h, out_w])
}

/// `run()`, and with this module's `trace` events on (`RUST_LOG=
/// cohort_train::kernels::conv2d=trace cohort run …`), one event with its
/// shapes, routes (the input's; the weight gradient's on the backward pass)
/// and milliseconds:
/// a route's cost inside a model, which `conv_passes` can misjudge (its
/// planar Winograd layout's backward pass took 3.0 ms there and 3.6 in
/// resnet_20; docs/BENCHMARKS.md, "What is left of resnet_20's step").
#[inline(always)]
fn timed(pass: &'static str, g: &Geometry, routes: (Route, Option<Route>), run: impl FnOnce()) {
    if !tracing::enabled!(tracing::Level::TRACE) {
        return run();
    }
    let started = std::time::Instant::now();
    run();
    tracing::trace!(
        pass,
        batch = g.batch,
        c_in = g.c_in,
        c_out = g.c_out,
        height = g.height,
        width = g.width,
        kernel = ?g.kernel,
        stride = ?g.stride,
        input_route = ?routes.0,
        weight_route = ?routes.1,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "convolution"
    );
}

/// Which kernel computes a pass of a convolution: each is fastest on some
/// shapes (docs/BENCHMARKS.md, "Each pass where it is fastest").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// [`winograd`]: 3 × 3 kernels of stride 1 and padding 1, from 512
    /// pairs of channels.
    Winograd,
    /// [`direct`]: few channel pairs on maps of 8 × 8 and more.
    ColumnFree,
    /// [`shifted`]: many channels, or maps too small for the column-free
    /// kernel.
    Shifted,
    /// [`im2col`]: everything else (strides, a first layer's few channels,
    /// pointwise kernels).
    Columns,
}

impl Route {
    /// The route of the forward pass, and of the input gradient with it.
    fn input(g: &Geometry) -> Self {
        if winograd::fastest(g) {
            Self::Winograd
        } else if direct::applies(g) {
            Self::ColumnFree
        } else if shifted::applies(g) {
            Self::Shifted
        } else {
            Self::Columns
        }
    }

    /// The route of the weight gradient.
    fn weight_gradient(g: &Geometry) -> Self {
        if winograd::fastest_for_weight_gradient(g) {
            Self::Winograd
        } else if shifted::applies_to_weight_gradient(g) {
            Self::Shifted
        } else if direct::applies(g) {
            Self::ColumnFree
        } else {
            Self::Columns
        }
    }

    #[inline(always)]
    fn forward(
        self,
        g: &Geometry,
        x: &[f32],
        weight: &[f32],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        match self {
            Self::Winograd => winograd::forward(g, x, weight, bias, out),
            Self::ColumnFree => direct::forward(g, x, weight, bias, out, direct::Kernel::Wide),
            Self::Shifted => shifted::forward(g, x, weight, bias, out),
            Self::Columns => im2col::forward(g, x, weight, bias, out),
        }
    }

    /// The gradients asked for in `grads`; nothing when none is.
    #[inline(always)]
    fn backward(self, g: &Geometry, x: &[f32], weight: &[f32], d_out: &[f32], grads: Grads<'_>) {
        if !grads.any() {
            return;
        }
        match self {
            Self::Winograd => winograd::backward(g, x, weight, d_out, grads),
            Self::ColumnFree => direct::backward(g, x, weight, d_out, grads, direct::Kernel::Wide),
            Self::Shifted => shifted::backward(g, x, weight, d_out, grads),
            Self::Columns => im2col::backward(g, x, weight, d_out, grads),
        }
    }
}

/// What the backward pass needs besides the saved tensors.
#[derive(Debug, Clone)]
struct Saved {
    x: NodeId,
    weight: NodeId,
    stride: [usize; 2],
    padding: [(usize, usize); 2],
}

impl Saved {
    fn new(x: NodeId, weight: NodeId, stride: [usize; 2], padding: [(usize, usize); 2]) -> Self {
        Self {
            x,
            weight,
            stride,
            padding,
        }
    }
}

/// The gradients of the parents that need one, registered in `grads`.
fn backward_into(
    saved: Saved,
    parents: &[Option<NodeId>],
    grad: FlexTensor,
    grads: &mut Gradients,
    checkpointer: &mut Checkpointer,
) {
    let x = checkpointer.retrieve_node_output::<FlexTensor>(saved.x);
    let weight = checkpointer.retrieve_node_output::<FlexTensor>(saved.weight);
    let g = geometry(&x, &weight, saved.stride, saved.padding);
    let (x, weight, grad) = (values(&x), values(&weight), values(&grad));
    let wants = |i: usize| parents.get(i).is_some_and(Option::is_some);
    let mut d_input = wants(0).then(|| vec![0.0f32; g.batch * g.input_len()]);
    let mut d_weight = wants(1).then(|| vec![0.0f32; g.weight_len()]);
    let mut d_bias = wants(2).then(|| vec![0.0f32; g.c_out]);
    let to_compute = Grads {
        input: d_input.as_deref_mut(),
        weight: d_weight.as_deref_mut(),
        bias: d_bias.as_deref_mut(),
    };
    let (x, weight, grad) = (host(&x), host(&weight), host(&grad));
    let (input_route, weight_route) = (Route::input(&g), Route::weight_gradient(&g));
    timed("backward", &g, (input_route, Some(weight_route)), || {
        super::simd::dispatch(
            #[inline(always)]
            || {
                if input_route == weight_route {
                    input_route.backward(&g, x, weight, grad, to_compute);
                } else {
                    let [input_part, weight_part] = to_compute.split();
                    input_route.backward(&g, x, weight, grad, input_part);
                    weight_route.backward(&g, x, weight, grad, weight_part);
                }
            },
        );
    });
    let shapes = [
        vec![g.batch, g.c_in, g.height, g.width],
        vec![g.c_out, g.c_in, g.kernel[0], g.kernel[1]],
        vec![g.c_out],
    ];
    for ((parent, values), shape) in parents.iter().zip([d_input, d_weight, d_bias]).zip(shapes) {
        if let (Some(id), Some(values)) = (parent, values) {
            grads.register::<Flex>(*id, tensor(values, shape));
        }
    }
}

#[derive(Debug)]
struct ConvBackward;

impl Backward<Flex, 2> for ConvBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node);
        let parents = ops
            .parents
            .each_ref()
            .map(|p| p.as_ref().map(|node| node.id));
        backward_into(ops.state, &parents, grad, grads, checkpointer);
    }
}

#[derive(Debug)]
struct ConvBiasBackward;

impl Backward<Flex, 3> for ConvBiasBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node);
        let parents = ops
            .parents
            .each_ref()
            .map(|p| p.as_ref().map(|node| node.id));
        backward_into(ops.state, &parents, grad, grads, checkpointer);
    }
}

type AdTensor = FloatTensor<Autodiff<Flex>>;

impl<C: CheckpointStrategy> NativeConv2d for Autodiff<Flex, C> {
    fn native_conv2d(
        x: AdTensor,
        weight: AdTensor,
        stride: [usize; 2],
        padding: [(usize, usize); 2],
    ) -> AdTensor {
        let forward = || {
            let (x, w) = (x.primitive().clone(), weight.primitive().clone());
            Flex::native_conv2d(x, w, stride, padding)
        };
        match ConvBackward
            .prepare::<C>([x.node(), weight.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = Saved::new(
                    prep.checkpoint(&x),
                    prep.checkpoint(&weight),
                    stride,
                    padding,
                );
                prep.finish(state, forward())
            }
            OpsKind::UnTracked(prep) => prep.finish(forward()),
        }
    }

    fn native_conv2d_bias(
        x: AdTensor,
        weight: AdTensor,
        bias: AdTensor,
        stride: [usize; 2],
        padding: [(usize, usize); 2],
    ) -> AdTensor {
        let forward = || {
            let (x, w) = (x.primitive().clone(), weight.primitive().clone());
            Flex::native_conv2d_bias(x, w, bias.primitive().clone(), stride, padding)
        };
        match ConvBiasBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = Saved::new(
                    prep.checkpoint(&x),
                    prep.checkpoint(&weight),
                    stride,
                    padding,
                );
                prep.finish(state, forward())
            }
            OpsKind::UnTracked(prep) => prep.finish(forward()),
        }
    }
}
