//! The task seam through the public API: a sequence model of one's own
//! learns next-token prediction, evaluation reports the task's loss and
//! accuracy over every position, and classification's loss is the
//! cross-entropy of the logits evaluation reports.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use cohort_core::data::Dataset;
use cohort_core::optim::OptimizerSpec;
use cohort_train::init::seeded_parameters;
use cohort_train::local::LocalPlan;
use cohort_train::model::{FederatedModel, Inputs, ModelError, ModelSpec, Randomness};
use cohort_train::registry::{ModelEntry, Registry, RunModel};
use cohort_train::task::{Classification, NextToken, Task};
use cohort_train::trainer::{ClientTask, TrainSettings};

const VOCABULARY: usize = 6;
const LENGTH: usize = 8;

/// Token embedding → one logit per token at every position.
#[derive(Module, Debug)]
struct Bigram {
    embedding: Embedding,
    output: Linear,
}

impl Bigram {
    fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        spec.require_sample_shape(&[LENGTH])?;
        Ok(Self {
            embedding: EmbeddingConfig::new(spec.classes, 16).init(device),
            output: LinearConfig::new(16, spec.classes).init(device),
        })
    }
}

impl FederatedModel for Bigram {
    fn forward(&self, inputs: Inputs, _randomness: &mut Randomness<'_>) -> Tensor<2> {
        let batch = inputs.batch_size();
        let logits = self.output.forward(self.embedding.forward(inputs.tokens()));
        logits.reshape([batch * LENGTH, VOCABULARY])
    }

    fn rows_per_sample(&self, sample_shape: &[usize]) -> usize {
        sample_shape.iter().product()
    }
}

/// Sequences counting up modulo the vocabulary from every start, each
/// labelled with the token after it: the next token is always the last + 1.
fn counting(samples: usize) -> Dataset {
    let mut inputs = Vec::new();
    let mut labels = Vec::new();
    for s in 0..samples {
        inputs.extend((0..LENGTH).map(|i| ((s + i) % VOCABULARY) as f32));
        labels.push(((s + LENGTH) % VOCABULARY) as u32);
    }
    Dataset::new(inputs, labels, vec![LENGTH]).unwrap()
}

fn bigram_registry() -> Registry {
    let mut registry = Registry::empty();
    registry
        .add_model("bigram", "embedding and a linear layer", Bigram::build)
        .unwrap();
    registry
}

fn run_model(entry: ModelEntry, sample_shape: Vec<usize>, task: Arc<dyn Task>) -> RunModel {
    RunModel {
        entry,
        spec: ModelSpec::new(sample_shape, VOCABULARY),
        task,
        augmentation: None,
    }
}

fn settings(epochs: u32) -> TrainSettings {
    TrainSettings {
        epochs,
        batch_size: 8,
        optimizer: OptimizerSpec::Sgd {
            learning_rate: 0.5,
            momentum: 0.0,
            weight_decay: 0.0,
            dampening: 0.0,
            nesterov: false,
        },
        clip_grad_norm: None,
        training_seed: Some(7),
        augmentation: None,
    }
}

#[test]
fn a_sequence_model_learns_next_token_prediction_over_every_position() {
    let registry = bigram_registry();
    let model = run_model(
        registry.model("bigram").unwrap().clone(),
        vec![LENGTH],
        Arc::new(NextToken),
    );
    let device = cohort_train::device::cpu();
    let data = counting(48);
    let all: Vec<u32> = (0..data.len() as u32).collect();
    let global = seeded_parameters(&model.template().unwrap(), 1);
    let mut evaluator = model.evaluator(&device, 16).unwrap();
    let before = evaluator.evaluate(&global, &data).unwrap();
    assert_eq!(
        before.rows,
        (48 * LENGTH) as u64,
        "every position is scored"
    );

    let mut trainer = model.trainer(&device, settings(20)).unwrap();
    let task = ClientTask {
        client_id: 1,
        round: 1,
    };
    let update = trainer
        .train(task, &global, &data, &all, &LocalPlan::plain(0.5))
        .unwrap();
    let after = evaluator.evaluate(&update.tree, &data).unwrap();
    assert!(
        after.accuracy > 0.95 && after.loss < before.loss / 4.0,
        "before {before:?}, after {after:?}"
    );
    // The loss reported is the mean cross-entropy of the rows' logits.
    let predictions = evaluator.predictions(&update.tree, &data, &all).unwrap();
    assert_eq!(predictions.labels.len(), 48 * LENGTH);
    assert_eq!(predictions.labels[..LENGTH], [1, 2, 3, 4, 5, 0, 1, 2]);
    let by_hand = mean_cross_entropy(&predictions.logits, &predictions.labels, VOCABULARY);
    assert!(
        (by_hand - after.loss).abs() < 1e-4,
        "{by_hand} vs {after:?}"
    );
    // A client's held-out score counts rows too.
    let held_out = trainer.score(&update.tree, &data, &all[..4]).unwrap();
    assert_eq!(held_out.rows, (4 * LENGTH) as u64);
}

#[test]
fn a_model_whose_rows_do_not_fit_the_task_is_an_error_not_a_wrong_metric() {
    let registry = bigram_registry();
    // Classification wants one row per sample; this model gives LENGTH.
    let model = run_model(
        registry.model("bigram").unwrap().clone(),
        vec![LENGTH],
        Arc::new(Classification),
    );
    let global = seeded_parameters(&model.template().unwrap(), 1);
    let mut evaluator = model.evaluator(&cohort_train::device::cpu(), 16).unwrap();
    let error = evaluator.evaluate(&global, &counting(4)).unwrap_err();
    assert_eq!(
        error.to_string(),
        "the model gives 32 output rows for 4 samples; classification needs 4"
    );
    // Training says so too, instead of a shape panic inside the loss.
    let mut trainer = model
        .trainer(&cohort_train::device::cpu(), settings(1))
        .unwrap();
    let task = ClientTask {
        client_id: 2,
        round: 1,
    };
    let error = trainer
        .train(
            task,
            &global,
            &counting(4),
            &[0, 1, 2, 3],
            &LocalPlan::plain(0.5),
        )
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "client 2, round 1, epoch 1, step 1: the model gives 32 output rows for 4 samples; \
         classification needs 4"
    );
}

#[test]
fn classification_reports_the_cross_entropy_of_its_logits_with_the_native_kernels_too() {
    let registry = Registry::builtin();
    let model = RunModel {
        entry: registry.model("lenet5").unwrap().clone(),
        spec: ModelSpec::new(vec![1, 28, 28], 10),
        task: Arc::new(Classification),
        augmentation: None,
    };
    let count = 40;
    let data = Dataset::new(
        (0..count * 784)
            .map(|i| ((i * 7919) % 255) as f32 / 255.0 - 0.5)
            .collect(),
        (0..count).map(|i| (i % 10) as u32).collect(),
        vec![1, 28, 28],
    )
    .unwrap();
    let global = seeded_parameters(&model.template().unwrap(), 3);
    let mut evaluator = model.evaluator(&cohort_train::device::cpu(), 16).unwrap();
    let evaluation = evaluator.evaluate(&global, &data).unwrap();
    let all: Vec<u32> = (0..count as u32).collect();
    let predictions = evaluator.predictions(&global, &data, &all).unwrap();
    let by_hand = mean_cross_entropy(&predictions.logits, &predictions.labels, 10);
    assert!(
        (by_hand - evaluation.loss).abs() < 1e-4,
        "{by_hand} vs {evaluation:?}"
    );
    assert_eq!(
        evaluation.accuracy,
        predictions.correct as f64 / count as f64
    );
}

fn mean_cross_entropy(logits: &[f32], targets: &[u32], classes: usize) -> f64 {
    let rows = logits.chunks_exact(classes);
    let total: f64 = rows
        .zip(targets)
        .map(|(row, &target)| {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            max + sum.ln() - row[target as usize] as f64
        })
        .sum();
    total / targets.len() as f64
}
