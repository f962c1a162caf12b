//! The `mpi` backend under Open MPI's own launcher: `mpirun -n 3 cohort run`
//! trains each rank's block of clients and ends with the model of the same
//! config run in one process, bit for bit. Built only with the `mpi` feature;
//! in that profile a missing `mpirun` is a failure, not a skip.
#![cfg(feature = "mpi")]

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{
    fixture_data, only_run_dir, real_data_dir, repo_root, single_process_model, write_config,
};

/// `mpirun -n ranks cohort run --config CONFIG --base BASE --cpu --quiet`.
fn mpirun(ranks: u32, config: &Path, base: &Path, data: &Path) -> Output {
    Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-n",
            &ranks.to_string(),
        ])
        // Every rank reads the data; mpirun passes only what -x names to remote nodes.
        .args(["-x", "COHORT_DATA_DIR"])
        .arg(env!("CARGO_BIN_EXE_cohort"))
        .args(["run", "--config", config.to_str().unwrap()])
        .args(["--base", base.to_str().unwrap(), "--cpu", "--quiet"])
        .env("COHORT_DATA_DIR", data)
        .env_remove("RUST_LOG")
        .output()
        .expect("mpirun runs (install openmpi-bin; this test is built with --features mpi)")
}

fn assert_same_model_under_mpirun(config: &Path, data: &Path, rounds: usize) {
    let dir = tempfile::tempdir().unwrap();
    let expected = single_process_model(config, &dir.path().join("single"), data);
    let base = dir.path().join("mpi");
    let output = mpirun(3, config, &base, data);
    assert!(
        output.status.success(),
        "mpirun: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Rank 0 alone writes a run folder.
    let run_dir = only_run_dir(&base);
    let results = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), rounds + 1, "{results}");
    let model = std::fs::read(run_dir.join("model.safetensors")).unwrap();
    assert!(
        model == expected,
        "the 3-rank MPI model differs from the single-process one"
    );
}

#[test]
fn three_mpi_ranks_give_the_single_process_model_on_the_fixture() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        r#"
[clients]
total_clients = 6
per_round = 4
[data]
datasource = "FashionMNIST"
download = false
partition_size = 40
[trainer]
rounds = 3
epochs = 1
batch_size = 10
max_concurrency = 1
optimizer = "sgd"
model_seed = 3
training_seed = 5
[parameters.optimizer]
learning_rate = 0.05
"#,
    );
    assert_same_model_under_mpirun(&config, &fixture_data(), 3);
}

/// The issue's check: R1 as shipped, on three MPI ranks.
#[test]
#[ignore = "needs the full datasets in COHORT_DATA_DIR: .ci/run runs ignored tests"]
fn r1_under_mpirun_with_three_ranks_equals_the_single_process_run() {
    let data = real_data_dir(&["fashion-mnist/train-images-idx3-ubyte.gz"]);
    let config = repo_root().join("configs/fashion_mnist/fedavg_lenet5_r1.toml");
    assert_same_model_under_mpirun(&config, &data, 5);
}
