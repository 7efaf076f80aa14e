//! What an `install_failed` event says: the stage that failed and whether
//! the run may be requeued on a cold sandbox. The contract's rule lives in
//! [`Cause::requeueable`]: requeueable where a fresh cold sandbox could
//! plausibly succeed, not where the run itself is invalid. A stage alone does
//! not decide it (an attachment fails on a bad name and on a dropped
//! connection alike), so an agent names both.

use std::fmt;

use crate::EventKind;

/// Where the install failed: the `stage` of an `install_failed` event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Preparation failed or ran out of time with the assignment held (1.1).
    Prepare,
    /// Delivery was not confirmed on the run-credential connection.
    Confirm,
    /// The install as a whole: its bound passed.
    Install,
    /// The agent was stopped (SIGTERM) before the run started.
    Terminated,
    /// `GET …/secrets`.
    Secrets,
    /// The attachments: listing, download, checksum, writing.
    Attachments,
    /// `POST …/git-credentials` and writing them for git.
    GitCredentials,
    /// `GET …/metadata` and writing it.
    Metadata,
    /// `POST …/cloud-credentials`.
    CloudCredentials,
    /// Refreshing a repo to its `expected_sha` or the head of its `ref`.
    Refresh,
    /// The run itself: its command and `cwd`.
    Check,
    /// The assignment's workspace is not the one prepared here.
    SamePreparation,
    /// Replacing the idle shell on the sandbox's terminal.
    Terminal,
    /// Restarting the MCP servers with the run's env.
    Mcp,
    /// Starting the run's command.
    Start,
}

impl Stage {
    pub const ALL: [Stage; 15] = [
        Self::Prepare,
        Self::Confirm,
        Self::Install,
        Self::Terminated,
        Self::Secrets,
        Self::Attachments,
        Self::GitCredentials,
        Self::Metadata,
        Self::CloudCredentials,
        Self::Refresh,
        Self::Check,
        Self::SamePreparation,
        Self::Terminal,
        Self::Mcp,
        Self::Start,
    ];

    /// The name on the wire.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Prepare => "prepare",
            Self::Confirm => "confirm",
            Self::Install => "install",
            Self::Terminated => "terminated",
            Self::Secrets => "secrets",
            Self::Attachments => "attachments",
            Self::GitCredentials => "git_credentials",
            Self::Metadata => "metadata",
            Self::CloudCredentials => "cloud_credentials",
            Self::Refresh => "refresh",
            Self::Check => "check",
            Self::SamePreparation => "same_preparation",
            Self::Terminal => "terminal",
            Self::Mcp => "mcp",
            Self::Start => "start",
        }
    }

    /// The stage with this wire name; `None` for a name another agent
    /// invented (the contract leaves stages open, so a server keeps the text).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|stage| stage.name() == name)
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What kind of failure stopped the install: decides `requeueable`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// The run is invalid wherever it goes: no command, a `cwd` that leaves
    /// the workspace or is not a directory, an attachment name with a path
    /// separator or `..`, a repo path that leaves the workspace, a command
    /// that cannot be spawned.
    InvalidRun,
    /// A call to the server, a download or a git transfer failed.
    Network,
    /// The idle shell is dead, busy or its terminal not writable.
    RefusedShell,
    /// The assignment's workspace is not the one prepared here.
    FingerprintMismatch,
    /// An MCP server failed to restart under `strict_mcp`.
    StrictMcp,
    /// The install did not finish within its bound.
    Deadline,
    /// Delivery was not confirmed within the confirm timeout.
    Unconfirmed,
    /// Preparation failed, or its bound passed, with the assignment held.
    Preparation,
    /// The agent was stopped (SIGTERM) before the run started.
    Terminated,
    /// This sandbox could not do its part: a file it could not write, a
    /// terminal gone missing.
    Sandbox,
}

impl Cause {
    /// The contract's rule for `requeueable`.
    pub const fn requeueable(self) -> bool {
        match self {
            Self::InvalidRun => false,
            Self::Network
            | Self::RefusedShell
            | Self::FingerprintMismatch
            | Self::StrictMcp
            | Self::Deadline
            | Self::Unconfirmed
            | Self::Preparation
            | Self::Terminated
            | Self::Sandbox => true,
        }
    }
}

impl EventKind {
    /// The `install_failed` event for a failure at `stage` of kind `cause`.
    pub fn install_failed(stage: Stage, cause: Cause, message: impl Into<String>) -> Self {
        Self::InstallFailed {
            requeueable: cause.requeueable(),
            stage: stage.name().to_owned(),
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_names_round_trip_and_are_distinct() {
        for stage in Stage::ALL {
            assert_eq!(Stage::from_name(stage.name()), Some(stage));
        }
        assert_eq!(Stage::from_name("warp_drive"), None);
    }

    #[test]
    fn only_an_invalid_run_is_final() {
        assert!(!Cause::InvalidRun.requeueable());
        for cause in [Cause::Network, Cause::FingerprintMismatch, Cause::Preparation, Cause::Unconfirmed] {
            assert!(cause.requeueable(), "{cause:?}");
        }
    }

    #[test]
    fn the_event_carries_the_stage_name_and_the_rule() {
        let event = EventKind::install_failed(Stage::SamePreparation, Cause::FingerprintMismatch, "differs");
        assert_eq!(
            event,
            EventKind::InstallFailed { requeueable: true, stage: "same_preparation".into(), message: "differs".into() }
        );
    }
}
