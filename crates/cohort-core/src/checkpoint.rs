//! Checkpoints for exact resume.
//!
//! After a round, the run folder gets `checkpoints/round-NNNN.safetensors` (the
//! global model, a plain safetensors file) and `checkpoints/round-NNNN.json`
//! (the history sidecar, JSON). The sidecar is written last and records the
//! SHA-256 of the model file, so a checkpoint is complete exactly when its
//! sidecar parses and the model matches it. Both files are written atomically
//! (write, fsync, rename): a crash at any point leaves the previous checkpoint
//! readable.
//!
//! What the sidecar holds is all the state a round leaves behind: local
//! optimizers are created fresh for every client run and training streams are
//! derived from seeds, so the model, the selector's RNG position (with a
//! utility selection, also what it learnt of the clients), the strategy's
//! state and the result rows are enough to continue as if nothing happened. A strategy's tensors (server momentum, Adam moments, control
//! variates) go to `checkpoints/round-NNNN.state.safetensors`, written before
//! the sidecar and named in it with their SHA-256.
//!
//! The client rows are the one part that grows with every round (1,000
//! rows a round at 1,000 clients a round). A checkpoint writes only the rows
//! since the one before it, to `checkpoints/clients-NNNN.json`, which names
//! the previous such file with its SHA-256; the sidecar names the newest.
//! Reading follows the chain back, each link's digest checked, so a
//! checkpoint costs what its round added, not the whole run so far. These
//! files are the run's record and are never pruned.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::codec::{self, DecodeLimits};
use crate::fsutil::atomic_write;
use crate::results::{ClientRow, RoundRow};
use crate::selection::SelectorState;
use crate::strategy::StrategyState;
use crate::tree::ParamTree;

/// Version of the checkpoint: its sidecar layout and its tensors' layout.
/// 2: models and strategy tensors in PyTorch's layout ([`crate::layout`]).
/// 3: the client rows in a chain of files ([`ClientRowsLink`]), not in the
/// sidecar; format 2, whose sidecar holds them all, is still read.
pub const FORMAT_VERSION: u32 = 3;
/// The format whose sidecar holds every client row itself.
const INLINE_ROWS_FORMAT: u32 = 2;
/// Folder of the checkpoints inside a run folder.
pub const FOLDER: &str = "checkpoints";

/// The history sidecar of one checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct History {
    pub format: u32,
    /// The last completed round.
    pub round: u32,
    /// Hash of the result-relevant config keys ([`crate::config::LoadedConfig::result_hash`]).
    pub config_hash: String,
    /// The client selector after the last completed round's selection.
    pub selector: SelectorState,
    /// The strategy and its state; `None` (JSON `null`) in checkpoints
    /// written before strategies existed (FedAvg, which keeps none).
    pub algorithm_state: Option<AlgorithmState>,
    pub rounds: Vec<RoundRow>,
    /// Every client row up to `round`. Format 3 keeps them in the chain that
    /// `client_rows` ends (and reads them back from it); format 2 kept them
    /// here.
    #[serde(default, skip_serializing)]
    pub clients: Vec<ClientRow>,
    /// The newest file of client rows. Given to [`write()`], the one the
    /// checkpoint before it wrote (`None` for a run's first); in a written
    /// sidecar, the file this checkpoint wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_rows: Option<ClientRowsLink>,
    /// File name of the model, beside this sidecar.
    pub model_file: String,
    pub model_sha256: String,
    /// An asynchronous run's tasks in flight; absent for synchronous runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asynchronous: Option<AsyncHistory>,
    /// A utility selection's state (`power_of_choice`, `oort`): what each
    /// client reported; absent for `random`, whose stream is all of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection: Option<crate::selection::PolicyState>,
}

/// A file of client rows in the checkpoint folder, with its SHA-256: the
/// rows of the rounds after the previous file's `round` up to this `round`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientRowsLink {
    pub round: u32,
    pub file: String,
    pub sha256: String,
}

/// The contents of one `clients-NNNN.json`.
#[derive(Debug, Serialize, Deserialize)]
struct ClientRowsFile {
    round: u32,
    previous: Option<ClientRowsLink>,
    rows: Vec<ClientRow>,
}

/// What an asynchronous run (`server.synchronous = false`) has in flight at
/// a checkpoint, beside the model: the simulated clock, and each task with
/// what it was sent. Its buffer is empty, since a checkpoint follows an
/// aggregation. The models the tasks trained from are in
/// `round-NNNN.bases.safetensors` (`bases_file`), one tree per version
/// (`v7`); a task's timing and its client's availability follow from the
/// profile and are computed again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AsyncHistory {
    /// Simulated seconds at the checkpoint.
    pub now: f64,
    /// The number the next task gets.
    pub next_task: u64,
    pub tasks: Vec<AsyncTask>,
    pub bases_file: Option<String>,
    pub bases_sha256: Option<String>,
}

/// One task in flight at a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AsyncTask {
    pub task: u64,
    pub client_id: u32,
    /// The model version (aggregations before it) it trained from.
    pub version: u32,
    /// Simulated seconds when it started.
    pub start: f64,
    pub learning_rate: f64,
    pub proximal_mu: f64,
    pub update_clip_norm: Option<f64>,
}

/// Where a checkpoint keeps a strategy's state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlgorithmState {
    /// `algorithm.type` of the run.
    pub strategy: String,
    /// The strategy's small values.
    pub scalars: serde_json::Value,
    /// File of the strategy's tensors beside this sidecar, if it has any.
    pub tensors_file: Option<String>,
    pub tensors_sha256: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot write checkpoint {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the checkpoints in {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A result row with a value JSON cannot hold: it would be stored as
    /// `null`, and no later `--resume` could read the checkpoint back.
    #[error(
        "cannot write checkpoint {path}: round {round}'s `{field}` is {value}, not a finite \
         number"
    )]
    NonFinite {
        path: PathBuf,
        round: u32,
        field: String,
        value: f64,
    },
    #[error(
        "no complete checkpoint in {folder}{}",
        if .rejected.is_empty() { String::new() } else { format!("; rejected: {}", .rejected.join("; ")) }
    )]
    NoneUsable {
        folder: PathBuf,
        rejected: Vec<String>,
    },
}

fn stem(round: u32) -> String {
    format!("round-{round:04}")
}

/// Writes the model, the strategy's tensors, the client rows after
/// `history.client_rows` (the previous checkpoint's newest file of them),
/// then the sidecar, each atomically; the sidecar's path. `history.clients`
/// may hold every row of the run or only those after that file's round.
pub fn write(
    run_dir: &Path,
    model: &[u8],
    history: History,
    strategy: (&str, &StrategyState),
) -> Result<PathBuf, CheckpointError> {
    write_with_bases(run_dir, model, history, strategy, &BTreeMap::new())
        .map(|written| written.sidecar)
}

/// A checkpoint written: its sidecar, and the file of client rows it wrote,
/// which the next checkpoint's history names as its previous one.
#[derive(Debug, Clone)]
pub struct Written {
    pub sidecar: PathBuf,
    pub client_rows: ClientRowsLink,
}

/// [`write()`], with an asynchronous run's base models (named `v<version>`)
/// in their own file before the sidecar, when `history.asynchronous` is set.
pub fn write_with_bases(
    run_dir: &Path,
    model: &[u8],
    mut history: History,
    strategy: (&str, &StrategyState),
    bases: &BTreeMap<String, ParamTree>,
) -> Result<Written, CheckpointError> {
    let folder = run_dir.join(FOLDER);
    let sidecar = folder.join(format!("{}.json", stem(history.round)));
    let previous = history.client_rows.take();
    let first_new = history.clients.len() - rows_after(previous.as_ref(), &history.clients).len();
    if let Some((round, field, value)) = non_finite(&history, first_new) {
        return Err(CheckpointError::NonFinite {
            path: sidecar,
            round,
            field,
            value,
        });
    }
    std::fs::create_dir_all(&folder).map_err(|source| CheckpointError::Write {
        path: folder.clone(),
        source,
    })?;
    history.algorithm_state = write_strategy_state(&folder, history.round, strategy)?;
    if let Some(asynchronous) = history.asynchronous.as_mut() {
        let file = format!("{}.bases.safetensors", stem(history.round));
        let digest = write_trees(&folder.join(&file), bases)?;
        asynchronous.bases_file = digest.as_ref().map(|_| file);
        asynchronous.bases_sha256 = digest;
    }
    let model_file = format!("{}.safetensors", stem(history.round));
    let model_path = folder.join(&model_file);
    atomic_write(&model_path, model).map_err(|source| CheckpointError::Write {
        path: model_path.clone(),
        source,
    })?;
    let client_rows = write_client_rows(
        &folder,
        history.round,
        previous,
        &history.clients[first_new..],
    )?;
    history.client_rows = Some(client_rows.clone());
    history.format = FORMAT_VERSION;
    history.model_file = model_file;
    history.model_sha256 = format!("{:x}", Sha256::digest(model));
    let json = serde_json::to_vec_pretty(&history).expect("histories serialize");
    // The sidecar may hold a strategy's secret (dp_fedavg's noise key).
    crate::fsutil::atomic_write_private(&sidecar, &json).map_err(|source| {
        CheckpointError::Write {
            path: sidecar.clone(),
            source,
        }
    })?;
    Ok(Written {
        sidecar,
        client_rows,
    })
}

/// The rows of `clients` (ordered by round) that a checkpoint after
/// `previous` writes: those of the rounds after the file's round (all of
/// them for a run's first checkpoint).
pub fn rows_after<'a>(
    previous: Option<&ClientRowsLink>,
    clients: &'a [ClientRow],
) -> &'a [ClientRow] {
    let since = previous.map_or(0, |link| link.round);
    &clients[clients.partition_point(|row| row.round <= since)..]
}

/// Writes `rows` (those after `previous`'s round) as `clients-NNNN.json` of
/// `round`, linked to `previous`; the link to it.
fn write_client_rows(
    folder: &Path,
    round: u32,
    previous: Option<ClientRowsLink>,
    rows: &[ClientRow],
) -> Result<ClientRowsLink, CheckpointError> {
    let file = format!("clients-{round:04}.json");
    let path = folder.join(&file);
    let contents = ClientRowsFile {
        round,
        previous,
        rows: rows.to_vec(),
    };
    let json = serde_json::to_vec(&contents).expect("client rows serialize");
    atomic_write(&path, &json).map_err(|source| CheckpointError::Write { path, source })?;
    Ok(ClientRowsLink {
        round,
        file,
        sha256: format!("{:x}", Sha256::digest(&json)),
    })
}

/// Every client row the chain ending at `newest` holds, oldest first, each
/// file's digest, round and rows checked against the link that names it.
fn read_client_rows(sidecar: &Path, newest: &ClientRowsLink) -> Result<Vec<ClientRow>, String> {
    let mut chunks = Vec::new();
    let mut next = Some(newest.clone());
    while let Some(link) = next {
        if !is_plain_file_name(&link.file) {
            return Err(format!(
                "names the client rows file `{}`, which is not a plain file name beside it",
                link.file
            ));
        }
        let path = sidecar.with_file_name(&link.file);
        let bytes = read_verified("client rows", &path, &link.sha256)?;
        let contents: ClientRowsFile = serde_json::from_slice(&bytes)
            .map_err(|e| format!("client rows {} are not valid ({e})", path.display()))?;
        let since = contents.previous.as_ref().map_or(0, |p| p.round);
        // Rounds strictly fall along the chain, so it ends within `round` links.
        let in_order = contents.rows.windows(2).all(|w| w[0].round <= w[1].round);
        if let Some(row) = contents.rows.iter().find(|row| row.round > link.round) {
            return Err(format!(
                "records round {} but holds a client row of round {}",
                link.round, row.round
            ));
        }
        let in_range = contents.rows.iter().all(|row| row.round > since);
        if contents.round != link.round || since >= link.round || !in_order || !in_range {
            return Err(format!(
                "client rows {} do not hold the rounds after {since} up to {} in order",
                path.display(),
                link.round
            ));
        }
        chunks.push(contents.rows);
        next = contents.previous;
    }
    Ok(chunks.into_iter().rev().flatten().collect())
}

/// The first value in the rows a sidecar stores that is not finite: the
/// round it belongs to, its field (`rounds.simulated_time`,
/// `clients[3].loss`), and the value; client rows from `first_client` on,
/// those before it being in an earlier checkpoint already. `epsilon` may be
/// infinite (no noise, no privacy: the honest answer); it is stored as an
/// absent value.
fn non_finite(history: &History, first_client: usize) -> Option<(u32, String, f64)> {
    for row in &history.rounds {
        let values = [
            ("accuracy", row.accuracy),
            ("elapsed_time", row.elapsed_time),
            ("round_time", row.round_time),
            ("training_time", row.training_time),
            ("evaluation_time", row.evaluation_time),
            ("train_loss", row.train_loss),
            ("simulated_time", row.simulated_time),
            ("federated_accuracy", row.federated_accuracy.unwrap_or(0.0)),
            ("test_loss", row.test_loss.unwrap_or(0.0)),
            // Infinite is allowed, NaN is not.
            (
                "epsilon",
                row.epsilon
                    .map_or(0.0, |e| if e.is_nan() { e } else { 0.0 }),
            ),
        ];
        if let Some((field, value)) = values.into_iter().find(|(_, value)| !value.is_finite()) {
            return Some((row.round, format!("rounds.{field}"), value));
        }
    }
    for (index, row) in history.clients.iter().enumerate().skip(first_client) {
        let values = [
            ("loss", row.loss),
            ("training_time", row.training_time),
            ("processing_time", row.processing_time),
            ("comm_time", row.comm_time),
            ("test_accuracy", row.test_accuracy.unwrap_or(0.0)),
        ];
        if let Some((field, value)) = values.into_iter().find(|(_, value)| !value.is_finite()) {
            return Some((
                row.round,
                format!("clients[{index}].{field} (client {})", row.client_id),
                value,
            ));
        }
    }
    None
}

/// Named trees as one safetensors file; its SHA-256, `None` when there are
/// none (no file is written).
fn write_trees(
    path: &Path,
    trees: &BTreeMap<String, ParamTree>,
) -> Result<Option<String>, CheckpointError> {
    if trees.is_empty() {
        return Ok(None);
    }
    let write_error = |message: String| CheckpointError::Write {
        path: path.to_path_buf(),
        source: std::io::Error::other(message),
    };
    let bytes =
        codec::encode(&ParamTree::Map(trees.clone())).map_err(|e| write_error(e.to_string()))?;
    if bytes.len() > DecodeLimits::default().max_bytes {
        return Err(write_error(format!(
            "{} bytes of models in flight, above what a checkpoint holds",
            bytes.len()
        )));
    }
    atomic_write(path, &bytes).map_err(|source| CheckpointError::Write {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Some(format!("{:x}", Sha256::digest(&bytes))))
}

fn write_strategy_state(
    folder: &Path,
    round: u32,
    (name, state): (&str, &StrategyState),
) -> Result<Option<AlgorithmState>, CheckpointError> {
    let (tensors_file, tensors_sha256) = if state.tensors.is_empty() {
        (None, None)
    } else {
        let file = format!("{}.state.safetensors", stem(round));
        let path = folder.join(&file);
        let bytes = codec::encode(&ParamTree::Map(state.tensors.clone())).map_err(|error| {
            CheckpointError::Write {
                path: path.clone(),
                source: std::io::Error::other(error.to_string()),
            }
        })?;
        // Refuse now what `latest` could not read back, rather than leave a
        // run whose every checkpoint is unusable.
        let limits = DecodeLimits::default();
        if bytes.len() > limits.max_bytes || state.tensors.len() > limits.max_tensors {
            return Err(CheckpointError::Write {
                path,
                source: std::io::Error::other(format!(
                    "the strategy state has {} tensors in {} bytes, above what a checkpoint \
                     holds ({} tensors, {} bytes); fewer clients or a smaller model",
                    state.tensors.len(),
                    bytes.len(),
                    limits.max_tensors,
                    limits.max_bytes
                )),
            });
        }
        crate::fsutil::atomic_write_private(&path, &bytes).map_err(|source| {
            CheckpointError::Write {
                path: path.clone(),
                source,
            }
        })?;
        (Some(file), Some(format!("{:x}", Sha256::digest(&bytes))))
    };
    Ok(Some(AlgorithmState {
        strategy: name.to_owned(),
        scalars: state.scalars.clone(),
        tensors_file,
        tensors_sha256,
    }))
}

/// Whether `run_dir` holds any checkpoint sidecar, usable or not: a run
/// killed before its first checkpoint has none and starts over on resume.
///
/// A `checkpoints` that exists but cannot be read as a folder is an error:
/// taking it for "none yet" would start the run over and overwrite its
/// results.
pub fn any_written(run_dir: &Path) -> Result<bool, CheckpointError> {
    let folder = run_dir.join(FOLDER);
    let entries = match std::fs::read_dir(&folder) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound && !folder.is_symlink() => {
            return Ok(false);
        }
        Err(source) => {
            return Err(CheckpointError::Read {
                path: folder,
                source,
            });
        }
    };
    Ok(entries
        .filter_map(|e| e.ok())
        .any(|e| sidecar_round(&e.path()).is_some()))
}

/// Deletes every checkpoint of `run_dir` but the newest `keep` (by round
/// number), each with all its files (`round-NNNN.*`); the rounds removed.
///
/// Called after a checkpoint was written whole, so the newest is usable;
/// keeping two or more leaves one to fall back on should the newest be
/// damaged later. Files that are not a checkpoint's are left alone.
pub fn prune(run_dir: &Path, keep: usize) -> Result<Vec<u32>, CheckpointError> {
    let folder = run_dir.join(FOLDER);
    let entries = std::fs::read_dir(&folder).map_err(|source| CheckpointError::Read {
        path: folder.clone(),
        source,
    })?;
    let mut files: Vec<(u32, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| file_round(&p).map(|round| (round, p)))
        .collect();
    let mut rounds: Vec<u32> = files.iter().map(|(round, _)| *round).collect();
    rounds.sort_unstable();
    rounds.dedup();
    let Some(&oldest_kept) = rounds
        .len()
        .checked_sub(keep.max(1))
        .and_then(|i| rounds.get(i))
    else {
        return Ok(Vec::new());
    };
    // The sidecar goes first: a checkpoint without it is no longer one, so
    // a removal cut short never leaves a sidecar naming a deleted model.
    files.sort_by_key(|(round, path)| (*round, sidecar_round(path).is_none()));
    for (round, path) in &files {
        if *round < oldest_kept {
            std::fs::remove_file(path).map_err(|source| CheckpointError::Write {
                path: path.clone(),
                source,
            })?;
        }
    }
    Ok(rounds.into_iter().filter(|&r| r < oldest_kept).collect())
}

/// The round of a checkpoint's file (`round-NNNN.json`, `.safetensors`,
/// `.state.safetensors`, `.bases.safetensors`), from its name.
fn file_round(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_prefix("round-")?;
    let (digits, extension) = rest.split_once('.')?;
    let known = [
        "json",
        "safetensors",
        "state.safetensors",
        "bases.safetensors",
    ];
    (known.contains(&extension) && !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// A checkpoint that passed every check.
#[derive(Debug, Clone)]
pub struct Restored {
    pub history: History,
    pub model: ParamTree,
    /// The strategy's state (empty for strategies that keep none).
    pub strategy_state: StrategyState,
    /// An asynchronous run's base models by name (`v7`); empty otherwise.
    pub bases: BTreeMap<String, ParamTree>,
    /// Newer checkpoints that were skipped, with the reason.
    pub skipped: Vec<String>,
}

/// The newest complete checkpoint of `run_dir`, falling back to older ones
/// when the newest is truncated or corrupt. Never returns a broken state.
pub fn latest(run_dir: &Path) -> Result<Restored, CheckpointError> {
    latest_accepted(run_dir, |_| Ok(()))
}

/// [`latest`], where a checkpoint must also pass `accept` (what only the
/// caller knows: the model's layout, the selector's stream, the strategy's
/// state); one it refuses is skipped with its reason, as a torn one is.
pub fn latest_accepted(
    run_dir: &Path,
    mut accept: impl FnMut(&Restored) -> Result<(), String>,
) -> Result<Restored, CheckpointError> {
    let folder = run_dir.join(FOLDER);
    let entries = std::fs::read_dir(&folder).map_err(|source| CheckpointError::Read {
        path: folder.clone(),
        source,
    })?;
    // By round number, not by text: round-10000 comes after round-9999.
    let mut sidecars: Vec<(u32, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| sidecar_round(&p).map(|round| (round, p)))
        .collect();
    sidecars.sort();
    let mut skipped = Vec::new();
    for (_, sidecar) in sidecars.iter().rev() {
        let restored = read_one(sidecar).and_then(|(history, model, strategy_state)| {
            let bases = read_bases(sidecar, history.asynchronous.as_ref())?;
            let restored = Restored {
                history,
                model,
                strategy_state,
                bases,
                skipped: Vec::new(),
            };
            accept(&restored).map(|()| restored)
        });
        match restored {
            Ok(restored) => {
                return Ok(Restored {
                    skipped,
                    ..restored
                });
            }
            Err(reason) => skipped.push(format!("{}: {reason}", sidecar.display())),
        }
    }
    Err(CheckpointError::NoneUsable {
        folder,
        rejected: skipped,
    })
}

/// The round of a sidecar's file name, `round-N.json`.
fn sidecar_round(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    name.strip_prefix("round-")?
        .strip_suffix(".json")?
        .parse()
        .ok()
}

/// Whether `name` is a plain file name beside the sidecar: a sidecar must not
/// point anywhere else.
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0'])
}

/// Largest round a checkpoint may record: the run goes on at `round + 1`.
const MAX_ROUND: u32 = u32::MAX - 1;

/// A sidecar's own numbers and file names must make sense before anything it
/// names is read.
fn check_history(sidecar: &Path, history: &History) -> Result<(), String> {
    if history.format == 1 {
        // Converting would need to know which leaves were burn's linear
        // weights, and a strategy's tensors (moments, control variates) would
        // need the same: a run that old starts over instead.
        return Err(format!(
            "format 1 was written by a cohort from before models were stored in PyTorch's \
             layout (linear weights [in, out], BatchNorm gamma/beta; now [out, in] and \
             weight/bias); this cohort reads format {FORMAT_VERSION}: start the run again"
        ));
    }
    if history.format != FORMAT_VERSION && history.format != INLINE_ROWS_FORMAT {
        return Err(format!(
            "format {} is neither {FORMAT_VERSION} nor {INLINE_ROWS_FORMAT}",
            history.format
        ));
    }
    if sidecar_round(sidecar) != Some(history.round) {
        return Err(format!(
            "records round {} but is named {}",
            history.round,
            sidecar.display()
        ));
    }
    if history.round == 0 || history.round > MAX_ROUND {
        return Err(format!("round {} is out of range", history.round));
    }
    let rows_where = (
        history.format,
        history.clients.is_empty(),
        &history.client_rows,
    );
    match rows_where {
        (INLINE_ROWS_FORMAT, _, Some(_)) => {
            return Err("format 2 holds its client rows itself, yet names a file of them".into());
        }
        (FORMAT_VERSION, false, _) => {
            return Err(format!(
                "format {FORMAT_VERSION} keeps its client rows in files, yet holds some itself"
            ));
        }
        // Every format-3 checkpoint writes a file of client rows, even an
        // empty one: a sidecar without it would resume with no record.
        (FORMAT_VERSION, true, None) => {
            return Err(format!(
                "format {FORMAT_VERSION} names no file of client rows (`client_rows`)"
            ));
        }
        (FORMAT_VERSION, true, Some(link)) if link.round != history.round => {
            return Err(format!(
                "records round {} but its newest client rows are of round {}",
                history.round, link.round
            ));
        }
        _ => {}
    }
    // The rows are the run's record up to its round: one per round, in
    // order, and no client row of a later round.
    let rounds: Vec<u32> = history.rounds.iter().map(|row| row.round).collect();
    if !rounds.iter().copied().eq(1..=history.round) {
        return Err(format!(
            "records round {} but holds {} result rows (rounds {:?}..{:?}), not one per round \
             from 1",
            history.round,
            rounds.len(),
            rounds.first(),
            rounds.last()
        ));
    }
    if let Some(row) = history.clients.iter().find(|row| row.round > history.round) {
        return Err(format!(
            "records round {} but holds a client row of round {}",
            history.round, row.round
        ));
    }
    let files = std::iter::once(history.model_file.as_str())
        .chain(
            history
                .algorithm_state
                .iter()
                .filter_map(|state| state.tensors_file.as_deref()),
        )
        .chain(
            history
                .asynchronous
                .iter()
                .filter_map(|a| a.bases_file.as_deref()),
        );
    for file in files {
        if !is_plain_file_name(file) {
            return Err(format!(
                "names the file `{file}`, which is not a plain file name beside it"
            ));
        }
    }
    Ok(())
}

/// A checkpoint's part: a regular file of bounded size (a folder is
/// anyone's to edit; a sidecar linked to `/dev/zero` must not hang a resume).
fn read_part(path: &Path) -> std::io::Result<Vec<u8>> {
    crate::fsutil::read_bounded(path, crate::fsutil::MAX_READ_BYTES)
}

/// The bytes of a part a sidecar or a link of the chain names (`what`, at
/// `path`), which must have the SHA-256 `expected` it was written with.
fn read_verified(what: &str, path: &Path, expected: &str) -> Result<Vec<u8>, String> {
    let bytes =
        read_part(path).map_err(|e| format!("{what} {} unreadable ({e})", path.display()))?;
    let digest = format!("{:x}", Sha256::digest(&bytes));
    if digest != expected {
        return Err(format!(
            "{what} {} has SHA-256 {digest}, {expected} was written (truncated or changed)",
            path.display()
        ));
    }
    Ok(bytes)
}

fn read_one(sidecar: &Path) -> Result<(History, ParamTree, StrategyState), String> {
    let text = read_part(sidecar).map_err(|e| format!("unreadable ({e})"))?;
    let mut history: History =
        serde_json::from_slice(&text).map_err(|e| format!("not a valid sidecar ({e})"))?;
    check_history(sidecar, &history)?;
    if let Some(newest) = &history.client_rows {
        history.clients = read_client_rows(sidecar, newest)?;
    }
    let model_path = sidecar.with_file_name(&history.model_file);
    let bytes = read_verified("model", &model_path, &history.model_sha256)?;
    let model = codec::decode(&bytes, &DecodeLimits::default())
        .map_err(|e| format!("model does not decode ({e})"))?;
    let state = read_strategy_state(sidecar, history.algorithm_state.as_ref())?;
    Ok((history, model, state))
}

/// An asynchronous checkpoint's base models, their file's digest checked.
fn read_bases(
    sidecar: &Path,
    saved: Option<&AsyncHistory>,
) -> Result<BTreeMap<String, ParamTree>, String> {
    let Some(saved) = saved else {
        return Ok(BTreeMap::new());
    };
    if !(saved.now.is_finite() && saved.now >= 0.0) {
        return Err(format!("its simulated clock, {}, is not a time", saved.now));
    }
    let (file, expected) = match (&saved.bases_file, &saved.bases_sha256) {
        (None, _) => return Ok(BTreeMap::new()),
        (Some(file), Some(expected)) => (file, expected),
        (Some(_), None) => return Err("base models file without its SHA-256".to_owned()),
    };
    let bytes = read_verified("base models", &sidecar.with_file_name(file), expected)?;
    match codec::decode(&bytes, &DecodeLimits::default()) {
        Ok(ParamTree::Map(trees)) => Ok(trees),
        Ok(other) => Err(format!("base models hold a {}, not a map", other.kind())),
        Err(e) => Err(format!("base models do not decode ({e})")),
    }
}

fn read_strategy_state(
    sidecar: &Path,
    saved: Option<&AlgorithmState>,
) -> Result<StrategyState, String> {
    let Some(saved) = saved else {
        return Ok(StrategyState::default());
    };
    let tensors = match (&saved.tensors_file, &saved.tensors_sha256) {
        (None, _) => Default::default(),
        (Some(file), Some(expected)) => {
            let bytes = read_verified("strategy state", &sidecar.with_file_name(file), expected)?;
            match codec::decode(&bytes, &DecodeLimits::default()) {
                Ok(ParamTree::Map(tensors)) => tensors,
                Ok(other) => {
                    return Err(format!(
                        "strategy state holds a {}, not a map",
                        other.kind()
                    ));
                }
                Err(e) => return Err(format!("strategy state does not decode ({e})")),
            }
        }
        (Some(_), None) => return Err("strategy state file without its SHA-256".to_owned()),
    };
    Ok(StrategyState {
        scalars: saved.scalars.clone(),
        tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::Array;

    #[test]
    fn a_checkpoints_entry_that_is_no_folder_is_an_error_not_a_fresh_start() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!any_written(dir.path()).unwrap());
        std::fs::create_dir(dir.path().join(FOLDER)).unwrap();
        assert!(!any_written(dir.path()).unwrap());
        std::fs::remove_dir(dir.path().join(FOLDER)).unwrap();
        std::fs::write(dir.path().join(FOLDER), b"not a folder").unwrap();
        let error = any_written(dir.path()).unwrap_err().to_string();
        assert!(error.contains("checkpoints"), "{error}");
        #[cfg(unix)]
        {
            std::fs::remove_file(dir.path().join(FOLDER)).unwrap();
            std::os::unix::fs::symlink(dir.path().join("gone"), dir.path().join(FOLDER)).unwrap();
            assert!(any_written(dir.path()).is_err());
        }
    }

    fn history(round: u32) -> History {
        History {
            format: FORMAT_VERSION,
            round,
            config_hash: "abc".into(),
            selector: SelectorState {
                seed: 1,
                word_pos: 16 * round as u128,
            },
            algorithm_state: None,
            rounds: (1..=round).map(row).collect(),
            clients: Vec::new(),
            client_rows: None,
            model_file: String::new(),
            model_sha256: String::new(),
            asynchronous: None,
            selection: None,
        }
    }

    fn row(round: u32) -> RoundRow {
        RoundRow {
            round,
            accuracy: 0.5,
            elapsed_time: 1.0,
            round_time: 1.0,
            training_time: 1.0,
            evaluation_time: 0.1,
            bytes_to_clients: 10,
            bytes_to_server: 10,
            train_loss: 0.7,
            simulated_time: 2.0,
            extra_bytes_to_clients: 0,
            federated_accuracy: None,
            epsilon: None,
            test_loss: Some(0.25),
            secagg: None,
            simulated_start: None,
            candidates: Vec::new(),
        }
    }

    #[test]
    fn rows_that_do_not_match_the_round_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &model(1.0), history(1), NONE).unwrap();
        let mut extra = history(2);
        extra.rounds.push(row(3));
        write(dir.path(), &model(2.0), extra, NONE).unwrap();
        let restored = latest(dir.path()).unwrap();
        assert_eq!(restored.history.round, 1);
        assert!(
            restored.skipped[0].contains("records round 2 but holds 3 result rows"),
            "{:?}",
            restored.skipped
        );
        let mut later = history(2);
        later.clients = vec![ClientRow::empty(5, 1)];
        write(dir.path(), &model(2.0), later, NONE).unwrap();
        let restored = latest(dir.path()).unwrap();
        assert!(
            restored.skipped[0].contains("a client row of round 5"),
            "{:?}",
            restored.skipped
        );
    }

    #[test]
    fn what_the_caller_refuses_is_skipped_like_a_torn_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &model(1.0), history(1), NONE).unwrap();
        write(dir.path(), &model(2.0), history(2), NONE).unwrap();
        let restored = latest_accepted(dir.path(), |r| match r.history.round {
            2 => Err("not for me".to_owned()),
            _ => Ok(()),
        })
        .unwrap();
        assert_eq!(restored.history.round, 1);
        assert!(
            restored.skipped[0].ends_with("not for me"),
            "{:?}",
            restored.skipped
        );
    }

    const NONE: (&str, &StrategyState) = ("fedavg", &EMPTY);
    static EMPTY: StrategyState = StrategyState {
        scalars: serde_json::Value::Null,
        tensors: std::collections::BTreeMap::new(),
    };

    #[test]
    fn a_non_finite_value_in_the_rows_is_refused_naming_round_and_field_not_stored_as_null() {
        let dir = tempfile::tempdir().unwrap();
        // An infinite ε is honest (no noise): it is kept, not refused.
        let row = |round: u32| RoundRow {
            epsilon: Some(f64::INFINITY),
            test_loss: None,
            secagg: None,
            ..row(round)
        };
        let mut good = history(2);
        good.rounds = vec![row(1), row(2)];
        good.clients = vec![ClientRow::empty(1, 4), ClientRow::empty(2, 4)];
        write(dir.path(), &model(1.0), good.clone(), NONE).unwrap();

        let mut overflowed = history(3);
        overflowed.rounds = vec![row(1), row(2), row(3)];
        overflowed.rounds[2].simulated_time = f64::INFINITY;
        let error = write(dir.path(), &model(2.0), overflowed, NONE)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("round 3's `rounds.simulated_time` is inf, not a finite number"),
            "{error}"
        );
        let mut poisoned = history(3);
        poisoned.rounds = good.rounds.clone();
        poisoned.clients = vec![ClientRow::empty(1, 4), ClientRow::empty(3, 9)];
        poisoned.clients[1].training_time = f64::NAN;
        let error = write(dir.path(), &model(2.0), poisoned, NONE)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("round 3's `clients[1].training_time (client 9)` is NaN"),
            "{error}"
        );
        // Nothing of the refused round was written: the last good checkpoint stands.
        assert!(!dir.path().join(FOLDER).join("round-0003.json").exists());
        assert!(
            !dir.path()
                .join(FOLDER)
                .join("round-0003.safetensors")
                .exists()
        );
        assert_eq!(latest(dir.path()).unwrap().history.round, 2);
    }

    #[test]
    fn strategy_state_round_trips_and_is_verified() {
        let dir = tempfile::tempdir().unwrap();
        let state = StrategyState {
            scalars: serde_json::json!({"steps": 3}),
            tensors: std::collections::BTreeMap::from([(
                "momentum".to_owned(),
                ParamTree::Leaf(Array::f32(vec![2], vec![0.5, -1.0]).unwrap()),
            )]),
        };
        write(dir.path(), &model(1.0), history(1), ("fedavgm", &state)).unwrap();
        let restored = latest(dir.path()).unwrap();
        assert_eq!(restored.strategy_state, state);
        assert_eq!(
            restored.history.algorithm_state.unwrap().strategy,
            "fedavgm"
        );
        // A changed state file makes the checkpoint unusable, never half-restored.
        let file = dir.path().join(FOLDER).join("round-0001.state.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&file, bytes).unwrap();
        let error = latest(dir.path()).unwrap_err().to_string();
        assert!(error.contains("strategy state"), "{error}");
    }

    fn model(value: f32) -> Vec<u8> {
        codec::encode(&ParamTree::from_dotted([(
            "w".to_owned(),
            Array::f32(vec![1], vec![value]).unwrap(),
        )]))
        .unwrap()
    }

    #[test]
    fn rounds_sort_as_numbers_and_sidecars_cannot_point_away_or_wrap() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &model(1.0), history(9999), NONE).unwrap();
        write(dir.path(), &model(2.0), history(10000), NONE).unwrap();
        assert_eq!(latest(dir.path()).unwrap().history.round, 10000);

        let folder = dir.path().join(FOLDER);
        let sidecar = folder.join("round-10000.json");
        let mut forged: History =
            serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
        forged.model_file = "../../model.safetensors".into();
        std::fs::write(&sidecar, serde_json::to_vec(&forged).unwrap()).unwrap();
        let restored = latest(dir.path()).unwrap();
        assert_eq!(restored.history.round, 9999);
        assert!(
            restored.skipped[0].contains("not a plain file name"),
            "{:?}",
            restored.skipped
        );

        // A sidecar claiming the last round there is cannot make the run wrap.
        let mut wrapping = forged.clone();
        wrapping.round = u32::MAX;
        wrapping.model_file = "round-10000.safetensors".into();
        std::fs::write(
            folder.join(format!("round-{}.json", u32::MAX)),
            serde_json::to_vec(&wrapping).unwrap(),
        )
        .unwrap();
        let restored = latest(dir.path()).unwrap();
        assert_eq!(restored.history.round, 9999);
        assert!(
            restored.skipped.iter().any(|s| s.contains("out of range")),
            "{:?}",
            restored.skipped
        );
    }

    #[test]
    fn checkpoints_from_before_the_pytorch_layout_are_refused_naming_the_change() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &model(1.0), history(1), NONE).unwrap();
        let sidecar = dir.path().join(FOLDER).join("round-0001.json");
        let mut old: History = serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
        old.format = 1;
        std::fs::write(&sidecar, serde_json::to_vec(&old).unwrap()).unwrap();
        let error = latest(dir.path()).unwrap_err().to_string();
        assert!(
            error.contains("round-0001.json")
                && error.contains("format 1")
                && error.contains("PyTorch's layout")
                && error.contains("[in, out]"),
            "{error}"
        );
    }

    /// Rows of `clients` clients in each of `rounds`, told apart by loss.
    fn client_rows(rounds: std::ops::RangeInclusive<u32>, clients: u32) -> Vec<ClientRow> {
        rounds
            .flat_map(|round| {
                (1..=clients).map(move |client| ClientRow {
                    loss: f64::from(round * 100 + client),
                    ..ClientRow::empty(round, client)
                })
            })
            .collect()
    }

    fn rows_in(file: &Path) -> Vec<u32> {
        let contents: ClientRowsFile =
            serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
        contents.rows.iter().map(|row| row.round).collect()
    }

    /// A chain of three checkpoints (the last two rounds apart, as
    /// `server.checkpoint_interval = 2` writes them), each given every row
    /// of the run so far, as the run folder's recorder keeps them.
    fn chained(dir: &Path) -> Vec<ClientRowsLink> {
        let mut links = Vec::new();
        for round in [1, 2, 4] {
            let mut history = history(round);
            history.clients = client_rows(1..=round, 3);
            history.client_rows = links.last().cloned();
            let written =
                write_with_bases(dir, &model(round as f32), history, NONE, &BTreeMap::new())
                    .unwrap();
            links.push(written.client_rows);
        }
        links
    }

    #[test]
    fn each_checkpoint_writes_only_the_client_rows_since_the_one_before() {
        let dir = tempfile::tempdir().unwrap();
        let links = chained(dir.path());
        let folder = dir.path().join(FOLDER);
        assert_eq!(rows_in(&folder.join("clients-0001.json")), [1, 1, 1]);
        assert_eq!(rows_in(&folder.join("clients-0002.json")), [2, 2, 2]);
        assert_eq!(
            rows_in(&folder.join("clients-0004.json")),
            [3, 3, 3, 4, 4, 4]
        );
        // The sidecar holds no row itself, only the newest link.
        let sidecar = std::fs::read_to_string(folder.join("round-0004.json")).unwrap();
        assert!(!sidecar.contains("\"clients\""), "{sidecar}");
        let restored = latest(dir.path()).unwrap();
        assert_eq!(restored.history.client_rows.as_ref(), links.last());
        assert_eq!(restored.history.clients, client_rows(1..=4, 3));
        // Rows given from the last link on write the same file.
        let mut only_new = history(4);
        only_new.clients = client_rows(3..=4, 3);
        only_new.client_rows = Some(links[1].clone());
        let again = write(dir.path(), &model(4.0), only_new, NONE).unwrap();
        assert_eq!(again, folder.join("round-0004.json"));
        assert_eq!(
            latest(dir.path()).unwrap().history.clients,
            client_rows(1..=4, 3)
        );
    }

    #[test]
    fn a_changed_file_of_client_rows_fails_every_checkpoint_whose_chain_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        chained(dir.path());
        let folder = dir.path().join(FOLDER);
        let newest = folder.join("clients-0004.json");
        let text = std::fs::read_to_string(&newest).unwrap();
        std::fs::write(&newest, text.replace("401", "999")).unwrap();
        let restored = latest(dir.path()).unwrap();
        assert_eq!(restored.history.round, 2);
        assert_eq!(restored.history.clients, client_rows(1..=2, 3));
        assert!(
            restored.skipped[0].contains("clients-0004.json")
                && restored.skipped[0].contains("truncated or changed"),
            "{:?}",
            restored.skipped
        );
        // The first link is in every chain: nothing is usable without it.
        std::fs::write(folder.join("clients-0001.json"), b"{}").unwrap();
        let error = latest(dir.path()).unwrap_err().to_string();
        assert!(error.contains("no complete checkpoint"), "{error}");
        assert!(error.contains("clients-0001.json"), "{error}");
    }

    #[test]
    fn format_2_sidecars_with_their_client_rows_inside_are_still_read() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &model(1.0), history(1), NONE).unwrap();
        let sidecar = dir.path().join(FOLDER).join("round-0001.json");
        let mut old: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&sidecar).unwrap()).unwrap();
        old["format"] = 2.into();
        old.as_object_mut().unwrap().remove("client_rows");
        old["clients"] = serde_json::to_value(client_rows(1..=1, 2)).unwrap();
        std::fs::write(&sidecar, serde_json::to_vec(&old).unwrap()).unwrap();
        let restored = latest(dir.path()).unwrap();
        assert_eq!(restored.history.clients, client_rows(1..=1, 2));
        assert_eq!(restored.history.client_rows, None);
        // Format 3 without its chain is refused, rather than resumed with no
        // client rows; with rows inside too: they belong in the chain.
        let mut unlinked = old.clone();
        unlinked["format"] = 3.into();
        unlinked.as_object_mut().unwrap().remove("clients");
        std::fs::write(&sidecar, serde_json::to_vec(&unlinked).unwrap()).unwrap();
        let error = latest(dir.path()).unwrap_err().to_string();
        assert!(error.contains("names no file of client rows"), "{error}");
        old["format"] = 3.into();
        std::fs::write(&sidecar, serde_json::to_vec(&old).unwrap()).unwrap();
        let error = latest(dir.path()).unwrap_err().to_string();
        assert!(error.contains("keeps its client rows in files"), "{error}");
    }

    #[test]
    fn newest_complete_checkpoint_wins() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &model(1.0), history(1), NONE).unwrap();
        write(dir.path(), &model(2.0), history(2), NONE).unwrap();
        let restored = latest(dir.path()).unwrap();
        assert_eq!(restored.history.round, 2);
        assert!(restored.skipped.is_empty());
    }

    #[test]
    fn truncated_or_corrupt_newest_falls_back_to_the_previous() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &model(1.0), history(1), NONE).unwrap();
        write(dir.path(), &model(2.0), history(2), NONE).unwrap();
        let newest_model = dir.path().join(FOLDER).join("round-0002.safetensors");
        let bytes = std::fs::read(&newest_model).unwrap();
        std::fs::write(&newest_model, &bytes[..bytes.len() / 2]).unwrap();
        let restored = latest(dir.path()).unwrap();
        assert_eq!(restored.history.round, 1);
        assert!(
            restored.skipped[0].contains("truncated or changed"),
            "{:?}",
            restored.skipped
        );

        std::fs::write(
            dir.path().join(FOLDER).join("round-0002.json"),
            b"{ not json",
        )
        .unwrap();
        assert_eq!(latest(dir.path()).unwrap().history.round, 1);
    }

    #[cfg(unix)]
    #[test]
    fn a_sidecar_linked_to_a_device_is_skipped_not_read() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &model(1.0), history(1), NONE).unwrap();
        write(dir.path(), &model(2.0), history(2), NONE).unwrap();
        let sidecar = dir.path().join(FOLDER).join("round-0002.json");
        std::fs::remove_file(&sidecar).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &sidecar).unwrap();
        let restored = latest(dir.path()).unwrap();
        assert_eq!(restored.history.round, 1);
        assert!(
            restored.skipped[0].contains("not a regular file"),
            "{:?}",
            restored.skipped
        );
    }

    #[test]
    fn no_usable_checkpoint_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &model(1.0), history(1), NONE).unwrap();
        std::fs::write(dir.path().join(FOLDER).join("round-0001.safetensors"), b"").unwrap();
        let error = latest(dir.path()).unwrap_err().to_string();
        assert!(error.contains("no complete checkpoint"), "{error}");
        assert!(error.contains("round-0001.json"), "{error}");
    }

    #[test]
    fn pruning_keeps_the_newest_checkpoints_whole_and_nothing_else_goes() {
        let dir = tempfile::tempdir().unwrap();
        for round in [1, 2, 3, 9, 10] {
            write(dir.path(), &model(round as f32), history(round), NONE).unwrap();
        }
        let folder = dir.path().join(FOLDER);
        std::fs::write(folder.join("notes.txt"), b"mine").unwrap();
        std::fs::write(folder.join("round-0001.json.tmp"), b"a torn write").unwrap();
        assert_eq!(prune(dir.path(), 2).unwrap(), [1, 2, 3]);
        let mut left: Vec<String> = std::fs::read_dir(&folder)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                // The client rows are the run's record: never pruned.
                "clients-0001.json",
                "clients-0002.json",
                "clients-0003.json",
                "clients-0009.json",
                "clients-0010.json",
                "notes.txt",
                "round-0001.json.tmp",
                "round-0009.json",
                "round-0009.safetensors",
                "round-0010.json",
                "round-0010.safetensors"
            ]
        );
        assert_eq!(latest(dir.path()).unwrap().history.round, 10);
        // Round 10000 comes after round 9999, not before round 2.
        write(dir.path(), &model(4.0), history(10_000), NONE).unwrap();
        assert_eq!(prune(dir.path(), 1).unwrap(), [9, 10]);
        assert_eq!(latest(dir.path()).unwrap().history.round, 10_000);
        assert!(prune(dir.path(), 5).unwrap().is_empty());
    }
}
