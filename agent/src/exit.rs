//! The agent's exit codes: the one place they are defined, so the contract
//! table, `--help` and `docs/protocol.md` can all be checked against it.

use std::fmt;

/// How the agent ended. The numbers are part of the contract (except
/// [`Exit::PrepareFailed`] and [`Exit::Internal`], which it leaves open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The run finished and was reported, or the standby was retired or
    /// cancelled, or it was stopped by SIGTERM while waiting.
    Success,
    /// An unexpected internal error (a bug or a broken host).
    Internal,
    /// Bad configuration or usage.
    Usage,
    /// `410` on the standby credential.
    Unavailable,
    /// `401`/`403` on the standby credential.
    Unauthorized,
    /// The standby deadline passed with no assignment.
    DeadlinePassed,
    /// The install failed before the run started (and was reported).
    InstallFailed,
    /// The run credential was refused: the assignment was withdrawn.
    Withdrawn,
    /// Preparation (clone, setup step, MCP server, idle shell) failed while
    /// no assignment was held, so there was nothing to report it to.
    PrepareFailed,
}

impl Exit {
    pub fn code(self) -> u8 {
        match self {
            Self::Success => 0,
            Self::Internal => 1,
            Self::Usage => 2,
            Self::Unavailable => 10,
            Self::Unauthorized => 11,
            Self::DeadlinePassed => 12,
            Self::InstallFailed => 13,
            Self::Withdrawn => 14,
            Self::PrepareFailed => 15,
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self {
            Self::Success => "finished",
            Self::Internal => "internal error",
            Self::Usage => "bad configuration or usage",
            Self::Unavailable => "standby credential unavailable (410)",
            Self::Unauthorized => "standby credential unauthorized (401/403)",
            Self::DeadlinePassed => "standby deadline passed with no assignment",
            Self::InstallFailed => "install failed before the run started",
            Self::Withdrawn => "assignment withdrawn (run credential refused)",
            Self::PrepareFailed => "workspace preparation failed",
        };
        write!(f, "{what} (exit {})", self.code())
    }
}

impl From<Exit> for std::process::ExitCode {
    fn from(exit: Exit) -> Self {
        std::process::ExitCode::from(exit.code())
    }
}

/// Shown at the end of `standby --help`.
pub const HELP: &str = "\
Exit codes:
  0   the run finished and was reported; or retired, cancelled, or SIGTERM while waiting
  1   internal error
  2   bad configuration or usage
  10  unavailable: the server answered 410 to the standby credential (not retried)
  11  unauthorized: the server answered 401/403 to the standby credential
  12  the standby deadline passed with no assignment
  13  the install failed before the run started (reported as install_failed)
  14  the assignment was withdrawn: the run credential was refused
  15  workspace preparation failed (clone, setup step, MCP server or shell) with no assignment held";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_lists_every_code() {
        for exit in [
            Exit::Success,
            Exit::Internal,
            Exit::Usage,
            Exit::Unavailable,
            Exit::Unauthorized,
            Exit::DeadlinePassed,
            Exit::InstallFailed,
            Exit::Withdrawn,
            Exit::PrepareFailed,
        ] {
            assert!(HELP.contains(&format!("\n  {:<3} ", exit.code())), "{exit} missing from HELP");
        }
    }
}
