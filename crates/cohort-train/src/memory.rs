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
        RETAINING.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether [`retain_freed_memory`] set malloc's thresholds in this process.
static RETAINING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`retain_freed_memory`] set malloc's thresholds in this process
/// (where [`share_one_arena_for`] can do anything): a caller asks before it
/// builds a model only to learn its largest tensor.
pub fn retains_freed_memory() -> bool {
    RETAINING.load(std::sync::atomic::Ordering::Relaxed)
}

/// A model with a tensor at least this large trains in threads that share
/// glibc's main arena ([`share_one_arena_for`]): a quarter of the 64 MiB a
/// thread's own arena grows its heaps to.
pub const SHARED_ARENA_TENSOR_BYTES: usize = 16 << 20;

/// Has the threads started from now on allocate from glibc's main arena,
/// where a model's largest tensor is at least [`SHARED_ARENA_TENSOR_BYTES`];
/// returns whether it did. Only in a process whose thresholds
/// [`retain_freed_memory`] set (the `cohort` program, the benches), before
/// the threads that train start.
///
/// Why: another thread's arena grows in heaps of at most 64 MiB, and glibc
/// unmaps such a heap as soon as it is empty, whatever the trim threshold.
/// A step that allocates and frees tensors of tens of MiB (cnn_femnist's
/// dense layer, 25.7 MB) then maps a heap and faults its pages in again
/// every time: 478,000 page faults in the zoo bench's cnn_femnist, a third
/// of its time (docs/BENCHMARKS.md). The main arena keeps freed memory
/// below the trim threshold. Smaller models keep an arena per thread: many
/// threads allocating small blocks at once wait on one arena's lock (the
/// 100,000-client LeNet-5 job was 15–18 % slower with one).
pub fn share_one_arena_for(largest_tensor_bytes: usize) -> bool {
    if largest_tensor_bytes < SHARED_ARENA_TENSOR_BYTES || !retains_freed_memory() {
        return false;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes how many arenas malloc may create.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    true
}
