//! `[secure_aggregation]` in network mode: a `cohort run` server and eight
//! real `cohort client` processes over loopback. The secure model equals
//! plain network FedAvg of the same updates within the quantisation bound;
//! clients that really exit at a stage (the hidden `--secagg-fault`) are
//! survived or fail the round as the protocol and `clients.min_per_round`
//! say; rogue clients are dropped; and nothing in the server's run folder
//! or logs holds a client's update.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};

use cohort_core::codec;
use cohort_core::secagg::{NumShares, Params, mean_error_bound};
use cohort_core::tree::ParamTree;

use common::{
    cohort_command, free_port, only_run_dir, resume_to_success, run_config, spawn_server_alone,
    write_config,
};

const SIZES: [u64; 8] = [20, 30, 40, 50, 60, 70, 80, 90];

/// Eight clients, all in every round, from the model in `initial`.
fn job(port: u16, initial: &Path, rounds: u32, min_per_round: u32, extra: &str) -> String {
    format!(
        r#"
[clients]
total_clients = 8
per_round = 8
min_per_round = {min_per_round}
comm_simulation = false
[server]
port = {port}
registration_timeout = 120
payload_timeout = 120
[data]
datasource = "FashionMNIST"
download = false
partition_sizes = [20, 30, 40, 50, 60, 70, 80, 90]
[trainer]
rounds = {rounds}
# The server waits for all eight processes, so each trains one client in
# round 1 and a process that leaves takes exactly its client with it.
max_concurrency = 8
epochs = 1
batch_size = 10
optimizer = "sgd"
initial_model = {initial:?}
training_seed = 1
[parameters.optimizer]
learning_rate = 0.05
{extra}
"#,
        initial = initial.display().to_string()
    )
}

const SECAGG_PLUS: &str = r#"
[secure_aggregation]
protocol = "secaggplus"
num_shares = 5
reconstruction_threshold = 3
max_weight = 100.0
clipping_range = 4.0
timeout = 60
"#;

const SECAGG_COMPLETE: &str = r#"
[secure_aggregation]
protocol = "secagg"
reconstruction_threshold = 5
max_weight = 100.0
clipping_range = 4.0
timeout = 60
"#;

/// The seeded LeNet-5 as a model file, so every run starts from a model the
/// test knows.
fn initial_model(dir: &Path) -> (PathBuf, ParamTree) {
    let cpu = cohort_train::device::cpu();
    let lenet = cohort_train::params::extract(&cohort_train::model::LeNet5::new(10, &cpu));
    let initial = cohort_train::init::seeded_parameters(&lenet, 3);
    let file = dir.join("initial.safetensors");
    std::fs::write(&file, codec::encode(&initial).unwrap()).unwrap();
    (file, initial)
}

struct Finished {
    server: Output,
    run_dir: Option<PathBuf>,
    client_logs: Vec<String>,
}

/// Runs `config_text` with a server that starts no clients of its own and
/// eight `cohort client` processes, the i-th with `faults[i]` (if any).
fn run(dir: &Path, name: &str, config_text: &str, faults: &[&str]) -> Finished {
    run_with(dir, name, config_text, faults, 8)
}

/// [`run`] with `processes` client processes.
fn run_with(
    dir: &Path,
    name: &str,
    config_text: &str,
    faults: &[&str],
    processes: usize,
) -> Finished {
    let folder = dir.join(name);
    std::fs::create_dir_all(&folder).unwrap();
    let config = write_config(&folder, config_text);
    let base = folder.join("runs");
    let server = spawn_server_alone(&config, &base, Stdio::piped());
    let port = config_text
        .lines()
        .find_map(|l| l.strip_prefix("port = "))
        .unwrap();
    let address = format!("127.0.0.1:{port}");
    let clients: Vec<Child> = (0..processes)
        .map(|i| {
            let mut args = vec!["client", "--server", &address, "--cpu"];
            if config_text.contains("[secure_aggregation]") {
                args.push("--require-secure-aggregation");
            }
            if let Some(fault) = faults.get(i) {
                args.extend(["--secagg-fault", fault]);
            }
            cohort_command(&args)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let server = server.wait_with_output().unwrap();
    let client_logs = clients
        .into_iter()
        .map(|c| String::from_utf8_lossy(&c.wait_with_output().unwrap().stderr).into_owned())
        .collect();
    // A run refused before round 1 leaves no run folder.
    let has_run = std::fs::read_dir(&base).is_ok_and(|mut entries| entries.next().is_some());
    let run_dir = has_run.then(|| only_run_dir(&base));
    Finished {
        server,
        run_dir,
        client_logs,
    }
}

fn succeeded(finished: &Finished) -> PathBuf {
    assert!(
        finished.server.status.success(),
        "server: {}\nclients: {:?}",
        String::from_utf8_lossy(&finished.server.stderr),
        finished.client_logs
    );
    finished.run_dir.clone().expect("a run folder")
}

fn floats(tree: &ParamTree) -> Vec<f32> {
    let mut out = Vec::new();
    tree.for_each_leaf(&mut |_, array| out.extend_from_slice(array.as_f32().unwrap()));
    out
}

fn read_model(path: &Path) -> ParamTree {
    let bytes = std::fs::read(path).unwrap();
    codec::decode(&bytes, &codec::DecodeLimits::default()).unwrap()
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// The first file under `dir` holding 64 consecutive bytes of one of
/// `updates` (each as its little-endian float32 bytes), taken at a few
/// places of each: a client's update, whole or in part, in any file format
/// that stores floats as they are.
fn file_with_an_update(dir: &Path, updates: &[Vec<f32>]) -> Option<(PathBuf, usize)> {
    let windows: Vec<(usize, Vec<u8>)> = updates
        .iter()
        .enumerate()
        .flat_map(|(c, update)| {
            let bytes: Vec<u8> = update.iter().flat_map(|v| v.to_le_bytes()).collect();
            [0, bytes.len() / 3, bytes.len() / 2, bytes.len() - 64]
                .into_iter()
                .map(move |at| (c + 1, bytes[at..at + 64].to_vec()))
                .collect::<Vec<_>>()
        })
        .collect();
    files_under(dir).into_iter().find_map(|path| {
        let content = std::fs::read(&path).unwrap();
        windows
            .iter()
            .find(|(_, w)| content.windows(64).any(|x| x == w.as_slice()))
            .map(|(c, _)| (path.clone(), *c))
    })
}

fn secagg_rows(run_dir: &Path) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(run_dir.join("secagg.csv")).unwrap();
    text.lines()
        .skip(1)
        .map(|l| l.split(',').map(str::to_owned).collect())
        .collect()
}

fn run_log(run_dir: &Path) -> String {
    std::fs::read_to_string(run_dir.join("run.log")).unwrap()
}

#[test]
fn eight_processes_give_plain_fedavg_within_the_bound_and_leave_no_update_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (file, initial) = initial_model(dir.path());
    let keep = "[results]\nkeep_client_updates = true\n";
    let plain = run(
        dir.path(),
        "plain",
        &job(free_port(), &file, 1, 8, keep),
        &[],
    );
    let plain_dir = succeeded(&plain);
    let updates: Vec<Vec<f32>> = (1..=8)
        .map(|c| {
            let path = plain_dir.join(format!("updates/round-0001/client-{c:04}.safetensors"));
            floats(&read_model(&path))
        })
        .collect();
    // The scan finds updates where they are: it can fail.
    assert!(file_with_an_update(&plain_dir, &updates).is_some());
    let g = floats(&initial);
    let total: f64 = SIZES.iter().sum::<u64>() as f64;
    let exact: Vec<f64> = (0..g.len())
        .map(|j| {
            let sum: f64 = updates
                .iter()
                .zip(SIZES)
                .map(|(x, n)| n as f64 * f64::from(x[j]))
                .sum();
            sum / total
        })
        .collect();
    let max_change = updates
        .iter()
        .flat_map(|x| x.iter().zip(&g).map(|(a, b)| f64::from((a - b).abs())))
        .fold(0.0, f64::max);
    let plain_model = floats(&read_model(&plain_dir.join("model.safetensors")));
    for (j, want) in exact.iter().enumerate() {
        assert!(
            (f64::from(plain_model[j]) - want).abs() <= 1e-5,
            "element {j}"
        );
    }
    for (name, section, num_shares) in [
        ("secaggplus", SECAGG_PLUS, NumShares::Neighbours(5)),
        ("secagg", SECAGG_COMPLETE, NumShares::All),
    ] {
        let threshold = if num_shares == NumShares::All { 5 } else { 3 };
        let params = Params {
            max_weight: 100.0,
            clipping_range: 4.0,
            ..Params::new(num_shares, threshold)
        };
        // Nothing is clipped: each weighted change is at most max_change.
        assert!(max_change < params.clipping_range, "{max_change}");
        // mean_error_bound: (e_S + M·e_T) / (T − e_T) with
        // e_S = n·max_weight·(2c/Q + M/(2Q)), e_T = n·max_weight/(2Q).
        let bound = mean_error_bound(&params, 8, total, max_change).unwrap();
        let secure = run(
            dir.path(),
            name,
            &job(free_port(), &file, 1, 8, section),
            &[],
        );
        let secure_dir = succeeded(&secure);
        let model = floats(&read_model(&secure_dir.join("model.safetensors")));
        let mut worst = 0.0f64;
        for (j, want) in exact.iter().enumerate() {
            let rounding = f64::from(f32::EPSILON) * want.abs();
            let error = (f64::from(model[j]) - want).abs();
            assert!(
                error <= bound + rounding,
                "{name} element {j}: {error} > {bound}"
            );
            worst = worst.max(error);
        }
        eprintln!("{name}: bound {bound:e}, worst error {worst:e}, max |x - g| {max_change}");
        assert!(
            worst > 0.0,
            "{name}: an exact sum would mean no quantisation"
        );
        let rows = secagg_rows(&secure_dir);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0][..3], ["1", "8", "8"], "{name}");
        // The masked inputs crossed the network: 8 × (61,706 + 1) × 4 bytes.
        assert!(rows[0][7].parse::<u64>().unwrap() >= 8 * 61_707 * 4);
        // Nothing of any client's update in the server's folder or its logs.
        assert!(!secure_dir.join("updates").exists());
        assert_eq!(file_with_an_update(&secure_dir, &updates), None, "{name}");
        let stderr = &secure.server.stderr;
        let windows = updates[0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>();
        assert!(!stderr.windows(64).any(|w| w == &windows[..64]));
    }
}

#[test]
fn a_client_gone_after_sharing_keys_and_one_after_masking_are_survived() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _) = initial_model(dir.path());
    let text = job(free_port(), &file, 1, 6, SECAGG_PLUS);
    let faults = ["leave-at-masked-input", "leave-at-unmask"];
    let finished = run(dir.path(), "dropouts", &text, &faults);
    let run_dir = succeeded(&finished);
    for log in &finished.client_logs[..2] {
        assert!(log.contains("--secagg-fault: leaving at"), "{log}");
    }
    // The one gone after its masked input is in the sum (its self mask is
    // rebuilt from its neighbours' shares); the other's masks are removed.
    let rows = secagg_rows(&run_dir);
    assert_eq!(rows[0][..3], ["1", "8", "7"], "{rows:?}");
    let log = run_log(&run_dir);
    assert!(log.contains("left at collect_masked_input"), "{log}");
    assert!(log.contains("its input is in the sum"), "{log}");
    let model = floats(&read_model(&run_dir.join("model.safetensors")));
    assert!(model.iter().all(|v| v.is_finite()));
}

#[test]
fn too_many_dropouts_fail_the_round_and_min_per_round_decides_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let (file, initial) = initial_model(dir.path());
    let faults = ["leave-at-masked-input"; 6];
    // Two clients left of eight, threshold 3: the round aborts. With
    // min_per_round = 1 the model stays and the next round runs on the two
    // processes left, each serving four clients.
    let goes_on = run(
        dir.path(),
        "goes_on",
        &job(free_port(), &file, 2, 1, SECAGG_PLUS),
        &faults,
    );
    let run_dir = succeeded(&goes_on);
    let log = run_log(&run_dir);
    assert!(log.contains("secure aggregation failed"), "{log}");
    let rows = secagg_rows(&run_dir);
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0][2], "0", "round 1 aggregated nothing: {rows:?}");
    assert_eq!(rows[1][..3], ["2", "8", "8"], "{rows:?}");
    let model = floats(&read_model(&run_dir.join("model.safetensors")));
    assert_ne!(model, floats(&initial), "round 2 moved the model");

    // With min_per_round = 3 the run stops, naming why.
    let stops = run(
        dir.path(),
        "stops",
        &job(free_port(), &file, 2, 3, SECAGG_PLUS),
        &faults,
    );
    let stderr = String::from_utf8_lossy(&stops.server.stderr);
    assert!(!stops.server.status.success(), "{stderr}");
    assert!(
        stderr.contains("secure aggregation protocol aborted")
            && stderr.contains("clients.min_per_round = 3"),
        "{stderr}"
    );
}

#[test]
fn rogue_clients_are_dropped_from_the_round_not_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _) = initial_model(dir.path());
    let text = job(free_port(), &file, 1, 5, SECAGG_COMPLETE);
    let faults = ["malformed-shares", "stranger-share", "short-input"];
    let finished = run(dir.path(), "rogues", &text, &faults);
    let run_dir = succeeded(&finished);
    let rows = secagg_rows(&run_dir);
    assert_eq!(rows[0][..3], ["1", "8", "5"], "{rows:?}");
    let log = run_log(&run_dir);
    for refusal in [
        "bytes; expected 105",
        "which is not a neighbour it was given",
        "masked vector has 61706 entries; expected 61707",
    ] {
        assert!(log.contains(refusal), "{refusal}: {log}");
    }
}

/// How a rogue speaking the proto itself misbehaves.
#[derive(Clone, Copy)]
enum Rogue {
    /// An answer to the setup whose bytes are no message at all.
    GarbageKeys,
    /// An answer to the setup that announces a terabyte.
    HugeAnswer,
    /// Its update in the clear beside the report.
    UpdateInTheClear,
}

/// Registers, answers its task with a report as an honest client would
/// (the sample count and steps of its partition), then misbehaves as
/// `rogue` says; answers nothing else.
async fn rogue_client(address: String, rogue: Rogue) {
    use cohort_runtime::grpc::proto::client_message::Kind;
    use cohort_runtime::grpc::proto::federation_client::FederationClient;
    use cohort_runtime::grpc::proto::server_message::Kind as ServerKind;
    use cohort_runtime::grpc::proto::{self, ClientMessage};
    use tokio_stream::wrappers::ReceiverStream;

    let mut client = loop {
        match FederationClient::connect(format!("http://{address}")).await {
            Ok(client) => break client,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    };
    let (sender, receiver) = tokio::sync::mpsc::channel(8);
    let send = |kind| ClientMessage { kind: Some(kind) };
    let register = proto::Register {
        name: "rogue".into(),
        protocol: cohort_runtime::grpc::PROTOCOL_VERSION,
        ..Default::default()
    };
    sender.send(send(Kind::Register(register))).await.unwrap();
    let response = client.join(ReceiverStream::new(receiver)).await.unwrap();
    let mut inbound = response.into_inner();
    while let Ok(Some(message)) = inbound.message().await {
        match message.kind {
            Some(ServerKind::Task(task)) => {
                // Late, as if it trained: by then every honest process has
                // taken its task, so the rogue holds exactly one client.
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                let samples = SIZES[task.client_id as usize - 1];
                let update = match rogue {
                    Rogue::UpdateInTheClear => vec![7u8; 4096],
                    _ => Vec::new(),
                };
                let report = proto::Report {
                    client_id: task.client_id,
                    round: task.round,
                    num_samples: samples,
                    loss: 0.5,
                    training_time: 0.1,
                    payload_bytes: update.len() as u64,
                    local_steps: samples.div_ceil(10),
                    ..Default::default()
                };
                let _ = sender.send(send(Kind::Report(report))).await;
                if !update.is_empty() {
                    let chunk = proto::Chunk {
                        data: update.into(),
                    };
                    let _ = sender.send(send(Kind::Chunk(chunk))).await;
                }
            }
            Some(ServerKind::Secagg(request)) => {
                let (body_bytes, body) = match rogue {
                    Rogue::GarbageKeys => (5, vec![0xff; 5]),
                    Rogue::HugeAnswer => (1 << 40, Vec::new()),
                    Rogue::UpdateInTheClear => continue,
                };
                let answer = proto::SecAggAnswer {
                    round: request.round,
                    client_id: request.client_id,
                    stage: request.stage,
                    body_bytes,
                    refused: String::new(),
                };
                let _ = sender.send(send(Kind::Secagg(answer))).await;
                if !body.is_empty() {
                    let chunk = proto::Chunk { data: body.into() };
                    let _ = sender.send(send(Kind::Chunk(chunk))).await;
                }
            }
            _ => {}
        }
    }
}

#[test]
fn a_rogue_speaking_the_proto_is_dropped_with_the_reason() {
    for (rogue, reason) in [
        (
            Rogue::GarbageKeys,
            "message is malformed: message tag 255; expected 1",
        ),
        (Rogue::HugeAnswer, "an answer of 1099511627776 bytes"),
        (Rogue::UpdateInTheClear, "bytes of update in the clear"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (file, _) = initial_model(dir.path());
        let port = free_port();
        let address = format!("127.0.0.1:{port}");
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.spawn(rogue_client(address, rogue));
        // Seven honest processes and the rogue make the eight the server
        // waits for.
        let text = job(port, &file, 1, 5, SECAGG_PLUS);
        let finished = run_with(dir.path(), "rogue", &text, &[], 7);
        let run_dir = succeeded(&finished);
        let rows = secagg_rows(&run_dir);
        let log = run_log(&run_dir);
        assert!(log.contains(reason), "{reason}: {log}");
        // The rogue's client is out of the sum, the seven honest ones in.
        assert_eq!(rows[0][2], "7", "{rows:?} {log}");
        runtime.shutdown_background();
    }
}

/// A one-round run of `strategy` under SecAgg+ over the network, and the same
/// in simulation: the same protocol on the same updates.
#[test]
fn every_sum_only_strategy_runs_over_the_network_as_in_simulation() {
    let dir = tempfile::tempdir().unwrap();
    let (file, initial) = initial_model(dir.path());
    let params = Params {
        max_weight: 100.0,
        clipping_range: 4.0,
        ..Params::new(NumShares::Neighbours(5), 3)
    };
    let total: f64 = SIZES.iter().sum::<u64>() as f64;
    // Every |x − g| of these runs is below 0.1 (the first test prints it).
    let bound = mean_error_bound(&params, 8, total, 0.1).unwrap();
    for strategy in [
        "fedavg",
        "fedprox",
        "fedavgm",
        "fedadam",
        "fedyogi",
        "fedadagrad",
    ] {
        let extra = format!("{SECAGG_PLUS}\n[algorithm]\ntype = \"{strategy}\"\n");
        let network_text = job(free_port(), &file, 1, 8, &extra);
        let network = run(dir.path(), &format!("{strategy}-net"), &network_text, &[]);
        let network_dir = succeeded(&network);
        assert_eq!(
            secagg_rows(&network_dir)[0][..3],
            ["1", "8", "8"],
            "{strategy}"
        );
        let simulated_text =
            network_text.replace("comm_simulation = false", "comm_simulation = true");
        let simulated = common::run_job(&simulated_text);
        assert!(
            simulated.2.status.success(),
            "{}",
            String::from_utf8_lossy(&simulated.2.stderr)
        );
        let simulated_dir = only_run_dir(&simulated.1);
        let net = floats(&read_model(&network_dir.join("model.safetensors")));
        let sim = floats(&read_model(&simulated_dir.join("model.safetensors")));
        assert!(net.iter().all(|v| v.is_finite()), "{strategy}");
        assert_ne!(net, floats(&initial), "{strategy} moved the model");
        if matches!(strategy, "fedavg" | "fedprox") {
            // The server's step is the mean itself: both are within the
            // bound of the exact mean, so within twice it of each other.
            for (j, (a, b)) in net.iter().zip(&sim).enumerate() {
                let rounding = 2.0 * f64::from(f32::EPSILON) * f64::from(a.abs());
                let gap = f64::from((a - b).abs());
                assert!(
                    gap <= 2.0 * bound + rounding,
                    "{strategy} element {j}: {gap}"
                );
            }
        }
    }
}

#[test]
fn a_client_that_never_answers_is_cut_off_at_the_stage_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _) = initial_model(dir.path());
    let section = SECAGG_PLUS.replace("timeout = 60", "timeout = 3");
    let text = job(free_port(), &file, 1, 6, &section);
    let started = std::time::Instant::now();
    let finished = run(dir.path(), "stall", &text, &["stall-at-unmask"]);
    let run_dir = succeeded(&finished);
    // Its masked input is in the sum; its self mask comes from its
    // neighbours' shares once the deadline has passed.
    assert!(started.elapsed() >= std::time::Duration::from_secs(3));
    let rows = secagg_rows(&run_dir);
    assert_eq!(rows[0][..3], ["1", "8", "8"], "{rows:?}");
    let log = run_log(&run_dir);
    assert!(log.contains("left at unmask"), "{log}");
    assert!(
        finished.client_logs[0].contains("not answering unmask"),
        "{}",
        finished.client_logs[0]
    );
}

#[test]
fn a_client_that_requires_secure_aggregation_refuses_a_run_in_the_clear() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _) = initial_model(dir.path());
    let port = free_port();
    // No [secure_aggregation]; the server gives up waiting after a second.
    let text = job(port, &file, 1, 8, "")
        .replace("registration_timeout = 120", "registration_timeout = 1");
    let config = write_config(dir.path(), &text);
    let base = dir.path().join("runs");
    let config_arg = config.to_str().unwrap();
    let base_arg = base.to_str().unwrap();
    let server = cohort_command(&["run", "--config", config_arg, "--cpu", "--quiet"])
        .args(["--local-clients", "0", "--base", base_arg])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let address = format!("127.0.0.1:{port}");
    let client = cohort_command(&["client", "--server", &address, "--cpu"])
        .arg("--require-secure-aggregation")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&client.stderr);
    assert!(!client.status.success(), "{stderr}");
    assert!(
        stderr.contains("--require-secure-aggregation refuses"),
        "{stderr}"
    );
    assert!(!stderr.contains("training client"), "{stderr}");
    server.wait_with_output().unwrap();
}

/// Distributed discrete Gaussian noise: `clip_norm` 0.5, `noise_multiplier`
/// 1, so the mean of 8 contributors carries noise of standard deviation
/// `1 · 0.5 / 8 = 0.0625` on each value.
const NOISY: &str = r#"
[secure_aggregation]
protocol = "secagg"
reconstruction_threshold = 5
timeout = 60
noise = "distributed_discrete_gaussian"
clip_norm = 0.5
noise_multiplier = 1.0
delta = 1e-5
"#;

fn results_epsilons(run_dir: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let at = header.iter().position(|h| *h == "epsilon").unwrap();
    lines
        .map(|l| l.split(',').nth(at).unwrap().parse().unwrap())
        .collect()
}

/// ε after rounds of `contributors` each, as the accountant computes it.
fn accountant_epsilon(dim: usize, contributors: &[usize]) -> f64 {
    let params = cohort_core::secagg::DdgParams {
        clip_norm: 0.5,
        noise_multiplier: 1.0,
        expected_clients: 8,
        granularity: None,
        delta: 1e-5,
    };
    let ddg = params.resolve(dim, 1 << 32).unwrap();
    let mut accountant = cohort_core::secagg::DdgAccountant::default();
    contributors
        .iter()
        .for_each(|&n| accountant.record(&ddg, n));
    accountant.epsilon(1e-5)
}

/// The unweighted mean of the clipped changes, plus `g`: DDG's mean
/// without its noise.
fn clipped_mean(g: &[f32], updates: &[Vec<f32>], clip: f64) -> Vec<f64> {
    let mut mean: Vec<f64> = g.iter().map(|&v| f64::from(v)).collect();
    for x in updates {
        let change: Vec<f64> = x.iter().zip(g).map(|(a, b)| f64::from(a - b)).collect();
        let norm = change.iter().map(|c| c * c).sum::<f64>().sqrt();
        let factor = (clip / norm).min(1.0);
        for (m, c) in mean.iter_mut().zip(change) {
            *m += factor * c / updates.len() as f64;
        }
    }
    mean
}

/// The RMS of `model − reference`, checked against the noise's standard
/// deviation: over LeNet-5's 61,706 values the estimate is within 5% of it
/// (5 standard errors, `5/√(2·61706)` ≈ 1.4%, with room for the rounding).
fn assert_noise_of_the_stated_size(what: &str, model: &[f32], reference: &[f64], std: f64) {
    let squares: f64 = model
        .iter()
        .zip(reference)
        .map(|(&m, r)| (f64::from(m) - r).powi(2))
        .sum();
    let rms = (squares / model.len() as f64).sqrt();
    eprintln!("{what}: rms of the noise {rms:.6}, expected {std:.6}");
    assert!((rms / std - 1.0).abs() < 0.05, "{what}: rms {rms} vs {std}");
}

#[test]
fn distributed_noise_in_both_modes_has_its_size_and_reports_the_accountants_epsilon() {
    let dir = tempfile::tempdir().unwrap();
    let (file, initial) = initial_model(dir.path());
    let keep = "[results]\nkeep_client_updates = true\n";
    let plain = run(
        dir.path(),
        "plain",
        &job(free_port(), &file, 1, 8, keep),
        &[],
    );
    let plain_dir = succeeded(&plain);
    let updates: Vec<Vec<f32>> = (1..=8)
        .map(|c| {
            let path = plain_dir.join(format!("updates/round-0001/client-{c:04}.safetensors"));
            floats(&read_model(&path))
        })
        .collect();
    let g = floats(&initial);
    let reference = clipped_mean(&g, &updates, 0.5);
    let std = 1.0 * 0.5 / 8.0;

    let network = run(
        dir.path(),
        "network",
        &job(free_port(), &file, 1, 8, NOISY),
        &[],
    );
    let network_dir = succeeded(&network);
    let model = floats(&read_model(&network_dir.join("model.safetensors")));
    assert_noise_of_the_stated_size("network", &model, &reference, std);
    assert_eq!(secagg_rows(&network_dir)[0][..3], ["1", "8", "8"]);
    let expected = accountant_epsilon(g.len(), &[8]);
    let reported = results_epsilons(&network_dir);
    assert_eq!(reported.len(), 1);
    eprintln!("network: ε after one round of 8: {}", reported[0]);
    // results.csv keeps six decimals.
    assert!(
        (reported[0] - expected).abs() < 1e-6,
        "{reported:?} vs {expected}"
    );

    // Simulation: two rounds, a quarter of the clients vanishing mid-protocol;
    // each round is accounted with the clients in its sum.
    let simulated = job(free_port(), &file, 2, 4, NOISY)
        .replace("comm_simulation = false", "comm_simulation = true")
        .replace("timeout = 60\n", "simulated_dropout = 0.25\n");
    let folder = dir.path().join("simulation");
    std::fs::create_dir_all(&folder).unwrap();
    let config = write_config(&folder, &simulated);
    let base = folder.join("runs");
    let output = run_config(&config, &base, &[]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let sim_dir = only_run_dir(&base);
    let contributors: Vec<usize> = secagg_rows(&sim_dir)
        .iter()
        .map(|row| row[2].parse().unwrap())
        .collect();
    assert_eq!(contributors.len(), 2);
    assert!(
        contributors.iter().all(|&n| (6..=8).contains(&n)),
        "{contributors:?}"
    );
    let reported = results_epsilons(&sim_dir);
    for round in 0..2 {
        let expected = accountant_epsilon(g.len(), &contributors[..=round]);
        assert!(
            (reported[round] - expected).abs() < 1e-6,
            "round {round}: {reported:?} vs {expected}"
        );
    }
    assert!(reported[0] < reported[1], "{reported:?}");
    eprintln!("simulation: contributors {contributors:?}, ε {reported:?}");
    // The same config again gives the same model, bit for bit.
    let again_base = folder.join("again");
    let again = run_config(&config, &again_base, &[]);
    assert!(again.status.success());
    let a = std::fs::read(sim_dir.join("model.safetensors")).unwrap();
    let b = std::fs::read(only_run_dir(&again_base).join("model.safetensors")).unwrap();
    assert!(a == b, "a seeded simulation repeats");
    // Stopped after round 1 and resumed: the accountant is charged again
    // with round 1's contributors, so round 2 reports the uninterrupted ε,
    // and the model is the same bit for bit.
    let cut_base = folder.join("cut");
    let cut = run_config(&config, &cut_base, &["--rounds", "1"]);
    assert!(cut.status.success());
    let cut_dir = only_run_dir(&cut_base);
    resume_to_success(&cut_dir, &["--rounds", "2"]);
    assert_eq!(results_epsilons(&cut_dir), reported);
    let resumed = std::fs::read(cut_dir.join("model.safetensors")).unwrap();
    assert!(
        resumed == a,
        "the resumed run's model is the uninterrupted one's"
    );
}
