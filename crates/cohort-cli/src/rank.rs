//! Which rank of a plan this process is (`cohort worker`, or `cohort run
//! --plan` under mpirun/srun/a Kubernetes Indexed Job), and its seat in the
//! ring, read from the host file `cohort place --emit` wrote for it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use cohort_core::cluster::{
    Backend, LauncherRank, RankFile, client_blocks, host_file_name, launcher_rank,
};
use cohort_core::config::LoadedConfig;
use cohort_runtime::collective::ring::{RingPeer, RingSettings};
use cohort_runtime::{DistributedRun, RankLink};

/// Host files larger than this are not plans.
pub(crate) const MAX_HOST_FILE_BYTES: u64 = 1 << 20;

/// This process's seat in a distributed simulation, or `None` for a plain
/// single-process run: with `--plan`, the plan's host file for this rank
/// (ring or MPI backend); without it, the ranks mpirun or srun started (MPI),
/// each training an even block of the clients.
pub fn seat(
    plan_dir: Option<&Path>,
    instance: Option<&str>,
    rank: Option<u32>,
    loaded: &LoadedConfig,
) -> anyhow::Result<Option<DistributedRun>> {
    let launched = launcher_rank(|key| std::env::var(key).ok())
        .map_err(|problem| anyhow::anyhow!("{problem}"))?;
    let Some(plan_dir) = plan_dir else {
        return match launched {
            Some(launched) if launched.world_size > 1 => launched_seat(&launched, loaded).map(Some),
            _ => Ok(None),
        };
    };
    let rank = match (rank, &launched) {
        (Some(rank), _) => rank,
        (None, Some(launched)) => launched.rank,
        (None, None) => bail!(
            "--plan needs this process's rank: --rank R, or start it with mpirun, srun or a \
             Kubernetes Indexed Job (JOB_COMPLETION_INDEX with COHORT_WORLD_SIZE)"
        ),
    };
    let instance = match instance {
        Some(instance) => instance.to_owned(),
        None => only_instance(plan_dir, rank)?,
    };
    let path = plan_dir.join(host_file_name(&instance, rank));
    let file = read_host_file(&path)?;
    if let Some(launched) = launched
        && launched.world_size != file.world_size
    {
        bail!(
            "{}: the plan has {} ranks, but the launcher started {} ({})",
            path.display(),
            file.world_size,
            launched.world_size,
            launched.source
        );
    }
    let clients = &loaded.config().clients;
    if file.num_clients != clients.total_clients {
        bail!(
            "{}: the plan is for {} clients, the config has clients.total_clients = {}",
            path.display(),
            file.num_clients,
            clients.total_clients
        );
    }
    planned_seat(&path, file, loaded).map(Some)
}

/// Ranks started by mpirun or srun without a plan: MPI, even client blocks.
fn launched_seat(launched: &LauncherRank, loaded: &LoadedConfig) -> anyhow::Result<DistributedRun> {
    let total = loaded.config().clients.total_clients;
    if launched.world_size > total {
        bail!(
            "{} ranks were started ({}), but clients.total_clients = {total}: every rank \
             needs a client",
            launched.world_size,
            launched.source
        );
    }
    let blocks = client_blocks(total, &vec![1; launched.world_size as usize]);
    Ok(DistributedRun {
        rank: launched.rank,
        world_size: launched.world_size,
        clients: blocks[launched.rank as usize],
        workers: None,
        link: RankLink::Mpi,
    })
}

fn planned_seat(
    path: &Path,
    file: RankFile,
    loaded: &LoadedConfig,
) -> anyhow::Result<DistributedRun> {
    let rank = &file.rank;
    let link = match file.backend {
        Backend::Ring => RankLink::Ring(Box::new(ring_settings(path, &file, loaded)?)),
        Backend::Mpi | Backend::Rdma => RankLink::Mpi,
        Backend::Grpc => bail!(
            "{}: backend `grpc` is network mode (`cohort run` with clients.comm_simulation = \
             false and `cohort client` processes), not ranks; place with --backend ring or mpi",
            path.display()
        ),
    };
    let workers = usize::try_from(rank.workers)
        .ok()
        .filter(|&w| (1..cohort_runtime::distributed::WORKER_ID_STRIDE).contains(&w))
        .with_context(|| {
            format!(
                "{}: rank {} has {} workers; a rank runs 1 to {}",
                path.display(),
                rank.rank,
                rank.workers,
                cohort_runtime::distributed::WORKER_ID_STRIDE - 1
            )
        })?;
    Ok(DistributedRun {
        rank: rank.rank,
        world_size: file.world_size,
        clients: rank.clients,
        workers: Some(workers as u32),
        link,
    })
}

fn ring_settings(
    path: &Path,
    file: &RankFile,
    loaded: &LoadedConfig,
) -> anyhow::Result<RingSettings> {
    let rank = &file.rank;
    let (left, right) = match &rank.ring {
        Some(ring) => (ring.left.clone(), ring.right.clone()),
        // One rank: its own neighbour; nothing is ever sent.
        None if file.world_size == 1 => {
            let me = cohort_core::cluster::Peer {
                rank: 0,
                address: rank.listen.into(),
                node: rank.node.clone(),
            };
            (me.clone(), me)
        }
        None => bail!(
            "{}: rank {} has no ring neighbours",
            path.display(),
            rank.rank
        ),
    };
    let peer = |p: cohort_core::cluster::Peer| RingPeer {
        rank: p.rank,
        address: p.address,
        node: p.node,
    };
    // RankFile::parse refused a file without one (an older cohort's).
    let secret = file.secret.clone().with_context(|| {
        format!(
            "{}: no ring secret; emit the plan again with `cohort place --emit`",
            path.display()
        )
    })?;
    let server = &loaded.config().server;
    Ok(RingSettings {
        instance: file.instance.clone(),
        rank: rank.rank,
        world_size: file.world_size,
        listen: rank.listen,
        left: peer(left),
        right: peer(right),
        secret,
        connect_timeout: Duration::from_secs_f64(server.registration_timeout),
        io_timeout: Duration::from_secs_f64(server.payload_timeout),
    })
}

fn read_host_file(path: &Path) -> anyhow::Result<RankFile> {
    let text = cohort_core::fsutil::read_bounded_text(path, MAX_HOST_FILE_BYTES)
        .with_context(|| format!("cannot read the host file {}", path.display()))?;
    RankFile::parse(&text)
        .with_context(|| format!("{} is not a host file of `cohort place`", path.display()))
}

/// The instance of the single plan in `dir` that has a host file for `rank`.
fn only_instance(dir: &Path, rank: u32) -> anyhow::Result<String> {
    let suffix = format!("-{rank}.json");
    let mut instances: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read the plan folder {}", dir.display()))?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter_map(|name| {
            let instance = name.strip_prefix("hosts-")?.strip_suffix(&suffix)?;
            (host_file_name(instance, rank) == name).then(|| instance.to_owned())
        })
        .collect();
    instances.sort();
    match instances.as_slice() {
        [one] => Ok(one.clone()),
        [] => bail!(
            "{} has no host file for rank {rank}; write the plan with `cohort place --emit {}`",
            dir.display(),
            dir.display()
        ),
        many => bail!(
            "{} holds plans of several instances ({}); pick one with --instance",
            dir.display(),
            many.join(", ")
        ),
    }
}

/// The folder a follower rank names in its options: the run folder when
/// resuming (it reads the checkpoints), else one it never creates or writes.
pub fn follower_dir(resume: Option<&PathBuf>) -> PathBuf {
    resume.cloned().unwrap_or_default()
}
