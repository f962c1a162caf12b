//! The models and data sets a run can name, by `trainer.model_name` and
//! `data.datasource`.
//!
//! Their names live here, with the models, not in cohort-core's config: the
//! CLI, `cohort check` and the did-you-mean of a misspelled name all ask a
//! [`Registry`]. [`Registry::builtin`] holds cohort's own; a program that
//! embeds cohort adds its own with [`Registry::add_model`] and
//! [`Registry::add_dataset`] and hands the registry to the run (and to
//! `cohort_cli::main_with`, so that its server, worker and client processes
//! all know them).

mod datasets;
mod strategies;

pub use datasets::{DataRequest, DatasetEntry, DatasetResolver, LoadError, TrainRows};
pub use strategies::StrategyEntry;

use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;

use burn::tensor::Device;
use cohort_core::config::{ConfigErrors, LoadedConfig, VectorizedClients, plain_name};
use cohort_core::data::tabular::FileFormat;
use cohort_core::data::{DataSource, Splits};
use cohort_core::strategy::{AlgorithmConfig, Strategy};
use cohort_core::suggest::did_you_mean;
use cohort_core::tree::ParamTree;

use crate::model::{
    Accelerated, Cnn, CnnBn, CnnFemnist, FederatedModel, LeNet5, LeNet5Compact, LstmShakespeare,
    ModelError, ModelOptions, ModelSpec, Multilayer, ResNet18, ResNet20, Vgg11,
};
use crate::params;
use crate::task::Task;
use crate::trainer::{
    Augmentation, ClientTrainer, Evaluator, LocalTrainer, ModelEvaluator, TrainSettings,
};

/// A registered model: its name, and what the runtime builds from it without
/// knowing its type.
#[derive(Clone)]
pub struct ModelEntry {
    name: String,
    summary: String,
    build: Arc<dyn BuildModel>,
}

impl std::fmt::Debug for ModelEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelEntry")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ModelEntry {
    /// The model that `build` constructs, under `name`.
    pub fn new<M, F>(name: &str, summary: &str, build: F) -> Self
    where
        M: FederatedModel,
        F: Fn(&ModelSpec, &Device) -> Result<M, ModelError> + Send + Sync + 'static,
    {
        Self {
            name: name.to_owned(),
            summary: summary.to_owned(),
            build: Arc::new(Typed {
                build,
                model: PhantomData,
            }),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// One line for listings (`cohort check`, errors).
    pub fn summary(&self) -> &str {
        &self.summary
    }

    /// A worker's trainer, its model instance on the autodiff version of
    /// `device`.
    pub fn trainer(
        &self,
        spec: &ModelSpec,
        task: &Arc<dyn Task>,
        device: &Device,
        settings: TrainSettings,
    ) -> Result<Box<dyn ClientTrainer>, ModelError> {
        self.build.trainer(spec, task, device, settings)
    }

    /// An evaluator on `device` (without autodiff).
    pub fn evaluator(
        &self,
        spec: &ModelSpec,
        task: &Arc<dyn Task>,
        device: &Device,
        batch_size: usize,
    ) -> Result<Box<dyn ModelEvaluator>, ModelError> {
        self.build.evaluator(spec, task, device, batch_size)
    }

    /// A freshly built instance's parameters in PyTorch's layout: the schema
    /// model files and seeds are checked against.
    pub fn template(&self, spec: &ModelSpec) -> Result<ParamTree, ModelError> {
        self.build.template(spec)
    }

    /// Which of cohort's own implementations computes the model, if any.
    pub fn accelerated(&self, spec: &ModelSpec) -> Result<Option<Accelerated>, ModelError> {
        Ok(self.build.facts(spec)?.accelerated)
    }

    /// Rows of outputs the model gives a sample
    /// ([`FederatedModel::rows_per_sample`]).
    pub fn rows_per_sample(&self, spec: &ModelSpec) -> Result<usize, ModelError> {
        Ok(self.build.facts(spec)?.rows_per_sample)
    }

    /// Whether the model can be built for `spec`: `Err` names the option
    /// (the key of `[parameters.model]`) at fault where one is.
    pub fn check_spec(&self, spec: &ModelSpec) -> Result<(), SpecRefusal> {
        self.build.check_spec(spec)
    }
}

/// Why a model cannot be built for a spec, and the option at fault if it is
/// one (`norm` for `parameters.model.norm`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecRefusal {
    pub option: Option<String>,
    pub error: ModelError,
}

/// What a [`ModelEntry`] does with its model type erased.
trait BuildModel: Send + Sync {
    fn trainer(
        &self,
        spec: &ModelSpec,
        task: &Arc<dyn Task>,
        device: &Device,
        settings: TrainSettings,
    ) -> Result<Box<dyn ClientTrainer>, ModelError>;
    fn evaluator(
        &self,
        spec: &ModelSpec,
        task: &Arc<dyn Task>,
        device: &Device,
        batch_size: usize,
    ) -> Result<Box<dyn ModelEvaluator>, ModelError>;
    fn template(&self, spec: &ModelSpec) -> Result<ParamTree, ModelError>;
    fn facts(&self, spec: &ModelSpec) -> Result<ModelFacts, ModelError>;
    fn check_spec(&self, spec: &ModelSpec) -> Result<(), SpecRefusal>;
}

/// What a built instance says of itself, asked once per question.
struct ModelFacts {
    accelerated: Option<Accelerated>,
    rows_per_sample: usize,
}

struct Typed<M, F> {
    build: F,
    model: PhantomData<fn() -> M>,
}

impl<M, F> Typed<M, F>
where
    M: FederatedModel,
    F: Fn(&ModelSpec, &Device) -> Result<M, ModelError> + Send + Sync,
{
    /// The model for `spec`, built from a fresh copy of it so that this
    /// build's record of the options it read is its own; an option given
    /// but never read is refused.
    fn built(&self, spec: &ModelSpec, device: &Device) -> Result<M, SpecRefusal> {
        let fresh = spec.clone();
        let model = (self.build)(&fresh, device).map_err(|error| SpecRefusal {
            option: fresh.options.refused(),
            error,
        })?;
        match fresh.options.unread() {
            Some((key, error)) => Err(SpecRefusal {
                option: Some(key),
                error,
            }),
            None => Ok(model),
        }
    }

    fn build(&self, spec: &ModelSpec, device: &Device) -> Result<M, ModelError> {
        self.built(spec, device).map_err(|refusal| refusal.error)
    }
}

impl<M, F> BuildModel for Typed<M, F>
where
    M: FederatedModel,
    F: Fn(&ModelSpec, &Device) -> Result<M, ModelError> + Send + Sync,
{
    fn trainer(
        &self,
        spec: &ModelSpec,
        task: &Arc<dyn Task>,
        device: &Device,
        settings: TrainSettings,
    ) -> Result<Box<dyn ClientTrainer>, ModelError> {
        let model = self.build(spec, &device.clone().autodiff())?;
        let trainer = LocalTrainer::new(|_| model, device, settings).with_task(task.clone());
        Ok(Box::new(trainer))
    }

    fn evaluator(
        &self,
        spec: &ModelSpec,
        task: &Arc<dyn Task>,
        device: &Device,
        batch_size: usize,
    ) -> Result<Box<dyn ModelEvaluator>, ModelError> {
        let model = self.build(spec, device)?;
        Ok(Box::new(
            Evaluator::new(model, batch_size).with_task(task.clone()),
        ))
    }

    fn template(&self, spec: &ModelSpec) -> Result<ParamTree, ModelError> {
        Ok(params::extract(&self.build(spec, &crate::device::cpu())?))
    }

    fn facts(&self, spec: &ModelSpec) -> Result<ModelFacts, ModelError> {
        let model = self.build(spec, &crate::device::cpu())?;
        Ok(ModelFacts {
            accelerated: model.accelerated(),
            rows_per_sample: model.rows_per_sample(&spec.sample_shape),
        })
    }

    fn check_spec(&self, spec: &ModelSpec) -> Result<(), SpecRefusal> {
        self.built(spec, &crate::device::cpu()).map(drop)
    }
}

/// The model a run trains: its registry entry, what it is built for and
/// the task it learns. Every trainer and evaluator of the run comes from here.
#[derive(Debug, Clone)]
pub struct RunModel {
    pub entry: ModelEntry,
    pub spec: ModelSpec,
    pub task: Arc<dyn Task>,
    /// The data set's augmentation of training batches, unless
    /// `data.augment = false`.
    pub augmentation: Option<Augmentation>,
}

impl RunModel {
    pub fn name(&self) -> &str {
        self.entry.name()
    }

    /// See [`ModelEntry::trainer`].
    pub fn trainer(
        &self,
        device: &Device,
        settings: TrainSettings,
    ) -> Result<Box<dyn ClientTrainer>, ModelError> {
        let settings = TrainSettings {
            augmentation: self.augmentation.clone(),
            ..settings
        };
        self.entry.trainer(&self.spec, &self.task, device, settings)
    }

    /// See [`ModelEntry::evaluator`].
    pub fn evaluator(
        &self,
        device: &Device,
        batch_size: usize,
    ) -> Result<Box<dyn ModelEvaluator>, ModelError> {
        self.entry
            .evaluator(&self.spec, &self.task, device, batch_size)
    }

    /// See [`ModelEntry::template`].
    pub fn template(&self) -> Result<ParamTree, ModelError> {
        self.entry.template(&self.spec)
    }

    /// See [`ModelEntry::accelerated`]: only for classification, the one
    /// task cohort's own implementations compute.
    pub fn accelerated(&self) -> Result<Option<Accelerated>, ModelError> {
        let accelerated = self.entry.accelerated(&self.spec)?;
        Ok(accelerated.filter(|_| self.task.is_builtin_classification()))
    }

    /// See [`ModelEntry::rows_per_sample`].
    pub fn rows_per_sample(&self) -> Result<usize, ModelError> {
        self.entry.rows_per_sample(&self.spec)
    }
}

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("a model named `{0}` is registered already")]
    DuplicateModel(String),
    #[error("a data set named `{0}` is registered already")]
    DuplicateDataset(String),
    #[error("a strategy named `{0}` is registered already (or is one of cohort's)")]
    DuplicateStrategy(String),
    #[error("`{0}` is not a name to register: use letters, digits and `_` only")]
    BadName(String),
}

/// The models, data sets and strategies a run may name.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    models: Vec<ModelEntry>,
    datasets: Vec<DatasetEntry>,
    /// Data sets whose entries come from their files when a run names them.
    resolvers: Vec<DatasetResolver>,
    /// Beside cohort's own (`AlgorithmConfig`), which are always there.
    strategies: Vec<StrategyEntry>,
}

impl Registry {
    /// No models at all.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Adds a strategy that `[algorithm] type = "<name>"` selects; its
    /// builder reads the section's other keys ([`StrategyEntry::new`]).
    pub fn add_strategy(&mut self, entry: StrategyEntry) -> Result<&mut Self, RegistryError> {
        if !plain_name(entry.name()) {
            return Err(RegistryError::BadName(entry.name().to_owned()));
        }
        let taken = AlgorithmConfig::names().contains(&entry.name())
            || self.strategies.iter().any(|e| e.name() == entry.name());
        if taken {
            return Err(RegistryError::DuplicateStrategy(entry.name().to_owned()));
        }
        self.strategies.push(entry);
        Ok(self)
    }

    /// The strategies added to cohort's own.
    pub fn strategies(&self) -> &[StrategyEntry] {
        &self.strategies
    }

    /// The strategy the config's `[algorithm]` names, with fresh state: one
    /// of cohort's, or one added here; else the config error that lists
    /// them all.
    pub fn strategy_of(&self, loaded: &LoadedConfig) -> Result<Box<dyn Strategy>, ConfigErrors> {
        strategies::strategy_of(&self.strategies, loaded)
    }

    /// cohort's own models. A model of cohort's is one file in `model/` and
    /// one line here.
    pub fn builtin() -> Self {
        let mut registry = Self::empty();
        for entry in [
            ModelEntry::new(
                "lenet5",
                "LeNet-5 as in the reference job (61,706 parameters)",
                LeNet5::build,
            ),
            ModelEntry::new(
                "lenet5_compact",
                "LeNet-5 without padding (44,426 parameters)",
                LeNet5Compact::build,
            ),
            ModelEntry::new(
                "cnn_bn",
                "a CNN with BatchNorm and seeded dropout (207,018 parameters)",
                CnnBn::build,
            ),
            ModelEntry::new(
                "multilayer",
                "an MLP for flattened or tabular samples (options: hidden, activation)",
                Multilayer::build,
            ),
            ModelEntry::new(
                "cnn",
                "McMahan et al.'s CNN: 5×5 conv 32 and 64, 2×2 pooling, dense 512",
                Cnn::build,
            ),
            ModelEntry::new(
                "resnet_20",
                "He et al.'s CIFAR ResNet-20, option A shortcuts (options: norm, groups)",
                ResNet20::build,
            ),
            ModelEntry::new(
                "cnn_femnist",
                "LEAF's FEMNIST CNN: 5×5 conv 32 and 64, 2×2 pooling, dense 2048",
                CnnFemnist::build,
            ),
            ModelEntry::new(
                "resnet_18",
                "Plato's ResNet-18, 3×3 stem, option B shortcuts (options: norm, groups)",
                ResNet18::build,
            ),
            ModelEntry::new(
                "vgg_11",
                "Plato's VGG-11 with BatchNorm and one linear layer (options: norm, groups)",
                Vgg11::build,
            ),
            ModelEntry::new(
                "lstm_shakespeare",
                "LEAF's Shakespeare LSTM: embedding 8, two LSTM layers of 256 (option: outputs)",
                LstmShakespeare::build,
            ),
        ] {
            registry.add(entry).expect("built-in names are unique");
        }
        for (source, summary) in [
            (
                DataSource::Mnist,
                "MNIST digits, 28×28 grayscale, 10 classes (IDX files)",
            ),
            (
                DataSource::FashionMnist,
                "Fashion-MNIST, 28×28 grayscale, 10 classes (IDX files)",
            ),
            (
                DataSource::Emnist,
                "EMNIST balanced, 28×28 grayscale, 47 classes (IDX files)",
            ),
            (
                DataSource::Cifar10,
                "CIFAR-10, 32×32 colour, 10 classes (binary batches)",
            ),
            (
                DataSource::Cifar100,
                "CIFAR-100, 32×32 colour, 100 fine classes (binary batches)",
            ),
            (
                DataSource::Femnist,
                "LEAF's FEMNIST, 28×28 grayscale, 62 classes, one writer a user (LEAF JSON)",
            ),
            (
                DataSource::Shakespeare,
                "LEAF's Shakespeare, next character of 80, one role a user (LEAF JSON)",
            ),
        ] {
            registry
                .add_dataset(DatasetEntry::builtin(source, summary))
                .expect("built-in names are unique");
        }
        for format in FileFormat::ALL {
            registry
                .add_resolver(DatasetResolver::file(format))
                .expect("built-in names are unique");
        }
        registry
    }

    /// Registers a data set.
    pub fn add_dataset(&mut self, entry: DatasetEntry) -> Result<&mut Self, RegistryError> {
        if !plain_name(entry.name()) {
            return Err(RegistryError::BadName(entry.name().to_owned()));
        }
        if self.knows_dataset(entry.name()) {
            return Err(RegistryError::DuplicateDataset(entry.name().to_owned()));
        }
        self.datasets.push(entry);
        Ok(self)
    }

    /// Registers a data set whose entry `resolver` derives when a run names
    /// it (its shape and classes from the files the config names).
    pub fn add_resolver(&mut self, resolver: DatasetResolver) -> Result<&mut Self, RegistryError> {
        if !plain_name(resolver.name()) {
            return Err(RegistryError::BadName(resolver.name().to_owned()));
        }
        if self.knows_dataset(resolver.name()) {
            return Err(RegistryError::DuplicateDataset(resolver.name().to_owned()));
        }
        self.resolvers.push(resolver);
        Ok(self)
    }

    fn knows_dataset(&self, name: &str) -> bool {
        self.dataset(name).is_some() || self.resolvers.iter().any(|r| r.name() == name)
    }

    /// The data sets derived from their files, in registration order.
    pub fn resolvers(&self) -> &[DatasetResolver] {
        &self.resolvers
    }

    /// The data set registered as `name` with a fixed entry (not one
    /// derived from files: see [`Registry::dataset_in`]).
    pub fn dataset(&self, name: &str) -> Option<&DatasetEntry> {
        self.datasets.iter().find(|entry| entry.name() == name)
    }

    /// Every data set, in registration order.
    pub fn datasets(&self) -> &[DatasetEntry] {
        &self.datasets
    }

    /// [`Registry::dataset_in`] with the files under `data.data_path`.
    pub fn dataset_of(&self, loaded: &LoadedConfig) -> Result<DatasetEntry, ConfigErrors> {
        self.dataset_in(loaded, None)
    }

    /// The data set `data.datasource` names, or the config error that says
    /// which names there are. A fixed entry's classes must be the config's
    /// `parameters.model.num_classes`; a derived one (a file data set) is
    /// read from `data_root` (else `data.data_path`) and takes its classes
    /// from its labels.
    pub fn dataset_in(
        &self,
        loaded: &LoadedConfig,
        data_root: Option<&Path>,
    ) -> Result<DatasetEntry, ConfigErrors> {
        let name = &loaded.config().data.datasource;
        if let Some(resolver) = self.resolvers.iter().find(|r| r.name() == name) {
            let root = data_root.unwrap_or(&loaded.config().data.data_path);
            return resolver.resolve(loaded, root);
        }
        let Some(entry) = self.dataset(name) else {
            let names: Vec<&str> = (self.datasets.iter().map(DatasetEntry::name))
                .chain(self.resolvers.iter().map(DatasetResolver::name))
                .collect();
            return Err(loaded.error_at(
                "data.datasource",
                format!(
                    "unknown value `{name}`{}; expected one of: {}",
                    did_you_mean(name, names.iter().copied()),
                    names.join(", ")
                ),
            ));
        };
        let classes = loaded.config().parameters.model.num_classes;
        if classes != entry.classes() {
            return Err(loaded.error_at(
                "parameters.model.num_classes",
                format!(
                    "{classes} classes requested, but {name} has {}",
                    entry.classes()
                ),
            ));
        }
        Ok(entry.clone())
    }

    /// The config's data set, loaded as `request` says.
    pub fn load_data(
        &self,
        loaded: &LoadedConfig,
        request: &DataRequest,
    ) -> Result<Splits, LoadError> {
        self.dataset_in(loaded, Some(&request.root))?.load(request)
    }

    /// Registers the model that `build` constructs under `name`.
    pub fn add_model<M, F>(
        &mut self,
        name: &str,
        summary: &str,
        build: F,
    ) -> Result<&mut Self, RegistryError>
    where
        M: FederatedModel,
        F: Fn(&ModelSpec, &Device) -> Result<M, ModelError> + Send + Sync + 'static,
    {
        self.add(ModelEntry::new(name, summary, build))
    }

    /// Registers `entry`.
    pub fn add(&mut self, entry: ModelEntry) -> Result<&mut Self, RegistryError> {
        if !plain_name(&entry.name) {
            return Err(RegistryError::BadName(entry.name));
        }
        if self.model(&entry.name).is_some() {
            return Err(RegistryError::DuplicateModel(entry.name));
        }
        self.models.push(entry);
        Ok(self)
    }

    /// The model registered as `name`.
    pub fn model(&self, name: &str) -> Option<&ModelEntry> {
        self.models.iter().find(|entry| entry.name == name)
    }

    /// Every model, in registration order.
    pub fn models(&self) -> &[ModelEntry] {
        &self.models
    }

    /// The model `trainer.model_name` names, or the config error that says
    /// which names there are.
    pub fn model_of(&self, loaded: &LoadedConfig) -> Result<&ModelEntry, ConfigErrors> {
        let name = &loaded.config().trainer.model_name;
        self.model(name).ok_or_else(|| {
            let names: Vec<&str> = self.models.iter().map(ModelEntry::name).collect();
            loaded.error_at(
                "trainer.model_name",
                format!(
                    "unknown value `{name}`{}; expected one of: {}",
                    did_you_mean(name, names.iter().copied()),
                    names.join(", ")
                ),
            )
        })
    }

    /// The model the config names for the config's data set, after
    /// [`Registry::check`] (with the data set's declared sample shape).
    pub fn config_model(&self, loaded: &LoadedConfig) -> Result<RunModel, ConfigErrors> {
        self.config_model_in(loaded, None)
    }

    /// [`Registry::config_model`] with the data set's files under
    /// `data_root` (else `data.data_path`).
    pub fn config_model_in(
        &self,
        loaded: &LoadedConfig,
        data_root: Option<&Path>,
    ) -> Result<RunModel, ConfigErrors> {
        let dataset = self.dataset_in(loaded, data_root)?;
        self.run_model_for(loaded, &dataset, dataset.sample_shape().to_vec())
    }

    /// The model the config names, for samples of `sample_shape` and the
    /// config's `parameters.model.num_classes`, learning the task of the
    /// config's data set, after [`Registry::check`].
    pub fn run_model(
        &self,
        loaded: &LoadedConfig,
        sample_shape: Vec<usize>,
    ) -> Result<RunModel, ConfigErrors> {
        self.run_model_in(loaded, None, sample_shape)
    }

    /// [`Registry::run_model`] with the data set's files under `data_root`
    /// (else `data.data_path`): a file data set's classes come from them.
    pub fn run_model_in(
        &self,
        loaded: &LoadedConfig,
        data_root: Option<&Path>,
        sample_shape: Vec<usize>,
    ) -> Result<RunModel, ConfigErrors> {
        let dataset = self.dataset_in(loaded, data_root)?;
        self.run_model_for(loaded, &dataset, sample_shape)
    }

    /// The model the config names for `dataset` (its task and classes),
    /// for samples of `sample_shape`, after [`Registry::check`].
    pub fn run_model_for(
        &self,
        loaded: &LoadedConfig,
        dataset: &DatasetEntry,
        sample_shape: Vec<usize>,
    ) -> Result<RunModel, ConfigErrors> {
        let augmentation = dataset
            .augmentation()
            .filter(|_| loaded.config().data.augment)
            .map(|augment| Augmentation {
                augment,
                black: dataset.black(sample_shape.first().copied().unwrap_or(1)),
            });
        let model = RunModel {
            entry: self.model_of(loaded)?.clone(),
            // The config's num_classes for a fixed entry (they are equal);
            // a file data set's classes from its labels.
            spec: ModelSpec::new(sample_shape, dataset.classes()).with_options(ModelOptions::new(
                loaded.config().parameters.model.options.clone(),
            )),
            task: dataset.task().clone(),
            augmentation,
        };
        self.check(loaded, &model)?;
        Ok(model)
    }

    /// What the config asks of its model that the registry can check before
    /// anything runs: that the model exists, and that it can train
    /// vectorized where `trainer.vectorized_clients` asks for it.
    pub fn check(&self, loaded: &LoadedConfig, model: &RunModel) -> Result<(), ConfigErrors> {
        let (entry, spec) = (&model.entry, &model.spec);
        let key = "trainer.vectorized_clients";
        if let Err(refusal) = entry.check_spec(spec) {
            return Err(match refusal.option {
                Some(option) => loaded.error_at(
                    &format!("parameters.model.{option}"),
                    format!("`{}`: {}", entry.name(), refusal.error),
                ),
                None => loaded.error_at(
                    "trainer.model_name",
                    format!("`{}` {}", entry.name(), refusal.error),
                ),
            });
        }
        let build = |error: ModelError| {
            loaded.error_at("trainer.model_name", format!("`{}` {error}", entry.name()))
        };
        let rows_per_sample = model.rows_per_sample().map_err(build)?;
        if let Err(problem) = model.task.check_rows(rows_per_sample, &spec.sample_shape) {
            return Err(loaded.error_at(
                "trainer.model_name",
                format!(
                    "`{}` cannot learn data.datasource = \"{}\": {problem}",
                    entry.name(),
                    loaded.config().data.datasource
                ),
            ));
        }
        let accelerated = model.accelerated().map_err(build)?;
        let vectorized = loaded.config().trainer.vectorized_clients != VectorizedClients::Off;
        if vectorized && !model.task.is_builtin_classification() {
            return Err(loaded.error_at(
                key,
                format!(
                    "trains classification only, and data.datasource = \"{}\" is {} (set \
                     trainer.vectorized_clients = \"off\")",
                    loaded.config().data.datasource,
                    model.task.name()
                ),
            ));
        }
        if vectorized && accelerated.is_none() {
            let stacked: Vec<String> = self
                .models
                .iter()
                .filter(|m| m.accelerated(spec).ok().flatten().is_some())
                .map(|m| format!("\"{}\"", m.name()))
                .collect();
            return Err(loaded.error_at(
                key,
                format!(
                    "supports trainer.model_name = {}, not \"{}\" (set \
                     trainer.vectorized_clients = \"off\")",
                    stacked.join(" or "),
                    entry.name()
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const MINIMAL: &str = "[parameters.optimizer]\nlearning_rate = 0.01\n";

    fn loaded(trainer: &str) -> LoadedConfig {
        let text = format!("{MINIMAL}[trainer]\noptimizer = \"sgd\"\n{trainer}");
        cohort_core::config::from_str(&text, Path::new("job.toml")).unwrap()
    }

    fn mnist() -> Vec<usize> {
        vec![1, 28, 28]
    }

    #[test]
    fn a_misspelled_model_name_is_a_config_error_with_a_suggestion() {
        let error = Registry::builtin()
            .run_model(&loaded("model_name = \"lenet_5\"\n"), mnist())
            .unwrap_err();
        let error = error.first();
        assert_eq!(error.key.as_deref(), Some("trainer.model_name"));
        assert!(error.message.contains("did you mean `lenet5`?"), "{error}");
        assert!(error.message.contains("cnn_bn"), "{error}");
    }

    #[test]
    fn the_research_data_sets_load_their_fixtures_as_they_declare() {
        let registry = Registry::builtin();
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data");
        for (name, classes, task, shape) in [
            ("EMNIST", 47, "classification", vec![1, 28, 28]),
            ("CIFAR10", 10, "classification", vec![3, 32, 32]),
            ("CIFAR100", 100, "classification", vec![3, 32, 32]),
            ("FEMNIST", 62, "classification", vec![1, 28, 28]),
            ("Shakespeare", 80, "next-token prediction", vec![80]),
        ] {
            let entry = registry.dataset(name).expect(name);
            assert_eq!(
                (entry.classes(), entry.task().name(), entry.sample_shape()),
                (classes, task, &shape[..]),
                "{name}"
            );
            assert_eq!(entry.normalization().is_some(), name != "Shakespeare");
            let mut request = DataRequest {
                root: root.clone(),
                fetch: cohort_core::data::Fetch::Never,
                test_only: false,
                train_rows: None,
            };
            // `load` holds every split to the entry's shape and task.
            let both = entry.load(&request).expect(name);
            assert!(!both.train.is_empty() && !both.test.is_empty(), "{name}");
            request.test_only = true;
            let test = entry.load(&request).expect(name);
            assert_eq!((test.train.len(), &test.test), (0, &both.test), "{name}");
        }
    }

    #[test]
    fn a_misspelled_data_set_is_a_config_error_with_a_suggestion() {
        let text = format!("{MINIMAL}[data]\ndatasource = \"FashionMnist\"\n");
        let loaded = cohort_core::config::from_str(&text, Path::new("job.toml")).unwrap();
        let error = Registry::builtin().dataset_of(&loaded).unwrap_err();
        let error = error.first();
        assert_eq!(error.key.as_deref(), Some("data.datasource"));
        assert!(
            error.message.contains("did you mean `FashionMNIST`?"),
            "{error}"
        );
    }

    #[test]
    fn vectorized_clients_need_a_model_the_vectorized_trainer_implements() {
        let registry = Registry::builtin();
        let bn = loaded("model_name = \"cnn_bn\"\nvectorized_clients = 8\n");
        let error = registry.run_model(&bn, mnist()).unwrap_err();
        let error = error.first();
        assert_eq!(error.key.as_deref(), Some("trainer.vectorized_clients"));
        assert!(
            error.message.contains("\"lenet5\" or \"lenet5_compact\""),
            "{error}"
        );
        let lenet = loaded("model_name = \"lenet5_compact\"\nvectorized_clients = 8\n");
        assert!(registry.run_model(&lenet, mnist()).is_ok());
    }

    #[test]
    fn the_task_takes_its_targets_from_the_models_rows_or_refuses_them_before_a_run() {
        let run = |datasource: &str, outputs: &str| {
            let text = format!(
                "{MINIMAL}[trainer]\noptimizer = \"sgd\"\nmodel_name = \"lstm_shakespeare\"\n\
                 [data]\ndatasource = \"{datasource}\"\n[parameters.model]\noutputs = \"{outputs}\"\n"
            );
            let loaded = cohort_core::config::from_str(&text, Path::new("job.toml")).unwrap();
            Registry::builtin().run_model(&loaded, vec![80])
        };
        // LEAF's model (the token after the sequence) and a row per position
        // both learn Shakespeare's next-token task.
        let last = run("Shakespeare", "last").unwrap();
        assert_eq!(last.rows_per_sample().unwrap(), 1);
        assert_eq!(
            run("Shakespeare", "every")
                .unwrap()
                .rows_per_sample()
                .unwrap(),
            80
        );
        // Classification has one target per sample: 80 rows are refused.
        let error = run("FashionMNIST", "every").unwrap_err();
        let error = error.first();
        assert_eq!(error.key.as_deref(), Some("trainer.model_name"));
        assert!(
            error.message.contains(
                "cannot learn data.datasource = \"FashionMNIST\": classification needs a row \
                 of outputs per sample, but the model gives 80"
            ),
            "{error}"
        );
    }

    #[test]
    fn a_model_that_refuses_the_data_names_the_key_and_both_shapes() {
        let error = Registry::builtin()
            .run_model(&loaded(""), vec![3, 32, 32])
            .unwrap_err();
        let error = error.first();
        assert_eq!(error.key.as_deref(), Some("trainer.model_name"));
        assert!(error.message.contains("[3, 32, 32]"), "{error}");
    }

    #[test]
    fn model_options_reach_the_model_and_a_misspelt_one_is_an_error_naming_its_key() {
        fn with(model: &str) -> impl Fn(&str) -> Result<RunModel, ConfigErrors> + '_ {
            move |options: &str| {
                let text = format!(
                    "{MINIMAL}[trainer]\noptimizer = \"sgd\"\nmodel_name = \"{model}\"\n\
                     [parameters.model]\n{options}"
                );
                let loaded = cohort_core::config::from_str(&text, Path::new("job.toml")).unwrap();
                Registry::builtin().run_model(&loaded, vec![3, 32, 32])
            }
        }
        let group = with("resnet_20")("norm = \"group\"\n").unwrap();
        // GroupNorm has no running statistics: 269,722 parameters, none besides.
        assert_eq!(group.template().unwrap().num_elements(), 269_722);
        let error = with("resnet_20")("nrom = \"group\"\n").unwrap_err();
        let error = error.first();
        assert_eq!(error.key.as_deref(), Some("parameters.model.nrom"));
        assert!(error.message.contains("did you mean `norm`?"), "{error}");
        let error = with("resnet_20")("norm = \"layer\"\n").unwrap_err();
        assert_eq!(error.first().key.as_deref(), Some("parameters.model.norm"));
        // A model without options refuses any.
        let error = with("cnn")("norm = \"group\"\n").unwrap_err();
        let error = error.first();
        assert_eq!(error.key.as_deref(), Some("parameters.model.norm"));
        assert!(error.message.contains("takes no options"), "{error}");
    }

    #[test]
    fn a_loader_that_breaks_its_declaration_is_an_error_naming_the_data_set() {
        let mut registry = Registry::builtin();
        registry
            .add_dataset(DatasetEntry::new("bad", "", vec![2], 3, 1, |_| {
                let split = || cohort_core::data::Dataset::new(vec![0.0; 2], vec![5], vec![2]);
                Ok(Splits {
                    train: split()?,
                    test: split()?,
                    train_users: None,
                })
            }))
            .unwrap();
        let text =
            format!("{MINIMAL}[data]\ndatasource = \"bad\"\n[parameters.model]\nnum_classes = 3\n");
        let loaded = cohort_core::config::from_str(&text, Path::new("job.toml")).unwrap();
        let request = DataRequest {
            root: ".".into(),
            fetch: cohort_core::data::Fetch::Never,
            test_only: false,
            train_rows: None,
        };
        let error = registry
            .load_data(&loaded, &request)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("`bad`") && error.contains("label 5"),
            "{error}"
        );
    }

    #[test]
    fn models_of_ones_own_are_found_and_names_stay_unique() {
        let mut registry = Registry::builtin();
        registry
            .add_model("small_lenet", "LeNet-5 by another name", LeNet5::build)
            .unwrap();
        let model = registry
            .run_model(&loaded("model_name = \"small_lenet\"\n"), mnist())
            .unwrap();
        assert_eq!(model.template().unwrap().num_elements(), 61_706);
        assert_eq!(
            registry
                .add_model("lenet5", "again", LeNet5::build)
                .unwrap_err(),
            RegistryError::DuplicateModel("lenet5".to_owned())
        );
        assert!(matches!(
            registry.add_model("my model", "", LeNet5::build),
            Err(RegistryError::BadName(_))
        ));
    }
}
