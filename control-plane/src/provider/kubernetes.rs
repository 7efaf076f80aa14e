//! The `kubernetes` provider (`standby-server serve --provider
//! kubernetes`): a sandbox is a Pod with a PersistentVolumeClaim for its
//! workspace, in one namespace of a cluster, driven through the API with
//! `kube` (in-cluster service account, or `KUBECONFIG`).
//!
//! - **create**: the workspace claim, then the Pod from the operator's
//!   template (`pod.rs` says what the server adds and refuses), whose PID
//!   1 is `standby hold`; it returns once the Pod runs;
//! - **launch**: a `pods/exec` of the agent with a fresh standby credential
//!   on its standard input (`exec.rs`): the first launch, each Tier 2
//!   follow-up and each Tier 1 resume is one;
//! - **Tier 2** (a parked running sandbox): the Pod keeps running; what
//!   the turn left is killed by its PID 1, asked by an exec
//!   (`standby clear`), and the next agent is a new exec;
//! - **stop** (Tier 1): the Pod is deleted with the stop grace, its claim
//!   kept and stamped with the time; **start** makes a new Pod on the same
//!   claim (the agent comes back from a new pod IP); a sandbox without a
//!   claim is missing, and its resume falls back to cold with the reason;
//! - **timers**: the sweeper (`sweeper.rs`, the rules shared with `local`
//!   and `docker`) stops idle Pods and deletes long-stopped sandboxes;
//! - **state** comes from one watch per kind (`cache.rs`), never a poll per
//!   Pod; the same watches tell an agent that its Pod was evicted, deleted
//!   or lost with its node, so its run is requeued or failed by the
//!   contract's rule without waiting out the silence bound;
//! - **a server's stop** leaves the Pods running: the next server (or the
//!   next leader of the replicas) adopts them by the instance label and
//!   deletes the ones its store does not know.

mod cache;
mod exec;
pub mod pod;
mod sweeper;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, PodTemplateSpec};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use tokio::sync::{oneshot, watch};

use self::cache::{Cache, PodState};
use super::timers::Timers;
use super::{AgentLaunch, Details, Found, Launched, ProviderError, SandboxProvider, ensure_sweeper, lock, wait_done};
pub use k8s_openapi::api::core::v1::Pod;

/// How the Kubernetes provider makes and times its sandboxes.
#[derive(Debug, Clone)]
pub struct KubernetesOptions {
    /// The namespace of the sandboxes; the client's own when `None` (in a
    /// cluster, the server Pod's namespace).
    pub namespace: Option<String>,
    /// The checked pod template (`pod::load_template`).
    pub template: PodTemplateSpec,
    /// The size each workspace claim asks for (`10Gi`).
    pub workspace_size: String,
    /// The claims' storage class; the cluster's default when `None`.
    pub storage_class: Option<String>,
    /// The label value of everything this control plane makes; every
    /// replica of one control plane shares it.
    pub instance: String,
    /// Where each sandbox's agent output is appended (`<id>.log`).
    pub log_dir: PathBuf,
    /// How long a provider minute is (auto-stop, delete).
    pub minute: Duration,
    /// Stopped for this many minutes: kept as it is (no archive on
    /// Kubernetes; see `sweeper.rs`).
    pub auto_archive: u32,
    /// Stopped for this many minutes: deleted, claim and all (`0`: never).
    pub auto_delete: u32,
    /// Between SIGTERM and SIGKILL when a Pod is deleted.
    pub stop_grace: Duration,
    /// How long a new Pod may take to run (scheduling, image pull).
    pub start_timeout: Duration,
}

/// Why the provider cannot start.
#[derive(Debug, thiserror::Error)]
pub enum KubernetesError {
    #[error("no Kubernetes client configuration (in a cluster: the service account; elsewhere: KUBECONFIG): {0}")]
    Config(#[source] kube::Error),
    #[error("cannot list Pods in namespace `{namespace}` (is the API server reachable, and the Role bound?): {source}")]
    Access {
        namespace: String,
        #[source]
        source: kube::Error,
    },
    #[error("the watches of Pods and claims in namespace `{namespace}` did not list within {timeout:?}")]
    Watch { namespace: String, timeout: Duration },
}

/// How long the watches may take to list at the start.
const FIRST_LIST: Duration = Duration::from_secs(30);
/// Beyond the stop grace, how long a deleted Pod may take to be gone.
const DELETE_SLACK: Duration = Duration::from_secs(30);
/// How long a `standby clear` or `standby busy` exec may take.
const WORD_TIMEOUT: Duration = Duration::from_secs(20);

/// An agent exec this server started.
#[derive(Debug)]
struct Agent {
    done: watch::Receiver<bool>,
    lost: Option<oneshot::Sender<String>>,
}

/// Sandboxes as Pods.
#[derive(Debug, Clone)]
pub struct KubernetesProvider {
    inner: Arc<KubernetesInner>,
}

#[derive(Debug)]
struct KubernetesInner {
    pods: Api<Pod>,
    claims: Api<PersistentVolumeClaim>,
    cache: Cache,
    options: KubernetesOptions,
    agents: Mutex<HashMap<String, Agent>>,
    /// Auto-stop minutes of each sandbox (memory, as on Docker).
    auto_stop: Mutex<HashMap<String, u32>>,
    timers: Arc<Timers>,
    /// `true` once [`SandboxProvider::stop_all`] began: no Pod is made after.
    closed: tokio::sync::RwLock<bool>,
    /// Dropped with the provider: the watches end.
    _stop: watch::Sender<bool>,
}

impl KubernetesProvider {
    /// Connects to the API server, checks that Pods can be listed, and
    /// starts the watches.
    pub async fn connect(options: KubernetesOptions) -> Result<Self, KubernetesError> {
        let client = kube::Client::try_default().await.map_err(KubernetesError::Config)?;
        let namespace = options.namespace.clone().unwrap_or_else(|| client.default_namespace().to_owned());
        let selector = pod::instance_selector(&options.instance);
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        pods.list(&ListParams::default().labels(&selector).limit(1))
            .await
            .map_err(|source| KubernetesError::Access { namespace: namespace.clone(), source })?;
        let (stop, stopped) = watch::channel(false);
        let cache = Cache::start(&client, &namespace, &selector, stopped);
        if !tokio::time::timeout(FIRST_LIST, cache.ready()).await.unwrap_or(false) {
            return Err(KubernetesError::Watch { namespace, timeout: FIRST_LIST });
        }
        std::fs::create_dir_all(&options.log_dir).ok();
        tracing::info!(namespace, instance = options.instance, "kubernetes provider ready");
        let timers = Timers::new(options.minute, options.auto_archive, options.auto_delete);
        let inner = Arc::new(KubernetesInner {
            pods,
            claims: Api::namespaced(client, &namespace),
            cache,
            options,
            agents: Mutex::new(HashMap::new()),
            auto_stop: Mutex::new(HashMap::new()),
            timers,
            closed: tokio::sync::RwLock::new(false),
            _stop: stop,
        });
        tokio::spawn(watch_for_lost_pods(Arc::downgrade(&inner), inner.cache.changed()));
        Ok(Self { inner })
    }

    fn ensure_sweeper(&self) {
        ensure_sweeper(&self.inner, &self.inner.timers, sweeper::sweep_once);
    }

    fn log_path(&self, sandbox_id: &str) -> PathBuf {
        self.inner.options.log_dir.join(format!("{sandbox_id}.log"))
    }

    fn failed(sandbox_id: &str, action: &'static str) -> impl FnOnce(kube::Error) -> ProviderError {
        let sandbox = sandbox_id.to_owned();
        move |source| ProviderError::Kubernetes { sandbox, action, source: Box::new(source) }
    }

    /// Makes the sandbox's Pod (its claim exists) and waits until it runs.
    async fn make_pod(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        let options = &self.inner.options;
        let grace = i64::try_from(options.stop_grace.as_secs()).unwrap_or(i64::MAX);
        let body = pod::pod(&options.template, sandbox_id, &options.instance, grace);
        match self.inner.pods.create(&PostParams::default(), &body).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => return Err(Self::failed(sandbox_id, "create its Pod")(error)),
        }
        self.wait_running(sandbox_id).await
    }

    /// Waits until the sandbox's Pod runs, or says why it will not.
    async fn wait_running(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        let name = pod::pod_name(sandbox_id);
        let cache = &self.inner.cache;
        let timeout = self.inner.options.start_timeout;
        // A Pod made a moment ago may not be heard yet: absent counts as
        // gone only once it was seen.
        let mut seen = false;
        let settled = |cache: &Cache| match cache.pod_state(&name) {
            PodState::Pending => {
                seen = true;
                false
            }
            PodState::Absent => seen,
            PodState::Running | PodState::Deleting | PodState::Ended(_) => true,
        };
        cache.wait_until(timeout, settled).await;
        let reason = match cache.pod_state(&name) {
            PodState::Running => return Ok(()),
            PodState::Pending => {
                let why = cache.pod(&name).and_then(|found| cache::pending_reason(&found));
                format!("not running after {timeout:?}{}", why.map(|why| format!(": {why}")).unwrap_or_default())
            }
            PodState::Absent => "deleted while starting".to_owned(),
            PodState::Deleting => "being deleted while starting".to_owned(),
            PodState::Ended(why) => why,
        };
        Err(ProviderError::Pod { sandbox: sandbox_id.to_owned(), pod: name, reason })
    }

    /// Deletes the sandbox's Pod with `grace` and waits until it is gone.
    async fn delete_pod(&self, sandbox_id: &str, grace: Duration) -> Result<(), ProviderError> {
        let name = pod::pod_name(sandbox_id);
        let seconds = u32::try_from(grace.as_secs()).unwrap_or(u32::MAX);
        let params = DeleteParams { grace_period_seconds: Some(seconds), ..Default::default() };
        match self.inner.pods.delete(&name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
            Err(error) => return Err(Self::failed(sandbox_id, "delete its Pod")(error)),
        }
        let gone = |cache: &Cache| cache.pod_state(&name) == PodState::Absent;
        if !self.inner.cache.wait_until(grace + DELETE_SLACK, gone).await {
            tracing::warn!(sandbox_id, pod = name, "a deleted Pod is still there after its grace");
        }
        Ok(())
    }

    /// Whether the sandbox's workspace claim exists and is not being
    /// deleted, from the watch's store: the provider reads no object by
    /// itself (its Role grants no `get`).
    fn claim_exists(&self, sandbox_id: &str) -> bool {
        self.inner
            .cache
            .claim(&pod::claim_name(sandbox_id))
            .is_some_and(|claim| claim.metadata.deletion_timestamp.is_none())
    }

    /// Stamps the claim with the time its sandbox stopped (the retention's
    /// age); a missing claim is fine.
    async fn stamp_stopped(&self, sandbox_id: &str) {
        let name = pod::claim_name(sandbox_id);
        let now = jiff::Timestamp::now().to_string();
        let patch = serde_json::json!({"metadata": {"annotations": {pod::STOPPED_AT: now}}});
        match self.inner.claims.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => tracing::warn!(sandbox_id, %error, "stamping a stopped sandbox's claim failed"),
        }
    }

    fn agent_done(&self, sandbox_id: &str) -> Option<watch::Receiver<bool>> {
        lock(&self.inner.agents).get(sandbox_id).map(|agent| agent.done.clone())
    }

    /// `standby WORD` in the sandbox's Pod.
    async fn word(&self, sandbox_id: &str, word: &str) -> Result<Option<i32>, ProviderError> {
        exec::run_word(&self.inner.pods, &pod::pod_name(sandbox_id), sandbox_id, word, WORD_TIMEOUT).await
    }
}

/// Tells every agent whose Pod is gone or ended (evicted, its node lost)
/// that it is, on every change the watches hear: level-triggered, so a
/// Pod that vanished in a re-list counts too.
async fn watch_for_lost_pods(inner: Weak<KubernetesInner>, mut changes: watch::Receiver<u64>) {
    while changes.changed().await.is_ok() {
        let Some(inner) = inner.upgrade() else { return };
        let mut agents = lock(&inner.agents);
        for (sandbox_id, agent) in agents.iter_mut() {
            if *agent.done.borrow() || agent.lost.is_none() {
                continue;
            }
            let why = match inner.cache.pod_state(&pod::pod_name(sandbox_id)) {
                PodState::Absent => "its Pod is gone".to_owned(),
                PodState::Ended(why) => format!("its Pod ended ({why})"),
                PodState::Running | PodState::Pending | PodState::Deleting => continue,
            };
            if let Some(lost) = agent.lost.take() {
                let _ = lost.send(why);
            }
        }
    }
}

impl SandboxProvider for KubernetesProvider {
    async fn create(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        self.ensure_sweeper();
        let closed = self.inner.closed.read().await;
        if *closed {
            return Err(ProviderError::Stopping { sandbox: sandbox_id.to_owned() });
        }
        let options = &self.inner.options;
        let claim =
            pod::claim(sandbox_id, &options.instance, &options.workspace_size, options.storage_class.as_deref());
        match self.inner.claims.create(&PostParams::default(), &claim).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(error) => return Err(Self::failed(sandbox_id, "create its workspace claim")(error)),
        }
        self.make_pod(sandbox_id).await
    }

    async fn start(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        self.ensure_sweeper();
        let closed = self.inner.closed.read().await;
        if *closed {
            return Err(ProviderError::Stopping { sandbox: sandbox_id.to_owned() });
        }
        let _starting = self.inner.timers.starting().await;
        match self.inner.cache.pod_state(&pod::pod_name(sandbox_id)) {
            PodState::Running => return Ok(()),
            PodState::Pending => return self.wait_running(sandbox_id).await,
            PodState::Deleting | PodState::Ended(_) => self.delete_pod(sandbox_id, Duration::ZERO).await?,
            PodState::Absent => {}
        }
        if !self.claim_exists(sandbox_id) {
            return Err(ProviderError::Missing {
                sandbox: sandbox_id.to_owned(),
                path: PathBuf::from(format!("claim {}", pod::claim_name(sandbox_id))),
            });
        }
        self.make_pod(sandbox_id).await?;
        tracing::info!(sandbox_id, "a stopped sandbox's Pod made again on its workspace claim");
        Ok(())
    }

    async fn launch(&self, sandbox_id: &str, launch: AgentLaunch) -> Result<Launched, ProviderError> {
        let name = pod::pod_name(sandbox_id);
        let log = self.log_path(sandbox_id);
        let started = exec::start_agent(&self.inner.pods, &name, sandbox_id, &launch, log).await?;
        let agent = Agent { done: started.done, lost: Some(started.lost) };
        lock(&self.inner.agents).insert(sandbox_id.to_owned(), agent);
        self.inner.timers.active(sandbox_id, Instant::now());
        tracing::info!(sandbox_id, pod = name, "agent started by an exec");
        Ok(Launched { pid: None, exited: started.exited })
    }

    async fn stop(&self, sandbox_id: &str) {
        if let Err(error) = self.delete_pod(sandbox_id, self.inner.options.stop_grace).await {
            tracing::warn!(%error, "stopping a sandbox's Pod failed");
        }
        if let Some(done) = self.agent_done(sandbox_id) {
            wait_done(done, Duration::from_secs(10)).await;
        }
        lock(&self.inner.agents).remove(sandbox_id);
        self.stamp_stopped(sandbox_id).await;
        self.inner.timers.forget(sandbox_id);
    }

    async fn clear(&self, sandbox_id: &str) {
        // The clearing exec is killed with the rest; `busy` says whether it worked.
        let _ = self.word(sandbox_id, "clear").await;
        match self.word(sandbox_id, "busy").await {
            Ok(Some(1)) => {}
            outcome => {
                tracing::warn!(sandbox_id, ?outcome, "a kept Pod could not be cleared: stopped instead");
                self.stop(sandbox_id).await;
            }
        }
    }

    async fn wait_exit(&self, sandbox_id: &str, timeout: Duration) -> bool {
        if let Some(done) = self.agent_done(sandbox_id) {
            return wait_done(done, timeout).await;
        }
        // An agent this server did not start (adopted after a restart).
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if !matches!(self.state(sandbox_id).await, Ok(Found::Running)) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    async fn delete(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        self.delete_pod(sandbox_id, Duration::ZERO).await?;
        match self.inner.claims.delete(&pod::claim_name(sandbox_id), &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => return Err(Self::failed(sandbox_id, "delete its workspace claim")(error)),
        }
        self.inner.timers.forget(sandbox_id);
        lock(&self.inner.auto_stop).remove(sandbox_id);
        lock(&self.inner.agents).remove(sandbox_id);
        let _ = tokio::fs::remove_file(self.log_path(sandbox_id)).await;
        Ok(())
    }

    async fn state(&self, sandbox_id: &str) -> Result<Found, ProviderError> {
        self.ensure_sweeper();
        match self.inner.cache.pod_state(&pod::pod_name(sandbox_id)) {
            PodState::Running => {}
            PodState::Pending => return Ok(Found::NoAgent),
            PodState::Absent | PodState::Deleting | PodState::Ended(_) => {
                return Ok(if self.claim_exists(sandbox_id) { Found::NoAgent } else { Found::Missing });
            }
        }
        if let Some(done) = self.agent_done(sandbox_id) {
            return Ok(if *done.borrow() { Found::NoAgent } else { Found::Running });
        }
        Ok(match self.word(sandbox_id, "busy").await? {
            Some(0) => Found::Running,
            _ => Found::NoAgent,
        })
    }

    async fn stop_all(&self) {
        // Pods outlive the server: the next one adopts them.
        *self.inner.closed.write().await = true;
    }

    async fn adopt(&self, known: HashSet<String>) {
        self.ensure_sweeper();
        let cache = &self.inner.cache;
        let pods = cache
            .pods()
            .iter()
            .filter_map(|found| pod::sandbox_of(&found.metadata).map(str::to_owned))
            .collect::<Vec<_>>();
        let claims = cache
            .claims()
            .iter()
            .filter_map(|found| pod::sandbox_of(&found.metadata).map(str::to_owned))
            .collect::<Vec<_>>();
        let mut orphans = HashSet::new();
        for sandbox_id in pods.iter().chain(&claims) {
            if known.contains(sandbox_id) {
                tracing::info!(sandbox_id, "adopted a sandbox");
            } else {
                orphans.insert(sandbox_id.clone());
            }
        }
        for sandbox_id in orphans {
            tracing::warn!(sandbox_id, "deleting an orphaned sandbox of this control plane");
            if let Err(error) = self.delete(&sandbox_id).await {
                tracing::warn!(%error, "deleting an orphaned sandbox failed");
            }
        }
    }

    fn details(&self, _sandbox_id: &str) -> Details {
        Details::default()
    }

    async fn set_auto_stop(&self, sandbox_id: &str, minutes: u32) -> Result<(), ProviderError> {
        self.ensure_sweeper();
        lock(&self.inner.auto_stop).insert(sandbox_id.to_owned(), minutes);
        Ok(())
    }

    async fn auto_stop(&self, sandbox_id: &str) -> Result<Option<u32>, ProviderError> {
        Ok(lock(&self.inner.auto_stop).get(sandbox_id).copied())
    }

    fn touch(&self, sandbox_id: &str) {
        self.inner.timers.active(sandbox_id, Instant::now());
    }

    fn containment(&self) -> &'static str {
        "container"
    }
}
