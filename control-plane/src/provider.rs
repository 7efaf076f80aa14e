//! Where sandboxes come from: the [`SandboxProvider`] trait and its types,
//! and every provider, one module each:
//! - [`local`]: a directory plus a `standby` process group on this machine;
//! - [`docker`]: a container of the Docker Engine (`--provider docker`);
//! - [`kubernetes`]: a Pod and a workspace claim in a cluster
//!   (`--provider kubernetes`);
//! - [`spool`]: only a standby credential in a file, nothing launched (load
//!   generation, an image smoke test, an external launcher);
//! - `timers`: the idle auto-stop and the retention (archive, delete)
//!   rules, pure, and what a sweeper keeps between its rounds; the sweeper
//!   of every provider without timers of its own feeds them with facts.
//!
//! A sandbox's life at a provider: created, running (an agent launched in
//! it), stopped (no process, the filesystem kept), archived (stopped long
//! enough to be packed away; it starts again more slowly), deleted.
//!
//! Another provider is one more module: it implements [`SandboxProvider`]
//! and, when its platform has no idle stop or retention of its own, holds
//! a `Timers`, starts its sweeper with `ensure_sweeper` and hands the
//! rules its facts, as `local` and `docker` do.

pub mod docker;
pub mod kubernetes;
pub mod local;
pub mod spool;
mod timers;

use std::collections::HashSet;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use standby_protocol::{Fingerprint, Secret};
use tokio::sync::{oneshot, watch};

use self::timers::{IdleStop, Timers};

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("sandbox {sandbox}: cannot {action} {path}: {source}")]
    Io {
        sandbox: String,
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox {sandbox}: cannot start the agent {program}: {source}")]
    Spawn {
        sandbox: String,
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox {sandbox} does not exist (no directory {path})")]
    Missing { sandbox: String, path: PathBuf },
    #[error("sandbox {sandbox}: `tar {args}` failed: {message}")]
    Tar { sandbox: String, args: String, message: String },
    #[error("sandbox {sandbox}: the Docker Engine could not {action}: {source}")]
    Docker {
        sandbox: String,
        action: &'static str,
        #[source]
        source: bollard::errors::Error,
    },
    #[error("sandbox {sandbox}: the Kubernetes API could not {action}: {source}")]
    Kubernetes {
        sandbox: String,
        action: &'static str,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("sandbox {sandbox}: its Pod {pod} does not run: {reason}")]
    Pod { sandbox: String, pod: String, reason: String },
    #[error("sandbox {sandbox}: not started: the server is stopping")]
    Stopping { sandbox: String },
    #[error("the firewall of the sandboxes' network `{network}` cannot be put in place: {message}")]
    Firewall { network: String, message: String },
}

/// What a provider says of a sandbox ([`SandboxProvider::state`]), asked
/// after a restart or before a resume. It speaks of the sandbox's agent,
/// not of what runs it: a Docker container kept running between two agents
/// (Tier 2) is [`Found::NoAgent`], as is a stopped one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// An agent runs in it.
    Running,
    /// Exists, unpacked, and no agent runs in it: a start (which leaves a
    /// running container running) and a launch make it serve again.
    NoAgent,
    /// Stopped long enough that the provider packed it away; it can be
    /// started again, more slowly.
    Archived,
    /// The provider has no such sandbox (deleted, or never made).
    Missing,
}

/// What the agent of a sandbox is started with: the contract's variables.
#[derive(Debug, Clone)]
pub struct AgentLaunch {
    /// `STANDBY_SERVER_URL`.
    pub server_url: String,
    /// `STANDBY_TOKEN`: the sandbox's standby credential.
    pub token: Secret,
    /// `STANDBY_HEARTBEAT_INTERVAL`.
    pub heartbeat_interval: Duration,
    /// `STANDBY_LOG`.
    pub log_filter: String,
    /// `STANDBY_OTLP_ENDPOINT`, when the server exports traces: where the
    /// agent's spans go.
    pub otlp_endpoint: Option<String>,
}

impl AgentLaunch {
    /// A launch the providers' tests give agents that never reach a server.
    #[cfg(test)]
    pub(crate) fn unreachable() -> Self {
        Self {
            server_url: "http://127.0.0.1:1".into(),
            token: Secret::new("sby_x_y"),
            heartbeat_interval: Duration::from_millis(500),
            log_filter: "info".into(),
            otlp_endpoint: None,
        }
    }
}

/// A launched agent: its pid where the provider knows one, and its exit
/// code (`None` for death by signal) once it ends.
#[derive(Debug)]
pub struct Launched {
    pub pid: Option<u32>,
    pub exited: oneshot::Receiver<Option<i32>>,
}

/// Provider-specific facts about a sandbox, for `GET /v1/sandboxes`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Details {
    pub pid: Option<u32>,
    pub dir: Option<PathBuf>,
}

/// Creates, starts, stops and deletes sandboxes, and launches the agent in
/// them. The engine calls these from tasks, never while holding state.
pub trait SandboxProvider: Send + Sync + 'static {
    /// Allocates a new sandbox.
    fn create(&self, sandbox_id: &str) -> impl Future<Output = Result<(), ProviderError>> + Send;
    /// Allocates a new sandbox that prepares a workspace of `fingerprint`:
    /// from the snapshot of that fingerprint where the provider keeps one
    /// ([`SandboxProvider::snapshot`]), so its agent finds the workspace
    /// prepared; else as [`SandboxProvider::create`].
    fn create_for(
        &self,
        sandbox_id: &str,
        fingerprint: &Fingerprint,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send {
        let _ = fingerprint;
        self.create(sandbox_id)
    }
    /// Whether this provider keeps snapshots of prepared sandboxes
    /// ([`SandboxProvider::snapshot`]); the machine asks for one only then.
    fn snapshots(&self) -> bool {
        false
    }
    /// Keeps the filesystem of the prepared sandbox as the snapshot of
    /// `fingerprint`, from which [`SandboxProvider::create_for`] makes
    /// later sandboxes; a snapshot of that fingerprint already kept is
    /// kept as it is. The sandbox holds no run meanwhile.
    fn snapshot(
        &self,
        sandbox_id: &str,
        fingerprint: &Fingerprint,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send {
        let _ = (sandbox_id, fingerprint);
        std::future::ready(Ok(()))
    }
    /// Makes an existing sandbox runnable again (resuming a stopped one,
    /// unpacking an archived one).
    fn start(&self, sandbox_id: &str) -> impl Future<Output = Result<(), ProviderError>> + Send;
    /// Starts the `standby` agent in a started sandbox.
    fn launch(
        &self,
        sandbox_id: &str,
        launch: AgentLaunch,
    ) -> impl Future<Output = Result<Launched, ProviderError>> + Send;
    /// Stops the sandbox's processes (SIGTERM, then after the provider's
    /// stop grace SIGKILL); its filesystem is kept. The grace is the
    /// provider's own setting: every stop of a sandbox, whoever asks for
    /// it (the engine, the sweeper, a shutdown), gives the same.
    fn stop(&self, sandbox_id: &str) -> impl Future<Output = ()> + Send;
    /// A finished turn's sandbox is kept running for the thread's next turn
    /// (Tier 2) and its agent has exited: end whatever the turn left
    /// running. A provider that can keep a sandbox running without its
    /// agent (a container with its own PID 1) keeps it running; the
    /// default stops it, which for a process-group sandbox is the same.
    fn clear(&self, sandbox_id: &str) -> impl Future<Output = ()> + Send {
        self.stop(sandbox_id)
    }
    /// Waits up to `timeout` for the agent to exit on its own; whether it did.
    fn wait_exit(&self, sandbox_id: &str, timeout: Duration) -> impl Future<Output = bool> + Send;
    /// Removes a stopped sandbox for good.
    fn delete(&self, sandbox_id: &str) -> impl Future<Output = Result<(), ProviderError>> + Send;
    /// Whether the sandbox exists, and whether its agent runs.
    fn state(&self, sandbox_id: &str) -> impl Future<Output = Result<Found, ProviderError>> + Send;
    /// Stops every sandbox this process launched (server shutdown).
    fn stop_all(&self) -> impl Future<Output = ()> + Send;
    fn details(&self, sandbox_id: &str) -> Details;
    /// Sets the idle auto-stop: stopped after `minutes` provider minutes
    /// without activity (`0`: never). A provider without one ignores it.
    fn set_auto_stop(&self, sandbox_id: &str, minutes: u32) -> impl Future<Output = Result<(), ProviderError>> + Send {
        let _ = (sandbox_id, minutes);
        async { Ok(()) }
    }
    /// The idle auto-stop set on the sandbox; `None` when unknown.
    fn auto_stop(&self, sandbox_id: &str) -> impl Future<Output = Result<Option<u32>, ProviderError>> + Send {
        let _ = sandbox_id;
        async { Ok(None) }
    }
    /// After a restart, the sandboxes the store knows: a provider whose
    /// sandboxes outlive the server adopts those and removes the others it
    /// made (orphans of a crash between a create and its commit).
    fn adopt(&self, known: HashSet<String>) -> impl Future<Output = ()> + Send {
        let _ = known;
        async {}
    }
    /// The address agents reach the server at when it is not the listen
    /// address (a container network's gateway); `None`: the listen address.
    fn agent_host(&self) -> Option<std::net::IpAddr> {
        None
    }
    /// The server listens at `addr` and is about to serve: a provider that
    /// guards its sandboxes' network opens it to this address's port here,
    /// before any sandbox is made. Its clean stop ([`Self::stop_all`])
    /// closes it again.
    fn serving(&self, addr: std::net::SocketAddr) -> impl Future<Output = Result<(), ProviderError>> + Send {
        let _ = addr;
        async { Ok(()) }
    }
    /// The sandbox is busy: its idle clock starts over.
    fn touch(&self, sandbox_id: &str) {
        let _ = sandbox_id;
    }
    /// How every process of a sandbox is kept killable (`/metrics`):
    /// `cgroup`, `pid-namespace`, `process-group`, or `none` for a provider
    /// that runs no process here.
    fn containment(&self) -> &'static str {
        "none"
    }
}

/// Starts a provider's sweeper on its first use (it needs the runtime,
/// which a provider may be made without): `sweep` runs every
/// [`Timers::period`] while `inner`, the provider's state, lives, and the
/// task ends once it is dropped. Every provider without timers of its own
/// (local, Docker) sweeps through this one loop.
pub(crate) fn ensure_sweeper<T, F>(inner: &Arc<T>, timers: &Timers, sweep: impl Fn(Arc<T>) -> F + Send + 'static)
where
    T: Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let (inner, period) = (Arc::downgrade(inner), timers.period());
    timers.sweeper.call_once(move || {
        tokio::spawn(sweep_while_alive(inner, period, sweep));
    });
}

async fn sweep_while_alive<T, F>(inner: Weak<T>, period: Duration, sweep: impl Fn(Arc<T>) -> F)
where
    F: Future<Output = ()>,
{
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        sweep(inner).await;
    }
}

/// Stops the sandboxes the idle auto-stop claimed, each in a task of its
/// own: a round of the sweeper does not wait out their grace periods. A
/// claim ends with its stop.
pub(crate) fn stop_idle<P: SandboxProvider + Clone>(provider: &P, due: Vec<IdleStop>) {
    for claim in due {
        tracing::info!(
            sandbox_id = claim.sandbox_id,
            minutes = claim.minutes,
            "idle auto-stop: no activity for its auto-stop minutes"
        );
        let provider = provider.clone();
        tokio::spawn(async move {
            provider.stop(&claim.sandbox_id).await;
            drop(claim);
        });
    }
}

/// Whether `done` turned `true` within `timeout`: an agent exited.
pub(crate) async fn wait_done(mut done: watch::Receiver<bool>, timeout: Duration) -> bool {
    tokio::time::timeout(timeout, done.wait_for(|done| *done)).await.is_ok_and(|result| result.is_ok())
}

/// A provider's mutex, taken even if a panic poisoned it: what it guards
/// (maps of sandboxes) stays consistent at every await-free step.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
