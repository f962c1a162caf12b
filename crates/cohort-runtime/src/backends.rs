//! The collective backends this build of the runtime has.
//!
//! cohort-core has no cargo features, so it cannot know what a build holds;
//! it takes this list ([`cohort_core::cluster::check_backend`]) and says what
//! is missing before anything starts, instead of failing once ranks run, as
//! exo's did on real hardware.

use cohort_core::cluster::Backend;

/// `grpc` and `ring` in every build; `mpi` and `rdma` (Open MPI over RDMA
/// devices) with the cargo feature `mpi`.
pub fn available_backends() -> Vec<Backend> {
    let mut backends = vec![Backend::Grpc, Backend::Ring];
    if cfg!(feature = "mpi") {
        backends.extend([Backend::Mpi, Backend::Rdma]);
    }
    backends
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_build_has_grpc_and_ring_and_mpi_comes_with_its_feature() {
        let backends = available_backends();
        assert!(backends.starts_with(&[Backend::Grpc, Backend::Ring]));
        assert_eq!(backends.contains(&Backend::Mpi), cfg!(feature = "mpi"));
        assert_eq!(backends.contains(&Backend::Rdma), cfg!(feature = "mpi"));
    }
}
