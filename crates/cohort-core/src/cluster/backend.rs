//! Collective backends, and which of them a build has.
//!
//! exo learnt on real hardware that a backend name the installed library did
//! not know ("the only valid values are any, mpi and ring but jaccl was
//! provided") fails only once the run starts. Here a name is parsed with the
//! valid ones and a did-you-mean in its error, and [`check_backend`] holds it
//! against the list of backends of *this build*, which the caller passes
//! (cohort-core has no cargo features; the runtime knows its own), so a
//! missing one fails before anything starts and says what would enable it.
//!
//! `rdma` is not a separate library as exo's `jaccl` is: cohort reaches RDMA
//! through Open MPI, whose UCX and verbs transports drive InfiniBand and RoCE
//! devices. So `rdma` is the `mpi` backend with a demand on the cluster: an
//! RDMA link between every pair of chosen nodes. A build has it exactly when
//! it has `mpi`.

use serde::{Deserialize, Serialize};

use crate::config::introspect;
use crate::suggest::did_you_mean;

/// How ranks exchange their partial aggregates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// The star through rank 0's gRPC server: today's deployment mode.
    Grpc,
    /// cohort's own TCP ring all-reduce, started from the plan's host files.
    Ring,
    /// Open MPI, launched by mpirun or srun (cargo feature `mpi`).
    Mpi,
    /// Open MPI over RDMA devices: `mpi` plus an all-to-all RDMA mesh.
    Rdma,
}

impl Backend {
    /// The name in configs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Grpc => "grpc",
            Backend::Ring => "ring",
            Backend::Mpi => "mpi",
            Backend::Rdma => "rdma",
        }
    }

    /// Reads a backend name, with the valid ones and what the name would need
    /// in the error.
    pub fn parse(name: &str) -> Result<Backend, BackendError> {
        if let Ok(backend) = introspect::parse_unit_variant::<Backend>(name) {
            return Ok(backend);
        }
        let names = introspect::unit_variants_of::<Backend>();
        let hint = match name.to_ascii_lowercase().as_str() {
            // cohort-train's `cuda` feature trains on a GPU, but partials are
            // reduced in host memory, where NCCL does not work.
            "nccl" => "; NCCL is NVIDIA's collective library for GPU buffers, and cohort \
                       reduces partial aggregates in host memory (even a `--features cuda` \
                       build); use `mpi` (Open MPI) or `ring`"
                .to_owned(),
            "jaccl" | "ibv" => "; that is MLX's RDMA backend; cohort reaches RDMA through Open \
                                MPI: use `rdma` (a build with `--features mpi`)"
                .to_owned(),
            "gloo" => "; that is PyTorch's; for TCP use `ring`, for MPI `mpi`".to_owned(),
            _ => did_you_mean(name, names.iter().copied()),
        };
        Err(BackendError::Unknown {
            name: name.to_owned(),
            hint,
            valid: names.join(", "),
        })
    }

    /// What makes this backend part of a build.
    fn how_to_enable(self) -> &'static str {
        match self {
            Backend::Grpc | Backend::Ring => {
                "every build of cohort has it; this caller left it out"
            }
            Backend::Mpi => {
                "rebuild with `--features mpi` (needs Open MPI: libopenmpi-dev, and \
                 libclang-dev for bindgen)"
            }
            Backend::Rdma => {
                "cohort reaches RDMA through Open MPI: rebuild with `--features mpi` \
                 (needs libopenmpi-dev and libclang-dev)"
            }
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Backend {
    type Err = BackendError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Backend::parse(name)
    }
}

/// A backend that cannot be used, said before anything starts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// A name that is no backend of cohort's.
    #[error("unknown backend `{name}`{hint}; the backends are: {valid}")]
    Unknown {
        /// The name given.
        name: String,
        /// A did-you-mean, or what the foreign name is and what to use instead.
        hint: String,
        /// The valid names, comma-separated.
        valid: String,
    },
    /// A backend of cohort's that this build does not have.
    #[error(
        "backend `{asked}` is not in this build; the backends this build has are {available}; {enable}"
    )]
    NotBuilt {
        /// The backend asked for.
        asked: Backend,
        /// This build's backends, as prose ("grpc and ring").
        available: String,
        /// What would enable `asked`.
        enable: String,
    },
}

/// The backends a build has, from the list its runtime gives: `rdma` comes
/// with `mpi`.
pub fn built_backends(available: &[Backend]) -> Vec<Backend> {
    let mut built = available.to_vec();
    if built.contains(&Backend::Mpi) {
        built.push(Backend::Rdma);
    }
    built.sort_unstable();
    built.dedup();
    built
}

/// Fails unless this build, whose backends are `available`, has `asked`.
pub fn check_backend(asked: Backend, available: &[Backend]) -> Result<(), BackendError> {
    let built = built_backends(available);
    if built.contains(&asked) {
        return Ok(());
    }
    let names: Vec<&str> = built.iter().map(|b| b.name()).collect();
    let available = match names.as_slice() {
        [] => "none".to_owned(),
        [one] => (*one).to_owned(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    };
    Err(BackendError::NotBuilt {
        asked,
        available,
        enable: asked.how_to_enable().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_serde_and_parse() {
        for backend in [Backend::Grpc, Backend::Ring, Backend::Mpi, Backend::Rdma] {
            assert_eq!(Backend::parse(backend.name()), Ok(backend));
            assert_eq!(introspect::unit_variant_name(&backend), backend.name());
        }
    }

    #[test]
    fn an_unavailable_backend_names_the_valid_ones_and_the_feature() {
        let error = check_backend(Backend::Mpi, &[Backend::Grpc, Backend::Ring]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "backend `mpi` is not in this build; the backends this build has are grpc and ring; \
             rebuild with `--features mpi` (needs Open MPI: libopenmpi-dev, and libclang-dev for \
             bindgen)"
        );
        let error = check_backend(Backend::Rdma, &[Backend::Grpc, Backend::Ring]).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("cohort reaches RDMA through Open MPI"),
            "{error}"
        );
        assert!(check_backend(Backend::Rdma, &[Backend::Mpi]).is_ok());
        assert!(check_backend(Backend::Ring, &[Backend::Grpc, Backend::Ring]).is_ok());
    }

    #[test]
    fn unknown_names_get_a_did_you_mean_or_what_they_would_need() {
        let error = Backend::parse("rign").unwrap_err().to_string();
        assert_eq!(
            error,
            "unknown backend `rign` (did you mean `ring`?); the backends are: grpc, ring, mpi, rdma"
        );
        let error = Backend::parse("nccl").unwrap_err().to_string();
        assert!(
            error.contains("NCCL is NVIDIA's collective library"),
            "{error}"
        );
        let error = Backend::parse("jaccl").unwrap_err().to_string();
        assert!(error.contains("use `rdma`"), "{error}");
        assert!(
            error.ends_with("the backends are: grpc, ring, mpi, rdma"),
            "{error}"
        );
    }
}
