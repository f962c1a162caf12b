//! Seeded model construction (`trainer.model_seed`).
//!
//! Every parameter is drawn from its own ChaCha8 stream derived from the model
//! seed and the parameter's path, with PyTorch's default initialization for
//! convolutions and linear layers (uniform in ±1/√fan_in for weights and
//! biases). Other leaves (BatchNorm's gamma, beta and running statistics) keep
//! the constructor's constants, as in PyTorch. Two trainers built
//! independently from the same seed start from identical parameters, and no
//! global RNG is touched.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use cohort_core::seeds::derive_seed;
use cohort_core::tree::{Array, ParamTree};

/// Fan-in of a weight in burn's layouts: convolution `[out, in, kh, kw]`,
/// linear `[in, out]`.
fn fan_in(shape: &[usize]) -> usize {
    match shape {
        [input, _output] => *input,
        [_out, rest @ ..] if !rest.is_empty() => rest.iter().product(),
        _ => 1,
    }
}

/// A tree with the schema of `template` and seeded values.
pub fn seeded_parameters(template: &ParamTree, seed: u64) -> ParamTree {
    let leaves = template.leaves();
    let weight_fan_in = |path: &str| -> Option<usize> {
        let layer = path.strip_suffix(".bias")?;
        leaves
            .iter()
            .find(|(p, _)| p.to_string() == format!("{layer}.weight"))
            .map(|(_, a)| fan_in(a.shape()))
    };
    ParamTree::from_dotted(leaves.iter().map(|(path, array)| {
        let name = path.to_string();
        if !(name.ends_with("weight") || name.ends_with("bias")) {
            return (name, (*array).clone());
        }
        let fan = weight_fan_in(&name)
            .unwrap_or_else(|| fan_in(array.shape()))
            .max(1);
        let bound = 1.0 / (fan as f32).sqrt();
        let mut rng =
            ChaCha8Rng::seed_from_u64(derive_seed(seed, &format!("model-init/{name}"), &[]));
        let values = (0..array.len())
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        (
            name,
            Array::f32(array.shape().to_vec(), values).expect("same shape as the template"),
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Net;
    use crate::params::extract;
    use cohort_core::config::ModelName;

    #[test]
    fn same_seed_same_parameters_other_seed_other_parameters() {
        let device = crate::device::cpu();
        let template_a = extract(&Net::build(ModelName::Lenet5, 10, &device));
        let template_b = extract(&Net::build(ModelName::Lenet5, 10, &device));
        assert_ne!(template_a, template_b, "unseeded construction differs");
        assert_eq!(
            seeded_parameters(&template_a, 17),
            seeded_parameters(&template_b, 17)
        );
        assert_ne!(
            seeded_parameters(&template_a, 17),
            seeded_parameters(&template_a, 18)
        );
    }

    #[test]
    fn bounds_follow_fan_in() {
        assert_eq!(fan_in(&[6, 1, 5, 5]), 25);
        assert_eq!(fan_in(&[120, 84]), 120);
        let device = crate::device::cpu();
        let tree = seeded_parameters(&extract(&Net::build(ModelName::Lenet5, 10, &device)), 1);
        for (path, array) in tree.leaves() {
            let max = array
                .as_f32()
                .unwrap()
                .iter()
                .fold(0.0f32, |m, x| m.max(x.abs()));
            if path.to_string() == "conv1.weight" || path.to_string() == "conv1.bias" {
                assert!(max <= 0.2, "{path}: {max}");
            }
        }
    }
}
