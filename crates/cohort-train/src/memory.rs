//! How the process's allocator treats memory a training step frees.
//!
//! A step allocates and frees buffers of up to a few MiB (activations,
//! column matrices, gradients). glibc's malloc hands freed memory at the top
//! of its heap back to the kernel and serves large blocks by `mmap`, so the
//! next step faults the same pages in again: about a thousand page faults a
//! batch for `multilayer`, which halved its training rate (docs/BENCHMARKS.md,
//! "Zoo training speed"). [`retain_freed_memory`] keeps freed memory in the
//! process instead; the peak is unchanged, only not returned between steps.

/// Has glibc keep freed memory for reuse: no trimming of the heap below
/// 1 GiB of free space, and blocks under 32 MiB from the heap rather than
/// `mmap`. For a program's `main`, before its threads start. Leaves the
/// settings alone where `GLIBC_TUNABLES` already sets malloc's (the user's
/// choice) and on other C libraries, where it does nothing.
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let user_set = std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc."));
        if user_set {
            return;
        }
        const TRIM_THRESHOLD: libc::c_int = 1 << 30;
        const MMAP_THRESHOLD: libc::c_int = 32 << 20;
        // SAFETY: mallopt only changes malloc's thresholds; it is called with
        // glibc's documented parameters and in-range values.
        unsafe {
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        }
    }
}
