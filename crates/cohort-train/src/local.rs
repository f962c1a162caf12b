//! The client side of a strategy: what it changes in local training.
//!
//! A strategy's [`ClientInstructions`] reach the trainer as a [`LocalPlan`].
//! Two kinds of change exist, and they compose:
//!
//! * **gradient terms**, added to every step's gradient before clipping and
//!   the optimizer: FedProx's `μ · (w − w_global)` (the gradient of
//!   `μ/2 · ‖w − w_global‖²`) and SCAFFOLD's correction `c − cᵢ`;
//! * **update post-processing**, on the finished model: clipping the update
//!   `w − w_global` to an L2 norm (differential privacy).
//!
//! Plain training (FedAvg) resolves to no terms at all, so it pays nothing.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use cohort_core::strategy::ClientInstructions;
use cohort_core::tree::{Array, ParamTree};

use crate::params::{LoadError, PathStack, leaf_values};

/// What the strategy asks of one local run.
pub type LocalPlan = ClientInstructions;

/// A plan's gradient terms as tensors on the model's device, keyed by
/// parameter, built once per local run.
pub(crate) struct GradientTerms {
    proximal: Option<(f32, HashMap<ParamId, Tensor<1>>)>,
    correction: Option<HashMap<ParamId, Tensor<1>>>,
}

impl GradientTerms {
    /// Resolves `plan` against `model`, whose parameters are `global`.
    pub(crate) fn new<M: Module>(
        model: &M,
        plan: &LocalPlan,
        global: &ParamTree,
    ) -> Result<Option<Self>, LoadError> {
        let proximal = if plan.proximal_mu > 0.0 {
            Some((plan.proximal_mu as f32, tensors_by_param(model, global)?))
        } else {
            None
        };
        let correction = plan
            .gradient_correction
            .as_ref()
            .map(|tree| tensors_by_param(model, tree))
            .transpose()?;
        Ok(
            (proximal.is_some() || correction.is_some()).then_some(Self {
                proximal,
                correction,
            }),
        )
    }

    /// `grads` with the terms added.
    pub(crate) fn apply<M: Module>(&self, model: &M, grads: GradientsParams) -> GradientsParams {
        let mut adder = AddTerms { terms: self, grads };
        model.visit(&mut adder);
        adder.grads
    }
}

struct AddTerms<'a> {
    terms: &'a GradientTerms,
    grads: GradientsParams,
}

impl ModuleVisitor for AddTerms<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(mut grad) = self.grads.remove::<D>(param.id) else {
            return;
        };
        let shape = grad.shape();
        if let Some((mu, global)) = &self.terms.proximal
            && let Some(anchor) = global.get(&param.id)
        {
            let weights = param.val().inner();
            grad = grad + (weights - anchor.clone().reshape(shape.clone())).mul_scalar(*mu);
        }
        if let Some(correction) = &self.terms.correction
            && let Some(term) = correction.get(&param.id)
        {
            grad = grad + term.clone().reshape(shape);
        }
        self.grads.register(param.id, grad);
    }
}

/// Each parameter's leaf of `tree` (PyTorch's layout) as a flat tensor in
/// burn's order on the parameter's (non-autodiff) device. The tree must have
/// exactly the model's parameters.
fn tensors_by_param<M: Module>(
    model: &M,
    tree: &ParamTree,
) -> Result<HashMap<ParamId, Tensor<1>>, LoadError> {
    let leaves: HashMap<String, &Array> = tree
        .leaves()
        .into_iter()
        .map(|(path, array)| (path.to_string(), array))
        .collect();
    let mut collector = Collector {
        path: PathStack::default(),
        leaves: &leaves,
        tensors: HashMap::new(),
        used: HashSet::new(),
        error: None,
    };
    model.visit(&mut collector);
    if let Some(error) = collector.error {
        return Err(error);
    }
    // Leaves, not parameters: an LSTM's four gates share PyTorch's leaf.
    if collector.used.len() != leaves.len() {
        let known = crate::params::extract(model);
        let expected: std::collections::BTreeSet<String> =
            known.leaves().iter().map(|(p, _)| p.to_string()).collect();
        let extra = leaves
            .keys()
            .find(|k| !expected.contains(*k))
            .cloned()
            .unwrap_or_default();
        return Err(LoadError::Unexpected(extra));
    }
    Ok(collector.tensors)
}

struct Collector<'a> {
    path: PathStack,
    leaves: &'a HashMap<String, &'a Array>,
    tensors: HashMap<ParamId, Tensor<1>>,
    /// The tree's leaves read.
    used: HashSet<String>,
    error: Option<LoadError>,
}

impl ModuleVisitor for Collector<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_some() {
            return;
        }
        let tensor = param.val();
        let shape = tensor.dims().to_vec();
        // In burn's order, so the flat tensor reshapes to the gradient's shape.
        let found = leaf_values(&self.path, &shape, |name| self.leaves.get(name).copied());
        let values = match found {
            Ok((leaf, values)) => {
                self.used.insert(leaf);
                values
            }
            Err(error) => {
                self.error = Some(error);
                return;
            }
        };
        let device = tensor.device().inner();
        let length = values.len();
        let flat = Tensor::<1>::from_data(TensorData::new(values, [length]), &device);
        self.tensors.insert(param.id, flat);
    }
}

/// `local` with its update `local − global` scaled down to L2 norm
/// `max_norm` when it is longer (float leaves; same schema as `global`).
pub fn clip_update(global: &ParamTree, local: ParamTree, max_norm: f64) -> ParamTree {
    let mut squared = 0.0f64;
    for ((_, g), (_, l)) in global.leaves().iter().zip(local.leaves()) {
        if let (Some(g), Some(l)) = (g.as_f32(), l.as_f32()) {
            squared += g
                .iter()
                .zip(l)
                .map(|(&a, &b)| (b as f64 - a as f64).powi(2))
                .sum::<f64>();
        }
    }
    let norm = squared.sqrt();
    if norm <= max_norm {
        return local;
    }
    cohort_core::strategy::scale_update(global, local, max_norm / norm)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(values: &[f32]) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![values.len()], values.to_vec()).unwrap(),
        )])
    }

    #[test]
    fn clipping_scales_long_updates_only() {
        // Update (3, 4) has norm 5; clipped to 2.5 it is (1.5, 2).
        let clipped = clip_update(&tree(&[1.0, 1.0]), tree(&[4.0, 5.0]), 2.5);
        assert_eq!(clipped, tree(&[2.5, 3.0]));
        let short = clip_update(&tree(&[1.0, 1.0]), tree(&[4.0, 5.0]), 5.0);
        assert_eq!(short, tree(&[4.0, 5.0]));
    }
}
