//! The asynchronous round loop (`server.synchronous = false`, Plato's
//! meaning), on the simulated clock of the device profiles; in network mode
//! the same steps run on the real clock (`realtime.rs`).
//!
//! Up to `clients.per_round` tasks are in flight; whenever one finishes (on
//! the simulated clock) a client online and not in flight is drawn to take
//! its place, with the global model as it is then. An update that arrives
//! is checked as a synchronous round's are, and dropped when it trained from
//! a model more than `server.staleness_bound` aggregations old; every
//! `server.minimum_clients_aggregated` updates the strategy aggregates them
//! ([`Strategy::aggregate_stale`](cohort_core::strategy::Strategy::aggregate_stale)),
//! and that aggregation is a round of the results files, evaluated,
//! recorded and checkpointed as a synchronous round is.
//!
//! The order of events is the simulated clock's ([`InFlight`]): a task's
//! timing comes from its client's profile and the bytes and samples it
//! moved, and each task's training stream from its task number, so the
//! model is the same bit for bit with any number of workers, whatever order
//! they finish in. A checkpoint follows an aggregation: it holds the clock,
//! the tasks in flight with what they were sent, and the models they
//! trained from; the buffer is empty then. `--resume` sends those tasks
//! again, which trains them to the same updates.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use anyhow::{Context, bail};

use cohort_core::checkpoint::{AsyncHistory, AsyncTask};
use cohort_core::clock::{InFlight, Next};
use cohort_core::results::SimulatedTask;
use cohort_core::strategy::ClientUpdate;
use cohort_core::strategy::stale::StaleUpdate;
use cohort_core::tree::ParamTree;
use cohort_train::trainer::ClientTask;

use super::{Aggregated, Dispatched, RoundLoop};
use crate::events::RunEvent;
use crate::record::{AsyncCheckpoint, CheckpointState};
use crate::transport::{ClientOutcome, TaskInstructions, TaskSpec};
use crate::updates::{Arrived, Collected, Dropped, check_update, hooked_payloads, unpack};

/// What the asynchronous server is told by the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AsyncSettings {
    /// `server.minimum_clients_aggregated`: updates per aggregation.
    pub(crate) buffer: usize,
    /// `server.staleness_bound`.
    pub(crate) staleness_bound: Option<u32>,
    /// Network mode: events in the order updates really arrive, timed by
    /// the server's clock, instead of on the simulated clock of the device
    /// profiles.
    pub(crate) real_time: bool,
}

/// One task on the clock.
pub(super) struct Flight {
    pub(super) client: u32,
    /// The model version (aggregations before it) it trained from.
    pub(super) version: u32,
    /// When it was sent, on the run's clock.
    pub(super) start: f64,
    /// On the simulated clock: how it is timed; `None` on the real one.
    simulated: Option<SimulatedFlight>,
    spec: TaskSpec,
    /// Its update (or why there is none), once trained; set at once for a
    /// client that goes offline before it could finish.
    pub(super) outcome: Option<Result<Arrived, Dropped>>,
}

/// A task's timing on the simulated clock.
struct SimulatedFlight {
    /// Download and compute; the upload's latency until its bytes are known.
    timing: SimulatedTask,
    /// When its client goes offline (infinity: never).
    online_until: f64,
}

/// What became of an update that arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// It joined the buffer.
    Buffered,
    /// It trained from too old a model.
    TooStale,
    /// Its client failed, was lost, or sent an update the checks refused.
    Failed,
}

/// What an aggregation leaves the run to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AggregationEnd {
    Continue,
    TargetReached,
    /// The caller asked to stop (`RunObserver::stop_requested`); the
    /// aggregation was checkpointed.
    Stopped,
}

/// An update waiting in the buffer.
struct Buffered {
    arrived: Arrived,
    version: u32,
}

/// The asynchronous server between events.
pub(super) struct AsyncRun {
    /// The run's clock: simulated seconds, or on the real clock seconds
    /// since the run started.
    pub(super) now: f64,
    next_task: u64,
    /// Aggregations so far: the version of the global model.
    pub(super) version: u32,
    /// Tasks by task number; on the real clock only a map of them (their
    /// order is the transport's).
    pub(super) flights: InFlight<Flight>,
    /// The models tasks in flight trained from, by version, and their wire
    /// payloads.
    bases: BTreeMap<u32, (Arc<ParamTree>, Arc<Vec<u8>>)>,
    buffer: Vec<Buffered>,
    pub(super) dropped: Vec<Dropped>,
    /// What was sent since the last aggregation.
    sent: Dispatched,
    /// On the real clock: clients whose task failed or was refused since
    /// the last update joined the buffer, not drawn again until one does, so
    /// that a client that fails at once cannot take every free place.
    pub(super) failed: BTreeSet<u32>,
}

impl RoundLoop<'_> {
    /// Runs every remaining aggregation; `true` when the target accuracy
    /// was reached.
    pub(super) fn run_async(&mut self, settings: AsyncSettings) -> anyhow::Result<bool> {
        if self.first_round > self.settings.last_round {
            tracing::info!(
                rounds = self.settings.last_round,
                "all rounds are done already"
            );
            return Ok(false);
        }
        match (settings.real_time, self.devices.is_some()) {
            (true, false) => return self.run_async_real_time(settings),
            (false, true) => {}
            (true, true) => {
                bail!("an asynchronous run on the real clock cannot have simulated devices")
            }
            (false, false) => bail!("an asynchronous run on the simulated clock needs devices"),
        }
        let mut run = self.async_start()?;
        loop {
            self.refill(&mut run)?;
            if self.wake(&mut run)? {
                continue;
            }
            match run.flights.next() {
                Next::Empty => bail!(
                    "round {}: no client is online at simulated time {} s or ever after \
                     (clients.availability), and none is in flight",
                    run.version + 1,
                    run.now
                ),
                Next::Unsettled(_) => {
                    let outcome = self.transport.next_outcome()?;
                    self.settle(&mut run, outcome)?;
                }
                Next::Ready(task) => {
                    let flight = run.flights.take(task).expect("the clock named it");
                    run.now = flight.at;
                    self.arrive(&mut run, flight.item);
                    if let Some(reached) = self.aggregate_if_full(&mut run, settings)? {
                        return Ok(reached);
                    }
                }
            }
        }
    }

    /// Aggregates the buffer once it holds `settings.buffer` updates;
    /// `Some(whether the target accuracy was reached)` when the run ends
    /// there, [`Stopped`](crate::events::Stopped) when the caller stops it.
    pub(super) fn aggregate_if_full(
        &mut self,
        run: &mut AsyncRun,
        settings: AsyncSettings,
    ) -> anyhow::Result<Option<bool>> {
        if run.buffer.len() < settings.buffer {
            return Ok(None);
        }
        let round = run.version + 1;
        let end = self.aggregate_buffer(run)?;
        if end == AggregationEnd::Stopped {
            // The checkpoint holds the tasks in flight: `--resume` sends them again.
            tracing::info!(round, "stopped by the caller");
            self.transport.cancel();
            return Err(crate::events::Stopped { round }.into());
        }
        let target_reached = end == AggregationEnd::TargetReached;
        if target_reached || round >= self.settings.last_round {
            self.transport.cancel();
            return Ok(Some(target_reached));
        }
        self.observer.on_event(&RunEvent::RoundStarted {
            round: round + 1,
            clients: settings.buffer,
        });
        Ok(None)
    }

    /// The clock at the start: fresh, or the checkpoint's with its tasks
    /// sent again.
    pub(super) fn async_start(&mut self) -> anyhow::Result<AsyncRun> {
        let version = self.first_round - 1;
        let real_time = self.real_time();
        let mut run = AsyncRun {
            now: if real_time {
                self.real_now()
            } else {
                self.clock.simulated_before
            },
            next_task: 0,
            version,
            flights: InFlight::default(),
            bases: BTreeMap::new(),
            buffer: Vec::new(),
            dropped: Vec::new(),
            sent: Dispatched::default(),
            failed: BTreeSet::new(),
        };
        if let Some(resumed) = self.resumed_async.take() {
            let history = resumed.history;
            // Real time goes on from this process's start: the tasks in
            // flight are sent again now.
            if !real_time {
                run.now = history.now;
            }
            run.next_task = history.next_task;
            for (version, base) in resumed.bases {
                let wire = self.pack_tree(&base)?.wire;
                run.bases.insert(version, (Arc::new(base), wire));
            }
            for task in history.tasks {
                let spec = TaskSpec {
                    slot: task.task as usize,
                    task: ClientTask {
                        client_id: task.client_id,
                        round: seed_round(task.task)?,
                    },
                    instructions: TaskInstructions {
                        learning_rate: task.learning_rate,
                        proximal_mu: task.proximal_mu,
                        update_clip_norm: task.update_clip_norm,
                        correction: None,
                    },
                };
                let start = if real_time { run.now } else { task.start };
                self.launch(&mut run, task.task, task.version, start, spec)?;
            }
            // Sent before the checkpoint: counted in the rounds before it.
            run.sent = Dispatched::default();
        }
        run.sent.sim_start = run.now;
        self.observer.on_event(&RunEvent::RoundStarted {
            round: run.version + 1,
            clients: self.settings.selection.per_round as usize,
        });
        Ok(run)
    }

    /// Fills the free places in flight with clients online now.
    fn refill(&mut self, run: &mut AsyncRun) -> anyhow::Result<()> {
        let selection = self.settings.selection;
        let free = (selection.per_round as usize).saturating_sub(run.flights.len());
        if free == 0 {
            return Ok(());
        }
        let busy: Vec<u32> = run.flights.iter().map(|(_, f)| f.item.client).collect();
        let devices = self
            .devices
            .as_mut()
            .context("an asynchronous run needs devices")?;
        let online = devices.online(selection.total_clients, run.now, &busy);
        // The places refilled now count towards the next aggregation.
        for client in self.selector.select(run.version + 1, &online, free) {
            self.dispatch_one(run, client)?;
        }
        Ok(())
    }

    /// With places free and a client coming online before the next event,
    /// the clock moves to it; `true` when it did.
    fn wake(&mut self, run: &mut AsyncRun) -> anyhow::Result<bool> {
        let selection = self.settings.selection;
        if run.flights.len() >= selection.per_round as usize {
            return Ok(false);
        }
        let next_event = match run.flights.next() {
            Next::Ready(task) | Next::Unsettled(task) => {
                run.flights.get(task).map_or(f64::INFINITY, |f| f.at)
            }
            Next::Empty => f64::INFINITY,
        };
        let busy: Vec<u32> = run.flights.iter().map(|(_, f)| f.item.client).collect();
        let devices = self
            .devices
            .as_mut()
            .context("an asynchronous run needs devices")?;
        match devices.next_online(selection.total_clients, run.now, &busy) {
            Some(at) if at > run.now && at < next_event => {
                run.now = at;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Sends `client` the global model as it is now.
    pub(super) fn dispatch_one(&mut self, run: &mut AsyncRun, client: u32) -> anyhow::Result<()> {
        let version = run.version;
        if let std::collections::btree_map::Entry::Vacant(slot) = run.bases.entry(version) {
            slot.insert((Arc::new(self.global.clone()), self.pack()?.wire));
        }
        let task = run.next_task;
        run.next_task += 1;
        let base = Arc::clone(&run.bases[&version].0);
        let instructions = self
            .strategy
            .configure(&self.context(version + 1), client, &base)
            .with_context(|| format!("round {}: client {client}", version + 1))?;
        let spec = TaskSpec {
            slot: task as usize,
            task: ClientTask {
                client_id: client,
                round: seed_round(task)?,
            },
            instructions: TaskInstructions::encode(instructions)?,
        };
        let (download, extra) = (
            run.bases[&version].1.len() as u64,
            spec.instructions.extra_bytes(),
        );
        run.sent.clients.push(client);
        run.sent.payload_bytes = download;
        run.sent.extra_bytes += extra;
        tracing::debug!(task, client, version, "task dispatched");
        self.launch(run, task, version, run.now, spec)
    }

    /// Puts a task on the clock and, unless its client goes offline before
    /// it could finish, hands it to the transport.
    fn launch(
        &mut self,
        run: &mut AsyncRun,
        task: u64,
        version: u32,
        start: f64,
        spec: TaskSpec,
    ) -> anyhow::Result<()> {
        let client = spec.task.client_id;
        let samples = self.expected_samples(client);
        let (_, wire) = run
            .bases
            .get(&version)
            .with_context(|| format!("task {task}: no model of version {version}"))?;
        let wire = Arc::clone(wire);
        let mut flight = Flight {
            client,
            version,
            start,
            simulated: None,
            spec,
            outcome: None,
        };
        if self.real_time() {
            self.transport.dispatch(wire, vec![flight.spec.clone()])?;
            run.flights.insert(task, start, false, flight)?;
            return Ok(());
        }
        let download = wire.len() as u64 + flight.spec.instructions.extra_bytes();
        let devices = self
            .devices
            .as_mut()
            .context("an asynchronous run needs devices")?;
        let timing = devices
            .task(client, start, download, samples, 0)
            .with_context(|| format!("client {client} has no device profile"))?;
        let online_until = devices
            .availability
            .online_until(client, start)
            .unwrap_or(start);
        let earliest = timing.end();
        flight.simulated = Some(SimulatedFlight {
            timing,
            online_until,
        });
        if online_until < earliest {
            // Lost before it could finish whatever it sends: not trained.
            flight.outcome = Some(Err(lost(client, online_until, &timing)));
            run.flights.insert(task, online_until, true, flight)?;
            return Ok(());
        }
        self.transport.dispatch(wire, vec![flight.spec.clone()])?;
        run.flights.insert(task, earliest, false, flight)?;
        Ok(())
    }

    /// A trained task's finish: its upload timed by its bytes, or its loss.
    fn settle(&mut self, run: &mut AsyncRun, outcome: ClientOutcome) -> anyhow::Result<()> {
        let task = outcome.slot as u64;
        let unpacked = unpack(outcome, &self.settings.inbound, &self.settings.limits);
        let devices = self
            .devices
            .as_ref()
            .context("an asynchronous run needs devices")?;
        let flight = &mut run
            .flights
            .get_mut(task)
            .with_context(|| format!("an outcome of task {task}, which is not in flight"))?
            .item;
        let simulated = flight
            .simulated
            .as_ref()
            .context("a task on the simulated clock without its timing")?;
        let (mut timing, online_until) = (simulated.timing, simulated.online_until);
        let at = match unpacked {
            Ok(mut arrived) => {
                let profile = devices
                    .profiles
                    .of(flight.client)
                    .context("no device profile")?;
                timing.upload = profile.upload_seconds(arrived.arrival.payload_bytes);
                arrived.arrival.simulated = Some(timing);
                if online_until < timing.end() {
                    flight.outcome = Some(Err(lost(flight.client, online_until, &timing)));
                    online_until
                } else {
                    flight.outcome = Some(Ok(arrived));
                    timing.end()
                }
            }
            Err(mut dropped) => {
                dropped.simulated = Some(timing);
                flight.outcome = Some(Err(dropped));
                timing.end()
            }
        };
        run.flights.settle(task, at)?;
        Ok(())
    }

    /// A task's event: its update joins the buffer, or it is dropped.
    pub(super) fn arrive(&mut self, run: &mut AsyncRun, flight: Flight) -> Verdict {
        let round = run.version + 1;
        let mut arrived = match flight.outcome {
            Some(Ok(arrived)) => arrived,
            Some(Err(dropped)) => {
                if let Some(task) = dropped.simulated {
                    self.selector
                        .observe_duration(dropped.client_id, super::task_seconds(&task));
                }
                tracing::warn!(
                    round,
                    client = dropped.client_id,
                    "client dropped: {}",
                    dropped.reason
                );
                self.observer.on_event(&RunEvent::ClientDropped {
                    round,
                    client_id: dropped.client_id,
                    reason: dropped.reason.clone(),
                });
                run.dropped.push(dropped);
                return Verdict::Failed;
            }
            None => unreachable!("a ready task is settled"),
        };
        let staleness = run.version - flight.version;
        arrived.arrival.staleness = Some(staleness);
        let refused = self.expected_report(&arrived).and_then(|expected| {
            check_update(
                &arrived,
                &expected,
                &self.global,
                self.settings.max_report_seconds,
            )
        });
        if let Err(reason) = refused {
            self.drop_update(round, &arrived, "update refused", reason, &mut run.dropped);
            return Verdict::Failed;
        }
        let bound = self.settings.asynchronous.and_then(|a| a.staleness_bound);
        if let Some(bound) = bound.filter(|&bound| staleness > bound) {
            let reason = format!(
                "it trained from version {}, {staleness} aggregations old, more than \
                 server.staleness_bound = {bound}",
                flight.version
            );
            self.drop_update(
                round,
                &arrived,
                "update too stale",
                reason,
                &mut run.dropped,
            );
            return Verdict::TooStale;
        }
        self.observer.on_event(&RunEvent::ClientFinished {
            round,
            client_id: flight.client,
        });
        let feedback = super::feedback_of(&arrived.report, arrived.arrival.simulated);
        self.selector.observe(round, &[feedback]);
        run.buffer.push(Buffered {
            arrived,
            version: flight.version,
        });
        Verdict::Buffered
    }

    /// The buffer's aggregation: a round of the results files, and whether
    /// the run goes on after it.
    fn aggregate_buffer(&mut self, run: &mut AsyncRun) -> anyhow::Result<AggregationEnd> {
        let round = run.version + 1;
        let buffered = std::mem::take(&mut run.buffer);
        let versions: Vec<u32> = buffered.iter().map(|b| b.version).collect();
        let collected = Collected {
            bytes_to_server: buffered
                .iter()
                .map(|b| b.arrived.arrival.payload_bytes)
                .sum(),
            updates: buffered.into_iter().map(|b| b.arrived).collect(),
            failures: Vec::new(),
            simulated_end: Some(run.now),
            store: None,
        };
        let (payloads, arrivals) =
            hooked_payloads(round, collected, &mut *self.hooks, &self.global)?;
        if self.leader() {
            self.recorder.updates(round, &payloads)?;
        }
        let stale: Vec<StaleUpdate<'_>> = payloads
            .iter()
            .zip(&versions)
            .map(|(payload, version)| StaleUpdate {
                update: ClientUpdate {
                    client_id: payload.report.client_id,
                    num_samples: payload.report.num_samples,
                    local_steps: payload.report.local_steps,
                    tree: payload.tree(),
                },
                base: &run.bases[version].0,
                staleness: run.version - version,
            })
            .collect();
        let before = self.strategy.state();
        let result = self
            .strategy
            .aggregate_stale(&self.context(round), &self.global, &stale);
        drop(stale);
        let outcome = self.adopt(round, result, before)?;
        let aggregated = Aggregated {
            reports: payloads.into_iter().map(|p| p.into_parts().0).collect(),
            arrivals,
            dropped: std::mem::take(&mut run.dropped),
            privacy: outcome.privacy,
            simulated_end: Some(run.now),
            secagg: None,
        };
        run.version = round;
        let busy: Vec<u32> = run.flights.iter().map(|(_, f)| f.item.version).collect();
        run.bases.retain(|version, _| busy.contains(version));
        let packed = self.pack()?;
        let sent = std::mem::replace(
            &mut run.sent,
            Dispatched {
                sim_start: run.now,
                ..Dispatched::default()
            },
        );
        let accuracy = self.evaluate_and_record(round, &sent, aggregated, &packed)?;
        let target_reached = self
            .settings
            .target_accuracy
            .is_some_and(|target| accuracy >= target);
        let stopping = round < self.settings.last_round && self.observer.stop_requested();
        self.checkpoint_async(round, run, &packed, target_reached || stopping)?;
        if target_reached {
            tracing::info!(round, accuracy, "target accuracy reached");
            return Ok(AggregationEnd::TargetReached);
        }
        Ok(if stopping {
            AggregationEnd::Stopped
        } else {
            AggregationEnd::Continue
        })
    }

    /// A checkpoint after `round`, when one is due: the model, the selector,
    /// the strategy, and the tasks in flight with their models.
    fn checkpoint_async(
        &mut self,
        round: u32,
        run: &AsyncRun,
        packed: &super::Packed,
        target_reached: bool,
    ) -> anyhow::Result<()> {
        let interval = self.settings.checkpoint_interval.max(1);
        let last = round >= self.settings.last_round;
        if !(self.leader() && (round.is_multiple_of(interval) || last || target_reached)) {
            return Ok(());
        }
        let asynchronous = in_flight(run);
        let written = self.recorder.checkpoint(&CheckpointState {
            round,
            model_bytes: &packed.model_bytes,
            selector: self.selector.draws_state(self.settings.selection.seed),
            selection: self.selector.policy().state(),
            strategy: self.strategy.as_ref(),
            rows: &self.rows,
            config_hash: &self.settings.config_hash,
            asynchronous: Some(&asynchronous),
        })?;
        if let Some(sidecar) = written {
            self.strategy_checkpointed(round)?;
            self.observer
                .on_event(&RunEvent::CheckpointWritten { round, sidecar });
        }
        Ok(())
    }

    /// Training samples of `client`'s partition, which its compute time
    /// is of.
    fn expected_samples(&self, client: u32) -> u64 {
        (client as usize)
            .checked_sub(1)
            .and_then(|index| self.clients.expected.get(index))
            .map_or(0, |e| e.train_samples)
    }
}

/// A task number as the training stream's round coordinate: every task of
/// a client has its own stream, as every round of a synchronous run has.
fn seed_round(task: u64) -> anyhow::Result<u32> {
    u32::try_from(task + 1).context("more than 4294967295 tasks in one run")
}

/// `client`, lost at `at` during `task`.
fn lost(client: u32, at: f64, task: &SimulatedTask) -> Dropped {
    Dropped {
        client_id: client,
        worker: None,
        reason: format!(
            "client lost: went offline at simulated time {at:.3} s, before its update could \
             arrive (at {:.3} s at the earliest)",
            task.end()
        ),
        simulated: Some(*task),
        staleness: None,
        wall: None,
    }
}

/// The checkpoint's part of the clock: the tasks in flight and their models.
fn in_flight(run: &AsyncRun) -> AsyncCheckpoint {
    let tasks = run
        .flights
        .iter()
        .map(|(task, flight)| {
            let item = &flight.item;
            let instructions = &item.spec.instructions;
            AsyncTask {
                task,
                client_id: item.client,
                version: item.version,
                start: item.start,
                learning_rate: instructions.learning_rate,
                proximal_mu: instructions.proximal_mu,
                update_clip_norm: instructions.update_clip_norm,
            }
        })
        .collect();
    let bases = run
        .bases
        .iter()
        .map(|(version, (tree, _))| (format!("v{version}"), ParamTree::clone(tree)))
        .collect();
    AsyncCheckpoint {
        history: AsyncHistory {
            now: run.now,
            next_task: run.next_task,
            tasks,
            bases_file: None,
            bases_sha256: None,
        },
        bases,
    }
}
