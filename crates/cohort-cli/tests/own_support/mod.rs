//! Helpers of the own-data tests (own_data.rs, python_client.rs): datasets
//! written from the fixture in the formats a client brings, `cohort` commands,
//! `clients.csv` rows, and FedAvg recomputed from the updates a run kept.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use cohort_core::codec::{self, DecodeLimits};
use cohort_core::data::idx::{IdxArray, read_idx_gz};
use cohort_core::strategy::{AlgorithmConfig, ClientUpdate, RoundContext};
use cohort_core::tree::ParamTree;

use crate::common::{fixture_data, write_config};

pub const PIXELS: usize = 28 * 28;
pub const BATCH_SIZE: u64 = 20;

/// The fixture's images and labels of one split.
pub struct Split {
    pub images: IdxArray,
    pub labels: IdxArray,
}

pub fn fixture_split(prefix: &str) -> Split {
    let folder = fixture_data().join("fashion-mnist");
    let read = |name: &str, rank| read_idx_gz(&folder.join(name), rank).unwrap();
    Split {
        images: read(&format!("{prefix}-images-idx3-ubyte.gz"), 3),
        labels: read(&format!("{prefix}-labels-idx1-ubyte.gz"), 1),
    }
}

/// The first `count` samples of `split` whose label passes `keep`.
pub fn pick(split: &Split, count: usize, keep: impl Fn(u8) -> bool) -> (Vec<u8>, Vec<u8>) {
    let chosen: Vec<usize> = (0..split.labels.data.len())
        .filter(|&i| keep(split.labels.data[i]))
        .take(count)
        .collect();
    assert_eq!(chosen.len(), count, "the fixture has too few such samples");
    let images = chosen
        .iter()
        .flat_map(|&i| {
            split.images.data[i * PIXELS..(i + 1) * PIXELS]
                .iter()
                .copied()
        })
        .collect();
    let labels = chosen.iter().map(|&i| split.labels.data[i]).collect();
    (images, labels)
}

pub fn idx_file(dims: &[usize], body: &[u8]) -> Vec<u8> {
    let mut raw = vec![0, 0, 0x08, dims.len() as u8];
    for &d in dims {
        raw.extend((d as u32).to_be_bytes());
    }
    raw.extend(body);
    raw
}

/// A folder of plain IDX files: training and held-out samples.
pub fn write_idx_folder(folder: &Path, train: &(Vec<u8>, Vec<u8>), test: &(Vec<u8>, Vec<u8>)) {
    std::fs::create_dir_all(folder).unwrap();
    for (prefix, (images, labels)) in [("train", train), ("t10k", test)] {
        let n = labels.len();
        std::fs::write(
            folder.join(format!("{prefix}-images-idx3-ubyte")),
            idx_file(&[n, 28, 28], images),
        )
        .unwrap();
        std::fs::write(
            folder.join(format!("{prefix}-labels-idx1-ubyte")),
            idx_file(&[n], labels),
        )
        .unwrap();
    }
}

/// A safetensors file as numpy users write it: uint8 images with int64
/// labels, or float32 intensities in [0, 1] shaped [N, 1, 28, 28].
pub fn write_safetensors(
    path: &Path,
    train: &(Vec<u8>, Vec<u8>),
    test: Option<&(Vec<u8>, Vec<u8>)>,
    float: bool,
) {
    use safetensors::tensor::{Dtype, TensorView};
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |prefix: &str, (images, labels): &(Vec<u8>, Vec<u8>)| {
        let n = labels.len();
        if float {
            let values = images
                .iter()
                .flat_map(|&p| (f32::from(p) / 255.0).to_le_bytes())
                .collect();
            owned.push((
                format!("{prefix}images"),
                Dtype::F32,
                vec![n, 1, 28, 28],
                values,
            ));
        } else {
            owned.push((
                format!("{prefix}images"),
                Dtype::U8,
                vec![n, 28, 28],
                images.clone(),
            ));
        }
        let labels = labels
            .iter()
            .flat_map(|&l| i64::from(l).to_le_bytes())
            .collect();
        owned.push((format!("{prefix}labels"), Dtype::I64, vec![n], labels));
    };
    add("", train);
    if let Some(test) = test {
        add("test_", test);
    }
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

pub fn cohort(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_cohort"));
    command
        .args(args)
        .env("COHORT_DATA_DIR", fixture_data())
        .env_remove("RUST_LOG")
        .env_remove("COHORT_TOKEN");
    command
}

/// `cohort client --data PATH [--client-id ID]`, with no shared data set in
/// reach: an own-data client must not need one.
pub fn own_data_client(port: u16, data: &Path, client_id: Option<u32>) -> Command {
    let server = format!("127.0.0.1:{port}");
    let mut command = cohort(&["client", "--server", &server, "--cpu", "--quiet", "--data"]);
    command
        .arg(data)
        .env("COHORT_DATA_DIR", "/nonexistent-shared-data");
    if let Some(id) = client_id {
        command.arg("--client-id").arg(id.to_string());
    }
    command
}

pub fn start(mut command: Command) -> Child {
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

pub fn finish(child: Child, what: &str) -> Output {
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The run folder's `run.log` once it has `count` lines containing `needle`.
pub fn wait_for_log(base: &Path, needle: &str, count: usize) -> PathBuf {
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no `{needle}` ×{count} in run.log within 60 s"
        );
        if let Some(Ok(entry)) = std::fs::read_dir(base).ok().and_then(|mut e| e.next()) {
            let log = std::fs::read_to_string(entry.path().join("run.log")).unwrap_or_default();
            if log.matches(needle).count() >= count {
                return entry.path();
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One row of `clients.csv`.
#[derive(Debug)]
pub struct Row {
    pub round: u32,
    pub client: u32,
    pub samples: String,
    pub histogram: String,
    pub test_accuracy: String,
    pub dropped: String,
}

pub fn clients_csv(run_dir: &Path) -> Vec<Row> {
    let text = std::fs::read_to_string(run_dir.join("clients.csv")).unwrap();
    // `dropped` is the last column and its reason may hold commas: split
    // into as many fields as the header names, the last one whole.
    let columns = text.lines().next().unwrap().split(',').count();
    text.lines()
        .skip(1)
        .map(|line| {
            let f: Vec<&str> = line.splitn(columns, ',').collect();
            Row {
                round: f[0].parse().unwrap(),
                client: f[1].parse().unwrap(),
                samples: f[3].to_owned(),
                histogram: f[9].to_owned(),
                test_accuracy: f[10].to_owned(),
                dropped: f[columns - 1].trim_matches('"').to_owned(),
            }
        })
        .collect()
}

pub fn decode_file(path: &Path) -> ParamTree {
    codec::decode(&std::fs::read(path).unwrap(), &DecodeLimits::default()).unwrap()
}

/// Round `round`'s model recomputed from the updates the server kept: FedAvg
/// through cohort-core's strategy, weighted by the samples `clients.csv`
/// gives, in its (selection) order, from the global model of the round
/// before (its checkpoint). `clients.csv`'s numbers are checked beforehand.
pub fn assert_fedavg(run_dir: &Path, round: u32, rows: &[Row], total_clients: u32) {
    let weights: Vec<(u32, u64)> = rows
        .iter()
        .filter(|r| r.round == round && r.dropped.is_empty())
        .map(|r| (r.client, r.samples.parse().unwrap()))
        .collect();
    let global =
        decode_file(&run_dir.join(format!("checkpoints/round-{:04}.safetensors", round - 1)));
    let folder = run_dir.join(format!("updates/round-{round:04}"));
    let trees: Vec<ParamTree> = weights
        .iter()
        .map(|(id, _)| decode_file(&folder.join(format!("client-{id:04}.safetensors"))))
        .collect();
    let updates: Vec<ClientUpdate<'_>> = weights
        .iter()
        .zip(&trees)
        .map(|(&(client_id, num_samples), tree)| ClientUpdate {
            client_id,
            num_samples,
            local_steps: num_samples.div_ceil(BATCH_SIZE),
            tree,
        })
        .collect();
    let context = RoundContext {
        round,
        learning_rate: 0.05,
        per_round: weights.len() as u32,
        total_clients,
    };
    let expected = AlgorithmConfig::default()
        .build()
        .unwrap()
        .aggregate(&context, &global, &updates)
        .unwrap()
        .model
        .unwrap();
    let model = run_dir.join(if round == 2 {
        "model.safetensors".to_owned()
    } else {
        format!("checkpoints/round-{round:04}.safetensors")
    });
    assert!(
        decode_file(&model) == expected,
        "round {round}: the model is not the sample-weighted FedAvg of {weights:?}"
    );
}

/// `cohort run` on `config_text` in the background; returns the base folder of its run.
pub fn server(dir: &Path, config_text: &str, extra: &[&str]) -> (PathBuf, Child) {
    server_on(dir, config_text, extra, &fixture_data())
}

/// A data folder under `dir` with the fixture's test files alone (no
/// training set), as a server whose clients all bring their own data holds.
pub fn test_files_only(dir: &Path) -> PathBuf {
    let root = dir.join("server-data");
    let folder = root.join("fashion-mnist");
    std::fs::create_dir_all(&folder).unwrap();
    for name in ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"] {
        std::fs::copy(
            fixture_data().join("fashion-mnist").join(name),
            folder.join(name),
        )
        .unwrap();
    }
    root
}

/// `server` with its data sets under `data_root` (`COHORT_DATA_DIR`).
pub fn server_on(
    dir: &Path,
    config_text: &str,
    extra: &[&str],
    data_root: &Path,
) -> (PathBuf, Child) {
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
    let mut command = cohort(&args);
    command.env("COHORT_DATA_DIR", data_root);
    (base, start(command))
}
