//! Every zoo model with every strategy, in each of cohort's modes, through the
//! real binary on the committed data fixtures (the real file formats, a few
//! samples each): one round under each registered strategy; a stateful run
//! that stops and resumes ends with the uninterrupted run's model bit for bit;
//! network mode (a server and client processes over gRPC) gives the
//! simulation's model bit for bit; three ranks of a ring give the
//! single-process model bit for bit.
//!
//! The models are those of the model zoo with the data sets they are made
//! for; the BatchNorm variants
//! are here because their running statistics are state that travels and is
//! aggregated with the weights.

mod common;

use std::path::Path;
use std::process::{Child, Command, Output};

use cohort_core::cluster::{Backend, MemoryNeed, RankCount, Request, place};
use cohort_core::strategy::AlgorithmConfig;
use common::{
    algorithm_section, cohort, fixture_data, free_port, only_run_dir, run_config, start_rank,
    write_config,
};

/// A zoo model on the data set it is made for.
struct Case {
    model: &'static str,
    datasource: &'static str,
    /// The `[parameters.model]` body.
    options: &'static str,
    /// Samples per client: the FEMNIST, CIFAR-100 and Shakespeare fixtures
    /// hold 6, 7 and 5 training samples, enough for one each of the five
    /// clients.
    partition_size: u32,
}

impl Case {
    fn label(&self) -> String {
        if self.options.is_empty() {
            self.model.to_owned()
        } else {
            format!("{} ({})", self.model, self.options.replace('\n', ", "))
        }
    }
}

const CASES: &[Case] = &[
    Case {
        model: "multilayer",
        datasource: "FashionMNIST",
        options: "",
        partition_size: 4,
    },
    Case {
        model: "cnn",
        datasource: "FashionMNIST",
        options: "",
        partition_size: 4,
    },
    Case {
        model: "cnn_femnist",
        datasource: "FEMNIST",
        options: "",
        partition_size: 1,
    },
    Case {
        model: "resnet_20",
        datasource: "CIFAR10",
        options: "norm = \"group\"",
        partition_size: 2,
    },
    Case {
        model: "resnet_20",
        datasource: "CIFAR10",
        options: "norm = \"batch\"",
        partition_size: 2,
    },
    Case {
        model: "resnet_18",
        datasource: "CIFAR10",
        options: "norm = \"batch\"",
        partition_size: 2,
    },
    Case {
        model: "vgg_11",
        datasource: "CIFAR100",
        options: "",
        partition_size: 1,
    },
    // LEAF's model: one row per sample, so Shakespeare's next-token task
    // learns the character after each sequence.
    Case {
        model: "lstm_shakespeare",
        datasource: "Shakespeare",
        options: "",
        partition_size: 1,
    },
];

/// Five clients, all five a round (Krum with f = 1 needs five), batch 2.
fn job(case: &Case, algorithm: &str, rounds: u32) -> String {
    format!(
        r#"
[clients]
total_clients = 5
per_round = 5
[server]
random_seed = 7
payload_timeout = 60
registration_timeout = 60
[data]
datasource = "{datasource}"
download = false
partition_size = {partition_size}
[trainer]
rounds = {rounds}
epochs = 1
batch_size = 2
max_concurrency = 2
optimizer = "sgd"
model_name = "{model}"
model_seed = 1
training_seed = 2
[parameters.optimizer]
learning_rate = 0.01
[parameters.model]
{options}
[algorithm]
{algorithm}
"#,
        datasource = case.datasource,
        partition_size = case.partition_size,
        model = case.model,
        options = case.options,
    )
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Every float32 value of a safetensors model file, checked with the
/// `safetensors` crate itself, is finite; returns how many values it holds.
fn finite_values(path: &Path) -> Result<usize, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let mut count = 0;
    for (name, view) in file.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            continue;
        }
        for chunk in view.data().chunks_exact(4) {
            let value = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            if !value.is_finite() {
                return Err(format!("{name} holds {value}"));
            }
            count += 1;
        }
    }
    Ok(count)
}

/// Asserts that `failures` is empty, listing every one of them.
fn assert_none_failed(what: &str, failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{what}: {} failure(s):\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn every_model_trains_a_round_under_every_strategy() {
    let mut failures = Vec::new();
    for case in CASES {
        for name in AlgorithmConfig::names() {
            let dir = tempfile::tempdir().unwrap();
            let config = write_config(dir.path(), &job(case, &algorithm_section(name), 1));
            let base = dir.path().join("runs");
            let output = run_config(&config, &base, &[]);
            let label = format!("{} under {name}", case.label());
            if !output.status.success() {
                failures.push(format!("{label}: {}", stderr(&output)));
                continue;
            }
            let run = only_run_dir(&base);
            let results = std::fs::read_to_string(run.join("results.csv")).unwrap();
            if results.lines().count() != 2 {
                failures.push(format!("{label}: results.csv\n{results}"));
            }
            if let Err(problem) = finite_values(&run.join("model.safetensors")) {
                failures.push(format!("{label}: {problem}"));
            }
        }
    }
    assert_none_failed("model × strategy", &failures);
}

/// The whole-run model and results, and those of a run stopped after round 1
/// and resumed to round 2, for `case` under `algorithm`.
fn whole_and_resumed(case: &Case, algorithm: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &job(case, &algorithm_section(algorithm), 2));
    let whole = dir.path().join("whole");
    let output = run_config(&config, &whole, &[]);
    if !output.status.success() {
        return Err(format!("uninterrupted run: {}", stderr(&output)));
    }
    let split = dir.path().join("split");
    let output = run_config(&config, &split, &["--rounds", "1"]);
    if !output.status.success() {
        return Err(format!("first round: {}", stderr(&output)));
    }
    let split = only_run_dir(&split);
    let args = [
        "run",
        "--resume",
        split.to_str().unwrap(),
        "--cpu",
        "--quiet",
    ];
    let resumed = cohort(&[&args[..], &["--rounds", "2"]].concat(), &fixture_data());
    if !resumed.status.success() {
        return Err(format!("resumed run: {}", stderr(&resumed)));
    }
    let log = std::fs::read_to_string(split.join("run.log")).unwrap();
    if !log.contains("resuming after round 1") {
        return Err(format!("the second run did not resume:\n{log}"));
    }
    let model = |run: &Path| std::fs::read(run.join("model.safetensors")).unwrap();
    if model(&split) != model(&only_run_dir(&whole)) {
        return Err("the resumed run ends with another model".into());
    }
    Ok(())
}

#[test]
fn every_model_resumes_bit_for_bit_with_stateful_strategies() {
    // SCAFFOLD's control variates and FedAdam's moments are model-shaped
    // state, so each model's whole state (its BatchNorm buffers included)
    // goes through the checkpoint.
    let mut failures = Vec::new();
    for case in CASES {
        for algorithm in ["scaffold", "fedadam"] {
            if let Err(problem) = whole_and_resumed(case, algorithm) {
                failures.push(format!("{} under {algorithm}: {problem}", case.label()));
            }
        }
    }
    assert_none_failed("resume", &failures);
}

/// `case`'s two-round job over the network (`comm_simulation = false`: the
/// server starts two client processes and talks gRPC to them) or simulated
/// in process, with FedProx so that the proximal term, which reads the global
/// model on the client, is part of what must agree.
fn network_job(case: &Case, port: u16, comm_simulation: bool) -> String {
    job(case, "type = \"fedprox\"\nmu = 0.1", 2)
        .replace("per_round = 5", "per_round = 5\ncomm_simulation = {sim}")
        .replace("{sim}", &comm_simulation.to_string())
        .replace("[server]", &format!("[server]\nport = {port}"))
}

fn model_of(case: &Case, comm_simulation: bool) -> Result<Vec<u8>, String> {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &network_job(case, free_port(), comm_simulation));
    let base = dir.path().join("runs");
    let mode = if comm_simulation {
        "simulation"
    } else {
        "network"
    };
    let output = Command::new(env!("CARGO_BIN_EXE_cohort"))
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
        .env_remove("COHORT_TOKEN")
        .output()
        .unwrap();
    if !output.status.success() {
        return Err(format!("{mode}: {}", stderr(&output)));
    }
    Ok(std::fs::read(only_run_dir(&base).join("model.safetensors")).unwrap())
}

#[test]
fn every_model_trains_over_the_network_as_in_simulation() {
    let mut failures = Vec::new();
    for case in CASES {
        let compared = model_of(case, false).and_then(|network| {
            let simulated = model_of(case, true)?;
            if network == simulated {
                Ok(())
            } else {
                Err("network and simulation end with different models".into())
            }
        });
        if let Err(problem) = compared {
            failures.push(format!("{}: {problem}", case.label()));
        }
    }
    assert_none_failed("network mode", &failures);
}

/// Host files of a 3-rank ring over this machine in `dir`; `span` keeps each
/// case's ports apart from the others'.
fn write_ring_plan(dir: &Path, instance: &str, span: u16) {
    let cluster = common::repo_root().join("configs/clusters/one_machine.toml");
    let topology = cohort_core::cluster::load(&cluster).unwrap();
    // resnet_18's 11 M parameters are the largest of the zoo.
    let need = MemoryNeed::estimate(11_200_000, 4, 5 * 3_073);
    let mut request = Request::new(instance, 5, need);
    request.backend = Backend::Ring;
    request.ranks = RankCount::Exactly(3);
    request.base_port = 30_000 + (std::process::id() % 10_000) as u16 + span * 1_024;
    let plan = place(&topology, &request).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    for file in plan.host_files(&cohort_core::cluster::RingSecret::generate().unwrap()) {
        std::fs::write(dir.join(file.name), file.contents).unwrap();
    }
}

fn ranks_against_one_process(case: &Case, span: u16) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &job(case, "type = \"fedavg\"", 2));
    let single = dir.path().join("single");
    let output = run_config(&config, &single, &[]);
    if !output.status.success() {
        return Err(format!("single process: {}", stderr(&output)));
    }
    let expected = std::fs::read(only_run_dir(&single).join("model.safetensors")).unwrap();
    let plan = dir.path().join("plan");
    write_ring_plan(&plan, &format!("zoo-{span}"), span);
    let base = dir.path().join("ranks");
    let ranks: Vec<Child> = (0..3)
        .map(|rank| start_rank(&config, &plan, &base, rank, &[]))
        .collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        if !output.status.success() {
            return Err(format!("rank {rank}: {}", stderr(&output)));
        }
    }
    let model = std::fs::read(only_run_dir(&base).join("model.safetensors")).unwrap();
    if model != expected {
        return Err("the 3-rank model differs from the single-process one".into());
    }
    Ok(())
}

#[test]
fn every_model_on_three_ranks_gives_the_single_process_model() {
    let mut failures = Vec::new();
    for (span, case) in (0u16..).zip(CASES) {
        if let Err(problem) = ranks_against_one_process(case, span) {
            failures.push(format!("{}: {problem}", case.label()));
        }
    }
    assert_none_failed("three ranks", &failures);
}
