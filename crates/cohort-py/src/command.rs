//! The wheel's `cohort` command: the `cohort` binary's command line (every
//! command, the same flags and messages) run in this process, so that
//! `pip install` gives both the library and the command from one build.

use pyo3::prelude::*;

/// Runs the `cohort` command line on `argv` (the program first, as
/// `sys.argv`), without the GIL; the exit code. The program is the
/// console script's path, which network mode starts again for its local
/// client processes.
#[pyfunction]
pub(crate) fn command_line(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(|| cohort_cli::command_line(cohort_cli::Registry::builtin(), argv))
}
