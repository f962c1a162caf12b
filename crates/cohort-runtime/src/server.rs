//! The federated round loop.
//!
//! One round, in order, each step a function of [`RoundLoop`]:
//! 1. **select** `per_round` logical clients ([`ClientSelector`]) and
//!    **dispatch** their tasks: the global model, packed once through
//!    `server.outbound_processors`, and per client the strategy's
//!    instructions ([`Strategy::configure`]), to the [`Transport`]: worker
//!    threads of this process, or `cohort client` processes over gRPC;
//! 2. **collect** the updates, unpacked through `server.inbound_processors`; a
//!    client that failed, timed out or sent a malformed payload is logged and
//!    dropped, and the round goes on if `clients.min_per_round` updates arrived;
//! 3. **aggregate**: put the updates back in selection order, run the server
//!    hooks under their positional contract, and let the strategy
//!    ([`Strategy::aggregate`]) make the next global model;
//! 4. **evaluate and record**: test-set accuracy, `results.csv`, `clients.csv`,
//!    the model file;
//! 5. **checkpoint** the model, the selector and the strategy's state; stop at
//!    `rounds` or at `target_accuracy`.
//!
//! The next round is dispatched as soon as the model is aggregated, so it
//! trains while this round is evaluated. Nothing of a round is written before
//! its aggregation succeeded, so a round that fails leaves the global model and
//! every file as the last round left them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use cohort_core::checkpoint::{self, History};
use cohort_core::codec::{self, DecodeLimits};
use cohort_core::config::{LoadedConfig, Pipelines, VectorizedClients};
use cohort_core::data::Dataset;
use cohort_core::fsutil::atomic_write;
use cohort_core::hooks::{ClientReport, NoHooks, ReceivedPayload, RoundPayloads, ServerHooks};
use cohort_core::layout;
use cohort_core::processors::Processor;
use cohort_core::results::{ClientRow, ResultsWriter, RoundRow};
use cohort_core::schedule::LrSchedule;
use cohort_core::selection::{ClientSelector, SelectorState};
use cohort_core::strategy::{ClientUpdate, PrivacySpent, RoundContext, Strategy};
use cohort_core::tree::{ArrayData, DTypeRule, ParamTree, check_schema};
use cohort_train::device::{self, DeviceRequest, Selected};
use cohort_train::init::seeded_parameters;
use cohort_train::trainer::{ClientTask, Evaluator};

use crate::client::{BatchRunner, ClientPartitions, ClientRunner, load_data};
use crate::collective::Collective;
use crate::collective::ring::RingCollective;
use crate::distributed::{DistributedTransport, SharedCollective, share_accuracy};
use crate::grpc::{GrpcTransport, ServerSettings};
use crate::pool::{Runner, WorkerPool};
use crate::progress::{Banner, Progress, ProgressMode};
use crate::transport::{Declared, TaskInstructions, TaskSpec, Transport};

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
    /// This process is one rank of a distributed simulation.
    pub distributed: Option<DistributedRun>,
}

/// One rank of a distributed simulation (`cohort worker`, or `cohort run`
/// under mpirun/srun with a plan): which clients it trains and how it meets
/// the other ranks.
#[derive(Debug, Clone)]
pub struct DistributedRun {
    pub rank: u32,
    pub world_size: u32,
    /// The logical clients this rank trains, every round.
    pub clients: cohort_core::cluster::ClientBlock,
    /// Its workers, as its plan gave them; `None`: `trainer.max_concurrency`.
    pub workers: Option<u32>,
    pub link: RankLink,
}

/// How a rank meets the others.
#[derive(Debug, Clone)]
pub enum RankLink {
    /// The built-in TCP ring, from a plan's host file.
    Ring(Box<crate::collective::ring::RingSettings>),
    /// Open MPI's world communicator (builds with the `mpi` feature).
    Mpi,
}

impl DistributedRun {
    pub fn leader(&self) -> bool {
        self.rank == 0
    }
}

/// The collective of `distributed`: joins the ring, or initializes MPI and
/// checks that it agrees with the launcher's rank and size.
fn connect_collective(distributed: &DistributedRun) -> anyhow::Result<Box<dyn Collective>> {
    match &distributed.link {
        RankLink::Ring(settings) => Ok(Box::new(RingCollective::connect((**settings).clone())?)),
        RankLink::Mpi => mpi_collective(distributed),
    }
}

#[cfg(feature = "mpi")]
fn mpi_collective(distributed: &DistributedRun) -> anyhow::Result<Box<dyn Collective>> {
    let world = crate::collective::mpi::MpiCollective::initialize()?;
    if (world.rank(), world.world_size()) != (distributed.rank, distributed.world_size) {
        bail!(
            "MPI says rank {} of {}, the launcher's environment rank {} of {}",
            world.rank(),
            world.world_size(),
            distributed.rank,
            distributed.world_size
        );
    }
    Ok(Box::new(world))
}

#[cfg(not(feature = "mpi"))]
fn mpi_collective(_: &DistributedRun) -> anyhow::Result<Box<dyn Collective>> {
    bail!(
        "backend `mpi`: this build of cohort has no MPI; rebuild with `--features mpi` \
         (needs libopenmpi-dev and libclang-dev), or place the run with `--backend ring`"
    )
}

/// Folder of the run folder where the client processes a network-mode run
/// starts write their output.
pub const CLIENT_LOGS: &str = "logs";

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
    /// Starts `spec.count` clients of the server at `server`; each writes its
    /// output to `logs/client-N.log` in the run folder, appended on resume,
    /// so the server's terminal shows the server alone.
    fn spawn(
        spec: &LocalClients,
        server: std::net::SocketAddr,
        loaded: &LoadedConfig,
        tls: bool,
        run_dir: &Path,
    ) -> anyhow::Result<Self> {
        let logs = run_dir.join(CLIENT_LOGS);
        std::fs::create_dir_all(&logs)
            .with_context(|| format!("cannot create {}", logs.display()))?;
        let mut children = Vec::new();
        for index in 0..spec.count {
            let path = logs.join(format!("client-{index}.log"));
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .with_context(|| format!("cannot open the client log {}", path.display()))?;
            let mut command = std::process::Command::new(&spec.program);
            command.stdout(log.try_clone()?).stderr(log);
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

/// The newest complete checkpoint of `run_dir`, checked against the config;
/// restores the strategy's state into `strategy`.
fn resume_point(
    loaded: &LoadedConfig,
    run_dir: &Path,
    strategy: &mut dyn Strategy,
) -> anyhow::Result<StartPoint> {
    let restored = checkpoint::latest(run_dir)?;
    for skipped in &restored.skipped {
        tracing::warn!("skipping checkpoint {skipped}");
    }
    let history = restored.history;
    if history.config_hash != loaded.result_hash() {
        bail!(
            "the config differs from the one {} was started with in a key that changes results \
             (config hash {} vs checkpoint {}); resume with the run's own config.toml. A run \
             started by an older cohort, whose hash covered other keys, cannot be resumed by \
             this one",
            run_dir.display(),
            loaded.result_hash(),
            history.config_hash
        );
    }
    let saved_strategy = history
        .algorithm_state
        .as_ref()
        .map_or("fedavg", |state| state.strategy.as_str());
    if saved_strategy != strategy.name() {
        bail!(
            "{} was run with strategy `{saved_strategy}`, but this run uses `{}`; a strategy \
             cannot take over another's state",
            run_dir.display(),
            strategy.name()
        );
    }
    strategy
        .restore(restored.strategy_state)
        .with_context(|| format!("round {}", history.round))?;
    tracing::info!(
        round = history.round,
        "resuming after round {}",
        history.round
    );
    Ok(StartPoint {
        global: layout::from_model_file(restored.model),
        selector: ClientSelector::from_state(history.selector),
        elapsed_before: history.rounds.last().map_or(0.0, |r| r.elapsed_time),
        first_round: history.round + 1,
        results: ResultsWriter::resume(run_dir, history.rounds, history.clients),
    })
}

fn fresh_start(loaded: &LoadedConfig, run_dir: &Path, evaluator: &Evaluator) -> StartPoint {
    let config = &loaded.config;
    StartPoint {
        global: match config.trainer.model_seed {
            Some(seed) => seeded_parameters(&evaluator.parameters(), seed),
            None => evaluator.parameters(),
        },
        selector: ClientSelector::new(config.server.random_seed),
        results: ResultsWriter::new(run_dir),
        first_round: 1,
        elapsed_before: 0.0,
    }
}

/// A round handed to the transport: who trains, and what was sent.
#[derive(Debug, Default)]
struct Dispatched {
    clients: Vec<u32>,
    /// Bytes of the global model each client receives.
    payload_bytes: u64,
    /// Bytes sent beside the model, all clients together (SCAFFOLD).
    extra_bytes: u64,
}

/// The global model of a round, packed once.
struct Packed {
    /// Plain safetensors with BatchNorm counters ([`layout::to_model_file`]):
    /// the model file and the checkpoint.
    model_bytes: Arc<Vec<u8>>,
    /// After `server.outbound_processors`: what the clients receive (the same
    /// allocation when the pipeline is plain `safetensor_encode`).
    wire: Arc<Vec<u8>>,
}

/// One client's numbers for the results files and simulated time.
#[derive(Debug, Clone, PartialEq)]
struct Arrival {
    processing_time: f64,
    comm_time: f64,
    payload_bytes: u64,
    /// Held-out samples the client evaluated the global model on, and how
    /// many it got right (`clients.do_test`).
    test_samples: u64,
    test_correct: u64,
}

/// An update that arrived and unpacked, with its slot in the selection.
#[derive(Debug)]
struct Arrived {
    slot: usize,
    report: ClientReport,
    tree: ParamTree,
    arrival: Arrival,
    /// An own-data client's declaration at registration.
    declared: Option<Declared>,
}

/// A client dropped from its round, and why.
#[derive(Debug, Clone, PartialEq)]
struct Dropped {
    client_id: u32,
    /// The worker that ran the task, when it got that far.
    worker: Option<usize>,
    reason: String,
}

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "client {}: {}", self.client_id, self.reason)
    }
}

/// What came back in a round, in selection order.
#[derive(Debug, Default)]
struct Collected {
    updates: Vec<Arrived>,
    failures: Vec<Dropped>,
    bytes_to_server: u64,
}

/// What a round's aggregation leaves for the records.
struct Aggregated {
    reports: Vec<ClientReport>,
    arrivals: Vec<Arrival>,
    dropped: Vec<Dropped>,
    privacy: Option<PrivacySpent>,
}

fn shared_row(arrived: &Arrived) -> crate::distributed::SharedRow {
    let (report, arrival) = (&arrived.report, &arrived.arrival);
    crate::distributed::SharedRow {
        slot: arrived.slot as u64,
        client_id: report.client_id,
        worker: report.worker as u64,
        num_samples: report.num_samples,
        local_steps: report.local_steps,
        payload_bytes: arrival.payload_bytes,
        test_samples: arrival.test_samples,
        test_correct: arrival.test_correct,
        loss: report.loss,
        training_time: report.training_time,
        processing_time: arrival.processing_time,
        comm_time: arrival.comm_time,
    }
}

fn unshared_row(row: &crate::distributed::SharedRow) -> (ClientReport, Arrival) {
    (
        ClientReport {
            client_id: row.client_id,
            num_samples: row.num_samples,
            loss: row.loss,
            training_time: row.training_time,
            local_steps: row.local_steps,
            worker: row.worker as usize,
        },
        Arrival {
            processing_time: row.processing_time,
            comm_time: row.comm_time,
            payload_bytes: row.payload_bytes,
            test_samples: row.test_samples,
            test_correct: row.test_correct,
        },
    )
}

fn shared_drop(dropped: &Dropped) -> crate::distributed::SharedDrop {
    crate::distributed::SharedDrop {
        client_id: dropped.client_id,
        worker: dropped.worker.unwrap_or_default() as u64,
        reason: dropped.reason.clone(),
    }
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
    run_with_strategy(loaded, options, hooks, loaded.config.algorithm.build())
}

/// [`run_with_hooks`] with a strategy of the caller's instead of the one
/// `[algorithm]` names: the way to run a strategy written outside cohort (see
/// `examples/norm_bounded_fedavg.rs`). Its state is checkpointed and restored
/// like a built-in strategy's.
pub fn run_with_strategy(
    loaded: &LoadedConfig,
    options: &RunOptions,
    hooks: &mut dyn ServerHooks,
    mut strategy: Box<dyn Strategy>,
) -> anyhow::Result<RunSummary> {
    let config = &loaded.config;
    let leader = options
        .distributed
        .as_ref()
        .is_none_or(DistributedRun::leader);
    if leader {
        std::fs::create_dir_all(&options.run_dir).with_context(|| {
            format!("cannot create the run folder {}", options.run_dir.display())
        })?;
    }
    // What runs is what the folder says: a resumed run rewrites config.toml
    // too, since it may have changed keys that do not change results (the
    // number of rounds, ports, paths), and a later --resume must see them. A
    // config with a token is a secret: only its owner may read it.
    if leader {
        let write = if config.server.auth_token.is_some() {
            cohort_core::fsutil::atomic_write_private
        } else {
            atomic_write
        };
        write(
            &options.run_dir.join("config.toml"),
            toml_text(&loaded.merged).as_bytes(),
        )
        .context("cannot write config.toml into the run folder")?;
    }
    let selected = device::select(options.device)?;
    tracing::info!(device = selected.name, "compute device");
    let (splits, partitions) = load_data(loaded, options.data_root.as_deref())?;
    let num_classes = config.parameters.model.num_classes;
    // An own-data client's labels are its own: the server never sees them.
    let own_data = config.clients.own_data_clients as usize;
    let histograms: Vec<Vec<u64>> = partitions
        .train
        .iter()
        .enumerate()
        .map(|(index, part)| match index < own_data {
            true => Vec::new(),
            false => {
                cohort_core::partition::label_histogram(&splits.train.labels, part, num_classes)
            }
        })
        .collect();
    let evaluator = Evaluator::new(
        config.trainer.model_name,
        num_classes,
        &selected.device,
        config.trainer.eval_batch_size,
    );
    tracing::info!(strategy = strategy.name(), "strategy");
    let start = if options.resume && checkpoint::any_written(&options.run_dir) {
        resume_point(loaded, &options.run_dir, strategy.as_mut())?
    } else {
        // Starting over would release the rounds already published again,
        // with fresh noise: together the two releases leak what the noise hid.
        if options.resume
            && strategy.name() == "dp_fedavg"
            && options.run_dir.join(MODEL_FILE).exists()
        {
            bail!(
                "{} released models but wrote no checkpoint; dp_fedavg cannot start it over \
                 without releasing those rounds twice with fresh noise. Start a new run",
                options.run_dir.display()
            );
        }
        if options.resume {
            // Killed before its first checkpoint: nothing of it is kept, so
            // starting over is exactly what an uninterrupted run does.
            tracing::info!("no checkpoint yet: the run starts over from round 1");
        }
        fresh_start(loaded, &options.run_dir, &evaluator)
    };
    if leader && options.show_progress {
        let banner = banner(
            loaded,
            options,
            strategy.name(),
            &selected,
            &splits,
            &partitions,
        );
        let resumed_at = options.resume.then_some(start.first_round);
        for line in (Banner {
            resumed_at,
            ..banner
        })
        .lines()
        {
            eprintln!("{line}");
        }
    }
    let expected = expected_reports(loaded, &partitions);
    let (mut transport, child_clients) =
        start_transport(loaded, options, &selected, splits.train, partitions)?;
    let partial = partial_reduce(loaded, options, strategy.as_ref(), hooks)?;
    let peers = match &options.distributed {
        Some(distributed) => {
            let (distributed_transport, peers) =
                join_ranks(loaded, distributed, transport, partial.is_some())?;
            transport = distributed_transport;
            Some(peers)
        }
        None => None,
    };
    let rounds = options.rounds.unwrap_or(config.trainer.rounds);
    let mut server = RoundLoop::new(
        loaded,
        options,
        hooks,
        strategy,
        transport,
        evaluator,
        splits.test,
        ClientFacts {
            histograms,
            expected,
        },
        start,
        rounds,
    )?;
    server.peers = peers;
    server.leader = leader;
    server.partial = partial;
    let reached_target = server.run()?;
    let RoundLoop {
        results, transport, ..
    } = server;
    // The transport goes first: closing the streams lets client processes exit.
    drop(transport);
    drop(child_clients);
    if leader && results.rounds().is_empty() {
        bail!("no round ran");
    }
    Ok(RunSummary {
        rounds: results.rounds().to_vec(),
        run_dir: options.run_dir.clone(),
        model_path: options.run_dir.join(MODEL_FILE),
        reached_target,
    })
}

/// This rank's client block when the ranks exchange partial sums
/// (`cluster.reduce = partial`); refused for strategies and hooks that need
/// every update.
fn partial_reduce(
    loaded: &LoadedConfig,
    options: &RunOptions,
    strategy: &dyn Strategy,
    hooks: &dyn ServerHooks,
) -> anyhow::Result<Option<cohort_core::cluster::ClientBlock>> {
    let wanted = loaded.config.cluster.reduce == Some(cohort_core::config::Reduce::Partial);
    let Some(distributed) = options.distributed.as_ref().filter(|_| wanted) else {
        return Ok(None);
    };
    if !strategy.aggregates_by_mean() {
        bail!(
            "cluster.reduce = \"partial\" needs a strategy that aggregates by the weighted mean \
             (fedavg, fedprox, fedavgm, fedadam, fedyogi, fedadagrad); `{}` needs every update: use reduce = \"gather\"",
            strategy.name()
        );
    }
    if !hooks.passes_through() {
        bail!(
            "cluster.reduce = \"partial\": server hooks see every payload of a round, which no \
             rank holds; use reduce = \"gather\""
        );
    }
    Ok(Some(distributed.clients))
}

/// Joins the other ranks and wraps this rank's worker pool so that each round
/// trains this rank's clients and gathers everyone's outcomes.
fn join_ranks(
    loaded: &LoadedConfig,
    distributed: &DistributedRun,
    local: Box<dyn Transport>,
    partial: bool,
) -> anyhow::Result<(Box<dyn Transport>, SharedCollective)> {
    if !loaded.config.clients.comm_simulation {
        bail!(
            "a distributed simulation trains each rank's clients on its own workers; set \
             clients.comm_simulation = true (network mode is the grpc backend)"
        );
    }
    let collective: SharedCollective =
        std::rc::Rc::new(std::cell::RefCell::new(connect_collective(distributed)?));
    let transport = DistributedTransport::new(
        local,
        std::rc::Rc::clone(&collective),
        distributed.clients,
        crate::distributed::WORKER_ID_STRIDE,
        loaded.decode_limits().max_bytes as u64,
        partial,
    );
    Ok((Box::new(transport), collective))
}

/// The pool's workers and how many tasks each takes at a time: one client
/// each, or with `trainer.vectorized_clients` K clients as one batch.
fn pool_runners(
    loaded: &LoadedConfig,
    selected: &Selected,
    workers: u32,
    train: &Dataset,
) -> anyhow::Result<(Vec<Runner>, usize)> {
    let trainer = &loaded.config.trainer;
    let chunk = match trainer.vectorized_clients {
        VectorizedClients::Off => {
            let runners = (0..workers)
                .map(|_| Runner::One(ClientRunner::new(loaded, selected)))
                .collect();
            return Ok((runners, 1));
        }
        VectorizedClients::Clients(k) => checked_batch(loaded, selected, train, k as usize)?,
        VectorizedClients::Auto => auto_batch(loaded, selected, workers, train)?,
    };
    tracing::info!(
        clients_per_batch = chunk,
        workers,
        "vectorized clients: each worker trains up to {chunk} clients as one batch"
    );
    let runners = (0..workers)
        .map(|_| BatchRunner::new(loaded, selected).map(Runner::Batch))
        .collect::<anyhow::Result<_>>()
        .context("trainer.vectorized_clients")?;
    Ok((runners, chunk))
}

/// K as the config gives it, or an error where one tensor of the largest
/// batch a worker can get (K, or a round's clients where those are fewer)
/// would not fit the largest buffer the device allocates.
fn checked_batch(
    loaded: &LoadedConfig,
    selected: &Selected,
    train: &Dataset,
    k: usize,
) -> anyhow::Result<usize> {
    let largest = k.min(loaded.config.clients.per_round as usize);
    let fit = clients_per_buffer(loaded, selected, train);
    anyhow::ensure!(
        largest <= fit,
        "trainer.vectorized_clients = {k}: a batch of {largest} clients needs a tensor larger \
         than the largest buffer {} allocates ({} bytes); use at most {fit}, or \"auto\"",
        selected.name,
        selected.max_buffer_bytes.unwrap_or(0),
    );
    Ok(k)
}

/// `"auto"`: K from the memory each worker may use and the largest buffer, or
/// an error where not even one client fits a buffer.
fn auto_batch(
    loaded: &LoadedConfig,
    selected: &Selected,
    workers: u32,
    train: &Dataset,
) -> anyhow::Result<usize> {
    let trainer = &loaded.config.trainer;
    let budget = cohort_train::vectorized::memory_budget(selected.memory_bytes, workers);
    tracing::info!(
        device_memory = selected.memory_bytes,
        max_buffer = selected.max_buffer_bytes,
        budget,
        "vectorized clients: K from the memory each worker may use"
    );
    let k = cohort_train::vectorized::clients_for_memory(
        trainer.model_name,
        loaded.config.parameters.model.num_classes,
        [train.rows, train.cols],
        trainer.batch_size,
        budget,
        selected.max_buffer_bytes,
    );
    anyhow::ensure!(
        k > 0,
        "trainer.vectorized_clients = \"auto\": one client at trainer.batch_size = {} needs a \
         tensor larger than the largest buffer {} allocates ({} bytes); lower the batch size",
        trainer.batch_size,
        selected.name,
        selected.max_buffer_bytes.unwrap_or(0),
    );
    Ok(k)
}

fn clients_per_buffer(loaded: &LoadedConfig, selected: &Selected, train: &Dataset) -> usize {
    cohort_train::vectorized::clients_per_buffer(
        loaded.config.trainer.model_name,
        loaded.config.parameters.model.num_classes,
        [train.rows, train.cols],
        loaded.config.trainer.batch_size,
        selected.max_buffer_bytes,
    )
}

/// The transport `clients.comm_simulation` asks for: worker threads, or a
/// gRPC server (with the local client processes it starts).
fn start_transport(
    loaded: &LoadedConfig,
    options: &RunOptions,
    selected: &Selected,
    train: Dataset,
    partitions: ClientPartitions,
) -> anyhow::Result<(Box<dyn Transport>, Option<ChildClients>)> {
    let config = &loaded.config;
    let trainer = &config.trainer;
    if config.clients.comm_simulation {
        // A rank of a plan runs the workers the plan gave it.
        let workers = options
            .distributed
            .as_ref()
            .and_then(|d| d.workers)
            .unwrap_or(trainer.max_concurrency);
        let (runners, chunk) = pool_runners(loaded, selected, workers, &train)?;
        let pool = WorkerPool::start(
            runners,
            Arc::new(train),
            Arc::new(partitions),
            trainer.threads_per_worker as usize,
            chunk,
        )?;
        return Ok((Box::new(pool), None));
    }
    let server = &config.server;
    if server.auth_token.is_some() && server.tls_cert.is_none() {
        tracing::warn!(
            "server.auth_token is set but TLS is off: the token crosses the network in the \
             clear (set server.tls_cert and server.tls_key)"
        );
    }
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
        max_payload_bytes: loaded.decode_limits().max_bytes,
        max_inflight_bytes: usize::try_from(loaded.max_inflight_bytes()).unwrap_or(usize::MAX),
        // Room for every client process the run waits for, and then some.
        admission: crate::admission::Admission {
            max_connections: 256.max(
                expected_clients(options, config) + config.clients.own_data_clients as usize + 64,
            ),
            ..Default::default()
        },
        own_data: crate::grpc::OwnDataSettings {
            clients: config.clients.own_data_clients,
            max_samples: config.clients.max_samples,
        },
    })?;
    progress_note(
        options.show_progress,
        &format!("listening for client processes on {}", grpc.local_addr()),
    );
    let children = match &options.local_clients {
        Some(spec) => Some(ChildClients::spawn(
            spec,
            grpc.local_addr(),
            loaded,
            server.tls_cert.is_some(),
            &options.run_dir,
        )?),
        None => None,
    };
    let expected = expected_clients(options, config);
    if let Err(error) = grpc.wait_for_clients(expected) {
        // The server goes first: closing its streams lets the children exit.
        drop(grpc);
        drop(children);
        return Err(error);
    }
    Ok((Box::new(grpc), children))
}

/// What the server knows of every client from the partitions it computed.
struct ClientFacts {
    /// Each client's training labels, for `clients.csv`.
    histograms: Vec<Vec<u64>>,
    /// What each client's report must say.
    expected: Vec<ExpectedReport>,
}

/// How many ordinary client processes network mode waits for: those it
/// starts, or `trainer.max_concurrency` started elsewhere; none when every
/// client brings its own data (those are waited for by id).
fn expected_clients(options: &RunOptions, config: &cohort_core::config::Config) -> usize {
    let clients = &config.clients;
    match &options.local_clients {
        Some(spec) => spec.count.max(1),
        None if clients.own_data_clients == clients.total_clients => 0,
        None => (config.trainer.max_concurrency as usize).max(1),
    }
}

/// Wall and simulated time of a run across rounds.
struct Clock {
    run_started: Instant,
    elapsed_before: f64,
    simulated_before: f64,
    previous_round_end: Instant,
}

/// The state of a run between rounds, and the steps of one round.
struct RoundLoop<'a> {
    loaded: &'a LoadedConfig,
    run_dir: PathBuf,
    hooks: &'a mut dyn ServerHooks,
    strategy: Box<dyn Strategy>,
    transport: Box<dyn Transport>,
    evaluator: Evaluator,
    /// Evaluation's own compute threads, so it does not oversubscribe the
    /// workers' cores while the next round trains.
    evaluation_pool: rayon::ThreadPool,
    test: Dataset,
    clients: ClientFacts,
    pipelines: Pipelines,
    limits: DecodeLimits,
    schedule: LrSchedule,
    global: ParamTree,
    selector: ClientSelector,
    results: ResultsWriter,
    first_round: u32,
    rounds: u32,
    clock: Clock,
    progress: Progress,
    /// The other ranks of a distributed simulation.
    peers: Option<SharedCollective>,
    /// Whether this process evaluates and writes the run's files (rank 0).
    leader: bool,
    /// `cluster.reduce = partial`: this rank's client block.
    partial: Option<cohort_core::cluster::ClientBlock>,
}

impl<'a> RoundLoop<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        loaded: &'a LoadedConfig,
        options: &RunOptions,
        hooks: &'a mut dyn ServerHooks,
        strategy: Box<dyn Strategy>,
        transport: Box<dyn Transport>,
        evaluator: Evaluator,
        test: Dataset,
        clients: ClientFacts,
        start: StartPoint,
        rounds: u32,
    ) -> anyhow::Result<Self> {
        let trainer = &loaded.config.trainer;
        let evaluation_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(trainer.threads_per_worker as usize)
            .thread_name(|i| format!("cohort-eval{i}"))
            .build()?;
        let progress = Progress::new(
            ProgressMode::for_stderr(options.show_progress),
            start.first_round,
            rounds,
        );
        let simulated_before = start
            .results
            .rounds()
            .last()
            .map_or(0.0, |r| r.simulated_time);
        Ok(Self {
            loaded,
            run_dir: options.run_dir.clone(),
            hooks,
            strategy,
            transport,
            evaluator,
            evaluation_pool,
            test,
            clients,
            pipelines: loaded.pipelines(),
            limits: loaded.decode_limits(),
            schedule: loaded.lr_schedule(),
            global: start.global,
            selector: start.selector,
            results: start.results,
            first_round: start.first_round,
            rounds,
            clock: Clock {
                run_started: Instant::now(),
                elapsed_before: start.elapsed_before,
                simulated_before,
                previous_round_end: Instant::now(),
            },
            progress,
            peers: None,
            leader: true,
            partial: None,
        })
    }

    /// Runs every remaining round; `true` when the target accuracy was reached.
    fn run(&mut self) -> anyhow::Result<bool> {
        if self.first_round > self.rounds {
            tracing::info!(rounds = self.rounds, "all rounds are done already");
            return Ok(false);
        }
        let initial = self.pack()?.wire;
        let mut dispatched = self.dispatch(self.first_round, initial)?;
        for round in self.first_round..=self.rounds {
            let mut steps = StepTimes::default();
            let started = Instant::now();
            let aggregated = match self.partial {
                Some(block) => {
                    let mine: Vec<u32> = dispatched
                        .clients
                        .iter()
                        .copied()
                        .filter(|&c| block.contains(c))
                        .collect();
                    let collected = self.collect(round, &mine, false)?;
                    steps.collecting = started.elapsed();
                    self.reduce_partials(round, dispatched.clients.len(), collected)?
                }
                None => {
                    let collected = self.collect(round, &dispatched.clients, true)?;
                    steps.collecting = started.elapsed();
                    self.aggregate(round, collected)?
                }
            };
            steps.aggregating = started.elapsed() - steps.collecting;
            // The checkpoint must hold the selector as it was before the next
            // round's draw, so a resumed run draws the same clients.
            let selector_state = self.selector.state(self.loaded.config.server.random_seed);
            let step = Instant::now();
            let packed = self.pack()?;
            steps.packing = step.elapsed();
            let this_round = std::mem::take(&mut dispatched);
            let step = Instant::now();
            if round < self.rounds {
                dispatched = self.dispatch(round + 1, Arc::clone(&packed.wire))?;
            }
            steps.dispatching = step.elapsed();
            let step = Instant::now();
            let accuracy = self.evaluate_and_record(round, &this_round, aggregated, &packed)?;
            steps.recording = step.elapsed();
            let target = self.loaded.config.trainer.target_accuracy;
            let target_reached = target.is_some_and(|target| accuracy >= target);
            let interval = self.loaded.config.server.checkpoint_interval;
            let step = Instant::now();
            if self.leader && (round % interval == 0 || round == self.rounds || target_reached) {
                self.checkpoint(round, &packed.model_bytes, selector_state)?;
            }
            steps.checkpointing = step.elapsed();
            steps.log(round);
            if target_reached {
                tracing::info!(round, accuracy, "target accuracy reached");
                // The next round may already be training; its work is dropped.
                self.transport.cancel();
                self.progress.finish();
                return Ok(true);
            }
        }
        self.progress.finish();
        Ok(false)
    }

    fn context(&self, round: u32) -> RoundContext {
        let clients = &self.loaded.config.clients;
        RoundContext {
            round,
            learning_rate: self
                .schedule
                .rate(self.loaded.optimizer.learning_rate(), round),
            per_round: clients.per_round,
            total_clients: clients.total_clients,
        }
    }

    /// The global model as a model file and as the wire pipeline makes it;
    /// with the default pipeline and no BatchNorm the two are the same bytes,
    /// packed once.
    fn pack(&self) -> anyhow::Result<Packed> {
        let file_tree = layout::to_model_file(&self.global);
        let model_bytes = Arc::new(codec::encode(file_tree.as_ref().unwrap_or(&self.global))?);
        let outbound = &self.pipelines.server_outbound;
        let wire = if outbound.steps() == [Processor::SafetensorEncode] {
            match file_tree {
                // The file's BatchNorm counters are not part of the tree that travels.
                Some(_) => Arc::new(codec::encode(&self.global)?),
                None => Arc::clone(&model_bytes),
            }
        } else {
            Arc::new(
                outbound
                    .send(&self.global)
                    .context("server.outbound_processors failed on the global model")?,
            )
        };
        Ok(Packed { model_bytes, wire })
    }

    /// Selects the round's clients and hands their tasks to the transport.
    fn dispatch(&mut self, round: u32, global_payload: Arc<Vec<u8>>) -> anyhow::Result<Dispatched> {
        let clients_config = &self.loaded.config.clients;
        let clients = self
            .selector
            .select(clients_config.total_clients, clients_config.per_round);
        tracing::info!(round, clients = ?clients, "round dispatched");
        let tasks = plan_tasks(
            self.strategy.as_ref(),
            &self.context(round),
            &clients,
            &self.global,
        )?;
        let extra_bytes = tasks.iter().map(|t| t.instructions.extra_bytes()).sum();
        let payload_bytes = global_payload.len() as u64;
        self.transport.dispatch(global_payload, tasks)?;
        Ok(Dispatched {
            clients,
            payload_bytes,
            extra_bytes,
        })
    }

    /// Waits for every dispatched task; keeps the updates that unpack.
    fn collect(
        &mut self,
        round: u32,
        clients: &[u32],
        whole_round: bool,
    ) -> anyhow::Result<Collected> {
        self.progress.start_round(round, clients.len());
        let mut collected = collect_updates(
            self.transport.as_mut(),
            clients.len(),
            &self.pipelines.server_inbound,
            &self.limits,
            &mut self.progress,
            round,
        )?;
        // One bad client is dropped from its round, never the end of the run.
        let mut kept = Vec::with_capacity(collected.updates.len());
        for arrived in collected.updates {
            let client_id = arrived.report.client_id;
            let verdict = self
                .expected_report(&arrived)
                .and_then(|expected| check_update(&arrived, &expected, &self.global));
            match verdict {
                Ok(()) => kept.push(arrived),
                Err(reason) => {
                    tracing::warn!(
                        round,
                        client = client_id,
                        "update refused, client dropped: {reason}"
                    );
                    collected.failures.push(Dropped {
                        client_id,
                        worker: Some(arrived.report.worker),
                        reason: format!("update refused: {reason}"),
                    });
                }
            }
        }
        collected.updates = kept;
        if whole_round {
            self.require_min(
                round,
                collected.updates.len(),
                clients.len(),
                &collected.failures,
            )?;
        }
        let clients_config = &self.loaded.config.clients;
        for arrived in &mut collected.updates {
            if arrived.slot < clients_config.attackers_per_round as usize {
                let honest = std::mem::replace(&mut arrived.tree, ParamTree::None);
                arrived.tree = cohort_core::attack::apply(
                    clients_config.attack,
                    clients_config.attack_scale,
                    &self.global,
                    honest,
                );
                tracing::info!(round, client = arrived.report.client_id, attack = ?clients_config.attack, "simulated attacker");
            }
        }
        Ok(collected)
    }

    /// What `arrived`'s report must say: the numbers of the partition the
    /// server computed, or for an own-data client what its declaration allows.
    fn expected_report(&self, arrived: &Arrived) -> Result<ExpectedReport, String> {
        let client_id = arrived.report.client_id;
        let config = &self.loaded.config;
        if (1..=config.clients.own_data_clients).contains(&client_id) {
            return own_data_expectation(arrived.report.num_samples, arrived.declared, config);
        }
        (client_id as usize)
            .checked_sub(1)
            .and_then(|index| self.clients.expected.get(index))
            .copied()
            .ok_or_else(|| "no such client".to_owned())
    }

    /// Fewer than `clients.min_per_round` updates stop the run.
    fn require_min(
        &self,
        round: u32,
        updates: usize,
        selected: usize,
        failures: &[Dropped],
    ) -> anyhow::Result<()> {
        let min_per_round = self.loaded.min_per_round() as usize;
        if updates < min_per_round {
            bail!(
                "round {round}: only {updates} of {selected} clients returned an update, and \
                 clients.min_per_round = {min_per_round}; the global model stays at round {}. \
                 Dropped: {}",
                round - 1,
                failures
                    .iter()
                    .map(Dropped::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
        Ok(())
    }

    /// `cluster.reduce = partial`: this rank's checked updates become one
    /// partial sum; the ranks swap partials and rows, and every rank adds the
    /// partials in rank order into the round's mean and the strategy's step.
    fn reduce_partials(
        &mut self,
        round: u32,
        selected: usize,
        mut collected: Collected,
    ) -> anyhow::Result<Aggregated> {
        use cohort_core::strategy::partial::{PartialSum, combine, partial_layout};
        let dropped = std::mem::take(&mut collected.failures);
        let updates: Vec<ClientUpdate<'_>> = collected
            .updates
            .iter()
            .map(|a| ClientUpdate {
                client_id: a.report.client_id,
                num_samples: a.report.num_samples,
                local_steps: a.report.local_steps,
                tree: &a.tree,
            })
            .collect();
        let partial = PartialSum::of(&self.global, &updates)
            .with_context(|| format!("round {round}: this rank's updates"))?;
        let share = crate::distributed::RankShare {
            rows: collected.updates.iter().map(shared_row).collect(),
            dropped: dropped.iter().map(shared_drop).collect(),
            partial: partial.encode(),
        };
        let elements = partial_layout(&self.global)?.len();
        let partial_bytes = 16 + 8 * elements;
        let peers = self
            .peers
            .as_ref()
            .context("partial reduce without peers")?;
        let blocks = peers.borrow_mut().all_gather(
            share.encode(),
            crate::distributed::RankShare::max_bytes(selected, partial_bytes),
        )?;
        let mut rows = Vec::new();
        let mut all_dropped = Vec::new();
        let mut partials = Vec::with_capacity(blocks.len());
        for (rank, block) in blocks.iter().enumerate() {
            let share = crate::distributed::RankShare::decode(block, selected, partial_bytes)
                .and_then(|s| Ok((PartialSum::decode(&s.partial, elements)?, s)))
                .map_err(|e| anyhow::anyhow!("round {round}: rank {rank}'s share: {e}"))?;
            partials.push(share.0);
            rows.extend(share.1.rows);
            all_dropped.extend(share.1.dropped.into_iter().map(|d| Dropped {
                client_id: d.client_id,
                worker: Some(d.worker as usize),
                reason: d.reason,
            }));
        }
        rows.sort_by_key(|r| r.slot);
        self.require_min(round, rows.len(), selected, &all_dropped)?;
        let mean = combine(&self.global, &partials)?;
        let outcome = self
            .strategy
            .aggregate_mean(&self.context(round), &self.global, mean)
            .with_context(|| format!("round {round}: aggregation refused"))?;
        match outcome.model {
            Some(model) => self.global = model,
            None => tracing::warn!(round, "total sample weight is zero; global model unchanged"),
        }
        let (reports, arrivals) = rows.iter().map(unshared_row).unzip();
        Ok(Aggregated {
            reports,
            arrivals,
            dropped: all_dropped,
            privacy: outcome.privacy,
        })
    }

    /// Server hooks under their contract, then the strategy's aggregation.
    fn aggregate(&mut self, round: u32, mut collected: Collected) -> anyhow::Result<Aggregated> {
        let dropped = std::mem::take(&mut collected.failures);
        let (payloads, arrivals) =
            hooked_payloads(round, collected, &mut *self.hooks, &self.global)?;
        if self.leader && self.loaded.config.results.keep_client_updates {
            keep_updates(&self.run_dir, round, &payloads)?;
        }
        let updates: Vec<ClientUpdate<'_>> = payloads
            .iter()
            .map(|payload| ClientUpdate {
                client_id: payload.report.client_id,
                num_samples: payload.report.num_samples,
                local_steps: payload.report.local_steps,
                tree: payload.tree(),
            })
            .collect();
        let outcome = self
            .strategy
            .aggregate(&self.context(round), &self.global, &updates)
            .with_context(|| format!("round {round}: aggregation refused"))?;
        match outcome.model {
            Some(model) => self.global = model,
            None => tracing::warn!(round, "total sample weight is zero; global model unchanged"),
        }
        if let Some(selected) = &outcome.selected {
            tracing::info!(round, clients = ?selected, "updates the strategy used");
        }
        Ok(Aggregated {
            reports: payloads.into_iter().map(|p| p.into_parts().0).collect(),
            arrivals,
            dropped,
            privacy: outcome.privacy,
        })
    }

    /// Test-set accuracy of the new model, the results rows and the model file.
    fn evaluate_and_record(
        &mut self,
        round: u32,
        dispatched: &Dispatched,
        aggregated: Aggregated,
        packed: &Packed,
    ) -> anyhow::Result<f64> {
        if !self.leader {
            let peers = self
                .peers
                .as_ref()
                .context("a follower rank without peers")?;
            let accuracy = share_accuracy(peers, None)?;
            self.clock.previous_round_end = Instant::now();
            tracing::info!(round, accuracy, "round finished (evaluated by rank 0)");
            return Ok(accuracy);
        }
        let evaluation_started = Instant::now();
        let (evaluator, global, test) = (&mut self.evaluator, &self.global, &self.test);
        let accuracy = self
            .evaluation_pool
            .install(|| evaluator.accuracy(global, test))?;
        let evaluation_time = evaluation_started.elapsed().as_secs_f64();
        let model_path = self.run_dir.join(MODEL_FILE);
        atomic_write(&model_path, &packed.model_bytes)
            .with_context(|| format!("cannot write {}", model_path.display()))?;
        let Aggregated {
            reports,
            arrivals,
            dropped,
            privacy,
        } = aggregated;
        let config = &self.loaded.config;
        let per_client_download = dispatched.payload_bytes
            + dispatched.extra_bytes / dispatched.clients.len().max(1) as u64;
        let slowest = slowest_client(&reports, &arrivals, per_client_download, config);
        let clock = &mut self.clock;
        let elapsed_time = clock.elapsed_before + clock.run_started.elapsed().as_secs_f64();
        let row = RoundRow {
            round,
            accuracy,
            elapsed_time,
            round_time: clock.previous_round_end.elapsed().as_secs_f64(),
            training_time: reports.iter().map(|r| r.training_time).sum(),
            evaluation_time,
            bytes_to_clients: dispatched.payload_bytes * dispatched.clients.len() as u64
                + dispatched.extra_bytes,
            bytes_to_server: arrivals.iter().map(|a| a.payload_bytes).sum(),
            train_loss: weighted_loss(&reports),
            simulated_time: if config.server.simulate_wall_time {
                clock.simulated_before + slowest
            } else {
                elapsed_time
            },
            extra_bytes_to_clients: dispatched.extra_bytes,
            federated_accuracy: federated_accuracy(&arrivals),
            epsilon: privacy.map(|p| p.epsilon),
        };
        clock.simulated_before = row.simulated_time;
        clock.previous_round_end = Instant::now();
        let mut client_rows = self.client_rows(round, &reports, &arrivals);
        client_rows.extend(dropped.into_iter().map(|d| ClientRow {
            worker: d.worker.unwrap_or_default(),
            label_histogram: self.histogram(d.client_id),
            dropped: Some(d.reason),
            ..ClientRow::empty(round, d.client_id)
        }));
        tracing::info!(
            round,
            accuracy,
            round_time = row.round_time,
            "round finished"
        );
        self.progress.round_line(&format!(
            "round {round:>3}: accuracy {accuracy:.4}, loss {:.4}, {:.2}s{}",
            row.train_loss,
            row.round_time,
            privacy.map_or(String::new(), |p| format!(
                ", ε = {:.3} (δ = {})",
                p.epsilon, p.delta
            )),
        ));
        self.results
            .record(row, client_rows)
            .context("cannot write results.csv")?;
        if let Some(peers) = &self.peers {
            share_accuracy(peers, Some(accuracy))?;
        }
        Ok(accuracy)
    }

    fn client_rows(
        &self,
        round: u32,
        reports: &[ClientReport],
        arrivals: &[Arrival],
    ) -> Vec<ClientRow> {
        reports
            .iter()
            .zip(arrivals)
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
                label_histogram: self.histogram(r.client_id),
                test_accuracy: (arrival.test_samples > 0)
                    .then(|| arrival.test_correct as f64 / arrival.test_samples as f64),
                dropped: None,
            })
            .collect()
    }

    fn histogram(&self, client_id: u32) -> Vec<u64> {
        (client_id as usize)
            .checked_sub(1)
            .and_then(|index| self.clients.histograms.get(index))
            .cloned()
            .unwrap_or_default()
    }

    fn checkpoint(
        &self,
        round: u32,
        model_bytes: &[u8],
        selector: SelectorState,
    ) -> anyhow::Result<()> {
        let state = self.strategy.state();
        checkpoint::write(
            &self.run_dir,
            model_bytes,
            History {
                format: checkpoint::FORMAT_VERSION,
                round,
                config_hash: self.loaded.result_hash(),
                selector,
                algorithm_state: None,
                rounds: self.results.rounds().to_vec(),
                clients: self.results.clients().to_vec(),
                model_file: String::new(),
                model_sha256: String::new(),
            },
            (self.strategy.name(), &state),
        )?;
        Ok(())
    }
}

/// Where the round loop's thread spent one round, in run.log (`round steps`),
/// so a run shows how much of it was anything but waiting for training:
/// `bench/scale.sh` reads it. Collecting is mostly waiting for the clients;
/// it also unpacks and checks their updates (their share is in each client's
/// `processing_time`). Recording holds the test-set evaluation, which
/// overlaps the next round's training.
#[derive(Debug, Default)]
struct StepTimes {
    collecting: Duration,
    aggregating: Duration,
    packing: Duration,
    dispatching: Duration,
    recording: Duration,
    checkpointing: Duration,
}

impl StepTimes {
    fn log(&self, round: u32) {
        tracing::info!(
            round,
            collecting = self.collecting.as_secs_f64(),
            aggregating = self.aggregating.as_secs_f64(),
            packing = self.packing.as_secs_f64(),
            dispatching = self.dispatching.as_secs_f64(),
            recording = self.recording.as_secs_f64(),
            checkpointing = self.checkpointing.as_secs_f64(),
            "round steps"
        );
    }
}

/// Each selected client's task: the strategy's instructions, encoded.
fn plan_tasks(
    strategy: &dyn Strategy,
    ctx: &RoundContext,
    clients: &[u32],
    global: &ParamTree,
) -> anyhow::Result<Vec<TaskSpec>> {
    clients
        .iter()
        .enumerate()
        .map(|(slot, &client_id)| {
            let instructions = strategy
                .configure(ctx, client_id, global)
                .with_context(|| format!("round {}: client {client_id}", ctx.round))?;
            Ok(TaskSpec {
                slot,
                task: ClientTask {
                    client_id,
                    round: ctx.round,
                },
                instructions: TaskInstructions::encode(instructions)?,
            })
        })
        .collect()
}

/// One outcome per dispatched task, in any order; the updates that unpack,
/// put back in selection (slot) order.
fn collect_updates(
    transport: &mut dyn Transport,
    tasks: usize,
    inbound: &cohort_core::processors::Pipeline,
    limits: &DecodeLimits,
    progress: &mut Progress,
    round: u32,
) -> anyhow::Result<Collected> {
    let mut collected = Collected::default();
    let mut arrived = Vec::with_capacity(tasks);
    for _ in 0..tasks {
        let outcome = transport.next_outcome()?;
        progress.client_done();
        let client_id = outcome.task.client_id;
        let delivered = match outcome.result {
            Ok(delivered) => delivered,
            Err(reason) => {
                tracing::warn!(round, client = client_id, "client dropped: {reason}");
                collected.failures.push(Dropped {
                    client_id,
                    worker: Some(outcome.worker),
                    reason,
                });
                continue;
            }
        };
        let reply = delivered.reply;
        collected.bytes_to_server += reply.payload.len() as u64;
        let unpacking = Instant::now();
        let tree = match inbound.receive(&reply.payload, limits) {
            Ok(tree) => tree,
            Err(error) => {
                tracing::warn!(
                    round,
                    client = client_id,
                    "malformed update, client dropped: {error}"
                );
                collected.failures.push(Dropped {
                    client_id,
                    worker: Some(outcome.worker),
                    reason: format!("malformed update: {error}"),
                });
                continue;
            }
        };
        tracing::debug!(
            client = client_id,
            worker = outcome.worker,
            loss = reply.loss,
            "client finished"
        );
        let arrival = Arrival {
            processing_time: reply.processing_time + unpacking.elapsed().as_secs_f64(),
            comm_time: delivered.comm_time,
            payload_bytes: reply.payload.len() as u64,
            test_samples: reply.test_samples,
            test_correct: reply.test_correct,
        };
        let report = ClientReport {
            client_id,
            num_samples: reply.num_samples,
            loss: reply.loss,
            training_time: reply.training_time,
            local_steps: reply.local_steps,
            worker: outcome.worker,
        };
        arrived.push(Arrived {
            slot: outcome.slot,
            report,
            tree,
            arrival,
            declared: delivered.declared,
        });
    }
    arrived.sort_by_key(|a| a.slot);
    collected.updates = arrived;
    Ok(collected)
}

/// The round's payloads after the server hooks, with the positional contract
/// checked, and their arrivals in the same order.
fn hooked_payloads(
    round: u32,
    collected: Collected,
    hooks: &mut dyn ServerHooks,
    global: &ParamTree,
) -> anyhow::Result<(Vec<ReceivedPayload>, Vec<Arrival>)> {
    let present: Vec<u32> = collected
        .updates
        .iter()
        .map(|a| a.report.client_id)
        .collect();
    let mut arrivals = Vec::with_capacity(present.len());
    let arrived = collected
        .updates
        .into_iter()
        .enumerate()
        .map(|(position, a)| {
            arrivals.push(a.arrival);
            (position, a.report, a.tree)
        })
        .collect();
    let payloads = RoundPayloads::assemble(round, &present, arrived)?
        .apply_hooks(hooks, global)?
        .into_payloads();
    Ok((payloads, arrivals))
}

/// What a client's report must say: the server computed the partitions, so
/// it knows every client's sample counts and how many local steps they make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ExpectedReport {
    train_samples: u64,
    local_steps: u64,
    test_samples: u64,
}

fn expected_reports(loaded: &LoadedConfig, partitions: &ClientPartitions) -> Vec<ExpectedReport> {
    let trainer = &loaded.config.trainer;
    partitions
        .train
        .iter()
        .zip(&partitions.test)
        .map(|(train, test)| ExpectedReport {
            train_samples: train.len() as u64,
            local_steps: trainer.epochs as u64 * train.len().div_ceil(trainer.batch_size) as u64,
            test_samples: test.len() as u64,
        })
        .collect()
}

/// What an own-data client's report must say. Its sample count is its own
/// word, so it is bounded, never trusted: at least 1, at most what it declared
/// at registration and `clients.max_samples`. Its local steps follow from the
/// count (`epochs · ⌈n / batch_size⌉`, which SCAFFOLD relies on), and its
/// held-out samples are all it declared when the run evaluates on clients.
fn own_data_expectation(
    num_samples: u64,
    declared: Option<Declared>,
    config: &cohort_core::config::Config,
) -> Result<ExpectedReport, String> {
    let declared = declared.ok_or_else(|| {
        "is an own-data client, but its update did not come from an own-data registration"
            .to_owned()
    })?;
    let max_samples = config.clients.max_samples;
    if num_samples == 0 || num_samples > declared.train_samples.min(max_samples) {
        return Err(format!(
            "reports {num_samples} training samples; it declared {} at registration, and \
             clients.max_samples = {max_samples}",
            declared.train_samples
        ));
    }
    let trainer = &config.trainer;
    let batches = num_samples.div_ceil(trainer.batch_size.max(1) as u64);
    let local_steps = u64::from(trainer.epochs)
        .checked_mul(batches)
        .ok_or_else(|| format!("{num_samples} training samples overflow the local step count"))?;
    Ok(ExpectedReport {
        train_samples: num_samples,
        local_steps,
        test_samples: if config.clients.do_test {
            declared.test_samples
        } else {
            0
        },
    })
}

/// Why an update that unpacked cannot join the round: a layout other than
/// the global model's, a value that is not finite, or numbers in its report
/// other than the server knows them to be.
fn check_update(
    arrived: &Arrived,
    expected: &ExpectedReport,
    global: &ParamTree,
) -> Result<(), String> {
    check_schema(global, &arrived.tree, DTypeRule::AnyFloat)
        .map_err(|mismatch| format!("the update does not match the global model: {mismatch}"))?;
    let mut non_finite = None;
    arrived.tree.for_each_leaf(&mut |path, array| {
        if non_finite.is_some() {
            return;
        }
        let bad = match array.data() {
            ArrayData::F32(values) => values.iter().position(|x| !x.is_finite()),
            ArrayData::F16(values) => values.iter().position(|x| !x.is_finite()),
            _ => None,
        };
        if let Some(index) = bad {
            non_finite = Some(format!("`{path}`[{index}] is not finite"));
        }
    });
    if let Some(problem) = non_finite {
        return Err(format!("the update is poisoned: {problem}"));
    }
    let report = &arrived.report;
    let arrival = &arrived.arrival;
    let claims = [
        (
            "training samples",
            report.num_samples,
            expected.train_samples,
        ),
        ("local steps", report.local_steps, expected.local_steps),
        (
            "held-out samples",
            arrival.test_samples,
            expected.test_samples,
        ),
    ];
    for (what, claimed, known) in claims {
        if claimed != known {
            return Err(format!(
                "reports {claimed} {what}, but the server expects {known}"
            ));
        }
    }
    for (what, value) in [
        ("loss", report.loss),
        ("training time", report.training_time),
        ("processing time", arrival.processing_time),
    ] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("reports a {what} of {value}"));
        }
    }
    if arrival.test_correct > arrival.test_samples {
        return Err(format!(
            "reports {} of {} held-out samples correct",
            arrival.test_correct, arrival.test_samples
        ));
    }
    Ok(())
}

/// Accuracy of the global model the round's clients received, over all their
/// held-out samples together; `None` when no client evaluated.
fn federated_accuracy(arrivals: &[Arrival]) -> Option<f64> {
    let samples: u64 = arrivals.iter().map(|a| a.test_samples).sum();
    let correct: u64 = arrivals.iter().map(|a| a.test_correct).sum();
    (samples > 0).then(|| correct as f64 / samples as f64)
}

/// Mean training loss of the round's clients, weighted by samples.
fn weighted_loss(reports: &[ClientReport]) -> f64 {
    let total: u64 = reports.iter().map(|r| r.num_samples).sum();
    reports
        .iter()
        .map(|r| r.loss * r.num_samples as f64)
        .sum::<f64>()
        / total.max(1) as f64
}

/// Simulated wall time of a round: its clients as if they ran in parallel,
/// each finishing after its download, processing, training and upload.
fn slowest_client(
    reports: &[ClientReport],
    arrivals: &[Arrival],
    downlink_payload: u64,
    config: &cohort_core::config::Config,
) -> f64 {
    let clients = &config.clients;
    reports
        .iter()
        .zip(arrivals)
        .map(|(report, arrival)| {
            let comm_time = match (clients.downlink_mbps, clients.uplink_mbps) {
                (None, None) => arrival.comm_time,
                (down, up) => {
                    down.map_or(0.0, |mbps| transfer_seconds(downlink_payload, mbps))
                        + up.map_or(0.0, |mbps| transfer_seconds(arrival.payload_bytes, mbps))
                }
            };
            report.training_time + arrival.processing_time + comm_time
        })
        .fold(0.0f64, f64::max)
}

/// The banner's facts: where the run reads and writes, what it computes, on
/// what, and how its clients run.
fn banner<'a>(
    loaded: &'a LoadedConfig,
    options: &'a RunOptions,
    strategy: &'a str,
    selected: &Selected,
    splits: &cohort_core::data::Splits,
    partitions: &ClientPartitions,
) -> Banner<'a> {
    let config = &loaded.config;
    let trainer = &config.trainer;
    let sizes = partitions.train.iter().map(Vec::len);
    let (smallest, largest) = (sizes.clone().min().unwrap_or(0), sizes.max().unwrap_or(0));
    let data_root = options.data_root.as_ref().unwrap_or(&config.data.data_path);
    // The names as the config spells them.
    let name_of = |value: toml::Value| value.as_str().map(str::to_owned).unwrap_or_default();
    let sampler =
        toml::Value::try_from(config.data.sampler).map_or_else(|_| String::new(), name_of);
    let source =
        toml::Value::try_from(config.data.datasource).map_or_else(|_| String::new(), name_of);
    let folder = data_root.join(config.data.datasource.folder());
    let data = if config.clients.all_own_data() {
        format!(
            "{source}: {} test samples from {}; every client trains on its own data",
            splits.test.len(),
            folder.display()
        )
    } else {
        format!(
            "{source}: {} training and {} test samples from {}; {sampler} partitions of {}",
            splits.train.len(),
            splits.test.len(),
            folder.display(),
            if smallest == largest {
                format!("{smallest} samples")
            } else {
                format!("{smallest} to {largest} samples")
            }
        )
    };
    let workers = options
        .distributed
        .as_ref()
        .and_then(|d| d.workers)
        .unwrap_or(trainer.max_concurrency);
    let plural =
        |count: u32, noun: &str| format!("{count} {noun}{}", if count == 1 { "" } else { "s" });
    let device = format!(
        "{}, {} × {} each",
        selected.name,
        plural(workers, "worker"),
        plural(trainer.threads_per_worker, "thread")
    );
    let execution = match (&options.distributed, config.clients.comm_simulation) {
        (Some(distributed), _) => format!(
            "{} ranks over {}{}",
            distributed.world_size,
            match distributed.link {
                RankLink::Ring(_) => "the TCP ring",
                RankLink::Mpi => "MPI",
            },
            if config.cluster.reduce == Some(cohort_core::config::Reduce::Partial) {
                ", partial sums"
            } else {
                ", updates gathered to rank 0"
            }
        ),
        (None, true) => "one process (clients simulated in the worker pool)".to_owned(),
        (None, false) => format!(
            "gRPC on {}:{}, {} local client processes{}",
            config.server.address,
            config.server.port,
            options.local_clients.as_ref().map_or(0, |c| c.count),
            if options.local_clients.is_some() {
                format!(
                    " (output in {})",
                    options.run_dir.join(CLIENT_LOGS).display()
                )
            } else {
                String::new()
            }
        ),
    };
    Banner {
        config: &loaded.path,
        run_dir: &options.run_dir,
        resumed_at: None,
        strategy,
        rounds: trainer.rounds,
        per_round: config.clients.per_round,
        total_clients: config.clients.total_clients,
        data,
        device,
        execution,
    }
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
        let tree = payload.tree();
        let file = layout::to_model_file(tree);
        atomic_write(&path, &codec::encode(file.as_ref().unwrap_or(tree))?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn toml_text(table: &toml::Table) -> String {
    toml::to_string_pretty(table).unwrap_or_else(|_| table.to_string())
}

/// Creates a fresh run folder under `base`, `<stem>-<unix seconds>` (or
/// `name`), with a counter when that exists already. Creating is the claim:
/// two runs started in the same second get two folders.
pub fn new_run_dir(
    base: &Path,
    config_path: &Path,
    name: Option<&str>,
) -> std::io::Result<PathBuf> {
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
    std::fs::create_dir_all(base)?;
    let mut candidate = base.join(&stem);
    let mut counter = 2;
    loop {
        match std::fs::create_dir(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
                candidate = base.join(format!("{stem}-{counter}"));
                counter += 1;
            }
            Err(error) => return Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use cohort_core::processors::Pipeline;
    use cohort_core::strategy::{AlgorithmConfig, fedprox::FedProxConfig};
    use cohort_core::tree::Array;

    use super::*;
    use crate::client::ClientReply;
    use crate::transport::{ClientOutcome, Delivered};

    #[test]
    fn a_batch_too_large_for_the_devices_buffers_is_an_error_naming_the_key() {
        let loaded = cohort_core::config::from_str(
            &std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../../configs/fashion_mnist/vectorized_100.toml"),
            )
            .unwrap(),
            Path::new("vectorized_100.toml"),
        )
        .unwrap();
        let images = Dataset {
            images: Vec::new(),
            labels: Vec::new(),
            rows: 28,
            cols: 28,
        };
        // One LeNet-5 client at batch 32: 3,763,200 bytes in its largest tensor.
        let gpu = |max_buffer_bytes| Selected {
            device: cohort_train::device::cpu(),
            name: "gpu (test)",
            memory_bytes: Some(1 << 40),
            max_buffer_bytes,
        };
        let ten = gpu(Some(10 * 3_763_200));
        assert_eq!(checked_batch(&loaded, &ten, &images, 10).unwrap(), 10);
        let error = checked_batch(&loaded, &ten, &images, 11)
            .unwrap_err()
            .to_string();
        assert!(error.contains("trainer.vectorized_clients = 11"), "{error}");
        assert!(error.contains("at most 10"), "{error}");
        assert_eq!(
            checked_batch(&loaded, &gpu(None), &images, 100_000).unwrap(),
            100_000
        );
        // A K beyond the round's 100 clients trains batches of 100 at most.
        let hundred = gpu(Some(100 * 3_763_200));
        assert_eq!(
            checked_batch(&loaded, &hundred, &images, 1_000).unwrap(),
            1_000
        );
        let error = checked_batch(&loaded, &ten, &images, 1_000)
            .unwrap_err()
            .to_string();
        assert!(error.contains("a batch of 100 clients"), "{error}");
        // "auto" stays within both the memory and the buffer, and says so
        // where not even one client fits.
        assert_eq!(auto_batch(&loaded, &ten, 1, &images).unwrap(), 10);
        let error = auto_batch(&loaded, &gpu(Some(3_763_200 - 256)), 1, &images).unwrap_err();
        assert!(
            error.to_string().contains("lower the batch size"),
            "{error}"
        );
    }

    fn tree(values: &[f32]) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![values.len()], values.to_vec()).unwrap(),
        )])
    }

    fn ctx(round: u32) -> RoundContext {
        RoundContext {
            round,
            learning_rate: 0.1,
            per_round: 3,
            total_clients: 10,
        }
    }

    /// Hands out canned outcomes in the order given.
    #[derive(Default)]
    struct ScriptedTransport {
        dispatched: Vec<TaskSpec>,
        outcomes: VecDeque<ClientOutcome>,
    }

    impl Transport for ScriptedTransport {
        fn dispatch(&mut self, _payload: Arc<Vec<u8>>, tasks: Vec<TaskSpec>) -> anyhow::Result<()> {
            self.dispatched.extend(tasks);
            Ok(())
        }

        fn next_outcome(&mut self) -> anyhow::Result<ClientOutcome> {
            self.outcomes
                .pop_front()
                .ok_or_else(|| anyhow::anyhow!("no outcome left"))
        }

        fn cancel(&mut self) {}
    }

    fn outcome(slot: usize, client_id: u32, payload: Result<Vec<u8>, &str>) -> ClientOutcome {
        ClientOutcome {
            slot,
            task: ClientTask {
                client_id,
                round: 1,
            },
            worker: 0,
            result: payload
                .map(|payload| Delivered {
                    reply: ClientReply {
                        num_samples: 10 * client_id as u64,
                        loss: 0.5,
                        training_time: client_id as f64,
                        processing_time: 0.0,
                        local_steps: 3,
                        test_samples: 4,
                        test_correct: 3,
                        payload,
                    },
                    comm_time: 0.0,
                    declared: None,
                })
                .map_err(str::to_owned),
        }
    }

    fn collect(outcomes: Vec<ClientOutcome>) -> Collected {
        let tasks = outcomes.len();
        let mut transport = ScriptedTransport {
            outcomes: outcomes.into(),
            ..Default::default()
        };
        let inbound = Pipeline::receiver(
            "server.inbound_processors",
            &["safetensor_decode".to_owned()],
        )
        .unwrap();
        collect_updates(
            &mut transport,
            tasks,
            &inbound,
            &DecodeLimits::default(),
            &mut Progress::new(ProgressMode::Hidden, 1, 1),
            1,
        )
        .unwrap()
    }

    #[test]
    fn plan_tasks_carries_each_clients_instructions_in_selection_order() {
        let fedprox = AlgorithmConfig::Fedprox(FedProxConfig { mu: 0.25 }).build();
        let tasks = plan_tasks(fedprox.as_ref(), &ctx(4), &[7, 2, 9], &tree(&[0.0])).unwrap();
        let clients: Vec<(usize, u32, u32)> = tasks
            .iter()
            .map(|t| (t.slot, t.task.client_id, t.task.round))
            .collect();
        assert_eq!(clients, [(0, 7, 4), (1, 2, 4), (2, 9, 4)]);
        assert!(tasks.iter().all(|t| t.instructions.proximal_mu == 0.25
            && t.instructions.learning_rate == 0.1
            && t.instructions.correction.is_none()));

        // SCAFFOLD's correction travels as plain safetensors of the model's layout.
        let scaffold = AlgorithmConfig::Scaffold(Default::default()).build();
        let tasks = plan_tasks(scaffold.as_ref(), &ctx(1), &[1], &tree(&[5.0, 6.0])).unwrap();
        let bytes = tasks[0].instructions.correction.as_ref().unwrap();
        assert_eq!(tasks[0].instructions.extra_bytes(), bytes.len() as u64);
        let correction = codec::decode(bytes, &DecodeLimits::default()).unwrap();
        assert_eq!(correction, tree(&[0.0, 0.0]));
    }

    #[test]
    fn collect_orders_updates_by_slot_and_drops_failed_and_malformed_clients() {
        let good = |v: f32| Ok(codec::encode(&tree(&[v])).unwrap());
        let collected = collect(vec![
            outcome(3, 4, good(4.0)),
            outcome(0, 1, Err("timed out")),
            outcome(2, 3, Ok(b"not safetensors".to_vec())),
            outcome(1, 2, good(2.0)),
        ]);
        let order: Vec<(usize, u32)> = collected
            .updates
            .iter()
            .map(|a| (a.slot, a.report.client_id))
            .collect();
        assert_eq!(order, [(1, 2), (3, 4)]);
        assert_eq!(collected.updates[0].tree, tree(&[2.0]));
        assert_eq!(collected.updates[0].report.local_steps, 3);
        assert_eq!(collected.failures.len(), 2, "{:?}", collected.failures);
        assert_eq!(collected.failures[0].to_string(), "client 1: timed out");
        assert!(
            collected.failures[1]
                .to_string()
                .starts_with("client 3: malformed update")
        );
        // Bytes that arrived count, also when they did not unpack.
        let expected = 2 * codec::encode(&tree(&[0.0])).unwrap().len() as u64 + 15;
        assert_eq!(collected.bytes_to_server, expected);
    }

    #[test]
    fn hooked_payloads_keep_reports_and_arrivals_aligned() {
        let good = |v: f32| Ok(codec::encode(&tree(&[v])).unwrap());
        let collected = collect(vec![outcome(1, 8, good(8.0)), outcome(0, 5, good(5.0))]);
        let (payloads, arrivals) =
            hooked_payloads(1, collected, &mut NoHooks, &tree(&[0.0])).unwrap();
        let ids: Vec<u32> = payloads.iter().map(|p| p.report.client_id).collect();
        assert_eq!(ids, [5, 8]);
        assert_eq!(payloads[1].tree(), &tree(&[8.0]));
        assert_eq!(arrivals.len(), 2);
    }

    #[test]
    fn updates_are_checked_against_what_the_server_knows() {
        let expected = ExpectedReport {
            train_samples: 30,
            local_steps: 3,
            test_samples: 4,
        };
        let arrived = |tree: ParamTree, local_steps: u64| Arrived {
            slot: 0,
            report: ClientReport {
                local_steps,
                ..report(1, 30, 0.5, 1.0)
            },
            tree,
            arrival: arrival(10, (4, 3)),
            declared: None,
        };
        let global = tree(&[0.0, 0.0]);
        assert_eq!(
            check_update(&arrived(tree(&[1.0, 2.0]), 3), &expected, &global),
            Ok(())
        );
        let transposed = check_update(&arrived(tree(&[1.0]), 3), &expected, &global);
        assert!(
            transposed
                .unwrap_err()
                .contains("does not match the global model")
        );
        let poisoned = check_update(&arrived(tree(&[1.0, f32::NAN]), 3), &expected, &global);
        assert!(poisoned.unwrap_err().contains("`w`[1] is not finite"));
        let steps = check_update(&arrived(tree(&[1.0, 2.0]), 0), &expected, &global);
        assert_eq!(
            steps.unwrap_err(),
            "reports 0 local steps, but the server expects 3"
        );
        let mut greedy = arrived(tree(&[1.0, 2.0]), 3);
        greedy.report.num_samples = u64::MAX;
        assert!(
            check_update(&greedy, &expected, &global)
                .unwrap_err()
                .contains("training samples")
        );
    }

    #[test]
    fn an_own_data_clients_report_is_bounded_by_its_declaration_and_max_samples() {
        let mut config = cohort_core::config::Config::default();
        config.trainer.epochs = 2;
        config.trainer.batch_size = 10;
        config.clients.max_samples = 1000;
        let declared = Some(Declared {
            train_samples: 25,
            test_samples: 7,
        });
        // 25 samples in batches of 10 are 3 steps an epoch, 6 in two epochs;
        // without clients.do_test no held-out samples are expected.
        assert_eq!(
            own_data_expectation(25, declared, &config),
            Ok(ExpectedReport {
                train_samples: 25,
                local_steps: 6,
                test_samples: 0,
            })
        );
        config.clients.do_test = true;
        assert_eq!(
            own_data_expectation(11, declared, &config).map(|e| (e.local_steps, e.test_samples)),
            Ok((4, 7))
        );
        for greedy in [0, 26, u64::MAX] {
            let refused = own_data_expectation(greedy, declared, &config).unwrap_err();
            assert!(refused.contains("it declared 25"), "{refused}");
        }
        config.clients.max_samples = 20;
        assert!(own_data_expectation(25, declared, &config).is_err());
        let unregistered = own_data_expectation(5, None, &config).unwrap_err();
        assert!(
            unregistered.contains("own-data registration"),
            "{unregistered}"
        );
    }

    fn report(client_id: u32, num_samples: u64, loss: f64, training_time: f64) -> ClientReport {
        ClientReport {
            client_id,
            num_samples,
            loss,
            training_time,
            local_steps: 1,
            worker: 0,
        }
    }

    fn arrival(payload_bytes: u64, test: (u64, u64)) -> Arrival {
        Arrival {
            processing_time: 0.5,
            comm_time: 2.0,
            payload_bytes,
            test_samples: test.0,
            test_correct: test.1,
        }
    }

    #[test]
    fn round_numbers_by_hand() {
        let reports = [report(1, 300, 1.0, 3.0), report(2, 100, 2.0, 1.0)];
        // (300·1 + 100·2) / 400 = 1.25.
        assert_eq!(weighted_loss(&reports), 1.25);
        // 3 of 4 and 1 of 6 held-out samples: 4 / 10.
        let arrivals = [arrival(1_000_000, (4, 3)), arrival(1_000_000, (6, 1))];
        assert_eq!(federated_accuracy(&arrivals), Some(0.4));
        assert_eq!(federated_accuracy(&[arrival(1, (0, 0))]), None);

        let mut config = cohort_core::config::Config::default();
        // Measured communication: the slowest is 3 + 0.5 + 2.
        assert_eq!(slowest_client(&reports, &arrivals, 2_000_000, &config), 5.5);
        // Bandwidths instead: 2 MB down at 8 Mbit/s is 2 s, 1 MB up at 4 is 2 s.
        config.clients.downlink_mbps = Some(8.0);
        config.clients.uplink_mbps = Some(4.0);
        assert_eq!(slowest_client(&reports, &arrivals, 2_000_000, &config), 7.5);
    }
}
