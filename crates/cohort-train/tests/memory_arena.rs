//! `share_one_arena_for`, in a process of its own and on its main thread (a
//! test harness would start threads, and which arena a new thread takes
//! depends on the threads before it): a thread that allocates and frees a
//! tensor of tens of MiB beside two it keeps faults the freed one's pages in
//! again every time from an arena of its own, whose emptied heaps glibc
//! unmaps, and once from the main arena it shares after the call.

mod support;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod arenas {
    use std::sync::mpsc;

    use cohort_train::memory::{
        SHARED_ARENA_TENSOR_BYTES, retain_freed_memory, share_one_arena_for,
    };

    const TENSOR: usize = 24 << 20;
    const ROUNDS: usize = 20;
    const PAGES: i64 = (TENSOR / 4096) as i64;

    /// Minor page faults of the calling thread so far.
    fn thread_faults() -> i64 {
        crate::support::minor_faults(libc::RUSAGE_THREAD)
    }

    fn touched(bytes: usize, mark: u8) -> Vec<u8> {
        let mut buffer = vec![0u8; bytes];
        for page in buffer.chunks_mut(4096) {
            page[0] = mark;
        }
        buffer
    }

    /// A thread that keeps two tensors, then `ROUNDS` times writes and
    /// frees a third (as a step does its gradient), and sends the faults of
    /// those rounds; it stays (its arena stays taken) until `release` is
    /// dropped.
    fn training_thread(release: mpsc::Receiver<()>) -> (i64, std::thread::JoinHandle<()>) {
        let (faults, received) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let kept = [touched(TENSOR, 1), touched(TENSOR, 2)];
            drop(touched(TENSOR, 3));
            let before = thread_faults();
            for round in 0..ROUNDS {
                std::hint::black_box(touched(TENSOR, round as u8));
            }
            faults
                .send(thread_faults() - before)
                .expect("the main thread waits");
            let _ = release.recv();
            std::hint::black_box(&kept);
        });
        (received.recv().expect("the thread's faults"), thread)
    }

    pub fn run() {
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc.")) {
            panic!("GLIBC_TUNABLES sets malloc's settings: unset it to run this test");
        }
        assert!(
            !share_one_arena_for(TENSOR),
            "shared without retain_freed_memory"
        );
        retain_freed_memory();
        let (hold_own, release_own) = mpsc::channel::<()>();
        let (own, own_thread) = training_thread(release_own);
        assert!(
            own >= PAGES * ROUNDS as i64 / 2,
            "{own} faults in a thread's own arena over {ROUNDS} rounds of {PAGES} pages: \
             its emptied heap was kept"
        );
        assert!(!share_one_arena_for(SHARED_ARENA_TENSOR_BYTES - 1));
        assert!(share_one_arena_for(TENSOR));
        let (hold_shared, release_shared) = mpsc::channel::<()>();
        let (shared, shared_thread) = training_thread(release_shared);
        assert!(
            shared <= 2 * PAGES,
            "{shared} faults over {ROUNDS} rounds of {PAGES} pages from the shared arena"
        );
        drop((hold_own, hold_shared));
        own_thread.join().expect("the first thread");
        shared_thread.join().expect("the second thread");
        println!(
            "test large_tensors_are_reused_from_one_arena ... ok ({own} faults alone, {shared} shared)"
        );
    }
}

fn main() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    arenas::run();
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    println!("test large_tensors_are_reused_from_one_arena ... ignored (glibc only)");
}
