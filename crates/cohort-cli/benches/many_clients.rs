//! One network-mode server (the real `cohort` binary) and many light
//! protocol clients in this process: what the server spends to admit and
//! aggregate every client's update in a round, and its peak memory.
//!
//! Each client answers a task with the model it was sent (a valid LeNet-5
//! update of the full size), so the clients cost almost nothing beside the
//! bytes they move, and the server's own CPU time per round is read from
//! `/proc/<pid>/stat` at each round's end (the moment its row reaches
//! results.csv).
//!
//!     cargo bench -p cohort-cli --bench many_clients -- [CLIENTS] [ROUNDS] [INFLIGHT_MIB]
//!
//! `COHORT_DATA_DIR` must hold Fashion-MNIST (the server's test set);
//! `COHORT_BIN` names the server binary (default: this build's).
//! `bench/many_clients.sh` runs it and profiles the server.

#[path = "../tests/light/mod.rs"]
mod light;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohort_runtime::grpc::proto;
use light::{join, next_task, send_update};

fn config(clients: u32, rounds: u32, port: u16, limits: Limits) -> String {
    // The largest payload (1 GiB by default) may not exceed what may be in
    // flight; 1 MiB holds LeNet-5's update of 248 KB, as a deployment would
    // set it, and leaves the limit's share for kept updates whole.
    let inflight = limits.inflight.map_or_else(String::new, |bytes| {
        let payload = bytes.min(1 << 20);
        format!("max_inflight_bytes = {bytes}\nmax_payload_bytes = {payload}")
    });
    let window = limits.window.map_or_else(String::new, |bytes| {
        format!("stream_window_bytes = {bytes}")
    });
    format!(
        r#"
[clients]
total_clients = {clients}
per_round = {clients}
comm_simulation = false
[server]
port = {port}
registration_timeout = 300
payload_timeout = 120
random_seed = 1
max_connections_per_address = {connections}
{inflight}
{window}
[data]
datasource = "FashionMNIST"
download = false
sampler = "iid_cyclic"
partition_size = 6
[trainer]
rounds = {rounds}
epochs = 1
batch_size = 32
optimizer = "sgd"
model_name = "lenet5"
model_seed = 1
[parameters.optimizer]
learning_rate = 0.01
"#,
        connections = clients + 16,
    )
}

/// The report of an update of `payload_bytes`: 6 samples, one step.
fn report(task: &proto::Task, payload_bytes: usize) -> proto::Report {
    proto::Report {
        client_id: task.client_id,
        round: task.round,
        num_samples: 6,
        loss: 0.5,
        training_time: 0.0,
        processing_time: 0.0,
        payload_bytes: payload_bytes as u64,
        local_steps: 1,
        ..Default::default()
    }
}

/// Joins once and answers every task with the model it came with.
async fn echo(address: String, index: u32) {
    let session = loop {
        if let Some(session) = join(&address, &format!("light-{index}")).await {
            break session;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut session = session;
    while let Some((task, payload)) = next_task(&mut session.inbound).await {
        let model = &payload[..task.payload_bytes as usize];
        send_update(&session.sender, report(&task, model.len()), model).await;
    }
}

/// The process's user + system CPU seconds so far (Linux).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let per_second = match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        ticks if ticks > 0 => ticks as f64,
        _ => 100.0,
    };
    Some(ticks / per_second)
}

fn peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// The server's memory limits the bench sets, where given.
#[derive(Clone, Copy)]
struct Limits {
    inflight: Option<u64>,
    window: Option<u32>,
}

fn start_server(dir: &Path, clients: u32, rounds: u32, port: u16, limits: Limits) -> Child {
    let path = dir.join("many.toml");
    std::fs::write(&path, config(clients, rounds, port, limits)).expect("config written");
    // COHORT_BIN: another build's server (an optimised one, with this
    // bench built quickly in the dev profile).
    let binary = std::env::var_os("COHORT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_cohort").into());
    Command::new(binary)
        .args(["run", "--config"])
        .arg(&path)
        .args(["--cpu", "--quiet", "--local-clients", "0", "--base"])
        .arg(dir.join("runs"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("server.log")).expect("log file"))
        .spawn()
        .expect("the cohort binary starts")
}

fn results_file(base: &Path) -> Option<PathBuf> {
    let run = std::fs::read_dir(base).ok()?.flatten().next()?.path();
    Some(run.join("results.csv"))
}

/// A numeric argument, or `None` where it is absent or `default`; anything
/// else stops the bench naming the argument.
fn number_or_default<T: std::str::FromStr>(arg: Option<&String>, name: &str) -> Option<T> {
    let arg = arg.filter(|a| a.as_str() != "default")?;
    match arg.parse() {
        Ok(value) => Some(value),
        Err(_) => {
            eprintln!("{name} must be a number or `default`, not `{arg}`");
            std::process::exit(2);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let clients: u32 = args.first().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let rounds: u32 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(4);
    // `server.max_inflight_bytes`, in MiB, and `server.stream_window_bytes`;
    // default: the server's.
    let limits = Limits {
        inflight: number_or_default(args.get(2), "INFLIGHT_MIB").map(|mib: u64| mib << 20),
        window: number_or_default(args.get(3), "WINDOW_BYTES"),
    };
    if std::env::var_os("COHORT_DATA_DIR").is_none() {
        eprintln!("set COHORT_DATA_DIR to a folder with fashion-mnist/");
        std::process::exit(2);
    }
    let dir = tempfile::tempdir().expect("a temporary folder");
    let port = free_port();
    let started = Instant::now();
    let mut server = start_server(dir.path(), clients, rounds, port, limits);
    let pid = server.id();
    println!("server pid {pid}");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let address = format!("127.0.0.1:{port}");
    for index in 0..clients {
        runtime.spawn(echo(address.clone(), index));
    }
    let base = dir.path().join("runs");
    let mut marks = vec![(
        0usize,
        started.elapsed().as_secs_f64(),
        cpu_seconds(pid).unwrap_or(0.0),
    )];
    let mut peak = 0.0f64;
    let status = loop {
        if let Some(status) = server.try_wait().expect("the server's status") {
            break status;
        }
        peak = peak.max(peak_rss_mib(pid).unwrap_or(0.0));
        let rows = results_file(&base)
            .and_then(|f| std::fs::read_to_string(f).ok())
            .map_or(0, |text| text.lines().count().saturating_sub(1));
        if rows > marks.last().expect("a first mark").0 {
            let cpu = cpu_seconds(pid).unwrap_or(f64::NAN);
            marks.push((rows, started.elapsed().as_secs_f64(), cpu));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    runtime.shutdown_timeout(Duration::from_secs(1));
    if !status.success() {
        let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default();
        eprintln!("the server failed:\n{log}");
        std::process::exit(1);
    }
    let limit = limits
        .inflight
        .map_or_else(|| "default".to_owned(), |b| format!("{} MiB", b >> 20));
    let window = limits
        .window
        .map_or_else(|| "default".to_owned(), |b| b.to_string());
    println!(
        "clients {clients}, rounds {rounds}, max_inflight_bytes {limit}, stream_window_bytes \
         {window}, server peak RSS {peak:.1} MiB"
    );
    println!("{:>6} {:>8} {:>12}", "round", "wall_s", "server_cpu_s");
    for pair in marks.windows(2) {
        let ((_, t0, c0), (rows, t1, c1)) = (pair[0], pair[1]);
        println!("{rows:>6} {:>8.3} {:>12.3}", t1 - t0, c1 - c0);
    }
}
