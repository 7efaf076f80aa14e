//! The server's rules as a pure state machine: inputs in, writes and
//! effects out. No IO, no clock (`now` is an argument), no randomness (a
//! [`Mint`] is injected), so every rule below is tested without sockets,
//! processes or sleeps.
//!
//! The driver ([`crate::engine`]) applies a [`Step`]'s writes in one store
//! transaction **before** it carries out any of its effects. That is how
//! "commit before tell" holds: the step that binds a run to a sandbox also
//! emits the assignment frame, and the frame leaves only once the binding
//! is durable. The same ordering makes fencing hold: a step that cancels,
//! supersedes or requeues a run revokes its run credential in the writes,
//! and only then tells anyone anything.
//!
//! Rules:
//! - A sandbox takes at most one assignment; an execution has at most one
//!   sandbox at a time (its previous attempt is released first).
//! - A warm candidate is a pool standby with no run, a live standby
//!   connection, and whose last heartbeat said `ready` within three
//!   heartbeat intervals. The run's workspace is not compared here: the
//!   agent checks it (`same_preparation`) and a mismatch comes back as a
//!   requeueable `install_failed`, so the run goes cold.
//! - At most one attempt per execution is warm; with no candidate (or after
//!   the warm attempt) the run gets a cold sandbox created for it, bound
//!   before it ever connects.
//! - The run credential connecting confirms delivery: the standby
//!   credential is revoked and the assignment replayed.
//! - `install_failed` with `requeueable` releases the run (credential
//!   revoked first), retires the sandbox and requeues the run while
//!   attempts remain; otherwise the run fails with the agent's message.
//! - A committed sandbox that exits, or stops heartbeating, before
//!   confirmation is written off (both credentials revoked) and the run
//!   requeued the same way.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use standby_protocol::{
    AgentState, Assignment, Cancel, Event, EventKind, Fingerprint, Retired, Run, Secret, ServerMessage, fingerprint,
};

use crate::credential::{self, CredentialKind, Mint, TokenHash};
use crate::model::{
    Attempt, AttemptOutcome, CredentialRecord, CredentialState, Millis, RunPath, RunRecord, RunRequest, RunState,
    SandboxKind, SandboxRecord, SandboxState, StoredEvent,
};

/// Identifies one control connection, allocated by the driver.
pub type ConnId = u64;

/// How many heartbeat intervals may pass before a sandbox counts as silent.
pub const HEARTBEAT_WINDOW: u32 = 3;

#[derive(Debug, Clone)]
pub struct DispatchConfig {
    /// The interval the agents are launched with.
    pub heartbeat_interval: Duration,
    /// Standbys kept ready.
    pub pool_size: usize,
    /// Attempts per execution, warm and cold together (at most one warm).
    pub max_attempts: u32,
    /// How long a launched sandbox may take to connect the first time.
    pub launch_timeout: Duration,
    /// How long a sandbox told to stop (finished, cancelled, retired) has to
    /// exit on its own before the provider stops it.
    pub linger: Duration,
    /// Fingerprint of the pool spec's workspace.
    pub pool_fingerprint: Fingerprint,
}

impl DispatchConfig {
    fn silence(&self) -> Duration {
        self.heartbeat_interval * HEARTBEAT_WINDOW
    }
}

/// A change to persist. A step's writes form one transaction.
#[derive(Debug, Clone)]
pub enum Write {
    NewRun(Box<RunRecord>, Box<RunRequest>),
    Run(Box<RunRecord>),
    Sandbox(Box<SandboxRecord>),
    Credential(Box<CredentialRecord>),
    Event(Box<StoredEvent>),
    Log { run_id: String, offset: u64, data: Vec<u8> },
}

/// Something the driver does after the step's writes are durable.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Send a frame on a control connection (dropped if it is gone).
    Send { conn: ConnId, message: ServerMessage },
    /// Close a control connection after the frames queued before it.
    Close { conn: ConnId },
    /// Launch the agent of a sandbox with its standby credential, creating
    /// the sandbox first when `create`.
    Launch { sandbox_id: String, token: Secret, create: bool },
    /// Let the sandbox exit on its own for up to `linger`, then stop it and
    /// delete it.
    Retire { sandbox_id: String, linger: Duration },
    /// Ask the provider what became of a sandbox (after a restart).
    Probe { sandbox_id: String },
}

/// The outcome of one input.
#[derive(Debug, Default)]
pub struct Step {
    pub writes: Vec<Write>,
    pub effects: Vec<Effect>,
}

impl Step {
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty() && self.effects.is_empty()
    }
}

/// Who a presented credential is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    Standby { sandbox_id: String, credential_id: String },
    Run { sandbox_id: String, run_id: String, attempt: u32, credential_id: String },
}

impl Admission {
    pub fn credential_id(&self) -> &str {
        match self {
            Self::Standby { credential_id, .. } | Self::Run { credential_id, .. } => credential_id,
        }
    }
}

/// Why a credential is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// `410`: an unknown or retired standby credential; the sandbox is gone.
    #[error("the standby credential is unknown or retired")]
    Gone,
    /// `401`: revoked, wrong, or not a credential at all.
    #[error("the credential is revoked or not valid")]
    Unauthorized,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CancelError {
    #[error("no run `{0}`")]
    NotFound(String),
    #[error("run `{run_id}` already {state}")]
    Finished { run_id: String, state: RunState },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// The chunk starts past the end of what was received.
    #[error("log chunk at offset {offset} leaves a gap: {received} bytes received so far")]
    Gap { offset: u64, received: u64 },
}

/// What a provider says about a sandbox after a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Running,
    /// Exists but its agent is not running: it can be started again.
    Stopped,
    Missing,
}

/// What the store holds, to rebuild the machine after a restart.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub runs: Vec<RunRecord>,
    pub sandboxes: Vec<SandboxRecord>,
    pub credentials: Vec<CredentialRecord>,
    /// `(run_id, event_id)` of every event received.
    pub event_ids: Vec<(String, String)>,
    /// Bytes of log received per run.
    pub log_lengths: Vec<(String, u64)>,
}

#[derive(Debug, Clone)]
struct Heartbeat {
    at: Millis,
    state: AgentState,
}

/// A sandbox's record plus what only lives in memory.
#[derive(Debug)]
struct Live {
    record: SandboxRecord,
    heartbeat: Option<Heartbeat>,
    /// The plaintext run credential, until delivery is confirmed, to send
    /// the assignment again on a later standby connection. Never stored:
    /// after a restart it is minted anew.
    run_token: Option<Secret>,
    launched_at: Millis,
    exited: bool,
    ever_ready: bool,
}

#[derive(Debug, Clone)]
struct Conn {
    sandbox_id: String,
    kind: CredentialKind,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone)]
pub struct SandboxView {
    pub record: SandboxRecord,
    pub last_heartbeat_at: Option<Millis>,
    pub last_state: Option<AgentState>,
    pub connected: bool,
    pub candidate: bool,
}

/// Numbers for `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct MetricsSnapshot {
    /// `(state, path)` → count; path `None` for runs never bound.
    pub runs: BTreeMap<(RunState, Option<RunPath>), u64>,
    /// Assignment sent → started, per started attempt, in milliseconds.
    pub assignment_to_start_ms: Vec<u64>,
    pub connected_standbys: u64,
    pub reconnects: u64,
    pub requeues: u64,
    pub sandboxes_live: u64,
}

pub struct Dispatch {
    config: DispatchConfig,
    mint: Box<dyn Mint>,
    runs: BTreeMap<String, RunRecord>,
    queue: VecDeque<String>,
    sandboxes: BTreeMap<String, Live>,
    credentials: HashMap<String, CredentialRecord>,
    conns: HashMap<ConnId, Conn>,
    events_seen: HashSet<(String, String)>,
    log_lengths: HashMap<String, u64>,
    draining: bool,
    /// Pool standbys in a row that ended without ever being ready.
    pool_failures: u32,
    pool_backoff_until: Millis,
}

impl std::fmt::Debug for Dispatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatch")
            .field("runs", &self.runs.len())
            .field("sandboxes", &self.sandboxes.len())
            .field("conns", &self.conns.len())
            .field("draining", &self.draining)
            .finish_non_exhaustive()
    }
}

fn describe_exit(code: Option<i32>) -> String {
    match code {
        Some(0) => "its agent exited 0".into(),
        Some(10) => "its agent exited 10 (standby credential unavailable)".into(),
        Some(11) => "its agent exited 11 (standby credential unauthorized)".into(),
        Some(12) => "its agent exited 12 (standby deadline passed)".into(),
        Some(13) => "its agent exited 13 (install failed)".into(),
        Some(14) => "its agent exited 14 (assignment withdrawn)".into(),
        Some(15) => "its agent exited 15 (preparation failed)".into(),
        Some(code) => format!("its agent exited {code}"),
        None => "its agent was killed by a signal".into(),
    }
}

impl Dispatch {
    pub fn new(config: DispatchConfig, mint: Box<dyn Mint>) -> Self {
        Self {
            config,
            mint,
            runs: BTreeMap::new(),
            queue: VecDeque::new(),
            sandboxes: BTreeMap::new(),
            credentials: HashMap::new(),
            conns: HashMap::new(),
            events_seen: HashSet::new(),
            log_lengths: HashMap::new(),
            draining: false,
            pool_failures: 0,
            pool_backoff_until: Millis(0),
        }
    }

    /// Rebuilds the machine from the store. Every sandbox that was not
    /// retired is probed: its connections died with the old process.
    pub fn restore(config: DispatchConfig, mint: Box<dyn Mint>, snapshot: Snapshot, now: Millis) -> (Self, Step) {
        let mut machine = Self::new(config, mint);
        let mut step = Step::default();
        let mut queued: Vec<&RunRecord> = snapshot.runs.iter().filter(|run| run.state == RunState::Queued).collect();
        queued.sort_by_key(|run| (run.submitted_at, run.id.clone()));
        machine.queue = queued.iter().map(|run| run.id.clone()).collect();
        machine.runs = snapshot.runs.into_iter().map(|run| (run.id.clone(), run)).collect();
        machine.credentials = snapshot.credentials.into_iter().map(|c| (c.id.clone(), c)).collect();
        machine.events_seen = snapshot.event_ids.into_iter().collect();
        machine.log_lengths = snapshot.log_lengths.into_iter().collect();
        for record in snapshot.sandboxes {
            if record.state != SandboxState::Retired {
                step.effects.push(Effect::Probe { sandbox_id: record.id.clone() });
            }
            let live =
                Live { record, heartbeat: None, run_token: None, launched_at: now, exited: false, ever_ready: false };
            machine.sandboxes.insert(live.record.id.clone(), live);
        }
        machine.dispatch_queued(now, &mut step);
        machine.top_up(now, &mut step);
        (machine, step)
    }

    // ---- queries ---------------------------------------------------------

    pub fn run(&self, run_id: &str) -> Option<&RunRecord> {
        self.runs.get(run_id)
    }

    pub fn runs(&self) -> impl Iterator<Item = &RunRecord> {
        self.runs.values()
    }

    pub fn sandbox(&self, sandbox_id: &str) -> Option<&SandboxRecord> {
        self.sandboxes.get(sandbox_id).map(|live| &live.record)
    }

    pub fn log_length(&self, run_id: &str) -> u64 {
        self.log_lengths.get(run_id).copied().unwrap_or(0)
    }

    pub fn sandbox_views(&self, now: Millis) -> Vec<SandboxView> {
        self.sandboxes
            .values()
            .map(|live| SandboxView {
                record: live.record.clone(),
                last_heartbeat_at: live.heartbeat.as_ref().map(|h| h.at),
                last_state: live.heartbeat.as_ref().map(|h| h.state),
                connected: self.standby_conns(&live.record.id).next().is_some()
                    || self.run_conns(&live.record.id).next().is_some(),
                candidate: self.is_candidate(now, live),
            })
            .collect()
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        let mut snapshot = MetricsSnapshot::default();
        for run in self.runs.values() {
            *snapshot.runs.entry((run.state, run.path())).or_default() += 1;
            for attempt in &run.attempts {
                if let (Some(sent), Some(started)) = (attempt.assignment_sent_at, attempt.started_at) {
                    snapshot.assignment_to_start_ms.push(started.since(sent));
                }
                if attempt.outcome == Some(AttemptOutcome::Requeued) {
                    snapshot.requeues += 1;
                }
            }
        }
        let mut standbys: HashSet<&str> = HashSet::new();
        for conn in self.conns.values().filter(|conn| conn.kind == CredentialKind::Standby) {
            standbys.insert(&conn.sandbox_id);
        }
        snapshot.connected_standbys = standbys.len() as u64;
        for live in self.sandboxes.values() {
            snapshot.reconnects += u64::from(live.record.connections.saturating_sub(1));
            snapshot.reconnects += u64::from(live.record.run_connections.saturating_sub(1));
            if live.record.state != SandboxState::Retired {
                snapshot.sandboxes_live += 1;
            }
        }
        snapshot
    }

    /// Who `token` is, or why it is refused. Rules: a token of a shape this
    /// server never mints, a wrong secret or a revoked credential is `401`;
    /// an unknown or retired standby credential is `410`.
    pub fn authenticate(&self, token: &str) -> Result<Admission, Refusal> {
        let parsed = credential::parse(token).ok_or(Refusal::Unauthorized)?;
        let Some(record) = self.credentials.get(parsed.id) else {
            return Err(match parsed.kind {
                CredentialKind::Standby => Refusal::Gone,
                CredentialKind::Run => Refusal::Unauthorized,
            });
        };
        if record.kind != parsed.kind || !record.hash.matches(token) {
            return Err(Refusal::Unauthorized);
        }
        match record.state {
            CredentialState::Active => {}
            CredentialState::Revoked => return Err(Refusal::Unauthorized),
            CredentialState::Retired => return Err(Refusal::Gone),
        }
        Ok(match (record.kind, &record.run_id, record.attempt) {
            (CredentialKind::Run, Some(run_id), Some(attempt)) => Admission::Run {
                sandbox_id: record.sandbox_id.clone(),
                run_id: run_id.clone(),
                attempt,
                credential_id: record.id.clone(),
            },
            (CredentialKind::Run, _, _) => return Err(Refusal::Unauthorized),
            (CredentialKind::Standby, _, _) => {
                Admission::Standby { sandbox_id: record.sandbox_id.clone(), credential_id: record.id.clone() }
            }
        })
    }

    // ---- user inputs -----------------------------------------------------

    /// Queues a run and dispatches it at once if it can be.
    pub fn submit(&mut self, now: Millis, run: Run, request: RunRequest) -> (Step, String) {
        let mut step = Step::default();
        let id = self.mint.id("exe");
        let record = RunRecord {
            id: id.clone(),
            submitted_at: now,
            state: RunState::Queued,
            fingerprint: run.workspace.as_ref().map(fingerprint),
            run,
            attempts: Vec::new(),
            exit_code: None,
            error: None,
            ended_at: None,
        };
        step.writes.push(Write::NewRun(Box::new(record.clone()), Box::new(request)));
        self.runs.insert(id.clone(), record);
        self.queue.push_back(id.clone());
        self.dispatch_queued(now, &mut step);
        (step, id)
    }

    /// Cancels a run. Before it starts: its credential is revoked first, the
    /// run never starts, its sandbox is told and retired. Once started: the
    /// sandbox is told and the run ends when the agent reports it.
    pub fn cancel(&mut self, now: Millis, run_id: &str) -> Result<(Step, RunState), CancelError> {
        let mut step = Step::default();
        let run = self.runs.get(run_id).ok_or_else(|| CancelError::NotFound(run_id.to_owned()))?;
        match run.state {
            RunState::Queued => {
                self.queue.retain(|queued| queued != run_id);
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
            }
            RunState::Committed | RunState::Confirmed => {
                let sandbox_id = self.fence(now, &mut step, run_id, AttemptOutcome::Cancelled, "cancelled".into());
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
                if let Some(sandbox_id) = sandbox_id {
                    let cancel = ServerMessage::Cancel(Cancel { execution_id: run_id.to_owned() });
                    self.retire_sandbox(
                        now,
                        &mut step,
                        &sandbox_id,
                        "its run was cancelled",
                        CredentialState::Retired,
                        Some(cancel),
                        self.config.linger,
                    );
                }
            }
            RunState::Running => {
                let sandbox_id = run.current().map(|attempt| attempt.sandbox_id.clone());
                self.update_run(&mut step, run_id, |run| run.state = RunState::Cancelling);
                if let Some(sandbox_id) = sandbox_id {
                    let conns: Vec<ConnId> = self.all_conns(&sandbox_id).collect();
                    for conn in conns {
                        let message = ServerMessage::Cancel(Cancel { execution_id: run_id.to_owned() });
                        step.effects.push(Effect::Send { conn, message });
                    }
                }
            }
            RunState::Cancelling | RunState::Cancelled => {}
            state @ (RunState::Exited | RunState::Failed) => {
                return Err(CancelError::Finished { run_id: run_id.to_owned(), state });
            }
        }
        let state = self.runs.get(run_id).map_or(RunState::Cancelled, |run| run.state);
        self.dispatch_queued(now, &mut step);
        self.top_up(now, &mut step);
        Ok((step, state))
    }

    // ---- control connections --------------------------------------------

    /// A connection was admitted with `credential_id` (checked again here:
    /// it may have been revoked between the upgrade and now).
    pub fn connected(&mut self, now: Millis, conn: ConnId, credential_id: &str, presented: &Secret) -> Step {
        let mut step = Step::default();
        let Some(credential) = self.credentials.get(credential_id).cloned() else {
            step.effects.push(Effect::Close { conn });
            return step;
        };
        if credential.state != CredentialState::Active {
            step.effects.push(Effect::Close { conn });
            return step;
        }
        let sandbox_id = credential.sandbox_id.clone();
        self.conns.insert(conn, Conn { sandbox_id: sandbox_id.clone(), kind: credential.kind });
        self.update_sandbox(&mut step, &sandbox_id, |record| match credential.kind {
            CredentialKind::Standby => record.connections += 1,
            CredentialKind::Run => record.run_connections += 1,
        });
        let Some(run_id) = self.sandboxes.get(&sandbox_id).and_then(|live| live.record.run_id.clone()) else {
            return step;
        };
        match credential.kind {
            CredentialKind::Standby => {
                let unconfirmed = self.runs.get(&run_id).is_some_and(|run| {
                    run.state.is_pre_start() && run.current().is_some_and(|a| a.delivery_confirmed_at.is_none())
                });
                if unconfirmed {
                    self.send_assignment(&mut step, conn, &run_id);
                }
            }
            CredentialKind::Run => {
                let unconfirmed = self.runs.get(&run_id).is_some_and(|run| {
                    run.state == RunState::Committed && run.current().is_some_and(|a| a.delivery_confirmed_at.is_none())
                });
                if unconfirmed {
                    self.confirm(now, &mut step, &run_id, &sandbox_id);
                }
                if let Some(run) = self.runs.get(&run_id) {
                    let message = ServerMessage::Assignment(Assignment {
                        execution_id: run_id.clone(),
                        run_credential: presented.clone(),
                        run: run.run.clone(),
                    });
                    step.effects.push(Effect::Send { conn, message });
                }
            }
        }
        step
    }

    /// Delivery confirmed: the standby credential is revoked (written
    /// before the replay goes out) and the standby connections closed.
    fn confirm(&mut self, now: Millis, step: &mut Step, run_id: &str, sandbox_id: &str) {
        if let Some(credential_id) = self.sandboxes.get(sandbox_id).map(|l| l.record.standby_credential_id.clone()) {
            self.set_credential(step, &credential_id, CredentialState::Revoked);
        }
        self.update_run(step, run_id, |run| {
            run.state = RunState::Confirmed;
            if let Some(attempt) = run.current_mut() {
                attempt.delivery_confirmed_at = Some(now);
            }
        });
        if let Some(live) = self.sandboxes.get_mut(sandbox_id) {
            live.run_token = None;
        }
        let standby: Vec<ConnId> = self.standby_conns(sandbox_id).collect();
        for conn in standby {
            step.effects.push(Effect::Close { conn });
        }
    }

    /// Sends the assignment of `run_id` on a standby connection, minting a
    /// new run credential if the plaintext was lost in a restart.
    fn send_assignment(&mut self, step: &mut Step, conn: ConnId, run_id: &str) {
        let Some(sandbox_id) = self.runs.get(run_id).and_then(|run| run.current()).map(|a| a.sandbox_id.clone()) else {
            return;
        };
        let token = match self.sandboxes.get(&sandbox_id).and_then(|live| live.run_token.clone()) {
            Some(token) => token,
            None => self.rotate_run_credential(step, run_id, &sandbox_id),
        };
        if let Some(run) = self.runs.get(run_id) {
            let message = ServerMessage::Assignment(Assignment {
                execution_id: run_id.to_owned(),
                run_credential: token,
                run: run.run.clone(),
            });
            step.effects.push(Effect::Send { conn, message });
        }
    }

    fn rotate_run_credential(&mut self, step: &mut Step, run_id: &str, sandbox_id: &str) -> Secret {
        let old = self.runs.get(run_id).and_then(|run| run.current()).map(|a| a.credential_id.clone());
        if let Some(old) = old {
            self.set_credential(step, &old, CredentialState::Revoked);
        }
        let number = self.runs.get(run_id).and_then(|run| run.current()).map_or(1, |a| a.number);
        let (credential_id, token) = self.new_credential(step, CredentialKind::Run, sandbox_id, Some((run_id, number)));
        self.update_run(step, run_id, |run| {
            if let Some(attempt) = run.current_mut() {
                attempt.credential_id = credential_id;
            }
        });
        if let Some(live) = self.sandboxes.get_mut(sandbox_id) {
            live.run_token = Some(token.clone());
        }
        token
    }

    pub fn disconnected(&mut self, conn: ConnId) {
        self.conns.remove(&conn);
    }

    /// The writer put an assignment on the wire.
    pub fn assignment_sent(&mut self, now: Millis, run_id: &str) -> Step {
        let mut step = Step::default();
        let unsent =
            self.runs.get(run_id).and_then(|run| run.current()).is_some_and(|a| a.assignment_sent_at.is_none());
        if unsent {
            self.update_run(&mut step, run_id, |run| {
                if let Some(attempt) = run.current_mut() {
                    attempt.assignment_sent_at = Some(now);
                }
            });
        }
        step
    }

    pub fn heartbeat(&mut self, now: Millis, conn: ConnId, state: AgentState) -> Step {
        let mut step = Step::default();
        let Some(sandbox_id) = self.conns.get(&conn).map(|c| c.sandbox_id.clone()) else {
            return step;
        };
        let Some(live) = self.sandboxes.get_mut(&sandbox_id) else {
            return step;
        };
        live.heartbeat = Some(Heartbeat { at: now, state });
        if state == AgentState::Ready {
            live.ever_ready = true;
            if live.record.kind == SandboxKind::Warm {
                self.pool_failures = 0;
            }
            if live.record.state == SandboxState::Standby {
                self.dispatch_queued(now, &mut step);
            }
        }
        step
    }

    // ---- execution calls ---------------------------------------------------

    /// A lifecycle event from the agent holding the run credential of
    /// `attempt`. Duplicates (same `event_id`) are acknowledged and ignored.
    pub fn event(&mut self, now: Millis, run_id: &str, attempt: u32, event: Event) -> Step {
        let mut step = Step::default();
        let key = (run_id.to_owned(), event.event_id.clone());
        if self.events_seen.contains(&key) {
            return step;
        }
        self.events_seen.insert(key);
        step.writes.push(Write::Event(Box::new(StoredEvent {
            run_id: run_id.to_owned(),
            attempt,
            received_at: now,
            event: event.clone(),
        })));
        let Some(run) = self.runs.get(run_id) else {
            return step;
        };
        let current = run.current().is_some_and(|a| a.number == attempt);
        let state = run.state;
        let sandbox_id = run.current().map(|a| a.sandbox_id.clone());
        if !current || state.is_terminal() {
            tracing::debug!(run_id, attempt, "event for a finished run or a past attempt recorded only");
            return step;
        }
        match event.kind {
            EventKind::Started => {
                self.update_run(&mut step, run_id, |run| {
                    if run.state.is_pre_start() {
                        run.state = RunState::Running;
                    }
                    if let Some(attempt) = run.current_mut() {
                        attempt.started_at.get_or_insert(now);
                    }
                });
            }
            EventKind::Exited { code } => {
                self.end_run(now, &mut step, run_id, RunState::Exited, Some(code), None);
                self.finish_attempt(now, &mut step, run_id, AttemptOutcome::Finished, format!("exited {code}"));
                if let Some(sandbox_id) = sandbox_id {
                    self.retire_sandbox(
                        now,
                        &mut step,
                        &sandbox_id,
                        "its run finished",
                        CredentialState::Retired,
                        None,
                        self.config.linger,
                    );
                }
            }
            EventKind::Cancelled => {
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
                let outcome = if state.is_pre_start() { AttemptOutcome::Cancelled } else { AttemptOutcome::Finished };
                self.finish_attempt(now, &mut step, run_id, outcome, "cancelled".into());
                if let Some(sandbox_id) = sandbox_id {
                    self.retire_sandbox(
                        now,
                        &mut step,
                        &sandbox_id,
                        "its run was cancelled",
                        CredentialState::Retired,
                        None,
                        self.config.linger,
                    );
                }
            }
            EventKind::InstallFailed { requeueable, stage, message } if state.is_pre_start() => {
                let reason = format!("install failed at {stage}: {message}");
                self.release(now, &mut step, run_id, requeueable, reason, false, self.config.linger);
            }
            EventKind::InstallFailed { .. } => {
                tracing::warn!(run_id, "install_failed after the run started ignored");
            }
        }
        self.dispatch_queued(now, &mut step);
        self.top_up(now, &mut step);
        step
    }

    /// A chunk of the run's log. A chunk that repeats bytes already received
    /// adds only what is new (a retried chunk is stored once); one that
    /// starts past the end is a gap.
    pub fn log(&mut self, run_id: &str, offset: u64, data: &[u8]) -> Result<(Step, u64), LogError> {
        let mut step = Step::default();
        let received = self.log_length(run_id);
        if offset > received {
            return Err(LogError::Gap { offset, received });
        }
        let end = offset + data.len() as u64;
        if end > received {
            let skip = usize::try_from(received - offset).unwrap_or(usize::MAX);
            let fresh = data.get(skip..).unwrap_or_default().to_vec();
            step.writes.push(Write::Log { run_id: run_id.to_owned(), offset: received, data: fresh });
            self.log_lengths.insert(run_id.to_owned(), end);
            return Ok((step, end));
        }
        Ok((step, received))
    }

    // ---- provider reports and time -----------------------------------------

    /// The sandbox's agent process ended.
    pub fn sandbox_exited(&mut self, now: Millis, sandbox_id: &str, code: Option<i32>) -> Step {
        let mut step = Step::default();
        let Some(live) = self.sandboxes.get_mut(sandbox_id) else {
            return step;
        };
        live.exited = true;
        let ever_ready = live.ever_ready;
        let kind = live.record.kind;
        let state = live.record.state;
        let run_id = live.record.run_id.clone();
        if self.draining {
            // The server is stopping its own sandboxes: their state stays as
            // it is, to be probed and resumed by the next start.
            self.update_sandbox(&mut step, sandbox_id, |record| record.exit_code = code);
            return step;
        }
        let reason = describe_exit(code);
        self.sandbox_lost(now, &mut step, sandbox_id, state, run_id, &reason);
        self.update_sandbox(&mut step, sandbox_id, |record| record.exit_code = code);
        if kind == SandboxKind::Warm && state == SandboxState::Standby && !ever_ready {
            self.pool_failed(now);
        }
        self.dispatch_queued(now, &mut step);
        self.top_up(now, &mut step);
        step
    }

    /// A sandbox can no longer serve: retire it, and write off its run if
    /// the run had not started, or fail it if it had.
    fn sandbox_lost(
        &mut self,
        now: Millis,
        step: &mut Step,
        sandbox_id: &str,
        state: SandboxState,
        run_id: Option<String>,
        reason: &str,
    ) {
        match (state, run_id) {
            (SandboxState::Retired, _) => {}
            (SandboxState::Assigned, Some(run_id)) => {
                let run_state = self.runs.get(&run_id).map(|run| run.state);
                let on_this = self
                    .runs
                    .get(&run_id)
                    .and_then(|run| run.current())
                    .is_some_and(|attempt| attempt.sandbox_id == sandbox_id);
                match run_state {
                    Some(s) if s.is_pre_start() && on_this => {
                        let when = if s == RunState::Committed {
                            "before delivery was confirmed"
                        } else {
                            "before the run started"
                        };
                        let why = format!("sandbox {sandbox_id} written off {when}: {reason}");
                        self.release(now, step, &run_id, true, why, true, Duration::ZERO);
                    }
                    Some(RunState::Running | RunState::Cancelling) if on_this => {
                        let error = format!("sandbox {sandbox_id} ended without reporting the run's end: {reason}");
                        self.end_run(now, step, &run_id, RunState::Failed, None, Some(error.clone()));
                        self.finish_attempt(now, step, &run_id, AttemptOutcome::Finished, error);
                        self.retire_sandbox(
                            now,
                            step,
                            sandbox_id,
                            reason,
                            CredentialState::Retired,
                            None,
                            Duration::ZERO,
                        );
                    }
                    _ => {
                        self.retire_sandbox(
                            now,
                            step,
                            sandbox_id,
                            reason,
                            CredentialState::Retired,
                            None,
                            Duration::ZERO,
                        );
                    }
                }
            }
            _ => {
                self.retire_sandbox(now, step, sandbox_id, reason, CredentialState::Retired, None, Duration::ZERO);
            }
        }
    }

    /// Launching a sandbox failed.
    pub fn launch_failed(&mut self, now: Millis, sandbox_id: &str, error: &str) -> Step {
        let mut step = Step::default();
        let Some(live) = self.sandboxes.get(sandbox_id) else {
            return step;
        };
        let (state, run_id, kind) = (live.record.state, live.record.run_id.clone(), live.record.kind);
        let reason = format!("launch failed: {error}");
        self.sandbox_lost(now, &mut step, sandbox_id, state, run_id, &reason);
        if kind == SandboxKind::Warm {
            self.pool_failed(now);
        }
        self.dispatch_queued(now, &mut step);
        self.top_up(now, &mut step);
        step
    }

    /// What the provider found of a sandbox after a restart. A stopped
    /// standby is started again (its workspace is kept, so its agent skips
    /// the clone and setup) with a new standby credential: only the hash
    /// of the old one was kept. A sandbox that held a run is written off.
    pub fn probed(&mut self, now: Millis, sandbox_id: &str, found: Found) -> Step {
        let mut step = Step::default();
        let Some(live) = self.sandboxes.get(sandbox_id) else {
            return step;
        };
        let (state, run_id) = (live.record.state, live.record.run_id.clone());
        match (found, state) {
            (Found::Running, _) | (_, SandboxState::Retired) => {}
            (Found::Stopped, SandboxState::Standby) if !self.draining => {
                let old = live.record.standby_credential_id.clone();
                self.set_credential(&mut step, &old, CredentialState::Revoked);
                let (credential_id, token) = self.new_credential(&mut step, CredentialKind::Standby, sandbox_id, None);
                self.update_sandbox(&mut step, sandbox_id, |record| {
                    record.standby_credential_id = credential_id;
                    record.exit_code = None;
                });
                if let Some(live) = self.sandboxes.get_mut(sandbox_id) {
                    live.launched_at = now;
                    live.exited = false;
                }
                step.effects.push(Effect::Launch { sandbox_id: sandbox_id.to_owned(), token, create: false });
            }
            (Found::Stopped | Found::Missing, _) => {
                let reason = if found == Found::Missing {
                    "the sandbox was missing after a server restart"
                } else {
                    "the sandbox stopped while the server was down"
                };
                self.sandbox_lost(now, &mut step, sandbox_id, state, run_id, reason);
            }
        }
        self.dispatch_queued(now, &mut step);
        self.top_up(now, &mut step);
        step
    }

    /// Time passed: write off silent committed sandboxes, retire silent
    /// standbys, refill the pool once its backoff expired.
    pub fn tick(&mut self, now: Millis) -> Step {
        let mut step = Step::default();
        if self.draining {
            return step;
        }
        let silence = self.config.silence();
        let mut lost = Vec::new();
        for live in self.sandboxes.values() {
            let record = &live.record;
            let connect_by = live.launched_at.plus(self.config.launch_timeout);
            let silent = match &live.heartbeat {
                Some(heartbeat) => now > heartbeat.at.plus(silence),
                None => now > connect_by,
            };
            match record.state {
                SandboxState::Retired => {}
                SandboxState::Standby if silent => {
                    lost.push((record.id.clone(), record.state, None, "no heartbeat within three intervals"));
                }
                SandboxState::Standby => {}
                SandboxState::Assigned => {
                    let unconfirmed = record.run_id.as_ref().and_then(|id| self.runs.get(id)).is_some_and(|run| {
                        run.state == RunState::Committed && run.current().is_some_and(|a| a.sandbox_id == record.id)
                    });
                    let committed_at = record
                        .run_id
                        .as_ref()
                        .and_then(|id| self.runs.get(id))
                        .and_then(|run| run.current())
                        .map_or(Millis(0), |a| a.committed_at);
                    let silent = match &live.heartbeat {
                        Some(heartbeat) => now > heartbeat.at.max(committed_at).plus(silence),
                        None => now > connect_by.max(committed_at.plus(self.config.launch_timeout)),
                    };
                    if unconfirmed && silent {
                        lost.push((record.id.clone(), record.state, record.run_id.clone(), "stopped heartbeating"));
                    }
                }
            }
        }
        for (sandbox_id, state, run_id, reason) in lost {
            if state == SandboxState::Standby {
                self.retire_sandbox(
                    now,
                    &mut step,
                    &sandbox_id,
                    reason,
                    CredentialState::Retired,
                    Some(ServerMessage::Retired(Retired { reason: Some(reason.into()) })),
                    Duration::ZERO,
                );
            } else {
                self.sandbox_lost(now, &mut step, &sandbox_id, state, run_id, reason);
            }
        }
        self.dispatch_queued(now, &mut step);
        self.top_up(now, &mut step);
        step
    }

    /// The server is stopping: nothing new is dispatched or launched, and
    /// exits of the sandboxes it stops change no state.
    pub fn shutdown(&mut self) {
        self.draining = true;
    }

    // ---- dispatch ------------------------------------------------------------

    fn is_candidate(&self, now: Millis, live: &Live) -> bool {
        live.record.kind == SandboxKind::Warm
            && live.record.state == SandboxState::Standby
            && !live.exited
            && live
                .heartbeat
                .as_ref()
                .is_some_and(|h| h.state == AgentState::Ready && now <= h.at.plus(self.config.silence()))
            && self.standby_conns(&live.record.id).next().is_some()
    }

    fn candidate(&self, now: Millis) -> Option<String> {
        self.sandboxes
            .values()
            .filter(|live| self.is_candidate(now, live))
            .min_by_key(|live| (live.record.created_at, live.record.id.clone()))
            .map(|live| live.record.id.clone())
    }

    fn dispatch_queued(&mut self, now: Millis, step: &mut Step) {
        if self.draining {
            return;
        }
        while let Some(run_id) = self.queue.pop_front() {
            let Some(run) = self.runs.get(&run_id) else { continue };
            if run.state != RunState::Queued {
                continue;
            }
            let warm = if run.had_warm_attempt() { None } else { self.candidate(now) };
            match warm {
                Some(sandbox_id) => {
                    self.commit(now, step, &run_id, &sandbox_id, RunPath::Warm);
                    let standby: Vec<ConnId> = self.standby_conns(&sandbox_id).collect();
                    for conn in standby {
                        self.send_assignment(step, conn, &run_id);
                    }
                }
                None => self.commit_cold(now, step, &run_id),
            }
        }
    }

    /// Binds `run_id` to `sandbox_id` with a new run credential. The caller
    /// tells the sandbox after this, in effects that follow these writes.
    fn commit(&mut self, now: Millis, step: &mut Step, run_id: &str, sandbox_id: &str, path: RunPath) {
        let number = self.runs.get(run_id).map_or(1, |run| run.attempts.len() as u32 + 1);
        let (credential_id, token) = self.new_credential(step, CredentialKind::Run, sandbox_id, Some((run_id, number)));
        self.update_run(step, run_id, |run| {
            run.state = RunState::Committed;
            run.attempts.push(Attempt {
                number,
                sandbox_id: sandbox_id.to_owned(),
                path,
                credential_id,
                committed_at: now,
                assignment_sent_at: None,
                delivery_confirmed_at: None,
                started_at: None,
                ended_at: None,
                outcome: None,
                reason: None,
            });
        });
        self.update_sandbox(step, sandbox_id, |record| {
            record.state = SandboxState::Assigned;
            record.run_id = Some(run_id.to_owned());
        });
        if let Some(live) = self.sandboxes.get_mut(sandbox_id) {
            live.run_token = Some(token);
        }
    }

    /// Creates a sandbox for `run_id`, prepared with the run's workspace
    /// (the pool's when it names none), binds the run to it, then launches
    /// it: the assignment is waiting before its agent ever connects.
    fn commit_cold(&mut self, now: Millis, step: &mut Step, run_id: &str) {
        let Some(run) = self.runs.get(run_id) else { return };
        let workspace = run.run.workspace.clone();
        let fingerprint = run.fingerprint.clone().unwrap_or_else(|| self.config.pool_fingerprint.clone());
        let (sandbox_id, token) = self.create_sandbox(now, step, SandboxKind::Cold, workspace, fingerprint);
        self.commit(now, step, run_id, &sandbox_id, RunPath::Cold);
        step.effects.push(Effect::Launch { sandbox_id, token, create: true });
    }

    fn create_sandbox(
        &mut self,
        now: Millis,
        step: &mut Step,
        kind: SandboxKind,
        workspace: Option<standby_protocol::Workspace>,
        fingerprint: Fingerprint,
    ) -> (String, Secret) {
        let sandbox_id = self.mint.id("sbx");
        let (credential_id, token) = self.new_credential(step, CredentialKind::Standby, &sandbox_id, None);
        let record = SandboxRecord {
            id: sandbox_id.clone(),
            kind,
            state: SandboxState::Standby,
            created_at: now,
            standby_credential_id: credential_id,
            workspace,
            fingerprint,
            run_id: None,
            connections: 0,
            run_connections: 0,
            retired_at: None,
            retire_reason: None,
            exit_code: None,
        };
        step.writes.push(Write::Sandbox(Box::new(record.clone())));
        let live =
            Live { record, heartbeat: None, run_token: None, launched_at: now, exited: false, ever_ready: false };
        self.sandboxes.insert(sandbox_id.clone(), live);
        (sandbox_id, token)
    }

    /// Keeps `pool_size` warm standbys with no run, unless a run of launch
    /// failures put the pool in backoff.
    fn top_up(&mut self, now: Millis, step: &mut Step) {
        if self.draining || now < self.pool_backoff_until {
            return;
        }
        let live = self
            .sandboxes
            .values()
            .filter(|l| l.record.kind == SandboxKind::Warm && l.record.state == SandboxState::Standby && !l.exited)
            .count();
        for _ in live..self.config.pool_size {
            let fingerprint = self.config.pool_fingerprint.clone();
            let (sandbox_id, token) = self.create_sandbox(now, step, SandboxKind::Warm, None, fingerprint);
            step.effects.push(Effect::Launch { sandbox_id, token, create: true });
        }
    }

    fn pool_failed(&mut self, now: Millis) {
        self.pool_failures = self.pool_failures.saturating_add(1);
        let exponent = self.pool_failures.saturating_sub(1).min(6);
        let delay = Duration::from_secs(1u64 << exponent).min(Duration::from_secs(60));
        self.pool_backoff_until = now.plus(delay);
    }

    // ---- releasing runs and sandboxes -----------------------------------------

    /// Fencing: revokes the current attempt's run credential (first among
    /// the step's writes that follow) and ends the attempt. Returns the
    /// attempt's sandbox.
    fn fence(
        &mut self,
        now: Millis,
        step: &mut Step,
        run_id: &str,
        outcome: AttemptOutcome,
        reason: String,
    ) -> Option<String> {
        let attempt = self.runs.get(run_id).and_then(|run| run.current()).cloned()?;
        self.set_credential(step, &attempt.credential_id, CredentialState::Revoked);
        if let Some(live) = self.sandboxes.get_mut(&attempt.sandbox_id) {
            live.run_token = None;
        }
        self.finish_attempt(now, step, run_id, outcome, reason);
        Some(attempt.sandbox_id)
    }

    /// Releases a run that did not start from its sandbox: fence, retire
    /// the sandbox, then requeue the run while attempts remain (and it is
    /// worth it), or fail it.
    #[allow(clippy::too_many_arguments)]
    fn release(
        &mut self,
        now: Millis,
        step: &mut Step,
        run_id: &str,
        requeueable: bool,
        reason: String,
        written_off: bool,
        linger: Duration,
    ) {
        let attempts = self.runs.get(run_id).map_or(0, |run| run.attempts.len() as u32);
        let requeue = requeueable && attempts < self.config.max_attempts;
        let outcome = if requeue { AttemptOutcome::Requeued } else { AttemptOutcome::Failed };
        let Some(sandbox_id) = self.fence(now, step, run_id, outcome, reason.clone()) else {
            return;
        };
        // A written-off sandbox may still hold its standby credential: revoke
        // it, so the sandbox can never come back as a standby either.
        let standby_state = if written_off { CredentialState::Revoked } else { CredentialState::Retired };
        let retire_reason = if written_off { "written off" } else { "its run was released" };
        self.retire_sandbox(now, step, &sandbox_id, retire_reason, standby_state, None, linger);
        if written_off {
            let conns: Vec<ConnId> = self.all_conns(&sandbox_id).collect();
            for conn in conns {
                step.effects.push(Effect::Close { conn });
            }
        }
        if requeue {
            self.update_run(step, run_id, |run| run.state = RunState::Queued);
            self.queue.push_back(run_id.to_owned());
        } else {
            let error = if requeueable { format!("gave up after {attempts} attempts; last: {reason}") } else { reason };
            self.end_run(now, step, run_id, RunState::Failed, None, Some(error));
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn retire_sandbox(
        &mut self,
        now: Millis,
        step: &mut Step,
        sandbox_id: &str,
        reason: &str,
        standby_state: CredentialState,
        notify: Option<ServerMessage>,
        linger: Duration,
    ) {
        let Some(live) = self.sandboxes.get(sandbox_id) else { return };
        if live.record.state == SandboxState::Retired {
            return;
        }
        let credential_id = live.record.standby_credential_id.clone();
        if self.credentials.get(&credential_id).is_some_and(|c| c.state == CredentialState::Active) {
            self.set_credential(step, &credential_id, standby_state);
        }
        self.update_sandbox(step, sandbox_id, |record| {
            record.state = SandboxState::Retired;
            record.retired_at = Some(now);
            record.retire_reason = Some(reason.to_owned());
        });
        if let Some(message) = notify {
            let conns: Vec<ConnId> = self.all_conns(sandbox_id).collect();
            for conn in conns {
                step.effects.push(Effect::Send { conn, message: message.clone() });
            }
        }
        step.effects.push(Effect::Retire { sandbox_id: sandbox_id.to_owned(), linger });
    }

    fn finish_attempt(&mut self, now: Millis, step: &mut Step, run_id: &str, outcome: AttemptOutcome, reason: String) {
        self.update_run(step, run_id, |run| {
            if let Some(attempt) = run.current_mut()
                && attempt.outcome.is_none()
            {
                attempt.ended_at = Some(now);
                attempt.outcome = Some(outcome);
                attempt.reason = Some(reason);
            }
        });
    }

    fn end_run(
        &mut self,
        now: Millis,
        step: &mut Step,
        run_id: &str,
        state: RunState,
        exit_code: Option<i32>,
        error: Option<String>,
    ) {
        self.update_run(step, run_id, |run| {
            run.state = state;
            run.exit_code = exit_code;
            run.ended_at = Some(now);
            if state != RunState::Exited {
                run.error = error;
            }
        });
    }

    // ---- record helpers ------------------------------------------------------

    fn new_credential(
        &mut self,
        step: &mut Step,
        kind: CredentialKind,
        sandbox_id: &str,
        run: Option<(&str, u32)>,
    ) -> (String, Secret) {
        let (id, token) = self.mint.credential(kind);
        let record = CredentialRecord {
            id: id.clone(),
            kind,
            hash: TokenHash::of(token.expose()),
            sandbox_id: sandbox_id.to_owned(),
            run_id: run.map(|(run_id, _)| run_id.to_owned()),
            attempt: run.map(|(_, attempt)| attempt),
            state: CredentialState::Active,
        };
        step.writes.push(Write::Credential(Box::new(record.clone())));
        self.credentials.insert(id.clone(), record);
        (id, token)
    }

    fn set_credential(&mut self, step: &mut Step, credential_id: &str, state: CredentialState) {
        if let Some(record) = self.credentials.get_mut(credential_id)
            && record.state != state
        {
            record.state = state;
            step.writes.push(Write::Credential(Box::new(record.clone())));
        }
    }

    fn update_run(&mut self, step: &mut Step, run_id: &str, change: impl FnOnce(&mut RunRecord)) {
        if let Some(run) = self.runs.get_mut(run_id) {
            change(run);
            step.writes.push(Write::Run(Box::new(run.clone())));
        }
    }

    fn update_sandbox(&mut self, step: &mut Step, sandbox_id: &str, change: impl FnOnce(&mut SandboxRecord)) {
        if let Some(live) = self.sandboxes.get_mut(sandbox_id) {
            change(&mut live.record);
            step.writes.push(Write::Sandbox(Box::new(live.record.clone())));
        }
    }

    fn standby_conns<'a>(&'a self, sandbox_id: &'a str) -> impl Iterator<Item = ConnId> + 'a {
        self.conns
            .iter()
            .filter(move |(_, conn)| conn.sandbox_id == sandbox_id && conn.kind == CredentialKind::Standby)
            .map(|(id, _)| *id)
    }

    fn run_conns<'a>(&'a self, sandbox_id: &'a str) -> impl Iterator<Item = ConnId> + 'a {
        self.conns
            .iter()
            .filter(move |(_, conn)| conn.sandbox_id == sandbox_id && conn.kind == CredentialKind::Run)
            .map(|(id, _)| *id)
    }

    fn all_conns<'a>(&'a self, sandbox_id: &'a str) -> impl Iterator<Item = ConnId> + 'a {
        let mut conns: Vec<ConnId> =
            self.conns.iter().filter(move |(_, conn)| conn.sandbox_id == sandbox_id).map(|(id, _)| *id).collect();
        conns.sort_unstable();
        conns.into_iter()
    }
}

#[cfg(test)]
mod tests;
