//! The network transport (`clients.comm_simulation = false`): a gRPC server in
//! the `cohort run` process and `cohort client` worker processes, on this
//! machine or others. The protocol is `proto/cohort.proto`.
//!
//! Each client process holds one bidirectional stream. After it registers
//! (shared token checked in constant time when `server.auth_token` is set), it
//! takes tasks from the round's queue one at a time, as an in-process worker
//! does. Payloads travel in chunks of [`CHUNK_BYTES`], so models of any size
//! pass without raising gRPC's message limits, and a client's claimed payload
//! size is checked against `server.max_payload_bytes` before anything is
//! buffered.
//!
//! A client that disconnects, dies, sends something malformed or exceeds
//! `server.payload_timeout` is dropped: its task comes back as a failed
//! [`ClientOutcome`] and the round loop decides (with `clients.min_per_round`)
//! whether the round can still aggregate.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::sync::Notify;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::client::ClientReply;
use crate::transport::{ClientOutcome, Delivered, TaskSpec, Transport};
use cohort_train::trainer::ClientTask;

pub mod proto {
    tonic::include_proto!("cohort.v1");
}

use proto::client_message::Kind as ClientKind;
use proto::federation_server::{Federation, FederationServer};
use proto::server_message::Kind as ServerKind;
use proto::{ClientMessage, ServerMessage};

/// Bumped when the messages change incompatibly.
pub const PROTOCOL_VERSION: u32 = 2;
/// Payload bytes per chunk message: well under gRPC's 4 MiB default limit.
pub const CHUNK_BYTES: usize = 1 << 20;

/// What the server needs to listen.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub bind: SocketAddr,
    /// The run's resolved config, sent to every client process.
    pub config_toml: String,
    pub auth_token: Option<String>,
    /// PEM certificate chain and private key.
    pub tls: Option<(PathBuf, PathBuf)>,
    pub payload_timeout: Duration,
    pub registration_timeout: Duration,
    pub max_payload_bytes: usize,
    /// Update bytes all clients together may have in flight to the server;
    /// a client whose upload would exceed it waits for room.
    pub max_inflight_bytes: usize,
    /// Limits on connections that have not (yet) registered.
    pub admission: crate::admission::Admission,
}

/// How long a new stream may take to send its Register message.
const REGISTER_WITHIN: Duration = Duration::from_secs(10);

struct Job {
    spec: TaskSpec,
    payload: Arc<Vec<u8>>,
}

struct Shared {
    settings: ServerSettings,
    queue: Mutex<VecDeque<Job>>,
    work: Notify,
    shutting_down: AtomicBool,
    registered: AtomicUsize,
    alive: AtomicUsize,
    outcomes: Mutex<mpsc::Sender<ClientOutcome>>,
    /// Room for uploads in flight, in KiB.
    inflight: Arc<tokio::sync::Semaphore>,
}

/// Semaphore permits count KiB, so a u32 of them covers any payload.
fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

impl Shared {
    fn push_outcome(&self, outcome: ClientOutcome) {
        if let Ok(sender) = self.outcomes.lock() {
            // The round loop may be gone already (run over); nothing to tell then.
            let _ = sender.send(outcome);
        }
    }

    async fn next_job(&self) -> Option<Job> {
        loop {
            let notified = self.work.notified();
            tokio::pin!(notified);
            // Registered before looking at the queue, so a push in between wakes us.
            notified.as_mut().enable();
            if self.shutting_down.load(Ordering::SeqCst) {
                return None;
            }
            if let Some(job) = self.queue.lock().ok()?.pop_front() {
                return Some(job);
            }
            notified.await;
        }
    }
}

struct Service {
    shared: Arc<Shared>,
}

type ServerStream = Pin<Box<dyn Stream<Item = Result<ServerMessage, Status>> + Send>>;

fn message(kind: ServerKind) -> Result<ServerMessage, Status> {
    Ok(ServerMessage { kind: Some(kind) })
}

fn token_matches(expected: &str, given: &str) -> bool {
    use subtle::ConstantTimeEq;
    expected.as_bytes().ct_eq(given.as_bytes()).into()
}

#[tonic::async_trait]
impl Federation for Service {
    type JoinStream = ServerStream;

    async fn join(
        &self,
        request: Request<Streaming<ClientMessage>>,
    ) -> Result<Response<Self::JoinStream>, Status> {
        // Over TLS, tonic wraps the connection's info in its own.
        let extensions = request.extensions();
        let connection = extensions
            .get::<crate::admission::AdmittedInfo>()
            .or_else(|| {
                extensions
                    .get::<tonic::transport::server::TlsConnectInfo<crate::admission::AdmittedInfo>>()
                    .map(|tls| tls.get_ref())
            })
            .cloned();
        let peer = connection
            .as_ref()
            .and_then(|c| c.tcp.remote_addr())
            .map_or_else(|| "unknown peer".to_owned(), |a| a.to_string());
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(REGISTER_WITHIN, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no Register message within 10 s"))?;
        let register = match first? {
            Some(ClientMessage {
                kind: Some(ClientKind::Register(register)),
            }) => register,
            _ => {
                return Err(Status::invalid_argument(
                    "the first message must be Register",
                ));
            }
        };
        if register.protocol != PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "client speaks protocol {}, this server {PROTOCOL_VERSION}; use the same cohort version on both",
                register.protocol
            )));
        }
        if let Some(expected) = &self.shared.settings.auth_token
            && !token_matches(expected, &register.token)
        {
            tracing::warn!(%peer, name = register.name, "client refused: wrong or missing token");
            return Err(Status::unauthenticated(
                "wrong or missing token (cohort client --token, or COHORT_TOKEN)",
            ));
        }
        // A registered client process may keep its connection.
        if let Some(connection) = &connection {
            connection.registered.store(true, Ordering::Relaxed);
        }
        let worker = self.shared.registered.fetch_add(1, Ordering::SeqCst);
        self.shared.alive.fetch_add(1, Ordering::SeqCst);
        tracing::info!(%peer, name = register.name, worker, "client process registered");
        let (sender, receiver) = tokio::sync::mpsc::channel(4);
        sender
            .send(message(ServerKind::Welcome(proto::Welcome {
                config_toml: self.shared.settings.config_toml.clone(),
                worker: worker as u32,
            })))
            .await
            .map_err(|_| Status::cancelled("client left during registration"))?;
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            serve_worker(&shared, worker, register.name, inbound, sender).await;
            shared.alive.fetch_sub(1, Ordering::SeqCst);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

/// Why a task did not come back.
enum TaskError {
    /// The client said so and can take further tasks.
    Failed(String),
    /// The connection is unusable; the worker is dropped.
    Broken(String),
}

async fn serve_worker(
    shared: &Shared,
    worker: usize,
    name: String,
    mut inbound: Streaming<ClientMessage>,
    sender: tokio::sync::mpsc::Sender<Result<ServerMessage, Status>>,
) {
    loop {
        // An idle client that leaves is noticed now, not when a task it would
        // have lost is handed to it.
        let job = tokio::select! {
            job = shared.next_job() => job,
            idle = inbound.message() => {
                match idle {
                    Ok(Some(_)) => tracing::warn!(worker, process = name, "unexpected message from an idle client; dropping it"),
                    Ok(None) | Err(_) => tracing::info!(worker, process = name, "client process left"),
                }
                None
            }
        };
        let Some(job) = job else { break };
        let started = Instant::now();
        let task = job.spec.task;
        let attempt = tokio::time::timeout(
            shared.settings.payload_timeout,
            run_task(shared, &sender, &mut inbound, &job),
        )
        .await;
        let (result, keep_worker) = match attempt {
            Ok(Ok(reply)) => {
                let own = reply.training_time + reply.processing_time;
                let comm_time = (started.elapsed().as_secs_f64() - own).max(0.0);
                (Ok(Delivered { reply, comm_time }), true)
            }
            Ok(Err(TaskError::Failed(reason))) => (Err(reason), true),
            Ok(Err(TaskError::Broken(reason))) => (Err(reason), false),
            Err(_) => (
                Err(format!(
                    "no report within server.payload_timeout = {} s",
                    shared.settings.payload_timeout.as_secs_f64()
                )),
                false,
            ),
        };
        if let Err(reason) = &result {
            tracing::warn!(
                client = task.client_id,
                round = task.round,
                worker,
                process = name,
                "client dropped from the round: {reason}"
            );
        }
        shared.push_outcome(ClientOutcome {
            slot: job.spec.slot,
            task,
            worker,
            result,
        });
        if !keep_worker {
            break;
        }
    }
}

async fn run_task(
    shared: &Shared,
    sender: &tokio::sync::mpsc::Sender<Result<ServerMessage, Status>>,
    inbound: &mut Streaming<ClientMessage>,
    job: &Job,
) -> Result<ClientReply, TaskError> {
    let gone = || TaskError::Broken("the client process disconnected".to_owned());
    let ClientTask { client_id, round } = job.spec.task;
    let instructions = &job.spec.instructions;
    let correction: &[u8] = instructions
        .correction
        .as_deref()
        .map_or(&[], Vec::as_slice);
    sender
        .send(message(ServerKind::Task(proto::Task {
            client_id,
            round,
            learning_rate: instructions.learning_rate,
            payload_bytes: job.payload.len() as u64,
            proximal_mu: instructions.proximal_mu,
            update_clip_norm: instructions.update_clip_norm,
            correction_bytes: correction.len() as u64,
        })))
        .await
        .map_err(|_| gone())?;
    for chunk in job
        .payload
        .chunks(CHUNK_BYTES)
        .chain(correction.chunks(CHUNK_BYTES))
    {
        sender
            .send(message(ServerKind::Chunk(proto::Chunk {
                data: chunk.to_vec(),
            })))
            .await
            .map_err(|_| gone())?;
    }
    let report = match next_message(inbound).await? {
        ClientKind::Report(report) => report,
        ClientKind::Failed(failed) if failed.client_id == client_id && failed.round == round => {
            return Err(TaskError::Failed(format!(
                "the client's training failed: {}",
                failed.reason
            )));
        }
        _ => return Err(malformed("expected a report")),
    };
    if report.client_id != client_id || report.round != round {
        return Err(malformed(&format!(
            "report for client {} round {}, but the task was client {client_id} round {round}",
            report.client_id, report.round
        )));
    }
    let size = usize::try_from(report.payload_bytes).unwrap_or(usize::MAX);
    if size > shared.settings.max_payload_bytes {
        return Err(malformed(&format!(
            "update of {} bytes exceeds server.max_payload_bytes = {}",
            report.payload_bytes, shared.settings.max_payload_bytes
        )));
    }
    // Room is reserved for the announced size before anything is buffered,
    // and the buffer grows only as bytes arrive.
    let _room = shared
        .inflight
        .acquire_many(kib(size))
        .await
        .map_err(|_| TaskError::Broken("the server is stopping".to_owned()))?;
    let mut payload = Vec::with_capacity(size.min(CHUNK_BYTES));
    while payload.len() < size {
        match next_message(inbound).await? {
            ClientKind::Chunk(chunk) if payload.len() + chunk.data.len() <= size => {
                payload.extend_from_slice(&chunk.data)
            }
            ClientKind::Chunk(_) => return Err(malformed("more payload bytes than announced")),
            _ => return Err(malformed("the update payload ended early")),
        }
    }
    Ok(ClientReply {
        num_samples: report.num_samples,
        loss: report.loss,
        training_time: report.training_time,
        processing_time: report.processing_time,
        local_steps: report.local_steps,
        test_samples: report.test_samples,
        test_correct: report.test_correct.min(report.test_samples),
        payload,
    })
}

fn malformed(what: &str) -> TaskError {
    TaskError::Broken(format!("malformed message from the client: {what}"))
}

async fn next_message(inbound: &mut Streaming<ClientMessage>) -> Result<ClientKind, TaskError> {
    match inbound.message().await {
        Ok(Some(ClientMessage { kind: Some(kind) })) => Ok(kind),
        Ok(Some(ClientMessage { kind: None })) => Err(malformed("empty message")),
        Ok(None) => Err(TaskError::Broken(
            "the client process closed the connection".to_owned(),
        )),
        Err(status) => Err(TaskError::Broken(format!(
            "the connection to the client process broke: {}",
            status.message()
        ))),
    }
}

/// The server side of the network transport.
pub struct GrpcTransport {
    shared: Arc<Shared>,
    outcomes: mpsc::Receiver<ClientOutcome>,
    local_addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    serving: Option<tokio::task::JoinHandle<()>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl GrpcTransport {
    /// Binds the address and starts serving in background threads.
    pub fn start(settings: ServerSettings) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("cohort-grpc")
            .enable_all()
            .build()?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(settings.bind))
            .with_context(|| {
                format!(
                    "cannot listen on {} (server.address / server.port)",
                    settings.bind
                )
            })?;
        let local_addr = listener.local_addr()?;
        // Pings find peers that vanished without closing; a client needs one
        // stream, so a few per connection are plenty.
        let mut builder = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(20)))
            .max_concurrent_streams(Some(4));
        if let Some((cert, key)) = &settings.tls {
            let read = |path: &PathBuf, what: &str| {
                std::fs::read(path).with_context(|| {
                    format!(
                        "cannot read the TLS {what} {} (server.tls_{what})",
                        path.display()
                    )
                })
            };
            let identity =
                tonic::transport::Identity::from_pem(read(cert, "cert")?, read(key, "key")?);
            builder = builder
                .tls_config(
                    tonic::transport::ServerTlsConfig::new()
                        .identity(identity)
                        .timeout(Duration::from_secs(10)),
                )
                .context("invalid TLS certificate or key (server.tls_cert / server.tls_key)")?;
        }
        let admission = settings.admission;
        // One largest update must always fit, or its client would wait forever.
        let room = settings.max_inflight_bytes.max(settings.max_payload_bytes);
        let inflight = Arc::new(tokio::sync::Semaphore::new(kib(room) as usize));
        let (outcome_sender, outcomes) = mpsc::channel();
        let shared = Arc::new(Shared {
            settings,
            queue: Mutex::new(VecDeque::new()),
            work: Notify::new(),
            shutting_down: AtomicBool::new(false),
            registered: AtomicUsize::new(0),
            alive: AtomicUsize::new(0),
            outcomes: Mutex::new(outcome_sender),
            inflight,
        });
        let service = FederationServer::new(Service {
            shared: Arc::clone(&shared),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let router = builder.add_service(service);
        let serving = runtime.spawn(async move {
            let incoming = crate::admission::incoming(listener, admission);
            if let Err(error) = router
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await
            {
                tracing::error!(%error, "the gRPC server stopped");
            }
        });
        tracing::info!(address = %local_addr, "listening for client processes");
        Ok(Self {
            shared,
            outcomes,
            local_addr,
            stop: Some(stop),
            serving: Some(serving),
            runtime: Some(runtime),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Blocks until `count` client processes have registered.
    pub fn wait_for_clients(&self, count: usize) -> anyhow::Result<()> {
        let timeout = self.shared.settings.registration_timeout;
        let started = Instant::now();
        while self.shared.registered.load(Ordering::SeqCst) < count {
            if started.elapsed() > timeout {
                bail!(
                    "only {} of {count} client processes registered within \
                     server.registration_timeout = {} s; start them with \
                     `cohort client --server {}`",
                    self.shared.registered.load(Ordering::SeqCst),
                    timeout.as_secs_f64(),
                    self.local_addr
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Client processes connected now.
    pub fn connected(&self) -> usize {
        self.shared.alive.load(Ordering::SeqCst)
    }
}

impl Transport for GrpcTransport {
    fn dispatch(
        &mut self,
        global_payload: Arc<Vec<u8>>,
        tasks: Vec<TaskSpec>,
    ) -> anyhow::Result<()> {
        {
            let mut queue = self
                .shared
                .queue
                .lock()
                .map_err(|_| anyhow::anyhow!("task queue poisoned"))?;
            queue.extend(tasks.into_iter().map(|spec| Job {
                spec,
                payload: Arc::clone(&global_payload),
            }));
        }
        self.shared.work.notify_waiters();
        Ok(())
    }

    fn next_outcome(&mut self) -> anyhow::Result<ClientOutcome> {
        let mut orphaned_since: Option<Instant> = None;
        loop {
            match self.outcomes.recv_timeout(Duration::from_millis(100)) {
                Ok(outcome) => return Ok(outcome),
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("the gRPC server stopped"),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            // Tasks wait in the queue with no process left to take them: give a
            // replacement the registration timeout to connect, then fail them.
            if self.shared.alive.load(Ordering::SeqCst) > 0 {
                orphaned_since = None;
                continue;
            }
            let since = *orphaned_since.get_or_insert_with(Instant::now);
            if since.elapsed() < self.shared.settings.registration_timeout {
                continue;
            }
            let orphans: Vec<Job> = self
                .shared
                .queue
                .lock()
                .map(|mut q| q.drain(..).collect())
                .unwrap_or_default();
            for job in orphans {
                self.shared.push_outcome(ClientOutcome {
                    slot: job.spec.slot,
                    task: job.spec.task,
                    worker: usize::MAX,
                    result: Err(format!(
                        "no client process was left to run it (none reconnected within \
                         server.registration_timeout = {} s)",
                        self.shared.settings.registration_timeout.as_secs_f64()
                    )),
                });
            }
            orphaned_since = None;
        }
    }

    fn cancel(&mut self) {
        if let Ok(mut queue) = self.shared.queue.lock() {
            queue.clear();
        }
    }
}

impl Drop for GrpcTransport {
    fn drop(&mut self) {
        self.shared.shutting_down.store(true, Ordering::SeqCst);
        self.shared.work.notify_waiters();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(runtime) = self.runtime.take() {
            // A graceful end: each worker stream finishes with an OK status and
            // the clients hang up. Shutting the runtime down at once would drop
            // the connections mid-stream, and clients would report a broken one.
            if let Some(serving) = self.serving.take() {
                runtime.block_on(async {
                    let _ = tokio::time::timeout(Duration::from_secs(10), serving).await;
                });
            }
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}
