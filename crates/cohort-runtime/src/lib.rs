//! The federated runtime of cohort: the round loop ([`server`]), the
//! transports that reach clients ([`transport`]: worker threads in [`pool`],
//! client processes over gRPC in [`grpc`]), the client side of a task
//! ([`client`]) and the `cohort client` process ([`worker_process`]).
//!
//! Payloads go through the configured processors in simulation as on a
//! network, so byte counts and processing costs are real.

pub mod admission;
pub mod backends;
pub mod client;
pub mod collective;
pub mod distributed;
pub mod grpc;
pub mod pool;
mod progress;
pub mod server;
pub mod transport;
pub mod worker_process;

pub use backends::available_backends;
pub use server::{
    DistributedRun, LocalClients, MODEL_FILE, RankLink, RunOptions, RunSummary, new_run_dir, run,
    run_with_hooks, run_with_strategy,
};
pub use worker_process::{OwnDataOptions, WorkerOptions, WorkerSummary, run_worker};
