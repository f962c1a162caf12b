//! Clients with their own data (`cohort client --data`, `clients.own_data_clients`):
//! three clients bring datasets of different sizes and label mixes, written by
//! the test from the fixture, and the server's model is the sample-weighted
//! FedAvg of their updates, recomputed here; claims that are out of range,
//! taken or too large are refused; a mixed run has own-data clients and
//! simulated ones, and an own-data client that over-reports its samples or
//! leaves is dropped from its round while the run goes on.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use cohort_core::codec::{self, DecodeLimits};
use cohort_core::data::idx::{IdxArray, read_idx_gz};
use cohort_core::strategy::{AlgorithmConfig, ClientUpdate, RoundContext};
use cohort_core::tree::ParamTree;
use cohort_runtime::grpc::PROTOCOL_VERSION;
use cohort_runtime::grpc::proto::client_message::Kind;
use cohort_runtime::grpc::proto::federation_client::FederationClient;
use cohort_runtime::grpc::proto::server_message::Kind as ServerKind;
use cohort_runtime::grpc::proto::{self, ClientMessage};
use common::{fixture_data, free_port, write_config};
use tokio_stream::wrappers::ReceiverStream;

const PIXELS: usize = 28 * 28;
const BATCH_SIZE: u64 = 20;

/// The fixture's images and labels of one split.
struct Split {
    images: IdxArray,
    labels: IdxArray,
}

fn fixture_split(prefix: &str) -> Split {
    let folder = fixture_data().join("fashion-mnist");
    let read = |name: &str, rank| read_idx_gz(&folder.join(name), rank).unwrap();
    Split {
        images: read(&format!("{prefix}-images-idx3-ubyte.gz"), 3),
        labels: read(&format!("{prefix}-labels-idx1-ubyte.gz"), 1),
    }
}

/// The first `count` samples of `split` whose label passes `keep`.
fn pick(split: &Split, count: usize, keep: impl Fn(u8) -> bool) -> (Vec<u8>, Vec<u8>) {
    let chosen: Vec<usize> = (0..split.labels.data.len())
        .filter(|&i| keep(split.labels.data[i]))
        .take(count)
        .collect();
    assert_eq!(chosen.len(), count, "the fixture has too few such samples");
    let images = chosen
        .iter()
        .flat_map(|&i| {
            split.images.data[i * PIXELS..(i + 1) * PIXELS]
                .iter()
                .copied()
        })
        .collect();
    let labels = chosen.iter().map(|&i| split.labels.data[i]).collect();
    (images, labels)
}

fn idx_file(dims: &[usize], body: &[u8]) -> Vec<u8> {
    let mut raw = vec![0, 0, 0x08, dims.len() as u8];
    for &d in dims {
        raw.extend((d as u32).to_be_bytes());
    }
    raw.extend(body);
    raw
}

/// A folder of plain IDX files: training and held-out samples.
fn write_idx_folder(folder: &Path, train: &(Vec<u8>, Vec<u8>), test: &(Vec<u8>, Vec<u8>)) {
    std::fs::create_dir_all(folder).unwrap();
    for (prefix, (images, labels)) in [("train", train), ("t10k", test)] {
        let n = labels.len();
        std::fs::write(
            folder.join(format!("{prefix}-images-idx3-ubyte")),
            idx_file(&[n, 28, 28], images),
        )
        .unwrap();
        std::fs::write(
            folder.join(format!("{prefix}-labels-idx1-ubyte")),
            idx_file(&[n], labels),
        )
        .unwrap();
    }
}

/// A safetensors file as numpy users write it: uint8 images with int64
/// labels, or float32 intensities in [0, 1] shaped [N, 1, 28, 28].
fn write_safetensors(
    path: &Path,
    train: &(Vec<u8>, Vec<u8>),
    test: Option<&(Vec<u8>, Vec<u8>)>,
    float: bool,
) {
    use safetensors::tensor::{Dtype, TensorView};
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |prefix: &str, (images, labels): &(Vec<u8>, Vec<u8>)| {
        let n = labels.len();
        if float {
            let values = images
                .iter()
                .flat_map(|&p| (f32::from(p) / 255.0).to_le_bytes())
                .collect();
            owned.push((
                format!("{prefix}images"),
                Dtype::F32,
                vec![n, 1, 28, 28],
                values,
            ));
        } else {
            owned.push((
                format!("{prefix}images"),
                Dtype::U8,
                vec![n, 28, 28],
                images.clone(),
            ));
        }
        let labels = labels
            .iter()
            .flat_map(|&l| i64::from(l).to_le_bytes())
            .collect();
        owned.push((format!("{prefix}labels"), Dtype::I64, vec![n], labels));
    };
    add("", train);
    if let Some(test) = test {
        add("test_", test);
    }
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn cohort(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_cohort"));
    command
        .args(args)
        .env("COHORT_DATA_DIR", fixture_data())
        .env_remove("RUST_LOG")
        .env_remove("COHORT_TOKEN");
    command
}

/// `cohort client --data PATH [--client-id ID]`, with no shared data set in
/// reach: an own-data client must not need one.
fn own_data_client(port: u16, data: &Path, client_id: Option<u32>) -> Command {
    let server = format!("127.0.0.1:{port}");
    let mut command = cohort(&["client", "--server", &server, "--cpu", "--quiet", "--data"]);
    command
        .arg(data)
        .env("COHORT_DATA_DIR", "/nonexistent-shared-data");
    if let Some(id) = client_id {
        command.arg("--client-id").arg(id.to_string());
    }
    command
}

fn start(mut command: Command) -> Child {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn finish(child: Child, what: &str) -> Output {
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The run folder's `run.log` once it has `count` lines containing `needle`.
fn wait_for_log(base: &Path, needle: &str, count: usize) -> PathBuf {
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no `{needle}` ×{count} in run.log within 60 s"
        );
        if let Some(Ok(entry)) = std::fs::read_dir(base).ok().and_then(|mut e| e.next()) {
            let log = std::fs::read_to_string(entry.path().join("run.log")).unwrap_or_default();
            if log.matches(needle).count() >= count {
                return entry.path();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn job(port: u16, clients: (u32, u32, u32), partition_sizes: &str, max_samples: u64) -> String {
    let (total, per_round, own) = clients;
    format!(
        r#"
[clients]
total_clients = {total}
per_round = {per_round}
min_per_round = {min}
own_data_clients = {own}
max_samples = {max_samples}
comm_simulation = false
do_test = true

[server]
port = {port}
registration_timeout = 60
random_seed = 4

[data]
datasource = "FashionMNIST"
download = false
partition_sizes = [{partition_sizes}]

[trainer]
rounds = 2
epochs = 1
batch_size = {BATCH_SIZE}
max_concurrency = 1
optimizer = "sgd"
model_name = "lenet5"
model_seed = 3
training_seed = 5

[parameters.optimizer]
learning_rate = 0.05

[results]
keep_client_updates = true
"#,
        min = per_round - u32::from(own < total)
    )
}

fn server(dir: &Path, config_text: &str, extra: &[&str]) -> (PathBuf, Child) {
    let config = write_config(dir, config_text);
    let base = dir.join("runs");
    let mut args = vec![
        "run",
        "--config",
        config.to_str().unwrap(),
        "--cpu",
        "--quiet",
        "--base",
        base.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let child = start(cohort(&args));
    (base, child)
}

/// One row of `clients.csv`.
#[derive(Debug)]
struct Row {
    round: u32,
    client: u32,
    samples: String,
    histogram: String,
    test_accuracy: String,
    dropped: String,
}

fn clients_csv(run_dir: &Path) -> Vec<Row> {
    let text = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    text.lines()
        .skip(1)
        .map(|line| {
            let f: Vec<&str> = line.splitn(12, ',').collect();
            Row {
                round: f[0].parse().unwrap(),
                client: f[1].parse().unwrap(),
                samples: f[3].to_owned(),
                histogram: f[9].to_owned(),
                test_accuracy: f[10].to_owned(),
                dropped: f[11].trim_matches('"').to_owned(),
            }
        })
        .collect()
}

fn decode_file(path: &Path) -> ParamTree {
    codec::decode(&std::fs::read(path).unwrap(), &DecodeLimits::default()).unwrap()
}

/// Round `round`'s model recomputed from the updates the server kept: FedAvg
/// through cohort-core's strategy, weighted by the samples `clients.csv`
/// gives, in its (selection) order, from the global model of the round
/// before (its checkpoint). `clients.csv`'s numbers are checked beforehand.
fn assert_fedavg(run_dir: &Path, round: u32, rows: &[Row], total_clients: u32) {
    let weights: Vec<(u32, u64)> = rows
        .iter()
        .filter(|r| r.round == round && r.dropped.is_empty())
        .map(|r| (r.client, r.samples.parse().unwrap()))
        .collect();
    let global =
        decode_file(&run_dir.join(format!("checkpoints/round-{:04}.safetensors", round - 1)));
    let folder = run_dir.join(format!("updates/round-{round:04}"));
    let trees: Vec<ParamTree> = weights
        .iter()
        .map(|(id, _)| decode_file(&folder.join(format!("client-{id:04}.safetensors"))))
        .collect();
    let updates: Vec<ClientUpdate<'_>> = weights
        .iter()
        .zip(&trees)
        .map(|(&(client_id, num_samples), tree)| ClientUpdate {
            client_id,
            num_samples,
            local_steps: num_samples.div_ceil(BATCH_SIZE),
            tree,
        })
        .collect();
    let context = RoundContext {
        round,
        learning_rate: 0.05,
        per_round: weights.len() as u32,
        total_clients,
    };
    let expected = AlgorithmConfig::default()
        .build()
        .aggregate(&context, &global, &updates)
        .unwrap()
        .model
        .unwrap();
    let model = run_dir.join(if round == 2 {
        "model.safetensors".to_owned()
    } else {
        format!("checkpoints/round-{round:04}.safetensors")
    });
    assert!(
        decode_file(&model) == expected,
        "round {round}: the model is not the sample-weighted FedAvg of {weights:?}"
    );
}

fn refused(command: Command, needle: &str) {
    let output = start(command).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{needle}: the claim was accepted");
    assert!(
        stderr.contains("the server refused this client") && stderr.contains(needle),
        "{needle}: {stderr}"
    );
}

#[test]
fn three_clients_with_their_own_data_give_the_sample_weighted_fedavg() {
    let dir = tempfile::tempdir().unwrap();
    let (train, test) = (fixture_split("train"), fixture_split("t10k"));
    // Different sizes and label mixes: classes 0–4 only, 5–9 only, all ten.
    let first = dir.path().join("first");
    write_idx_folder(
        &first,
        &pick(&train, 150, |l| l < 5),
        &pick(&test, 40, |l| l < 5),
    );
    let second = dir.path().join("second.safetensors");
    write_safetensors(
        &second,
        &pick(&train, 70, |l| l >= 5),
        Some(&pick(&test, 30, |l| l >= 5)),
        false,
    );
    let third = dir.path().join("third.safetensors");
    write_safetensors(&third, &pick(&train, 260, |_| true), None, true);
    let too_big = dir.path().join("too_big.safetensors");
    write_safetensors(&too_big, &pick(&train, 400, |_| true), None, false);

    let port = free_port();
    let (base, server) = server(dir.path(), &job(port, (3, 3, 3), "100, 100, 100", 300), &[]);
    let first_client = start(own_data_client(port, &first, Some(1)));
    wait_for_log(&base, "own-data client registered", 1);
    refused(
        own_data_client(port, &second, Some(1)),
        "client id 1 is already held",
    );
    refused(
        own_data_client(port, &second, Some(7)),
        "client id 7 is not an own-data client of this run: ids are 1 to 3",
    );
    refused(
        own_data_client(port, &too_big, None),
        "400 training samples declared; this server accepts 1 to 300 (clients.max_samples)",
    );
    let second_client = start(own_data_client(port, &second, Some(2)));
    // Without --client-id: the lowest id no one holds.
    let third_client = start(own_data_client(port, &third, None));
    finish(server, "cohort run");
    for (child, name) in [
        (first_client, "client 1"),
        (second_client, "client 2"),
        (third_client, "client 3"),
    ] {
        finish(child, name);
    }

    let run_dir = common::only_run_dir(&base);
    let rows = clients_csv(&run_dir);
    assert_eq!(rows.len(), 6, "{rows:?}");
    for row in &rows {
        let (samples, held_out) = match row.client {
            1 => ("150", true),
            2 => ("70", true),
            3 => ("260", false),
            other => panic!("client {other}"),
        };
        assert_eq!(
            (row.samples.as_str(), row.dropped.as_str()),
            (samples, ""),
            "{row:?}"
        );
        // The server never sees an own-data client's labels.
        assert_eq!(row.histogram, "", "{row:?}");
        assert_eq!(!row.test_accuracy.is_empty(), held_out, "{row:?}");
    }
    assert_fedavg(&run_dir, 2, &rows, 3);
    let results = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 3, "{results}");
}

/// A hostile own-data client speaking the real protocol: it declares 10
/// samples, reports 1000 in round 1 (with an honest-looking update: the global
/// model back), then leaves when its round-2 task arrives.
async fn over_reporting_client(address: String) {
    let started = Instant::now();
    let mut client = loop {
        match FederationClient::connect(format!("http://{address}")).await {
            Ok(client) => break client,
            Err(error) if started.elapsed() > Duration::from_secs(60) => panic!("{error}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let (sender, receiver) = tokio::sync::mpsc::channel(8);
    let register = Kind::Register(proto::Register {
        token: String::new(),
        name: "over-reporting".into(),
        protocol: PROTOCOL_VERSION,
        own_data: Some(proto::OwnData {
            client_id: 2,
            train_samples: 10,
            test_samples: 0,
        }),
    });
    sender
        .send(ClientMessage {
            kind: Some(register),
        })
        .await
        .unwrap();
    let mut inbound = client
        .join(ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    let mut payload = Vec::new();
    let mut task: Option<proto::Task> = None;
    while let Ok(Some(message)) = inbound.message().await {
        match message.kind {
            Some(ServerKind::Task(t)) if t.round == 1 => task = Some(t),
            Some(ServerKind::Task(_)) => return,
            Some(ServerKind::Chunk(chunk)) => payload.extend_from_slice(&chunk.data),
            _ => {}
        }
        let Some(t) = task
            .as_ref()
            .filter(|t| payload.len() as u64 == t.payload_bytes)
        else {
            continue;
        };
        let report = Kind::Report(proto::Report {
            client_id: t.client_id,
            round: t.round,
            num_samples: 1000,
            loss: 0.5,
            training_time: 0.01,
            payload_bytes: payload.len() as u64,
            local_steps: 1000u64.div_ceil(BATCH_SIZE),
            ..Default::default()
        });
        sender
            .send(ClientMessage { kind: Some(report) })
            .await
            .unwrap();
        let chunk = Kind::Chunk(proto::Chunk {
            data: std::mem::take(&mut payload),
        });
        sender
            .send(ClientMessage { kind: Some(chunk) })
            .await
            .unwrap();
        task = None;
    }
}

#[test]
fn a_mixed_run_has_own_data_and_simulated_clients_and_drops_a_lying_one() {
    let dir = tempfile::tempdir().unwrap();
    let train = fixture_split("train");
    let test = fixture_split("t10k");
    let own = dir.path().join("own");
    write_idx_folder(
        &own,
        &pick(&train, 90, |l| l % 2 == 0),
        &pick(&test, 20, |l| l % 2 == 0),
    );

    // Clients 1 and 2 bring their own data; 3 and 4 train partitions of the
    // fixture on the one worker process the server starts.
    let port = free_port();
    let config = job(port, (4, 4, 2), "50, 50, 80, 40", 1000);
    let (base, server) = server(dir.path(), &config, &["--local-clients", "1"]);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let liar = runtime.spawn(over_reporting_client(format!("127.0.0.1:{port}")));
    let own_client = start(own_data_client(port, &own, Some(1)));
    finish(server, "cohort run");
    finish(own_client, "own-data client 1");
    runtime.block_on(liar).unwrap();

    let run_dir = common::only_run_dir(&base);
    let rows = clients_csv(&run_dir);
    assert_eq!(rows.len(), 8, "{rows:?}");
    for row in &rows {
        match row.client {
            1 => assert_eq!(
                (row.samples.as_str(), row.histogram.as_str()),
                ("90", ""),
                "{row:?}"
            ),
            2 if row.round == 1 => assert!(
                row.dropped
                    .contains("reports 1000 training samples; it declared 10"),
                "{row:?}"
            ),
            2 => assert!(
                !row.dropped.is_empty(),
                "the client that left is dropped: {row:?}"
            ),
            3 | 4 => {
                let samples = if row.client == 3 { "64" } else { "32" };
                assert_eq!(
                    (row.samples.as_str(), row.dropped.as_str()),
                    (samples, ""),
                    "{row:?}"
                );
                assert!(!row.histogram.is_empty(), "{row:?}");
            }
            other => panic!("client {other}"),
        }
    }
    assert_fedavg(&run_dir, 2, &rows, 4);
}
