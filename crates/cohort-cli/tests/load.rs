//! Fifty clients on loopback against the real server binary for twenty
//! rounds, a third of them hostile: some register and vanish mid-task, some
//! hold a task and never answer, some answer with garbage, some never get past
//! TCP. Every round must complete with the honest updates alone, the server's
//! memory must not grow with the churn, and the final model must be the one
//! the honest updates give when aggregated by hand.
//!
//! The clients are light tokio tasks speaking the real gRPC protocol (the
//! `.proto`'s messages, chunked payloads, safetensors), not `cohort client`
//! processes: fifty training processes would not fit on two cores, and an
//! honest client whose update is a known function of the model it received
//! lets the test recompute every round.

mod common;
mod light;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cohort_core::codec::{self, DecodeLimits};
use cohort_core::strategy::{AlgorithmConfig, ClientUpdate, RoundContext};
use cohort_core::tree::{ArrayData, ParamTree};
use cohort_runtime::grpc::proto::client_message::Kind;
use cohort_runtime::grpc::proto::{self, ClientMessage};
use common::{fixture_data, free_port, only_run_dir, write_config};
use light::{join, next_task, send_update};

const TOTAL_CLIENTS: u32 = 50;
const PER_ROUND: u32 = 20;
const ROUNDS: u32 = 20;
const BATCH_SIZE: u64 = 4;
const HONEST: u32 = 30;
const VANISHING: u32 = 5;
const IDLE: u32 = 5;
const GARBAGE: u32 = 5;
/// Raw TCP peers: two that send random bytes, three that send nothing.
const RAW_TCP: u32 = 5;

/// Training samples of logical client `id` (1-based): 4 to 12, so the
/// weights of the average differ.
fn partition_size(id: u32) -> u64 {
    4 + u64::from(id % 9)
}

fn job(port: u16) -> String {
    let sizes: Vec<String> = (1..=TOTAL_CLIENTS)
        .map(|id| partition_size(id).to_string())
        .collect();
    format!(
        r#"
[clients]
total_clients = {TOTAL_CLIENTS}
per_round = {PER_ROUND}
min_per_round = 1
comm_simulation = false
[server]
port = {port}
registration_timeout = 60
payload_timeout = 2
random_seed = 11
[data]
datasource = "FashionMNIST"
download = false
partition_sizes = [{}]
[trainer]
rounds = {ROUNDS}
epochs = 1
batch_size = {BATCH_SIZE}
max_concurrency = {HONEST}
optimizer = "sgd"
model_seed = 3
[parameters.optimizer]
learning_rate = 0.05
"#,
        sizes.join(", ")
    )
}

/// What honest clients saw and sent, for recomputing the run afterwards.
#[derive(Default)]
struct Ledger {
    /// The global model each round was dispatched with, as received.
    globals: BTreeMap<u32, Vec<ParamTree>>,
    /// (round, client) → the update sent.
    updates: BTreeMap<(u32, u32), ParamTree>,
}

/// The honest update: the received model moved by a client-specific step,
/// so the weighted average of a round is not any single update.
fn honest_update(global: &ParamTree, client_id: u32) -> ParamTree {
    let step = 0.01 * ((client_id % 7) as f32 - 3.0);
    let mut flat = global.clone().flatten();
    for (_, array) in &mut flat.leaves {
        if let ArrayData::F32(values) = array.data_mut() {
            values.iter_mut().for_each(|v| *v += step);
        }
    }
    flat.unflatten().unwrap()
}

fn report(task: &proto::Task, payload_bytes: usize) -> proto::Report {
    let samples = partition_size(task.client_id);
    proto::Report {
        client_id: task.client_id,
        round: task.round,
        num_samples: samples,
        loss: 0.5,
        training_time: 0.01,
        processing_time: 0.0,
        payload_bytes: payload_bytes as u64,
        local_steps: samples.div_ceil(BATCH_SIZE),
        ..Default::default()
    }
}

/// Reconnects until the run is over, answering every task honestly.
async fn honest(address: String, index: u32, ledger: Arc<Mutex<Ledger>>, done: Arc<AtomicBool>) {
    while !done.load(Ordering::SeqCst) {
        let Some(mut session) = join(&address, &format!("honest-{index}")).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        while let Some((task, payload)) = next_task(&mut session.inbound).await {
            let global = codec::decode(&payload, &DecodeLimits::default()).unwrap();
            let update = honest_update(&global, task.client_id);
            let bytes = codec::encode(&update).unwrap();
            {
                let mut ledger = ledger.lock().unwrap();
                ledger.globals.entry(task.round).or_default().push(global);
                ledger.updates.insert((task.round, task.client_id), update);
            }
            send_update(&session.sender, report(&task, bytes.len()), &bytes).await;
        }
    }
}

/// Registers, takes a task, and drops the connection before answering.
async fn vanishing(address: String, index: u32, done: Arc<AtomicBool>) {
    while !done.load(Ordering::SeqCst) {
        if let Some(mut session) = join(&address, &format!("vanishing-{index}")).await {
            let _ = next_task(&mut session.inbound).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Registers and holds its stream (and whatever task it is given) without
/// ever answering, until the server gives up on it; then does it again.
async fn idle(address: String, index: u32, done: Arc<AtomicBool>) {
    while !done.load(Ordering::SeqCst) {
        if let Some(mut session) = join(&address, &format!("idle-{index}")).await {
            while let Ok(Some(_)) = session.inbound.message().await {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Answers tasks with bytes that are not an update, a report for another
/// round, or a chunk where a report belongs, in turn.
async fn garbage(address: String, index: u32, done: Arc<AtomicBool>) {
    let mut random = XorShift(0x9e37_79b9 + u64::from(index));
    let mut turn = index;
    while !done.load(Ordering::SeqCst) {
        let Some(mut session) = join(&address, &format!("garbage-{index}")).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        while let Some((task, _)) = next_task(&mut session.inbound).await {
            turn += 1;
            let noise = random.bytes(4096);
            match turn % 3 {
                0 => send_update(&session.sender, report(&task, noise.len()), &noise).await,
                1 => {
                    let mut wrong = report(&task, 0);
                    wrong.round += 1;
                    send_update(&session.sender, wrong, &[]).await
                }
                _ => {
                    let chunk = Kind::Chunk(proto::Chunk { data: noise.into() });
                    let _ = session
                        .sender
                        .send(ClientMessage { kind: Some(chunk) })
                        .await;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// TCP peers that never speak gRPC: random bytes, or nothing at all.
fn raw_tcp(address: String, index: u32, done: Arc<AtomicBool>) {
    let mut random = XorShift(0x51_7cc1_b727 + u64::from(index));
    while !done.load(Ordering::SeqCst) {
        let Ok(mut stream) = TcpStream::connect(&address) else {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
        if index < 2 {
            let _ = stream.write_all(&random.bytes(4096));
        }
        // Wait for the server to close the connection on us.
        let mut sink = [0u8; 1024];
        while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
    }
}

struct XorShift(u64);

impl XorShift {
    fn bytes(&mut self, count: usize) -> Vec<u8> {
        (0..count)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                self.0 as u8
            })
            .collect()
    }
}

/// The server's peak resident memory so far, in KiB (Linux).
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The rows of `clients.csv`: per round, the aggregated clients in file
/// (selection) order, and the dropped clients with their reasons.
type Rounds = BTreeMap<u32, (Vec<u32>, Vec<(u32, String)>)>;

fn read_clients_csv(path: &Path) -> Rounds {
    let text = std::fs::read_to_string(path).unwrap();
    let mut rounds = Rounds::new();
    // `dropped` is the last column and its reason may hold commas.
    let columns = text.lines().next().unwrap().split(',').count();
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.splitn(columns, ',').collect();
        let round: u32 = fields[0].parse().unwrap();
        let client: u32 = fields[1].parse().unwrap();
        let entry = rounds.entry(round).or_default();
        match fields.get(columns - 1) {
            Some(reason) if !reason.is_empty() => {
                entry.1.push((client, reason.trim_matches('"').to_owned()))
            }
            _ => entry.0.push(client),
        }
    }
    rounds
}

/// FedAvg of the honest updates of one round, in the order the server
/// aggregated them, through the strategy the server uses.
fn fedavg_by_hand(round: u32, global: &ParamTree, clients: &[u32], ledger: &Ledger) -> ParamTree {
    let updates: Vec<ClientUpdate<'_>> = clients
        .iter()
        .map(|&client_id| ClientUpdate {
            client_id,
            num_samples: partition_size(client_id),
            local_steps: partition_size(client_id).div_ceil(BATCH_SIZE),
            tree: ledger
                .updates
                .get(&(round, client_id))
                .unwrap_or_else(|| panic!("round {round}: client {client_id}'s update was aggregated, but no honest client sent it")),
        })
        .collect();
    let context = RoundContext {
        round,
        learning_rate: 0.05,
        per_round: PER_ROUND,
        total_clients: TOTAL_CLIENTS,
    };
    AlgorithmConfig::default()
        .build()
        .unwrap()
        .aggregate(&context, global, &updates)
        .unwrap()
        .model
        .unwrap()
}

#[test]
fn fifty_clients_with_hostile_ones_for_twenty_rounds_aggregate_only_the_honest_updates() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(dir.path(), &job(port));
    let base = dir.path().join("runs");
    let mut server = Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args([
            "run",
            "--config",
            config.to_str().unwrap(),
            "--cpu",
            "--quiet",
        ])
        .args(["--local-clients", "0", "--base", base.to_str().unwrap()])
        .env("COHORT_DATA_DIR", fixture_data())
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("server.log")).unwrap())
        .spawn()
        .unwrap();
    let pid = server.id();
    let address = format!("127.0.0.1:{port}");
    let done = Arc::new(AtomicBool::new(false));
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    for index in 0..HONEST {
        runtime.spawn(honest(
            address.clone(),
            index,
            Arc::clone(&ledger),
            Arc::clone(&done),
        ));
    }
    for index in 0..VANISHING {
        runtime.spawn(vanishing(address.clone(), index, Arc::clone(&done)));
    }
    for index in 0..IDLE {
        runtime.spawn(idle(address.clone(), index, Arc::clone(&done)));
    }
    for index in 0..GARBAGE {
        runtime.spawn(garbage(address.clone(), index, Arc::clone(&done)));
    }
    let raw: Vec<_> = (0..RAW_TCP)
        .map(|index| {
            let (address, done) = (address.clone(), Arc::clone(&done));
            std::thread::spawn(move || raw_tcp(address, index, done))
        })
        .collect();

    // Bounded in time: twenty rounds, each at worst one payload timeout long.
    let started = Instant::now();
    let mut samples = Vec::new();
    let status = loop {
        if let Some(status) = server.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(300) {
            let _ = server.kill();
            panic!("the run did not finish within 300 s");
        }
        if let Some(kib) = peak_rss_kib(pid) {
            samples.push((started.elapsed(), kib));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    done.store(true, Ordering::SeqCst);
    runtime.shutdown_timeout(Duration::from_secs(1));
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default();
    assert!(status.success(), "the run failed: {log}");
    for thread in raw {
        thread.join().unwrap();
    }

    let run_dir = only_run_dir(&base);
    let results = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 1 + ROUNDS as usize, "{results}");
    let rounds = read_clients_csv(&run_dir.join("clients.csv"));
    assert_eq!(rounds.len(), ROUNDS as usize);
    let ledger = ledger.lock().unwrap();
    let mut reasons = BTreeMap::<String, usize>::new();
    for (&round, (aggregated, dropped)) in &rounds {
        assert_eq!(
            aggregated.len() + dropped.len(),
            PER_ROUND as usize,
            "round {round}"
        );
        let honest: Vec<u32> = ledger
            .updates
            .keys()
            .filter(|(r, _)| *r == round)
            .map(|&(_, client)| client)
            .collect();
        let mut sorted = aggregated.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted, honest,
            "round {round}: aggregated clients are not the honest ones"
        );
        for (client, reason) in dropped {
            assert!(
                !honest.contains(client),
                "round {round}: honest client {client} dropped: {reason}"
            );
            *reasons
                .entry(reason.split(':').next().unwrap().to_owned())
                .or_default() += 1;
        }
    }
    // Each kind of hostility reached the round loop and was named.
    let all_reasons = format!("{reasons:?}");
    eprintln!("dropped clients by reason: {all_reasons}");
    for expected in [
        "malformed update",
        "malformed message",
        "the client process",
        "no report within",
    ] {
        assert!(
            reasons.keys().any(|r| r.contains(expected)),
            "no dropped client for `{expected}`: {all_reasons}"
        );
    }

    // Every round's model is FedAvg of its honest updates, recomputed here.
    let mut global = ledger.globals[&1][0].clone();
    for round in 1..=ROUNDS {
        for received in &ledger.globals[&round] {
            assert!(
                received == &global,
                "round {round}: a client received another model"
            );
        }
        global = fedavg_by_hand(round, &global, &rounds[&round].0, &ledger);
    }
    let final_model = codec::decode(
        &std::fs::read(run_dir.join("model.safetensors")).unwrap(),
        &DecodeLimits::default(),
    )
    .unwrap();
    assert!(
        final_model == global,
        "the final model is not FedAvg of the honest updates"
    );

    // Memory: the churn of twenty rounds does not make the server grow.
    let peak = samples.last().unwrap().1;
    let halfway = samples
        .iter()
        .take_while(|(at, _)| *at < started.elapsed() / 2)
        .last()
        .map_or(peak, |s| s.1);
    eprintln!("server peak RSS: {halfway} KiB halfway, {peak} KiB at the end");
    assert!(peak < 512 * 1024, "server peak RSS {peak} KiB");
    assert!(
        peak <= halfway + 64 * 1024,
        "server peak RSS grew from {halfway} KiB halfway to {peak} KiB"
    );
}
