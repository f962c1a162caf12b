//! A client in another language: `examples/python_client/grpc_client.py` (grpcio stubs
//! generated from cohort.proto at run time, numpy LeNet-5) joins a
//! network-mode run as own-data client 1 beside a `cohort client` worker
//! that trains clients 2 and 3 on the fixture. Its updates must be
//! aggregated in both rounds, and the model must be the sample-weighted
//! FedAvg recomputed from the kept updates.

mod common;
mod own_support;

use std::process::Command;

use common::{free_port, repo_root};
use own_support::*;

const PREREQUISITE: &str =
    "needs python3 with numpy, safetensors and grpcio: .ci/run runs ignored tests";

fn python_ready() {
    let probe = Command::new("python3")
        .args(["-c", "import numpy, safetensors, grpc, grpc_tools"])
        .output();
    match probe {
        Ok(output) if output.status.success() => {}
        Ok(output) => panic!(
            "{PREREQUISITE} (pip install -r examples/python_client/requirements.txt): {}",
            String::from_utf8_lossy(&output.stderr)
        ),
        Err(error) => panic!("{PREREQUISITE}: cannot run python3: {error}"),
    }
}

fn job(port: u16) -> String {
    format!(
        r#"
[clients]
total_clients = 3
per_round = 3
own_data_clients = 1
comm_simulation = false
do_test = true

[server]
port = {port}
registration_timeout = 60
random_seed = 2

[data]
datasource = "FashionMNIST"
download = false
partition_sizes = [50, 100, 60]

[trainer]
rounds = 2
epochs = 1
batch_size = {BATCH_SIZE}
optimizer = "sgd"
model_name = "lenet5"
model_seed = 3

[parameters.optimizer]
learning_rate = 0.05
momentum = 0.9

[results]
keep_client_updates = true
"#
    )
}

#[test]
#[ignore = "needs python3 with numpy, safetensors and grpcio: .ci/run runs ignored tests"]
fn the_python_client_joins_a_network_round_and_its_update_is_aggregated() {
    python_ready();
    let example = repo_root().join("examples/python_client");
    let self_test = Command::new("python3")
        .arg(example.join("train.py"))
        .arg("--self-test")
        .output()
        .unwrap();
    assert!(
        self_test.status.success(),
        "train.py's backward pass: {}",
        String::from_utf8_lossy(&self_test.stderr)
    );

    let dir = tempfile::tempdir().unwrap();
    let (train, test) = (fixture_split("train"), fixture_split("t10k"));
    let data = dir.path().join("python.safetensors");
    write_safetensors(
        &data,
        &pick(&train, 120, |l| l != 3),
        Some(&pick(&test, 40, |l| l != 3)),
        false,
    );
    let port = free_port();
    let (base, server) = server(dir.path(), &job(port), &["--local-clients", "1"]);
    let mut python = Command::new("python3");
    python
        .arg(example.join("grpc_client.py"))
        .args(["--server", &format!("127.0.0.1:{port}"), "--data"])
        .arg(&data);
    let python = start(python);
    finish(server, "cohort run");
    let output = finish(python, "the Python client");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("registered as own-data client 1 (120 samples)"),
        "{stdout}"
    );

    let run_dir = common::only_run_dir(&base);
    let rows = clients_csv(&run_dir);
    assert_eq!(rows.len(), 6, "{rows:?}");
    for row in rows.iter().filter(|r| r.client == 1) {
        assert_eq!(
            (row.samples.as_str(), row.dropped.as_str()),
            ("120", ""),
            "{row:?}"
        );
        assert!(!row.test_accuracy.is_empty(), "{row:?}");
    }
    assert!(rows.iter().all(|r| r.dropped.is_empty()), "{rows:?}");
    // The Python client trained: its update is not the model it received.
    let global = decode_file(&run_dir.join("checkpoints/round-0001.safetensors"));
    let update = decode_file(&run_dir.join("updates/round-0002/client-0001.safetensors"));
    assert!(
        update != global,
        "the Python client sent the global model back"
    );
    assert_fedavg(&run_dir, 2, &rows, 3);
}
