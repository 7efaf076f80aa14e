//! The driver: owns every task and process of one agent's life, feeds what
//! happens into the [`Lifecycle`] state machine and carries out its actions.
//!
//! Shutdown follows one path whatever ended the life (a run's exit, a
//! refusal, a signal, a failure): report, stop the run, the install, the MCP
//! servers and the shell, close the control socket, kill and reap anything
//! left, exit.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use standby_protocol::layout::StateDir;
use standby_protocol::{CredentialKind, Event, EventKind, ExitCode, Refusal, Secret, ServerMessage, Spec, paths};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::api::{Api, ApiError, call_backoff, retry};
use crate::config::Config;
use crate::control::{self, ControlConfig, ControlEvent, Login};
use crate::install::{self, InstallInput, Installed, Prepared};
use crate::lifecycle::{Action, Input, InstallFailure, Lifecycle, RunSignal, Timeouts};
use crate::logship::{self, ShipReport};
use crate::mcp::McpSupervisor;
use crate::reconnect::BACKOFF_CAP;
use crate::redact::Redactor;
use crate::shell::{IdleShell, RunGroup, ShellError};
use crate::telemetry::{Measured, RunTrace};
use crate::{prepare, process, reaper, time};

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
    /// The spec fetch was refused; the message says how.
    Refused(Refusal, String),
    Failed(String),
}

/// The run once started.
struct Started {
    execution_id: String,
    group: RunGroup,
    /// `None` once the run's exit has been collected.
    exit: Option<JoinHandle<i32>>,
    shipper: JoinHandle<ShipReport>,
    started_event: JoinHandle<()>,
}

/// Runs one agent life to its end and returns how it ended. `tls` is the
/// one trust store of the control socket and every HTTP call.
pub async fn run(config: Config, spec_source: SpecSource, tls: Arc<rustls::ClientConfig>) -> ExitCode {
    if let Err(e) = reaper::become_subreaper() {
        tracing::warn!(error = %e, "cannot become a child subreaper; orphans of children will not be reaped");
    }
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let reaper_task = reaper::spawn_reaper(shutdown_rx);
    let exit = match Driver::new(config, tls) {
        Ok(driver) => driver.run(spec_source).await,
        Err(message) => {
            tracing::error!(message, "cannot start");
            ExitCode::Internal
        }
    };
    let _ = shutdown_tx.send(true);
    reaper::kill_remaining_children(CHILD_GRACE).await;
    let _ = reaper_task.await;
    exit
}

struct Driver {
    config: Config,
    tls: Arc<rustls::ClientConfig>,
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
    /// The span exporter (`STANDBY_OTLP_ENDPOINT`); `None`: nothing traced.
    exporter: Option<standby_otlp::Exporter>,
    /// Where the run's spans go, once assigned (only with an exporter).
    trace: Option<RunTrace>,
}

impl Driver {
    fn new(config: Config, tls: Arc<rustls::ClientConfig>) -> Result<Self, String> {
        let api = Api::with_tls(&config.server_url, Arc::clone(&tls), config.insecure)
            .map_err(|e| format!("HTTP client: {e}"))?;
        let start = Instant::now();
        let standby_deadline =
            config.deadline.map(|d| time::deadline_instant(d, start, start, std::time::SystemTime::now()));
        // Tracing never stops an agent: a client that cannot be built is
        // a warning and no spans.
        let exporter = config.otlp_traces_url.as_ref().and_then(|url| {
            crate::telemetry::exporter(url, &tls)
                .inspect_err(|error| tracing::warn!(error, "no spans will be exported"))
                .ok()
        });
        let timeouts = Timeouts {
            standby_deadline,
            prepare_deadline: Some(time::after(start, config.prepare_timeout)),
            prepare: config.prepare_timeout,
            confirm: config.confirm_timeout,
            install: config.install_timeout,
            grace: config.cancel_grace,
        };
        Ok(Self {
            config,
            tls,
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
            exporter,
            trace: None,
        })
    }

    async fn run(mut self, spec_source: SpecSource) -> ExitCode {
        let mut sigterm = signal(SignalKind::terminate()).ok();
        let mut sigint = signal(SignalKind::interrupt()).ok();

        let (login_tx, login_rx) =
            watch::channel(Login { kind: CredentialKind::Standby, secret: self.config.token.clone() });
        let (status_tx, status_rx) = watch::channel(self.machine.heartbeat());
        let (control_tx, mut control_rx) = mpsc::channel(16);
        let control_config = ControlConfig {
            socket_url: self.config.socket_url.clone(),
            heartbeat_interval: self.config.heartbeat_interval,
            tls: Arc::clone(&self.tls),
        };
        let (control_stop_tx, control_stop_rx) = watch::channel(false);
        let control = control::spawn(control_config, login_rx, status_rx, control_tx, control_stop_rx);

        let (prep_tx, mut prep_rx) = mpsc::channel(1);
        let mut prep: Option<JoinHandle<Result<Prepared, PrepFailure>>> =
            Some(tokio::spawn(prepare_all(self.config.clone(), self.api.clone(), spec_source, prep_tx)));

        let mut finish = None;
        while finish.is_none() {
            let deadline = self.machine.next_deadline();
            let input = tokio::select! {
                Some(event) = control_rx.recv() => match event {
                    ControlEvent::Connected(credential) => Input::Connected(credential),
                    ControlEvent::Refused { credential, refusal } => Input::Refused { credential, refusal },
                    ControlEvent::Message { credential, message } => {
                        let message = *message;
                        if credential == CredentialKind::Run
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
                    Input::SpecLoaded
                }
                result = join(&mut prep) => {
                    prep = None;
                    // The spec is sent before preparation ends; take it even
                    // if this branch won the race against the message (the
                    // machine counts a prepared sandbox's spec as loaded).
                    while let Ok(PrepEvent::SpecLoaded(spec)) = prep_rx.try_recv() {
                        self.spec_loaded(*spec);
                    }
                    match result.unwrap_or_else(|e| Err(PrepFailure::Failed(format!("preparation task: {e}")))) {
                        Ok(prepared) => {
                            self.prepared = Some(prepared);
                            Input::PrepareFinished(Ok(()))
                        }
                        Err(PrepFailure::Refused(refusal, message)) => Input::SpecRefused { refusal, message },
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
                        finish = Some((None, ExitCode::Internal));
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
                        other => inputs.extend(self.act(other, &login_tx).await),
                    }
                }
            }
            // Only a change wakes the control task (which sends it at once).
            let status = self.machine.heartbeat();
            status_tx.send_if_modified(|current| {
                let changed = *current != status;
                if changed {
                    *current = status;
                }
                changed
            });
        }
        let (report, exit) = finish.unwrap_or((None, ExitCode::Internal));
        if let Some(prep) = prep {
            // Dropping the preparation kills what it started (git and setup
            // process groups, MCP servers); wait until it is dropped.
            prep.abort();
            let _ = prep.await;
        }
        self.wind_down(report).await;
        let _ = control_stop_tx.send(true);
        let _ = control.await;
        if let Some(exporter) = self.exporter.take() {
            let dropped = exporter.shutdown().await;
            if dropped > 0 {
                tracing::warn!(dropped, "spans were not exported: the OTLP endpoint failed or did not answer in time");
            }
        }
        tracing::info!(exit = %exit, "standby exiting");
        exit
    }

    fn spec_loaded(&mut self, spec: Spec) {
        if let Some(at) = spec.deadline.as_deref() {
            match crate::config::parse_time(at) {
                Ok(at) => {
                    let now = Instant::now();
                    let deadline =
                        time::deadline_instant(time::Deadline::At(at), now, now, std::time::SystemTime::now());
                    self.machine.tighten_standby_deadline(deadline);
                }
                Err(e) => tracing::warn!(error = e, "the spec's deadline is ignored"),
            }
        }
        self.spec = Some(spec);
    }

    /// Carries out one action; returns what it led to, if anything.
    async fn act(&mut self, action: Action, login: &watch::Sender<Login>) -> Option<Input> {
        match action {
            Action::Accepted { execution_id, credential } => {
                self.assigned_at = Some(Instant::now());
                self.run_credential = Some((execution_id, credential));
            }
            Action::Confirm { credential } => {
                let _ = login.send(Login { kind: CredentialKind::Run, secret: credential });
            }
            Action::Install(assignment) => {
                let Some(mut prepared) = self.prepared.take() else {
                    tracing::error!("install requested before preparation finished");
                    return None;
                };
                if self.exporter.is_some() {
                    let anchor = (Instant::now(), std::time::SystemTime::now());
                    let context = assignment.trace_context.as_ref();
                    self.trace = Some(RunTrace::new(&assignment.execution_id, context, anchor));
                }
                let input = InstallInput {
                    api: self.api.clone(),
                    credential: assignment.run_credential.clone(),
                    execution_id: assignment.execution_id.clone(),
                    run: assignment.run,
                    root: self.config.workspace.clone(),
                    spec: self.spec.clone().unwrap_or_default(),
                    plan: self.config.install_plan,
                    deadline: time::after(Instant::now(), self.config.install_timeout),
                    // Once: a second install in this life would find the
                    // clone as the first left it, not as preparation did.
                    checkouts: std::mem::take(&mut prepared.checkouts),
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
                if let Err(failure) = self.start_run().await {
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
                    if let Err(error) = started.group.signal(signal) {
                        tracing::warn!(execution_id = %started.execution_id, %error, "cannot signal the run");
                    }
                }
            }
            Action::Finish { .. } => {}
        }
        None
    }

    /// Spawns the run on the prepared terminal, then (off the critical
    /// path) reports `started` and ships its output.
    async fn start_run(&mut self) -> Result<(), InstallFailure> {
        let missing = InstallFailure::missing;
        let installed = self.installed.take().ok_or_else(|| missing("nothing installed"))?;
        let prepared = self.prepared.as_mut().ok_or_else(|| missing("no prepared terminal"))?;
        let (execution_id, credential) = self.run_credential.clone().ok_or_else(|| missing("no run credential"))?;
        let shell = prepared.shell.take().ok_or_else(InstallFailure::shell_gone)?;
        // Killing and reaping the shell and forking the run block: off the
        // runtime, which keeps the heartbeats going meanwhile.
        let spawning = Instant::now();
        let (installed, replaced) = process::off_runtime(move || {
            let replaced = shell.replace(&installed.argv, &installed.cwd, &installed.env);
            (installed, replaced)
        })
        .await
        .ok_or_else(|| missing("the task starting the run failed"))?;
        let mut run = replaced.map_err(|e| InstallFailure::start_failed(&installed.argv[0], &e))?;
        let started_at = Instant::now();
        let group = run.group();
        let timing = self.log_timing(&execution_id, &installed, started_at.duration_since(spawning), started_at);
        if let (Some(exporter), Some(trace)) = (&self.exporter, &self.trace) {
            let confirm = self.assigned_at.zip(self.confirmed_at);
            let measured = Measured { confirm, steps: &installed.steps, spawn: (spawning, started_at) };
            trace.spans(&measured).into_iter().for_each(|span| exporter.tracer().emit(span));
        }

        let redactor = Redactor::new(installed.secrets.iter().map(Secret::expose).chain([self.config.token.expose()]));
        let output = run.take_output();
        let shipper = tokio::spawn(logship::ship(
            self.api.clone(),
            credential.clone(),
            execution_id.clone(),
            output,
            redactor,
            logship::ShipConfig {
                spool_dir: StateDir::of(&self.config.workspace).path().to_path_buf(),
                bound: self.config.log_spool_max,
                drain: logship::DRAIN_BOUND,
                attempt: logship::ATTEMPT_BOUND,
            },
        ));
        let started_event = tokio::spawn({
            let (api, id, timeout) = (self.api.clone(), execution_id.clone(), self.config.event_timeout);
            async move {
                let started = new_event(&id, EventKind::Started).with_install_timing(timing);
                if let Err(e) = report(&api, &credential, &id, started, timeout).await {
                    tracing::warn!(execution_id = id, error = %e, "`started` was not acknowledged");
                }
            }
        });
        let exit = tokio::spawn(async move { run.wait().await });
        self.started = Some(Started { execution_id, group, exit: Some(exit), shipper, started_event });
        Ok(())
    }

    /// One line with the duration of every install step, the confirmation,
    /// the spawn on the prepared terminal and the critical path from
    /// assignment to start, in milliseconds to a tenth (a warm start is a
    /// few of them); the same, in microseconds by name, for the `started`
    /// event (contract 1.3, `install_us`).
    fn log_timing(
        &self,
        execution_id: &str,
        installed: &Installed,
        spawn: Duration,
        started_at: Instant,
    ) -> BTreeMap<String, u64> {
        let since_assignment = |at: Option<Instant>| at.zip(self.assigned_at).map(|(at, from)| at.duration_since(from));
        let micros = |took: Duration| u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let mut timing: BTreeMap<String, u64> =
            installed.steps.iter().map(|timed| (timed.stage.name().to_owned(), micros(timed.took))).collect();
        timing.insert("spawn".to_owned(), micros(spawn));
        if let Some(confirm) = since_assignment(self.confirmed_at) {
            timing.insert("confirm".to_owned(), micros(confirm));
        }
        if let Some(critical_path) = since_assignment(Some(started_at)) {
            timing.insert("critical_path".to_owned(), micros(critical_path));
        }
        let steps = installed
            .steps
            .iter()
            .map(|timed| format!("{}={}ms", timed.stage, tenths_ms(timed.took)))
            .collect::<Vec<_>>()
            .join(" ");
        tracing::info!(
            execution_id,
            confirm_ms = since_assignment(self.confirmed_at).map(tenths_ms),
            spawn_ms = tenths_ms(spawn),
            critical_path_ms = since_assignment(Some(started_at)).map(tenths_ms),
            plan = ?self.config.install_plan,
            steps,
            degraded = ?installed.degraded,
            "run started"
        );
        timing
    }

    /// The common end: report, stop everything this life started.
    async fn wind_down(&mut self, report_kind: Option<EventKind>) {
        let mut log_lost = 0;
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
                    // Best effort: the run is killed at the end whatever it does.
                    let _ = started.group.signal(Signal::SIGKILL);
                }
                let _ = exit.await;
            }
            let _ = started.started_event.await;
            // No bound of its own here: the output ends at most 2 s after
            // the run, and the shipper then gives up once its drain bound
            // passes without progress, so waiting for its count is bounded,
            // and a server that keeps taking the log gets all of it.
            match started.shipper.await {
                Ok(shipped) => {
                    tracing::info!(
                        bytes = shipped.bytes,
                        chunks = shipped.chunks,
                        lost = shipped.lost_bytes,
                        "run output shipped"
                    );
                    log_lost = shipped.lost_bytes;
                }
                Err(error) => {
                    tracing::error!(%error, "the log shipper failed; how much of the output was lost is unknown")
                }
            }
        }
        if self.run_credential.is_some() {
            let repos = self.spec.as_ref().map(|spec| spec.workspace.repos.as_slice()).unwrap_or_default();
            crate::hygiene::remove_run_files(&self.config.workspace, repos).await;
        }
        if let (Some(kind), Some((execution_id, credential))) = (report_kind, &self.run_credential) {
            let name = kind.name();
            let event = new_event(execution_id, kind).with_log_lost(log_lost);
            match report(&self.api, credential, execution_id, event, self.config.event_timeout).await {
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

/// A duration in milliseconds, rounded to a tenth.
fn tenths_ms(took: Duration) -> f64 {
    (took.as_micros() as f64 / 100.0).round() / 10.0
}

/// Posts an event until it is acknowledged, keeping its `event_id` across
/// retries, for at most `timeout`. A final event carries `log_lost`, the
/// bytes of the run's output the shipper gave up on (contract 1.1 note 10).
/// A try unanswered for [`logship::ATTEMPT_BOUND`] is made again on new
/// connections ([`Api::fresh`]), as a log chunk is: pooled connections
/// that died silently must not hold the run's end for minutes.
/// An event of the run with an id of its own, kept by its retries.
fn new_event(execution_id: &str, kind: EventKind) -> Event {
    Event::new(format!("{execution_id}-{}-{:016x}", kind.name(), rand::random::<u64>()), kind)
}

async fn report(
    api: &Api,
    credential: &Secret,
    execution_id: &str,
    event: Event,
    timeout: Duration,
) -> Result<(), ApiError> {
    let path = paths::events(execution_id);
    let call = format!("POST {path}");
    let deadline = time::after(Instant::now(), timeout);
    let api = std::sync::Mutex::new(api.clone());
    let lock = || api.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    retry(&call, deadline, call_backoff(), || async {
        let attempt_api = lock().clone();
        match tokio::time::timeout(logship::ATTEMPT_BOUND, attempt_api.post(credential, &path, &event)).await {
            Ok(result) => result,
            Err(_) => {
                *lock() = attempt_api.fresh();
                Err(ApiError::Unanswered { call: call.clone(), bound: logship::ATTEMPT_BOUND })
            }
        }
    })
    .await
}

/// Loads the spec, prepares the workspace, starts the MCP servers and opens
/// the idle shell.
async fn prepare_all(
    config: Config,
    api: Api,
    source: SpecSource,
    events: mpsc::Sender<PrepEvent>,
) -> Result<Prepared, PrepFailure> {
    let spec = match source {
        SpecSource::File(spec) => *spec,
        SpecSource::Server => fetch_spec(&api, &config.token).await?,
    };
    let _ = events.send(PrepEvent::SpecLoaded(Box::new(spec.clone()))).await;
    let root = &config.workspace;
    let workspace = prepare::prepare(root, &spec.workspace, config.snapshot.as_deref())
        .await
        .map_err(|e| PrepFailure::Failed(e.to_string()))?;
    let mcp = McpSupervisor::start(&spec.mcp_servers_with_defaults(), root, config.mcp_ready_timeout)
        .await
        .map_err(|e| PrepFailure::Failed(e.to_string()))?;
    let shell_argv = spec.shell.clone().filter(|argv| !argv.is_empty()).unwrap_or_else(default_shell);
    let shell = {
        let (argv, root) = (shell_argv.clone(), root.clone());
        // Opening a terminal and forking the shell block: off the runtime.
        process::off_runtime(move || IdleShell::open(&argv, &root, &process::child_env()))
            .await
            .unwrap_or_else(|| {
                Err(ShellError::Spawn { program: shell_argv[0].clone(), source: "the task failed".into() })
            })
            .map_err(|e| PrepFailure::Failed(format!("idle shell `{}`: {e}", shell_argv.join(" "))))?
    };
    let state_root = root.clone();
    process::off_runtime(move || crate::hygiene::ready_state_dir(&state_root))
        .await
        .unwrap_or_else(|| Err(std::io::Error::other("the task failed")))
        .map_err(|e| PrepFailure::Failed(format!("writing {}: {e}", StateDir::of(root).path().display())))?;
    tracing::info!(fingerprint = %workspace.fingerprint, skipped = workspace.skipped, "ready");
    Ok(Prepared { shell: Some(shell), mcp, fingerprint: workspace.fingerprint, checkouts: workspace.checkouts })
}

fn default_shell() -> Vec<String> {
    let bash = PathBuf::from("/bin/bash");
    vec![if bash.exists() { bash.display().to_string() } else { "/bin/sh".to_owned() }]
}

/// `GET /v1/standby/spec` with the standby credential, retrying transient
/// failures without end (the deadlines and SIGTERM still apply: they end the
/// task from outside). The lifecycle keeps the standby credential in force
/// until the spec is loaded, so this never races the switch to the run
/// credential.
async fn fetch_spec(api: &Api, token: &Secret) -> Result<Spec, PrepFailure> {
    let path = standby_protocol::SPEC_PATH;
    let forever = time::after(Instant::now(), time::FOREVER);
    tracing::info!("fetching the spec");
    let backoff = call_backoff().with_max_delay(BACKOFF_CAP);
    retry(&format!("GET {path}"), forever, backoff, || api.get_json(token, path)).await.map_err(|e| match e.refusal() {
        Some(refusal) => PrepFailure::Refused(refusal, e.to_string()),
        None => PrepFailure::Failed(format!("fetching the spec: {e}")),
    })
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
