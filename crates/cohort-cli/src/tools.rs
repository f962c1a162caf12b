//! `cohort aggregate` and `cohort partitions`: the strategy and the
//! partitioner of a config, applied once, outside a run.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use cohort_core::config::LoadedConfig;
use cohort_core::strategy::{ClientUpdate, RoundContext};
use cohort_core::tree::ParamTree;

/// One `FILE=SAMPLES` argument of `cohort aggregate`.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateArg {
    pub path: PathBuf,
    pub samples: u64,
}

/// Parses `FILE=SAMPLES`; the last `=` separates them, so file names may hold `=`.
pub fn parse_update(text: &str) -> Result<UpdateArg, String> {
    let (path, samples) = text
        .rsplit_once('=')
        .ok_or_else(|| format!("`{text}`: expected FILE=SAMPLES, e.g. client1.safetensors=600"))?;
    let samples = samples
        .parse::<u64>()
        .map_err(|_| format!("`{text}`: `{samples}` is not a whole number of samples"))?;
    if path.is_empty() {
        return Err(format!("`{text}`: the file name is empty"));
    }
    Ok(UpdateArg {
        path: PathBuf::from(path),
        samples,
    })
}

/// Applies the configured strategy, with fresh state, to `updates` from
/// `global` (model files in PyTorch's layout: `state_dict` names and shapes,
/// BatchNorm's `num_batches_tracked` dropped on reading and written as 0), and
/// writes the result to `output` atomically. Client ids are the
/// updates' positions, from 1; every update reports `local_steps` steps.
pub fn aggregate(
    registry: &cohort_train::registry::Registry,
    loaded: &LoadedConfig,
    global_path: &Path,
    output: &Path,
    updates: &[UpdateArg],
    local_steps: u64,
) -> anyhow::Result<String> {
    if updates.is_empty() {
        bail!("give at least one update as FILE=SAMPLES");
    }
    let global = crate::read_model(global_path)?;
    let trees: Vec<ParamTree> = updates
        .iter()
        .map(|u| crate::read_model(&u.path))
        .collect::<anyhow::Result<_>>()?;
    let client_updates: Vec<ClientUpdate<'_>> = updates
        .iter()
        .zip(&trees)
        .enumerate()
        .map(|(index, (arg, tree))| ClientUpdate {
            client_id: index as u32 + 1,
            num_samples: arg.samples,
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
    let mut strategy = registry.strategy_of(loaded)?;
    let outcome = strategy
        .aggregate(&ctx, &global, &client_updates)
        .with_context(|| format!("{} refused the updates", strategy.name()))?;
    let weighted = updates.iter().filter(|u| u.samples > 0).count();
    let unchanged = outcome.model.as_ref().is_none_or(|model| *model == global);
    let model = outcome.model.unwrap_or_else(|| global.clone());
    let file = cohort_core::layout::to_model_file(&model);
    let bytes = cohort_core::codec::encode(file.as_ref().unwrap_or(&model))?;
    cohort_core::fsutil::atomic_write(output, &bytes)
        .with_context(|| format!("cannot write {}", output.display()))?;
    let unweighted = match updates.len() - weighted {
        0 => String::new(),
        n => format!(" ({n} of them with 0 samples, so no weight)"),
    };
    let mut summary = if unchanged {
        format!(
            "{}: the global model is unchanged by the {} update(s){unweighted}; wrote it to {}",
            strategy.name(),
            updates.len(),
            output.display()
        )
    } else {
        format!(
            "{}: {} update(s) aggregated{unweighted} into {}",
            strategy.name(),
            updates.len(),
            output.display()
        )
    };
    if let Some(selected) = outcome.selected {
        let files: Vec<String> = selected
            .iter()
            .map(|&id| updates[id as usize - 1].path.display().to_string())
            .collect();
        summary.push_str(&format!("; used {}", files.join(", ")));
    }
    if let Some(privacy) = outcome.privacy {
        summary.push_str(&format!(
            "; ε = {:.4} at δ = {} for one round",
            privacy.epsilon, privacy.delta
        ));
    }
    Ok(summary)
}

/// What `cohort evaluate` reports.
pub struct Evaluation {
    pub correct: u64,
    pub samples: usize,
    pub test_samples: usize,
}

/// What `cohort evaluate` is asked: the model file (PyTorch's layout), how
/// many of the test set's first samples (all by default), where to write
/// the logits, and the device.
pub struct EvaluateRequest<'a> {
    pub model: &'a Path,
    pub first: Option<usize>,
    pub logits: Option<&'a Path>,
    pub device: cohort_train::device::DeviceRequest,
}

/// The accuracy of the request's model file on the first samples of the
/// config's test set, counted as a run counts it; with `logits`, also writes
/// each sample's logits (`[samples, classes]` float32) and label (int64)
/// there as safetensors.
pub fn evaluate(
    loaded: &LoadedConfig,
    registry: &cohort_train::registry::Registry,
    data_root: Option<&Path>,
    request: &EvaluateRequest<'_>,
) -> anyhow::Result<Evaluation> {
    let config = loaded.config();
    let model = request.model;
    let tree = crate::read_model(model)?;
    // Every prediction of such a model is the same garbage: an accuracy of
    // it would read as a (poor) score.
    if let Some((path, index)) = tree.first_non_finite() {
        bail!(
            "{}: `{path}`[{index}] is not finite; a model with NaN or infinite values has no \
             accuracy",
            model.display()
        );
    }
    let test = test_set(loaded, registry, data_root)?;
    let samples = request.first.unwrap_or(test.len());
    if samples == 0 || samples > test.len() {
        bail!(
            "--first {samples}: the test set of {} has {} samples; give 1 to {}",
            config.data.datasource,
            test.len(),
            test.len()
        );
    }
    let selected = cohort_train::device::select(request.device)?;
    let mut evaluator = registry
        .run_model_in(loaded, data_root, test.sample_shape.clone())?
        .evaluator(&selected.device, config.trainer.eval_batch_size)?;
    let indices: Vec<u32> = (0..samples as u32).collect();
    let predictions = evaluator
        .predictions(&tree, &test, &indices)
        .with_context(|| {
            format!(
                "{} is not a {} model in PyTorch's layout (trainer.model_name of {})",
                model.display(),
                config.trainer.model_name,
                loaded.path().display()
            )
        })?;
    if let Some(path) = request.logits {
        write_logits(path, samples, &predictions)?;
    }
    Ok(Evaluation {
        correct: predictions.correct,
        samples,
        test_samples: test.len(),
    })
}

/// The config's test set alone.
fn test_set(
    loaded: &LoadedConfig,
    registry: &cohort_train::registry::Registry,
    data_root: Option<&Path>,
) -> anyhow::Result<cohort_core::data::Dataset> {
    let data = &loaded.config().data;
    let request = cohort_train::registry::DataRequest {
        root: data_root.unwrap_or(&data.data_path).to_path_buf(),
        fetch: if data.download {
            cohort_core::data::Fetch::FromMirrors(data.mirrors.clone().unwrap_or_default())
        } else {
            cohort_core::data::Fetch::Never
        },
        test_only: true,
        train_rows: None,
    };
    Ok(registry
        .load_data(loaded, &request)
        .map_err(anyhow::Error::from_boxed)?
        .test)
}

/// `--logits`: each sample's logits and label, as safetensors.
fn write_logits(
    path: &Path,
    samples: usize,
    predictions: &cohort_train::trainer::Predictions,
) -> anyhow::Result<()> {
    let shape = vec![samples, predictions.classes];
    let labels = predictions.labels.iter().map(|&l| l as i64).collect();
    let out = ParamTree::from_dotted([
        (
            "logits".to_owned(),
            cohort_core::tree::Array::f32(shape, predictions.logits.clone())?,
        ),
        (
            "labels".to_owned(),
            cohort_core::tree::Array::new(
                vec![samples],
                cohort_core::tree::ArrayData::I64(labels),
            )?,
        ),
    ]);
    cohort_core::fsutil::atomic_write(path, &cohort_core::codec::encode(&out)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

/// What `cohort partitions` shows: each client's label histogram, the
/// table of them, and the assignment itself.
pub struct PartitionReport {
    pub histograms: Vec<Vec<u64>>,
    pub table: String,
    /// `--json`: which training-set samples each client trains on (and holds
    /// out), exactly as a run computes them, so another framework can train
    /// the same clients on the same samples.
    pub assignment: serde_json::Value,
}

/// The config's partitions of its data set: histograms, table and
/// assignment; with `sample_orders`, each client's sample order in every
/// local epoch of every round.
pub fn partitions(
    loaded: &LoadedConfig,
    registry: &cohort_train::registry::Registry,
    data_root: Option<&Path>,
    sample_orders: bool,
) -> anyhow::Result<PartitionReport> {
    let config = loaded.config();
    let clients = &config.clients;
    let training_seed = match (sample_orders, config.trainer.training_seed) {
        (true, None) => anyhow::bail!(
            "{}: --sample-orders needs trainer.training_seed: without it each run \
             shuffles from fresh entropy, so no order can be written ahead",
            loaded.path().display()
        ),
        (_, seed) => seed.filter(|_| sample_orders),
    };
    if clients.all_own_data() {
        anyhow::bail!(
            "{}: every client brings its own data (clients.own_data_clients = \
             clients.total_clients = {}), so the run computes no partitions",
            loaded.path().display(),
            clients.total_clients
        );
    }
    let (splits, partitions) = cohort_runtime::client::load_data(loaded, registry, data_root)?;
    // The data set's classes: a file data set's come from its labels.
    let classes = registry.dataset_in(loaded, data_root)?.classes();
    let labels = &splits.train.labels;
    let table = cohort_core::partition::summary_table(&partitions.train, labels, classes);
    let histograms = partitions
        .train
        .iter()
        .map(|part| cohort_core::partition::label_histogram(labels, part, classes))
        .collect();
    let own_data = clients.own_data_clients as usize;
    let mut assignment = serde_json::json!({
        "format": 1,
        "config": loaded.path().display().to_string(),
        "config_hash": loaded.result_hash(),
        "datasource": config.data.datasource,
        "train_samples": splits.train.len(),
        "test_samples": splits.test.len(),
        "clients": partitions
            .train
            .iter()
            .zip(&partitions.test)
            .enumerate()
            .map(|(index, (train, held_out))| serde_json::json!({
                "client_id": index + 1,
                "own_data": index < own_data,
                "train": train,
                "held_out": held_out,
            }))
            .collect::<Vec<_>>(),
    });
    if let Some(seed) = training_seed {
        add_sample_orders(&mut assignment, &partitions.train, seed, &config.trainer)?;
    }
    Ok(PartitionReport {
        histograms,
        table,
        assignment,
    })
}

/// The most sample indices `--sample-orders` writes: each is a JSON number
/// held in memory first, so 100 million are several gigabytes already.
const MAX_SAMPLE_ORDER_ENTRIES: u64 = 100_000_000;

/// `cohort partitions --sample-orders`: each client's `orders[round − 1]
/// [epoch − 1]`, the sequence its batches are cut from, and the settings they
/// depend on; refused, before anything is drawn, past
/// [`MAX_SAMPLE_ORDER_ENTRIES`].
fn add_sample_orders(
    assignment: &mut serde_json::Value,
    train: &[Vec<u32>],
    training_seed: u64,
    trainer: &cohort_core::config::Trainer,
) -> anyhow::Result<()> {
    let samples: u64 = train.iter().map(|partition| partition.len() as u64).sum();
    let entries = samples
        .checked_mul(u64::from(trainer.rounds))
        .and_then(|n| n.checked_mul(u64::from(trainer.epochs)));
    if entries.is_none_or(|n| n > MAX_SAMPLE_ORDER_ENTRIES) {
        anyhow::bail!(
            "--sample-orders would write {samples} samples × {} rounds × {} epochs of \
             indices, more than {MAX_SAMPLE_ORDER_ENTRIES}: lower trainer.rounds (--set \
             trainer.rounds=N writes the first N rounds' orders, the same as the run's)",
            trainer.rounds,
            trainer.epochs
        );
    }
    assignment["sample_orders"] = serde_json::json!({
        "training_seed": training_seed,
        "rounds": trainer.rounds,
        "epochs": trainer.epochs,
        "batch_size": trainer.batch_size,
    });
    let clients = assignment["clients"]
        .as_array_mut()
        .context("the assignment has its clients")?;
    for ((index, client), partition) in clients.iter_mut().enumerate().zip(train) {
        let client_id = u32::try_from(index + 1).context("more than u32::MAX clients")?;
        let orders: Vec<Vec<Vec<u32>>> = (1..=trainer.rounds)
            .map(|round| {
                cohort_core::seeds::epoch_orders(
                    partition,
                    training_seed,
                    client_id,
                    round,
                    trainer.epochs,
                )
            })
            .collect();
        client["orders"] = serde_json::json!(orders);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_orders_past_their_bound_are_refused_before_any_is_drawn() {
        let trainer = cohort_core::config::Trainer {
            rounds: 1_000_000,
            ..Default::default()
        };
        let mut assignment = serde_json::json!({"clients": [{}, {}]});
        let train = vec![(0..60).collect::<Vec<u32>>(); 2];
        let error = add_sample_orders(&mut assignment, &train, 1, &trainer).unwrap_err();
        assert!(
            error.to_string().contains("lower trainer.rounds"),
            "{error}"
        );
        assert!(assignment.get("sample_orders").is_none());
        let few = cohort_core::config::Trainer {
            rounds: 2,
            ..Default::default()
        };
        add_sample_orders(&mut assignment, &train, 1, &few).unwrap();
        assert_eq!(
            assignment["clients"][1]["orders"].as_array().unwrap().len(),
            2
        );
    }

    #[test]
    fn update_arguments_parse_or_say_why() {
        assert_eq!(
            parse_update("a=b.safetensors=600").unwrap(),
            UpdateArg {
                path: PathBuf::from("a=b.safetensors"),
                samples: 600
            }
        );
        assert!(
            parse_update("x.safetensors")
                .unwrap_err()
                .contains("FILE=SAMPLES")
        );
        assert!(
            parse_update("x=-3")
                .unwrap_err()
                .contains("not a whole number")
        );
        assert!(parse_update("=3").unwrap_err().contains("empty"));
    }
}
