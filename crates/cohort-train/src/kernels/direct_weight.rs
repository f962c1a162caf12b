//! The weight gradient of the column-free convolution ([`super::direct`]),
//! read in place: for every kernel offset `s`, input `i` and output `o`,
//! `dW[o][i][s] += Σ_q d_out[o][q] · input[i][q + offset_s]` over a group's
//! laid-out positions, the input's lanes past a row's edge masked to zero
//! ([`super::direct::BorderMasks`]).
//!
//! As one gemm product per offset, each product packed both of its operands
//! first: per offset, a copy of the whole output gradient and of the whole
//! shifted input, for products whose output is only `C_out × C_in` (16 × 16
//! in resnet_20's first stage), so the packing cost about as much as the
//! multiplications. Here a micro-kernel reads both where they lie: 4
//! outputs × 4 inputs, 16 positions a step, in 16 AVX-512 registers of
//! partial sums, one per position modulo 16.
//!
//! Blocked for the caches: positions in chunks of [`CHUNK`] and, for each
//! chunk, every offset in turn over the same rows (4 output-gradient rows
//! and 4 input rows of a chunk: 32 KB, in L1 across the offsets). A tile's
//! partial sums are carried from chunk to chunk in memory, exactly, and
//! summed across their 16 lanes once at the end in a fixed tree
//! ([`lane_total`]), so every result's order of additions is fixed by the
//! shapes: the portable loops give the same bits, and the tests hold the
//! two to each other.

use std::ops::Range;

use super::direct::{BorderMasks, Kernel, LANES, wide};
/// Outputs of a micro-kernel tile.
const TILE_OUTPUTS: usize = 4;
/// Inputs of a micro-kernel tile.
const TILE_INPUTS: usize = 6;
/// Positions of one chunk: a tile's rows of a chunk stay in L1 while every
/// offset sums over them.
const CHUNK: usize = 1024;

/// One group's products (see the module documentation). `d_out` holds
/// `outputs` rows `d_out_channel` apart, `input` holds `inputs` rows
/// `input_channel` apart, each read at `positions` (a multiple of
/// [`LANES`]) from its start, the input's shifted by each offset.
pub(super) struct WeightProducts<'a> {
    pub(super) d_out: &'a [f32],
    pub(super) d_out_channel: usize,
    pub(super) outputs: usize,
    pub(super) input: &'a [f32],
    pub(super) input_channel: usize,
    pub(super) inputs: usize,
    pub(super) offsets: &'a [usize],
    /// Which lanes of the shifted input lie in their own row, per offset.
    pub(super) masks: &'a BorderMasks,
    pub(super) positions: usize,
}

/// One kernel offset: the input's shift, and which of its lanes lie in
/// their own row ([`BorderMasks`]), one mask per 16 positions.
#[derive(Clone, Copy)]
struct Shift<'a> {
    offset: usize,
    masks: &'a [u16],
}

/// The outputs and inputs of a tile, and where its partial sums lie.
#[derive(Clone)]
struct Tile {
    outputs: Range<usize>,
    inputs: Range<usize>,
}

impl WeightProducts<'_> {
    /// Adds the products to `d_weight` (`[outputs, inputs, offsets]`,
    /// PyTorch's layout of a convolution's weight).
    pub(super) fn add_to(&self, kernel: Kernel, d_weight: &mut [f32]) {
        let taps = self.offsets.len();
        let farthest = self.offsets.iter().copied().max().unwrap_or(0);
        assert!(self.positions.is_multiple_of(LANES));
        assert!(
            self.outputs == 0
                || (self.outputs - 1) * self.d_out_channel + self.positions <= self.d_out.len(),
            "the output gradient holds every position read"
        );
        assert!(
            self.inputs == 0
                || (self.inputs - 1) * self.input_channel + self.positions + farthest
                    <= self.input.len(),
            "the input holds every position read"
        );
        assert!(d_weight.len() >= self.outputs * self.inputs * taps);
        assert!((0..taps).all(|s| self.masks.of(s).len() * LANES >= self.positions));
        assert!(
            kernel == Kernel::Portable || wide(),
            "the wide kernel on a CPU without AVX-512F"
        );
        let per_tap = TILE_OUTPUTS * TILE_INPUTS * LANES;
        let mut lanes = vec![0.0f32; taps * per_tap];
        for first_output in (0..self.outputs).step_by(TILE_OUTPUTS) {
            for first_input in (0..self.inputs).step_by(TILE_INPUTS) {
                let tile = Tile {
                    outputs: first_output..(first_output + TILE_OUTPUTS).min(self.outputs),
                    inputs: first_input..(first_input + TILE_INPUTS).min(self.inputs),
                };
                lanes.fill(0.0);
                for start in (0..self.positions).step_by(CHUNK) {
                    let chunk = start..(start + CHUNK).min(self.positions);
                    let per_offset = self.offsets.iter().zip(lanes.chunks_exact_mut(per_tap));
                    for (s, (&offset, lanes)) in per_offset.enumerate() {
                        let at = Shift {
                            offset,
                            masks: self.masks.of(s),
                        };
                        self.tile(kernel, &tile, chunk.clone(), at, lanes);
                    }
                }
                for (s, lanes) in lanes.chunks_exact(per_tap).enumerate() {
                    for (a, o) in tile.outputs.clone().enumerate() {
                        for (b, i) in tile.inputs.clone().enumerate() {
                            let sums = &lanes[(a * TILE_INPUTS + b) * LANES..][..LANES];
                            d_weight[(o * self.inputs + i) * taps + s] += lane_total(sums);
                        }
                    }
                }
            }
        }
    }

    /// Adds one tile's products over `chunk` at `offset` to its partial
    /// sums (`lanes`: `[TILE_OUTPUTS, TILE_INPUTS, LANES]`, output then
    /// input).
    fn tile(
        &self,
        kernel: Kernel,
        tile: &Tile,
        chunk: Range<usize>,
        at: Shift<'_>,
        lanes: &mut [f32],
    ) {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Wide => {
                let wide = WIDE[tile.outputs.len() - 1][tile.inputs.len() - 1];
                // SAFETY: the CPU has AVX-512F and FMA, and the rows hold
                // every position read (both asserted by `add_to`); the
                // kernel is the one for the tile's shape.
                unsafe { wide(self, tile, chunk, at, lanes) }
            }
            _ => self.tile_portable(tile, chunk, at, lanes),
        }
    }

    fn tile_portable(&self, tile: &Tile, chunk: Range<usize>, at: Shift<'_>, lanes: &mut [f32]) {
        for (a, o) in tile.outputs.clone().enumerate() {
            let d_out = &self.d_out[o * self.d_out_channel..];
            for (b, i) in tile.inputs.clone().enumerate() {
                let input = &self.input[i * self.input_channel + at.offset..];
                let sums = &mut lanes[(a * TILE_INPUTS + b) * LANES..][..LANES];
                for q in chunk.clone().step_by(LANES) {
                    let mask = at.masks[q / LANES];
                    let (d, x) = (&d_out[q..q + LANES], &input[q..q + LANES]);
                    for (lane, ((sum, &d), &x)) in sums.iter_mut().zip(d).zip(x).enumerate() {
                        let x = if mask & (1 << lane) != 0 { x } else { 0.0 };
                        *sum = d.mul_add(x, *sum);
                    }
                }
            }
        }
    }
}

/// [`WeightProducts::tile_portable`] for a tile of `O` outputs × `I`
/// inputs in `O · I` AVX-512 registers: per 16 positions, `I` input
/// loads, `O` output-gradient loads and `O · I` fused multiply-adds.
///
/// # Safety
/// The CPU must have AVX-512F and FMA; the rows must hold every
/// position read (the caller's assertions).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn tile_wide<const O: usize, const I: usize>(
    products: &WeightProducts<'_>,
    tile: &Tile,
    chunk: Range<usize>,
    at: Shift<'_>,
    lanes: &mut [f32],
) {
    use std::arch::x86_64::*;
    let slot = |a: usize, b: usize| (a * TILE_INPUTS + b) * LANES;
    assert!(slot(O - 1, I - 1) + LANES <= lanes.len());
    assert!(tile.outputs.len() == O && tile.inputs.len() == I);
    // SAFETY (every pointer below): inside `lanes` (asserted) or inside
    // the rows (the caller's assertions).
    let mut acc: [[__m512; I]; O] = std::array::from_fn(|a| {
        std::array::from_fn(|b| unsafe { _mm512_loadu_ps(lanes.as_ptr().add(slot(a, b))) })
    });
    let d_out: [*const f32; O] = std::array::from_fn(|a| unsafe {
        products
            .d_out
            .as_ptr()
            .add((tile.outputs.start + a) * products.d_out_channel)
    });
    let input: [*const f32; I] = std::array::from_fn(|b| unsafe {
        products
            .input
            .as_ptr()
            .add((tile.inputs.start + b) * products.input_channel + at.offset)
    });
    assert!(chunk.end <= at.masks.len() * LANES);
    for q in chunk.step_by(LANES) {
        let mask = at.masks[q / LANES];
        // A loop, not `array::from_fn`: its closure lacks this function's
        // target features, so the masked load in it was a call.
        let mut x = [_mm512_setzero_ps(); I];
        for (x, input) in x.iter_mut().zip(&input) {
            *x = unsafe { _mm512_maskz_loadu_ps(mask, input.add(q)) };
        }
        for (sums, row) in acc.iter_mut().zip(&d_out) {
            let d = unsafe { _mm512_loadu_ps(row.add(q)) };
            for (sum, &x) in sums.iter_mut().zip(&x) {
                *sum = _mm512_fmadd_ps(d, x, *sum);
            }
        }
    }
    for (a, sums) in acc.iter().enumerate() {
        for (b, sum) in sums.iter().enumerate() {
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr().add(slot(a, b)), *sum) };
        }
    }
}

/// The wide micro-kernel of a tile of `o` outputs and `i` inputs at
/// `WIDE[o − 1][i − 1]`: full tiles, and the ragged ones at the edges.
#[cfg(target_arch = "x86_64")]
type WideTile = unsafe fn(&WeightProducts<'_>, &Tile, Range<usize>, Shift<'_>, &mut [f32]);

#[cfg(target_arch = "x86_64")]
macro_rules! wide_row {
    ($o:literal) => {
        [
            tile_wide::<$o, 1>,
            tile_wide::<$o, 2>,
            tile_wide::<$o, 3>,
            tile_wide::<$o, 4>,
            tile_wide::<$o, 5>,
            tile_wide::<$o, 6>,
        ]
    };
}

#[cfg(target_arch = "x86_64")]
const WIDE: [[WideTile; TILE_INPUTS]; TILE_OUTPUTS] =
    [wide_row!(1), wide_row!(2), wide_row!(3), wide_row!(4)];

/// The sum of 16 lanes in a fixed tree: halves added, then quarters, and
/// so on.
fn lane_total(lanes: &[f32]) -> f32 {
    let mut values: [f32; LANES] = lanes.try_into().expect("16 lanes");
    let mut width = LANES / 2;
    while width > 0 {
        for j in 0..width {
            values[j] += values[j + width];
        }
        width /= 2;
    }
    values[0]
}
