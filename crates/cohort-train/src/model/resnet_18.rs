//! `resnet_18`: ResNet-18 with a CIFAR-style stem, as Plato ships it.
//!
//! Reference: Plato's `plato/models/resnet.py` (after kuangliu/pytorch-cifar),
//! He et al. 2016's ResNet-18 for 32×32 images: a 3×3 convolution to 64
//! channels with stride 1 and no max pooling (ImageNet's 7×7 stride-2 stem and
//! pooling would leave CIFAR's images 8×8 before the first block), then 4
//! stages of 2 basic blocks with 64, 128, 256 and 512 channels (stages 2–4
//! start with stride 2), shortcuts of option B where width or resolution
//! changes (1×1 convolution and normalization, `shortcut.0`/`shortcut.1`),
//! average pooling and a linear layer; 11,173,962 parameters for 10 classes.
//! Names are Plato's (`conv1`, `bn1`, `layer{1..4}.{0,1}.…`, `linear`), so
//! a Plato `resnet_18` `state_dict` with BatchNorm has the same keys.
//!
//! Plato pools with a fixed 4×4 window, which gives its 512 features on
//! 32×32 images only; here the pooling is global, the same on 32×32 and
//! defined for any size. Options: `norm` (`"batch"`, default, or
//! `"group"`) and `groups` ([`NormKind`]).

use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use super::blocks::{BasicBlock, Norm, NormKind, Shortcut, conv3x3, global_average};
use super::{FederatedModel, Inputs, ModelError, ModelSpec, Randomness, conv2d};

/// Channels of the four stages.
const WIDTHS: [usize; 4] = [64, 128, 256, 512];
/// Blocks per stage.
const BLOCKS: usize = 2;

/// See the module documentation.
#[derive(Module, Debug)]
pub struct ResNet18 {
    conv1: Conv2d,
    bn1: Norm,
    layer1: Vec<BasicBlock>,
    layer2: Vec<BasicBlock>,
    layer3: Vec<BasicBlock>,
    layer4: Vec<BasicBlock>,
    linear: Linear,
}

impl ResNet18 {
    pub fn new(channels: usize, classes: usize, norm: NormKind, device: &Device) -> Self {
        let stage = |input: usize, output: usize, stride: usize| -> Vec<BasicBlock> {
            (0..BLOCKS)
                .map(|i| {
                    let (input, stride) = if i == 0 { (input, stride) } else { (output, 1) };
                    BasicBlock::new(input, output, stride, norm, Shortcut::Projection, device)
                })
                .collect()
        };
        let [a, b, c, d] = WIDTHS;
        Self {
            conv1: conv3x3(channels, a, 1, device),
            bn1: norm.init(a, device),
            layer1: stage(a, a, 1),
            layer2: stage(a, b, 2),
            layer3: stage(b, c, 2),
            layer4: stage(c, d, 2),
            linear: LinearConfig::new(d, classes).init(device),
        }
    }

    /// For images of any channels and size, `spec`'s classes and the
    /// options `norm` and `groups`.
    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        let norm = NormKind::from_spec(spec, &WIDTHS)?;
        let [channels, _, _] = spec.require_images(1)?;
        Ok(Self::new(channels, spec.classes, norm, device))
    }
}

impl FederatedModel for ResNet18 {
    fn forward(&self, inputs: Inputs, _randomness: &mut Randomness<'_>) -> Tensor<2> {
        let x = self.bn1.forward_relu(conv2d(&self.conv1, inputs.images()));
        let x = [&self.layer1, &self.layer2, &self.layer3, &self.layer4]
            .into_iter()
            .flatten()
            .fold(x, |x, block| block.forward(x));
        self.linear.forward(global_average(x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelOptions;

    fn spec(shape: &[usize], options: &str) -> ModelSpec {
        let table: toml::Table = options.parse().unwrap();
        ModelSpec::new(shape.to_vec(), 10)
            .with_options(ModelOptions::new(table.into_iter().collect()))
    }

    #[test]
    fn parameter_counts_are_plato_s_by_hand() {
        let device = crate::device::cpu();
        // conv1 3·64·9 = 1,728, bn1 128; layer1 2·(2·36,864 + 256) = 147,968;
        // layer2 (73,728 + 147,456 + 512 + 8,192 + 256) + (2·147,456 + 512) = 525,568;
        // layer3 (294,912 + 589,824 + 1,024 + 32,768 + 512) + (2·589,824 + 1,024)
        // = 2,099,712; layer4 (1,179,648 + 2,359,296 + 2,048 + 131,072 + 1,024)
        // + (2·2,359,296 + 2,048) = 8,393,728; linear 5,130: 11,173,962.
        let group = ResNet18::build(&spec(&[3, 32, 32], "norm = \"group\""), &device).unwrap();
        assert_eq!(group.num_params(), 11_173_962);
        // Running statistics of 64 + 4·64 + 5·128 + 5·256 + 5·512 = 4,800 channels.
        let batch = ResNet18::build(&spec(&[3, 32, 32], ""), &device).unwrap();
        assert_eq!(batch.num_params(), 11_173_962 + 9_600);
    }

    #[test]
    fn forward_gives_one_row_per_image() {
        let device = crate::device::cpu();
        let model = ResNet18::build(&spec(&[1, 28, 28], "norm = \"group\""), &device).unwrap();
        let inputs = Inputs::from_host(vec![0.1; 2 * 784], &[1, 28, 28], &device);
        assert_eq!(
            model.forward(inputs, &mut Randomness::none()).dims(),
            [2, 10]
        );
    }

    #[test]
    fn feature_vectors_and_groups_that_do_not_divide_are_refused() {
        let device = crate::device::cpu();
        let error = ResNet18::build(&spec(&[600], ""), &device).unwrap_err();
        assert!(error.to_string().contains("[600]"), "{error}");
        let error = ResNet18::build(
            &spec(&[3, 32, 32], "norm = \"group\"\ngroups = 48"),
            &device,
        )
        .unwrap_err();
        assert!(
            error.to_string().contains("does not divide the 64"),
            "{error}"
        );
    }
}
