//! A whole round in one process: every message is encoded, counted and
//! decoded on the other side, as it would be on a network, so the byte
//! counts are the real ones and decoding sees whatever a party sent.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

use super::client::{ClientError, InputSent, KeysAdvertised, SharesSent};
use super::server::{
    CollectingInputs, CollectingKeys, CollectingShares, PeerError, SecAggError, ServerOutput,
    Unmasking,
};
use super::shamir::MAX_SHARES;
use super::wire::{
    KeyAdvertisement, Limits, MaskedInput, Message, NeighbourKeys, SealedShares, UnmaskRequest,
    UnmaskResponse,
};
use super::{ClientId, Params};

/// When a client stops answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum DropPoint {
    /// It sent its public keys, then nothing.
    AfterAdvertising,
    /// It sent its sealed shares, then nothing.
    AfterSharingKeys,
    /// It sent its masked input but no unmask answer.
    AfterMaskedInput,
}

/// The stages, for naming messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    AdvertiseKeys,
    ShareKeys,
    MaskedInput,
    Unmask,
}

/// Bytes on the wire in one stage, summed over clients.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageBytes {
    /// Client → server.
    pub up: u64,
    /// Server → client.
    pub down: u64,
}

/// Bytes on the wire per stage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireBytes {
    pub advertise_keys: StageBytes,
    pub share_keys: StageBytes,
    pub masked_input: StageBytes,
    pub unmask: StageBytes,
}

impl WireBytes {
    fn stage(&mut self, stage: Stage) -> &mut StageBytes {
        match stage {
            Stage::AdvertiseKeys => &mut self.advertise_keys,
            Stage::ShareKeys => &mut self.share_keys,
            Stage::MaskedInput => &mut self.masked_input,
            Stage::Unmask => &mut self.unmask,
        }
    }
}

/// Compute time of the parties, encoding and decoding excluded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timings {
    /// Summed over all clients.
    pub clients: Duration,
    pub server: Duration,
}

/// The outcome of a simulated round.
#[derive(Debug, Clone, PartialEq)]
pub struct Aggregate {
    /// The unmasked sum mod the modulus, before dequantising (what an
    /// encoded round decodes, [`simulate_encoded_round`]).
    pub sum: Vec<u32>,
    /// `Σ w_i · x_i` over the contributors, dequantised.
    pub weighted_sum: Vec<f64>,
    /// `Σ w_i` over the contributors, dequantised.
    pub total_weight: f64,
    /// The clients whose inputs are in the sum, sorted.
    pub contributors: Vec<ClientId>,
    /// Client messages the server refused (their senders were dropped).
    pub refused: Vec<PeerError>,
    /// Clients that stopped because of a server message, and why.
    pub client_errors: Vec<(ClientId, ClientError)>,
    pub bytes: WireBytes,
    pub timings: Timings,
}

impl Aggregate {
    /// The weighted mean, FedAvg's result; `None` when the total weight is 0.
    pub fn mean(&self) -> Option<Vec<f32>> {
        (self.total_weight > 0.0).then(|| {
            self.weighted_sum
                .iter()
                .map(|s| (s / self.total_weight) as f32)
                .collect()
        })
    }
}

/// Hooks to misbehave in tests: edit a client's message before it is sent
/// (a rogue client) or the server's unmask request (a malicious server).
pub trait Adversary {
    fn shares(&mut self, _from: ClientId, _shares: &mut SealedShares) {}
    fn masked_input(&mut self, _from: ClientId, _input: &mut MaskedInput) {}
    fn routed_shares(&mut self, _to: ClientId, _shares: &mut SealedShares) {}
    fn unmask_request(&mut self, _to: ClientId, _request: &mut UnmaskRequest) {}
    fn unmask_response(&mut self, _from: ClientId, _response: &mut UnmaskResponse) {}
    /// The encoded bytes a client sends in `stage`.
    fn upload(&mut self, _from: ClientId, _stage: Stage, _bytes: &mut Vec<u8>) {}
}

/// No one misbehaves.
pub struct Honest;

impl Adversary for Honest {}

/// One client's input: its id, its weight (e.g. its number of examples) and
/// its update.
pub type Input<'a> = (ClientId, f64, &'a [f32]);

/// One client's input as integers it encoded itself: its id and its vector
/// of the round's dimension plus one (see [`SharesSent::collect_masked_encoded`]).
///
/// [`SharesSent::collect_masked_encoded`]: super::client::SharesSent::collect_masked_encoded
pub type EncodedInput<'a> = (ClientId, &'a [u32]);

/// What a simulated client masks.
#[derive(Debug, Clone, Copy)]
enum Plaintext<'a> {
    Weighted(f64, &'a [f32]),
    Encoded(&'a [u32]),
}

/// Runs one round of SecAgg(+) over `inputs` with the given dropouts; all
/// randomness (keys, graph, rounding) comes from `seed`.
pub fn simulate_round(
    params: &Params,
    inputs: &[Input<'_>],
    dropouts: &[(ClientId, DropPoint)],
    seed: u64,
) -> Result<Aggregate, SecAggError> {
    simulate_round_with(params, inputs, dropouts, seed, &mut Honest)
}

/// [`simulate_round`] over vectors the clients encoded as integers
/// themselves: the result's [`Aggregate::sum`] is their sum mod the
/// modulus; its weighted sum and total weight mean nothing then.
pub fn simulate_encoded_round(
    params: &Params,
    inputs: &[EncodedInput<'_>],
    dropouts: &[(ClientId, DropPoint)],
    seed: u64,
) -> Result<Aggregate, SecAggError> {
    let plain: Vec<(ClientId, Plaintext<'_>)> = inputs
        .iter()
        .map(|&(id, values)| (id, Plaintext::Encoded(values)))
        .collect();
    run_round(params, &plain, dropouts, seed, &mut Honest)
}

/// [`simulate_round`] with an [`Adversary`].
pub fn simulate_round_with(
    params: &Params,
    inputs: &[Input<'_>],
    dropouts: &[(ClientId, DropPoint)],
    seed: u64,
    adversary: &mut dyn Adversary,
) -> Result<Aggregate, SecAggError> {
    let plain: Vec<(ClientId, Plaintext<'_>)> = inputs
        .iter()
        .map(|&(id, w, values)| (id, Plaintext::Weighted(w, values)))
        .collect();
    run_round(params, &plain, dropouts, seed, adversary)
}

fn run_round(
    params: &Params,
    inputs: &[(ClientId, Plaintext<'_>)],
    dropouts: &[(ClientId, DropPoint)],
    seed: u64,
    adversary: &mut dyn Adversary,
) -> Result<Aggregate, SecAggError> {
    let ids: Vec<ClientId> = inputs.iter().map(|(id, _)| *id).collect();
    let dim = dimension(inputs);
    let mut sim = Sim::new(params, inputs, dropouts, seed, adversary);
    let server = sim.timed_server(|rng| CollectingKeys::new(params, &ids, dim, seed, rng))?;
    let clients = sim.advertise(&ids);
    let (server, down) = sim.stage_keys(server, clients)?;
    let clients = sim.share_keys(down);
    let (server, down) = sim.stage_shares(server, clients)?;
    let clients = sim.masked_inputs(down);
    let (server, requests) = sim.stage_inputs(server, clients)?;
    let output = sim.unmask(server, requests)?;
    Ok(sim.into_aggregate(output))
}

/// The model's dimension: a weighted input's length, an encoded one's less
/// its leading entry.
fn dimension(inputs: &[(ClientId, Plaintext<'_>)]) -> usize {
    match inputs.first() {
        Some((_, Plaintext::Weighted(_, values))) => values.len(),
        Some((_, Plaintext::Encoded(values))) => values.len().saturating_sub(1),
        None => 0,
    }
}

/// The state of a simulated round between stages.
struct Sim<'a> {
    params: Params,
    inputs: BTreeMap<ClientId, Plaintext<'a>>,
    dropouts: BTreeMap<ClientId, DropPoint>,
    rngs: BTreeMap<ClientId, ChaCha20Rng>,
    server_rng: ChaCha20Rng,
    adversary: &'a mut dyn Adversary,
    to_client: Limits,
    to_server: Limits,
    bytes: WireBytes,
    timings: Timings,
    refused: Vec<PeerError>,
    client_errors: Vec<(ClientId, ClientError)>,
}

impl<'a> Sim<'a> {
    fn new(
        params: &Params,
        inputs: &[(ClientId, Plaintext<'a>)],
        dropouts: &[(ClientId, DropPoint)],
        seed: u64,
        adversary: &'a mut dyn Adversary,
    ) -> Sim<'a> {
        let dim = dimension(inputs);
        let max_peers = params.shares_for(inputs.len()).min(MAX_SHARES);
        let client_rng = |id: ClientId| {
            // One key for all clients, one stream each: independent streams.
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            rng.set_stream(id);
            (id, rng)
        };
        Sim {
            params: params.clone(),
            inputs: inputs.iter().copied().collect(),
            dropouts: dropouts.iter().copied().collect(),
            rngs: inputs.iter().map(|(id, _)| client_rng(*id)).collect(),
            server_rng: ChaCha20Rng::seed_from_u64(!seed),
            adversary,
            to_client: Limits {
                max_peers,
                max_values: 0,
            },
            to_server: Limits {
                max_peers,
                max_values: dim.saturating_add(1),
            },
            bytes: WireBytes::default(),
            timings: Timings::default(),
            refused: Vec::new(),
            client_errors: Vec::new(),
        }
    }

    fn timed_server<T>(&mut self, work: impl FnOnce(&mut ChaCha20Rng) -> T) -> T {
        let started = Instant::now();
        let out = work(&mut self.server_rng);
        self.timings.server += started.elapsed();
        out
    }

    /// Runs a client's step, timed; a failure drops the client.
    fn timed_client<T>(
        &mut self,
        id: ClientId,
        work: impl FnOnce(&mut ChaCha20Rng, Plaintext<'a>) -> Result<T, ClientError>,
    ) -> Option<T> {
        let input = self.inputs[&id];
        let rng = self.rngs.get_mut(&id)?;
        let started = Instant::now();
        let out = work(rng, input);
        self.timings.clients += started.elapsed();
        out.map_err(|e| self.client_errors.push((id, e))).ok()
    }

    fn gone_after(&self, id: ClientId, point: DropPoint) -> bool {
        self.dropouts.get(&id) == Some(&point)
    }

    /// Encodes a client's message, lets the adversary at the bytes, counts
    /// them and decodes them as the server would.
    fn upload<M: Message>(&mut self, from: ClientId, stage: Stage, message: &M) -> Option<M> {
        let mut bytes = message.to_bytes();
        self.adversary.upload(from, stage, &mut bytes);
        self.bytes.stage(stage).up += bytes.len() as u64;
        M::from_bytes(&bytes, &self.to_server)
            .map_err(|error| {
                self.refused.push(PeerError::Malformed {
                    client: from,
                    error,
                })
            })
            .ok()
    }

    /// Encodes a server message, counts it and decodes it as the client would.
    fn download<M: Message>(&mut self, to: ClientId, stage: Stage, message: &M) -> Option<M> {
        let bytes = message.to_bytes();
        self.bytes.stage(stage).down += bytes.len() as u64;
        M::from_bytes(&bytes, &self.to_client)
            .map_err(|e| self.client_errors.push((to, e.into())))
            .ok()
    }

    fn advertise(&mut self, ids: &[ClientId]) -> Vec<(ClientId, KeysAdvertised, KeyAdvertisement)> {
        let params = self.params.clone();
        ids.iter()
            .filter_map(|&id| {
                let (state, keys) =
                    self.timed_client(id, |rng, _| KeysAdvertised::start(id, &params, rng))?;
                let keys = self.upload(id, Stage::AdvertiseKeys, &keys)?;
                Some((id, state, keys))
            })
            .collect()
    }

    #[allow(clippy::type_complexity)]
    fn stage_keys(
        &mut self,
        mut server: CollectingKeys,
        clients: Vec<(ClientId, KeysAdvertised, KeyAdvertisement)>,
    ) -> Result<(CollectingShares, Vec<(KeysAdvertised, NeighbourKeys)>), SecAggError> {
        let mut states = BTreeMap::new();
        for (id, state, keys) in clients {
            if self.timed_server(|_| server.receive(id, keys)).is_ok()
                && !self.gone_after(id, DropPoint::AfterAdvertising)
            {
                states.insert(id, state);
            }
        }
        let (server, messages) = self.timed_server(|_| server.finish())?;
        let down = messages
            .into_iter()
            .filter_map(|(id, keys)| {
                let state = states.remove(&id)?;
                Some((state, self.download(id, Stage::ShareKeys, &keys)?))
            })
            .collect();
        Ok((server, down))
    }

    fn share_keys(
        &mut self,
        down: Vec<(KeysAdvertised, NeighbourKeys)>,
    ) -> Vec<(ClientId, SharesSent, SealedShares)> {
        down.into_iter()
            .filter_map(|(state, keys)| {
                let id = state.id();
                let (state, mut shares) =
                    self.timed_client(id, |rng, _| state.share_keys(&keys, rng))?;
                self.adversary.shares(id, &mut shares);
                let shares = self.upload(id, Stage::ShareKeys, &shares)?;
                Some((id, state, shares))
            })
            .collect()
    }

    #[allow(clippy::type_complexity)]
    fn stage_shares(
        &mut self,
        mut server: CollectingShares,
        clients: Vec<(ClientId, SharesSent, SealedShares)>,
    ) -> Result<(CollectingInputs, Vec<(SharesSent, SealedShares)>), SecAggError> {
        let mut states = BTreeMap::new();
        for (id, state, shares) in clients {
            if self.timed_server(|_| server.receive(id, shares)).is_ok()
                && !self.gone_after(id, DropPoint::AfterSharingKeys)
            {
                states.insert(id, state);
            }
        }
        let (server, messages) = self.timed_server(|_| server.finish())?;
        let down = messages
            .into_iter()
            .filter_map(|(id, mut routed)| {
                let state = states.remove(&id)?;
                self.adversary.routed_shares(id, &mut routed);
                Some((state, self.download(id, Stage::MaskedInput, &routed)?))
            })
            .collect();
        Ok((server, down))
    }

    fn masked_inputs(
        &mut self,
        down: Vec<(SharesSent, SealedShares)>,
    ) -> Vec<(ClientId, InputSent, MaskedInput)> {
        down.into_iter()
            .filter_map(|(state, routed)| {
                let id = state.id();
                let (state, mut input) = self.timed_client(id, |rng, plain| match plain {
                    Plaintext::Weighted(weight, values) => {
                        state.collect_masked_input(&routed, weight, values, rng)
                    }
                    Plaintext::Encoded(values) => state.collect_masked_encoded(&routed, values),
                })?;
                self.adversary.masked_input(id, &mut input);
                let input = self.upload(id, Stage::MaskedInput, &input)?;
                Some((id, state, input))
            })
            .collect()
    }

    #[allow(clippy::type_complexity)]
    fn stage_inputs(
        &mut self,
        mut server: CollectingInputs,
        clients: Vec<(ClientId, InputSent, MaskedInput)>,
    ) -> Result<(Unmasking, Vec<(InputSent, UnmaskRequest)>), SecAggError> {
        let mut states = BTreeMap::new();
        for (id, state, input) in clients {
            if self.timed_server(|_| server.receive(id, input)).is_ok()
                && !self.gone_after(id, DropPoint::AfterMaskedInput)
            {
                states.insert(id, state);
            }
        }
        let (server, messages) = self.timed_server(|_| server.finish())?;
        let down = messages
            .into_iter()
            .filter_map(|(id, mut request)| {
                let state = states.remove(&id)?;
                self.adversary.unmask_request(id, &mut request);
                Some((state, self.download(id, Stage::Unmask, &request)?))
            })
            .collect();
        Ok((server, down))
    }

    fn unmask(
        &mut self,
        mut server: Unmasking,
        requests: Vec<(InputSent, UnmaskRequest)>,
    ) -> Result<ServerOutput, SecAggError> {
        for (state, request) in requests {
            let id = state.id();
            let Some(mut response) = self.timed_client(id, |_, _| state.unmask(&request)) else {
                continue;
            };
            self.adversary.unmask_response(id, &mut response);
            if let Some(response) = self.upload::<UnmaskResponse>(id, Stage::Unmask, &response) {
                // A refusal is recorded by the server; the round goes on.
                let _ = self.timed_server(|_| server.receive(id, response));
            }
        }
        self.timed_server(|_| server.finish())
    }

    fn into_aggregate(mut self, output: ServerOutput) -> Aggregate {
        self.refused.extend(output.refused);
        Aggregate {
            sum: output.sum,
            weighted_sum: output.weighted_sum,
            total_weight: output.total_weight,
            contributors: output.contributors,
            refused: self.refused,
            client_errors: self.client_errors,
            bytes: self.bytes,
            timings: self.timings,
        }
    }
}
