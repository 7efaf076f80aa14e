//! Drives the [`Rules`] state machine: one task owns it, takes commands
//! from HTTP handlers, sockets, provider tasks and a ticker, and applies
//! their steps' writes in one store transaction **before** carrying out
//! the effects (sending frames, launching, parking, resuming and retiring
//! sandboxes) and answering. Commands already queued are committed together
//! (group commit, [`batch`]). A sandbox's provider operations run one after
//! another, in the order the machine emitted them.
//!
//! A store failure is fatal: the machine's memory may then be ahead of the
//! store, so the engine stops and the server shuts down; the next start
//! rebuilds everything from what was committed. A replica's writes run
//! under the fence its [`Leadership`] gives; a write the store refuses for
//! the lease, or a lease that lapsed while it committed, deposes it, and
//! the engine stops before telling anyone anything.

mod adopted;
mod batch;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use standby_protocol::{Secret, ServerMessage};
use tokio::sync::{mpsc, oneshot, watch};

use crate::cluster::Leadership;
use crate::model::{Clock, Holder, ParkMode};
use crate::policy::raised_auto_stop;
use crate::provider::{AgentLaunch, Details, Found, Launched, SandboxProvider};
use crate::rules::{
    Answer, ConnId, Effect, Input, LiveSandbox, Provision, Reply, ResumeFailure, ResumeStart, Rules, SandboxPage, Step,
};
use crate::store::{Store, StoreError};

use self::batch::{After, Batch};

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

/// Where a control connection's frames go: the socket task of this
/// process that holds it, or the link to the replica that holds it
/// (`cluster::link`), under that replica's number for the agent.
#[derive(Debug, Clone)]
pub struct ConnWriter(Writer);

#[derive(Debug, Clone)]
enum Writer {
    Local(mpsc::UnboundedSender<Outbound>),
    Linked { link: mpsc::UnboundedSender<(u64, Outbound)>, agent: u64 },
}

impl ConnWriter {
    /// A socket held by a task of this process.
    pub fn local(sender: mpsc::UnboundedSender<Outbound>) -> Self {
        Self(Writer::Local(sender))
    }

    /// A socket another replica holds: its frames go down `link`.
    pub fn linked(link: mpsc::UnboundedSender<(u64, Outbound)>, agent: u64) -> Self {
        Self(Writer::Linked { link, agent })
    }

    /// Queues `outbound`; a writer that is gone drops it (its connection
    /// is being closed, and the machine hears of it).
    fn send(&self, outbound: Outbound) {
        let _ = match &self.0 {
            Writer::Local(sender) => sender.send(outbound).map_err(drop),
            Writer::Linked { link, agent } => link.send((*agent, outbound)).map_err(drop),
        };
    }
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

/// What the engine's queue carries: inputs for the machine, which it
/// forwards without knowing them, and the few things that are the
/// engine's own (a socket's writer, the provider's details, the end).
#[derive(Debug)]
enum Command {
    /// An input for the machine; its reply goes to `reply` (when someone
    /// waits) once the input's writes are committed.
    Input {
        input: Input,
        reply: Option<oneshot::Sender<Reply>>,
    },
    /// A control connection opened: its writer is attached before the
    /// machine hears of it (its effects may use it).
    Connect {
        conn: ConnId,
        writer: ConnWriter,
        credential_id: String,
        presented: Secret,
        holder: Option<Holder>,
    },
    /// A control connection closed: its writer is dropped.
    Disconnect {
        conn: ConnId,
    },
    /// A page of sandboxes, with what the provider knows of each.
    Sandboxes {
        page: SandboxPage,
        reply: oneshot::Sender<Vec<(LiveSandbox, Details)>>,
    },
    Stop,
}

/// How the engine launches and stops agents.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The base URL agents are given (`STANDBY_SERVER_URL`).
    pub server_url: String,
    pub heartbeat_interval: Duration,
    /// `STANDBY_LOG` of the agents.
    pub agent_log: String,
    /// How often silence and the pool are checked.
    pub tick: Duration,
    /// Bound on each provider call of a resume (state, start).
    pub resume_timeout: Duration,
    /// The time every input is stamped with.
    pub clock: Clock,
    /// Whether this process leads, and the fence its writes run under.
    pub leadership: Leadership,
    /// Where a started run's spans go (`--otlp-endpoint`); `None`: nowhere.
    pub tracer: Option<standby_otlp::Tracer>,
    /// `STANDBY_OTLP_ENDPOINT` of the agents, when traces are exported.
    pub agent_otlp_endpoint: Option<String>,
}

/// Why the engine stopped on its own.
#[derive(Debug, thiserror::Error)]
enum Halt {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("deposed: {0}")]
    Deposed(String),
}

/// A cheap, cloneable way to talk to the engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    next_conn: Arc<AtomicU64>,
}

impl EngineHandle {
    /// Asks the machine: its answer once the input's writes are committed.
    /// `A` is the kind of answer the input gives (see [`Reply`]).
    pub async fn ask<A: Answer>(&self, input: Input) -> Result<A, EngineGone> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::Input { input, reply: Some(reply) }).await.map_err(|_| EngineGone)?;
        let reply = answer.await.map_err(|_| EngineGone)?;
        A::from_reply(reply).ok_or_else(|| {
            let asked = std::any::type_name::<A>();
            tracing::error!(asked, "the machine answered another kind of reply than asked for");
            EngineGone
        })
    }

    /// Tells the machine, without waiting for its answer.
    pub async fn tell(&self, input: Input) {
        self.send(Command::Input { input, reply: None }).await;
    }

    async fn send(&self, command: Command) {
        // Only fails when the engine has stopped; the caller is then being
        // torn down too.
        let _ = self.tx.send(command).await;
    }

    pub fn next_conn_id(&self) -> ConnId {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    /// Control connection `conn` (claimed with [`Input::ClaimSocket`]) is
    /// open: frames for it go to `writer`; `holder` holds its socket.
    pub async fn connect(
        &self,
        conn: ConnId,
        writer: ConnWriter,
        (credential_id, presented): (&str, Secret),
        holder: Option<Holder>,
    ) {
        let credential_id = credential_id.to_owned();
        self.send(Command::Connect { conn, writer, credential_id, presented, holder }).await;
    }

    /// Control connection `conn` closed (or its upgrade never completed):
    /// its claim is freed.
    pub async fn disconnect(&self, conn: ConnId) {
        self.send(Command::Disconnect { conn }).await;
    }

    /// A page of sandboxes, in creation order, with the provider's details.
    pub async fn sandboxes(&self, page: SandboxPage) -> Result<Vec<(LiveSandbox, Details)>, EngineGone> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::Sandboxes { page, reply }).await.map_err(|_| EngineGone)?;
        answer.await.map_err(|_| EngineGone)
    }

    /// Ends the engine task, closing every control connection.
    pub async fn stop(&self) {
        self.send(Command::Stop).await;
    }
}

/// The task that owns the state machine.
pub struct Engine<P> {
    machine: Rules,
    store: Arc<dyn Store>,
    provider: Arc<P>,
    config: EngineConfig,
    conns: HashMap<ConnId, ConnWriter>,
    /// One queue per sandbox: its provider operations (launch, park, stop,
    /// resume, retire) run one after another in the order the machine
    /// emitted them.
    ops: HashMap<String, mpsc::UnboundedSender<Op>>,
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
    /// [`Self::run`]) is the step [`Rules::restore`] returned, applied
    /// before anything else.
    pub fn new(
        mailbox: Mailbox,
        machine: Rules,
        store: Arc<dyn Store>,
        provider: Arc<P>,
        config: EngineConfig,
    ) -> Self {
        let Mailbox { rx, handle } = mailbox;
        Self { machine, store, provider, config, conns: HashMap::new(), ops: HashMap::new(), rx, handle }
    }

    /// Runs until stopped, until the store fails or this replica is
    /// deposed; `fatal` is set then, so the server can end.
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
                    let step = self.machine.handle(self.config.clock.now(), Input::Tick);
                    self.apply(step).await.map(|()| Flow::Continue)
                }
            };
            match result {
                Ok(Flow::Continue) => {}
                Ok(Flow::Stop) => break,
                Err(error) => {
                    tracing::error!(%error, "the engine stops");
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
    async fn handle_batch(&mut self, commands: Vec<Command>) -> Result<Flow, Halt> {
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
        let now = self.config.clock.now();
        match command {
            Command::Input { input, reply: to } => {
                let reply = batch.stage(self.machine.handle(now, input));
                if let Some(to) = to {
                    batch.then(batch::reply(to, reply));
                }
            }
            Command::Connect { conn, writer, credential_id, presented, holder } => {
                batch.then(After::Attach(conn, writer));
                batch.stage(self.machine.handle(now, Input::Connected { conn, credential_id, presented, holder }));
            }
            Command::Disconnect { conn } => {
                batch.then(After::Detach(conn));
                batch.stage(self.machine.handle(now, Input::Disconnected { conn }));
            }
            Command::Sandboxes { page, reply: to } => {
                let views = match batch.stage(self.machine.handle(now, Input::Sandboxes { page })) {
                    Reply::Sandboxes(views) => views,
                    _ => Vec::new(),
                };
                let with_details = views
                    .into_iter()
                    .map(|view| {
                        let details = self.provider.details(&view.record.id);
                        (view, details)
                    })
                    .collect();
                batch.then(batch::reply(to, with_details));
            }
            // The batch ends before it (see `handle_batch`).
            Command::Stop => {}
        }
    }

    /// Commit, then tell: one step, as a batch of its own.
    async fn apply(&mut self, step: Step) -> Result<(), Halt> {
        let mut batch = Batch::default();
        batch.stage(step);
        self.commit(batch).await
    }

    /// The batch's writes first, in one transaction; its effects and
    /// replies only once it succeeded, in order.
    async fn commit(&mut self, batch: Batch<After>) -> Result<(), Halt> {
        let (writes, after) = batch.into_parts();
        let leadership = self.config.leadership.clone();
        let fence = leadership.fence().map_err(|not| Halt::Deposed(not.to_string()))?;
        // Under a fence the lease is checked even for a batch without
        // writes, before any effect is carried out.
        let effects = after.iter().any(|action| matches!(action, After::Effect(_)));
        if !writes.is_empty() || (effects && fence.is_some()) {
            blocking(&self.store, move |store| store.apply(&writes, fence.as_ref())).await.inspect_err(|error| {
                // A write that failed once the lease lapsed (the database
                // ended the transaction of a leader frozen past its
                // deadline) says as much as one refused for the lease.
                if error.deposes() || leadership.lapsed(Instant::now()) {
                    leadership.depose(&error.to_string());
                }
            })?;
            // Committed; but told only while the lease holds.
            if leadership.lapsed(Instant::now()) {
                let why = "the lease's local deadline passed while a write committed: nothing of it is told";
                leadership.depose(why);
                return Err(Halt::Deposed(why.into()));
            }
        }
        for action in after {
            match action {
                After::Effect(effect) => self.effect(*effect),
                After::Reply(answer) => answer(),
                After::Attach(conn, writer) => {
                    self.conns.insert(conn, writer);
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
            otlp_endpoint: self.config.agent_otlp_endpoint.clone(),
        }
    }

    /// Queues `op` behind the sandbox's earlier operations. The queue's
    /// task runs on a worker thread (never the blocking pool): the local
    /// provider's parent-death signal is tied to the thread that spawns the
    /// agent.
    /// An operation whose turn comes once this process may no longer lead
    /// is dropped: a deposed leader calls no provider.
    fn queue(&mut self, sandbox_id: &str, op: impl Future<Output = ()> + Send + 'static) {
        let leadership = self.config.leadership.clone();
        let sender = self.ops.entry(sandbox_id.to_owned()).or_insert_with(|| {
            let (sender, mut queue) = mpsc::unbounded_channel::<Op>();
            tokio::spawn(async move {
                while let Some(op) = queue.recv().await {
                    if leadership.lapsed(Instant::now()) {
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
                if let (Some(writer), Some(text)) = (self.conns.get(&conn), message.encode()) {
                    writer.send(Outbound::Frame { text, assignment_of });
                }
            }
            Effect::Close { conn } => {
                if let Some(writer) = self.conns.get(&conn) {
                    writer.send(Outbound::Close);
                }
            }
            Effect::Launch { sandbox_id, credential_id, token, provision, auto_stop, fingerprint } => {
                let provider = Arc::clone(&self.provider);
                let handle = self.handle.clone();
                let launch = self.agent_launch(token);
                let id = sandbox_id.clone();
                self.queue(&id, async move {
                    let prepared = match provision {
                        Provision::Create => provider.create_for(&sandbox_id, &fingerprint).await,
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
                        Ok(launched) => watch_exit(handle, sandbox_id, credential_id, launched),
                        Err(error) => {
                            tracing::error!(%error, "launch failed");
                            handle.tell(Input::LaunchFailed { sandbox_id, error: error.to_string() }).await;
                        }
                    }
                });
            }
            Effect::Resume { sandbox_id, credential_id, token, auto_stop } => {
                let provider = Arc::clone(&self.provider);
                let handle = self.handle.clone();
                let launch = self.agent_launch(token);
                let bound = self.config.resume_timeout;
                let id = sandbox_id.clone();
                self.queue(&id, async move {
                    match resume(provider.as_ref(), &sandbox_id, launch, auto_stop, bound).await {
                        Ok(launched) => watch_exit(handle, sandbox_id, credential_id, launched),
                        Err(failure) => {
                            tracing::warn!(sandbox_id, %failure, "resuming a kept sandbox failed");
                            handle.tell(Input::ResumeFailed { sandbox_id, failure }).await;
                        }
                    }
                });
            }
            Effect::Park { sandbox_id, linger, auto_stop, mode } => {
                let provider = Arc::clone(&self.provider);
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
                        ParkMode::Running => provider.clear(&sandbox_id).await,
                        ParkMode::Stopped => provider.stop(&sandbox_id).await,
                    }
                    set_auto_stop(provider.as_ref(), &sandbox_id, auto_stop).await;
                });
            }
            Effect::Snapshot { sandbox_id, fingerprint } => {
                let provider = Arc::clone(&self.provider);
                let handle = self.handle.clone();
                let id = sandbox_id.clone();
                self.queue(&id, async move {
                    let outcome = provider.snapshot(&sandbox_id, &fingerprint).await.map_err(|error| error.to_string());
                    handle.tell(Input::SnapshotTaken { sandbox_id, fingerprint, outcome }).await;
                });
            }
            Effect::Stop { sandbox_id } => {
                let provider = Arc::clone(&self.provider);
                let id = sandbox_id.clone();
                self.queue(&id, async move {
                    provider.stop(&sandbox_id).await;
                });
            }
            Effect::Touch { sandbox_id } => self.provider.touch(&sandbox_id),
            Effect::Traced(run) => {
                if let Some(tracer) = &self.config.tracer {
                    crate::telemetry::run_spans(&run).into_iter().for_each(|span| tracer.emit(span));
                }
            }
            Effect::Retire { sandbox_id, linger } => {
                let provider = Arc::clone(&self.provider);
                let id = sandbox_id.clone();
                self.queue(&id, async move {
                    if !provider.wait_exit(&sandbox_id, linger).await {
                        provider.stop(&sandbox_id).await;
                    }
                    if let Err(error) = provider.delete(&sandbox_id).await {
                        tracing::warn!(%error, "deleting a retired sandbox failed");
                    }
                });
                // Nothing follows a retirement: the queue ends once drained.
                self.ops.remove(&id);
            }
            Effect::Probe { sandbox_id, credential_id } => {
                let provider = Arc::clone(&self.provider);
                let handle = self.handle.clone();
                tokio::spawn(async move {
                    let found = provider.state(&sandbox_id).await.unwrap_or_else(|error| {
                        tracing::warn!(%error, "probing a sandbox failed: taken as missing");
                        Found::Missing
                    });
                    handle.tell(Input::Probed { sandbox_id: sandbox_id.clone(), found }).await;
                    if found == Found::Running {
                        adopted::until_ended(provider.as_ref(), &sandbox_id).await;
                        handle.tell(Input::Exited { sandbox_id, credential_id, code: None }).await;
                    }
                });
            }
        }
    }
}

/// Reports the exit of the agent started with `credential_id` to the
/// engine when it comes.
fn watch_exit(handle: EngineHandle, sandbox_id: String, credential_id: String, launched: Launched) {
    tokio::spawn(async move {
        let code = launched.exited.await.unwrap_or(None);
        handle.tell(Input::Exited { sandbox_id, credential_id, code }).await;
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
        provider.stop(sandbox_id).await;
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
