//! The models cohort trains. Each is a burn module with a `forward` from a batch
//! of `[batch, 1, 28, 28]` images to `[batch, classes]` logits.
//!
//! Modes follow from where a model runs, as in burn: on an autodiff device
//! (the trainer's) BatchNorm normalizes by batch statistics and updates its
//! running statistics, and dropout drops; on a plain device (evaluation)
//! BatchNorm uses its running statistics and dropout is the identity. Dropout
//! draws its masks from the caller's seeded stream, never from a global RNG.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use cohort_core::config::ModelName;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Classic LeNet-5, the layout of Plato's PyTorch model (61,706 parameters):
/// conv 1→6 5×5 pad 2, ReLU, max-pool 2; conv 6→16 5×5, ReLU, max-pool 2;
/// conv 16→120 5×5, ReLU; linear 120→84, ReLU; linear 84→10.
#[derive(Module, Debug)]
pub struct LeNet5 {
    conv1: Conv2d,
    conv2: Conv2d,
    conv3: Conv2d,
    fc4: Linear,
    fc5: Linear,
    pool: MaxPool2d,
}

impl LeNet5 {
    pub fn new(num_classes: usize, device: &Device) -> Self {
        Self {
            conv1: Conv2dConfig::new([1, 6], [5, 5])
                .with_padding(PaddingConfig2d::Explicit(2, 2, 2, 2))
                .init(device),
            conv2: Conv2dConfig::new([6, 16], [5, 5]).init(device),
            conv3: Conv2dConfig::new([16, 120], [5, 5]).init(device),
            fc4: LinearConfig::new(120, 84).init(device),
            fc5: LinearConfig::new(84, num_classes).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
        }
    }

    #[cfg(test)]
    pub(crate) fn fc5_for_tests(&self) -> &Linear {
        &self.fc5
    }

    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.pool.forward(relu(self.conv1.forward(images)));
        let x = self.pool.forward(relu(self.conv2.forward(x)));
        let x = relu(self.conv3.forward(x)).flatten::<2>(1, 3);
        self.fc5.forward(relu(self.fc4.forward(x)))
    }
}

/// The seed's compact variant without padding (44,426 parameters): two
/// conv/pool stages to 16·4·4 = 256 features, then 256→120→84→10.
#[derive(Module, Debug)]
pub struct LeNet5Compact {
    conv1: Conv2d,
    conv2: Conv2d,
    fc3: Linear,
    fc4: Linear,
    fc5: Linear,
    pool: MaxPool2d,
}

impl LeNet5Compact {
    pub fn new(num_classes: usize, device: &Device) -> Self {
        Self {
            conv1: Conv2dConfig::new([1, 6], [5, 5]).init(device),
            conv2: Conv2dConfig::new([6, 16], [5, 5]).init(device),
            fc3: LinearConfig::new(256, 120).init(device),
            fc4: LinearConfig::new(120, 84).init(device),
            fc5: LinearConfig::new(84, num_classes).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
        }
    }

    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.pool.forward(relu(self.conv1.forward(images)));
        let x = self
            .pool
            .forward(relu(self.conv2.forward(x)))
            .flatten::<2>(1, 3);
        let x = relu(self.fc3.forward(x));
        self.fc5.forward(relu(self.fc4.forward(x)))
    }
}

/// A small CNN with BatchNorm and dropout (207,018 parameters and 96 running
/// statistics): conv 1→16 3×3 pad 1, BatchNorm, ReLU, max-pool 2; conv 16→32
/// 3×3 pad 1, BatchNorm, ReLU, max-pool 2; linear 1568→128, ReLU, dropout 0.5;
/// linear 128→10. BatchNorm's running mean and variance travel in the
/// parameter tree (as in a PyTorch `state_dict`), so FedAvg averages them too.
#[derive(Module, Debug)]
pub struct CnnBn {
    conv1: Conv2d,
    bn1: BatchNorm,
    conv2: Conv2d,
    bn2: BatchNorm,
    fc3: Linear,
    fc4: Linear,
    pool: MaxPool2d,
    dropout: f64,
}

impl CnnBn {
    pub fn new(num_classes: usize, device: &Device) -> Self {
        let same = || PaddingConfig2d::Explicit(1, 1, 1, 1);
        Self {
            conv1: Conv2dConfig::new([1, 16], [3, 3])
                .with_padding(same())
                .init(device),
            bn1: BatchNormConfig::new(16).init(device),
            conv2: Conv2dConfig::new([16, 32], [3, 3])
                .with_padding(same())
                .init(device),
            bn2: BatchNormConfig::new(32).init(device),
            fc3: LinearConfig::new(32 * 7 * 7, 128).init(device),
            fc4: LinearConfig::new(128, num_classes).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            dropout: 0.5,
        }
    }

    pub fn forward(&self, images: Tensor<4>, dropout: Option<&mut ChaCha8Rng>) -> Tensor<2> {
        let x = self
            .pool
            .forward(relu(self.bn1.forward(self.conv1.forward(images))));
        let x = self
            .pool
            .forward(relu(self.bn2.forward(self.conv2.forward(x))))
            .flatten::<2>(1, 3);
        let x = relu(self.fc3.forward(x));
        let x = match dropout {
            Some(rng) if x.device().is_autodiff() => seeded_dropout(x, self.dropout, rng),
            _ => x,
        };
        self.fc4.forward(x)
    }
}

/// Inverted dropout with a mask drawn on the host from `rng`, so the dropped
/// units depend only on the client's training stream.
fn seeded_dropout(x: Tensor<2>, prob: f64, rng: &mut ChaCha8Rng) -> Tensor<2> {
    let dims = x.dims();
    let keep_scale = (1.0 / (1.0 - prob)) as f32;
    let mask: Vec<f32> = (0..dims[0] * dims[1])
        .map(|_| {
            if rng.random::<f64>() < prob {
                0.0
            } else {
                keep_scale
            }
        })
        .collect();
    let mask = Tensor::<2>::from_data(TensorData::new(mask, dims), &x.device());
    x * mask
}

/// Any model cohort can train, chosen by `trainer.model_name`.
// One `Net` per worker, built once and moved by value only between rounds:
// boxing the variants would buy nothing measurable.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Net {
    LeNet5(LeNet5),
    LeNet5Compact(LeNet5Compact),
    CnnBn(CnnBn),
}

impl Net {
    /// The model `trainer.model_name` names, freshly initialized.
    pub fn build(model: ModelName, num_classes: usize, device: &Device) -> Self {
        match model {
            ModelName::Lenet5 => Net::LeNet5(LeNet5::new(num_classes, device)),
            ModelName::Lenet5Compact => Net::LeNet5Compact(LeNet5Compact::new(num_classes, device)),
            ModelName::CnnBn => Net::CnnBn(CnnBn::new(num_classes, device)),
        }
    }

    /// Which model this is.
    pub fn name(&self) -> ModelName {
        match self {
            Net::LeNet5(_) => ModelName::Lenet5,
            Net::LeNet5Compact(_) => ModelName::Lenet5Compact,
            Net::CnnBn(_) => ModelName::CnnBn,
        }
    }

    /// Logits. `dropout` is the stream dropout masks come from while training;
    /// evaluation passes `None` (and runs on a plain device, so dropout is off
    /// either way).
    pub fn forward(&self, images: Tensor<4>, dropout: Option<&mut ChaCha8Rng>) -> Tensor<2> {
        match self {
            Net::LeNet5(model) => model.forward(images),
            Net::LeNet5Compact(model) => model.forward(images),
            Net::CnnBn(model) => model.forward(images, dropout),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_the_reference_layouts() {
        let device = crate::device::cpu();
        assert_eq!(
            Net::build(ModelName::Lenet5, 10, &device).num_params(),
            61_706
        );
        assert_eq!(
            Net::build(ModelName::CnnBn, 10, &device).num_params(),
            207_018 + 96
        );
        assert_eq!(
            Net::build(ModelName::Lenet5Compact, 10, &device).num_params(),
            44_426
        );
    }

    #[test]
    fn forward_gives_one_logit_row_per_image() {
        let device = crate::device::cpu();
        for name in ModelName::all() {
            let model = Net::build(name, 10, &device);
            let logits = model.forward(Tensor::zeros([3, 1, 28, 28], &device), None);
            assert_eq!(logits.dims(), [3, 10], "{name}");
        }
    }

    #[test]
    fn every_model_name_is_built() {
        assert_eq!(ModelName::all().len(), 3);
        let error = "resnet".parse::<ModelName>().unwrap_err();
        assert!(error.contains("lenet5_compact"), "{error}");
    }
}
