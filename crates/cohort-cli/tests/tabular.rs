//! File data sets (`data.datasource = "CSV"`, `"NPZ"`, `"Safetensors"`) end
//! to end: `cohort run` trains `multilayer` on each of the fixtures of
//! `scripts/make_tabular_fixtures.py` (3 classes, 4 features, 300 training
//! and 60 test samples, 6 clients), `cohort check` surveys them, and broken
//! files and configs fail naming the file and what was wrong.

mod common;

use std::path::{Path, PathBuf};

use common::{cohort, only_run_dir, repo_root, write_config};

fn tabular() -> PathBuf {
    repo_root().join("tests/fixtures/tabular")
}

/// A small run of `multilayer` on the file data set `data` (the keys of
/// `[data]`), 6 clients, all of them every round.
fn job(data: &str, extra: &str) -> String {
    format!(
        r#"
[clients]
total_clients = 6
per_round = 6

[data]
{data}

[trainer]
rounds = 3
epochs = 2
batch_size = 10
max_concurrency = 2
optimizer = "sgd"
model_name = "multilayer"
model_seed = 3
training_seed = 5

[parameters.model]
hidden = [32]
activation = "relu"
{extra}

[parameters.optimizer]
learning_rate = 0.1
momentum = 0.9
"#
    )
}

/// Runs `config_text` with `data_dir` as `COHORT_DATA_DIR`: the output and,
/// when it succeeded, the accuracy of each round.
fn run(config_text: &str, data_dir: &Path) -> (std::process::Output, Vec<f64>) {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), config_text);
    let base = dir.path().join("runs");
    let output = cohort(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--cpu",
            "--quiet",
            "--base",
            base.to_str().unwrap(),
        ],
        data_dir,
    );
    if !output.status.success() {
        return (output, Vec::new());
    }
    let csv = std::fs::read_to_string(only_run_dir(&base).join("results.csv")).unwrap();
    let accuracies = csv
        .lines()
        .skip(1)
        .map(|line| line.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    (output, accuracies)
}

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Three classes at random are 1/3; the blobs are far apart, so three
/// rounds of a small MLP reach well past chance: 0.8 is the margin asked.
const PAST_CHANCE: f64 = 0.8;

fn trains(data: &str) {
    let (output, accuracies) = run(&job(data, ""), &tabular());
    assert!(
        output.status.success(),
        "{data}\nstderr: {}",
        stderr(&output)
    );
    assert_eq!(accuracies.len(), 3, "{data}");
    let last = accuracies[2];
    assert!(
        last > PAST_CHANCE,
        "{data}: accuracy after 3 rounds {accuracies:?}"
    );
}

#[test]
fn multilayer_learns_a_csv_file() {
    trains(
        "datasource = \"CSV\"\ntrain_file = \"train.csv\"\ntest_file = \"test.csv\"\nclient_column = \"client\"",
    );
}

#[test]
fn multilayer_learns_an_npz_file_of_2x2_samples() {
    trains(
        "datasource = \"NPZ\"\ntrain_file = \"tabular.npz\"\nsampler = \"dirichlet\"\nconcentration = 0.5\nmin_partition_size = 5",
    );
}

#[test]
fn multilayer_learns_a_safetensors_file() {
    trains(
        "datasource = \"Safetensors\"\ntrain_file = \"tabular.safetensors\"\nsampler = \"shards\"",
    );
}

#[test]
fn the_natural_sampler_makes_a_client_of_each_client_id() {
    trains(
        "datasource = \"CSV\"\ntrain_file = \"train.csv\"\ntest_file = \"test.csv\"\nclient_column = \"client\"\nsampler = \"natural\"",
    );
    // A CSV file without its client column has no users.
    let (output, _) = run(
        &job(
            "datasource = \"CSV\"\ntrain_file = \"train.csv\"\ntest_fraction = 0.2\nsampler = \"natural\"",
            "",
        ),
        &tabular(),
    );
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("natural sampler needs"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn check_surveys_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let check = |data: &str| {
        let config = write_config(dir.path(), &job(data, ""));
        cohort(&["check", "--config", config.to_str().unwrap()], &tabular())
    };
    let output = check("datasource = \"NPZ\"\ntrain_file = \"tabular.npz\"\nsampler = \"natural\"");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", stderr(&output));
    assert!(
        stdout.contains("tabular.npz holds 300 training and 60 test samples of shape [2, 2], each with its client id"),
        "{stdout}"
    );
    let output = check(
        "datasource = \"CSV\"\ntrain_file = \"train.csv\"\ntest_fraction = 0.2\nsampler = \"natural\"",
    );
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        stderr(&output)
    );
    assert!(!output.status.success(), "{all}");
    // Without data.client_column the `client` column is a fifth feature.
    assert!(
        all.contains("240 training and 60 test samples of shape [5]"),
        "{all}"
    );
    assert!(
        all.contains("no client ids: add a data.client_column"),
        "{all}"
    );
}

/// A data folder with the fixture's files and `name` holding `text`.
fn folder_with(name: &str, text: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for file in ["train.csv", "test.csv"] {
        std::fs::copy(tabular().join(file), dir.path().join(file)).unwrap();
    }
    std::fs::write(dir.path().join(name), text).unwrap();
    dir
}

fn fails_with(data: &str, extra: &str, folder: &Path, expected: &[&str]) {
    let (output, _) = run(&job(data, extra), folder);
    let error = stderr(&output);
    assert!(!output.status.success(), "{data}: ran");
    for part in expected {
        assert!(
            error.contains(part),
            "{data}: expected `{part}` in\n{error}"
        );
    }
}

#[test]
fn broken_files_and_configs_fail_naming_the_file_and_the_problem() {
    let csv = "datasource = \"CSV\"\ntrain_file = \"train.csv\"\ntest_file = \"test.csv\"";
    fails_with(
        &format!("{csv}\nlabel_column = \"class\""),
        "",
        &tabular(),
        &[
            "train.csv",
            "no column `class` (data.label_column)",
            "f0, f1, f2, f3, label, client",
        ],
    );
    let bad_cell = folder_with(
        "bad.csv",
        "f0,f1,f2,f3,label,client\n1,2,3,4,0,0\n1,2,oops,4,1,0\n",
    );
    fails_with(
        "datasource = \"CSV\"\ntrain_file = \"bad.csv\"\ntest_file = \"test.csv\"",
        "",
        bad_cell.path(),
        &[
            "bad.csv",
            "line 3, column `f2`: `oops` is not a finite number",
        ],
    );
    fails_with(
        csv,
        "num_classes = 2",
        &tabular(),
        &["parameters.model.num_classes", "is 2, but", "has label 2"],
    );
    let other_header = folder_with("other.csv", "a,b,c,d,label,client\n1,2,3,4,0,0\n");
    fails_with(
        "datasource = \"CSV\"\ntrain_file = \"train.csv\"\ntest_file = \"other.csv\"",
        "",
        other_header.path(),
        &["other.csv", "train.csv", "is not the header"],
    );
    fails_with(
        "datasource = \"CSV\"\ntrain_file = \"train.csv\"",
        "",
        &tabular(),
        &["train.csv", "data.test_fraction"],
    );
    fails_with(
        "datasource = \"CSV\"\ntrain_file = \"missing.csv\"\ntest_fraction = 0.1",
        "",
        &tabular(),
        &["missing.csv", "cannot be read"],
    );
    fails_with(
        "datasource = \"MNIST\"\ntrain_file = \"train.csv\"",
        "",
        &tabular(),
        &["data.train_file", "applies only to the file data sets"],
    );
}

#[test]
fn partitions_count_the_files_classes() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &job(
            "datasource = \"CSV\"\ntrain_file = \"train.csv\"\ntest_file = \"test.csv\"\nsampler = \"dirichlet\"\nmin_partition_size = 5",
            "",
        ),
    );
    let output = cohort(
        &["partitions", "--config", config.to_str().unwrap()],
        &tabular(),
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", stderr(&output));
    let header = stdout.lines().next().unwrap();
    // Three classes (0, 1, 2), not the default num_classes of 10.
    assert!(header.trim_end().ends_with('2'), "{stdout}");
}

#[test]
fn a_larger_num_classes_is_kept() {
    let csv = "datasource = \"CSV\"\ntrain_file = \"train.csv\"\ntest_file = \"test.csv\"";
    let (output, accuracies) = run(&job(csv, "num_classes = 5"), &tabular());
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(accuracies[2] > PAST_CHANCE, "{accuracies:?}");
}

#[test]
fn the_shipped_csv_config_runs_from_the_repository() {
    let config = repo_root().join("configs/tabular/csv_multilayer.toml");
    let dir = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args([
            "run",
            "--config",
            config.to_str().unwrap(),
            "--cpu",
            "--quiet",
            "--base",
            dir.path().to_str().unwrap(),
            "--set",
            "trainer.rounds=1",
        ])
        .current_dir(repo_root())
        .env_remove("COHORT_DATA_DIR")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
}
