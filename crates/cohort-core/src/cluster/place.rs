//! `place()`: which nodes a run uses, and what each rank does there.
//!
//! Pure: a topology and a request in, a plan or an error out; no I/O, no
//! clock, no randomness. The rules are exo's, for federated workers instead
//! of model layers:
//!
//! 1. **Candidates.** Every set of nodes with at least `min_nodes` nodes (and,
//!    for a fixed rank count, at most that many) is a candidate.
//! 2. **Memory.** On a candidate, ranks are split across its nodes in
//!    proportion to their cores (training is compute-bound; memory is a
//!    limit, not a speed), largest remainder, at least one each. A node's
//!    cores are split across its ranks as workers unless the request fixes
//!    workers per rank, and clients across ranks in proportion to workers.
//!    The candidate fits when every node holds what its ranks need.
//! 3. **Links.** Every pair of nodes of a candidate must share a socket link
//!    (the coordinator and the ring need TCP between them); the `rdma` backend
//!    also needs an RDMA link between every pair (an all-to-all device
//!    matrix), and refuses a partial mesh.
//! 4. **Choice.** The smallest fitting, linked candidate wins; among equals,
//!    the one with more memory left free, then the one of leaf nodes (fewer
//!    links, leaving the hubs to others), then the first by node id.
//!
//! What it cannot know: the memory need is an estimate the caller passes
//! ([`MemoryNeed::estimate`]), and links are as the cluster file says; a
//! link that is down is found when the run starts, not here.

use std::collections::BTreeSet;

use super::backend::{Backend, BackendError, check_backend};
use super::plan::{self, Plan};
use super::ports::{self, PORT_SPAN};
use super::size::format_bytes;
use super::split::{ClientBlock, client_blocks, split_proportional};
use super::topology::{LinkKind, Topology};

/// How many ranks a run asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankCount {
    /// One rank on each node of the smallest set that fits.
    Fewest,
    /// Exactly this many ranks, on the smallest set of nodes that holds them
    /// (several ranks may share a node).
    Exactly(u32),
}

/// Bytes a run needs, in three parts, so that the need of a rank follows from
/// how many workers and clients it gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryNeed {
    /// Each rank, whatever it trains: the global model and the partial sums.
    pub per_rank: u64,
    /// Each worker of a rank: one model being trained with its gradients and
    /// optimizer state.
    pub per_worker: u64,
    /// Each logical client a rank trains: its training data, kept in memory
    /// across rounds.
    pub per_client: u64,
}

/// What a rank needs besides the model: the process, its thread pools, the
/// test set (MNIST's is 8 MB) and room to spare.
const RANK_OVERHEAD: u64 = 256 << 20;
/// What a worker needs besides the model: activations of a batch and buffers.
const WORKER_OVERHEAD: u64 = 64 << 20;

impl MemoryNeed {
    /// A rough need for a model of `parameters` parameters of
    /// `bytes_per_parameter` bytes each (4 for f32) and `data_bytes_per_client`
    /// bytes of training data per client (samples × bytes per sample).
    pub fn estimate(parameters: u64, bytes_per_parameter: u64, data_bytes_per_client: u64) -> Self {
        let model = parameters.saturating_mul(bytes_per_parameter);
        Self {
            // The global model, the next one being built, and the partial
            // weighted sum, which is kept in f64: 2 models' worth.
            per_rank: RANK_OVERHEAD.saturating_add(model.saturating_mul(4)),
            // Weights, gradients and two optimizer moments (Adam's): 4 models.
            per_worker: WORKER_OVERHEAD.saturating_add(model.saturating_mul(4)),
            per_client: data_bytes_per_client,
        }
    }

    /// Bytes one rank with `workers` workers and `clients` clients needs.
    pub fn of_rank(&self, workers: u32, clients: u32) -> u64 {
        self.per_rank
            .saturating_add(self.per_worker.saturating_mul(u64::from(workers)))
            .saturating_add(self.per_client.saturating_mul(u64::from(clients)))
    }
}

/// What a run needs from the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Names the instance (a run id): ports, host files and launch lines are
    /// keyed by it. 1 to 64 letters, digits, `-`, `_` or `.`, not starting
    /// with `.` or `-`.
    pub instance: String,
    /// The collective backend. Default: `grpc`.
    pub backend: Backend,
    /// The backends this build has (the runtime knows; core has no features).
    /// Default: `grpc` and `ring`.
    pub available_backends: Vec<Backend>,
    /// How many ranks. Default: [`RankCount::Fewest`].
    pub ranks: RankCount,
    /// Fewest nodes to spread over, to force one rank per machine even when
    /// one machine could hold them all. Default: 1.
    pub min_nodes: u32,
    /// Workers (parallel client trainings) per rank; `None` splits each node's
    /// cores among its ranks. Default: `None`.
    pub workers_per_rank: Option<u32>,
    /// Logical clients of the run (`clients.total_clients`), at least one per
    /// rank. Required.
    pub num_clients: u32,
    /// Memory the run needs. Required.
    pub memory: MemoryNeed,
    /// Bottom of the port range `base_port..base_port + PORT_SPAN`.
    /// Default: [`ports::DEFAULT_BASE_PORT`].
    pub base_port: u16,
    /// Ports already taken on these nodes, such as another plan's
    /// ([`Plan::ports`]). Default: none.
    pub ports_in_use: BTreeSet<u16>,
}

impl Request {
    /// A request with the defaults above.
    pub fn new(instance: impl Into<String>, num_clients: u32, memory: MemoryNeed) -> Self {
        Self {
            instance: instance.into(),
            backend: Backend::Grpc,
            available_backends: vec![Backend::Grpc, Backend::Ring],
            ranks: RankCount::Fewest,
            min_nodes: 1,
            workers_per_rank: None,
            num_clients,
            memory,
            base_port: ports::DEFAULT_BASE_PORT,
            ports_in_use: BTreeSet::new(),
        }
    }
}

/// Why no set of nodes fits in memory: the set that came closest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryShortfall {
    /// The nodes of the closest set.
    pub nodes: Vec<String>,
    /// Ranks it would have run.
    pub ranks: u32,
    /// Bytes its ranks need in all.
    pub needed: u64,
    /// Bytes its nodes have in all.
    pub has: u64,
    /// The node short by the most.
    pub node: String,
    /// Ranks on that node.
    pub node_ranks: u32,
    /// Bytes that node's ranks need.
    pub node_needed: u64,
    /// Bytes that node has.
    pub node_has: u64,
    /// The need the request gave.
    pub need: MemoryNeed,
}

impl std::fmt::Display for MemoryShortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "not enough memory: the best set of nodes ({}) has {} and its {} rank(s) need {}; \
             node `{}` would need {} for {} rank(s) and has {} \
             (a rank needs {}, plus {} a worker and {} a client)",
            self.nodes.join(", "),
            format_bytes(self.has),
            self.ranks,
            format_bytes(self.needed),
            self.node,
            format_bytes(self.node_needed),
            self.node_ranks,
            format_bytes(self.node_has),
            format_bytes(self.need.per_rank),
            format_bytes(self.need.per_worker),
            format_bytes(self.need.per_client),
        )
    }
}

/// Why a run cannot be placed; each names what is missing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The backend is unknown to this build.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The request itself cannot be met by any cluster.
    #[error("invalid placement request: {0}")]
    Request(String),
    /// No set of nodes has the memory.
    #[error("{0}")]
    NotEnoughMemory(MemoryShortfall),
    /// The sets with the memory have two nodes without a socket link.
    #[error(
        "nodes `{a}` and `{b}` are both needed but no socket link joins them; add a [[links]] \
         entry between an interface of each"
    )]
    NoLink {
        /// One node of the pair.
        a: String,
        /// The other.
        b: String,
    },
    /// `rdma` was asked and the sets with the memory have a pair of nodes
    /// without an RDMA link.
    #[error(
        "backend `rdma` needs an RDMA link between every pair of chosen nodes, but `{a}` and \
         `{b}` have none (the RDMA links form a partial mesh); add an rdma link between them, \
         or use `mpi` over sockets"
    )]
    PartialRdmaMesh {
        /// One node of the pair.
        a: String,
        /// The other.
        b: String,
    },
    /// More ranks than clients.
    #[error("{clients} logical clients cannot fill {ranks} ranks; each rank trains at least one")]
    TooFewClients {
        /// `num_clients` of the request.
        clients: u32,
        /// Ranks asked for.
        ranks: u32,
    },
    /// The port range is full.
    #[error(
        "no {wanted} free ports in {base}..{end} for instance `{instance}`; choose another base port"
    )]
    NoFreePorts {
        /// The instance.
        instance: String,
        /// `base_port`.
        base: u16,
        /// End of the range (exclusive).
        end: u32,
        /// Ports needed: one per rank.
        wanted: usize,
    },
}

/// Places a run on a cluster: the nodes, ranks, workers, clients, addresses
/// and ports, or what is missing.
pub fn place(topology: &Topology, request: &Request) -> Result<Plan, PlacementError> {
    check_request(topology, request)?;
    let layout = choose(topology, request)?;
    let ports = ports::choose_ports(
        &request.instance,
        request.base_port,
        layout.rank_node.len(),
        &request.ports_in_use,
    )
    .ok_or_else(|| PlacementError::NoFreePorts {
        instance: request.instance.clone(),
        base: request.base_port,
        end: u32::from(request.base_port) + u32::from(PORT_SPAN),
        wanted: layout.rank_node.len(),
    })?;
    Ok(plan::build(topology, request, &layout, &ports))
}

fn check_request(topology: &Topology, request: &Request) -> Result<(), PlacementError> {
    check_backend(request.backend, &request.available_backends)?;
    let bad = |message: String| Err(PlacementError::Request(message));
    if !plan::is_instance_name(&request.instance) {
        return bad(format!(
            "instance `{}`: expected 1 to 64 letters, digits, `-`, `_` or `.`, not starting \
             with `.` or `-` (it names files)",
            request.instance
        ));
    }
    if request.num_clients == 0 {
        return bad("num_clients is 0; a run trains at least one client".to_owned());
    }
    if request.workers_per_rank == Some(0) {
        return bad("workers_per_rank is 0; a rank needs at least one worker".to_owned());
    }
    if u32::from(request.base_port) + u32::from(PORT_SPAN) > 65_536 || request.base_port == 0 {
        return bad(format!(
            "base_port {}: the range base_port..base_port + {PORT_SPAN} must lie in 1..=65535",
            request.base_port
        ));
    }
    let nodes = topology.nodes().len() as u32;
    if request.min_nodes > request.num_clients {
        return Err(PlacementError::TooFewClients {
            clients: request.num_clients,
            ranks: request.min_nodes,
        });
    }
    if request.min_nodes > nodes {
        return bad(format!(
            "min_nodes is {} but the cluster has {nodes} node(s)",
            request.min_nodes
        ));
    }
    match request.ranks {
        RankCount::Exactly(0) => bad("0 ranks; a run needs at least one".to_owned()),
        RankCount::Exactly(ranks) if ranks > request.num_clients => {
            Err(PlacementError::TooFewClients {
                clients: request.num_clients,
                ranks,
            })
        }
        RankCount::Exactly(ranks) if request.min_nodes > ranks => bad(format!(
            "min_nodes is {} but only {ranks} rank(s) were asked for; a node runs at least one",
            request.min_nodes
        )),
        _ => Ok(()),
    }
}

/// Where every rank runs and what it does, before addresses and ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Chosen nodes, indices into the topology, in file order.
    pub nodes: Vec<usize>,
    /// The node of each rank; a node's ranks are consecutive.
    pub rank_node: Vec<usize>,
    /// Workers of each rank.
    pub workers: Vec<u32>,
    /// Clients of each rank.
    pub blocks: Vec<ClientBlock>,
    /// Bytes each rank needs.
    pub rank_memory: Vec<u64>,
    /// Bytes each chosen node needs, in the order of `nodes`.
    pub node_memory: Vec<u64>,
}

fn lay_out(topology: &Topology, request: &Request, set: &[usize], ranks: u32) -> Layout {
    let cores: Vec<u64> = set
        .iter()
        .map(|&n| u64::from(topology.nodes()[n].cores))
        .collect();
    let per_node = split_proportional(ranks, &cores);
    let (mut rank_node, mut workers) = (Vec::new(), Vec::new());
    for (&node, &count) in set.iter().zip(&per_node) {
        let cores = topology.nodes()[node].cores;
        let shares = match request.workers_per_rank {
            Some(fixed) => vec![fixed; count as usize],
            None if cores >= count => split_proportional(cores, &vec![1; count as usize]),
            // More ranks than cores: each still trains, one client at a time.
            None => vec![1; count as usize],
        };
        rank_node.extend(std::iter::repeat_n(node, count as usize));
        workers.extend(shares);
    }
    let capacity: Vec<u64> = workers.iter().map(|&w| u64::from(w)).collect();
    let blocks = client_blocks(request.num_clients, &capacity);
    let rank_memory: Vec<u64> = workers
        .iter()
        .zip(&blocks)
        .map(|(&w, block)| request.memory.of_rank(w, block.len()))
        .collect();
    let node_memory = set
        .iter()
        .map(|&node| {
            let on_node = rank_node
                .iter()
                .zip(&rank_memory)
                .filter(|(n, _)| **n == node);
            on_node.fold(0u64, |sum, (_, &m)| sum.saturating_add(m))
        })
        .collect();
    Layout {
        nodes: set.to_vec(),
        rank_node,
        workers,
        blocks,
        rank_memory,
        node_memory,
    }
}

/// Memory of the layout's nodes and what they need, in all.
fn totals(topology: &Topology, layout: &Layout) -> (u64, u64) {
    let has = layout.nodes.iter().fold(0u64, |sum, &n| {
        sum.saturating_add(topology.nodes()[n].memory)
    });
    let needed = layout
        .node_memory
        .iter()
        .fold(0u64, |sum, &m| sum.saturating_add(m));
    (has, needed)
}

/// `None` when every node of the layout holds its ranks.
fn shortfall(topology: &Topology, request: &Request, layout: &Layout) -> Option<MemoryShortfall> {
    let nodes = topology.nodes();
    let (index, deficit) = layout
        .nodes
        .iter()
        .zip(&layout.node_memory)
        .enumerate()
        .map(|(i, (&n, &need))| (i, need.saturating_sub(nodes[n].memory)))
        .max_by_key(|&(i, deficit)| (deficit, std::cmp::Reverse(i)))?;
    if deficit == 0 {
        return None;
    }
    let node = layout.nodes[index];
    let ranks = layout.rank_node.iter().filter(|&&n| n == node).count() as u32;
    let (has, needed) = totals(topology, layout);
    Some(MemoryShortfall {
        nodes: layout.nodes.iter().map(|&n| nodes[n].id.clone()).collect(),
        ranks: layout.rank_node.len() as u32,
        needed,
        has,
        node: nodes[node].id.clone(),
        node_ranks: ranks,
        node_needed: layout.node_memory[index],
        node_has: nodes[node].memory,
        need: request.memory,
    })
}

/// The first pair of the set without the links the backend needs.
fn link_problem(topology: &Topology, set: &[usize], backend: Backend) -> Option<PlacementError> {
    let id = |n: usize| topology.nodes()[n].id.clone();
    let pairs = || {
        set.iter()
            .enumerate()
            .flat_map(move |(i, &a)| set[i + 1..].iter().map(move |&b| (a, b)))
    };
    if let Some((a, b)) = pairs().find(|&(a, b)| topology.route(LinkKind::Socket, a, b).is_none()) {
        return Some(PlacementError::NoLink { a: id(a), b: id(b) });
    }
    if backend == Backend::Rdma
        && let Some((a, b)) = pairs().find(|&(a, b)| topology.route(LinkKind::Rdma, a, b).is_none())
    {
        return Some(PlacementError::PartialRdmaMesh { a: id(a), b: id(b) });
    }
    None
}

/// Orders fitting sets of one size: more memory left free, then fewer links
/// (leaf nodes), then node ids.
fn preference(
    topology: &Topology,
    layout: &Layout,
) -> (std::cmp::Reverse<u64>, usize, Vec<String>) {
    let (has, needed) = totals(topology, layout);
    let links = layout.nodes.iter().map(|&n| topology.degree(n)).sum();
    let mut ids: Vec<String> = layout
        .nodes
        .iter()
        .map(|&n| topology.nodes()[n].id.clone())
        .collect();
    ids.sort();
    (std::cmp::Reverse(has.saturating_sub(needed)), links, ids)
}

/// The node counts to try, smallest first.
fn sizes(topology: &Topology, request: &Request) -> std::ops::RangeInclusive<usize> {
    let nodes = topology.nodes().len();
    let most = match request.ranks {
        RankCount::Fewest => nodes.min(request.num_clients as usize),
        RankCount::Exactly(ranks) => nodes.min(ranks as usize),
    };
    (request.min_nodes.max(1) as usize)..=most
}

/// The subsets of `0..n` with `size` members, each in ascending order.
fn subsets(n: usize, size: usize) -> impl Iterator<Item = Vec<usize>> {
    (0u32..1 << n)
        .filter(move |mask| mask.count_ones() as usize == size)
        .map(move |mask| (0..n).filter(|i| mask & (1 << i) != 0).collect())
}

fn choose(topology: &Topology, request: &Request) -> Result<Layout, PlacementError> {
    let mut closest: Option<MemoryShortfall> = None;
    let mut unlinked: Option<PlacementError> = None;
    for size in sizes(topology, request) {
        let ranks = match request.ranks {
            RankCount::Fewest => size as u32,
            RankCount::Exactly(ranks) => ranks,
        };
        let mut best: Option<(_, Layout)> = None;
        let mut best_unlinked: Option<(_, PlacementError)> = None;
        for set in subsets(topology.nodes().len(), size) {
            let layout = lay_out(topology, request, &set, ranks);
            if let Some(short) = shortfall(topology, request, &layout) {
                let margin = |s: &MemoryShortfall| i128::from(s.has) - i128::from(s.needed);
                if closest.as_ref().is_none_or(|c| margin(&short) > margin(c)) {
                    closest = Some(short);
                }
                continue;
            }
            let key = preference(topology, &layout);
            if let Some(problem) = link_problem(topology, &set, request.backend) {
                if best_unlinked.as_ref().is_none_or(|(k, _)| key < *k) {
                    best_unlinked = Some((key, problem));
                }
            } else if best.as_ref().is_none_or(|(k, _)| key < *k) {
                best = Some((key, layout));
            }
        }
        if let Some((_, layout)) = best {
            return Ok(layout);
        }
        // The smallest sets with the memory say best what link is missing.
        unlinked = unlinked.or(best_unlinked.map(|(_, problem)| problem));
    }
    Err(unlinked
        .or(closest.map(PlacementError::NotEnoughMemory))
        .unwrap_or_else(|| {
            PlacementError::Request("no set of nodes to try; check min_nodes and ranks".to_owned())
        }))
}
