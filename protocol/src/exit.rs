//! The agent's exit codes: one table, from which the agent's `--help`, the
//! server's description of a sandbox that ended and `docs/contract.md`'s
//! table are all derived (a test checks the last against this one).

use std::fmt;

/// How an agent ended. The numbers are the contract's, except
/// [`ExitCode::Internal`], which it leaves open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExitCode {
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
    /// Preparation failed, or its bound passed, with no assignment held.
    PrepareFailed,
}

impl ExitCode {
    /// Every exit code, in numeric order.
    pub const ALL: [ExitCode; 9] = [
        Self::Success,
        Self::Internal,
        Self::Usage,
        Self::Unavailable,
        Self::Unauthorized,
        Self::DeadlinePassed,
        Self::InstallFailed,
        Self::Withdrawn,
        Self::PrepareFailed,
    ];

    /// The process exit status.
    pub const fn code(self) -> u8 {
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

    /// The exit code with this number, if it is one of the table's.
    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|exit| i32::from(exit.code()) == code)
    }

    /// Whether the contract defines this code (`1` it leaves open).
    pub const fn in_contract(self) -> bool {
        !matches!(self, Self::Internal)
    }

    /// A few words, as the server describes a sandbox whose agent ended.
    pub const fn meaning(self) -> &'static str {
        match self {
            Self::Success => "finished",
            Self::Internal => "internal error",
            Self::Usage => "bad configuration or usage",
            Self::Unavailable => "standby credential unavailable",
            Self::Unauthorized => "standby credential unauthorized",
            Self::DeadlinePassed => "standby deadline passed",
            Self::InstallFailed => "install failed",
            Self::Withdrawn => "assignment withdrawn",
            Self::PrepareFailed => "preparation failed",
        }
    }

    /// One line of explanation, as `--help` and the contract's table give it.
    pub const fn help(self) -> &'static str {
        match self {
            Self::Success => "the run finished and was reported, or the standby was retired or cancelled",
            Self::Internal => "internal error",
            Self::Usage => "bad configuration or usage",
            Self::Unavailable => "unavailable (`410` on the standby credential)",
            Self::Unauthorized => "unauthorized (`401`/`403` on the standby credential)",
            Self::DeadlinePassed => "the standby deadline passed with no assignment",
            Self::InstallFailed => "the install failed before the run started (reported)",
            Self::Withdrawn => "the assignment was withdrawn (the run credential was refused)",
            Self::PrepareFailed => "preparation failed, or its bound passed, with no assignment held",
        }
    }

    /// The `Exit codes:` section of the agent's `--help`.
    pub fn help_text() -> String {
        let mut text = String::from("Exit codes:");
        for exit in Self::ALL {
            text.push_str(&format!("\n  {:<3} {}", exit.code(), exit.help().replace('`', "")));
        }
        text
    }

    /// How the server describes a sandbox whose agent ended with `code`
    /// (`None`: killed by a signal).
    pub fn describe(code: Option<i32>) -> String {
        match code {
            Some(0) => "its agent exited 0".into(),
            Some(code) => match Self::from_code(code) {
                Some(exit) => format!("its agent exited {code} ({})", exit.meaning()),
                None => format!("its agent exited {code}"),
            },
            None => "its agent was killed by a signal".into(),
        }
    }
}

impl fmt::Display for ExitCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (exit {})", self.meaning(), self.code())
    }
}

impl From<ExitCode> for std::process::ExitCode {
    fn from(exit: ExitCode) -> Self {
        std::process::ExitCode::from(exit.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_round_trip() {
        for exit in ExitCode::ALL {
            assert_eq!(ExitCode::from_code(i32::from(exit.code())), Some(exit));
        }
        assert_eq!(ExitCode::from_code(3), None);
    }

    #[test]
    fn help_text_lists_every_code() {
        let help = ExitCode::help_text();
        for exit in ExitCode::ALL {
            assert!(help.contains(&format!("\n  {:<3} ", exit.code())), "{exit} missing from {help}");
        }
    }

    #[test]
    fn the_server_names_a_known_code_and_keeps_an_unknown_one() {
        assert_eq!(ExitCode::describe(Some(14)), "its agent exited 14 (assignment withdrawn)");
        assert_eq!(ExitCode::describe(Some(77)), "its agent exited 77");
        assert_eq!(ExitCode::describe(None), "its agent was killed by a signal");
    }
}
