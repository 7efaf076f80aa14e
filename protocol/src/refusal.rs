//! How a server's answer to a credential is read, on the control socket's
//! upgrade and on every HTTP call: the one mapping from status to meaning to
//! exit code, used by the agent that reads answers and by the servers that
//! give them.

use crate::ExitCode;

/// Which credential a request carried. A server that keeps it keeps it as
/// `standby` or `run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
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

/// Where a credential stands with the server it is presented to. With
/// [`Standing::admits`] it is the servers' half of the refusal rule: which
/// credential is answered which status, on the control socket's upgrade and
/// on every HTTP call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Standing {
    /// In force.
    Active,
    /// The run credential of a cancelled run (1.1): its run's events and log
    /// are still accepted until the agent exits; anything else is refused as
    /// gone.
    Finishing,
    /// Withdrawn in favour of another holder: the standby credential once
    /// its run credential connected, the run credential of a run that was
    /// superseded or requeued.
    Revoked,
    /// Its subject is gone: a retired or expired standby (or a standby
    /// credential the server no longer holds at all), a run that is over.
    Retired,
    /// Not a credential the server issued for this use: unknown, a wrong
    /// secret, another run's credential, a standby credential on a run's
    /// call, a run credential on the spec.
    Unknown,
}

/// What a credential is presented for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Purpose {
    /// The control socket's upgrade.
    Socket,
    /// The spec, and a run's secrets, attachments, git and cloud
    /// credentials and metadata.
    Fetch,
    /// A run's events and log.
    Report,
}

impl Standing {
    /// Whether a credential that stands so is accepted for `purpose`, or
    /// how it is refused.
    pub const fn admits(self, purpose: Purpose) -> Result<(), Refusal> {
        match (self, purpose) {
            (Self::Active, _) | (Self::Finishing, Purpose::Report) => Ok(()),
            (Self::Finishing | Self::Retired, _) => Err(Refusal::Gone),
            (Self::Revoked | Self::Unknown, _) => Err(Refusal::Unauthorized),
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
    fn the_servers_table() {
        for purpose in [Purpose::Socket, Purpose::Fetch, Purpose::Report] {
            assert_eq!(Standing::Active.admits(purpose), Ok(()));
            assert_eq!(Standing::Revoked.admits(purpose), Err(Refusal::Unauthorized));
            assert_eq!(Standing::Unknown.admits(purpose), Err(Refusal::Unauthorized));
            assert_eq!(Standing::Retired.admits(purpose), Err(Refusal::Gone));
        }
        assert_eq!(Standing::Finishing.admits(Purpose::Report), Ok(()), "a cancelled run still reports (1.1)");
        assert_eq!(Standing::Finishing.admits(Purpose::Fetch), Err(Refusal::Gone));
        assert_eq!(Standing::Finishing.admits(Purpose::Socket), Err(Refusal::Gone));
    }

    #[test]
    fn a_server_answers_the_status_the_agent_reads() {
        for refusal in [Refusal::Gone, Refusal::Unauthorized] {
            assert_eq!(Answer::of(refusal.status()), Answer::Refused(refusal));
        }
    }
}
