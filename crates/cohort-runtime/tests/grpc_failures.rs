//! The gRPC transport against hand-written misbehaving clients on loopback:
//! each failure comes back as a failed outcome naming the client, and the
//! server keeps serving.

use std::sync::Arc;
use std::time::Duration;

use cohort_runtime::grpc::proto::client_message::Kind;
use cohort_runtime::grpc::proto::federation_client::FederationClient;
use cohort_runtime::grpc::proto::server_message::Kind as ServerKind;
use cohort_runtime::grpc::proto::{self, ClientMessage};
use cohort_runtime::grpc::{GrpcTransport, PROTOCOL_VERSION, ServerSettings};
use cohort_runtime::transport::{TaskInstructions, TaskSpec, Transport};
use cohort_train::trainer::ClientTask;
use tokio_stream::wrappers::ReceiverStream;

fn settings(timeout: Duration) -> ServerSettings {
    ServerSettings {
        bind: "127.0.0.1:0".parse().unwrap(),
        config_toml: String::new(),
        auth_token: None,
        tls: None,
        payload_timeout: timeout,
        registration_timeout: Duration::from_secs(20),
        max_payload_bytes: 1000,
        max_inflight_bytes: 1 << 20,
        stream_window_bytes: None,
        admission: Default::default(),
        own_data: Default::default(),
    }
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

/// A client that registers, takes one task and answers with `reply`.
fn rogue_client(address: std::net::SocketAddr, reply: Vec<Kind>, linger: Duration) {
    let mut steps: Vec<(Duration, Kind)> = reply.into_iter().map(|k| (Duration::ZERO, k)).collect();
    scripted_client(address, linger, move |_| std::mem::take(&mut steps));
}

/// A client that registers, takes one task, and sends what `script` makes of
/// the task's client id, each message after its delay; then stays `linger`.
fn scripted_client(
    address: std::net::SocketAddr,
    linger: Duration,
    mut script: impl FnMut(u32) -> Vec<(Duration, Kind)> + Send + 'static,
) {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async move {
            let mut client = FederationClient::connect(format!("http://{address}"))
                .await
                .unwrap();
            let (sender, receiver) = tokio::sync::mpsc::channel(8);
            sender
                .send(ClientMessage {
                    kind: Some(Kind::Register(proto::Register {
                        token: String::new(),
                        name: "rogue".into(),
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
            // Welcome, then the task and its payload chunk.
            let mut task = None;
            while let Ok(Some(message)) = inbound.message().await {
                match message.kind {
                    Some(ServerKind::Task(t)) => task = Some(t.client_id),
                    Some(ServerKind::Chunk(_)) if task.is_some() => break,
                    _ => {}
                }
            }
            for (delay, kind) in script(task.unwrap_or_default()) {
                tokio::time::sleep(delay).await;
                let _ = sender.send(ClientMessage { kind: Some(kind) }).await;
            }
            tokio::time::sleep(linger).await;
        });
    });
}

fn report(client_id: u32, payload_bytes: u64) -> Kind {
    Kind::Report(proto::Report {
        client_id,
        round: 1,
        num_samples: 10,
        loss: 0.5,
        training_time: 0.1,
        processing_time: 0.0,
        payload_bytes,
        local_steps: 1,
        ..Default::default()
    })
}

fn failure_of(reply: Vec<Kind>, linger: Duration, timeout: Duration) -> String {
    let mut transport = GrpcTransport::start(settings(timeout)).unwrap();
    rogue_client(transport.local_addr(), reply, linger);
    transport.wait_for_clients(1).unwrap();
    transport
        .dispatch(Arc::new(vec![1, 2, 3]), vec![task(4)])
        .unwrap();
    let outcome = transport.next_outcome().unwrap();
    assert_eq!(outcome.task.client_id, 4);
    outcome.result.expect_err("the rogue client must fail")
}

#[test]
fn an_oversized_payload_is_refused_before_it_is_buffered() {
    let reason = failure_of(
        vec![report(4, 1_000_000)],
        Duration::from_secs(2),
        Duration::from_secs(10),
    );
    assert!(
        reason.contains("exceeds server.max_payload_bytes = 1000"),
        "{reason}"
    );
}

#[test]
fn a_report_for_another_client_is_malformed() {
    let reason = failure_of(
        vec![report(5, 0)],
        Duration::from_secs(2),
        Duration::from_secs(10),
    );
    assert!(
        reason.contains("report for client 5 round 1, but the task was client 4"),
        "{reason}"
    );
}

#[test]
fn more_bytes_than_announced_is_malformed() {
    let chunk = Kind::Chunk(proto::Chunk {
        data: vec![0; 20].into(),
    });
    let reason = failure_of(
        vec![report(4, 10), chunk],
        Duration::from_secs(2),
        Duration::from_secs(10),
    );
    assert!(
        reason.contains("more payload bytes than announced"),
        "{reason}"
    );
}

#[test]
fn a_client_that_hangs_up_mid_task_is_dropped() {
    let reason = failure_of(vec![report(4, 10)], Duration::ZERO, Duration::from_secs(10));
    assert!(reason.contains("client process"), "{reason}");
}

#[test]
fn a_silent_client_times_out() {
    let reason = failure_of(vec![], Duration::from_secs(5), Duration::from_millis(300));
    assert!(
        reason.contains("no report within server.payload_timeout"),
        "{reason}"
    );
}

#[test]
fn a_training_failure_is_reported_with_its_reason() {
    let failed = Kind::Failed(proto::TaskFailed {
        client_id: 4,
        round: 1,
        reason: "gradient norm is NaN".into(),
    });
    let reason = failure_of(
        vec![failed],
        Duration::from_secs(2),
        Duration::from_secs(10),
    );
    assert!(
        reason.contains("the client's training failed: gradient norm is NaN"),
        "{reason}"
    );
}

/// #28 item 5: a reason of megabytes is cut to `MAX_REASON_BYTES` on
/// arrival, so it cannot grow the log, `clients.csv` and every later sidecar.
#[test]
fn a_huge_failure_reason_is_cut_on_arrival() {
    let failed = Kind::Failed(proto::TaskFailed {
        client_id: 4,
        round: 1,
        reason: "€".repeat(700_000),
    });
    let reason = failure_of(
        vec![failed],
        Duration::from_secs(2),
        Duration::from_secs(10),
    );
    let kept = cohort_runtime::transport::MAX_REASON_BYTES;
    assert!(reason.len() < kept + 100, "{} bytes", reason.len());
    assert!(reason.starts_with("the client's training failed: €€€"));
    assert!(
        reason.ends_with("… (2100000 bytes in all)"),
        "{}",
        &reason[reason.len() - 40..]
    );
}

/// Connections that never send a byte: more than the server admits at once
/// are closed at once, the others when their first-byte deadline passes, and
/// an honest client registers after them. Also a client that sends only the
/// HTTP/2 preface and then nothing is not kept forever.
#[test]
fn silent_connections_are_capped_and_closed_and_honest_clients_still_register() {
    use std::io::{Read, Write};
    let mut settings = settings(Duration::from_secs(10));
    settings.admission = cohort_runtime::admission::Admission {
        max_connections: 8,
        first_byte_within: Duration::from_millis(500),
        register_within: Duration::from_secs(1),
        ..Default::default()
    };
    let transport = GrpcTransport::start(settings).unwrap();
    let address = transport.local_addr();
    let started = std::time::Instant::now();
    let silent: Vec<std::net::TcpStream> = (0..20)
        .map(|_| std::net::TcpStream::connect(address).unwrap())
        .collect();
    for mut connection in silent {
        connection
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut byte = [0u8; 1];
        match connection.read(&mut byte) {
            Ok(0) => {}
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("a silent connection was kept open: {other:?}"),
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );

    // Bytes that never register a client (here the HTTP/2 preface and
    // nothing more) hold a slot only until the registration deadline.
    let mut preface_only = std::net::TcpStream::connect(address).unwrap();
    preface_only
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .unwrap();
    preface_only
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let cut_off = std::time::Instant::now();
    let mut sink = [0u8; 256];
    loop {
        match preface_only.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => continue,
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(error) => panic!("the preface-only connection was kept open: {error}"),
        }
    }
    assert!(
        cut_off.elapsed() < Duration::from_secs(4),
        "{:?}",
        cut_off.elapsed()
    );
    // A registered client keeps its connection past the deadline.
    rogue_client(address, Vec::new(), Duration::from_secs(3));
    transport.wait_for_clients(1).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        transport.connected(),
        1,
        "the registered client was cut off"
    );
}

fn chunk(byte: u8, len: usize) -> Kind {
    Kind::Chunk(proto::Chunk {
        data: vec![byte; len].into(),
    })
}

/// Two uploads of 4 KiB each: A announces its update first and then trickles
/// it over 1.5 s; B announces 0.3 s after A and sends its update at once.
/// Returns the payload byte of each outcome in the order they came back, and
/// the seconds until the second one.
fn two_uploads(max_inflight_bytes: usize) -> (Vec<u8>, f64) {
    let mut settings = settings(Duration::from_secs(20));
    settings.max_payload_bytes = 4096;
    settings.max_inflight_bytes = max_inflight_bytes;
    let mut transport = GrpcTransport::start(settings).unwrap();
    let address = transport.local_addr();
    let slow = |id| {
        vec![
            (Duration::ZERO, report(id, 4096)),
            (Duration::ZERO, chunk(0xAA, 2048)),
            (Duration::from_millis(1500), chunk(0xAA, 2048)),
        ]
    };
    let quick = |id| {
        vec![
            (Duration::from_millis(300), report(id, 4096)),
            (Duration::ZERO, chunk(0xBB, 4096)),
        ]
    };
    scripted_client(address, Duration::from_secs(5), slow);
    transport.wait_for_clients(1).unwrap();
    // The slow client takes the first task before the quick one registers.
    transport
        .dispatch(Arc::new(vec![1, 2, 3]), vec![task(1), task(2)])
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let started = std::time::Instant::now();
    scripted_client(address, Duration::from_secs(5), quick);
    let mut order = Vec::new();
    for _ in 0..2 {
        let outcome = transport.next_outcome().unwrap();
        let delivered = outcome.result.expect("both uploads are honest");
        assert_eq!(delivered.reply.payload.len(), 4096);
        order.push(delivered.reply.payload[0]);
    }
    (order, started.elapsed().as_secs_f64())
}

/// With room for one update in flight, the second upload waits for the
/// first to finish instead of being buffered beside it; with room for both,
/// the quick one finishes first. Both are delivered either way.
#[test]
fn uploads_past_the_inflight_room_wait_for_it() {
    let (order, seconds) = two_uploads(4096);
    assert_eq!(order, [0xAA, 0xBB], "the quick upload did not wait");
    assert!(
        seconds >= 1.0,
        "the second upload came back after {seconds} s"
    );
    let (order, _) = two_uploads(1 << 20);
    assert_eq!(
        order,
        [0xBB, 0xAA],
        "with room for both, the quick one is first"
    );
}

/// #28 item 18: a real client process refuses a task whose numbers it
/// cannot train by (here a NaN learning rate), answering TaskFailed with the
/// field and value, without unpacking or training anything; then it keeps
/// serving until the server goes.
#[test]
fn an_honest_client_refuses_a_nan_learning_rate_without_training() {
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data");
    let config_toml = r#"
[clients]
total_clients = 4
per_round = 1
comm_simulation = false
[data]
datasource = "FashionMNIST"
download = false
partition_size = 100
[trainer]
rounds = 1
epochs = 1
batch_size = 20
optimizer = "sgd"
[parameters.optimizer]
learning_rate = 0.05
"#;
    let mut transport = GrpcTransport::start(ServerSettings {
        config_toml: config_toml.to_owned(),
        ..settings(Duration::from_secs(60))
    })
    .unwrap();
    let options = honest_client(transport.local_addr(), data);
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        done.send(cohort_runtime::run_worker(&options).map_err(|e| e.to_string()))
    });
    transport.wait_for_clients(1).unwrap();
    // Not even a model: a client that looked at the payload would fail
    // unpacking it instead.
    let poisoned = TaskSpec {
        instructions: TaskInstructions::plain(f64::NAN),
        ..task(4)
    };
    transport
        .dispatch(Arc::new(vec![1, 2, 3]), vec![poisoned])
        .unwrap();
    let reason = transport
        .next_outcome()
        .unwrap()
        .result
        .expect_err("the client must refuse the task");
    assert!(
        reason.contains(
            "refused to train: the task's `learning_rate` is NaN; expected a finite number >= 0"
        ),
        "{reason}"
    );
    drop(transport);
    let summary = finished
        .recv_timeout(Duration::from_secs(30))
        .expect("the client leaves when the server goes")
        .unwrap();
    assert_eq!((summary.tasks, summary.failed), (1, 1));
}

/// #28 item 4: connections that hold every slot make the server cut an
/// honest client's connection at once; the client keeps trying until its
/// --connect-timeout and gets in once the silent ones are closed.
#[test]
fn an_honest_client_retries_past_a_server_whose_slots_are_full() {
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data");
    let mut settings = settings(Duration::from_secs(10));
    settings.config_toml = "[clients]\ntotal_clients = 4\nper_round = 1\ncomm_simulation = false\n\
        [data]\ndatasource = \"FashionMNIST\"\ndownload = false\npartition_size = 100\n\
        [trainer]\noptimizer = \"sgd\"\n[parameters.optimizer]\nlearning_rate = 0.05\n"
        .to_owned();
    settings.admission = cohort_runtime::admission::Admission {
        max_connections: 4,
        first_byte_within: Duration::from_secs(2),
        register_within: Duration::from_secs(2),
        ..Default::default()
    };
    let transport = GrpcTransport::start(settings).unwrap();
    let address = transport.local_addr();
    let squatters: Vec<std::net::TcpStream> = (0..4)
        .map(|_| {
            let socket = std::net::TcpStream::connect(address).unwrap();
            socket.set_nodelay(true).unwrap();
            socket
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let options = honest_client(address, data);
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        done.send(cohort_runtime::run_worker(&options).map_err(|e| e.to_string()))
    });
    transport.wait_for_clients(1).unwrap();
    drop(squatters);
    drop(transport);
    // The server going away ends the client; what matters is that it got in.
    let _ = finished.recv_timeout(Duration::from_secs(30));
}

/// A `cohort client` of the server at `address`, on the fixtures in `data`.
fn honest_client(
    address: std::net::SocketAddr,
    data: std::path::PathBuf,
) -> cohort_runtime::WorkerOptions {
    cohort_runtime::WorkerOptions {
        server: address.to_string(),
        token: None,
        tls_ca: None,
        tls_domain: None,
        data_root: Some(data),
        max_payload_bytes: 1 << 20,
        device: cohort_train::device::DeviceRequest::Cpu,
        connect_timeout: Duration::from_secs(20),
        own_data: None,
        host_name: "honest".into(),
        registry: std::sync::Arc::new(cohort_train::registry::Registry::builtin()),
        require_secure_aggregation: false,
        secagg_fault: None,
    }
}

/// The Join method's path; the route (`grpc/wire.rs`) answers only this one.
const JOIN: &str = "/cohort.v1.Federation/Join";

/// A call's outbox and response stream, or the status it was refused with
/// before any stream.
type Call = Result<
    (
        tokio::sync::mpsc::Sender<ClientMessage>,
        tonic::Streaming<proto::ServerMessage>,
    ),
    tonic::Status,
>;

/// A call of `path` on a connection of its own whose first message is a
/// valid Register, sent with `grpc-encoding: encoding` where given (the
/// frames themselves uncompressed): the call's outbox and its response
/// stream, or the status it was refused with before any stream (tonic's
/// client fails the call itself only on a `grpc-status` in the response's
/// headers, a trailers-only response).
async fn call(
    address: std::net::SocketAddr,
    path: &'static str,
    encoding: Option<&'static str>,
) -> Call {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let (sender, receiver) = tokio::sync::mpsc::channel(1);
    sender
        .send(ClientMessage {
            kind: Some(Kind::Register(proto::Register {
                token: String::new(),
                name: "caller".into(),
                protocol: PROTOCOL_VERSION,
                own_data: None,
            })),
        })
        .await
        .unwrap();
    let mut request = tonic::Request::new(ReceiverStream::new(receiver));
    if let Some(encoding) = encoding {
        request
            .metadata_mut()
            .insert("grpc-encoding", encoding.parse().unwrap());
    }
    let codec = tonic_prost::ProstCodec::<ClientMessage, proto::ServerMessage>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    let inbound = grpc.streaming(request, path, codec).await?.into_inner();
    Ok((sender, inbound))
}

/// The worker index a call that must register was welcomed as.
async fn welcomed(call: Call) -> u32 {
    let (_outbox, mut inbound) = call.unwrap_or_else(|status| panic!("refused: {status:?}"));
    match inbound.message().await.unwrap().and_then(|m| m.kind) {
        Some(ServerKind::Welcome(welcome)) => welcome.worker,
        other => panic!("expected a welcome, got {other:?}"),
    }
}

/// The status a call that must be refused before its stream was refused with.
fn refused(call: Call, what: &str) -> tonic::Status {
    match call {
        Ok(_) => panic!("{what}: the call was answered with a stream"),
        Err(status) => status,
    }
}

/// As tonic's generated server did: a method other than Join, with a valid
/// Register as its first message, is `Unimplemented`, whether the route
/// sees it (a path under the service) or tonic's router does (another
/// service), and registers no process.
#[test]
fn another_method_is_unimplemented() {
    let transport = GrpcTransport::start(settings(Duration::from_secs(10))).unwrap();
    let address = transport.local_addr();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        for path in [
            "/cohort.v1.Federation/Nope",
            "/cohort.v1.Federation/join",
            "/cohort.v1.Federation/Join/",
            "/cohort.v1.Other/Join",
        ] {
            let status = refused(call(address, path, None).await, path);
            assert_eq!(
                status.code(),
                tonic::Code::Unimplemented,
                "{path}: {status:?}"
            );
        }
        let status = refused(
            call(address, "/cohort.v1.Federation/Nope", None).await,
            "Nope",
        );
        assert_eq!(status.message(), "no method /cohort.v1.Federation/Nope");
        // The same call on Join registers, as the first process: what was
        // refused was the path, and the refused calls took no place.
        assert_eq!(welcomed(call(address, JOIN, None).await).await, 0);
    });
}

/// Compression is refused, as tonic's generated server (built without any
/// encoding) refused it: a Join call that announces an encoding other than
/// `identity` is `Unimplemented`, naming the encoding, before its stream;
/// `identity`, no compression, registers.
#[test]
fn a_compressed_join_is_refused_naming_its_encoding() {
    let transport = GrpcTransport::start(settings(Duration::from_secs(10))).unwrap();
    let address = transport.local_addr();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        for encoding in ["gzip", "zstd", "deflate"] {
            let status = refused(call(address, JOIN, Some(encoding)).await, encoding);
            assert_eq!(
                status.code(),
                tonic::Code::Unimplemented,
                "{encoding}: {status:?}"
            );
            assert_eq!(
                status.message(),
                format!("message compression \"{encoding}\" is not supported by this server")
            );
        }
        assert_eq!(
            welcomed(call(address, JOIN, Some("identity")).await).await,
            0
        );
        assert_eq!(welcomed(call(address, JOIN, None).await).await, 1);
    });
}

/// With HTTP/2's smallest window (`server.stream_window_bytes`), an update
/// four times the window arrives whole: the client sends what the window
/// allows, and the server's window updates carry the rest.
#[test]
fn a_small_stream_window_still_carries_an_update_larger_than_it() {
    const UPDATE: usize = 4 * 65_535;
    let mut settings = settings(Duration::from_secs(20));
    settings.max_payload_bytes = UPDATE;
    settings.stream_window_bytes = Some(65_535);
    let mut transport = GrpcTransport::start(settings).unwrap();
    let script = |id| {
        vec![
            (Duration::ZERO, report(id, UPDATE as u64)),
            (Duration::ZERO, chunk(0xCC, UPDATE)),
        ]
    };
    scripted_client(transport.local_addr(), Duration::from_secs(10), script);
    transport.wait_for_clients(1).unwrap();
    transport
        .dispatch(Arc::new(vec![1, 2, 3]), vec![task(1)])
        .unwrap();
    let delivered = transport
        .next_outcome()
        .unwrap()
        .result
        .expect("an honest upload");
    assert_eq!(delivered.reply.payload.len(), UPDATE);
    assert!(delivered.reply.payload.iter().all(|&b| b == 0xCC));
}
