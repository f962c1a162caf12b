//! The name in a Register message, against a real GrpcTransport on loopback:
//! a name over `MAX_CLIENT_NAME_BYTES` is refused (token or not) before any
//! of it is logged or kept, one at the bound gets in, and a peer that keeps
//! getting refused writes a bounded number of log lines.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cohort_runtime::grpc::proto::client_message::Kind;
use cohort_runtime::grpc::proto::federation_client::FederationClient;
use cohort_runtime::grpc::proto::server_message::Kind as ServerKind;
use cohort_runtime::grpc::proto::{self, ClientMessage, ServerMessage};
use cohort_runtime::grpc::{
    GrpcTransport, MAX_CLIENT_NAME_BYTES, PROTOCOL_VERSION, ServerSettings,
};
use tokio_stream::wrappers::ReceiverStream;

/// What the tests of this file logged, all of them together: the server
/// logs from its own runtime's threads, so only a global subscriber sees it.
fn log() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let writer = Arc::clone(&log);
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || Buffer(Arc::clone(&writer)))
            .try_init()
            .expect("no other subscriber in this test binary");
        log
    })
}

struct Buffer(Arc<Mutex<Vec<u8>>>);

impl Write for Buffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn start(token: Option<&str>) -> GrpcTransport {
    log();
    GrpcTransport::start(ServerSettings {
        bind: "127.0.0.1:0".parse().unwrap(),
        config_toml: String::new(),
        auth_token: token.map(str::to_owned),
        tls: None,
        payload_timeout: Duration::from_secs(10),
        registration_timeout: Duration::from_secs(5),
        max_payload_bytes: 1000,
        max_inflight_bytes: 1 << 20,
        stream_window_bytes: None,
        admission: Default::default(),
        own_data: Default::default(),
    })
    .unwrap()
}

/// A registered stream: dropping it leaves.
type Joined = (
    tokio::sync::mpsc::Sender<ClientMessage>,
    tonic::Streaming<ServerMessage>,
    proto::Welcome,
);

/// Registers on a connection of its own, as a reconnecting peer would.
async fn register(
    address: SocketAddr,
    token: &str,
    name: String,
    own_data: Option<proto::OwnData>,
) -> Result<Joined, tonic::Status> {
    let mut client = FederationClient::connect(format!("http://{address}"))
        .await
        .unwrap();
    let (sender, receiver) = tokio::sync::mpsc::channel(1);
    sender
        .send(ClientMessage {
            kind: Some(Kind::Register(proto::Register {
                token: token.to_owned(),
                name,
                protocol: PROTOCOL_VERSION,
                own_data,
            })),
        })
        .await
        .unwrap();
    let mut inbound = client
        .join(ReceiverStream::new(receiver))
        .await?
        .into_inner();
    match inbound.message().await?.and_then(|m| m.kind) {
        Some(ServerKind::Welcome(welcome)) => Ok((sender, inbound, welcome)),
        other => panic!("expected a welcome, got {other:?}"),
    }
}

fn refusal(status: Result<Joined, tonic::Status>) -> tonic::Status {
    match status {
        Ok((_, _, welcome)) => panic!("registered as worker {}", welcome.worker),
        Err(status) => status,
    }
}

/// gRPC's default message limit is 4 MiB: this is about the longest name
/// that reaches the service at all.
const HUGE: usize = 4_000_000;

fn assert_name_refused(status: &tonic::Status, bytes: usize) {
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    let expected = format!(
        "client name (Register.name) is {bytes} bytes; this server accepts at most \
         {MAX_CLIENT_NAME_BYTES} (MAX_CLIENT_NAME_BYTES)"
    );
    assert_eq!(status.message(), expected);
}

#[test]
fn a_huge_name_with_a_wrong_token_is_refused_for_its_length() {
    let transport = start(Some("secret"));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let status = refusal(runtime.block_on(register(
        transport.local_addr(),
        "wrong",
        "n".repeat(HUGE),
        None,
    )));
    assert_name_refused(&status, HUGE);
    assert_eq!(transport.connected(), 0);
}

#[test]
fn a_huge_name_without_a_token_is_refused_and_registers_nothing() {
    let transport = start(None);
    let address = transport.local_addr();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    for _ in 0..3 {
        let status = refusal(runtime.block_on(register(address, "", "h".repeat(HUGE), None)));
        assert_name_refused(&status, HUGE);
    }
    assert_eq!(transport.connected(), 0);
    // No worker index went to the refused streams either.
    let (_sender, _inbound, welcome) = runtime
        .block_on(register(address, "", "honest".into(), None))
        .unwrap();
    assert_eq!(welcome.worker, 0);
    transport.wait_for_clients(1).unwrap();
}

#[test]
fn a_name_at_the_bound_is_accepted_and_one_byte_more_is_not() {
    let transport = start(Some("secret"));
    let address = transport.local_addr();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // Multi-byte characters: the bound counts bytes, not characters.
    let at_bound = format!("{}a", "€".repeat((MAX_CLIENT_NAME_BYTES - 1) / 3));
    assert_eq!(at_bound.len(), MAX_CLIENT_NAME_BYTES);
    let joined = runtime
        .block_on(register(address, "secret", at_bound.clone(), None))
        .unwrap();
    transport.wait_for_clients(1).unwrap();
    assert_eq!(transport.connected(), 1);
    drop(joined);
    let over = format!("{at_bound}b");
    let status = refusal(runtime.block_on(register(address, "secret", over, None)));
    assert_name_refused(&status, MAX_CLIENT_NAME_BYTES + 1);
}

/// One peer, reconnecting for each attempt, refused for a wrong token, a
/// long name and an impossible own-data claim, 40 times each: one line per
/// kind of refusal per 10 s window, and no name in any of them.
#[test]
fn refusals_from_one_peer_are_logged_once_per_window() {
    let transport = start(Some("secret"));
    let address = transport.local_addr();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let started = Instant::now();
    let own_data = proto::OwnData {
        client_id: 1,
        train_samples: 10,
        test_samples: 0,
    };
    for _ in 0..40 {
        let token = refusal(runtime.block_on(register(address, "wrong", "x".repeat(200), None)));
        assert_eq!(token.code(), tonic::Code::Unauthenticated, "{token:?}");
        let long = refusal(runtime.block_on(register(address, "secret", "y".repeat(300), None)));
        assert_name_refused(&long, 300);
        let claim =
            refusal(runtime.block_on(register(address, "secret", "own".into(), Some(own_data))));
        assert_eq!(claim.code(), tonic::Code::FailedPrecondition, "{claim:?}");
    }
    // Lines are written when the refusal is, before the client hears of it.
    let windows = 1 + started.elapsed().as_secs() as usize / 10;
    let log = String::from_utf8(log().lock().unwrap().clone()).unwrap();
    for marker in [
        "client refused: wrong or missing token",
        "bytes=300 ",
        // This test's own claim refusal: other tests of this binary refuse
        // own-data claims too, into the same log.
        "own-data client refused: this run has no own-data clients",
    ] {
        let lines: Vec<&str> = log.lines().filter(|line| line.contains(marker)).collect();
        assert!(
            (1..=windows).contains(&lines.len()),
            "{} lines with {marker:?} in {windows} windows: {lines:#?}",
            lines.len()
        );
        assert!(lines.iter().all(|line| line.len() < 400), "{lines:#?}");
    }
    assert!(!log.contains("xxxxxxxxxx"), "a refused name was logged");
    assert!(!log.contains("yyyyyyyyyy"), "a refused name was logged");
    assert_eq!(transport.connected(), 0);
}

/// #28 item 9: with per-id tokens an own-data id is claimed by its token
/// alone: the run's token, another id's token or none cannot take it, and an
/// id served by another process after its holder left is logged loudly.
#[test]
fn own_data_ids_are_claimed_by_their_own_tokens() {
    let (one, two) = ("own-data-token-one-0001", "own-data-token-two-0002");
    log();
    let transport = GrpcTransport::start(ServerSettings {
        bind: "127.0.0.1:0".parse().unwrap(),
        config_toml: String::new(),
        auth_token: Some("the-run-token".to_owned()),
        tls: None,
        payload_timeout: Duration::from_secs(10),
        registration_timeout: Duration::from_secs(5),
        max_payload_bytes: 1000,
        max_inflight_bytes: 1 << 20,
        stream_window_bytes: None,
        admission: Default::default(),
        own_data: cohort_runtime::grpc::OwnDataSettings {
            clients: 2,
            max_samples: 100,
            tokens: vec![one.to_owned(), two.to_owned()],
        },
    })
    .unwrap();
    let address = transport.local_addr();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let claim = |token: &str, client_id: u32| {
        runtime.block_on(register(
            address,
            token,
            "own".to_owned(),
            Some(proto::OwnData {
                client_id,
                train_samples: 10,
                test_samples: 0,
            }),
        ))
    };
    for (token, id) in [
        ("the-run-token", 1),
        ("", 1),
        ("own-data-token-one-0002", 0),
    ] {
        let status = refusal(claim(token, id));
        assert_eq!(
            status.code(),
            tonic::Code::Unauthenticated,
            "{token}: {status:?}"
        );
    }
    let status = refusal(claim(two, 1));
    assert_eq!(
        status.message(),
        "this token is own-data client 2's, not client 1's (--client-id)"
    );
    // The token names the id; no --client-id needed.
    let (_, _, welcome) = claim(two, 0).unwrap();
    assert_eq!(welcome.client_id, 2);
    let holder = claim(one, 1).unwrap();
    assert_eq!(holder.2.client_id, 1);
    drop(holder);
    // Once its holder left, id 1 may be claimed again (with its token), and
    // that is said.
    let deadline = Instant::now() + Duration::from_secs(10);
    let again = loop {
        match claim(one, 1) {
            Ok(joined) => break joined,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(status) => panic!("{status:?}"),
        }
    };
    assert_eq!(again.2.client_id, 1);
    let text = String::from_utf8_lossy(&log().lock().unwrap()).into_owned();
    assert!(
        text.contains("own-data client 1 is claimed again"),
        "{text}"
    );
    // The tokens never reach the log.
    assert!(!text.contains(one) && !text.contains(two), "{text}");
}
