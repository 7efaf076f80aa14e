//! What the API server does per kind beyond storing: validation and
//! defaults at create, PVC binding, and deletion (graceful for a pod with a
//! container, held by PVC protection for a claim in use).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::Shared;
use super::error::ApiError;
use base64::Engine;

use super::store::{ObjKey, Part, Store, now};

/// The host directory of a bound PVC.
pub fn pvc_dir(root: &Path, namespace: &str, claim: &str) -> PathBuf {
    root.join("pvcs").join(namespace).join(claim)
}

pub fn is_pod(key_rt_plural: &str, group: &str) -> bool {
    group.is_empty() && key_rt_plural == "pods"
}

fn is_pvc(key: &ObjKey) -> bool {
    key.rt.group.is_empty() && key.rt.plural == "persistentvolumeclaims"
}

/// Validation and server-side defaults before an object is stored.
pub fn admit_create(plural: &str, group: &str, namespace: &str, obj: &mut Value) -> Result<(), ApiError> {
    if !group.is_empty() {
        return Ok(());
    }
    match plural {
        "pods" => {
            let containers = obj.pointer("/spec/containers").and_then(Value::as_array);
            if containers.is_none_or(|c| c.is_empty()) {
                return Err(ApiError::Invalid(format!(
                    "Pod \"{}\" is invalid: spec.containers: Required value",
                    super::store::name_of(obj)
                )));
            }
            for (i, c) in containers.into_iter().flatten().enumerate() {
                if c.pointer("/securityContext/privileged").and_then(Value::as_bool) == Some(true) {
                    return Err(ApiError::Invalid(format!(
                        "Pod \"{}\" is invalid: spec.containers[{i}].securityContext.privileged: Forbidden: disallowed by the fake cluster",
                        super::store::name_of(obj)
                    )));
                }
            }
            obj["status"] = json!({ "phase": "Pending", "qosClass": "BestEffort" });
        }
        "secrets" => fold_string_data(obj),
        "persistentvolumeclaims" => {
            // Bound at once, as with a volume binding mode of Immediate and a
            // provisioner that never fails: a directory stands for the volume
            // (made by `after_create`, once the name is known to be free).
            let name = super::store::name_of(obj).to_owned();
            let modes = obj.pointer("/spec/accessModes").cloned().unwrap_or_else(|| json!(["ReadWriteOnce"]));
            let storage = obj.pointer("/spec/resources/requests/storage").cloned().unwrap_or_else(|| json!("1Gi"));
            obj["spec"]["volumeName"] = json!(format!("pvc-{namespace}-{name}"));
            obj["status"] = json!({ "phase": "Bound", "accessModes": modes, "capacity": { "storage": storage } });
            let finalizers = obj["metadata"]["finalizers"].as_array().cloned().unwrap_or_default();
            if !finalizers.iter().any(|f| f == "kubernetes.io/pvc-protection") {
                let mut finalizers = finalizers;
                finalizers.push(json!("kubernetes.io/pvc-protection"));
                obj["metadata"]["finalizers"] = json!(finalizers);
            }
        }
        _ => {}
    }
    Ok(())
}

/// A Secret's `stringData` goes into `data`, base64-encoded, as the real
/// server does on every write: it is never stored or returned.
fn fold_string_data(obj: &mut Value) {
    let Some(strings) = obj.as_object_mut().and_then(|m| m.remove("stringData")) else { return };
    let Some(strings) = strings.as_object() else { return };
    if !obj["data"].is_object() {
        obj["data"] = json!({});
    }
    for (k, v) in strings {
        let text = v.as_str().unwrap_or("");
        obj["data"][k] = json!(base64::engine::general_purpose::STANDARD.encode(text));
    }
}

/// A pod's spec without the fields an update may change.
fn fixed_pod_spec(pod: &Value) -> Value {
    let mut spec = pod.get("spec").cloned().unwrap_or(Value::Null);
    if let Some(map) = spec.as_object_mut() {
        for field in ["activeDeadlineSeconds", "tolerations", "schedulingGates", "terminationGracePeriodSeconds"] {
            map.remove(field);
        }
        for list in ["containers", "initContainers"] {
            for c in map.get_mut(list).and_then(Value::as_array_mut).into_iter().flatten() {
                c.as_object_mut().map(|c| c.remove("image"));
            }
        }
    }
    spec
}

/// Validation of an update (PUT or PATCH) of `old` into `new`: a pod's spec
/// is immutable but for images, deadlines and tolerations (the real
/// server's rule); a Secret's `stringData` is folded into `data`.
pub fn admit_update(key: &ObjKey, part: Part, old: &Value, new: &mut Value) -> Result<(), ApiError> {
    if !key.rt.group.is_empty() {
        return Ok(());
    }
    match key.rt.plural.as_str() {
        "pods" if part == Part::Main && fixed_pod_spec(old) != fixed_pod_spec(new) => Err(ApiError::Invalid(format!(
            "Pod \"{}\" is invalid: spec: Forbidden: pod updates may not change fields other than \
             `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,\
             `spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` \
             (allow it to be set to 1 if it was previously negative)",
            key.name
        ))),
        "secrets" => {
            fold_string_data(new);
            Ok(())
        }
        _ => Ok(()),
    }
}

/// What follows a stored create: a PVC's directory.
pub fn after_create(shared: &Shared, key: &ObjKey) -> Result<(), ApiError> {
    if is_pvc(key) {
        let dir = pvc_dir(&shared.root, &key.namespace, &key.name);
        std::fs::create_dir_all(&dir).map_err(|e| ApiError::Internal(format!("make {}: {e}", dir.display())))?;
    }
    Ok(())
}

fn phase(pod: &Value) -> &str {
    pod.pointer("/status/phase").and_then(Value::as_str).unwrap_or("Pending")
}

/// Whether a pod still holds its PVCs (not Succeeded or Failed).
fn pod_terminated(pod: &Value) -> bool {
    matches!(phase(pod), "Succeeded" | "Failed")
}

/// The claim names of a pod's PVC volumes.
pub fn claims_of(pod: &Value) -> Vec<String> {
    pod.pointer("/spec/volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|v| v.pointer("/persistentVolumeClaim/claimName").and_then(Value::as_str))
        .map(str::to_owned)
        .collect()
}

fn claim_in_use(store: &Store, key: &ObjKey) -> bool {
    let Some(pods) = store.resource("", "v1", "pods") else {
        return false;
    };
    let (pods, _) = store.list(&pods, Some(&key.namespace));
    pods.iter().any(|p| !pod_terminated(p) && claims_of(p).contains(&key.name))
}

/// Removes a PVC and its directory.
fn remove_pvc(store: &Store, root: &Path, key: &ObjKey) -> Option<Value> {
    let removed = store.remove(key);
    let _ = std::fs::remove_dir_all(pvc_dir(root, &key.namespace, &key.name));
    removed
}

/// PVC protection: every claim marked for deletion and no longer used by a
/// running pod goes now. Called by the kubelet whenever anything changes.
pub fn finalize_claims(store: &Store, root: &Path) {
    let Some(pvcs) = store.resource("", "v1", "persistentvolumeclaims") else {
        return;
    };
    let (claims, _) = store.list(&pvcs, None);
    for claim in claims {
        if claim.pointer("/metadata/deletionTimestamp").is_none() {
            continue;
        }
        let key = ObjKey {
            rt: pvcs.clone(),
            namespace: claim.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or("").into(),
            name: super::store::name_of(&claim).into(),
        };
        if !claim_in_use(store, &key) {
            remove_pvc(store, root, &key);
        }
    }
}

/// A DELETE of one object. A pod that has not terminated is marked
/// (`deletionTimestamp`, `deletionGracePeriodSeconds`) and left to the
/// kubelet, unless the grace is 0 (a forced delete removes it at once, the
/// kubelet then kills what runs). A claim in use is marked and left to PVC
/// protection. Anything else goes at once. Returns the object as the real
/// server does (the marked one, or the last state of the removed one).
pub fn delete(shared: &Shared, key: &ObjKey, grace: Option<i64>) -> Result<Value, ApiError> {
    let store = &shared.store;
    let Some(obj) = store.get(key) else {
        return Err(key.rt.not_found(&key.name));
    };
    if is_pod(&key.rt.plural, &key.rt.group) && !pod_terminated(&obj) && grace != Some(0) {
        if obj.pointer("/metadata/deletionTimestamp").is_some() {
            return Ok(obj);
        }
        let grace =
            grace.or_else(|| obj.pointer("/spec/terminationGracePeriodSeconds").and_then(Value::as_i64)).unwrap_or(30);
        return store.modify(key, Part::Internal, |pod| {
            pod["metadata"]["deletionTimestamp"] = json!(now());
            pod["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
            Ok(())
        });
    }
    if is_pvc(key) {
        if claim_in_use(store, key) {
            return store.modify(key, Part::Internal, |pvc| {
                if pvc.pointer("/metadata/deletionTimestamp").is_none() {
                    pvc["metadata"]["deletionTimestamp"] = json!(now());
                    pvc["metadata"]["deletionGracePeriodSeconds"] = json!(0);
                }
                Ok(())
            });
        }
        return remove_pvc(store, &shared.root, key).ok_or_else(|| key.rt.not_found(&key.name));
    }
    store.remove(key).ok_or_else(|| key.rt.not_found(&key.name))
}
