//! `cohort`: federated learning from the command line.
//!
//! The `cohort` binary is [`main_with`] over cohort's built-in models. A
//! program of your own that registers more models calls [`main_with`] with
//! its registry and is the whole command line with them: `run`, `client`,
//! `worker`, `check`, `evaluate`, `aggregate`, `partitions`, network mode and
//! ranks, its server and client processes all knowing its models (the
//! processes a run starts are the same program).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use cohort_core::config::{LoadedConfig, Override};
use cohort_runtime::{RunOptions, new_run_dir};

mod check;
mod place;
mod plot;
mod progress;
mod rank;
mod tools;
use cohort_train::device::DeviceRequest;
pub use cohort_train::registry::Registry;

/// Environment variable naming the folder that holds the datasets; it
/// overrides `data.data_path`.
const DATA_DIR_ENV: &str = "COHORT_DATA_DIR";

/// The data folder `COHORT_DATA_DIR` names, over `data.data_path`.
pub(crate) fn data_root_env() -> Option<PathBuf> {
    std::env::var_os(DATA_DIR_ENV).map(PathBuf::from)
}

#[derive(Parser)]
#[command(
    name = "cohort",
    version,
    about = "Federated learning: simulate many clients on one machine, or run a server and clients over the network."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// The order is the order a user meets the commands in: run and check a
// config, look at results and partitions, check models, then deployment.
#[derive(Subcommand)]
enum Command {
    /// Run a federated training job described by a TOML config.
    ///
    /// Writes a run folder (results.csv, clients.csv, model.safetensors,
    /// checkpoints, the config as it ran) that `--resume` continues.
    Run(RunArgs),
    /// Check a config and print it with every default filled in.
    ///
    /// Then what it points to: the data set's files (from their headers:
    /// present, intact, large enough for the partitions), TLS files, the
    /// cluster file. Every problem is named; none of them are left for the
    /// run to meet.
    Check(ConfigArgs),
    /// Chart a results column of one or more run folders into a PNG.
    ///
    /// Three panels: against round, against wall time, and against
    /// simulated time (clients of a round in parallel, as a deployment would
    /// run them). Accuracy by default; --metric picks other columns.
    Plot(plot::PlotArgs),
    /// Print each client's sample count and label histogram.
    ///
    /// Under the config's partitioner (`data.sampler`); --png draws them,
    /// --json writes the exact assignment for other frameworks.
    Partitions {
        #[command(flatten)]
        config: ConfigArgs,
        /// Also draw the histograms as stacked bars into this PNG.
        #[arg(long, value_name = "FILE")]
        png: Option<PathBuf>,
        /// Also write the exact assignment (each client's training and
        /// held-out sample indices, 0-based into the training set) as JSON.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// With --json: also each client's sample order in every local epoch
        /// of every round, as its trainer draws them from
        /// `trainer.training_seed`, so another framework can train the same
        /// batches.
        #[arg(long, requires = "json")]
        sample_orders: bool,
    },
    /// Evaluate a model file on the config's test set.
    ///
    /// The file is safetensors in PyTorch's layout, as runs write
    /// model.safetensors; prints the correct count and the accuracy, as a run
    /// evaluates its global model.
    Evaluate {
        #[command(flatten)]
        config: ConfigArgs,
        /// The model file.
        #[arg(long, value_name = "FILE")]
        model: PathBuf,
        /// Only the first N samples of the test set [default: all].
        #[arg(long, value_name = "N")]
        first: Option<usize>,
        /// Also write each sample's logits (`logits`, [N, classes] float32) and
        /// label (`labels`, int64) to this safetensors file.
        #[arg(long, value_name = "FILE")]
        logits: Option<PathBuf>,
        /// Evaluate on the CPU, even when the build has a GPU backend.
        #[arg(long, conflicts_with = "gpu")]
        cpu: bool,
        /// Evaluate on the GPU; fail if there is none.
        #[arg(long)]
        gpu: bool,
    },
    /// Compare two model files leaf by leaf.
    ///
    /// Safetensors files in PyTorch's layout: prints the largest absolute
    /// difference and the relative L2 distance, and exits non-zero above
    /// --tolerance. BatchNorm's num_batches_tracked is not compared.
    Compare {
        /// The reference model.
        reference: PathBuf,
        /// The model compared with it.
        candidate: PathBuf,
        /// Largest allowed relative L2 distance ‖a − b‖ / ‖a‖ (0: bitwise equal).
        #[arg(long, default_value_t = 0.0)]
        tolerance: f64,
    },
    /// Apply the config's strategy once to model files.
    ///
    /// From fresh strategy state (`[algorithm]`): for audits and for checking
    /// cohort against other implementations. Client ids are the updates'
    /// positions, from 1. Files are in PyTorch's layout (a `state_dict` saved
    /// with safetensors); the output is too, with num_batches_tracked 0.
    Aggregate {
        #[command(flatten)]
        config: ConfigArgs,
        /// The global model the clients started from.
        #[arg(long, value_name = "FILE")]
        global: PathBuf,
        /// Where to write the aggregated model.
        #[arg(long, short, value_name = "FILE")]
        output: PathBuf,
        /// Local steps each client took (SCAFFOLD's control variates use it).
        #[arg(long, default_value_t = 1)]
        local_steps: u64,
        /// The clients' models, each as FILE=SAMPLES.
        #[arg(required = true, value_name = "FILE=SAMPLES", value_parser = tools::parse_update)]
        updates: Vec<tools::UpdateArg>,
    },
    /// A client process for network mode: connects to a `cohort run` server.
    ///
    /// For configs with `clients.comm_simulation = false`. A partition
    /// client (no --data) trains the clients the server gives it on their
    /// partitions of the config's data set, so it needs the data set's files
    /// on this machine (under `data.data_path`, or `COHORT_DATA_DIR`). An
    /// own-data client (--data PATH) claims one of the config's
    /// `clients.own_data_clients` and trains on that data only; it needs no
    /// data set. Either runs until the server closes the session.
    Client(ClientArgs),
    /// Plan where a run's ranks go on a cluster.
    ///
    /// Nodes, workers, clients, addresses, ports: printed as a table or
    /// JSON; with --emit, each rank's host file and the command lines that
    /// start the ranks (with this command's --set, --unset and --rounds).
    Place(place::PlaceArgs),
    /// One rank of a distributed simulation, as `cohort place --emit` plans it.
    ///
    /// Trains its block of clients and meets the other ranks as the plan
    /// says. Started by the launch lines `cohort place --emit` writes.
    Worker(WorkerArgs),
}

/// The config a command reads, and what the command line changes in it.
#[derive(Args)]
pub(crate) struct ConfigArgs {
    /// The config file (TOML); `cohort check` prints it with every default.
    #[arg(long, short, value_name = "FILE")]
    config: PathBuf,
    /// Override a config key, as `cohort run --set` does (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<Override>,
    /// Take a key out of the config, so its default applies (repeatable;
    /// before --set).
    #[arg(long = "unset", value_name = "KEY", value_parser = Override::unset)]
    unsets: Vec<Override>,
    /// Number of rounds: the same as --set trainer.rounds=N.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: Option<u32>,
}

impl ConfigArgs {
    /// The config with --unset, --set and --rounds over it, in that order.
    fn load(&self, registry: &Registry) -> anyhow::Result<LoadedConfig> {
        load_config(&self.config, &self.overrides(), registry)
    }

    /// The config as `cohort place` reads it: no model or strategy lookup.
    pub(crate) fn load_unchecked(&self) -> anyhow::Result<LoadedConfig> {
        Ok(cohort_core::config::load_with(
            &self.config,
            &self.overrides(),
        )?)
    }

    pub(crate) fn path(&self) -> &std::path::Path {
        &self.config
    }

    fn overrides(&self) -> Vec<Override> {
        all_overrides(&self.unsets, &self.overrides, self.rounds)
    }

    /// --unset, --set and --rounds as arguments again, for the command
    /// lines `cohort place` writes.
    pub(crate) fn command_line(&self) -> Vec<String> {
        let mut words = Vec::new();
        for unset in &self.unsets {
            words.extend(["--unset".to_owned(), unset.key.clone()]);
        }
        for set in &self.overrides {
            words.extend(["--set".to_owned(), set.to_string()]);
        }
        if let Some(rounds) = self.rounds {
            words.extend(["--rounds".to_owned(), rounds.to_string()]);
        }
        words
    }
}

/// `--unset`s, then `--set`s, then `--rounds`, as one list.
fn all_overrides(unsets: &[Override], sets: &[Override], rounds: Option<u32>) -> Vec<Override> {
    unsets
        .iter()
        .chain(sets)
        .cloned()
        .chain(rounds.map(Override::rounds))
        .collect()
}

#[derive(Args)]
struct RunArgs {
    /// The config file (TOML); `cohort check FILE` prints it with every key
    /// and its default. Required, unless --resume is given: then it defaults
    /// to the run folder's config.toml.
    #[arg(long, short, required_unless_present = "resume")]
    config: Option<PathBuf>,
    /// Continue the run in RUN_DIR from its newest complete checkpoint; the final
    /// model and results.csv are those an uninterrupted run would give.
    #[arg(long, value_name = "RUN_DIR", conflicts_with = "base")]
    resume: Option<PathBuf>,
    /// Train and evaluate on the CPU, even when the build has a GPU backend.
    #[arg(long, conflicts_with = "gpu")]
    cpu: bool,
    /// Train and evaluate on the GPU; fail if the build has no GPU backend or no GPU answers.
    #[arg(long)]
    gpu: bool,
    /// Folder under which the run folder is created [default: `general.base_path`, i.e. runs/].
    #[arg(long)]
    base: Option<PathBuf>,
    /// Number of rounds: the same as --set trainer.rounds=N (a cosine
    /// schedule then spans N rounds); at least 1. Recorded in the run's
    /// config.toml, so --resume remembers it; with --resume it extends or
    /// shortens the run.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: Option<u32>,
    /// Override a config key, validated like the file's own keys and recorded
    /// in the run's config.toml (repeatable): --set trainer.epochs=2 --set
    /// data.datasource=MNIST. Values are TOML (5, 0.1, true, "text", [1, 2]);
    /// anything else is read as a string.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<Override>,
    /// Take a key out of the config, so its default applies (repeatable;
    /// before --set): --unset data.partition_size.
    #[arg(long = "unset", value_name = "KEY", value_parser = Override::unset)]
    unsets: Vec<Override>,
    /// No progress bar and only warnings on stderr (for scripts).
    #[arg(long, short)]
    quiet: bool,
    /// Draw accuracy.png into the run folder when the run ends.
    #[arg(long)]
    plot: bool,
    /// More log lines on stderr (info level); the run log always has them.
    #[arg(long, short, conflicts_with = "quiet")]
    verbose: bool,
    /// Network mode: how many `cohort client` processes to start on this
    /// machine [default: trainer.max_concurrency]. 0 starts none and waits for
    /// clients started elsewhere.
    #[arg(long, value_name = "N")]
    local_clients: Option<usize>,
    /// Distributed simulation: the folder of host files that `cohort place
    /// --emit` wrote; this process is one rank of that plan.
    #[arg(long, value_name = "DIR")]
    plan: Option<PathBuf>,
    /// The plan's instance [default: the only one in --plan].
    #[arg(long, requires = "plan")]
    instance: Option<String>,
    /// This process's rank in the plan [default: from the launcher: mpirun,
    /// srun, or a Kubernetes Indexed Job's JOB_COMPLETION_INDEX].
    #[arg(long, requires = "plan")]
    rank: Option<u32>,
}

/// `cohort worker`'s flags: `run`'s, less those of network mode and of a
/// single process, with --plan required.
#[derive(Args)]
struct WorkerArgs {
    /// The config file (TOML), the same on every rank. Required unless
    /// --resume is given.
    #[arg(long, short, required_unless_present = "resume")]
    config: Option<PathBuf>,
    /// The folder of host files that `cohort place --emit` wrote.
    #[arg(long, value_name = "DIR")]
    plan: PathBuf,
    /// The plan's instance [default: the only one in --plan].
    #[arg(long)]
    instance: Option<String>,
    /// This process's rank in the plan [default: from the launcher: mpirun,
    /// srun, or a Kubernetes Indexed Job's JOB_COMPLETION_INDEX].
    #[arg(long)]
    rank: Option<u32>,
    /// Continue the run in RUN_DIR (rank 0's run folder, as every rank sees it).
    #[arg(long, value_name = "RUN_DIR", conflicts_with = "base")]
    resume: Option<PathBuf>,
    /// Folder under which rank 0 creates the run folder [default: `general.base_path`].
    #[arg(long)]
    base: Option<PathBuf>,
    /// Number of rounds: the same as --set trainer.rounds=N.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: Option<u32>,
    /// Override a config key, as `cohort run --set` does (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<Override>,
    /// Take a key out of the config, so its default applies (repeatable;
    /// before --set).
    #[arg(long = "unset", value_name = "KEY", value_parser = Override::unset)]
    unsets: Vec<Override>,
    /// Train on the CPU, even when the build has a GPU backend.
    #[arg(long, conflicts_with = "gpu")]
    cpu: bool,
    /// Train on the GPU; fail if there is none.
    #[arg(long)]
    gpu: bool,
    /// Only warnings on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// More log lines on stderr (info level).
    #[arg(long, short, conflicts_with = "quiet")]
    verbose: bool,
}

impl From<WorkerArgs> for RunArgs {
    fn from(worker: WorkerArgs) -> Self {
        Self {
            config: worker.config,
            resume: worker.resume,
            cpu: worker.cpu,
            gpu: worker.gpu,
            base: worker.base,
            rounds: worker.rounds,
            overrides: worker.overrides,
            unsets: worker.unsets,
            quiet: worker.quiet,
            plot: false,
            verbose: worker.verbose,
            local_clients: None,
            plan: Some(worker.plan),
            instance: worker.instance,
            rank: worker.rank,
        }
    }
}

#[derive(Args)]
struct ClientArgs {
    /// The server, HOST:PORT (its `server.address` and `server.port`).
    #[arg(long)]
    server: String,
    /// Shared token when the server sets `server.auth_token` [env: COHORT_TOKEN].
    #[arg(long)]
    token: Option<String>,
    /// PEM certificate of the authority that signed the server's TLS
    /// certificate; turns TLS on.
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// Name the server's certificate must carry [default: the host of --server].
    #[arg(long, requires = "tls_ca")]
    tls_domain: Option<String>,
    /// Seconds to keep trying to reach the server.
    #[arg(long, default_value_t = 60.0)]
    connect_timeout: f64,
    /// Largest payload (global model, correction) this client accepts in
    /// bytes, whatever the server's config says.
    #[arg(long, default_value_t = 1 << 30)]
    max_payload_bytes: usize,
    /// Train on the CPU, even when the build has a GPU backend.
    #[arg(long, conflicts_with = "gpu")]
    cpu: bool,
    /// Train on the GPU; fail if there is none.
    #[arg(long)]
    gpu: bool,
    /// Only warnings on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// Bring your own data: a folder of IDX files (train-images-idx3-ubyte,
    /// train-labels-idx1-ubyte, optionally t10k-* for held-out evaluation;
    /// plain or .gz), of CIFAR's binary batches (data_batch_N.bin and
    /// test_batch.bin, or CIFAR-100's train.bin and test.bin) or of LEAF's
    /// JSON (train/*.json, optionally test/*.json); a safetensors file with
    /// `images` and `labels` (optionally `test_images`, `test_labels`); a
    /// .csv file (a header row, numeric features, --label-column) or an .npz
    /// file (`x`, `y`, optionally `x_test`, `y_test`). The process claims
    /// one own-data client of the run (clients.own_data_clients) and trains
    /// it on this data only.
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    /// The own-data client to claim, 1..=clients.own_data_clients [default:
    /// the lowest one no connected process holds].
    #[arg(long, value_name = "ID", requires = "data", value_parser = clap::value_parser!(u32).range(1..))]
    client_id: Option<u32>,
    /// With --data: the most samples the data set may hold in either split,
    /// counted from its headers before it is read (the server's
    /// clients.max_samples refuses more at registration anyway).
    #[arg(long, value_name = "N", default_value_t = 100_000, requires = "data", value_parser = clap::value_parser!(u64).range(1..))]
    max_samples: u64,
    /// With a --data CSV file: the column that holds the labels.
    #[arg(long, value_name = "NAME", default_value = "label", requires = "data")]
    label_column: String,
    /// Refuse to take part in a run whose config has no
    /// [secure_aggregation]: the server would receive this client's updates
    /// unmasked. Checked when the server's config arrives, before any
    /// training.
    #[arg(long)]
    require_secure_aggregation: bool,
    /// Tests only: misbehave in secure aggregation, for tests of how the
    /// server copes. `leave-at-share-keys`, `leave-at-masked-input`,
    /// `leave-at-unmask`: the process exits when that stage's message
    /// arrives; `stall-at-masked-input`, `stall-at-unmask`: it stays
    /// connected and never answers that stage; `malformed-shares`, `stranger-share`, `short-input`: it sends
    /// that rogue message. Hidden from --help: no deployment wants it.
    #[arg(long, hide = true, value_name = "FAULT")]
    secagg_fault: Option<cohort_runtime::secure_client::SecAggFault>,
}

/// The `cohort` command line over the models of `registry`; the process's
/// exit code. Call it first in `main`: it sets the process's SIGPIPE
/// disposition and logging.
pub fn main_with(registry: Registry) -> ExitCode {
    // This process is the `cohort` program itself (a host such as Python
    // keeps its own allocator settings).
    cohort_train::memory::retain_freed_memory();
    main_with_args(registry, std::env::args_os())
}

/// [`main_with`] on `args` (the program first, as `std::env::args_os`
/// gives them) rather than the process's own: the command line of a host
/// that is not the `cohort` binary, such as the Python package's `cohort`
/// command. When `args`' first item is a file, it is the program that
/// network mode starts for its local client processes (this process's own
/// executable is then the host's, such as `python3`).
pub fn main_with_args<I, T>(registry: Registry, args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    ExitCode::from(command_line(registry, args))
}

/// [`main_with_args`]'s exit code as a number: 0 done, 1 an error (printed
/// as `error: …`), 2 a usage error (clap's).
pub fn command_line<I, T>(registry: Registry, args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    if let Some(program) = args.first().map(PathBuf::from)
        && program.is_file()
        && let Ok(program) = std::fs::canonicalize(program)
    {
        // Only the first caller's program counts: one process, one command.
        let _ = SELF_PROGRAM.set(program);
    }
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        // As clap's own exit: usage errors 2, --help and --version 0.
        Err(error) => {
            let _ = error.print();
            return u8::try_from(error.exit_code()).unwrap_or(2);
        }
    };
    if !cli.command.talks_to_peers() {
        quiet_on_closed_pipe();
    }
    let switches = match train_switches() {
        Ok(switches) => switches,
        Err(error) => {
            eprintln!("error: {}", error_chain(&error));
            return 1;
        }
    };
    cohort_train::switches::set(switches);
    match execute(cli, &Arc::new(registry)) {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("error: {}", error_chain(&error));
            1
        }
    }
}

/// The program [`main_with_args`] was started as, where it was a file.
static SELF_PROGRAM: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// What starts this command line again as a new process: the program it was
/// started as ([`main_with_args`]), else this process's executable.
fn self_program() -> PathBuf {
    match SELF_PROGRAM.get() {
        Some(program) => program.clone(),
        None => std::env::current_exe().unwrap_or_else(|_| PathBuf::from("cohort")),
    }
}

/// `error` and its causes joined by `: `, as anyhow's `{:#}` writes them,
/// but without a cause whose text the message before it already ends with
/// (an error type that prints its source in its own message, as many
/// libraries' do): "out of memory: out of memory" is said once.
fn error_chain(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let message = cause.to_string();
        if !text.is_empty() && text.ends_with(message.as_str()) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&message);
    }
    text
}

impl Command {
    /// Whether the command holds sockets. Those keep Rust's ignored SIGPIPE:
    /// under the signal's default action a vectored write (`writev`, which
    /// hyper uses and which has no `MSG_NOSIGNAL`) to a peer that has just
    /// closed would kill the process without a word, a client whose server
    /// finished or a server whose client left, instead of returning the
    /// error the transport handles.
    fn talks_to_peers(&self) -> bool {
        matches!(
            self,
            Command::Run(_) | Command::Client(_) | Command::Worker(_)
        )
    }
}

/// Rust ignores SIGPIPE, so a write to a closed pipe (`cohort check | head`)
/// is an error that `println!` turns into a panic. A command-line tool ends
/// quietly there, as `cat` does: the signal's default action. Only for
/// commands that write to no socket ([`Command::talks_to_peers`]).
fn quiet_on_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: called before the command starts any thread of its own; it
    // changes only this process's disposition of one signal.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// The training layer's switches, from this process's environment: the
/// library reads none itself.
fn train_switches() -> anyhow::Result<cohort_train::switches::TrainSwitches> {
    let is = |name: &str, value: &str| std::env::var(name).is_ok_and(|v| v == value);
    let gpu_products = match std::env::var("COHORT_GPU_PRODUCTS") {
        Ok(value) => value,
        Err(std::env::VarError::NotPresent) => String::new(),
        Err(std::env::VarError::NotUnicode(value)) => {
            anyhow::bail!("COHORT_GPU_PRODUCTS: {value:?} is not UTF-8")
        }
    };
    let gpu_products = cohort_train::vectorized::ProductChoice::parse(&gpu_products)
        .map_err(|refusal| anyhow::anyhow!("COHORT_GPU_PRODUCTS: {refusal}"))?;
    let thin_gpu_products = match std::env::var("COHORT_GPU_THIN_PRODUCTS").as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("" | "0") => false,
        Ok("1") => true,
        Ok(other) => anyhow::bail!("COHORT_GPU_THIN_PRODUCTS: `{other}` is not 0 or 1"),
        Err(std::env::VarError::NotUnicode(value)) => {
            anyhow::bail!("COHORT_GPU_THIN_PRODUCTS: {value:?} is not 0 or 1")
        }
    };
    Ok(cohort_train::switches::TrainSwitches {
        native_kernels: !is("COHORT_NATIVE_KERNELS", "0"),
        vectorized_autodiff: is("COHORT_VECTORIZED_AUTODIFF", "1"),
        kernel_cache: cohort_train::device::KernelCache::from_env(
            std::env::var_os(cohort_train::device::KERNEL_CACHE_VAR).as_deref(),
            user_cache_folder().map(|folder| folder.join("cohort").join("kernels")),
        ),
        gpu_products,
        thin_gpu_products,
    })
}

/// `$XDG_CACHE_HOME`, else `~/.cache`; `None` where neither is known.
fn user_cache_folder() -> Option<PathBuf> {
    let set = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
    set("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| set("HOME").map(|home| PathBuf::from(home).join(".cache")))
}

fn execute(cli: Cli, registry: &Arc<Registry>) -> anyhow::Result<()> {
    match cli.command {
        Command::Check(config) => {
            let loaded = config.load(registry)?;
            println!(
                "# {} is valid (hash {})",
                config.path().display(),
                loaded.hash()
            );
            let data_root = std::env::var_os(DATA_DIR_ENV).map(PathBuf::from);
            let findings = check::check(&loaded, data_root.as_deref());
            for note in loaded.notes() {
                println!("# {note}");
            }
            println!("{}", cohort_core::config::to_toml(loaded.config())?);
            check::report(&findings)
        }
        Command::Run(args) => run(args, registry),
        Command::Worker(args) => run(args.into(), registry),
        Command::Aggregate {
            config,
            global,
            output,
            local_steps,
            updates,
        } => {
            let loaded = config.load(registry)?;
            let summary =
                tools::aggregate(registry, &loaded, &global, &output, &updates, local_steps)?;
            println!("{summary}");
            Ok(())
        }
        Command::Partitions {
            config,
            png,
            json,
            sample_orders,
        } => {
            let loaded = config.load(registry)?;
            let data_root = std::env::var_os(DATA_DIR_ENV).map(PathBuf::from);
            let report = tools::partitions(&loaded, registry, data_root.as_deref(), sample_orders)?;
            print!("{}", report.table);
            if let Some(png) = png {
                plot::draw_partitions(&report.histograms, &png)?;
                println!("wrote {}", png.display());
            }
            if let Some(path) = json {
                let text = serde_json::to_string(&report.assignment)?;
                cohort_core::fsutil::atomic_write(&path, text.as_bytes())
                    .with_context(|| format!("cannot write {}", path.display()))?;
                println!("wrote {}", path.display());
            }
            Ok(())
        }
        Command::Evaluate {
            config,
            model,
            first,
            logits,
            cpu,
            gpu,
        } => {
            let loaded = config.load(registry)?;
            let request = tools::EvaluateRequest {
                model: &model,
                first,
                logits: logits.as_deref(),
                device: device_of(cpu, gpu),
            };
            evaluate(&loaded, registry, &request)
        }
        Command::Client(args) => client(args, registry),
        Command::Place(args) => place::place(&args, registry),
        Command::Compare {
            reference,
            candidate,
            tolerance,
        } => compare_models(&reference, &candidate, tolerance),
        Command::Plot(args) => {
            let output = args
                .output
                .clone()
                .unwrap_or_else(|| args.runs[0].join(PLOT_FILE));
            let written = plot_runs(&args.runs, &output, &args.chart())?;
            println!("wrote {}", written.display());
            Ok(())
        }
    }
}

/// `cohort evaluate`: the model file's accuracy on the config's test set.
fn evaluate(
    loaded: &cohort_core::config::LoadedConfig,
    registry: &Registry,
    request: &tools::EvaluateRequest<'_>,
) -> anyhow::Result<()> {
    let data_root = std::env::var_os(DATA_DIR_ENV).map(PathBuf::from);
    let result = tools::evaluate(loaded, registry, data_root.as_deref(), request)?;
    println!(
        "{}: {} of {} correct, accuracy {:.4} ({} {}, first {} of {} test samples)",
        request.model.display(),
        result.correct,
        result.samples,
        result.correct as f64 / result.samples as f64,
        loaded.config().trainer.model_name,
        loaded.config().data.datasource,
        result.samples,
        result.test_samples
    );
    Ok(())
}

/// Loads and checks a config, then holds `cluster.backend` against the
/// backends of this build and `trainer.model_name`, `data.datasource` and
/// `algorithm.type` against the registry: a run that could not start fails
/// now, naming the key, not once its ranks are up.
fn load_config(
    path: &std::path::Path,
    overrides: &[Override],
    registry: &Registry,
) -> anyhow::Result<cohort_core::config::LoadedConfig> {
    let loaded = cohort_core::config::load_with(path, overrides)?;
    loaded.check_cluster_backend(&cohort_runtime::available_backends())?;
    registry.config_model_in(&loaded, data_root_env().as_deref())?;
    registry.strategy_of(&loaded)?;
    Ok(loaded)
}

/// A model file (PyTorch's layout) as the tree runs train and aggregate:
/// BatchNorm's `num_batches_tracked` counters dropped.
fn read_model(path: &std::path::Path) -> anyhow::Result<cohort_core::tree::ParamTree> {
    let bytes = cohort_core::fsutil::read_bounded(path, cohort_core::fsutil::MAX_READ_BYTES)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let limits = cohort_core::codec::DecodeLimits {
        max_bytes: bytes.len(),
        ..Default::default()
    };
    cohort_core::codec::decode(&bytes, &limits)
        .map(cohort_core::layout::from_model_file)
        .with_context(|| format!("{} is not a readable safetensors model", path.display()))
}

fn compare_models(
    reference: &std::path::Path,
    candidate: &std::path::Path,
    tolerance: f64,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        tolerance.is_finite() && tolerance >= 0.0,
        "--tolerance must be a finite number >= 0, got {tolerance}"
    );
    let (reference_model, candidate_model) = (read_model(reference)?, read_model(candidate)?);
    // A distance to NaN or infinity says nothing: name where the values are.
    for (path, model) in [(reference, &reference_model), (candidate, &candidate_model)] {
        if let Some((leaf, index)) = model.first_non_finite() {
            anyhow::bail!(
                "{}: `{leaf}`[{index}] is not finite; models with NaN or infinite values cannot \
                 be compared by distance",
                path.display()
            );
        }
    }
    let comparison = cohort_core::compare::compare(&reference_model, &candidate_model)
        .with_context(|| {
            format!(
                "{} and {} are not the same model layout",
                reference.display(),
                candidate.display()
            )
        })?;
    let at = comparison
        .max_abs_at
        .as_ref()
        .map(|path| format!(" (at {path})"))
        .unwrap_or_default();
    println!(
        "elements {}, differing {}, max |a-b| {:.3e}{at}, relative L2 {:.3e}",
        comparison.elements, comparison.differing, comparison.max_abs, comparison.relative_l2
    );
    anyhow::ensure!(
        comparison.relative_l2 <= tolerance,
        "relative L2 distance {:.3e} is above the tolerance {tolerance:.3e}",
        comparison.relative_l2
    );
    Ok(())
}

fn run(args: RunArgs, registry: &Arc<Registry>) -> anyhow::Result<()> {
    let loaded = load_for_run(&args, registry)?;
    let distributed = rank::seat(
        args.plan.as_deref(),
        args.instance.as_deref(),
        args.rank,
        &loaded,
    )?;
    let follower = distributed.as_ref().is_some_and(|d| !d.leader());
    if distributed.is_none()
        && let Some((run_dir, round, accuracy)) = completed(&args, &loaded)
    {
        if !args.quiet {
            println!(
                "{}: all {round} rounds are done (accuracy {accuracy:.4}); nothing to run. \
                 `--rounds N` with N above {round} continues it",
                run_dir.display()
            );
        }
        return Ok(());
    }
    let run_dir = run_dir_of(&args, &loaded, follower)?;
    let loaded = if args.resume.is_none() && distributed.is_none() {
        let name = run_name(&args, &loaded);
        named(loaded, name)?
    } else {
        loaded
    };
    if follower {
        init_stderr_logging(args.quiet, args.verbose)?;
    } else {
        init_logging(&run_dir, args.quiet, args.verbose, args.resume.is_some())?;
    }
    tracing::info!(config = %loaded.path().display(), run_dir = %run_dir.display(), hash = loaded.result_hash(), "run started");
    for note in loaded.notes() {
        // Plato's names read as cohort's: on the terminal once, and in run.log.
        if !follower && !args.quiet {
            eprintln!("{note}");
        }
        tracing::info!("{note}");
    }
    let device = device_of(args.cpu, args.gpu);
    let local_clients = local_clients_of(&args, &loaded, device)?;
    let options = RunOptions {
        device,
        run_dir,
        rounds: None,
        data_root: std::env::var_os(DATA_DIR_ENV).map(PathBuf::from),
        resume: args.resume.is_some(),
        local_clients,
        distributed,
        registry: Arc::clone(registry),
    };
    let fresh = args.resume.is_none() && !follower;
    let run = cohort_runtime::RunBuilder::new(&loaded, options.clone())
        .observer(progress::Terminal::new(!args.quiet))
        .run();
    let summary = match run {
        Ok(summary) => summary,
        // A run that never finished a round leaves nothing to keep or resume.
        Err(error) if fresh && !options.run_dir.join("results.csv").exists() => {
            let _ = std::fs::remove_dir_all(&options.run_dir);
            return Err(error.context(format!(
                "the run failed before its first round; its folder {} was removed",
                options.run_dir.display()
            )));
        }
        Err(error) => return Err(error),
    };
    if args.plot && !summary.rounds.is_empty() {
        let written = plot_runs(
            std::slice::from_ref(&summary.run_dir),
            &summary.run_dir.join(PLOT_FILE),
            &plot::Chart::default(),
        )?;
        tracing::info!(plot = %written.display(), "chart written");
    }
    report_finished(&summary, follower, args.quiet);
    Ok(())
}

/// `--resume` of a run whose newest checkpoint is at its last round: the
/// folder, that round and its accuracy. Whatever cannot be read here is left
/// to the run itself, which says what is wrong.
fn completed(
    args: &RunArgs,
    loaded: &cohort_core::config::LoadedConfig,
) -> Option<(PathBuf, u32, f64)> {
    let run_dir = args.resume.as_ref()?;
    let history = cohort_core::checkpoint::latest(run_dir).ok()?.history;
    let accuracy = history.rounds.last()?.accuracy;
    (history.round >= loaded.config().trainer.rounds)
        .then(|| (run_dir.clone(), history.round, accuracy))
}

/// The run folder: `--resume`'s, or a fresh one (created now); a follower
/// rank's is rank 0's, which it only reads to resume.
fn run_dir_of(
    args: &RunArgs,
    loaded: &cohort_core::config::LoadedConfig,
    follower: bool,
) -> anyhow::Result<PathBuf> {
    if follower {
        return Ok(rank::follower_dir(args.resume.as_ref()));
    }
    let run_dir = match &args.resume {
        Some(run_dir) => run_dir.clone(),
        None => fresh_run_dir(args, loaded)?,
    };
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("cannot create the run folder {}", run_dir.display()))?;
    Ok(run_dir)
}

/// `--cpu` / `--gpu`, else cohort picks.
fn device_of(cpu: bool, gpu: bool) -> DeviceRequest {
    match (cpu, gpu) {
        (true, _) => DeviceRequest::Cpu,
        (_, true) => DeviceRequest::Gpu,
        _ => DeviceRequest::Auto,
    }
}

/// Network mode's client processes started on this machine: `--local-clients`,
/// else one per `trainer.max_concurrency` (none when every client brings its
/// own data: a local one would have nothing to train).
fn local_clients_of(
    args: &RunArgs,
    loaded: &cohort_core::config::LoadedConfig,
    device: DeviceRequest,
) -> anyhow::Result<Option<cohort_runtime::LocalClients>> {
    let local_clients = if loaded.config().clients.comm_simulation {
        if args.local_clients.is_some() {
            anyhow::bail!(
                "--local-clients is for network mode; the config runs clients in process \
                 (clients.comm_simulation = true)"
            );
        }
        None
    } else {
        // When every client brings its own data, a local worker would have
        // nothing to train.
        let clients = &loaded.config().clients;
        let count =
            args.local_clients
                .unwrap_or(if clients.own_data_clients == clients.total_clients {
                    0
                } else {
                    loaded.config().trainer.max_concurrency as usize
                });
        let device_flag = match device {
            DeviceRequest::Cpu => Some("--cpu"),
            DeviceRequest::Gpu => Some("--gpu"),
            DeviceRequest::Auto => None,
        };
        (count > 0).then(|| cohort_runtime::LocalClients {
            program: self_program(),
            count,
            // Their output goes to log files in the run folder, at info level
            // whatever the server's terminal shows.
            args: device_flag.into_iter().map(str::to_owned).collect(),
        })
    };
    Ok(local_clients)
}

/// The last line on the terminal. Written, not `println!`ed: a run keeps
/// SIGPIPE ignored ([`Command::talks_to_peers`]), and a reader of stdout
/// that left early must not turn a finished run into a panic.
fn report_finished(summary: &cohort_runtime::RunSummary, follower: bool, quiet: bool) {
    use std::io::Write as _;
    if quiet {
        return;
    }
    let line = if follower {
        "this rank is done; rank 0 wrote the results".to_owned()
    } else {
        match summary.rounds.last() {
            Some(last) => format!(
                "finished {} rounds: accuracy {:.4}{}; results in {}",
                summary.rounds.len(),
                last.accuracy,
                if summary.reached_target {
                    " (target reached)"
                } else {
                    ""
                },
                summary.run_dir.display()
            ),
            None => format!("no rounds ran; results in {}", summary.run_dir.display()),
        }
    };
    // The results are on disk; a closed stdout loses nothing.
    let _ = writeln!(std::io::stdout(), "{line}");
}

impl RunArgs {
    /// `--unset`, `--set` and `--rounds` as one list of overrides.
    fn overrides(&self) -> Vec<Override> {
        all_overrides(&self.unsets, &self.overrides, self.rounds)
    }
}

/// The config of a new run, or of the run `--resume` continues: its own
/// config.toml (or `--config`, which must compute the same run), with `--set`
/// and `--rounds` over it. A resumed run may change keys that do not change
/// results (rounds, ports, paths), never those that do.
fn load_for_run(args: &RunArgs, registry: &Registry) -> anyhow::Result<LoadedConfig> {
    let overrides = args.overrides();
    let Some(run_dir) = &args.resume else {
        let path = args
            .config
            .as_ref()
            .expect("clap requires --config without --resume");
        return load_config(path, &overrides, registry);
    };
    let saved_path = run_dir.join("config.toml");
    let saved = cohort_core::config::load(&saved_path)
        .with_context(|| format!("{} is not a resumable run folder", run_dir.display()))?;
    let resumed = load_config(
        args.config.as_ref().unwrap_or(&saved_path),
        &overrides,
        registry,
    )?;
    let differences = saved.result_differences(&resumed);
    if !differences.is_empty() {
        let cosine = differences.iter().any(|d| d.starts_with("trainer.rounds:"));
        anyhow::bail!(
            "{} differs from the config {} was started with in keys that change results:\n  {}{}",
            args.config.as_ref().map_or_else(
                || "--set/--rounds".to_owned(),
                |path| path.display().to_string()
            ),
            run_dir.display(),
            differences.join("\n  "),
            if cosine {
                "\n(a cosine schedule spans trainer.rounds, so changing the number of rounds \
                 changes every round's learning rate: start a new run instead)"
            } else {
                ""
            }
        );
    }
    Ok(resumed)
}

/// A new run folder under `--base` (or the config's result or base path):
/// `general.run_name`, else the run's name with the time it started.
fn fresh_run_dir(args: &RunArgs, loaded: &LoadedConfig) -> anyhow::Result<PathBuf> {
    let config = &loaded.config();
    let base = args
        .base
        .clone()
        .or_else(|| config.results.result_path.clone())
        .unwrap_or_else(|| config.general.base_path.clone());
    let created = match &config.general.run_name {
        Some(name) => new_run_dir(&base, loaded.path(), Some(name)),
        None => cohort_runtime::new_timestamped_run_dir(&base, &run_name(args, loaded)),
    };
    created.with_context(|| format!("cannot create a run folder under {}", base.display()))
}

/// The run's name, for its folder and for `cohort plot`'s legends:
/// `general.run_name`, else the config's stem, with the strategy when the
/// command line chose it (`--set algorithm.type=fedprox`), so runs of one
/// config with different strategies are told apart.
fn run_name(args: &RunArgs, loaded: &LoadedConfig) -> String {
    if let Some(name) = &loaded.config().general.run_name {
        return name.clone();
    }
    let stem = loaded
        .path()
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into());
    let strategy_set = args
        .overrides
        .iter()
        .any(|o| o.key == "algorithm.type" && o.value.is_some());
    if strategy_set {
        format!("{stem}-{}", loaded.config().algorithm.name())
    } else {
        stem
    }
}

/// `loaded` with `general.run_name` recorded, so the run folder's
/// config.toml carries the name its charts are labelled with.
fn named(loaded: LoadedConfig, name: String) -> anyhow::Result<LoadedConfig> {
    if loaded.config().general.run_name.is_some() {
        return Ok(loaded);
    }
    let name = Override {
        key: "general.run_name".to_owned(),
        value: Some(toml::Value::String(name)),
    };
    Ok(loaded.with_overrides(&[name])?)
}

/// Logging of a rank that writes no run folder: stderr only.
fn init_stderr_logging(quiet: bool, verbose: bool) -> anyhow::Result<()> {
    let level = if quiet || !verbose { "warn" } else { "info" };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level)),
        )
        .try_init()
        .map_err(|error| anyhow::anyhow!("cannot start logging: {error}"))
}

fn client(args: ClientArgs, registry: &Arc<Registry>) -> anyhow::Result<()> {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(if args.quiet { "warn" } else { "info" }));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // No colour codes in the log files a server gives its own clients.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter)
        .try_init()
        .map_err(|error| anyhow::anyhow!("cannot start logging: {error}"))?;
    anyhow::ensure!(
        args.connect_timeout.is_finite() && args.connect_timeout >= 0.0,
        "--connect-timeout must be a number of seconds >= 0"
    );
    let options = cohort_runtime::WorkerOptions {
        server: args.server,
        token: args
            .token
            .or_else(|| std::env::var("COHORT_TOKEN").ok().filter(|t| !t.is_empty())),
        tls_ca: args.tls_ca,
        tls_domain: args.tls_domain,
        data_root: std::env::var_os(DATA_DIR_ENV).map(PathBuf::from),
        device: match (args.cpu, args.gpu) {
            (true, _) => DeviceRequest::Cpu,
            (_, true) => DeviceRequest::Gpu,
            _ => DeviceRequest::Auto,
        },
        connect_timeout: std::time::Duration::from_secs_f64(args.connect_timeout),
        max_payload_bytes: args.max_payload_bytes,
        host_name: std::env::var("HOSTNAME").unwrap_or_else(|_| "client".to_owned()),
        own_data: args.data.map(|path| cohort_runtime::OwnDataOptions {
            path,
            client_id: args.client_id,
            max_samples: args.max_samples,
            label_column: args.label_column,
        }),
        registry: Arc::clone(registry),
        require_secure_aggregation: args.require_secure_aggregation,
        secagg_fault: args.secagg_fault,
    };
    let summary = cohort_runtime::run_worker(&options)?;
    tracing::info!(
        tasks = summary.tasks,
        failed = summary.failed,
        "the server closed the session"
    );
    Ok(())
}

/// File name of the chart `--plot` and `cohort plot` write by default.
const PLOT_FILE: &str = "accuracy.png";

/// Draws into a temporary PNG beside `output` and renames it, so a reader never
/// sees half a chart.
fn plot_runs(
    runs: &[PathBuf],
    output: &std::path::Path,
    chart: &plot::Chart,
) -> anyhow::Result<PathBuf> {
    let series = runs
        .iter()
        .map(|run| plot::load_run(run))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let stem = output
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "plot".into());
    let temporary = output.with_file_name(format!("{stem}.tmp-{}.png", std::process::id()));
    let drawn = plot::draw(&series, chart, &temporary).and_then(|_| {
        std::fs::rename(&temporary, output)
            .with_context(|| format!("cannot write {}", output.display()))
    });
    if drawn.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    drawn.map(|()| output.to_path_buf())
}

/// Full log to `run.log` in the run folder; warnings (or everything with
/// `--verbose`, or `RUST_LOG`) on stderr.
fn init_logging(
    run_dir: &std::path::Path,
    quiet: bool,
    verbose: bool,
    append: bool,
) -> anyhow::Result<()> {
    // A resumed run appends to the log of the run it continues.
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(append)
        .write(!append)
        .truncate(!append)
        .open(run_dir.join("run.log"))
        .context("cannot open run.log")?;
    let stderr_level = if verbose { "info" } else { "warn" };
    let stderr_filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(if quiet { "warn" } else { stderr_level }));
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(Mutex::new(log_file))
                .with_ansi(false)
                .with_filter(EnvFilter::new("info")),
        )
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(stderr_filter),
        )
        .try_init()
        .context("cannot start logging")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// An error that prints its source in its own message and also gives it
    /// as its source, as many libraries' errors do.
    #[derive(Debug)]
    struct Reading(std::io::Error);

    impl std::fmt::Display for Reading {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot read data.bin: {}", self.0)
        }
    }

    impl std::error::Error for Reading {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_already_in_its_message_is_said_once() {
        let oom = || std::io::Error::new(std::io::ErrorKind::OutOfMemory, "out of memory");
        let error = anyhow::Error::new(Reading(oom())).context("loading the data");
        assert_eq!(
            format!("{error:#}"),
            "loading the data: cannot read data.bin: out of memory: out of memory"
        );
        assert_eq!(
            super::error_chain(&error),
            "loading the data: cannot read data.bin: out of memory"
        );
        let plain = anyhow::Error::new(oom()).context("loading the data");
        assert_eq!(
            super::error_chain(&plain),
            "loading the data: out of memory"
        );
    }
}
