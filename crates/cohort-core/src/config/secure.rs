//! `[secure_aggregation]`: its counts resolved against a round's clients
//! into the protocol's [`Params`], and every combination with the rest of
//! the config that secure aggregation cannot honour refused with the reason.
//!
//! What is refused and why: the server sees only the round's weighted sum,
//! so anything that needs one client's update is impossible: strategies
//! that look at each update (median, trimmed mean, Krum, SCAFFOLD's
//! per-client state, `dp_fedavg`'s clipping on the server), keeping the
//! updates (`results.keep_client_updates`) and dropping outliers by their
//! distance (`server.max_update_norm_ratio`). Distributed ranks have no
//! secure-aggregation stages yet, and are refused rather than run in the
//! clear. In network mode the clients keep their updates, so what would
//! replace or draw on them in the server is refused too.

use crate::secagg::{DdgError, DdgParams, NumShares, Params, ParamsError};

use super::schema::{Config, SecAggNoise, SecAggProtocol, SecureAggregation};
use super::{Fail, MAX_TIMEOUT_SECONDS};

/// The strategies whose next model depends on a round only through its
/// sample-weighted mean, which is what secure aggregation reveals.
pub const SUM_ONLY_STRATEGIES: &[&str] = &[
    "fedavg",
    "fedprox",
    "fedavgm",
    "fedadam",
    "fedyogi",
    "fedadagrad",
];

/// A parameter that does not work for a round, and the key it is about.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("secure_aggregation.{key}: {message}")]
pub struct SecureParamsError {
    /// The key under `[secure_aggregation]`.
    pub key: &'static str,
    pub message: String,
}

impl SecureAggregation {
    /// The protocol's parameters for a round of `clients` clients: the
    /// fractions resolved as Flower does (`num_shares` as `⌈f·clients⌉`,
    /// raised to an odd count; the threshold as `⌈f·num_shares⌉`), then
    /// every check of [`Params::check_for`].
    pub fn params_for(&self, clients: usize) -> Result<Params, SecureParamsError> {
        let num_shares = match (self.protocol, self.num_shares) {
            (SecAggProtocol::SecAgg, None) => NumShares::All,
            (SecAggProtocol::SecAgg, Some(_)) => {
                return Err(SecureParamsError {
                    key: "num_shares",
                    message: "is for protocol = \"secaggplus\"; \"secagg\" shares every \
                              client's secrets with every other client, so leave it out"
                        .to_owned(),
                });
            }
            (SecAggProtocol::SecAggPlus, None) => {
                return Err(SecureParamsError {
                    key: "num_shares",
                    message: "is required with protocol = \"secaggplus\" (as in Flower): an \
                              odd count of at least 3, or a fraction of the round's clients"
                        .to_owned(),
                });
            }
            (SecAggProtocol::SecAggPlus, Some(count)) => {
                let mut k = count.resolve(clients);
                if matches!(count, super::ShareCount::Fraction(_)) {
                    // Flower rounds an even count up; so does the fraction here.
                    k = (k | 1).max(3);
                }
                NumShares::Neighbours(k)
            }
        };
        let Some(threshold) = self.reconstruction_threshold else {
            return Err(SecureParamsError {
                key: "reconstruction_threshold",
                message: "is required (as in Flower): a count of shares, more than half of \
                          num_shares, or a fraction of num_shares"
                    .to_owned(),
            });
        };
        let shares = match num_shares {
            NumShares::Neighbours(k) => k.min(clients),
            NumShares::All => clients,
        };
        let params = Params {
            num_shares,
            reconstruction_threshold: threshold.resolve(shares),
            max_weight: self.max_weight,
            clipping_range: self.clipping_range,
            quantization_range: self.quantization_range,
            modulus_range: self.modulus_range,
        };
        params
            .check_for(clients)
            .map_err(|error| SecureParamsError {
                key: key_of(&error),
                message: format!("{error} (in a round of clients.per_round = {clients} clients)"),
            })?;
        Ok(params)
    }
}

/// The δ that ε is reported for when `delta` is left out.
pub const DEFAULT_DELTA: f64 = 1e-5;

impl SecureAggregation {
    /// The noise's parameters for rounds of `clients` expected
    /// contributors; `None` without noise. Every key is checked here, and
    /// the modulus against the default granularity (the model's size is
    /// checked when the run starts).
    pub fn ddg_params(&self, clients: usize) -> Result<Option<DdgParams>, SecureParamsError> {
        let keys = [
            ("clip_norm", self.clip_norm),
            ("noise_multiplier", self.noise_multiplier),
            ("granularity", self.granularity),
            ("delta", self.delta),
        ];
        if self.noise == SecAggNoise::None {
            return match keys.iter().find(|(_, value)| value.is_some()) {
                Some((key, _)) => Err(SecureParamsError {
                    key,
                    message: "is for noise = \"distributed_discrete_gaussian\"; without noise \
                              nothing is clipped or noised, so leave it out"
                        .to_owned(),
                }),
                None => Ok(None),
            };
        }
        let required = |key: &'static str, value: Option<f64>, what: &str| {
            value.ok_or_else(|| SecureParamsError {
                key,
                message: format!(
                    "is required with noise = \"distributed_discrete_gaussian\": {what}"
                ),
            })
        };
        let clip_norm = required(
            "clip_norm",
            self.clip_norm,
            "the L2 norm each client's change is clipped to, a number above 0",
        )?;
        let noise_multiplier = required(
            "noise_multiplier",
            self.noise_multiplier,
            "the noise of the sum relative to clip_norm, a number above 0",
        )?;
        if !(noise_multiplier.is_finite() && noise_multiplier > 0.0) {
            return Err(SecureParamsError {
                key: "noise_multiplier",
                message: format!(
                    "is {noise_multiplier}; expected a finite number above 0 (0 would add no noise and spend unbounded privacy)"
                ),
            });
        }
        let params = DdgParams {
            clip_norm,
            noise_multiplier,
            expected_clients: clients,
            granularity: self.granularity,
            delta: self.delta.unwrap_or(DEFAULT_DELTA),
        };
        // Any model size shows a bad value or a modulus too small for the
        // default granularity; the real one is checked at the start.
        params
            .resolve(1, self.modulus_range)
            .map_err(|error| SecureParamsError {
                key: ddg_key_of(&error),
                message: match error {
                    DdgError::Param {
                        value, expected, ..
                    } => {
                        format!("is {value}; expected {expected}")
                    }
                    other => other.to_string(),
                },
            })?;
        Ok(Some(params))
    }
}

/// The key a noise parameter error is about.
fn ddg_key_of(error: &DdgError) -> &'static str {
    match error {
        DdgError::Param { name, .. } if *name != "clients.per_round" => name,
        DdgError::ModulusTooSmall { .. } => "modulus_range",
        _ => "granularity",
    }
}

/// The key a protocol parameter error is about.
fn key_of(error: &ParamsError) -> &'static str {
    match error {
        ParamsError::NumShares(_) => "num_shares",
        ParamsError::ThresholdRange { .. }
        | ParamsError::ThresholdTooSmall(_)
        | ParamsError::ThresholdMajority { .. }
        | ParamsError::TooFewClients { .. } => "reconstruction_threshold",
        ParamsError::NotPositive { name, .. } => name,
        ParamsError::QuantizationRange | ParamsError::Overflow { .. } => "quantization_range",
        ParamsError::ModulusRange { .. } => "modulus_range",
    }
}

/// Why `strategy` cannot run on the sum alone, for the strategies cohort
/// ships; `None` for those that can (and for names cohort does not know,
/// which the run's assembly asks the strategy itself about).
pub fn strategy_refusal(strategy: &str) -> Option<&'static str> {
    Some(match strategy {
        "median" | "trimmed_mean" => {
            "takes coordinate-wise order statistics of the individual updates, which secure \
             aggregation hides; it reveals only their sum"
        }
        "krum" | "multi_krum" => {
            "scores each update by its distances to the others, which needs the individual \
             updates that secure aggregation hides"
        }
        "scaffold" => {
            "updates each client's control variate on the server from that client's own \
             update, which secure aggregation hides"
        }
        "dp_fedavg" => {
            "clips each client's update on the server, which needs the individual updates; \
             secure aggregation leaves the server only their sum"
        }
        "fedasync" | "fedbuff" => {
            "weighs each update by its own staleness, so the server needs every update with \
             the model version it was trained from; secure aggregation gives it one sum of the \
             round's updates"
        }
        _ => return None,
    })
}

/// Every check of `[secure_aggregation]` against itself and the run.
pub(super) fn validate(config: &Config, fail: Fail) {
    let Some(secure) = &config.secure_aggregation else {
        return;
    };
    let key = |name: &str| format!("secure_aggregation.{name}");
    if let Err(error) = secure.params_for(config.clients.per_round as usize) {
        fail(&key(error.key), error.message);
    }
    if let Err(error) = secure.ddg_params(config.clients.per_round as usize) {
        fail(&key(error.key), error.message);
    }
    if let Some(timeout) = secure.timeout
        && !(timeout.is_finite() && timeout > 0.0 && timeout <= MAX_TIMEOUT_SECONDS)
    {
        fail(
            &key("timeout"),
            format!(
                "must be a number of seconds in (0, {MAX_TIMEOUT_SECONDS}] (a year), got {timeout}"
            ),
        );
    }
    let dropout = secure.simulated_dropout;
    if !(0.0..1.0).contains(&dropout) {
        fail(
            &key("simulated_dropout"),
            format!("must be a fraction of the round's clients in [0, 1), got {dropout}"),
        );
    }
    let strategy = config.algorithm.name();
    if let Some(reason) = strategy_refusal(strategy) {
        fail(
            "algorithm.type",
            format!(
                "`{strategy}` cannot run with [secure_aggregation]: it {reason}. Strategies \
                 that need only the sum: {}",
                SUM_ONLY_STRATEGIES.join(", ")
            ),
        );
    }
    refuse_combinations(config, fail);
}

/// The keys that would see or need what secure aggregation hides, or that
/// ask for a mode without its stages.
fn refuse_combinations(config: &Config, fail: Fail) {
    if config.results.keep_client_updates {
        fail(
            "results.keep_client_updates",
            "cannot be true with [secure_aggregation]: the server never holds a client's \
             unmasked update, so there is none to keep"
                .to_owned(),
        );
    }
    if config.server.max_update_norm_ratio.is_some() {
        fail(
            "server.max_update_norm_ratio",
            "cannot be set with [secure_aggregation]: it measures each update's distance \
             from the global model, and the server sees only the sum"
                .to_owned(),
        );
    }
    if !config.clients.comm_simulation {
        refuse_in_network_mode(config, fail);
    }
    if config.cluster.backend.is_some() {
        fail(
            "cluster.backend",
            "cannot be set with [secure_aggregation] yet: the ranks of a distributed \
             simulation exchange updates or partial sums in the clear"
                .to_owned(),
        );
    }
}

/// Network mode: each client masks its own update in its own process, so
/// the server has no update to replace with a simulated attack, and its
/// clients drop out for real rather than by a draw.
fn refuse_in_network_mode(config: &Config, fail: Fail) {
    if let Some(secure) = &config.secure_aggregation
        && secure.simulated_dropout > 0.0
    {
        fail(
            "secure_aggregation.simulated_dropout",
            "is for simulation (clients.comm_simulation = true); in network mode clients \
             drop out for real, and the server cannot make one vanish"
                .to_owned(),
        );
    }
    if config.clients.attack != crate::attack::Attack::None
        && config.clients.attackers_per_round > 0
    {
        fail(
            "clients.attack",
            "cannot be set with [secure_aggregation] in network mode: a simulated attacker \
             replaces its update on the server, which never holds one"
                .to_owned(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ShareCount;

    fn plus(k: ShareCount, t: ShareCount) -> SecureAggregation {
        SecureAggregation {
            num_shares: Some(k),
            reconstruction_threshold: Some(t),
            ..SecureAggregation::default()
        }
    }

    #[test]
    fn counts_and_fractions_resolve_as_flowers() {
        let counted = plus(ShareCount::Count(5), ShareCount::Count(3));
        let p = counted.params_for(10).unwrap();
        assert_eq!(p.num_shares, NumShares::Neighbours(5));
        assert_eq!(p.reconstruction_threshold, 3);
        assert_eq!(p.quantization_range, 1 << 22);
        // 0.4 of 10 clients is 4 shares, raised to the odd 5; 0.6 of 5 is 3.
        let fractions = plus(ShareCount::Fraction(0.4), ShareCount::Fraction(0.6));
        let p = fractions.params_for(10).unwrap();
        assert_eq!(p.num_shares, NumShares::Neighbours(5));
        assert_eq!(p.reconstruction_threshold, 3);
        let all = SecureAggregation {
            protocol: SecAggProtocol::SecAgg,
            reconstruction_threshold: Some(ShareCount::Fraction(0.75)),
            ..SecureAggregation::default()
        };
        let p = all.params_for(8).unwrap();
        assert_eq!(p.num_shares, NumShares::All);
        assert_eq!(p.reconstruction_threshold, 6);
    }

    #[test]
    fn refusals_name_their_key() {
        let key = |s: &SecureAggregation, n: usize| s.params_for(n).unwrap_err().key;
        let even = plus(ShareCount::Count(4), ShareCount::Count(3));
        assert_eq!(key(&even, 10), "num_shares");
        let low = plus(ShareCount::Count(7), ShareCount::Count(3));
        assert_eq!(key(&low, 10), "reconstruction_threshold");
        let message = low.params_for(10).unwrap_err().to_string();
        assert!(
            message.starts_with("secure_aggregation.reconstruction_threshold: ")
                && message.contains("clients.per_round = 10"),
            "{message}"
        );
        let missing = SecureAggregation::default();
        assert_eq!(key(&missing, 10), "num_shares");
        let secagg_with_k = SecureAggregation {
            protocol: SecAggProtocol::SecAgg,
            ..plus(ShareCount::Count(5), ShareCount::Count(3))
        };
        assert_eq!(key(&secagg_with_k, 10), "num_shares");
        let no_threshold = SecureAggregation {
            num_shares: Some(ShareCount::Count(5)),
            ..SecureAggregation::default()
        };
        assert_eq!(key(&no_threshold, 10), "reconstruction_threshold");
        // 2000 clients × 2^22 do not fit below 2^32.
        let ok = plus(ShareCount::Count(5), ShareCount::Count(3));
        assert_eq!(key(&ok, 2000), "quantization_range");
        let bad_clip = SecureAggregation {
            clipping_range: -1.0,
            ..ok.clone()
        };
        assert_eq!(key(&bad_clip, 10), "clipping_range");
    }

    #[test]
    fn only_sum_strategies_pass() {
        for name in SUM_ONLY_STRATEGIES {
            assert_eq!(strategy_refusal(name), None, "{name}");
        }
        for name in [
            "median",
            "trimmed_mean",
            "krum",
            "multi_krum",
            "scaffold",
            "dp_fedavg",
            "fedasync",
            "fedbuff",
        ] {
            assert!(strategy_refusal(name).is_some(), "{name}");
        }
        // Every shipped strategy is in one list or the other.
        for name in crate::strategy::AlgorithmConfig::names() {
            assert!(
                SUM_ONLY_STRATEGIES.contains(name) || strategy_refusal(name).is_some(),
                "{name} is neither accepted nor refused"
            );
        }
    }
}
