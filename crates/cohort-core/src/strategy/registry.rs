//! The registration of every strategy: its `algorithm.type` name, its options
//! and how it is built. Adding a strategy is a file beside this one (options
//! struct + strategy) and one variant plus one match arm in each `match` here.

use serde::{Deserialize, Serialize};

use super::{Strategy, dp, fedasync, fedavg, fedavgm, fedbuff, fedopt, fedprox, robust, scaffold};

/// The `[algorithm]` section: `type` picks the strategy, the other keys are its
/// options (each documented on its options struct and in docs/CONFIG.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AlgorithmConfig {
    Fedavg(fedavg::FedAvgConfig),
    Fedavgm(fedavgm::FedAvgMConfig),
    Fedadam(fedopt::FedOptConfig),
    Fedyogi(fedopt::FedOptConfig),
    Fedadagrad(fedopt::FedAdagradConfig),
    Fedprox(fedprox::FedProxConfig),
    Scaffold(scaffold::ScaffoldConfig),
    Median(robust::MedianConfig),
    TrimmedMean(robust::TrimmedMeanConfig),
    Krum(robust::KrumConfig),
    MultiKrum(robust::MultiKrumConfig),
    DpFedavg(dp::DpFedAvgConfig),
    Fedasync(fedasync::FedAsyncConfig),
    Fedbuff(fedbuff::FedBuffConfig),
    /// A strategy a program registered by name (`cohort_train::registry`):
    /// never read from a config by serde (the loader sets it for a `type`
    /// that is not one of the above), and built by that registry.
    #[serde(skip)]
    Registered(RegisteredAlgorithm),
}

/// `[algorithm]` of a strategy registered by a program: its `type` and the
/// other keys as written, for its registered builder to read.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RegisteredAlgorithm {
    pub name: String,
    pub options: toml::Table,
}

impl RegisteredAlgorithm {
    /// The options as `T` (a `#[serde(default, deny_unknown_fields)]`
    /// struct, as cohort's own strategies' options are), or the reason they
    /// are not, naming the key.
    pub fn options_as<T: serde::de::DeserializeOwned>(&self) -> Result<T, String> {
        T::deserialize(self.options.clone()).map_err(|error| error.message().to_owned())
    }
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        AlgorithmConfig::Fedavg(fedavg::FedAvgConfig::default())
    }
}

/// What option checks may need to know about the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunShape {
    pub total_clients: u32,
    pub per_round: u32,
    /// Fewest updates a round aggregates (`clients.min_per_round`).
    pub min_per_round: u32,
    /// `trainer.optimizer`, lowercased.
    pub local_optimizer: &'static str,
}

/// An option of `[algorithm]` that cannot work: which one and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionError {
    /// The option's key inside `[algorithm]` (`type` for the choice itself).
    pub option: &'static str,
    pub message: String,
}

impl AlgorithmConfig {
    /// Every registered `type`, in registration order (read from the serde
    /// derive, so it cannot drift from the enum).
    pub fn names() -> &'static [&'static str] {
        crate::config::introspect::variants_of::<AlgorithmConfig>("type")
    }

    /// The `type` this section was written with.
    pub fn name(&self) -> &str {
        match self {
            AlgorithmConfig::Registered(registered) => &registered.name,
            AlgorithmConfig::Fedavg(_) => "fedavg",
            AlgorithmConfig::Fedavgm(_) => "fedavgm",
            AlgorithmConfig::Fedadam(_) => "fedadam",
            AlgorithmConfig::Fedyogi(_) => "fedyogi",
            AlgorithmConfig::Fedadagrad(_) => "fedadagrad",
            AlgorithmConfig::Fedprox(_) => "fedprox",
            AlgorithmConfig::Scaffold(_) => "scaffold",
            AlgorithmConfig::Median(_) => "median",
            AlgorithmConfig::TrimmedMean(_) => "trimmed_mean",
            AlgorithmConfig::Krum(_) => "krum",
            AlgorithmConfig::MultiKrum(_) => "multi_krum",
            AlgorithmConfig::DpFedavg(_) => "dp_fedavg",
            AlgorithmConfig::Fedasync(_) => "fedasync",
            AlgorithmConfig::Fedbuff(_) => "fedbuff",
        }
    }

    /// How many attackers among `updates` the strategy is built to withstand,
    /// for the robust ones (the means claim nothing): Krum's and Multi-Krum's
    /// `byzantine`, trimmed mean's `⌊beta · n⌋` trimmed from each side, the
    /// median's `⌈n/2⌉ − 1`.
    pub fn attackers_tolerated(&self, updates: u32) -> Option<u32> {
        match self {
            AlgorithmConfig::Krum(c) => Some(c.byzantine),
            AlgorithmConfig::MultiKrum(c) => Some(c.byzantine),
            AlgorithmConfig::TrimmedMean(c) => {
                Some(robust::trimmed_per_side(c.beta, updates as usize) as u32)
            }
            AlgorithmConfig::Median(_) => Some(updates.div_ceil(2).saturating_sub(1)),
            _ => None,
        }
    }

    /// Checks the options against each other and against the run.
    pub fn check(&self, run: &RunShape) -> Result<(), OptionError> {
        match self {
            AlgorithmConfig::Fedavg(_) => Ok(()),
            // Its registered builder checks its options.
            AlgorithmConfig::Registered(_) => Ok(()),
            AlgorithmConfig::Fedavgm(c) => c.check(run),
            AlgorithmConfig::Fedadam(c) | AlgorithmConfig::Fedyogi(c) => c.check(),
            AlgorithmConfig::Fedadagrad(c) => c.common().check(),
            AlgorithmConfig::Fedprox(c) => c.check(run),
            AlgorithmConfig::Scaffold(c) => c.check(run),
            AlgorithmConfig::Median(_) => Ok(()),
            AlgorithmConfig::TrimmedMean(c) => c.check(run),
            AlgorithmConfig::Krum(c) => c.check(run),
            AlgorithmConfig::MultiKrum(c) => c.check(run),
            AlgorithmConfig::DpFedavg(c) => c.check(run),
            AlgorithmConfig::Fedasync(c) => c.check(),
            AlgorithmConfig::Fedbuff(c) => c.check(),
        }
    }

    /// The strategy this section describes, with fresh state; `None` for a
    /// strategy a program registered (its registry builds it).
    pub fn build(&self) -> Option<Box<dyn Strategy>> {
        Some(match self {
            AlgorithmConfig::Registered(_) => return None,
            AlgorithmConfig::Fedavg(_) => Box::new(fedavg::FedAvg),
            AlgorithmConfig::Fedavgm(c) => Box::new(fedavgm::FedAvgM::new(c.clone())),
            AlgorithmConfig::Fedadam(c) => Box::new(fedopt::FedOpt::new(
                fedopt::ServerOptimizer::Adam,
                c.clone(),
            )),
            AlgorithmConfig::Fedyogi(c) => Box::new(fedopt::FedOpt::new(
                fedopt::ServerOptimizer::Yogi,
                c.clone(),
            )),
            AlgorithmConfig::Fedadagrad(c) => Box::new(fedopt::FedOpt::new(
                fedopt::ServerOptimizer::Adagrad,
                c.common(),
            )),
            AlgorithmConfig::Fedprox(c) => Box::new(fedprox::FedProx::new(c.clone())),
            AlgorithmConfig::Scaffold(c) => Box::new(scaffold::Scaffold::new(c.clone())),
            AlgorithmConfig::Median(_) => Box::new(robust::Median),
            AlgorithmConfig::TrimmedMean(c) => Box::new(robust::TrimmedMean::new(c.clone())),
            AlgorithmConfig::Krum(c) => Box::new(robust::Krum::new(c.clone())),
            AlgorithmConfig::MultiKrum(c) => Box::new(robust::MultiKrum::new(c.clone())),
            AlgorithmConfig::DpFedavg(c) => Box::new(dp::DpFedAvg::new(c.clone())),
            AlgorithmConfig::Fedasync(c) => Box::new(fedasync::FedAsync::new(c.clone())),
            AlgorithmConfig::Fedbuff(c) => Box::new(fedbuff::FedBuff::new(c.clone())),
        })
    }
}
