//! `cohort.partition` and `cohort.aggregate`: a config's partitioner and
//! strategy applied once, outside a run, as `cohort partitions` and
//! `cohort aggregate` apply them. The Python side writes the config (a
//! dict: `[data]` for a partitioner, `[algorithm]` for a strategy), so the
//! options are checked by the config's own rules and named by their keys.

use anyhow::Context;
use cohort_core::strategy::{ClientUpdate, RoundContext};
use cohort_core::tree::ParamTree;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::config::{Source, load_or_raise};
use crate::tensors::{TensorIn, TensorOut, tensors_of, tree_of};

/// Little-endian u32 values, as NumPy's `astype("<u4").tobytes()` writes them.
fn u32s(bytes: &[u8], what: &str) -> anyhow::Result<Vec<u32>> {
    anyhow::ensure!(
        bytes.len().is_multiple_of(4),
        "{what}: {} bytes are not whole 32-bit values",
        bytes.len()
    );
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Each client's sample indices (client 1 first) as little-endian u32
/// bytes, split from `labels` (and, for the natural sampler, `users`) by
/// the config's `[data]` sampler for `clients.total_clients` clients.
#[pyfunction]
#[pyo3(signature = (table_json, labels, users))]
pub(crate) fn partition<'py>(
    py: Python<'py>,
    table_json: String,
    labels: Bound<'py, PyBytes>,
    users: Option<Bound<'py, PyBytes>>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let loaded = load_or_raise(py, &Source::Table(table_json), "{}")?;
    let split = || -> anyhow::Result<Vec<Vec<u32>>> {
        let labels = u32s(labels.as_bytes(), "labels")?;
        let users = users.map(|u| u32s(u.as_bytes(), "users")).transpose()?;
        Ok(loaded.partitions(&labels, users.as_deref())?)
    };
    let parts = split().map_err(|e| crate::cohort_error(py, &e))?;
    Ok(parts
        .iter()
        .map(|part| {
            let bytes: Vec<u8> = part.iter().flat_map(|i| i.to_le_bytes()).collect();
            PyBytes::new(py, &bytes)
        })
        .collect())
}

/// What one aggregation gives back: the next global model, the clients a
/// selecting strategy used, and the privacy spent (ε, δ) by one that
/// accounts for it.
type Aggregation<'py> = (Vec<TensorOut<'py>>, Option<Vec<u32>>, Option<(f64, f64)>);

/// Applies the config's strategy, with fresh state, to `updates` (each its
/// tensors and its sample count) from `global`, as `cohort aggregate` does:
/// client ids are the updates' positions from 1, round 1, and every update
/// reports `local_steps` steps.
#[pyfunction]
#[pyo3(signature = (table_json, global, updates, local_steps))]
pub(crate) fn aggregate<'py>(
    py: Python<'py>,
    table_json: String,
    global: Vec<TensorIn<'py>>,
    updates: Vec<(Vec<TensorIn<'py>>, u64)>,
    local_steps: u64,
) -> PyResult<Aggregation<'py>> {
    let loaded = load_or_raise(py, &Source::Table(table_json), "{}")?;
    let apply = || -> anyhow::Result<_> {
        anyhow::ensure!(!updates.is_empty(), "give at least one update");
        let global = cohort_core::layout::from_model_file(tree_of(global)?);
        let trees = updates
            .into_iter()
            .enumerate()
            .map(|(index, (tensors, samples))| {
                let tree = tree_of(tensors).with_context(|| format!("update {index}"))?;
                Ok((cohort_core::layout::from_model_file(tree), samples))
            })
            .collect::<anyhow::Result<Vec<(ParamTree, u64)>>>()?;
        let client_updates: Vec<ClientUpdate<'_>> = trees
            .iter()
            .enumerate()
            .map(|(index, (tree, samples))| ClientUpdate {
                client_id: index as u32 + 1,
                num_samples: *samples,
                local_steps,
                tree,
            })
            .collect();
        let clients = &loaded.config().clients;
        let ctx = RoundContext {
            round: 1,
            learning_rate: loaded
                .lr_schedule()
                .rate(loaded.optimizer().learning_rate(), 1),
            per_round: clients.per_round,
            total_clients: clients.total_clients,
        };
        let registry = cohort_train::registry::Registry::builtin();
        let mut strategy = registry.strategy_of(&loaded)?;
        let outcome = strategy
            .aggregate(&ctx, &global, &client_updates)
            .with_context(|| format!("{} refused the updates", strategy.name()))?;
        let model = outcome.model.unwrap_or(global);
        let file = cohort_core::layout::to_model_file(&model).unwrap_or(model);
        let privacy = outcome.privacy.map(|p| (p.epsilon, p.delta));
        Ok((file, outcome.selected, privacy))
    };
    let (model, selected, privacy) = apply().map_err(|e| crate::cohort_error(py, &e))?;
    Ok((tensors_of(py, &model), selected, privacy))
}
