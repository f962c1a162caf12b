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

    fn aggregates_by_fedavg_mean(&self) -> bool {
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

    /// The strategies that say their aggregation is FedAvg's mean step
    /// from the folded mean to the model their own aggregation gives, bit
    /// for bit; those that step from a mean of their own say no.
    #[test]
    fn strategies_of_fedavgs_mean_step_from_the_fold_bit_for_bit() {
        use crate::aggregate::{FedAvgOutcome, MeanFold};
        use crate::strategy::AlgorithmConfig;
        let global = tree(&[0.5, -1.0, 2.0]);
        let trees = [
            tree(&[0.1, 0.2, 0.3]),
            tree(&[1.0, -7.25, 1e-7]),
            tree(&[3.0, 0.0, -0.0]),
        ];
        let samples = [7, 0, 13];
        let configs = [
            AlgorithmConfig::Fedavg(Default::default()),
            AlgorithmConfig::Fedprox(Default::default()),
        ];
        for config in configs {
            let (mut whole, mut folded) = (config.build().unwrap(), config.build().unwrap());
            assert!(folded.aggregates_by_fedavg_mean(), "{}", folded.name());
            let expected = whole
                .aggregate(&ctx(1), &global, &updates(&trees, &samples))
                .unwrap();
            let weights = (1..).zip(samples.iter().map(|&n| n as f64)).collect();
            let mut fold = MeanFold::new(&global, weights).unwrap();
            trees.iter().for_each(|t| fold.add(t).unwrap());
            let mean = match fold.finish().unwrap() {
                FedAvgOutcome::Updated(mean) => Some(mean),
                FedAvgOutcome::Unchanged => None,
            };
            let got = folded.aggregate_mean(&ctx(1), &global, mean).unwrap();
            let bits = |tree: &ParamTree| -> Vec<u32> {
                values(tree).iter().map(|x| x.to_bits()).collect()
            };
            assert_eq!(
                bits(got.model.as_ref().unwrap()),
                bits(expected.model.as_ref().unwrap()),
                "{}",
                folded.name()
            );
        }
        for config in [
            AlgorithmConfig::Fedavgm(Default::default()),
            AlgorithmConfig::Fedadam(Default::default()),
            AlgorithmConfig::Median(Default::default()),
        ] {
            assert!(!config.build().unwrap().aggregates_by_fedavg_mean());
        }
    }
}
