//! Plato's config names, read as cohort's.
//!
//! A config written for Plato (the seed's `fedavg_lenet5_mlx.toml`, Plato's
//! MNIST configs) loads: [`translate`] rewrites the merged table in place
//! before the strict key check, so what runs, what `config.toml` in the run
//! folder holds and what the config hash covers are cohort's names only. Every
//! rewrite where the names differ leaves a one-line note for `cohort check` and
//! the run log; docs/CONFIG.md's "Plato configs" table lists them all.
//!
//! The contract: a Plato key is mapped only where cohort computes the same
//! thing under another name, accepted with a note only where it changes
//! nothing in cohort (`framework`), and refused otherwise, naming the file, the
//! key and why. Keys neither Plato nor cohort know stay errors of the strict
//! check that follows. What this cannot prove is that Plato's Python samplers
//! draw the same samples: cohort's streams are ChaCha8, Plato's NumPy's, so a
//! mapped partition has Plato's structure, not its sample identities.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::{ConfigError, file_error};
use crate::data::DataSource;
use crate::suggest::did_you_mean;

/// Frameworks Plato's `framework` key names that cohort can stand in for:
/// burn runs the same models, so the key only tells which LeNet-5 is meant.
const FRAMEWORKS: &[&str] = &["mlx", "pytorch", "torch"];

/// The sections that may carry Plato's `framework` key.
const FRAMEWORK_KEYS: &[&str] = &[
    "trainer.framework",
    "algorithm.framework",
    "parameters.model.framework",
];

/// Rewrites Plato's names in `merged` to cohort's. Returns a note for each
/// rewrite; problems go to `errors` (the key stays, so the strict check or the
/// types report nothing twice only where the key is removed here).
pub(super) fn translate(
    merged: &mut toml::Table,
    origins: &mut BTreeMap<String, PathBuf>,
    path: &Path,
    errors: &mut Vec<ConfigError>,
) -> Vec<String> {
    let mut plato = Plato {
        origins,
        path,
        errors,
        notes: Vec::new(),
    };
    let marked = is_plato_format(merged);
    let mlx = plato.frameworks(merged);
    plato.trainer_and_algorithm(merged, mlx);
    plato.datasource(merged);
    plato.sampler(merged, marked);
    if !mlx {
        plato.pytorch_optimizer(merged);
    }
    plato.speed_simulation(merged);
    plato.notes
}

struct Plato<'a> {
    origins: &'a mut BTreeMap<String, PathBuf>,
    path: &'a Path,
    errors: &'a mut Vec<ConfigError>,
    notes: Vec<String>,
}

/// Names only Plato uses: a file with any of them was written for Plato, so
/// its other keys mean what Plato means by them (an iid `partition_size`
/// larger than the training set, for one).
fn is_plato_format(merged: &toml::Table) -> bool {
    let text = |key: &str| get(merged, key).and_then(toml::Value::as_str);
    FRAMEWORK_KEYS.iter().any(|key| get(merged, key).is_some())
        || text("trainer.type") == Some("mlx")
        || text("algorithm.type") == Some("mlx_fedavg")
        || text("data.datasource") == Some("Torchvision")
        || get(merged, "data.dataset_name").is_some()
        || text("data.sampler") == Some("noniid")
        || get(merged, "parameters.optimizer.lr").is_some()
}

impl Plato<'_> {
    fn fail(&mut self, key: &str, message: String) {
        let file = self.origin(key);
        self.errors
            .push(file_error(&file, Some(key.to_owned()), message));
    }

    fn origin(&self, key: &str) -> PathBuf {
        self.origins
            .get(key)
            .cloned()
            .unwrap_or_else(|| self.path.to_path_buf())
    }

    /// `framework` in any section: accepted with a note and removed. Returns
    /// whether the config means Plato's MLX path (which picks the unpadded
    /// LeNet-5). Mixed frameworks are refused, as Plato refuses them.
    fn frameworks(&mut self, merged: &mut toml::Table) -> bool {
        let mut chosen: Option<(String, &str)> = None;
        for &key in FRAMEWORK_KEYS {
            let Some(value) = get(merged, key) else {
                continue;
            };
            let Some(name) = value.as_str().map(str::to_ascii_lowercase) else {
                let found = value.type_str();
                self.fail(key, format!("expected a framework name, found a {found}"));
                continue;
            };
            if !FRAMEWORKS.contains(&name.as_str()) {
                let hint = did_you_mean(&name, FRAMEWORKS.iter().copied());
                self.fail(
                    key,
                    format!(
                        "Plato's framework `{name}`{hint} has no counterpart in cohort; \
                         cohort runs Plato's `mlx` and `pytorch` models (or leave the key out)"
                    ),
                );
                continue;
            }
            let family = if name == "mlx" { "mlx" } else { "pytorch" };
            if let Some((other, other_key)) = &chosen
                && other != family
            {
                self.fail(
                    key,
                    format!(
                        "`{name}` conflicts with {other_key} = \"{other}\"; Plato refuses mixed \
                         frameworks too: use one"
                    ),
                );
                continue;
            }
            chosen = Some((family.to_owned(), key));
            remove(merged, key);
            self.notes.push(format!(
                "plato: {key} = \"{name}\" accepted, no effect: cohort trains every model with burn"
            ));
        }
        let trainer_mlx = get(merged, "trainer.type").and_then(toml::Value::as_str) == Some("mlx");
        trainer_mlx || chosen.is_some_and(|(family, _)| family == "mlx")
    }

    /// `trainer.type = "mlx"`, `algorithm.type = "mlx_fedavg"`, and the MLX
    /// LeNet-5, which is the one without padding.
    fn trainer_and_algorithm(&mut self, merged: &mut toml::Table, mlx: bool) {
        self.rename_value(
            merged,
            "trainer.type",
            "mlx",
            "basic",
            "cohort's one trainer (burn) takes MLX's optimizer names and defaults",
        );
        self.rename_value(
            merged,
            "algorithm.type",
            "mlx_fedavg",
            "fedavg",
            "the same sample-weighted FedAvg",
        );
        if mlx {
            self.rename_value(
                merged,
                "trainer.model_name",
                "lenet5",
                "lenet5_compact",
                "Plato's MLX LeNet-5 has no padding (44,426 parameters)",
            );
        }
    }

    fn rename_value(
        &mut self,
        merged: &mut toml::Table,
        key: &str,
        plato: &str,
        cohort: &str,
        why: &str,
    ) {
        if get(merged, key).and_then(toml::Value::as_str) == Some(plato) {
            set(merged, key, toml::Value::String(cohort.to_owned()));
            self.notes.push(format!(
                "plato: {key} = \"{plato}\" read as {key} = \"{cohort}\" ({why})"
            ));
        }
    }

    /// `datasource = "Torchvision"` with `dataset_name`: cohort names the
    /// dataset in `datasource` itself.
    fn datasource(&mut self, merged: &mut toml::Table) {
        let torchvision =
            get(merged, "data.datasource").and_then(toml::Value::as_str) == Some("Torchvision");
        let name = get(merged, "data.dataset_name").cloned();
        // Plato's Torchvision data sets that cohort reads itself.
        let datasets = ["MNIST", "FashionMNIST", "EMNIST", "CIFAR10", "CIFAR100"];
        match (torchvision, name) {
            (false, None) => {}
            (false, Some(_)) => self.fail(
                "data.dataset_name",
                "goes with Plato's `data.datasource = \"Torchvision\"`; cohort names the dataset \
                 in data.datasource (such as MNIST or CIFAR10): remove data.dataset_name"
                    .to_owned(),
            ),
            (true, None) => self.fail(
                "data.datasource",
                "`Torchvision` needs Plato's data.dataset_name (such as MNIST or CIFAR10); or write \
                 the dataset here: data.datasource = \"MNIST\""
                    .to_owned(),
            ),
            (true, Some(toml::Value::String(name))) if datasets.contains(&name.as_str()) => {
                remove(merged, "data.dataset_name");
                set(merged, "data.datasource", toml::Value::String(name.clone()));
                self.notes.push(format!(
                    "plato: data.datasource = \"Torchvision\" with dataset_name = \"{name}\" \
                     read as data.datasource = \"{name}\""
                ));
            }
            (true, Some(other)) => {
                let shown = other.as_str().map_or(other.to_string(), str::to_owned);
                let hint = did_you_mean(&shown, datasets);
                self.fail(
                    "data.dataset_name",
                    format!(
                        "Torchvision dataset `{shown}`{hint} is not one cohort has; datasets: {}",
                        datasets.join(", ")
                    ),
                );
            }
        }
    }

    /// `noniid` is cohort's `dirichlet`; Plato's iid with partitions larger
    /// than the training set repeats it, cohort's `iid_cyclic`.
    fn sampler(&mut self, merged: &mut toml::Table, plato_format: bool) {
        let sampler = get(merged, "data.sampler")
            .and_then(toml::Value::as_str)
            .map(str::to_owned);
        match sampler.as_deref() {
            Some("noniid") => {
                set(
                    merged,
                    "data.sampler",
                    toml::Value::String("dirichlet".to_owned()),
                );
                self.notes.push(
                    "plato: data.sampler = \"noniid\" read as data.sampler = \"dirichlet\" \
                     (label skew by Dir(concentration))"
                        .to_owned(),
                );
                if let Some(size) = remove(merged, "data.partition_size") {
                    self.notes.push(format!(
                        "plato: data.partition_size = {size} has no effect with \"noniid\": Plato \
                         draws that many samples for each client independently, cohort's \
                         dirichlet splits each class among the clients (disjoint, every sample)"
                    ));
                }
            }
            Some("iid") | None if plato_format => self.oversized_iid(merged),
            _ => {}
        }
    }

    fn oversized_iid(&mut self, merged: &mut toml::Table) {
        let Some(size) = get(merged, "data.partition_size").and_then(toml::Value::as_integer)
        else {
            return;
        };
        let clients = get(merged, "clients.total_clients")
            .and_then(toml::Value::as_integer)
            .unwrap_or(i64::from(super::Clients::default().total_clients));
        let source = get(merged, "data.datasource")
            .and_then(toml::Value::as_str)
            .and_then(DataSource::from_name)
            .unwrap_or(DataSource::Mnist);
        // LEAF's sets are as large as LEAF's scripts cut them.
        let Some(available) = source.published_train_samples() else {
            return;
        };
        let available = available as i64;
        if size <= 0 || clients <= 0 || size.saturating_mul(clients) <= available {
            return;
        }
        set(
            merged,
            "data.sampler",
            toml::Value::String("iid_cyclic".to_owned()),
        );
        self.notes.push(format!(
            "plato: data.sampler = \"iid\" with {clients} × partition_size = {size} > {available} \
             training samples read as data.sampler = \"iid_cyclic\" (Plato repeats the shuffled \
             training set to fill the partitions)"
        ));
    }

    /// Plato's PyTorch trainer passes `[parameters.optimizer]` to
    /// `torch.optim`: `lr` is MLX's `learning_rate`, and PyTorch's Adam
    /// corrects its bias where MLX's does not by default.
    fn pytorch_optimizer(&mut self, merged: &mut toml::Table) {
        let Some(rate) = get(merged, "parameters.optimizer.lr").cloned() else {
            return;
        };
        if get(merged, "parameters.optimizer.learning_rate").is_some() {
            self.fail(
                "parameters.optimizer.lr",
                "is Plato's (PyTorch's) name for learning_rate, which is set too: keep one"
                    .to_owned(),
            );
            return;
        }
        let origin = self.origin("parameters.optimizer.lr");
        remove(merged, "parameters.optimizer.lr");
        set(merged, "parameters.optimizer.learning_rate", rate.clone());
        self.origins.insert(
            "parameters.optimizer.learning_rate".to_owned(),
            origin.clone(),
        );
        self.notes.push(format!(
            "plato: parameters.optimizer.lr = {rate} read as parameters.optimizer.learning_rate \
             = {rate}"
        ));
        let optimizer = get(merged, "trainer.optimizer")
            .and_then(toml::Value::as_str)
            .unwrap_or("adam")
            .to_ascii_lowercase();
        let dampened = get(merged, "parameters.optimizer.dampening")
            .and_then(|v| v.as_float().or(v.as_integer().map(|i| i as f64)))
            .is_some_and(|d| d != 0.0);
        match optimizer.as_str() {
            "adam" | "adamw" if get(merged, "parameters.optimizer.bias_correction").is_none() => {
                set(
                    merged,
                    "parameters.optimizer.bias_correction",
                    toml::Value::Boolean(true),
                );
                self.origins
                    .insert("parameters.optimizer.bias_correction".to_owned(), origin);
                self.notes.push(format!(
                    "plato: PyTorch's {optimizer} corrects bias: read as \
                     parameters.optimizer.bias_correction = true"
                ));
            }
            "sgd" | "momentum" if dampened => self.fail(
                "parameters.optimizer.dampening",
                "PyTorch's SGD skips dampening on its first step and cohort's (MLX's) does not, \
                 so a Plato config with dampening would train differently: remove it or write \
                 learning_rate for MLX's SGD"
                    .to_owned(),
            ),
            _ => {}
        }
    }
}

/// Plato's client speed and sleep simulation, read as a `[clients.profile]`.
impl Plato<'_> {
    fn speed_simulation(&mut self, merged: &mut toml::Table) {
        if let Some(value) = remove(merged, "server.periodic_interval") {
            self.notes.push(format!(
                "plato: server.periodic_interval = {value} accepted, no effect: cohort's \
                 asynchronous server aggregates on the simulated clock, every \
                 server.minimum_clients_aggregated updates"
            ));
        }
        let speed = remove(merged, "clients.speed_simulation");
        let distribution = remove(merged, "clients.simulation_distribution");
        let max_sleep = remove(merged, "clients.max_sleep_time");
        let seed = remove(merged, "clients.random_seed");
        let sleep = remove(merged, "clients.sleep_simulation");
        let average = remove(merged, "clients.avg_training_time");
        match speed {
            Some(toml::Value::Boolean(true)) => {}
            Some(toml::Value::Boolean(false)) | None => {
                let ignored: Vec<&str> = [
                    ("speed_simulation", speed.is_some()),
                    ("simulation_distribution", distribution.is_some()),
                    ("max_sleep_time", max_sleep.is_some()),
                    ("random_seed", seed.is_some()),
                    ("sleep_simulation", sleep.is_some()),
                    ("avg_training_time", average.is_some()),
                ]
                .into_iter()
                .filter_map(|(key, set)| set.then_some(key))
                .collect();
                if !ignored.is_empty() {
                    self.notes.push(format!(
                        "plato: clients.{} accepted, no effect without speed_simulation = true",
                        ignored.join(", clients.")
                    ));
                }
                return;
            }
            Some(other) => {
                let found = other.type_str();
                self.fail(
                    "clients.speed_simulation",
                    format!("expected true or false, found a {found}"),
                );
                return;
            }
        }
        let Some(compute) = self.sleep_distribution(distribution) else {
            return;
        };
        set(merged, "clients.profile.compute", compute.clone());
        set(
            merged,
            "clients.profile.compute_unit",
            toml::Value::String("epoch".to_owned()),
        );
        // Plato's default cap.
        let cap = max_sleep.unwrap_or(toml::Value::Integer(60));
        set(merged, "clients.profile.compute_max", cap.clone());
        self.notes.push(format!(
            "plato: clients.speed_simulation = true with simulation_distribution = {compute} read \
             as clients.profile.compute = {compute} seconds per epoch (compute_unit = \
             \"epoch\"), cut at clients.profile.compute_max = {cap} (Plato's max_sleep_time); \
             cohort draws from ChaCha8, not NumPy, so each client's figure differs from Plato's, \
             the distribution does not"
        ));
        if let Some(seed) = seed {
            set(merged, "clients.profile.seed", seed.clone());
            self.notes.push(format!(
                "plato: clients.random_seed = {seed} read as clients.profile.seed = {seed}"
            ));
        }
        self.sleep_simulation(merged, sleep, average);
    }

    /// Plato's `simulation_distribution` as cohort's distribution table.
    fn sleep_distribution(&mut self, distribution: Option<toml::Value>) -> Option<toml::Value> {
        let key = "clients.simulation_distribution";
        let Some(toml::Value::Table(mut table)) = distribution else {
            self.fail(
                key,
                "speed_simulation = true needs simulation_distribution = { distribution = \
                 \"normal\" | \"pareto\", ... } (Plato's sleep time per epoch)"
                    .to_owned(),
            );
            return None;
        };
        let name = table
            .get("distribution")
            .and_then(toml::Value::as_str)
            .map(str::to_ascii_lowercase);
        match name.as_deref() {
            Some("normal") | Some("pareto") => {
                table.insert(
                    "distribution".to_owned(),
                    toml::Value::String(name.expect("matched")),
                );
                Some(toml::Value::Table(table))
            }
            Some("zipf") => {
                self.fail(
                    key,
                    "Plato's `zipf` draws whole seconds from a discrete law cohort does not \
                     have; use `pareto` (continuous, heavy-tailed) or a \
                     [clients.profile] of cohort's"
                        .to_owned(),
                );
                None
            }
            other => {
                self.fail(
                    key,
                    format!(
                        "distribution `{}` is none of Plato's that cohort reads: normal, pareto",
                        other.unwrap_or("(missing)")
                    ),
                );
                None
            }
        }
    }

    /// `sleep_simulation`: cohort never sleeps, so both of Plato's values
    /// give simulated times; `avg_training_time` is each task's fixed cost.
    fn sleep_simulation(
        &mut self,
        merged: &mut toml::Table,
        sleep: Option<toml::Value>,
        average: Option<toml::Value>,
    ) {
        match (sleep.as_ref().and_then(toml::Value::as_bool), average) {
            (Some(true), Some(average)) => {
                set(merged, "clients.profile.task_overhead", average.clone());
                self.notes.push(format!(
                    "plato: clients.sleep_simulation = true with avg_training_time = {average} \
                     read as clients.profile.task_overhead = {average} (each task's training \
                     time beside its simulated sleep)"
                ));
            }
            (Some(true), None) => self.fail(
                "clients.sleep_simulation",
                "Plato's sleep_simulation = true needs clients.avg_training_time (the training \
                 time that stands in for the measured one)"
                    .to_owned(),
            ),
            (Some(false) | None, average) => {
                self.notes.push(
                    "plato: clients.sleep_simulation = false: cohort never sleeps, the sleep \
                     times are simulated (as Plato's sleep_simulation = true, without \
                     avg_training_time)"
                        .to_owned(),
                );
                if average.is_some() {
                    self.notes.push(
                        "plato: clients.avg_training_time accepted, no effect without \
                         sleep_simulation = true"
                            .to_owned(),
                    );
                }
            }
        }
    }
}

/// The value at a dotted key (`parameters.model.framework`).
fn get<'t>(table: &'t toml::Table, dotted: &str) -> Option<&'t toml::Value> {
    let (head, rest) = match dotted.split_once('.') {
        Some((head, rest)) => (head, Some(rest)),
        None => (dotted, None),
    };
    let value = table.get(head)?;
    match rest {
        None => Some(value),
        Some(rest) => get(value.as_table()?, rest),
    }
}

/// Sets a dotted key whose sections exist or can be made; a section that is
/// not a table is left alone (the type check reports it).
fn set(table: &mut toml::Table, dotted: &str, value: toml::Value) {
    match dotted.split_once('.') {
        None => {
            table.insert(dotted.to_owned(), value);
        }
        Some((head, rest)) => {
            let section = table
                .entry(head.to_owned())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if let toml::Value::Table(section) = section {
                set(section, rest, value);
            }
        }
    }
}

/// Removes a dotted key, returning its value.
pub(super) fn remove(table: &mut toml::Table, dotted: &str) -> Option<toml::Value> {
    match dotted.split_once('.') {
        None => table.remove(dotted),
        Some((head, rest)) => match table.get_mut(head)? {
            toml::Value::Table(section) => remove(section, rest),
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests;
