//! Step 4 of a round: the new global model's test-set evaluation, the
//! round's rows (its own and its clients'), and the recorder.

use std::time::Instant;

use cohort_core::hooks::ClientReport;
use cohort_core::results::{ClientRow, RoundRow};
use cohort_train::task::Evaluation;

use super::{Aggregated, ClientFacts, Dispatched, Packed, RoundLoop};
use anyhow::Context;

use crate::distributed::{share_accuracy, share_scores};
use crate::events::RunEvent;
use crate::record::{federated_accuracy, slowest_client, weighted_loss};
use crate::updates::Arrival;

impl RoundLoop<'_> {
    /// The new model's test-set accuracy (rank 0's, on a follower rank),
    /// after its rows and the model reached the recorder.
    pub(super) fn evaluate_and_record(
        &mut self,
        round: u32,
        dispatched: &Dispatched,
        aggregated: Aggregated,
        packed: &Packed,
    ) -> anyhow::Result<f64> {
        let sliced = self
            .ranks
            .as_ref()
            .is_some_and(|r| r.test_batches.is_some());
        if self.ranks.as_ref().is_some_and(|r| !r.leader) {
            let accuracy = match sliced {
                true => self.evaluate_slices(round)?.accuracy,
                false => share_accuracy(&self.peers()?, None)?,
            };
            self.clock.previous_round_end = Instant::now();
            tracing::info!(round, accuracy, "round finished (rank 0 writes its rows)");
            return Ok(accuracy);
        }
        let evaluation_started = Instant::now();
        let evaluation = match sliced {
            true => self.evaluate_slices(round)?,
            false => self.evaluate(round)?,
        };
        let evaluation_time = evaluation_started.elapsed().as_secs_f64();
        self.recorder.model(round, &packed.model_bytes)?;
        let row = self.round_row(round, dispatched, &aggregated, &evaluation, evaluation_time);
        self.clock.simulated_before = row.simulated_time;
        self.clock.previous_round_end = Instant::now();
        let Aggregated {
            reports,
            arrivals,
            dropped,
            privacy,
            ..
        } = aggregated;
        let mut client_rows = client_rows(round, &reports, &arrivals, &self.clients);
        client_rows.extend(dropped.into_iter().map(|d| ClientRow {
            worker: d.worker.unwrap_or_default(),
            label_histogram: self.clients.histogram(d.client_id),
            simulated: d.simulated,
            staleness: d.staleness,
            wall: d.wall,
            dropped: Some(d.reason),
            ..ClientRow::empty(round, d.client_id)
        }));
        tracing::info!(
            round,
            accuracy = row.accuracy,
            test_loss = evaluation.loss,
            round_time = row.round_time,
            "round finished"
        );
        self.rows.push(row.clone(), client_rows);
        let clients = self.rows.clients_of(round);
        self.recorder.round(&row, clients, &self.rows)?;
        let accuracy = row.accuracy;
        self.observer
            .on_event(&RunEvent::RoundFinished { row, privacy });
        if self.ranks.is_some() && !sliced {
            share_accuracy(&self.peers()?, Some(accuracy))?;
        }
        Ok(accuracy)
    }

    fn peers(&self) -> anyhow::Result<crate::distributed::SharedCollective> {
        let ranks = self
            .ranks
            .as_ref()
            .context("evaluation across ranks without peers")?;
        Ok(ranks.peers.clone())
    }

    /// The global model on the test set, on evaluation's own threads.
    fn evaluate(&mut self, round: u32) -> anyhow::Result<Evaluation> {
        let (evaluator, global, test) = (&mut self.evaluator, &self.global, &self.test);
        let evaluation = self
            .evaluation_pool
            .install(|| evaluator.evaluate(global, test))?;
        warn_unless_finite(round, &evaluation);
        Ok(evaluation)
    }

    /// The global model on the test set, each rank scoring its slice (the
    /// loop's test set) and every rank adding all the slices' scores in batch
    /// order: the single process's evaluation, bit for bit, in a share of its
    /// time.
    fn evaluate_slices(&mut self, round: u32) -> anyhow::Result<Evaluation> {
        let ranks = self
            .ranks
            .as_ref()
            .context("evaluation across ranks without peers")?;
        let batches = ranks
            .test_batches
            .clone()
            .context("evaluation across ranks without a split of the test set")?;
        let peers = ranks.peers.clone();
        let (evaluator, global, test) = (&mut self.evaluator, &self.global, &self.test);
        let mine = self
            .evaluation_pool
            .install(|| evaluator.batch_scores(global, test))
            .map_err(|e| e.to_string());
        let evaluation = share_scores(&peers, mine, &batches)
            .with_context(|| format!("round {round}: the test set's evaluation"))?
            .finish();
        warn_unless_finite(round, &evaluation);
        Ok(evaluation)
    }

    /// `results.csv`'s row of `round`: its times, bytes, losses and
    /// accuracies.
    fn round_row(
        &self,
        round: u32,
        dispatched: &Dispatched,
        aggregated: &Aggregated,
        evaluation: &Evaluation,
        evaluation_time: f64,
    ) -> RoundRow {
        let Aggregated {
            reports,
            arrivals,
            privacy,
            ..
        } = aggregated;
        let per_client_download = dispatched.payload_bytes
            + dispatched.extra_bytes / dispatched.clients.len().max(1) as u64;
        let wall_time = &self.settings.wall_time;
        let slowest = slowest_client(reports, arrivals, per_client_download, wall_time);
        let clock = &self.clock;
        let elapsed_time = clock.elapsed_before + clock.run_started.elapsed().as_secs_f64();
        let (pass_down, pass_up) =
            super::candidates::pass_bytes(&dispatched.candidates, dispatched.payload_bytes);
        RoundRow {
            round,
            accuracy: evaluation.accuracy,
            elapsed_time,
            round_time: clock.previous_round_end.elapsed().as_secs_f64(),
            training_time: reports.iter().map(|r| r.training_time).sum(),
            evaluation_time,
            bytes_to_clients: dispatched.payload_bytes * dispatched.clients.len() as u64
                + dispatched.extra_bytes
                + pass_down,
            bytes_to_server: arrivals.iter().map(|a| a.payload_bytes).sum::<u64>() + pass_up,
            train_loss: weighted_loss(reports),
            simulated_time: match aggregated.simulated_end {
                Some(end) => end,
                None if wall_time.simulate => clock.simulated_before + slowest,
                None => elapsed_time,
            },
            extra_bytes_to_clients: dispatched.extra_bytes,
            federated_accuracy: federated_accuracy(arrivals),
            epsilon: privacy.as_ref().map(|p| p.epsilon),
            test_loss: Some(evaluation.loss).filter(|loss| loss.is_finite()),
            secagg: aggregated.secagg,
            simulated_start: aggregated.simulated_end.map(|_| dispatched.sim_start),
            candidates: dispatched.candidates.clone(),
        }
    }
}

/// A non-finite test loss is left out of `results.csv`; say so.
fn warn_unless_finite(round: u32, evaluation: &Evaluation) {
    if !evaluation.loss.is_finite() {
        tracing::warn!(
            round,
            loss = evaluation.loss,
            "the test loss is not finite; not recorded"
        );
    }
}

/// `clients.csv`'s rows of the clients whose updates arrived.
fn client_rows(
    round: u32,
    reports: &[ClientReport],
    arrivals: &[Arrival],
    clients: &ClientFacts,
) -> Vec<ClientRow> {
    reports
        .iter()
        .zip(arrivals)
        .map(|(r, arrival)| ClientRow {
            round,
            client_id: r.client_id,
            worker: r.worker,
            samples: r.num_samples,
            loss: r.loss,
            training_time: r.training_time,
            processing_time: arrival.processing_time,
            comm_time: arrival.comm_time,
            payload_bytes: arrival.payload_bytes,
            label_histogram: clients.histogram(r.client_id),
            test_accuracy: (arrival.test_samples > 0)
                .then(|| arrival.test_correct as f64 / arrival.test_samples as f64),
            dropped: None,
            simulated: arrival.simulated,
            staleness: arrival.staleness,
            wall: arrival.wall,
        })
        .collect()
}
