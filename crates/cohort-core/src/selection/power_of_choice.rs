//! Power-of-choice selection (Cho, Wang and Joshi 2020, "Client Selection in
//! Federated Learning: Convergence Analysis and Power-of-Choice Selection
//! Strategies").
//!
//! Each round the server draws a candidate set of `d` clients without
//! replacement, each draw with probability proportional to the client's
//! share of the data (`p_k = n_k / n`), and selects the `m = per_round`
//! candidates with the highest local loss `F_k(w)`. Equal losses keep the
//! order the candidates were drawn in (the paper breaks ties at random; the
//! draw order is a seeded random order).
//!
//! Where the loss comes from is [`PowerOfChoiceLoss`]:
//! * `evaluated`, the paper's pow-d: the server sends the current global
//!   model to the `d` candidates and each computes `F_k(w)`, the mean loss
//!   of `w` over all of its local training data, before the server selects.
//!   The choice is two steps here: [`PowerOfChoice::draw_candidates`]
//!   (seeded, from the selector's stream), then [`PowerOfChoice::choose`]
//!   from the losses the runtime's evaluation pass brought back. The
//!   paper's cpow-d, which estimates `F_k(w)` on a mini-batch, is not
//!   implemented: a pass over the partition is exact and, simulated, cheap.
//! * `last_reported`, the paper's communication- and computation-free
//!   rpow-d: a client's loss is the mean training loss it reported the last
//!   time it trained (the loss of the model it started from, averaged over
//!   its local steps), and a client that never trained counts as having an
//!   infinite loss, so every client is tried before any is passed over for
//!   its loss. [`PowerOfChoice::select`] draws and chooses in one call.
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
    /// Which loss ranks the candidates. Default: `evaluated` where the run
    /// can evaluate the candidates (synchronous rounds of simulated
    /// clients), `last_reported` elsewhere. Unset, it stays out of the
    /// config hash, so runs started before it existed keep theirs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss: Option<PowerOfChoiceLoss>,
}

/// `clients.power_of_choice.loss`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PowerOfChoiceLoss {
    /// pow-d: each candidate's loss of the current global model on its
    /// training data, computed for the choice.
    Evaluated,
    /// rpow-d: each client's training loss from the last time it trained.
    LastReported,
}

impl PowerOfChoiceLoss {
    /// The name as written in a config.
    pub fn name(self) -> &'static str {
        match self {
            PowerOfChoiceLoss::Evaluated => "evaluated",
            PowerOfChoiceLoss::LastReported => "last_reported",
        }
    }
}

impl PowerOfChoiceOptions {
    /// d for a run of `per_round` of `total` clients.
    pub fn candidates_of(&self, per_round: u32, total: u32) -> u32 {
        self.candidates
            .unwrap_or(per_round.saturating_mul(2))
            .min(total)
    }

    /// The loss of a run that can evaluate its candidates (`pass_possible`)
    /// or cannot: `loss`, or by default the paper's pow-d where it can run.
    pub fn loss_of(&self, pass_possible: bool) -> PowerOfChoiceLoss {
        self.loss.unwrap_or(if pass_possible {
            PowerOfChoiceLoss::Evaluated
        } else {
            PowerOfChoiceLoss::LastReported
        })
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

/// What the policy remembers: each client's last loss.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PowerOfChoiceState {
    /// Index `c − 1`: client `c`'s loss; `inf` until it has one. With
    /// `evaluated`, the loss of its last evaluation, which no choice reads
    /// again (each round evaluates afresh) but a checkpoint shows.
    #[serde(with = "exact::list")]
    pub losses: Vec<f64>,
    /// The loss the state was learnt by; `None` in checkpoints written
    /// before the choice existed, which were all `last_reported`.
    #[serde(default)]
    pub loss: Option<PowerOfChoiceLoss>,
}

#[derive(Debug, Clone)]
pub struct PowerOfChoice {
    /// d.
    candidates: u32,
    per_round: u32,
    loss: PowerOfChoiceLoss,
    /// Each client's data size, the candidate draw's weight.
    weights: Vec<f64>,
    state: PowerOfChoiceState,
}

impl PowerOfChoice {
    /// A policy that has seen no client; `options.loss` unset is the
    /// paper's pow-d (the runtime sets it to what the run can do).
    pub fn new(options: PowerOfChoiceOptions, per_round: u32, prior: &ClientPrior) -> Self {
        let total = prior.samples.len();
        let loss = options.loss.unwrap_or(PowerOfChoiceLoss::Evaluated);
        Self {
            candidates: options.candidates_of(per_round, total as u32),
            per_round: per_round.max(1),
            loss,
            weights: prior.samples.iter().map(|&n| n as f64).collect(),
            state: PowerOfChoiceState {
                losses: vec![f64::INFINITY; total],
                loss: Some(loss),
            },
        }
    }

    /// Continues from a checkpoint's `state`. A state from before the loss
    /// could be chosen continues as it was learnt, `last_reported`: its run
    /// has the same config hash as one of today's default.
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
        let learnt = state.loss.unwrap_or(PowerOfChoiceLoss::LastReported);
        if state.loss.is_some() && learnt != policy.loss {
            return Err(format!(
                "its power_of_choice state ranks by clients.power_of_choice.loss = \"{}\", and \
                 this run by \"{}\"",
                learnt.name(),
                policy.loss.name()
            ));
        }
        policy.loss = learnt;
        policy.state = PowerOfChoiceState {
            loss: Some(learnt),
            ..state
        };
        Ok(policy)
    }

    pub fn state(&self) -> &PowerOfChoiceState {
        &self.state
    }

    /// What ranks the candidates.
    pub fn loss(&self) -> PowerOfChoiceLoss {
        self.loss
    }

    /// `count` of `available`: a candidate set drawn by data size, then the
    /// highest losses the policy knows in it (with `evaluated`, each
    /// candidate's last evaluated loss: the runtime's synchronous rounds
    /// evaluate first, [`PowerOfChoice::draw_candidates`] and
    /// [`PowerOfChoice::choose`]).
    pub fn select(&mut self, rng: &mut ChaCha8Rng, available: &[u32], count: usize) -> Vec<u32> {
        let drawn = self.draw_candidates(rng, available, count);
        highest_loss(&drawn, &self.state.losses, count.min(drawn.len()))
    }

    /// pow-d's first step: the candidate set for `count` places among
    /// `available`, drawn by data size, in the order drawn.
    pub fn draw_candidates(
        &mut self,
        rng: &mut ChaCha8Rng,
        available: &[u32],
        count: usize,
    ) -> Vec<u32> {
        let count = count.min(available.len());
        if count == 0 {
            return Vec::new();
        }
        let scaled =
            (count as u64 * u64::from(self.candidates)).div_ceil(u64::from(self.per_round));
        let size = (scaled as usize).clamp(count, available.len());
        let weights: Vec<f64> = available
            .iter()
            .map(|&c| self.weights.get(c as usize - 1).copied().unwrap_or(0.0))
            .collect();
        weighted_draws(rng, available, &weights, size)
    }

    /// pow-d's second step: the `count` of `candidates` (as drawn) with the
    /// highest `losses` (one per candidate, in the same order). A loss that
    /// is not a number counts as infinite: the model is at its worst there.
    /// A candidate without a loss (`-inf`: its evaluation failed) comes
    /// after every evaluated one. The evaluated losses are kept as the
    /// clients' last.
    pub fn choose(&mut self, candidates: &[u32], losses: &[f64], count: usize) -> Vec<u32> {
        let mut known = vec![f64::NEG_INFINITY; self.state.losses.len()];
        for (&client, &loss) in candidates.iter().zip(losses) {
            let loss = if loss.is_nan() { f64::INFINITY } else { loss };
            let index = client as usize - 1;
            if let Some(slot) = known.get_mut(index) {
                *slot = loss;
            }
            if loss >= 0.0
                && let Some(slot) = self.state.losses.get_mut(index)
            {
                *slot = loss;
            }
        }
        highest_loss(candidates, &known, count.min(candidates.len()))
    }

    /// The training losses of the clients that trained; with `evaluated`,
    /// nothing: the next choice evaluates afresh.
    pub fn observe(&mut self, feedback: &[Feedback]) {
        if self.loss == PowerOfChoiceLoss::Evaluated {
            return;
        }
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

    fn last_reported(candidates: u32) -> PowerOfChoiceOptions {
        PowerOfChoiceOptions {
            candidates: Some(candidates),
            loss: Some(PowerOfChoiceLoss::LastReported),
        }
    }

    fn evaluated(candidates: u32) -> PowerOfChoiceOptions {
        PowerOfChoiceOptions {
            candidates: Some(candidates),
            loss: Some(PowerOfChoiceLoss::Evaluated),
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
        let options = last_reported(5);
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
        let options = last_reported(1);
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
        let options = last_reported(4);
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
        let options = last_reported(3);
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

    #[test]
    fn evaluated_losses_choose_the_highest_ties_in_draw_order() {
        let mut policy = PowerOfChoice::new(evaluated(4), 2, &prior(&[10; 5]));
        // Drawn 3, 1, 5, 2 with losses 0.5, 2.0, 2.0, NaN: the NaN counts as
        // infinite, so client 2 first; 1 and 5 tie at 2.0 and 1 was drawn
        // first.
        let (drawn, losses) = ([3, 1, 5, 2], [0.5, 2.0, 2.0, f64::NAN]);
        assert_eq!(policy.choose(&drawn, &losses, 2), [2, 1]);
        assert_eq!(policy.choose(&drawn, &losses, 3), [2, 1, 5]);
        // What was evaluated is kept; client 4 was not a candidate.
        let kept = &policy.state().losses;
        assert_eq!(kept[..3], [2.0, f64::INFINITY, 0.5]);
        assert_eq!(kept[3], f64::INFINITY);
        // A failed evaluation (-inf) comes after any loss, and is not kept.
        assert_eq!(policy.choose(&[4, 2], &[f64::NEG_INFINITY, 0.1], 1), [2]);
        assert_eq!(policy.state().losses[3], f64::INFINITY);
        // Training reports teach pow-d nothing: each choice evaluates afresh.
        policy.observe(&[feedback(4, 0.3)]);
        assert_eq!(policy.state().losses[3], f64::INFINITY);
    }

    #[test]
    fn the_candidate_draw_is_the_one_step_draw_of_the_same_stream() {
        // d = 3 of 6, per_round = 2: three candidates for two places, two
        // for one (⌈1 · 3 / 2⌉), drawn from the stream as `select` draws.
        let sizes = prior(&[5, 10, 15, 20, 25, 30]);
        let all = [1, 2, 3, 4, 5, 6];
        let mut two_step = PowerOfChoice::new(evaluated(3), 2, &sizes);
        let mut one_step = PowerOfChoice::new(evaluated(3), 2, &sizes);
        let (mut a, mut b) = (ChaCha8Rng::seed_from_u64(7), ChaCha8Rng::seed_from_u64(7));
        for count in [2, 1, 2] {
            let drawn = two_step.draw_candidates(&mut a, &all, count);
            assert_eq!(drawn.len(), if count == 2 { 3 } else { 2 });
            // Nothing evaluated yet: every loss is infinite, ties in draw order.
            let picked = one_step.select(&mut b, &all, count);
            assert_eq!(picked, drawn[..count]);
        }
        assert_eq!(a.get_word_pos(), b.get_word_pos());
    }

    #[test]
    fn a_checkpoint_from_before_the_choice_continues_as_last_reported() {
        let sizes = prior(&[1, 2]);
        let old: PowerOfChoiceState = serde_json::from_str(r#"{"losses":["0.5","inf"]}"#).unwrap();
        assert_eq!(old.loss, None);
        let options = PowerOfChoiceOptions::default();
        let restored = PowerOfChoice::restore(options, 1, &sizes, old).unwrap();
        assert_eq!(restored.loss(), PowerOfChoiceLoss::LastReported);
        assert_eq!(restored.state().loss, Some(PowerOfChoiceLoss::LastReported));
        // A state that says which it was must be this run's.
        let rpow = PowerOfChoice::new(last_reported(2), 1, &sizes)
            .state()
            .clone();
        let refused = PowerOfChoice::restore(evaluated(2), 1, &sizes, rpow).unwrap_err();
        assert!(
            refused.contains(
                "clients.power_of_choice.loss = \"last_reported\", and this run by \"evaluated\""
            ),
            "{refused}"
        );
        assert_eq!(options.loss_of(true), PowerOfChoiceLoss::Evaluated);
        assert_eq!(options.loss_of(false), PowerOfChoiceLoss::LastReported);
        assert_eq!(
            last_reported(2).loss_of(true),
            PowerOfChoiceLoss::LastReported
        );
    }
}
