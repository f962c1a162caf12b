//! What a data folder holds, from the files' headers alone: which of a data
//! set's files are there and how many samples each declares. `cohort check`
//! uses it to find a missing, truncated or mismatched file, or partitions the
//! training set cannot hold, before a run reads anything.

use std::path::{Path, PathBuf};

use super::idx::read_idx_dims;
use super::{DataFile, DataSource};

/// One of a data set's four files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SurveyedFile {
    pub file: DataFile,
    pub path: PathBuf,
    pub state: FileState,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileState {
    Missing,
    /// The dimensions its header declares: `[samples, rows, cols]` for
    /// images, `[samples]` for labels.
    Present(Vec<usize>),
    /// Unreadable or not the IDX file it should be.
    Broken(String),
}

/// The four files of `source` under `root` (train images, train labels, test
/// images, test labels).
#[derive(Debug, Clone)]
pub struct Survey {
    pub folder: PathBuf,
    pub files: Vec<SurveyedFile>,
}

impl Survey {
    pub fn of(source: DataSource, root: &Path) -> Self {
        let folder = root.join(source.folder());
        let files = source
            .files()
            .iter()
            .map(|file| {
                let path = folder.join(file.name);
                let rank = if file.name.contains("images") { 3 } else { 1 };
                let state = if !path.is_file() {
                    FileState::Missing
                } else {
                    match read_idx_dims(&path, rank) {
                        Ok(dims) => FileState::Present(dims),
                        Err(error) => FileState::Broken(error.to_string()),
                    }
                };
                SurveyedFile {
                    file: *file,
                    path,
                    state,
                }
            })
            .collect();
        Self { folder, files }
    }

    /// Samples of the training set, when both its files are there and agree.
    pub fn train_samples(&self) -> Option<usize> {
        self.split_samples(0)
    }

    pub fn test_samples(&self) -> Option<usize> {
        self.split_samples(2)
    }

    fn split_samples(&self, first: usize) -> Option<usize> {
        match (&self.files[first].state, &self.files[first + 1].state) {
            (FileState::Present(images), FileState::Present(labels))
                if images.first() == labels.first() =>
            {
                images.first().copied()
            }
            _ => None,
        }
    }

    /// Every problem a run would meet reading these files, one line each:
    /// broken files, images and labels of one split that disagree in count.
    /// Missing files are not problems here: they may be downloaded.
    pub fn problems(&self) -> Vec<String> {
        self.problems_of(&[0, 2])
    }

    /// The test split's files alone: those a run whose clients all bring
    /// their own data reads.
    pub fn test_files(&self) -> &[SurveyedFile] {
        &self.files[2..]
    }

    /// The problems of the test split's files alone (see `problems`).
    pub fn test_problems(&self) -> Vec<String> {
        self.problems_of(&[2])
    }

    /// Problems of the splits whose image file is at the indices `firsts`.
    fn problems_of(&self, firsts: &[usize]) -> Vec<String> {
        let mut problems: Vec<String> = firsts
            .iter()
            .flat_map(|&first| &self.files[first..first + 2])
            .filter_map(|f| match &f.state {
                FileState::Broken(reason) => Some(reason.clone()),
                _ => None,
            })
            .collect();
        for &first in firsts {
            if let (FileState::Present(images), FileState::Present(labels)) =
                (&self.files[first].state, &self.files[first + 1].state)
                && images.first() != labels.first()
            {
                problems.push(format!(
                    "{} declares {} images but {} declares {} labels",
                    self.files[first].path.display(),
                    images.first().copied().unwrap_or(0),
                    self.files[first + 1].path.display(),
                    labels.first().copied().unwrap_or(0),
                ));
            }
        }
        problems
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
