//! Models, local training and evaluation of cohort, on the burn tensor library.
//!
//! This crate owns everything that touches tensors: the model seam and the
//! models ([`model`]), the names a run can give them ([`registry`]),
//! moving parameters between modules and host trees ([`params`]), the
//! optimizers with MLX's rules ([`optim`]), the local trainer and the evaluator
//! ([`trainer`]), and the device choice ([`device`]). Aggregation and all other
//! decisions stay in `cohort-core`.

pub mod device;
pub mod init;
mod kernels;
/// The convolution's paths one pass at a time, for
/// `benches/conv_passes.rs` (not a stable interface).
#[doc(hidden)]
pub use kernels::conv_bench;
pub mod local;
pub mod memory;
pub mod model;
pub mod optim;
pub mod params;
pub mod registry;
pub mod switches;
pub mod task;
pub mod trainer;
pub mod vectorized;
