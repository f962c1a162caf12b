//! How the ranks of a distributed run exchange bytes. One operation is
//! enough for federated rounds: [`Collective::all_gather`], after which every
//! rank holds every rank's contribution in rank order, so every rank can run
//! the same deterministic aggregation and end the round with the same model.
//!
//! Backends: [`ring::RingCollective`] (TCP, built in, for machines without
//! MPI) and, in builds with the `mpi` feature, `mpi::MpiCollective` (Open
//! MPI through rsmpi).

#[cfg(feature = "mpi")]
pub mod mpi;
pub mod ring;

use std::fmt;

/// What a collective operation can fail with: which peer, and what happened.
#[derive(Debug)]
pub struct CollectiveError {
    pub message: String,
}

impl fmt::Display for CollectiveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CollectiveError {}

/// Not `Send`: MPI's communicators belong to the thread that made them, and
/// the round loop drives every collective from one thread.
pub trait Collective {
    fn rank(&self) -> u32;
    fn world_size(&self) -> u32;
    /// Every rank's `mine`, indexed by rank; all ranks get the same list.
    /// Each contribution is at most `max_bytes`, or the call fails.
    fn all_gather(
        &mut self,
        mine: Vec<u8>,
        max_bytes: u64,
    ) -> Result<Vec<Vec<u8>>, CollectiveError>;
}

/// The collective of a run in one process: gathering is a copy.
#[derive(Debug, Default)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> u32 {
        0
    }

    fn world_size(&self) -> u32 {
        1
    }

    fn all_gather(
        &mut self,
        mine: Vec<u8>,
        _max_bytes: u64,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        Ok(vec![mine])
    }
}
