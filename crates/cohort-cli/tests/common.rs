//! Helpers shared by the binary's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

pub fn fixture_data() -> PathBuf {
    repo_root().join("tests/fixtures/data")
}

/// Runs the real `cohort` binary with `args`, datasets from `data_dir`.
pub fn cohort(args: &[&str], data_dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(args)
        .env("COHORT_DATA_DIR", data_dir)
        .env_remove("RUST_LOG")
        .output()
        .expect("the cohort binary runs")
}

/// The folder with the real datasets (`COHORT_DATA_DIR`). Tests that call
/// this are `#[ignore]`d with the reason, so a plain `cargo test` on a fresh
/// clone does not count them; run with `--include-ignored` (as `.ci/run`
/// does), a missing folder fails the test.
pub fn real_data_dir(needed: &[&str]) -> PathBuf {
    let dir = std::env::var_os("COHORT_DATA_DIR").map(PathBuf::from);
    match dir {
        Some(dir) if needed.iter().all(|f| dir.join(f).is_file()) => dir,
        other => panic!(
            "real data not found: set COHORT_DATA_DIR to a folder with {needed:?} (got {other:?})"
        ),
    }
}

/// Fails the test unless `python3` imports every module of `modules`; tests
/// that call this are `#[ignore]`d with the packages they need.
pub fn require_python(modules: &[&str]) {
    let imports = format!("import {}", modules.join(", "));
    let output = std::process::Command::new("python3")
        .args(["-c", &imports])
        .output();
    let problem = match output {
        Err(error) => format!("python3 cannot be started ({error})"),
        Ok(output) if !output.status.success() => {
            String::from_utf8_lossy(&output.stderr).trim().to_owned()
        }
        Ok(_) => return,
    };
    panic!("this test needs python3 with {modules:?}: {problem}");
}

pub fn write_config(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("job.toml");
    std::fs::write(&path, body).unwrap();
    path
}

/// Runs `config_text` on the fixture; returns the temp folder (keep it alive),
/// the base folder of the run and the process output.
pub fn run_job(config_text: &str) -> (tempfile::TempDir, std::path::PathBuf, std::process::Output) {
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
        &fixture_data(),
    );
    (dir, base, output)
}

pub fn only_run_dir(base: &std::path::Path) -> std::path::PathBuf {
    let mut dirs: Vec<_> = std::fs::read_dir(base)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs.pop().unwrap()
}

/// A loopback port that was free a moment ago (the OS picks it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `cohort run --config CONFIG --cpu --quiet --base BASE EXTRA...` on the fixture.
pub fn run_config(config: &Path, base: &Path, extra: &[&str]) -> Output {
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
    cohort(&args, &fixture_data())
}

/// The model file of `config` run in one process on the CPU, under `base`,
/// with datasets from `data`: the reference distributed runs must equal.
pub fn single_process_model(config: &Path, base: &Path, data: &Path) -> Vec<u8> {
    let output = cohort(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--base",
            base.to_str().unwrap(),
            "--cpu",
            "--quiet",
        ],
        data,
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::read(only_run_dir(base).join("model.safetensors")).unwrap()
}

/// The run folder under `base` once its `results.csv` has more than
/// `rounds` rounds; fails after 120 s.
pub fn run_dir_after_rounds(base: &Path, rounds: usize) -> PathBuf {
    let started = std::time::Instant::now();
    loop {
        assert!(
            started.elapsed().as_secs() < 120,
            "no progress within 120 s"
        );
        if let Ok(mut entries) = std::fs::read_dir(base)
            && let Some(Ok(entry)) = entries.next()
        {
            let results =
                std::fs::read_to_string(entry.path().join("results.csv")).unwrap_or_default();
            if results.lines().count() > rounds {
                return entry.path();
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The `[algorithm]` body each strategy is tested with: options that make a
/// two-round test on a few clients meaningful.
pub fn algorithm_section(name: &str) -> String {
    match name {
        // Noise of the default multiplier over five clients would swamp a
        // two-round test; the accounting is what is checked here.
        // A fixed noise seed makes the uninterrupted and the resumed run
        // comparable; the entropy key's own resume is a unit test in dp.rs.
        "dp_fedavg" => {
            "type = \"dp_fedavg\"\nnoise_multiplier = 0.001\nclip_norm = 5.0\nnoise_seed = 7".into()
        }
        // The default beta, 0.1, trims nothing from five updates (refused).
        "trimmed_mean" => "type = \"trimmed_mean\"\nbeta = 0.2".into(),
        // The default momentum settles at FedAvg's step size over ~10 rounds;
        // two rounds need a faster start.
        "fedavgm" => "type = \"fedavgm\"\nserver_learning_rate = 1.0\nmomentum = 0.5".into(),
        "fedadam" | "fedyogi" | "fedadagrad" => {
            format!("type = \"{name}\"\nserver_learning_rate = 0.03")
        }
        other => format!("type = \"{other}\""),
    }
}

/// `cohort worker` for `rank` of the plan in `plan`, on the fixture, its
/// stderr piped for the test to read.
pub fn start_rank(
    config: &Path,
    plan: &Path,
    base: &Path,
    rank: u32,
    extra: &[&str],
) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args(["worker", "--config", config.to_str().unwrap()])
        .args([
            "--plan",
            plan.to_str().unwrap(),
            "--rank",
            &rank.to_string(),
        ])
        .args(["--base", base.to_str().unwrap(), "--cpu", "--quiet"])
        .args(extra)
        .env("COHORT_DATA_DIR", fixture_data())
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Starts `cohort run --config CONFIG --cpu --quiet --base BASE` on the
/// fixture and SIGKILLs it as soon as its run folder holds the checkpoint
/// of `round` (it may be writing later rounds by then: a kill lands
/// anywhere); returns the run folder. Fails if no such checkpoint appears
/// within 120 s or the run finished before it could be killed.
pub fn run_killed_after_checkpoint(config: &Path, base: &Path, round: u32) -> PathBuf {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args([
            "run",
            "--config",
            config.to_str().unwrap(),
            "--cpu",
            "--quiet",
        ])
        .args(["--base", base.to_str().unwrap()])
        .env("COHORT_DATA_DIR", fixture_data())
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let checkpoint = format!("checkpoints/round-{round:04}.json");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let killed = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "no checkpoint of round {round} appeared"
        );
        let found = std::fs::read_dir(base)
            .ok()
            .and_then(|mut entries| entries.next())
            .and_then(|entry| entry.ok())
            .map(|entry| entry.path())
            .filter(|run| run.join(&checkpoint).is_file());
        if let Some(run) = found {
            assert!(
                child.try_wait().unwrap().is_none(),
                "the run finished before it could be killed"
            );
            child.kill().unwrap(); // SIGKILL
            break run;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    assert!(!child.wait().unwrap().success(), "the run was killed");
    killed
}

/// `cohort run --resume RUN_DIR --cpu --quiet EXTRA...` on the fixture, to
/// success; fails showing its stderr otherwise.
pub fn resume_to_success(run_dir: &Path, extra: &[&str]) {
    let mut args = vec![
        "run",
        "--resume",
        run_dir.to_str().unwrap(),
        "--cpu",
        "--quiet",
    ];
    args.extend_from_slice(extra);
    let output = cohort(&args, &fixture_data());
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The `cohort` binary with the fixtures' data and no ambient log level or
/// token from the environment.
pub fn cohort_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_cohort"));
    command
        .args(args)
        .env("COHORT_DATA_DIR", fixture_data())
        .env_remove("RUST_LOG")
        .env_remove("COHORT_TOKEN");
    command
}

/// `cohort run` in network mode that starts no client processes of its own;
/// the test starts them by hand, as on other machines. Its stderr is piped.
pub fn spawn_server_alone(config: &Path, base: &Path, stdout: Stdio) -> Child {
    cohort_command(&[
        "run",
        "--config",
        config.to_str().unwrap(),
        "--cpu",
        "--quiet",
        "--local-clients",
        "0",
        "--base",
        base.to_str().unwrap(),
    ])
    .stdout(stdout)
    .stderr(Stdio::piped())
    .spawn()
    .unwrap()
}
