//! Privacy accounting for the sampled Gaussian mechanism with Rényi
//! differential privacy (RDP), written to give the numbers Opacus gives.
//!
//! # The mechanism
//!
//! One round of [`dp_fedavg`](super::dp) is a *sampled Gaussian mechanism*
//! (SGM): a random subset of clients, each in it with probability `q`,
//! contributes updates clipped to L2 norm `S`; their sum gets Gaussian noise
//! of standard deviation `σ·S` (`σ` is the noise multiplier). Its privacy is
//! tracked in RDP (Mironov 2017, "Rényi Differential Privacy"): at order `α`
//! the mechanism is `(α, ε(α))`-RDP, RDP of `T` rounds adds up to
//! `T·ε(α)`, and at the end the best order is turned into an `(ε, δ)` pair.
//!
//! # The RDP of one step
//!
//! Mironov, Talwar and Zhang 2019 ("Rényi Differential Privacy of the Sampled
//! Gaussian Mechanism", Section 3.3) give `ε(α) = ln(A_α) / (α − 1)` with
//! `A_α = E_{z∼μ₀} [((1 − q) + q·μ₁(z)/μ₀(z))^α]`, `μ₀ = N(0, σ²)`,
//! `μ₁ = N(1, σ²)`, computed in log space:
//!
//! * **integer `α`**: the binomial expansion
//!   `A_α = Σ_{i=0..α} C(α, i) qⁱ (1 − q)^{α−i} exp((i² − i) / 2σ²)`;
//! * **fractional `α`**: two series (integrals over `z ≤ z₀` and `z ≥ z₀`,
//!   `z₀ = σ² ln(1/q − 1) + 1/2`) of terms
//!   `C(α, i) qⁱ (1 − q)^{α−i} exp((i² − i) / 2σ²) · erfc((i − z₀) / √2σ) / 2`
//!   and the mirror terms with `j = α − i`, summed until both terms drop below
//!   `e^{−30}`. `C(α, i)` changes sign once `i > α`, so terms are added or
//!   subtracted in log space.
//!
//! Special cases, in this order: `q = 0` releases nothing (`ε(α) = 0`), `σ = 0`
//! is no privacy (`∞`), `q = 1` is the plain Gaussian mechanism
//! (`ε(α) = α / 2σ²`), `α = ∞` gives `∞`.
//!
//! # From RDP to (ε, δ)
//!
//! [`epsilon`] uses Balle et al. 2020 ("Hypothesis Testing Interpretations and
//! Rényi Differential Privacy", Theorem 21):
//! `ε = min_α [ RDP(α) − (ln δ + ln α) / (α − 1) + ln((α − 1) / α) ]`,
//! orders whose value is NaN skipped, `(∞, NaN)` when every one is.
//!
//! # Agreement with Opacus
//!
//! Every rule above, the order of the special cases, the stopping rule of the
//! fractional series and the default orders ([`default_orders`], Opacus's
//! `RDPAccountant.DEFAULT_ALPHAS`) follow `opacus/accountants/analysis/rdp.py`
//! (`compute_rdp`, `get_privacy_spent`), itself from TF Privacy. The test
//! `tests/privacy_opacus.rs` runs Opacus's own file on a grid of settings and
//! compares every order's RDP and the final ε. Differences from Opacus, none
//! of which changes a result Opacus returns:
//!
//! * `erfc` is computed here (series below 1, continued fraction above, in
//!   log space so that it never underflows) instead of scipy's `log_ndtr`;
//!   both are accurate to a few units in the last place.
//! * Binomial coefficients are accumulated in log space, so orders whose
//!   `C(α, i)` overflows a float (above ~1000, where Opacus's RDP becomes ∞)
//!   still get a number.
//! * Where Opacus would raise (a log-space subtraction going negative, which
//!   exact arithmetic rules out) or loop forever (NaN terms), the order's RDP
//!   here is NaN, and [`epsilon`] skips it: fewer orders can only give a
//!   larger, still valid, ε.
//! * [`epsilon_after`] of zero steps is 0, as Opacus's accountant with an
//!   empty history; [`epsilon`] of all-zero RDP is not 0 (Opacus's formula
//!   gives a small positive bound, kept as is).
//!
//! Sharing Opacus's stopping rule means sharing its truncation: at small `q`
//! and orders near 1, where `ln A_α` is ~1e-5, the dropped `e^{−30}` tail is
//! ~1e-8 of it, and both implementations are that far from the exact value
//! (checked against a 40-digit quadrature). Such orders do not decide ε:
//! their conversion term `−ln δ / (α − 1)` is large while their RDP is small.

use std::f64::consts::{LN_2, PI, SQRT_2};

/// The fractional series stops once both of its terms are below `e^{-30}`
/// (Opacus's rule).
const LOG_TERM_CUTOFF: f64 = -30.0;
/// A bound on the fractional series, far above what any finite σ needs (terms
/// decay at least like `i^{−α−2}`); reaching it makes that order NaN.
const MAX_FRACTIONAL_TERMS: u64 = 10_000_000;
/// Below this `|x|`, `erfc` comes from the series of `erf`; above, from the
/// continued fraction. Both keep `ln erfc` within ~2e-15 (relative) there,
/// in at most ~20 and ~190 steps; the series loses more as `1 − erf(x)`
/// shrinks, the fraction converges more slowly towards 0.
const ERFC_SERIES_BELOW: f64 = 1.0;

/// Opacus's default orders (`RDPAccountant.DEFAULT_ALPHAS`):
/// `1.1, 1.2, …, 10.9` then `12, 13, …, 63`, bit for bit.
pub fn default_orders() -> Vec<f64> {
    (1..100u32)
        .map(|x| 1.0 + f64::from(x) / 10.0)
        .chain((12..64u32).map(f64::from))
        .collect()
}

/// RDP of `steps` compositions of the sampled Gaussian mechanism with sampling
/// rate `q` and noise multiplier `noise_multiplier`, at each of `orders`
/// (Opacus's `compute_rdp`). Values may be `∞`.
///
/// # Panics
///
/// If `q` is not in `[0, 1]`, `noise_multiplier` is not finite and
/// non-negative, or an order is not above 1 (`∞` is allowed).
pub fn rdp_sampled_gaussian(q: f64, noise_multiplier: f64, steps: u64, orders: &[f64]) -> Vec<f64> {
    assert!(
        (0.0..=1.0).contains(&q),
        "sampling rate q = {q} is not in [0, 1]"
    );
    assert!(
        noise_multiplier.is_finite() && noise_multiplier >= 0.0,
        "noise multiplier {noise_multiplier} is not finite and non-negative"
    );
    orders
        .iter()
        .map(|&order| {
            assert!(order > 1.0, "RDP order {order} is not above 1");
            // `steps` compositions add up; ∞·0 is NaN, as in Opacus.
            rdp_one_step(q, noise_multiplier, order) * steps as f64
        })
        .collect()
}

/// `(ε, best order)` for `δ` from RDP values at `orders` (Opacus's
/// `get_privacy_spent`): the smallest conversion over the orders, NaN skipped;
/// `(∞, NaN)` when no order gives a number.
///
/// # Panics
///
/// If `rdp` and `orders` differ in length.
pub fn epsilon(rdp: &[f64], orders: &[f64], delta: f64) -> (f64, f64) {
    assert_eq!(
        rdp.len(),
        orders.len(),
        "one RDP value per order: {} values for {} orders",
        rdp.len(),
        orders.len()
    );
    let mut best: Option<(f64, f64)> = None;
    for (&value, &order) in rdp.iter().zip(orders) {
        // Same operations in the same order as Opacus, for the same rounding.
        let eps = value - (delta.ln() + order.ln()) / (order - 1.0) + ((order - 1.0) / order).ln();
        // Strictly smaller: the first of equal minima wins, as `nanargmin`.
        if !eps.is_nan() && best.is_none_or(|(smallest, _)| eps < smallest) {
            best = Some((eps, order));
        }
    }
    best.unwrap_or((f64::INFINITY, f64::NAN))
}

/// ε after `steps` rounds of the sampled Gaussian mechanism (sampling rate
/// `q`, noise multiplier `noise_multiplier`) for `δ`, over
/// [`default_orders`]: what Opacus's `RDPAccountant` reports after `steps`
/// calls of `step(noise_multiplier, sample_rate = q)`. Zero steps spend
/// nothing (0).
///
/// # Panics
///
/// As [`rdp_sampled_gaussian`].
pub fn epsilon_after(q: f64, noise_multiplier: f64, steps: u64, delta: f64) -> f64 {
    if steps == 0 {
        return 0.0;
    }
    let orders = default_orders();
    let rdp = rdp_sampled_gaussian(q, noise_multiplier, steps, &orders);
    epsilon(&rdp, &orders, delta).0
}

/// RDP of one step at order `alpha`, special cases first (Opacus's order).
fn rdp_one_step(q: f64, sigma: f64, alpha: f64) -> f64 {
    if q == 0.0 {
        return 0.0;
    }
    if sigma == 0.0 {
        return f64::INFINITY;
    }
    if q == 1.0 {
        return alpha / (2.0 * sigma * sigma);
    }
    if alpha.is_infinite() {
        return f64::INFINITY;
    }
    let log_a = if alpha.fract() == 0.0 {
        log_a_integer(q, sigma, alpha)
    } else {
        log_a_fractional(q, sigma, alpha)
    };
    log_a / (alpha - 1.0)
}

/// `ln A_α` for integer `α` (finite, ≥ 2) and `0 < q < 1`: the binomial
/// expansion, term by term in log space.
fn log_a_integer(q: f64, sigma: f64, alpha: f64) -> f64 {
    let (log_q, log_1mq) = (q.ln(), (1.0 - q).ln());
    let mut log_a = f64::NEG_INFINITY;
    // ln C(α, i), updated by the ratio C(α, i) / C(α, i − 1) = (α − i + 1) / i.
    let mut log_binomial = 0.0;
    let mut i = 0.0;
    while i <= alpha {
        if i > 0.0 {
            log_binomial += ((alpha - i + 1.0) / i).ln();
        }
        let log_coefficient = log_binomial + i * log_q + (alpha - i) * log_1mq;
        let term = log_coefficient + (i * i - i) / (2.0 * sigma * sigma);
        log_a = log_add(log_a, term);
        i += 1.0;
    }
    log_a
}

/// `ln A_α` for fractional `α` and `0 < q < 1`: the two erfc-weighted series
/// of the module documentation, until both terms are below `e^{−30}`. NaN if
/// the sums go wrong (see the module documentation).
fn log_a_fractional(q: f64, sigma: f64, alpha: f64) -> f64 {
    let (log_q, log_1mq) = (q.ln(), (1.0 - q).ln());
    let z0 = sigma * sigma * (1.0 / q - 1.0).ln() + 0.5;
    let (mut log_a0, mut log_a1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    // |C(α, i)| in log space and its sign, updated by the ratio (α − i + 1) / i.
    let (mut log_abs_binomial, mut positive) = (0.0, true);
    for step in 0..MAX_FRACTIONAL_TERMS {
        let i = step as f64;
        if step > 0 {
            let ratio = (alpha - i + 1.0) / i;
            log_abs_binomial += ratio.abs().ln();
            positive ^= ratio < 0.0;
        }
        let j = alpha - i;
        let log_t0 = log_abs_binomial + i * log_q + j * log_1mq;
        let log_t1 = log_abs_binomial + j * log_q + i * log_1mq;
        let log_e0 = 0.5f64.ln() + log_erfc((i - z0) / (SQRT_2 * sigma));
        let log_e1 = 0.5f64.ln() + log_erfc((z0 - j) / (SQRT_2 * sigma));
        let log_s0 = log_t0 + (i * i - i) / (2.0 * sigma * sigma) + log_e0;
        let log_s1 = log_t1 + (j * j - j) / (2.0 * sigma * sigma) + log_e1;
        if positive {
            log_a0 = log_add(log_a0, log_s0);
            log_a1 = log_add(log_a1, log_s1);
        } else {
            log_a0 = log_sub(log_a0, log_s0);
            log_a1 = log_sub(log_a1, log_s1);
        }
        if log_a0.is_nan() || log_a1.is_nan() {
            return f64::NAN;
        }
        if log_s0.max(log_s1) < LOG_TERM_CUTOFF {
            return log_add(log_a0, log_a1);
        }
    }
    f64::NAN
}

/// `ln(eˣ + eʸ)`.
fn log_add(x: f64, y: f64) -> f64 {
    let (small, large) = if x < y { (x, y) } else { (y, x) };
    if small == f64::NEG_INFINITY {
        return large;
    }
    (small - large).exp().ln_1p() + large
}

/// `ln(eˣ − eʸ)`; NaN when `x < y` (the difference would be negative).
fn log_sub(x: f64, y: f64) -> f64 {
    if x < y {
        return f64::NAN;
    }
    if y == f64::NEG_INFINITY {
        return x;
    }
    if x == y {
        return f64::NEG_INFINITY;
    }
    let ratio_minus_one = (x - y).exp_m1();
    if ratio_minus_one.is_infinite() {
        // eʸ is negligible next to eˣ (Opacus's overflow branch).
        x
    } else {
        ratio_minus_one.ln() + y
    }
}

/// `ln erfc(x)` for finite `x`, without underflow for large `x` (where
/// `erfc(x) < 1e−308` from `x ≈ 26.6`) and accurate to a few ulp everywhere:
/// the series of `erf` where `1 − erf` loses little (`|x| < 1`), the
/// continued fraction of `erfc` beyond, its `e^{−x²}` factor taken in log
/// space.
fn log_erfc(x: f64) -> f64 {
    if x.abs() < ERFC_SERIES_BELOW {
        (1.0 - erf_series(x)).ln()
    } else if x > 0.0 {
        -x * x - 0.5 * PI.ln() + erfc_continued_fraction(x).ln()
    } else {
        // erfc(x) = 2 − erfc(−x), and erfc(−x) ≤ erfc(1) < 0.16 here.
        let complement = (-x * x).exp() / PI.sqrt() * erfc_continued_fraction(-x);
        LN_2 + (-0.5 * complement).ln_1p()
    }
}

/// `erf(x)` from `erf(x) = 2/√π · e^{−x²} · Σₙ 2ⁿ x^{2n+1} / (1·3·…·(2n+1))`,
/// whose terms are all of the sign of `x` (no cancellation), for small `|x|`.
fn erf_series(x: f64) -> f64 {
    let x2 = x * x;
    let (mut term, mut sum) = (x, x);
    let mut n = 0u32;
    // The terms fall once 2n + 1 > 2x², and geometrically after that.
    while term.abs() > sum.abs() * f64::EPSILON / 4.0 {
        n += 1;
        term *= 2.0 * x2 / f64::from(2 * n + 1);
        sum += term;
    }
    2.0 / PI.sqrt() * (-x2).exp() * sum
}

/// `K(x) = √π · e^{x²} · erfc(x)` for `x ≥ 1`, from Laplace's continued
/// fraction `K(x) = 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + …))))`, evaluated by
/// the modified Lentz method (Press et al., Numerical Recipes, §5.2).
fn erfc_continued_fraction(x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    // f = x + a₁/(x + a₂/(x + …)) with aₙ = n/2; K = 1/f.
    let (mut f, mut c, mut d) = (x, x, 0.0);
    for n in 1..1000u32 {
        let a = f64::from(n) * 0.5;
        d = x + a * d;
        d = if d.abs() < TINY { 1.0 / TINY } else { 1.0 / d };
        c = x + a / c;
        if c.abs() < TINY {
            c = TINY;
        }
        let change = c * d;
        f *= change;
        if (change - 1.0).abs() <= f64::EPSILON / 2.0 {
            break;
        }
    }
    1.0 / f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_close(actual: f64, expected: f64, relative: f64, what: &str) {
        let error = (actual - expected).abs() / expected.abs().max(f64::MIN_POSITIVE);
        assert!(
            error <= relative,
            "{what}: {actual:e} vs {expected:e} (relative error {error:e} > {relative:e})"
        );
    }

    #[test]
    fn log_erfc_matches_high_precision_values() {
        // ln erfc(x) from mpmath at 50 digits, rounded to float64.
        let reference = [
            (-6.0, LN_2), // 0.6931471805599453: erfc(6) < 1e-16
            (-2.5, 0.6929436838471712),
            (-1.6, 0.6812508911460097),
            (-1.5, 0.6760545027339606),
            (-0.9999, 0.6112097880472299),
            (1.0001, -1.849869415115786),
            (-0.3, 0.28414589714140825),
            (0.5, -0.7350111298370844),
            (1.4999, -3.3841412183977524),
            (1.5, -3.3844920895515527),
            (2.75, -9.204140410324296),
            (6.0, -38.37756117322339),
            (27.0, -732.8688865078974),
            (300.0, -90006.27615297306),
        ];
        for (x, expected) in reference {
            assert_close(log_erfc(x), expected, 3e-15, &format!("ln erfc({x})"));
        }
        assert_eq!(log_erfc(0.0), 0.0);
    }

    #[test]
    fn opacus_reference_values() {
        // (q, σ, steps, ε, best order) from Opacus 1.6.0's
        // `get_privacy_spent(compute_rdp(...), delta = 1e-5)` over its default
        // orders (tests/python/opacus_rdp.py). Fractional and integer best
        // orders both appear. The tolerance allows for erfc and binomials
        // computed differently from scipy, a few ulp each; the differences
        // seen are 6e-14 or less.
        let reference = [
            (0.01, 1.0, 1000, 2.1013652716430564, 7.8),
            (0.01, 4.0, 1000, 0.30116115855491327, 48.0),
            (0.1, 1.0, 30, 4.848039837634082, 4.0),
            (0.5, 1.0, 1, 3.8935758781414105, 5.4),
            (0.5, 0.5, 1000, 904.4100371518558, 1.1),
            (1.0, 4.0, 1, 1.0125506277526435, 18.0),
        ];
        let orders = default_orders();
        for (q, sigma, steps, expected, expected_order) in reference {
            let rdp = rdp_sampled_gaussian(q, sigma, steps, &orders);
            let (eps, order) = epsilon(&rdp, &orders, 1e-5);
            let what = format!("q = {q}, σ = {sigma}, {steps} steps");
            assert_close(eps, expected, 1e-12, &what);
            assert_eq!(order, expected_order, "{what}");
            assert_eq!(epsilon_after(q, sigma, steps, 1e-5), eps, "{what}");
        }
    }

    #[test]
    fn full_sampling_is_the_plain_gaussian_mechanism() {
        let orders = default_orders();
        let rdp = rdp_sampled_gaussian(1.0, 2.0, 3, &orders);
        for (value, order) in rdp.iter().zip(&orders) {
            assert_eq!(*value, 3.0 * order / 8.0);
        }
        // The general series tend to α/2σ² as q → 1, at integer and
        // fractional orders: the special case is their limit.
        for order in [2.0, 7.0, 2.5, 6.3] {
            let near = rdp_sampled_gaussian(1.0 - 1e-9, 2.0, 1, &[order])[0];
            assert_close(near, order / 8.0, 1e-6, &format!("order {order}"));
        }
    }

    #[test]
    fn integer_orders_match_the_closed_forms() {
        let (q, sigma) = (0.2f64, 0.8f64);
        let e = |k: f64| (k / (2.0 * sigma * sigma)).exp();
        // A₂ = 1 + q²(e^{1/σ²} − 1); A₃ expanded term by term.
        let a2 = 1.0 + q * q * (e(2.0) - 1.0);
        let p = 1.0 - q;
        let a3 = p.powi(3) + 3.0 * q * p * p + 3.0 * q * q * p * e(2.0) + q.powi(3) * e(6.0);
        let rdp = rdp_sampled_gaussian(q, sigma, 1, &[2.0, 3.0]);
        assert_close(rdp[0], a2.ln(), 1e-14, "order 2");
        assert_close(rdp[1], a3.ln() / 2.0, 1e-14, "order 3");
    }

    #[test]
    fn the_fractional_series_agrees_with_the_binomial_sum_at_integers() {
        // The two-series formula holds at every α, so forcing it at integer
        // orders checks it (and log_erfc) against the independent binomial sum.
        for (q, sigma) in [(0.01, 0.5), (0.1, 1.0), (0.5, 1.5), (0.9, 4.0)] {
            for alpha in [2.0, 3.0, 8.0, 20.0] {
                assert_close(
                    log_a_fractional(q, sigma, alpha),
                    log_a_integer(q, sigma, alpha),
                    1e-12,
                    &format!("q = {q}, σ = {sigma}, α = {alpha}"),
                );
            }
        }
    }

    #[test]
    fn rdp_adds_up_over_steps_and_epsilon_grows_with_them() {
        let orders = default_orders();
        let one = rdp_sampled_gaussian(0.05, 1.1, 1, &orders);
        let many = rdp_sampled_gaussian(0.05, 1.1, 250, &orders);
        for (a, b) in one.iter().zip(&many) {
            assert_eq!(a * 250.0, *b);
        }
        let epsilons: Vec<f64> = [1, 10, 100, 1000]
            .iter()
            .map(|&steps| epsilon_after(0.05, 1.1, steps, 1e-5))
            .collect();
        assert!(epsilons.windows(2).all(|w| w[0] < w[1]), "{epsilons:?}");
        assert_eq!(epsilon_after(0.05, 1.1, 0, 1e-5), 0.0);
    }

    #[test]
    fn epsilon_falls_as_the_noise_grows() {
        let epsilons: Vec<f64> = [0.6, 0.8, 1.0, 2.0, 5.0]
            .iter()
            .map(|&sigma| epsilon_after(0.1, sigma, 100, 1e-5))
            .collect();
        assert!(epsilons.windows(2).all(|w| w[0] > w[1]), "{epsilons:?}");
    }

    #[test]
    fn special_cases_follow_opacus() {
        let orders = default_orders();
        assert_eq!(orders.len(), 151);
        assert_eq!((orders[0], orders[98], orders[99]), (1.1, 10.9, 12.0));
        assert_eq!(orders[150], 63.0);

        // Nothing sampled: RDP 0, yet Opacus's conversion leaves a positive ε.
        let zero = rdp_sampled_gaussian(0.0, 1.0, 30, &orders);
        assert!(zero.iter().all(|&r| r == 0.0));
        let (eps, order) = epsilon(&zero, &orders, 1e-5);
        assert_close(eps, 0.10286725121127971, 1e-14, "q = 0");
        assert_eq!(order, 63.0);

        // No noise: no privacy; Opacus returns the first order then.
        let none = rdp_sampled_gaussian(0.1, 0.0, 30, &orders);
        assert!(none.iter().all(|r| r.is_infinite()));
        assert_eq!(epsilon(&none, &orders, 1e-5), (f64::INFINITY, 1.1));
        assert_eq!(
            rdp_sampled_gaussian(0.1, 1.0, 1, &[f64::INFINITY]),
            [f64::INFINITY]
        );

        let (eps, order) = epsilon(&[f64::NAN, f64::NAN], &[2.0, 3.0], 1e-5);
        assert!(eps.is_infinite() && order.is_nan());
        let (eps, order) = epsilon(&[f64::NAN, 0.5], &[2.0, 3.0], 1e-5);
        assert_eq!(order, 3.0);
        assert!(eps.is_finite());
    }

    #[test]
    fn log_space_helpers() {
        assert_close(log_add(1.0f64.ln(), 2.0f64.ln()), 3.0f64.ln(), 1e-15, "add");
        assert!(log_sub(3.0f64.ln(), 2.0f64.ln()).abs() < 1e-15);
        assert_eq!(log_sub(5.0f64.ln(), 5.0f64.ln()), f64::NEG_INFINITY);
        assert!(log_sub(1.0, 2.0).is_nan());
        assert_eq!(log_sub(1000.0, 0.0), 1000.0);
        assert_eq!(log_add(f64::NEG_INFINITY, 2.0), 2.0);
    }

    #[test]
    #[should_panic(expected = "sampling rate q = 1.5 is not in [0, 1]")]
    fn a_sampling_rate_above_one_is_refused() {
        rdp_sampled_gaussian(1.5, 1.0, 1, &[2.0]);
    }
}
