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

    /// The bit mask that reduces a `u32` modulo `modulus_range`.
    pub(crate) fn modulus_mask(&self) -> u32 {
        (self.modulus_range - 1) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
