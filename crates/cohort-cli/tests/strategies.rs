//! Every strategy through the real binary: its shipped config loads, it trains
//! on the fixture, stateful strategies resume bit-identically, and `cohort
//! aggregate` / `cohort partitions` do what they say.

mod common;

use std::path::{Path, PathBuf};

use cohort_core::strategy::AlgorithmConfig;
use cohort_core::tree::{Array, ParamTree};
use common::{
    algorithm_section, cohort, fixture_data, only_run_dir, repo_root, run_config, run_job,
    write_config,
};

/// Six clients of 100 samples, five per round (Krum with f = 1 needs five).
fn job(algorithm: &str, rounds: u32) -> String {
    format!(
        r#"
[clients]
total_clients = 6
per_round = 5
[data]
datasource = "FashionMNIST"
download = false
partition_size = 100
[trainer]
rounds = {rounds}
epochs = 4
batch_size = 25
max_concurrency = 2
optimizer = "sgd"
model_seed = 1
training_seed = 2
[algorithm]
{algorithm}
[parameters.optimizer]
learning_rate = 0.1
"#
    )
}

fn results(run_dir: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(run_dir.join("results.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(str::to_owned).collect())
        .collect()
}

#[test]
fn every_registered_strategy_has_a_config_that_checks() {
    let folder = repo_root().join("configs/strategies");
    // The configs are for the full data set, which `cohort check` would hold
    // the fixture's 600 samples against: an empty folder leaves the files to
    // the download and checks the configs themselves.
    let no_data = tempfile::tempdir().unwrap();
    for name in AlgorithmConfig::names() {
        let path = folder.join(format!("{name}.toml"));
        assert!(path.is_file(), "no config for strategy {name}");
        let output = cohort(
            &["check", "--config", path.to_str().unwrap()],
            no_data.path(),
        );
        assert!(
            output.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let printed = String::from_utf8_lossy(&output.stdout);
        assert!(printed.contains(&format!("type = \"{name}\"")), "{printed}");
    }
}

#[test]
fn every_strategy_trains_on_the_fixture() {
    for name in AlgorithmConfig::names() {
        let (_dir, base, output) = run_job(&job(&algorithm_section(name), 2));
        assert!(
            output.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let rows = results(&only_run_dir(&base));
        assert_eq!(rows.len(), 2, "{name}");
        let accuracy: f64 = rows[1][1].parse().unwrap();
        // Chance is 0.1; every strategy has learned something after two rounds.
        eprintln!("{name}: accuracy {accuracy} after 2 rounds");
        assert!(accuracy > 0.2, "{name}: accuracy {accuracy} after 2 rounds");
        let epsilon = &rows[1][12];
        assert_eq!(
            !epsilon.is_empty(),
            *name == "dp_fedavg",
            "{name}: epsilon column `{epsilon}`"
        );
        let extra: u64 = rows[1][10].parse().unwrap();
        // SCAFFOLD sends c − cᵢ (one model) to each of the five clients.
        assert_eq!(
            extra > 0,
            *name == "scaffold",
            "{name}: extra bytes {extra}"
        );
    }
}

/// round, accuracy, bytes, loss, extra bytes, federated accuracy, epsilon.
fn results_without_times(run_dir: &Path) -> Vec<String> {
    results(run_dir)
        .into_iter()
        .map(|f| {
            [&f[0], &f[1], &f[6], &f[7], &f[8], &f[10], &f[11], &f[12]]
                .map(|s| s.as_str())
                .join(",")
        })
        .collect()
}

#[test]
fn stateful_strategies_resume_bit_identically() {
    for name in [
        "fedavgm",
        "fedadam",
        "fedyogi",
        "fedadagrad",
        "scaffold",
        "dp_fedavg",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let config = write_config(dir.path(), &job(&algorithm_section(name), 4));
        let whole = dir.path().join("whole");
        assert!(run_config(&config, &whole, &[]).status.success(), "{name}");
        let whole = only_run_dir(&whole);

        // Stop after round 2, then continue to round 4 from the checkpoint.
        let split = dir.path().join("split");
        assert!(
            run_config(&config, &split, &["--rounds", "2"])
                .status
                .success()
        );
        let split = only_run_dir(&split);
        let state = split.join("checkpoints/round-0002.state.safetensors");
        assert_eq!(
            state.is_file(),
            name != "dp_fedavg",
            "{name}: {}",
            state.display()
        );
        let resumed = cohort(
            &[
                "run",
                "--resume",
                split.to_str().unwrap(),
                "--cpu",
                "--quiet",
                "--rounds",
                "4",
            ],
            &fixture_data(),
        );
        assert!(
            resumed.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&resumed.stderr)
        );
        // It continued from the checkpoint rather than starting over.
        let log = std::fs::read_to_string(split.join("run.log")).unwrap();
        assert!(log.contains("resuming after round 2"), "{name}: {log}");
        assert_eq!(
            std::fs::read(split.join("model.safetensors")).unwrap(),
            std::fs::read(whole.join("model.safetensors")).unwrap(),
            "{name}: the resumed run ends with another model"
        );
        assert_eq!(
            results_without_times(&split),
            results_without_times(&whole),
            "{name}"
        );
    }
}

/// SCAFFOLD's client variates in a file (a budget of one byte) give the
/// model they give in memory; each checkpoint copies only the server's
/// variate, and a run that appended round 3's variates but lost round 3's
/// checkpoint (killed between the two) resumes from round 2's position in the
/// file to the same model.
#[test]
fn scaffold_variates_in_a_file_give_the_same_model_and_resume_from_their_position() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &job(&algorithm_section("scaffold"), 4));
    let in_file = ["--set", "server.client_state_memory_bytes=1"];
    let memory = dir.path().join("memory");
    assert!(run_config(&config, &memory, &[]).status.success());
    let memory = only_run_dir(&memory);
    let model = |run: &Path| std::fs::read(run.join("model.safetensors")).unwrap();

    let file = dir.path().join("file");
    assert!(run_config(&config, &file, &in_file).status.success());
    let file = only_run_dir(&file);
    assert!(
        model(&file) == model(&memory),
        "the file-backed run ends with another model"
    );
    assert_eq!(results_without_times(&file), results_without_times(&memory));
    let logs: Vec<String> = std::fs::read_dir(file.join("client_state/scaffold"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(logs.len(), 1, "older generations are forgotten: {logs:?}");
    let state = std::fs::read(file.join("checkpoints/round-0004.state.safetensors")).unwrap();
    let names: Vec<String> = safetensors::SafeTensors::deserialize(&state)
        .unwrap()
        .names()
        .into_iter()
        .map(str::to_owned)
        .collect();
    assert_eq!(names, ["server"]);

    let split = dir.path().join("split");
    let mut args = in_file.to_vec();
    args.extend(["--rounds", "3"]);
    assert!(run_config(&config, &split, &args).status.success());
    let split = only_run_dir(&split);
    for entry in std::fs::read_dir(split.join("checkpoints")).unwrap() {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("round-0003")
        {
            std::fs::remove_file(path).unwrap();
        }
    }
    let resumed = cohort(
        &[
            "run",
            "--resume",
            split.to_str().unwrap(),
            "--cpu",
            "--quiet",
            "--rounds",
            "4",
        ],
        &fixture_data(),
    );
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let log = std::fs::read_to_string(split.join("run.log")).unwrap();
    assert!(log.contains("resuming after round 2"), "{log}");
    assert!(
        model(&split) == model(&memory),
        "the resumed run ends with another model"
    );
}

#[test]
fn a_resumed_stateful_run_needs_its_state() {
    // A checkpoint whose strategy state is gone is not resumed from (it would
    // silently restart the moments at zero).
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &job(&algorithm_section("fedadam"), 3));
    let whole = dir.path().join("whole");
    assert!(run_config(&config, &whole, &[]).status.success());
    let split = dir.path().join("split");
    assert!(
        run_config(&config, &split, &["--rounds", "2"])
            .status
            .success()
    );
    let split = only_run_dir(&split);
    let checkpoints = split.join("checkpoints");
    std::fs::remove_file(checkpoints.join("round-0002.state.safetensors")).unwrap();
    std::fs::remove_file(checkpoints.join("round-0001.state.safetensors")).unwrap();
    let resumed = cohort(
        &[
            "run",
            "--resume",
            split.to_str().unwrap(),
            "--cpu",
            "--quiet",
            "--rounds",
            "3",
        ],
        &fixture_data(),
    );
    assert!(
        !resumed.status.success(),
        "a checkpoint without its state must not resume"
    );
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(stderr.contains("strategy state"), "{stderr}");
}

fn write_model(path: &Path, values: &[f32]) {
    let tree = ParamTree::from_dotted([(
        "w".to_owned(),
        Array::f32(vec![values.len()], values.to_vec()).unwrap(),
    )]);
    std::fs::write(path, cohort_core::codec::encode(&tree).unwrap()).unwrap();
}

fn read_values(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let tree = cohort_core::codec::decode(&bytes, &Default::default()).unwrap();
    tree.leaves()[0].1.as_f32().unwrap().to_vec()
}

fn aggregate(algorithm: &str, updates: &[(&[f32], u64)]) -> (std::process::Output, Vec<f32>) {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "[clients]\ntotal_clients = 5\nper_round = 5\n[algorithm]\n{algorithm}\n\
             [parameters.optimizer]\nlearning_rate = 0.1\n"
        ),
    );
    let global = dir.path().join("global.safetensors");
    write_model(&global, &[0.0, 0.0]);
    let mut args: Vec<String> = ["aggregate", "--config", config.to_str().unwrap()]
        .map(str::to_owned)
        .to_vec();
    args.extend(["--global".into(), global.display().to_string()]);
    let output_path = dir.path().join("out.safetensors");
    args.extend(["--output".into(), output_path.display().to_string()]);
    for (index, (values, samples)) in updates.iter().enumerate() {
        let path: PathBuf = dir.path().join(format!("u{index}.safetensors"));
        write_model(&path, values);
        args.push(format!("{}={samples}", path.display()));
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let output = cohort(&refs, &fixture_data());
    let values = if output.status.success() {
        read_values(&output_path)
    } else {
        Vec::new()
    };
    (output, values)
}

#[test]
fn cohort_aggregate_refuses_non_finite_updates_with_every_strategy_that_averages() {
    for algorithm in ["type = \"fedavg\"", "type = \"fedprox\"\nmu = 0.1"] {
        for bad in [f32::NAN, f32::INFINITY] {
            let updates: [(&[f32], u64); 2] = [(&[1.0, 2.0], 10), (&[3.0, bad], 10)];
            let (output, _) = aggregate(algorithm, &updates);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(!output.status.success(), "{algorithm}: {bad} accepted");
            assert!(
                stderr.contains(&format!("client 2: element 1 of `w` is {bad}")),
                "{algorithm}: {stderr}"
            );
        }
    }
}

#[test]
fn cohort_aggregate_applies_the_configured_strategy_once() {
    let updates: [(&[f32], u64); 5] = [
        (&[1.0, 10.0], 100),
        (&[2.0, 20.0], 100),
        (&[3.0, 30.0], 100),
        (&[4.0, 40.0], 100),
        (&[100.0, -100.0], 400),
    ];
    // FedAvg: (1 + 2 + 3 + 4 + 4·100) / 8 = 51.25; (10 + 20 + 30 + 40 − 400) / 8 = −37.5.
    let (_, fedavg) = aggregate("type = \"fedavg\"", &updates);
    assert_eq!(fedavg, [51.25, -37.5]);
    // Median of (1, 2, 3, 4, 100) = 3; of (10, 20, 30, 40, −100) = 20.
    let (_, median) = aggregate("type = \"median\"", &updates);
    assert_eq!(median, [3.0, 20.0]);
    // Krum (f = 1) picks an inner update, never the outlier.
    let (output, krum) = aggregate("type = \"krum\"\nbyzantine = 1", &updates);
    assert!(krum[0] <= 4.0, "{krum:?}");
    assert!(String::from_utf8_lossy(&output.stdout).contains("used"));
    // Three updates are too few for f = 1 (n ≥ 2f + 3): a clear error, not a panic.
    let (output, _) = aggregate("type = \"krum\"\nbyzantine = 1", &updates[..3]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("needs at least 5 updates"), "{stderr}");
}

#[test]
fn cohort_aggregate_says_when_the_model_is_unchanged() {
    let (output, model) = aggregate("type = \"fedavg\"", &[(&[1.0, 2.0], 10), (&[3.0, 4.0], 0)]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(model, [1.0, 2.0]);
    assert!(
        stdout.contains("fedavg: 2 update(s) aggregated (1 of them with 0 samples, so no weight)"),
        "{stdout}"
    );
    // Weights of 0 everywhere: nothing to average, and the report says so.
    let (output, model) = aggregate("type = \"fedavg\"", &[(&[1.0, 2.0], 0), (&[3.0, 4.0], 0)]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(model, [0.0, 0.0]);
    assert!(
        stdout.contains(
            "fedavg: the global model is unchanged by the 2 update(s) (2 of them with 0 samples"
        ),
        "{stdout}"
    );
}

#[test]
fn cohort_partitions_prints_and_draws_the_label_histograms() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "[clients]\ntotal_clients = 4\n[data]\ndatasource = \"FashionMNIST\"\ndownload = false\nsampler = \"shards\"\nshards_per_client = 2\n[parameters.optimizer]\nlearning_rate = 0.1\n",
    );
    let png = dir.path().join("parts.png");
    let output = cohort(
        &[
            "partitions",
            "--config",
            config.to_str().unwrap(),
            "--png",
            png.to_str().unwrap(),
        ],
        &fixture_data(),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = String::from_utf8_lossy(&output.stdout);
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.trim_start().starts_with(char::is_numeric))
        .collect();
    assert_eq!(rows.len(), 4, "{table}");
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
}

#[test]
fn clients_evaluate_the_global_model_and_attackers_are_simulated() {
    let body = job("type = \"median\"", 2).replace(
        "per_round = 5",
        "per_round = 5\ndo_test = true\nattack = \"sign_flip\"\nattackers_per_round = 1",
    );
    let (_dir, base, output) = run_job(&body);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let run_dir = only_run_dir(&base);
    let rows = results(&run_dir);
    // Round 2's clients evaluated the model of round 1 on their held-out data:
    // about what the server measured for that model on the test set.
    let federated: f64 = rows[1][11].parse().unwrap();
    let server_round_one: f64 = rows[0][1].parse().unwrap();
    assert!(
        (federated - server_round_one).abs() < 0.15,
        "federated {federated} vs server {server_round_one}"
    );
    let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    let first = clients.lines().nth(1).unwrap();
    let fields: Vec<&str> = first.split(',').collect();
    // 80 of 100 samples train, 20 are held out; the histogram counts the 80.
    assert_eq!(fields[3], "80", "{first}");
    let histogram: u64 = fields[9]
        .split(' ')
        .map(|n| n.parse::<u64>().unwrap())
        .sum();
    assert_eq!(histogram, 80, "{first}");
    assert!(!fields[10].is_empty(), "{first}");
    let log = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    assert_eq!(
        log.matches("simulated attacker").count(),
        2,
        "one per round"
    );
}

#[test]
fn unknown_strategies_and_options_get_suggestions() {
    let (_dir, _base, output) = run_job(&job("type = \"fedprx\"", 1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("`algorithm.type`"), "{stderr}");
    assert!(stderr.contains("did you mean `fedprox`"), "{stderr}");
    let (_dir, _base, output) = run_job(&job("type = \"fedprox\"\nmuu = 0.1", 1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("`algorithm.muu`"), "{stderr}");
    assert!(stderr.contains("did you mean `mu`"), "{stderr}");
}
