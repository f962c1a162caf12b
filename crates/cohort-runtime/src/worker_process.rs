//! `cohort client`: a physical client worker process for network mode.
//!
//! It connects to a `cohort run` server, registers, receives the run's config,
//! loads its own copy of the data set and computes the same partitions the
//! server's config implies (partitioning is a pure function of the config),
//! then trains whichever logical client each task names until the server
//! closes the stream.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio_stream::wrappers::ReceiverStream;

use cohort_train::device::{self, DeviceRequest};
use cohort_train::trainer::ClientTask;

use crate::client::{ClientRunner, load_data};
use crate::grpc::proto::client_message::Kind as ClientKind;
use crate::grpc::proto::federation_client::FederationClient;
use crate::grpc::proto::server_message::Kind as ServerKind;
use crate::grpc::proto::{self, ClientMessage, ServerMessage};
use crate::grpc::{CHUNK_BYTES, PROTOCOL_VERSION};
use crate::transport::TaskInstructions;

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
        let pem = std::fs::read(ca)
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
        .build()?;
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

async fn work(options: &WorkerOptions) -> anyhow::Result<WorkerSummary> {
    let mut client = connect(options).await?;
    let (sender, receiver) = tokio::sync::mpsc::channel::<ClientMessage>(4);
    let name = format!(
        "{}:{}",
        std::env::var("HOSTNAME").unwrap_or_else(|_| "client".to_owned()),
        std::process::id()
    );
    // Queued before the call: the server answers only after reading it.
    sender
        .send(send(ClientKind::Register(proto::Register {
            token: options.token.clone().unwrap_or_default(),
            name,
            protocol: PROTOCOL_VERSION,
        })))
        .await?;
    let mut inbound = client
        .join(ReceiverStream::new(receiver))
        .await
        .map_err(|status| anyhow::anyhow!("the server refused this client: {}", status.message()))?
        .into_inner();
    let welcome = match next(&mut inbound).await? {
        Some(ServerKind::Welcome(welcome)) => welcome,
        _ => bail!("the server did not welcome this client"),
    };
    let loaded =
        cohort_core::config::from_str(&welcome.config_toml, Path::new("<config from the server>"))
            .context("the server's config does not load in this cohort build")?;
    let config = &loaded.config;
    let selected = device::select(options.device)?;
    let (splits, partitions) = load_data(&loaded, options.data_root.as_deref())?;
    let mut runner = ClientRunner::new(&loaded, &selected);
    let compute = rayon::ThreadPoolBuilder::new()
        .num_threads(config.trainer.threads_per_worker as usize)
        .build()?;
    let train = Arc::new(splits.train);
    let max_bytes = loaded
        .decode_limits()
        .max_bytes
        .min(options.max_payload_bytes);
    tracing::info!(
        worker = welcome.worker,
        device = selected.name,
        "registered; waiting for tasks"
    );

    let mut summary = WorkerSummary::default();
    loop {
        let task = match next(&mut inbound).await? {
            Some(ServerKind::Task(task)) => task,
            None => break,
            Some(_) => bail!("the server sent a message out of order"),
        };
        let payload =
            receive_bytes(&mut inbound, task.payload_bytes, max_bytes, "global model").await?;
        let correction = match task.correction_bytes {
            0 => None,
            bytes => Some(Arc::new(
                receive_bytes(&mut inbound, bytes, max_bytes, "gradient correction").await?,
            )),
        };
        let instructions = TaskInstructions {
            learning_rate: task.learning_rate,
            proximal_mu: task.proximal_mu,
            update_clip_norm: task.update_clip_norm,
            correction,
        };
        let index = (task.client_id as usize).checked_sub(1);
        let partition =
            index.and_then(|index| partitions.train.get(index).zip(partitions.test.get(index)));
        let Some((partition, held_out)) = partition else {
            bail!(
                "the server asked for client {}, which the config does not have",
                task.client_id
            );
        };
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
        let outcome = tokio::task::block_in_place(|| {
            compute
                .install(|| runner.run(job, &instructions, &payload, &train, partition, held_out))
        });
        summary.tasks += 1;
        match outcome {
            Ok(reply) => {
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
                    })))
                    .await?;
                for chunk in reply.payload.chunks(CHUNK_BYTES) {
                    sender
                        .send(send(ClientKind::Chunk(proto::Chunk {
                            data: chunk.to_vec(),
                        })))
                        .await?;
                }
            }
            Err(error) => {
                summary.failed += 1;
                tracing::warn!(client = task.client_id, round = task.round, "{error}");
                sender
                    .send(send(ClientKind::Failed(proto::TaskFailed {
                        client_id: task.client_id,
                        round: task.round,
                        reason: error.to_string(),
                    })))
                    .await?;
            }
        }
    }
    Ok(summary)
}

/// `announced` bytes sent as chunks, refusing more than `max_bytes` (the
/// config's `server.max_payload_bytes`) before allocating anything.
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
    let mut bytes = Vec::with_capacity(size);
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
