//! Splitting a training set among logical clients.
//!
//! Every sampler is a pure function of its inputs and a seed, drawing from one
//! ChaCha8 stream, so the server and every client process compute the same
//! partitions from the same config. Partitions are indices into the training
//! set, client `c` (1-based) at index `c - 1`, and never overlap.
//!
//! `dirichlet` and `quantity_skew` draw from Gamma and Dirichlet distributions
//! written here rather than taken from `rand_distr`, to keep the dependency list
//! short and the algorithm fixed across crate versions: a partition is part of
//! what a run computes, so it must not change under a dependency update. They
//! use `f64::ln` and `exp` from the platform's math library, which may round the
//! last bit differently on another operating system; a draw changes only if a
//! value lands within that rounding of a decision (a rejection test or a cut
//! point), so machines agree in practice but not by construction.

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Draws a Dirichlet sampler makes before it gives up on `min_size`.
pub const MAX_DRAWS: usize = 1000;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
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
    #[error(
        "{clients} clients × min_partition_size {min_size} = {needed} samples, but the training set has {available}"
    )]
    MinSizeUnreachable {
        clients: usize,
        min_size: usize,
        needed: usize,
        available: usize,
    },
    #[error(
        "{sampler} split with concentration {alpha} over {clients} clients: none of {attempts} \
         draws gave every client min_partition_size = {min_size} samples (the best draw's \
         smallest client had {smallest}); raise the concentration, lower min_partition_size \
         or use fewer clients"
    )]
    MinSizeNotReached {
        sampler: &'static str,
        alpha: f64,
        clients: usize,
        min_size: usize,
        smallest: usize,
        attempts: usize,
    },
    #[error(
        "{clients} clients × shards_per_client {shards_per_client} = {shards} shards, but the \
         training set has only {available} samples"
    )]
    TooFewForShards {
        clients: usize,
        shards_per_client: usize,
        shards: usize,
        available: usize,
    },
    #[error("concentration must be a finite number > 0, got {alpha}")]
    InvalidConcentration { alpha: f64 },
    #[error(
        "the natural sampler needs a data set whose samples have users (FEMNIST's writers, \
         Shakespeare's roles); {datasource} has none: choose another data.sampler"
    )]
    NoUsers { datasource: String },
    #[error(
        "{clients} clients, but the training set has {users} users (data.sampler = \
         \"natural\" makes one client of each): lower clients.total_clients"
    )]
    TooFewUsers { clients: usize, users: usize },
    #[error("label {label} of training sample {index} is outside 0..{num_classes}")]
    LabelOutOfRange {
        index: usize,
        label: u32,
        num_classes: usize,
    },
}

/// The `natural` sampler: the data set's own users are the clients. `users`
/// gives each training sample's user (ids from 0); the users are ordered by
/// a ChaCha8 shuffle seeded by `seed`, and client `c` is the `c`-th of them,
/// with every sample of that user, in the data set's order. Users beyond
/// `clients` take no part.
pub fn natural(users: &[u32], clients: usize, seed: u64) -> Result<Vec<Vec<u32>>, PartitionError> {
    let count = users.iter().map(|&u| u as usize + 1).max().unwrap_or(0);
    let mut samples_of: Vec<Vec<u32>> = vec![Vec::new(); count];
    for (index, &user) in users.iter().enumerate() {
        samples_of[user as usize].push(index as u32);
    }
    // A user id that no sample has is no user.
    samples_of.retain(|samples| !samples.is_empty());
    if samples_of.len() < clients {
        return Err(PartitionError::TooFewUsers {
            clients,
            users: samples_of.len(),
        });
    }
    samples_of.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    samples_of.truncate(clients);
    Ok(samples_of)
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

/// The `iid_cyclic` sampler, Plato's iid: the seeded shuffle of
/// `0..num_samples` repeated end to end until it holds `clients ×
/// partition_size` positions, client `c` (1-based) taking every `clients`-th
/// position from `c - 1`. A size beyond the training set's share repeats
/// samples inside a partition (Plato's `fedavg_lenet5_mlx.toml`: 10 clients
/// of 20,000 from MNIST's 60,000 hold 6,000 distinct samples each, seen three
/// or four times an epoch); partitions may share samples when `clients` does
/// not divide `num_samples`.
pub fn iid_cyclic(
    num_samples: usize,
    clients: usize,
    partition_size: Option<usize>,
    seed: u64,
) -> Result<Vec<Vec<u32>>, PartitionError> {
    let size = partition_size.unwrap_or(num_samples / clients.max(1));
    if size == 0 || num_samples == 0 {
        return Err(PartitionError::EmptyPartition {
            clients,
            available: num_samples,
        });
    }
    let mut order: Vec<u32> = (0..num_samples as u32).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    Ok((0..clients)
        .map(|client| {
            (0..size)
                .map(|k| order[(client + k * clients) % num_samples])
                .collect()
        })
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
    // Sizes come from a config: their sum may not fit a usize.
    let needed = sizes
        .iter()
        .try_fold(0usize, |total, &size| total.checked_add(size))
        .unwrap_or(usize::MAX);
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

/// The `dirichlet` sampler, the label-skew split of Hsu, Qi & Brown (2019) as
/// NIID-Bench (Li et al., 2022) implements it: each class's indices are
/// shuffled and cut among the clients in proportions drawn from
/// Dir(`alpha`, …, `alpha`), so a small `alpha` gives each client a few
/// dominant classes and a large one approaches iid. Every sample goes to some
/// client; partition sizes vary.
///
/// Like NIID-Bench, all classes are redrawn until every client has `min_size`
/// samples, at most [`MAX_DRAWS`] times. `min_size = 0` allows empty clients.
pub fn dirichlet(
    labels: &[u32],
    num_classes: usize,
    clients: usize,
    alpha: f64,
    min_size: usize,
    seed: u64,
) -> Result<Vec<Vec<u32>>, PartitionError> {
    check_concentration(alpha)?;
    check_min_size(labels.len(), clients, min_size)?;
    let mut by_class = indices_by_class(labels, num_classes)?;
    if clients == 0 {
        return Ok(Vec::new());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for class in &mut by_class {
        class.shuffle(&mut rng);
    }
    let mut proportions = Vec::with_capacity(clients);
    // Only the sizes are redrawn; the indices are cut once a draw passes.
    let class_sizes = redraw_until(min_size, || {
        let mut totals = vec![0; clients];
        let sizes: Vec<Vec<usize>> = by_class
            .iter()
            .map(|class| {
                dirichlet_draw(&mut rng, alpha, clients, &mut proportions);
                let sizes = proportional_sizes(class.len(), &proportions);
                totals.iter_mut().zip(&sizes).for_each(|(t, s)| *t += s);
                sizes
            })
            .collect();
        (sizes, totals.into_iter().min().unwrap_or(0))
    })
    .map_err(|smallest| PartitionError::MinSizeNotReached {
        sampler: "dirichlet",
        alpha,
        clients,
        min_size,
        smallest,
        attempts: MAX_DRAWS,
    })?;
    let mut partitions = vec![Vec::new(); clients];
    for (class, sizes) in by_class.iter().zip(&class_sizes) {
        let mut start = 0;
        for (partition, &size) in partitions.iter_mut().zip(sizes) {
            partition.extend_from_slice(&class[start..start + size]);
            start += size;
        }
    }
    Ok(partitions)
}

/// The `shards` sampler, the pathological non-iid split of McMahan et al.
/// (2017): the indices, sorted by label, are cut into `clients ×
/// shards_per_client` equal shards and each client gets `shards_per_client`
/// of them at random, so it sees about that many classes.
///
/// The sort is stable over a seeded shuffle, so which samples of a class land
/// in which shard is random too. When the shards do not divide the training
/// set, the remainder (fewer samples than shards) is left out: it is taken
/// from the shuffled order before sorting, a random subset rather than the
/// tail of the last class.
pub fn shards(
    labels: &[u32],
    clients: usize,
    shards_per_client: usize,
    seed: u64,
) -> Result<Vec<Vec<u32>>, PartitionError> {
    if clients == 0 {
        return Ok(Vec::new());
    }
    let available = labels.len();
    if shards_per_client == 0 {
        return Err(PartitionError::EmptyPartition { clients, available });
    }
    let shard_count = clients.saturating_mul(shards_per_client);
    if shard_count > available {
        return Err(PartitionError::TooFewForShards {
            clients,
            shards_per_client,
            shards: shard_count,
            available,
        });
    }
    let shard_size = available / shard_count;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<u32> = (0..available as u32).collect();
    order.shuffle(&mut rng);
    order.truncate(shard_count * shard_size);
    order.sort_by_key(|&index| labels[index as usize]);
    let mut shard_ids: Vec<usize> = (0..shard_count).collect();
    shard_ids.shuffle(&mut rng);
    Ok(shard_ids
        .chunks_exact(shards_per_client)
        .map(|own| {
            own.iter()
                .flat_map(|&shard| &order[shard * shard_size..(shard + 1) * shard_size])
                .copied()
                .collect()
        })
        .collect())
}

/// The `quantity_skew` sampler, NIID-Bench's quantity skew (Li et al., 2022):
/// a seeded shuffle of `0..num_samples` cut into runs whose sizes follow
/// Dir(`alpha`, …, `alpha`) over the clients, so contents are iid and only the
/// amounts differ. Every sample goes to some client.
///
/// Sizes are redrawn until every client has `min_size` samples, at most
/// [`MAX_DRAWS`] times. `min_size = 0` allows empty clients.
pub fn quantity_skew(
    num_samples: usize,
    clients: usize,
    alpha: f64,
    min_size: usize,
    seed: u64,
) -> Result<Vec<Vec<u32>>, PartitionError> {
    check_concentration(alpha)?;
    check_min_size(num_samples, clients, min_size)?;
    if clients == 0 {
        return Ok(Vec::new());
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<u32> = (0..num_samples as u32).collect();
    order.shuffle(&mut rng);
    let mut proportions = Vec::with_capacity(clients);
    let sizes = redraw_until(min_size, || {
        dirichlet_draw(&mut rng, alpha, clients, &mut proportions);
        let sizes = proportional_sizes(num_samples, &proportions);
        let smallest = sizes.iter().copied().min().unwrap_or(0);
        (sizes, smallest)
    })
    .map_err(|smallest| PartitionError::MinSizeNotReached {
        sampler: "quantity_skew",
        alpha,
        clients,
        min_size,
        smallest,
        attempts: MAX_DRAWS,
    })?;
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

/// Samples of each class in `partition`. The histogram is at least
/// `num_classes` long and grows to fit larger labels, so nothing goes uncounted.
///
/// # Panics
/// If `partition` holds an index outside `labels`.
pub fn label_histogram(labels: &[u32], partition: &[u32], num_classes: usize) -> Vec<u64> {
    let mut histogram = vec![0u64; num_classes];
    for &index in partition {
        let label = labels[index as usize] as usize;
        if label >= histogram.len() {
            histogram.resize(label + 1, 0);
        }
        histogram[label] += 1;
    }
    histogram
}

/// A client's partition split into the samples it trains on and the samples it
/// holds out to evaluate the global model (`clients.do_test`): a ChaCha8
/// shuffle of the partition seeded by `(seed, client)`, of which the last
/// `⌈fraction · n⌉` are held out, keeping at least one sample on each side
/// when the partition has two or more.
pub fn holdout(
    partition: &[u32],
    fraction: f64,
    seed: u64,
    client_id: u32,
) -> (Vec<u32>, Vec<u32>) {
    let mut order = partition.to_vec();
    let stream = crate::seeds::derive_seed(seed, "client-holdout", &[client_id as u64]);
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(stream));
    let n = order.len();
    let held = if n >= 2 {
        ((fraction * n as f64).ceil() as usize).clamp(1, n - 1)
    } else {
        0
    };
    let test = order.split_off(n - held);
    (order, test)
}

/// A table of the partitions for `cohort partitions`: a header, then one line
/// per client with its id, its number of samples and its label histogram,
/// columns right-aligned.
///
/// # Panics
/// If a partition holds an index outside `labels`.
pub fn summary_table(partitions: &[Vec<u32>], labels: &[u32], num_classes: usize) -> String {
    let histograms: Vec<Vec<u64>> = partitions
        .iter()
        .map(|partition| label_histogram(labels, partition, num_classes))
        .collect();
    let classes = histograms.iter().map(Vec::len).max().unwrap_or(num_classes);
    let mut rows = vec![
        std::iter::once("client".to_owned())
            .chain(std::iter::once("samples".to_owned()))
            .chain((0..classes).map(|class| class.to_string()))
            .collect::<Vec<_>>(),
    ];
    for (client, (partition, histogram)) in partitions.iter().zip(&histograms).enumerate() {
        let mut row = vec![(client + 1).to_string(), partition.len().to_string()];
        row.extend((0..classes).map(|c| histogram.get(c).copied().unwrap_or(0).to_string()));
        rows.push(row);
    }
    let widths: Vec<usize> = (0..classes + 2)
        .map(|column| rows.iter().map(|row| row[column].len()).max().unwrap_or(0))
        .collect();
    let mut table = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, &width)| format!("{cell:>width$}"))
            .collect();
        table.push_str(&cells.join("  "));
        table.push('\n');
    }
    table
}

fn check_concentration(alpha: f64) -> Result<(), PartitionError> {
    if alpha.is_finite() && alpha > 0.0 {
        Ok(())
    } else {
        Err(PartitionError::InvalidConcentration { alpha })
    }
}

/// Refuses at once what no number of draws could satisfy.
fn check_min_size(available: usize, clients: usize, min_size: usize) -> Result<(), PartitionError> {
    let needed = clients.saturating_mul(min_size);
    if needed > available {
        return Err(PartitionError::MinSizeUnreachable {
            clients,
            min_size,
            needed,
            available,
        });
    }
    Ok(())
}

fn indices_by_class(labels: &[u32], num_classes: usize) -> Result<Vec<Vec<u32>>, PartitionError> {
    let mut by_class = vec![Vec::new(); num_classes];
    for (index, &label) in labels.iter().enumerate() {
        let Some(class) = by_class.get_mut(label as usize) else {
            return Err(PartitionError::LabelOutOfRange {
                index,
                label,
                num_classes,
            });
        };
        class.push(index as u32);
    }
    Ok(by_class)
}

/// Calls `draw` (which returns a value and its smallest partition) until the
/// smallest partition reaches `min_size`. NIID-Bench redraws without a bound;
/// the bound turns an impossible request (a tiny concentration over many
/// clients) into an error instead of a hang. `Err` holds the best smallest
/// partition seen.
fn redraw_until<T>(min_size: usize, mut draw: impl FnMut() -> (T, usize)) -> Result<T, usize> {
    let mut best = 0;
    for _ in 0..MAX_DRAWS {
        let (value, smallest) = draw();
        if smallest >= min_size {
            return Ok(value);
        }
        best = best.max(smallest);
    }
    Err(best)
}

/// Sizes of the runs that cut `n` items in `proportions` (which sum to 1): run
/// `c` ends at ⌊n·(p₁ + … + p_c)⌋ and the last at `n`, as NIID-Bench's
/// `np.split(idx, (np.cumsum(p) * n).astype(int)[:-1])`. The sizes sum to `n`.
fn proportional_sizes(n: usize, proportions: &[f64]) -> Vec<usize> {
    let mut sizes = Vec::with_capacity(proportions.len());
    let (mut cumulative, mut start) = (0.0, 0);
    for (i, &p) in proportions.iter().enumerate() {
        cumulative += p;
        let end = if i + 1 == proportions.len() {
            n
        } else {
            // `as` floors a positive float and saturates; the clamp absorbs a
            // cumulative sum that rounding pushed past 1.
            ((cumulative * n as f64) as usize).clamp(start, n)
        };
        sizes.push(end - start);
        start = end;
    }
    sizes
}

/// A draw from the symmetric Dirichlet Dir(`alpha`, …, `alpha`) over `k`
/// components, into `out`: independent Gamma(`alpha`, 1) draws, normalized.
/// The draws stay logarithms until they are scaled by the largest, so tiny
/// `alpha` cannot underflow every component to 0.
fn dirichlet_draw(rng: &mut impl Rng, alpha: f64, k: usize, out: &mut Vec<f64>) {
    out.clear();
    out.extend((0..k).map(|_| ln_gamma_draw(rng, alpha)));
    let largest = out.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    out.iter_mut().for_each(|x| *x = (*x - largest).exp());
    // At least 1: the largest component became exp(0).
    let sum: f64 = out.iter().sum();
    out.iter_mut().for_each(|x| *x /= sum);
}

/// The natural log of a Gamma(`alpha`, 1) draw, by Marsaglia & Tsang (2000),
/// "A simple method for generating gamma variables": for `alpha` ≥ 1, with
/// d = alpha − 1/3 and c = 1/√(9d), draw x ~ N(0, 1) and v = (1 + cx)³, and
/// accept d·v when v > 0 and either u < 1 − 0.0331·x⁴ (the cheap squeeze) or
/// ln u < x²/2 + d(1 − v + ln v), u ~ U(0, 1). For `alpha` < 1, their boost:
/// Gamma(alpha) = Gamma(alpha + 1)·U^(1/alpha).
///
/// A logarithm, because U^(1/alpha) underflows f64 for small `alpha` (U = 0.5,
/// alpha = 0.001 gives 2⁻¹⁰⁰⁰).
fn ln_gamma_draw(rng: &mut impl Rng, alpha: f64) -> f64 {
    if alpha < 1.0 {
        // 1 − [0, 1) is (0, 1], so the log is finite.
        let u = 1.0 - rng.random::<f64>();
        return ln_gamma_draw(rng, alpha + 1.0) + u.ln() / alpha;
    }
    let d = alpha - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = standard_normal(rng);
        let v = 1.0 + c * x;
        if v <= 0.0 {
            continue;
        }
        let v = v * v * v;
        let u = rng.random::<f64>();
        let x2 = x * x;
        if u < 1.0 - 0.0331 * x2 * x2 || u.ln() < 0.5 * x2 + d * (1.0 - v + v.ln()) {
            return d.ln() + v.ln();
        }
    }
}

/// A N(0, 1) draw by Marsaglia's polar method: a point uniform in the unit
/// disc gives a normal without sin or cos (only ln and sqrt). The second normal
/// it yields is dropped, to keep the sampler stateless.
fn standard_normal(rng: &mut impl Rng) -> f64 {
    loop {
        let u = 2.0 * rng.random::<f64>() - 1.0;
        let v = 2.0 * rng.random::<f64>() - 1.0;
        let s = u * u + v * v;
        if s > 0.0 && s < 1.0 {
            return u * (-2.0 * s.ln() / s).sqrt();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_clients_are_whole_users_in_a_seeded_order() {
        // Samples 0..6 of users 2, 0, 2, 1, 0, 2 (user 3 has none).
        let users = [2, 0, 2, 1, 0, 2];
        let parts = natural(&users, 3, 5).unwrap();
        let mut sorted = parts.clone();
        sorted.sort();
        assert_eq!(sorted, [vec![0, 2, 5], vec![1, 4], vec![3]]);
        assert_eq!(natural(&users, 3, 5).unwrap(), parts, "seeded");
        let first = natural(&users, 1, 5).unwrap();
        assert_eq!(first[..], parts[..1]);
        assert!(matches!(
            natural(&users, 4, 5),
            Err(PartitionError::TooFewUsers {
                clients: 4,
                users: 3
            })
        ));
    }

    #[test]
    fn iid_cyclic_is_platos_strided_fill_of_the_repeated_shuffle() {
        // 10 clients of 20 from 60 samples, as Plato's 10 × 20,000 of 60,000:
        // each client holds 6 distinct samples, two seen 4 times and four 3
        // times, and no two clients share one.
        let parts = iid_cyclic(60, 10, Some(20), 7).unwrap();
        assert_eq!(parts.len(), 10);
        let mut owner = std::collections::HashMap::new();
        for (client, part) in parts.iter().enumerate() {
            assert_eq!(part.len(), 20);
            let mut counts = std::collections::BTreeMap::new();
            for &index in part {
                *counts.entry(index).or_insert(0) += 1;
                assert_eq!(*owner.entry(index).or_insert(client), client);
            }
            assert_eq!(counts.len(), 6);
            let mut repeats: Vec<i32> = counts.into_values().collect();
            repeats.sort_unstable();
            assert_eq!(repeats, [3, 3, 3, 3, 4, 4]);
        }
        assert_eq!(owner.len(), 60);
        // Sizes that fit give disjoint partitions, like `iid`.
        let fit = iid_cyclic(60, 3, Some(20), 7).unwrap();
        let mut all: Vec<u32> = fit.concat();
        all.sort_unstable();
        assert_eq!(all, (0..60).collect::<Vec<u32>>());
        assert_eq!(iid_cyclic(60, 3, Some(20), 7).unwrap(), fit);
        assert!(iid_cyclic(0, 3, Some(20), 7).is_err());
    }
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn holdout_is_seeded_disjoint_and_sized() {
        let partition: Vec<u32> = (100..110).collect();
        let (train, test) = holdout(&partition, 0.2, 1, 3);
        assert_eq!((train.len(), test.len()), (8, 2));
        let mut all: Vec<u32> = train.iter().chain(&test).copied().collect();
        all.sort_unstable();
        assert_eq!(all, partition);
        assert_eq!(holdout(&partition, 0.2, 1, 3), (train, test.clone()));
        assert_ne!(holdout(&partition, 0.2, 1, 4).1, test);
        // Tiny partitions keep a training sample.
        assert_eq!(holdout(&[7], 0.5, 1, 1), (vec![7], vec![]));
        assert_eq!(holdout(&[7, 8], 0.9, 1, 1).0.len(), 1);
    }

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

    /// Every index below `n` at most once across `parts`; returns how many.
    fn assert_disjoint(parts: &[Vec<u32>], n: usize) -> usize {
        let mut seen = HashSet::new();
        for &i in parts.iter().flatten() {
            assert!((i as usize) < n, "index {i} outside 0..{n}");
            assert!(seen.insert(i), "index {i} in two partitions");
        }
        seen.len()
    }

    /// `per_class` samples of each of `classes` labels, interleaved.
    fn balanced_labels(classes: u32, per_class: usize) -> Vec<u32> {
        (0..per_class).flat_map(|_| 0..classes).collect()
    }

    #[test]
    fn gamma_draws_have_the_right_mean_and_variance() {
        let n = 20_000.0;
        for (alpha, seed) in [(0.05, 1), (0.3, 2), (1.0, 3), (3.7, 4), (100.0, 5)] {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let draws: Vec<f64> = (0..n as usize)
                .map(|_| ln_gamma_draw(&mut rng, alpha).exp())
                .collect();
            let mean = draws.iter().sum::<f64>() / n;
            let var = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
            // Gamma(α, 1) has mean and variance α; allow five standard errors
            // (the variance estimate's from the fourth moment 3α² + 6α).
            assert!(
                (mean - alpha).abs() < 5.0 * (alpha / n).sqrt(),
                "α = {alpha}: mean {mean}"
            );
            let var_error = ((2.0 * alpha * alpha + 6.0 * alpha) / n).sqrt();
            assert!(
                (var - alpha).abs() < 5.0 * var_error,
                "α = {alpha}: variance {var}"
            );
        }
    }

    #[test]
    fn dirichlet_draws_sum_to_one_even_for_tiny_alpha() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut p = Vec::new();
        for alpha in [1e-4, 0.01, 0.5, 1.0, 1e6] {
            for _ in 0..100 {
                dirichlet_draw(&mut rng, alpha, 7, &mut p);
                assert!(p.iter().all(|x| x.is_finite() && *x >= 0.0), "{p:?}");
                assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12, "{p:?}");
            }
        }
    }

    #[test]
    fn proportional_sizes_floor_the_cumulative_cut_points() {
        assert_eq!(proportional_sizes(10, &[0.25, 0.25, 0.5]), [2, 3, 5]);
        assert_eq!(proportional_sizes(7, &[1.0, 0.0]), [7, 0]);
        assert_eq!(proportional_sizes(0, &[0.5, 0.5]), [0, 0]);
        // A cumulative sum rounded past 1 still ends at n.
        assert_eq!(proportional_sizes(3, &[0.6, 0.4000001, 0.0]), [1, 2, 0]);
    }

    #[test]
    fn dirichlet_with_huge_concentration_splits_each_class_evenly() {
        // 4 clients, 2 classes of 100: Dir(1e6) is uniform to ~1e-3, so each
        // client gets 25 ± 1 of each class.
        let labels = balanced_labels(2, 100);
        let parts = dirichlet(&labels, 2, 4, 1e6, 1, 3).unwrap();
        assert_eq!(assert_disjoint(&parts, 200), 200);
        for part in &parts {
            for count in label_histogram(&labels, part, 2) {
                assert!((24..=26).contains(&count), "{count}");
            }
        }
    }

    #[test]
    fn dirichlet_edge_cases() {
        let labels = balanced_labels(3, 10);
        let one = dirichlet(&labels, 3, 1, 0.1, 10, 1).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].len(), 30);
        assert_eq!(
            dirichlet(&labels, 3, 0, 0.1, 10, 1).unwrap(),
            Vec::<Vec<u32>>::new()
        );
        assert!(matches!(
            dirichlet(&labels, 2, 2, 1.0, 1, 1),
            Err(PartitionError::LabelOutOfRange {
                index: 2,
                label: 2,
                num_classes: 2
            })
        ));
        assert!(matches!(
            dirichlet(&labels, 3, 4, 1.0, 8, 1),
            Err(PartitionError::MinSizeUnreachable {
                needed: 32,
                available: 30,
                ..
            })
        ));
        for alpha in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                dirichlet(&labels, 3, 2, alpha, 1, 1),
                Err(PartitionError::InvalidConcentration { .. })
            ));
        }
    }

    #[test]
    fn unreachable_min_size_is_an_error_after_bounded_draws() {
        // One class of 50 over 10 clients at α = 0.01: nearly all of it goes
        // to one client in every draw, so no draw gives everyone 4.
        let labels = vec![0u32; 50];
        let error = dirichlet(&labels, 1, 10, 0.01, 4, 1).unwrap_err();
        let PartitionError::MinSizeNotReached {
            smallest, attempts, ..
        } = error
        else {
            panic!("{error:?}");
        };
        assert!(smallest < 4);
        assert_eq!(attempts, MAX_DRAWS);
        let message = quantity_skew(50, 10, 0.01, 4, 1).unwrap_err().to_string();
        for part in [
            "quantity_skew",
            "0.01",
            "10 clients",
            "min_partition_size = 4",
        ] {
            assert!(message.contains(part), "{message}");
        }
    }

    #[test]
    fn shards_of_twenty_samples_hold_one_label_each() {
        // 5 labels × 4 samples, 5 clients × 2 shards of 2: each shard lies
        // within one label, so each client has 4 samples of at most 2 labels,
        // each label in an even count.
        let labels: Vec<u32> = (0..20).map(|i| (i / 4) as u32).collect();
        let parts = shards(&labels, 5, 2, 11).unwrap();
        assert_eq!(assert_disjoint(&parts, 20), 20);
        for part in &parts {
            assert_eq!(part.len(), 4);
            for shard in part.chunks(2) {
                assert_eq!(labels[shard[0] as usize], labels[shard[1] as usize]);
            }
            let histogram = label_histogram(&labels, part, 5);
            assert!(histogram.iter().filter(|&&c| c > 0).count() <= 2);
            assert!(histogram.iter().all(|c| c % 2 == 0), "{histogram:?}");
        }
    }

    #[test]
    fn shards_leave_out_the_remainder_and_refuse_too_few_samples() {
        // 20 samples in 3 × 2 = 6 shards of 3: 2 samples are left out.
        let labels: Vec<u32> = (0..20).map(|i| (i / 4) as u32).collect();
        let parts = shards(&labels, 3, 2, 1).unwrap();
        assert!(parts.iter().all(|p| p.len() == 6));
        assert_eq!(assert_disjoint(&parts, 20), 18);
        assert!(matches!(
            shards(&labels, 11, 2, 1),
            Err(PartitionError::TooFewForShards {
                shards: 22,
                available: 20,
                ..
            })
        ));
        assert!(matches!(
            shards(&labels, 3, 0, 1),
            Err(PartitionError::EmptyPartition { .. })
        ));
    }

    #[test]
    fn quantity_skew_keeps_contents_iid_and_varies_sizes() {
        let parts = quantity_skew(1000, 5, 0.5, 10, 2).unwrap();
        assert_eq!(assert_disjoint(&parts, 1000), 1000);
        let sizes: Vec<usize> = parts.iter().map(Vec::len).collect();
        assert!(sizes.iter().all(|&s| s >= 10), "{sizes:?}");
        assert_ne!(sizes.iter().min(), sizes.iter().max(), "{sizes:?}");
    }

    #[test]
    fn non_iid_samplers_depend_on_the_seed_only() {
        let labels = balanced_labels(10, 50);
        for (a, b) in [(1, 1), (1, 2)] {
            let same = a == b;
            assert_eq!(
                dirichlet(&labels, 10, 8, 0.5, 5, a).unwrap()
                    == dirichlet(&labels, 10, 8, 0.5, 5, b).unwrap(),
                same
            );
            assert_eq!(
                shards(&labels, 8, 2, a).unwrap() == shards(&labels, 8, 2, b).unwrap(),
                same
            );
            assert_eq!(
                quantity_skew(500, 8, 0.5, 5, a).unwrap()
                    == quantity_skew(500, 8, 0.5, 5, b).unwrap(),
                same
            );
        }
    }

    /// Mean over clients of the total-variation distance between a client's
    /// label distribution and the uniform one: 0 for iid, near 1 for one
    /// class per client.
    fn mean_label_skew(parts: &[Vec<u32>], labels: &[u32], classes: usize) -> f64 {
        let skews: Vec<f64> = parts
            .iter()
            .filter(|p| !p.is_empty())
            .map(|part| {
                let histogram = label_histogram(labels, part, classes);
                let n = part.len() as f64;
                histogram
                    .iter()
                    .map(|&c| (c as f64 / n - 1.0 / classes as f64).abs())
                    .sum::<f64>()
                    / 2.0
            })
            .collect();
        skews.iter().sum::<f64>() / skews.len() as f64
    }

    #[test]
    fn small_concentration_skews_labels_far_more_than_large() {
        // Fixed seeds make this deterministic; the margins are wide (about
        // 0.6 against 0.05) so it also holds for seeds other than these.
        let labels = balanced_labels(10, 100);
        for seed in 1..=5 {
            let skewed = mean_label_skew(
                &dirichlet(&labels, 10, 10, 0.1, 10, seed).unwrap(),
                &labels,
                10,
            );
            let even = mean_label_skew(
                &dirichlet(&labels, 10, 10, 100.0, 10, seed).unwrap(),
                &labels,
                10,
            );
            assert!(skewed > 0.4, "seed {seed}: α = 0.1 skew {skewed}");
            assert!(even < 0.15, "seed {seed}: α = 100 skew {even}");
            assert!(skewed > 3.0 * even, "seed {seed}: {skewed} vs {even}");
        }
    }

    #[test]
    fn histogram_and_summary_table() {
        let labels = [0u32, 1, 1, 2, 9];
        assert_eq!(label_histogram(&labels, &[1, 2, 3], 3), [0, 2, 1]);
        // A label past num_classes widens the histogram instead of vanishing.
        assert_eq!(label_histogram(&labels, &[4], 3).len(), 10);
        let table = summary_table(&[vec![0, 1, 2], vec![3]], &labels, 3);
        assert_eq!(
            table,
            "client  samples  0  1  2\n     1        3  1  2  0\n     2        1  0  0  1\n"
        );
    }

    proptest! {
        #[test]
        fn dirichlet_partitions_are_disjoint_and_cover(
            labels in proptest::collection::vec(0u32..5, 0..300),
            clients in 1usize..12,
            alpha in prop::sample::select(vec![0.05, 0.3, 1.0, 10.0]),
            seed in any::<u64>(),
        ) {
            let parts = dirichlet(&labels, 5, clients, alpha, 0, seed).unwrap();
            prop_assert_eq!(parts.len(), clients);
            prop_assert_eq!(assert_disjoint(&parts, labels.len()), labels.len());
        }

        #[test]
        fn dirichlet_meets_min_size_or_says_why(
            labels in proptest::collection::vec(0u32..3, 0..200),
            clients in 1usize..8,
            min_size in 1usize..6,
            seed in any::<u64>(),
        ) {
            match dirichlet(&labels, 3, clients, 0.5, min_size, seed) {
                Ok(parts) => {
                    prop_assert_eq!(assert_disjoint(&parts, labels.len()), labels.len());
                    prop_assert!(parts.iter().all(|p| p.len() >= min_size));
                }
                Err(PartitionError::MinSizeUnreachable { .. }) => {
                    prop_assert!(clients * min_size > labels.len());
                }
                Err(PartitionError::MinSizeNotReached { smallest, .. }) => {
                    prop_assert!(smallest < min_size);
                }
                Err(other) => prop_assert!(false, "{other}"),
            }
        }

        #[test]
        fn shards_are_disjoint_and_equal(
            labels in proptest::collection::vec(0u32..10, 1..400),
            clients in 1usize..10,
            shards_per_client in 1usize..4,
            seed in any::<u64>(),
        ) {
            let shard_count = clients * shards_per_client;
            prop_assume!(shard_count <= labels.len());
            let shard_size = labels.len() / shard_count;
            let parts = shards(&labels, clients, shards_per_client, seed).unwrap();
            prop_assert_eq!(parts.len(), clients);
            for part in &parts {
                prop_assert_eq!(part.len(), shards_per_client * shard_size);
                // Each shard is a run of the label-sorted order.
                for shard in part.chunks(shard_size) {
                    prop_assert!(shard.windows(2).all(|w| labels[w[0] as usize] <= labels[w[1] as usize]));
                }
            }
            prop_assert_eq!(assert_disjoint(&parts, labels.len()), shard_count * shard_size);
            prop_assert_eq!(&parts, &shards(&labels, clients, shards_per_client, seed).unwrap());
        }

        #[test]
        fn quantity_skew_is_disjoint_covering_and_sized(
            n in 0usize..2000,
            clients in 1usize..20,
            alpha in prop::sample::select(vec![0.1, 0.5, 1.0, 100.0]),
            min_size in 0usize..20,
            seed in any::<u64>(),
        ) {
            match quantity_skew(n, clients, alpha, min_size, seed) {
                Ok(parts) => {
                    prop_assert_eq!(parts.len(), clients);
                    prop_assert_eq!(assert_disjoint(&parts, n), n);
                    prop_assert!(parts.iter().all(|p| p.len() >= min_size));
                    prop_assert_eq!(&parts, &quantity_skew(n, clients, alpha, min_size, seed).unwrap());
                }
                Err(PartitionError::MinSizeUnreachable { .. }) => prop_assert!(clients * min_size > n),
                Err(PartitionError::MinSizeNotReached { smallest, .. }) => prop_assert!(smallest < min_size),
                Err(other) => prop_assert!(false, "{other}"),
            }
        }
    }
}
