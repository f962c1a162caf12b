//! The model seam: what any burn module implements to take part in a
//! federation, and the models cohort ships.
//!
//! A model is a burn [`Module`] with a [`FederatedModel::forward`] from a batch
//! of the dataset's samples to one row of outputs per sample (logits over the
//! task's classes). Everything else a federation needs comes from the module
//! itself: its parameters travel as a tree in PyTorch's layout
//! ([`crate::params`], the one place that knows layouts), it is built from a
//! [`ModelSpec`] (the dataset's sample shape, the task's classes and the
//! model's options from `[parameters.model]`, [`ModelOptions`]) by the
//! function registered with it ([`crate::registry`]), and its initial
//! parameters come from the model seed ([`crate::init`]).
//!
//! Modes follow from where a model runs, as in burn: on an autodiff device
//! (the trainer's) BatchNorm normalizes by batch statistics and updates its
//! running statistics, and dropout drops; on a plain device (evaluation)
//! BatchNorm uses its running statistics and dropout is the identity. Dropout
//! draws its masks from the client's seeded stream ([`Randomness`]), never
//! from a global RNG.

mod blocks;
mod builtin;
mod cnn;
mod cnn_femnist;
mod lstm_shakespeare;
mod multilayer;
mod options;
mod resnet_18;
mod resnet_20;
mod vgg_11;

use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub use crate::kernels::{
    batch_norm, batch_norm_relu, conv2d, group_norm, group_norm_relu, linear, lstm, max_pool2d,
    tanh,
};
pub use blocks::{Norm, NormKind};
pub use builtin::{CnnBn, LeNet5, LeNet5Compact};
pub use cnn::Cnn;
pub use cnn_femnist::CnnFemnist;
pub use lstm_shakespeare::LstmShakespeare;
pub use multilayer::{Activation, Multilayer};
pub use options::ModelOptions;
pub use resnet_18::ResNet18;
pub use resnet_20::ResNet20;
pub use vgg_11::Vgg11;

/// A burn module that trains in a federation.
///
/// Implement `forward` and register a constructor
/// ([`crate::registry::Registry::add_model`]); training, evaluation,
/// aggregation, the wire format, checkpoints and model files then work for it
/// unchanged.
pub trait FederatedModel: Module + 'static {
    /// Outputs `[batch, classes]` for `inputs`. `randomness` is the client's
    /// training stream while training (for dropout) and empty in evaluation.
    fn forward(&self, inputs: Inputs, randomness: &mut Randomness<'_>) -> Tensor<2>;

    /// Which of cohort's own implementations computes exactly this model
    /// (the native CPU kernels, the vectorized GPU clients). Only cohort's
    /// built-in models can name one, so a model of your own always trains
    /// through burn.
    fn accelerated(&self) -> Option<Accelerated> {
        None
    }

    /// Rows of outputs per sample of `sample_shape`: 1 (a row of logits per
    /// sample) unless the model scores every position of a sequence, as a
    /// language model does. The task takes its targets from this
    /// ([`crate::task::Task::targets`]): next-token prediction learns the
    /// token after each position from a model of one row per position, and
    /// the token after the sequence from a model of one row per sample.
    fn rows_per_sample(&self, _sample_shape: &[usize]) -> usize {
        1
    }
}

/// What a model is built for: one sample's shape, the task's outputs and the
/// model's options.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// `[channels, height, width]` for images, `[features]` for tabular
    /// rows, `[length]` for token sequences.
    pub sample_shape: Vec<usize>,
    /// Outputs per sample: the classes of the task (the vocabulary of a
    /// next-token task).
    pub classes: usize,
    /// `[parameters.model]`'s keys beside `num_classes`, read by the
    /// model's constructor ([`ModelOptions`]).
    pub options: ModelOptions,
}

impl ModelSpec {
    /// For samples of `sample_shape` and `classes` outputs, without options.
    pub fn new(sample_shape: Vec<usize>, classes: usize) -> Self {
        Self {
            sample_shape,
            classes,
            options: ModelOptions::default(),
        }
    }

    /// The same spec with `options`.
    pub fn with_options(self, options: ModelOptions) -> Self {
        Self { options, ..self }
    }

    /// `[channels, height, width]` of image samples at least `min_side`
    /// pixels on each side, else the error naming what the model needs.
    pub fn require_images(&self, min_side: usize) -> Result<[usize; 3], ModelError> {
        match *self.sample_shape.as_slice() {
            [channels, height, width] if channels > 0 && height.min(width) >= min_side => {
                Ok([channels, height, width])
            }
            _ => Err(ModelError(format!(
                "takes images [channels, height, width] of at least {min_side}×{min_side} \
                 pixels, but the data set's samples are {:?}",
                self.sample_shape
            ))),
        }
    }

    /// `Ok` when the samples have `expected` shape, else the error a model
    /// built for one input shape gives.
    pub fn require_sample_shape(&self, expected: &[usize]) -> Result<(), ModelError> {
        if self.sample_shape == expected {
            Ok(())
        } else {
            Err(ModelError(format!(
                "takes samples of shape {expected:?}, but the data set's are {:?}",
                self.sample_shape
            )))
        }
    }
}

/// Why a model cannot be built for a [`ModelSpec`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ModelError(pub String);

/// A batch of samples on the model's device, `[batch, values per sample]`,
/// viewed in the shape the model asks for.
#[derive(Debug, Clone)]
pub struct Inputs {
    values: Tensor<2>,
    sample_shape: Vec<usize>,
}

impl Inputs {
    /// `values` is `[batch, product of sample_shape]`.
    pub fn new(values: Tensor<2>, sample_shape: Vec<usize>) -> Self {
        Self {
            values,
            sample_shape,
        }
    }

    /// Built from host values laid out as [`cohort_core::data::Dataset`]
    /// holds them.
    pub fn from_host(
        values: Vec<f32>,
        sample_shape: &[usize],
        device: &burn::tensor::Device,
    ) -> Self {
        let per_sample: usize = sample_shape.iter().product();
        let batch = values.len() / per_sample.max(1);
        let data = TensorData::new(values, [batch, per_sample]);
        Self::new(Tensor::from_data(data, device), sample_shape.to_vec())
    }

    pub fn batch_size(&self) -> usize {
        self.values.dims()[0]
    }

    pub fn sample_shape(&self) -> &[usize] {
        &self.sample_shape
    }

    /// `[batch, values per sample]`: feature vectors as they are.
    pub fn features(self) -> Tensor<2> {
        self.values
    }

    /// `[batch, channels, height, width]`.
    ///
    /// # Panics
    /// When samples are not `[channels, height, width]`: a model that reads
    /// images checks its [`ModelSpec`] when it is built.
    pub fn images(self) -> Tensor<4> {
        let &[channels, height, width] = self.sample_shape.as_slice() else {
            panic!(
                "images need samples of [channels, height, width], these are {:?}",
                self.sample_shape
            );
        };
        let batch = self.batch_size();
        self.values.reshape([batch, channels, height, width])
    }

    /// `[batch, length]` token ids (held as exact float32 integers).
    pub fn tokens(self) -> Tensor<2, Int> {
        self.values.int()
    }
}

/// The randomness a forward pass may use: the client's training stream while
/// training, nothing in evaluation.
pub struct Randomness<'a> {
    stream: Option<&'a mut ChaCha8Rng>,
}

impl<'a> Randomness<'a> {
    /// None: evaluation, or a caller that wants dropout off.
    pub fn none() -> Self {
        Self { stream: None }
    }

    pub(crate) fn from_stream(stream: &'a mut ChaCha8Rng) -> Self {
        Self {
            stream: Some(stream),
        }
    }

    /// The stream, while training.
    pub fn stream(&mut self) -> Option<&mut ChaCha8Rng> {
        self.stream.as_deref_mut()
    }

    /// Inverted dropout of `x` with drop probability `prob`, the mask drawn on
    /// the host from the training stream so that the dropped units depend only
    /// on the client, round and epoch. The identity in evaluation (no stream,
    /// or a plain device).
    pub fn dropout<const D: usize>(&mut self, x: Tensor<D>, prob: f64) -> Tensor<D> {
        let Some(rng) = self.stream.as_deref_mut() else {
            return x;
        };
        if !x.device().is_autodiff() {
            return x;
        }
        let dims = x.dims();
        let keep_scale = (1.0 / (1.0 - prob)) as f32;
        let mask: Vec<f32> = (0..dims.iter().product::<usize>())
            .map(|_| {
                if rng.random::<f64>() < prob {
                    0.0
                } else {
                    keep_scale
                }
            })
            .collect();
        let mask = Tensor::<D>::from_data(TensorData::new(mask, dims), &x.device());
        x * mask
    }
}

/// One of cohort's own implementations of a built-in model, with the
/// model's classes; made only inside this crate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accelerated {
    pub(crate) net: Stackable,
    pub(crate) classes: usize,
}

/// The built-in models the vectorized trainer stacks (the LeNets also have
/// native CPU kernels).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stackable {
    LeNet(LeNetVariant),
    /// McMahan et al.'s CNN (and LEAF's FEMNIST CNN) on one-channel images
    /// whose sides divide by 4, with `dense` units.
    Cnn {
        dense: usize,
    },
    /// A multilayer perceptron: `hidden` widths, tanh or ReLU after each.
    Multilayer {
        hidden: Vec<usize>,
        tanh: bool,
    },
    /// `resnet_20` with GroupNorm of `groups` groups, on images of any
    /// channels and size.
    ResNet20 {
        groups: usize,
    },
}

/// The LeNets the native kernels and the vectorized trainer implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeNetVariant {
    /// LeNet-5 with padding and conv3 (`lenet5`).
    Padded,
    /// Two conv stages without padding (`lenet5_compact`).
    Compact,
}
