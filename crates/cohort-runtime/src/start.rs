//! Where a run starts: round 1 with the initial model, or the round after
//! the newest complete checkpoint, with the selector, the results rows and
//! the strategy's state as that checkpoint left them.

use std::path::Path;

use anyhow::bail;

use cohort_core::checkpoint;
use cohort_core::layout;
use cohort_core::results::RunRows;
use cohort_core::selection::ClientSelector;
use cohort_core::strategy::Strategy;
use cohort_core::tree::{DTypeRule, ParamTree, check_schema};

use crate::round_loop::Selection;

/// Where a run starts: fresh, or from a checkpoint.
#[derive(Debug)]
pub(crate) struct StartPoint {
    pub(crate) global: ParamTree,
    pub(crate) selector: ClientSelector,
    /// Where the selection policy starts.
    pub(crate) selection: SelectionStart,
    /// The rows of the rounds already run.
    pub(crate) rows: RunRows,
    pub(crate) first_round: u32,
    /// Wall seconds the run had used before this process.
    pub(crate) elapsed_before: f64,
    /// An asynchronous run's tasks in flight at the checkpoint.
    pub(crate) asynchronous: Option<AsyncResume>,
}

/// A selection policy's start: knowing nothing of the clients, or as a
/// checkpoint left it (`None`: `random`, which keeps nothing but its stream).
#[derive(Debug, Clone)]
pub(crate) enum SelectionStart {
    Fresh,
    Resumed(Option<cohort_core::selection::PolicyState>),
}

/// An asynchronous checkpoint's clock, tasks and the models they trained from.
#[derive(Debug, Clone)]
pub(crate) struct AsyncResume {
    pub(crate) history: checkpoint::AsyncHistory,
    /// By version.
    pub(crate) bases: std::collections::BTreeMap<u32, ParamTree>,
}

/// What a checkpoint must fit beyond its own integrity: the hash of the
/// config that resumes it, the model's layout, and the selector's stream.
pub(crate) struct ResumeChecks<'a> {
    pub(crate) config_hash: &'a str,
    /// The model's parameters as it builds them (names, shapes, dtypes).
    pub(crate) reference: &'a ParamTree,
    pub(crate) selection: Selection,
}

/// The newest complete checkpoint of `run_dir` that fits `checks` and whose
/// strategy state `strategy` takes (a forged or damaged one is skipped with
/// the reason, as a torn one is); restores that state into `strategy`.
pub(crate) fn resume_point(
    checks: &ResumeChecks<'_>,
    run_dir: &Path,
    strategy: &mut dyn Strategy,
) -> anyhow::Result<StartPoint> {
    let config_hash = checks.config_hash;
    let restored = checkpoint::latest_accepted(run_dir, |restored| {
        fits(checks, restored)?;
        // Taken here, so that a state it refuses falls back like the rest; a
        // later checkpoint's restore replaces an earlier one's.
        strategy
            .restore(restored.strategy_state.clone())
            .map_err(|error| format!("its strategy state is refused: {error}"))
    })?;
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
    tracing::info!(
        round = history.round,
        "resuming after round {}",
        history.round
    );
    Ok(StartPoint {
        global: layout::from_model_file(restored.model),
        selector: ClientSelector::from_state(history.selector),
        selection: SelectionStart::Resumed(history.selection),
        elapsed_before: history.rounds.last().map_or(0.0, |r| r.elapsed_time),
        first_round: history.round + 1,
        asynchronous: match history.asynchronous {
            Some(async_history) => Some(AsyncResume {
                history: async_history,
                bases: versions_of(restored.bases).map_err(anyhow::Error::msg)?,
            }),
            None => None,
        },
        rows: RunRows {
            rounds: history.rounds,
            clients: history.clients,
            checkpointed_clients: history.client_rows,
        },
    })
}

/// Why `restored` cannot continue this run: a model of another layout or
/// with non-finite values, a strategy tensor that is not finite, or a
/// selector whose position is not where the seeded draws of its rounds end.
fn fits(checks: &ResumeChecks<'_>, restored: &checkpoint::Restored) -> Result<(), String> {
    let model = layout::from_model_file(restored.model.clone());
    check_schema(checks.reference, &model, DTypeRule::Exact)
        .map_err(|mismatch| format!("its model does not fit the model: {mismatch}"))?;
    if let Some((path, index)) = model.first_non_finite() {
        return Err(format!("its model's `{path}`[{index}] is not finite"));
    }
    for (name, tree) in &restored.bases {
        let base = layout::from_model_file(tree.clone());
        check_schema(checks.reference, &base, DTypeRule::Exact)
            .map_err(|mismatch| format!("its base model `{name}` does not fit: {mismatch}"))?;
        if let Some((path, index)) = base.first_non_finite() {
            return Err(format!(
                "its base model `{name}`'s `{path}`[{index}] is not finite"
            ));
        }
    }
    if let Some(asynchronous) = &restored.history.asynchronous {
        let versions = versions_of(restored.bases.clone())?;
        for task in &asynchronous.tasks {
            if !versions.contains_key(&task.version) || task.version > restored.history.round {
                return Err(format!(
                    "its task {} trained from version {}, which it does not hold",
                    task.task, task.version
                ));
            }
        }
    }
    for (name, tree) in &restored.strategy_state.tensors {
        if let Some((path, index)) = tree.first_non_finite() {
            return Err(format!(
                "its strategy state `{name}`'s `{path}`[{index}] is not finite"
            ));
        }
    }
    let history = &restored.history;
    let selection = checks.selection;
    // The state's shape is checked against the run's clients here, so a
    // checkpoint of another selection is skipped with the reason.
    let total = selection.total_clients as usize;
    let prior = cohort_core::selection::ClientPrior {
        samples: vec![0; total],
        durations: vec![0.0; total],
    };
    cohort_core::selection::Policy::restore(&selection.policy, &prior, history.selection.clone())?;
    if !selection.replayable {
        // Who could be drawn depended on the simulated clock; the sidecar's
        // digest of the model is what vouches for it.
        return Ok(());
    }
    let mut replay = ClientSelector::new(selection.seed);
    for _ in 0..history.round {
        replay.select_stratified(
            selection.total_clients,
            selection.draws,
            selection.policy.strata,
        );
    }
    if replay.state(selection.seed) != history.selector {
        return Err(format!(
            "its selector is at {:?}, but {} rounds of server.random_seed = {} end at {:?}",
            history.selector,
            history.round,
            selection.seed,
            replay.state(selection.seed)
        ));
    }
    Ok(())
}

/// Round 1 of a new run: `initial` is the global model (seeded, or read
/// from a file, by the assembly).
pub(crate) fn fresh_start(initial: ParamTree, selector_seed: u64) -> StartPoint {
    StartPoint {
        global: initial,
        selector: ClientSelector::new(selector_seed),
        selection: SelectionStart::Fresh,
        rows: RunRows::default(),
        first_round: 1,
        elapsed_before: 0.0,
        asynchronous: None,
    }
}

/// `v<version>`-named base models by version.
fn versions_of(
    bases: std::collections::BTreeMap<String, ParamTree>,
) -> Result<std::collections::BTreeMap<u32, ParamTree>, String> {
    bases
        .into_iter()
        .map(|(name, tree)| {
            let version = name
                .strip_prefix('v')
                .and_then(|v| v.parse::<u32>().ok())
                .ok_or_else(|| format!("base model `{name}` is not named v<version>"))?;
            Ok((version, layout::from_model_file(tree)))
        })
        .collect()
}
