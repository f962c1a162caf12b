//! `resnet_20`: He et al.'s ResNet for CIFAR-10.
//!
//! Reference: He, Zhang, Ren and Sun, "Deep Residual Learning for Image
//! Recognition", CVPR 2016, §4.2: a 3×3 convolution to 16 channels, then 3
//! stages of n = 3 basic blocks with 16, 32 and 64 channels (the first block
//! of stages 2 and 3 halves the resolution with stride 2), global average
//! pooling and a linear layer: 6n + 2 = 20 layers, 0.27M parameters.
//! Shortcuts are the paper's option A for CIFAR (identity; where the width
//! doubles, the input subsampled and zero-padded, no parameters), as in
//! akamaster/pytorch_resnet_cifar10, the PyTorch version FL code bases
//! usually copy; Plato ships no ResNet-20, and cohort's `resnet_18` is
//! Plato's (option B). Layer names are that implementation's
//! (`conv1`, `bn1`, `layer{1,2,3}.{0,1,2}.{conv,bn}{1,2}`, `linear`).
//!
//! Options: `norm = "batch"` (default) or `"group"`, with `groups` (default
//! 2) for GroupNorm ([`NormKind`]). Any image size and channel count: the
//! global average pool makes the linear layer 64 wide whatever the size
//! (on 32×32, the paper's 8×8 average).

use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use super::blocks::{BasicBlock, Norm, NormKind, Shortcut, conv3x3, global_average};
use super::{
    Accelerated, FederatedModel, Inputs, ModelError, ModelSpec, Randomness, Stackable, conv2d,
};

/// Channels of the three stages.
const WIDTHS: [usize; 3] = [16, 32, 64];
/// Blocks per stage (n).
const BLOCKS: usize = 3;

/// See the module documentation.
#[derive(Module, Debug)]
pub struct ResNet20 {
    conv1: Conv2d,
    bn1: Norm,
    layer1: Vec<BasicBlock>,
    layer2: Vec<BasicBlock>,
    layer3: Vec<BasicBlock>,
    linear: Linear,
}

impl ResNet20 {
    pub fn new(channels: usize, classes: usize, norm: NormKind, device: &Device) -> Self {
        let stage = |input: usize, output: usize, stride: usize| -> Vec<BasicBlock> {
            (0..BLOCKS)
                .map(|i| {
                    let (input, stride) = if i == 0 { (input, stride) } else { (output, 1) };
                    BasicBlock::new(input, output, stride, norm, Shortcut::PadIdentity, device)
                })
                .collect()
        };
        let [a, b, c] = WIDTHS;
        Self {
            conv1: conv3x3(channels, a, 1, device),
            bn1: norm.init(a, device),
            layer1: stage(a, a, 1),
            layer2: stage(a, b, 2),
            layer3: stage(b, c, 2),
            linear: LinearConfig::new(c, classes).init(device),
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

impl FederatedModel for ResNet20 {
    fn forward(&self, inputs: Inputs, _randomness: &mut Randomness<'_>) -> Tensor<2> {
        let x = self.bn1.forward_relu(conv2d(&self.conv1, inputs.images()));
        let x = [&self.layer1, &self.layer2, &self.layer3]
            .into_iter()
            .flatten()
            .fold(x, |x, block| block.forward(x));
        self.linear.forward(global_average(x))
    }

    /// Stacked with GroupNorm; BatchNorm's running statistics are not.
    fn accelerated(&self) -> Option<Accelerated> {
        let Norm::Group(norm) = &self.bn1 else {
            return None;
        };
        Some(Accelerated {
            net: Stackable::ResNet20 {
                groups: norm.num_groups,
            },
            classes: self.linear.weight.val().dims()[1],
        })
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
    fn parameter_counts_are_he_et_al_s_by_hand() {
        let device = crate::device::cpu();
        // conv1 3·16·9 = 432, bn1 32; stage 1: 3 blocks of 2·(16·16·9) + 2·32 = 4,672
        // → 14,016; stage 2: 16·32·9 + 32·32·9 + 128 = 13,952, then 2 blocks of
        // 2·9,216 + 128 = 18,560 → 51,072; stage 3: 32·64·9 + 64·64·9 + 256 = 55,552,
        // then 2 of 2·36,864 + 256 = 73,984 → 203,520; linear 64·10 + 10 = 650.
        // Sum 269,722 (akamaster's count for ResNet-20).
        let group = ResNet20::build(&spec(&[3, 32, 32], "norm = \"group\""), &device).unwrap();
        assert_eq!(group.num_params(), 269_722);
        // BatchNorm adds a running mean and variance per channel: 16 (bn1) +
        // 6·16 + 6·32 + 6·64 = 688 channels, 1,376 statistics.
        let batch = ResNet20::build(&spec(&[3, 32, 32], ""), &device).unwrap();
        assert_eq!(batch.num_params(), 269_722 + 1_376);
    }

    #[test]
    fn forward_gives_one_row_per_image_for_either_norm_and_odd_sizes() {
        let device = crate::device::cpu();
        for (shape, options) in [
            ([3, 32, 32], ""),
            ([1, 28, 28], "norm = \"group\""),
            ([2, 9, 7], ""),
        ] {
            let model = ResNet20::build(&spec(&shape, options), &device).unwrap();
            let values = vec![0.1; 2 * shape.iter().product::<usize>()];
            let logits = model.forward(
                Inputs::from_host(values, &shape, &device),
                &mut Randomness::none(),
            );
            assert_eq!(logits.dims(), [2, 10], "{shape:?}");
        }
    }

    /// A leaf of `tree` by its PyTorch name.
    fn leaf(tree: &cohort_core::tree::ParamTree, name: &str) -> Vec<f32> {
        let leaves = tree.leaves();
        let (_, array) = leaves
            .iter()
            .find(|(path, _)| path.to_string() == name)
            .unwrap_or_else(|| panic!("no leaf {name}"));
        array.as_f32().unwrap().to_vec()
    }

    /// `tree` with every running statistic set to `value`.
    fn with_statistics(
        tree: &cohort_core::tree::ParamTree,
        value: f32,
    ) -> cohort_core::tree::ParamTree {
        cohort_core::tree::ParamTree::from_dotted(tree.leaves().into_iter().map(|(path, array)| {
            let name = path.to_string();
            let array = if name.ends_with("running_mean") || name.ends_with("running_var") {
                cohort_core::tree::Array::f32(array.shape().to_vec(), vec![value; array.len()])
                    .unwrap()
            } else {
                array.clone()
            };
            (name, array)
        }))
    }

    #[test]
    fn fedavg_averages_batchnorm_running_statistics_and_no_counter_travels() {
        use cohort_core::aggregate::{Contribution, FedAvgOutcome, fedavg};
        let device = crate::device::cpu();
        let model = ResNet20::build(&spec(&[3, 32, 32], ""), &device).unwrap();
        let global = crate::params::extract(&model);
        let names: Vec<String> = global.leaves().iter().map(|(p, _)| p.to_string()).collect();
        // 19 BatchNorm layers (bn1, two per block), each with both statistics
        // and no `num_batches_tracked`: cohort's BatchNorm keeps no counter.
        assert_eq!(
            names
                .iter()
                .filter(|n| n.ends_with(".running_mean"))
                .count(),
            19
        );
        assert_eq!(
            names.iter().filter(|n| n.ends_with(".running_var")).count(),
            19
        );
        assert!(!names.iter().any(|n| n.ends_with("num_batches_tracked")));
        // Two clients, 1 and 3 samples: the statistics are averaged by sample
        // count like every weight, (1·2 + 3·6) / 4 = 5.
        let (a, b) = (with_statistics(&global, 2.0), with_statistics(&global, 6.0));
        let contributions = [
            Contribution {
                client_id: 1,
                weight: 1.0,
                tree: &a,
            },
            Contribution {
                client_id: 2,
                weight: 3.0,
                tree: &b,
            },
        ];
        let FedAvgOutcome::Updated(averaged) = fedavg(&global, &contributions).unwrap() else {
            panic!("a positive total weight updates the model");
        };
        for name in [
            "bn1.running_mean",
            "layer2.0.bn1.running_var",
            "layer3.2.bn2.running_mean",
        ] {
            assert!(
                leaf(&averaged, name)
                    .iter()
                    .all(|&v| (v - 5.0).abs() < 1e-6),
                "{name}"
            );
        }
        // The average loads into the model and is what evaluation normalizes with.
        let loaded = crate::params::load(model, &averaged).unwrap();
        assert_eq!(crate::params::extract(&loaded), averaged);
        // A model file is a complete state_dict: a zero counter per BatchNorm.
        let file = cohort_core::layout::to_model_file(&averaged).expect("BatchNorm layers");
        let counters = file
            .leaves()
            .iter()
            .filter(|(p, _)| p.to_string().ends_with(".num_batches_tracked"))
            .count();
        assert_eq!(counters, 19);
        // GroupNorm has nothing of the kind.
        let group = ResNet20::build(&spec(&[3, 32, 32], "norm = \"group\""), &device).unwrap();
        assert!(cohort_core::layout::to_model_file(&crate::params::extract(&group)).is_none());
    }

    #[test]
    fn samples_that_are_not_images_and_bad_groups_are_refused() {
        let device = crate::device::cpu();
        let error = ResNet20::build(&spec(&[784], ""), &device).unwrap_err();
        assert!(error.to_string().contains("[784]"), "{error}");
        let error = ResNet20::build(&spec(&[3, 32, 32], "norm = \"group\"\ngroups = 3"), &device)
            .unwrap_err();
        assert!(
            error.to_string().contains("does not divide the 16"),
            "{error}"
        );
        let error = ResNet20::build(&spec(&[3, 32, 32], "groups = 4"), &device).unwrap_err();
        assert!(error.to_string().contains("norm = \"group\""), "{error}");
    }
}
