//! Which rank this process is, as the engine that started it says: Open MPI's
//! `mpirun`, Slurm's `srun`, any PMI launcher (MPICH, Hydra), or a Kubernetes
//! Indexed Job (the index, with the size from `COHORT_WORLD_SIZE`). Pure: the
//! environment comes in as a function, so every launcher is tested without
//! setting variables.

/// A rank and the number of ranks, with the variables they came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LauncherRank {
    pub rank: u32,
    pub world_size: u32,
    /// The launcher, named by its variables (`OMPI_COMM_WORLD_RANK/SIZE`).
    pub source: &'static str,
}

/// Rank and size variables per launcher, in the order they are trusted: a
/// Slurm job step started by `mpirun` has both, and MPI's are the ranks of
/// the job.
const LAUNCHERS: [(&str, &str, &str); 4] = [
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK/SIZE (mpirun)",
    ),
    ("PMI_RANK", "PMI_SIZE", "PMI_RANK/SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_PROCID/NTASKS (srun)"),
    (
        "JOB_COMPLETION_INDEX",
        "COHORT_WORLD_SIZE",
        "JOB_COMPLETION_INDEX/COHORT_WORLD_SIZE (Kubernetes Indexed Job)",
    ),
];

/// The rank this process was started as, or `None` when no launcher set one
/// (a plain process: one rank). A launcher's variables that are present but
/// not numbers, or a rank not below the size, are an error naming them.
pub fn launcher_rank(env: impl Fn(&str) -> Option<String>) -> Result<Option<LauncherRank>, String> {
    for (rank_key, size_key, source) in LAUNCHERS {
        let Some(rank_text) = env(rank_key) else {
            continue;
        };
        let number = |key: &str, text: &str| {
            text.trim()
                .parse::<u32>()
                .map_err(|_| format!("{key} = `{text}` is not a rank number ({source})"))
        };
        let rank = number(rank_key, &rank_text)?;
        let size_text = env(size_key).ok_or_else(|| {
            format!("{rank_key} is set but {size_key} is not; set both ({source})")
        })?;
        let world_size = number(size_key, &size_text)?;
        if world_size == 0 || rank >= world_size {
            return Err(format!(
                "{rank_key} = {rank} is not a rank of {size_key} = {world_size} ({source})"
            ));
        }
        return Ok(Some(LauncherRank {
            rank,
            world_size,
            source,
        }));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |key| pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    #[test]
    fn each_launcher_is_read() {
        let cases = [
            (
                vec![("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "3")],
                (2, 3),
            ),
            (vec![("PMI_RANK", "0"), ("PMI_SIZE", "4")], (0, 4)),
            (vec![("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8")], (5, 8)),
            (
                vec![("JOB_COMPLETION_INDEX", "1"), ("COHORT_WORLD_SIZE", "2")],
                (1, 2),
            ),
        ];
        for (vars, (rank, size)) in cases {
            let found = launcher_rank(env(&vars)).unwrap().unwrap();
            assert_eq!((found.rank, found.world_size), (rank, size), "{vars:?}");
        }
        assert_eq!(launcher_rank(env(&[])).unwrap(), None);
    }

    #[test]
    fn mpi_ranks_win_over_slurms_inside_a_slurm_job() {
        let found = launcher_rank(env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((found.rank, found.world_size), (1, 2));
        assert!(found.source.contains("mpirun"));
    }

    #[test]
    fn bad_values_name_the_variable() {
        let error =
            launcher_rank(env(&[("SLURM_PROCID", "x"), ("SLURM_NTASKS", "2")])).unwrap_err();
        assert!(error.contains("SLURM_PROCID = `x`"), "{error}");
        let error = launcher_rank(env(&[("JOB_COMPLETION_INDEX", "0")])).unwrap_err();
        assert!(error.contains("COHORT_WORLD_SIZE is not"), "{error}");
        let error = launcher_rank(env(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")])).unwrap_err();
        assert!(
            error.contains("PMI_RANK = 4 is not a rank of PMI_SIZE = 4"),
            "{error}"
        );
    }
}
