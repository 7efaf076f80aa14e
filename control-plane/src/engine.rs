//! Drives the [`Dispatch`] state machine: one task owns it, takes commands
//! from HTTP handlers, sockets, provider tasks and a ticker, and applies
//! their steps' writes in one store transaction **before** carrying out
//! the effects (sending frames, launching, parking, resuming and retiring
//! sandboxes) and answering. Commands already queued are committed together
//! (group commit, [`batch`]). A sandbox's provider operations run one after
//! another, in the order the machine emitted them.
//!
//! A store failure is fatal: the machine's memory may then be ahead of the
//! store, so the engine stops and the server shuts down; the next start
//! rebuilds everything from what was committed.

mod adopted;
mod batch;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use standby_protocol::{AgentState, Event, Run, Secret, ServerMessage};
use tokio::sync::{mpsc, oneshot, watch};

use crate::dispatch::{
    Admission, Call, CancelError, ConnId, Dispatch, Effect, IdempotencyKey, KeyReused, LogError, MetricsSnapshot,
    Provision, Refusal, ResumeFailure, ResumeStart, SandboxPage, SandboxView, Step, Submitted,
};
use crate::model::{Millis, ParkMode, RunRecord, RunRequest, RunState, SandboxRecord, ThreadRecord};
use crate::policy::raised_auto_stop;
use crate::provider::{AgentLaunch, Details, Found, Launched, SandboxProvider};
use crate::store::{Store, StoreError};

use self::adopted::Adopted;
use self::batch::{After, Batch, reply};

/// Bound on setting a sandbox's auto-stop: it is best effort, and never
/// holds up a launch or a resume for longer.
pub(crate) const AUTO_STOP_BOUND: Duration = Duration::from_secs(5);

/// What a socket task is told to do.
#[derive(Debug)]
pub enum Outbound {
    /// Write a text frame; for an assignment, report when it is written.
    Frame { text: String, assignment_of: Option<String> },
    /// Send a close frame and end the connection.
    Close,
}

/// A provider operation on one sandbox, queued behind its earlier ones.
type Op = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Whether the engine goes on after a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Continue,
    Stop,
}

/// The engine stopped (a store failure, or shutdown) before answering.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the dispatch engine is not running")]
pub struct EngineGone;

#[derive(Debug)]
enum Command {
    Check {
        token: String,
        call: Call,
        reply: oneshot::Sender<Result<Admission, Refusal>>,
    },
    ClaimSocket {
        conn: ConnId,
        token: String,
        reply: oneshot::Sender<Result<Admission, Refusal>>,
    },
    Connect {
        conn: ConnId,
        sender: mpsc::UnboundedSender<Outbound>,
        credential_id: String,
        presented: Secret,
    },
    Disconnect {
        conn: ConnId,
    },
    Heartbeat {
        conn: ConnId,
        state: AgentState,
    },
    AssignmentSent {
        run_id: String,
    },
    Submit {
        run: Box<Run>,
        request: Box<RunRequest>,
        thread_id: Option<String>,
        key: Option<IdempotencyKey>,
        reply: oneshot::Sender<Result<(Submitted, Option<RunRecord>), KeyReused>>,
    },
    GetThread {
        thread_id: String,
        reply: oneshot::Sender<Option<ThreadRecord>>,
    },
    Cancel {
        run_id: String,
        reply: oneshot::Sender<Result<RunState, CancelError>>,
    },
    GetRun {
        run_id: String,
        reply: oneshot::Sender<Option<RunRecord>>,
    },
    GetSandbox {
        sandbox_id: String,
        reply: oneshot::Sender<Option<SandboxRecord>>,
    },
    Sandboxes {
        page: SandboxPage,
        reply: oneshot::Sender<Vec<(SandboxView, Details)>>,
    },
    Event {
        run_id: String,
        attempt: u32,
        event: Event,
        reply: oneshot::Sender<()>,
    },
    Log {
        chunk: LogInput,
        reply: oneshot::Sender<Result<u64, LogError>>,
    },
    Metrics {
        reply: oneshot::Sender<MetricsSnapshot>,
    },
    Exited {
        sandbox_id: String,
        code: Option<i32>,
    },
    /// An agent this process did not start ([`adopted`]) no longer runs.
    AdoptedExited {
        sandbox_id: String,
    },
    LaunchFailed {
        sandbox_id: String,
        error: String,
    },
    SpecServed {
        sandbox_id: String,
    },
    ResumeFailed {
        sandbox_id: String,
        failure: ResumeFailure,
    },
    Probed {
        sandbox_id: String,
        found: Found,
    },
    Drain {
        reply: oneshot::Sender<()>,
    },
    Stop,
}

/// A log chunk as the agent sent it, decoded.
#[derive(Debug)]
pub struct LogInput {
    pub run_id: String,
    pub offset: u64,
    pub dropped: u64,
    pub data: Vec<u8>,
}

/// How the engine launches and stops agents.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The base URL agents are given (`STANDBY_SERVER_URL`).
    pub server_url: String,
    pub heartbeat_interval: Duration,
    /// `STANDBY_LOG` of the agents.
    pub agent_log: String,
    /// Between SIGTERM and SIGKILL when a sandbox is stopped.
    pub stop_grace: Duration,
    /// How often silence and the pool are checked.
    pub tick: Duration,
    /// Bound on each provider call of a resume (state, start).
    pub resume_timeout: Duration,
}

/// A cheap, cloneable way to talk to the engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    next_conn: Arc<AtomicU64>,
}

impl EngineHandle {
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, EngineGone> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(make(reply)).await.map_err(|_| EngineGone)?;
        answer.await.map_err(|_| EngineGone)
    }

    async fn tell(&self, command: Command) {
        // Only fails when the engine has stopped; the caller is then being
        // torn down too.
        let _ = self.tx.send(command).await;
    }

    pub fn next_conn_id(&self) -> ConnId {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// Who `token` is for `call`, or why it is refused.
    pub async fn check(&self, token: &str, call: Call) -> Result<Result<Admission, Refusal>, EngineGone> {
        let token = token.to_owned();
        self.ask(|reply| Command::Check { token, call, reply }).await
    }

    /// Admits the upgrade of control connection `conn` with `token`,
    /// claiming the credential's one socket for it; [`Self::disconnect`]
    /// frees the claim (also when the upgrade never completes).
    pub async fn claim_socket(&self, conn: ConnId, token: &str) -> Result<Result<Admission, Refusal>, EngineGone> {
        let token = token.to_owned();
        self.ask(|reply| Command::ClaimSocket { conn, token, reply }).await
    }

    pub async fn connect(
        &self,
        conn: ConnId,
        sender: mpsc::UnboundedSender<Outbound>,
        credential_id: &str,
        presented: Secret,
    ) {
        self.tell(Command::Connect { conn, sender, credential_id: credential_id.to_owned(), presented }).await;
    }

    pub async fn disconnect(&self, conn: ConnId) {
        self.tell(Command::Disconnect { conn }).await;
    }

    pub async fn heartbeat(&self, conn: ConnId, state: AgentState) {
        self.tell(Command::Heartbeat { conn, state }).await;
    }

    pub async fn assignment_sent(&self, run_id: &str) {
        self.tell(Command::AssignmentSent { run_id: run_id.to_owned() }).await;
    }

    pub async fn submit(&self, run: Run, request: RunRequest) -> Result<RunRecord, EngineGone> {
        self.submit_turn(run, request, None).await
    }

    /// Submits a run as a turn of `thread_id` (when given).
    pub async fn submit_turn(
        &self,
        run: Run,
        request: RunRequest,
        thread_id: Option<String>,
    ) -> Result<RunRecord, EngineGone> {
        match self.submit_keyed(run, request, thread_id, None).await? {
            Ok((_, Some(record))) => Ok(record),
            // Without a key there is always a new run, in memory.
            Ok((_, None)) | Err(_) => Err(EngineGone),
        }
    }

    /// Submits a run under an `Idempotency-Key` (when given): the run it
    /// made (and its record while in memory), or [`KeyReused`].
    pub async fn submit_keyed(
        &self,
        run: Run,
        request: RunRequest,
        thread_id: Option<String>,
        key: Option<IdempotencyKey>,
    ) -> Result<Result<(Submitted, Option<RunRecord>), KeyReused>, EngineGone> {
        self.ask(|reply| Command::Submit { run: Box::new(run), request: Box::new(request), thread_id, key, reply })
            .await
    }

    /// A sandbox's agent was served its spec.
    pub async fn spec_served(&self, sandbox_id: &str) {
        self.tell(Command::SpecServed { sandbox_id: sandbox_id.to_owned() }).await;
    }

    pub async fn thread(&self, thread_id: &str) -> Result<Option<ThreadRecord>, EngineGone> {
        let thread_id = thread_id.to_owned();
        self.ask(|reply| Command::GetThread { thread_id, reply }).await
    }

    pub async fn cancel(&self, run_id: &str) -> Result<Result<RunState, CancelError>, EngineGone> {
        let run_id = run_id.to_owned();
        self.ask(|reply| Command::Cancel { run_id, reply }).await
    }

    pub async fn run(&self, run_id: &str) -> Result<Option<RunRecord>, EngineGone> {
        let run_id = run_id.to_owned();
        self.ask(|reply| Command::GetRun { run_id, reply }).await
    }

    pub async fn sandbox(&self, sandbox_id: &str) -> Result<Option<SandboxRecord>, EngineGone> {
        let sandbox_id = sandbox_id.to_owned();
        self.ask(|reply| Command::GetSandbox { sandbox_id, reply }).await
    }

    /// A page of sandboxes, in creation order.
    pub async fn sandboxes(&self, page: SandboxPage) -> Result<Vec<(SandboxView, Details)>, EngineGone> {
        self.ask(|reply| Command::Sandboxes { page, reply }).await
    }

    pub async fn event(&self, run_id: &str, attempt: u32, event: Event) -> Result<(), EngineGone> {
        let run_id = run_id.to_owned();
        self.ask(|reply| Command::Event { run_id, attempt, event, reply }).await
    }

    pub async fn log(&self, chunk: LogInput) -> Result<Result<u64, LogError>, EngineGone> {
        self.ask(|reply| Command::Log { chunk, reply }).await
    }

    pub async fn metrics(&self) -> Result<MetricsSnapshot, EngineGone> {
        self.ask(|reply| Command::Metrics { reply }).await
    }

    /// Stops dispatching and launching; exits no longer change state.
    pub async fn drain(&self) -> Result<(), EngineGone> {
        self.ask(|reply| Command::Drain { reply }).await
    }

    /// Ends the engine task, closing every control connection.
    pub async fn stop(&self) {
        self.tell(Command::Stop).await;
    }
}

/// The task that owns the state machine.
pub struct Engine<P> {
    machine: Dispatch,
    store: Arc<dyn Store>,
    provider: Arc<P>,
    config: EngineConfig,
    conns: HashMap<ConnId, mpsc::UnboundedSender<Outbound>>,
    /// One queue per sandbox: its provider operations (launch, park, stop,
    /// resume, retire) run one after another in the order the machine
    /// emitted them.
    ops: HashMap<String, mpsc::UnboundedSender<Op>>,
    adopted: Adopted,
    rx: mpsc::Receiver<Command>,
    handle: EngineHandle,
}

impl<P> std::fmt::Debug for Engine<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("machine", &self.machine)
            .field("conns", &self.conns.len())
            .finish_non_exhaustive()
    }
}

async fn blocking<T: Send + 'static>(
    store: &Arc<dyn Store>,
    call: impl FnOnce(&dyn Store) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    let store = Arc::clone(store);
    match tokio::task::spawn_blocking(move || call(store.as_ref())).await {
        Ok(result) => result,
        Err(join) => std::panic::resume_unwind(join.into_panic()),
    }
}

/// The engine's queue of commands, made before the engine itself: a
/// replica serves (and its handlers queue) before it leads and starts one.
#[derive(Debug)]
pub struct Mailbox {
    rx: mpsc::Receiver<Command>,
    handle: EngineHandle,
}

impl EngineHandle {
    /// A handle and the mailbox its commands go to.
    pub fn mailbox() -> (Self, Mailbox) {
        let (tx, rx) = mpsc::channel(1024);
        let handle = Self { tx, next_conn: Arc::new(AtomicU64::new(1)) };
        (handle.clone(), Mailbox { rx, handle })
    }
}

impl<P: SandboxProvider> Engine<P> {
    /// An engine for `machine` taking `mailbox`'s commands; `initial` (of
    /// [`Self::run`]) is the step [`Dispatch::restore`] returned, applied
    /// before anything else.
    pub fn new(
        mailbox: Mailbox,
        machine: Dispatch,
        store: Arc<dyn Store>,
        provider: Arc<P>,
        config: EngineConfig,
    ) -> Self {
        let Mailbox { rx, handle } = mailbox;
        Self {
            machine,
            store,
            provider,
            config,
            conns: HashMap::new(),
            ops: HashMap::new(),
            adopted: Adopted::default(),
            rx,
            handle,
        }
    }

    /// Runs until stopped or until the store fails; `fatal` is set on a
    /// store failure so the server can shut down.
    pub async fn run(mut self, initial: Step, fatal: watch::Sender<Option<String>>) {
        if let Err(error) = self.apply(initial).await {
            let _ = fatal.send(Some(error.to_string()));
            return;
        }
        let mut ticker = tokio::time::interval(self.config.tick);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let result = tokio::select! {
                command = self.rx.recv() => match command {
                    None => break,
                    Some(first) => {
                        let commands = batch::take_queued(&mut self.rx, first, batch::BOUND);
                        self.handle_batch(commands).await
                    }
                },
                _ = ticker.tick() => {
                    let step = self.machine.tick(Millis::now());
                    self.apply(step).await.map(|()| Flow::Continue)
                }
            };
            match result {
                Ok(Flow::Continue) => {}
                Ok(Flow::Stop) => break,
                Err(error) => {
                    tracing::error!(%error, "store failure: the engine stops");
                    let _ = fatal.send(Some(error.to_string()));
                    break;
                }
            }
        }
        // Dropping the senders ends every socket task.
        self.conns.clear();
    }

    /// Runs `commands` through the machine, commits their writes in one
    /// transaction, then carries out their effects and answers them in
    /// order. A `Stop` ends the batch there (the commands after it are
    /// dropped, their callers see the engine gone).
    async fn handle_batch(&mut self, commands: Vec<Command>) -> Result<Flow, StoreError> {
        let mut batch = Batch::default();
        let mut flow = Flow::Continue;
        for command in commands {
            if matches!(command, Command::Stop) {
                flow = Flow::Stop;
                break;
            }
            self.stage(&mut batch, command);
        }
        self.commit(batch).await?;
        Ok(flow)
    }

    /// Runs one command through the machine into `batch`: its writes, then
    /// what to do once they are committed.
    fn stage(&mut self, batch: &mut Batch<After>, command: Command) {
        let now = Millis::now();
        match command {
            Command::Check { token, call, reply: to } => {
                batch.then(reply(to, self.machine.check(&token, call)));
            }
            Command::ClaimSocket { conn, token, reply: to } => match self.machine.claim_socket(now, conn, &token) {
                Ok((admission, step)) => {
                    batch.stage(step);
                    batch.then(reply(to, Ok(admission)));
                }
                Err(refusal) => batch.then(reply(to, Err(refusal))),
            },
            Command::Connect { conn, sender, credential_id, presented } => {
                batch.then(After::Attach(conn, sender));
                batch.stage(self.machine.connected(now, conn, &credential_id, &presented));
            }
            Command::Disconnect { conn } => {
                batch.then(After::Detach(conn));
                self.machine.disconnected(conn);
            }
            Command::Heartbeat { conn, state } => batch.stage(self.machine.heartbeat(now, conn, state)),
            Command::AssignmentSent { run_id } => batch.stage(self.machine.assignment_sent(now, &run_id)),
            Command::Submit { run, request, thread_id, key, reply: to } => {
                match self.machine.submit_keyed(now, *run, *request, thread_id, key) {
                    Ok((step, submitted)) => {
                        batch.stage(step);
                        let record = self.machine.run(submitted.run_id()).cloned();
                        batch.then(reply(to, Ok((submitted, record))));
                    }
                    Err(reused) => batch.then(reply(to, Err(reused))),
                }
            }
            Command::Cancel { run_id, reply: to } => match self.machine.cancel(now, &run_id) {
                Ok((step, state)) => {
                    batch.stage(step);
                    batch.then(reply(to, Ok(state)));
                }
                Err(error) => batch.then(reply(to, Err(error))),
            },
            Command::GetRun { run_id, reply: to } => batch.then(reply(to, self.machine.run(&run_id).cloned())),
            Command::GetThread { thread_id, reply: to } => {
                batch.then(reply(to, self.machine.thread(&thread_id).cloned()));
            }
            Command::GetSandbox { sandbox_id, reply: to } => {
                batch.then(reply(to, self.machine.sandbox(&sandbox_id).cloned()));
            }
            Command::Sandboxes { page, reply: to } => {
                let views = self.machine.sandbox_page(now, &page);
                let with_details = views
                    .into_iter()
                    .map(|view| {
                        let details = self.provider.details(&view.record.id);
                        (view, details)
                    })
                    .collect();
                batch.then(reply(to, with_details));
            }
            Command::Event { run_id, attempt, event, reply: to } => {
                batch.stage(self.machine.event(now, &run_id, attempt, event));
                batch.then(reply(to, ()));
            }
            Command::Log { chunk, reply: to } => {
                match self.machine.log(&chunk.run_id, chunk.offset, chunk.dropped, &chunk.data) {
                    Ok((step, received)) => {
                        batch.stage(step);
                        batch.then(reply(to, Ok(received)));
                    }
                    Err(error) => batch.then(reply(to, Err(error))),
                }
            }
            Command::Metrics { reply: to } => batch.then(reply(to, self.machine.metrics())),
            Command::Exited { sandbox_id, code } => batch.stage(self.machine.sandbox_exited(now, &sandbox_id, code)),
            Command::LaunchFailed { sandbox_id, error } => {
                batch.stage(self.machine.launch_failed(now, &sandbox_id, &error));
            }
            Command::SpecServed { sandbox_id } => batch.stage(self.machine.spec_served(&sandbox_id)),
            Command::ResumeFailed { sandbox_id, failure } => {
                batch.stage(self.machine.resume_failed(now, &sandbox_id, &failure));
            }
            Command::AdoptedExited { sandbox_id } => {
                if self.adopted.ended(&sandbox_id) {
                    batch.stage(self.machine.sandbox_exited(now, &sandbox_id, None));
                }
            }
            Command::Probed { sandbox_id, found } => {
                if found == Found::Running {
                    let handle = self.handle.clone();
                    self.adopted.watch(Arc::clone(&self.provider), sandbox_id.clone(), |sandbox_id| async move {
                        handle.tell(Command::AdoptedExited { sandbox_id }).await;
                    });
                }
                batch.stage(self.machine.probed(now, &sandbox_id, found));
            }
            Command::Drain { reply: to } => {
                self.machine.shutdown();
                batch.then(reply(to, ()));
            }
            // The batch ends before it (see `handle_batch`).
            Command::Stop => {}
        }
    }

    /// Commit, then tell: one step, as a batch of its own.
    async fn apply(&mut self, step: Step) -> Result<(), StoreError> {
        let mut batch = Batch::default();
        batch.stage(step);
        self.commit(batch).await
    }

    /// The batch's writes first, in one transaction; its effects and
    /// replies only once it succeeded, in order.
    async fn commit(&mut self, batch: Batch<After>) -> Result<(), StoreError> {
        let (writes, after) = batch.into_parts();
        // A fenced store checks the lease even for a batch without writes,
        // before any effect is carried out.
        let effects = after.iter().any(|action| matches!(action, After::Effect(_)));
        if !writes.is_empty() || (effects && self.store.fenced()) {
            blocking(&self.store, move |store| store.apply(&writes)).await?;
        }
        for action in after {
            match action {
                After::Effect(effect) => self.effect(*effect),
                After::Reply(answer) => answer(),
                After::Attach(conn, sender) => {
                    self.conns.insert(conn, sender);
                }
                After::Detach(conn) => {
                    self.conns.remove(&conn);
                }
            }
        }
        Ok(())
    }

    fn agent_launch(&self, token: Secret) -> AgentLaunch {
        AgentLaunch {
            server_url: self.config.server_url.clone(),
            token,
            heartbeat_interval: self.config.heartbeat_interval,
            log_filter: self.config.agent_log.clone(),
        }
    }

    /// Queues `op` behind the sandbox's earlier operations. The queue's
    /// task runs on a worker thread (never the blocking pool): the local
    /// provider's parent-death signal is tied to the thread that spawns the
    /// agent.
    /// An operation whose turn comes after the lease this store writes
    /// under lapsed is dropped: a deposed leader calls no provider.
    fn queue(&mut self, sandbox_id: &str, op: impl Future<Output = ()> + Send + 'static) {
        let store = Arc::clone(&self.store);
        let sender = self.ops.entry(sandbox_id.to_owned()).or_insert_with(|| {
            let (sender, mut queue) = mpsc::unbounded_channel::<Op>();
            tokio::spawn(async move {
                while let Some(op) = queue.recv().await {
                    if store.lapsed() {
                        tracing::warn!("the lease lapsed: a queued provider operation is not carried out");
                        continue;
                    }
                    op.await;
                }
            });
            sender
        });
        let _ = sender.send(Box::pin(op));
    }

    fn effect(&mut self, effect: Effect) {
        match effect {
            Effect::Send { conn, message } => {
                let assignment_of = match &message {
                    ServerMessage::Assignment(assignment) => Some(assignment.execution_id.clone()),
                    _ => None,
                };
                if let (Some(sender), Some(text)) = (self.conns.get(&conn), message.encode()) {
                    let _ = sender.send(Outbound::Frame { text, assignment_of });
                }
            }
            Effect::Close { conn } => {
                if let Some(sender) = self.conns.get(&conn) {
                    let _ = sender.send(Outbound::Close);
                }
            }
            Effect::Launch { sandbox_id, token, provision, auto_stop } => {
                self.adopted.forget(&sandbox_id);
                let provider = Arc::clone(&self.provider);
                let handle = self.handle.clone();
                let launch = self.agent_launch(token);
                let id = sandbox_id.clone();
                self.queue(&id, async move {
                    let prepared = match provision {
                        Provision::Create => provider.create(&sandbox_id).await,
                        Provision::Start => provider.start(&sandbox_id).await,
                    };
                    if prepared.is_ok() && provision == Provision::Create {
                        set_auto_stop(provider.as_ref(), &sandbox_id, auto_stop).await;
                    }
                    let launched = match prepared {
                        Ok(()) => provider.launch(&sandbox_id, launch).await,
                        Err(error) => Err(error),
                    };
                    match launched {
                        Ok(launched) => watch_exit(handle, sandbox_id, launched),
                        Err(error) => {
                            tracing::error!(%error, "launch failed");
                            handle.tell(Command::LaunchFailed { sandbox_id, error: error.to_string() }).await;
                        }
                    }
                });
            }
            Effect::Resume { sandbox_id, token, auto_stop } => {
                self.adopted.forget(&sandbox_id);
                let provider = Arc::clone(&self.provider);
                let handle = self.handle.clone();
                let launch = self.agent_launch(token);
                let (bound, grace) = (self.config.resume_timeout, self.config.stop_grace);
                let id = sandbox_id.clone();
                self.queue(&id, async move {
                    match resume(provider.as_ref(), &sandbox_id, launch, auto_stop, bound, grace).await {
                        Ok(launched) => watch_exit(handle, sandbox_id, launched),
                        Err(failure) => {
                            tracing::warn!(sandbox_id, %failure, "resuming a kept sandbox failed");
                            handle.tell(Command::ResumeFailed { sandbox_id, failure }).await;
                        }
                    }
                });
            }
            Effect::Park { sandbox_id, linger, auto_stop, mode } => {
                let provider = Arc::clone(&self.provider);
                let grace = self.config.stop_grace;
                let id = sandbox_id.clone();
                self.queue(&id, async move {
                    if !provider.wait_exit(&sandbox_id, linger).await {
                        tracing::info!(sandbox_id, "a finished turn's agent did not exit by itself: stopped");
                    }
                    // Ends whatever is left (with no agent running, only
                    // processes that escaped it): a parked sandbox keeps
                    // its files, not its processes; one kept running for
                    // the next turn stays running where the provider can.
                    match mode {
                        ParkMode::Running => provider.clear(&sandbox_id, grace).await,
                        ParkMode::Stopped => provider.stop(&sandbox_id, grace).await,
                    }
                    set_auto_stop(provider.as_ref(), &sandbox_id, auto_stop).await;
                });
            }
            Effect::Stop { sandbox_id } => {
                let provider = Arc::clone(&self.provider);
                let grace = self.config.stop_grace;
                let id = sandbox_id.clone();
                self.queue(&id, async move {
                    provider.stop(&sandbox_id, grace).await;
                });
            }
            Effect::Touch { sandbox_id } => self.provider.touch(&sandbox_id),
            Effect::Retire { sandbox_id, linger } => {
                self.adopted.forget(&sandbox_id);
                let provider = Arc::clone(&self.provider);
                let grace = self.config.stop_grace;
                let id = sandbox_id.clone();
                self.queue(&id, async move {
                    if !provider.wait_exit(&sandbox_id, linger).await {
                        provider.stop(&sandbox_id, grace).await;
                    }
                    if let Err(error) = provider.delete(&sandbox_id).await {
                        tracing::warn!(%error, "deleting a retired sandbox failed");
                    }
                });
                // Nothing follows a retirement: the queue ends once drained.
                self.ops.remove(&id);
            }
            Effect::Probe { sandbox_id } => {
                let provider = Arc::clone(&self.provider);
                let handle = self.handle.clone();
                tokio::spawn(async move {
                    let found = provider.state(&sandbox_id).await.unwrap_or_else(|error| {
                        tracing::warn!(%error, "probing a sandbox failed: taken as missing");
                        Found::Missing
                    });
                    handle.tell(Command::Probed { sandbox_id, found }).await;
                });
            }
        }
    }
}

/// Reports the agent's exit to the engine when it comes.
fn watch_exit(handle: EngineHandle, sandbox_id: String, launched: Launched) {
    tokio::spawn(async move {
        let code = launched.exited.await.unwrap_or(None);
        handle.tell(Command::Exited { sandbox_id, code }).await;
    });
}

/// Sets the provider auto-stop, best effort and bounded.
async fn set_auto_stop<P: SandboxProvider>(provider: &P, sandbox_id: &str, minutes: u32) {
    match tokio::time::timeout(AUTO_STOP_BOUND, provider.set_auto_stop(sandbox_id, minutes)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(sandbox_id, %error, "setting the auto-stop failed"),
        Err(_) => tracing::warn!(sandbox_id, "setting the auto-stop timed out"),
    }
}

/// Makes a kept sandbox run again: its provider state first, then what
/// [`ResumeStart::for_found`] says (a deleted one cannot be resumed, a
/// running one is stopped first), the start, a shorter auto-stop raised
/// (best effort, bounded), then a fresh agent. An error says why.
async fn resume<P: SandboxProvider>(
    provider: &P,
    sandbox_id: &str,
    launch: AgentLaunch,
    auto_stop: u32,
    bound: Duration,
    grace: Duration,
) -> Result<Launched, ResumeFailure> {
    let bounded = |what: &str| {
        ResumeFailure::Failed(format!(
            "the provider did not answer {what} within {}",
            humantime::format_duration(bound)
        ))
    };
    let found = tokio::time::timeout(bound, provider.state(sandbox_id))
        .await
        .map_err(|_| bounded("its state"))?
        .map_err(|error| ResumeFailure::Failed(format!("reading its state failed: {error}")))?;
    if ResumeStart::for_found(found)? == ResumeStart::StopFirst {
        tracing::warn!(sandbox_id, "a kept sandbox was still running: stopped before its resume");
        provider.stop(sandbox_id, grace).await;
    }
    tokio::time::timeout(bound, provider.start(sandbox_id))
        .await
        .map_err(|_| bounded("the start"))?
        .map_err(|error| ResumeFailure::Failed(format!("the provider refused to start it: {error}")))?;
    let raise = async {
        let current = provider.auto_stop(sandbox_id).await?;
        if let Some(minutes) = raised_auto_stop(current, auto_stop) {
            provider.set_auto_stop(sandbox_id, minutes).await?;
        }
        Ok::<_, crate::provider::ProviderError>(())
    };
    match tokio::time::timeout(AUTO_STOP_BOUND, raise).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(sandbox_id, %error, "raising the auto-stop on resume failed"),
        Err(_) => tracing::warn!(sandbox_id, "raising the auto-stop on resume timed out"),
    }
    provider
        .launch(sandbox_id, launch)
        .await
        .map_err(|error| ResumeFailure::Failed(format!("launching its agent failed: {error}")))
}
