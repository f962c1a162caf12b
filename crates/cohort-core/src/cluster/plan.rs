//! The plan `place()` returns, and what is made from it without I/O: the
//! table, per-rank host files (name and contents; writing them is the CLI's
//! job) and the command lines that start the ranks.
//!
//! Addresses follow exo's rules. Rank 0's coordinator binds `0.0.0.0` on the
//! instance's first port; every other rank is given the address *of rank 0*
//! that it can reach: rank 0's end of the best socket link between their two
//! nodes (interface kind first, then bandwidth), or `127.0.0.1` when they
//! share a node. Ring neighbours are found the same way, per rank: a single
//! host list for all ranks is what broke exo's 3-node rings, since the address
//! by which one node reaches another is not the one a third node uses.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::address::{Host, HostPort};

use serde::{Deserialize, Serialize};

use super::backend::Backend;
use super::place::{Layout, Request};
use super::secret::RingSecret;
use super::size::format_bytes;
use super::split::ClientBlock;
use super::topology::Topology;

/// Where a run's ranks go and how they reach each other.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The instance (run id) the plan is for.
    pub instance: String,
    /// The collective backend.
    pub backend: Backend,
    /// Number of ranks.
    pub world_size: u32,
    /// Logical clients, split over the ranks' `clients` blocks.
    pub num_clients: u32,
    /// The port rank 0's coordinator listens on.
    pub coordinator_port: u16,
    /// The chosen nodes, rank 0's first.
    pub nodes: Vec<PlacedNode>,
    /// The ranks, in order.
    pub ranks: Vec<RankPlan>,
    /// For `rdma`: entry `[i][j]` is the RDMA device on rank `i`'s node that
    /// reaches rank `j`'s node; `None` on the diagonal and between ranks of
    /// one node (they share memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma_devices: Option<Vec<Vec<Option<String>>>>,
}

/// A chosen node and what it takes on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedNode {
    /// The node's id.
    pub id: String,
    /// The name launchers reach it by.
    pub host: String,
    /// Ranks it runs.
    pub ranks: u32,
    /// Bytes its ranks need, estimated.
    pub memory_needed: u64,
    /// Bytes it has for the run.
    pub memory: u64,
}

/// One rank of the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPlan {
    /// The rank.
    pub rank: u32,
    /// Id of its node.
    pub node: String,
    /// Host name of its node.
    pub host: String,
    /// Where it listens: `0.0.0.0` on its own port (rank 0's is the
    /// coordinator port).
    pub listen: SocketAddr,
    /// Rank 0's coordinator as this rank reaches it (`0.0.0.0:port` for rank 0
    /// itself, which binds it): an IP address, or the DNS name the cluster
    /// file gave rank 0's interface.
    pub coordinator: HostPort,
    /// Workers: clients trained at once.
    pub workers: u32,
    /// The logical clients it trains, every round.
    pub clients: ClientBlock,
    /// Bytes it needs, estimated.
    pub memory_needed: u64,
    /// Its ring neighbours, for the `ring` backend with two ranks or more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring: Option<RingPeers>,
}

/// A rank's place in the ring.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingPeers {
    /// The rank before it (rank − 1, wrapping).
    pub left: Peer,
    /// The rank after it (rank + 1, wrapping).
    pub right: Peer,
    /// One entry per rank, as MLX's ring reads it: `0.0.0.0:port` for itself,
    /// the neighbours' addresses as this rank reaches them, `None` for ranks it
    /// never talks to.
    pub hosts: Vec<Option<HostPort>>,
}

/// Another rank as one rank reaches it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    /// Its rank.
    pub rank: u32,
    /// Its address (or DNS name) and port, from this rank's side.
    pub address: HostPort,
    /// Id of its node, so that errors about it can name the machine.
    #[serde(default)]
    pub node: String,
}

/// What one rank's host file holds: its part of the plan and what it shares.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankFile {
    /// The instance.
    pub instance: String,
    /// The backend.
    pub backend: Backend,
    /// Number of ranks.
    pub world_size: u32,
    /// Logical clients of the run.
    pub num_clients: u32,
    /// This rank.
    pub rank: RankPlan,
    /// The RDMA device matrix, for `rdma`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma_devices: Option<Vec<Vec<Option<String>>>>,
    /// The plan's ring secret, the same in every host file of the plan (64
    /// hex digits): ring ranks prove they hold it before they exchange
    /// anything. Optional here only so that a file written by an older cohort
    /// reads and is refused by [`RankFile::parse`] with a reason (and so that
    /// `cohort place --emit` can still read such files' ports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<RingSecret>,
}

/// Why a host file cannot seat a rank.
#[derive(Debug, thiserror::Error)]
pub enum HostFileError {
    #[error("not the JSON of a host file: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Invalid(String),
}

impl RankFile {
    /// Reads a host file's contents (JSON, as [`Plan::host_files`] writes
    /// them) and checks that they can seat a rank: a file is anyone's to
    /// edit, and a rank or neighbour outside the world would index past it.
    pub fn parse(text: &str) -> Result<Self, HostFileError> {
        let file: RankFile = serde_json::from_str(text)?;
        file.check().map_err(HostFileError::Invalid)?;
        Ok(file)
    }

    fn check(&self) -> Result<(), String> {
        let (world, rank) = (self.world_size, &self.rank);
        if self.secret.is_none() {
            return Err(format!(
                "the host file of rank {} of `{}` has no ring secret: it was written by an \
                 older cohort; emit the plan again (`cohort place --emit DIR`) and copy the new \
                 host files to every node",
                rank.rank, self.instance
            ));
        }
        if world == 0 {
            return Err("world_size = 0: a plan has at least one rank".to_owned());
        }
        if rank.rank >= world {
            return Err(format!(
                "rank = {}, but world_size = {world}: ranks are 0 to {}",
                rank.rank,
                world - 1
            ));
        }
        let block = rank.clients;
        if block.first == 0 || block.first > block.last || block.last > self.num_clients {
            return Err(format!(
                "rank {}'s clients {}..={} are not a block of clients 1 to num_clients = {}",
                rank.rank, block.first, block.last, self.num_clients
            ));
        }
        if let Some(ring) = &rank.ring {
            for (side, peer) in [("left", &ring.left), ("right", &ring.right)] {
                if peer.rank >= world {
                    return Err(format!(
                        "rank {}'s {side} neighbour is rank {}, but world_size = {world}",
                        rank.rank, peer.rank
                    ));
                }
            }
            if ring.hosts.len() != world as usize {
                return Err(format!(
                    "rank {}'s ring lists {} hosts for {world} ranks",
                    rank.rank,
                    ring.hosts.len()
                ));
            }
        }
        if let Some(matrix) = &self.rdma_devices
            && (matrix.len() != world as usize
                || matrix.iter().any(|row| row.len() != world as usize))
        {
            return Err(format!("rdma_devices is not a {world} × {world} matrix"));
        }
        Ok(())
    }
}

/// A file to write: its name (no directory) and contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFile {
    /// File name, keyed by instance (and rank), so that two instances sharing
    /// a folder never overwrite each other's files.
    pub name: String,
    /// The contents.
    pub contents: String,
}

/// What the launch command lines need besides the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchSpec {
    /// The cohort binary. Default: `cohort`.
    pub program: String,
    /// Folder that holds the host files, as the nodes see it.
    /// Default: `plan`.
    pub plan_dir: String,
    /// The run config, as the nodes see it. Default: `config.toml`.
    pub config: String,
    /// Arguments that change the config, after `--config` on every line
    /// (`--set KEY=VALUE`, `--unset KEY`, `--rounds N`), so each rank runs
    /// the config that was placed. Default: none.
    pub config_args: Vec<String>,
}

impl Default for LaunchSpec {
    fn default() -> Self {
        Self {
            program: "cohort".to_owned(),
            plan_dir: "plan".to_owned(),
            config: "config.toml".to_owned(),
            config_args: Vec::new(),
        }
    }
}

/// Command lines that start a plan's ranks, in three forms.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Launch {
    /// One command per rank, to run on its node (`ring`, `grpc`).
    pub plain: Vec<RankCommand>,
    /// One mpirun line that starts every rank (`mpi`, `rdma`).
    pub mpirun: String,
    /// One srun line for a Slurm allocation; it reads the plan's
    /// `slurm-hosts-<instance>` file to put each rank on its node.
    pub srun: String,
}

/// The command that starts one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankCommand {
    /// The rank.
    pub rank: u32,
    /// Host to run it on.
    pub host: String,
    /// The command line.
    pub command: String,
}

/// Name of the host file of `rank` of `instance`: `hosts-<instance>-<rank>.json`.
pub fn host_file_name(instance: &str, rank: u32) -> String {
    format!("hosts-{instance}-{rank}.json")
}

/// Whether `name` can key file names: 1 to 64 letters, digits, `-`, `_`, `.`,
/// not starting with `.` or `-` (no hidden files, no options).
pub(crate) fn is_instance_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

const ANY: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Rank `to` as rank `from` reaches it.
fn reach(topology: &Topology, layout: &Layout, ports: &[u16], from: usize, to: usize) -> HostPort {
    let (a, b) = (layout.rank_node[from], layout.rank_node[to]);
    let host = if a == b {
        Host::Ip(LOOPBACK)
    } else {
        // place() chose only sets whose every pair has a socket link.
        topology
            .address_of(b, a)
            .expect("placement checked a socket link between every pair of nodes")
            .clone()
    };
    HostPort::new(host, ports[to])
}

fn ring_peers(topology: &Topology, layout: &Layout, ports: &[u16], rank: usize) -> RingPeers {
    let size = layout.rank_node.len();
    let (left, right) = ((rank + size - 1) % size, (rank + 1) % size);
    let peer = |other: usize| Peer {
        rank: other as u32,
        address: reach(topology, layout, ports, rank, other),
        node: topology.nodes()[layout.rank_node[other]].id.clone(),
    };
    let hosts = (0..size)
        .map(|other| match other {
            _ if other == rank => Some(HostPort::new(ANY, ports[rank])),
            _ if other == left || other == right => Some(peer(other).address),
            _ => None,
        })
        .collect();
    RingPeers {
        left: peer(left),
        right: peer(right),
        hosts,
    }
}

fn rdma_matrix(topology: &Topology, layout: &Layout) -> Vec<Vec<Option<String>>> {
    let nodes = &layout.rank_node;
    nodes
        .iter()
        .map(|&a| {
            nodes
                .iter()
                .map(|&b| (a != b).then(|| topology.rdma_device(a, b).map(str::to_owned)))
                .map(Option::flatten)
                .collect()
        })
        .collect()
}

/// The plan of a layout that fits, with its ports (one per rank).
pub(crate) fn build(
    topology: &Topology,
    request: &Request,
    layout: &Layout,
    ports: &[u16],
) -> Plan {
    let nodes = topology.nodes();
    let size = layout.rank_node.len();
    let ring = request.backend == Backend::Ring && size > 1;
    let ranks = (0..size)
        .map(|rank| {
            let node = &nodes[layout.rank_node[rank]];
            RankPlan {
                rank: rank as u32,
                node: node.id.clone(),
                host: node.host.clone(),
                listen: SocketAddr::new(ANY, ports[rank]),
                coordinator: match rank {
                    0 => HostPort::new(ANY, ports[0]),
                    _ => reach(topology, layout, ports, rank, 0),
                },
                workers: layout.workers[rank],
                clients: layout.blocks[rank],
                memory_needed: layout.rank_memory[rank],
                ring: ring.then(|| ring_peers(topology, layout, ports, rank)),
            }
        })
        .collect();
    let placed = layout
        .nodes
        .iter()
        .zip(&layout.node_memory)
        .map(|(&n, &needed)| PlacedNode {
            id: nodes[n].id.clone(),
            host: nodes[n].host.clone(),
            ranks: layout.rank_node.iter().filter(|&&r| r == n).count() as u32,
            memory_needed: needed,
            memory: nodes[n].memory,
        })
        .collect();
    Plan {
        instance: request.instance.clone(),
        backend: request.backend,
        world_size: size as u32,
        num_clients: request.num_clients,
        coordinator_port: ports[0],
        nodes: placed,
        ranks,
        rdma_devices: (request.backend == Backend::Rdma).then(|| rdma_matrix(topology, layout)),
    }
}

impl Plan {
    /// The rank that trains client `id` (1-based), every round.
    pub fn rank_of_client(&self, id: u32) -> Option<u32> {
        let rank = self.ranks.iter().find(|r| r.clients.contains(id))?;
        Some(rank.rank)
    }

    /// The ports this plan takes; pass them as `ports_in_use` when placing
    /// another instance on the same nodes.
    pub fn ports(&self) -> BTreeSet<u16> {
        self.ranks.iter().map(|r| r.listen.port()).collect()
    }

    /// The host file of each rank, `hosts-<instance>-<rank>.json`, each with
    /// `secret` (draw a fresh one per plan: [`RingSecret::generate`]; the files
    /// are then secrets, to write readable by their owner only), and
    /// `slurm-hosts-<instance>` (one host per rank, for `srun`; no secret).
    pub fn host_files(&self, secret: &RingSecret) -> Vec<HostFile> {
        let mut files: Vec<HostFile> = self
            .ranks
            .iter()
            .map(|rank| {
                let file = RankFile {
                    instance: self.instance.clone(),
                    backend: self.backend,
                    world_size: self.world_size,
                    num_clients: self.num_clients,
                    rank: rank.clone(),
                    rdma_devices: self.rdma_devices.clone(),
                    secret: Some(secret.clone()),
                };
                let json = serde_json::to_string_pretty(&file).expect("plans serialize");
                HostFile {
                    name: host_file_name(&self.instance, rank.rank),
                    contents: json + "\n",
                }
            })
            .collect();
        files.push(HostFile {
            name: self.slurm_hosts_name(),
            contents: self.ranks.iter().map(|r| format!("{}\n", r.host)).collect(),
        });
        files
    }

    fn slurm_hosts_name(&self) -> String {
        format!("slurm-hosts-{}", self.instance)
    }

    /// The command lines that start the ranks: per rank, with mpirun, with srun.
    pub fn launch(&self, spec: &LaunchSpec) -> Launch {
        let dir = spec.plan_dir.trim_end_matches('/');
        let dir = if dir.is_empty() { "/" } else { dir };
        let (program, instance) = (shell_word(&spec.program), shell_word(&self.instance));
        let config: String = std::iter::once(&spec.config)
            .chain(&spec.config_args)
            .map(|word| shell_word(word))
            .collect::<Vec<_>>()
            .join(" ");
        let run = format!(
            "{program} run --config {config} --plan {} --instance {instance}",
            shell_word(dir)
        );
        let plain = self
            .ranks
            .iter()
            .map(|rank| RankCommand {
                rank: rank.rank,
                host: rank.host.clone(),
                command: format!(
                    "{program} worker --config {config} --plan {} --instance {instance} --rank {}",
                    shell_word(dir),
                    rank.rank
                ),
            })
            .collect();
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("{}:{}", n.host, n.ranks))
            .collect();
        // UCX is Open MPI's transport for InfiniBand and RoCE devices.
        let transport = if self.backend == Backend::Rdma {
            " --mca pml ucx"
        } else {
            ""
        };
        let mpirun = format!(
            "mpirun -n {} --host {}{transport} {run}",
            self.world_size,
            hosts.join(",")
        );
        let hostfile = shell_word(&format!("{dir}/{}", self.slurm_hosts_name()));
        let srun = format!(
            "SLURM_HOSTFILE={hostfile} srun --ntasks={} --distribution=arbitrary {run}",
            self.world_size
        );
        Launch {
            plain,
            mpirun,
            srun,
        }
    }

    /// A readable table of the ranks, with a line per node below.
    pub fn table(&self) -> String {
        let peer = |p: &Peer| format!("{} {}", p.rank, p.address);
        let mut rows = vec![
            [
                "rank",
                "node",
                "listen",
                "coordinator",
                "workers",
                "clients",
                "left",
                "right",
            ]
            .map(str::to_owned)
            .to_vec(),
        ];
        for r in &self.ranks {
            let (left, right) = match &r.ring {
                Some(ring) => (peer(&ring.left), peer(&ring.right)),
                None => ("-".to_owned(), "-".to_owned()),
            };
            rows.push(vec![
                r.rank.to_string(),
                r.node.clone(),
                r.listen.to_string(),
                r.coordinator.to_string(),
                r.workers.to_string(),
                format!("{}-{}", r.clients.first, r.clients.last),
                left,
                right,
            ]);
        }
        let mut out = format!(
            "instance {}: backend {}, {} rank(s) on {} node(s), {} clients\n",
            self.instance,
            self.backend,
            self.world_size,
            self.nodes.len(),
            self.num_clients
        );
        out.push_str(&align(&rows));
        for node in &self.nodes {
            out.push_str(&format!(
                "node {} ({}): {} rank(s), needs {} of {}\n",
                node.id,
                node.host,
                node.ranks,
                format_bytes(node.memory_needed),
                format_bytes(node.memory)
            ));
        }
        out
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.table())
    }
}

/// Rows as left-aligned columns two spaces apart.
fn align(rows: &[Vec<String>]) -> String {
    let columns = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .map(|row| row[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, &width)| format!("{cell:width$}"))
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// `text` as one shell word: as is when it has no special characters, else in
/// single quotes.
fn shell_word(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:=,@+%".contains(&b));
    if plain {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}
