//! The primitives: X25519 key agreement, HKDF-SHA256 key derivation,
//! AES-256-GCM for the shares in transit, and the AES-128 counter-mode
//! stream that expands a 32-byte seed into a mask.
//!
//! Every derivation carries a label and the ids it belongs to, so a key
//! derived for one purpose or one pair of clients is never valid for another.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use hkdf::Hkdf;
use rand::RngCore;
use sha2::{Digest, Sha256};
use x25519_dalek::{PublicKey, StaticSecret};

use super::ClientId;

const LABEL: &[u8] = b"cohort/secagg/v1";

/// An X25519 key pair; the secret is zeroised on drop.
pub struct KeyPair {
    pub secret: StaticSecret,
    pub public: [u8; 32],
}

impl KeyPair {
    /// A fresh key pair from `rng` (32 random bytes, clamped by X25519).
    pub fn generate(rng: &mut impl RngCore) -> KeyPair {
        let mut bytes = [0u8; 32];
        rng.fill_bytes(&mut bytes);
        KeyPair::from_secret(bytes)
    }

    /// The key pair of a secret's bytes (as reconstructed from shares).
    pub fn from_secret(bytes: [u8; 32]) -> KeyPair {
        let secret = StaticSecret::from(bytes);
        let public = PublicKey::from(&secret).to_bytes();
        KeyPair { secret, public }
    }
}

/// The X25519 shared secret with `peer`, or `None` when it is not
/// contributory (the peer's key is a low-order point, so the "secret" would
/// be known to anyone): such a peer is treated as hostile.
pub fn agree(secret: &StaticSecret, peer: &[u8; 32]) -> Option<[u8; 32]> {
    let shared = secret.diffie_hellman(&PublicKey::from(*peer));
    shared.was_contributory().then(|| shared.to_bytes())
}

fn derive(shared: &[u8; 32], purpose: &[u8], a: ClientId, b: ClientId) -> [u8; 32] {
    let mut info = Vec::with_capacity(purpose.len() + 16);
    info.extend_from_slice(purpose);
    info.extend_from_slice(&a.to_le_bytes());
    info.extend_from_slice(&b.to_le_bytes());
    let mut out = [0u8; 32];
    Hkdf::<Sha256>::new(Some(LABEL), shared)
        .expand(&info, &mut out)
        .expect("32 bytes is a valid HKDF-SHA256 length");
    out
}

/// The seed of the pairwise mask of two clients, the same from either side.
pub fn pairwise_seed(shared: &[u8; 32], a: ClientId, b: ClientId) -> [u8; 32] {
    derive(shared, b"pairwise-mask", a.min(b), a.max(b))
}

/// The key that encrypts the shares `sender` sends `recipient`: one key per
/// direction, each encrypting exactly one message per round, which is why a
/// fixed nonce is safe (the key pairs are fresh every round).
pub fn share_key(shared: &[u8; 32], sender: ClientId, recipient: ClientId) -> [u8; 32] {
    derive(shared, b"share-encryption", sender, recipient)
}

fn associated_data(sender: ClientId, recipient: ClientId) -> [u8; 32] {
    let mut aad = [0u8; 32];
    aad[..16].copy_from_slice(LABEL);
    aad[16..24].copy_from_slice(&sender.to_le_bytes());
    aad[24..].copy_from_slice(&recipient.to_le_bytes());
    aad
}

/// Encrypts `plaintext` from `sender` to `recipient`; the ids are bound as
/// associated data, so the ciphertext opens only for that pair.
pub fn seal(key: &[u8; 32], sender: ClientId, recipient: ClientId, plaintext: &[u8]) -> Vec<u8> {
    let aad = associated_data(sender, recipient);
    Aes256Gcm::new(key.into())
        .encrypt(
            Nonce::from_slice(&[0; 12]),
            Payload {
                msg: plaintext,
                aad: &aad,
            },
        )
        .expect("AES-GCM encrypts any message this small")
}

/// Decrypts a ciphertext claimed to come from `sender` for `recipient`;
/// `None` if it was tampered with, or sealed for another pair or key.
pub fn open(
    key: &[u8; 32],
    sender: ClientId,
    recipient: ClientId,
    ciphertext: &[u8],
) -> Option<Vec<u8>> {
    let aad = associated_data(sender, recipient);
    Aes256Gcm::new(key.into())
        .decrypt(
            Nonce::from_slice(&[0; 12]),
            Payload {
                msg: ciphertext,
                aad: &aad,
            },
        )
        .ok()
}

/// A commitment to a self-mask seed, sent with the masked input so the
/// server can tell a seed reconstructed from corrupt shares from the real
/// one. The seed is 32 uniform bytes, so the hash reveals nothing of it.
pub fn seed_commitment(seed: &[u8; 32]) -> [u8; 32] {
    let mut hash = Sha256::new();
    hash.update(LABEL);
    hash.update(b"self-mask-commitment");
    hash.update(seed);
    hash.finalize().into()
}

/// Whether a mask is added to or subtracted from a vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sign {
    Add,
    Subtract,
}

/// The keystream a mask seed expands to: AES-128 in counter mode (NIST SP
/// 800-38A, a 128-bit big-endian counter), keyed by the seed's first half
/// and counting from its second half. A seed is 32 bytes of an X25519
/// agreement or of the client's own stream, which holds 128 bits of
/// security, what AES-128 keeps; AES rather than ChaCha20 because x86-64
/// and ARMv8 both compute it in hardware: 9.3 GB/s against ChaCha20's
/// 1.4 GB/s on one core here with AES-NI, 42 with VAES ([`aes_ctr`]),
/// and masks are nearly all of a client's work.
///
/// [`aes_ctr`]: super::aes_ctr
pub fn mask_stream(seed: &[u8; 32]) -> MaskStream {
    MaskStream::new(seed)
}

/// The stream cipher of [`mask_stream`].
pub use super::aes_ctr::AesCtr as MaskStream;

/// Entries of a vector masked per pass over the masks: 4 KiB of values and
/// 4 KiB of keystream, which stay in the first-level cache.
pub const MASK_BLOCK: usize = 1024;

/// The next `count` 32-bit words of `stream` (at most [`MASK_BLOCK`]), each
/// four little-endian bytes of it, with `bytes` as their buffer.
pub fn next_words<'a>(
    stream: &mut MaskStream,
    bytes: &'a mut [u8; MASK_BLOCK * 4],
    count: usize,
) -> impl Iterator<Item = u32> + 'a {
    let bytes = &mut bytes[..count * 4];
    stream.fill(bytes);
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
}

/// Adds (or subtracts) the mask that `seed` expands to, entry by entry,
/// modulo `2^bits` where `modulus_mask = 2^bits - 1`. Arithmetic wraps
/// modulo 2^32, which `2^bits` divides, so reducing once at the end is exact.
pub fn apply_mask(values: &mut [u32], seed: &[u8; 32], sign: Sign, modulus_mask: u32) {
    apply_masks(values, &[(*seed, sign)], modulus_mask);
}

/// [`apply_mask`] for every `(seed, sign)` of `masks`, in one pass over
/// `values`: each block of entries takes its part of every mask while it is
/// in cache, rather than the whole vector streaming through memory once a
/// mask. The result does not depend on the masks' order.
pub fn apply_masks(values: &mut [u32], masks: &[([u8; 32], Sign)], modulus_mask: u32) {
    let mut streams: Vec<(MaskStream, Sign)> = masks
        .iter()
        .map(|(seed, sign)| (mask_stream(seed), *sign))
        .collect();
    let mut bytes = [0u8; MASK_BLOCK * 4];
    for chunk in values.chunks_mut(MASK_BLOCK) {
        for (stream, sign) in &mut streams {
            let masks = next_words(stream, &mut bytes, chunk.len()).map(|m| m & modulus_mask);
            match sign {
                Sign::Add => chunk
                    .iter_mut()
                    .zip(masks)
                    .for_each(|(v, m)| *v = v.wrapping_add(m)),
                Sign::Subtract => chunk
                    .iter_mut()
                    .zip(masks)
                    .for_each(|(v, m)| *v = v.wrapping_sub(m)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha20Rng;

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The stream is standard AES-128-CTR, so a client in another language
    /// can compute the same masks: NIST SP 800-38A, F.5.1, its key and
    /// initial counter block as the seed, the keystream as plaintext XOR
    /// ciphertext of its four blocks, read as little-endian words.
    #[test]
    fn masks_are_nist_aes_128_ctr_keystream() {
        let seed: [u8; 32] =
            hex("2b7e151628aed2a6abf7158809cf4f3cf0f1f2f3f4f5f6f7f8f9fafbfcfdfeff")
                .try_into()
                .unwrap();
        let plain = hex(concat!(
            "6bc1bee22e409f96e93d7e117393172aae2d8a571e03ac9c9eb76fac45af8e51",
            "30c81c46a35ce411e5fbc1191a0a52eff69f2445df4f9b17ad2b417be66c3710"
        ));
        let cipher = hex(concat!(
            "874d6191b620e3261bef6864990db6ce9806f66b7970fdff8617187bb9fffdff",
            "5ae4df3edbd5d35e5b4f09020db03eab1e031dda2fbe03d1792170a0f3009cee"
        ));
        let expected: Vec<u32> = plain
            .iter()
            .zip(&cipher)
            .map(|(p, c)| p ^ c)
            .collect::<Vec<u8>>()
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        let mut values = vec![0u32; 16];
        apply_mask(&mut values, &seed, Sign::Add, u32::MAX);
        assert_eq!(values, expected);

        // Past the first block of entries the stream goes on, unbroken.
        let len = 2 * MASK_BLOCK + 5;
        let mut whole = vec![0u8; len * 4];
        MaskStream::portable(&seed).fill(&mut whole);
        let mut values = vec![0u32; len];
        apply_mask(&mut values, &seed, Sign::Add, u32::MAX);
        let words: Vec<u32> = whole
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        assert_eq!(values, words);
    }

    #[test]
    fn agreement_is_symmetric_and_refuses_low_order_points() {
        let mut rng = ChaCha20Rng::seed_from_u64(3);
        let (a, b) = (KeyPair::generate(&mut rng), KeyPair::generate(&mut rng));
        let ab = agree(&a.secret, &b.public).unwrap();
        assert_eq!(Some(ab), agree(&b.secret, &a.public));
        assert_eq!(pairwise_seed(&ab, 1, 2), pairwise_seed(&ab, 2, 1));
        assert_ne!(share_key(&ab, 1, 2), share_key(&ab, 2, 1));
        assert_eq!(agree(&a.secret, &[0; 32]), None);
        let again = KeyPair::from_secret(a.secret.to_bytes());
        assert_eq!(again.public, a.public);
    }

    #[test]
    fn ciphertexts_open_only_for_their_pair() {
        let key = [9u8; 32];
        let sealed = seal(&key, 1, 2, b"share");
        assert_eq!(open(&key, 1, 2, &sealed).as_deref(), Some(&b"share"[..]));
        assert_eq!(open(&key, 3, 2, &sealed), None);
        assert_eq!(open(&key, 1, 3, &sealed), None);
        assert_eq!(open(&[8; 32], 1, 2, &sealed), None);
        let mut flipped = sealed.clone();
        flipped[0] ^= 1;
        assert_eq!(open(&key, 1, 2, &flipped), None);
        assert_eq!(open(&key, 1, 2, &sealed[..3]), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Pairwise masks added by one side and subtracted by the other,
        /// plus a self mask added and then removed, cancel exactly.
        #[test]
        fn masks_cancel_modulo_the_modulus(
            values in proptest::collection::vec(any::<u32>(), 0..3000),
            bits in 1u32..=32,
            seed_a in proptest::array::uniform32(any::<u8>()),
            seed_b in proptest::array::uniform32(any::<u8>()),
        ) {
            let modulus_mask = if bits == 32 { u32::MAX } else { (1u32 << bits) - 1 };
            let reduced: Vec<u32> = values.iter().map(|v| v & modulus_mask).collect();
            let mut masked = reduced.clone();
            apply_mask(&mut masked, &seed_a, Sign::Add, modulus_mask);
            apply_mask(&mut masked, &seed_b, Sign::Add, modulus_mask);
            if values.len() > 8 && bits >= 16 {
                prop_assert_ne!(&masked, &reduced);
            }
            apply_mask(&mut masked, &seed_a, Sign::Subtract, modulus_mask);
            apply_mask(&mut masked, &seed_b, Sign::Subtract, modulus_mask);
            let unmasked: Vec<u32> = masked.iter().map(|v| v & modulus_mask).collect();
            prop_assert_eq!(unmasked, reduced);
        }

        /// Masks applied in one pass equal the same masks applied one at a
        /// time, whatever their number, signs and the vector's length
        /// against the block size.
        #[test]
        fn masks_in_one_pass_equal_masks_one_at_a_time(
            values in proptest::collection::vec(any::<u32>(), 0..3 * MASK_BLOCK + 7),
            masks in proptest::collection::vec(
                (proptest::array::uniform32(any::<u8>()), any::<bool>()), 0..5),
            bits in 1u32..=32,
        ) {
            let modulus_mask = if bits == 32 { u32::MAX } else { (1u32 << bits) - 1 };
            let masks: Vec<([u8; 32], Sign)> = masks
                .into_iter()
                .map(|(seed, add)| (seed, if add { Sign::Add } else { Sign::Subtract }))
                .collect();
            let mut one_pass = values.clone();
            apply_masks(&mut one_pass, &masks, modulus_mask);
            let mut one_at_a_time = values;
            for (seed, sign) in &masks {
                apply_mask(&mut one_at_a_time, seed, *sign, modulus_mask);
            }
            prop_assert_eq!(one_pass, one_at_a_time);
        }
    }
}
