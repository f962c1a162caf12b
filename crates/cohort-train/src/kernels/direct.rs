//! A stride-1 convolution without a column matrix, on CPUs with AVX-512:
//! forward, input gradient, and weight and bias gradients.
//!
//! [`super::im2col`] copies every input value `kh·kw` times into a column
//! matrix and, on the way back, folds a column gradient of that size into
//! the input gradient; for resnet_20 those copies were as long as the
//! products themselves (`cargo bench -p cohort-train --bench conv_shifts`).
//! Here the input is laid out once, with zero rows between images, so that
//! every kernel offset `(ky, kx)` reads the same matrix shifted by `ky·row +
//! kx` floats ([`Layout`]; reads past a row's edge masked to zero,
//! [`BorderMasks`]), and a micro-kernel ([`Pass::tile_wide`]) runs the offsets inside its
//! inner loop: 48 output positions × 8 output channels in 24 AVX-512
//! registers, summed over input channels and offsets. The input gradient is
//! the same kernel over the output gradient with the offsets reversed; the
//! weight gradient reads the output gradient and the shifted input in place
//! with a micro-kernel of its own ([`super::direct_weight`]).
//!
//! Results equal [`super::im2col`]'s up to the order of the sums (a test
//! holds them to each other on ragged shapes); one thread, an order fixed by
//! the shapes, the same bits on every run. Where it applies:
//! [`applies`].

use std::cell::RefCell;

use super::direct_weight::WeightProducts;
use super::im2col::{Geometry, Grads, add_bias, check, copy_short, zero_short};

/// Output positions of one micro-kernel tile: three vectors of 16.
const TILE_POSITIONS: usize = 48;
/// Output channels of one micro-kernel tile: eight, so that the 16, 32
/// and 64 channels of ResNets' stages fill whole tiles. With six a tile
/// (and 64 positions), 16 channels computed 18 and 32 computed 36, and
/// cnn, cnn_femnist and resnet_20 trained 6–12 % slower on a Zen 4 core
/// (docs/BENCHMARKS.md, "Eight output channels a tile").
const TILE_CHANNELS: usize = 8;
/// Positions a group of images aims at: the weight gradient sums over a
/// group's positions at a time, and their count sets the buffers' size.
const POSITIONS_PER_GROUP: usize = 4096;
/// Inputs a pass sums over a block of positions before the next chunk
/// ([`Pass::run`]).
const CHUNK_INPUTS: usize = 64;
/// Positions of one block of a pass ([`Pass::run`]): whole tiles, about 512.
const BLOCK_POSITIONS: usize = 10 * TILE_POSITIONS;
/// Below this many input channels the column matrix is short and im2col's
/// single product computes the forward pass and the input gradient faster
/// (a first layer's 1 or 3 channels).
const MIN_INPUT_CHANNELS: usize = 8;
/// From this many pairs of input and output channels on, im2col's product
/// (gemm's micro-kernel, blocked for the caches over `C_in·kh·kw`) is
/// faster than this kernel in every pass: 256→256 at 8 × 8 ran at 74
/// GFLOP/s here and 96 through im2col, 128→256 at 89 and 99, 64→128 at 16
/// × 16 at 95 and 96; at 64→64 and below this kernel wins (8 × 8: 88
/// against 72; 32 × 32: 99 against 90). Measured on a Zen 4 core
/// (docs/BENCHMARKS.md, "Each pass where it is fastest").
const MAX_CHANNEL_PAIRS: usize = 64 * 128;

/// Whether this convolution's forward pass and input gradient run here:
/// stride 1, the same padding on both sides of an axis and no more than
/// the kernel's side minus one, at least [`MIN_INPUT_CHANNELS`] input
/// channels, fewer than [`MAX_CHANNEL_PAIRS`] pairs of channels, a kernel
/// larger than 1 × 1 (a pointwise convolution needs no column matrix
/// anyway), images whose outputs are at least three quarters of the
/// padded image (8 × 8 and larger for a 3 × 3 kernel of padding 1), on a
/// CPU with AVX-512F and FMA. On 4 × 4 and 2 × 2 maps (VGG's and
/// ResNet-18's last layers) this kernel is slower than im2col's product:
/// vgg_11 trained 35 % slower when a third to a half of its positions were
/// padding, and still 11 % slower (80 → 71 samples/s) when [`Layout`]'s
/// rows lost their padding columns and 4 × 4 maps threw away only a fifth.
pub(crate) fn applies(g: &Geometry) -> bool {
    let symmetric = g.pad[0].0 == g.pad[0].1 && g.pad[1].0 == g.pad[1].1;
    let fits = g.pad[0].0 < g.kernel[0] && g.pad[1].0 < g.kernel[1];
    let Some([out_h, out_w]) = g.output() else {
        return false;
    };
    let padded = (g.height + g.pad[0].0) * (g.width + g.pad[1].0);
    g.stride == [1, 1]
        && symmetric
        && fits
        && g.kernel != [1, 1]
        && g.c_in >= MIN_INPUT_CHANNELS
        && g.c_in.saturating_mul(g.c_out) < MAX_CHANNEL_PAIRS
        && 4 * out_h * out_w >= 3 * padded
        && wide()
}

/// Whether the CPU has the micro-kernel's instructions.
pub(crate) fn wide() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Which micro-kernel computes the tiles: AVX-512, or the same sums in
/// plain loops (tests hold the two against each other and against im2col
/// on any CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    Wide,
    Portable,
}

/// A group of `images` images laid out flat: each row `row = max(W, out_w)`
/// floats (zeros past `W`), each image `rows = H + pad_h` rows (the last
/// `pad_h` zero, shared with the next image's top border), `pad_h` zero
/// rows before the first image and `pad_w` zeros before everything.
/// Input `(image, y, x)` lies at [`Layout::input_at`]; output `(image, oy,
/// ox)` is computed at position `(image·rows + oy)·row + ox` from the input
/// at that position plus [`Layout::offset`]`(ky, kx)`. Positions whose
/// `ox ≥ out_w` or `oy ≥ out_h` are computed and thrown away.
///
/// Rows carry no padding columns: a read past a row's left or right edge
/// lands in the neighbouring row, and [`BorderMasks`] zero those lanes
/// instead. With a padding column per row (`row = W + pad_w`, the zeros
/// shared by neighbouring rows) the positions thrown away were 27 % more
/// than those kept at 8 × 8 (81 for 64), 13 % at 16 × 16 and 31 % for
/// cnn's 5 × 5 kernels at 14 × 14; now 12.5 %, 6 % and 14 %, the padding
/// rows alone.
#[derive(Debug, Clone, Copy)]
struct Layout {
    images: usize,
    row: usize,
    rows: usize,
    pad: [usize; 2],
    /// Output positions computed: the group's, rounded up to whole tiles.
    positions: usize,
    /// Floats a channel takes, margins for the last tile's reads included.
    channel: usize,
}

impl Layout {
    fn new(g: &Geometry, images: usize) -> Self {
        let pad = [g.pad[0].0, g.pad[1].0];
        let row = laid_out_row(g);
        let rows = g.height + pad[0];
        let positions = (images * rows * row).next_multiple_of(TILE_POSITIONS);
        let farthest = (g.kernel[0] - 1) * row + g.kernel[1] - 1;
        let data_end = pad[1] + (images * rows + pad[0]) * row;
        Self {
            images,
            row,
            rows,
            pad,
            positions,
            channel: (positions + farthest).max(data_end),
        }
    }

    fn offset(&self, ky: usize, kx: usize) -> usize {
        ky * self.row + kx
    }

    /// Every kernel offset's shift, `(ky, kx)` in PyTorch's order.
    fn offsets(&self, g: &Geometry) -> Vec<usize> {
        let [kh, kw] = g.kernel;
        (0..kh * kw).map(|s| self.offset(s / kw, s % kw)).collect()
    }

    fn input_at(&self, image: usize, y: usize) -> usize {
        self.pad[1] + (image * self.rows + self.pad[0] + y) * self.row
    }

    /// Positions the input gradient's pass computes: every laid-out input
    /// position, in whole tiles.
    fn input_gradient_positions(&self) -> usize {
        self.channel.next_multiple_of(TILE_POSITIONS)
    }

    fn output_at(&self, image: usize, oy: usize) -> usize {
        (image * self.rows + oy) * self.row
    }
}

/// Positions an image takes in a [`Layout`]: its rows, each with the
/// padding it shares with the next, of [`laid_out_row`] columns.
fn laid_out_per_image(g: &Geometry) -> usize {
    (g.height + g.pad[0].0) * laid_out_row(g)
}

/// A laid-out row: the input's width, or the output's where padding makes
/// it wider.
fn laid_out_row(g: &Geometry) -> usize {
    let out_w = g.output().map_or(0, |[_, out_w]| out_w);
    g.width.max(out_w)
}

/// Which lanes of a pass's reads lie in the row they belong to: bit `l` of
/// [`BorderMasks::of`]`(s)[v]` is set where position `16·v + l`, read at
/// kernel offset number `s`, takes a value of its own row; a clear bit is a
/// read past the row's edge (into the neighbouring row, [`Layout`] having no
/// padding columns), which the kernels load as zero.
pub(super) struct BorderMasks {
    bits: Vec<u16>,
    vectors: usize,
}

impl BorderMasks {
    /// Masks for `positions` (a multiple of 16) whose column is `(q −
    /// phase) mod row`, for offsets of kernel columns `columns[s]`, where
    /// `reads(column, kx)` says whether a position of that column reads its
    /// own row at kernel column `kx`.
    fn new(
        positions: usize,
        (row, phase): (usize, usize),
        columns: &[usize],
        reads: impl Fn(usize, usize) -> bool,
    ) -> Self {
        let vectors = positions.div_ceil(LANES);
        let kernel_columns = columns.iter().max().map_or(0, |kx| kx + 1);
        // One table per kernel column, then copied per offset.
        let per_column: Vec<Vec<u16>> = (0..kernel_columns)
            .map(|kx| {
                let mut column = (row - phase % row) % row;
                (0..vectors)
                    .map(|_| {
                        let mut bits = 0u16;
                        for lane in 0..LANES {
                            if reads(column, kx) {
                                bits |= 1 << lane;
                            }
                            column = if column + 1 == row { 0 } else { column + 1 };
                        }
                        bits
                    })
                    .collect()
            })
            .collect();
        let bits = columns
            .iter()
            .flat_map(|&kx| per_column[kx].iter().copied())
            .collect();
        Self { bits, vectors }
    }

    /// The forward pass's and the weight gradient's masks: output column
    /// `ox` reads input column `ox + kx − pad_w`, inside `0..W`.
    fn forward(g: &Geometry, layout: &Layout) -> Self {
        let kw = g.kernel[1];
        let taps = g.kernel[0] * kw;
        let columns: Vec<usize> = (0..taps).map(|s| s % kw).collect();
        let (pad, width) = (layout.pad[1], g.width);
        Self::new(layout.positions, (layout.row, 0), &columns, |ox, kx| {
            ox + kx >= pad && ox + kx - pad < width
        })
    }

    /// The input gradient's masks over its positions of the laid-out input
    /// (offsets last to first): input column `x` reads the output
    /// gradient's column `x + pad_w − kx`, inside `0..out_w`.
    fn input_gradient(g: &Geometry, layout: &Layout) -> Self {
        let kw = g.kernel[1];
        let taps = g.kernel[0] * kw;
        let columns: Vec<usize> = (0..taps).map(|s| (taps - 1 - s) % kw).collect();
        let out_w = g.output().map_or(0, |[_, out_w]| out_w);
        let pad = layout.pad[1];
        let positions = layout.input_gradient_positions();
        Self::new(positions, (layout.row, pad), &columns, |x, kx| {
            x + pad >= kx && x + pad - kx < out_w
        })
    }

    /// The masks of offset number `s`, one per 16 positions.
    pub(super) fn of(&self, s: usize) -> &[u16] {
        &self.bits[s * self.vectors..][..self.vectors]
    }

    /// The same masks tile by tile: for each tile of [`TILE_POSITIONS`],
    /// for each offset, its vectors' masks, so a micro-kernel reads its
    /// tile's in order, without an index to compute or check per offset.
    fn by_tile(&self) -> Vec<[u16; TILE_VECTORS]> {
        let taps = self.bits.len() / self.vectors.max(1);
        let tiles = self.vectors / TILE_VECTORS;
        let mut out = Vec::with_capacity(tiles * taps);
        for tile in 0..tiles {
            for s in 0..taps {
                let masks = &self.of(s)[tile * TILE_VECTORS..][..TILE_VECTORS];
                out.push(masks.try_into().expect("a tile's vectors"));
            }
        }
        out
    }
}

/// Vectors of 16 positions in a micro-kernel tile.
const TILE_VECTORS: usize = TILE_POSITIONS / LANES;

/// Positions a mask covers, and the weight gradient sums side by side: one
/// AVX-512 vector.
pub(super) const LANES: usize = 16;

/// Images a group holds: about [`POSITIONS_PER_GROUP`] positions.
fn images_per_group(g: &Geometry) -> usize {
    (POSITIONS_PER_GROUP / laid_out_per_image(g).max(1)).clamp(1, g.batch.max(1))
}

thread_local! {
    /// The laid-out input, the output (or its gradient) and the laid-out
    /// output gradient of one group, reused from call to call (and by
    /// [`super::shifted`] for its layout, copies and product: a pass runs
    /// one path at a time).
    static BUFFERS: RefCell<[Vec<f32>; 3]> = const { RefCell::new([Vec::new(), Vec::new(), Vec::new()]) };
}

/// `f` with the thread's three buffers (see `im2col::with_columns` for why
/// they are taken out of the cell rather than used inside `with`, and why
/// this is inlined: `f`'s copies run in the caller's AVX2 function).
#[inline(always)]
pub(super) fn with_buffers<R>(f: impl FnOnce(&mut [Vec<f32>; 3]) -> R) -> R {
    let mut buffers = BUFFERS.with(RefCell::take);
    let result = f(&mut buffers);
    BUFFERS.with(|cell| cell.replace(buffers));
    result
}

/// `buffer` holding `len` values, unspecified: for what is then written
/// whole (a pass's output, [`lay_out`]'s channels).
pub(super) fn sized(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    &mut buffer[..len]
}

/// `planes` (`[images, C, h, w]`) laid out by `layout` into `out`,
/// `channel_len` floats a channel, each plane's row `y` at `at(image, y)`
/// (increasing with the image and the row), and zeros everywhere else: each
/// channel written whole, its gaps (a row's padding, the rows between
/// images) zeroed as it goes, so `out` need not be cleared first (a
/// `memset` of the whole buffer was 7 % of resnet_20's step).
#[inline(always)]
fn lay_out(
    planes: &[f32],
    (channels, h, w): (usize, usize, usize),
    layout: &Layout,
    channel_len: usize,
    at: impl Fn(&Layout, usize, usize) -> usize,
    out: &mut [f32],
) {
    for c in 0..channels {
        let channel = &mut out[c * channel_len..][..channel_len];
        let mut written = 0;
        for image in 0..layout.images {
            let plane = &planes[(image * channels + c) * h * w..][..h * w];
            for (y, line) in plane.chunks_exact(w).enumerate() {
                let start = at(layout, image, y);
                zero_short(&mut channel[written..start]);
                copy_short(&mut channel[start..][..w], line);
                written = start + w;
            }
        }
        channel[written..].fill(0.0);
    }
}

/// The group of `layout.images` images of `input` from image `first` on,
/// laid out into `buffer`.
#[inline(always)]
fn lay_out_input<'b>(
    g: &Geometry,
    layout: &Layout,
    input: &[f32],
    first: usize,
    buffer: &'b mut Vec<f32>,
) -> &'b [f32] {
    let laid = sized(buffer, g.c_in * layout.channel);
    let images = &input[first * g.input_len()..][..layout.images * g.input_len()];
    let dims = (g.c_in, g.height, g.width);
    lay_out(images, dims, layout, layout.channel, Layout::input_at, laid);
    laid
}

/// The inverse of [`lay_out`]: the planes read back out of `laid`.
#[inline(always)]
fn gather(
    laid: &[f32],
    (channels, h, w): (usize, usize, usize),
    layout: &Layout,
    channel_len: usize,
    at: impl Fn(&Layout, usize, usize) -> usize,
    planes: &mut [f32],
) {
    for image in 0..layout.images {
        for c in 0..channels {
            let plane = &mut planes[(image * channels + c) * h * w..][..h * w];
            let channel = &laid[c * channel_len..][..channel_len];
            for (y, line) in plane.chunks_exact_mut(w).enumerate() {
                copy_short(line, &channel[at(layout, image, y)..][..w]);
            }
        }
    }
}

/// Weights in the micro-kernel's order: for each block of
/// [`TILE_CHANNELS`] outputs, for each input, for each offset, the block's
/// [`TILE_CHANNELS`] values (zero past the last output). `value(o, i, s)`
/// is the weight from input `i` to output `o` at offset number `s`.
fn pack(
    (outputs, inputs, offsets): (usize, usize, usize),
    value: impl Fn(usize, usize, usize) -> f32,
) -> Vec<f32> {
    let blocks = outputs.div_ceil(TILE_CHANNELS);
    let mut packed = Vec::with_capacity(blocks * inputs * offsets * TILE_CHANNELS);
    for block in 0..blocks {
        for i in 0..inputs {
            for s in 0..offsets {
                for n in 0..TILE_CHANNELS {
                    let o = block * TILE_CHANNELS + n;
                    packed.push(if o < outputs { value(o, i, s) } else { 0.0 });
                }
            }
        }
    }
    packed
}

/// One shifted-sum pass: `out[o][q] += Σ_i Σ_s w(o, i, s) · source[i][q +
/// offsets[s]]` for `q < positions` (a multiple of [`TILE_POSITIONS`]),
/// `out` holding whole blocks of [`TILE_CHANNELS`] rows of `positions`.
struct Pass<'a> {
    source: &'a [f32],
    source_channel: usize,
    inputs: usize,
    offsets: Vec<usize>,
    /// [`BorderMasks::by_tile`]: each tile's masks, offset by offset (a
    /// call's largest group's: a smaller group's are their first tiles).
    masks: &'a [[u16; TILE_VECTORS]],
    packed: &'a [f32],
    positions: usize,
}

impl Pass<'_> {
    /// Writes the pass's sums to `out` (whole blocks of rows: every value).
    ///
    /// Blocked for the caches, as a matrix product is: the inputs in chunks
    /// of [`CHUNK_INPUTS`] and the positions in blocks of
    /// [`BLOCK_POSITIONS`], so that a chunk of a block's source (64 inputs
    /// × 512 positions and the offsets' reach: about 150 KB) stays in L2
    /// while every output block sums over it, and an output block's weights
    /// for the chunk (64 × 9 × 6 floats) stay in L1 across the block's
    /// tiles. One pass over all the inputs for one output block at a time
    /// re-read the whole source from memory for each block of outputs:
    /// vgg_11 trained 35 % slower than through im2col. A tile carries its
    /// sums from chunk to chunk through `out`, exactly (a float32 stored
    /// and loaded back is the same float), so the blocking leaves every
    /// output's order of additions as it was: inputs in order, offsets in
    /// order within each input.
    fn run(&self, kernel: Kernel, out: &mut [f32]) {
        let taps = self.offsets.len();
        let per_block = self.inputs * taps * TILE_CHANNELS;
        let farthest = self.offsets.iter().copied().max().unwrap_or(0);
        assert!(self.positions.is_multiple_of(TILE_POSITIONS));
        assert!(self.masks.len() >= self.positions / TILE_POSITIONS * taps);
        assert!(
            self.inputs == 0
                || (self.inputs - 1) * self.source_channel + self.positions + farthest
                    <= self.source.len(),
            "the source holds every position a tile reads"
        );
        assert!(
            kernel == Kernel::Portable || wide(),
            "the wide kernel on a CPU without AVX-512F"
        );
        if per_block == 0 {
            return;
        }
        let blocks = self.packed.len() / per_block;
        assert!(out.len() >= blocks * TILE_CHANNELS * self.positions);
        for first in (0..self.inputs).step_by(CHUNK_INPUTS) {
            let chunk = first..(first + CHUNK_INPUTS).min(self.inputs);
            let weights_of_chunk =
                chunk.start * taps * TILE_CHANNELS..chunk.end * taps * TILE_CHANNELS;
            for block_start in (0..self.positions).step_by(BLOCK_POSITIONS) {
                let block_end = (block_start + BLOCK_POSITIONS).min(self.positions);
                for block in 0..blocks {
                    let weights = &self.packed[block * per_block..][weights_of_chunk.clone()];
                    let rows = &mut out[block * TILE_CHANNELS * self.positions..]
                        [..TILE_CHANNELS * self.positions];
                    for start in (block_start..block_end).step_by(TILE_POSITIONS) {
                        let tile = Tile {
                            start,
                            inputs: chunk.clone(),
                        };
                        match kernel {
                            #[cfg(target_arch = "x86_64")]
                            Kernel::Wide => {
                                // SAFETY: the CPU has AVX-512F and FMA (checked
                                // above); the source holds every position read
                                // (asserted above), `weights` the chunk's values
                                // of an output block, and `rows` a block's rows of
                                // `positions` from `start` on.
                                unsafe { self.tile_wide(tile, weights, rows) }
                            }
                            _ => self.tile_portable(tile, weights, rows),
                        }
                    }
                }
            }
        }
    }

    /// A tile's border masks, offset by offset.
    fn tile_masks(&self, tile: &Tile) -> &[[u16; TILE_VECTORS]] {
        let taps = self.offsets.len();
        &self.masks[tile.start / TILE_POSITIONS * taps..][..taps]
    }

    fn tile_portable(&self, tile: Tile, weights: &[f32], rows: &mut [f32]) {
        let mut acc = [[0.0f32; TILE_POSITIONS]; TILE_CHANNELS];
        if tile.inputs.start > 0 {
            for (n, sums) in acc.iter_mut().enumerate() {
                sums.copy_from_slice(&rows[n * self.positions + tile.start..][..TILE_POSITIONS]);
            }
        }
        let mut w = weights.chunks_exact(TILE_CHANNELS);
        let tile_masks = self.tile_masks(&tile);
        for i in tile.inputs {
            let channel = &self.source[i * self.source_channel..];
            for (&offset, masks) in self.offsets.iter().zip(tile_masks) {
                let values: [f32; TILE_POSITIONS] = std::array::from_fn(|q| {
                    let inside = masks[q / LANES] & (1 << (q % LANES)) != 0;
                    if inside {
                        channel[tile.start + offset + q]
                    } else {
                        0.0
                    }
                });
                let block = w.next().expect("a block's weights");
                for (sums, &weight) in acc.iter_mut().zip(block) {
                    for (sum, &v) in sums.iter_mut().zip(&values) {
                        *sum = weight.mul_add(v, *sum);
                    }
                }
            }
        }
        for (n, sums) in acc.iter().enumerate() {
            rows[n * self.positions + tile.start..][..TILE_POSITIONS].copy_from_slice(sums);
        }
    }

    /// [`Pass::tile_portable`] in 24 AVX-512 registers: per input and
    /// offset, three loads of 16 positions, eight broadcast weights, 24 fused
    /// multiply-adds.
    ///
    /// # Safety
    /// The CPU must have AVX-512F and FMA; the caller checked the lengths.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn tile_wide(&self, tile: Tile, weights: &[f32], rows: &mut [f32]) {
        use std::arch::x86_64::*;
        let row = |n: usize| n * self.positions + tile.start;
        assert!(row(TILE_CHANNELS - 1) + TILE_POSITIONS <= rows.len());
        assert!(weights.len() >= tile.inputs.len() * self.offsets.len() * TILE_CHANNELS);
        let carried = tile.inputs.start > 0;
        // SAFETY: each row holds a tile's positions from `row(n)` on (asserted).
        let mut acc: [[__m512; TILE_VECTORS]; TILE_CHANNELS] = std::array::from_fn(|n| {
            std::array::from_fn(|v| match carried {
                true => unsafe { _mm512_loadu_ps(rows.as_ptr().add(row(n) + LANES * v)) },
                false => _mm512_setzero_ps(),
            })
        });
        let tile_masks = self.tile_masks(&tile);
        let mut w = weights.as_ptr();
        for i in tile.inputs {
            // SAFETY: within the source (the caller's assertion).
            let channel = unsafe {
                self.source
                    .as_ptr()
                    .add(i * self.source_channel + tile.start)
            };
            for (&offset, masks) in self.offsets.iter().zip(tile_masks) {
                // SAFETY: a tile's positions from `start + offset` on lie in
                // the source (the caller's assertion).
                // A loop, not `array::from_fn`: its closure lacks this
                // function's target features, so the masked load in it
                // was a call.
                let mut values = [_mm512_setzero_ps(); TILE_VECTORS];
                for (v, value) in values.iter_mut().enumerate() {
                    *value =
                        unsafe { _mm512_maskz_loadu_ps(masks[v], channel.add(offset + LANES * v)) };
                }
                for sums in acc.iter_mut() {
                    // SAFETY: the chunk's weights hold `TILE_CHANNELS` values
                    // for every input and offset (asserted).
                    let weight = unsafe {
                        let weight = _mm512_set1_ps(*w);
                        w = w.add(1);
                        weight
                    };
                    for (sum, &v) in sums.iter_mut().zip(&values) {
                        *sum = _mm512_fmadd_ps(weight, v, *sum);
                    }
                }
            }
        }
        for (n, sums) in acc.iter().enumerate() {
            for (v, sum) in sums.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe { _mm512_storeu_ps(rows.as_mut_ptr().add(row(n) + LANES * v), *sum) };
            }
        }
    }
}

/// The positions and the chunk of inputs one micro-kernel call sums.
#[derive(Clone)]
struct Tile {
    start: usize,
    inputs: std::ops::Range<usize>,
}

/// `out = conv(input, weight) + bias`, as [`super::im2col::forward`]
/// (the same layouts); the caller checked [`applies`] (or asks for the
/// portable kernel). Inlined into the caller's AVX2 function
/// ([`super::simd::dispatch`]), as im2col's passes are, so the copies
/// between layouts run eight lanes wide.
#[inline(always)]
pub(crate) fn forward(
    g: &Geometry,
    input: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    kernel: Kernel,
) {
    let [out_h, out_w] = g.output().expect("a valid geometry");
    let [kh, kw] = g.kernel;
    assert_eq!(input.len(), g.batch * g.input_len(), "input length");
    assert_eq!(weight.len(), g.weight_len(), "weight length");
    assert_eq!(out.len(), g.batch * g.output_len(), "output length");
    let taps = kh * kw;
    let packed = pack((g.c_out, g.c_in, taps), |o, i, s| {
        weight[(o * g.c_in + i) * taps + s]
    });
    let most = images_per_group(g);
    // A position's masks depend on its column alone, so the largest
    // group's serve every group; built per group they cost a tenth of
    // resnet_20's first stage.
    let masks = BorderMasks::forward(g, &Layout::new(g, most)).by_tile();
    with_buffers(
        #[inline(always)]
        |[laid, product, _]| {
            for first in (0..g.batch).step_by(most) {
                let layout = Layout::new(g, most.min(g.batch - first));
                let offsets = layout.offsets(g);
                let laid = lay_out_input(g, &layout, input, first, laid);
                let blocks = g.c_out.div_ceil(TILE_CHANNELS);
                let product = sized(product, blocks * TILE_CHANNELS * layout.positions);
                let pass = Pass {
                    source: laid,
                    source_channel: layout.channel,
                    inputs: g.c_in,
                    offsets,
                    masks: &masks,
                    packed: &packed,
                    positions: layout.positions,
                };
                pass.run(kernel, product);
                let dst = &mut out[first * g.output_len()..][..layout.images * g.output_len()];
                let dims = (g.c_out, out_h, out_w);
                gather(
                    product,
                    dims,
                    &layout,
                    layout.positions,
                    Layout::output_at,
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
/// [`super::im2col::backward`] computes them (inlined as [`forward`] is).
#[inline(always)]
pub(crate) fn backward(
    g: &Geometry,
    input: &[f32],
    weight: &[f32],
    d_out: &[f32],
    grads: Grads<'_>,
    kernel: Kernel,
) {
    let taps = g.kernel[0] * g.kernel[1];
    check(g, input.len(), weight.len(), d_out.len());
    let Some((mut d_input, mut d_weight)) = grads.bias_then_rest(g, d_out) else {
        return;
    };
    // The input gradient reads the output gradient at `q − offset`: shifted
    // by the largest offset, every read is at `q + (largest − offset)`.
    let reversed = pack((g.c_in, g.c_out, taps), |i, o, s| {
        weight[(o * g.c_in + i) * taps + (taps - 1 - s)]
    });
    if let Some(d_weight) = d_weight.as_deref_mut() {
        d_weight.fill(0.0);
    }
    let most = images_per_group(g);
    // As in `forward`: the largest group's masks serve every group; each
    // only for the gradient asked for.
    let full = Layout::new(g, most);
    let weight_masks = d_weight.is_some().then(|| BorderMasks::forward(g, &full));
    let input_masks = d_input
        .is_some()
        .then(|| BorderMasks::input_gradient(g, &full).by_tile());
    with_buffers(
        #[inline(always)]
        |[laid, d_laid, grad]| {
            for first in (0..g.batch).step_by(most) {
                let layout = Layout::new(g, most.min(g.batch - first));
                let images = &d_out[first * g.output_len()..][..layout.images * g.output_len()];
                let grad = GroupGradient::lay_out(g, &layout, images, grad);
                if let (Some(d_weight), Some(masks)) = (d_weight.as_deref_mut(), &weight_masks) {
                    let laid = lay_out_input(g, &layout, input, first, laid);
                    grad.weight_gradient(g, &layout, laid, masks, kernel, d_weight);
                }
                if let (Some(d_input), Some(masks)) = (d_input.as_deref_mut(), &input_masks) {
                    let d_images =
                        &mut d_input[first * g.input_len()..][..layout.images * g.input_len()];
                    let pass = grad.input_gradient_pass(g, &layout, &reversed, masks);
                    let positions = pass.positions;
                    let d_laid = sized(
                        d_laid,
                        g.c_in.div_ceil(TILE_CHANNELS) * TILE_CHANNELS * positions,
                    );
                    pass.run(kernel, d_laid);
                    let dims = (g.c_in, g.height, g.width);
                    gather(d_laid, dims, &layout, positions, Layout::input_at, d_images);
                }
            }
        },
    );
}

/// A group's output gradient laid out as its output is computed (zero at
/// the positions thrown away), each channel after `farthest` zeros (the
/// largest offset) so that the input gradient reads it at non-negative
/// offsets, and `farthest` plus a tile's zeros after it.
struct GroupGradient<'a> {
    values: &'a [f32],
    channel: usize,
    farthest: usize,
}

impl<'a> GroupGradient<'a> {
    #[inline(always)]
    fn lay_out(g: &Geometry, layout: &Layout, images: &[f32], buffer: &'a mut Vec<f32>) -> Self {
        let [out_h, out_w] = g.output().expect("a valid geometry");
        let farthest = layout.offset(g.kernel[0] - 1, g.kernel[1] - 1);
        let channel = farthest + layout.positions + farthest + TILE_POSITIONS;
        let values = sized(buffer, g.c_out * channel);
        let at = |l: &Layout, image: usize, y: usize| farthest + Layout::output_at(l, image, y);
        lay_out(images, (g.c_out, out_h, out_w), layout, channel, at, values);
        Self {
            values,
            channel,
            farthest,
        }
    }

    /// Adds the group's weight gradient to `d_weight` (`[C_out, C_in,
    /// taps]`): the output gradient's rows against the laid-out input
    /// shifted by each kernel offset, over the group's positions
    /// ([`WeightProducts`]).
    #[inline(always)]
    fn weight_gradient(
        &self,
        g: &Geometry,
        layout: &Layout,
        laid: &[f32],
        masks: &BorderMasks,
        kernel: Kernel,
        d_weight: &mut [f32],
    ) {
        let offsets = layout.offsets(g);
        let products = WeightProducts {
            d_out: &self.values[self.farthest..],
            d_out_channel: self.channel,
            outputs: g.c_out,
            input: laid,
            input_channel: layout.channel,
            inputs: g.c_in,
            offsets: &offsets,
            masks,
            positions: layout.positions,
        };
        products.add_to(kernel, d_weight);
    }

    /// The pass that computes the group's input gradient over its laid-out
    /// input positions (`reversed`: the weights packed with the inputs as
    /// outputs, offsets last to first). Every position gathered (below
    /// `layout.channel`) reads its own channel of the gradient: the data
    /// end at most `farthest` past the computed positions, and a channel
    /// holds `farthest` more than that.
    fn input_gradient_pass<'p>(
        &'p self,
        g: &Geometry,
        layout: &Layout,
        reversed: &'p [f32],
        masks: &'p [[u16; TILE_VECTORS]],
    ) -> Pass<'p> {
        let [kh, kw] = g.kernel;
        let taps = kh * kw;
        let offsets = (0..taps)
            .map(|s| self.farthest - layout.offset((taps - 1 - s) / kw, (taps - 1 - s) % kw))
            .collect();
        let positions = layout.input_gradient_positions();
        Pass {
            source: self.values,
            source_channel: self.channel,
            inputs: g.c_out,
            offsets,
            masks,
            packed: reversed,
            positions,
        }
    }
}
