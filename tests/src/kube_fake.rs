//! An in-process fake Kubernetes API server with a fake kubelet, for testing
//! the Kubernetes provider with the real `kube::Client` where no real
//! kube-apiserver can run.
//!
//! [`FakeCluster::start`] serves plain HTTP on `127.0.0.1:0`: a generic
//! object store (pods, PVCs, config maps, secrets; custom resources are one
//! line in [`store::registry`]) with the API server's resource versions,
//! conflicts, merge patches, selectors, watches (history, bookmarks, 410 on
//! a compacted version) and graceful pod deletion; a kubelet that runs each
//! pod's one container as host processes in a PID namespace of its own; and
//! exec over the WebSocket channel protocol (v5, v4).
//!
//! # Limits of the fake (read before trusting a green test)
//!
//! - **No images, no mounts, no filesystem isolation.** A container runs on
//!   the host's filesystem, as root. Its command's first word is mapped
//!   through [`FakeOptions::binaries`] (container path → host path); nothing
//!   else is. Volumes are *path mappings*: a `volumeMounts[].mountPath` of a
//!   PVC volume stands for [`FakeCluster::pvc_dir`], of an `emptyDir` for a
//!   per-pod temp directory, and the fake rewrites any env value, argument
//!   (of the container and of an exec) and the working directory equal to
//!   a mount path or below it (`mountPath + "/"`) to the host path. Files
//!   the process reads and paths it builds itself are NOT rewritten. `configMap`, `secret`, `projected`
//!   volumes are not mapped at all.
//! - **Isolation is a PID namespace and a mount namespace only** (`unshare
//!   --pid --fork --mount-proc`): the container's first process is PID 1 and
//!   sees only its own processes; it shares the host's network (`podIP` is
//!   127.0.0.1), users, cgroups and hostname (`HOSTNAME` is set to the pod's
//!   name in its environment only). Needs root; without it a pod fails.
//! - One node (`fake-node`), one container per pod (more: the pod fails), no
//!   init containers, no probes, no resources, no image pulls. Security
//!   contexts are ignored except that `privileged: true` is refused at create.
//! - `restartPolicy` is honoured (Always and OnFailure restart the
//!   container, `restartCount` and `lastState` move, `CrashLoopBackOff`
//!   between runs) but the back-off is 1 s doubling to 8 s, not 10 s to
//!   5 minutes, and it never resets.
//! - Strategic merge patch is applied as a JSON merge patch (lists replace
//!   whole), server-side apply as create-or-merge-patch (no field ownership,
//!   no conflicts between managers), JSON patch is refused (415).
//! - No admission, RBAC, authentication, namespaces as objects, owner
//!   references/garbage collection (except for what agent-sandbox's
//!   objects own, below), finalizers other than PVC protection,
//!   `limit`/`continue` paging (every list is whole), or
//!   `resourceVersionMatch`. Events are stored, never generated.
//! - Exec has no TTY (a `tty=true` exec gets pipes) and ignores resize.
//!   As on a real node, an exec whose background child keeps stdout open
//!   does not end until that child does.

//! - Pod logs are the whole log at once: `follow`, `tailLines`, `sinceTime`,
//!   `previous` are ignored. Delete preconditions and `propagationPolicy`
//!   are ignored. The eviction API (`pods/{name}/eviction`) is a graceful
//!   delete (no disruption budgets). `/version`, `/api`, `/apis` are
//!   answered but not recorded in [`FakeCluster::calls`].
//!
//! # agent-sandbox (kubernetes-sigs/agent-sandbox, v1beta1)
//!
//! The CRDs are served (`agents.x-k8s.io`: `sandboxes`;
//! `extensions.agents.x-k8s.io`: `sandboxtemplates`, `sandboxclaims`,
//! `sandboxwarmpools`; status a subresource of all but templates), with
//! `networking.k8s.io/v1` `networkpolicies`, and a fake of the project's
//! controllers runs in every fake cluster (it does nothing without those
//! objects). What it models, as the real controllers do it:
//!
//! - **Sandbox** → a PVC `<claimTemplate.metadata.name>-<sandbox>` per
//!   `spec.volumeClaimTemplates[i]` (the template's labels and annotations
//!   plus `agents.x-k8s.io/sandbox-name-hash`, owned by the Sandbox, made
//!   once, kept while suspended); while `spec.operatingMode` is not
//!   `Suspended`, a Pod named as the Sandbox: labels = the template's
//!   labels except `agents.x-k8s.io/*` ones, plus
//!   `agents.x-k8s.io/sandbox-name-hash` = FNV-1a hash of the Sandbox's
//!   name, plus `agents.x-k8s.io/warm-pool-sandbox` (while a pool owns it)
//!   and `agents.x-k8s.io/sandbox-template-ref-hash` (while a pool or claim
//!   owns it); the template's annotations plus
//!   `agents.x-k8s.io/propagated-labels`/`-annotations`; spec = the
//!   template's with a `persistentVolumeClaim` volume per claim template
//!   (named as it); a controller ownerReference to the Sandbox. The Sandbox
//!   gets `agents.x-k8s.io/pod-name`. Later changes of the template's
//!   metadata (a claim's adoption) are carried to the running Pod's labels.
//! - Suspending deletes the Pod (a plain, graceful delete) and clears
//!   `pod-name`; PVCs stay; `Running` again makes a new Pod on them.
//! - Sandbox status: `conditions` (metav1.Condition: type, status, reason,
//!   message, lastTransitionTime, observedGeneration): `Ready` True
//!   `DependenciesReady` when the Pod runs, is Ready and has IPs, else False
//!   `DependenciesNotReady` / `SandboxSuspended` / `PodSucceeded` /
//!   `PodFailed` / `ReconcilerError`; `Suspended` False `NotSuspended`, False
//!   `PodTerminating`, True `PodTerminated`; `PodScheduled` (while a Pod
//!   exists), `Finished` (once it ended); `podIPs`, `nodeName`, `selector`.
//! - **SandboxTemplate** → label `agents.x-k8s.io/sandbox-template-ref-hash`
//!   on itself and, unless `networkPolicyManagement: Unmanaged`, a
//!   NetworkPolicy `<template>-network-policy` owned by it: podSelector
//!   `{sandbox-template-ref-hash: hash(template)}`, policyTypes Ingress and
//!   Egress, the template's `networkPolicy.ingress`/`egress`, or without
//!   `networkPolicy` the real default (ingress only from the sandbox
//!   router; egress to 0.0.0.0/0 and ::/0 except private, link-local and
//!   ULA ranges). **Stored, never enforced**: the fake has no network.
//! - **SandboxWarmPool** keeps `spec.replicas` (default 1) Sandboxes it
//!   controls (generateName `<pool>-`, labels `warm-pool-sandbox` =
//!   hash(pool), `sandbox-template-ref-hash`, `launch-type: warm`,
//!   `sandbox-template-hash`, `sandbox-pod-template-hash`, `created-by:
//!   controller`; annotation `agents.x-k8s.io/sandbox-template-ref`), the
//!   template's podTemplate and volumeClaimTemplates copied with the
//!   secure defaults (`automountServiceAccountToken: false`; under the
//!   default NetworkPolicy `dnsPolicy: None` with 8.8.8.8 and 1.1.1.1).
//!   Excess goes unready-first, newest-first. Status `replicas`,
//!   `readyReplicas`, `selector`, `observedGeneration`. Without its
//!   template it makes nothing until the template exists.
//! - **SandboxClaim** adopts an unclaimed pool member with pod IPs (a
//!   Ready one first): annotates itself `agents.x-k8s.io/sandbox-name`,
//!   and the Sandbox loses the warm-pool and template-hash labels, gains
//!   `agents.x-k8s.io/claim-uid` (on it and its podTemplate labels) and
//!   `launch-type: warm`, and gets the claim as its only (controller)
//!   owner; the pool replaces it. A claim younger than 2 s waits for
//!   members without IPs; otherwise (or with `spec.env` or
//!   `spec.volumeClaimTemplates`) it makes a cold Sandbox named as the
//!   claim (`launch-type: cold`), env injected per the template's
//!   `envVarsInjectionPolicy` (default Disallowed: rejected). Status:
//!   `sandbox.name`, `sandbox.podIPs`, condition `Ready` = the Sandbox's
//!   (or False `SandboxNotReady`, `WarmPoolNotFound`, `TemplateNotFound`,
//!   `EnvVarsInjectionRejected`, `SandboxCreatePending`).
//! - Deletion: the garbage collector, simplified: any Sandbox, Pod, PVC or
//!   NetworkPolicy whose controller ownerReference names a missing
//!   agent-sandbox object is deleted (background propagation: a Pod
//!   gracefully, a PVC once unused). So deleting a claim deletes its
//!   Sandbox, then its Pod and PVCs; deleting a pool its unclaimed members.
//!
//! Not modelled: `lifecycle` (`shutdownTime`, `shutdownPolicy`,
//! `ttlSecondsAfterFinished`: nothing expires), `spec.service` (no
//! Service, no `serviceFQDN`), `additionalPodMetadata`, the pool's
//! `updateStrategy` (stale members are never replaced), its readiness
//! grace (unready members are never replaced), refill rate limits and
//! batch sizes, adoption of orphaned Sandboxes, Pods or PVCs, foreground
//! deletion, the controllers' events and metrics, and the exact template
//! hashes (the fake hashes the same content, not Go's JSON of it). Sandbox
//! objects have no finalizers in the fake (nor, at the version read, in
//! the real project): a deleted Sandbox goes at once; its Pod follows.
//!
//! # What kube does, as the fake found it
//!
//! - Exec: kube offers `v5.channel.k8s.io, v4.channel.k8s.io`; on v5 it
//!   signals stdin's end with the frame `[255, 0]` when the stdin writer is
//!   *shut down* (`AsyncWriteExt::shutdown`), not when it is dropped; on v4
//!   it can only close the whole WebSocket, losing the output still to come.
//!   It stops reading at the first status frame (channel 3), so the server
//!   sends stdout and stderr to their end first.
//! - A watch resumed from a compacted version is a 200 response whose one
//!   event is `ERROR` with a 410 Status; kube's `watcher` yields it as an
//!   `Err` item (the stream goes on) and re-lists. A watch that simply ends
//!   is resumed from the last version seen (bookmarks move it).
//!
//! # Extending: custom resources and controllers
//!
//! A custom resource is one `ResourceType::new(group, version, plural,
//! kind, namespaced)` line in [`store::registry`]. A controller (as the
//! agent-sandbox fake in `agent_sandbox.rs`) follows the kubelet's
//! pattern: a task started in [`FakeCluster::start`] that wakes on
//! `Store::subscribe`, re-reads the state it reconciles (level-triggered,
//! so it writes only what differs, or it wakes itself forever) and stops on
//! the shutdown signal.

mod agent_sandbox;
mod error;
mod exec;
mod kubelet;
mod objects;
mod process;
mod routes;
mod selector;
mod status;
pub mod store;
mod watch;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::sync::watch as signal;

pub use error::ApiError;

use kubelet::Kubelet;
use store::Store;

/// What the fake cluster knows of its world.
#[derive(Debug, Clone)]
pub struct FakeOptions {
    /// The namespace of the kubeconfig and of [`FakeCluster::client`].
    pub namespace: String,
    /// image name -> the entrypoint the "image" has (e.g. "standby-sandbox:test" -> ["/usr/local/bin/standby"])
    pub images: HashMap<String, Vec<String>>,
    /// container path -> host path, for executables (e.g. "/usr/local/bin/standby" -> the real standby binary)
    pub binaries: HashMap<String, PathBuf>,
    /// how many past resource versions a watch may resume from before it gets 410 (default 1000)
    pub history: usize,
}

impl Default for FakeOptions {
    fn default() -> Self {
        Self { namespace: "standby".into(), images: HashMap::new(), binaries: HashMap::new(), history: 1000 }
    }
}

/// One API request the fake served, named as RBAC names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Call {
    /// get list watch create update patch delete deletecollection
    pub verb: String,
    /// "" for core
    pub group: String,
    /// "pods", "pods/exec", "persistentvolumeclaims", ...
    pub resource: String,
    pub namespace: Option<String>,
}

/// What the routes, the kubelet and the handle share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub store: Arc<Store>,
    pub options: FakeOptions,
    pub calls: Mutex<Vec<Call>>,
    pub kubelet: Arc<Kubelet>,
    pub shutdown: signal::Receiver<bool>,
    /// The fake's own temp dir: PVC directories, emptyDirs, pod logs.
    pub root: PathBuf,
}

/// A running fake cluster. Dropping it stops the server and every loop of
/// it, and kills (and reaps) every process of every pod.
#[derive(Debug)]
pub struct FakeCluster {
    shared: Arc<Shared>,
    url: String,
    stop: signal::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl FakeCluster {
    /// Serves on a fresh port of 127.0.0.1 and starts the kubelet.
    pub async fn start(options: FakeOptions) -> FakeCluster {
        let dir = tempfile::Builder::new().prefix("kube-fake").tempdir().expect("a temp dir for the fake cluster");
        let root = dir.path().to_path_buf();
        let (stop, shutdown) = signal::channel(false);
        let store = Arc::new(Store::new(options.history));
        let kubelet = Arc::new(Kubelet::new(store.clone(), options.clone(), root.clone(), shutdown.clone()));
        let shared = Arc::new(Shared {
            store,
            options,
            calls: Mutex::new(Vec::new()),
            kubelet: kubelet.clone(),
            shutdown: shutdown.clone(),
            root,
        });
        kubelet.spawn();
        agent_sandbox::spawn(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0");
        let url = format!("http://{}", listener.local_addr().expect("a bound address"));
        let router = routes::router(shared.clone());
        let mut server_shutdown = shutdown;
        let server = tokio::spawn(async move {
            let stopped = async move {
                let _ = server_shutdown.wait_for(|stop| *stop).await;
            };
            let _ = axum::serve(listener, router).with_graceful_shutdown(stopped).await;
        });
        FakeCluster { shared, url, stop, server, _dir: dir }
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// Writes a kubeconfig whose current context is this server, in
    /// [`FakeOptions::namespace`], without credentials.
    pub fn write_kubeconfig(&self, path: &Path) {
        let ns = &self.shared.options.namespace;
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {ns}\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            url = self.url
        );
        std::fs::write(path, text).expect("write the kubeconfig");
    }

    /// A client of this server in [`FakeOptions::namespace`].
    pub async fn client(&self) -> kube::Client {
        let mut config = kube::Config::new(self.url.parse().expect("the server's URL is a URI"));
        config.default_namespace = self.shared.options.namespace.clone();
        kube::Client::try_from(config).expect("a client of the fake cluster")
    }

    /// Every API request served, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.shared.calls.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The host directory backing PVC `claim` (in the options' namespace).
    pub fn pvc_dir(&self, claim: &str) -> PathBuf {
        objects::pvc_dir(&self.shared.root, &self.shared.options.namespace, claim)
    }

    /// The kubelet's eviction of `pod`: its processes killed, its status
    /// phase Failed with reason "Evicted", then the object deleted.
    pub async fn evict(&self, pod: &str) {
        self.shared.kubelet.evict(&self.shared.options.namespace, pod).await;
    }

    /// The node lost: every pod's processes SIGKILLed, its Ready condition
    /// False with reason "NodeLost" and phase Unknown; the objects are
    /// deleted a second later.
    pub async fn lose_node(&self) {
        self.shared.kubelet.lose_node().await;
    }

    /// Compacts the history to now and ends every open watch: each client
    /// re-watches from a version now too old and gets 410 Gone.
    pub async fn expire_watches(&self) {
        self.shared.store.compact_now();
    }

    /// The host pid of the pod's PID 1 while its container runs.
    pub fn pod_processes(&self, pod: &str) -> Option<u32> {
        self.shared.kubelet.pid1(&self.shared.options.namespace, pod)
    }
}

impl Drop for FakeCluster {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.shared.kubelet.kill_all_now();
        self.server.abort();
    }
}

/// Resolves once the fake is shutting down (its handle dropped); every loop
/// of the fake selects on it.
pub(crate) async fn stopped(shutdown: &mut signal::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}
