//! Datasets: the IDX reader, the dataset catalogue, and downloads.

pub mod download;
pub mod idx;
pub mod own;
pub mod survey;

use std::path::{Path, PathBuf};

pub use download::{DownloadError, Fetch};

use idx::{IdxError, read_idx_gz};

/// A dataset of the MNIST family: `data.datasource`, written as Plato writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DataSource {
    #[serde(rename = "MNIST")]
    Mnist,
    #[serde(rename = "FashionMNIST")]
    FashionMnist,
}

impl std::fmt::Display for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&crate::config::introspect::unit_variant_name(self))
    }
}

/// One file of a dataset with its SHA-256.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataFile {
    pub name: &'static str,
    pub sha256: &'static str,
}

impl DataSource {
    /// From its `data.datasource` name.
    pub fn from_name(name: &str) -> Option<Self> {
        crate::config::introspect::parse_unit_variant(name).ok()
    }

    /// Subfolder of `data_path` holding the files.
    pub fn folder(self) -> &'static str {
        match self {
            DataSource::Mnist => "mnist",
            DataSource::FashionMnist => "fashion-mnist",
        }
    }

    /// Standard public mirrors, tried in order.
    pub fn mirrors(self) -> &'static [&'static str] {
        match self {
            DataSource::Mnist => &[
                "https://ossci-datasets.s3.amazonaws.com/mnist/",
                "https://storage.googleapis.com/cvdf-datasets/mnist/",
            ],
            DataSource::FashionMnist => {
                &["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"]
            }
        }
    }

    /// Train images, train labels, test images, test labels.
    pub fn files(self) -> [DataFile; 4] {
        let f = |name, sha256| DataFile { name, sha256 };
        match self {
            DataSource::Mnist => [
                f(
                    "train-images-idx3-ubyte.gz",
                    "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
                ),
                f(
                    "train-labels-idx1-ubyte.gz",
                    "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
                ),
                f(
                    "t10k-images-idx3-ubyte.gz",
                    "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
                ),
                f(
                    "t10k-labels-idx1-ubyte.gz",
                    "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
                ),
            ],
            DataSource::FashionMnist => [
                f(
                    "train-images-idx3-ubyte.gz",
                    "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
                ),
                f(
                    "train-labels-idx1-ubyte.gz",
                    "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
                ),
                f(
                    "t10k-images-idx3-ubyte.gz",
                    "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
                ),
                f(
                    "t10k-labels-idx1-ubyte.gz",
                    "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
                ),
            ],
        }
    }

    /// Images in the published training set (60,000 for both), for estimates
    /// made before the files are read, such as `cohort place`'s memory need.
    pub fn train_samples(self) -> usize {
        match self {
            DataSource::Mnist | DataSource::FashionMnist => 60_000,
        }
    }

    /// Pixels of one image (28 × 28 for both).
    pub fn pixels_per_image(self) -> usize {
        self.sample_shape().iter().product()
    }

    /// One sample's shape, `[channels, height, width]`.
    pub fn sample_shape(self) -> Vec<usize> {
        match self {
            DataSource::Mnist | DataSource::FashionMnist => vec![1, 28, 28],
        }
    }

    /// Mean and standard deviation of the pixel intensities in [0, 1].
    ///
    /// Both use MNIST's statistics (0.1307, 0.3081), as Plato does for both
    /// datasets, so results compare one to one with Plato and with
    /// `torch_r1.py`. (Fashion-MNIST's own are about 0.2860 and 0.3530.)
    pub fn normalization(self) -> (f32, f32) {
        (0.1307, 0.3081)
    }
}

/// Per-channel normalization of intensities in [0, 1]: `(x - mean) / std`,
/// channel `c` of a `[channels, ...]` sample taking `mean[c]` and `std[c]`,
/// or every value the one pair when there is one.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalization {
    pub mean: Vec<f32>,
    pub std: Vec<f32>,
}

impl Normalization {
    /// One mean and standard deviation for every value.
    pub fn single(mean: f32, std: f32) -> Self {
        Self {
            mean: vec![mean],
            std: vec![std],
        }
    }

    /// Normalizes `values`, samples of `sample_shape` one after another; an
    /// error, leaving them as they were, when there are several pairs but not
    /// one per channel (`sample_shape[0]`).
    pub fn apply(&self, values: &mut [f32], sample_shape: &[usize]) -> Result<(), String> {
        if let ([mean], [std]) = (self.mean.as_slice(), self.std.as_slice()) {
            values.iter_mut().for_each(|x| *x = (*x - mean) / std);
            return Ok(());
        }
        let channels = sample_shape.first().copied().unwrap_or(1);
        if self.mean.len() != channels || self.std.len() != channels {
            return Err(format!(
                "{} means and {} standard deviations do not normalize samples of {sample_shape:?} \
                 ({channels} channels)",
                self.mean.len(),
                self.std.len()
            ));
        }
        let plane: usize = sample_shape[1..].iter().product();
        for (index, chunk) in values.chunks_mut(plane.max(1)).enumerate() {
            let channel = index % channels;
            let (mean, std) = (self.mean[channel], self.std[channel]);
            chunk.iter_mut().for_each(|x| *x = (*x - mean) / std);
        }
        Ok(())
    }
}

/// Samples of any shape, normalized to float32, with one class id each.
///
/// Sample `i` is `inputs[i * n .. (i + 1) * n]` with `n` the product of
/// `sample_shape`, row-major: `[channels, height, width]` for images, `[features]`
/// for tabular rows, `[length]` for token sequences (token ids as exact
/// float32 integers). `labels[i]` is its target: the class of a classification
/// task, the next token of a next-token task.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    pub inputs: Vec<f32>,
    pub labels: Vec<u32>,
    pub sample_shape: Vec<usize>,
}

impl Dataset {
    /// A dataset after checking that `inputs` holds one sample of
    /// `sample_shape` per label.
    pub fn new(
        inputs: Vec<f32>,
        labels: Vec<u32>,
        sample_shape: Vec<usize>,
    ) -> Result<Self, ShapeError> {
        let dataset = Self {
            inputs,
            labels,
            sample_shape,
        };
        dataset.check()?;
        Ok(dataset)
    }

    /// That `inputs` holds one sample of `sample_shape` per label (the
    /// fields are public, so a data set made by hand is checked here).
    pub fn check(&self) -> Result<(), ShapeError> {
        let per_sample = self
            .sample_shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&n| n > 0)
            .ok_or_else(|| ShapeError::SampleShape(self.sample_shape.clone()))?;
        if per_sample.checked_mul(self.labels.len()) != Some(self.inputs.len()) {
            return Err(ShapeError::Count {
                values: self.inputs.len(),
                labels: self.labels.len(),
                sample_shape: self.sample_shape.clone(),
            });
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Values of one sample: the product of `sample_shape`.
    pub fn values_per_sample(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// Copies the inputs and labels at `indices` into `inputs` and `labels`
    /// (cleared first), ready to become a batch tensor.
    pub fn gather(&self, indices: &[u32], inputs: &mut Vec<f32>, labels: &mut Vec<i64>) {
        let per_sample = self.values_per_sample();
        inputs.clear();
        labels.clear();
        inputs.reserve(indices.len() * per_sample);
        for &index in indices {
            let start = index as usize * per_sample;
            inputs.extend_from_slice(&self.inputs[start..start + per_sample]);
            labels.push(i64::from(self.labels[index as usize]));
        }
    }

    /// The first label at or above `classes`, with its index.
    pub fn label_out_of(&self, classes: usize) -> Option<(usize, u32)> {
        self.labels
            .iter()
            .enumerate()
            .find(|(_, label)| **label as usize >= classes)
            .map(|(index, &label)| (index, label))
    }
}

/// Why values and labels do not make a [`Dataset`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    #[error("sample shape {0:?} has no values (or more than fit in memory)")]
    SampleShape(Vec<usize>),
    #[error("{values} values are not {labels} samples of shape {sample_shape:?}")]
    Count {
        values: usize,
        labels: usize,
        sample_shape: Vec<usize>,
    },
}

/// Train and test splits.
#[derive(Debug, Clone, PartialEq)]
pub struct Splits {
    pub train: Dataset,
    pub test: Dataset,
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(transparent)]
    Idx(#[from] IdxError),
    #[error("{images}: {image_count} images but {labels} has {label_count} labels")]
    CountMismatch {
        images: PathBuf,
        image_count: usize,
        labels: PathBuf,
        label_count: usize,
    },
    #[error("{path}: label {label} at index {index} is outside 0..10")]
    BadLabel {
        path: PathBuf,
        index: usize,
        label: u8,
    },
    #[error("{0}")]
    Missing(String),
    #[error(transparent)]
    Download(#[from] DownloadError),
}

/// Loads both splits from `root/<folder>/`, fetching missing files when
/// `fetch` allows.
pub fn load(source: DataSource, root: &Path, fetch: &Fetch) -> Result<Splits, DataError> {
    let files = source.files();
    let folder = fetch_missing(source, root, fetch, &files)?;
    Ok(Splits {
        train: read_split(source, &folder, &files[0], &files[1])?,
        test: read_split(source, &folder, &files[2], &files[3])?,
    })
}

/// Loads the test split alone (the `t10k` files), fetching them when `fetch`
/// allows: evaluation needs nothing else, so a server whose clients all bring
/// their own data, and `cohort evaluate`, work from a folder without the
/// training set.
pub fn load_test(source: DataSource, root: &Path, fetch: &Fetch) -> Result<Dataset, DataError> {
    let [_, _, images, labels] = source.files();
    let folder = fetch_missing(source, root, fetch, &[images, labels])?;
    read_split(source, &folder, &images, &labels)
}

/// `root/<folder>/` once each of `files` is there, downloaded if need be.
fn fetch_missing(
    source: DataSource,
    root: &Path,
    fetch: &Fetch,
    files: &[DataFile],
) -> Result<PathBuf, DataError> {
    let folder = root.join(source.folder());
    let missing: Vec<DataFile> = files
        .iter()
        .copied()
        .filter(|f| !folder.join(f.name).is_file())
        .collect();
    if missing.is_empty() {
        return Ok(folder);
    }
    match fetch {
        Fetch::Never => Err(DataError::Missing(missing_message(
            source, &folder, &missing, None,
        ))),
        Fetch::FromMirrors(mirrors) => {
            let mirrors: Vec<String> = if mirrors.is_empty() {
                source.mirrors().iter().map(|m| m.to_string()).collect()
            } else {
                mirrors.clone()
            };
            for file in &missing {
                if let Err(error) = download::fetch_verified(&mirrors, file, &folder) {
                    return Err(DataError::Missing(missing_message(
                        source,
                        &folder,
                        &missing,
                        Some(&error),
                    )));
                }
            }
            Ok(folder)
        }
    }
}

/// One split's images (normalized) and labels, checked against each other.
fn read_split(
    source: DataSource,
    folder: &Path,
    images: &DataFile,
    labels: &DataFile,
) -> Result<Dataset, DataError> {
    let (mean, std) = source.normalization();
    let images_path = folder.join(images.name);
    let labels_path = folder.join(labels.name);
    let image_array = read_idx_gz(&images_path, 3)?;
    let label_array = read_idx_gz(&labels_path, 1)?;
    if image_array.dims[0] != label_array.dims[0] {
        return Err(DataError::CountMismatch {
            images: images_path,
            image_count: image_array.dims[0],
            labels: labels_path,
            label_count: label_array.dims[0],
        });
    }
    if let Some((index, &label)) = label_array.data.iter().enumerate().find(|(_, l)| **l >= 10) {
        return Err(DataError::BadLabel {
            path: labels_path,
            index,
            label,
        });
    }
    let scale = 1.0 / (255.0 * std);
    let shift = mean / std;
    Ok(Dataset {
        inputs: image_array
            .data
            .iter()
            .map(|&p| p as f32 * scale - shift)
            .collect(),
        labels: label_array.data.into_iter().map(u32::from).collect(),
        sample_shape: vec![1, image_array.dims[1], image_array.dims[2]],
    })
}

fn missing_message(
    source: DataSource,
    folder: &Path,
    missing: &[DataFile],
    error: Option<&DownloadError>,
) -> String {
    let mut message = format!(
        "{source:?} data files are missing from {}:\n",
        folder.display()
    );
    for file in missing {
        message.push_str(&format!("  {}  (sha256 {})\n", file.name, file.sha256));
    }
    match error {
        Some(error) => message.push_str(&format!("Downloading them failed: {error}\n")),
        None => message.push_str("Downloading is off (data.download = false).\n"),
    }
    message.push_str(&format!(
        "Put these files in {} (from {}), or point data.data_path or COHORT_DATA_DIR at a folder \
         that has a `{}/` subfolder with them.",
        folder.display(),
        source.mirrors().join(" or "),
        source.folder()
    ));
    message
}

#[cfg(test)]
mod tests {
    #[test]
    fn normalization_is_per_channel_or_one_pair_for_all() {
        let mut values = vec![0.5, 0.5, 1.0, 1.0, 0.5, 0.5, 1.0, 1.0];
        let per_channel = Normalization {
            mean: vec![0.5, 0.0],
            std: vec![0.25, 0.5],
        };
        per_channel.apply(&mut values, &[2, 1, 2]).unwrap();
        assert_eq!(values, [0.0, 0.0, 2.0, 2.0, 0.0, 0.0, 2.0, 2.0]);
        let mut values = vec![1.0, 0.0];
        Normalization::single(0.5, 0.5)
            .apply(&mut values, &[1, 1, 2])
            .unwrap();
        assert_eq!(values, [1.0, -1.0]);
        let error = per_channel.apply(&mut values, &[3, 1, 1]).unwrap_err();
        assert!(
            error.contains("2 means and 2 standard deviations"),
            "{error}"
        );
        assert_eq!(values, [1.0, -1.0], "left as they were");
    }

    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data")
    }

    #[test]
    fn the_test_split_loads_from_a_folder_without_the_training_set() {
        let dir = tempfile::tempdir().unwrap();
        let source = DataSource::FashionMnist;
        let folder = dir.path().join(source.folder());
        std::fs::create_dir_all(&folder).unwrap();
        for file in &source.files()[2..] {
            let from = fixture().join(source.folder()).join(file.name);
            std::fs::copy(from, folder.join(file.name)).unwrap();
        }
        let test = load_test(source, dir.path(), &Fetch::Never).unwrap();
        let both = load(source, &fixture(), &Fetch::Never).unwrap();
        assert_eq!(test, both.test);

        let error = load(source, dir.path(), &Fetch::Never)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("train-images-idx3-ubyte.gz") && !error.contains("t10k-images"),
            "{error}"
        );
    }
}
