//! The models cohort ships: LeNet-class networks for `[1, 28, 28]` images.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use super::{
    Accelerated, FederatedModel, Inputs, LeNetVariant, ModelError, ModelSpec, Randomness,
    Stackable, batch_norm_relu, conv2d, max_pool2d,
};

/// The sample shape all three take: MNIST's.
const MNIST_SAMPLE: [usize; 3] = [1, 28, 28];

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

    /// For `spec`'s classes, refusing samples other than `[1, 28, 28]`.
    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        spec.require_sample_shape(&MNIST_SAMPLE)?;
        Ok(Self::new(spec.classes, device))
    }

    #[cfg(test)]
    pub(crate) fn fc5_for_tests(&self) -> &Linear {
        &self.fc5
    }

    pub fn logits(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.pool.forward(relu(self.conv1.forward(images)));
        let x = self.pool.forward(relu(self.conv2.forward(x)));
        let x = relu(self.conv3.forward(x)).flatten::<2>(1, 3);
        self.fc5.forward(relu(self.fc4.forward(x)))
    }
}

impl FederatedModel for LeNet5 {
    fn forward(&self, inputs: Inputs, _randomness: &mut Randomness<'_>) -> Tensor<2> {
        self.logits(inputs.images())
    }

    fn accelerated(&self) -> Option<Accelerated> {
        Some(Accelerated {
            net: Stackable::LeNet(LeNetVariant::Padded),
            classes: self.fc5.weight.val().dims()[1],
        })
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

    /// For `spec`'s classes, refusing samples other than `[1, 28, 28]`.
    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        spec.require_sample_shape(&MNIST_SAMPLE)?;
        Ok(Self::new(spec.classes, device))
    }

    pub fn logits(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.pool.forward(relu(self.conv1.forward(images)));
        let x = self
            .pool
            .forward(relu(self.conv2.forward(x)))
            .flatten::<2>(1, 3);
        let x = relu(self.fc3.forward(x));
        self.fc5.forward(relu(self.fc4.forward(x)))
    }
}

impl FederatedModel for LeNet5Compact {
    fn forward(&self, inputs: Inputs, _randomness: &mut Randomness<'_>) -> Tensor<2> {
        self.logits(inputs.images())
    }

    fn accelerated(&self) -> Option<Accelerated> {
        Some(Accelerated {
            net: Stackable::LeNet(LeNetVariant::Compact),
            classes: self.fc5.weight.val().dims()[1],
        })
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

    /// For `spec`'s classes, refusing samples other than `[1, 28, 28]`.
    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        spec.require_sample_shape(&MNIST_SAMPLE)?;
        Ok(Self::new(spec.classes, device))
    }
}

impl FederatedModel for CnnBn {
    fn forward(&self, inputs: Inputs, randomness: &mut Randomness<'_>) -> Tensor<2> {
        let x = batch_norm_relu(&self.bn1, conv2d(&self.conv1, inputs.images()));
        let x = max_pool2d(&self.pool, x);
        let x = batch_norm_relu(&self.bn2, conv2d(&self.conv2, x));
        let x = max_pool2d(&self.pool, x).flatten::<2>(1, 3);
        let x = relu(self.fc3.forward(x));
        let x = randomness.dropout(x, self.dropout);
        self.fc4.forward(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Module;

    fn spec(classes: usize) -> ModelSpec {
        ModelSpec::new(MNIST_SAMPLE.to_vec(), classes)
    }

    #[test]
    fn parameter_counts_match_the_reference_layouts() {
        let device = crate::device::cpu();
        assert_eq!(LeNet5::new(10, &device).num_params(), 61_706);
        assert_eq!(CnnBn::new(10, &device).num_params(), 207_018 + 96);
        assert_eq!(LeNet5Compact::new(10, &device).num_params(), 44_426);
    }

    #[test]
    fn forward_gives_one_logit_row_per_image() {
        let device = crate::device::cpu();
        let inputs = || Inputs::from_host(vec![0.0; 3 * 784], &MNIST_SAMPLE, &device);
        let mut none = Randomness::none();
        let outputs = [
            LeNet5::build(&spec(7), &device)
                .unwrap()
                .forward(inputs(), &mut none),
            LeNet5Compact::build(&spec(7), &device)
                .unwrap()
                .forward(inputs(), &mut none),
            CnnBn::build(&spec(7), &device)
                .unwrap()
                .forward(inputs(), &mut none),
        ];
        for logits in outputs {
            assert_eq!(logits.dims(), [3, 7]);
        }
    }

    #[test]
    fn other_sample_shapes_are_refused_naming_both() {
        let device = crate::device::cpu();
        let cifar = ModelSpec::new(vec![3, 32, 32], 10);
        let error = LeNet5::build(&cifar, &device).unwrap_err().to_string();
        assert!(
            error.contains("[1, 28, 28]") && error.contains("[3, 32, 32]"),
            "{error}"
        );
    }
}
