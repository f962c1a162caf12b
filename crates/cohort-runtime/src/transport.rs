//! How the server reaches its clients. The round loop sees only [`Transport`]:
//! hand out a round's tasks with the packed global model, then collect one
//! [`ClientOutcome`] per task, in whatever order they finish. Two transports
//! implement it:
//!
//! * [`crate::pool::WorkerPool`]: `clients.comm_simulation = true`, the
//!   clients run on worker threads of this process;
//! * [`crate::grpc::GrpcTransport`]: `comm_simulation = false`, the clients are
//!   separate `cohort client` processes, on this machine or others.
//!
//! Both move the same bytes (the configured processor pipelines run on both
//! sides either way), so byte counts and processing costs are real in the
//! simulation too.

use std::sync::Arc;

use cohort_train::trainer::ClientTask;

use crate::client::ClientReply;

/// One logical client's task in a round.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskSpec {
    /// Position in the round's selection order.
    pub slot: usize,
    pub task: ClientTask,
    pub instructions: TaskInstructions,
}

/// A strategy's [`cohort_core::strategy::ClientInstructions`] as they travel:
/// the numbers as they are, the correction tree as plain safetensors bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskInstructions {
    pub learning_rate: f64,
    pub proximal_mu: f64,
    pub update_clip_norm: Option<f64>,
    pub correction: Option<Arc<Vec<u8>>>,
}

impl TaskInstructions {
    /// Encodes the strategy's instructions for the wire.
    pub fn encode(
        instructions: cohort_core::strategy::ClientInstructions,
    ) -> Result<Self, cohort_core::codec::CodecError> {
        Ok(Self {
            learning_rate: instructions.learning_rate,
            proximal_mu: instructions.proximal_mu,
            update_clip_norm: instructions.update_clip_norm,
            correction: instructions
                .gradient_correction
                .as_ref()
                .map(cohort_core::codec::encode)
                .transpose()?
                .map(Arc::new),
        })
    }

    /// Plain training at `learning_rate`.
    pub fn plain(learning_rate: f64) -> Self {
        Self {
            learning_rate,
            proximal_mu: 0.0,
            update_clip_norm: None,
            correction: None,
        }
    }

    /// Whether a client can train by these numbers: a server (or anyone who
    /// speaks for one) could send a NaN or negative learning rate, μ or clip
    /// norm, and the client would train on it and send back garbage. The
    /// reason names the field, its value and what was expected.
    ///
    /// A learning rate of exactly 0 is allowed: a cosine schedule ends at
    /// `trainer.lr_min`, which is 0 by default.
    pub fn check(&self) -> Result<(), String> {
        let fields = [
            (
                "learning_rate",
                self.learning_rate,
                self.learning_rate >= 0.0,
                "a finite number >= 0",
            ),
            (
                "proximal_mu",
                self.proximal_mu,
                self.proximal_mu >= 0.0,
                "a finite number >= 0",
            ),
        ]
        .into_iter()
        .chain(self.update_clip_norm.map(|clip| {
            (
                "update_clip_norm",
                clip,
                clip > 0.0,
                "a finite number > 0 when present",
            )
        }));
        for (field, value, in_range, expected) in fields {
            if !(value.is_finite() && in_range) {
                return Err(format!(
                    "the task's `{field}` is {}; expected {expected}",
                    cohort_core::number::shown(value)
                ));
            }
        }
        Ok(())
    }

    /// Bytes beside the global model (the correction).
    pub fn extra_bytes(&self) -> u64 {
        self.correction.as_ref().map_or(0, |c| c.len() as u64)
    }
}

/// A task's result as the server sees it.
#[derive(Debug)]
pub struct ClientOutcome {
    pub slot: usize,
    pub task: ClientTask,
    /// The physical worker that ran it.
    pub worker: usize,
    pub result: Result<Delivered, String>,
}

/// A reply that reached the server.
#[derive(Debug)]
pub struct Delivered {
    pub reply: ClientReply,
    /// Seconds on the wire: the task's round trip as the server measured it,
    /// less the client's own training and processing time. 0 in process.
    pub comm_time: f64,
    /// What the client declared when it registered, for an own-data client
    /// (`cohort client --data`); `None` for clients whose partition the
    /// server computed.
    pub declared: Option<Declared>,
}

/// An own-data client's declaration at registration: the most its reports
/// may claim. Bounded by `clients.max_samples` before it is accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Declared {
    pub train_samples: u64,
    pub test_samples: u64,
}

/// Longest failure reason kept from a client or a rank: a reason lands in
/// the log, `clients.csv` and every later checkpoint sidecar, so a peer's
/// megabytes of text would grow each of them round after round.
pub const MAX_REASON_BYTES: usize = 4096;

/// The longest prefix of `text` of at most `max` bytes that ends on a
/// character boundary: for peer-sent text that is logged or kept, where
/// slicing at `max` itself could split a character and panic.
pub(crate) fn truncated(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// One secure-aggregation stage message for a logical client, to the worker
/// process that trained it (network mode).
#[derive(Debug, Clone, PartialEq)]
pub struct StageMessage {
    pub client_id: u32,
    pub worker: usize,
    /// The stage's message, encoded by `cohort_core::secagg::wire`.
    pub body: Vec<u8>,
}

/// How long a stage waits and how much one answer may hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageBounds {
    pub timeout: std::time::Duration,
    pub max_answer_bytes: usize,
}

/// Each client's answer to a stage message, or why none came.
pub type StageAnswers = Vec<(u32, Result<Vec<u8>, String>)>;

/// A client's loss of a global model on its training data, trained on
/// nothing (power-of-choice's candidates, `clients.power_of_choice.loss =
/// "evaluated"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalLoss {
    /// Output rows scored: the samples of its partition for classification.
    pub rows: u64,
    /// The mean loss over them.
    pub loss: f64,
}

/// Bytes a candidate sends back with its loss: the loss and its rows.
pub const LOCAL_LOSS_BYTES: u64 = 16;

pub trait Transport {
    /// Starts `tasks`; each client receives `global_payload` (the global model
    /// after `server.outbound_processors`).
    fn dispatch(
        &mut self,
        global_payload: Arc<Vec<u8>>,
        tasks: Vec<TaskSpec>,
    ) -> anyhow::Result<()>;

    /// The next finished task of those dispatched. Errors only when the
    /// transport itself is broken; a failed client is an `Err` result inside
    /// the outcome.
    fn next_outcome(&mut self) -> anyhow::Result<ClientOutcome>;

    /// Drops tasks not yet started (the run is stopping early).
    fn cancel(&mut self);

    /// Has each of `clients` compute the loss of the global model in
    /// `global_payload` on its training data, without training and without
    /// changing anything a task later sees; one answer per client, in the
    /// order of `clients`, each the loss or why there is none. Called
    /// between rounds, with no task in flight.
    fn local_losses(
        &mut self,
        global_payload: Arc<Vec<u8>>,
        clients: &[u32],
    ) -> anyhow::Result<Vec<Result<LocalLoss, String>>> {
        let _ = (global_payload, clients);
        anyhow::bail!(
            "this transport cannot have clients evaluate the global model, which \
             clients.power_of_choice.loss = \"evaluated\" needs (only the simulation's worker \
             pool can); set it to \"last_reported\""
        )
    }

    /// Sends one secure-aggregation stage's messages and waits, within
    /// `bounds`, for each client's answer. Only a transport whose clients
    /// are processes of their own has stages: in process, the round loop
    /// runs the protocol itself.
    fn secure_stage(
        &mut self,
        round: u32,
        stage: cohort_core::secagg::sim::Stage,
        messages: Vec<StageMessage>,
        bounds: StageBounds,
    ) -> anyhow::Result<StageAnswers> {
        let _ = (round, stage, messages, bounds);
        anyhow::bail!("this transport has no secure-aggregation stages (network mode only)")
    }
}

#[cfg(test)]
mod tests {
    use super::{TaskInstructions, truncated};

    #[test]
    fn instructions_a_client_cannot_train_by_are_refused_naming_field_and_value() {
        let good = TaskInstructions {
            learning_rate: 0.05,
            proximal_mu: 0.01,
            update_clip_norm: Some(1.0),
            correction: None,
        };
        assert_eq!(good.check(), Ok(()));
        // The last round of a cosine schedule to lr_min = 0.
        assert_eq!(TaskInstructions::plain(0.0).check(), Ok(()));
        let cases = [
            (
                TaskInstructions::plain(f64::NAN),
                "the task's `learning_rate` is NaN; expected a finite number >= 0",
            ),
            (
                TaskInstructions::plain(-0.1),
                "the task's `learning_rate` is -0.1; expected a finite number >= 0",
            ),
            (
                TaskInstructions::plain(f64::INFINITY),
                "the task's `learning_rate` is inf; expected a finite number >= 0",
            ),
            (
                TaskInstructions {
                    proximal_mu: -1.0,
                    ..good.clone()
                },
                "the task's `proximal_mu` is -1; expected a finite number >= 0",
            ),
            (
                TaskInstructions {
                    proximal_mu: f64::NAN,
                    ..good.clone()
                },
                "the task's `proximal_mu` is NaN; expected a finite number >= 0",
            ),
            (
                TaskInstructions {
                    update_clip_norm: Some(0.0),
                    ..good.clone()
                },
                "the task's `update_clip_norm` is 0; expected a finite number > 0 when present",
            ),
            (
                TaskInstructions {
                    update_clip_norm: Some(f64::NAN),
                    ..good.clone()
                },
                "the task's `update_clip_norm` is NaN; expected a finite number > 0 when present",
            ),
            (
                TaskInstructions {
                    update_clip_norm: Some(-1e-310),
                    ..good.clone()
                },
                "the task's `update_clip_norm` is -1e-310; expected a finite number > 0 when \
                 present",
            ),
        ];
        for (instructions, reason) in cases {
            assert_eq!(instructions.check(), Err(reason.to_owned()));
        }
    }

    #[test]
    fn truncation_never_splits_a_character() {
        // 'é' is 2 bytes, '€' 3, '𝄞' 4: a cut inside each falls back to the
        // boundary before it.
        assert_eq!(truncated("abc", 10), "abc");
        assert_eq!(truncated("abc", 3), "abc");
        assert_eq!(truncated("abc", 0), "");
        assert_eq!(truncated("aé", 2), "a");
        assert_eq!(truncated("aé", 3), "aé");
        assert_eq!(truncated("€€", 5), "€");
        for max in 0..4 {
            assert_eq!(truncated("𝄞x", max), "");
        }
        assert_eq!(truncated("𝄞x", 4), "𝄞");
        let mixed = "a€𝄞é".repeat(100);
        for max in 0..=mixed.len() + 1 {
            let cut = truncated(&mixed, max);
            assert!(cut.len() <= max && mixed.starts_with(cut));
            assert!(
                max > mixed.len() || max - cut.len() < 4,
                "{max}: {}",
                cut.len()
            );
        }
    }
}
