//! Seeded model construction (`trainer.model_seed`).
//!
//! Every parameter is drawn from its own ChaCha8 stream derived from the model
//! seed and the parameter's path, with PyTorch's default initialization for
//! convolutions and linear layers (uniform in ±1/√fan_in for weights and
//! biases) and LSTMs (±1/√hidden). Other leaves (BatchNorm's weight, bias and running statistics)
//! keep the constructor's constants, as in PyTorch. Two trainers built
//! independently from the same seed start from identical parameters, and no
//! global RNG is touched.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use cohort_core::seeds::derive_seed;
use cohort_core::tree::{Array, ParamTree};

/// Fan-in of a convolution (`[out, in, kh, kw]`) or linear (`[out, in]`)
/// weight in PyTorch's layout; `None` for one-dimensional weights (BatchNorm),
/// which are not drawn.
fn fan_in(shape: &[usize]) -> Option<usize> {
    match shape {
        [_out, rest @ ..] if !rest.is_empty() => Some(rest.iter().product()),
        _ => None,
    }
}

/// The hidden size of an `nn.LSTM` tensor (`weight_ih_l0`, `bias_hh_l1`, …:
/// `[4·hidden, …]`), whose weights and biases PyTorch draws in
/// ±1/√hidden; `None` for other leaves.
fn lstm_hidden(name: &str, shape: &[usize]) -> Option<usize> {
    let last = name.rsplit('.').next()?;
    let lstm = ["weight_ih_l", "weight_hh_l", "bias_ih_l", "bias_hh_l"]
        .iter()
        .any(|prefix| last.starts_with(prefix));
    lstm.then(|| shape.first().map(|rows| rows / 4))?
}

/// A tree with the schema of `template` (PyTorch's layout) and seeded values.
pub fn seeded_parameters(template: &ParamTree, seed: u64) -> ParamTree {
    let leaves = template.leaves();
    let layer_fan_in = |name: &str| -> Option<usize> {
        let layer = name
            .strip_suffix(".weight")
            .or_else(|| name.strip_suffix(".bias"))?;
        leaves
            .iter()
            .find(|(p, _)| p.to_string() == format!("{layer}.weight"))
            .and_then(|(_, a)| fan_in(a.shape()))
    };
    ParamTree::from_dotted(leaves.iter().map(|(path, array)| {
        let name = path.to_string();
        let Some(fan) = lstm_hidden(&name, array.shape()).or_else(|| layer_fan_in(&name)) else {
            return (name, (*array).clone());
        };
        let bound = 1.0 / (fan.max(1) as f32).sqrt();
        let mut rng =
            ChaCha8Rng::seed_from_u64(derive_seed(seed, &format!("model-init/{name}"), &[]));
        let mut values: Vec<f32> = (0..array.len())
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        // Linear weights are drawn in [in, out] order, the order cohort drew
        // them in before it used PyTorch's layout, so a seed gives the same
        // model (and runs the same results) as it always did.
        if let &[output, input] = array.shape() {
            let mut transposed = vec![0.0; values.len()];
            for i in 0..input {
                for o in 0..output {
                    transposed[o * input + i] = values[i * output + o];
                }
            }
            values = transposed;
        }
        (
            name,
            Array::f32(array.shape().to_vec(), values).expect("same shape as the template"),
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LeNet5;
    use crate::params::extract;

    #[test]
    fn lstm_tensors_are_seeded_within_pytorchs_bound() {
        use crate::model::{LstmShakespeare, ModelSpec};
        let device = crate::device::cpu();
        let spec = ModelSpec::new(vec![4], 80);
        let template = extract(&LstmShakespeare::build(&spec, &device).unwrap());
        let a = seeded_parameters(&template, 3);
        assert_eq!(
            a,
            seeded_parameters(
                &extract(&LstmShakespeare::build(&spec, &device).unwrap()),
                3
            )
        );
        let leaves = a.leaves();
        let (_, hh) = leaves
            .iter()
            .find(|(p, _)| p.to_string() == "lstm.bias_hh_l1")
            .unwrap();
        let values = hh.as_f32().unwrap();
        // 1/√256 = 0.0625; drawn, not the constructor's values.
        assert!(values.iter().all(|v| v.abs() < 0.0625), "{values:?}");
        let (_, old) = template
            .leaves()
            .into_iter()
            .find(|(p, _)| p.to_string() == "lstm.bias_hh_l1")
            .unwrap();
        assert_ne!(hh.as_f32(), old.as_f32());
    }

    #[test]
    fn same_seed_same_parameters_other_seed_other_parameters() {
        let device = crate::device::cpu();
        let template_a = extract(&LeNet5::new(10, &device));
        let template_b = extract(&LeNet5::new(10, &device));
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
        assert_eq!(fan_in(&[6, 1, 5, 5]), Some(25));
        assert_eq!(fan_in(&[84, 120]), Some(120));
        assert_eq!(fan_in(&[16]), None);
        let device = crate::device::cpu();
        let tree = seeded_parameters(&extract(&LeNet5::new(10, &device)), 1);
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
