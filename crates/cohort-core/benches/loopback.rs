//! Plain TCP loopback throughput: the ceiling any transport on this machine
//! can reach, measured in the same session as a network-mode run so that its
//! bytes per second can be read against it (docs/BENCHMARKS.md).
//!
//! `cargo bench -p cohort-core --bench loopback` — sends 1 GiB through one
//! 127.0.0.1 connection in 1 MiB writes, three times, and prints GB/s. It lives
//! here, beside no tensor library, so that it builds in seconds.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

const TOTAL: usize = 1 << 30;
const WRITE: usize = 1 << 20;

fn once() -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("loopback listener");
    let address = listener.local_addr().expect("bound address");
    let reader = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let mut buffer = vec![0u8; WRITE];
        let mut received = 0usize;
        while received < TOTAL {
            let n = stream.read(&mut buffer).expect("read");
            assert!(n > 0, "sender closed early");
            received += n;
        }
        received
    });
    let mut stream = TcpStream::connect(address).expect("connect");
    stream.set_nodelay(true).ok();
    let block = vec![7u8; WRITE];
    let started = Instant::now();
    for _ in 0..TOTAL / WRITE {
        stream.write_all(&block).expect("write");
    }
    let received = reader.join().expect("reader thread");
    let seconds = started.elapsed().as_secs_f64();
    received as f64 / seconds / 1e9
}

fn main() {
    let runs: Vec<f64> = (0..3).map(|_| once()).collect();
    let best = runs.iter().copied().fold(0.0, f64::max);
    println!(
        "loopback TCP, 1 GiB in 1 MiB writes: {} GB/s (best {best:.2} GB/s)",
        runs.iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
}
