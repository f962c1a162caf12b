//! A model and a data set of our own, trained by cohort without changing it.
//!
//! [`Mlp`] is a two-layer perceptron in burn; [`blobs`] makes a seeded
//! classification task (points around one centre per class); [`damped`] is a
//! server strategy (FedAvg's step, damped). [`registry`] adds them to
//! cohort's own models, data sets and strategies, and everything else comes
//! from cohort: `src/main.rs` is the whole `cohort` command line with them,
//! and `tests/federation.rs` runs them from Rust code, through that binary,
//! and over the network.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use cohort_core::data::{Dataset, Splits};
use cohort_train::model::{FederatedModel, Inputs, ModelError, ModelSpec, Randomness};
use cohort_train::registry::{DatasetEntry, Registry, StrategyEntry};

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
            train_users: None,
        }
    }
}

/// A server strategy of our own: the global model moves only `damping` of
/// the way to FedAvg's average, `x ← x + d · (avg − x)`.
pub mod damped {
    use cohort_core::strategy::fedavg::weighted_average;
    use cohort_core::strategy::{
        Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError, scale_update,
    };
    use cohort_core::tree::ParamTree;

    /// `[algorithm]` of `type = "damped_fedavg"`.
    #[derive(Debug, Clone, serde::Deserialize)]
    #[serde(default, deny_unknown_fields)]
    pub struct Options {
        /// In (0, 1]; default 0.5. 1 is FedAvg.
        pub damping: f64,
    }

    impl Default for Options {
        fn default() -> Self {
            Self { damping: 0.5 }
        }
    }

    pub struct DampedFedAvg {
        pub damping: f64,
    }

    impl DampedFedAvg {
        pub fn from_options(options: Options) -> Result<Self, String> {
            if !(options.damping > 0.0 && options.damping <= 1.0) {
                return Err(format!(
                    "damping must be in (0, 1], got {}",
                    options.damping
                ));
            }
            Ok(Self {
                damping: options.damping,
            })
        }
    }

    impl Strategy for DampedFedAvg {
        fn name(&self) -> &'static str {
            "damped_fedavg"
        }

        fn aggregate(
            &mut self,
            _ctx: &RoundContext,
            global: &ParamTree,
            updates: &[ClientUpdate<'_>],
        ) -> Result<Aggregated, StrategyError> {
            Ok(match weighted_average(global, updates)? {
                Some(average) => Aggregated::model(scale_update(global, average, self.damping)),
                None => Aggregated::unchanged(),
            })
        }
    }
}

/// cohort's models, data sets and strategies, with `mlp`, `blobs` and
/// `damped_fedavg` added.
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
        .add_strategy(StrategyEntry::new(
            "damped_fedavg",
            "FedAvg's step, damped",
            |section, _run| {
                let options = section.options_as::<damped::Options>()?;
                Ok(Box::new(damped::DampedFedAvg::from_options(options)?))
            },
        ))
        .expect("`damped_fedavg` is not a built-in name");
    registry
}

#[cfg(test)]
mod tests {
    use super::damped::*;
    use cohort_core::strategy::{ClientUpdate, RoundContext, Strategy};
    use cohort_core::tree::{Array, ParamTree};

    fn tree(value: f32) -> ParamTree {
        ParamTree::from_dotted([("w".to_owned(), Array::f32(vec![1], vec![value]).unwrap())])
    }

    #[test]
    fn damped_fedavg_moves_half_way_to_the_weighted_average_by_hand() {
        // FedAvg of 2 (1 sample) and 8 (3 samples) is 6.5; half way from 1 is 3.75.
        let (a, b) = (tree(2.0), tree(8.0));
        let updates = [(1, 1, &a), (2, 3, &b)].map(|(client_id, num_samples, tree)| ClientUpdate {
            client_id,
            num_samples,
            local_steps: 1,
            tree,
        });
        let ctx = RoundContext {
            round: 1,
            learning_rate: 0.1,
            per_round: 2,
            total_clients: 2,
        };
        let mut strategy = DampedFedAvg { damping: 0.5 };
        let next = strategy.aggregate(&ctx, &tree(1.0), &updates).unwrap();
        assert_eq!(next.model.unwrap(), tree(3.75));
        assert!(DampedFedAvg::from_options(Options { damping: 0.0 }).is_err());
    }
}
