//! The package's own model and data set, trained by cohort three ways: from
//! Rust code with a per-round callback, through its own binary's `run`, and
//! in network mode with its own binary as server and client processes. All
//! three give the same model bit for bit. Clients that bring their own data
//! (feature vectors in a safetensors file) train the same model too.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use cohort_runtime::{MODEL_FILE, RunBuilder, RunOptions};
use cohort_train::device::DeviceRequest;

/// Chance is 1 in 4; the centres are well apart, so three rounds of FedAvg
/// learn far more than that.
const LEARNED: f64 = 0.9;

fn config_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("blobs.toml")
}

fn config_text() -> String {
    std::fs::read_to_string(config_path()).unwrap()
}

/// Runs `text` in this process; every round's accuracy and the final model file.
fn run_in_process(text: &str, run_dir: &Path) -> (Vec<f64>, Vec<u8>) {
    let loaded = cohort_core::config::from_str(text, &config_path()).unwrap();
    let options = RunOptions {
        device: DeviceRequest::Cpu,
        ..RunOptions::new(run_dir.to_path_buf())
    };
    let mut accuracies = Vec::new();
    RunBuilder::new(&loaded, options)
        .registry(Arc::new(own_model::registry()))
        .on_round(|row| accuracies.push(row.accuracy))
        .run()
        .unwrap();
    (accuracies, std::fs::read(run_dir.join(MODEL_FILE)).unwrap())
}

/// `own-model run --config CONFIG --cpu --quiet --base BASE EXTRA...`; the
/// model file of the run it made.
fn run_binary(config: &Path, base: &Path, extra: &[&str]) -> Vec<u8> {
    let output = Command::new(env!("CARGO_BIN_EXE_own-model"))
        .args(["run", "--config"])
        .arg(config)
        .args(["--cpu", "--quiet", "--base"])
        .arg(base)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let runs: Vec<PathBuf> = std::fs::read_dir(base)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    std::fs::read(runs[0].join(MODEL_FILE)).unwrap()
}

#[test]
fn from_rust_code_the_model_learns_and_each_round_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (accuracies, _) = run_in_process(&config_text(), &dir.path().join("run"));
    assert_eq!(accuracies.len(), 3, "{accuracies:?}");
    let last = accuracies[2];
    assert!(last > LEARNED, "accuracy after 3 rounds: {accuracies:?}");
}

#[test]
fn its_own_binary_runs_the_same_config_to_the_same_model_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (_, in_process) = run_in_process(&config_text(), &dir.path().join("run"));
    let from_binary = run_binary(&config_path(), &dir.path().join("runs"), &[]);
    assert_eq!(in_process, from_binary);
}

#[test]
fn a_network_round_with_its_own_binary_as_server_and_clients_equals_the_in_process_round() {
    let dir = tempfile::tempdir().unwrap();
    let one_round = config_text().replace("rounds = 3", "rounds = 1");
    let (_, in_process) = run_in_process(&one_round, &dir.path().join("run"));

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let network = one_round.replace(
        "per_round = 4\n",
        &format!(
            "per_round = 4\ncomm_simulation = false\n\n[server]\nport = {port}\n\
             registration_timeout = 60\n"
        ),
    );
    let config = dir.path().join("network.toml");
    std::fs::write(&config, network).unwrap();
    let over_grpc = run_binary(&config, &dir.path().join("runs"), &["--local-clients", "2"]);
    assert_eq!(in_process, over_grpc);
}

/// The training points of `blobs` from `range`, as a safetensors file of
/// float32 feature vectors, the way a Python client's `save_file` writes one.
fn write_own_data(path: &Path, range: std::ops::Range<usize>) {
    use safetensors::tensor::{Dtype, TensorView};
    let train = own_model::blobs::splits(7).train;
    let features = own_model::blobs::FEATURES;
    let inputs: Vec<u8> = train.inputs[range.start * features..range.end * features]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let labels: Vec<u8> = train.labels[range.clone()]
        .iter()
        .flat_map(|&l| i64::from(l).to_le_bytes())
        .collect();
    let views = [
        (
            "inputs",
            TensorView::new(Dtype::F32, vec![range.len(), features], &inputs).unwrap(),
        ),
        (
            "labels",
            TensorView::new(Dtype::I64, vec![range.len()], &labels).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn clients_that_bring_their_own_feature_vectors_train_the_packages_model() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let own = config_text().replace(
        "per_round = 4\n",
        &format!(
            "per_round = 2\nown_data_clients = 2\ncomm_simulation = false\n\n[server]\n\
             port = {port}\nregistration_timeout = 60\n"
        ),
    );
    let own = own.replace("total_clients = 4", "total_clients = 2");
    let config = dir.path().join("own.toml");
    std::fs::write(&config, own).unwrap();
    let halves = [0..1_000, 1_000..2_000];
    let files: Vec<PathBuf> = halves
        .iter()
        .enumerate()
        .map(|(i, range)| {
            let path = dir.path().join(format!("client{i}.safetensors"));
            write_own_data(&path, range.clone());
            path
        })
        .collect();
    let base = dir.path().join("runs");
    let server = Command::new(env!("CARGO_BIN_EXE_own-model"))
        .args(["run", "--config"])
        .arg(&config)
        .args(["--cpu", "--quiet", "--base"])
        .arg(&base)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let clients: Vec<_> = files
        .iter()
        .map(|file| {
            Command::new(env!("CARGO_BIN_EXE_own-model"))
                .args(["client", "--cpu", "--server", &format!("127.0.0.1:{port}")])
                .arg("--data")
                .arg(file)
                .args(["--connect-timeout", "60"])
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let output = server.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for client in clients {
        let output = client.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "{}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let run = std::fs::read_dir(&base)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let results = std::fs::read_to_string(run.join("results.csv")).unwrap();
    let rows = cohort_core::results::parse_results(&results, "results.csv").unwrap();
    assert_eq!(rows.len(), 3);
    let last = rows.last().unwrap();
    assert!(last.accuracy > LEARNED, "{results}");
    assert!(last.test_loss.is_some_and(|loss| loss < 0.5), "{results}");
}

#[test]
fn a_strategy_of_its_own_is_named_in_the_config_from_rust_and_through_its_binary() {
    let dir = tempfile::tempdir().unwrap();
    let damped = format!(
        "{}\n[algorithm]\ntype = \"damped_fedavg\"\ndamping = 0.5\n",
        config_text()
    )
    .replace("rounds = 3", "rounds = 2");
    let (accuracies, in_process) = run_in_process(&damped, &dir.path().join("run"));
    assert_eq!(accuracies.len(), 2);
    let config = dir.path().join("damped.toml");
    std::fs::write(&config, &damped).unwrap();
    let through_binary = run_binary(&config, &dir.path().join("runs"), &[]);
    assert_eq!(in_process, through_binary);
    // Damping changes the model: it is not FedAvg under another name.
    let plain = config_text().replace("rounds = 3", "rounds = 2");
    let (_, fedavg) = run_in_process(&plain, &dir.path().join("fedavg"));
    assert_ne!(in_process, fedavg);

    // A misspelled name is told apart from cohort's and the program's own
    // strategies; options the strategy refuses name it.
    for (section, needle) in [
        (
            "type = \"damped_fedvg\"\n",
            "unknown strategy `damped_fedvg` (did you mean `damped_fedavg`?)",
        ),
        (
            "type = \"damped_fedavg\"\ndamping = 2.0\n",
            "`damped_fedavg`: damping must be in (0, 1], got 2",
        ),
        (
            "type = \"damped_fedavg\"\ndampin = 0.5\n",
            "`damped_fedavg`: unknown field `dampin`",
        ),
    ] {
        let config = dir.path().join("bad.toml");
        std::fs::write(
            &config,
            format!("{}\n[algorithm]\n{section}", config_text()),
        )
        .unwrap();
        let output = Command::new(env!("CARGO_BIN_EXE_own-model"))
            .args(["check", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{section}: accepted");
        assert!(
            stderr.contains(needle) && stderr.contains("bad.toml"),
            "{section}: {stderr}"
        );
    }
}
