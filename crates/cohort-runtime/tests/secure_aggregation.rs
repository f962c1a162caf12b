//! `[secure_aggregation]` in simulation mode, through whole runs: the
//! secure model equals plain FedAvg of the same updates within the stated
//! quantisation bound, the run folder holds no client's update, dropouts
//! are survived, and too many of them fail the round as `min_per_round`
//! says.

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use cohort_core::codec;
use cohort_core::config::LoadedConfig;
use cohort_core::secagg::{NumShares, Params, mean_error_bound};
use cohort_core::tree::ParamTree;
use cohort_runtime::{MODEL_FILE, RunBuilder, RunEvent, RunOptions};
use cohort_train::device::DeviceRequest;

const SIZES: [u64; 8] = [20, 30, 40, 50, 60, 70, 80, 90];

fn job(initial: &Path, extra: &str) -> String {
    format!(
        r#"
[clients]
total_clients = 8
per_round = 8
min_per_round = 1
[data]
datasource = "FashionMNIST"
download = false
partition_sizes = [20, 30, 40, 50, 60, 70, 80, 90]
[trainer]
rounds = 1
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

const SECURE: &str = r#"
[secure_aggregation]
protocol = "secaggplus"
num_shares = 5
reconstruction_threshold = 3
max_weight = 100.0
clipping_range = 4.0
"#;

fn options(run_dir: PathBuf) -> RunOptions {
    RunOptions {
        device: DeviceRequest::Cpu,
        data_root: Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data")),
        ..RunOptions::new(run_dir)
    }
}

fn config(text: &str) -> LoadedConfig {
    cohort_core::config::from_str(text, Path::new("job.toml")).unwrap()
}

/// The seeded LeNet-5 as a model file, so both runs start from a model the
/// test knows.
fn initial_model(dir: &Path) -> (PathBuf, ParamTree) {
    let cpu = cohort_train::device::cpu();
    let lenet = cohort_train::params::extract(&cohort_train::model::LeNet5::new(10, &cpu));
    let initial = cohort_train::init::seeded_parameters(&lenet, 3);
    let file = dir.join("initial.safetensors");
    std::fs::write(&file, codec::encode(&initial).unwrap()).unwrap();
    (file, initial)
}

fn floats(tree: &ParamTree) -> Vec<f32> {
    let mut out = Vec::new();
    tree.for_each_leaf(&mut |_, array| out.extend_from_slice(array.as_f32().unwrap()));
    out
}

fn read_model(path: &Path) -> ParamTree {
    codec::decode(
        &std::fs::read(path).unwrap(),
        &codec::DecodeLimits::default(),
    )
    .unwrap()
}

/// Every file under `dir`, recursively.
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

#[test]
fn the_secure_model_is_fedavg_within_the_quantisation_bound() {
    let dir = tempfile::tempdir().unwrap();
    let (file, initial) = initial_model(dir.path());
    // The plain run keeps its updates: the test's FedAvg is computed from them.
    let plain_dir = dir.path().join("plain");
    let plain = config(&job(&file, "[results]\nkeep_client_updates = true\n"));
    RunBuilder::new(&plain, options(plain_dir.clone()))
        .run()
        .unwrap();
    let secure_dir = dir.path().join("secure");
    RunBuilder::new(&config(&job(&file, SECURE)), options(secure_dir.clone()))
        .run()
        .unwrap();

    let updates: Vec<Vec<f32>> = (1..=8)
        .map(|c| {
            let path = plain_dir.join(format!("updates/round-0001/client-{c:04}.safetensors"));
            floats(&read_model(&path))
        })
        .collect();
    let g = floats(&initial);
    let total: f64 = SIZES.iter().sum::<u64>() as f64;
    let exact: Vec<f64> = (0..g.len())
        .map(|j| {
            updates
                .iter()
                .zip(SIZES)
                .map(|(x, n)| n as f64 * f64::from(x[j]))
                .sum::<f64>()
                / total
        })
        .collect();
    let max_change = updates
        .iter()
        .flat_map(|x| x.iter().zip(&g).map(|(a, b)| f64::from((a - b).abs())))
        .fold(0.0, f64::max);
    let params = Params {
        max_weight: 100.0,
        clipping_range: 4.0,
        ..Params::new(NumShares::Neighbours(5), 3)
    };
    // Nothing is clipped: each weighted change is at most max_change.
    assert!(max_change < params.clipping_range, "{max_change}");
    let bound = mean_error_bound(&params, 8, total, max_change).unwrap();
    let secure = floats(&read_model(&secure_dir.join(MODEL_FILE)));
    let plain_model = floats(&read_model(&plain_dir.join(MODEL_FILE)));
    let mut worst = 0.0f64;
    for j in 0..g.len() {
        // f32 storage of the result adds at most one rounding of it.
        let rounding = f64::from(f32::EPSILON) * exact[j].abs();
        let error = (f64::from(secure[j]) - exact[j]).abs();
        assert!(error <= bound + rounding, "element {j}: {error} > {bound}");
        worst = worst.max(error);
        // The test's FedAvg is cohort's plain one.
        assert!(
            (f64::from(plain_model[j]) - exact[j]).abs() <= 1e-5,
            "element {j}"
        );
    }
    // The bound says something: far below the round's step.
    let step = exact
        .iter()
        .zip(&g)
        .map(|(m, g)| (m - f64::from(*g)).abs())
        .fold(0.0, f64::max);
    eprintln!(
        "bound {bound:e}, worst error {worst:e}, largest step {step:e}, max |x - g| {max_change}"
    );
    assert!(bound < step / 100.0, "bound {bound}, step {step}");
    assert!(
        worst > 0.0,
        "a quantised sum that is exact hides nothing of the rounding"
    );

    // The run folder holds no update: no updates folder, and no model file
    // in it equal or close to any client's update.
    assert!(!secure_dir.join("updates").exists());
    for path in files_under(&secure_dir) {
        if path.extension().is_some_and(|e| e == "safetensors") {
            let values = floats(&read_model(&path));
            for (c, update) in updates.iter().enumerate() {
                let close = values.len() == update.len()
                    && values.iter().zip(update).all(|(a, b)| (a - b).abs() < 1e-4);
                assert!(!close, "{} is client {}'s update", path.display(), c + 1);
            }
        }
    }
    let costs = std::fs::read_to_string(secure_dir.join("secagg.csv")).unwrap();
    let lines: Vec<&str> = costs.lines().collect();
    assert_eq!(lines.len(), 2, "{costs}");
    let fields: Vec<&str> = lines[1].split(',').collect();
    assert_eq!(&fields[..3], ["1", "8", "8"], "{costs}");
    // The masked inputs: 8 clients × 61,706 + 1 values × 4 bytes at least.
    let input_up: u64 = fields[7].parse().unwrap();
    assert!(input_up >= 8 * 61_707 * 4, "{costs}");
    assert!(!plain_dir.join("secagg.csv").exists());
}

/// The events of a run that ends, and how it ended.
fn run_events(text: &str, run_dir: PathBuf) -> (Vec<RunEvent>, anyhow::Result<()>) {
    let events = RefCell::new(Vec::new());
    let loaded = config(text);
    let result = RunBuilder::new(&loaded, options(run_dir))
        .observer(|event: &RunEvent| events.borrow_mut().push(event.clone()))
        .run()
        .map(|_| ());
    (events.into_inner(), result)
}

#[test]
fn dropouts_above_the_threshold_are_survived() {
    let dir = tempfile::tempdir().unwrap();
    let (file, initial) = initial_model(dir.path());
    let run_dir = dir.path().join("run");
    let text = job(&file, &format!("{SECURE}simulated_dropout = 0.25\n"))
        .replace("rounds = 1", "rounds = 2");
    let (events, result) = run_events(&text, run_dir.clone());
    result.unwrap();
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, RunEvent::ModelKept { .. })),
        "{events:?}"
    );
    let costs = std::fs::read_to_string(run_dir.join("secagg.csv")).unwrap();
    for line in costs.lines().skip(1) {
        let fields: Vec<u32> = line
            .split(',')
            .take(3)
            .map(|f| f.parse().unwrap())
            .collect();
        // Two of eight vanish; those gone after their masked input still count.
        assert_eq!(fields[1], 8, "{costs}");
        assert!((6..=8).contains(&fields[2]), "{costs}");
    }
    let dropped_rows = std::fs::read_to_string(run_dir.join("clients.csv"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("secure aggregation"))
        .count();
    let contributors: u32 = costs
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(2).unwrap().parse::<u32>().unwrap())
        .sum();
    assert_eq!(dropped_rows as u32, 16 - contributors, "{costs}");
    assert_ne!(
        floats(&read_model(&run_dir.join(MODEL_FILE))),
        floats(&initial)
    );
}

#[test]
fn too_many_dropouts_fail_the_round_and_min_per_round_decides() {
    let dir = tempfile::tempdir().unwrap();
    let (file, initial) = initial_model(dir.path());
    // Seven of eight vanish: no secret can be rebuilt from one client's
    // shares. With min_per_round = 1 the rounds keep the model, the run goes on.
    let text = job(&file, &format!("{SECURE}simulated_dropout = 0.875\n"))
        .replace("rounds = 1", "rounds = 2");
    let run_dir = dir.path().join("goes-on");
    let (events, result) = run_events(&text, run_dir.clone());
    result.unwrap();
    let kept: Vec<&String> = events
        .iter()
        .filter_map(|e| match e {
            RunEvent::ModelKept { reason, .. } => Some(reason),
            _ => None,
        })
        .collect();
    assert_eq!(kept.len(), 2, "{events:?}");
    assert!(
        kept[0].contains("secure aggregation protocol aborted"),
        "{}",
        kept[0]
    );
    assert_eq!(
        floats(&read_model(&run_dir.join(MODEL_FILE))),
        floats(&initial)
    );
    let costs = std::fs::read_to_string(run_dir.join("secagg.csv")).unwrap();
    for line in costs.lines().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        assert_eq!(&fields[1..3], ["8", "0"], "{costs}");
    }

    // With min_per_round = 8 the same round stops the run.
    let strict = text.replace("min_per_round = 1", "min_per_round = 8");
    let (_, result) = run_events(&strict, dir.path().join("stops"));
    let message = format!("{:#}", result.unwrap_err());
    assert!(
        message.contains("secure aggregation") && message.contains("clients.min_per_round = 8"),
        "{message}"
    );
}

#[test]
fn strategies_and_keys_that_need_each_update_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _) = initial_model(dir.path());
    let text = job(&file, &format!("{SECURE}\n[algorithm]\ntype = \"krum\"\n"));
    let errors = cohort_core::config::from_str(&text, Path::new("job.toml")).unwrap_err();
    let message = errors.to_string();
    assert!(
        message.contains("algorithm.type") && message.contains("distances"),
        "{message}"
    );
    // A partition heavier than max_weight is refused before round 1.
    let heavy = job(
        &file,
        &SECURE.replace("max_weight = 100.0", "max_weight = 50.0"),
    );
    let error = RunBuilder::new(&config(&heavy), options(dir.path().join("heavy")))
        .run()
        .unwrap_err();
    let message = format!("{error:#}");
    assert!(
        message.contains("secure_aggregation.max_weight = 50") && message.contains("90"),
        "{message}"
    );
}
