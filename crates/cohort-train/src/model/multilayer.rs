//! `multilayer`: a multilayer perceptron for flattened inputs and tabular
//! data.
//!
//! Reference: Plato's `plato/models/multilayer.py` (after Shokri et al., "Membership
//! Inference Attacks against Machine Learning Models", S&P 2017): hidden layers of 1024,
//! 512, 256 and 128 units with tanh, then a linear layer to the classes. Those are the
//! defaults here; `hidden = [200, 200]` with `activation = "relu"` is McMahan et al.'s
//! 2NN (2017, 199,210 parameters on MNIST).
//!
//! Options (`[parameters.model]`): `hidden` (hidden layer sizes, default
//! `[1024, 512, 256, 128]`), `activation` (`"tanh"`, the default, or `"relu"`).
//!
//! Parameters are `layers.{i}.weight` / `layers.{i}.bias`, the last layer the
//! output (a PyTorch `nn.ModuleList` named `layers`, as the twin in
//! `examples/pytorch/models.py`). Any sample shape is flattened, as
//! `torch.flatten(x, 1)` does.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

use super::{
    Accelerated, FederatedModel, Inputs, ModelError, ModelSpec, Randomness, Stackable, linear, tanh,
};

/// The nonlinearity after each hidden layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Tanh,
    Relu,
}

/// See the module documentation.
#[derive(Module, Debug)]
pub struct Multilayer {
    /// Hidden layers, then the output layer.
    layers: Vec<Linear>,
    #[module(skip)]
    activation: Activation,
}

impl Multilayer {
    /// Plato's hidden sizes.
    pub const DEFAULT_HIDDEN: [usize; 4] = [1024, 512, 256, 128];

    /// `inputs` values per sample through `hidden` layers to `classes`.
    pub fn new(
        inputs: usize,
        hidden: &[usize],
        classes: usize,
        activation: Activation,
        device: &Device,
    ) -> Self {
        let widths: Vec<usize> = std::iter::once(inputs)
            .chain(hidden.iter().copied())
            .chain(std::iter::once(classes))
            .collect();
        let layers = widths
            .windows(2)
            .map(|pair| LinearConfig::new(pair[0], pair[1]).init(device))
            .collect();
        Self { layers, activation }
    }

    /// For any sample shape with at least one value (flattened), `spec`'s
    /// classes and the options `hidden` and `activation`.
    pub fn build(spec: &ModelSpec, device: &Device) -> Result<Self, ModelError> {
        let hidden = spec.options.sizes("hidden", &Self::DEFAULT_HIDDEN)?;
        let activation = match spec
            .options
            .choice("activation", &["tanh", "relu"], "tanh")?
            .as_str()
        {
            "relu" => Activation::Relu,
            _ => Activation::Tanh,
        };
        let inputs: usize = spec.sample_shape.iter().product();
        if spec.sample_shape.is_empty() || inputs == 0 {
            return Err(ModelError(format!(
                "takes samples of at least one value, but the data set's samples are {:?}",
                spec.sample_shape
            )));
        }
        Ok(Self::new(inputs, &hidden, spec.classes, activation, device))
    }
}

impl FederatedModel for Multilayer {
    fn forward(&self, inputs: Inputs, _randomness: &mut Randomness<'_>) -> Tensor<2> {
        let (output, hidden) = self.layers.split_last().expect("at least the output layer");
        let x = hidden.iter().fold(inputs.features(), |x, layer| {
            let x = linear(layer, x);
            match self.activation {
                Activation::Tanh => tanh(x),
                Activation::Relu => relu(x),
            }
        });
        linear(output, x)
    }

    fn accelerated(&self) -> Option<Accelerated> {
        let (output, hidden) = self.layers.split_last()?;
        Some(Accelerated {
            net: Stackable::Multilayer {
                hidden: hidden.iter().map(|l| l.weight.val().dims()[1]).collect(),
                tanh: self.activation == Activation::Tanh,
            },
            classes: output.weight.val().dims()[1],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelOptions;

    fn spec(shape: &[usize], classes: usize, options: &str) -> ModelSpec {
        let table: toml::Table = options.parse().unwrap();
        ModelSpec::new(shape.to_vec(), classes)
            .with_options(ModelOptions::new(table.into_iter().collect()))
    }

    #[test]
    fn parameter_counts_match_plato_and_mcmahan_by_hand() {
        let device = crate::device::cpu();
        // Plato's defaults on Purchase-100 (600 features, 100 classes):
        // 600·1024+1024 + 1024·512+512 + 512·256+256 + 256·128+128 + 128·100+100
        // = 615,424 + 524,800 + 131,328 + 32,896 + 12,900 = 1,317,348.
        let plato = Multilayer::build(&spec(&[600], 100, ""), &device).unwrap();
        assert_eq!(plato.num_params(), 1_317_348);
        // McMahan et al.'s 2NN on MNIST: 784·200+200 + 200·200+200 + 200·10+10 = 199,210.
        let two_nn = spec(
            &[1, 28, 28],
            10,
            "hidden = [200, 200]\nactivation = \"relu\"",
        );
        assert_eq!(
            Multilayer::build(&two_nn, &device).unwrap().num_params(),
            199_210
        );
    }

    #[test]
    fn forward_gives_one_row_of_classes_per_sample() {
        let device = crate::device::cpu();
        let model = Multilayer::build(&spec(&[5], 3, "hidden = [4]"), &device).unwrap();
        let inputs = Inputs::from_host(vec![0.5; 2 * 5], &[5], &device);
        let logits = model.forward(inputs, &mut Randomness::none());
        assert_eq!(logits.dims(), [2, 3]);
    }

    #[test]
    fn samples_without_values_and_bad_options_are_refused() {
        let device = crate::device::cpu();
        let error = Multilayer::build(&spec(&[], 3, ""), &device).unwrap_err();
        assert!(error.to_string().contains("at least one value"), "{error}");
        let error = Multilayer::build(&spec(&[4, 0], 3, ""), &device).unwrap_err();
        assert!(error.to_string().contains("[4, 0]"), "{error}");
        let error = Multilayer::build(&spec(&[5], 3, "activation = \"gelu\""), &device)
            .unwrap_err()
            .to_string();
        assert!(error.contains("parameters.model.activation"), "{error}");
    }
}
