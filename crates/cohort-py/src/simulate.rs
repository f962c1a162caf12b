//! `cohort.simulate`: Flower-style Python clients in worker processes the
//! Python side forked, on cohort's round loop.
//!
//! The Python side (`cohort/_simulation.py`) forks a template process
//! before any of the engine's threads exist; the template asks client
//! `"0"` for the initial parameters and forks the workers, and this
//! function gets the engine's ends of their pipes. From here on
//! it is `cohort_runtime::piped::PipedClients` (the transport) and the
//! round loop, assembled by `RunBuilder::external_clients`: no data set,
//! no model of the registry. Evaluation on the server is the user's
//! `evaluate_fn`, called with the GIL held for that moment on the loop's
//! thread.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use cohort_core::data::Dataset;
use cohort_core::tree::ParamTree;
use cohort_runtime::RunEvent;
use cohort_runtime::piped::{PipedClients, Respawn, WorkerLink};
use cohort_train::task::Evaluation;
use cohort_train::trainer::{EvalError, ModelEvaluator, Predictions};
use pyo3::prelude::*;

use crate::config::{Source, load_or_raise};
use crate::run::{
    PythonObserver, python_strategy, raise_strategy_failure, report, run_dir_of, run_engine,
    with_strategy,
};
use crate::strategy::StrategyFailure;
use crate::tensors::{TensorIn, TensorOut, tensors_of, tree_of};

/// The global model on the server: the user's `evaluate_fn` (wrapped by
/// the Python side to take the round and the tensors and return `(loss,
/// accuracy or None)`), or nothing.
struct PythonEvaluator {
    /// The model's layout: the initial parameters.
    reference: ParamTree,
    evaluate: Option<Py<PyAny>>,
    /// The round being recorded, from the run's events: evaluation comes
    /// after the round started and before the next one does.
    round: Arc<AtomicU32>,
    /// The exception `evaluate_fn` raised, raised again once the run ends.
    failure: Arc<Mutex<Option<PyErr>>>,
}

impl ModelEvaluator for PythonEvaluator {
    fn parameters(&self) -> ParamTree {
        self.reference.clone()
    }

    /// Without `evaluate_fn` there is no accuracy to record: 0, and no test
    /// loss (a loss that is not finite is left blank in `results.csv`).
    fn evaluate(&mut self, tree: &ParamTree, _data: &Dataset) -> Result<Evaluation, EvalError> {
        let Some(callback) = &self.evaluate else {
            return Ok(Evaluation {
                accuracy: 0.0,
                loss: f64::NAN,
                rows: 0,
            });
        };
        let round = self.round.load(Ordering::SeqCst);
        let called = Python::attach(|py| {
            callback
                .call1(py, (round, tensors_of(py, tree)))
                .and_then(|answer| answer.extract::<(f64, Option<f64>)>(py))
                .map_err(|error| {
                    let message = format!("evaluate_fn raised in round {round}: {error}");
                    (error, message)
                })
        });
        match called {
            Ok((loss, accuracy)) => Ok(Evaluation {
                accuracy: accuracy.unwrap_or(0.0),
                loss,
                rows: 0,
            }),
            Err((error, message)) => {
                if let Ok(mut slot) = self.failure.lock() {
                    slot.get_or_insert(error);
                }
                Err(EvalError::Failed(message))
            }
        }
    }

    fn predictions(
        &mut self,
        _tree: &ParamTree,
        _data: &Dataset,
        _indices: &[u32],
    ) -> Result<Predictions, EvalError> {
        Err(EvalError::Failed(
            "a run of Python clients has no test set to predict".to_owned(),
        ))
    }
}

/// The worker processes' pipe ends, `(from the worker, to the worker)`, as
/// the transport's links. Python gives their ownership up with this call:
/// it never closes or reads them again.
fn links_of(fds: Vec<(i32, i32)>) -> PyResult<Vec<WorkerLink>> {
    let mut seen = std::collections::HashSet::new();
    for &fd in fds.iter().flat_map(|(r, w)| [r, w]) {
        if fd < 0 || !seen.insert(fd) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "worker pipe {fd} is negative or given twice"
            )));
        }
    }
    Ok(fds
        .into_iter()
        .map(|(from_worker, to_worker)| {
            // SAFETY: each descriptor is an open pipe end created by
            // `os.pipe()` on the Python side, distinct (checked above) and
            // owned by nothing else from here on, so the `File` is its
            // only owner and closes it once.
            let (from_worker, to_worker) =
                unsafe { (File::from_raw_fd(from_worker), File::from_raw_fd(to_worker)) };
            WorkerLink {
                from_worker: Box::new(from_worker),
                to_worker: Box::new(to_worker),
            }
        })
        .collect())
}

/// The Python side's `Workers`: a worker whose client overran
/// `server.payload_timeout` is killed, and a fresh one forked by the
/// template process (forked before the engine's threads; it forked the
/// first workers too) takes its place.
struct PythonRespawn {
    workers: Py<PyAny>,
}

impl Respawn for PythonRespawn {
    /// A failure here is Python's own (the kill was refused): printed as
    /// Python prints an exception it cannot raise, since the watchdog has
    /// no caller to raise it to.
    fn stop(&mut self, worker: usize) {
        Python::attach(|py| {
            if let Err(error) = self.workers.call_method1(py, "stop", (worker,)) {
                error.print(py);
            }
        });
    }

    fn spawn(&mut self, worker: usize) -> anyhow::Result<WorkerLink> {
        let fds: (i32, i32) = Python::attach(|py| {
            self.workers
                .call_method1(py, "spawn", (worker,))
                .and_then(|fds| fds.extract(py))
        })
        .map_err(|error| anyhow::anyhow!("{error}"))?;
        let mut links = links_of(vec![fds]).map_err(|error| anyhow::anyhow!("{error}"))?;
        links
            .pop()
            .ok_or_else(|| anyhow::anyhow!("the worker template process gave no pipes"))
    }
}

/// Runs Python clients behind `workers` on the round loop; returns what
/// `cohort.run` returns.
#[pyfunction]
#[pyo3(signature = (path, table_json, overrides_json, run_dir, resume, workers, initial, evaluate_fn, on_round, strategy, respawn))]
#[allow(clippy::too_many_arguments)] // the Python wrapper's arguments, one to one
pub(crate) fn simulate<'py>(
    py: Python<'py>,
    path: Option<PathBuf>,
    table_json: Option<String>,
    overrides_json: &str,
    run_dir: Option<PathBuf>,
    resume: bool,
    workers: Vec<(i32, i32)>,
    initial: Vec<TensorIn<'py>>,
    evaluate_fn: Option<Py<PyAny>>,
    on_round: Option<Py<PyAny>>,
    strategy: Option<Py<PyAny>>,
    respawn: Py<PyAny>,
) -> PyResult<(String, Vec<TensorOut<'py>>)> {
    // First, so that the pipes are closed whatever fails next.
    let links = links_of(workers)?;
    let names: Vec<String> = initial.iter().map(|(name, ..)| name.clone()).collect();
    let initial = tree_of(initial).map_err(|e| crate::cohort_error(py, &e))?;
    let source = Source::new(path, table_json)?;
    let loaded = load_or_raise(py, &source, overrides_json)?;
    let run_dir = run_dir_of(py, &loaded, run_dir, resume)?;
    let respawn = Box::new(PythonRespawn { workers: respawn });
    let transport = PipedClients::start_with(&loaded, names, links, Some(respawn))
        .map_err(|e| crate::cohort_error(py, &e))?;
    let round = Arc::new(AtomicU32::new(0));
    let failure = Arc::new(Mutex::new(None));
    let evaluator = PythonEvaluator {
        reference: initial.clone(),
        evaluate: evaluate_fn,
        round: Arc::clone(&round),
        failure: Arc::clone(&failure),
    };
    let options = cohort_runtime::RunOptions {
        resume,
        ..cohort_runtime::RunOptions::new(run_dir)
    };
    let strategy_failure = StrategyFailure::default();
    let strategy = python_strategy(py, strategy, &strategy_failure)?;
    let observer = PythonObserver::new(on_round);
    let finished = py.detach(|| {
        run_engine(&loaded, options, observer, |builder| {
            with_strategy(builder, strategy)
                .external_clients()
                .transport(Box::new(transport))
                .evaluator(Box::new(evaluator))
                .initial_model(initial)
                .observer(move |event: &RunEvent| {
                    if let RunEvent::RoundStarted { round: started, .. } = event {
                        round.store(*started, Ordering::SeqCst);
                    }
                })
        })
    });
    raise_strategy_failure(&strategy_failure)?;
    let raised = failure.lock().ok().and_then(|mut slot| slot.take());
    match raised {
        Some(error) => Err(error),
        None => report(py, finished),
    }
}
