//! The loop through its parts alone: a fake transport whose clients each
//! add their own constant to the global model, so every round's FedAvg
//! is known by hand.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::path::Path;
use std::rc::Rc;

use cohort_core::hooks::NoHooks;
use cohort_core::selection::ClientSelector;
use cohort_core::strategy::AlgorithmConfig;
use cohort_core::tree::ArrayData;
use cohort_train::trainer::ClientTask;

use super::*;
use crate::client::ClientReply;
use crate::record::{MODEL_FILE, RunFolder};
use crate::start::{ResumeChecks, fresh_start, resume_point};
use crate::transport::{ClientOutcome, Delivered, TaskSpec};

const TOTAL: u32 = 5;
const PER_ROUND: u32 = 3;

/// Client `c` trains on `10·c` samples and returns the global model plus
/// `c / 1000` in every value; clients in `failing` never answer.
struct AddingClients {
    global: ParamTree,
    tasks: VecDeque<TaskSpec>,
    failing: Vec<u32>,
    /// The round in which every client adds 1e30 instead (finite in float32).
    boosted: Option<u32>,
    /// Every round's clients, in selection order.
    served: Rc<RefCell<Vec<Vec<u32>>>>,
}

fn samples(client_id: u32) -> u64 {
    10 * u64::from(client_id)
}

fn shifted(tree: &ParamTree, by: f32) -> ParamTree {
    let mut tree = tree.clone();
    for array in tree.leaves_mut() {
        if let ArrayData::F32(values) = array.data_mut() {
            values.iter_mut().for_each(|x| *x += by);
        }
    }
    tree
}

impl Transport for AddingClients {
    fn dispatch(&mut self, payload: Arc<Vec<u8>>, tasks: Vec<TaskSpec>) -> anyhow::Result<()> {
        self.global = codec::decode(&payload, &DecodeLimits::default())?;
        self.served
            .borrow_mut()
            .push(tasks.iter().map(|t| t.task.client_id).collect());
        self.tasks.extend(tasks);
        Ok(())
    }

    fn next_outcome(&mut self) -> anyhow::Result<ClientOutcome> {
        let spec = self.tasks.pop_front().context("no task left")?;
        let client_id = spec.task.client_id;
        let result = if self.failing.contains(&client_id) {
            Err("the client went away".to_owned())
        } else {
            let by = if self.boosted == Some(spec.task.round) {
                1e30
            } else {
                client_id as f32 / 1000.0
            };
            let update = shifted(&self.global, by);
            Ok(Delivered {
                reply: ClientReply {
                    num_samples: samples(client_id),
                    loss: 0.5,
                    training_time: 1.0,
                    processing_time: 0.0,
                    local_steps: 1,
                    test_samples: 0,
                    test_correct: 0,
                    payload: codec::encode(&update)?.into(),
                    packed_from: None,
                    unwritten_len: None,
                },
                comm_time: 0.0,
                declared: None,
            })
        };
        Ok(ClientOutcome {
            slot: spec.slot,
            task: ClientTask {
                client_id,
                round: spec.task.round,
            },
            worker: 0,
            result,
        })
    }

    fn cancel(&mut self) {
        self.tasks.clear();
    }
}

fn settings(last_round: u32, min_per_round: usize) -> LoopSettings {
    let inbound = Pipeline::receiver(
        "server.inbound_processors",
        &["safetensor_decode".to_owned()],
    )
    .unwrap();
    let outbound = Pipeline::sender(
        "server.outbound_processors",
        &["safetensor_encode".to_owned()],
    )
    .unwrap();
    LoopSettings {
        last_round,
        selection: Selection {
            seed: 7,
            total_clients: TOTAL,
            per_round: PER_ROUND,
            draws: PER_ROUND,
            replayable: true,
            policy: Default::default(),
        },
        min_per_round,
        target_accuracy: None,
        checkpoint_interval: 1,
        learning_rate: 0.1,
        schedule: LrSchedule::Constant,
        outbound,
        inbound,
        limits: DecodeLimits::default(),
        attack: SimulatedAttack {
            kind: cohort_core::attack::Attack::None,
            attackers_per_round: 0,
            scale: 1.0,
            warning: None,
        },
        max_update_norm_ratio: None,
        max_model_step_ratio: 1e6,
        own_data: OwnDataRules {
            clients: 0,
            max_samples: 1000,
            epochs: 1,
            batch_size: 1000,
            do_test: false,
            rows_per_sample: 1,
        },
        max_report_seconds: 600.0,
        wall_time: SimulatedWallTime::default(),
        config_hash: "test".to_owned(),
        evaluation_threads: 1,
        secure: None,
        asynchronous: None,
        round_deadline: None,
        spill: None,
    }
}

fn evaluator() -> Box<dyn ModelEvaluator> {
    let lenet = cohort_train::model::LeNet5::new(10, &cohort_train::device::cpu());
    Box::new(cohort_train::trainer::Evaluator::new(lenet, 8))
}

fn test_set() -> Dataset {
    Dataset {
        inputs: vec![0.0; 4 * 28 * 28],
        labels: vec![0, 1, 2, 3],
        sample_shape: vec![1, 28, 28],
    }
}

fn facts() -> ClientFacts {
    ClientFacts {
        histograms: vec![vec![1]; TOTAL as usize],
        expected: (1..=TOTAL)
            .map(|c| ExpectedReport {
                train_samples: samples(c),
                local_steps: 1,
                test_samples: 0,
            })
            .collect(),
        self_reported: None,
    }
}

/// Runs the loop from `start` to `last_round`; the events it sent and
/// the clients it served.
fn run_loop(
    run_dir: &Path,
    start: StartPoint,
    last_round: u32,
    failing: &[u32],
    strategy: Box<dyn Strategy>,
) -> anyhow::Result<(Vec<RunEvent>, Vec<Vec<u32>>)> {
    run_boosted(run_dir, start, last_round, failing, strategy, None)
}

/// [`run_loop`] with every update of round `boosted` huge.
fn run_boosted(
    run_dir: &Path,
    start: StartPoint,
    last_round: u32,
    failing: &[u32],
    strategy: Box<dyn Strategy>,
    boosted: Option<u32>,
) -> anyhow::Result<(Vec<RunEvent>, Vec<Vec<u32>>)> {
    let mut events = Vec::new();
    let mut record = |event: &RunEvent| events.push(event.clone());
    let mut hooks = NoHooks;
    let served = Rc::new(RefCell::new(Vec::new()));
    let transport = AddingClients {
        global: ParamTree::None,
        tasks: VecDeque::new(),
        failing: failing.to_vec(),
        boosted,
        served: Rc::clone(&served),
    };
    let mut round_loop = RoundLoop::new(
        LoopParts {
            settings: settings(last_round, 2),
            strategy,
            transport: Box::new(transport),
            hooks: &mut hooks,
            observer: &mut record,
            evaluator: evaluator(),
            recorder: Box::new(RunFolder::new(run_dir.to_path_buf())),
            test: test_set(),
            clients: facts(),
            ranks: None,
            devices: None,
        },
        start,
    )?;
    round_loop.run()?;
    drop(round_loop);
    Ok((events, served.take()))
}

fn fedavg() -> Box<dyn Strategy> {
    AlgorithmConfig::default().build().unwrap()
}

fn model_file(run_dir: &Path) -> ParamTree {
    let bytes = std::fs::read(run_dir.join(MODEL_FILE)).unwrap();
    codec::decode(&bytes, &DecodeLimits::default()).unwrap()
}

fn first_value(tree: &ParamTree) -> f32 {
    tree.leaves()[0].1.as_f32().unwrap()[0]
}

/// FedAvg of the round's answering clients, by hand: each adds
/// `c / 1000`, weighted by its `10·c` samples.
fn fedavg_shift(clients: &[u32]) -> f64 {
    let weight: f64 = clients.iter().map(|&c| samples(c) as f64).sum();
    clients
        .iter()
        .map(|&c| samples(c) as f64 * (c as f64 / 1000.0))
        .sum::<f64>()
        / weight
}

#[test]
fn each_round_selects_dispatches_collects_aggregates_evaluates_records_and_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let initial = evaluator().parameters();
    let start = fresh_start(initial.clone(), 7);
    let (events, served) = run_loop(dir.path(), start, 2, &[], fedavg()).unwrap();

    // Selection is the seeded selector's, round after round.
    let mut selector = ClientSelector::new(7);
    let expected: Vec<Vec<u32>> = (0..2).map(|_| selector.select(TOTAL, PER_ROUND)).collect();
    assert_eq!(served, expected);

    // The model file is the initial model plus both rounds' FedAvg shifts.
    let shift = fedavg_shift(&served[0]) + fedavg_shift(&served[1]);
    let got = first_value(&model_file(dir.path())) as f64;
    let want = first_value(&initial) as f64 + shift;
    assert!((got - want).abs() < 1e-6, "{got} vs {want}");

    // The events, in order, for each round.
    let kinds: Vec<String> = events
        .iter()
        .map(|event| match event {
            RunEvent::RoundStarted { round, clients } => format!("start {round} {clients}"),
            RunEvent::ClientFinished { round, .. } => format!("client {round}"),
            RunEvent::RoundFinished { row, .. } => format!("finished {}", row.round),
            RunEvent::CheckpointWritten { round, .. } => format!("checkpoint {round}"),
            RunEvent::RunFinished { rounds, .. } => format!("done {rounds}"),
            other => format!("{other:?}"),
        })
        .collect();
    let round = |r: u32| {
        [
            format!("start {r} 3"),
            format!("client {r}"),
            format!("client {r}"),
            format!("client {r}"),
            format!("finished {r}"),
            format!("checkpoint {r}"),
        ]
    };
    let mut want_kinds: Vec<String> = round(1).into_iter().chain(round(2)).collect();
    want_kinds.push("done 2".to_owned());
    assert_eq!(kinds, want_kinds);

    // Recorded: results.csv and clients.csv rows, checkpoints of both rounds.
    let results = std::fs::read_to_string(dir.path().join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 3, "{results}");
    let clients = std::fs::read_to_string(dir.path().join("clients.csv")).unwrap();
    assert_eq!(clients.lines().count(), 1 + 2 * 3, "{clients}");
    let latest = cohort_core::checkpoint::latest(dir.path()).unwrap();
    assert_eq!(latest.history.round, 2);
}

#[test]
fn a_client_that_fails_is_dropped_from_its_round_and_the_round_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let initial = evaluator().parameters();
    // Seed 7 selects client 4 in round 1 (checked below).
    let failing = 4;
    let start = fresh_start(initial.clone(), 7);
    let (events, served) = run_loop(dir.path(), start, 1, &[failing], fedavg()).unwrap();
    assert!(served[0].contains(&failing), "{served:?}");
    let dropped: Vec<&RunEvent> = events
        .iter()
        .filter(|e| matches!(e, RunEvent::ClientDropped { .. }))
        .collect();
    assert_eq!(
        dropped,
        [&RunEvent::ClientDropped {
            round: 1,
            client_id: failing,
            reason: "the client went away".to_owned(),
        }]
    );
    let answered: Vec<u32> = served[0]
        .iter()
        .copied()
        .filter(|&c| c != failing)
        .collect();
    let got = first_value(&model_file(dir.path())) as f64;
    let want = first_value(&initial) as f64 + fedavg_shift(&answered);
    assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    let clients = std::fs::read_to_string(dir.path().join("clients.csv")).unwrap();
    assert!(clients.contains("the client went away"), "{clients}");
}

#[test]
fn too_few_updates_stop_the_run_before_anything_of_the_round_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let start = fresh_start(evaluator().parameters(), 7);
    // Every client fails; min_per_round is 2.
    let error = run_loop(dir.path(), start, 1, &[1, 2, 3, 4, 5], fedavg()).unwrap_err();
    let message = format!("{error:#}");
    assert!(message.contains("clients.min_per_round = 2"), "{message}");
    assert!(!dir.path().join(MODEL_FILE).exists());
    assert!(!dir.path().join("results.csv").exists());
}

#[test]
fn a_resumed_loop_ends_where_an_uninterrupted_one_does_bit_for_bit() {
    let whole = tempfile::tempdir().unwrap();
    let initial = evaluator().parameters();
    let start = fresh_start(initial.clone(), 7);
    // FedAvgM keeps state (its momentum) that the checkpoint must carry.
    let momentum = || -> Box<dyn Strategy> {
        AlgorithmConfig::Fedavgm(Default::default())
            .build()
            .unwrap()
    };
    run_loop(whole.path(), start, 3, &[], momentum()).unwrap();

    let split = tempfile::tempdir().unwrap();
    let start = fresh_start(initial, 7);
    run_loop(split.path(), start, 2, &[], momentum()).unwrap();
    let mut strategy = momentum();
    let reference = evaluator().parameters();
    let checks = |config_hash| ResumeChecks {
        config_hash,
        reference: &reference,
        selection: Selection {
            seed: 7,
            total_clients: TOTAL,
            per_round: PER_ROUND,
            draws: PER_ROUND,
            replayable: true,
            policy: Default::default(),
        },
    };
    let start = resume_point(&checks("test"), split.path(), strategy.as_mut()).unwrap();
    assert_eq!(start.first_round, 3);
    let (events, _) = run_loop(split.path(), start, 3, &[], strategy).unwrap();
    assert!(matches!(events[0], RunEvent::RoundStarted { round: 3, .. }));

    let read = |dir: &Path| std::fs::read(dir.join(MODEL_FILE)).unwrap();
    assert_eq!(read(whole.path()), read(split.path()));
    // A checkpoint of another config is refused.
    let error = resume_point(&checks("other"), split.path(), momentum().as_mut()).unwrap_err();
    assert!(error.to_string().contains("config hash"), "{error}");
    let rows = |dir: &Path| {
        let text = std::fs::read_to_string(dir.join("results.csv")).unwrap();
        text.lines().count()
    };
    assert_eq!(rows(whole.path()), rows(split.path()));
}

#[test]
fn a_forged_checkpoint_falls_back_to_the_one_before_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let initial = evaluator().parameters();
    run_loop(
        dir.path(),
        fresh_start(initial.clone(), 7),
        2,
        &[],
        fedavg(),
    )
    .unwrap();
    let reference = evaluator().parameters();
    let checks = ResumeChecks {
        config_hash: "test",
        reference: &reference,
        selection: Selection {
            seed: 7,
            total_clients: TOTAL,
            per_round: PER_ROUND,
            draws: PER_ROUND,
            replayable: true,
            policy: Default::default(),
        },
    };
    let sidecar = dir.path().join("checkpoints").join("round-0002.json");
    let original = std::fs::read(&sidecar).unwrap();
    let forge = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut json: serde_json::Value = serde_json::from_slice(&original).unwrap();
        edit(&mut json);
        std::fs::write(&sidecar, serde_json::to_vec(&json).unwrap()).unwrap();
        let start = resume_point(&checks, dir.path(), fedavg().as_mut()).unwrap();
        assert_eq!(start.first_round, 2, "the forged round 2 was taken");
    };
    // A selector moved elsewhere would silently draw other clients.
    forge(&|json| json["selector"]["word_pos"] = 12345.into());
    // A model of another layout (its sha256 recomputed by whoever forged it).
    let compact = cohort_train::params::extract(&cohort_train::model::LeNet5Compact::new(
        10,
        &cohort_train::device::cpu(),
    ));
    let model_path = dir
        .path()
        .join("checkpoints")
        .join("round-0002.safetensors");
    let bytes = codec::encode(&compact).unwrap();
    std::fs::write(&model_path, &bytes).unwrap();
    let digest = format!("{:x}", <sha2::Sha256 as sha2::Digest>::digest(&bytes));
    forge(&|json| json["model_sha256"] = digest.clone().into());
    // A non-finite model.
    let nan = shifted(&initial, f32::NAN);
    let bytes = codec::encode(&nan).unwrap();
    std::fs::write(&model_path, &bytes).unwrap();
    let digest = format!("{:x}", <sha2::Sha256 as sha2::Digest>::digest(&bytes));
    forge(&|json| json["model_sha256"] = digest.clone().into());
}

#[test]
fn a_round_whose_model_is_refused_keeps_the_model_and_the_strategy_state_it_started_from() {
    let momentum = || -> Box<dyn Strategy> {
        AlgorithmConfig::Fedavgm(Default::default())
            .build()
            .unwrap()
    };
    let initial = evaluator().parameters();
    let reference = evaluator().parameters();
    let checks = ResumeChecks {
        config_hash: "test",
        reference: &reference,
        selection: Selection {
            seed: 7,
            total_clients: TOTAL,
            per_round: PER_ROUND,
            draws: PER_ROUND,
            replayable: true,
            policy: Default::default(),
        },
    };
    // Round 2's updates are huge: its model is refused.
    let boosted = tempfile::tempdir().unwrap();
    let start = fresh_start(initial.clone(), 7);
    let (events, _) = run_boosted(boosted.path(), start, 2, &[], momentum(), Some(2)).unwrap();
    let kept: Vec<&RunEvent> = events
        .iter()
        .filter(|e| matches!(e, RunEvent::ModelKept { .. }))
        .collect();
    assert!(
        matches!(kept[..], [RunEvent::ModelKept { round: 2, reason }]
            if reason.contains("server.max_model_step_ratio")),
        "{kept:?}"
    );
    let mut after_two = momentum();
    resume_point(&checks, boosted.path(), after_two.as_mut()).unwrap();

    let one = tempfile::tempdir().unwrap();
    let start = fresh_start(initial, 7);
    run_loop(one.path(), start, 1, &[], momentum()).unwrap();
    let mut after_one = momentum();
    resume_point(&checks, one.path(), after_one.as_mut()).unwrap();

    assert_eq!(model_file(boosted.path()), model_file(one.path()));
    assert!(
        !after_one.state().is_empty(),
        "FedAvgM has momentum after a round"
    );
    assert_eq!(after_two.state(), after_one.state());
}

/// The asynchronous server on the real clock over the fake transport, which
/// answers its tasks in the order they were sent: an aggregation every
/// update, tasks more than `staleness_bound` versions old dropped.
fn run_real_time(
    run_dir: &Path,
    last_round: u32,
    failing: &[u32],
    staleness_bound: Option<u32>,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let start = fresh_start(evaluator().parameters(), 7);
    let mut observer = StopAfter(None, 0);
    run_real_time_from(
        run_dir,
        start,
        last_round,
        failing,
        staleness_bound,
        &mut observer,
    )
}

/// An observer that asks to stop once `.0` rounds (if any) have finished.
struct StopAfter(Option<u32>, u32);

impl RunObserver for StopAfter {
    fn on_event(&mut self, event: &RunEvent) {
        if matches!(event, RunEvent::RoundFinished { .. }) {
            self.1 += 1;
        }
    }

    fn stop_requested(&self) -> bool {
        self.0.is_some_and(|rounds| self.1 >= rounds)
    }
}

/// [`run_real_time`] from `start`, told by `observer`.
fn run_real_time_from(
    run_dir: &Path,
    start: StartPoint,
    last_round: u32,
    failing: &[u32],
    staleness_bound: Option<u32>,
    observer: &mut dyn RunObserver,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let mut hooks = NoHooks;
    let served = Rc::new(RefCell::new(Vec::new()));
    let transport = AddingClients {
        global: ParamTree::None,
        tasks: VecDeque::new(),
        failing: failing.to_vec(),
        boosted: None,
        served: Rc::clone(&served),
    };
    let mut settings = settings(last_round, 1);
    settings.selection.replayable = false;
    settings.asynchronous = Some(AsyncSettings {
        buffer: 1,
        staleness_bound,
        real_time: true,
    });
    let mut round_loop = RoundLoop::new(
        LoopParts {
            settings,
            strategy: fedavg(),
            transport: Box::new(transport),
            hooks: &mut hooks,
            observer,
            evaluator: evaluator(),
            recorder: Box::new(RunFolder::new(run_dir.to_path_buf())),
            test: test_set(),
            clients: facts(),
            ranks: None,
            devices: None,
        },
        start,
    )?;
    round_loop.run()?;
    drop(round_loop);
    Ok(served.take())
}

#[test]
fn on_the_real_clock_updates_count_in_arrival_order_and_a_failing_client_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let failing = 1;
    let served = run_real_time(dir.path(), 6, &[failing], Some(1)).unwrap();
    // One task at a time: three distinct clients for the three places, then
    // one per freed place.
    assert!(served.iter().all(|tasks| tasks.len() == 1), "{served:?}");
    let mut first: Vec<u32> = served[..3].concat();
    first.sort_unstable();
    first.dedup();
    assert_eq!(first.len(), 3, "{served:?}");
    let clients = std::fs::read_to_string(dir.path().join("clients.csv")).unwrap();
    let rows: Vec<Vec<&str>> = clients
        .lines()
        .skip(1)
        .map(|line| line.splitn(20, ',').collect())
        .collect();
    let (aggregated, dropped): (Vec<_>, Vec<_>) = rows.iter().partition(|r| r[19].is_empty());
    // One update a round, none staler than the bound.
    let rounds: Vec<&str> = aggregated.iter().map(|r| r[0]).collect();
    assert_eq!(rounds, ["1", "2", "3", "4", "5", "6"], "{clients}");
    assert!(
        aggregated
            .iter()
            .all(|r| r[16].parse::<u32>().unwrap() <= 1),
        "{clients}"
    );
    // Answered in the order they were sent, the third of the first three
    // tasks is two versions old when it arrives: dropped, with its staleness.
    assert!(
        dropped
            .iter()
            .any(|r| r[16] == "2" && r[19].contains("update too stale")),
        "{clients}"
    );
    // The failing client is dropped each time it is drawn, at most once
    // between two updates that join (here: once a round).
    let failures: Vec<&Vec<&str>> = dropped
        .iter()
        .filter(|r| r[1] == failing.to_string())
        .copied()
        .collect();
    assert!(
        !failures.is_empty(),
        "client {failing} was never drawn: {served:?}"
    );
    assert!(
        failures.iter().all(|r| r[19] == "the client went away"),
        "{clients}"
    );
    let mut failed_rounds: Vec<&str> = failures.iter().map(|r| r[0]).collect();
    failed_rounds.dedup();
    assert_eq!(failed_rounds.len(), failures.len(), "{clients}");
    // Every task has its send and arrival on the server's clock.
    for row in &rows {
        let (sent, arrived): (f64, f64) = (row[17].parse().unwrap(), row[18].parse().unwrap());
        assert!(0.0 <= sent && sent <= arrived, "{row:?}");
    }
}

#[test]
fn on_the_real_clock_a_run_whose_every_client_fails_stops_with_their_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let error = run_real_time(dir.path(), 2, &[1, 2, 3, 4, 5], None).unwrap_err();
    let message = format!("{error:#}");
    assert!(
        message.contains("every client's task failed or was refused since the last update")
            && message.contains("the client went away"),
        "{message}"
    );
    assert!(!dir.path().join("results.csv").exists());
}

#[test]
fn a_stopped_asynchronous_run_checkpoints_its_tasks_in_flight_and_resumes_them() {
    let dir = tempfile::tempdir().unwrap();
    let start = fresh_start(evaluator().parameters(), 7);
    let mut stop = StopAfter(Some(2), 0);
    let error = run_real_time_from(dir.path(), start, 5, &[], None, &mut stop).unwrap_err();
    assert_eq!(
        error.downcast_ref::<crate::events::Stopped>(),
        Some(&crate::events::Stopped { round: 2 })
    );
    // Checkpointed at round 2 whatever the interval, with the two tasks
    // still in flight.
    let latest = cohort_core::checkpoint::latest(dir.path()).unwrap();
    assert_eq!(latest.history.round, 2);
    let in_flight = latest.history.asynchronous.expect("the tasks in flight");
    assert_eq!(in_flight.tasks.len(), 2, "{in_flight:?}");

    let mut strategy = fedavg();
    let reference = evaluator().parameters();
    let mut selection = settings(5, 1).selection;
    selection.replayable = false;
    let checks = ResumeChecks {
        config_hash: "test",
        reference: &reference,
        selection,
    };
    let resumed = resume_point(&checks, dir.path(), strategy.as_mut()).unwrap();
    assert_eq!(resumed.first_round, 3);
    let mut go_on = StopAfter(None, 0);
    let served = run_real_time_from(dir.path(), resumed, 5, &[], None, &mut go_on).unwrap();
    // The resumed loop sends the checkpoint's two tasks first, then one per
    // freed place.
    let sent_again: Vec<u32> = in_flight.tasks.iter().map(|t| t.client_id).collect();
    assert_eq!(served[..2].concat(), sent_again, "{served:?}");
    assert!(served.len() >= 2 + 3, "{served:?}");
    let results = std::fs::read_to_string(dir.path().join("results.csv")).unwrap();
    assert_eq!(results.lines().count(), 1 + 5, "{results}");
}

/// FedAvg that fails in its own code in round 2, as a strategy behind a
/// foreign call does (`StrategyError::Failed`).
struct FailsInRoundTwo;

impl Strategy for FailsInRoundTwo {
    fn name(&self) -> &'static str {
        "fails_in_round_two"
    }

    fn aggregate(
        &mut self,
        ctx: &cohort_core::strategy::RoundContext,
        global: &ParamTree,
        updates: &[cohort_core::strategy::ClientUpdate<'_>],
    ) -> Result<cohort_core::strategy::Aggregated, StrategyError> {
        if ctx.round == 2 {
            return Err(StrategyError::Failed {
                strategy: self.name(),
                message: "aggregate_fit raised ZeroDivisionError".to_owned(),
            });
        }
        cohort_core::strategy::fedavg::FedAvg.aggregate(ctx, global, updates)
    }
}

#[test]
fn a_strategy_that_fails_in_its_own_code_stops_the_run_with_its_message() {
    let dir = tempfile::tempdir().unwrap();
    let start = fresh_start(evaluator().parameters(), 7);
    let error = run_loop(dir.path(), start, 3, &[], Box::new(FailsInRoundTwo)).unwrap_err();
    let message = format!("{error:#}");
    assert!(
        message.contains(
            "round 2: aggregation refused: strategy fails_in_round_two failed: aggregate_fit \
             raised ZeroDivisionError"
        ),
        "{message}"
    );
    // Round 1 stays recorded and checkpointed: the run can resume from it.
    assert!(dir.path().join("checkpoints/round-0001.json").exists());
    assert!(!dir.path().join("checkpoints/round-0002.json").exists());
}
