//! Simulated devices in a round (`[clients.profile]`, `[clients.availability]`):
//! each task's timing from its client's profile and the bytes and samples it
//! moved, never from the measured times; a client that goes offline before
//! its update arrives is lost to the round; a round draws among the clients
//! online when it starts. Power-of-choice's evaluation pass, where the run
//! has one, comes first: the round's tasks start when it has ended.

use std::sync::Arc;

use cohort_core::clock::{TaskEnd, Verdict, close_round};
use cohort_core::devices::{Availability, OnlineIndex, Profiles, TaskTiming};
use cohort_core::results::SimulatedTask;

use super::{Dispatched, RoundLoop, Selected};
use crate::updates::Collected;

/// The devices of a run, built by the assembly from the config's profile
/// and availability.
#[derive(Debug, Clone)]
pub(crate) struct SimDevices {
    pub(crate) profiles: Profiles,
    pub(crate) availability: Availability,
    /// Whether the availability is other than always (selection then draws
    /// among the clients online).
    pub(crate) intermittent: bool,
    pub(crate) epochs: u32,
    /// Who is online as the clock moves, for the questions of every event.
    pub(crate) online: OnlineIndex,
}

impl SimDevices {
    /// `client`'s task from `start`: `download` bytes down, `samples` to
    /// train on, `upload` bytes up.
    pub(crate) fn task(
        &self,
        client: u32,
        start: f64,
        download: u64,
        samples: u64,
        upload: u64,
    ) -> Option<SimulatedTask> {
        let profile = self.profiles.of(client)?;
        let TaskTiming {
            download,
            compute,
            upload,
        } = TaskTiming {
            upload: profile.upload_seconds(upload),
            ..profile.before_upload(download, samples, self.epochs)
        };
        Some(SimulatedTask {
            start,
            download,
            compute,
            upload,
        })
    }

    /// `client`'s evaluation of a model from `start` (power-of-choice's
    /// candidates): `download` bytes down, a forward pass over `samples`,
    /// its loss up.
    pub(crate) fn evaluation(
        &self,
        client: u32,
        start: f64,
        download: u64,
        samples: u64,
    ) -> Option<SimulatedTask> {
        let timing = self.profiles.of(client)?.evaluation(
            download,
            samples,
            crate::transport::LOCAL_LOSS_BYTES,
        );
        Some(SimulatedTask {
            start,
            download: timing.download,
            compute: timing.compute,
            upload: timing.upload,
        })
    }

    /// When `client` went offline during `task`, if it did.
    pub(crate) fn lost_at(&mut self, client: u32, task: &SimulatedTask) -> Option<f64> {
        match self.availability.online_until(client, task.start) {
            None => Some(task.start),
            Some(until) if until < task.end() => Some(until),
            Some(_) => None,
        }
    }

    /// The clients of `1..=total` online at `time`, except `busy`.
    pub(crate) fn online(&mut self, total: u32, time: f64, busy: &[u32]) -> Vec<u32> {
        self.online
            .online_clients(&mut self.availability, total, time, busy)
    }

    /// The earliest time from `time` on when a client of `1..=total` other
    /// than `busy` is online; `None` when none ever is again.
    pub(crate) fn next_online(&mut self, total: u32, time: f64, busy: &[u32]) -> Option<f64> {
        self.online
            .next_online_client(&mut self.availability, total, time, busy)
    }
}

impl RoundLoop<'_> {
    /// The round's clients: `per_round` of all of them, or with an
    /// availability, of those online when the round starts (waiting on the
    /// simulated clock for one to come online when none is); for pow-d
    /// after their candidates evaluated `global_payload`.
    pub(super) fn select_clients(
        &mut self,
        round: u32,
        global_payload: &Arc<Vec<u8>>,
    ) -> anyhow::Result<Selected> {
        let selection = self.settings.selection;
        let (total, draws) = (selection.total_clients, selection.draws as usize);
        let start = self.clock.simulated_before;
        let Some(devices) = self.devices.as_mut().filter(|d| d.intermittent) else {
            if self.selector.evaluates() {
                let all: Vec<u32> = (1..=total).collect();
                return self.choose_evaluated(round, &all, start, global_payload);
            }
            let clients = self.selector.select_all(round, total, selection.draws);
            return Ok(Selected::at(clients, start));
        };
        let Some(start) = devices.next_online(total, start, &[]) else {
            anyhow::bail!(
                "round {round}: no client is online at simulated time {start} s or ever after \
                 (clients.availability)"
            );
        };
        let online = devices.online(total, start, &[]);
        let selected = if self.selector.evaluates() {
            self.choose_evaluated(round, &online, start, global_payload)?
        } else {
            Selected::at(self.selector.select(round, &online, draws), start)
        };
        if selected.clients.len() < draws {
            tracing::info!(
                round,
                online = selected.clients.len(),
                "fewer clients online than clients.per_round"
            );
        }
        Ok(selected)
    }

    /// Times each update of the round on the simulated clock and closes the
    /// round ([`close_round`]): clients that went offline before their
    /// update arrived are lost, those after the deadline or the first
    /// `per_round` of an over-selection are late; both are dropped. Returns
    /// when the round closed.
    pub(super) fn time_round(
        &mut self,
        round: u32,
        dispatched: &Dispatched,
        collected: &mut Collected,
    ) -> Option<f64> {
        let devices = self.devices.as_mut()?;
        let download = dispatched.payload_bytes
            + dispatched.extra_bytes / dispatched.clients.len().max(1) as u64;
        let mut ends = Vec::with_capacity(collected.updates.len());
        for arrived in &mut collected.updates {
            let client = arrived.report.client_id;
            let task = devices.task(
                client,
                dispatched.train_start,
                download,
                arrived.report.num_samples,
                arrived.arrival.payload_bytes,
            )?;
            ends.push(match devices.lost_at(client, &task) {
                Some(at) => TaskEnd::Lost(at),
                None => TaskEnd::Arrives(task.end()),
            });
            arrived.arrival.simulated = Some(task);
        }
        let selection = self.settings.selection;
        let quota = (selection.draws > selection.per_round).then_some(selection.per_round as usize);
        let deadline = self.settings.round_deadline;
        let (end, verdicts) = close_round(dispatched.sim_start, &ends, deadline, quota);
        let updates = std::mem::take(&mut collected.updates);
        for ((arrived, verdict), task_end) in updates.into_iter().zip(verdicts).zip(ends) {
            let detail = match (verdict, task_end) {
                (Verdict::Aggregated, _) => {
                    collected.updates.push(arrived);
                    continue;
                }
                (Verdict::Lost, TaskEnd::Lost(at)) => (
                    "client lost",
                    format!("went offline at simulated time {at:.3} s, before its update arrived"),
                ),
                _ => (
                    "client late",
                    format!(
                        "the round closed at simulated time {end:.3} s ({}), before its update \
                         arrived",
                        closed_by(deadline, quota)
                    ),
                ),
            };
            let (what, detail) = detail;
            self.drop_update(round, &arrived, what, detail, &mut collected.failures);
        }
        Some(end)
    }
}

/// What closes a round, in words.
fn closed_by(deadline: Option<f64>, quota: Option<usize>) -> String {
    let mut reasons = Vec::new();
    if let Some(quota) = quota {
        reasons.push(format!(
            "the first clients.per_round = {quota} updates of an over-selection"
        ));
    }
    if let Some(deadline) = deadline {
        reasons.push(format!("server.round_deadline = {deadline} s"));
    }
    if reasons.is_empty() {
        reasons.push("its last task".to_owned());
    }
    reasons.join(" or ")
}
