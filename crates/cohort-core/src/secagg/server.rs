//! The server's side of a round, as a chain of states like the client's.
//!
//! In each stage the server `receive`s one message per client and then
//! `finish`es the stage, which yields the next state and the messages for
//! the clients still in the round. A message that breaks the protocol is
//! refused with a [`PeerError`]: its sender is treated as dropped at that
//! stage and the round goes on. A round ends in a [`SecAggError`] only when
//! it cannot finish correctly: too few clients left to reconstruct a secret,
//! or a reconstructed secret that fails its check.
//!
//! Client sets follow Bonawitz et al.: U1 advertised keys, U2 sent shares,
//! U3 sent masked inputs. A client in U3 whose shares some neighbour
//! refused is excluded from the sum (its input is discarded and it is
//! handled as if it had dropped after sending shares): keeping it would
//! mean reconstructing its mask key while its self mask is also revealed,
//! which would expose its input.

use std::collections::{BTreeMap, BTreeSet};

use rand::seq::SliceRandom;
use rand::{CryptoRng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use x25519_dalek::StaticSecret;

use super::crypto::{self, KeyPair, Sign};
use super::graph::{Graph, GraphError};
use super::quant;
use super::shamir::{self, SHARE_LEN, Share};
use super::wire::{
    KeyAdvertisement, MaskedInput, NeighbourKeys, PeerKeys, SealedShares, UnmaskRequest,
    UnmaskResponse, WireError,
};
use super::{ClientId, Params, ParamsError};

/// The length of an honest sealed share: two shares and a tag byte, plus
/// the 16-byte AES-GCM tag.
pub const SEALED_LEN: usize = 1 + 2 * SHARE_LEN + 16;

/// A client's message refused by the server; the client is dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    #[error(
        "client {client} is not expected at this stage (unknown, dropped earlier, or already answered)"
    )]
    Unexpected { client: ClientId },
    #[error("client {client}'s public key repeats another client's key or is a low-order point")]
    WeakKey { client: ClientId },
    #[error(
        "client {client} sends a share to {recipient}, which is not a neighbour it was given (or twice)"
    )]
    NoEdge {
        client: ClientId,
        recipient: ClientId,
    },
    #[error(
        "client {client} sends {got} sealed shares; expected one for each of its {expected} neighbours"
    )]
    MissingShares {
        client: ClientId,
        got: usize,
        expected: usize,
    },
    #[error(
        "client {client}'s sealed share for {recipient} has {len} bytes; expected {SEALED_LEN}"
    )]
    SealedLength {
        client: ClientId,
        recipient: ClientId,
        len: usize,
    },
    #[error("client {client}'s masked vector has {len} entries; expected {expected}")]
    VectorLength {
        client: ClientId,
        len: usize,
        expected: usize,
    },
    #[error(
        "client {client}'s masked value {value} at index {index} is not below the modulus {modulus}"
    )]
    ValueRange {
        client: ClientId,
        index: usize,
        value: u32,
        modulus: u64,
    },
    #[error(
        "client {client} reports refusing shares from {peer}, which it was not sent (or twice)"
    )]
    BadRejection { client: ClientId, peer: ClientId },
    #[error(
        "client {client}'s shares were refused by its neighbour {by}; it is left out of the sum"
    )]
    ReportedByPeer { client: ClientId, by: ClientId },
    #[error("client {client}'s message is malformed: {error}")]
    Malformed { client: ClientId, error: WireError },
    #[error("client {client}'s unmask response does not answer the request: {what}")]
    BadResponse {
        client: ClientId,
        what: &'static str,
    },
}

impl PeerError {
    /// The client whose message was refused (and who is dropped for it).
    pub fn client(&self) -> ClientId {
        match self {
            PeerError::Unexpected { client }
            | PeerError::WeakKey { client }
            | PeerError::NoEdge { client, .. }
            | PeerError::MissingShares { client, .. }
            | PeerError::SealedLength { client, .. }
            | PeerError::VectorLength { client, .. }
            | PeerError::ValueRange { client, .. }
            | PeerError::BadRejection { client, .. }
            | PeerError::ReportedByPeer { client, .. }
            | PeerError::Malformed { client, .. }
            | PeerError::BadResponse { client, .. } => *client,
        }
    }
}

/// Why a round could not be completed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SecAggError {
    #[error(transparent)]
    Params(#[from] ParamsError),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error("the model has {0} values; expected 1 to {max}", max = MAX_VALUES)]
    Dimension(usize),
    #[error(
        "after {stage}, client {client} has {alive} live neighbours (self included); expected at least the threshold {threshold}"
    )]
    TooFewSurvivors {
        stage: &'static str,
        client: ClientId,
        alive: usize,
        threshold: usize,
    },
    #[error(
        "{got} shares of client {owner}'s {secret} came back; expected at least the threshold {need}"
    )]
    NotEnoughShares {
        owner: ClientId,
        secret: &'static str,
        got: usize,
        need: usize,
    },
    #[error("{got} masked inputs are usable; expected at least the threshold {need}")]
    TooFewContributors { got: usize, need: usize },
    #[error(
        "client {client}'s mask key gives no contributory agreement; expected it refused on receipt"
    )]
    NotContributory { client: ClientId },
    #[error(
        "no {need} of the {got} shares of client {owner}'s {secret} rebuild what it committed to (tried {attempts} subsets); some shares are corrupt"
    )]
    Mismatch {
        owner: ClientId,
        secret: &'static str,
        got: usize,
        need: usize,
        attempts: usize,
    },
}

/// The longest model a round accepts (2^28 values, 1 GiB of `u32`).
pub const MAX_VALUES: usize = 1 << 28;

/// How many subsets of `t` shares are tried before a secret is given up.
const RECONSTRUCTION_ATTEMPTS: usize = 32;

const SEED: &str = "self-mask seed";
const KEY: &str = "mask key";

/// What the server learns: the weighted sum and total weight over the
/// clients whose inputs are in it, and who was refused along the way.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerOutput {
    /// The unmasked sum of the contributors' vectors mod the modulus, as
    /// it was before dequantising: what an encoded round
    /// ([`super::ddg`]) decodes.
    pub sum: Vec<u32>,
    pub weighted_sum: Vec<f64>,
    pub total_weight: f64,
    pub contributors: Vec<ClientId>,
    pub refused: Vec<PeerError>,
}

/// What every stage shares.
struct Core {
    params: Params,
    threshold: usize,
    graph: Graph,
    /// The vector length: the model plus the weight entry.
    len: usize,
    keys: BTreeMap<ClientId, KeyAdvertisement>,
    /// The ids in the key list each client was sent, sorted; a holder's share
    /// of its secrets is at point (position in this list) + 1.
    key_lists: BTreeMap<ClientId, Vec<ClientId>>,
    sealed: BTreeMap<ClientId, Vec<(ClientId, Vec<u8>)>>,
    routed: BTreeMap<ClientId, BTreeSet<ClientId>>,
    inputs: BTreeMap<ClientId, MaskedInput>,
    refused: Vec<PeerError>,
}

impl Core {
    fn refuse(&mut self, error: PeerError) -> Result<(), PeerError> {
        self.refused.push(error.clone());
        Err(error)
    }

    /// Aborts unless each client in `alive` has `t` neighbours in `alive`.
    fn check_alive(
        &self,
        stage: &'static str,
        alive: &BTreeSet<ClientId>,
    ) -> Result<(), SecAggError> {
        for &client in alive {
            let around = self.graph.neighbours(client).unwrap_or(&[]);
            let live = around.iter().filter(|id| alive.contains(id)).count();
            if live < self.threshold {
                return Err(SecAggError::TooFewSurvivors {
                    stage,
                    client,
                    alive: live,
                    threshold: self.threshold,
                });
            }
        }
        Ok(())
    }

    /// The point of `holder`'s share of `owner`'s secrets.
    fn share_point(&self, owner: ClientId, holder: ClientId) -> Option<u32> {
        let list = self.key_lists.get(&owner)?;
        let at = list.binary_search(&holder).ok()?;
        u32::try_from(at + 1).ok()
    }

    /// The peers whose pairwise masks `client`'s input carries.
    fn mask_peers(&self, client: ClientId) -> BTreeSet<ClientId> {
        let rejected: BTreeSet<ClientId> = self.inputs[&client].rejected.iter().copied().collect();
        self.routed[&client]
            .difference(&rejected)
            .copied()
            .collect()
    }
}

/// Stage 1: collecting public keys.
pub struct CollectingKeys {
    core: Core,
    /// A throwaway secret for checking that advertised keys are contributory.
    probe: StaticSecret,
}

/// Stage 2: collecting sealed shares.
pub struct CollectingShares(Core);

/// Stage 3: collecting masked inputs.
pub struct CollectingInputs(Core);

/// Stage 4: collecting the shares that remove the masks.
pub struct Unmasking {
    core: Core,
    contributors: BTreeSet<ClientId>,
    /// The peers whose pairwise masks each contributor's input carries.
    mask_peers: BTreeMap<ClientId, BTreeSet<ClientId>>,
    dropped: BTreeSet<ClientId>,
    requests: BTreeMap<ClientId, UnmaskRequest>,
    responses: BTreeMap<ClientId, UnmaskResponse>,
}

impl CollectingKeys {
    /// A round over `clients` for models of `dim` values; `graph_seed`
    /// shuffles the SecAgg+ graph.
    pub fn new(
        params: &Params,
        clients: &[ClientId],
        dim: usize,
        graph_seed: u64,
        rng: &mut impl CryptoRng,
    ) -> Result<CollectingKeys, SecAggError> {
        let shares = params.check_for(clients.len())?;
        if dim == 0 || dim > MAX_VALUES {
            return Err(SecAggError::Dimension(dim));
        }
        let core = Core {
            params: params.clone(),
            threshold: params.reconstruction_threshold,
            graph: Graph::new(clients, shares, graph_seed)?,
            len: dim + 1,
            keys: BTreeMap::new(),
            key_lists: BTreeMap::new(),
            sealed: BTreeMap::new(),
            routed: BTreeMap::new(),
            inputs: BTreeMap::new(),
            refused: Vec::new(),
        };
        let probe = KeyPair::generate(rng).secret;
        Ok(CollectingKeys { core, probe })
    }

    /// The round's graph.
    pub fn graph(&self) -> &Graph {
        &self.core.graph
    }

    /// Records a client's keys; a repeated or low-order key is refused.
    pub fn receive(&mut self, from: ClientId, keys: KeyAdvertisement) -> Result<(), PeerError> {
        let core = &mut self.core;
        if core.graph.neighbours(from).is_none() || core.keys.contains_key(&from) {
            return core.refuse(PeerError::Unexpected { client: from });
        }
        let repeated = keys.mask_key == keys.encryption_key
            || core.keys.values().any(|k| {
                [k.mask_key, k.encryption_key]
                    .iter()
                    .any(|seen| *seen == keys.mask_key || *seen == keys.encryption_key)
            });
        let weak = [keys.mask_key, keys.encryption_key]
            .iter()
            .any(|key| crypto::agree(&self.probe, key).is_none());
        if repeated || weak {
            return core.refuse(PeerError::WeakKey { client: from });
        }
        core.keys.insert(from, keys);
        Ok(())
    }

    /// Sends each client the keys of its neighbours that advertised.
    pub fn finish(
        mut self,
    ) -> Result<(CollectingShares, Vec<(ClientId, NeighbourKeys)>), SecAggError> {
        let alive: BTreeSet<ClientId> = self.core.keys.keys().copied().collect();
        self.core.check_alive("advertising keys", &alive)?;
        let mut out = Vec::with_capacity(alive.len());
        for &client in &alive {
            let list: Vec<ClientId> = self
                .core
                .graph
                .neighbours(client)
                .unwrap_or(&[])
                .iter()
                .copied()
                .filter(|id| alive.contains(id))
                .collect();
            let peers = list
                .iter()
                .map(|&id| PeerKeys {
                    id,
                    keys: self.core.keys[&id].clone(),
                })
                .collect();
            self.core.key_lists.insert(client, list);
            out.push((client, NeighbourKeys { peers }));
        }
        Ok((CollectingShares(self.core), out))
    }
}

impl CollectingShares {
    /// Records a client's sealed shares: exactly one for each neighbour in
    /// its key list, of the honest length.
    pub fn receive(&mut self, from: ClientId, shares: SealedShares) -> Result<(), PeerError> {
        let core = &mut self.0;
        let Some(list) = core.key_lists.get(&from) else {
            return core.refuse(PeerError::Unexpected { client: from });
        };
        if core.sealed.contains_key(&from) {
            return core.refuse(PeerError::Unexpected { client: from });
        }
        let expected = list.len() - 1;
        let mut seen = BTreeSet::new();
        for (recipient, sealed) in &shares.entries {
            if *recipient == from
                || list.binary_search(recipient).is_err()
                || !seen.insert(*recipient)
            {
                let error = PeerError::NoEdge {
                    client: from,
                    recipient: *recipient,
                };
                return core.refuse(error);
            }
            if sealed.len() != SEALED_LEN {
                let error = PeerError::SealedLength {
                    client: from,
                    recipient: *recipient,
                    len: sealed.len(),
                };
                return core.refuse(error);
            }
        }
        if seen.len() != expected {
            return core.refuse(PeerError::MissingShares {
                client: from,
                got: seen.len(),
                expected,
            });
        }
        core.sealed.insert(from, shares.entries);
        Ok(())
    }

    /// Routes each sealed share to its recipient, if both are still here.
    pub fn finish(
        mut self,
    ) -> Result<(CollectingInputs, Vec<(ClientId, SealedShares)>), SecAggError> {
        let core = &mut self.0;
        let alive: BTreeSet<ClientId> = core.sealed.keys().copied().collect();
        core.check_alive("sharing keys", &alive)?;
        let mut inbox: BTreeMap<ClientId, Vec<(ClientId, Vec<u8>)>> =
            alive.iter().map(|&id| (id, Vec::new())).collect();
        for (&sender, entries) in &core.sealed {
            for (recipient, sealed) in entries {
                if let Some(box_) = inbox.get_mut(recipient) {
                    box_.push((sender, sealed.clone()));
                }
            }
        }
        core.sealed.clear();
        let mut out = Vec::with_capacity(inbox.len());
        for (recipient, entries) in inbox {
            core.routed
                .insert(recipient, entries.iter().map(|(s, _)| *s).collect());
            out.push((recipient, SealedShares { entries }));
        }
        Ok((CollectingInputs(self.0), out))
    }
}

impl CollectingInputs {
    /// Records a client's masked input: the right length, every entry below
    /// the modulus, and refusals only of senders it was actually sent.
    pub fn receive(&mut self, from: ClientId, input: MaskedInput) -> Result<(), PeerError> {
        let core = &mut self.0;
        let Some(routed) = core.routed.get(&from) else {
            return core.refuse(PeerError::Unexpected { client: from });
        };
        if core.inputs.contains_key(&from) {
            return core.refuse(PeerError::Unexpected { client: from });
        }
        if input.values.len() != core.len {
            let error = PeerError::VectorLength {
                client: from,
                len: input.values.len(),
                expected: core.len,
            };
            return core.refuse(error);
        }
        let modulus = core.params.modulus_range;
        if let Some((index, &value)) = input
            .values
            .iter()
            .enumerate()
            .find(|(_, v)| u64::from(**v) >= modulus)
        {
            return core.refuse(PeerError::ValueRange {
                client: from,
                index,
                value,
                modulus,
            });
        }
        let mut seen = BTreeSet::new();
        if let Some(&peer) = input
            .rejected
            .iter()
            .find(|p| !routed.contains(p) || !seen.insert(**p))
        {
            return core.refuse(PeerError::BadRejection { client: from, peer });
        }
        core.inputs.insert(from, input);
        Ok(())
    }

    /// Settles who is in the sum and asks every contributor for the shares
    /// that remove the masks: self-mask seeds of its neighbours in the sum,
    /// mask keys of its neighbours out of it whose pairwise masks some
    /// contributor's input carries (and whose share it holds).
    pub fn finish(self) -> Result<(Unmasking, Vec<(ClientId, UnmaskRequest)>), SecAggError> {
        let mut core = self.0;
        let contributors = core.settle_contributors()?;
        let mask_peers: BTreeMap<ClientId, BTreeSet<ClientId>> = contributors
            .iter()
            .map(|&id| (id, core.mask_peers(id)))
            .collect();
        let dropped = core.dropped_keys_needed(&contributors, &mask_peers)?;
        let mut requests = BTreeMap::new();
        for (&holder, peers) in &mask_peers {
            let around = core.graph.neighbours(holder).unwrap_or(&[]);
            let request = UnmaskRequest {
                survivors: around
                    .iter()
                    .copied()
                    .filter(|id| contributors.contains(id))
                    .collect(),
                dropped: peers
                    .iter()
                    .copied()
                    .filter(|id| dropped.contains(id))
                    .collect(),
            };
            requests.insert(holder, request);
        }
        let out = requests.iter().map(|(&id, r)| (id, r.clone())).collect();
        let responses = BTreeMap::new();
        let state = Unmasking {
            core,
            contributors,
            mask_peers,
            dropped,
            requests,
            responses,
        };
        Ok((state, out))
    }
}

impl Core {
    /// The clients whose inputs go in the sum: those that sent one, less
    /// those a neighbour reported (each report is recorded as a refusal).
    fn settle_contributors(&mut self) -> Result<BTreeSet<ClientId>, SecAggError> {
        let mut excluded = BTreeSet::new();
        for (&by, input) in &self.inputs {
            for &client in &input.rejected {
                excluded.insert(client);
                self.refused.push(PeerError::ReportedByPeer { client, by });
            }
        }
        let contributors: BTreeSet<ClientId> = self
            .inputs
            .keys()
            .copied()
            .filter(|id| !excluded.contains(id))
            .collect();
        self.check_alive("sending masked inputs", &contributors)?;
        // Fewer than t inputs in the sum would say too much about each; an
        // empty set passes the neighbourhood check, so it is checked here.
        if contributors.len() < self.threshold {
            let (got, need) = (contributors.len(), self.threshold);
            return Err(SecAggError::TooFewContributors { got, need });
        }
        Ok(contributors)
    }

    /// The clients out of the sum whose pairwise masks some contributor's
    /// input carries, so whose mask keys must be rebuilt; aborts if fewer
    /// than `t` contributors hold shares of one of them.
    fn dropped_keys_needed(
        &self,
        contributors: &BTreeSet<ClientId>,
        mask_peers: &BTreeMap<ClientId, BTreeSet<ClientId>>,
    ) -> Result<BTreeSet<ClientId>, SecAggError> {
        let dropped: BTreeSet<ClientId> = mask_peers
            .values()
            .flatten()
            .copied()
            .filter(|id| !contributors.contains(id))
            .collect();
        for &owner in &dropped {
            let got = mask_peers.values().filter(|p| p.contains(&owner)).count();
            if got < self.threshold {
                let (secret, need) = (KEY, self.threshold);
                return Err(SecAggError::NotEnoughShares {
                    owner,
                    secret,
                    got,
                    need,
                });
            }
        }
        Ok(dropped)
    }
}

impl Unmasking {
    /// Records a contributor's shares: exactly the ones asked for, in the
    /// order asked, each at the point the holder was given.
    pub fn receive(&mut self, from: ClientId, response: UnmaskResponse) -> Result<(), PeerError> {
        let Some(request) = self.requests.get(&from) else {
            return self.core.refuse(PeerError::Unexpected { client: from });
        };
        if self.responses.contains_key(&from) {
            return self.core.refuse(PeerError::Unexpected { client: from });
        }
        let answers = |asked: &[ClientId], given: &[(ClientId, Share)]| {
            asked.len() == given.len()
                && asked.iter().zip(given).all(|(&owner, (id, share))| {
                    owner == *id && self.core.share_point(owner, from) == Some(share.x)
                })
        };
        if !answers(&request.survivors, &response.seed_shares) {
            let what = "self-mask-seed shares differ from those asked for";
            return self
                .core
                .refuse(PeerError::BadResponse { client: from, what });
        }
        if !answers(&request.dropped, &response.key_shares) {
            let what = "mask-key shares differ from those asked for";
            return self
                .core
                .refuse(PeerError::BadResponse { client: from, what });
        }
        self.responses.insert(from, response);
        Ok(())
    }

    /// Reconstructs the secrets, removes the masks and dequantises.
    pub fn finish(self) -> Result<ServerOutput, SecAggError> {
        let core = &self.core;
        let modulus_mask = core.params.modulus_mask();
        let mut sum = vec![0u32; core.len];
        for &id in &self.contributors {
            for (acc, v) in sum.iter_mut().zip(&core.inputs[&id].values) {
                *acc = acc.wrapping_add(*v);
            }
        }
        let mut masks = Vec::new();
        for &owner in &self.contributors {
            let commitment = core.inputs[&owner].seed_commitment;
            let check = |seed: &[u8; 32]| crypto::seed_commitment(seed) == commitment;
            let seed = self.reconstruct(owner, SEED, |r| &r.seed_shares, check)?;
            masks.push((seed, Sign::Subtract));
        }
        for &owner in &self.dropped {
            let advertised = core.keys[&owner].mask_key;
            let check = |key: &[u8; 32]| KeyPair::from_secret(*key).public == advertised;
            let key = self.reconstruct(owner, KEY, |r| &r.key_shares, check)?;
            self.pairwise_masks(&mut masks, owner, &KeyPair::from_secret(key))?;
        }
        crypto::apply_masks(&mut sum, &masks, modulus_mask);
        sum.iter_mut().for_each(|v| *v &= modulus_mask);
        let (total_weight, weighted_sum) =
            quant::dequantize(&sum, self.contributors.len(), &core.params);
        Ok(ServerOutput {
            sum,
            weighted_sum,
            total_weight,
            contributors: self.contributors.into_iter().collect(),
            refused: self.core.refused,
        })
    }

    /// The pairwise masks between the dropped `owner` and every contributor
    /// whose input carries one, with the sign that removes them: the
    /// contributor added it when its id is the larger, so it is subtracted
    /// then, and added otherwise.
    fn pairwise_masks(
        &self,
        masks: &mut Vec<([u8; 32], Sign)>,
        owner: ClientId,
        key: &KeyPair,
    ) -> Result<(), SecAggError> {
        for (&client, peers) in &self.mask_peers {
            if !peers.contains(&owner) {
                continue;
            }
            // Keys were checked contributory on receipt, so this holds.
            let shared = crypto::agree(&key.secret, &self.core.keys[&client].mask_key)
                .ok_or(SecAggError::NotContributory { client })?;
            let sign = if client > owner {
                Sign::Subtract
            } else {
                Sign::Add
            };
            masks.push((crypto::pairwise_seed(&shared, client, owner), sign));
        }
        Ok(())
    }

    /// One secret of `owner` from the shares the responders returned: the
    /// first `t` if they pass `check`, else other subsets of `t`, drawn at
    /// random, so one corrupt share among spare ones does not sink the round.
    fn reconstruct(
        &self,
        owner: ClientId,
        secret: &'static str,
        list: impl Fn(&UnmaskResponse) -> &Vec<(ClientId, Share)>,
        check: impl Fn(&[u8; 32]) -> bool,
    ) -> Result<[u8; 32], SecAggError> {
        let mut shares: Vec<Share> = self
            .responses
            .values()
            .filter_map(|r| list(r).iter().find(|(id, _)| *id == owner).map(|(_, s)| *s))
            .collect();
        let (got, need) = (shares.len(), self.core.threshold);
        if got < need {
            return Err(SecAggError::NotEnoughShares {
                owner,
                secret,
                got,
                need,
            });
        }
        let attempts = if got == need {
            1
        } else {
            RECONSTRUCTION_ATTEMPTS
        };
        let mut rng = ChaCha20Rng::seed_from_u64(owner);
        for attempt in 0..attempts {
            if attempt > 0 {
                shares.shuffle(&mut rng);
            }
            if let Ok(value) = shamir::reconstruct(&shares, need)
                && check(&value)
            {
                return Ok(value);
            }
        }
        Err(SecAggError::Mismatch {
            owner,
            secret,
            got,
            need,
            attempts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secagg::NumShares;
    use crate::secagg::graph::GraphError;

    fn keys(rng: &mut ChaCha20Rng) -> KeyAdvertisement {
        KeyAdvertisement {
            mask_key: KeyPair::generate(rng).public,
            encryption_key: KeyPair::generate(rng).public,
        }
    }

    #[test]
    fn key_collection_refuses_strangers_repeats_and_weak_keys() {
        let mut rng = ChaCha20Rng::seed_from_u64(1);
        let params = Params::new(NumShares::Neighbours(3), 2);
        let mut server = CollectingKeys::new(&params, &[1, 2, 3, 4], 10, 0, &mut rng).unwrap();
        let first = keys(&mut rng);
        server.receive(1, first.clone()).unwrap();
        assert_eq!(
            server.receive(1, keys(&mut rng)),
            Err(PeerError::Unexpected { client: 1 })
        );
        assert_eq!(
            server.receive(9, keys(&mut rng)),
            Err(PeerError::Unexpected { client: 9 })
        );
        assert_eq!(
            server.receive(2, first.clone()),
            Err(PeerError::WeakKey { client: 2 })
        );
        let low_order = KeyAdvertisement {
            mask_key: [0; 32],
            ..keys(&mut rng)
        };
        assert_eq!(
            server.receive(3, low_order),
            Err(PeerError::WeakKey { client: 3 })
        );
        // Only client 1 is left: its neighbourhood is below the threshold.
        assert!(matches!(
            server.finish(),
            Err(SecAggError::TooFewSurvivors {
                client: 1,
                alive: 1,
                threshold: 2,
                ..
            })
        ));
    }

    #[test]
    fn bad_dimensions_and_params_are_refused() {
        let mut rng = ChaCha20Rng::seed_from_u64(2);
        let params = Params::new(NumShares::All, 2);
        assert!(matches!(
            CollectingKeys::new(&params, &[1, 2, 3], 0, 0, &mut rng),
            Err(SecAggError::Dimension(0))
        ));
        assert!(matches!(
            CollectingKeys::new(&params, &[1, 2, 3, 4], 5, 0, &mut rng),
            Err(SecAggError::Params(ParamsError::ThresholdMajority { .. }))
        ));
        assert!(matches!(
            CollectingKeys::new(&params, &[1, 1, 2], 5, 0, &mut rng),
            Err(SecAggError::Graph(GraphError::DuplicateClient(1)))
        ));
    }
}
