//! A client's own data in the formats of the run's other data sets: CIFAR's
//! binary batches, LEAF's JSON, and the CSV and NPZ files of the file data
//! sets, each read by that data set's own reader so an own-data client holds
//! what the server's loader would have read from the same files. [`super::own`]
//! dispatches here; the samples come back as its [`Samples`], whose shape and
//! normalization are then fitted to the server's data set there.
//!
//! As for IDX and safetensors, the sample count is known before the samples
//! are converted (CIFAR: from the files' sizes; LEAF: from `num_samples`;
//! NPZ: from the arrays' headers; CSV: its rows, bounded by the file's size)
//! and refused above the client's `--max-samples`.

use std::path::{Path, PathBuf};

use super::cifar::{self, Cifar};
use super::leaf::{self, Leaf};
use super::own::{Encoding, OwnData, OwnDataError, Samples, check_count, invalid, pixels};
use super::tabular::{self, FileFormat};

/// `folder` as CIFAR-10's (`data_batch_*.bin`, optionally `test_batch.bin`)
/// or CIFAR-100's (`train.bin`, optionally `test.bin`) binary batches, the
/// names the archives use; `None` when it holds neither.
pub(super) fn load_cifar_folder(
    folder: &Path,
    max_samples: u64,
) -> Result<Option<OwnData>, OwnDataError> {
    let batches = numbered_batches(folder)?;
    let (kind, train, test) = if !batches.is_empty() {
        (Cifar::Ten, batches, folder.join("test_batch.bin"))
    } else if folder.join("train.bin").is_file() {
        (
            Cifar::Hundred,
            vec![folder.join("train.bin")],
            folder.join("test.bin"),
        )
    } else {
        return Ok(None);
    };
    let train = cifar_samples(kind, &train, max_samples)?;
    let test = match test.is_file() {
        true => Some(cifar_samples(kind, &[test], max_samples)?),
        false => None,
    };
    Ok(Some(OwnData {
        source: folder.to_path_buf(),
        train,
        test: test.filter(|t| !t.is_empty()),
    }))
}

/// CIFAR-10's `data_batch_N.bin` files of `folder`, in N's order (a client
/// may hold any number of them).
fn numbered_batches(folder: &Path) -> Result<Vec<PathBuf>, OwnDataError> {
    let entries = std::fs::read_dir(folder).map_err(|source| OwnDataError::Io {
        path: folder.to_path_buf(),
        source,
    })?;
    let mut numbered: Vec<(u64, PathBuf)> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter_map(|path| {
            let name = path.file_name()?.to_str()?;
            let number = name
                .strip_prefix("data_batch_")?
                .strip_suffix(".bin")?
                .parse()
                .ok()?;
            path.is_file().then_some((number, path))
        })
        .collect();
    numbered.sort();
    Ok(numbered.into_iter().map(|(_, path)| path).collect())
}

fn cifar_samples(
    kind: Cifar,
    files: &[PathBuf],
    max_samples: u64,
) -> Result<Samples, OwnDataError> {
    let mut count = 0usize;
    for file in files {
        count = count.saturating_add(kind.records_of(file)?);
    }
    check_count(&files[0], count, max_samples)?;
    let (mut bytes, mut labels) = (Vec::new(), Vec::new());
    for file in files {
        cifar::read_batch(kind, file, &mut bytes, &mut labels)?;
    }
    Ok(Samples {
        values: pixels(&files[0], &bytes)?,
        labels,
        shape: vec![3, 32, 32],
        encoding: Encoding::Pixels,
    })
}

/// `folder/train/*.json` (and optionally `folder/test/*.json`) in LEAF's
/// format, every user's samples as this one client's; FEMNIST or
/// Shakespeare as the first file's samples say. `None` without `train/`.
pub(super) fn load_leaf_folder(
    folder: &Path,
    max_samples: u64,
) -> Result<Option<OwnData>, OwnDataError> {
    let train_folder = folder.join("train");
    if !train_folder.is_dir() {
        return Ok(None);
    }
    let kind = leaf_kind(&train_folder)?;
    let train = leaf_samples(kind, &train_folder, max_samples)?;
    let test_folder = folder.join("test");
    let test = match test_folder.is_dir() {
        true => Some(leaf_samples(kind, &test_folder, max_samples)?),
        false => None,
    };
    Ok(Some(OwnData {
        source: folder.to_path_buf(),
        train,
        test: test.filter(|t| !t.is_empty()),
    }))
}

/// FEMNIST's `x` is a list of 784 numbers a sample, Shakespeare's a string.
fn leaf_kind(folder: &Path) -> Result<Leaf, OwnDataError> {
    let files = leaf::json_files(folder).unwrap_or_default();
    let first = files
        .first()
        .ok_or_else(|| invalid(folder, "has no .json files (LEAF's train/*.json)"))?;
    let bytes =
        crate::fsutil::read_bounded(first, crate::fsutil::MAX_READ_BYTES).map_err(|source| {
            OwnDataError::Io {
                path: first.clone(),
                source,
            }
        })?;
    let file: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|error| invalid(first, format!("not JSON: {error}")))?;
    let sample = file
        .get("user_data")
        .and_then(|users| users.as_object())
        .and_then(|users| users.values().next())
        .and_then(|user| user.get("x"))
        .and_then(|x| x.as_array())
        .and_then(|x| x.first());
    match sample {
        Some(serde_json::Value::Array(_)) => Ok(Leaf::Femnist),
        Some(serde_json::Value::String(_)) => Ok(Leaf::Shakespeare),
        _ => Err(invalid(
            first,
            "not one of LEAF's files: its first user's `x` holds neither FEMNIST's lists of \
             784 values nor Shakespeare's strings",
        )),
    }
}

fn leaf_samples(kind: Leaf, folder: &Path, max_samples: u64) -> Result<Samples, OwnDataError> {
    let count = leaf::count_samples(folder)?;
    check_count(folder, count, max_samples)?;
    // Unnormalized: the server's data set's normalization is applied to own
    // data in one place, `OwnData::into_dataset`.
    let split = leaf::read_split(kind, folder, None)?;
    let encoding = match kind {
        Leaf::Femnist => Encoding::Floats,
        Leaf::Shakespeare => Encoding::Tokens,
    };
    let shape = match kind {
        // LEAF's 28 × 28 images, as an IDX client's or FEMNIST's own [1, 28, 28].
        Leaf::Femnist => split.data.sample_shape[1..].to_vec(),
        Leaf::Shakespeare => split.data.sample_shape,
    };
    Ok(Samples {
        values: split.data.inputs,
        labels: split.data.labels,
        shape,
        encoding,
    })
}

/// A CSV (header row, a label column, numeric features) or NPZ (`x`, `y`,
/// optionally `x_test`, `y_test`) file as the file data sets read it; a
/// client-id column or array is not read: all of it is this client's.
pub(super) fn load_table(
    path: &Path,
    format: FileFormat,
    label_column: &str,
    max_samples: u64,
) -> Result<OwnData, OwnDataError> {
    let file_error = |error: tabular::FileError| OwnDataError::Invalid {
        path: error.path,
        reason: error.message,
    };
    if format == FileFormat::Npz {
        let (train, test) = tabular::npz_counts(path).map_err(file_error)?;
        check_count(path, train.max(test.unwrap_or(0)), max_samples)?;
    }
    let (train, test) = tabular::read_own(path, format, label_column).map_err(file_error)?;
    let samples = |data: super::Dataset| -> Result<Samples, OwnDataError> {
        check_count(path, data.len(), max_samples)?;
        Ok(Samples {
            values: data.inputs,
            labels: data.labels,
            shape: data.sample_shape,
            encoding: Encoding::Floats,
        })
    };
    Ok(OwnData {
        source: path.to_path_buf(),
        train: samples(train)?,
        test: test.map(samples).transpose()?.filter(|t| !t.is_empty()),
    })
}
