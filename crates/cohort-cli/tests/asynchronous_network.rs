//! The asynchronous server in network mode (`server.synchronous = false`,
//! `clients.comm_simulation = false`) with real `cohort client` processes
//! over loopback sockets: FedBuff and FedAsync run to the end on the real
//! clock, an update held back past `server.staleness_bound` (its process
//! stopped with SIGSTOP until others were aggregated) is dropped and
//! recorded, a client process killed mid-run is replaced, Oort selects and
//! keeps its state, and `--resume` goes on from a checkpoint's tasks.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{
    cohort_command, fixture_data, free_port, only_run_dir, spawn_server_alone, write_config,
};

/// Columns of clients.csv.
const STALENESS: usize = 16;
const WALL_START: usize = 17;
const WALL_END: usize = 18;
/// Columns of results.csv.
const ELAPSED: usize = 2;
const SIMULATED_TIME: usize = 9;
const SIMULATED_START: usize = 14;

/// `total` clients, `per_round` in flight, an aggregation every `buffer`
/// updates, under `algorithm`.
fn job(port: u16, total: u32, per_round: u32, buffer: u32, algorithm: &str) -> String {
    format!(
        r#"
[clients]
total_clients = {total}
per_round = {per_round}
comm_simulation = false

[server]
port = {port}
registration_timeout = 60
payload_timeout = 120
synchronous = false
minimum_clients_aggregated = {buffer}
staleness_bound = 3

[algorithm]
{algorithm}

[data]
datasource = "FashionMNIST"
download = false
partition_size = 100

[trainer]
rounds = 6
epochs = 1
batch_size = 16
max_concurrency = {per_round}
optimizer = "sgd"
model_name = "lenet5"
model_seed = 3
training_seed = 5

[parameters.optimizer]
learning_rate = 0.05
"#
    )
}

fn succeeded(output: &std::process::Output) {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs `config` to the end with the client processes the server starts;
/// its run folder.
fn run(config: &Path, base: &Path, extra: &[&str]) -> PathBuf {
    succeeded(&common::run_config(config, base, extra));
    only_run_dir(base)
}

/// clients.csv's rows, split at commas, the header left out; the last
/// field is the dropped reason (which may hold commas) whole.
fn client_rows(run_dir: &Path) -> Vec<Vec<String>> {
    let csv = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    let columns = csv.lines().next().unwrap().split(',').count();
    assert_eq!(
        csv.lines().next().unwrap().split(',').nth(WALL_END),
        Some("wall_end")
    );
    csv.lines()
        .skip(1)
        .map(|line| line.splitn(columns, ',').map(str::to_owned).collect())
        .collect()
}

fn result_rows(run_dir: &Path) -> Vec<Vec<String>> {
    let csv = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    csv.lines()
        .skip(1)
        .map(|line| line.split(',').map(str::to_owned).collect())
        .collect()
}

fn number(field: &str) -> f64 {
    field
        .parse()
        .unwrap_or_else(|_| panic!("`{field}` is not a number"))
}

/// What every network asynchronous run records: `rounds` aggregations of
/// `buffer` updates each, every update with its staleness and its real
/// send and arrival, each aggregation's real start and end in order.
/// Returns the aggregated updates' staleness.
fn check_records(run_dir: &Path, rounds: usize, buffer: usize) -> Vec<u32> {
    let results = result_rows(run_dir);
    assert_eq!(results.len(), rounds, "{results:?}");
    let mut previous_end = 0.0;
    for row in &results {
        let (start, end) = (number(&row[SIMULATED_START]), number(&row[SIMULATED_TIME]));
        assert!(
            previous_end <= start && start <= end && end <= number(&row[ELAPSED]) + 1e-3,
            "aggregations out of order on the real clock: {results:?}"
        );
        previous_end = end;
    }
    let clients = client_rows(run_dir);
    let mut staleness = Vec::new();
    for round in 1..=rounds {
        let aggregated: Vec<&Vec<String>> = clients
            .iter()
            .filter(|r| r[0] == round.to_string() && r.last().unwrap().is_empty())
            .collect();
        assert_eq!(aggregated.len(), buffer, "round {round}: {clients:?}");
        for row in aggregated {
            let (sent, arrived) = (number(&row[WALL_START]), number(&row[WALL_END]));
            assert!(sent <= arrived, "{row:?}");
            assert!(
                arrived <= number(&results[round - 1][SIMULATED_TIME]) + 1e-3,
                "an update arrived after the aggregation it joined: {row:?}"
            );
            staleness.push(row[STALENESS].parse().unwrap());
        }
    }
    staleness
}

#[test]
fn fedbuff_runs_to_the_end_on_the_real_clock_with_three_client_processes() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &job(free_port(), 6, 3, 2, "type = \"fedbuff\""));
    let base = dir.path().join("runs");
    let output = common::run_config(&config, &base, &[]);
    succeeded(&output);
    let run_dir = only_run_dir(&base);
    let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    assert_eq!(log.matches("client process registered").count(), 3, "{log}");
    let staleness = check_records(&run_dir, 6, 2);
    // Three tasks start from version 0 and the first two aggregate: the
    // third joins a later aggregation, one version or more behind.
    assert!(staleness.iter().any(|&s| s >= 1), "{staleness:?}");
    assert!(staleness.iter().all(|&s| s <= 3), "{staleness:?}");
    let sidecar = std::fs::read_to_string(run_dir.join("checkpoints/round-0006.json")).unwrap();
    assert!(sidecar.contains("\"asynchronous\""), "{sidecar}");
    assert!(run_dir.join("model.safetensors").is_file());
}

#[test]
fn fedasync_aggregates_every_update_as_it_arrives() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &job(free_port(), 4, 2, 1, "type = \"fedasync\"\nalpha = 0.5"),
    );
    let run_dir = run(&config, &dir.path().join("runs"), &[]);
    let staleness = check_records(&run_dir, 6, 1);
    // The second of the first two tasks arrives after the first was mixed in.
    assert!(staleness.iter().any(|&s| s >= 1), "{staleness:?}");
}

/// A `cohort client` of the server at `address`, its stderr read line by
/// line on a thread (so that it never blocks on a full pipe) and sent to
/// the receiver.
fn client_process(address: &str) -> (Child, mpsc::Receiver<String>) {
    let mut child = cohort_command(&["client", "--server", address, "--cpu"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (lines, received) = mpsc::channel();
    std::thread::spawn(move || {
        // Drained to the end even when no one listens any more: a client
        // whose stderr closed would die of it.
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    (child, received)
}

/// Waits for a line of `lines` that holds `text`; fails after 120 s.
fn wait_for_line(lines: &mpsc::Receiver<String>, text: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.contains(text) => return,
            Ok(_) => {}
            Err(_) => panic!("no line with `{text}` within 120 s"),
        }
    }
}

/// Polls until `ready` says yes; fails after 120 s naming `what`.
fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ready() {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within 120 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Rounds in the results.csv of the one run under `base` (0 before it has one).
fn rounds_written(base: &Path) -> usize {
    std::fs::read_dir(base)
        .ok()
        .and_then(|mut entries| entries.next())
        .and_then(Result::ok)
        .and_then(|entry| std::fs::read_to_string(entry.path().join("results.csv")).ok())
        .map_or(0, |csv| csv.lines().count().saturating_sub(1))
}

fn signal(child: &Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) on a child this test started and has not reaped.
    assert_eq!(
        unsafe { libc::kill(pid, signal) },
        0,
        "kill({pid}, {signal})"
    );
}

#[test]
fn an_update_held_back_past_the_staleness_bound_is_dropped_and_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    // Two processes for two places: the one stopped holds its task, the
    // other's updates are aggregated one by one; bound 1. The server starts
    // with one process (max_concurrency = 1), so the first task is the
    // held one's.
    let text = job(port, 4, 2, 1, "type = \"fedbuff\"")
        .replace("staleness_bound = 3", "staleness_bound = 1")
        .replace("rounds = 6", "rounds = 12")
        .replace("epochs = 1", "epochs = 3")
        .replace("max_concurrency = 2", "max_concurrency = 1");
    let config = write_config(dir.path(), &text);
    let base = dir.path().join("runs");
    let server = spawn_server_alone(&config, &base, Stdio::null());
    let address = format!("127.0.0.1:{port}");
    let (held, held_lines) = client_process(&address);
    wait_for_line(&held_lines, "training client");
    signal(&held, libc::SIGSTOP);
    let (other, _other_lines) = client_process(&address);
    // Its task was sent after the aggregations written so far: two more
    // make it at least two versions old.
    let before = rounds_written(&base);
    wait_until("two aggregations without the stopped client", || {
        rounds_written(&base) >= before + 2
    });
    // The other process stops too, so the run cannot end before the held
    // update arrives.
    signal(&other, libc::SIGSTOP);
    signal(&held, libc::SIGCONT);
    let run_dir = only_run_dir(&base);
    wait_until("the stale update's drop", || {
        std::fs::read_to_string(run_dir.join("run.log"))
            .is_ok_and(|log| log.contains("update too stale"))
    });
    signal(&other, libc::SIGCONT);

    let output = server.wait_with_output().unwrap();
    succeeded(&output);
    for mut client in [held, other] {
        client.wait().unwrap();
    }
    // The held task was the run's first, sent version 0. (Others may be
    // dropped as stale too: two places and one update an aggregation let a
    // slow task fall two versions behind.)
    let held_row: Vec<Vec<String>> = client_rows(&run_dir)
        .into_iter()
        .filter(|row| {
            row.last()
                .unwrap()
                .contains("update too stale: it trained from version 0,")
        })
        .collect();
    assert_eq!(held_row.len(), 1, "{held_row:?}");
    let row = &held_row[0];
    assert!(row[STALENESS].parse::<u32>().unwrap() >= 2, "{row:?}");
    assert!(
        row.last()
            .unwrap()
            .contains("more than server.staleness_bound = 1"),
        "{row:?}"
    );
    assert!(number(&row[WALL_START]) < number(&row[WALL_END]), "{row:?}");
    // The run went on to its last round, every round with one update.
    check_records(&run_dir, 12, 1);
}

#[test]
fn a_client_process_killed_mid_run_is_replaced_and_the_run_completes() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    // The server starts with one process (max_concurrency = 1): the first
    // task is the victim's.
    let text = job(port, 6, 2, 2, "type = \"fedbuff\"")
        .replace("epochs = 1", "epochs = 3")
        .replace("max_concurrency = 2", "max_concurrency = 1");
    let config = write_config(dir.path(), &text);
    let base = dir.path().join("runs");
    let server = spawn_server_alone(&config, &base, Stdio::null());
    let address = format!("127.0.0.1:{port}");
    let (mut victim, victim_lines) = client_process(&address);
    wait_for_line(&victim_lines, "training client");
    let survivors: Vec<Child> = (0..2).map(|_| client_process(&address).0).collect();
    victim.kill().unwrap(); // SIGKILL, mid-training
    victim.wait().unwrap();
    let output = server.wait_with_output().unwrap();
    succeeded(&output);
    for mut client in survivors {
        client.wait().unwrap();
    }
    let run_dir = only_run_dir(&base);
    let dropped: Vec<Vec<String>> = client_rows(&run_dir)
        .into_iter()
        .filter(|row| !row.last().unwrap().is_empty())
        .collect();
    assert_eq!(dropped.len(), 1, "the killed client's task: {dropped:?}");
    let reason = dropped[0].last().unwrap();
    assert!(
        reason.contains("client process") || reason.contains("connection"),
        "{reason}"
    );
    check_records(&run_dir, 6, 2);
}

#[test]
fn oort_selects_on_the_real_clock_and_keeps_its_state() {
    let dir = tempfile::tempdir().unwrap();
    let text = job(free_port(), 6, 2, 1, "type = \"fedbuff\"").replace(
        "comm_simulation = false",
        "comm_simulation = false\nselection = \"oort\"",
    );
    let config = write_config(dir.path(), &text);
    let run_dir = run(&config, &dir.path().join("runs"), &[]);
    check_records(&run_dir, 6, 1);
    let sidecar = std::fs::read_to_string(run_dir.join("checkpoints/round-0006.json")).unwrap();
    assert!(sidecar.contains("\"policy\""), "{sidecar}");
    assert!(sidecar.contains("\"arms\""), "{sidecar}");
    // Oort explores clients it has not seen: six updates from two places
    // come from more than two clients.
    let mut clients: Vec<String> = client_rows(&run_dir)
        .into_iter()
        .map(|r| r[1].clone())
        .collect();
    clients.sort();
    clients.dedup();
    assert!(clients.len() > 2, "{clients:?}");
}

#[test]
fn a_resumed_network_run_sends_the_tasks_in_flight_again_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &job(free_port(), 6, 3, 2, "type = \"fedbuff\""));
    let run_dir = run(&config, &dir.path().join("runs"), &["--rounds", "3"]);
    let sidecar = std::fs::read_to_string(run_dir.join("checkpoints/round-0003.json")).unwrap();
    assert!(sidecar.contains("\"tasks\""), "{sidecar}");
    let history: serde_json::Value = serde_json::from_str(&sidecar).unwrap();
    let in_flight = history["asynchronous"]["tasks"].as_array().unwrap().len();
    // Three places, one freed by the update that filled the buffer (each
    // earlier one was refilled before the next arrived).
    assert_eq!(in_flight, 2, "{sidecar}");

    let resumed = common::cohort(
        &[
            "run",
            "--resume",
            run_dir.to_str().unwrap(),
            "--cpu",
            "--quiet",
            "--rounds",
            "6",
        ],
        &fixture_data(),
    );
    succeeded(&resumed);
    let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    assert!(log.contains("resuming after round 3"), "{log}");
    check_records(&run_dir, 6, 2);
}

#[test]
fn a_network_server_killed_after_a_checkpoint_resumes_and_completes() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &job(free_port(), 6, 3, 2, "type = \"fedbuff\"").replace("rounds = 6", "rounds = 10"),
    );
    // The client processes it started lose their connection with it and end.
    let killed = common::run_killed_after_checkpoint(&config, &dir.path().join("runs"), 3);
    assert!(
        !killed.join("checkpoints/round-0010.json").exists(),
        "killed before the last round"
    );
    common::resume_to_success(&killed, &[]);
    let log = std::fs::read_to_string(killed.join("run.log")).unwrap();
    assert!(log.contains("resuming after round"), "{log}");
    check_records(&killed, 10, 2);
}
