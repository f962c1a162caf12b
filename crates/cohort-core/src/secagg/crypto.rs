//! The primitives: X25519 key agreement, HKDF-SHA256 key derivation,
//! AES-256-GCM for the shares in transit, and the ChaCha20 stream that
//! expands a 32-byte seed into a mask.
//!
//! Every derivation carries a label and the ids it belongs to, so a key
//! derived for one purpose or one pair of clients is never valid for another.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use hkdf::Hkdf;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
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

/// Adds (or subtracts) the mask that `seed` expands to, entry by entry,
/// modulo `2^bits` where `modulus_mask = 2^bits - 1`. Arithmetic wraps
/// modulo 2^32, which `2^bits` divides, so reducing once at the end is exact.
pub fn apply_mask(values: &mut [u32], seed: &[u8; 32], sign: Sign, modulus_mask: u32) {
    let mut rng = ChaCha20Rng::from_seed(*seed);
    let mut block = [0u32; 1024];
    for chunk in values.chunks_mut(block.len()) {
        let mask = &mut block[..chunk.len()];
        rng.fill(mask);
        for (v, &m) in chunk.iter_mut().zip(mask.iter()) {
            let m = m & modulus_mask;
            *v = match sign {
                Sign::Add => v.wrapping_add(m),
                Sign::Subtract => v.wrapping_sub(m),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
    }
}
