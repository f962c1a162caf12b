//! The distributed discrete Gaussian mechanism (DDG) on top of secure
//! aggregation: differential privacy that does not trust the server.
//!
//! Kairouz, Liu and Steinke, "The Distributed Discrete Gaussian Mechanism
//! for Federated Learning with Secure Aggregation" (ICML 2021,
//! arXiv:2102.06387; theorem numbers below are the arXiv version's, as the
//! authors' reference implementation, `google-research/federated`
//! `distributed_dp/`, cites them). Each client, in its own process, turns
//! its model change `x` (of `d` values) into integers and adds its share of
//! the noise before masking, so the server's unmasked sum already carries
//! the whole noise:
//!
//! 1. **Clip** `x` to L2 norm `c` (`clip_norm`).
//! 2. **Rotate**: flip signs with a Rademacher vector drawn from a seed
//!    every client of the round shares, pad with zeros to `d' = 2^⌈log₂ d⌉`
//!    and apply the normalised Walsh–Hadamard transform `H/√d'`. The
//!    rotation is orthogonal, so it keeps the norm; it spreads the mass over
//!    all coordinates, so none is large and the modular sum rarely wraps
//!    (the paper's Section 4 "flattening"; `compression_utils.py`,
//!    `randomized_hadamard_transform`, does the same with one repeat).
//! 3. **Scale** by `1/γ` (`γ`, the granularity) and **round** each
//!    coordinate up with probability equal to its fraction, re-drawing the
//!    whole vector while its norm exceeds
//!    `Δ₂ = min(c/γ + √d', √((c/γ)² + d'/4 + √(2 ln(1/β))·(c/γ + √d'/2)))`
//!    (conditional randomized rounding, Proposition 22 of the
//!    paper, `accounting_utils.rounded_l2_norm_bound`; `β = e^{−1/2}` as the
//!    reference's `DEFAULT_BETA`). Each try succeeds with probability at
//!    least `1 − β`; after [`MAX_ROUNDING_ATTEMPTS`] tries the client gives
//!    up with an error instead of sending an unbounded vector.
//! 4. **Noise**: add to each coordinate an independent `N_Z(0, σ_ℓ²)`
//!    with `σ_ℓ = z·c / (γ·√n)` (`z` the noise multiplier, `n` the clients a
//!    round expects), sampled exactly as Canonne, Kamath and Steinke 2020
//!    (arXiv:2004.00010, Algorithms 1–3: rejection from the discrete Laplace
//!    of scale `⌊σ⌋ + 1`, itself from Bernoulli(`e^{−γ}`) draws). The
//!    sum of `n` shares has variance `n·σ_ℓ²`: central noise `z·c` on the
//!    sum, the DP-FedAvg calibration, in the original units.
//! 5. Send `[1, v mod m]`: the leading 1 counts the contributors, so the
//!    server can check the count it decodes with.
//!
//! The server decodes the modular sum `S` of `n` contributors: each entry
//! as a signed integer in `[−m/2, m/2)`, times `γ`, the inverse rotation
//! (`H/√d'` then the same signs), the padding dropped, divided by `n`.
//!
//! # The weight
//!
//! DDG's mean is the **unweighted** mean of the clipped changes. A sample
//! count would be one more value that depends on a client's data, outside
//! the clipping, and the sensitivity analysis is for a vector of bounded
//! norm; so every client counts once (weight 1), and `total_weight` is the
//! number of contributors. This differs from FedAvg's sample weighting.
//!
//! # Privacy accounting
//!
//! One round with `n` contributors releases the sum of `n` noisy vectors.
//! Neighbouring inputs differ in one client's vector (added or removed),
//! whose rounded, scaled norm is at most `Δ₂` (so the rounding's inflation
//! is in the sensitivity) and L1 norm at most `Δ₁ = Δ₂·min(√d', Δ₂)`.
//! Theorem 1 of the paper bounds the Rényi divergence of the sum of `n`
//! discrete Gaussians through
//! `τ = 10·Σ_{k=1}^{n−1} e^{−2π²σ_ℓ²·k/(k+1)}`, and Proposition 14 (Eq. 17)
//! gives, at every order `α`, RDP of
//! `min(α/2·Δ₂²/(nσ_ℓ²) + τd', α/2·(Δ₂²/(nσ_ℓ²) + 2Δ₁τ/(√n σ_ℓ) + τ²d'),
//! α/2·(Δ₂/(√n σ_ℓ) + τ√d')²)`; the last term is Theorem 1's
//! `½ε²`-concentrated DP with `ε = Δ₂/(√n σ_ℓ) + τ√d'`. Rounds compose by
//! adding RDP order by order (ρ-zCDP rounds add their `ρ`, the special
//! case of RDP linear in `α`), and the total is converted to `(ε, δ)` as
//! [`crate::strategy::privacy::epsilon`] does for `dp_fedavg` (Balle et
//! al. 2020, Theorem 21), over the reference's orders `2, …, 128, 256`.
//! This is `accounting_utils.ddgauss_epsilon` with `q = 1`:
//!
//! * No amplification by sampling: the server picks each round's clients,
//!   so it knows who is in the sum.
//! * A round is accounted with the clients that **actually** contributed:
//!   dropped clients add no noise, so fewer contributors mean a smaller
//!   total noise `n·σ_ℓ²` and a larger ε than planned.
//! * A round whose protocol aborted revealed nothing and costs nothing.
//!
//! # What this cannot prove
//!
//! The guarantee is against a server that sees only the unmasked sum:
//! a client that colludes with it reveals its own noise share, which then
//! protects no one ([`super`]'s module doc; docs/SECURITY.md says by how
//! much the noise shrinks). The sampler draws its uniforms from floating
//! point (`u < p`), so a Bernoulli of probability `p` is exact only to
//! `2^{−53}`; the reference relaxes the same way. The granularity's default
//! (`k = 4` standard deviations of the sum within the modulus,
//! `accounting_utils.heuristic_scale_factor`) is a heuristic: a coordinate
//! of the sum beyond `±m/2` wraps around and decodes wrong, which costs
//! accuracy, never privacy (it is post-processing of the noisy sum).

use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::strategy::privacy;

/// `β` of the conditional rounding: the reference's `DEFAULT_BETA`, `e^{−1/2}`.
pub const ROUNDING_BETA: f64 = 0.606_530_659_712_633_4;
/// Standard deviations of the sum the default granularity fits within the
/// modulus (`k` of `ddgauss_params` in the reference).
pub const K_STDDEVS: f64 = 4.0;
/// Tries of the conditional rounding before a client gives up: each fails
/// with probability at most `β ≈ 0.61`, so all of them with at most ~1e-215.
pub const MAX_ROUNDING_ATTEMPTS: u32 = 1000;
/// Scaled values beyond this would lose integers in f64 (2^53) once summed.
const MAX_SCALED_NORM: f64 = (1u64 << 50) as f64;

/// The RDP orders of the reference accountant (`RDP_ORDERS`): 2 to 128, and 256.
pub fn rdp_orders() -> Vec<f64> {
    (2..=128u32).map(f64::from).chain([256.0]).collect()
}

/// The seed of round `round`'s rotation, which every client of the round
/// and the server derive alike from the run's seed: it must be shared, and
/// it need not be secret.
pub fn rotation_seed(run_seed: u64, round: u32) -> u64 {
    crate::seeds::derive_seed(run_seed, "ddg-rotation", &[u64::from(round)])
}

/// The seed of one simulated client's rounding and noise in a round whose
/// noise seed is `round_seed` (simulation only: see [`super::federated::DdgSeeds`]).
pub fn noise_seed(round_seed: u64, client: u32) -> u64 {
    crate::seeds::derive_seed(round_seed, "ddg-noise", &[u64::from(client)])
}

/// What the config gives: the mechanism before the model's size is known.
#[derive(Debug, Clone, PartialEq)]
pub struct DdgParams {
    /// `c`: each client's change is clipped to this L2 norm.
    pub clip_norm: f64,
    /// `z`: the noise of the whole sum has standard deviation `z·c`.
    pub noise_multiplier: f64,
    /// `n`: the contributors a round expects; each adds `1/n` of the variance.
    pub expected_clients: usize,
    /// `γ`; `None` picks it from the modulus ([`DdgParams::resolve`]).
    pub granularity: Option<f64>,
    /// The `δ` that ε is reported for.
    pub delta: f64,
}

/// A parameter or input that DDG cannot work with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DdgError {
    #[error("{name} is {value}; expected {expected}")]
    Param {
        name: &'static str,
        value: f64,
        expected: &'static str,
    },
    #[error(
        "modulus_range {modulus} cannot hold the sum of {clients} clients at {K_STDDEVS} standard deviations (it needs modulus² > clients·{}); raise modulus_range or set granularity",
        K_STDDEVS * K_STDDEVS
    )]
    ModulusTooSmall { modulus: u64, clients: usize },
    #[error(
        "granularity {gamma} scales a clipped update to norm {scaled:e}, beyond 2^50 where sums of integers lose precision; expected a coarser granularity"
    )]
    TooFine { gamma: f64, scaled: f64 },
    #[error(
        "each client's noise would be {sigma:e} granules, beyond 2^40; expected a coarser granularity or a smaller noise_multiplier"
    )]
    TooMuchNoise { sigma: f64 },
    #[error("the model has no float values to add noise to")]
    Empty,
    #[error("the vector has {got} values; expected {expected}")]
    Length { got: usize, expected: usize },
    #[error("the update is not finite at element {index}")]
    NotFinite { index: usize },
    #[error(
        "conditional rounding exceeded the norm bound {bound} in each of {attempts} attempts; expected to pass within a few"
    )]
    Rounding { bound: f64, attempts: u32 },
    #[error(
        "the unmasked sum counts {got} contributors (mod the modulus); expected {expected}, so a vector in it was not encoded as DDG encodes"
    )]
    Count { got: u64, expected: usize },
}

/// The mechanism for a model of `dim` values: every number the clients
/// and the server must agree on.
#[derive(Debug, Clone, PartialEq)]
pub struct Ddg {
    /// `d`, the model's float values.
    pub dim: usize,
    /// `d'`, the rotated length: `d` rounded up to a power of two.
    pub padded: usize,
    /// `γ`, the value of one integer step.
    pub gamma: f64,
    /// `c`.
    pub clip_norm: f64,
    /// `σ_ℓ`: each client's noise, in steps of `γ`.
    pub local_sigma: f64,
    /// `Δ₂`: the L2 bound of a client's rounded vector, in steps of `γ`.
    pub norm_bound: f64,
    /// `m`: the masking modulus.
    pub modulus: u64,
    /// `δ`.
    pub delta: f64,
}

impl DdgParams {
    /// The mechanism for a model of `dim` values masked mod `modulus`.
    /// Without a granularity, `γ` is chosen as the reference's
    /// `heuristic_scale_factor` chooses it (flatness `ρ = 1`): `K_STDDEVS`
    /// standard deviations of each coordinate of the sum (signal, rounding
    /// and noise) fill the modulus,
    /// `γ = 2k·√(c²n²/d' + n·(z·c)²/n) / √(m² − n·k²)`.
    pub fn resolve(&self, dim: usize, modulus: u64) -> Result<Ddg, DdgError> {
        self.check()?;
        let padded = dim
            .checked_next_power_of_two()
            .filter(|_| dim > 0)
            .ok_or(DdgError::Empty)?;
        if !(modulus.is_power_of_two() && (2..=1 << 32).contains(&modulus)) {
            return Err(DdgError::Param {
                name: "modulus_range",
                value: modulus as f64,
                expected: "a power of two in [2, 2^32]",
            });
        }
        let (c, z, n) = (
            self.clip_norm,
            self.noise_multiplier,
            self.expected_clients as f64,
        );
        let local_std = z * c / n.sqrt();
        let gamma = match self.granularity {
            Some(gamma) => gamma,
            None => {
                let m = modulus as f64;
                let room = m * m - n * K_STDDEVS * K_STDDEVS;
                if room <= 0.0 {
                    return Err(DdgError::ModulusTooSmall {
                        modulus,
                        clients: self.expected_clients,
                    });
                }
                let spread = (c * c * n * n / padded as f64 + n * local_std * local_std).sqrt();
                2.0 * K_STDDEVS * spread / room.sqrt()
            }
        };
        // A relative leeway for the float rounding of clipping and rotating.
        let scaled = c * (1.0 + 1e-6) / gamma;
        if !scaled.is_finite() || scaled > MAX_SCALED_NORM {
            return Err(DdgError::TooFine { gamma, scaled });
        }
        let local_sigma = local_std / gamma;
        if !local_sigma.is_finite() || local_sigma > (1u64 << 40) as f64 {
            return Err(DdgError::TooMuchNoise { sigma: local_sigma });
        }
        Ok(Ddg {
            dim,
            padded,
            gamma,
            clip_norm: c,
            local_sigma,
            norm_bound: rounded_norm_bound(scaled, ROUNDING_BETA, padded),
            modulus,
            delta: self.delta,
        })
    }

    fn check(&self) -> Result<(), DdgError> {
        let param = |name, value, expected| {
            Err(DdgError::Param {
                name,
                value,
                expected,
            })
        };
        if !(self.clip_norm.is_finite() && self.clip_norm > 0.0) {
            return param("clip_norm", self.clip_norm, "a finite number above 0");
        }
        if !(self.noise_multiplier.is_finite() && self.noise_multiplier >= 0.0) {
            return param(
                "noise_multiplier",
                self.noise_multiplier,
                "a finite number of at least 0",
            );
        }
        if self.expected_clients == 0 {
            return param("clients.per_round", 0.0, "at least 1 client");
        }
        if let Some(gamma) = self.granularity
            && !(gamma.is_finite() && gamma > 0.0)
        {
            return param("granularity", gamma, "a finite number above 0");
        }
        if !(self.delta > 0.0 && self.delta < 1.0) {
            return param("delta", self.delta, "a number in (0, 1)");
        }
        Ok(())
    }
}

/// The paper's bound on the L2 norm of `norm`-bounded vector of `dim`
/// coordinates after conditional randomized rounding with `beta`
/// (Proposition 22, as the reference's `compression_utils.py` cites it; its
/// `rounded_l2_norm_bound`):
/// the smaller of `norm + √dim` (always) and
/// `√(norm² + dim/4 + √(2 ln(1/β))·(norm + √dim/2))` (what conditioning buys).
pub fn rounded_norm_bound(norm: f64, beta: f64, dim: usize) -> f64 {
    let d = dim as f64;
    let always = norm + d.sqrt();
    if beta <= 0.0 {
        return always;
    }
    let squared =
        norm * norm + 0.25 * d + (2.0 * (1.0 / beta).ln()).sqrt() * (norm + 0.5 * d.sqrt());
    always.min(squared.sqrt())
}

/// Scales `values` down to L2 norm `clip_norm` if above it; the norm before.
pub fn clip_to_norm(values: &mut [f64], clip_norm: f64) -> f64 {
    let norm = values.iter().map(|v| v * v).sum::<f64>().sqrt();
    if norm > clip_norm {
        let factor = clip_norm / norm;
        values.iter_mut().for_each(|v| *v *= factor);
    }
    norm
}

/// The randomized Hadamard rotation: `values` padded with zeros to
/// `padded` (a power of two, at least `values.len()`), signs flipped by the
/// Rademacher vector of `seed`, then `H/√padded`.
pub fn rotate(values: &[f64], padded: usize, seed: u64) -> Vec<f64> {
    let mut out = values.to_vec();
    out.resize(padded, 0.0);
    for (v, flip) in out.iter_mut().zip(signs(seed, padded)) {
        if flip {
            *v = -*v;
        }
    }
    walsh_hadamard(&mut out);
    out
}

/// The inverse of [`rotate`]: `H/√d'` (its own inverse), the same signs,
/// and the first `dim` values.
pub fn unrotate(values: &[f64], dim: usize, seed: u64) -> Vec<f64> {
    let mut out = values.to_vec();
    walsh_hadamard(&mut out);
    for (v, flip) in out.iter_mut().zip(signs(seed, values.len())) {
        if flip {
            *v = -*v;
        }
    }
    out.truncate(dim);
    out
}

/// `len` random signs (true: flip) from `seed`, 64 to a draw.
fn signs(seed: u64, len: usize) -> impl Iterator<Item = bool> {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    (0..len.div_ceil(64))
        .flat_map(move |_| {
            let bits = rng.next_u64();
            (0..64).map(move |i| bits >> i & 1 == 1)
        })
        .take(len)
}

/// The fast Walsh–Hadamard transform, normalised by `1/√len` so that it
/// is orthogonal and its own inverse; `values.len()` is a power of two.
fn walsh_hadamard(values: &mut [f64]) {
    let len = values.len();
    let mut half = 1;
    while half < len {
        for block in values.chunks_exact_mut(2 * half) {
            let (left, right) = block.split_at_mut(half);
            for (a, b) in left.iter_mut().zip(right) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        half *= 2;
    }
    let norm = 1.0 / (len as f64).sqrt();
    values.iter_mut().for_each(|v| *v *= norm);
}

/// Conditional randomized rounding: each value rounded up with probability
/// equal to its fraction (unbiased), the whole vector re-drawn while its L2
/// norm exceeds `bound`, at most [`MAX_ROUNDING_ATTEMPTS`] times. Values must
/// be finite and below 2^50 in magnitude.
pub fn conditional_round(
    values: &[f64],
    bound: f64,
    rng: &mut impl RngCore,
) -> Result<Vec<i64>, DdgError> {
    let floors: Vec<f64> = values.iter().map(|v| v.floor()).collect();
    for _ in 0..MAX_ROUNDING_ATTEMPTS {
        let mut norm_sq = 0.0;
        let rounded: Vec<i64> = values
            .iter()
            .zip(&floors)
            .map(|(&v, &floor)| {
                let r = floor + f64::from(u8::from(rng.random::<f64>() < v - floor));
                norm_sq += r * r;
                // Below 2^50 in magnitude (checked by the caller): exact.
                r as i64
            })
            .collect();
        if norm_sq.sqrt() <= bound {
            return Ok(rounded);
        }
    }
    Err(DdgError::Rounding {
        bound,
        attempts: MAX_ROUNDING_ATTEMPTS,
    })
}

/// One draw of the discrete Gaussian `N_Z(0, σ²)`, `P(x) ∝ e^{−x²/2σ²}` on
/// the integers (Canonne, Kamath, Steinke 2020, Algorithm 3): a discrete
/// Laplace draw `Y` of scale `t = ⌊σ⌋ + 1`, kept with probability
/// `exp(−(|Y| − σ²/t)² / 2σ²)`. `σ = 0` (or below) gives 0.
pub fn sample_discrete_gaussian(sigma: f64, rng: &mut impl RngCore) -> i64 {
    if sigma.is_nan() || sigma <= 0.0 {
        return 0;
    }
    let sigma2 = sigma * sigma;
    // σ ≤ 2^40 (checked by the caller), so t fits.
    let t = sigma.floor() as u64 + 1;
    loop {
        let y = sample_discrete_laplace(t, rng);
        let gap = y.unsigned_abs() as f64 - sigma2 / t as f64;
        if bernoulli_exp_neg(gap * gap / (2.0 * sigma2), rng) {
            return y;
        }
    }
}

/// One draw of the discrete Laplace of integer scale `t ≥ 1`,
/// `P(x) ∝ e^{−|x|/t}` (CKS 2020, Algorithm 2 with `s = 1`): `U` uniform below
/// `t` kept with probability `e^{−U/t}`, plus `t` times a geometric count of
/// Bernoulli(`e^{−1}`) successes, with a random sign (a negative zero
/// re-drawn).
fn sample_discrete_laplace(t: u64, rng: &mut impl RngCore) -> i64 {
    loop {
        let u = rng.random_range(0..t);
        if !bernoulli_exp_neg(u as f64 / t as f64, rng) {
            continue;
        }
        let mut v: u64 = 0;
        while bernoulli_exp_neg(1.0, rng) {
            v = v.saturating_add(1);
        }
        let x = v.saturating_mul(t).saturating_add(u).min(i64::MAX as u64) as i64;
        let negative = rng.random::<bool>();
        if negative && x == 0 {
            continue;
        }
        return if negative { -x } else { x };
    }
}

/// Bernoulli(`e^{−γ}`) for `γ ≥ 0` (CKS 2020, Algorithm 1): for `γ ≤ 1`, count
/// successes of Bernoulli(`γ/k`), `k = 1, 2, …`, until the first failure; the
/// result is whether the count is even. Larger `γ` is `⌊γ⌋` draws at
/// `γ = 1` and one at the fraction.
fn bernoulli_exp_neg(gamma: f64, rng: &mut impl RngCore) -> bool {
    let mut left = gamma;
    while left > 1.0 {
        if !bernoulli_exp_neg_unit(1.0, rng) {
            return false;
        }
        left -= 1.0;
    }
    bernoulli_exp_neg_unit(left, rng)
}

fn bernoulli_exp_neg_unit(gamma: f64, rng: &mut impl RngCore) -> bool {
    let mut k: u64 = 1;
    while rng.random::<f64>() < gamma / k as f64 {
        k += 1;
    }
    k % 2 == 1
}

impl Ddg {
    /// The vector a client masks: `[1, v mod m]` with `v` its clipped,
    /// rotated (by the round's `rotation_seed`), scaled, rounded and noised
    /// change. Rounding and noise draw on `rng`: the client's own, private
    /// randomness (a seeded one only in simulation).
    pub fn encode(
        &self,
        change: &[f32],
        rotation_seed: u64,
        rng: &mut impl RngCore,
    ) -> Result<Vec<u32>, DdgError> {
        if change.len() != self.dim {
            return Err(DdgError::Length {
                got: change.len(),
                expected: self.dim,
            });
        }
        if let Some(index) = change.iter().position(|v| !v.is_finite()) {
            return Err(DdgError::NotFinite { index });
        }
        let mut x: Vec<f64> = change.iter().map(|&v| f64::from(v)).collect();
        clip_to_norm(&mut x, self.clip_norm);
        let scaled: Vec<f64> = rotate(&x, self.padded, rotation_seed)
            .into_iter()
            .map(|v| v / self.gamma)
            .collect();
        let rounded = conditional_round(&scaled, self.norm_bound, rng)?;
        let m = self.modulus as i64;
        let mut out = Vec::with_capacity(self.padded + 1);
        out.push(1);
        for r in rounded {
            // |r| ≤ 2^51 and |noise| far below 2^62: no overflow.
            let noised = r.saturating_add(sample_discrete_gaussian(self.local_sigma, rng));
            // In [0, m) with m ≤ 2^32.
            out.push(noised.rem_euclid(m) as u32);
        }
        Ok(out)
    }

    /// The mean change from the unmasked sum of `contributors` encoded
    /// vectors: each entry read as a signed integer in `[−m/2, m/2)`, times
    /// `γ`, rotated back, the padding dropped, divided by `contributors`.
    /// The sum's count entry must agree with `contributors`.
    pub fn decode(
        &self,
        sum: &[u32],
        contributors: usize,
        rotation_seed: u64,
    ) -> Result<Vec<f64>, DdgError> {
        if sum.len() != self.padded + 1 {
            return Err(DdgError::Length {
                got: sum.len(),
                expected: self.padded + 1,
            });
        }
        let m = self.modulus;
        let count = u64::from(sum[0]);
        if contributors == 0 || count != contributors as u64 % m {
            return Err(DdgError::Count {
                got: count,
                expected: contributors,
            });
        }
        let half = m / 2;
        let signed: Vec<f64> = sum[1..]
            .iter()
            .map(|&s| {
                let s = u64::from(s) % m;
                let value = if s >= half {
                    s as i64 - m as i64
                } else {
                    s as i64
                };
                value as f64 * self.gamma
            })
            .collect();
        let n = contributors as f64;
        Ok(unrotate(&signed, self.dim, rotation_seed)
            .into_iter()
            .map(|v| v / n)
            .collect())
    }

    /// How far each coordinate of [`Ddg::decode`]'s mean can be from the
    /// mean of the clipped changes when no noise is added (`σ_ℓ = 0`) and the
    /// sum does not wrap (`n·Δ₂ < m/2`): each client's rounding moves its
    /// scaled vector by less than `√d'` in L2, the rotation back keeps that,
    /// so the mean moves by less than `γ·√d'` in L2 and so in every
    /// coordinate. A little is added for f64 rounding.
    pub fn noiseless_error_bound(&self) -> f64 {
        self.gamma * (self.padded as f64).sqrt() * (1.0 + 1e-9) + 1e-12
    }

    /// The standard deviation of each coordinate of the decoded mean's
    /// noise with `contributors` in the sum: `√n·σ_ℓ·γ / n` (the rotation
    /// back is orthogonal and the coordinates' noises independent, so each
    /// output coordinate has the same variance).
    pub fn mean_noise_std(&self, contributors: usize) -> f64 {
        let n = contributors as f64;
        n.sqrt() * self.local_sigma * self.gamma / n
    }

    /// RDP of one round with `contributors` in the sum, at each of `orders`
    /// (see the module docs); no contributor releases nothing (0), no noise
    /// gives `∞`.
    pub fn round_rdp(&self, contributors: usize, orders: &[f64]) -> Vec<f64> {
        if contributors == 0 {
            return vec![0.0; orders.len()];
        }
        let sigma = self.local_sigma;
        if sigma.is_nan() || sigma <= 0.0 {
            return vec![f64::INFINITY; orders.len()];
        }
        let n = contributors as f64;
        let d = self.padded as f64;
        let tau = 10.0
            * (1..contributors)
                .map(|k| {
                    let k = k as f64;
                    (-2.0 * (std::f64::consts::PI * sigma).powi(2) * (k / (k + 1.0))).exp()
                })
                .sum::<f64>();
        let l2 = self.norm_bound / (n.sqrt() * sigma);
        let l1 = self.norm_bound * d.sqrt().min(self.norm_bound) / (n.sqrt() * sigma);
        orders
            .iter()
            .map(|&alpha| {
                let first = alpha / 2.0 * l2 * l2 + tau * d;
                let second = alpha / 2.0 * (l2 * l2 + 2.0 * l1 * tau + tau * tau * d);
                let third = alpha / 2.0 * (l2 + d.sqrt() * tau).powi(2);
                first.min(second).min(third)
            })
            .collect()
    }
}

/// The privacy spent so far: the rounds' RDP added up order by order.
#[derive(Debug, Clone, PartialEq)]
pub struct DdgAccountant {
    orders: Vec<f64>,
    rdp: Vec<f64>,
    rounds: u32,
}

impl Default for DdgAccountant {
    fn default() -> Self {
        let orders = rdp_orders();
        let rdp = vec![0.0; orders.len()];
        Self {
            orders,
            rdp,
            rounds: 0,
        }
    }
}

impl DdgAccountant {
    /// Adds a round with `contributors` in the sum.
    pub fn record(&mut self, ddg: &Ddg, contributors: usize) {
        let round = ddg.round_rdp(contributors, &self.orders);
        self.rdp.iter_mut().zip(round).for_each(|(a, r)| *a += r);
        self.rounds += 1;
    }

    /// ε for `delta` after the rounds recorded; 0 before any.
    pub fn epsilon(&self, delta: f64) -> f64 {
        if self.rounds == 0 {
            return 0.0;
        }
        privacy::epsilon(&self.rdp, &self.orders, delta).0
    }
}

#[cfg(test)]
mod tests;
