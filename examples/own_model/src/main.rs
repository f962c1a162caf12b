//! `own-model`: the `cohort` command line, with `mlp` and `blobs` as well.

fn main() -> std::process::ExitCode {
    cohort_cli::main_with(own_model::registry())
}
