//! Reader for the binary version of CIFAR-10 and CIFAR-100.
//!
//! A file is a run of fixed-size records and nothing else: no header, no
//! count. A CIFAR-10 record is one label byte then 3,072 pixel bytes; a
//! CIFAR-100 record is a coarse label byte, a fine label byte, then the
//! pixels. The pixels are 1,024 red, 1,024 green and 1,024 blue values, each
//! plane row-major over 32 × 32: already the `[3, 32, 32]` layout of a
//! sample, so a record is copied, not rearranged.
//!
//! What is checked before any value is used: the file is a regular file no
//! larger than the largest file of the data set, its length is a whole number
//! of records, and every label is below the number of classes. What cannot be
//! checked: that the pixels are the published ones (the download's SHA-256
//! covers that for an archive fetched by cohort, not for files put by hand).

use std::path::{Path, PathBuf};

use super::{DataFile, Dataset, Normalization};

/// Pixel bytes of one image: 3 channels of 32 × 32.
pub const PIXELS: usize = 3 * 32 * 32;

/// CIFAR-100's `train.bin` is 50,000 records of 3,074 bytes (153.7 MB); a
/// file beyond this is not one of the data set's, and is refused before it
/// is read.
const MAX_FILE_BYTES: u64 = 160 << 20;

/// Which of the two data sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cifar {
    Ten,
    Hundred,
}

impl Cifar {
    /// Label bytes before the pixels of each record.
    pub fn label_bytes(self) -> usize {
        match self {
            Cifar::Ten => 1,
            Cifar::Hundred => 2,
        }
    }

    /// Bytes of one record.
    pub fn record_bytes(self) -> usize {
        self.label_bytes() + PIXELS
    }

    /// Classes of the label cohort reads (CIFAR-100's fine label).
    pub fn classes(self) -> usize {
        match self {
            Cifar::Ten => 10,
            Cifar::Hundred => 100,
        }
    }

    /// The folder the archive unpacks to, under `data_path`.
    pub fn folder(self) -> &'static str {
        match self {
            Cifar::Ten => "cifar-10-batches-bin",
            Cifar::Hundred => "cifar-100-binary",
        }
    }

    /// The training files, in the order their records are concatenated.
    pub fn train_files(self) -> &'static [&'static str] {
        match self {
            Cifar::Ten => &[
                "data_batch_1.bin",
                "data_batch_2.bin",
                "data_batch_3.bin",
                "data_batch_4.bin",
                "data_batch_5.bin",
            ],
            Cifar::Hundred => &["train.bin"],
        }
    }

    pub fn test_file(self) -> &'static str {
        match self {
            Cifar::Ten => "test_batch.bin",
            Cifar::Hundred => "test.bin",
        }
    }

    /// The published archive, with the SHA-256 that TensorFlow Datasets
    /// records for it (`url_checksums/cifar10.txt`, `cifar100.txt`: sizes
    /// 170,052,171 and 168,513,733 bytes). The CIFAR page itself states MD5s
    /// only.
    pub fn archive(self) -> DataFile {
        match self {
            Cifar::Ten => DataFile {
                name: "cifar-10-binary.tar.gz",
                sha256: "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
            },
            Cifar::Hundred => DataFile {
                name: "cifar-100-binary.tar.gz",
                sha256: "58a81ae192c23a4be8b1804d68e518ed807d710a4eb253b1f2a199162a40d8ec",
            },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CifarError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path}: {bytes} bytes is not a whole number of {record}-byte records \
         ({labels} label byte(s) + 3,072 pixel bytes); the file is truncated or not a \
         {name} binary batch"
    )]
    Size {
        path: PathBuf,
        bytes: u64,
        record: usize,
        labels: usize,
        name: &'static str,
    },
    #[error("{path}: record {index} has label {label}, expected one below {classes}")]
    Label {
        path: PathBuf,
        index: usize,
        label: u8,
        classes: usize,
    },
}

impl Cifar {
    fn name(self) -> &'static str {
        match self {
            Cifar::Ten => "CIFAR-10",
            Cifar::Hundred => "CIFAR-100",
        }
    }

    /// Records of a file of `bytes` bytes, or why it cannot hold whole ones.
    pub fn records_in(self, path: &Path, bytes: u64) -> Result<usize, CifarError> {
        let record = self.record_bytes() as u64;
        if !bytes.is_multiple_of(record) || bytes > MAX_FILE_BYTES {
            return Err(CifarError::Size {
                path: path.to_path_buf(),
                bytes,
                record: self.record_bytes(),
                labels: self.label_bytes(),
                name: self.name(),
            });
        }
        Ok((bytes / record) as usize)
    }

    /// Records of the file at `path` from its length alone: what `cohort
    /// check` reports without reading the pixels.
    pub fn records_of(self, path: &Path) -> Result<usize, CifarError> {
        let metadata = std::fs::metadata(path).map_err(|source| CifarError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        self.records_in(path, metadata.len())
    }
}

/// The images and labels of one file, appended to `pixels` and `labels`.
pub fn read_batch(
    kind: Cifar,
    path: &Path,
    pixels: &mut Vec<u8>,
    labels: &mut Vec<u32>,
) -> Result<(), CifarError> {
    let bytes =
        crate::fsutil::read_bounded(path, MAX_FILE_BYTES).map_err(|source| CifarError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    parse_batch(kind, path, &bytes, pixels, labels)
}

/// [`read_batch`] on bytes already read; `path` names them in errors.
pub fn parse_batch(
    kind: Cifar,
    path: &Path,
    bytes: &[u8],
    pixels: &mut Vec<u8>,
    labels: &mut Vec<u32>,
) -> Result<(), CifarError> {
    let records = kind.records_in(path, bytes.len() as u64)?;
    let skip = kind.label_bytes() - 1;
    pixels.reserve(records * PIXELS);
    labels.reserve(records);
    for (index, record) in bytes.chunks_exact(kind.record_bytes()).enumerate() {
        // CIFAR-100's first byte is the coarse label (20 superclasses); the
        // fine one after it is the 100-class label.
        let label = record[skip];
        if usize::from(label) >= kind.classes() {
            return Err(CifarError::Label {
                path: path.to_path_buf(),
                index,
                label,
                classes: kind.classes(),
            });
        }
        labels.push(u32::from(label));
        pixels.extend_from_slice(&record[kind.label_bytes()..]);
    }
    Ok(())
}

/// The files of one split under `folder`, normalized, as one data set.
pub fn read_split(
    kind: Cifar,
    folder: &Path,
    files: &[&str],
    normalization: &Normalization,
) -> Result<Dataset, CifarError> {
    let (pixels, labels) = read_records(kind, folder, files)?;
    Ok(to_dataset(pixels, labels, normalization))
}

/// The raw pixels and labels of one split's files under `folder`.
pub fn read_records(
    kind: Cifar,
    folder: &Path,
    files: &[&str],
) -> Result<(Vec<u8>, Vec<u32>), CifarError> {
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    for file in files {
        read_batch(kind, &folder.join(file), &mut pixels, &mut labels)?;
    }
    Ok((pixels, labels))
}

/// Raw records as a normalized data set of 3×32×32 samples.
pub fn to_dataset(pixels: Vec<u8>, labels: Vec<u32>, normalization: &Normalization) -> Dataset {
    let mut inputs: Vec<f32> = pixels.iter().map(|&p| f32::from(p) / 255.0).collect();
    let shape = vec![3, 32, 32];
    normalization
        .apply(&mut inputs, &shape)
        .expect("three pairs for three channels");
    Dataset {
        inputs,
        labels,
        sample_shape: shape,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: Cifar, label: u8, fill: u8) -> Vec<u8> {
        let mut bytes = vec![label; kind.label_bytes()];
        if kind == Cifar::Hundred {
            bytes[0] = 19; // a coarse label, to be skipped
        }
        bytes.extend(std::iter::repeat_n(fill, PIXELS));
        bytes
    }

    #[test]
    fn records_are_labels_then_channel_planes() {
        for kind in [Cifar::Ten, Cifar::Hundred] {
            let mut bytes = record(kind, 7, 0);
            // Red plane 10, green 20, blue 30 in the second record.
            let mut second = vec![3u8; kind.label_bytes()];
            for value in [10u8, 20, 30] {
                second.extend(std::iter::repeat_n(value, 1024));
            }
            bytes.extend(second);
            let (mut pixels, mut labels) = (Vec::new(), Vec::new());
            parse_batch(kind, Path::new("b.bin"), &bytes, &mut pixels, &mut labels).unwrap();
            assert_eq!(labels, [7, 3], "{kind:?}");
            assert_eq!(pixels.len(), 2 * PIXELS);
            assert_eq!(
                (pixels[PIXELS], pixels[PIXELS + 1024], pixels[PIXELS + 2048]),
                (10, 20, 30)
            );
        }
    }

    #[test]
    fn truncated_oversized_and_mislabelled_files_are_refused_by_name() {
        let path = Path::new("data_batch_3.bin");
        let mut bytes = record(Cifar::Ten, 1, 5);
        bytes.pop();
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        let error = parse_batch(Cifar::Ten, path, &bytes, &mut pixels, &mut labels)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("data_batch_3.bin: 3072 bytes is not a whole number of 3073-byte"),
            "{error}"
        );
        // A CIFAR-10 batch read as CIFAR-100: 3,073 is not a multiple of 3,074.
        let bytes = record(Cifar::Ten, 1, 5);
        let error = parse_batch(Cifar::Hundred, path, &bytes, &mut pixels, &mut labels)
            .unwrap_err()
            .to_string();
        assert!(error.contains("3074-byte records"), "{error}");
        let error = parse_batch(
            Cifar::Ten,
            path,
            &record(Cifar::Ten, 10, 0),
            &mut pixels,
            &mut labels,
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("record 0 has label 10, expected one below 10"),
            "{error}"
        );
        assert!(
            Cifar::Ten
                .records_in(path, 3073 * 60_000)
                .unwrap_err()
                .to_string()
                .contains("not a whole number"),
            "larger than any file of the data set"
        );
        assert_eq!(
            Cifar::Hundred.records_in(path, 3074 * 50_000).unwrap(),
            50_000
        );
    }

    #[test]
    fn a_device_or_a_missing_file_is_an_error_naming_it() {
        let error = read_batch(
            Cifar::Ten,
            Path::new("/nonexistent/test_batch.bin"),
            &mut Vec::new(),
            &mut Vec::new(),
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("/nonexistent/test_batch.bin"), "{error}");
        #[cfg(unix)]
        {
            let error = read_batch(
                Cifar::Ten,
                Path::new("/dev/zero"),
                &mut Vec::new(),
                &mut Vec::new(),
            )
            .unwrap_err()
            .to_string();
            assert!(error.contains("not a regular file"), "{error}");
        }
    }

    proptest::proptest! {
        /// Any whole number of records with labels in range parses, keeping
        /// each record's label and pixels in order; one byte more or less
        /// never does.
        #[test]
        fn whole_records_parse_and_others_do_not(
            labels in proptest::collection::vec(0u8..100, 0..6),
            hundred in proptest::bool::ANY,
            extra in 1usize..3073,
        ) {
            let kind = if hundred { Cifar::Hundred } else { Cifar::Ten };
            let labels: Vec<u8> = labels.iter().map(|l| l % kind.classes() as u8).collect();
            let mut bytes = Vec::new();
            for (i, &label) in labels.iter().enumerate() {
                bytes.extend(record(kind, label, i as u8));
            }
            let (mut pixels, mut parsed) = (Vec::new(), Vec::new());
            parse_batch(kind, Path::new("x"), &bytes, &mut pixels, &mut parsed).unwrap();
            let expected: Vec<u32> = labels.iter().map(|&l| u32::from(l)).collect();
            proptest::prop_assert_eq!(parsed, expected);
            for i in 0..labels.len() {
                proptest::prop_assert!(pixels[i * PIXELS..(i + 1) * PIXELS].iter().all(|&p| p == i as u8));
            }
            bytes.extend(std::iter::repeat_n(0, extra));
            let result = parse_batch(kind, Path::new("x"), &bytes, &mut Vec::new(), &mut Vec::new());
            proptest::prop_assert!(result.is_err());
        }
    }
}
