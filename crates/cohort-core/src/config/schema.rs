//! The typed configuration: one struct per TOML section.
//!
//! Every field has a default documented in `docs/CONFIG.md`; keep the two in
//! step. Unknown keys are rejected by the loader (with a did-you-mean), so the
//! structs themselves accept only what they declare.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

// The keys of simulated devices and asynchronous rounds are written (to
// config.toml, and so to the config hash) only when set: a run started
// before they existed keeps its hash and can be resumed.
fn is_default<T: Default + PartialEq>(value: &T) -> bool {
    *value == T::default()
}

fn is_one(value: &f64) -> bool {
    *value == 1.0
}

fn is_one_u32(value: &u32) -> bool {
    *value == 1
}

fn is_true(value: &bool) -> bool {
    *value
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub general: General,
    pub clients: Clients,
    pub server: Server,
    pub data: Data,
    pub trainer: Trainer,
    pub algorithm: crate::strategy::AlgorithmConfig,
    pub parameters: Parameters,
    pub results: Results,
    pub cluster: Cluster,
    /// `[secure_aggregation]`: present, the server learns only the round's
    /// weighted sum (see [`SecureAggregation`]); absent, every update is
    /// seen in the clear, as before. Left out of the serialized config when
    /// absent, so the result hash of a config without it is unchanged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secure_aggregation: Option<SecureAggregation>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct General {
    /// Folder under which run folders are created.
    pub base_path: PathBuf,
    /// Name of the run folder; default: the config file's stem and a timestamp.
    pub run_name: Option<String>,
}

impl Default for General {
    fn default() -> Self {
        Self {
            base_path: PathBuf::from("runs"),
            run_name: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Clients {
    #[serde(rename = "type")]
    pub kind: String,
    pub total_clients: u32,
    pub per_round: u32,
    /// Selected clients evaluate the global model they receive on a held-out
    /// part of their partition; results.csv gets the federated accuracy.
    pub do_test: bool,
    /// Fraction of each client's partition held out for `do_test`.
    pub test_fraction: f64,
    /// Simulated Byzantine clients for experiments: `none`, `scale` or
    /// `sign_flip` (see docs/ALGORITHMS.md).
    pub attack: crate::attack::Attack,
    /// How many of each round's selected clients attack.
    pub attackers_per_round: u32,
    /// The factor s of the attack.
    pub attack_scale: f64,
    /// true: clients run in this process; false: separate client processes
    /// over gRPC (`cohort client`).
    pub comm_simulation: bool,
    /// Reports a round needs to aggregate; default `per_round`.
    pub min_per_round: Option<u32>,
    /// Client → server, applied by the client to its update.
    pub outbound_processors: Vec<String>,
    /// Server → client, applied by the client to the global model it receives.
    pub inbound_processors: Vec<String>,
    /// Client upload bandwidth in Mbit/s for simulated wall time; default: measured.
    pub uplink_mbps: Option<f64>,
    /// Client download bandwidth in Mbit/s for simulated wall time; default: measured.
    pub downlink_mbps: Option<f64>,
    /// Network mode: logical clients 1..=own_data_clients are `cohort client
    /// --data` processes that train on data they hold; the others train
    /// partitions of the run's data set. Default 0.
    pub own_data_clients: u32,
    /// Most training (and held-out) samples an own-data client may declare,
    /// and so the most weight it can get in a sample-weighted average.
    pub max_samples: u64,
    /// A file of `ID TOKEN` lines, one per own-data client: a process may
    /// claim an id only with its token. Default: none (the run's
    /// `server.auth_token` admits a claim of any free id).
    pub own_data_token_file: Option<PathBuf>,
    /// `[clients.profile]`: simulated devices (compute speed, links); see
    /// [`crate::devices`]. Default: none, simulated time from measured times.
    #[serde(skip_serializing_if = "is_default")]
    pub profile: crate::devices::ProfileConfig,
    /// `[clients.availability]`: when each client is online. Default: always.
    #[serde(skip_serializing_if = "is_default")]
    pub availability: crate::devices::AvailabilityConfig,
    /// Draw this many times `per_round` clients (rounded up) and aggregate
    /// the first `per_round` updates to arrive on the simulated clock
    /// (Bonawitz et al. 2019). Default 1: no over-selection.
    #[serde(skip_serializing_if = "is_one")]
    pub over_selection: f64,
    /// Who trains each round: `random` (uniform), `power_of_choice` (Cho et
    /// al. 2020) or `oort` (Lai et al. 2021); see [`crate::selection`].
    /// Default `random`.
    #[serde(skip_serializing_if = "is_default")]
    pub selection: crate::selection::SelectionKind,
    /// Random rounds draw their clients in this many contiguous blocks of
    /// ids, each block's share in proportion to its size (stratified
    /// sampling; [`crate::selection::ClientSelector::select_stratified`]).
    /// Default 1: one uniform draw of all.
    #[serde(skip_serializing_if = "is_one_u32")]
    pub strata: u32,
    /// `[clients.power_of_choice]`: its candidate set's size.
    #[serde(skip_serializing_if = "is_default")]
    pub power_of_choice: crate::selection::PowerOfChoiceOptions,
    /// `[clients.oort]`: Oort's parameters, under its names.
    #[serde(skip_serializing_if = "is_default")]
    pub oort: crate::selection::OortOptions,
}

impl Default for Clients {
    fn default() -> Self {
        Self {
            kind: "simple".to_owned(),
            total_clients: 10,
            per_round: 2,
            do_test: false,
            test_fraction: 0.2,
            attack: crate::attack::Attack::None,
            attackers_per_round: 0,
            attack_scale: 10.0,
            comm_simulation: true,
            min_per_round: None,
            outbound_processors: vec!["safetensor_encode".to_owned()],
            inbound_processors: vec!["safetensor_decode".to_owned()],
            uplink_mbps: None,
            downlink_mbps: None,
            own_data_clients: 0,
            max_samples: 100_000,
            own_data_token_file: None,
            profile: crate::devices::ProfileConfig::default(),
            availability: crate::devices::AvailabilityConfig::default(),
            over_selection: 1.0,
            selection: crate::selection::SelectionKind::Random,
            strata: 1,
            power_of_choice: crate::selection::PowerOfChoiceOptions::default(),
            oort: crate::selection::OortOptions::default(),
        }
    }
}

impl Clients {
    /// Whether every logical client is an own-data client: the run's data set
    /// is then needed for its test split alone (the server's evaluation), and
    /// no partition of its training set is ever computed.
    pub fn all_own_data(&self) -> bool {
        self.own_data_clients > 0 && self.own_data_clients == self.total_clients
    }

    /// Clients drawn each round: `per_round × over_selection` rounded up, at
    /// most every client.
    pub fn drawn_per_round(&self) -> u32 {
        let drawn = (f64::from(self.per_round) * self.over_selection.max(1.0)).ceil();
        if drawn.is_finite() && drawn < f64::from(self.total_clients) {
            (drawn as u32).max(self.per_round)
        } else {
            self.total_clients
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Server {
    /// Plato's name for the algorithm; if given, it must equal `algorithm.type`.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub address: String,
    pub port: u16,
    /// Seed of the client-selection RNG.
    pub random_seed: u64,
    pub simulate_wall_time: bool,
    /// Rounds between checkpoints; the last round is always checkpointed.
    pub checkpoint_interval: u32,
    /// How many of the newest checkpoints a run keeps (older ones are
    /// deleted once a newer one is written whole). Default: all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoints_kept: Option<u32>,
    /// Bytes of per-client strategy state (SCAFFOLD's control variates) kept
    /// in memory; beyond it, that state lives in a file of the run folder.
    pub client_state_memory_bytes: u64,
    /// Applied by the server to each client's update.
    pub inbound_processors: Vec<String>,
    /// Applied by the server to the global model it sends.
    pub outbound_processors: Vec<String>,
    /// Largest payload accepted in either direction, after decompression.
    pub max_payload_bytes: u64,
    /// Update bytes all clients together may have in flight to the server;
    /// default: 4 GiB, or `max_payload_bytes` when that is larger.
    pub max_inflight_bytes: Option<u64>,
    /// HTTP/2 flow-control window of each connection and stream (network
    /// mode): bytes a client may send before the server has read them.
    /// Default: hyper's (1 MiB a stream). Smaller bounds what waiting
    /// uploads hold in memory (connections × window), at the cost of upload
    /// speed over links with a long round trip (window / round trip).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_window_bytes: Option<u32>,
    /// Seconds a client may take for one task (download, train, upload) before
    /// it is dropped from the round.
    pub payload_timeout: f64,
    /// Seconds the server waits for client processes to register.
    pub registration_timeout: f64,
    /// Connections open at once from one IP address (network mode), so
    /// one host cannot take every connection slot; raised to fit the
    /// client processes a run starts on its own machine.
    pub max_connections_per_address: u32,
    /// Shared secret client processes must present; default: none.
    pub auth_token: Option<String>,
    /// PEM certificate chain and key for TLS; default: plain TCP.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Drops an update whose distance from the global model is more than
    /// this many times the round's median distance; default: off.
    pub max_update_norm_ratio: Option<f64>,
    /// Refuses an aggregated model farther from the global model than this
    /// many times the global model's norm (at least 1): the round keeps the
    /// model it started from. `inf` is off.
    pub max_model_step_ratio: f64,
    /// `false`: Plato's asynchronous server. Up to `clients.per_round`
    /// clients train at once, a new one is selected whenever one finishes,
    /// and the strategy aggregates every `minimum_clients_aggregated`
    /// updates: on the simulated clock of a `[clients.profile]` in
    /// simulation mode, on the real one (updates as they arrive) in network
    /// mode.
    #[serde(skip_serializing_if = "is_true")]
    pub synchronous: bool,
    /// Asynchronous runs: updates aggregated at once (FedBuff's K). Default 1.
    #[serde(skip_serializing_if = "is_one_u32")]
    pub minimum_clients_aggregated: u32,
    /// Asynchronous runs: an update trained from a model more than this many
    /// versions old is dropped. Default: none, every update is used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staleness_bound: Option<u32>,
    /// Synchronous rounds on the simulated clock: updates that would arrive
    /// more than this many seconds after the round started are dropped as
    /// late. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub round_deadline: Option<f64>,
}

impl Default for Server {
    fn default() -> Self {
        Self {
            kind: None,
            address: "127.0.0.1".to_owned(),
            port: 8000,
            random_seed: 1,
            simulate_wall_time: true,
            checkpoint_interval: 1,
            checkpoints_kept: None,
            client_state_memory_bytes: 1 << 30,
            inbound_processors: vec!["safetensor_decode".to_owned()],
            outbound_processors: vec!["safetensor_encode".to_owned()],
            max_payload_bytes: 1 << 30,
            max_inflight_bytes: None,
            stream_window_bytes: None,
            payload_timeout: 600.0,
            registration_timeout: 120.0,
            max_connections_per_address: 64,
            auth_token: None,
            tls_cert: None,
            tls_key: None,
            max_update_norm_ratio: None,
            max_model_step_ratio: 1e6,
            synchronous: true,
            minimum_clients_aggregated: 1,
            staleness_bound: None,
            round_deadline: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Data {
    /// A data set of the registry the run is given: cohort's `MNIST`,
    /// `FashionMNIST`, `EMNIST`, `CIFAR10`, `CIFAR100`, `FEMNIST` and
    /// `Shakespeare` ([`crate::data::DataSource`]), plus any an embedding
    /// program registers; checked against it when the run is assembled.
    pub datasource: String,
    pub data_path: PathBuf,
    /// How the training set is split among the clients.
    /// Crop and flip training batches where the data set defines it (CIFAR's
    /// 4-pixel-padded random crop and horizontal flip); `false` trains on the
    /// samples as they are.
    pub augment: bool,
    pub sampler: Sampler,
    /// Samples per client (`iid` only); default: the training set divided evenly.
    pub partition_size: Option<usize>,
    /// Samples of each client in turn (one entry per client), for unequal
    /// clients (`iid` only); excludes `partition_size`.
    pub partition_sizes: Option<Vec<usize>>,
    /// Dirichlet concentration α of `dirichlet` and `quantity_skew`: small is
    /// skewed, large approaches iid.
    pub concentration: f64,
    /// Label-sorted shards each client gets (`shards`).
    pub shards_per_client: usize,
    /// Smallest partition `dirichlet` and `quantity_skew` may give a client;
    /// draws that give less are redrawn.
    pub min_partition_size: usize,
    /// Seed of the partitioning shuffle.
    pub random_seed: u64,
    /// Fetch missing files from the public mirrors.
    pub download: bool,
    /// Mirror base URLs tried in order; default: the dataset's standard mirrors.
    pub mirrors: Option<Vec<String>>,
    /// The file of a file data set (`CSV`, `NPZ`, `Safetensors`: see
    /// [`crate::data::tabular`]), relative to `data_path` unless absolute;
    /// required for those, refused for the others.
    pub train_file: Option<PathBuf>,
    /// A file data set's test file, in the same format; default: the test
    /// arrays of `train_file` (NPZ, Safetensors) or `test_fraction`.
    pub test_file: Option<PathBuf>,
    /// `CSV`: the column of labels; default `"label"`.
    pub label_column: Option<String>,
    /// `CSV`: a column of integer client ids, not a feature; it makes the
    /// `natural` sampler's users.
    pub client_column: Option<String>,
    /// A file data set without a test set: this fraction (0 < f < 1) of the
    /// training file, drawn by a seeded shuffle, is the test set.
    pub test_fraction: Option<f64>,
    /// Seed of `test_fraction`'s shuffle; default: `random_seed`.
    pub split_seed: Option<u64>,
}

impl Data {
    /// `datasource` when it is one of cohort's own data sets.
    pub fn builtin_source(&self) -> Option<crate::data::DataSource> {
        crate::data::DataSource::from_name(&self.datasource)
    }
}

impl Default for Data {
    fn default() -> Self {
        Self {
            datasource: "MNIST".to_owned(),
            data_path: PathBuf::from("data"),
            augment: true,
            sampler: Sampler::Iid,
            partition_size: None,
            partition_sizes: None,
            concentration: 1.0,
            shards_per_client: 2,
            min_partition_size: 10,
            random_seed: 1,
            download: true,
            mirrors: None,
            train_file: None,
            test_file: None,
            label_column: None,
            client_column: None,
            test_fraction: None,
            split_seed: None,
        }
    }
}

/// `data.sampler`: how the training set is split among the clients (see
/// [`crate::partition`]). An unknown name is a serde error that lists these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sampler {
    /// A seeded shuffle cut into equal (or `partition_sizes`) runs.
    #[default]
    Iid,
    /// Plato's iid: the shuffle repeated to fill `total_clients ×
    /// partition_size`, client `c` taking every `total_clients`-th sample; a
    /// size beyond the training set's share repeats samples.
    IidCyclic,
    /// Label skew: each class split among clients by Dir(`concentration`).
    /// Plato's name for it, `noniid`, is read by the Plato layer.
    Dirichlet,
    /// McMahan et al.'s label-sorted shards, `shards_per_client` per client.
    Shards,
    /// Iid contents, sizes drawn from Dir(`concentration`).
    QuantitySkew,
    /// The data set's own users as clients (FEMNIST's writers, Shakespeare's
    /// roles): `total_clients` of them in a seeded order.
    Natural,
}

impl Sampler {
    /// The name as written in a config.
    pub fn name(self) -> &'static str {
        match self {
            Sampler::Iid => "iid",
            Sampler::IidCyclic => "iid_cyclic",
            Sampler::Dirichlet => "dirichlet",
            Sampler::Shards => "shards",
            Sampler::QuantitySkew => "quantity_skew",
            Sampler::Natural => "natural",
        }
    }
}

impl std::fmt::Display for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `trainer.lr_scheduler`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrScheduler {
    /// The configured rate every round.
    #[default]
    None,
    /// Multiply by `lr_gamma` every `lr_step_size` rounds.
    Step,
    /// Cosine annealing to `lr_min` over `trainer.rounds`.
    Cosine,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Trainer {
    #[serde(rename = "type")]
    pub kind: String,
    pub rounds: u32,
    /// Physical workers; unset, one per core this process may use
    /// ([`default_max_concurrency`]). Results do not depend on it.
    pub max_concurrency: u32,
    pub target_accuracy: Option<f64>,
    pub epochs: u32,
    pub batch_size: usize,
    pub optimizer: String,
    /// A model of the registry the run is given (`cohort-train`'s built-in
    /// models, plus any an embedding program registers); checked against it
    /// when the run is assembled, since cohort-core knows no model names.
    pub model_name: String,
    pub model_seed: Option<u64>,
    /// Round 1's global model from a safetensors file in PyTorch's layout
    /// (a `model.safetensors` of an earlier run, or a PyTorch state dict)
    /// instead of the seeded construction.
    pub initial_model: Option<std::path::PathBuf>,
    pub training_seed: Option<u64>,
    pub clip_grad_norm: Option<f64>,
    /// Compute threads per physical worker.
    pub threads_per_worker: u32,
    /// Batch size of the server's test-set evaluation.
    pub eval_batch_size: usize,
    /// Learning-rate schedule across rounds: `none`, `step` or `cosine`.
    pub lr_scheduler: LrScheduler,
    /// `step`: rounds between decays.
    pub lr_step_size: u32,
    /// `step`: factor applied at each decay.
    pub lr_gamma: f64,
    /// `cosine`: the rate reached at the last round.
    pub lr_min: f64,
    /// Train clients one by one (`"off"`), or up to K of a round as one
    /// batched computation (an integer K, or `"auto"`: K from a memory budget).
    pub vectorized_clients: VectorizedClients,
}

/// `trainer.vectorized_clients`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "VectorizedValue", into = "VectorizedValue")]
pub enum VectorizedClients {
    /// Each worker trains one client at a time.
    #[default]
    Off,
    /// As many clients at a time as the trainer's memory budget holds.
    Auto,
    /// Up to this many clients at a time (at least 1).
    Clients(u32),
}

/// How `trainer.vectorized_clients` is written: a word or a number.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum VectorizedValue {
    Number(i64),
    Word(String),
}

impl TryFrom<VectorizedValue> for VectorizedClients {
    type Error = String;

    fn try_from(value: VectorizedValue) -> Result<Self, String> {
        let expected = "expected \"off\", \"auto\" or a number of clients from 1 to 4294967295";
        match value {
            VectorizedValue::Word(word) => match word.to_ascii_lowercase().as_str() {
                "off" => Ok(Self::Off),
                "auto" => Ok(Self::Auto),
                _ => Err(format!("{expected}, got \"{word}\"")),
            },
            VectorizedValue::Number(n) => match u32::try_from(n) {
                Ok(k) if k >= 1 => Ok(Self::Clients(k)),
                _ => Err(format!("{expected}, got {n}")),
            },
        }
    }
}

impl From<VectorizedClients> for VectorizedValue {
    fn from(value: VectorizedClients) -> Self {
        match value {
            VectorizedClients::Off => Self::Word("off".to_owned()),
            VectorizedClients::Auto => Self::Word("auto".to_owned()),
            VectorizedClients::Clients(k) => Self::Number(k.into()),
        }
    }
}

/// One worker per core this process may use (its CPU affinity and cgroup
/// quota counted), 1 when the system does not say: training scales with
/// cores, and the result is the same for any worker count.
pub fn default_max_concurrency() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| (n.get() as u32).min(super::MAX_WORKERS))
}

impl Default for Trainer {
    fn default() -> Self {
        Self {
            kind: "basic".to_owned(),
            rounds: 5,
            max_concurrency: default_max_concurrency(),
            target_accuracy: None,
            epochs: 5,
            batch_size: 32,
            optimizer: "adam".to_owned(),
            model_name: "lenet5".to_owned(),
            model_seed: None,
            initial_model: None,
            training_seed: None,
            clip_grad_norm: None,
            threads_per_worker: 1,
            eval_batch_size: 1000,
            lr_scheduler: LrScheduler::None,
            lr_step_size: 1,
            lr_gamma: 0.1,
            lr_min: 0.0,
            vectorized_clients: VectorizedClients::Off,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Parameters {
    pub model: ModelParameters,
    /// `learning_rate` and the options of `trainer.optimizer`, checked by
    /// [`crate::optim::OptimizerSpec::from_config`].
    pub optimizer: BTreeMap<String, toml::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelParameters {
    pub num_classes: usize,
    /// Every other key of `[parameters.model]`: options of the model that
    /// `trainer.model_name` names (`norm`, `hidden`, ...). cohort-core knows
    /// no model, so it keeps them as read; the model registry checks them,
    /// a key the model does not read included. Not a key itself (serde
    /// skips it): the loader fills it and [`super::to_toml`] writes it back.
    #[serde(skip)]
    pub options: BTreeMap<String, toml::Value>,
}

impl Default for ModelParameters {
    fn default() -> Self {
        Self {
            num_classes: 10,
            options: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Results {
    /// Where run folders go; overrides `general.base_path` when set.
    pub result_path: Option<PathBuf>,
    /// Also write every client update the server received, as
    /// `updates/round-NNNN/client-CCCC.safetensors` (for audits and debugging).
    pub keep_client_updates: bool,
}

/// `[cluster]`: how a run spreads over ranks and machines (`cohort place`
/// plans it from a cluster file). Without a backend the run is one process,
/// as it always was. Where the run goes does not change what it computes, so
/// these keys are result-neutral ([`super::RESULT_NEUTRAL_KEYS`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Cluster {
    /// The collective backend: `grpc`, `ring`, `mpi` or `rdma`. Default: none,
    /// one process. A name cohort does not know is refused at load with the
    /// valid ones; one this build lacks (`mpi` without `--features mpi`) is
    /// refused by the command that loads the config, which knows the build.
    #[serde(
        deserialize_with = "backend_name",
        skip_serializing_if = "Option::is_none"
    )]
    pub backend: Option<crate::cluster::Backend>,
    /// The cluster file (`cohort place`'s `--cluster`), relative to the config
    /// file that sets it, as `include` is. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// Exactly this many ranks, at least 1 and at most
    /// `clients.total_clients`. Default: one rank per node of the smallest set
    /// of nodes that fits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<u32>,
    /// Fewest nodes to spread over, at least 1 and at most `ranks`. Default: 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_nodes: Option<u32>,
    /// How ranks combine a round. Default: `gather`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reduce: Option<Reduce>,
}

/// How the ranks of a distributed simulation combine a round's updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reduce {
    /// Every rank receives every update and aggregates as one process would:
    /// the model equals the single-process one bit for bit, for any strategy.
    #[default]
    Gather,
    /// Each rank sends one partial sum (`Σ nᵢ·xᵢ`, `Σ nᵢ`) instead of its
    /// updates: one model's worth per rank, whatever its number of clients.
    /// Only for strategies that aggregate by the weighted mean (`fedavg`,
    /// `fedprox`, `fedavgm`, `fedadam`, `fedyogi`, `fedadagrad`) and runs
    /// without server hooks; equal to the single-process
    /// model up to rounding (float64 partial sums in rank order).
    Partial,
}

/// `cluster.backend` through [`crate::cluster::Backend::parse`], whose error
/// lists the valid names with a did-you-mean and says what a foreign name
/// (`nccl`, `jaccl`, `gloo`) is.
fn backend_name<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<crate::cluster::Backend>, D::Error> {
    let name = String::deserialize(deserializer)?;
    crate::cluster::Backend::parse(&name)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// `[secure_aggregation]`: SecAgg+ (Bell et al. 2020) or SecAgg (Bonawitz et
/// al. 2017) with the names and meanings of Flower's `SecAggPlusWorkflow`.
/// Checked, and the counts resolved against `clients.per_round`, by
/// `config/secure.rs`; the protocol itself is [`crate::secagg`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecureAggregation {
    /// `secaggplus` (a random sparse graph of `num_shares`) or `secagg`
    /// (the complete graph). Default: `secaggplus`.
    pub protocol: SecAggProtocol,
    /// SecAgg+: shares of each client's secrets, itself included: an odd
    /// count of at least 3, or a fraction of the round's clients in (0, 1]
    /// (rounded up to an odd count, as Flower does). Required for
    /// `secaggplus`; refused for `secagg`, which shares with every client.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_shares: Option<ShareCount>,
    /// Shares needed to rebuild a secret: a count, or a fraction of
    /// `num_shares` in (0, 1] (rounded up). More than half of the shares.
    /// Required.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reconstruction_threshold: Option<ShareCount>,
    /// The largest sample weight a client may carry. Default: 1000.
    pub max_weight: f64,
    /// Each weighted value is clipped to `[-clipping_range, clipping_range]`.
    /// Default: 8.
    pub clipping_range: f64,
    /// Clipped values become integers in `[0, quantization_range]`.
    /// Default: 2^22.
    pub quantization_range: u64,
    /// Masked arithmetic is modulo this power of two, at most 2^32.
    /// Default: 2^32.
    pub modulus_range: u64,
    /// Seconds the server waits for each stage's messages (network mode);
    /// default: `server.payload_timeout`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
    /// Simulation only: the fraction of each round's clients that vanish
    /// during the protocol (each at a stage drawn from the server's seed),
    /// to measure and test dropout handling. Default: 0.
    pub simulated_dropout: f64,
    /// Noise each client adds to its update before masking, for
    /// differential privacy that does not trust the server: `none`
    /// (default) or `distributed_discrete_gaussian` ([`crate::secagg::ddg`]).
    /// Left out of the written config (and so of the result hash) when
    /// `none`, so runs from before the key existed keep their hash.
    #[serde(skip_serializing_if = "SecAggNoise::is_none")]
    pub noise: SecAggNoise,
    /// With noise: each client's change is clipped to this L2 norm.
    /// Required with noise; refused without.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip_norm: Option<f64>,
    /// With noise: the whole sum's noise has standard deviation
    /// `noise_multiplier · clip_norm`, shared among `clients.per_round`.
    /// Required with noise; refused without.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub noise_multiplier: Option<f64>,
    /// With noise: the value of one integer step of the encoding; default:
    /// chosen so that four standard deviations of the sum fit the modulus.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub granularity: Option<f64>,
    /// With noise: the δ that ε is reported for. Default: 1e-5.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<f64>,
}

impl Default for SecureAggregation {
    fn default() -> Self {
        Self {
            protocol: SecAggProtocol::SecAggPlus,
            num_shares: None,
            reconstruction_threshold: None,
            max_weight: 1000.0,
            clipping_range: 8.0,
            quantization_range: 1 << 22,
            modulus_range: 1 << 32,
            timeout: None,
            simulated_dropout: 0.0,
            noise: SecAggNoise::None,
            clip_norm: None,
            noise_multiplier: None,
            granularity: None,
            delta: None,
        }
    }
}

impl SecAggNoise {
    fn is_none(&self) -> bool {
        *self == SecAggNoise::None
    }
}

/// `secure_aggregation.noise`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum SecAggNoise {
    /// No noise: the server learns the exact (quantised) weighted mean.
    #[default]
    #[serde(rename = "none")]
    None,
    /// Kairouz, Liu and Steinke 2021: each client clips its change and adds
    /// its share of discrete Gaussian noise before masking.
    #[serde(rename = "distributed_discrete_gaussian")]
    DistributedDiscreteGaussian,
}

/// `secure_aggregation.protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum SecAggProtocol {
    /// SecAgg+: each client shares with `num_shares - 1` neighbours.
    #[default]
    #[serde(rename = "secaggplus")]
    SecAggPlus,
    /// SecAgg: each client shares with every other client.
    #[serde(rename = "secagg")]
    SecAgg,
}

/// A count of shares, or a fraction of what it is counted against, as
/// Flower takes `num_shares` and `reconstruction_threshold` (an integer is a
/// count, a float a fraction).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ShareCount {
    Count(u64),
    Fraction(f64),
}

impl ShareCount {
    /// The count out of `of`: a count as it is, a fraction `f` as `⌈f·of⌉`.
    pub fn resolve(self, of: usize) -> usize {
        match self {
            ShareCount::Count(count) => usize::try_from(count).unwrap_or(usize::MAX),
            ShareCount::Fraction(fraction) => (fraction * of as f64).ceil() as usize,
        }
    }
}

impl Serialize for ShareCount {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match *self {
            ShareCount::Count(count) => serializer.serialize_u64(count),
            ShareCount::Fraction(fraction) => serializer.serialize_f64(fraction),
        }
    }
}

impl<'de> Deserialize<'de> for ShareCount {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ShareCount;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a whole number of shares, or a fraction in (0, 1]")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ShareCount, E> {
                u64::try_from(v)
                    .map(ShareCount::Count)
                    .map_err(|_| E::custom(format!("{v} is negative; expected a number of shares")))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ShareCount, E> {
                Ok(ShareCount::Count(v))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<ShareCount, E> {
                if v.is_finite() && v > 0.0 && v <= 1.0 {
                    Ok(ShareCount::Fraction(v))
                } else {
                    Err(E::custom(format!(
                        "{v} is not a fraction in (0, 1]; expected a whole number of shares or a \
                         fraction of them"
                    )))
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}
