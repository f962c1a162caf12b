//! Configs written in Plato's format (tests/fixtures/plato/, with the keys of
//! the seed's `fedavg_lenet5_mlx.toml` and Plato's MNIST non-IID config) load
//! with `cohort check`, one note per name cohort reads differently, and run.

mod common;

use std::path::{Path, PathBuf};

use common::{cohort, fixture_data, only_run_dir, repo_root};

fn plato_fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures/plato").join(name)
}

fn check(config: &Path) -> std::process::Output {
    cohort(
        &["check", "--config", config.to_str().unwrap()],
        &fixture_data(),
    )
}

fn text(output: &[u8]) -> String {
    String::from_utf8_lossy(output).into_owned()
}

#[test]
fn the_seeds_mlx_config_checks_with_a_note_per_plato_name() {
    let output = check(&plato_fixture("fedavg_lenet5_mlx.toml"));
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{}", text(&output.stderr));
    for note in [
        "# plato: trainer.framework = \"mlx\" accepted, no effect",
        "# plato: trainer.type = \"mlx\" read as trainer.type = \"basic\"",
        "# plato: algorithm.type = \"mlx_fedavg\" read as algorithm.type = \"fedavg\"",
        "# plato: trainer.model_name = \"lenet5\" read as trainer.model_name = \"lenet5_compact\"",
        "# plato: data.datasource = \"Torchvision\" with dataset_name = \"MNIST\" read as \
         data.datasource = \"MNIST\"",
        "read as data.sampler = \"iid_cyclic\"",
    ] {
        assert!(stdout.contains(note), "`{note}` missing from:\n{stdout}");
    }
    // The printed config is cohort's, with the reference job's settings.
    for line in [
        "model_name = \"lenet5_compact\"",
        "sampler = \"iid_cyclic\"",
        "partition_size = 20000",
        "per_round = 2",
        "optimizer = \"adam\"",
        "learning_rate = 0.001",
    ] {
        assert!(stdout.contains(line), "`{line}` missing from:\n{stdout}");
    }
}

#[test]
fn platos_noniid_config_checks_as_dirichlet() {
    let output = check(&plato_fixture("fedavg_lenet5_noniid.toml"));
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(
        stdout.contains("# plato: data.sampler = \"noniid\" read as data.sampler = \"dirichlet\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("# plato: parameters.optimizer.lr = 0.01 read as"),
        "{stdout}"
    );
    assert!(stdout.contains("concentration = 0.5"), "{stdout}");
}

#[test]
fn config_errors_come_all_at_once() {
    let output = check(&plato_fixture("typos.toml"));
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("3 problems in the config:"), "{stderr}");
    for key in [
        "`clients.per_round`",
        "`data.concentraton`",
        "`trainer.epochs`",
    ] {
        assert!(stderr.contains(key), "{key} missing from:\n{stderr}");
    }
    assert!(stderr.contains("did you mean `concentration`?"), "{stderr}");
    assert!(stderr.contains("typos.toml"), "{stderr}");
}

/// Runs `config` on the fixture data (not quiet: the notes go to stderr).
fn run(config: &Path, base: &Path) -> std::process::Output {
    cohort(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--cpu",
            "--base",
            base.to_str().unwrap(),
        ],
        &fixture_data(),
    )
}

/// The committed fixture holds Fashion-MNIST only, and a test must not
/// download: the same Plato keys, on that data, for one short round.
fn on_fixture_data(plato_text: &str) -> String {
    plato_text
        .replace("\"MNIST\"", "\"FashionMNIST\"")
        .replace("download = true", "download = false")
        .replace("rounds = 5", "rounds = 1")
        .replace("epochs = 5", "epochs = 1")
}

#[test]
fn the_noniid_plato_config_runs_and_logs_its_notes() {
    let dir = tempfile::tempdir().unwrap();
    let source = std::fs::read_to_string(plato_fixture("fedavg_lenet5_noniid.toml")).unwrap();
    let config = dir.path().join("noniid.toml");
    std::fs::write(&config, on_fixture_data(&source)).unwrap();
    let base = dir.path().join("runs");
    let output = run(&config, &base);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("plato: data.sampler = \"noniid\" read as"),
        "{stderr}"
    );
    let run_dir = only_run_dir(&base);
    let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    assert!(
        log.contains("plato: data.datasource = \"Torchvision\" with dataset_name"),
        "{log}"
    );
    let results = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 2, "{results}");
    // The run folder's config is cohort's own and reloads without notes.
    let saved = run_dir.join("config.toml");
    let saved_text = std::fs::read_to_string(&saved).unwrap();
    assert!(
        saved_text.contains("sampler = \"dirichlet\""),
        "{saved_text}"
    );
    assert!(!saved_text.contains("Torchvision"), "{saved_text}");
    let again = check(&saved);
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert!(!text(&again.stdout).contains("plato:"));
}

#[test]
fn the_mlx_plato_config_runs_the_compact_lenet_on_cyclic_partitions() {
    let dir = tempfile::tempdir().unwrap();
    let main = std::fs::read_to_string(plato_fixture("fedavg_lenet5_mlx.toml")).unwrap();
    let data = std::fs::read_to_string(plato_fixture("mnist_iid.toml")).unwrap();
    // 100 clients × 601 samples outgrow the published 60,000, so Plato's
    // repeating iid is chosen, while a round stays two clients of 601.
    let main = on_fixture_data(&main).replace("total_clients = 10", "total_clients = 100");
    let data = on_fixture_data(&data).replace("partition_size = 20000", "partition_size = 601");
    std::fs::write(dir.path().join("mlx.toml"), main).unwrap();
    std::fs::write(dir.path().join("mnist_iid.toml"), data).unwrap();
    let base = dir.path().join("runs");
    let output = run(&dir.path().join("mlx.toml"), &base);
    let stderr = text(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("\"iid_cyclic\""), "{stderr}");
    let run_dir = only_run_dir(&base);
    let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    let rows: Vec<&str> = clients.lines().skip(1).collect();
    assert_eq!(rows.len(), 2, "{clients}");
    for row in rows {
        let samples = row.split(',').nth(3).unwrap();
        assert_eq!(samples, "601", "{row}");
    }
    let saved = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    assert!(saved.contains("model_name = \"lenet5_compact\""), "{saved}");
}
