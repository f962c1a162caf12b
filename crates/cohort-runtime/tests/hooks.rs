//! Server hooks inside a real run: a hook that breaks the positional contract
//! stops the round before aggregation, and the global model stays as it was.

use std::path::{Path, PathBuf};

use cohort_core::hooks::{ReceivedPayload, ServerHooks};
use cohort_runtime::{MODEL_FILE, RunOptions, run, run_with_hooks};
use cohort_train::device::DeviceRequest;

const JOB: &str = r#"
[clients]
total_clients = 4
per_round = 2
[data]
datasource = "FashionMNIST"
download = false
partition_size = 100
[trainer]
rounds = 2
epochs = 1
batch_size = 20
optimizer = "sgd"
model_seed = 1
training_seed = 1
[parameters.optimizer]
learning_rate = 0.05
"#;

fn options(run_dir: PathBuf, rounds: u32) -> RunOptions {
    RunOptions {
        device: DeviceRequest::Cpu,
        rounds: Some(rounds),
        data_root: Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data")),
        ..RunOptions::new(run_dir)
    }
}

/// Swaps the two payloads of every round from `from_round` on.
struct SwapFrom {
    from_round: u32,
    round: u32,
    observed: Vec<u32>,
}

impl ServerHooks for SwapFrom {
    fn weights_received(&mut self, mut payloads: Vec<ReceivedPayload>) -> Vec<ReceivedPayload> {
        self.round += 1;
        if self.round >= self.from_round {
            payloads.swap(0, 1);
        }
        payloads
    }

    fn on_weights_received(&mut self, payloads: &[ReceivedPayload]) {
        self.observed
            .extend(payloads.iter().map(|p| p.report.client_id));
    }
}

#[test]
fn contract_violation_stops_before_aggregation_and_keeps_the_model() {
    let loaded = cohort_core::config::from_str(JOB, Path::new("job.toml")).unwrap();
    let dir = tempfile::tempdir().unwrap();

    let one_round = run(&loaded, &options(dir.path().join("one"), 1)).unwrap();
    let after_round_one = std::fs::read(&one_round.model_path).unwrap();

    let mut hook = SwapFrom {
        from_round: 2,
        round: 0,
        observed: Vec::new(),
    };
    let error =
        run_with_hooks(&loaded, &options(dir.path().join("hooked"), 2), &mut hook).unwrap_err();
    let message = format!("{error:#}");
    assert!(
        message.contains("after hook `weights_received`"),
        "{message}"
    );
    assert!(message.contains("reordered"), "{message}");
    // Round 1 passed the hooks; round 2 stopped before aggregation.
    assert_eq!(hook.observed.len(), 2);
    let kept = std::fs::read(dir.path().join("hooked").join(MODEL_FILE)).unwrap();
    assert_eq!(
        kept, after_round_one,
        "the global model is the one of round 1"
    );
    let csv = std::fs::read_to_string(dir.path().join("hooked/results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "only round 1 recorded: {csv}");
}
