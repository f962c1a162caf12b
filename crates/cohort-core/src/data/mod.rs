//! Datasets: the readers of their file formats (IDX, CIFAR's binary
//! batches, LEAF's JSON; CSV, NumPy .npz and safetensors for the file data
//! sets of [`tabular`]), the dataset catalogue, and downloads.

pub mod augment;
pub mod cifar;
pub mod download;
pub mod idx;
pub mod leaf;
pub mod own;
mod own_files;
pub mod survey;
pub mod tabular;

use std::path::{Path, PathBuf};

pub use download::{DownloadError, Fetch, KnownZip};

use cifar::{Cifar, CifarError};
use idx::{IdxError, read_idx_gz};
use leaf::{Leaf, LeafError};

/// One of cohort's own data sets: `data.datasource`, written as Plato
/// writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DataSource {
    #[serde(rename = "MNIST")]
    Mnist,
    #[serde(rename = "FashionMNIST")]
    FashionMnist,
    /// EMNIST's `balanced` split: 47 classes of digits and letters.
    #[serde(rename = "EMNIST")]
    Emnist,
    #[serde(rename = "CIFAR10")]
    Cifar10,
    #[serde(rename = "CIFAR100")]
    Cifar100,
    /// LEAF's Federated EMNIST: 62 classes, one writer a user.
    #[serde(rename = "FEMNIST")]
    Femnist,
    /// LEAF's Shakespeare: next character, one speaking role a user.
    #[serde(rename = "Shakespeare")]
    Shakespeare,
}

/// How a data set's files are written, which decides its reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Four gzip-compressed IDX files: train and test images and labels.
    Idx,
    /// CIFAR's binary batches.
    Cifar(Cifar),
    /// LEAF's JSON files, one folder a split.
    Leaf(Leaf),
}

/// How missing files are fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Obtain {
    /// Each of [`DataSource::files`] from the mirrors, as it is.
    EachFile,
    /// One archive from the mirrors, holding the files.
    Archive(DataFile),
    /// One zip from the mirrors, of known size, holding the files in one of
    /// its folders among others; streamed to disk, not held in memory.
    Zip(KnownZip),
    /// By hand only: no mirror is known whose files have a published
    /// SHA-256 cohort could check; the text says where they come from.
    ByHand(&'static str),
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

/// NIST's zip of all six EMNIST splits, with the size and SHA-256 TensorFlow
/// Datasets records for it (`url_checksums/emnist.txt`); the `balanced`
/// split's four files are in its `gzip/` folder.
pub const EMNIST_ZIP: KnownZip = KnownZip {
    name: "gzip.zip",
    size: 561_753_746,
    sha256: "fb9bb67e33772a9cc0b895e4ecf36d2cf35be8b709693c3564cea2a019fcda8e",
    folder: "gzip/",
    // The largest of the four, the training images, is 112,800 images of
    // 28 × 28 bytes and a 16-byte header (88,435,216 bytes) before gzip,
    // which adds a few bytes per 64 KiB at worst: far below 128 MiB.
    max_member_bytes: 128 << 20,
    // Six splits of four files and a mapping each, and the folder: about 31.
    max_entries: 256,
};

/// EMNIST's four files of the `balanced` split, as they are in the
/// `gzip/` folder of NIST's `gzip.zip`.
const EMNIST_FILES: [&str; 4] = [
    "emnist-balanced-train-images-idx3-ubyte.gz",
    "emnist-balanced-train-labels-idx1-ubyte.gz",
    "emnist-balanced-test-images-idx3-ubyte.gz",
    "emnist-balanced-test-labels-idx1-ubyte.gz",
];

impl DataSource {
    /// Every one of them, in the order listings show them.
    pub const ALL: [DataSource; 7] = [
        DataSource::Mnist,
        DataSource::FashionMnist,
        DataSource::Emnist,
        DataSource::Cifar10,
        DataSource::Cifar100,
        DataSource::Femnist,
        DataSource::Shakespeare,
    ];

    /// From its `data.datasource` name.
    pub fn from_name(name: &str) -> Option<Self> {
        crate::config::introspect::parse_unit_variant(name).ok()
    }

    pub fn format(self) -> Format {
        match self {
            DataSource::Mnist | DataSource::FashionMnist | DataSource::Emnist => Format::Idx,
            DataSource::Cifar10 => Format::Cifar(Cifar::Ten),
            DataSource::Cifar100 => Format::Cifar(Cifar::Hundred),
            DataSource::Femnist => Format::Leaf(Leaf::Femnist),
            DataSource::Shakespeare => Format::Leaf(Leaf::Shakespeare),
        }
    }

    /// Subfolder of `data_path` holding the files: for CIFAR the folder its
    /// archive unpacks to, for LEAF the data set's name in LEAF's own
    /// layout (`femnist/train/*.json`).
    pub fn folder(self) -> &'static str {
        match self {
            DataSource::Mnist => "mnist",
            DataSource::FashionMnist => "fashion-mnist",
            DataSource::Emnist => "emnist",
            DataSource::Cifar10 => Cifar::Ten.folder(),
            DataSource::Cifar100 => Cifar::Hundred.folder(),
            DataSource::Femnist => Leaf::Femnist.folder(),
            DataSource::Shakespeare => Leaf::Shakespeare.folder(),
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
            DataSource::Cifar10 | DataSource::Cifar100 => &["https://www.cs.toronto.edu/~kriz/"],
            DataSource::Emnist => &["https://biometrics.nist.gov/cs_links/EMNIST/"],
            DataSource::Femnist | DataSource::Shakespeare => &[],
        }
    }

    /// How missing files are fetched.
    pub fn obtain(self) -> Obtain {
        match self {
            DataSource::Mnist | DataSource::FashionMnist => Obtain::EachFile,
            DataSource::Cifar10 => Obtain::Archive(Cifar::Ten.archive()),
            DataSource::Cifar100 => Obtain::Archive(Cifar::Hundred.archive()),
            DataSource::Emnist => Obtain::Zip(EMNIST_ZIP),
            DataSource::Femnist => Obtain::ByHand(Leaf::Femnist.how_to_make()),
            DataSource::Shakespeare => Obtain::ByHand(Leaf::Shakespeare.how_to_make()),
        }
    }

    /// The files the reader opens, relative to [`DataSource::folder`]:
    /// train images, train labels, test images, test labels for IDX; the
    /// training batches then the test batch for CIFAR; nothing for LEAF,
    /// whose files are every `.json` of `train/` and `test/`. `sha256` is
    /// each file's published digest, and empty where none is published for
    /// the file itself (CIFAR's are covered by their archive's, EMNIST's by
    /// NIST's zip's).
    pub fn files(self) -> Vec<DataFile> {
        let f = |name, sha256| DataFile { name, sha256 };
        match self {
            DataSource::Mnist => vec![
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
            DataSource::FashionMnist => vec![
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
            DataSource::Emnist => EMNIST_FILES.iter().map(|name| f(name, "")).collect(),
            DataSource::Cifar10 | DataSource::Cifar100 => {
                let Format::Cifar(kind) = self.format() else {
                    unreachable!("CIFAR's format")
                };
                let names = kind.train_files().iter().copied();
                names
                    .chain([kind.test_file()])
                    .map(|name| f(name, ""))
                    .collect()
            }
            DataSource::Femnist | DataSource::Shakespeare => Vec::new(),
        }
    }

    /// Classes of the labels (for Shakespeare, the characters of LEAF's
    /// vocabulary).
    pub fn classes(self) -> usize {
        match self {
            DataSource::Mnist | DataSource::FashionMnist | DataSource::Cifar10 => 10,
            DataSource::Emnist => 47,
            DataSource::Cifar100 => 100,
            DataSource::Femnist => 62,
            DataSource::Shakespeare => leaf::VOCABULARY.chars().count(),
        }
    }

    /// Samples in the published training set, for estimates made before the
    /// files are read, such as `cohort place`'s memory need. LEAF's sets are
    /// cut by LEAF's own scripts (sampling, the train fraction), so theirs is
    /// the full set's size at LEAF's default 90 % training fraction, and
    /// [`DataSource::published_train_samples`] has none.
    pub fn train_samples(self) -> usize {
        match self {
            DataSource::Mnist | DataSource::FashionMnist => 60_000,
            DataSource::Emnist => 112_800,
            DataSource::Cifar10 | DataSource::Cifar100 => 50_000,
            DataSource::Femnist => 805_263 * 9 / 10,
            DataSource::Shakespeare => 4_226_158 * 9 / 10,
        }
    }

    /// The training set's size when it is fixed by the publication: what a
    /// config may be held against before the files are read.
    pub fn published_train_samples(self) -> Option<usize> {
        match self.format() {
            Format::Leaf(_) => None,
            Format::Idx | Format::Cifar(_) => Some(self.train_samples()),
        }
    }

    /// Values of one sample.
    pub fn pixels_per_image(self) -> usize {
        self.sample_shape().iter().product()
    }

    /// One sample's shape: `[channels, height, width]` for images,
    /// `[length]` for Shakespeare's character sequences.
    pub fn sample_shape(self) -> Vec<usize> {
        match self {
            DataSource::Mnist
            | DataSource::FashionMnist
            | DataSource::Emnist
            | DataSource::Femnist => vec![1, 28, 28],
            DataSource::Cifar10 | DataSource::Cifar100 => vec![3, 32, 32],
            DataSource::Shakespeare => vec![leaf::SEQUENCE_LENGTH],
        }
    }

    /// Per-channel mean and standard deviation of the intensities in [0, 1],
    /// as Plato's data sources normalize, so results compare one to one with
    /// Plato's; `None` for token ids, which are not normalized.
    ///
    /// MNIST and Fashion-MNIST both use MNIST's statistics (0.1307, 0.3081),
    /// as Plato does for both (Fashion-MNIST's own are about 0.2860 and
    /// 0.3530). CIFAR-10 and CIFAR-100 use ImageNet's (Plato's `cifar10.py`
    /// and `cifar100.py`); CIFAR-10's own are about (0.4914, 0.4822, 0.4465)
    /// and (0.2470, 0.2435, 0.2616). EMNIST uses (0.5, 0.5) as Plato's
    /// `emnist.py`; FEMNIST (0.9637, 0.1597) as Plato's `femnist.py`, since
    /// LEAF's values are white-background intensities (1.0 is paper).
    pub fn normalization(self) -> Option<Normalization> {
        match self {
            DataSource::Mnist | DataSource::FashionMnist => {
                Some(Normalization::single(0.1307, 0.3081))
            }
            DataSource::Emnist => Some(Normalization::single(0.5, 0.5)),
            DataSource::Cifar10 | DataSource::Cifar100 => Some(Normalization {
                mean: vec![0.485, 0.456, 0.406],
                std: vec![0.229, 0.224, 0.225],
            }),
            DataSource::Femnist => Some(Normalization::single(0.9637, 0.1597)),
            DataSource::Shakespeare => None,
        }
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

    /// The samples at `rows` (each below [`Dataset::len`]), in that order, as
    /// a data set of their own.
    pub fn rows(&self, rows: &[u32]) -> Result<Dataset, RowError> {
        if let Some(&row) = rows.iter().find(|&&row| row as usize >= self.len()) {
            return Err(RowError {
                row,
                samples: self.len(),
            });
        }
        Ok(Dataset {
            inputs: pick_rows(&self.inputs, self.values_per_sample(), rows),
            labels: pick_rows(&self.labels, 1, rows),
            sample_shape: self.sample_shape.clone(),
        })
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

/// A chosen row the split does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("row {row} was chosen, but the training split has {samples} samples")]
pub struct RowError {
    pub row: u32,
    pub samples: usize,
}

/// Which training rows a process needs, chosen from the training labels
/// (and, for data sets that have them, each sample's user) before any input
/// is converted to floats: a rank of a distributed run needs only its
/// clients' partitions, which are computed from labels alone. The rows come
/// back in ascending order, without repeats; an `Err` is the caller's reason
/// to stop, shown as it is.
pub type ChooseRows<'a> = &'a mut RowChooser<'a>;

/// The function behind [`ChooseRows`].
pub type RowChooser<'a> = dyn FnMut(&[u32], Option<&[u32]>) -> Result<Vec<u32>, String> + 'a;

/// Train and test splits.
#[derive(Debug, Clone, PartialEq)]
pub struct Splits {
    pub train: Dataset,
    pub test: Dataset,
    /// Each training sample's natural client (its user: a FEMNIST writer, a
    /// Shakespeare role), for data sets that have them:
    /// `data.sampler = "natural"` makes one client of each user.
    pub train_users: Option<Vec<u32>>,
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(transparent)]
    Idx(#[from] IdxError),
    #[error(transparent)]
    Cifar(#[from] CifarError),
    #[error(transparent)]
    Leaf(#[from] LeafError),
    #[error("{images}: {image_count} images but {labels} has {label_count} labels")]
    CountMismatch {
        images: PathBuf,
        image_count: usize,
        labels: PathBuf,
        label_count: usize,
    },
    #[error("{path}: label {label} at index {index} is outside 0..{classes}")]
    BadLabel {
        path: PathBuf,
        index: usize,
        label: u8,
        classes: usize,
    },
    #[error("{0}")]
    Missing(String),
    #[error("choosing the training rows to read: {0}")]
    Choice(String),
    #[error(transparent)]
    Row(#[from] RowError),
    #[error(transparent)]
    Download(#[from] DownloadError),
}

/// Loads both splits from `root/<folder>/`, fetching missing files when
/// `fetch` allows.
pub fn load(source: DataSource, root: &Path, fetch: &Fetch) -> Result<Splits, DataError> {
    load_inner(source, root, fetch, None)
}

/// [`load`], with only the training rows that `choose` picks from the
/// labels: the training split holds those samples, in `choose`'s order
/// (row `i` of it is training sample `rows[i]`), and `train_users`, when the
/// data set has users, still holds every sample's. IDX and CIFAR files are
/// converted to floats only for the chosen rows, so the floats of the
/// others never take memory; LEAF's JSON is parsed whole first.
pub fn load_rows(
    source: DataSource,
    root: &Path,
    fetch: &Fetch,
    choose: ChooseRows<'_>,
) -> Result<Splits, DataError> {
    load_inner(source, root, fetch, Some(choose))
}

fn load_inner(
    source: DataSource,
    root: &Path,
    fetch: &Fetch,
    choose: Option<ChooseRows<'_>>,
) -> Result<Splits, DataError> {
    let files = source.files();
    match source.format() {
        Format::Idx => {
            let folder = fetch_missing(source, root, fetch, &files)?;
            Ok(Splits {
                train: read_split_rows(source, &folder, &files[0], &files[1], choose)?,
                test: read_split(source, &folder, &files[2], &files[3])?,
                train_users: None,
            })
        }
        Format::Cifar(kind) => {
            let folder = fetch_missing(source, root, fetch, &files)?;
            let normalization = normalization_of(source);
            let (pixels, labels) = cifar::read_records(kind, &folder, kind.train_files())?;
            let (pixels, labels) =
                match choose_rows(&labels, None, choose).map_err(DataError::Choice)? {
                    Some(rows) => (
                        pick_rows(&pixels, cifar::PIXELS, &rows),
                        pick_rows(&labels, 1, &rows),
                    ),
                    None => (pixels, labels),
                };
            let train = cifar::to_dataset(pixels, labels, &normalization);
            let test = cifar::read_split(kind, &folder, &[kind.test_file()], &normalization)?;
            Ok(Splits {
                train,
                test,
                train_users: None,
            })
        }
        Format::Leaf(kind) => {
            let folder = leaf_folder(source, root, &["train", "test"])?;
            let mut splits = leaf::load(kind, &folder, source.normalization().as_ref())?.splits();
            let users = splits.train_users.as_deref();
            if let Some(rows) =
                choose_rows(&splits.train.labels, users, choose).map_err(DataError::Choice)?
            {
                splits.train = splits.train.rows(&rows)?;
            }
            Ok(splits)
        }
    }
}

/// The `width` values of each row of `values` at `rows` (each in range), in
/// that order.
fn pick_rows<T: Copy>(values: &[T], width: usize, rows: &[u32]) -> Vec<T> {
    let mut picked = Vec::with_capacity(rows.len().saturating_mul(width));
    for &row in rows {
        let start = row as usize * width;
        picked.extend_from_slice(&values[start..start + width]);
    }
    picked
}

/// `choose`'s rows of a split of `labels.len()` samples, checked to be
/// ascending and in range; every row without a `choose`.
fn choose_rows(
    labels: &[u32],
    users: Option<&[u32]>,
    choose: Option<&mut RowChooser<'_>>,
) -> Result<Option<Vec<u32>>, String> {
    let Some(choose) = choose else {
        return Ok(None);
    };
    let rows = choose(labels, users)?;
    if let Some(pair) = rows.windows(2).find(|pair| pair[0] >= pair[1]) {
        return Err(format!(
            "rows must ascend without repeats, but {} comes before {}",
            pair[0], pair[1]
        ));
    }
    if let Some(&row) = rows.last().filter(|&&row| row as usize >= labels.len()) {
        return Err(format!(
            "row {row} was chosen, but the training split has {} samples",
            labels.len()
        ));
    }
    Ok(Some(rows))
}

/// Loads the test split alone (the `t10k` files, CIFAR's test batch, LEAF's
/// `test/`), fetching them when `fetch` allows: evaluation needs nothing
/// else, so a server whose clients all bring their own data, and `cohort
/// evaluate`, work from a folder without the training set.
pub fn load_test(source: DataSource, root: &Path, fetch: &Fetch) -> Result<Dataset, DataError> {
    let files = source.files();
    match source.format() {
        Format::Idx => {
            let folder = fetch_missing(source, root, fetch, &files[2..])?;
            read_split(source, &folder, &files[2], &files[3])
        }
        Format::Cifar(kind) => {
            let folder = fetch_missing(source, root, fetch, &files[files.len() - 1..])?;
            Ok(cifar::read_split(
                kind,
                &folder,
                &[kind.test_file()],
                &normalization_of(source),
            )?)
        }
        Format::Leaf(kind) => {
            let folder = leaf_folder(source, root, &["test"])?;
            let normalization = source.normalization();
            Ok(leaf::read_split(kind, &folder.join("test"), normalization.as_ref())?.data)
        }
    }
}

fn normalization_of(source: DataSource) -> Normalization {
    source
        .normalization()
        .expect("every image data set is normalized")
}

/// `root/<folder>/` once each of `splits` (`train`, `test`) there has a
/// `.json` file: LEAF's files are made by LEAF's scripts, never downloaded.
fn leaf_folder(source: DataSource, root: &Path, splits: &[&str]) -> Result<PathBuf, DataError> {
    let folder = root.join(source.folder());
    let empty: Vec<String> = splits
        .iter()
        .filter(|split| leaf::json_files(&folder.join(split)).is_none_or(|f| f.is_empty()))
        .map(|split| format!("{split}/*.json"))
        .collect();
    if empty.is_empty() {
        return Ok(folder);
    }
    let Obtain::ByHand(how) = source.obtain() else {
        unreachable!("LEAF's files are made by hand")
    };
    Err(DataError::Missing(format!(
        "{source} data files are missing from {}: no {}.\nThey cannot be downloaded: {how}.\n\
         Put them there, or point data.data_path or COHORT_DATA_DIR at a folder that has a \
         `{}/` subfolder with them.",
        folder.display(),
        empty.join(" and no "),
        source.folder()
    )))
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
    let Fetch::FromMirrors(mirrors) = fetch else {
        return Err(DataError::Missing(missing_message(
            source,
            &folder,
            &missing,
            Some("Downloading is off (data.download = false)."),
        )));
    };
    let mirrors: Vec<String> = if mirrors.is_empty() {
        source.mirrors().iter().map(|m| m.to_string()).collect()
    } else {
        mirrors.clone()
    };
    let failed = |error: DownloadError| {
        DataError::Missing(missing_message(
            source,
            &folder,
            &missing,
            Some(&format!("Downloading them failed: {error}")),
        ))
    };
    match source.obtain() {
        Obtain::EachFile => {
            for file in &missing {
                download::fetch_verified(&mirrors, file, &folder).map_err(failed)?;
            }
        }
        Obtain::Archive(archive) => {
            let members: Vec<String> = missing
                .iter()
                .map(|f| format!("{}/{}", source.folder(), f.name))
                .collect();
            download::fetch_archive(&mirrors, &archive, &members, root).map_err(failed)?;
        }
        Obtain::Zip(zip) => {
            // The whole zip comes down for any one file, so every file of the
            // data set not yet here is taken from it, not only `files`.
            let absent: Vec<&str> = (source.files().into_iter())
                .map(|f| f.name)
                .filter(|name| !folder.join(name).is_file())
                .collect();
            download::fetch_zip(&mirrors, &zip, &absent, &folder).map_err(failed)?;
        }
        Obtain::ByHand(how) => {
            return Err(DataError::Missing(missing_message(
                source,
                &folder,
                &missing,
                Some(&format!("They cannot be downloaded: {how}.")),
            )));
        }
    }
    Ok(folder)
}

/// One split's images (normalized) and labels, checked against each other.
fn read_split(
    source: DataSource,
    folder: &Path,
    images: &DataFile,
    labels: &DataFile,
) -> Result<Dataset, DataError> {
    read_split_rows(source, folder, images, labels, None)
}

/// [`read_split`] of only the rows `choose` picks from the labels, which are
/// read and checked first.
fn read_split_rows(
    source: DataSource,
    folder: &Path,
    images: &DataFile,
    labels: &DataFile,
    choose: Option<ChooseRows<'_>>,
) -> Result<Dataset, DataError> {
    let images_path = folder.join(images.name);
    let labels_path = folder.join(labels.name);
    let label_array = read_idx_gz(&labels_path, 1)?;
    let classes = source.classes();
    if let Some((index, &label)) =
        (label_array.data.iter().enumerate()).find(|(_, l)| usize::from(**l) >= classes)
    {
        return Err(DataError::BadLabel {
            path: labels_path,
            index,
            label,
            classes,
        });
    }
    let all_labels: Vec<u32> = label_array.data.iter().map(|&l| u32::from(l)).collect();
    let image_array = read_idx_gz(&images_path, 3)?;
    if image_array.dims[0] != label_array.dims[0] {
        return Err(DataError::CountMismatch {
            images: images_path,
            image_count: image_array.dims[0],
            labels: labels_path,
            label_count: label_array.dims[0],
        });
    }
    let rows = choose_rows(&all_labels, None, choose).map_err(DataError::Choice)?;
    let (height, width) = (image_array.dims[1], image_array.dims[2]);
    let (mut pixels, labels) = match &rows {
        Some(rows) => (
            pick_rows(&image_array.data, height * width, rows),
            pick_rows(&all_labels, 1, rows),
        ),
        None => (image_array.data, all_labels),
    };
    let mut sample_shape = vec![1, height, width];
    if source == DataSource::Emnist {
        // EMNIST's IDX files hold each image transposed (column-major) with
        // respect to MNIST's; transposed back, a letter stands upright.
        pixels = transposed(&pixels, height, width);
        sample_shape = vec![1, width, height];
    }
    // One pair for the one channel; computed as one multiply and one
    // subtract, the arithmetic these data sets have always been read with,
    // so earlier runs repeat bit for bit.
    let normalization = normalization_of(source);
    let (mean, std) = (normalization.mean[0], normalization.std[0]);
    let scale = 1.0 / (255.0 * std);
    let shift = mean / std;
    let inputs: Vec<f32> = pixels.iter().map(|&p| p as f32 * scale - shift).collect();
    Ok(Dataset {
        inputs,
        labels,
        sample_shape,
    })
}

/// Each `rows` × `cols` image of `pixels` transposed to `cols` × `rows`.
fn transposed(pixels: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let plane = (rows * cols).max(1);
    let mut out = vec![0u8; pixels.len()];
    for (image, target) in pixels.chunks_exact(plane).zip(out.chunks_exact_mut(plane)) {
        for r in 0..rows {
            for c in 0..cols {
                target[c * rows + r] = image[r * cols + c];
            }
        }
    }
    out
}

fn missing_message(
    source: DataSource,
    folder: &Path,
    missing: &[DataFile],
    why: Option<&str>,
) -> String {
    let mut message = format!(
        "{source} data files are missing from {}:\n",
        folder.display()
    );
    for file in missing {
        message.push_str(&format!("  {}", file.name));
        if !file.sha256.is_empty() {
            message.push_str(&format!("  (sha256 {})", file.sha256));
        }
        message.push('\n');
    }
    if let Some(why) = why {
        message.push_str(why);
        message.push('\n');
    }
    let from = match source.obtain() {
        Obtain::Archive(archive) => format!(
            " (from {}{}, SHA-256 {}, which unpacks to `{}/`)",
            source.mirrors().first().copied().unwrap_or_default(),
            archive.name,
            archive.sha256,
            source.folder()
        ),
        Obtain::Zip(zip) => format!(
            " (they are in the `{}` folder of {}{}, {} bytes, SHA-256 {})",
            zip.folder,
            source.mirrors().first().copied().unwrap_or_default(),
            zip.name,
            zip.size,
            zip.sha256
        ),
        Obtain::EachFile => format!(" (from {})", source.mirrors().join(" or ")),
        Obtain::ByHand(_) => String::new(),
    };
    message.push_str(&format!(
        "Put these files in {}{from}, or point data.data_path or COHORT_DATA_DIR at a folder \
         that has a `{}/` subfolder with them.",
        folder.display(),
        source.folder()
    ));
    message
}

#[cfg(test)]
mod tests {
    proptest::proptest! {
        /// Transposing twice gives the images back, and once moves pixel
        /// (r, c) of a rows × cols image to (c, r).
        #[test]
        fn transposing_is_its_own_inverse(
            rows in 1usize..6,
            cols in 1usize..6,
            images in 1usize..3,
            seed in proptest::num::u8::ANY,
        ) {
            let pixels: Vec<u8> = (0..rows * cols * images)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect();
            let once = transposed(&pixels, rows, cols);
            proptest::prop_assert_eq!(transposed(&once, cols, rows), pixels.clone());
            let (r, c) = (rows - 1, 0);
            proptest::prop_assert_eq!(once[c * rows + r], pixels[r * cols + c]);
        }
    }

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
