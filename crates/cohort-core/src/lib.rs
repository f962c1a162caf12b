//! The backend-free core of cohort.
//!
//! Everything here is plain Rust on host memory, with no tensor library: the
//! configuration, parameter trees, aggregation, the payload codec, data files,
//! partitioning, client selection and result files. Decisions are pure
//! functions; the few side effects (reading data, writing files) sit at the
//! edges in [`data`] and [`results`].
//!
//! Where to look:
//! * FedAvg: [`aggregate::fedavg`]
//! * parameter trees: [`tree::ParamTree`]; their tensor layout (PyTorch's): [`layout`]
//! * config schema and loader: [`config`]
//! * safetensors payloads: [`codec`]
//! * iid partitions: [`partition`]; client selection: [`selection`]
//! * cluster files and placement of ranks on nodes: [`cluster::place`]
//! * secure aggregation (SecAgg+), simulated in process: [`secagg::simulate_round`]

pub mod aggregate;
pub mod attack;
pub mod checkpoint;
pub mod clock;
pub mod cluster;
pub mod codec;
pub mod compare;
pub mod config;
pub mod data;
pub mod devices;
pub mod fsutil;
pub mod hooks;
pub mod layout;
pub mod number;
pub mod optim;
pub mod partition;
pub mod processors;
pub mod results;
pub mod schedule;
pub mod secagg;
pub mod seeds;
pub mod selection;
pub mod strategy;
pub mod suggest;
pub mod tree;
pub mod vector_log;
