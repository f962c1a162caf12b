//! Secure aggregation: the server learns the weighted sum of the clients'
//! updates and nothing about any one of them.
//!
//! This is SecAgg+ (Bell et al., CCS 2020), with SecAgg (Bonawitz et al.,
//! CCS 2017) as its special case on the complete graph, following Flower's
//! `SecAggPlusWorkflow` and `secaggplus_mod` in names and semantics. Only the
//! cryptographic core lives here; [`simulate_round`] runs a whole round in
//! one process (the simulation mode), and [`network`] gives each side of a
//! round over bytes, for network mode (the transport is the runtime's).
//!
//! ```
//! use cohort_core::secagg::{DropPoint, NumShares, Params, simulate_round};
//!
//! // SecAgg+ on a ring of 4 (each client, its two neighbours), threshold 2.
//! let params = Params::new(NumShares::Neighbours(3), 2);
//! let updates = [[0.5f32, -1.0], [1.5, 2.0], [-0.5, 0.0], [9.0, 9.0]];
//! let inputs: Vec<_> = (0..4u64).map(|i| (i, 10.0, &updates[i as usize][..])).collect();
//! // Client 3 sends its shares, then vanishes: the others' masks with it are removed.
//! let round = simulate_round(&params, &inputs, &[(3, DropPoint::AfterSharingKeys)], 42)?;
//! assert_eq!(round.contributors, [0, 1, 2]);
//! let mean = round.mean().unwrap();
//! assert!((mean[0] - 0.5).abs() < 1e-4 && (mean[1] - 1.0 / 3.0).abs() < 1e-4);
//! # Ok::<(), cohort_core::secagg::SecAggError>(())
//! ```
//!
//! # The protocol
//!
//! Every client `i` has neighbours `N(i)` in a seeded random
//! `k`-regular graph ([`graph`]). In four stages:
//!
//! 1. **Advertise keys**: `i` sends two fresh X25519 public keys, one for
//!    pairwise masks (`c_i`) and one for encrypting shares.
//! 2. **Share keys**: the server forwards to `i` its neighbours' keys; `i`
//!    draws a self-mask seed `b_i`, splits `b_i` and its mask secret key into
//!    `k` Shamir shares with threshold `t`, and sends each neighbour its pair
//!    of shares, encrypted with AES-256-GCM under a key agreed with it.
//! 3. **Masked input**: the server routes the encrypted shares; `i` sends
//!    `y_i = x_i + PRG(b_i) + Σ_{j∈N(i), j<i} PRG(s_ij) − Σ_{j∈N(i), j>i} PRG(s_ij)`
//!    mod `modulus_range`, where `x_i = [w_i, w_i·update_i]` quantised and
//!    `s_ij` is agreed from `c_i`, `c_j`. Pairwise masks cancel in the sum.
//! 4. **Unmask**: for each neighbour the server asks either for the share of
//!    `b_j` (`j` is in the sum) or of `j`'s mask key (`j` dropped after
//!    sharing keys), never both; from `t` shares it rebuilds each secret,
//!    removes the self masks and the dropped clients' pairwise masks, and
//!    dequantises.
//!
//! # Safety against hostile parties
//!
//! Every message is decoded with bounded counts ([`wire`]); every client
//! message the server cannot use is refused and its sender dropped
//! ([`server::PeerError`]), and the round aborts ([`SecAggError`]) only when
//! it cannot finish: fewer than `t` live clients around one that matters.
//! Shares are sealed with the sender and recipient ids as associated data.
//! An honest client refuses an unmask request that names a peer in both
//! lists, names a peer it has no edge to, or names fewer than `t` survivors;
//! with `t > k/2` a server that tells different clients different stories
//! cannot gather `t` shares of both secrets of one client.
//!
//! # Choices, and where this differs from Flower
//!
//! * Primitives: `x25519-dalek` (key agreement, with a check that the
//!   result is contributory, so low-order keys are refused), `aes-gcm` (the
//!   RustCrypto AEAD, already in the lock file through another dependency;
//!   Flower uses Fernet), `hkdf` + `sha2` for key derivation with a label and
//!   both ids, and AES-128-CTR (`aes` through `aes-gcm`, and `ctr`) as the
//!   mask PRG, keyed by the 32-byte seed's halves: hardware AES makes it
//!   6× ChaCha20 (`rand_chacha`, the first choice), 30× with VAES, and the
//!   masks were nearly all of the protocol's compute. Flower folds the seed to 32 bits and
//!   uses NumPy's Mersenne Twister, which a server could search; that is
//!   not mirrored.
//! * Shamir sharing is written here ([`shamir`]) over GF(2^61 − 1): the
//!   maintained crates either work byte-wise in GF(256) (`sharks`, its fork
//!   `blahaj`), which caps a secret at 255 shares, too few for SecAgg over
//!   the complete graph, or bring a generic elliptic-curve stack
//!   (`vsss-rs`) for what is forty lines of field arithmetic. Flower uses
//!   GF(2^128) in 16-byte chunks.
//! * `num_shares` and `reconstruction_threshold` are resolved counts
//!   (Flower also takes fractions of the sampled clients); the threshold
//!   may equal `num_shares` (Flower wants it strictly below) but must be more
//!   than half of it; `num_shares` must be odd (Flower adds one to an even
//!   value and warns).
//! * A weight above `max_weight` and a sum that could overflow the modulus
//!   (`clients · quantization_range ≥ modulus_range`) are refused; Flower
//!   warns and may return a wrong sum.
//! * The result is the weighted sum and the total weight, not their
//!   quotient, so a caller can combine rounds or add noise before dividing;
//!   [`Aggregate::mean`] gives FedAvg's mean.
//! * The server removes a dropped client's pairwise mask only from the
//!   inputs that carry it (Flower removes it for every neighbour), and checks
//!   every reconstructed secret: a mask key against the public key it was
//!   advertised with, a self-mask seed against a hash commitment sent with
//!   the masked input, so corrupt shares abort the round instead of
//!   corrupting the sum.
//! * A client that receives a share it cannot open reports the sender,
//!   which is then left out of the sum (see [`server`] for why it cannot be
//!   kept). This lets a malicious client knock an honest neighbour out of
//!   one round; it cannot learn anything by it.
//! * Distributed differential privacy is [`ddg`]: each client clips its
//!   change and adds its share of discrete Gaussian noise before masking
//!   (Kairouz, Liu, Steinke 2021), and masks the integers as they are
//!   ([`client::SharesSent::collect_masked_encoded`]); the server decodes
//!   the modular sum ([`server::ServerOutput::sum`]). Colluding clients can
//!   hand the server their noise shares, which lowers the noise protecting
//!   the others (docs/SECURITY.md).
//! * Not implemented: the consistency round of Bonawitz et al.'s
//!   malicious-server variant (clients signing the survivor set), and
//!   client authentication of the key advertisements (a real deployment
//!   binds them to an identity, e.g. the transport's TLS identity).

pub mod aes_ctr;
pub mod client;
pub mod crypto;
pub mod ddg;
pub mod federated;
pub mod graph;
pub mod network;
pub mod params;
pub mod quant;
pub mod server;
pub mod shamir;
pub mod sim;
pub mod wire;

/// A client's id in a round (Flower's node id).
pub type ClientId = u64;

pub use ddg::{Ddg, DdgAccountant, DdgError, DdgParams};
pub use federated::{
    DdgSeeds, SecureMean, SecureRoundError, ddg_masked_input, ddg_mean_of_sum, draw_dropouts,
    masked_change, masked_len, mean_error_bound, mean_of_sum, resolve_ddg, secure_ddg_mean,
    secure_mean,
};
pub use params::{NumShares, Params, ParamsError};
pub use server::{PeerError, SecAggError};
pub use sim::{Aggregate, DropPoint, simulate_encoded_round, simulate_round, simulate_round_with};

#[cfg(test)]
mod tests;
