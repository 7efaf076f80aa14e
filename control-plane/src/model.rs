//! The records the server keeps: runs, their attempts, sandboxes and
//! credentials. They are plain data, shared by the dispatch state machine
//! (which changes them), the store (which persists them as JSON documents)
//! and the HTTP API (which shows them).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use standby_protocol::{Fingerprint, GitCredential, Run, Secret, Workspace};

use crate::credential::{CredentialKind, TokenHash};

/// Milliseconds since the Unix epoch: the clock the state machine is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Millis(pub i64);

impl Millis {
    pub fn now() -> Self {
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Self(i64::try_from(since.as_millis()).unwrap_or(i64::MAX))
    }

    pub fn plus(self, duration: std::time::Duration) -> Self {
        Self(self.0.saturating_add(i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)))
    }

    /// Milliseconds from `earlier` to `self`, never negative.
    pub fn since(self, earlier: Self) -> u64 {
        u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0)
    }

    /// RFC 3339, for people and the API.
    pub fn rfc3339(self) -> String {
        jiff::Timestamp::from_millisecond(self.0).map(|t| t.to_string()).unwrap_or_else(|_| self.0.to_string())
    }
}

/// Where a run is in its life. `queued` → `committed` (bound to a
/// sandbox, assignment being delivered) → `confirmed` (the run credential
/// connected) → `running` → `exited`; or `failed` / `cancelled`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Queued,
    Committed,
    Confirmed,
    Running,
    /// Cancel requested after the run started; waiting for its report.
    Cancelling,
    Exited,
    Failed,
    Cancelled,
}

impl RunState {
    pub const ALL: [Self; 8] = [
        Self::Queued,
        Self::Committed,
        Self::Confirmed,
        Self::Running,
        Self::Cancelling,
        Self::Exited,
        Self::Failed,
        Self::Cancelled,
    ];

    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Exited | Self::Failed | Self::Cancelled)
    }

    /// Bound to a sandbox but not started: the window fencing protects.
    pub fn is_pre_start(self) -> bool {
        matches!(self, Self::Committed | Self::Confirmed)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Committed => "committed",
            Self::Confirmed => "confirmed",
            Self::Running => "running",
            Self::Cancelling => "cancelling",
            Self::Exited => "exited",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for RunState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether an attempt used a pre-warmed standby or a sandbox created for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunPath {
    Warm,
    Cold,
}

impl RunPath {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Warm => "warm",
            Self::Cold => "cold",
        }
    }
}

/// How an attempt ended, when it is not the run's live one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptOutcome {
    /// The run finished on it (exited, failed after starting, cancelled).
    Finished,
    /// Released before the run started; the run went back to the queue.
    Requeued,
    /// Ended before the run started, and so did the run.
    Failed,
    /// The run was cancelled before it started.
    Cancelled,
}

/// One binding of a run to a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    pub number: u32,
    pub sandbox_id: String,
    pub path: RunPath,
    pub credential_id: String,
    pub committed_at: Millis,
    pub assignment_sent_at: Option<Millis>,
    pub delivery_confirmed_at: Option<Millis>,
    pub started_at: Option<Millis>,
    pub ended_at: Option<Millis>,
    pub outcome: Option<AttemptOutcome>,
    /// Why it ended, in words (the agent's message, "sandbox exited"...).
    pub reason: Option<String>,
}

/// A run as the server tracks it. Secrets are not here: they stay in the
/// stored [`RunRequest`], read only when the agent asks for them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRecord {
    pub id: String,
    pub submitted_at: Millis,
    pub state: RunState,
    /// What the assignment carries.
    pub run: Run,
    /// Fingerprint of `run.workspace`, when the run names one.
    pub fingerprint: Option<Fingerprint>,
    pub attempts: Vec<Attempt>,
    pub exit_code: Option<i32>,
    pub error: Option<String>,
    pub ended_at: Option<Millis>,
}

impl RunRecord {
    pub fn current(&self) -> Option<&Attempt> {
        self.attempts.last()
    }

    pub fn current_mut(&mut self) -> Option<&mut Attempt> {
        self.attempts.last_mut()
    }

    pub fn had_warm_attempt(&self) -> bool {
        self.attempts.iter().any(|attempt| attempt.path == RunPath::Warm)
    }

    /// The path of the attempt that ran (or is running) the run.
    pub fn path(&self) -> Option<RunPath> {
        self.current().map(|attempt| attempt.path)
    }
}

/// Whether a sandbox was made ahead of time for the pool or for one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxKind {
    Warm,
    Cold,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// No run bound: a standby (warm) or about to get one (never for cold).
    Standby,
    /// A run is bound to it.
    Assigned,
    /// Done: its standby credential answers `410` or `401`, never `101`.
    Retired,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Standby => "standby",
            Self::Assigned => "assigned",
            Self::Retired => "retired",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    pub kind: SandboxKind,
    pub state: SandboxState,
    pub created_at: Millis,
    /// The current standby credential (a restart may rotate it).
    pub standby_credential_id: String,
    /// The workspace it prepares; `None` means the pool spec's.
    pub workspace: Option<Workspace>,
    pub fingerprint: Fingerprint,
    pub run_id: Option<String>,
    /// Control connections admitted with the standby credential: more
    /// than one means reconnects.
    pub connections: u32,
    /// Control connections admitted with a run credential; the first is
    /// delivery confirmation, any more are reconnects.
    #[serde(default)]
    pub run_connections: u32,
    pub retired_at: Option<Millis>,
    pub retire_reason: Option<String>,
    pub exit_code: Option<i32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CredentialState {
    Active,
    /// Fenced: answered `401`.
    Revoked,
    /// Its sandbox is gone: answered `410` (standby credentials only).
    Retired,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialRecord {
    pub id: String,
    pub kind: CredentialKind,
    pub hash: TokenHash,
    pub sandbox_id: String,
    /// Run credentials: the execution and attempt number.
    pub run_id: Option<String>,
    pub attempt: Option<u32>,
    pub state: CredentialState,
}

/// An attachment as stored: the content itself, served to the agent with
/// its SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredAttachment {
    pub name: String,
    /// Base64 (standard alphabet) of the content.
    pub content_base64: String,
    pub sha256: String,
}

/// Everything submitted with a run, secrets included: stored once at
/// submit, read when the agent fetches its parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRequest {
    pub secrets: BTreeMap<String, Secret>,
    pub cloud_env: BTreeMap<String, Secret>,
    pub git_credentials: Vec<GitCredential>,
    pub metadata: serde_json::Value,
    pub attachments: Vec<StoredAttachment>,
}

/// A lifecycle event as stored, in arrival order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredEvent {
    pub run_id: String,
    pub attempt: u32,
    pub received_at: Millis,
    pub event: standby_protocol::Event,
}
