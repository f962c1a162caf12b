//! Step 3 of a round under secure aggregation (simulation mode): the
//! round's checked updates go through the SecAgg(+) protocol in process
//! ([`cohort_core::secagg::secure_mean`]), every message encoded and
//! counted, and the strategy steps from the unmasked mean alone
//! ([`Strategy::aggregate_mean`]). No client's update reaches the hooks,
//! the recorder or the strategy; the round's costs go to `secagg.csv`.
//!
//! A round whose protocol aborts (fewer than the threshold of a client's
//! neighbours left) keeps the global model, as a refused aggregate does, and
//! the run goes on; fewer contributors than `clients.min_per_round` stop
//! the run, as too few updates do.
//!
//! [`Strategy::aggregate_mean`]: cohort_core::strategy::Strategy::aggregate_mean

use cohort_core::results::SecAggRow;
use cohort_core::secagg::{self, Params, SecureMean};
use cohort_core::seeds::derive_seed;
use cohort_core::strategy::{ClientUpdate, StrategyState};

use super::{Aggregated, RoundLoop};
use crate::events::RunEvent;
use crate::updates::{Arrived, Collected, Dropped};

/// What the loop needs of `[secure_aggregation]`, as plain values.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SecureSettings {
    /// The protocol's parameters for a round of `clients.per_round`.
    pub(crate) params: Params,
    /// The stream every round's keys, graph and rounding are drawn from.
    pub(crate) seed: u64,
    /// The fraction of each round's clients that vanish mid-protocol.
    pub(crate) simulated_dropout: f64,
}

impl RoundLoop<'_> {
    /// The round's mean through the protocol, then the strategy's step.
    pub(super) fn aggregate_securely(
        &mut self,
        round: u32,
        selected: &[u32],
        mut collected: Collected,
        secure: &SecureSettings,
    ) -> anyhow::Result<Aggregated> {
        let mut dropped = std::mem::take(&mut collected.failures);
        let arrived = std::mem::take(&mut collected.updates);
        let simulated_end = collected.simulated_end;
        let ids: Vec<u32> = arrived.iter().map(|a| a.report.client_id).collect();
        let vanish = secagg::draw_dropouts(
            &ids,
            secure.simulated_dropout,
            derive_seed(secure.seed, "secagg-dropout", &[u64::from(round)]),
        );
        let updates: Vec<ClientUpdate<'_>> = arrived.iter().map(client_update).collect();
        let outcome = secagg::secure_mean(
            &secure.params,
            &self.global,
            selected,
            &updates,
            &vanish,
            derive_seed(secure.seed, "secagg", &[u64::from(round)]),
        );
        drop(updates);
        let secure_round = match outcome {
            Ok(secure_round) => secure_round,
            Err(error) => {
                let left = arrived.len().saturating_sub(vanish.len());
                return self
                    .secure_round_failed(round, selected, left, arrived, dropped, &error)
                    .map(|failed| Aggregated {
                        simulated_end,
                        ..failed
                    });
            }
        };
        let row = secagg_row(selected.len(), &secure_round);
        let (kept, left) = split_contributors(arrived, &secure_round.contributors);
        for (arrived, reason) in left.into_iter().map(|a| {
            let reason = reason_of(&secure_round, a.report.client_id);
            (a, reason)
        }) {
            self.drop_update(round, &arrived, "secure aggregation", reason, &mut dropped);
        }
        self.require_min(round, kept.len(), selected.len(), &dropped)?;
        tracing::info!(
            round,
            contributors = kept.len(),
            bytes_up = row.advertise_up + row.share_up + row.input_up + row.unmask_up,
            bytes_down = row.share_down + row.input_down + row.unmask_down,
            client_seconds = row.client_time,
            server_seconds = row.server_time,
            "secure aggregation"
        );
        let before: StrategyState = self.strategy.state();
        let aggregated =
            self.strategy
                .aggregate_mean(&self.context(round), &self.global, secure_round.mean);
        let outcome = self.adopt(round, aggregated, before)?;
        let (reports, arrivals) = kept.into_iter().map(|a| (a.report, a.arrival)).unzip();
        Ok(Aggregated {
            reports,
            arrivals,
            dropped,
            privacy: outcome.privacy,
            secagg: Some(row),
            simulated_end,
        })
    }

    /// The protocol aborted with `left` clients still in it. Fewer than
    /// `clients.min_per_round` stop the run; otherwise the model and the
    /// strategy stay as they were, the round's clients are recorded as
    /// trained, and the run goes on.
    fn secure_round_failed(
        &mut self,
        round: u32,
        selected: &[u32],
        left: usize,
        arrived: Vec<Arrived>,
        dropped: Vec<Dropped>,
        error: &secagg::SecureRoundError,
    ) -> anyhow::Result<Aggregated> {
        let min_per_round = self.settings.min_per_round;
        if left < min_per_round {
            anyhow::bail!(
                "round {round}: {error}; {left} of {} clients were left in secure aggregation, \
                 and clients.min_per_round = {min_per_round}; the global model stays at round {}",
                selected.len(),
                round.saturating_sub(1)
            );
        }
        let reason = format!(
            "{error}; the global model stays at round {}",
            round.saturating_sub(1)
        );
        tracing::warn!(round, "secure aggregation failed: {reason}");
        self.observer
            .on_event(&RunEvent::ModelKept { round, reason });
        let (reports, arrivals) = arrived.into_iter().map(|a| (a.report, a.arrival)).unzip();
        Ok(Aggregated {
            reports,
            arrivals,
            dropped,
            privacy: None,
            secagg: Some(SecAggRow {
                selected: selected.len() as u32,
                ..SecAggRow::default()
            }),
            simulated_end: None,
        })
    }
}

fn client_update(arrived: &Arrived) -> ClientUpdate<'_> {
    ClientUpdate {
        client_id: arrived.report.client_id,
        num_samples: arrived.report.num_samples,
        local_steps: arrived.report.local_steps,
        tree: &arrived.tree,
    }
}

/// The arrived updates in the sum, and the others, each in arrival order.
fn split_contributors(arrived: Vec<Arrived>, contributors: &[u32]) -> (Vec<Arrived>, Vec<Arrived>) {
    arrived
        .into_iter()
        .partition(|a| contributors.binary_search(&a.report.client_id).is_ok())
}

/// Why `client` is not in the sum.
fn reason_of(round: &SecureMean, client: u32) -> String {
    round
        .dropped
        .iter()
        .filter(|(id, _)| *id == client)
        .map(|(_, reason)| reason.as_str())
        .collect::<Vec<_>>()
        .join("; ")
}

fn secagg_row(selected: usize, round: &SecureMean) -> SecAggRow {
    let b = &round.bytes;
    SecAggRow {
        selected: selected as u32,
        contributors: round.contributors.len() as u32,
        advertise_up: b.advertise_keys.up,
        share_down: b.share_keys.down,
        share_up: b.share_keys.up,
        input_down: b.masked_input.down,
        input_up: b.masked_input.up,
        unmask_down: b.unmask.down,
        unmask_up: b.unmask.up,
        client_time: round.timings.clients.as_secs_f64(),
        server_time: round.timings.server.as_secs_f64(),
    }
}
