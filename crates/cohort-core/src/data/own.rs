//! A client's own data set (`cohort client --data PATH`): what a client that
//! does not take a partition of the run's shared data trains on.
//!
//! Every format of the run's data sets, each checked in full before the
//! client registers, so that the sample counts it declares are the ones it
//! holds. IDX and safetensors are read here; CIFAR's binary batches, LEAF's
//! JSON, CSV and NPZ by their data sets' own readers (`own_files.rs`):
//!
//! * **a folder of IDX files**, named as MNIST names them:
//!   `train-images-idx3-ubyte` and `train-labels-idx1-ubyte`, and for held-out
//!   evaluation optionally `t10k-images-idx3-ubyte` and
//!   `t10k-labels-idx1-ubyte`; each plain or gzip-compressed (`.gz`); images
//!   `[N, height, width]` of uint8 pixels;
//! * **a safetensors file** (what `safetensors.numpy.save_file` writes):
//!   `images` or `inputs` `[N, ...]` and `labels` (uint8 or int64 `[N]`),
//!   optionally `test_images`/`test_inputs` and `test_labels` of the same
//!   kinds. Inputs are uint8 pixels (0–255), float32 values, or int64 token
//!   ids;
//! * **a folder of CIFAR's binary batches**, named as the archives name them:
//!   CIFAR-10's `data_batch_N.bin` (any number of them) and optionally
//!   `test_batch.bin`, or CIFAR-100's `train.bin` and optionally `test.bin`;
//! * **a folder in LEAF's layout**: `train/*.json` and optionally
//!   `test/*.json`, FEMNIST's or Shakespeare's (told apart by the samples),
//!   every user's samples this one client's;
//! * **a `.csv` file** (a header row, a label column, `label` unless
//!   `cohort client --label-column` names another, numeric features) or an
//!   **`.npz` file** (`x`, `y`, optionally `x_test`, `y_test`), as the CSV
//!   and NPZ data sets read them; their features are float32 values.
//!
//! The samples must have the shape of the server's data set (`[N, H, W]`
//! stands for one channel, `[N, 1, H, W]`). Pixels become intensities in
//! [0, 1]; where the server's data set normalizes its images, intensities
//! (pixels, or float32 in [0, 1]) are normalized the same way, and float32
//! inputs of a data set that does not are taken as they are. All of this
//! happens in [`OwnData::into_dataset`], once the client knows the run's data
//! set. Every error names the file, the tensor and what was expected; nothing
//! here panics on a malformed file.

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::idx::{IdxError, read_idx, read_idx_dims};
use super::own_files;
use super::tabular::FileFormat;
use super::{Dataset, Normalization};

/// A CSV file's label column unless the client names another
/// (`cohort client --label-column`), as `data.label_column`'s default.
pub const DEFAULT_LABEL_COLUMN: &str = "label";

/// The largest token id held exactly by a float32 sample value.
const MAX_TOKEN: i64 = 1 << 24;

/// Training and (optional) held-out samples, as read from the file.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnData {
    /// The folder or file it was read from, for messages.
    pub source: PathBuf,
    pub train: Samples,
    pub test: Option<Samples>,
}

/// Samples of one split: `values` row-major, `shape` per sample as the file
/// has it, with labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Samples {
    pub values: Vec<f32>,
    pub labels: Vec<u32>,
    pub shape: Vec<usize>,
    pub encoding: Encoding,
}

/// What a file's input values are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// uint8 pixels, held as intensities in [0, 1].
    Pixels,
    /// float32 values as the file has them.
    Floats,
    /// int64 token ids, held as exact float32 integers.
    Tokens,
}

impl Samples {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

/// What the server's data set is, for [`OwnData::into_dataset`].
#[derive(Debug, Clone, Copy)]
pub struct Expected<'a> {
    /// One sample's shape.
    pub sample_shape: &'a [usize],
    /// Labels are below this (`parameters.model.num_classes`).
    pub classes: usize,
    /// How the data set normalizes intensities, if it does.
    pub normalization: Option<&'a Normalization>,
    /// The data set's name, for messages.
    pub datasource: &'a str,
}

#[derive(Debug, thiserror::Error)]
pub enum OwnDataError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Idx(#[from] IdxError),
    #[error(transparent)]
    Cifar(#[from] super::cifar::CifarError),
    #[error(transparent)]
    Leaf(#[from] super::leaf::LeafError),
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

pub(super) fn invalid(path: &Path, reason: impl Into<String>) -> OwnDataError {
    OwnDataError::Invalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

impl OwnData {
    /// Reads a folder of IDX files or a safetensors file of at most
    /// `max_samples` samples in either split: counted from the headers before
    /// anything is allocated for them, so a small file that claims millions
    /// of images is refused, not read.
    pub fn load(path: &Path, max_samples: u64) -> Result<Self, OwnDataError> {
        Self::load_with(path, max_samples, DEFAULT_LABEL_COLUMN)
    }

    /// [`OwnData::load`], with `label_column` naming a CSV file's labels.
    /// The format follows the path: a folder of IDX files, of CIFAR's binary
    /// batches or of LEAF's `train/` (and `test/`) JSON; a `.csv` or `.npz`
    /// file as the file data sets read them; any other file as safetensors.
    pub fn load_with(
        path: &Path,
        max_samples: u64,
        label_column: &str,
    ) -> Result<Self, OwnDataError> {
        let extension = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_lowercase);
        let loaded = if path.is_dir() {
            match own_files::load_cifar_folder(path, max_samples)? {
                Some(loaded) => loaded,
                None => match own_files::load_leaf_folder(path, max_samples)? {
                    Some(loaded) => loaded,
                    None => load_idx_folder(path, max_samples)?,
                },
            }
        } else if extension.as_deref() == Some("csv") {
            own_files::load_table(path, FileFormat::Csv, label_column, max_samples)?
        } else if extension.as_deref() == Some("npz") {
            own_files::load_table(path, FileFormat::Npz, label_column, max_samples)?
        } else {
            load_safetensors(path, max_samples)?
        };
        if loaded.train.is_empty() {
            return Err(invalid(path, "holds no training samples"));
        }
        Ok(loaded)
    }

    /// Held-out samples (0 without a test split).
    pub fn test_len(&self) -> usize {
        self.test.as_ref().map_or(0, Samples::len)
    }

    /// One [`Dataset`] shaped and normalized as the server's data set
    /// (`expected`): the training samples first (indices `0..train`), then
    /// the held-out ones, so a client's partition and held-out lists are
    /// index ranges of the same data set.
    pub fn into_dataset(self, expected: Expected<'_>) -> Result<Dataset, OwnDataError> {
        let mut values = prepare(
            &self.source,
            "training",
            self.train.values,
            &self.train.shape,
            self.train.encoding,
            expected,
        )?;
        let mut labels = self.train.labels;
        if let Some(test) = self.test {
            values.extend(prepare(
                &self.source,
                "held-out",
                test.values,
                &test.shape,
                test.encoding,
                expected,
            )?);
            labels.extend(test.labels);
        }
        if let Some((index, label)) = labels
            .iter()
            .enumerate()
            .find(|(_, label)| **label as usize >= expected.classes)
        {
            return Err(invalid(
                &self.source,
                format!(
                    "label {label} at sample {index} (training samples first, then held-out \
                     ones) is outside 0..{} (the run's parameters.model.num_classes)",
                    expected.classes
                ),
            ));
        }
        Dataset::new(values, labels, expected.sample_shape.to_vec())
            .map_err(|error| invalid(&self.source, error.to_string()))
    }
}

/// One split's values as the server's data set holds its samples: its shape
/// checked, intensities normalized where the data set normalizes.
fn prepare(
    source: &Path,
    split: &str,
    mut values: Vec<f32>,
    shape: &[usize],
    encoding: Encoding,
    expected: Expected<'_>,
) -> Result<Vec<f32>, OwnDataError> {
    let wanted = expected.sample_shape;
    let fits = shape == wanted || (wanted.first() == Some(&1) && shape == &wanted[1..]);
    if !fits {
        return Err(invalid(
            source,
            format!(
                "{split} samples of shape {shape:?}, but the server's data set `{}` has samples \
                 of {wanted:?}",
                expected.datasource
            ),
        ));
    }
    match (encoding, expected.normalization) {
        (Encoding::Tokens, Some(_)) => Err(invalid(
            source,
            format!(
                "{split} samples are token ids, but the server's data set `{}` holds images \
                 (uint8 pixels or float32 intensities)",
                expected.datasource
            ),
        )),
        (Encoding::Pixels | Encoding::Floats, Some(normalization)) => {
            if encoding == Encoding::Floats {
                check_intensities(source, split, &values)?;
            }
            normalization.apply(&mut values, wanted).map_err(|error| {
                invalid(
                    source,
                    format!("the server's data set `{}`: {error}", expected.datasource),
                )
            })?;
            Ok(values)
        }
        (_, None) => Ok(values),
    }
}

/// Float32 inputs of a data set that normalizes are intensities in [0, 1].
fn check_intensities(path: &Path, split: &str, values: &[f32]) -> Result<(), OwnDataError> {
    match values.iter().position(|v| !(0.0..=1.0).contains(v)) {
        Some(index) => Err(invalid(
            path,
            format!(
                "float32 value {} at element {index} of the {split} samples is not an \
                 intensity in [0, 1], which the server's data set normalizes (divide uint8 pixels \
                 by 255, or save them as uint8)",
                values[index]
            ),
        )),
        None => Ok(()),
    }
}

const IDX_NAMES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

/// `folder/name` or `folder/name.gz`, whichever exists.
fn idx_file(folder: &Path, name: &str) -> Option<PathBuf> {
    [folder.join(name), folder.join(format!("{name}.gz"))]
        .into_iter()
        .find(|path| path.is_file())
}

fn load_idx_folder(folder: &Path, max_samples: u64) -> Result<OwnData, OwnDataError> {
    let files = IDX_NAMES.map(|name| idx_file(folder, name));
    let [Some(images), Some(labels), test_images, test_labels] = files else {
        return Err(invalid(
            folder,
            format!(
                "a data folder needs {} and {} (plain or .gz), and optionally {} and {} for \
                 held-out evaluation",
                IDX_NAMES[0], IDX_NAMES[1], IDX_NAMES[2], IDX_NAMES[3]
            ),
        ));
    };
    let test = match (test_images, test_labels) {
        (Some(images), Some(labels)) => Some(read_idx_pair(&images, &labels, max_samples)?),
        (None, None) => None,
        _ => {
            return Err(invalid(
                folder,
                format!(
                    "held-out data needs both {} and {}, found one",
                    IDX_NAMES[2], IDX_NAMES[3]
                ),
            ));
        }
    };
    Ok(OwnData {
        source: folder.to_path_buf(),
        train: read_idx_pair(&images, &labels, max_samples)?,
        test: test.filter(|t| !t.is_empty()),
    })
}

fn read_idx_pair(
    images_path: &Path,
    labels_path: &Path,
    max_samples: u64,
) -> Result<Samples, OwnDataError> {
    let declared = read_idx_dims(images_path, 3)?[0];
    check_count(images_path, declared, max_samples)?;
    let images = read_idx(images_path, 3)?;
    let labels = read_idx(labels_path, 1)?;
    if images.dims[0] != labels.dims[0] {
        return Err(invalid(
            labels_path,
            format!(
                "{} labels, but {} has {} images",
                labels.dims[0],
                images_path.display(),
                images.dims[0]
            ),
        ));
    }
    Ok(Samples {
        values: pixels(images_path, &images.data)?,
        labels: labels.data.into_iter().map(u32::from).collect(),
        shape: images.dims[1..].to_vec(),
        encoding: Encoding::Pixels,
    })
}

/// More samples than the client accepts are refused by name.
pub(super) fn check_count(path: &Path, count: usize, max_samples: u64) -> Result<(), OwnDataError> {
    if count as u64 > max_samples {
        return Err(invalid(
            path,
            format!(
                "{count} samples, more than the {max_samples} this client accepts \
                 (cohort client --max-samples)"
            ),
        ));
    }
    Ok(())
}

/// `count` float32 values, allocated fallibly: a data set too large for
/// this machine's memory is an error, not an abort.
fn reserve(path: &Path, count: usize) -> Result<Vec<f32>, OwnDataError> {
    let mut values = Vec::new();
    values.try_reserve_exact(count).map_err(|_| {
        invalid(
            path,
            format!("{count} values do not fit this machine's memory as float32"),
        )
    })?;
    Ok(values)
}

/// uint8 pixels as intensities in [0, 1].
pub(super) fn pixels(path: &Path, data: &[u8]) -> Result<Vec<f32>, OwnDataError> {
    let mut values = reserve(path, data.len())?;
    values.extend(data.iter().map(|&p| f32::from(p) / 255.0));
    Ok(values)
}

fn load_safetensors(path: &Path, max_samples: u64) -> Result<OwnData, OwnDataError> {
    let bytes =
        crate::fsutil::read_bounded(path, crate::fsutil::MAX_READ_BYTES).map_err(|source| {
            OwnDataError::Io {
                path: path.to_path_buf(),
                source,
            }
        })?;
    let file = SafeTensors::deserialize(&bytes).map_err(|error| {
        invalid(
            path,
            format!(
                "neither a folder of IDX files nor a valid safetensors file ({error}); \
                 write one with safetensors.numpy.save_file({{\"images\": ..., \"labels\": ...}}, PATH)"
            ),
        )
    })?;
    // `images` or `inputs`, whichever the file has (both is ambiguous).
    let inputs =
        |names: [&'static str; 2]| -> Result<Option<(&'static str, TensorView<'_>)>, OwnDataError> {
            match names.map(|name| file.tensor(name).ok()) {
                [Some(_), Some(_)] => Err(invalid(
                    path,
                    format!("has both `{}` and `{}`; keep one", names[0], names[1]),
                )),
                [Some(view), None] => Ok(Some((names[0], view))),
                [None, Some(view)] => Ok(Some((names[1], view))),
                [None, None] => Ok(None),
            }
        };
    let get = |name: &'static str| file.tensor(name).ok().map(|view| (name, view));
    let train = match (inputs(["images", "inputs"])?, get("labels")) {
        (Some(images), Some(labels)) => samples(path, images, labels, max_samples)?,
        _ => {
            return Err(invalid(
                path,
                format!(
                    "needs tensors `images` (or `inputs`) and `labels` (and optionally \
                     `test_images` and `test_labels`); it has {:?}",
                    file.names()
                ),
            ));
        }
    };
    let test = match (inputs(["test_images", "test_inputs"])?, get("test_labels")) {
        (Some(images), Some(labels)) => Some(samples(path, images, labels, max_samples)?),
        (None, None) => None,
        _ => {
            return Err(invalid(
                path,
                "held-out data needs both `test_images` (or `test_inputs`) and `test_labels`, \
                 found one",
            ));
        }
    };
    Ok(OwnData {
        source: path.to_path_buf(),
        train,
        test: test.filter(|t| !t.is_empty()),
    })
}

fn samples(
    path: &Path,
    (inputs_name, inputs): (&str, TensorView<'_>),
    (labels_name, labels): (&str, TensorView<'_>),
    max_samples: u64,
) -> Result<Samples, OwnDataError> {
    let shape = inputs.shape();
    let Some((&count, sample_shape)) = shape.split_first().filter(|(_, rest)| !rest.is_empty())
    else {
        return Err(invalid(
            path,
            format!(
                "tensor `{inputs_name}` has shape {shape:?}, expected [N, ...] (one row per sample)"
            ),
        ));
    };
    check_count(path, count, max_samples)?;
    if labels.shape() != [count] {
        return Err(invalid(
            path,
            format!(
                "tensor `{labels_name}` has shape {:?}, expected [{count}] (one label per sample \
                 of `{inputs_name}`)",
                labels.shape()
            ),
        ));
    }
    let (values, encoding) = match inputs.dtype() {
        Dtype::U8 => (pixels(path, inputs.data())?, Encoding::Pixels),
        Dtype::F32 => (floats(path, inputs_name, inputs.data())?, Encoding::Floats),
        Dtype::I64 => (tokens(path, inputs_name, inputs.data())?, Encoding::Tokens),
        other => {
            return Err(invalid(
                path,
                format!(
                    "tensor `{inputs_name}` is {other:?}, expected uint8 (pixels), float32 or \
                     int64 (token ids)"
                ),
            ));
        }
    };
    Ok(Samples {
        values,
        labels: label_values(path, labels_name, &labels)?,
        shape: sample_shape.to_vec(),
        encoding,
    })
}

fn little_endian_i64(bytes: &[u8]) -> i64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(bytes);
    i64::from_le_bytes(word)
}

fn label_values(
    path: &Path,
    name: &str,
    labels: &TensorView<'_>,
) -> Result<Vec<u32>, OwnDataError> {
    match labels.dtype() {
        Dtype::U8 => Ok(labels.data().iter().map(|&l| u32::from(l)).collect()),
        Dtype::I64 => labels
            .data()
            .chunks_exact(8)
            .enumerate()
            .map(|(index, bytes)| {
                let label = little_endian_i64(bytes);
                u32::try_from(label).map_err(|_| {
                    invalid(
                        path,
                        format!("tensor `{name}`[{index}] is {label}, not a class index"),
                    )
                })
            })
            .collect(),
        other => Err(invalid(
            path,
            format!("tensor `{name}` is {other:?}, expected uint8 or int64"),
        )),
    }
}

fn floats(path: &Path, name: &str, data: &[u8]) -> Result<Vec<f32>, OwnDataError> {
    let mut values = reserve(path, data.len() / 4)?;
    for (index, bytes) in data.chunks_exact(4).enumerate() {
        let value = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        if !value.is_finite() {
            return Err(invalid(
                path,
                format!("tensor `{name}` element {index} is {value}, not a finite number"),
            ));
        }
        values.push(value);
    }
    Ok(values)
}

fn tokens(path: &Path, name: &str, data: &[u8]) -> Result<Vec<f32>, OwnDataError> {
    let mut values = reserve(path, data.len() / 8)?;
    for (index, bytes) in data.chunks_exact(8).enumerate() {
        let token = little_endian_i64(bytes);
        if !(0..MAX_TOKEN).contains(&token) {
            return Err(invalid(
                path,
                format!("tensor `{name}` element {index} is {token}, not a token id in 0..2^24"),
            ));
        }
        values.push(token as f32);
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIDE: usize = 28;

    fn mnist_like(normalization: &Normalization, classes: usize) -> Expected<'_> {
        Expected {
            sample_shape: &[1, SIDE, SIDE],
            classes,
            normalization: Some(normalization),
            datasource: "MNIST",
        }
    }

    /// A tensor to write: name, dtype, shape, bytes.
    type Tensor<'a> = (&'a str, Dtype, Vec<usize>, Vec<u8>);

    fn save(path: &Path, tensors: &[Tensor<'_>]) {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(name, dtype, shape, data)| {
                (
                    name.to_string(),
                    TensorView::new(*dtype, shape.clone(), data).unwrap(),
                )
            })
            .collect();
        std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
    }

    fn idx(dims: &[u32], body: &[u8]) -> Vec<u8> {
        let mut raw = vec![0, 0, 0x08, dims.len() as u8];
        for d in dims {
            raw.extend(d.to_be_bytes());
        }
        raw.extend(body);
        raw
    }

    #[test]
    fn a_safetensors_file_with_held_out_data_loads_and_normalizes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mine.safetensors");
        let pixels = SIDE * SIDE;
        let floats: Vec<u8> = (0..pixels).flat_map(|_| 0.5f32.to_le_bytes()).collect();
        let test_labels: Vec<u8> = 7i64.to_le_bytes().to_vec();
        save(
            &path,
            &[
                (
                    "images",
                    Dtype::U8,
                    vec![2, SIDE, SIDE],
                    vec![255; 2 * pixels],
                ),
                ("labels", Dtype::U8, vec![2], vec![3, 4]),
                ("test_images", Dtype::F32, vec![1, 1, SIDE, SIDE], floats),
                ("test_labels", Dtype::I64, vec![1], test_labels),
            ],
        );
        let own = OwnData::load(&path, 100_000).unwrap();
        assert_eq!((own.train.len(), own.test_len()), (2, 1));
        let normalization = Normalization::single(0.5, 0.25);
        let data = own.into_dataset(mnist_like(&normalization, 10)).unwrap();
        assert_eq!(data.labels, [3, 4, 7]);
        assert_eq!(data.inputs[0], 2.0);
        assert_eq!(data.inputs[2 * pixels], 0.0);
    }

    #[test]
    fn malformed_safetensors_files_are_refused_naming_the_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        let pixels = SIDE * SIDE;
        let cases: Vec<(Vec<Tensor<'_>>, &str)> = vec![
            (
                vec![("images", Dtype::U8, vec![1, 10, 10], vec![0; 100])],
                "needs tensors `images` (or `inputs`) and `labels`",
            ),
            (
                vec![
                    ("images", Dtype::U8, vec![3], vec![0; 3]),
                    ("labels", Dtype::U8, vec![3], vec![0; 3]),
                ],
                "`images` has shape [3], expected [N, ...]",
            ),
            (
                vec![
                    ("images", Dtype::U8, vec![1, 1], vec![0]),
                    ("inputs", Dtype::U8, vec![1, 1], vec![0]),
                    ("labels", Dtype::U8, vec![1], vec![0]),
                ],
                "has both `images` and `inputs`",
            ),
            (
                vec![
                    (
                        "inputs",
                        Dtype::I64,
                        vec![1, 1],
                        (-3i64).to_le_bytes().to_vec(),
                    ),
                    ("labels", Dtype::U8, vec![1], vec![0]),
                ],
                "`inputs` element 0 is -3, not a token id",
            ),
            (
                vec![
                    (
                        "inputs",
                        Dtype::F32,
                        vec![1, 1],
                        f32::NAN.to_le_bytes().to_vec(),
                    ),
                    ("labels", Dtype::U8, vec![1], vec![0]),
                ],
                "`inputs` element 0 is NaN",
            ),
            (
                vec![
                    ("images", Dtype::U8, vec![1, SIDE, SIDE], vec![0; pixels]),
                    ("labels", Dtype::U8, vec![2], vec![0, 1]),
                ],
                "`labels` has shape [2], expected [1]",
            ),
            (
                vec![
                    ("images", Dtype::U8, vec![1, SIDE, SIDE], vec![0; pixels]),
                    (
                        "labels",
                        Dtype::I64,
                        vec![1],
                        (-1i64).to_le_bytes().to_vec(),
                    ),
                ],
                "`labels`[0] is -1",
            ),
            (
                vec![
                    ("images", Dtype::U8, vec![1, SIDE, SIDE], vec![0; pixels]),
                    ("labels", Dtype::U8, vec![1], vec![0]),
                    (
                        "test_images",
                        Dtype::U8,
                        vec![1, SIDE, SIDE],
                        vec![0; pixels],
                    ),
                ],
                "needs both `test_images` (or `test_inputs`) and `test_labels`",
            ),
            (
                vec![
                    ("images", Dtype::U8, vec![0, SIDE, SIDE], vec![]),
                    ("labels", Dtype::U8, vec![0], vec![]),
                ],
                "no training samples",
            ),
        ];
        for (tensors, needle) in cases {
            save(&path, &tensors);
            let error = OwnData::load(&path, 100_000).unwrap_err().to_string();
            assert!(error.contains(needle), "{needle}: {error}");
            assert!(error.contains("bad.safetensors"), "{error}");
        }
        std::fs::write(&path, b"not a tensor file").unwrap();
        let error = OwnData::load(&path, 100_000).unwrap_err().to_string();
        assert!(error.contains("neither a folder of IDX files"), "{error}");
    }

    #[test]
    fn an_idx_folder_loads_plain_and_gzip_files() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let pixels = SIDE * SIDE;
        std::fs::write(
            dir.path().join(IDX_NAMES[0]),
            idx(&[2, 28, 28], &vec![51; 2 * pixels]),
        )
        .unwrap();
        let mut encoder = flate2::write::GzEncoder::new(
            std::fs::File::create(dir.path().join(format!("{}.gz", IDX_NAMES[1]))).unwrap(),
            flate2::Compression::fast(),
        );
        encoder.write_all(&idx(&[2], &[1, 9])).unwrap();
        encoder.finish().unwrap();
        let own = OwnData::load(dir.path(), 100_000).unwrap();
        assert_eq!(own.train.labels, [1, 9]);
        assert_eq!(own.train.values[0], 0.2);
        assert_eq!(own.train.shape, [28, 28]);
        assert!(own.test.is_none());
        let unit = Normalization::single(0.0, 1.0);
        let error = own
            .into_dataset(mnist_like(&unit, 5))
            .unwrap_err()
            .to_string();
        assert!(error.contains("label 9 at sample 1"), "{error}");

        std::fs::write(dir.path().join(IDX_NAMES[2]), idx(&[1, 28, 28], &[0; 784])).unwrap();
        let error = OwnData::load(dir.path(), 100_000).unwrap_err().to_string();
        assert!(error.contains("needs both"), "{error}");
        std::fs::write(dir.path().join(IDX_NAMES[3]), idx(&[2], &[0, 0])).unwrap();
        let error = OwnData::load(dir.path(), 100_000).unwrap_err().to_string();
        assert!(error.contains("2 labels, but"), "{error}");

        let empty = tempfile::tempdir().unwrap();
        let error = OwnData::load(empty.path(), 100_000)
            .unwrap_err()
            .to_string();
        assert!(error.contains("a data folder needs"), "{error}");
    }

    #[test]
    fn a_header_that_claims_more_samples_than_accepted_is_refused_before_reading() {
        use std::io::Write;
        // A few bytes of gzip whose header claims 2,000,000 images: refused
        // from the header, nothing allocated for them.
        let dir = tempfile::tempdir().unwrap();
        let mut encoder = flate2::write::GzEncoder::new(
            std::fs::File::create(dir.path().join(format!("{}.gz", IDX_NAMES[0]))).unwrap(),
            flate2::Compression::fast(),
        );
        encoder
            .write_all(&idx(&[2_000_000, 28, 28], &[0; 784]))
            .unwrap();
        encoder.finish().unwrap();
        std::fs::write(dir.path().join(IDX_NAMES[1]), idx(&[1], &[0])).unwrap();
        let error = OwnData::load(dir.path(), 100_000).unwrap_err().to_string();
        assert!(
            error.contains("2000000 samples, more than the 100000 this client accepts"),
            "{error}"
        );

        // The bound holds for safetensors files too, and is the caller's.
        let path = dir.path().join("own.safetensors");
        let images = vec![0u8; 3 * 784];
        let labels = vec![0u8; 3];
        let views = [
            (
                "images",
                safetensors::tensor::TensorView::new(Dtype::U8, vec![3, 28, 28], &images).unwrap(),
            ),
            (
                "labels",
                safetensors::tensor::TensorView::new(Dtype::U8, vec![3], &labels).unwrap(),
            ),
        ];
        safetensors::serialize_to_file(views, None, &path).unwrap();
        assert_eq!(OwnData::load(&path, 3).unwrap().train.len(), 3);
        let error = OwnData::load(&path, 2).unwrap_err().to_string();
        assert!(error.contains("3 samples, more than the 2"), "{error}");
    }

    #[test]
    fn own_data_of_any_shape_fits_the_servers_data_set_or_is_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("colour.safetensors");
        // Two 3×2×2 colour images of uint8 pixels.
        save(
            &path,
            &[
                ("images", Dtype::U8, vec![2, 3, 2, 2], vec![255; 24]),
                (
                    "labels",
                    Dtype::I64,
                    vec![2],
                    [12i64, 99].iter().flat_map(|l| l.to_le_bytes()).collect(),
                ),
            ],
        );
        let normalization = Normalization {
            mean: vec![0.0, 0.5, 1.0],
            std: vec![1.0, 0.5, 1.0],
        };
        let cifar = |shape: &'static [usize]| Expected {
            sample_shape: shape,
            classes: 100,
            normalization: Some(&normalization),
            datasource: "CIFAR100",
        };
        let data = OwnData::load(&path, 10)
            .unwrap()
            .into_dataset(cifar(&[3, 2, 2]))
            .unwrap();
        assert_eq!(data.labels, [12, 99]);
        assert_eq!(
            data.inputs[..12],
            [1., 1., 1., 1., 1., 1., 1., 1., 0., 0., 0., 0.]
        );
        let error = OwnData::load(&path, 10)
            .unwrap()
            .into_dataset(cifar(&[3, 32, 32]))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(
                "training samples of shape [3, 2, 2], but the server's data set `CIFAR100` has \
                 samples of [3, 32, 32]"
            ),
            "{error}"
        );

        // Token sequences (int64) of a data set that does not normalize are
        // taken as they are; an image data set refuses them.
        let path = dir.path().join("tokens.safetensors");
        let tokens: Vec<u8> = [1i64, 2, 3, 4]
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        save(
            &path,
            &[
                ("inputs", Dtype::I64, vec![2, 2], tokens),
                ("labels", Dtype::U8, vec![2], vec![3, 5]),
            ],
        );
        let text = Expected {
            sample_shape: &[2],
            classes: 80,
            normalization: None,
            datasource: "Shakespeare",
        };
        let data = OwnData::load(&path, 10)
            .unwrap()
            .into_dataset(text)
            .unwrap();
        assert_eq!(
            (data.inputs, data.labels),
            (vec![1.0, 2.0, 3.0, 4.0], vec![3, 5])
        );
        let error = OwnData::load(&path, 10)
            .unwrap()
            .into_dataset(Expected {
                sample_shape: &[1, 2],
                ..cifar(&[])
            })
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("are token ids, but the server's data set `CIFAR100` holds images"),
            "{error}"
        );
    }

    #[test]
    fn float_inputs_are_intensities_where_the_data_set_normalizes_and_values_where_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("floats.safetensors");
        let values: Vec<u8> = [0.5f32, 255.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        save(
            &path,
            &[
                ("inputs", Dtype::F32, vec![1, 2], values),
                ("labels", Dtype::U8, vec![1], vec![0]),
            ],
        );
        let features = Expected {
            sample_shape: &[2],
            classes: 2,
            normalization: None,
            datasource: "blobs",
        };
        let data = OwnData::load(&path, 10)
            .unwrap()
            .into_dataset(features)
            .unwrap();
        assert_eq!(data.inputs, [0.5, 255.0]);
        let normalization = Normalization::single(0.0, 1.0);
        let error = OwnData::load(&path, 10)
            .unwrap()
            .into_dataset(Expected {
                normalization: Some(&normalization),
                ..features
            })
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(
                "float32 value 255 at element 1 of the training samples is not an intensity"
            ),
            "{error}"
        );
    }
}
