//! `vgg_11`: VGG-11 (configuration A of Simonyan and Zisserman, ICLR 2015) as
//! Plato ships it for CIFAR.
//!
//! Reference: Plato's `plato/models/vgg.py`: the plan 64, M, 128, M, 256, 256,
//! M, 512, 512, M, 512, 512, where a number is a 3×3 convolution (padding 1,
//! with bias) followed by BatchNorm and ReLU, and M a 2×2 max pooling; then
//! average pooling to 512 features and one linear layer (no 4096-unit
//! classifier). Names are Plato's: the plan's positions in `layers` (an
//! `nn.Sequential`), `layers.{i}.conv` and `layers.{i}.bn`, pooling
//! positions holding no parameters, and `fc`.
//!
//! Plato pools the last 2×2 map with a 2×2 window, which gives its 512
//! features on 32×32 images only; here the pooling is global, the same on
//! 32×32 and defined for any image of at least 16×16 (four poolings).
//! Options: `norm` (`"batch"`, Plato's and the default, or `"group"`) and
//! `groups` ([`NormKind`]).

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::{Device, Tensor};

use super::blocks::{Norm, NormKind, global_average};
use super::{
    FederatedModel, Inputs, ModelError, ModelSpec, Randomness, conv2d, linear, max_pool2d,
};

/// VGG-11's plan: output channels of each convolution, `None` a pooling.
const PLAN: [Option<usize>; 12] = [
    Some(64),
    None,
    Some(128),
    None,
    Some(256),
    Some(256),
    None,
    Some(512),
    Some(512),
    None,
    Some(512),
    Some(512),
];

/// Convolution, normalization, ReLU (Plato's `ConvModule`).
#[derive(Module, Debug)]
pub struct ConvModule {
    conv: Conv2d,
    bn: Norm,
}

/// One position of the plan.
// Twelve of them per model: a pooling's unused bytes cost nothing, and a
// boxed convolution would be one more indirection burn's derive must follow.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum VggLayer {
    Conv(ConvModule),
    Pool(MaxPool2d),
}

/// See the module documentation.
#[derive(Module, Debug)]
pub struct Vgg11 {
    layers: Vec<VggLayer>,
    fc: Linear,
}

impl Vgg11 {
    pub fn new(channels: usize, classes: usize, norm: NormKind, device: &Device) -> Self {
        let mut input = channels;
        let layers = PLAN
            .iter()
            .map(|step| match *step {
                Some(output) => {
                    let conv = Conv2dConfig::new([input, output], [3, 3])
                        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                        .init(device);
                    input = output;
                    VggLayer::Conv(ConvModule {
                        conv,
                        bn: norm.init(output, device),
                    })
                }
                None => VggLayer::Pool(MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init()),
            })
            .collect();
        Self {
            layers,
            fc: LinearConfig::new(input, classes).init(device),
        }
    }

    /// For images of at least 16×16 pixels, `spec`'s classes and the
    /// options `norm` and `groups`.
    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        let widths: Vec<usize> = PLAN.iter().flatten().copied().collect();
        let norm = NormKind::from_spec(spec, &widths)?;
        let [channels, _, _] = spec.require_images(16)?;
        Ok(Self::new(channels, spec.classes, norm, device))
    }
}

impl FederatedModel for Vgg11 {
    fn forward(&self, inputs: Inputs, _randomness: &mut Randomness<'_>) -> Tensor<2> {
        let x = self
            .layers
            .iter()
            .fold(inputs.images(), |x, layer| match layer {
                VggLayer::Conv(module) => module.bn.forward_relu(conv2d(&module.conv, x)),
                VggLayer::Pool(pool) => max_pool2d(pool, x),
            });
        linear(&self.fc, global_average(x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_count_by_hand() {
        let device = crate::device::cpu();
        // Convolutions with bias: 1,792 + 73,856 + 295,168 + 590,080 + 1,180,160
        // + 3·2,359,808 = 9,220,480; BatchNorm weight and bias: 2·(64 + 128 + 256
        // + 256 + 512 + 3·512) = 5,504; fc 512·10 + 10 = 5,130: 9,231,114, and
        // 5,504 running statistics.
        let model = Vgg11::build(&ModelSpec::new(vec![3, 32, 32], 10), &device).unwrap();
        assert_eq!(model.num_params(), 9_231_114 + 5_504);
    }

    #[test]
    fn forward_gives_one_row_per_image() {
        let device = crate::device::cpu();
        let model = Vgg11::build(&ModelSpec::new(vec![1, 28, 28], 47), &device).unwrap();
        let inputs = Inputs::from_host(vec![0.1; 2 * 784], &[1, 28, 28], &device);
        assert_eq!(
            model.forward(inputs, &mut Randomness::none()).dims(),
            [2, 47]
        );
    }

    #[test]
    fn images_smaller_than_four_poolings_take_are_refused() {
        let device = crate::device::cpu();
        let error = Vgg11::build(&ModelSpec::new(vec![3, 15, 32], 10), &device).unwrap_err();
        assert!(error.to_string().contains("16×16"), "{error}");
    }
}
