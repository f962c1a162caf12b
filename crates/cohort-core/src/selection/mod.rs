//! Seeded selection of the clients that train in a round.
//!
//! `clients.selection` picks the policy ([`SelectionKind`]):
//! * `random`: `per_round` distinct clients drawn uniformly ([`ClientSelector`]);
//! * `power_of_choice`: Cho, Wang and Joshi's pow-d ([`power_of_choice`]): `d`
//!   candidates drawn by data size, the `per_round` with the highest loss,
//!   either the loss of the global model the candidates evaluate first
//!   ([`Selector::draw_candidates`], then [`Selector::choose`]) or the
//!   training loss they last reported;
//! * `oort`: Lai et al.'s Oort ([`oort`]): statistical utility from the
//!   training loss, a penalty for clients slower than the preferred round
//!   duration, exploration of clients not yet seen, and its pacer.
//!
//! Every policy draws from the one ChaCha8 stream of `server.random_seed`,
//! and the utility policies decide from what the clients reported
//! ([`Feedback`]): the training loss, the samples and a duration that is
//! simulated (or a sample count), never measured, so a run's choices are the
//! same with any number of workers. A policy's state ([`PolicyState`]) is
//! plain data that the checkpoint keeps, its numbers written exactly, so a
//! resumed run makes the same choices.
//!
//! A policy is told which round it selects for. In synchronous rounds that is
//! the round; in an asynchronous run it is the aggregation the task's update
//! will count towards (the model version plus one), and a policy is asked for
//! one client whenever one finishes: what changes once a round (Oort's
//! exploration decay and pacer) changes when that number does.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub mod oort;
pub mod power_of_choice;

pub use oort::{Oort, OortOptions, OortState};
pub use power_of_choice::{
    PowerOfChoice, PowerOfChoiceLoss, PowerOfChoiceOptions, PowerOfChoiceState,
};

/// Picks `per_round` distinct logical clients each round from its own ChaCha8
/// stream seeded by `server.random_seed`; no global RNG is involved, so the
/// sequence of cohorts depends on the seed alone.
#[derive(Debug, Clone)]
pub struct ClientSelector {
    rng: ChaCha8Rng,
}

/// Where a selector's stream stands; restoring it continues the same sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectorState {
    pub seed: u64,
    /// Position in the ChaCha8 stream, in 32-bit words.
    pub word_pos: u128,
}

impl ClientSelector {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// Distinct 1-based client ids, in the order they were drawn.
    pub fn select(&mut self, total_clients: u32, per_round: u32) -> Vec<u32> {
        rand::seq::index::sample(&mut self.rng, total_clients as usize, per_round as usize)
            .into_iter()
            .map(|index| index as u32 + 1)
            .collect()
    }

    /// `per_round` distinct 1-based ids drawn in `strata` contiguous blocks
    /// of `1..=total_clients` (as equal as they go, as
    /// [`crate::cluster::client_blocks`] splits clients over equal ranks),
    /// each block's share of `per_round` in proportion to its size, drawn
    /// uniformly within the block: stratified sampling. Every client's chance
    /// of being drawn stays `per_round / total_clients` (exactly where the
    /// blocks divide evenly), and each block sends the same number each
    /// round, so ranks that hold whole blocks train equal shares. One stratum
    /// is [`ClientSelector::select`], draw for draw.
    ///
    /// Callers validate `strata ≤ min(per_round, total_clients)`; more are
    /// taken as that many, so every block still sends at least one.
    pub fn select_stratified(
        &mut self,
        total_clients: u32,
        per_round: u32,
        strata: u32,
    ) -> Vec<u32> {
        let strata = strata.min(per_round).min(total_clients);
        if strata <= 1 {
            return self.select(total_clients, per_round);
        }
        let blocks = crate::cluster::client_blocks(total_clients, &vec![1; strata as usize]);
        let sizes: Vec<u64> = blocks.iter().map(|block| u64::from(block.len())).collect();
        let shares = crate::cluster::split_proportional(per_round, &sizes);
        let mut drawn = Vec::with_capacity(per_round as usize);
        for (block, share) in blocks.iter().zip(shares) {
            let picks =
                rand::seq::index::sample(&mut self.rng, block.len() as usize, share as usize);
            drawn.extend(picks.into_iter().map(|index| block.first + index as u32));
        }
        drawn
    }

    /// `count` distinct ids of `candidates` (at most all of them), in the
    /// order drawn: a round among the clients online, or one client to
    /// replace one that finished.
    pub fn select_from(&mut self, candidates: &[u32], count: usize) -> Vec<u32> {
        let count = count.min(candidates.len());
        rand::seq::index::sample(&mut self.rng, candidates.len(), count)
            .into_iter()
            .map(|index| candidates[index])
            .collect()
    }

    pub fn state(&self, seed: u64) -> SelectorState {
        SelectorState {
            seed,
            word_pos: self.rng.get_word_pos(),
        }
    }

    pub fn from_state(state: SelectorState) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(state.seed);
        rng.set_word_pos(state.word_pos);
        Self { rng }
    }
}

/// `clients.selection`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectionKind {
    /// Uniform among the clients that can be drawn.
    #[default]
    Random,
    /// Cho et al. 2020: the highest loss among candidates drawn by size.
    PowerOfChoice,
    /// Lai et al., OSDI 2021.
    Oort,
}

impl SelectionKind {
    /// The name as written in a config.
    pub fn name(self) -> &'static str {
        match self {
            SelectionKind::Random => "random",
            SelectionKind::PowerOfChoice => "power_of_choice",
            SelectionKind::Oort => "oort",
        }
    }
}

/// What a client's finished task tells a policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Feedback {
    pub client_id: u32,
    /// Training samples it reported.
    pub samples: u64,
    /// Its mean training loss.
    pub loss: f64,
    /// Its task's simulated seconds (download, training, upload), or without
    /// device profiles its samples.
    pub duration: f64,
}

/// What the server knows of each client before any has trained; index
/// `c − 1` is client `c`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ClientPrior {
    /// Training samples of each client's partition.
    pub samples: Vec<u64>,
    /// Each client's expected task duration, in the unit of
    /// [`Feedback::duration`].
    pub durations: Vec<f64>,
}

/// The selection policy and its state.
#[derive(Debug, Clone)]
pub enum Policy {
    Random,
    PowerOfChoice(PowerOfChoice),
    Oort(Box<Oort>),
}

/// A utility policy's state, as a checkpoint keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
pub enum PolicyState {
    PowerOfChoice(PowerOfChoiceState),
    Oort(OortState),
}

impl PolicyState {
    fn kind(&self) -> SelectionKind {
        match self {
            PolicyState::PowerOfChoice(_) => SelectionKind::PowerOfChoice,
            PolicyState::Oort(_) => SelectionKind::Oort,
        }
    }
}

/// The selection settings of a run, as read from the config.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PolicyConfig {
    pub kind: SelectionKind,
    pub power_of_choice: PowerOfChoiceOptions,
    pub oort: OortOptions,
    /// `clients.per_round`.
    pub per_round: u32,
    /// `clients.strata`: random rounds of all clients drawn in this many
    /// blocks of ids ([`ClientSelector::select_stratified`]); 0 and 1 draw
    /// from all at once.
    pub strata: u32,
}

impl Policy {
    /// A policy that has seen no client yet.
    pub fn fresh(config: &PolicyConfig, prior: &ClientPrior) -> Self {
        match config.kind {
            SelectionKind::Random => Policy::Random,
            SelectionKind::PowerOfChoice => Policy::PowerOfChoice(PowerOfChoice::new(
                config.power_of_choice,
                config.per_round,
                prior,
            )),
            SelectionKind::Oort => Policy::Oort(Box::new(Oort::new(config.oort, prior))),
        }
    }

    /// The policy of `config` continuing from a checkpoint's `state`; an
    /// error says why the state cannot be this run's.
    pub fn restore(
        config: &PolicyConfig,
        prior: &ClientPrior,
        state: Option<PolicyState>,
    ) -> Result<Self, String> {
        let found = state
            .as_ref()
            .map_or(SelectionKind::Random, PolicyState::kind);
        if found != config.kind {
            return Err(format!(
                "its selection state is `{}`'s, but this run selects by `{}`",
                found.name(),
                config.kind.name()
            ));
        }
        let clients = prior.samples.len();
        match state {
            None => Ok(Policy::Random),
            Some(PolicyState::PowerOfChoice(state)) => {
                PowerOfChoice::restore(config.power_of_choice, config.per_round, prior, state)
                    .map(Policy::PowerOfChoice)
            }
            Some(PolicyState::Oort(state)) => {
                Oort::restore(config.oort, clients, state).map(|oort| Policy::Oort(Box::new(oort)))
            }
        }
    }

    pub fn state(&self) -> Option<PolicyState> {
        match self {
            Policy::Random => None,
            Policy::PowerOfChoice(p) => Some(PolicyState::PowerOfChoice(p.state().clone())),
            Policy::Oort(o) => Some(PolicyState::Oort(o.state().clone())),
        }
    }

    /// Whether the draws depend on what clients reported (so a checkpoint's
    /// stream position cannot be replayed from the seed alone).
    pub fn uses_feedback(&self) -> bool {
        !matches!(self, Policy::Random)
    }
}

/// The run's selector: the seeded stream and the policy that draws from it.
#[derive(Debug, Clone)]
pub struct Selector {
    draws: ClientSelector,
    policy: Policy,
    strata: u32,
}

impl Selector {
    pub fn new(draws: ClientSelector, policy: Policy) -> Self {
        Self {
            draws,
            policy,
            strata: 1,
        }
    }

    /// Random rounds of all clients drawn in `strata` blocks of ids
    /// (`clients.strata`, [`ClientSelector::select_stratified`]).
    pub fn stratified(mut self, strata: u32) -> Self {
        self.strata = strata;
        self
    }

    /// `count` distinct clients of all `total` for `round`.
    pub fn select_all(&mut self, round: u32, total: u32, count: u32) -> Vec<u32> {
        match &mut self.policy {
            // The plain draw, so a random run draws what it always drew.
            Policy::Random => self.draws.select_stratified(total, count, self.strata),
            _ => {
                let all: Vec<u32> = (1..=total).collect();
                self.select(round, &all, count as usize)
            }
        }
    }

    /// `count` distinct ids of `candidates` (at most all of them) for `round`.
    pub fn select(&mut self, round: u32, candidates: &[u32], count: usize) -> Vec<u32> {
        match &mut self.policy {
            Policy::Random => self.draws.select_from(candidates, count),
            Policy::PowerOfChoice(p) => p.select(&mut self.draws.rng, candidates, count),
            Policy::Oort(o) => o.select(&mut self.draws.rng, round, candidates, count),
        }
    }

    /// Whether the policy chooses from losses of the current global model
    /// that the candidates evaluate first (pow-d): the caller then selects
    /// in two steps, [`Selector::draw_candidates`], the evaluation, and
    /// [`Selector::choose`], instead of [`Selector::select`].
    pub fn evaluates(&self) -> bool {
        matches!(&self.policy, Policy::PowerOfChoice(p) if p.loss() == PowerOfChoiceLoss::Evaluated)
    }

    /// The candidates to evaluate for `count` places among `available`, in
    /// the order drawn. For a policy that does not evaluate, its choice
    /// itself ([`Selector::select`]), which [`Selector::choose`] keeps.
    pub fn draw_candidates(&mut self, round: u32, available: &[u32], count: usize) -> Vec<u32> {
        match &mut self.policy {
            Policy::PowerOfChoice(p) if p.loss() == PowerOfChoiceLoss::Evaluated => {
                p.draw_candidates(&mut self.draws.rng, available, count)
            }
            _ => self.select(round, available, count),
        }
    }

    /// `count` of `candidates` by their evaluated `losses` (one each, in
    /// order; `-inf` where an evaluation failed); a policy that does not
    /// evaluate keeps the first `count`.
    pub fn choose(&mut self, candidates: &[u32], losses: &[f64], count: usize) -> Vec<u32> {
        match &mut self.policy {
            Policy::PowerOfChoice(p) if p.loss() == PowerOfChoiceLoss::Evaluated => {
                p.choose(candidates, losses, count)
            }
            _ => candidates.iter().copied().take(count).collect(),
        }
    }

    /// What `round`'s clients reported.
    pub fn observe(&mut self, round: u32, feedback: &[Feedback]) {
        match &mut self.policy {
            Policy::Random => {}
            Policy::PowerOfChoice(p) => p.observe(feedback),
            Policy::Oort(o) => o.observe(round, feedback),
        }
    }

    /// `client`'s task took `duration` but brought no update (late, lost).
    pub fn observe_duration(&mut self, client: u32, duration: f64) {
        if let Policy::Oort(o) = &mut self.policy {
            o.observe_duration(client, duration);
        }
    }

    /// The stream's position.
    pub fn draws_state(&self, seed: u64) -> SelectorState {
        self.draws.state(seed)
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }
}

/// `count` distinct items of `items`, each draw proportional to the weights
/// of those not yet drawn (NumPy's `choice(replace=False, p=…)`); where the
/// remaining weights are all zero the draw is uniform among them.
pub(crate) fn weighted_draws(
    rng: &mut ChaCha8Rng,
    items: &[u32],
    weights: &[f64],
    count: usize,
) -> Vec<u32> {
    debug_assert_eq!(items.len(), weights.len());
    let mut left: Vec<(u32, f64)> = items
        .iter()
        .zip(weights)
        .map(|(&item, &w)| (item, if w.is_finite() && w > 0.0 { w } else { 0.0 }))
        .collect();
    let mut drawn = Vec::with_capacity(count.min(left.len()));
    while drawn.len() < count && !left.is_empty() {
        let total: f64 = left.iter().map(|(_, w)| w).sum();
        let index = if total > 0.0 {
            let mut target = rng.random::<f64>() * total;
            let mut chosen = None;
            for (index, (_, w)) in left.iter().enumerate() {
                if *w > 0.0 {
                    chosen = Some(index);
                    if target < *w {
                        break;
                    }
                    target -= w;
                }
            }
            // Rounding may leave `target` past the last weight: the last
            // positive one is drawn.
            chosen.unwrap_or(0)
        } else {
            rng.random_range(0..left.len())
        };
        drawn.push(left.remove(index).0);
    }
    drawn
}

/// Serde for `f64` as the shortest decimal that reads back to the same bits
/// (Rust's `Display`), in a string: a JSON number may not read back exactly,
/// and `inf` is none.
pub(crate) mod exact {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&value.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse()
            .map_err(|_| serde::de::Error::custom(format!("`{text}` is not a number")))
    }

    /// The same for a list.
    pub mod list {
        use serde::ser::SerializeSeq;
        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(values: &[f64], serializer: S) -> Result<S::Ok, S::Error> {
            let mut seq = serializer.serialize_seq(Some(values.len()))?;
            for value in values {
                seq.serialize_element(&value.to_string())?;
            }
            seq.end()
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(
            deserializer: D,
        ) -> Result<Vec<f64>, D::Error> {
            Vec::<String>::deserialize(deserializer)?
                .into_iter()
                .map(|text| {
                    text.parse()
                        .map_err(|_| serde::de::Error::custom(format!("`{text}` is not a number")))
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_is_deterministic_for_a_seed_and_distinct() {
        let mut a = ClientSelector::new(1);
        let mut b = ClientSelector::new(1);
        for _ in 0..20 {
            let picked = a.select(10, 4);
            assert_eq!(picked, b.select(10, 4));
            let mut sorted = picked.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), 4);
            assert!(picked.iter().all(|&id| (1..=10).contains(&id)));
        }
        let rounds = |seed| {
            let mut s = ClientSelector::new(seed);
            (0..5).map(|_| s.select(100, 3)).collect::<Vec<_>>()
        };
        assert_ne!(rounds(1), rounds(2));
    }

    #[test]
    fn selection_among_candidates_draws_only_them() {
        let mut a = ClientSelector::new(3);
        let mut b = ClientSelector::new(3);
        let candidates = [4, 9, 11, 30];
        for _ in 0..20 {
            let picked = a.select_from(&candidates, 2);
            assert_eq!(picked, b.select_from(&candidates, 2));
            assert_eq!(picked.len(), 2);
            assert_ne!(picked[0], picked[1]);
            assert!(picked.iter().all(|id| candidates.contains(id)));
        }
        // More asked than there are: all of them.
        let mut all = a.select_from(&candidates, 10);
        all.sort_unstable();
        assert_eq!(all, candidates);
        assert!(a.select_from(&[], 3).is_empty());
    }

    #[test]
    fn restored_state_continues_the_sequence() {
        let mut original = ClientSelector::new(5);
        original.select(10, 2);
        let mut restored = ClientSelector::from_state(original.state(5));
        assert_eq!(original.select(10, 2), restored.select(10, 2));
    }

    #[test]
    fn a_random_selector_draws_what_the_plain_stream_draws() {
        let mut plain = ClientSelector::new(9);
        let mut selector = Selector::new(ClientSelector::new(9), Policy::Random);
        for round in 1..=5 {
            assert_eq!(selector.select_all(round, 20, 4), plain.select(20, 4));
        }
    }

    #[test]
    fn stratified_draws_by_hand() {
        // 10 clients in 2 strata (1–5, 6–10), 5 a round: 2.5 each, the tie to
        // the first: 3 from the first block, then 2 from the second, each
        // drawn as a plain draw of its block would be.
        let mut stratified = ClientSelector::new(11);
        let mut plain = ChaCha8Rng::seed_from_u64(11);
        let picked = stratified.select_stratified(10, 5, 2);
        let first: Vec<u32> = rand::seq::index::sample(&mut plain, 5, 3)
            .into_iter()
            .map(|i| i as u32 + 1)
            .collect();
        let second: Vec<u32> = rand::seq::index::sample(&mut plain, 5, 2)
            .into_iter()
            .map(|i| i as u32 + 6)
            .collect();
        assert_eq!(picked, [first, second].concat());
        // One stratum is the plain draw, and the stream moves alike.
        let (mut one, mut all) = (ClientSelector::new(2), ClientSelector::new(2));
        for _ in 0..5 {
            assert_eq!(one.select_stratified(30, 7, 1), all.select(30, 7));
        }
        assert_eq!(one.state(2), all.state(2));
    }

    #[test]
    fn a_stratified_selector_draws_its_blocks_and_resumes() {
        let mut plain = ClientSelector::new(4);
        let mut selector = Selector::new(ClientSelector::new(4), Policy::Random).stratified(4);
        for round in 1..=5 {
            assert_eq!(
                selector.select_all(round, 40, 8),
                plain.select_stratified(40, 8, 4)
            );
        }
        let mut restored = ClientSelector::from_state(selector.draws_state(4));
        assert_eq!(
            selector.select_all(6, 40, 8),
            restored.select_stratified(40, 8, 4)
        );
    }

    #[test]
    fn every_client_is_drawn_equally_often_when_stratified() {
        // 12 clients, 4 a round from 4 strata of 3: each client's chance is
        // 1/3, as in a uniform draw of 4 of 12.
        let mut selector = ClientSelector::new(5);
        let rounds = 30_000;
        let mut times = [0u32; 12];
        for _ in 0..rounds {
            for id in selector.select_stratified(12, 4, 4) {
                times[id as usize - 1] += 1;
            }
        }
        for (index, &n) in times.iter().enumerate() {
            let share = f64::from(n) / f64::from(rounds);
            // The standard deviation of the share is sqrt(2/9 / 30000) ≈ 0.0027.
            assert!(
                (share - 1.0 / 3.0).abs() < 0.012,
                "client {}: {share}",
                index + 1
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn stratified_draws_are_distinct_and_fill_each_block_s_share(
            total in 1u32..300,
            per_round_fraction in 0.0f64..1.0,
            strata_fraction in 0.0f64..1.0,
            seed in 0u64..1_000,
        ) {
            let per_round = 1 + (per_round_fraction * f64::from(total - 1)) as u32;
            let strata = 1 + (strata_fraction * f64::from(per_round - 1)) as u32;
            let picked = ClientSelector::new(seed).select_stratified(total, per_round, strata);
            proptest::prop_assert_eq!(picked.len(), per_round as usize);
            let mut sorted = picked.clone();
            sorted.sort_unstable();
            sorted.dedup();
            proptest::prop_assert_eq!(sorted.len(), picked.len());
            let blocks = crate::cluster::client_blocks(total, &vec![1; strata as usize]);
            let sizes: Vec<u64> = blocks.iter().map(|b| u64::from(b.len())).collect();
            let shares = crate::cluster::split_proportional(per_round, &sizes);
            for (block, share) in blocks.iter().zip(shares) {
                let inside = picked.iter().filter(|&&id| block.contains(id)).count();
                proptest::prop_assert_eq!(inside, share as usize);
            }
        }

        #[test]
        fn ranks_holding_whole_strata_train_equal_shares(
            ranks in 1u32..9,
            strata_per_rank in 1u32..4,
            clients_per_stratum in 1u32..50,
            drawn_per_stratum_fraction in 0.0f64..1.0,
            seed in 0u64..1_000,
        ) {
            let strata = ranks * strata_per_rank;
            let per_stratum = 1 + (drawn_per_stratum_fraction * f64::from(clients_per_stratum - 1)) as u32;
            let (total, per_round) = (strata * clients_per_stratum, strata * per_stratum);
            let picked = ClientSelector::new(seed).select_stratified(total, per_round, strata);
            for block in crate::cluster::client_blocks(total, &vec![1; ranks as usize]) {
                let trained = picked.iter().filter(|&&id| block.contains(id)).count();
                proptest::prop_assert_eq!(trained as u32, per_round / ranks);
            }
        }
    }

    #[test]
    fn weighted_draws_follow_the_weights_and_never_repeat() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        // A zero weight is drawn only once the positive ones are gone.
        for _ in 0..50 {
            let drawn = weighted_draws(&mut rng, &[1, 2, 3], &[0.0, 1.0, 3.0], 2);
            assert_eq!(drawn.len(), 2);
            assert!(!drawn.contains(&1), "{drawn:?}");
        }
        let all = weighted_draws(&mut rng, &[1, 2, 3], &[0.0, 1.0, 3.0], 5);
        assert_eq!(all.len(), 3);
        assert_eq!(all[2], 1);
        // Client 3 (weight 3 of 4) is drawn first about three times in four.
        let first_is_3 = (0..4000)
            .filter(|_| weighted_draws(&mut rng, &[2, 3], &[1.0, 3.0], 1) == [3])
            .count();
        assert!((2800..3200).contains(&first_is_3), "{first_is_3}");
        // All weights zero: uniform, still distinct.
        let mut uniform = weighted_draws(&mut rng, &[5, 6, 7], &[0.0; 3], 3);
        uniform.sort_unstable();
        assert_eq!(uniform, [5, 6, 7]);
    }

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Exact {
        #[serde(with = "exact")]
        one: f64,
        #[serde(with = "exact::list")]
        many: Vec<f64>,
    }

    #[test]
    fn exact_numbers_read_back_to_the_same_bits() {
        let value = Exact {
            one: 0.1 + 0.2,
            many: vec![f64::INFINITY, 1e-300 / 3.0, -0.0, 2.0_f64.sqrt()],
        };
        let json = serde_json::to_string(&value).unwrap();
        let back: Exact = serde_json::from_str(&json).unwrap();
        assert_eq!(back.one.to_bits(), value.one.to_bits());
        for (a, b) in back.many.iter().zip(&value.many) {
            assert_eq!(a.to_bits(), b.to_bits(), "{json}");
        }
        let error = serde_json::from_str::<Exact>(r#"{"one":"x","many":[]}"#).unwrap_err();
        assert!(error.to_string().contains("`x` is not a number"), "{error}");
    }

    /// The policies: random, pow-d, rpow-d, Oort.
    fn config_of(index: u8, per_round: u32) -> PolicyConfig {
        let (kind, loss) = [
            (SelectionKind::Random, None),
            (
                SelectionKind::PowerOfChoice,
                Some(PowerOfChoiceLoss::Evaluated),
            ),
            (
                SelectionKind::PowerOfChoice,
                Some(PowerOfChoiceLoss::LastReported),
            ),
            (SelectionKind::Oort, None),
        ][usize::from(index % 4)];
        PolicyConfig {
            kind,
            power_of_choice: PowerOfChoiceOptions {
                loss,
                ..PowerOfChoiceOptions::default()
            },
            per_round,
            ..PolicyConfig::default()
        }
    }

    /// A round's choice as the runtime makes it: in two steps when the
    /// policy evaluates, the losses made up from the round and the client.
    fn choice(selector: &mut Selector, round: u32, available: &[u32], count: usize) -> Vec<u32> {
        if !selector.evaluates() {
            return selector.select(round, available, count);
        }
        let candidates = selector.draw_candidates(round, available, count);
        let losses: Vec<f64> = candidates
            .iter()
            .map(|&c| match (c + round) % 5 {
                0 => f64::NEG_INFINITY,
                1 => f64::NAN,
                k => f64::from(k) / 4.0,
            })
            .collect();
        selector.choose(&candidates, &losses, count)
    }

    proptest::proptest! {
        #[test]
        fn every_policy_draws_distinct_available_clients_and_repeats_for_a_seed(
            seed in proptest::prelude::any::<u64>(),
            total in 1u32..25,
            per_round in 1u32..8,
            kind in 0u8..4,
            mask in proptest::prelude::any::<u32>(),
        ) {
            let per_round = per_round.min(total);
            let prior = ClientPrior {
                samples: (1..=total).map(|c| u64::from(c * 7 % 13 + 1)).collect(),
                durations: (1..=total).map(|c| f64::from(c % 5 + 1)).collect(),
            };
            let config = config_of(kind, per_round);
            let make = || Selector::new(ClientSelector::new(seed), Policy::fresh(&config, &prior));
            let (mut a, mut b) = (make(), make());
            for round in 1..=6u32 {
                // Who is online changes from round to round.
                let online = mask.rotate_left(round * 5) | 1;
                let candidates: Vec<u32> =
                    (1..=total).filter(|c| online >> ((c - 1) % 32) & 1 == 1).collect();
                let picked = choice(&mut a, round, &candidates, per_round as usize);
                proptest::prop_assert_eq!(&picked, &choice(&mut b, round, &candidates, per_round as usize));
                let mut distinct = picked.clone();
                distinct.sort_unstable();
                distinct.dedup();
                proptest::prop_assert_eq!(distinct.len(), picked.len());
                proptest::prop_assert_eq!(picked.len(), (per_round as usize).min(candidates.len()));
                proptest::prop_assert!(picked.iter().all(|c| candidates.contains(c)));
                let feedback: Vec<Feedback> = picked
                    .iter()
                    .map(|&c| Feedback {
                        client_id: c,
                        samples: prior.samples[c as usize - 1],
                        loss: f64::from(c * round % 7) / 3.0,
                        duration: f64::from(c % 3 + 1),
                    })
                    .collect();
                a.observe(round, &feedback);
                b.observe(round, &feedback);
            }
        }
    }
}
