//! Why a command failed, and the exit code each kind maps to (see the exit codes in `main.rs`).

use std::process::ExitCode;

/// Why a command failed, with the exit code it maps to.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The router refused the action or a check failed (exit 1).
    Refused(String),
    /// The command line is wrong, e.g. `--router` names the data listener (exit 2).
    Usage(String),
    /// The router could not be reached or does not control the fleet (exit 3).
    Unavailable(String),
    /// Standard output was closed by its reader (exit 141, nothing printed).
    PipeClosed,
}

impl Failure {
    pub(crate) fn exit(&self) -> ExitCode {
        match self {
            Failure::Refused(_) => ExitCode::from(1),
            Failure::Usage(_) => ExitCode::from(2),
            Failure::Unavailable(_) => ExitCode::from(3),
            Failure::PipeClosed => ExitCode::from(141),
        }
    }
    pub(crate) fn message(&self) -> &str {
        match self {
            Failure::Refused(m) | Failure::Usage(m) | Failure::Unavailable(m) => m,
            Failure::PipeClosed => "standard output closed",
        }
    }
}
