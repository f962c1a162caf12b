//! The federated round loop.
//!
//! One round, in order:
//! 1. select `per_round` logical clients ([`ClientSelector`]);
//! 2. pack the global model once through `server.outbound_processors` (the
//!    payload every selected client receives);
//! 3. hand the tasks to the transport ([`Transport`]): worker threads of this
//!    process, or `cohort client` processes over gRPC. Each client unpacks the
//!    model, trains on its partition and packs its update;
//! 4. unpack each update through `server.inbound_processors`; a client that
//!    failed, timed out or sent a malformed payload is logged and dropped, and
//!    the round goes on if `clients.min_per_round` updates arrived;
//! 5. put the updates back in selection order and aggregate them with the one
//!    validated FedAvg ([`cohort_core::aggregate::fedavg`]);
//! 6. evaluate the new global model on the test set, write the results row and
//!    the model, and stop at `rounds` or at `target_accuracy`.
//!
//! Nothing of a round is written before its aggregation succeeded, so a round
//! that fails leaves the global model and every file as the last round left them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};

use cohort_core::aggregate::{Contribution, FedAvgOutcome, fedavg};
use cohort_core::checkpoint::{self, History};
use cohort_core::codec;
use cohort_core::config::LoadedConfig;
use cohort_core::fsutil::atomic_write;
use cohort_core::hooks::{ClientReport, NoHooks, RoundPayloads, ServerHooks};
use cohort_core::processors::Processor;
use cohort_core::results::{ClientRow, ResultsWriter, RoundRow};
use cohort_core::selection::ClientSelector;
use cohort_core::tree::ParamTree;
use cohort_train::device::{self, DeviceRequest};
use cohort_train::init::seeded_parameters;
use cohort_train::trainer::{ClientTask, Evaluator};

use crate::client::{ClientRunner, load_data};
use crate::grpc::{GrpcTransport, ServerSettings};
use crate::pool::WorkerPool;
use crate::transport::{TaskSpec, Transport};

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
    /// Network mode: client processes this run starts itself on this machine.
    pub local_clients: Option<LocalClients>,
}

/// Client processes `cohort run` starts for network mode.
#[derive(Debug, Clone)]
pub struct LocalClients {
    /// The `cohort` executable.
    pub program: PathBuf,
    pub count: usize,
    /// Extra arguments for `cohort client` (device flag, log level).
    pub args: Vec<String>,
}

/// The started client processes; killed when the run ends, however it ends.
struct ChildClients(Vec<std::process::Child>);

impl ChildClients {
    fn spawn(
        spec: &LocalClients,
        server: std::net::SocketAddr,
        loaded: &LoadedConfig,
        tls: bool,
    ) -> anyhow::Result<Self> {
        let mut children = Vec::new();
        for _ in 0..spec.count {
            let mut command = std::process::Command::new(&spec.program);
            command
                .arg("client")
                .arg("--server")
                .arg(server.to_string())
                .args(&spec.args);
            if let Some(token) = &loaded.config.server.auth_token {
                // The environment, not the command line: tokens stay out of `ps`.
                command.env("COHORT_TOKEN", token);
            }
            if tls && let Some(cert) = &loaded.config.server.tls_cert {
                command.arg("--tls-ca").arg(cert);
            }
            let child = command.spawn().with_context(|| {
                format!("cannot start a client process ({})", spec.program.display())
            })?;
            children.push(child);
        }
        Ok(Self(children))
    }
}

impl Drop for ChildClients {
    fn drop(&mut self) {
        // The server closing its streams ends the clients; give them a moment
        // to exit on their own before making sure.
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        for child in &mut self.0 {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
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

/// A round handed to the transport: who trains, and the size of the global payload.
struct Dispatched {
    clients: Vec<u32>,
    payload_bytes: u64,
}

/// The global model of a round, packed once.
struct Packed {
    /// Plain safetensors: the model file and the checkpoint.
    model_bytes: Arc<Vec<u8>>,
    /// After `server.outbound_processors`: what the clients receive (the same
    /// allocation when the pipeline is plain `safetensor_encode`).
    wire: Arc<Vec<u8>>,
}

/// One client's numbers for the results files and simulated time.
struct Arrival {
    processing_time: f64,
    comm_time: f64,
    payload_bytes: u64,
}

/// Seconds to move `bytes` at `mbps` Mbit/s.
fn transfer_seconds(bytes: u64, mbps: f64) -> f64 {
    bytes as f64 * 8.0 / (mbps * 1e6)
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

    let (splits, partitions) = load_data(loaded, options.data_root.as_deref())?;

    let trainer_config = &config.trainer;
    let num_classes = config.parameters.model.num_classes;
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
    let pipelines = loaded.pipelines();
    let limits = loaded.decode_limits();
    let mut child_clients = None;
    let mut transport: Box<dyn Transport> = if config.clients.comm_simulation {
        let runners = (0..trainer_config.max_concurrency)
            .map(|_| ClientRunner::new(loaded, &selected))
            .collect::<Result<Vec<_>, _>>()?;
        Box::new(WorkerPool::start(
            runners,
            Arc::new(splits.train),
            Arc::new(partitions),
            trainer_config.threads_per_worker as usize,
        )?)
    } else {
        let server = &config.server;
        let bind = format!("{}:{}", server.address, server.port);
        let bind = std::net::ToSocketAddrs::to_socket_addrs(&bind)
            .with_context(|| format!("server.address / server.port: cannot resolve `{bind}`"))?
            .next()
            .with_context(|| format!("server.address / server.port: `{bind}` has no address"))?;
        let grpc = GrpcTransport::start(ServerSettings {
            bind,
            config_toml: toml_text(&loaded.merged),
            auth_token: server.auth_token.clone(),
            tls: server.tls_cert.clone().zip(server.tls_key.clone()),
            payload_timeout: std::time::Duration::from_secs_f64(server.payload_timeout),
            registration_timeout: std::time::Duration::from_secs_f64(server.registration_timeout),
            max_payload_bytes: limits.max_bytes,
        })?;
        progress_note(
            options.show_progress,
            &format!("listening for client processes on {}", grpc.local_addr()),
        );
        if let Some(spec) = &options.local_clients {
            child_clients = Some(ChildClients::spawn(
                spec,
                grpc.local_addr(),
                loaded,
                server.tls_cert.is_some(),
            )?);
        }
        let expected = options
            .local_clients
            .as_ref()
            .map_or(trainer_config.max_concurrency as usize, |spec| spec.count)
            .max(1);
        grpc.wait_for_clients(expected)?;
        Box::new(grpc)
    };

    let rounds = options.rounds.unwrap_or(trainer_config.rounds);
    let per_round = config.clients.per_round;
    let progress = progress_bar(
        options.show_progress,
        (rounds + 1).saturating_sub(first_round) as u64 * per_round as u64,
    );
    let model_path = options.run_dir.join(MODEL_FILE);
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
    let dispatch = |round: u32,
                    global_payload: Arc<Vec<u8>>,
                    selector: &mut ClientSelector,
                    transport: &mut dyn Transport|
     -> anyhow::Result<Dispatched> {
        let clients = selector.select(config.clients.total_clients, per_round);
        tracing::info!(round, clients = ?clients, "round dispatched");
        let learning_rate = schedule.rate(loaded.optimizer.learning_rate(), round);
        let tasks = clients
            .iter()
            .enumerate()
            .map(|(slot, &client_id)| TaskSpec {
                slot,
                task: ClientTask { client_id, round },
                learning_rate,
            })
            .collect();
        let payload_bytes = global_payload.len() as u64;
        transport.dispatch(global_payload, tasks)?;
        Ok(Dispatched {
            clients,
            payload_bytes,
        })
    };
    // The model file is plain safetensors whatever the wire pipeline is; with
    // the default pipeline the two are the same bytes, packed once.
    let plain_pipeline = pipelines.server_outbound.steps() == [Processor::SafetensorEncode];
    let pack = |global: &ParamTree| -> anyhow::Result<Packed> {
        let model_bytes = Arc::new(codec::encode(global)?);
        let wire = if plain_pipeline {
            Arc::clone(&model_bytes)
        } else {
            Arc::new(
                pipelines
                    .server_outbound
                    .send(global)
                    .context("server.outbound_processors failed on the global model")?,
            )
        };
        Ok(Packed { model_bytes, wire })
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
    let initial_payload = pack(&global)?.wire;
    let mut dispatched = dispatch(
        first_round,
        initial_payload,
        &mut selector,
        transport.as_mut(),
    )?;
    let mut previous_round_end = Instant::now();

    for round in first_round..=rounds {
        progress.set_message(format!("round {round}/{rounds}"));
        let selected_clients = std::mem::take(&mut dispatched.clients);
        let mut arrived = Vec::with_capacity(selected_clients.len());
        let mut arrivals: Vec<Option<Arrival>> =
            (0..selected_clients.len()).map(|_| None).collect();
        let mut failures: Vec<String> = Vec::new();
        let mut bytes_to_server = 0u64;
        for _ in 0..selected_clients.len() {
            let outcome = transport.next_outcome()?;
            progress.inc(1);
            let client_id = outcome.task.client_id;
            let delivered = match outcome.result {
                Ok(delivered) => delivered,
                Err(reason) => {
                    tracing::warn!(round, client = client_id, "client dropped: {reason}");
                    failures.push(format!("client {client_id}: {reason}"));
                    continue;
                }
            };
            let reply = delivered.reply;
            bytes_to_server += reply.payload.len() as u64;
            let unpacking = Instant::now();
            let received = match pipelines.server_inbound.receive(&reply.payload, &limits) {
                Ok(tree) => tree,
                Err(error) => {
                    tracing::warn!(
                        round,
                        client = client_id,
                        "malformed update, client dropped: {error}"
                    );
                    failures.push(format!("client {client_id}: malformed update: {error}"));
                    continue;
                }
            };
            tracing::debug!(
                client = client_id,
                worker = outcome.worker,
                loss = reply.loss,
                seconds = reply.training_time,
                "client finished"
            );
            arrivals[outcome.slot] = Some(Arrival {
                processing_time: reply.processing_time + unpacking.elapsed().as_secs_f64(),
                comm_time: delivered.comm_time,
                payload_bytes: reply.payload.len() as u64,
            });
            let report = ClientReport {
                client_id,
                num_samples: reply.num_samples,
                loss: reply.loss,
                training_time: reply.training_time,
                worker: outcome.worker,
            };
            arrived.push((outcome.slot, report, received));
        }
        let min_per_round = loaded.min_per_round() as usize;
        if arrived.len() < min_per_round {
            bail!(
                "round {round}: only {} of {} clients returned an update, and \
                 clients.min_per_round = {min_per_round}; the global model stays at round {}. \
                 Dropped: {}",
                arrived.len(),
                selected_clients.len(),
                round - 1,
                failures.join("; ")
            );
        }
        // The round goes on with the clients that arrived, in selection order.
        arrived.sort_by_key(|(slot, _, _)| *slot);
        let present: Vec<u32> = arrived
            .iter()
            .map(|(_, report, _)| report.client_id)
            .collect();
        let arrived: Vec<_> = arrived
            .into_iter()
            .enumerate()
            .map(|(position, (_, report, tree))| (position, report, tree))
            .collect();
        let arrivals: Vec<Arrival> = arrivals.into_iter().flatten().collect();
        let payloads = RoundPayloads::assemble(round, &present, arrived)?
            .apply_hooks(hooks, &global)?
            .into_payloads();
        if config.results.keep_client_updates {
            keep_updates(&options.run_dir, round, &payloads)?;
        }
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
        let downlink_payload = dispatched.payload_bytes;
        // The checkpoint of this round must hold the selector as it was before
        // the next round's draw, so a resumed run draws the same clients.
        let selector_after_round = selector.state(config.server.random_seed);
        let Packed {
            model_bytes,
            wire: wire_payload,
        } = pack(&global)?;
        if round < rounds {
            dispatched = dispatch(round + 1, wire_payload, &mut selector, transport.as_mut())?;
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
        // Simulated wall time: the round's clients as if they ran in parallel,
        // each finishing after its download, processing, training and upload.
        let clients_config = &config.clients;
        let slowest_client = reports
            .iter()
            .zip(&arrivals)
            .map(|(report, arrival)| {
                let comm_time = match (clients_config.downlink_mbps, clients_config.uplink_mbps) {
                    (None, None) => arrival.comm_time,
                    (down, up) => {
                        down.map_or(0.0, |mbps| transfer_seconds(downlink_payload, mbps))
                            + up.map_or(0.0, |mbps| transfer_seconds(arrival.payload_bytes, mbps))
                    }
                };
                report.training_time + arrival.processing_time + comm_time
            })
            .fold(0.0f64, f64::max);
        let elapsed_time = elapsed_before + run_started.elapsed().as_secs_f64();
        let simulated_time = if config.server.simulate_wall_time {
            simulated_before + slowest_client
        } else {
            elapsed_time
        };
        let row = RoundRow {
            round,
            accuracy,
            elapsed_time,
            round_time: previous_round_end.elapsed().as_secs_f64(),
            training_time: reports.iter().map(|r| r.training_time).sum(),
            evaluation_time,
            bytes_to_clients,
            bytes_to_server,
            train_loss,
            simulated_time,
        };
        simulated_before = row.simulated_time;
        previous_round_end = Instant::now();
        let client_rows = reports
            .iter()
            .zip(&arrivals)
            .map(|(r, arrival)| ClientRow {
                round,
                client_id: r.client_id,
                worker: r.worker,
                samples: r.num_samples,
                loss: r.loss,
                training_time: r.training_time,
                processing_time: arrival.processing_time,
                comm_time: arrival.comm_time,
                payload_bytes: arrival.payload_bytes,
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
            transport.cancel();
            break;
        }
    }
    progress.finish_and_clear();
    // The transport goes first: closing the streams lets client processes exit.
    drop(transport);
    drop(child_clients);
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

fn progress_note(show: bool, line: &str) {
    if show {
        eprintln!("{line}");
    }
}

/// `updates/round-NNNN/client-CCCC.safetensors`: what the server aggregated.
fn keep_updates(
    run_dir: &Path,
    round: u32,
    payloads: &[cohort_core::hooks::ReceivedPayload],
) -> anyhow::Result<()> {
    let folder = run_dir.join("updates").join(format!("round-{round:04}"));
    std::fs::create_dir_all(&folder)
        .with_context(|| format!("cannot create {}", folder.display()))?;
    for payload in payloads {
        let path = folder.join(format!(
            "client-{:04}.safetensors",
            payload.report.client_id
        ));
        atomic_write(&path, &codec::encode(payload.tree())?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
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
