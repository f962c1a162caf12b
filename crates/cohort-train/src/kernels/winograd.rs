//! A 3 × 3 convolution of stride 1 and padding 1 by Winograd's minimal
//! filtering, F(2 × 2, 3 × 3): forward, input gradient, and weight and bias
//! gradients, NCHW in and out as [`super::im2col`].
//!
//! Each 2 × 2 block of outputs ("tile") of each channel is computed from
//! the 4 × 4 patch of input around it: the patch and the 3 × 3 kernel are
//! moved into a 16-element space (`V = Bᵀ d B`, `U = G g Gᵀ`), multiplied
//! element by element there, summed over input channels, and moved back
//! (`Y = Aᵀ (Σ U ⊙ V) A`). The sum over input channels of each of the 16
//! elements is one matrix product, `M_ξ = U_ξ · V_ξ` (`[C_out, C_in] ·
//! [C_in, tiles]`), through [`super::gemm`]: 16 multiply-adds per input
//! channel for 4 outputs, where a direct convolution does 36 (2.25× fewer),
//! and none by the padding's zeros one at a time. The transforms'
//! coefficients are 0, ±1 and ±½, so they add rounding of the order of the
//! direct sum's (Lavin and Gray, "Fast Algorithms for Convolutional Neural
//! Networks", 2016; the equivalence tests hold it to im2col and to
//! PyTorch).
//!
//! A group of images is laid out position-major (`[H, W, images · C]`,
//! [`super::gemm::transpose_into`]), so that each transform runs over
//! whole vectors of every image's and channel's value at one position, and
//! the products read the transformed patches in place (`[tiles, C]` per
//! element, a column-major matrix to gemm).
//!
//! The backward pass needs no other algorithm:
//! * the input gradient of this convolution is the same convolution of the
//!   output gradient with the kernel turned by 180° and its channels
//!   swapped; turning the kernel only swaps the first and last rows and
//!   columns of `U` (`G J = Π G` for the reversal `J` and the swap `Π` of
//!   rows 0 and 3), so the forward's `U` serves, transposed;
//! * the weight gradient is the exact gradient of the forward's formula:
//!   `∂L/∂U_ξ = Σ_tiles (A dY Aᵀ)_ξ · V_ξ`, one product per element
//!   (`[C_out, tiles] · [tiles, C_in]`), and `∂L/∂g = Gᵀ (∂L/∂U) G`.
//!
//! One thread, an order fixed by the shapes, the same bits on every run.
//! Where it applies: [`applies`].

use super::direct::{sized, with_buffers};
use super::gemm::{MatRef, Strides, matmul, transpose_into};
use super::im2col::{Geometry, Grads, add_bias, check};

/// Elements of a tile's transformed patch: 4 × 4.
const ELEMENTS: usize = 16;
/// Outputs along each side of a tile.
const TILE_SIDE: usize = 2;
/// Floats one group's transformed patches (or products) may take: 16 ×
/// channels × tiles. A megabyte, so that a group's patches are still in
/// the caches when its products read them.
const GROUP_FLOATS: usize = 256 * 1024;
/// Fewer input channels give products too short (`K = C_in`) for the
/// transforms' cost to pay off; a first layer's 1 or 3 channels go
/// elsewhere.
const MIN_INPUT_CHANNELS: usize = 8;
/// Below this many pairs of channels the transforms cost more than the
/// multiply-adds they save: 16 → 16 at 32 × 32 (resnet_20's first stage)
/// ran its three passes in 6.3 ms here against the column-free kernel's
/// 5.4; 16 → 32 and 32 → 16 at 16 × 16 in 2.0 against 2.7 (`cargo bench -p
/// cohort-train --bench conv_passes`, a Zen 4 core).
const MIN_CHANNEL_PAIRS: usize = 512;
/// Maps of fewer output positions compute their forward pass and input
/// gradient faster through [`super::shifted`]: a 2 × 2 map's one tile
/// reads a 4 × 4 patch of which 12 values are padding, so the transform
/// saves nothing (512 → 512: 9.9 and 7.1 ms against 4.4 and 4.1). Its
/// weight gradient is still faster here (6.5 against 12.8).
const MIN_POSITIONS: usize = 16;

/// Whether this convolution can run here: a 3 × 3 kernel, stride 1,
/// padding 1 on every side (the output the input's size), at least
/// [`MIN_INPUT_CHANNELS`] input channels.
pub(crate) fn applies(g: &Geometry) -> bool {
    g.kernel == [3, 3]
        && g.stride == [1, 1]
        && g.pad == [(1, 1), (1, 1)]
        && g.c_in >= MIN_INPUT_CHANNELS
        && g.height > 0
        && g.width > 0
}

/// Whether this convolution's weight gradient is fastest here: [`applies`],
/// with at least [`MIN_CHANNEL_PAIRS`] pairs of channels.
pub(crate) fn fastest_for_weight_gradient(g: &Geometry) -> bool {
    applies(g) && g.c_in.saturating_mul(g.c_out) >= MIN_CHANNEL_PAIRS
}

/// Whether this convolution's forward pass and input gradient are fastest
/// here: as for the weight gradient, on maps of at least
/// [`MIN_POSITIONS`] positions.
pub(crate) fn fastest(g: &Geometry) -> bool {
    fastest_for_weight_gradient(g) && g.height * g.width >= MIN_POSITIONS
}

/// A map's tiles.
#[derive(Debug, Clone, Copy)]
struct Tiles {
    /// Tile rows and columns: the map's sides halved, rounded up (an odd
    /// side's last tile computes a row or column that is thrown away).
    rows: usize,
    cols: usize,
    height: usize,
    width: usize,
}

impl Tiles {
    fn new(height: usize, width: usize) -> Self {
        Self {
            rows: height.div_ceil(TILE_SIDE),
            cols: width.div_ceil(TILE_SIDE),
            height,
            width,
        }
    }

    fn count(&self) -> usize {
        self.rows * self.cols
    }

    fn positions(&self) -> usize {
        self.height * self.width
    }

    /// Images a group holds: [`GROUP_FLOATS`] for its widest side, at
    /// least one.
    fn images_per_group(&self, channels: usize, batch: usize) -> usize {
        let per_image = ELEMENTS * channels.max(1) * self.count().max(1);
        (GROUP_FLOATS / per_image).clamp(1, batch.max(1))
    }
}

/// `out[k] = f(a[k], b[k])` over whole slices: loops the compiler
/// vectorizes (inlined into the caller's AVX2 function).
#[inline(always)]
fn zip2(out: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) {
    let n = out.len();
    let (a, b) = (&a[..n], &b[..n]);
    for k in 0..n {
        out[k] = f(a[k], b[k]);
    }
}

/// [`zip2`] of three slices.
#[inline(always)]
fn zip3(out: &mut [f32], a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) {
    let n = out.len();
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    for k in 0..n {
        out[k] = f(a[k], b[k], c[k]);
    }
}

/// The swap of rows 0 and 3 (and of columns 0 and 3) of a 4 × 4 element
/// index: `U` of the kernel turned by 180° is `U` so permuted.
fn turned(e: usize) -> usize {
    let swap = |r: usize| match r {
        0 => 3,
        3 => 0,
        r => r,
    };
    4 * swap(e / 4) + swap(e % 4)
}

/// Kernels transformed at a time: their nine planes and the transform's
/// intermediate planes stay in L1.
const KERNEL_CHUNK: usize = 64;

/// `kernels` kernels moved into the 16-element space, `G g Gᵀ` with `G =
/// [[1, 0, 0], [½, ½, ½], [½, −½, ½], [0, 0, 1]]`, written to `u` as `[16,
/// kernels]`: element `ξ` of kernel `q` (read from `weight` at
/// `kernel_at(q)`, nine values) at `place(ξ) · kernels + q`. Vectorized
/// over [`KERNEL_CHUNK`] kernels at a time.
#[inline(always)]
fn kernel_transform(
    weight: &[f32],
    kernels: usize,
    kernel_at: impl Fn(usize) -> usize,
    place: impl Fn(usize) -> usize,
    u: &mut [f32],
) {
    const N: usize = KERNEL_CHUNK;
    let mut planes = [[0.0f32; N]; 9];
    let mut columns = [[[0.0f32; N]; 4]; 3];
    for first in (0..kernels).step_by(N) {
        let n = N.min(kernels - first);
        for k in 0..n {
            let kernel = &weight[kernel_at(first + k)..][..9];
            for (s, plane) in planes.iter_mut().enumerate() {
                plane[k] = kernel[s];
            }
        }
        // G g: the kernel's columns, each four rows.
        for (x, column) in columns.iter_mut().enumerate() {
            through_g([&planes[x], &planes[3 + x], &planes[6 + x]], column);
        }
        for r in 0..4 {
            let mut row = [[0.0f32; N]; 4];
            through_g([&columns[0][r], &columns[1][r], &columns[2][r]], &mut row);
            for (x, values) in row.iter().enumerate() {
                u[place(4 * r + x) * kernels + first..][..n].copy_from_slice(&values[..n]);
            }
        }
    }
}

/// `G` applied to three planes of [`KERNEL_CHUNK`] values: four planes.
#[inline(always)]
fn through_g(c: [&[f32; KERNEL_CHUNK]; 3], out: &mut [[f32; KERNEL_CHUNK]; 4]) {
    for k in 0..KERNEL_CHUNK {
        let (a, b, d) = (c[0][k], c[1][k], c[2][k]);
        out[0][k] = a;
        out[1][k] = 0.5 * (a + b + d);
        out[2][k] = 0.5 * (a - b + d);
        out[3][k] = d;
    }
}

/// `Gᵀ` applied to four planes of [`KERNEL_CHUNK`] values: three planes.
#[inline(always)]
fn through_gt(v: [&[f32]; 4], out: &mut [[f32; KERNEL_CHUNK]; 3]) {
    let n = KERNEL_CHUNK.min(v[0].len());
    let (v0, v1, v2, v3) = (&v[0][..n], &v[1][..n], &v[2][..n], &v[3][..n]);
    for k in 0..n {
        out[0][k] = v0[k] + 0.5 * (v1[k] + v2[k]);
        out[1][k] = 0.5 * (v1[k] - v2[k]);
        out[2][k] = 0.5 * (v1[k] + v2[k]) + v3[k];
    }
}

/// The adjoint of [`kernel_transform`]: `Gᵀ d G` for each kernel's
/// 16-element gradient in `du` (`[16, kernels]`), written to `d_weight`
/// (`[kernels, 3, 3]`).
#[inline(always)]
fn kernel_gradient(du: &[f32], kernels: usize, d_weight: &mut [f32]) {
    const N: usize = KERNEL_CHUNK;
    let mut columns = [[[0.0f32; N]; 3]; 4];
    for first in (0..kernels).step_by(N) {
        let n = N.min(kernels - first);
        let element = |e: usize| &du[e * kernels + first..][..n];
        // Gᵀ d: each column of d, three rows.
        for (x, column) in columns.iter_mut().enumerate() {
            through_gt(
                [element(x), element(4 + x), element(8 + x), element(12 + x)],
                column,
            );
        }
        for y in 0..3 {
            let mut row = [[0.0f32; N]; 3];
            through_gt(
                [
                    &columns[0][y],
                    &columns[1][y],
                    &columns[2][y],
                    &columns[3][y],
                ],
                &mut row,
            );
            for k in 0..n {
                for (x, values) in row.iter().enumerate() {
                    d_weight[(first + k) * 9 + 3 * y + x] = values[k];
                }
            }
        }
    }
}

/// The 4 × 4 patches around every tile of a position-major group
/// (`laid`: `[H, W, p]`, `p` values a position), moved into the 16-element
/// space (`Bᵀ d B`, `Bᵀ = [[1, 0, −1, 0], [0, 1, 1, 0], [0, −1, 1, 0], [0,
/// 1, 0, −1]]`), as `[16, tiles, p]`.
#[inline(always)]
fn input_transform(laid: &[f32], p: usize, tiles: &Tiles, v: &mut [f32]) {
    let zeros = vec![0.0f32; p];
    let mut rows = vec![0.0f32; ELEMENTS * p];
    let stride = tiles.count() * p;
    let (h, w) = (tiles.height, tiles.width);
    for ty in 0..tiles.rows {
        for tx in 0..tiles.cols {
            let at = |r: usize, s: usize| {
                let (y, x) = ((2 * ty + r).wrapping_sub(1), (2 * tx + s).wrapping_sub(1));
                if y < h && x < w {
                    &laid[(y * w + x) * p..][..p]
                } else {
                    &zeros[..]
                }
            };
            // Bᵀ d: the patch's rows combined, column by column (row i of
            // column s at (4·i + s)·p).
            for s in 0..4 {
                let [d0, d1, d2, d3] = [at(0, s), at(1, s), at(2, s), at(3, s)];
                let line = |i: usize| (4 * i + s) * p;
                zip2(&mut rows[line(0)..][..p], d0, d2, |a, b| a - b);
                zip2(&mut rows[line(1)..][..p], d1, d2, |a, b| a + b);
                zip2(&mut rows[line(2)..][..p], d2, d1, |a, b| a - b);
                zip2(&mut rows[line(3)..][..p], d1, d3, |a, b| a - b);
            }
            // (Bᵀ d) B: each row's four columns combined.
            let tile = (ty * tiles.cols + tx) * p;
            for i in 0..4 {
                let c = |s: usize| &rows[(4 * i + s) * p..][..p];
                let [c0, c1, c2, c3] = [c(0), c(1), c(2), c(3)];
                let out = |j: usize| (4 * i + j) * stride + tile;
                zip2(&mut v[out(0)..][..p], c0, c2, |a, b| a - b);
                zip2(&mut v[out(1)..][..p], c1, c2, |a, b| a + b);
                zip2(&mut v[out(2)..][..p], c2, c1, |a, b| a - b);
                zip2(&mut v[out(3)..][..p], c1, c3, |a, b| a - b);
            }
        }
    }
}

/// The products `m` (`[16, tiles, p]`) moved back (`Aᵀ m A`, `Aᵀ = [[1, 1,
/// 1, 0], [0, 1, −1, −1]]`) into a position-major group (`[H, W, p]`).
#[inline(always)]
fn output_transform(m: &[f32], p: usize, tiles: &Tiles, laid: &mut [f32]) {
    let mut rows = vec![0.0f32; 2 * 4 * p];
    let stride = tiles.count() * p;
    let (h, w) = (tiles.height, tiles.width);
    for ty in 0..tiles.rows {
        for tx in 0..tiles.cols {
            let tile = (ty * tiles.cols + tx) * p;
            let at = |e: usize| &m[e * stride + tile..][..p];
            // Aᵀ m: the four rows of each column combined into two.
            for x in 0..4 {
                let [m0, m1, m2, m3] = [at(x), at(4 + x), at(8 + x), at(12 + x)];
                zip3(&mut rows[x * p..][..p], m0, m1, m2, |a, b, c| a + b + c);
                zip3(&mut rows[(4 + x) * p..][..p], m1, m2, m3, |a, b, c| {
                    a - b - c
                });
            }
            for i in 0..TILE_SIDE {
                let y = 2 * ty + i;
                if y >= h {
                    break;
                }
                let c = |x: usize| &rows[(4 * i + x) * p..][..p];
                let x = 2 * tx;
                zip3(
                    &mut laid[(y * w + x) * p..][..p],
                    c(0),
                    c(1),
                    c(2),
                    |a, b, c| a + b + c,
                );
                if x + 1 < w {
                    let out = &mut laid[(y * w + x + 1) * p..][..p];
                    zip3(out, c(1), c(2), c(3), |a, b, c| a - b - c);
                }
            }
        }
    }
}

/// The output gradient of every tile of a position-major group (`[H, W,
/// p]`) moved into the 16-element space, the adjoint of
/// [`output_transform`] (`A dY Aᵀ`), as `[16, tiles, p]`.
#[inline(always)]
fn output_gradient_transform(laid: &[f32], p: usize, tiles: &Tiles, dm: &mut [f32]) {
    let zeros = vec![0.0f32; p];
    let mut rows = vec![0.0f32; 4 * 2 * p];
    let stride = tiles.count() * p;
    let (h, w) = (tiles.height, tiles.width);
    for ty in 0..tiles.rows {
        for tx in 0..tiles.cols {
            let at = |i: usize, j: usize| {
                let (y, x) = (2 * ty + i, 2 * tx + j);
                if y < h && x < w {
                    &laid[(y * w + x) * p..][..p]
                } else {
                    &zeros[..]
                }
            };
            // A dY: rows (y0, y0 + y1, y0 − y1, −y1), two columns each.
            for j in 0..2 {
                let (y0, y1) = (at(0, j), at(1, j));
                rows[j * p..][..p].copy_from_slice(y0);
                zip2(&mut rows[(2 + j) * p..][..p], y0, y1, |a, b| a + b);
                zip2(&mut rows[(4 + j) * p..][..p], y0, y1, |a, b| a - b);
                zip2(&mut rows[(6 + j) * p..][..p], y0, y1, |_, b| -b);
            }
            // Each row (a, b) through Aᵀ: (a, a + b, a − b, −b).
            let tile = (ty * tiles.cols + tx) * p;
            for r in 0..4 {
                let (a, b) = (&rows[2 * r * p..][..p], &rows[(2 * r + 1) * p..][..p]);
                let out = |x: usize| (4 * r + x) * stride + tile;
                dm[out(0)..][..p].copy_from_slice(a);
                zip2(&mut dm[out(1)..][..p], a, b, |a, b| a + b);
                zip2(&mut dm[out(2)..][..p], a, b, |a, b| a - b);
                zip2(&mut dm[out(3)..][..p], a, b, |_, b| -b);
            }
        }
    }
}

/// One element's `[C_out, C_in]` matrix of `U`, for the forward pass, or
/// the `[C_in, C_out]` one of the kernel turned by 180°, for the input
/// gradient; both column-major, the layout gemm reads without packing it
/// (row-major, the forward pass of 512 → 512 at 4 × 4 took twice as long
/// as the input gradient's).
struct Kernels<'a> {
    /// `[16, columns, rows]`.
    u: &'a [f32],
    rows: usize,
}

thread_local! {
    /// The kernels' transform, or the weight gradient's in the 16-element
    /// space, reused from call to call (16 MB for 512 × 512 channels:
    /// allocated afresh, its pages were cleared on every call).
    static ELEMENT_MATRICES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `f` with the thread's buffer for [`Kernels`] or the weight gradient's
/// 16 matrices (taken out of the cell, as [`with_buffers`] does).
#[inline(always)]
fn with_element_matrices<R>(f: impl FnOnce(&mut Vec<f32>) -> R) -> R {
    let mut buffer = ELEMENT_MATRICES.with(std::cell::RefCell::take);
    let result = f(&mut buffer);
    ELEMENT_MATRICES.with(|cell| cell.replace(buffer));
    result
}

impl<'a> Kernels<'a> {
    /// The forward pass's: element `ξ` of kernel `(o, i)` at `ξ · C_out ·
    /// C_in + i · C_out + o`.
    #[inline(always)]
    fn forward(weight: &[f32], (c_out, c_in): (usize, usize), buffer: &'a mut Vec<f32>) -> Self {
        let u = sized(buffer, ELEMENTS * c_out * c_in);
        let at = |q: usize| ((q % c_out) * c_in + q / c_out) * 9;
        kernel_transform(weight, c_out * c_in, at, |e| e, u);
        Self { u, rows: c_out }
    }

    /// The input gradient's: element `ξ` of kernel `(o, i)` at `turned(ξ) ·
    /// C_out · C_in + o · C_in + i`, which is the `[C_in, C_out]` matrix of
    /// the turned kernel, column-major.
    #[inline(always)]
    fn turned(weight: &[f32], (c_out, c_in): (usize, usize), buffer: &'a mut Vec<f32>) -> Self {
        let u = sized(buffer, ELEMENTS * c_out * c_in);
        kernel_transform(weight, c_out * c_in, |q| q * 9, turned, u);
        Self { u, rows: c_in }
    }

    fn matrix(&self, e: usize) -> MatRef<'_> {
        let plane = self.u.len() / ELEMENTS;
        MatRef {
            data: &self.u[e * plane..][..plane],
            strides: Strides::row_major(self.rows).t(),
        }
    }
}

/// `out` (`[batch, outputs, H, W]`) = the convolution of `planes`
/// (`[batch, inputs, H, W]`) by `kernels`, group by group.
#[inline(always)]
fn convolve(
    planes: &[f32],
    (batch, inputs, outputs): (usize, usize, usize),
    tiles: &Tiles,
    kernels: &Kernels<'_>,
    out: &mut [f32],
) {
    let positions = tiles.positions();
    let most = tiles.images_per_group(inputs.max(outputs), batch);
    with_buffers(
        #[inline(always)]
        |[laid, v, m]| {
            for first in (0..batch).step_by(most) {
                let images = most.min(batch - first);
                let (p_in, p_out) = (images * inputs, images * outputs);
                let laid_in = sized(laid, p_in * positions);
                transpose_into(
                    &planes[first * inputs * positions..][..p_in * positions],
                    p_in,
                    positions,
                    laid_in,
                );
                let v = sized(v, ELEMENTS * tiles.count() * p_in);
                input_transform(laid_in, p_in, tiles, v);
                // Column `t = tile · images + image` of each product.
                let columns = tiles.count() * images;
                let m = sized(m, ELEMENTS * columns * outputs);
                for e in 0..ELEMENTS {
                    matmul(
                        (outputs, columns, inputs),
                        &mut m[e * columns * outputs..][..columns * outputs],
                        Strides::row_major(outputs).t(),
                        false,
                        kernels.matrix(e),
                        MatRef {
                            data: &v[e * columns * inputs..][..columns * inputs],
                            strides: Strides::row_major(inputs).t(),
                        },
                    );
                }
                let laid_out = sized(laid, p_out * positions);
                output_transform(m, p_out, tiles, laid_out);
                let dst = &mut out[first * outputs * positions..][..p_out * positions];
                transpose_into(laid_out, positions, p_out, dst);
            }
        },
    );
}

/// `out = conv(input, weight) + bias`, as [`super::im2col::forward`] (the
/// same layouts); the caller checked [`applies`]. Inlined into the
/// caller's AVX2 function ([`super::simd::dispatch`]), as the other
/// kernels' passes are, so the transforms run eight lanes wide.
#[inline(always)]
pub(crate) fn forward(
    g: &Geometry,
    input: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    check(g, input.len(), weight.len(), out.len());
    assert!(
        applies(g),
        "not a 3 × 3 convolution of stride 1, padding 1: {g:?}"
    );
    let tiles = Tiles::new(g.height, g.width);
    with_element_matrices(
        #[inline(always)]
        |buffer| {
            let kernels = Kernels::forward(weight, (g.c_out, g.c_in), buffer);
            convolve(input, (g.batch, g.c_in, g.c_out), &tiles, &kernels, out);
        },
    );
    if let Some(bias) = bias {
        add_bias(g, out, bias);
    }
}

/// The gradients of [`forward`] given the output's gradient `d_out`, as
/// [`super::im2col::backward`] computes them (inlined as [`forward`] is).
#[inline(always)]
pub(crate) fn backward(
    g: &Geometry,
    input: &[f32],
    weight: &[f32],
    d_out: &[f32],
    grads: Grads<'_>,
) {
    check(g, input.len(), weight.len(), d_out.len());
    assert!(
        applies(g),
        "not a 3 × 3 convolution of stride 1, padding 1: {g:?}"
    );
    let Some((d_input, d_weight)) = grads.bias_then_rest(g, d_out) else {
        return;
    };
    let tiles = Tiles::new(g.height, g.width);
    if let Some(d_weight) = d_weight {
        weight_gradient(g, input, d_out, &tiles, d_weight);
    }
    if let Some(d_input) = d_input {
        with_element_matrices(
            #[inline(always)]
            |buffer| {
                let kernels = Kernels::turned(weight, (g.c_out, g.c_in), buffer);
                convolve(d_out, (g.batch, g.c_out, g.c_in), &tiles, &kernels, d_input);
            },
        );
    }
}

/// `d_weight` (`[C_out, C_in, 3, 3]`) from the input and the output's
/// gradient: `∂L/∂U_ξ = Σ (A dY Aᵀ)_ξ · V_ξ` summed over every group's
/// tiles, then each kernel's `Gᵀ (∂L/∂U) G`.
#[inline(always)]
fn weight_gradient(
    g: &Geometry,
    input: &[f32],
    d_out: &[f32],
    tiles: &Tiles,
    d_weight: &mut [f32],
) {
    let kernels = g.c_out * g.c_in;
    with_element_matrices(
        #[inline(always)]
        |buffer| {
            let du = sized(buffer, ELEMENTS * kernels);
            weight_products(g, (input, d_out), tiles, du);
            kernel_gradient(du, kernels, d_weight);
        },
    );
}

/// `du` (`[16, C_out, C_in]`) = `Σ (A dY Aᵀ)_ξ · V_ξ` over every tile of
/// the batch, group by group.
#[inline(always)]
fn weight_products(g: &Geometry, (input, d_out): (&[f32], &[f32]), tiles: &Tiles, du: &mut [f32]) {
    let positions = tiles.positions();
    let kernels = g.c_out * g.c_in;
    let most = tiles.images_per_group(g.c_in.max(g.c_out), g.batch);
    with_buffers(
        #[inline(always)]
        |[laid, v, dm]| {
            for (index, first) in (0..g.batch).step_by(most).enumerate() {
                let images = most.min(g.batch - first);
                let (p_in, p_out) = (images * g.c_in, images * g.c_out);
                let laid_in = sized(laid, p_in * positions);
                transpose_into(
                    &input[first * g.input_len()..][..images * g.input_len()],
                    p_in,
                    positions,
                    laid_in,
                );
                let v = sized(v, ELEMENTS * tiles.count() * p_in);
                input_transform(laid_in, p_in, tiles, v);
                let laid_grad = sized(laid, p_out * positions);
                transpose_into(
                    &d_out[first * g.output_len()..][..images * g.output_len()],
                    p_out,
                    positions,
                    laid_grad,
                );
                let dm = sized(dm, ELEMENTS * tiles.count() * p_out);
                output_gradient_transform(laid_grad, p_out, tiles, dm);
                let columns = tiles.count() * images;
                for e in 0..ELEMENTS {
                    matmul(
                        (g.c_out, g.c_in, columns),
                        &mut du[e * kernels..][..kernels],
                        Strides::row_major(g.c_in),
                        index > 0,
                        MatRef {
                            data: &dm[e * columns * g.c_out..][..columns * g.c_out],
                            strides: Strides::row_major(g.c_out).t(),
                        },
                        MatRef::row_major(&v[e * columns * g.c_in..][..columns * g.c_in], g.c_in),
                    );
                }
            }
        },
    );
}
