//! Each pass of a convolution (forward, input gradient, weight gradient)
//! through each of cohort's CPU paths (the column-free kernel, the
//! shifted copies, Winograd's F(2 × 2, 3 × 3), im2col), on the 3 × 3 layers of the zoo's CIFAR models
//! at batch 32: the measurements that chose which path computes which pass
//! (`kernels::conv2d`'s routes). The paths alternate, so a host's drift
//! touches all alike; each figure is the best of the repetitions after a
//! warm-up, in milliseconds, with GFLOP/s of the whole layer (forward and
//! both gradients) after each path's sum, and in brackets both gradients
//! computed in one call, as a model's backward pass asks for them.
//!
//! `cargo bench -p cohort-train --bench conv_passes -- [--reps N]
//! [--layers c_in,c_out,side;…] [--paths winograd,im2col,…] [--kernel 5] [--stride 2]`;
//! one thread.

use cohort_train::conv_bench::{Case, PATHS};

/// vgg_11's 3 × 3 layers (with their map sides), then resnet_20's.
const LAYERS: &[[usize; 3]] = &[
    [3, 64, 32],
    [64, 128, 16],
    [128, 256, 8],
    [256, 256, 8],
    [256, 512, 4],
    [512, 512, 4],
    [512, 512, 2],
    [16, 16, 32],
    [32, 32, 16],
    [64, 64, 8],
];

/// Ends the bench on a malformed argument, saying which.
fn refuse(what: &str) -> ! {
    eprintln!("conv_passes: {what}");
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let reps: usize = match value("--reps").map(|r| r.parse()) {
        None => 7,
        Some(Ok(reps)) if reps > 0 => reps,
        Some(_) => refuse("--reps takes a count of at least 1"),
    };
    let layers: Vec<[usize; 3]> = match value("--layers") {
        None => LAYERS.to_vec(),
        Some(list) => list
            .split(';')
            .map(|layer| {
                let numbers: Result<Vec<usize>, _> = layer.split(',').map(str::parse).collect();
                match numbers.as_deref() {
                    Ok(&[c_in, c_out, side]) if c_in > 0 && c_out > 0 && side > 0 => {
                        [c_in, c_out, side]
                    }
                    _ => refuse(&format!(
                        "--layers: `{layer}` is not c_in,c_out,side, each at least 1"
                    )),
                }
            })
            .collect(),
    };
    let kernel: usize = match value("--kernel").map(|k| k.parse()) {
        None => 3,
        Some(Ok(k)) if k % 2 == 1 => k,
        Some(_) => refuse("--kernel takes an odd side"),
    };
    let stride: usize = match value("--stride").map(|s| s.parse()) {
        None => 1,
        Some(Ok(s)) if s > 0 => s,
        Some(_) => refuse("--stride takes a step of at least 1"),
    };
    let chosen: Vec<usize> = match value("--paths") {
        None => (0..PATHS.len()).collect(),
        Some(list) => list
            .split(',')
            .map(|name| match PATHS.iter().position(|p| p == &name) {
                Some(path) => path,
                None => refuse(&format!("--paths: `{name}` is none of {PATHS:?}")),
            })
            .collect(),
    };
    println!(
        "# batch 32, {kernel} × {kernel} kernels, padding {}, stride {stride}; ms: forward / input gradient / weight gradient = sum (GFLOP/s) [both gradients in one call]; best of {reps}",
        kernel / 2
    );
    for [c_in, c_out, side] in layers {
        let mut case = Case::new(32, (c_in, c_out), side, kernel, stride);
        let paths: Vec<usize> = chosen
            .iter()
            .copied()
            .filter(|&p| case.runs_on(p))
            .collect();
        let mut best = vec![[f64::MAX; 4]; PATHS.len()];
        for rep in 0..=reps {
            for &path in &paths {
                let times = case.time(path);
                if rep > 0 {
                    for (b, t) in best[path].iter_mut().zip(times) {
                        *b = b.min(t);
                    }
                }
            }
        }
        let mut line = format!("{c_in:>4} → {c_out:<4} {side:>2}×{side:<2}");
        for &path in &paths {
            let [f, i, w, both] = best[path].map(|s| s * 1e3);
            let gflops = 3.0 * case.flop() / ((f + i + w) * 1e6);
            line += &format!(
                "  {}: {f:.2} / {i:.2} / {w:.2} = {:.2} ({gflops:.0}) [{both:.2}]",
                PATHS[path],
                f + i + w
            );
        }
        println!("{line}");
    }
}
