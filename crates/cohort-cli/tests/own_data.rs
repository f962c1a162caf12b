//! Clients with their own data (`cohort client --data`, `clients.own_data_clients`):
//! three clients bring datasets of different sizes and label mixes, written by
//! the test from the fixture, and the server's model is the sample-weighted
//! FedAvg of their updates, recomputed here; claims that are out of range,
//! taken or too large are refused; a mixed run has own-data clients and
//! simulated ones, and an own-data client that over-reports its samples or
//! leaves is dropped from its round while the run goes on, also when the
//! server is asynchronous.

mod common;
mod own_support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use cohort_runtime::grpc::PROTOCOL_VERSION;
use cohort_runtime::grpc::proto::client_message::Kind;
use cohort_runtime::grpc::proto::federation_client::FederationClient;
use cohort_runtime::grpc::proto::server_message::Kind as ServerKind;
use cohort_runtime::grpc::proto::{self, ClientMessage};
use common::free_port;
use own_support::*;
use tokio_stream::wrappers::ReceiverStream;

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

    // Every client brings its own data: the server holds the test set alone
    // (for its evaluation), and `cohort check` asks for nothing more.
    let port = free_port();
    let config = job(port, (3, 3, 3), "100, 100, 100", 300);
    let server_data = test_files_only(dir.path());
    let checked = check_on(dir.path(), &config, &server_data);
    assert!(
        checked.status.success(),
        "cohort check: {}",
        String::from_utf8_lossy(&checked.stderr)
    );
    let notes = String::from_utf8_lossy(&checked.stdout);
    assert!(
        notes.contains("200 test samples; every client brings its own training data"),
        "{notes}"
    );
    let (base, server) = server_on(dir.path(), &config, &[], &server_data);
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
    // Without --client-id: the lowest id no one holds, once client 2 holds its own.
    wait_for_log(&base, "own-data client registered", 2);
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
    // The server evaluated every round on the test set it held.
    for line in results.lines().skip(1) {
        let accuracy: f64 = line.split(',').nth(1).unwrap().parse().unwrap();
        assert!(accuracy > 0.0, "{results}");
    }
    let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    assert!(
        log.contains("loaded the test set of FashionMNIST"),
        "run.log: {log}"
    );
}

/// `cohort check --config` on `config_text` with its data sets under `data_root`.
fn check_on(dir: &Path, config_text: &str, data_root: &Path) -> std::process::Output {
    let config = common::write_config(dir, config_text);
    let mut command = cohort(&["check", "--config", config.to_str().unwrap()]);
    command.env("COHORT_DATA_DIR", data_root);
    command.output().unwrap()
}

/// A hostile own-data client speaking the real protocol: it declares 10
/// samples, reports 1000 in round 1 (with an honest-looking update: the global
/// model back), then leaves when its round-2 task arrives.
/// Own-data client 2 over the real protocol: it declares 10 samples and
/// reports 1000 for its task of round 1, then leaves at its next task, or
/// with `every_task` answers every task so.
async fn over_reporting_client(address: String, every_task: bool) {
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
            Some(ServerKind::Task(t)) if every_task || t.round == 1 => task = Some(t),
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
            data: std::mem::take(&mut payload).into(),
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
    // Partitions are cut from the training set, so the server needs it.
    let checked = check_on(dir.path(), &config, &test_files_only(dir.path()));
    let problems = String::from_utf8_lossy(&checked.stderr);
    assert!(
        !checked.status.success()
            && problems.contains("train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz missing"),
        "cohort check without the training set: {problems}"
    );
    let (base, server) = server(dir.path(), &config, &["--local-clients", "1"]);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let liar = runtime.spawn(over_reporting_client(format!("127.0.0.1:{port}"), false));
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

#[test]
fn an_asynchronous_server_admits_own_data_updates_and_refuses_a_lying_one() {
    let dir = tempfile::tempdir().unwrap();
    let (train, test) = (fixture_split("train"), fixture_split("t10k"));
    let own = dir.path().join("own");
    write_idx_folder(
        &own,
        &pick(&train, 90, |l| l % 2 == 0),
        &pick(&test, 20, |l| l % 2 == 0),
    );
    // Both clients bring their own data and both places are always theirs:
    // client 1 honest, client 2 over-reporting every task.
    let port = free_port();
    let config = job(port, (2, 2, 2), "100, 100", 1000)
        .replace("min_per_round = 2\n", "")
        .replace(
            "random_seed = 4",
            "random_seed = 4\nsynchronous = false\nstaleness_bound = 10",
        )
        .replace("rounds = 2", "rounds = 3");
    let (base, server) = server_on(dir.path(), &config, &[], &test_files_only(dir.path()));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let liar = runtime.spawn(over_reporting_client(format!("127.0.0.1:{port}"), true));
    let own_client = start(own_data_client(port, &own, Some(1)));
    finish(server, "cohort run");
    finish(own_client, "own-data client 1");
    runtime.block_on(liar).unwrap();

    let rows = clients_csv(&common::only_run_dir(&base));
    let aggregated: Vec<&Row> = rows.iter().filter(|r| r.dropped.is_empty()).collect();
    assert_eq!(
        aggregated
            .iter()
            .map(|r| (r.round, r.client))
            .collect::<Vec<_>>(),
        [(1, 1), (2, 1), (3, 1)],
        "{rows:?}"
    );
    assert!(aggregated.iter().all(|r| r.samples == "90"), "{rows:?}");
    let refused: Vec<&Row> = rows.iter().filter(|r| r.client == 2).collect();
    assert!(!refused.is_empty(), "{rows:?}");
    assert!(
        refused.iter().all(|r| r
            .dropped
            .contains("update refused: reports 1000 training samples; it declared 10")),
        "{rows:?}"
    );
}

/// A run of a file data set (CSV) whose clients bring their own CSV files
/// and hold none of the server's, one with its labels in a column of
/// another name (`--label-column`). The clients learn the data set's
/// classes from the config the server sends; the model is their
/// sample-weighted FedAvg.
#[test]
fn own_data_clients_of_a_csv_run_bring_their_own_files() {
    let dir = tempfile::tempdir().unwrap();
    let tabular = common::fixture_data().join("../tabular");
    let server_data = dir.path().join("server-data");
    std::fs::create_dir_all(&server_data).unwrap();
    for name in ["train.csv", "test.csv"] {
        std::fs::copy(tabular.join(name), server_data.join(name)).unwrap();
    }
    let text = std::fs::read_to_string(tabular.join("train.csv")).unwrap();
    let mut lines = text.lines();
    let header = lines.next().unwrap();
    let rows: Vec<&str> = lines.collect();
    // Client 1: 100 rows, the label column renamed.
    let first = dir.path().join("first.csv");
    let renamed = header.replace("label", "target");
    std::fs::write(&first, format!("{renamed}\n{}\n", rows[..100].join("\n"))).unwrap();
    // Client 2: 150 other rows, `label` as the data set names it.
    let second = dir.path().join("second.csv");
    std::fs::write(
        &second,
        format!("{header}\n{}\n", rows[100..250].join("\n")),
    )
    .unwrap();
    let port = free_port();
    let config = format!(
        r#"
[clients]
total_clients = 2
per_round = 2
own_data_clients = 2
comm_simulation = false

[server]
port = {port}
registration_timeout = 60

[data]
datasource = "CSV"
train_file = "train.csv"
test_file = "test.csv"
label_column = "label"

[trainer]
rounds = 2
epochs = 1
batch_size = 10
max_concurrency = 1
optimizer = "sgd"
model_name = "multilayer"

[parameters.model]
hidden = [8]

[parameters.optimizer]
learning_rate = 0.1

[results]
keep_client_updates = true
"#
    );
    let (base, server) = server_on(dir.path(), &config, &[], &server_data);
    let mut renamed_client = own_data_client(port, &first, Some(1));
    renamed_client.args(["--label-column", "target"]);
    let first_client = start(renamed_client);
    let second_client = start(own_data_client(port, &second, Some(2)));
    finish(server, "cohort run");
    finish(first_client, "client 1");
    finish(second_client, "client 2");
    let run_dir = common::only_run_dir(&base);
    let rows = clients_csv(&run_dir);
    assert_eq!(rows.len(), 4, "{rows:?}");
    for row in &rows {
        let samples = if row.client == 1 { "100" } else { "150" };
        assert_eq!(
            (row.samples.as_str(), row.dropped.as_str()),
            (samples, ""),
            "{row:?}"
        );
    }
    assert_fedavg(&run_dir, 2, &rows, 2);
}
