//! The models cohort writes are plain safetensors that Python reads: names,
//! shapes and values, checked with `safetensors` + `numpy`.
//! Ignored by a plain `cargo test` (a fresh clone may lack the packages);
//! `.ci/run` runs it, and there a missing package fails it.

mod common;

use std::process::Command;

use cohort_core::codec::{DecodeLimits, decode};
use common::{only_run_dir, run_job};

const READER: &str = r#"
import json, sys
import numpy as np
from safetensors.numpy import load_file
tensors = load_file(sys.argv[1])
print(json.dumps({name: {"shape": list(t.shape), "dtype": str(t.dtype), "sum": float(np.sum(t.astype(np.float64))), "first": float(t.reshape(-1)[0])} for name, t in tensors.items()}))
"#;

#[test]
#[ignore = "needs python3 with numpy and safetensors: .ci/run runs ignored tests"]
fn python_reads_names_shapes_and_values() {
    common::require_python(&["numpy", "safetensors.numpy"]);
    let (_dir, base, output) = run_job(
        r#"
[clients]
total_clients = 2
per_round = 2
[data]
datasource = "FashionMNIST"
download = false
partition_size = 100
[trainer]
rounds = 2
epochs = 1
optimizer = "sgd"
model_seed = 4
training_seed = 4
[parameters.optimizer]
learning_rate = 0.05
"#,
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let run = only_run_dir(&base);

    for model in [
        run.join("model.safetensors"),
        run.join("checkpoints/round-0001.safetensors"),
    ] {
        let python = Command::new("python3")
            .args(["-c", READER, model.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            python.status.success(),
            "{}",
            String::from_utf8_lossy(&python.stderr)
        );
        let seen: serde_json::Value = serde_json::from_slice(&python.stdout).unwrap();
        let tree = decode(&std::fs::read(&model).unwrap(), &DecodeLimits::default()).unwrap();
        let leaves = tree.leaves();
        assert_eq!(seen.as_object().unwrap().len(), leaves.len());
        for (path, array) in leaves {
            let entry = &seen[path.to_string()];
            assert_eq!(entry["dtype"], "float32", "{path}");
            let shape: Vec<usize> = entry["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(shape, array.shape(), "{path}");
            let values = array.as_f32().unwrap();
            assert_eq!(entry["first"].as_f64().unwrap() as f32, values[0], "{path}");
            let sum: f64 = values.iter().map(|&x| x as f64).sum();
            assert!(
                (entry["sum"].as_f64().unwrap() - sum).abs() <= 1e-9 * sum.abs().max(1.0),
                "{path}"
            );
        }
        assert!(seen.get("conv1.weight").is_some() && seen.get("fc5.bias").is_some());
    }
}
