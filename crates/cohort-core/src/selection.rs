//! Seeded selection of the clients that train in a round.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

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
}
