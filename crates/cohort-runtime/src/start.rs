//! Where a run starts: round 1 with the initial model, or the round after
//! the newest complete checkpoint, with the selector, the results rows and
//! the strategy's state as that checkpoint left them.

use std::path::Path;

use anyhow::{Context, bail};

use cohort_core::checkpoint;
use cohort_core::layout;
use cohort_core::results::ResultsWriter;
use cohort_core::selection::ClientSelector;
use cohort_core::strategy::Strategy;
use cohort_core::tree::ParamTree;

/// Where a run starts: fresh, or from a checkpoint.
#[derive(Debug)]
pub(crate) struct StartPoint {
    pub(crate) global: ParamTree,
    pub(crate) selector: ClientSelector,
    pub(crate) results: ResultsWriter,
    pub(crate) first_round: u32,
    /// Wall seconds the run had used before this process.
    pub(crate) elapsed_before: f64,
}

/// The newest complete checkpoint of `run_dir`, checked against the hash of
/// the config that resumes it; restores the strategy's state into `strategy`.
pub(crate) fn resume_point(
    config_hash: &str,
    run_dir: &Path,
    strategy: &mut dyn Strategy,
) -> anyhow::Result<StartPoint> {
    let restored = checkpoint::latest(run_dir)?;
    for skipped in &restored.skipped {
        tracing::warn!("skipping checkpoint {skipped}");
    }
    let history = restored.history;
    if history.config_hash != config_hash {
        bail!(
            "the config differs from the one {} was started with in a key that changes results \
             (config hash {} vs checkpoint {}); resume with the run's own config.toml. A run \
             started by an older cohort, whose hash covered other keys, cannot be resumed by \
             this one",
            run_dir.display(),
            config_hash,
            history.config_hash
        );
    }
    let saved_strategy = history
        .algorithm_state
        .as_ref()
        .map_or("fedavg", |state| state.strategy.as_str());
    if saved_strategy != strategy.name() {
        bail!(
            "{} was run with strategy `{saved_strategy}`, but this run uses `{}`; a strategy \
             cannot take over another's state",
            run_dir.display(),
            strategy.name()
        );
    }
    strategy
        .restore(restored.strategy_state)
        .with_context(|| format!("round {}", history.round))?;
    tracing::info!(
        round = history.round,
        "resuming after round {}",
        history.round
    );
    Ok(StartPoint {
        global: layout::from_model_file(restored.model),
        selector: ClientSelector::from_state(history.selector),
        elapsed_before: history.rounds.last().map_or(0.0, |r| r.elapsed_time),
        first_round: history.round + 1,
        results: ResultsWriter::resume(run_dir, history.rounds, history.clients),
    })
}

/// Round 1 of a new run: `initial` is the global model (seeded, or read
/// from a file, by the assembly).
pub(crate) fn fresh_start(initial: ParamTree, selector_seed: u64, run_dir: &Path) -> StartPoint {
    StartPoint {
        global: initial,
        selector: ClientSelector::new(selector_seed),
        results: ResultsWriter::new(run_dir),
        first_round: 1,
        elapsed_before: 0.0,
    }
}
