//! `fedprox`: FedAvg with a proximal local objective (Li et al. 2020,
//! "Federated Optimization in Heterogeneous Networks").
//!
//! Each client minimizes `Fᵢ(w) + μ/2 · ‖w − w_global‖²` instead of `Fᵢ(w)`:
//! the extra term pulls local training towards the model the round started
//! from, which limits client drift on heterogeneous data. The gradient gains
//! `μ · (w − w_global)`; the trainer (`cohort-train`) adds it to every step.
//! The server step is FedAvg's. With `mu = 0` FedProx is FedAvg.

use serde::{Deserialize, Serialize};

use super::fedavg::FedAvg;
use super::registry::{OptionError, RunShape};
use super::{Aggregated, ClientInstructions, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

/// Options of `fedprox`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedProxConfig {
    /// μ, the weight of the proximal term. Default 0.01 (the paper tries
    /// 0.001 to 1).
    pub mu: f64,
}

impl Default for FedProxConfig {
    fn default() -> Self {
        Self { mu: 0.01 }
    }
}

impl FedProxConfig {
    pub fn check(&self, _run: &RunShape) -> Result<(), OptionError> {
        if self.mu.is_finite() && self.mu >= 0.0 {
            Ok(())
        } else {
            Err(OptionError {
                option: "mu",
                message: format!("must be a finite number >= 0, got {}", self.mu),
            })
        }
    }
}

/// FedAvg on the server, a proximal term on the clients.
#[derive(Debug, Clone)]
pub struct FedProx {
    config: FedProxConfig,
}

impl FedProx {
    pub fn new(config: FedProxConfig) -> Self {
        Self { config }
    }
}

impl Strategy for FedProx {
    fn name(&self) -> &'static str {
        "fedprox"
    }

    fn configure(
        &self,
        ctx: &RoundContext,
        _client_id: u32,
        _global: &ParamTree,
    ) -> Result<ClientInstructions, StrategyError> {
        Ok(ClientInstructions {
            proximal_mu: self.config.mu,
            ..ClientInstructions::plain(ctx.learning_rate)
        })
    }

    fn aggregate(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        // The server step is FedAvg's; only the clients' objective differs.
        FedAvg.aggregate(ctx, global, updates)
    }

    fn aggregates_by_mean(&self) -> bool {
        true
    }

    fn aggregates_by_fedavg_mean(&self) -> bool {
        true
    }

    fn aggregate_mean(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        mean: Option<ParamTree>,
    ) -> Result<Aggregated, StrategyError> {
        FedAvg.aggregate_mean(ctx, global, mean)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::fedavg::tests::{ctx, tree, updates, values};

    #[test]
    fn clients_get_mu_and_the_server_averages() {
        let mut strategy = FedProx::new(FedProxConfig { mu: 0.5 });
        let instructions = strategy.configure(&ctx(1), 3, &tree(&[0.0])).unwrap();
        assert_eq!(instructions.proximal_mu, 0.5);
        assert_eq!(instructions.learning_rate, 0.1);
        let trees = [tree(&[1.0]), tree(&[4.0])];
        // (2·1 + 1·4) / 3 = 2.
        let out = strategy
            .aggregate(&ctx(1), &tree(&[0.0]), &updates(&trees, &[2, 1]))
            .unwrap();
        assert_eq!(values(&out.model.unwrap()), [2.0]);
    }

    #[test]
    fn negative_mu_is_refused() {
        let run = RunShape {
            total_clients: 10,
            per_round: 2,
            min_per_round: 2,
            local_optimizer: "sgd",
        };
        assert!(FedProxConfig { mu: -1.0 }.check(&run).is_err());
        assert!(FedProxConfig { mu: 0.0 }.check(&run).is_ok());
    }
}
