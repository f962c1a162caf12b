//! `cohort.connect`: a Flower-style Python client joins a network-mode run
//! as one of its own-data clients, over cohort's gRPC protocol.
//!
//! The protocol is the Rust client's (`cohort_runtime::run_worker_with`:
//! registration, the task stream, bounded payloads, TLS, the token); only
//! the training is the user's, in a worker process the Python side forked
//! before this function started any thread, reached over the pipe
//! contract `cohort.simulate` uses (`cohort_runtime::piped::PipedWorker`).
//! So Python reimplements nothing of the protocol.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cohort_runtime::piped::{PipedWorker, WorkerLink};
use cohort_runtime::{Declaration, TaskTrainer, WorkerOptions};
use pyo3::prelude::*;

/// The worker's pipe ends `(from the worker, to the worker)` as a link;
/// Python gives their ownership up with the call.
fn link_of((from_worker, to_worker): (i32, i32)) -> PyResult<WorkerLink> {
    if from_worker < 0 || to_worker < 0 || from_worker == to_worker {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "worker pipes {from_worker} and {to_worker} are negative or the same"
        )));
    }
    // SAFETY: both are open pipe ends made by `os.pipe()` on the Python
    // side, distinct (checked above), and owned by nothing else from here
    // on, so each `File` is the only owner and closes its end once.
    let (from_worker, to_worker) =
        unsafe { (File::from_raw_fd(from_worker), File::from_raw_fd(to_worker)) };
    Ok(WorkerLink {
        from_worker: Box::new(from_worker),
        to_worker: Box::new(to_worker),
    })
}

/// Joins the server at `server` as an own-data client declaring
/// `train_samples` and `test_samples`, answering its tasks with the worker
/// behind `worker` until the server ends the run; returns the tasks done
/// and how many of them failed.
#[pyfunction]
#[pyo3(signature = (server, worker, names, train_samples, test_samples, client_id, token, tls_ca, tls_domain, connect_timeout, max_payload_bytes, require_secure_aggregation))]
#[allow(clippy::too_many_arguments)] // the Python wrapper's keywords, one to one
pub(crate) fn connect(
    py: Python<'_>,
    server: String,
    worker: (i32, i32),
    names: Option<Vec<String>>,
    train_samples: u64,
    test_samples: u64,
    client_id: Option<u32>,
    token: Option<String>,
    tls_ca: Option<PathBuf>,
    tls_domain: Option<String>,
    connect_timeout: f64,
    max_payload_bytes: usize,
    require_secure_aggregation: bool,
) -> PyResult<(usize, usize)> {
    // First, so that the pipes are closed whatever fails next.
    let link = link_of(worker)?;
    let timeout = Duration::try_from_secs_f64(connect_timeout).map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "connect_timeout = {connect_timeout}; expected a number of seconds >= 0"
        ))
    })?;
    let options = WorkerOptions {
        server,
        token,
        tls_ca,
        tls_domain,
        data_root: None,
        max_payload_bytes,
        device: cohort_train::device::DeviceRequest::Auto,
        connect_timeout: timeout,
        own_data: None,
        host_name: host_name(),
        registry: Arc::new(cohort_train::registry::Registry::builtin()),
        require_secure_aggregation,
        secagg_fault: None,
    };
    let declared = Declaration {
        client_id,
        train_samples,
        test_samples,
    };
    // A Ctrl-C (or another signal handler's exception) is seen between the
    // server's messages and raised once the client has stopped.
    let interrupted: Mutex<Option<PyErr>> = Mutex::new(None);
    let stop = || {
        Python::attach(|py| match py.check_signals() {
            Ok(()) => false,
            Err(error) => {
                if let Ok(mut slot) = interrupted.lock() {
                    slot.get_or_insert(error);
                }
                true
            }
        })
    };
    let summary = py.detach(|| {
        cohort_runtime::run_worker_with(
            &options,
            declared,
            Box::new(move |loaded, _granted| {
                let worker = PipedWorker::new(loaded, names, link);
                Ok(Box::new(worker) as Box<dyn TaskTrainer>)
            }),
            &stop,
        )
    });
    if let Some(error) = interrupted.lock().ok().and_then(|mut slot| slot.take()) {
        return Err(error);
    }
    let summary = summary.map_err(|error| crate::cohort_error(py, &error))?;
    Ok((summary.tasks, summary.failed))
}

/// How this machine is named in the server's log, as `cohort client`
/// names it.
fn host_name() -> String {
    std::env::var("HOSTNAME").unwrap_or_else(|_| "python".to_owned())
}
