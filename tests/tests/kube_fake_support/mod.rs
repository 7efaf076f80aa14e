//! Helpers of the fake cluster's tests: the cluster with the host's `sh`,
//! `cat` and `sleep`, object builders, and waits with a deadline.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod};
use kube::api::Api;
use kube::runtime::wait::{Condition, await_condition, conditions};
use serde_json::json;
use standby_e2e::kube_fake::{FakeCluster, FakeOptions};

pub const IMAGE: &str = "busybox:test";
pub const WAIT: Duration = Duration::from_secs(20);

/// `sh`, `cat` and `sleep` of the host, under /bin and /usr/bin.
pub fn options() -> FakeOptions {
    let mut binaries = HashMap::new();
    for tool in ["sh", "cat", "sleep"] {
        let host = ["/bin", "/usr/bin"]
            .iter()
            .map(|dir| PathBuf::from(dir).join(tool))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("{tool} on the host"));
        binaries.insert(format!("/bin/{tool}"), host.clone());
        binaries.insert(format!("/usr/bin/{tool}"), host);
    }
    let images = HashMap::from([(IMAGE.to_owned(), vec!["/bin/sh".to_owned()])]);
    FakeOptions { binaries, images, ..FakeOptions::default() }
}

pub async fn cluster() -> (FakeCluster, kube::Client) {
    let cluster = FakeCluster::start(options()).await;
    let client = cluster.client().await;
    (cluster, client)
}

pub fn config_map(name: &str, labels: &[(&str, &str)]) -> ConfigMap {
    let labels: BTreeMap<String, String> = labels.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
    serde_json::from_value(json!({
        "metadata": { "name": name, "labels": labels },
        "data": { "k": "v" },
    }))
    .expect("a config map")
}

/// A pod running `sh -c script`, FOO=bar in its env; `pvc` mounted at /data
/// (DIR=/data) if given.
pub fn pod(name: &str, script: &str, pvc: Option<&str>) -> Pod {
    let mut spec = json!({
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "enableServiceLinks": false,
        "containers": [{
            "name": "main",
            "image": IMAGE,
            "command": ["/bin/sh", "-c", script],
            "env": [{ "name": "FOO", "value": "bar" }, { "name": "DIR", "value": "/data" }],
        }],
    });
    if let Some(claim) = pvc {
        spec["volumes"] = json!([{ "name": "data", "persistentVolumeClaim": { "claimName": claim } }]);
        spec["containers"][0]["volumeMounts"] = json!([{ "name": "data", "mountPath": "/data" }]);
    }
    serde_json::from_value(json!({ "metadata": { "name": name, "labels": { "app": "t" } }, "spec": spec }))
        .expect("a pod")
}

pub fn claim(name: &str) -> PersistentVolumeClaim {
    serde_json::from_value(json!({
        "metadata": { "name": name },
        "spec": { "accessModes": ["ReadWriteOnce"], "resources": { "requests": { "storage": "1Gi" } } },
    }))
    .expect("a claim")
}

pub async fn in_time<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f).await.unwrap_or_else(|_| panic!("{what}: not within {WAIT:?}"))
}

/// Polls `check` until it holds (for what no event announces: processes,
/// files), failing after [`WAIT`].
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    in_time(what, async {
        while !check() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// Waits (on a watch of the pod, as the provider would) for `cond`.
pub async fn until(pods: &Api<Pod>, name: &str, what: &str, cond: impl Condition<Pod>) -> Option<Pod> {
    // Boxed: kube's watch future is large.
    in_time(what, Box::pin(await_condition(pods.clone(), name, cond))).await.expect("a watch of the pod")
}

pub async fn running(pods: &Api<Pod>, name: &str) -> Pod {
    until(pods, name, "the pod runs", conditions::is_pod_running()).await.expect("the pod exists")
}

pub async fn gone(pods: &Api<Pod>, name: &str, uid: &str) {
    until(pods, name, "the pod is gone", conditions::is_deleted(uid)).await;
}

pub async fn logs_contain(pods: &Api<Pod>, name: &str, text: &str) {
    in_time("the log", async {
        loop {
            let log = pods.logs(name, &Default::default()).await.expect("the pod's log");
            if log.contains(text) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

pub fn alive(pid: u32) -> bool {
    // A zombie is dead: what is left of it is the parent's to reap.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// Host pids of every process in the PID namespace of host pid `pid1`.
pub fn namespace_members(pid1: u32) -> Vec<u32> {
    let ns = std::fs::read_link(format!("/proc/{pid1}/ns/pid")).expect("the pod's PID namespace");
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/ns/pid")).is_ok_and(|l| l == ns))
        .collect()
}

pub fn api_code(err: kube::Error) -> (u16, String) {
    match err {
        kube::Error::Api(status) => (status.code, status.reason),
        other => panic!("not an API error: {other}"),
    }
}
