//! Network mode's two sides of a round, over bytes: what a client process
//! answers to each stage message ([`ClientRound`]) and how the server runs
//! the stages over any transport ([`serve_round`], through [`Exchange`]).
//!
//! Both sides are the state machines of [`super::client`] and
//! [`super::server`] with the [`super::wire`] encoding around them; nothing
//! of the protocol is written twice. What this module adds is what a
//! network needs and a single process does not:
//!
//! * a **setup** message (stage 0), so a client checks the round's
//!   parameters against its own config before it makes a key: a server
//!   cannot lower the threshold or widen the graph behind its clients' backs;
//! * **stage order**: each message must be the one the client's state
//!   expects, once; anything else ends the client's part in the round;
//! * **bounds** on every message from the peer before it is decoded: the
//!   server decodes client messages with [`Limits`] sized by the round (its
//!   neighbours, its model), the client decodes server messages with limits
//!   from its own config, never from the server's word.
//!
//! Contract: every refusal names the stage, the peer and what was expected;
//! no input from a peer panics. What it cannot prove: that the server
//! routes honestly (see `docs/SECURITY.md`); the client's checks
//! ([`InputSent::unmask`]) are what stop a server asking for both shares of
//! one peer.

use std::collections::BTreeSet;

use rand::CryptoRng;

use super::client::{ClientError, InputSent, KeysAdvertised, SharesSent};
use super::server::{CollectingKeys, PeerError, SecAggError, ServerOutput};
use super::shamir::{MAX_SHARES, SHARE_LEN};
use super::sim::{Stage, StageBytes, WireBytes};
use super::wire::{
    KeyAdvertisement, Limits, MAX_CIPHERTEXT, MaskedInput, Message, NeighbourKeys, SealedShares,
    Setup, UnmaskRequest, UnmaskResponse, WireError,
};
use super::{ClientId, Params};

/// The random stream of a party in network mode.
pub type PartyRng = rand_chacha::ChaCha20Rng;

/// A fresh stream from the operating system's entropy: keys, seeds and
/// rounding nothing the other parties know predicts.
pub fn fresh_rng() -> PartyRng {
    rand::SeedableRng::from_os_rng()
}

/// The stage's name, as logs and errors give it.
pub fn stage_name(stage: Stage) -> &'static str {
    match stage {
        Stage::AdvertiseKeys => "setup",
        Stage::ShareKeys => "share_keys",
        Stage::MaskedInput => "collect_masked_input",
        Stage::Unmask => "unmask",
    }
}

/// Why a client leaves the round; the server hears the text.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClientRoundError {
    #[error("the server sent a {got} message; expected {expected}")]
    OutOfOrder {
        got: &'static str,
        expected: &'static str,
    },
    #[error(
        "the server's setup asks for {got:?}; this client's config says {expected:?}, so it takes no part"
    )]
    SetupMismatch {
        got: Box<Params>,
        expected: Box<Params>,
    },
    #[error("the server's setup names {got} clients; expected 2 to {most} (clients.total_clients)")]
    SetupClients { got: u32, most: u32 },
    #[error("the server's setup names a model of {got} values; this client trained {expected}")]
    SetupDimension { got: u64, expected: usize },
    #[error("the server's {stage} message is malformed: {error}")]
    Malformed {
        stage: &'static str,
        error: WireError,
    },
    #[error("at {stage}: {error}")]
    Protocol {
        stage: &'static str,
        error: ClientError,
    },
}

enum State {
    /// Trained; waits for the setup.
    Trained,
    Advertised(KeysAdvertised),
    SharesSent(SharesSent),
    InputSent(InputSent),
    /// Answered the unmask request, or left.
    Done,
}

/// What a client masks: a weighted change the protocol quantises, or a
/// vector the client encoded as integers itself ([`super::ddg`]).
enum Input {
    Weighted { weight: f64, change: Vec<f32> },
    Encoded(Vec<u32>),
}

/// One logical client's part in one round, in its own process: its input
/// `[weight, weight·change]` (or its encoded vector) and the protocol's
/// state.
pub struct ClientRound {
    id: ClientId,
    /// The parameters the client's own config gives the round.
    expected: Params,
    /// `clients.total_clients` of the client's config: no round is larger.
    max_clients: u32,
    input: Input,
    state: State,
    limits: Limits,
}

impl ClientRound {
    /// A trained client `id` that will mask `change` with `weight`, taking
    /// part only in a round of the `expected` parameters of at most
    /// `max_clients` clients.
    pub fn new(
        id: ClientId,
        expected: Params,
        max_clients: u32,
        weight: f64,
        change: Vec<f32>,
    ) -> ClientRound {
        Self::with_input(
            id,
            expected,
            max_clients,
            Input::Weighted { weight, change },
        )
    }

    /// A trained client `id` that will mask `values`, integers it encoded
    /// itself (their length the model's dimension plus one), as
    /// [`ClientRound::new`] otherwise.
    pub fn encoded(
        id: ClientId,
        expected: Params,
        max_clients: u32,
        values: Vec<u32>,
    ) -> ClientRound {
        Self::with_input(id, expected, max_clients, Input::Encoded(values))
    }

    fn with_input(id: ClientId, expected: Params, max_clients: u32, input: Input) -> ClientRound {
        let max_peers = expected
            .shares_for(max_clients as usize)
            .clamp(1, MAX_SHARES);
        ClientRound {
            id,
            expected,
            max_clients,
            input,
            state: State::Trained,
            limits: Limits {
                max_peers,
                max_values: 0,
            },
        }
    }

    /// Whether the part is over (answered the unmask request or left).
    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// The answer to the server's `stage` message `body`. After an error
    /// the part is over: the client answers nothing more this round.
    pub fn answer(
        &mut self,
        stage: Stage,
        body: &[u8],
        rng: &mut impl CryptoRng,
    ) -> Result<Vec<u8>, ClientRoundError> {
        let state = std::mem::replace(&mut self.state, State::Done);
        let name = stage_name(stage);
        let malformed = |error| ClientRoundError::Malformed { stage: name, error };
        let protocol = |error| ClientRoundError::Protocol { stage: name, error };
        let (next, reply) = match (state, stage) {
            (State::Trained, Stage::AdvertiseKeys) => {
                let setup = Setup::from_bytes(body, &self.limits).map_err(malformed)?;
                self.check_setup(&setup)?;
                let (next, keys) =
                    KeysAdvertised::start(self.id, &setup.params, rng).map_err(protocol)?;
                (State::Advertised(next), keys.to_bytes())
            }
            (State::Advertised(state), Stage::ShareKeys) => {
                let keys = NeighbourKeys::from_bytes(body, &self.limits).map_err(malformed)?;
                let (next, shares) = state.share_keys(&keys, rng).map_err(protocol)?;
                (State::SharesSent(next), shares.to_bytes())
            }
            (State::SharesSent(state), Stage::MaskedInput) => {
                let routed = SealedShares::from_bytes(body, &self.limits).map_err(malformed)?;
                let input = std::mem::replace(&mut self.input, Input::Encoded(Vec::new()));
                let (next, input) = match input {
                    Input::Weighted { weight, change } => {
                        state.collect_masked_input(&routed, weight, &change, rng)
                    }
                    Input::Encoded(values) => state.collect_masked_encoded(&routed, &values),
                }
                .map_err(protocol)?;
                (State::InputSent(next), input.to_bytes())
            }
            (State::InputSent(state), Stage::Unmask) => {
                let request = UnmaskRequest::from_bytes(body, &self.limits).map_err(malformed)?;
                // The only answer that reveals shares goes through the
                // client's checks: never both secrets of one peer.
                let response = state.unmask(&request).map_err(protocol)?;
                (State::Done, response.to_bytes())
            }
            (state, _) => {
                return Err(ClientRoundError::OutOfOrder {
                    got: name,
                    expected: expected_stage(&state),
                });
            }
        };
        self.state = next;
        Ok(reply)
    }

    fn check_setup(&self, setup: &Setup) -> Result<(), ClientRoundError> {
        if setup.params != self.expected {
            return Err(ClientRoundError::SetupMismatch {
                got: Box::new(setup.params.clone()),
                expected: Box::new(self.expected.clone()),
            });
        }
        if setup.clients < 2 || setup.clients > self.max_clients {
            return Err(ClientRoundError::SetupClients {
                got: setup.clients,
                most: self.max_clients,
            });
        }
        let dimension = match &self.input {
            Input::Weighted { change, .. } => change.len(),
            Input::Encoded(values) => values.len().saturating_sub(1),
        };
        if setup.dimension != dimension as u64 {
            return Err(ClientRoundError::SetupDimension {
                got: setup.dimension,
                expected: dimension,
            });
        }
        Ok(())
    }
}

fn expected_stage(state: &State) -> &'static str {
    match state {
        State::Trained => "setup",
        State::Advertised(_) => "share_keys",
        State::SharesSent(_) => "collect_masked_input",
        State::InputSent(_) => "unmask",
        State::Done => "nothing more this round",
    }
}

/// How the server reaches its clients for one stage: send each message,
/// and give back each client's answer, or why none came (it left, timed
/// out, refused). Answers may come in any order; a client not answered for
/// is taken as gone.
pub trait Exchange {
    fn exchange(
        &mut self,
        stage: Stage,
        messages: Vec<(ClientId, Vec<u8>)>,
    ) -> Vec<(ClientId, Result<Vec<u8>, String>)>;
}

/// The most bytes a client's answer to `stage` can honestly have, for a
/// round whose clients have at most `max_peers` neighbours (self included)
/// and a model of `dimension` values: the transport refuses a longer one
/// before reading it.
pub fn max_answer_bytes(stage: Stage, max_peers: usize, dimension: usize) -> usize {
    let peers = max_peers.min(MAX_SHARES);
    let body = match stage {
        Stage::AdvertiseKeys => 64,
        Stage::ShareKeys => peers.saturating_mul(12 + MAX_CIPHERTEXT),
        Stage::MaskedInput => peers
            .saturating_mul(8)
            .saturating_add(dimension.saturating_add(1).saturating_mul(4))
            .saturating_add(40),
        Stage::Unmask => peers.saturating_mul(2 * (8 + SHARE_LEN)),
    };
    body.saturating_add(16)
}

/// A finished round: the server's output and who left along the way.
#[derive(Debug, Clone, PartialEq)]
pub struct ServedRound {
    pub output: ServerOutput,
    /// Clients out of the sum, and why, in the order they left.
    pub left: Vec<(ClientId, String)>,
    pub bytes: WireBytes,
}

/// A round that could not finish.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundAborted {
    pub error: SecAggError,
    /// Clients still in the protocol when it aborted.
    pub alive: usize,
    pub left: Vec<(ClientId, String)>,
}

/// Runs one round over `exchange` for `clients` with models of `dimension`
/// values; `graph_seed` shuffles the SecAgg+ graph. Each stage's answers are
/// decoded within the round's bounds and given to the server's state
/// machine; a client that does not answer, answers what does not decode or
/// breaks the protocol is out, as in [`super::simulate_round`].
pub fn serve_round(
    params: &Params,
    clients: &[ClientId],
    dimension: usize,
    graph_seed: u64,
    exchange: &mut dyn Exchange,
    rng: &mut impl CryptoRng,
) -> Result<ServedRound, RoundAborted> {
    let mut round = Served {
        left: Vec::new(),
        bytes: WireBytes::default(),
        alive: clients.len(),
        limits: Limits {
            max_peers: params.shares_for(clients.len()).clamp(1, MAX_SHARES),
            max_values: dimension.saturating_add(1),
        },
    };
    let result = round.run(params, clients, dimension, graph_seed, exchange, rng);
    match result {
        Ok(mut output) => {
            // Those a neighbour reported are out too; the rest of the
            // refusals were recorded as they happened.
            for refusal in std::mem::take(&mut output.refused) {
                if let PeerError::ReportedByPeer { client, .. } = refusal {
                    round
                        .left
                        .push((client, format!("refused by the server: {refusal}")));
                }
            }
            Ok(ServedRound {
                output,
                left: round.left,
                bytes: round.bytes,
            })
        }
        Err(error) => Err(RoundAborted {
            error,
            alive: round.alive,
            left: round.left,
        }),
    }
}

/// The server's bookkeeping across the stages of [`serve_round`].
struct Served {
    left: Vec<(ClientId, String)>,
    bytes: WireBytes,
    alive: usize,
    limits: Limits,
}

impl Served {
    fn run(
        &mut self,
        params: &Params,
        clients: &[ClientId],
        dimension: usize,
        graph_seed: u64,
        exchange: &mut dyn Exchange,
        rng: &mut impl CryptoRng,
    ) -> Result<ServerOutput, SecAggError> {
        let mut keys = CollectingKeys::new(params, clients, dimension, graph_seed, rng)?;
        let setup = Setup {
            params: params.clone(),
            clients: u32::try_from(clients.len()).unwrap_or(u32::MAX),
            dimension: dimension as u64,
        };
        let messages = clients.iter().map(|&id| (id, setup.clone())).collect();
        self.stage::<_, KeyAdvertisement>(Stage::AdvertiseKeys, messages, exchange, |id, m| {
            keys.receive(id, m)
        });
        let (mut shares, messages) = keys.finish()?;
        self.stage::<_, SealedShares>(Stage::ShareKeys, messages, exchange, |id, m| {
            shares.receive(id, m)
        });
        let (mut inputs, messages) = shares.finish()?;
        self.stage::<_, MaskedInput>(Stage::MaskedInput, messages, exchange, |id, m| {
            inputs.receive(id, m)
        });
        let (mut unmasking, messages) = inputs.finish()?;
        self.stage::<_, UnmaskResponse>(Stage::Unmask, messages, exchange, |id, m| {
            unmasking.receive(id, m)
        });
        unmasking.finish()
    }

    /// One stage: `messages` out, each answer decoded as `A` and received.
    fn stage<D: Message, A: Message>(
        &mut self,
        stage: Stage,
        messages: Vec<(ClientId, D)>,
        exchange: &mut dyn Exchange,
        mut receive: impl FnMut(ClientId, A) -> Result<(), PeerError>,
    ) {
        let name = stage_name(stage);
        let sent: BTreeSet<ClientId> = messages.iter().map(|(id, _)| *id).collect();
        let encoded: Vec<(ClientId, Vec<u8>)> = messages
            .into_iter()
            .map(|(id, m)| (id, m.to_bytes()))
            .collect();
        let counts: &mut StageBytes = stage_bytes(&mut self.bytes, stage);
        counts.down += encoded.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
        let mut answered = BTreeSet::new();
        for (id, answer) in exchange.exchange(stage, encoded) {
            if !sent.contains(&id) || !answered.insert(id) {
                continue;
            }
            let bytes = match answer {
                Ok(bytes) => bytes,
                Err(reason) => {
                    self.left.push((id, format!("left at {name}: {reason}")));
                    continue;
                }
            };
            stage_bytes(&mut self.bytes, stage).up += bytes.len() as u64;
            match A::from_bytes(&bytes, &self.limits) {
                Ok(message) => {
                    if let Err(refusal) = receive(id, message) {
                        self.left
                            .push((id, format!("refused by the server: {refusal}")));
                    }
                }
                Err(error) => {
                    let refusal = PeerError::Malformed { client: id, error };
                    self.left
                        .push((id, format!("refused by the server: {refusal}")));
                }
            }
        }
        for &id in sent.difference(&answered) {
            self.left
                .push((id, format!("left at {name}: no answer came back")));
        }
        let gone: BTreeSet<ClientId> = self.left.iter().map(|(id, _)| *id).collect();
        self.alive = sent.iter().filter(|id| !gone.contains(id)).count();
    }
}

fn stage_bytes(bytes: &mut WireBytes, stage: Stage) -> &mut StageBytes {
    match stage {
        Stage::AdvertiseKeys => &mut bytes.advertise_keys,
        Stage::ShareKeys => &mut bytes.share_keys,
        Stage::MaskedInput => &mut bytes.masked_input,
        Stage::Unmask => &mut bytes.unmask,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secagg::NumShares;
    use rand::SeedableRng;
    use std::collections::BTreeMap;

    /// Clients in memory, answering through their parts; `leave` names
    /// the stage at which a client stops answering.
    struct Clients {
        parts: BTreeMap<ClientId, ClientRound>,
        leave: BTreeMap<ClientId, Stage>,
        rng: PartyRng,
        /// A malicious server: rewrites the unmask request to one client.
        tamper_unmask: Option<(ClientId, UnmaskRequest)>,
    }

    impl Exchange for Clients {
        fn exchange(
            &mut self,
            stage: Stage,
            messages: Vec<(ClientId, Vec<u8>)>,
        ) -> Vec<(ClientId, Result<Vec<u8>, String>)> {
            let mut out = Vec::new();
            for (id, mut body) in messages {
                if self.leave.get(&id) == Some(&stage) {
                    continue;
                }
                if let Some((to, request)) = &self.tamper_unmask
                    && *to == id
                    && stage == Stage::Unmask
                {
                    body = request.to_bytes();
                }
                let part = self.parts.get_mut(&id).unwrap();
                let answer = part.answer(stage, &body, &mut self.rng);
                out.push((id, answer.map_err(|e| e.to_string())));
            }
            out
        }
    }

    /// Each client and four neighbours, threshold 3 (the complete graph
    /// below six clients).
    fn params() -> Params {
        Params::new(NumShares::Neighbours(5), 3)
    }

    fn clients(n: u64) -> Clients {
        let parts = (1..=n)
            .map(|id| {
                let change = vec![id as f32 * 0.01, -0.02];
                (id, ClientRound::new(id, params(), 8, 10.0, change))
            })
            .collect();
        Clients {
            parts,
            leave: BTreeMap::new(),
            rng: PartyRng::seed_from_u64(5),
            tamper_unmask: None,
        }
    }

    fn serve(clients: &mut Clients, n: u64) -> Result<ServedRound, RoundAborted> {
        let ids: Vec<ClientId> = (1..=n).collect();
        let mut rng = PartyRng::seed_from_u64(6);
        serve_round(&params(), &ids, 2, 7, clients, &mut rng)
    }

    #[test]
    fn a_round_over_bytes_gives_the_sum() {
        let mut five = clients(5);
        let served = serve(&mut five, 5).unwrap();
        assert_eq!(served.output.contributors, [1, 2, 3, 4, 5]);
        assert!(served.left.is_empty(), "{:?}", served.left);
        let mean = served.output.weighted_sum[0] / served.output.total_weight;
        let bound = crate::secagg::mean_error_bound(&params(), 5, 50.0, 0.05).unwrap();
        assert!((mean - 0.03).abs() <= bound, "{mean}, bound {bound}");
        assert!(served.bytes.masked_input.up > 0 && served.bytes.share_keys.down > 0);
        assert!(five.parts.values().all(ClientRound::is_done));
    }

    #[test]
    fn clients_gone_after_sharing_keys_or_masking_are_survived() {
        let mut seven = clients(7);
        seven.leave.insert(2, Stage::MaskedInput);
        seven.leave.insert(4, Stage::Unmask);
        let served = serve(&mut seven, 7).unwrap();
        // 4 sent its masked input: it is in the sum; 2 is not.
        assert_eq!(served.output.contributors, [1, 3, 4, 5, 6, 7]);
        let gone: Vec<ClientId> = served.left.iter().map(|(id, _)| *id).collect();
        assert_eq!(gone, [2, 4]);
        assert!(served.left[0].1.contains("left at collect_masked_input"));
        let mean = served.output.weighted_sum[0] / served.output.total_weight;
        let want = (0.01 + 0.03 + 0.04 + 0.05 + 0.06 + 0.07) / 6.0;
        let bound = crate::secagg::mean_error_bound(&params(), 6, 60.0, 0.07).unwrap();
        assert!((mean - want).abs() <= bound, "{mean}, bound {bound}");
    }

    #[test]
    fn too_few_survivors_abort_naming_how_many_were_left() {
        let mut four = clients(4);
        for id in [1, 2, 3] {
            four.leave.insert(id, Stage::MaskedInput);
        }
        let aborted = serve(&mut four, 4).unwrap_err();
        assert_eq!(aborted.alive, 1);
        assert_eq!(aborted.left.len(), 3);
        assert!(matches!(aborted.error, SecAggError::TooFewSurvivors { .. }));
    }

    #[test]
    fn a_client_refuses_to_reveal_both_shares_of_one_peer() {
        let mut five = clients(5);
        // Client 1 is asked for both secrets of its neighbour 2 (five
        // clients with five shares: the complete graph).
        let neighbour = 2;
        let request = UnmaskRequest {
            survivors: vec![1, neighbour],
            dropped: vec![neighbour],
        };
        five.tamper_unmask = Some((1, request));
        let served = serve(&mut five, 5).unwrap();
        let refusal = served.left.iter().find(|(id, _)| *id == 1).unwrap();
        assert!(refusal.1.contains("revealing both"), "{}", refusal.1);
    }

    #[test]
    fn a_setup_other_than_the_config_is_refused_before_any_key() {
        let mut part = ClientRound::new(1, params(), 8, 1.0, vec![0.0; 2]);
        let mut rng = PartyRng::seed_from_u64(1);
        let lowered = Setup {
            params: Params::new(NumShares::Neighbours(5), 2),
            clients: 4,
            dimension: 2,
        };
        let error = part
            .answer(Stage::AdvertiseKeys, &lowered.to_bytes(), &mut rng)
            .unwrap_err();
        assert!(
            matches!(error, ClientRoundError::SetupMismatch { .. }),
            "{error}"
        );
        assert!(part.is_done());
        let mut part = ClientRound::new(1, params(), 8, 1.0, vec![0.0; 2]);
        let wide = Setup {
            params: params(),
            clients: 9,
            dimension: 2,
        };
        assert!(matches!(
            part.answer(Stage::AdvertiseKeys, &wide.to_bytes(), &mut rng),
            Err(ClientRoundError::SetupClients { got: 9, most: 8 })
        ));
        let mut part = ClientRound::new(1, params(), 8, 1.0, vec![0.0; 2]);
        assert!(matches!(
            part.answer(Stage::ShareKeys, &[], &mut rng),
            Err(ClientRoundError::OutOfOrder { .. })
        ));
        let mut part = ClientRound::new(1, params(), 8, 1.0, vec![0.0; 2]);
        assert!(matches!(
            part.answer(Stage::AdvertiseKeys, &[8, 1], &mut rng),
            Err(ClientRoundError::Malformed { .. })
        ));
    }
}
