//! Compiling the kernels' element-wise loops for the CPU they run on.
//!
//! A release build targets baseline x86-64 (SSE2), so plain loops vectorize
//! four lanes wide. [`dispatch`] runs its closure inside a function compiled
//! for AVX2 where the CPU has it; with the kernels `#[inline(always)]`, their
//! loops are vectorized eight lanes wide there. The loops add, compare and
//! copy, never multiply-add, so both builds give the same bits.

/// `f()`, compiled for AVX2 when the CPU has AVX2. Pass the closure as
/// `#[inline(always)] || …`: a closure left to the inliner's judgment stays a
/// function of its own, compiled for baseline x86-64.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: `avx2` is compiled for AVX2, which the CPU was just found to have.
        return unsafe { avx2(f) };
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}
