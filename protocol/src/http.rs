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
