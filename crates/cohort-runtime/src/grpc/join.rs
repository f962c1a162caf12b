//! A client process joining: its first message must be a Register of this
//! protocol, with a name of bounded length and the run's token (or, for an
//! own-data client with per-id tokens, its id's); then one process per
//! connection, the claim of an own-data id, the Welcome, and the task loop
//! ([`super::serve`]) until it leaves. Refusals are logged at most once per
//! window per peer address and kind, and an unauthenticated peer's name
//! never reaches the log.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::proto::client_message::Kind as ClientKind;
use super::proto::federation_server::Federation;
use super::proto::server_message::Kind as ServerKind;
use super::proto::{self, ClientMessage};
use super::serve::{Process, serve_worker};
use super::{
    Lane, MAX_CLIENT_NAME_BYTES, PROTOCOL_VERSION, REGISTER_WITHIN, ServerStream, Shared, message,
};
use crate::admission::{AdmittedInfo, Registration};
use crate::transport::Declared;

pub(super) struct Service {
    pub(super) shared: Arc<Shared>,
}

/// Who is joining, for the log and for per-peer refusal counts.
struct Peer {
    text: String,
    ip: Option<IpAddr>,
}

/// A registration that passed: its lane, worker index and declaration.
struct Joined {
    lane: Lane,
    worker: usize,
    declared: Option<Declared>,
}

fn token_matches(expected: &str, given: &str) -> bool {
    use subtle::ConstantTimeEq;
    expected.as_bytes().ct_eq(given.as_bytes()).into()
}

/// The connection a request came on. Over TLS, tonic wraps the connection's
/// info in its own.
fn connection_of<T>(request: &Request<T>) -> Option<AdmittedInfo> {
    let extensions = request.extensions();
    extensions
        .get::<AdmittedInfo>()
        .or_else(|| {
            extensions
                .get::<tonic::transport::server::TlsConnectInfo<AdmittedInfo>>()
                .map(|tls| tls.get_ref())
        })
        .cloned()
}

/// The stream's first message, which must be a Register within
/// [`REGISTER_WITHIN`].
async fn first_register(inbound: &mut Streaming<ClientMessage>) -> Result<proto::Register, Status> {
    let first = tokio::time::timeout(REGISTER_WITHIN, inbound.message())
        .await
        .map_err(|_| Status::deadline_exceeded("no Register message within 10 s"))?;
    match first? {
        Some(ClientMessage {
            kind: Some(ClientKind::Register(register)),
        }) => Ok(register),
        _ => Err(Status::invalid_argument(
            "the first message must be Register",
        )),
    }
}

impl Service {
    /// The protocol, the name's length and the token, in that order; the
    /// own-data claim to make, if any (its id taken from a per-id token).
    fn authenticate(
        &self,
        register: &proto::Register,
        peer: &Peer,
    ) -> Result<Option<proto::OwnData>, Status> {
        let shared = &self.shared;
        if register.protocol != PROTOCOL_VERSION {
            return Err(Status::failed_precondition(format!(
                "client speaks protocol {}, this server {PROTOCOL_VERSION}; use the same cohort version on both",
                register.protocol
            )));
        }
        // Checked before the token, so that a long name is refused whoever
        // sends it, and none of it reaches the log.
        let length = register.name.len();
        if length > MAX_CLIENT_NAME_BYTES {
            if let Some(times) = shared.refused(peer.ip, "name") {
                tracing::warn!(peer = %peer.text, bytes = length, times, "client refused: its name is longer than {MAX_CLIENT_NAME_BYTES} bytes");
            }
            return Err(Status::invalid_argument(format!(
                "client name (Register.name) is {length} bytes; this server accepts at most \
                 {MAX_CLIENT_NAME_BYTES} (MAX_CLIENT_NAME_BYTES)"
            )));
        }
        // With per-id tokens an own-data client proves which id it is; the
        // run's token then admits only ordinary client processes.
        let own_data_tokens = &shared.settings.own_data.tokens;
        if let Some(own) = &register.own_data
            && !own_data_tokens.is_empty()
        {
            return own_data_of_token(own, own_data_tokens, &register.token)
                .map(Some)
                .inspect_err(|_| {
                    if let Some(times) = shared.refused(peer.ip, "token") {
                        tracing::warn!(peer = %peer.text, times, "own-data claim refused: wrong or missing own-data token");
                    }
                });
        }
        if let Some(expected) = &shared.settings.auth_token
            && !token_matches(expected, &register.token)
        {
            // Not the name: whoever sent it has not shown they may write to
            // this log.
            if let Some(times) = shared.refused(peer.ip, "token") {
                tracing::warn!(peer = %peer.text, times, "client refused: wrong or missing token");
            }
            return Err(Status::unauthenticated(
                "wrong or missing token (cohort client --token, or COHORT_TOKEN)",
            ));
        }
        Ok(register.own_data)
    }

    /// Takes the process in: an own-data id claimed, or a place among the
    /// ordinary processes. Names are logged Debug-formatted (`?`), so that
    /// control characters in one cannot forge or garble log lines.
    fn admit(
        &self,
        register: &proto::Register,
        own: Option<proto::OwnData>,
        peer: &Peer,
    ) -> Result<Joined, Status> {
        let shared = &self.shared;
        let name = &register.name;
        let Some(own) = own else {
            let worker = shared.registered.fetch_add(1, Ordering::SeqCst);
            shared.ordinary.fetch_add(1, Ordering::SeqCst);
            shared.alive.fetch_add(1, Ordering::SeqCst);
            tracing::info!(peer = %peer.text, ?name, worker, "client process registered");
            return Ok(Joined {
                lane: Lane::Shared,
                worker,
                declared: None,
            });
        };
        let (id, worker, declared) = shared.claim(&own, &peer.text).inspect_err(|refusal| {
            if let Some(times) = shared.refused(peer.ip, "own-data") {
                tracing::warn!(peer = %peer.text, ?name, times, "own-data client refused: {}", refusal.message());
            }
        })?;
        tracing::info!(peer = %peer.text, ?name, worker, client = id, train_samples = declared.train_samples, test_samples = declared.test_samples, "own-data client registered");
        Ok(Joined {
            lane: Lane::Own(id),
            worker,
            declared: Some(declared),
        })
    }
}

/// The server's side of a process leaving: its claim or its place, and its
/// connection's registration (so a connection without a process is closed).
fn leave(shared: &Shared, joined: &Joined, registration: Option<&Registration>) {
    match joined.lane {
        Lane::Own(id) => shared.release(id, joined.worker),
        Lane::Shared => {
            shared.alive.fetch_sub(1, Ordering::SeqCst);
        }
    }
    // At the end of the run the connection stays registered: the server's
    // graceful shutdown closes it once the stream has ended with status OK.
    // Released, a connection past its registration deadline (every one, in a
    // run longer than `register_within`) fails its next read at once, and h2
    // then drops the frames it has not written yet, the stream's OK status
    // among them: the client would see a broken connection
    // (crate::admission::Admitted::poll_read).
    if shared.shutting_down.load(Ordering::SeqCst) {
        return;
    }
    if let Some(registration) = registration {
        registration.release();
    }
}

#[tonic::async_trait]
impl Federation for Service {
    type JoinStream = ServerStream;

    async fn join(
        &self,
        request: Request<Streaming<ClientMessage>>,
    ) -> Result<Response<Self::JoinStream>, Status> {
        let registration = connection_of(&request).map(|connection| {
            let address = connection.tcp.remote_addr();
            (connection.registration, address)
        });
        let address = registration.as_ref().and_then(|(_, address)| *address);
        let peer = Peer {
            text: address.map_or_else(|| "unknown peer".to_owned(), |a| a.to_string()),
            ip: address.map(|a| a.ip()),
        };
        let registration = registration.map(|(registration, _)| registration);
        let mut inbound = request.into_inner();
        let register = first_register(&mut inbound).await?;
        let own = self.authenticate(&register, &peer)?;
        if let Some(registration) = &registration
            && !registration.register()
        {
            return Err(Status::resource_exhausted(
                "this connection serves a client process already; each process needs its own \
                 connection",
            ));
        }
        let joined = self.admit(&register, own, &peer).inspect_err(|_| {
            if let Some(registration) = &registration {
                registration.release();
            }
        })?;
        let shared = Arc::clone(&self.shared);
        let (sender, receiver) = tokio::sync::mpsc::channel(4);
        let welcome = sender
            .send(message(ServerKind::Welcome(proto::Welcome {
                config_toml: shared.settings.config_toml.clone(),
                worker: joined.worker as u32,
                client_id: match joined.lane {
                    Lane::Own(id) => id,
                    Lane::Shared => 0,
                },
            })))
            .await;
        if welcome.is_err() {
            leave(&shared, &joined, registration.as_deref());
            return Err(Status::cancelled("client left during registration"));
        }
        tokio::spawn(async move {
            let process = Process {
                worker: joined.worker,
                name: register.name,
                lane: joined.lane,
                declared: joined.declared,
            };
            serve_worker(&shared, &process, inbound, sender).await;
            leave(&shared, &joined, registration.as_deref());
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

/// The claim `own` with the id whose token `token` is: an explicit id must
/// be that one. Every token is compared in constant time, so the time taken
/// says nothing of which one was close.
fn own_data_of_token(
    own: &proto::OwnData,
    tokens: &[String],
    token: &str,
) -> Result<proto::OwnData, Status> {
    let mut found = None;
    for (index, expected) in tokens.iter().enumerate() {
        if token_matches(expected, token) {
            found = Some(index as u32 + 1);
        }
    }
    match found {
        Some(id) if own.client_id == 0 || own.client_id == id => Ok(proto::OwnData {
            client_id: id,
            ..*own
        }),
        Some(id) => Err(Status::unauthenticated(format!(
            "this token is own-data client {id}'s, not client {}'s (--client-id)",
            own.client_id
        ))),
        None => Err(Status::unauthenticated(
            "wrong or missing own-data token: this run gives each own-data client a token \
             of its own (cohort client --token, or COHORT_TOKEN)",
        )),
    }
}
