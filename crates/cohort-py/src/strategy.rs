//! `cohort.Strategy`: a strategy written in Python, run by the round loop
//! as any [`Strategy`] given to `RunBuilder::strategy` is.
//!
//! The Python side (`cohort/_strategy.py`) wraps the user's object in a
//! bridge whose methods take and return only what crosses this boundary
//! elsewhere: tensors as `(name, dtype, shape, bytes)` tuples, numbers, and
//! the state as JSON text beside its tensors. The bridge checks what the
//! user's code returns (arrays of the model's layout, a state of arrays and
//! scalars, instructions by their names) and raises a Python exception
//! naming the key otherwise. Each call holds the GIL for its moment only:
//! the engine runs with it released.
//!
//! The contract with the round loop:
//!
//! * [`Strategy::aggregate`] calls `aggregate_fit`, then reads the state
//!   (`get_state`) in the same call, so a state that cannot be stored fails
//!   the round it was made in, never a checkpoint written later;
//!   [`Strategy::state`] returns that state as it was read (the trait's
//!   `state` cannot fail). Changes the user's code makes to its state
//!   outside `aggregate_fit` are seen at the next aggregation.
//! * [`Strategy::restore`] hands the checkpoint's state to `set_state`; one
//!   it raises on is skipped by the resume with the exception as the
//!   reason, as a damaged checkpoint is.
//! * A Python exception is the strategy author's bug, not a client's: the
//!   call returns [`StrategyError::Failed`] with the exception and its
//!   traceback, the run stops, and the exception itself is raised again in
//!   Python once the engine returns ([`StrategyFailure`]).
//!
//! What this cannot check: that the strategy is deterministic. Resuming is
//! exact only when its next model depends on nothing but its arguments and
//! its state (no unseeded randomness, no clock).

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use cohort_core::strategy::{
    Aggregated, ClientInstructions, ClientUpdate, RoundContext, Strategy, StrategyError,
    StrategyState,
};
use cohort_core::tree::{Array, ArrayData, FlatTree, ParamTree};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::tensors::{TensorIn, TensorOut, dtype_of, tensors_of};

/// The first exception the strategy's code raised in a run, shared with the
/// caller so that it can be raised again once the engine returns.
pub(crate) type StrategyFailure = Arc<Mutex<Option<PyErr>>>;

/// The user's strategy behind its Python bridge.
pub(crate) struct PythonStrategy {
    bridge: Py<PyAny>,
    name: &'static str,
    /// Whether the user's class has its own `configure_fit`: without one,
    /// clients train at the round's rate and Python is not called per client.
    configures: bool,
    /// The state read after the last aggregation (or at the start, or as
    /// restored): what a checkpoint stores.
    state: StrategyState,
    failure: StrategyFailure,
}

/// A strategy name as the trait gives it (`&'static str`): each distinct
/// name is leaked once for the life of the process, so running the same
/// class again costs nothing more.
fn interned(name: String) -> &'static str {
    static NAMES: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let mut guard = match NAMES.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    };
    let names = guard.get_or_insert_with(HashSet::new);
    if let Some(known) = names.get(name.as_str()) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.into_boxed_str());
    names.insert(leaked);
    leaked
}

/// The state the bridge gives: JSON text of the small values, and the
/// arrays.
type StateIn<'py> = (String, Vec<TensorIn<'py>>);

impl PythonStrategy {
    /// Wraps `bridge` (a `cohort._strategy.Bridge`), reading its name and
    /// its initial state now, so that a state that cannot be stored is
    /// refused before the run starts.
    pub(crate) fn new(
        py: Python<'_>,
        bridge: Py<PyAny>,
        failure: StrategyFailure,
    ) -> PyResult<Self> {
        let bound = bridge.bind(py);
        let name: String = bound.getattr("name")?.extract()?;
        let configures: bool = bound.getattr("configures")?.extract()?;
        let state: StateIn<'_> = bound.call_method0("get_state")?.extract()?;
        let state = state_of(state).map_err(pyo3::exceptions::PyValueError::new_err)?;
        Ok(Self {
            bridge,
            name: interned(name),
            configures,
            state,
            failure,
        })
    }

    /// Runs `call` with the GIL; a Python exception is kept for the caller
    /// and becomes [`StrategyError::Failed`] with its traceback.
    fn call<T>(
        &self,
        method: &str,
        call: impl for<'py> FnOnce(Python<'py>, &Bound<'py, PyAny>) -> PyResult<T>,
    ) -> Result<T, StrategyError> {
        self.call_python(method, call).map_err(|failed| {
            let (error, failed) = *failed;
            if let Ok(mut slot) = self.failure.lock() {
                slot.get_or_insert(error);
            }
            failed
        })
    }

    /// [`Self::call`] without keeping the exception: for a call whose
    /// failure the run handles itself.
    fn call_python<T>(
        &self,
        method: &str,
        call: impl for<'py> FnOnce(Python<'py>, &Bound<'py, PyAny>) -> PyResult<T>,
    ) -> Result<T, Box<(PyErr, StrategyError)>> {
        Python::attach(|py| {
            call(py, self.bridge.bind(py)).map_err(|error| {
                let message = format!("{method} raised {}", described(py, &error));
                let failed = StrategyError::Failed {
                    strategy: self.name,
                    message,
                };
                Box::new((error, failed))
            })
        })
    }

    /// A failure of this side's own (a state or model that does not fit),
    /// raised in Python as a `ValueError` with the same message.
    fn refused(&self, message: String) -> StrategyError {
        if let Ok(mut slot) = self.failure.lock() {
            slot.get_or_insert(pyo3::exceptions::PyValueError::new_err(format!(
                "strategy {}: {message}",
                self.name
            )));
        }
        StrategyError::Failed {
            strategy: self.name,
            message,
        }
    }
}

/// `ValueError: boom` and the traceback Python would print.
fn described(py: Python<'_>, error: &PyErr) -> String {
    let traceback = error
        .traceback(py)
        .and_then(|traceback| traceback.format().ok())
        .unwrap_or_default();
    format!("{error}\n{traceback}").trim_end().to_owned()
}

/// The bridge's state as a [`StrategyState`]: the JSON as it is, each array
/// a leaf under its key (the bridge keeps keys to plain identifiers, which
/// the checkpoint's safetensors file stores as they are).
fn state_of((scalars, tensors): StateIn<'_>) -> Result<StrategyState, String> {
    let scalars: serde_json::Value = serde_json::from_str(&scalars)
        .map_err(|error| format!("the state's scalars are not JSON: {error}"))?;
    let mut leaves = BTreeMap::new();
    for (name, dtype, shape, bytes) in tensors {
        let array = leaf_of(&name, &dtype, shape, bytes.as_bytes())?;
        leaves.insert(name, ParamTree::Leaf(array));
    }
    Ok(StrategyState {
        scalars,
        tensors: leaves,
    })
}

fn leaf_of(name: &str, dtype: &str, shape: Vec<usize>, bytes: &[u8]) -> Result<Array, String> {
    let kind = dtype_of(dtype).ok_or_else(|| format!("`{name}`: dtype {dtype} is not stored"))?;
    let data = ArrayData::from_le_bytes(kind, bytes).ok_or_else(|| {
        format!(
            "`{name}`: {} bytes are not whole {dtype} elements",
            bytes.len()
        )
    })?;
    Array::new(shape, data).map_err(|error| format!("`{name}`: {error}"))
}

/// A checkpoint's state as the bridge takes it.
fn state_out<'py>(
    py: Python<'py>,
    state: &StrategyState,
) -> Result<(String, Vec<TensorOut<'py>>), String> {
    let mut tensors = Vec::new();
    for (name, tree) in &state.tensors {
        let ParamTree::Leaf(array) = tree else {
            return Err(format!("`{name}` is a {}, not an array", tree.kind()));
        };
        tensors.push((
            name.clone(),
            crate::tensors::name_of(array.dtype()),
            array.shape().to_vec(),
            PyBytes::new(py, &array.data().to_le_bytes()),
        ));
    }
    Ok((state.scalars.to_string(), tensors))
}

/// The arrays the user's `aggregate_fit` returned, in the global model's
/// order, as a tree of its layout; each must have its leaf's name, dtype
/// and shape.
fn model_of(global: &ParamTree, tensors: Vec<TensorIn<'_>>) -> Result<ParamTree, String> {
    let reference = global.leaves();
    if tensors.len() != reference.len() {
        return Err(format!(
            "aggregate_fit returned {} arrays; the model has {}",
            tensors.len(),
            reference.len()
        ));
    }
    let mut leaves = Vec::with_capacity(reference.len());
    for ((path, expected), (name, dtype, shape, bytes)) in reference.into_iter().zip(tensors) {
        let array = leaf_of(&name, &dtype, shape, bytes.as_bytes())?;
        if array.dtype() != expected.dtype() || array.shape() != expected.shape() {
            return Err(format!(
                "aggregate_fit returned `{path}` as {} {:?}; the model's is {} {:?}",
                array.dtype(),
                array.shape(),
                expected.dtype(),
                expected.shape()
            ));
        }
        leaves.push((path, array));
    }
    FlatTree {
        skeleton: global.skeleton(),
        leaves,
    }
    .unflatten()
    .map_err(|error| error.to_string())
}

/// A client's update as the bridge takes it.
type UpdateOut<'py> = (u32, u64, u64, Vec<TensorOut<'py>>);

/// What the bridge's `aggregate` returns: the next model's arrays (`None`:
/// unchanged) and the state after it.
type AggregateIn<'py> = (Option<Vec<TensorIn<'py>>>, StateIn<'py>);

impl Strategy for PythonStrategy {
    fn name(&self) -> &'static str {
        self.name
    }

    fn configure(
        &self,
        ctx: &RoundContext,
        client_id: u32,
        global: &ParamTree,
    ) -> Result<ClientInstructions, StrategyError> {
        if !self.configures {
            return Ok(ClientInstructions::plain(ctx.learning_rate));
        }
        let (learning_rate, proximal_mu, update_clip_norm) =
            self.call("configure_fit", |py, bridge| {
                let args = (
                    ctx.round,
                    client_id,
                    ctx.learning_rate,
                    tensors_of(py, global),
                );
                bridge.call_method1("configure", args)?.extract()
            })?;
        Ok(ClientInstructions {
            learning_rate,
            proximal_mu,
            gradient_correction: None,
            update_clip_norm,
        })
    }

    fn aggregate(
        &mut self,
        ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        let (model, state) = self.call("aggregate_fit", |py, bridge| {
            let updates: Vec<UpdateOut<'_>> = updates
                .iter()
                .map(|u| {
                    (
                        u.client_id,
                        u.num_samples,
                        u.local_steps,
                        tensors_of(py, u.tree),
                    )
                })
                .collect();
            let args = (ctx.round, tensors_of(py, global), updates);
            let (tensors, state): AggregateIn<'_> =
                bridge.call_method1("aggregate", args)?.extract()?;
            let model = tensors.map(|t| model_of(global, t)).transpose();
            Ok((model, state_of(state)))
        })?;
        let model = model.map_err(|message| self.refused(message))?;
        self.state = state.map_err(|message| self.refused(message))?;
        Ok(Aggregated {
            model,
            ..Aggregated::unchanged()
        })
    }

    fn state(&self) -> StrategyState {
        self.state.clone()
    }

    /// A state `set_state` refuses is not the run's end: the resume skips
    /// that checkpoint with the reason, as it skips a damaged one.
    fn restore(&mut self, state: StrategyState) -> Result<(), StrategyError> {
        let name = self.name;
        self.call_python("set_state", |py, bridge| {
            let (scalars, tensors) = state_out(py, &state).map_err(|problem| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "the checkpoint's state of {name} is not a cohort.Strategy state: {problem}"
                ))
            })?;
            bridge.call_method1("set_state", (scalars, tensors))?;
            Ok(())
        })
        .map_err(|failed| failed.1)?;
        self.state = state;
        Ok(())
    }
}
