//! File data sets: samples of any shape and their classes read from one file
//! the config names (`data.train_file`), not from a built-in catalogue.
//!
//! - `CSV`: a header row, a label column (`data.label_column`, default
//!   `label`), optionally a column of integer client ids
//!   (`data.client_column`), every other column a numeric feature: samples of
//!   shape `[features]`.
//! - `NPZ`: NumPy's `.npz` with arrays `x` (`[N, ...]`, any float, integer or
//!   bool dtype, converted to f32), `y` (`[N]` integers), optionally `x_test`
//!   and `y_test`, and `client_id` (`[N]` integers). Read with the `npyz`
//!   crate (its `npz` feature): it gives each array's header (dtype, shape,
//!   order) before any data is read, so the shape is bounded and checked
//!   first, it needs no `ndarray`, and its `zip` (0.6) is already in the
//!   workspace's lock file; `ndarray-npy` would bring `ndarray` 0.17 and a
//!   second `zip`.
//! - `Safetensors`: tensors `inputs` (`[N, ...]`, any float or integer
//!   dtype), `labels` (`[N]` integers), optionally `test_inputs`,
//!   `test_labels` and `client_id`, read with the `safetensors` crate.
//!
//! The test set is, in order: the file's own test arrays, `data.test_file`
//! (the same format, its `x`/`y`, `inputs`/`labels` or rows), or a seeded
//! `data.test_fraction` of the training file; with none of them loading is
//! an error saying so.
//!
//! Every file is taken as hostile: its size, sample count and values are
//! bounded ([`MAX_FILE_BYTES`], [`MAX_SAMPLES`], [`MAX_VALUES`]), shapes are
//! multiplied with checked arithmetic, and every error names the file and
//! what was expected. Labels are whole numbers from 0: the data set's
//! classes are the largest label + 1 (over both splits).

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::{Dataset, Splits};
use crate::config::Data;

/// The largest file read: 2 GiB.
pub const MAX_FILE_BYTES: u64 = 2 << 30;
/// The most samples a split may have.
pub const MAX_SAMPLES: usize = 1 << 28;
/// The most values (samples × values per sample) a split may have: 4 GiB of
/// f32 (bounded before any array is read, so a lying header allocates no
/// more).
pub const MAX_VALUES: usize = 1 << 28;
/// The most columns a CSV file may have.
pub const MAX_COLUMNS: usize = 1 << 16;
/// The largest label: classes are at most this + 1.
pub const MAX_LABEL: u32 = 1 << 20;
/// The largest client id.
pub const MAX_CLIENT_ID: u32 = 1 << 24;

/// A file data set's format, by its `data.datasource` name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileFormat {
    Csv,
    Npz,
    Safetensors,
}

impl FileFormat {
    pub const ALL: [FileFormat; 3] = [FileFormat::Csv, FileFormat::Npz, FileFormat::Safetensors];

    /// Its `data.datasource` name.
    pub fn name(self) -> &'static str {
        match self {
            FileFormat::Csv => "CSV",
            FileFormat::Npz => "NPZ",
            FileFormat::Safetensors => "Safetensors",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// One line for listings.
    pub fn summary(self) -> &'static str {
        match self {
            FileFormat::Csv => {
                "rows of numeric features from data.train_file (CSV with a header), classes \
                 from its label column"
            }
            FileFormat::Npz => {
                "samples of any shape from data.train_file (NumPy .npz: x, y, optional \
                 x_test, y_test, client_id)"
            }
            FileFormat::Safetensors => {
                "samples of any shape from data.train_file (safetensors: inputs, labels, \
                 optional test_inputs, test_labels, client_id)"
            }
        }
    }
}

impl std::fmt::Display for FileFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a file data set's config says: the files (resolved against the data
/// folder) and how to read them.
#[derive(Debug, Clone, PartialEq)]
pub struct FileSpec {
    pub format: FileFormat,
    pub train_file: PathBuf,
    pub test_file: Option<PathBuf>,
    pub label_column: String,
    pub client_column: Option<String>,
    pub test_fraction: Option<f64>,
    pub split_seed: u64,
}

impl FileSpec {
    /// The spec of `data` when its `datasource` is a file format with a
    /// `train_file`, the files relative to `root` unless absolute.
    pub fn of(data: &Data, root: &Path) -> Option<Self> {
        let format = FileFormat::from_name(&data.datasource)?;
        let resolve = |file: &PathBuf| root.join(file);
        Some(Self {
            format,
            train_file: resolve(data.train_file.as_ref()?),
            test_file: data.test_file.as_ref().map(resolve),
            label_column: data
                .label_column
                .clone()
                .unwrap_or_else(|| "label".to_owned()),
            client_column: data.client_column.clone(),
            test_fraction: data.test_fraction,
            split_seed: data.split_seed.unwrap_or(data.random_seed),
        })
    }
}

/// A file that does not hold what it should: its path and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", path.display())]
pub struct FileError {
    pub path: PathBuf,
    pub message: String,
}

fn error(path: &Path, message: impl Into<String>) -> FileError {
    FileError {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Both splits of a file data set, and its classes (largest label + 1).
#[derive(Debug, Clone, PartialEq)]
pub struct FileData {
    pub splits: Splits,
    pub classes: usize,
}

/// One file's samples, with each sample's client when the file has them.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    pub data: Dataset,
    pub users: Option<Vec<u32>>,
    /// A CSV file's header; empty for the other formats.
    pub columns: Vec<String>,
}

/// What a file declares, from its headers (CSV: the whole file, which has no
/// other header): what `cohort check` shows before a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSurvey {
    pub sample_shape: Vec<usize>,
    pub train_samples: usize,
    /// `None` when the test set is cut from the training file.
    pub test_samples: Option<usize>,
    /// Whether the training samples name their clients.
    pub has_clients: bool,
}

/// Reads both splits as `spec` says.
pub fn load(spec: &FileSpec) -> Result<FileData, FileError> {
    let (train, own_test) = read_file(spec, &spec.train_file, true)?;
    let (train, test) = match (own_test, &spec.test_file, spec.test_fraction) {
        (Some(test), None, None) => (train, test),
        (Some(_), Some(file), _) => {
            return Err(error(
                &spec.train_file,
                format!(
                    "holds its own test arrays, and data.test_file names {} too: keep one",
                    file.display()
                ),
            ));
        }
        (Some(_), None, Some(_)) => {
            return Err(error(
                &spec.train_file,
                "holds its own test arrays, and data.test_fraction asks to cut one from the \
                 training set too: keep one",
            ));
        }
        (None, Some(file), _) => {
            let (test, _) = read_file(spec, file, false)?;
            same_columns(spec, &train, &test, file)?;
            if test.data.sample_shape != train.data.sample_shape {
                return Err(error(
                    file,
                    format!(
                        "its samples are {:?}, but those of {} are {:?}",
                        test.data.sample_shape,
                        spec.train_file.display(),
                        train.data.sample_shape
                    ),
                ));
            }
            (train, test.data)
        }
        (None, None, Some(fraction)) => {
            split_off(&spec.train_file, train, fraction, spec.split_seed)?
        }
        (None, None, None) => {
            return Err(error(&spec.train_file, no_test_set(spec.format)));
        }
    };
    let classes = train
        .data
        .labels
        .iter()
        .chain(&test.labels)
        .max()
        .map_or(0, |&max| max as usize + 1);
    Ok(FileData {
        splits: Splits {
            train: train.data,
            test,
            train_users: train.users.map(|users| dense(&users)),
        },
        classes,
    })
}

/// Client ids renumbered 0, 1, … in their order, so that ids as large as
/// [`MAX_CLIENT_ID`] cost the natural sampler no more than their count; the
/// users keep their order, so its partitions are those of the ids as written.
pub fn dense(users: &[u32]) -> Vec<u32> {
    let mut ids = users.to_vec();
    ids.sort_unstable();
    ids.dedup();
    users
        .iter()
        .map(|id| ids.binary_search(id).map_or(0, |rank| rank as u32))
        .collect()
}

fn no_test_set(format: FileFormat) -> String {
    let own = match format {
        FileFormat::Csv => "",
        FileFormat::Npz => "has no x_test and y_test arrays, and ",
        FileFormat::Safetensors => "has no test_inputs and test_labels tensors, and ",
    };
    format!(
        "{own}the config names no test set: set data.test_file, or data.test_fraction (0 < f < 1) \
         to hold out part of the training set"
    )
}

/// What `spec`'s files declare, from their headers.
pub fn survey(spec: &FileSpec) -> Result<FileSurvey, FileError> {
    let (train, own_test, has_clients) = match spec.format {
        FileFormat::Csv => {
            let (part, _) = read_file(spec, &spec.train_file, true)?;
            let shape = part.data.sample_shape.clone();
            ((part.data.len(), shape), None, part.users.is_some())
        }
        FileFormat::Npz => npz_survey(&spec.train_file)?,
        FileFormat::Safetensors => safetensors_survey(&spec.train_file)?,
    };
    let test_samples = match (&spec.test_file, own_test) {
        (_, Some(test)) => Some(test),
        (Some(file), None) => Some(match spec.format {
            FileFormat::Csv => {
                let train = read_file(spec, &spec.train_file, true)?.0;
                let test = read_file(spec, file, false)?.0;
                same_columns(spec, &train, &test, file)?;
                test.data.len()
            }
            FileFormat::Npz => npz_survey(file)?.0.0,
            FileFormat::Safetensors => safetensors_survey(file)?.0.0,
        }),
        (None, None) => {
            if spec.test_fraction.is_none() {
                return Err(error(&spec.train_file, no_test_set(spec.format)));
            }
            None
        }
    };
    Ok(FileSurvey {
        sample_shape: train.1,
        train_samples: train.0,
        test_samples,
        has_clients,
    })
}

/// One file as an own-data client holds it (`cohort client --data`): its
/// samples and its own test part, with `label_column` naming a CSV file's
/// labels; its client ids, if any, are checked but not kept (all of it is
/// one client's).
pub fn read_own(
    path: &Path,
    format: FileFormat,
    label_column: &str,
) -> Result<(Dataset, Option<Dataset>), FileError> {
    let spec = FileSpec {
        format,
        train_file: path.to_path_buf(),
        test_file: None,
        label_column: label_column.to_owned(),
        client_column: None,
        test_fraction: None,
        split_seed: 0,
    };
    let (part, test) = read_file(&spec, path, true)?;
    Ok((part.data, test))
}

/// An NPZ file's training and test sample counts, from its arrays' headers.
pub fn npz_counts(path: &Path) -> Result<(usize, Option<usize>), FileError> {
    let ((train, _), test, _) = npz_survey(path)?;
    Ok((train, test))
}

/// One file: its training part, and its own test part where the format has
/// one (`train` false: a test file, whose client ids are ignored).
fn read_file(
    spec: &FileSpec,
    path: &Path,
    train: bool,
) -> Result<(Part, Option<Dataset>), FileError> {
    match spec.format {
        FileFormat::Csv => {
            let text = read_bounded(path)?;
            let text = String::from_utf8(text)
                .map_err(|e| error(path, format!("is not UTF-8 text: {e}")))?;
            let table = parse_csv(
                &text,
                path,
                &spec.label_column,
                spec.client_column.as_deref(),
            )?;
            let data = Dataset::new(table.features, table.labels, vec![table.feature_count])
                .map_err(|e| error(path, e.to_string()))?;
            Ok((
                Part {
                    data,
                    users: table.clients.filter(|_| train),
                    columns: table.header,
                },
                None,
            ))
        }
        FileFormat::Npz => read_npz(path, train),
        FileFormat::Safetensors => read_safetensors(path, train),
    }
}

/// A CSV test file's header must be the training file's.
fn same_columns(spec: &FileSpec, train: &Part, test: &Part, file: &Path) -> Result<(), FileError> {
    if train.columns == test.columns {
        return Ok(());
    }
    Err(error(
        file,
        format!(
            "its header `{}` is not the header `{}` of {}: the test file needs the training \
             file's columns",
            test.columns.join(","),
            train.columns.join(","),
            spec.train_file.display()
        ),
    ))
}

/// The file's bytes, refused past [`MAX_FILE_BYTES`].
fn read_bounded(path: &Path) -> Result<Vec<u8>, FileError> {
    let file =
        std::fs::File::open(path).map_err(|e| error(path, format!("cannot be read: {e}")))?;
    let size = file
        .metadata()
        .map_err(|e| error(path, format!("cannot be read: {e}")))?
        .len();
    check_size(path, size)?;
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| error(path, format!("cannot be read: {e}")))?;
    check_size(path, bytes.len() as u64)?;
    Ok(bytes)
}

fn check_size(path: &Path, size: u64) -> Result<(), FileError> {
    if size > MAX_FILE_BYTES {
        return Err(error(
            path,
            format!("is {size} bytes, more than the {MAX_FILE_BYTES} a data file may have"),
        ));
    }
    Ok(())
}

/// A CSV file's samples: features row-major, one label each.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// Every column's name, as the header has them.
    pub header: Vec<String>,
    pub feature_count: usize,
    pub features: Vec<f32>,
    pub labels: Vec<u32>,
    pub clients: Option<Vec<u32>>,
}

fn header_cells(line: &str) -> Vec<String> {
    let line = line.strip_prefix('\u{feff}').unwrap_or(line);
    line.trim_end_matches('\r')
        .split(',')
        .map(|cell| unquote(cell.trim()).to_owned())
        .collect()
}

fn unquote(cell: &str) -> &str {
    cell.strip_prefix('"')
        .and_then(|c| c.strip_suffix('"'))
        .unwrap_or(cell)
}

/// Parses CSV text (from `path`, for errors): a header row naming every
/// column, then one row of cells a sample. Cells are separated by commas and
/// may be surrounded by blanks or double quotes; blank lines are skipped.
/// The label column holds whole numbers ≥ 0 (`3` or `3.0`), the client
/// column (when named) integers ≥ 0, every other column finite numbers.
pub fn parse_csv(
    text: &str,
    path: &Path,
    label_column: &str,
    client_column: Option<&str>,
) -> Result<Table, FileError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let Some((_, header_line)) = lines.next() else {
        return Err(error(
            path,
            "is empty: expected a header row naming the columns",
        ));
    };
    let header = header_cells(header_line);
    if header.len() > MAX_COLUMNS {
        return Err(error(
            path,
            format!("has {} columns, more than {MAX_COLUMNS}", header.len()),
        ));
    }
    if let Some(empty) = header.iter().position(String::is_empty) {
        return Err(error(
            path,
            format!("line 1: column {} has no name", empty + 1),
        ));
    }
    for (index, name) in header.iter().enumerate() {
        if header[..index].contains(name) {
            return Err(error(
                path,
                format!("line 1: column `{name}` is named twice"),
            ));
        }
    }
    let find = |name: &str, key: &str| {
        header.iter().position(|c| c == name).ok_or_else(|| {
            error(
                path,
                format!(
                    "has no column `{name}` ({key}); its columns are {}",
                    header.join(", ")
                ),
            )
        })
    };
    let label_at = find(label_column, "data.label_column")?;
    let client_at = client_column
        .map(|name| find(name, "data.client_column"))
        .transpose()?;
    if client_at == Some(label_at) {
        return Err(error(
            path,
            format!("`{label_column}` cannot be both the label and the client column"),
        ));
    }
    let feature_count = header.len() - 1 - usize::from(client_at.is_some());
    if feature_count == 0 {
        return Err(error(
            path,
            "has no feature column besides the label (and client) column",
        ));
    }
    let mut features = Vec::new();
    let mut labels = Vec::new();
    let mut clients = client_at.map(|_| Vec::new());
    for (index, line) in lines {
        let number = index + 1;
        if labels.len() >= MAX_SAMPLES || features.len() + feature_count > MAX_VALUES {
            return Err(error(
                path,
                format!(
                    "line {number}: more than {MAX_SAMPLES} rows or {MAX_VALUES} values, the \
                     most a data file may have"
                ),
            ));
        }
        let cells: Vec<&str> = line.trim_end_matches('\r').split(',').collect();
        if cells.len() != header.len() {
            return Err(error(
                path,
                format!(
                    "line {number}: {} cells, but the header has {} columns",
                    cells.len(),
                    header.len()
                ),
            ));
        }
        for (column, cell) in cells.iter().enumerate() {
            let value = unquote(cell.trim());
            let bad = |what: &str| {
                error(
                    path,
                    format!(
                        "line {number}, column `{}`: `{value}` is not {what}",
                        header[column]
                    ),
                )
            };
            if column == label_at {
                labels.push(whole_number(value, MAX_LABEL).ok_or_else(|| {
                    bad(&format!("a label (a whole number from 0 to {MAX_LABEL})"))
                })?);
            } else if Some(column) == client_at {
                let id = whole_number(value, MAX_CLIENT_ID).ok_or_else(|| {
                    bad(&format!(
                        "a client id (a whole number from 0 to {MAX_CLIENT_ID})"
                    ))
                })?;
                if let Some(clients) = clients.as_mut() {
                    clients.push(id);
                }
            } else {
                let number: f32 = value
                    .parse()
                    .ok()
                    .filter(|x: &f32| x.is_finite())
                    .ok_or_else(|| bad("a finite number"))?;
                features.push(number);
            }
        }
    }
    if labels.is_empty() {
        return Err(error(path, "has a header but no rows"));
    }
    Ok(Table {
        header,
        feature_count,
        features,
        labels,
        clients,
    })
}

/// `value` as a whole number in `0..=max` (`3` or `3.0`).
fn whole_number(value: &str, max: u32) -> Option<u32> {
    if let Ok(n) = value.parse::<u32>() {
        return (n <= max).then_some(n);
    }
    let x: f64 = value.parse().ok()?;
    (x.is_finite() && x.fract() == 0.0 && (0.0..=f64::from(max)).contains(&x)).then_some(x as u32)
}

/// Moves a seeded `fraction` of `train`'s samples into a test set.
fn split_off(
    path: &Path,
    train: Part,
    fraction: f64,
    seed: u64,
) -> Result<(Part, Dataset), FileError> {
    let count = train.data.len();
    let test_count = (count as f64 * fraction).round() as usize;
    if !(fraction > 0.0 && fraction < 1.0) || test_count == 0 || test_count >= count {
        return Err(error(
            path,
            format!(
                "data.test_fraction = {fraction} of its {count} samples leaves no training or no \
                 test sample"
            ),
        ));
    }
    let mut order: Vec<u32> = (0..count as u32).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let (test_indices, train_indices) = order.split_at(test_count);
    let mut test_indices = test_indices.to_vec();
    let mut train_indices = train_indices.to_vec();
    // In the file's order within each split.
    test_indices.sort_unstable();
    train_indices.sort_unstable();
    let take = |indices: &[u32]| {
        let mut inputs = Vec::new();
        let mut labels = Vec::new();
        train.data.gather(indices, &mut inputs, &mut labels);
        Dataset {
            inputs,
            labels: labels.into_iter().map(|l| l as u32).collect(),
            sample_shape: train.data.sample_shape.clone(),
        }
    };
    let users = train
        .users
        .as_ref()
        .map(|users| train_indices.iter().map(|&i| users[i as usize]).collect());
    Ok((
        Part {
            data: take(&train_indices),
            users,
            columns: train.columns.clone(),
        },
        take(&test_indices),
    ))
}

/// Checks an array's shape: `[N, ...]` (`samples`) or `[N]` (labels), each
/// within bounds; the sample shape and N.
pub fn check_shape(
    path: &Path,
    name: &str,
    shape: &[usize],
    labels: bool,
) -> Result<(usize, Vec<usize>), FileError> {
    let bad = |why: String| error(path, format!("array `{name}` of shape {shape:?}: {why}"));
    let Some((&count, rest)) = shape.split_first() else {
        return Err(bad("expected [samples, ...], not a scalar".to_owned()));
    };
    if count == 0 {
        return Err(bad("has no samples".to_owned()));
    }
    if count > MAX_SAMPLES {
        return Err(bad(format!("more than {MAX_SAMPLES} samples")));
    }
    if labels {
        if !rest.is_empty() {
            return Err(bad("expected [samples], one label a sample".to_owned()));
        }
        return Ok((count, Vec::new()));
    }
    let sample_shape = if rest.is_empty() {
        vec![1]
    } else {
        rest.to_vec()
    };
    let values = sample_shape
        .iter()
        .try_fold(count, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= MAX_VALUES);
    match values {
        Some(0) => Err(bad("has no values".to_owned())),
        Some(_) => Ok((count, sample_shape)),
        None => Err(bad(format!("more than {MAX_VALUES} values"))),
    }
}

/// Labels (or client ids) from integers: whole numbers from 0 to `max`.
fn to_ids(path: &Path, name: &str, values: Vec<i64>, max: u32) -> Result<Vec<u32>, FileError> {
    values
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            u32::try_from(v).ok().filter(|&v| v <= max).ok_or_else(|| {
                error(
                    path,
                    format!("`{name}`[{index}] is {v}, not a whole number from 0 to {max}"),
                )
            })
        })
        .collect()
}

fn pair_up(
    path: &Path,
    (x, x_name, sample_shape): (Vec<f32>, &str, Vec<usize>),
    (y, y_name): (Vec<u32>, &str),
) -> Result<Dataset, FileError> {
    let per_sample: usize = sample_shape.iter().product();
    if x.len() != y.len() * per_sample {
        return Err(error(
            path,
            format!(
                "`{x_name}` has {} samples but `{y_name}` has {} labels",
                x.len() / per_sample.max(1),
                y.len()
            ),
        ));
    }
    Dataset::new(x, y, sample_shape).map_err(|e| error(path, e.to_string()))
}

fn with_users(
    path: &Path,
    data: &Dataset,
    users: Option<Vec<u32>>,
) -> Result<Option<Vec<u32>>, FileError> {
    match users {
        Some(users) if users.len() != data.len() => Err(error(
            path,
            format!(
                "`client_id` has {} entries but there are {} training samples",
                users.len(),
                data.len()
            ),
        )),
        other => Ok(other),
    }
}

// ---- NPZ ----

type Npz = npyz::npz::NpzArchive<std::io::BufReader<std::fs::File>>;

fn open_npz(path: &Path) -> Result<Npz, FileError> {
    let size = std::fs::metadata(path)
        .map_err(|e| error(path, format!("cannot be read: {e}")))?
        .len();
    check_size(path, size)?;
    npyz::npz::NpzArchive::open(path)
        .map_err(|e| error(path, format!("is not a NumPy .npz (zip) file: {e}")))
}

/// An array's header: its shape and dtype, checked; `None` when absent.
fn npz_array<'a>(
    path: &Path,
    npz: &'a mut Npz,
    name: &str,
) -> Result<Option<npyz::NpyFile<zip::read::ZipFile<'a>>>, FileError> {
    // What the zip declares the member to hold once inflated: a header that
    // asks for more values than that is refused before any is allocated.
    let member = npyz::npz::file_name_from_array_name(name);
    let stored = match npz.zip_archive().by_name(&member) {
        Ok(file) => file.size(),
        Err(zip::result::ZipError::FileNotFound) => return Ok(None),
        Err(e) => return Err(error(path, format!("array `{name}` cannot be read: {e}"))),
    };
    let array = npz
        .by_name(name)
        .map_err(|e| error(path, format!("array `{name}` is not a readable .npy: {e}")))?;
    let Some(array) = array else { return Ok(None) };
    if array.order() == npyz::Order::Fortran && array.shape().len() > 1 {
        return Err(error(
            path,
            format!(
                "array `{name}` is in Fortran order: save it C-contiguous \
                 (numpy.ascontiguousarray)"
            ),
        ));
    }
    let bytes = match array.dtype() {
        npyz::DType::Plain(ts) => ts.num_bytes().map(|b| b as u64),
        _ => None,
    };
    let needed = (array.shape().iter()).try_fold(bytes.unwrap_or(1), |n, &d| n.checked_mul(d));
    if needed.is_none_or(|needed| needed > stored) {
        return Err(error(
            path,
            format!(
                "array `{name}` of shape {:?} needs more bytes than the {stored} its zip member \
                 holds",
                array.shape()
            ),
        ));
    }
    Ok(Some(array))
}

fn npz_shape(
    path: &Path,
    name: &str,
    shape: &[u64],
    labels: bool,
) -> Result<(usize, Vec<usize>), FileError> {
    let shape: Option<Vec<usize>> = shape.iter().map(|&d| usize::try_from(d).ok()).collect();
    let shape =
        shape.ok_or_else(|| error(path, format!("array `{name}`: a dimension past usize")))?;
    check_shape(path, name, &shape, labels)
}

fn type_str(path: &Path, name: &str, dtype: &npyz::DType) -> Result<npyz::TypeStr, FileError> {
    match dtype {
        npyz::DType::Plain(ts) => Ok(ts.clone()),
        other => Err(error(
            path,
            format!(
                "array `{name}` has dtype {}, expected plain numbers",
                other.descr()
            ),
        )),
    }
}

fn npz_floats<R: Read>(
    path: &Path,
    name: &str,
    array: npyz::NpyFile<R>,
) -> Result<Vec<f32>, FileError> {
    use npyz::TypeChar::{Bool, Float, Int, Uint};
    let ts = type_str(path, name, &array.dtype())?;
    let read = |e: std::io::Error| error(path, format!("array `{name}`: {e}"));
    let values: Vec<f32> = match (ts.type_char(), ts.size_field()) {
        (Float, 2) => array
            .into_vec::<half::f16>()
            .map_err(read)?
            .into_iter()
            .map(f32::from)
            .collect(),
        (Float, 4) => array.into_vec::<f32>().map_err(read)?,
        (Float, 8) => array
            .into_vec::<f64>()
            .map_err(read)?
            .into_iter()
            .map(|x| x as f32)
            .collect(),
        (Int, 1) => array
            .into_vec::<i8>()
            .map_err(read)?
            .into_iter()
            .map(f32::from)
            .collect(),
        (Int, 2) => array
            .into_vec::<i16>()
            .map_err(read)?
            .into_iter()
            .map(f32::from)
            .collect(),
        (Int, 4) => array
            .into_vec::<i32>()
            .map_err(read)?
            .into_iter()
            .map(|x| x as f32)
            .collect(),
        (Int, 8) => array
            .into_vec::<i64>()
            .map_err(read)?
            .into_iter()
            .map(|x| x as f32)
            .collect(),
        (Uint, 1) => array
            .into_vec::<u8>()
            .map_err(read)?
            .into_iter()
            .map(f32::from)
            .collect(),
        (Uint, 2) => array
            .into_vec::<u16>()
            .map_err(read)?
            .into_iter()
            .map(f32::from)
            .collect(),
        (Uint, 4) => array
            .into_vec::<u32>()
            .map_err(read)?
            .into_iter()
            .map(|x| x as f32)
            .collect(),
        (Uint, 8) => array
            .into_vec::<u64>()
            .map_err(read)?
            .into_iter()
            .map(|x| x as f32)
            .collect(),
        (Bool, 1) => array
            .into_vec::<bool>()
            .map_err(read)?
            .into_iter()
            .map(|b| f32::from(u8::from(b)))
            .collect(),
        _ => {
            return Err(error(
                path,
                format!("array `{name}` has dtype {ts}, expected a float, integer or bool dtype"),
            ));
        }
    };
    finite(path, name, values)
}

fn finite(path: &Path, name: &str, values: Vec<f32>) -> Result<Vec<f32>, FileError> {
    if let Some(index) = values.iter().position(|x| !x.is_finite()) {
        return Err(error(
            path,
            format!(
                "`{name}` value {index} is {}, expected a finite number",
                values[index]
            ),
        ));
    }
    Ok(values)
}

fn npz_ints<R: Read>(
    path: &Path,
    name: &str,
    array: npyz::NpyFile<R>,
) -> Result<Vec<i64>, FileError> {
    use npyz::TypeChar::{Int, Uint};
    let ts = type_str(path, name, &array.dtype())?;
    let read = |e: std::io::Error| error(path, format!("array `{name}`: {e}"));
    Ok(match (ts.type_char(), ts.size_field()) {
        (Int, 1) => array
            .into_vec::<i8>()
            .map_err(read)?
            .into_iter()
            .map(i64::from)
            .collect(),
        (Int, 2) => array
            .into_vec::<i16>()
            .map_err(read)?
            .into_iter()
            .map(i64::from)
            .collect(),
        (Int, 4) => array
            .into_vec::<i32>()
            .map_err(read)?
            .into_iter()
            .map(i64::from)
            .collect(),
        (Int, 8) => array.into_vec::<i64>().map_err(read)?,
        (Uint, 1) => array
            .into_vec::<u8>()
            .map_err(read)?
            .into_iter()
            .map(i64::from)
            .collect(),
        (Uint, 2) => array
            .into_vec::<u16>()
            .map_err(read)?
            .into_iter()
            .map(i64::from)
            .collect(),
        (Uint, 4) => array
            .into_vec::<u32>()
            .map_err(read)?
            .into_iter()
            .map(i64::from)
            .collect(),
        (Uint, 8) => array
            .into_vec::<u64>()
            .map_err(read)?
            .into_iter()
            .map(|x| i64::try_from(x).unwrap_or(i64::MAX))
            .collect(),
        _ => {
            return Err(error(
                path,
                format!("array `{name}` has dtype {ts}, expected an integer dtype"),
            ));
        }
    })
}

fn npz_pair(
    path: &Path,
    npz: &mut Npz,
    x_name: &str,
    y_name: &str,
) -> Result<Option<Dataset>, FileError> {
    let (x, sample_shape) = {
        let Some(array) = npz_array(path, npz, x_name)? else {
            return Ok(None);
        };
        let (_, sample_shape) = npz_shape(path, x_name, array.shape(), false)?;
        (npz_floats(path, x_name, array)?, sample_shape)
    };
    let y = npz_array(path, npz, y_name)?
        .ok_or_else(|| error(path, format!("has `{x_name}` but no `{y_name}` array")))?;
    npz_shape(path, y_name, y.shape(), true)?;
    let y = to_ids(path, y_name, npz_ints(path, y_name, y)?, MAX_LABEL)?;
    pair_up(path, (x, x_name, sample_shape), (y, y_name)).map(Some)
}

fn read_npz(path: &Path, train: bool) -> Result<(Part, Option<Dataset>), FileError> {
    let mut npz = open_npz(path)?;
    let data = npz_pair(path, &mut npz, "x", "y")?.ok_or_else(|| {
        error(
            path,
            format!("has no array `x`; its arrays are {}", names(&npz)),
        )
    })?;
    let test = if train {
        match (
            npz_pair(path, &mut npz, "x_test", "y_test")?,
            npz.array_names().any(|n| n == "y_test"),
        ) {
            (None, true) => return Err(error(path, "has `y_test` but no `x_test` array")),
            (test, _) => test,
        }
    } else {
        None
    };
    let users = match (train, npz_array(path, &mut npz, "client_id")?) {
        (true, Some(ids)) => {
            npz_shape(path, "client_id", ids.shape(), true)?;
            Some(to_ids(
                path,
                "client_id",
                npz_ints(path, "client_id", ids)?,
                MAX_CLIENT_ID,
            )?)
        }
        _ => None,
    };
    let users = with_users(path, &data, users)?;
    Ok((
        Part {
            data,
            users,
            columns: Vec::new(),
        },
        test,
    ))
}

fn names(npz: &Npz) -> String {
    let names: Vec<&str> = npz.array_names().collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

type Counted = ((usize, Vec<usize>), Option<usize>, bool);

fn npz_survey(path: &Path) -> Result<Counted, FileError> {
    let mut npz = open_npz(path)?;
    let mut shape_of =
        |name: &str, labels: bool| -> Result<Option<(usize, Vec<usize>)>, FileError> {
            match npz_array(path, &mut npz, name)? {
                Some(array) => {
                    let shape = array.shape().to_vec();
                    npz_shape(path, name, &shape, labels).map(Some)
                }
                None => Ok(None),
            }
        };
    let x = shape_of("x", false)?.ok_or_else(|| error(path, "has no array `x`"))?;
    let y = shape_of("y", true)?.ok_or_else(|| error(path, "has no array `y`"))?;
    if x.0 != y.0 {
        return Err(error(
            path,
            format!("`x` has {} samples but `y` has {} labels", x.0, y.0),
        ));
    }
    let test = shape_of("x_test", false)?.map(|(n, _)| n);
    let clients = shape_of("client_id", true)?.is_some();
    Ok((x, test, clients))
}

// ---- safetensors ----

/// A safetensors header, checked against the file's size: the header's
/// length and its tensors.
fn safetensors_header(
    path: &Path,
    file: &mut std::fs::File,
) -> Result<(u64, safetensors::tensor::Metadata), FileError> {
    let size = file
        .metadata()
        .map_err(|e| error(path, format!("cannot be read: {e}")))?
        .len();
    check_size(path, size)?;
    let not = |why: String| error(path, format!("is not a safetensors file: {why}"));
    let mut length = [0u8; 8];
    file.read_exact(&mut length)
        .map_err(|e| not(e.to_string()))?;
    let length = u64::from_le_bytes(length);
    // safetensors' own bound on a header.
    if length > 100_000_000 || length.saturating_add(8) > size {
        return Err(not(format!(
            "a header of {length} bytes in a file of {size}"
        )));
    }
    let mut header = vec![0u8; length as usize];
    file.read_exact(&mut header)
        .map_err(|e| not(e.to_string()))?;
    let metadata: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).map_err(|e| not(e.to_string()))?;
    let data_bytes = size - 8 - length;
    if metadata.data_len() as u64 != data_bytes {
        return Err(not(format!(
            "its tensors take {} bytes, but {data_bytes} follow the header",
            metadata.data_len()
        )));
    }
    Ok((8 + length, metadata))
}

fn safetensors_survey(path: &Path) -> Result<Counted, FileError> {
    let mut file =
        std::fs::File::open(path).map_err(|e| error(path, format!("cannot be read: {e}")))?;
    let (_, metadata) = safetensors_header(path, &mut file)?;
    let shape_of = |name: &str, labels: bool| {
        metadata
            .info(name)
            .map(|info| check_shape(path, name, &info.shape, labels))
            .transpose()
    };
    let x = shape_of("inputs", false)?.ok_or_else(|| error(path, "has no tensor `inputs`"))?;
    let y = shape_of("labels", true)?.ok_or_else(|| error(path, "has no tensor `labels`"))?;
    if x.0 != y.0 {
        return Err(error(
            path,
            format!("`inputs` has {} samples but `labels` has {}", x.0, y.0),
        ));
    }
    let test = shape_of("test_inputs", false)?.map(|(n, _)| n);
    let clients = shape_of("client_id", true)?.is_some();
    Ok((x, test, clients))
}

/// One tensor's bytes, checked against its dtype and shape.
struct Tensor {
    bytes: Vec<u8>,
    dtype: safetensors::Dtype,
    sample_shape: Vec<usize>,
}

fn read_safetensors(path: &Path, train: bool) -> Result<(Part, Option<Dataset>), FileError> {
    let mut file =
        std::fs::File::open(path).map_err(|e| error(path, format!("cannot be read: {e}")))?;
    // The header first, so that shapes are checked before the data is read.
    let (data_start, metadata) = safetensors_header(path, &mut file)?;
    let mut infos: HashMap<&str, safetensors::tensor::TensorInfo> = HashMap::new();
    for name in [
        "inputs",
        "labels",
        "test_inputs",
        "test_labels",
        "client_id",
    ] {
        if let Some(info) = metadata.info(name) {
            infos.insert(name, info.clone());
        }
    }
    let mut tensor = |name: &str, labels: bool| -> Result<Option<Tensor>, FileError> {
        let Some(info) = infos.get(name).cloned() else {
            return Ok(None);
        };
        let (shape, dtype, (start, end)) = (info.shape, info.dtype, info.data_offsets);
        let (count, sample_shape) = check_shape(path, name, &shape, labels)?;
        let values = sample_shape.iter().product::<usize>().max(1) * count;
        let bytes = dtype_bytes(path, name, dtype)?;
        if values.checked_mul(bytes) != end.checked_sub(start) {
            return Err(error(
                path,
                format!("tensor `{name}`: {shape:?} of {dtype:?} is not its {start}..{end} bytes"),
            ));
        }
        let mut data = vec![0u8; end - start];
        file.seek(SeekFrom::Start(data_start + start as u64))
            .and_then(|_| file.read_exact(&mut data))
            .map_err(|e| error(path, format!("tensor `{name}` cannot be read: {e}")))?;
        Ok(Some(Tensor {
            bytes: data,
            dtype,
            sample_shape,
        }))
    };
    let mut pair = |x_name: &str, y_name: &str| -> Result<Option<Dataset>, FileError> {
        let Some(x) = tensor(x_name, false)? else {
            return Ok(None);
        };
        let values = finite(path, x_name, st_floats(path, x_name, &x.bytes, x.dtype)?)?;
        let y = tensor(y_name, true)?
            .ok_or_else(|| error(path, format!("has `{x_name}` but no `{y_name}` tensor")))?;
        let y = to_ids(
            path,
            y_name,
            st_ints(path, y_name, &y.bytes, y.dtype)?,
            MAX_LABEL,
        )?;
        pair_up(path, (values, x_name, x.sample_shape), (y, y_name)).map(Some)
    };
    let data = pair("inputs", "labels")?.ok_or_else(|| error(path, "has no tensor `inputs`"))?;
    let test = if train {
        pair("test_inputs", "test_labels")?
    } else {
        None
    };
    let users = match (train, tensor("client_id", true)?) {
        (true, Some(ids)) => Some(to_ids(
            path,
            "client_id",
            st_ints(path, "client_id", &ids.bytes, ids.dtype)?,
            MAX_CLIENT_ID,
        )?),
        _ => None,
    };
    let users = with_users(path, &data, users)?;
    Ok((
        Part {
            data,
            users,
            columns: Vec::new(),
        },
        test,
    ))
}

fn dtype_bytes(path: &Path, name: &str, dtype: safetensors::Dtype) -> Result<usize, FileError> {
    use safetensors::Dtype::*;
    Ok(match dtype {
        BOOL | U8 | I8 => 1,
        I16 | U16 | F16 | BF16 => 2,
        I32 | U32 | F32 => 4,
        I64 | U64 | F64 => 8,
        other => {
            return Err(error(
                path,
                format!(
                    "tensor `{name}` has dtype {other:?}, expected a float, integer or bool one"
                ),
            ));
        }
    })
}

fn st_floats(
    path: &Path,
    name: &str,
    bytes: &[u8],
    dtype: safetensors::Dtype,
) -> Result<Vec<f32>, FileError> {
    use safetensors::Dtype::*;
    fn each<const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> f32) -> Vec<f32> {
        bytes
            .chunks_exact(N)
            .map(|c| f(c.try_into().expect("chunks of N")))
            .collect()
    }
    Ok(match dtype {
        F32 => each(bytes, f32::from_le_bytes),
        F64 => each(bytes, |b| f64::from_le_bytes(b) as f32),
        F16 => each(bytes, |b| half::f16::from_le_bytes(b).to_f32()),
        BF16 => each(bytes, |b| half::bf16::from_le_bytes(b).to_f32()),
        U8 | BOOL => bytes.iter().map(|&b| f32::from(b)).collect(),
        I8 => bytes.iter().map(|&b| f32::from(b as i8)).collect(),
        _ => st_ints(path, name, bytes, dtype)?
            .into_iter()
            .map(|x| x as f32)
            .collect(),
    })
}

fn st_ints(
    path: &Path,
    name: &str,
    bytes: &[u8],
    dtype: safetensors::Dtype,
) -> Result<Vec<i64>, FileError> {
    use safetensors::Dtype::*;
    fn each<const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> i64) -> Vec<i64> {
        bytes
            .chunks_exact(N)
            .map(|c| f(c.try_into().expect("chunks of N")))
            .collect()
    }
    Ok(match dtype {
        U8 => bytes.iter().map(|&b| i64::from(b)).collect(),
        I8 => bytes.iter().map(|&b| i64::from(b as i8)).collect(),
        I16 => each(bytes, |b| i64::from(i16::from_le_bytes(b))),
        U16 => each(bytes, |b| i64::from(u16::from_le_bytes(b))),
        I32 => each(bytes, |b| i64::from(i32::from_le_bytes(b))),
        U32 => each(bytes, |b| i64::from(u32::from_le_bytes(b))),
        I64 => each(bytes, i64::from_le_bytes),
        U64 => each(bytes, |b| {
            i64::try_from(u64::from_le_bytes(b)).unwrap_or(i64::MAX)
        }),
        other => {
            return Err(error(
                path,
                format!("tensor `{name}` has dtype {other:?}, expected an integer dtype"),
            ));
        }
    })
}

#[cfg(test)]
mod tests;
