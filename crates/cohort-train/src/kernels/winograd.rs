//! Convolutions of stride 1 and "same" padding with 3 × 3 and 5 × 5
//! kernels by Winograd's minimal filtering, F(2 × 2, 3 × 3) and F(2 × 2, 5
//! × 5): forward, input gradient, and weight and bias gradients, NCHW in
//! and out as [`super::im2col`].
//!
//! Each 2 × 2 block of outputs ("tile") of each channel is computed from
//! the `n × n` patch of input around it (`n = r + 1` for an `r × r`
//! kernel): the patch and the kernel are moved into an `n²`-element space
//! (`V = Bᵀ d B`, `U = G g Gᵀ`), multiplied element by element there,
//! summed over input channels, and moved back (`Y = Aᵀ (Σ U ⊙ V) A`). The
//! sum over input channels of each element is one matrix product, `M_ξ =
//! U_ξ · V_ξ` (`[C_out, C_in] · [C_in, tiles]`), through [`super::gemm`]:
//! per input channel and 4 outputs, 16 multiply-adds where a direct 3 × 3
//! convolution does 36 (2.25× fewer), 36 where a 5 × 5 one does 100 (2.8×),
//! and none by the padding's zeros one at a time. The matrices are
//! Toom-Cook's at the points 0, ±1 (and ±2 for 5 × 5)
//! and infinity; their coefficients are small (±½ and ±1 for 3 × 3, at
//! most 5 for 5 × 5), so the rounding they add is of the order of the
//! direct sum's (Lavin and Gray, "Fast Algorithms for Convolutional Neural
//! Networks", 2016; the equivalence tests hold the results to im2col's and
//! to PyTorch's).
//!
//! A group of images is laid out position-major (`[H, W, images · C]`,
//! [`super::gemm::transpose_into`]), so that each transform runs over
//! whole vectors of every image's and channel's value at one position, and
//! the products read the transformed patches in place (`[tiles, C]` per
//! element, a column-major matrix to gemm).
//!
//! The backward pass needs no other algorithm:
//! * the input gradient of a stride-1 "same" convolution is the same
//!   convolution of the output gradient with the kernel turned by 180° and
//!   its channels swapped;
//! * the weight gradient is the exact gradient of the forward's formula:
//!   `∂L/∂U_ξ = Σ_tiles (A dY Aᵀ)_ξ · V_ξ`, one product per element
//!   (`[C_out, tiles] · [tiles, C_in]`), and `∂L/∂g = Gᵀ (∂L/∂U) G`.
//!
//! [`three`] writes F(2 × 2, 3 × 3)'s transforms out as additions and
//! subtractions; [`minimal`] drives any F(2 × 2, r × r)'s from its
//! matrices, and computes F(2 × 2, 5 × 5). The rest (layouts, products,
//! the backward pass) is shared ([`Transforms`]).
//!
//! One thread, an order fixed by the shapes, the same bits on every run.
//! Where it applies: [`applies`].

mod minimal;
mod three;

use std::cell::RefCell;

use super::direct::{sized, with_buffers};
use super::gemm::{MatRef, Strides, matmul, transpose_into};
use super::im2col::{Geometry, Grads, add_bias, check};
use minimal::FIVE;
use three::Three;

/// Outputs along each side of a tile.
const TILE_SIDE: usize = 2;
/// Floats one group's transformed patches (or products) may take:
/// elements × channels × tiles. A megabyte, so that a group's patches are
/// still in the caches when its products read them.
const GROUP_FLOATS: usize = 256 * 1024;
/// Fewer input channels give products too short (`K = C_in`) for the
/// transforms' cost to pay off; a first layer's 1 or 3 channels go
/// elsewhere.
const MIN_INPUT_CHANNELS: usize = 8;
/// Below this many pairs of channels the transforms cost more than the
/// multiply-adds they save: 16 → 16 at 32 × 32 (resnet_20's first stage)
/// ran its three passes in 5.75 ms here against the column-free kernel's
/// 5.24; 16 → 32 and 32 → 16 at 16 × 16 in 2.0 against 2.7 (`cargo bench -p
/// cohort-train --bench conv_passes`, a Zen 4 core; docs/BENCHMARKS.md,
/// "Winograd's minimal filtering").
const MIN_CHANNEL_PAIRS: usize = 512;
/// Maps of fewer output positions compute their forward pass and input
/// gradient faster through [`super::shifted`]: a 2 × 2 map's one tile
/// reads a 4 × 4 patch of which 12 values are padding, so the transform
/// saves nothing (512 → 512: 9.3 and 7.1 ms against 4.2 and 3.9). Its
/// weight gradient is still faster here (5.9 against 12.6).
const MIN_POSITIONS: usize = 16;

/// Whether this convolution can run here: stride 1, a 3 × 3 kernel with
/// padding 1 or a 5 × 5 one with padding 2 on every side (the output the
/// input's size), at least [`MIN_INPUT_CHANNELS`] input channels.
pub(crate) fn applies(g: &Geometry) -> bool {
    let same = |r: usize| g.kernel == [r, r] && g.pad == [(r / 2, r / 2), (r / 2, r / 2)];
    (same(3) || same(5))
        && g.stride == [1, 1]
        && g.c_in >= MIN_INPUT_CHANNELS
        && g.height > 0
        && g.width > 0
}

/// Whether this convolution's forward pass and input gradient are fastest
/// here: [`applies`], with at least [`MIN_CHANNEL_PAIRS`] pairs of channels,
/// on maps of at least [`MIN_POSITIONS`] positions.
pub(crate) fn fastest(g: &Geometry) -> bool {
    pays_off(g) && g.height * g.width >= MIN_POSITIONS
}

/// Whether this convolution's weight gradient goes here: [`applies`], with
/// at least [`MIN_CHANNEL_PAIRS`] pairs of channels, for a 3 × 3 kernel.
/// F(2 × 2, 5 × 5)'s weight gradient sums over every tile of the batch
/// products of values its transforms amplified (coefficients up to 5 in
/// `Bᵀ`, `Gᵀ`'s sixths taking them apart again): on 32 images of 32
/// channels at 14 × 14 its float32 result was 3.8e-3 from float64's where
/// a direct sum's was 2.2e-5, of values up to 104 (`python3
/// bench/winograd_rounding.py --images 32 --channels 32 --side 14`), so a
/// 5 × 5 weight gradient stays with the direct sums' paths; the forward pass
/// and the input gradient, which sum over one tile's inputs, stay within
/// the equivalence tests' bounds.
pub(crate) fn fastest_for_weight_gradient(g: &Geometry) -> bool {
    pays_off(g) && g.kernel == [3, 3]
}

fn pays_off(g: &Geometry) -> bool {
    applies(g) && g.c_in.saturating_mul(g.c_out) >= MIN_CHANNEL_PAIRS
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

    /// Position `(y, x)`'s values in the position-major group `laid`
    /// (`zeros.len()` a position), or `zeros` outside the map: a patch's
    /// reader, its rows and columns wrapped below zero landing outside.
    #[inline(always)]
    fn position<'a>(&self, laid: &'a [f32], zeros: &'a [f32], (y, x): (usize, usize)) -> &'a [f32] {
        let p = zeros.len();
        if y < self.height && x < self.width {
            &laid[(y * self.width + x) * p..][..p]
        } else {
            zeros
        }
    }

    /// Images a group of `elements`-element patches holds:
    /// [`GROUP_FLOATS`] for its widest side, at least one.
    fn images_per_group(&self, elements: usize, channels: usize, batch: usize) -> usize {
        let per_image = elements * channels.max(1) * self.count().max(1);
        (GROUP_FLOATS / per_image).clamp(1, batch.max(1))
    }
}

/// Kernels transformed at a time: their planes and the transform's
/// intermediate planes stay in L1.
const KERNEL_CHUNK: usize = 64;

/// The order in which a transform lays out the kernels of a weight
/// (`[C_out, C_in, r, r]`): kernel `q = a · inner + b` is the one at
/// `a · outer_step + b · inner_step`, its values in order or, `turned`, in
/// reverse (the kernel turned by 180°).
#[derive(Debug, Clone, Copy)]
struct KernelOrder {
    count: usize,
    inner: usize,
    outer_step: usize,
    inner_step: usize,
    turned: bool,
}

impl KernelOrder {
    /// The forward pass's: kernel `(o, i)` at `q = i · C_out + o`, so that
    /// each element's `[C_out, C_in]` matrix is column-major, which gemm
    /// reads without packing it (row-major, 512 → 512 at 4 × 4 took twice as
    /// long).
    fn forward(g: &Geometry, taps: usize) -> Self {
        Self {
            count: g.c_out * g.c_in,
            inner: g.c_out,
            outer_step: taps,
            inner_step: g.c_in * taps,
            turned: false,
        }
    }

    /// The input gradient's: kernel `(o, i)` turned, at `q = o · C_in + i`,
    /// each element's `[C_in, C_out]` matrix column-major.
    fn turned(g: &Geometry, taps: usize) -> Self {
        Self {
            count: g.c_out * g.c_in,
            inner: g.c_in,
            outer_step: g.c_in * taps,
            inner_step: taps,
            turned: true,
        }
    }

    /// The `taps` values of kernels `first..first + n` from `weight`, value
    /// `s` of kernel `first + k` at `planes[s · KERNEL_CHUNK + k]`. One
    /// division a chunk: a division per value (forming `(o, i)` from `q`)
    /// took longer than 512 → 512's products.
    #[inline(always)]
    fn gather(&self, weight: &[f32], taps: usize, (first, n): (usize, usize), planes: &mut [f32]) {
        let (mut a, mut b) = (first / self.inner, first % self.inner);
        for k in 0..n {
            let kernel = &weight[a * self.outer_step + b * self.inner_step..][..taps];
            for (s, &value) in kernel.iter().enumerate() {
                let s = if self.turned { taps - 1 - s } else { s };
                planes[s * KERNEL_CHUNK + k] = value;
            }
            b += 1;
            if b == self.inner {
                (a, b) = (a + 1, 0);
            }
        }
    }
}

/// The transforms of one F(2 × 2, r × r), on `n × n` patches (`n = r + 1`).
/// A position-major group is `[H, W, p]`, `p` values a position; a
/// transformed one `[n², tiles, p]`, tile `ty · cols + tx`.
trait Transforms {
    /// The kernel's side, `r`.
    const KERNEL: usize;
    /// Elements of a transformed patch, `n²`.
    const ELEMENTS: usize;

    /// `order.count` kernels of `weight` moved into the transformed space,
    /// `G g Gᵀ`, as `[n², kernels]`: element `ξ` of kernel `q` (in
    /// `order`) at `ξ · kernels + q`.
    fn kernel_transform(&self, weight: &[f32], order: KernelOrder, u: &mut [f32]);

    /// The adjoint of [`Transforms::kernel_transform`]: `Gᵀ d G` for each
    /// kernel's `n²`-element gradient in `du` (`[n², kernels]`), written to
    /// `d_weight` (`[kernels, r, r]`).
    fn kernel_gradient(&self, du: &[f32], kernels: usize, d_weight: &mut [f32]);

    /// The `n × n` patches around every tile of a position-major group
    /// (zeros outside the map), moved into the transformed space (`Bᵀ d B`).
    fn input_transform(&self, laid: &[f32], p: usize, tiles: &Tiles, v: &mut [f32]);

    /// The summed products `m` moved back (`Aᵀ m A`) into a position-major
    /// group.
    fn output_transform(&self, m: &[f32], p: usize, tiles: &Tiles, laid: &mut [f32]);

    /// A position-major output gradient moved into the transformed space,
    /// the adjoint of [`Transforms::output_transform`] (`A dY Aᵀ`).
    fn output_gradient_transform(&self, laid: &[f32], p: usize, tiles: &Tiles, dm: &mut [f32]);
}

impl<T: Transforms> Driver for T {}

/// What every [`Transforms`] computes with them: the products, group by
/// group, and the passes.
trait Driver: Transforms {
    /// `out` (`[batch, outputs, H, W]`) = the convolution of `planes`
    /// (`[batch, inputs, H, W]`) by `kernels`, group by group.
    #[inline(always)]
    fn convolve(
        &self,
        planes: &[f32],
        (batch, inputs, outputs): (usize, usize, usize),
        tiles: &Tiles,
        kernels: &Kernels<'_>,
        out: &mut [f32],
    ) {
        let elements = Self::ELEMENTS;
        let positions = tiles.positions();
        let most = tiles.images_per_group(elements, inputs.max(outputs), batch);
        with_buffers(
            #[inline(always)]
            |[laid, v, m]| {
                for first in (0..batch).step_by(most) {
                    let images = most.min(batch - first);
                    let (p_in, p_out) = (images * inputs, images * outputs);
                    let laid_in = sized(laid, p_in * positions);
                    let group = &planes[first * inputs * positions..][..p_in * positions];
                    transpose_into(group, p_in, positions, laid_in);
                    let v = sized(v, elements * tiles.count() * p_in);
                    self.input_transform(laid_in, p_in, tiles, v);
                    // Column `t = tile · images + image` of each product.
                    let columns = tiles.count() * images;
                    let m = sized(m, elements * columns * outputs);
                    for e in 0..elements {
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
                    self.output_transform(m, p_out, tiles, laid_out);
                    let dst = &mut out[first * outputs * positions..][..p_out * positions];
                    transpose_into(laid_out, positions, p_out, dst);
                }
            },
        );
    }

    /// `du` (`[N², C_out, C_in]`) = `Σ (A dY Aᵀ)_ξ · V_ξ` over every tile
    /// of the batch, group by group.
    #[inline(always)]
    fn weight_products(
        &self,
        g: &Geometry,
        (input, d_out): (&[f32], &[f32]),
        tiles: &Tiles,
        du: &mut [f32],
    ) {
        let elements = Self::ELEMENTS;
        let positions = tiles.positions();
        let kernels = g.c_out * g.c_in;
        let most = tiles.images_per_group(elements, g.c_in.max(g.c_out), g.batch);
        with_buffers(
            #[inline(always)]
            |[laid, v, dm]| {
                for (index, first) in (0..g.batch).step_by(most).enumerate() {
                    let images = most.min(g.batch - first);
                    let (p_in, p_out) = (images * g.c_in, images * g.c_out);
                    let laid_in = sized(laid, p_in * positions);
                    let group = &input[first * g.input_len()..][..images * g.input_len()];
                    transpose_into(group, p_in, positions, laid_in);
                    let v = sized(v, elements * tiles.count() * p_in);
                    self.input_transform(laid_in, p_in, tiles, v);
                    let laid_grad = sized(laid, p_out * positions);
                    let group = &d_out[first * g.output_len()..][..images * g.output_len()];
                    transpose_into(group, p_out, positions, laid_grad);
                    let dm = sized(dm, elements * tiles.count() * p_out);
                    self.output_gradient_transform(laid_grad, p_out, tiles, dm);
                    let columns = tiles.count() * images;
                    for e in 0..elements {
                        matmul(
                            (g.c_out, g.c_in, columns),
                            &mut du[e * kernels..][..kernels],
                            Strides::row_major(g.c_in),
                            index > 0,
                            MatRef {
                                data: &dm[e * columns * g.c_out..][..columns * g.c_out],
                                strides: Strides::row_major(g.c_out).t(),
                            },
                            MatRef::row_major(
                                &v[e * columns * g.c_in..][..columns * g.c_in],
                                g.c_in,
                            ),
                        );
                    }
                }
            },
        );
    }

    /// The forward pass without the bias.
    #[inline(always)]
    fn forward(&self, g: &Geometry, input: &[f32], weight: &[f32], out: &mut [f32]) {
        let tiles = Tiles::new(g.height, g.width);
        let taps = Self::KERNEL * Self::KERNEL;
        with_element_matrices(
            #[inline(always)]
            |buffer| {
                let u = sized(buffer, Self::ELEMENTS * g.c_out * g.c_in);
                let (c_out, c_in) = (g.c_out, g.c_in);
                self.kernel_transform(weight, KernelOrder::forward(g, taps), u);
                let kernels = Kernels {
                    u,
                    rows: c_out,
                    plane: c_out * c_in,
                };
                self.convolve(input, (g.batch, c_in, c_out), &tiles, &kernels, out);
            },
        );
    }

    /// The input and weight gradients asked for.
    #[inline(always)]
    fn backward(
        &self,
        g: &Geometry,
        input: &[f32],
        weight: &[f32],
        d_out: &[f32],
        (d_input, d_weight): (Option<&mut [f32]>, Option<&mut [f32]>),
    ) {
        let tiles = Tiles::new(g.height, g.width);
        let taps = Self::KERNEL * Self::KERNEL;
        let kernels = g.c_out * g.c_in;
        with_element_matrices(
            #[inline(always)]
            |buffer| {
                if let Some(d_weight) = d_weight {
                    let du = sized(buffer, Self::ELEMENTS * kernels);
                    self.weight_products(g, (input, d_out), &tiles, du);
                    self.kernel_gradient(du, kernels, d_weight);
                }
                if let Some(d_input) = d_input {
                    // The kernel turned by 180°, from output channel `o` back
                    // to input channel `i`.
                    let u = sized(buffer, Self::ELEMENTS * kernels);
                    self.kernel_transform(weight, KernelOrder::turned(g, taps), u);
                    let turned = Kernels {
                        u,
                        rows: g.c_in,
                        plane: kernels,
                    };
                    self.convolve(d_out, (g.batch, g.c_out, g.c_in), &tiles, &turned, d_input);
                }
            },
        );
    }
}

/// Each element's matrix of a transformed kernel, column-major with
/// `rows` rows (`[elements, columns, rows]`).
struct Kernels<'a> {
    u: &'a [f32],
    rows: usize,
    /// Values of one element's matrix: `C_out · C_in`.
    plane: usize,
}

impl Kernels<'_> {
    fn matrix(&self, e: usize) -> MatRef<'_> {
        MatRef {
            data: &self.u[e * self.plane..][..self.plane],
            strides: Strides::row_major(self.rows).t(),
        }
    }
}

thread_local! {
    /// The kernels' transform, or the weight gradient in the transformed
    /// space, reused from call to call (16 MB for 512 × 512 channels of 3
    /// × 3: allocated afresh, its pages were cleared on every call).
    static ELEMENT_MATRICES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `f` with the thread's buffer for the transformed kernels (taken out of
/// the cell, as [`with_buffers`] does).
#[inline(always)]
fn with_element_matrices<T>(f: impl FnOnce(&mut Vec<f32>) -> T) -> T {
    let mut buffer = ELEMENT_MATRICES.with(RefCell::take);
    let result = f(&mut buffer);
    ELEMENT_MATRICES.with(|cell| cell.replace(buffer));
    result
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
        "not a stride-1 \"same\" 3 × 3 or 5 × 5 convolution: {g:?}"
    );
    match g.kernel {
        [3, 3] => Three.forward(g, input, weight, out),
        _ => FIVE.forward(g, input, weight, out),
    }
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
        "not a stride-1 \"same\" 3 × 3 or 5 × 5 convolution: {g:?}"
    );
    let Some(wanted) = grads.bias_then_rest(g, d_out) else {
        return;
    };
    match g.kernel {
        [3, 3] => Three.backward(g, input, weight, d_out, wanted),
        _ => FIVE.backward(g, input, weight, d_out, wanted),
    }
}
