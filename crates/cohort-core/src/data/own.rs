//! A client's own data set (`cohort client --data PATH`): what a client that
//! does not take a partition of the run's shared data trains on.
//!
//! Two formats, both checked in full before the client registers, so that the
//! sample counts it declares are the ones it holds:
//!
//! * **a folder of IDX files**, named as MNIST names them:
//!   `train-images-idx3-ubyte` and `train-labels-idx1-ubyte`, and for held-out
//!   evaluation optionally `t10k-images-idx3-ubyte` and
//!   `t10k-labels-idx1-ubyte`; each plain or gzip-compressed (`.gz`);
//! * **a safetensors file** (what `safetensors.numpy.save_file` writes):
//!   `images` (uint8 `[N, 28, 28]` or `[N, 1, 28, 28]` of pixel values
//!   0–255, or float32 of the same shapes with intensities in [0, 1]) and
//!   `labels` (uint8 or int64 `[N]`), optionally `test_images` and
//!   `test_labels` of the same kinds.
//!
//! Images are kept as intensities in [0, 1] until [`OwnData::into_dataset`]
//! normalizes them the way the run's data source is normalized, once the
//! client knows the run's config. Every error names the file, the tensor and
//! what was expected; nothing here panics on a malformed file.

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::Dataset;
use super::idx::{IdxError, read_idx, read_idx_dims};

/// Image side the built-in models take.
pub const SIDE: usize = 28;

/// Training and (optional) held-out images as intensities in [0, 1].
#[derive(Debug, Clone, PartialEq)]
pub struct OwnData {
    /// The folder or file it was read from, for messages.
    pub source: PathBuf,
    pub train: Samples,
    pub test: Option<Samples>,
}

/// Images `[count, SIDE, SIDE]` row-major, intensities in [0, 1], with labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Samples {
    pub images: Vec<f32>,
    pub labels: Vec<u8>,
}

impl Samples {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
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
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

fn invalid(path: &Path, reason: impl Into<String>) -> OwnDataError {
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
        let loaded = if path.is_dir() {
            load_idx_folder(path, max_samples)?
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

    /// One [`Dataset`], normalized with `(mean, std)`: the training samples
    /// first (indices `0..train`), then the held-out ones, so a client's
    /// partition and held-out lists are index ranges of the same data set.
    /// Labels must be below `num_classes`.
    pub fn into_dataset(
        self,
        (mean, std): (f32, f32),
        num_classes: usize,
    ) -> Result<Dataset, OwnDataError> {
        let mut images = self.train.images;
        let mut labels = self.train.labels;
        if let Some(test) = self.test {
            images.extend(test.images);
            labels.extend(test.labels);
        }
        if let Some((index, label)) = labels
            .iter()
            .enumerate()
            .find(|(_, label)| usize::from(**label) >= num_classes)
        {
            return Err(invalid(
                &self.source,
                format!(
                    "label {label} at sample {index} (training samples first, then held-out \
                     ones) is outside 0..{num_classes} (the run's parameters.model.num_classes)"
                ),
            ));
        }
        images.iter_mut().for_each(|x| *x = (*x - mean) / std);
        Ok(Dataset {
            inputs: images,
            labels: labels.into_iter().map(u32::from).collect(),
            sample_shape: vec![1, SIDE, SIDE],
        })
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
    if images.dims[1..] != [SIDE, SIDE] {
        return Err(invalid(
            images_path,
            format!(
                "images of {}×{}, the models take {SIDE}×{SIDE}",
                images.dims[1], images.dims[2]
            ),
        ));
    }
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
        images: pixels(images_path, &images.data)?,
        labels: labels.data,
    })
}

/// More samples than the client accepts are refused by name.
fn check_count(path: &Path, count: usize, max_samples: u64) -> Result<(), OwnDataError> {
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

/// uint8 pixels as intensities in [0, 1], allocated fallibly: a data set
/// too large for this machine's memory is an error, not an abort.
fn pixels(path: &Path, data: &[u8]) -> Result<Vec<f32>, OwnDataError> {
    let mut values = Vec::new();
    values.try_reserve_exact(data.len()).map_err(|_| {
        invalid(
            path,
            format!(
                "{} pixels do not fit this machine's memory as float32",
                data.len()
            ),
        )
    })?;
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
    let get = |name: &str| file.tensor(name).ok();
    let train = match (get("images"), get("labels")) {
        (Some(images), Some(labels)) => {
            samples(path, ("images", images), ("labels", labels), max_samples)?
        }
        _ => {
            return Err(invalid(
                path,
                format!(
                    "needs tensors `images` and `labels` (and optionally `test_images` and \
                     `test_labels`); it has {:?}",
                    file.names()
                ),
            ));
        }
    };
    let test = match (get("test_images"), get("test_labels")) {
        (Some(images), Some(labels)) => Some(samples(
            path,
            ("test_images", images),
            ("test_labels", labels),
            max_samples,
        )?),
        (None, None) => None,
        _ => {
            return Err(invalid(
                path,
                "held-out data needs both `test_images` and `test_labels`, found one",
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
    (images_name, images): (&str, TensorView<'_>),
    (labels_name, labels): (&str, TensorView<'_>),
    max_samples: u64,
) -> Result<Samples, OwnDataError> {
    let shape = images.shape();
    let count = match shape {
        [n, rows, cols] | [n, 1, rows, cols] if *rows == SIDE && *cols == SIDE => *n,
        _ => {
            return Err(invalid(
                path,
                format!(
                    "tensor `{images_name}` has shape {shape:?}, expected [N, {SIDE}, {SIDE}] \
                     or [N, 1, {SIDE}, {SIDE}]"
                ),
            ));
        }
    };
    check_count(path, count, max_samples)?;
    if labels.shape() != [count] {
        return Err(invalid(
            path,
            format!(
                "tensor `{labels_name}` has shape {:?}, expected [{count}] (one label per image \
                 of `{images_name}`)",
                labels.shape()
            ),
        ));
    }
    let image_values = match images.dtype() {
        Dtype::U8 => pixels(path, images.data())?,
        Dtype::F32 => float_images(path, images_name, images.data())?,
        other => {
            return Err(invalid(
                path,
                format!("tensor `{images_name}` is {other:?}, expected uint8 or float32"),
            ));
        }
    };
    let label_values = match labels.dtype() {
        Dtype::U8 => labels.data().to_vec(),
        Dtype::I64 => labels
            .data()
            .chunks_exact(8)
            .enumerate()
            .map(|(index, bytes)| {
                let mut word = [0u8; 8];
                word.copy_from_slice(bytes);
                let label = i64::from_le_bytes(word);
                u8::try_from(label).map_err(|_| {
                    invalid(
                        path,
                        format!("tensor `{labels_name}`[{index}] is {label}, not a class index"),
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        other => {
            return Err(invalid(
                path,
                format!("tensor `{labels_name}` is {other:?}, expected uint8 or int64"),
            ));
        }
    };
    Ok(Samples {
        images: image_values,
        labels: label_values,
    })
}

fn float_images(path: &Path, name: &str, data: &[u8]) -> Result<Vec<f32>, OwnDataError> {
    data.chunks_exact(4)
        .enumerate()
        .map(|(index, bytes)| {
            let value = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            if (0.0..=1.0).contains(&value) {
                Ok(value)
            } else {
                Err(invalid(
                    path,
                    format!(
                        "tensor `{name}` element {index} is {value}; float32 images hold \
                         intensities in [0, 1] (divide uint8 pixels by 255, or save them as uint8)"
                    ),
                ))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let data = own.into_dataset((0.5, 0.25), 10).unwrap();
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
                "needs tensors `images` and `labels`",
            ),
            (
                vec![
                    ("images", Dtype::U8, vec![1, 10, 10], vec![0; 100]),
                    ("labels", Dtype::U8, vec![1], vec![0]),
                ],
                "`images` has shape [1, 10, 10]",
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
                    (
                        "images",
                        Dtype::F32,
                        vec![1, SIDE, SIDE],
                        (0..pixels).flat_map(|_| 255f32.to_le_bytes()).collect(),
                    ),
                    ("labels", Dtype::U8, vec![1], vec![0]),
                ],
                "intensities in [0, 1]",
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
                "needs both `test_images` and `test_labels`",
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
        assert_eq!(own.train.images[0], 0.2);
        assert!(own.test.is_none());
        let error = own.into_dataset((0.0, 1.0), 5).unwrap_err().to_string();
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
}
