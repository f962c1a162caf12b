//! Step 3 of a round under secure aggregation. In simulation mode the
//! round's checked updates go through the SecAgg(+) protocol in process
//! ([`cohort_core::secagg::secure_mean`]), every message encoded and
//! counted. In network mode the updates never reach this process: the
//! clients whose report arrived and passed its checks mask their own
//! updates, and the stages go over the transport to the processes that
//! trained them ([`network::serve_round`]), after the round's reports, on
//! the graph of the selected clients (a client whose report is missing
//! drops out at the setup; one that leaves later is handled as the
//! protocol says). Either way
//! the strategy steps from the unmasked mean alone
//! ([`Strategy::aggregate_mean`]); no client's update reaches the hooks,
//! the recorder or the strategy; the round's costs go to `secagg.csv`.
//!
//! With `secure_aggregation.noise` each client adds its share of discrete
//! Gaussian noise before masking and the mean is decoded from the modular
//! sum ([`cohort_core::secagg::ddg`]); each round is accounted with the
//! clients in its sum, and ε so far goes to the round's row.
//!
//! A round whose protocol aborts (fewer than the threshold of a client's
//! neighbours left) keeps the global model, as a refused aggregate does, and
//! the run goes on if `clients.min_per_round` clients were still in the
//! protocol; fewer stop the run, as too few updates do.
//!
//! [`Strategy::aggregate_mean`]: cohort_core::strategy::Strategy::aggregate_mean

use cohort_core::results::SecAggRow;
use cohort_core::secagg::network::{self, Exchange};
use cohort_core::secagg::sim::{Stage, Timings};
use cohort_core::secagg::{
    self, ClientId, Ddg, DdgParams, DdgSeeds, Params, SecureMean, SecureRoundError, ddg,
};
use cohort_core::seeds::derive_seed;
use cohort_core::strategy::{ClientUpdate, PrivacySpent, StrategyState};

use super::{Aggregated, RoundLoop};
use crate::events::RunEvent;
use crate::transport::{StageBounds, StageMessage, Transport};
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
    /// Network mode: the clients mask their own updates and the stages go
    /// over the transport, each waiting at most this long
    /// (`secure_aggregation.timeout`); `None`: simulation, in process.
    pub(crate) network: Option<std::time::Duration>,
    /// Distributed discrete Gaussian noise, added by each client before
    /// masking (`secure_aggregation.noise`); `None`: no noise.
    pub(crate) noise: Option<DdgParams>,
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
        let ddg = match &secure.noise {
            Some(noise) => Some(
                secagg::resolve_ddg(noise, &secure.params, &self.global)
                    .map_err(|e| anyhow::anyhow!("secure_aggregation.noise: {e}"))?,
            ),
            None => None,
        };
        let outcome = match secure.network {
            Some(timeout) => {
                self.mean_over_network(round, selected, &arrived, secure, ddg.as_ref(), timeout)
            }
            None => self.mean_in_process(round, selected, &arrived, secure, ddg.as_ref()),
        };
        let secure_round = match outcome {
            Ok(secure_round) => secure_round,
            Err((error, left)) => {
                // An aborted round released nothing: ε stays where it was.
                let privacy = ddg.as_ref().map(|d| self.privacy_so_far(d));
                return self
                    .secure_round_failed(round, selected, left, arrived, dropped, &error)
                    .map(|failed| Aggregated {
                        simulated_end,
                        privacy,
                        ..failed
                    });
            }
        };
        // The sum is out once unmasked, whatever the strategy makes of it:
        // the round is accounted with the clients actually in it.
        let spent = ddg.as_ref().map(|d| {
            self.ddg_spent.record(d, secure_round.contributors.len());
            self.privacy_so_far(d)
        });
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
            privacy: spent.or(outcome.privacy),
            secagg: Some(row),
            simulated_end,
        })
    }

    /// ε so far under distributed noise, for the mechanism's δ.
    fn privacy_so_far(&self, ddg: &Ddg) -> PrivacySpent {
        PrivacySpent {
            epsilon: self.ddg_spent.epsilon(ddg.delta),
            delta: ddg.delta,
        }
    }

    /// Simulation mode: the protocol in process over the round's updates
    /// (each client's noise added in process when `ddg` is set, drawn from
    /// the run's seed so that a run repeats bit for bit); on an abort, the
    /// error and how many clients were still in it.
    fn mean_in_process(
        &self,
        round: u32,
        selected: &[u32],
        arrived: &[Arrived],
        secure: &SecureSettings,
        ddg: Option<&Ddg>,
    ) -> Result<SecureMean, (SecureRoundError, usize)> {
        let ids: Vec<u32> = arrived.iter().map(|a| a.report.client_id).collect();
        let vanish = secagg::draw_dropouts(
            &ids,
            secure.simulated_dropout,
            derive_seed(secure.seed, "secagg-dropout", &[u64::from(round)]),
        );
        let updates: Vec<ClientUpdate<'_>> = arrived.iter().map(client_update).collect();
        let seed = derive_seed(secure.seed, "secagg", &[u64::from(round)]);
        match ddg {
            Some(ddg) => {
                let seeds = DdgSeeds {
                    protocol: seed,
                    rotation: ddg::rotation_seed(secure.seed, round),
                    noise: derive_seed(secure.seed, "ddg-noise", &[u64::from(round)]),
                };
                let (params, global) = (&secure.params, &self.global);
                secagg::secure_ddg_mean(params, ddg, global, selected, &updates, &vanish, seeds)
            }
            None => secagg::secure_mean(
                &secure.params,
                &self.global,
                selected,
                &updates,
                &vanish,
                seed,
            ),
        }
        .map_err(|error| (error, arrived.len().saturating_sub(vanish.len())))
    }

    /// Network mode: the stages over the transport with the client
    /// processes that trained the round's arrived clients, each of which
    /// masks its own update; the server sees only the unmasked sum. The
    /// round's graph is over every selected client, as in simulation mode,
    /// so both modes draw the same graph; a selected client whose update
    /// did not arrive drops out at the setup.
    fn mean_over_network(
        &mut self,
        round: u32,
        selected: &[u32],
        arrived: &[Arrived],
        secure: &SecureSettings,
        ddg: Option<&Ddg>,
        timeout: std::time::Duration,
    ) -> Result<SecureMean, (SecureRoundError, usize)> {
        // With noise the clients mask the rotated, padded vector.
        let dimension = match ddg {
            Some(ddg) => ddg.padded,
            None => secagg::masked_len(&self.global).map_err(|e| (e, 0))?,
        };
        let mut ids: Vec<u64> = selected.iter().map(|&id| u64::from(id)).collect();
        ids.sort_unstable();
        let workers = arrived
            .iter()
            .map(|a| (a.report.client_id, a.report.worker))
            .collect();
        let max_peers = secure.params.shares_for(ids.len());
        let mut exchange = NetworkExchange {
            transport: self.transport.as_mut(),
            round,
            workers,
            timeout,
            max_peers,
            dimension,
            broken: None,
        };
        let started = std::time::Instant::now();
        let served = network::serve_round(
            &secure.params,
            &ids,
            dimension,
            derive_seed(secure.seed, "secagg", &[u64::from(round)]),
            &mut exchange,
            &mut network::fresh_rng(),
        );
        if let Some(error) = exchange.broken.take() {
            tracing::error!(round, "secure aggregation: the transport failed: {error:#}");
        }
        let served = match served {
            Ok(served) => served,
            Err(aborted) => {
                for (client, reason) in &aborted.left {
                    tracing::warn!(round, client, "secure aggregation: {reason}");
                }
                let error = SecureRoundError::Protocol(aborted.error);
                return Err((error, aborted.alive));
            }
        };
        let output = served.output;
        for (client, reason) in &served.left {
            // Those out of the sum are logged as dropped by the caller; one
            // that left after its masked input is still in it.
            if output.contributors.contains(client) {
                tracing::warn!(
                    round,
                    client,
                    "secure aggregation: {reason}; its input is in the sum"
                );
            }
        }
        let contributors = output.contributors.len();
        let (mean, total_weight) = self
            .mean_of_output(&output, ddg, secure.seed, round)
            .map_err(|e| (e, contributors))?;
        let mut dropped: Vec<(u32, String)> = served
            .left
            .into_iter()
            .map(|(id, reason)| (id as u32, reason))
            .collect();
        dropped.sort_by_key(|(id, _)| *id);
        Ok(SecureMean {
            mean,
            total_weight,
            contributors: output.contributors.iter().map(|&id| id as u32).collect(),
            dropped,
            bytes: served.bytes,
            timings: Timings {
                // The clients' compute is in their own processes: unmeasured.
                clients: std::time::Duration::ZERO,
                server: started.elapsed(),
            },
        })
    }

    /// The mean and the total weight from a network round's unmasked sum:
    /// with noise, decoded (every contributor weighs 1); without, dequantised.
    fn mean_of_output(
        &self,
        output: &secagg::server::ServerOutput,
        ddg: Option<&Ddg>,
        seed: u64,
        round: u32,
    ) -> Result<(Option<cohort_core::tree::ParamTree>, f64), SecureRoundError> {
        let contributors = output.contributors.len();
        match ddg {
            Some(ddg) => {
                let rotation = ddg::rotation_seed(seed, round);
                let mean = secagg::ddg_mean_of_sum(
                    ddg,
                    &self.global,
                    &output.sum,
                    contributors,
                    rotation,
                )?;
                Ok((mean, contributors as f64))
            }
            None => {
                let mean =
                    secagg::mean_of_sum(&self.global, &output.weighted_sum, output.total_weight)?;
                Ok((mean, output.total_weight))
            }
        }
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

/// One round's stages over the transport: each message to the process that
/// trained its client. A transport that fails outright answers every
/// client with its error, so the round aborts rather than the run.
struct NetworkExchange<'t> {
    transport: &'t mut dyn Transport,
    round: u32,
    workers: std::collections::BTreeMap<u32, usize>,
    timeout: std::time::Duration,
    max_peers: usize,
    dimension: usize,
    broken: Option<anyhow::Error>,
}

impl Exchange for NetworkExchange<'_> {
    fn exchange(
        &mut self,
        stage: Stage,
        messages: Vec<(ClientId, Vec<u8>)>,
    ) -> Vec<(ClientId, Result<Vec<u8>, String>)> {
        let ids: Vec<ClientId> = messages.iter().map(|(id, _)| *id).collect();
        let mut absent = Vec::new();
        let mut routed = Vec::with_capacity(messages.len());
        for (id, body) in messages {
            let worker = u32::try_from(id)
                .ok()
                .and_then(|client_id| Some((client_id, *self.workers.get(&client_id)?)));
            match worker {
                Some((client_id, worker)) => routed.push(StageMessage {
                    client_id,
                    worker,
                    body,
                }),
                None => absent.push((
                    id,
                    Err("its update did not arrive, so it has nothing to mask".to_owned()),
                )),
            }
        }
        let bounds = StageBounds {
            timeout: self.timeout,
            max_answer_bytes: network::max_answer_bytes(stage, self.max_peers, self.dimension),
        };
        match self
            .transport
            .secure_stage(self.round, stage, routed, bounds)
        {
            Ok(answers) => answers
                .into_iter()
                .map(|(id, answer)| (u64::from(id), answer))
                .chain(absent)
                .collect(),
            Err(error) => {
                let reason = format!("the transport failed: {error:#}");
                self.broken = Some(error);
                ids.into_iter()
                    .map(|id| (id, Err(reason.clone())))
                    .collect()
            }
        }
    }
}
