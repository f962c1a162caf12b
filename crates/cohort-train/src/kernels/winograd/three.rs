//! F(2 × 2, 3 × 3), Toom-Cook at 0, 1, −1 and infinity, its transforms
//! written out: every coefficient is 0, ±1 or ±½, so each transform is
//! additions and subtractions over whole vectors (the matrix-driven
//! [`super::minimal`] multiplies by each coefficient, and ran resnet_20's
//! 16-channel layer's three passes 40 % slower through it).

use super::{KERNEL_CHUNK, KernelOrder, TILE_SIDE, Tiles, Transforms};

/// F(2 × 2, 3 × 3).
pub(super) struct Three;

impl Transforms for Three {
    const KERNEL: usize = 3;
    const ELEMENTS: usize = 16;

    #[inline(always)]
    fn kernel_transform(&self, weight: &[f32], order: KernelOrder, u: &mut [f32]) {
        kernel_transform(weight, order, u);
    }

    #[inline(always)]
    fn kernel_gradient(&self, du: &[f32], kernels: usize, d_weight: &mut [f32]) {
        kernel_gradient(du, kernels, d_weight);
    }

    #[inline(always)]
    fn input_transform(&self, laid: &[f32], p: usize, tiles: &Tiles, v: &mut [f32]) {
        input_transform(laid, p, tiles, v);
    }

    #[inline(always)]
    fn output_transform(&self, m: &[f32], p: usize, tiles: &Tiles, laid: &mut [f32]) {
        output_transform(m, p, tiles, laid);
    }

    #[inline(always)]
    fn output_gradient_transform(&self, laid: &[f32], p: usize, tiles: &Tiles, dm: &mut [f32]) {
        output_gradient_transform(laid, p, tiles, dm);
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

/// [`Transforms::kernel_transform`] with `G = [[1, 0, 0], [½, ½, ½], [½,
/// −½, ½], [0, 0, 1]]`, vectorized over [`KERNEL_CHUNK`] kernels at a time.
#[inline(always)]
fn kernel_transform(weight: &[f32], order: KernelOrder, u: &mut [f32]) {
    const N: usize = KERNEL_CHUNK;
    let kernels = order.count;
    let mut planes = [0.0f32; 9 * N];
    let mut columns = [[[0.0f32; N]; 4]; 3];
    for first in (0..kernels).step_by(N) {
        let n = N.min(kernels - first);
        order.gather(weight, 9, (first, n), &mut planes);
        let plane =
            |s: usize| -> &[f32; N] { planes[s * N..][..N].try_into().expect("a chunk's plane") };
        // G g: the kernel's columns, each four rows.
        for (x, column) in columns.iter_mut().enumerate() {
            through_g([plane(x), plane(3 + x), plane(6 + x)], column);
        }
        for r in 0..4 {
            let mut row = [[0.0f32; N]; 4];
            through_g([&columns[0][r], &columns[1][r], &columns[2][r]], &mut row);
            for (x, values) in row.iter().enumerate() {
                u[(4 * r + x) * kernels + first..][..n].copy_from_slice(&values[..n]);
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

/// [`Transforms::kernel_gradient`]: `Gᵀ d G`.
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

/// [`Transforms::input_transform`] with `Bᵀ = [[1, 0, −1, 0], [0, 1, 1,
/// 0], [0, −1, 1, 0], [0, 1, 0, −1]]`.
#[inline(always)]
fn input_transform(laid: &[f32], p: usize, tiles: &Tiles, v: &mut [f32]) {
    let zeros = vec![0.0f32; p];
    let mut rows = vec![0.0f32; 16 * p];
    let stride = tiles.count() * p;
    for ty in 0..tiles.rows {
        for tx in 0..tiles.cols {
            let at = |r: usize, s: usize| {
                let (y, x) = ((2 * ty + r).wrapping_sub(1), (2 * tx + s).wrapping_sub(1));
                tiles.position(laid, &zeros, (y, x))
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

/// [`Transforms::output_transform`] with `Aᵀ = [[1, 1, 1, 0], [0, 1, −1,
/// −1]]`.
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

/// [`Transforms::output_gradient_transform`]: `A dY Aᵀ`.
#[inline(always)]
fn output_gradient_transform(laid: &[f32], p: usize, tiles: &Tiles, dm: &mut [f32]) {
    let zeros = vec![0.0f32; p];
    let mut rows = vec![0.0f32; 4 * 2 * p];
    let stride = tiles.count() * p;
    for ty in 0..tiles.rows {
        for tx in 0..tiles.cols {
            let at = |i: usize, j: usize| tiles.position(laid, &zeros, (2 * ty + i, 2 * tx + j));
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
