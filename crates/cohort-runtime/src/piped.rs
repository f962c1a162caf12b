//! Clients that are the caller's own code, in worker processes the caller
//! started, reached over a pair of pipes each: the transport behind
//! `cohort.simulate`, where each worker is a forked Python interpreter
//! running Flower-style `NumPyClient`s.
//!
//! The contract, both directions: a message is a `u64` little-endian length,
//! that many bytes of a JSON object (the header), a second `u64` length and
//! that many bytes of plain safetensors (the tensors; length 0 for none).
//! The engine sends `{"op": "fit", "cid", "config", "names", "evaluate"}`
//! with the global model; `names` is the order of the client's list of
//! arrays. The worker answers `{"ok": true, "num_examples", "metrics",
//! "fit_seconds", "evaluation"}` with its parameters, or `{"ok": false,
//! "error"}` with no tensors. No pickle crosses: only JSON and raw
//! little-endian arrays, so the engine never runs anything a worker sends.
//!
//! What is checked here, before the round loop's own checks
//! (`updates::check_update`: layout against the global model,
//! finite values): lengths against `MAX_HEADER_BYTES` and
//! `server.max_payload_bytes` before anything is allocated, the header's
//! types, and the tensors as safetensors. A client that raised, answered
//! with something else or whose worker died is an `Err` outcome with the
//! reason (dropped from its round, in `clients.csv`); the worker that died
//! takes no more tasks, and the run fails only when none is left.
//!
//! What this cannot prove: that a client trained at all, or on how many
//! samples. Its `num_examples` is its own word, bounded by
//! `clients.max_samples` in the round loop.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;
use cohort_core::codec::{self, DecodeLimits};
use cohort_core::config::LoadedConfig;
use cohort_core::processors::{Pipeline, Processor};
use serde_json::{Value, json};

use crate::client::ClientReply;
use crate::transport::{
    ClientOutcome, Delivered, MAX_REASON_BYTES, TaskSpec, Transport, truncated,
};

/// The largest header a worker may send: metrics and an error message, not
/// data.
pub const MAX_HEADER_BYTES: u64 = 1 << 20;

/// One worker process's ends of its two pipes.
pub struct WorkerLink {
    /// What the worker writes.
    pub from_worker: Box<dyn Read + Send>,
    /// What the worker reads.
    pub to_worker: Box<dyn Write + Send>,
}

/// Stops and replaces a worker process whose client overran
/// `server.payload_timeout`: the caller's part, since the caller started
/// the workers (and knows how to start another without forking the
/// engine's process).
pub trait Respawn: Send {
    /// Ends worker `worker`'s process now, so that the thread waiting on
    /// its answer reads the end of its pipe.
    fn stop(&mut self, worker: usize);
    /// A fresh worker process in place of `worker`, and its pipe ends.
    fn spawn(&mut self, worker: usize) -> anyhow::Result<WorkerLink>;
}

type SharedRespawn = Arc<Mutex<Box<dyn Respawn>>>;

fn locked<T: ?Sized>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// When a worker's task started, for the watchdog.
#[derive(Default)]
struct Clock {
    started: Mutex<Option<Instant>>,
    /// The watchdog stopped the worker: its task overran.
    overran: AtomicBool,
}

/// A worker's deadline: its clock, the caller's respawn and the timeout.
#[derive(Clone)]
struct Deadline {
    clock: Arc<Clock>,
    respawn: SharedRespawn,
    timeout: Duration,
}

/// Stops every worker whose task has run longer than `timeout`, until the
/// transport is dropped or no worker is left.
fn watchdog(
    clocks: Vec<Arc<Clock>>,
    respawn: SharedRespawn,
    timeout: Duration,
    live: Arc<AtomicUsize>,
    closed: Arc<AtomicBool>,
) {
    while !closed.load(Ordering::SeqCst) && live.load(Ordering::SeqCst) > 0 {
        for (worker, clock) in clocks.iter().enumerate() {
            // Held while stopping, so the worker's thread sees `overran`
            // as soon as it has its answer or the end of its pipe.
            let started = locked(&clock.started);
            let late = started.is_some_and(|t| t.elapsed() > timeout);
            if late && !clock.overran.swap(true, Ordering::SeqCst) {
                locked(&respawn).stop(worker);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What every task's request is built from, read from the config once.
#[derive(Debug, Clone)]
struct Settings {
    /// The order of the client's list of arrays.
    names: Vec<String>,
    inbound: Pipeline,
    outbound: Pipeline,
    limits: DecodeLimits,
    epochs: u32,
    batch_size: usize,
    /// `trainer.training_seed`, else `server.random_seed`: the base of
    /// each (client, round)'s seed.
    seed: u64,
    /// `clients.do_test`: each client evaluates the model it receives first.
    evaluate: bool,
}

impl Settings {
    fn of(loaded: &LoadedConfig, names: Vec<String>) -> Self {
        let config = loaded.config();
        let pipelines = loaded.pipelines();
        Self {
            names,
            inbound: pipelines.client_inbound,
            outbound: pipelines.client_outbound,
            limits: loaded.decode_limits(),
            epochs: config.trainer.epochs,
            batch_size: config.trainer.batch_size,
            seed: config
                .trainer
                .training_seed
                .unwrap_or(config.server.random_seed),
            evaluate: config.clients.do_test,
        }
    }
}

struct Job {
    spec: TaskSpec,
    header: Vec<u8>,
    tensors: Arc<Vec<u8>>,
}

/// Worker processes as a [`Transport`]: a thread per worker takes the next
/// task from a shared queue, writes it to its worker and reads the answer.
pub struct PipedClients {
    settings: Settings,
    jobs: Option<Sender<Job>>,
    results: Receiver<ClientOutcome>,
    cancelled: Arc<AtomicBool>,
    live: Arc<AtomicUsize>,
    /// Ends the watchdog.
    closed: Arc<AtomicBool>,
}

impl PipedClients {
    /// Starts a thread for each of `links`; `names` orders the arrays the
    /// clients receive and return.
    pub fn start(
        loaded: &LoadedConfig,
        names: Vec<String>,
        links: Vec<WorkerLink>,
    ) -> anyhow::Result<Self> {
        Self::start_with(loaded, names, links, None)
    }

    /// [`PipedClients::start`], and with `respawn` a client whose answer
    /// does not come within `server.payload_timeout` is dropped from its
    /// round with that reason, its worker stopped and replaced.
    pub fn start_with(
        loaded: &LoadedConfig,
        names: Vec<String>,
        links: Vec<WorkerLink>,
        respawn: Option<Box<dyn Respawn>>,
    ) -> anyhow::Result<Self> {
        if links.is_empty() {
            bail!("no worker process to run the clients (trainer.max_concurrency)");
        }
        let settings = Settings::of(loaded, names);
        let (job_sender, job_receiver) = mpsc::channel::<Job>();
        let job_receiver = Arc::new(Mutex::new(job_receiver));
        let (result_sender, results) = mpsc::channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let live = Arc::new(AtomicUsize::new(links.len()));
        let closed = Arc::new(AtomicBool::new(false));
        let clocks: Vec<Arc<Clock>> = links.iter().map(|_| Arc::default()).collect();
        let respawn: Option<SharedRespawn> = respawn.map(|r| Arc::new(Mutex::new(r)));
        let timeout = Duration::try_from_secs_f64(loaded.config().server.payload_timeout)
            .unwrap_or(Duration::MAX);
        if let Some(respawn) = &respawn {
            let (clocks, respawn) = (clocks.clone(), Arc::clone(respawn));
            let (live, closed) = (Arc::clone(&live), Arc::clone(&closed));
            std::thread::Builder::new()
                .name("cohort-piped-watchdog".to_owned())
                .spawn(move || watchdog(clocks, respawn, timeout, live, closed))?;
        }
        for (worker, link) in links.into_iter().enumerate() {
            let serving = Serving {
                worker,
                link,
                jobs: Arc::clone(&job_receiver),
                results: result_sender.clone(),
                cancelled: Arc::clone(&cancelled),
                live: Arc::clone(&live),
                settings: settings.clone(),
                deadline: respawn.as_ref().map(|respawn| Deadline {
                    clock: Arc::clone(&clocks[worker]),
                    respawn: Arc::clone(respawn),
                    timeout,
                }),
            };
            // Not joined on drop: a thread waiting on a client's training
            // ends when its worker process does, and the caller ends those.
            std::thread::Builder::new()
                .name(format!("cohort-piped{worker}"))
                .spawn(move || serving.run())?;
        }
        Ok(Self {
            settings,
            jobs: Some(job_sender),
            results,
            cancelled,
            live,
            closed,
        })
    }

    /// The global model as the workers read it: plain safetensors.
    fn plain_global(&self, global_payload: Arc<Vec<u8>>) -> anyhow::Result<Arc<Vec<u8>>> {
        if self.settings.inbound.steps() == [Processor::SafetensorDecode] {
            return Ok(global_payload);
        }
        let tree = self
            .settings
            .inbound
            .receive(&global_payload, &self.settings.limits)
            .map_err(|e| anyhow::anyhow!("cannot unpack the global model: {e}"))?;
        Ok(Arc::new(codec::encode(&tree)?))
    }
}

/// The JSON header of `spec`'s request: Flower's `config` keys, with the
/// seed of the (client, round) from cohort's streams.
fn request_header(settings: &Settings, spec: &TaskSpec) -> anyhow::Result<Vec<u8>> {
    let instructions = &spec.instructions;
    if instructions.correction.is_some() {
        bail!(
            "the strategy sends clients a gradient correction (SCAFFOLD), which Python clients \
             (cohort.simulate, cohort.connect) cannot apply; use a strategy that aggregates on \
             the server"
        );
    }
    if instructions.update_clip_norm.is_some() {
        bail!(
            "the strategy asks clients to clip their updates (dp_fedavg), which Python clients \
             (cohort.simulate, cohort.connect) do not do; use a strategy that aggregates on the \
             server"
        );
    }
    let task = spec.task;
    let mut config = json!({
        "server_round": task.round,
        "cid": (task.client_id - 1).to_string(),
        "seed": cohort_core::seeds::derive_seed(
            settings.seed,
            "python-client",
            &[u64::from(task.client_id), u64::from(task.round)],
        ),
        "local_epochs": settings.epochs,
        "batch_size": settings.batch_size,
        "learning_rate": instructions.learning_rate,
    });
    if instructions.proximal_mu > 0.0 {
        config["proximal_mu"] = json!(instructions.proximal_mu);
    }
    let header = json!({
        "op": "fit",
        "cid": (task.client_id - 1).to_string(),
        "config": config,
        "names": settings.names,
        "evaluate": settings.evaluate,
    });
    Ok(serde_json::to_vec(&header)?)
}

impl Transport for PipedClients {
    fn dispatch(
        &mut self,
        global_payload: Arc<Vec<u8>>,
        tasks: Vec<TaskSpec>,
    ) -> anyhow::Result<()> {
        if self.live.load(Ordering::SeqCst) == 0 {
            bail!("every worker process has exited");
        }
        let tensors = self.plain_global(global_payload)?;
        let jobs = self
            .jobs
            .as_ref()
            .expect("the jobs sender lives until drop");
        for spec in tasks {
            let header = request_header(&self.settings, &spec)?;
            let job = Job {
                spec,
                header,
                tensors: Arc::clone(&tensors),
            };
            jobs.send(job)
                .map_err(|_| anyhow::anyhow!("every worker process has exited"))?;
        }
        Ok(())
    }

    fn next_outcome(&mut self) -> anyhow::Result<ClientOutcome> {
        loop {
            match self.results.recv_timeout(Duration::from_millis(200)) {
                Ok(outcome) => return Ok(outcome),
                // A worker sends its last outcome before it counts itself
                // out, so none left and nothing queued means none will come.
                Err(RecvTimeoutError::Timeout) if self.live.load(Ordering::SeqCst) == 0 => {
                    bail!("every worker process has exited; no client can run")
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => bail!("every worker thread has stopped"),
            }
        }
    }

    fn cancel(&mut self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }
}

impl Drop for PipedClients {
    fn drop(&mut self) {
        // The threads see the queue closed, drop their pipes, and the
        // worker processes read the end of their input.
        self.jobs.take();
        self.closed.store(true, Ordering::SeqCst);
    }
}

/// Why a task got no reply: the client's doing (the worker goes on), or
/// the pipe's (the worker is gone).
enum Failure {
    Client(String),
    Link(String),
}

/// One worker thread's side of its worker process.
struct Serving {
    worker: usize,
    link: WorkerLink,
    jobs: Arc<Mutex<Receiver<Job>>>,
    results: Sender<ClientOutcome>,
    cancelled: Arc<AtomicBool>,
    live: Arc<AtomicUsize>,
    settings: Settings,
    /// With a respawn: the worker's clock, for the watchdog.
    deadline: Option<Deadline>,
}

impl Serving {
    fn run(mut self) {
        loop {
            let next = match self.jobs.lock() {
                Ok(receiver) => receiver.recv().ok(),
                Err(_) => None,
            };
            let Some(job) = next else { break };
            if self.cancelled.load(Ordering::SeqCst) {
                break;
            }
            let result = self.exchange(&job);
            let gone = matches!(result, Err(Failure::Link(_)));
            let outcome = ClientOutcome {
                slot: job.spec.slot,
                task: job.spec.task,
                worker: self.worker,
                result: result
                    .map(|reply| Delivered {
                        reply,
                        comm_time: 0.0,
                        declared: None,
                    })
                    .map_err(|failure| match failure {
                        Failure::Client(reason) | Failure::Link(reason) => reason,
                    }),
            };
            if self.results.send(outcome).is_err() || gone {
                break;
            }
        }
        self.live.fetch_sub(1, Ordering::SeqCst);
    }

    /// Sends `job` to the worker and reads its answer; one that overran
    /// its deadline fails the task whatever it answered, and the worker the
    /// watchdog stopped is replaced.
    fn exchange(&mut self, job: &Job) -> Result<ClientReply, Failure> {
        let Some(deadline) = self.deadline.clone() else {
            return exchange(
                &mut self.link,
                self.worker,
                &self.settings,
                &job.header,
                &job.tensors,
            );
        };
        *locked(&deadline.clock.started) = Some(Instant::now());
        let result = exchange(
            &mut self.link,
            self.worker,
            &self.settings,
            &job.header,
            &job.tensors,
        );
        let overran = {
            let mut started = locked(&deadline.clock.started);
            *started = None;
            deadline.clock.overran.swap(false, Ordering::SeqCst)
        };
        if !overran {
            return result;
        }
        let reason = format!(
            "fit did not return within {} s (server.payload_timeout)",
            deadline.timeout.as_secs_f64()
        );
        match locked(&deadline.respawn).spawn(self.worker) {
            Ok(link) => {
                self.link = link;
                Err(Failure::Client(format!(
                    "{reason}; its worker process was replaced"
                )))
            }
            Err(error) => Err(Failure::Link(format!(
                "{reason}, and its worker process could not be replaced: {error:#}"
            ))),
        }
    }
}

/// One request to the worker behind `link` and its answer as a reply.
fn exchange(
    link: &mut WorkerLink,
    worker: usize,
    settings: &Settings,
    header: &[u8],
    tensors: &[u8],
) -> Result<ClientReply, Failure> {
    let link_error =
        |e: std::io::Error| Failure::Link(format!("worker process {worker} is gone ({e})"));
    write_message(&mut link.to_worker, header, tensors).map_err(link_error)?;
    let (header, tensors) = read_message(&mut link.from_worker, settings.limits.max_bytes as u64)
        .map_err(|e| match e {
        ReadError::Io(e) => link_error(e),
        ReadError::Refused(reason) => Failure::Link(format!(
            "worker process {worker} sent a malformed answer ({reason}); \
                 it takes no more clients"
        )),
    })?;
    reply_of(settings, &header, &tensors).map_err(Failure::Client)
}

/// One worker process trained task by task, on the caller's thread: the
/// trainer of a network-mode client process whose clients are the
/// caller's code (`cohort.connect`), speaking the same pipe contract as
/// [`PipedClients`].
pub struct PipedWorker {
    settings: Settings,
    link: WorkerLink,
    /// Whether `settings.names` is the caller's order, or the global
    /// model's, read from each task's model.
    named: bool,
}

impl PipedWorker {
    /// `names`: the order of the client's list of arrays; `None`: the
    /// global model's own order (its tensors' names, sorted).
    pub fn new(loaded: &LoadedConfig, names: Option<Vec<String>>, link: WorkerLink) -> Self {
        let named = names.is_some();
        Self {
            settings: Settings::of(loaded, names.unwrap_or_default()),
            link,
            named,
        }
    }

    /// The request of `task` from the global model `payload` (as the
    /// server sent it, through `client_inbound`): its header and plain
    /// tensors, or why the client cannot train it.
    fn request(
        &mut self,
        task: cohort_train::trainer::ClientTask,
        instructions: &crate::transport::TaskInstructions,
        payload: &[u8],
    ) -> Result<(Vec<u8>, Vec<u8>), String> {
        let tree = self
            .settings
            .inbound
            .receive(payload, &self.settings.limits)
            .map_err(|e| format!("cannot unpack the global model: {e}"))?;
        if !self.named {
            self.settings.names = tree.leaves().iter().map(|(p, _)| p.to_string()).collect();
        }
        let tensors = codec::encode(&tree).map_err(|e| e.to_string())?;
        let spec = TaskSpec {
            slot: 0,
            task,
            instructions: instructions.clone(),
        };
        let header = request_header(&self.settings, &spec).map_err(|e| e.to_string())?;
        Ok((header, tensors))
    }
}

/// A client that raised or answered wrongly fails its task; a worker that
/// is gone ends the process, which has no other.
impl crate::worker_process::TaskTrainer for PipedWorker {
    fn train(
        &mut self,
        task: cohort_train::trainer::ClientTask,
        instructions: &crate::transport::TaskInstructions,
        payload: &[u8],
    ) -> anyhow::Result<Result<ClientReply, String>> {
        let (header, tensors) = match self.request(task, instructions, payload) {
            Ok(request) => request,
            Err(reason) => return Ok(Err(reason)),
        };
        match exchange(&mut self.link, 0, &self.settings, &header, &tensors) {
            Ok(reply) => Ok(Ok(reply)),
            Err(Failure::Client(reason)) => Ok(Err(reason)),
            Err(Failure::Link(reason)) => Err(anyhow::anyhow!(reason)),
        }
    }
}

fn write_message(to: &mut dyn Write, header: &[u8], tensors: &[u8]) -> std::io::Result<()> {
    to.write_all(&(header.len() as u64).to_le_bytes())?;
    to.write_all(header)?;
    to.write_all(&(tensors.len() as u64).to_le_bytes())?;
    to.write_all(tensors)?;
    to.flush()
}

enum ReadError {
    Io(std::io::Error),
    /// The bytes are not a message this side reads: the stream is out of step.
    Refused(String),
}

/// One message, each length checked against its bound before the bytes are
/// allocated.
fn read_message(from: &mut dyn Read, max_tensor_bytes: u64) -> Result<(Value, Vec<u8>), ReadError> {
    let header = read_block(from, MAX_HEADER_BYTES, "header")?;
    let header: Value = serde_json::from_slice(&header)
        .map_err(|e| ReadError::Refused(format!("the header is not JSON: {e}")))?;
    if !header.is_object() {
        return Err(ReadError::Refused("the header is not a JSON object".into()));
    }
    let tensors = read_block(from, max_tensor_bytes, "tensors")?;
    Ok((header, tensors))
}

fn read_block(from: &mut dyn Read, max: u64, what: &str) -> Result<Vec<u8>, ReadError> {
    let mut length = [0u8; 8];
    from.read_exact(&mut length).map_err(ReadError::Io)?;
    let length = u64::from_le_bytes(length);
    if length > max {
        return Err(ReadError::Refused(format!(
            "its {what} announce {length} bytes, more than the {max} allowed \
             (server.max_payload_bytes for tensors)"
        )));
    }
    let mut bytes = vec![0u8; length as usize];
    from.read_exact(&mut bytes).map_err(ReadError::Io)?;
    Ok(bytes)
}

/// A worker's answer as a reply of the round, or why the client is out of
/// it.
fn reply_of(settings: &Settings, header: &Value, tensors: &[u8]) -> Result<ClientReply, String> {
    if header["ok"] != Value::Bool(true) {
        let error = header["error"]
            .as_str()
            .unwrap_or("the worker answered without `ok` or an `error`");
        return Err(truncated(error, MAX_REASON_BYTES).to_owned());
    }
    let num_samples = header["num_examples"].as_u64().ok_or_else(|| {
        format!(
            "fit returned num_examples = {}; expected an integer >= 0",
            shown_json(&header["num_examples"])
        )
    })?;
    let unpacking = Instant::now();
    let tree = codec::decode(tensors, &settings.limits)
        .map_err(|e| format!("the parameters fit returned do not unpack: {e}"))?;
    let payload = settings
        .outbound
        .send(&tree)
        .map_err(|e| format!("cannot pack the parameters fit returned: {e}"))?;
    let (test_samples, test_correct) = evaluation_counts(&header["evaluation"])?;
    // The count is the client's word: checked here, bounded by
    // clients.max_samples when the round admits the update.
    let local_steps = num_samples
        .div_ceil(settings.batch_size.max(1) as u64)
        .checked_mul(u64::from(settings.epochs))
        .ok_or_else(|| format!("fit returned num_examples = {num_samples}, too many to train"))?;
    Ok(ClientReply {
        num_samples,
        loss: reported_loss(&header["metrics"]),
        training_time: non_negative(&header["fit_seconds"]).unwrap_or(0.0),
        processing_time: unpacking.elapsed().as_secs_f64(),
        local_steps,
        test_samples,
        test_correct,
        payload: payload.into(),
        packed_from: Some(tree),
        unwritten_len: None,
    })
}

/// The training loss a client reports in its metrics (`loss` or
/// `train_loss`), for `results.csv`'s `train_loss`; 0 when it gives none.
fn reported_loss(metrics: &Value) -> f64 {
    ["loss", "train_loss"]
        .iter()
        .find_map(|key| non_negative(&metrics[*key]))
        .unwrap_or(0.0)
}

fn non_negative(value: &Value) -> Option<f64> {
    value.as_f64().filter(|v| v.is_finite() && *v >= 0.0)
}

/// The held-out samples and how many were right, from the client's
/// `evaluate` before training (`clients.do_test`); none when it did not
/// evaluate or its metrics give no `accuracy`.
fn evaluation_counts(evaluation: &Value) -> Result<(u64, u64), String> {
    if evaluation.is_null() {
        return Ok((0, 0));
    }
    let samples = evaluation["num_examples"].as_u64().ok_or_else(|| {
        format!(
            "evaluate returned num_examples = {}; expected an integer >= 0",
            shown_json(&evaluation["num_examples"])
        )
    })?;
    let Some(accuracy) = evaluation["metrics"]["accuracy"].as_f64() else {
        return Ok((0, 0));
    };
    if !(0.0..=1.0).contains(&accuracy) {
        return Err(format!(
            "evaluate returned accuracy = {accuracy}; expected a share in [0, 1]"
        ));
    }
    Ok((samples, (accuracy * samples as f64).round() as u64))
}

/// A JSON value as a reason shows it, cut short.
fn shown_json(value: &Value) -> String {
    let text = value.to_string();
    truncated(&text, 200).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cohort_core::tree::{Array, ParamTree};

    fn settings() -> Settings {
        let loaded = cohort_core::config::from_str(
            "[clients]\ntotal_clients = 4\nper_round = 2\n\
             [parameters.optimizer]\nlearning_rate = 0.1\n",
            std::path::Path::new("test.toml"),
        )
        .unwrap();
        let pipelines = loaded.pipelines();
        Settings {
            names: vec!["0".into(), "1".into()],
            inbound: pipelines.client_inbound,
            outbound: pipelines.client_outbound,
            limits: DecodeLimits::default(),
            epochs: 2,
            batch_size: 10,
            seed: 7,
            evaluate: true,
        }
    }

    fn tensors() -> Vec<u8> {
        codec::encode(&ParamTree::from_dotted([
            ("0".to_owned(), Array::f32(vec![2], vec![1.0, 2.0]).unwrap()),
            ("1".to_owned(), Array::f32(vec![], vec![3.0]).unwrap()),
        ]))
        .unwrap()
    }

    #[test]
    fn a_good_answer_becomes_a_reply_with_its_numbers() {
        let header = json!({
            "ok": true, "num_examples": 25, "metrics": {"loss": 0.5}, "fit_seconds": 0.25,
            "evaluation": {"loss": 1.0, "num_examples": 8, "metrics": {"accuracy": 0.75}},
        });
        let reply = reply_of(&settings(), &header, &tensors()).unwrap();
        assert_eq!(reply.num_samples, 25);
        assert_eq!(reply.loss, 0.5);
        assert_eq!(reply.training_time, 0.25);
        // 2 epochs of ⌈25 / 10⌉ batches.
        assert_eq!(reply.local_steps, 6);
        assert_eq!((reply.test_samples, reply.test_correct), (8, 6));
        let tree = codec::decode(&reply.payload, &DecodeLimits::default()).unwrap();
        assert_eq!(tree.leaves().len(), 2);
    }

    #[test]
    fn bad_answers_are_refused_with_the_reason() {
        let settings = settings();
        let refused = |header: Value, tensors: &[u8]| reply_of(&settings, &header, tensors);
        assert_eq!(
            refused(
                json!({"ok": false, "error": "fit raised ValueError: boom"}),
                &[]
            ),
            Err("fit raised ValueError: boom".to_owned())
        );
        assert_eq!(
            refused(json!({"ok": true, "num_examples": -3}), &tensors()),
            Err("fit returned num_examples = -3; expected an integer >= 0".to_owned())
        );
        let garbage = refused(json!({"ok": true, "num_examples": 3}), b"not safetensors");
        assert!(
            garbage
                .unwrap_err()
                .starts_with("the parameters fit returned do not unpack")
        );
        // A count whose steps overflow is refused, not wrapped or a panic.
        let one_a_batch = Settings {
            batch_size: 1,
            ..self::tests::settings()
        };
        let huge = json!({"ok": true, "num_examples": u64::MAX});
        assert!(
            reply_of(&one_a_batch, &huge, &tensors())
                .unwrap_err()
                .contains("too many to train")
        );
        let accuracy = json!({"ok": true, "num_examples": 3,
            "evaluation": {"num_examples": 4, "metrics": {"accuracy": 1.5}}});
        assert_eq!(
            refused(accuracy, &tensors()),
            Err("evaluate returned accuracy = 1.5; expected a share in [0, 1]".to_owned())
        );
    }

    #[test]
    fn a_message_longer_than_its_bound_is_refused_before_it_is_read() {
        let mut bytes = Vec::new();
        write_message(&mut bytes, b"{}", &[0u8; 64]).unwrap();
        let read = read_message(&mut &bytes[..], 1 << 10).ok().unwrap();
        assert_eq!((read.0, read.1.len()), (json!({}), 64));
        match read_message(&mut &bytes[..], 63) {
            Err(ReadError::Refused(reason)) => assert!(reason.contains("64 bytes"), "{reason}"),
            _ => panic!("a block over its bound was read"),
        }
        let mut huge = (MAX_HEADER_BYTES + 1).to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(matches!(
            read_message(&mut &huge[..], 1 << 10),
            Err(ReadError::Refused(_))
        ));
    }

    /// A respawn over threads: `stop` closes the hung worker's answers so
    /// its thread's read ends; `spawn` starts a worker that answers.
    struct ThreadRespawn {
        hung_answers: Option<std::io::PipeWriter>,
        stopped: Arc<AtomicUsize>,
    }

    fn answering_worker() -> WorkerLink {
        let (mut requests, to_worker) = std::io::pipe().unwrap();
        let (from_worker, mut answers) = std::io::pipe().unwrap();
        std::thread::spawn(move || {
            while read_message(&mut requests, 1 << 20).is_ok() {
                let answer = json!({"ok": true, "num_examples": 7, "metrics": {}});
                let answer = serde_json::to_vec(&answer).unwrap();
                if write_message(&mut answers, &answer, &tensors()).is_err() {
                    return;
                }
            }
        });
        WorkerLink {
            from_worker: Box::new(from_worker),
            to_worker: Box::new(to_worker),
        }
    }

    impl Respawn for ThreadRespawn {
        fn stop(&mut self, worker: usize) {
            assert_eq!(worker, 0);
            self.stopped.fetch_add(1, Ordering::SeqCst);
            self.hung_answers.take();
        }

        fn spawn(&mut self, _worker: usize) -> anyhow::Result<WorkerLink> {
            Ok(answering_worker())
        }
    }

    #[test]
    fn a_client_past_the_timeout_is_dropped_and_its_worker_replaced() {
        let loaded = cohort_core::config::from_str(
            "[clients]\ntotal_clients = 4\nper_round = 2\n\
             [server]\npayload_timeout = 0.2\n\
             [parameters.optimizer]\nlearning_rate = 0.1\n",
            std::path::Path::new("test.toml"),
        )
        .unwrap();
        // The only worker reads its task and never answers.
        let (mut requests, to_worker) = std::io::pipe().unwrap();
        let (from_worker, answers) = std::io::pipe().unwrap();
        std::thread::spawn(move || while read_message(&mut requests, 1 << 20).is_ok() {});
        let stopped = Arc::new(AtomicUsize::new(0));
        let respawn = ThreadRespawn {
            hung_answers: Some(answers),
            stopped: Arc::clone(&stopped),
        };
        let link = WorkerLink {
            from_worker: Box::new(from_worker),
            to_worker: Box::new(to_worker),
        };
        let names = vec!["0".into(), "1".into()];
        let mut clients =
            PipedClients::start_with(&loaded, names, vec![link], Some(Box::new(respawn))).unwrap();
        let spec = |slot: usize, client_id: u32| TaskSpec {
            slot,
            task: cohort_train::trainer::ClientTask {
                client_id,
                round: 1,
            },
            instructions: crate::transport::TaskInstructions::plain(0.1),
        };
        let started = Instant::now();
        clients
            .dispatch(Arc::new(tensors()), vec![spec(0, 1), spec(1, 2)])
            .unwrap();
        let first = clients.next_outcome().unwrap();
        let reason = first.result.unwrap_err();
        assert_eq!(
            reason,
            "fit did not return within 0.2 s (server.payload_timeout); its worker process was \
             replaced"
        );
        assert!(started.elapsed() >= Duration::from_millis(200));
        // The next client runs on the replacement.
        let second = clients.next_outcome().unwrap();
        assert_eq!(second.result.unwrap().reply.num_samples, 7);
        assert_eq!(stopped.load(Ordering::SeqCst), 1);
    }

    /// A piped worker of a network client: the arrays are named by the
    /// global model's own order when the caller gives none, a client's
    /// failure fails its task, and a worker that is gone ends the process.
    #[test]
    fn a_piped_worker_trains_tasks_in_the_models_order_until_its_worker_is_gone() {
        use crate::worker_process::TaskTrainer;
        let loaded = cohort_core::config::from_str(
            "[clients]\ntotal_clients = 4\nper_round = 2\n\
             [parameters.optimizer]\nlearning_rate = 0.1\n",
            std::path::Path::new("test.toml"),
        )
        .unwrap();
        let (mut requests, to_worker) = std::io::pipe().unwrap();
        let (from_worker, mut answers) = std::io::pipe().unwrap();
        let worker = std::thread::spawn(move || {
            let (header, _) = read_message(&mut requests, 1 << 20).ok().unwrap();
            assert_eq!(header["names"], json!(["0", "1"]));
            assert_eq!(header["cid"], json!("2"));
            let answer = json!({"ok": true, "num_examples": 5, "metrics": {}});
            let answer = serde_json::to_vec(&answer).unwrap();
            write_message(&mut answers, &answer, &tensors()).unwrap();
            let _ = read_message(&mut requests, 1 << 20);
            let refusal = serde_json::to_vec(&json!({"ok": false, "error": "fit raised"})).unwrap();
            write_message(&mut answers, &refusal, &[]).unwrap();
        });
        let link = WorkerLink {
            from_worker: Box::new(from_worker),
            to_worker: Box::new(to_worker),
        };
        let mut piped = PipedWorker::new(&loaded, None, link);
        let task = cohort_train::trainer::ClientTask {
            client_id: 3,
            round: 1,
        };
        let plain = crate::transport::TaskInstructions::plain(0.1);
        let reply = piped.train(task, &plain, &tensors()).unwrap().unwrap();
        assert_eq!(reply.num_samples, 5);
        let refused = piped.train(task, &plain, &tensors()).unwrap();
        assert_eq!(refused.unwrap_err(), "fit raised");
        worker.join().unwrap();
        let gone = piped.train(task, &plain, &tensors()).unwrap_err();
        assert!(
            gone.to_string().contains("worker process 0 is gone"),
            "{gone}"
        );
    }

    /// A worker in a thread over real pipes: it answers the first task,
    /// raises on the second and then exits.
    #[test]
    fn a_worker_that_dies_fails_its_task_and_then_the_transport() {
        let loaded = cohort_core::config::from_str(
            "[clients]\ntotal_clients = 4\nper_round = 2\n\
             [parameters.optimizer]\nlearning_rate = 0.1\n",
            std::path::Path::new("test.toml"),
        )
        .unwrap();
        let (mut requests, to_worker) = std::io::pipe().unwrap();
        let (from_worker, mut answers) = std::io::pipe().unwrap();
        let worker = std::thread::spawn(move || {
            let (header, _) = read_message(&mut requests, 1 << 20).ok().unwrap();
            assert_eq!(header["config"]["server_round"], json!(1));
            let answer = json!({"ok": true, "num_examples": 5, "metrics": {}});
            write_message(
                &mut answers,
                &serde_json::to_vec(&answer).unwrap(),
                &tensors(),
            )
            .unwrap();
            let _ = read_message(&mut requests, 1 << 20);
        });
        let link = WorkerLink {
            from_worker: Box::new(from_worker),
            to_worker: Box::new(to_worker),
        };
        let mut clients =
            PipedClients::start(&loaded, vec!["0".into(), "1".into()], vec![link]).unwrap();
        let spec = |slot: usize, client_id: u32| TaskSpec {
            slot,
            task: cohort_train::trainer::ClientTask {
                client_id,
                round: 1,
            },
            instructions: crate::transport::TaskInstructions::plain(0.1),
        };
        clients
            .dispatch(Arc::new(tensors()), vec![spec(0, 1), spec(1, 2)])
            .unwrap();
        let first = clients.next_outcome().unwrap();
        assert_eq!(first.result.unwrap().reply.num_samples, 5);
        let second = clients.next_outcome().unwrap();
        let reason = second.result.unwrap_err();
        assert!(reason.starts_with("worker process 0 is gone"), "{reason}");
        worker.join().unwrap();
        assert!(
            clients
                .dispatch(Arc::new(tensors()), vec![spec(0, 3)])
                .is_err()
        );
    }
}
