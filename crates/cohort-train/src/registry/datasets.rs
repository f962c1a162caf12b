//! Data sets a run can name, by `data.datasource`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cohort_core::config::{ConfigErrors, LoadedConfig};
use cohort_core::data::augment::Augment;
use cohort_core::data::tabular::{self, FileFormat, FileSpec};
use cohort_core::data::{self, DataSource, Dataset, Fetch, Normalization, Splits};

use crate::task::{Classification, NextToken, Task};

/// What a data set's loader is asked for.
#[derive(Debug, Clone)]
pub struct DataRequest {
    /// `data.data_path`, or the folder the command line gives instead.
    pub root: PathBuf,
    /// Whether missing files may be downloaded, and from where.
    pub fetch: Fetch,
    /// Only the test split is needed (a server whose clients all bring their
    /// own data, `cohort evaluate`): the training split may come back empty.
    pub test_only: bool,
    /// Only these training rows are needed (a rank of a distributed run, a
    /// client process): the training split holds just them, in the order the
    /// chooser gives. [`DatasetEntry::load`] keeps the promise for every
    /// loader; one that reads only what is chosen (cohort's own IDX and CIFAR
    /// readers) also keeps the others' samples out of memory while it loads.
    pub train_rows: Option<TrainRows>,
}

type Choose = dyn Fn(&[u32], Option<&[u32]>) -> Result<Vec<u32>, String> + Send + Sync;

/// Which training rows a process needs, from the training labels and, for a
/// data set that has them, each sample's user: ascending, without repeats
/// (see [`cohort_core::data::ChooseRows`]).
#[derive(Clone)]
pub struct TrainRows(Arc<Choose>);

impl TrainRows {
    pub fn new(
        choose: impl Fn(&[u32], Option<&[u32]>) -> Result<Vec<u32>, String> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(choose))
    }

    pub fn choose(&self, labels: &[u32], users: Option<&[u32]>) -> Result<Vec<u32>, String> {
        (self.0)(labels, users)
    }
}

impl std::fmt::Debug for TrainRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TrainRows(..)")
    }
}

/// A loader's failure, shown to the user as it is (say which files, which
/// values and what was expected).
pub type LoadError = Box<dyn std::error::Error + Send + Sync>;

type Load = dyn Fn(&DataRequest) -> Result<Splits, LoadError> + Send + Sync;

/// A registered data set: its name, what a model built for it needs to know
/// before it is loaded, and its loader.
#[derive(Clone)]
pub struct DatasetEntry {
    name: String,
    summary: String,
    sample_shape: Vec<usize>,
    classes: usize,
    train_samples: usize,
    task: Arc<dyn Task>,
    normalization: Option<Normalization>,
    augmentation: Option<Augment>,
    load: Arc<Load>,
}

impl std::fmt::Debug for DatasetEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatasetEntry")
            .field("name", &self.name)
            .field("sample_shape", &self.sample_shape)
            .field("classes", &self.classes)
            .field("task", &self.task.name())
            .finish_non_exhaustive()
    }
}

impl DatasetEntry {
    /// The data set that `load` reads, under `name`: samples of
    /// `sample_shape`, labels below `classes`, about `train_samples` training
    /// samples (for estimates made before loading, such as `cohort place`'s),
    /// learned as classification unless [`DatasetEntry::with_task`] says
    /// otherwise.
    pub fn new(
        name: &str,
        summary: &str,
        sample_shape: Vec<usize>,
        classes: usize,
        train_samples: usize,
        load: impl Fn(&DataRequest) -> Result<Splits, LoadError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name: name.to_owned(),
            summary: summary.to_owned(),
            sample_shape,
            classes,
            train_samples,
            task: Arc::new(Classification),
            normalization: None,
            augmentation: None,
            load: Arc::new(load),
        }
    }

    /// How the loader normalizes image intensities in [0, 1]: own-data
    /// clients (`cohort client --data`) normalize their pixels the same way.
    /// Without it, own data's values are taken as they are.
    pub fn with_normalization(mut self, normalization: Normalization) -> Self {
        self.normalization = Some(normalization);
        self
    }

    /// Training batches cropped and flipped as `augment` says (seeded from
    /// each client's round and epoch, so runs repeat), unless the config sets
    /// `data.augment = false`. Evaluation sees the samples as they are.
    pub fn with_augmentation(mut self, augment: Augment) -> Self {
        self.augmentation = Some(augment);
        self
    }

    /// The data set learned as `task` (its loss and metrics; `classes` is
    /// then the task's outputs per row, such as a vocabulary).
    pub fn with_task(mut self, task: impl Task) -> Self {
        self.task = Arc::new(task);
        self
    }

    /// One of cohort's own data sets, read from `root/<folder>/`, with its
    /// normalization and its task (next-token prediction for Shakespeare).
    pub fn builtin(source: DataSource, summary: &str) -> Self {
        let entry = Self::new(
            &source.to_string(),
            summary,
            source.sample_shape(),
            source.classes(),
            source.train_samples(),
            move |request| {
                if request.test_only {
                    let test = data::load_test(source, &request.root, &request.fetch)?;
                    let train = Dataset {
                        inputs: Vec::new(),
                        labels: Vec::new(),
                        sample_shape: test.sample_shape.clone(),
                    };
                    return Ok(Splits {
                        train,
                        test,
                        train_users: None,
                    });
                }
                Ok(match &request.train_rows {
                    Some(rows) => data::load_rows(
                        source,
                        &request.root,
                        &request.fetch,
                        &mut |labels, users| rows.choose(labels, users),
                    )?,
                    None => data::load(source, &request.root, &request.fetch)?,
                })
            },
        );
        let entry = match source.normalization() {
            Some(normalization) => entry.with_normalization(normalization),
            None => entry,
        };
        match source {
            DataSource::Shakespeare => entry.with_task(NextToken),
            // torchvision's RandomCrop(32, padding=4) and horizontal flips,
            // as Plato trains CIFAR.
            DataSource::Cifar10 | DataSource::Cifar100 => entry.with_augmentation(Augment::CIFAR),
            _ => entry,
        }
    }

    /// The file data set `loaded` names (`data.datasource = "CSV"`, `"NPZ"`
    /// or `"Safetensors"`), read from `data.train_file` under `root`: its
    /// sample shape from the file, its classes the largest label + 1, or
    /// `parameters.model.num_classes` where the config sets it larger (a
    /// label at or above a num_classes the config sets is an error). The
    /// entry holds the splits it read, so loading it reads nothing again.
    pub fn from_file(loaded: &LoadedConfig, root: &Path) -> Result<Self, ConfigErrors> {
        let data = &loaded.config().data;
        let Some(spec) = FileSpec::of(data, root) else {
            return Err(loaded.error_at(
                "data.train_file",
                format!(
                    "`{}` reads data.train_file, which is not set",
                    data.datasource
                ),
            ));
        };
        let read = tabular::load(&spec)
            .map_err(|error| loaded.error_at("data.train_file", format!("{error}")))?;
        let classes = match loaded.num_classes_set() {
            None => read.classes,
            Some(set) if set >= read.classes => set,
            Some(set) => {
                let found = [
                    ("training", &spec.train_file, &read.splits.train),
                    (
                        "test",
                        spec.test_file.as_ref().unwrap_or(&spec.train_file),
                        &read.splits.test,
                    ),
                ]
                .into_iter()
                .find_map(|(split, file, set_of)| {
                    set_of
                        .label_out_of(set)
                        .map(|(index, label)| (split, file, index, label))
                });
                let (split, file, index, label) =
                    found.unwrap_or(("training", &spec.train_file, 0, read.classes as u32 - 1));
                return Err(loaded.error_at(
                    "parameters.model.num_classes",
                    format!(
                        "is {set}, but {}: {split} sample {index} has label {label} (labels \
                         must be below num_classes; remove it to take the file's {} classes)",
                        file.display(),
                        read.classes
                    ),
                ));
            }
        };
        let splits = Arc::new(read.splits);
        let train_samples = splits.train.len();
        let sample_shape = splits.train.sample_shape.clone();
        Ok(Self::new(
            spec.format.name(),
            spec.format.summary(),
            sample_shape,
            classes,
            train_samples,
            move |request| {
                let mut splits = Splits::clone(&splits);
                if request.test_only {
                    splits.train.inputs.clear();
                    splits.train.labels.clear();
                    splits.train_users = None;
                }
                Ok(splits)
            },
        ))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn summary(&self) -> &str {
        &self.summary
    }

    pub fn sample_shape(&self) -> &[usize] {
        &self.sample_shape
    }

    pub fn classes(&self) -> usize {
        self.classes
    }

    pub fn train_samples(&self) -> usize {
        self.train_samples
    }

    pub fn task(&self) -> &Arc<dyn Task> {
        &self.task
    }

    pub fn normalization(&self) -> Option<&Normalization> {
        self.normalization.as_ref()
    }

    pub fn augmentation(&self) -> Option<Augment> {
        self.augmentation
    }

    /// Each of `channels` channels' value of a black pixel, as the loader
    /// normalizes: what augmentation pads with.
    pub fn black(&self, channels: usize) -> Vec<f32> {
        match &self.normalization {
            Some(normalization) => data::augment::black_of(normalization, channels),
            None => vec![0.0; channels],
        }
    }

    /// Both splits (or the test split alone), checked against what the entry
    /// declares: every sample of its shape, and what its task needs (every
    /// label below its classes; for next-token prediction, every token too).
    pub fn load(&self, request: &DataRequest) -> Result<Splits, LoadError> {
        let splits = match &request.train_rows {
            Some(rows) if !request.test_only => self.load_rows(request, rows)?,
            _ => (self.load)(request)?,
        };
        for (split, set) in [("training", &splits.train), ("test", &splits.test)] {
            if set.sample_shape != self.sample_shape {
                return Err(format!(
                    "data set `{}`: its {split} samples are {:?}, but it declares {:?}",
                    self.name, set.sample_shape, self.sample_shape
                )
                .into());
            }
            let checked = set.check();
            if let Err(error) = checked {
                return Err(format!("data set `{}`, {split} split: {error}", self.name).into());
            }
            if let Err(error) = self.task.check(set, self.classes) {
                return Err(format!("data set `{}`, {split} split: {error}", self.name).into());
            }
        }
        Ok(splits)
    }

    /// The loader's splits with only the chosen training rows: its own
    /// choice when it made one, else the rows taken from what it read.
    fn load_rows(&self, request: &DataRequest, rows: &TrainRows) -> Result<Splits, LoadError> {
        let asked = Arc::new(Mutex::new(None::<usize>));
        let noted = Arc::clone(&asked);
        let inner = rows.clone();
        let request = DataRequest {
            train_rows: Some(TrainRows::new(move |labels, users| {
                let chosen = inner.choose(labels, users)?;
                *noted.lock().unwrap_or_else(|e| e.into_inner()) = Some(chosen.len());
                Ok(chosen)
            })),
            ..request.clone()
        };
        let mut splits = (self.load)(&request)?;
        let chosen = *asked.lock().unwrap_or_else(|e| e.into_inner());
        match chosen {
            Some(count) if count == splits.train.len() => {}
            Some(count) => {
                return Err(format!(
                    "data set `{}`: {count} training rows were chosen, but its loader returned {}",
                    self.name,
                    splits.train.len()
                )
                .into());
            }
            None => {
                let chosen = rows.choose(&splits.train.labels, splits.train_users.as_deref())?;
                splits.train = splits
                    .train
                    .rows(&chosen)
                    .map_err(|e| format!("data set `{}`: {e}", self.name))?;
            }
        }
        Ok(splits)
    }
}

type Resolve = dyn Fn(&LoadedConfig, &Path) -> Result<DatasetEntry, ConfigErrors> + Send + Sync;

/// A data set whose entry is derived from the config and the data folder
/// when a run names it, not fixed when it is registered: its sample shape
/// and classes come from the files (cohort's `CSV`, `NPZ` and
/// `Safetensors`, [`DatasetResolver::file`]).
#[derive(Clone)]
pub struct DatasetResolver {
    name: String,
    summary: String,
    resolve: Arc<Resolve>,
}

impl std::fmt::Debug for DatasetResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatasetResolver")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// What a file data set's entry was derived from: the same spec, classes
/// and files (by size and modification time) give the same entry.
type FileKey = (
    FileSpec,
    Option<usize>,
    Vec<Option<(u64, std::time::SystemTime)>>,
);

impl DatasetResolver {
    /// The data set named `name` whose entry `resolve` derives from the
    /// config and the data folder (`data.data_path`, or the folder the
    /// command line gives).
    pub fn new(
        name: &str,
        summary: &str,
        resolve: impl Fn(&LoadedConfig, &Path) -> Result<DatasetEntry, ConfigErrors>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self {
            name: name.to_owned(),
            summary: summary.to_owned(),
            resolve: Arc::new(resolve),
        }
    }

    /// A file data set of `format` ([`DatasetEntry::from_file`]). The last
    /// entry derived is kept, so a run that asks for it several times (its
    /// model, its data) reads the file once while the file is unchanged.
    pub fn file(format: FileFormat) -> Self {
        let last: Mutex<Option<(FileKey, DatasetEntry)>> = Mutex::new(None);
        Self::new(format.name(), format.summary(), move |loaded, root| {
            let key = FileSpec::of(&loaded.config().data, root).map(|spec| {
                let stamps = std::iter::once(&spec.train_file)
                    .chain(spec.test_file.as_ref())
                    .map(|file| {
                        let meta = std::fs::metadata(file).ok()?;
                        Some((meta.len(), meta.modified().ok()?))
                    })
                    .collect();
                (spec, loaded.num_classes_set(), stamps)
            });
            let mut last = last.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if let (Some(key), Some((kept, entry))) = (&key, last.as_ref())
                && key == kept
                && key.2.iter().all(Option::is_some)
            {
                return Ok(entry.clone());
            }
            let entry = DatasetEntry::from_file(loaded, root)?;
            if let Some(key) = key {
                *last = Some((key, entry.clone()));
            }
            Ok(entry)
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn summary(&self) -> &str {
        &self.summary
    }

    /// The entry for `loaded`, its files under `root`.
    pub fn resolve(
        &self,
        loaded: &LoadedConfig,
        root: &Path,
    ) -> Result<DatasetEntry, ConfigErrors> {
        (self.resolve)(loaded, root)
    }
}
