//! No single client, file or start can crash, poison or clobber a run: the
//! inputs that once did, replayed against the real binary.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use cohort_core::tree::{Array, ArrayData, ParamTree};
use cohort_runtime::grpc::proto::client_message::Kind;
use cohort_runtime::grpc::proto::federation_client::FederationClient;
use cohort_runtime::grpc::proto::server_message::Kind as ServerKind;
use cohort_runtime::grpc::proto::{self, ClientMessage};
use cohort_runtime::grpc::{CHUNK_BYTES, PROTOCOL_VERSION};
use common::{cohort, fixture_data, free_port, only_run_dir, run_config, write_config};
use tokio_stream::wrappers::ReceiverStream;

/// Two logical clients of 100 samples, one round; a round needs one update.
fn network_job(port: u16) -> String {
    format!(
        r#"
[clients]
total_clients = 2
per_round = 2
min_per_round = 1
comm_simulation = false
[server]
port = {port}
registration_timeout = 60
payload_timeout = 60
[data]
datasource = "FashionMNIST"
download = false
partition_sizes = [100, 100]
[trainer]
rounds = 1
epochs = 1
batch_size = 20
max_concurrency = 2
optimizer = "sgd"
model_seed = 3
training_seed = 5
[parameters.optimizer]
learning_rate = 0.05
[results]
keep_client_updates = true
"#
    )
}

/// How the rogue client spoils the global model it received.
#[derive(Clone, Copy)]
enum Spoil {
    /// One weight matrix with its dimensions swapped.
    Transpose,
    /// A NaN in the first leaf.
    NaN,
    /// An honest-looking model, but `num_samples = 2^64 − 1`.
    HugeSampleCount,
}

/// Registers and answers every task it is given with the spoiled global model,
/// a few seconds late: by then the honest client process has surely taken the
/// round's other task.
async fn rogue_client(address: String, spoil: Spoil) {
    let mut client = loop {
        match FederationClient::connect(format!("http://{address}")).await {
            Ok(client) => break client,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let (sender, receiver) = tokio::sync::mpsc::channel(8);
    let register = Kind::Register(proto::Register {
        token: String::new(),
        name: "rogue".into(),
        protocol: PROTOCOL_VERSION,
        own_data: None,
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
    let mut task = None;
    let mut payload = Vec::new();
    while let Ok(Some(message)) = inbound.message().await {
        match message.kind {
            Some(ServerKind::Task(t)) => {
                task = Some(t);
                payload.clear();
            }
            Some(ServerKind::Chunk(chunk)) => payload.extend_from_slice(&chunk.data),
            _ => {}
        }
        let complete = task
            .as_ref()
            .is_some_and(|t| payload.len() as u64 >= t.payload_bytes);
        if complete && let Some(task) = task.take() {
            tokio::time::sleep(Duration::from_secs(3)).await;
            answer(&sender, &task, &payload, spoil).await;
        }
    }
}

async fn answer(
    sender: &tokio::sync::mpsc::Sender<ClientMessage>,
    task: &proto::Task,
    payload: &[u8],
    spoil: Spoil,
) {
    let global = cohort_core::codec::decode(payload, &Default::default()).unwrap();
    let update = cohort_core::codec::encode(&spoiled(global, spoil)).unwrap();
    let report = Kind::Report(proto::Report {
        client_id: task.client_id,
        round: task.round,
        num_samples: match spoil {
            Spoil::HugeSampleCount => u64::MAX,
            _ => 100,
        },
        loss: 0.5,
        training_time: 0.1,
        processing_time: 0.0,
        payload_bytes: update.len() as u64,
        local_steps: 5,
        ..Default::default()
    });
    let _ = sender.send(ClientMessage { kind: Some(report) }).await;
    for chunk in update.chunks(CHUNK_BYTES) {
        let chunk = Kind::Chunk(proto::Chunk {
            data: chunk.to_vec().into(),
        });
        let _ = sender.send(ClientMessage { kind: Some(chunk) }).await;
    }
}

fn spoiled(global: ParamTree, spoil: Spoil) -> ParamTree {
    let mut tree = global.flatten();
    match spoil {
        Spoil::Transpose => {
            let (_, array) = tree
                .leaves
                .iter_mut()
                .find(|(_, a)| a.shape().len() == 2 && a.shape()[0] != a.shape()[1])
                .expect("LeNet-5 has a rectangular weight matrix");
            let shape = vec![array.shape()[1], array.shape()[0]];
            *array = Array::new(shape, array.data().clone()).unwrap();
        }
        Spoil::NaN => {
            if let ArrayData::F32(values) = tree.leaves[0].1.data_mut() {
                values[0] = f32::NAN;
            }
        }
        Spoil::HugeSampleCount => {}
    }
    tree.unflatten().unwrap()
}

#[test]
fn one_spoiled_update_is_dropped_and_the_round_aggregates_the_honest_one() {
    for (spoil, reason) in [
        (Spoil::Transpose, "does not match the global model"),
        (Spoil::NaN, "is not finite"),
        (
            Spoil::HugeSampleCount,
            "reports 18446744073709551615 training samples",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let config = write_config(dir.path(), &network_job(port));
        let base = dir.path().join("runs");
        let server = Command::new(env!("CARGO_BIN_EXE_cohort"))
            .args([
                "run",
                "--config",
                config.to_str().unwrap(),
                "--cpu",
                "--quiet",
            ])
            .args(["--local-clients", "0", "--base", base.to_str().unwrap()])
            .env("COHORT_DATA_DIR", fixture_data())
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let address = format!("127.0.0.1:{port}");
        let mut honest = Command::new(env!("CARGO_BIN_EXE_cohort"))
            .args(["client", "--server", &address, "--cpu"])
            .env("COHORT_DATA_DIR", fixture_data())
            .env_remove("COHORT_TOKEN")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("honest.log")).unwrap())
            .spawn()
            .unwrap();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(120),
                rogue_client(address.clone(), spoil),
            )
            .await
            .expect("the server ended the rogue's session")
        });
        let output = server.wait_with_output().unwrap();
        let _ = honest.wait();
        assert!(
            output.status.success(),
            "{reason}: {}\nhonest client: {}",
            String::from_utf8_lossy(&output.stderr),
            std::fs::read_to_string(dir.path().join("honest.log")).unwrap_or_default()
        );
        let run_dir = only_run_dir(&base);
        let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
        assert!(log.contains("update refused, client dropped"), "{log}");
        assert!(log.contains(reason), "{reason}: {log}");
        // The round is the honest update alone: FedAvg of one model is that model.
        // clients.csv: the honest row, and the rogue's with the reason.
        let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
        assert_eq!(clients.lines().count(), 3, "{clients}");
        let (used, dropped): (Vec<&str>, Vec<&str>) =
            clients.lines().skip(1).partition(|row| row.ends_with(','));
        assert_eq!((used.len(), dropped.len()), (1, 1), "{clients}");
        assert!(dropped[0].contains("update refused"), "{clients}");
        assert!(dropped[0].contains(reason), "{reason}: {clients}");
        let honest_id: u32 = used[0].split(',').nth(1).unwrap().parse().unwrap();
        let kept = run_dir.join(format!(
            "updates/round-0001/client-{honest_id:04}.safetensors"
        ));
        assert_eq!(
            std::fs::read(run_dir.join("model.safetensors")).unwrap(),
            std::fs::read(kept).unwrap()
        );
    }
}

#[test]
fn two_runs_started_at_once_get_two_folders() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "[clients]\ntotal_clients = 2\n[data]\ndatasource = \"FashionMNIST\"\ndownload = false\npartition_size = 50\n[trainer]\nrounds = 1\nepochs = 1\n[parameters.optimizer]\nlearning_rate = 0.01\n",
    );
    let base = dir.path().join("runs");
    let start = || {
        Command::new(env!("CARGO_BIN_EXE_cohort"))
            .args([
                "run",
                "--config",
                config.to_str().unwrap(),
                "--cpu",
                "--quiet",
            ])
            .args(["--base", base.to_str().unwrap()])
            .env("COHORT_DATA_DIR", fixture_data())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (start(), start());
    for child in [a, b] {
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let folders: Vec<_> = std::fs::read_dir(&base)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(folders.len(), 2, "{folders:?}");
    for folder in folders {
        let csv = std::fs::read_to_string(folder.join("results.csv")).unwrap();
        assert_eq!(csv.lines().count(), 2, "{}: {csv}", folder.display());
    }
}

#[test]
fn a_run_killed_before_its_first_checkpoint_resumes_from_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "[clients]\ntotal_clients = 2\n[data]\ndatasource = \"FashionMNIST\"\ndownload = false\npartition_size = 50\n[trainer]\nrounds = 2\nepochs = 1\nmodel_seed = 1\ntraining_seed = 1\n[parameters.optimizer]\nlearning_rate = 0.01\n",
    );
    let whole = dir.path().join("whole");
    let output = run_config(&config, &whole, &[]);
    assert!(output.status.success());
    let whole = only_run_dir(&whole);
    // What a kill right after start leaves: the run folder and its config.
    let killed = dir.path().join("killed");
    std::fs::create_dir_all(&killed).unwrap();
    std::fs::copy(whole.join("config.toml"), killed.join("config.toml")).unwrap();
    let output = cohort(
        &[
            "run",
            "--resume",
            killed.to_str().unwrap(),
            "--cpu",
            "--quiet",
        ],
        &fixture_data(),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        std::fs::read(killed.join("model.safetensors")).unwrap(),
        std::fs::read(whole.join("model.safetensors")).unwrap()
    );
    let log = std::fs::read_to_string(killed.join("run.log")).unwrap();
    assert!(log.contains("no checkpoint yet"), "{log}");
}

#[test]
fn a_model_file_with_a_200000_segment_name_is_an_error_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let name = vec!["a"; 200_000].join(".");
    let header =
        format!("{{\"{name}\":{{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}}}");
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 4]);
    let path = dir.path().join("deep.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let output = cohort(
        &["compare", path.to_str().unwrap(), path.to_str().unwrap()],
        Path::new("."),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("segments"), "{stderr}");
    assert!(!stderr.contains("overflowed"), "{stderr}");
}

/// `cohort check … | head`: a reader that leaves early must end the command
/// quietly (as `cat` ends), not with a panic about a broken pipe.
#[cfg(unix)]
#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let config = common::repo_root().join("configs/fashion_mnist/fedavg_lenet5_r1.toml");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let output = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["check", "--config", config.to_str().unwrap()])
        .env("COHORT_DATA_DIR", fixture_data())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(output.status.signal(), Some(libc_sigpipe()), "{stderr}");
}

/// SIGPIPE's number on every Unix cohort builds for.
#[cfg(unix)]
fn libc_sigpipe() -> i32 {
    13
}

/// A model with a NaN has no accuracy: `cohort evaluate` says so instead of
/// scoring its constant guesses.
#[test]
fn evaluating_a_non_finite_model_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut tree = cohort_train::params::extract(&cohort_train::model::LeNet5::new(
        10,
        &cohort_train::device::cpu(),
    ));
    if let ArrayData::F32(values) = tree.leaves_mut()[0].data_mut() {
        values[3] = f32::NAN;
    }
    let model = dir.path().join("nan.safetensors");
    std::fs::write(&model, cohort_core::codec::encode(&tree).unwrap()).unwrap();
    let config = common::repo_root().join("configs/fashion_mnist/fedavg_lenet5_r1.toml");
    let output = cohort(
        &[
            "evaluate",
            "--config",
            config.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--cpu",
        ],
        &fixture_data(),
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("[3] is not finite"), "{stderr}");

    // Nor has it a distance to itself.
    let compared = cohort(
        &["compare", model.to_str().unwrap(), model.to_str().unwrap()],
        &fixture_data(),
    );
    let stderr = String::from_utf8_lossy(&compared.stderr);
    assert!(!compared.status.success(), "{stderr}");
    assert!(
        stderr.contains("[3] is not finite") && !stderr.contains("relative L2"),
        "{stderr}"
    );
}

/// Paths that name a device, a FIFO or a link to one: every reader refuses
/// them at once instead of reading forever or blocking.
#[cfg(unix)]
#[test]
fn readers_refuse_devices_fifos_and_links_to_them() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    std::os::unix::fs::symlink("/dev/zero", run.join("results.csv")).unwrap();
    let fifo = fifo.to_str().unwrap();
    let run = run.to_str().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &["compare", "/dev/zero", "/dev/zero"],
            "/dev/zero is not a regular file (a device)",
        ),
        (&["compare", fifo, fifo], "is not a regular file (a FIFO)"),
        (
            &["plot", run],
            "results.csv is not a regular file (a device)",
        ),
        (
            &["client", "--server", "127.0.0.1:9", "--data", "/dev/zero"],
            "not a regular file",
        ),
    ];
    for (args, expected) in cases {
        let output = cohort(args, &fixture_data());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}
