use super::*;
use proptest::prelude::*;

fn rng(seed: u64) -> ChaCha20Rng {
    ChaCha20Rng::seed_from_u64(seed)
}

/// The pmf of `N_Z(0, σ²)` on `-limit..=limit`, normalised over a range wide
/// enough that the rest is below 1e-300.
fn pmf(sigma: f64, limit: i64) -> Vec<f64> {
    let wide = (40.0 * sigma).ceil() as i64 + 10;
    let weight = |x: i64| (-(x as f64).powi(2) / (2.0 * sigma * sigma)).exp();
    let total: f64 = (-wide..=wide).map(weight).sum();
    (-limit..=limit).map(|x| weight(x) / total).collect()
}

/// The exact variance of `N_Z(0, σ²)`, from its pmf.
fn exact_variance(sigma: f64) -> f64 {
    let limit = (40.0 * sigma).ceil() as i64 + 10;
    pmf(sigma, limit)
        .iter()
        .zip(-limit..)
        .map(|(p, x)| p * (x * x) as f64)
        .sum()
}

/// Pearson's statistic of `samples` against the pmf of `sigma` over the
/// integers within 3σ (each tail lumped into one bin), and its degrees of
/// freedom.
fn chi_squared(samples: &[i64], sigma: f64) -> (f64, usize) {
    let limit = (3.0 * sigma).ceil() as i64;
    let inner = pmf(sigma, limit);
    let tail = (1.0 - inner.iter().sum::<f64>()) / 2.0;
    let mut observed = vec![0u64; inner.len() + 2];
    for &s in samples {
        let bin = if s < -limit {
            0
        } else if s > limit {
            inner.len() + 1
        } else {
            (s + limit) as usize + 1
        };
        observed[bin] += 1;
    }
    let expected: Vec<f64> = [tail].into_iter().chain(inner).chain([tail]).collect();
    let n = samples.len() as f64;
    let statistic = observed
        .iter()
        .zip(&expected)
        .filter(|(_, p)| **p * n > 0.0)
        .map(|(&o, &p)| (o as f64 - p * n).powi(2) / (p * n))
        .sum();
    (statistic, expected.len() - 1)
}

/// The chi-squared quantile at 1 − 0.001 (Wilson–Hilferty), so a correct
/// sampler fails one test in a thousand seeds; these seeds are fixed.
fn chi_squared_limit(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.090_232;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn the_sampler_has_the_discrete_gaussians_moments_and_pmf() {
    for (seed, sigma) in [(1u64, 0.7), (2, 3.0), (3, 25.5)] {
        let mut r = rng(seed);
        let n = 60_000;
        let samples: Vec<i64> = (0..n)
            .map(|_| sample_discrete_gaussian(sigma, &mut r))
            .collect();
        let mean = samples.iter().sum::<i64>() as f64 / n as f64;
        let variance = samples
            .iter()
            .map(|&s| (s as f64 - mean).powi(2))
            .sum::<f64>()
            / n as f64;
        let exact = exact_variance(sigma);
        // Five standard errors of each estimate (a Gaussian's fourth moment).
        assert!(
            mean.abs() < 5.0 * (exact / n as f64).sqrt(),
            "σ {sigma}: mean {mean}"
        );
        let spread = 5.0 * exact * (2.0 / n as f64).sqrt();
        assert!(
            (variance - exact).abs() < spread,
            "σ {sigma}: {variance} vs {exact}"
        );
        let (statistic, df) = chi_squared(&samples, sigma);
        assert!(
            statistic < chi_squared_limit(df),
            "σ {sigma}: χ² {statistic}, df {df}"
        );
        // The test has power: the same draws against a 10% wider pmf fail it.
        let (wrong, df) = chi_squared(&samples, sigma * 1.1);
        assert!(
            wrong > chi_squared_limit(df),
            "σ {sigma}: χ² {wrong} vs the wrong pmf"
        );
    }
    // Below 1, N_Z's variance falls below σ² (0.215 at σ = 0.5, 0.0077 at
    // 0.3): the test above compares against the exact one.
    assert!((exact_variance(0.5) - 0.215_012_675).abs() < 1e-8);
    assert!((exact_variance(0.3) - 0.007_672_519).abs() < 1e-8);
    assert!((exact_variance(3.0) - 9.0).abs() < 1e-9);
    assert_eq!(sample_discrete_gaussian(0.0, &mut rng(0)), 0);
}

#[test]
fn bernoulli_of_exp_minus_gamma_has_its_probability() {
    for gamma in [0.0, 0.3, 1.0, 2.5] {
        let mut r = rng(7);
        let n = 40_000;
        let hits = (0..n).filter(|_| bernoulli_exp_neg(gamma, &mut r)).count();
        let p = (-gamma).exp();
        let frequency = hits as f64 / n as f64;
        let spread = 5.0 * (p * (1.0 - p) / n as f64).sqrt() + 1e-12;
        assert!(
            (frequency - p).abs() <= spread,
            "γ {gamma}: {frequency} vs {p}"
        );
    }
}

#[test]
fn the_hadamard_transform_on_a_hand_computed_vector() {
    let mut v = vec![1.0, 0.0, 0.0, 0.0];
    walsh_hadamard(&mut v);
    assert_eq!(v, [0.5; 4]);
    let mut v = vec![1.0, 2.0, 3.0, 4.0];
    walsh_hadamard(&mut v);
    assert_eq!(v, [5.0, -1.0, -2.0, 0.0]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The rotation is orthogonal: it keeps the norm, and its inverse undoes
    /// it up to float rounding.
    #[test]
    fn the_rotation_is_orthogonal(
        values in proptest::collection::vec(-10.0f64..10.0, 1..300),
        seed in any::<u64>(),
    ) {
        let padded = values.len().next_power_of_two();
        let rotated = rotate(&values, padded, seed);
        prop_assert_eq!(rotated.len(), padded);
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let n = norm(&values);
        prop_assert!((norm(&rotated) - n).abs() <= 1e-12 * (1.0 + n));
        let back = unrotate(&rotated, values.len(), seed);
        prop_assert_eq!(back.len(), values.len());
        for (b, v) in back.iter().zip(&values) {
            prop_assert!((b - v).abs() <= 1e-12 * (1.0 + n), "{} vs {}", b, v);
        }
    }

    /// Rounding moves each value by less than one, keeps the norm bound,
    /// and is reproducible from its seed.
    #[test]
    fn conditional_rounding_is_bounded(
        values in proptest::collection::vec(-50.0f64..50.0, 1..200),
        seed in any::<u64>(),
    ) {
        let norm = values.iter().map(|x| x * x).sum::<f64>().sqrt();
        let bound = rounded_norm_bound(norm, ROUNDING_BETA, values.len());
        let rounded = conditional_round(&values, bound, &mut rng(seed)).unwrap();
        let rounded_norm = rounded.iter().map(|&x| (x * x) as f64).sum::<f64>().sqrt();
        prop_assert!(rounded_norm <= bound);
        for (&r, &v) in rounded.iter().zip(&values) {
            prop_assert!((r as f64 - v).abs() < 1.0);
        }
        prop_assert_eq!(rounded, conditional_round(&values, bound, &mut rng(seed)).unwrap());
    }
}

#[test]
fn rounding_is_unbiased_and_gives_up_with_an_error() {
    let values = [0.25, -1.75, 3.5];
    let mut r = rng(11);
    let trials = 20_000;
    let mut sums = [0.0; 3];
    for _ in 0..trials {
        let rounded = conditional_round(&values, f64::INFINITY, &mut r).unwrap();
        sums.iter_mut()
            .zip(&rounded)
            .for_each(|(s, &x)| *s += x as f64);
    }
    for (s, v) in sums.iter().zip(values) {
        // Each draw's variance is at most 1/4.
        assert!((s / trials as f64 - v).abs() < 5.0 * (0.25 / trials as f64).sqrt());
    }
    // Every rounding of [1.5; 4] has norm at least 2.
    let error = conditional_round(&[1.5; 4], 1.0, &mut r).unwrap_err();
    assert_eq!(
        error,
        DdgError::Rounding {
            bound: 1.0,
            attempts: MAX_ROUNDING_ATTEMPTS
        }
    );
    assert!(error.to_string().contains("1000 attempts"), "{error}");
}

#[test]
fn the_rounded_norm_bound_by_hand() {
    // √(1000² + 65536/4 + √(2·½)·(1000 + 256/2)) = √1017512.
    let bound = rounded_norm_bound(1000.0, ROUNDING_BETA, 65536);
    assert!((bound - 1_017_512f64.sqrt()).abs() < 1e-9, "{bound}");
    // √(0.25 + 1 + 1·(0.5 + 1)) = √2.75 is below 0.5 + √4.
    assert!((rounded_norm_bound(0.5, ROUNDING_BETA, 4) - 2.75f64.sqrt()).abs() < 1e-15);
    // With a tiny β the conditioning buys nothing: √(9 + 4 + 7.43·5) > 3 + 4.
    assert_eq!(rounded_norm_bound(3.0, 1e-12, 16), 7.0);
    assert_eq!(rounded_norm_bound(3.0, 0.0, 16), 7.0);
}

#[test]
fn clipping_scales_only_long_vectors() {
    let mut long = vec![3.0, 4.0];
    assert_eq!(clip_to_norm(&mut long, 1.0), 5.0);
    assert!((long[0] - 0.6).abs() < 1e-15 && (long[1] - 0.8).abs() < 1e-15);
    let mut short = vec![0.3, 0.4];
    clip_to_norm(&mut short, 1.0);
    assert_eq!(short, [0.3, 0.4]);
}

fn params(z: f64, n: usize, granularity: Option<f64>) -> DdgParams {
    DdgParams {
        clip_norm: 1.0,
        noise_multiplier: z,
        expected_clients: n,
        granularity,
        delta: 1e-5,
    }
}

#[test]
fn resolve_names_each_bad_value() {
    let name = |p: DdgParams| match p.resolve(10, 1 << 32).unwrap_err() {
        DdgError::Param { name, .. } => name,
        other => panic!("{other}"),
    };
    assert_eq!(
        name(DdgParams {
            clip_norm: 0.0,
            ..params(1.0, 4, None)
        }),
        "clip_norm"
    );
    assert_eq!(name(params(f64::NAN, 4, None)), "noise_multiplier");
    assert_eq!(name(params(-1.0, 4, None)), "noise_multiplier");
    assert_eq!(name(params(1.0, 4, Some(0.0))), "granularity");
    assert_eq!(
        name(DdgParams {
            delta: 1.0,
            ..params(1.0, 4, None)
        }),
        "delta"
    );
    assert_eq!(name(params(1.0, 0, None)), "clients.per_round");
    let p = params(1.0, 4, None);
    assert_eq!(p.resolve(0, 1 << 32).unwrap_err(), DdgError::Empty);
    assert!(matches!(
        p.resolve(10, 1000),
        Err(DdgError::Param {
            name: "modulus_range",
            ..
        })
    ));
    // 4 clients at 4 standard deviations need modulus² > 64.
    assert!(matches!(
        p.resolve(10, 8),
        Err(DdgError::ModulusTooSmall { .. })
    ));
    assert!(matches!(
        params(1.0, 4, Some(1e-20)).resolve(10, 1 << 32),
        Err(DdgError::TooFine { .. })
    ));
    let message = p.resolve(10, 8).unwrap_err().to_string();
    assert!(message.contains("modulus_range 8"), "{message}");
}

#[test]
fn the_default_granularity_by_hand() {
    // d = 3 pads to 4; n = 4, z = 1, c = 1: local std 1/2, spread
    // √(16/4 + 4·1/4) = √5, γ = 2·4·√5 / √(2^32² − 64).
    let ddg = params(1.0, 4, None).resolve(3, 1 << 32).unwrap();
    assert_eq!(ddg.padded, 4);
    let m = (1u64 << 32) as f64;
    let gamma = 8.0 * 5f64.sqrt() / (m * m - 64.0).sqrt();
    assert!(
        (ddg.gamma / gamma - 1.0).abs() < 1e-12,
        "{} vs {gamma}",
        ddg.gamma
    );
    assert!((ddg.local_sigma - 0.5 / gamma).abs() / ddg.local_sigma < 1e-12);
}

/// The mean of `changes` after each is clipped to `clip`, in f64.
fn clipped_mean(changes: &[Vec<f32>], clip: f64) -> Vec<f64> {
    let dim = changes[0].len();
    let mut mean = vec![0.0; dim];
    for change in changes {
        let mut x: Vec<f64> = change.iter().map(|&v| f64::from(v)).collect();
        clip_to_norm(&mut x, clip);
        mean.iter_mut()
            .zip(x)
            .for_each(|(m, v)| *m += v / changes.len() as f64);
    }
    mean
}

/// The modular sum of the clients' encodings, as the server unmasks it.
fn modular_sum(encoded: &[Vec<u32>], modulus: u64) -> Vec<u32> {
    let mut sum = vec![0u64; encoded[0].len()];
    for e in encoded {
        sum.iter_mut()
            .zip(e)
            .for_each(|(s, &v)| *s = (*s + u64::from(v)) % modulus);
    }
    sum.into_iter().map(|s| s as u32).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Without noise the decoded mean is the mean of the clipped changes
    /// within [`Ddg::noiseless_error_bound`] (`γ·√d'`; here the sum cannot
    /// wrap: n·Δ₂ is far below m/2).
    #[test]
    fn without_noise_the_mean_is_within_the_rounding_bound(
        changes in proptest::collection::vec(proptest::collection::vec(-2.0f32..2.0, 7), 1..6),
        gamma_exp in 4i32..12,
        seed in any::<u64>(),
    ) {
        let gamma = 2f64.powi(-gamma_exp);
        let n = changes.len();
        let ddg = params(0.0, n, Some(gamma)).resolve(7, 1 << 32).unwrap();
        prop_assert!(n as f64 * ddg.norm_bound < (1u64 << 31) as f64);
        let mut r = rng(seed);
        let encoded: Vec<Vec<u32>> =
            changes.iter().map(|c| ddg.encode(c, seed, &mut r).unwrap()).collect();
        let mean = ddg.decode(&modular_sum(&encoded, 1 << 32), n, seed).unwrap();
        let bound = ddg.noiseless_error_bound();
        for (got, want) in mean.iter().zip(clipped_mean(&changes, 1.0)) {
            prop_assert!((got - want).abs() <= bound, "{} vs {}, bound {}", got, want, bound);
        }
    }
}

#[test]
fn the_noise_shares_add_up_to_the_stated_variance() {
    // 8 clients at z = 2: the mean's noise has std z·c/n = 0.25 per value.
    let n = 8;
    let ddg = params(2.0, n, Some(1e-3)).resolve(1000, 1 << 32).unwrap();
    assert!((ddg.mean_noise_std(n) - 0.25).abs() < 1e-12);
    let mut r = rng(5);
    let zeros = vec![0.0f32; 1000];
    let mut values = Vec::new();
    for trial in 0..4 {
        let encoded: Vec<Vec<u32>> = (0..n)
            .map(|_| ddg.encode(&zeros, trial, &mut r).unwrap())
            .collect();
        values.extend(
            ddg.decode(&modular_sum(&encoded, 1 << 32), n, trial)
                .unwrap(),
        );
    }
    let count = values.len() as f64;
    let mean = values.iter().sum::<f64>() / count;
    let std = (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / count).sqrt();
    // 4000 values: the std estimate is within 5·std/√(2·4000) ≈ 5.6%.
    assert!(
        (std / 0.25 - 1.0).abs() < 5.0 / (2.0 * count).sqrt(),
        "{std}"
    );
    assert!(mean.abs() < 5.0 * 0.25 / count.sqrt(), "{mean}");
    // Fewer contributors: less noise, as the accountant assumes.
    assert!(ddg.mean_noise_std(4) * 4.0 < ddg.mean_noise_std(8) * 8.0);
}

#[test]
fn the_same_seed_gives_the_same_bits() {
    let ddg = params(1.0, 3, None).resolve(50, 1 << 32).unwrap();
    let change: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let a = ddg.encode(&change, 9, &mut rng(1)).unwrap();
    assert_eq!(a, ddg.encode(&change, 9, &mut rng(1)).unwrap());
    assert_ne!(a, ddg.encode(&change, 9, &mut rng(2)).unwrap());
    assert_ne!(a, ddg.encode(&change, 10, &mut rng(1)).unwrap());
    assert_eq!((a.len(), a[0]), (65, 1));
}

#[test]
fn bad_inputs_are_errors() {
    let ddg = params(1.0, 3, None).resolve(4, 1 << 32).unwrap();
    let mut r = rng(0);
    assert_eq!(
        ddg.encode(&[0.0; 3], 0, &mut r).unwrap_err(),
        DdgError::Length {
            got: 3,
            expected: 4
        }
    );
    assert_eq!(
        ddg.encode(&[0.0, f32::NAN, 0.0, 0.0], 0, &mut r)
            .unwrap_err(),
        DdgError::NotFinite { index: 1 }
    );
    let sum = vec![2u32, 0, 0, 0, 0];
    assert!(ddg.decode(&sum, 2, 0).is_ok());
    assert_eq!(
        ddg.decode(&sum, 3, 0).unwrap_err(),
        DdgError::Count {
            got: 2,
            expected: 3
        }
    );
    assert!(matches!(
        ddg.decode(&sum[..4], 2, 0),
        Err(DdgError::Length { .. })
    ));
    assert!(ddg.decode(&sum, 0, 0).is_err());
}

/// A mechanism with the reference's sensitivity: `rounded_l2_norm_bound`
/// of `c/γ` with no leeway, as `ddgauss_epsilon` computes it.
fn reference_ddg(gamma: f64, z: f64, n: usize, c: f64, padded: usize, delta: f64) -> Ddg {
    Ddg {
        dim: padded,
        padded,
        gamma,
        clip_norm: c,
        local_sigma: z * c / (n as f64).sqrt() / gamma,
        norm_bound: rounded_norm_bound(c / gamma, ROUNDING_BETA, padded),
        modulus: 1 << 32,
        delta,
    }
}

fn epsilon_after(ddg: &Ddg, contributors: &[usize]) -> f64 {
    let mut accountant = DdgAccountant::default();
    contributors.iter().for_each(|&n| accountant.record(ddg, n));
    accountant.epsilon(ddg.delta)
}

#[test]
fn the_accountant_agrees_with_the_reference_formulas() {
    // (γ, z, n, c, d', rounds, δ) → ε of `accounting_utils.ddgauss_epsilon`
    // (q = 1) with TF Privacy's conversion, computed in plain Python from
    // the reference's formulas. The second case has τ ≈ 0.0105.
    let cases = [
        (1e-3, 1.0, 100, 1.0, 65536, 10, 1e-5, 20.064371480042897),
        (0.3, 0.8, 10, 1.0, 1024, 5, 1e-5, 223.34774456281),
        (0.01, 2.0, 20, 0.5, 4096, 100, 1e-6, 48.48921619684438),
    ];
    for (gamma, z, n, c, padded, rounds, delta, expected) in cases {
        let ddg = reference_ddg(gamma, z, n, c, padded, delta);
        let eps = epsilon_after(&ddg, &vec![n; rounds]);
        assert!((eps / expected - 1.0).abs() < 1e-9, "{eps} vs {expected}");
    }
}

#[test]
fn the_accountant_is_monotone() {
    let ddg = |z| reference_ddg(1e-3, z, 50, 1.0, 4096, 1e-5);
    let one = epsilon_after(&ddg(1.0), &[50]);
    let ten = epsilon_after(&ddg(1.0), &[50; 10]);
    assert!(one < ten, "{one} vs {ten}");
    let noisier = epsilon_after(&ddg(2.0), &[50; 10]);
    assert!(noisier < ten, "{noisier} vs {ten}");
    // Much noise, little privacy spent.
    assert!(epsilon_after(&ddg(100.0), &[50]) < 0.2);
    // Half the clients dropped: half the noise variance, more ε.
    assert!(epsilon_after(&ddg(1.0), &[25; 10]) > ten);
    // A round without contributors costs nothing; no noise costs all.
    assert_eq!(epsilon_after(&ddg(1.0), &[0, 50]), one);
    assert_eq!(epsilon_after(&ddg(0.0), &[50]), f64::INFINITY);
    assert_eq!(DdgAccountant::default().epsilon(1e-5), 0.0);
}

#[test]
fn at_large_sigma_the_accountant_is_the_gaussian_mechanisms() {
    // τ vanishes, so one round is the Gaussian mechanism's RDP α/(2z'²)
    // with z' = z·(c/γ)/Δ₂, the noise relative to the rounded sensitivity.
    let ddg = reference_ddg(1e-4, 1.5, 30, 1.0, 1024, 1e-5);
    let orders = rdp_orders();
    let z_effective = 1.5 * (1.0 / 1e-4) / ddg.norm_bound;
    for (rdp, alpha) in ddg.round_rdp(30, &orders).iter().zip(&orders) {
        let gaussian = alpha / (2.0 * z_effective * z_effective);
        assert!(
            (rdp / gaussian - 1.0).abs() < 1e-12,
            "α {alpha}: {rdp} vs {gaussian}"
        );
    }
}
