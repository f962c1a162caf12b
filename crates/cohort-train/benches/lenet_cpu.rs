//! LeNet-5 on one CPU core: local training (R1's client: 6,000 samples,
//! batch 32, SGD with momentum) and test-set evaluation (10,000 samples,
//! batch 1,000), as samples per second and as a share of the core's peak.
//!
//! `cargo bench -p cohort-train --bench lenet_cpu` (add `-- --quick` for one
//! repetition). `COHORT_NATIVE_KERNELS=0` measures burn flex's path instead
//! of cohort's kernels. `bench/compare.sh` runs PyTorch's counterpart
//! (`bench/torch_lenet_cpu.py`) right after, for ratios from the same run.
//!
//! Synthetic images: the work per sample does not depend on the pixels.
//! Times are the thread's CPU time (both here and in the PyTorch script), so
//! another process on the core slows a run less than it would wall time.

use std::time::Instant;

use cohort_core::data::Dataset;
use cohort_core::optim::OptimizerSpec;
use cohort_core::strategy::ClientInstructions;
use cohort_train::model::LeNet5;
use cohort_train::trainer::{ClientTask, Evaluator, LocalTrainer, TrainSettings};

/// Multiply-adds of one LeNet-5 forward pass: conv1, conv2, conv3, fc4, fc5.
const FORWARD_MACS: f64 = (6 * 784 * 25 + 16 * 100 * 150 + 120 * 400 + 120 * 84 + 84 * 10) as f64;
/// Backward: every layer's weight gradient (as many as forward) and every
/// input gradient but conv1's.
const TRAIN_MACS: f64 = 2.0 * FORWARD_MACS + (FORWARD_MACS - (6 * 784 * 25) as f64);

fn dataset(count: usize) -> Dataset {
    let images = (0..count * 784)
        .map(|i| ((i * 7919) % 255) as f32 / 255.0 - 0.5)
        .collect();
    Dataset {
        inputs: images,
        labels: (0..count).map(|i| (i % 10) as u32).collect(),
        sample_shape: vec![1, 28, 28],
    }
}

/// Seconds this process's threads have run on a CPU (`getrusage`), or
/// `None`. On a shared machine, where wall time includes the time other
/// processes held the cores, this is the steadier measure; it counts every
/// thread, since evaluation scores its batches on the compute pool (the
/// calling thread's own time, measured before, left evaluation at 0 s).
fn cpu_seconds() -> Option<f64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the zeroed space given.
    let usage = unsafe {
        if libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) != 0 {
            return None;
        }
        usage.assume_init()
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Some(seconds(usage.ru_utime) + seconds(usage.ru_stime))
}

/// Best and worst of `reps` timings of `f`, in seconds: process CPU time
/// where the system reports it, wall time otherwise.
fn time(reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    let mut times = Vec::new();
    for _ in 0..reps {
        let (start, cpu) = (Instant::now(), cpu_seconds());
        f();
        times.push(match (cpu, cpu_seconds()) {
            (Some(a), Some(b)) => b - a,
            _ => start.elapsed().as_secs_f64(),
        });
    }
    let best = times.iter().copied().fold(f64::INFINITY, f64::min);
    let worst = times.iter().copied().fold(0.0, f64::max);
    (best, worst)
}

fn main() {
    cohort_train::memory::retain_freed_memory();
    let reps = if std::env::args().any(|a| a == "--quick") {
        1
    } else {
        3
    };
    let native = std::env::var("COHORT_NATIVE_KERNELS").as_deref() != Ok("0");
    cohort_train::switches::set(cohort_train::switches::TrainSwitches {
        native_kernels: native,
        ..Default::default()
    });
    let path = if native {
        "cohort kernels"
    } else {
        "burn flex"
    };
    let device = cohort_train::device::cpu();
    let settings = TrainSettings {
        epochs: 1,
        batch_size: 32,
        optimizer: OptimizerSpec::Sgd {
            learning_rate: 0.01,
            momentum: 0.9,
            weight_decay: 0.0,
            dampening: 0.0,
            nesterov: false,
        },
        clip_grad_norm: None,
        training_seed: Some(1),
        augmentation: None,
    };
    let mut evaluator = Evaluator::new(LeNet5::new(10, &device), 1000);
    let global = evaluator.parameters();
    let mut trainer = LocalTrainer::new(|d| LeNet5::new(10, d), &device, settings);
    let train = dataset(6000);
    let partition: Vec<u32> = (0..6000).collect();
    let plan = ClientInstructions::plain(0.01);
    let task = ClientTask {
        client_id: 1,
        round: 1,
    };
    let (best, worst) = time(reps, || {
        trainer
            .train(task, &global, &train, &partition, &plan)
            .expect("training runs");
    });
    let rate = 6000.0 / best;
    println!(
        "{path}: training {rate:.0} samples/s per core (best of {reps}, worst {:.0}), \
         {:.1} GFLOP/s at {:.2} MFLOP per sample",
        6000.0 / worst,
        rate * 2.0 * TRAIN_MACS / 1e9,
        2.0 * TRAIN_MACS / 1e6
    );
    let test = dataset(10_000);
    let (best, worst) = time(reps, || {
        evaluator.accuracy(&global, &test).expect("evaluation runs");
    });
    println!(
        "{path}: evaluation of 10,000 samples {best:.3} s (best of {reps}, worst {worst:.3}), \
         {:.1} GFLOP/s at {:.2} MFLOP per sample",
        10_000.0 / best * 2.0 * FORWARD_MACS / 1e9,
        2.0 * FORWARD_MACS / 1e6
    );
}
