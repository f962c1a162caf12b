//! Per-client vectors on disk, for state that outgrows memory (SCAFFOLD's
//! control variates of 100,000 clients are 25 GB for LeNet-5).
//!
//! A [`VectorLog`] is an append-only file of fixed-size records, `[client id:
//! u32][width × f32]`, little-endian; a client's value is its last record. In
//! memory it keeps only where each client's last record starts. A position in
//! the log ([`LogMark`]: the file's generation and its length) is all a
//! checkpoint needs to come back to this state, so a checkpoint records what
//! changed (the records appended since) instead of copying every vector.
//! Rewinding to a mark truncates the file there and reads the record heads
//! again.
//!
//! When the log holds more than twice the live records, [`VectorLog::compact`]
//! writes the live ones into the next generation's file. Older files are
//! kept until a checkpoint holds a mark of the current one
//! ([`VectorLog::forget_others`]), so the last checkpoint's mark can always
//! be rewound to.
//! Records carry no checksum: the file is the run folder's own, written by
//! this process, and what reads it back is bounded by the width and the
//! file's length, never by a count read from it.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where a log stood: its file's generation and length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogMark {
    pub generation: u32,
    pub bytes: u64,
    /// Floats per vector.
    pub width: usize,
}

/// What went wrong with a log file: which file, and what.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct LogError {
    pub path: PathBuf,
    pub problem: String,
}

/// Client vectors of one width in an append-only file (see the module).
#[derive(Debug)]
pub struct VectorLog {
    folder: PathBuf,
    generation: u32,
    file: File,
    bytes: u64,
    width: usize,
    /// Where each client's last record starts.
    last: HashMap<u32, u64>,
}

impl VectorLog {
    /// An empty log of vectors of `width` floats in `folder` (created if
    /// needed), at generation 0; an older file there is replaced.
    pub fn create(folder: &Path, width: usize) -> Result<Self, LogError> {
        Self::start(folder, 0, width)
    }

    /// The log as it stood at `mark`: the file of its generation cut to its
    /// length (what was appended after the mark is dropped), its records'
    /// heads read again.
    pub fn open_at(folder: &Path, mark: LogMark) -> Result<Self, LogError> {
        let path = file_of(folder, mark.generation);
        let record = record_bytes(mark.width);
        let fail = |problem: String| LogError {
            path: path.clone(),
            problem,
        };
        if mark.width == 0 || mark.width > MAX_WIDTH || !mark.bytes.is_multiple_of(record) {
            return Err(fail(format!(
                "a mark of {} bytes is not a whole number of records of {} floats",
                mark.bytes, mark.width
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| fail(format!("cannot open: {e}")))?;
        let length = file
            .metadata()
            .map_err(|e| fail(format!("cannot read its length: {e}")))?
            .len();
        if length < mark.bytes {
            return Err(fail(format!(
                "holds {length} bytes, but the checkpoint's mark is at {}",
                mark.bytes
            )));
        }
        file.set_len(mark.bytes)
            .map_err(|e| fail(format!("cannot cut it at {}: {e}", mark.bytes)))?;
        let mut log = Self {
            folder: folder.to_path_buf(),
            generation: mark.generation,
            file,
            bytes: mark.bytes,
            width: mark.width,
            last: HashMap::new(),
        };
        log.read_heads()?;
        Ok(log)
    }

    fn start(folder: &Path, generation: u32, width: usize) -> Result<Self, LogError> {
        let path = file_of(folder, generation);
        let fail = |problem: String| LogError {
            path: path.clone(),
            problem,
        };
        if width == 0 || width > MAX_WIDTH {
            return Err(fail(format!(
                "vectors of {width} floats (at most {MAX_WIDTH})"
            )));
        }
        std::fs::create_dir_all(folder)
            .map_err(|e| fail(format!("cannot create its folder: {e}")))?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| fail(format!("cannot create: {e}")))?;
        Ok(Self {
            folder: folder.to_path_buf(),
            generation,
            file,
            bytes: 0,
            width,
            last: HashMap::new(),
        })
    }

    fn path(&self) -> PathBuf {
        file_of(&self.folder, self.generation)
    }

    fn fail(&self, problem: String) -> LogError {
        LogError {
            path: self.path(),
            problem,
        }
    }

    fn read_heads(&mut self) -> Result<(), LogError> {
        let record = record_bytes(self.width);
        let mut head = [0u8; 4];
        let mut at = 0;
        while at < self.bytes {
            self.file
                .seek(SeekFrom::Start(at))
                .and_then(|_| self.file.read_exact(&mut head))
                .map_err(|e| self.fail(format!("cannot read the record at {at}: {e}")))?;
            self.last.insert(u32::from_le_bytes(head), at);
            at += record;
        }
        Ok(())
    }

    /// Floats per vector.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Clients with a vector.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }

    /// Where the log stands now.
    pub fn mark(&self) -> LogMark {
        LogMark {
            generation: self.generation,
            bytes: self.bytes,
            width: self.width,
        }
    }

    /// Client `client`'s last vector, if it has one.
    pub fn get(&self, client: u32) -> Result<Option<Vec<f32>>, LogError> {
        let Some(&at) = self.last.get(&client) else {
            return Ok(None);
        };
        let mut bytes = vec![0u8; self.width * 4];
        // Through `&File`: a log is used from one thread at a time (its
        // owner is `Send`, not `Sync`), so the seek and the read stay paired.
        let mut file = &self.file;
        file.seek(SeekFrom::Start(at + 4))
            .and_then(|_| file.read_exact(&mut bytes))
            .map_err(|e| self.fail(format!("cannot read client {client}'s vector: {e}")))?;
        Ok(Some(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ))
    }

    /// Sets the vectors of several clients, in the order given (the last
    /// of a client's wins), appended in one write.
    pub fn put_all<'a>(
        &mut self,
        vectors: impl IntoIterator<Item = (u32, &'a [f32])>,
    ) -> Result<(), LogError> {
        let start = self.bytes;
        let mut written = Vec::new();
        let result = (|| {
            self.file
                .seek(SeekFrom::Start(start))
                .map_err(|e| self.fail(format!("cannot seek to its end: {e}")))?;
            let mut out = BufWriter::with_capacity(1 << 20, &self.file);
            let mut at = start;
            for (client, vector) in vectors {
                if vector.len() != self.width {
                    return Err(self.fail(format!(
                        "client {client}'s vector has {} floats, the log holds {}",
                        vector.len(),
                        self.width
                    )));
                }
                out.write_all(&client.to_le_bytes())
                    .and_then(|_| write_floats(&mut out, vector))
                    .map_err(|e| self.fail(format!("cannot append: {e}")))?;
                written.push((client, at));
                at += record_bytes(self.width);
            }
            out.flush()
                .map_err(|e| self.fail(format!("cannot append: {e}")))?;
            Ok(at)
        })();
        match result {
            Ok(end) => {
                self.bytes = end;
                self.last.extend(written);
                Ok(())
            }
            Err(error) => {
                // Nothing of a failed append counts: cut what reached the file.
                let _ = self.file.set_len(start);
                Err(error)
            }
        }
    }

    /// Whether the log holds more than twice its live records (and more
    /// than a few): worth [`VectorLog::compact`].
    pub fn wants_compaction(&self) -> bool {
        let records = self.bytes / record_bytes(self.width);
        records > 64 && records > 2 * self.last.len() as u64
    }

    /// The live records, in client order, into the next generation's file,
    /// which becomes the log. Older files stay until
    /// [`VectorLog::forget_others`]: a mark taken before (the last
    /// checkpoint's) can still be rewound to.
    pub fn compact(&mut self) -> Result<(), LogError> {
        let next = self
            .generation
            .checked_add(1)
            .ok_or_else(|| self.fail("no generation after this one".to_owned()))?;
        let mut clients: Vec<u32> = self.last.keys().copied().collect();
        clients.sort_unstable();
        let mut compacted = Self::start(&self.folder, next, self.width)?;
        for chunk in clients.chunks(64) {
            let mut vectors = Vec::with_capacity(chunk.len());
            for &client in chunk {
                let vector = self.get(client)?.expect("a live client has a record");
                vectors.push((client, vector));
            }
            compacted.put_all(vectors.iter().map(|(c, v)| (*c, v.as_slice())))?;
        }
        compacted.sync()?;
        *self = compacted;
        Ok(())
    }

    /// Deletes every other generation's file, once the current one's mark
    /// is safe in a checkpoint: nothing will rewind to them.
    pub fn forget_others(&self) -> Result<(), LogError> {
        let entries = std::fs::read_dir(&self.folder).map_err(|e| LogError {
            path: self.folder.clone(),
            problem: format!("cannot list: {e}"),
        })?;
        let current = self.path();
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let is_log = name.starts_with("vectors-") && name.ends_with(".log");
            if is_log && path != current {
                std::fs::remove_file(&path).map_err(|e| LogError {
                    path: path.clone(),
                    problem: format!("cannot delete: {e}"),
                })?;
            }
        }
        Ok(())
    }

    /// Flushes the file to disk, so a checkpoint's mark survives a crash.
    pub fn sync(&self) -> Result<(), LogError> {
        self.file
            .sync_data()
            .map_err(|e| self.fail(format!("cannot sync: {e}")))
    }
}

/// Floats a vector may have: a gigabyte's worth, what a checkpoint's tensors
/// may hold in all, so a mark read from a file cannot ask for more.
const MAX_WIDTH: usize = 1 << 28;

fn file_of(folder: &Path, generation: u32) -> PathBuf {
    folder.join(format!("vectors-{generation}.log"))
}

fn record_bytes(width: usize) -> u64 {
    4 + 4 * width as u64
}

fn write_floats(out: &mut impl Write, values: &[f32]) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(values.len() * 4);
    for value in values {
        bytes.extend_from_slice(&value.to_le_bytes());
    }
    out.write_all(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn vector(seed: u32, width: usize) -> Vec<f32> {
        (0..width)
            .map(|i| (seed * 31 + i as u32) as f32 * 0.5)
            .collect()
    }

    #[test]
    fn last_record_wins_and_a_mark_rewinds() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = VectorLog::create(dir.path(), 3).unwrap();
        log.put_all([(7, &[1.0, 2.0, 3.0][..]), (2, &[4.0, 5.0, 6.0][..])])
            .unwrap();
        let mark = log.mark();
        assert_eq!(mark.bytes, 2 * 16);
        log.put_all([(7, &[9.0, 9.0, 9.0][..]), (5, &[0.5, 0.5, 0.5][..])])
            .unwrap();
        assert_eq!(log.get(7).unwrap().unwrap(), [9.0, 9.0, 9.0]);
        assert_eq!(log.len(), 3);
        drop(log);
        let mut rewound = VectorLog::open_at(dir.path(), mark).unwrap();
        assert_eq!(rewound.get(7).unwrap().unwrap(), [1.0, 2.0, 3.0]);
        assert_eq!(rewound.get(5).unwrap(), None);
        assert_eq!(rewound.len(), 2);
        // A vector of another width is refused and leaves nothing behind.
        let error = rewound.put_all([(1, &[1.0][..])]).unwrap_err();
        assert!(
            error.to_string().contains("has 1 floats, the log holds 3"),
            "{error}"
        );
        assert_eq!(rewound.mark(), mark);
    }

    #[test]
    fn marks_that_do_not_fit_the_file_are_refused_with_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = VectorLog::create(dir.path(), 2).unwrap();
        log.put_all([(1, &[1.0, 2.0][..])]).unwrap();
        let mark = log.mark();
        let past_the_end = LogMark { bytes: 24, ..mark };
        let error = VectorLog::open_at(dir.path(), past_the_end).unwrap_err();
        assert!(
            error.to_string().contains("vectors-0.log: holds 12 bytes"),
            "{error}"
        );
        let ragged = LogMark { bytes: 5, ..mark };
        assert!(VectorLog::open_at(dir.path(), ragged).is_err());
        let missing = LogMark {
            generation: 4,
            ..mark
        };
        let error = VectorLog::open_at(dir.path(), missing).unwrap_err();
        assert!(
            error.to_string().contains("vectors-4.log: cannot open"),
            "{error}"
        );
    }

    #[test]
    fn compaction_keeps_the_live_vectors_and_older_marks_until_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = VectorLog::create(dir.path(), 4).unwrap();
        for round in 0..40u32 {
            let vectors: Vec<(u32, Vec<f32>)> =
                (0..5).map(|c| (c, vector(round * 5 + c, 4))).collect();
            log.put_all(vectors.iter().map(|(c, v)| (*c, v.as_slice())))
                .unwrap();
        }
        assert!(log.wants_compaction());
        let before = log.mark();
        log.compact().unwrap();
        log.compact().unwrap();
        assert_eq!(log.mark().generation, 2);
        assert_eq!(log.mark().bytes, 5 * 20);
        for c in 0..5 {
            assert_eq!(log.get(c).unwrap().unwrap(), vector(39 * 5 + c, 4));
        }
        // A mark from before both compactions still rewinds...
        let old = VectorLog::open_at(dir.path(), before).unwrap();
        assert_eq!(old.get(3).unwrap().unwrap(), vector(39 * 5 + 3, 4));
        // ... until the current generation's mark is kept and the rest forgotten.
        log.forget_others().unwrap();
        assert!(VectorLog::open_at(dir.path(), before).is_err());
        let files = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(files, 1);
    }

    /// An operation on the log: set some clients' vectors, take a mark, or
    /// rewind to the latest mark taken.
    #[derive(Debug, Clone)]
    enum Step {
        Put(Vec<(u32, u32)>),
        Mark,
        Rewind,
        Compact,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => prop::collection::vec((0u32..12, 0u32..1_000), 1..6).prop_map(Step::Put),
            1 => Just(Step::Mark),
            1 => Just(Step::Rewind),
            1 => Just(Step::Compact),
        ]
    }

    proptest! {
        /// Whatever is appended, compacted and rewound, the log reads like
        /// a map that is saved at each mark and restored at each rewind.
        #[test]
        fn the_log_reads_as_a_map_with_snapshots(steps in prop::collection::vec(step(), 1..40)) {
            let dir = tempfile::tempdir().unwrap();
            let width = 3;
            let mut log = VectorLog::create(dir.path(), width).unwrap();
            let mut model: BTreeMap<u32, Vec<f32>> = BTreeMap::new();
            let mut saved = (log.mark(), model.clone());
            for step in steps {
                match step {
                    Step::Put(puts) => {
                        let vectors: Vec<(u32, Vec<f32>)> =
                            puts.iter().map(|&(c, s)| (c, vector(s, width))).collect();
                        log.put_all(vectors.iter().map(|(c, v)| (*c, v.as_slice()))).unwrap();
                        model.extend(vectors);
                    }
                    // A mark is a checkpoint: the other generations go.
                    Step::Mark => {
                        saved = (log.mark(), model.clone());
                        log.forget_others().unwrap();
                    }
                    Step::Rewind => {
                        log = VectorLog::open_at(dir.path(), saved.0).unwrap();
                        model = saved.1.clone();
                    }
                    Step::Compact => log.compact().unwrap(),
                }
                prop_assert_eq!(log.len(), model.len());
                for (client, expected) in &model {
                    let stored = log.get(*client).unwrap();
                    prop_assert_eq!(stored.as_ref(), Some(expected));
                }
            }
        }
    }
}
