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
//! The warm pool's policy (in `pool`, `threads` and `resume`):
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
//!
//! Every input comes in through [`Rules::handle`] (`input`: the one
//! [`Input`] type and its [`Reply`]), which hands it to the rule of its
//! concern. One file per concern, each an `impl Rules` block over the
//! state below: `admission` (credentials, one socket each), `connections` (control
//! sockets, heartbeats, delivery), `runs` (submit, cancel, and how a run
//! ends), `events`, `logs`, `sandboxes` (launch, exit, loss, probes after
//! a restart), `ticks` (time passing), `placement` (binding queued runs),
//! `pool`, `threads` (the pointer, parking), `resume` (a follow-up turn on
//! a parked sandbox), `bounds` (what a run may cost), `idempotency` (a
//! retried submission answers the run it made) and `queries` (what the API
//! and `/metrics` read).

mod admission;
mod bounds;
mod connections;
mod events;
mod idempotency;
mod index;
mod input;
mod logs;
mod placement;
mod pool;
mod queries;
mod resume;
mod runs;
mod sandboxes;
pub mod snapshots;
mod threads;
mod ticks;
pub(crate) mod trace;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::Duration;

use standby_protocol::{AgentState, Fingerprint, Secret, ServerMessage};

use self::index::LiveSandboxes;
use crate::credential::{CredentialKind, Mint, TokenHash};
use crate::model::{
    CredentialRecord, CredentialState, IdempotencyRecord, Millis, Park, ParkMode, RunPath, RunRecord, RunRequest,
    RunState, SandboxRecord, SandboxState, StoredEvent, ThreadRecord,
};
use crate::policy::PoolPolicy;

pub use admission::{Admission, AdmissionRefusal, Call};
pub use bounds::{Evicted, MAX_EVENTS_PER_RUN, RunBounds};
pub use idempotency::{IdempotencyKey, KeyReused, Submitted};
pub use input::{Answer, Input, Reply};
pub use logs::{LogError, LogLedger};
pub use queries::{Histogram, LiveSandbox, LostRuns, MetricsSnapshot, Phase, SandboxCounts, SandboxPage, StartTimes};
pub use resume::{ResumeFailure, ResumeStart};
pub use runs::CancelError;
pub use threads::StalePointer;

/// Identifies one control connection, allocated by the driver.
pub type ConnId = u64;

/// How many heartbeat intervals may pass before a sandbox counts as silent.
pub const HEARTBEAT_WINDOW: u32 = 3;

#[derive(Debug, Clone)]
pub struct RulesConfig {
    /// The interval the agents are launched with.
    pub heartbeat_interval: Duration,
    /// Standbys kept ready.
    pub pool_size: usize,
    /// Attempts per execution, warm and cold together (at most one warm).
    pub max_attempts: u32,
    /// How long a launched sandbox may take to connect the first time.
    pub launch_timeout: Duration,
    /// How long a sandbox whose run's delivery was confirmed may go
    /// unheard before its agent is taken for dead. A live agent reconnects
    /// long before (its backoff is capped at 30 s); without this bound a run
    /// whose agent died where no provider reports exits (an adopted sandbox
    /// after a restart or a failover, the spool provider) stays running
    /// for good.
    pub run_silence: Duration,
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
    /// The provider makes sandboxes from snapshots of prepared ones
    /// ([`snapshots`]): the first ready standby of a fingerprint is
    /// snapshotted.
    pub snapshots: bool,
    /// Whether runs are traced (`--otlp-endpoint`): assignments carry a
    /// trace context and a started run is handed over as
    /// [`Effect::Traced`]. Off, neither is made.
    pub trace: bool,
}

impl RulesConfig {
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
    /// An `Idempotency-Key`, written with the run it made (replacing one
    /// past its window that no tick forgot yet).
    Idempotency(Box<IdempotencyRecord>),
    /// Forget the `Idempotency-Key`s made at or before `through`.
    ForgetIdempotency {
        through: Millis,
    },
}

/// Something the driver does after the step's writes are durable.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Send a frame on a control connection (dropped if it is gone).
    Send { conn: ConnId, message: ServerMessage },
    /// Close a control connection after the frames queued before it.
    Close { conn: ConnId },
    /// Launch the agent of a sandbox with its standby credential, after the
    /// provider has made the sandbox ready as `provision` says (with the
    /// provider auto-stop `auto_stop`, in provider minutes, when created).
    /// Its exit is reported with `credential_id` (the token's), so that a
    /// late notice of an earlier agent is told from this one's.
    /// `fingerprint` is what the sandbox prepares: a provider with a
    /// snapshot of it creates the sandbox from that.
    Launch {
        sandbox_id: String,
        credential_id: String,
        token: Secret,
        provision: Provision,
        auto_stop: u32,
        fingerprint: Fingerprint,
    },
    /// Keep the prepared sandbox's filesystem as the snapshot of
    /// `fingerprint` ([`snapshots`]); the answer comes back as
    /// [`Input::SnapshotTaken`]. The sandbox is placed nowhere meanwhile.
    Snapshot { sandbox_id: String, fingerprint: Fingerprint },
    /// Let the sandbox exit on its own for up to `linger`, then stop it and
    /// delete it.
    Retire { sandbox_id: String, linger: Duration },
    /// Ask the provider what became of a sandbox (after a restart). An agent
    /// found running was started by another process with standby
    /// credential `credential_id`: its exit is reported with it.
    Probe { sandbox_id: String, credential_id: String },
    /// A turn ended and its sandbox is kept: let its agent exit on its own
    /// for up to `linger` (stop it then), make sure no process is left,
    /// and set the provider auto-stop (best effort).
    /// `mode` says whether the sandbox stays running for the next turn
    /// (Tier 2: what the turn left is cleared) or is stopped (Tier 1).
    Park { sandbox_id: String, linger: Duration, auto_stop: u32, mode: ParkMode },
    /// Stop the sandbox's processes and keep its filesystem (Tier 1).
    Stop { sandbox_id: String },
    /// Make a kept sandbox run again, as [`ResumeStart::for_found`] says
    /// by its provider state, raise a shorter auto-stop (bounded, best
    /// effort), and launch a fresh agent with `token`. Failures come back
    /// as [`Rules::resume_failed`].
    Resume { sandbox_id: String, credential_id: String, token: Secret, auto_stop: u32 },
    /// The sandbox is busy (preparing, installing or running): the
    /// provider's idle auto-stop clock starts over.
    Touch { sandbox_id: String },
    /// The run started (its current attempt's `started_at` was just
    /// recorded): its spans are built from this record and exported. Only
    /// when [`RulesConfig::trace`] is on.
    Traced(Box<RunRecord>),
}

/// What the provider does before an agent is launched in a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provision {
    /// Create the sandbox (a new standby, or a cold sandbox for a run).
    Create,
    /// Start the existing sandbox again: its workspace is kept, so its
    /// agent skips the clone and setup.
    Start,
}

/// The outcome of one input.
#[derive(Debug, Default)]
pub struct Step {
    pub writes: Vec<Write>,
    pub effects: Vec<Effect>,
    /// For whoever asked, once the writes are committed.
    pub reply: Reply,
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
    /// The `Idempotency-Key`s still kept.
    pub idempotency: Vec<IdempotencyRecord>,
}

#[derive(Debug, Clone)]
struct Heartbeat {
    at: Millis,
    state: AgentState,
}

/// Whether a sandbox's agent process is running (or being started).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Agent {
    Running,
    /// Not running, and none is being started: the sandbox costs no
    /// compute.
    Exited,
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
    /// Its filesystem is being kept as a snapshot: no run is placed on it,
    /// and it is not silent (the provider pauses it for the commit).
    snapshotting: bool,
    /// When its snapshot's commit ended: its silence counts from then, not
    /// from its last heartbeat before the pause.
    snapshot_ended_at: Option<Millis>,
    /// Start it again ([`Effect::Resume`]) once its current agent exits.
    resume_after_exit: bool,
    /// Its agent fetched its spec (with the standby credential).
    spec_served: bool,
    /// An assignment waits for [`Live::may_assign`].
    assignment_withheld: bool,
    /// Its open connections (keys of `Rules::conns`), oldest first:
    /// finding a sandbox's connections must not cost all of them, since
    /// every dispatch asks each standby whether it is connected.
    conns: BTreeSet<ConnId>,
}

impl Live {
    fn new(record: SandboxRecord, now: Millis, agent: Agent) -> Self {
        Self {
            record,
            heartbeat: None,
            run_token: None,
            launched_at: now,
            exited: agent == Agent::Exited,
            ever_ready: false,
            snapshotting: false,
            snapshot_ended_at: None,
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

#[derive(Debug, Clone)]
struct Conn {
    sandbox_id: String,
    kind: CredentialKind,
    /// The credential it was admitted with: a kept sandbox gets a new
    /// standby credential per agent, and only the current agent's
    /// connections are its standby connections.
    credential_id: String,
}

pub struct Rules {
    config: RulesConfig,
    mint: Box<dyn Mint>,
    runs: BTreeMap<String, RunRecord>,
    queue: VecDeque<String>,
    sandboxes: LiveSandboxes,
    credentials: HashMap<String, CredentialRecord>,
    conns: HashMap<ConnId, Conn>,
    /// Event ids recorded, per run in memory.
    events_seen: HashMap<String, HashSet<String>>,
    logs: HashMap<String, LogLedger>,
    /// Finished runs no longer in memory, for `/metrics`.
    evicted: Evicted,
    /// Runs failed for a sandbox lost after their delivery (since this
    /// process started), for `/metrics`.
    lost: LostRuns,
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
    /// `Idempotency-Key`s of submissions within the window, by key.
    idempotency: HashMap<String, IdempotencyRecord>,
    snapshots: snapshots::Snapshots,
}

impl std::fmt::Debug for Rules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rules")
            .field("runs", &self.runs.len())
            .field("sandboxes", &self.sandboxes.len())
            .field("conns", &self.conns.len())
            .field("draining", &self.draining)
            .finish_non_exhaustive()
    }
}

impl Rules {
    pub fn new(config: RulesConfig, mint: Box<dyn Mint>) -> Self {
        Self {
            config,
            mint,
            runs: BTreeMap::new(),
            queue: VecDeque::new(),
            sandboxes: LiveSandboxes::default(),
            credentials: HashMap::new(),
            conns: HashMap::new(),
            events_seen: HashMap::new(),
            logs: HashMap::new(),
            evicted: Evicted::default(),
            lost: LostRuns::default(),
            draining: false,
            pool_failures: 0,
            pool_backoff_until: Millis(0),
            threads: BTreeMap::new(),
            blocked: 0,
            blocked_cold: 0,
            admissions: admission::Admissions::default(),
            idempotency: HashMap::new(),
            snapshots: snapshots::Snapshots::default(),
        }
    }

    /// Rebuilds the machine from the store. Every sandbox that was not
    /// retired is probed: its connections died with the old process. A
    /// resume in progress is undone (the run queued again, the sandbox
    /// parked stopped), and parked-running sandboxes count as stopped: their
    /// agents went with the old process.
    pub fn restore(config: RulesConfig, mint: Box<dyn Mint>, snapshot: Snapshot, now: Millis) -> (Self, Step) {
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
        machine.idempotency = snapshot.idempotency.into_iter().map(|k| (k.key.clone(), k)).collect();
        let resuming: Vec<String> =
            machine.runs.values().filter(|run| run.state == RunState::Resuming).map(|run| run.id.clone()).collect();
        for run_id in resuming {
            machine.update_run(&mut step, &run_id, |run| run.state = RunState::Queued);
        }
        for record in snapshot.sandboxes {
            let agent = if record.state == SandboxState::Retired {
                Agent::Exited
            } else {
                step.effects.push(Effect::Probe {
                    sandbox_id: record.id.clone(),
                    credential_id: record.standby_credential_id.clone(),
                });
                Agent::Running
            };
            let id = record.id.clone();
            machine.sandboxes.insert(id.clone(), Live::new(record, now, agent));
            let state = machine.sandboxes.get(&id).map(|live| live.record.state);
            let running = machine.sandboxes.get(&id).and_then(Live::park_mode) == Some(ParkMode::Running);
            if state == Some(SandboxState::Resuming) || running {
                machine.update_sandbox(&mut step, &id, |record| {
                    record.state = SandboxState::Parked;
                    record.run_id = None;
                    record.park = Some(Park { mode: ParkMode::Stopped, since: now, until: None });
                });
            }
        }
        machine.repair_credentials(now, &mut step);
        machine.place_and_top_up(now, &mut step);
        (machine, step)
    }

    /// The server is stopping: nothing new is dispatched or launched, and
    /// exits of the sandboxes it stops change no state.
    fn shutdown(&mut self) {
        self.draining = true;
    }

    /// The end of every input that may free a sandbox or a slot: queued
    /// runs are placed, then the pool is topped up with what room is left.
    fn place_and_top_up(&mut self, now: Millis, step: &mut Step) {
        self.dispatch_queued(now, step);
        self.top_up(now, step);
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
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            change(&mut live.record);
            step.writes.push(Write::Sandbox(Box::new(live.record.clone())));
        }
    }
}

#[cfg(test)]
mod tests;
