//! `Federation.Join` as HTTP, served without tonic's per-message copy of
//! what goes out.
//!
//! tonic's generated server encodes every outgoing message into a buffer of
//! its own stream: with a thousand clients being sent their task at once, a
//! thousand copies of the global model wait there for their connections.
//! This route takes tonic's place for the one method: the inbound side is
//! tonic's own decoder ([`Streaming`]), the handler is [`Federation::join`]
//! as before, and each outgoing [`ServerMessage`] becomes gRPC's frame
//! header and the message's protobuf bytes, where a [`proto::Chunk`]'s data
//! goes out as the [`Bytes`] it holds (a slice of the one shared global
//! model, [`super::Job`]), never copied per client. The bytes on the wire
//! are those prost writes for the same message (the tests below hold the
//! two equal), so clients of any language see no difference.
//!
//! What tonic's server did besides, and this route does too: the response's
//! `content-type`, its trailers (`grpc-status` 0 at the stream's end, the
//! status of an error), a trailers-only response for a call refused before
//! its stream starts, `Unimplemented` for another method, and tonic's 4 MiB
//! limit on a received message. Compression is refused, as it was: no
//! encoding is accepted.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http_body::Frame;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
use tonic::codec::Codec;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::{Code, Status, Streaming};

use super::ServerStream;
use super::join;
use super::proto::federation_server::Federation;
use super::proto::server_message::Kind as ServerKind;
use super::proto::{ClientMessage, ServerMessage};

/// The method's path, as the generated server routes it.
const JOIN_PATH: &str = "/cohort.v1.Federation/Join";
/// Largest message decoded from a client: tonic's default.
const MAX_RECEIVED_MESSAGE: usize = 4 << 20;
/// gRPC's frame header: a compression flag and the message's length.
const FRAME_HEADER: usize = 5;
/// `ServerMessage.chunk` and `Chunk.data` (cohort.proto).
const SERVER_CHUNK_FIELD: u32 = 3;
const CHUNK_DATA_FIELD: u32 = 1;

/// The Join service as tonic's router takes it.
#[derive(Clone)]
pub(super) struct JoinRoute {
    pub(super) service: Arc<join::Service>,
}

impl tonic::server::NamedService for JoinRoute {
    const NAME: &'static str = "cohort.v1.Federation";
}

impl Service<http::Request<tonic::body::Body>> for JoinRoute {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let service = Arc::clone(&self.service);
        Box::pin(async move { Ok(respond(&service, request).await) })
    }
}

async fn respond(
    service: &join::Service,
    request: http::Request<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    if request.uri().path() != JOIN_PATH {
        return Status::unimplemented(format!("no method {}", request.uri().path())).into_http();
    }
    if let Some(encoding) = request.headers().get("grpc-encoding")
        && encoding != "identity"
    {
        return Status::unimplemented(format!(
            "message compression {encoding:?} is not supported by this server"
        ))
        .into_http();
    }
    let request = request.map(|body| {
        Streaming::new_request(
            tonic_prost::ProstCodec::<ServerMessage, ClientMessage>::default().decoder(),
            body,
            None,
            Some(MAX_RECEIVED_MESSAGE),
        )
    });
    let response = match service.join(tonic::Request::from_http(request)).await {
        Ok(response) => response,
        Err(status) => return status.into_http(),
    };
    let (metadata, messages, extensions) = response.into_parts();
    let mut response = http::Response::new(tonic::body::Body::new(ServerBody::new(messages)));
    *response.headers_mut() = metadata.into_headers();
    *response.extensions_mut() = extensions;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

/// The response body: each message as gRPC frames, then the status as
/// trailers.
struct ServerBody {
    messages: ServerStream,
    /// A chunk's data, due after the frame header and field keys just sent.
    data: Option<Bytes>,
    ended: bool,
}

impl ServerBody {
    fn new(messages: ServerStream) -> Self {
        Self {
            messages,
            data: None,
            ended: false,
        }
    }

    fn trailers(&mut self, status: &Status) -> Frame<Bytes> {
        self.ended = true;
        let mut trailers = http::HeaderMap::new();
        if status.add_header(&mut trailers).is_err() {
            trailers.clear();
            trailers.insert(
                Status::GRPC_STATUS,
                http::HeaderValue::from(Code::Internal as i32),
            );
        }
        Frame::trailers(trailers)
    }
}

impl http_body::Body for ServerBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if self.ended {
            return Poll::Ready(None);
        }
        let frame = match self.messages.as_mut().poll_next(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Some(Ok(message))) => {
                let (head, data) = encoded(message);
                self.data = data;
                Frame::data(head)
            }
            Poll::Ready(Some(Err(status))) => self.trailers(&status),
            Poll::Ready(None) => self.trailers(&Status::ok("")),
        };
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.data.is_none()
    }
}

/// One message as a gRPC frame: its header and bytes, and for a chunk with
/// data, the data itself to follow them, uncopied.
fn encoded(message: ServerMessage) -> (Bytes, Option<Bytes>) {
    match message.kind {
        Some(ServerKind::Chunk(chunk)) if !chunk.data.is_empty() => {
            let data = chunk.data;
            // Chunk { data }: the field's key, length and bytes.
            let chunk_len =
                key_len(CHUNK_DATA_FIELD) + encoded_len_varint(data.len() as u64) + data.len();
            // ServerMessage { chunk }: the same around the chunk.
            let message_len =
                key_len(SERVER_CHUNK_FIELD) + encoded_len_varint(chunk_len as u64) + chunk_len;
            let mut head = BytesMut::with_capacity(FRAME_HEADER + message_len - data.len());
            frame_header(&mut head, message_len);
            encode_key(SERVER_CHUNK_FIELD, WireType::LengthDelimited, &mut head);
            encode_varint(chunk_len as u64, &mut head);
            encode_key(CHUNK_DATA_FIELD, WireType::LengthDelimited, &mut head);
            encode_varint(data.len() as u64, &mut head);
            (head.freeze(), Some(data))
        }
        kind => {
            let message = ServerMessage { kind };
            let length = message.encoded_len();
            let mut head = BytesMut::with_capacity(FRAME_HEADER + length);
            frame_header(&mut head, length);
            // The buffer was sized for the message: encoding cannot run out.
            let _ = message.encode(&mut head);
            (head.freeze(), None)
        }
    }
}

/// Uncompressed, `length` bytes long. A message never nears 4 GiB: chunks
/// are [`super::CHUNK_BYTES`].
fn frame_header(head: &mut BytesMut, length: usize) {
    head.put_u8(0);
    head.put_u32(u32::try_from(length).unwrap_or(u32::MAX));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::proto;

    /// What tonic's encoder sends for `message`: header and prost's bytes.
    fn reference(message: &ServerMessage) -> Vec<u8> {
        let body = message.encode_to_vec();
        let mut framed = vec![0];
        framed.extend_from_slice(&(body.len() as u32).to_be_bytes());
        framed.extend_from_slice(&body);
        framed
    }

    fn sent(message: ServerMessage) -> Vec<u8> {
        let (head, data) = encoded(message);
        let mut framed = head.to_vec();
        framed.extend_from_slice(data.as_deref().unwrap_or_default());
        framed
    }

    fn chunk(data: Bytes) -> ServerMessage {
        ServerMessage {
            kind: Some(ServerKind::Chunk(proto::Chunk { data })),
        }
    }

    #[test]
    fn chunks_are_the_bytes_prost_writes() {
        // Lengths around each varint width, and a whole chunk.
        for size in [
            0,
            1,
            2,
            100,
            127,
            128,
            129,
            16_383,
            16_384,
            100_000,
            1 << 20,
        ] {
            let data = Bytes::from((0..size).map(|i| (i * 7 % 251) as u8).collect::<Vec<_>>());
            let message = chunk(data);
            assert_eq!(sent(message.clone()), reference(&message), "{size} bytes");
        }
    }

    #[test]
    fn a_chunk_goes_out_as_the_shared_bytes_themselves() {
        let model = Bytes::from(vec![3u8; 4096]);
        let (_, data) = encoded(chunk(model.slice(1024..2048)));
        let data = data.expect("the data follows the header");
        // The same memory, not a copy of it.
        assert_eq!(data.as_ptr(), model[1024..].as_ptr());
        assert_eq!(data.len(), 1024);
    }

    #[test]
    fn other_messages_are_the_bytes_prost_writes() {
        let messages = [
            ServerMessage { kind: None },
            ServerMessage {
                kind: Some(ServerKind::Welcome(proto::Welcome {
                    config_toml: "[clients]\ntotal_clients = 3\n".repeat(50),
                    worker: 7,
                    client_id: 2,
                })),
            },
            ServerMessage {
                kind: Some(ServerKind::Task(proto::Task {
                    client_id: 12,
                    round: 3,
                    learning_rate: 0.05,
                    payload_bytes: 248_000,
                    update_clip_norm: Some(1.5),
                    ..Default::default()
                })),
            },
        ];
        for message in messages {
            let (head, data) = encoded(message.clone());
            assert!(data.is_none());
            assert_eq!(head.to_vec(), reference(&message));
        }
    }
}
