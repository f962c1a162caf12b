//! What a run tells whoever embeds it: structured events, in the order they
//! happen, to a [`RunObserver`] the caller chooses.
//!
//! The library never prints. The `cohort` command renders its banner,
//! progress bar and round lines from these events; an embedding program can
//! plot, stream or stop on them instead. Logging through `tracing` (run.log)
//! is separate and unchanged: events are for the caller, the log is for the
//! record.

use std::path::PathBuf;

use cohort_core::results::RoundRow;
use cohort_core::strategy::PrivacySpent;

/// The facts of a run before its first round: what the `cohort` banner
/// shows.
#[derive(Debug, Clone, PartialEq)]
pub struct RunFacts {
    /// The config file, as the run read it.
    pub config: PathBuf,
    pub run_dir: PathBuf,
    /// The round a resumed run continues at; `None` for a fresh run.
    pub resumed_at: Option<u32>,
    pub strategy: String,
    /// The first round this process runs and the last of the run.
    pub first_round: u32,
    pub last_round: u32,
    pub per_round: u32,
    pub total_clients: u32,
    /// Where the data comes from and how it is partitioned, in words.
    pub data: String,
    /// The compute device and the workers on it, in words.
    pub device: String,
    /// How the clients run (in process, gRPC, ranks), in words.
    pub execution: String,
    /// Whether this process evaluates and writes the run's files: the only
    /// process, or rank 0 of a distributed simulation.
    pub leader: bool,
}

/// One thing that happened in a run.
#[derive(Debug, Clone, PartialEq)]
pub enum RunEvent {
    /// Everything is built; round `facts.first_round` is about to start.
    RunStarted(RunFacts),
    /// A network-mode server is listening for client processes.
    Listening { address: std::net::SocketAddr },
    /// Before round 1, a network-mode server's count of registered clients
    /// changed (and once when it starts waiting): `processes` of the
    /// `expected` ordinary client processes are in, and `own_data_missing`
    /// own-data clients are still to claim their ids.
    Registered {
        processes: usize,
        expected: usize,
        own_data_missing: usize,
    },
    /// The loop waits for the outcomes of `clients` tasks of `round`.
    RoundStarted { round: u32, clients: usize },
    /// One client's update arrived (it may still be refused by the checks).
    ClientFinished { round: u32, client_id: u32 },
    /// A client is out of its round: it failed, timed out, sent bytes that do
    /// not unpack, or an update the server's checks refused.
    ClientDropped {
        round: u32,
        client_id: u32,
        reason: String,
    },
    /// The round's aggregated model was refused (not finite): the global
    /// model and the strategy's state stay as they were before the round.
    ModelKept { round: u32, reason: String },
    /// A round is aggregated, evaluated and recorded (rank 0 only).
    RoundFinished {
        row: RoundRow,
        privacy: Option<PrivacySpent>,
    },
    /// A checkpoint of `round` is complete on disk.
    CheckpointWritten { round: u32, sidecar: PathBuf },
    /// The loop is done: `rounds` rows recorded in all (resumed ones too).
    RunFinished { rounds: usize, reached_target: bool },
}

/// Receives a run's events. Called on the round loop's thread, between
/// steps: a slow observer slows the loop, never corrupts it.
pub trait RunObserver {
    fn on_event(&mut self, event: &RunEvent);

    /// Whether the run should stop once the round in progress is recorded
    /// (a Ctrl-C seen by an embedding program, a callback that failed). The
    /// loop asks after each round's row is recorded; it then checkpoints
    /// that round whatever `server.checkpoint_interval` says, drops the
    /// next round's work (an asynchronous run's tasks in flight, which the
    /// checkpoint holds and `--resume` sends again), and ends with
    /// [`Stopped`], so `--resume`
    /// continues at the next round. Never by default.
    fn stop_requested(&self) -> bool {
        false
    }
}

/// How a run that an observer stopped ends: `round` is the last round
/// recorded and checkpointed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the run was stopped after round {round}; resume it to continue")]
pub struct Stopped {
    pub round: u32,
}

/// Any closure over events is an observer.
impl<F: FnMut(&RunEvent)> RunObserver for F {
    fn on_event(&mut self, event: &RunEvent) {
        self(event)
    }
}

/// Discards every event: a run nobody watches.
#[derive(Debug, Default, Clone, Copy)]
pub struct Unobserved;

impl RunObserver for Unobserved {
    fn on_event(&mut self, _: &RunEvent) {}
}

/// The round's line as the `cohort` command prints it (and the tests read).
pub fn round_summary(row: &RoundRow, privacy: Option<&PrivacySpent>) -> String {
    format!(
        "round {:>3}: accuracy {:.4}{}, loss {:.4}, {:.2}s{}",
        row.round,
        row.accuracy,
        row.federated_accuracy
            .map_or(String::new(), |federated| format!(
                " (on the clients' own test data {federated:.4})"
            )),
        row.train_loss,
        row.round_time,
        privacy.map_or(String::new(), |p| format!(
            ", ε = {:.3} (δ = {})",
            p.epsilon, p.delta
        )),
    )
}

impl RunFacts {
    /// The banner's lines.
    pub fn banner(&self) -> Vec<String> {
        let start = match self.resumed_at {
            Some(round) => format!(" (resumed at round {round})"),
            None => String::new(),
        };
        vec![
            format!(
                "cohort: {} → {}{start}",
                self.config.display(),
                self.run_dir.display()
            ),
            format!(
                "  strategy  {}, {} rounds, {} of {} clients per round",
                self.strategy, self.last_round, self.per_round, self.total_clients
            ),
            format!("  data      {}", self.data),
            format!("  device    {}", self.device),
            format!("  backend   {}", self.execution),
        ]
    }
}
