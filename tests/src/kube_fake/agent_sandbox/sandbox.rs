//! The Sandbox controller (agent-sandbox's `controllers/sandbox_controller.go`):
//! a Sandbox's PVCs from its `volumeClaimTemplates`, its one Pod while it is
//! not `Suspended`, and its status.

use serde_json::{Map, Value, json};

use super::super::store::Part;
use super::{
    CREATED_BY_LABEL, Controllers, EXT_GROUP, NAME_HASH_LABEL, POD_NAME_ANNOTATION, PROPAGATED_ANNOTATIONS_ANNOTATION,
    PROPAGATED_LABELS_ANNOTATION, TEMPLATE_REF_HASH_LABEL, WARM_POOL_LABEL, condition, conditions_of, controlled_by,
    controller_of, deleting, generation, is_system_key, map_at, owner_ref, set_condition, str_at,
};

/// The labels the controller puts on the Pod besides the template's own:
/// the warm-pool label while a SandboxWarmPool controls the Sandbox, the
/// template-ref hash while an extensions object does, and `created-by`.
fn extension_labels(sb: &Value) -> Map<String, Value> {
    let mut labels = Map::new();
    let labels_of_sb = map_at(sb, "/metadata/labels");
    if let Some(owner) = controller_of(sb)
        && str_at(owner, "/apiVersion").split('/').next() == Some(EXT_GROUP)
    {
        if str_at(owner, "/kind") == "SandboxWarmPool"
            && let Some(v) = labels_of_sb.get(WARM_POOL_LABEL).filter(|v| v.as_str() != Some(""))
        {
            labels.insert(WARM_POOL_LABEL.into(), v.clone());
        }
        if let Some(v) = labels_of_sb.get(TEMPLATE_REF_HASH_LABEL).filter(|v| v.as_str() != Some("")) {
            labels.insert(TEMPLATE_REF_HASH_LABEL.into(), v.clone());
        }
    }
    labels
}

fn sorted_keys(map: &Map<String, Value>) -> String {
    let mut keys: Vec<&str> = map.keys().map(String::as_str).collect();
    keys.sort_unstable();
    keys.join(",")
}

/// The template's labels or annotations without the controllers' own keys.
fn user_keys(sb: &Value, what: &str) -> Map<String, Value> {
    map_at(sb, &format!("/spec/podTemplate/metadata/{what}")).into_iter().filter(|(k, _)| !is_system_key(k)).collect()
}

/// The Pod the controller creates for a Sandbox.
fn new_pod(sb: &Value) -> Value {
    let name = str_at(sb, "/metadata/name");
    let template_labels = user_keys(sb, "labels");
    let template_annotations = user_keys(sb, "annotations");
    let mut labels = template_labels.clone();
    labels.insert(NAME_HASH_LABEL.into(), json!(super::name_hash(name)));
    labels.extend(extension_labels(sb));
    if let Some(v) = sb.pointer(&format!("/metadata/labels/{}", CREATED_BY_LABEL.replace('/', "~1"))) {
        labels.insert(CREATED_BY_LABEL.into(), v.clone());
    }
    let mut annotations = template_annotations.clone();
    if !template_labels.is_empty() {
        annotations.insert(PROPAGATED_LABELS_ANNOTATION.into(), json!(sorted_keys(&template_labels)));
    }
    if !template_annotations.is_empty() {
        annotations.insert(PROPAGATED_ANNOTATIONS_ANNOTATION.into(), json!(sorted_keys(&template_annotations)));
    }
    let mut spec = sb.pointer("/spec/podTemplate/spec").cloned().unwrap_or_else(|| json!({}));
    // MergeVolumeClaimVolumes: a template volume of a claim template's name
    // is replaced by the PVC volume; the PVC volumes go last.
    let claim_volumes: Vec<Value> = claim_templates(sb)
        .iter()
        .map(|vct| {
            let vname = str_at(vct, "/metadata/name");
            json!({ "name": vname, "persistentVolumeClaim": { "claimName": format!("{vname}-{name}") } })
        })
        .collect();
    if !claim_volumes.is_empty() {
        let mut volumes: Vec<Value> = spec
            .get("volumes")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|v| !claim_volumes.iter().any(|c| c["name"] == v["name"]))
            .cloned()
            .collect();
        volumes.extend(claim_volumes);
        spec["volumes"] = json!(volumes);
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [owner_ref(sb)],
        },
        "spec": spec,
    })
}

fn claim_templates(sb: &Value) -> Vec<Value> {
    sb.pointer("/spec/volumeClaimTemplates").and_then(Value::as_array).cloned().unwrap_or_default()
}

/// `updatePodMetadata`: the Pod's labels and annotations follow the
/// Sandbox's template and owner (a claimed Sandbox's Pod loses the
/// warm-pool label).
fn sync_pod_metadata(sb: &Value, pod: &mut Value) {
    let name_hash = super::name_hash(str_at(sb, "/metadata/name"));
    let template_labels = user_keys(sb, "labels");
    let template_annotations = user_keys(sb, "annotations");
    let mut labels = map_at(pod, "/metadata/labels");
    let mut annotations = map_at(pod, "/metadata/annotations");
    labels.insert(NAME_HASH_LABEL.into(), json!(name_hash));
    labels.extend(template_labels.clone());
    let propagated = annotations.get(PROPAGATED_LABELS_ANNOTATION).and_then(Value::as_str).unwrap_or("").to_owned();
    for k in propagated.split(',').filter(|k| !k.is_empty() && *k != NAME_HASH_LABEL) {
        if is_system_key(k) || !template_labels.contains_key(k) {
            labels.remove(k);
        }
    }
    let extension = extension_labels(sb);
    for key in [WARM_POOL_LABEL, TEMPLATE_REF_HASH_LABEL] {
        match extension.get(key) {
            Some(v) => labels.insert(key.into(), v.clone()),
            None => labels.remove(key),
        };
    }
    match map_at(sb, "/metadata/labels").get(CREATED_BY_LABEL).filter(|v| v.as_str() != Some("")) {
        Some(v) => labels.insert(CREATED_BY_LABEL.into(), v.clone()),
        None => labels.remove(CREATED_BY_LABEL),
    };
    annotations.extend(template_annotations.clone());
    let propagated =
        annotations.get(PROPAGATED_ANNOTATIONS_ANNOTATION).and_then(Value::as_str).unwrap_or("").to_owned();
    for k in propagated.split(',').filter(|k| !k.is_empty() && !is_system_key(k)) {
        if !template_annotations.contains_key(k) {
            annotations.remove(k);
        }
    }
    annotations.insert(PROPAGATED_LABELS_ANNOTATION.into(), json!(sorted_keys(&template_labels)));
    annotations.insert(PROPAGATED_ANNOTATIONS_ANNOTATION.into(), json!(sorted_keys(&template_annotations)));
    pod["metadata"]["labels"] = json!(labels);
    pod["metadata"]["annotations"] = json!(annotations);
}

fn pod_phase(pod: &Value) -> &str {
    str_at(pod, "/status/phase")
}

fn pod_ready(pod: &Value) -> bool {
    pod.pointer("/status/conditions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|c| str_at(c, "/type") == "Ready")
        .is_some_and(|c| str_at(c, "/status") == "True")
}

fn pod_ips(pod: &Value) -> Vec<Value> {
    pod.pointer("/status/podIPs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.get("ip").cloned())
        .collect()
}

impl Controllers {
    pub(super) fn sync_sandbox(&self, sb: &Value) {
        if deleting(sb) {
            return;
        }
        let ns = str_at(sb, "/metadata/namespace").to_owned();
        let name = str_at(sb, "/metadata/name").to_owned();
        let name_hash = super::name_hash(&name);
        let suspended = str_at(sb, "/spec/operatingMode") == "Suspended";
        let mut error: Option<String> = None;

        for vct in claim_templates(sb) {
            let pvc_name = format!("{}-{name}", str_at(&vct, "/metadata/name"));
            match self.get("persistentvolumeclaims", &ns, &pvc_name) {
                Some(pvc) if controller_of(&pvc).is_some() && !controlled_by(&pvc, sb) => {
                    error = Some(format!("PVC {pvc_name:?} is owned by another controller, not by sandbox {name:?}"));
                }
                Some(_) => {}
                None => {
                    let mut labels = map_at(&vct, "/metadata/labels");
                    labels.insert(NAME_HASH_LABEL.into(), json!(name_hash));
                    let pvc = json!({
                        "metadata": {
                            "name": pvc_name,
                            "labels": labels,
                            "annotations": map_at(&vct, "/metadata/annotations"),
                            "ownerReferences": [owner_ref(sb)],
                        },
                        "spec": vct.get("spec").cloned().unwrap_or_else(|| json!({})),
                    });
                    if let Err(e) = self.create("persistentvolumeclaims", &ns, pvc) {
                        error = Some(e.to_string());
                    }
                }
            }
        }

        let annotated = str_at(sb, &format!("/metadata/annotations/{}", POD_NAME_ANNOTATION.replace('/', "~1")));
        let pod_name = if annotated.is_empty() { name.clone() } else { annotated.to_owned() };
        let mut pod = self.get("pods", &ns, &pod_name);
        let mut annotation = (!annotated.is_empty()).then(|| annotated.to_owned());
        if pod.is_none() {
            annotation = None;
        }
        if let Some(p) = &pod
            && !controlled_by(p, sb)
        {
            error = Some(format!("pod {pod_name:?} is not owned by sandbox {name:?}"));
            pod = None;
            annotation = None;
        }
        if suspended {
            if let Some(p) = &pod
                && !deleting(p)
            {
                self.delete("pods", &ns, &pod_name);
                pod = self.get("pods", &ns, &pod_name);
            }
            annotation = None;
        } else if error.is_none() {
            match &pod {
                None => match self.create("pods", &ns, new_pod(sb)) {
                    Ok(created) => pod = Some(created),
                    Err(e) => error = Some(e.to_string()),
                },
                Some(p) => {
                    let mut synced = p.clone();
                    sync_pod_metadata(sb, &mut synced);
                    if &synced != p {
                        let (labels, annotations) =
                            (synced["metadata"]["labels"].clone(), synced["metadata"]["annotations"].clone());
                        self.modify("pods", p, Part::Main, |current| {
                            current["metadata"]["labels"] = labels;
                            current["metadata"]["annotations"] = annotations;
                        });
                    }
                }
            }
            if let Some(p) = &pod
                && annotation.is_none()
            {
                annotation = Some(str_at(p, "/metadata/name").to_owned());
            }
        }
        if annotation.as_deref() != (!annotated.is_empty()).then_some(annotated) {
            self.modify("sandboxes", sb, Part::Main, |current| {
                let mut annotations = map_at(current, "/metadata/annotations");
                match &annotation {
                    Some(a) => annotations.insert(POD_NAME_ANNOTATION.into(), json!(a)),
                    None => annotations.remove(POD_NAME_ANNOTATION),
                };
                current["metadata"]["annotations"] = json!(annotations);
            });
        }

        let mut status = sb.get("status").cloned().filter(Value::is_object).unwrap_or_else(|| json!({}));
        let map = status.as_object_mut().expect("an object");
        match &pod {
            Some(p) => {
                map.insert("selector".into(), json!(format!("{NAME_HASH_LABEL}={name_hash}")));
                let ips = pod_ips(p);
                if ips.is_empty() {
                    map.remove("podIPs")
                } else {
                    map.insert("podIPs".into(), json!(ips))
                };
                match str_at(p, "/spec/nodeName") {
                    "" => map.remove("nodeName"),
                    node => map.insert("nodeName".into(), json!(node)),
                };
            }
            None => {
                map.remove("podIPs");
                map.remove("nodeName");
            }
        }
        let mut conditions = conditions_of(sb);
        for c in self.sandbox_conditions(sb, pod.as_ref(), error.as_deref()) {
            set_condition(&mut conditions, c);
        }
        let finished = pod.as_ref().is_some_and(|p| matches!(pod_phase(p), "Succeeded" | "Failed"));
        conditions.retain(|c| {
            let kind = str_at(c, "/type");
            !(kind == "Finished" && !finished || kind == "PodScheduled" && pod.is_none())
        });
        status["conditions"] = json!(conditions);
        self.set_status("sandboxes", sb, status);
    }

    /// Suspended, Finished (a pod that ended), PodScheduled (while there
    /// is a pod), Ready: as `computeConditions` computes them.
    fn sandbox_conditions(&self, sb: &Value, pod: Option<&Value>, error: Option<&str>) -> Vec<Value> {
        let generation = generation(sb);
        let suspended = str_at(sb, "/spec/operatingMode") == "Suspended";
        let mut out = Vec::new();
        out.push(match (suspended, pod) {
            (false, _) => condition("Suspended", false, "NotSuspended", "Sandbox is not suspended", generation),
            (true, None) => condition(
                "Suspended",
                true,
                "PodTerminated",
                "Pod has been terminated. Sandbox is suspended",
                generation,
            ),
            (true, Some(_)) => {
                condition("Suspended", false, "PodTerminating", "Pod is terminating. Sandbox is suspending", generation)
            }
        });
        if let Some(p) = pod {
            match pod_phase(p) {
                "Succeeded" => out.push(condition("Finished", true, "PodSucceeded", "", generation)),
                "Failed" => out.push(condition("Finished", true, "PodFailed", "", generation)),
                _ => {}
            }
            let scheduled = p
                .pointer("/status/conditions")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .find(|c| str_at(c, "/type") == "PodScheduled");
            out.push(match scheduled {
                Some(c) => {
                    let ok = str_at(c, "/status");
                    let reason = match (str_at(c, "/reason"), ok) {
                        ("", "True") => "PodScheduled",
                        ("", _) => "PodSchedulingUnknown",
                        (r, _) => r,
                    };
                    json!({ "type": "PodScheduled", "status": ok, "reason": reason,
                            "message": str_at(c, "/message"), "observedGeneration": generation })
                }
                None => json!({ "type": "PodScheduled", "status": "Unknown", "reason": "PodSchedulingUnknown",
                                "message": "Pod has not reported a PodScheduled condition yet",
                                "observedGeneration": generation }),
            });
        }
        let ready = |ok: bool, reason: &str, message: &str| condition("Ready", ok, reason, message, generation);
        out.push(if let Some(e) = error {
            ready(false, "ReconcilerError", &format!("Error seen: {e}"))
        } else if suspended {
            ready(
                false,
                "SandboxSuspended",
                if pod.is_some() { "Sandbox is suspending" } else { "Sandbox is suspended" },
            )
        } else {
            match pod {
                None => ready(false, "DependenciesNotReady", "Pod does not exist"),
                Some(p) => match pod_phase(p) {
                    "Succeeded" => ready(false, "PodSucceeded", "Pod completed successfully"),
                    "Failed" => ready(false, "PodFailed", "Pod failed"),
                    "Running" if pod_ready(p) && !pod_ips(p).is_empty() => {
                        ready(true, "DependenciesReady", "Pod is Ready")
                    }
                    "Running" if pod_ready(p) => {
                        ready(false, "DependenciesNotReady", "Pod is Ready but has no podIPs yet")
                    }
                    "Running" => ready(false, "DependenciesNotReady", "Pod is Running but not Ready"),
                    phase => ready(false, "DependenciesNotReady", &format!("Pod exists with phase: {phase}")),
                },
            }
        });
        out
    }
}
