//! Simulated devices: how fast each client computes and talks, and when it
//! is online.
//!
//! A [`DeviceProfile`] gives one client's compute speed (seconds per
//! training sample, or per epoch for Plato's configs), a fixed cost per task,
//! its link bandwidths and latency. [`Profiles::draw`] draws every client's
//! figures from the `[clients.profile]` distributions ([`Distribution`]), each
//! from its own ChaCha8 stream of `(clients.profile.seed, client)`, or reads
//! them from a CSV file of per-client figures ([`Profiles::from_csv`]).
//! [`Availability`] says when each client is online: always, a seeded on/off
//! model, or a trace file.
//!
//! A task's simulated duration ([`TaskTiming`]) comes from the profile and
//! the task's size alone (payload bytes, samples, epochs), never from the
//! machine's measured speed: the simulated timeline, and so every
//! asynchronous result, is the same whatever the worker count or the load.
//!
//! Files are hostile input: their size is bounded, every number is checked,
//! and every error names the file, the line and the column.

mod availability;
mod distribution;

use std::path::Path;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

pub use availability::{
    Availability, AvailabilityConfig, AvailabilityModel, Interval, OnlineIndex,
};
pub use distribution::Distribution;

/// The longest a figure may be: compute seconds per sample (or epoch), task
/// overhead and latency are at most a day, so a task stays a finite number
/// of seconds that any result file holds.
pub const MAX_SECONDS: f64 = 86_400.0;
/// The slowest link: 1 kbit/s (as `clients.uplink_mbps`).
pub const MIN_MBPS: f64 = crate::config::MIN_MBPS;
/// The fastest: 1 Pbit/s.
pub const MAX_MBPS: f64 = crate::config::MAX_MBPS;
/// The largest profile or trace file read.
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// What one compute figure is per.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ComputeUnit {
    /// Seconds per training sample per epoch: a task of n samples and e
    /// epochs computes `n · e · figure` seconds.
    #[default]
    Sample,
    /// Seconds per epoch, whatever the partition's size (Plato's sleep time
    /// per epoch).
    Epoch,
}

/// `[clients.profile]`: the simulated devices. Without `compute` or `file`
/// there is no profile, and simulated time comes from measured times.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProfileConfig {
    /// Seconds of compute per training sample and epoch (or per epoch, with
    /// `compute_unit = "epoch"`): a number or a distribution. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compute: Option<Distribution>,
    /// `sample` (default) or `epoch`.
    pub compute_unit: ComputeUnit,
    /// Draws of `compute` above this are cut to it (Plato's
    /// `max_sleep_time`). Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compute_max: Option<f64>,
    /// Seconds every task costs beside its compute (Plato's
    /// `avg_training_time`). Default 0.
    pub task_overhead: f64,
    /// Client download bandwidth in Mbit/s. Default: none, downloads take
    /// only the latency.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downlink_mbps: Option<Distribution>,
    /// Client upload bandwidth in Mbit/s. Default: none, as downloads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uplink_mbps: Option<Distribution>,
    /// Seconds each transfer (download, upload) waits before its first byte.
    /// Default 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency: Option<Distribution>,
    /// Seed of the draws: client c's figures come from the stream of
    /// `(seed, c)`. Default 1.
    pub seed: u64,
    /// A CSV file of per-client figures (relative to the config file that
    /// sets it), instead of the draws: columns `client` and `compute`, and
    /// optionally `downlink_mbps`, `uplink_mbps`, `latency`. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<std::path::PathBuf>,
}

impl Default for ProfileConfig {
    fn default() -> Self {
        Self {
            compute: None,
            compute_unit: ComputeUnit::Sample,
            compute_max: None,
            task_overhead: 0.0,
            downlink_mbps: None,
            uplink_mbps: None,
            latency: None,
            seed: 1,
            file: None,
        }
    }
}

impl ProfileConfig {
    /// Whether the run simulates devices.
    pub fn enabled(&self) -> bool {
        self.compute.is_some() || self.file.is_some()
    }

    /// Every problem, as (key inside `[clients.profile]`, message).
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut problems = Vec::new();
        let mut check = |key: &'static str, figure: &Option<Distribution>, min, max| {
            if let Some(Err(reason)) = figure.as_ref().map(|d| d.check(min, max)) {
                problems.push((key, reason));
            }
        };
        check("compute", &self.compute, 0.0, MAX_SECONDS);
        check("downlink_mbps", &self.downlink_mbps, MIN_MBPS, MAX_MBPS);
        check("uplink_mbps", &self.uplink_mbps, MIN_MBPS, MAX_MBPS);
        check("latency", &self.latency, 0.0, MAX_SECONDS);
        if let Some(max) = self.compute_max
            && !(max.is_finite() && max > 0.0 && max <= MAX_SECONDS)
        {
            problems.push((
                "compute_max",
                format!(
                    "must be a number of seconds in (0, {MAX_SECONDS}], got {}",
                    crate::number::shown(max)
                ),
            ));
        }
        if !(self.task_overhead.is_finite() && (0.0..=MAX_SECONDS).contains(&self.task_overhead)) {
            problems.push((
                "task_overhead",
                format!(
                    "must be a number of seconds in [0, {MAX_SECONDS}], got {}",
                    crate::number::shown(self.task_overhead)
                ),
            ));
        }
        if !self.enabled() {
            let set = [
                ("downlink_mbps", self.downlink_mbps.is_some()),
                ("uplink_mbps", self.uplink_mbps.is_some()),
                ("latency", self.latency.is_some()),
                ("task_overhead", self.task_overhead != 0.0),
                ("compute_max", self.compute_max.is_some()),
            ];
            for (key, _) in set.into_iter().filter(|(_, set)| *set) {
                problems.push((
                    key,
                    "needs clients.profile.compute or clients.profile.file: without them \
                     there is no device profile"
                        .to_owned(),
                ));
            }
        }
        problems
    }
}

/// What share of a training epoch's compute one forward pass over the same
/// samples takes: a backward pass costs about twice the forward one, the
/// usual rule for dense and convolutional networks, so a training step is
/// three forward passes' worth.
pub const FORWARD_SHARE: f64 = 1.0 / 3.0;

/// One client's simulated device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceProfile {
    /// Seconds per sample and epoch, or per epoch ([`ComputeUnit`]).
    pub compute: f64,
    pub unit: ComputeUnit,
    pub task_overhead: f64,
    /// `None`: an unbounded link (transfers take only the latency).
    pub downlink_mbps: Option<f64>,
    pub uplink_mbps: Option<f64>,
    pub latency: f64,
}

/// Where a task's simulated seconds went.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TaskTiming {
    pub download: f64,
    pub compute: f64,
    pub upload: f64,
}

impl TaskTiming {
    pub fn total(&self) -> f64 {
        self.download + self.compute + self.upload
    }
}

impl DeviceProfile {
    /// Seconds to move `bytes` down to the client.
    pub fn download_seconds(&self, bytes: u64) -> f64 {
        self.latency
            + self
                .downlink_mbps
                .map_or(0.0, |mbps| bits(bytes) / (mbps * 1e6))
    }

    /// Seconds to move `bytes` up to the server.
    pub fn upload_seconds(&self, bytes: u64) -> f64 {
        self.latency
            + self
                .uplink_mbps
                .map_or(0.0, |mbps| bits(bytes) / (mbps * 1e6))
    }

    /// Seconds of local training over `samples` for `epochs`.
    pub fn compute_seconds(&self, samples: u64, epochs: u32) -> f64 {
        let per_epoch = match self.unit {
            ComputeUnit::Sample => self.compute * samples as f64,
            ComputeUnit::Epoch => self.compute,
        };
        self.task_overhead + per_epoch * f64::from(epochs)
    }

    /// An evaluation of a model on `samples` (power-of-choice's candidates):
    /// `download_bytes` down, one forward pass over them, `upload_bytes` up.
    /// The forward pass is [`FORWARD_SHARE`] of one training epoch; the
    /// task overhead is the training task's, not charged here.
    pub fn evaluation(&self, download_bytes: u64, samples: u64, upload_bytes: u64) -> TaskTiming {
        let epoch = match self.unit {
            ComputeUnit::Sample => self.compute * samples as f64,
            ComputeUnit::Epoch => self.compute,
        };
        TaskTiming {
            download: self.download_seconds(download_bytes),
            compute: epoch * FORWARD_SHARE,
            upload: self.upload_seconds(upload_bytes),
        }
    }

    /// A task's timing before its upload size is known: the upload's
    /// latency is the least it can take.
    pub fn before_upload(&self, download_bytes: u64, samples: u64, epochs: u32) -> TaskTiming {
        TaskTiming {
            download: self.download_seconds(download_bytes),
            compute: self.compute_seconds(samples, epochs),
            upload: self.latency,
        }
    }
}

fn bits(bytes: u64) -> f64 {
    bytes as f64 * 8.0
}

/// Every client's device, client `c` at index `c − 1`.
#[derive(Debug, Clone, PartialEq)]
pub struct Profiles(Vec<DeviceProfile>);

impl Profiles {
    /// Each client's figures drawn from `config`'s distributions, client c
    /// from the stream of `(config.seed, c)`, figure after figure in a fixed
    /// order (compute, downlink, uplink, latency), so adding a client leaves
    /// the others' figures as they were.
    pub fn draw(config: &ProfileConfig, total_clients: u32) -> Self {
        let compute = config
            .compute
            .clone()
            .unwrap_or(Distribution::Constant { value: 0.0 });
        Profiles(
            (1..=total_clients)
                .map(|client| {
                    let seed = crate::seeds::derive_seed(
                        config.seed,
                        "device-profile",
                        &[u64::from(client)],
                    );
                    let mut rng = ChaCha8Rng::seed_from_u64(seed);
                    let compute =
                        compute.sample(&mut rng, 0.0, config.compute_max.unwrap_or(MAX_SECONDS));
                    let mut link = |figure: &Option<Distribution>| {
                        figure
                            .as_ref()
                            .map(|d| d.sample(&mut rng, MIN_MBPS, MAX_MBPS))
                    };
                    let downlink_mbps = link(&config.downlink_mbps);
                    let uplink_mbps = link(&config.uplink_mbps);
                    let latency = config
                        .latency
                        .as_ref()
                        .map_or(0.0, |d| d.sample(&mut rng, 0.0, MAX_SECONDS));
                    DeviceProfile {
                        compute,
                        unit: config.compute_unit,
                        task_overhead: config.task_overhead,
                        downlink_mbps,
                        uplink_mbps,
                        latency,
                    }
                })
                .collect(),
        )
    }

    /// Client `client_id`'s device.
    pub fn of(&self, client_id: u32) -> Option<&DeviceProfile> {
        (client_id as usize)
            .checked_sub(1)
            .and_then(|index| self.0.get(index))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Per-client figures from CSV `text` (named `file` in errors): a header
    /// naming the columns, then one row per client 1..=`total_clients`, each
    /// exactly once. `client` and `compute` are required; a column
    /// `downlink_mbps`, `uplink_mbps` or `latency` that is absent takes
    /// `config`'s figure (drawn as [`Profiles::draw`] does).
    pub fn from_csv(
        text: &str,
        file: &Path,
        config: &ProfileConfig,
        total_clients: u32,
    ) -> Result<Self, FileError> {
        let mut profiles = Self::draw(config, total_clients);
        let table = CsvTable::parse(text, file, &PROFILE_COLUMNS, &["client", "compute"])?;
        let mut seen = vec![false; total_clients as usize];
        for row in table.rows() {
            let client = row.client(total_clients)?;
            let slot = &mut seen[client as usize - 1];
            if std::mem::replace(slot, true) {
                return Err(row.error(0, format!("client {client} has a row already")));
            }
            let profile = &mut profiles.0[client as usize - 1];
            profile.compute = row.number("compute", 0.0, MAX_SECONDS)?.expect("required");
            if let Some(mbps) = row.number("downlink_mbps", MIN_MBPS, MAX_MBPS)? {
                profile.downlink_mbps = Some(mbps);
            }
            if let Some(mbps) = row.number("uplink_mbps", MIN_MBPS, MAX_MBPS)? {
                profile.uplink_mbps = Some(mbps);
            }
            if let Some(latency) = row.number("latency", 0.0, MAX_SECONDS)? {
                profile.latency = latency;
            }
        }
        if let Some(missing) = seen.iter().position(|seen| !seen) {
            return Err(FileError {
                file: file.display().to_string(),
                line: table.last_line(),
                column: None,
                problem: format!(
                    "no row for client {} (every client 1..={total_clients} needs one)",
                    missing + 1
                ),
            });
        }
        Ok(profiles)
    }
}

const PROFILE_COLUMNS: [&str; 5] = [
    "client",
    "compute",
    "downlink_mbps",
    "uplink_mbps",
    "latency",
];

/// A profile or trace file that cannot be read: where, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: line {line}{}: {problem}", .column.as_ref().map_or(String::new(), |c| format!(", column {c}")))]
pub struct FileError {
    pub file: String,
    pub line: usize,
    /// The column's number and name (`2 (compute)`), when one is at fault.
    pub column: Option<String>,
    pub problem: String,
}

/// Reads a profile or trace file, bounded.
pub fn read_file(path: &Path) -> Result<String, FileError> {
    crate::fsutil::read_bounded_text(path, MAX_FILE_BYTES).map_err(|error| FileError {
        file: path.display().to_string(),
        line: 0,
        column: None,
        problem: format!("cannot read it: {error}"),
    })
}

/// A small CSV of numbers: a header of known column names, then rows of as
/// many comma-separated fields. No quoting: every field is a number.
struct CsvTable<'a> {
    file: String,
    columns: Vec<&'a str>,
    rows: Vec<(usize, Vec<&'a str>)>,
}

struct CsvRow<'t, 'a> {
    table: &'t CsvTable<'a>,
    line: usize,
    fields: &'t [&'a str],
}

impl<'a> CsvTable<'a> {
    fn parse(
        text: &'a str,
        file: &Path,
        known: &[&str],
        required: &[&str],
    ) -> Result<Self, FileError> {
        let file = file.display().to_string();
        let error = |line, column: Option<String>, problem: String| FileError {
            file: file.clone(),
            line,
            column,
            problem,
        };
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, line)| (i + 1, line.trim()))
            .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'));
        let Some((header_line, header)) = lines.next() else {
            return Err(error(
                1,
                None,
                format!(
                    "the file is empty; expected a header such as `{}`",
                    required.join(",")
                ),
            ));
        };
        let columns: Vec<&str> = header.split(',').map(str::trim).collect();
        for (index, name) in columns.iter().enumerate() {
            if !known.contains(name) {
                return Err(error(
                    header_line,
                    Some(format!("{} ({name})", index + 1)),
                    format!(
                        "unknown column `{name}`{}; columns: {}",
                        crate::suggest::did_you_mean(name, known.iter().copied()),
                        known.join(", ")
                    ),
                ));
            }
            if columns[..index].contains(name) {
                return Err(error(
                    header_line,
                    Some(format!("{} ({name})", index + 1)),
                    format!("column `{name}` appears twice"),
                ));
            }
        }
        if let Some(missing) = required.iter().find(|r| !columns.contains(r)) {
            return Err(error(
                header_line,
                None,
                format!(
                    "the header has no `{missing}` column; it needs {}",
                    required.join(", ")
                ),
            ));
        }
        let mut rows = Vec::new();
        for (line, text) in lines {
            let fields: Vec<&str> = text.split(',').map(str::trim).collect();
            if fields.len() != columns.len() {
                return Err(error(
                    line,
                    None,
                    format!("{} fields, the header has {}", fields.len(), columns.len()),
                ));
            }
            rows.push((line, fields));
        }
        Ok(Self {
            file,
            columns,
            rows,
        })
    }

    fn rows(&self) -> impl Iterator<Item = CsvRow<'_, 'a>> {
        self.rows.iter().map(|(line, fields)| CsvRow {
            table: self,
            line: *line,
            fields,
        })
    }

    fn last_line(&self) -> usize {
        self.rows.last().map_or(1, |(line, _)| *line)
    }
}

impl CsvRow<'_, '_> {
    fn error(&self, index: usize, problem: String) -> FileError {
        FileError {
            file: self.table.file.clone(),
            line: self.line,
            column: Some(format!("{} ({})", index + 1, self.table.columns[index])),
            problem,
        }
    }

    fn index(&self, column: &str) -> Option<usize> {
        self.table.columns.iter().position(|c| *c == column)
    }

    /// The client id of the `client` column, in 1..=`total_clients`.
    fn client(&self, total_clients: u32) -> Result<u32, FileError> {
        let index = self.index("client").expect("required column");
        let field = self.fields[index];
        match field.parse::<u32>() {
            Ok(id) if (1..=total_clients).contains(&id) => Ok(id),
            Ok(id) => Err(self.error(
                index,
                format!("client {id} is not one of the run's clients 1..={total_clients}"),
            )),
            Err(_) => Err(self.error(index, format!("`{field}` is not a client id"))),
        }
    }

    /// The number in `column`, in `[min, max]`; `None` when the file has no
    /// such column.
    fn number(&self, column: &str, min: f64, max: f64) -> Result<Option<f64>, FileError> {
        let Some(index) = self.index(column) else {
            return Ok(None);
        };
        let field = self.fields[index];
        match field.parse::<f64>() {
            Ok(value) if value.is_finite() && (min..=max).contains(&value) => Ok(Some(value)),
            Ok(value) => Err(self.error(
                index,
                format!(
                    "{} is outside [{}, {}]",
                    crate::number::shown(value),
                    crate::number::shown(min),
                    crate::number::shown(max)
                ),
            )),
            Err(_) => Err(self.error(index, format!("`{field}` is not a number"))),
        }
    }
}

#[cfg(test)]
mod tests;
