//! The federated round loop.
//!
//! One round, in order, each step a function of [`RoundLoop`]:
//! 1. **select** `per_round` logical clients ([`Selector`]: uniform, by
//!    the utility of what they reported, `clients.selection`, or for pow-d
//!    by the loss of the global model its candidates compute first,
//!    `candidates.rs`) and
//!    **dispatch** their tasks: the global model, packed once through the
//!    outbound pipeline, and per client the strategy's instructions
//!    ([`Strategy::configure`]), to the [`Transport`];
//! 2. **collect** the updates, unpacked through the inbound pipeline and
//!    checked ([`crate::updates`]); a client that failed, timed out or sent a
//!    malformed or implausible update is dropped, and the round goes on if
//!    `min_per_round` updates arrived;
//! 3. **aggregate**: put the updates back in selection order, run the server
//!    hooks under their positional contract, and let the strategy
//!    ([`Strategy::aggregate`]) make the next global model; under secure
//!    aggregation the updates go through the protocol instead and the
//!    strategy steps from their mean alone (`secure.rs`);
//! 4. **evaluate and record**: test-set accuracy, the round's rows and the
//!    model, to the [`Recorder`];
//! 5. **checkpoint** the model, the selector (its stream and what its policy
//!    learnt of the clients) and the strategy's state; stop at
//!    the last round or at the target accuracy.
//!
//! The next round is dispatched as soon as the model is aggregated, so it
//! trains while this round is evaluated. Nothing of a round is written before
//! its aggregation succeeded, so a round that fails leaves the global model and
//! every file as the last round left them.
//!
//! The loop works on its parts alone ([`LoopParts`], [`LoopSettings`]): it
//! never sees the config, the command line or the environment; the run's
//! assembly ([`crate::assembly`]) builds the parts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use cohort_core::aggregate::AggregationError;
use cohort_core::codec::{self, DecodeLimits};
use cohort_core::data::Dataset;
use cohort_core::hooks::{ClientReport, ServerHooks};
use cohort_core::layout;
use cohort_core::processors::{Pipeline, Processor};
use cohort_core::results::{RoundRow, RunRows};
use cohort_core::schedule::LrSchedule;
use cohort_core::selection::{ClientPrior, Feedback, Policy, PolicyConfig, Selector};
use cohort_core::strategy::{
    self as strategies, ClientUpdate, PrivacySpent, RoundContext, Strategy, StrategyError,
};
use cohort_core::tree::ParamTree;
use cohort_train::trainer::ModelEvaluator;

use crate::distributed::SharedCollective;
use crate::events::{RunEvent, RunObserver};
use crate::record::{CheckpointState, Recorder, SimulatedWallTime};
use crate::spill::{SpillSettings, UpdateStore};
use crate::start::StartPoint;
use crate::transport::Transport;
use crate::updates::{
    Arrival, Arrived, Collected, Dropped, ExpectedReport, Intake, OwnDataRules, check_report,
    check_update, collect_updates, dropped_update, hooked_payloads, own_data_expectation,
    plan_tasks, self_reported_expectation,
};
pub(crate) use asynchronous::AsyncSettings;
use candidates::Selected;
pub(crate) use devices::SimDevices;
pub(crate) use secure::SecureSettings;

/// Everything the loop needs to know that a config would say, as plain
/// values: built once by the assembly, never changed by the loop.
#[derive(Debug, Clone)]
pub(crate) struct LoopSettings {
    /// The run's last round (a resumed run starts later, not elsewhere).
    pub(crate) last_round: u32,
    pub(crate) selection: Selection,
    /// Fewer updates than this stop the run before the round is written.
    pub(crate) min_per_round: usize,
    pub(crate) target_accuracy: Option<f64>,
    /// Every this many rounds a checkpoint (and at the last round and the target).
    pub(crate) checkpoint_interval: u32,
    /// The optimizer's base rate, and its schedule across rounds.
    pub(crate) learning_rate: f64,
    pub(crate) schedule: LrSchedule,
    pub(crate) outbound: Pipeline,
    pub(crate) inbound: Pipeline,
    pub(crate) limits: DecodeLimits,
    pub(crate) attack: SimulatedAttack,
    /// `server.max_update_norm_ratio`.
    pub(crate) max_update_norm_ratio: Option<f64>,
    /// `server.max_model_step_ratio`.
    pub(crate) max_model_step_ratio: f64,
    pub(crate) own_data: OwnDataRules,
    /// The most seconds a report may claim for training or for processing:
    /// `server.payload_timeout` over the network (a task cannot take longer
    /// than the server waits for it), a year for in-process workers.
    pub(crate) max_report_seconds: f64,
    pub(crate) wall_time: SimulatedWallTime,
    /// The config's result hash, kept in every checkpoint.
    pub(crate) config_hash: String,
    /// Compute threads for the test-set evaluation.
    pub(crate) evaluation_threads: usize,
    /// `[secure_aggregation]`: the round's mean through the protocol
    /// instead of every update to the strategy.
    pub(crate) secure: Option<SecureSettings>,
    /// `server.synchronous = false`: the asynchronous server's settings.
    pub(crate) asynchronous: Option<AsyncSettings>,
    /// `server.round_deadline`: simulated seconds a synchronous round waits.
    pub(crate) round_deadline: Option<f64>,
    /// Network mode: past the share of `server.max_inflight_bytes` that
    /// the bytes in flight leave (`LoadedConfig::inflight_split`), a round
    /// whose updates are folded one at a time keeps the rest on disk.
    pub(crate) spill: Option<SpillSettings>,
}

/// Who is drawn each round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Selection {
    /// `server.random_seed`: the selector's stream, kept in checkpoints.
    pub(crate) seed: u64,
    pub(crate) total_clients: u32,
    pub(crate) per_round: u32,
    /// Clients drawn each round: `per_round`, or more with
    /// `clients.over_selection`.
    pub(crate) draws: u32,
    /// Whether each round draws `per_round` of all clients, so `--resume`
    /// can replay the draws to check a checkpoint's selector; not with an
    /// availability, where who can be drawn depends on the simulated clock,
    /// nor with a policy that decides from the clients' reports.
    pub(crate) replayable: bool,
    /// `clients.selection` and its options.
    pub(crate) policy: PolicyConfig,
}

/// `clients.attack`: the first `attackers_per_round` slots of each round
/// replace their updates (a robustness experiment).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SimulatedAttack {
    pub(crate) kind: cohort_core::attack::Attack,
    pub(crate) attackers_per_round: u32,
    pub(crate) scale: f64,
    /// More attackers than the strategy withstands, in words.
    pub(crate) warning: Option<String>,
}

/// The parts a loop runs with.
pub(crate) struct LoopParts<'a> {
    pub(crate) settings: LoopSettings,
    pub(crate) strategy: Box<dyn Strategy>,
    pub(crate) transport: Box<dyn Transport>,
    pub(crate) hooks: &'a mut dyn ServerHooks,
    pub(crate) observer: &'a mut dyn RunObserver,
    pub(crate) evaluator: Box<dyn ModelEvaluator>,
    pub(crate) recorder: Box<dyn Recorder + 'a>,
    pub(crate) test: Dataset,
    pub(crate) clients: ClientFacts,
    /// This process is one rank of a distributed simulation.
    pub(crate) ranks: Option<RankRole>,
    /// Simulated devices (`[clients.profile]`); `None`: measured times.
    pub(crate) devices: Option<SimDevices>,
}

/// A rank's place among the others.
pub(crate) struct RankRole {
    pub(crate) peers: SharedCollective,
    /// Whether this rank evaluates and writes the run's files (rank 0).
    pub(crate) leader: bool,
    /// `cluster.reduce = partial`: this rank's client block.
    pub(crate) partial: Option<cohort_core::cluster::ClientBlock>,
    /// Evaluation batches each rank scores, in rank order, where the test
    /// set is split over the ranks (the loop's test set is then this rank's
    /// slice); `None`: rank 0 evaluates the whole set alone.
    pub(crate) test_batches: Option<Vec<usize>>,
}

/// What the server knows of every client from the partitions it computed.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClientFacts {
    /// Each client's training labels, for `clients.csv`.
    pub(crate) histograms: Vec<Vec<u64>>,
    /// What each client's report must say.
    pub(crate) expected: Vec<ExpectedReport>,
    /// The clients are the caller's own code (`RunBuilder::external_clients`):
    /// the server computed no partition, so each report is the client's own
    /// word, bounded by this many samples (`clients.max_samples`).
    pub(crate) self_reported: Option<u64>,
}

impl ClientFacts {
    fn histogram(&self, client_id: u32) -> Vec<u64> {
        (client_id as usize)
            .checked_sub(1)
            .and_then(|index| self.histograms.get(index))
            .cloned()
            .unwrap_or_default()
    }
}

/// A round handed to the transport: who trains, and what was sent.
#[derive(Debug, Default)]
pub(crate) struct Dispatched {
    pub(crate) clients: Vec<u32>,
    /// Bytes of the global model each client receives.
    pub(crate) payload_bytes: u64,
    /// Bytes sent beside the model, all clients together (SCAFFOLD).
    pub(crate) extra_bytes: u64,
    /// When the round started on the simulated clock.
    pub(crate) sim_start: f64,
    /// When its tasks start on the simulated clock: `sim_start`, or after
    /// power-of-choice's evaluation pass, when the last candidate's loss
    /// has arrived.
    pub(crate) train_start: f64,
    /// The candidates that evaluated the global model for the choice.
    pub(crate) candidates: Vec<cohort_core::results::CandidateRow>,
}

/// The global model of a round, packed once.
pub(crate) struct Packed {
    /// Plain safetensors with BatchNorm counters ([`layout::to_model_file`]):
    /// the model file and the checkpoint.
    pub(crate) model_bytes: Arc<Vec<u8>>,
    /// After `server.outbound_processors`: what the clients receive (the same
    /// allocation when the pipeline is plain `safetensor_encode`).
    pub(crate) wire: Arc<Vec<u8>>,
}

/// What a round's aggregation leaves for the records.
pub(crate) struct Aggregated {
    pub(crate) reports: Vec<ClientReport>,
    pub(crate) arrivals: Vec<Arrival>,
    pub(crate) dropped: Vec<Dropped>,
    pub(crate) privacy: Option<PrivacySpent>,
    /// The protocol's costs, under secure aggregation.
    pub(crate) secagg: Option<cohort_core::results::SecAggRow>,
    /// When the round ended on the simulated clock (device profiles).
    pub(crate) simulated_end: Option<f64>,
}

/// Wall and simulated time of a run across rounds.
struct Clock {
    run_started: Instant,
    elapsed_before: f64,
    simulated_before: f64,
    previous_round_end: Instant,
}

/// The state of a run between rounds, and the steps of one round.
pub(crate) struct RoundLoop<'a> {
    settings: LoopSettings,
    hooks: &'a mut dyn ServerHooks,
    observer: &'a mut dyn RunObserver,
    strategy: Box<dyn Strategy>,
    transport: Box<dyn Transport>,
    evaluator: Box<dyn ModelEvaluator>,
    /// Evaluation's own compute threads, so it does not oversubscribe the
    /// workers' cores while the next round trains.
    evaluation_pool: rayon::ThreadPool,
    test: Dataset,
    clients: ClientFacts,
    global: ParamTree,
    selector: Selector,
    recorder: Box<dyn Recorder + 'a>,
    /// Every round's rows so far, resumed ones included.
    rows: RunRows,
    first_round: u32,
    clock: Clock,
    ranks: Option<RankRole>,
    devices: Option<SimDevices>,
    /// An asynchronous checkpoint's tasks, until the loop sends them again.
    resumed_async: Option<crate::start::AsyncResume>,
    /// The privacy spent by the rounds so far under distributed noise.
    ddg_spent: cohort_core::secagg::DdgAccountant,
}

/// The privacy spent by a resumed run's rounds under distributed noise,
/// charged again from their rows: each round that released a sum with the
/// clients that were in it (`secagg.csv`'s contributors), an aborted round
/// with nothing, exactly as the uninterrupted run charged them.
fn replayed_privacy(
    settings: &LoopSettings,
    start: &StartPoint,
) -> anyhow::Result<cohort_core::secagg::DdgAccountant> {
    let mut spent = cohort_core::secagg::DdgAccountant::default();
    let Some((secure, noise)) = settings
        .secure
        .as_ref()
        .and_then(|secure| Some((secure, secure.noise.as_ref()?)))
    else {
        return Ok(spent);
    };
    if start.rows.rounds.is_empty() {
        return Ok(spent);
    }
    let ddg = cohort_core::secagg::resolve_ddg(noise, &secure.params, &start.global)
        .map_err(|e| anyhow::anyhow!("secure_aggregation.noise: {e}"))?;
    for row in &start.rows.rounds {
        match &row.secagg {
            Some(costs) if costs.contributors > 0 => {
                spent.record(&ddg, costs.contributors as usize)
            }
            Some(_) => {}
            // Rounds in the clear would have released each update: no
            // accountant could say what they spent.
            None => anyhow::bail!(
                "--resume with secure_aggregation.noise: round {} of the checkpoint was not \
                 securely aggregated, so the privacy it spent is unknown",
                row.round
            ),
        }
    }
    Ok(spent)
}

impl<'a> RoundLoop<'a> {
    /// The loop over its parts; nothing here reads a config.
    pub(crate) fn new(parts: LoopParts<'a>, start: StartPoint) -> anyhow::Result<Self> {
        let evaluation_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(parts.settings.evaluation_threads.max(1))
            .thread_name(|i| format!("cohort-eval{i}"))
            .build()
            .context(
                "cannot start the evaluation's compute threads (trainer.threads_per_worker)",
            )?;
        let ddg_spent = replayed_privacy(&parts.settings, &start)?;
        let simulated_before = start.rows.rounds.last().map_or(0.0, |r| r.simulated_time);
        let selector = selector(&parts, &start)?;
        Ok(Self {
            settings: parts.settings,
            hooks: parts.hooks,
            observer: parts.observer,
            strategy: parts.strategy,
            transport: parts.transport,
            evaluator: parts.evaluator,
            evaluation_pool,
            test: parts.test,
            clients: parts.clients,
            global: start.global,
            selector,
            recorder: parts.recorder,
            rows: start.rows,
            first_round: start.first_round,
            clock: Clock {
                run_started: Instant::now(),
                elapsed_before: start.elapsed_before,
                simulated_before,
                previous_round_end: Instant::now(),
            },
            ranks: parts.ranks,
            devices: parts.devices,
            resumed_async: start.asynchronous,
            ddg_spent,
        })
    }

    /// Whether this process evaluates and writes the run's files (rank 0, or
    /// the only process).
    /// Tells the strategy its state is in a checkpoint now.
    fn strategy_checkpointed(&mut self, round: u32) -> anyhow::Result<()> {
        self.strategy.checkpointed().with_context(|| {
            format!(
                "round {round}: {} after its checkpoint",
                self.strategy.name()
            )
        })
    }

    fn leader(&self) -> bool {
        self.ranks.as_ref().is_none_or(|r| r.leader)
    }

    /// The loop's parts back, once it has run: the transport must be dropped
    /// before the client processes it serves.
    pub(crate) fn finish(self) -> (Box<dyn Transport>, Vec<RoundRow>) {
        (self.transport, self.rows.rounds)
    }

    /// Runs every remaining round; `true` when the target accuracy was reached.
    pub(crate) fn run(&mut self) -> anyhow::Result<bool> {
        let reached = match self.settings.asynchronous {
            Some(asynchronous) => self.run_async(asynchronous)?,
            None => self.run_rounds()?,
        };
        self.observer.on_event(&RunEvent::RunFinished {
            rounds: self.rows.rounds.len(),
            reached_target: reached,
        });
        Ok(reached)
    }

    fn run_rounds(&mut self) -> anyhow::Result<bool> {
        let last_round = self.settings.last_round;
        if self.first_round > last_round {
            tracing::info!(rounds = last_round, "all rounds are done already");
            return Ok(false);
        }
        let initial = self.pack()?.wire;
        let mut dispatched = self.dispatch(self.first_round, initial)?;
        for round in self.first_round..=last_round {
            let mut steps = StepTimes::default();
            let started = Instant::now();
            let aggregated = match self.ranks.as_ref().and_then(|r| r.partial) {
                Some(block) => {
                    let mine: Vec<u32> = dispatched
                        .clients
                        .iter()
                        .copied()
                        .filter(|&c| block.contains(c))
                        .collect();
                    let collected = self.collect(round, &mine, None)?;
                    steps.collecting = started.elapsed();
                    self.reduce_partials(round, dispatched.clients.len(), collected)?
                }
                None => {
                    let collected = self.collect(round, &dispatched.clients, Some(&dispatched))?;
                    steps.collecting = started.elapsed();
                    match self.settings.secure.clone() {
                        Some(secure) => {
                            self.aggregate_securely(round, &dispatched.clients, collected, &secure)?
                        }
                        None => self.aggregate(round, collected)?,
                    }
                }
            };
            steps.aggregating = started.elapsed() - steps.collecting;
            // The next round starts on the simulated clock when this one ended.
            if let Some(end) = aggregated.simulated_end {
                self.clock.simulated_before = end;
            }
            self.observe_round(round, &aggregated);
            // The checkpoint must hold the selector as it was before the next
            // round's draw, so a resumed run draws the same clients.
            let selector_state = self.selector.draws_state(self.settings.selection.seed);
            let selection_state = self.selector.policy().state();
            let step = Instant::now();
            let packed = self.pack()?;
            steps.packing = step.elapsed();
            let this_round = std::mem::take(&mut dispatched);
            let step = Instant::now();
            if round < last_round {
                dispatched = self.dispatch(round + 1, Arc::clone(&packed.wire))?;
            }
            steps.dispatching = step.elapsed();
            let step = Instant::now();
            let accuracy = self.evaluate_and_record(round, &this_round, aggregated, &packed)?;
            steps.recording = step.elapsed();
            let target = self.settings.target_accuracy;
            let target_reached = target.is_some_and(|target| accuracy >= target);
            let stopping = round < last_round && self.observer.stop_requested();
            let interval = self.settings.checkpoint_interval.max(1);
            let step = Instant::now();
            let due = round % interval == 0 || round == last_round || target_reached || stopping;
            if self.leader() && due {
                let written = self.recorder.checkpoint(&CheckpointState {
                    round,
                    model_bytes: &packed.model_bytes,
                    selector: selector_state,
                    selection: selection_state.clone(),
                    strategy: self.strategy.as_ref(),
                    rows: &self.rows,
                    config_hash: &self.settings.config_hash,
                    asynchronous: None,
                })?;
                if let Some(sidecar) = written {
                    self.strategy_checkpointed(round)?;
                    self.observer
                        .on_event(&RunEvent::CheckpointWritten { round, sidecar });
                }
            }
            steps.checkpointing = step.elapsed();
            steps.log(round);
            if stopping && !target_reached {
                tracing::info!(round, "stopped by the caller");
                self.transport.cancel();
                return Err(crate::events::Stopped { round }.into());
            }
            if target_reached {
                tracing::info!(round, accuracy, "target accuracy reached");
                // The next round may already be training; its work is dropped.
                self.transport.cancel();
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// What `round`'s clients reported, for a utility selection: the
    /// aggregated ones' losses and durations, the dropped ones' durations
    /// where the simulated clock timed them.
    fn observe_round(&mut self, round: u32, aggregated: &Aggregated) {
        if !self.selector.policy().uses_feedback() {
            return;
        }
        let feedback: Vec<Feedback> = aggregated
            .reports
            .iter()
            .zip(&aggregated.arrivals)
            .map(|(report, arrival)| feedback_of(report, arrival.simulated))
            .collect();
        self.selector.observe(round, &feedback);
        for dropped in &aggregated.dropped {
            if let Some(task) = dropped.simulated {
                self.selector
                    .observe_duration(dropped.client_id, task_seconds(&task));
            }
        }
    }

    fn context(&self, round: u32) -> RoundContext {
        let selection = &self.settings.selection;
        RoundContext {
            round,
            learning_rate: self
                .settings
                .schedule
                .rate(self.settings.learning_rate, round),
            per_round: selection.per_round,
            total_clients: selection.total_clients,
        }
    }

    /// The global model as a model file and as the wire pipeline makes it;
    /// with the default pipeline and no BatchNorm the two are the same bytes,
    /// packed once.
    fn pack(&self) -> anyhow::Result<Packed> {
        self.pack_tree(&self.global)
    }

    /// [`RoundLoop::pack`] of any model of the run (an asynchronous run's
    /// older versions).
    fn pack_tree(&self, tree: &ParamTree) -> anyhow::Result<Packed> {
        let file_tree = layout::to_model_file(tree);
        let model_bytes = Arc::new(codec::encode(file_tree.as_ref().unwrap_or(tree))?);
        let outbound = &self.settings.outbound;
        let wire = if outbound.steps() == [Processor::SafetensorEncode] {
            match file_tree {
                // The file's BatchNorm counters are not part of the tree that travels.
                Some(_) => Arc::new(codec::encode(tree)?),
                None => Arc::clone(&model_bytes),
            }
        } else {
            Arc::new(
                outbound
                    .send(tree)
                    .context("server.outbound_processors failed on the global model")?,
            )
        };
        Ok(Packed { model_bytes, wire })
    }

    /// Selects the round's clients and hands their tasks to the transport.
    fn dispatch(&mut self, round: u32, global_payload: Arc<Vec<u8>>) -> anyhow::Result<Dispatched> {
        let Selected {
            clients,
            sim_start,
            train_start,
            candidates,
        } = self.select_clients(round, &global_payload)?;
        tracing::info!(round, clients = ?clients, "round dispatched");
        let tasks = plan_tasks(
            self.strategy.as_ref(),
            &self.context(round),
            &clients,
            &self.global,
        )?;
        let extra_bytes = tasks.iter().map(|t| t.instructions.extra_bytes()).sum();
        let payload_bytes = global_payload.len() as u64;
        self.transport.dispatch(global_payload, tasks)?;
        Ok(Dispatched {
            clients,
            payload_bytes,
            extra_bytes,
            sim_start,
            train_start,
            candidates,
        })
    }

    /// Waits for every dispatched task; keeps the updates that unpack and
    /// pass their checks, each checked as it arrives (before a round that
    /// folds its updates may move it to disk). The whole round (`dispatched`, not a rank's part of it) is timed on the
    /// simulated clock and must have `min_per_round` updates.
    fn collect(
        &mut self,
        round: u32,
        clients: &[u32],
        dispatched: Option<&Dispatched>,
    ) -> anyhow::Result<Collected> {
        self.observer.on_event(&RunEvent::RoundStarted {
            round,
            clients: clients.len(),
        });
        let masked = self.masked_by_clients();
        let mut store = match &self.settings.spill {
            Some(spill) if self.folds_updates() => Some(UpdateStore::new(spill, round)),
            _ => None,
        };
        let (settings, facts, global) = (&self.settings, &self.clients, &self.global);
        let check = |arrived: &Arrived| {
            let max_seconds = settings.max_report_seconds;
            expected_of(facts, &settings.own_data, arrived).and_then(|expected| {
                if masked {
                    check_report(arrived, &expected, max_seconds)
                } else {
                    check_update(arrived, &expected, global, max_seconds)
                }
            })
        };
        let intake = Intake {
            inbound: &settings.inbound,
            limits: &settings.limits,
            masked,
            check: &check,
            store: store.as_mut(),
        };
        // One bad client is dropped from its round, never the end of the run.
        let mut collected = collect_updates(
            self.transport.as_mut(),
            clients.len(),
            intake,
            &mut *self.observer,
            round,
        )?;
        if let Some(store) = &store
            && store.spilled() > 0
        {
            tracing::info!(
                round,
                spilled = store.spilled(),
                file = %store.path().display(),
                "updates past their share of server.max_inflight_bytes wait on disk for aggregation"
            );
        }
        collected.store = store;
        if let Some(dispatched) = dispatched {
            collected.simulated_end = self.time_round(round, dispatched, &mut collected);
        }
        if !self.masked_by_clients() {
            self.simulate_attacks(round, &mut collected);
        }
        if let Some(ratio) = self.settings.max_update_norm_ratio {
            self.drop_outliers(round, ratio, &mut collected);
        }
        if dispatched.is_some() {
            self.require_min(
                round,
                collected.updates.len(),
                clients.len(),
                &collected.failures,
            )?;
        }
        Ok(collected)
    }

    /// Whether updates stay with their clients (secure aggregation in
    /// network mode): reports arrive without them.
    fn masked_by_clients(&self) -> bool {
        self.settings
            .secure
            .as_ref()
            .is_some_and(|secure| secure.network.is_some())
    }

    /// `arrived`'s client is out of the round: `what` happened, `detail` says why.
    fn drop_update(
        &mut self,
        round: u32,
        arrived: &Arrived,
        what: &str,
        detail: String,
        failures: &mut Vec<Dropped>,
    ) {
        failures.push(dropped_update(
            round,
            arrived,
            what,
            detail,
            &mut *self.observer,
        ));
    }

    /// Whether this round's updates are folded into the mean one at a time
    /// as they are read back ([`RoundLoop::aggregate_folded`]), so that past
    /// the budget they wait on disk: only where nothing needs them all in
    /// memory at once. Hooks, kept updates, norm screening, attacks and
    /// strategies of their own arithmetic see every update; ranks, secure
    /// aggregation and asynchronous rounds have their own paths.
    fn folds_updates(&self) -> bool {
        let settings = &self.settings;
        settings.spill.is_some()
            && self.ranks.is_none()
            && settings.secure.is_none()
            && settings.asynchronous.is_none()
            && settings.max_update_norm_ratio.is_none()
            && settings.attack.attackers_per_round == 0
            && self.hooks.passes_through()
            && !self.recorder.keeps_updates()
            && self.strategy.aggregates_by_fedavg_mean()
    }

    /// `clients.attack`: the round's first slots replace their updates.
    fn simulate_attacks(&self, round: u32, collected: &mut Collected) {
        let attack = &self.settings.attack;
        for arrived in &mut collected.updates {
            if arrived.slot < attack.attackers_per_round as usize {
                let honest = std::mem::replace(&mut arrived.tree, ParamTree::None);
                arrived.tree =
                    cohort_core::attack::apply(attack.kind, attack.scale, &self.global, honest);
                tracing::info!(round, client = arrived.report.client_id, attack = ?attack.kind, "simulated attacker");
            }
        }
    }

    /// `server.max_update_norm_ratio`: an update farther from the global
    /// model than `ratio` times the round's (lower) median distance is
    /// dropped, so one huge but finite update cannot carry the average away
    /// (a mean has no defence against it).
    fn drop_outliers(&mut self, round: u32, ratio: f64, collected: &mut Collected) {
        let norms: Vec<f64> = collected
            .updates
            .iter()
            .map(|a| a.tree.float_distance(&self.global).unwrap_or(f64::INFINITY))
            .collect();
        let mut sorted = norms.clone();
        sorted.sort_by(f64::total_cmp);
        let Some(&median) = sorted.get(sorted.len().saturating_sub(1) / 2) else {
            return;
        };
        let mut kept = Vec::with_capacity(norms.len());
        for (arrived, norm) in std::mem::take(&mut collected.updates)
            .into_iter()
            .zip(norms)
        {
            if norm > ratio * median {
                let detail = format!(
                    "its distance from the global model, {}, is more than \
                     server.max_update_norm_ratio = {ratio} times the round's median {}",
                    cohort_core::number::shown(norm),
                    cohort_core::number::shown(median)
                );
                self.drop_update(
                    round,
                    &arrived,
                    "update too far",
                    detail,
                    &mut collected.failures,
                );
            } else {
                kept.push(arrived);
            }
        }
        collected.updates = kept;
    }

    /// What `arrived`'s report must say ([`expected_of`]).
    fn expected_report(&self, arrived: &Arrived) -> Result<ExpectedReport, String> {
        expected_of(&self.clients, &self.settings.own_data, arrived)
    }

    /// Fewer than `clients.min_per_round` updates stop the run.
    fn require_min(
        &self,
        round: u32,
        updates: usize,
        selected: usize,
        failures: &[Dropped],
    ) -> anyhow::Result<()> {
        let min_per_round = self.settings.min_per_round;
        if updates < min_per_round {
            bail!(
                "round {round}: only {updates} of {selected} clients returned an update, and \
                 clients.min_per_round = {min_per_round}; the global model stays at round {}. \
                 Dropped: {}{}",
                round - 1,
                failures
                    .iter()
                    .map(Dropped::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
                self.attack_note()
            );
        }
        Ok(())
    }

    /// Why a round may have failed that the run was warned of: more
    /// simulated attackers than the strategy withstands.
    fn attack_note(&self) -> String {
        self.settings
            .attack
            .warning
            .as_ref()
            .map_or(String::new(), |warning| format!(" ({warning})"))
    }

    /// The global model after `aggregated`, the outcome of the strategy's
    /// aggregation from the state `before`. A model that is not finite
    /// (refused by the strategy, or found here) or steps too far
    /// ([`RoundLoop::refusal`]) does not replace the global one: the
    /// strategy goes back to `before` and the round ends with the
    /// model it started from, so one huge update costs a round, not the run.
    /// The outcome's model has moved into the loop when it returns.
    fn adopt(
        &mut self,
        round: u32,
        aggregated: Result<strategies::Aggregated, StrategyError>,
        before: strategies::StrategyState,
    ) -> anyhow::Result<strategies::Aggregated> {
        let reason = match aggregated {
            Err(StrategyError::Aggregation(error @ AggregationError::NonFinite { .. })) => {
                error.to_string()
            }
            Err(error) => {
                return Err(anyhow::Error::new(error).context(format!(
                    "round {round}: aggregation refused{}",
                    self.attack_note()
                )));
            }
            Ok(mut outcome) => match outcome.model.as_ref().and_then(|m| self.refusal(m)) {
                Some(reason) => reason,
                None => {
                    match outcome.model.take() {
                        Some(model) => self.global = model,
                        None => tracing::warn!(
                            round,
                            "total sample weight is zero; global model unchanged"
                        ),
                    }
                    return Ok(outcome);
                }
            },
        };
        self.strategy.restore(before).with_context(|| {
            format!(
                "round {round}: cannot return {} to its state before the round",
                self.strategy.name()
            )
        })?;
        tracing::warn!(round, %reason, "aggregated model refused; the global model stays at round {}", round - 1);
        self.observer
            .on_event(&RunEvent::ModelKept { round, reason });
        Ok(strategies::Aggregated::unchanged())
    }

    /// Why `model` may not become the global model, if it may not: a value
    /// that is not finite, or a step from the global model larger than
    /// `server.max_model_step_ratio` times the global model's norm (at least
    /// 1), which no honest round takes and one huge finite update does.
    fn refusal(&self, model: &ParamTree) -> Option<String> {
        if let Some((path, index)) = model.first_non_finite() {
            return Some(format!(
                "the aggregated model is not finite at `{path}`[{index}]"
            ));
        }
        let ratio = self.settings.max_model_step_ratio;
        let scale = self.global.float_norm().max(1.0);
        let step = model.float_distance(&self.global).unwrap_or(f64::INFINITY);
        (step > ratio * scale).then(|| {
            format!(
                "the aggregated model is {} from the global model, more than \
                 server.max_model_step_ratio = {ratio} times its norm {}",
                cohort_core::number::shown(step),
                cohort_core::number::shown(scale)
            )
        })
    }

    /// Server hooks under their contract, then the strategy's aggregation.
    fn aggregate(&mut self, round: u32, mut collected: Collected) -> anyhow::Result<Aggregated> {
        if let Some(store) = collected.store.take() {
            return self.aggregate_folded(round, collected, store);
        }
        let dropped = std::mem::take(&mut collected.failures);
        let simulated_end = collected.simulated_end;
        let (payloads, arrivals) =
            hooked_payloads(round, collected, &mut *self.hooks, &self.global)?;
        if self.leader() {
            self.recorder.updates(round, &payloads)?;
        }
        let updates: Vec<ClientUpdate<'_>> = payloads
            .iter()
            .map(|payload| ClientUpdate {
                client_id: payload.report.client_id,
                num_samples: payload.report.num_samples,
                local_steps: payload.report.local_steps,
                tree: payload.tree(),
            })
            .collect();
        let before = self.strategy.state();
        let aggregated = self
            .strategy
            .aggregate(&self.context(round), &self.global, &updates);
        let outcome = self.adopt(round, aggregated, before)?;
        if let Some(selected) = &outcome.selected {
            tracing::info!(round, clients = ?selected, "updates the strategy used");
        }
        Ok(Aggregated {
            reports: payloads.into_iter().map(|p| p.into_parts().0).collect(),
            arrivals,
            dropped,
            privacy: outcome.privacy,
            secagg: None,
            simulated_end,
        })
    }
}

/// What `arrived`'s report must say: the numbers of the partition the
/// server computed, or for an own-data client what its declaration allows.
fn expected_of(
    clients: &ClientFacts,
    rules: &OwnDataRules,
    arrived: &Arrived,
) -> Result<ExpectedReport, String> {
    let client_id = arrived.report.client_id;
    if let Some(max_samples) = clients.self_reported {
        return self_reported_expectation(&arrived.report, &arrived.arrival, max_samples);
    }
    if (1..=rules.clients).contains(&client_id) {
        return own_data_expectation(arrived.report.num_samples, arrived.declared, rules);
    }
    (client_id as usize)
        .checked_sub(1)
        .and_then(|index| clients.expected.get(index))
        .copied()
        .ok_or_else(|| "no such client".to_owned())
}

/// The run's selector: the start point's stream, and its policy fresh or as
/// the checkpoint left it.
fn selector(parts: &LoopParts<'_>, start: &StartPoint) -> anyhow::Result<Selector> {
    let config = &parts.settings.selection.policy;
    let prior = client_prior(parts, &start.global)?;
    let policy = match &start.selection {
        crate::start::SelectionStart::Fresh => Policy::fresh(config, &prior),
        crate::start::SelectionStart::Resumed(state) => {
            Policy::restore(config, &prior, state.clone())
                .map_err(anyhow::Error::msg)
                .context("the checkpoint's client selection cannot continue")?
        }
    };
    if let Policy::PowerOfChoice(power) = &policy {
        // Said once, as a checkpoint from before the choice existed keeps
        // ranking by what it was learnt with.
        tracing::info!(
            loss = power.loss().name(),
            "power-of-choice ranks its candidates by clients.power_of_choice.loss"
        );
    }
    Ok(Selector::new(start.selector.clone(), policy).stratified(config.strata))
}

/// What the server knows of each client before it trains: its partition's
/// samples, and its task's simulated duration (the model down and up and
/// its samples trained) or, without device profiles, its samples.
fn client_prior(parts: &LoopParts<'_>, global: &ParamTree) -> anyhow::Result<ClientPrior> {
    let total = parts.settings.selection.total_clients;
    if parts.settings.selection.policy.kind == cohort_core::selection::SelectionKind::Random {
        return Ok(ClientPrior::default());
    }
    let model_bytes = codec::encode(global)?.len() as u64;
    let samples: Vec<u64> = (0..total as usize)
        .map(|i| parts.clients.expected.get(i).map_or(0, |e| e.train_samples))
        .collect();
    let durations = samples
        .iter()
        .zip(1..=total)
        .map(|(&n, client)| match &parts.devices {
            Some(devices) => devices
                .task(client, 0.0, model_bytes, n, model_bytes)
                .map_or(n as f64, |task| task_seconds(&task)),
            None => n as f64,
        })
        .collect();
    Ok(ClientPrior { samples, durations })
}

/// A task's simulated seconds: download, training and upload.
fn task_seconds(task: &cohort_core::results::SimulatedTask) -> f64 {
    task.download + task.compute + task.upload
}

/// What a policy learns from `report`: its loss and samples, and its
/// simulated duration, or without device profiles its samples (never the
/// measured time, which would make the choice depend on the machine).
fn feedback_of(
    report: &ClientReport,
    simulated: Option<cohort_core::results::SimulatedTask>,
) -> Feedback {
    Feedback {
        client_id: report.client_id,
        samples: report.num_samples,
        loss: report.loss,
        duration: simulated.map_or(report.num_samples as f64, |t| task_seconds(&t)),
    }
}

/// Where the round loop's thread spent one round, in run.log (`round steps`),
/// so a run shows how much of it was anything but waiting for training:
/// `bench/scale.sh` reads it. Collecting is mostly waiting for the clients;
/// it also unpacks and checks their updates (their share is in each client's
/// `processing_time`). Recording holds the test-set evaluation, which
/// overlaps the next round's training.
#[derive(Debug, Default)]
struct StepTimes {
    collecting: Duration,
    aggregating: Duration,
    packing: Duration,
    dispatching: Duration,
    recording: Duration,
    checkpointing: Duration,
}

impl StepTimes {
    fn log(&self, round: u32) {
        tracing::info!(
            round,
            collecting = self.collecting.as_secs_f64(),
            aggregating = self.aggregating.as_secs_f64(),
            packing = self.packing.as_secs_f64(),
            dispatching = self.dispatching.as_secs_f64(),
            recording = self.recording.as_secs_f64(),
            checkpointing = self.checkpointing.as_secs_f64(),
            "round steps"
        );
    }
}

mod asynchronous;
mod candidates;
mod devices;
mod evaluate;
mod folded;
mod partial;
mod realtime;
mod secure;
#[cfg(test)]
mod tests;
