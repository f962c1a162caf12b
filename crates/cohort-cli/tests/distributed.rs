//! Distributed simulation on one machine: three `cohort worker` ranks of a
//! plan meet in a TCP ring over loopback, each trains its block of clients,
//! and the final model equals, bit for bit, the model of the same config run
//! in one process, for FedAvg and for the median (which cannot be split into
//! partial sums); the test set scored in slices, one per rank, gives the
//! single process's accuracy and loss. A rank that dies mid-run ends the
//! others with an error that names it, and rank 0's checkpoints let the run
//! resume.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use cohort_core::cluster::{Backend, MemoryNeed, RankCount, Request, place};
use common::{
    cohort, fixture_data, only_run_dir, run_dir_after_rounds, single_process_model, start_rank,
    write_config,
};

fn job(algorithm: &str, rounds: u32) -> String {
    format!(
        r#"
[clients]
total_clients = 6
per_round = 4
[server]
random_seed = 7
payload_timeout = 20
registration_timeout = 30
[data]
datasource = "FashionMNIST"
download = false
partition_size = 40
[trainer]
rounds = {rounds}
epochs = 1
batch_size = 10
max_concurrency = 2
# 7 batches of the 200 test images, so each of three ranks scores its own.
eval_batch_size = 30
optimizer = "sgd"
model_seed = 3
training_seed = 5
[parameters.optimizer]
learning_rate = 0.05
[algorithm]
type = "{algorithm}"
"#
    )
}

/// Host files of a 3-rank ring plan on this machine, written into `dir`.
fn write_plan(dir: &Path, instance: &str) {
    write_plan_of(dir, instance, 3);
}

fn write_plan_of(dir: &Path, instance: &str, ranks: u32) {
    let cluster = common::repo_root().join("configs/clusters/one_machine.toml");
    write_ring_plan(&cluster, dir, instance, ranks, 1, 0);
}

/// Places a ring of `ranks` over at least `min_nodes` nodes of `cluster` and
/// writes its host files into `dir`; returns the plan. `span` moves the
/// ports to another 1,024-port span, clear of the other tests' instances.
fn write_ring_plan(
    cluster: &Path,
    dir: &Path,
    instance: &str,
    ranks: u32,
    min_nodes: u32,
    span: u16,
) -> cohort_core::cluster::Plan {
    let topology = cohort_core::cluster::load(cluster).unwrap();
    let mut request = Request::new(instance, 6, MemoryNeed::estimate(62_006, 4, 40 * 785));
    request.backend = Backend::Ring;
    request.ranks = RankCount::Exactly(ranks);
    request.min_nodes = min_nodes;
    // Away from other tests' ports; the plan picks within 1,024 of it.
    request.base_port = 40_000 + (std::process::id() % 20_000) as u16 + span * 1_024;
    let plan = place(&topology, &request).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    for file in plan.host_files(&cohort_core::cluster::RingSecret::generate().unwrap()) {
        std::fs::write(dir.join(file.name), file.contents).unwrap();
    }
    plan
}

/// The values of `column` in a results.csv, by its header.
fn results_column(results: &str, column: &str) -> Vec<String> {
    let mut lines = results.lines();
    let header = lines.next().unwrap();
    let at = header.split(',').position(|name| name == column).unwrap();
    lines
        .map(|line| line.split(',').nth(at).unwrap().to_owned())
        .collect()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn three_ranks_in_a_ring_give_the_single_process_model_bit_for_bit() {
    for algorithm in ["fedavg", "median"] {
        let dir = tempfile::tempdir().unwrap();
        let config = write_config(dir.path(), &job(algorithm, 3));
        let expected = single_process_model(&config, &dir.path().join("single"), &fixture_data());
        let plan = dir.path().join("plan");
        write_plan(&plan, &format!("t-{algorithm}"));
        let base = dir.path().join("ranks");
        let ranks: Vec<Child> = (0..3)
            .map(|rank| start_rank(&config, &plan, &base, rank, &[]))
            .collect();
        let outputs: Vec<Output> = ranks
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        for (rank, output) in outputs.iter().enumerate() {
            assert!(
                output.status.success(),
                "{algorithm}: rank {rank}: {}",
                stderr(output)
            );
        }
        // Only rank 0 writes a run folder.
        let run_dir = only_run_dir(&base);
        let model = std::fs::read(run_dir.join("model.safetensors")).unwrap();
        assert!(
            model == expected,
            "{algorithm}: the 3-rank model differs from the single-process one"
        );
        let results = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
        assert_eq!(results.lines().count(), 4, "{results}");
        // A uniform draw over 3 ranks: rank 0 says how strata would even it.
        let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
        assert!(log.contains("clients.strata = 3 (or a multiple)"), "{log}");
        // The ranks scored a slice of the test set each; their sum is the
        // single process's evaluation to the last digit.
        let single =
            std::fs::read_to_string(only_run_dir(&dir.path().join("single")).join("results.csv"))
                .unwrap();
        for column in ["accuracy", "test_loss"] {
            assert_eq!(
                results_column(&results, column),
                results_column(&single, column),
                "{algorithm}: {column}"
            );
        }
        // Every rank trained, with the workers its plan gave it (one_machine:
        // 8 cores over 3 ranks, 3, 3 and 2): workers of rank r are 1000r + i.
        let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
        let ids: Vec<u32> = clients
            .lines()
            .skip(1)
            .map(|l| l.split(',').nth(2).unwrap().parse::<u32>().unwrap())
            .collect();
        assert!(ids.iter().all(|id| id % 1000 < 3), "{clients}");
        let workers: std::collections::BTreeSet<u32> = ids.iter().map(|id| id / 1000).collect();
        assert_eq!(
            workers.len(),
            3,
            "ranks that trained: {workers:?}\n{clients}"
        );
    }
}

/// Runs `config` on the 3-rank ring plan `instance` (its host files in
/// `dir/plan`, its ranks' folders in `dir/ranks`), each rank to success,
/// and returns rank 0's run folder.
fn three_ranks(config: &Path, dir: &Path, instance: &str) -> PathBuf {
    let plan = dir.join("plan");
    write_plan(&plan, instance);
    let base = dir.join("ranks");
    let ranks: Vec<Child> = (0..3)
        .map(|rank| start_rank(config, &plan, &base, rank, &[]))
        .collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "rank {rank}: {}", stderr(&output));
    }
    only_run_dir(&base)
}

/// `clients.strata` a multiple of the ranks: each rank trains the same number
/// of clients every round (its blocks' shares), and the model is still the
/// single process's, which draws the same strata.
#[test]
fn stratified_rounds_give_each_rank_its_share_and_the_single_process_model() {
    let dir = tempfile::tempdir().unwrap();
    let text = job("fedavg", 3).replace("per_round = 4", "per_round = 3\nstrata = 3");
    let config = write_config(dir.path(), &text);
    let expected = single_process_model(&config, &dir.path().join("single"), &fixture_data());
    let run_dir = three_ranks(&config, dir.path(), "strata");
    let model = std::fs::read(run_dir.join("model.safetensors")).unwrap();
    assert!(
        model == expected,
        "the 3-rank model differs from the single-process one"
    );
    let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    assert!(!log.contains("clients.strata"), "{log}");
    // 6 clients over 3 ranks are blocks {1, 2}, {3, 4}, {5, 6}, the strata's
    // own: each round draws one of each, trained by that block's rank.
    let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    let rows: Vec<(u32, u32, u32)> = clients
        .lines()
        .skip(1)
        .map(|line| {
            let field = |i: usize| line.split(',').nth(i).unwrap().parse::<u32>().unwrap();
            (field(0), field(1), field(2) / 1000)
        })
        .collect();
    for round in 1..=3 {
        let mut blocks: Vec<(u32, u32)> = rows
            .iter()
            .filter(|row| row.0 == round)
            .map(|&(_, client, rank)| ((client - 1) / 2, rank))
            .collect();
        blocks.sort_unstable();
        assert_eq!(
            blocks,
            [(0, 0), (1, 1), (2, 2)],
            "round {round}:\n{clients}"
        );
    }
}

/// A host file without a ring secret (an older cohort's) is refused before
/// the rank listens, with what to do; the rank never runs unauthenticated.
#[test]
fn a_host_file_without_a_secret_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &job("fedavg", 1));
    let plan = dir.path().join("plan");
    write_plan_of(&plan, "old", 2);
    let path = plan.join("hosts-old-1.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("secret");
    std::fs::write(&path, json.to_string()).unwrap();
    let output = start_rank(&config, &plan, &dir.path().join("ranks"), 1, &[])
        .wait_with_output()
        .unwrap();
    let message = stderr(&output);
    assert!(!output.status.success(), "{message}");
    assert!(message.contains("has no ring secret"), "{message}");
    assert!(message.contains("cohort place --emit"), "{message}");
}

/// `cluster.reduce = partial`: each rank sends one partial sum. FedAvg
/// matches the single process to float rounding (float64 partials added in
/// rank order vs float32 accumulation in selection order), and every client
/// still has its row; the median, which needs every update, is refused.
#[test]
fn partial_sums_match_the_single_process_to_rounding_and_refuse_the_median() {
    let dir = tempfile::tempdir().unwrap();
    let config_text = format!("{}\n[cluster]\nreduce = \"partial\"\n", job("fedavg", 3));
    let config = write_config(dir.path(), &config_text);
    let single_base = dir.path().join("single");
    single_process_model(&config, &dir.path().join("single"), &fixture_data());
    let run_dir = three_ranks(&config, dir.path(), "t-partial");
    let model = run_dir.join("model.safetensors");
    let reference = only_run_dir(&single_base).join("model.safetensors");
    let compared = cohort(
        &[
            "compare",
            reference.to_str().unwrap(),
            model.to_str().unwrap(),
            "--tolerance",
            "1e-6",
        ],
        &fixture_data(),
    );
    eprintln!(
        "partial vs single process: {}",
        String::from_utf8_lossy(&compared.stdout)
    );
    assert!(
        compared.status.success(),
        "{}{}",
        String::from_utf8_lossy(&compared.stdout),
        stderr(&compared)
    );
    // 3 rounds of 4 clients: every client's row came across from its rank.
    let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    assert_eq!(clients.lines().count(), 1 + 12, "{clients}");

    let plan = dir.path().join("plan");
    let median = write_config(
        &plan,
        &format!("{}\n[cluster]\nreduce = \"partial\"\n", job("median", 1)),
    );
    let refused: Vec<Output> = (0..3)
        .map(|rank| start_rank(&median, &plan, &dir.path().join("median"), rank, &[]))
        .map(|child| child.wait_with_output().unwrap())
        .collect();
    for output in &refused {
        assert!(!output.status.success());
        assert!(
            stderr(output).contains("`median` needs every update"),
            "{}",
            stderr(output)
        );
    }
}

#[test]
fn a_rank_that_dies_is_named_and_the_run_resumes_on_a_smaller_plan() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &job("fedavg", 40));
    std::fs::create_dir_all(dir.path().join("short")).unwrap();
    let expected_config = write_config(&dir.path().join("short"), &job("fedavg", 40));
    let plan = dir.path().join("plan");
    write_plan(&plan, "t-dies");
    let base = dir.path().join("ranks");
    let mut ranks: Vec<Child> = (0..3)
        .map(|rank| start_rank(&config, &plan, &base, rank, &[]))
        .collect();
    // Let some rounds finish, then kill rank 2 mid-run.
    let run_dir = run_dir_after_rounds(&base, 2);
    ranks[2].kill().unwrap();
    let _ = ranks.pop().unwrap().wait();
    let outputs: Vec<Output> = ranks
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    // Rank 0 receives from rank 2; rank 1 sends to it, or hears rank 0 stop.
    for (rank, output) in outputs.iter().enumerate() {
        assert!(
            !output.status.success(),
            "rank {rank} went on without rank 2"
        );
    }
    let first = stderr(&outputs[0]);
    assert!(
        first.contains("its left neighbour rank 2 (local at 127.0.0.1:"),
        "{first}"
    );
    let second = stderr(&outputs[1]);
    assert!(
        second.contains("rank 2 (local at ") || second.contains("rank 0 (local at "),
        "{second}"
    );

    // It resumes on a smaller plan, two ranks, from rank 0's folder; the run
    // ends as an unbroken one would.
    let smaller = dir.path().join("smaller");
    write_plan_of(&smaller, "t-smaller", 2);
    let plan = smaller;
    let resume = ["--resume", run_dir.to_str().unwrap()];
    let ranks: Vec<Child> = (0..2)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_cohort"))
                .args([
                    "worker",
                    "--plan",
                    plan.to_str().unwrap(),
                    "--rank",
                    &rank.to_string(),
                ])
                .args(["--cpu", "--quiet"])
                .args(resume)
                .env("COHORT_DATA_DIR", fixture_data())
                .env_remove("RUST_LOG")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, child) in ranks.into_iter().enumerate() {
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "resumed rank {rank}: {}",
            stderr(&output)
        );
    }
    let results = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 41, "{results}");
    let expected = single_process_model(
        &expected_config,
        &dir.path().join("short/single"),
        &fixture_data(),
    );
    let model = std::fs::read(run_dir.join("model.safetensors")).unwrap();
    assert!(
        model == expected,
        "the resumed 3-rank model differs from the single-process one"
    );
}

/// The cluster file names every interface by DNS name (`localhost`, which
/// every system resolves), as a Kubernetes Indexed Job's does with its pods'
/// names: the plan carries the names, and each rank resolves its neighbours
/// when it connects. Three nodes, one rank each, the single-process model.
#[test]
fn ranks_named_by_dns_meet_in_a_ring() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &job("fedavg", 2));
    let expected = single_process_model(&config, &dir.path().join("single"), &fixture_data());
    let mut cluster = String::new();
    for node in ["a", "b", "c"] {
        cluster.push_str(&format!(
            "[[nodes]]\nid = \"{node}\"\nhost = \"localhost\"\nmemory = \"4 GiB\"\ncores = 1\n\
             interfaces = [{{ name = \"eth0\", address = \"localhost\", kind = \"ethernet\" }}]\n\n"
        ));
    }
    for (from, to) in [("a", "b"), ("b", "c"), ("a", "c")] {
        cluster.push_str(&format!(
            "[[links]]\nfrom = \"{from}.eth0\"\nto = \"{to}.eth0\"\n\n"
        ));
    }
    let cluster_path = dir.path().join("named.toml");
    std::fs::write(&cluster_path, cluster).unwrap();
    let plan_dir = dir.path().join("plan");
    let plan = write_ring_plan(&cluster_path, &plan_dir, "dns", 3, 3, 2);
    for rank in &plan.ranks[1..] {
        assert_eq!(rank.coordinator.host.to_string(), "localhost", "{rank:?}");
    }
    let base = dir.path().join("ranks");
    let outputs: Vec<Output> = (0..3)
        .map(|rank| start_rank(&config, &plan_dir, &base, rank, &[]))
        .collect::<Vec<Child>>()
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (rank, output) in outputs.iter().enumerate() {
        assert!(output.status.success(), "rank {rank}: {}", stderr(output));
    }
    let run_dir = only_run_dir(&base);
    assert!(std::fs::read(run_dir.join("model.safetensors")).unwrap() == expected);
}
