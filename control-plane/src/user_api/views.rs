//! What the user API answers with: the records as the API shows them. Each
//! is the type the handler serialises and the schema the OpenAPI document
//! gives for it (`user_api::openapi`), so the two cannot drift.

use serde::Serialize;
use utoipa::ToSchema;

use crate::model::{
    Attempt, AttemptOutcome, Holder, Millis, ParkMode, Resume, RunPath, RunRecord, RunState, SandboxKind, SandboxState,
    StoredEvent, ThreadRecord,
};
use crate::provider::Details;
use crate::rules::LiveSandbox;

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct AttemptView {
    #[schema(minimum = 1)]
    number: u32,
    sandbox_id: String,
    path: RunPath,
    #[schema(format = DateTime)]
    committed_at: String,
    #[schema(format = DateTime)]
    assignment_sent_at: Option<String>,
    #[schema(format = DateTime)]
    delivery_confirmed_at: Option<String>,
    #[schema(format = DateTime)]
    started_at: Option<String>,
    #[schema(format = DateTime)]
    ended_at: Option<String>,
    outcome: Option<AttemptOutcome>,
    reason: Option<String>,
}

impl From<&Attempt> for AttemptView {
    fn from(attempt: &Attempt) -> Self {
        Self {
            number: attempt.number,
            sandbox_id: attempt.sandbox_id.clone(),
            path: attempt.path,
            committed_at: attempt.committed_at.rfc3339(),
            assignment_sent_at: attempt.assignment_sent_at.map(Millis::rfc3339),
            delivery_confirmed_at: attempt.delivery_confirmed_at.map(Millis::rfc3339),
            started_at: attempt.started_at.map(Millis::rfc3339),
            ended_at: attempt.ended_at.map(Millis::rfc3339),
            outcome: attempt.outcome,
            reason: attempt.reason.clone(),
        }
    }
}

/// The run's timeline: the submission, then its latest attempt.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Timestamps {
    #[schema(format = DateTime)]
    submitted: String,
    #[schema(format = DateTime)]
    committed: Option<String>,
    #[schema(format = DateTime)]
    assignment_sent: Option<String>,
    #[schema(format = DateTime)]
    delivery_confirmed: Option<String>,
    #[schema(format = DateTime)]
    started: Option<String>,
    #[schema(format = DateTime)]
    exited: Option<String>,
    #[schema(format = DateTime)]
    ended: Option<String>,
}

/// Submit to start, and its parts, in milliseconds.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Durations {
    submit_to_start: Option<u64>,
    /// Submitted → committed to the attempt that ran (earlier attempts included).
    queued: Option<u64>,
    commit_to_assignment_sent: Option<u64>,
    assignment_sent_to_delivery_confirmed: Option<u64>,
    delivery_confirmed_to_started: Option<u64>,
    /// A follow-up turn's resume: claimed → its sandbox's agent ready.
    resume: Option<u64>,
}

/// Why a run is `waiting`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct WaitView {
    reason: String,
    #[schema(format = DateTime)]
    since: String,
}

/// A follow-up turn's resume of its thread's kept sandbox.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ResumeView {
    sandbox_id: String,
    from: ParkMode,
    #[schema(format = DateTime)]
    began_at: String,
    #[schema(format = DateTime)]
    ready_at: Option<String>,
    /// Why the resume was given up and the run placed like a new one.
    fallback: Option<String>,
}

impl From<&Resume> for ResumeView {
    fn from(resume: &Resume) -> Self {
        Self {
            sandbox_id: resume.sandbox_id.clone(),
            from: resume.from,
            began_at: resume.began_at.rfc3339(),
            ready_at: resume.ready_at.map(Millis::rfc3339),
            fallback: resume.fallback.clone(),
        }
    }
}

/// A run (`POST /v1/runs`, `GET /v1/runs/{id}`, the list's items).
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Run)]
pub(crate) struct RunView {
    #[schema(pattern = "^exe_")]
    id: String,
    state: RunState,
    /// How its latest attempt was placed.
    path: Option<RunPath>,
    #[schema(min_items = 1)]
    command: Vec<String>,
    thread_id: Option<String>,
    /// Why it is `waiting`.
    wait: Option<WaitView>,
    resume: Option<ResumeView>,
    attempts: Vec<AttemptView>,
    exit_code: Option<i32>,
    error: Option<String>,
    /// Whether the log holds all of the run's output, by its agent's final
    /// event (contract 1.1 note 10); `null` until the run has ended, and
    /// when it ended without that event.
    log_complete: Option<bool>,
    /// Bytes of output the agent gave up on, dropped ones included (the
    /// log shows a marker where a gap is known); `null` when none were.
    #[schema(minimum = 1)]
    log_lost_bytes: Option<u64>,
    timestamps: Timestamps,
    durations_ms: Durations,
}

fn span(from: Option<Millis>, to: Option<Millis>) -> Option<u64> {
    Some(to?.since(from?))
}

pub(crate) fn view(run: &RunRecord) -> RunView {
    let current = run.current();
    let at = |f: fn(&Attempt) -> Option<Millis>| current.and_then(f);
    let committed = current.map(|a| a.committed_at);
    let sent = at(|a| a.assignment_sent_at);
    let confirmed = at(|a| a.delivery_confirmed_at);
    let started = at(|a| a.started_at);
    RunView {
        id: run.id.clone(),
        state: run.state,
        path: run.path(),
        command: run.run.command.clone(),
        thread_id: run.thread_id.clone(),
        wait: run
            .wait
            .as_ref()
            .filter(|_| run.state == RunState::Waiting)
            .map(|wait| WaitView { reason: wait.reason.clone(), since: wait.since.rfc3339() }),
        resume: run.resume.as_ref().map(ResumeView::from),
        attempts: run.attempts.iter().map(AttemptView::from).collect(),
        exit_code: run.exit_code,
        error: run.error.clone(),
        log_complete: run.log_lost.map(|lost| lost == 0),
        log_lost_bytes: run.log_lost.filter(|&lost| lost > 0),
        timestamps: Timestamps {
            submitted: run.submitted_at.rfc3339(),
            committed: committed.map(Millis::rfc3339),
            assignment_sent: sent.map(Millis::rfc3339),
            delivery_confirmed: confirmed.map(Millis::rfc3339),
            started: started.map(Millis::rfc3339),
            exited: run.ended_at.filter(|_| run.state == RunState::Exited).map(Millis::rfc3339),
            ended: run.ended_at.map(Millis::rfc3339),
        },
        durations_ms: Durations {
            submit_to_start: span(Some(run.submitted_at), started),
            queued: span(Some(run.submitted_at), committed),
            commit_to_assignment_sent: span(committed, sent),
            assignment_sent_to_delivery_confirmed: span(sent, confirmed),
            delivery_confirmed_to_started: span(confirmed, started),
            resume: run.resume.as_ref().and_then(|resume| span(Some(resume.began_at), resume.ready_at)),
        },
    }
}

/// A page of runs, oldest submission first.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct RunsPage {
    pub runs: Vec<RunView>,
    /// Pass as `cursor` for the next page; `null` on the last.
    pub next_cursor: Option<String>,
}

/// An event a run's agent reported.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct EventView {
    #[schema(minimum = 1)]
    attempt: u32,
    #[schema(format = DateTime)]
    received_at: String,
    /// The event as the agent sent it (the contract's `Event`).
    #[schema(schema_with = super::openapi::event_schema)]
    event: standby_protocol::Event,
}

impl From<StoredEvent> for EventView {
    fn from(stored: StoredEvent) -> Self {
        Self { attempt: stored.attempt, received_at: stored.received_at.rfc3339(), event: stored.event }
    }
}

/// A page of a run's events, in arrival order.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct EventsPage {
    pub events: Vec<EventView>,
    /// Pass as `cursor` for the next page; `null` on the last.
    pub next_cursor: Option<String>,
}

/// How a kept sandbox waits for its thread's next turn.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ParkView {
    mode: ParkMode,
    #[schema(format = DateTime)]
    since: String,
    /// End of the warm idle window (`running` only).
    #[schema(format = DateTime)]
    until: Option<String>,
}

/// A sandbox (`GET /v1/sandboxes`).
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Sandbox)]
pub(crate) struct SandboxView {
    id: String,
    kind: SandboxKind,
    state: SandboxState,
    run_id: Option<String>,
    #[schema(format = DateTime)]
    created_at: String,
    /// Its agent holds a control connection.
    connected: bool,
    /// It may be given the next run.
    candidate: bool,
    /// A process of it exists or is being started.
    running: bool,
    thread_id: Option<String>,
    park: Option<ParkView>,
    #[schema(format = DateTime)]
    expires_at: Option<String>,
    #[schema(format = DateTime)]
    deadline: Option<String>,
    auto_stop_minutes: Option<u32>,
    /// In a replicated deployment: the replica holding its agent's last
    /// control connection, and the leader's epoch that recorded it.
    held_by: Option<Holder>,
    #[schema(format = DateTime)]
    last_heartbeat_at: Option<String>,
    /// The agent's state in its last heartbeat (the contract's `AgentState`).
    #[schema(schema_with = super::openapi::agent_state_schema)]
    last_state: Option<standby_protocol::AgentState>,
    connections: u32,
    run_connections: u32,
    /// The workspace fingerprint it prepared.
    #[schema(value_type = String)]
    fingerprint: standby_protocol::Fingerprint,
    #[schema(format = DateTime)]
    retired_at: Option<String>,
    retire_reason: Option<String>,
    exit_code: Option<i32>,
    /// The provider's process id of its agent, where it has one.
    pid: Option<u32>,
    /// The provider's directory of it, where it has one.
    dir: Option<String>,
}

impl SandboxView {
    pub(crate) fn new(live: LiveSandbox, details: Details) -> Self {
        let record = live.record;
        Self {
            id: record.id,
            kind: record.kind,
            state: record.state,
            run_id: record.run_id,
            created_at: record.created_at.rfc3339(),
            connected: live.connected,
            candidate: live.candidate,
            running: live.running,
            thread_id: record.thread_id,
            park: record.park.map(|park| ParkView {
                mode: park.mode,
                since: park.since.rfc3339(),
                until: park.until.map(Millis::rfc3339),
            }),
            expires_at: record.expires_at.map(Millis::rfc3339),
            deadline: record.deadline.map(Millis::rfc3339),
            auto_stop_minutes: record.auto_stop_minutes,
            held_by: record.held_by.clone(),
            last_heartbeat_at: live.last_heartbeat_at.map(Millis::rfc3339),
            last_state: live.last_state,
            connections: record.connections,
            run_connections: record.run_connections,
            fingerprint: record.fingerprint,
            retired_at: record.retired_at.map(Millis::rfc3339),
            retire_reason: record.retire_reason,
            exit_code: record.exit_code,
            pid: details.pid,
            dir: details.dir.map(|dir| dir.display().to_string()),
        }
    }
}

/// A page of sandboxes, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SandboxesPage {
    pub sandboxes: Vec<SandboxView>,
    /// Pass as `cursor` for the next page; `null` on the last.
    pub next_cursor: Option<String>,
}

/// A thread's pointer to the sandbox kept for it (`GET /v1/threads/{id}`).
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Thread)]
pub(crate) struct ThreadView {
    id: String,
    /// Bumped by every move of the pointer.
    generation: u64,
    /// The sandbox kept for the thread.
    sandbox_id: Option<String>,
    /// The turn holding the thread: the next turn waits until it ends.
    holder: Option<String>,
    #[schema(format = DateTime)]
    updated_at: String,
}

impl From<ThreadRecord> for ThreadView {
    fn from(thread: ThreadRecord) -> Self {
        Self {
            id: thread.id,
            generation: thread.generation,
            sandbox_id: thread.sandbox_id,
            holder: thread.holder,
            updated_at: thread.updated_at.rfc3339(),
        }
    }
}
