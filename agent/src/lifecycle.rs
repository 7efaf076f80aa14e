//! The agent's lifecycle as a pure state machine: inputs in, actions out.
//!
//! It does no IO and reads no clock (the caller passes `now`), so every
//! rule of the contract about what happens when is tested here without
//! sockets, processes or sleeps. [`crate::agent`] drives it: it turns socket
//! frames, process exits, signals and timers into [`Input`]s and carries out
//! the [`Action`]s.

use std::time::Duration;

use standby_protocol::{AgentState, Assignment, EventKind, Secret, ServerMessage};
use tokio::time::Instant;

use crate::exit::Exit;
use crate::time;

/// Which credential a control connection was opened with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credential {
    Standby,
    Run,
}

/// What kind of failure stopped the install: decides `requeueable`, in
/// this one place. The contract's rule: requeueable where a fresh cold
/// sandbox could plausibly succeed, not where the run itself is invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The run is invalid wherever it goes: no command, a `cwd` that leaves
    /// the workspace or is not a directory, an attachment name with a path
    /// separator or `..`, a repo path that leaves the workspace, a command
    /// that cannot be spawned.
    InvalidRun,
    /// A call to the server, a download or a git transfer failed.
    Network,
    /// The idle shell is dead, busy or its terminal not writable.
    RefusedShell,
    /// The assignment's workspace is not the one prepared here.
    FingerprintMismatch,
    /// An MCP server failed to restart under `strict_mcp`.
    StrictMcp,
    /// The install did not finish within its bound.
    Deadline,
    /// Delivery was not confirmed within the confirm timeout.
    Unconfirmed,
    /// Preparation failed, or its bound passed, with the assignment held.
    Preparation,
    /// The agent was stopped (SIGTERM) before the run started.
    Terminated,
    /// This sandbox could not do its part: a file it could not write, a
    /// terminal gone missing.
    Sandbox,
}

impl Cause {
    pub fn requeueable(self) -> bool {
        match self {
            Self::InvalidRun => false,
            Self::Network
            | Self::RefusedShell
            | Self::FingerprintMismatch
            | Self::StrictMcp
            | Self::Deadline
            | Self::Unconfirmed
            | Self::Preparation
            | Self::Terminated
            | Self::Sandbox => true,
        }
    }
}

/// Why the install failed, as reported in `install_failed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallFailure {
    pub stage: String,
    pub message: String,
    pub requeueable: bool,
    /// The run credential was refused with this status: the run was
    /// withdrawn, so nothing is reported and the agent exits 14.
    pub refused: Option<u16>,
}

impl InstallFailure {
    /// A failure at `stage`; `cause` decides whether it is requeueable.
    pub fn new(stage: &str, message: impl Into<String>, cause: Cause) -> Self {
        Self { stage: stage.to_owned(), message: message.into(), requeueable: cause.requeueable(), refused: None }
    }

    pub fn refused(stage: &str, message: impl Into<String>, status: u16) -> Self {
        Self { refused: Some(status), ..Self::new(stage, message, Cause::Network) }
    }

    fn event(self) -> EventKind {
        EventKind::InstallFailed { requeueable: self.requeueable, stage: self.stage, message: self.message }
    }
}

#[derive(Debug)]
pub enum Input {
    /// The spec is known (read from `STANDBY_SPEC` or fetched with the
    /// standby credential).
    SpecLoaded,
    /// Workspace, MCP servers and idle shell are ready (or not).
    PrepareFinished(Result<(), String>),
    /// A control connection was established.
    Connected(Credential),
    /// The upgrade was refused with `401`, `403` or `410`.
    Refused {
        credential: Credential,
        status: u16,
    },
    /// A decoded frame (`Unknown` types are dropped before they get here).
    Server {
        credential: Credential,
        message: ServerMessage,
    },
    InstallFinished(Result<(), InstallFailure>),
    /// The run could not be spawned on the terminal.
    RunFailedToStart(InstallFailure),
    RunExited {
        code: i32,
    },
    /// SIGTERM or SIGINT to the agent.
    Terminate,
    /// Time has moved on; check the deadlines.
    Tick,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunSignal {
    Terminate,
    Kill,
}

#[derive(Debug)]
pub enum Action {
    /// An assignment was accepted: from here every call uses its run
    /// credential (reports included), whatever else is held.
    Accepted { execution_id: String, credential: Secret },
    /// Close the standby connection and connect with the run credential.
    Confirm { credential: Secret },
    /// Install the run (preparation is done).
    Install(Box<Assignment>),
    /// Installed and confirmed: start the run. Emitted at most once.
    StartRun,
    /// Signal the run's process group.
    SignalRun(RunSignal),
    /// Stop installing; nothing the run would have done may happen.
    AbortInstall,
    /// Stop everything, report `report` if any, and exit. Always last.
    Finish { report: Option<EventKind>, exit: Exit },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StopReason {
    Cancel,
    Terminate,
    Withdrawn,
}

#[derive(Debug)]
enum Phase {
    /// No assignment yet.
    Waiting,
    /// An assignment was accepted and the run has not started.
    Installing {
        execution_id: String,
        /// The confirmation, held until the spec is loaded: switching to the
        /// run credential closes the standby connection, and a server may
        /// revoke the standby credential the moment the run credential
        /// connects, so the spec (a standby call) must be fetched first.
        confirm: Option<Action>,
        held: Option<Box<Assignment>>,
        install_by: Option<Instant>,
        installed: bool,
        confirm_by: Instant,
        confirmed: bool,
    },
    Running {
        execution_id: String,
        stop: Option<(StopReason, Instant)>,
        killed: bool,
    },
    /// An install call was refused with the run credential. A server that
    /// cancels revokes the credential first and sends `cancel` right after,
    /// so the agent waits briefly for it before concluding the run was
    /// withdrawn (cancelled: exit 0 and reported; withdrawn: exit 14).
    Withdrawing {
        execution_id: String,
        until: Instant,
    },
    Done,
}

/// How long a refused install call waits for the `cancel` that may follow.
pub const WITHDRAW_GRACE: Duration = Duration::from_secs(1);

/// Timeouts that shape the lifecycle.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// No assignment by then: exit 12.
    pub standby_deadline: Option<Instant>,
    /// Preparation not finished by then: exit 15, or the held assignment's
    /// install fails (stage `prepare`).
    pub prepare_deadline: Option<Instant>,
    /// The preparation bound the deadline came from, for messages.
    pub prepare: Duration,
    pub confirm: Duration,
    pub install: Duration,
    /// Between SIGTERM and SIGKILL for a stopping run.
    pub grace: Duration,
}

#[derive(Debug)]
pub struct Lifecycle {
    phase: Phase,
    spec_loaded: bool,
    prepared: bool,
    timeouts: Timeouts,
}

impl Lifecycle {
    pub fn new(timeouts: Timeouts) -> Self {
        Self { phase: Phase::Waiting, spec_loaded: false, prepared: false, timeouts }
    }

    /// Applies a second standby deadline (the spec's) when it is earlier.
    pub fn tighten_standby_deadline(&mut self, at: Instant) {
        let current = &mut self.timeouts.standby_deadline;
        *current = Some(current.map_or(at, |existing| existing.min(at)));
    }

    /// What the next heartbeat says.
    pub fn heartbeat(&self) -> (AgentState, Option<String>) {
        match &self.phase {
            Phase::Waiting if self.prepared => (AgentState::Ready, None),
            Phase::Waiting => (AgentState::Preparing, None),
            Phase::Installing { execution_id, installed, install_by, .. } => {
                let state = if !self.prepared || install_by.is_none() {
                    AgentState::Preparing
                } else if *installed {
                    AgentState::Confirming
                } else {
                    AgentState::Installing
                };
                (state, Some(execution_id.clone()))
            }
            Phase::Running { execution_id, .. } => (AgentState::Running, Some(execution_id.clone())),
            Phase::Withdrawing { execution_id, .. } => (AgentState::Finishing, Some(execution_id.clone())),
            Phase::Done => (AgentState::Finishing, None),
        }
    }

    /// The accepted execution, if any.
    pub fn execution_id(&self) -> Option<&str> {
        match &self.phase {
            Phase::Installing { execution_id, .. }
            | Phase::Running { execution_id, .. }
            | Phase::Withdrawing { execution_id, .. } => Some(execution_id),
            Phase::Waiting | Phase::Done => None,
        }
    }

    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// When [`Input::Tick`] should next be delivered.
    pub fn next_deadline(&self) -> Option<Instant> {
        let prepare = self.timeouts.prepare_deadline.filter(|_| !self.prepared);
        match &self.phase {
            Phase::Waiting => [self.timeouts.standby_deadline, prepare].into_iter().flatten().min(),
            Phase::Installing { install_by, installed, confirm_by, confirmed, .. } => {
                let confirm = (!confirmed).then_some(*confirm_by);
                let install = install_by.filter(|_| !installed);
                [confirm, install, prepare].into_iter().flatten().min()
            }
            Phase::Running { stop: Some((_, kill_at)), killed: false, .. } => Some(*kill_at),
            Phase::Withdrawing { until, .. } => Some(*until),
            Phase::Running { .. } | Phase::Done => None,
        }
    }

    pub fn handle(&mut self, now: Instant, input: Input) -> Vec<Action> {
        if self.is_done() {
            return Vec::new();
        }
        match input {
            Input::SpecLoaded => self.on_spec_loaded(),
            Input::PrepareFinished(result) => self.on_prepared(now, result),
            Input::Connected(credential) => {
                tracing::debug!(?credential, "control connection established");
                Vec::new()
            }
            Input::Refused { credential, status } => self.on_refused(now, credential, status),
            Input::Server { credential, message } => self.on_message(now, credential, message),
            Input::InstallFinished(result) => self.on_installed(now, result),
            Input::RunFailedToStart(failure) => self.finish(Some(failure.event()), Exit::InstallFailed),
            Input::RunExited { code } => self.on_run_exited(code),
            Input::Terminate => self.on_terminate(now),
            Input::Tick => self.on_tick(now),
        }
    }

    fn finish(&mut self, report: Option<EventKind>, exit: Exit) -> Vec<Action> {
        let mut actions = Vec::new();
        if matches!(self.phase, Phase::Installing { .. }) {
            actions.push(Action::AbortInstall);
        }
        self.phase = Phase::Done;
        actions.push(Action::Finish { report, exit });
        actions
    }

    fn on_spec_loaded(&mut self) -> Vec<Action> {
        self.spec_loaded = true;
        match &mut self.phase {
            Phase::Installing { confirm, .. } => confirm.take().into_iter().collect(),
            _ => Vec::new(),
        }
    }

    fn on_prepared(&mut self, now: Instant, result: Result<(), String>) -> Vec<Action> {
        if let Err(message) = result {
            return match self.phase {
                Phase::Installing { .. } => self.finish(
                    Some(InstallFailure::new("prepare", message, Cause::Preparation).event()),
                    Exit::InstallFailed,
                ),
                _ => self.finish(None, Exit::PrepareFailed),
            };
        }
        // A prepared sandbox has its spec, whatever the order the driver
        // saw the two in.
        let mut actions = self.on_spec_loaded();
        self.prepared = true;
        if let Phase::Installing { held, install_by, .. } = &mut self.phase
            && let Some(assignment) = held.take()
        {
            *install_by = Some(time::after(now, self.timeouts.install));
            actions.push(Action::Install(assignment));
        }
        actions
    }

    fn on_refused(&mut self, now: Instant, credential: Credential, status: u16) -> Vec<Action> {
        match (&self.phase, credential) {
            (Phase::Waiting, Credential::Standby) if status == 410 => self.finish(None, Exit::Unavailable),
            (Phase::Waiting, Credential::Standby) => self.finish(None, Exit::Unauthorized),
            (Phase::Installing { .. } | Phase::Withdrawing { .. }, Credential::Run) => {
                self.finish(None, Exit::Withdrawn)
            }
            (Phase::Running { .. }, Credential::Run) => self.stop_run(now, StopReason::Withdrawn),
            _ => {
                tracing::debug!(?credential, status, "stale refusal ignored");
                Vec::new()
            }
        }
    }

    fn on_message(&mut self, now: Instant, credential: Credential, message: ServerMessage) -> Vec<Action> {
        match message {
            ServerMessage::Assignment(assignment) => self.on_assignment(now, credential, assignment),
            ServerMessage::Retired(retired) => match self.phase {
                Phase::Waiting => {
                    tracing::info!(reason = retired.reason.as_deref().unwrap_or(""), "retired");
                    self.finish(None, Exit::Success)
                }
                _ => {
                    tracing::info!("`retired` after an assignment ignored");
                    Vec::new()
                }
            },
            ServerMessage::Cancel(cancel) if self.execution_id() == Some(cancel.execution_id.as_str()) => {
                tracing::info!(execution_id = %cancel.execution_id, "cancel received");
                match self.phase {
                    Phase::Running { .. } => self.stop_run(now, StopReason::Cancel),
                    _ => self.finish(Some(EventKind::Cancelled), Exit::Success),
                }
            }
            ServerMessage::Cancel(cancel) => {
                tracing::info!(execution_id = %cancel.execution_id, "cancel for another execution ignored");
                Vec::new()
            }
            ServerMessage::Unknown { type_name } => {
                tracing::debug!(type_name, "unknown message type skipped");
                Vec::new()
            }
        }
    }

    fn on_assignment(&mut self, now: Instant, credential: Credential, assignment: Assignment) -> Vec<Action> {
        let incoming = assignment.execution_id.clone();
        match &mut self.phase {
            Phase::Waiting => {
                tracing::info!(execution_id = %incoming, prepared = self.prepared, spec_loaded = self.spec_loaded, "assignment accepted");
                let confirm = Action::Confirm { credential: assignment.run_credential.clone() };
                let (confirm_now, confirm_held) =
                    if self.spec_loaded { (Some(confirm), None) } else { (None, Some(confirm)) };
                let accepted =
                    Action::Accepted { execution_id: incoming.clone(), credential: assignment.run_credential.clone() };
                let assignment = Box::new(assignment);
                let (held, install_by, install) = if self.prepared {
                    (None, Some(time::after(now, self.timeouts.install)), Some(Action::Install(assignment)))
                } else {
                    (Some(assignment), None, None)
                };
                self.phase = Phase::Installing {
                    execution_id: incoming,
                    confirm: confirm_held,
                    held,
                    install_by,
                    installed: false,
                    confirm_by: time::after(now, self.timeouts.confirm),
                    confirmed: false,
                };
                std::iter::once(accepted).chain(confirm_now).chain(install).collect()
            }
            Phase::Installing { execution_id, confirmed, installed, .. } if *execution_id == incoming => {
                if credential == Credential::Run && !*confirmed {
                    tracing::info!(execution_id = %incoming, "delivery confirmed");
                    *confirmed = true;
                    if *installed {
                        return self.start_run();
                    }
                } else {
                    tracing::debug!(execution_id = %incoming, ?credential, "assignment replay ignored");
                }
                Vec::new()
            }
            Phase::Running { execution_id, .. } | Phase::Withdrawing { execution_id, .. }
                if *execution_id == incoming =>
            {
                tracing::debug!(execution_id = %incoming, "assignment replay ignored");
                Vec::new()
            }
            _ => {
                tracing::warn!(execution_id = %incoming, current = ?self.execution_id(), "assignment for another execution ignored");
                Vec::new()
            }
        }
    }

    fn on_installed(&mut self, now: Instant, result: Result<(), InstallFailure>) -> Vec<Action> {
        let Phase::Installing { installed, confirmed, execution_id, .. } = &mut self.phase else {
            return Vec::new();
        };
        match result {
            Err(InstallFailure { refused: Some(status), stage, .. }) => {
                tracing::warn!(stage, status, "the run credential was refused during the install");
                let execution_id = std::mem::take(execution_id);
                self.phase = Phase::Withdrawing { execution_id, until: time::after(now, WITHDRAW_GRACE) };
                Vec::new()
            }
            Err(failure) => self.finish(Some(failure.event()), Exit::InstallFailed),
            Ok(()) => {
                *installed = true;
                if *confirmed { self.start_run() } else { Vec::new() }
            }
        }
    }

    fn start_run(&mut self) -> Vec<Action> {
        let Phase::Installing { execution_id, .. } = &mut self.phase else {
            return Vec::new();
        };
        self.phase = Phase::Running { execution_id: std::mem::take(execution_id), stop: None, killed: false };
        vec![Action::StartRun]
    }

    fn stop_run(&mut self, now: Instant, reason: StopReason) -> Vec<Action> {
        let Phase::Running { stop, .. } = &mut self.phase else {
            return Vec::new();
        };
        if stop.is_some() {
            return Vec::new();
        }
        *stop = Some((reason, time::after(now, self.timeouts.grace)));
        vec![Action::SignalRun(RunSignal::Terminate)]
    }

    /// Preparation has not finished and its bound has passed.
    fn preparation_overdue(&self, now: Instant) -> bool {
        !self.prepared && self.timeouts.prepare_deadline.is_some_and(|by| now >= by)
    }

    fn on_run_exited(&mut self, code: i32) -> Vec<Action> {
        let Phase::Running { stop, .. } = &self.phase else {
            return Vec::new();
        };
        match stop.map(|(reason, _)| reason) {
            Some(StopReason::Cancel) => self.finish(Some(EventKind::Cancelled), Exit::Success),
            Some(StopReason::Withdrawn) => self.finish(None, Exit::Withdrawn),
            Some(StopReason::Terminate) | None => self.finish(Some(EventKind::Exited { code }), Exit::Success),
        }
    }

    fn on_terminate(&mut self, now: Instant) -> Vec<Action> {
        match self.phase {
            Phase::Waiting => self.finish(None, Exit::Success),
            Phase::Installing { .. } => self.finish(
                Some(
                    InstallFailure::new(
                        "terminated",
                        "the agent was stopped (SIGTERM) before the run started",
                        Cause::Terminated,
                    )
                    .event(),
                ),
                Exit::InstallFailed,
            ),
            Phase::Running { .. } => self.stop_run(now, StopReason::Terminate),
            Phase::Withdrawing { .. } => self.finish(None, Exit::Withdrawn),
            Phase::Done => Vec::new(),
        }
    }

    fn on_tick(&mut self, now: Instant) -> Vec<Action> {
        let overdue = self.preparation_overdue(now);
        match &mut self.phase {
            Phase::Waiting => match self.timeouts.standby_deadline {
                Some(deadline) if now >= deadline => {
                    tracing::info!("standby deadline passed with no assignment");
                    self.finish(None, Exit::DeadlinePassed)
                }
                _ if overdue => {
                    tracing::error!(
                        timeout = %humantime::format_duration(self.timeouts.prepare),
                        "preparation did not finish within STANDBY_PREPARE_TIMEOUT"
                    );
                    self.finish(None, Exit::PrepareFailed)
                }
                _ => Vec::new(),
            },
            Phase::Installing { .. } if overdue => {
                let message =
                    format!("preparation did not finish within {}", humantime::format_duration(self.timeouts.prepare));
                self.finish(
                    Some(InstallFailure::new("prepare", message, Cause::Preparation).event()),
                    Exit::InstallFailed,
                )
            }
            Phase::Installing { confirm_by, confirmed, install_by, installed, .. } => {
                if !*confirmed && now >= *confirm_by {
                    let message = format!(
                        "delivery was not confirmed within {}",
                        humantime::format_duration(self.timeouts.confirm)
                    );
                    return self.finish(
                        Some(InstallFailure::new("confirm", message, Cause::Unconfirmed).event()),
                        Exit::InstallFailed,
                    );
                }
                if !*installed && install_by.is_some_and(|by| now >= by) {
                    let message = format!(
                        "the install did not finish within {}",
                        humantime::format_duration(self.timeouts.install)
                    );
                    return self.finish(
                        Some(InstallFailure::new("install", message, Cause::Deadline).event()),
                        Exit::InstallFailed,
                    );
                }
                Vec::new()
            }
            Phase::Running { stop: Some((_, kill_at)), killed, .. } if !*killed && now >= *kill_at => {
                *killed = true;
                vec![Action::SignalRun(RunSignal::Kill)]
            }
            Phase::Withdrawing { until, .. } if now >= *until => {
                tracing::info!("no cancel followed the refusal: the run was withdrawn");
                self.finish(None, Exit::Withdrawn)
            }
            Phase::Running { .. } | Phase::Withdrawing { .. } | Phase::Done => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use standby_protocol::{Cancel, Retired, Run};

    use super::*;

    const CONFIRM: Duration = Duration::from_secs(300);
    const INSTALL: Duration = Duration::from_secs(120);
    const GRACE: Duration = Duration::from_secs(10);
    const PREPARE: Duration = Duration::from_secs(1800);

    fn machine(deadline: Option<Duration>) -> (Lifecycle, Instant) {
        let start = Instant::now();
        let timeouts = Timeouts {
            standby_deadline: deadline.map(|d| start + d),
            prepare_deadline: Some(start + PREPARE),
            prepare: PREPARE,
            confirm: CONFIRM,
            install: INSTALL,
            grace: GRACE,
        };
        (Lifecycle::new(timeouts), start)
    }

    fn assignment(id: &str) -> ServerMessage {
        ServerMessage::Assignment(Assignment {
            execution_id: id.into(),
            run_credential: Secret::new(format!("cred-{id}")),
            run: Run {
                command: vec!["true".into()],
                cwd: None,
                env: BTreeMap::new(),
                mcp_env: BTreeMap::new(),
                workspace: None,
                strict_mcp: false,
                attachments: None,
            },
        })
    }

    fn server(credential: Credential, message: ServerMessage) -> Input {
        Input::Server { credential, message }
    }

    fn names(actions: &[Action]) -> Vec<&'static str> {
        actions
            .iter()
            .map(|a| match a {
                Action::Accepted { .. } => "accepted",
                Action::Confirm { .. } => "confirm",
                Action::Install(_) => "install",
                Action::StartRun => "start",
                Action::SignalRun(RunSignal::Terminate) => "term",
                Action::SignalRun(RunSignal::Kill) => "kill",
                Action::AbortInstall => "abort",
                Action::Finish { .. } => "finish",
            })
            .collect()
    }

    fn finish(actions: &[Action]) -> (Option<EventKind>, Exit) {
        match actions.last() {
            Some(Action::Finish { report, exit }) => (report.clone(), *exit),
            other => panic!("expected Finish last, got {other:?}"),
        }
    }

    /// A prepared machine with exe_1 accepted and installing.
    fn installing() -> (Lifecycle, Instant) {
        let (mut m, now) = machine(None);
        m.handle(now, Input::PrepareFinished(Ok(())));
        let actions = m.handle(now, server(Credential::Standby, assignment("exe_1")));
        assert_eq!(names(&actions), ["accepted", "confirm", "install"]);
        (m, now)
    }

    fn running() -> (Lifecycle, Instant) {
        let (mut m, now) = installing();
        assert!(m.handle(now, Input::InstallFinished(Ok(()))).is_empty());
        assert_eq!(names(&m.handle(now, server(Credential::Run, assignment("exe_1")))), ["start"]);
        (m, now)
    }

    #[test]
    fn heartbeat_follows_the_phases() {
        let (mut m, now) = machine(None);
        assert_eq!(m.heartbeat(), (AgentState::Preparing, None));
        m.handle(now, Input::PrepareFinished(Ok(())));
        assert_eq!(m.heartbeat(), (AgentState::Ready, None));
        m.handle(now, server(Credential::Standby, assignment("exe_1")));
        assert_eq!(m.heartbeat(), (AgentState::Installing, Some("exe_1".into())));
        m.handle(now, Input::InstallFinished(Ok(())));
        assert_eq!(m.heartbeat(), (AgentState::Confirming, Some("exe_1".into())));
        m.handle(now, server(Credential::Run, assignment("exe_1")));
        assert_eq!(m.heartbeat(), (AgentState::Running, Some("exe_1".into())));
        m.handle(now, Input::RunExited { code: 3 });
        assert_eq!(m.heartbeat().0, AgentState::Finishing);
    }

    #[test]
    fn confirmation_before_install_also_starts_once() {
        let (mut m, now) = installing();
        assert!(m.handle(now, server(Credential::Run, assignment("exe_1"))).is_empty());
        assert_eq!(names(&m.handle(now, Input::InstallFinished(Ok(())))), ["start"]);
    }

    #[test]
    fn replays_never_start_the_run_twice() {
        let (mut m, now) = running();
        for credential in [Credential::Standby, Credential::Run, Credential::Run] {
            assert!(m.handle(now, server(credential, assignment("exe_1"))).is_empty());
        }
        assert!(m.handle(now, Input::InstallFinished(Ok(()))).is_empty());
    }

    #[test]
    fn replay_on_the_standby_connection_does_not_confirm() {
        let (mut m, now) = installing();
        m.handle(now, Input::InstallFinished(Ok(())));
        assert!(m.handle(now, server(Credential::Standby, assignment("exe_1"))).is_empty());
        assert_eq!(m.heartbeat().0, AgentState::Confirming);
    }

    #[test]
    fn another_execution_is_ignored() {
        let (mut m, now) = installing();
        assert!(m.handle(now, server(Credential::Standby, assignment("exe_2"))).is_empty());
        assert!(m.handle(now, server(Credential::Run, assignment("exe_2"))).is_empty());
        assert_eq!(m.execution_id(), Some("exe_1"));
    }

    #[test]
    fn assignment_during_preparation_is_held_then_installed() {
        let (mut m, now) = machine(Some(Duration::from_secs(5)));
        assert!(m.handle(now, Input::SpecLoaded).is_empty());
        let actions = m.handle(now, server(Credential::Standby, assignment("exe_1")));
        assert_eq!(names(&actions), ["accepted", "confirm"], "confirmation starts at once, the install waits");
        assert_eq!(m.heartbeat(), (AgentState::Preparing, Some("exe_1".into())));
        // The standby deadline no longer applies once an assignment is held.
        assert!(m.handle(now + Duration::from_secs(6), Input::Tick).is_empty());
        let actions = m.handle(now, Input::PrepareFinished(Ok(())));
        assert!(matches!(&actions[..], [Action::Install(a)] if a.execution_id == "exe_1"));
    }

    #[test]
    fn confirmation_waits_for_the_spec() {
        let (mut m, now) = machine(None);
        let actions = m.handle(now, server(Credential::Standby, assignment("exe_1")));
        assert_eq!(names(&actions), ["accepted"], "the standby connection stays until the spec is fetched");
        assert_eq!(m.heartbeat(), (AgentState::Preparing, Some("exe_1".into())));
        assert_eq!(m.next_deadline(), Some(now + CONFIRM), "the confirm timeout counts from acceptance");
        assert_eq!(names(&m.handle(now, Input::SpecLoaded)), ["confirm"]);
        assert!(m.handle(now, Input::SpecLoaded).is_empty(), "confirmed once");
        assert!(matches!(&m.handle(now, Input::PrepareFinished(Ok(())))[..], [Action::Install(_)]));

        // A preparation that ends first releases both.
        let (mut m, now) = machine(None);
        assert_eq!(names(&m.handle(now, server(Credential::Standby, assignment("exe_1")))), ["accepted"]);
        assert_eq!(names(&m.handle(now, Input::PrepareFinished(Ok(())))), ["confirm", "install"]);

        // Never loaded: the confirm timeout fails the install, requeueable.
        let (mut m, now) = machine(None);
        m.handle(now, server(Credential::Standby, assignment("exe_1")));
        let (report, exit) = finish(&m.handle(now + CONFIRM, Input::Tick));
        assert_eq!(exit, Exit::InstallFailed);
        assert!(
            matches!(report, Some(EventKind::InstallFailed { requeueable: true, ref stage, .. }) if stage == "confirm")
        );
    }

    #[test]
    fn preparation_failure_exits_15_or_reports_when_an_assignment_is_held() {
        let (mut m, now) = machine(None);
        let (report, exit) = finish(&m.handle(now, Input::PrepareFinished(Err("setup step `deps` failed".into()))));
        assert_eq!((report, exit), (None, Exit::PrepareFailed));

        let (mut m, now) = machine(None);
        m.handle(now, server(Credential::Standby, assignment("exe_1")));
        let (report, exit) = finish(&m.handle(now, Input::PrepareFinished(Err("boom".into()))));
        assert_eq!(exit, Exit::InstallFailed);
        assert!(
            matches!(report, Some(EventKind::InstallFailed { requeueable: true, ref stage, .. }) if stage == "prepare")
        );
    }

    #[test]
    fn preparation_past_its_bound_exits_15_without_an_assignment() {
        let (mut m, start) = machine(None);
        assert_eq!(m.next_deadline(), Some(start + PREPARE));
        assert!(m.handle(start + PREPARE - Duration::from_millis(1), Input::Tick).is_empty());
        let (report, exit) = finish(&m.handle(start + PREPARE, Input::Tick));
        assert_eq!((report, exit), (None, Exit::PrepareFailed));
    }

    #[test]
    fn preparation_past_its_bound_with_an_assignment_held_fails_the_install_requeueable() {
        let (mut m, start) = machine(None);
        m.handle(start, server(Credential::Standby, assignment("exe_1")));
        // The confirmation is done; only the preparation is outstanding.
        m.handle(start, server(Credential::Run, assignment("exe_1")));
        assert_eq!(m.next_deadline(), Some(start + PREPARE));
        let actions = m.handle(start + PREPARE, Input::Tick);
        assert_eq!(names(&actions), ["abort", "finish"]);
        let (report, exit) = finish(&actions);
        assert_eq!(exit, Exit::InstallFailed);
        assert!(
            matches!(report, Some(EventKind::InstallFailed { requeueable: true, ref stage, ref message }) if stage == "prepare" && message.contains("30m")),
            "{report:?}"
        );
    }

    #[test]
    fn the_preparation_bound_ends_with_the_preparation() {
        let (mut m, start) = machine(None);
        m.handle(start, Input::PrepareFinished(Ok(())));
        assert_eq!(m.next_deadline(), None);
        assert!(m.handle(start + PREPARE, Input::Tick).is_empty());
        m.handle(start + PREPARE, server(Credential::Standby, assignment("exe_1")));
        assert_eq!(m.next_deadline(), Some(start + PREPARE + INSTALL), "only the install bound applies");
    }

    #[test]
    fn requeueable_follows_the_kind_of_failure() {
        let requeueable = [
            (Cause::Network, true),
            (Cause::RefusedShell, true),
            (Cause::FingerprintMismatch, true),
            (Cause::StrictMcp, true),
            (Cause::Deadline, true),
            (Cause::Unconfirmed, true),
            (Cause::Preparation, true),
            (Cause::Terminated, true),
            (Cause::Sandbox, true),
            (Cause::InvalidRun, false),
        ];
        for (cause, expected) in requeueable {
            assert_eq!(cause.requeueable(), expected, "{cause:?}");
            assert_eq!(InstallFailure::new("stage", "why", cause).requeueable, expected, "{cause:?}");
        }
        assert!(InstallFailure::refused("secrets", "401", 401).requeueable);
    }

    #[test]
    fn standby_refusals_map_to_exit_codes() {
        for (status, expected) in [(410, Exit::Unavailable), (401, Exit::Unauthorized), (403, Exit::Unauthorized)] {
            let (mut m, now) = machine(None);
            let actions = m.handle(now, Input::Refused { credential: Credential::Standby, status });
            assert_eq!(finish(&actions), (None, expected), "status {status}");
        }
    }

    #[test]
    fn run_credential_refused_before_start_is_withdrawn() {
        for status in [401, 403, 410] {
            let (mut m, now) = installing();
            let actions = m.handle(now, Input::Refused { credential: Credential::Run, status });
            assert_eq!(names(&actions), ["abort", "finish"]);
            assert_eq!(finish(&actions), (None, Exit::Withdrawn));
            // Nothing afterwards can start it.
            assert!(m.handle(now, Input::InstallFinished(Ok(()))).is_empty());
            assert!(m.handle(now, server(Credential::Run, assignment("exe_1"))).is_empty());
        }
    }

    #[test]
    fn stale_standby_refusal_after_acceptance_is_ignored() {
        let (mut m, now) = installing();
        assert!(m.handle(now, Input::Refused { credential: Credential::Standby, status: 401 }).is_empty());
    }

    #[test]
    fn retired_only_before_an_assignment() {
        let (mut m, now) = machine(None);
        let actions = m.handle(now, server(Credential::Standby, ServerMessage::Retired(Retired { reason: None })));
        assert_eq!(finish(&actions), (None, Exit::Success));

        let (mut m, now) = installing();
        assert!(m.handle(now, server(Credential::Run, ServerMessage::Retired(Retired { reason: None }))).is_empty());
    }

    #[test]
    fn deadline_without_assignment_exits_12() {
        let (mut m, start) = machine(Some(Duration::from_secs(30)));
        assert_eq!(m.next_deadline(), Some(start + Duration::from_secs(30)));
        assert!(m.handle(start + Duration::from_secs(29), Input::Tick).is_empty());
        let actions = m.handle(start + Duration::from_secs(30), Input::Tick);
        assert_eq!(finish(&actions), (None, Exit::DeadlinePassed));
    }

    #[test]
    fn unconfirmed_delivery_fails_requeueable_at_the_confirm_timeout() {
        let (mut m, start) = installing();
        m.handle(start, Input::InstallFinished(Ok(())));
        assert_eq!(m.next_deadline(), Some(start + CONFIRM));
        let actions = m.handle(start + CONFIRM, Input::Tick);
        let (report, exit) = finish(&actions);
        assert_eq!(exit, Exit::InstallFailed);
        assert!(
            matches!(report, Some(EventKind::InstallFailed { requeueable: true, ref stage, .. }) if stage == "confirm")
        );
    }

    #[test]
    fn install_timeout_aborts_the_install() {
        let (mut m, start) = installing();
        m.handle(start, server(Credential::Run, assignment("exe_1")));
        assert_eq!(m.next_deadline(), Some(start + INSTALL));
        let actions = m.handle(start + INSTALL, Input::Tick);
        assert_eq!(names(&actions), ["abort", "finish"]);
        assert!(
            matches!(finish(&actions).0, Some(EventKind::InstallFailed { requeueable: true, ref stage, .. }) if stage == "install")
        );
    }

    #[test]
    fn install_failure_is_reported_as_given() {
        let (mut m, now) = installing();
        let failure = InstallFailure::new("check", "cwd `../x` leaves the workspace", Cause::InvalidRun);
        let (report, exit) = finish(&m.handle(now, Input::InstallFinished(Err(failure))));
        assert_eq!(exit, Exit::InstallFailed);
        assert!(matches!(report, Some(EventKind::InstallFailed { requeueable: false, .. })));
        assert!(m.handle(now, server(Credential::Run, assignment("exe_1"))).is_empty(), "never starts");
    }

    #[test]
    fn run_credential_refused_by_an_install_call_is_withdrawn_unless_a_cancel_follows() {
        let refused = || InstallFailure::refused("secrets", "GET /v1/executions/exe_1/secrets: 401", 401);
        let (mut m, now) = installing();
        assert!(m.handle(now, Input::InstallFinished(Err(refused()))).is_empty(), "waits for a cancel");
        assert_eq!(m.next_deadline(), Some(now + WITHDRAW_GRACE));
        assert!(m.handle(now, server(Credential::Run, assignment("exe_1"))).is_empty(), "never starts");
        let actions = m.handle(now + WITHDRAW_GRACE, Input::Tick);
        assert_eq!(finish(&actions), (None, Exit::Withdrawn));

        let (mut m, now) = installing();
        m.handle(now, Input::InstallFinished(Err(refused())));
        let cancel = ServerMessage::Cancel(Cancel { execution_id: "exe_1".into() });
        let actions = m.handle(now, server(Credential::Run, cancel));
        assert_eq!(finish(&actions), (Some(EventKind::Cancelled), Exit::Success));
    }

    #[test]
    fn cancel_before_start_never_starts_the_run() {
        let (mut m, now) = installing();
        let cancel = ServerMessage::Cancel(Cancel { execution_id: "exe_1".into() });
        let actions = m.handle(now, server(Credential::Run, cancel));
        assert_eq!(names(&actions), ["abort", "finish"]);
        assert_eq!(finish(&actions), (Some(EventKind::Cancelled), Exit::Success));
        assert!(m.handle(now, Input::InstallFinished(Ok(()))).is_empty());
        assert!(m.handle(now, server(Credential::Run, assignment("exe_1"))).is_empty());
    }

    #[test]
    fn cancel_for_another_execution_is_ignored() {
        let (mut m, now) = installing();
        let cancel = ServerMessage::Cancel(Cancel { execution_id: "exe_9".into() });
        assert!(m.handle(now, server(Credential::Run, cancel)).is_empty());
        let (mut m, now) = machine(None);
        let cancel = ServerMessage::Cancel(Cancel { execution_id: "exe_9".into() });
        assert!(m.handle(now, server(Credential::Standby, cancel)).is_empty());
    }

    #[test]
    fn cancel_during_run_terminates_then_kills_after_grace() {
        let (mut m, start) = running();
        let cancel = ServerMessage::Cancel(Cancel { execution_id: "exe_1".into() });
        assert_eq!(names(&m.handle(start, server(Credential::Run, cancel.clone()))), ["term"]);
        assert!(m.handle(start, server(Credential::Run, cancel)).is_empty(), "a repeated cancel does nothing");
        assert_eq!(m.next_deadline(), Some(start + GRACE));
        assert!(m.handle(start + GRACE - Duration::from_millis(1), Input::Tick).is_empty());
        assert_eq!(names(&m.handle(start + GRACE, Input::Tick)), ["kill"]);
        assert_eq!(m.next_deadline(), None);
        assert_eq!(
            finish(&m.handle(start, Input::RunExited { code: 137 })),
            (Some(EventKind::Cancelled), Exit::Success)
        );
    }

    #[test]
    fn sigterm_by_phase() {
        let (mut m, now) = machine(None);
        assert_eq!(finish(&m.handle(now, Input::Terminate)), (None, Exit::Success));

        let (mut m, now) = installing();
        let (report, exit) = finish(&m.handle(now, Input::Terminate));
        assert_eq!(exit, Exit::InstallFailed);
        assert!(matches!(report, Some(EventKind::InstallFailed { requeueable: true, .. })));

        let (mut m, now) = running();
        assert_eq!(names(&m.handle(now, Input::Terminate)), ["term"]);
        let (report, exit) = finish(&m.handle(now, Input::RunExited { code: 143 }));
        assert_eq!((report, exit), (Some(EventKind::Exited { code: 143 }), Exit::Success));
    }

    #[test]
    fn run_credential_refused_during_the_run_stops_it() {
        let (mut m, now) = running();
        assert_eq!(names(&m.handle(now, Input::Refused { credential: Credential::Run, status: 401 })), ["term"]);
        assert_eq!(finish(&m.handle(now, Input::RunExited { code: 143 })), (None, Exit::Withdrawn));
    }

    #[test]
    fn run_exit_is_reported() {
        let (mut m, now) = running();
        assert_eq!(
            finish(&m.handle(now, Input::RunExited { code: 7 })),
            (Some(EventKind::Exited { code: 7 }), Exit::Success)
        );
        assert!(m.is_done());
        assert!(m.handle(now, Input::Terminate).is_empty(), "nothing after Finish");
    }

    #[test]
    fn spawn_failure_is_an_install_failure() {
        let (mut m, now) = running();
        let failure = InstallFailure::new("start", "`nope`: command not found", Cause::InvalidRun);
        let (report, exit) = finish(&m.handle(now, Input::RunFailedToStart(failure)));
        assert_eq!(exit, Exit::InstallFailed);
        assert!(matches!(report, Some(EventKind::InstallFailed { requeueable: false, .. })));
    }

    proptest::proptest! {
        /// Timeouts and deadlines of any size, and ticks at any time up to
        /// a century on, drive every phase without a panic.
        #[test]
        fn absurd_timeouts_never_panic(
            confirm in crate::time::tests::any_duration(),
            install in crate::time::tests::any_duration(),
            grace in crate::time::tests::any_duration(),
            deadline in crate::time::tests::any_duration(),
            tick in crate::time::tests::any_duration(),
            prepare in crate::time::tests::any_duration(),
        ) {
            let start = Instant::now();
            let timeouts = Timeouts {
                standby_deadline: Some(time::after(start, deadline)),
                prepare_deadline: Some(time::after(start, prepare)),
                prepare,
                confirm,
                install,
                grace,
            };
            let mut m = Lifecycle::new(timeouts);
            let later = time::after(start, tick);
            m.handle(start, server(Credential::Standby, assignment("exe_1")));
            m.handle(start, Input::PrepareFinished(Ok(())));
            m.handle(later, Input::Tick);
            m.handle(start, Input::InstallFinished(Ok(())));
            m.handle(start, server(Credential::Run, assignment("exe_1")));
            m.handle(start, Input::Terminate);
            let _ = m.next_deadline();
            m.handle(later, Input::Tick);
            m.handle(time::after(later, time::FOREVER), Input::Tick);
        }
    }
}
