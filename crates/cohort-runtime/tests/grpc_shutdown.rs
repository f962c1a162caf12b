//! The end of a run over the network: dropping the transport ends every
//! client process's stream with status OK, so `cohort client` exits 0 rather
//! than reporting a broken connection.

use std::net::SocketAddr;
use std::time::Duration;

use cohort_runtime::admission::Admission;
use cohort_runtime::grpc::proto::client_message::Kind;
use cohort_runtime::grpc::proto::federation_client::FederationClient;
use cohort_runtime::grpc::proto::server_message::Kind as ServerKind;
use cohort_runtime::grpc::proto::{self, ClientMessage};
use cohort_runtime::grpc::{GrpcTransport, PROTOCOL_VERSION, ServerSettings};
use tokio_stream::wrappers::ReceiverStream;

/// A short registration deadline, so that it has long passed when the run
/// ends, as it has in any real run.
fn settings() -> ServerSettings {
    ServerSettings {
        bind: "127.0.0.1:0".parse().unwrap(),
        config_toml: String::new(),
        auth_token: None,
        tls: None,
        payload_timeout: Duration::from_secs(10),
        registration_timeout: Duration::from_secs(20),
        max_payload_bytes: 1000,
        max_inflight_bytes: 1 << 20,
        stream_window_bytes: None,
        admission: Admission {
            register_within: Duration::from_millis(50),
            ..Admission::default()
        },
        own_data: Default::default(),
    }
}

/// A registered client process, each on its own connection, waiting for
/// its next task: its outbox (kept open, as `cohort client` keeps it) and
/// its inbound stream.
async fn registered(
    server: SocketAddr,
) -> (
    tokio::sync::mpsc::Sender<ClientMessage>,
    tonic::Streaming<proto::ServerMessage>,
) {
    let mut client = FederationClient::connect(format!("http://{server}"))
        .await
        .unwrap();
    let (sender, receiver) = tokio::sync::mpsc::channel(8);
    sender
        .send(ClientMessage {
            kind: Some(Kind::Register(proto::Register {
                token: String::new(),
                name: "waiting".into(),
                protocol: PROTOCOL_VERSION,
                own_data: None,
            })),
        })
        .await
        .unwrap();
    let mut inbound = client
        .join(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    let welcome = inbound.message().await.unwrap().unwrap();
    assert!(matches!(welcome.kind, Some(ServerKind::Welcome(_))));
    (sender, inbound)
}

#[test]
fn the_end_of_the_run_closes_every_stream_with_status_ok() {
    const PROCESSES: usize = 4;
    // A race (the stream's end against the connection's), so several runs.
    for attempt in 0..10 {
        let transport = GrpcTransport::start(settings()).unwrap();
        let server = transport.local_addr();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let clients = runtime.block_on(async {
            let mut clients = Vec::new();
            for _ in 0..PROCESSES {
                clients.push(registered(server).await);
            }
            clients
        });
        transport.wait_for_clients(PROCESSES).unwrap();
        // Past the registration deadline: a registered connection is kept.
        std::thread::sleep(Duration::from_millis(150));
        assert_eq!(transport.connected(), PROCESSES, "attempt {attempt}");
        // The run is over.
        let dropping = std::thread::spawn(move || drop(transport));
        runtime.block_on(async {
            for (index, (_outbox, mut inbound)) in clients.into_iter().enumerate() {
                let end = tokio::time::timeout(Duration::from_secs(20), inbound.message())
                    .await
                    .unwrap_or_else(|_| panic!("attempt {attempt}, process {index}: no end"));
                match end {
                    Ok(None) => {}
                    Ok(Some(message)) => {
                        panic!("attempt {attempt}, process {index}: {message:?} after the run")
                    }
                    Err(status) => panic!(
                        "attempt {attempt}, process {index}: the stream ended with {:?}: {}",
                        status.code(),
                        status.message()
                    ),
                }
            }
        });
        dropping.join().unwrap();
    }
}
