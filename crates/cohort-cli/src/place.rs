//! `cohort place`: where a run's ranks go on a cluster, and the files that
//! start them.
//!
//! Every decision is `cohort_core::cluster::place`'s, a pure function; this
//! module gathers its inputs (the run config, the cluster file, a memory
//! estimate, the backends of this build, the ports that other instances' host
//! files in `--emit DIR` already hold) and writes what comes out: the table or
//! JSON on stdout, the host files and `launch-<instance>.txt` in `--emit DIR`.
//!
//! The memory need is an estimate from the model's size and the partition
//! sizes the config names, not a measurement; when nothing fits, the error
//! says what it assumed per rank, worker and client.
//!
//! A backend this build lacks fails before anything is written, but after the
//! cluster has been asked whether it could hold the run with that backend:
//! `rdma` on a partial mesh is refused for the missing link, not sent to a
//! rebuild with `--features mpi` that would end at the same wall.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use sha2::{Digest, Sha256};

use cohort_core::cluster::{
    self, Backend, Launch, LaunchSpec, MemoryNeed, PlacementError, Plan, RankCount, RankFile,
    Request,
};
use cohort_core::config::{Config, LoadedConfig, Sampler};
use cohort_core::fsutil::{atomic_write, atomic_write_private};
use cohort_train::registry::Registry;

#[derive(Args)]
pub struct PlaceArgs {
    /// The cluster file: nodes, interfaces, links (see
    /// configs/clusters/three_nodes.toml) [default: the config's `cluster.file`].
    #[arg(long, value_name = "FILE")]
    cluster: Option<PathBuf>,
    #[command(flatten)]
    config: crate::ConfigArgs,
    /// Collective backend: grpc, ring, mpi or rdma [default: `cluster.backend`, else grpc].
    #[arg(long, value_name = "NAME", value_parser = parse_backend)]
    backend: Option<Backend>,
    /// Exactly this many ranks [default: `cluster.ranks`, else one per node
    /// of the smallest set of nodes that fits].
    #[arg(long, value_name = "N")]
    ranks: Option<u32>,
    /// Fewest nodes to spread over [default: `cluster.min_nodes`, else 1].
    #[arg(long, value_name = "N")]
    min_nodes: Option<u32>,
    /// Names the instance, which keys ports, host files and launch lines
    /// [default: `general.run_name`, else `cohort-` and a hash of the config
    /// and the cluster file].
    #[arg(long, value_name = "ID")]
    instance: Option<String>,
    /// Bottom of the range of 1024 ports that instances share.
    #[arg(long, value_name = "P", default_value_t = cluster::DEFAULT_BASE_PORT)]
    base_port: u16,
    /// Print the plan as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Write each rank's host file, the Slurm host list and
    /// launch-<instance>.txt into DIR (created if needed). Other instances'
    /// files there stay, and their ports are avoided.
    #[arg(long, value_name = "DIR")]
    emit: Option<PathBuf>,
}

fn parse_backend(name: &str) -> Result<Backend, String> {
    Backend::parse(name).map_err(|error| error.to_string())
}

/// `cohort place`.
pub fn place(args: &PlaceArgs, registry: &Registry) -> anyhow::Result<()> {
    let loaded = args.config.load_unchecked()?;
    let size = run_size(&loaded, registry)?;
    let cluster_path = cluster_path(args, &loaded)?;
    let topology = cluster::load(&cluster_path)?;
    let instance = instance_name(args, &loaded, &cluster_path)?;
    let earlier = match &args.emit {
        Some(dir) => read_host_files(dir)?,
        None => Vec::new(),
    };
    let mut request = request(args, loaded.config(), instance, &size);
    request.ports_in_use = earlier
        .iter()
        .filter(|(_, file)| file.instance != request.instance)
        .map(|(_, file)| file.rank.listen.port())
        .collect::<BTreeSet<u16>>();
    let plan = place_in_this_build(&topology, &request, args, &loaded)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print!("{}", plan.table());
    }
    if let Some(dir) = &args.emit {
        emit(dir, &plan, &args.config, &earlier)?;
    }
    Ok(())
}

fn cluster_path(args: &PlaceArgs, loaded: &LoadedConfig) -> anyhow::Result<PathBuf> {
    args.cluster
        .clone()
        .or_else(|| loaded.cluster_file())
        .with_context(|| {
            format!(
                "no cluster file: pass --cluster FILE, or set `cluster.file` in {}",
                args.config.path().display()
            )
        })
}

/// `--instance`, else the run name, else a hash of what the plan is made
/// from, so that placing the same run on the same cluster again gives the
/// same instance, and with it the same ports and file names.
fn instance_name(
    args: &PlaceArgs,
    loaded: &LoadedConfig,
    cluster_path: &Path,
) -> anyhow::Result<String> {
    if let Some(instance) = args
        .instance
        .clone()
        .or(loaded.config().general.run_name.clone())
    {
        return Ok(instance);
    }
    let cluster_text =
        cohort_core::fsutil::read_bounded(cluster_path, cohort_core::fsutil::MAX_READ_BYTES)
            .with_context(|| format!("cannot read {}", cluster_path.display()))?;
    let mut hasher = Sha256::new();
    hasher.update(loaded.hash().as_bytes());
    hasher.update(&cluster_text);
    let digest = format!("{:x}", hasher.finalize());
    Ok(format!("cohort-{}", &digest[..12]))
}

/// `place()` with this build's backends. A backend the build lacks is
/// reported after the cluster has been asked whether it could hold the run
/// with it: when it could not (`rdma` on a partial mesh), rebuilding with
/// `--features mpi` would not help, so that is said first. The build's refusal
/// names `cluster.backend` and its file when the config chose the backend.
fn place_in_this_build(
    topology: &cluster::Topology,
    request: &Request,
    args: &PlaceArgs,
    loaded: &LoadedConfig,
) -> anyhow::Result<Plan> {
    let not_built = match cluster::place(topology, request) {
        Err(PlacementError::Backend(error)) => error,
        placed => return Ok(placed?),
    };
    let mut with_it = request.clone();
    with_it.available_backends.push(request.backend);
    cluster::place(topology, &with_it)?;
    if args.backend.is_none() {
        loaded.check_cluster_backend(&request.available_backends)?;
    }
    Err(not_built.into())
}

/// The request: flags first, then the config's `[cluster]`, then defaults.
fn request(args: &PlaceArgs, config: &Config, instance: String, size: &RunSize) -> Request {
    let cluster = &config.cluster;
    let need = memory_need(config, size);
    let mut request = Request::new(instance, config.clients.total_clients, need);
    request.backend = args.backend.or(cluster.backend).unwrap_or(Backend::Grpc);
    request.available_backends = cohort_runtime::available_backends();
    request.ranks = args
        .ranks
        .or(cluster.ranks)
        .map_or(RankCount::Fewest, RankCount::Exactly);
    request.min_nodes = args.min_nodes.or(cluster.min_nodes).unwrap_or(1);
    request.base_port = args.base_port;
    request
}

/// Bytes per parameter: cohort trains in float32.
const PARAMETER_BYTES: u64 = 4;

/// What the memory need is counted from, known before any data is read.
struct RunSize {
    /// Parameters of the model, counted on one built on the CPU (milliseconds).
    parameters: u64,
    /// Values of one sample of the data set.
    values_per_sample: usize,
    /// Samples of the data set's training split.
    train_samples: usize,
}

fn run_size(loaded: &LoadedConfig, registry: &Registry) -> anyhow::Result<RunSize> {
    let root = crate::data_root_env();
    let dataset = registry.dataset_in(loaded, root.as_deref())?;
    let model = registry.run_model_for(loaded, &dataset, dataset.sample_shape().to_vec())?;
    Ok(RunSize {
        parameters: model.template()?.num_elements() as u64,
        values_per_sample: dataset.sample_shape().iter().product(),
        train_samples: dataset.train_samples(),
    })
}

/// The model's parameters and each client's training data, as the runtime
/// holds it: float32 values and a 4-byte label per sample.
fn memory_need(config: &Config, size: &RunSize) -> MemoryNeed {
    let sample_bytes = (size.values_per_sample * 4 + 4) as u64;
    let per_client =
        (samples_per_client(config, size.train_samples) as u64).saturating_mul(sample_bytes);
    MemoryNeed::estimate(size.parameters, PARAMETER_BYTES, per_client)
}

/// Samples of the largest client the config names; for samplers that size
/// clients from the labels (not read here), the even share of the training
/// set, which is what a client holds on average.
fn samples_per_client(config: &Config, train_samples: usize) -> usize {
    let data = &config.data;
    let clients = config.clients.total_clients.max(1) as usize;
    match (data.sampler, &data.partition_sizes, data.partition_size) {
        (Sampler::Iid, Some(sizes), _) => sizes.iter().copied().max().unwrap_or(0),
        (Sampler::Iid | Sampler::IidCyclic, None, Some(size)) => size,
        _ => train_samples.div_ceil(clients),
    }
}

/// The host files already in `dir`, with their paths; none when it does not
/// exist yet. A file named like a host file that does not read as one is an
/// error: its ports would go unseen.
fn read_host_files(dir: &Path) -> anyhow::Result<Vec<(PathBuf, RankFile)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => {
            return Err(error).with_context(|| format!("cannot read {}", dir.display()));
        }
    };
    let mut files = Vec::new();
    for entry in entries {
        let path = entry
            .with_context(|| format!("cannot read {}", dir.display()))?
            .path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !(name.starts_with("hosts-") && name.ends_with(".json")) {
            continue;
        }
        let text = cohort_core::fsutil::read_bounded_text(&path, crate::rank::MAX_HOST_FILE_BYTES)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let file: RankFile = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a host file of `cohort place`; move it away or emit into another folder",
                path.display()
            )
        })?;
        files.push((path, file));
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(files)
}

/// Writes the plan's host files and launch lines into `dir`, each atomically.
/// The host files carry a ring secret drawn fresh for this plan, so they are
/// written readable and writable by their owner only (Unix); copy them to the
/// nodes the same way (`scp -p`, a Kubernetes Secret), not world-readable.
/// Host files this instance left from an earlier plan with more ranks are
/// removed, so that `cohort worker --rank` cannot start from a stale one.
fn emit(
    dir: &Path,
    plan: &Plan,
    config: &crate::ConfigArgs,
    earlier: &[(PathBuf, RankFile)],
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let write = |name: &str, contents: &str, private: bool| {
        let path = dir.join(name);
        let written = if private {
            atomic_write_private(&path, contents.as_bytes())
        } else {
            atomic_write(&path, contents.as_bytes())
        };
        written.with_context(|| format!("cannot write {}", path.display()))
    };
    let secret = cluster::RingSecret::generate().map_err(anyhow::Error::msg)?;
    let files = plan.host_files(&secret);
    for file in &files {
        // Rank files hold the secret; the Slurm host list does not.
        let private = file.name.starts_with("hosts-");
        write(&file.name, &file.contents, private)?;
    }
    for (path, old) in earlier {
        let ours = old.instance == plan.instance
            && path.file_name().and_then(|n| n.to_str())
                == Some(&cluster::host_file_name(&old.instance, old.rank.rank));
        if ours && old.rank.rank >= plan.world_size {
            std::fs::remove_file(path)
                .with_context(|| format!("cannot remove the stale {}", path.display()))?;
        }
    }
    let spec = LaunchSpec {
        program: "cohort".to_owned(),
        plan_dir: dir.display().to_string(),
        config: config.path().display().to_string(),
        config_args: config.command_line(),
    };
    let launch_name = format!("launch-{}.txt", plan.instance);
    write(
        &launch_name,
        &launch_text(plan, &plan.launch(&spec), dir),
        false,
    )?;
    eprintln!(
        "wrote hosts-{instance}-{{0..{}}}.json, slurm-hosts-{instance} and {launch_name} to {}",
        plan.world_size - 1,
        dir.display(),
        instance = plan.instance,
    );
    Ok(())
}

/// The three forms of launch lines, as a file a person reads and copies from.
fn launch_text(plan: &Plan, launch: &Launch, dir: &Path) -> String {
    let mut text = format!(
        "# cohort place: instance {}, backend {}, {} rank(s); host files in {}\n\
         #\n# One command per rank, each on its node (ring, grpc):\n",
        plan.instance,
        plan.backend,
        plan.world_size,
        dir.display()
    );
    for rank in &launch.plain {
        text.push_str(&format!(
            "# rank {} on {}\n{}\n",
            rank.rank, rank.host, rank.command
        ));
    }
    text.push_str(&format!(
        "\n# Or every rank at once with Open MPI (mpi, rdma):\n{}\n",
        launch.mpirun
    ));
    text.push_str(&format!(
        "\n# Or inside a Slurm allocation:\n{}\n",
        launch.srun
    ));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(text: &str) -> LoadedConfig {
        cohort_core::config::from_str(text, Path::new("run.toml")).unwrap()
    }

    fn config(text: &str) -> Config {
        loaded(text).config().clone()
    }

    const BASE: &str = "[parameters.optimizer]\nlearning_rate = 0.01\n";

    #[test]
    fn samples_per_client_come_from_the_partition_sizes_the_config_names() {
        let sized = config(&format!(
            "{BASE}[clients]\ntotal_clients = 3\nper_round = 1\n\
             [data]\npartition_sizes = [10, 300, 20]\n"
        ));
        assert_eq!(samples_per_client(&sized, 60_000), 300);
        let fixed = config(&format!("{BASE}[data]\npartition_size = 6000\n"));
        assert_eq!(samples_per_client(&fixed, 60_000), 6000);
        // 60,000 training images over the default 10 clients.
        assert_eq!(samples_per_client(&config(BASE), 60_000), 6000);
        let skewed = config(&format!(
            "{BASE}[clients]\ntotal_clients = 7\n[data]\nsampler = \"dirichlet\"\n"
        ));
        assert_eq!(samples_per_client(&skewed, 60_000), 8572);
    }

    #[test]
    fn the_memory_need_counts_the_model_and_the_client_data() {
        let loaded = loaded(&format!("{BASE}[data]\npartition_size = 100\n"));
        let size = run_size(&loaded, &Registry::builtin()).unwrap();
        let need = memory_need(loaded.config(), &size);
        // 100 samples of 784 float32 pixels and a 4-byte label.
        assert_eq!(need.per_client, 100 * 3140);
        // LeNet-5's 61,706 parameters, 4 bytes each.
        assert_eq!(need, MemoryNeed::estimate(61_706, 4, 100 * 3140));
    }
}
