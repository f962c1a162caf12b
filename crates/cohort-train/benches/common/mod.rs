//! What the matrix-product benches share: one gemm call on strided
//! operands, and a timer.

use std::time::Instant;

/// `dst = lhs · rhs` (or `dst += lhs · rhs` where `accumulate`) through
/// gemm on one thread, strides `(row, column)` per operand.
pub fn product(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    dst_strides: (usize, usize),
    accumulate: bool,
    lhs: (&[f32], (usize, usize)),
    rhs: (&[f32], (usize, usize)),
) {
    let extent =
        |(rows, cols): (usize, usize), r: usize, c: usize| (r - 1) * rows + (c - 1) * cols + 1;
    assert!(extent(dst_strides, m, n) <= dst.len());
    assert!(extent(lhs.1, m, k) <= lhs.0.len() && extent(rhs.1, k, n) <= rhs.0.len());
    let s = |x: usize| x as isize;
    // SAFETY: every operand's extent was checked against its slice above and
    // the callers' `dst` strides map distinct elements to distinct places.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            s(dst_strides.1),
            s(dst_strides.0),
            accumulate,
            lhs.0.as_ptr(),
            s(lhs.1.1),
            s(lhs.1.0),
            rhs.0.as_ptr(),
            s(rhs.1.1),
            s(rhs.1.0),
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Seconds one call of `f` takes: the best of 5 rounds of `calls` calls.
pub fn seconds(calls: u32, mut f: impl FnMut()) -> f64 {
    (0..5)
        .map(|_| {
            let started = Instant::now();
            for _ in 0..calls {
                f();
            }
            started.elapsed().as_secs_f64() / f64::from(calls)
        })
        .fold(f64::INFINITY, f64::min)
}
