//! Power-of-choice selection (Cho, Wang and Joshi 2020, "Client Selection in
//! Federated Learning: Convergence Analysis and Power-of-Choice Selection
//! Strategies").
//!
//! Each round the server draws a candidate set of `d` clients without
//! replacement, each draw with probability proportional to the client's
//! share of the data (`p_k = n_k / n`), and selects the `m = per_round`
//! candidates with the highest local loss `F_k(w)`.
//!
//! The paper's pow-d evaluates the global model on every candidate's data
//! before it selects, one more round trip to `d` clients. cohort uses the
//! paper's communication- and computation-free variant, rpow-d: a client's
//! loss is the mean training loss it reported the last time it trained (the
//! loss of the model it started from, averaged over its local steps), and a
//! client that never trained counts as having an infinite loss, so every
//! client is tried before any is passed over for its loss. Equal losses
//! keep the order the candidates were drawn in.
//!
//! For fewer places than `per_round` (an asynchronous run refilling one),
//! the candidate set shrinks in proportion: `⌈count · d / per_round⌉`
//! candidates for `count` places, at least `count`.

use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{ClientPrior, Feedback, exact, weighted_draws};

/// `[clients.power_of_choice]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PowerOfChoiceOptions {
    /// The candidate set's size d, `per_round ≤ d ≤ total_clients`. Default:
    /// `2 · per_round`, at most every client.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidates: Option<u32>,
}

impl PowerOfChoiceOptions {
    /// d for a run of `per_round` of `total` clients.
    pub fn candidates_of(&self, per_round: u32, total: u32) -> u32 {
        self.candidates
            .unwrap_or(per_round.saturating_mul(2))
            .min(total)
    }

    /// Why `candidates` cannot be this run's, if it cannot.
    pub fn check(&self, per_round: u32, total: u32) -> Result<(), String> {
        match self.candidates {
            Some(d) if d < per_round || d > total => Err(format!(
                "must be between clients.per_round = {per_round} and clients.total_clients = \
                 {total}, got {d}"
            )),
            _ => Ok(()),
        }
    }
}

/// What the policy remembers: each client's last reported loss.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PowerOfChoiceState {
    /// Index `c − 1`: client `c`'s loss; `inf` until it reports one.
    #[serde(with = "exact::list")]
    pub losses: Vec<f64>,
}

#[derive(Debug, Clone)]
pub struct PowerOfChoice {
    /// d.
    candidates: u32,
    per_round: u32,
    /// Each client's data size, the candidate draw's weight.
    weights: Vec<f64>,
    state: PowerOfChoiceState,
}

impl PowerOfChoice {
    pub fn new(options: PowerOfChoiceOptions, per_round: u32, prior: &ClientPrior) -> Self {
        let total = prior.samples.len();
        Self {
            candidates: options.candidates_of(per_round, total as u32),
            per_round: per_round.max(1),
            weights: prior.samples.iter().map(|&n| n as f64).collect(),
            state: PowerOfChoiceState {
                losses: vec![f64::INFINITY; total],
            },
        }
    }

    /// Continues from a checkpoint's `state`.
    pub fn restore(
        options: PowerOfChoiceOptions,
        per_round: u32,
        prior: &ClientPrior,
        state: PowerOfChoiceState,
    ) -> Result<Self, String> {
        let mut policy = Self::new(options, per_round, prior);
        if state.losses.len() != policy.state.losses.len() {
            return Err(format!(
                "its power_of_choice state has {} clients, the run {}",
                state.losses.len(),
                policy.state.losses.len()
            ));
        }
        if let Some(client) = state.losses.iter().position(|l| l.is_nan() || *l < 0.0) {
            return Err(format!(
                "its power_of_choice loss of client {} is {}, not a loss",
                client + 1,
                state.losses[client]
            ));
        }
        policy.state = state;
        Ok(policy)
    }

    pub fn state(&self) -> &PowerOfChoiceState {
        &self.state
    }

    /// `count` of `candidates`: a candidate set drawn by data size, then the
    /// highest losses in it.
    pub fn select(&mut self, rng: &mut ChaCha8Rng, candidates: &[u32], count: usize) -> Vec<u32> {
        let count = count.min(candidates.len());
        if count == 0 {
            return Vec::new();
        }
        let scaled =
            (count as u64 * u64::from(self.candidates)).div_ceil(u64::from(self.per_round));
        let size = (scaled as usize).clamp(count, candidates.len());
        let weights: Vec<f64> = candidates
            .iter()
            .map(|&c| self.weights.get(c as usize - 1).copied().unwrap_or(0.0))
            .collect();
        let drawn = weighted_draws(rng, candidates, &weights, size);
        highest_loss(&drawn, &self.state.losses, count)
    }

    /// The losses of the clients that trained.
    pub fn observe(&mut self, feedback: &[Feedback]) {
        for f in feedback {
            if let Some(slot) = self.state.losses.get_mut(f.client_id as usize - 1)
                && f.loss.is_finite()
            {
                *slot = f.loss;
            }
        }
    }
}

/// The `count` clients of `drawn` with the highest `losses` (index `c − 1`),
/// equal losses in the order drawn.
pub fn highest_loss(drawn: &[u32], losses: &[f64], count: usize) -> Vec<u32> {
    let loss = |c: u32| losses.get(c as usize - 1).copied().unwrap_or(f64::INFINITY);
    let mut ranked = drawn.to_vec();
    ranked.sort_by(|&a, &b| loss(b).total_cmp(&loss(a)));
    ranked.truncate(count);
    ranked
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn prior(samples: &[u64]) -> ClientPrior {
        ClientPrior {
            samples: samples.to_vec(),
            durations: samples.iter().map(|&n| n as f64).collect(),
        }
    }

    fn feedback(client_id: u32, loss: f64) -> Feedback {
        Feedback {
            client_id,
            samples: 10,
            loss,
            duration: 10.0,
        }
    }

    #[test]
    fn with_every_client_a_candidate_the_highest_losses_are_chosen() {
        // d = 5 of 5: the candidate set is everyone, so the choice is the
        // m = 2 highest losses. Round 1: nobody has reported, every loss is
        // infinite and the two are the first two drawn.
        let options = PowerOfChoiceOptions {
            candidates: Some(5),
        };
        let mut policy = PowerOfChoice::new(options, 2, &prior(&[10, 20, 30, 40, 50]));
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let all = [1, 2, 3, 4, 5];
        assert_eq!(policy.select(&mut rng, &all, 2).len(), 2);
        // Losses 0.5, —, 2.0, 1.0, 0.1: client 2 has never reported (∞),
        // then client 3's 2.0.
        policy.observe(&[
            feedback(1, 0.5),
            feedback(3, 2.0),
            feedback(4, 1.0),
            feedback(5, 0.1),
        ]);
        assert_eq!(policy.select(&mut rng, &all, 2), [2, 3]);
        // Client 2 reports 0.2, client 3 1.5: now 3 (1.5) and 4 (1.0).
        policy.observe(&[feedback(2, 0.2), feedback(3, 1.5)]);
        assert_eq!(policy.select(&mut rng, &all, 2), [3, 4]);
        // Among the online 1, 2, 5 only: 1 (0.5) and 2 (0.2).
        assert_eq!(policy.select(&mut rng, &[1, 2, 5], 2), [1, 2]);
    }

    #[test]
    fn ranking_by_hand() {
        let losses = [0.3, 0.9, 0.3, f64::INFINITY];
        assert_eq!(highest_loss(&[1, 2, 3, 4], &losses, 3), [4, 2, 1]);
        // Equal losses keep the draw's order.
        assert_eq!(highest_loss(&[3, 1], &losses, 2), [3, 1]);
    }

    #[test]
    fn candidates_are_drawn_by_data_size() {
        // d = m = 1: the choice is the one candidate, drawn by size, so client
        // 2 (90 of 100 samples) is chosen about nine times in ten.
        let options = PowerOfChoiceOptions {
            candidates: Some(1),
        };
        let mut policy = PowerOfChoice::new(options, 1, &prior(&[10, 90]));
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let twos = (0..2000)
            .filter(|_| policy.select(&mut rng, &[1, 2], 1) == [2])
            .count();
        assert!((1700..1900).contains(&twos), "{twos}");
    }

    #[test]
    fn fewer_places_draw_fewer_candidates() {
        // d = 4, per_round = 2: one place draws 2 candidates. Client 1's loss
        // is the highest, so it is chosen exactly when it is drawn.
        let options = PowerOfChoiceOptions {
            candidates: Some(4),
        };
        let mut policy = PowerOfChoice::new(options, 2, &prior(&[10; 4]));
        policy.observe(&[
            feedback(1, 9.0),
            feedback(2, 1.0),
            feedback(3, 1.0),
            feedback(4, 1.0),
        ]);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let ones = (0..2000)
            .filter(|_| policy.select(&mut rng, &[1, 2, 3, 4], 1) == [1])
            .count();
        // P(client 1 among 2 of 4 equal weights) = 1/2.
        assert!((900..1100).contains(&ones), "{ones}");
    }

    #[test]
    fn options_are_checked_and_state_restores() {
        let options = PowerOfChoiceOptions {
            candidates: Some(3),
        };
        assert!(options.check(2, 10).is_ok());
        assert!(options.check(4, 10).unwrap_err().contains("got 3"));
        assert!(
            options
                .check(1, 2)
                .unwrap_err()
                .contains("total_clients = 2")
        );
        assert_eq!(PowerOfChoiceOptions::default().candidates_of(3, 100), 6);
        assert_eq!(PowerOfChoiceOptions::default().candidates_of(3, 5), 5);

        let mut policy = PowerOfChoice::new(options, 2, &prior(&[1, 2, 3]));
        policy.observe(&[feedback(2, 0.7)]);
        let json = serde_json::to_string(policy.state()).unwrap();
        let state: PowerOfChoiceState = serde_json::from_str(&json).unwrap();
        let restored = PowerOfChoice::restore(options, 2, &prior(&[1, 2, 3]), state.clone());
        assert_eq!(restored.unwrap().state(), policy.state());
        let refused = PowerOfChoice::restore(options, 2, &prior(&[1, 2]), state).unwrap_err();
        assert!(refused.contains("3 clients, the run 2"), "{refused}");
    }
}
