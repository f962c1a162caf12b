//! `cohort.run`: a config run by `cohort_runtime::RunBuilder` in this
//! process, with the GIL released while the engine works.
//!
//! The round loop runs on the calling thread. At each of its events the
//! observer takes the GIL back for a moment to let Python run its signal
//! handlers (`PyErr_CheckSignals`) and, once a round is recorded, to call
//! `on_round`. A Ctrl-C (`KeyboardInterrupt`) or an exception from the
//! callback asks the loop to stop ([`RunObserver::stop_requested`]): it
//! checkpoints the round it just recorded and ends, so the run folder
//! resumes with `resume=True`, and the exception is raised in Python. A
//! Ctrl-C is seen at the next event (a client's update arriving, a round
//! starting), not in the middle of a client's training.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use cohort_core::config::LoadedConfig;
use cohort_core::hooks::ReceivedPayload;
use cohort_core::results::{ClientRow, RoundRow, RunRows};
use cohort_runtime::{
    CheckpointState, Recorder, RunBuilder, RunEvent, RunFolder, RunObserver, RunOptions, RunSummary,
};
use pyo3::prelude::*;

use crate::config::{Source, load_or_raise};
use crate::strategy::{PythonStrategy, StrategyFailure};
use crate::tensors::{TensorOut, read_model_file, tensors_of};

/// Sees the run's events on the loop's thread; remembers the first Python
/// exception (a signal's, the callback's), which stops the run.
pub(crate) struct PythonObserver {
    /// Called with each round's row as JSON text (the Python side turns it
    /// into a dict for the user's callback).
    on_round: Option<Py<PyAny>>,
    failure: Option<PyErr>,
}

impl PythonObserver {
    pub(crate) fn new(on_round: Option<Py<PyAny>>) -> Self {
        Self {
            on_round,
            failure: None,
        }
    }

    fn react(&self, py: Python<'_>, event: &RunEvent) -> PyResult<()> {
        py.check_signals()?;
        if let (RunEvent::RoundFinished { row, .. }, Some(callback)) = (event, &self.on_round) {
            callback.call1(py, (row_json(row),))?;
        }
        Ok(())
    }
}

impl RunObserver for PythonObserver {
    fn on_event(&mut self, event: &RunEvent) {
        if self.failure.is_some() {
            return;
        }
        if let Err(error) = Python::attach(|py| self.react(py, event)) {
            self.failure = Some(error);
        }
    }

    fn stop_requested(&self) -> bool {
        self.failure.is_some()
    }
}

fn row_json(row: &RoundRow) -> String {
    serde_json::to_string(row).unwrap_or_else(|_| "{}".to_owned())
}

/// The run folder's files, and every client row kept for the caller.
struct Capture {
    folder: RunFolder,
    clients: Vec<ClientRow>,
}

impl Recorder for Capture {
    fn model(&mut self, round: u32, model_bytes: &[u8]) -> anyhow::Result<()> {
        self.folder.model(round, model_bytes)
    }

    fn round(
        &mut self,
        round: &RoundRow,
        clients: &[ClientRow],
        rows: &RunRows,
    ) -> anyhow::Result<()> {
        self.folder.round(round, clients, rows)?;
        // `rows` holds the rounds a resumed run read back too.
        self.clients.clone_from(&rows.clients);
        Ok(())
    }

    fn checkpoint(&mut self, state: &CheckpointState<'_>) -> anyhow::Result<Option<PathBuf>> {
        self.folder.checkpoint(state)
    }

    fn updates(&mut self, round: u32, payloads: &[ReceivedPayload]) -> anyhow::Result<()> {
        self.folder.updates(round, payloads)
    }

    fn keeps_updates(&self) -> bool {
        self.folder.keeps_updates()
    }
}

/// A fresh run folder where `cohort run` would make one: under
/// `results.result_path` or `general.base_path`, named `general.run_name`
/// or the config's stem with the time.
pub(crate) fn fresh_run_dir(loaded: &LoadedConfig) -> anyhow::Result<PathBuf> {
    let config = loaded.config();
    let base = config
        .results
        .result_path
        .clone()
        .unwrap_or_else(|| config.general.base_path.clone());
    let created = match &config.general.run_name {
        Some(name) => cohort_runtime::new_run_dir(&base, loaded.path(), Some(name)),
        None => {
            let stem = loaded
                .path()
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .filter(|s| !s.starts_with('<'))
                .unwrap_or_else(|| "run".to_owned());
            cohort_runtime::new_timestamped_run_dir(&base, &stem)
        }
    };
    created.with_context(|| format!("cannot create a run folder under {}", base.display()))
}

/// What the engine hands back once the GIL is held again.
pub(crate) struct Finished {
    outcome: anyhow::Result<RunSummary>,
    observer: PythonObserver,
    clients: Vec<ClientRow>,
}

/// Runs `loaded` with the run folder's files kept and `observer` lent;
/// `parts` adds what the caller replaces.
pub(crate) fn run_engine(
    loaded: &LoadedConfig,
    options: RunOptions,
    observer: PythonObserver,
    parts: impl for<'b> FnOnce(RunBuilder<'b>) -> RunBuilder<'b>,
) -> Finished {
    let mut capture = Capture {
        folder: RunFolder::for_config(options.run_dir.clone(), loaded.config()),
        clients: Vec::new(),
    };
    let mut observer = observer;
    let builder = RunBuilder::new(loaded, options)
        .recorder(&mut capture)
        .observer(Lent(&mut observer));
    let outcome = parts(builder).run();
    Finished {
        outcome,
        observer,
        clients: capture.clients,
    }
}

/// The run folder of a run: the one given, or a fresh one (not when
/// resuming, which needs the folder of the run to continue).
pub(crate) fn run_dir_of(
    py: Python<'_>,
    loaded: &LoadedConfig,
    run_dir: Option<PathBuf>,
    resume: bool,
) -> PyResult<PathBuf> {
    match run_dir {
        Some(dir) => Ok(dir),
        None if resume => Err(pyo3::exceptions::PyValueError::new_err(
            "resume=True needs the run_dir of the run to continue",
        )),
        None => fresh_run_dir(loaded).map_err(|e| crate::cohort_error(py, &e)),
    }
}

/// What a run returns to Python: its rows, facts and folder as JSON text,
/// and the final model's tensors; or the exception that stopped it.
pub(crate) fn report<'py>(
    py: Python<'py>,
    finished: Finished,
) -> PyResult<(String, Vec<TensorOut<'py>>)> {
    // A Ctrl-C or the callback's exception wins over whatever the run
    // returned: the run stopped because of it.
    if let Some(failure) = finished.observer.failure {
        return Err(failure);
    }
    let summary = finished.outcome.map_err(|e| crate::cohort_error(py, &e))?;
    let model = read_model_file(&summary.model_path).map_err(|e| crate::cohort_error(py, &e))?;
    let report = serde_json::json!({
        "run_dir": summary.run_dir,
        "model_path": summary.model_path,
        "reached_target": summary.reached_target,
        "rounds": summary.rounds,
        "clients": finished.clients,
    });
    Ok((report.to_string(), tensors_of(py, &model)))
}

/// An observer lent to a run, so that it can be read once the run is over.
struct Lent<'a>(&'a mut PythonObserver);

impl RunObserver for Lent<'_> {
    fn on_event(&mut self, event: &RunEvent) {
        self.0.on_event(event)
    }

    fn stop_requested(&self) -> bool {
        self.0.stop_requested()
    }
}

/// Runs a config: returns the run's rows, facts and folder as JSON text,
/// and the final model's tensors (PyTorch layout).
#[pyfunction]
#[pyo3(signature = (path, table_json, overrides_json, run_dir, data_dir, resume, on_round, strategy))]
#[allow(clippy::too_many_arguments)] // the Python wrapper's keywords, one to one
pub(crate) fn run<'py>(
    py: Python<'py>,
    path: Option<PathBuf>,
    table_json: Option<String>,
    overrides_json: &str,
    run_dir: Option<PathBuf>,
    data_dir: Option<PathBuf>,
    resume: bool,
    on_round: Option<Py<PyAny>>,
    strategy: Option<Py<PyAny>>,
) -> PyResult<(String, Vec<TensorOut<'py>>)> {
    let source = Source::new(path, table_json)?;
    let loaded = load_or_raise(py, &source, overrides_json)?;
    let run_dir = run_dir_of(py, &loaded, run_dir, resume)?;
    let options = RunOptions {
        data_root: data_dir,
        resume,
        ..RunOptions::new(run_dir)
    };
    let failure = StrategyFailure::default();
    let strategy = python_strategy(py, strategy, &failure)?;
    let observer = PythonObserver::new(on_round);
    let finished = py.detach(|| {
        run_engine(&loaded, options, observer, |builder| {
            with_strategy(builder, strategy)
        })
    });
    raise_strategy_failure(&failure)?;
    report(py, finished)
}

/// The user's `cohort.Strategy` (its bridge), checked and ready for the
/// round loop.
pub(crate) fn python_strategy(
    py: Python<'_>,
    bridge: Option<Py<PyAny>>,
    failure: &StrategyFailure,
) -> PyResult<Option<PythonStrategy>> {
    bridge
        .map(|bridge| PythonStrategy::new(py, bridge, Arc::clone(failure)))
        .transpose()
}

/// `builder` with the user's strategy in place of `[algorithm]`'s, if given.
pub(crate) fn with_strategy(
    builder: RunBuilder<'_>,
    strategy: Option<PythonStrategy>,
) -> RunBuilder<'_> {
    match strategy {
        Some(strategy) => builder.strategy(Box::new(strategy)),
        None => builder,
    }
}

/// The exception the strategy's code raised, raised again now: it is what
/// stopped the run.
pub(crate) fn raise_strategy_failure(failure: &StrategyFailure) -> PyResult<()> {
    match failure.lock().ok().and_then(|mut slot| slot.take()) {
        Some(error) => Err(error),
        None => Ok(()),
    }
}
