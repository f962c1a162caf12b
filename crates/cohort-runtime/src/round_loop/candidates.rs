//! Power-of-choice's evaluation pass (pow-d, `clients.power_of_choice.loss =
//! "evaluated"`): before a synchronous round's choice, the selector draws
//! its candidates, each computes the loss of the current global model on
//! its training data through the transport ([`Transport::local_losses`]:
//! nothing trained, nothing a task later sees changed), and the selector
//! takes the highest. The pass runs when the round is dispatched, right
//! after the previous round's aggregation, with no task in flight.
//!
//! With device profiles the pass is on the simulated clock: each candidate
//! downloads the model, runs one forward pass over its samples and uploads
//! its loss, all from the round's start; the round's tasks start when the
//! last candidate's loss has arrived, so the round's simulated duration
//! holds the pass. Every candidate's loss goes to `candidates.csv`.
//!
//! [`Transport::local_losses`]: crate::transport::Transport::local_losses

use std::sync::Arc;

use anyhow::Context;
use cohort_core::results::CandidateRow;

use super::RoundLoop;
use crate::transport::{LOCAL_LOSS_BYTES, LocalLoss};

/// The round's clients and when they start on the simulated clock.
#[derive(Debug)]
pub(crate) struct Selected {
    pub(crate) clients: Vec<u32>,
    /// The round's start.
    pub(crate) sim_start: f64,
    /// Its tasks' start: after the evaluation pass, if there was one.
    pub(crate) train_start: f64,
    pub(crate) candidates: Vec<CandidateRow>,
}

impl Selected {
    /// Clients chosen without an evaluation pass: they start with the round.
    pub(crate) fn at(clients: Vec<u32>, start: f64) -> Self {
        Self {
            clients,
            sim_start: start,
            train_start: start,
            candidates: Vec::new(),
        }
    }
}

/// Bytes the pass moved, to the clients (the model to each candidate) and
/// to the server (the answers).
pub(super) fn pass_bytes(candidates: &[CandidateRow], payload_bytes: u64) -> (u64, u64) {
    let answered = candidates.iter().filter(|c| c.failed.is_none()).count() as u64;
    (
        payload_bytes * candidates.len() as u64,
        LOCAL_LOSS_BYTES * answered,
    )
}

impl RoundLoop<'_> {
    /// pow-d's choice for `round` among `available`, starting at `start`
    /// on the simulated clock: the candidates drawn, their losses of the
    /// model in `global_payload`, the highest taken.
    pub(super) fn choose_evaluated(
        &mut self,
        round: u32,
        available: &[u32],
        start: f64,
        global_payload: &Arc<Vec<u8>>,
    ) -> anyhow::Result<Selected> {
        let count = self.settings.selection.draws as usize;
        let candidates = self.selector.draw_candidates(round, available, count);
        let answers = self
            .transport
            .local_losses(Arc::clone(global_payload), &candidates)
            .with_context(|| format!("round {round}: power-of-choice's candidates"))?;
        anyhow::ensure!(
            answers.len() == candidates.len(),
            "round {round}: {} answers for {} power-of-choice candidates",
            answers.len(),
            candidates.len()
        );
        let losses: Vec<f64> = answers
            .iter()
            .map(|answer| answer.as_ref().map_or(f64::NEG_INFINITY, |l| l.loss))
            .collect();
        let clients = self.selector.choose(&candidates, &losses, count);
        tracing::info!(round, candidates = ?candidates, losses = ?losses, chosen = ?clients, "power-of-choice candidates evaluated");
        let payload_bytes = global_payload.len() as u64;
        let mut train_start = start;
        let mut rows = Vec::with_capacity(candidates.len());
        for (&client, answer) in candidates.iter().zip(answers) {
            let row = self.candidate_row(round, client, answer, start, payload_bytes);
            if let Some(task) = row.simulated {
                train_start = train_start.max(task.end());
            }
            rows.push(CandidateRow {
                selected: clients.contains(&client),
                ..row
            });
        }
        Ok(Selected {
            clients,
            sim_start: start,
            train_start,
            candidates: rows,
        })
    }

    /// `candidates.csv`'s row of `client`'s answer, timed from `start`
    /// where the run simulates devices (a failed evaluation still took
    /// the model down and ran).
    fn candidate_row(
        &self,
        round: u32,
        client: u32,
        answer: Result<LocalLoss, String>,
        start: f64,
        payload_bytes: u64,
    ) -> CandidateRow {
        let samples = (client as usize)
            .checked_sub(1)
            .and_then(|index| self.clients.expected.get(index))
            .map_or(0, |expected| expected.train_samples);
        let simulated = self
            .devices
            .as_ref()
            .and_then(|devices| devices.evaluation(client, start, payload_bytes, samples));
        let (loss, failed) = match answer {
            Ok(local) => (local.loss, None),
            Err(reason) => {
                tracing::warn!(
                    round,
                    client,
                    "power-of-choice candidate's evaluation failed, ranked last: {reason}"
                );
                (f64::NEG_INFINITY, Some(reason))
            }
        };
        CandidateRow {
            client_id: client,
            samples,
            loss,
            selected: false,
            simulated,
            failed,
        }
    }
}
