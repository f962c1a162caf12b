//! Exact resume: a run killed with SIGKILL and resumed ends with the same model
//! and the same results (times aside) as an uninterrupted run.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{cohort, fixture_data, write_config};

const JOB: &str = r#"
[clients]
total_clients = 4
per_round = 2
[data]
datasource = "FashionMNIST"
download = false
partition_size = 150
[trainer]
rounds = 8
epochs = 2
batch_size = 16
max_concurrency = 2
optimizer = "adam"
model_seed = 11
training_seed = 12
[parameters.optimizer]
learning_rate = 0.002
"#;

/// Columns of results.csv that do not depend on timing.
fn results_without_times(run_dir: &Path) -> Vec<String> {
    let csv = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    csv.lines()
        .map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            // round, accuracy, [elapsed, round_time, training, evaluation], bytes…, loss
            [fields[0], fields[1], fields[6], fields[7], fields[8]].join(",")
        })
        .collect()
}

/// clients.csv without the training time (and the worker, which depends on timing).
fn clients_without_times(run_dir: &Path) -> Vec<String> {
    let csv = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    csv.lines()
        .map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            [fields[0], fields[1], fields[3], fields[4]].join(",")
        })
        .collect()
}

fn uninterrupted(config: &Path, base: &Path) -> PathBuf {
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
        &fixture_data(),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::read_dir(base)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
}

fn resume(run_dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "run",
        "--resume",
        run_dir.to_str().unwrap(),
        "--cpu",
        "--quiet",
    ];
    args.extend_from_slice(extra);
    cohort(&args, &fixture_data())
}

#[test]
fn sigkill_then_resume_equals_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), JOB);
    let reference = uninterrupted(&config, &dir.path().join("reference"));

    let mut child = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args([
            "run",
            "--config",
            config.to_str().unwrap(),
            "--cpu",
            "--quiet",
        ])
        .env("COHORT_DATA_DIR", fixture_data())
        .args(["--base", dir.path().join("killed-base").to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = dir.path().join("killed-base");
    let deadline = Instant::now() + Duration::from_secs(120);
    let killed_run = loop {
        assert!(
            Instant::now() < deadline,
            "no checkpoint of round 3 appeared"
        );
        let found = std::fs::read_dir(&base)
            .ok()
            .and_then(|mut entries| entries.next())
            .and_then(|entry| entry.ok())
            .map(|entry| entry.path())
            .filter(|run| run.join("checkpoints/round-0003.json").is_file());
        if let Some(run) = found {
            assert!(
                child.try_wait().unwrap().is_none(),
                "the run finished before it could be killed"
            );
            child.kill().unwrap(); // SIGKILL
            break run;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let status = child.wait().unwrap();
    assert!(!status.success(), "the run was killed");
    let completed = std::fs::read_dir(killed_run.join("checkpoints"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "json")
        })
        .count();
    assert!(
        completed < 8,
        "killed before the last round ({completed} checkpoints)"
    );

    let output = resume(&killed_run, &[]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let log = std::fs::read_to_string(killed_run.join("run.log")).unwrap();
    assert!(log.contains("resuming after round"), "{log}");

    assert_eq!(
        std::fs::read(killed_run.join("model.safetensors")).unwrap(),
        std::fs::read(reference.join("model.safetensors")).unwrap(),
        "final model differs from the uninterrupted run"
    );
    assert_eq!(
        results_without_times(&killed_run),
        results_without_times(&reference)
    );
    assert_eq!(
        clients_without_times(&killed_run),
        clients_without_times(&reference)
    );
}

#[test]
fn corrupt_newest_checkpoint_falls_back_and_still_matches() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &JOB.replace("rounds = 8", "rounds = 4"));
    let reference = uninterrupted(&config, &dir.path().join("reference"));
    let broken = uninterrupted(&config, &dir.path().join("broken"));

    // Truncate the newest model and mark round 4 as not done: resume must use
    // round 3 and redo round 4.
    let newest = broken.join("checkpoints/round-0004.safetensors");
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 3]).unwrap();
    let output = resume(&broken, &[]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let log = std::fs::read_to_string(broken.join("run.log")).unwrap();
    assert!(log.contains("skipping checkpoint"), "{log}");
    assert!(log.contains("resuming after round 3"), "{log}");
    assert_eq!(
        std::fs::read(broken.join("model.safetensors")).unwrap(),
        std::fs::read(reference.join("model.safetensors")).unwrap()
    );
    assert_eq!(
        results_without_times(&broken),
        results_without_times(&reference)
    );
}

#[test]
fn no_usable_checkpoint_stops_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &JOB.replace("rounds = 8", "rounds = 1"));
    let run = uninterrupted(&config, &dir.path().join("runs"));
    std::fs::write(run.join("checkpoints/round-0001.json"), b"{ truncated").unwrap();
    let output = resume(&run, &[]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no complete checkpoint"), "{stderr}");
}

#[test]
fn a_checkpoints_entry_that_is_no_folder_stops_the_resume_and_keeps_the_results() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &JOB.replace("rounds = 8", "rounds = 1"));
    let run = uninterrupted(&config, &dir.path().join("runs"));
    let results = std::fs::read(run.join("results.csv")).unwrap();
    std::fs::remove_dir_all(run.join("checkpoints")).unwrap();
    std::fs::write(run.join("checkpoints"), b"not a folder").unwrap();
    let output = resume(&run, &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot read the checkpoints in"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(run.join("results.csv")).unwrap(), results);
}

#[test]
fn resume_refuses_a_config_that_changes_results() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &JOB.replace("rounds = 8", "rounds = 1"));
    let run = uninterrupted(&config, &dir.path().join("runs"));
    let changed = dir.path().join("changed.toml");
    std::fs::write(
        &changed,
        JOB.replace("learning_rate = 0.002", "learning_rate = 0.01"),
    )
    .unwrap();
    let output = resume(&run, &["--config", changed.to_str().unwrap()]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("parameters.optimizer.learning_rate: 0.002 → 0.01"),
        "{stderr}"
    );

    // More rounds do not change what was computed: extending the run is allowed.
    let output = resume(
        &run,
        &["--config", config.to_str().unwrap(), "--rounds", "2"],
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(results_without_times(&run).len(), 1 + 2);
}

/// `--rounds` and `--set` are recorded in the run's config.toml: a later
/// `--resume` without them continues the run as it was started, and the
/// model equals an uninterrupted run of that many rounds.
#[test]
fn resume_remembers_rounds_and_set_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &JOB.replace("rounds = 8", "rounds = 5"));
    let base = dir.path().join("runs");
    let output = common::run_config(
        &config,
        &base,
        &["--rounds", "2", "--set", "trainer.epochs=1"],
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let run = common::only_run_dir(&base);
    let recorded = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        recorded.contains("rounds = 2") && recorded.contains("epochs = 1"),
        "{recorded}"
    );
    assert_eq!(results_without_times(&run).len(), 1 + 2);

    // A plain --resume remembers both: there is nothing left to run.
    let output = resume(&run, &[]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(results_without_times(&run).len(), 1 + 2);

    // --resume --rounds 3 extends it, and a later --resume remembers the 3;
    // the model is that of an uninterrupted 3-round run with one epoch.
    let output = resume(&run, &["--rounds", "3"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(results_without_times(&run).len(), 1 + 3);
    let recorded = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(recorded.contains("rounds = 3"), "{recorded}");
    std::fs::create_dir(dir.path().join("straight")).unwrap();
    let straight = write_config(
        &dir.path().join("straight"),
        &JOB.replace("rounds = 8", "rounds = 3")
            .replace("epochs = 2", "epochs = 1"),
    );
    let reference = uninterrupted(&straight, &dir.path().join("straight-runs"));
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        std::fs::read(reference.join("model.safetensors")).unwrap()
    );
    assert_eq!(
        results_without_times(&run),
        results_without_times(&reference)
    );

    // A --set that changes results is refused on resume, naming the key.
    let output = resume(&run, &["--set", "trainer.epochs=2"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("trainer.epochs: 1 → 2"), "{stderr}");
}

/// Under a cosine schedule the number of rounds sets every round's learning
/// rate, so `--resume --rounds` is refused with the reason.
#[test]
fn resume_refuses_new_rounds_under_a_cosine_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &JOB.replace("rounds = 8", "rounds = 1\nlr_scheduler = \"cosine\""),
    );
    let run = uninterrupted(&config, &dir.path().join("runs"));
    let output = resume(&run, &["--rounds", "2"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("trainer.rounds: 1 → 2"), "{stderr}");
    assert!(
        stderr.contains("cosine schedule spans trainer.rounds"),
        "{stderr}"
    );
}

/// A stratified run resumes where it stopped (its checkpoint's selector
/// checked against a replay of its rounds with the run's strata), and the
/// rounds after it draw what an uninterrupted run draws.
#[test]
fn a_stratified_run_resumes_as_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let stratified = JOB
        .replace("per_round = 2", "per_round = 2\nstrata = 2")
        .replace("epochs = 2", "epochs = 1");
    let config = write_config(dir.path(), &stratified.replace("rounds = 8", "rounds = 2"));
    let base = dir.path().join("runs");
    let output = common::run_config(&config, &base, &[]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let run = common::only_run_dir(&base);
    let output = resume(&run, &["--rounds", "4"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let log = std::fs::read_to_string(run.join("run.log")).unwrap();
    assert!(log.contains("resuming after round 2"), "{log}");
    std::fs::create_dir(dir.path().join("straight")).unwrap();
    let straight = write_config(
        &dir.path().join("straight"),
        &stratified.replace("rounds = 8", "rounds = 4"),
    );
    let reference = uninterrupted(&straight, &dir.path().join("straight-runs"));
    assert_eq!(
        clients_without_times(&run),
        clients_without_times(&reference)
    );
    // Each round one client of 1–2 and one of 3–4.
    for round in 1..=4 {
        let mut halves: Vec<u32> = clients_without_times(&reference)
            .iter()
            .skip(1)
            .filter(|row| row.starts_with(&format!("{round},")))
            .map(|row| (row.split(',').nth(1).unwrap().parse::<u32>().unwrap() - 1) / 2)
            .collect();
        halves.sort_unstable();
        assert_eq!(halves, [0, 1], "round {round}");
    }
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        std::fs::read(reference.join("model.safetensors")).unwrap()
    );
}
