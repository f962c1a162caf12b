//! The README's tutorial, run as written: each `<!-- tutorial: NAME -->`
//! block is a bash script, run from a folder that holds the repository's
//! configs, with the `cohort` under test first on PATH.

mod common;

use std::path::Path;

use common::{free_port, real_data_dir, repo_root};

/// The README's tutorial block called `name`: the lines of the ```sh fence
/// right after its marker.
fn block(name: &str) -> String {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let marker = format!("<!-- tutorial: {name} -->");
    let after = readme
        .split_once(&marker)
        .unwrap_or_else(|| panic!("README.md has no `{marker}`"))
        .1;
    let fence = after
        .trim_start()
        .strip_prefix("```sh\n")
        .unwrap_or_else(|| panic!("`{marker}` is not followed by a ```sh block"));
    let (script, _) = fence
        .split_once("\n```")
        .unwrap_or_else(|| panic!("the block after `{marker}` does not end"));
    script.to_owned()
}

/// Runs `script` with bash in a fresh folder that links to the repository's
/// configs, as a user would from the repository root; the folder, to look in.
fn run(script: &str) -> tempfile::TempDir {
    let data = real_data_dir(&["fashion-mnist/train-images-idx3-ubyte.gz"]);
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(repo_root().join("configs"), dir.path().join("configs")).unwrap();
    let binary = Path::new(env!("CARGO_BIN_EXE_cohort"));
    let path = format!(
        "{}:{}",
        binary.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = std::process::Command::new("bash")
        .args(["-euo", "pipefail", "-c", script])
        .current_dir(dir.path())
        .env("PATH", path)
        .env("COHORT_DATA_DIR", data)
        .env_remove("RUST_LOG")
        .env_remove("COHORT_TOKEN")
        .output()
        .expect("bash runs");
    assert!(
        output.status.success(),
        "the tutorial block failed:\n{script}\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    dir
}

/// The run folders under runs/tutorial, by name.
fn run_folders(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("runs/tutorial"))
        .unwrap()
        .map(|entry| entry.unwrap())
        .filter(|entry| entry.path().is_dir())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
#[ignore = "needs the full Fashion-MNIST in COHORT_DATA_DIR"]
fn the_first_non_iid_experiment_runs_as_written() {
    let dir = run(&block("non-iid"));
    for png in ["partitions-iid.png", "partitions-dirichlet.png"] {
        assert!(
            dir.path().join("runs/tutorial").join(png).is_file(),
            "{png}"
        );
    }
    let runs = run_folders(dir.path());
    assert_eq!(runs.len(), 1, "{runs:?}");
    let run = dir.path().join("runs/tutorial").join(&runs[0]);
    assert!(run.join("accuracy.png").is_file());
    let results = std::fs::read_to_string(run.join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 3, "{results}");
}

#[test]
#[ignore = "needs the full Fashion-MNIST in COHORT_DATA_DIR"]
fn comparing_two_strategies_runs_as_written() {
    let dir = run(&block("compare"));
    let runs = run_folders(dir.path());
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert!(
        runs.iter().any(|r| r.starts_with("fedavg-fedadam-")),
        "{runs:?}"
    );
    for png in ["compare.png", "compare-loss.png"] {
        assert!(
            dir.path().join("runs/tutorial").join(png).is_file(),
            "{png}"
        );
    }
}

#[test]
#[ignore = "needs the full Fashion-MNIST in COHORT_DATA_DIR"]
fn a_server_and_two_clients_run_as_written() {
    let script = block("network");
    assert!(script.contains("47613"), "{script}");
    // The port the README shows may be taken on a shared machine.
    let dir = run(&script.replace("47613", &free_port().to_string()));
    let runs = run_folders(dir.path());
    assert_eq!(runs.len(), 1, "{runs:?}");
    let run = dir.path().join("runs/tutorial").join(&runs[0]);
    let results = std::fs::read_to_string(run.join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 3, "{results}");
    let log = std::fs::read_to_string(run.join("run.log")).unwrap();
    assert_eq!(log.matches("client process registered").count(), 2, "{log}");
}
