//! A strategy written outside cohort, against its public API only:
//! norm-bounded FedAvg (Sun et al. 2019, "Can You Really Backdoor Federated
//! Learning?"): each client's update `xᵢ − x` is clipped to an L2 norm bound
//! before the sample-weighted average, which blunts scaled (boosted) updates.
//!
//! `cargo run --release -p cohort-runtime --example norm_bounded_fedavg -- CONFIG`
//! runs a config with it; `cargo test` runs the tests below (a hand-computed
//! case and a real two-round run on the test fixtures).

use cohort_core::strategy::{
    Aggregated, ClientUpdate, RoundContext, Strategy, StrategyError, float_layout,
};
use cohort_core::tree::ParamTree;

/// FedAvg of norm-clipped updates.
pub struct NormBoundedFedAvg {
    /// Largest L2 norm an update keeps.
    pub bound: f64,
    /// Rounds aggregated (to show the strategy ran).
    pub rounds: u32,
}

impl Strategy for NormBoundedFedAvg {
    fn name(&self) -> &'static str {
        "norm_bounded_fedavg"
    }

    fn aggregate(
        &mut self,
        _ctx: &RoundContext,
        global: &ParamTree,
        updates: &[ClientUpdate<'_>],
    ) -> Result<Aggregated, StrategyError> {
        let layout = float_layout(self.name(), global)?;
        let anchor = layout.flatten(global);
        let total: f64 = updates.iter().map(|u| u.num_samples as f64).sum();
        if total == 0.0 {
            return Ok(Aggregated {
                model: None,
                privacy: None,
                selected: None,
            });
        }
        let mut next: Vec<f64> = anchor.iter().map(|&x| x as f64).collect();
        for update in updates {
            let local = layout.flatten(update.tree);
            let delta: Vec<f64> = local
                .iter()
                .zip(&anchor)
                .map(|(&y, &x)| y as f64 - x as f64)
                .collect();
            let norm = delta.iter().map(|d| d * d).sum::<f64>().sqrt();
            if !norm.is_finite() {
                return Err(StrategyError::BadUpdate {
                    client_id: update.client_id,
                    problem: format!("update norm is {norm}"),
                });
            }
            let scale = (self.bound / norm).min(1.0) * update.num_samples as f64 / total;
            for (out, d) in next.iter_mut().zip(delta) {
                *out += scale * d;
            }
        }
        self.rounds += 1;
        let next: Vec<f32> = next.into_iter().map(|x| x as f32).collect();
        Ok(Aggregated::model(layout.rebuild(global, &next)))
    }
}

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: norm_bounded_fedavg CONFIG"))?;
    let loaded = cohort_core::config::load(std::path::Path::new(&path))?;
    let options = cohort_runtime::RunOptions {
        data_root: std::env::var_os("COHORT_DATA_DIR").map(Into::into),
        ..cohort_runtime::RunOptions::new(cohort_runtime::new_run_dir(
            &loaded.config().general.base_path,
            std::path::Path::new(&path),
            None,
        )?)
    };
    let strategy = Box::new(NormBoundedFedAvg {
        bound: 1.0,
        rounds: 0,
    });
    let summary = cohort_runtime::RunBuilder::new(&loaded, options)
        .strategy(strategy)
        .on_round(|row| println!("round {:>3}: accuracy {:.4}", row.round, row.accuracy))
        .run()?;
    println!("results in {}", summary.run_dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_core::tree::Array;

    fn tree(values: &[f32]) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![values.len()], values.to_vec()).unwrap(),
        )])
    }

    #[test]
    fn a_boosted_update_is_clipped_to_the_bound() {
        let mut strategy = NormBoundedFedAvg {
            bound: 1.0,
            rounds: 0,
        };
        let global = tree(&[0.0, 0.0]);
        // Client 1 moves by (0.6, 0.8) (norm 1, kept); client 2 by (30, 40)
        // (norm 50, clipped to (0.6, 0.8)). Equal samples: the mean is (0.6, 0.8).
        let (a, b) = (tree(&[0.6, 0.8]), tree(&[30.0, 40.0]));
        let updates = [
            ClientUpdate {
                client_id: 1,
                num_samples: 5,
                local_steps: 1,
                tree: &a,
            },
            ClientUpdate {
                client_id: 2,
                num_samples: 5,
                local_steps: 1,
                tree: &b,
            },
        ];
        let ctx = RoundContext {
            round: 1,
            learning_rate: 0.1,
            per_round: 2,
            total_clients: 2,
        };
        let out = strategy.aggregate(&ctx, &global, &updates).unwrap();
        let values = out.model.unwrap().leaves()[0].1.as_f32().unwrap().to_vec();
        assert!((values[0] - 0.6).abs() < 1e-6 && (values[1] - 0.8).abs() < 1e-6);
    }

    /// A real run through the public API: the round loop calls this strategy.
    #[test]
    fn runs_inside_a_real_simulation() {
        let config = r#"
[clients]
total_clients = 4
per_round = 2
[data]
datasource = "FashionMNIST"
download = false
partition_size = 50
[trainer]
rounds = 2
epochs = 1
batch_size = 25
optimizer = "sgd"
model_seed = 1
training_seed = 1
[parameters.optimizer]
learning_rate = 0.05
"#;
        let loaded =
            cohort_core::config::from_str(config, std::path::Path::new("example.toml")).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let options = cohort_runtime::RunOptions {
            device: cohort_train::device::DeviceRequest::Cpu,
            data_root: Some(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data"),
            ),
            ..cohort_runtime::RunOptions::new(dir.path().join("run"))
        };
        let mut hooks = cohort_core::hooks::NoHooks;
        let summary = cohort_runtime::run_with_strategy(
            &loaded,
            &options,
            &mut hooks,
            Box::new(NormBoundedFedAvg {
                bound: 0.5,
                rounds: 0,
            }),
        )
        .unwrap();
        assert_eq!(summary.rounds.len(), 2);
        // Round 2 moved the model by at most the bound: a convex combination of
        // updates clipped to 0.5.
        let model = |round: u32| {
            let path = dir
                .path()
                .join(format!("run/checkpoints/round-{round:04}.safetensors"));
            let bytes = std::fs::read(path).unwrap();
            let tree = cohort_core::codec::decode(&bytes, &Default::default()).unwrap();
            let layout = float_layout("test", &tree).unwrap();
            layout.flatten(&tree)
        };
        let (first, second) = (model(1), model(2));
        let moved = first
            .iter()
            .zip(&second)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(moved > 0.0 && moved <= 0.5 + 1e-4, "moved {moved}");
    }
}
