//! Data sets a run can name, by `data.datasource`.

use std::path::PathBuf;
use std::sync::Arc;

use cohort_core::data::{self, DataSource, Dataset, Fetch, Splits};

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
    load: Arc<Load>,
}

impl std::fmt::Debug for DatasetEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatasetEntry")
            .field("name", &self.name)
            .field("sample_shape", &self.sample_shape)
            .field("classes", &self.classes)
            .finish_non_exhaustive()
    }
}

impl DatasetEntry {
    /// The data set that `load` reads, under `name`: samples of
    /// `sample_shape`, labels below `classes`, about `train_samples` training
    /// samples (for estimates made before loading, such as `cohort place`'s).
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
            load: Arc::new(load),
        }
    }

    /// One of cohort's own data sets, read from `root/<folder>/`.
    pub fn builtin(source: DataSource, summary: &str) -> Self {
        Self::new(
            &source.to_string(),
            summary,
            source.sample_shape(),
            10,
            source.train_samples(),
            move |request| {
                if request.test_only {
                    let test = data::load_test(source, &request.root, &request.fetch)?;
                    let train = Dataset {
                        inputs: Vec::new(),
                        labels: Vec::new(),
                        sample_shape: test.sample_shape.clone(),
                    };
                    return Ok(Splits { train, test });
                }
                Ok(data::load(source, &request.root, &request.fetch)?)
            },
        )
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

    /// Both splits (or the test split alone), checked against what the entry
    /// declares: every sample of its shape, every label below its classes.
    pub fn load(&self, request: &DataRequest) -> Result<Splits, LoadError> {
        let splits = (self.load)(request)?;
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
            if let Some((index, label)) = set.label_out_of(self.classes) {
                return Err(format!(
                    "data set `{}`, {split} split: label {label} at sample {index} is outside \
                     0..{}",
                    self.name, self.classes
                )
                .into());
            }
        }
        Ok(splits)
    }
}
