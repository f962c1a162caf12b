//! The simulated clock: an asynchronous FedBuff run is the same bit for bit
//! with one worker or two and after a SIGKILL and `--resume`; a trace file's
//! availability is followed exactly, a client offline mid-training lost.

mod common;

use std::path::{Path, PathBuf};

use common::{cohort, fixture_data, write_config};

const FEDBUFF: &str = r#"
[clients]
total_clients = 6
per_round = 3
[clients.profile]
compute = { distribution = "lognormal", median = 0.002, sigma = 1.0 }
downlink_mbps = 50
uplink_mbps = { distribution = "two_point", fast = 40, slow = 2, slow_fraction = 0.5 }
latency = 0.01
[server]
synchronous = false
minimum_clients_aggregated = 2
staleness_bound = 3
[algorithm]
type = "fedbuff"
[data]
datasource = "FashionMNIST"
download = false
partition_size = 100
[trainer]
rounds = 10
epochs = 2
batch_size = 16
max_concurrency = 2
optimizer = "adam"
model_seed = 11
training_seed = 12
[parameters.optimizer]
learning_rate = 0.002
"#;

fn run(config: &Path, base: &Path) -> PathBuf {
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
    common::only_run_dir(base)
}

/// results.csv without the columns measured on the machine.
fn results_without_times(run_dir: &Path) -> Vec<String> {
    let csv = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    csv.lines()
        .map(|line| {
            let f: Vec<&str> = line.split(',').collect();
            // round, accuracy, bytes, loss, simulated time, test loss, simulated start.
            [f[0], f[1], f[6], f[7], f[8], f[9], f[13], f[14]].join(",")
        })
        .collect()
}

/// clients.csv without the measured times and the worker.
fn clients_without_times(run_dir: &Path) -> Vec<String> {
    let csv = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    csv.lines()
        .map(|line| {
            let f: Vec<&str> = line.split(',').collect();
            let mut kept = vec![f[0], f[1], f[3], f[4], f[8]];
            // sim_start … staleness, and the dropped reason (which may hold commas).
            kept.extend_from_slice(&f[11..]);
            kept.join(",")
        })
        .collect()
}

#[test]
fn fedbuff_is_the_same_with_one_or_two_workers() {
    let dir = tempfile::tempdir().unwrap();
    let two = write_config(dir.path(), FEDBUFF);
    let one_dir = dir.path().join("one");
    std::fs::create_dir_all(&one_dir).unwrap();
    let one = write_config(
        &one_dir,
        &FEDBUFF.replace("max_concurrency = 2", "max_concurrency = 1"),
    );
    let with_two = run(&two, &dir.path().join("two-runs"));
    let with_one = run(&one, &dir.path().join("one-runs"));
    assert_eq!(
        std::fs::read(with_one.join("model.safetensors")).unwrap(),
        std::fs::read(with_two.join("model.safetensors")).unwrap(),
        "the final model depends on the worker count"
    );
    assert_eq!(
        results_without_times(&with_one),
        results_without_times(&with_two)
    );
    assert_eq!(
        clients_without_times(&with_one),
        clients_without_times(&with_two)
    );

    // It was asynchronous: stale updates were aggregated, the clock moved
    // forward, and each round aggregated K = 2 updates.
    let clients = std::fs::read_to_string(with_two.join("clients.csv")).unwrap();
    // Aggregated rows end with an empty `dropped`; a dropped stale update
    // records its staleness too.
    let staleness: Vec<u32> = clients
        .lines()
        .skip(1)
        .filter(|line| line.ends_with(','))
        .filter_map(|line| line.split(',').nth(16)?.parse().ok())
        .collect();
    assert!(staleness.iter().any(|&s| s > 0), "{clients}");
    assert!(staleness.iter().all(|&s| s <= 3), "{clients}");
    let results = std::fs::read_to_string(with_two.join("results.csv")).unwrap();
    let ends: Vec<f64> = results
        .lines()
        .skip(1)
        .map(|line| line.split(',').nth(9).unwrap().parse().unwrap())
        .collect();
    assert_eq!(ends.len(), 10);
    assert!(ends.windows(2).all(|w| w[0] <= w[1]), "{results}");
    for round in 1..=10 {
        let aggregated = clients
            .lines()
            .skip(1)
            .filter(|line| {
                let f: Vec<&str> = line.split(',').collect();
                f[0] == round.to_string() && line.ends_with(',')
            })
            .count();
        assert_eq!(aggregated, 2, "round {round}: {clients}");
    }
}

#[test]
fn fedbuff_after_a_sigkill_and_resume_equals_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), FEDBUFF);
    let reference = run(&config, &dir.path().join("reference"));

    let killed = common::run_killed_after_checkpoint(&config, &dir.path().join("killed-base"), 3);
    assert!(
        !killed.join("checkpoints/round-0010.json").exists(),
        "killed before the last round"
    );
    // The checkpoint holds the clock and the tasks in flight.
    let sidecar = std::fs::read_to_string(killed.join("checkpoints/round-0003.json")).unwrap();
    assert!(sidecar.contains("\"asynchronous\""), "{sidecar}");
    assert!(
        killed
            .join("checkpoints/round-0003.bases.safetensors")
            .is_file()
    );

    common::resume_to_success(&killed, &[]);
    let log = std::fs::read_to_string(killed.join("run.log")).unwrap();
    assert!(log.contains("resuming after round"), "{log}");
    assert_eq!(
        std::fs::read(killed.join("model.safetensors")).unwrap(),
        std::fs::read(reference.join("model.safetensors")).unwrap(),
        "final model differs from the uninterrupted run"
    );
    assert_eq!(
        results_without_times(&killed),
        results_without_times(&reference)
    );
    assert_eq!(
        clients_without_times(&killed),
        clients_without_times(&reference)
    );
}

const TRACED: &str = r#"
[clients]
total_clients = 4
per_round = 4
min_per_round = 3
[clients.profile]
compute = 0.01
[clients.availability]
model = "trace"
trace_file = "trace.csv"
[data]
datasource = "FashionMNIST"
download = false
partition_size = 100
[trainer]
rounds = 2
epochs = 1
batch_size = 20
max_concurrency = 2
optimizer = "sgd"
model_seed = 3
training_seed = 4
[parameters.optimizer]
learning_rate = 0.05
"#;

#[test]
fn a_trace_is_followed_and_a_client_offline_mid_training_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), TRACED);
    // Client 4 is online only until 0.5 s: its task (100 samples · 0.01 s)
    // would end at 1 s.
    std::fs::write(
        dir.path().join("trace.csv"),
        "client,online_from,online_until\n1,0,1000\n2,0,1000\n3,0,1000\n4,0,0.5\n",
    )
    .unwrap();
    let run_dir = run(&config, &dir.path().join("runs"));
    let results = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    let rows: Vec<Vec<String>> = results
        .lines()
        .skip(1)
        .map(|line| line.split(',').map(str::to_owned).collect())
        .collect();
    // Every task takes 1 s on the clock: rounds [0, 1] and [1, 2], from
    // the profile, not from how long training took here.
    assert_eq!(
        (rows[0][14].as_str(), rows[0][9].as_str()),
        ("0.000", "1.000")
    );
    assert_eq!(
        (rows[1][14].as_str(), rows[1][9].as_str()),
        ("1.000", "2.000")
    );
    let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    let lost: Vec<&str> = clients
        .lines()
        .filter(|line| line.contains("client lost"))
        .collect();
    assert_eq!(lost.len(), 1, "{clients}");
    assert!(lost[0].starts_with("1,4,"), "{clients}");
    assert!(
        lost[0].contains("went offline at simulated time 0.500 s"),
        "{clients}"
    );
    // Round 2 starts at 1 s, when client 4 is offline: it is not drawn.
    let second: Vec<&str> = clients.lines().filter(|l| l.starts_with("2,")).collect();
    assert_eq!(second.len(), 3, "{clients}");
    assert!(second.iter().all(|l| !l.starts_with("2,4,")), "{clients}");
    // Each aggregated row: start, download 0, compute 1, upload 0, end.
    assert!(
        clients.contains(",1.000,0.000,1.000,0.000,2.000,"),
        "{clients}"
    );
}

const OVER_SELECTED: &str = r#"
[clients]
total_clients = 4
per_round = 2
over_selection = 2.0
[clients.profile]
file = "devices.csv"
[data]
datasource = "FashionMNIST"
download = false
partition_size = 100
[trainer]
rounds = 2
epochs = 1
batch_size = 20
max_concurrency = 2
optimizer = "sgd"
model_seed = 3
training_seed = 4
[parameters.optimizer]
learning_rate = 0.05
"#;

/// clients.csv rows of `round` that were aggregated, and those dropped with
/// `reason`.
fn rows_of(clients: &str, round: u32, reason: &str) -> (Vec<u32>, Vec<u32>) {
    let mut aggregated = Vec::new();
    let mut dropped = Vec::new();
    for line in clients.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        if f[0] != round.to_string() {
            continue;
        }
        let client = f[1].parse().unwrap();
        if line.ends_with(',') {
            aggregated.push(client);
        } else if line.contains(reason) {
            dropped.push(client);
        }
    }
    aggregated.sort_unstable();
    dropped.sort_unstable();
    (aggregated, dropped)
}

#[test]
fn over_selection_and_a_deadline_keep_the_first_updates_and_drop_the_late() {
    let dir = tempfile::tempdir().unwrap();
    // 100 samples, one epoch: client c's task takes c seconds.
    std::fs::write(
        dir.path().join("devices.csv"),
        "client,compute\n1,0.01\n2,0.02\n3,0.03\n4,0.04\n",
    )
    .unwrap();
    let config = write_config(dir.path(), OVER_SELECTED);
    let run_dir = run(&config, &dir.path().join("over"));
    let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    // All four drawn, the first two to arrive aggregated, the round closed
    // at 2 s; the others late.
    for round in 1..=2 {
        let (aggregated, late) = rows_of(&clients, round, "client late");
        assert_eq!(aggregated, [1, 2], "{clients}");
        assert_eq!(late, [3, 4], "{clients}");
    }
    let results = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    let ends: Vec<&str> = results
        .lines()
        .skip(1)
        .map(|line| line.split(',').nth(9).unwrap())
        .collect();
    assert_eq!(ends, ["2.000", "4.000"], "{results}");

    // A deadline of 2.5 s, no over-selection: again clients 1 and 2.
    let deadline = OVER_SELECTED
        .replace(
            "per_round = 2\nover_selection = 2.0",
            "per_round = 4\nmin_per_round = 2",
        )
        .replace("[data]", "[server]\nround_deadline = 2.5\n[data]");
    let config = write_config(dir.path(), &deadline);
    let run_dir = run(&config, &dir.path().join("deadline"));
    let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    let (aggregated, late) = rows_of(&clients, 1, "server.round_deadline = 2.5 s");
    assert_eq!((aggregated, late), (vec![1, 2], vec![3, 4]), "{clients}");
    let results = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    assert_eq!(
        results.lines().nth(1).unwrap().split(',').nth(9),
        Some("2.500")
    );
}
