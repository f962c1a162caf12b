//! `retain_freed_memory` in a process of its own (malloc's settings are
//! process-wide): a buffer of a few MiB allocated, written and freed again
//! and again faults its pages in once, not every time.
//!
//! glibc raises its thresholds by itself after some frees, which a simple
//! loop meets at once but a training step's many sizes do not (81,000
//! faults in a few `multilayer` epochs, docs/BENCHMARKS.md); the test first
//! pins glibc's starting threshold (128 KiB) to show the faults, then calls
//! `retain_freed_memory`.

mod support;

/// Minor page faults of this process so far.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn minor_faults() -> i64 {
    support::minor_faults(libc::RUSAGE_SELF)
}

/// Faults taken by `rounds` of a `bytes`-long buffer written and freed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn faults_of_steps(rounds: usize, bytes: usize) -> i64 {
    let before = minor_faults();
    for round in 0..rounds {
        let mut buffer = vec![0u8; bytes];
        // Every page written, as a step writes its activations.
        for page in buffer.chunks_mut(4096) {
            page[0] = round as u8;
        }
        std::hint::black_box(&buffer);
    }
    minor_faults() - before
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn freed_step_buffers_are_reused_without_faulting_their_pages_again() {
    if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.")) {
        panic!("GLIBC_TUNABLES sets malloc's thresholds: unset it to run this test");
    }
    const BYTES: usize = 8 << 20;
    const ROUNDS: usize = 40;
    let pages = (BYTES / 4096) as i64;
    // glibc's starting threshold, pinned: a block this size is mapped and
    // unmapped each time.
    // SAFETY: mallopt only changes malloc's thresholds.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10) };
    let default = faults_of_steps(ROUNDS, BYTES);
    assert!(
        default >= pages * ROUNDS as i64 / 2,
        "{default} faults with glibc's starting threshold: freed blocks were not unmapped"
    );
    cohort_train::memory::retain_freed_memory();
    let retained = faults_of_steps(ROUNDS, BYTES);
    assert!(
        retained <= 2 * pages,
        "{retained} faults over {ROUNDS} rounds of {pages} pages: freed memory was returned"
    );
}
