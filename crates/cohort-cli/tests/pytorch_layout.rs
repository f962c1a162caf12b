//! cohort's model files are PyTorch `state_dict`s, checked without PyTorch:
//!
//! * a numpy LeNet-5 written from PyTorch's definitions
//!   (`examples/python_client/lenet5.py`: conv `[out, in, kh, kw]`, max-pool,
//!   linear `y = x Wᵀ + b` with `W` `[out, in]`) reads a run's
//!   `model.safetensors` and classifies a slice of the test set exactly as
//!   `cohort evaluate` does, logits within float32 rounding;
//! * the files of a run of each model for MNIST's samples (`lenet5`,
//!   `lenet5_compact`, `cnn_bn`) hold exactly the names, shapes and dtypes of
//!   the `state_dict` of its class in `examples/pytorch/models.py`, written out
//!   below as a table (what `load_state_dict(..., strict=True)` checks). Every
//!   registered model, the zoo's too, is loaded into its PyTorch twin itself
//!   by `crates/cohort-train/tests/pytorch_twins.rs`.
//!
//! Needs python3 with numpy and safetensors; without them these tests fail
//! rather than pass having checked nothing, so they are `#[ignore]`d and
//! `.ci/run` runs them (`--include-ignored`).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::{cohort, fixture_data, only_run_dir, repo_root, require_python, run_job};

/// Prints `{name: [shape, dtype]}` of a safetensors file, as numpy reads it.
const LIST_TENSORS: &str = r#"
import json, sys
from safetensors.numpy import load_file
print(json.dumps({n: [list(t.shape), str(t.dtype)] for n, t in load_file(sys.argv[1]).items()}))
"#;

/// The numpy forward pass on the first N test images of the fixture; compares
/// with cohort's logits file and prints what it found.
const NUMPY_LENET5: &str = r#"
import json, sys
import numpy as np
from safetensors.numpy import load_file
examples, model, images, labels, first, reference = sys.argv[1:7]
sys.path.insert(0, examples)
import lenet5
n = int(first)
x = lenet5.normalize(lenet5.read_idx(images)[:n])
y = lenet5.read_idx(labels)[:n]
logits = lenet5.forward(load_file(model), x)
cohort = load_file(reference)
print(json.dumps({
    "correct": int((logits.argmax(axis=1) == y).sum()),
    "same_labels": bool(np.array_equal(cohort["labels"], y.astype(np.int64))),
    "max_abs_logit_difference": float(np.abs(logits - cohort["logits"]).max()),
    "largest_logit": float(np.abs(cohort["logits"]).max()),
}))
"#;

fn python(script: &str, args: &[&str]) -> serde_json::Value {
    let output = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 runs");
    assert!(
        output.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("the script prints JSON")
}

fn job(model: &str, rounds: u32) -> String {
    format!(
        r#"
[clients]
total_clients = 2
per_round = 2
[data]
datasource = "FashionMNIST"
download = false
partition_size = 300
[trainer]
model_name = "{model}"
rounds = {rounds}
epochs = 2
optimizer = "sgd"
model_seed = 4
training_seed = 4
[parameters.optimizer]
learning_rate = 0.1
"#
    )
}

fn assert_success(output: &std::process::Output) {
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
#[ignore = "needs python3 with numpy and safetensors: .ci/run runs ignored tests"]
fn a_numpy_lenet5_from_pytorchs_definitions_classifies_as_cohort_does() {
    require_python(&["numpy", "safetensors.numpy"]);
    let (dir, base, output) = run_job(&job("lenet5", 3));
    assert_success(&output);
    let run = only_run_dir(&base);
    let model = run.join("model.safetensors");
    let config = run.join("config.toml");
    let evaluate = |extra: &[&str]| {
        let mut args = vec![
            "evaluate",
            "--config",
            config.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--cpu",
        ];
        args.extend_from_slice(extra);
        let output = cohort(&args, &fixture_data());
        assert_success(&output);
        String::from_utf8(output.stdout).unwrap()
    };

    // `cohort evaluate` on the whole test set is the run's own evaluation.
    let results = std::fs::read_to_string(run.join("results.csv")).unwrap();
    let last_accuracy = results.lines().last().unwrap().split(',').nth(1).unwrap();
    let whole = evaluate(&[]);
    assert!(
        whole.contains(&format!("accuracy {last_accuracy} ")),
        "results.csv's last accuracy {last_accuracy}, cohort evaluate: {whole}"
    );

    let first = 150;
    let logits = dir.path().join("cohort-logits.safetensors");
    let sliced = evaluate(&[
        "--first",
        &first.to_string(),
        "--logits",
        logits.to_str().unwrap(),
    ]);
    let cohort_correct: u64 = sliced
        .split(": ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|count| count.parse().ok())
        .unwrap_or_else(|| panic!("no correct count in `{sliced}`"));

    let fashion = fixture_data().join("fashion-mnist");
    let seen = python(
        NUMPY_LENET5,
        &[
            repo_root().join("examples/python_client").to_str().unwrap(),
            model.to_str().unwrap(),
            fashion.join("t10k-images-idx3-ubyte.gz").to_str().unwrap(),
            fashion.join("t10k-labels-idx1-ubyte.gz").to_str().unwrap(),
            &first.to_string(),
            logits.to_str().unwrap(),
        ],
    );
    assert_eq!(seen["same_labels"], true, "{seen}");
    assert_eq!(
        seen["correct"].as_u64().unwrap(),
        cohort_correct,
        "numpy {seen} vs cohort `{sliced}`"
    );
    // A trained model, not one that answers one class: the comparison means something.
    assert!(
        cohort_correct * 10 > first * 2,
        "{cohort_correct} of {first}"
    );
    let difference = seen["max_abs_logit_difference"].as_f64().unwrap();
    let scale = seen["largest_logit"].as_f64().unwrap().max(1.0);
    assert!(
        difference <= 1e-5 * scale,
        "logits differ by up to {difference} (largest {scale}): {seen}"
    );
}

/// The `state_dict` of each class of `examples/pytorch/models.py` with
/// `num_classes=10`: name, shape, numpy dtype.
fn pytorch_state_dict(model: &str) -> BTreeMap<String, (Vec<usize>, &'static str)> {
    let f = "float32";
    let entries: Vec<(&str, Vec<usize>, &str)> = match model {
        "lenet5" => vec![
            ("conv1.weight", vec![6, 1, 5, 5], f),
            ("conv1.bias", vec![6], f),
            ("conv2.weight", vec![16, 6, 5, 5], f),
            ("conv2.bias", vec![16], f),
            ("conv3.weight", vec![120, 16, 5, 5], f),
            ("conv3.bias", vec![120], f),
            ("fc4.weight", vec![84, 120], f),
            ("fc4.bias", vec![84], f),
            ("fc5.weight", vec![10, 84], f),
            ("fc5.bias", vec![10], f),
        ],
        "lenet5_compact" => vec![
            ("conv1.weight", vec![6, 1, 5, 5], f),
            ("conv1.bias", vec![6], f),
            ("conv2.weight", vec![16, 6, 5, 5], f),
            ("conv2.bias", vec![16], f),
            ("fc3.weight", vec![120, 256], f),
            ("fc3.bias", vec![120], f),
            ("fc4.weight", vec![84, 120], f),
            ("fc4.bias", vec![84], f),
            ("fc5.weight", vec![10, 84], f),
            ("fc5.bias", vec![10], f),
        ],
        "cnn_bn" => vec![
            ("conv1.weight", vec![16, 1, 3, 3], f),
            ("conv1.bias", vec![16], f),
            ("bn1.weight", vec![16], f),
            ("bn1.bias", vec![16], f),
            ("bn1.running_mean", vec![16], f),
            ("bn1.running_var", vec![16], f),
            ("bn1.num_batches_tracked", vec![], "int64"),
            ("conv2.weight", vec![32, 16, 3, 3], f),
            ("conv2.bias", vec![32], f),
            ("bn2.weight", vec![32], f),
            ("bn2.bias", vec![32], f),
            ("bn2.running_mean", vec![32], f),
            ("bn2.running_var", vec![32], f),
            ("bn2.num_batches_tracked", vec![], "int64"),
            ("fc3.weight", vec![128, 1568], f),
            ("fc3.bias", vec![128], f),
            ("fc4.weight", vec![10, 128], f),
            ("fc4.bias", vec![10], f),
        ],
        other => panic!("no state_dict table for model `{other}`: add its class and rows"),
    };
    entries
        .into_iter()
        .map(|(name, shape, dtype)| (name.to_owned(), (shape, dtype)))
        .collect()
}

fn tensors_of(file: &Path) -> BTreeMap<String, (Vec<usize>, String)> {
    let seen = python(LIST_TENSORS, &[file.to_str().unwrap()]);
    seen.as_object()
        .unwrap()
        .iter()
        .map(|(name, entry)| {
            let shape = entry[0]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (name.clone(), (shape, entry[1].as_str().unwrap().to_owned()))
        })
        .collect()
}

#[test]
#[ignore = "needs python3 with numpy and safetensors: .ci/run runs ignored tests"]
fn the_mnist_models_files_are_their_pytorch_state_dicts() {
    require_python(&["numpy", "safetensors.numpy"]);
    // The models of Fashion-MNIST's samples tabled above, run end to end.
    // Every registered model, these included, is held to its PyTorch twin
    // (strict load and logits) by cohort-train's tests/pytorch_twins.rs.
    for name in ["lenet5", "lenet5_compact", "cnn_bn"] {
        let name = name.to_owned();
        let expected: BTreeMap<String, (Vec<usize>, String)> = pytorch_state_dict(&name)
            .into_iter()
            .map(|(k, (shape, dtype))| (k, (shape, dtype.to_owned())))
            .collect();
        let (_dir, base, output) = run_job(&job(&name, 1));
        assert_success(&output);
        let run = only_run_dir(&base);
        for file in [
            run.join("model.safetensors"),
            run.join("checkpoints/round-0001.safetensors"),
        ] {
            assert_eq!(tensors_of(&file), expected, "{name}: {}", file.display());
        }
        // A model file reads back (counters dropped) into cohort's evaluation.
        let evaluated = cohort(
            &[
                "evaluate",
                "--config",
                run.join("config.toml").to_str().unwrap(),
                "--model",
                run.join("model.safetensors").to_str().unwrap(),
                "--cpu",
                "--first",
                "20",
            ],
            &fixture_data(),
        );
        assert_success(&evaluated);
    }
}
