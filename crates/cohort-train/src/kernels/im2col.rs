//! A general 2-D convolution on host buffers (any kernel size, stride and
//! zero padding, per side; dilation 1, one group), NCHW as burn and PyTorch:
//! forward, input gradient and weight and bias gradients, each an im2col or
//! col2im and one matrix product ([`super::gemm`]) per group of images.
//!
//! Per image, the column matrix is `[C_in·kh·kw, P]` (`P = out_h · out_w`),
//! so the forward product `W · col` (`[C_out, P]`) is the image's NCHW
//! output and `Wᵀ · d_out` is the column gradient col2im folds back. Where
//! an image has few positions, the column matrices of several images lie
//! side by side (`[K, images·P]`) so one product serves them all
//! ([`images_per_product`]); the outputs are then scattered back to NCHW.
//! The weight gradient `Σ_b d_out_b · col_bᵀ` is accumulated group after
//! group in batch order, and the bias gradient image after image: one
//! thread, an order fixed by the shapes, the same bits on every run.
//!
//! The column matrix of a group lives in a buffer reused from call to call
//! (per thread).

use std::cell::RefCell;

use super::gemm::{MatRef, Strides, matmul, transpose_into};

/// The shapes of one convolution. `pad` is `[(top, bottom), (left, right)]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub batch: usize,
    pub c_in: usize,
    pub height: usize,
    pub width: usize,
    pub c_out: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub pad: [(usize, usize); 2],
}

impl Geometry {
    /// Output height and width; `None` when the kernel does not fit the
    /// padded input or a stride is zero.
    pub(crate) fn output(&self) -> Option<[usize; 2]> {
        let side = |size: usize, (begin, end): (usize, usize), kernel: usize, stride: usize| {
            let padded = size + begin + end;
            (stride > 0 && kernel > 0 && padded >= kernel).then(|| (padded - kernel) / stride + 1)
        };
        Some([
            side(self.height, self.pad[0], self.kernel[0], self.stride[0])?,
            side(self.width, self.pad[1], self.kernel[1], self.stride[1])?,
        ])
    }

    pub(super) fn positions(&self) -> usize {
        let [h, w] = self.output().expect("a valid geometry");
        h * w
    }

    /// Rows of the column matrix: the products' inner dimension.
    fn patch(&self) -> usize {
        self.c_in * self.kernel[0] * self.kernel[1]
    }

    pub(crate) fn input_len(&self) -> usize {
        self.c_in * self.height * self.width
    }

    pub(crate) fn output_len(&self) -> usize {
        self.c_out * self.positions()
    }

    pub(crate) fn weight_len(&self) -> usize {
        self.c_out * self.patch()
    }

    /// A 1×1 kernel with stride 1 and no padding reads each image as its
    /// own column matrix (`[C_in, H·W]`), so im2col is skipped.
    fn pointwise(&self) -> bool {
        self.kernel == [1, 1] && self.stride == [1, 1] && self.pad == [(0, 0), (0, 0)]
    }
}

thread_local! {
    /// The column matrix (or its gradient) of one image.
    static COLUMNS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `f` with a column buffer of `len` values (contents unspecified). The
/// buffer is taken out of the thread's cell and put back, rather than `f`
/// run inside `LocalKey::with`: `with` is a function of its own, compiled
/// for baseline x86-64, and everything `f` inlined (the column copies,
/// col2im's sums) ran four lanes wide in it, outside the caller's AVX2
/// ([`super::simd::dispatch`]).
#[inline(always)]
fn with_columns<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut columns = COLUMNS.with(RefCell::take);
    columns.resize(len, 0.0);
    let result = f(&mut columns[..len]);
    COLUMNS.with(|cell| cell.replace(columns));
    result
}

/// The output positions `o` of one axis whose input `o·stride + k − pad`
/// falls inside `0..size`: a range `lo..hi` of `0..out`.
pub(super) fn valid(
    out: usize,
    size: usize,
    k: usize,
    pad: usize,
    stride: usize,
) -> (usize, usize) {
    let lo = pad.saturating_sub(k).div_ceil(stride);
    let hi = (size + pad).saturating_sub(k).div_ceil(stride).min(out);
    (lo.min(hi), hi)
}

/// Calls `run(row, oy, source, (lo, hi))` for every line of the column
/// matrix: `row` is its row (`(ci·kh + ky)·kw + kx`), `oy` the output line,
/// `lo..hi` the output columns that read the input (the others read
/// padding), and `source` the offset in the image (`[C_in, H, W]`) of the
/// element output column `lo` reads, `None` when the whole line is padding.
#[inline(always)]
fn for_each_line(g: &Geometry, mut run: impl FnMut(usize, usize, Option<usize>, (usize, usize))) {
    let [out_h, out_w] = g.output().expect("a valid geometry");
    let [kh, kw] = g.kernel;
    let [sh, sw] = g.stride;
    let (top, left) = (g.pad[0].0, g.pad[1].0);
    for ci in 0..g.c_in {
        for ky in 0..kh {
            let rows = valid(out_h, g.height, ky, top, sh);
            for kx in 0..kw {
                let row = (ci * kh + ky) * kw + kx;
                let cols = valid(out_w, g.width, kx, left, sw);
                // Input column of output column `lo`. A line whose columns
                // all read padding has no source: its offset could lie past
                // the image (a 5 × 5 kernel on a 1 × 1 map: `lo + 4 − 2`
                // past the last channel's one value), and slicing there
                // panicked.
                let first = (cols.0 * sw + kx).saturating_sub(left);
                for oy in 0..out_h {
                    let source = (oy >= rows.0 && oy < rows.1 && cols.0 < cols.1).then(|| {
                        let iy = oy * sh + ky - top;
                        (ci * g.height + iy) * g.width + first
                    });
                    run(row, oy, source, cols);
                }
            }
        }
    }
}

/// `dst = src` for the short lines of a column matrix (a feature map's
/// width, often 32 floats or fewer), in 8-float moves the compiler inlines:
/// `copy_from_slice` calls `memmove` for every line, and the calls were a
/// tenth of resnet_20's step.
#[inline(always)]
pub(super) fn copy_short(dst: &mut [f32], src: &[f32]) {
    let len = dst.len();
    assert_eq!(len, src.len(), "line lengths");
    if len < 8 {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = *s;
        }
        return;
    }
    let mut at = 0;
    while at + 8 <= len {
        let block: [f32; 8] = src[at..at + 8].try_into().expect("8 floats");
        dst[at..at + 8].copy_from_slice(&block);
        at += 8;
    }
    if at < len {
        // The last 8, overlapping what was copied: no loop of the rest.
        let block: [f32; 8] = src[len - 8..].try_into().expect("8 floats");
        dst[len - 8..].copy_from_slice(&block);
    }
}

/// Zeroes a line's padding (a kernel's overhang: one or two floats for
/// 3×3 and 5×5 kernels) without a `memset` call, which a loop would become.
#[inline(always)]
pub(super) fn zero_short(values: &mut [f32]) {
    match values {
        [] => {}
        [a] => *a = 0.0,
        [a, b] => (*a, *b) = (0.0, 0.0),
        [a, b, c] => (*a, *b, *c) = (0.0, 0.0, 0.0),
        longer => longer.fill(0.0),
    }
}

/// One image (`[C_in, H, W]`) as its column matrix `[C_in·kh·kw, P]`,
/// row `r` at `col[r * ld..][..P]` (`ld ≥ P`: the images of a group of
/// [`images_per_product`] lie side by side).
#[inline(always)]
fn im2col(g: &Geometry, image: &[f32], col: &mut [f32], ld: usize) {
    let [_, out_w] = g.output().expect("a valid geometry");
    let sw = g.stride[1];
    for_each_line(
        g,
        #[inline(always)]
        |row, oy, source, (lo, hi)| {
            let line = &mut col[row * ld + oy * out_w..][..out_w];
            let Some(start) = source else {
                line.fill(0.0);
                return;
            };
            zero_short(&mut line[..lo]);
            zero_short(&mut line[hi..]);
            let dst = &mut line[lo..hi];
            match sw {
                1 => copy_short(dst, &image[start..][..hi - lo]),
                2 => gather_every_other(dst, &image[start..]),
                _ => {
                    for (i, d) in dst.iter_mut().enumerate() {
                        *d = image[start + i * sw];
                    }
                }
            }
        },
    );
}

/// The adjoint of [`im2col`] (same `ld`): every column entry added to the
/// input element it read. Overwrites `d_image` (`[C_in, H, W]`).
#[inline(always)]
fn col2im(g: &Geometry, d_col: &[f32], ld: usize, d_image: &mut [f32]) {
    let [_, out_w] = g.output().expect("a valid geometry");
    let sw = g.stride[1];
    d_image.fill(0.0);
    for_each_line(
        g,
        #[inline(always)]
        |row, oy, source, (lo, hi)| {
            let Some(start) = source else { return };
            let line = &d_col[row * ld + oy * out_w..][lo..hi];
            match sw {
                1 => {
                    for (d, s) in d_image[start..][..hi - lo].iter_mut().zip(line) {
                        *d += s;
                    }
                }
                2 => add_every_other(&mut d_image[start..], line),
                _ => {
                    for (i, s) in line.iter().enumerate() {
                        d_image[start + i * sw] += s;
                    }
                }
            }
        },
    );
}

/// `dst[i] = src[2i]`: a column-matrix line of a stride-2 convolution
/// (`src` from the line's first input value on; it may run past the line's
/// last). Sixteen values at a time in AVX2 registers where the CPU has it:
/// the scalar loops (with [`add_every_other`]'s) were most of the time a
/// stride-2 layer spent outside its products; 16 → 32 at 32 × 32 ran its
/// three passes in 4.43 ms with them, 3.83–3.91 with these (`cargo bench
/// -p cohort-train --bench conv_passes -- --stride 2`).
#[inline(always)]
fn gather_every_other(dst: &mut [f32], src: &[f32]) {
    assert!(
        dst.is_empty() || src.len() > 2 * (dst.len() - 1),
        "a stride-2 line's source"
    );
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        done = unsafe { gather_every_other_avx2(dst, src) };
    }
    for i in done..dst.len() {
        dst[i] = src[2 * i];
    }
}

/// [`gather_every_other`]'s runs of eight values whose sixteen source
/// values lie in `src`; how many values it wrote.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn gather_every_other_avx2(dst: &mut [f32], src: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let runs = (dst.len() / 8).min(src.len() / 16);
    for k in 0..runs {
        // SAFETY: src[16k .. 16k + 16] and dst[8k .. 8k + 8] lie within the
        // slices (`runs` bounds both).
        unsafe {
            let a = _mm256_loadu_ps(src.as_ptr().add(16 * k));
            let b = _mm256_loadu_ps(src.as_ptr().add(16 * k + 8));
            // (a0, a2, b0, b2 | a4, a6, b4, b6), its 64-bit halves reordered.
            let even = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
            let ordered = _mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(even));
            _mm256_storeu_ps(dst.as_mut_ptr().add(8 * k), _mm256_castpd_ps(ordered));
        }
    }
    8 * runs
}

/// `dst[2i] += src[i]`: [`gather_every_other`]'s adjoint (col2im's), each
/// sum the scalar loop's, the values between left as they were.
#[inline(always)]
fn add_every_other(dst: &mut [f32], src: &[f32]) {
    assert!(
        src.is_empty() || dst.len() > 2 * (src.len() - 1),
        "a stride-2 line's target"
    );
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        done = unsafe { add_every_other_avx2(dst, src) };
    }
    for i in done..src.len() {
        dst[2 * i] += src[i];
    }
}

/// [`add_every_other`]'s runs of eight values whose sixteen targets lie in
/// `dst`; how many values it added.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn add_every_other_avx2(dst: &mut [f32], src: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let runs = (src.len() / 8).min(dst.len() / 16);
    for k in 0..runs {
        // SAFETY: dst[16k .. 16k + 16] and src[8k .. 8k + 8] lie within the
        // slices (`runs` bounds both).
        unsafe {
            let s = _mm256_loadu_ps(src.as_ptr().add(8 * k));
            // (s0, 0, s1, 0 | s4, 0, s5, 0) and (s2, 0, s3, 0 | s6, 0, s7,
            // 0), their lanes recombined: s spread to the even places.
            let zero = _mm256_setzero_ps();
            let (low, high) = (_mm256_unpacklo_ps(s, zero), _mm256_unpackhi_ps(s, zero));
            let spread = [
                _mm256_permute2f128_ps::<0x20>(low, high),
                _mm256_permute2f128_ps::<0x31>(low, high),
            ];
            for (half, values) in spread.into_iter().enumerate() {
                let at = dst.as_mut_ptr().add(16 * k + 8 * half);
                let old = _mm256_loadu_ps(at);
                // The sums at even places, the odd ones untouched (adding
                // their zeros would turn a −0 into +0).
                let sum = _mm256_add_ps(old, values);
                _mm256_storeu_ps(at, _mm256_blend_ps::<0b1010_1010>(sum, old));
            }
        }
    }
    8 * runs
}

/// How many images share one matrix product: enough that the product has
/// about [`COLUMNS_PER_PRODUCT`] columns. With one image a product, a late
/// layer's few positions (VGG's 2×2, a ResNet's 4×4 or 8×8) left gemm's
/// vector lanes mostly empty and repacked the whole weight for every image.
fn images_per_product(g: &Geometry) -> usize {
    COLUMNS_PER_PRODUCT
        .div_ceil(g.positions().max(1))
        .clamp(1, g.batch.max(1))
}

/// Columns a product aims at (one image of more positions is one product).
const COLUMNS_PER_PRODUCT: usize = 512;

/// The batch in groups of [`images_per_product`]: `(first image, images)`.
fn groups(g: &Geometry) -> impl Iterator<Item = (usize, usize)> {
    let (batch, size) = (g.batch, images_per_product(g));
    (0..batch)
        .step_by(size)
        .map(move |first| (first, size.min(batch - first)))
}

/// The column matrix of `images` images from `first` on: `[K, images·P]`,
/// image `j`'s columns at `j·P`. One image of a pointwise convolution is its
/// own column matrix, returned without a copy.
#[inline(always)]
fn columns<'a>(
    g: &Geometry,
    input: &'a [f32],
    (first, images): (usize, usize),
    col: &'a mut [f32],
) -> &'a [f32] {
    let (len, p) = (g.input_len(), g.positions());
    if images == 1 && g.pointwise() {
        return &input[first * len..][..len];
    }
    let ld = images * p;
    for j in 0..images {
        let image = &input[(first + j) * len..][..len];
        im2col(g, image, &mut col[j * p..], ld);
    }
    &col[..g.patch() * ld]
}

/// `out = conv(input, weight) + bias`: `input` `[B, C_in, H, W]`, `weight`
/// `[C_out, C_in, kh, kw]`, `bias` `[C_out]`, `out` `[B, C_out, out_h, out_w]`.
#[inline(always)]
pub(crate) fn forward(
    g: &Geometry,
    input: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let (k, p, m) = (g.patch(), g.positions(), g.c_out);
    check(g, input.len(), weight.len(), out.len());
    let w = MatRef {
        data: weight,
        strides: Strides::row_major(k),
    };
    let most = images_per_product(g);
    // A group's product `[C_out, images·P]`, scattered to NCHW after.
    let mut product = vec![0.0f32; if most > 1 { m * most * p } else { 0 }];
    with_columns(
        k * most * p,
        #[inline(always)]
        |col| {
            for (first, images) in groups(g) {
                let ld = images * p;
                let rhs = MatRef {
                    data: columns(g, input, (first, images), col),
                    strides: Strides::row_major(ld),
                };
                let dst = &mut out[first * g.output_len()..][..images * g.output_len()];
                if images == 1 {
                    matmul((m, p, k), dst, Strides::row_major(p), false, w, rhs);
                } else {
                    let product = &mut product[..m * ld];
                    matmul((m, ld, k), product, Strides::row_major(ld), false, w, rhs);
                    for (co, row) in product.chunks_exact(ld).enumerate() {
                        for (j, plane) in row.chunks_exact(p).enumerate() {
                            dst[j * g.output_len() + co * p..][..p].copy_from_slice(plane);
                        }
                    }
                }
                if let Some(bias) = bias {
                    add_bias(g, dst, bias);
                }
            }
        },
    );
}

/// Which gradients [`backward`] computes, each overwritten when present:
/// the input's (`[B, C_in, H, W]`), the weight's (`[C_out, C_in, kh, kw]`)
/// and the bias's (`[C_out]`).
pub(crate) struct Grads<'a> {
    pub input: Option<&'a mut [f32]>,
    pub weight: Option<&'a mut [f32]>,
    pub bias: Option<&'a mut [f32]>,
}

/// One gradient to compute, into its buffer, or none.
pub(super) type Gradient<'a> = Option<&'a mut [f32]>;

impl<'a> Grads<'a> {
    /// These gradients in two parts, for passes computed by different
    /// kernels: the input's with the bias's, and the weight's.
    pub(crate) fn split(self) -> [Grads<'a>; 2] {
        [
            Grads {
                input: self.input,
                weight: None,
                bias: self.bias,
            },
            Grads {
                input: None,
                weight: self.weight,
                bias: None,
            },
        ]
    }

    /// Computes the bias gradient where it is asked for and hands back the
    /// input's and the weight's, `None` when neither is asked for: every
    /// kernel's backward pass starts so.
    #[inline(always)]
    pub(super) fn bias_then_rest(
        self,
        g: &Geometry,
        d_out: &[f32],
    ) -> Option<(Gradient<'a>, Gradient<'a>)> {
        if let Some(d_bias) = self.bias {
            bias_backward(g, d_out, d_bias);
        }
        (self.input.is_some() || self.weight.is_some()).then_some((self.input, self.weight))
    }

    /// Whether there is any gradient to compute.
    pub(crate) fn any(&self) -> bool {
        self.input.is_some() || self.weight.is_some() || self.bias.is_some()
    }
}

/// The gradients of [`forward`] given the output's gradient `d_out`.
#[inline(always)]
pub(crate) fn backward(
    g: &Geometry,
    input: &[f32],
    weight: &[f32],
    d_out: &[f32],
    grads: Grads<'_>,
) {
    let (k, p, m) = (g.patch(), g.positions(), g.c_out);
    check(g, input.len(), weight.len(), d_out.len());
    let Some((mut d_input, d_weight)) = grads.bias_then_rest(g, d_out) else {
        return;
    };
    let w_t = MatRef {
        data: weight,
        strides: Strides::row_major(k).t(),
    };
    // The weight gradient is summed with its output channels contiguous
    // (`[k, m]`) and transposed once at the end: both factors of
    // `d_out · colᵀ` run along the positions, and with the destination
    // channel-major gemm packs the column matrix a few rows at a time instead
    // of gathering a 64-row panel out of rows a whole image apart, which ran
    // the product at a sixth of its speed (`cargo bench -p cohort-train
    // --bench gemm_layouts`).
    let mut d_weight_t = d_weight.is_some().then(|| vec![0.0f32; g.weight_len()]);
    let most = images_per_product(g);
    // A group's output gradient as one `[C_out, images·P]` matrix.
    let mut grad_rows = vec![0.0f32; if most > 1 { m * most * p } else { 0 }];
    with_columns(
        k * most * p,
        #[inline(always)]
        |col| {
            for (first, images) in groups(g) {
                let ld = images * p;
                let d_out = &d_out[first * g.output_len()..][..images * g.output_len()];
                let grad_data = match images {
                    1 => d_out,
                    _ => side_by_side(g, d_out, &mut grad_rows[..m * ld]),
                };
                let grad = MatRef {
                    data: grad_data,
                    strides: Strides::row_major(ld),
                };
                if let Some(dst) = d_weight_t.as_deref_mut() {
                    let cols_t = MatRef {
                        data: columns(g, input, (first, images), col),
                        strides: Strides::row_major(ld).t(),
                    };
                    let accumulate = first > 0;
                    matmul(
                        (m, k, ld),
                        dst,
                        Strides::row_major(m).t(),
                        accumulate,
                        grad,
                        cols_t,
                    );
                }
                let Some(d_input) = d_input.as_deref_mut() else {
                    continue;
                };
                let d_images = &mut d_input[first * g.input_len()..][..images * g.input_len()];
                if images == 1 && g.pointwise() {
                    matmul((k, p, m), d_images, Strides::row_major(p), false, w_t, grad);
                    continue;
                }
                let d_col = &mut col[..k * ld];
                matmul((k, ld, m), d_col, Strides::row_major(ld), false, w_t, grad);
                for (j, d_image) in d_images.chunks_exact_mut(g.input_len()).enumerate() {
                    col2im(g, &d_col[j * p..], ld, d_image);
                }
            }
        },
    );
    if let (Some(d_weight), Some(transposed)) = (d_weight, d_weight_t) {
        transpose_into(&transposed, k, m, &mut d_weight[..g.weight_len()]);
    }
    if g.batch == 0 {
        d_input.iter_mut().for_each(|d| d.fill(0.0));
    }
}

/// The output gradients of a group's images (`[images, C_out, P]`) as one
/// `[C_out, images·P]` matrix, image `j`'s columns at `j·P`.
#[inline(always)]
fn side_by_side<'a>(g: &Geometry, d_out: &[f32], rows: &'a mut [f32]) -> &'a [f32] {
    let p = g.positions();
    let ld = rows.len() / g.c_out.max(1);
    for (j, image) in d_out.chunks_exact(g.output_len()).enumerate() {
        for (co, plane) in image.chunks_exact(p).enumerate() {
            rows[co * ld + j * p..][..p].copy_from_slice(plane);
        }
    }
    rows
}

/// `out[b, co, p] += bias[co]` for the images of `out` (NCHW).
#[inline(always)]
pub(super) fn add_bias(g: &Geometry, out: &mut [f32], bias: &[f32]) {
    for image in out.chunks_exact_mut(g.output_len()) {
        for (plane, b) in image.chunks_exact_mut(g.positions()).zip(bias) {
            plane.iter_mut().for_each(|v| *v += b);
        }
    }
}

/// `d_bias[co] = Σ_b Σ_p d_out[b, co, p]`, in batch then position order.
#[inline(always)]
pub(super) fn bias_backward(g: &Geometry, d_out: &[f32], d_bias: &mut [f32]) {
    let p = g.positions();
    d_bias[..g.c_out].fill(0.0);
    for image in d_out.chunks_exact(g.output_len().max(1)).take(g.batch) {
        for (plane, d) in image.chunks_exact(p.max(1)).zip(d_bias.iter_mut()) {
            *d += plane.iter().sum::<f32>();
        }
    }
}

/// # Panics
/// When a buffer's length is not the geometry's (the callers size them).
pub(super) fn check(g: &Geometry, input: usize, weight: usize, out: usize) {
    assert!(g.output().is_some(), "invalid convolution geometry {g:?}");
    assert_eq!(input, g.batch * g.input_len(), "input length");
    assert_eq!(weight, g.weight_len(), "weight length");
    assert_eq!(out, g.batch * g.output_len(), "output length");
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The vector moves against the loops they replace, on every length
    /// around their runs of eight, with sources and targets that end right
    /// after the line and long after it; a −0 between the targets stays −0.
    #[test]
    fn stride_two_lines_move_as_the_scalar_loops() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for n in 0..40usize {
            for slack in [0usize, 1, 17] {
                let src: Vec<f32> = (0..2 * n + slack)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                if n > 0 || slack > 0 {
                    let mut ours = vec![f32::NAN; n];
                    gather_every_other(&mut ours, &src);
                    let theirs: Vec<f32> = (0..n).map(|i| src[2 * i]).collect();
                    assert_eq!(ours, theirs, "gather of {n}, slack {slack}");
                }
                let line: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
                let start: Vec<f32> = (0..2 * n + slack)
                    .map(|i| {
                        if i % 2 == 1 {
                            -0.0
                        } else {
                            rng.random_range(-1.0..1.0)
                        }
                    })
                    .collect();
                if n == 0 && start.is_empty() {
                    continue;
                }
                let mut ours = start.clone();
                add_every_other(&mut ours, &line);
                let mut theirs = start;
                for (i, s) in line.iter().enumerate() {
                    theirs[2 * i] += s;
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&ours), bits(&theirs), "add of {n}, slack {slack}");
            }
        }
    }

    #[test]
    fn col2im_is_the_adjoint_of_im2col_for_strides_and_uneven_padding() {
        // <im2col(x), c> = <x, col2im(c)> for every x and c.
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for (kernel, stride, pad) in [
            ([3, 3], [1, 1], [(1, 1), (1, 1)]),
            ([5, 2], [2, 3], [(2, 0), (0, 1)]),
            ([1, 1], [2, 2], [(0, 0), (0, 0)]),
            ([4, 4], [1, 2], [(3, 3), (2, 0)]),
        ] {
            let g = Geometry {
                batch: 1,
                c_in: 3,
                height: 7,
                width: 6,
                c_out: 1,
                kernel,
                stride,
                pad,
            };
            let mut random =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
            let x = random(g.input_len());
            let c = random(g.patch() * g.positions());
            let mut col = vec![f32::NAN; c.len()];
            im2col(&g, &x, &mut col, g.positions());
            let mut back = vec![f32::NAN; x.len()];
            col2im(&g, &c, g.positions(), &mut back);
            let lhs: f64 = col.iter().zip(&c).map(|(a, b)| (a * b) as f64).sum();
            let rhs: f64 = x.iter().zip(&back).map(|(a, b)| (a * b) as f64).sum();
            assert!(
                (lhs - rhs).abs() <= 1e-4 * lhs.abs().max(1.0),
                "{g:?}: {lhs} vs {rhs}"
            );
        }
    }

    #[test]
    fn the_output_size_is_pytorchs_and_a_kernel_larger_than_the_input_is_refused() {
        let g = |size: usize, k: usize, s: usize, p: usize| Geometry {
            batch: 1,
            c_in: 1,
            height: size,
            width: size,
            c_out: 1,
            kernel: [k, k],
            stride: [s, s],
            pad: [(p, p), (p, p)],
        };
        // ⌊(size + 2p − k) / s⌋ + 1
        assert_eq!(g(32, 3, 2, 1).output(), Some([16, 16]));
        assert_eq!(g(28, 5, 1, 2).output(), Some([28, 28]));
        assert_eq!(g(7, 3, 3, 0).output(), Some([2, 2]));
        assert_eq!(g(2, 3, 1, 0).output(), None);
        assert_eq!(g(5, 3, 0, 0).output(), None);
    }
}
