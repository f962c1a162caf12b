//! A model and a data set of our own, trained by cohort without changing it.
//!
//! [`Mlp`] is a two-layer perceptron in burn; [`blobs`] makes a seeded
//! classification task (points around one centre per class). [`registry`]
//! adds both to cohort's own models and data sets, and everything else comes
//! from cohort: `src/main.rs` is the whole `cohort` command line with them,
//! and `tests/federation.rs` runs them from Rust code, through that binary,
//! and over the network.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use cohort_core::data::{Dataset, Splits};
use cohort_train::model::{FederatedModel, Inputs, ModelError, ModelSpec, Randomness};
use cohort_train::registry::{DatasetEntry, Registry};

/// Hidden units of [`Mlp`].
const HIDDEN: usize = 32;

/// Features → 32 hidden units (ReLU) → one logit per class.
#[derive(Module, Debug)]
pub struct Mlp {
    hidden: Linear,
    output: Linear,
}

impl Mlp {
    /// For any sample shape: samples are flattened to feature vectors.
    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        let features: usize = spec.sample_shape.iter().product();
        if features == 0 || spec.classes < 2 {
            return Err(ModelError(format!(
                "needs features and at least two classes, got samples of {:?} and {} classes",
                spec.sample_shape, spec.classes
            )));
        }
        Ok(Self {
            hidden: LinearConfig::new(features, HIDDEN).init(device),
            output: LinearConfig::new(HIDDEN, spec.classes).init(device),
        })
    }
}

impl FederatedModel for Mlp {
    fn forward(&self, inputs: Inputs, _randomness: &mut Randomness<'_>) -> Tensor<2> {
        self.output
            .forward(relu(self.hidden.forward(inputs.features())))
    }
}

/// The seeded task: `CLASSES` classes of `FEATURES`-dimensional points.
pub mod blobs {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    pub const FEATURES: usize = 16;
    pub const CLASSES: usize = 4;
    pub const TRAIN: usize = 2_000;
    pub const TEST: usize = 500;

    /// `count` points: class `i % CLASSES`, at its centre plus noise.
    fn points(count: usize, centres: &[Vec<f32>], rng: &mut ChaCha8Rng) -> Dataset {
        let mut inputs = Vec::with_capacity(count * FEATURES);
        let mut labels = Vec::with_capacity(count);
        for i in 0..count {
            let class = i % CLASSES;
            inputs.extend(
                centres[class]
                    .iter()
                    .map(|c| c + rng.random_range(-1.0f32..1.0)),
            );
            labels.push(class as u32);
        }
        Dataset::new(inputs, labels, vec![FEATURES]).expect("one sample per label")
    }

    /// Both splits, the same for the same seed on every machine.
    pub fn splits(seed: u64) -> Splits {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let centres: Vec<Vec<f32>> = (0..CLASSES)
            .map(|_| {
                (0..FEATURES)
                    .map(|_| rng.random_range(-1.0f32..1.0))
                    .collect()
            })
            .collect();
        Splits {
            train: points(TRAIN, &centres, &mut rng),
            test: points(TEST, &centres, &mut rng),
        }
    }
}

/// cohort's models and data sets, with `mlp` and `blobs` added.
pub fn registry() -> Registry {
    let mut registry = Registry::builtin();
    registry
        .add_model(
            "mlp",
            "two-layer perceptron over flattened samples",
            Mlp::build,
        )
        .expect("`mlp` is not a built-in name");
    registry
        .add_dataset(DatasetEntry::new(
            "blobs",
            "seeded points around one centre per class",
            vec![blobs::FEATURES],
            blobs::CLASSES,
            blobs::TRAIN,
            // Generated, not read: the folder and download settings do not apply.
            |_request| Ok(blobs::splits(7)),
        ))
        .expect("`blobs` is not a built-in name");
    registry
}
