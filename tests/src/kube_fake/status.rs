//! The pod statuses the fake kubelet writes, shaped as a real kubelet's
//! (phase, conditions, one container status), and the comparison that keeps
//! a level-triggered kubelet from rewriting a status that did not change.

use serde_json::{Value, json};

use super::store::now;

pub const NODE: &str = "fake-node";
pub const POD_IP: &str = "127.0.0.1";

fn condition(kind: &str, ok: bool, reason: Option<&str>, message: Option<&str>) -> Value {
    let mut c = json!({
        "type": kind,
        "status": if ok { "True" } else { "False" },
        "lastProbeTime": null,
        "lastTransitionTime": now(),
    });
    if let Some(reason) = reason {
        c["reason"] = json!(reason);
    }
    if let Some(message) = message {
        c["message"] = json!(message);
    }
    c
}

/// Not scheduled: a PVC is missing or unbound.
pub fn unschedulable(message: &str) -> Value {
    json!({
        "phase": "Pending",
        "qosClass": "BestEffort",
        "conditions": [condition("PodScheduled", false, Some("Unschedulable"), Some(message))],
    })
}

fn container(name: &str, image: &str, ready: bool, state: &Value) -> Value {
    json!({
        "name": name,
        "image": image,
        "imageID": "",
        "ready": ready,
        "started": state.get("running").is_some(),
        "restartCount": 0,
        "state": state,
    })
}

/// The container's state after it exited with `code`.
fn terminated_state(code: i32, started_at: &str) -> Value {
    json!({ "terminated": {
        "exitCode": code,
        "reason": if code == 0 { "Completed" } else { "Error" },
        "startedAt": started_at,
        "finishedAt": now(),
    } })
}

/// Sets the restart count (and the last run's end) of the container status.
pub fn with_restarts(mut status: Value, restarts: u32, last: Option<&Value>) -> Value {
    if let Some(c) = status.pointer_mut("/containerStatuses/0") {
        c["restartCount"] = json!(restarts);
        if let Some(last) = last {
            c["lastState"] = last.clone();
        }
    }
    status
}

/// Exited, to be restarted after `backoff` (restartPolicy Always, or
/// OnFailure after a failure): the pod stays Running, not ready.
pub fn crash_loop(cname: &str, image: &str, code: i32, started_at: &str, backoff: u64) -> Value {
    let waiting = json!({ "waiting": {
        "reason": "CrashLoopBackOff",
        "message": format!("back-off {backoff}s restarting failed container={cname}"),
    } });
    let mut c = container(cname, image, false, &waiting);
    c["lastState"] = terminated_state(code, started_at);
    json!({
        "phase": "Running",
        "qosClass": "BestEffort",
        "hostIP": POD_IP,
        "podIP": POD_IP,
        "podIPs": [{ "ip": POD_IP }],
        "startTime": started_at,
        "conditions": [
            condition("PodScheduled", true, None, None),
            condition("Initialized", true, None, None),
            condition("ContainersReady", false, Some("ContainersNotReady"), None),
            condition("Ready", false, Some("ContainersNotReady"), None),
        ],
        "containerStatuses": [c],
    })
}

/// Scheduled, the container not running (yet, or it cannot start).
pub fn waiting(cname: &str, image: &str, reason: &str, message: Option<&str>) -> Value {
    let mut waiting = json!({ "reason": reason });
    if let Some(message) = message {
        waiting["message"] = json!(message);
    }
    json!({
        "phase": "Pending",
        "qosClass": "BestEffort",
        "hostIP": POD_IP,
        "startTime": now(),
        "conditions": [
            condition("PodScheduled", true, None, None),
            condition("Initialized", true, None, None),
            condition("ContainersReady", false, Some("ContainersNotReady"), None),
            condition("Ready", false, Some("ContainersNotReady"), None),
        ],
        "containerStatuses": [container(cname, image, false, &json!({ "waiting": waiting }))],
    })
}

/// Running and ready.
pub fn running(cname: &str, image: &str, started_at: &str) -> Value {
    json!({
        "phase": "Running",
        "qosClass": "BestEffort",
        "hostIP": POD_IP,
        "podIP": POD_IP,
        "podIPs": [{ "ip": POD_IP }],
        "startTime": started_at,
        "conditions": [
            condition("PodScheduled", true, None, None),
            condition("Initialized", true, None, None),
            condition("ContainersReady", true, None, None),
            condition("Ready", true, None, None),
        ],
        "containerStatuses": [container(cname, image, true, &json!({ "running": { "startedAt": started_at } }))],
    })
}

/// The container exited with `code`: Succeeded for 0, else Failed.
pub fn terminated(cname: &str, image: &str, started_at: &str, code: i32) -> Value {
    let (phase, pod_reason) = if code == 0 { ("Succeeded", "PodCompleted") } else { ("Failed", "PodFailed") };
    json!({
        "phase": phase,
        "qosClass": "BestEffort",
        "hostIP": POD_IP,
        "podIP": POD_IP,
        "podIPs": [{ "ip": POD_IP }],
        "startTime": started_at,
        "conditions": [
            condition("PodScheduled", true, None, None),
            condition("Initialized", true, None, None),
            condition("ContainersReady", false, Some(pod_reason), None),
            condition("Ready", false, Some(pod_reason), None),
        ],
        "containerStatuses": [container(cname, image, false, &terminated_state(code, started_at))],
    })
}

/// The pod failed without running (more than one container, no root, the
/// process would not start).
pub fn failed(reason: &str, message: &str) -> Value {
    json!({
        "phase": "Failed",
        "qosClass": "BestEffort",
        "reason": reason,
        "message": message,
        "conditions": [condition("Ready", false, Some("PodFailed"), None)],
    })
}

/// Evicted by the kubelet: the container killed.
pub fn evicted(previous: &Value) -> Value {
    let mut status = previous.clone();
    status["phase"] = json!("Failed");
    status["reason"] = json!("Evicted");
    status["message"] = json!("The node was low on resource: memory. ");
    set_not_ready(&mut status, "PodFailed", None);
    terminate_containers(&mut status, 137, "Error");
    status
}

/// The node lost: nobody knows what runs.
pub fn node_lost(previous: &Value) -> Value {
    let mut status = previous.clone();
    status["phase"] = json!("Unknown");
    status["reason"] = json!("NodeLost");
    status["message"] = json!(format!("Node {NODE} which was running pod is unresponsive"));
    set_not_ready(&mut status, "NodeLost", Some("Kubelet stopped posting node status."));
    if let Some(cs) = status.get_mut("containerStatuses").and_then(Value::as_array_mut) {
        for c in cs {
            c["ready"] = json!(false);
        }
    }
    status
}

fn set_not_ready(status: &mut Value, reason: &str, message: Option<&str>) {
    let mut conditions: Vec<Value> = status
        .get("conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|c| c["type"] != "Ready" && c["type"] != "ContainersReady")
        .collect();
    conditions.push(condition("ContainersReady", false, Some(reason), message));
    conditions.push(condition("Ready", false, Some(reason), message));
    status["conditions"] = json!(conditions);
}

fn terminate_containers(status: &mut Value, code: i32, reason: &str) {
    if let Some(cs) = status.get_mut("containerStatuses").and_then(Value::as_array_mut) {
        for c in cs {
            let started = c.pointer("/state/running/startedAt").cloned().unwrap_or(Value::Null);
            c["ready"] = json!(false);
            c["started"] = json!(false);
            c["state"] = json!({ "terminated": {
                "exitCode": code, "reason": reason, "startedAt": started, "finishedAt": now()
            } });
        }
    }
}

/// A status with its times blanked, to compare what a status says.
fn timeless(status: &Value) -> Value {
    match status {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| {
                    let v = if k.ends_with("Time") || k.ends_with("At") { Value::Null } else { timeless(v) };
                    (k.clone(), v)
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(timeless).collect()),
        other => other.clone(),
    }
}

/// Whether two statuses say the same, times aside.
pub fn same(a: Option<&Value>, b: &Value) -> bool {
    a.is_some_and(|a| timeless(a) == timeless(b))
}
