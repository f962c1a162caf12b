//! A federated round's updates through the protocol: what the round loop
//! calls in simulation mode instead of handing the strategy every update.
//!
//! Each client masks `[w, w·(x − g)]`, its sample count `w` and its model
//! `x` after training relative to the global model `g` it was sent, so the
//! server's unmasked sum is `Σ w` and `Σ w·(x − g)`, and the round's mean is
//! `g + Σ w·(x − g) / Σ w`, FedAvg's sample-weighted mean. Flower masks the
//! parameters themselves; masking the change instead keeps the values small
//! (so `clipping_range` bounds each weighted change, and a quantum
//! `2·clipping_range / quantization_range` is fine-grained relative to it),
//! and is what client-side clipping for differential privacy bounds.
//!
//! The protocol runs over every client the round selected, in Flower's
//! order: keys are agreed before training, so a selected client whose
//! update did not arrive (it failed, timed out, or its update was refused)
//! has dropped after sharing its keys, and its masks are removed through its
//! neighbours' shares. The result holds only the sum's mean: no client's
//! update leaves this function, unmasked or masked.
//!
//! Error bound (the quantisation's, [`quant::sum_error_bound`]): with no
//! value clipped and every `|x − g|` at most `M`, the weighted sum `S` is
//! within `e_S = n·max_weight·(2c/Q + M/(2Q))` and the total weight `T`
//! within `e_T = n·max_weight/(2Q)` of the exact ones, so each element of
//! the mean is within `(e_S + M·e_T) / (T − e_T)` of FedAvg's
//! ([`mean_error_bound`]).

use std::collections::BTreeSet;

use rand::SeedableRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand_chacha::ChaCha20Rng;

use super::client::ClientError;
use super::ddg::{self, Ddg, DdgError, DdgParams};
use super::quant;
use super::sim::{
    Aggregate, DropPoint, Timings, WireBytes, simulate_encoded_round, simulate_round,
};
use super::{Params, PeerError, SecAggError};
use crate::aggregate::{Contribution, validate};
use crate::strategy::{ClientUpdate, FloatLayout, float_layout};
use crate::tree::ParamTree;

/// What a secure round gives the server: the mean, and the protocol's cost.
#[derive(Debug, Clone, PartialEq)]
pub struct SecureMean {
    /// `g + Σ w·(x − g) / Σ w` over the contributors; `None` when their
    /// total weight is 0.
    pub mean: Option<ParamTree>,
    /// The dequantised total weight `Σ w`.
    pub total_weight: f64,
    /// The clients whose updates are in the sum, sorted.
    pub contributors: Vec<u32>,
    /// Selected clients that left the protocol, and why, in id order.
    pub dropped: Vec<(u32, String)>,
    pub bytes: WireBytes,
    pub timings: Timings,
}

/// A round that cannot be aggregated securely: the model stays as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SecureRoundError {
    #[error("the global model cannot be masked: {0}")]
    Model(String),
    #[error("the secure aggregation protocol aborted: {0}")]
    Protocol(#[from] SecAggError),
    #[error("distributed discrete Gaussian noise: {0}")]
    Noise(DdgError),
}

/// The round's mean through the protocol. `selected` are the round's
/// clients, `updates` the ones that arrived (each id among `selected`),
/// `dropouts` the protocol stages at which arrived clients vanish (a
/// simulation's knob), `seed` every random choice of the round (keys, the
/// graph, rounding).
pub fn secure_mean(
    params: &Params,
    global: &ParamTree,
    selected: &[u32],
    updates: &[ClientUpdate<'_>],
    dropouts: &[(u32, DropPoint)],
    seed: u64,
) -> Result<SecureMean, SecureRoundError> {
    let layout = float_layout("secure aggregation", global)
        .map_err(|e| SecureRoundError::Model(e.to_string()))?;
    let anchor = layout.flatten(global);
    let mut dropped = Vec::new();
    let mut changes = Vec::with_capacity(updates.len());
    for update in updates {
        match change_of(&layout, &anchor, global, update) {
            Ok(change) => changes.push((update.client_id, update.num_samples as f64, change)),
            // The client cannot mask what does not fit the model: it drops.
            Err(reason) => dropped.push((update.client_id, reason)),
        }
    }
    let zeros = vec![0.0f32; layout.len()];
    let arrived = changes.iter().map(|(id, w, x)| (*id, (*w, x.as_slice())));
    let (arrived, inputs, drops) = round_inputs(arrived, selected, dropouts, (0.0, &zeros[..]));
    let inputs: Vec<(u64, f64, &[f32])> = inputs.iter().map(|&(id, (w, x))| (id, w, x)).collect();
    let round = simulate_round(params, &inputs, &drops, seed)?;
    let contributors = settle(&round, &arrived, dropouts, &mut dropped);
    let mean = mean_of(
        &layout,
        &anchor,
        global,
        &round.weighted_sum,
        round.total_weight,
    );
    Ok(SecureMean {
        mean,
        total_weight: round.total_weight,
        contributors,
        dropped,
        bytes: round.bytes,
        timings: round.timings,
    })
}

/// The protocol's inputs: the arrived clients' (sorted by id), then every
/// selected client whose update did not arrive, with `absent` as its input
/// and a drop after sharing keys (its keys were shared before training; its
/// input never comes); and the ids that arrived.
#[allow(clippy::type_complexity)]
fn round_inputs<T: Copy>(
    arrived: impl Iterator<Item = (u32, T)>,
    selected: &[u32],
    dropouts: &[(u32, DropPoint)],
    absent: T,
) -> (BTreeSet<u32>, Vec<(u64, T)>, Vec<(u64, DropPoint)>) {
    let mut inputs: Vec<(u64, T)> = arrived.map(|(id, x)| (u64::from(id), x)).collect();
    let ids: BTreeSet<u32> = inputs.iter().map(|(id, _)| *id as u32).collect();
    let mut drops: Vec<(u64, DropPoint)> = dropouts
        .iter()
        .map(|&(id, point)| (u64::from(id), point))
        .collect();
    for &id in selected.iter().filter(|id| !ids.contains(id)) {
        inputs.push((u64::from(id), absent));
        drops.push((u64::from(id), DropPoint::AfterSharingKeys));
    }
    inputs.sort_by_key(|(id, _)| *id);
    (ids, inputs, drops)
}

/// The round's contributors, with the reasons of those that arrived and are
/// not among them added to `dropped` (sorted by id).
fn settle(
    round: &Aggregate,
    arrived: &BTreeSet<u32>,
    dropouts: &[(u32, DropPoint)],
    dropped: &mut Vec<(u32, String)>,
) -> Vec<u32> {
    let contributors: Vec<u32> = round.contributors.iter().map(|&id| id as u32).collect();
    dropped.extend(reasons(&round.refused, &round.client_errors));
    for &(id, point) in dropouts {
        if arrived.contains(&id) && !contributors.contains(&id) {
            dropped.push((id, format!("vanished {}", point_name(point))));
        }
    }
    dropped.sort_by_key(|(id, _)| *id);
    contributors
}

/// The seeds of a simulated round with distributed discrete Gaussian noise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DdgSeeds {
    /// The protocol's (keys, graph), as [`secure_mean`]'s `seed`.
    pub protocol: u64,
    /// The rotation every client of the round shares ([`ddg::rotation_seed`]).
    pub rotation: u64,
    /// Each client's rounding and noise, a stream per client
    /// ([`ddg::noise_seed`]). Only a simulation may draw a client's noise
    /// from a seed the server knows: in network mode each client draws its
    /// own from the operating system.
    pub noise: u64,
}

/// [`secure_mean`] with distributed discrete Gaussian noise ([`ddg`]): each
/// arrived client clips, rotates, rounds and noises its change `x − g`
/// (a client whose update cannot be encoded drops, with the reason), the
/// protocol sums the integers mod the modulus, and the mean is
/// `g + decode(sum)`, the **unweighted** mean of the clipped changes plus
/// noise; `total_weight` is the number of contributors.
pub fn secure_ddg_mean(
    params: &Params,
    ddg: &Ddg,
    global: &ParamTree,
    selected: &[u32],
    updates: &[ClientUpdate<'_>],
    dropouts: &[(u32, DropPoint)],
    seeds: DdgSeeds,
) -> Result<SecureMean, SecureRoundError> {
    let layout = ddg_layout(ddg, global)?;
    let anchor = layout.flatten(global);
    let mut dropped = Vec::new();
    let mut encoded = Vec::with_capacity(updates.len());
    for update in updates {
        let encoding = change_of(&layout, &anchor, global, update).and_then(|change| {
            let seed = ddg::noise_seed(seeds.noise, update.client_id);
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            ddg.encode(&change, seeds.rotation, &mut rng)
                .map_err(|e| format!("cannot add its noise: {e}"))
        });
        match encoding {
            Ok(values) => encoded.push((update.client_id, values)),
            Err(reason) => dropped.push((update.client_id, reason)),
        }
    }
    let zeros = vec![0u32; ddg.padded + 1];
    let arrived = encoded.iter().map(|(id, v)| (*id, v.as_slice()));
    let (arrived, inputs, drops) = round_inputs(arrived, selected, dropouts, &zeros[..]);
    let round = simulate_encoded_round(params, &inputs, &drops, seeds.protocol)?;
    let contributors = settle(&round, &arrived, dropouts, &mut dropped);
    let mean = ddg_mean(
        ddg,
        &layout,
        &anchor,
        global,
        &round.sum,
        contributors.len(),
        seeds.rotation,
    )?;
    Ok(SecureMean {
        mean,
        total_weight: contributors.len() as f64,
        contributors,
        dropped,
        bytes: round.bytes,
        timings: round.timings,
    })
}

/// The mechanism for `global`'s float values masked under `params`.
pub fn resolve_ddg(
    ddg: &DdgParams,
    params: &Params,
    global: &ParamTree,
) -> Result<Ddg, SecureRoundError> {
    ddg.resolve(masked_len(global)?, params.modulus_range)
        .map_err(SecureRoundError::Noise)
}

/// What one client masks in network mode with DDG, in its own process: its
/// change `x − g` ([`masked_change`]) encoded with its own `rng`.
pub fn ddg_masked_input(
    ddg: &Ddg,
    global: &ParamTree,
    update: &ClientUpdate<'_>,
    rotation_seed: u64,
    rng: &mut impl rand::RngCore,
) -> Result<Vec<u32>, String> {
    let change = masked_change(global, update)?;
    ddg.encode(&change, rotation_seed, rng)
        .map_err(|e| format!("cannot add its noise: {e}"))
}

/// The mean the server makes of an unmasked DDG sum of `contributors`
/// clients in network mode, as [`secure_ddg_mean`] makes it; `None` without
/// contributors.
pub fn ddg_mean_of_sum(
    ddg: &Ddg,
    global: &ParamTree,
    sum: &[u32],
    contributors: usize,
    rotation_seed: u64,
) -> Result<Option<ParamTree>, SecureRoundError> {
    let layout = ddg_layout(ddg, global)?;
    let anchor = layout.flatten(global);
    ddg_mean(
        ddg,
        &layout,
        &anchor,
        global,
        sum,
        contributors,
        rotation_seed,
    )
}

fn ddg_layout(ddg: &Ddg, global: &ParamTree) -> Result<FloatLayout, SecureRoundError> {
    let layout = float_layout("secure aggregation", global)
        .map_err(|e| SecureRoundError::Model(e.to_string()))?;
    if layout.len() != ddg.dim {
        return Err(SecureRoundError::Model(format!(
            "the model has {} values; the noise was set up for {}",
            layout.len(),
            ddg.dim
        )));
    }
    Ok(layout)
}

fn ddg_mean(
    ddg: &Ddg,
    layout: &FloatLayout,
    anchor: &[f32],
    global: &ParamTree,
    sum: &[u32],
    contributors: usize,
    rotation_seed: u64,
) -> Result<Option<ParamTree>, SecureRoundError> {
    if contributors == 0 {
        return Ok(None);
    }
    let change = ddg
        .decode(sum, contributors, rotation_seed)
        .map_err(SecureRoundError::Noise)?;
    let values: Vec<f32> = anchor
        .iter()
        .zip(&change)
        .map(|(&g, &c)| (f64::from(g) + c) as f32)
        .collect();
    Ok(Some(layout.rebuild(global, &values)))
}

/// `g + Σ w·(x − g) / Σ w` as a model; `None` when the total weight is 0.
fn mean_of(
    layout: &FloatLayout,
    anchor: &[f32],
    global: &ParamTree,
    weighted_sum: &[f64],
    total_weight: f64,
) -> Option<ParamTree> {
    (total_weight > 0.0).then(|| {
        let values: Vec<f32> = anchor
            .iter()
            .zip(weighted_sum)
            .map(|(&g, &s)| (f64::from(g) + s / total_weight) as f32)
            .collect();
        layout.rebuild(global, &values)
    })
}

/// What one client masks in network mode, computed in its own process:
/// `x − g` for its update (checked against the global model as
/// [`secure_mean`] checks it), flattened over the float leaves. With its
/// sample count as the weight, this is exactly the input a client of
/// [`secure_mean`] masks, so both modes run the same protocol on the same
/// vectors.
pub fn masked_change(global: &ParamTree, update: &ClientUpdate<'_>) -> Result<Vec<f32>, String> {
    let layout = float_layout("secure aggregation", global).map_err(|e| e.to_string())?;
    let anchor = layout.flatten(global);
    change_of(&layout, &anchor, global, update)
}

/// The mean the server makes of an unmasked sum in network mode, as
/// [`secure_mean`] makes it: `g + Σ w·(x − g) / Σ w`, `None` when the total
/// weight is 0. `weighted_sum` must have one entry per float value of
/// `global`.
pub fn mean_of_sum(
    global: &ParamTree,
    weighted_sum: &[f64],
    total_weight: f64,
) -> Result<Option<ParamTree>, SecureRoundError> {
    let layout = float_layout("secure aggregation", global)
        .map_err(|e| SecureRoundError::Model(e.to_string()))?;
    if weighted_sum.len() != layout.len() {
        return Err(SecureRoundError::Model(format!(
            "the unmasked sum has {} values; the model has {}",
            weighted_sum.len(),
            layout.len()
        )));
    }
    let anchor = layout.flatten(global);
    Ok(mean_of(
        &layout,
        &anchor,
        global,
        weighted_sum,
        total_weight,
    ))
}

/// The number of float values a model masks (the protocol's dimension).
pub fn masked_len(global: &ParamTree) -> Result<usize, SecureRoundError> {
    float_layout("secure aggregation", global)
        .map(|layout| layout.len())
        .map_err(|e| SecureRoundError::Model(e.to_string()))
}

/// `x − g` for one update, after FedAvg's checks of the update against the
/// global model and a finiteness check.
fn change_of(
    layout: &FloatLayout,
    anchor: &[f32],
    global: &ParamTree,
    update: &ClientUpdate<'_>,
) -> Result<Vec<f32>, String> {
    let contribution = Contribution {
        client_id: update.client_id,
        weight: update.num_samples as f64,
        tree: update.tree,
    };
    validate(global, &[contribution]).map_err(|e| format!("its update does not fit: {e}"))?;
    let values = layout.flatten(update.tree);
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        return Err(format!("its update is not finite at element {index}"));
    }
    Ok(values.iter().zip(anchor).map(|(x, g)| x - g).collect())
}

/// The protocol's refusals and client failures as `(client, reason)`.
fn reasons(refused: &[PeerError], failures: &[(u64, ClientError)]) -> Vec<(u32, String)> {
    let mut out: Vec<(u32, String)> = refused
        .iter()
        .map(|e| (e.client() as u32, format!("refused by the server: {e}")))
        .collect();
    out.extend(
        failures
            .iter()
            .map(|(id, e)| (*id as u32, format!("left the protocol: {e}"))),
    );
    out
}

fn point_name(point: DropPoint) -> &'static str {
    match point {
        DropPoint::AfterAdvertising => "after advertising its keys",
        DropPoint::AfterSharingKeys => "after sharing its keys",
        DropPoint::AfterMaskedInput => "after sending its masked input",
    }
}

/// `fraction` of the `arrived` clients (rounded to the nearest count), each
/// vanishing at one of the three stages, all drawn from `seed`.
pub fn draw_dropouts(arrived: &[u32], fraction: f64, seed: u64) -> Vec<(u32, DropPoint)> {
    let count = ((fraction * arrived.len() as f64).round() as usize).min(arrived.len());
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let mut ids = arrived.to_vec();
    ids.shuffle(&mut rng);
    let points = [
        DropPoint::AfterAdvertising,
        DropPoint::AfterSharingKeys,
        DropPoint::AfterMaskedInput,
    ];
    let mut drawn: Vec<(u32, DropPoint)> = ids
        .into_iter()
        .take(count)
        .map(|id| (id, *points.choose(&mut rng).expect("three points")))
        .collect();
    drawn.sort_unstable();
    drawn
}

/// How far each element of the secure mean can be from FedAvg's mean of the
/// same updates, for `clients` contributors with total weight
/// `total_weight`, every change `|x − g|` at most `max_change` and none
/// clipped (see the module docs). `None` when the bound is not finite (the
/// weight error swallows the total weight).
pub fn mean_error_bound(
    params: &Params,
    clients: usize,
    total_weight: f64,
    max_change: f64,
) -> Option<f64> {
    let (sum_error, weight_error) = quant::sum_error_bound(params, clients, max_change);
    let below = total_weight - weight_error;
    (below > 0.0).then(|| (sum_error + max_change * weight_error) / below)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secagg::NumShares;
    use crate::tree::Array;

    fn tree(values: &[f32]) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![values.len()], values.to_vec()).unwrap(),
        )])
    }

    fn values(tree: &ParamTree) -> Vec<f32> {
        tree.leaves()[0].1.as_f32().unwrap().to_vec()
    }

    fn update(client_id: u32, num_samples: u64, tree: &ParamTree) -> ClientUpdate<'_> {
        ClientUpdate {
            client_id,
            num_samples,
            local_steps: 1,
            tree,
        }
    }

    /// FedAvg's mean of `models` with `weights`, in f64.
    fn fedavg(models: &[&ParamTree], weights: &[f64]) -> Vec<f64> {
        let total: f64 = weights.iter().sum();
        let dim = values(models[0]).len();
        (0..dim)
            .map(|j| {
                models
                    .iter()
                    .zip(weights)
                    .map(|(m, w)| w * f64::from(values(m)[j]))
                    .sum::<f64>()
                    / total
            })
            .collect()
    }

    #[test]
    fn the_mean_is_fedavg_within_the_bound() {
        let params = Params::new(NumShares::Neighbours(3), 2);
        let global = tree(&[1.0, -2.0, 0.5]);
        let models: Vec<ParamTree> = (0..6)
            .map(|i| {
                let d = i as f32 * 0.1 - 0.25;
                tree(&[1.0 + d, -2.0 - 2.0 * d, 0.5 + d * d])
            })
            .collect();
        let weights = [10u64, 20, 30, 40, 50, 60];
        let updates: Vec<_> = models
            .iter()
            .enumerate()
            .map(|(i, m)| update(i as u32 + 1, weights[i], m))
            .collect();
        let selected: Vec<u32> = (1..=6).collect();
        let out = secure_mean(&params, &global, &selected, &updates, &[], 7).unwrap();
        assert_eq!(out.contributors, selected);
        assert!(out.dropped.is_empty(), "{:?}", out.dropped);
        let exact = fedavg(
            &models.iter().collect::<Vec<_>>(),
            &weights.map(|w| w as f64),
        );
        let bound = mean_error_bound(&params, 6, 210.0, 0.5).unwrap();
        let mean = values(out.mean.as_ref().unwrap());
        for (got, want) in mean.iter().zip(&exact) {
            // The f32 result adds its own rounding.
            let error = (f64::from(*got) - want).abs();
            assert!(error <= bound + 1e-6, "{got} vs {want}: {error} > {bound}");
        }
        // The bound is not vacuous: well below the updates' spread.
        assert!(bound < 1e-3, "{bound}");
        assert!(out.bytes.masked_input.up > 4 * 6 * 4);
    }

    #[test]
    fn clients_without_updates_drop_after_sharing_keys() {
        // The complete graph of 8 with threshold 5: three gone leave five.
        let params = Params::new(NumShares::All, 5);
        let global = tree(&[0.0; 4]);
        let models: Vec<ParamTree> = (0..7).map(|i| tree(&[i as f32 * 0.01; 4])).collect();
        // Clients 1..=8 were selected; 8 sent nothing, 3 is drawn to vanish
        // after its masked input (its input still counts).
        let updates: Vec<_> = models
            .iter()
            .enumerate()
            .map(|(i, m)| update(i as u32 + 1, 5, m))
            .collect();
        let selected: Vec<u32> = (1..=8).collect();
        let drops = [
            (3, DropPoint::AfterMaskedInput),
            (5, DropPoint::AfterAdvertising),
        ];
        let out = secure_mean(&params, &global, &selected, &updates, &drops, 1).unwrap();
        assert_eq!(out.contributors, [1, 2, 3, 4, 6, 7]);
        assert_eq!(out.dropped.len(), 1, "{:?}", out.dropped);
        assert_eq!(out.dropped[0].0, 5);
        let expected = (0.0 + 0.01 + 0.02 + 0.03 + 0.05 + 0.06) / 6.0;
        let mean = values(out.mean.as_ref().unwrap());
        // Weights of 5 against max_weight 1000 use little of the range.
        let bound = mean_error_bound(&params, 6, 30.0, 0.06).unwrap();
        for value in mean {
            assert!(
                (f64::from(value) - expected).abs() <= bound,
                "{value} vs {expected}"
            );
        }
    }

    #[test]
    fn too_few_survivors_abort_the_round() {
        let params = Params::new(NumShares::Neighbours(3), 2);
        let global = tree(&[0.0; 2]);
        let models: Vec<ParamTree> = (0..4).map(|_| tree(&[0.1, 0.2])).collect();
        let updates: Vec<_> = models
            .iter()
            .enumerate()
            .map(|(i, m)| update(i as u32 + 1, 5, m))
            .collect();
        let drops = [
            (1, DropPoint::AfterSharingKeys),
            (2, DropPoint::AfterSharingKeys),
            (3, DropPoint::AfterSharingKeys),
        ];
        let error = secure_mean(&params, &global, &[1, 2, 3, 4], &updates, &drops, 3).unwrap_err();
        assert!(matches!(error, SecureRoundError::Protocol(_)), "{error}");
    }

    #[test]
    fn an_update_that_does_not_fit_is_its_clients_drop() {
        let params = Params::new(NumShares::All, 2);
        let global = tree(&[0.0; 2]);
        let good = tree(&[0.1, 0.2]);
        let wrong = tree(&[0.1, 0.2, 0.3]);
        let updates = [
            update(1, 5, &good),
            update(2, 5, &good),
            update(3, 5, &wrong),
        ];
        let out = secure_mean(&params, &global, &[1, 2, 3], &updates, &[], 3).unwrap();
        assert_eq!(out.contributors, [1, 2]);
        assert_eq!(out.dropped[0].0, 3);
        assert!(
            out.dropped[0].1.contains("does not fit"),
            "{:?}",
            out.dropped
        );
    }

    fn ddg_params(z: f64, n: usize) -> DdgParams {
        DdgParams {
            clip_norm: 1.0,
            noise_multiplier: z,
            expected_clients: n,
            granularity: None,
            delta: 1e-5,
        }
    }

    const SEEDS: DdgSeeds = DdgSeeds {
        protocol: 3,
        rotation: 4,
        noise: 5,
    };

    #[test]
    fn without_noise_ddg_gives_the_unweighted_mean_of_the_clipped_changes() {
        let params = Params::new(NumShares::Neighbours(3), 2);
        let global = tree(&[1.0, -2.0, 0.5]);
        // Client 3's change has norm 5: clipped to 1.
        let models = [
            tree(&[1.1, -2.0, 0.5]),
            tree(&[1.0, -1.8, 0.4]),
            tree(&[4.0, 2.0, 0.5]),
            tree(&[0.9, -2.1, 0.6]),
        ];
        let updates: Vec<_> = models
            .iter()
            .enumerate()
            .map(|(i, m)| update(i as u32 + 1, 10 * (i as u64 + 1), m))
            .collect();
        let ddg = resolve_ddg(&ddg_params(0.0, 4), &params, &global).unwrap();
        let out =
            secure_ddg_mean(&params, &ddg, &global, &[1, 2, 3, 4], &updates, &[], SEEDS).unwrap();
        assert_eq!(out.contributors, [1, 2, 3, 4]);
        assert_eq!(out.total_weight, 4.0);
        let changes = [
            [0.1, 0.0, 0.0],
            [0.0, 0.2, -0.1],
            [0.6, 0.8, 0.0],
            [-0.1, -0.1, 0.1],
        ];
        let bound = ddg.noiseless_error_bound();
        // With the default granularity the rounding is ~1e-8: far below
        // the differences between the sample-weighted and plain means.
        assert!(bound < 1e-6, "{bound}");
        for (j, got) in values(out.mean.as_ref().unwrap()).iter().enumerate() {
            let want = values(&global)[j] as f64 + changes.iter().map(|c| c[j]).sum::<f64>() / 4.0;
            // f32 results add their own rounding.
            assert!(
                (f64::from(*got) - want).abs() <= bound + 1e-6,
                "{got} vs {want}"
            );
        }
    }

    #[test]
    fn ddg_noise_shrinks_with_dropped_clients_and_has_its_spread() {
        let params = Params::new(NumShares::All, 4);
        let dim = 4096;
        let global = tree(&vec![0.0; dim]);
        let model = tree(&vec![0.0; dim]);
        let updates: Vec<_> = (1..=6).map(|i| update(i, 5, &model)).collect();
        let ddg = resolve_ddg(&ddg_params(1.0, 6), &params, &global).unwrap();
        // Client 6 sent nothing; client 2 vanishes before its masked input.
        let drops = [(2, DropPoint::AfterSharingKeys)];
        let selected: Vec<u32> = (1..=7).collect();
        let out = secure_ddg_mean(
            &params,
            &ddg,
            &global,
            &selected,
            &updates[..5],
            &drops,
            SEEDS,
        )
        .unwrap();
        assert_eq!(out.contributors, [1, 3, 4, 5]);
        // Four shares of variance (z·c)²/6 each, over 4: std √(4/6)/4.
        let expected = ddg.mean_noise_std(4);
        assert!((expected - (4.0f64 / 6.0).sqrt() / 4.0).abs() < 1e-12);
        let mean = values(out.mean.as_ref().unwrap());
        let rms = (mean.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / dim as f64).sqrt();
        // 4096 values: within 5·expected/√(2·4096) ≈ 5.5% of the expected.
        assert!(
            (rms / expected - 1.0).abs() < 5.0 / (2.0 * dim as f64).sqrt(),
            "{rms}"
        );
        let again = secure_ddg_mean(
            &params,
            &ddg,
            &global,
            &selected,
            &updates[..5],
            &drops,
            SEEDS,
        )
        .unwrap();
        assert_eq!(again.mean, out.mean, "seeded: bit for bit");
    }

    #[test]
    fn dropouts_are_seeded_and_sized() {
        let ids: Vec<u32> = (1..=100).collect();
        let a = draw_dropouts(&ids, 0.3, 9);
        assert_eq!(a.len(), 30);
        assert_eq!(a, draw_dropouts(&ids, 0.3, 9));
        assert_ne!(a, draw_dropouts(&ids, 0.3, 10));
        assert!(draw_dropouts(&ids, 0.0, 9).is_empty());
    }
}
