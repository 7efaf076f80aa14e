//! The fake kubelet of the one node `fake-node`: level-triggered on every
//! store write, it schedules new pods, checks their PVCs, starts each pod's
//! one container (a supervisor task per pod owns the process), reports its
//! status, honours graceful deletion (SIGTERM to PID 1, SIGKILL after the
//! grace, then the object removed), and kills what runs for a pod that is
//! gone. It also finalises PVCs held by PVC protection.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot, watch};

use super::FakeOptions;
use super::objects::finalize_claims;
use super::process::{self, Plan, PlanError};
use super::status;
use super::store::{ObjKey, Part, ResourceType, Store};

mod supervisor;

/// (namespace, name)
type PodName = (String, String);

/// What the kubelet tells a pod's supervisor.
#[derive(Debug)]
enum Control {
    /// Graceful stop: SIGTERM to PID 1, SIGKILL after `grace` seconds.
    Terminate { grace: u64 },
    /// SIGKILL now; the caller writes the status (eviction, lost node, a
    /// force-deleted pod); `ack` once the processes are reaped.
    Kill { ack: Option<oneshot::Sender<()>> },
}

/// A pod whose container the kubelet started.
#[derive(Debug)]
struct Runtime {
    uid: String,
    plan: Arc<Plan>,
    /// The host pid of `unshare` (leader of the container's process group).
    unshare: Option<u32>,
    /// The host pid of the container's PID 1.
    pid1: Option<u32>,
    control: mpsc::UnboundedSender<Control>,
    terminating: bool,
}

#[derive(Debug)]
pub struct Kubelet {
    store: Arc<Store>,
    options: FakeOptions,
    root: PathBuf,
    shutdown: watch::Receiver<bool>,
    runtimes: Mutex<HashMap<PodName, Runtime>>,
    /// Pods (by uid) the kubelet has started or given up on: never again.
    started: Mutex<HashSet<String>>,
    logs: Mutex<HashMap<PodName, PathBuf>>,
    /// Host pids of running execs (`nsenter`), killed and reaped on drop.
    execs: Mutex<HashSet<u32>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

impl Kubelet {
    pub fn new(store: Arc<Store>, options: FakeOptions, root: PathBuf, shutdown: watch::Receiver<bool>) -> Self {
        Self {
            store,
            options,
            root,
            shutdown,
            runtimes: Mutex::new(HashMap::new()),
            started: Mutex::new(HashSet::new()),
            logs: Mutex::new(HashMap::new()),
            execs: Mutex::new(HashSet::new()),
        }
    }

    fn pods(&self) -> Arc<ResourceType> {
        self.store.resource("", "v1", "pods").expect("pods are registered")
    }

    fn key(&self, namespace: &str, name: &str) -> ObjKey {
        ObjKey { rt: self.pods(), namespace: namespace.into(), name: name.into() }
    }

    /// Starts the kubelet's loop: a sync after every store write, until
    /// the fake shuts down.
    pub fn spawn(self: &Arc<Self>) {
        let kubelet = self.clone();
        let mut changed = self.store.subscribe();
        let mut shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            loop {
                kubelet.sync();
                tokio::select! {
                    r = changed.changed() => if r.is_err() { return },
                    () = super::stopped(&mut shutdown) => return,
                }
            }
        });
    }

    /// Writes a pod's status (and `nodeName` when scheduled) if it says
    /// something new and the pod is still the one `uid` names.
    fn set_status(&self, key: &ObjKey, uid: &str, new: Value, node: bool) {
        let _ = self.store.modify(key, Part::Internal, |pod| {
            if str_at(pod, "/metadata/uid") != uid {
                return Ok(());
            }
            if node {
                pod["spec"]["nodeName"] = json!(status::NODE);
            }
            if !status::same(pod.get("status"), &new) {
                pod["status"] = new;
            }
            Ok(())
        });
    }

    fn claim_bound(&self, namespace: &str, claim: &str) -> bool {
        let Some(pvcs) = self.store.resource("", "v1", "persistentvolumeclaims") else { return false };
        let key = ObjKey { rt: pvcs, namespace: namespace.into(), name: claim.into() };
        self.store.get(&key).is_some_and(|pvc| {
            str_at(&pvc, "/status/phase") == "Bound" && pvc.pointer("/metadata/deletionTimestamp").is_none()
        })
    }

    fn sync(self: &Arc<Self>) {
        if *self.shutdown.borrow() {
            return;
        }
        let (pods, _) = self.store.list(&self.pods(), None);
        let mut present = HashSet::new();
        for pod in pods {
            let (ns, name, uid) =
                (str_at(&pod, "/metadata/namespace"), str_at(&pod, "/metadata/name"), str_at(&pod, "/metadata/uid"));
            present.insert((ns.to_owned(), name.to_owned(), uid.to_owned()));
            let key = self.key(ns, name);
            if pod.pointer("/metadata/deletionTimestamp").is_some() {
                let grace = pod.pointer("/metadata/deletionGracePeriodSeconds").and_then(Value::as_u64).unwrap_or(30);
                let mut runtimes = lock(&self.runtimes);
                match runtimes.get_mut(&(ns.to_owned(), name.to_owned())) {
                    Some(rt) if rt.uid == uid => {
                        if !rt.terminating {
                            rt.terminating = true;
                            let _ = rt.control.send(Control::Terminate { grace });
                        }
                    }
                    _ => {
                        drop(runtimes);
                        lock(&self.started).insert(uid.to_owned());
                        self.store.remove_if_uid(&key, uid);
                    }
                }
                continue;
            }
            if lock(&self.started).contains(uid)
                || matches!(str_at(&pod, "/status/phase"), "Succeeded" | "Failed" | "Unknown")
            {
                continue;
            }
            self.start(&pod, key, uid);
        }
        let mut live_uids: HashSet<String> = present.iter().map(|(_, _, uid)| uid.clone()).collect();
        for ((ns, name), rt) in lock(&self.runtimes).iter() {
            if !present.contains(&(ns.clone(), name.clone(), rt.uid.clone())) {
                let _ = rt.control.send(Control::Kill { ack: None });
            }
            live_uids.insert(rt.uid.clone());
        }
        // An emptyDir lives as long as its pod.
        for entry in std::fs::read_dir(self.root.join("emptydirs")).into_iter().flatten().flatten() {
            if entry.file_name().to_str().is_some_and(|uid| !live_uids.contains(uid)) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        finalize_claims(&self.store, &self.root);
    }

    /// Schedules a new pod and starts its container, or says why not.
    fn start(self: &Arc<Self>, pod: &Value, key: ObjKey, uid: &str) {
        let ns = key.namespace.clone();
        let container = pod.pointer("/spec/containers/0").cloned().unwrap_or_default();
        let (cname, image) = (str_at(&container, "/name").to_owned(), str_at(&container, "/image").to_owned());
        let plan = process::plan(pod, &self.options, &self.root, &|claim| self.claim_bound(&ns, claim));
        match plan {
            Err(PlanError::Unschedulable(message)) => {
                self.set_status(&key, uid, status::unschedulable(&message), false)
            }
            Err(PlanError::Waiting { reason, message }) => {
                self.set_status(&key, uid, status::waiting(&cname, &image, reason, Some(&message)), true);
            }
            Err(PlanError::Failed(message)) => {
                lock(&self.started).insert(uid.to_owned());
                self.set_status(&key, uid, status::failed("UnexpectedAdmissionError", &message), true);
            }
            Ok(plan) => {
                lock(&self.started).insert(uid.to_owned());
                self.set_status(&key, uid, status::waiting(&cname, &image, "ContainerCreating", None), true);
                let plan = Arc::new(plan);
                let (control, rx) = mpsc::unbounded_channel();
                let runtime = Runtime {
                    uid: uid.to_owned(),
                    plan: plan.clone(),
                    unshare: None,
                    pid1: None,
                    control,
                    terminating: false,
                };
                // A Pod made again under the same name (agent-sandbox's
                // controller does) is another Pod: the old one's
                // processes die, as a kubelet keys its Pods by uid.
                let replaced = lock(&self.runtimes).insert((key.namespace.clone(), key.name.clone()), runtime);
                if let Some(old) = replaced {
                    let _ = old.control.send(Control::Kill { ack: None });
                }
                let kubelet = self.clone();
                let uid = uid.to_owned();
                tokio::spawn(async move { kubelet.supervise(key, uid, plan, rx).await });
            }
        }
    }

    fn log_path(&self, key: &ObjKey, uid: &str) -> PathBuf {
        let path = self.root.join("logs").join(format!("{}_{}_{uid}.log", key.namespace, key.name));
        lock(&self.logs).insert((key.namespace.clone(), key.name.clone()), path.clone());
        path
    }

    fn update_runtime(&self, key: &ObjKey, uid: &str, f: impl FnOnce(&mut Runtime)) {
        if let Some(rt) = lock(&self.runtimes).get_mut(&(key.namespace.clone(), key.name.clone()))
            && rt.uid == uid
        {
            f(rt);
        }
    }

    /// Kills a pod's processes and waits until they are reaped; the pod is
    /// never started again.
    async fn kill_and_wait(&self, key: &ObjKey, uid: &str) {
        lock(&self.started).insert(uid.to_owned());
        let (ack, done) = oneshot::channel();
        let sent = match lock(&self.runtimes).get(&(key.namespace.clone(), key.name.clone())) {
            Some(rt) if rt.uid == uid => rt.control.send(Control::Kill { ack: Some(ack) }).is_ok(),
            _ => false,
        };
        if sent {
            let _ = done.await;
        }
    }

    pub async fn evict(&self, namespace: &str, name: &str) {
        let key = self.key(namespace, name);
        let Some(pod) = self.store.get(&key) else { return };
        let uid = str_at(&pod, "/metadata/uid").to_owned();
        self.kill_and_wait(&key, &uid).await;
        let _ = self.store.modify(&key, Part::Internal, |pod| {
            if str_at(pod, "/metadata/uid") == uid {
                pod["status"] = status::evicted(pod.get("status").unwrap_or(&Value::Null));
            }
            Ok(())
        });
        self.store.remove_if_uid(&key, &uid);
        finalize_claims(&self.store, &self.root);
    }

    pub async fn lose_node(self: &Arc<Self>) {
        let (pods, _) = self.store.list(&self.pods(), None);
        let mut lost = Vec::new();
        for pod in pods {
            let key = self.key(str_at(&pod, "/metadata/namespace"), str_at(&pod, "/metadata/name"));
            let uid = str_at(&pod, "/metadata/uid").to_owned();
            self.kill_and_wait(&key, &uid).await;
            let _ = self.store.modify(&key, Part::Internal, |pod| {
                if str_at(pod, "/metadata/uid") == uid {
                    pod["status"] = status::node_lost(pod.get("status").unwrap_or(&Value::Null));
                }
                Ok(())
            });
            lost.push((key, uid));
        }
        let kubelet = self.clone();
        let mut shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {
                    for (key, uid) in lost {
                        kubelet.store.remove_if_uid(&key, &uid);
                    }
                    finalize_claims(&kubelet.store, &kubelet.root);
                }
                () = super::stopped(&mut shutdown) => {}
            }
        });
    }

    pub fn pid1(&self, namespace: &str, name: &str) -> Option<u32> {
        lock(&self.runtimes).get(&(namespace.to_owned(), name.to_owned())).and_then(|rt| rt.pid1)
    }

    /// What an exec into the pod needs: its container's plan and PID 1.
    pub fn exec_target(&self, namespace: &str, name: &str, uid: &str) -> Option<(Arc<Plan>, u32)> {
        let runtimes = lock(&self.runtimes);
        let rt = runtimes.get(&(namespace.to_owned(), name.to_owned())).filter(|rt| rt.uid == uid)?;
        Some((rt.plan.clone(), rt.pid1?))
    }

    pub fn exec_started(&self, pid: u32) {
        lock(&self.execs).insert(pid);
    }

    pub fn exec_ended(&self, pid: u32) {
        lock(&self.execs).remove(&pid);
    }

    /// The pod's log (its container's stdout and stderr), or "".
    pub fn log(&self, namespace: &str, name: &str) -> String {
        let path = lock(&self.logs).get(&(namespace.to_owned(), name.to_owned())).cloned();
        path.and_then(|p| std::fs::read(p).ok()).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
    }

    /// The fake's drop: SIGKILL every pod's PID 1 (which takes its whole PID
    /// namespace down) and process group, and every exec, then reap them.
    pub fn kill_all_now(&self) {
        let (mut groups, mut pids1) = (Vec::new(), Vec::new());
        for rt in lock(&self.runtimes).values() {
            // PID 1 first, alone: `unshare` then reaps it and exits, so no
            // dying PID 1 is orphaned. A pod without a known PID 1 has its
            // whole group killed.
            match rt.pid1 {
                Some(pid) => {
                    process::signal(pid, Signal::SIGKILL);
                    pids1.push(pid);
                }
                None => rt.unshare.into_iter().for_each(|g| process::signal_group(g, Signal::SIGKILL)),
            }
            groups.extend(rt.unshare);
        }
        for pid in lock(&self.execs).iter() {
            process::signal_group(*pid, Signal::SIGKILL);
            groups.push(*pid);
        }
        for pid in pids1 {
            process::wait_gone_now(pid, Duration::from_secs(2));
        }
        for pgid in groups {
            // Anything left in the group (nothing, normally), then reap its
            // leader: our child.
            process::signal_group(pgid, Signal::SIGKILL);
            process::reap(pgid, Duration::from_secs(2));
        }
    }
}
