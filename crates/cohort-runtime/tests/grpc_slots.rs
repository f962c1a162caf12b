//! Connection slots against squatters on loopback: one address cannot take
//! every slot, a registered process that never answers its task loses its
//! connection (and so its slot), and one connection carries one process.
//! Attackers connect from 127.0.0.2 (all of 127.0.0.0/8 is this machine), so
//! honest clients from 127.0.0.1 are another address.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cohort_runtime::admission::Admission;
use cohort_runtime::grpc::proto::client_message::Kind;
use cohort_runtime::grpc::proto::federation_client::FederationClient;
use cohort_runtime::grpc::proto::server_message::Kind as ServerKind;
use cohort_runtime::grpc::proto::{self, ClientMessage};
use cohort_runtime::grpc::{GrpcTransport, PROTOCOL_VERSION, ServerSettings};
use cohort_runtime::transport::{TaskInstructions, TaskSpec, Transport};
use cohort_train::trainer::ClientTask;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::wrappers::ReceiverStream;

const CONFIG: &str = "[clients]\ntotal_clients = 4\nper_round = 1\ncomm_simulation = false\n\
    [data]\ndatasource = \"FashionMNIST\"\ndownload = false\npartition_size = 100\n\
    [trainer]\noptimizer = \"sgd\"\n[parameters.optimizer]\nlearning_rate = 0.05\n";

fn settings(admission: Admission, payload_timeout: Duration) -> ServerSettings {
    ServerSettings {
        bind: "127.0.0.1:0".parse().unwrap(),
        config_toml: CONFIG.to_owned(),
        auth_token: None,
        tls: None,
        payload_timeout,
        registration_timeout: Duration::from_secs(20),
        max_payload_bytes: 1 << 20,
        max_inflight_bytes: 1 << 20,
        stream_window_bytes: None,
        admission,
        own_data: Default::default(),
    }
}

/// A connection from `source` that sends the HTTP/2 preface and then
/// nothing.
async fn preface_from(source: [u8; 4], server: SocketAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((source, 0))).unwrap();
    let mut stream = socket.connect(server).await.unwrap();
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    stream
}

/// Whether the server closes `stream` within `within` (reading and dropping
/// what it sends before, its HTTP/2 settings).
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut sink = [0u8; 256];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut sink)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

#[test]
fn one_address_cannot_take_every_connection_slot() {
    let admission = Admission {
        max_connections: 16,
        max_per_address: 3,
        first_byte_within: Duration::from_secs(5),
        register_within: Duration::from_secs(5),
    };
    let transport = GrpcTransport::start(settings(admission, Duration::from_secs(10))).unwrap();
    let server = transport.local_addr();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(preface_from([127, 0, 0, 2], server).await);
        }
        // The fourth from that address is closed at once, long before any
        // deadline would close it.
        let started = Instant::now();
        let mut fourth = preface_from([127, 0, 0, 2], server).await;
        assert!(closed_within(&mut fourth, Duration::from_secs(2)).await);
        assert!(started.elapsed() < Duration::from_secs(2));
        // Another address still gets in, and the three stay open meanwhile.
        let mut other = preface_from([127, 0, 0, 3], server).await;
        assert!(!closed_within(&mut other, Duration::from_secs(1)).await);
        for stream in &mut held {
            assert!(!closed_within(stream, Duration::from_millis(100)).await);
        }
        // A place of the address is given back when one of its connections
        // closes.
        drop(held.pop());
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut again = preface_from([127, 0, 0, 2], server).await;
        assert!(!closed_within(&mut again, Duration::from_secs(1)).await);
    });
}

fn task(client_id: u32) -> TaskSpec {
    TaskSpec {
        slot: 0,
        task: ClientTask {
            client_id,
            round: 1,
        },
        instructions: TaskInstructions::plain(0.1),
    }
}

fn register() -> ClientMessage {
    ClientMessage {
        kind: Some(Kind::Register(proto::Register {
            token: String::new(),
            name: "squatter".into(),
            protocol: PROTOCOL_VERSION,
            own_data: None,
        })),
    }
}

/// A process that registers, takes its task and never answers, keeping its
/// connection open (HTTP/2 answers the server's pings) for `linger`.
fn never_answering(server: SocketAddr, linger: Duration) {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async move {
            let mut client = FederationClient::connect(format!("http://{server}"))
                .await
                .unwrap();
            let (sender, receiver) = tokio::sync::mpsc::channel(8);
            sender.send(register()).await.unwrap();
            let mut inbound = client
                .join(ReceiverStream::new(receiver))
                .await
                .unwrap()
                .into_inner();
            let deadline = tokio::time::Instant::now() + linger;
            while let Ok(Ok(Some(_))) = tokio::time::timeout_at(deadline, inbound.message()).await {
            }
            tokio::time::sleep_until(deadline).await;
            drop(sender);
        });
    });
}

/// Before, such a process kept its slot for as long as it answered
/// keepalives: with the address's one slot taken, the honest client never
/// got in.
#[test]
fn a_process_that_never_answers_its_task_loses_its_connection_slot() {
    let admission = Admission {
        max_connections: 16,
        max_per_address: 1,
        first_byte_within: Duration::from_secs(2),
        register_within: Duration::from_secs(2),
    };
    let mut transport =
        GrpcTransport::start(settings(admission, Duration::from_millis(500))).unwrap();
    let server = transport.local_addr();
    never_answering(server, Duration::from_secs(60));
    transport.wait_for_clients(1).unwrap();
    transport
        .dispatch(Arc::new(vec![1, 2, 3]), vec![task(1)])
        .unwrap();
    let outcome = transport.next_outcome().unwrap();
    let reason = outcome.result.expect_err("the squatter never answers");
    assert!(
        reason.contains("no report within server.payload_timeout"),
        "{reason}"
    );
    // The honest client, from the same address, gets the slot the squatter
    // held.
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data");
    let options = cohort_runtime::WorkerOptions {
        server: server.to_string(),
        token: None,
        tls_ca: None,
        tls_domain: None,
        data_root: Some(data),
        max_payload_bytes: 1 << 20,
        device: cohort_train::device::DeviceRequest::Cpu,
        connect_timeout: Duration::from_secs(20),
        own_data: None,
        host_name: "honest".into(),
        registry: Arc::new(cohort_train::registry::Registry::builtin()),
        require_secure_aggregation: false,
        secagg_fault: None,
    };
    std::thread::spawn(move || {
        let _ = cohort_runtime::run_worker(&options);
    });
    transport.wait_for_clients(2).unwrap();
    assert_eq!(transport.connected(), 1, "the squatter is gone");
}

#[test]
fn a_connection_carries_one_client_process() {
    let transport =
        GrpcTransport::start(settings(Admission::default(), Duration::from_secs(10))).unwrap();
    let server = transport.local_addr();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // The admitted process's stream is kept open until the count below is
    // read: dropped at the end of the block, its disconnect raced the
    // assertion (it read 0 once in CI).
    let _admitted = runtime.block_on(async {
        let mut first = FederationClient::connect(format!("http://{server}"))
            .await
            .unwrap();
        // A clone shares the channel, so its stream is on the same connection.
        let mut second = first.clone();
        let join = |client: &mut FederationClient<tonic::transport::Channel>| {
            let (sender, receiver) = tokio::sync::mpsc::channel(8);
            let mut client = client.clone();
            async move {
                sender.send(register()).await.unwrap();
                let answer = client.join(ReceiverStream::new(receiver)).await;
                (answer, sender)
            }
        };
        let (admitted, _keep) = join(&mut first).await;
        let mut inbound = admitted
            .expect("the first process is admitted")
            .into_inner();
        let welcome = inbound.message().await.unwrap().unwrap();
        assert!(matches!(welcome.kind, Some(ServerKind::Welcome(_))));
        let (refused, _keep_too) = join(&mut second).await;
        let status = refused.expect_err("a second process on the connection");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status}");
        assert!(status.message().contains("its own connection"), "{status}");
        (_keep, inbound)
    });
    transport.wait_for_clients(1).unwrap();
    assert_eq!(transport.connected(), 1);
}
