//! Derivation of independent random streams from user seeds.
//!
//! A stream for (training seed, logical client, round, epoch) depends on those
//! values only: not on which physical worker runs the client, nor in which
//! order. No global or thread-local RNG is involved anywhere in cohort.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

/// A 64-bit seed for the stream named by `purpose` and `coordinates`, from
/// SHA-256 so that nearby inputs give unrelated seeds.
pub fn derive_seed(base: u64, purpose: &str, coordinates: &[u64]) -> u64 {
    let mut hasher = Sha256::new();
    hasher.update(base.to_le_bytes());
    hasher.update((purpose.len() as u64).to_le_bytes());
    hasher.update(purpose.as_bytes());
    for c in coordinates {
        hasher.update(c.to_le_bytes());
    }
    let digest = hasher.finalize();
    u64::from_le_bytes(digest[..8].try_into().expect("SHA-256 has 32 bytes"))
}

/// Seed of the shuffling stream of one local epoch.
pub fn training_stream(training_seed: u64, client_id: u32, round: u32, epoch: u32) -> u64 {
    derive_seed(
        training_seed,
        "local-training",
        &[client_id as u64, round as u64, epoch as u64],
    )
}

/// The stream local epoch `epoch` of `client_id` in `round` shuffles its
/// samples with (the trainers go on drawing dropout masks from it).
pub fn epoch_rng(training_seed: u64, client_id: u32, round: u32, epoch: u32) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(training_stream(training_seed, client_id, round, epoch))
}

/// Shuffles `order` for one local epoch, as every trainer does: each epoch
/// shuffles the previous epoch's order (the partition's own order before the
/// first), so [`epoch_orders`] and the trainers visit the same sequence.
pub fn shuffle_for_epoch(order: &mut [u32], rng: &mut ChaCha8Rng) {
    order.shuffle(rng);
}

/// The order in which `client_id` visits the samples of `partition` in each
/// of its `epochs` local epochs of `round` (one list per epoch, batches cut
/// from its front), exactly as the trainers draw it: so another framework
/// can train the same batches (`cohort partitions --sample-orders`).
pub fn epoch_orders(
    partition: &[u32],
    training_seed: u64,
    client_id: u32,
    round: u32,
    epochs: u32,
) -> Vec<Vec<u32>> {
    let mut order = partition.to_vec();
    (1..=epochs)
        .map(|epoch| {
            shuffle_for_epoch(
                &mut order,
                &mut epoch_rng(training_seed, client_id, round, epoch),
            );
            order.clone()
        })
        .collect()
}

/// Seed of the augmentation stream of one local epoch (crops and flips,
/// `data::augment`): its own purpose, so augmenting leaves the shuffle as it
/// was.
pub fn augmentation_stream(training_seed: u64, client_id: u32, round: u32, epoch: u32) -> u64 {
    derive_seed(
        training_seed,
        "augmentation",
        &[client_id as u64, round as u64, epoch as u64],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_coordinate_changes_the_stream() {
        let base = training_stream(29, 3, 2, 1);
        assert_eq!(base, training_stream(29, 3, 2, 1));
        for other in [
            training_stream(30, 3, 2, 1),
            training_stream(29, 4, 2, 1),
            training_stream(29, 3, 3, 1),
            training_stream(29, 3, 2, 2),
        ] {
            assert_ne!(base, other);
        }
        assert_ne!(derive_seed(1, "a", &[]), derive_seed(1, "b", &[]));
        assert_ne!(augmentation_stream(29, 3, 2, 1), base);
    }

    #[test]
    fn each_epoch_reshuffles_the_previous_epochs_order() {
        let partition: Vec<u32> = (100..164).collect();
        let orders = epoch_orders(&partition, 7, 3, 2, 3);
        assert_eq!(orders.len(), 3);
        let mut first = partition.clone();
        shuffle_for_epoch(&mut first, &mut epoch_rng(7, 3, 2, 1));
        assert_eq!(orders[0], first);
        assert_ne!(orders[0], partition);
        let mut second = first.clone();
        shuffle_for_epoch(&mut second, &mut epoch_rng(7, 3, 2, 2));
        assert_eq!(orders[1], second);
        // Epoch 2 starts from epoch 1's order, not from the partition's.
        let mut from_partition = partition.clone();
        shuffle_for_epoch(&mut from_partition, &mut epoch_rng(7, 3, 2, 2));
        assert_ne!(orders[1], from_partition);
        for order in &orders {
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, partition);
        }
        assert_eq!(orders, epoch_orders(&partition, 7, 3, 2, 3));
        assert_ne!(orders[0], epoch_orders(&partition, 7, 4, 2, 1)[0]);
        assert_ne!(orders[0], epoch_orders(&partition, 7, 3, 3, 1)[0]);
        assert_ne!(orders[0], epoch_orders(&partition, 8, 3, 2, 1)[0]);
    }
}
