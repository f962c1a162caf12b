//! The `cohort` binary end to end on the committed fixture.

mod common;

use cohort_core::codec::{DecodeLimits, decode};
use common::{cohort, fixture_data, only_run_dir, run_job, write_config};

const SMALL_JOB: &str = r#"
[clients]
total_clients = 4
per_round = 2

[data]
datasource = "FashionMNIST"
download = false
partition_size = 150

[trainer]
rounds = 3
epochs = 1
batch_size = 16
max_concurrency = 2
optimizer = "sgd"
model_name = "lenet5"
model_seed = 3
training_seed = 5

[parameters.optimizer]
learning_rate = 0.05
momentum = 0.9
"#;

#[test]
fn small_job_writes_results_and_model() {
    let (_dir, base, output) = run_job(SMALL_JOB);
    assert!(
        output.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let run_dir = only_run_dir(&base);

    let csv = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next().unwrap(), cohort_core::results::RESULTS_HEADER);
    let rows: Vec<Vec<String>> = lines
        .map(|l| l.split(',').map(str::to_owned).collect())
        .collect();
    assert_eq!(rows.len(), 3);
    for (index, row) in rows.iter().enumerate() {
        assert_eq!(row[0], (index + 1).to_string());
        let accuracy: f64 = row[1].parse().unwrap();
        assert!((0.0..=1.0).contains(&accuracy), "{row:?}");
        let elapsed: f64 = row[2].parse().unwrap();
        assert!(elapsed > 0.0);
        // 2 clients × one encoded LeNet-5 each way.
        let to_clients: u64 = row[6].parse().unwrap();
        let to_server: u64 = row[7].parse().unwrap();
        assert!(
            to_clients > 2 * 61_706 * 4 && to_clients == to_server,
            "{row:?}"
        );
    }
    // Ten classes at random is 0.1; three rounds on 300 samples learn something.
    let last: f64 = rows[2][1].parse().unwrap();
    assert!(last > 0.3, "accuracy after 3 rounds: {last}");

    let clients = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    assert_eq!(clients.lines().count(), 1 + 3 * 2);

    let model = std::fs::read(run_dir.join("model.safetensors")).unwrap();
    let tree = decode(&model, &DecodeLimits::default()).unwrap();
    assert_eq!(tree.num_elements(), 61_706);
    assert!(
        tree.leaves()
            .iter()
            .all(|(_, a)| a.as_f32().unwrap().iter().all(|x| x.is_finite()))
    );
    assert!(run_dir.join("run.log").is_file());
    assert!(run_dir.join("config.toml").is_file());
}

#[test]
fn seeded_runs_are_reproducible() {
    let (_a, base_a, out_a) = run_job(SMALL_JOB);
    let (_b, base_b, out_b) = run_job(SMALL_JOB);
    assert!(out_a.status.success() && out_b.status.success());
    let model = |base: &std::path::Path| {
        std::fs::read(only_run_dir(base).join("model.safetensors")).unwrap()
    };
    assert_eq!(
        model(&base_a),
        model(&base_b),
        "same seeds, same worker count: same model"
    );
    assert_eq!(accuracies(&base_a), accuracies(&base_b));
}

#[test]
fn physical_worker_count_does_not_change_the_result() {
    let (_a, base_a, out_a) = run_job(SMALL_JOB);
    let (_b, base_b, out_b) =
        run_job(&SMALL_JOB.replace("max_concurrency = 2", "max_concurrency = 1"));
    assert!(out_a.status.success() && out_b.status.success());
    let model = |base: &std::path::Path| {
        std::fs::read(only_run_dir(base).join("model.safetensors")).unwrap()
    };
    assert_eq!(model(&base_a), model(&base_b));
}

#[test]
fn compare_tells_identical_from_different_models() {
    let (_a, base_a, out_a) = run_job(SMALL_JOB);
    let (_b, base_b, out_b) = run_job(&SMALL_JOB.replace("training_seed = 5", "training_seed = 6"));
    assert!(out_a.status.success() && out_b.status.success());
    let a = only_run_dir(&base_a).join("model.safetensors");
    let b = only_run_dir(&base_b).join("model.safetensors");
    let compare = |extra: &[&str]| {
        let mut args = vec!["compare", a.to_str().unwrap()];
        args.extend_from_slice(extra);
        cohort(&args, &fixture_data())
    };
    let same = compare(&[a.to_str().unwrap()]);
    assert!(same.status.success());
    assert!(String::from_utf8_lossy(&same.stdout).contains("differing 0,"));
    let strict = compare(&[b.to_str().unwrap()]);
    assert!(!strict.status.success());
    assert!(String::from_utf8_lossy(&strict.stderr).contains("above the tolerance"));
    let loose = compare(&[b.to_str().unwrap(), "--tolerance", "10"]);
    assert!(loose.status.success(), "{loose:?}");
}

fn accuracies(base: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(only_run_dir(base).join("results.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
        .collect()
}

#[test]
fn target_accuracy_stops_the_run_early() {
    let (_dir, base, output) = run_job(SMALL_JOB);
    assert!(output.status.success());
    let first = accuracies(&base)[0];
    // A target at round 1's accuracy stops after round 1.
    let (_dir, base, output) = run_job(&SMALL_JOB.replace(
        "rounds = 3",
        &format!("rounds = 3\ntarget_accuracy = {first}"),
    ));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(accuracies(&base), [first]);
}

#[test]
fn plot_draws_a_png_for_one_or_several_runs() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &SMALL_JOB.replace("rounds = 3", "rounds = 2"));
    let base = dir.path().join("runs");
    let run = |extra: &[&str]| {
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
        let output = cohort(&args, &fixture_data());
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    run(&["--plot"]);
    run(&[]);
    let mut runs: Vec<_> = std::fs::read_dir(&base)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    runs.sort();
    let with_plot = runs
        .iter()
        .find(|r| r.join("accuracy.png").is_file())
        .expect("--plot wrote accuracy.png");
    assert_png(&with_plot.join("accuracy.png"));

    let compared = dir.path().join("compare.png");
    let output = cohort(
        &[
            "plot",
            runs[0].to_str().unwrap(),
            runs[1].to_str().unwrap(),
            "--output",
            compared.to_str().unwrap(),
        ],
        &fixture_data(),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_png(&compared);

    let output = cohort(&["plot", dir.path().to_str().unwrap()], &fixture_data());
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("results.csv"));
}

/// A PNG of the chart's size.
fn assert_png(path: &std::path::Path) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{path:?} is not a PNG");
    let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert_eq!((width, height), (1800, 500));
}

#[test]
fn bad_config_fails_with_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &SMALL_JOB.replace("per_round = 2", "per_rnd = 2"),
    );
    let output = cohort(
        &["run", "--config", config.to_str().unwrap(), "--quiet"],
        &fixture_data(),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("job.toml"), "{stderr}");
    assert!(stderr.contains("`clients.per_rnd`"), "{stderr}");
    assert!(stderr.contains("did you mean `per_round`?"), "{stderr}");
}

#[test]
fn an_unknown_gpu_product_routine_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), SMALL_JOB);
    for (value, named) in [("fastest", "`fastest`"), ("conv=gemm", "`conv`")] {
        let output = common::cohort_command(&["check", "--config", config.to_str().unwrap()])
            .env("COHORT_GPU_PRODUCTS", value)
            .output()
            .unwrap();
        assert!(!output.status.success(), "{value} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("COHORT_GPU_PRODUCTS"), "{stderr}");
        assert!(stderr.contains(named), "{stderr}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let output = common::cohort_command(&["check", "--config", config.to_str().unwrap()])
            .env(
                "COHORT_GPU_PRODUCTS",
                std::ffi::OsStr::from_bytes(b"simple_unit_\xffsmall"),
            )
            .output()
            .unwrap();
        assert!(
            !output.status.success(),
            "a value not in UTF-8 was accepted"
        );
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("COHORT_GPU_PRODUCTS") && stderr.contains("UTF-8"),
            "{stderr}"
        );
    }
    let output = common::cohort_command(&["check", "--config", config.to_str().unwrap()])
        .env(
            "COHORT_GPU_PRODUCTS",
            "conv_forward=simple_unit_small,linear_forward=burn",
        )
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
}

#[test]
fn the_thin_gpu_products_switch_takes_0_or_1_only() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), SMALL_JOB);
    let check = |value: &str| {
        common::cohort_command(&["check", "--config", config.to_str().unwrap()])
            .env("COHORT_GPU_THIN_PRODUCTS", value)
            .output()
            .unwrap()
    };
    for value in ["yes", "2", "true"] {
        let output = check(value);
        assert!(!output.status.success(), "{value} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("COHORT_GPU_THIN_PRODUCTS") && stderr.contains(&format!("`{value}`")),
            "{stderr}"
        );
    }
    for value in ["0", "1", ""] {
        let output = check(value);
        assert!(output.status.success(), "{value}: {output:?}");
    }
}

#[test]
fn missing_data_without_download_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), SMALL_JOB);
    let empty = dir.path().join("no-data");
    let output = cohort(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--quiet",
            "--base",
            dir.path().join("runs").to_str().unwrap(),
        ],
        &empty,
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("train-images-idx3-ubyte.gz"), "{stderr}");
    assert!(stderr.contains("COHORT_DATA_DIR"), "{stderr}");
    assert!(stderr.contains("Put these files in"), "{stderr}");
    // The run never started: no folder is left for it.
    let left = std::fs::read_dir(dir.path().join("runs")).map_or(0, |entries| entries.count());
    assert_eq!(left, 0, "{stderr}");
}

#[test]
fn zero_rounds_are_refused_and_help_says_config_is_required() {
    let output = cohort(
        &["run", "--config", "x.toml", "--rounds", "0"],
        &fixture_data(),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--rounds"), "{stderr}");
    assert!(stderr.contains("0 is not in 1.."), "{stderr}");
    let help = cohort(&["run", "--help"], &fixture_data());
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("Required, unless --resume is given"),
        "{text}"
    );
}

/// The banner before round 1 and, in a log (stderr is not a terminal here),
/// one progress line per round with the round count and the time left.
#[test]
fn the_run_says_what_it_runs_before_round_1_and_where_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), SMALL_JOB);
    let output = cohort(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--cpu",
            "--base",
            dir.path().join("runs").to_str().unwrap(),
            "--set",
            "trainer.rounds=2",
        ],
        &fixture_data(),
    );
    assert!(output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    let run_dir = only_run_dir(&dir.path().join("runs"));
    let expected_banner = [
        format!("cohort: {} → {}", config.display(), run_dir.display()),
        "  strategy  fedavg, 2 rounds, 2 of 4 clients per round".to_owned(),
        format!(
            "  data      FashionMNIST: 600 training and 200 test samples from {}; \
             iid partitions of 150 samples",
            fixture_data().join("fashion-mnist").display()
        ),
        "  device    cpu (burn flex), 2 workers × 1 thread each".to_owned(),
        "  backend   one process (clients simulated in the worker pool)".to_owned(),
    ];
    assert_eq!(lines[..5], expected_banner, "{stderr}");
    for (line, round) in lines[5..7].iter().zip(1..) {
        assert!(
            line.starts_with(&format!("round   {round}: accuracy 0.")),
            "{stderr}"
        );
        assert!(
            line.contains(&format!("[{round}/2 rounds, ETA ")),
            "{stderr}"
        );
    }
    assert_eq!(lines.len(), 7, "{stderr}");
}

#[test]
fn gpu_request_on_a_cpu_build_is_a_clear_error() {
    if cfg!(any(
        feature = "wgpu",
        feature = "vulkan",
        feature = "vulkan-untuned",
        feature = "wgpu-untuned",
        feature = "metal",
        feature = "cuda"
    )) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), SMALL_JOB);
    let output = cohort(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--gpu",
            "--quiet",
            "--base",
            dir.path().join("runs").to_str().unwrap(),
        ],
        &fixture_data(),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("built without a GPU backend"), "{stderr}");
}

/// The aggregation does not care which mode trained the clients: with
/// `trainer.vectorized_clients` the global model after 3 rounds equals the
/// one-by-one run's within 1e-5 (per client, vectorized and alone agree to
/// a few 1e-8 a round on the CPU: reduction order; see
/// `cohort_train::vectorized`). Partitions of 150 at batch 16 end each epoch
/// on a partial batch.
#[test]
fn vectorized_clients_give_the_same_global_model_as_one_by_one() {
    const TOLERANCE: f32 = 1e-5;
    let model = |base: &std::path::Path| {
        let bytes = std::fs::read(only_run_dir(base).join("model.safetensors")).unwrap();
        decode(&bytes, &DecodeLimits::default()).unwrap()
    };
    let (_a, base_a, out_a) = run_job(SMALL_JOB);
    assert!(
        out_a.status.success(),
        "{}",
        String::from_utf8_lossy(&out_a.stderr)
    );
    let one_by_one = model(&base_a);
    for setting in ["vectorized_clients = 2", "vectorized_clients = \"auto\""] {
        let text = SMALL_JOB.replace(
            "max_concurrency = 2",
            &format!("max_concurrency = 1\n{setting}"),
        );
        let (_b, base_b, out_b) = run_job(&text);
        assert!(
            out_b.status.success(),
            "{}",
            String::from_utf8_lossy(&out_b.stderr)
        );
        let log = std::fs::read_to_string(only_run_dir(&base_b).join("run.log")).unwrap();
        assert!(log.contains("vectorized clients"), "{log}");
        let vectorized = model(&base_b);
        let mut worst = 0.0f32;
        for ((path, a), (_, b)) in one_by_one.leaves().iter().zip(vectorized.leaves()) {
            assert_eq!(a.shape(), b.shape(), "{path}");
            for (x, y) in a.as_f32().unwrap().iter().zip(b.as_f32().unwrap()) {
                worst = worst.max((x - y).abs());
            }
        }
        eprintln!("{setting}: max |vectorized − one by one| = {worst:e}");
        assert!(worst <= TOLERANCE, "{setting}: {worst}");
        assert_ne!(
            one_by_one.leaves()[0].1.as_f32().unwrap()[0],
            0.0,
            "the model trained"
        );
    }
}

/// `cohort partitions --json` writes the assignment a run trains on: every
/// client's sample count in it is the one `clients.csv` reports for that
/// client, the lists never overlap, and every index is in the training set.
#[test]
fn partitions_json_is_the_assignment_the_run_trains_on() {
    let dir = tempfile::tempdir().unwrap();
    let skewed = SMALL_JOB.replace(
        "partition_size = 150",
        "sampler = \"dirichlet\"\nconcentration = 0.5\nrandom_seed = 4",
    );
    let config = write_config(dir.path(), &skewed);
    let json = dir.path().join("partitions.json");
    let listed = cohort(
        &[
            "partitions",
            "--config",
            config.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ],
        &fixture_data(),
    );
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let assignment: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(assignment["datasource"], "FashionMNIST");
    let train_samples = assignment["train_samples"].as_u64().unwrap();
    let clients = assignment["clients"].as_array().unwrap();
    assert_eq!(clients.len(), 4);
    let lists: Vec<Vec<u64>> = clients
        .iter()
        .map(|c| {
            c["train"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap())
                .collect()
        })
        .collect();
    let mut every: Vec<u64> = lists.iter().flatten().copied().collect();
    let total = every.len();
    every.sort_unstable();
    every.dedup();
    assert_eq!(every.len(), total, "the partitions overlap");
    assert!(every.iter().all(|&i| i < train_samples));
    let sizes: Vec<usize> = lists.iter().map(Vec::len).collect();
    assert!(
        sizes.iter().any(|&s| s != sizes[0]),
        "dirichlet gives unequal sizes: {sizes:?}"
    );

    let output = cohort(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--cpu",
            "--base",
            dir.path().join("runs").to_str().unwrap(),
        ],
        &fixture_data(),
    );
    assert!(output.status.success());
    let run_dir = only_run_dir(&dir.path().join("runs"));
    let csv = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    let mut checked = 0;
    for line in csv.lines().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let (client, samples): (usize, usize) =
            (fields[1].parse().unwrap(), fields[3].parse().unwrap());
        assert_eq!(samples, sizes[client - 1], "client {client}: {line}");
        checked += 1;
    }
    assert_eq!(checked, 3 * 2);
}

/// `--sample-orders` adds each client's order of its samples in every
/// local epoch of every round: a reshuffle of its partition each epoch, the
/// same on every call; without `trainer.training_seed` there is no order to
/// write ahead, and the command says so.
#[test]
fn partitions_json_can_carry_every_epochs_sample_order() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &SMALL_JOB.replace("epochs = 1", "epochs = 2"));
    let orders_of = |name: &str| {
        let json = dir.path().join(name);
        let listed = cohort(
            &[
                "partitions",
                "--config",
                config.to_str().unwrap(),
                "--json",
                json.to_str().unwrap(),
                "--sample-orders",
            ],
            &fixture_data(),
        );
        assert!(
            listed.status.success(),
            "{}",
            String::from_utf8_lossy(&listed.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&std::fs::read(&json).unwrap()).unwrap()
    };
    let assignment = orders_of("a.json");
    assert_eq!(
        assignment["sample_orders"],
        serde_json::json!({"training_seed": 5, "rounds": 3, "epochs": 2, "batch_size": 16})
    );
    let numbers = |value: &serde_json::Value| -> Vec<u64> {
        let list = value.as_array().unwrap().iter();
        list.map(|i| i.as_u64().unwrap()).collect()
    };
    for client in assignment["clients"].as_array().unwrap() {
        let mut train = numbers(&client["train"]);
        train.sort_unstable();
        let rounds = client["orders"].as_array().unwrap();
        assert_eq!(rounds.len(), 3);
        for epochs in rounds {
            let epochs = epochs.as_array().unwrap();
            assert_eq!(epochs.len(), 2);
            assert_ne!(epochs[0], epochs[1], "each epoch reshuffles");
            for order in epochs {
                let mut sorted = numbers(order);
                sorted.sort_unstable();
                assert_eq!(sorted, train);
            }
        }
        assert_ne!(rounds[0], rounds[1], "each round draws its own");
    }
    assert_eq!(orders_of("b.json"), assignment);

    let unseeded = write_config(dir.path(), &SMALL_JOB.replace("training_seed = 5\n", ""));
    let refused = cohort(
        &[
            "partitions",
            "--config",
            unseeded.to_str().unwrap(),
            "--json",
            dir.path().join("c.json").to_str().unwrap(),
            "--sample-orders",
        ],
        &fixture_data(),
    );
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("trainer.training_seed"), "{stderr}");
    assert!(!dir.path().join("c.json").exists());
}

/// `--set` works on the commands that read a config as it does on `run`.
#[test]
fn partitions_take_set_overrides_as_run_does() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), SMALL_JOB);
    let json = dir.path().join("parts.json");
    let output = cohort(
        &[
            "partitions",
            "--config",
            config.to_str().unwrap(),
            "--set",
            "data.partition_size=100",
            "--json",
            json.to_str().unwrap(),
        ],
        &fixture_data(),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let assignment: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let sizes: Vec<usize> = assignment["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["train"].as_array().unwrap().len())
        .collect();
    assert_eq!(sizes, [100; 4]);
    let refused = cohort(
        &[
            "partitions",
            "--config",
            config.to_str().unwrap(),
            "--set",
            "data.partition_sise=100",
        ],
        &fixture_data(),
    );
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("partition_size"), "{stderr}");
}

/// `--resume` of a finished run says so and runs nothing: no data is
/// loaded, no banner, no line added to run.log.
#[test]
fn resuming_a_finished_run_says_it_is_complete() {
    let (_dir, base, output) = run_job(&SMALL_JOB.replace("rounds = 3", "rounds = 2"));
    assert!(output.status.success());
    let run_dir = only_run_dir(&base);
    let log_before = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    // No data folder: a resume that loaded the data would fail.
    let no_data = tempfile::tempdir().unwrap();
    let resumed = cohort(
        &["run", "--resume", run_dir.to_str().unwrap(), "--cpu"],
        no_data.path(),
    );
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    assert!(
        stdout.contains("all 2 rounds are done (accuracy 0."),
        "{stdout}"
    );
    assert!(
        stdout.contains("`--rounds N` with N above 2 continues it"),
        "{stdout}"
    );
    assert!(
        resumed.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let log_after = std::fs::read_to_string(run_dir.join("run.log")).unwrap();
    assert_eq!(log_before, log_after);
}

/// The run folder's config.toml is the config as it ran: every default
/// filled in and the data folder it read, so `--resume RUN_DIR` alone
/// continues it, with no COHORT_DATA_DIR.
#[test]
fn the_run_records_its_resolved_config_and_resumes_from_it_alone() {
    let (_dir, base, output) = run_job(&SMALL_JOB.replace("rounds = 3", "rounds = 1"));
    assert!(output.status.success());
    let run_dir = only_run_dir(&base);
    let recorded = std::fs::read_to_string(run_dir.join("config.toml")).unwrap();
    let data = fixture_data().canonicalize().unwrap();
    assert!(
        recorded.contains(&format!("data_path = {:?}", data.display().to_string())),
        "{recorded}"
    );
    // Defaults SMALL_JOB leaves out are written too.
    assert!(recorded.contains("payload_timeout = 600.0"), "{recorded}");
    let resumed = std::process::Command::new(env!("CARGO_BIN_EXE_cohort"))
        .args([
            "run",
            "--resume",
            run_dir.to_str().unwrap(),
            "--rounds",
            "2",
        ])
        .args(["--cpu", "--quiet"])
        .env_remove("COHORT_DATA_DIR")
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let csv = std::fs::read_to_string(run_dir.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
}

#[test]
fn unset_takes_a_key_out_so_its_default_applies() {
    let dir = tempfile::tempdir().unwrap();
    // partition_size pins the iid split; without it a Dirichlet split is valid.
    let config = write_config(dir.path(), SMALL_JOB);
    let output = cohort(
        &[
            "partitions",
            "--config",
            config.to_str().unwrap(),
            "--unset",
            "data.partition_size",
            "--set",
            "data.sampler=dirichlet",
            "--set",
            "data.concentration=0.1",
        ],
        &fixture_data(),
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let refused = cohort(
        &[
            "check",
            "--config",
            config.to_str().unwrap(),
            "--unset",
            "data.partition_sise",
        ],
        &fixture_data(),
    );
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("`data.partition_sise` cannot be unset: the config does not set it")
            && stderr.contains("did you mean `partition_size`"),
        "{stderr}"
    );
    // --rounds on check, as on run: the printed config carries it.
    let checked = cohort(
        &[
            "check",
            "--config",
            config.to_str().unwrap(),
            "--rounds",
            "7",
        ],
        &fixture_data(),
    );
    let stdout = String::from_utf8_lossy(&checked.stdout);
    assert!(checked.status.success(), "{stdout}");
    assert!(stdout.contains("rounds = 7"), "{stdout}");
}

#[test]
fn runs_of_one_config_with_different_strategies_are_told_apart() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &SMALL_JOB.replace("rounds = 3", "rounds = 1"));
    let base = dir.path().join("runs");
    let run = |extra: &[&str]| {
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
        let output = cohort(&args, &fixture_data());
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    run(&[]);
    run(&[
        "--set",
        "algorithm.type=fedprox",
        "--set",
        "algorithm.mu=0.01",
    ]);
    let mut names: Vec<String> = std::fs::read_dir(&base)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names.len(), 2, "{names:?}");
    let fedprox = names
        .iter()
        .find(|n| n.starts_with("job-fedprox-"))
        .unwrap_or_else(|| panic!("no job-fedprox-* folder: {names:?}"));
    // The name is recorded, and is what `cohort plot` labels the line with.
    let recorded = std::fs::read_to_string(base.join(fedprox).join("config.toml")).unwrap();
    assert!(
        recorded.contains("run_name = \"job-fedprox\""),
        "{recorded}"
    );
    let plain = names.iter().find(|n| *n != fedprox).unwrap();
    let recorded = std::fs::read_to_string(base.join(plain).join("config.toml")).unwrap();
    assert!(recorded.contains("run_name = \"job\""), "{recorded}");
}

#[test]
fn help_lists_commands_in_the_order_users_need_them() {
    let help = cohort(&["--help"], &fixture_data());
    let text = String::from_utf8_lossy(&help.stdout);
    let commands: Vec<&str> = text
        .lines()
        .skip_while(|line| !line.starts_with("Commands:"))
        .skip(1)
        .take_while(|line| !line.is_empty())
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    assert_eq!(
        commands,
        [
            "run",
            "check",
            "plot",
            "partitions",
            "evaluate",
            "compare",
            "aggregate",
            "client",
            "place",
            "worker",
            "help"
        ],
        "{text}"
    );
    // One line each.
    let lines = text
        .lines()
        .skip_while(|line| !line.starts_with("Commands:"))
        .skip(1)
        .take_while(|line| !line.is_empty())
        .count();
    assert_eq!(lines, 11, "{text}");
    let worker = String::from_utf8_lossy(&cohort(&["worker", "--help"], &fixture_data()).stdout)
        .into_owned();
    assert!(worker.contains("--plan <DIR>"), "{worker}");
    assert!(!worker.contains("--local-clients"), "{worker}");
    assert!(!worker.contains("[--plan"), "{worker}");
    let compare = String::from_utf8_lossy(&cohort(&["compare", "--help"], &fixture_data()).stdout)
        .into_owned();
    assert_eq!(compare.matches("default").count(), 1, "{compare}");
    let plot =
        String::from_utf8_lossy(&cohort(&["plot", "--help"], &fixture_data()).stdout).into_owned();
    assert!(plot.contains("simulated time"), "{plot}");
    let run =
        String::from_utf8_lossy(&cohort(&["run", "--help"], &fixture_data()).stdout).into_owned();
    assert!(run.contains("cohort check"), "{run}");
    assert!(!run.contains("docs/CONFIG.md"), "{run}");
}
