//! `fedavgm`: FedAvg with server momentum (Hsu, Qi, Brown 2019, "Measuring the
//! Effects of Non-Identical Data Distribution for Federated Visual
//! Classification").
//!
//! With `Δ = x − Σᵢ (nᵢ/n) xᵢ` (the round's pseudo-gradient: the global model
//! minus the sample-weighted average of the clients' models),
//!
//! ```text
//! v ← β·v + Δ
//! x ← x − η·v
//! ```
//!
//! starting from `v = 0`. With `β = 0` and `η = 1` this is FedAvg. The momentum
//! `v` is the strategy's state and is checkpointed.

use serde::{Deserialize, Serialize};

use super::flat::{FloatLayout, flatten_mean, flatten_round};
use super::registry::{OptionError, RunShape};
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError, StrategyState};
use crate::tree::ParamTree;

/// Options of `fedavgm`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAvgMConfig {
    /// η, the server learning rate. Default 0.1.
    pub server_learning_rate: f64,
    /// β, the server momentum. Default 0.9. Hsu et al. tune the effective rate
    /// `η / (1 − β)`: the defaults make it 1, FedAvg's step size.
    pub momentum: f64,
}

impl Default for FedAvgMConfig {
    fn default() -> Self {
        Self {
            server_learning_rate: 0.1,
            momentum: 0.9,
        }
    }
}

impl FedAvgMConfig {
    pub fn check(&self, _run: &RunShape) -> Result<(), OptionError> {
        super::positive("server_learning_rate", self.server_learning_rate)?;
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(OptionError {
                option: "momentum",
                message: format!("must be in [0, 1), got {}", self.momentum),
            });
        }
        Ok(())
    }
}

/// FedAvg with server momentum.
#[derive(Debug, Clone)]
pub struct FedAvgM {
    config: FedAvgMConfig,
    /// `v`; `None` until the first round (zero).
    velocity: Option<Vec<f32>>,
}

impl FedAvgM {
    pub fn new(config: FedAvgMConfig) -> Self {
        Self {
            config,
            velocity: None,
        }
    }
}

/// One server-momentum step on flat vectors: updates `velocity` and returns
/// the new model.
pub fn momentum_step(
    global: &[f32],
    average: &[f32],
    velocity: &mut [f32],
    learning_rate: f64,
    momentum: f64,
) -> Vec<f32> {
    global
        .iter()
        .zip(average)
        .zip(velocity.iter_mut())
        .map(|((&x, &avg), v)| {
            let delta = x as f64 - avg as f64;
            *v = (momentum * *v as f64 + delta) as f32;
            (x as f64 - learning_rate * *v as f64) as f32
        })
        .collect()
}

impl FedAvgM {
    /// The momentum step from the round's sample-weighted average.
    fn step(
        &mut self,
        global: &ParamTree,
        layout: &FloatLayout,
        current: &[f32],
        average: &[f32],
    ) -> Result<Aggregated, StrategyError> {
        let velocity = self.velocity.get_or_insert_with(|| layout.zeros());
        if velocity.len() != current.len() {
            return Err(StrategyError::State {
                strategy: "fedavgm",
                problem: "the momentum does not have the model's size".to_owned(),
            });
        }
        let next = momentum_step(
            current,
            average,
            velocity,
            self.config.server_learning_rate,
            self.config.momentum,
        );
        Ok(Aggregated::model(layout.rebuild(global, &next)))
    }
}

impl Strategy for FedAvgM {
    fn name(&self) -> &'static str {
        "fedavgm"
    }

    fn aggregate(
        &mut self,
        _ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        let round = flatten_round(self.name(), global, updates)?;
        let Some(average) = round.sample_weighted_mean(updates) else {
            return Ok(Aggregated::unchanged());
        };
        self.step(global, &round.layout, &round.global, &average)
    }

    fn aggregates_by_mean(&self) -> bool {
        true
    }

    fn aggregate_mean(
        &mut self,
        _ctx: &RoundContext,
        global: &ParamTree,
        mean: Option<ParamTree>,
    ) -> Result<Aggregated, StrategyError> {
        let Some(mean) = mean else {
            return Ok(Aggregated::unchanged());
        };
        let (layout, current, average) = flatten_mean(self.name(), global, &mean)?;
        self.step(global, &layout, &current, &average)
    }

    fn state(&self) -> StrategyState {
        super::state_of_vectors([("momentum", self.velocity.as_deref())])
    }

    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        let [velocity] = super::vectors_of_state(self.name(), state, ["momentum"])?;
        self.velocity = velocity;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::fedavg::tests::{ctx, tree, updates, values};

    #[test]
    fn two_rounds_by_hand() {
        let mut strategy = FedAvgM::new(FedAvgMConfig {
            server_learning_rate: 0.5,
            momentum: 0.5,
        });
        // Round 1: x = 1, clients 3 (1 sample) and 5 (3 samples): avg = 4.5,
        // Δ = −3.5, v = −3.5, x = 1 + 0.5·3.5 = 2.75.
        let trees = [tree(&[3.0]), tree(&[5.0])];
        let out = strategy
            .aggregate(&ctx(1), &tree(&[1.0]), &updates(&trees, &[1, 3]))
            .unwrap();
        let x = out.model.unwrap();
        assert_eq!(values(&x), [2.75]);
        // Round 2: one client at 2.75 (no change): Δ = 0, v = −1.75,
        // x = 2.75 + 0.5·1.75 = 3.625: momentum keeps moving the model.
        let trees = [tree(&[2.75])];
        let out = strategy
            .aggregate(&ctx(2), &x, &updates(&trees, &[1]))
            .unwrap();
        assert_eq!(values(&out.model.unwrap()), [3.625]);
    }

    #[test]
    fn no_momentum_and_unit_rate_is_fedavg() {
        let mut strategy = FedAvgM::new(FedAvgMConfig {
            server_learning_rate: 1.0,
            momentum: 0.0,
        });
        let trees = [tree(&[1.0, 2.0]), tree(&[5.0, 10.0])];
        let out = strategy
            .aggregate(&ctx(1), &tree(&[0.0, 0.0]), &updates(&trees, &[300, 100]))
            .unwrap();
        assert_eq!(values(&out.model.unwrap()), [2.0, 4.0]);
    }

    #[test]
    fn state_round_trips() {
        let mut strategy = FedAvgM::new(FedAvgMConfig::default());
        assert!(strategy.state().is_empty());
        let trees = [tree(&[3.0])];
        strategy
            .aggregate(&ctx(1), &tree(&[1.0]), &updates(&trees, &[1]))
            .unwrap();
        let mut restored = FedAvgM::new(FedAvgMConfig::default());
        restored.restore(strategy.state()).unwrap();
        assert_eq!(restored.velocity, strategy.velocity);
    }
}
