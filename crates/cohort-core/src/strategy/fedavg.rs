//! `fedavg`: sample-weighted federated averaging (McMahan et al. 2017,
//! "Communication-Efficient Learning of Deep Networks from Decentralized Data").
//!
//! `x ← Σᵢ (nᵢ / n) · xᵢ`. The arithmetic is [`crate::aggregate::fedavg`], the
//! streaming, validated path every other part of cohort uses; this file only
//! puts it behind the [`Strategy`] interface.

use serde::{Deserialize, Serialize};

use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::aggregate::{FedAvgOutcome, fedavg};
use crate::tree::ParamTree;

/// `fedavg` has no options.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAvgConfig {}

/// Sample-weighted averaging of the clients' models.
#[derive(Debug, Clone, Copy, Default)]
pub struct FedAvg;

/// The sample-weighted mean of the updates, or `None` when their total weight
/// is zero. Shared by the strategies whose server step is FedAvg's.
pub fn weighted_average(
    global: &ParamTree,
    updates: &[ClientUpdate<'_>],
) -> Result<Option<ParamTree>, StrategyError> {
    Ok(
        match fedavg(global, &super::flat::contributions(updates))? {
            FedAvgOutcome::Updated(tree) => Some(tree),
            FedAvgOutcome::Unchanged => None,
        },
    )
}

impl Strategy for FedAvg {
    fn name(&self) -> &'static str {
        "fedavg"
    }

    fn aggregate(
        &mut self,
        _ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        Ok(Aggregated {
            model: weighted_average(global, updates)?,
            ..Aggregated::unchanged()
        })
    }

    fn aggregates_by_mean(&self) -> bool {
        true
    }

    fn aggregate_mean(
        &mut self,
        _ctx: &RoundContext,
        _global: &ParamTree,
        mean: Option<ParamTree>,
    ) -> Result<Aggregated, StrategyError> {
        Ok(Aggregated {
            model: mean,
            ..Aggregated::unchanged()
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::tree::Array;

    pub(crate) fn tree(values: &[f32]) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![values.len()], values.to_vec()).unwrap(),
        )])
    }

    pub(crate) fn values(tree: &ParamTree) -> Vec<f32> {
        tree.leaves()[0].1.as_f32().unwrap().to_vec()
    }

    pub(crate) fn ctx(round: u32) -> RoundContext {
        RoundContext {
            round,
            learning_rate: 0.1,
            per_round: 2,
            total_clients: 10,
        }
    }

    pub(crate) fn updates<'a>(trees: &'a [ParamTree], samples: &[u64]) -> Vec<ClientUpdate<'a>> {
        trees
            .iter()
            .zip(samples)
            .enumerate()
            .map(|(i, (tree, &num_samples))| ClientUpdate {
                client_id: i as u32 + 1,
                num_samples,
                local_steps: 1,
                tree,
            })
            .collect()
    }

    #[test]
    fn weighted_mean_by_hand() {
        let trees = [tree(&[1.0, 2.0]), tree(&[5.0, 10.0])];
        // 300 and 100 samples: 0.75·(1, 2) + 0.25·(5, 10) = (2, 4).
        let out = FedAvg
            .aggregate(&ctx(1), &tree(&[0.0, 0.0]), &updates(&trees, &[300, 100]))
            .unwrap();
        assert_eq!(values(&out.model.unwrap()), [2.0, 4.0]);
    }

    #[test]
    fn zero_weight_leaves_the_model_unchanged() {
        let trees = [tree(&[1.0])];
        let out = FedAvg
            .aggregate(&ctx(1), &tree(&[0.0]), &updates(&trees, &[0]))
            .unwrap();
        assert_eq!(out.model, None);
    }
}
