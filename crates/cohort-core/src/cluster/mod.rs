//! The cluster layer: which machines a run uses, and how its ranks meet.
//!
//! A cluster file (TOML, [`ClusterSpec`]) lists nodes with their memory,
//! cores, GPUs and network interfaces, and typed links between interfaces
//! (socket or RDMA, with a bandwidth). [`load`] reads it with a size bound and
//! [`Topology::new`] validates it; every error names the file, the key, the
//! bad value and what was expected.

mod backend;
mod file;
mod size;
mod topology;

pub use backend::{Backend, BackendError, built_backends, check_backend};
pub use file::{
    ClusterError, ClusterSpec, InterfaceSpec, LinkEnd, LinkSpec, MAX_CLUSTER_BYTES, NodeSpec, load,
    parse,
};
pub use size::format_bytes;
pub use topology::{
    Endpoint, Interface, InterfaceKind, Link, LinkKind, MAX_NODES, Node, Topology, TopologyError,
};
