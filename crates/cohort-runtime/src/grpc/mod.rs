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
//!
//! **Own-data clients** (`clients.own_data_clients`, `cohort client --data`)
//! claim one logical id in 1..=own_data_clients when they register, with the
//! sample counts they hold. A claim is checked before it is accepted: the id
//! in range and held by no connected process, each count at least 1 (training)
//! and at most `clients.max_samples`. The tasks of a claimed id go to its
//! claimant's own queue, never to an ordinary worker process (which would
//! train it on a partition of the shared data set); a task for an id whose
//! claimant is not connected fails at once, and so do the queued tasks of a
//! claimant that leaves. Ordinary worker processes share the queue of every
//! other id, as before.

use std::collections::{BTreeMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::sync::Notify;
use tokio_stream::Stream;
use tonic::Status;

use crate::transport::{ClientOutcome, Declared, TaskSpec, Transport};

mod join;
mod secure;
mod serve;
mod wire;

use join::Service;
pub use secure::{stage_from, stage_of};

pub mod proto {
    tonic::include_proto!("cohort.v1");
}

use proto::ServerMessage;
use proto::server_message::Kind as ServerKind;

/// Bumped when the messages change incompatibly. 3: own-data registration
/// (an older server would take an own-data client for an ordinary worker).
/// 4: secure aggregation's stages (an older client would send its update in
/// the clear). 5: secure aggregation's masks from AES-128-CTR, no longer
/// ChaCha20 (the sum of a version-4 client's input would not unmask).
pub const PROTOCOL_VERSION: u32 = 5;
/// Payload bytes per chunk message: well under gRPC's 4 MiB default limit.
pub const CHUNK_BYTES: usize = 1 << 20;

/// `bytes` as payload chunks of at most [`CHUNK_BYTES`], each a slice of
/// it (no copy).
pub(crate) fn chunks(bytes: &bytes::Bytes) -> impl Iterator<Item = bytes::Bytes> + '_ {
    (0..bytes.len())
        .step_by(CHUNK_BYTES)
        .map(|start| bytes.slice(start..bytes.len().min(start + CHUNK_BYTES)))
}

/// Room held against `server.max_inflight_bytes` (in KiB permits).
type Room = tokio::sync::OwnedSemaphorePermit;
/// Longest `Register.name` accepted. The name is free text for the log, and
/// gRPC alone would let it be 4 MB: logged on every refusal and kept for
/// every registered process, that floods `run.log` and the server's memory
/// before any token is checked. `cohort client` truncates its own to fit.
pub const MAX_CLIENT_NAME_BYTES: usize = 256;
/// Largest TLS certificate or key file read: a PEM chain is kilobytes.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

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
    /// HTTP/2 flow-control window of each connection and stream; `None`:
    /// hyper's default.
    pub stream_window_bytes: Option<u32>,
    /// Limits on connections that have not (yet) registered.
    pub admission: crate::admission::Admission,
    pub own_data: OwnDataSettings,
}

/// Which logical clients bring their own data, and the bound on what they
/// may declare (`clients.own_data_clients`, `clients.max_samples`).
#[derive(Clone, PartialEq, Eq)]
pub struct OwnDataSettings {
    /// Logical clients `1..=clients` are own-data clients; 0: none.
    pub clients: u32,
    pub max_samples: u64,
    /// One token per own-data client (client `c` at index `c − 1`,
    /// `clients.own_data_token_file`); empty: a claim needs the run's token
    /// only, and any process holding it may claim any free id.
    pub tokens: Vec<String>,
}

impl std::fmt::Debug for OwnDataSettings {
    // The tokens are secrets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnDataSettings")
            .field("clients", &self.clients)
            .field("max_samples", &self.max_samples)
            .field("tokens", &format_args!("[{} hidden]", self.tokens.len()))
            .finish()
    }
}

impl Default for OwnDataSettings {
    fn default() -> Self {
        Self {
            clients: 0,
            max_samples: 100_000,
            tokens: Vec::new(),
        }
    }
}

/// How long a new stream may take to send its Register message.
const REGISTER_WITHIN: Duration = Duration::from_secs(10);

struct Job {
    spec: TaskSpec,
    /// The round's global model, shared by every task: its chunks go out as
    /// slices of it (`wire.rs`), never a copy per client.
    payload: bytes::Bytes,
}

/// Shared bytes (a round's global model, a correction) as the owner of a
/// [`bytes::Bytes`], so that slices of them need no copy.
struct SharedBytes(Arc<Vec<u8>>);

impl SharedBytes {
    fn bytes(bytes: Arc<Vec<u8>>) -> bytes::Bytes {
        bytes::Bytes::from_owner(Self(bytes))
    }
}

impl AsRef<[u8]> for SharedBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

/// Where a client process takes its tasks from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    /// An ordinary worker process: any logical client not an own-data one.
    Shared,
    /// The process that claimed this own-data client.
    Own(u32),
}

/// A connected own-data client.
struct Claim {
    worker: usize,
    jobs: VecDeque<Job>,
}

#[derive(Default)]
struct Queues {
    /// Tasks for ordinary worker processes.
    shared: VecDeque<Job>,
    /// Connected own-data clients by logical id, with their tasks.
    claims: BTreeMap<u32, Claim>,
    /// Who held each own-data id last (its peer address), so that an id
    /// served by another process mid-run is said loudly.
    held_by: BTreeMap<u32, String>,
}

struct Shared {
    settings: ServerSettings,
    queue: Mutex<Queues>,
    work: Notify,
    shutting_down: AtomicBool,
    /// Every registration so far (the next worker index).
    registered: AtomicUsize,
    /// Ordinary worker processes registered so far, and connected now.
    ordinary: AtomicUsize,
    alive: AtomicUsize,
    outcomes: Mutex<mpsc::Sender<(ClientOutcome, Option<Room>)>>,
    /// Room for uploads in flight, in KiB.
    inflight: Arc<tokio::sync::Semaphore>,
    /// Refusals of registrations, so that a peer retrying a wrong token (or
    /// anything else refused) cannot flood `run.log`.
    refusals: Mutex<crate::admission::RefusalsByPeer>,
    /// Each connected process's queue of secure-aggregation stage messages,
    /// by worker index.
    mailboxes: Mutex<BTreeMap<usize, tokio::sync::mpsc::UnboundedSender<secure::StageJob>>>,
}

/// Semaphore permits count KiB, so a u32 of them covers any payload.
fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

impl Shared {
    /// Counts a refused registration; `Some(refusals of this kind from this
    /// peer since its last line)` when this one is to be logged.
    fn refused(&self, peer: Option<IpAddr>, kind: &'static str) -> Option<u64> {
        self.refusals.lock().ok()?.due(peer, kind)
    }

    fn push_outcome(&self, outcome: ClientOutcome) {
        self.push_received(outcome, None);
    }

    /// An outcome with the room its update's bytes hold against
    /// `server.max_inflight_bytes`: the room is freed only once the round
    /// loop has taken the update in, so updates received faster than the
    /// loop unpacks them wait in the clients' uploads, not in memory.
    fn push_received(&self, outcome: ClientOutcome, room: Option<Room>) {
        if let Ok(sender) = self.outcomes.lock() {
            // The round loop may be gone already (run over); nothing to tell then.
            let _ = sender.send((outcome, room));
        }
    }

    async fn next_job(&self, lane: Lane) -> Option<Job> {
        loop {
            let notified = self.work.notified();
            tokio::pin!(notified);
            // Registered before looking at the queue, so a push in between wakes us.
            notified.as_mut().enable();
            if self.shutting_down.load(Ordering::SeqCst) {
                return None;
            }
            let job = {
                let mut queues = self.queue.lock().ok()?;
                match lane {
                    Lane::Shared => queues.shared.pop_front(),
                    Lane::Own(id) => queues.claims.get_mut(&id)?.jobs.pop_front(),
                }
            };
            if job.is_some() {
                return job;
            }
            notified.await;
        }
    }

    /// Checks an own-data registration and records the claim; the error is
    /// the refusal the client prints.
    fn claim(&self, own: &proto::OwnData, peer: &str) -> Result<(u32, usize, Declared), Status> {
        let settings = &self.settings.own_data;
        if settings.clients == 0 {
            return Err(Status::failed_precondition(
                "this run has no own-data clients (clients.own_data_clients = 0); start the \
                 client without --data to train partitions of the run's data set",
            ));
        }
        let bound = settings.max_samples;
        for (what, count, least) in [
            ("training", own.train_samples, 1),
            ("held-out", own.test_samples, 0),
        ] {
            if count < least || count > bound {
                return Err(Status::invalid_argument(format!(
                    "{count} {what} samples declared; this server accepts {least} to {bound} \
                     (clients.max_samples)"
                )));
            }
        }
        let mut queues = self
            .queue
            .lock()
            .map_err(|_| Status::internal("task queue poisoned"))?;
        let id = match own.client_id {
            0 => (1..=settings.clients)
                .find(|id| !queues.claims.contains_key(id))
                .ok_or_else(|| {
                    Status::resource_exhausted(format!(
                        "all {} own-data client ids are held by connected processes",
                        settings.clients
                    ))
                })?,
            id if id > settings.clients => {
                return Err(Status::invalid_argument(format!(
                    "client id {id} is not an own-data client of this run: ids are 1 to {} \
                     (clients.own_data_clients)",
                    settings.clients
                )));
            }
            id if queues.claims.contains_key(&id) => {
                return Err(Status::already_exists(format!(
                    "client id {id} is already held by another connected process"
                )));
            }
            id => id,
        };
        let worker = self.registered.fetch_add(1, Ordering::SeqCst);
        let declared = Declared {
            train_samples: own.train_samples,
            test_samples: own.test_samples,
        };
        queues.claims.insert(
            id,
            Claim {
                worker,
                jobs: VecDeque::new(),
            },
        );
        if let Some(before) = queues.held_by.insert(id, peer.to_owned()) {
            tracing::warn!(
                client = id,
                now = %peer,
                before = %before,
                "own-data client {id} is claimed again, by another process: its updates from \
                 here on come from {peer} (before: {before})"
            );
        }
        Ok((id, worker, declared))
    }

    /// Ends a claim when its process leaves; its queued tasks fail.
    fn release(&self, id: u32, worker: usize) {
        let jobs = match self.queue.lock() {
            Ok(mut queues) if queues.claims.get(&id).is_some_and(|c| c.worker == worker) => queues
                .claims
                .remove(&id)
                .map(|c| c.jobs)
                .unwrap_or_default(),
            _ => VecDeque::new(),
        };
        for job in jobs {
            self.push_outcome(ClientOutcome {
                slot: job.spec.slot,
                task: job.spec.task,
                worker,
                result: Err(format!(
                    "own-data client {id} disconnected before its task started"
                )),
            });
        }
    }
}

type ServerStream = Pin<Box<dyn Stream<Item = Result<ServerMessage, Status>> + Send>>;

fn message(kind: ServerKind) -> Result<ServerMessage, Status> {
    Ok(ServerMessage { kind: Some(kind) })
}

/// tonic's server with cohort's HTTP/2 settings, over TLS when given a
/// certificate and key.
fn server_builder(
    tls: Option<&(PathBuf, PathBuf)>,
    window: Option<u32>,
) -> anyhow::Result<tonic::transport::Server> {
    // Pings find peers that vanished without closing; a client needs one
    // stream, so a few per connection are plenty. A window bounds what an
    // upload waiting for room holds in the server's buffers: the connection
    // gets the same, since a client sends on one stream at a time.
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .max_concurrent_streams(Some(4))
        .initial_stream_window_size(window)
        .initial_connection_window_size(window);
    if let Some((cert, key)) = tls {
        let read = |path: &PathBuf, what: &str| {
            cohort_core::fsutil::read_bounded(path, MAX_PEM_BYTES).with_context(|| {
                format!(
                    "cannot read the TLS {what} {} (server.tls_{what})",
                    path.display()
                )
            })
        };
        let identity = tonic::transport::Identity::from_pem(read(cert, "cert")?, read(key, "key")?);
        builder = builder
            .tls_config(
                tonic::transport::ServerTlsConfig::new()
                    .identity(identity)
                    .timeout(Duration::from_secs(10)),
            )
            .context("invalid TLS certificate or key (server.tls_cert / server.tls_key)")?;
    }
    Ok(builder)
}

/// The server side of the network transport.
pub struct GrpcTransport {
    shared: Arc<Shared>,
    outcomes: mpsc::Receiver<(ClientOutcome, Option<Room>)>,
    /// The room of the outcome handed out last, freed when the loop asks
    /// for the next one: by then it has unpacked, checked and kept (or
    /// spilled) that update.
    handed: Option<Room>,
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
            .build()
            .context("cannot start the gRPC server's threads")?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(settings.bind))
            .with_context(|| {
                format!(
                    "cannot listen on {} (server.address / server.port)",
                    settings.bind
                )
            })?;
        let local_addr = listener.local_addr()?;
        let mut builder = server_builder(settings.tls.as_ref(), settings.stream_window_bytes)?;
        let admission = settings.admission;
        // One largest update must always fit, or its client would wait forever.
        let room = settings.max_inflight_bytes.max(settings.max_payload_bytes);
        let inflight = Arc::new(tokio::sync::Semaphore::new(kib(room) as usize));
        let (outcome_sender, outcomes) = mpsc::channel();
        let shared = Arc::new(Shared {
            settings,
            queue: Mutex::new(Queues::default()),
            work: Notify::new(),
            shutting_down: AtomicBool::new(false),
            registered: AtomicUsize::new(0),
            ordinary: AtomicUsize::new(0),
            alive: AtomicUsize::new(0),
            outcomes: Mutex::new(outcome_sender),
            inflight,
            refusals: Mutex::default(),
            mailboxes: Mutex::default(),
        });
        let service = wire::JoinRoute {
            service: Arc::new(Service {
                shared: Arc::clone(&shared),
            }),
        };
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
            handed: None,
            local_addr,
            stop: Some(stop),
            serving: Some(serving),
            runtime: Some(runtime),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Blocks until `count` ordinary worker processes have registered and
    /// every own-data client has claimed its id.
    pub fn wait_for_clients(&self, count: usize) -> anyhow::Result<()> {
        self.wait_for_clients_with(count, &mut |_| {})
    }

    /// [`Self::wait_for_clients`], telling `progress` of each change in who
    /// is registered (first with the state when the wait begins).
    pub fn wait_for_clients_with(
        &self,
        count: usize,
        progress: &mut dyn FnMut(Waiting),
    ) -> anyhow::Result<()> {
        let timeout = self.shared.settings.registration_timeout;
        let started = Instant::now();
        let mut last = None;
        loop {
            let ordinary = self.shared.ordinary.load(Ordering::SeqCst);
            let unclaimed = self.unclaimed();
            let waiting = Waiting {
                processes: ordinary,
                expected: count,
                own_data_missing: unclaimed.len(),
            };
            if last != Some(waiting) {
                progress(waiting);
                last = Some(waiting);
            }
            if ordinary >= count && unclaimed.is_empty() {
                return Ok(());
            }
            if started.elapsed() > timeout {
                let seconds = timeout.as_secs_f64();
                if ordinary < count {
                    bail!(
                        "only {ordinary} of {count} client processes registered within \
                         server.registration_timeout = {seconds} s; start them with \
                         `cohort client --server {}`",
                        self.local_addr
                    );
                }
                bail!(
                    "own-data clients {unclaimed:?} did not register within \
                     server.registration_timeout = {seconds} s; start each with \
                     `cohort client --server {} --data PATH --client-id ID`",
                    self.local_addr
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Own-data client ids no connected process holds.
    fn unclaimed(&self) -> Vec<u32> {
        let claims = self
            .shared
            .queue
            .lock()
            .map(|q| q.claims.keys().copied().collect::<Vec<_>>())
            .unwrap_or_default();
        (1..=self.shared.settings.own_data.clients)
            .filter(|id| claims.binary_search(id).is_err())
            .collect()
    }

    /// Client processes connected now.
    pub fn connected(&self) -> usize {
        let claims = self.shared.queue.lock().map_or(0, |q| q.claims.len());
        self.shared.alive.load(Ordering::SeqCst) + claims
    }
}

/// Who has registered while a server waits for its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    /// Ordinary client processes registered so far.
    pub processes: usize,
    /// Ordinary client processes the server waits for.
    pub expected: usize,
    /// Own-data clients that no process has claimed yet.
    pub own_data_missing: usize,
}

impl Transport for GrpcTransport {
    fn dispatch(
        &mut self,
        global_payload: Arc<Vec<u8>>,
        tasks: Vec<TaskSpec>,
    ) -> anyhow::Result<()> {
        let own_data = self.shared.settings.own_data.clients;
        let global_payload = SharedBytes::bytes(global_payload);
        let mut absent = Vec::new();
        {
            let mut queues = self
                .shared
                .queue
                .lock()
                .map_err(|_| anyhow::anyhow!("task queue poisoned"))?;
            for spec in tasks {
                let id = spec.task.client_id;
                let job = Job {
                    spec,
                    payload: global_payload.clone(),
                };
                if id == 0 || id > own_data {
                    queues.shared.push_back(job);
                } else if let Some(claim) = queues.claims.get_mut(&id) {
                    claim.jobs.push_back(job);
                } else {
                    absent.push(job);
                }
            }
        }
        self.shared.work.notify_waiters();
        for job in absent {
            let id = job.spec.task.client_id;
            self.shared.push_outcome(ClientOutcome {
                slot: job.spec.slot,
                task: job.spec.task,
                worker: usize::MAX,
                result: Err(format!(
                    "own-data client {id} is not connected (no `cohort client --data` process holds it)"
                )),
            });
        }
        Ok(())
    }

    fn next_outcome(&mut self) -> anyhow::Result<ClientOutcome> {
        self.handed = None;
        let mut orphaned_since: Option<Instant> = None;
        loop {
            match self.outcomes.recv_timeout(Duration::from_millis(100)) {
                Ok((outcome, room)) => {
                    self.handed = room;
                    return Ok(outcome);
                }
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
                .map(|mut q| q.shared.drain(..).collect())
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

    fn secure_stage(
        &mut self,
        round: u32,
        stage: cohort_core::secagg::sim::Stage,
        messages: Vec<crate::transport::StageMessage>,
        bounds: crate::transport::StageBounds,
    ) -> anyhow::Result<crate::transport::StageAnswers> {
        let runtime = self
            .runtime
            .as_ref()
            .context("the gRPC server has stopped")?;
        Ok(runtime.block_on(secure::exchange(
            &self.shared,
            round,
            stage,
            messages,
            bounds,
        )))
    }

    fn cancel(&mut self) {
        if let Ok(mut queues) = self.shared.queue.lock() {
            queues.shared.clear();
            queues
                .claims
                .values_mut()
                .for_each(|claim| claim.jobs.clear());
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
