//! F(2 × 2, r × r) for any `r`, its transforms driven by the matrices of
//! [`Minimal`]: F(2 × 2, 5 × 5) for cnn's and cnn_femnist's 5 × 5 layers.

use super::{KERNEL_CHUNK, KernelOrder, TILE_SIDE, Tiles, Transforms};

/// A minimal filtering algorithm F(2 × 2, r × r) on `n × n` patches (`n = r
/// + 1`), by its three matrices.
pub(super) struct Minimal<const N: usize, const R: usize> {
    /// `Bᵀ`: a patch into the transformed space (rows, then columns).
    input: [[f32; N]; N],
    /// `G`: a kernel into the transformed space.
    kernel: [[f32; R]; N],
    /// `Aᵀ`: the summed products back to a tile's 2 × 2 outputs.
    output: [[f32; N]; TILE_SIDE],
}

/// F(2 × 2, 5 × 5), Toom-Cook at 0, 1, −1, 2, −2 and infinity (the
/// matrices solved exactly, in rationals, from `Aᵀ` and `G`; `G`'s sixths
/// and twelfths round once, in the kernel's transform).
pub(super) const FIVE: Minimal<6, 5> = Minimal {
    input: [
        [4.0, 0.0, -5.0, 0.0, 1.0, 0.0],
        [0.0, -4.0, -4.0, 1.0, 1.0, 0.0],
        [0.0, 4.0, -4.0, -1.0, 1.0, 0.0],
        [0.0, -2.0, -1.0, 2.0, 1.0, 0.0],
        [0.0, 2.0, -1.0, -2.0, 1.0, 0.0],
        [0.0, 4.0, 0.0, -5.0, 0.0, 1.0],
    ],
    kernel: [
        [1.0 / 4.0, 0.0, 0.0, 0.0, 0.0],
        [-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0],
        [-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0],
        [1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0, 1.0 / 3.0, 2.0 / 3.0],
        [1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0, -1.0 / 3.0, 2.0 / 3.0],
        [0.0, 0.0, 0.0, 0.0, 1.0],
    ],
    output: [
        [1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
        [0.0, 1.0, -1.0, 2.0, -2.0, 1.0],
    ],
};

/// Most terms of one [`combine`]: a 6 × 6 patch's row.
const MAX_TERMS: usize = 6;

/// `out[k] = Σ_j coefficients[j] · inputs[j][k]`, the terms with a zero
/// coefficient left out and the others summed in order (a product by ±1 is
/// exact, so F(2 × 2, 3 × 3)'s sums are plain additions and subtractions).
/// One loop over `k` for up to three terms, which the compiler vectorizes
/// (inlined into the caller's AVX2 function); further terms are added in
/// further loops, in the same order.
#[inline(always)]
fn combine(out: &mut [f32], coefficients: &[f32], inputs: &[&[f32]]) {
    assert!(coefficients.len() <= MAX_TERMS && coefficients.len() == inputs.len());
    let n = out.len();
    let mut c = [0.0f32; MAX_TERMS];
    let mut x: [&[f32]; MAX_TERMS] = [&[]; MAX_TERMS];
    let mut terms = 0;
    for (&coefficient, &input) in coefficients.iter().zip(inputs) {
        if coefficient != 0.0 {
            (c[terms], x[terms]) = (coefficient, &input[..n]);
            terms += 1;
        }
    }
    let (a, b, d) = (x[0], x[1], x[2]);
    match terms {
        0 => out.fill(0.0),
        1 => {
            let a = &a[..n];
            for k in 0..n {
                out[k] = c[0] * a[k];
            }
        }
        2 => {
            let (a, b) = (&a[..n], &b[..n]);
            for k in 0..n {
                out[k] = c[0] * a[k] + c[1] * b[k];
            }
        }
        _ => {
            let (a, b, d) = (&a[..n], &b[..n], &d[..n]);
            for k in 0..n {
                out[k] = c[0] * a[k] + c[1] * b[k] + c[2] * d[k];
            }
        }
    }
    for (&coefficient, input) in c[..terms].iter().zip(&x[..terms]).skip(3) {
        let input = &input[..n];
        for k in 0..n {
            out[k] += coefficient * input[k];
        }
    }
}

/// Column `j` of a matrix of `R` columns.
fn column<const N: usize, const R: usize>(matrix: &[[f32; R]; N], j: usize) -> [f32; N] {
    std::array::from_fn(|i| matrix[i][j])
}

impl<const N: usize, const R: usize> Transforms for Minimal<N, R> {
    const KERNEL: usize = R;
    const ELEMENTS: usize = N * N;

    /// [`KERNEL_CHUNK`] kernels at a time, vectorized over them.
    #[inline(always)]
    fn kernel_transform(&self, weight: &[f32], order: KernelOrder, u: &mut [f32]) {
        const C: usize = KERNEL_CHUNK;
        let kernels = order.count;
        let mut planes = vec![0.0f32; R * R * C];
        let mut mid = vec![0.0f32; N * R * C];
        for first in (0..kernels).step_by(C) {
            let n = C.min(kernels - first);
            order.gather(weight, R * R, (first, n), &mut planes);
            // G g: each kernel column `x` through G, into `mid[j][x]`.
            for x in 0..R {
                let inputs: [&[f32]; R] = std::array::from_fn(|y| &planes[(y * R + x) * C..][..n]);
                for (j, row) in self.kernel.iter().enumerate() {
                    combine(&mut mid[(j * R + x) * C..][..n], row, &inputs);
                }
            }
            // (G g) Gᵀ: each row `j` of `mid` through G.
            for j in 0..N {
                let inputs: [&[f32]; R] = std::array::from_fn(|x| &mid[(j * R + x) * C..][..n]);
                for (jj, row) in self.kernel.iter().enumerate() {
                    combine(&mut u[(j * N + jj) * kernels + first..][..n], row, &inputs);
                }
            }
        }
    }

    /// The adjoint of [`Transforms::kernel_transform`]: `Gᵀ d G` for each
    /// kernel's `N²`-element gradient in `du` (`[N², kernels]`), written to
    /// `d_weight` (`[kernels, R, R]`).
    #[inline(always)]
    fn kernel_gradient(&self, du: &[f32], kernels: usize, d_weight: &mut [f32]) {
        const C: usize = KERNEL_CHUNK;
        let mut mid = vec![0.0f32; R * N * C];
        let mut out = vec![0.0f32; R * R * C];
        let columns: [[f32; N]; R] = std::array::from_fn(|k| column(&self.kernel, k));
        for first in (0..kernels).step_by(C) {
            let n = C.min(kernels - first);
            // Gᵀ d: each element column `jj` through Gᵀ, into `mid[y][jj]`.
            for jj in 0..N {
                let inputs: [&[f32]; N] =
                    std::array::from_fn(|j| &du[(j * N + jj) * kernels + first..][..n]);
                for (y, coefficients) in columns.iter().enumerate() {
                    combine(&mut mid[(y * N + jj) * C..][..n], coefficients, &inputs);
                }
            }
            // (Gᵀ d) G: each row `y` of `mid` through Gᵀ.
            for y in 0..R {
                let inputs: [&[f32]; N] = std::array::from_fn(|jj| &mid[(y * N + jj) * C..][..n]);
                for (x, coefficients) in columns.iter().enumerate() {
                    combine(&mut out[(y * R + x) * C..][..n], coefficients, &inputs);
                }
            }
            for k in 0..n {
                for s in 0..R * R {
                    d_weight[(first + k) * R * R + s] = out[s * C + k];
                }
            }
        }
    }

    /// The `N × N` patches around every tile of a position-major group
    /// (`laid`: `[H, W, p]`, `p` values a position), moved into the
    /// transformed space (`Bᵀ d B`), as `[N², tiles, p]`.
    #[inline(always)]
    fn input_transform(&self, laid: &[f32], p: usize, tiles: &Tiles, v: &mut [f32]) {
        let zeros = vec![0.0f32; p];
        let mut rows = vec![0.0f32; N * N * p];
        let stride = tiles.count() * p;
        let (h, w, pad) = (tiles.height, tiles.width, R / 2);
        for ty in 0..tiles.rows {
            for tx in 0..tiles.cols {
                let at = |r: usize, s: usize| {
                    let y = (TILE_SIDE * ty + r).wrapping_sub(pad);
                    let x = (TILE_SIDE * tx + s).wrapping_sub(pad);
                    if y < h && x < w {
                        &laid[(y * w + x) * p..][..p]
                    } else {
                        &zeros[..]
                    }
                };
                // Bᵀ d: each patch column `s` through Bᵀ, into `rows[i][s]`.
                for s in 0..N {
                    let inputs: [&[f32]; N] = std::array::from_fn(|r| at(r, s));
                    for (i, coefficients) in self.input.iter().enumerate() {
                        combine(&mut rows[(i * N + s) * p..][..p], coefficients, &inputs);
                    }
                }
                // (Bᵀ d) B: each row `i` through Bᵀ.
                let tile = (ty * tiles.cols + tx) * p;
                for i in 0..N {
                    let inputs: [&[f32]; N] =
                        std::array::from_fn(|s| &rows[(i * N + s) * p..][..p]);
                    for (j, coefficients) in self.input.iter().enumerate() {
                        combine(
                            &mut v[(i * N + j) * stride + tile..][..p],
                            coefficients,
                            &inputs,
                        );
                    }
                }
            }
        }
    }

    /// The products `m` (`[N², tiles, p]`) moved back (`Aᵀ m A`) into a
    /// position-major group (`[H, W, p]`).
    #[inline(always)]
    fn output_transform(&self, m: &[f32], p: usize, tiles: &Tiles, laid: &mut [f32]) {
        let mut rows = vec![0.0f32; TILE_SIDE * N * p];
        let stride = tiles.count() * p;
        let (h, w) = (tiles.height, tiles.width);
        for ty in 0..tiles.rows {
            for tx in 0..tiles.cols {
                let tile = (ty * tiles.cols + tx) * p;
                // Aᵀ m: each element column `x` through Aᵀ, into `rows[i][x]`.
                for x in 0..N {
                    let inputs: [&[f32]; N] =
                        std::array::from_fn(|j| &m[(j * N + x) * stride + tile..][..p]);
                    for (i, coefficients) in self.output.iter().enumerate() {
                        combine(&mut rows[(i * N + x) * p..][..p], coefficients, &inputs);
                    }
                }
                // (Aᵀ m) A: each row `i` through Aᵀ, the outputs in the map.
                for i in 0..TILE_SIDE {
                    let y = TILE_SIDE * ty + i;
                    if y >= h {
                        break;
                    }
                    let inputs: [&[f32]; N] =
                        std::array::from_fn(|x| &rows[(i * N + x) * p..][..p]);
                    for (ii, coefficients) in self.output.iter().enumerate() {
                        let x = TILE_SIDE * tx + ii;
                        if x < w {
                            combine(&mut laid[(y * w + x) * p..][..p], coefficients, &inputs);
                        }
                    }
                }
            }
        }
    }

    /// The output gradient of every tile of a position-major group (`[H, W,
    /// p]`) moved into the transformed space, the adjoint of
    /// [`Transforms::output_transform`] (`A dY Aᵀ`), as `[N², tiles, p]`.
    #[inline(always)]
    fn output_gradient_transform(&self, laid: &[f32], p: usize, tiles: &Tiles, dm: &mut [f32]) {
        let zeros = vec![0.0f32; p];
        let mut rows = vec![0.0f32; N * TILE_SIDE * p];
        let columns: [[f32; TILE_SIDE]; N] = std::array::from_fn(|j| column(&self.output, j));
        let stride = tiles.count() * p;
        let (h, w) = (tiles.height, tiles.width);
        for ty in 0..tiles.rows {
            for tx in 0..tiles.cols {
                let at = |i: usize, ii: usize| {
                    let (y, x) = (TILE_SIDE * ty + i, TILE_SIDE * tx + ii);
                    if y < h && x < w {
                        &laid[(y * w + x) * p..][..p]
                    } else {
                        &zeros[..]
                    }
                };
                // A dY: each output column `ii` through A, into `rows[j][ii]`.
                for ii in 0..TILE_SIDE {
                    let inputs: [&[f32]; TILE_SIDE] = std::array::from_fn(|i| at(i, ii));
                    for (j, coefficients) in columns.iter().enumerate() {
                        combine(
                            &mut rows[(j * TILE_SIDE + ii) * p..][..p],
                            coefficients,
                            &inputs,
                        );
                    }
                }
                // (A dY) Aᵀ: each row `j` through A.
                let tile = (ty * tiles.cols + tx) * p;
                for j in 0..N {
                    let inputs: [&[f32]; TILE_SIDE] =
                        std::array::from_fn(|ii| &rows[(j * TILE_SIDE + ii) * p..][..p]);
                    for (x, coefficients) in columns.iter().enumerate() {
                        combine(
                            &mut dm[(j * N + x) * stride + tile..][..p],
                            coefficients,
                            &inputs,
                        );
                    }
                }
            }
        }
    }
}
