//! cohort from Python: the `cohort._cohort` extension module, a thin layer
//! over the Rust crates (the Python package `cohort`, in `python/cohort/`,
//! wraps it with NumPy and keyword arguments).
//!
//! Nothing here decides anything the Rust crates do not: configs are loaded
//! and validated by `cohort_core::config`, runs are assembled by
//! `cohort_runtime::RunBuilder`, partitions and aggregations are the
//! config's own. What crosses the boundary is plain: JSON text for configs,
//! options and rows (Python's `json` turns it into dicts), and tensors as
//! `(name, dtype, shape, little-endian bytes)` tuples, which NumPy reads
//! without a copy of its own. No NumPy C API is used, so one abi3 wheel
//! serves every CPython from 3.10 on.
//!
//! Errors become Python exceptions carrying cohort's message:
//! `cohort.ConfigError` (every problem of a config at once, as the `cohort`
//! command reports them), `cohort.CohortError` for the rest.

use pyo3::prelude::*;

mod command;
mod config;
mod connect;
mod run;
mod simulate;
mod strategy;
mod tensors;
mod tools;

#[pymodule]
fn _cohort(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    module.add_function(wrap_pyfunction!(run::run, module)?)?;
    module.add_function(wrap_pyfunction!(simulate::simulate, module)?)?;
    module.add_function(wrap_pyfunction!(connect::connect, module)?)?;
    module.add_function(wrap_pyfunction!(config::check, module)?)?;
    module.add_function(wrap_pyfunction!(config::resolved, module)?)?;
    module.add_function(wrap_pyfunction!(tools::partition, module)?)?;
    module.add_function(wrap_pyfunction!(tools::aggregate, module)?)?;
    module.add_function(wrap_pyfunction!(command::command_line, module)?)?;
    Ok(())
}

/// A Python exception of the package's own (`cohort._errors`), built with
/// `args`: the classes live in Python so that they are ordinary classes
/// with attributes, documented and picklable.
fn python_error<'py>(
    py: Python<'py>,
    class: &str,
    args: impl pyo3::call::PyCallArgs<'py>,
) -> PyErr {
    let built = py
        .import("cohort._errors")
        .and_then(|errors| errors.getattr(class))
        .and_then(|class| class.call1(args));
    match built {
        Ok(error) => PyErr::from_value(error),
        Err(error) => error,
    }
}

/// `error` (with its causes, as the `cohort` command prints them) as a
/// `cohort.CohortError`.
/// A config problem found while a run is assembled (a strategy name only
/// the registry knows) is a `cohort.ConfigError` too.
fn cohort_error(py: Python<'_>, error: &anyhow::Error) -> PyErr {
    match error.downcast_ref::<cohort_core::config::ConfigErrors>() {
        Some(errors) => config::config_error(py, errors),
        None => python_error(py, "CohortError", (format!("{error:#}"),)),
    }
}
