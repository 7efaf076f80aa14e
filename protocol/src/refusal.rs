//! How a server's answer to a credential is read, on the control socket's
//! upgrade and on every HTTP call: the one mapping from status to meaning to
//! exit code, used by the agent that reads answers and by the servers that
//! give them.

use crate::ExitCode;

/// Which credential a request carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CredentialKind {
    /// The long-lived credential a standby waits with.
    Standby,
    /// The per-run credential from the assignment.
    Run,
}

/// A final refusal of a credential: never retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// `410 Gone`: the credential's subject is gone (a retired standby, a
    /// finished run). The server answers this to a credential it issued and
    /// has since retired.
    Gone,
    /// `401`/`403`: the credential is not (or no longer) accepted. The server
    /// answers `401` to a credential it does not know.
    Unauthorized,
}

impl Refusal {
    /// The status a server answers with.
    pub const fn status(self) -> u16 {
        match self {
            Self::Gone => 410,
            Self::Unauthorized => 401,
        }
    }

    /// How the agent exits when `credential` is refused this way.
    pub const fn exit(self, credential: CredentialKind) -> ExitCode {
        match (credential, self) {
            (CredentialKind::Standby, Self::Gone) => ExitCode::Unavailable,
            (CredentialKind::Standby, Self::Unauthorized) => ExitCode::Unauthorized,
            (CredentialKind::Run, _) => ExitCode::Withdrawn,
        }
    }
}

/// What an answer's status means to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Answer {
    /// `2xx`.
    Success,
    /// The credential is refused for good.
    Refused(Refusal),
    /// `408`, `429`, `5xx`: retried with backoff, honouring `Retry-After`.
    Transient,
    /// Any other status: the request itself is wrong; retrying will not help.
    Fatal,
}

impl Answer {
    pub const fn of(status: u16) -> Self {
        match status {
            200..=299 => Self::Success,
            401 | 403 => Self::Refused(Refusal::Unauthorized),
            410 => Self::Refused(Refusal::Gone),
            408 | 429 => Self::Transient,
            500.. => Self::Transient,
            _ => Self::Fatal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_contract_table() {
        let standby = CredentialKind::Standby;
        let run = CredentialKind::Run;
        assert_eq!(Answer::of(410), Answer::Refused(Refusal::Gone));
        assert_eq!(Refusal::Gone.exit(standby).code(), 10);
        assert_eq!(Refusal::Gone.exit(run).code(), 14);
        for status in [401, 403] {
            let Answer::Refused(refusal) = Answer::of(status) else { panic!("{status} is a refusal") };
            assert_eq!(refusal.exit(standby).code(), 11);
            assert_eq!(refusal.exit(run).code(), 14);
        }
        for status in [408, 429, 500, 502, 503] {
            assert_eq!(Answer::of(status), Answer::Transient, "{status}");
        }
        assert_eq!(Answer::of(404), Answer::Fatal);
        assert_eq!(Answer::of(204), Answer::Success);
    }

    #[test]
    fn a_server_answers_the_status_the_agent_reads() {
        for refusal in [Refusal::Gone, Refusal::Unauthorized] {
            assert_eq!(Answer::of(refusal.status()), Answer::Refused(refusal));
        }
    }
}
