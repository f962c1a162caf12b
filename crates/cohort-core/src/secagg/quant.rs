//! Quantisation of a weighted update to integers, as Flower does it.
//!
//! A client with weight `w` sends `[q_w, q(r·x_1), …, q(r·x_d)]` where
//! `q_w = round(w / max_weight · Q)`, `r = q_w / Q` (the weight as the server
//! will see it, so the two stay consistent) and
//! `q(v) = stochastic_round((clip(v, -c, c) + c) · Q / (2c))`, an integer in
//! `[0, Q]` (`Q = quantization_range`, `c = clipping_range`). Stochastic
//! rounding rounds up with probability equal to the fraction, so it is
//! unbiased to within 2^-32 (the draw is a 32-bit word of a mask stream keyed
//! by 32 bytes of the caller's seeded generator, so a run stays reproducible
//! and a million values cost one key, not a million draws from it).
//!
//! The server's sum of `n` such vectors gives the total weight
//! `max_weight · S_0 / Q` and the weighted sum
//! `max_weight · (S_j · 2c / Q − n·c)`.
//!
//! Error bound (see [`sum_error_bound`]): when no value is clipped, each
//! client's entry is off by less than one quantum `2c/Q` from stochastic
//! rounding, and its weight by at most `1/(2Q)` of `max_weight`, which moves
//! `w·x` by at most `max_weight·|x|/(2Q)`. Over `n` clients the weighted sum is
//! within `n · max_weight · (2c/Q + max|x|/(2Q))` of the exact `Σ w_i·x_i`
//! and the total weight within `n · max_weight / (2Q)` of `Σ w_i`.

use rand::{Rng, RngCore};

use super::Params;
use super::crypto::{self, MASK_BLOCK};

/// A client's own input that cannot be quantised.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    #[error("weight {weight}; expected a finite number in 0..={max_weight} (max_weight)")]
    Weight { weight: f64, max_weight: f64 },
    #[error("value {value} at index {index}; expected a finite number")]
    NotFinite { index: usize, value: f32 },
}

/// The quantised weight `round(weight / max_weight · Q)`. Flower only warns
/// when a weight exceeds `max_weight` (and the sum may then overflow);
/// here it is refused.
pub fn quantize_weight(weight: f64, params: &Params) -> Result<u32, QuantError> {
    if !(weight.is_finite() && (0.0..=params.max_weight).contains(&weight)) {
        return Err(QuantError::Weight {
            weight,
            max_weight: params.max_weight,
        });
    }
    let q = params.quantization_range as f64;
    // At most Q, which is below the modulus and so below 2^32.
    Ok((weight / params.max_weight * q).round().min(q) as u32)
}

/// The vector a client masks: its quantised weight, then its quantised
/// weighted values.
pub fn quantize(
    values: &[f32],
    weight_q: u32,
    params: &Params,
    rng: &mut impl RngCore,
) -> Result<Vec<u32>, QuantError> {
    let q = params.quantization_range as f64;
    let c = params.clipping_range;
    let ratio = f64::from(weight_q) / q;
    let scale = q / (2.0 * c);
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        let value = values[index];
        return Err(QuantError::NotFinite { index, value });
    }
    let mut rounding = crypto::mask_stream(&rng.random::<[u8; 32]>());
    let mut bytes = [0u8; MASK_BLOCK * 4];
    let mut out = Vec::with_capacity(values.len() + 1);
    out.push(weight_q);
    let top = q as u32;
    for chunk in values.chunks(MASK_BLOCK) {
        let draws = crypto::next_words(&mut rounding, &mut bytes, chunk.len());
        // Branch-free, so the compiler can vectorise it: the values are
        // finite (checked above), `max`/`min` rather than `clamp` (whose
        // argument check would stay in the loop), and scaled lies in
        // [0, Q] with Q < 2^32, where truncation is the floor.
        out.extend(chunk.iter().zip(draws).map(|(&value, draw)| {
            let scaled = ((ratio * f64::from(value)).max(-c).min(c) + c) * scale;
            let floor = scaled as u32;
            let up = f64::from(draw) < (scaled - f64::from(floor)) * TWO_POW_32;
            floor.saturating_add(u32::from(up)).min(top)
        }));
    }
    Ok(out)
}

const TWO_POW_32: f64 = 4_294_967_296.0;

/// The total weight and the weighted sum from the unmasked sum `sum` of
/// `contributors` quantised vectors.
pub fn dequantize(sum: &[u32], contributors: usize, params: &Params) -> (f64, Vec<f64>) {
    let q = params.quantization_range as f64;
    let c = params.clipping_range;
    let w = params.max_weight;
    let Some((&weight, values)) = sum.split_first() else {
        return (0.0, Vec::new());
    };
    let offset = contributors as f64 * c;
    let weighted = values
        .iter()
        .map(|&s| w * (f64::from(s) * 2.0 * c / q - offset))
        .collect();
    (w * f64::from(weight) / q, weighted)
}

/// How far the weighted sum and the total weight of `clients` unclipped
/// inputs, each value at most `max_abs` in magnitude, can be from the exact
/// ones (see the module docs). A little is added for f64 rounding.
pub fn sum_error_bound(params: &Params, clients: usize, max_abs: f64) -> (f64, f64) {
    let q = params.quantization_range as f64;
    let n = clients as f64;
    let sum = n * params.max_weight * (2.0 * params.clipping_range / q + max_abs / (2.0 * q));
    let weight = n * params.max_weight / (2.0 * q);
    (sum * (1.0 + 1e-9) + 1e-9, weight * (1.0 + 1e-9) + 1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secagg::NumShares;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha20Rng;

    fn params(q_bits: u32, c: f64, max_weight: f64) -> Params {
        Params {
            quantization_range: 1 << q_bits,
            clipping_range: c,
            max_weight,
            ..Params::new(NumShares::All, 2)
        }
    }

    #[test]
    fn refuses_bad_weights_and_values() {
        let p = params(22, 8.0, 100.0);
        assert!(matches!(
            quantize_weight(100.5, &p),
            Err(QuantError::Weight { .. })
        ));
        assert!(quantize_weight(-1.0, &p).is_err());
        assert!(quantize_weight(f64::NAN, &p).is_err());
        assert_eq!(quantize_weight(100.0, &p), Ok(1 << 22));
        let mut rng = ChaCha20Rng::seed_from_u64(0);
        assert!(matches!(
            quantize(&[0.0, f32::NAN], 1, &p, &mut rng),
            Err(QuantError::NotFinite { index: 1, .. })
        ));
    }

    #[test]
    fn clipping_and_seeded_rounding() {
        let p = params(8, 1.0, 1.0);
        let w = quantize_weight(1.0, &p).unwrap();
        let mut rng = ChaCha20Rng::seed_from_u64(5);
        let out = quantize(&[5.0, -5.0, 0.0], w, &p, &mut rng).unwrap();
        assert_eq!(out, vec![256, 256, 0, 128]);
        let values: Vec<f32> = (0..100).map(|i| i as f32 * 0.0137 - 0.5).collect();
        let a = quantize(&values, w, &p, &mut ChaCha20Rng::seed_from_u64(9)).unwrap();
        let b = quantize(&values, w, &p, &mut ChaCha20Rng::seed_from_u64(9)).unwrap();
        assert_eq!(a, b);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// One client's round trip stays within the stated bound.
        #[test]
        fn round_trip_within_bound(
            values in proptest::collection::vec(-4.0f32..4.0, 1..200),
            weight in 0.0f64..50.0,
            q_bits in 8u32..24,
            seed in any::<u64>(),
        ) {
            let p = params(q_bits, 4.0, 50.0);
            let wq = quantize_weight(weight, &p).unwrap();
            let mut rng = ChaCha20Rng::seed_from_u64(seed);
            let quantized = quantize(&values, wq, &p, &mut rng).unwrap();
            prop_assert!(quantized.iter().all(|&v| u64::from(v) <= p.quantization_range));
            let (total, sums) = dequantize(&quantized, 1, &p);
            let (sum_bound, weight_bound) = sum_error_bound(&p, 1, 4.0);
            prop_assert!((total - weight).abs() <= weight_bound);
            for (s, &x) in sums.iter().zip(&values) {
                let exact = weight * f64::from(x);
                prop_assert!((s - exact).abs() <= sum_bound, "{s} vs {exact}, bound {sum_bound}");
            }
        }
    }
}
