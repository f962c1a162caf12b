//! Helpers shared by the allocator tests, each a process of its own.

/// Minor page faults so far of `who`: `libc::RUSAGE_SELF` (the process) or
/// `libc::RUSAGE_THREAD` (the calling thread).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn minor_faults(who: libc::c_int) -> i64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the zeroed space given.
    let usage = unsafe {
        assert_eq!(libc::getrusage(who, usage.as_mut_ptr()), 0);
        usage.assume_init()
    };
    usage.ru_minflt
}
