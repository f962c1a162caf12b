//! Network mode (`clients.comm_simulation = false`) with real `cohort client`
//! processes over loopback sockets.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use common::{cohort_command, free_port, only_run_dir, spawn_server_alone, write_config};

/// Two logical clients with 300 and 100 samples (3:1), one round.
fn unequal_job(port: u16, comm_simulation: bool) -> String {
    format!(
        r#"
[clients]
total_clients = 2
per_round = 2
comm_simulation = {comm_simulation}

[server]
port = {port}
registration_timeout = 60

[data]
datasource = "FashionMNIST"
download = false
partition_sizes = [300, 100]

[trainer]
rounds = 1
epochs = 1
batch_size = 20
max_concurrency = 2
optimizer = "sgd"
model_name = "lenet5"
model_seed = 3
training_seed = 5

[parameters.optimizer]
learning_rate = 0.05
momentum = 0.9

[results]
keep_client_updates = true
"#
    )
}

fn run_to_completion(
    dir: &Path,
    config_text: &str,
    extra: &[&str],
) -> (PathBuf, std::process::Output) {
    let config = write_config(dir, config_text);
    let base = dir.join("runs");
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
    let output = cohort_command(&args).output().unwrap();
    (base, output)
}

/// Float32 tensors of a safetensors file, read with the `safetensors` crate
/// directly (not cohort's codec), by name.
fn tensors(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<f32>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn two_client_processes_give_the_exact_sample_weighted_mean() {
    let dir = tempfile::tempdir().unwrap();
    let (base, output) = run_to_completion(dir.path(), &unequal_job(free_port(), false), &[]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let run_dir = only_run_dir(&base);

    // Two physical processes registered, and each trained one logical client.
    let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    assert_eq!(log.matches("client process registered").count(), 2, "{log}");
    // Their output is in the run folder, not on the server's stderr.
    for index in 0..2 {
        let path = run_dir.join(format!("logs/client-{index}.log"));
        let client_log = std::fs::read_to_string(&path).unwrap();
        assert!(
            client_log.contains("the server closed the session"),
            "{path:?}: {client_log}"
        );
        assert!(
            !client_log.contains('\u{1b}'),
            "{path:?} has colour codes: {client_log}"
        );
    }
    let server_stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !server_stderr.contains("the server closed the session"),
        "{server_stderr}"
    );
    let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    let rows: Vec<Vec<&str>> = clients
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(rows.len(), 2, "{clients}");
    let mut samples: Vec<(&str, &str)> = rows.iter().map(|r| (r[1], r[3])).collect();
    samples.sort();
    assert_eq!(samples, [("1", "300"), ("2", "100")], "{clients}");
    assert_ne!(
        rows[0][2], rows[1][2],
        "two different worker processes: {clients}"
    );

    // The aggregated model, computed independently: 0.75·a + 0.25·b in float32.
    let updates = run_dir.join("updates/round-0001");
    let a = tensors(&updates.join("client-0001.safetensors"));
    let b = tensors(&updates.join("client-0002.safetensors"));
    let global = tensors(&run_dir.join("model.safetensors"));
    assert_eq!(global.len(), 10);
    let (wa, wb) = ((300.0f64 / 400.0) as f32, (100.0f64 / 400.0) as f32);
    for ((name, g), ((_, x), (_, y))) in global.iter().zip(a.iter().zip(&b)) {
        for (i, ((&g, &x), &y)) in g.iter().zip(x).zip(y).enumerate() {
            let expected = wa * x + wb * y;
            assert_eq!(
                g.to_bits(),
                expected.to_bits(),
                "{name}[{i}]: {g} vs {expected}"
            );
        }
    }
    assert_ne!(a, b, "the two clients trained on different data");

    // The same config in one process gives the same model, bit for bit.
    let dir2 = tempfile::tempdir().unwrap();
    let (base2, output2) = run_to_completion(dir2.path(), &unequal_job(free_port(), true), &[]);
    assert!(
        output2.status.success(),
        "{}",
        String::from_utf8_lossy(&output2.stderr)
    );
    assert_eq!(
        std::fs::read(only_run_dir(&base2).join("model.safetensors")).unwrap(),
        std::fs::read(run_dir.join("model.safetensors")).unwrap()
    );
}

#[test]
fn the_server_says_whom_it_waits_for_and_claims_no_workers_it_does_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &unequal_job(free_port(), false));
    let base = dir.path().join("runs");
    let output = cohort_command(&[
        "run",
        "--config",
        config.to_str().unwrap(),
        "--cpu",
        "--base",
        base.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("the clients train in their own processes"),
        "{stderr}"
    );
    assert!(!stderr.contains("workers ×"), "{stderr}");
    assert!(
        stderr.contains("waits for 2 client process(es) (2 started here, output in ")
            && stderr.contains(
                "each round gives 2 clients to them and aggregates once 2 updates are in"
            ),
        "{stderr}"
    );
    assert!(
        stderr.contains("client processes registered: 2 of 2: starting round 1"),
        "{stderr}"
    );
    // Each change is a line: never more than one per count.
    for count in 0..=2 {
        let prefix = format!("client processes registered: {count} of 2");
        assert!(stderr.matches(&prefix).count() <= 1, "{stderr}");
    }
}

/// Three logical clients, all in every round, with enough local work that a
/// process can be killed while it trains.
fn three_client_job(port: u16, min_per_round: u32) -> String {
    format!(
        r#"
[clients]
total_clients = 3
per_round = 3
min_per_round = {min_per_round}
comm_simulation = false

[server]
port = {port}
registration_timeout = 60
payload_timeout = 120

[data]
datasource = "FashionMNIST"
download = false

[trainer]
rounds = 2
epochs = 8
batch_size = 16
max_concurrency = 3
optimizer = "sgd"
model_name = "lenet5"
model_seed = 3
training_seed = 5

[parameters.optimizer]
learning_rate = 0.05
"#
    )
}

struct Killed {
    server: std::process::Output,
    base: PathBuf,
    _dir: tempfile::TempDir,
}

/// Starts the server and three client processes by hand, kills the first
/// client as soon as it reports that it is training, and waits for the server.
fn run_and_kill_one(min_per_round: u32) -> Killed {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(dir.path(), &three_client_job(port, min_per_round));
    let base = dir.path().join("runs");
    let server = spawn_server_alone(&config, &base, Stdio::piped());
    let address = format!("127.0.0.1:{port}");
    let mut clients: Vec<Child> = (0..3)
        .map(|_| {
            cohort_command(&["client", "--server", &address, "--cpu"])
                .stderr(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let victim_log = clients[0].stderr.take().unwrap();
    let mut saw_training = false;
    for line in BufReader::new(victim_log).lines() {
        let line = line.unwrap();
        if line.contains("training client") {
            saw_training = true;
            break;
        }
    }
    assert!(saw_training, "the first client never started training");
    clients[0].kill().unwrap();
    clients[0].wait().unwrap();
    let server = server.wait_with_output().unwrap();
    for client in &mut clients[1..] {
        // They end by themselves once the server closes the session.
        client.wait().unwrap();
    }
    Killed {
        server,
        base,
        _dir: dir,
    }
}

#[test]
fn a_killed_client_process_is_dropped_and_the_round_goes_on_with_min_per_round_2() {
    let killed = run_and_kill_one(2);
    let stderr = String::from_utf8_lossy(&killed.server.stderr);
    assert!(killed.server.status.success(), "{stderr}");
    assert!(
        stderr.contains("client dropped"),
        "the drop is logged: {stderr}"
    );
    let run_dir = only_run_dir(&killed.base);
    let results = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 3, "both rounds ran: {results}");
    let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    // Aggregated rows end with an empty `dropped` field.
    let per_round = |round: &str| {
        clients
            .lines()
            .filter(|l| l.starts_with(&format!("{round},")) && l.ends_with(','))
            .count()
    };
    assert_eq!(
        per_round("1"),
        2,
        "round 1 aggregated the two survivors: {clients}"
    );
    let dropped: Vec<&str> = clients.lines().filter(|l| !l.ends_with(',')).collect();
    assert_eq!(
        dropped.len(),
        2,
        "the header and the killed client: {clients}"
    );
    assert!(dropped[1].starts_with("1,"), "{clients}");
    assert_eq!(
        per_round("2"),
        3,
        "round 2 ran all three clients on two processes: {clients}"
    );
}

#[test]
fn a_killed_client_process_stops_the_run_cleanly_with_min_per_round_3() {
    let killed = run_and_kill_one(3);
    let stderr = String::from_utf8_lossy(&killed.server.stderr);
    assert!(!killed.server.status.success());
    assert!(
        stderr.contains("round 1: only 2 of 3 clients returned an update"),
        "{stderr}"
    );
    assert!(stderr.contains("clients.min_per_round = 3"), "{stderr}");
    // Nothing of a run that never finished a round is left behind.
    assert!(
        stderr.contains("the run failed before its first round; its folder"),
        "{stderr}"
    );
    let left = std::fs::read_dir(&killed.base).map_or(0, |entries| entries.count());
    assert_eq!(
        left,
        0,
        "a run folder was left under {}",
        killed.base.display()
    );
}

#[test]
fn a_wrong_token_is_refused_and_the_right_one_works() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let job = unequal_job(port, false).replace(
        "registration_timeout = 60",
        "registration_timeout = 60\nauth_token = \"s3cret\"",
    );
    let config = write_config(dir.path(), &job);
    let base = dir.path().join("runs");
    let server = spawn_server_alone(&config, &base, Stdio::piped());
    let address = format!("127.0.0.1:{port}");
    let intruder = cohort_command(&["client", "--server", &address, "--token", "guess"])
        .output()
        .unwrap();
    assert!(!intruder.status.success());
    let message = String::from_utf8_lossy(&intruder.stderr);
    assert!(message.contains("refused"), "{message}");
    let members: Vec<Child> = (0..2)
        .map(|_| {
            cohort_command(&["client", "--server", &address, "--cpu", "--quiet"])
                .env("COHORT_TOKEN", "s3cret")
                .stderr(Stdio::piped())
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
    for member in members {
        let done = member.wait_with_output().unwrap();
        assert!(
            done.status.success(),
            "{}",
            String::from_utf8_lossy(&done.stderr)
        );
    }
}

#[test]
fn tls_with_a_generated_certificate_carries_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let certified =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    let cert = dir.path().join("server.pem");
    let key = dir.path().join("server.key");
    std::fs::write(&cert, certified.cert.pem()).unwrap();
    std::fs::write(&key, certified.signing_key.serialize_pem()).unwrap();
    let job = unequal_job(free_port(), false).replace(
        "registration_timeout = 60",
        &format!(
            "registration_timeout = 60\ntls_cert = \"{}\"\ntls_key = \"{}\"",
            cert.display(),
            key.display()
        ),
    );
    let (base, output) = run_to_completion(dir.path(), &job, &[]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let results = std::fs::read_to_string(only_run_dir(&base).join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 2, "{results}");
}

/// `unequal_job` for two rounds of plain SGD under `algorithm`: round 2 is
/// where SCAFFOLD's corrections are non-zero.
fn strategy_job(port: u16, comm_simulation: bool, algorithm: &str) -> String {
    unequal_job(port, comm_simulation)
        .replace("rounds = 1", "rounds = 2")
        .replace("momentum = 0.9", "")
        .replace(
            "[results]",
            &format!("[algorithm]\n{algorithm}\n\n[results]"),
        )
}

#[test]
fn fedprox_and_scaffold_give_the_same_model_over_the_network() {
    for algorithm in ["type = \"fedprox\"\nmu = 0.5", "type = \"scaffold\""] {
        let network_dir = tempfile::tempdir().unwrap();
        let (base, output) = run_to_completion(
            network_dir.path(),
            &strategy_job(free_port(), false, algorithm),
            &[],
        );
        assert!(
            output.status.success(),
            "{algorithm}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let network_run = only_run_dir(&base);
        let local_dir = tempfile::tempdir().unwrap();
        let (base, output) = run_to_completion(
            local_dir.path(),
            &strategy_job(free_port(), true, algorithm),
            &[],
        );
        assert!(output.status.success(), "{algorithm}");
        let local_run = only_run_dir(&base);
        assert_eq!(
            std::fs::read(network_run.join("model.safetensors")).unwrap(),
            std::fs::read(local_run.join("model.safetensors")).unwrap(),
            "{algorithm}: network and simulation differ"
        );
        // The strategy did something: its model differs from plain FedAvg's.
        let fedavg_dir = tempfile::tempdir().unwrap();
        let (base, output) = run_to_completion(
            fedavg_dir.path(),
            &strategy_job(free_port(), true, "type = \"fedavg\""),
            &[],
        );
        assert!(output.status.success());
        assert_ne!(
            std::fs::read(only_run_dir(&base).join("model.safetensors")).unwrap(),
            std::fs::read(local_run.join("model.safetensors")).unwrap(),
            "{algorithm} trained exactly like fedavg"
        );
        if algorithm.contains("scaffold") {
            let csv = std::fs::read_to_string(network_run.join("results.csv")).unwrap();
            let extra: Vec<&str> = csv
                .lines()
                .skip(1)
                .map(|l| l.split(',').nth(10).unwrap())
                .collect();
            assert!(extra.iter().all(|e| e.parse::<u64>().unwrap() > 0), "{csv}");
        }
    }
}

/// Past `server.max_inflight_bytes` of decoded updates, a fedavg or fedprox
/// round keeps the rest of its updates on disk and folds every update into
/// the mean one at a time: the model is still the simulation's, bit for
/// bit, and no spill file outlives its round.
#[test]
fn updates_past_the_inflight_budget_wait_on_disk_and_give_the_simulations_model() {
    // Of 600,000 bytes in flight, 300,000 receive (one LeNet-5 update of
    // 247 KB) and 300,000 keep one decoded update, not two.
    let job = |port: u16, comm_simulation: bool, algorithm: &str| {
        strategy_job(port, comm_simulation, algorithm)
            .replace(
                "total_clients = 2\nper_round = 2",
                "total_clients = 4\nper_round = 4",
            )
            .replace("[300, 100]", "[300, 100, 50, 7]")
            .replace(
                "registration_timeout = 60",
                "registration_timeout = 60\nmax_payload_bytes = 300000\nmax_inflight_bytes = 600000",
            )
            .replace("keep_client_updates = true", "keep_client_updates = false")
    };
    for algorithm in ["type = \"fedavg\"", "type = \"fedprox\"\nmu = 0.5"] {
        let network_dir = tempfile::tempdir().unwrap();
        let (base, output) =
            run_to_completion(network_dir.path(), &job(free_port(), false, algorithm), &[]);
        assert!(
            output.status.success(),
            "{algorithm}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let network_run = only_run_dir(&base);
        let log = std::fs::read_to_string(network_run.join("run.log")).unwrap();
        assert_eq!(
            log.matches("wait on disk for aggregation").count(),
            2,
            "{algorithm}: every round spilled: {log}"
        );
        assert!(log.contains("spilled=3"), "{algorithm}: {log}");
        let left: Vec<_> = std::fs::read_dir(&network_run)
            .unwrap()
            .flatten()
            .filter(|entry| entry.file_name().to_string_lossy().ends_with(".spill"))
            .collect();
        assert!(left.is_empty(), "{algorithm}: {left:?}");
        let local_dir = tempfile::tempdir().unwrap();
        let (base, output) =
            run_to_completion(local_dir.path(), &job(free_port(), true, algorithm), &[]);
        assert!(output.status.success(), "{algorithm}");
        assert_eq!(
            std::fs::read(network_run.join("model.safetensors")).unwrap(),
            std::fs::read(only_run_dir(&base).join("model.safetensors")).unwrap(),
            "{algorithm}: network and simulation differ"
        );
    }
}

/// Whether SIGPIPE is ignored in the running process `pid` (Linux's
/// `SigIgn` mask in /proc, bit `signal - 1`).
#[cfg(target_os = "linux")]
fn ignores_sigpipe(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let mask = status
        .lines()
        .find_map(|line| line.strip_prefix("SigIgn:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
        .unwrap();
    mask & (1 << (libc::SIGPIPE - 1)) != 0
}

/// A server and a client write to sockets whose peer may have just left.
/// Under SIGPIPE's default action hyper's vectored writes would kill them
/// without a word (a client whose server had just finished did die so,
/// seen in CI); ignored, the write fails and the transport handles it.
/// Both processes are checked once the client has registered, well after
/// the command line chose the disposition.
#[cfg(target_os = "linux")]
#[test]
fn a_server_and_its_clients_ignore_sigpipe() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(dir.path(), &unequal_job(port, false));
    let mut server = spawn_server_alone(&config, &dir.path().join("runs"), Stdio::null());
    // One of the two clients the run waits for: it registers and waits.
    let mut client = cohort_command(&["client", "--server", &format!("127.0.0.1:{port}")])
        .args(["--cpu", "--connect-timeout", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = BufReader::new(client.stderr.take().unwrap());
    let mut registered = false;
    for line in log.lines() {
        if line.unwrap().contains("registered; waiting for tasks") {
            registered = true;
            break;
        }
    }
    let (server_ignores, client_ignores) =
        (ignores_sigpipe(server.id()), ignores_sigpipe(client.id()));
    for child in [&mut client, &mut server] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    assert!(registered, "the client never registered");
    assert!(server_ignores, "the server takes SIGPIPE's default action");
    assert!(client_ignores, "the client takes SIGPIPE's default action");
}
