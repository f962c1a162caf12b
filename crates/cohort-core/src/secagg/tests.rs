//! Whole rounds: results against plain FedAvg, dropouts, rogue clients and
//! a malicious server.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use super::client::ClientError;
use super::graph::Graph;
use super::quant::sum_error_bound;
use super::shamir::PRIME;
use super::sim::{Adversary, Stage};
use super::wire::{MaskedInput, SealedShares, UnmaskRequest, UnmaskResponse};
use super::*;

/// Updates in [-1, 1], weights in [1, 100].
fn make_inputs(n: usize, dim: usize, seed: u64) -> Vec<(ClientId, f64, Vec<f32>)> {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    (0..n as u64)
        .map(|i| {
            let values = (0..dim).map(|_| rng.random_range(-1.0f32..=1.0)).collect();
            (
                1000 + i * 17,
                f64::from(rng.random_range(1u32..=100)),
                values,
            )
        })
        .collect()
}

fn borrowed(inputs: &[(ClientId, f64, Vec<f32>)]) -> Vec<sim::Input<'_>> {
    inputs
        .iter()
        .map(|(id, w, x)| (*id, *w, x.as_slice()))
        .collect()
}

/// Plain FedAvg numerator and denominator over `contributors`.
fn fedavg(inputs: &[(ClientId, f64, Vec<f32>)], contributors: &[ClientId]) -> (Vec<f64>, f64) {
    let dim = inputs[0].2.len();
    let mut sum = vec![0.0; dim];
    let mut total = 0.0;
    for (_, w, x) in inputs.iter().filter(|(id, _, _)| contributors.contains(id)) {
        total += w;
        for (s, v) in sum.iter_mut().zip(x) {
            *s += w * f64::from(*v);
        }
    }
    (sum, total)
}

/// The round's result is FedAvg's over its contributors within the
/// quantisation bound of `quant::sum_error_bound` (values are at most 1).
fn assert_matches_fedavg(
    params: &Params,
    inputs: &[(ClientId, f64, Vec<f32>)],
    result: &Aggregate,
) {
    let (sum, total) = fedavg(inputs, &result.contributors);
    let (sum_bound, weight_bound) = sum_error_bound(params, result.contributors.len(), 1.0);
    assert!(
        (result.total_weight - total).abs() <= weight_bound,
        "total weight {} vs {total}, bound {weight_bound}",
        result.total_weight
    );
    for (got, want) in result.weighted_sum.iter().zip(&sum) {
        assert!(
            (got - want).abs() <= sum_bound,
            "{got} vs {want}, bound {sum_bound}"
        );
    }
    let mean = result.mean().unwrap();
    for (got, want) in mean.iter().zip(&sum) {
        let want = want / total;
        let bound = (sum_bound + weight_bound) / (total - weight_bound) * 2.0 + 1e-6;
        assert!(
            (f64::from(*got) - want).abs() <= bound,
            "mean {got} vs {want}"
        );
    }
}

fn plus() -> Params {
    Params::new(NumShares::Neighbours(5), 3)
}

fn ids(inputs: &[(ClientId, f64, Vec<f32>)]) -> Vec<ClientId> {
    inputs.iter().map(|(id, _, _)| *id).collect()
}

#[test]
fn eight_clients_equal_fedavg() {
    let inputs = make_inputs(8, 300, 1);
    for params in [plus(), Params::new(NumShares::All, 5)] {
        let result = simulate_round(&params, &borrowed(&inputs), &[], 7).unwrap();
        assert_eq!(result.contributors, ids(&inputs));
        assert!(result.refused.is_empty() && result.client_errors.is_empty());
        assert_matches_fedavg(&params, &inputs, &result);
    }
}

#[test]
fn a_small_modulus_still_cancels_exactly() {
    // 8 clients × 2^12 < 2^16: masks are drawn and cancelled mod 2^16.
    let params = Params {
        quantization_range: 1 << 12,
        modulus_range: 1 << 16,
        max_weight: 100.0,
        clipping_range: 1.0,
        ..plus()
    };
    let inputs = make_inputs(8, 64, 9);
    let dropouts = [(inputs[0].0, DropPoint::AfterSharingKeys)];
    let result = simulate_round(&params, &borrowed(&inputs), &dropouts, 9).unwrap();
    assert_eq!(result.contributors.len(), 7);
    assert_matches_fedavg(&params, &inputs, &result);
}

#[test]
fn rounds_are_seeded_and_bytes_are_the_encoded_sizes() {
    let inputs = make_inputs(8, 50, 2);
    let a = simulate_round(&plus(), &borrowed(&inputs), &[], 3).unwrap();
    let b = simulate_round(&plus(), &borrowed(&inputs), &[], 3).unwrap();
    assert_eq!((&a.weighted_sum, a.bytes), (&b.weighted_sum, b.bytes));
    let c = simulate_round(&plus(), &borrowed(&inputs), &[], 4).unwrap();
    assert_ne!(a.weighted_sum, c.weighted_sum, "rounding follows the seed");
    // Keys: tag + 2 keys. Masked input: tag, empty list, commitment, list of d + 1.
    assert_eq!(a.bytes.advertise_keys.up, 8 * 65);
    assert_eq!(a.bytes.masked_input.up, 8 * (1 + 4 + 32 + 4 + 4 * 51));
    // Each of the 8 clients seals one share for each of its 4 neighbours.
    let sealed = 8 + 4 + server::SEALED_LEN as u64;
    assert_eq!(a.bytes.share_keys.up, 8 * (1 + 4 + 4 * sealed));
    assert_eq!(a.bytes.masked_input.down, a.bytes.share_keys.up);
}

#[test]
fn dropouts_at_each_stage_leave_fedavg_of_the_survivors() {
    let inputs = make_inputs(8, 200, 3);
    let all = ids(&inputs);
    let dropouts = [
        (all[1], DropPoint::AfterSharingKeys),
        (all[4], DropPoint::AfterMaskedInput),
    ];
    for params in [plus(), Params::new(NumShares::All, 5)] {
        let result = simulate_round(&params, &borrowed(&inputs), &dropouts, 11).unwrap();
        // The one that sent its masked input is in the sum; its masks are
        // removed through its neighbours' shares of its seed.
        let expected: Vec<ClientId> = all.iter().copied().filter(|&id| id != all[1]).collect();
        assert_eq!(result.contributors, expected);
        assert_matches_fedavg(&params, &inputs, &result);
    }
    let early = [(all[6], DropPoint::AfterAdvertising)];
    let result = simulate_round(&plus(), &borrowed(&inputs), &early, 12).unwrap();
    assert!(!result.contributors.contains(&all[6]));
    assert_matches_fedavg(&plus(), &inputs, &result);
}

#[test]
fn too_many_dropouts_abort_with_a_clear_error() {
    let inputs = make_inputs(8, 20, 4);
    let all = ids(&inputs);
    let dropouts: Vec<_> = all[..4]
        .iter()
        .map(|&id| (id, DropPoint::AfterSharingKeys))
        .collect();
    let error = simulate_round(
        &Params::new(NumShares::All, 5),
        &borrowed(&inputs),
        &dropouts,
        5,
    )
    .unwrap_err();
    assert!(
        matches!(
            error,
            SecAggError::TooFewSurvivors {
                alive: 4,
                threshold: 5,
                ..
            }
        ),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("4 live neighbours") && message.contains("threshold 5"),
        "{message}"
    );
    // Unmask answers missing: the seeds of the survivors cannot be rebuilt.
    let silent: Vec<_> = all[..4]
        .iter()
        .map(|&id| (id, DropPoint::AfterMaskedInput))
        .collect();
    let error = simulate_round(
        &Params::new(NumShares::All, 5),
        &borrowed(&inputs),
        &silent,
        5,
    )
    .unwrap_err();
    assert!(
        matches!(
            error,
            SecAggError::NotEnoughShares {
                got: 4,
                need: 5,
                ..
            }
        ),
        "{error}"
    );
}

/// Misbehaviour of one client or of the server, for the tests below.
#[derive(Default)]
struct Rogue {
    client: ClientId,
    flip_share_byte: bool,
    truncate_vector: bool,
    share_to: Option<ClientId>,
    garble_upload: Option<Stage>,
    corrupt_answer: bool,
    corrupt_all_of: Option<ClientId>,
    /// A client whose first two routed shares get each other's sender ids.
    relabel_for: Option<ClientId>,
    /// (victim, peer to add to `dropped`, peer to add to `survivors`).
    server_asks: Option<(ClientId, Option<ClientId>, Option<ClientId>)>,
}

impl Adversary for Rogue {
    fn shares(&mut self, from: ClientId, shares: &mut SealedShares) {
        if from != self.client {
            return;
        }
        if self.flip_share_byte {
            shares.entries[0].1[5] ^= 0x40;
        }
        if let Some(to) = self.share_to {
            shares.entries[0].0 = to;
        }
    }
    fn masked_input(&mut self, from: ClientId, input: &mut MaskedInput) {
        if from == self.client && self.truncate_vector {
            input.values.pop();
        }
    }
    fn routed_shares(&mut self, to: ClientId, shares: &mut SealedShares) {
        if self.relabel_for == Some(to) {
            let (a, b) = (shares.entries[0].0, shares.entries[1].0);
            shares.entries[0].0 = b;
            shares.entries[1].0 = a;
        }
    }
    fn unmask_request(&mut self, to: ClientId, request: &mut UnmaskRequest) {
        if let Some((victim, both, stranger)) = self.server_asks
            && victim == to
        {
            let peer = request.survivors.iter().copied().find(|&p| p != to);
            request.dropped.extend(both.and(peer));
            // In place of a true survivor: a longer list than the
            // neighbourhood would already fail to decode.
            let slot = request.survivors.iter_mut().find(|p| **p != to);
            if let (Some(slot), Some(stranger)) = (slot, stranger) {
                *slot = stranger;
            }
        }
    }
    fn unmask_response(&mut self, from: ClientId, response: &mut UnmaskResponse) {
        let corrupt = |share: &mut (ClientId, super::shamir::Share)| {
            share.1.y[0] = (share.1.y[0] + 1) % PRIME
        };
        if from == self.client && self.corrupt_answer {
            response.seed_shares.iter_mut().for_each(corrupt);
        }
        if let Some(owner) = self.corrupt_all_of {
            response
                .seed_shares
                .iter_mut()
                .filter(|s| s.0 == owner)
                .for_each(corrupt);
        }
    }
    fn upload(&mut self, from: ClientId, stage: Stage, bytes: &mut Vec<u8>) {
        if from == self.client && self.garble_upload == Some(stage) {
            bytes.truncate(bytes.len() / 2);
        }
    }
}

fn run_rogue(rogue: &mut Rogue, seed: u64) -> (Vec<(ClientId, f64, Vec<f32>)>, Aggregate) {
    let inputs = make_inputs(8, 100, 5);
    rogue.client = inputs[2].0;
    let result = simulate_round_with(&plus(), &borrowed(&inputs), &[], seed, rogue).unwrap();
    (inputs, result)
}

#[test]
fn a_client_sending_a_corrupt_share_is_left_out() {
    let mut rogue = Rogue {
        flip_share_byte: true,
        ..Rogue::default()
    };
    let (inputs, result) = run_rogue(&mut rogue, 21);
    assert!(!result.contributors.contains(&rogue.client));
    assert_eq!(result.contributors.len(), 7);
    assert!(matches!(
        result.refused[..],
        [PeerError::ReportedByPeer { client, .. }] if client == rogue.client
    ));
    assert_matches_fedavg(&plus(), &inputs, &result);
}

#[test]
fn a_client_sending_a_short_vector_is_dropped() {
    let mut rogue = Rogue {
        truncate_vector: true,
        ..Rogue::default()
    };
    let (inputs, result) = run_rogue(&mut rogue, 22);
    assert_eq!(result.contributors.len(), 7);
    assert!(matches!(
        result.refused[..],
        [PeerError::VectorLength {
            len: 100,
            expected: 101,
            ..
        }]
    ));
    assert_matches_fedavg(&plus(), &inputs, &result);
}

#[test]
fn a_client_sharing_with_a_stranger_is_dropped() {
    let inputs = make_inputs(8, 100, 5);
    let graph = Graph::new(&ids(&inputs), 5, 23).unwrap();
    let rogue_id = inputs[2].0;
    let stranger = ids(&inputs)
        .into_iter()
        .find(|&id| !graph.linked(rogue_id, id))
        .unwrap();
    let mut rogue = Rogue {
        share_to: Some(stranger),
        ..Rogue::default()
    };
    let (inputs, result) = run_rogue(&mut rogue, 23);
    assert!(matches!(
        result.refused[..],
        [PeerError::NoEdge { client, recipient }] if client == rogue_id && recipient == stranger
    ));
    assert_eq!(result.contributors.len(), 7);
    assert_matches_fedavg(&plus(), &inputs, &result);
}

#[test]
fn garbled_bytes_drop_the_sender_at_any_stage() {
    for stage in [Stage::ShareKeys, Stage::MaskedInput, Stage::Unmask] {
        let mut rogue = Rogue {
            garble_upload: Some(stage),
            ..Rogue::default()
        };
        let (inputs, result) = run_rogue(&mut rogue, 24);
        assert!(
            matches!(result.refused[..], [PeerError::Malformed { client, .. }] if client == rogue.client),
            "{stage:?}: {:?}",
            result.refused
        );
        // A garbled unmask answer still leaves its masked input in the sum.
        let expected = if stage == Stage::Unmask { 8 } else { 7 };
        assert_eq!(result.contributors.len(), expected, "{stage:?}");
        assert_matches_fedavg(&plus(), &inputs, &result);
    }
}

#[test]
fn shares_relabelled_by_the_server_do_not_open() {
    let inputs = make_inputs(8, 100, 5);
    let victim = inputs[4].0;
    let mut rogue = Rogue {
        relabel_for: Some(victim),
        ..Rogue::default()
    };
    let (inputs, result) = run_rogue(&mut rogue, 29);
    // Sealed for (sender, victim), each fails to open under the other sender's
    // key: the victim refuses both, and both senders leave the sum.
    let reported: Vec<(ClientId, ClientId)> = result
        .refused
        .iter()
        .map(|r| match r {
            PeerError::ReportedByPeer { client, by } => (*client, *by),
            other => panic!("{other}"),
        })
        .collect();
    assert_eq!(reported.len(), 2);
    assert!(
        reported
            .iter()
            .all(|&(client, by)| by == victim && client != victim)
    );
    assert_eq!(result.contributors.len(), 6);
    assert_matches_fedavg(&plus(), &inputs, &result);
}

#[test]
fn a_corrupt_unmask_share_is_outvoted_by_spare_ones() {
    let mut rogue = Rogue {
        corrupt_answer: true,
        ..Rogue::default()
    };
    let (inputs, result) = run_rogue(&mut rogue, 27);
    assert_eq!(result.contributors.len(), 8);
    assert_matches_fedavg(&plus(), &inputs, &result);
}

#[test]
fn corrupt_shares_everywhere_abort_with_a_clear_error() {
    let inputs = make_inputs(8, 100, 5);
    let owner = inputs[5].0;
    let mut rogue = Rogue {
        corrupt_all_of: Some(owner),
        ..Rogue::default()
    };
    let error = simulate_round_with(&plus(), &borrowed(&inputs), &[], 28, &mut rogue).unwrap_err();
    assert!(
        matches!(error, SecAggError::Mismatch { owner: o, need: 3, .. } if o == owner),
        "{error}"
    );
}

#[test]
fn an_honest_client_refuses_to_reveal_both_shares() {
    let mut rogue = Rogue::default();
    let inputs = make_inputs(8, 100, 5);
    let victim = inputs[3].0;
    rogue.server_asks = Some((victim, Some(0), None));
    let (_, result) = run_rogue(&mut rogue, 25);
    let [(client, ClientError::BothShares(peer))] = result.client_errors[..] else {
        panic!("{:?}", result.client_errors);
    };
    assert_eq!(client, victim);
    assert_ne!(peer, victim);
    // Without the victim's shares the others still finish the round.
    assert_eq!(result.contributors.len(), 8);
}

#[test]
fn an_honest_client_refuses_to_answer_for_a_stranger() {
    let inputs = make_inputs(8, 100, 5);
    let graph = Graph::new(&ids(&inputs), 5, 26).unwrap();
    let victim = inputs[3].0;
    let stranger = ids(&inputs)
        .into_iter()
        .find(|&id| !graph.linked(victim, id))
        .unwrap();
    let mut rogue = Rogue {
        server_asks: Some((victim, None, Some(stranger))),
        ..Rogue::default()
    };
    let (_, result) = run_rogue(&mut rogue, 26);
    assert_eq!(
        result.client_errors,
        vec![(victim, ClientError::NoEdge(stranger))]
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Any seed, any two dropouts at any stage: FedAvg of the contributors.
    #[test]
    fn random_rounds_equal_fedavg(
        seed in any::<u64>(),
        drop_a in 0usize..9,
        drop_b in 0usize..9,
        stage_a in 0usize..3,
        stage_b in 0usize..3,
    ) {
        let inputs = make_inputs(9, 40, seed);
        let stages = [DropPoint::AfterAdvertising, DropPoint::AfterSharingKeys, DropPoint::AfterMaskedInput];
        let dropouts = [(inputs[drop_a].0, stages[stage_a]), (inputs[drop_b].0, stages[stage_b])];
        let params = Params::new(NumShares::Neighbours(7), 4);
        let result = simulate_round(&params, &borrowed(&inputs), &dropouts, seed).unwrap();
        // A client named twice drops at the later-listed point.
        let effective: std::collections::BTreeMap<_, _> = dropouts.into_iter().collect();
        for (id, point) in effective {
            prop_assert_eq!(result.contributors.contains(&id), point == DropPoint::AfterMaskedInput);
        }
        assert_matches_fedavg(&params, &inputs, &result);
    }
}
