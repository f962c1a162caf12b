//! A stride-1 convolution as one matrix product per kernel offset, over
//! copies of the input shifted along the rows: forward, input gradient, and
//! weight and bias gradients, NCHW in and out as [`super::im2col`].
//!
//! im2col multiplies by a column matrix that holds every input value
//! `kh·kw` times, zeros included where an offset reads the padding: on the
//! 4 × 4 and 2 × 2 maps of VGG's and ResNet-18's last layers a third and
//! more than half of its products are by zero (a 2 × 2 map reads 16 of the
//! 36 values of its padded 3 × 3 neighbourhoods). Here a group of images
//! is laid out position-major (`[C_in, H, W, images]`: a position's images
//! side by side), so that an offset `(ky, kx)` reads whole rows of the
//! layout: the output rows whose input row `y + ky − top` lies in the
//! image are one contiguous range of columns, and a product
//! `W[:, :, ky, kx] · X_kx` over just those columns skips the padding
//! rows. Only the horizontal shift needs copies: `X_kx` is the input moved
//! by `kx − left` positions along each row, zeros at its ends (`kw`
//! copies, the unmoved one the layout itself where the output is as wide
//! as the input). A 3 × 3 kernel on a 2 × 2 map then multiplies 24 values
//! per output neighbourhood instead of 36, on a 4 × 4 map 120 instead of
//! 144 per 16 positions.
//!
//! Each product runs through [`super::gemm`]; one thread, an order fixed by
//! the shapes, the same bits on every run. The bias gradient is im2col's.
//! Where it applies: [`applies`].

use super::direct::{sized, with_buffers};
use super::gemm::{MatRef, Strides, matmul, transpose_into};
use super::im2col::{Geometry, Grads, add_bias, check, valid};

/// Columns (positions × images) of one group's products: enough for
/// gemm's micro-kernel to run at speed over `K = C_in` and few enough that
/// the group's copies stay in the caches.
const COLUMNS_PER_GROUP: usize = 2048;
/// Fewer input channels make each offset's product too short (`K = C_in`)
/// for gemm to run at speed; im2col's single product over `C_in·kh·kw`
/// rows is faster there.
const MIN_INPUT_CHANNELS: usize = 32;

/// Whether this convolution runs here: stride 1, a kernel larger than 1 × 1
/// (a pointwise convolution has nothing to shift), at least
/// [`MIN_INPUT_CHANNELS`] input channels and a valid geometry. The caller
/// prefers [`super::direct`] where that applies.
pub(crate) fn applies(g: &Geometry) -> bool {
    g.stride == [1, 1] && g.kernel != [1, 1] && g.c_in >= MIN_INPUT_CHANNELS && g.output().is_some()
}

/// The most output positions of a map whose weight gradient runs here.
/// On 4 × 4 and 2 × 2 maps im2col's product sums a third to more than half
/// zeros and this path's is as fast or faster (`cargo bench -p
/// cohort-train --bench conv_passes`, batch 32: 512 → 512 at 2 × 2 12.9 ms
/// against 13.8, 256 → 512 at 4 × 4 12.2 against 14.4, 512 → 512 at 4 × 4
/// 28.0 against 27.1); from 8 × 8 on im2col's is as fast or faster (64 →
/// 128 at 16 × 16: 18.9 against 14.1).
const MAX_WEIGHT_GRADIENT_POSITIONS: usize = 16;

/// From this many kernel taps on, the weight gradient runs here on maps of
/// any size: each kernel row's product reads `kw` copies at once (`K = kw
/// · C_in`, 160 for cnn's 32 → 64 layer, 96 for a 3 × 3 kernel on 32
/// channels), and at 32 → 64 on 14 × 14 with a 5 × 5 kernel it took 5.96 ms
/// against the column-free kernel's 8.12 and im2col's 7.55 (`cargo bench
/// -p cohort-train --bench conv_passes -- --kernel 5`, a Zen 4 core; the
/// one 5 × 5 layer measured).
const MIN_WEIGHT_GRADIENT_TAPS: usize = 25;

/// Whether this convolution's weight gradient runs here: [`applies`], on
/// maps of at most [`MAX_WEIGHT_GRADIENT_POSITIONS`] output positions or
/// with kernels of at least [`MIN_WEIGHT_GRADIENT_TAPS`] taps. The caller
/// prefers this to [`super::direct`].
pub(crate) fn applies_to_weight_gradient(g: &Geometry) -> bool {
    applies(g)
        && (g.positions() <= MAX_WEIGHT_GRADIENT_POSITIONS
            || g.kernel[0] * g.kernel[1] >= MIN_WEIGHT_GRADIENT_TAPS)
}

/// One group of images in the position-major layout, and where each kernel
/// offset reads and writes it.
struct Group {
    images: usize,
    height: usize,
    out_h: usize,
    out_w: usize,
    /// The copy (`left`) that is the layout itself, where the output is as
    /// wide as the input.
    unmoved: Option<usize>,
}

impl Group {
    fn new(g: &Geometry, images: usize) -> Self {
        let [out_h, out_w] = g.output().expect("a valid geometry");
        let left = g.pad[1].0;
        Self {
            images,
            height: g.height,
            out_h,
            out_w,
            unmoved: (out_w == g.width && left < g.kernel[1]).then_some(left),
        }
    }

    /// Values of one channel of a shifted copy: `H` rows of `out_w`
    /// positions of `images`.
    fn copy_channel(&self) -> usize {
        self.height * self.out_w * self.images
    }

    /// Columns of the output (or its gradient): every output position of
    /// every image.
    fn columns(&self) -> usize {
        self.out_h * self.out_w * self.images
    }

    /// Columns of one row of the output or of a shifted copy.
    fn row(&self) -> usize {
        self.out_w * self.images
    }

    /// For kernel row `ky`: the output rows that read the input (`lo..hi`),
    /// and the input row output row `lo` reads.
    fn rows_of(&self, g: &Geometry, ky: usize) -> (usize, usize, usize) {
        let top = g.pad[0].0;
        let (lo, hi) = valid(self.out_h, g.height, ky, top, 1);
        (lo, hi, (lo + ky).saturating_sub(top))
    }
}

/// Images a group holds: about [`COLUMNS_PER_GROUP`] output columns.
fn images_per_group(g: &Geometry) -> usize {
    (COLUMNS_PER_GROUP / g.positions().max(1)).clamp(1, g.batch.max(1))
}

/// `images` NCHW images (`[images, C, H, W]`) as `[C, H, W, images]`.
#[inline(always)]
fn position_major(images: &[f32], count: usize, dst: &mut [f32]) {
    transpose_into(images, count, images.len() / count.max(1), dst);
}

/// The `kw` copies of `laid` (`[C_in, H, W, images]`) shifted along the
/// rows, copy `kx` at `kx · C_in · copy_channel()`: value `(c, y, x, n)`
/// of copy `kx` is the input's `(c, y, x + kx − left, n)`, zero outside the
/// row. The unmoved copy is left unwritten where the layout serves as it,
/// unless `every` asks for all `kw` side by side (the weight gradient's
/// products read them as one matrix).
#[inline(always)]
fn shifted_copies(g: &Geometry, group: &Group, laid: &[f32], copies: &mut [f32], every: bool) {
    let left = g.pad[1].0;
    let n = group.images;
    let channel = group.copy_channel();
    for kx in 0..g.kernel[1] {
        if group.unmoved == Some(kx) && !every {
            continue;
        }
        let (lo, hi) = valid(group.out_w, g.width, kx, left, 1);
        let copy = &mut copies[kx * g.c_in * channel..][..g.c_in * channel];
        for (c, dst) in copy.chunks_exact_mut(channel).enumerate() {
            for (y, dst_row) in dst.chunks_exact_mut(group.row()).enumerate() {
                let src_row = &laid[(c * g.height + y) * g.width * n..][..g.width * n];
                dst_row[..lo * n].fill(0.0);
                dst_row[hi * n..].fill(0.0);
                if lo < hi {
                    let first = lo + kx - left;
                    dst_row[lo * n..hi * n].copy_from_slice(&src_row[first * n..][..(hi - lo) * n]);
                }
            }
        }
    }
}

/// Copy `kx` of the shifted input: the layout itself for the unmoved one.
fn copy_of<'a>(
    g: &Geometry,
    group: &Group,
    kx: usize,
    laid: &'a [f32],
    copies: &'a [f32],
) -> &'a [f32] {
    let len = g.c_in * group.copy_channel();
    match group.unmoved == Some(kx) {
        true => &laid[..len],
        false => &copies[kx * len..][..len],
    }
}

/// The kernel offsets in the order the products run: first one that
/// covers every output row (so that it can overwrite instead of add),
/// where there is one.
fn offsets(g: &Geometry, group: &Group) -> (Vec<[usize; 2]>, bool) {
    let [kh, kw] = g.kernel;
    let mut all: Vec<[usize; 2]> = (0..kh)
        .flat_map(|ky| (0..kw).map(move |kx| [ky, kx]))
        .collect();
    let covering = all.iter().position(|&[ky, kx]| {
        let (lo, hi, _) = group.rows_of(g, ky);
        group.unmoved == Some(kx) && lo == 0 && hi == group.out_h
    });
    if let Some(i) = covering {
        all[..=i].rotate_right(1);
    }
    (all, covering.is_some())
}

/// `out = conv(input, weight) + bias`, as [`super::im2col::forward`].
#[inline(always)]
pub(crate) fn forward(
    g: &Geometry,
    input: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    assert!(
        applies(g),
        "not a stride-1 convolution of enough channels: {g:?}"
    );
    check(g, input.len(), weight.len(), out.len());
    let taps = g.kernel[0] * g.kernel[1];
    let most = images_per_group(g);
    with_buffers(
        #[inline(always)]
        |[laid, copies, product]| {
            for first in (0..g.batch).step_by(most) {
                let group = Group::new(g, most.min(g.batch - first));
                let images = &input[first * g.input_len()..][..group.images * g.input_len()];
                let laid = sized(laid, images.len());
                position_major(images, group.images, laid);
                let copies = sized(copies, g.kernel[1] * g.c_in * group.copy_channel());
                shifted_copies(g, &group, laid, copies, false);
                let columns = group.columns();
                let product = sized(product, g.c_out * columns);
                let (order, covered) = offsets(g, &group);
                if !covered {
                    product.fill(0.0);
                }
                for (i, &[ky, kx]) in order.iter().enumerate() {
                    let (lo, hi, source_row) = group.rows_of(g, ky);
                    if lo >= hi {
                        continue;
                    }
                    let width = (hi - lo) * group.row();
                    let copy = copy_of(g, &group, kx, laid, copies);
                    let w = MatRef {
                        data: &weight[ky * g.kernel[1] + kx..],
                        strides: Strides {
                            rows: g.c_in * taps,
                            cols: taps,
                        },
                    };
                    let x = MatRef {
                        data: &copy[source_row * group.row()..],
                        strides: Strides {
                            rows: group.copy_channel(),
                            cols: 1,
                        },
                    };
                    let dst = &mut product[lo * group.row()..];
                    let strides = Strides {
                        rows: columns,
                        cols: 1,
                    };
                    let accumulate = i > 0 || !covered;
                    matmul((g.c_out, width, g.c_in), dst, strides, accumulate, w, x);
                }
                let dst = &mut out[first * g.output_len()..][..group.images * g.output_len()];
                transpose_into(
                    product,
                    g.c_out * group.out_h * group.out_w,
                    group.images,
                    dst,
                );
                if let Some(bias) = bias {
                    add_bias(g, dst, bias);
                }
            }
        },
    );
}

/// The gradients of [`forward`] given the output's gradient `d_out`, as
/// [`super::im2col::backward`] computes them.
#[inline(always)]
pub(crate) fn backward(
    g: &Geometry,
    input: &[f32],
    weight: &[f32],
    d_out: &[f32],
    grads: Grads<'_>,
) {
    assert!(
        applies(g),
        "not a stride-1 convolution of enough channels: {g:?}"
    );
    check(g, input.len(), weight.len(), d_out.len());
    let Some((mut d_input, d_weight)) = grads.bias_then_rest(g, d_out) else {
        return;
    };
    // Summed as `[kh, kw, C_in, C_out]` (the products write their output
    // channels contiguous, as im2col's weight gradient does, for the same
    // reason: gemm packs both factors along the columns), laid out as the
    // weight once at the end.
    let mut d_weight_t = d_weight.is_some().then(|| vec![0.0f32; g.weight_len()]);
    let most = images_per_group(g);
    with_buffers(
        #[inline(always)]
        |[laid, copies, grad]| {
            for first in (0..g.batch).step_by(most) {
                let group = Group::new(g, most.min(g.batch - first));
                let images = &d_out[first * g.output_len()..][..group.images * g.output_len()];
                let grad = sized(grad, images.len());
                position_major(images, group.images, grad);
                if let Some(d_weight_t) = d_weight_t.as_deref_mut() {
                    let images = &input[first * g.input_len()..][..group.images * g.input_len()];
                    let laid = sized(laid, images.len());
                    position_major(images, group.images, laid);
                    let copies = sized(copies, g.kernel[1] * g.c_in * group.copy_channel());
                    shifted_copies(g, &group, laid, copies, true);
                    weight_gradient(g, &group, grad, copies, first > 0, d_weight_t);
                }
                if let Some(d_input) = d_input.as_deref_mut() {
                    let d_images =
                        &mut d_input[first * g.input_len()..][..group.images * g.input_len()];
                    input_gradient(g, &group, weight, grad, [laid, copies], d_images);
                }
            }
        },
    );
    if let (Some(d_weight), Some(transposed)) = (d_weight, d_weight_t) {
        weight_layout(g, &transposed, &mut d_weight[..g.weight_len()]);
    }
    if g.batch == 0 {
        d_input.iter_mut().for_each(|d| d.fill(0.0));
    }
}

/// Adds (or, for the first group, writes) a group's weight gradient to
/// `d_weight_t` (`[kh, kw, C_in, C_out]`): per kernel row, the output
/// gradient's rows that read the input times the rows they read of all
/// `kw` shifted copies at once. Nine products of `C_in` columns (one per
/// offset) packed the output gradient nine times and ran 64 → 128 at 16 ×
/// 16 at 40 % of im2col's speed; three of `3·C_in` columns pack it three.
#[inline(always)]
fn weight_gradient(
    g: &Geometry,
    group: &Group,
    grad: &[f32],
    copies: &[f32],
    accumulate: bool,
    d_weight_t: &mut [f32],
) {
    let [kh, kw] = g.kernel;
    let row_len = kw * g.c_in * g.c_out;
    for ky in 0..kh {
        let (lo, hi, source_row) = group.rows_of(g, ky);
        if lo >= hi {
            // No output reads the input at this kernel row: its gradient
            // stays the zeros it started as.
            continue;
        }
        let depth = (hi - lo) * group.row();
        let d_out = MatRef {
            data: &grad[lo * group.row()..],
            strides: Strides {
                rows: group.columns(),
                cols: 1,
            },
        };
        let x_t = MatRef {
            data: &copies[source_row * group.row()..],
            strides: Strides {
                rows: 1,
                cols: group.copy_channel(),
            },
        };
        let dst = &mut d_weight_t[ky * row_len..][..row_len];
        let strides = Strides {
            rows: 1,
            cols: g.c_out,
        };
        matmul(
            (g.c_out, kw * g.c_in, depth),
            dst,
            strides,
            accumulate,
            d_out,
            x_t,
        );
    }
}

/// `d_weight_t` (`[kh·kw, C_in, C_out]`) as the weight's layout
/// (`[C_out, C_in, kh·kw]`): two transposes, the second per output channel.
#[inline(always)]
fn weight_layout(g: &Geometry, d_weight_t: &[f32], d_weight: &mut [f32]) {
    let taps = g.kernel[0] * g.kernel[1];
    let per_channel = taps * g.c_in;
    let by_channel = super::gemm::transposed(d_weight_t, per_channel, g.c_out);
    for (src, dst) in by_channel
        .chunks_exact(per_channel)
        .zip(d_weight.chunks_exact_mut(per_channel))
    {
        transpose_into(src, taps, g.c_in, dst);
    }
}

/// A group's input gradient, written to `d_images` (NCHW): per offset, the
/// weights transposed times the output gradient's rows, added into the
/// gradient of the shifted copy they came from; the copies' gradients are
/// then shifted back and summed. `scratch` (the forward's two buffers) holds
/// the copies' gradients and the position-major sum.
#[inline(always)]
fn input_gradient(
    g: &Geometry,
    group: &Group,
    weight: &[f32],
    grad: &[f32],
    [summed, copies]: [&mut Vec<f32>; 2],
    d_images: &mut [f32],
) {
    let [kh, kw] = g.kernel;
    let taps = kh * kw;
    let channel = group.copy_channel();
    let copies = sized(copies, kw * g.c_in * channel);
    copies.fill(0.0);
    for ky in 0..kh {
        let (lo, hi, source_row) = group.rows_of(g, ky);
        if lo >= hi {
            continue;
        }
        let width = (hi - lo) * group.row();
        for kx in 0..kw {
            let w_t = MatRef {
                data: &weight[ky * kw + kx..],
                strides: Strides {
                    rows: taps,
                    cols: g.c_in * taps,
                },
            };
            let d_out = MatRef {
                data: &grad[lo * group.row()..],
                strides: Strides {
                    rows: group.columns(),
                    cols: 1,
                },
            };
            let dst = &mut copies[(kx * g.c_in * channel) + source_row * group.row()..];
            let strides = Strides {
                rows: channel,
                cols: 1,
            };
            matmul((g.c_in, width, g.c_out), dst, strides, true, w_t, d_out);
        }
    }
    let n = group.images;
    let left = g.pad[1].0;
    let summed = sized(summed, g.c_in * g.height * g.width * n);
    summed.fill(0.0);
    for kx in 0..kw {
        let (lo, hi) = valid(group.out_w, g.width, kx, left, 1);
        if lo >= hi {
            continue;
        }
        let copy = &copies[kx * g.c_in * channel..][..g.c_in * channel];
        for (c, src) in copy.chunks_exact(channel).enumerate() {
            for (y, src_row) in src.chunks_exact(group.row()).enumerate() {
                let dst_row = &mut summed[(c * g.height + y) * g.width * n..][..g.width * n];
                let first = lo + kx - left;
                let dst = &mut dst_row[first * n..][..(hi - lo) * n];
                for (d, s) in dst.iter_mut().zip(&src_row[lo * n..hi * n]) {
                    *d += s;
                }
            }
        }
    }
    transpose_into(summed, g.c_in * g.height * g.width, n, d_images);
}
