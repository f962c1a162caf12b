//! Reader for LEAF's JSON files: FEMNIST and Shakespeare, as LEAF's own
//! scripts write them (`data/<name>/data/{train,test}/*.json` in LEAF's
//! tree; `<name>/train/*.json` and `<name>/test/*.json` under cohort's
//! `data_path`).
//!
//! A file is one object: `users` (names), `num_samples` (one count a user),
//! `user_data` (for each user, `x` and `y` lists of that many samples), and
//! possibly `hierarchies`, which is ignored. What is checked before a sample
//! is kept: the file is a regular file of bounded size and valid JSON; the
//! three fields agree (as many counts as users, every user's data there,
//! no data of a user not listed, `x` and `y` of the declared length); every
//! sample has the data set's shape and values (FEMNIST: 784 values in
//! [0, 1], a label below 62; Shakespeare: 80 characters of LEAF's
//! vocabulary and one more for `y`). An error names the file and the user.
//!
//! FEMNIST's values are what LEAF's `data_to_json.py` writes: NIST's
//! grayscale pixels divided by 255, not inverted, so paper is 1.0 and ink
//! near 0 (Plato's FEMNIST normalization, mean 0.9637, says the same).
//! Labels are LEAF's: 0–9 digits, 10–35 upper case, 36–61 lower case.
//!
//! Each sample keeps its user ([`Users`]), for partitions that follow
//! LEAF's natural split of one client a writer or role.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{Dataset, Normalization, Splits};

/// LEAF's `ALL_LETTERS` (`models/utils/language_utils.py`): the 80
/// characters of Shakespeare's samples, a character's token id its index.
pub const VOCABULARY: &str =
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}";

/// Characters of one Shakespeare sample (LEAF's `SEQ_LEN`).
pub const SEQUENCE_LENGTH: usize = 80;

/// FEMNIST's 28 × 28 values of one image.
const FEMNIST_VALUES: usize = 28 * 28;
const FEMNIST_CLASSES: u64 = 62;

/// Larger than any file LEAF's scripts write (FEMNIST's hold up to 100
/// writers, a few hundred MB); refused before it is read.
const MAX_FILE_BYTES: u64 = crate::fsutil::MAX_READ_BYTES;
/// Users of one file, and samples of one split: far above LEAF's (3,550
/// writers and 805,263 images in all FEMNIST; 4.2 million Shakespeare
/// samples), a bound on what a hostile file costs.
const MAX_USERS: usize = 100_000;
const MAX_SAMPLES: usize = 8_000_000;

/// Which of LEAF's data sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leaf {
    Femnist,
    Shakespeare,
}

impl Leaf {
    /// The data set's folder under `data_path`, LEAF's own name for it.
    pub fn folder(self) -> &'static str {
        match self {
            Leaf::Femnist => "femnist",
            Leaf::Shakespeare => "shakespeare",
        }
    }

    /// Where the files come from: LEAF publishes scripts, not the files.
    pub fn how_to_make(self) -> &'static str {
        match self {
            Leaf::Femnist => {
                "LEAF's scripts make them from NIST's data (in LEAF's repository, \
                 data/femnist: ./preprocess.sh, for example with -s niid --sf 1.0 -k 0 -t sample), \
                 and write them to data/femnist/data/train and data/femnist/data/test; copy those \
                 two folders to femnist/train and femnist/test"
            }
            Leaf::Shakespeare => {
                "LEAF's scripts make them from the Complete Works (in LEAF's repository, \
                 data/shakespeare: ./preprocess.sh, for example with -s niid --sf 1.0 -k 0 -t \
                 sample), and write them to data/shakespeare/data/train and \
                 data/shakespeare/data/test; copy those two folders to shakespeare/train and \
                 shakespeare/test"
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeafError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not one of LEAF's JSON files: {reason}")]
    Json { path: PathBuf, reason: String },
    #[error("{path}: user `{user}`: {reason}")]
    User {
        path: PathBuf,
        user: String,
        reason: String,
    },
    #[error("{folder}: no .json files")]
    NoFiles { folder: PathBuf },
}

/// Whose each sample is: `names[of_sample[i]]` is sample `i`'s user (a
/// FEMNIST writer, a Shakespeare role), names in order of first sample.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Users {
    pub names: Vec<String>,
    pub of_sample: Vec<u32>,
}

/// One split's samples and their users.
#[derive(Debug, Clone, PartialEq)]
pub struct LeafSplit {
    pub data: Dataset,
    pub users: Users,
}

/// Both splits.
#[derive(Debug, Clone, PartialEq)]
pub struct LeafData {
    pub train: LeafSplit,
    pub test: LeafSplit,
}

impl LeafData {
    /// The samples, with each training sample's user.
    pub fn splits(self) -> Splits {
        Splits {
            train: self.train.data,
            test: self.test.data,
            train_users: Some(self.train.users.of_sample),
        }
    }
}

/// The `.json` files of `folder`, sorted by name so that every process
/// reads the samples in one order; `None` when it cannot be listed.
pub fn json_files(folder: &Path) -> Option<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(folder)
        .ok()?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "json") && path.is_file())
        .collect();
    files.sort();
    Some(files)
}

/// `folder/train/*.json` and `folder/test/*.json`.
pub fn load(
    kind: Leaf,
    folder: &Path,
    normalization: Option<&Normalization>,
) -> Result<LeafData, LeafError> {
    Ok(LeafData {
        train: read_split(kind, &folder.join("train"), normalization)?,
        test: read_split(kind, &folder.join("test"), normalization)?,
    })
}

/// Every `.json` file of `folder` as one split, in file then `users` order.
pub fn read_split(
    kind: Leaf,
    folder: &Path,
    normalization: Option<&Normalization>,
) -> Result<LeafSplit, LeafError> {
    let files = json_files(folder).unwrap_or_default();
    if files.is_empty() {
        return Err(LeafError::NoFiles {
            folder: folder.to_path_buf(),
        });
    }
    let mut split = Builder::new(kind);
    for path in &files {
        let bytes =
            crate::fsutil::read_bounded(path, MAX_FILE_BYTES).map_err(|source| LeafError::Io {
                path: path.clone(),
                source,
            })?;
        split.add_file(path, &bytes)?;
    }
    split.finish(normalization)
}

/// The samples of a split's files from their `num_samples` alone (the rest
/// is scanned, not kept): what `cohort check` reports.
pub fn count_samples(folder: &Path) -> Result<usize, LeafError> {
    #[derive(Deserialize)]
    struct Counts {
        num_samples: Vec<u64>,
    }
    let files = json_files(folder).unwrap_or_default();
    if files.is_empty() {
        return Err(LeafError::NoFiles {
            folder: folder.to_path_buf(),
        });
    }
    let mut samples = 0u64;
    for path in &files {
        let io = |source| LeafError::Io {
            path: path.clone(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let reader = std::io::Read::take(std::io::BufReader::new(file), MAX_FILE_BYTES);
        let counts: Counts = serde_json::from_reader(reader).map_err(|e| LeafError::Json {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        samples = counts
            .num_samples
            .iter()
            .fold(samples, |sum, &n| sum.saturating_add(n));
    }
    Ok(samples as usize)
}

#[derive(Deserialize)]
struct LeafFile<X, Y> {
    users: Vec<String>,
    num_samples: Vec<u64>,
    user_data: BTreeMap<String, UserData<X, Y>>,
}

#[derive(Deserialize)]
struct UserData<X, Y> {
    x: Vec<X>,
    y: Vec<Y>,
}

/// A split as its files are read.
struct Builder {
    kind: Leaf,
    inputs: Vec<f32>,
    labels: Vec<u32>,
    users: Users,
    ids: HashMap<String, u32>,
}

impl Builder {
    fn new(kind: Leaf) -> Self {
        Self {
            kind,
            inputs: Vec::new(),
            labels: Vec::new(),
            users: Users::default(),
            ids: HashMap::new(),
        }
    }

    /// The samples of one file, appended after checking all of them.
    fn add_file(&mut self, path: &Path, bytes: &[u8]) -> Result<(), LeafError> {
        let json = |e: serde_json::Error| LeafError::Json {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        match self.kind {
            Leaf::Femnist => {
                let file: LeafFile<Vec<f32>, u64> = serde_json::from_slice(bytes).map_err(json)?;
                self.add_users(path, file, femnist_sample)
            }
            Leaf::Shakespeare => {
                let file: LeafFile<String, String> = serde_json::from_slice(bytes).map_err(json)?;
                self.add_users(path, file, shakespeare_sample)
            }
        }
    }

    /// Checks `file`'s fields against each other, then each user's samples
    /// through `sample`, which appends one sample's values and returns its
    /// label, or says what is wrong with it.
    fn add_users<X, Y>(
        &mut self,
        path: &Path,
        mut file: LeafFile<X, Y>,
        sample: fn(&X, &Y, &mut Vec<f32>) -> Result<u32, String>,
    ) -> Result<(), LeafError> {
        let structure = |reason: String| LeafError::Json {
            path: path.to_path_buf(),
            reason,
        };
        if file.users.len() != file.num_samples.len() || file.users.len() > MAX_USERS {
            return Err(structure(format!(
                "{} users and {} num_samples (at most {MAX_USERS} users a file, one count each)",
                file.users.len(),
                file.num_samples.len()
            )));
        }
        if let Some(extra) = file.user_data.keys().find(|k| !file.users.contains(k)) {
            return Err(structure(format!(
                "user_data has `{extra}`, who is not in users"
            )));
        }
        for (user, &declared) in file.users.iter().zip(&file.num_samples) {
            let bad = |reason: String| LeafError::User {
                path: path.to_path_buf(),
                user: user.clone(),
                reason,
            };
            let data = file
                .user_data
                .remove(user)
                .ok_or_else(|| bad("listed in users, twice or without user_data".to_owned()))?;
            if data.x.len() as u64 != declared || data.y.len() as u64 != declared {
                return Err(bad(format!(
                    "num_samples says {declared}, but x has {} and y {}",
                    data.x.len(),
                    data.y.len()
                )));
            }
            if self.labels.len() + data.y.len() > MAX_SAMPLES {
                return Err(bad(format!("the split exceeds {MAX_SAMPLES} samples")));
            }
            let id = self.user_id(user);
            for (index, (x, y)) in data.x.iter().zip(&data.y).enumerate() {
                let label = sample(x, y, &mut self.inputs)
                    .map_err(|reason| bad(format!("sample {index}: {reason}")))?;
                self.labels.push(label);
                self.users.of_sample.push(id);
            }
        }
        Ok(())
    }

    fn user_id(&mut self, user: &str) -> u32 {
        if let Some(&id) = self.ids.get(user) {
            return id;
        }
        let id = self.users.names.len() as u32;
        self.users.names.push(user.to_owned());
        self.ids.insert(user.to_owned(), id);
        id
    }

    fn finish(mut self, normalization: Option<&Normalization>) -> Result<LeafSplit, LeafError> {
        let sample_shape = match self.kind {
            Leaf::Femnist => vec![1, 28, 28],
            Leaf::Shakespeare => vec![SEQUENCE_LENGTH],
        };
        if let Some(normalization) = normalization {
            normalization
                .apply(&mut self.inputs, &sample_shape)
                .expect("one pair for one channel");
        }
        Ok(LeafSplit {
            data: Dataset {
                inputs: self.inputs,
                labels: self.labels,
                sample_shape,
            },
            users: self.users,
        })
    }
}

// The types are `LeafFile`'s parameters, so `add_users` can take either.
#[allow(clippy::ptr_arg)]
fn femnist_sample(x: &Vec<f32>, y: &u64, inputs: &mut Vec<f32>) -> Result<u32, String> {
    if x.len() != FEMNIST_VALUES {
        return Err(format!(
            "x has {} values, expected {FEMNIST_VALUES} (28 × 28)",
            x.len()
        ));
    }
    if let Some(value) = x.iter().find(|v| !(0.0..=1.0).contains(*v)) {
        return Err(format!("x has {value}, expected values in [0, 1]"));
    }
    if *y >= FEMNIST_CLASSES {
        return Err(format!(
            "y is {y}, expected a class below {FEMNIST_CLASSES}"
        ));
    }
    inputs.extend_from_slice(x);
    Ok(*y as u32)
}

#[allow(clippy::ptr_arg)]
fn shakespeare_sample(x: &String, y: &String, inputs: &mut Vec<f32>) -> Result<u32, String> {
    let token = |c: char| VOCABULARY.chars().position(|v| v == c);
    let length = x.chars().count();
    if length != SEQUENCE_LENGTH {
        return Err(format!(
            "x has {length} characters, expected {SEQUENCE_LENGTH}"
        ));
    }
    let mut y_chars = y.chars();
    let (Some(next), None) = (y_chars.next(), y_chars.next()) else {
        return Err(format!("y is {y:?}, expected one character"));
    };
    let label = token(next).ok_or_else(|| format!("y is {next:?}, not in LEAF's vocabulary"))?;
    let start = inputs.len();
    for c in x.chars() {
        match token(c) {
            Some(id) => inputs.push(id as f32),
            None => {
                inputs.truncate(start);
                return Err(format!("x has {c:?}, not in LEAF's vocabulary"));
            }
        }
    }
    Ok(label as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn femnist_file(users: &[(&str, usize)]) -> String {
        let names: Vec<String> = users.iter().map(|(u, _)| format!("{u:?}")).collect();
        let counts: Vec<String> = users.iter().map(|(_, n)| n.to_string()).collect();
        let data: Vec<String> = users
            .iter()
            .map(|(user, n)| {
                let image = format!("[{}]", vec!["0.5"; FEMNIST_VALUES].join(","));
                let xs = vec![image; *n].join(",");
                let ys = (0..*n).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
                format!("{user:?}: {{\"x\": [{xs}], \"y\": [{ys}]}}")
            })
            .collect();
        format!(
            "{{\"users\": [{}], \"num_samples\": [{}], \"user_data\": {{{}}}}}",
            names.join(","),
            counts.join(","),
            data.join(",")
        )
    }

    fn parse(kind: Leaf, text: &str) -> Result<LeafSplit, LeafError> {
        let mut builder = Builder::new(kind);
        builder.add_file(Path::new("all_data_0.json"), text.as_bytes())?;
        builder.finish(None)
    }

    #[test]
    fn femnist_samples_keep_their_writers() {
        let split = parse(Leaf::Femnist, &femnist_file(&[("f0001", 2), ("f0002", 1)])).unwrap();
        assert_eq!(split.data.labels, [0, 1, 0]);
        assert_eq!(split.data.sample_shape, [1, 28, 28]);
        assert_eq!(split.data.inputs.len(), 3 * FEMNIST_VALUES);
        assert_eq!(split.users.names, ["f0001", "f0002"]);
        assert_eq!(split.users.of_sample, [0, 0, 1]);
    }

    #[test]
    fn malformed_femnist_files_name_the_file_and_the_user() {
        let good = femnist_file(&[("f0001", 2)]);
        let cases = [
            (
                good.replace("[2]", "[3]"),
                "user `f0001`: num_samples says 3",
            ),
            (
                good.replace("\"y\": [0,1]", "\"y\": [0,62]"),
                "sample 1: y is 62",
            ),
            (good.replacen("0.5", "1.5", 1), "sample 0: x has 1.5"),
            (good.replacen("0.5,", "", 1), "x has 783 values"),
            (
                good.replace("[\"f0001\"]", "[\"f0001\", \"f9\"]"),
                "2 users and 1 num_samples",
            ),
            (
                good.replace("\"users\": [\"f0001\"]", "\"users\": [\"f9\"]"),
                "`f0001`, who is not",
            ),
            (
                good[..good.len() - 3].to_owned(),
                "not one of LEAF's JSON files",
            ),
        ];
        for (text, needle) in cases {
            let error = parse(Leaf::Femnist, &text).unwrap_err().to_string();
            assert!(error.starts_with("all_data_0.json: "), "{error}");
            assert!(error.contains(needle), "{needle}: {error}");
        }
    }

    #[test]
    fn shakespeare_characters_are_token_ids_of_leafs_vocabulary() {
        assert_eq!(VOCABULARY.chars().count(), 80);
        let x = "ab".repeat(40);
        let text = format!(
            "{{\"users\": [\"ROMEO\"], \"hierarchies\": [], \"num_samples\": [1], \
             \"user_data\": {{\"ROMEO\": {{\"x\": [{x:?}], \"y\": [\"\\n\"]}}}}}}"
        );
        let split = parse(Leaf::Shakespeare, &text).unwrap();
        // 'a' is the 54th character of the vocabulary, 'b' the 55th.
        assert_eq!(&split.data.inputs[..2], [53.0, 54.0]);
        assert_eq!(split.data.labels, [0]);
        assert_eq!(split.users.names, ["ROMEO"]);
        for (bad, needle) in [
            (text.replace(&x, &x[1..]), "x has 79 characters"),
            (text.replacen("ab", "a~", 1), "x has '~', not in LEAF's"),
            (text.replace("\"\\n\"", "\"ab\""), "expected one character"),
        ] {
            let error = parse(Leaf::Shakespeare, &bad).unwrap_err().to_string();
            assert!(error.contains("user `ROMEO`: sample 0"), "{error}");
            assert!(error.contains(needle), "{needle}: {error}");
        }
    }

    proptest::proptest! {
        /// Any bytes, and any cut of a valid file, give samples or an error
        /// naming the file, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200),
            cut in 0usize..4000,
        ) {
            for kind in [Leaf::Femnist, Leaf::Shakespeare] {
                let mut builder = Builder::new(kind);
                if let Err(error) = builder.add_file(Path::new("f.json"), &bytes) {
                    proptest::prop_assert!(error.to_string().starts_with("f.json: "));
                }
                let valid = femnist_file(&[("u", 1)]);
                let cut = &valid.as_bytes()[..cut.min(valid.len())];
                let result = Builder::new(kind).add_file(Path::new("f.json"), cut);
                proptest::prop_assert!(result.is_err() || cut.len() == valid.len());
            }
        }
    }

    #[test]
    fn a_split_without_files_says_which_folder() {
        let dir = tempfile::tempdir().unwrap();
        let error = read_split(Leaf::Femnist, dir.path(), None)
            .unwrap_err()
            .to_string();
        assert!(error.ends_with("no .json files"), "{error}");
    }
}
