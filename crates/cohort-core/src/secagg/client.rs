//! The client's side of a round, as a chain of states: each stage consumes
//! the previous state, so a stage cannot run twice or out of order, and the
//! unmask answer (the only one that reveals shares) is given at most once.

use std::collections::{BTreeMap, BTreeSet};

use rand::CryptoRng;

use super::crypto::{self, KeyPair, Sign};
use super::quant::{self, QuantError};
use super::shamir::{self, MAX_SHARES, ShamirError};
use super::wire::{
    KeyAdvertisement, Limits, MaskedInput, Message, NeighbourKeys, SealedShares, SharePlaintext,
    UnmaskRequest, UnmaskResponse, WireError,
};
use super::{ClientId, Params, ParamsError};

/// Why a client stopped taking part. Each names the peer or value at fault;
/// those about the server's messages mean the server misbehaved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Params(#[from] ParamsError),
    #[error("own input: {0}")]
    Input(#[from] QuantError),
    #[error(
        "the server's key list is not sorted by id or repeats client {0}; expected each neighbour once, in order"
    )]
    KeyListOrder(ClientId),
    #[error("the server's key list does not hold this client's own keys; expected them unchanged")]
    OwnKeysMissing,
    #[error(
        "the server's key list has {got} entries; expected at least the threshold {need} and at most {MAX_SHARES}"
    )]
    KeyListSize { got: usize, need: usize },
    #[error(
        "client {0}'s public key repeats another key or is a low-order point; expected distinct, contributory keys"
    )]
    WeakKey(ClientId),
    #[error(
        "shares routed from {0}, which is not a neighbour (or is this client, or appears twice)"
    )]
    UnexpectedSender(ClientId),
    #[error(
        "{accepted} neighbours' shares accepted (self included); expected at least the threshold {need}"
    )]
    TooFewNeighbours { accepted: usize, need: usize },
    #[error(
        "the server asks for both the self-mask-seed share and the mask-key share of client {0}; revealing both would unmask its input"
    )]
    BothShares(ClientId),
    #[error("the server asks for the shares of client {0}, which is no neighbour of this client")]
    NoEdge(ClientId),
    #[error("the server asks for the shares of client {0}, whose shares this client refused")]
    NoShareHeld(ClientId),
    #[error("the server asks for this client's own mask-key share while it is alive")]
    OwnKey,
    #[error("the server names client {0} twice in its unmask request")]
    Repeated(ClientId),
    #[error(
        "the server names {survivors} surviving neighbours; expected at least the threshold {need}"
    )]
    TooFewSurvivors { survivors: usize, need: usize },
    #[error("a message from the server is malformed: {0}")]
    Malformed(#[from] WireError),
    #[error("secret sharing failed: {0}")]
    Shamir(#[from] ShamirError),
}

/// Stage 1 done: the client has advertised its two public keys.
pub struct KeysAdvertised {
    id: ClientId,
    params: Params,
    mask: KeyPair,
    encryption: KeyPair,
}

/// Stage 2 done: the client has sent its shares.
pub struct SharesSent {
    id: ClientId,
    params: Params,
    mask: KeyPair,
    seed: [u8; 32],
    /// Each neighbour's mask key and the key that opens its shares to us.
    peers: BTreeMap<ClientId, ([u8; 32], [u8; 32])>,
    own_shares: SharePlaintext,
}

/// Stage 3 done: the client has sent its masked input and holds its
/// neighbours' shares for the unmask request.
pub struct InputSent {
    id: ClientId,
    threshold: usize,
    neighbours: BTreeSet<ClientId>,
    held: BTreeMap<ClientId, SharePlaintext>,
}

impl KeysAdvertised {
    /// The client's id.
    pub fn id(&self) -> ClientId {
        self.id
    }

    /// Starts a round: two fresh X25519 key pairs, one for the pairwise
    /// masks and one for encrypting shares.
    pub fn start(
        id: ClientId,
        params: &Params,
        rng: &mut impl CryptoRng,
    ) -> Result<(KeysAdvertised, KeyAdvertisement), ClientError> {
        params.validate()?;
        let state = KeysAdvertised {
            id,
            params: params.clone(),
            mask: KeyPair::generate(rng),
            encryption: KeyPair::generate(rng),
        };
        let message = KeyAdvertisement {
            mask_key: state.mask.public,
            encryption_key: state.encryption.public,
        };
        Ok((state, message))
    }

    /// Checks the neighbours' keys, shares a fresh self-mask seed and the
    /// mask secret key among them (the `i`-th in id order gets the share at
    /// point `i + 1`), and seals each neighbour's pair of shares for it.
    pub fn share_keys(
        self,
        keys: &NeighbourKeys,
        rng: &mut impl CryptoRng,
    ) -> Result<(SharesSent, SealedShares), ClientError> {
        let own = self.check_key_list(keys)?;
        let t = self.params.reconstruction_threshold;
        let mut seed = [0u8; 32];
        rng.fill_bytes(&mut seed);
        let n = keys.peers.len();
        let seed_shares = shamir::split(&seed, t, n, rng)?;
        let key_shares = shamir::split(&self.mask.secret.to_bytes(), t, n, rng)?;
        let mut peers = BTreeMap::new();
        let mut entries = Vec::with_capacity(n - 1);
        for (at, peer) in keys.peers.iter().enumerate() {
            let plaintext = SharePlaintext {
                seed_share: seed_shares[at],
                key_share: key_shares[at],
            };
            if at == own {
                continue;
            }
            let shared = crypto::agree(&self.encryption.secret, &peer.keys.encryption_key)
                .ok_or(ClientError::WeakKey(peer.id))?;
            let to_peer = crypto::share_key(&shared, self.id, peer.id);
            let from_peer = crypto::share_key(&shared, peer.id, self.id);
            let sealed = crypto::seal(&to_peer, self.id, peer.id, &plaintext.to_bytes());
            entries.push((peer.id, sealed));
            peers.insert(peer.id, (peer.keys.mask_key, from_peer));
        }
        let own_shares = SharePlaintext {
            seed_share: seed_shares[own],
            key_share: key_shares[own],
        };
        let state = SharesSent {
            id: self.id,
            params: self.params,
            mask: self.mask,
            seed,
            peers,
            own_shares,
        };
        Ok((state, SealedShares { entries }))
    }

    /// The server's key list must be sorted, hold this client's own keys
    /// unchanged, be at least `t` long, and repeat no key (Flower's checks).
    /// Returns this client's position in it.
    fn check_key_list(&self, keys: &NeighbourKeys) -> Result<usize, ClientError> {
        let t = self.params.reconstruction_threshold;
        let n = keys.peers.len();
        if n < t || n > MAX_SHARES {
            return Err(ClientError::KeyListSize { got: n, need: t });
        }
        if let Some(pair) = keys.peers.windows(2).find(|p| p[0].id >= p[1].id) {
            return Err(ClientError::KeyListOrder(pair[1].id));
        }
        let own = keys
            .peers
            .iter()
            .position(|p| p.id == self.id)
            .filter(|&at| {
                let k = &keys.peers[at].keys;
                k.mask_key == self.mask.public && k.encryption_key == self.encryption.public
            })
            .ok_or(ClientError::OwnKeysMissing)?;
        let mut seen = BTreeSet::new();
        for peer in &keys.peers {
            let fresh = seen.insert(peer.keys.mask_key) && seen.insert(peer.keys.encryption_key);
            let mask_ok = peer.id == self.id
                || crypto::agree(&self.mask.secret, &peer.keys.mask_key).is_some();
            if !fresh || !mask_ok {
                return Err(ClientError::WeakKey(peer.id));
            }
        }
        Ok(own)
    }
}

impl SharesSent {
    /// The client's id.
    pub fn id(&self) -> ClientId {
        self.id
    }

    /// Opens the shares routed to this client, refusing any that fail to
    /// authenticate or decode (the server is told, and drops that sender);
    /// then quantises `[weight, weight·input]`, adds the self mask and the
    /// pairwise masks of every accepted neighbour (added when this client's
    /// id is the larger, subtracted otherwise), reduced mod the modulus.
    pub fn collect_masked_input(
        self,
        routed: &SealedShares,
        weight: f64,
        input: &[f32],
        rng: &mut impl CryptoRng,
    ) -> Result<(InputSent, MaskedInput), ClientError> {
        self.mask_with(routed, |params| {
            let weight_q = quant::quantize_weight(weight, params)?;
            Ok(quant::quantize(input, weight_q, params, rng)?)
        })
    }

    /// [`SharesSent::collect_masked_input`] for a vector the caller has
    /// already made integers (the distributed discrete Gaussian's,
    /// [`super::ddg`]): `values` are masked as they are, reduced mod the
    /// modulus, so the server's sum is their sum mod the modulus. Its
    /// length must be the round's dimension plus one, as a quantised
    /// vector's is.
    pub fn collect_masked_encoded(
        self,
        routed: &SealedShares,
        values: &[u32],
    ) -> Result<(InputSent, MaskedInput), ClientError> {
        self.mask_with(routed, |_| Ok(values.to_vec()))
    }

    /// Opens the routed shares, checks that enough neighbours are left,
    /// then masks the vector `encode` gives.
    fn mask_with(
        self,
        routed: &SealedShares,
        encode: impl FnOnce(&Params) -> Result<Vec<u32>, ClientError>,
    ) -> Result<(InputSent, MaskedInput), ClientError> {
        let (held, rejected) = self.open_routed(routed)?;
        let t = self.params.reconstruction_threshold;
        if held.len() + 1 < t {
            return Err(ClientError::TooFewNeighbours {
                accepted: held.len() + 1,
                need: t,
            });
        }
        let mut values = encode(&self.params)?;
        let modulus_mask = self.params.modulus_mask();
        let mut masks = vec![(self.seed, Sign::Add)];
        for &peer in held.keys() {
            let (mask_key, _) = &self.peers[&peer];
            // Checked contributory in `share_keys`.
            let shared =
                crypto::agree(&self.mask.secret, mask_key).ok_or(ClientError::WeakKey(peer))?;
            let sign = if self.id > peer {
                Sign::Add
            } else {
                Sign::Subtract
            };
            masks.push((crypto::pairwise_seed(&shared, self.id, peer), sign));
        }
        crypto::apply_masks(&mut values, &masks, modulus_mask);
        values.iter_mut().for_each(|v| *v &= modulus_mask);
        let message = MaskedInput {
            rejected,
            seed_commitment: crypto::seed_commitment(&self.seed),
            values,
        };
        let mut held = held;
        held.insert(self.id, self.own_shares);
        let state = InputSent {
            id: self.id,
            threshold: t,
            neighbours: self.peers.keys().copied().chain([self.id]).collect(),
            held,
        };
        Ok((state, message))
    }

    /// The shares that open and decode, by sender, and the senders refused.
    #[allow(clippy::type_complexity)]
    fn open_routed(
        &self,
        routed: &SealedShares,
    ) -> Result<(BTreeMap<ClientId, SharePlaintext>, Vec<ClientId>), ClientError> {
        let limits = Limits {
            max_peers: 0,
            max_values: 0,
        };
        let mut held = BTreeMap::new();
        let mut rejected = BTreeSet::new();
        for (sender, sealed) in &routed.entries {
            let Some((_, key)) = self.peers.get(sender) else {
                return Err(ClientError::UnexpectedSender(*sender));
            };
            if held.contains_key(sender) || rejected.contains(sender) {
                return Err(ClientError::UnexpectedSender(*sender));
            }
            let plaintext = crypto::open(key, *sender, self.id, sealed)
                .and_then(|bytes| SharePlaintext::from_bytes(&bytes, &limits).ok())
                .filter(|p| p.seed_share.x == p.key_share.x);
            match plaintext {
                Some(p) => {
                    held.insert(*sender, p);
                }
                None => {
                    rejected.insert(*sender);
                }
            }
        }
        Ok((held, rejected.into_iter().collect()))
    }
}

impl InputSent {
    /// The client's id.
    pub fn id(&self) -> ClientId {
        self.id
    }

    /// Answers the server's unmask request, after checking it: no peer named
    /// twice or in both lists (that would reveal both its self-mask seed and
    /// its mask key, so its input), only neighbours whose shares this client
    /// holds, never its own mask key, and at least `t` survivors.
    pub fn unmask(self, request: &UnmaskRequest) -> Result<UnmaskResponse, ClientError> {
        let mut named = BTreeSet::new();
        for &peer in request.survivors.iter().chain(&request.dropped) {
            if !named.insert(peer) {
                let both = request.survivors.contains(&peer) && request.dropped.contains(&peer);
                return Err(if both {
                    ClientError::BothShares(peer)
                } else {
                    ClientError::Repeated(peer)
                });
            }
            if !self.neighbours.contains(&peer) {
                return Err(ClientError::NoEdge(peer));
            }
            if !self.held.contains_key(&peer) {
                return Err(ClientError::NoShareHeld(peer));
            }
        }
        if request.dropped.contains(&self.id) {
            return Err(ClientError::OwnKey);
        }
        if request.survivors.len() < self.threshold {
            return Err(ClientError::TooFewSurvivors {
                survivors: request.survivors.len(),
                need: self.threshold,
            });
        }
        Ok(UnmaskResponse {
            seed_shares: request
                .survivors
                .iter()
                .map(|p| (*p, self.held[p].seed_share))
                .collect(),
            key_shares: request
                .dropped
                .iter()
                .map(|p| (*p, self.held[p].key_share))
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secagg::NumShares;
    use crate::secagg::wire::PeerKeys;
    use rand::SeedableRng;
    use rand_chacha::ChaCha20Rng;

    const IDS: [ClientId; 3] = [10, 20, 30];

    fn params() -> Params {
        Params::new(NumShares::All, 2)
    }

    fn advertised(rng: &mut ChaCha20Rng) -> (Vec<KeysAdvertised>, NeighbourKeys) {
        let (states, peers): (Vec<_>, Vec<_>) = IDS
            .iter()
            .map(|&id| {
                let (state, keys) = KeysAdvertised::start(id, &params(), rng).unwrap();
                (state, PeerKeys { id, keys })
            })
            .unzip();
        (states, NeighbourKeys { peers })
    }

    #[test]
    fn key_lists_are_checked() {
        let mut rng = ChaCha20Rng::seed_from_u64(1);
        let (mut states, keys) = advertised(&mut rng);
        let first = states.remove(0);
        let mut swapped = keys.clone();
        swapped.peers.swap(1, 2);
        assert!(matches!(
            first.check_key_list(&swapped),
            Err(ClientError::KeyListOrder(20))
        ));
        let others = NeighbourKeys {
            peers: keys.peers[1..].to_vec(),
        };
        assert_eq!(
            first.check_key_list(&others),
            Err(ClientError::OwnKeysMissing)
        );
        let alone = NeighbourKeys {
            peers: keys.peers[..1].to_vec(),
        };
        assert!(matches!(
            first.check_key_list(&alone),
            Err(ClientError::KeyListSize { got: 1, need: 2 })
        ));
        let mut copied = keys.clone();
        copied.peers[2].keys.mask_key = copied.peers[1].keys.mask_key;
        assert_eq!(first.check_key_list(&copied), Err(ClientError::WeakKey(30)));
        let mut low_order = keys.clone();
        low_order.peers[1].keys.mask_key = [0; 32];
        assert_eq!(
            first.check_key_list(&low_order),
            Err(ClientError::WeakKey(20))
        );
        assert_eq!(first.check_key_list(&keys), Ok(0));
    }

    /// Client 10's view after 20 sent an authentic but malformed share and
    /// 30 an honest one.
    fn after_malformed_share() -> Result<(InputSent, MaskedInput), ClientError> {
        let mut rng = ChaCha20Rng::seed_from_u64(2);
        let (states, keys) = advertised(&mut rng);
        let mut sent: Vec<(SharesSent, SealedShares)> = states
            .into_iter()
            .map(|s| s.share_keys(&keys, &mut rng).unwrap())
            .collect();
        let to_first = |sealed: &SealedShares| {
            sealed
                .entries
                .iter()
                .find(|(to, _)| *to == 10)
                .unwrap()
                .1
                .clone()
        };
        // 20 seals a plaintext that is not two shares, under the right key.
        let key = sent[0].0.peers[&20].1;
        let garbage = crypto::seal(&key, 20, 10, &[7; 40]);
        let routed = SealedShares {
            entries: vec![(20, garbage), (30, to_first(&sent[2].1))],
        };
        let first = sent.remove(0).0;
        first.collect_masked_input(&routed, 1.0, &[0.5; 4], &mut rng)
    }

    #[test]
    fn an_authentic_but_malformed_share_is_refused() {
        let (state, input) = after_malformed_share().unwrap();
        assert_eq!(input.rejected, vec![20]);
        assert_eq!(state.held.keys().copied().collect::<Vec<_>>(), vec![10, 30]);
        let ask =
            |survivors: Vec<ClientId>, dropped: Vec<ClientId>| UnmaskRequest { survivors, dropped };
        let fresh = || after_malformed_share().unwrap().0;
        assert_eq!(
            fresh().unmask(&ask(vec![10, 20], vec![])),
            Err(ClientError::NoShareHeld(20))
        );
        assert_eq!(
            fresh().unmask(&ask(vec![10, 30], vec![30])),
            Err(ClientError::BothShares(30))
        );
        assert_eq!(
            fresh().unmask(&ask(vec![10, 40], vec![])),
            Err(ClientError::NoEdge(40))
        );
        assert_eq!(
            fresh().unmask(&ask(vec![30], vec![10])),
            Err(ClientError::OwnKey)
        );
        assert_eq!(
            fresh().unmask(&ask(vec![30, 30], vec![])),
            Err(ClientError::Repeated(30))
        );
        assert_eq!(
            fresh().unmask(&ask(vec![10], vec![])),
            Err(ClientError::TooFewSurvivors {
                survivors: 1,
                need: 2
            })
        );
        let answer = fresh().unmask(&ask(vec![10, 30], vec![])).unwrap();
        let owners: Vec<ClientId> = answer.seed_shares.iter().map(|(id, _)| *id).collect();
        assert_eq!(owners, vec![10, 30]);
        assert!(answer.key_shares.is_empty());
    }
}
