//! Splitting a training set among logical clients.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartitionError {
    #[error(
        "{clients} clients × partition_size {size} = {needed} samples, but the training set has {available}"
    )]
    NotEnoughSamples {
        clients: usize,
        size: usize,
        needed: usize,
        available: usize,
    },
    #[error("{clients} clients cannot each get a sample from a training set of {available}")]
    EmptyPartition { clients: usize, available: usize },
}

/// The `iid` sampler: shuffles `0..num_samples` with a ChaCha8 stream seeded by
/// `seed` and gives client `c` (1-based) the `c`-th run of `partition_size`
/// indices. Partitions are disjoint; with the default size (`num_samples /
/// clients`) they cover all but the remainder.
pub fn iid(
    num_samples: usize,
    clients: usize,
    partition_size: Option<usize>,
    seed: u64,
) -> Result<Vec<Vec<u32>>, PartitionError> {
    let size = partition_size.unwrap_or(num_samples / clients.max(1));
    if size == 0 {
        return Err(PartitionError::EmptyPartition {
            clients,
            available: num_samples,
        });
    }
    let needed = size.saturating_mul(clients);
    if needed > num_samples {
        return Err(PartitionError::NotEnoughSamples {
            clients,
            size,
            needed,
            available: num_samples,
        });
    }
    let mut order: Vec<u32> = (0..num_samples as u32).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    Ok(order
        .chunks_exact(size)
        .take(clients)
        .map(<[u32]>::to_vec)
        .collect())
}

/// The `iid` sampler with a size per client (`data.partition_sizes`): the same
/// seeded shuffle, client `c` getting the next `sizes[c - 1]` indices. Used for
/// clients with unequal amounts of data.
pub fn iid_sized(
    num_samples: usize,
    sizes: &[usize],
    seed: u64,
) -> Result<Vec<Vec<u32>>, PartitionError> {
    if let Some(&smallest) = sizes.iter().min()
        && smallest == 0
    {
        return Err(PartitionError::EmptyPartition {
            clients: sizes.len(),
            available: num_samples,
        });
    }
    let needed: usize = sizes.iter().sum();
    if needed > num_samples {
        return Err(PartitionError::NotEnoughSamples {
            clients: sizes.len(),
            size: sizes.iter().copied().max().unwrap_or(0),
            needed,
            available: num_samples,
        });
    }
    let mut order: Vec<u32> = (0..num_samples as u32).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let mut start = 0;
    Ok(sizes
        .iter()
        .map(|&size| {
            let part = order[start..start + size].to_vec();
            start += size;
            part
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn sized_partitions_are_disjoint_and_sized() {
        let parts = iid_sized(100, &[30, 10, 5], 4).unwrap();
        assert_eq!(parts.iter().map(Vec::len).collect::<Vec<_>>(), [30, 10, 5]);
        let all: HashSet<u32> = parts.iter().flatten().copied().collect();
        assert_eq!(all.len(), 45);
        assert!(iid_sized(100, &[60, 50], 4).is_err());
        assert!(iid_sized(100, &[0, 5], 4).is_err());
    }

    #[test]
    fn too_large_partitions_are_refused() {
        assert!(matches!(
            iid(100, 10, Some(11), 1),
            Err(PartitionError::NotEnoughSamples { needed: 110, .. })
        ));
        assert!(matches!(
            iid(5, 10, None, 1),
            Err(PartitionError::EmptyPartition { .. })
        ));
    }

    #[test]
    fn same_seed_same_partitions_other_seed_other_partitions() {
        assert_eq!(
            iid(1000, 10, None, 7).unwrap(),
            iid(1000, 10, None, 7).unwrap()
        );
        assert_ne!(
            iid(1000, 10, None, 7).unwrap(),
            iid(1000, 10, None, 8).unwrap()
        );
    }

    proptest! {
        #[test]
        fn partitions_are_disjoint_and_cover(n in 1usize..2000, clients in 1usize..20, seed in any::<u64>()) {
            prop_assume!(n >= clients);
            let parts = iid(n, clients, None, seed).unwrap();
            prop_assert_eq!(parts.len(), clients);
            let size = n / clients;
            let mut seen = HashSet::new();
            for part in &parts {
                prop_assert_eq!(part.len(), size);
                for &i in part {
                    prop_assert!((i as usize) < n);
                    prop_assert!(seen.insert(i), "index {} in two partitions", i);
                }
            }
            // Everything but the remainder is covered.
            prop_assert_eq!(seen.len(), n - n % clients);
        }
    }
}
