//! The cluster layer: which machines a run uses, and how its ranks meet.
//!
//! A cluster file (TOML, [`ClusterSpec`]) lists nodes with their memory,
//! cores, GPUs and network interfaces, and typed links between interfaces
//! (socket or RDMA, with a bandwidth). [`load`] reads it with a size bound and
//! [`Topology::new`] validates it; every error names the file, the key, the
//! bad value and what was expected.
//!
//! [`place`] is a pure function over a [`Topology`] and a [`Request`], tested
//! without I/O in exo's style. It returns a [`Plan`]: the chosen nodes, the
//! ranks with their workers and the contiguous block of logical clients each
//! trains (the same every round, so data stays put), the coordinator address
//! each rank reaches, ring neighbours per rank or the RDMA device matrix, and
//! ports that collide neither within the plan nor with the ports the caller
//! says are taken. From a plan come, still without I/O, a table, the per-rank
//! host files (name and contents, keyed by instance and rank, each with the
//! plan's [`RingSecret`]) and the command lines that start the ranks (plain,
//! mpirun, srun).
//!
//! Checked before any placement: the backend is one this build has (the
//! caller passes the list: core has no cargo features), the request can be
//! met at all (clients for every rank, a port range that fits). Then the
//! memory of every node, a socket link between every pair of chosen nodes,
//! and for `rdma` an RDMA link between every pair.
//!
//! What it cannot prove: memory needs are estimates ([`MemoryNeed`]), links
//! are what the file says, and ports free when planned may be taken by the
//! time the ranks bind them; the runtime reports those when they happen.

mod address;
mod backend;
mod file;
mod frame;
mod launcher;
mod place;
mod plan;
mod ports;
mod secret;
mod size;
mod split;
mod topology;

pub use address::{Host, HostPort};
pub use backend::{Backend, BackendError, built_backends, check_backend};
pub use file::{
    ClusterError, ClusterSpec, InterfaceSpec, LinkEnd, LinkSpec, MAX_CLUSTER_BYTES, NodeSpec, load,
    parse,
};
pub use frame::{
    FRAME_HEADER_BYTES, FRAME_MAGIC, FrameError, FrameExpectation, FrameHeader, decode_frame,
    encode_frame,
};
pub use launcher::{LauncherRank, launcher_rank};
pub use place::{MemoryNeed, MemoryShortfall, PlacementError, RankCount, Request, place};
pub use plan::{
    HostFile, HostFileError, Launch, LaunchSpec, Peer, PlacedNode, Plan, RankCommand, RankFile,
    RankPlan, RingPeers, host_file_name,
};
pub use ports::{DEFAULT_BASE_PORT, PORT_SPAN};
pub use secret::{RING_SECRET_BYTES, RingSecret};
pub use size::format_bytes;
pub(crate) use split::split_proportional;
pub use split::{ClientBlock, client_blocks, evaluation_slices};
pub use topology::{
    Endpoint, Interface, InterfaceKind, Link, LinkKind, MAX_NODES, Node, Topology, TopologyError,
};

#[cfg(test)]
mod tests;
