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
use std::time::Instant;

use cohort_core::codec::{self, DecodeLimits};
use cohort_core::tree::{Array, ParamTree};

/// LeNet-5's parameter layout (61,706 float32 values).
fn lenet5_like() -> ParamTree {
    let shapes: [(&str, &[usize]); 10] = [
        ("conv1.weight", &[6, 1, 5, 5]),
        ("conv1.bias", &[6]),
        ("conv2.weight", &[16, 6, 5, 5]),
        ("conv2.bias", &[16]),
        ("conv3.weight", &[120, 16, 5, 5]),
        ("conv3.bias", &[120]),
        ("fc4.weight", &[120, 84]),
        ("fc4.bias", &[84]),
        ("fc5.weight", &[84, 10]),
        ("fc5.bias", &[10]),
    ];
    tree_of(&shapes)
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

/// Best of `repeats` timings, in seconds.
fn best_of(repeats: usize, mut work: impl FnMut()) -> f64 {
    (0..repeats)
        .map(|_| {
            let started = Instant::now();
            work();
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    println!("| tree | encode µs | decode µs | memcpy µs | encode / memcpy | decode / memcpy |");
    println!("|---|---|---|---|---|---|");
    let rows: [(&str, fn() -> ParamTree, usize); 2] = [
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
