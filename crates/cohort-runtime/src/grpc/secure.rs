//! Secure aggregation's stages over the client streams: the round loop
//! hands a stage's messages to [`exchange`], which puts each in the mailbox
//! of the process that trained its client; that process's serving task
//! ([`serve_stage`]) sends it and reads the answer, bounded in time (the
//! stage's deadline, `secure_aggregation.timeout`) and in size (announced
//! before any byte is buffered, at most what the stage can honestly need).
//!
//! A process that breaks the stream, sends something else or is late is cut
//! off, as a task that breaks is: its clients' answers are errors, and the
//! protocol takes them as dropped at that stage.

use cohort_core::secagg::sim::Stage;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tonic::{Status, Streaming};

use super::proto::client_message::Kind as ClientKind;
use super::proto::server_message::Kind as ServerKind;
use super::proto::{self, ClientMessage, SecAggStage, ServerMessage};
use super::{CHUNK_BYTES, Shared, message};
use crate::transport::{MAX_REASON_BYTES, StageAnswers, StageBounds, StageMessage, truncated};

/// One stage message waiting for a process.
pub(super) struct StageJob {
    request: proto::SecAggRequest,
    max_answer_bytes: usize,
    deadline: Instant,
    reply: oneshot::Sender<Result<Vec<u8>, String>>,
}

/// The proto's name of a stage.
pub fn stage_of(stage: Stage) -> SecAggStage {
    match stage {
        Stage::AdvertiseKeys => SecAggStage::Setup,
        Stage::ShareKeys => SecAggStage::ShareKeys,
        Stage::MaskedInput => SecAggStage::CollectMaskedInput,
        Stage::Unmask => SecAggStage::Unmask,
    }
}

/// The stage a proto value names; `None` for the unspecified or unknown.
pub fn stage_from(value: i32) -> Option<Stage> {
    match SecAggStage::try_from(value).ok()? {
        SecAggStage::Setup => Some(Stage::AdvertiseKeys),
        SecAggStage::ShareKeys => Some(Stage::ShareKeys),
        SecAggStage::CollectMaskedInput => Some(Stage::MaskedInput),
        SecAggStage::Unmask => Some(Stage::Unmask),
        SecAggStage::Unspecified => None,
    }
}

/// Sends every message to its process and waits for all answers until the
/// stage's deadline.
pub(super) async fn exchange(
    shared: &Shared,
    round: u32,
    stage: Stage,
    messages: Vec<StageMessage>,
    bounds: StageBounds,
) -> StageAnswers {
    let deadline = Instant::now() + bounds.timeout;
    let mut waiting = Vec::with_capacity(messages.len());
    let mut answers = Vec::with_capacity(messages.len());
    for m in messages {
        if m.body.len() > CHUNK_BYTES {
            answers.push((
                m.client_id,
                Err("its stage message is too long to send".into()),
            ));
            continue;
        }
        let (reply, answer) = oneshot::channel();
        let job = StageJob {
            request: proto::SecAggRequest {
                round,
                client_id: m.client_id,
                stage: stage_of(stage) as i32,
                body: m.body,
            },
            max_answer_bytes: bounds.max_answer_bytes,
            deadline,
            reply,
        };
        let mailbox = shared
            .mailboxes
            .lock()
            .ok()
            .and_then(|boxes| boxes.get(&m.worker).cloned());
        match mailbox.map(|mailbox| mailbox.send(job)) {
            Some(Ok(())) => waiting.push((m.client_id, answer)),
            _ => answers.push((
                m.client_id,
                Err("the client process that trained it is no longer connected".into()),
            )),
        }
    }
    for (client, answer) in waiting {
        let result = match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err("its client process left".to_owned()),
            Err(_) => Err(format!(
                "no answer within secure_aggregation.timeout = {} s",
                bounds.timeout.as_secs_f64()
            )),
        };
        answers.push((client, result));
    }
    answers
}

/// A process's mailbox, registered for as long as it is served.
pub(super) struct Mailbox<'a> {
    shared: &'a Shared,
    worker: usize,
    pub(super) jobs: tokio::sync::mpsc::UnboundedReceiver<StageJob>,
}

impl<'a> Mailbox<'a> {
    pub(super) fn open(shared: &'a Shared, worker: usize) -> Self {
        let (sender, jobs) = tokio::sync::mpsc::unbounded_channel();
        if let Ok(mut boxes) = shared.mailboxes.lock() {
            boxes.insert(worker, sender);
        }
        Self {
            shared,
            worker,
            jobs,
        }
    }
}

impl Drop for Mailbox<'_> {
    fn drop(&mut self) {
        if let Ok(mut boxes) = self.shared.mailboxes.lock() {
            boxes.remove(&self.worker);
        }
    }
}

/// Serves one stage message to the process; `false` when the process is
/// to be cut off (broken, late, or off the protocol).
pub(super) async fn serve_stage(
    sender: &tokio::sync::mpsc::Sender<Result<ServerMessage, Status>>,
    inbound: &mut Streaming<ClientMessage>,
    job: StageJob,
) -> bool {
    let StageJob {
        request,
        max_answer_bytes,
        deadline,
        reply,
    } = job;
    let outcome = tokio::time::timeout_at(deadline, async {
        sender
            .send(message(ServerKind::Secagg(request.clone())))
            .await
            .map_err(|_| Broken("the client process disconnected".to_owned()))?;
        receive_answer(inbound, &request, max_answer_bytes).await
    })
    .await;
    let (result, keep) = match outcome {
        Ok(Ok(answer)) => (answer, true),
        Ok(Err(Broken(reason))) => (Err(reason), false),
        Err(_) => (
            Err("no answer before the stage's deadline".to_owned()),
            false,
        ),
    };
    let _ = reply.send(result);
    keep
}

struct Broken(String);

/// The answer to `request`: its body, or the client's refusal (cut to
/// [`MAX_REASON_BYTES`]).
async fn receive_answer(
    inbound: &mut Streaming<ClientMessage>,
    request: &proto::SecAggRequest,
    max_bytes: usize,
) -> Result<Result<Vec<u8>, String>, Broken> {
    let answer = match next(inbound).await? {
        ClientKind::Secagg(answer) => answer,
        _ => return Err(malformed("expected a secure-aggregation answer")),
    };
    if (answer.round, answer.client_id, answer.stage)
        != (request.round, request.client_id, request.stage)
    {
        return Err(malformed(&format!(
            "answer for client {} round {} stage {}, but the request was client {} round {} \
             stage {}",
            answer.client_id,
            answer.round,
            answer.stage,
            request.client_id,
            request.round,
            request.stage
        )));
    }
    if !answer.refused.is_empty() {
        let reason = truncated(&answer.refused, MAX_REASON_BYTES);
        return Ok(Err(format!("the client refused: {reason}")));
    }
    let size = usize::try_from(answer.body_bytes).unwrap_or(usize::MAX);
    if size > max_bytes {
        return Err(malformed(&format!(
            "an answer of {} bytes; this stage's answers are at most {max_bytes}",
            answer.body_bytes
        )));
    }
    let mut body = Vec::with_capacity(size.min(CHUNK_BYTES));
    while body.len() < size {
        match next(inbound).await? {
            ClientKind::Chunk(chunk) if body.len() + chunk.data.len() <= size => {
                body.extend_from_slice(&chunk.data)
            }
            ClientKind::Chunk(_) => return Err(malformed("more answer bytes than announced")),
            _ => return Err(malformed("the answer ended early")),
        }
    }
    Ok(Ok(body))
}

fn malformed(what: &str) -> Broken {
    Broken(format!("malformed message from the client: {what}"))
}

async fn next(inbound: &mut Streaming<ClientMessage>) -> Result<ClientKind, Broken> {
    match inbound.message().await {
        Ok(Some(ClientMessage { kind: Some(kind) })) => Ok(kind),
        Ok(Some(ClientMessage { kind: None })) => Err(malformed("empty message")),
        Ok(None) => Err(Broken(
            "the client process closed the connection".to_owned(),
        )),
        Err(status) => Err(Broken(format!(
            "the connection to the client process broke: {}",
            status.message()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_has_one_proto_value_and_back() {
        let stages = [
            Stage::AdvertiseKeys,
            Stage::ShareKeys,
            Stage::MaskedInput,
            Stage::Unmask,
        ];
        for stage in stages {
            assert_eq!(stage_from(stage_of(stage) as i32), Some(stage));
        }
        let values: std::collections::BTreeSet<i32> =
            stages.iter().map(|&s| stage_of(s) as i32).collect();
        assert_eq!(values.len(), stages.len());
        // A peer's unspecified or unknown value names no stage.
        for value in [0, 5, -1, i32::MAX] {
            assert_eq!(stage_from(value), None, "{value}");
        }
    }

    #[test]
    fn an_answer_round_trips_through_its_proto_encoding() {
        use prost::Message as _;
        let answer = proto::SecAggAnswer {
            round: 3,
            client_id: 7,
            stage: SecAggStage::Unmask as i32,
            body_bytes: 1 << 20,
            refused: "the server asks for both shares".into(),
        };
        let bytes = answer.encode_to_vec();
        assert_eq!(proto::SecAggAnswer::decode(&bytes[..]).unwrap(), answer);
        let request = proto::SecAggRequest {
            round: 3,
            client_id: 7,
            stage: SecAggStage::Setup as i32,
            body: vec![8; 57],
        };
        let bytes = request.encode_to_vec();
        assert_eq!(proto::SecAggRequest::decode(&bytes[..]).unwrap(), request);
    }
}
