//! Strategies a program adds by name, beside cohort's own (`algorithm.type`).

use std::sync::Arc;

use cohort_core::config::{ConfigErrors, LoadedConfig};
use cohort_core::strategy::{AlgorithmConfig, RegisteredAlgorithm, RunShape, Strategy};
use cohort_core::suggest::did_you_mean;

type Build =
    dyn Fn(&RegisteredAlgorithm, &RunShape) -> Result<Box<dyn Strategy>, String> + Send + Sync;

/// A strategy registered by name: `[algorithm] type = "<name>"` builds it
/// from the section's other keys.
#[derive(Clone)]
pub struct StrategyEntry {
    name: String,
    summary: String,
    build: Arc<Build>,
}

impl std::fmt::Debug for StrategyEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StrategyEntry")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl StrategyEntry {
    /// `build` reads the section's options (refusing what it cannot use,
    /// with a message that names the option) and makes the strategy with
    /// fresh state.
    pub fn new(
        name: &str,
        summary: &str,
        build: impl Fn(&RegisteredAlgorithm, &RunShape) -> Result<Box<dyn Strategy>, String>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self {
            name: name.to_owned(),
            summary: summary.to_owned(),
            build: Arc::new(build),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn summary(&self) -> &str {
        &self.summary
    }
}

/// The strategy `[algorithm]` names, from cohort's own or from `registered`;
/// a config error at `algorithm.type` naming every strategy there is when it
/// names none, or at `algorithm` with the builder's reason when it refuses
/// the options.
pub(super) fn strategy_of(
    registered: &[StrategyEntry],
    loaded: &LoadedConfig,
) -> Result<Box<dyn Strategy>, ConfigErrors> {
    let section = match &loaded.config().algorithm {
        AlgorithmConfig::Registered(section) => section,
        builtin => {
            return builtin.build().ok_or_else(|| {
                loaded.error_at("algorithm.type", "is not a strategy cohort builds")
            });
        }
    };
    let Some(entry) = registered.iter().find(|e| e.name == section.name) else {
        let names: Vec<&str> = AlgorithmConfig::names()
            .iter()
            .copied()
            .chain(registered.iter().map(StrategyEntry::name))
            .collect();
        return Err(loaded.error_at(
            "algorithm.type",
            format!(
                "unknown strategy `{}`{}; strategies: {}",
                section.name,
                did_you_mean(&section.name, names.iter().copied()),
                names.join(", ")
            ),
        ));
    };
    (entry.build)(section, &loaded.run_shape())
        .map_err(|reason| loaded.error_at("algorithm", format!("`{}`: {reason}", entry.name)))
}
