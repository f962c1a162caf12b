//! The one matrix product the native kernels use: the `gemm` crate (the one
//! burn flex itself links), behind a safe, bounds-checked signature.
//!
//! `gemm` picks its micro-kernel (AVX2/FMA, AVX-512 …) at run time and, with
//! `Parallelism::None`, sums every output in an order fixed by the shapes and
//! the machine alone, so the same call on the same machine gives the same bits.

/// How a matrix lies in its slice: element `(row, col)` is at
/// `row * rows + col * cols`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Strides {
    pub rows: usize,
    pub cols: usize,
}

impl Strides {
    /// A row-major matrix with `cols` columns.
    pub(crate) const fn row_major(cols: usize) -> Self {
        Self {
            rows: cols,
            cols: 1,
        }
    }

    /// The same storage read as its transpose.
    pub(crate) const fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
        }
    }

    /// One past the largest offset of a `rows × cols` matrix (both non-zero).
    fn extent(self, rows: usize, cols: usize) -> usize {
        (rows - 1) * self.rows + (cols - 1) * self.cols + 1
    }
}

/// A matrix operand: its storage and layout.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub strides: Strides,
}

impl<'a> MatRef<'a> {
    /// `data` as a row-major matrix with `cols` columns.
    pub(crate) fn row_major(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            strides: Strides::row_major(cols),
        }
    }
}

/// A row-major `[rows, cols]` matrix written into `out` as row-major
/// `[cols, rows]`.
///
/// In 16 × 16 tiles, each output row of a tile (one cache line) written
/// whole: with a power-of-two side the plain loop's strided writes missed
/// the cache on every element (6 ns an element against 0.3–0.5 ns; a fifth
/// of `multilayer`'s step when linear weights were transposed that way).
pub(crate) fn transpose_into(values: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    const TILE: usize = 16;
    assert_eq!(
        values.len(),
        rows * cols,
        "values of a {rows}×{cols} matrix"
    );
    assert_eq!(out.len(), values.len(), "room for the transpose");
    for r0 in (0..rows).step_by(TILE) {
        let r1 = (r0 + TILE).min(rows);
        for c0 in (0..cols).step_by(TILE) {
            for c in c0..(c0 + TILE).min(cols) {
                let line = &mut out[c * rows + r0..c * rows + r1];
                for (i, v) in line.iter_mut().enumerate() {
                    *v = values[(r0 + i) * cols + c];
                }
            }
        }
    }
}

/// [`transpose_into`] a new buffer.
pub(crate) fn transposed(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    transpose_into(values, rows, cols, &mut out);
    out
}

/// `dst = lhs · rhs` (`[m, k] · [k, n]`), or `dst += lhs · rhs` with `accumulate`.
///
/// # Panics
/// When a matrix does not fit in its slice, or `dst`'s layout maps two
/// elements to one place (which would make the product depend on write order).
pub(crate) fn matmul(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_strides: Strides,
    accumulate: bool,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst_strides.extent(m, n) <= dst.len(), "dst out of bounds");
    assert!(
        (dst_strides.rows >= n * dst_strides.cols && dst_strides.cols >= 1)
            || (dst_strides.cols >= m * dst_strides.rows && dst_strides.rows >= 1),
        "dst elements overlap"
    );
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    dst[r * dst_strides.rows + c * dst_strides.cols] = 0.0;
                }
            }
        }
        return;
    }
    assert!(
        lhs.strides.extent(m, k) <= lhs.data.len(),
        "lhs out of bounds"
    );
    assert!(
        rhs.strides.extent(k, n) <= rhs.data.len(),
        "rhs out of bounds"
    );
    let s = |x: usize| x as isize;
    // SAFETY: the asserts above keep every element gemm reads or writes inside
    // its slice (non-negative strides, extents checked), the destination's
    // elements are distinct, and `&mut dst` cannot alias `lhs`/`rhs`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            s(dst_strides.cols),
            s(dst_strides.rows),
            accumulate,
            lhs.data.as_ptr(),
            s(lhs.strides.cols),
            s(lhs.strides.rows),
            rhs.data.as_ptr(),
            s(rhs.strides.cols),
            s(rhs.strides.rows),
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(m: usize, n: usize, k: usize, a: MatRef<'_>, b: MatRef<'_>) -> Vec<f32> {
        let mut out = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut sum = 0.0f64;
                for p in 0..k {
                    sum += a.data[i * a.strides.rows + p * a.strides.cols] as f64
                        * b.data[p * b.strides.rows + j * b.strides.cols] as f64;
                }
                out[i * n + j] = sum as f32;
            }
        }
        out
    }

    #[test]
    fn strided_products_match_a_naive_sum() {
        let (m, n, k) = (7, 5, 9);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        for (sa, sb) in [
            (Strides::row_major(k), Strides::row_major(n)),
            (Strides::row_major(m).t(), Strides::row_major(k).t()),
        ] {
            let (a, b) = (
                MatRef {
                    data: &a,
                    strides: sa,
                },
                MatRef {
                    data: &b,
                    strides: sb,
                },
            );
            let expected = naive(m, n, k, a, b);
            let mut dst = vec![1.0f32; m * n];
            matmul((m, n, k), &mut dst, Strides::row_major(n), false, a, b);
            for (x, y) in dst.iter().zip(&expected) {
                assert!((x - y).abs() <= 1e-5, "{x} vs {y}");
            }
            let mut acc = vec![1.0f32; m * n];
            matmul((m, n, k), &mut acc, Strides::row_major(n), true, a, b);
            for (x, y) in acc.iter().zip(&expected) {
                assert!((x - y - 1.0).abs() <= 1e-5, "{x} vs {y} + 1");
            }
        }
    }

    #[test]
    fn tiled_transpose_moves_every_element_of_ragged_shapes() {
        for (rows, cols) in [(1, 1), (1, 70), (70, 1), (33, 70), (64, 32), (100, 37)] {
            let values: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
            let out = transposed(&values, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        out[c * rows + r],
                        values[r * cols + c],
                        "{rows}x{cols} at {r},{c}"
                    );
                }
            }
            assert_eq!(transposed(&out, cols, rows), values, "{rows}x{cols} back");
        }
    }

    #[test]
    #[should_panic(expected = "lhs out of bounds")]
    fn a_short_operand_is_refused() {
        let a = [0.0f32; 5];
        let b = [0.0f32; 4];
        let mut dst = [0.0f32; 4];
        let sa = MatRef {
            data: &a,
            strides: Strides::row_major(3),
        };
        let sb = MatRef {
            data: &b,
            strides: Strides::row_major(2),
        };
        matmul((2, 2, 3), &mut dst, Strides::row_major(2), false, sa, sb);
    }
}
