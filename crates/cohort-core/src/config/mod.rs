//! Loading and validating the run configuration.
//!
//! A config is one TOML file with the sections of [`Config`]. Inside any
//! section, `include = "other.toml"` (or a list of files) merges that file's
//! keys into the section; keys written in the section itself win. Paths are
//! relative to the file that names them.
//!
//! Every problem is a [`ConfigError`] that names the file, the key and what was
//! expected: TOML syntax, unknown sections and keys (with a did-you-mean), wrong
//! types, and impossible values such as `per_round > total_clients`.

mod foreign;
pub(crate) mod introspect;
mod overrides;
mod plato;
mod schema;
pub mod secure;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub use overrides::Override;
pub use schema::*;

use crate::optim::OptimizerSpec;
use crate::strategy::{AlgorithmConfig, RegisteredAlgorithm};
use crate::suggest::did_you_mean;

/// A configuration problem, with where it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: PathBuf,
    /// Dotted key such as `clients.per_round`; `None` for file-level problems.
    pub key: Option<String>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.key {
            Some(key) => write!(f, "{}: `{key}`: {}", self.file.display(), self.message),
            None => write!(f, "{}: {}", self.file.display(), self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Every problem found in one config, in the order found: a config is checked
/// to the end, so one edit can fix them all rather than one per run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(Vec<ConfigError>);

impl ConfigErrors {
    /// The problems, at least one.
    pub fn errors(&self) -> &[ConfigError] {
        &self.0
    }

    /// The first problem found.
    pub fn first(&self) -> &ConfigError {
        &self.0[0]
    }
}

impl From<ConfigError> for ConfigErrors {
    fn from(error: ConfigError) -> Self {
        Self(vec![error])
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let [one] = self.0.as_slice() {
            return one.fmt(f);
        }
        write!(f, "{} problems in the config:", self.0.len())?;
        for error in &self.0 {
            write!(f, "\n  {error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A validated config with where each key came from.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    config: Config,
    optimizer: OptimizerSpec,
    path: PathBuf,
    merged: toml::Table,
    notes: Vec<String>,
    origins: BTreeMap<String, PathBuf>,
}

/// A validated config is read, never changed: its fields are private so
/// nothing can turn it into one that would not have passed validation. A
/// different config is loaded anew (with `--set`-style overrides, see
/// [`load_with`] and [`LoadedConfig::with_overrides`]).
impl LoadedConfig {
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The optimizer `[trainer]` names, with its options checked.
    pub fn optimizer(&self) -> &OptimizerSpec {
        &self.optimizer
    }

    /// The top-level file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The fully merged table, as the run saw it (Plato's names translated).
    pub fn merged(&self) -> &toml::Table {
        &self.merged
    }

    /// One line for each Plato name read as cohort's (see `config/plato.rs`).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// This config with `overrides` over it, validated anew as if they had
    /// been given with `--set` when it was loaded.
    pub fn with_overrides(&self, overrides: &[Override]) -> Result<Self, ConfigErrors> {
        let mut loaded = from_table(self.merged.clone(), &self.path, overrides)?;
        for (key, origin) in &self.origins {
            if !overrides.iter().any(|o| &o.key == key) {
                loaded.origins.insert(key.clone(), origin.clone());
            }
        }
        loaded.notes = self.notes.clone();
        Ok(loaded)
    }
}

/// The four payload pipelines of a config, checked to fit together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipelines {
    /// The client's update on its way to the server.
    pub client_outbound: crate::processors::Pipeline,
    pub server_inbound: crate::processors::Pipeline,
    /// The global model on its way to the clients.
    pub server_outbound: crate::processors::Pipeline,
    pub client_inbound: crate::processors::Pipeline,
}

impl Pipelines {
    pub fn from_config(config: &Config) -> Result<Self, crate::processors::PipelineError> {
        use crate::processors::{Pipeline, check_pair};
        let pipelines = Self {
            client_outbound: Pipeline::sender(
                "clients.outbound_processors",
                &config.clients.outbound_processors,
            )?,
            server_inbound: Pipeline::receiver(
                "server.inbound_processors",
                &config.server.inbound_processors,
            )?,
            server_outbound: Pipeline::sender(
                "server.outbound_processors",
                &config.server.outbound_processors,
            )?,
            client_inbound: Pipeline::receiver(
                "clients.inbound_processors",
                &config.clients.inbound_processors,
            )?,
        };
        check_pair(
            "clients.outbound_processors",
            &pipelines.client_outbound,
            "server.inbound_processors",
            &pipelines.server_inbound,
        )?;
        check_pair(
            "server.outbound_processors",
            &pipelines.server_outbound,
            "clients.inbound_processors",
            &pipelines.client_inbound,
        )?;
        Ok(pipelines)
    }
}

impl LoadedConfig {
    /// The payload pipelines; the config was checked at load, so they fit.
    pub fn pipelines(&self) -> Pipelines {
        Pipelines::from_config(&self.config).expect("pipelines are checked when the config loads")
    }

    /// Each client's training-sample indices (client `c` at index `c - 1`),
    /// split by `data.sampler` from the training set's `labels` (or, for the
    /// natural sampler, its samples' `users`).
    pub fn partitions(
        &self,
        labels: &[u32],
        users: Option<&[u32]>,
    ) -> Result<Vec<Vec<u32>>, crate::partition::PartitionError> {
        use crate::partition;
        let data = &self.config.data;
        let clients = self.config.clients.total_clients as usize;
        let (alpha, min_size, seed) = (
            data.concentration,
            data.min_partition_size,
            data.random_seed,
        );
        match data.sampler {
            Sampler::Iid => match &data.partition_sizes {
                Some(sizes) => partition::iid_sized(labels.len(), sizes, seed),
                None => partition::iid(labels.len(), clients, data.partition_size, seed),
            },
            Sampler::IidCyclic => {
                partition::iid_cyclic(labels.len(), clients, data.partition_size, seed)
            }
            Sampler::Dirichlet => {
                // A file data set's classes come from its labels, and may
                // be more than the default num_classes.
                let labelled = labels.iter().max().map_or(0, |&l| l as usize + 1);
                let classes = self.config.parameters.model.num_classes.max(labelled);
                partition::dirichlet(labels, classes, clients, alpha, min_size, seed)
            }
            Sampler::Shards => partition::shards(labels, clients, data.shards_per_client, seed),
            Sampler::QuantitySkew => {
                partition::quantity_skew(labels.len(), clients, alpha, min_size, seed)
            }
            Sampler::Natural => match users {
                Some(users) => partition::natural(users, clients, seed),
                None => Err(partition::PartitionError::NoUsers {
                    datasource: data.datasource.clone(),
                }),
            },
        }
    }

    /// The facts about the run that strategy options are checked against.
    pub fn run_shape(&self) -> crate::strategy::RunShape {
        use crate::optim::OptimizerSpec;
        let clients = &self.config.clients;
        crate::strategy::RunShape {
            total_clients: clients.total_clients,
            per_round: clients.per_round,
            min_per_round: self.min_per_round(),
            local_optimizer: match &self.optimizer {
                OptimizerSpec::Sgd { momentum, .. } if *momentum == 0.0 => "sgd",
                OptimizerSpec::Sgd { .. } => "sgd with momentum",
                OptimizerSpec::Adam { .. } => "adam",
                OptimizerSpec::AdamW { .. } => "adamw",
                OptimizerSpec::RmsProp { .. } => "rmsprop",
                OptimizerSpec::Lion { .. } => "lion",
            },
        }
    }

    /// Bytes of a round's updates a network server may hold at once:
    /// uploads received but not yet taken in, and the decoded updates it
    /// keeps for aggregation (see [`LoadedConfig::inflight_split`]).
    pub fn max_inflight_bytes(&self) -> u64 {
        let server = &self.config.server;
        server
            .max_inflight_bytes
            .unwrap_or((1u64 << 32).max(server.max_payload_bytes))
    }

    /// `server.max_inflight_bytes` shared between its two uses, so that
    /// together they stay within it: half of it for uploads received but not
    /// yet taken in by the round loop (one largest payload, at least, or no
    /// upload could ever start), the rest for decoded updates kept in memory
    /// until aggregation (the others wait on disk).
    pub fn inflight_split(&self) -> InflightSplit {
        let limit = self.max_inflight_bytes();
        let receiving = (limit / 2)
            .max(self.config.server.max_payload_bytes)
            .min(limit);
        InflightSplit {
            receiving,
            keeping: limit - receiving,
        }
    }

    /// Reports a round needs before it aggregates.
    pub fn min_per_round(&self) -> u32 {
        self.config
            .clients
            .min_per_round
            .unwrap_or(self.config.clients.per_round)
    }

    /// Decoding limits for payloads from the other side.
    pub fn decode_limits(&self) -> crate::codec::DecodeLimits {
        crate::codec::DecodeLimits {
            max_bytes: usize::try_from(self.config.server.max_payload_bytes).unwrap_or(usize::MAX),
            ..Default::default()
        }
    }

    /// `cluster.file` resolved against the folder of the file that set it, as
    /// `include` paths are; `None` when unset.
    pub fn cluster_file(&self) -> Option<PathBuf> {
        let file = self.config.cluster.file.as_ref()?;
        let folder = self.origin_of("cluster.file").parent();
        Some(folder.unwrap_or(Path::new("")).join(file))
    }

    /// `clients.profile.file`, relative to the config file that sets it.
    pub fn profile_file(&self) -> Option<PathBuf> {
        self.relative_file(
            "clients.profile.file",
            self.config.clients.profile.file.as_ref(),
        )
    }

    /// `clients.availability.trace_file`, relative to the config file that sets it.
    pub fn trace_file(&self) -> Option<PathBuf> {
        self.relative_file(
            "clients.availability.trace_file",
            self.config.clients.availability.trace_file.as_ref(),
        )
    }

    fn relative_file(&self, key: &str, file: Option<&PathBuf>) -> Option<PathBuf> {
        // Origins are kept per key of a section: `clients.profile` for the
        // keys of `[clients.profile]`.
        let section = key.rsplit_once('.').map_or(key, |(section, _)| section);
        let origin = self.origins.get(key).or_else(|| self.origins.get(section));
        let folder = origin.unwrap_or(&self.path).parent();
        Some(folder.unwrap_or(Path::new("")).join(file?))
    }

    /// Fails unless this build, whose backends are `available` (the runtime's
    /// list: core has no cargo features), has `cluster.backend`. The error
    /// names the file and the key, and what would enable the backend.
    pub fn check_cluster_backend(
        &self,
        available: &[crate::cluster::Backend],
    ) -> Result<(), ConfigError> {
        let Some(backend) = self.config.cluster.backend else {
            return Ok(());
        };
        crate::cluster::check_backend(backend, available).map_err(|error| {
            file_error(
                self.origin_of("cluster.backend"),
                Some("cluster.backend".to_owned()),
                error.to_string(),
            )
        })
    }

    /// The file that set `key` (dotted), or the top-level file.
    pub fn origin_of(&self, key: &str) -> &Path {
        self.origins.get(key).unwrap_or(&self.path)
    }

    /// `parameters.model.num_classes` when the config sets it (a file or
    /// `--set`), `None` when it is the default: a file data set's classes
    /// then come from its labels.
    pub fn num_classes_set(&self) -> Option<usize> {
        let model = self.merged.get("parameters")?.get("model")?;
        model
            .get("num_classes")
            .map(|_| self.config.parameters.model.num_classes)
    }

    /// A problem with `key`'s value found after loading, by a layer that
    /// knows what cohort-core does not (the model registry), naming the file
    /// that set the key as every other config error does.
    pub fn error_at(&self, key: &str, message: impl Into<String>) -> ConfigErrors {
        ConfigErrors(vec![file_error(
            self.origin_of(key),
            Some(key.to_owned()),
            message,
        )])
    }

    /// SHA-256 over the merged config, keys sorted: equal for configs that mean
    /// the same, whatever their layout or includes.
    pub fn hash(&self) -> String {
        let canonical = serde_json::to_string(&self.merged).expect("TOML tables serialize to JSON");
        format!("{:x}", Sha256::digest(canonical.as_bytes()))
    }
}

/// Whether `name` can name a registered model, data set or strategy: ASCII
/// letters, digits and `_`, so it needs no quoting anywhere it is shown.
pub fn plain_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The config with every default filled in, as TOML.
pub fn to_toml(config: &Config) -> Result<String, toml::ser::Error> {
    toml::to_string_pretty(&as_table(config)?)
}

/// `config` as a TOML table, a registered strategy's section as it was read
/// (serde skips that variant).
fn as_table(config: &Config) -> Result<toml::Table, toml::ser::Error> {
    let mut table = match &config.algorithm {
        AlgorithmConfig::Registered(registered) => {
            let builtin = Config {
                algorithm: AlgorithmConfig::default(),
                ..config.clone()
            };
            let mut table = toml::Table::try_from(&builtin)?;
            let mut section = registered.options.clone();
            section.insert("type".to_owned(), registered.name.clone().into());
            table.insert("algorithm".to_owned(), section.into());
            table
        }
        _ => toml::Table::try_from(config)?,
    };
    // The model's options beside `num_classes`, where they were read from.
    if let Some(toml::Value::Table(parameters)) = table.get_mut("parameters")
        && let Some(toml::Value::Table(model)) = parameters.get_mut("model")
    {
        model.extend(config.parameters.model.options.clone());
    }
    Ok(table)
}

/// HTTP/2's smallest and largest flow-control windows (RFC 9113, 6.9.2).
const MIN_STREAM_WINDOW: u32 = 65_535;
const MAX_STREAM_WINDOW: u32 = (1 << 31) - 1;

/// Keys that do not change what a run computes: where files go, where data
/// comes from, and how many rounds to run (so a finished run can be extended).
pub const RESULT_NEUTRAL_KEYS: &[&str] = &[
    "general.base_path",
    "general.run_name",
    "results.result_path",
    "data.data_path",
    "data.download",
    "data.mirrors",
    "trainer.rounds",
    // How payloads travel does not change what is computed: the same config
    // gives the same model in one process or over the network.
    "clients.comm_simulation",
    "clients.uplink_mbps",
    "clients.downlink_mbps",
    "server.address",
    "server.port",
    "server.payload_timeout",
    "server.registration_timeout",
    "server.max_connections_per_address",
    "server.auth_token",
    "clients.own_data_token_file",
    "server.tls_cert",
    "server.tls_key",
    "server.max_payload_bytes",
    "server.max_inflight_bytes",
    "server.stream_window_bytes",
    "results.keep_client_updates",
    // Which old checkpoints stay on disk changes none of the newest.
    "server.checkpoints_kept",
    // Whether client state is in memory or a file changes none of its bits.
    "server.client_state_memory_bytes",
    // How long the server waits for a stage changes nothing it computes.
    "secure_aggregation.timeout",
    // An alias that must equal algorithm.type: writing it or not changes nothing.
    "server.type",
    // Where the ranks run: a distributed run computes the single-process
    // run's model, and `--resume` may continue on another plan.
    "cluster.backend",
    "cluster.file",
    "cluster.ranks",
    "cluster.min_nodes",
    // Paths of files that config.toml writes out in full (a relative path
    // means another file beside the run folder); what they hold counts.
    "clients.profile.file",
    "clients.availability.trace_file",
];

impl LoadedConfig {
    /// Every result-relevant key with its value, defaults filled in, as
    /// `section.key = value` lines in sorted order.
    pub fn result_fields(&self) -> BTreeMap<String, String> {
        let value = toml::Value::Table(as_table(&self.config).expect("configs serialize"));
        let mut fields = BTreeMap::new();
        flatten_value("", &value, &mut fields);
        // A cosine schedule is planned over `trainer.rounds`, so there the
        // number of rounds does change what every round computes.
        let cosine = self.config.trainer.lr_scheduler == LrScheduler::Cosine;
        fields.retain(|key, _| {
            !RESULT_NEUTRAL_KEYS.contains(&key.as_str()) || (cosine && key == "trainer.rounds")
        });
        fields
    }

    /// A warning when `clients.attackers_per_round` is more than the robust
    /// strategy withstands in a round of `clients.per_round` updates: the run
    /// is legal (an experiment may want to see it fail) but its result is
    /// not what the strategy's guarantee describes.
    pub fn attack_warning(&self) -> Option<String> {
        let clients = &self.config.clients;
        let attackers = clients.attackers_per_round;
        let algorithm = &self.config.algorithm;
        let tolerated = algorithm.attackers_tolerated(clients.per_round)?;
        (attackers > tolerated).then(|| {
            format!(
                "clients.attackers_per_round = {attackers} is more than `{}` withstands in a \
                 round of clients.per_round = {} updates ({tolerated}); expect the attack to \
                 succeed",
                algorithm.name(),
                clients.per_round
            )
        })
    }

    /// SHA-256 of [`LoadedConfig::result_fields`]: equal for configs that
    /// compute the same run.
    pub fn result_hash(&self) -> String {
        let canonical = serde_json::to_string(&self.result_fields()).expect("maps serialize");
        format!("{:x}", Sha256::digest(canonical.as_bytes()))
    }

    /// The learning-rate schedule. A cosine schedule spans `trainer.rounds`;
    /// rounds beyond it (`--rounds`) stay at `lr_min`.
    pub fn lr_schedule(&self) -> crate::schedule::LrSchedule {
        use crate::schedule::LrSchedule;
        let trainer = &self.config.trainer;
        match trainer.lr_scheduler {
            LrScheduler::Step => LrSchedule::Step {
                step_size: trainer.lr_step_size,
                gamma: trainer.lr_gamma,
            },
            LrScheduler::Cosine => LrSchedule::Cosine {
                rounds: trainer.rounds,
                min_lr: trainer.lr_min,
            },
            LrScheduler::None => LrSchedule::Constant,
        }
    }

    /// Result-relevant keys whose values differ between two configs.
    pub fn result_differences(&self, other: &LoadedConfig) -> Vec<String> {
        let (mine, theirs) = (self.result_fields(), other.result_fields());
        let mut keys: Vec<String> = mine.keys().chain(theirs.keys()).cloned().collect();
        keys.sort();
        keys.dedup();
        keys.into_iter()
            .filter(|k| mine.get(k) != theirs.get(k))
            .map(|k| {
                let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(unset)".to_owned());
                format!("{k}: {} → {}", show(mine.get(&k)), show(theirs.get(&k)))
            })
            .collect()
    }
}

fn flatten_value(prefix: &str, value: &toml::Value, out: &mut BTreeMap<String, String>) {
    match value {
        toml::Value::Table(table) => {
            for (key, child) in table {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                flatten_value(&path, child, out);
            }
        }
        other => {
            out.insert(prefix.to_owned(), other.to_string());
        }
    }
}

/// Reads, merges, type-checks and validates the config at `path`.
pub fn load(path: &Path) -> Result<LoadedConfig, ConfigErrors> {
    load_with(path, &[])
}

/// [`load`] with command-line `overrides` (`--set`) written over the merged
/// file before any check, so they are validated like the file's own keys.
pub fn load_with(path: &Path, overrides: &[Override]) -> Result<LoadedConfig, ConfigErrors> {
    let table = read_table(path)?;
    from_table(table, path, overrides)
}

/// Like [`load`], for config text that claims to come from `path` (includes
/// resolve relative to it).
pub fn from_str(text: &str, path: &Path) -> Result<LoadedConfig, ConfigErrors> {
    from_str_with(text, path, &[])
}

/// [`from_str`] with `overrides` written over the text's table before any
/// check, as [`load_with`] does for a file.
pub fn from_str_with(
    text: &str,
    path: &Path,
    overrides: &[Override],
) -> Result<LoadedConfig, ConfigErrors> {
    let table = parse_table(text, path)?;
    from_table(table, path, overrides)
}

fn file_error(file: &Path, key: Option<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        file: file.to_path_buf(),
        key,
        message: message.into(),
    }
}

/// Largest config file read, a thousand times a real one.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Most physical workers (`trainer.max_concurrency`).
pub const MAX_WORKERS: u32 = 1024;
/// Most compute threads a worker (`trainer.threads_per_worker`).
pub const MAX_THREADS_PER_WORKER: u32 = 1024;
/// Most `include` files one config may pull in, all sections together.
pub const MAX_INCLUDES: usize = 64;

fn read_table(path: &Path) -> Result<toml::Table, ConfigError> {
    use std::io::Read;
    let cannot =
        |e: std::io::Error| file_error(path, None, format!("cannot read config file: {e}"));
    let file = std::fs::File::open(path).map_err(cannot)?;
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(cannot)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(file_error(
            path,
            None,
            format!("is larger than {MAX_CONFIG_BYTES} bytes; a config is a few kilobytes"),
        ));
    }
    parse_table(&text, path)
}

fn parse_table(text: &str, path: &Path) -> Result<toml::Table, ConfigError> {
    text.parse::<toml::Table>().map_err(|e| {
        file_error(
            path,
            None,
            format!("invalid TOML: {}", e.to_string().trim_end()),
        )
    })
}

/// Section names and, for `parameters`, its subsections.
const SECTIONS: &[&str] = &[
    "general",
    "clients",
    "server",
    "data",
    "trainer",
    "algorithm",
    "parameters",
    "results",
    "cluster",
    "secure_aggregation",
];

fn from_table(
    table: toml::Table,
    path: &Path,
    overrides: &[Override],
) -> Result<LoadedConfig, ConfigErrors> {
    let mut errors = Vec::new();
    let (mut merged, mut origins) = merge_sections(table, path, &mut errors);
    if let Err(message) = overrides::apply(&mut merged, overrides, SECTIONS) {
        errors.push(file_error(Path::new("--set"), None, message));
    }
    for item in overrides {
        origins.insert(item.key.clone(), PathBuf::from(item.origin()));
    }
    let notes = plato::translate(&mut merged, &mut origins, path, &mut errors);
    // What the run keeps is the table before problems are taken out of it
    // below; a config with problems is not kept.
    let kept = merged.clone();
    let model_options = take_model_options(&mut merged);
    let registered = check_unknown_keys(&mut merged, path, &origins, &mut errors);
    let Some(mut config) = deserialize_all(&mut merged, path, &origins, &mut errors) else {
        return Err(ConfigErrors(errors));
    };
    config.parameters.model.options = model_options;
    // A built-in data set knows its classes, so the model's output follows
    // it unless the config names a count (a count that differs is refused in
    // `validate_data`): FEMNIST's 62 need no line of their own.
    let classes_named = kept
        .get("parameters")
        .and_then(|parameters| parameters.get("model"))
        .and_then(|model| model.get("num_classes"))
        .is_some();
    if !classes_named && let Some(source) = config.data.builtin_source() {
        config.parameters.model.num_classes = source.classes();
    }
    if let Some(registered) = registered {
        config.algorithm = AlgorithmConfig::Registered(registered);
    }
    let optimizer =
        OptimizerSpec::from_config(&config.trainer.optimizer, &config.parameters.optimizer);
    let optimizer_known = optimizer.is_ok();
    let optimizer = optimizer.unwrap_or_else(|e| {
        let file = origins.get(&e.key).map_or(path, PathBuf::as_path);
        errors.push(file_error(file, Some(e.key), e.message));
        OptimizerSpec::from_config(
            "sgd",
            &BTreeMap::from([("learning_rate".to_owned(), 0.1.into())]),
        )
        .expect("plain SGD is a valid optimizer")
    });
    let loaded = LoadedConfig {
        config,
        optimizer,
        path: path.to_path_buf(),
        merged: kept,
        notes,
        origins,
    };
    errors.extend(validate(&loaded, optimizer_known));
    if errors.is_empty() {
        Ok(loaded)
    } else {
        Err(ConfigErrors(errors))
    }
}

/// The sections with their includes merged in, and the file each key came
/// from. A section that cannot be read is reported and left out.
fn merge_sections(
    table: toml::Table,
    path: &Path,
    errors: &mut Vec<ConfigError>,
) -> (toml::Table, BTreeMap<String, PathBuf>) {
    let mut origins = BTreeMap::new();
    let mut merged = toml::Table::new();
    let mut included = 0usize;
    let not_a_section = |key: String, value: &toml::Value| {
        let found = value.type_str();
        file_error(
            path,
            Some(key.clone()),
            format!("expected a section `[{key}]`, found a {found}"),
        )
    };
    for (section, value) in table {
        if !SECTIONS.contains(&section.as_str()) {
            errors.push(file_error(
                path,
                Some(section.clone()),
                format!(
                    "unknown section `[{section}]`{}; sections are: {}",
                    did_you_mean(&section, SECTIONS.iter().copied()),
                    SECTIONS.join(", ")
                ),
            ));
            continue;
        }
        let toml::Value::Table(body) = value else {
            errors.push(not_a_section(section, &value));
            continue;
        };
        let mut resolve = |body: toml::Table, key: &str| {
            resolve_includes(
                body,
                path,
                key,
                &mut origins,
                &mut Vec::new(),
                &mut included,
            )
        };
        let body = if section == "parameters" {
            let mut parameters = toml::Table::new();
            for (sub, sub_value) in body {
                let key = format!("parameters.{sub}");
                match sub_value {
                    toml::Value::Table(sub_body) => match resolve(sub_body, &key) {
                        Ok(resolved) => {
                            parameters.insert(sub, toml::Value::Table(resolved));
                        }
                        Err(error) => errors.push(error),
                    },
                    other => errors.push(not_a_section(key, &other)),
                }
            }
            parameters
        } else {
            match resolve(body, &section) {
                Ok(body) => body,
                Err(error) => {
                    errors.push(error);
                    continue;
                }
            }
        };
        merged.insert(section, toml::Value::Table(body));
    }
    (merged, origins)
}

/// Deserializes the table into a [`Config`], reporting every key of the wrong
/// type: each one found is reported and removed (its default stands in), and
/// the rest deserialized again. `None` when an error names no removable key.
fn deserialize_all(
    merged: &mut toml::Table,
    path: &Path,
    origins: &BTreeMap<String, PathBuf>,
    errors: &mut Vec<ConfigError>,
) -> Option<Config> {
    loop {
        let error = match serde_path_to_error::deserialize(toml::Value::Table(merged.clone())) {
            Ok(config) => return Some(config),
            Err(error) => error,
        };
        let key = error.path().to_string();
        let file = origins.get(&key).map_or(path, PathBuf::as_path);
        errors.push(file_error(
            file,
            Some(key.clone()),
            suggest_variant(foreign::plain_types(&without_location(
                error.into_inner().to_string(),
            ))),
        ));
        // `clients.outbound_processors[0]` is the key `clients.outbound_processors`.
        let removable = key.split('[').next().unwrap_or_default();
        plato::remove(merged, removable)?;
    }
}

/// The message without the "in `key`" line the TOML deserializer appends:
/// the error names its key already, and a list of errors stays one per line.
fn without_location(message: String) -> String {
    match message.split_once("\nin `") {
        Some((head, _)) => head.trim_end().to_owned(),
        None => message.trim_end().to_owned(),
    }
}

/// serde's "unknown variant `x`, expected one of `a`, `b`" with a
/// did-you-mean among the names it lists, for every enum-valued key.
fn suggest_variant(message: String) -> String {
    let Some(rest) = message.strip_prefix("unknown variant `") else {
        return message;
    };
    let Some((given, expected)) = rest.split_once('`') else {
        return message;
    };
    let names: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    let suggestion = did_you_mean(given, names.iter().copied());
    if suggestion.is_empty() {
        message
    } else {
        format!(
            "unknown value `{given}`{suggestion}; expected one of: {}",
            names.join(", ")
        )
    }
}

/// Merges `include` files into a section body, recursively; the body's own keys
/// win over included ones. Records the origin file of every key.
fn resolve_includes(
    mut body: toml::Table,
    file: &Path,
    section: &str,
    origins: &mut BTreeMap<String, PathBuf>,
    chain: &mut Vec<PathBuf>,
    included: &mut usize,
) -> Result<toml::Table, ConfigError> {
    let include_key = format!("{section}.include");
    let includes = match body.remove("include") {
        None => Vec::new(),
        Some(toml::Value::String(one)) => vec![one],
        Some(toml::Value::Array(many)) => many
            .into_iter()
            .map(|v| match v {
                toml::Value::String(s) => Ok(s),
                other => Err(file_error(
                    file,
                    Some(include_key.clone()),
                    format!("expected file names, found {} `{other}`", other.type_str()),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(file_error(
                file,
                Some(include_key),
                format!(
                    "expected a file name or a list of file names, found {} `{other}`",
                    other.type_str()
                ),
            ));
        }
    };
    let mut merged = toml::Table::new();
    for include in includes {
        let target = file.parent().unwrap_or(Path::new(".")).join(&include);
        let canonical = target.canonicalize().map_err(|e| {
            file_error(
                file,
                Some(include_key.clone()),
                format!("cannot read included file `{}`: {e}", target.display()),
            )
        })?;
        if chain.contains(&canonical) {
            return Err(file_error(
                file,
                Some(include_key.clone()),
                format!(
                    "`{}` includes itself (through {} files)",
                    target.display(),
                    chain.len()
                ),
            ));
        }
        *included += 1;
        if *included > MAX_INCLUDES {
            return Err(file_error(
                file,
                Some(include_key.clone()),
                format!("more than {MAX_INCLUDES} included files in one config"),
            ));
        }
        let table = read_table(&target)?;
        chain.push(canonical);
        let resolved = resolve_includes(table, &target, section, origins, chain, included)?;
        chain.pop();
        merged.extend(resolved);
    }
    for key in body.keys() {
        origins.insert(format!("{section}.{key}"), file.to_path_buf());
    }
    merged.extend(body);
    Ok(merged)
}

/// Takes the keys of `[parameters.model]` other than its own fields
/// (`num_classes`) out of `merged`: they are the options of the model the
/// config names, which only the model registry can check (as a registered
/// strategy's options are).
fn take_model_options(merged: &mut toml::Table) -> BTreeMap<String, toml::Value> {
    let fields = introspect::fields_of::<ModelParameters>();
    let Some(toml::Value::Table(parameters)) = merged.get_mut("parameters") else {
        return BTreeMap::new();
    };
    let Some(toml::Value::Table(model)) = parameters.get_mut("model") else {
        return BTreeMap::new();
    };
    let options: Vec<String> = model
        .keys()
        .filter(|key| !fields.contains(&key.as_str()))
        .cloned()
        .collect();
    options
        .into_iter()
        .filter_map(|key| model.remove(&key).map(|value| (key, value)))
        .collect()
}

/// Reports every key no section declares, and removes it so the types of the
/// others can still be checked. An `[algorithm]` of a `type` cohort does not
/// ship is taken out and returned, for the program's registry to check.
fn check_unknown_keys(
    merged: &mut toml::Table,
    path: &Path,
    origins: &BTreeMap<String, PathBuf>,
    errors: &mut Vec<ConfigError>,
) -> Option<RegisteredAlgorithm> {
    let known: BTreeMap<&str, &'static [&'static str]> = BTreeMap::from([
        ("general", introspect::fields_of::<General>()),
        ("clients", introspect::fields_of::<Clients>()),
        ("server", introspect::fields_of::<Server>()),
        ("data", introspect::fields_of::<Data>()),
        ("trainer", introspect::fields_of::<Trainer>()),
        ("parameters", introspect::fields_of::<Parameters>()),
        (
            "parameters.model",
            introspect::fields_of::<ModelParameters>(),
        ),
        ("results", introspect::fields_of::<Results>()),
        ("cluster", introspect::fields_of::<Cluster>()),
        (
            "secure_aggregation",
            introspect::fields_of::<SecureAggregation>(),
        ),
    ]);
    let check = |section: &str, body: &mut toml::Table, errors: &mut Vec<ConfigError>| {
        let fields = known[section];
        let mut sorted: Vec<&str> = fields.to_vec();
        sorted.sort_unstable();
        let unknown: Vec<String> = body
            .keys()
            .filter(|key| !fields.contains(&key.as_str()))
            .cloned()
            .collect();
        for key in unknown {
            body.remove(&key);
            let dotted = format!("{section}.{key}");
            let file = origins.get(&dotted).map_or(path, PathBuf::as_path);
            errors.push(file_error(
                file,
                Some(dotted),
                format!(
                    "unknown key `{key}` in [{section}]{}; valid keys: {}",
                    foreign::flower_hint(section, &key)
                        .unwrap_or_else(|| did_you_mean(&key, fields.iter().copied())),
                    sorted.join(", ")
                ),
            ));
        }
    };
    let mut algorithm = AlgorithmKeys::Builtin;
    for (section, body) in merged.iter_mut() {
        let toml::Value::Table(body) = body else {
            continue;
        };
        if section == "algorithm" {
            algorithm = check_algorithm_keys(body, path, origins, errors);
            continue;
        }
        check(section, body, errors);
        if section == "parameters"
            && let Some(toml::Value::Table(model)) = body.get_mut("model")
        {
            check("parameters.model", model, errors);
        }
    }
    match algorithm {
        AlgorithmKeys::Builtin => None,
        AlgorithmKeys::Unusable => {
            // Without a strategy the options cannot be typed; the default stands in.
            merged.remove("algorithm");
            None
        }
        AlgorithmKeys::Registered(name) => {
            let Some(toml::Value::Table(mut options)) = merged.remove("algorithm") else {
                unreachable!("a registered name was read from the [algorithm] table");
            };
            options.remove("type");
            Some(RegisteredAlgorithm { name, options })
        }
    }
}

/// What [`check_algorithm_keys`] found.
enum AlgorithmKeys {
    /// One of cohort's strategies, its options checked.
    Builtin,
    /// A name no strategy of cohort's has, for a program's registry.
    Registered(String),
    /// No usable name (the error is reported).
    Unusable,
}

/// The longest timeout a config may set: a year, far below where a
/// `Duration` of seconds overflows.
pub const MAX_TIMEOUT_SECONDS: f64 = 365.0 * 24.0 * 3600.0;
/// The slowest `clients.uplink_mbps` / `downlink_mbps`: 1 kbit/s. Far slower
/// ones (`1e-310`) make a payload's simulated transfer time overflow to
/// infinity, which no result file or checkpoint can hold.
pub const MIN_MBPS: f64 = 1e-3;
/// The fastest: 1 Pbit/s.
pub const MAX_MBPS: f64 = 1e9;

/// `[algorithm]`: `type` names a strategy, and every other key is one of
/// that strategy's options. For cohort's own strategies both lists come from
/// the serde derive, so they cannot drift from the code; reports every
/// problem and removes unknown options. A plain name that is none of them is
/// left to the registry of the program that loads the config (which reports
/// a misspelling with the names it knows).
fn check_algorithm_keys(
    body: &mut toml::Table,
    path: &Path,
    origins: &BTreeMap<String, PathBuf>,
    errors: &mut Vec<ConfigError>,
) -> AlgorithmKeys {
    let file_of = |key: &str| {
        origins
            .get(key)
            .cloned()
            .unwrap_or_else(|| path.to_path_buf())
    };
    let names = introspect::variants_of::<AlgorithmConfig>("type");
    let name = match body.get("type") {
        None => {
            errors.push(file_error(
                &file_of("algorithm"),
                Some("algorithm.type".to_owned()),
                format!("missing; choose a strategy: {}", names.join(", ")),
            ));
            return AlgorithmKeys::Unusable;
        }
        Some(toml::Value::String(name)) => name.clone(),
        Some(other) => {
            errors.push(file_error(
                &file_of("algorithm.type"),
                Some("algorithm.type".to_owned()),
                format!(
                    "expected a strategy name, found {} `{other}`",
                    other.type_str()
                ),
            ));
            return AlgorithmKeys::Unusable;
        }
    };
    if !names.contains(&name.as_str()) {
        if plain_name(&name) {
            return AlgorithmKeys::Registered(name);
        }
        errors.push(file_error(
            &file_of("algorithm.type"),
            Some("algorithm.type".to_owned()),
            format!(
                "unknown strategy `{name}`{}; strategies: {}",
                did_you_mean(&name, names.iter().copied()),
                names.join(", ")
            ),
        ));
        return AlgorithmKeys::Unusable;
    }
    let options = introspect::variant_fields_of::<AlgorithmConfig>("type", &name);
    let valid = if options.is_empty() {
        format!("`{name}` takes no options")
    } else {
        let mut sorted = options.to_vec();
        sorted.sort_unstable();
        format!("options of `{name}`: {}", sorted.join(", "))
    };
    let unknown: Vec<String> = body
        .keys()
        .filter(|key| key.as_str() != "type" && !options.contains(&key.as_str()))
        .cloned()
        .collect();
    for key in unknown {
        body.remove(&key);
        let dotted = format!("algorithm.{key}");
        errors.push(file_error(
            &file_of(&dotted),
            Some(dotted),
            format!(
                "unknown option `{key}`{}; {valid}",
                foreign::flower_hint("algorithm", &key)
                    .unwrap_or_else(|| did_you_mean(&key, options.iter().copied()))
            ),
        ));
    }
    AlgorithmKeys::Builtin
}

/// Reports a problem with a key; validation goes on to find the others.
type Fail<'a> = &'a dyn Fn(&str, String);

/// Every impossible value and combination, all of them: ranges, pipelines,
/// the strategy against the run, data and trainer. Checks that need the
/// optimizer are skipped when it did not load (its own error is reported).
fn validate(loaded: &LoadedConfig, optimizer_known: bool) -> Vec<ConfigError> {
    let found = std::cell::RefCell::new(Vec::new());
    let fail = |key: &str, message: String| {
        found.borrow_mut().push(file_error(
            loaded.origin_of(key),
            Some(key.to_owned()),
            message,
        ));
    };
    let config = &loaded.config;
    validate_clients(config, &fail);
    validate_server(config, &fail);
    validate_run_name(config, &fail);
    if optimizer_known {
        validate_algorithm(loaded, &fail);
    }
    validate_data(config, &fail);
    validate_trainer(loaded, optimizer_known, &fail);
    validate_cluster(loaded, &fail);
    secure::validate(config, &fail);
    validate_devices(config, &fail);
    validate_asynchronous(loaded, &fail);
    validate_selection(config, &fail);
    found.into_inner()
}

/// `clients.strata`: at least one, each stratum sends at least one client,
/// and only where a round is one draw of all clients with uniform chances.
fn validate_strata(config: &Config, fail: Fail) {
    let clients = &config.clients;
    let strata = clients.strata;
    if strata <= 1 {
        if strata == 0 {
            fail("clients.strata", "must be at least 1, got 0".to_owned());
        }
        return;
    }
    let drawn = clients.drawn_per_round();
    if strata > drawn.min(clients.total_clients) {
        fail(
            "clients.strata",
            format!(
                "each stratum sends at least one client a round, so it can be at most the \
                 clients drawn per round ({drawn}) and clients.total_clients ({}), got {strata}",
                clients.total_clients
            ),
        );
    }
    if let Some(message) = strata_refusal(config) {
        fail("clients.strata", message);
    }
}

/// Why this run cannot draw its rounds in strata, whatever their number:
/// another selection, asynchronous rounds, an availability, or `dp_fedavg`;
/// `None` where `clients.strata > 1` may be set.
pub fn strata_refusal(config: &Config) -> Option<String> {
    let clients = &config.clients;
    if clients.selection != crate::selection::SelectionKind::Random {
        Some(format!(
            "stratifies clients.selection = \"random\", and this run selects by \"{}\"",
            clients.selection.name()
        ))
    } else if !config.server.synchronous {
        Some(
            "is for synchronous rounds: asynchronous ones draw a client at a time, which no \
             strata can split"
                .to_owned(),
        )
    } else if clients.availability.model != crate::devices::AvailabilityModel::Always {
        Some(
            "draws from all clients, and with clients.availability a round draws from those \
             online"
                .to_owned(),
        )
    } else if config.algorithm.name() == "dp_fedavg" {
        Some(
            "dp_fedavg's accountant assumes a uniform sample of clients.per_round, and a \
             stratified one is not"
                .to_owned(),
        )
    } else {
        None
    }
}

/// `clients.selection` and its options: each policy's own ranges, options
/// of a policy not chosen, and what a utility policy cannot know.
fn validate_selection(config: &Config, fail: Fail) {
    use crate::selection::SelectionKind;
    let clients = &config.clients;
    let kind = clients.selection;
    for (section, unused, of) in [
        (
            "clients.power_of_choice",
            kind != SelectionKind::PowerOfChoice && clients.power_of_choice != Default::default(),
            "power_of_choice",
        ),
        (
            "clients.oort",
            kind != SelectionKind::Oort && clients.oort != Default::default(),
            "oort",
        ),
    ] {
        if unused {
            fail(
                section,
                format!(
                    "is for clients.selection = \"{of}\", and this run selects by \"{}\"",
                    kind.name()
                ),
            );
        }
    }
    if let Err(message) = clients
        .power_of_choice
        .check(clients.per_round, clients.total_clients)
    {
        fail("clients.power_of_choice.candidates", message);
    }
    let evaluated = Some(crate::selection::PowerOfChoiceLoss::Evaluated);
    if kind == SelectionKind::PowerOfChoice
        && clients.power_of_choice.loss == evaluated
        && let Some(reason) = candidate_evaluation_refusal(config)
    {
        fail(
            "clients.power_of_choice.loss",
            format!("\"evaluated\" cannot run here: {reason}; use \"last_reported\""),
        );
    }
    for (key, message) in clients.oort.problems() {
        fail(&format!("clients.oort.{key}"), message);
    }
    validate_strata(config, fail);
    if kind == SelectionKind::Random {
        return;
    }
    if clients.own_data_clients > 0 {
        fail(
            "clients.selection",
            format!(
                "`{}` weighs clients by their data sizes before they train, and the server \
                 learns an own-data client's only from its first report; use \"random\" with \
                 clients.own_data_clients",
                kind.name()
            ),
        );
    }
    if config.cluster.backend.is_some() {
        fail(
            "clients.selection",
            format!(
                "`{}` decides from every client's report, and the ranks of a distributed \
                 simulation each see only their own clients'; leave cluster.backend out",
                kind.name()
            ),
        );
    }
}

/// Why a run of `config` cannot evaluate power-of-choice candidates on
/// the global model before it selects (pow-d), if it cannot; `None` where
/// it can, which makes `evaluated` its default.
pub fn candidate_evaluation_refusal(config: &Config) -> Option<&'static str> {
    if !config.server.synchronous {
        return Some(
            "an asynchronous run (server.synchronous = false) refills each place as an update \
             arrives, while other clients train, so there is no global model between rounds \
             for candidates to evaluate",
        );
    }
    if !config.clients.comm_simulation {
        return Some(
            "network clients (clients.comm_simulation = false) have no evaluation message in \
             cohort's protocol; the pass runs on the simulation's workers only",
        );
    }
    if config.cluster.backend.is_some() {
        return Some(
            "the ranks of a distributed simulation (cluster.backend) each hold only their own \
             clients, and the choice needs every candidate's loss",
        );
    }
    None
}

/// An error unless `value` is one of `allowed`, with a did-you-mean.
fn one_of(fail: Fail, key: &str, value: &str, allowed: &[&str]) {
    if !allowed.contains(&value) {
        fail(
            key,
            format!(
                "unknown value `{value}`{}; expected one of: {}",
                did_you_mean(value, allowed.iter().copied()),
                allowed.join(", ")
            ),
        );
    }
}

fn validate_clients(config: &Config, fail: Fail) {
    let clients = &config.clients;
    if clients.total_clients == 0 {
        fail("clients.total_clients", "must be at least 1".to_owned());
    }
    if clients.per_round == 0 {
        fail("clients.per_round", "must be at least 1".to_owned());
    }
    if clients.per_round > clients.total_clients {
        fail(
            "clients.per_round",
            format!(
                "{} clients per round cannot be selected from total_clients = {}",
                clients.per_round, clients.total_clients
            ),
        );
    }
    one_of(fail, "clients.type", &clients.kind, &["simple"]);
    if !(clients.test_fraction > 0.0 && clients.test_fraction < 1.0) {
        fail(
            "clients.test_fraction",
            format!("must be in (0, 1), got {}", clients.test_fraction),
        );
    }
    if clients.attackers_per_round > clients.per_round {
        fail(
            "clients.attackers_per_round",
            format!(
                "{} attackers cannot be among per_round = {} clients",
                clients.attackers_per_round, clients.per_round
            ),
        );
    }
    if (clients.attack == crate::attack::Attack::None) != (clients.attackers_per_round == 0) {
        fail(
            "clients.attack",
            "`attack` and `attackers_per_round` go together: set both (an attack and at least \
             one attacker) or neither"
                .to_owned(),
        );
    }
    if !(clients.attack_scale.is_finite() && clients.attack_scale > 0.0) {
        fail(
            "clients.attack_scale",
            format!("must be a finite number > 0, got {}", clients.attack_scale),
        );
    }
    validate_own_data(clients, fail);
    if let Some(min) = clients.min_per_round
        && (min == 0 || min > clients.per_round)
    {
        fail(
            "clients.min_per_round",
            format!(
                "must be between 1 and per_round = {}, got {min}",
                clients.per_round
            ),
        );
    }
    for (key, value) in [
        ("clients.uplink_mbps", clients.uplink_mbps),
        ("clients.downlink_mbps", clients.downlink_mbps),
    ] {
        if let Some(value) = value
            && !(MIN_MBPS..=MAX_MBPS).contains(&value)
        {
            fail(
                key,
                format!(
                    "must be a bandwidth in [{}, {}] Mbit/s (1 kbit/s to 1 Pbit/s), got {}",
                    crate::number::shown(MIN_MBPS),
                    crate::number::shown(MAX_MBPS),
                    crate::number::shown(value)
                ),
            );
        }
    }
}

fn validate_server(config: &Config, fail: Fail) {
    let server = &config.server;
    if let Some(ratio) = server.max_update_norm_ratio
        && !(ratio.is_finite() && ratio > 1.0)
    {
        fail(
            "server.max_update_norm_ratio",
            format!(
                "must be a finite number above 1 (times the round's median update norm), got {ratio}"
            ),
        );
    }
    let step = server.max_model_step_ratio;
    if step.is_nan() || step <= 1.0 {
        fail(
            "server.max_model_step_ratio",
            format!(
                "must be a number above 1 (times the global model's norm), or inf for no bound; \
                 got {step}"
            ),
        );
    }
    for (key, value) in [
        ("server.payload_timeout", server.payload_timeout),
        ("server.registration_timeout", server.registration_timeout),
    ] {
        if !(value.is_finite() && value > 0.0 && value <= MAX_TIMEOUT_SECONDS) {
            fail(
                key,
                format!(
                    "must be a number of seconds in (0, {MAX_TIMEOUT_SECONDS}] (a year), got {value}"
                ),
            );
        }
    }
    if server.max_connections_per_address == 0 {
        fail(
            "server.max_connections_per_address",
            "must be at least 1 (connections from one IP address at once)".to_owned(),
        );
    }
    if server.max_payload_bytes == 0 {
        fail("server.max_payload_bytes", "must be at least 1".to_owned());
    }
    if let Some(room) = server.max_inflight_bytes
        && room < server.max_payload_bytes
    {
        fail(
            "server.max_inflight_bytes",
            format!(
                "{room} is below server.max_payload_bytes = {}: one largest update could never \
                 be received",
                server.max_payload_bytes
            ),
        );
    }
    if let Some(window) = server.stream_window_bytes
        && !(MIN_STREAM_WINDOW..=MAX_STREAM_WINDOW).contains(&window)
    {
        fail(
            "server.stream_window_bytes",
            format!(
                "{window} is outside HTTP/2's window sizes, {MIN_STREAM_WINDOW} to \
                 {MAX_STREAM_WINDOW} bytes"
            ),
        );
    }
    if server.tls_cert.is_some() != server.tls_key.is_some() {
        fail(
            "server.tls_cert",
            "tls_cert and tls_key go together: give both for TLS, or neither".to_owned(),
        );
    }
    if let Some(token) = &server.auth_token
        && token.is_empty()
    {
        fail(
            "server.auth_token",
            "must not be empty; leave it out for no authentication".to_owned(),
        );
    }
}

/// A run name is one folder under the base folder, never a path out of it.
/// `[clients.profile]` and `[clients.availability]`: ranges, and the
/// older bandwidth keys, which a profile replaces.
fn validate_devices(config: &Config, fail: Fail) {
    let clients = &config.clients;
    for (key, message) in clients.profile.problems() {
        fail(&format!("clients.profile.{key}"), message);
    }
    for (key, message) in clients.availability.problems() {
        fail(&format!("clients.availability.{key}"), message);
    }
    if clients.profile.enabled() {
        for (key, set) in [
            ("uplink_mbps", clients.uplink_mbps.is_some()),
            ("downlink_mbps", clients.downlink_mbps.is_some()),
        ] {
            if set {
                fail(
                    &format!("clients.{key}"),
                    format!(
                        "a [clients.profile] gives each client its links: write \
                         clients.profile.{key} instead"
                    ),
                );
            }
        }
    }
    let availability = clients.availability.model != crate::devices::AvailabilityModel::Always;
    if availability && !clients.profile.enabled() {
        fail(
            "clients.availability.model",
            "needs a [clients.profile] (clients.profile.compute or clients.profile.file): \
             whether a client is online when it finishes depends on how long it takes"
                .to_owned(),
        );
    }
    if clients.profile.enabled() && config.cluster.backend.is_some() {
        fail(
            "clients.profile",
            "device profiles run in one process for now: the ranks of a distributed \
             simulation would each time only their own clients; leave cluster.backend out"
                .to_owned(),
        );
    }
    let over = clients.over_selection;
    if !(over.is_finite() && (1.0..=10.0).contains(&over)) {
        fail(
            "clients.over_selection",
            format!("must be a factor in [1, 10] of clients.per_round, got {over}"),
        );
    }
    let timed = [
        ("clients.over_selection", over > 1.0),
        (
            "server.round_deadline",
            config.server.round_deadline.is_some(),
        ),
    ];
    for (key, _) in timed.into_iter().filter(|(_, set)| *set) {
        if !clients.profile.enabled() {
            fail(
                key,
                "needs a [clients.profile]: which updates arrive first, or in time, is \
                 decided on the simulated clock"
                    .to_owned(),
            );
        }
        if !config.server.synchronous {
            fail(
                key,
                "is for synchronous rounds (server.synchronous = true)".to_owned(),
            );
        }
    }
    if over > 1.0 && config.algorithm.name() == "dp_fedavg" {
        fail(
            "clients.over_selection",
            "dp_fedavg's accountant assumes the aggregated clients are a uniform sample of \
             clients.per_round; the first to arrive are the fastest, not that sample"
                .to_owned(),
        );
    }
    if let Some(deadline) = config.server.round_deadline
        && !(deadline.is_finite() && deadline > 0.0 && deadline <= 1e9)
    {
        fail(
            "server.round_deadline",
            format!("must be a number of simulated seconds in (0, 1e9], got {deadline}"),
        );
    }
    if (availability || clients.profile.enabled()) && !clients.comm_simulation {
        fail(
            "clients.comm_simulation",
            "device profiles and availability are simulated: they need comm_simulation = true \
             (network clients take the time they take)"
                .to_owned(),
        );
    }
}

/// `server.synchronous = false`: what the asynchronous server supports.
fn validate_asynchronous(loaded: &LoadedConfig, fail: Fail) {
    let config = &loaded.config;
    let server = &config.server;
    let per_round = config.clients.per_round;
    if server.synchronous {
        for (key, set) in [
            ("server.staleness_bound", server.staleness_bound.is_some()),
            (
                "server.minimum_clients_aggregated",
                server.minimum_clients_aggregated != 1,
            ),
        ] {
            if set {
                fail(
                    key,
                    "is read only by the asynchronous server (server.synchronous = false)"
                        .to_owned(),
                );
            }
        }
        return;
    }
    let min = server.minimum_clients_aggregated;
    if min == 0 || min > per_round {
        fail(
            "server.minimum_clients_aggregated",
            format!(
                "must be between 1 and clients.per_round = {per_round} (the clients in flight), \
                 got {min}"
            ),
        );
    }
    let refusals = [
        (
            "clients.profile.compute",
            config.clients.comm_simulation && !config.clients.profile.enabled(),
            "server.synchronous = false in simulation (clients.comm_simulation = true) needs a \
             [clients.profile] (clients.profile.compute or clients.profile.file): the simulated \
             clock decides the order updates arrive in (network mode takes their real order)",
        ),
        (
            "cluster.backend",
            config.cluster.backend.is_some(),
            "the asynchronous server runs in one process for now: leave cluster.backend out",
        ),
        (
            "clients.attack",
            config.clients.attackers_per_round > 0,
            "simulated attackers take the first slots of a synchronous round; an asynchronous \
             run has no rounds of slots",
        ),
        (
            "server.max_update_norm_ratio",
            server.max_update_norm_ratio.is_some(),
            "compares an update with the median of its round; the asynchronous server takes \
             updates one by one",
        ),
        (
            "clients.min_per_round",
            config.clients.min_per_round.is_some(),
            "is for synchronous rounds; the asynchronous server aggregates every \
             server.minimum_clients_aggregated updates",
        ),
        (
            "secure_aggregation",
            config.secure_aggregation.is_some(),
            "masks the updates of one synchronous round together, and the asynchronous server \
             takes each update as it arrives: it would see every update in the clear, so the \
             two are refused together",
        ),
    ];
    for (key, refused, why) in refusals {
        if refused {
            fail(key, why.to_owned());
        }
    }
    if let Some(strategy) = config.algorithm.build()
        && let Err(reason) = strategy.asynchronous()
    {
        fail(
            "algorithm.type",
            format!(
                "`{}` cannot run with server.synchronous = false: {reason}",
                config.algorithm.name()
            ),
        );
    }
}

fn validate_run_name(config: &Config, fail: Fail) {
    if let Some(name) = &config.general.run_name {
        let plain = !name.is_empty()
            && name != "."
            && name != ".."
            && !name.contains(['/', '\\', '\0'])
            && Path::new(name).components().count() == 1;
        if !plain {
            fail(
                "general.run_name",
                format!(
                    "`{name}` is not a plain folder name: no `/`, `\\`, `..` or empty name; \
                     the run folder goes under the base folder"
                ),
            );
        }
    }
}

fn validate_algorithm(loaded: &LoadedConfig, fail: Fail) {
    let config = &loaded.config;
    if let Err(error) = Pipelines::from_config(config) {
        fail(&error.key.clone(), error.reason);
    }
    let algorithm = config.algorithm.name();
    if let Some(alias) = &config.server.kind
        && alias != algorithm
    {
        fail(
            "server.type",
            format!(
                "is `{alias}` but algorithm.type is `{algorithm}`; server.type is only an alias \
                 of algorithm.type (leave it out)"
            ),
        );
    }
    if let Err(error) = config.algorithm.check(&loaded.run_shape()) {
        let key = if error.option == "type" {
            "algorithm.type".to_owned()
        } else {
            format!("algorithm.{}", error.option)
        };
        fail(&key, error.message);
    }
}

fn validate_data(config: &Config, fail: Fail) {
    let data = &config.data;
    if data.sampler != Sampler::Iid {
        let cyclic = data.sampler == Sampler::IidCyclic;
        for (key, set) in [
            (
                "data.partition_size",
                data.partition_size.is_some() && !cyclic,
            ),
            ("data.partition_sizes", data.partition_sizes.is_some()),
        ] {
            if set {
                fail(
                    key,
                    format!(
                        "applies only to `data.sampler = \"iid\"`; with `data.sampler = \"{}\"` \
                         the sampler decides each client's size, so remove `{key}`",
                        data.sampler
                    ),
                );
            }
        }
    }
    if !(data.concentration.is_finite() && data.concentration > 0.0) {
        fail(
            "data.concentration",
            format!("must be a finite number > 0, got {}", data.concentration),
        );
    }
    if data.shards_per_client == 0 {
        fail("data.shards_per_client", "must be at least 1".to_owned());
    }
    if data.min_partition_size == 0 {
        fail(
            "data.min_partition_size",
            "must be at least 1: a client without samples cannot train".to_owned(),
        );
    }
    if config.data.partition_size == Some(0) {
        fail(
            "data.partition_size",
            "must be at least 1 when set".to_owned(),
        );
    }
    check_file_data(config, fail);
    check_partition_sizes(config, fail);
    check_iid_fits(config, fail);
    check_iid_cyclic(config, fail);
    if let Some(mirrors) = &config.data.mirrors
        && mirrors.is_empty()
    {
        fail(
            "data.mirrors",
            "must list at least one URL when set".to_owned(),
        );
    }
    if let Some(source) = config.data.builtin_source()
        && config.parameters.model.num_classes != source.classes()
    {
        fail(
            "parameters.model.num_classes",
            format!(
                "{} classes requested, but {} has {}",
                config.parameters.model.num_classes,
                config.data.datasource,
                source.classes()
            ),
        );
    }
}

fn validate_trainer(loaded: &LoadedConfig, optimizer_known: bool, fail: Fail) {
    let config = &loaded.config;
    one_of(fail, "trainer.type", &config.trainer.kind, &["basic"]);
    let trainer = &config.trainer;
    if trainer.rounds == 0 {
        fail("trainer.rounds", "must be at least 1".to_owned());
    }
    if trainer.epochs == 0 {
        fail("trainer.epochs", "must be at least 1".to_owned());
    }
    if trainer.batch_size == 0 {
        fail("trainer.batch_size", "must be at least 1".to_owned());
    }
    if trainer.eval_batch_size == 0 {
        fail("trainer.eval_batch_size", "must be at least 1".to_owned());
    }
    if trainer.lr_step_size == 0 {
        fail(
            "trainer.lr_step_size",
            "must be at least 1 round".to_owned(),
        );
    }
    if !(trainer.lr_gamma.is_finite() && trainer.lr_gamma > 0.0) {
        fail(
            "trainer.lr_gamma",
            format!("must be a finite number > 0, got {}", trainer.lr_gamma),
        );
    }
    let base_rate = loaded.optimizer.learning_rate();
    if optimizer_known
        && !(trainer.lr_min.is_finite() && (0.0..=base_rate).contains(&trainer.lr_min))
    {
        fail(
            "trainer.lr_min",
            format!(
                "must be in [0, learning_rate = {base_rate}], got {}",
                trainer.lr_min
            ),
        );
    }
    if config.server.checkpoint_interval == 0 {
        fail(
            "server.checkpoint_interval",
            "must be at least 1 (rounds between checkpoints)".to_owned(),
        );
    }
    if config.server.checkpoints_kept == Some(0) {
        fail(
            "server.checkpoints_kept",
            "must be at least 1: --resume needs the newest checkpoint (leave it out to keep all)"
                .to_owned(),
        );
    }
    // Each worker is a thread with its own model, and in network mode a
    // process: bounded so a typo cannot start a hundred thousand of them.
    if !(1..=MAX_WORKERS).contains(&trainer.max_concurrency) {
        fail(
            "trainer.max_concurrency",
            format!(
                "is {}; must be 1 to {MAX_WORKERS} physical workers",
                trainer.max_concurrency
            ),
        );
    }
    if !(1..=MAX_THREADS_PER_WORKER).contains(&trainer.threads_per_worker) {
        fail(
            "trainer.threads_per_worker",
            format!(
                "is {}; must be 1 to {MAX_THREADS_PER_WORKER} compute threads",
                trainer.threads_per_worker
            ),
        );
    }
    if let Some(target) = trainer.target_accuracy
        && !(target.is_finite() && (0.0..=1.0).contains(&target))
    {
        fail(
            "trainer.target_accuracy",
            format!("must be a fraction in [0, 1] (e.g. 0.97), got {target}"),
        );
    }
    if let Some(norm) = trainer.clip_grad_norm
        && !(norm.is_finite() && norm >= 0.0)
    {
        fail(
            "trainer.clip_grad_norm",
            format!("must be a finite number >= 0, got {norm}"),
        );
    }
    validate_vectorized(loaded, optimizer_known, fail);
}

/// What `trainer.vectorized_clients` can train: SGD, in the server's worker
/// pool. Whether the model can be stacked is the model registry's check.
fn validate_vectorized(loaded: &LoadedConfig, optimizer_known: bool, fail: Fail) {
    let config = &loaded.config;
    if config.trainer.vectorized_clients == schema::VectorizedClients::Off {
        return;
    }
    let key = "trainer.vectorized_clients";
    if optimizer_known && !matches!(loaded.optimizer, crate::optim::OptimizerSpec::Sgd { .. }) {
        fail(
            key,
            format!(
                "supports trainer.optimizer = \"sgd\" (or \"momentum\") only, not \"{}\" \
                 (set trainer.vectorized_clients = \"off\")",
                config.trainer.optimizer
            ),
        );
    }
    if !config.clients.comm_simulation {
        fail(
            key,
            "trains clients in the server's worker threads: it needs clients.comm_simulation = \
             true"
                .to_owned(),
        );
    }
}

/// `[cluster]`'s ranges; which backends the build has is the caller's check
/// ([`LoadedConfig::check_cluster_backend`]), and whether the cluster can
/// hold the run is `cohort place`'s.
/// Own-data clients are processes on the network, and their sample counts
/// must be bounded so that a sum of a round's weights cannot overflow.
fn validate_own_data(clients: &schema::Clients, fail: Fail) {
    if clients.own_data_clients > clients.total_clients {
        fail(
            "clients.own_data_clients",
            format!(
                "{} own-data clients cannot be among total_clients = {}",
                clients.own_data_clients, clients.total_clients
            ),
        );
    }
    if clients.own_data_clients > 0 && clients.comm_simulation {
        fail(
            "clients.own_data_clients",
            "own-data clients are `cohort client --data` processes: set \
             clients.comm_simulation = false (network mode)"
                .to_owned(),
        );
    }
    if clients.own_data_token_file.is_some() && clients.own_data_clients == 0 {
        fail(
            "clients.own_data_token_file",
            "gives own-data clients their tokens, but clients.own_data_clients = 0".to_owned(),
        );
    }
    if !(1..=MAX_SAMPLES_BOUND).contains(&clients.max_samples) {
        fail(
            "clients.max_samples",
            format!(
                "must be between 1 and {MAX_SAMPLES_BOUND}, got {}",
                clients.max_samples
            ),
        );
    }
}

/// Largest `clients.max_samples`: 2^32 samples a client, so that the weights
/// of any round (at most 2^32 clients) sum within a u64.
pub const MAX_SAMPLES_BOUND: u64 = 1 << 32;

fn validate_cluster(loaded: &LoadedConfig, fail: Fail) {
    let cluster = &loaded.config.cluster;
    let clients = loaded.config.clients.total_clients;
    if cluster
        .file
        .as_ref()
        .is_some_and(|f| f.as_os_str().is_empty())
    {
        fail(
            "cluster.file",
            "is empty; name a cluster file or leave the key out".to_owned(),
        );
    }
    for (key, value, what) in [
        ("cluster.ranks", cluster.ranks, "ranks"),
        // A node runs at least one rank.
        (
            "cluster.min_nodes",
            cluster.min_nodes,
            "nodes run at least as many ranks, which",
        ),
    ] {
        match value {
            Some(0) => return fail(key, "must be at least 1".to_owned()),
            Some(count) if count > clients => {
                return fail(
                    key,
                    format!(
                        "{count} {what} need at least {count} logical clients, but \
                         clients.total_clients = {clients}; every rank trains at least one"
                    ),
                );
            }
            _ => {}
        }
    }
    if let (Some(ranks), Some(nodes)) = (cluster.ranks, cluster.min_nodes)
        && nodes > ranks
    {
        fail(
            "cluster.min_nodes",
            format!("{nodes} nodes cannot be filled by ranks = {ranks}; a node runs at least one"),
        );
    }
}

/// `data.partition_sizes`: one size per client, none empty, and a sum no
/// training set index overflows.
fn check_partition_sizes(config: &Config, fail: Fail) {
    if let Some(sizes) = &config.data.partition_sizes {
        if config.data.partition_size.is_some() {
            fail(
                "data.partition_sizes",
                "give either partition_size (all clients alike) or partition_sizes, not both"
                    .to_owned(),
            );
        }
        if sizes.len() != config.clients.total_clients as usize {
            fail(
                "data.partition_sizes",
                format!(
                    "has {} entries but clients.total_clients = {}; give one size per client",
                    sizes.len(),
                    config.clients.total_clients
                ),
            );
        }
        if sizes.contains(&0) {
            fail(
                "data.partition_sizes",
                "every client needs at least 1 sample".to_owned(),
            );
        }
        // No dataset holds more samples than a u32 indexes.
        let total = sizes
            .iter()
            .try_fold(0u64, |total, &size| total.checked_add(size as u64))
            .filter(|&total| total <= u32::MAX as u64);
        if total.is_none() {
            fail(
                "data.partition_sizes",
                format!(
                    "the sizes add up to more than {} samples, more than any training set holds",
                    u32::MAX
                ),
            );
        }
    }
}

/// Most passes over the training set `iid_cyclic`'s partitions may make
/// together: Plato's reference makes 3⅓, and the index lists grow with it (4
/// bytes a position: 128 passes over 60,000 samples are 31 MB), which is what
/// 10,000 clients of 600 samples each need (100 passes).
pub const MAX_CYCLIC_PASSES: u64 = 128;

/// `iid_cyclic` repeats samples once its partitions outgrow the training
/// set: bounded, and without `do_test`, whose held-out part would repeat
/// training samples.
fn check_iid_cyclic(config: &Config, fail: Fail) {
    if config.data.sampler != schema::Sampler::IidCyclic {
        return;
    }
    let clients = u64::from(config.clients.total_clients);
    // A data set of the registry's, or one cut by LEAF's scripts, is sized
    // when it is loaded.
    let Some(available) = config
        .data
        .builtin_source()
        .and_then(|source| source.published_train_samples())
    else {
        return;
    };
    let available = available as u64;
    let size = config
        .data
        .partition_size
        .map_or(available / clients.max(1), |size| size as u64);
    let needed = size.saturating_mul(clients);
    if needed > MAX_CYCLIC_PASSES.saturating_mul(available) {
        fail(
            "data.partition_size",
            format!(
                "{clients} clients × {size} = {needed} samples would repeat the {available} \
                 training samples more than {MAX_CYCLIC_PASSES} times"
            ),
        );
    }
    if needed > available && config.clients.do_test {
        fail(
            "clients.do_test",
            format!(
                "with data.sampler = \"iid_cyclic\" and {needed} > {available} samples a \
                 partition repeats samples, so a held-out part would hold training samples; \
                 turn do_test off or make the partitions fit"
            ),
        );
    }
}

/// The fewest training samples the config's partitions need, with the key
/// that sets the number: iid partitions are disjoint, so they need their sum;
/// the label-skew samplers need `min_partition_size` a client; shards at
/// least one sample a client. `None` for `iid_cyclic`, which repeats the
/// training set as often as it takes.
pub fn training_samples_needed(config: &Config) -> Option<(&'static str, u64)> {
    use schema::Sampler;
    let data = &config.data;
    let clients = u64::from(config.clients.total_clients);
    Some(
        match (data.sampler, &data.partition_sizes, data.partition_size) {
            (Sampler::IidCyclic, _, _) => return None,
            (Sampler::Iid, Some(sizes), _) => (
                "data.partition_sizes",
                sizes
                    .iter()
                    .fold(0u64, |sum, &s| sum.saturating_add(s as u64)),
            ),
            (Sampler::Iid, None, Some(size)) => {
                ("data.partition_size", (size as u64).saturating_mul(clients))
            }
            (Sampler::Iid, None, None) | (Sampler::Shards | Sampler::Natural, _, _) => {
                ("clients.total_clients", clients)
            }
            (Sampler::Dirichlet | Sampler::QuantitySkew, _, _) => (
                "data.min_partition_size",
                (data.min_partition_size.max(1) as u64).saturating_mul(clients),
            ),
        },
    )
}

/// The keys of file data sets (`data.datasource = "CSV"`, `"NPZ"`,
/// `"Safetensors"`): `train_file` required for them, every one of them
/// refused for the other data sets, the CSV columns for CSV only.
fn check_file_data(config: &Config, fail: Fail) {
    use crate::data::tabular::FileFormat;
    let data = &config.data;
    let format = FileFormat::from_name(&data.datasource);
    let keys: [(&str, bool); 6] = [
        ("data.train_file", data.train_file.is_some()),
        ("data.test_file", data.test_file.is_some()),
        ("data.label_column", data.label_column.is_some()),
        ("data.client_column", data.client_column.is_some()),
        ("data.test_fraction", data.test_fraction.is_some()),
        ("data.split_seed", data.split_seed.is_some()),
    ];
    let Some(format) = format else {
        for (key, _) in keys.iter().filter(|(_, set)| *set) {
            fail(
                key,
                format!(
                    "applies only to the file data sets (data.datasource = \"CSV\", \"NPZ\" or \
                     \"Safetensors\"); `{}` reads its own files, so remove `{key}`",
                    data.datasource
                ),
            );
        }
        return;
    };
    if data.train_file.is_none() {
        fail(
            "data.datasource",
            format!(
                "`{format}` reads the file that data.train_file names (relative to \
                 data.data_path), and none is set"
            ),
        );
    }
    if format != FileFormat::Csv {
        for key in ["data.label_column", "data.client_column"] {
            if keys.iter().any(|(k, set)| *k == key && *set) {
                fail(
                    key,
                    format!(
                        "names a column of a CSV file; `{format}` files name their arrays \
                         (see docs/CONFIG.md), so remove `{key}`"
                    ),
                );
            }
        }
    }
    for (key, name) in [
        ("data.label_column", &data.label_column),
        ("data.client_column", &data.client_column),
    ] {
        if name.as_ref().is_some_and(|n| n.trim().is_empty()) {
            fail(key, "must name a column".to_owned());
        }
    }
    if data.label_column.is_some() && data.label_column == data.client_column {
        fail(
            "data.client_column",
            "must be another column than data.label_column".to_owned(),
        );
    }
    if let Some(fraction) = data.test_fraction {
        if !(fraction > 0.0 && fraction < 1.0) {
            fail(
                "data.test_fraction",
                format!("must be a number with 0 < f < 1, got {fraction}"),
            );
        }
        if data.test_file.is_some() {
            fail(
                "data.test_fraction",
                "cuts a test set from the training file, and data.test_file names one: keep \
                 one"
                .to_owned(),
            );
        }
    } else if data.split_seed.is_some() {
        fail(
            "data.split_seed",
            "seeds data.test_fraction's split, which is not set".to_owned(),
        );
    }
}

/// Iid partitions with a given size cannot together take more samples than
/// the published training set has; `cohort check` says so before a run reads
/// the files (and holds every sampler against the files' own sizes).
fn check_iid_fits(config: &Config, fail: Fail) {
    let explicit = config.data.partition_sizes.is_some() || config.data.partition_size.is_some();
    if config.data.sampler != schema::Sampler::Iid || !explicit {
        return;
    }
    let Some((key, needed)) = training_samples_needed(config) else {
        return;
    };
    let clients = config.clients.total_clients;
    let Some(source) = config.data.builtin_source() else {
        return;
    };
    let Some(available) = source.published_train_samples() else {
        return;
    };
    let available = available as u64;
    if needed > available {
        fail(
            key,
            format!(
                "{clients} clients need {needed} training samples in all, but {} has {available}; \
                 make the partitions smaller or the clients fewer (Plato's iid repeats the \
                 training set instead: data.sampler = \"iid_cyclic\")",
                source.folder()
            ),
        );
    }
}

/// `server.max_inflight_bytes` as a network server spends it
/// ([`LoadedConfig::inflight_split`]); the two add up to the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InflightSplit {
    /// Update bytes being received or waiting for the round loop.
    pub receiving: u64,
    /// Decoded update bytes a round keeps in memory.
    pub keeping: u64,
}

#[cfg(test)]
mod tests;
