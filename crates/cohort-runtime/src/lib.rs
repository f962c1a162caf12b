//! The federated runtime of cohort: the round loop ([`server`]) and the pool of
//! physical workers that train logical clients ([`pool`]).
//!
//! Payloads go through the same safetensors codec in simulation as on a
//! network, so byte counts and encode/decode costs are real.

pub mod pool;
pub mod server;

pub use server::{MODEL_FILE, RunOptions, RunSummary, new_run_dir, run, run_with_hooks};
