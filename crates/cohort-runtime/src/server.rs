//! The federated round loop.
//!
//! One round, in order:
//! 1. select `per_round` logical clients ([`ClientSelector`]);
//! 2. encode the global model once (the payload each selected client receives);
//! 3. hand each client to the worker pool, which trains it on its partition;
//! 4. encode and decode each update through the safetensors codec, as a real
//!    transport would, counting the bytes;
//! 5. put the updates back in selection order and aggregate them with the one
//!    validated FedAvg ([`cohort_core::aggregate::fedavg`]);
//! 6. evaluate the new global model on the test set, write the results row and
//!    the model, and stop at `rounds` or at `target_accuracy`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};

use cohort_core::aggregate::{Contribution, FedAvgOutcome, fedavg};
use cohort_core::checkpoint::{self, History};
use cohort_core::codec::{self, DecodeLimits};
use cohort_core::config::LoadedConfig;
use cohort_core::data::{self, DataSource, Fetch};
use cohort_core::fsutil::atomic_write;
use cohort_core::hooks::{ClientReport, NoHooks, RoundPayloads, ServerHooks};
use cohort_core::partition;
use cohort_core::results::{ClientRow, ResultsWriter, RoundRow};
use cohort_core::selection::ClientSelector;
use cohort_core::tree::ParamTree;
use cohort_train::device::{self, DeviceRequest};
use cohort_train::init::seeded_parameters;
use cohort_train::trainer::{ClientTask, Evaluator, LocalTrainer, TrainSettings};

use crate::pool::{Job, WorkerPool};

/// How the command line shaped this run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub device: DeviceRequest,
    /// The run folder, created if missing.
    pub run_dir: PathBuf,
    /// Overrides `trainer.rounds`.
    pub rounds: Option<u32>,
    /// Where datasets live; overrides `data.data_path`.
    pub data_root: Option<PathBuf>,
    pub show_progress: bool,
    /// Continue from the newest complete checkpoint in `run_dir`.
    pub resume: bool,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub rounds: Vec<RoundRow>,
    pub run_dir: PathBuf,
    pub model_path: PathBuf,
    pub reached_target: bool,
}

/// Where a run starts: fresh, or from a checkpoint.
struct StartPoint {
    global: ParamTree,
    selector: ClientSelector,
    results: ResultsWriter,
    first_round: u32,
    /// Wall seconds the run had used before this process.
    elapsed_before: f64,
}

/// The newest complete checkpoint of `run_dir`, checked against the config.
fn resume_point(loaded: &LoadedConfig, run_dir: &Path) -> anyhow::Result<StartPoint> {
    let restored = checkpoint::latest(run_dir)?;
    for skipped in &restored.skipped {
        tracing::warn!("skipping checkpoint {skipped}");
    }
    let history = restored.history;
    if history.config_hash != loaded.result_hash() {
        bail!(
            "the config differs from the one {} was started with in a key that changes results \
             (config hash {} vs checkpoint {}); resume with the run's own config.toml",
            run_dir.display(),
            loaded.result_hash(),
            history.config_hash
        );
    }
    tracing::info!(
        round = history.round,
        "resuming after round {}",
        history.round
    );
    Ok(StartPoint {
        global: restored.model,
        selector: ClientSelector::from_state(history.selector),
        elapsed_before: history.rounds.last().map_or(0.0, |r| r.elapsed_time),
        first_round: history.round + 1,
        results: ResultsWriter::resume(run_dir, history.rounds, history.clients),
    })
}

/// A round handed to the pool: who trains, and the size of the global payload.
struct Dispatched {
    clients: Vec<u32>,
    payload_bytes: u64,
}

/// Name of the final model file in the run folder.
pub const MODEL_FILE: &str = "model.safetensors";

/// Runs the configured federated training in this process.
pub fn run(loaded: &LoadedConfig, options: &RunOptions) -> anyhow::Result<RunSummary> {
    run_with_hooks(loaded, options, &mut NoHooks)
}

/// [`run`] with server hooks between receipt and aggregation. A hook that
/// breaks the positional contract stops the run before that round's
/// aggregation; the global model and the files of earlier rounds stay as they
/// were.
pub fn run_with_hooks(
    loaded: &LoadedConfig,
    options: &RunOptions,
    hooks: &mut dyn ServerHooks,
) -> anyhow::Result<RunSummary> {
    let config = &loaded.config;
    std::fs::create_dir_all(&options.run_dir)
        .with_context(|| format!("cannot create the run folder {}", options.run_dir.display()))?;
    // A resumed run keeps the config it started with.
    if !options.resume {
        atomic_write(
            &options.run_dir.join("config.toml"),
            toml_text(&loaded.merged).as_bytes(),
        )
        .context("cannot write config.toml into the run folder")?;
    }

    let selected = device::select(options.device)?;
    tracing::info!(device = selected.name, "compute device");

    let source =
        DataSource::from_name(&config.data.datasource).expect("validated by the config loader");
    let data_root = options
        .data_root
        .clone()
        .unwrap_or_else(|| config.data.data_path.clone());
    let fetch = if config.data.download {
        Fetch::FromMirrors(config.data.mirrors.clone().unwrap_or_default())
    } else {
        Fetch::Never
    };
    let loading = Instant::now();
    let splits = data::load(source, &data_root, &fetch)?;
    tracing::info!(
        train = splits.train.len(),
        test = splits.test.len(),
        seconds = loading.elapsed().as_secs_f64(),
        "loaded {:?} from {}",
        source,
        data_root.display()
    );
    let partitions: Vec<Arc<Vec<u32>>> = partition::iid(
        splits.train.len(),
        config.clients.total_clients as usize,
        config.data.partition_size,
        config.data.random_seed,
    )
    .context("config `data.partition_size` / `clients.total_clients` do not fit the training set")?
    .into_iter()
    .map(Arc::new)
    .collect();

    let trainer_config = &config.trainer;
    let num_classes = config.parameters.model.num_classes;
    let settings = TrainSettings {
        epochs: trainer_config.epochs,
        batch_size: trainer_config.batch_size,
        optimizer: loaded.optimizer.clone(),
        clip_grad_norm: trainer_config.clip_grad_norm,
        training_seed: trainer_config.training_seed,
    };
    let mut evaluator = Evaluator::new(
        &trainer_config.model_name,
        num_classes,
        &selected.device,
        trainer_config.eval_batch_size,
    )?;
    let start = if options.resume {
        resume_point(loaded, &options.run_dir)?
    } else {
        StartPoint {
            global: match trainer_config.model_seed {
                Some(seed) => seeded_parameters(&evaluator.parameters(), seed),
                None => evaluator.parameters(),
            },
            selector: ClientSelector::new(config.server.random_seed),
            results: ResultsWriter::new(&options.run_dir),
            first_round: 1,
            elapsed_before: 0.0,
        }
    };
    let StartPoint {
        mut global,
        mut selector,
        mut results,
        first_round,
        elapsed_before,
    } = start;
    let mut simulated_before = results.rounds().last().map_or(0.0, |r| r.simulated_time);
    let workers = (0..trainer_config.max_concurrency)
        .map(|_| {
            LocalTrainer::new(
                &trainer_config.model_name,
                num_classes,
                &selected.device,
                settings.clone(),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let pool = WorkerPool::start(
        workers,
        Arc::new(splits.train),
        trainer_config.threads_per_worker as usize,
    )?;

    let rounds = options.rounds.unwrap_or(trainer_config.rounds);
    let per_round = config.clients.per_round;
    let progress = progress_bar(
        options.show_progress,
        (rounds + 1).saturating_sub(first_round) as u64 * per_round as u64,
    );
    let model_path = options.run_dir.join(MODEL_FILE);
    let limits = DecodeLimits::default();
    let run_started = Instant::now();
    let mut reached_target = false;

    // Round r + 1 trains while round r's model is evaluated: the next round
    // needs only the aggregated model, not its accuracy. Evaluation gets its own
    // compute threads so it does not oversubscribe the workers' cores.
    let evaluation_pool = rayon::ThreadPoolBuilder::new()
        .num_threads(trainer_config.threads_per_worker as usize)
        .thread_name(|i| format!("cohort-eval{i}"))
        .build()?;
    let schedule = loaded.lr_schedule();
    // `payload_bytes` is the size of the encoded global model, which the
    // caller has encoded already (it is also the model file).
    let dispatch = |round: u32,
                    global: &ParamTree,
                    payload_bytes: u64,
                    selector: &mut ClientSelector|
     -> anyhow::Result<Dispatched> {
        let clients = selector.select(config.clients.total_clients, per_round);
        tracing::info!(round, clients = ?clients, "round dispatched");
        let shared = Arc::new(global.clone());
        for (slot, &client_id) in clients.iter().enumerate() {
            pool.submit(Job {
                slot,
                task: ClientTask { client_id, round },
                global: Arc::clone(&shared),
                partition: Arc::clone(&partitions[client_id as usize - 1]),
                learning_rate: schedule.rate(loaded.optimizer.learning_rate(), round),
            })?;
        }
        Ok(Dispatched {
            clients,
            payload_bytes,
        })
    };
    if first_round > rounds {
        tracing::info!(rounds, "all rounds are done already");
        return Ok(RunSummary {
            rounds: results.rounds().to_vec(),
            run_dir: options.run_dir.clone(),
            model_path,
            reached_target,
        });
    }
    let initial_bytes = codec::encode(&global)?.len() as u64;
    let mut dispatched = dispatch(first_round, &global, initial_bytes, &mut selector)?;
    let mut previous_round_end = Instant::now();

    for round in first_round..=rounds {
        progress.set_message(format!("round {round}/{rounds}"));
        let selected_clients = std::mem::take(&mut dispatched.clients);
        let mut arrived = Vec::with_capacity(selected_clients.len());
        // Simulated wall time: the selected clients as if run in parallel.
        let mut slowest_client = 0.0f64;
        let mut bytes_to_server = 0u64;
        for _ in 0..selected_clients.len() {
            let result = pool.next_result()?;
            let update = result.outcome?;
            // The update crosses the (simulated) wire exactly as it would a socket.
            let processing_started = Instant::now();
            let payload = codec::encode(&update.tree)?;
            bytes_to_server += payload.len() as u64;
            let received = codec::decode(&payload, &limits)
                .with_context(|| format!("client {}: update payload", result.task.client_id))?;
            let processing_time = processing_started.elapsed().as_secs_f64();
            slowest_client = slowest_client.max(update.training_time + processing_time);
            tracing::debug!(
                client = result.task.client_id,
                worker = result.worker,
                loss = update.loss,
                seconds = update.training_time,
                "client finished"
            );
            let report = ClientReport {
                client_id: result.task.client_id,
                num_samples: update.num_samples,
                loss: update.loss,
                training_time: update.training_time,
                worker: result.worker,
            };
            arrived.push((result.slot, report, received));
            progress.inc(1);
        }
        let payloads = RoundPayloads::assemble(round, &selected_clients, arrived)?
            .apply_hooks(hooks, &global)?
            .into_payloads();
        let contributions: Vec<Contribution<'_>> = payloads
            .iter()
            .map(|payload| Contribution {
                client_id: payload.report.client_id,
                weight: payload.report.num_samples as f64,
                tree: payload.tree(),
            })
            .collect();
        match fedavg(&global, &contributions)
            .with_context(|| format!("round {round}: aggregation refused"))?
        {
            FedAvgOutcome::Updated(tree) => global = tree,
            FedAvgOutcome::Unchanged => {
                tracing::warn!(round, "total sample weight is zero; global model unchanged")
            }
        }
        let reports: Vec<ClientReport> = payloads.into_iter().map(|p| p.into_parts().0).collect();
        let bytes_to_clients = dispatched.payload_bytes * selected_clients.len() as u64;
        // The checkpoint of this round must hold the selector as it was before
        // the next round's draw, so a resumed run draws the same clients.
        let selector_after_round = selector.state(config.server.random_seed);
        let model_bytes = codec::encode(&global)?;
        if round < rounds {
            dispatched = dispatch(round + 1, &global, model_bytes.len() as u64, &mut selector)?;
        }

        let evaluation_started = Instant::now();
        let accuracy = evaluation_pool.install(|| evaluator.accuracy(&global, &splits.test))?;
        let evaluation_time = evaluation_started.elapsed().as_secs_f64();

        atomic_write(&model_path, &model_bytes)
            .with_context(|| format!("cannot write {}", model_path.display()))?;
        let total_samples: u64 = reports.iter().map(|r| r.num_samples).sum();
        let train_loss = reports
            .iter()
            .map(|r| r.loss * r.num_samples as f64)
            .sum::<f64>()
            / total_samples.max(1) as f64;
        let row = RoundRow {
            round,
            accuracy,
            elapsed_time: elapsed_before + run_started.elapsed().as_secs_f64(),
            round_time: previous_round_end.elapsed().as_secs_f64(),
            training_time: reports.iter().map(|r| r.training_time).sum(),
            evaluation_time,
            bytes_to_clients,
            bytes_to_server,
            train_loss,
            simulated_time: simulated_before + slowest_client,
        };
        simulated_before = row.simulated_time;
        previous_round_end = Instant::now();
        let client_rows = reports
            .iter()
            .map(|r| ClientRow {
                round,
                client_id: r.client_id,
                worker: r.worker,
                samples: r.num_samples,
                loss: r.loss,
                training_time: r.training_time,
            })
            .collect();
        tracing::info!(
            round,
            accuracy,
            round_time = row.round_time,
            train_loss,
            "round finished"
        );
        progress.println(format!(
            "round {round:>3}: accuracy {:.4}, loss {:.4}, {:.2}s",
            accuracy, train_loss, row.round_time
        ));
        results
            .record(row, client_rows)
            .context("cannot write results.csv")?;

        let target_reached = trainer_config
            .target_accuracy
            .is_some_and(|target| accuracy >= target);
        if round % config.server.checkpoint_interval == 0 || round == rounds || target_reached {
            checkpoint::write(
                &options.run_dir,
                &model_bytes,
                History {
                    format: checkpoint::FORMAT_VERSION,
                    round,
                    config_hash: loaded.result_hash(),
                    selector: selector_after_round,
                    algorithm_state: serde_json::Value::Null,
                    rounds: results.rounds().to_vec(),
                    clients: results.clients().to_vec(),
                    model_file: String::new(),
                    model_sha256: String::new(),
                },
            )?;
        }

        if let Some(target) = trainer_config.target_accuracy
            && target_reached
        {
            tracing::info!(round, accuracy, target, "target accuracy reached");
            reached_target = true;
            // The next round may already be training; its work is dropped.
            pool.cancel();
            break;
        }
    }
    progress.finish_and_clear();
    if results.rounds().is_empty() {
        bail!("no round ran");
    }
    Ok(RunSummary {
        rounds: results.rounds().to_vec(),
        run_dir: options.run_dir.clone(),
        model_path,
        reached_target,
    })
}

fn progress_bar(show: bool, total: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} clients, {elapsed_precise}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

fn toml_text(table: &toml::Table) -> String {
    toml::to_string_pretty(table).unwrap_or_else(|_| table.to_string())
}

/// A fresh run folder name under `base`: `<stem>-<unix seconds>`, with a
/// counter when that exists already.
pub fn new_run_dir(base: &Path, config_path: &Path, name: Option<&str>) -> PathBuf {
    let stem = name.map(str::to_owned).unwrap_or_else(|| {
        let stem = config_path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "run".into());
        let seconds = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        format!("{stem}-{seconds}")
    });
    let mut candidate = base.join(&stem);
    let mut counter = 2;
    while candidate.exists() {
        candidate = base.join(format!("{stem}-{counter}"));
        counter += 1;
    }
    candidate
}
