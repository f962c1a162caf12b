//! `fedadam`, `fedyogi`, `fedadagrad`: adaptive server optimizers on the
//! round's pseudo-gradient (Reddi et al. 2021, "Adaptive Federated
//! Optimization", Algorithm 2).
//!
//! With `Δ = Σᵢ (nᵢ/n) xᵢ − x` (the sample-weighted average of the clients'
//! models minus the global model; the paper writes the plain mean, which is the
//! same when clients hold equal amounts of data):
//!
//! ```text
//! m ← β₁·m + (1 − β₁)·Δ
//! v ← v + Δ²                              (FedAdagrad)
//! v ← v − (1 − β₂)·Δ²·sign(v − Δ²)        (FedYogi)
//! v ← β₂·v + (1 − β₂)·Δ²                  (FedAdam)
//! x ← x + η · m / (√v + τ)
//! ```
//!
//! element-wise, from `m = 0` and `v = τ²` (the paper's `v₋₁ ≥ τ²`). As in the
//! paper there is no bias correction. `m` and `v` are the strategy's state and
//! are checkpointed.

use serde::{Deserialize, Serialize};

use super::flat::{FloatLayout, flatten_mean, flatten_round};
use super::registry::OptionError;
use super::{Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError, StrategyState};
use crate::tree::ParamTree;

/// Options of `fedadam` and `fedyogi` (`fedadagrad`: [`FedAdagradConfig`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedOptConfig {
    /// η, the server learning rate. Default 0.01.
    pub server_learning_rate: f64,
    /// β₁, decay of the first moment. Default 0.9.
    pub beta1: f64,
    /// β₂, decay of the second moment. Default 0.99.
    pub beta2: f64,
    /// τ, the adaptivity: small values make the step more adaptive. Default 0.001.
    pub tau: f64,
}

impl Default for FedOptConfig {
    fn default() -> Self {
        Self {
            server_learning_rate: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            tau: 1e-3,
        }
    }
}

impl FedOptConfig {
    pub fn check(&self) -> Result<(), OptionError> {
        super::positive("server_learning_rate", self.server_learning_rate)?;
        super::positive("tau", self.tau)?;
        for (option, value) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&value) {
                return Err(OptionError {
                    option,
                    message: format!("must be in [0, 1), got {value}"),
                });
            }
        }
        Ok(())
    }
}

/// Options of `fedadagrad`: those of [`FedOptConfig`] without `beta2`, which
/// Adagrad's sum of squares does not use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAdagradConfig {
    /// η, the server learning rate. Default 0.01.
    pub server_learning_rate: f64,
    /// β₁, decay of the first moment. Default 0.9.
    pub beta1: f64,
    /// τ, the adaptivity. Default 0.001.
    pub tau: f64,
}

impl Default for FedAdagradConfig {
    fn default() -> Self {
        let FedOptConfig {
            server_learning_rate,
            beta1,
            tau,
            ..
        } = FedOptConfig::default();
        Self {
            server_learning_rate,
            beta1,
            tau,
        }
    }
}

impl FedAdagradConfig {
    /// The shared options, `beta2` unused.
    pub fn common(&self) -> FedOptConfig {
        FedOptConfig {
            server_learning_rate: self.server_learning_rate,
            beta1: self.beta1,
            tau: self.tau,
            ..FedOptConfig::default()
        }
    }
}

/// Which second-moment rule the server uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerOptimizer {
    Adam,
    Yogi,
    Adagrad,
}

impl ServerOptimizer {
    fn name(self) -> &'static str {
        match self {
            ServerOptimizer::Adam => "fedadam",
            ServerOptimizer::Yogi => "fedyogi",
            ServerOptimizer::Adagrad => "fedadagrad",
        }
    }
}

/// The moments of the server optimizer.
#[derive(Debug, Clone, PartialEq)]
pub struct Moments {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

impl Moments {
    pub fn new(len: usize, tau: f64) -> Self {
        Self {
            m: vec![0.0; len],
            v: vec![(tau * tau) as f32; len],
        }
    }
}

/// One adaptive server step on flat vectors: updates `moments` and returns the
/// new model. Arithmetic in float64, state stored in float32.
pub fn adaptive_step(
    rule: ServerOptimizer,
    config: &FedOptConfig,
    global: &[f32],
    average: &[f32],
    moments: &mut Moments,
) -> Vec<f32> {
    let FedOptConfig {
        server_learning_rate: eta,
        beta1,
        beta2,
        tau,
    } = *config;
    let mut next = Vec::with_capacity(global.len());
    for (i, (&x, &avg)) in global.iter().zip(average).enumerate() {
        let delta = avg as f64 - x as f64;
        let squared = delta * delta;
        let m = beta1 * moments.m[i] as f64 + (1.0 - beta1) * delta;
        let v_old = moments.v[i] as f64;
        let v = match rule {
            ServerOptimizer::Adagrad => v_old + squared,
            ServerOptimizer::Yogi => v_old - (1.0 - beta2) * squared * sign(v_old - squared),
            ServerOptimizer::Adam => beta2 * v_old + (1.0 - beta2) * squared,
        };
        moments.m[i] = m as f32;
        moments.v[i] = v as f32;
        // From the stored float32 values, so a resumed run steps identically.
        let step = eta * moments.m[i] as f64 / ((moments.v[i] as f64).sqrt() + tau);
        next.push((x as f64 + step) as f32);
    }
    next
}

/// `sign` with `sign(0) = 0`, as Yogi's rule needs.
fn sign(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// An adaptive server optimizer on the pseudo-gradient.
#[derive(Debug, Clone)]
pub struct FedOpt {
    rule: ServerOptimizer,
    config: FedOptConfig,
    moments: Option<Moments>,
}

impl FedOpt {
    pub fn new(rule: ServerOptimizer, config: FedOptConfig) -> Self {
        Self {
            rule,
            config,
            moments: None,
        }
    }
}

impl FedOpt {
    /// The adaptive server step from the round's sample-weighted average.
    fn step(
        &mut self,
        global: &ParamTree,
        layout: &FloatLayout,
        current: &[f32],
        average: &[f32],
    ) -> Result<Aggregated, StrategyError> {
        let tau = self.config.tau;
        let moments = self
            .moments
            .get_or_insert_with(|| Moments::new(current.len(), tau));
        if moments.m.len() != current.len() || moments.v.len() != current.len() {
            return Err(StrategyError::State {
                strategy: self.rule.name(),
                problem: "the moments do not have the model's size".to_owned(),
            });
        }
        let next = adaptive_step(self.rule, &self.config, current, average, moments);
        Ok(Aggregated::model(layout.rebuild(global, &next)))
    }
}

impl Strategy for FedOpt {
    fn name(&self) -> &'static str {
        self.rule.name()
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
        let moments = self.moments.as_ref();
        super::state_of_vectors([
            ("m", moments.map(|m| m.m.as_slice())),
            ("v", moments.map(|m| m.v.as_slice())),
        ])
    }

    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        let name = self.name();
        self.moments = match super::vectors_of_state(name, state, ["m", "v"])? {
            [Some(m), Some(v)] if m.len() == v.len() => Some(Moments { m, v }),
            [None, None] => None,
            _ => {
                return Err(StrategyError::State {
                    strategy: name,
                    problem: "needs both moments m and v, of one size".to_owned(),
                });
            }
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::fedavg::tests::{ctx, tree, updates, values};

    fn config() -> FedOptConfig {
        FedOptConfig {
            server_learning_rate: 1.0,
            beta1: 0.5,
            beta2: 0.5,
            tau: 0.5,
        }
    }

    /// One round from x = 0 with one client at 2: Δ = 2, m = 0.5·2 = 1,
    /// v₀ = τ² = 0.25.
    fn first_round(rule: ServerOptimizer) -> f32 {
        let mut strategy = FedOpt::new(rule, config());
        let trees = [tree(&[2.0])];
        let out = strategy
            .aggregate(&ctx(1), &tree(&[0.0]), &updates(&trees, &[1]))
            .unwrap();
        values(&out.model.unwrap())[0]
    }

    #[test]
    fn adagrad_by_hand() {
        // v = 0.25 + 4 = 4.25; x = 1 / (√4.25 + 0.5).
        let expected = (1.0 / (4.25f64.sqrt() + 0.5)) as f32;
        assert_eq!(first_round(ServerOptimizer::Adagrad), expected);
    }

    #[test]
    fn yogi_by_hand() {
        // v = 0.25 − 0.5·4·sign(0.25 − 4) = 0.25 + 2 = 2.25; x = 1 / (1.5 + 0.5) = 0.5.
        assert_eq!(first_round(ServerOptimizer::Yogi), 0.5);
    }

    #[test]
    fn adam_by_hand() {
        // v = 0.5·0.25 + 0.5·4 = 2.125; x = 1 / (√2.125 + 0.5).
        let expected = (1.0 / (2.125f64.sqrt() + 0.5)) as f32;
        assert_eq!(first_round(ServerOptimizer::Adam), expected);
    }

    #[test]
    fn moments_persist_and_restore() {
        let mut strategy = FedOpt::new(ServerOptimizer::Adam, config());
        let trees = [tree(&[2.0, -1.0])];
        let global = tree(&[0.0, 0.0]);
        let first = strategy
            .aggregate(&ctx(1), &global, &updates(&trees, &[1]))
            .unwrap()
            .model
            .unwrap();
        let mut restored = FedOpt::new(ServerOptimizer::Adam, config());
        restored.restore(strategy.state()).unwrap();
        let a = strategy
            .aggregate(&ctx(2), &first, &updates(&trees, &[1]))
            .unwrap();
        let b = restored
            .aggregate(&ctx(2), &first, &updates(&trees, &[1]))
            .unwrap();
        assert_eq!(a, b);
        // A second step with the same client moves on: momentum at work.
        assert_ne!(values(&a.model.unwrap()), values(&first));
    }

    #[test]
    fn options_are_checked() {
        let bad = FedOptConfig {
            beta1: 1.0,
            ..FedOptConfig::default()
        };
        assert_eq!(bad.check().unwrap_err().option, "beta1");
        let bad = FedOptConfig {
            tau: 0.0,
            ..FedOptConfig::default()
        };
        assert_eq!(bad.check().unwrap_err().option, "tau");
    }
}
