//! Where a run's results go ([`Recorder`]; by default the run folder's
//! files, [`RunFolder`]), and the arithmetic of the rows (simulated wall
//! time, weighted loss).

use std::path::{Path, PathBuf};

use anyhow::Context;

use cohort_core::checkpoint::{self, History};
use cohort_core::codec;
use cohort_core::fsutil::atomic_write;
use cohort_core::hooks::{ClientReport, ReceivedPayload};
use cohort_core::layout;
use cohort_core::results::{ClientRow, RoundRow, RunRows};
use cohort_core::selection::{PolicyState, SelectorState};
use cohort_core::strategy::Strategy;

use crate::updates::Arrival;

/// Name of the final model file in the run folder.
pub const MODEL_FILE: &str = "model.safetensors";

/// `server.simulate_wall_time` and the simulated links.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct SimulatedWallTime {
    pub(crate) simulate: bool,
    pub(crate) downlink_mbps: Option<f64>,
    pub(crate) uplink_mbps: Option<f64>,
}

/// What a checkpoint after `round` holds: everything `--resume` needs to
/// continue the run exactly.
pub struct CheckpointState<'a> {
    pub round: u32,
    /// The global model after `round`, as the model file's bytes.
    pub model_bytes: &'a [u8],
    /// The selector before the next round's draw.
    pub selector: SelectorState,
    /// A utility selection's state then (`None` for `random`).
    pub selection: Option<PolicyState>,
    /// The strategy, whose [`Strategy::state`] the checkpoint keeps.
    pub strategy: &'a dyn Strategy,
    pub rows: &'a RunRows,
    /// The config's result hash: `--resume` refuses a config that would
    /// compute another run.
    pub config_hash: &'a str,
    /// An asynchronous run's tasks in flight and the models they trained from.
    pub asynchronous: Option<&'a AsyncCheckpoint>,
}

/// What an asynchronous run has in flight at a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct AsyncCheckpoint {
    pub history: checkpoint::AsyncHistory,
    /// The models the tasks trained from, by `v<version>`.
    pub bases: std::collections::BTreeMap<String, cohort_core::tree::ParamTree>,
}

/// Where a run's results go. The loop calls it on the process that writes
/// the run's results (rank 0 of a distributed simulation), and only once a
/// round's aggregation succeeded, so a recorder never sees a round that
/// failed. An error stops the run.
///
/// [`RunFolder`] is the default: the run folder's files. A caller's own
/// (to a database, or the default's files plus something else) is given to
/// [`crate::RunBuilder::recorder`]; `--resume` reads only the run folder's
/// checkpoints, so a recorder that writes none makes a run that cannot be
/// resumed.
pub trait Recorder {
    /// The global model after `round`, as a model file's bytes (PyTorch
    /// layout, safetensors).
    fn model(&mut self, round: u32, model_bytes: &[u8]) -> anyhow::Result<()>;

    /// `round`'s row and its clients' rows (dropped clients' included), once
    /// `rows` holds them; `rows` has every round so far.
    fn round(
        &mut self,
        round: &RoundRow,
        clients: &[ClientRow],
        rows: &RunRows,
    ) -> anyhow::Result<()>;

    /// A checkpoint after `state.round`; where it was written, if it was.
    fn checkpoint(&mut self, state: &CheckpointState<'_>) -> anyhow::Result<Option<PathBuf>>;

    /// The updates aggregated in `round`, as the server hooks passed them,
    /// before the strategy aggregates them. Nothing by default.
    fn updates(&mut self, round: u32, payloads: &[ReceivedPayload]) -> anyhow::Result<()> {
        let _ = (round, payloads);
        Ok(())
    }

    /// Whether [`Recorder::updates`] does anything with the updates. Where
    /// it does not, a network-mode server may fold a round's updates into
    /// the mean one at a time, keeping those past their share of
    /// `server.max_inflight_bytes` on disk instead of all of them in memory, and never calls it. Yes by
    /// default, so a recorder that keeps updates never misses one.
    fn keeps_updates(&self) -> bool {
        true
    }
}

/// A recorder lent for the run, to be read once it is over.
impl<R: Recorder + ?Sized> Recorder for &mut R {
    fn model(&mut self, round: u32, model_bytes: &[u8]) -> anyhow::Result<()> {
        (**self).model(round, model_bytes)
    }

    fn round(
        &mut self,
        round: &RoundRow,
        clients: &[ClientRow],
        rows: &RunRows,
    ) -> anyhow::Result<()> {
        (**self).round(round, clients, rows)
    }

    fn checkpoint(&mut self, state: &CheckpointState<'_>) -> anyhow::Result<Option<PathBuf>> {
        (**self).checkpoint(state)
    }

    fn updates(&mut self, round: u32, payloads: &[ReceivedPayload]) -> anyhow::Result<()> {
        (**self).updates(round, payloads)
    }

    fn keeps_updates(&self) -> bool {
        (**self).keeps_updates()
    }
}

/// The run folder: `model.safetensors`, `results.csv` and `clients.csv`
/// rewritten after every round, checkpoints, and (when asked) every update
/// aggregated. Every write is atomic, so a run stopped at any point leaves
/// the files of its last complete round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunFolder {
    run_dir: PathBuf,
    keep_client_updates: bool,
    checkpoints_kept: Option<u32>,
    /// Client rows this process has put in `clients.csv`, which later
    /// rounds append to (none before its first write).
    clients_written: Option<usize>,
    /// The newest file of client rows this process's checkpoints wrote.
    client_rows: Option<checkpoint::ClientRowsLink>,
}

impl RunFolder {
    /// Writes into `run_dir`, which must exist.
    pub fn new(run_dir: PathBuf) -> Self {
        Self {
            run_dir,
            keep_client_updates: false,
            checkpoints_kept: None,
            clients_written: None,
            client_rows: None,
        }
    }

    /// `server.checkpoints_kept`: after each checkpoint, delete all but the
    /// newest `kept` (`None`: keep every one).
    pub fn checkpoints_kept(mut self, kept: Option<u32>) -> Self {
        self.checkpoints_kept = kept;
        self
    }

    /// The folder's recorder as the config asks: updates kept or not,
    /// checkpoints pruned or not.
    pub fn for_config(run_dir: PathBuf, config: &cohort_core::config::Config) -> Self {
        Self::new(run_dir)
            .keep_client_updates(config.results.keep_client_updates)
            .checkpoints_kept(config.server.checkpoints_kept)
    }

    /// `results.keep_client_updates`: also every update aggregated, in
    /// `updates/round-NNNN/client-CCCC.safetensors`.
    pub fn keep_client_updates(mut self, keep: bool) -> Self {
        self.keep_client_updates = keep;
        self
    }
}

impl Recorder for RunFolder {
    fn model(&mut self, _round: u32, model_bytes: &[u8]) -> anyhow::Result<()> {
        let path = self.run_dir.join(MODEL_FILE);
        atomic_write(&path, model_bytes).with_context(|| format!("cannot write {}", path.display()))
    }

    fn round(&mut self, _: &RoundRow, _: &[ClientRow], rows: &RunRows) -> anyhow::Result<()> {
        // Taken first: after a failed write the next one rewrites the file.
        let written = self.clients_written.take();
        self.clients_written =
            Some(rows.append_files(&self.run_dir, written).with_context(|| {
                format!("cannot write the results in {}", self.run_dir.display())
            })?);
        Ok(())
    }

    fn checkpoint(&mut self, state: &CheckpointState<'_>) -> anyhow::Result<Option<PathBuf>> {
        let strategy_state = state.strategy.state();
        let no_bases = std::collections::BTreeMap::new();
        let bases = state.asynchronous.map_or(&no_bases, |a| &a.bases);
        // Only the rows since the last checkpoint are written (and copied).
        let previous = self
            .client_rows
            .clone()
            .or_else(|| state.rows.checkpointed_clients.clone());
        let written = checkpoint::write_with_bases(
            &self.run_dir,
            state.model_bytes,
            History {
                format: checkpoint::FORMAT_VERSION,
                round: state.round,
                config_hash: state.config_hash.to_owned(),
                selector: state.selector,
                algorithm_state: None,
                rounds: state.rows.rounds.clone(),
                clients: checkpoint::rows_after(previous.as_ref(), &state.rows.clients).to_vec(),
                client_rows: previous,
                model_file: String::new(),
                model_sha256: String::new(),
                asynchronous: state.asynchronous.map(|a| a.history.clone()),
                selection: state.selection.clone(),
            },
            (state.strategy.name(), &strategy_state),
            bases,
        )?;
        self.client_rows = Some(written.client_rows);
        let sidecar = written.sidecar;
        if let Some(kept) = self.checkpoints_kept {
            let removed = checkpoint::prune(&self.run_dir, kept as usize)?;
            if !removed.is_empty() {
                tracing::debug!(
                    ?removed,
                    kept,
                    "older checkpoints deleted (server.checkpoints_kept)"
                );
            }
        }
        Ok(Some(sidecar))
    }

    fn updates(&mut self, round: u32, payloads: &[ReceivedPayload]) -> anyhow::Result<()> {
        if self.keep_client_updates {
            keep_updates(&self.run_dir, round, payloads)?;
        }
        Ok(())
    }

    fn keeps_updates(&self) -> bool {
        self.keep_client_updates
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
