//! The `mpi` backend: the ranks mpirun or srun started, through Open MPI
//! (rsmpi), so every transport Open MPI has (TCP, shared memory, UCX and
//! verbs for RDMA) carries the all-gather. Built only with the `mpi` feature.

use super::{Collective, CollectiveError};

/// The world communicator of this process; MPI is finalized when it drops.
pub struct MpiCollective {
    _universe: mpi::environment::Universe,
    world: mpi::topology::SimpleCommunicator,
}

impl MpiCollective {
    /// Initializes MPI. Only the thread that calls this talks to MPI
    /// (`Funneled`): the worker pool's threads never do.
    pub fn initialize() -> Result<Self, CollectiveError> {
        let (universe, _threading) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .ok_or_else(|| CollectiveError {
                message: "MPI was initialized already in this process".to_owned(),
            })?;
        let world = universe.world();
        Ok(Self {
            _universe: universe,
            world,
        })
    }
}

impl Collective for MpiCollective {
    fn rank(&self) -> u32 {
        use mpi::traits::Communicator;
        self.world.rank() as u32
    }

    fn world_size(&self) -> u32 {
        use mpi::traits::Communicator;
        self.world.size() as u32
    }

    fn all_gather(
        &mut self,
        mine: Vec<u8>,
        max_bytes: u64,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        use mpi::Count;
        use mpi::datatype::PartitionMut;
        use mpi::traits::{Communicator, CommunicatorCollectives};
        let size = self.world.size() as usize;
        // A length past what MPI counts in (2^31 − 1) is announced as −1, so
        // every rank sees it and refuses the round together.
        let own = Count::try_from(mine.len()).unwrap_or(-1);
        let mut counts: Vec<Count> = vec![0; size];
        self.world.all_gather_into(&own, &mut counts[..]);
        for (rank, &count) in counts.iter().enumerate() {
            if count < 0 || count as u64 > max_bytes {
                return Err(CollectiveError {
                    message: format!(
                        "rank {rank} has {} bytes to share, more than the {max_bytes} allowed",
                        if count < 0 {
                            "over 2 GiB of".to_owned()
                        } else {
                            count.to_string()
                        }
                    ),
                });
            }
        }
        let mut displacements = Vec::with_capacity(size);
        let mut total: Count = 0;
        for &count in &counts {
            displacements.push(total);
            total = total.checked_add(count).ok_or_else(|| CollectiveError {
                message: "the round's outcomes pass MPI's 2 GiB per call".to_owned(),
            })?;
        }
        let mut buffer = vec![0u8; total as usize];
        {
            let mut partition = PartitionMut::new(&mut buffer[..], &counts[..], &displacements[..]);
            self.world
                .all_gather_varcount_into(&mine[..], &mut partition);
        }
        Ok(counts
            .iter()
            .zip(&displacements)
            .map(|(&count, &at)| buffer[at as usize..(at + count) as usize].to_vec())
            .collect())
    }
}
