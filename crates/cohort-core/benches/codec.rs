//! The payload codec (`codec::encode`, `codec::decode`) against a plain
//! memcpy of the same bytes into a fresh buffer, in one run.
//!
//! `cargo bench -p cohort-core --bench codec` (add `-- --quick` to skip the
//! 100 MB row).
//!
//! Every simulated client decodes the global model and encodes its update,
//! and the server decodes each update: three passes over the model per
//! client, which at 1,000 small clients a round is most of the round's time
//! outside training (docs/BENCHMARKS.md, "100,000 clients"). The reference
//! copies the model's bytes once into a newly allocated buffer, which is the
//! least either direction must do.

use std::hint::black_box;

use cohort_core::codec::{self, DecodeLimits};
use cohort_core::tree::{Array, ParamTree};

mod common;

use common::best_of;

/// LeNet-5's parameter layout (61,706 float32 values).
fn lenet5_like() -> ParamTree {
    common::lenet5_like(|i| (i as u32).wrapping_mul(2_654_435_761) as f32 * 1e-9)
}

/// 100 MB of float32 in four large leaves.
fn hundred_mb() -> ParamTree {
    let per_leaf = 100_000_000 / 4 / 4;
    let shapes: Vec<(String, [usize; 1])> = (0..4)
        .map(|i| (format!("layer{i}.weight"), [per_leaf]))
        .collect();
    let borrowed: Vec<(&str, &[usize])> = shapes
        .iter()
        .map(|(name, shape)| (name.as_str(), &shape[..]))
        .collect();
    tree_of(&borrowed)
}

fn tree_of(shapes: &[(&str, &[usize])]) -> ParamTree {
    ParamTree::from_dotted(shapes.iter().enumerate().map(|(leaf, (name, shape))| {
        let len: usize = shape.iter().product();
        let values = (0..len)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ leaf as u32) as f32 * 1e-9)
            .collect();
        (
            name.to_string(),
            Array::f32(shape.to_vec(), values).unwrap(),
        )
    }))
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    println!("| tree | encode µs | decode µs | memcpy µs | encode / memcpy | decode / memcpy |");
    println!("|---|---|---|---|---|---|");
    // (label, the tree, timings to take the best of)
    type Row = (&'static str, fn() -> ParamTree, usize);
    let rows: [Row; 2] = [
        ("LeNet-5 (247 KB)", lenet5_like, 2_000),
        ("100 MB", hundred_mb, 5),
    ];
    for (label, make, repeats) in rows.into_iter().take(if quick { 1 } else { 2 }) {
        let tree = make();
        let bytes = codec::encode(&tree).unwrap();
        let limits = DecodeLimits::default();
        assert_eq!(codec::decode(&bytes, &limits).unwrap(), tree);
        let encode = best_of(repeats, || {
            black_box(codec::encode(black_box(&tree)).unwrap());
        });
        let decode = best_of(repeats, || {
            black_box(codec::decode(black_box(&bytes), &limits).unwrap());
        });
        let copy = best_of(repeats, || {
            black_box(black_box(&bytes[..]).to_vec());
        });
        println!(
            "| {label} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} |",
            encode * 1e6,
            decode * 1e6,
            copy * 1e6,
            encode / copy,
            decode / copy
        );
    }
}
