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
//!   deletes the ones its store does not know;
//! - **agent-sandbox mode** (`agent_sandbox.rs`) makes each sandbox a
//!   SandboxClaim of a warm pool instead; everything else is the same.

mod agent_sandbox;
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

use self::agent_sandbox::AgentSandbox;
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
    /// Plain Pods, or agent-sandbox's claims of a warm pool.
    pub api: KubernetesApi,
    /// Agent-sandbox mode: the Sandboxes the warm pool keeps started.
    pub warm_pool: u32,
    /// The port agents reach the server at (its NetworkPolicy's egress).
    pub server_port: u16,
}

/// What a sandbox is made of (`--kubernetes-api`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KubernetesApi {
    /// A Pod and a workspace claim of the server's own.
    Pods,
    /// A SandboxClaim of kubernetes-sigs/agent-sandbox's warm pool.
    AgentSandbox,
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
    #[error(
        "cannot apply the SandboxTemplate and SandboxWarmPool `{name}` (is agent-sandbox installed, and its Role granted?): {source}"
    )]
    AgentSandbox {
        name: String,
        #[source]
        source: kube::Error,
    },
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
    /// The uid of the Pod it was started in: a Pod of the same name made
    /// again (agent-sandbox's controller does) is another Pod.
    pod_uid: Option<String>,
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
    timers: Arc<Timers>,
    /// Agent-sandbox mode's objects; `None` for plain Pods.
    agent_sandbox: Option<AgentSandbox>,
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
        let agent_sandbox = match options.api {
            KubernetesApi::Pods => None,
            KubernetesApi::AgentSandbox => {
                let grace = i64::try_from(options.stop_grace.as_secs()).unwrap_or(i64::MAX);
                let completed = pod::sandbox_template(&options.template, &options.instance, grace);
                let name = agent_sandbox::pool_name(&options.instance);
                let claim = (options.workspace_size.as_str(), options.storage_class.as_deref());
                let template =
                    agent_sandbox::template_object(&name, &completed, &options.instance, claim, options.server_port);
                let applied = AgentSandbox::apply(&client, &namespace, &options.instance, template, options.warm_pool);
                Some(applied.await.map_err(|source| KubernetesError::AgentSandbox { name, source })?)
            }
        };
        let (stop, stopped) = watch::channel(false);
        let sandbox_claims = agent_sandbox.as_ref().map(|_| agent_sandbox::claims_resource());
        let cache = Cache::start(&client, &namespace, &selector, sandbox_claims.as_ref(), stopped);
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
            timers,
            agent_sandbox,
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
        let cache = &self.inner.cache;
        let timeout = self.inner.options.start_timeout;
        // A Pod made a moment ago may not be heard yet: absent counts as
        // gone only once it was seen. A claim not bound yet is pending.
        let mut seen = false;
        let settled = |cache: &Cache| match self.pod_of(sandbox_id).map(|name| cache.pod_state(&name)) {
            None => false,
            Some(PodState::Pending) => {
                seen = true;
                false
            }
            Some(PodState::Absent) => seen,
            Some(PodState::Running | PodState::Deleting | PodState::Ended(_)) => true,
        };
        cache.wait_until(timeout, settled).await;
        let Some(name) = self.pod_of(sandbox_id) else {
            return Err(ProviderError::Pod {
                sandbox: sandbox_id.to_owned(),
                pod: pod::pod_name(sandbox_id),
                reason: format!("its SandboxClaim was not bound to a Sandbox within {timeout:?}"),
            });
        };
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

    /// The Pod of a sandbox: its own, or (agent-sandbox mode) the one of
    /// the Sandbox its claim was bound to; `None` while it is not bound.
    fn pod_of(&self, sandbox_id: &str) -> Option<String> {
        match &self.inner.agent_sandbox {
            None => Some(pod::pod_name(sandbox_id)),
            Some(_) => self
                .inner
                .cache
                .sandbox_claim(&pod::pod_name(sandbox_id))
                .and_then(|claim| agent_sandbox::bound_sandbox(&claim)),
        }
    }

    /// How the sandbox's Pod stands (absent while a claim is not bound).
    fn pod_state(&self, sandbox_id: &str) -> PodState {
        self.pod_of(sandbox_id).map_or(PodState::Absent, |name| self.inner.cache.pod_state(&name))
    }

    /// Waits until the sandbox's Pod is gone, up to `timeout`.
    async fn wait_gone(&self, sandbox_id: &str, timeout: Duration) {
        let gone = |_: &Cache| self.pod_state(sandbox_id) == PodState::Absent;
        if !self.inner.cache.wait_until(timeout, gone).await {
            tracing::warn!(sandbox_id, "a sandbox's Pod is still there after its grace");
        }
    }

    /// Deletes the sandbox's own Pod with `grace` and waits until it is gone.
    async fn delete_pod(&self, sandbox_id: &str, grace: Duration) -> Result<(), ProviderError> {
        let name = pod::pod_name(sandbox_id);
        let seconds = u32::try_from(grace.as_secs()).unwrap_or(u32::MAX);
        let params = DeleteParams { grace_period_seconds: Some(seconds), ..Default::default() };
        match self.inner.pods.delete(&name, &params).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => return Ok(()),
            Err(error) => return Err(Self::failed(sandbox_id, "delete its Pod")(error)),
        }
        self.wait_gone(sandbox_id, grace + DELETE_SLACK).await;
        Ok(())
    }

    /// Whether the sandbox still exists when it has no Pod: its workspace
    /// claim (or its SandboxClaim), not being deleted, as the watches have
    /// it: the provider reads no single object.
    fn kept(&self, sandbox_id: &str) -> bool {
        let cache = &self.inner.cache;
        let name = pod::pod_name(sandbox_id);
        match &self.inner.agent_sandbox {
            None => cache
                .claim(&pod::claim_name(sandbox_id))
                .is_some_and(|claim| claim.metadata.deletion_timestamp.is_none()),
            Some(_) => cache.sandbox_claim(&name).is_some_and(|claim| claim.metadata.deletion_timestamp.is_none()),
        }
    }

    /// Stamps the sandbox with the time it stopped (the retention's age);
    /// a missing one is fine.
    async fn stamp_stopped(&self, sandbox_id: &str) {
        let now = jiff::Timestamp::now().to_string();
        let stamped = match &self.inner.agent_sandbox {
            Some(agent_sandbox) => agent_sandbox.stamp_stopped(sandbox_id, &now).await,
            None => {
                let patch = serde_json::json!({"metadata": {"annotations": {pod::STOPPED_AT: now}}});
                let claims = &self.inner.claims;
                match claims.patch(&pod::claim_name(sandbox_id), &PatchParams::default(), &Patch::Merge(&patch)).await {
                    Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
                    other => other.map(drop),
                }
            }
        };
        if let Err(error) = stamped {
            tracing::warn!(sandbox_id, %error, "stamping a stopped sandbox failed");
        }
    }

    /// The sandboxes whose Pod runs.
    fn running(&self) -> Vec<String> {
        self.sandbox_ids().into_iter().filter(|id| self.pod_state(id) == PodState::Running).collect()
    }

    /// The sandboxes without a Pod, with when they stopped (their stamp).
    fn stopped(&self) -> Vec<(String, Option<String>)> {
        let stamp = |meta: &kube::api::ObjectMeta| meta.annotations.as_ref()?.get(pod::STOPPED_AT).cloned();
        let cache = &self.inner.cache;
        let kept: Vec<(String, Option<String>)> = match &self.inner.agent_sandbox {
            None => cache
                .claims()
                .iter()
                .filter_map(|claim| Some((pod::sandbox_of(&claim.metadata)?.to_owned(), stamp(&claim.metadata))))
                .collect(),
            Some(_) => cache
                .sandbox_claims()
                .iter()
                .filter_map(|claim| Some((pod::sandbox_of(&claim.metadata)?.to_owned(), stamp(&claim.metadata))))
                .collect(),
        };
        kept.into_iter().filter(|(id, _)| self.pod_state(id) == PodState::Absent).collect()
    }

    /// Every sandbox of this control plane the watches know of.
    fn sandbox_ids(&self) -> Vec<String> {
        let cache = &self.inner.cache;
        let mut ids: Vec<String> = match &self.inner.agent_sandbox {
            None => cache
                .pods()
                .iter()
                .map(|found| &found.metadata)
                .chain(cache.claims().iter().map(|claim| &claim.metadata))
                .filter_map(|meta| pod::sandbox_of(meta).map(str::to_owned))
                .collect(),
            Some(_) => cache
                .sandbox_claims()
                .iter()
                .filter_map(|claim| pod::sandbox_of(&claim.metadata).map(str::to_owned))
                .collect(),
        };
        ids.sort();
        ids.dedup();
        ids
    }

    fn agent_done(&self, sandbox_id: &str) -> Option<watch::Receiver<bool>> {
        lock(&self.inner.agents).get(sandbox_id).map(|agent| agent.done.clone())
    }

    /// `standby WORD` in the sandbox's Pod.
    async fn word(&self, sandbox_id: &str, word: &str) -> Result<Option<i32>, ProviderError> {
        let Some(pod) = self.pod_of(sandbox_id) else { return Ok(None) };
        exec::run_word(&self.inner.pods, &pod, sandbox_id, word, WORD_TIMEOUT).await
    }

    fn unbound(sandbox_id: &str) -> ProviderError {
        ProviderError::Pod {
            sandbox: sandbox_id.to_owned(),
            pod: pod::pod_name(sandbox_id),
            reason: "its SandboxClaim is not bound to a Sandbox".to_owned(),
        }
    }
}

/// Tells every agent whose Pod is gone or ended (evicted, its node lost)
/// that it is, on every change the watches hear: level-triggered, so a
/// Pod that vanished in a re-list counts too.
async fn watch_for_lost_pods(inner: Weak<KubernetesInner>, mut changes: watch::Receiver<u64>) {
    while changes.changed().await.is_ok() {
        let Some(inner) = inner.upgrade() else { return };
        let provider = KubernetesProvider { inner: Arc::clone(&inner) };
        let mut agents = lock(&inner.agents);
        for (sandbox_id, agent) in agents.iter_mut() {
            if *agent.done.borrow() || agent.lost.is_none() {
                continue;
            }
            let pod = provider.pod_of(sandbox_id).and_then(|name| inner.cache.pod(&name));
            let replaced = match (&pod, &agent.pod_uid) {
                (Some(pod), Some(uid)) => pod.metadata.uid.as_ref() != Some(uid),
                _ => false,
            };
            let why = match provider.pod_state(sandbox_id) {
                _ if replaced => "its Pod was made again".to_owned(),
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
        if let Some(agent_sandbox) = &self.inner.agent_sandbox {
            let claimed = agent_sandbox.claim(sandbox_id, &options.instance).await;
            claimed.map_err(Self::failed(sandbox_id, "create its SandboxClaim"))?;
            return self.wait_running(sandbox_id).await;
        }
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
        let state = self.pod_state(sandbox_id);
        match state {
            PodState::Running => return Ok(()),
            PodState::Pending => return self.wait_running(sandbox_id).await,
            PodState::Deleting | PodState::Ended(_) | PodState::Absent => {}
        }
        if !self.kept(sandbox_id) {
            return Err(ProviderError::Missing {
                sandbox: sandbox_id.to_owned(),
                path: PathBuf::from(format!("claim {}", pod::claim_name(sandbox_id))),
            });
        }
        if let Some(agent_sandbox) = &self.inner.agent_sandbox {
            let sandbox = self.pod_of(sandbox_id).ok_or_else(|| Self::unbound(sandbox_id))?;
            if state != PodState::Absent {
                self.wait_gone(sandbox_id, self.inner.options.stop_grace + DELETE_SLACK).await;
            }
            let resumed = agent_sandbox.set_mode(&sandbox, "Running").await;
            resumed.map_err(Self::failed(sandbox_id, "resume its Sandbox"))?;
            self.wait_running(sandbox_id).await?;
        } else {
            if state != PodState::Absent {
                self.delete_pod(sandbox_id, Duration::ZERO).await?;
            }
            self.make_pod(sandbox_id).await?;
        }
        tracing::info!(sandbox_id, "a stopped sandbox's Pod made again on its workspace claim");
        Ok(())
    }

    async fn launch(&self, sandbox_id: &str, launch: AgentLaunch) -> Result<Launched, ProviderError> {
        let name = self.pod_of(sandbox_id).ok_or_else(|| Self::unbound(sandbox_id))?;
        let log = self.log_path(sandbox_id);
        let started = exec::start_agent(&self.inner.pods, &name, sandbox_id, &launch, log).await?;
        let pod_uid = self.inner.cache.pod(&name).and_then(|found| found.metadata.uid.clone());
        let agent = Agent { done: started.done, lost: Some(started.lost), pod_uid };
        lock(&self.inner.agents).insert(sandbox_id.to_owned(), agent);
        self.inner.timers.active(sandbox_id, Instant::now());
        tracing::info!(sandbox_id, pod = name, "agent started by an exec");
        Ok(Launched { pid: None, exited: started.exited })
    }

    async fn stop(&self, sandbox_id: &str) {
        let grace = self.inner.options.stop_grace;
        let stopped = match (&self.inner.agent_sandbox, self.pod_of(sandbox_id)) {
            (Some(agent_sandbox), Some(sandbox)) => {
                let suspended = agent_sandbox.set_mode(&sandbox, "Suspended").await;
                let suspended = suspended.map_err(Self::failed(sandbox_id, "suspend its Sandbox"));
                if suspended.is_ok() {
                    self.wait_gone(sandbox_id, grace + DELETE_SLACK).await;
                }
                suspended
            }
            (Some(_), None) => Ok(()),
            (None, _) => self.delete_pod(sandbox_id, grace).await,
        };
        if let Err(error) = stopped {
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
        if let Some(agent_sandbox) = &self.inner.agent_sandbox {
            agent_sandbox.release(sandbox_id).await.map_err(Self::failed(sandbox_id, "delete its SandboxClaim"))?;
        } else {
            self.delete_pod(sandbox_id, Duration::ZERO).await?;
            match self.inner.claims.delete(&pod::claim_name(sandbox_id), &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => return Err(Self::failed(sandbox_id, "delete its workspace claim")(error)),
            }
        }
        self.inner.timers.deleted(sandbox_id);
        lock(&self.inner.agents).remove(sandbox_id);
        let _ = tokio::fs::remove_file(self.log_path(sandbox_id)).await;
        Ok(())
    }

    async fn state(&self, sandbox_id: &str) -> Result<Found, ProviderError> {
        self.ensure_sweeper();
        match self.pod_state(sandbox_id) {
            PodState::Running => {}
            PodState::Pending => return Ok(Found::NoAgent),
            PodState::Absent | PodState::Deleting | PodState::Ended(_) => {
                return Ok(if self.kept(sandbox_id) { Found::NoAgent } else { Found::Missing });
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
        for sandbox_id in self.sandbox_ids() {
            if known.contains(&sandbox_id) {
                tracing::info!(sandbox_id, "adopted a sandbox");
                continue;
            }
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
        self.inner.timers.set_auto_stop(sandbox_id, minutes);
        Ok(())
    }

    async fn auto_stop(&self, sandbox_id: &str) -> Result<Option<u32>, ProviderError> {
        Ok(self.inner.timers.auto_stop(sandbox_id))
    }

    fn touch(&self, sandbox_id: &str) {
        self.inner.timers.active(sandbox_id, Instant::now());
    }

    fn containment(&self) -> &'static str {
        "container"
    }
}
