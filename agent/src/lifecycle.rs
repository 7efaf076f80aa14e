//! The agent's lifecycle as a pure state machine: inputs in, actions out.
//!
//! It does no IO and reads no clock (the caller passes `now`), so every
//! rule of the contract about what happens when is tested here without
//! sockets, processes or sleeps. [`crate::agent`] drives it: it turns socket
//! frames, process exits, signals and timers into [`Input`]s and carries out
//! the [`Action`]s.

mod failure;

use std::time::Duration;

use standby_protocol::{
    AgentState, Assignment, Cause, CredentialKind, EventKind, ExitCode, Refusal, Secret, ServerMessage, Stage,
};
use tokio::time::Instant;

pub(crate) use self::failure::InstallFailure;
use crate::time;

#[derive(Debug)]
pub(crate) enum Input {
    /// The spec is known (read from `STANDBY_SPEC` or fetched with the
    /// standby credential).
    SpecLoaded,
    /// The spec fetch was refused; `message` says how.
    SpecRefused {
        refusal: Refusal,
        message: String,
    },
    /// Workspace, MCP servers and idle shell are ready (or not).
    PrepareFinished(Result<(), String>),
    /// A control connection was established.
    Connected(CredentialKind),
    /// The upgrade was refused with `401`, `403` or `410`.
    Refused {
        credential: CredentialKind,
        refusal: Refusal,
    },
    /// A decoded frame (`Unknown` types are dropped before they get here).
    Server {
        credential: CredentialKind,
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
pub(crate) enum RunSignal {
    Terminate,
    Kill,
}

#[derive(Debug)]
pub(crate) enum Action {
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
    Finish { report: Option<EventKind>, exit: ExitCode },
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
pub(crate) const WITHDRAW_GRACE: Duration = Duration::from_secs(1);

/// Timeouts that shape the lifecycle.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    /// No assignment by then: exit 12.
    pub(crate) standby_deadline: Option<Instant>,
    /// Preparation not finished by then: exit 15, or the held assignment's
    /// install fails (stage `prepare`).
    pub(crate) prepare_deadline: Option<Instant>,
    /// The preparation bound the deadline came from, for messages.
    pub(crate) prepare: Duration,
    pub(crate) confirm: Duration,
    pub(crate) install: Duration,
    /// Between SIGTERM and SIGKILL for a stopping run.
    pub(crate) grace: Duration,
}

#[derive(Debug)]
pub(crate) struct Lifecycle {
    phase: Phase,
    spec_loaded: bool,
    prepared: bool,
    timeouts: Timeouts,
}

impl Lifecycle {
    pub(crate) fn new(timeouts: Timeouts) -> Self {
        Self { phase: Phase::Waiting, spec_loaded: false, prepared: false, timeouts }
    }

    /// Applies a second standby deadline (the spec's) when it is earlier.
    pub(crate) fn tighten_standby_deadline(&mut self, at: Instant) {
        let current = &mut self.timeouts.standby_deadline;
        *current = Some(current.map_or(at, |existing| existing.min(at)));
    }

    /// What the next heartbeat says.
    pub(crate) fn heartbeat(&self) -> (AgentState, Option<String>) {
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
    pub(crate) fn execution_id(&self) -> Option<&str> {
        match &self.phase {
            Phase::Installing { execution_id, .. }
            | Phase::Running { execution_id, .. }
            | Phase::Withdrawing { execution_id, .. } => Some(execution_id),
            Phase::Waiting | Phase::Done => None,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// When [`Input::Tick`] should next be delivered.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
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

    pub(crate) fn handle(&mut self, now: Instant, input: Input) -> Vec<Action> {
        if self.is_done() {
            return Vec::new();
        }
        match input {
            Input::SpecLoaded => self.on_spec_loaded(),
            Input::SpecRefused { refusal, message } => self.on_spec_refused(refusal, &message),
            Input::PrepareFinished(result) => self.on_prepared(now, result),
            Input::Connected(credential) => {
                tracing::debug!(?credential, "control connection established");
                Vec::new()
            }
            Input::Refused { credential, refusal } => self.on_refused(now, credential, refusal),
            Input::Server { credential, message } => self.on_message(now, credential, message),
            Input::InstallFinished(result) => self.on_installed(now, result),
            Input::RunFailedToStart(failure) => self.finish(Some(failure.event()), ExitCode::InstallFailed),
            Input::RunExited { code } => self.on_run_exited(code),
            Input::Terminate => self.on_terminate(now),
            Input::Tick => self.on_tick(now),
        }
    }

    fn finish(&mut self, report: Option<EventKind>, exit: ExitCode) -> Vec<Action> {
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

    /// A refused spec fetch is a standby refusal while no assignment is
    /// held; with one held, it is a failed preparation of that run
    /// (requeueable), not a reason to exit as if the standby were retired.
    fn on_spec_refused(&mut self, refusal: Refusal, message: &str) -> Vec<Action> {
        match self.phase {
            Phase::Waiting => self.finish(None, refusal.exit(CredentialKind::Standby)),
            Phase::Installing { .. } => {
                let message = format!("fetching the spec after the assignment was accepted: {message}");
                self.fail_install(Stage::Prepare, Cause::Preparation, message)
            }
            Phase::Running { .. } | Phase::Withdrawing { .. } | Phase::Done => {
                tracing::debug!(?refusal, "a spec refusal after the install ignored");
                Vec::new()
            }
        }
    }

    /// Ends the install with an `install_failed` report and exit 13.
    fn fail_install(&mut self, stage: Stage, cause: Cause, message: String) -> Vec<Action> {
        self.finish(Some(EventKind::install_failed(stage, cause, message)), ExitCode::InstallFailed)
    }

    fn on_prepared(&mut self, now: Instant, result: Result<(), String>) -> Vec<Action> {
        if let Err(message) = result {
            return match self.phase {
                Phase::Installing { .. } => self.fail_install(Stage::Prepare, Cause::Preparation, message),
                _ => self.finish(None, ExitCode::PrepareFailed),
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

    fn on_refused(&mut self, now: Instant, credential: CredentialKind, refusal: Refusal) -> Vec<Action> {
        match (&self.phase, credential) {
            (Phase::Waiting, CredentialKind::Standby)
            | (Phase::Installing { .. } | Phase::Withdrawing { .. }, CredentialKind::Run) => {
                self.finish(None, refusal.exit(credential))
            }
            (Phase::Running { .. }, CredentialKind::Run) => self.stop_run(now, StopReason::Withdrawn),
            _ => {
                tracing::debug!(?credential, ?refusal, "stale refusal ignored");
                Vec::new()
            }
        }
    }

    fn on_message(&mut self, now: Instant, credential: CredentialKind, message: ServerMessage) -> Vec<Action> {
        match message {
            ServerMessage::Assignment(assignment) => self.on_assignment(now, credential, *assignment),
            ServerMessage::Retired(retired) => match self.phase {
                Phase::Waiting => {
                    tracing::info!(reason = retired.reason.as_deref().unwrap_or(""), "retired");
                    self.finish(None, ExitCode::Success)
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
                    _ => self.finish(Some(EventKind::Cancelled), ExitCode::Success),
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

    fn on_assignment(&mut self, now: Instant, credential: CredentialKind, assignment: Assignment) -> Vec<Action> {
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
                if credential == CredentialKind::Run && !*confirmed {
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
            Err(InstallFailure { refused: Some(refusal), stage, .. }) => {
                tracing::warn!(%stage, ?refusal, "the run credential was refused during the install");
                let execution_id = std::mem::take(execution_id);
                self.phase = Phase::Withdrawing { execution_id, until: time::after(now, WITHDRAW_GRACE) };
                Vec::new()
            }
            Err(failure) => self.finish(Some(failure.event()), ExitCode::InstallFailed),
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
            Some(StopReason::Cancel) => self.finish(Some(EventKind::Cancelled), ExitCode::Success),
            Some(StopReason::Withdrawn) => self.finish(None, ExitCode::Withdrawn),
            Some(StopReason::Terminate) | None => self.finish(Some(EventKind::Exited { code }), ExitCode::Success),
        }
    }

    fn on_terminate(&mut self, now: Instant) -> Vec<Action> {
        match self.phase {
            Phase::Waiting => self.finish(None, ExitCode::Success),
            Phase::Installing { .. } => self.fail_install(
                Stage::Terminated,
                Cause::Terminated,
                "the agent was stopped (SIGTERM) before the run started".into(),
            ),
            Phase::Running { .. } => self.stop_run(now, StopReason::Terminate),
            Phase::Withdrawing { .. } => self.finish(None, ExitCode::Withdrawn),
            Phase::Done => Vec::new(),
        }
    }

    fn on_tick(&mut self, now: Instant) -> Vec<Action> {
        let overdue = self.preparation_overdue(now);
        match &mut self.phase {
            Phase::Waiting => match self.timeouts.standby_deadline {
                Some(deadline) if now >= deadline => {
                    tracing::info!("standby deadline passed with no assignment");
                    self.finish(None, ExitCode::DeadlinePassed)
                }
                _ if overdue => {
                    tracing::error!(
                        timeout = %humantime::format_duration(self.timeouts.prepare),
                        "preparation did not finish within STANDBY_PREPARE_TIMEOUT"
                    );
                    self.finish(None, ExitCode::PrepareFailed)
                }
                _ => Vec::new(),
            },
            Phase::Installing { .. } if overdue => {
                let message =
                    format!("preparation did not finish within {}", humantime::format_duration(self.timeouts.prepare));
                self.fail_install(Stage::Prepare, Cause::Preparation, message)
            }
            Phase::Installing { confirm_by, confirmed, install_by, installed, .. } => {
                if !*confirmed && now >= *confirm_by {
                    let message = format!(
                        "delivery was not confirmed within {}",
                        humantime::format_duration(self.timeouts.confirm)
                    );
                    return self.fail_install(Stage::Confirm, Cause::Unconfirmed, message);
                }
                if !*installed && install_by.is_some_and(|by| now >= by) {
                    let message = format!(
                        "the install did not finish within {}",
                        humantime::format_duration(self.timeouts.install)
                    );
                    return self.fail_install(Stage::Install, Cause::Deadline, message);
                }
                Vec::new()
            }
            Phase::Running { stop: Some((_, kill_at)), killed, .. } if !*killed && now >= *kill_at => {
                *killed = true;
                vec![Action::SignalRun(RunSignal::Kill)]
            }
            Phase::Withdrawing { until, .. } if now >= *until => {
                tracing::info!("no cancel followed the refusal: the run was withdrawn");
                self.finish(None, ExitCode::Withdrawn)
            }
            Phase::Running { .. } | Phase::Withdrawing { .. } | Phase::Done => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use standby_protocol::{Answer, Cancel, Retired, Run};

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
        ServerMessage::Assignment(Box::new(Assignment {
            execution_id: id.into(),
            run_credential: Secret::new(format!("cred-{id}")),
            run: Run { command: vec!["true".into()], ..Run::default() },
            trace_context: None,
        }))
    }

    fn server(credential: CredentialKind, message: ServerMessage) -> Input {
        Input::Server { credential, message }
    }

    /// The refusal a server answers with `status`.
    fn refused(credential: CredentialKind, status: u16) -> Input {
        let Answer::Refused(refusal) = Answer::of(status) else { panic!("{status} is not a refusal") };
        Input::Refused { credential, refusal }
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

    fn finish(actions: &[Action]) -> (Option<EventKind>, ExitCode) {
        match actions.last() {
            Some(Action::Finish { report, exit }) => (report.clone(), *exit),
            other => panic!("expected Finish last, got {other:?}"),
        }
    }

    /// A prepared machine with exe_1 accepted and installing.
    fn installing() -> (Lifecycle, Instant) {
        let (mut m, now) = machine(None);
        m.handle(now, Input::PrepareFinished(Ok(())));
        let actions = m.handle(now, server(CredentialKind::Standby, assignment("exe_1")));
        assert_eq!(names(&actions), ["accepted", "confirm", "install"]);
        (m, now)
    }

    fn running() -> (Lifecycle, Instant) {
        let (mut m, now) = installing();
        assert!(m.handle(now, Input::InstallFinished(Ok(()))).is_empty());
        assert_eq!(names(&m.handle(now, server(CredentialKind::Run, assignment("exe_1")))), ["start"]);
        (m, now)
    }

    #[test]
    fn heartbeat_follows_the_phases() {
        let (mut m, now) = machine(None);
        assert_eq!(m.heartbeat(), (AgentState::Preparing, None));
        m.handle(now, Input::PrepareFinished(Ok(())));
        assert_eq!(m.heartbeat(), (AgentState::Ready, None));
        m.handle(now, server(CredentialKind::Standby, assignment("exe_1")));
        assert_eq!(m.heartbeat(), (AgentState::Installing, Some("exe_1".into())));
        m.handle(now, Input::InstallFinished(Ok(())));
        assert_eq!(m.heartbeat(), (AgentState::Confirming, Some("exe_1".into())));
        m.handle(now, server(CredentialKind::Run, assignment("exe_1")));
        assert_eq!(m.heartbeat(), (AgentState::Running, Some("exe_1".into())));
        m.handle(now, Input::RunExited { code: 3 });
        assert_eq!(m.heartbeat().0, AgentState::Finishing);
    }

    #[test]
    fn confirmation_before_install_also_starts_once() {
        let (mut m, now) = installing();
        assert!(m.handle(now, server(CredentialKind::Run, assignment("exe_1"))).is_empty());
        assert_eq!(names(&m.handle(now, Input::InstallFinished(Ok(())))), ["start"]);
    }

    #[test]
    fn replays_never_start_the_run_twice() {
        let (mut m, now) = running();
        for credential in [CredentialKind::Standby, CredentialKind::Run, CredentialKind::Run] {
            assert!(m.handle(now, server(credential, assignment("exe_1"))).is_empty());
        }
        assert!(m.handle(now, Input::InstallFinished(Ok(()))).is_empty());
    }

    #[test]
    fn replay_on_the_standby_connection_does_not_confirm() {
        let (mut m, now) = installing();
        m.handle(now, Input::InstallFinished(Ok(())));
        assert!(m.handle(now, server(CredentialKind::Standby, assignment("exe_1"))).is_empty());
        assert_eq!(m.heartbeat().0, AgentState::Confirming);
    }

    #[test]
    fn another_execution_is_ignored() {
        let (mut m, now) = installing();
        assert!(m.handle(now, server(CredentialKind::Standby, assignment("exe_2"))).is_empty());
        assert!(m.handle(now, server(CredentialKind::Run, assignment("exe_2"))).is_empty());
        assert_eq!(m.execution_id(), Some("exe_1"));
    }

    #[test]
    fn assignment_during_preparation_is_held_then_installed() {
        let (mut m, now) = machine(Some(Duration::from_secs(5)));
        assert!(m.handle(now, Input::SpecLoaded).is_empty());
        let actions = m.handle(now, server(CredentialKind::Standby, assignment("exe_1")));
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
        let actions = m.handle(now, server(CredentialKind::Standby, assignment("exe_1")));
        assert_eq!(names(&actions), ["accepted"], "the standby connection stays until the spec is fetched");
        assert_eq!(m.heartbeat(), (AgentState::Preparing, Some("exe_1".into())));
        assert_eq!(m.next_deadline(), Some(now + CONFIRM), "the confirm timeout counts from acceptance");
        assert_eq!(names(&m.handle(now, Input::SpecLoaded)), ["confirm"]);
        assert!(m.handle(now, Input::SpecLoaded).is_empty(), "confirmed once");
        assert!(matches!(&m.handle(now, Input::PrepareFinished(Ok(())))[..], [Action::Install(_)]));

        // A preparation that ends first releases both.
        let (mut m, now) = machine(None);
        assert_eq!(names(&m.handle(now, server(CredentialKind::Standby, assignment("exe_1")))), ["accepted"]);
        assert_eq!(names(&m.handle(now, Input::PrepareFinished(Ok(())))), ["confirm", "install"]);

        // Never loaded: the confirm timeout fails the install, requeueable.
        let (mut m, now) = machine(None);
        m.handle(now, server(CredentialKind::Standby, assignment("exe_1")));
        let (report, exit) = finish(&m.handle(now + CONFIRM, Input::Tick));
        assert_eq!(exit, ExitCode::InstallFailed);
        assert!(
            matches!(report, Some(EventKind::InstallFailed { requeueable: true, ref stage, .. }) if stage == "confirm")
        );
    }

    #[test]
    fn preparation_failure_exits_15_or_reports_when_an_assignment_is_held() {
        let (mut m, now) = machine(None);
        let (report, exit) = finish(&m.handle(now, Input::PrepareFinished(Err("setup step `deps` failed".into()))));
        assert_eq!((report, exit), (None, ExitCode::PrepareFailed));

        let (mut m, now) = machine(None);
        m.handle(now, server(CredentialKind::Standby, assignment("exe_1")));
        let (report, exit) = finish(&m.handle(now, Input::PrepareFinished(Err("boom".into()))));
        assert_eq!(exit, ExitCode::InstallFailed);
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
        assert_eq!((report, exit), (None, ExitCode::PrepareFailed));
    }

    #[test]
    fn preparation_past_its_bound_with_an_assignment_held_fails_the_install_requeueable() {
        let (mut m, start) = machine(None);
        m.handle(start, server(CredentialKind::Standby, assignment("exe_1")));
        // The confirmation is done; only the preparation is outstanding.
        m.handle(start, server(CredentialKind::Run, assignment("exe_1")));
        assert_eq!(m.next_deadline(), Some(start + PREPARE));
        let actions = m.handle(start + PREPARE, Input::Tick);
        assert_eq!(names(&actions), ["abort", "finish"]);
        let (report, exit) = finish(&actions);
        assert_eq!(exit, ExitCode::InstallFailed);
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
        m.handle(start + PREPARE, server(CredentialKind::Standby, assignment("exe_1")));
        assert_eq!(m.next_deadline(), Some(start + PREPARE + INSTALL), "only the install bound applies");
    }

    #[test]
    fn standby_refusals_map_to_exit_codes() {
        for (status, expected) in
            [(410, ExitCode::Unavailable), (401, ExitCode::Unauthorized), (403, ExitCode::Unauthorized)]
        {
            let (mut m, now) = machine(None);
            let actions = m.handle(now, refused(CredentialKind::Standby, status));
            assert_eq!(finish(&actions), (None, expected), "status {status}");
        }
    }

    #[test]
    fn run_credential_refused_before_start_is_withdrawn() {
        for status in [401, 403, 410] {
            let (mut m, now) = installing();
            let actions = m.handle(now, refused(CredentialKind::Run, status));
            assert_eq!(names(&actions), ["abort", "finish"]);
            assert_eq!(finish(&actions), (None, ExitCode::Withdrawn));
            // Nothing afterwards can start it.
            assert!(m.handle(now, Input::InstallFinished(Ok(()))).is_empty());
            assert!(m.handle(now, server(CredentialKind::Run, assignment("exe_1"))).is_empty());
        }
    }

    #[test]
    fn stale_standby_refusal_after_acceptance_is_ignored() {
        let (mut m, now) = installing();
        assert!(m.handle(now, refused(CredentialKind::Standby, 401)).is_empty());
    }

    #[test]
    fn a_refused_spec_fetch_exits_as_a_refusal_without_an_assignment() {
        for (refusal, expected) in
            [(Refusal::Gone, ExitCode::Unavailable), (Refusal::Unauthorized, ExitCode::Unauthorized)]
        {
            let (mut m, now) = machine(None);
            let actions = m.handle(now, Input::SpecRefused { refusal, message: "answered 410".into() });
            assert_eq!(finish(&actions), (None, expected), "{refusal:?}");
        }
    }

    #[test]
    fn a_refused_spec_fetch_with_an_assignment_held_fails_its_preparation_requeueable() {
        let (mut m, now) = machine(None);
        m.handle(now, server(CredentialKind::Standby, assignment("exe_1")));
        let refused = Input::SpecRefused { refusal: Refusal::Unauthorized, message: "answered 401".into() };
        let (report, exit) = finish(&m.handle(now, refused));
        assert_eq!(exit, ExitCode::InstallFailed);
        assert!(
            matches!(report, Some(EventKind::InstallFailed { requeueable: true, ref stage, ref message }) if stage == "prepare" && message.contains("answered 401")),
            "{report:?}"
        );
    }

    #[test]
    fn retired_only_before_an_assignment() {
        let (mut m, now) = machine(None);
        let actions = m.handle(now, server(CredentialKind::Standby, ServerMessage::Retired(Retired { reason: None })));
        assert_eq!(finish(&actions), (None, ExitCode::Success));

        let (mut m, now) = installing();
        assert!(
            m.handle(now, server(CredentialKind::Run, ServerMessage::Retired(Retired { reason: None }))).is_empty()
        );
    }

    #[test]
    fn deadline_without_assignment_exits_12() {
        let (mut m, start) = machine(Some(Duration::from_secs(30)));
        assert_eq!(m.next_deadline(), Some(start + Duration::from_secs(30)));
        assert!(m.handle(start + Duration::from_secs(29), Input::Tick).is_empty());
        let actions = m.handle(start + Duration::from_secs(30), Input::Tick);
        assert_eq!(finish(&actions), (None, ExitCode::DeadlinePassed));
    }

    #[test]
    fn unconfirmed_delivery_fails_requeueable_at_the_confirm_timeout() {
        let (mut m, start) = installing();
        m.handle(start, Input::InstallFinished(Ok(())));
        assert_eq!(m.next_deadline(), Some(start + CONFIRM));
        let actions = m.handle(start + CONFIRM, Input::Tick);
        let (report, exit) = finish(&actions);
        assert_eq!(exit, ExitCode::InstallFailed);
        assert!(
            matches!(report, Some(EventKind::InstallFailed { requeueable: true, ref stage, .. }) if stage == "confirm")
        );
    }

    #[test]
    fn install_timeout_aborts_the_install() {
        let (mut m, start) = installing();
        m.handle(start, server(CredentialKind::Run, assignment("exe_1")));
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
        let failure = InstallFailure::new(Stage::Check, Cause::InvalidRun, "cwd `../x` leaves the workspace");
        let (report, exit) = finish(&m.handle(now, Input::InstallFinished(Err(failure))));
        assert_eq!(exit, ExitCode::InstallFailed);
        assert!(matches!(report, Some(EventKind::InstallFailed { requeueable: false, .. })));
        assert!(m.handle(now, server(CredentialKind::Run, assignment("exe_1"))).is_empty(), "never starts");
    }

    #[test]
    fn run_credential_refused_by_an_install_call_is_withdrawn_unless_a_cancel_follows() {
        let refused =
            || InstallFailure::refused(Stage::Secrets, Refusal::Unauthorized, "GET /v1/executions/exe_1/secrets: 401");
        let (mut m, now) = installing();
        assert!(m.handle(now, Input::InstallFinished(Err(refused()))).is_empty(), "waits for a cancel");
        assert_eq!(m.next_deadline(), Some(now + WITHDRAW_GRACE));
        assert!(m.handle(now, server(CredentialKind::Run, assignment("exe_1"))).is_empty(), "never starts");
        let actions = m.handle(now + WITHDRAW_GRACE, Input::Tick);
        assert_eq!(finish(&actions), (None, ExitCode::Withdrawn));

        let (mut m, now) = installing();
        m.handle(now, Input::InstallFinished(Err(refused())));
        let cancel = ServerMessage::Cancel(Cancel { execution_id: "exe_1".into() });
        let actions = m.handle(now, server(CredentialKind::Run, cancel));
        assert_eq!(finish(&actions), (Some(EventKind::Cancelled), ExitCode::Success));
    }

    #[test]
    fn cancel_before_start_never_starts_the_run() {
        let (mut m, now) = installing();
        let cancel = ServerMessage::Cancel(Cancel { execution_id: "exe_1".into() });
        let actions = m.handle(now, server(CredentialKind::Run, cancel));
        assert_eq!(names(&actions), ["abort", "finish"]);
        assert_eq!(finish(&actions), (Some(EventKind::Cancelled), ExitCode::Success));
        assert!(m.handle(now, Input::InstallFinished(Ok(()))).is_empty());
        assert!(m.handle(now, server(CredentialKind::Run, assignment("exe_1"))).is_empty());
    }

    #[test]
    fn cancel_for_another_execution_is_ignored() {
        let (mut m, now) = installing();
        let cancel = ServerMessage::Cancel(Cancel { execution_id: "exe_9".into() });
        assert!(m.handle(now, server(CredentialKind::Run, cancel)).is_empty());
        let (mut m, now) = machine(None);
        let cancel = ServerMessage::Cancel(Cancel { execution_id: "exe_9".into() });
        assert!(m.handle(now, server(CredentialKind::Standby, cancel)).is_empty());
    }

    #[test]
    fn cancel_during_run_terminates_then_kills_after_grace() {
        let (mut m, start) = running();
        let cancel = ServerMessage::Cancel(Cancel { execution_id: "exe_1".into() });
        assert_eq!(names(&m.handle(start, server(CredentialKind::Run, cancel.clone()))), ["term"]);
        assert!(m.handle(start, server(CredentialKind::Run, cancel)).is_empty(), "a repeated cancel does nothing");
        assert_eq!(m.next_deadline(), Some(start + GRACE));
        assert!(m.handle(start + GRACE - Duration::from_millis(1), Input::Tick).is_empty());
        assert_eq!(names(&m.handle(start + GRACE, Input::Tick)), ["kill"]);
        assert_eq!(m.next_deadline(), None);
        assert_eq!(
            finish(&m.handle(start, Input::RunExited { code: 137 })),
            (Some(EventKind::Cancelled), ExitCode::Success)
        );
    }

    #[test]
    fn sigterm_by_phase() {
        let (mut m, now) = machine(None);
        assert_eq!(finish(&m.handle(now, Input::Terminate)), (None, ExitCode::Success));

        let (mut m, now) = installing();
        let (report, exit) = finish(&m.handle(now, Input::Terminate));
        assert_eq!(exit, ExitCode::InstallFailed);
        assert!(
            matches!(report, Some(EventKind::InstallFailed { requeueable: true, ref stage, .. }) if stage == "terminated"),
            "{report:?}"
        );

        let (mut m, now) = running();
        assert_eq!(names(&m.handle(now, Input::Terminate)), ["term"]);
        let (report, exit) = finish(&m.handle(now, Input::RunExited { code: 143 }));
        assert_eq!((report, exit), (Some(EventKind::Exited { code: 143 }), ExitCode::Success));
    }

    #[test]
    fn run_credential_refused_during_the_run_stops_it() {
        let (mut m, now) = running();
        assert_eq!(names(&m.handle(now, refused(CredentialKind::Run, 401))), ["term"]);
        assert_eq!(finish(&m.handle(now, Input::RunExited { code: 143 })), (None, ExitCode::Withdrawn));
    }

    #[test]
    fn run_exit_is_reported() {
        let (mut m, now) = running();
        assert_eq!(
            finish(&m.handle(now, Input::RunExited { code: 7 })),
            (Some(EventKind::Exited { code: 7 }), ExitCode::Success)
        );
        assert!(m.is_done());
        assert!(m.handle(now, Input::Terminate).is_empty(), "nothing after Finish");
    }

    #[test]
    fn spawn_failure_is_an_install_failure() {
        let (mut m, now) = running();
        let failure = InstallFailure::new(Stage::Start, Cause::InvalidRun, "`nope`: command not found");
        let (report, exit) = finish(&m.handle(now, Input::RunFailedToStart(failure)));
        assert_eq!(exit, ExitCode::InstallFailed);
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
            m.handle(start, server(CredentialKind::Standby, assignment("exe_1")));
            m.handle(start, Input::PrepareFinished(Ok(())));
            m.handle(later, Input::Tick);
            m.handle(start, Input::InstallFinished(Ok(())));
            m.handle(start, server(CredentialKind::Run, assignment("exe_1")));
            m.handle(start, Input::Terminate);
            let _ = m.next_deadline();
            m.handle(later, Input::Tick);
            m.handle(time::after(later, time::FOREVER), Input::Tick);
        }
    }
}
