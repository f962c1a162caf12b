//! Vectorized against alone, on the CPU.
//!
//! Tolerance: after every step, each client's parameters agree with
//! `LocalTrainer` alone to `TOLERANCE` in max absolute difference. Not bitwise:
//! the im2col matrix products and the per-client loss reduce in another order
//! than flex's convolution kernels and burn's cross-entropy, a few ulps per
//! step that SGD with momentum carries forward. Measured on flex: 1.5e-8
//! (LeNet-5, 2 epochs), 3.8e-8 (with clipping, weight decay, Nesterov and
//! per-client rates), 7.5e-9 (compact LeNet-5), against moves of 0.02-0.18.

use super::*;
use crate::model::{LeNetVariant, ModelSpec};
use crate::registry::{ModelEntry, Registry};
use crate::trainer::ModelEvaluator;
use rand::Rng;

const MNIST: [usize; 3] = [1, 28, 28];

fn spec() -> ModelSpec {
    ModelSpec::new(MNIST.to_vec(), 10)
}

fn classification() -> std::sync::Arc<dyn crate::task::Task> {
    std::sync::Arc::new(crate::task::Classification)
}

fn entry(name: &str) -> ModelEntry {
    Registry::builtin().model(name).unwrap().clone()
}

fn accel(name: &str) -> Option<Accelerated> {
    entry(name).accelerated(&spec()).unwrap()
}

fn vectorized(name: &str, settings: TrainSettings) -> VectorizedTrainer {
    VectorizedTrainer::new(name, accel(name), &crate::device::cpu(), settings).unwrap()
}

/// Largest |vectorized − alone| allowed over every parameter of every client.
const TOLERANCE: f32 = 1e-6;

/// The same for `cnn` on a CPU with AVX-512: alone, its 5 × 5 convolution
/// of 32 into 64 channels runs through the column-free kernel
/// (`kernels::direct`), whose sums of 800 products round otherwise than
/// the stacked clients' im2col product (within 1.4e-6 of the values' scale
/// in `kernels::direct_tests`), and a client's steps carry that to up to
/// 3.3e-5 (measured with and without clipping; 1.5e-8 with both sides on
/// im2col), against moves of 0.03. An indexing or masking error moves a
/// client by the scale of its moves.
const CNN_TOLERANCE: f32 = 1e-4;

/// The same for `resnet_20`. Of its four clients, three agree with alone
/// to 1.2e-7; the fourth by 8.4e-4 against moves of 0.3, from its first
/// step on, and only in the layers below `layer1.2`'s first ReLU: two of
/// that ReLU's inputs in the first step lie within 3e-7 of zero (counted),
/// so the two sums' rounding opens the gate in one and closes it in the
/// other, and one position's gradient flows in one only. With other
/// samples or burn's own CPU kernels alone, other clients meet such a tie
/// (1e-4 to 1e-3 measured). The function itself is checked exactly where
/// rounding cannot flip a gate: the stacked logits against the model's
/// (`stacked_resnet_20_gives_the_model_s_logits`) and the written-out
/// gradients against autodiff's.
const RESNET_TOLERANCE: f32 = 2e-3;

fn dataset(count: usize, poison: Option<usize>) -> Dataset {
    let mut data = samples_of(&MNIST, count);
    if let Some(sample) = poison {
        data.inputs[sample * 784 + 300] = f32::INFINITY;
    }
    data
}

/// `count` random samples of `shape` with labels of 10 classes.
fn samples_of(shape: &[usize], count: usize) -> Dataset {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let values = shape.iter().product::<usize>();
    Dataset {
        inputs: (0..count * values)
            .map(|_| rng.random::<f32>() * 2.0 - 0.5)
            .collect(),
        labels: (0..count).map(|_| rng.random_range(0..10u32)).collect(),
        sample_shape: shape.to_vec(),
    }
}

fn settings(clip: Option<f64>, epochs: u32, weight_decay: f64, nesterov: bool) -> TrainSettings {
    TrainSettings {
        epochs,
        batch_size: 32,
        optimizer: OptimizerSpec::Sgd {
            learning_rate: 0.05,
            momentum: 0.9,
            weight_decay,
            dampening: 0.0,
            nesterov,
        },
        clip_grad_norm: clip,
        training_seed: Some(5),
        augmentation: None,
    }
}

fn global_model(model: &str) -> ParamTree {
    crate::init::seeded_parameters(&entry(model).template(&spec()).unwrap(), 3)
}

/// Client `c`'s partition: unequal sizes, none a multiple of the batch.
fn partitions() -> Vec<Vec<u32>> {
    let sizes = [70usize, 45, 100, 7];
    let mut start = 0u32;
    sizes
        .iter()
        .map(|&n| {
            let part = (start..start + n as u32).collect();
            start += n as u32;
            part
        })
        .collect()
}

fn max_difference(a: &ParamTree, b: &ParamTree) -> f32 {
    let mut worst = 0.0f32;
    for ((pa, x), (pb, y)) in a.leaves().iter().zip(b.leaves()) {
        assert_eq!(pa.to_string(), pb.to_string());
        assert_eq!(x.shape(), y.shape(), "{pa}");
        for (p, q) in x.as_f32().unwrap().iter().zip(y.as_f32().unwrap()) {
            worst = worst.max((p - q).abs());
        }
    }
    worst
}

struct Compared {
    worst: f32,
    moved: f32,
}

impl Compared {
    /// Together within [`TOLERANCE`] of alone, after training that moved
    /// the model well beyond it (`what` names the case in a failure).
    fn assert_equal_after_real_training(&self, what: &str) {
        self.assert_within(TOLERANCE, what);
    }

    /// [`Compared::assert_equal_after_real_training`] to `tolerance`.
    fn assert_within(&self, tolerance: f32, what: &str) {
        assert!(self.worst <= tolerance, "{what}: {}", self.worst);
        assert!(
            self.moved > 100.0 * tolerance,
            "{what}: the test needs real training"
        );
    }
}

/// Trains every client alone and all together; returns the largest
/// difference between the two, and how far alone moved from the global model.
fn compare(model: &str, settings: TrainSettings, rates: &[f64]) -> Compared {
    compare_on(&MNIST, model, settings, rates)
}

/// [`compare`] on random samples of `shape` (10 classes).
fn compare_on(shape: &[usize], model: &str, settings: TrainSettings, rates: &[f64]) -> Compared {
    compare_with(ModelSpec::new(shape.to_vec(), 10), model, settings, rates)
}

/// [`compare`] for the model `spec` describes, on random samples of its
/// shape.
fn compare_with(spec: ModelSpec, model: &str, settings: TrainSettings, rates: &[f64]) -> Compared {
    let device = crate::device::cpu();
    let data = samples_of(&spec.sample_shape, 222);
    let entry = entry(model);
    let global = crate::init::seeded_parameters(&entry.template(&spec).unwrap(), 3);
    let parts = partitions();
    let plans: Vec<LocalPlan> = rates.iter().map(|&r| LocalPlan::plain(r)).collect();
    let jobs: Vec<Job<'_>> = parts
        .iter()
        .zip(&plans)
        .enumerate()
        .map(|(i, (partition, plan))| Job {
            task: ClientTask {
                client_id: i as u32 + 1,
                round: 3,
            },
            global: &global,
            partition,
            plan,
        })
        .collect();
    let accelerated = entry.accelerated(&spec).unwrap();
    let mut vectorized =
        VectorizedTrainer::new(model, accelerated, &device, settings.clone()).unwrap();
    let together = vectorized.train(&jobs, &data);
    let mut alone = entry
        .trainer(&spec, &classification(), &device, settings)
        .unwrap();
    let mut compared = Compared {
        worst: 0.0,
        moved: 0.0,
    };
    for (job, together) in jobs.iter().zip(together) {
        let single = alone
            .train(job.task, &global, &data, job.partition, job.plan)
            .unwrap();
        let together = together.unwrap();
        assert_eq!(together.local_steps, single.local_steps);
        assert_eq!(together.num_samples, single.num_samples);
        assert!(
            (together.loss - single.loss).abs() <= 1e-4 * single.loss.abs().max(1.0),
            "loss {} vs {}",
            together.loss,
            single.loss
        );
        compared.worst = compared
            .worst
            .max(max_difference(&together.tree, &single.tree));
        compared.moved = compared.moved.max(max_difference(&single.tree, &global));
    }
    eprintln!(
        "{model}: max |vectorized − alone| = {:e}, max |alone − global| = {:e}",
        compared.worst, compared.moved
    );
    compared
}

#[test]
fn vectorized_sgd_momentum_equals_each_client_alone() {
    let result = compare(
        "lenet5",
        settings(None, 2, 0.0, false),
        &[0.05, 0.05, 0.05, 0.05],
    );
    result.assert_equal_after_real_training("lenet5, momentum");
}

#[test]
fn vectorized_with_clipping_weight_decay_and_own_rates_equals_alone() {
    // A limit well below the free norm, so every step is clipped.
    let result = compare(
        "lenet5",
        settings(Some(0.5), 2, 1e-3, true),
        &[0.05, 0.02, 0.1, 0.07],
    );
    result.assert_equal_after_real_training("lenet5, clipping and weight decay");
}

#[test]
fn vectorized_compact_lenet_equals_alone() {
    let result = compare(
        "lenet5_compact",
        settings(Some(2.0), 1, 0.0, false),
        &[0.05, 0.05, 0.05, 0.05],
    );
    assert!(result.worst <= TOLERANCE, "{}", result.worst);
}

/// With clipping: each client's clipping scale comes from a norm over 1.6
/// million gradients for `cnn`, which alone sums by rows as the stacked
/// clients do (one float32 sum of them all drifted by 1e-4 of the moves).
#[test]
fn vectorized_cnn_and_multilayer_equal_each_client_alone() {
    for model in ["multilayer", "cnn"] {
        let result = compare(
            model,
            settings(Some(2.0), 1, 1e-3, false),
            &[0.05, 0.02, 0.1, 0.07],
        );
        let tolerance = match model {
            "cnn" => CNN_TOLERANCE,
            _ => TOLERANCE,
        };
        result.assert_within(tolerance, model);
    }
}

/// `resnet_20` with GroupNorm on three-channel images of odd sizes, and the
/// tree's names and layouts of every layer (the stem, both convolutions and
/// norms of each block, option A's shortcuts, the linear layer).
#[test]
fn vectorized_resnet_20_equals_each_client_alone() {
    let result = compare_with(
        group_norm_spec(&[3, 11, 10]),
        "resnet_20",
        settings(Some(5.0), 1, 1e-3, false),
        &[0.05, 0.02, 0.1, 0.07],
    );
    result.assert_within(RESNET_TOLERANCE, "resnet_20");
}

/// The stacked `resnet_20` gives the model's logits for the same tree: the
/// two compute the same function, layer names and layouts included, before
/// any training carries rounding forward.
#[test]
fn stacked_resnet_20_gives_the_model_s_logits() {
    use crate::model::{FederatedModel, Inputs, Randomness, ResNet20};
    let device = crate::device::cpu();
    let image = [3, 11, 10];
    let spec = group_norm_spec(&image);
    let tree = crate::init::seeded_parameters(&entry("resnet_20").template(&spec).unwrap(), 7);
    let model = crate::params::load(ResNet20::build(&spec, &device).unwrap(), &tree).unwrap();
    let (count, values) = (222, image.iter().product::<usize>());
    let data = samples_of(&image, count);
    let expected = model
        .forward(
            Inputs::from_host(data.inputs.clone(), &image, &device),
            &mut Randomness::none(),
        )
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let net = net::StackedNet::new(&Stackable::ResNet20 { groups: 2 }, 10, image, &device);
    let plan = LocalPlan::plain(0.1);
    let job = Job {
        task: ClientTask {
            client_id: 1,
            round: 1,
        },
        global: &tree,
        partition: &[0],
        plan: &plan,
    };
    let stacked = stack(&net, [job.global].into_iter()).unwrap();
    let params: Vec<Tensor<3>> = net
        .params()
        .iter()
        .zip(stacked.values)
        .map(|(p, v)| Tensor::<3>::from_data(TensorData::new(v, [1, p.rows, p.cols]), &device))
        .collect();
    let images = Tensor::<2>::from_data(TensorData::new(data.inputs, [count, values]), &device);
    let got = net
        .forward(&params, images, 1)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let largest = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = expected
        .iter()
        .zip(&got)
        .fold(0.0f32, |m, (e, g)| m.max((e - g).abs()));
    assert!(largest > 0.1, "{largest}");
    assert!(worst <= 1e-5 * largest, "{worst:e} of {largest:e}");
}

fn group_norm_spec(image: &[usize]) -> ModelSpec {
    let table: toml::Table = "norm = \"group\"".parse().unwrap();
    let options = crate::model::ModelOptions::new(table.into_iter().collect());
    ModelSpec::new(image.to_vec(), 10).with_options(options)
}

/// With crops and flips (CIFAR's augmentation), each client's batches are
/// augmented from its own stream, as alone: on three-channel images, for the
/// perceptron and for `resnet_20`.
#[test]
fn vectorized_clients_augment_their_batches_as_alone() {
    let augmented = TrainSettings {
        augmentation: Some(crate::trainer::Augmentation {
            augment: cohort_core::data::augment::Augment {
                padding: 2,
                flip: true,
            },
            black: vec![-1.0, -0.5, 0.25],
        }),
        ..settings(Some(5.0), 2, 0.0, false)
    };
    let rates = [0.05, 0.02, 0.1, 0.07];
    let result = compare_on(&[3, 8, 6], "multilayer", augmented.clone(), &rates);
    result.assert_equal_after_real_training("multilayer, augmented");
    let larger = [0.1, 0.05, 0.2, 0.15];
    let result = compare_with(group_norm_spec(&[3, 8, 6]), "resnet_20", augmented, &larger);
    result.assert_within(RESNET_TOLERANCE, "resnet_20, augmented");
}

/// The perceptron stacks on any sample shape: tabular rows of 600 values.
#[test]
fn vectorized_multilayer_on_tabular_rows_equals_each_client_alone() {
    let result = compare_on(
        &[600],
        "multilayer",
        settings(Some(2.0), 1, 1e-3, false),
        &[0.05, 0.02, 0.1, 0.07],
    );
    result.assert_equal_after_real_training("multilayer on tabular rows");
}

#[test]
fn a_non_finite_client_fails_as_alone_and_the_others_do_not_notice() {
    let device = crate::device::cpu();
    // Sample 80 is client 2's (70..115).
    let data = dataset(222, Some(80));
    let global = global_model("lenet5");
    let parts = partitions();
    let plan = LocalPlan::plain(0.05);
    let jobs: Vec<Job<'_>> = parts
        .iter()
        .enumerate()
        .map(|(i, partition)| Job {
            task: ClientTask {
                client_id: i as u32 + 1,
                round: 1,
            },
            global: &global,
            partition,
            plan: &plan,
        })
        .collect();
    let settings = settings(Some(1.0), 1, 0.0, false);
    let mut vectorized = vectorized("lenet5", settings.clone());
    let together = vectorized.train(&jobs, &data);
    let mut alone = entry("lenet5")
        .trainer(&spec(), &classification(), &device, settings)
        .unwrap();
    for (job, together) in jobs.iter().zip(together) {
        let single = alone.train(job.task, &global, &data, job.partition, job.plan);
        match (together, single) {
            (Err(a), Err(b)) => {
                assert_eq!(job.task.client_id, 2);
                let (
                    TrainError::NonFiniteGradient {
                        epoch: ea,
                        step: sa,
                        ..
                    },
                    TrainError::NonFiniteGradient {
                        epoch: eb,
                        step: sb,
                        ..
                    },
                ) = (&a, &b)
                else {
                    panic!("{a} / {b}");
                };
                assert_eq!((ea, sa), (eb, sb));
            }
            (Ok(a), Ok(b)) => assert!(max_difference(&a.tree, &b.tree) <= TOLERANCE),
            (a, b) => panic!("client {}: {a:?} vs {b:?}", job.task.client_id),
        }
    }
}

#[test]
fn an_empty_partition_or_a_foreign_tree_fails_its_client_only() {
    let data = dataset(222, None);
    let global = global_model("lenet5");
    let foreign = global_model("lenet5_compact");
    let plan = LocalPlan::plain(0.05);
    let parts = partitions();
    let task = |client_id| ClientTask {
        client_id,
        round: 1,
    };
    let jobs = [
        Job {
            task: task(1),
            global: &global,
            partition: &parts[0],
            plan: &plan,
        },
        Job {
            task: task(2),
            global: &global,
            partition: &[],
            plan: &plan,
        },
        Job {
            task: task(3),
            global: &foreign,
            partition: &parts[2],
            plan: &plan,
        },
        Job {
            task: task(4),
            global: &global,
            partition: &parts[3],
            plan: &plan,
        },
    ];
    let mut vectorized = vectorized("lenet5", settings(None, 1, 0.0, false));
    let results = vectorized.train(&jobs, &data);
    assert!(results[0].is_ok());
    assert!(matches!(
        results[1],
        Err(TrainError::EmptyPartition { client_id: 2, .. })
    ));
    assert!(
        matches!(results[2], Err(TrainError::Load { client_id: 3, .. })),
        "{:?}",
        results[2]
    );
    assert!(results[3].is_ok());
}

#[test]
fn unsupported_models_and_optimizers_name_the_key() {
    let adam = OptimizerSpec::Adam {
        learning_rate: 0.01,
        betas: [0.9, 0.999],
        eps: 1e-8,
        bias_correction: false,
    };
    let error = check("lenet5", accel("lenet5"), &adam).unwrap_err();
    assert_eq!(
        error.to_string(),
        "trainer.vectorized_clients supports trainer.optimizer = \"sgd\" only, not \"adam\""
    );
    let sgd = settings(None, 1, 0.0, false).optimizer;
    let error = check("cnn_bn", accel("cnn_bn"), &sgd).unwrap_err();
    assert!(error.to_string().contains("trainer.model_name"), "{error}");
    assert!(check("lenet5_compact", accel("lenet5_compact"), &sgd).is_ok());
    // The stacked convolutions read one channel, and their pooling has no
    // floor mode: CIFAR's three channels and 30×30 images train alone.
    for shape in [[3, 32, 32], [1, 30, 30]] {
        let image_spec = ModelSpec::new(shape.to_vec(), 10);
        let cnn = entry("cnn").accelerated(&image_spec).unwrap();
        let error = check("cnn", cnn, &sgd).unwrap_err();
        assert!(error.to_string().contains("one-channel"), "{error}");
    }
    assert!(check("cnn_femnist", accel("cnn_femnist"), &sgd).is_ok());
    // resnet_20 stacks with GroupNorm only: BatchNorm's running statistics
    // are state the stacked step does not keep.
    let cifar = [3, 32, 32];
    let batch_norm = entry("resnet_20")
        .accelerated(&ModelSpec::new(cifar.to_vec(), 10))
        .unwrap();
    let error = check("resnet_20", batch_norm, &sgd).unwrap_err();
    assert!(error.to_string().contains("norm = \"group\""), "{error}");
    let group_norm = entry("resnet_20")
        .accelerated(&group_norm_spec(&cifar))
        .unwrap();
    assert!(check("resnet_20", group_norm, &sgd).is_ok());
    let tabular = ModelSpec::new(vec![600], 100);
    let multilayer = entry("multilayer").accelerated(&tabular).unwrap();
    assert!(check("multilayer", multilayer, &sgd).is_ok());
}

#[test]
fn the_memory_budget_chooses_the_batch_of_clients() {
    let k = clients_for_memory(accel("lenet5"), [1, 28, 28], 32, AUTO_MEMORY_BUDGET, None);
    // 3,758,376 floats (15.0 MB) a LeNet-5 client at batch 32: 285 clients
    // fit in 4 GiB.
    assert_eq!(k, 285);
    assert!((100..400).contains(&k), "{k}");
    let half = clients_for_memory(
        accel("lenet5"),
        [1, 28, 28],
        32,
        AUTO_MEMORY_BUDGET / 2,
        None,
    );
    assert!(half.abs_diff(k / 2) <= 1, "{half} vs {k}");
    assert_eq!(
        clients_for_memory(accel("lenet5"), [1, 28, 28], 32, 1, None),
        1
    );
}

#[test]
fn the_device_memory_is_shared_by_the_workers_with_room_for_tuning() {
    assert_eq!(memory_budget(None, 1), AUTO_MEMORY_BUDGET);
    assert_eq!(memory_budget(None, 8), AUTO_MEMORY_BUDGET);
    assert_eq!(memory_budget(Some(16 << 30), 1), 8 << 30);
    assert_eq!(memory_budget(Some(16 << 30), 4), 2 << 30);
    // No workers is read as one; a tiny device still gets a budget (of one
    // client, by `clients_for_memory`'s floor).
    assert_eq!(memory_budget(Some(16 << 30), 0), 8 << 30);
    assert_eq!(memory_budget(Some(1), 3), 1);
    // An H200 as cubecl reports it under Vulkan (150,754,820,096 bytes of
    // memory, buffers up to 2,147,483,644 bytes), one worker: half its memory
    // would hold over 3,000 LeNet-5 clients, but a buffer holds the largest
    // tensor (32 · 29,400 floats, 3,763,200 bytes a client) of 570.
    let (memory, buffer) = (150_754_820_096, 2_147_483_644);
    let budget = memory_budget(Some(memory), 1);
    let unbounded = clients_for_memory(accel("lenet5"), [1, 28, 28], 32, budget, None);
    assert!(unbounded > 3_000, "{unbounded}");
    let h200 = clients_for_memory(accel("lenet5"), [1, 28, 28], 32, budget, Some(buffer));
    assert_eq!(h200, 570);
}

#[test]
fn a_batch_fits_the_largest_buffer() {
    let net = StackedNet::new(
        &Stackable::LeNet(LeNetVariant::Padded),
        10,
        [1, 28, 28],
        &crate::device::cpu(),
    );
    // Counted by hand: conv2's input gradient gathers, for each of the
    // 14·14·6 inputs of a sample, the 25 patch entries at most that read it
    // (29,400 floats a sample; conv1's patches are 28·28 positions × 25, 19,600
    // + 1); for a single sample, conv3's stacked weight (400 × 120) is larger.
    assert_eq!(net.largest_tensor_elements(1), 400 * 120);
    assert_eq!(net.largest_tensor_elements(32), 32 * 14 * 14 * 6 * 25);
    let per_client = 32 * 14 * 14 * 6 * 25 * 4;
    let fit = |limit| clients_per_buffer(accel("lenet5"), [1, 28, 28], 32, Some(limit));
    // A client's 3,763,200 bytes are 14,700 × 256; cubecl's pools round a
    // limit down to 256 bytes, and so does the count.
    assert_eq!(fit(per_client * 7 + 255), 7);
    assert_eq!(fit(per_client * 7), 7);
    assert_eq!(fit(per_client * 7 - 1), 6);
    assert_eq!(fit(per_client - 1), 0);
    assert_eq!(
        clients_per_buffer(accel("lenet5"), [1, 28, 28], 32, None),
        usize::MAX
    );
}

/// The written-out step (loss and backward pass) against burn's autodiff of
/// the same forward, on a step with padding (a client with fewer samples) and
/// blank images, whose pooling windows tie (every position sees only the bias).
#[test]
fn written_out_backward_equals_autodiff() {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let models = [
        Stackable::LeNet(LeNetVariant::Padded),
        Stackable::LeNet(LeNetVariant::Compact),
        Stackable::Cnn { dense: 24 },
        Stackable::Multilayer {
            hidden: vec![40, 24],
            tanh: true,
        },
        Stackable::Multilayer {
            hidden: vec![24],
            tanh: false,
        },
    ];
    for model in models {
        written_out_against_autodiff(&model, [1, 28, 28], &mut rng);
    }
}

/// The same for `resnet_20` with GroupNorm, on three-channel images of odd
/// sizes (the stride-2 layers keep the odd row) and on one channel.
#[test]
fn written_out_resnet_backward_equals_autodiff() {
    let mut rng = ChaCha8Rng::seed_from_u64(29);
    for (groups, image) in [(2, [3, 9, 7]), (4, [1, 8, 8])] {
        written_out_against_autodiff(&Stackable::ResNet20 { groups }, image, &mut rng);
    }
}

/// One step of `model` on `image`s: the written-out loss and gradients
/// against autodiff's, within 1e-5 of the largest value.
fn written_out_against_autodiff(model: &Stackable, image: [usize; 3], rng: &mut ChaCha8Rng) {
    let device = crate::device::cpu();
    let (k, batch, classes) = (3, 5, 10);
    let values: usize = image.iter().product();
    let net = net::StackedNet::new(model, classes, image, &device);
    let params: Vec<Tensor<3>> = net
        .params()
        .iter()
        .map(|p| [k, p.rows, p.cols])
        .map(|shape| {
            let scale = 1.0 / (shape[1] as f32).sqrt();
            // Shifted up so that ReLUs open; a perceptron's 784 inputs
            // would saturate tanh (a zero derivative) under shifted weights.
            let perceptron_weight = matches!(model, Stackable::Multilayer { .. }) && shape[1] > 1;
            let shift = if perceptron_weight { 0.0 } else { 0.05 };
            let values: Vec<f32> = (0..shape.iter().product::<usize>())
                .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale + shift)
                .collect();
            Tensor::<3>::from_data(TensorData::new(values, shape), &device)
        })
        .collect();
    let mut pixels: Vec<f32> = (0..k * batch * values).map(|_| rng.random()).collect();
    pixels[..2 * values].fill(0.0);
    let images = Tensor::<2>::from_data(TensorData::new(pixels, [k * batch, values]), &device);
    let counts = [5usize, 3, 5];
    let mut weights = vec![0.0f32; k * batch * classes];
    for (client, &count) in counts.iter().enumerate() {
        for row in 0..count {
            let label = rng.random_range(0..classes);
            weights[(client * batch + row) * classes + label] = 1.0 / count as f32;
        }
    }
    let weights = Tensor::<3>::from_data(TensorData::new(weights, [k, batch, classes]), &device);

    let (recorded_loss, recorded) = recorded_step(&net, &params, images.clone(), weights.clone());
    let (written_loss, written) = written_out_step(&net, &params, images, weights);

    let close = |a: Tensor<3>, b: Tensor<3>, what: &str| {
        assert_eq!(a.dims(), b.dims(), "{model:?} {what}");
        let expected = b.into_data().try_to_vec::<f32>().unwrap();
        let got = a.into_data().try_to_vec::<f32>().unwrap();
        let largest = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let worst = expected
            .iter()
            .zip(&got)
            .fold(0.0f32, |m, (e, g)| m.max((e - g).abs()));
        assert!(largest > 0.0, "{model:?} {what}: no gradient");
        assert!(
            worst <= 1e-5 * largest.max(1.0),
            "{model:?} {what}: |written − autodiff| {worst:e} (largest {largest:e})"
        );
    };
    close(written_loss, recorded_loss, "loss");
    assert_eq!(written.len(), recorded.len());
    for (index, (grad, expected)) in written.into_iter().zip(recorded).enumerate() {
        close(grad, expected, &format!("parameter {index}"));
    }
}

/// The images go to the device once per dataset: a trainer that has seen one
/// dataset trains on another of the same shape exactly as a fresh trainer.
#[test]
fn a_new_dataset_replaces_the_images_on_the_device() {
    let first = dataset(222, None);
    let second = Dataset {
        inputs: first.inputs.iter().map(|v| 1.0 - v).collect(),
        labels: first.labels.iter().rev().copied().collect(),
        sample_shape: first.sample_shape.clone(),
    };
    let global = global_model("lenet5_compact");
    let partition: Vec<u32> = (0..40).collect();
    let plan = LocalPlan::plain(0.05);
    let jobs = [Job {
        task: ClientTask {
            client_id: 1,
            round: 1,
        },
        global: &global,
        partition: &partition,
        plan: &plan,
    }];
    let trainer = || vectorized("lenet5_compact", settings(None, 1, 0.0, false));
    let mut reused = trainer();
    let on_first = reused.train(&jobs, &first).remove(0).unwrap();
    let on_second = reused.train(&jobs, &second).remove(0).unwrap();
    let fresh = trainer().train(&jobs, &second).remove(0).unwrap();
    assert_eq!(max_difference(&on_second.tree, &fresh.tree), 0.0);
    assert!(max_difference(&on_second.tree, &on_first.tree) > 0.0);
}

/// The stacked evaluator scores each batch as the model's own evaluator
/// does: 50 samples in batches of 7, 3 batches a pass, so the last pass
/// holds one full batch, one of a single sample and a padded slot.
#[test]
fn stacked_evaluation_scores_each_batch_as_the_model_does() {
    let device = crate::device::cpu();
    let cases = [
        (spec(), "lenet5"),
        (spec(), "cnn"),
        (spec(), "multilayer"),
        (group_norm_spec(&[3, 11, 10]), "resnet_20"),
    ];
    for (spec, model) in cases {
        let entry = entry(model);
        let tree = crate::init::seeded_parameters(&entry.template(&spec).unwrap(), 3);
        let data = samples_of(&spec.sample_shape, 50);
        let plain = || {
            entry
                .evaluator(&spec, &classification(), &device, 7)
                .unwrap()
        };
        let expected = plain().batch_scores(&tree, &data).unwrap();
        let accelerated = entry.accelerated(&spec).unwrap().unwrap();
        let mut stacked = StackedEvaluator::new(plain(), accelerated, &device, 7, 3);
        assert_eq!(stacked.evaluation_batch(), Some(7));
        let got = stacked.batch_scores(&tree, &data).unwrap();
        assert_eq!(got.len(), 8, "{model}");
        for (batch, (got, expected)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(got.rows, expected.rows, "{model}, batch {batch}");
            assert_eq!(got.correct, expected.correct, "{model}, batch {batch}");
            let scale = expected.loss_sum.abs().max(1.0);
            assert!(
                (got.loss_sum - expected.loss_sum).abs() < 1e-5 * scale,
                "{model}, batch {batch}: loss {} against {}",
                got.loss_sum,
                expected.loss_sum
            );
        }
        let whole = stacked.evaluate(&tree, &data).unwrap();
        assert_eq!(whole.rows, 50);
        assert!(
            whole.accuracy > 0.0,
            "{model}: some random guesses are right"
        );
    }
}

#[test]
fn stacked_evaluation_refuses_a_label_beyond_the_classes() {
    let device = crate::device::cpu();
    let entry = entry("lenet5");
    let tree = global_model("lenet5");
    let mut data = dataset(20, None);
    data.labels[13] = 10;
    let plain = entry
        .evaluator(&spec(), &classification(), &device, 8)
        .unwrap();
    let mut stacked = StackedEvaluator::new(plain, accel("lenet5").unwrap(), &device, 8, 2);
    let error = stacked.evaluate(&tree, &data).unwrap_err();
    assert_eq!(
        error,
        crate::trainer::EvalError::LabelOutOfRange {
            index: 13,
            label: 10,
            classes: 10
        }
    );
}

/// A tree of another model is refused as the model's own evaluator refuses
/// it, before the labels are looked at.
#[test]
fn stacked_evaluation_refuses_a_tree_of_another_model() {
    let device = crate::device::cpu();
    let mut data = dataset(20, None);
    data.labels[3] = 10;
    let plain = entry("lenet5")
        .evaluator(&spec(), &classification(), &device, 8)
        .unwrap();
    let mut stacked = StackedEvaluator::new(plain, accel("lenet5").unwrap(), &device, 8, 2);
    let error = stacked.evaluate(&global_model("cnn"), &data).unwrap_err();
    assert!(
        matches!(error, crate::trainer::EvalError::Load(_)),
        "{error}"
    );
}
