//! The driver: owns every task and process of one agent's life, feeds what
//! happens into the [`Lifecycle`] state machine and carries out its actions.
//!
//! Shutdown follows one path whatever ended the life (a run's exit, a
//! refusal, a signal, a failure): report, stop the run, the install, the MCP
//! servers and the shell, close the control socket, kill and reap anything
//! left, exit.

use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use standby_protocol::{Event, EventKind, Secret, ServerMessage, Spec, paths};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::api::{Api, ApiError, Class, call_backoff, retry};
use crate::config::{Config, Deadline};
use crate::control::{self, ControlConfig, ControlEvent, Login};
use crate::exit::Exit;
use crate::install::{self, InstallInput, Installed, Prepared};
use crate::lifecycle::{Action, Credential, Input, InstallFailure, Lifecycle, RunSignal, Timeouts};
use crate::logship::{self, ShipReport};
use crate::mcp::McpSupervisor;
use crate::redact::Redactor;
use crate::shell::IdleShell;
use crate::{prepare, reaper};

/// How long the final log upload may take once the run has exited.
const LOG_DRAIN_BOUND: Duration = Duration::from_secs(30);
/// Grace for stray children at exit.
const CHILD_GRACE: Duration = Duration::from_secs(2);

/// Where the spec comes from.
#[derive(Debug)]
pub enum SpecSource {
    /// Already read and parsed from `STANDBY_SPEC`.
    File(Box<Spec>),
    Server,
}

/// Reads the spec file named by the configuration, if any. A missing or
/// malformed file is bad configuration (exit 2).
pub fn spec_source(config: &Config) -> Result<SpecSource, String> {
    let Some(path) = &config.spec else {
        return Ok(SpecSource::Server);
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("invalid STANDBY_SPEC (--spec): cannot read {}: {e}", path.display()))?;
    let spec: Spec = serde_json::from_str(&text).map_err(|e| {
        format!(
            "invalid STANDBY_SPEC (--spec): {} is not a spec: {}",
            path.display(),
            standby_protocol::describe_json_error(&e)
        )
    })?;
    Ok(SpecSource::File(Box::new(spec)))
}

/// What the preparation task reports.
enum PrepEvent {
    SpecLoaded(Box<Spec>),
}

enum PrepFailure {
    Refused(u16),
    Failed(String),
}

/// The run once started.
struct Started {
    execution_id: String,
    pgid: i32,
    /// `None` once the run's exit has been collected.
    exit: Option<JoinHandle<i32>>,
    shipper: JoinHandle<ShipReport>,
    started_event: JoinHandle<()>,
}

/// Runs one agent life to its end and returns how it ended.
pub async fn run(config: Config, spec_source: SpecSource) -> Exit {
    if let Err(e) = reaper::become_subreaper() {
        tracing::warn!(error = %e, "cannot become a child subreaper; orphans of children will not be reaped");
    }
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let reaper_task = reaper::spawn_reaper(shutdown_rx);
    let exit = match Driver::new(config) {
        Ok(driver) => driver.run(spec_source).await,
        Err(message) => {
            tracing::error!(message, "cannot start");
            Exit::Internal
        }
    };
    let _ = shutdown_tx.send(true);
    reaper::kill_remaining_children(CHILD_GRACE).await;
    let _ = reaper_task.await;
    exit
}

struct Driver {
    config: Config,
    api: Api,
    machine: Lifecycle,
    spec: Option<Spec>,
    prepared: Option<Prepared>,
    run_credential: Option<(String, Secret)>,
    assigned_at: Option<Instant>,
    confirmed_at: Option<Instant>,
    install: Option<InstallTask>,
    installed: Option<Installed>,
    started: Option<Started>,
}

impl Driver {
    fn new(config: Config) -> Result<Self, String> {
        let api = Api::new(&config.server_url).map_err(|e| format!("HTTP client: {e}"))?;
        let start = Instant::now();
        let standby_deadline = config.deadline.map(|d| deadline_instant(d, start));
        let timeouts = Timeouts {
            standby_deadline,
            confirm: config.confirm_timeout,
            install: config.install_timeout,
            grace: config.cancel_grace,
        };
        Ok(Self {
            config,
            api,
            machine: Lifecycle::new(timeouts),
            spec: None,
            prepared: None,
            run_credential: None,
            assigned_at: None,
            confirmed_at: None,
            install: None,
            installed: None,
            started: None,
        })
    }

    async fn run(mut self, spec_source: SpecSource) -> Exit {
        let mut sigterm = signal(SignalKind::terminate()).ok();
        let mut sigint = signal(SignalKind::interrupt()).ok();

        let (login_tx, login_rx) =
            watch::channel(Login { kind: Credential::Standby, secret: self.config.token.clone() });
        let login_rx_for_spec = login_rx.clone();
        let (status_tx, status_rx) = watch::channel(self.machine.heartbeat());
        let (control_tx, mut control_rx) = mpsc::channel(16);
        let control_config = ControlConfig {
            socket_url: self.config.socket_url.clone(),
            heartbeat_interval: self.config.heartbeat_interval,
        };
        let (control_stop_tx, control_stop_rx) = watch::channel(false);
        let control = control::spawn(control_config, login_rx, status_rx, control_tx, control_stop_rx);

        let (prep_tx, mut prep_rx) = mpsc::channel(1);
        let mut prep: Option<JoinHandle<Result<Prepared, PrepFailure>>> = Some(tokio::spawn(prepare_all(
            self.config.clone(),
            self.api.clone(),
            spec_source,
            login_rx_for_spec,
            prep_tx,
        )));

        let mut finish = None;
        while finish.is_none() {
            let deadline = self.machine.next_deadline();
            let input = tokio::select! {
                Some(event) = control_rx.recv() => match event {
                    ControlEvent::Connected(credential) => Input::Connected(credential),
                    ControlEvent::Refused { credential, status } => Input::Refused { credential, status },
                    ControlEvent::Message { credential, message } => {
                        let message = *message;
                        if credential == Credential::Run
                            && self.confirmed_at.is_none()
                            && matches!(&message, ServerMessage::Assignment(a) if Some(a.execution_id.as_str()) == self.machine.execution_id())
                        {
                            self.confirmed_at = Some(Instant::now());
                        }
                        Input::Server { credential, message }
                    }
                },
                Some(PrepEvent::SpecLoaded(spec)) = prep_rx.recv() => {
                    self.spec_loaded(*spec);
                    continue;
                }
                result = join(&mut prep) => {
                    prep = None;
                    // The spec is sent before preparation ends; take it even
                    // if this branch won the race against the message.
                    while let Ok(PrepEvent::SpecLoaded(spec)) = prep_rx.try_recv() {
                        self.spec_loaded(*spec);
                    }
                    match result.unwrap_or_else(|e| Err(PrepFailure::Failed(format!("preparation task: {e}")))) {
                        Ok(prepared) => {
                            self.prepared = Some(prepared);
                            Input::PrepareFinished(Ok(()))
                        }
                        // Once an assignment is accepted the standby credential
                        // is revoked; a spec fetch it fails is a failed
                        // preparation (requeueable), not a standby refusal.
                        Err(PrepFailure::Refused(status)) if self.machine.execution_id().is_some() => {
                            Input::PrepareFinished(Err(format!("fetching the spec: the server answered {status} after the assignment was accepted")))
                        }
                        Err(PrepFailure::Refused(status)) => Input::Refused { credential: Credential::Standby, status },
                        Err(PrepFailure::Failed(message)) => {
                            tracing::error!(error = message, "preparation failed");
                            Input::PrepareFinished(Err(message))
                        }
                    }
                }
                result = join_install(&mut self.install) => {
                    self.install = None;
                    let Ok((prepared, result)) = result else {
                        tracing::error!("the install task failed");
                        finish = Some((None, Exit::Internal));
                        continue;
                    };
                    self.prepared = Some(prepared);
                    match result {
                        Some(Ok(installed)) => {
                            self.installed = Some(installed);
                            Input::InstallFinished(Ok(()))
                        }
                        Some(Err(failure)) => Input::InstallFinished(Err(failure)),
                        None => continue,
                    }
                }
                code = join_run(&mut self.started) => Input::RunExited { code },
                _ = recv_signal(&mut sigterm) => Input::Terminate,
                _ = recv_signal(&mut sigint) => Input::Terminate,
                _ = sleep_until(deadline) => Input::Tick,
            };
            let mut inputs = vec![input];
            while let Some(input) = inputs.pop() {
                for action in self.machine.handle(Instant::now(), input) {
                    match action {
                        Action::Finish { report, exit } => finish = Some((report, exit)),
                        other => inputs.extend(self.act(other, &login_tx)),
                    }
                }
            }
            let _ = status_tx.send(self.machine.heartbeat());
        }
        let (report, exit) = finish.unwrap_or((None, Exit::Internal));
        if let Some(prep) = prep {
            prep.abort();
        }
        self.wind_down(report).await;
        let _ = control_stop_tx.send(true);
        let _ = control.await;
        tracing::info!(exit = %exit, "standby exiting");
        exit
    }

    fn spec_loaded(&mut self, spec: Spec) {
        if let Some(at) = spec.deadline.as_deref() {
            match crate::config::parse_time(at) {
                Ok(at) => self.machine.tighten_standby_deadline(deadline_instant(Deadline::At(at), Instant::now())),
                Err(e) => tracing::warn!(error = e, "the spec's deadline is ignored"),
            }
        }
        self.spec = Some(spec);
    }

    /// Carries out one action; returns what it led to, if anything.
    fn act(&mut self, action: Action, login: &watch::Sender<Login>) -> Option<Input> {
        match action {
            Action::Confirm { execution_id, credential } => {
                self.assigned_at = Some(Instant::now());
                self.run_credential = Some((execution_id, credential.clone()));
                let _ = login.send(Login { kind: Credential::Run, secret: credential });
            }
            Action::Install(assignment) => {
                let Some(mut prepared) = self.prepared.take() else {
                    tracing::error!("install requested before preparation finished");
                    return None;
                };
                let input = InstallInput {
                    api: self.api.clone(),
                    credential: assignment.run_credential.clone(),
                    execution_id: assignment.execution_id.clone(),
                    run: assignment.run,
                    root: self.config.workspace.clone(),
                    spec: self.spec.clone().unwrap_or_else(|| Spec {
                        workspace: Default::default(),
                        mcp_servers: Vec::new(),
                        shell: None,
                        deadline: None,
                    }),
                    plan: self.config.install_plan,
                    deadline: Instant::now() + self.config.install_timeout,
                };
                let (abort_tx, abort_rx) = oneshot::channel();
                let task = tokio::spawn(async move {
                    let result = tokio::select! {
                        result = install::install(&input, &mut prepared) => Some(result),
                        _ = abort_rx => None,
                    };
                    (prepared, result)
                });
                self.install = Some((Some(abort_tx), task));
            }
            Action::AbortInstall => {
                if let Some(abort) = self.install.as_mut().and_then(|(abort, _)| abort.take()) {
                    let _ = abort.send(());
                }
            }
            Action::StartRun => {
                if let Err(failure) = self.start_run() {
                    return Some(Input::RunFailedToStart(failure));
                }
            }
            Action::SignalRun(which) => {
                if let Some(started) = &self.started {
                    let signal = match which {
                        RunSignal::Terminate => Signal::SIGTERM,
                        RunSignal::Kill => Signal::SIGKILL,
                    };
                    tracing::info!(execution_id = %started.execution_id, ?signal, "signalling the run's process group");
                    let _ = killpg(Pid::from_raw(started.pgid), signal);
                }
            }
            Action::Finish { .. } => {}
        }
        None
    }

    /// Spawns the run on the prepared terminal, then (off the critical
    /// path) reports `started` and ships its output.
    fn start_run(&mut self) -> Result<(), InstallFailure> {
        let installed = self.installed.take().ok_or_else(|| InstallFailure::new("start", "nothing installed", true))?;
        let prepared =
            self.prepared.as_mut().ok_or_else(|| InstallFailure::new("start", "no prepared terminal", true))?;
        let (execution_id, credential) =
            self.run_credential.clone().ok_or_else(|| InstallFailure::new("start", "no run credential", true))?;
        let shell =
            prepared.shell.take().ok_or_else(|| InstallFailure::new("start", "the idle shell is gone", true))?;
        let mut run = shell
            .replace(&installed.argv, &installed.cwd, &installed.env)
            .map_err(|e| InstallFailure::new("start", format!("starting `{}`: {e}", installed.argv[0]), false))?;
        let started_at = Instant::now();
        let pgid = i32::try_from(run.pid()).unwrap_or(i32::MAX);
        self.log_timing(&execution_id, &installed, started_at);

        let redactor = Redactor::new(installed.secrets.iter().map(Secret::expose).chain([self.config.token.expose()]));
        let output = run.take_output();
        let shipper = tokio::spawn(logship::ship(
            self.api.clone(),
            credential.clone(),
            execution_id.clone(),
            output,
            redactor,
            self.config.event_timeout,
        ));
        let started_event = tokio::spawn({
            let (api, id, timeout) = (self.api.clone(), execution_id.clone(), self.config.event_timeout);
            async move {
                if let Err(e) = report(&api, &credential, &id, EventKind::Started, timeout).await {
                    tracing::warn!(execution_id = id, error = %e, "`started` was not acknowledged");
                }
            }
        });
        let exit = tokio::spawn(async move { run.wait().await });
        self.started = Some(Started { execution_id, pgid, exit: Some(exit), shipper, started_event });
        Ok(())
    }

    /// One line with the duration of every install step, the confirmation
    /// and the critical path from assignment to start.
    fn log_timing(&self, execution_id: &str, installed: &Installed, started_at: Instant) {
        let since_assignment = |at: Option<Instant>| at.zip(self.assigned_at).map(|(at, from)| at.duration_since(from));
        let steps = installed
            .steps
            .iter()
            .map(|(name, took)| format!("{name}={}ms", took.as_millis()))
            .collect::<Vec<_>>()
            .join(" ");
        tracing::info!(
            execution_id,
            confirm_ms = since_assignment(self.confirmed_at).map(|d| d.as_millis() as u64),
            critical_path_ms = since_assignment(Some(started_at)).map(|d| d.as_millis() as u64),
            plan = ?self.config.install_plan,
            steps,
            degraded = ?installed.degraded,
            "run started"
        );
    }

    /// The common end: report, stop everything this life started.
    async fn wind_down(&mut self, report_kind: Option<EventKind>) {
        if let Some((abort, task)) = self.install.take() {
            if let Some(abort) = abort {
                let _ = abort.send(());
            }
            if let Ok((prepared, _)) = task.await {
                self.prepared = Some(prepared);
            }
        }
        if let Some(started) = self.started.take() {
            if let Some(exit) = started.exit {
                if !exit.is_finished() {
                    let _ = killpg(Pid::from_raw(started.pgid), Signal::SIGKILL);
                }
                let _ = exit.await;
            }
            let _ = started.started_event.await;
            match tokio::time::timeout(LOG_DRAIN_BOUND, started.shipper).await {
                Ok(Ok(shipped)) => tracing::info!(
                    bytes = shipped.bytes,
                    chunks = shipped.chunks,
                    lost = shipped.lost_bytes,
                    "run output shipped"
                ),
                _ => tracing::warn!("run output was not fully shipped"),
            }
        }
        if let (Some(kind), Some((execution_id, credential))) = (report_kind, &self.run_credential) {
            let name = event_name(&kind);
            match report(&self.api, credential, execution_id, kind, self.config.event_timeout).await {
                Ok(()) => tracing::info!(execution_id, event = name, "reported"),
                Err(e) => tracing::error!(execution_id, event = name, error = %e, "report was not acknowledged"),
            }
        }
        if let Some(mut prepared) = self.prepared.take() {
            prepared.mcp.stop().await;
            if let Some(shell) = prepared.shell.take() {
                shell.close().await;
            }
        }
    }
}

fn event_name(kind: &EventKind) -> &'static str {
    match kind {
        EventKind::Started => "started",
        EventKind::Exited { .. } => "exited",
        EventKind::Cancelled => "cancelled",
        EventKind::InstallFailed { .. } => "install_failed",
    }
}

/// Posts an event until it is acknowledged, keeping its `event_id` across
/// retries, for at most `timeout`.
pub async fn report(
    api: &Api,
    credential: &Secret,
    execution_id: &str,
    kind: EventKind,
    timeout: Duration,
) -> Result<(), ApiError> {
    let event =
        Event { event_id: format!("{execution_id}-{}-{:016x}", event_name(&kind), rand::random::<u64>()), kind };
    let path = paths::events(execution_id);
    retry(&format!("POST {path}"), Instant::now() + timeout, call_backoff(), || api.post(credential, &path, &event))
        .await
}

/// Loads the spec, prepares the workspace, starts the MCP servers and opens
/// the idle shell.
async fn prepare_all(
    config: Config,
    api: Api,
    source: SpecSource,
    login: watch::Receiver<Login>,
    events: mpsc::Sender<PrepEvent>,
) -> Result<Prepared, PrepFailure> {
    let spec = match source {
        SpecSource::File(spec) => *spec,
        SpecSource::Server => fetch_spec(&api, &login).await?,
    };
    let _ = events.send(PrepEvent::SpecLoaded(Box::new(spec.clone()))).await;
    let root = &config.workspace;
    let workspace = prepare::prepare(root, &spec.workspace).await.map_err(|e| PrepFailure::Failed(e.to_string()))?;
    let mcp = McpSupervisor::start(&spec.mcp_servers, root, config.mcp_ready_timeout)
        .await
        .map_err(|e| PrepFailure::Failed(e.to_string()))?;
    let shell_argv = spec.shell.clone().filter(|argv| !argv.is_empty()).unwrap_or_else(default_shell);
    let shell = IdleShell::open(&shell_argv, root, &crate::process::child_env())
        .map_err(|e| PrepFailure::Failed(format!("idle shell `{}`: {e}", shell_argv.join(" "))))?;
    tracing::info!(fingerprint = %workspace.fingerprint, skipped = workspace.skipped, "ready");
    Ok(Prepared { shell: Some(shell), mcp, fingerprint: workspace.fingerprint })
}

fn default_shell() -> Vec<String> {
    let bash = PathBuf::from("/bin/bash");
    vec![if bash.exists() { bash.display().to_string() } else { "/bin/sh".to_owned() }]
}

/// `GET /v1/standby/spec`, retrying transient failures without end (the
/// deadline and SIGTERM still apply: they end the task from outside). Each
/// attempt uses the credential the agent currently holds: an assignment
/// accepted during the fetch revokes the standby credential, and the run
/// credential is the one that can still be presented.
async fn fetch_spec(api: &Api, login: &watch::Receiver<Login>) -> Result<Spec, PrepFailure> {
    let path = standby_protocol::SPEC_PATH;
    let forever = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
    tracing::info!("fetching the spec");
    let backoff = call_backoff().with_max_delay(control::BACKOFF_CAP);
    retry(&format!("GET {path}"), forever, backoff, || {
        let secret = login.borrow().secret.clone();
        async move { api.get_json(&secret, path).await }
    })
    .await
    .map_err(|e| match (e.class(), e.status()) {
        (Class::Unauthorized | Class::Gone, Some(status)) => PrepFailure::Refused(status),
        _ => PrepFailure::Failed(format!("fetching the spec: {e}")),
    })
}

fn deadline_instant(deadline: Deadline, start: Instant) -> Instant {
    match deadline {
        Deadline::After(after) => start + after,
        Deadline::At(at) => {
            let from_now = at.duration_since(std::time::SystemTime::now()).unwrap_or_default();
            Instant::now() + from_now
        }
    }
}

/// Waits for an optional task; never resolves when there is none.
async fn join<T>(task: &mut Option<JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    match task {
        Some(handle) => handle.await,
        None => std::future::pending().await,
    }
}

/// The abort switch (taken when used) and the task, which hands the
/// prepared sandbox back whether it finished or was aborted.
type InstallTask = (Option<oneshot::Sender<()>>, JoinHandle<(Prepared, Option<Result<Installed, InstallFailure>>)>);

async fn join_install(
    task: &mut Option<InstallTask>,
) -> Result<(Prepared, Option<Result<Installed, InstallFailure>>), tokio::task::JoinError> {
    match task {
        Some((_, handle)) => handle.await,
        None => std::future::pending().await,
    }
}

async fn join_run(started: &mut Option<Started>) -> i32 {
    let Some(exit) = started.as_mut().and_then(|s| s.exit.as_mut()) else {
        return std::future::pending().await;
    };
    let code = exit.await.unwrap_or(1);
    if let Some(started) = started {
        started.exit = None;
    }
    code
}

async fn recv_signal(stream: &mut Option<tokio::signal::unix::Signal>) {
    match stream {
        Some(stream) => {
            stream.recv().await;
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
