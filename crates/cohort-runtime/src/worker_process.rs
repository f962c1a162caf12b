//! `cohort client`: a physical client worker process for network mode.
//!
//! It connects to a `cohort run` server, registers, receives the run's config,
//! and then trains the tasks it is given until the server closes the stream.
//! Two kinds:
//!
//! * an **ordinary worker** loads its own copy of the run's data set and
//!   computes the same partitions the server's config implies (partitioning
//!   is a pure function of the config), then trains whichever logical client
//!   each task names;
//! * an **own-data client** (`--data PATH`) reads its data first
//!   (`cohort_core::data::own`), declares its sample counts when it registers
//!   and claims one logical client; every task it gets is for that client,
//!   trained on all of its training samples and evaluated (with
//!   `clients.do_test`) on all of its held-out ones. It never needs the run's
//!   data set.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio_stream::wrappers::ReceiverStream;

use cohort_core::config::LoadedConfig;
use cohort_core::data::Dataset;
use cohort_core::data::own::{Expected, OwnData};
use cohort_core::data::tabular::FileFormat;
use cohort_train::device::{self, DeviceRequest};
use cohort_train::registry::DatasetEntry;
use cohort_train::trainer::ClientTask;

use crate::client::{BatchTask, ClientPartitions, ClientReply, ClientRunner, load_data};
use crate::grpc::proto::client_message::Kind as ClientKind;
use crate::grpc::proto::federation_client::FederationClient;
use crate::grpc::proto::server_message::Kind as ServerKind;
use crate::grpc::proto::{self, ClientMessage, ServerMessage};
use crate::grpc::{MAX_CLIENT_NAME_BYTES, PROTOCOL_VERSION};
use crate::secure_client::{Reply, SecureClient};
use crate::transport::{TaskInstructions, truncated};

/// How `cohort client` was started.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// `HOST:PORT` of the server.
    pub server: String,
    pub token: Option<String>,
    /// PEM certificate of the authority that signed the server's certificate;
    /// its presence switches the connection to TLS.
    pub tls_ca: Option<PathBuf>,
    /// Name the server's certificate must carry [default: the server's host].
    pub tls_domain: Option<String>,
    /// Overrides the config's `data.data_path`.
    pub data_root: Option<PathBuf>,
    /// Largest payload this client accepts, whatever the server's config says
    /// (a server could announce anything).
    pub max_payload_bytes: usize,
    pub device: DeviceRequest,
    /// How long to keep trying to reach the server.
    pub connect_timeout: Duration,
    /// `--data`: this process brings its own data.
    pub own_data: Option<OwnDataOptions>,
    /// How this machine is named in the server's log (with the process id).
    pub host_name: String,
    /// The models the server's config may name: those of the program the
    /// server runs, so that the client builds the same model.
    pub registry: std::sync::Arc<cohort_train::registry::Registry>,
    /// `--require-secure-aggregation`: refuse a run whose config sends
    /// updates in the clear, before training anything.
    pub require_secure_aggregation: bool,
    /// Tests only: misbehave in secure aggregation (`--secagg-fault`, hidden).
    pub secagg_fault: Option<crate::secure_client::SecAggFault>,
}

/// `cohort client --data PATH [--client-id ID]`.
#[derive(Debug, Clone)]
pub struct OwnDataOptions {
    /// A folder or file in one of the formats of `cohort_core::data::own`.
    pub path: PathBuf,
    /// The own-data client to claim; `None`: the lowest free one.
    pub client_id: Option<u32>,
    /// Most samples the data set may hold in either split, checked before it
    /// is read.
    pub max_samples: u64,
    /// A CSV file's label column.
    pub label_column: String,
}

/// What a worker process did, for its exit message.
#[derive(Debug, Clone, Default)]
pub struct WorkerSummary {
    pub tasks: usize,
    pub failed: usize,
}

fn send(kind: ClientKind) -> ClientMessage {
    ClientMessage { kind: Some(kind) }
}

async fn connect(
    options: &WorkerOptions,
) -> anyhow::Result<FederationClient<tonic::transport::Channel>> {
    let scheme = if options.tls_ca.is_some() {
        "https"
    } else {
        "http"
    };
    let url = format!("{scheme}://{}", options.server);
    let mut endpoint = tonic::transport::Endpoint::from_shared(url.clone())
        .with_context(|| format!("`{}` is not a HOST:PORT address", options.server))?;
    if let Some(ca) = &options.tls_ca {
        let pem = cohort_core::fsutil::read_bounded(ca, crate::grpc::MAX_PEM_BYTES)
            .with_context(|| format!("cannot read the CA certificate {}", ca.display()))?;
        let host = options
            .server
            .rsplit_once(':')
            .map_or(options.server.as_str(), |(h, _)| h);
        let domain = options
            .tls_domain
            .clone()
            .unwrap_or_else(|| host.to_owned());
        endpoint = endpoint
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(pem))
                    .domain_name(domain),
            )
            .context("invalid TLS settings")?;
    }
    let started = Instant::now();
    loop {
        match endpoint.connect().await {
            Ok(channel) => return Ok(FederationClient::new(channel)),
            Err(error) if started.elapsed() < options.connect_timeout => {
                tracing::debug!(%error, "server not reachable yet; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => {
                bail!(
                    "cannot reach the cohort server at {url} within {} s: {error}",
                    options.connect_timeout.as_secs_f64()
                )
            }
        }
    }
}

/// Runs until the server ends the session.
pub fn run_worker(options: &WorkerOptions) -> anyhow::Result<WorkerSummary> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the client's network thread")?;
    runtime.block_on(work(options))
}

async fn next(inbound: &mut tonic::Streaming<ServerMessage>) -> anyhow::Result<Option<ServerKind>> {
    match inbound.message().await {
        Ok(Some(ServerMessage { kind: Some(kind) })) => Ok(Some(kind)),
        Ok(Some(ServerMessage { kind: None })) => bail!("the server sent an empty message"),
        Ok(None) => Ok(None),
        Err(status) if status.code() == tonic::Code::Unauthenticated => {
            bail!("the server refused this client: {}", status.message())
        }
        Err(status) => bail!("the connection to the server broke: {}", status.message()),
    }
}

type Outbox = tokio::sync::mpsc::Sender<ClientMessage>;

/// `host:pid`, the host name cut so the whole fits the server's bound (which
/// refuses longer names): an honest client with a long host name still gets
/// in, and keeps its process id.
fn process_name(host: &str, pid: u32) -> String {
    let pid = format!(":{pid}");
    let host = truncated(host, MAX_CLIENT_NAME_BYTES - pid.len());
    format!("{host}{pid}")
}

type Joined = (Outbox, tonic::Streaming<ServerMessage>, proto::Welcome);

/// Registers (with an own-data claim when `own` is given) and waits for the
/// server's welcome. A refusal that may clear (a server whose connection
/// slots are full cuts the connection) is retried until `--connect-timeout`;
/// a refusal of this client itself (token, name, protocol, declaration, an
/// id held by another process) is final.
async fn register(options: &WorkerOptions, own: Option<&proto::OwnData>) -> anyhow::Result<Joined> {
    let started = Instant::now();
    loop {
        match try_register(options, own).await {
            Ok(joined) => return Ok(joined),
            Err(Refused::Passing(status)) if started.elapsed() < options.connect_timeout => {
                tracing::info!(
                    reason = status.message(),
                    "the server did not take this client yet; retrying"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(Refused::Passing(status)) => bail!(
                "the server did not take this client within {} s (--connect-timeout): {}",
                options.connect_timeout.as_secs_f64(),
                status.message()
            ),
            Err(Refused::Final(error)) => return Err(error),
        }
    }
}

/// Why one registration attempt failed.
enum Refused {
    /// May clear by itself: try again.
    Passing(tonic::Status),
    Final(anyhow::Error),
}

impl From<anyhow::Error> for Refused {
    fn from(error: anyhow::Error) -> Self {
        Refused::Final(error)
    }
}

/// Statuses that say "not now" rather than "not you": a connection cut
/// before registration (slots full), every own-data id held. An explicit
/// `--client-id` another process holds stays a refusal: its holder is
/// connected, and waiting for it would only hide the conflict.
fn passing(status: &tonic::Status) -> bool {
    use tonic::Code;
    matches!(
        status.code(),
        Code::Unavailable | Code::Unknown | Code::ResourceExhausted | Code::Cancelled
    )
}

async fn try_register(
    options: &WorkerOptions,
    own: Option<&proto::OwnData>,
) -> Result<Joined, Refused> {
    let mut client = connect(options).await?;
    let (sender, receiver) = tokio::sync::mpsc::channel::<ClientMessage>(4);
    let name = process_name(&options.host_name, std::process::id());
    let own_data = own.cloned();
    // Queued before the call: the server answers only after reading it.
    sender
        .send(send(ClientKind::Register(proto::Register {
            token: options.token.clone().unwrap_or_default(),
            name,
            protocol: PROTOCOL_VERSION,
            own_data,
        })))
        .await
        .map_err(anyhow::Error::from)?;
    let mut inbound = match client.join(ReceiverStream::new(receiver)).await {
        Ok(response) => response.into_inner(),
        Err(status) if passing(&status) => return Err(Refused::Passing(status)),
        Err(status) => {
            return Err(Refused::Final(anyhow::anyhow!(
                "the server refused this client: {}",
                status.message()
            )));
        }
    };
    match inbound.message().await {
        Ok(Some(ServerMessage {
            kind: Some(ServerKind::Welcome(welcome)),
        })) => Ok((sender, inbound, welcome)),
        Err(status) if passing(&status) => Err(Refused::Passing(status)),
        _ => Err(Refused::Final(anyhow::anyhow!(
            "the server did not welcome this client"
        ))),
    }
}

/// What this process trains on.
enum Holdings {
    /// Partitions of the run's data set, for any logical client.
    Shared {
        data: Dataset,
        partitions: ClientPartitions,
    },
    /// Its own data: one logical client, all of its training samples, and its
    /// held-out samples when the run evaluates on clients.
    Own {
        client_id: u32,
        data: Dataset,
        train: Vec<u32>,
        held_out: Vec<u32>,
        /// The server's data set as this process knows it.
        dataset: DatasetEntry,
    },
}

/// The server's data set for an own-data client. A file data set (CSV, NPZ,
/// Safetensors) is known from the server's file, which such a client need
/// not hold: then it is known from the client's own samples and the classes
/// the server's config states (`parameters.model.num_classes`, which the
/// server fills in for its clients).
fn own_dataset(
    loaded: &LoadedConfig,
    options: &WorkerOptions,
    own: &OwnData,
) -> anyhow::Result<DatasetEntry> {
    let datasource = &loaded.config().data.datasource;
    let from_files = options
        .registry
        .dataset_in(loaded, options.data_root.as_deref());
    let (Err(errors), Some(format)) = (&from_files, FileFormat::from_name(datasource)) else {
        return from_files.map_err(|errors| anyhow::anyhow!("{errors}"));
    };
    let classes = loaded.num_classes_set().with_context(|| {
        format!(
            "the server's file data set `{datasource}` cannot be read here ({errors}), and its              config does not say its classes (parameters.model.num_classes)"
        )
    })?;
    let name = format.name().to_owned();
    Ok(DatasetEntry::new(
        format.name(),
        format.summary(),
        own.train.shape.clone(),
        classes,
        own.train.len(),
        move |_| Err(format!("an own-data client of `{name}` reads only its own file").into()),
    ))
}

impl Holdings {
    /// One sample's shape in the data held.
    fn sample_shape(&self) -> &[usize] {
        match self {
            Self::Shared { data, .. } | Self::Own { data, .. } => &data.sample_shape,
        }
    }

    fn prepare(
        loaded: &LoadedConfig,
        options: &WorkerOptions,
        own: Option<OwnData>,
        granted: u32,
    ) -> anyhow::Result<Self> {
        let Some(own) = own else {
            let (splits, partitions) =
                load_data(loaded, &options.registry, options.data_root.as_deref())?;
            return Ok(Self::Shared {
                data: splits.train,
                partitions,
            });
        };
        anyhow::ensure!(
            granted > 0,
            "the server accepted the own-data registration but named no client id"
        );
        let config = &loaded.config();
        let (train, test) = (own.train.len(), own.test_len());
        let total = u32::try_from(train + test)
            .with_context(|| format!("{}: more than 2^32 samples", own.source.display()))?;
        let train = u32::try_from(train).unwrap_or(total);
        // Own data takes the shape, normalization and task of the server's
        // data set, as this process's registry knows it.
        let dataset = own_dataset(loaded, options, &own)?;
        let data = own.into_dataset(Expected {
            sample_shape: dataset.sample_shape(),
            classes: dataset.classes(),
            normalization: dataset.normalization(),
            datasource: dataset.name(),
        })?;
        if let Err(error) = dataset.task().check(&data, dataset.classes()) {
            anyhow::bail!(
                "--data: the server's data set `{}` is learned as {}: {error}",
                dataset.name(),
                dataset.task().name()
            );
        }
        let held_out = if config.clients.do_test {
            (train..total).collect()
        } else {
            Vec::new()
        };
        Ok(Self::Own {
            client_id: granted,
            data,
            train: (0..train).collect(),
            held_out,
            dataset,
        })
    }

    /// The data set, training indices and held-out indices of `client_id`.
    fn client(&self, client_id: u32) -> anyhow::Result<(&Dataset, &[u32], &[u32])> {
        match self {
            Self::Shared { data, partitions } => {
                let index = (client_id as usize).checked_sub(1);
                let found = index
                    .and_then(|index| partitions.train.get(index).zip(partitions.test.get(index)));
                let Some((train, held_out)) = found else {
                    bail!(
                        "the server asked for client {client_id}, which the config does not have"
                    );
                };
                Ok((data, train, held_out))
            }
            Self::Own {
                client_id: mine,
                data,
                train,
                held_out,
                ..
            } => {
                anyhow::ensure!(
                    client_id == *mine,
                    "the server asked for client {client_id}, but this process holds client \
                     {mine}'s data"
                );
                Ok((data, train, held_out))
            }
        }
    }
}

/// Trains the tasks a client process receives: cohort's own model on the
/// data the process holds (`cohort client`), or the caller's code
/// ([`run_worker_with`]).
pub trait TaskTrainer {
    /// The reply to `task`, from the global model as the server sent it
    /// (`payload`, through `client_inbound`), or why this client is out of
    /// the round (sent to the server as `TaskFailed`); the outer `Err`
    /// ends the process (a task it can never train).
    fn train(
        &mut self,
        task: ClientTask,
        instructions: &TaskInstructions,
        payload: &[u8],
    ) -> anyhow::Result<Result<ClientReply, String>>;
}

/// An own-data client whose training is the caller's code: what it
/// declares at registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Declaration {
    /// The own-data client to claim; `None`: the lowest free one.
    pub client_id: Option<u32>,
    pub train_samples: u64,
    pub test_samples: u64,
}

/// Builds the trainer once the server's config is known: the config and
/// the own-data client id the server granted.
pub type MakeTrainer<'a> =
    Box<dyn FnOnce(&LoadedConfig, u32) -> anyhow::Result<Box<dyn TaskTrainer>> + 'a>;

/// Asked between the server's messages whether the caller wants the
/// process to stop (a Ctrl-C in the caller's code).
pub type StopCheck<'a> = &'a (dyn Fn() -> bool + Sync);

/// [`run_worker`] for an own-data client that trains with `make`'s
/// trainer instead of a model of the registry: it declares `declared`,
/// loads no data and builds no model. While it waits for the server it
/// asks `stop` every 200 ms, and ends when that says so.
pub fn run_worker_with(
    options: &WorkerOptions,
    declared: Declaration,
    make: MakeTrainer<'_>,
    stop: StopCheck<'_>,
) -> anyhow::Result<WorkerSummary> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the client's network thread")?;
    let own = proto::OwnData {
        client_id: declared.client_id.unwrap_or(0),
        train_samples: declared.train_samples,
        test_samples: declared.test_samples,
    };
    runtime.block_on(async {
        let (sender, mut inbound, welcome) = register(options, Some(&own)).await?;
        let loaded = server_config(&welcome)?;
        check_secure_aggregation(options, &loaded)?;
        anyhow::ensure!(
            welcome.client_id > 0,
            "the server accepted the own-data registration but named no client id"
        );
        let mut trainer = make(&loaded, welcome.client_id)?;
        tracing::info!(
            worker = welcome.worker,
            client = welcome.client_id,
            "registered as own-data client {}; waiting for tasks",
            welcome.client_id
        );
        let secure = SecureClient::of_config(&loaded, options.secagg_fault)?;
        let mut served = Served {
            sender: &sender,
            inbound: &mut inbound,
            stop: Some(stop),
        };
        serve(options, &loaded, &mut served, trainer.as_mut(), secure).await
    })
}

/// The stream a client process is served on, and the caller's stop check.
struct Served<'a> {
    sender: &'a Outbox,
    inbound: &'a mut tonic::Streaming<ServerMessage>,
    stop: Option<StopCheck<'a>>,
}

impl Served<'_> {
    /// The server's next message, unless the caller stops first.
    async fn next(&mut self) -> anyhow::Result<Option<ServerKind>> {
        let Some(stop) = self.stop else {
            return next(self.inbound).await;
        };
        tokio::select! {
            message = next(self.inbound) => message,
            () = stopped(stop) => bail!("stopped while waiting for the server"),
        }
    }
}

async fn stopped(stop: StopCheck<'_>) {
    while !stop() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `--require-secure-aggregation`: the config is the server's word, and a
/// server that leaves the section out would receive every update in the
/// clear.
fn check_secure_aggregation(options: &WorkerOptions, loaded: &LoadedConfig) -> anyhow::Result<()> {
    anyhow::ensure!(
        !options.require_secure_aggregation || loaded.config().secure_aggregation.is_some(),
        "the server's config has no [secure_aggregation], so this client's updates would \
         reach the server unmasked; --require-secure-aggregation refuses to take part"
    );
    Ok(())
}

fn server_config(welcome: &proto::Welcome) -> anyhow::Result<LoadedConfig> {
    cohort_core::config::from_str(&welcome.config_toml, Path::new("<config from the server>"))
        .context("the server's config does not load in this cohort build")
}

/// cohort's own model trained on the data this process holds.
struct ModelTrainer {
    holdings: Holdings,
    runner: ClientRunner,
    compute: rayon::ThreadPool,
}

impl TaskTrainer for ModelTrainer {
    fn train(
        &mut self,
        task: ClientTask,
        instructions: &TaskInstructions,
        payload: &[u8],
    ) -> anyhow::Result<Result<ClientReply, String>> {
        let (data, partition, held_out) = self.holdings.client(task.client_id)?;
        let runner = &mut self.runner;
        let task = BatchTask {
            task,
            instructions,
            partition,
            held_out,
        };
        let outcome = self.compute.install(|| runner.run(&task, payload, data));
        Ok(outcome.map_err(|error| error.to_string()))
    }
}

async fn work(options: &WorkerOptions) -> anyhow::Result<WorkerSummary> {
    // Read and checked before connecting: the counts it declares are what it holds.
    let own = match &options.own_data {
        Some(own) => Some(OwnData::load_with(
            &own.path,
            own.max_samples,
            &own.label_column,
        )?),
        None => None,
    };
    let declared = own.as_ref().map(|own| proto::OwnData {
        client_id: options
            .own_data
            .as_ref()
            .and_then(|o| o.client_id)
            .unwrap_or(0),
        train_samples: own.train.len() as u64,
        test_samples: own.test_len() as u64,
    });
    let (sender, mut inbound, welcome) = register(options, declared.as_ref()).await?;
    let loaded = server_config(&welcome)?;
    let config = &loaded.config();
    check_secure_aggregation(options, &loaded)?;
    // The server's configuration decides the shapes this client's kernels see.
    device::key_kernel_cache(&loaded.result_hash());
    let selected = device::select(options.device)?;
    let holdings = Holdings::prepare(&loaded, options, own, welcome.client_id)?;
    let shape = holdings.sample_shape().to_vec();
    let model = match &holdings {
        Holdings::Own { dataset, .. } => options.registry.run_model_for(&loaded, dataset, shape),
        Holdings::Shared { .. } => {
            let root = options.data_root.as_deref();
            options.registry.run_model_in(&loaded, root, shape)
        }
    }
    .context("the server's model")?;
    let mut trainer = ModelTrainer {
        holdings,
        runner: ClientRunner::new(&loaded, &model, &selected)?,
        compute: compute_threads(config.trainer.threads_per_worker)?,
    };
    log_registered(&welcome, selected.name);
    let secure = SecureClient::of_config(&loaded, options.secagg_fault)?;
    let mut served = Served {
        sender: &sender,
        inbound: &mut inbound,
        stop: None,
    };
    serve(options, &loaded, &mut served, &mut trainer, secure).await
}

/// Answers the server's tasks with `trainer` until it ends the stream;
/// under secure aggregation (`secure`) each update stays here and only its
/// masked form leaves, stage by stage.
async fn serve(
    options: &WorkerOptions,
    loaded: &LoadedConfig,
    served: &mut Served<'_>,
    trainer: &mut dyn TaskTrainer,
    mut secure: Option<SecureClient>,
) -> anyhow::Result<WorkerSummary> {
    let max_bytes = loaded
        .decode_limits()
        .max_bytes
        .min(options.max_payload_bytes);
    let mut summary = WorkerSummary::default();
    loop {
        let task = match served.next().await? {
            Some(ServerKind::Task(task)) => task,
            Some(ServerKind::Secagg(request)) => {
                let Some(secure) = secure.as_mut() else {
                    bail!("the server sent a secure-aggregation stage, but its config has none");
                };
                answer_stage(served.sender, secure, &request).await?;
                continue;
            }
            None => break,
            Some(_) => bail!("the server sent a message out of order"),
        };
        let download_started = Instant::now();
        let (payload, instructions) = task_inputs(served.inbound, &task, max_bytes).await?;
        let download_time = download_started.elapsed().as_secs_f64();
        tracing::info!(
            round = task.round,
            client = task.client_id,
            "training client {} of round {}",
            task.client_id,
            task.round
        );
        let job = ClientTask {
            client_id: task.client_id,
            round: task.round,
        };
        let outcome = tokio::task::block_in_place(|| trainer.train(job, &instructions, &payload))?;
        summary.tasks += 1;
        if let Err(error) = &outcome {
            summary.failed += 1;
            tracing::warn!(client = task.client_id, round = task.round, "{error}");
        }
        let mut outcome = outcome;
        if let Some(secure) = secure.as_mut() {
            withhold_update(secure, &task, &payload, &mut outcome);
        }
        answer(served.sender, &task, outcome, download_time).await?;
    }
    Ok(summary)
}

fn log_registered(welcome: &proto::Welcome, device: &str) {
    match welcome.client_id {
        0 => tracing::info!(
            worker = welcome.worker,
            device,
            "registered; waiting for tasks"
        ),
        id => tracing::info!(
            worker = welcome.worker,
            client = id,
            device,
            "registered as own-data client {id}; waiting for tasks"
        ),
    }
}

/// Under secure aggregation the trained update stays in this process: the
/// report goes without it, and only its masked form leaves, stage by stage.
/// A task whose update cannot be masked fails with the reason.
fn withhold_update(
    secure: &mut SecureClient,
    task: &proto::Task,
    global_payload: &[u8],
    outcome: &mut Result<ClientReply, String>,
) {
    let Ok(reply) = outcome else { return };
    match secure.trained(task.client_id, task.round, global_payload, reply) {
        Ok(()) => {
            reply.payload = bytes::Bytes::new();
            reply.packed_from = None;
        }
        Err(reason) => *outcome = Err(reason),
    }
}

/// Answers one secure-aggregation stage message: the answer's size, then
/// its bytes in chunks; or the refusal.
async fn answer_stage(
    sender: &Outbox,
    secure: &mut SecureClient,
    request: &proto::SecAggRequest,
) -> anyhow::Result<()> {
    let reply = match crate::grpc::stage_from(request.stage) {
        Some(stage) => secure.answer(request.round, request.client_id, stage, &request.body),
        None => Reply::Refuse(format!("unknown stage {}", request.stage)),
    };
    let (body, refused) = match reply {
        Reply::Answer(body) => (body, String::new()),
        Reply::Refuse(reason) => (Vec::new(), reason),
        Reply::Silent => return Ok(()),
    };
    sender
        .send(send(ClientKind::Secagg(proto::SecAggAnswer {
            round: request.round,
            client_id: request.client_id,
            stage: request.stage,
            body_bytes: body.len() as u64,
            refused,
        })))
        .await?;
    for data in crate::grpc::chunks(&body.into()) {
        sender
            .send(send(ClientKind::Chunk(proto::Chunk { data })))
            .await?;
    }
    Ok(())
}

/// The compute threads a task trains on.
fn compute_threads(threads: u32) -> anyhow::Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads as usize)
        .build()
        .with_context(|| {
            format!("cannot start {threads} compute threads (trainer.threads_per_worker)")
        })
}

/// What follows a Task message: the global model, and the strategy's
/// correction when it announced one, each bounded by `max_bytes`.
async fn task_inputs(
    inbound: &mut tonic::Streaming<ServerMessage>,
    task: &proto::Task,
    max_bytes: usize,
) -> anyhow::Result<(Vec<u8>, TaskInstructions)> {
    let payload = receive_bytes(inbound, task.payload_bytes, max_bytes, "global model").await?;
    let correction = match task.correction_bytes {
        0 => None,
        bytes => Some(Arc::new(
            receive_bytes(inbound, bytes, max_bytes, "gradient correction").await?,
        )),
    };
    let instructions = TaskInstructions {
        learning_rate: task.learning_rate,
        proximal_mu: task.proximal_mu,
        update_clip_norm: task.update_clip_norm,
        correction,
    };
    Ok((payload, instructions))
}

/// Sends a task's report and update, or why it failed.
async fn answer(
    sender: &Outbox,
    task: &proto::Task,
    outcome: Result<ClientReply, String>,
    download_time: f64,
) -> anyhow::Result<()> {
    let reply = match outcome {
        Ok(reply) => reply,
        Err(reason) => {
            sender
                .send(send(ClientKind::Failed(proto::TaskFailed {
                    client_id: task.client_id,
                    round: task.round,
                    reason,
                })))
                .await?;
            return Ok(());
        }
    };
    sender
        .send(send(ClientKind::Report(proto::Report {
            client_id: task.client_id,
            round: task.round,
            num_samples: reply.num_samples,
            loss: reply.loss,
            training_time: reply.training_time,
            processing_time: reply.processing_time,
            payload_bytes: reply.payload.len() as u64,
            local_steps: reply.local_steps,
            test_samples: reply.test_samples,
            test_correct: reply.test_correct,
            download_time,
        })))
        .await?;
    for data in crate::grpc::chunks(&reply.payload) {
        sender
            .send(send(ClientKind::Chunk(proto::Chunk { data })))
            .await?;
    }
    Ok(())
}

/// `announced` bytes sent as chunks, refusing more than `max_bytes` (the
/// config's `server.max_payload_bytes`) before allocating anything. The
/// buffer grows as chunks arrive: an announcement alone (a server could
/// announce a gigabyte and send nothing) reserves no more than a few chunks.
async fn receive_bytes(
    inbound: &mut tonic::Streaming<ServerMessage>,
    announced: u64,
    max_bytes: usize,
    what: &str,
) -> anyhow::Result<Vec<u8>> {
    let size = usize::try_from(announced)
        .ok()
        .filter(|&size| size <= max_bytes)
        .with_context(|| {
            format!(
                "the server announced a {what} of {announced} bytes, above \
                 the limit of {max_bytes} (server.max_payload_bytes, capped by --max-payload-bytes)"
            )
        })?;
    let mut bytes = Vec::with_capacity(first_capacity(size));
    while bytes.len() < size {
        match next(inbound).await? {
            Some(ServerKind::Chunk(chunk)) if bytes.len() + chunk.data.len() <= size => {
                bytes.extend_from_slice(&chunk.data)
            }
            Some(ServerKind::Chunk(_)) => bail!("the server sent more {what} bytes than announced"),
            _ => bail!("the {what} payload ended early"),
        }
    }
    Ok(bytes)
}

/// What a payload of `announced` bytes reserves before its first chunk.
fn first_capacity(announced: usize) -> usize {
    announced.min(4 * crate::grpc::CHUNK_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_announced_size_reserves_a_few_chunks_at_most() {
        assert_eq!(first_capacity(1000), 1000);
        assert_eq!(first_capacity(1 << 30), 4 << 20);
    }

    #[test]
    fn a_long_host_name_is_cut_to_the_servers_bound_and_keeps_the_pid() {
        assert_eq!(process_name("box", 42), "box:42");
        // '€' is 3 bytes: 256 - len(":4294967295") = 245 bytes of host name
        // end inside one, so the cut must fall back a byte or two.
        for host in ["€".repeat(200), "a".repeat(1000), "é€𝄞".repeat(50)] {
            for pid in [0, 7, u32::MAX] {
                let name = process_name(&host, pid);
                let suffix = format!(":{pid}");
                assert!(name.len() <= MAX_CLIENT_NAME_BYTES, "{}", name.len());
                assert!(name.len() > MAX_CLIENT_NAME_BYTES - 4, "{}", name.len());
                assert!(
                    name.ends_with(&suffix) && host.starts_with(&name[..name.len() - suffix.len()])
                );
            }
        }
    }
}
