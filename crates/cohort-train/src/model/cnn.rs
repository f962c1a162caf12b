//! `cnn`: the CNN of McMahan et al., "Communication-Efficient Learning of
//! Deep Networks from Decentralized Data" (AISTATS 2017), §3: two 5×5
//! convolutions of 32 and 64 channels, each followed by 2×2 max pooling, a
//! dense layer of 512 units with ReLU and a linear output layer; 1,663,370
//! parameters on MNIST, which fixes the convolutions' padding as "same" (2).
//!
//! The same network with a 2048-unit dense layer is LEAF's FEMNIST CNN
//! (`cnn_femnist`, `cnn_femnist.rs`), so both are this type.
//!
//! Any channel count and image size of at least 4×4 (two poolings); the dense
//! layer's inputs are `64 · ⌊h/4⌋ · ⌊w/4⌋`, as PyTorch's floor-mode pooling
//! gives. Names: `conv1`, `conv2`, `fc1`, `fc2`.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use super::{
    Accelerated, FederatedModel, Inputs, ModelError, ModelSpec, Randomness, Stackable, conv2d,
    linear, max_pool2d,
};

/// See the module documentation.
#[derive(Module, Debug)]
pub struct Cnn {
    conv1: Conv2d,
    conv2: Conv2d,
    fc1: Linear,
    fc2: Linear,
    pool: MaxPool2d,
    /// `[channels, height, width]` of the images it was built for.
    #[module(skip)]
    image: [usize; 3],
}

impl Cnn {
    /// McMahan et al.'s dense width.
    pub const DENSE: usize = 512;

    /// For `[channels, height, width]` images, `dense` units and `classes`.
    pub fn new(image: [usize; 3], dense: usize, classes: usize, device: &Device) -> Self {
        let [channels, height, width] = image;
        let same = || PaddingConfig2d::Explicit(2, 2, 2, 2);
        Self {
            conv1: Conv2dConfig::new([channels, 32], [5, 5])
                .with_padding(same())
                .init(device),
            conv2: Conv2dConfig::new([32, 64], [5, 5])
                .with_padding(same())
                .init(device),
            fc1: LinearConfig::new(64 * (height / 4) * (width / 4), dense).init(device),
            fc2: LinearConfig::new(dense, classes).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            image,
        }
    }

    /// For `spec`'s images (at least 4×4) and classes, with `dense` units.
    pub fn with_dense(spec: &ModelSpec, dense: usize, device: &Device) -> Result<Self, ModelError> {
        let image = spec.require_images(4)?;
        Ok(Self::new(image, dense, spec.classes, device))
    }

    /// McMahan et al.'s CNN for `spec`.
    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        Self::with_dense(spec, Self::DENSE, device)
    }
}

impl FederatedModel for Cnn {
    fn forward(&self, inputs: Inputs, _randomness: &mut Randomness<'_>) -> Tensor<2> {
        // ReLU after the pooling: both take maxima, so they commute (the
        // same values and gradients as the twin's ReLU-then-pool, windows
        // without padding), and the ReLU passes over a quarter of the values.
        let x = relu(max_pool2d(&self.pool, conv2d(&self.conv1, inputs.images())));
        let x = relu(max_pool2d(&self.pool, conv2d(&self.conv2, x))).flatten::<2>(1, 3);
        linear(&self.fc2, relu(linear(&self.fc1, x)))
    }

    /// Stacked for one-channel images whose sides divide by 4 (the stacked
    /// pooling has no floor mode to drop an odd row).
    fn accelerated(&self) -> Option<Accelerated> {
        let [channels, height, width] = self.image;
        (channels == 1 && height % 4 == 0 && width % 4 == 0).then(|| Accelerated {
            net: Stackable::Cnn {
                dense: self.fc1.weight.val().dims()[1],
            },
            classes: self.fc2.weight.val().dims()[1],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_count_is_mcmahan_et_al_s() {
        let device = crate::device::cpu();
        // conv1 32·25 + 32 = 832; conv2 64·32·25 + 64 = 51,264;
        // fc1 (64·7·7)·512 + 512 = 1,606,144; fc2 512·10 + 10 = 5,130:
        // 1,663,370, the paper's count.
        let mnist = ModelSpec::new(vec![1, 28, 28], 10);
        assert_eq!(Cnn::build(&mnist, &device).unwrap().num_params(), 1_663_370);
    }

    #[test]
    fn forward_gives_one_row_per_image_for_odd_sizes_too() {
        let device = crate::device::cpu();
        for shape in [[1, 28, 28], [3, 33, 30]] {
            let model = Cnn::build(&ModelSpec::new(shape.to_vec(), 7), &device).unwrap();
            let values = vec![0.2; 3 * shape.iter().product::<usize>()];
            let logits = model.forward(
                Inputs::from_host(values, &shape, &device),
                &mut Randomness::none(),
            );
            assert_eq!(logits.dims(), [3, 7], "{shape:?}");
        }
    }

    #[test]
    fn images_too_small_to_pool_twice_and_non_images_are_refused() {
        let device = crate::device::cpu();
        for shape in [vec![1, 3, 28], vec![784]] {
            let error = Cnn::build(&ModelSpec::new(shape.clone(), 10), &device).unwrap_err();
            assert!(error.to_string().contains(&format!("{shape:?}")), "{error}");
        }
    }
}
