//! Configs from Python: a file (with `include`s, as `cohort run` reads it)
//! or a dict with the same structure, and overrides as `--set` gives them,
//! validated by `cohort_core::config` to the end so that every problem is
//! reported at once.

use std::path::{Path, PathBuf};

use cohort_core::config::{self, ConfigErrors, LoadedConfig, Override};
use pyo3::prelude::*;

/// Where a dict config says it comes from: errors name it, and its
/// `include`s resolve from the working folder.
pub(crate) const DICT_ORIGIN: &str = "<dict>";

/// A config as Python gives it.
pub(crate) enum Source {
    File(PathBuf),
    /// A dict, as JSON text.
    Table(String),
}

impl Source {
    pub(crate) fn new(path: Option<PathBuf>, table_json: Option<String>) -> PyResult<Self> {
        match (path, table_json) {
            (Some(path), None) => Ok(Source::File(path)),
            (None, Some(json)) => Ok(Source::Table(json)),
            _ => Err(pyo3::exceptions::PyTypeError::new_err(
                "give a config as a path or as a dict, not both",
            )),
        }
    }
}

/// A problem found before the config's own checks: which input and why.
fn input_error(origin: &str, key: Option<&str>, message: String) -> ConfigErrors {
    config::ConfigError {
        file: PathBuf::from(origin),
        key: key.map(str::to_owned),
        message,
    }
    .into()
}

/// JSON from Python as TOML: TOML has no null, so a `None` value is refused
/// naming its key (to take a key out, pass it in `overrides` as `None`).
fn toml_of(json: serde_json::Value, origin: &str, key: &str) -> Result<toml::Value, ConfigErrors> {
    toml::Value::try_from(json).map_err(|error| {
        let message = format!("cannot be written as TOML ({error}); None has no TOML form");
        input_error(origin, Some(key), message)
    })
}

/// `{"trainer.rounds": 3, "data.partition_size": None}` as `--set` and
/// `--unset` overrides, each key checked as the command line checks it.
fn overrides_of(json: &str) -> Result<Vec<Override>, ConfigErrors> {
    let origin = "overrides";
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(json)
        .map_err(|error| input_error(origin, None, format!("not a mapping of keys: {error}")))?;
    map.into_iter()
        .map(|(key, value)| {
            if value.is_null() {
                return Override::unset(&key).map_err(|m| input_error(origin, Some(&key), m));
            }
            let mut parsed: Override = format!("{key}=0")
                .parse()
                .map_err(|m| input_error(origin, Some(&key), m))?;
            parsed.value = Some(toml_of(value, origin, &key)?);
            Ok(parsed)
        })
        .collect()
}

/// Loads and validates `source` with `overrides_json` written over it.
pub(crate) fn load(source: &Source, overrides_json: &str) -> Result<LoadedConfig, ConfigErrors> {
    let overrides = overrides_of(overrides_json)?;
    match source {
        Source::File(path) => config::load_with(path, &overrides),
        Source::Table(json) => {
            let value: serde_json::Value = serde_json::from_str(json).map_err(|error| {
                input_error(DICT_ORIGIN, None, format!("not a config table: {error}"))
            })?;
            let table = match toml_of(value, DICT_ORIGIN, "<root>")? {
                toml::Value::Table(table) => table,
                other => {
                    let message = format!("a config is a table, not a {}", other.type_str());
                    return Err(input_error(DICT_ORIGIN, None, message));
                }
            };
            config::from_str_with(&table.to_string(), Path::new(DICT_ORIGIN), &overrides)
        }
    }
}

/// `errors` as a `cohort.ConfigError`: the message the `cohort` command
/// prints, and each problem as a `(file, key, message)` tuple.
pub(crate) fn config_error(py: Python<'_>, errors: &ConfigErrors) -> PyErr {
    let problems: Vec<(String, Option<String>, String)> = errors
        .errors()
        .iter()
        .map(|e| {
            (
                e.file.display().to_string(),
                e.key.clone(),
                e.message.clone(),
            )
        })
        .collect();
    crate::python_error(py, "ConfigError", (errors.to_string(), problems))
}

/// Loads `source`, raising `cohort.ConfigError` when it does not validate.
pub(crate) fn load_or_raise(
    py: Python<'_>,
    source: &Source,
    overrides_json: &str,
) -> PyResult<LoadedConfig> {
    load(source, overrides_json).map_err(|errors| config_error(py, &errors))
}

/// Validates a config; returns the merged config as TOML text (what a run
/// would write to its `config.toml`).
#[pyfunction]
#[pyo3(signature = (path, table_json, overrides_json))]
pub(crate) fn check(
    py: Python<'_>,
    path: Option<PathBuf>,
    table_json: Option<String>,
    overrides_json: &str,
) -> PyResult<String> {
    let source = Source::new(path, table_json)?;
    let loaded = load_or_raise(py, &source, overrides_json)?;
    Ok(loaded.merged().to_string())
}

/// Validates a config; returns it as a run would use it, every default
/// filled in, as JSON text (what `cohort.simulate` reads the number of
/// workers from before it starts them).
#[pyfunction]
#[pyo3(signature = (path, table_json, overrides_json))]
pub(crate) fn resolved(
    py: Python<'_>,
    path: Option<PathBuf>,
    table_json: Option<String>,
    overrides_json: &str,
) -> PyResult<String> {
    let source = Source::new(path, table_json)?;
    let loaded = load_or_raise(py, &source, overrides_json)?;
    let resolved = || -> anyhow::Result<String> {
        let table: toml::Table = config::to_toml(loaded.config())?.parse()?;
        Ok(serde_json::to_string(&table)?)
    };
    resolved().map_err(|e| crate::cohort_error(py, &e))
}
