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

/// Where the engine reads the time it gives the machine: the system clock
/// in production, one a test moves by hand. Read in one place, so every
/// input of a batch is stamped by the same clock.
#[derive(Clone)]
pub struct Clock(std::sync::Arc<dyn Fn() -> Millis + Send + Sync>);

impl Clock {
    pub fn system() -> Self {
        Self::from_fn(Millis::now)
    }

    pub fn from_fn(now: impl Fn() -> Millis + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(now))
    }

    pub fn now(&self) -> Millis {
        (self.0)()
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Clock").field(&self.now()).finish()
    }
}

/// Where a run is in its life. `queued` → `committed` (bound to a
/// sandbox, assignment being delivered) → `confirmed` (the run credential
/// connected) → `running` → `exited`; or `failed` / `cancelled`. Before it
/// is bound, a run may be `waiting` (the running cap is reached, or another
/// turn of its thread holds the thread's sandbox) or `resuming` (its
/// thread's parked sandbox is being started for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Queued,
    /// Not bound, and cannot be yet: [`RunRecord::wait`] says why.
    Waiting,
    /// Its thread's parked sandbox is being made ready for it; bound (and
    /// told) only once its agent is ready.
    Resuming,
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
    pub const ALL: [Self; 10] = [
        Self::Queued,
        Self::Waiting,
        Self::Resuming,
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

    /// Not bound to a sandbox yet.
    pub fn is_unbound(self) -> bool {
        matches!(self, Self::Queued | Self::Waiting | Self::Resuming)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Waiting => "waiting",
            Self::Resuming => "resuming",
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

/// What kind of sandbox an attempt got: a pre-warmed standby, a sandbox
/// created for it, or its thread's parked sandbox, still running (Tier 2)
/// or stopped and started again for it (Tier 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunPath {
    Warm,
    Cold,
    ParkedRunning,
    ParkedStopped,
}

impl RunPath {
    pub const ALL: [Self; 4] = [Self::Warm, Self::Cold, Self::ParkedRunning, Self::ParkedStopped];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Warm => "warm",
            Self::Cold => "cold",
            Self::ParkedRunning => "parked_running",
            Self::ParkedStopped => "parked_stopped",
        }
    }
}

/// How an attempt ended, when it is not the run's live one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
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
    /// The agent's own timing of the start, microseconds by step
    /// (contract 1.3, `install_us` of `started`), for the status page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub install_us: Option<std::collections::BTreeMap<String, u64>>,
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
    /// The conversation this run is a turn of: its sandbox is kept for the
    /// thread's next turn.
    #[serde(default)]
    pub thread_id: Option<String>,
    /// The generation of the thread pointer this turn wrote when it took
    /// the thread; its later pointer writes expect exactly this one.
    #[serde(default)]
    pub thread_generation: Option<u64>,
    /// Why the run is `waiting`, and since when.
    #[serde(default)]
    pub wait: Option<Wait>,
    /// The resume of its thread's parked sandbox, when one was tried.
    #[serde(default)]
    pub resume: Option<Resume>,
    /// What its agent's final event (`exited`, `cancelled`) said of the
    /// log: bytes of output it gave up on, 0 when it delivered all of it;
    /// `None` while the run has not ended, or when it ended without that
    /// event (contract 1.1 note 10).
    #[serde(default)]
    pub log_lost: Option<u64>,
}

/// Why an unbound run cannot be bound yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wait {
    pub reason: String,
    pub since: Millis,
    /// Whether it waits for a running slot (the cap), as opposed to its
    /// thread's previous turn.
    pub for_slot: bool,
}

/// A follow-up turn's use of its thread's parked sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resume {
    pub sandbox_id: String,
    /// How the sandbox was parked when the turn arrived.
    pub from: ParkMode,
    pub began_at: Millis,
    /// Its agent said `ready` (the run was bound then).
    pub ready_at: Option<Millis>,
    /// Why the resume was given up and the run placed like a new one.
    pub fallback: Option<String>,
}

impl RunRecord {
    /// A run just submitted: queued, nothing tried, its fingerprint that of
    /// the workspace it names.
    pub fn queued(id: String, submitted_at: Millis, run: Run, thread_id: Option<String>) -> Self {
        Self {
            id,
            submitted_at,
            state: RunState::Queued,
            fingerprint: run.workspace.as_ref().map(standby_protocol::fingerprint),
            run,
            attempts: Vec::new(),
            exit_code: None,
            error: None,
            ended_at: None,
            thread_id,
            thread_generation: None,
            wait: None,
            resume: None,
            log_lost: None,
        }
    }

    pub fn current(&self) -> Option<&Attempt> {
        self.attempts.last()
    }

    pub fn current_mut(&mut self) -> Option<&mut Attempt> {
        self.attempts.last_mut()
    }

    /// Whether an attempt already used a sandbox prepared before the run
    /// (a standby or a parked one): later attempts go cold.
    pub fn had_prepared_attempt(&self) -> bool {
        self.attempts.iter().any(|attempt| attempt.path != RunPath::Cold)
    }

    /// The path of the attempt that ran (or is running) the run.
    pub fn path(&self) -> Option<RunPath> {
        self.current().map(|attempt| attempt.path)
    }
}

/// Whether a sandbox was made ahead of time for the pool or for one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxKind {
    Warm,
    Cold,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// No run bound: a standby (warm) or about to get one (never for cold).
    Standby,
    /// A run is bound to it.
    Assigned,
    /// Kept for its thread's next turn ([`SandboxRecord::park`] says how).
    Parked,
    /// Parked, and claimed by a turn of its thread (`run_id`): being made
    /// ready; the run is bound once its agent is.
    Resuming,
    /// Done: its standby credential answers `410` or `401`, never `101`.
    Retired,
}

impl SandboxState {
    pub const ALL: [Self; 5] = [Self::Standby, Self::Assigned, Self::Parked, Self::Resuming, Self::Retired];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Standby => "standby",
            Self::Assigned => "assigned",
            Self::Parked => "parked",
            Self::Resuming => "resuming",
            Self::Retired => "retired",
        }
    }
}

/// How a sandbox kept for a thread waits for the next turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ParkMode {
    /// Tier 2: running, with a fresh agent, until the warm idle window ends.
    Running,
    /// Tier 1: stopped through the provider; the filesystem is kept.
    Stopped,
}

impl ParkMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Stopped => "stopped",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Park {
    pub mode: ParkMode,
    /// When its turn ended (or, for `stopped`, when it was stopped).
    pub since: Millis,
    /// End of the warm idle window (`running` only).
    pub until: Option<Millis>,
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
    /// The thread it served a turn of; it is kept for that thread.
    #[serde(default)]
    pub thread_id: Option<String>,
    /// How it is kept (`parked` and `resuming`).
    #[serde(default)]
    pub park: Option<Park>,
    /// Standby TTL: a replacement is made from here on (jittered).
    #[serde(default)]
    pub expires_at: Option<Millis>,
    /// Standby TTL: its end; the standby is retired before it.
    #[serde(default)]
    pub deadline: Option<Millis>,
    /// The provider auto-stop last asked for, in provider minutes (`0`:
    /// never).
    #[serde(default)]
    pub auto_stop_minutes: Option<u32>,
    /// The replica that held its agent's last control connection.
    #[serde(default)]
    pub held_by: Option<Holder>,
}

impl SandboxRecord {
    /// A sandbox just made: in standby, never connected, nothing decided.
    pub fn standby(
        id: String,
        kind: SandboxKind,
        created_at: Millis,
        standby_credential_id: String,
        (workspace, fingerprint): (Option<Workspace>, Fingerprint),
    ) -> Self {
        Self {
            id,
            kind,
            state: SandboxState::Standby,
            created_at,
            standby_credential_id,
            workspace,
            fingerprint,
            run_id: None,
            connections: 0,
            run_connections: 0,
            retired_at: None,
            retire_reason: None,
            exit_code: None,
            thread_id: None,
            park: None,
            expires_at: None,
            deadline: None,
            auto_stop_minutes: None,
            held_by: None,
        }
    }
}

/// Which replica of a replicated deployment holds an agent's control
/// socket, recorded by the leader of `epoch` when the socket opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Holder {
    pub replica: String,
    pub epoch: u64,
}

/// The thread-to-sandbox pointer. Every write names the generation it
/// read and bumps it (compare-and-set, in memory and in the store), so a
/// stale writer (a turn that finished late, a second server process on the
/// same store) cannot overwrite a newer pointer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadRecord {
    pub id: String,
    pub generation: u64,
    /// The sandbox kept for the thread (parked, resuming, or busy with
    /// `holder`).
    pub sandbox_id: Option<String>,
    /// The turn holding the thread: the next turn waits until it ends.
    pub holder: Option<String>,
    pub updated_at: Millis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CredentialState {
    Active,
    /// Fenced: answered `401`.
    Revoked,
    /// Answered `410`. A standby credential: its sandbox is gone. A run
    /// credential: its run is over.
    Retired,
    /// A run credential after a cancel (amendment 8): the run's events and
    /// log are accepted, anything else is answered `410`.
    Finishing,
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

impl StoredAttachment {
    /// How run `run_id`'s agent is told of it, by the attachments call and
    /// inline in the assignment alike: its name, hash and the server's URL
    /// of its content.
    pub fn listed(&self, run_id: &str) -> standby_protocol::Attachment {
        standby_protocol::Attachment {
            name: self.name.clone(),
            url: standby_protocol::paths::attachment(run_id, &self.name),
            sha256: self.sha256.clone(),
        }
    }
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

/// An `Idempotency-Key` of `POST /v1/runs`: the run it made and a hash of
/// the body it came with, kept for the idempotency window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    pub key: String,
    /// SHA-256 (hex) of the submission as parsed JSON, so that a retry
    /// with the same fields in another order or spacing is the same body.
    pub request_hash: String,
    pub run_id: String,
    pub created_at: Millis,
}
