//! What the provider knows of its Pods and claims: one watch per kind
//! (`kube::runtime::watcher`, which lists, watches from the list's
//! version, and lists again when the API server answers 410 Gone), each
//! mirrored in a reflector's store: Pods, and the workspace claims
//! (plain Pods) or agent-sandbox's SandboxClaims (agent-sandbox mode). Every question the provider asks of a
//! sandbox's state is answered from these stores, never by a GET per Pod,
//! and every change wakes whoever waits for one ([`Cache::changed`]): a
//! Pod running, a Pod gone, an agent's Pod lost under it.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

/// The mirrored Pods and claims of this control plane's instance.
#[derive(Debug, Clone)]
pub(super) struct Cache {
    pods: Store<Pod>,
    /// Plain Pods: the workspace claims.
    claims: Option<Store<PersistentVolumeClaim>>,
    /// Agent-sandbox mode: the SandboxClaims, and their resource (the key
    /// of a dynamic object in its store).
    sandbox_claims: Option<(Store<DynamicObject>, ApiResource)>,
    namespace: String,
    changes: watch::Receiver<u64>,
}

/// How a sandbox's Pod stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PodState {
    /// No Pod.
    Absent,
    /// Made, not running yet (scheduling, pulling, starting).
    Pending,
    /// Its container runs and the Pod is not being deleted.
    Running,
    /// Being deleted: its kubelet stops its processes (the exec of an
    /// agent in it ends with them).
    Deleting,
    /// Ended (its PID 1 exited, evicted) or its node lost: it will not
    /// serve again, and an exec in it may never end by itself. The reason,
    /// for the log.
    Ended(String),
}

impl Cache {
    /// Starts the two watches; they end when `stop` is dropped or set.
    /// Starts the watches: Pods, and the workspace claims, or the
    /// SandboxClaims of `sandbox_claims` when given; they end when `stop`
    /// is dropped or set.
    pub(super) fn start(
        client: &kube::Client,
        namespace: &str,
        selector: &str,
        sandbox_claims: Option<&ApiResource>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        let (tx, changes) = watch::channel(0_u64);
        let tx = Arc::new(tx);
        let api = Api::namespaced(client.clone(), namespace);
        let pods = mirror::<Pod>(api, (), selector, Arc::clone(&tx), stop.clone());
        let (claims, sandbox_claims) = match sandbox_claims {
            Some(resource) => {
                let api = Api::namespaced_with(client.clone(), namespace, resource);
                let store = mirror::<DynamicObject>(api, resource.clone(), selector, tx, stop);
                (None, Some((store, resource.clone())))
            }
            None => (Some(mirror(Api::namespaced(client.clone(), namespace), (), selector, tx, stop)), None),
        };
        Self { pods, claims, sandbox_claims, namespace: namespace.to_owned(), changes }
    }

    /// Waits until every watch has listed once.
    pub(super) async fn ready(&self) -> bool {
        let claims = match &self.claims {
            Some(claims) => claims.wait_until_ready().await.is_ok(),
            None => true,
        };
        let sandbox_claims = match &self.sandbox_claims {
            Some((claims, _)) => claims.wait_until_ready().await.is_ok(),
            None => true,
        };
        self.pods.wait_until_ready().await.is_ok() && claims && sandbox_claims
    }

    pub(super) fn pod(&self, name: &str) -> Option<Arc<Pod>> {
        self.pods.get(&ObjectRef::new(name).within(&self.namespace))
    }

    pub(super) fn claim(&self, name: &str) -> Option<Arc<PersistentVolumeClaim>> {
        self.claims.as_ref()?.get(&ObjectRef::new(name).within(&self.namespace))
    }

    pub(super) fn sandbox_claim(&self, name: &str) -> Option<Arc<DynamicObject>> {
        let (claims, resource) = self.sandbox_claims.as_ref()?;
        claims.get(&ObjectRef::new_with(name, resource.clone()).within(&self.namespace))
    }

    pub(super) fn sandbox_claims(&self) -> Vec<Arc<DynamicObject>> {
        self.sandbox_claims.as_ref().map(|(claims, _)| claims.state()).unwrap_or_default()
    }

    pub(super) fn pods(&self) -> Vec<Arc<Pod>> {
        self.pods.state()
    }

    pub(super) fn claims(&self) -> Vec<Arc<PersistentVolumeClaim>> {
        self.claims.as_ref().map(Store::state).unwrap_or_default()
    }

    /// How the Pod `name` stands, as last heard.
    pub(super) fn pod_state(&self, name: &str) -> PodState {
        self.pod(name).map_or(PodState::Absent, |pod| pod_state(&pod))
    }

    /// A receiver that changes with every event of either watch.
    pub(super) fn changed(&self) -> watch::Receiver<u64> {
        self.changes.clone()
    }

    /// Waits up to `timeout` until `done` holds of the stores; whether it
    /// did. Woken by the watches, not by polling the API server.
    pub(super) async fn wait_until(&self, timeout: Duration, mut done: impl FnMut(&Self) -> bool) -> bool {
        let mut changes = self.changed();
        let waited = tokio::time::timeout(timeout, async {
            loop {
                changes.borrow_and_update();
                if done(self) {
                    return true;
                }
                if changes.changed().await.is_err() {
                    return done(self);
                }
            }
        });
        waited.await.unwrap_or(false)
    }
}

/// How a Pod stands, from its object.
pub(super) fn pod_state(pod: &Pod) -> PodState {
    if pod.metadata.deletion_timestamp.is_some() {
        return PodState::Deleting;
    }
    let Some(status) = &pod.status else { return PodState::Pending };
    match status.phase.as_deref() {
        Some("Succeeded" | "Failed") => {
            let reason = status.reason.clone().or_else(|| status.message.clone());
            return PodState::Ended(format!(
                "{}{}",
                status.phase.as_deref().unwrap_or_default(),
                reason.map(|reason| format!(": {reason}")).unwrap_or_default()
            ));
        }
        Some("Unknown") => return PodState::Ended("its node is lost".into()),
        _ => {}
    }
    let not_ready = status.conditions.iter().flatten().find(|condition| {
        condition.type_ == "Ready" && condition.status == "False" && condition.reason.as_deref() == Some("NodeLost")
    });
    if not_ready.is_some() {
        return PodState::Ended("its node is lost".into());
    }
    let running = status
        .container_statuses
        .iter()
        .flatten()
        .any(|container| container.state.as_ref().is_some_and(|state| state.running.is_some()));
    if status.phase.as_deref() == Some("Running") && running { PodState::Running } else { PodState::Pending }
}

/// Why a Pod that is not running will not run: the first container's
/// waiting reason (an image that cannot be pulled), or the scheduler's.
pub(super) fn pending_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let waiting = status.container_statuses.iter().flatten().find_map(|container| {
        let waiting = container.state.as_ref()?.waiting.as_ref()?;
        Some(format!(
            "{}{}",
            waiting.reason.clone()?,
            waiting.message.as_deref().map(|m| format!(": {m}")).unwrap_or_default()
        ))
    });
    waiting.or_else(|| {
        status.conditions.iter().flatten().find_map(|condition| {
            (condition.status == "False" && condition.type_ == "PodScheduled")
                .then(|| condition.message.clone().or_else(|| condition.reason.clone()))
                .flatten()
        })
    })
}

/// One kind's watch, mirrored into a store, bumping `changes` on every event.
fn mirror<K>(
    api: Api<K>,
    dyntype: K::DynamicType,
    selector: &str,
    changes: Arc<watch::Sender<u64>>,
    mut stop: watch::Receiver<bool>,
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let kind = K::kind(&dyntype).into_owned();
    let writer = reflector::store::Writer::new(dyntype);
    let reader = writer.as_reader();
    let config = watcher::Config::default().labels(selector);
    let stream = watcher(api, config).default_backoff().reflect(writer);
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                _ = stop.wait_for(|stopped| *stopped) => return,
                event = stream.next() => match event {
                    Some(Ok(_)) => changes.send_modify(|n| *n = n.wrapping_add(1)),
                    Some(Err(error)) => tracing::warn!(%error, kind, "a watch of the sandboxes failed; it starts again"),
                    None => return,
                },
            }
        }
    });
    reader
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(yaml: &str) -> Pod {
        serde_saphyr::from_str(yaml).expect("a pod")
    }

    #[test]
    fn a_pod_stands_by_its_phase_its_deletion_and_its_node() {
        let running = "metadata: {name: p}\nstatus:\n  phase: Running\n  containerStatuses: [{name: c, image: i, imageID: '', ready: true, restartCount: 0, state: {running: {}}}]\n";
        assert_eq!(pod_state(&pod(running)), PodState::Running);
        assert_eq!(pod_state(&pod("metadata: {name: p}\nstatus: {phase: Pending}\n")), PodState::Pending);
        let deleting = "metadata: {name: p, deletionTimestamp: '2026-12-03T12:00:00Z'}\nstatus: {phase: Running}\n";
        assert_eq!(pod_state(&pod(deleting)), PodState::Deleting);
        let evicted = "metadata: {name: p}\nstatus: {phase: Failed, reason: Evicted}\n";
        assert_eq!(pod_state(&pod(evicted)), PodState::Ended("Failed: Evicted".into()));
        let lost = "metadata: {name: p}\nstatus:\n  phase: Running\n  conditions: [{type: Ready, status: 'False', reason: NodeLost}]\n";
        assert_eq!(pod_state(&pod(lost)), PodState::Ended("its node is lost".into()));
        assert_eq!(
            pod_state(&pod("metadata: {name: p}\nstatus: {phase: Unknown}\n")),
            PodState::Ended("its node is lost".into())
        );
    }

    #[test]
    fn a_pod_that_cannot_start_says_why() {
        let pull = "metadata: {name: p}\nstatus:\n  phase: Pending\n  containerStatuses: [{name: c, image: i, imageID: '', ready: false, restartCount: 0, state: {waiting: {reason: ErrImagePull, message: not found}}}]\n";
        assert_eq!(pending_reason(&pod(pull)).as_deref(), Some("ErrImagePull: not found"));
        let unscheduled = "metadata: {name: p}\nstatus:\n  phase: Pending\n  conditions: [{type: PodScheduled, status: 'False', reason: Unschedulable, message: 0/3 nodes are available}]\n";
        assert_eq!(pending_reason(&pod(unscheduled)).as_deref(), Some("0/3 nodes are available"));
    }
}
