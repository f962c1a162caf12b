//! 2-D max pooling (any kernel and stride, no padding, dilation 1) as one
//! burn operation on the CPU, forward and backward.
//!
//! burn flex pools through its 3-D pooling with indices, a general loop that
//! took 12–15 % of `cnn`'s training step; here a window's maximum is one pass
//! over its rows, and the way back finds each window's winner again in the
//! saved input (the first maximum in row-major order, as PyTorch's CPU kernel
//! picks it) instead of keeping an index tensor.

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Backend, Flex, backend_extension, tensor::FloatTensor};
use burn::nn::PaddingConfig2d;
use burn::nn::pool::MaxPool2d;
use burn::tensor::{DType, Tensor};

use super::flex::{host, tensor};

/// The shapes of one pooling: `planes` images × channels of `height × width`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    pub planes: usize,
    pub height: usize,
    pub width: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
}

impl Window {
    /// Output height and width; `None` when the kernel does not fit or a
    /// stride or kernel side is zero.
    pub(crate) fn output(&self) -> Option<[usize; 2]> {
        let side = |size: usize, kernel: usize, stride: usize| {
            (stride > 0 && kernel > 0 && size >= kernel).then(|| (size - kernel) / stride + 1)
        };
        Some([
            side(self.height, self.kernel[0], self.stride[0])?,
            side(self.width, self.kernel[1], self.stride[1])?,
        ])
    }

    /// The offset in its plane of the first maximum of output `(oy, ox)`'s
    /// window.
    #[inline(always)]
    fn winner(&self, plane: &[f32], oy: usize, ox: usize) -> usize {
        let (y0, x0) = (oy * self.stride[0], ox * self.stride[1]);
        let mut best = y0 * self.width + x0;
        for y in y0..y0 + self.kernel[0] {
            let row = y * self.width;
            for at in row + x0..row + x0 + self.kernel[1] {
                if plane[at] > plane[best] {
                    best = at;
                }
            }
        }
        best
    }
}

impl Window {
    /// 2×2 windows at stride 2, every model's pooling: a pass over two rows
    /// at a time instead of [`Window::winner`]'s general loops.
    fn halving(&self) -> bool {
        self.kernel == [2, 2] && self.stride == [2, 2]
    }
}

/// The first maximum of `a[0], a[1], b[0], b[1]` (a 2×2 window's rows) and
/// its place in that order.
#[inline(always)]
fn first_max(a: &[f32], b: &[f32]) -> (f32, usize) {
    let (mut best, mut at) = (a[0], 0);
    if a[1] > best {
        (best, at) = (a[1], 1);
    }
    if b[0] > best {
        (best, at) = (b[0], 2);
    }
    if b[1] > best {
        (best, at) = (b[1], 3);
    }
    (best, at)
}

/// Each window's maximum: `x` `[planes, H, W]` into `out` `[planes, oh, ow]`.
pub(crate) fn forward(w: &Window, x: &[f32], out: &mut [f32]) {
    let [oh, ow] = w.output().expect("a valid pooling window");
    let plane_len = w.height * w.width;
    assert_eq!(x.len(), w.planes * plane_len, "input length");
    assert_eq!(out.len(), w.planes * oh * ow, "output length");
    if w.halving() {
        for (index, line) in out.chunks_exact_mut(ow.max(1)).enumerate() {
            let start = ((index / oh) * w.height + 2 * (index % oh)) * w.width;
            let (top, bottom) = x[start..start + 2 * w.width].split_at(w.width);
            let pairs = top.chunks_exact(2).zip(bottom.chunks_exact(2));
            for (d, (a, b)) in line.iter_mut().zip(pairs) {
                *d = first_max(a, b).0;
            }
        }
        return;
    }
    for (plane, dst) in x
        .chunks_exact(plane_len.max(1))
        .zip(out.chunks_exact_mut((oh * ow).max(1)))
    {
        for (oy, line) in dst.chunks_exact_mut(ow).enumerate() {
            for (ox, d) in line.iter_mut().enumerate() {
                *d = plane[w.winner(plane, oy, ox)];
            }
        }
    }
}

/// The input gradient: each output's gradient added to its window's winner.
/// Overwrites `d_x`.
pub(crate) fn backward(w: &Window, x: &[f32], d_out: &[f32], d_x: &mut [f32]) {
    let [oh, ow] = w.output().expect("a valid pooling window");
    let plane_len = w.height * w.width;
    assert_eq!(x.len(), w.planes * plane_len, "input length");
    assert_eq!(d_x.len(), x.len(), "input gradient length");
    assert_eq!(d_out.len(), w.planes * oh * ow, "output gradient length");
    // Halving windows tile a plane of even sides, and every value of it is
    // written below; otherwise some keep a zero.
    let tiled = w.halving() && w.height.is_multiple_of(2) && w.width.is_multiple_of(2);
    if !tiled {
        d_x.fill(0.0);
    }
    if w.halving() {
        // Rows and columns past the last window (odd sides) keep their zeros.
        for (index, line) in d_out.chunks_exact(ow.max(1)).enumerate() {
            let start = ((index / oh) * w.height + 2 * (index % oh)) * w.width;
            let (top, bottom) = x[start..start + 2 * w.width].split_at(w.width);
            let rows = &mut d_x[start..start + 2 * w.width];
            let (d_top, d_bottom) = rows.split_at_mut(w.width);
            let mut halving = HalvingLine {
                top,
                bottom,
                grads: line,
                d_top,
                d_bottom,
            };
            let done = halving_backward_wide(&mut halving);
            let (top, bottom) = (&top[2 * done..], &bottom[2 * done..]);
            let (d_top, d_bottom) = (
                &mut halving.d_top[2 * done..],
                &mut halving.d_bottom[2 * done..],
            );
            let pairs = top.chunks_exact(2).zip(bottom.chunks_exact(2));
            let d_pairs = d_top.chunks_exact_mut(2).zip(d_bottom.chunks_exact_mut(2));
            for ((g, (a, b)), (d_a, d_b)) in line[done..].iter().zip(pairs).zip(d_pairs) {
                let [p, q, r, t] = [a[0], a[1], b[0], b[1]];
                let wins = window_winners([p, q, r, t]);
                let pick = |k: usize| if wins[k] { *g } else { 0.0 };
                (d_a[0], d_a[1], d_b[0], d_b[1]) = (pick(0), pick(1), pick(2), pick(3));
            }
        }
        return;
    }
    let planes = x
        .chunks_exact(plane_len.max(1))
        .zip(d_x.chunks_exact_mut(plane_len.max(1)))
        .zip(d_out.chunks_exact((oh * ow).max(1)));
    for ((plane, d_plane), grads) in planes {
        for (oy, line) in grads.chunks_exact(ow).enumerate() {
            for (ox, g) in line.iter().enumerate() {
                d_plane[w.winner(plane, oy, ox)] += g;
            }
        }
    }
}

/// Which of a 2×2 window's values `[top left, top right, bottom left,
/// bottom right]` is its first maximum in row-major order: the value above
/// every earlier one and not below any later one. Comparisons and selects,
/// no branch on the winner (which is random, so mispredicted); a window
/// holding a NaN may have no winner, as in the AVX2 version.
#[inline(always)]
fn window_winners([p, q, r, t]: [f32; 4]) -> [bool; 4] {
    [
        (p >= q) & (p >= r) & (p >= t),
        (q > p) & (q >= r) & (q >= t),
        (r > p) & (r > q) & (r >= t),
        (t > p) & (t > q) & (t > r),
    ]
}

/// One output line of a 2×2, stride-2 pooling's way back: the window
/// rows of the input, the line's gradients, and the rows' gradients to
/// write.
struct HalvingLine<'a> {
    top: &'a [f32],
    bottom: &'a [f32],
    grads: &'a [f32],
    d_top: &'a mut [f32],
    d_bottom: &'a mut [f32],
}

/// The first windows of a line done by [`halving_backward_avx2`]: how many,
/// 0 on a CPU without AVX2.
#[inline(always)]
fn halving_backward_wide(line: &mut HalvingLine<'_>) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU was just found to have AVX2.
        return unsafe { halving_backward_avx2(line) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = line;
    0
}

/// [`window_winners`] for four windows at a time, eight lanes wide: each
/// value is compared with its pair's other value (swapped within the pair)
/// and with the other row's two, the first of a pair winning ties. A
/// compiler does not vectorize the scalar loop (its windows interleave), and
/// it was 9 % of cnn's training step. Returns the windows done (a multiple
/// of 4); the caller does the rest. The same comparisons (ordered, so false
/// on a NaN) and the gradient's own bits where a value wins, so the result is
/// the scalar loop's, bit for bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn halving_backward_avx2(line: &mut HalvingLine<'_>) -> usize {
    use std::arch::x86_64::*;
    let HalvingLine {
        top,
        bottom,
        grads,
        d_top,
        d_bottom,
    } = line;
    let blocks = grads.len() / 4;
    let floats = 8 * blocks;
    assert!(top.len() >= floats && bottom.len() >= floats, "input rows");
    assert!(
        d_top.len() >= floats && d_bottom.len() >= floats,
        "gradient rows"
    );
    // Odd lanes (a pair's second value) must beat the first; even lanes tie-win.
    let pair_wins = |a: __m256, swapped: __m256| {
        _mm256_blend_ps::<0b1010_1010>(
            _mm256_cmp_ps::<_CMP_GE_OQ>(a, swapped),
            _mm256_cmp_ps::<_CMP_GT_OQ>(a, swapped),
        )
    };
    for block in 0..blocks {
        let (at, g_at) = (8 * block, 4 * block);
        // SAFETY: `at + 8 <= floats` and `g_at + 4 <= grads.len()`, checked above.
        let (t, b, g) = unsafe {
            (
                _mm256_loadu_ps(top.as_ptr().add(at)),
                _mm256_loadu_ps(bottom.as_ptr().add(at)),
                _mm_loadu_ps(grads.as_ptr().add(g_at)),
            )
        };
        let t_swapped = _mm256_permute_ps::<0b10_11_00_01>(t);
        let b_swapped = _mm256_permute_ps::<0b10_11_00_01>(b);
        // The top row is earlier than the bottom: it wins ties with it.
        let t_wins = _mm256_and_ps(
            pair_wins(t, t_swapped),
            _mm256_and_ps(
                _mm256_cmp_ps::<_CMP_GE_OQ>(t, b),
                _mm256_cmp_ps::<_CMP_GE_OQ>(t, b_swapped),
            ),
        );
        let b_wins = _mm256_and_ps(
            pair_wins(b, b_swapped),
            _mm256_and_ps(
                _mm256_cmp_ps::<_CMP_GT_OQ>(b, t),
                _mm256_cmp_ps::<_CMP_GT_OQ>(b, t_swapped),
            ),
        );
        // Each window's gradient in both lanes of its pair.
        let g = _mm256_set_m128(_mm_unpackhi_ps(g, g), _mm_unpacklo_ps(g, g));
        // SAFETY: as for the loads.
        unsafe {
            _mm256_storeu_ps(d_top.as_mut_ptr().add(at), _mm256_and_ps(t_wins, g));
            _mm256_storeu_ps(d_bottom.as_mut_ptr().add(at), _mm256_and_ps(b_wins, g));
        }
    }
    4 * blocks
}

/// Max pooling on burn's CPU backend, with or without autodiff.
#[backend_extension(Flex, Autodiff)]
pub trait NativeMaxPool2d: Backend {
    /// `x` `[B, C, H, W]` pooled by `kernel` windows at `stride`, no padding.
    fn native_max_pool2d(
        x: FloatTensor<Self>,
        kernel: [usize; 2],
        stride: [usize; 2],
    ) -> FloatTensor<Self>;
}

/// `pool.forward(x)`, through cohort's kernel where it applies (float32 on
/// burn's CPU device with the native kernels on, no padding, dilation 1,
/// floor mode, a window that fits), else through burn's. The same values
/// either way: a maximum rounds nothing.
pub fn max_pool2d(pool: &MaxPool2d, x: Tensor<4>) -> Tensor<4> {
    let [_, _, height, width] = x.dims();
    let window = Window {
        planes: 0,
        height,
        width,
        kernel: pool.kernel_size,
        stride: pool.stride,
    };
    if !super::enabled_on(&x.device())
        || x.dtype() != DType::F32
        || !matches!(pool.padding, PaddingConfig2d::Valid)
        || pool.dilation != [1, 1]
        || pool.ceil_mode
        || window.output().is_none()
    {
        return pool.forward(x);
    }
    type D = burn::backend::Dispatch;
    Tensor::from_dispatch(<D as NativeMaxPool2d>::native_max_pool2d(
        x.into_dispatch(),
        pool.kernel_size,
        pool.stride,
    ))
}

fn window_of(x: &FlexTensor, kernel: [usize; 2], stride: [usize; 2]) -> (Window, [usize; 4]) {
    let [batch, channels, height, width] = x.layout().shape().dims();
    let window = Window {
        planes: batch * channels,
        height,
        width,
        kernel,
        stride,
    };
    let [oh, ow] = window
        .output()
        .expect("max_pool2d: the window does not fit the input");
    (window, [batch, channels, oh, ow])
}

impl NativeMaxPool2d for Flex {
    fn native_max_pool2d(x: FlexTensor, kernel: [usize; 2], stride: [usize; 2]) -> FlexTensor {
        let (window, dims) = window_of(&x, kernel, stride);
        let x = x.to_contiguous();
        let mut out = vec![0.0f32; dims.iter().product()];
        super::simd::dispatch(
            #[inline(always)]
            || forward(&window, host(&x), &mut out),
        );
        tensor(out, dims.to_vec())
    }
}

#[derive(Debug, Clone)]
struct Saved {
    x: NodeId,
    kernel: [usize; 2],
    stride: [usize; 2],
}

#[derive(Debug)]
struct MaxPoolBackward;

impl Backward<Flex, 1> for MaxPoolBackward {
    type State = Saved;

    fn backward(self, ops: Ops<Saved, 1>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<Flex>(&ops.node).to_contiguous();
        let saved = ops.state;
        let x = checkpointer.retrieve_node_output::<FlexTensor>(saved.x);
        let (window, _) = window_of(&x, saved.kernel, saved.stride);
        let dims = x.layout().shape().to_vec();
        let x = x.to_contiguous();
        let mut d_x = vec![0.0f32; host(&x).len()];
        super::simd::dispatch(
            #[inline(always)]
            || backward(&window, host(&x), host(&grad), &mut d_x),
        );
        let [node_x] = ops.parents;
        if let Some(node) = node_x {
            grads.register::<Flex>(node.id, tensor(d_x, dims));
        }
    }
}

type AdTensor = FloatTensor<Autodiff<Flex>>;

impl<C: CheckpointStrategy> NativeMaxPool2d for Autodiff<Flex, C> {
    fn native_max_pool2d(x: AdTensor, kernel: [usize; 2], stride: [usize; 2]) -> AdTensor {
        let forward = || Flex::native_max_pool2d(x.primitive().clone(), kernel, stride);
        match MaxPoolBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let state = Saved {
                    x: prep.checkpoint(&x),
                    kernel,
                    stride,
                };
                prep.finish(state, forward())
            }
            OpsKind::UnTracked(prep) => prep.finish(forward()),
        }
    }
}

#[cfg(test)]
mod tests {
    //! Against burn-nn's MaxPool2d under autodiff on random inputs (distinct
    //! values, so every window has one winner): the same output and input
    //! gradient, bit for bit, since a maximum and a routed gradient round
    //! nothing.

    use burn::nn::pool::MaxPool2dConfig;
    use burn::tensor::{Tensor, TensorData};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn run(
        shape: [usize; 4],
        kernel: [usize; 2],
        stride: [usize; 2],
        native: bool,
    ) -> [Vec<f32>; 2] {
        let device = crate::device::cpu().autodiff();
        let mut rng = ChaCha8Rng::seed_from_u64(shape.iter().product::<usize>() as u64);
        let len: usize = shape.iter().product();
        let values: Vec<f32> = (0..len).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let pool = MaxPool2dConfig::new(kernel).with_strides(stride).init();
        let x = Tensor::<4>::from_data(TensorData::new(values, shape), &device).require_grad();
        let out = if native {
            super::max_pool2d(&pool, x.clone())
        } else {
            pool.forward(x.clone())
        };
        let weights: Vec<f32> = (0..out.dims().iter().product::<usize>())
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let r = Tensor::<4>::from_data(TensorData::new(weights, out.dims()), &device);
        let grads = (out.clone() * r).sum().backward();
        let host = |t: Tensor<4>| t.into_data().try_to_vec::<f32>().unwrap();
        [host(out), host(x.grad(&grads).unwrap())]
    }

    /// The way back of 2×2 windows at stride 2, eight lanes wide where the
    /// CPU has AVX2, against [`super::window_winners`] window by window, bit
    /// for bit: values from a small set so that windows tie, with NaNs and
    /// both zeros, and widths that leave 0 to 3 windows past the last block
    /// of four.
    #[test]
    fn halving_way_back_is_the_scalar_rule_bit_for_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let choices = [-1.0f32, -0.0, 0.0, 1.0, 2.0, f32::NAN];
        for width in [2usize, 3, 8, 9, 10, 14, 16, 17, 28, 30] {
            let (height, planes) = (6, 3);
            let window = super::Window {
                planes,
                height,
                width,
                kernel: [2, 2],
                stride: [2, 2],
            };
            let [oh, ow] = window.output().unwrap();
            let x: Vec<f32> = (0..planes * height * width)
                .map(|_| choices[rng.random_range(0..choices.len())])
                .collect();
            let d_out: Vec<f32> = (0..planes * oh * ow)
                .map(|i| match i % 7 {
                    0 => -0.0,
                    _ => rng.random_range(-1.0f32..1.0),
                })
                .collect();
            let mut d_x = vec![f32::NAN; x.len()];
            super::backward(&window, &x, &d_out, &mut d_x);
            let mut expected = vec![0.0f32; x.len()];
            for plane in 0..planes {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let top = (plane * height + 2 * oy) * width + 2 * ox;
                        let at = [top, top + 1, top + width, top + width + 1];
                        let wins = super::window_winners(at.map(|i| x[i]));
                        let g = d_out[(plane * oh + oy) * ow + ox];
                        for (&i, won) in at.iter().zip(wins) {
                            expected[i] = if won { g } else { 0.0 };
                        }
                    }
                }
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&d_x), bits(&expected), "width {width}");
        }
    }

    #[test]
    fn output_and_input_gradient_are_burns() {
        let cases = [
            ([2, 3, 8, 8], [2, 2], [2, 2]),
            ([1, 4, 7, 9], [2, 2], [2, 2]),
            ([2, 3, 14, 14], [2, 2], [2, 2]),
            ([1, 2, 5, 3], [2, 2], [2, 2]),
            ([2, 2, 9, 9], [3, 3], [2, 2]),
            ([1, 1, 5, 6], [3, 2], [1, 2]),
            ([3, 2, 4, 4], [4, 4], [4, 4]),
        ];
        for (shape, kernel, stride) in cases {
            let ours = run(shape, kernel, stride, true);
            let burns = run(shape, kernel, stride, false);
            assert_eq!(
                ours[0], burns[0],
                "output of {shape:?} {kernel:?}/{stride:?}"
            );
            assert_eq!(
                ours[1], burns[1],
                "gradient of {shape:?} {kernel:?}/{stride:?}"
            );
        }
    }

    #[test]
    fn ties_send_the_gradient_to_the_first_maximum() {
        let window = super::Window {
            planes: 1,
            height: 2,
            width: 4,
            kernel: [2, 2],
            stride: [2, 2],
        };
        let x = [1.0, 3.0, 0.0, 0.0, 3.0, 2.0, 0.0, 0.0];
        let mut out = [0.0; 2];
        super::forward(&window, &x, &mut out);
        assert_eq!(out, [3.0, 0.0]);
        let mut d_x = [9.0; 8];
        super::backward(&window, &x, &[1.0, 2.0], &mut d_x);
        assert_eq!(d_x, [0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        // The general path (one 2×4 window) picks the same first maximum.
        let whole = super::Window {
            kernel: [2, 4],
            stride: [2, 4],
            ..window
        };
        let mut out = [0.0; 1];
        super::forward(&whole, &x, &mut out);
        assert_eq!(out, [3.0]);
        super::backward(&whole, &x, &[5.0], &mut d_x);
        assert_eq!(d_x, [0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }
}
