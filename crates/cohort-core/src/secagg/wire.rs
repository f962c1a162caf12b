//! The messages of the protocol and their byte encoding.
//!
//! Each message is a tag byte, then fixed-width little-endian fields, with a
//! `u32` count before every list. Decoding treats the bytes as hostile: every
//! count is checked against a [`Limits`] bound and against the bytes left
//! before anything is allocated, and trailing bytes are an error. The same
//! encoding gives the byte counts the simulation reports.

use super::shamir::{SHARE_LEN, ShamirError, Share};
use super::{ClientId, NumShares, Params};

/// The most bytes one sealed share may have (it is 104 when honest).
pub const MAX_CIPHERTEXT: usize = 256;

/// Bounds for decoding: how many peers a list may name and how long a
/// masked vector may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_peers: usize,
    pub max_values: usize,
}

/// Why bytes are not a valid message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("message ends after {remaining} bytes where {needed} more were expected")]
    Truncated { needed: usize, remaining: usize },
    #[error("message tag {got}; expected {expected}")]
    Tag { got: u8, expected: u8 },
    #[error("{what}: {count} entries; expected at most {max}")]
    TooMany {
        what: &'static str,
        count: usize,
        max: usize,
    },
    #[error("{0} bytes after the end of the message; expected none")]
    Trailing(usize),
    #[error("malformed share: {0}")]
    Share(#[from] ShamirError),
}

/// Appends fields to a message.
#[derive(Default)]
pub struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.0.extend_from_slice(v);
    }
    fn count(&mut self, n: usize) {
        // Every list is bounded far below 2^32 by the limits above.
        self.u32(u32::try_from(n).expect("list length fits in u32"));
    }
}

/// Reads fields from hostile bytes.
pub struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.0.len() {
            return Err(WireError::Truncated {
                needed: n,
                remaining: self.0.len(),
            });
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        Ok(self.take(N)?.try_into().expect("took N bytes"))
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn tag(&mut self, expected: u8) -> Result<(), WireError> {
        match self.u8()? {
            got if got == expected => Ok(()),
            got => Err(WireError::Tag { got, expected }),
        }
    }
    /// A list count, at most `max` and no more than the bytes left allow at
    /// `min_entry` bytes per entry, so no allocation is larger than the input.
    fn count(
        &mut self,
        what: &'static str,
        max: usize,
        min_entry: usize,
    ) -> Result<usize, WireError> {
        let count = self.u32()? as usize;
        let fits = self.0.len() / min_entry.max(1);
        if count > max || count > fits {
            return Err(WireError::TooMany {
                what,
                count,
                max: max.min(fits),
            });
        }
        Ok(count)
    }
    fn share(&mut self) -> Result<Share, WireError> {
        Ok(Share::from_bytes(&self.array::<SHARE_LEN>()?)?)
    }
    fn ids(&mut self, what: &'static str, max: usize) -> Result<Vec<ClientId>, WireError> {
        let n = self.count(what, max, 8)?;
        (0..n).map(|_| self.u64()).collect()
    }
}

/// A message with a byte encoding.
pub trait Message: Sized {
    /// Appends the message's fields.
    fn write(&self, w: &mut Writer);
    /// Reads the message's fields within `limits`.
    fn read(r: &mut Reader<'_>, limits: &Limits) -> Result<Self, WireError>;

    /// The encoded message.
    fn to_bytes(&self) -> Vec<u8> {
        let mut w = Writer::default();
        self.write(&mut w);
        w.0
    }

    /// Decodes a whole message; bytes left over are an error.
    fn from_bytes(bytes: &[u8], limits: &Limits) -> Result<Self, WireError> {
        let mut r = Reader(bytes);
        let message = Self::read(&mut r, limits)?;
        match r.0.len() {
            0 => Ok(message),
            n => Err(WireError::Trailing(n)),
        }
    }
}

/// Stage 1, client → server: the two public keys, one for the pairwise
/// masks and one for encrypting shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyAdvertisement {
    pub mask_key: [u8; 32],
    pub encryption_key: [u8; 32],
}

/// One client's advertised keys, as the server forwards them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerKeys {
    pub id: ClientId,
    pub keys: KeyAdvertisement,
}

/// Stage 2, server → client: the keys of the client's neighbours that
/// advertised, itself included, sorted by id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeighbourKeys {
    pub peers: Vec<PeerKeys>,
}

/// Stage 2 up (client → server, `peer` = recipient) and stage 3 down
/// (server → client, `peer` = sender): shares sealed for one peer each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedShares {
    pub entries: Vec<(ClientId, Vec<u8>)>,
}

/// Stage 3, client → server: the masked vector, the peers whose shares the
/// client refused (it applied no pairwise mask with them), and a commitment
/// to its self-mask seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskedInput {
    pub rejected: Vec<ClientId>,
    pub seed_commitment: [u8; 32],
    pub values: Vec<u32>,
}

/// Stage 4, server → client: whose self-mask-seed shares (`survivors`) and
/// whose mask-key shares (`dropped`) the server asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnmaskRequest {
    pub survivors: Vec<ClientId>,
    pub dropped: Vec<ClientId>,
}

/// Stage 4, client → server: the requested shares, by owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnmaskResponse {
    pub seed_shares: Vec<(ClientId, Share)>,
    pub key_shares: Vec<(ClientId, Share)>,
}

/// Stage 0 (network mode), server → client: the round's parameters, how
/// many clients it starts with and the model's length. The client checks
/// them against its own config before it makes any key.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    pub params: Params,
    pub clients: u32,
    pub dimension: u64,
}

/// Inside a sealed share: the sender's self-mask-seed share and mask-key
/// share for the recipient. The ids are bound by the encryption instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharePlaintext {
    pub seed_share: Share,
    pub key_share: Share,
}

impl Message for KeyAdvertisement {
    fn write(&self, w: &mut Writer) {
        w.u8(1);
        w.bytes(&self.mask_key);
        w.bytes(&self.encryption_key);
    }
    fn read(r: &mut Reader<'_>, _: &Limits) -> Result<Self, WireError> {
        r.tag(1)?;
        Ok(KeyAdvertisement {
            mask_key: r.array()?,
            encryption_key: r.array()?,
        })
    }
}

impl Message for NeighbourKeys {
    fn write(&self, w: &mut Writer) {
        w.u8(2);
        w.count(self.peers.len());
        for peer in &self.peers {
            w.u64(peer.id);
            w.bytes(&peer.keys.mask_key);
            w.bytes(&peer.keys.encryption_key);
        }
    }
    fn read(r: &mut Reader<'_>, limits: &Limits) -> Result<Self, WireError> {
        r.tag(2)?;
        let n = r.count("neighbour keys", limits.max_peers, 72)?;
        let peers = (0..n)
            .map(|_| {
                let id = r.u64()?;
                let keys = KeyAdvertisement {
                    mask_key: r.array()?,
                    encryption_key: r.array()?,
                };
                Ok(PeerKeys { id, keys })
            })
            .collect::<Result<_, WireError>>()?;
        Ok(NeighbourKeys { peers })
    }
}

impl Message for SealedShares {
    fn write(&self, w: &mut Writer) {
        w.u8(3);
        w.count(self.entries.len());
        for (peer, sealed) in &self.entries {
            w.u64(*peer);
            w.count(sealed.len());
            w.bytes(sealed);
        }
    }
    fn read(r: &mut Reader<'_>, limits: &Limits) -> Result<Self, WireError> {
        r.tag(3)?;
        let n = r.count("sealed shares", limits.max_peers, 12)?;
        let entries = (0..n)
            .map(|_| {
                let peer = r.u64()?;
                let len = r.count("sealed share bytes", MAX_CIPHERTEXT, 1)?;
                Ok((peer, r.take(len)?.to_vec()))
            })
            .collect::<Result<_, WireError>>()?;
        Ok(SealedShares { entries })
    }
}

impl Message for MaskedInput {
    fn write(&self, w: &mut Writer) {
        w.u8(4);
        w.count(self.rejected.len());
        self.rejected.iter().for_each(|&id| w.u64(id));
        w.bytes(&self.seed_commitment);
        w.count(self.values.len());
        self.values.iter().for_each(|&v| w.u32(v));
    }
    fn read(r: &mut Reader<'_>, limits: &Limits) -> Result<Self, WireError> {
        r.tag(4)?;
        let rejected = r.ids("rejected peers", limits.max_peers)?;
        let seed_commitment = r.array()?;
        let n = r.count("masked values", limits.max_values, 4)?;
        let values = (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?;
        Ok(MaskedInput {
            rejected,
            seed_commitment,
            values,
        })
    }
}

impl Message for UnmaskRequest {
    fn write(&self, w: &mut Writer) {
        w.u8(5);
        for list in [&self.survivors, &self.dropped] {
            w.count(list.len());
            list.iter().for_each(|&id| w.u64(id));
        }
    }
    fn read(r: &mut Reader<'_>, limits: &Limits) -> Result<Self, WireError> {
        r.tag(5)?;
        Ok(UnmaskRequest {
            survivors: r.ids("survivors", limits.max_peers)?,
            dropped: r.ids("dropped", limits.max_peers)?,
        })
    }
}

impl Message for UnmaskResponse {
    fn write(&self, w: &mut Writer) {
        w.u8(6);
        for list in [&self.seed_shares, &self.key_shares] {
            w.count(list.len());
            for (owner, share) in list {
                w.u64(*owner);
                w.bytes(&share.to_bytes());
            }
        }
    }
    fn read(r: &mut Reader<'_>, limits: &Limits) -> Result<Self, WireError> {
        r.tag(6)?;
        let mut lists = [Vec::new(), Vec::new()];
        for (list, what) in lists.iter_mut().zip(["seed shares", "key shares"]) {
            let n = r.count(what, limits.max_peers, 8 + SHARE_LEN)?;
            *list = (0..n)
                .map(|_| Ok((r.u64()?, r.share()?)))
                .collect::<Result<_, WireError>>()?;
        }
        let [seed_shares, key_shares] = lists;
        Ok(UnmaskResponse {
            seed_shares,
            key_shares,
        })
    }
}

impl Message for Setup {
    fn write(&self, w: &mut Writer) {
        w.u8(8);
        let p = &self.params;
        // 0 stands for the complete graph (SecAgg); a count is SecAgg+'s k.
        let k = match p.num_shares {
            NumShares::All => 0,
            NumShares::Neighbours(k) => u32::try_from(k).unwrap_or(u32::MAX),
        };
        w.u32(k);
        w.u32(u32::try_from(p.reconstruction_threshold).unwrap_or(u32::MAX));
        w.u64(p.max_weight.to_bits());
        w.u64(p.clipping_range.to_bits());
        w.u64(p.quantization_range);
        w.u64(p.modulus_range);
        w.u32(self.clients);
        w.u64(self.dimension);
    }
    fn read(r: &mut Reader<'_>, _: &Limits) -> Result<Self, WireError> {
        r.tag(8)?;
        let num_shares = match r.u32()? {
            0 => NumShares::All,
            k => NumShares::Neighbours(k as usize),
        };
        let params = Params {
            num_shares,
            reconstruction_threshold: r.u32()? as usize,
            max_weight: f64::from_bits(r.u64()?),
            clipping_range: f64::from_bits(r.u64()?),
            quantization_range: r.u64()?,
            modulus_range: r.u64()?,
        };
        Ok(Setup {
            params,
            clients: r.u32()?,
            dimension: r.u64()?,
        })
    }
}

impl Message for SharePlaintext {
    fn write(&self, w: &mut Writer) {
        w.u8(7);
        w.bytes(&self.seed_share.to_bytes());
        w.bytes(&self.key_share.to_bytes());
    }
    fn read(r: &mut Reader<'_>, _: &Limits) -> Result<Self, WireError> {
        r.tag(7)?;
        Ok(SharePlaintext {
            seed_share: r.share()?,
            key_share: r.share()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIMITS: Limits = Limits {
        max_peers: 8,
        max_values: 16,
    };

    fn share(x: u32) -> Share {
        Share {
            x,
            y: [x as u64; 5],
        }
    }

    #[test]
    fn messages_round_trip() {
        let keys = KeyAdvertisement {
            mask_key: [1; 32],
            encryption_key: [2; 32],
        };
        let input = MaskedInput {
            rejected: vec![3],
            seed_commitment: [4; 32],
            values: vec![5, 6, 7],
        };
        let response = UnmaskResponse {
            seed_shares: vec![(1, share(1))],
            key_shares: vec![(2, share(2)), (3, share(3))],
        };
        let sealed = SealedShares {
            entries: vec![(9, vec![1, 2, 3])],
        };
        assert_eq!(
            KeyAdvertisement::from_bytes(&keys.to_bytes(), &LIMITS),
            Ok(keys)
        );
        assert_eq!(
            MaskedInput::from_bytes(&input.to_bytes(), &LIMITS),
            Ok(input)
        );
        assert_eq!(
            UnmaskResponse::from_bytes(&response.to_bytes(), &LIMITS),
            Ok(response)
        );
        assert_eq!(
            SealedShares::from_bytes(&sealed.to_bytes(), &LIMITS),
            Ok(sealed)
        );
    }

    #[test]
    fn hostile_bytes_are_refused() {
        let input = MaskedInput {
            rejected: vec![],
            seed_commitment: [0; 32],
            values: vec![0; 17],
        };
        assert!(matches!(
            MaskedInput::from_bytes(&input.to_bytes(), &LIMITS),
            Err(WireError::TooMany { count: 17, .. })
        ));
        // A count of 2^32 - 1 with nothing behind it allocates nothing.
        let mut huge = vec![5];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            UnmaskRequest::from_bytes(&huge, &LIMITS),
            Err(WireError::TooMany { .. })
        ));
        let mut trailing = UnmaskRequest {
            survivors: vec![1],
            dropped: vec![],
        }
        .to_bytes();
        trailing.push(0);
        assert_eq!(
            UnmaskRequest::from_bytes(&trailing, &LIMITS),
            Err(WireError::Trailing(1))
        );
        assert!(matches!(
            KeyAdvertisement::from_bytes(&[2; 65], &LIMITS),
            Err(WireError::Tag {
                got: 2,
                expected: 1
            })
        ));
    }

    fn setup_of(k: u32, t: u32, weight: f64, clients: u32, dimension: u64) -> Setup {
        let num_shares = match k {
            0 => NumShares::All,
            k => NumShares::Neighbours(k as usize),
        };
        Setup {
            params: Params {
                max_weight: weight,
                ..Params::new(num_shares, t as usize)
            },
            clients,
            dimension,
        }
    }

    #[test]
    fn a_setup_is_its_fixed_width_fields() {
        let setup = setup_of(5, 3, 100.0, 8, 61_706);
        let bytes = setup.to_bytes();
        assert_eq!(bytes.len(), 1 + 4 + 4 + 8 * 4 + 4 + 8);
        assert_eq!(bytes[0], 8);
        assert_eq!(Setup::from_bytes(&bytes, &LIMITS), Ok(setup));
        assert!(matches!(
            Setup::from_bytes(&bytes[..20], &LIMITS),
            Err(WireError::Truncated { .. })
        ));
    }

    proptest! {
        /// Every setup, NaN weights and absurd counts included, comes back
        /// as it was sent: the client, not the decoder, judges the values.
        #[test]
        fn setups_round_trip(
            k in any::<u32>(),
            t in any::<u32>(),
            weight_bits in any::<u64>(),
            clients in any::<u32>(),
            dimension in any::<u64>(),
        ) {
            let setup = setup_of(k, t, f64::from_bits(weight_bits), clients, dimension);
            let back = Setup::from_bytes(&setup.to_bytes(), &LIMITS).unwrap();
            prop_assert_eq!(back.params.max_weight.to_bits(), weight_bits);
            prop_assert_eq!(back.to_bytes(), setup.to_bytes());
        }

        /// Every message a client sends comes back from its bytes unchanged.
        #[test]
        fn client_messages_round_trip(
            ids in proptest::collection::vec(any::<u64>(), 0..8),
            values in proptest::collection::vec(any::<u32>(), 0..16),
            sealed in proptest::collection::vec(any::<u8>(), 0..MAX_CIPHERTEXT),
            commitment in any::<[u8; 32]>(),
        ) {
            let input = MaskedInput { rejected: ids.clone(), seed_commitment: commitment, values };
            prop_assert_eq!(MaskedInput::from_bytes(&input.to_bytes(), &LIMITS), Ok(input));
            let shares = SealedShares { entries: ids.iter().map(|&id| (id, sealed.clone())).collect() };
            prop_assert_eq!(SealedShares::from_bytes(&shares.to_bytes(), &LIMITS), Ok(shares));
            let request = UnmaskRequest { survivors: ids.clone(), dropped: ids };
            prop_assert_eq!(UnmaskRequest::from_bytes(&request.to_bytes(), &LIMITS), Ok(request));
        }

        /// No byte string makes decoding panic.
        #[test]
        fn decoding_never_panics(body in proptest::collection::vec(any::<u8>(), 0..400)) {
            // Behind the right tag, so decoding goes past the first byte.
            let with = |tag: u8| [&[tag][..], &body].concat();
            let _ = NeighbourKeys::from_bytes(&with(2), &LIMITS);
            let _ = SealedShares::from_bytes(&with(3), &LIMITS);
            let _ = MaskedInput::from_bytes(&with(4), &LIMITS);
            let _ = UnmaskRequest::from_bytes(&with(5), &LIMITS);
            let _ = UnmaskResponse::from_bytes(&with(6), &LIMITS);
            let _ = SharePlaintext::from_bytes(&with(7), &LIMITS);
            let _ = Setup::from_bytes(&with(8), &LIMITS);
        }
    }
}
