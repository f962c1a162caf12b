//! `fedasync`: asynchronous federated optimization (Xie, Koyejo, Gupta 2019,
//! "Asynchronous Federated Optimization").
//!
//! Each update `x_new`, trained from the model of `τ` aggregations ago, is
//! mixed into the global model with a weight discounted by its staleness:
//!
//! ```text
//! α_t = α · s(t − τ)
//! x  ← (1 − α_t) · x + α_t · x_new
//! ```
//!
//! with the paper's staleness functions: `constant` `s = 1`; `polynomial`
//! `s(τ) = (τ + 1)^(−a)`; `hinge` `s(τ) = 1` for `τ ≤ b`, else
//! `1 / (a·(τ − b) + 1)`. The paper aggregates each update as it arrives
//! (`server.minimum_clients_aggregated = 1`); with a larger buffer the
//! updates are mixed in one after another in arrival order, each with its
//! own staleness. In a synchronous run every update has staleness 0.
//! Computed in float64, stored as the model's dtypes.

use serde::{Deserialize, Serialize};

use super::registry::OptionError;
use super::stale::{StaleUpdate, flatten_stale};
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError};
use crate::tree::ParamTree;

/// `algorithm.staleness_function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StalenessFunction {
    /// `s = 1`: staleness ignored.
    Constant,
    /// `s(τ) = (τ + 1)^(−a)`, a = `staleness_exponent`.
    #[default]
    Polynomial,
    /// `1` up to `hinge_bound`, then `1 / (hinge_slope · (τ − b) + 1)`.
    Hinge,
}

/// Options of `fedasync`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAsyncConfig {
    /// α, the mixing weight of a fresh update, in (0, 1]. Default 0.6 (one
    /// of the paper's two settings).
    pub alpha: f64,
    /// `constant`, `polynomial` (default) or `hinge`.
    pub staleness_function: StalenessFunction,
    /// `polynomial`'s a. Default 0.5 (the paper's).
    pub staleness_exponent: f64,
    /// `hinge`'s a. Default 10 (the paper's).
    pub hinge_slope: f64,
    /// `hinge`'s b: staleness up to this is not discounted. Default 4 (the
    /// paper's).
    pub hinge_bound: u32,
}

impl Default for FedAsyncConfig {
    fn default() -> Self {
        Self {
            alpha: 0.6,
            staleness_function: StalenessFunction::Polynomial,
            staleness_exponent: 0.5,
            hinge_slope: 10.0,
            hinge_bound: 4,
        }
    }
}

impl FedAsyncConfig {
    pub fn check(&self) -> Result<(), OptionError> {
        if !(self.alpha > 0.0 && self.alpha <= 1.0) {
            return Err(OptionError {
                option: "alpha",
                message: format!("must be in (0, 1], got {}", self.alpha),
            });
        }
        for (option, value) in [
            ("staleness_exponent", self.staleness_exponent),
            ("hinge_slope", self.hinge_slope),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(OptionError {
                    option,
                    message: format!("must be a finite number >= 0, got {value}"),
                });
            }
        }
        Ok(())
    }

    /// `s(τ)`, in (0, 1].
    pub fn discount(&self, staleness: u32) -> f64 {
        let tau = f64::from(staleness);
        match self.staleness_function {
            StalenessFunction::Constant => 1.0,
            StalenessFunction::Polynomial => (tau + 1.0).powf(-self.staleness_exponent),
            StalenessFunction::Hinge if staleness <= self.hinge_bound => 1.0,
            StalenessFunction::Hinge => {
                1.0 / (self.hinge_slope * (tau - f64::from(self.hinge_bound)) + 1.0)
            }
        }
    }
}

/// Staleness-discounted mixing of each update into the global model.
#[derive(Debug, Clone)]
pub struct FedAsync {
    config: FedAsyncConfig,
}

impl FedAsync {
    pub fn new(config: FedAsyncConfig) -> Self {
        Self { config }
    }
}

/// `x ← (1 − αᵢ) x + αᵢ wᵢ` for each update in turn, in float64.
pub fn mix(global: &[f32], updates: &[&[f32]], alphas: &[f64]) -> Vec<f32> {
    let mut model: Vec<f64> = global.iter().map(|&x| x as f64).collect();
    for (update, &alpha) in updates.iter().zip(alphas) {
        for (x, &w) in model.iter_mut().zip(update.iter()) {
            *x = (1.0 - alpha) * *x + alpha * w as f64;
        }
    }
    model.into_iter().map(|x| x as f32).collect()
}

impl Strategy for FedAsync {
    fn name(&self) -> &'static str {
        "fedasync"
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
        let flat = flatten_stale(self.name(), global, updates)?.round;
        let alphas: Vec<f64> = updates
            .iter()
            .map(|u| self.config.alpha * self.config.discount(u.staleness))
            .collect();
        let models: Vec<&[f32]> = flat.updates.iter().map(Vec::as_slice).collect();
        let mixed = mix(&flat.global, &models, &alphas);
        Ok(Aggregated::model(flat.layout.rebuild(global, &mixed)))
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
    fn staleness_functions_by_hand() {
        let mut config = FedAsyncConfig::default();
        // (3 + 1)^(−0.5) = 1/2.
        assert_eq!(config.discount(3), 0.5);
        assert_eq!(config.discount(0), 1.0);
        config.staleness_function = StalenessFunction::Hinge;
        // Up to b = 4 no discount; at 6: 1 / (10 · 2 + 1).
        assert_eq!(config.discount(4), 1.0);
        assert_eq!(config.discount(6), 1.0 / 21.0);
        config.staleness_function = StalenessFunction::Constant;
        assert_eq!(config.discount(1000), 1.0);
    }

    #[test]
    fn two_stale_updates_by_hand() {
        let global = leaf(&[0.0, 0.0]);
        let (base_a, base_b) = (leaf(&[9.0, 9.0]), leaf(&[0.0, 0.0]));
        let (a, b) = (leaf(&[4.0, 8.0]), leaf(&[2.0, 2.0]));
        let update = |tree, base, staleness| StaleUpdate {
            update: ClientUpdate {
                client_id: 1,
                num_samples: 10,
                local_steps: 1,
                tree,
            },
            base,
            staleness,
        };
        let mut strategy = FedAsync::new(FedAsyncConfig {
            alpha: 0.5,
            ..FedAsyncConfig::default()
        });
        // First a: staleness 3, α₁ = 0.5 · (4)^(−0.5) = 0.25:
        //   x = 0.75 · [0, 0] + 0.25 · [4, 8] = [1, 2].
        // Then b: staleness 0, α₂ = 0.5:
        //   x = 0.5 · [1, 2] + 0.5 · [2, 2] = [1.5, 2].
        // FedAsync mixes the model itself: the bases do not enter.
        let out = strategy
            .aggregate_stale(
                &ctx(),
                &global,
                &[update(&a, &base_a, 3), update(&b, &base_b, 0)],
            )
            .unwrap();
        assert_eq!(out.model.unwrap(), leaf(&[1.5, 2.0]));
        // Synchronous: staleness 0, α = 0.5.
        let out = strategy.aggregate(&ctx(), &global, &[update(&a, &global, 0).update]);
        assert_eq!(out.unwrap().model.unwrap(), leaf(&[2.0, 4.0]));
    }

    #[test]
    fn options_out_of_range_are_refused() {
        for alpha in [0.0, 1.5, f64::NAN] {
            let config = FedAsyncConfig {
                alpha,
                ..FedAsyncConfig::default()
            };
            assert_eq!(config.check().unwrap_err().option, "alpha");
        }
        let config = FedAsyncConfig {
            staleness_exponent: -1.0,
            ..FedAsyncConfig::default()
        };
        assert_eq!(config.check().unwrap_err().option, "staleness_exponent");
        assert!(FedAsyncConfig::default().check().is_ok());
    }
}
