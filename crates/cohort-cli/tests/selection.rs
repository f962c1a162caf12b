//! Client selection by utility through the real binary: Oort leaves a slow
//! client for last and power-of-choice follows the reported losses (rpow-d)
//! or the losses of the global model its candidates evaluate (pow-d); an
//! Oort run, synchronous or under FedBuff, is the same bit for bit with one
//! worker or two, after a stop and `--resume`, and after a SIGKILL and
//! `--resume`, and a pow-d run with one worker or two and after a stop and
//! `--resume`.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{cohort, fixture_data, write_config};

/// Seven clients; client 7 computes 100 times slower than the others.
const DEVICES: &str =
    "client,compute\n1,0.001\n2,0.001\n3,0.001\n4,0.001\n5,0.001\n6,0.001\n7,0.1\n";

const OORT: &str = r#"
[clients]
total_clients = 7
per_round = 2
selection = "oort"
[clients.profile]
file = "devices.csv"
[data]
datasource = "FashionMNIST"
download = false
partition_size = 80
[trainer]
rounds = 8
epochs = 1
batch_size = 20
max_concurrency = 2
optimizer = "sgd"
model_seed = 3
training_seed = 4
[parameters.optimizer]
learning_rate = 0.05
"#;

const FEDBUFF_OORT: &str = r#"
[clients]
total_clients = 6
per_round = 3
selection = "oort"
[clients.oort]
pacer_step = 2
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

const POWER_OF_CHOICE: &str = r#"
[clients]
total_clients = 6
per_round = 2
selection = "power_of_choice"
[clients.power_of_choice]
candidates = 6
loss = "last_reported"
[data]
datasource = "FashionMNIST"
download = false
partition_size = 100
[trainer]
rounds = 5
epochs = 1
batch_size = 20
max_concurrency = 2
optimizer = "sgd"
model_seed = 5
training_seed = 6
[parameters.optimizer]
learning_rate = 0.05
"#;

/// pow-d, the default loss of a synchronous simulation: 4 candidates of 6
/// clients for 2 places, on simulated devices. Each client holds two
/// label-sorted shards of the fixture's 600 samples: 100 samples of two or
/// three classes, so the global model's loss differs much between them.
const POW_D: &str = r#"
[clients]
total_clients = 6
per_round = 2
selection = "power_of_choice"
[clients.power_of_choice]
candidates = 4
[clients.profile]
compute = 0.001
downlink_mbps = 20
uplink_mbps = 5
latency = 0.05
[data]
datasource = "FashionMNIST"
download = false
sampler = "shards"
[trainer]
rounds = 4
epochs = 1
batch_size = 20
max_concurrency = 2
optimizer = "sgd"
model_seed = 5
training_seed = 6
[parameters.optimizer]
learning_rate = 0.05
"#;

/// A folder with `config` as job.toml and the device file beside it.
fn job(dir: &Path, config: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("devices.csv"), DEVICES).unwrap();
    write_config(dir, config)
}

fn succeeded(output: &std::process::Output) {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Runs `config` under `base` (`extra` arguments after it); its run folder.
fn run(config: &Path, base: &Path, extra: &[&str]) -> PathBuf {
    succeeded(&common::run_config(config, base, extra));
    common::only_run_dir(base)
}

fn resume(run_dir: &Path, rounds: &str) {
    let args = [
        "run",
        "--resume",
        run_dir.to_str().unwrap(),
        "--cpu",
        "--quiet",
        "--rounds",
        rounds,
    ];
    succeeded(&cohort(&args, &fixture_data()));
}

/// clients.csv without the measured times and the worker.
fn clients_without_times(run_dir: &Path) -> Vec<String> {
    let csv = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    csv.lines()
        .map(|line| {
            let f: Vec<&str> = line.split(',').collect();
            let mut kept = vec![f[0], f[1], f[3], f[4], f[8]];
            kept.extend_from_slice(&f[11..]);
            kept.join(",")
        })
        .collect()
}

/// The final model, and what each round chose and learnt.
fn outcome(run_dir: &Path) -> (Vec<u8>, Vec<String>) {
    (
        std::fs::read(run_dir.join("model.safetensors")).unwrap(),
        clients_without_times(run_dir),
    )
}

/// Each round's aggregated clients with their reported loss, in order.
fn chosen(run_dir: &Path) -> BTreeMap<u32, Vec<(u32, f64)>> {
    let csv = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    let mut rounds: BTreeMap<u32, Vec<(u32, f64)>> = BTreeMap::new();
    for line in csv.lines().skip(1).filter(|line| line.ends_with(',')) {
        let f: Vec<&str> = line.split(',').collect();
        rounds
            .entry(f[0].parse().unwrap())
            .or_default()
            .push((f[1].parse().unwrap(), f[4].parse().unwrap()));
    }
    rounds
}

/// Checks that a run of `config` is the same with one worker and with two,
/// when stopped after round `stop` and resumed, and when killed with
/// SIGKILL after its checkpoint of round `stop` and resumed; returns the
/// two-worker run (in the folder returned with it).
fn same_with_workers_and_resume(
    config: &str,
    stop: u32,
    rounds: u32,
) -> (tempfile::TempDir, PathBuf) {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path();
    let two = run(&job(&dir.join("two"), config), &dir.join("two-runs"), &[]);
    let one_config = config.replace("max_concurrency = 2", "max_concurrency = 1");
    let one = run(
        &job(&dir.join("one"), &one_config),
        &dir.join("one-runs"),
        &[],
    );
    assert_eq!(
        outcome(&one),
        outcome(&two),
        "the run depends on the workers"
    );

    let stop = stop.to_string();
    let stopped = run(
        &job(&dir.join("stopped"), config),
        &dir.join("stopped-runs"),
        &["--rounds", &stop],
    );
    let sidecar =
        std::fs::read_to_string(stopped.join(format!("checkpoints/round-{stop:0>4}.json")))
            .unwrap();
    assert!(sidecar.contains("\"policy\""), "{sidecar}");
    assert!(sidecar.contains("\"arms\""), "{sidecar}");
    resume(&stopped, &rounds.to_string());
    let log = std::fs::read_to_string(stopped.join("run.log")).unwrap();
    assert!(
        log.contains(&format!("resuming after round {stop}")),
        "{log}"
    );
    assert_eq!(
        outcome(&stopped),
        outcome(&two),
        "a stopped and resumed run differs from the uninterrupted one"
    );

    // SIGKILL once the checkpoint of round `stop` is written: wherever the
    // kill lands, `--resume` takes the newest complete checkpoint.
    let killed = common::run_killed_after_checkpoint(
        &job(&dir.join("killed"), config),
        &dir.join("killed-runs"),
        stop.parse().unwrap(),
    );
    assert!(
        !killed
            .join(format!("checkpoints/round-{rounds:0>4}.json"))
            .exists(),
        "killed before the last round"
    );
    common::resume_to_success(&killed, &[]);
    let log = std::fs::read_to_string(killed.join("run.log")).unwrap();
    assert!(log.contains("resuming after round"), "{log}");
    assert_eq!(
        outcome(&killed),
        outcome(&two),
        "a killed and resumed run differs from the uninterrupted one"
    );
    (temp, two)
}

#[test]
fn oort_explores_the_slow_client_last_and_is_the_same_with_workers_and_after_resume() {
    let (_dir, run_dir) = same_with_workers_and_resume(OORT, 3, 8);
    let rounds = chosen(&run_dir);
    assert_eq!(rounds.len(), 8);
    let first_round = |client: u32| {
        rounds
            .iter()
            .find(|(_, picked)| picked.iter().any(|(c, _)| *c == client))
            .map(|(round, _)| *round)
    };
    // Client 7's task is 100 times longer: its utility is scaled by
    // (T / t)² ≈ 10⁻⁴, so it is explored only when no other client is left
    // unexplored (rounds 1 to 3 explore the six others two by two). The
    // round after, Oort's code still fills that round's exploration places
    // at random (it ends exploration after drawing); from then on the places
    // go by score, and client 7's never makes the cut.
    let slow = first_round(7).expect("client 7 is explored once all others are");
    for client in 1..=6 {
        assert!(
            first_round(client).is_some_and(|round| round < slow),
            "client {client} not before client 7: {rounds:?}"
        );
    }
    assert!(
        slow + 2 <= 8,
        "explored too late to see it passed over: {rounds:?}"
    );
    for (round, picked) in rounds.range(slow + 2..) {
        assert!(
            picked.iter().all(|(client, _)| *client != 7),
            "round {round}: {rounds:?}"
        );
    }
}

#[test]
fn fedbuff_under_oort_is_the_same_with_workers_and_after_resume() {
    let (_dir, run_dir) = same_with_workers_and_resume(FEDBUFF_OORT, 4, 10);
    let rounds = chosen(&run_dir);
    assert_eq!(rounds.len(), 10);
    assert!(
        rounds.values().all(|picked| picked.len() == 2),
        "{rounds:?}"
    );
}

#[test]
fn power_of_choice_tries_every_client_then_takes_the_highest_losses() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = run(
        &job(dir.path(), POWER_OF_CHOICE),
        &dir.path().join("runs"),
        &[],
    );
    let rounds = chosen(&run_dir);
    // A client that never trained counts as the highest loss: rounds 1 to 3
    // take each of the six once.
    let mut first: Vec<u32> = (1..=3)
        .flat_map(|round| rounds[&round].iter().map(|(c, _)| *c))
        .collect();
    first.sort_unstable();
    assert_eq!(first, [1, 2, 3, 4, 5, 6], "{rounds:?}");
    // With every client a candidate (d = 6), rounds 4 and 5 take the two
    // highest of the losses last reported.
    let mut last: BTreeMap<u32, f64> = BTreeMap::new();
    for round in 1..=5 {
        if round >= 4 {
            let picked: Vec<u32> = rounds[&round].iter().map(|(c, _)| *c).collect();
            let lowest_picked = picked.iter().map(|c| last[c]).fold(f64::INFINITY, f64::min);
            for (client, loss) in &last {
                assert!(
                    picked.contains(client) || *loss <= lowest_picked,
                    "round {round}: {picked:?} with losses {last:?}"
                );
            }
        }
        for (client, loss) in &rounds[&round] {
            last.insert(*client, *loss);
        }
    }
}

#[test]
fn utility_selection_is_refused_where_it_cannot_decide() {
    let dir = tempfile::tempdir().unwrap();
    let bad = POWER_OF_CHOICE.replace("candidates = 6", "candidates = 7");
    let output = cohort(
        &["check", "--config", job(dir.path(), &bad).to_str().unwrap()],
        &fixture_data(),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("clients.power_of_choice.candidates")
            && stderr.contains("clients.total_clients = 6, got 7"),
        "{stderr}"
    );
}

/// `candidates.csv`'s rows by round: client, samples, loss, selected, and
/// the evaluation's simulated start and end, in the order drawn.
type Candidates = BTreeMap<u32, Vec<(u32, u64, f64, bool, f64, f64)>>;

fn candidates(run_dir: &Path) -> Candidates {
    let csv = std::fs::read_to_string(run_dir.join("candidates.csv")).unwrap();
    let mut rounds = Candidates::new();
    for line in csv.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        assert_eq!(f[10], "", "a candidate's evaluation failed: {line}");
        rounds.entry(f[0].parse().unwrap()).or_default().push((
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
            f[3].parse().unwrap(),
            f[4] == "1",
            f[5].parse().unwrap(),
            f[9].parse().unwrap(),
        ));
    }
    rounds
}

/// The clients the choice takes: the `per_round` highest losses, equal ones
/// in the order drawn.
fn highest(drawn: &[(u32, u64, f64, bool, f64, f64)], per_round: usize) -> Vec<u32> {
    let mut ranked = drawn.to_vec();
    ranked.sort_by(|a, b| b.2.total_cmp(&a.2));
    let mut top: Vec<u32> = ranked[..per_round].iter().map(|c| c.0).collect();
    top.sort_unstable();
    top
}

#[test]
fn pow_d_trains_the_candidates_whose_loss_of_the_global_model_is_highest() {
    // A learning rate far below a weight's last bit: training leaves the
    // model as it was, so a client's reported training loss (its mean over
    // every sample of its one epoch) is the loss of the round's global model
    // on all its data, what its candidate evaluation must have found.
    let frozen = POW_D
        .replace("learning_rate = 0.05", "learning_rate = 1e-30")
        .replace("rounds = 4", "rounds = 2");
    let dir = tempfile::tempdir().unwrap();
    let run_dir = run(&job(dir.path(), &frozen), &dir.path().join("runs"), &[]);
    let evaluated = candidates(&run_dir);
    let trained = chosen(&run_dir);
    assert_eq!(evaluated.len(), 2);
    for (round, drawn) in &evaluated {
        assert_eq!(drawn.len(), 4, "round {round}: {drawn:?}");
        let mut selected: Vec<u32> = drawn.iter().filter(|c| c.3).map(|c| c.0).collect();
        selected.sort_unstable();
        assert_eq!(selected, highest(drawn, 2), "round {round}: {drawn:?}");
        let mut aggregated: Vec<u32> = trained[round].iter().map(|(c, _)| *c).collect();
        aggregated.sort_unstable();
        assert_eq!(aggregated, selected, "round {round}");
        for (client, reported) in &trained[round] {
            let candidate = drawn.iter().find(|c| c.0 == *client).unwrap();
            assert_eq!(candidate.1, 100, "{candidate:?}");
            assert!(
                (candidate.2 - reported).abs() < 1e-4,
                "round {round}, client {client}: evaluated {} but trained from {reported}",
                candidate.2
            );
        }
    }
}

#[test]
fn pow_d_is_the_same_with_workers_and_after_resume_and_its_pass_is_on_the_clock() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path();
    let outcome_of = |run_dir: &Path| {
        let csv = std::fs::read_to_string(run_dir.join("candidates.csv")).unwrap();
        (outcome(run_dir), csv)
    };
    let two = run(&job(&dir.join("two"), POW_D), &dir.join("two-runs"), &[]);
    let one_config = POW_D.replace("max_concurrency = 2", "max_concurrency = 1");
    let one = run(
        &job(&dir.join("one"), &one_config),
        &dir.join("one-runs"),
        &[],
    );
    assert_eq!(
        outcome_of(&one),
        outcome_of(&two),
        "the run depends on the workers"
    );
    let stopped = run(
        &job(&dir.join("stopped"), POW_D),
        &dir.join("stopped-runs"),
        &["--rounds", "2"],
    );
    resume(&stopped, "4");
    assert_eq!(
        outcome_of(&stopped),
        outcome_of(&two),
        "a stopped and resumed run differs from the uninterrupted one"
    );

    // Each round's tasks start once the last candidate's loss has arrived,
    // and the round (results.csv's simulated_start) starts with the pass.
    let evaluated = candidates(&two);
    let results = std::fs::read_to_string(two.join("results.csv")).unwrap();
    let clients = std::fs::read_to_string(two.join("clients.csv")).unwrap();
    for (round, drawn) in &evaluated {
        let pass_start = drawn[0].4;
        let pass_end = drawn.iter().map(|c| c.5).fold(f64::MIN, f64::max);
        assert!(pass_end > pass_start, "round {round}: {drawn:?}");
        let row: Vec<&str> = results
            .lines()
            .nth(*round as usize)
            .unwrap()
            .split(',')
            .collect();
        let simulated_start: f64 = row[14].parse().unwrap();
        assert!((simulated_start - pass_start).abs() < 1e-3, "{row:?}");
        let starts: Vec<f64> = clients
            .lines()
            .skip(1)
            .map(|line| line.split(',').collect::<Vec<_>>())
            .filter(|f| f[0] == round.to_string())
            .map(|f| f[11].parse().unwrap())
            .collect();
        assert_eq!(starts.len(), 2, "round {round}");
        for start in starts {
            assert!(
                (start - pass_end).abs() < 2e-3,
                "round {round}: {start} vs {pass_end}"
            );
        }
    }
}

#[test]
fn pow_d_is_refused_where_candidates_cannot_evaluate() {
    let dir = tempfile::tempdir().unwrap();
    let asynchronous = POW_D.replace(
        "candidates = 4",
        "candidates = 4\nloss = \"evaluated\"\n[server]\nsynchronous = false",
    );
    let output = cohort(
        &[
            "check",
            "--config",
            job(dir.path(), &asynchronous).to_str().unwrap(),
        ],
        &fixture_data(),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("clients.power_of_choice.loss")
            && stderr.contains("an asynchronous run (server.synchronous = false)")
            && stderr.contains("use \"last_reported\""),
        "{stderr}"
    );
}
