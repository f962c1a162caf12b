//! `fedbuff`: buffered asynchronous aggregation (Nguyen et al. 2022,
//! "Federated Learning with Buffered Asynchronous Aggregation").
//!
//! The server keeps a buffer of K client steps `Δᵢ = wᵢ − baseᵢ` (each
//! client's model minus the model it started from), each discounted by its
//! staleness, and when K have arrived takes one server step:
//!
//! ```text
//! x ← x + η_g · (1/K) · Σᵢ s(τᵢ) · Δᵢ,      s(τ) = 1 / √(1 + τ)
//! ```
//!
//! K is `server.minimum_clients_aggregated`; η_g is `server_learning_rate`.
//! As in the paper's algorithm the mean is unweighted (every buffered step
//! counts once, whatever its sample count). In a synchronous run every
//! staleness is 0 and this is FedAvg's step, unweighted, times η_g.
//! Computed in float64, stored as the model's dtypes.

use serde::{Deserialize, Serialize};

use super::registry::OptionError;
use super::stale::{StaleUpdate, flatten_stale};
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

/// Options of `fedbuff`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedBuffConfig {
    /// η_g, the server learning rate. Default 1.
    pub server_learning_rate: f64,
}

impl Default for FedBuffConfig {
    fn default() -> Self {
        Self {
            server_learning_rate: 1.0,
        }
    }
}

impl FedBuffConfig {
    pub fn check(&self) -> Result<(), OptionError> {
        super::positive("server_learning_rate", self.server_learning_rate)
    }
}

/// `s(τ) = 1 / √(1 + τ)`.
pub fn discount(staleness: u32) -> f64 {
    1.0 / (1.0 + f64::from(staleness)).sqrt()
}

/// Buffered, staleness-discounted server steps.
#[derive(Debug, Clone)]
pub struct FedBuff {
    config: FedBuffConfig,
}

impl FedBuff {
    pub fn new(config: FedBuffConfig) -> Self {
        Self { config }
    }
}

/// `x + η · (1/K) · Σ sᵢ (wᵢ − bᵢ)`, in float64.
pub fn buffered_step(
    global: &[f32],
    updates: &[&[f32]],
    bases: &[&[f32]],
    discounts: &[f64],
    learning_rate: f64,
) -> Vec<f32> {
    let scale = learning_rate / updates.len().max(1) as f64;
    let mut step = vec![0.0f64; global.len()];
    for ((update, base), &s) in updates.iter().zip(bases).zip(discounts) {
        for ((acc, &w), &b) in step.iter_mut().zip(update.iter()).zip(base.iter()) {
            *acc += s * (w as f64 - b as f64);
        }
    }
    global
        .iter()
        .zip(step)
        .map(|(&x, delta)| (x as f64 + scale * delta) as f32)
        .collect()
}

impl Strategy for FedBuff {
    fn name(&self) -> &'static str {
        "fedbuff"
    }

    fn aggregate(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        self.aggregate_stale(ctx, global, &super::stale::fresh(global, updates))
    }

    fn asynchronous(&self) -> Result<(), String> {
        Ok(())
    }

    fn aggregate_stale(
        &mut self,
        _ctx: &RoundContext,
        global: &ParamTree,
        updates: &[StaleUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        let flat = flatten_stale(self.name(), global, updates)?;
        let models: Vec<&[f32]> = flat.round.updates.iter().map(Vec::as_slice).collect();
        let bases: Vec<&[f32]> = flat.bases.iter().map(Vec::as_slice).collect();
        let discounts: Vec<f64> = updates.iter().map(|u| discount(u.staleness)).collect();
        let next = buffered_step(
            &flat.round.global,
            &models,
            &bases,
            &discounts,
            self.config.server_learning_rate,
        );
        Ok(Aggregated::model(flat.round.layout.rebuild(global, &next)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(values: &[f32]) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            crate::tree::Array::f32(vec![values.len()], values.to_vec()).unwrap(),
        )])
    }

    fn ctx() -> RoundContext {
        RoundContext {
            round: 1,
            learning_rate: 0.1,
            per_round: 2,
            total_clients: 4,
        }
    }

    #[test]
    fn a_buffer_of_two_by_hand() {
        let global = leaf(&[1.0, 1.0]);
        let (base_1, w_1) = (leaf(&[1.0, 1.0]), leaf(&[2.0, 3.0]));
        let (base_2, w_2) = (leaf(&[1.0, 2.0]), leaf(&[0.0, 0.0]));
        let update = |tree, base, staleness, num_samples| StaleUpdate {
            update: ClientUpdate {
                client_id: 1,
                num_samples,
                local_steps: 1,
                tree,
            },
            base,
            staleness,
        };
        // Δ₁ = [1, 2] at staleness 0 (s = 1); Δ₂ = [−1, −2] at staleness 3
        // (s = 1/√4 = 1/2): Σ sᵢΔᵢ = [0.5, 1], over K = 2: [0.25, 0.5].
        // η = 1: x = [1.25, 1.5]; η = 2: [1.5, 2]. Sample counts do not weigh.
        let buffer = [update(&w_1, &base_1, 0, 1), update(&w_2, &base_2, 3, 1000)];
        let mut strategy = FedBuff::new(FedBuffConfig::default());
        let out = strategy.aggregate_stale(&ctx(), &global, &buffer).unwrap();
        assert_eq!(out.model.unwrap(), leaf(&[1.25, 1.5]));
        let mut faster = FedBuff::new(FedBuffConfig {
            server_learning_rate: 2.0,
        });
        let out = faster.aggregate_stale(&ctx(), &global, &buffer).unwrap();
        assert_eq!(out.model.unwrap(), leaf(&[1.5, 2.0]));
        assert_eq!(discount(0), 1.0);
        assert_eq!(discount(3), 0.5);
    }

    #[test]
    fn synchronous_is_the_unweighted_mean_step() {
        let global = leaf(&[0.0]);
        let (a, b) = (leaf(&[2.0]), leaf(&[4.0]));
        let updates = [
            ClientUpdate {
                client_id: 1,
                num_samples: 1,
                local_steps: 1,
                tree: &a,
            },
            ClientUpdate {
                client_id: 2,
                num_samples: 9,
                local_steps: 1,
                tree: &b,
            },
        ];
        let out = FedBuff::new(FedBuffConfig::default())
            .aggregate(&ctx(), &global, &updates)
            .unwrap();
        assert_eq!(out.model.unwrap(), leaf(&[3.0]));
        let bad = FedBuffConfig {
            server_learning_rate: 0.0,
        };
        assert_eq!(bad.check().unwrap_err().option, "server_learning_rate");
    }
}
