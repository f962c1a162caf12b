//! `lstm_shakespeare`: LEAF's character model for Shakespeare.
//!
//! Reference: TalwalkarLab/leaf, `models/shakespeare/stacked_lstm.py` (Caldas
//! et al., "LEAF: A Benchmark for Federated Settings", 2018): characters
//! embedded in 8 dimensions (the embedding has a row per class: the
//! vocabulary is the classes), two stacked LSTM layers of 256 units, and a
//! dense layer from the last position's output to the vocabulary. The LSTM is
//! PyTorch's (`nn.LSTM`: gates i, f, g, o, two biases per layer, no forget
//! bias of 1 as TensorFlow's `BasicLSTMCell` adds), so the twin in
//! `examples/pytorch/models.py` is `Embedding`, `LSTM(8, 256, num_layers=2,
//! batch_first=True)` and `Linear`: `embedding.weight`, `lstm.weight_ih_l0`,
//! `lstm.weight_hh_l0`, `lstm.bias_ih_l0`, `lstm.bias_hh_l0` (and `_l1`),
//! `fc.weight`, `fc.bias`. burn keeps each gate as its own pair of linear
//! layers; `params.rs` stacks them into PyTorch's tensors and back.
//!
//! Samples are `[length]` token ids. Option `outputs`: `"last"` (LEAF's, the
//! default: one row per sample, for classification of the next character)
//! or `"every"` (a row per position, for next-token prediction).

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, Lstm, LstmConfig};
use burn::tensor::{Device, Tensor};

use super::{FederatedModel, Inputs, ModelError, ModelSpec, Randomness};

/// LEAF's embedding size.
const EMBEDDING: usize = 8;
/// LEAF's LSTM width and depth.
const HIDDEN: usize = 256;
const LAYERS: usize = 2;

/// See the module documentation.
#[derive(Module, Debug)]
pub struct LstmShakespeare {
    embedding: Embedding,
    /// One `nn.LSTM` of `LAYERS` layers in PyTorch's layout.
    lstm: Vec<Lstm>,
    fc: Linear,
    /// A row per position rather than for the last one.
    #[module(skip)]
    every_position: bool,
}

impl LstmShakespeare {
    pub fn new(vocabulary: usize, every_position: bool, device: &Device) -> Self {
        let lstm = (0..LAYERS)
            .map(|layer| {
                let input = if layer == 0 { EMBEDDING } else { HIDDEN };
                LstmConfig::new(input, HIDDEN, true)
                    .with_batch_first(true)
                    .init(device)
            })
            .collect();
        Self {
            embedding: EmbeddingConfig::new(vocabulary, EMBEDDING).init(device),
            lstm,
            fc: LinearConfig::new(HIDDEN, vocabulary).init(device),
            every_position,
        }
    }

    /// For `[length]` token sequences over `spec`'s classes (the
    /// vocabulary), with the option `outputs`.
    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        let outputs = spec.options.choice("outputs", &["last", "every"], "last")?;
        match spec.sample_shape.as_slice() {
            [length] if *length > 0 => Ok(Self::new(spec.classes, outputs == "every", device)),
            _ => Err(ModelError(format!(
                "takes token sequences [length], but the data set's samples are {:?}",
                spec.sample_shape
            ))),
        }
    }
}

impl FederatedModel for LstmShakespeare {
    fn forward(&self, inputs: Inputs, _randomness: &mut Randomness<'_>) -> Tensor<2> {
        let x = self.embedding.forward(inputs.tokens());
        let x = self.lstm.iter().fold(x, |x, layer| super::lstm(layer, x));
        let [batch, length, hidden] = x.dims();
        let x = if self.every_position {
            x.reshape([batch * length, hidden])
        } else {
            x.slice([0..batch, length - 1..length, 0..hidden])
                .reshape([batch, hidden])
        };
        super::linear(&self.fc, x)
    }

    fn rows_per_sample(&self, sample_shape: &[usize]) -> usize {
        if self.every_position {
            sample_shape.iter().product()
        } else {
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelOptions;

    fn spec(length: usize, options: &str) -> ModelSpec {
        let table: toml::Table = options.parse().unwrap();
        ModelSpec::new(vec![length], 80)
            .with_options(ModelOptions::new(table.into_iter().collect()))
    }

    #[test]
    fn parameter_count_by_hand() {
        let device = crate::device::cpu();
        // Embedding 80·8 = 640; layer 0: 4·256·(8 + 256) + 2·4·256 = 272,384;
        // layer 1: 4·256·(256 + 256) + 2·4·256 = 526,336; fc 256·80 + 80 = 20,560:
        // 819,920.
        let model = LstmShakespeare::build(&spec(80, ""), &device).unwrap();
        assert_eq!(model.num_params(), 819_920);
        let tree = crate::params::extract(&model);
        assert_eq!(tree.num_elements(), 819_920);
        let shapes: Vec<(String, Vec<usize>)> = tree
            .leaves()
            .iter()
            .map(|(p, a)| (p.to_string(), a.shape().to_vec()))
            .collect();
        assert!(
            shapes.contains(&("lstm.weight_ih_l0".to_owned(), vec![1024, 8])),
            "{shapes:?}"
        );
        assert!(
            shapes.contains(&("lstm.weight_hh_l1".to_owned(), vec![1024, 256])),
            "{shapes:?}"
        );
        assert!(
            shapes.contains(&("lstm.bias_ih_l1".to_owned(), vec![1024])),
            "{shapes:?}"
        );
        assert_eq!(shapes.len(), 11, "{shapes:?}");
    }

    #[test]
    fn forward_gives_a_row_per_sample_or_per_position() {
        let device = crate::device::cpu();
        let tokens: Vec<f32> = (0..3 * 5).map(|i| (i % 80) as f32).collect();
        for (options, rows) in [("", 3), ("outputs = \"every\"", 15)] {
            let model = LstmShakespeare::build(&spec(5, options), &device).unwrap();
            let inputs = Inputs::from_host(tokens.clone(), &[5], &device);
            assert_eq!(
                model.forward(inputs, &mut Randomness::none()).dims(),
                [rows, 80]
            );
        }
    }

    #[test]
    fn images_are_refused() {
        let device = crate::device::cpu();
        let error =
            LstmShakespeare::build(&ModelSpec::new(vec![1, 28, 28], 80), &device).unwrap_err();
        assert!(error.to_string().contains("[1, 28, 28]"), "{error}");
    }

    #[test]
    fn the_tree_loads_back_gate_by_gate() {
        let device = crate::device::cpu();
        let a = LstmShakespeare::build(&spec(4, ""), &device).unwrap();
        let tree = crate::params::extract(&a);
        let b = LstmShakespeare::build(&spec(4, ""), &device).unwrap();
        assert_ne!(crate::params::extract(&b), tree);
        let b = crate::params::load(b, &tree).unwrap();
        assert_eq!(crate::params::extract(&b), tree);
    }
}
