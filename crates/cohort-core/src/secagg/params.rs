//! The protocol parameters, with the names and meanings of Flower's
//! `SecAggPlusWorkflow`, and their validation.

/// How many parties each client shares its secrets with, itself included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumShares {
    /// SecAgg+: each client has `k - 1` neighbours in a random `k`-regular
    /// graph and keeps one share itself. `k` must be odd (an even degree
    /// `k - 1` is possible on any number of clients, an odd one is not); when
    /// `k` is at least the number of clients the graph is complete.
    Neighbours(usize),
    /// SecAgg: the complete graph; every client shares with every other.
    All,
}

/// The parameters of one secure-aggregation round.
///
/// Flower also accepts fractions for `num_shares` and
/// `reconstruction_threshold` and resolves them against the number of
/// sampled clients at run time; here both are resolved counts, which keeps
/// the protocol core free of sampling policy (the config layer resolves them).
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// The number of shares each client's secrets are split into (`k`).
    pub num_shares: NumShares,
    /// The number of shares needed to reconstruct a secret (`t`).
    pub reconstruction_threshold: usize,
    /// The largest weight (e.g. number of examples) one client may carry;
    /// weights are sent as `weight / max_weight`, quantised.
    pub max_weight: f64,
    /// Values (after weighting) are clipped to `[-clipping_range, clipping_range]`.
    pub clipping_range: f64,
    /// Clipped values are quantised to integers in `[0, quantization_range]`.
    pub quantization_range: u64,
    /// Arithmetic on masked vectors is modulo `modulus_range`, a power of two
    /// no larger than `2^32` (vectors are `u32`).
    pub modulus_range: u64,
}

impl Params {
    /// The given graph and threshold (Flower requires both) with Flower's
    /// defaults for the rest: `max_weight` 1000, `clipping_range` 8,
    /// `quantization_range` 2^22, `modulus_range` 2^32.
    pub fn new(num_shares: NumShares, reconstruction_threshold: usize) -> Self {
        Params {
            num_shares,
            reconstruction_threshold,
            max_weight: 1000.0,
            clipping_range: 8.0,
            quantization_range: 1 << 22,
            modulus_range: 1 << 32,
        }
    }
}

/// A parameter out of range; each variant names the value and what was expected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamsError {
    #[error("num_shares is {0}; expected an odd number of at least 3")]
    NumShares(usize),
    #[error(
        "reconstruction_threshold is {threshold}; expected at least 2 and at most num_shares ({num_shares})"
    )]
    ThresholdRange { threshold: usize, num_shares: usize },
    #[error(
        "reconstruction_threshold is {0}; expected at least 2, so that no single share reveals a secret"
    )]
    ThresholdTooSmall(usize),
    #[error(
        "reconstruction_threshold is {threshold}; expected more than half of num_shares ({num_shares}), so that a malicious server cannot collect both shares of one client's secrets"
    )]
    ThresholdMajority { threshold: usize, num_shares: usize },
    #[error("{name} is {value}; expected a finite number greater than 0")]
    NotPositive { name: &'static str, value: f64 },
    #[error("quantization_range is 0; expected at least 1")]
    QuantizationRange,
    #[error(
        "modulus_range is {modulus}; expected a power of two greater than quantization_range ({quantization}) and at most 2^32"
    )]
    ModulusRange { modulus: u64, quantization: u64 },
    #[error(
        "{clients} clients with quantization_range {quantization} can sum to {clients}×{quantization}, which does not fit below modulus_range {modulus}; lower quantization_range or raise modulus_range"
    )]
    Overflow {
        clients: usize,
        quantization: u64,
        modulus: u64,
    },
    #[error(
        "{clients} clients cannot meet reconstruction_threshold {threshold}; expected at least 2 clients and no fewer than the threshold"
    )]
    TooFewClients { clients: usize, threshold: usize },
}

impl Params {
    /// Checks every parameter on its own; [`Params::check_for`] adds the
    /// checks that depend on the number of clients.
    pub fn validate(&self) -> Result<(), ParamsError> {
        let t = self.reconstruction_threshold;
        if let NumShares::Neighbours(k) = self.num_shares {
            if k < 3 || k.is_multiple_of(2) {
                return Err(ParamsError::NumShares(k));
            }
            if t < 2 || t > k {
                return Err(ParamsError::ThresholdRange {
                    threshold: t,
                    num_shares: k,
                });
            }
            if 2 * t <= k {
                return Err(ParamsError::ThresholdMajority {
                    threshold: t,
                    num_shares: k,
                });
            }
        } else if t < 2 {
            return Err(ParamsError::ThresholdTooSmall(t));
        }
        for (name, value) in [
            ("max_weight", self.max_weight),
            ("clipping_range", self.clipping_range),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(ParamsError::NotPositive { name, value });
            }
        }
        if self.quantization_range == 0 {
            return Err(ParamsError::QuantizationRange);
        }
        let m = self.modulus_range;
        if !m.is_power_of_two() || m > 1 << 32 || m <= self.quantization_range {
            return Err(ParamsError::ModulusRange {
                modulus: m,
                quantization: self.quantization_range,
            });
        }
        Ok(())
    }

    /// Checks the parameters for a round of `clients` clients: the shares
    /// per client for that round, the threshold against it, and that the sum
    /// of every client's quantised values (each at most
    /// `quantization_range`, the weight entry included) stays below the
    /// modulus. Flower only warns about the overflow; here it is refused,
    /// because an overflowing sum is silently wrong.
    pub fn check_for(&self, clients: usize) -> Result<usize, ParamsError> {
        self.validate()?;
        let k = self.shares_for(clients);
        let t = self.reconstruction_threshold;
        if clients < 2 || t > k {
            return Err(ParamsError::TooFewClients {
                clients,
                threshold: t,
            });
        }
        if 2 * t <= k {
            return Err(ParamsError::ThresholdMajority {
                threshold: t,
                num_shares: k,
            });
        }
        let fits = (clients as u128) * u128::from(self.quantization_range)
            < u128::from(self.modulus_range);
        if !fits {
            return Err(ParamsError::Overflow {
                clients,
                quantization: self.quantization_range,
                modulus: self.modulus_range,
            });
        }
        Ok(k)
    }

    /// The shares per client (self included) in a round of `clients`.
    pub fn shares_for(&self, clients: usize) -> usize {
        match self.num_shares {
            NumShares::Neighbours(k) => k.min(clients),
            NumShares::All => clients,
        }
    }

    /// An upper bound on the probability that a round of `clients` aborts
    /// because some secret has fewer than `reconstruction_threshold` shares
    /// left, when each client drops out independently with probability
    /// `dropout`: a client that stays needs `t − 1` of its `k − 1` peers'
    /// shares beside its own, one that drops needs `t` of them, and a union
    /// bound over the clients (at most 1). It is what the random graph and
    /// the threshold cost in dropout tolerance; dropouts that are not
    /// independent (a whole site going down) can do worse.
    pub fn abort_bound(&self, clients: usize, dropout: f64) -> f64 {
        let dropout = dropout.clamp(0.0, 1.0);
        let peers = self.shares_for(clients).saturating_sub(1);
        let t = self.reconstruction_threshold;
        let stays = binomial_below(peers, 1.0 - dropout, t.saturating_sub(1));
        let drops = binomial_below(peers, 1.0 - dropout, t);
        let per_client = (1.0 - dropout) * stays + dropout * drops;
        (clients as f64 * per_client).min(1.0)
    }

    /// The largest dropout, in whole percent, at which [`Self::abort_bound`]
    /// stays at or below `risk` for a round of `clients`.
    pub fn dropout_tolerance(&self, clients: usize, risk: f64) -> u32 {
        (0..100)
            .take_while(|&percent| self.abort_bound(clients, f64::from(percent) / 100.0) <= risk)
            .last()
            .unwrap_or(0)
    }

    /// The bit mask that reduces a `u32` modulo `modulus_range`.
    pub(crate) fn modulus_mask(&self) -> u32 {
        (self.modulus_range - 1) as u32
    }
}

/// `P(X < below)` for `X ~ Binomial(n, p)`, summed in log space, so that a
/// large `n` (terms like `(1 − p)^n` far below `f64`'s range) stays exact
/// to rounding.
fn binomial_below(n: usize, p: f64, below: usize) -> f64 {
    if below == 0 {
        return 0.0;
    }
    if below > n {
        return 1.0;
    }
    if p <= 0.0 {
        return 1.0;
    }
    if p >= 1.0 {
        return 0.0;
    }
    let (ln_p, ln_q) = (p.ln(), (1.0 - p).ln());
    let mut ln_choose = 0.0;
    let mut logs = Vec::with_capacity(below);
    for j in 0..below {
        logs.push(ln_choose + j as f64 * ln_p + (n - j) as f64 * ln_q);
        ln_choose += ((n - j) as f64).ln() - ((j + 1) as f64).ln();
    }
    let top = logs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = logs.iter().map(|l| (l - top).exp()).sum();
    (top + sum.ln()).exp().min(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The binomial tail against sums computed by hand (`scipy.stats.binom`
    /// gives the same digits), and at sizes where the plain product
    /// underflows.
    #[test]
    fn binomial_tail_matches_hand_sums_and_survives_large_n() {
        // P(Bin(2, 0.5) < 1) = 0.25; P(Bin(2, 0.5) < 2) = 0.75.
        assert!((binomial_below(2, 0.5, 1) - 0.25).abs() < 1e-15);
        assert!((binomial_below(2, 0.5, 2) - 0.75).abs() < 1e-15);
        // P(Bin(20, 0.7) < 10) = 0.0171448164312584...
        assert!((binomial_below(20, 0.7, 10) - 0.017_144_816_431_258_4).abs() < 1e-12);
        assert_eq!(binomial_below(5, 0.3, 0), 0.0);
        assert_eq!(binomial_below(5, 0.3, 6), 1.0);
        assert_eq!(binomial_below(5, 1.0, 5), 0.0);
        // 0.3^2000 is 0 in f64, yet the median's tail is about a half.
        let half = binomial_below(2000, 0.7, 1400);
        assert!((0.45..0.55).contains(&half), "{half}");
    }

    /// The bound of the benchmark's settings: SecAgg+ `k = 21, t = 11` over
    /// 100 clients aborts most rounds at 30 % dropout and almost none at
    /// 10 %; the complete graph of SecAgg with `t = 51` tolerates more.
    #[test]
    fn dropout_tolerance_follows_the_graph_and_threshold() {
        let plus = Params::new(NumShares::Neighbours(21), 11);
        assert!(plus.abort_bound(100, 0.3) > 0.5);
        assert!(plus.abort_bound(100, 0.1) < 1e-3);
        assert_eq!(plus.abort_bound(100, 0.0), 0.0);
        let tolerance = plus.dropout_tolerance(100, 0.01);
        assert!((10..30).contains(&tolerance), "{tolerance}");
        let all = Params::new(NumShares::All, 51);
        assert!(all.dropout_tolerance(100, 0.01) > tolerance);
        // A larger round with the same k tolerates less.
        assert!(plus.dropout_tolerance(1000, 0.01) <= tolerance);
    }

    /// The degrees the benchmark's 30 % rows use (`bench/secagg.sh`) are
    /// the smallest odd ones, with `t = k/2 + 1`, whose rounds complete
    /// 99 % of the time at 30 % dropout.
    #[test]
    fn the_smallest_degrees_for_thirty_percent_dropout() {
        let risk = |clients: usize, k: usize| {
            Params::new(NumShares::Neighbours(k), k / 2 + 1).abort_bound(clients, 0.3)
        };
        for (clients, k) in [(100, 79), (1000, 105)] {
            assert!(risk(clients, k) <= 0.01, "{clients}: {}", risk(clients, k));
            assert!(
                risk(clients, k - 2) > 0.01,
                "{clients}: {}",
                risk(clients, k - 2)
            );
        }
    }

    #[test]
    fn flower_defaults_validate() {
        Params::new(NumShares::All, 2).validate().unwrap();
        let plus = Params::new(NumShares::Neighbours(5), 3);
        assert_eq!(plus.check_for(100), Ok(5));
        assert_eq!(plus.check_for(4), Ok(4));
    }

    #[test]
    fn refusals_name_the_value() {
        let base = Params::new(NumShares::All, 2);
        let with = |k: usize, t: usize| Params {
            num_shares: NumShares::Neighbours(k),
            reconstruction_threshold: t,
            ..base.clone()
        };
        assert_eq!(with(4, 3).validate(), Err(ParamsError::NumShares(4)));
        assert_eq!(with(1, 1).validate(), Err(ParamsError::NumShares(1)));
        assert!(matches!(
            with(5, 6).validate(),
            Err(ParamsError::ThresholdRange { threshold: 6, .. })
        ));
        assert!(matches!(
            with(7, 3).validate(),
            Err(ParamsError::ThresholdMajority { threshold: 3, .. })
        ));
        let bad_mod = Params {
            modulus_range: 3 << 20,
            ..base.clone()
        };
        assert!(matches!(
            bad_mod.validate(),
            Err(ParamsError::ModulusRange { .. })
        ));
        let too_big = Params {
            modulus_range: 1 << 33,
            ..base.clone()
        };
        assert!(too_big.validate().is_err());
        let nan = Params {
            clipping_range: f64::NAN,
            ..base.clone()
        };
        assert!(matches!(
            nan.validate(),
            Err(ParamsError::NotPositive {
                name: "clipping_range",
                ..
            })
        ));
        assert_eq!(
            Params::new(NumShares::All, 1).validate(),
            Err(ParamsError::ThresholdTooSmall(1))
        );
        let message = with(7, 3).validate().unwrap_err().to_string();
        assert!(message.contains("3") && message.contains("7"), "{message}");
    }

    #[test]
    fn overflow_and_client_count() {
        let base = Params::new(NumShares::Neighbours(5), 3);
        assert!(base.check_for(1023).is_ok());
        assert!(matches!(
            base.check_for(1024),
            Err(ParamsError::Overflow { clients: 1024, .. })
        ));
        assert!(matches!(
            base.check_for(1),
            Err(ParamsError::TooFewClients { .. })
        ));
        // SecAgg over 4 clients with t = 2: 2t must exceed the 4 shares.
        assert!(matches!(
            Params::new(NumShares::All, 2).check_for(4),
            Err(ParamsError::ThresholdMajority { .. })
        ));
    }
}
