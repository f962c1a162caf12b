//! Serving one registered client process: its tasks one at a time (the
//! global model and the instructions out in chunks, the update back within
//! `server.payload_timeout`, bounded by the announced size and the room in
//! flight), until it leaves or breaks.

use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use cohort_train::trainer::ClientTask;
use tonic::{Status, Streaming};

use super::proto::client_message::Kind as ClientKind;
use super::proto::server_message::Kind as ServerKind;
use super::proto::{self, ClientMessage, ServerMessage};
use super::{CHUNK_BYTES, Job, Lane, Room, Shared, SharedBytes, chunks, kib, message};
use crate::client::ClientReply;
use crate::transport::{ClientOutcome, Declared, Delivered, MAX_REASON_BYTES, truncated};

/// Why a task did not come back.
pub(super) enum TaskError {
    /// The client said so and can take further tasks.
    Failed(String),
    /// The connection is unusable; the worker is dropped.
    Broken(String),
}

/// A registered client process, as the server serves it.
pub(super) struct Process {
    pub(super) worker: usize,
    /// Free text from its Register message, for the log; at most
    /// [`super::MAX_CLIENT_NAME_BYTES`].
    pub(super) name: String,
    pub(super) lane: Lane,
    pub(super) declared: Option<Declared>,
}

pub(super) async fn serve_worker(
    shared: &Shared,
    process: &Process,
    mut inbound: Streaming<ClientMessage>,
    sender: tokio::sync::mpsc::Sender<Result<ServerMessage, Status>>,
) {
    let (worker, name) = (process.worker, &process.name);
    let mut mailbox = super::secure::Mailbox::open(shared, worker);
    loop {
        // An idle client that leaves is noticed now, not when a task it would
        // have lost is handed to it.
        let job = tokio::select! {
            job = shared.next_job(process.lane) => job,
            Some(stage) = mailbox.jobs.recv() => {
                if super::secure::serve_stage(&sender, &mut inbound, stage).await {
                    continue;
                }
                tracing::warn!(worker, process = name, "client process cut off in a secure-aggregation stage");
                None
            }
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
        let mut room = None;
        let (result, keep_worker) = match attempt {
            Ok(Ok((reply, transfer, held))) => {
                room = Some(held);
                let comm_time = transfer.comm_time(started.elapsed().as_secs_f64());
                let declared = process.declared;
                (
                    Ok(Delivered {
                        reply,
                        comm_time,
                        declared,
                    }),
                    true,
                )
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
        shared.push_received(
            ClientOutcome {
                slot: job.spec.slot,
                task,
                worker,
                result,
            },
            room,
        );
        if !keep_worker {
            break;
        }
    }
}

/// How long a task's payloads took to cross the network: the download as
/// the client measured it, the upload as the server did.
struct Transfer {
    /// Seconds, from the client's report: a peer's number, bounded before use.
    download: f64,
    /// Seconds from the report's arrival to the update's last chunk.
    upload: f64,
}

impl Transfer {
    /// `clients.csv`'s comm_time: download plus upload, never more than the
    /// whole task took (`elapsed`), and a client's non-finite or negative
    /// figure counted as 0.
    fn comm_time(&self, elapsed: f64) -> f64 {
        let download = if self.download.is_finite() {
            self.download.max(0.0)
        } else {
            0.0
        };
        (download + self.upload).min(elapsed).max(0.0)
    }
}

/// One task: sent, answered, its update received.
async fn run_task(
    shared: &Shared,
    sender: &tokio::sync::mpsc::Sender<Result<ServerMessage, Status>>,
    inbound: &mut Streaming<ClientMessage>,
    job: &Job,
) -> Result<(ClientReply, Transfer, Room), TaskError> {
    send_task(sender, job).await?;
    let report = answer(inbound, job.spec.task).await?;
    let upload_started = Instant::now();
    let (payload, room) = receive_update(shared, inbound, &report).await?;
    let transfer = Transfer {
        download: report.download_time,
        upload: upload_started.elapsed().as_secs_f64(),
    };
    let reply = ClientReply {
        num_samples: report.num_samples,
        loss: report.loss,
        training_time: report.training_time,
        processing_time: report.processing_time,
        local_steps: report.local_steps,
        test_samples: report.test_samples,
        test_correct: report.test_correct.min(report.test_samples),
        payload,
        packed_from: None,
        unwritten_len: None,
    };
    Ok((reply, transfer, room))
}

fn gone() -> TaskError {
    TaskError::Broken("the client process disconnected".to_owned())
}

/// The Task message, then the global model and the strategy's correction
/// in chunks.
async fn send_task(
    sender: &tokio::sync::mpsc::Sender<Result<ServerMessage, Status>>,
    job: &Job,
) -> Result<(), TaskError> {
    let ClientTask { client_id, round } = job.spec.task;
    let instructions = &job.spec.instructions;
    let correction = instructions
        .correction
        .clone()
        .map_or_else(Bytes::new, SharedBytes::bytes);
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
    // Slices of the shared model (and of the client's correction): the
    // bytes go out uncopied (`wire.rs`).
    for data in chunks(&job.payload).chain(chunks(&correction)) {
        sender
            .send(message(ServerKind::Chunk(proto::Chunk { data })))
            .await
            .map_err(|_| gone())?;
    }
    Ok(())
}

/// The client's answer to `task`: its report, or the failure it names
/// (its reason cut to [`MAX_REASON_BYTES`] on arrival).
async fn answer(
    inbound: &mut Streaming<ClientMessage>,
    task: ClientTask,
) -> Result<proto::Report, TaskError> {
    let ClientTask { client_id, round } = task;
    let report = match next_message(inbound).await? {
        ClientKind::Report(report) => report,
        ClientKind::Failed(failed) if failed.client_id == client_id && failed.round == round => {
            let reason = truncated(&failed.reason, MAX_REASON_BYTES);
            let cut = if reason.len() < failed.reason.len() {
                format!(" … ({} bytes in all)", failed.reason.len())
            } else {
                String::new()
            };
            return Err(TaskError::Failed(format!(
                "the client's training failed: {reason}{cut}"
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
    Ok(report)
}

/// The update `report` announces, within `server.max_payload_bytes` and
/// the room in flight, with that room: it stays taken until the round loop
/// has taken the update in.
async fn receive_update(
    shared: &Shared,
    inbound: &mut Streaming<ClientMessage>,
    report: &proto::Report,
) -> Result<(Bytes, Room), TaskError> {
    let size = usize::try_from(report.payload_bytes).unwrap_or(usize::MAX);
    if size > shared.settings.max_payload_bytes {
        return Err(malformed(&format!(
            "update of {} bytes exceeds server.max_payload_bytes = {}",
            report.payload_bytes, shared.settings.max_payload_bytes
        )));
    }
    // Room is reserved for the announced size before anything is buffered,
    // and the buffer grows only as bytes arrive.
    let room = Arc::clone(&shared.inflight)
        .acquire_many_owned(kib(size))
        .await
        .map_err(|_| TaskError::Broken("the server is stopping".to_owned()))?;
    let mut payload = Received::default();
    while payload.len() < size {
        match next_message(inbound).await? {
            ClientKind::Chunk(chunk) if payload.len() + chunk.data.len() <= size => {
                payload.push(chunk.data, size)
            }
            ClientKind::Chunk(_) => return Err(malformed("more payload bytes than announced")),
            _ => return Err(malformed("the update payload ended early")),
        }
    }
    Ok((payload.into_bytes(), room))
}

/// An update's bytes as they arrive. A chunk is a slice of the buffer tonic
/// decoded its message in, so an update of one chunk (any update up to
/// [`CHUNK_BYTES`]) is kept as that slice, with no copy beside tonic's; a
/// longer one is gathered into one buffer, which grows only as bytes arrive.
#[derive(Default)]
enum Received {
    #[default]
    Nothing,
    One(Bytes),
    Gathered(BytesMut),
}

impl Received {
    fn len(&self) -> usize {
        match self {
            Self::Nothing => 0,
            Self::One(bytes) => bytes.len(),
            Self::Gathered(bytes) => bytes.len(),
        }
    }

    /// Appends `chunk` to an update announced as `size` bytes.
    fn push(&mut self, chunk: Bytes, size: usize) {
        *self = match std::mem::take(self) {
            Self::Nothing => Self::One(chunk),
            Self::One(first) => {
                let mut gathered = BytesMut::with_capacity(size.min(4 * CHUNK_BYTES));
                gathered.extend_from_slice(&first);
                gathered.extend_from_slice(&chunk);
                Self::Gathered(gathered)
            }
            Self::Gathered(mut gathered) => {
                gathered.extend_from_slice(&chunk);
                Self::Gathered(gathered)
            }
        };
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Self::Nothing => Bytes::new(),
            Self::One(bytes) => bytes,
            Self::Gathered(bytes) => bytes.freeze(),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::{Bytes, CHUNK_BYTES, Received, Transfer};

    #[test]
    fn an_update_of_one_chunk_is_kept_as_that_chunk() {
        let decoded = Bytes::from(vec![7u8; 1000]);
        let mut received = Received::default();
        received.push(decoded.slice(10..990), 980);
        let kept = received.into_bytes();
        // The memory tonic decoded the message in, not a copy of it.
        assert_eq!(kept.as_ptr(), decoded[10..].as_ptr());
        assert_eq!(kept.len(), 980);
    }

    #[test]
    fn an_update_of_several_chunks_is_gathered_in_order() {
        let size = 2 * CHUNK_BYTES + 3;
        let mut received = Received::default();
        for (byte, len) in [(1u8, CHUNK_BYTES), (2, CHUNK_BYTES), (3, 3)] {
            received.push(Bytes::from(vec![byte; len]), size);
        }
        assert_eq!(received.len(), size);
        let kept = received.into_bytes();
        assert_eq!(kept[0], 1);
        assert_eq!(kept[CHUNK_BYTES], 2);
        assert_eq!(kept[2 * CHUNK_BYTES..], [3, 3, 3]);
        assert!(Received::default().into_bytes().is_empty());
    }

    #[test]
    fn comm_time_is_download_plus_upload_bounded_by_the_task() {
        let transfer = |download| Transfer {
            download,
            upload: 0.25,
        };
        assert_eq!(transfer(0.5).comm_time(10.0), 0.75);
        // A client's figure is not trusted beyond the task's own length.
        assert_eq!(transfer(1e9).comm_time(2.0), 2.0);
        assert_eq!(transfer(f64::NAN).comm_time(2.0), 0.25);
        assert_eq!(transfer(-5.0).comm_time(2.0), 0.25);
        assert_eq!(transfer(f64::INFINITY).comm_time(2.0), 0.25);
    }
}
