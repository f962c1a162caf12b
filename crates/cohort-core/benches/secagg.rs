//! Compute cost of one secure-aggregation round, simulated in process.
//!
//! `cargo bench -p cohort-core --bench secagg` (add `-- --quick` for the
//! 10-client rows only), or one row:
//! `-- --row CLIENTS VALUES GRAPH DROPOUT REPEATS` with `GRAPH` `all:T`
//! (SecAgg, threshold `T`) or `K:T` (SecAgg+), as `bench/secagg.sh` runs it;
//! `-- --keystream` measures the masks' stream alone.
//!
//! Each round aggregates a LeNet-5-sized update (61,706 float32 values) from
//! 10 or 100 clients, over the complete graph (SecAgg) and a sparse SecAgg+
//! graph, with 0 %, 10 % and 30 % of the clients dropping out: half of them
//! after sharing keys (their mask keys are rebuilt and their pairwise masks
//! removed), half after sending their masked input (their inputs count, and
//! their self masks are removed through their neighbours' shares).
//!
//! "client ms" is the clients' compute summed and divided by the number of
//! clients; "server ms" is the server's compute for the round. Encoding and
//! decoding of messages is not in either. Best of `REPEATS` rounds.

use std::time::Duration;

use cohort_core::secagg::{DropPoint, NumShares, Params, simulate_round};

const LENET5: usize = 61_706;
const REPEATS: usize = 3;

fn update(len: usize, seed: u64) -> Vec<f32> {
    (0..len as u64)
        .map(|i| {
            let bits = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(0x9E37_79B9)) as u32;
            (bits as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Drops `percent` of the clients, alternating between the two drop points.
fn dropouts(ids: &[u64], percent: usize) -> Vec<(u64, DropPoint)> {
    let count = ids.len() * percent / 100;
    let step = ids.len() / count.max(1);
    (0..count)
        .map(|i| {
            let point = if i % 2 == 0 {
                DropPoint::AfterSharingKeys
            } else {
                DropPoint::AfterMaskedInput
            };
            (ids[i * step], point)
        })
        .collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn row(clients: usize, graph: &str, params: &Params, percent: usize) {
    row_of(clients, LENET5, graph, params, percent, REPEATS);
}

fn row_of(
    clients: usize,
    values: usize,
    graph: &str,
    params: &Params,
    percent: usize,
    repeats: usize,
) {
    let inputs: Vec<(u64, f64, Vec<f32>)> = (0..clients as u64)
        .map(|id| (id, 10.0 + (id % 900) as f64, update(values, id)))
        .collect();
    let borrowed: Vec<(u64, f64, &[f32])> = inputs
        .iter()
        .map(|(id, w, x)| (*id, *w, x.as_slice()))
        .collect();
    let ids: Vec<u64> = inputs.iter().map(|(id, _, _)| *id).collect();
    let drops = dropouts(&ids, percent);
    let mut best: Option<(Duration, Duration, u64, u64, usize)> = None;
    for repeat in 0..repeats {
        match simulate_round(params, &borrowed, &drops, repeat as u64) {
            Ok(round) => {
                let b = round.bytes;
                let up = b.advertise_keys.up + b.share_keys.up + b.masked_input.up + b.unmask.up;
                let down = b.share_keys.down + b.masked_input.down + b.unmask.down;
                let t = round.timings;
                let better = best.is_none_or(|(c, s, ..)| t.clients + t.server < c + s);
                if better {
                    best = Some((t.clients, t.server, up, down, round.contributors.len()));
                }
            }
            Err(error) => {
                println!(
                    "| {clients} | {values} | {graph} | {percent} % | aborted: {error} | | | | |"
                );
                return;
            }
        }
    }
    let (client, server, up, down, contributors) = best.expect("repeats > 0");
    println!(
        "| {clients} | {values} | {graph} | {percent} % | {:.1} | {:.1} | {:.2} | {:.2} | {contributors} |",
        ms(client) / clients as f64,
        ms(server),
        up as f64 / 1e6,
        down as f64 / 1e6,
    );
}

/// `--row CLIENTS VALUES GRAPH DROPOUT REPEATS`: one row, no header.
fn one_row(args: &[String]) {
    let number = |i: usize| -> usize {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("--row CLIENTS VALUES GRAPH DROPOUT REPEATS; argument {i}"))
    };
    let (clients, values, percent, repeats) = (number(0), number(1), number(3), number(4));
    let graph = args.get(2).expect("GRAPH: all:T or K:T");
    let (k, t) = graph.split_once(':').expect("GRAPH: all:T or K:T");
    let t: usize = t.parse().expect("a threshold");
    let (params, label) = if k == "all" {
        (Params::new(NumShares::All, t), format!("SecAgg t={t}"))
    } else {
        let k: usize = k.parse().expect("a number of shares");
        (
            Params::new(NumShares::Neighbours(k), t),
            format!("SecAgg+ k={k} t={t}"),
        )
    };
    row_of(clients, values, &label, &params, percent, repeats);
}

/// `--keystream`: the masks' stream alone, one thread, 32 MB in 4 KiB
/// pieces (a mask block), best of five: the stream in use (VAES where the
/// CPU has it), RustCrypto's `aes` + `ctr`, and ChaCha20 (`rand_chacha`,
/// the stream before) for comparison.
fn keystream() {
    use cohort_core::secagg::aes_ctr::AesCtr;
    use rand::{RngCore, SeedableRng};
    const TOTAL: usize = 32 << 20;
    let mut piece = [0u8; 4096];
    let mut best_of = |fill: &mut dyn FnMut(&mut [u8])| {
        (0..5)
            .map(|_| {
                let started = std::time::Instant::now();
                for _ in 0..TOTAL / piece.len() {
                    fill(&mut piece);
                }
                started.elapsed()
            })
            .min()
            .expect("five runs")
    };
    let seed = [7u8; 32];
    let mut in_use = AesCtr::new(&seed);
    let mut portable = AesCtr::portable(&seed);
    let mut chacha = rand_chacha::ChaCha20Rng::from_seed(seed);
    let rows: [(&str, Duration); 3] = [
        (
            "AesCtr::new (VAES where present)",
            best_of(&mut |b| in_use.fill(b)),
        ),
        (
            "AesCtr::portable (aes + ctr)",
            best_of(&mut |b| portable.fill(b)),
        ),
        (
            "ChaCha20 (rand_chacha)",
            best_of(&mut |b| chacha.fill_bytes(b)),
        ),
    ];
    println!("| stream | GB/s |");
    println!("|---|---|");
    for (name, time) in rows {
        println!(
            "| {name} | {:.1} |",
            TOTAL as f64 / time.as_secs_f64() / 1e9
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--row") {
        return one_row(&args[at + 1..]);
    }
    if args.iter().any(|a| a == "--keystream") {
        return keystream();
    }
    let quick = args.iter().any(|a| a == "--quick");
    println!(
        "| clients | values | graph | dropout | client ms | server ms | up MB | down MB | in sum |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for clients in [10usize, 100] {
        if quick && clients == 100 {
            continue;
        }
        let secagg = Params::new(NumShares::All, clients / 2 + 1);
        // At 100 clients a small and a larger neighbourhood: 30 % dropout
        // can leave a 21-neighbourhood below its threshold.
        let graphs: &[(usize, usize)] = if clients == 10 {
            &[(7, 4)]
        } else {
            &[(21, 11), (41, 21)]
        };
        for percent in [0, 10, 30] {
            let label = format!("SecAgg t={}", clients / 2 + 1);
            row(clients, &label, &secagg, percent);
            for &(k, t) in graphs {
                let plus = Params::new(NumShares::Neighbours(k), t);
                row(clients, &format!("SecAgg+ k={k} t={t}"), &plus, percent);
            }
        }
    }
}
