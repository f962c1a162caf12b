//! Shamir secret sharing of 32-byte secrets over the prime field GF(2^61 − 1).
//!
//! A secret is cut into five 7-byte chunks (the last has 4 bytes), each below
//! 2^56 and so an element of the field; each chunk is shared with its own
//! random polynomial of degree `t - 1`, all evaluated at the same points. A
//! share is its point `x` (1-based, distinct) and the five evaluations.
//!
//! Why this field: 2^61 − 1 is a Mersenne prime, so reduction after a
//! 64×64-bit product is two shifts and an add, with no big-integer code; and
//! it has room for any number of shares this protocol will ever use (the
//! byte-wise GF(256) schemes of `sharks`/`blahaj` stop at 255 shares, which a
//! SecAgg round over the complete graph can exceed).
//!
//! Reconstruction from fewer than `t` shares is refused; a set of `t` shares
//! that is not consistent usually interpolates to a chunk above 2^56, which
//! is reported as [`ShamirError::Garbage`] rather than returned.

use rand::RngCore;

/// The field's prime, 2^61 − 1.
pub const PRIME: u64 = (1 << 61) - 1;
/// The length of every shared secret.
pub const SECRET_LEN: usize = 32;
/// The most shares of one secret (the `x` points run from 1 to this).
pub const MAX_SHARES: usize = 1 << 16;
const CHUNK_BYTES: usize = 7;
const CHUNKS: usize = SECRET_LEN.div_ceil(CHUNK_BYTES);
/// The encoded length of a [`Share`]: its point as `u32`, then five `u64`.
pub const SHARE_LEN: usize = 4 + 8 * CHUNKS;

/// One share of a 32-byte secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// The evaluation point, 1 ..= [`MAX_SHARES`].
    pub x: u32,
    /// The evaluations of the five chunk polynomials at `x`, each below [`PRIME`].
    pub y: [u64; CHUNKS],
}

/// Why a split or reconstruction failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShamirError {
    #[error(
        "threshold {threshold} with {count} shares; expected 1 <= threshold <= count <= {MAX_SHARES}"
    )]
    Counts { threshold: usize, count: usize },
    #[error("{got} shares; expected at least the threshold {need}")]
    TooFew { got: usize, need: usize },
    #[error("share point {0}; expected 1..={MAX_SHARES} and no two shares at the same point")]
    BadPoint(u32),
    #[error("share value {0:#x}; expected a field element below 2^61 - 1")]
    BadValue(u64),
    #[error(
        "the shares interpolate to a value that is no secret (chunk {chunk} is {value:#x}); they are inconsistent or too few"
    )]
    Garbage { chunk: usize, value: u64 },
}

impl Share {
    /// The fixed-length little-endian encoding.
    pub fn to_bytes(&self) -> [u8; SHARE_LEN] {
        let mut out = [0u8; SHARE_LEN];
        out[..4].copy_from_slice(&self.x.to_le_bytes());
        for (i, y) in self.y.iter().enumerate() {
            out[4 + 8 * i..12 + 8 * i].copy_from_slice(&y.to_le_bytes());
        }
        out
    }

    /// Decodes and range-checks a share received from another party.
    pub fn from_bytes(bytes: &[u8; SHARE_LEN]) -> Result<Share, ShamirError> {
        let x = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
        if x == 0 || x as usize > MAX_SHARES {
            return Err(ShamirError::BadPoint(x));
        }
        let mut y = [0u64; CHUNKS];
        for (i, slot) in y.iter_mut().enumerate() {
            let v = u64::from_le_bytes(bytes[4 + 8 * i..12 + 8 * i].try_into().expect("8 bytes"));
            if v >= PRIME {
                return Err(ShamirError::BadValue(v));
            }
            *slot = v;
        }
        Ok(Share { x, y })
    }
}

/// Splits `secret` into `count` shares at points 1..=count, any `threshold`
/// of which reconstruct it.
pub fn split(
    secret: &[u8; SECRET_LEN],
    threshold: usize,
    count: usize,
    rng: &mut impl RngCore,
) -> Result<Vec<Share>, ShamirError> {
    if threshold == 0 || threshold > count || count > MAX_SHARES {
        return Err(ShamirError::Counts { threshold, count });
    }
    let mut shares: Vec<Share> = (1..=count as u32)
        .map(|x| Share { x, y: [0; CHUNKS] })
        .collect();
    for (c, chunk) in chunks(secret).into_iter().enumerate() {
        // Coefficients a_0 = chunk, a_1..a_{t-1} uniform in the field.
        let mut coefficients = vec![chunk];
        coefficients.extend((1..threshold).map(|_| random_element(rng)));
        for share in &mut shares {
            share.y[c] = horner(&coefficients, u64::from(share.x));
        }
    }
    Ok(shares)
}

/// Reconstructs a secret from the first `threshold` of `shares`.
pub fn reconstruct(shares: &[Share], threshold: usize) -> Result<[u8; SECRET_LEN], ShamirError> {
    if threshold == 0 || shares.len() < threshold {
        return Err(ShamirError::TooFew {
            got: shares.len(),
            need: threshold.max(1),
        });
    }
    let chunks = interpolate_at_zero(&shares[..threshold])?;
    from_chunks(&chunks)
}

/// The chunk polynomials' values at 0 through the given shares (the secret's
/// chunks if they are `t` consistent shares). Public to the module so tests
/// can show that fewer than `t` shares give garbage.
pub(super) fn interpolate_at_zero(shares: &[Share]) -> Result<[u64; CHUNKS], ShamirError> {
    for (i, share) in shares.iter().enumerate() {
        if share.x == 0
            || share.x as usize > MAX_SHARES
            || shares[..i].iter().any(|s| s.x == share.x)
        {
            return Err(ShamirError::BadPoint(share.x));
        }
        if let Some(&v) = share.y.iter().find(|&&v| v >= PRIME) {
            return Err(ShamirError::BadValue(v));
        }
    }
    let mut out = [0u64; CHUNKS];
    for (i, share) in shares.iter().enumerate() {
        // Lagrange basis at 0: prod_{j != i} x_j / (x_j - x_i).
        let (mut num, mut den) = (1u64, 1u64);
        let xi = u64::from(share.x);
        for other in shares
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, s)| s)
        {
            let xj = u64::from(other.x);
            num = mul(num, xj);
            den = mul(den, sub(xj, xi));
        }
        let basis = mul(num, inverse(den));
        for (slot, &y) in out.iter_mut().zip(&share.y) {
            *slot = add(*slot, mul(basis, y));
        }
    }
    Ok(out)
}

fn chunks(secret: &[u8; SECRET_LEN]) -> [u64; CHUNKS] {
    let mut out = [0u64; CHUNKS];
    for (slot, bytes) in out.iter_mut().zip(secret.chunks(CHUNK_BYTES)) {
        let mut word = [0u8; 8];
        word[..bytes.len()].copy_from_slice(bytes);
        *slot = u64::from_le_bytes(word);
    }
    out
}

fn from_chunks(chunks: &[u64; CHUNKS]) -> Result<[u8; SECRET_LEN], ShamirError> {
    let mut secret = [0u8; SECRET_LEN];
    for (c, (&value, bytes)) in chunks
        .iter()
        .zip(secret.chunks_mut(CHUNK_BYTES))
        .enumerate()
    {
        if value >> (8 * bytes.len()) != 0 {
            return Err(ShamirError::Garbage { chunk: c, value });
        }
        bytes.copy_from_slice(&value.to_le_bytes()[..bytes.len()]);
    }
    Ok(secret)
}

fn random_element(rng: &mut impl RngCore) -> u64 {
    // Rejection sampling over 61 bits: only 2^61 - 1 itself is rejected.
    loop {
        let v = rng.next_u64() >> 3;
        if v < PRIME {
            return v;
        }
    }
}

fn horner(coefficients: &[u64], x: u64) -> u64 {
    coefficients
        .iter()
        .rev()
        .fold(0, |acc, &a| add(mul(acc, x), a))
}

fn reduce(v: u128) -> u64 {
    // 2^61 ≡ 1 (mod p): fold the high bits onto the low ones, twice.
    let folded = (v & u128::from(PRIME)) + (v >> 61);
    let folded = (folded & u128::from(PRIME)) + (folded >> 61);
    let r = folded as u64;
    if r >= PRIME { r - PRIME } else { r }
}

fn add(a: u64, b: u64) -> u64 {
    let s = a + b;
    if s >= PRIME { s - PRIME } else { s }
}

fn sub(a: u64, b: u64) -> u64 {
    if a >= b { a - b } else { a + PRIME - b }
}

fn mul(a: u64, b: u64) -> u64 {
    reduce(u128::from(a) * u128::from(b))
}

/// The inverse by Fermat's little theorem, a^(p-2). Callers never pass 0:
/// the denominators are products of differences of distinct points.
fn inverse(a: u64) -> u64 {
    let (mut base, mut exp, mut acc) = (a, PRIME - 2, 1u64);
    while exp > 0 {
        if exp & 1 == 1 {
            acc = mul(acc, base);
        }
        base = mul(base, base);
        exp >>= 1;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    use rand_chacha::ChaCha20Rng;

    #[test]
    fn field_arithmetic() {
        assert_eq!(reduce(u128::from(PRIME)), 0);
        assert_eq!(mul(PRIME - 1, PRIME - 1), 1);
        for a in [1, 2, 12345, PRIME - 1, 1 << 60] {
            assert_eq!(mul(a, inverse(a)), 1);
        }
        assert_eq!(sub(0, 1), PRIME - 1);
    }

    #[test]
    fn encoding_round_trips_and_rejects() {
        let mut rng = ChaCha20Rng::seed_from_u64(1);
        let share = split(&[7; 32], 2, 3, &mut rng).unwrap()[2];
        assert_eq!(Share::from_bytes(&share.to_bytes()), Ok(share));
        let mut bytes = share.to_bytes();
        bytes[..4].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(Share::from_bytes(&bytes), Err(ShamirError::BadPoint(0)));
        let mut bytes = share.to_bytes();
        bytes[4..12].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            Share::from_bytes(&bytes),
            Err(ShamirError::BadValue(u64::MAX))
        );
    }

    #[test]
    fn refuses_bad_counts_and_duplicates() {
        let mut rng = ChaCha20Rng::seed_from_u64(2);
        assert!(split(&[0; 32], 0, 3, &mut rng).is_err());
        assert!(split(&[0; 32], 4, 3, &mut rng).is_err());
        let shares = split(&[0; 32], 2, 3, &mut rng).unwrap();
        assert_eq!(
            reconstruct(&shares[..1], 2),
            Err(ShamirError::TooFew { got: 1, need: 2 })
        );
        assert_eq!(
            reconstruct(&[shares[0], shares[0]], 2),
            Err(ShamirError::BadPoint(1))
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn any_t_of_n_reconstruct(
            secret in proptest::array::uniform32(any::<u8>()),
            n in 1usize..40,
            t_pick in 0usize..40,
            seed in any::<u64>(),
        ) {
            let t = t_pick % n + 1;
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            let mut shares = split(&secret, t, n, &mut rng).unwrap();
            shares.shuffle(&mut rng);
            prop_assert_eq!(reconstruct(&shares[..t], t), Ok(secret));
            prop_assert_eq!(reconstruct(&shares, t), Ok(secret));
        }

        #[test]
        fn below_threshold_is_garbage_or_refused(
            secret in proptest::array::uniform32(any::<u8>()),
            n in 3usize..30,
            seed in any::<u64>(),
        ) {
            let t = n / 2 + 1;
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            let shares = split(&secret, t, n, &mut rng).unwrap();
            // Asked for t with t - 1: refused outright.
            prop_assert!(reconstruct(&shares[..t - 1], t).is_err());
            // Interpolating t - 1 shares anyway gives anything but the secret.
            let short = interpolate_at_zero(&shares[..t - 1]).unwrap();
            prop_assert_ne!(from_chunks(&short), Ok(secret));
        }

        #[test]
        fn a_tampered_share_changes_the_result(
            secret in proptest::array::uniform32(any::<u8>()),
            seed in any::<u64>(),
            delta in 1u64..PRIME,
        ) {
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            let mut shares = split(&secret, 3, 5, &mut rng).unwrap();
            shares[1].y[0] = add(shares[1].y[0], delta);
            prop_assert_ne!(reconstruct(&shares[..3], 3), Ok(secret));
        }
    }
}
