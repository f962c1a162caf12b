//! What comes back from the clients, and what the server lets into a round:
//! outcomes unpacked and put back in selection order, each update held
//! against what the server knows (the global model's layout, finite values,
//! the sample and step counts of the partitions it computed or an own-data
//! client's declaration), and the server hooks' positional contract.
//!
//! One bad client is dropped from its round with the reason, never the end
//! of the run.

use std::time::Instant;

use anyhow::Context;

use cohort_core::codec::DecodeLimits;
use cohort_core::hooks::{ClientReport, ReceivedPayload, RoundPayloads, ServerHooks};
use cohort_core::number::shown;
use cohort_core::strategy::{RoundContext, Strategy};
use cohort_core::tree::{DTypeRule, ParamTree, check_schema};
use cohort_train::trainer::ClientTask;

use crate::client::ClientPartitions;
use crate::events::{RunEvent, RunObserver};
use crate::spill::UpdateStore;
use crate::transport::{ClientOutcome, Declared, Delivered, TaskInstructions, TaskSpec, Transport};

/// What the server asks of an own-data client's report (`cohort client
/// --data`): its sample count is its own word, bounded by these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OwnDataRules {
    /// Clients `1..=clients` bring their own data.
    pub(crate) clients: u32,
    pub(crate) max_samples: u64,
    pub(crate) epochs: u32,
    pub(crate) batch_size: usize,
    /// `clients.do_test`: its held-out samples are evaluated too.
    pub(crate) do_test: bool,
    /// Output rows the task scores per held-out sample (1 for
    /// classification): reports count held-out rows.
    pub(crate) rows_per_sample: u64,
}

/// One client's numbers for the results files and simulated time.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Arrival {
    pub(crate) processing_time: f64,
    pub(crate) comm_time: f64,
    pub(crate) payload_bytes: u64,
    /// Held-out samples the client evaluated the global model on, and how
    /// many it got right (`clients.do_test`).
    pub(crate) test_samples: u64,
    pub(crate) test_correct: u64,
    /// The task on the simulated clock, with a `[clients.profile]`.
    pub(crate) simulated: Option<cohort_core::results::SimulatedTask>,
    /// Asynchronous runs: aggregations since the model it trained from.
    pub(crate) staleness: Option<u32>,
    /// The task on the server's real clock, where that clock orders the run.
    pub(crate) wall: Option<cohort_core::results::WallTask>,
}

/// An update that arrived and unpacked, with its slot in the selection.
#[derive(Debug)]
pub(crate) struct Arrived {
    pub(crate) slot: usize,
    pub(crate) report: ClientReport,
    pub(crate) tree: ParamTree,
    pub(crate) arrival: Arrival,
    /// An own-data client's declaration at registration.
    pub(crate) declared: Option<Declared>,
}

/// A client dropped from its round, and why.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Dropped {
    pub(crate) client_id: u32,
    /// The worker that ran the task, when it got that far.
    pub(crate) worker: Option<usize>,
    pub(crate) reason: String,
    /// The task on the simulated clock as far as it got (a client lost when
    /// it went offline, or late).
    pub(crate) simulated: Option<cohort_core::results::SimulatedTask>,
    /// Asynchronous runs: how stale its update was, when it got that far.
    pub(crate) staleness: Option<u32>,
    /// The task on the server's real clock, where that clock orders the run.
    pub(crate) wall: Option<cohort_core::results::WallTask>,
}

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "client {}: {}", self.client_id, self.reason)
    }
}

/// What came back in a round, in selection order.
#[derive(Debug, Default)]
pub(crate) struct Collected {
    pub(crate) updates: Vec<Arrived>,
    /// Where the updates wait when the round folds them into the mean one
    /// at a time: some of their trees are on disk, not in `updates`.
    pub(crate) store: Option<UpdateStore>,
    pub(crate) failures: Vec<Dropped>,
    pub(crate) bytes_to_server: u64,
    /// When the round ended on the simulated clock, with a `[clients.profile]`.
    pub(crate) simulated_end: Option<f64>,
}

pub(crate) fn shared_row(arrived: &Arrived) -> crate::distributed::SharedRow {
    let (report, arrival) = (&arrived.report, &arrived.arrival);
    crate::distributed::SharedRow {
        slot: arrived.slot as u64,
        client_id: report.client_id,
        worker: report.worker as u64,
        num_samples: report.num_samples,
        local_steps: report.local_steps,
        payload_bytes: arrival.payload_bytes,
        test_samples: arrival.test_samples,
        test_correct: arrival.test_correct,
        loss: report.loss,
        training_time: report.training_time,
        processing_time: arrival.processing_time,
        comm_time: arrival.comm_time,
    }
}

pub(crate) fn unshared_row(row: &crate::distributed::SharedRow) -> (ClientReport, Arrival) {
    (
        ClientReport {
            client_id: row.client_id,
            num_samples: row.num_samples,
            loss: row.loss,
            training_time: row.training_time,
            local_steps: row.local_steps,
            worker: row.worker as usize,
        },
        Arrival {
            processing_time: row.processing_time,
            comm_time: row.comm_time,
            payload_bytes: row.payload_bytes,
            test_samples: row.test_samples,
            test_correct: row.test_correct,
            simulated: None,
            staleness: None,
            wall: None,
        },
    )
}

pub(crate) fn shared_drop(dropped: &Dropped) -> crate::distributed::SharedDrop {
    crate::distributed::SharedDrop {
        client_id: dropped.client_id,
        worker: dropped.worker.unwrap_or_default() as u64,
        reason: dropped.reason.clone(),
    }
}

/// Each selected client's task: the strategy's instructions, encoded.
pub(crate) fn plan_tasks(
    strategy: &dyn Strategy,
    ctx: &RoundContext,
    clients: &[u32],
    global: &ParamTree,
) -> anyhow::Result<Vec<TaskSpec>> {
    clients
        .iter()
        .enumerate()
        .map(|(slot, &client_id)| {
            let instructions = strategy
                .configure(ctx, client_id, global)
                .with_context(|| format!("round {}: client {client_id}", ctx.round))?;
            Ok(TaskSpec {
                slot,
                task: ClientTask {
                    client_id,
                    round: ctx.round,
                },
                instructions: TaskInstructions::encode(instructions)?,
            })
        })
        .collect()
}

/// How a round takes in what arrives: each update unpacked through
/// `inbound` within `limits` (or, `masked`, its report alone), held by
/// `check` against what the server knows, then given to `store`, which may
/// move it to disk.
pub(crate) struct Intake<'a> {
    pub(crate) inbound: &'a cohort_core::processors::Pipeline,
    pub(crate) limits: &'a DecodeLimits,
    pub(crate) masked: bool,
    pub(crate) check: &'a dyn Fn(&Arrived) -> Result<(), String>,
    pub(crate) store: Option<&'a mut UpdateStore>,
}

/// One outcome per dispatched task, in any order; the updates that unpack
/// and pass the intake's check, put back in selection (slot) order. Each is
/// checked as it arrives, before the store keeps it, so an update on disk
/// has passed every check an update in memory has. The dropped come in
/// arrival order, then the refused in slot order.
pub(crate) fn collect_updates(
    transport: &mut dyn Transport,
    tasks: usize,
    mut intake: Intake<'_>,
    observer: &mut dyn RunObserver,
    round: u32,
) -> anyhow::Result<Collected> {
    let mut collected = Collected::default();
    let mut arrived = Vec::with_capacity(tasks);
    let mut refused = Vec::new();
    for _ in 0..tasks {
        let outcome = transport.next_outcome()?;
        let client_id = outcome.task.client_id;
        // Bytes that arrived count, also when they do not unpack.
        if let Ok(delivered) = &outcome.result {
            collected.bytes_to_server += delivered.reply.payload_bytes();
        }
        match unpack_or_masked(outcome, intake.inbound, intake.limits, intake.masked) {
            Ok(mut update) => {
                observer.on_event(&RunEvent::ClientFinished { round, client_id });
                if let Err(reason) = (intake.check)(&update) {
                    let dropped =
                        dropped_update(round, &update, "update refused", reason, observer);
                    refused.push((update.slot, dropped));
                    continue;
                }
                if let Some(store) = intake.store.as_deref_mut() {
                    store.keep(&mut update)?;
                }
                arrived.push(update);
            }
            Err(dropped) => {
                tracing::warn!(
                    round,
                    client = client_id,
                    "client dropped: {}",
                    dropped.reason
                );
                observer.on_event(&RunEvent::ClientDropped {
                    round,
                    client_id,
                    reason: dropped.reason.clone(),
                });
                collected.failures.push(dropped);
            }
        }
    }
    arrived.sort_by_key(|a| a.slot);
    refused.sort_by_key(|(slot, _)| *slot);
    collected
        .failures
        .extend(refused.into_iter().map(|(_, dropped)| dropped));
    collected.updates = arrived;
    Ok(collected)
}

/// `arrived`'s client is out of the round: `what` happened, `detail` says
/// why; logged and told to the observer.
pub(crate) fn dropped_update(
    round: u32,
    arrived: &Arrived,
    what: &str,
    detail: String,
    observer: &mut dyn RunObserver,
) -> Dropped {
    let client_id = arrived.report.client_id;
    tracing::warn!(
        round,
        client = client_id,
        "{what}, client dropped: {detail}"
    );
    let reason = format!("{what}: {detail}");
    observer.on_event(&RunEvent::ClientDropped {
        round,
        client_id,
        reason: reason.clone(),
    });
    Dropped {
        client_id,
        worker: Some(arrived.report.worker),
        reason,
        simulated: arrived.arrival.simulated,
        staleness: arrived.arrival.staleness,
        wall: arrived.arrival.wall,
    }
}

/// One outcome's update, unpacked through the inbound pipeline, with its
/// report; or why the client is out of the round.
/// [`unpack`], or under secure aggregation in network mode (`masked`) a
/// report whose update stays with its client: the report alone, with no
/// tree. Such a client must send no update bytes at all: one that sends its
/// update in the clear is dropped, and its bytes never unpacked.
fn unpack_or_masked(
    outcome: ClientOutcome,
    inbound: &cohort_core::processors::Pipeline,
    limits: &DecodeLimits,
    masked: bool,
) -> Result<Arrived, Dropped> {
    if !masked {
        return unpack(outcome, inbound, limits);
    }
    let sent = outcome
        .result
        .as_ref()
        .map_or(0, |delivered| delivered.reply.payload_bytes());
    let client_id = outcome.task.client_id;
    let dropped = |reason: String| Dropped {
        client_id,
        worker: Some(outcome.worker),
        reason,
        simulated: None,
        staleness: None,
        wall: None,
    };
    if sent > 0 {
        return Err(dropped(format!(
            "sent {sent} bytes of update in the clear; under [secure_aggregation] an update \
             travels only masked, in the protocol's stages"
        )));
    }
    let delivered = outcome.result.map_err(dropped)?;
    Ok(arrived(
        outcome.slot,
        outcome.worker,
        client_id,
        delivered,
        ParamTree::None,
        0.0,
    ))
}

pub(crate) fn unpack(
    outcome: ClientOutcome,
    inbound: &cohort_core::processors::Pipeline,
    limits: &DecodeLimits,
) -> Result<Arrived, Dropped> {
    let client_id = outcome.task.client_id;
    let dropped = |reason: String| Dropped {
        client_id,
        worker: Some(outcome.worker),
        reason,
        simulated: None,
        staleness: None,
        wall: None,
    };
    let mut delivered = outcome.result.map_err(dropped)?;
    let unpacking = Instant::now();
    let (payload, length) = (&delivered.reply.payload, delivered.reply.payload_bytes());
    let tree = match delivered.reply.packed_from.take() {
        Some(tree) => inbound.receive_own(payload, saturating_len(length), tree, limits),
        None => inbound.receive(payload, limits),
    }
    .map_err(|error| dropped(format!("malformed update: {error}")))?;
    tracing::debug!(
        client = client_id,
        worker = outcome.worker,
        loss = delivered.reply.loss,
        "client finished"
    );
    let unpacking = unpacking.elapsed().as_secs_f64();
    Ok(arrived(
        outcome.slot,
        outcome.worker,
        client_id,
        delivered,
        tree,
        unpacking,
    ))
}

/// A length as `usize`, past any limit where it does not fit.
fn saturating_len(bytes: u64) -> usize {
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

/// A delivered report as the round takes it: `tree` its unpacked update
/// (none when the update stays masked with its client), `unpacking` the
/// server's seconds spent on it, added to the client's processing time.
fn arrived(
    slot: usize,
    worker: usize,
    client_id: u32,
    delivered: Delivered,
    tree: ParamTree,
    unpacking: f64,
) -> Arrived {
    let reply = delivered.reply;
    Arrived {
        slot,
        report: ClientReport {
            client_id,
            num_samples: reply.num_samples,
            loss: reply.loss,
            training_time: reply.training_time,
            local_steps: reply.local_steps,
            worker,
        },
        arrival: Arrival {
            processing_time: reply.processing_time + unpacking,
            comm_time: delivered.comm_time,
            payload_bytes: reply.payload_bytes(),
            test_samples: reply.test_samples,
            test_correct: reply.test_correct,
            simulated: None,
            staleness: None,
            wall: None,
        },
        tree,
        declared: delivered.declared,
    }
}

/// The round's payloads after the server hooks, with the positional contract
/// checked, and their arrivals in the same order.
pub(crate) fn hooked_payloads(
    round: u32,
    collected: Collected,
    hooks: &mut dyn ServerHooks,
    global: &ParamTree,
) -> anyhow::Result<(Vec<ReceivedPayload>, Vec<Arrival>)> {
    let present: Vec<u32> = collected
        .updates
        .iter()
        .map(|a| a.report.client_id)
        .collect();
    let mut arrivals = Vec::with_capacity(present.len());
    let arrived = collected
        .updates
        .into_iter()
        .enumerate()
        .map(|(position, a)| {
            arrivals.push(a.arrival);
            (position, a.report, a.tree)
        })
        .collect();
    let payloads = RoundPayloads::assemble(round, &present, arrived)?
        .apply_hooks(hooks, global)?
        .into_payloads();
    Ok((payloads, arrivals))
}

/// What a client's report must say: the server computed the partitions, so
/// it knows every client's sample counts and how many local steps they make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ExpectedReport {
    pub(crate) train_samples: u64,
    pub(crate) local_steps: u64,
    pub(crate) test_samples: u64,
}

pub(crate) fn expected_reports(
    partitions: &ClientPartitions,
    epochs: u32,
    batch_size: usize,
    rows_per_sample: u64,
) -> Vec<ExpectedReport> {
    partitions
        .train
        .iter()
        .zip(&partitions.test)
        .map(|(train, test)| ExpectedReport {
            train_samples: train.len() as u64,
            local_steps: u64::from(epochs) * train.len().div_ceil(batch_size.max(1)) as u64,
            test_samples: test.len() as u64 * rows_per_sample,
        })
        .collect()
}

/// What an own-data client's report must say. Its sample count is its own
/// word, so it is bounded, never trusted: at least 1, at most what it declared
/// at registration and `clients.max_samples`. Its local steps follow from the
/// count (`epochs · ⌈n / batch_size⌉`, which SCAFFOLD relies on), and its
/// held-out samples are all it declared when the run evaluates on clients.
pub(crate) fn own_data_expectation(
    num_samples: u64,
    declared: Option<Declared>,
    rules: &OwnDataRules,
) -> Result<ExpectedReport, String> {
    let declared = declared.ok_or_else(|| {
        "is an own-data client, but its update did not come from an own-data registration"
            .to_owned()
    })?;
    let max_samples = rules.max_samples;
    if num_samples == 0 || num_samples > declared.train_samples.min(max_samples) {
        return Err(format!(
            "reports {num_samples} training samples; it declared {} at registration, and \
             clients.max_samples = {max_samples}",
            declared.train_samples
        ));
    }
    let batches = num_samples.div_ceil(rules.batch_size.max(1) as u64);
    let local_steps = u64::from(rules.epochs)
        .checked_mul(batches)
        .ok_or_else(|| format!("{num_samples} training samples overflow the local step count"))?;
    Ok(ExpectedReport {
        train_samples: num_samples,
        local_steps,
        test_samples: if rules.do_test {
            declared
                .test_samples
                .checked_mul(rules.rows_per_sample)
                .ok_or_else(|| {
                    format!(
                        "{} held-out samples overflow the row count",
                        declared.test_samples
                    )
                })?
        } else {
            0
        },
    })
}

/// What a report of a client that is the caller's own code must say
/// (`cohort.simulate`'s Python clients): the server knows nothing of its
/// data, so its counts are its own word, bounded: at most `max_samples`
/// (`clients.max_samples`) training and held-out samples each, so one
/// client cannot claim the whole weight of an average by a huge count.
/// Zero samples is allowed (a Flower client may report it; it weighs
/// nothing).
pub(crate) fn self_reported_expectation(
    report: &ClientReport,
    arrival: &Arrival,
    max_samples: u64,
) -> Result<ExpectedReport, String> {
    for (what, claimed) in [
        ("training", report.num_samples),
        ("held-out", arrival.test_samples),
    ] {
        if claimed > max_samples {
            return Err(format!(
                "reports {claimed} {what} samples, more than clients.max_samples = {max_samples}"
            ));
        }
    }
    Ok(ExpectedReport {
        train_samples: report.num_samples,
        local_steps: report.local_steps,
        test_samples: arrival.test_samples,
    })
}

/// Why an update that unpacked cannot join the round: a layout other than
/// the global model's, a value that is not finite, numbers in its report
/// other than the server knows them to be, or a training or processing time
/// above `max_seconds` (a finite time that large would make the simulated
/// time infinite, and no checkpoint could store it).
pub(crate) fn check_update(
    arrived: &Arrived,
    expected: &ExpectedReport,
    global: &ParamTree,
    max_seconds: f64,
) -> Result<(), String> {
    check_schema(global, &arrived.tree, DTypeRule::AnyFloat)
        .map_err(|mismatch| format!("the update does not match the global model: {mismatch}"))?;
    if let Some((path, index)) = arrived.tree.first_non_finite() {
        return Err(format!(
            "the update is poisoned: `{path}`[{index}] is not finite"
        ));
    }
    check_report(arrived, expected, max_seconds)
}

/// The report's numbers against what the server expects; under secure
/// aggregation in network mode the whole check, as the update stays with
/// its client (the protocol checks the masked vector's length and range).
pub(crate) fn check_report(
    arrived: &Arrived,
    expected: &ExpectedReport,
    max_seconds: f64,
) -> Result<(), String> {
    let report = &arrived.report;
    let arrival = &arrived.arrival;
    let claims = [
        (
            "training samples",
            report.num_samples,
            expected.train_samples,
        ),
        ("local steps", report.local_steps, expected.local_steps),
        (
            "held-out samples",
            arrival.test_samples,
            expected.test_samples,
        ),
    ];
    for (what, claimed, known) in claims {
        if claimed != known {
            return Err(format!(
                "reports {claimed} {what}, but the server expects {known}"
            ));
        }
    }
    for (what, value) in [
        ("loss", report.loss),
        ("training time", report.training_time),
        ("processing time", arrival.processing_time),
    ] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("reports a {what} of {value}"));
        }
    }
    for (what, value) in [
        ("training time", report.training_time),
        ("processing time", arrival.processing_time),
    ] {
        if value > max_seconds {
            return Err(format!(
                "reports a {what} of {} s, more than the {} s a task may take \
                 (server.payload_timeout over the network)",
                shown(value),
                shown(max_seconds)
            ));
        }
    }
    if arrival.test_correct > arrival.test_samples {
        return Err(format!(
            "reports {} of {} held-out samples correct",
            arrival.test_correct, arrival.test_samples
        ));
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::VecDeque;
    use std::sync::Arc;

    use cohort_core::codec;
    use cohort_core::hooks::NoHooks;
    use cohort_core::processors::Pipeline;
    use cohort_core::strategy::{AlgorithmConfig, fedprox::FedProxConfig};
    use cohort_core::tree::Array;

    use super::*;
    use crate::client::ClientReply;
    use crate::transport::{ClientOutcome, Delivered};

    fn tree(values: &[f32]) -> ParamTree {
        ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![values.len()], values.to_vec()).unwrap(),
        )])
    }

    fn ctx(round: u32) -> RoundContext {
        RoundContext {
            round,
            learning_rate: 0.1,
            per_round: 3,
            total_clients: 10,
        }
    }

    /// Hands out canned outcomes in the order given.
    #[derive(Default)]
    struct ScriptedTransport {
        dispatched: Vec<TaskSpec>,
        outcomes: VecDeque<ClientOutcome>,
    }

    impl Transport for ScriptedTransport {
        fn dispatch(&mut self, _payload: Arc<Vec<u8>>, tasks: Vec<TaskSpec>) -> anyhow::Result<()> {
            self.dispatched.extend(tasks);
            Ok(())
        }

        fn next_outcome(&mut self) -> anyhow::Result<ClientOutcome> {
            self.outcomes
                .pop_front()
                .ok_or_else(|| anyhow::anyhow!("no outcome left"))
        }

        fn cancel(&mut self) {}
    }

    fn outcome(slot: usize, client_id: u32, payload: Result<Vec<u8>, &str>) -> ClientOutcome {
        ClientOutcome {
            slot,
            task: ClientTask {
                client_id,
                round: 1,
            },
            worker: 0,
            result: payload
                .map(|payload| Delivered {
                    reply: ClientReply {
                        num_samples: 10 * client_id as u64,
                        loss: 0.5,
                        training_time: client_id as f64,
                        processing_time: 0.0,
                        local_steps: 3,
                        test_samples: 4,
                        test_correct: 3,
                        payload: payload.into(),
                        packed_from: None,
                        unwritten_len: None,
                    },
                    comm_time: 0.0,
                    declared: None,
                })
                .map_err(str::to_owned),
        }
    }

    fn collect(outcomes: Vec<ClientOutcome>) -> Collected {
        let tasks = outcomes.len();
        let mut transport = ScriptedTransport {
            outcomes: outcomes.into(),
            ..Default::default()
        };
        let inbound = Pipeline::receiver(
            "server.inbound_processors",
            &["safetensor_decode".to_owned()],
        )
        .unwrap();
        let intake = Intake {
            inbound: &inbound,
            limits: &DecodeLimits::default(),
            masked: false,
            check: &|_| Ok(()),
            store: None,
        };
        collect_updates(
            &mut transport,
            tasks,
            intake,
            &mut crate::events::Unobserved,
            1,
        )
        .unwrap()
    }

    #[test]
    fn plan_tasks_carries_each_clients_instructions_in_selection_order() {
        let fedprox = AlgorithmConfig::Fedprox(FedProxConfig { mu: 0.25 })
            .build()
            .unwrap();
        let tasks = plan_tasks(fedprox.as_ref(), &ctx(4), &[7, 2, 9], &tree(&[0.0])).unwrap();
        let clients: Vec<(usize, u32, u32)> = tasks
            .iter()
            .map(|t| (t.slot, t.task.client_id, t.task.round))
            .collect();
        assert_eq!(clients, [(0, 7, 4), (1, 2, 4), (2, 9, 4)]);
        assert!(tasks.iter().all(|t| t.instructions.proximal_mu == 0.25
            && t.instructions.learning_rate == 0.1
            && t.instructions.correction.is_none()));

        // SCAFFOLD's correction travels as plain safetensors of the model's layout.
        let scaffold = AlgorithmConfig::Scaffold(Default::default())
            .build()
            .unwrap();
        let tasks = plan_tasks(scaffold.as_ref(), &ctx(1), &[1], &tree(&[5.0, 6.0])).unwrap();
        let bytes = tasks[0].instructions.correction.as_ref().unwrap();
        assert_eq!(tasks[0].instructions.extra_bytes(), bytes.len() as u64);
        let correction = codec::decode(bytes, &DecodeLimits::default()).unwrap();
        assert_eq!(correction, tree(&[0.0, 0.0]));
    }

    #[test]
    fn collect_orders_updates_by_slot_and_drops_failed_and_malformed_clients() {
        let good = |v: f32| Ok(codec::encode(&tree(&[v])).unwrap());
        let collected = collect(vec![
            outcome(3, 4, good(4.0)),
            outcome(0, 1, Err("timed out")),
            outcome(2, 3, Ok(b"not safetensors".to_vec())),
            outcome(1, 2, good(2.0)),
        ]);
        let order: Vec<(usize, u32)> = collected
            .updates
            .iter()
            .map(|a| (a.slot, a.report.client_id))
            .collect();
        assert_eq!(order, [(1, 2), (3, 4)]);
        assert_eq!(collected.updates[0].tree, tree(&[2.0]));
        assert_eq!(collected.updates[0].report.local_steps, 3);
        assert_eq!(collected.failures.len(), 2, "{:?}", collected.failures);
        assert_eq!(collected.failures[0].to_string(), "client 1: timed out");
        assert!(
            collected.failures[1]
                .to_string()
                .starts_with("client 3: malformed update")
        );
        // Bytes that arrived count, also when they did not unpack.
        let expected = 2 * codec::encode(&tree(&[0.0])).unwrap().len() as u64 + 15;
        assert_eq!(collected.bytes_to_server, expected);
    }

    #[test]
    fn hooked_payloads_keep_reports_and_arrivals_aligned() {
        let good = |v: f32| Ok(codec::encode(&tree(&[v])).unwrap());
        let collected = collect(vec![outcome(1, 8, good(8.0)), outcome(0, 5, good(5.0))]);
        let (payloads, arrivals) =
            hooked_payloads(1, collected, &mut NoHooks, &tree(&[0.0])).unwrap();
        let ids: Vec<u32> = payloads.iter().map(|p| p.report.client_id).collect();
        assert_eq!(ids, [5, 8]);
        assert_eq!(payloads[1].tree(), &tree(&[8.0]));
        assert_eq!(arrivals.len(), 2);
    }

    #[test]
    fn updates_are_checked_against_what_the_server_knows() {
        let expected = ExpectedReport {
            train_samples: 30,
            local_steps: 3,
            test_samples: 4,
        };
        let arrived = |tree: ParamTree, local_steps: u64| Arrived {
            slot: 0,
            report: ClientReport {
                local_steps,
                ..report(1, 30, 0.5, 1.0)
            },
            tree,
            arrival: arrival(10, (4, 3)),
            declared: None,
        };
        let global = tree(&[0.0, 0.0]);
        assert_eq!(
            check_update(&arrived(tree(&[1.0, 2.0]), 3), &expected, &global, 600.0),
            Ok(())
        );
        let transposed = check_update(&arrived(tree(&[1.0]), 3), &expected, &global, 600.0);
        assert!(
            transposed
                .unwrap_err()
                .contains("does not match the global model")
        );
        let poisoned = check_update(
            &arrived(tree(&[1.0, f32::NAN]), 3),
            &expected,
            &global,
            600.0,
        );
        assert!(poisoned.unwrap_err().contains("`w`[1] is not finite"));
        let steps = check_update(&arrived(tree(&[1.0, 2.0]), 0), &expected, &global, 600.0);
        assert_eq!(
            steps.unwrap_err(),
            "reports 0 local steps, but the server expects 3"
        );
        let mut greedy = arrived(tree(&[1.0, 2.0]), 3);
        greedy.report.num_samples = u64::MAX;
        assert!(
            check_update(&greedy, &expected, &global, 600.0)
                .unwrap_err()
                .contains("training samples")
        );
    }

    #[test]
    fn reported_times_above_the_payload_timeout_are_refused() {
        let expected = ExpectedReport {
            train_samples: 30,
            local_steps: 1,
            test_samples: 4,
        };
        let global = tree(&[0.0]);
        let timed = |training_time: f64, processing_time: f64| Arrived {
            slot: 0,
            report: report(1, 30, 0.5, training_time),
            tree: tree(&[1.0]),
            arrival: Arrival {
                processing_time,
                ..arrival(10, (4, 3))
            },
            declared: None,
        };
        // Up to the bound is fine: a task may take as long as the server waits.
        assert_eq!(
            check_update(&timed(600.0, 600.0), &expected, &global, 600.0),
            Ok(())
        );
        // Each finite, but their sum over a round is infinite.
        let huge = check_update(&timed(1.7e308, 0.5), &expected, &global, 600.0).unwrap_err();
        assert!(
            huge.contains("training time of 1.7e308 s") && huge.contains("600 s"),
            "{huge}"
        );
        let huge = check_update(&timed(1.0, 1.7e308), &expected, &global, 600.0).unwrap_err();
        assert!(huge.contains("processing time of 1.7e308 s"), "{huge}");
        let late = check_update(&timed(600.5, 0.0), &expected, &global, 600.0).unwrap_err();
        assert!(late.contains("training time of 600.5 s"), "{late}");
    }

    #[test]
    fn an_own_data_clients_report_is_bounded_by_its_declaration_and_max_samples() {
        let mut rules = OwnDataRules {
            clients: 1,
            max_samples: 1000,
            epochs: 2,
            batch_size: 10,
            do_test: false,
            rows_per_sample: 1,
        };
        let declared = Some(Declared {
            train_samples: 25,
            test_samples: 7,
        });
        // 25 samples in batches of 10 are 3 steps an epoch, 6 in two epochs;
        // without clients.do_test no held-out samples are expected.
        assert_eq!(
            own_data_expectation(25, declared, &rules),
            Ok(ExpectedReport {
                train_samples: 25,
                local_steps: 6,
                test_samples: 0,
            })
        );
        rules.do_test = true;
        assert_eq!(
            own_data_expectation(11, declared, &rules).map(|e| (e.local_steps, e.test_samples)),
            Ok((4, 7))
        );
        for greedy in [0, 26, u64::MAX] {
            let refused = own_data_expectation(greedy, declared, &rules).unwrap_err();
            assert!(refused.contains("it declared 25"), "{refused}");
        }
        rules.max_samples = 20;
        assert!(own_data_expectation(25, declared, &rules).is_err());
        let unregistered = own_data_expectation(5, None, &rules).unwrap_err();
        assert!(
            unregistered.contains("own-data registration"),
            "{unregistered}"
        );
    }

    pub(crate) fn report(
        client_id: u32,
        num_samples: u64,
        loss: f64,
        training_time: f64,
    ) -> ClientReport {
        ClientReport {
            client_id,
            num_samples,
            loss,
            training_time,
            local_steps: 1,
            worker: 0,
        }
    }

    pub(crate) fn arrival(payload_bytes: u64, test: (u64, u64)) -> Arrival {
        Arrival {
            processing_time: 0.5,
            comm_time: 2.0,
            payload_bytes,
            test_samples: test.0,
            test_correct: test.1,
            simulated: None,
            staleness: None,
            wall: None,
        }
    }
}
