//! FedAvg throughput against a plain memcpy of the same bytes, in one run.
//!
//! `cargo bench -p cohort-core --bench aggregate` (add `-- --quick` to skip the
//! 100-client × 100 MB case, which needs about 11 GB of memory).
//!
//! Throughput is bytes of client trees read per second. The reference copies
//! every client tree once into a scratch buffer with `copy_from_slice`: the
//! least any aggregation must do is read each client's bytes once.

use std::hint::black_box;

use cohort_core::aggregate::{Contribution, fedavg};
use cohort_core::tree::{Array, ParamTree};

mod common;

use common::best_of;

/// LeNet-5's parameter layout (61,706 float32 values).
fn lenet5_like(seed: u32) -> ParamTree {
    common::lenet5_like(|i| filled_value(i, seed))
}

/// 100 MB of float32 in four large leaves.
fn hundred_mb(seed: u32) -> ParamTree {
    let per_leaf = 100_000_000 / 4 / 4;
    ParamTree::from_dotted((0..4).map(|i| {
        (
            format!("layer{i}.weight"),
            Array::f32(vec![per_leaf], filled(per_leaf, seed + i)).unwrap(),
        )
    }))
}

fn filled(len: usize, seed: u32) -> Vec<f32> {
    (0..len).map(|i| filled_value(i, seed)).collect()
}

fn filled_value(i: usize, seed: u32) -> f32 {
    ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 * 1e-9
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    println!("| tree | clients | FedAvg GB/s | memcpy GB/s | FedAvg / memcpy |");
    println!("|---|---|---|---|---|");
    for (label, make) in [
        ("LeNet-5 (247 KB)", lenet5_like as fn(u32) -> ParamTree),
        ("100 MB", hundred_mb),
    ] {
        for clients in [2usize, 10, 100] {
            if quick && label == "100 MB" && clients == 100 {
                continue;
            }
            let trees: Vec<ParamTree> = (0..clients).map(|c| make(c as u32)).collect();
            let global = make(u32::MAX);
            let contributions: Vec<Contribution<'_>> = trees
                .iter()
                .enumerate()
                .map(|(i, tree)| Contribution {
                    client_id: i as u32 + 1,
                    weight: 100.0 + i as f64,
                    tree,
                })
                .collect();
            let bytes = (global.size_in_bytes() * clients) as f64;
            let repeats = if label == "100 MB" { 3 } else { 50 };
            let aggregate = best_of(repeats, || {
                black_box(fedavg(&global, &contributions).unwrap());
            });
            let mut scratch: Vec<f32> = vec![0.0; global.num_elements()];
            let copy = best_of(repeats, || {
                for tree in &trees {
                    let mut offset = 0;
                    for (_, array) in tree.leaves() {
                        let values = array.as_f32().unwrap();
                        scratch[offset..offset + values.len()].copy_from_slice(values);
                        offset += values.len();
                    }
                    black_box(&scratch);
                }
            });
            let (aggregate_rate, copy_rate) = (bytes / aggregate / 1e9, bytes / copy / 1e9);
            println!(
                "| {label} | {clients} | {aggregate_rate:.2} | {copy_rate:.2} | {:.2} |",
                aggregate_rate / copy_rate
            );
        }
    }
}
