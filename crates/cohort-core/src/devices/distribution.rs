//! The seeded distributions a device profile draws its figures from.
//!
//! A figure in the config is a number (the same for every client) or a
//! table naming a distribution and its parameters:
//!
//! ```toml
//! compute = 0.002
//! compute = { distribution = "lognormal", median = 0.002, sigma = 1.0 }
//! compute = { distribution = "two_point", fast = 0.001, slow = 0.01, slow_fraction = 0.2 }
//! ```
//!
//! Every draw takes uniform numbers from the ChaCha8 stream it is given, so a
//! client's figures depend on the seed and the client alone. Normal variates
//! are Box–Muller from two uniforms: cohort has no `rand_distr`, and two
//! uniforms per variate keep the stream's position a plain count.

use rand::Rng;
use serde::{Deserialize, Serialize};

/// One figure of a device profile: a constant or a seeded distribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "toml::Value", into = "toml::Value")]
pub enum Distribution {
    /// The same value for every client.
    Constant { value: f64 },
    /// Uniform on `[low, high]`.
    Uniform { low: f64, high: f64 },
    /// `median · exp(sigma · Z)`, Z standard normal: the median is `e^μ`.
    Lognormal { median: f64, sigma: f64 },
    /// `slow` with probability `slow_fraction`, else `fast`.
    TwoPoint {
        fast: f64,
        slow: f64,
        slow_fraction: f64,
    },
    /// `max(0, mean + sd · Z)`: Plato's `normal`, cut at 0 since no time is
    /// negative.
    Normal { mean: f64, sd: f64 },
    /// `scale · ((1 − U)^(−1/alpha) − 1)`: NumPy's `pareto(alpha)` (the Lomax
    /// distribution, Plato's `pareto`) times `scale`.
    Pareto { alpha: f64, scale: f64 },
}

/// The table form, as serde reads it (its errors name the field).
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "distribution", rename_all = "snake_case", deny_unknown_fields)]
enum Table {
    Constant {
        value: f64,
    },
    Uniform {
        low: f64,
        high: f64,
    },
    Lognormal {
        median: f64,
        sigma: f64,
    },
    TwoPoint {
        fast: f64,
        slow: f64,
        slow_fraction: f64,
    },
    Normal {
        mean: f64,
        sd: f64,
    },
    Pareto {
        alpha: f64,
        #[serde(default = "one")]
        scale: f64,
    },
}

fn one() -> f64 {
    1.0
}

/// The names a table's `distribution` may take.
pub const NAMES: &[&str] = &[
    "constant",
    "uniform",
    "lognormal",
    "two_point",
    "normal",
    "pareto",
];

impl TryFrom<toml::Value> for Distribution {
    type Error = String;

    fn try_from(value: toml::Value) -> Result<Self, String> {
        let number = match &value {
            toml::Value::Float(x) => Some(*x),
            toml::Value::Integer(i) => Some(*i as f64),
            _ => None,
        };
        if let Some(value) = number {
            return Ok(Distribution::Constant { value });
        }
        if !value.is_table() {
            return Err(format!(
                "expected a number or a table with `distribution` (one of {}), found a {}",
                NAMES.join(", "),
                value.type_str()
            ));
        }
        let table: Table = value
            .try_into()
            .map_err(|e: toml::de::Error| e.message().trim_end().to_owned())?;
        Ok(match table {
            Table::Constant { value } => Distribution::Constant { value },
            Table::Uniform { low, high } => Distribution::Uniform { low, high },
            Table::Lognormal { median, sigma } => Distribution::Lognormal { median, sigma },
            Table::TwoPoint {
                fast,
                slow,
                slow_fraction,
            } => Distribution::TwoPoint {
                fast,
                slow,
                slow_fraction,
            },
            Table::Normal { mean, sd } => Distribution::Normal { mean, sd },
            Table::Pareto { alpha, scale } => Distribution::Pareto { alpha, scale },
        })
    }
}

impl From<Distribution> for toml::Value {
    fn from(distribution: Distribution) -> Self {
        let mut table = toml::Table::new();
        let mut put = |key: &str, value: toml::Value| {
            table.insert(key.to_owned(), value);
        };
        let name = |n: &str| toml::Value::String(n.to_owned());
        match distribution {
            Distribution::Constant { value } => return toml::Value::Float(value),
            Distribution::Uniform { low, high } => {
                put("distribution", name("uniform"));
                put("low", low.into());
                put("high", high.into());
            }
            Distribution::Lognormal { median, sigma } => {
                put("distribution", name("lognormal"));
                put("median", median.into());
                put("sigma", sigma.into());
            }
            Distribution::TwoPoint {
                fast,
                slow,
                slow_fraction,
            } => {
                put("distribution", name("two_point"));
                put("fast", fast.into());
                put("slow", slow.into());
                put("slow_fraction", slow_fraction.into());
            }
            Distribution::Normal { mean, sd } => {
                put("distribution", name("normal"));
                put("mean", mean.into());
                put("sd", sd.into());
            }
            Distribution::Pareto { alpha, scale } => {
                put("distribution", name("pareto"));
                put("alpha", alpha.into());
                put("scale", scale.into());
            }
        }
        toml::Value::Table(table)
    }
}

impl Distribution {
    /// Whether every value it can draw lies in `[min, max]` and its
    /// parameters make sense; the reason names the parameter.
    pub fn check(&self, min: f64, max: f64) -> Result<(), String> {
        let within = |name: &str, value: f64| {
            if value.is_finite() && (min..=max).contains(&value) {
                Ok(())
            } else {
                Err(format!(
                    "`{name}` must be a finite number in [{}, {}], got {}",
                    crate::number::shown(min),
                    crate::number::shown(max),
                    crate::number::shown(value)
                ))
            }
        };
        let positive = |name: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(format!(
                    "`{name}` must be a finite number > 0, got {}",
                    crate::number::shown(value)
                ))
            }
        };
        match *self {
            Distribution::Constant { value } => within("value", value),
            Distribution::Uniform { low, high } => {
                within("low", low)?;
                within("high", high)?;
                if low > high {
                    return Err(format!("`low` = {low} is above `high` = {high}"));
                }
                Ok(())
            }
            Distribution::Lognormal { median, sigma } => {
                within("median", median)?;
                // Beyond e^±(8σ) a draw is as good as never; clamped below.
                if !(sigma.is_finite() && (0.0..=10.0).contains(&sigma)) {
                    return Err(format!("`sigma` must be in [0, 10], got {sigma}"));
                }
                Ok(())
            }
            Distribution::TwoPoint {
                fast,
                slow,
                slow_fraction,
            } => {
                within("fast", fast)?;
                within("slow", slow)?;
                if !(0.0..=1.0).contains(&slow_fraction) {
                    return Err(format!(
                        "`slow_fraction` must be in [0, 1], got {slow_fraction}"
                    ));
                }
                Ok(())
            }
            Distribution::Normal { mean, sd } => {
                within("mean", mean)?;
                if !(sd.is_finite() && sd >= 0.0) {
                    return Err(format!("`sd` must be a finite number >= 0, got {sd}"));
                }
                Ok(())
            }
            Distribution::Pareto { alpha, scale } => {
                positive("alpha", alpha)?;
                within("scale", scale)
            }
        }
    }

    /// One draw from `rng`, clamped to `[min, max]` (the tails of a
    /// lognormal, a normal or a Pareto reach any number; a figure must stay
    /// one that result files and checkpoints can hold).
    pub fn sample(&self, rng: &mut impl Rng, min: f64, max: f64) -> f64 {
        let value = match *self {
            Distribution::Constant { value } => value,
            Distribution::Uniform { low, high } => low + (high - low) * rng.random::<f64>(),
            Distribution::Lognormal { median, sigma } => {
                median * (sigma * standard_normal(rng)).exp()
            }
            Distribution::TwoPoint {
                fast,
                slow,
                slow_fraction,
            } => {
                if rng.random::<f64>() < slow_fraction {
                    slow
                } else {
                    fast
                }
            }
            Distribution::Normal { mean, sd } => mean + sd * standard_normal(rng),
            Distribution::Pareto { alpha, scale } => {
                let u: f64 = rng.random();
                scale * ((1.0 - u).powf(-1.0 / alpha) - 1.0)
            }
        };
        if value.is_nan() {
            return min;
        }
        value.clamp(min, max)
    }
}

/// A standard normal variate from two uniforms (Box–Muller).
fn standard_normal(rng: &mut impl Rng) -> f64 {
    // 1 − U is in (0, 1], so the logarithm is finite.
    let u1 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn parse(text: &str) -> Result<Distribution, String> {
        #[derive(Deserialize)]
        struct Holder {
            figure: Distribution,
        }
        toml::from_str::<Holder>(text)
            .map(|h| h.figure)
            .map_err(|e| e.message().to_owned())
    }

    #[test]
    fn a_number_or_a_table_reads_and_writes_back() {
        assert_eq!(
            parse("figure = 3").unwrap(),
            Distribution::Constant { value: 3.0 }
        );
        let lognormal =
            parse(r#"figure = { distribution = "lognormal", median = 0.5, sigma = 1 }"#).unwrap();
        assert_eq!(
            lognormal,
            Distribution::Lognormal {
                median: 0.5,
                sigma: 1.0
            }
        );
        let pareto = parse(r#"figure = { distribution = "pareto", alpha = 1 }"#).unwrap();
        assert_eq!(
            pareto,
            Distribution::Pareto {
                alpha: 1.0,
                scale: 1.0
            }
        );
        for distribution in [lognormal, pareto, Distribution::Constant { value: 2.0 }] {
            let value: toml::Value = distribution.clone().into();
            assert_eq!(Distribution::try_from(value).unwrap(), distribution);
        }
    }

    #[test]
    fn bad_tables_are_refused_naming_what_is_wrong() {
        let unknown =
            parse(r#"figure = { distribution = "lognorml", median = 1, sigma = 1 }"#).unwrap_err();
        assert!(unknown.contains("unknown variant `lognorml`"), "{unknown}");
        let missing = parse(r#"figure = { distribution = "uniform", low = 1 }"#).unwrap_err();
        assert!(missing.contains("missing field `high`"), "{missing}");
        let extra =
            parse(r#"figure = { distribution = "constant", value = 1, mean = 2 }"#).unwrap_err();
        assert!(extra.contains("unknown field `mean`"), "{extra}");
        let text = parse(r#"figure = "fast""#).unwrap_err();
        assert!(text.contains("expected a number or a table"), "{text}");
    }

    #[test]
    fn checks_name_the_parameter_out_of_range() {
        let bad = [
            (Distribution::Constant { value: -1.0 }, "`value`"),
            (
                Distribution::Uniform {
                    low: 2.0,
                    high: 1.0,
                },
                "`low` = 2",
            ),
            (
                Distribution::Lognormal {
                    median: 1.0,
                    sigma: f64::NAN,
                },
                "`sigma`",
            ),
            (
                Distribution::TwoPoint {
                    fast: 1.0,
                    slow: 2.0,
                    slow_fraction: 1.5,
                },
                "`slow_fraction`",
            ),
            (
                Distribution::Pareto {
                    alpha: 0.0,
                    scale: 1.0,
                },
                "`alpha`",
            ),
        ];
        for (distribution, named) in bad {
            let reason = distribution.check(0.0, 100.0).unwrap_err();
            assert!(reason.contains(named), "{reason}");
        }
        assert_eq!(
            Distribution::Constant { value: 5.0 }.check(0.0, 10.0),
            Ok(())
        );
    }

    #[test]
    fn draws_follow_their_distribution() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let n = 20_000;
        let draws = |d: &Distribution, rng: &mut ChaCha8Rng| -> Vec<f64> {
            (0..n).map(|_| d.sample(rng, 0.0, 1e12)).collect()
        };
        // The lognormal's median is its `median`: half the draws below it.
        let lognormal = Distribution::Lognormal {
            median: 2.0,
            sigma: 1.0,
        };
        let below = draws(&lognormal, &mut rng)
            .iter()
            .filter(|&&x| x < 2.0)
            .count();
        assert!((below as f64 / n as f64 - 0.5).abs() < 0.02, "{below}");
        // Two points: about slow_fraction of them slow, nothing else.
        let two = Distribution::TwoPoint {
            fast: 1.0,
            slow: 9.0,
            slow_fraction: 0.25,
        };
        let values = draws(&two, &mut rng);
        assert!(values.iter().all(|&x| x == 1.0 || x == 9.0));
        let slow = values.iter().filter(|&&x| x == 9.0).count() as f64 / n as f64;
        assert!((slow - 0.25).abs() < 0.02, "{slow}");
        // Lomax(α = 3) has mean 1 / (α − 1) = 0.5.
        let pareto = Distribution::Pareto {
            alpha: 3.0,
            scale: 1.0,
        };
        let mean = draws(&pareto, &mut rng).iter().sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.05, "{mean}");
        // Uniform stays inside its bounds; a normal is cut at the minimum.
        let uniform = Distribution::Uniform {
            low: 3.0,
            high: 4.0,
        };
        assert!(
            draws(&uniform, &mut rng)
                .iter()
                .all(|x| (3.0..=4.0).contains(x))
        );
        let normal = Distribution::Normal { mean: 0.0, sd: 1.0 };
        let cut = draws(&normal, &mut rng);
        assert!(cut.iter().all(|&x| x >= 0.0));
        assert!(cut.iter().filter(|&&x| x == 0.0).count() > n / 3);
    }

    proptest::proptest! {
        #[test]
        fn every_draw_is_within_its_bounds(
            seed in proptest::prelude::any::<u64>(),
            median in 1e-6f64..1e3,
            sigma in 0.0f64..10.0,
            max in 1.0f64..1e6,
        ) {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let d = Distribution::Lognormal { median, sigma };
            for _ in 0..64 {
                let x = d.sample(&mut rng, 1e-9, max);
                proptest::prop_assert!(x.is_finite() && (1e-9..=max).contains(&x));
            }
        }
    }
}
