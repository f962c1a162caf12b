//! Splitting a count in proportion to weights: ranks over nodes, cores over a
//! node's ranks, logical clients and the test set's batches over ranks.
//!
//! Largest remainder (Hamilton's method), in integers so that the same inputs
//! give the same split on every machine: each part gets the floor of its exact
//! share, the parts with the largest remainders get one more each (ties to the
//! earlier part), and a part left at zero takes one from the largest, as exo
//! does for layers, so that every part gets at least one.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Splits `total` into `weights.len()` parts in proportion to `weights`, each
/// at least 1. All-zero weights count as equal.
///
/// # Panics
/// When `weights` is empty or `total < weights.len()`; callers check both.
pub(crate) fn split_proportional(total: u32, weights: &[u64]) -> Vec<u32> {
    let parts = weights.len();
    assert!(
        parts > 0 && total as usize >= parts,
        "{total} over {parts} parts"
    );
    let equal = vec![1; parts];
    let weights = if weights.iter().all(|&w| w == 0) {
        &equal
    } else {
        weights
    };
    let sum: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    let exact: Vec<(u32, u128)> = weights
        .iter()
        .map(|&w| {
            let scaled = u128::from(total) * u128::from(w);
            ((scaled / sum) as u32, scaled % sum)
        })
        .collect();
    let mut split: Vec<u32> = exact.iter().map(|&(floor, _)| floor).collect();
    let mut by_remainder: Vec<usize> = (0..parts).collect();
    by_remainder.sort_by_key(|&i| (std::cmp::Reverse(exact[i].1), i));
    let given: u32 = split.iter().sum();
    for &i in by_remainder.iter().take((total - given) as usize) {
        split[i] += 1;
    }
    for i in 0..parts {
        if split[i] == 0 {
            // total >= parts, so while a part is 0 another holds 2 or more.
            let largest = (0..parts).max_by_key(|&j| (split[j], std::cmp::Reverse(j)));
            let largest = largest.expect("parts > 0");
            split[largest] -= 1;
            split[i] = 1;
        }
    }
    split
}

/// The logical clients one rank trains: ids `first..=last`, 1-based like the
/// client selector's ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientBlock {
    /// First client id of the block.
    pub first: u32,
    /// Last client id of the block (inclusive).
    pub last: u32,
}

impl ClientBlock {
    /// Whether client `id` belongs to this block.
    pub fn contains(&self, id: u32) -> bool {
        (self.first..=self.last).contains(&id)
    }

    /// How many clients the block holds.
    pub fn len(&self) -> u32 {
        self.last - self.first + 1
    }

    /// Always false: a block holds at least one client.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Contiguous blocks of client ids `1..=num_clients`, one per rank, sized in
/// proportion to `capacities`. They depend on nothing but these inputs, so
/// every round of a plan keeps each client's data on the same rank.
pub fn client_blocks(num_clients: u32, capacities: &[u64]) -> Vec<ClientBlock> {
    let mut next = 1;
    split_proportional(num_clients, capacities)
        .into_iter()
        .map(|count| {
            let block = ClientBlock {
                first: next,
                last: next + count - 1,
            };
            next += count;
            block
        })
        .collect()
}

/// The test samples each rank scores: whole evaluation batches of
/// `batch_size`, the batches split as evenly as they go, in rank order. The
/// ranks' per-batch scores in rank order are then the single process's
/// batches in order, so their sum is the same bits.
pub fn evaluation_slices(samples: usize, batch_size: usize, ranks: u32) -> Vec<Range<usize>> {
    let batch_size = batch_size.max(1);
    let batches = samples.div_ceil(batch_size);
    let ranks = ranks.max(1) as usize;
    let bound = |rank: usize| (batches * rank / ranks * batch_size).min(samples);
    (0..ranks)
        .map(|rank| bound(rank)..bound(rank + 1))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn evaluation_slices_by_hand() {
        // 10 samples in batches of 3: 4 batches (3, 3, 3, 1) over 3 ranks.
        assert_eq!(evaluation_slices(10, 3, 3), [0..3, 3..6, 6..10]);
        // More ranks than batches: some ranks score nothing.
        assert_eq!(evaluation_slices(4, 4, 2), [0..0, 0..4]);
        assert_eq!(evaluation_slices(0, 32, 2), [0..0, 0..0]);
    }

    #[test]
    fn largest_remainder_by_hand() {
        // 7 × (5, 3, 2) / 10 = 3.5, 2.1, 1.4: floors 3, 2, 1 give 6; the one
        // left goes to the largest remainder, .5.
        assert_eq!(split_proportional(7, &[5, 3, 2]), [4, 2, 1]);
        // 10 × (1, 1, 1) / 3 = 3.33 each: the tie goes to the first.
        assert_eq!(split_proportional(10, &[1, 1, 1]), [4, 3, 3]);
        // 3 × (100, 1, 1) / 102: floors 2, 0, 0 and one left for the first
        // (remainder 96): 3, 0, 0; each empty part takes one from the largest.
        assert_eq!(split_proportional(3, &[100, 1, 1]), [1, 1, 1]);
        assert_eq!(split_proportional(4, &[0, 0]), [2, 2]);
    }

    #[test]
    fn client_blocks_are_contiguous_and_one_based() {
        let blocks = client_blocks(10, &[5, 3, 2]);
        let bounds: Vec<(u32, u32)> = blocks.iter().map(|b| (b.first, b.last)).collect();
        assert_eq!(bounds, [(1, 5), (6, 8), (9, 10)]);
        assert!(blocks[1].contains(6) && !blocks[1].contains(9));
        assert_eq!(blocks[2].len(), 2);
    }

    proptest! {
        #[test]
        fn a_split_sums_to_the_total_and_gives_each_part_one(
            weights in prop::collection::vec(0u64..1_000, 1..12),
            extra in 0u32..500,
        ) {
            let total = weights.len() as u32 + extra;
            let split = split_proportional(total, &weights);
            prop_assert_eq!(split.len(), weights.len());
            prop_assert_eq!(split.iter().sum::<u32>(), total);
            prop_assert!(split.iter().all(|&part| part >= 1));
        }

        #[test]
        fn evaluation_slices_tile_the_test_set_on_batch_bounds(
            samples in 0usize..5_000,
            batch_size in 1usize..300,
            ranks in 1u32..17,
        ) {
            let slices = evaluation_slices(samples, batch_size, ranks);
            prop_assert_eq!(slices.len(), ranks as usize);
            prop_assert_eq!(slices[0].start, 0);
            prop_assert_eq!(slices.last().unwrap().end, samples);
            let batches: Vec<usize> = slices.iter().map(|s| s.len().div_ceil(batch_size)).collect();
            prop_assert!(batches.iter().max().unwrap() - batches.iter().min().unwrap() <= 1);
            for pair in slices.windows(2) {
                prop_assert_eq!(pair[0].end, pair[1].start);
                prop_assert!(pair[1].start % batch_size == 0 || pair[1].is_empty());
            }
        }
    }
}
