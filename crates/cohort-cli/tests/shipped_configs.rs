//! Every config cohort ships runs to its end with the defaults it shows,
//! shortened only in rounds (and, for the 100-client vectorized job on a
//! CPU, in samples per client), on the real data sets; each strategy's
//! config learns within five rounds (DP-FedAvg's within 15).

mod common;

use std::path::{Path, PathBuf};

use common::{cohort, only_run_dir, real_data_dir, repo_root};

/// The shipped run configs: every `.toml` under `configs/` but the cluster
/// files, which describe machines, not runs.
fn shipped() -> Vec<PathBuf> {
    let mut configs = Vec::new();
    for folder in [
        "fashion_mnist",
        "mnist",
        "selection",
        "strategies",
        "tabular",
    ] {
        let dir = repo_root().join("configs").join(folder);
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                configs.push(path);
            }
        }
    }
    configs.sort();
    let expected_folders = std::fs::read_dir(repo_root().join("configs"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().is_dir())
        .count();
    assert_eq!(expected_folders, 6, "a new configs/ folder: list it above");
    configs
}

/// The data folder a config runs on. This machine has MNIST's test set
/// only, so the MNIST config runs on Fashion-MNIST's files under MNIST's
/// names (the same IDX format and sizes): what is checked is that the config
/// runs to its end, not MNIST's accuracy.
fn data_for(config: &Path, real: &Path, stand_in: &Path) -> PathBuf {
    let text = std::fs::read_to_string(config).unwrap();
    // A file data set's config points at the committed fixture.
    if text.contains("datasource = \"CSV\"") {
        return repo_root().join("tests/fixtures/tabular");
    }
    if !text.contains("datasource = \"MNIST\"") {
        return real.to_path_buf();
    }
    let mnist = stand_in.join("mnist");
    std::fs::create_dir_all(&mnist).unwrap();
    for file in [
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ] {
        let target = mnist.join(file);
        if !target.exists() {
            std::fs::copy(real.join("fashion-mnist").join(file), target).unwrap();
        }
    }
    stand_in.to_path_buf()
}

/// The final accuracy of `config` run for `rounds` rounds with `extra`
/// arguments.
fn run_to_end(config: &Path, data: &Path, rounds: u32, extra: &[&str]) -> f64 {
    let base = tempfile::tempdir().unwrap();
    let rounds = rounds.to_string();
    let mut args = vec![
        "run",
        "--config",
        config.to_str().unwrap(),
        "--cpu",
        "--quiet",
        "--base",
        base.path().to_str().unwrap(),
        "--rounds",
        &rounds,
    ];
    args.extend_from_slice(extra);
    let output = cohort(&args, data);
    assert!(
        output.status.success(),
        "{}: {}",
        config.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let csv = std::fs::read_to_string(only_run_dir(base.path()).join("results.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), rounds.parse::<usize>().unwrap(), "{csv}");
    rows.last()
        .unwrap()
        .split(',')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
#[ignore = "needs the full datasets in COHORT_DATA_DIR: .ci/run runs ignored tests"]
fn every_shipped_config_runs_to_its_end() {
    let real = real_data_dir(&["fashion-mnist/train-images-idx3-ubyte.gz"]);
    let stand_in = tempfile::tempdir().unwrap();
    let configs = shipped();
    assert!(configs.len() >= 19, "{configs:?}");
    for config in configs {
        let data = data_for(&config, &real, stand_in.path());
        let name = config.file_stem().unwrap().to_string_lossy().into_owned();
        // A selection policy's config is held to a strategy's standard.
        let parent = config.parent().unwrap();
        let strategy = parent.ends_with("strategies") || parent.ends_with("selection");
        // 100 clients of 6,000 samples a round are minutes on two cores;
        // 60 samples each keep the job's shape.
        let extra: &[&str] = if name == "vectorized_100" {
            &["--set", "data.partition_size=60"]
        } else {
            &[]
        };
        // DP-FedAvg's noise holds it near chance for its first ten rounds;
        // a FedAsync round is one client's update, so 30 of them are three
        // rounds' worth of the synchronous strategies' work.
        let rounds = match (strategy, name.as_str()) {
            (true, "dp_fedavg") => 15,
            (true, "fedasync") => 30,
            (true, _) => 5,
            (false, _) => 1,
        };
        let accuracy = run_to_end(&config, &data, rounds, extra);
        eprintln!("{name}: accuracy {accuracy:.4} after {rounds} rounds");
        if strategy {
            // Chance is 0.1: each strategy's own config is at 2.5 times that
            // within five rounds of 10 of 100 Dirichlet(0.5) clients (Krum,
            // the slowest, at 0.28; FedAvg at 0.55), DP-FedAvg's within 15
            // of 200 of 1,000 (its noise is drawn afresh each run: 0.43 to
            // 0.56 seen).
            let least = if name == "dp_fedavg" { 0.3 } else { 0.25 };
            assert!(
                accuracy > least,
                "{name}: accuracy {accuracy} after {rounds} rounds"
            );
        }
    }
}
