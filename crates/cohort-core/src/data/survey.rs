//! What a data folder holds, from the files' headers alone: which of a data
//! set's files are there and how many samples each declares. `cohort check`
//! uses it to find a missing, truncated or mismatched file, or partitions the
//! training set cannot hold, before a run reads anything.

use std::path::{Path, PathBuf};

use super::idx::read_idx_dims;
use super::{DataFile, DataSource, Format, Obtain, leaf};

/// One of a data set's files (for LEAF, one split's folder of `.json`
/// files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SurveyedFile {
    pub file: DataFile,
    pub path: PathBuf,
    pub state: FileState,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileState {
    Missing,
    /// The dimensions its header (or its size) declares: `[samples, rows,
    /// cols]` for IDX images, `[samples]` for IDX labels and LEAF's splits,
    /// `[samples, 3, 32, 32]` for CIFAR's batches.
    Present(Vec<usize>),
    /// Unreadable or not the file it should be.
    Broken(String),
}

/// The files of `source` under `root`: the training split's, then the test
/// split's.
#[derive(Debug, Clone)]
pub struct Survey {
    pub folder: PathBuf,
    pub files: Vec<SurveyedFile>,
    /// Index of the test split's first file.
    test_from: usize,
    format: Format,
    obtain: Obtain,
}

impl Survey {
    pub fn of(source: DataSource, root: &Path) -> Self {
        let folder = root.join(source.folder());
        let format = source.format();
        let files: Vec<SurveyedFile> = match format {
            Format::Leaf(_) => ["train", "test"]
                .iter()
                .map(|split| leaf_split(&folder, split))
                .collect(),
            Format::Idx | Format::Cifar(_) => source
                .files()
                .iter()
                .map(|file| {
                    let path = folder.join(file.name);
                    let state = if !path.is_file() {
                        FileState::Missing
                    } else {
                        dims_of(format, file, &path)
                    };
                    SurveyedFile {
                        file: *file,
                        path,
                        state,
                    }
                })
                .collect(),
        };
        let test_from = match format {
            Format::Idx => 2,
            Format::Cifar(_) | Format::Leaf(_) => files.len() - 1,
        };
        Self {
            folder,
            files,
            test_from,
            format,
            obtain: source.obtain(),
        }
    }

    /// Samples of the training set, when all its files are there and agree.
    pub fn train_samples(&self) -> Option<usize> {
        self.split_samples(0..self.test_from)
    }

    pub fn test_samples(&self) -> Option<usize> {
        self.split_samples(self.test_from..self.files.len())
    }

    /// How missing files would be fetched: a run with `data.download` off,
    /// or with files that can only be put by hand, fails on them.
    pub fn obtain(&self) -> Obtain {
        self.obtain
    }

    fn split_samples(&self, files: std::ops::Range<usize>) -> Option<usize> {
        let files = &self.files[files];
        let firsts: Option<Vec<usize>> = files
            .iter()
            .map(|f| match &f.state {
                FileState::Present(dims) => dims.first().copied(),
                _ => None,
            })
            .collect();
        let firsts = firsts?;
        match self.format {
            // Images and labels: one count, declared twice.
            Format::Idx => (firsts[0] == firsts[1]).then_some(firsts[0]),
            Format::Cifar(_) | Format::Leaf(_) => Some(firsts.iter().sum()),
        }
    }

    /// Every problem a run would meet reading these files, one line each:
    /// broken files, images and labels of one split that disagree in count.
    /// Missing files are not problems here: they may be downloaded.
    pub fn problems(&self) -> Vec<String> {
        self.problems_of(0)
    }

    /// The test split's files alone: those a run whose clients all bring
    /// their own data reads.
    pub fn test_files(&self) -> &[SurveyedFile] {
        &self.files[self.test_from..]
    }

    /// The problems of the test split's files alone (see `problems`).
    pub fn test_problems(&self) -> Vec<String> {
        self.problems_of(self.test_from)
    }

    /// Problems of the files from index `first` on.
    fn problems_of(&self, first: usize) -> Vec<String> {
        let mut problems: Vec<String> = self.files[first..]
            .iter()
            .filter_map(|f| match &f.state {
                FileState::Broken(reason) => Some(reason.clone()),
                _ => None,
            })
            .collect();
        if self.format != Format::Idx {
            return problems;
        }
        for pair in (first..self.files.len()).step_by(2) {
            if let (FileState::Present(images), FileState::Present(labels)) =
                (&self.files[pair].state, &self.files[pair + 1].state)
                && images.first() != labels.first()
            {
                problems.push(format!(
                    "{} declares {} images but {} declares {} labels",
                    self.files[pair].path.display(),
                    images.first().copied().unwrap_or(0),
                    self.files[pair + 1].path.display(),
                    labels.first().copied().unwrap_or(0),
                ));
            }
        }
        problems
    }
}

/// What the header of an IDX file, or the size of a CIFAR batch, declares.
fn dims_of(format: Format, file: &DataFile, path: &Path) -> FileState {
    let declared = match format {
        Format::Cifar(kind) => kind
            .records_of(path)
            .map(|records| vec![records, 3, 32, 32])
            .map_err(|e| e.to_string()),
        Format::Idx | Format::Leaf(_) => {
            let rank = if file.name.contains("images") { 3 } else { 1 };
            read_idx_dims(path, rank).map_err(|e| e.to_string())
        }
    };
    match declared {
        Ok(dims) => FileState::Present(dims),
        Err(reason) => FileState::Broken(reason),
    }
}

/// One LEAF split: its folder's `.json` files, counted from `num_samples`.
fn leaf_split(folder: &Path, split: &'static str) -> SurveyedFile {
    let path = folder.join(split);
    let name = match split {
        "train" => "train/*.json",
        _ => "test/*.json",
    };
    let state = match leaf::json_files(&path) {
        None => FileState::Missing,
        Some(files) if files.is_empty() => FileState::Missing,
        Some(_) => match leaf::count_samples(&path) {
            Ok(samples) => FileState::Present(vec![samples]),
            Err(error) => FileState::Broken(error.to_string()),
        },
    };
    SurveyedFile {
        file: DataFile { name, sha256: "" },
        path,
        state,
    }
}

/// The files of `files` that are not there.
pub fn missing(files: &[SurveyedFile]) -> Vec<&SurveyedFile> {
    files
        .iter()
        .filter(|f| f.state == FileState::Missing)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/data")
    }

    #[test]
    fn the_fixture_declares_its_sizes() {
        let survey = Survey::of(DataSource::FashionMnist, &fixture());
        assert_eq!(survey.train_samples(), Some(600));
        assert_eq!(survey.test_samples(), Some(200));
        assert!(survey.problems().is_empty(), "{:?}", survey.problems());
        assert!(missing(&survey.files).is_empty());
        assert_eq!(survey.files[0].state, FileState::Present(vec![600, 28, 28]));
    }

    #[test]
    fn missing_truncated_and_mismatched_files_are_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("fashion-mnist");
        std::fs::create_dir(&folder).unwrap();
        let from = fixture().join("fashion-mnist");
        // Train images of the fixture with test labels: 600 against 200.
        std::fs::copy(
            from.join("train-images-idx3-ubyte.gz"),
            folder.join("train-images-idx3-ubyte.gz"),
        )
        .unwrap();
        std::fs::copy(
            from.join("t10k-labels-idx1-ubyte.gz"),
            folder.join("train-labels-idx1-ubyte.gz"),
        )
        .unwrap();
        std::fs::write(folder.join("t10k-images-idx3-ubyte.gz"), b"\x1f\x8b\x08").unwrap();
        let survey = Survey::of(DataSource::FashionMnist, dir.path());
        assert_eq!(missing(&survey.files).len(), 1);
        assert_eq!(
            missing(&survey.files)[0].file.name,
            "t10k-labels-idx1-ubyte.gz"
        );
        assert_eq!(survey.train_samples(), None);
        let problems = survey.problems();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("corrupt or truncated"), "{problems:?}");
        assert!(
            problems[1].contains("declares 600 images but"),
            "{problems:?}"
        );
        assert!(problems[1].contains("declares 200 labels"), "{problems:?}");
    }
}
