use std::collections::BTreeMap;

use base64::Engine;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Secret;

/// `GET /v1/executions/{id}/secrets`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SecretsResponse {
    pub secrets: BTreeMap<String, Secret>,
}

/// `GET /v1/executions/{id}/attachments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AttachmentsResponse {
    pub attachments: Vec<Attachment>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Attachment {
    /// A plain file name: one with a path separator or `..` fails the install.
    pub name: String,
    /// Starting with `/`: appended to the server's base URL; else absolute.
    pub url: String,
    /// Lowercase hex SHA-256 of the content.
    pub sha256: String,
}

/// `POST /v1/executions/{id}/git-credentials`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GitCredentialsResponse {
    pub credentials: Vec<GitCredential>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GitCredential {
    pub protocol: String,
    pub host: String,
    pub username: String,
    pub password: Secret,
}

/// `POST /v1/executions/{id}/cloud-credentials`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CloudCredentialsResponse {
    pub env: BTreeMap<String, Secret>,
}

/// `POST /v1/executions/{id}/events`. A retried event keeps its `event_id`,
/// so the server can drop duplicates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Event {
    pub event_id: String,
    #[serde(flatten)]
    pub kind: EventKind,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventKind {
    Started,
    Exited { code: i32 },
    Cancelled,
    InstallFailed { requeueable: bool, stage: String, message: String },
}

impl EventKind {
    /// Every event type's name on the wire, in the order a run reports them.
    pub const NAMES: [&'static str; 4] = ["install_failed", "started", "exited", "cancelled"];

    /// The `type` this event carries on the wire.
    pub const fn name(&self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Exited { .. } => "exited",
            Self::Cancelled => "cancelled",
            Self::InstallFailed { .. } => "install_failed",
        }
    }

    /// Whether this event ends the run.
    pub const fn is_terminal(&self) -> bool {
        !matches!(self, Self::Started)
    }

    /// Whether this event may follow `earlier`, the run's distinct events
    /// so far, in the order the contract gives them: a run starts at most
    /// once, exits only once started, fails its install only before it
    /// starts, and reports nothing after an event that ends it.
    pub fn may_follow<'a>(&self, earlier: impl IntoIterator<Item = &'a EventKind>) -> Result<(), OutOfOrder> {
        let (mut started, mut ended) = (false, false);
        for event in earlier {
            started |= matches!(event, Self::Started);
            ended |= event.is_terminal();
        }
        match self {
            _ if ended => Err(OutOfOrder::AfterEnd),
            Self::Started if started => Err(OutOfOrder::StartedTwice),
            Self::Exited { .. } if !started => Err(OutOfOrder::NotStarted),
            Self::InstallFailed { .. } if started => Err(OutOfOrder::FailedAfterStart),
            _ => Ok(()),
        }
    }
}

/// How an event breaks the order of a run's events
/// ([`EventKind::may_follow`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OutOfOrder {
    #[error("an event after the one that ended the run")]
    AfterEnd,
    #[error("`started` a second time")]
    StartedTwice,
    #[error("`exited` before `started`")]
    NotStarted,
    #[error("`install_failed` after `started`")]
    FailedAfterStart,
}

/// `POST /v1/executions/{id}/log`: a chunk of the run's redacted terminal
/// output. `offset` counts bytes already sent, so the server recognises a
/// retried chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LogChunk {
    pub offset: u64,
    /// Base64 (standard alphabet, padded).
    pub data: String,
    /// Bytes the agent had to drop just before this chunk because its
    /// spool bound was exceeded (amendment 6): `offset` is the true one,
    /// and the server accepts it when it equals its stored length plus
    /// `dropped`, recording the gap.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropped: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

impl LogChunk {
    pub fn new(offset: u64, bytes: &[u8]) -> Self {
        Self { offset, data: base64::engine::general_purpose::STANDARD.encode(bytes), dropped: 0 }
    }

    /// A chunk that follows a gap of `dropped` bytes.
    pub fn after_gap(offset: u64, dropped: u64, bytes: &[u8]) -> Self {
        Self { dropped, ..Self::new(offset, bytes) }
    }

    pub fn bytes(&self) -> Result<Vec<u8>, base64::DecodeError> {
        base64::engine::general_purpose::STANDARD.decode(&self.data)
    }
}

/// Body of a `409` answer to a log chunk (amendment 6): the bytes the
/// server holds, so the agent resumes from there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LogReceived {
    pub received: u64,
}

/// Body of an error answer from the reference server (an extension: the
/// contract does not define error bodies, and the agent does not need one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_reports_in_the_contracts_order() {
        let exited = EventKind::Exited { code: 0 };
        let failed = EventKind::InstallFailed { requeueable: true, stage: "secrets".into(), message: "503".into() };
        assert_eq!(EventKind::Started.may_follow(&[]), Ok(()));
        assert_eq!(exited.may_follow(&[EventKind::Started]), Ok(()));
        assert_eq!(EventKind::Cancelled.may_follow(&[]), Ok(()), "cancelled before the start");
        assert_eq!(EventKind::Cancelled.may_follow(&[EventKind::Started]), Ok(()));
        assert_eq!(failed.may_follow(&[]), Ok(()));

        assert_eq!(EventKind::Started.may_follow(&[EventKind::Started]), Err(OutOfOrder::StartedTwice));
        assert_eq!(exited.may_follow(&[]), Err(OutOfOrder::NotStarted));
        assert_eq!(failed.may_follow(&[EventKind::Started]), Err(OutOfOrder::FailedAfterStart));
        for end in [exited.clone(), EventKind::Cancelled, failed.clone()] {
            assert_eq!(EventKind::Cancelled.may_follow([&EventKind::Started, &end]), Err(OutOfOrder::AfterEnd));
        }
    }
}
