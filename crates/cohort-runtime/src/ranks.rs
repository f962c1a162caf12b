//! A distributed simulation's ranks: who this process is among them, how it
//! meets the others (the TCP ring or MPI), and the transport that trains its
//! client block and gathers everyone's outcomes.

use anyhow::bail;

use cohort_core::config::LoadedConfig;
use cohort_core::hooks::ServerHooks;
use cohort_core::strategy::Strategy;

use crate::collective::Collective;
use crate::collective::ring::RingCollective;
use crate::distributed::{DistributedTransport, SharedCollective};
use crate::transport::Transport;

/// the other ranks.
#[derive(Debug, Clone)]
pub struct DistributedRun {
    pub rank: u32,
    pub world_size: u32,
    /// The logical clients this rank trains, every round.
    pub clients: cohort_core::cluster::ClientBlock,
    /// Its workers, as its plan gave them; `None`: `trainer.max_concurrency`.
    pub workers: Option<u32>,
    pub link: RankLink,
}

/// How a rank meets the others.
#[derive(Debug, Clone)]
pub enum RankLink {
    /// The built-in TCP ring, from a plan's host file.
    Ring(Box<crate::collective::ring::RingSettings>),
    /// Open MPI's world communicator (builds with the `mpi` feature).
    Mpi,
}

impl DistributedRun {
    pub fn leader(&self) -> bool {
        self.rank == 0
    }
}

/// The collective of `distributed`: joins the ring, or initializes MPI and
/// checks that it agrees with the launcher's rank and size.
fn connect_collective(distributed: &DistributedRun) -> anyhow::Result<Box<dyn Collective>> {
    match &distributed.link {
        RankLink::Ring(settings) => Ok(Box::new(RingCollective::connect((**settings).clone())?)),
        RankLink::Mpi => mpi_collective(distributed),
    }
}

#[cfg(feature = "mpi")]
fn mpi_collective(distributed: &DistributedRun) -> anyhow::Result<Box<dyn Collective>> {
    let world = crate::collective::mpi::MpiCollective::initialize()?;
    if (world.rank(), world.world_size()) != (distributed.rank, distributed.world_size) {
        bail!(
            "MPI says rank {} of {}, the launcher's environment rank {} of {}",
            world.rank(),
            world.world_size(),
            distributed.rank,
            distributed.world_size
        );
    }
    Ok(Box::new(world))
}

#[cfg(not(feature = "mpi"))]
fn mpi_collective(_: &DistributedRun) -> anyhow::Result<Box<dyn Collective>> {
    bail!(
        "backend `mpi`: this build of cohort has no MPI; rebuild with `--features mpi` \
         (needs libopenmpi-dev and libclang-dev), or place the run with `--backend ring`"
    )
}

/// Folder of the run folder where the client processes a network-mode run
/// This rank's client block when the ranks exchange partial sums
/// (`cluster.reduce = partial`); refused for strategies and hooks that need
/// every update.
pub(crate) fn partial_reduce(
    loaded: &LoadedConfig,
    distributed: Option<&DistributedRun>,
    strategy: &dyn Strategy,
    hooks: &dyn ServerHooks,
) -> anyhow::Result<Option<cohort_core::cluster::ClientBlock>> {
    let wanted = loaded.config().cluster.reduce == Some(cohort_core::config::Reduce::Partial);
    let Some(distributed) = distributed.filter(|_| wanted) else {
        return Ok(None);
    };
    if !strategy.aggregates_by_mean() {
        bail!(
            "cluster.reduce = \"partial\" needs a strategy that aggregates by the weighted mean \
             (fedavg, fedprox, fedavgm, fedadam, fedyogi, fedadagrad); `{}` needs every update: use reduce = \"gather\"",
            strategy.name()
        );
    }
    if loaded.config().server.max_update_norm_ratio.is_some() {
        bail!(
            "cluster.reduce = \"partial\": server.max_update_norm_ratio compares each update \
             with the round's median, which no rank holds; use reduce = \"gather\""
        );
    }
    if !hooks.passes_through() {
        bail!(
            "cluster.reduce = \"partial\": server hooks see every payload of a round, which no \
             rank holds; use reduce = \"gather\""
        );
    }
    Ok(Some(distributed.clients))
}

/// Joins the other ranks and wraps this rank's worker pool so that each round
/// trains this rank's clients and gathers everyone's outcomes.
pub(crate) fn join_ranks(
    loaded: &LoadedConfig,
    distributed: &DistributedRun,
    local: Box<dyn Transport>,
    partial: bool,
) -> anyhow::Result<(Box<dyn Transport>, SharedCollective)> {
    if !loaded.config().clients.comm_simulation {
        bail!(
            "a distributed simulation trains each rank's clients on its own workers; set \
             clients.comm_simulation = true (network mode is the grpc backend)"
        );
    }
    let collective: SharedCollective =
        std::rc::Rc::new(std::cell::RefCell::new(connect_collective(distributed)?));
    let transport = DistributedTransport::new(
        local,
        std::rc::Rc::clone(&collective),
        distributed.clients,
        crate::distributed::WORKER_ID_STRIDE,
        loaded.decode_limits().max_bytes as u64,
        partial,
    );
    Ok((Box::new(transport), collective))
}
