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
//!   requeued the same way. One that exits after confirmation, before
//!   `started` arrives, may have started the run: the run fails (at most
//!   once).
//!
//! The warm pool's policy (in [`pool`] and [`threads`]):
//! - Sandboxes that cost compute (a process exists or is being started:
//!   standbys, busy ones, parked-running ones, retired ones not yet gone)
//!   never exceed the running cap. A run that needs a new one at the cap
//!   waits in order (`waiting`), and the oldest parked-running sandbox is
//!   stopped (or released) to make room.
//! - Standbys have a TTL: from a jittered point a replacement is made, and
//!   the old one is retired once the replacement is ready (or at 95% of
//!   its TTL at the latest).
//! - A turn of a thread keeps its sandbox for the thread's next turn:
//!   parked running (Tier 2: a fresh agent, until the warm idle window
//!   ends) or parked stopped (Tier 1: provider stopped, filesystem kept).
//!   The next turn resumes it and is bound only once its agent is ready;
//!   a resume that fails places the run like a new one, with the reason
//!   recorded. Turns of one thread take the sandbox one at a time, through
//!   a pointer written compare-and-set.

mod admission;
mod bounds;
mod pool;
mod threads;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::Duration;

use standby_protocol::{
    AgentState, Assignment, Cancel, Event, EventKind, ExitCode, Fingerprint, Retired, Run, Secret, ServerMessage,
    fingerprint,
};

use crate::credential::{CredentialKind, Mint, TokenHash};
use crate::model::{
    Attempt, AttemptOutcome, CredentialRecord, CredentialState, Millis, ParkMode, RunPath, RunRecord, RunRequest,
    RunState, SandboxKind, SandboxRecord, SandboxState, StoredEvent, ThreadRecord,
};
use crate::policy::AutoStop;

pub use admission::Call;
pub use bounds::{Evicted, LogLedger, MAX_EVENTS_PER_RUN, RunBounds};
pub use threads::StalePointer;

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
    /// The pool spec's workspace: what an assignment names for a run
    /// that names none (amendment 1).
    pub pool_workspace: standby_protocol::Workspace,
    /// Fingerprint of the pool spec's workspace.
    pub pool_fingerprint: Fingerprint,
    pub pool_policy: PoolPolicy,
    /// What one run may cost: its log cap, its time in memory once finished.
    pub bounds: RunBounds,
}

/// The pool policy and the thread tiers.
#[derive(Debug, Clone)]
pub struct PoolPolicy {
    /// Most sandboxes costing compute at once; `0`: no cap.
    pub running_cap: usize,
    /// A standby is replaced within this; zero: never.
    pub standby_ttl: Duration,
    /// Tier 2: how long a thread's sandbox stays running after a turn;
    /// zero: not at all.
    pub warm_idle: Duration,
    /// Tier 1: a thread's sandbox is kept stopped (after the warm idle
    /// window, or at once); otherwise it is released.
    pub park_stopped: bool,
    /// The provider's idle auto-stop, floored for sandboxes kept warm.
    pub auto_stop: AutoStop,
    /// How long a resumed sandbox's agent may take to be ready.
    pub resume_timeout: Duration,
}

impl Default for PoolPolicy {
    fn default() -> Self {
        Self {
            running_cap: 0,
            standby_ttl: Duration::ZERO,
            warm_idle: Duration::from_secs(300),
            park_stopped: true,
            auto_stop: AutoStop::default(),
            resume_timeout: Duration::from_secs(60),
        }
    }
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
    /// Bytes of a run's log at stream `offset` (possibly none: a gap or
    /// bytes over the cap), and its ledger after them.
    Log {
        run_id: String,
        offset: u64,
        data: Vec<u8>,
        ledger: LogLedger,
    },
    /// The thread pointer, written only if the stored one still has
    /// generation `expected` (`0`: none stored yet).
    Thread {
        record: Box<ThreadRecord>,
        expected: u64,
    },
}

/// Something the driver does after the step's writes are durable.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Send a frame on a control connection (dropped if it is gone).
    Send { conn: ConnId, message: ServerMessage },
    /// Close a control connection after the frames queued before it.
    Close { conn: ConnId },
    /// Launch the agent of a sandbox with its standby credential, creating
    /// the sandbox first when `create` (with the provider auto-stop
    /// `auto_stop`, in provider minutes).
    Launch { sandbox_id: String, token: Secret, create: bool, auto_stop: u32 },
    /// Let the sandbox exit on its own for up to `linger`, then stop it and
    /// delete it.
    Retire { sandbox_id: String, linger: Duration },
    /// Ask the provider what became of a sandbox (after a restart).
    Probe { sandbox_id: String },
    /// A turn ended and its sandbox is kept: let its agent exit on its own
    /// for up to `linger` (stop it then), make sure no process is left,
    /// and set the provider auto-stop (best effort).
    Park { sandbox_id: String, linger: Duration, auto_stop: u32 },
    /// Stop the sandbox's processes and keep its filesystem (Tier 1).
    Stop { sandbox_id: String },
    /// Make a kept sandbox run again: read its provider state, start it if
    /// stopped or archived, raise a shorter auto-stop (bounded, best
    /// effort), launch a fresh agent with `token`. Failures come back as
    /// [`Dispatch::resume_failed`].
    Resume { sandbox_id: String, token: Secret, auto_stop: u32 },
    /// The sandbox is busy (preparing, installing or running): the
    /// provider's idle auto-stop clock starts over.
    Touch { sandbox_id: String },
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
    /// `410`: a run credential whose run is over (or, after a cancel, used
    /// for anything but the run's events and log).
    #[error("the run is over: its run credential is withdrawn")]
    Ended,
    /// `409`: a control socket upgrade with a credential whose socket is
    /// live; that socket counts as gone after `retry_after` unless it is
    /// heard from again.
    #[error("a live control connection already uses this credential")]
    Duplicate { retry_after: Duration },
}

impl Refusal {
    /// The contract's refusal this is, which the agent reads from its
    /// status; `None` for a second socket, which refuses the connection,
    /// not the credential.
    pub const fn contract(self) -> Option<standby_protocol::Refusal> {
        match self {
            Self::Gone | Self::Ended => Some(standby_protocol::Refusal::Gone),
            Self::Unauthorized => Some(standby_protocol::Refusal::Unauthorized),
            Self::Duplicate { .. } => None,
        }
    }

    /// The HTTP status the server answers with.
    pub fn status(self) -> axum::http::StatusCode {
        use axum::http::StatusCode;
        match self.contract() {
            // The contract's statuses are valid ones: the fallback is never taken.
            Some(refusal) => StatusCode::from_u16(refusal.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            None => StatusCode::CONFLICT,
        }
    }
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
    /// The chunk starts past the end of what was received, other than
    /// after exactly the gap it declares (`409` with `received`).
    #[error(
        "log chunk at offset {offset} (after {dropped} dropped bytes) does not follow the {received} bytes received"
    )]
    Conflict { offset: u64, dropped: u64, received: u64 },
}

/// What a provider says about a sandbox after a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Running,
    /// Exists but its agent is not running: it can be started again.
    Stopped,
    /// Stopped long enough that the provider packed it away; it can be
    /// started again, more slowly.
    Archived,
    Missing,
}

/// What the store holds, to rebuild the machine after a restart.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub runs: Vec<RunRecord>,
    pub sandboxes: Vec<SandboxRecord>,
    pub credentials: Vec<CredentialRecord>,
    /// `(run_id, event_id)` of every event received by the runs loaded.
    pub event_ids: Vec<(String, String)>,
    /// The log ledger of each run loaded that has one.
    pub logs: Vec<(String, LogLedger)>,
    /// Finished runs, which are not loaded: how many, by state and path.
    pub finished: Vec<((RunState, Option<RunPath>), u64)>,
    pub threads: Vec<ThreadRecord>,
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
    /// Its agent process is not running (and none is being started): it
    /// costs no compute.
    exited: bool,
    ever_ready: bool,
    /// Start it again ([`Effect::Resume`]) once its current agent exits.
    resume_after_exit: bool,
    /// Its agent fetched its spec (with the standby credential).
    spec_served: bool,
    /// An assignment waits for [`Live::may_assign`].
    assignment_withheld: bool,
    /// Its open connections (keys of `Dispatch::conns`), oldest first:
    /// finding a sandbox's connections must not cost all of them, since
    /// every dispatch asks each standby whether it is connected.
    conns: BTreeSet<ConnId>,
}

impl Live {
    fn new(record: SandboxRecord, now: Millis, exited: bool) -> Self {
        Self {
            record,
            heartbeat: None,
            run_token: None,
            launched_at: now,
            exited,
            ever_ready: false,
            resume_after_exit: false,
            spec_served: false,
            assignment_withheld: false,
            conns: BTreeSet::new(),
        }
    }

    /// Whether its agent may be told its assignment on a standby
    /// connection: once the agent has its spec (fetched, or it says it is
    /// past preparing). Telling it earlier starts delivery confirmation,
    /// which revokes the standby credential, while the agent may still be
    /// fetching its spec with it: that fetch would be refused and the agent
    /// would never finish preparing.
    fn may_assign(&self) -> bool {
        self.spec_served
            || self.ever_ready
            || self.heartbeat.as_ref().is_some_and(|heartbeat| heartbeat.state != AgentState::Preparing)
    }

    fn park_mode(&self) -> Option<ParkMode> {
        self.record.park.as_ref().map(|park| park.mode)
    }
}

/// What became of a queued run in one dispatch.
#[derive(Debug)]
enum Placement {
    Placed,
    /// Not bound; `for_slot`: it needs a new running slot (and, when
    /// `cold_only`, cannot take a standby).
    Wait {
        reason: String,
        for_slot: bool,
        cold_only: bool,
    },
}

#[derive(Debug, Clone)]
struct Conn {
    sandbox_id: String,
    kind: CredentialKind,
    /// The credential it was admitted with: a kept sandbox gets a new
    /// standby credential per agent, and only the current agent's
    /// connections are its standby connections.
    credential_id: String,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone)]
pub struct SandboxView {
    pub record: SandboxRecord,
    pub last_heartbeat_at: Option<Millis>,
    pub last_state: Option<AgentState>,
    pub connected: bool,
    pub candidate: bool,
    /// A process of it exists or is being started: it counts against the
    /// running cap.
    pub running: bool,
}

/// Which sandboxes a page of [`Dispatch::sandbox_views`] holds.
#[derive(Debug, Clone, Default)]
pub struct SandboxPage {
    /// The last sandbox of the previous page (`created_at`, id).
    pub after: Option<(Millis, String)>,
    pub limit: usize,
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
    /// Sandboxes counting against the running cap.
    pub sandboxes_running: u64,
    pub running_cap: u64,
    pub parked_running: u64,
    pub parked_stopped: u64,
    /// Resumes of a parked sandbox given up for a fresh sandbox.
    pub resume_fallbacks: u64,
    /// Control socket upgrades refused because their credential had a
    /// live socket (since this process started).
    pub duplicate_connections_refused: u64,
    /// Assignment sent → started of the finished runs no longer in memory.
    pub assignment_to_start_past: crate::metrics::Histogram,
    /// Runs held in memory (the rest are only in the store).
    pub runs_in_memory: u64,
}

pub struct Dispatch {
    config: DispatchConfig,
    mint: Box<dyn Mint>,
    runs: BTreeMap<String, RunRecord>,
    queue: VecDeque<String>,
    sandboxes: BTreeMap<String, Live>,
    credentials: HashMap<String, CredentialRecord>,
    conns: HashMap<ConnId, Conn>,
    /// Event ids recorded, per run in memory.
    events_seen: HashMap<String, HashSet<String>>,
    logs: HashMap<String, LogLedger>,
    /// Finished runs no longer in memory, for `/metrics`.
    evicted: Evicted,
    draining: bool,
    /// Pool standbys in a row that ended without ever being ready.
    pool_failures: u32,
    pool_backoff_until: Millis,
    threads: BTreeMap<String, ThreadRecord>,
    /// Queued runs that need a new running slot and have none (as of the
    /// last dispatch), and how many of them cannot take a standby.
    blocked: usize,
    blocked_cold: usize,
    admissions: admission::Admissions,
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
            events_seen: HashMap::new(),
            logs: HashMap::new(),
            evicted: Evicted::default(),
            draining: false,
            pool_failures: 0,
            pool_backoff_until: Millis(0),
            threads: BTreeMap::new(),
            blocked: 0,
            blocked_cold: 0,
            admissions: admission::Admissions::default(),
        }
    }

    /// Rebuilds the machine from the store. Every sandbox that was not
    /// retired is probed: its connections died with the old process. A
    /// resume in progress is undone (the run queued again, the sandbox
    /// parked stopped), and parked-running sandboxes count as stopped: their
    /// agents went with the old process.
    pub fn restore(config: DispatchConfig, mint: Box<dyn Mint>, snapshot: Snapshot, now: Millis) -> (Self, Step) {
        let mut machine = Self::new(config, mint);
        let mut step = Step::default();
        let mut queued: Vec<&RunRecord> = snapshot.runs.iter().filter(|run| run.state.is_unbound()).collect();
        queued.sort_by_key(|run| (run.submitted_at, run.id.clone()));
        machine.queue = queued.iter().map(|run| run.id.clone()).collect();
        machine.runs = snapshot.runs.into_iter().map(|run| (run.id.clone(), run)).collect();
        machine.credentials = snapshot.credentials.into_iter().map(|c| (c.id.clone(), c)).collect();
        for (run_id, event_id) in snapshot.event_ids {
            machine.events_seen.entry(run_id).or_default().insert(event_id);
        }
        machine.logs = snapshot.logs.into_iter().collect();
        machine.evicted.runs = snapshot.finished.into_iter().collect();
        machine.threads = snapshot.threads.into_iter().map(|t| (t.id.clone(), t)).collect();
        let resuming: Vec<String> =
            machine.runs.values().filter(|run| run.state == RunState::Resuming).map(|run| run.id.clone()).collect();
        for run_id in resuming {
            machine.update_run(&mut step, &run_id, |run| run.state = RunState::Queued);
        }
        for record in snapshot.sandboxes {
            let retired = record.state == SandboxState::Retired;
            if !retired {
                step.effects.push(Effect::Probe { sandbox_id: record.id.clone() });
            }
            let id = record.id.clone();
            machine.sandboxes.insert(id.clone(), Live::new(record, now, retired));
            let state = machine.sandboxes.get(&id).map(|live| live.record.state);
            let running = machine.sandboxes.get(&id).and_then(Live::park_mode) == Some(ParkMode::Running);
            if state == Some(SandboxState::Resuming) || running {
                machine.update_sandbox(&mut step, &id, |record| {
                    record.state = SandboxState::Parked;
                    record.run_id = None;
                    record.park = Some(crate::model::Park { mode: ParkMode::Stopped, since: now, until: None });
                });
            }
        }
        machine.repair_credentials(now, &mut step);
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

    /// Every sandbox.
    pub fn sandbox_views(&self, now: Millis) -> Vec<SandboxView> {
        self.sandbox_page(now, &SandboxPage { after: None, limit: usize::MAX })
    }

    /// A page of sandboxes in creation order (`created_at`, then id).
    pub fn sandbox_page(&self, now: Millis, page: &SandboxPage) -> Vec<SandboxView> {
        let mut lives: Vec<&Live> = self
            .sandboxes
            .values()
            .filter(|live| {
                page.after.as_ref().is_none_or(|(at, id)| (live.record.created_at, &live.record.id) > (*at, id))
            })
            .collect();
        lives.sort_by(|a, b| (a.record.created_at, &a.record.id).cmp(&(b.record.created_at, &b.record.id)));
        lives.truncate(page.limit);
        lives
            .into_iter()
            .map(|live| SandboxView {
                record: live.record.clone(),
                last_heartbeat_at: live.heartbeat.as_ref().map(|h| h.at),
                last_state: live.heartbeat.as_ref().map(|h| h.state),
                connected: self.live_standby_conns(live).next().is_some() || self.run_conns(live).next().is_some(),
                candidate: self.is_candidate(now, live),
                running: !live.exited,
            })
            .collect()
    }

    pub fn thread(&self, thread_id: &str) -> Option<&ThreadRecord> {
        self.threads.get(thread_id)
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
            if !live.exited {
                snapshot.sandboxes_running += 1;
            }
            if live.record.state == SandboxState::Parked {
                match live.park_mode() {
                    Some(ParkMode::Running) => snapshot.parked_running += 1,
                    Some(ParkMode::Stopped) => snapshot.parked_stopped += 1,
                    None => {}
                }
            }
        }
        snapshot.resume_fallbacks =
            self.runs.values().filter(|run| run.resume.as_ref().is_some_and(|r| r.fallback.is_some())).count() as u64;
        for (key, count) in &self.evicted.runs {
            *snapshot.runs.entry(*key).or_default() += count;
        }
        snapshot.assignment_to_start_past = self.evicted.assignment_to_start.clone();
        snapshot.requeues += self.evicted.requeues;
        snapshot.resume_fallbacks += self.evicted.resume_fallbacks;
        snapshot.runs_in_memory = self.runs.len() as u64;
        snapshot.running_cap = self.config.pool_policy.running_cap as u64;
        snapshot.duplicate_connections_refused = self.admissions.duplicates_refused;
        snapshot
    }

    /// Who `token` is, or why it is refused, for anything but a run's
    /// events and log (see [`Dispatch::check`]).
    pub fn authenticate(&self, token: &str) -> Result<Admission, Refusal> {
        self.check(token, Call::Fetch)
    }

    // ---- user inputs -----------------------------------------------------

    /// Queues a run and dispatches it at once if it can be.
    pub fn submit(&mut self, now: Millis, run: Run, request: RunRequest) -> (Step, String) {
        self.submit_turn(now, run, request, None)
    }

    /// Queues a run, as a turn of `thread_id` when given, and dispatches it
    /// at once if it can be.
    pub fn submit_turn(
        &mut self,
        now: Millis,
        run: Run,
        request: RunRequest,
        thread_id: Option<String>,
    ) -> (Step, String) {
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
            thread_id,
            thread_generation: None,
            wait: None,
            resume: None,
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
            RunState::Queued | RunState::Waiting => {
                self.queue.retain(|queued| queued != run_id);
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
            }
            RunState::Resuming => {
                self.queue.retain(|queued| queued != run_id);
                self.unclaim_resume(now, &mut step, run_id);
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
            }
            RunState::Committed | RunState::Confirmed => {
                // The agent may still report the run's end (amendment 8).
                let sandbox_id =
                    self.fence(now, &mut step, run_id, AttemptOutcome::Cancelled, "cancelled".into(), true);
                if let Some(sandbox_id) = sandbox_id {
                    let cancel = ServerMessage::Cancel(Cancel { execution_id: run_id.to_owned() });
                    let conns: Vec<ConnId> = self.all_conns(&sandbox_id).collect();
                    for conn in conns {
                        step.effects.push(Effect::Send { conn, message: cancel.clone() });
                    }
                    // The agent never starts the run and exits: a thread's
                    // sandbox is kept all the same, with the files of the
                    // turns before.
                    self.end_turn(now, &mut step, run_id, &sandbox_id, "its run was cancelled");
                }
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
            }
            RunState::Running => {
                let sandbox_id = run.current().map(|attempt| attempt.sandbox_id.clone());
                self.update_run(&mut step, run_id, |run| run.state = RunState::Cancelling);
                self.begin_grace(&mut step, run_id);
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
        if credential.state != CredentialState::Active || !self.holds_socket(conn, credential_id) {
            step.effects.push(Effect::Close { conn });
            return step;
        }
        self.socket_heard(now, conn, credential_id);
        let sandbox_id = credential.sandbox_id.clone();
        self.conns.insert(
            conn,
            Conn { sandbox_id: sandbox_id.clone(), kind: credential.kind, credential_id: credential_id.to_owned() },
        );
        if let Some(live) = self.sandboxes.get_mut(&sandbox_id) {
            live.conns.insert(conn);
        }
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
                let may_assign = self.sandboxes.get(&sandbox_id).is_some_and(Live::may_assign);
                if unconfirmed && may_assign {
                    self.send_assignment(&mut step, conn, &run_id);
                } else if unconfirmed && let Some(live) = self.sandboxes.get_mut(&sandbox_id) {
                    live.assignment_withheld = true;
                }
            }
            CredentialKind::Run => {
                let unconfirmed = self.runs.get(&run_id).is_some_and(|run| {
                    run.state == RunState::Committed && run.current().is_some_and(|a| a.delivery_confirmed_at.is_none())
                });
                if unconfirmed {
                    self.confirm(now, &mut step, &run_id, &sandbox_id);
                }
                if let Some(message) = self.assignment(&run_id, presented.clone()) {
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
        if let Some(message) = self.assignment(run_id, token) {
            step.effects.push(Effect::Send { conn, message });
        }
    }

    /// The assignment frame of `run_id`. It always names the workspace the
    /// run expects (amendment 1): the run's own, else the one its sandbox
    /// was prepared with, which for a pool standby is the pool spec's.
    fn assignment(&self, run_id: &str, run_credential: Secret) -> Option<ServerMessage> {
        let record = self.runs.get(run_id)?;
        let mut run = record.run.clone();
        if run.workspace.is_none() {
            let prepared = record
                .current()
                .and_then(|attempt| self.sandboxes.get(&attempt.sandbox_id))
                .and_then(|live| live.record.workspace.clone());
            run.workspace = Some(prepared.unwrap_or_else(|| self.config.pool_workspace.clone()));
        }
        Some(ServerMessage::Assignment(Assignment { execution_id: run_id.to_owned(), run_credential, run }))
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

    /// The sandbox's agent was served its spec: a withheld assignment can
    /// go out now.
    pub fn spec_served(&mut self, sandbox_id: &str) -> Step {
        let mut step = Step::default();
        let Some(live) = self.sandboxes.get_mut(sandbox_id) else { return step };
        live.spec_served = true;
        if live.assignment_withheld {
            self.send_withheld(&mut step, sandbox_id);
        }
        step
    }

    fn send_withheld(&mut self, step: &mut Step, sandbox_id: &str) {
        let Some(live) = self.sandboxes.get_mut(sandbox_id) else { return };
        live.assignment_withheld = false;
        let Some(run_id) = live.record.run_id.clone() else { return };
        let unconfirmed = self.runs.get(&run_id).is_some_and(|run| {
            run.state == RunState::Committed
                && run.current().is_some_and(|a| a.sandbox_id == sandbox_id && a.delivery_confirmed_at.is_none())
        });
        if unconfirmed {
            let standby: Vec<ConnId> = self.standby_conns(sandbox_id).collect();
            for conn in standby {
                self.send_assignment(step, conn, &run_id);
            }
        }
    }

    pub fn disconnected(&mut self, conn: ConnId) {
        let Some(gone) = self.conns.remove(&conn) else {
            self.socket_closed(conn, None);
            return;
        };
        self.socket_closed(conn, Some(&gone.credential_id));
        if let Some(live) = self.sandboxes.get_mut(&gone.sandbox_id) {
            live.conns.remove(&conn);
        }
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
        let Some((sandbox_id, credential_id)) =
            self.conns.get(&conn).map(|c| (c.sandbox_id.clone(), c.credential_id.clone()))
        else {
            return step;
        };
        if !self.credential_usable(&credential_id) {
            // Withdrawn: its socket is being closed; it speaks for no one.
            return step;
        }
        self.socket_heard(now, conn, &credential_id);
        let Some(live) = self.sandboxes.get(&sandbox_id) else {
            return step;
        };
        let was_candidate = self.is_candidate(now, live);
        let Some(live) = self.sandboxes.get_mut(&sandbox_id) else {
            return step;
        };
        live.heartbeat = Some(Heartbeat { at: now, state });
        if live.assignment_withheld && live.may_assign() {
            self.send_withheld(&mut step, &sandbox_id);
        }
        let Some(live) = self.sandboxes.get_mut(&sandbox_id) else {
            return step;
        };
        if state == AgentState::Ready {
            live.ever_ready = true;
            if live.record.kind == SandboxKind::Warm && live.record.state == SandboxState::Standby {
                self.pool_failures = 0;
            }
            match live.record.state {
                SandboxState::Standby => {
                    self.dispatch_queued(now, &mut step);
                    // A new candidate may let an expired standby go; a
                    // candidate's routine heartbeat changes nothing the
                    // tick has not already weighed.
                    if !was_candidate {
                        self.expire_standbys(now, &mut step);
                    }
                }
                SandboxState::Resuming => self.resumed_ready(now, &mut step, &sandbox_id),
                _ => {}
            }
        } else {
            step.effects.push(Effect::Touch { sandbox_id });
        }
        step
    }

    // ---- execution calls ---------------------------------------------------

    /// A lifecycle event from the agent holding the run credential of
    /// `attempt`. Duplicates (same `event_id`) are acknowledged and ignored.
    fn record_event(&mut self, now: Millis, run_id: &str, attempt: u32, event: Event) -> Step {
        let mut step = Step::default();
        if !self.runs.contains_key(run_id) {
            tracing::debug!(run_id, "event for a run not in memory acknowledged and dropped");
            return step;
        }
        if self.event_seen(run_id, &event.event_id) {
            return step;
        }
        if self.remember_event(run_id, &event.event_id) {
            step.writes.push(Write::Event(Box::new(StoredEvent {
                run_id: run_id.to_owned(),
                attempt,
                received_at: now,
                event: event.clone(),
            })));
        } else {
            tracing::warn!(run_id, "a run's event past its event bound acts but is not recorded");
        }
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
                self.finish_attempt(now, &mut step, run_id, AttemptOutcome::Finished, format!("exited {code}"));
                if let Some(sandbox_id) = sandbox_id {
                    self.end_turn(now, &mut step, run_id, &sandbox_id, "its run finished");
                }
                self.end_run(now, &mut step, run_id, RunState::Exited, Some(code), None);
            }
            EventKind::Cancelled => {
                let outcome = if state.is_pre_start() { AttemptOutcome::Cancelled } else { AttemptOutcome::Finished };
                self.finish_attempt(now, &mut step, run_id, outcome, "cancelled".into());
                if let Some(sandbox_id) = sandbox_id {
                    self.end_turn(now, &mut step, run_id, &sandbox_id, "its run was cancelled");
                }
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
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

    // ---- provider reports and time -----------------------------------------

    /// The sandbox's agent process ended.
    pub fn sandbox_exited(&mut self, now: Millis, sandbox_id: &str, code: Option<i32>) -> Step {
        let mut step = Step::default();
        let Some(live) = self.sandboxes.get_mut(sandbox_id) else {
            return step;
        };
        if live.exited {
            // Already counted (a stop of a sandbox whose agent was gone).
            return step;
        }
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
        self.end_graces_of(&mut step, sandbox_id);
        let reason = ExitCode::describe(code);
        match state {
            SandboxState::Parked => self.parked_exited(now, &mut step, sandbox_id, &reason),
            SandboxState::Resuming => self.resuming_exited(now, &mut step, sandbox_id, &reason),
            _ => self.sandbox_lost(now, &mut step, sandbox_id, state, run_id, &reason),
        }
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
            (SandboxState::Resuming, _) => self.resume_fallback(now, step, sandbox_id, reason),
            (SandboxState::Assigned, Some(run_id)) => {
                let run_state = self.runs.get(&run_id).map(|run| run.state);
                let on_this = self
                    .runs
                    .get(&run_id)
                    .and_then(|run| run.current())
                    .is_some_and(|attempt| attempt.sandbox_id == sandbox_id);
                match run_state {
                    Some(RunState::Committed) if on_this => {
                        let why = format!("sandbox {sandbox_id} written off before delivery was confirmed: {reason}");
                        self.release(now, step, &run_id, true, why, true, Duration::ZERO);
                    }
                    // Once delivery is confirmed the agent may start the run
                    // at any moment, and reports `started` concurrently: its
                    // death cannot be told from one before the start. At most
                    // once: the run fails rather than run a second time.
                    Some(RunState::Confirmed) if on_this => {
                        let why = format!(
                            "sandbox {sandbox_id} ended after delivery was confirmed, before the run was reported \
                             started (it may have started it, so it is not run again): {reason}"
                        );
                        self.release(now, step, &run_id, false, why, true, Duration::ZERO);
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
        if let Some(live) = self.sandboxes.get_mut(sandbox_id) {
            live.exited = true;
        }
        self.sandbox_lost(now, &mut step, sandbox_id, state, run_id, &reason);
        if kind == SandboxKind::Warm && state == SandboxState::Standby {
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
        let Some(live) = self.sandboxes.get_mut(sandbox_id) else {
            return step;
        };
        if found != Found::Running {
            live.exited = true;
            self.end_graces_of(&mut step, sandbox_id);
        }
        let Some(live) = self.sandboxes.get_mut(sandbox_id) else {
            return step;
        };
        let (state, run_id) = (live.record.state, live.record.run_id.clone());
        let expired = live
            .record
            .deadline
            .is_some_and(|deadline| now >= crate::policy::retire_at(live.record.created_at, deadline));
        match (found, state) {
            (_, SandboxState::Retired) => {}
            (Found::Running, SandboxState::Parked | SandboxState::Resuming) => {
                // Not this process's agent: its exit would never be seen.
                // Stop it; the sandbox stays parked stopped.
                step.effects.push(Effect::Stop { sandbox_id: sandbox_id.to_owned() });
                live.exited = true;
            }
            (Found::Running, _) => {}
            (Found::Stopped | Found::Archived, SandboxState::Parked | SandboxState::Resuming) => {
                // A turn claimed it before the probe answered: start it now.
                if live.resume_after_exit && !self.draining {
                    self.emit_resume(now, &mut step, sandbox_id);
                }
            }
            (Found::Stopped, SandboxState::Standby) if !self.draining && !expired => {
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
                step.effects.push(Effect::Launch {
                    sandbox_id: sandbox_id.to_owned(),
                    token,
                    create: false,
                    auto_stop: 0,
                });
            }
            (Found::Stopped | Found::Archived | Found::Missing, _) => {
                let reason = match found {
                    Found::Missing => "the sandbox was missing after a server restart",
                    _ if expired => "its standby TTL ran out while the server was down",
                    _ => "the sandbox stopped while the server was down",
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
                SandboxState::Retired | SandboxState::Parked | SandboxState::Resuming => {}
                SandboxState::Standby if silent && !live.exited => {
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
        self.tick_threads(now, &mut step);
        self.expire_graces(now, &mut step);
        self.expire_standbys(now, &mut step);
        self.evict_finished(now);
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
            && self.live_standby_conns(live).next().is_some()
    }

    fn candidate(&self, now: Millis) -> Option<String> {
        self.sandboxes
            .values()
            .filter(|live| self.is_candidate(now, live))
            .min_by(|a, b| (a.record.created_at, &a.record.id).cmp(&(b.record.created_at, &b.record.id)))
            .map(|live| live.record.id.clone())
    }

    /// Places queued runs in order. A run that needs a new running slot at
    /// the cap waits, and so does every later run that needs one (they
    /// wait in order); later runs that need no new slot (a ready standby,
    /// their thread's running sandbox) go on. Then parked-running sandboxes
    /// (and, for runs that cannot take one, standbys) are stopped to make
    /// room for the runs that wait.
    fn dispatch_queued(&mut self, now: Millis, step: &mut Step) {
        if self.draining {
            return;
        }
        let queue = std::mem::take(&mut self.queue);
        let mut kept = VecDeque::new();
        let (mut blocked, mut blocked_cold) = (0, 0);
        for run_id in queue {
            let Some(run) = self.runs.get(&run_id) else { continue };
            if !matches!(run.state, RunState::Queued | RunState::Waiting) {
                continue;
            }
            match self.place(now, step, &run_id, blocked > 0) {
                Placement::Placed => {}
                Placement::Wait { reason, for_slot, cold_only } => {
                    if for_slot {
                        blocked += 1;
                        blocked_cold += usize::from(cold_only);
                    }
                    self.set_waiting(now, step, &run_id, reason, for_slot);
                    kept.push_back(run_id);
                }
            }
        }
        // Anything queued while placing comes after the runs already waiting.
        kept.extend(std::mem::take(&mut self.queue));
        self.queue = kept;
        self.blocked = blocked;
        self.blocked_cold = blocked_cold;
        self.make_room(now, step);
    }

    /// Binds `run_id` if it can be: to its thread's parked sandbox, a ready
    /// standby, or a new cold sandbox (given a running slot, and no earlier
    /// run waiting for one).
    fn place(&mut self, now: Millis, step: &mut Step, run_id: &str, behind_waiting: bool) -> Placement {
        let Some(run) = self.runs.get(run_id) else { return Placement::Placed };
        let prepared_before = run.had_prepared_attempt();
        if let Some(thread_id) = run.thread_id.clone() {
            if let Some(holder) = self.thread_busy(&thread_id, run_id) {
                let reason = format!("turn {holder} of thread {thread_id} holds the thread's sandbox");
                return Placement::Wait { reason, for_slot: false, cold_only: false };
            }
            if !prepared_before
                && let Some(placement) = self.place_on_thread(now, step, run_id, &thread_id, behind_waiting)
            {
                return placement;
            }
        }
        let warm = if prepared_before { None } else { self.candidate(now) };
        if let Some(sandbox_id) = warm {
            self.commit(now, step, run_id, &sandbox_id, RunPath::Warm);
            self.claim_thread(now, step, run_id, &sandbox_id);
            let standby: Vec<ConnId> = self.standby_conns(&sandbox_id).collect();
            for conn in standby {
                self.send_assignment(step, conn, run_id);
            }
            return Placement::Placed;
        }
        if behind_waiting || !self.slot_free() {
            return Placement::Wait { reason: self.cap_reason(), for_slot: true, cold_only: prepared_before };
        }
        if let Some(sandbox_id) = self.commit_cold(now, step, run_id) {
            self.claim_thread(now, step, run_id, &sandbox_id);
        }
        Placement::Placed
    }

    fn set_waiting(&mut self, now: Millis, step: &mut Step, run_id: &str, reason: String, for_slot: bool) {
        let unchanged = self
            .runs
            .get(run_id)
            .is_some_and(|run| run.state == RunState::Waiting && run.wait.as_ref().is_some_and(|w| w.reason == reason));
        if unchanged {
            return;
        }
        self.update_run(step, run_id, |run| {
            let since = run.wait.as_ref().filter(|_| run.state == RunState::Waiting).map_or(now, |w| w.since);
            run.state = RunState::Waiting;
            run.wait = Some(crate::model::Wait { reason, since, for_slot });
        });
    }

    /// Binds `run_id` to `sandbox_id` with a new run credential. The caller
    /// tells the sandbox after this, in effects that follow these writes.
    fn commit(&mut self, now: Millis, step: &mut Step, run_id: &str, sandbox_id: &str, path: RunPath) {
        let number = self.runs.get(run_id).map_or(1, |run| run.attempts.len() as u32 + 1);
        let (credential_id, token) = self.new_credential(step, CredentialKind::Run, sandbox_id, Some((run_id, number)));
        self.update_run(step, run_id, |run| {
            run.state = RunState::Committed;
            run.wait = None;
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
            record.park = None;
        });
        if let Some(live) = self.sandboxes.get_mut(sandbox_id) {
            live.run_token = Some(token);
        }
    }

    /// Creates a sandbox for `run_id`, prepared with the run's workspace
    /// (the pool's when it names none), binds the run to it, then launches
    /// it: the assignment is waiting before its agent ever connects.
    fn commit_cold(&mut self, now: Millis, step: &mut Step, run_id: &str) -> Option<String> {
        let run = self.runs.get(run_id)?;
        let workspace = run.run.workspace.clone();
        let fingerprint = run.fingerprint.clone().unwrap_or_else(|| self.config.pool_fingerprint.clone());
        let (sandbox_id, token) = self.create_sandbox(now, step, SandboxKind::Cold, workspace, fingerprint);
        let auto_stop = self.config.pool_policy.auto_stop.minutes;
        self.update_sandbox(step, &sandbox_id, |record| record.auto_stop_minutes = Some(auto_stop));
        self.commit(now, step, run_id, &sandbox_id, RunPath::Cold);
        step.effects.push(Effect::Launch { sandbox_id: sandbox_id.clone(), token, create: true, auto_stop });
        Some(sandbox_id)
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
            thread_id: None,
            park: None,
            expires_at: None,
            deadline: None,
            auto_stop_minutes: None,
        };
        step.writes.push(Write::Sandbox(Box::new(record.clone())));
        self.sandboxes.insert(sandbox_id.clone(), Live::new(record, now, false));
        (sandbox_id, token)
    }

    // ---- releasing runs and sandboxes -----------------------------------------

    /// Fencing: revokes the current attempt's run credential (first among
    /// the step's writes that follow), or with `grace` (a cancel) leaves it
    /// only the run's events and log, and ends the attempt. Returns the
    /// attempt's sandbox.
    fn fence(
        &mut self,
        now: Millis,
        step: &mut Step,
        run_id: &str,
        outcome: AttemptOutcome,
        reason: String,
        grace: bool,
    ) -> Option<String> {
        let attempt = self.runs.get(run_id).and_then(|run| run.current()).cloned()?;
        if grace {
            self.begin_grace(step, run_id);
        } else {
            self.withdraw(step, &attempt.credential_id, CredentialState::Revoked);
        }
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
        let Some(sandbox_id) = self.fence(now, step, run_id, outcome, reason.clone(), false) else {
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
        let thread_id = live.record.thread_id.clone();
        if self.credentials.get(&credential_id).is_some_and(|c| c.state == CredentialState::Active) {
            self.set_credential(step, &credential_id, standby_state);
        }
        self.update_sandbox(step, sandbox_id, |record| {
            record.state = SandboxState::Retired;
            record.retired_at = Some(now);
            record.retire_reason = Some(reason.to_owned());
            record.park = None;
        });
        if let Some(live) = self.sandboxes.get_mut(sandbox_id) {
            live.resume_after_exit = false;
        }
        if let Some(thread_id) = thread_id {
            self.forget_sandbox(now, step, &thread_id, sandbox_id);
        }
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
            run.wait = None;
            if state != RunState::Exited {
                run.error = error;
            }
        });
        self.withdraw_run(now, step, run_id, state);
        self.turn_over(now, step, run_id);
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

    /// Connections of the sandbox's current standby credential.
    fn standby_conns<'a>(&'a self, sandbox_id: &'a str) -> impl Iterator<Item = ConnId> + 'a {
        self.sandboxes.get(sandbox_id).into_iter().flat_map(|live| self.live_standby_conns(live))
    }

    fn live_standby_conns<'a>(&'a self, live: &'a Live) -> impl Iterator<Item = ConnId> + 'a {
        let current = live.record.standby_credential_id.as_str();
        self.live_conns(live)
            .filter(move |(_, conn)| conn.kind == CredentialKind::Standby && conn.credential_id == current)
            .map(|(id, _)| id)
    }

    fn run_conns<'a>(&'a self, live: &'a Live) -> impl Iterator<Item = ConnId> + 'a {
        self.live_conns(live).filter(|(_, conn)| conn.kind == CredentialKind::Run).map(|(id, _)| id)
    }

    /// Every connection of the sandbox, oldest first.
    fn all_conns<'a>(&'a self, sandbox_id: &'a str) -> impl Iterator<Item = ConnId> + 'a {
        self.sandboxes.get(sandbox_id).into_iter().flat_map(|live| live.conns.iter().copied())
    }

    fn live_conns<'a>(&'a self, live: &'a Live) -> impl Iterator<Item = (ConnId, &'a Conn)> + 'a {
        live.conns.iter().filter_map(|id| self.conns.get(id).map(|conn| (*id, conn)))
    }
}

#[cfg(test)]
mod tests;
