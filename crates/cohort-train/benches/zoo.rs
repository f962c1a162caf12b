//! Training speed of every zoo model on its data set's shapes: samples per
//! second of local training at batch 32 (SGD, one epoch over synthetic
//! samples: the work per sample does not depend on the values), through the
//! registry's trainer, the path a run takes.
//!
//! `cargo bench -p cohort-train --bench zoo -- [--gpu] [--samples N]
//! [--models a,b] [--reps R] [--burn]`; one compute thread unless
//! `--threads N`; `--burn` turns cohort's native CPU kernels off
//! (`TrainSwitches::native_kernels`), to compare against burn's own path.
//! `bench/zoo.sh` runs PyTorch's counterpart (`bench/torch_zoo.py`, the twins
//! of `examples/pytorch/models.py`) right after, for ratios from the same
//! run. Each line is `model shape samples/s` (best of the repetitions after
//! one warm-up epoch, which also takes a GPU's kernel compilation).

use std::sync::Arc;
use std::time::Instant;

use cohort_core::data::Dataset;
use cohort_core::optim::OptimizerSpec;
use cohort_train::device::DeviceRequest;
use cohort_train::local::LocalPlan;
use cohort_train::model::{ModelOptions, ModelSpec};
use cohort_train::registry::Registry;
use cohort_train::task::{Classification, NextToken, Task};
use cohort_train::trainer::{ClientTask, TrainSettings};

/// A model on the shapes of the data set it is trained on in the literature.
struct Case {
    model: &'static str,
    /// What the shapes are, for the report.
    data: &'static str,
    shape: &'static [usize],
    classes: usize,
    options: &'static str,
    tokens: bool,
}

const fn case(
    model: &'static str,
    data: &'static str,
    shape: &'static [usize],
    classes: usize,
    options: &'static str,
) -> Case {
    Case {
        model,
        data,
        shape,
        classes,
        options,
        tokens: false,
    }
}

const CASES: &[Case] = &[
    case("multilayer", "FashionMNIST", &[1, 28, 28], 10, ""),
    case("cnn", "FashionMNIST", &[1, 28, 28], 10, ""),
    case("cnn_femnist", "FEMNIST", &[1, 28, 28], 62, ""),
    case("resnet_20", "CIFAR10", &[3, 32, 32], 10, "norm = \"group\""),
    case("resnet_18", "CIFAR10", &[3, 32, 32], 10, ""),
    case("vgg_11", "CIFAR10", &[3, 32, 32], 10, ""),
    Case {
        tokens: true,
        ..case("lstm_shakespeare", "Shakespeare", &[80], 80, "")
    },
];

struct Args {
    gpu: bool,
    samples: usize,
    reps: usize,
    threads: usize,
    burn: bool,
    models: Option<Vec<String>>,
}

fn args() -> Args {
    let mut args = Args {
        gpu: false,
        samples: 320,
        reps: 3,
        threads: 1,
        burn: false,
        models: None,
    };
    let mut words = std::env::args().skip(1);
    while let Some(word) = words.next() {
        let mut value = |name: &str| {
            words
                .next()
                .unwrap_or_else(|| panic!("{name} needs a value"))
        };
        match word.as_str() {
            "--gpu" => args.gpu = true,
            "--burn" => args.burn = true,
            "--samples" => args.samples = value("--samples").parse().expect("--samples N"),
            "--reps" => args.reps = value("--reps").parse().expect("--reps N"),
            "--threads" => args.threads = value("--threads").parse().expect("--threads N"),
            "--models" => {
                args.models = Some(value("--models").split(',').map(str::to_owned).collect())
            }
            // cargo bench passes --bench to every bench binary.
            _ => {}
        }
    }
    args
}

fn samples(case: &Case, count: usize) -> Dataset {
    let per_sample: usize = case.shape.iter().product();
    let inputs: Vec<f32> = (0..count * per_sample)
        .map(|i| match case.tokens {
            true => ((i * 7919) % case.classes) as f32,
            false => ((i * 7919) % 255) as f32 / 127.5 - 1.0,
        })
        .collect();
    let labels = (0..count).map(|i| (i % case.classes) as u32).collect();
    Dataset::new(inputs, labels, case.shape.to_vec()).expect("sized inputs")
}

fn spec_of(case: &Case) -> ModelSpec {
    let table: toml::Table = case.options.parse().expect("options are TOML");
    ModelSpec::new(case.shape.to_vec(), case.classes)
        .with_options(ModelOptions::new(table.into_iter().collect()))
}

/// The bytes of the largest tensor of the models measured: as a `cohort
/// run` of the model does, the threads share one malloc arena for a large
/// one (`memory::share_one_arena_for`; the decision is the process's, so
/// it is taken for the largest model of the run).
fn largest_tensor_bytes(registry: &Registry, cases: &[&Case]) -> usize {
    cases
        .iter()
        .filter_map(|case| {
            let entry = registry.model(case.model).expect("a registered model");
            let template = entry.template(&spec_of(case)).expect("the model builds");
            template
                .leaves()
                .iter()
                .map(|(_, a)| a.size_in_bytes())
                .max()
        })
        .max()
        .unwrap_or(0)
}

/// Samples per second of one epoch over `count` samples, best of `reps`
/// after a warm-up epoch.
fn measure(
    registry: &Registry,
    case: &Case,
    selected: &cohort_train::device::Selected,
    count: usize,
    reps: usize,
) -> f64 {
    let entry = registry.model(case.model).expect("a registered model");
    let spec = spec_of(case);
    // LEAF's Shakespeare model predicts from the last position by default
    // (`outputs = "last"`), as its twin does: one row a sample.
    let task: Arc<dyn Task> = match case.options.contains("every") {
        true => Arc::new(NextToken),
        false => Arc::new(Classification),
    };
    let global = cohort_train::init::seeded_parameters(&entry.template(&spec).unwrap(), 5);
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
        training_seed: Some(3),
        augmentation: None,
    };
    let mut trainer = entry
        .trainer(&spec, &task, &selected.device, settings)
        .unwrap();
    let data = samples(case, count);
    let all: Vec<u32> = (0..count as u32).collect();
    let plan = LocalPlan::plain(0.01);
    let mut best = f64::INFINITY;
    for rep in 0..=reps {
        let task = ClientTask {
            client_id: 1,
            round: rep as u32 + 1,
        };
        let started = Instant::now();
        let update = trainer.train(task, &global, &data, &all, &plan).unwrap();
        let seconds = started.elapsed().as_secs_f64();
        assert!(
            update.loss.is_finite(),
            "{}: loss {}",
            case.model,
            update.loss
        );
        if rep > 0 {
            best = best.min(seconds);
        }
    }
    count as f64 / best
}

fn main() {
    let args = args();
    cohort_train::memory::retain_freed_memory();
    // A GPU run keeps its tuning results and kernels where
    // COHORT_KERNEL_CACHE says (none when unset), keyed by what sets the
    // shapes: the models and the epoch's sample count. A first process can
    // then pay the compilation and a later one measure the steady state.
    let kernel_cache = cohort_train::device::KernelCache::from_env(
        std::env::var_os(cohort_train::device::KERNEL_CACHE_VAR).as_deref(),
        None,
    );
    let models = args
        .models
        .as_ref()
        .map_or("all".to_owned(), |m| m.join("_"));
    cohort_train::device::key_kernel_cache(&format!("zoo{models}{}", args.samples));
    cohort_train::switches::set(cohort_train::switches::TrainSwitches {
        native_kernels: !args.burn,
        kernel_cache,
        ..Default::default()
    });
    let selected = cohort_train::device::select(if args.gpu {
        DeviceRequest::Gpu
    } else {
        DeviceRequest::Cpu
    })
    .expect("the device");
    let registry = Registry::builtin();
    println!(
        "# cohort zoo training, batch 32, {} samples an epoch, best of {}, on {} ({} thread(s)){}",
        args.samples,
        args.reps,
        selected.name,
        args.threads,
        if args.burn {
            ", native kernels off"
        } else {
            ""
        }
    );
    let cases: Vec<&Case> = CASES
        .iter()
        .filter(|case| {
            let wanted = |models: &Vec<String>| models.iter().any(|m| m == case.model);
            args.models.as_ref().is_none_or(wanted)
        })
        .collect();
    if cohort_train::memory::share_one_arena_for(largest_tensor_bytes(&registry, &cases)) {
        println!("# the threads share one malloc arena (a tensor of 16 MiB or more)");
    }
    // Built after the arena is chosen: a thread takes its arena at its first
    // allocation, which a pool's threads make as they start.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build()
        .expect("compute threads");
    for case in cases {
        let rate = pool.install(|| measure(&registry, case, &selected, args.samples, args.reps));
        println!("{} {} {:?} {:.1}", case.model, case.data, case.shape, rate);
    }
}
