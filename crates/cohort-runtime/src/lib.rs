//! The federated runtime of cohort: a run assembled from its parts
//! ([`RunBuilder`], built in `assembly.rs`), the round loop over them
//! (`round_loop.rs`), the events it reports ([`events`]), the transports that
//! reach clients ([`transport`]: worker threads in [`pool`], client processes
//! over gRPC in [`grpc`], the caller's worker processes over pipes in
//! [`piped`]), the client side of a task ([`client`]) and the
//! `cohort client` process ([`worker_process`]).
//!
//! Payloads go through the configured processors in simulation as on a
//! network, so byte counts and processing costs are real.

pub mod admission;
mod assembly;
pub mod backends;
mod children;
pub mod client;
pub mod collective;
pub mod distributed;
pub mod events;
pub mod grpc;
pub mod piped;
pub mod pool;
mod ranks;
mod record;
mod round_loop;
mod run;
pub mod secure_client;
mod spill;
mod start;
pub mod transport;
mod transports;
mod updates;
pub mod worker_process;

pub use backends::available_backends;
pub use children::{CLIENT_LOGS, LocalClients};
pub use events::{RunEvent, RunFacts, RunObserver, Stopped};
pub use ranks::{DistributedRun, RankLink};
pub use record::{CheckpointState, MODEL_FILE, Recorder, RunFolder};
pub use run::{
    RunBuilder, RunOptions, RunSummary, new_run_dir, new_timestamped_run_dir, run, run_with_hooks,
    run_with_strategy,
};
pub use worker_process::{
    Declaration, MakeTrainer, OwnDataOptions, StopCheck, TaskTrainer, WorkerOptions, WorkerSummary,
    run_worker, run_worker_with,
};
