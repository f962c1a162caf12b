//! What a run leaves on disk: the model file, `results.csv` and
//! `clients.csv`, checkpoints, and (on request) every update aggregated; and
//! the arithmetic of the rows (simulated wall time, weighted loss).
//!
//! Only the process that writes the run's files records (rank 0 of a
//! distributed simulation); every write is atomic, so a run stopped at any
//! point leaves the files of its last complete round.

use std::path::{Path, PathBuf};

use anyhow::Context;

use cohort_core::checkpoint::{self, History};
use cohort_core::codec;
use cohort_core::fsutil::atomic_write;
use cohort_core::hooks::{ClientReport, ReceivedPayload};
use cohort_core::layout;
use cohort_core::results::{ClientRow, ResultsWriter, RoundRow};
use cohort_core::selection::SelectorState;
use cohort_core::strategy::Strategy;

use crate::updates::Arrival;

/// Name of the final model file in the run folder.
pub const MODEL_FILE: &str = "model.safetensors";

/// Where and what the recorder writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RecordSettings {
    pub(crate) run_dir: PathBuf,
    /// The config's result hash, kept in every checkpoint: `--resume` refuses
    /// a config that would compute another run.
    pub(crate) config_hash: String,
    /// `results.keep_client_updates`.
    pub(crate) keep_client_updates: bool,
}

/// `server.simulate_wall_time` and the simulated links.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct SimulatedWallTime {
    pub(crate) simulate: bool,
    pub(crate) downlink_mbps: Option<f64>,
    pub(crate) uplink_mbps: Option<f64>,
}

/// The run folder's writer.
pub(crate) struct Recorder {
    settings: RecordSettings,
    results: ResultsWriter,
    /// Whether this process writes (rank 0); the others keep rows only.
    writes: bool,
}

impl Recorder {
    pub(crate) fn new(settings: RecordSettings, results: ResultsWriter, writes: bool) -> Self {
        Self {
            settings,
            results,
            writes,
        }
    }

    pub(crate) fn rounds(&self) -> &[RoundRow] {
        self.results.rounds()
    }

    pub(crate) fn into_rounds(self) -> Vec<RoundRow> {
        self.results.rounds().to_vec()
    }

    pub(crate) fn write_model(&self, model_bytes: &[u8]) -> anyhow::Result<()> {
        let path = self.settings.run_dir.join(MODEL_FILE);
        atomic_write(&path, model_bytes).with_context(|| format!("cannot write {}", path.display()))
    }

    pub(crate) fn record(&mut self, row: RoundRow, clients: Vec<ClientRow>) -> anyhow::Result<()> {
        self.results
            .record(row, clients)
            .context("cannot write results.csv")
    }

    /// The checkpoint of `round`; its sidecar's path, written last.
    pub(crate) fn checkpoint(
        &self,
        round: u32,
        model_bytes: &[u8],
        selector: SelectorState,
        strategy: &dyn Strategy,
    ) -> anyhow::Result<PathBuf> {
        let state = strategy.state();
        let sidecar = checkpoint::write(
            &self.settings.run_dir,
            model_bytes,
            History {
                format: checkpoint::FORMAT_VERSION,
                round,
                config_hash: self.settings.config_hash.clone(),
                selector,
                algorithm_state: None,
                rounds: self.results.rounds().to_vec(),
                clients: self.results.clients().to_vec(),
                model_file: String::new(),
                model_sha256: String::new(),
            },
            (strategy.name(), &state),
        )?;
        Ok(sidecar)
    }

    /// `results.keep_client_updates`: what the server aggregated, in
    /// `updates/round-NNNN/client-CCCC.safetensors`.
    pub(crate) fn keep_updates(
        &self,
        round: u32,
        payloads: &[ReceivedPayload],
    ) -> anyhow::Result<()> {
        if self.writes && self.settings.keep_client_updates {
            keep_updates(&self.settings.run_dir, round, payloads)?;
        }
        Ok(())
    }
}

/// Seconds to move `bytes` at `mbps` Mbit/s.
pub(crate) fn transfer_seconds(bytes: u64, mbps: f64) -> f64 {
    bytes as f64 * 8.0 / (mbps * 1e6)
}

/// Accuracy of the global model the round's clients received, over all their
/// held-out samples together; `None` when no client evaluated.
pub(crate) fn federated_accuracy(arrivals: &[Arrival]) -> Option<f64> {
    let samples: u64 = arrivals.iter().map(|a| a.test_samples).sum();
    let correct: u64 = arrivals.iter().map(|a| a.test_correct).sum();
    (samples > 0).then(|| correct as f64 / samples as f64)
}

/// Mean training loss of the round's clients, weighted by samples.
pub(crate) fn weighted_loss(reports: &[ClientReport]) -> f64 {
    let total: u64 = reports.iter().map(|r| r.num_samples).sum();
    reports
        .iter()
        .map(|r| r.loss * r.num_samples as f64)
        .sum::<f64>()
        / total.max(1) as f64
}

/// Simulated wall time of a round: its clients as if they ran in parallel,
/// each finishing after its download, processing, training and upload.
pub(crate) fn slowest_client(
    reports: &[ClientReport],
    arrivals: &[Arrival],
    downlink_payload: u64,
    wall_time: &SimulatedWallTime,
) -> f64 {
    reports
        .iter()
        .zip(arrivals)
        .map(|(report, arrival)| {
            let comm_time = match (wall_time.downlink_mbps, wall_time.uplink_mbps) {
                (None, None) => arrival.comm_time,
                (down, up) => {
                    down.map_or(0.0, |mbps| transfer_seconds(downlink_payload, mbps))
                        + up.map_or(0.0, |mbps| transfer_seconds(arrival.payload_bytes, mbps))
                }
            };
            report.training_time + arrival.processing_time + comm_time
        })
        .fold(0.0f64, f64::max)
}

/// `updates/round-NNNN/client-CCCC.safetensors`: what the server aggregated.
fn keep_updates(run_dir: &Path, round: u32, payloads: &[ReceivedPayload]) -> anyhow::Result<()> {
    let folder = run_dir.join("updates").join(format!("round-{round:04}"));
    std::fs::create_dir_all(&folder)
        .with_context(|| format!("cannot create {}", folder.display()))?;
    for payload in payloads {
        let path = folder.join(format!(
            "client-{:04}.safetensors",
            payload.report.client_id
        ));
        let tree = payload.tree();
        let file = layout::to_model_file(tree);
        atomic_write(&path, &codec::encode(file.as_ref().unwrap_or(tree))?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::updates::tests::{arrival, report};

    #[test]
    fn round_numbers_by_hand() {
        let reports = [report(1, 300, 1.0, 3.0), report(2, 100, 2.0, 1.0)];
        // (300·1 + 100·2) / 400 = 1.25.
        assert_eq!(weighted_loss(&reports), 1.25);
        // 3 of 4 and 1 of 6 held-out samples: 4 / 10.
        let arrivals = [arrival(1_000_000, (4, 3)), arrival(1_000_000, (6, 1))];
        assert_eq!(federated_accuracy(&arrivals), Some(0.4));
        assert_eq!(federated_accuracy(&[arrival(1, (0, 0))]), None);

        let mut links = SimulatedWallTime::default();
        // Measured communication: the slowest is 3 + 0.5 + 2.
        assert_eq!(slowest_client(&reports, &arrivals, 2_000_000, &links), 5.5);
        // Bandwidths instead: 2 MB down at 8 Mbit/s is 2 s, 1 MB up at 4 is 2 s.
        links.downlink_mbps = Some(8.0);
        links.uplink_mbps = Some(4.0);
        assert_eq!(slowest_client(&reports, &arrivals, 2_000_000, &links), 7.5);
    }
}
