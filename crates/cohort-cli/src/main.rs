//! The `cohort` binary: the command line over cohort's built-in models.

fn main() -> std::process::ExitCode {
    cohort_cli::main_with(cohort_cli::Registry::builtin())
}
