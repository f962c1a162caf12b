//! Where a round's admitted updates wait for aggregation when the server
//! folds them into the mean one at a time (`RoundLoop::aggregate_folded`):
//! in memory up to a budget (what the bytes in flight leave of
//! `server.max_inflight_bytes`), then in a file of
//! the run folder, so a round of many clients needs no more memory than the
//! budget whatever its number of updates.
//!
//! Each update is written as it is admitted (after its checks), as plain
//! safetensors, which gives back every leaf bit for bit; aggregation reads
//! each back once, in selection order. The file is removed when the round's
//! store is dropped, whether the round succeeded or not.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

use cohort_core::codec::{self, DecodeLimits};
use cohort_core::tree::ParamTree;

use crate::updates::Arrived;

/// Where and past how many bytes a round's updates go to disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SpillSettings {
    /// Bytes of decoded updates a round keeps in memory.
    pub(crate) budget: u64,
    /// The run folder, where the spill file is made.
    pub(crate) folder: PathBuf,
}

/// One round's admitted updates: in memory up to the budget, the rest in
/// the spill file.
#[derive(Debug)]
pub(crate) struct UpdateStore {
    budget: u64,
    /// Bytes of the trees kept in memory so far.
    held: u64,
    path: PathBuf,
    file: Option<File>,
    /// Where each spilled update (by its slot) lies in the file.
    spilled: HashMap<usize, (u64, usize)>,
    written: u64,
}

impl UpdateStore {
    pub(crate) fn new(settings: &SpillSettings, round: u32) -> Self {
        Self {
            budget: settings.budget,
            held: 0,
            path: settings
                .folder
                .join(format!("round-{round:04}.updates.spill")),
            file: None,
            spilled: HashMap::new(),
            written: 0,
        }
    }

    /// Keeps `arrived`'s update: in memory while the round's updates fit
    /// the budget, otherwise written to the spill file (its tree left
    /// empty), so memory stops growing with the round's clients.
    pub(crate) fn keep(&mut self, arrived: &mut Arrived) -> anyhow::Result<()> {
        let size = arrived.tree.size_in_bytes() as u64;
        if self.held.saturating_add(size) <= self.budget {
            self.held += size;
            return Ok(());
        }
        let client_id = arrived.report.client_id;
        let bytes = codec::encode(&arrived.tree)
            .with_context(|| format!("client {client_id}'s update cannot be encoded to spill"))?;
        let file = match &mut self.file {
            Some(file) => file,
            None => self.file.insert(create(&self.path)?),
        };
        file.write_all(&bytes).with_context(|| {
            format!(
                "cannot write client {client_id}'s update to the spill file {}",
                self.path.display()
            )
        })?;
        self.spilled
            .insert(arrived.slot, (self.written, bytes.len()));
        self.written += bytes.len() as u64;
        arrived.tree = ParamTree::None;
        Ok(())
    }

    /// `arrived`'s update, moved out of memory or read back from the file.
    pub(crate) fn take(&mut self, arrived: &mut Arrived) -> anyhow::Result<ParamTree> {
        let Some(&(offset, len)) = self.spilled.get(&arrived.slot) else {
            return Ok(std::mem::replace(&mut arrived.tree, ParamTree::None));
        };
        let client_id = arrived.report.client_id;
        let path = &self.path;
        let failed = || {
            format!(
                "cannot read back client {client_id}'s update from the spill file {}",
                path.display()
            )
        };
        let file = self.file.as_mut().with_context(failed)?;
        let mut bytes = vec![0u8; len];
        file.seek(SeekFrom::Start(offset))
            .and_then(|_| file.read_exact(&mut bytes))
            .with_context(failed)?;
        // The server wrote these bytes itself; no limit below their size.
        let limits = DecodeLimits {
            max_bytes: len,
            max_tensors: usize::MAX,
        };
        let tree = codec::decode(&bytes, &limits).with_context(failed)?;
        // Writing resumes at the end if the round keeps more.
        file.seek(SeekFrom::End(0)).with_context(failed)?;
        Ok(tree)
    }

    /// How many of the round's updates went to disk.
    pub(crate) fn spilled(&self) -> usize {
        self.spilled.len()
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

fn create(path: &Path) -> anyhow::Result<File> {
    File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("cannot create the spill file {}", path.display()))
}

impl Drop for UpdateStore {
    fn drop(&mut self) {
        if self.file.take().is_some()
            && let Err(error) = std::fs::remove_file(&self.path)
        {
            tracing::warn!(
                file = %self.path.display(),
                "cannot remove the round's spill file: {error}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::updates::tests::{arrival, report};
    use cohort_core::tree::{Array, ArrayData, DType};

    fn arrived(slot: usize, tree: ParamTree) -> Arrived {
        Arrived {
            slot,
            report: report(slot as u32 + 1, 10, 0.5, 1.0),
            tree,
            arrival: arrival(10, (0, 0)),
            declared: None,
        }
    }

    fn tree(seed: f32) -> ParamTree {
        ParamTree::from_dotted([
            (
                "a.weight".to_owned(),
                Array::f32(vec![2, 3], (0..6).map(|i| seed * i as f32).collect()).unwrap(),
            ),
            (
                "b".to_owned(),
                // float16 1.0 and -0.0, which must come back as they went.
                Array::new(
                    vec![2],
                    ArrayData::from_le_bytes(DType::F16, &[0x00, 0x3c, 0x00, 0x80]).unwrap(),
                )
                .unwrap(),
            ),
        ])
    }

    #[test]
    fn updates_past_the_budget_go_to_disk_and_come_back_bit_for_bit() {
        let folder = tempfile::tempdir().unwrap();
        let one = tree(1.0).size_in_bytes() as u64;
        let settings = SpillSettings {
            budget: 2 * one,
            folder: folder.path().to_owned(),
        };
        let mut store = UpdateStore::new(&settings, 3);
        let mut updates: Vec<Arrived> = (0..5)
            .map(|slot| arrived(slot, tree(slot as f32 + 0.5)))
            .collect();
        // Kept in arrival order, not slot order.
        for update in updates.iter_mut().rev() {
            store.keep(update).unwrap();
        }
        assert_eq!(store.spilled(), 3);
        assert!(store.path().ends_with("round-0003.updates.spill"));
        assert!(store.path().exists());
        let spilled = updates.iter().filter(|u| u.tree == ParamTree::None).count();
        assert_eq!(spilled, 3);
        for update in &mut updates {
            let slot = update.slot;
            let back = store.take(update).unwrap();
            let bits = |t: &ParamTree| -> Vec<Vec<u8>> {
                t.leaves()
                    .iter()
                    .map(|(_, a)| a.data().to_le_bytes())
                    .collect()
            };
            assert_eq!(bits(&back), bits(&tree(slot as f32 + 0.5)), "slot {slot}");
            assert_eq!(back, tree(slot as f32 + 0.5));
        }
        let path = store.path().to_owned();
        drop(store);
        assert!(!path.exists(), "the spill file outlived its round");
    }

    #[test]
    fn a_spill_file_that_cannot_be_made_or_read_is_named() {
        let folder = tempfile::tempdir().unwrap();
        let settings = SpillSettings {
            budget: 0,
            folder: folder.path().join("missing"),
        };
        let mut store = UpdateStore::new(&settings, 1);
        let error = store.keep(&mut arrived(0, tree(1.0))).unwrap_err();
        let message = format!("{error:#}");
        assert!(
            message.contains("cannot create the spill file") && message.contains("missing"),
            "{message}"
        );

        let settings = SpillSettings {
            budget: 0,
            folder: folder.path().to_owned(),
        };
        let mut store = UpdateStore::new(&settings, 2);
        let mut update = arrived(0, tree(1.0));
        store.keep(&mut update).unwrap();
        // Cut short behind the server's back.
        std::fs::OpenOptions::new()
            .write(true)
            .open(store.path())
            .unwrap()
            .set_len(4)
            .unwrap();
        let message = format!("{:#}", store.take(&mut update).unwrap_err());
        assert!(
            message.contains("cannot read back client 1's update from the spill file")
                && message.contains("round-0002.updates.spill"),
            "{message}"
        );
    }
}
