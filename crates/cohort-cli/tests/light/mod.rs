//! Light protocol clients: tokio tasks that speak the real gRPC protocol
//! (the `.proto`'s messages, chunked payloads) without training, for the
//! load test and the many-clients benchmark.

use cohort_runtime::grpc::proto::client_message::Kind;
use cohort_runtime::grpc::proto::federation_client::FederationClient;
use cohort_runtime::grpc::proto::server_message::Kind as ServerKind;
use cohort_runtime::grpc::proto::{self, ClientMessage, ServerMessage};
use cohort_runtime::grpc::{CHUNK_BYTES, PROTOCOL_VERSION};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// One registered stream to the server.
pub struct Session {
    pub sender: mpsc::Sender<ClientMessage>,
    pub inbound: tonic::Streaming<ServerMessage>,
}

/// Registers as `name`; `None` when the server cannot be reached or refuses.
pub async fn join(address: &str, name: &str) -> Option<Session> {
    let mut client = FederationClient::connect(format!("http://{address}"))
        .await
        .ok()?;
    let (sender, receiver) = mpsc::channel(8);
    let register = Kind::Register(proto::Register {
        token: String::new(),
        name: name.to_owned(),
        protocol: PROTOCOL_VERSION,
        own_data: None,
    });
    sender
        .send(ClientMessage {
            kind: Some(register),
        })
        .await
        .ok()?;
    let inbound = client
        .join(ReceiverStream::new(receiver))
        .await
        .ok()?
        .into_inner();
    Some(Session { sender, inbound })
}

/// The next task with its whole payload; `None` when the stream ends.
pub async fn next_task(
    inbound: &mut tonic::Streaming<ServerMessage>,
) -> Option<(proto::Task, Vec<u8>)> {
    let mut task: Option<proto::Task> = None;
    let mut payload = Vec::new();
    loop {
        if let Some(t) = &task
            && payload.len() as u64 >= t.payload_bytes + t.correction_bytes
        {
            return task.map(|t| (t, payload));
        }
        match inbound.message().await.ok()??.kind {
            Some(ServerKind::Task(t)) => {
                task = Some(t);
                payload.clear();
            }
            Some(ServerKind::Chunk(chunk)) => payload.extend_from_slice(&chunk.data),
            _ => {}
        }
    }
}

/// The report, then the payload in the protocol's chunks.
pub async fn send_update(
    sender: &mpsc::Sender<ClientMessage>,
    report: proto::Report,
    payload: &[u8],
) {
    let _ = sender
        .send(ClientMessage {
            kind: Some(Kind::Report(report)),
        })
        .await;
    for chunk in payload.chunks(CHUNK_BYTES) {
        let chunk = Kind::Chunk(proto::Chunk {
            data: chunk.to_vec().into(),
        });
        let _ = sender.send(ClientMessage { kind: Some(chunk) }).await;
    }
}
