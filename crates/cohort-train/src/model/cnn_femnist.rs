//! `cnn_femnist`: LEAF's FEMNIST CNN.
//!
//! Reference: TalwalkarLab/leaf, `models/femnist/cnn.py` (Caldas et al.,
//! "LEAF: A Benchmark for Federated Settings", 2018): conv 5×5 to 32
//! channels, "same" padding, ReLU, 2×2 max pooling; conv 5×5 to 64, same,
//! ReLU, 2×2 max pooling; dense 2048 with ReLU; dense to the classes (62 for
//! FEMNIST). That is McMahan et al.'s CNN with a wider dense layer, so the
//! model is [`Cnn`] built with 2048 units: same layer names (`conv1`, `conv2`,
//! `fc1`, `fc2`), same input rules (any channels, at least 4×4 pixels).
//! LEAF's TensorFlow layout (`[h, w, in, out]` kernels) is not cohort's: the
//! files are PyTorch's, as for every model.

use burn::tensor::Device;

use super::cnn::Cnn;
use super::{ModelError, ModelSpec};

/// Builds LEAF's FEMNIST CNN, a [`Cnn`] with a 2048-unit dense layer.
pub struct CnnFemnist;

impl CnnFemnist {
    /// LEAF's dense width.
    pub const DENSE: usize = 2048;

    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Cnn, ModelError> {
        Cnn::with_dense(spec, Self::DENSE, device)
    }
}

#[cfg(test)]
mod tests {
    use burn::module::Module;

    use super::*;
    use crate::model::{FederatedModel, Inputs, Randomness};

    #[test]
    fn parameter_count_for_femnist_by_hand() {
        let device = crate::device::cpu();
        // conv1 832, conv2 51,264 (as `cnn`); fc1 (64·7·7)·2048 + 2048 = 6,424,576;
        // fc2 2048·62 + 62 = 127,038: 6,603,710.
        let femnist = ModelSpec::new(vec![1, 28, 28], 62);
        assert_eq!(
            CnnFemnist::build(&femnist, &device).unwrap().num_params(),
            6_603_710
        );
    }

    #[test]
    fn forward_gives_a_row_of_the_data_set_s_classes_per_image() {
        let device = crate::device::cpu();
        let model = CnnFemnist::build(&ModelSpec::new(vec![1, 28, 28], 62), &device).unwrap();
        let inputs = Inputs::from_host(vec![0.0; 2 * 784], &[1, 28, 28], &device);
        assert_eq!(
            model.forward(inputs, &mut Randomness::none()).dims(),
            [2, 62]
        );
    }

    #[test]
    fn feature_vectors_are_refused() {
        let device = crate::device::cpu();
        let error = CnnFemnist::build(&ModelSpec::new(vec![784], 62), &device).unwrap_err();
        assert!(error.to_string().contains("[784]"), "{error}");
    }
}
