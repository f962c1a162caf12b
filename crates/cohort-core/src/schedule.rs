//! Learning-rate schedules that run across rounds.
//!
//! The local optimizer is recreated for every client run, so a schedule that
//! lived inside it would restart each round. Here the server computes the rate
//! of each round from the round number alone and hands it to the clients: the
//! schedule spans the whole federated run, and a resumed run gets the same
//! rates without saving any scheduler state.

use serde::{Deserialize, Serialize};

/// `trainer.lr_scheduler` with its options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum LrSchedule {
    /// The configured learning rate every round (the default).
    Constant,
    /// Multiply by `gamma` every `step_size` rounds.
    Step { step_size: u32, gamma: f64 },
    /// Cosine annealing from the configured rate at round 1 to `min_lr` at
    /// round `rounds`.
    Cosine { rounds: u32, min_lr: f64 },
}

impl LrSchedule {
    /// The learning rate of `round` (1-based) for a base rate `base`.
    pub fn rate(&self, base: f64, round: u32) -> f64 {
        let completed = round.saturating_sub(1);
        match *self {
            LrSchedule::Constant => base,
            LrSchedule::Step { step_size, gamma } => {
                base * gamma.powi((completed / step_size.max(1)) as i32)
            }
            LrSchedule::Cosine { rounds, min_lr } => {
                if rounds <= 1 {
                    return base;
                }
                let progress = completed.min(rounds - 1) as f64 / (rounds - 1) as f64;
                min_lr + (base - min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_is_the_default_and_does_nothing() {
        assert_eq!(LrSchedule::Constant.rate(0.1, 1), 0.1);
        assert_eq!(LrSchedule::Constant.rate(0.1, 500), 0.1);
    }

    #[test]
    fn step_decays_every_step_size_rounds() {
        let schedule = LrSchedule::Step {
            step_size: 2,
            gamma: 0.5,
        };
        let rates: Vec<f64> = (1..=5).map(|r| schedule.rate(1.0, r)).collect();
        assert_eq!(rates, [1.0, 1.0, 0.5, 0.5, 0.25]);
    }

    #[test]
    fn cosine_runs_from_base_to_min_across_all_rounds() {
        let schedule = LrSchedule::Cosine {
            rounds: 5,
            min_lr: 0.0,
        };
        let rates: Vec<f64> = (1..=5).map(|r| schedule.rate(1.0, r)).collect();
        assert!((rates[0] - 1.0).abs() < 1e-12);
        assert!((rates[2] - 0.5).abs() < 1e-12);
        assert!(rates[4].abs() < 1e-12);
        assert!(rates.windows(2).all(|w| w[1] < w[0]), "{rates:?}");
        // Past the planned rounds it stays at the minimum.
        assert!(schedule.rate(1.0, 9).abs() < 1e-12);
    }
}
