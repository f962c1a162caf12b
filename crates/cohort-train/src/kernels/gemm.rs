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
/// In tiles, each output row of a tile written whole: with a power-of-two
/// side the plain loop's strided writes missed the cache on every element
/// (6 ns an element against 0.3–0.5 ns; a fifth of `multilayer`'s step when
/// linear weights were transposed that way). Where the CPU has AVX2, the
/// tiles are moved as 8 × 8 blocks in registers ([`transpose_avx2`]); the
/// rows and columns past the last whole block, and every tile elsewhere,
/// element by element ([`transpose_tile`]).
pub(crate) fn transpose_into(values: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    assert_eq!(
        values.len(),
        rows * cols,
        "values of a {rows}×{cols} matrix"
    );
    assert_eq!(out.len(), values.len(), "room for the transpose");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU was just found to have AVX2.
        unsafe { transpose_avx2(values, rows, cols, out) };
        return;
    }
    transpose_tile(values, (rows, cols), (0..rows, 0..cols), out);
}

/// The rows `rs` and columns `cs` of [`transpose_into`]'s matrix, in 16 × 16
/// tiles of single moves.
#[inline(always)]
fn transpose_tile(
    values: &[f32],
    (rows, cols): (usize, usize),
    (rs, cs): (std::ops::Range<usize>, std::ops::Range<usize>),
    out: &mut [f32],
) {
    const TILE: usize = 16;
    for r0 in rs.clone().step_by(TILE) {
        let r1 = (r0 + TILE).min(rs.end);
        for c0 in cs.clone().step_by(TILE) {
            for c in c0..(c0 + TILE).min(cs.end) {
                let line = &mut out[c * rows + r0..c * rows + r1];
                for (i, v) in line.iter_mut().enumerate() {
                    *v = values[(r0 + i) * cols + c];
                }
            }
        }
    }
}

/// [`transpose_into`] with the whole 8 × 8 blocks moved in registers: eight
/// rows loaded, interleaved in three rounds of unpacks, shuffles and lane
/// permutes, stored as eight columns. A client transposes every linear
/// weight when it loads the global model and again when it hands in its
/// update: for cnn_femnist's 3,136 × 2,048 layer, the transposes' share of
/// the zoo bench's profile fell from 5.4 % to 3.5 % (docs/BENCHMARKS.md,
/// "Transposes in registers"). Blocks go
/// 32 × 32 tiles at a time, so the rows read and written stay in cache.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn transpose_avx2(values: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    const TILE: usize = 32;
    let (whole_rows, whole_cols) = (rows / 8 * 8, cols / 8 * 8);
    assert!(values.len() >= rows * cols && out.len() >= rows * cols);
    for r0 in (0..whole_rows).step_by(TILE) {
        for c0 in (0..whole_cols).step_by(TILE) {
            for r in (r0..(r0 + TILE).min(whole_rows)).step_by(8) {
                for c in (c0..(c0 + TILE).min(whole_cols)).step_by(8) {
                    // SAFETY: rows `r..r + 8` and columns `c..c + 8` lie in
                    // the matrix (`r + 8 <= whole_rows`, `c + 8 <= whole_cols`),
                    // whose `rows · cols` values both slices hold (checked above).
                    unsafe {
                        block_8x8(
                            values.as_ptr().add(r * cols + c),
                            cols,
                            out.as_mut_ptr().add(c * rows + r),
                            rows,
                        );
                    }
                }
            }
        }
    }
    transpose_tile(values, (rows, cols), (0..rows, whole_cols..cols), out);
    transpose_tile(values, (rows, cols), (whole_rows..rows, 0..whole_cols), out);
}

/// The 8 × 8 block at `src` (rows `src_stride` floats apart) written
/// transposed at `dst` (rows `dst_stride` apart).
///
/// # Safety
/// Eight rows of eight floats must be readable at `src` and writable at
/// `dst` with those strides, and the CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_8x8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's promise: eight readable rows of eight.
    let row: [__m256; 8] =
        std::array::from_fn(|i| unsafe { _mm256_loadu_ps(src.add(i * src_stride)) });
    // Pairs of rows interleaved, then pairs of pairs: each 128-bit lane then
    // holds four values of one column, from rows 0–3 or 4–7.
    let pairs = [
        _mm256_unpacklo_ps(row[0], row[1]),
        _mm256_unpackhi_ps(row[0], row[1]),
        _mm256_unpacklo_ps(row[2], row[3]),
        _mm256_unpackhi_ps(row[2], row[3]),
        _mm256_unpacklo_ps(row[4], row[5]),
        _mm256_unpackhi_ps(row[4], row[5]),
        _mm256_unpacklo_ps(row[6], row[7]),
        _mm256_unpackhi_ps(row[6], row[7]),
    ];
    let quads = [
        _mm256_shuffle_ps::<0x44>(pairs[0], pairs[2]),
        _mm256_shuffle_ps::<0xEE>(pairs[0], pairs[2]),
        _mm256_shuffle_ps::<0x44>(pairs[1], pairs[3]),
        _mm256_shuffle_ps::<0xEE>(pairs[1], pairs[3]),
        _mm256_shuffle_ps::<0x44>(pairs[4], pairs[6]),
        _mm256_shuffle_ps::<0xEE>(pairs[4], pairs[6]),
        _mm256_shuffle_ps::<0x44>(pairs[5], pairs[7]),
        _mm256_shuffle_ps::<0xEE>(pairs[5], pairs[7]),
    ];
    let column = [
        _mm256_permute2f128_ps::<0x20>(quads[0], quads[4]),
        _mm256_permute2f128_ps::<0x20>(quads[1], quads[5]),
        _mm256_permute2f128_ps::<0x20>(quads[2], quads[6]),
        _mm256_permute2f128_ps::<0x20>(quads[3], quads[7]),
        _mm256_permute2f128_ps::<0x31>(quads[0], quads[4]),
        _mm256_permute2f128_ps::<0x31>(quads[1], quads[5]),
        _mm256_permute2f128_ps::<0x31>(quads[2], quads[6]),
        _mm256_permute2f128_ps::<0x31>(quads[3], quads[7]),
    ];
    for (i, values) in column.into_iter().enumerate() {
        // SAFETY: the caller's promise: eight writable rows of eight.
        unsafe { _mm256_storeu_ps(dst.add(i * dst_stride), values) };
    }
}

/// [`transpose_into`] a new buffer.
pub(crate) fn transposed(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    transpose_into(values, rows, cols, &mut out);
    out
}

/// `lhs · rhs` (`[m, k] · [k, n]`) in a new buffer laid out by
/// `dst_strides`, which must place the `m · n` values on `0..m · n` (row-
/// or column-major): written once by the product, never zeroed first (a
/// linear layer's weight gradient is 25.7 MB in cnn_femnist, and zeroing
/// it took 2.4–2.8 % of that model's profile samples).
///
/// # Panics
/// As [`matmul`], and when `dst_strides` leaves a gap or runs past `m · n`.
pub(crate) fn product(
    (m, n, k): (usize, usize, usize),
    dst_strides: Strides,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
) -> Vec<f32> {
    let len = m * n;
    let dense = (dst_strides.cols == 1 && dst_strides.rows == n)
        || (dst_strides.rows == 1 && dst_strides.cols == m);
    assert!(len == 0 || dense, "dst must be row- or column-major");
    let mut dst = Vec::with_capacity(len);
    // SAFETY: `matmul_raw` with `accumulate` off writes every one of the
    // `m · n` places once (`dense`: exactly `0..len`, within the capacity)
    // and reads none before writing it: gemm-common 0.19 sets its `alpha`
    // to zero when told not to read the destination, and every path (its
    // micro-kernels, gemv, gevv, `k = 0`) then stores without loading;
    // `product_overwrites_whatever_the_buffer_held` holds it to that with
    // NaN in the buffer, on shapes of each path. After it the first `len`
    // values are initialized.
    unsafe {
        matmul_raw(
            (m, n, k),
            dst.as_mut_ptr(),
            len,
            dst_strides,
            false,
            lhs,
            rhs,
        );
        dst.set_len(len);
    }
    dst
}

/// `dst = lhs · rhs` (`[m, k] · [k, n]`), or `dst += lhs · rhs` with `accumulate`.
///
/// # Panics
/// When a matrix does not fit in its slice, or `dst`'s layout maps two
/// elements to one place (which would make the product depend on write order).
pub(crate) fn matmul(
    shape: (usize, usize, usize),
    dst: &mut [f32],
    dst_strides: Strides,
    accumulate: bool,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
) {
    // SAFETY: `dst` is an initialized slice of `dst.len()` values.
    unsafe {
        matmul_raw(
            shape,
            dst.as_mut_ptr(),
            dst.len(),
            dst_strides,
            accumulate,
            lhs,
            rhs,
        )
    }
}

/// [`matmul`] into the `dst_len` places from `dst`.
///
/// # Safety
/// `dst` must be valid for writes of `dst_len` values, not alias `lhs` or
/// `rhs`, and, with `accumulate`, hold initialized values where the
/// product lands.
unsafe fn matmul_raw(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_len: usize,
    dst_strides: Strides,
    accumulate: bool,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(dst_strides.extent(m, n) <= dst_len, "dst out of bounds");
    assert!(
        (dst_strides.rows >= n * dst_strides.cols && dst_strides.cols >= 1)
            || (dst_strides.cols >= m * dst_strides.rows && dst_strides.rows >= 1),
        "dst elements overlap"
    );
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    // SAFETY: within `dst_len` by the extent checked above.
                    unsafe {
                        dst.add(r * dst_strides.rows + c * dst_strides.cols)
                            .write(0.0)
                    };
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
    // elements are distinct, and the caller's promise keeps `dst` valid and
    // unaliased.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
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

    /// [`product`] writes into memory it never initialized, which is sound
    /// only while gemm, told not to read the destination, stores without
    /// loading on every path. NaN in the destination would survive any
    /// load (`0 · NaN` is NaN), so each shape here, one per path of gemm's
    /// (a row, a column, a dot product, `k = 0`, the micro-kernels with one
    /// and several depth blocks, both destination layouts), must come out
    /// as the naive sum.
    #[test]
    fn product_overwrites_whatever_the_buffer_held() {
        for (m, n, k) in [
            (1, 9, 7),
            (9, 1, 7),
            (1, 1, 7),
            (6, 5, 0),
            (37, 29, 13),
            (64, 48, 700),
            (3, 70, 300),
        ] {
            let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
            let (a, b) = (MatRef::row_major(&a, k), MatRef::row_major(&b, n));
            let expected = naive(m, n, k, a, b);
            let close = |x: f32, y: f32| (x - y).abs() <= 1e-4 * (1.0 + y.abs());
            for column_major in [false, true] {
                let strides = match column_major {
                    false => Strides::row_major(n),
                    true => Strides::row_major(m).t(),
                };
                let at = |i: usize, j: usize| i * strides.rows + j * strides.cols;
                let mut poisoned = vec![f32::NAN; m * n];
                matmul((m, n, k), &mut poisoned, strides, false, a, b);
                let fresh = product((m, n, k), strides, a, b);
                for (i, j) in (0..m).flat_map(|i| (0..n).map(move |j| (i, j))) {
                    let want = expected[i * n + j];
                    let what = format!("{m}x{n}x{k}, column-major {column_major}, at {i},{j}");
                    assert!(close(poisoned[at(i, j)], want), "over NaN: {what}");
                    assert!(close(fresh[at(i, j)], want), "new buffer: {what}");
                }
            }
        }
    }

    #[test]
    fn tiled_transposes_move_every_element_of_ragged_shapes() {
        for (rows, cols) in [
            (1, 1),
            (1, 70),
            (70, 1),
            (33, 70),
            (64, 32),
            (100, 37),
            (8, 8),
            (7, 9),
            (40, 17),
            (200, 64),
        ] {
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
            let mut single_moves = vec![0.0; values.len()];
            transpose_tile(&values, (rows, cols), (0..rows, 0..cols), &mut single_moves);
            assert_eq!(single_moves, out, "{rows}x{cols} without AVX2");
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
