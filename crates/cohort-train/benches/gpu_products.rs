//! Every matrix product of a vectorized LeNet-5 step (K clients of batch B)
//! through each of cubek's routines for f32 on the GPU, against burn's own
//! `matmul`, in isolation: which routines compile slowly and which run fast
//! on the step's shapes. On an H100 these did not predict the step itself,
//! so `vectorized/product.rs`'s table was chosen from whole runs
//! (docs/BENCHMARKS.md, "A product's kernel chosen without timing").
//!
//! `cargo bench --profile dist -p cohort-train -p cohort-cli --features
//! cohort-cli/vulkan-untuned --bench gpu_products -- [--clients K] [--batch B]
//! [--reps R]` (naming cohort-cli too builds burn with the features of the
//! `cohort` binary's build, so that build's artifacts serve). Each line: the
//! product, its role (the key of the table), the routine, the first launch's
//! ms (compilation included: what a first round pays), the mean ms of R
//! launches after three (every output kept until the device has finished
//! them all: burn's fusion skips an operation whose output is dropped
//! unread), and how far the routine's result is from burn's, relative to
//! its largest value. A routine that refuses a shape falls back to burn's
//! kernel, and reads as burn's time (a warning says so). burn's product
//! runs first and is `simple_unit_large`'s kernel, so that routine's first
//! launch finds it compiled.

use std::time::Instant;

use burn::tensor::{Device, Distribution, Tensor};
use cohort_train::device::DeviceRequest;
use cohort_train::vectorized::{Role, Routine, with_routine};

struct Args {
    clients: usize,
    batch: usize,
    reps: usize,
}

fn args() -> Args {
    let mut args = Args {
        clients: 100,
        batch: 32,
        reps: 20,
    };
    let mut given = std::env::args().skip(1);
    while let Some(flag) = given.next() {
        let mut value = |name: &str| -> usize {
            let given = given.next();
            given
                .as_deref()
                .and_then(|v| v.parse().ok())
                .filter(|v: &usize| *v > 0)
                .unwrap_or_else(|| panic!("{name} takes a positive number, not {given:?}"))
        };
        match flag.as_str() {
            "--clients" => args.clients = value("--clients"),
            "--batch" => args.batch = value("--batch"),
            "--reps" => args.reps = value("--reps"),
            "--bench" => {}
            other => panic!("unknown argument {other}: expected --clients, --batch or --reps"),
        }
    }
    args
}

/// One product `[batches, m, k] · [batches, k, n]`, each operand made
/// contiguous or as the transposed view the net passes.
struct Product {
    name: &'static str,
    role: Role,
    batches: usize,
    m: usize,
    k: usize,
    n: usize,
    transposed: [bool; 2],
}

fn lenet5_products(clients: usize, batch: usize) -> Vec<Product> {
    let p = |name, role, batches, m, k, n, transposed| Product {
        name,
        role,
        batches,
        m,
        k,
        n,
        transposed,
    };
    let (c, b) = (clients, batch);
    let samples = c * b;
    use Role::*;
    vec![
        p(
            "conv1 forward",
            ConvForward,
            c,
            b * 576,
            25,
            6,
            [false, false],
        ),
        p(
            "conv2 forward",
            ConvForward,
            c,
            b * 100,
            150,
            16,
            [false, false],
        ),
        p("fc3 forward", LinearForward, c, b, 400, 120, [false, false]),
        p("fc4 forward", LinearForward, c, b, 120, 84, [false, false]),
        p("fc5 forward", LinearForward, c, b, 84, 10, [false, false]),
        p(
            "fc5 weight gradient",
            LinearWeightGradient,
            c,
            84,
            b,
            10,
            [true, false],
        ),
        p(
            "fc5 input gradient",
            LinearInputGradient,
            c,
            b,
            10,
            84,
            [false, true],
        ),
        p(
            "fc4 weight gradient",
            LinearWeightGradient,
            c,
            120,
            b,
            84,
            [true, false],
        ),
        p(
            "fc4 input gradient",
            LinearInputGradient,
            c,
            b,
            84,
            120,
            [false, true],
        ),
        p(
            "fc3 weight gradient",
            LinearWeightGradient,
            c,
            400,
            b,
            120,
            [true, false],
        ),
        p(
            "fc3 input gradient",
            LinearInputGradient,
            c,
            b,
            120,
            400,
            [false, true],
        ),
        p(
            "conv2 input gradient",
            ConvInputGradient,
            c,
            b * 100,
            16,
            150,
            [false, true],
        ),
        p(
            "conv2 weight gradient",
            ConvWeightGradient,
            samples,
            150,
            100,
            16,
            [true, false],
        ),
    ]
}

/// `[batches, rows, columns]`, as the transposed view of a contiguous
/// `[batches, columns, rows]` where `transposed`.
fn operand(
    batches: usize,
    rows: usize,
    columns: usize,
    transposed: bool,
    device: &Device,
) -> Tensor<3> {
    let normal = Distribution::Normal(0.0, 1.0);
    match transposed {
        true => Tensor::random([batches, columns, rows], normal, device).swap_dims(1, 2),
        false => Tensor::random([batches, rows, columns], normal, device),
    }
}

/// Waits for the device to finish every one of `outputs` (one read of
/// their last values).
fn finish(outputs: &[Tensor<3>]) {
    let corners = outputs
        .iter()
        .map(|x| {
            let [a, b, c] = x.dims();
            x.clone().slice([a - 1..a, b - 1..b, c - 1..c]).reshape([1])
        })
        .collect();
    let _ = Tensor::<1>::cat(corners, 0).into_data();
}

/// The first launch's ms (compilation included), then the mean ms of `reps`
/// launches after two more.
fn time(reps: usize, run: &dyn Fn() -> Tensor<3>) -> (f64, f64) {
    let start = Instant::now();
    finish(&[run()]);
    let first = start.elapsed().as_secs_f64() * 1e3;
    for _ in 0..2 {
        finish(&[run()]);
    }
    let start = Instant::now();
    let outputs: Vec<Tensor<3>> = (0..reps).map(|_| run()).collect();
    finish(&outputs);
    (first, start.elapsed().as_secs_f64() * 1e3 / reps as f64)
}

/// The routines measured: the unit routines (the others were slower over
/// whole runs, docs/BENCHMARKS.md).
const MEASURED: [Routine; 4] = [
    Routine::SimpleUnitLargeTile,
    Routine::SimpleUnitSmallTile,
    Routine::DoubleUnitLargeTile,
    Routine::DoubleUnitSmallTile,
];

fn main() {
    let args = args();
    cohort_train::switches::set(cohort_train::switches::TrainSwitches::default());
    let selected = cohort_train::device::select(DeviceRequest::Gpu).expect("a GPU device");
    let device = selected.device;
    println!(
        "# GPU products of a vectorized LeNet-5 step, {} clients of batch {}, mean of {} launches, on {}",
        args.clients, args.batch, args.reps, selected.name
    );
    println!("product,role,batches,m,k,n,routine,first_ms,ms,distance_from_burn");
    for product in lenet5_products(args.clients, args.batch) {
        let Product {
            batches, m, k, n, ..
        } = product;
        let lhs = operand(batches, m, k, product.transposed[0], &device);
        let rhs = operand(batches, k, n, product.transposed[1], &device);
        let burn = || lhs.clone().matmul(rhs.clone());
        // Timed before anything else runs the routine, so that the first
        // launch pays its compilation.
        let burn_times = time(args.reps, &burn);
        let reference = burn();
        let largest: f32 = reference.clone().abs().max().into_scalar();
        let report = |routine: &str, (first, ms): (f64, f64), distance: f32| {
            println!(
                "{},{},{batches},{m},{k},{n},{routine},{first:.1},{ms:.4},{:.2e}",
                product.name,
                product.role.name(),
                distance / largest.max(f32::MIN_POSITIVE)
            );
        };
        report("burn", burn_times, 0.0);
        for routine in MEASURED {
            let run = || with_routine(lhs.clone(), rhs.clone(), routine);
            let times = time(args.reps, &run);
            let distance: f32 = (run() - reference.clone()).abs().max().into_scalar();
            report(routine.name(), times, distance);
        }
    }
}
