//! Oort's training selector (Lai, Zhu, Madhyastha and Chowdhury, "Oort:
//! Efficient Federated Learning via Guided Participant Selection", OSDI
//! 2021), following its published code (`SymbioticLab/Oort`, `oort/oort.py`,
//! `_training_selector.getTopK`) and its default parameters.
//!
//! Each client is an arm with a statistical utility `U_i`, the last
//! duration `t_i` of its task, the round `τ_i` it last trained in and how
//! often it trained. Selecting `K` clients for round `R`:
//!
//! 1. once per round, the **pacer**: the exploited clients' mean utility of
//!    the last round is kept; every `pacer_step` rounds, if the sum over
//!    the last `pacer_step` rounds moved by at most 10 % from the sum over
//!    the `pacer_step` before, the preferred-duration percentile
//!    `round_threshold` rises by `pacer_delta` (at most 100); if it moved by
//!    5 times or more, it falls by `pacer_delta` (at least `pacer_delta`).
//!    Then the exploration factor `ε ← max(ε · exploration_decay,
//!    exploration_min)`;
//! 2. clients that trained more than `blacklist_rounds` times (at most
//!    `blacklist_max_len` of all) are left out;
//! 3. the preferred duration `T` is the `round_threshold` percentile of all
//!    clients' durations (infinite at 100);
//! 4. every client that has trained scores
//!    `(min(U_i, clip) − U_min) / (U_max − U_min) + √(0.1 · ln R / τ_i)`,
//!    times `(T / t_i)^round_penalty` when `t_i > T`, with `U_min`, `U_max`
//!    (`U_min` scaled by 0.999) and `clip` (the `clip_bound` quantile) over
//!    the positive utilities of the clients that can be drawn;
//! 5. `⌊K · (1 − ε)⌋` of them are exploited: drawn without replacement, by
//!    score, among those scoring at least `cut_off_util` times the score
//!    just below the cut;
//! 6. the other places **explore** clients that never trained: drawn by
//!    their data size (with the same duration penalty) among the
//!    `sample_window` times as many largest ones; once no client is left
//!    unexplored, ε and its minimum become 0;
//! 7. places still free are filled uniformly.
//!
//! A client's utility after it trained is Oort's `|B_i| · √(mean of its
//! samples' squared losses)` with `|B_i|` its training samples; cohort's
//! reports carry the mean training loss, not each sample's, so cohort uses
//! `|B_i| · L̄_i`, a lower bound of Oort's (by Jensen's inequality, equal
//! when the samples' losses are equal). Before it trains, a client's
//! utility is its data size and its duration the server's estimate, as in
//! Oort's `register_client`. Durations are simulated seconds with device
//! profiles, else training samples (what a task costs at equal speed), never
//! measured times, so the choice is the same with any number of workers.
//!
//! Where Oort's code would fail (an index past the last score, drawing more
//! clients than can be drawn) cohort takes the nearest meaningful choice:
//! the cut uses the last score, and no more clients are drawn than there
//! are outside the blacklist.

use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{ClientPrior, Feedback, exact, weighted_draws};

/// `[clients.oort]`: Oort's parameters under its own names, with its
/// defaults (`training/argParser.py`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OortOptions {
    /// ε at the start, the share of places given to exploration. Default 0.9.
    pub exploration_factor: f64,
    /// ε's factor each round. Default 0.95.
    pub exploration_decay: f64,
    /// ε's floor. Default 0.2.
    pub exploration_min: f64,
    /// The preferred duration's percentile of all durations, at the start.
    /// Default 10.
    pub round_threshold: f64,
    /// α of the `(T / t_i)^α` penalty. Default 2.
    pub round_penalty: f64,
    /// Rounds between the pacer's looks. Default 20.
    pub pacer_step: u32,
    /// The pacer's change of `round_threshold`. Default 5.
    pub pacer_delta: f64,
    /// Exploited clients are drawn among those scoring at least this times
    /// the cut's score. Default 0.7.
    pub cut_off_util: f64,
    /// Unexplored clients are drawn among this many times the places' count
    /// of the largest. Default 5.
    pub sample_window: f64,
    /// The quantile of utilities that clips them. Default 0.98.
    pub clip_bound: f64,
    /// A client that trained more than this many times is left out.
    /// Default: none (Oort's −1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blacklist_rounds: Option<u32>,
    /// The most clients left out, as a share of all. Default 0.3.
    pub blacklist_max_len: f64,
}

impl Default for OortOptions {
    fn default() -> Self {
        Self {
            exploration_factor: 0.9,
            exploration_decay: 0.95,
            exploration_min: 0.2,
            round_threshold: 10.0,
            round_penalty: 2.0,
            pacer_step: 20,
            pacer_delta: 5.0,
            cut_off_util: 0.7,
            sample_window: 5.0,
            clip_bound: 0.98,
            blacklist_rounds: None,
            blacklist_max_len: 0.3,
        }
    }
}

impl OortOptions {
    /// Each option out of its range, as (key under `clients.oort`, why).
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let within = |value: f64, low: f64, high: f64, low_open: bool| {
            value.is_finite() && value <= high && if low_open { value > low } else { value >= low }
        };
        let checks = [
            (
                "exploration_factor",
                self.exploration_factor,
                0.0,
                1.0,
                false,
                "[0, 1]",
            ),
            (
                "exploration_decay",
                self.exploration_decay,
                0.0,
                1.0,
                true,
                "(0, 1]",
            ),
            (
                "exploration_min",
                self.exploration_min,
                0.0,
                1.0,
                false,
                "[0, 1]",
            ),
            (
                "round_threshold",
                self.round_threshold,
                0.0,
                100.0,
                true,
                "(0, 100]",
            ),
            (
                "round_penalty",
                self.round_penalty,
                0.0,
                100.0,
                false,
                "[0, 100]",
            ),
            (
                "pacer_delta",
                self.pacer_delta,
                0.0,
                100.0,
                true,
                "(0, 100]",
            ),
            ("cut_off_util", self.cut_off_util, 0.0, 1.0, true, "(0, 1]"),
            (
                "sample_window",
                self.sample_window,
                1.0,
                1e6,
                false,
                "[1, 1e6]",
            ),
            ("clip_bound", self.clip_bound, 0.0, 1.0, true, "(0, 1]"),
            (
                "blacklist_max_len",
                self.blacklist_max_len,
                0.0,
                1.0,
                false,
                "[0, 1]",
            ),
        ];
        let mut problems: Vec<(&'static str, String)> = checks
            .into_iter()
            .filter(|&(_, value, low, high, open, _)| !within(value, low, high, open))
            .map(|(key, value, _, _, _, range)| (key, format!("must be in {range}, got {value}")))
            .collect();
        if self.pacer_step == 0 {
            problems.push(("pacer_step", "must be at least 1 round, got 0".to_owned()));
        }
        problems
    }
}

/// One client as Oort sees it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Arm {
    /// Statistical utility: data size until it trains, then `|B_i| · L̄_i`.
    #[serde(with = "exact")]
    pub reward: f64,
    /// Its last task's duration (or the estimate).
    #[serde(with = "exact")]
    pub duration: f64,
    /// The round it last trained in (0: never).
    pub time_stamp: u32,
    /// Times it trained.
    pub count: u32,
}

/// Oort's state between selections, as a checkpoint keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OortState {
    /// Index `c − 1`: client `c`.
    pub arms: Vec<Arm>,
    /// The round last selected for (0: none yet).
    pub round: u32,
    #[serde(with = "exact")]
    pub exploration: f64,
    #[serde(with = "exact")]
    pub exploration_min: f64,
    /// The preferred duration's percentile now.
    #[serde(with = "exact")]
    pub round_threshold: f64,
    /// The exploited clients' mean utility, one entry a round.
    #[serde(with = "exact::list")]
    pub exploit_history: Vec<f64>,
    /// The clients exploited for `round`.
    pub exploit_clients: Vec<u32>,
    /// Clients that reported since the pacer last looked, in id order.
    pub successful: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct Oort {
    options: OortOptions,
    state: OortState,
}

impl Oort {
    pub fn new(options: OortOptions, prior: &ClientPrior) -> Self {
        let arms = prior
            .samples
            .iter()
            .zip(&prior.durations)
            .map(|(&samples, &duration)| Arm {
                reward: samples as f64,
                duration,
                time_stamp: 0,
                count: 0,
            })
            .collect();
        Self {
            options,
            state: OortState {
                arms,
                round: 0,
                exploration: options.exploration_factor,
                exploration_min: options.exploration_min,
                round_threshold: options.round_threshold,
                exploit_history: Vec::new(),
                exploit_clients: Vec::new(),
                successful: Vec::new(),
            },
        }
    }

    /// Continues from a checkpoint's `state` for a run of `clients` clients.
    pub fn restore(options: OortOptions, clients: usize, state: OortState) -> Result<Self, String> {
        if state.arms.len() != clients {
            return Err(format!(
                "its oort state has {} clients, the run {clients}",
                state.arms.len()
            ));
        }
        let numbers = state
            .arms
            .iter()
            .flat_map(|a| [a.reward, a.duration])
            .chain([
                state.exploration,
                state.exploration_min,
                state.round_threshold,
            ])
            .chain(state.exploit_history.iter().copied());
        if numbers.into_iter().any(|x| x.is_nan()) {
            return Err("its oort state holds a value that is not a number".to_owned());
        }
        let known = |c: &u32| (1..=clients as u32).contains(c);
        if !state
            .exploit_clients
            .iter()
            .chain(&state.successful)
            .all(known)
        {
            return Err("its oort state names a client the run does not have".to_owned());
        }
        Ok(Self { options, state })
    }

    pub fn state(&self) -> &OortState {
        &self.state
    }

    /// `count` of `candidates` for `round`.
    pub fn select(
        &mut self,
        rng: &mut ChaCha8Rng,
        round: u32,
        candidates: &[u32],
        count: usize,
    ) -> Vec<u32> {
        if round != self.state.round {
            self.advance(round);
        }
        let blacklist = self.blacklist();
        let mut ordered: Vec<u32> = candidates
            .iter()
            .copied()
            .filter(|c| self.arm(*c).is_some() && !blacklist.contains(c))
            .collect();
        ordered.sort_unstable();
        ordered.dedup();
        let count = count.min(ordered.len());
        let preferred = self.preferred_duration();
        let mut picked = self.exploit(rng, round, &ordered, count, preferred);
        self.state.exploit_clients.extend_from_slice(&picked);
        if self.state.arms.iter().any(|a| a.count == 0) {
            let explored = self.explore(rng, &ordered, count - picked.len(), preferred);
            picked.extend(explored);
        } else {
            self.state.exploration = 0.0;
            self.state.exploration_min = 0.0;
        }
        let rest: Vec<u32> = ordered
            .iter()
            .copied()
            .filter(|c| !picked.contains(c))
            .collect();
        let missing = count - picked.len();
        picked.extend(
            rand::seq::index::sample(rng, rest.len(), missing)
                .into_iter()
                .map(|i| rest[i]),
        );
        picked
    }

    /// What `round`'s clients reported.
    pub fn observe(&mut self, round: u32, feedback: &[Feedback]) {
        for f in feedback {
            let Some(arm) = self.arm_mut(f.client_id) else {
                continue;
            };
            let reward = f.samples as f64 * f.loss;
            if reward.is_finite() {
                arm.reward = reward.max(0.0);
            }
            if f.duration.is_finite() {
                arm.duration = f.duration;
            }
            arm.time_stamp = round;
            arm.count = arm.count.saturating_add(1);
            if let Err(at) = self.state.successful.binary_search(&f.client_id) {
                self.state.successful.insert(at, f.client_id);
            }
        }
    }

    /// A task of `client` that brought no update took `duration`.
    pub fn observe_duration(&mut self, client: u32, duration: f64) {
        if let Some(arm) = self.arm_mut(client)
            && duration.is_finite()
        {
            arm.duration = duration;
        }
    }

    fn arm(&self, client: u32) -> Option<&Arm> {
        (client as usize)
            .checked_sub(1)
            .and_then(|i| self.state.arms.get(i))
    }

    fn arm_mut(&mut self, client: u32) -> Option<&mut Arm> {
        (client as usize)
            .checked_sub(1)
            .and_then(|i| self.state.arms.get_mut(i))
    }

    /// Once per round: the pacer, then the exploration factor's decay.
    fn advance(&mut self, round: u32) {
        self.state.round = round;
        self.pacer(round);
        self.state.exploit_clients.clear();
        let options = &self.options;
        self.state.exploration =
            (self.state.exploration * options.exploration_decay).max(self.state.exploration_min);
    }

    /// Oort's `pacer`: the last round's exploited utility, and every
    /// `pacer_step` rounds the preferred duration relaxed when the utility
    /// stalled, tightened when it jumped.
    fn pacer(&mut self, round: u32) {
        let state = &mut self.state;
        let (mut count, mut sum) = (1e-4, 0.0);
        for client in &state.exploit_clients {
            if state.successful.binary_search(client).is_ok() {
                count += 1.0;
                sum += state.arms[*client as usize - 1].reward;
            }
        }
        state.exploit_history.push(sum / count);
        state.successful.clear();
        let step = self.options.pacer_step as usize;
        let history = &state.exploit_history;
        if (round as usize) < 2 * step || !round.is_multiple_of(self.options.pacer_step) {
            return;
        }
        let Some(start) = history.len().checked_sub(2 * step) else {
            return;
        };
        let last: f64 = history[start..start + step].iter().sum();
        let current: f64 = history[start + step..].iter().sum();
        let delta = self.options.pacer_delta;
        if (current - last).abs() <= last * 0.1 {
            state.round_threshold = (state.round_threshold + delta).min(100.0);
        } else if (current - last).abs() >= last * 5.0 {
            state.round_threshold = (state.round_threshold - delta).max(delta);
        }
    }

    /// Clients that trained more than `blacklist_rounds` times, most first,
    /// at most `blacklist_max_len` of all.
    fn blacklist(&self) -> Vec<u32> {
        let Some(limit) = self.options.blacklist_rounds else {
            return Vec::new();
        };
        let mut ids: Vec<u32> = (1..=self.state.arms.len() as u32).collect();
        ids.sort_by_key(|&c| std::cmp::Reverse(self.state.arms[c as usize - 1].count));
        let most = (self.options.blacklist_max_len * self.state.arms.len() as f64) as usize;
        ids.into_iter()
            .take_while(|&c| self.state.arms[c as usize - 1].count > limit)
            .take(most)
            .collect()
    }

    /// T: the `round_threshold` percentile of every client's duration.
    fn preferred_duration(&self) -> f64 {
        let threshold = self.state.round_threshold;
        if threshold >= 100.0 || self.state.arms.is_empty() {
            return f64::INFINITY;
        }
        let mut durations: Vec<f64> = self.state.arms.iter().map(|a| a.duration).collect();
        durations.sort_by(f64::total_cmp);
        let at = ((durations.len() as f64 * threshold / 100.0) as usize).min(durations.len() - 1);
        durations[at]
    }

    /// `value` scaled down by `(T / duration)^round_penalty` when slower than T.
    fn penalised(&self, value: f64, duration: f64, preferred: f64) -> f64 {
        if duration > preferred {
            value * (preferred / duration.max(1e-4)).powf(self.options.round_penalty)
        } else {
            value
        }
    }

    /// Each client of `ordered` that has trained, with its score for `round`.
    pub fn scores(&self, round: u32, ordered: &[u32], preferred: f64) -> Vec<(u32, f64)> {
        let mut rewards: Vec<f64> = ordered
            .iter()
            .map(|&c| self.state.arms[c as usize - 1].reward)
            .filter(|&r| r > 0.0)
            .collect();
        rewards.sort_by(f64::total_cmp);
        let (clip, low, range) = match (rewards.first(), rewards.last()) {
            (Some(&first), Some(&last)) => {
                let at = ((rewards.len() as f64 * self.options.clip_bound) as usize)
                    .min(rewards.len() - 1);
                let low = first * 0.999;
                (rewards[at], low, (last - low).max(1e-4))
            }
            _ => (f64::INFINITY, 0.0, 1e-4),
        };
        let uncertainty = 0.1 * f64::from(round.max(1)).ln();
        ordered
            .iter()
            .filter_map(|&c| {
                let arm = &self.state.arms[c as usize - 1];
                (arm.count > 0).then(|| {
                    let score = (arm.reward.min(clip) - low) / range
                        + (uncertainty / f64::from(arm.time_stamp.max(1))).sqrt();
                    (c, self.penalised(score, arm.duration, preferred))
                })
            })
            .collect()
    }

    /// `⌊count · (1 − ε)⌋` clients that have trained, drawn by score above
    /// the cut.
    fn exploit(
        &self,
        rng: &mut ChaCha8Rng,
        round: u32,
        ordered: &[u32],
        count: usize,
        preferred: f64,
    ) -> Vec<u32> {
        let mut scores = self.scores(round, ordered, preferred);
        let wanted = ((count as f64 * (1.0 - self.state.exploration)) as usize).min(scores.len());
        if wanted == 0 {
            return Vec::new();
        }
        // Stable: equal scores keep the id order, as Oort's sorted() does.
        scores.sort_by(|a, b| b.1.total_cmp(&a.1));
        let cut = scores[wanted.min(scores.len() - 1)].1 * self.options.cut_off_util;
        let pool: Vec<(u32, f64)> = scores.into_iter().take_while(|s| s.1 >= cut).collect();
        let (ids, weights): (Vec<u32>, Vec<f64>) = pool.into_iter().unzip();
        weighted_draws(rng, &ids, &weights, wanted)
    }

    /// Up to `places` clients that never trained, drawn by data size among
    /// the `sample_window · places` largest (slow ones penalised).
    fn explore(
        &self,
        rng: &mut ChaCha8Rng,
        ordered: &[u32],
        places: usize,
        preferred: f64,
    ) -> Vec<u32> {
        let mut fresh: Vec<(u32, f64)> = ordered
            .iter()
            .filter_map(|&c| {
                let arm = &self.state.arms[c as usize - 1];
                (arm.count == 0).then(|| (c, self.penalised(arm.reward, arm.duration, preferred)))
            })
            .collect();
        let places = places.min(fresh.len());
        fresh.sort_by(|a, b| b.1.total_cmp(&a.1));
        let window = ((self.options.sample_window * places as f64) as usize).min(fresh.len());
        fresh.truncate(window);
        let (ids, weights): (Vec<u32>, Vec<f64>) = fresh.into_iter().unzip();
        weighted_draws(rng, &ids, &weights, places)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn oort(options: OortOptions, samples: &[u64], durations: &[f64]) -> Oort {
        Oort::new(
            options,
            &ClientPrior {
                samples: samples.to_vec(),
                durations: durations.to_vec(),
            },
        )
    }

    fn report(client_id: u32, samples: u64, loss: f64, duration: f64) -> Feedback {
        Feedback {
            client_id,
            samples,
            loss,
            duration,
        }
    }

    #[test]
    fn two_rounds_by_hand() {
        // 4 clients of 10, 20, 30, 40 samples taking 1, 1, 1, 10 s; K = 2,
        // ε = 0.5 kept there, one unexplored client drawn from a window of
        // as many as places (sample_window = 1).
        let options = OortOptions {
            exploration_factor: 0.5,
            exploration_decay: 1.0,
            exploration_min: 0.5,
            sample_window: 1.0,
            ..OortOptions::default()
        };
        let mut selector = oort(options, &[10, 20, 30, 40], &[1.0, 1.0, 1.0, 10.0]);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let all = [1, 2, 3, 4];
        // Round 1: nobody trained, so ⌊2 · 0.5⌋ = 1 exploited place has no
        // one to exploit and both places explore. T is the 10th percentile
        // of (1, 1, 1, 10) = 1 s, so client 4 weighs 40 · (1/10)² = 0.4; the
        // window is the 2 largest, 3 (30) and 2 (20), and both are drawn.
        let mut first = selector.select(&mut rng, 1, &all, 2);
        first.sort_unstable();
        assert_eq!(first, [2, 3]);
        // Client 2: 20 samples at loss 0.5 → U = 10, 1 s; client 3: 30 at
        // 1.0 → U = 30, 2 s.
        selector.observe(1, &[report(2, 20, 0.5, 1.0), report(3, 30, 1.0, 2.0)]);
        // Round 2: utilities (10, 10, 30, 40) of the four (1 and 4 still at
        // their sizes): U_min = 9.99, U_max = 40 (clip: the 0.98 quantile,
        // index 3, is 40), range 30.01; T is still 1 s (durations 1, 1, 2, 10).
        let bonus = (0.1 * 2f64.ln() / 1.0).sqrt();
        let scores = selector.scores(2, &all, 1.0);
        assert_eq!(scores.len(), 2);
        assert_eq!(scores[0].0, 2);
        assert!((scores[0].1 - ((10.0 - 9.99) / 30.01 + bonus)).abs() < 1e-12);
        // Client 3 took 2 s > T: its score times (1/2)².
        assert_eq!(scores[1].0, 3);
        assert!((scores[1].1 - ((30.0 - 9.99) / 30.01 + bonus) * 0.25).abs() < 1e-12);
        // One exploited place (2 or 3, by score) and one explored: of the
        // unexplored 1 (10) and 4 (0.4), the window of one holds client 1.
        let second = selector.select(&mut rng, 2, &all, 2);
        assert_eq!(second.len(), 2);
        assert!([2, 3].contains(&second[0]), "{second:?}");
        assert_eq!(second[1], 1);
        assert_eq!(selector.state().exploit_clients, [second[0]]);
    }

    #[test]
    fn the_pacer_relaxes_a_stalled_utility_and_tightens_a_jump() {
        let options = OortOptions {
            pacer_step: 1,
            ..OortOptions::default()
        };
        let mut selector = oort(options, &[10, 10], &[1.0, 1.0]);
        // Round 1's exploited utility was 5; client 1 was exploited for
        // round 1 and reported U = 5.2.
        selector.state.exploit_history = vec![5.0];
        selector.state.round = 1;
        selector.state.exploit_clients = vec![1];
        selector.observe(1, &[report(1, 10, 0.52, 1.0)]);
        selector.advance(2);
        // 5.2 / (1 + 1e-4) is within 10 % of 5: threshold 10 → 15.
        assert!((selector.state.exploit_history[1] - 5.2 / 1.0001).abs() < 1e-12);
        assert_eq!(selector.state.round_threshold, 15.0);
        assert!(selector.state.successful.is_empty());
        // Round 3: the exploited client reports 40, which is 5 times 5.2 or
        // more above it: 15 → 10.
        selector.state.exploit_clients = vec![1];
        selector.observe(2, &[report(1, 10, 4.0, 1.0)]);
        selector.advance(3);
        assert_eq!(selector.state.round_threshold, 10.0);
        // Exploration decays once a round: 0.9 · 0.95 · 0.95.
        assert!((selector.state.exploration - 0.9 * 0.95 * 0.95).abs() < 1e-15);
        // A second selection for round 3 changes neither.
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        selector.select(&mut rng, 3, &[1, 2], 1);
        assert!((selector.state.exploration - 0.9 * 0.95 * 0.95).abs() < 1e-15);
        assert_eq!(selector.state.exploit_history.len(), 3);
    }

    #[test]
    fn blacklisted_clients_are_never_drawn_and_exploration_ends() {
        let options = OortOptions {
            blacklist_rounds: Some(1),
            blacklist_max_len: 0.5,
            ..OortOptions::default()
        };
        let mut selector = oort(options, &[10, 10, 10, 10], &[1.0; 4]);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for round in 1..=2 {
            selector.observe(round, &[report(1, 10, 1.0, 1.0)]);
        }
        // Client 1 trained twice, more than once: out. Later others train
        // twice too, and at most two of the four are ever out.
        assert_eq!(selector.blacklist(), [1]);
        for round in 3..10 {
            let out = selector.blacklist();
            assert!(out.len() <= 2, "{out:?}");
            let picked = selector.select(&mut rng, round, &[1, 2, 3, 4], 2);
            assert_eq!(picked.len(), 2);
            assert!(
                picked.iter().all(|c| !out.contains(c)),
                "{picked:?} {out:?}"
            );
            let feedback: Vec<Feedback> = picked.iter().map(|&c| report(c, 10, 1.0, 1.0)).collect();
            selector.observe(round, &feedback);
        }
        // Everyone has trained: nothing left to explore.
        assert_eq!(selector.state.exploration, 0.0);
        assert_eq!(selector.blacklist().len(), 2);
    }

    #[test]
    fn state_restores_and_refuses_what_is_not_this_run() {
        let mut selector = oort(OortOptions::default(), &[5, 6, 7], &[1.0, 2.0, 3.0]);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let picked = selector.select(&mut rng, 1, &[1, 2, 3], 2);
        let feedback: Vec<Feedback> = picked.iter().map(|&c| report(c, 5, 0.3, 1.5)).collect();
        selector.observe(1, &feedback);
        let json = serde_json::to_string(selector.state()).unwrap();
        let state: OortState = serde_json::from_str(&json).unwrap();
        let mut restored = Oort::restore(OortOptions::default(), 3, state.clone()).unwrap();
        assert_eq!(restored.state(), selector.state());
        let mut rng_copy = rng.clone();
        assert_eq!(
            restored.select(&mut rng_copy, 2, &[1, 2, 3], 2),
            selector.select(&mut rng, 2, &[1, 2, 3], 2)
        );
        let refused = Oort::restore(OortOptions::default(), 4, state).unwrap_err();
        assert!(refused.contains("3 clients, the run 4"), "{refused}");
    }

    #[test]
    fn options_out_of_range_are_named() {
        assert!(OortOptions::default().problems().is_empty());
        let bad = OortOptions {
            exploration_factor: 1.5,
            pacer_step: 0,
            round_threshold: 0.0,
            ..OortOptions::default()
        };
        let keys: Vec<&str> = bad.problems().iter().map(|p| p.0).collect();
        assert_eq!(
            keys,
            ["exploration_factor", "round_threshold", "pacer_step"]
        );
    }
}
