//! Running a federation from Rust: [`RunBuilder`] takes a validated config
//! and the run's options, lets the caller replace any part (the strategy,
//! the server hooks, the transport, the data, the evaluator, the recorder,
//! the initial model) and add observers of the run's [`crate::events`], then builds
//! everything else and runs. [`run`], [`run_with_hooks`] and
//! [`run_with_strategy`] are its shortest forms.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use cohort_runtime::{RunBuilder, RunOptions, events::RunEvent};
//! let loaded = cohort_core::config::load(std::path::Path::new("configs/fashion_mnist/r1.toml"))
//!     .map_err(|errors| anyhow::anyhow!("{errors}"))?;
//! let summary = RunBuilder::new(&loaded, RunOptions::new("runs/r1".into()))
//!     .on_round(|row| println!("round {}: {:.4}", row.round, row.accuracy))
//!     .run()?;
//! println!("final accuracy {:.4}", summary.rounds.last().map_or(0.0, |r| r.accuracy));
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cohort_core::config::LoadedConfig;
use cohort_core::data::Splits;
use cohort_core::hooks::ServerHooks;
use cohort_core::results::RoundRow;
use cohort_core::strategy::Strategy;
use cohort_core::tree::ParamTree;
use cohort_train::device::DeviceRequest;
use cohort_train::registry::Registry;
use cohort_train::trainer::ModelEvaluator;

use crate::children::LocalClients;
use crate::client::ClientPartitions;
use crate::events::{RunEvent, RunObserver};
use crate::ranks::DistributedRun;
use crate::record::Recorder;
use crate::transport::Transport;

/// How the caller (the command line, or a program) shapes this run, beside
/// its config.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub device: DeviceRequest,
    /// The run folder, created if missing.
    pub run_dir: PathBuf,
    /// Overrides `trainer.rounds`.
    pub rounds: Option<u32>,
    /// Where datasets live; overrides `data.data_path`.
    pub data_root: Option<PathBuf>,
    /// Continue from the newest complete checkpoint in `run_dir`.
    pub resume: bool,
    /// Network mode: client processes this run starts itself on this machine.
    pub local_clients: Option<LocalClients>,
    /// This process is one rank of a distributed simulation.
    pub distributed: Option<DistributedRun>,
    /// The models `trainer.model_name` may name.
    pub registry: Arc<Registry>,
}

impl RunOptions {
    /// A fresh run in `run_dir` on the device cohort picks, as the config says.
    pub fn new(run_dir: PathBuf) -> Self {
        Self {
            device: DeviceRequest::Auto,
            run_dir,
            rounds: None,
            data_root: None,
            resume: false,
            local_clients: None,
            distributed: None,
            registry: Arc::new(Registry::builtin()),
        }
    }
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Every round's row, resumed rounds included (empty on a follower rank).
    pub rounds: Vec<RoundRow>,
    pub run_dir: PathBuf,
    pub model_path: PathBuf,
    pub reached_target: bool,
}

/// The parts a caller gave; the assembly builds the others.
#[derive(Default)]
pub(crate) struct Parts<'a> {
    pub(crate) strategy: Option<Box<dyn Strategy>>,
    pub(crate) hooks: Option<&'a mut dyn ServerHooks>,
    pub(crate) observer: Observers<'a>,
    pub(crate) transport: Option<Box<dyn Transport>>,
    pub(crate) data: Option<(Splits, ClientPartitions)>,
    pub(crate) evaluator: Option<Box<dyn ModelEvaluator>>,
    pub(crate) recorder: Option<Box<dyn Recorder + 'a>>,
    pub(crate) initial_model: Option<ParamTree>,
    pub(crate) external_clients: bool,
}

/// Every observer a caller added, in the order added.
#[derive(Default)]
pub(crate) struct Observers<'a>(Vec<Box<dyn RunObserver + 'a>>);

impl RunObserver for Observers<'_> {
    fn on_event(&mut self, event: &RunEvent) {
        for observer in &mut self.0 {
            observer.on_event(event);
        }
    }

    fn stop_requested(&self) -> bool {
        self.0.iter().any(|observer| observer.stop_requested())
    }
}

/// A run of `loaded`, assembled from the config with the parts the caller
/// replaces, then run by [`RunBuilder::run`].
pub struct RunBuilder<'a> {
    loaded: &'a LoadedConfig,
    options: RunOptions,
    parts: Parts<'a>,
}

impl<'a> RunBuilder<'a> {
    pub fn new(loaded: &'a LoadedConfig, options: RunOptions) -> Self {
        Self {
            loaded,
            options,
            parts: Parts::default(),
        }
    }

    /// A strategy of the caller's instead of the one `[algorithm]` names (see
    /// `examples/norm_bounded_fedavg.rs`). Its state is checkpointed and
    /// restored like a built-in strategy's.
    pub fn strategy(mut self, strategy: Box<dyn Strategy>) -> Self {
        self.parts.strategy = Some(strategy);
        self
    }

    /// Server hooks between receipt and aggregation. A hook that breaks the
    /// positional contract stops the run before that round's aggregation.
    pub fn hooks(mut self, hooks: &'a mut dyn ServerHooks) -> Self {
        self.parts.hooks = Some(hooks);
        self
    }

    /// Receives every event of the run, after those added before it.
    pub fn observer(mut self, observer: impl RunObserver + 'a) -> Self {
        self.parts.observer.0.push(Box::new(observer));
        self
    }

    /// Called with each round's row once the round is recorded.
    pub fn on_round(self, mut callback: impl FnMut(&RoundRow) + 'a) -> Self {
        self.observer(move |event: &RunEvent| {
            if let RunEvent::RoundFinished { row, .. } = event {
                callback(row);
            }
        })
    }

    /// Reaches the clients through `transport` instead of the one
    /// `clients.comm_simulation` asks for (no client processes are started).
    pub fn transport(mut self, transport: Box<dyn Transport>) -> Self {
        self.parts.transport = Some(transport);
        self
    }

    /// The training and test sets and every client's partition, instead of
    /// loading `[data]`. With the default transport the workers train on
    /// these partitions, so they must index `splits.train`.
    pub fn data(mut self, splits: Splits, partitions: ClientPartitions) -> Self {
        self.parts.data = Some((splits, partitions));
        self
    }

    /// Evaluates the global model after each round instead of the config's
    /// model on its device.
    pub fn evaluator(mut self, evaluator: Box<dyn ModelEvaluator>) -> Self {
        self.parts.evaluator = Some(evaluator);
        self
    }

    /// Sends the run's results (every round's rows, the model, checkpoints)
    /// to `recorder` instead of the run folder's files ([`crate::RunFolder`] is
    /// the default; wrap it to keep the files too). `--resume` reads the
    /// run folder's checkpoints only. The run folder still gets
    /// `config.toml` and, in network mode, the client processes' logs.
    pub fn recorder(mut self, recorder: impl Recorder + 'a) -> Self {
        self.parts.recorder = Some(Box::new(recorder));
        self
    }

    /// The models the config may name, instead of cohort's built-in ones
    /// (a registry with models of the caller's added).
    pub fn registry(mut self, registry: Arc<Registry>) -> Self {
        self.options.registry = registry;
        self
    }

    /// Round 1's global model instead of the seeded one; checked against the
    /// model's layout (names, shapes, dtypes) before anything runs.
    pub fn initial_model(mut self, model: ParamTree) -> Self {
        self.parts.initial_model = Some(model);
        self
    }

    /// The clients are the caller's own code behind the given transport
    /// (`cohort.simulate`'s Python clients): the run loads no data set and
    /// builds no model from the registry (`trainer.model_name` and `[data]`
    /// are not read), so the caller gives the transport, the evaluator
    /// (whose `parameters` are the model's layout) and the initial model.
    /// Each client's sample counts are its own word, bounded by
    /// `clients.max_samples`.
    pub fn external_clients(mut self) -> Self {
        self.parts.external_clients = true;
        self
    }

    /// Builds what is missing and runs every round.
    pub fn run(self) -> anyhow::Result<RunSummary> {
        crate::assembly::build_and_run(self.loaded, &self.options, self.parts)
    }
}

/// Runs the configured federated training in this process.
pub fn run(loaded: &LoadedConfig, options: &RunOptions) -> anyhow::Result<RunSummary> {
    RunBuilder::new(loaded, options.clone()).run()
}

/// [`run`] with server hooks between receipt and aggregation. A hook that
/// breaks the positional contract stops the run before that round's
/// aggregation; the global model and the files of earlier rounds stay as they
/// were.
pub fn run_with_hooks(
    loaded: &LoadedConfig,
    options: &RunOptions,
    hooks: &mut dyn ServerHooks,
) -> anyhow::Result<RunSummary> {
    RunBuilder::new(loaded, options.clone()).hooks(hooks).run()
}

/// [`run_with_hooks`] with a strategy of the caller's instead of the one
/// `[algorithm]` names.
pub fn run_with_strategy(
    loaded: &LoadedConfig,
    options: &RunOptions,
    hooks: &mut dyn ServerHooks,
    strategy: Box<dyn Strategy>,
) -> anyhow::Result<RunSummary> {
    RunBuilder::new(loaded, options.clone())
        .hooks(hooks)
        .strategy(strategy)
        .run()
}

pub(crate) fn toml_text(table: &toml::Table) -> String {
    toml::to_string_pretty(table).unwrap_or_else(|_| table.to_string())
}

/// Creates a fresh run folder under `base`, `<stem>-<unix seconds>` (or
/// `name`), with a counter when that exists already. Creating is the claim:
/// two runs started in the same second get two folders.
pub fn new_run_dir(
    base: &Path,
    config_path: &Path,
    name: Option<&str>,
) -> std::io::Result<PathBuf> {
    match name {
        Some(name) => claim_run_dir(base, name),
        None => {
            let stem = config_path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "run".into());
            new_timestamped_run_dir(base, &stem)
        }
    }
}

/// Creates a fresh run folder `<stem>-<unix seconds>` under `base` (with a
/// counter when that exists already).
pub fn new_timestamped_run_dir(base: &Path, stem: &str) -> std::io::Result<PathBuf> {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    claim_run_dir(base, &format!("{stem}-{seconds}"))
}

fn claim_run_dir(base: &Path, stem: &str) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(base)?;
    let mut candidate = base.join(stem);
    let mut counter = 2;
    loop {
        match std::fs::create_dir(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
                candidate = base.join(format!("{stem}-{counter}"));
                counter += 1;
            }
            Err(error) => return Err(error),
        }
    }
}
