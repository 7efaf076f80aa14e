//! What an install failure reports, and whether a cold sandbox could do
//! better. The contract's rule (`requeueable` follows the [`Cause`]) lives in
//! `standby_protocol`; the choice of cause for the agent's own errors (a
//! shell that refuses to be replaced, a call that failed, a command that
//! cannot start) is made here, without IO, and tested here.

use standby_protocol::{Cause, EventKind, Refusal, Stage};

use crate::api::ApiError;
use crate::shell::ShellError;

/// Why the install failed, as reported in `install_failed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InstallFailure {
    pub(crate) stage: Stage,
    pub(crate) cause: Cause,
    pub(crate) message: String,
    /// The run credential was refused: the run was withdrawn, so nothing is
    /// reported and the agent exits 14.
    pub(crate) refused: Option<Refusal>,
}

impl InstallFailure {
    /// A failure at `stage`; `cause` decides whether it is requeueable.
    pub(crate) fn new(stage: Stage, cause: Cause, message: impl Into<String>) -> Self {
        Self { stage, cause, message: message.into(), refused: None }
    }

    /// A call at `stage` whose run credential the server refused.
    pub(crate) fn refused(stage: Stage, refusal: Refusal, message: impl Into<String>) -> Self {
        Self { refused: Some(refusal), ..Self::new(stage, Cause::Network, message) }
    }

    /// Whether a cold sandbox could plausibly succeed.
    #[cfg(test)]
    pub(crate) fn requeueable(&self) -> bool {
        self.cause.requeueable()
    }

    /// The `install_failed` event that reports it.
    pub(crate) fn event(self) -> EventKind {
        EventKind::install_failed(self.stage, self.cause, self.message)
    }

    /// The idle shell was already taken, or never opened: this sandbox
    /// cannot take the run.
    pub(crate) fn shell_gone() -> Self {
        Self::new(Stage::Terminal, Cause::RefusedShell, "the idle shell is gone")
    }

    /// Something the start needs is missing from the driver: this sandbox's
    /// fault, never the run's.
    pub(crate) fn missing(what: &str) -> Self {
        Self::new(Stage::Start, Cause::Sandbox, what)
    }

    /// A failed call at `stage` fails the install, requeueable; a refused
    /// run credential means the run was withdrawn (cancelled, superseded or
    /// requeued). An answer over its cap, or a URL or redirect the origin
    /// rule refuses, is the run's data at fault: a cold sandbox would meet
    /// it too (not requeueable).
    pub(crate) fn call_failed(stage: Stage) -> impl Fn(ApiError) -> Self {
        move |error| match (&error, error.refusal()) {
            (_, Some(refusal)) => Self::refused(stage, refusal, error.to_string()),
            (ApiError::TooLarge { .. } | ApiError::Refused { .. }, None) => {
                Self::new(stage, Cause::InvalidRun, error.to_string())
            }
            _ => Self::new(stage, Cause::Network, error.to_string()),
        }
    }

    /// The run could not replace the idle shell: a shell that refuses to be
    /// replaced (it died or became busy since the install checked it) is
    /// this sandbox's problem, a command that cannot start is the run's.
    pub(crate) fn start_failed(program: &str, error: &ShellError) -> Self {
        let message = format!("starting `{program}`: {error}");
        match error {
            ShellError::NotAlive { .. }
            | ShellError::Busy { .. }
            | ShellError::NoForeground
            | ShellError::NotWritable => Self::new(Stage::Terminal, Cause::RefusedShell, message),
            ShellError::EmptyCommand | ShellError::Cwd { .. } | ShellError::Spawn { .. } => {
                Self::new(Stage::Start, Cause::InvalidRun, message)
            }
            ShellError::OpenPty { .. }
            | ShellError::Io { .. }
            | ShellError::Signal { .. }
            | ShellError::TerminalTaken { .. } => Self::new(Stage::Start, Cause::Sandbox, message),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use reqwest::StatusCode;

    use super::*;

    #[test]
    fn requeueable_follows_the_kind_of_failure() {
        let requeueable = [
            (Cause::Network, true),
            (Cause::RefusedShell, true),
            (Cause::FingerprintMismatch, true),
            (Cause::StrictMcp, true),
            (Cause::Deadline, true),
            (Cause::Unconfirmed, true),
            (Cause::Preparation, true),
            (Cause::Terminated, true),
            (Cause::Sandbox, true),
            (Cause::InvalidRun, false),
        ];
        for (cause, expected) in requeueable {
            assert_eq!(cause.requeueable(), expected, "{cause:?}");
            assert_eq!(InstallFailure::new(Stage::Check, cause, "why").requeueable(), expected, "{cause:?}");
        }
        assert!(InstallFailure::refused(Stage::Secrets, Refusal::Unauthorized, "401").requeueable());
    }

    #[test]
    fn a_shell_refusing_replacement_is_requeueable_a_command_that_cannot_start_is_not() {
        let refusals = [
            ShellError::Busy { foreground_pgid: 42 },
            ShellError::NotAlive { status: "exit status 1".into() },
            ShellError::NoForeground,
            ShellError::NotWritable,
        ];
        for error in refusals {
            let failure = InstallFailure::start_failed("agent.sh", &error);
            assert_eq!((failure.stage, failure.requeueable()), (Stage::Terminal, true), "{failure:?}");
        }
        let invalid = [
            ShellError::EmptyCommand,
            ShellError::Cwd { path: PathBuf::from("/nope"), source: std::io::ErrorKind::NotFound.into() },
            ShellError::Spawn { program: "agent.sh".into(), source: "not found".into() },
        ];
        for error in invalid {
            let failure = InstallFailure::start_failed("agent.sh", &error);
            assert_eq!((failure.stage, failure.requeueable()), (Stage::Start, false), "{failure:?}");
        }
        let failure = InstallFailure::start_failed("agent.sh", &ShellError::OpenPty { source: "no ptys left".into() });
        assert_eq!((failure.stage, failure.requeueable()), (Stage::Start, true), "{failure:?}");
        assert!(failure.message.starts_with("starting `agent.sh`: "), "{}", failure.message);
    }

    #[test]
    fn what_the_start_finds_missing_is_the_sandboxs_fault() {
        for failure in [InstallFailure::missing("no run credential"), InstallFailure::shell_gone()] {
            assert!(failure.requeueable(), "{failure:?}");
            assert_eq!(failure.refused, None);
        }
    }

    #[test]
    fn a_failed_call_is_requeueable_a_refused_credential_withdraws_bad_data_is_final() {
        let status = |status: StatusCode| ApiError::Status { call: "GET /x".into(), status, retry_after: None };
        let failed = InstallFailure::call_failed(Stage::Secrets);

        let unavailable = failed(status(StatusCode::SERVICE_UNAVAILABLE));
        assert_eq!((unavailable.stage, unavailable.requeueable(), unavailable.refused), (Stage::Secrets, true, None));
        let exhausted = failed(ApiError::Exhausted {
            call: "GET /x".into(),
            attempts: 3,
            last: Box::new(status(StatusCode::BAD_GATEWAY)),
        });
        assert!(exhausted.requeueable() && exhausted.refused.is_none(), "{exhausted:?}");

        for (answer, refusal) in [
            (StatusCode::UNAUTHORIZED, Refusal::Unauthorized),
            (StatusCode::FORBIDDEN, Refusal::Unauthorized),
            (StatusCode::GONE, Refusal::Gone),
        ] {
            assert_eq!(failed(status(answer)).refused, Some(refusal), "{answer}");
        }

        let too_large = failed(ApiError::TooLarge { call: "GET /x".into(), cap: 1 << 20 });
        assert!(!too_large.requeueable(), "{too_large:?}");
        let off_origin = failed(ApiError::Refused { call: "GET /x".into(), problem: "redirect".into() });
        assert!(!off_origin.requeueable(), "{off_origin:?}");
    }
}
