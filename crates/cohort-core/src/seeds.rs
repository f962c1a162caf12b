//! Derivation of independent random streams from user seeds.
//!
//! A stream for (training seed, logical client, round, epoch) depends on those
//! values only: not on which physical worker runs the client, nor in which
//! order. No global or thread-local RNG is involved anywhere in cohort.

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
}
