//! A fake of kubernetes-sigs/agent-sandbox's controllers (Sandbox,
//! SandboxTemplate, SandboxWarmPool, SandboxClaim), faithful to the real
//! ones in the names, labels, owner references and status fields a client
//! relies on (see the module doc of [`super`] for what is and is not
//! modelled). One level-triggered loop: on every store write it re-reads
//! every object of those kinds and writes only what differs.
//!
//! The reconcilers live in [`sandbox`] (Sandbox → PVCs, Pod, status),
//! [`extensions`] (SandboxTemplate → NetworkPolicy, SandboxWarmPool →
//! Sandboxes) and [`claim`] (SandboxClaim → an adopted or a cold
//! Sandbox); this file holds the loop, the shared vocabulary and the
//! owner-reference garbage collector.

mod claim;
mod extensions;
mod sandbox;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::Shared;
use super::error::ApiError;
use super::objects;
use super::store::{ObjKey, Part, ResourceType, now};

pub const GROUP: &str = "agents.x-k8s.io";
pub const EXT_GROUP: &str = "extensions.agents.x-k8s.io";
pub const VERSION: &str = "v1beta1";

/// The Sandbox controller's tracking label on its Pod, PVCs (and Service):
/// the FNV-1a hash of the Sandbox's name.
pub const NAME_HASH_LABEL: &str = "agents.x-k8s.io/sandbox-name-hash";
pub const POD_NAME_ANNOTATION: &str = "agents.x-k8s.io/pod-name";
pub const WARM_POOL_LABEL: &str = "agents.x-k8s.io/warm-pool-sandbox";
pub const TEMPLATE_REF_HASH_LABEL: &str = "agents.x-k8s.io/sandbox-template-ref-hash";
pub const TEMPLATE_HASH_LABEL: &str = "agents.x-k8s.io/sandbox-template-hash";
pub const POD_TEMPLATE_HASH_LABEL: &str = "agents.x-k8s.io/sandbox-pod-template-hash";
pub const LAUNCH_TYPE_LABEL: &str = "agents.x-k8s.io/launch-type";
pub const CREATED_BY_LABEL: &str = "agents.x-k8s.io/created-by";
pub const TEMPLATE_REF_ANNOTATION: &str = "agents.x-k8s.io/sandbox-template-ref";
pub const CLAIM_UID_LABEL: &str = "agents.x-k8s.io/claim-uid";
/// On a SandboxClaim: the name of the Sandbox it adopted.
pub const ASSIGNED_SANDBOX_ANNOTATION: &str = "agents.x-k8s.io/sandbox-name";
pub const PROPAGATED_LABELS_ANNOTATION: &str = "agents.x-k8s.io/propagated-labels";
pub const PROPAGATED_ANNOTATIONS_ANNOTATION: &str = "agents.x-k8s.io/propagated-annotations";

/// The real controller's `NameHash`: FNV-1a (32 bit) of the name, 8 hex digits.
pub fn name_hash(name: &str) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("{h:08x}")
}

/// Labels and annotations under `agents.x-k8s.io/` or
/// `extensions.agents.x-k8s.io/` are the controllers' own: never copied
/// from a template onto a Pod.
pub fn is_system_key(key: &str) -> bool {
    key.starts_with("agents.x-k8s.io/") || key.starts_with("extensions.agents.x-k8s.io/")
}

pub fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

pub fn map_at(v: &Value, pointer: &str) -> Map<String, Value> {
    v.pointer(pointer).and_then(Value::as_object).cloned().unwrap_or_default()
}

pub fn deleting(obj: &Value) -> bool {
    obj.pointer("/metadata/deletionTimestamp").is_some_and(|t| !t.is_null())
}

/// A controller ownerReference to `owner`, as `SetControllerReference` makes.
pub fn owner_ref(owner: &Value) -> Value {
    json!({
        "apiVersion": str_at(owner, "/apiVersion"),
        "kind": str_at(owner, "/kind"),
        "name": str_at(owner, "/metadata/name"),
        "uid": str_at(owner, "/metadata/uid"),
        "controller": true,
        "blockOwnerDeletion": true,
    })
}

/// The ownerReference with `controller: true`, if any.
pub fn controller_of(obj: &Value) -> Option<&Value> {
    obj.pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)?
        .iter()
        .find(|r| r.get("controller").and_then(Value::as_bool) == Some(true))
}

pub fn controlled_by(obj: &Value, owner: &Value) -> bool {
    controller_of(obj).is_some_and(|r| str_at(r, "/uid") == str_at(owner, "/metadata/uid"))
}

/// `meta.SetStatusCondition`: the condition of `new`'s type is replaced,
/// its `lastTransitionTime` moving only when its status changes; a new
/// type is appended.
pub fn set_condition(conditions: &mut Vec<Value>, mut new: Value) {
    let kind = str_at(&new, "/type").to_owned();
    match conditions.iter_mut().find(|c| str_at(c, "/type") == kind) {
        Some(old) => {
            let time = if str_at(old, "/status") == str_at(&new, "/status") {
                old.get("lastTransitionTime").cloned().unwrap_or_else(|| json!(now()))
            } else {
                json!(now())
            };
            new["lastTransitionTime"] = time;
            *old = new;
        }
        None => {
            new["lastTransitionTime"] = json!(now());
            conditions.push(new);
        }
    }
}

pub fn condition(kind: &str, status: bool, reason: &str, message: &str, generation: i64) -> Value {
    json!({
        "type": kind,
        "status": if status { "True" } else { "False" },
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    })
}

pub fn conditions_of(obj: &Value) -> Vec<Value> {
    obj.pointer("/status/conditions").and_then(Value::as_array).cloned().unwrap_or_default()
}

pub fn find_condition<'a>(obj: &'a Value, kind: &str) -> Option<&'a Value> {
    obj.pointer("/status/conditions")?.as_array()?.iter().find(|c| str_at(c, "/type") == kind)
}

pub fn generation(obj: &Value) -> i64 {
    obj.pointer("/metadata/generation").and_then(Value::as_i64).unwrap_or(1)
}

/// The controllers' access to the store, as the API server would serve them.
#[derive(Debug, Clone)]
pub(crate) struct Controllers {
    shared: Arc<Shared>,
}

impl Controllers {
    pub fn rt(&self, plural: &str) -> Arc<ResourceType> {
        let (group, version) = match plural {
            "sandboxes" => (GROUP, VERSION),
            "sandboxtemplates" | "sandboxclaims" | "sandboxwarmpools" => (EXT_GROUP, VERSION),
            "networkpolicies" => ("networking.k8s.io", "v1"),
            _ => ("", "v1"),
        };
        self.shared.store.resource(group, version, plural).unwrap_or_else(|| panic!("{plural} are registered"))
    }

    fn key(&self, plural: &str, namespace: &str, name: &str) -> ObjKey {
        ObjKey { rt: self.rt(plural), namespace: namespace.into(), name: name.into() }
    }

    pub fn list(&self, plural: &str) -> Vec<Value> {
        self.shared.store.list(&self.rt(plural), None).0
    }

    pub fn list_in(&self, plural: &str, namespace: &str) -> Vec<Value> {
        self.shared.store.list(&self.rt(plural), Some(namespace)).0
    }

    pub fn get(&self, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        self.shared.store.get(&self.key(plural, namespace, name))
    }

    /// A create as the API server does it: defaults, then the store, then
    /// what follows (a PVC's directory).
    pub fn create(&self, plural: &str, namespace: &str, mut obj: Value) -> Result<Value, ApiError> {
        let rt = self.rt(plural);
        objects::admit_create(&rt.plural, &rt.group, namespace, &mut obj)?;
        let created = self.shared.store.create(&rt, namespace, obj)?;
        let key = ObjKey { rt, namespace: namespace.into(), name: str_at(&created, "/metadata/name").into() };
        objects::after_create(&self.shared, &key)?;
        Ok(created)
    }

    /// A DELETE without options: graceful for a pod, held by PVC protection
    /// for a claim in use, at once for the rest.
    pub fn delete(&self, plural: &str, namespace: &str, name: &str) {
        let _ = objects::delete(&self.shared, &self.key(plural, namespace, name), None);
    }

    /// Changes an object if it is still the one `uid` names; a write that
    /// changes nothing is no write.
    pub fn modify(&self, plural: &str, obj: &Value, part: Part, f: impl FnOnce(&mut Value)) {
        let uid = str_at(obj, "/metadata/uid").to_owned();
        let key = self.key(plural, str_at(obj, "/metadata/namespace"), str_at(obj, "/metadata/name"));
        let _ = self.shared.store.modify(&key, part, |current| {
            if str_at(current, "/metadata/uid") == uid {
                f(current);
            }
            Ok(())
        });
    }

    /// Writes `status` if it differs from the stored one.
    pub fn set_status(&self, plural: &str, obj: &Value, status: Value) {
        if obj.get("status") == Some(&status) {
            return;
        }
        self.modify(plural, obj, Part::Status, |current| current["status"] = status);
    }

    /// One pass of every controller. Returns when to look again if nothing
    /// is written before (a claim waiting for a warm candidate's IP).
    fn sync(&self) -> Option<Duration> {
        if *self.shared.shutdown.borrow() {
            return None;
        }
        self.sync_templates();
        self.sync_pools();
        let requeue = self.sync_claims();
        for sb in self.list("sandboxes") {
            self.sync_sandbox(&sb);
        }
        self.collect_garbage();
        requeue
    }

    /// The garbage collector, for what agent-sandbox's objects own only: a
    /// pod, PVC, Sandbox or NetworkPolicy whose controller ownerReference
    /// names an agent-sandbox object that no longer exists (or has another
    /// uid) is deleted as a background-propagation delete would (a pod
    /// gracefully, a PVC once no pod uses it).
    fn collect_garbage(&self) {
        for plural in ["sandboxes", "pods", "persistentvolumeclaims", "networkpolicies"] {
            for obj in self.list(plural) {
                if deleting(&obj) {
                    continue;
                }
                let Some(owner) = controller_of(&obj) else { continue };
                let owner_plural = match (str_at(owner, "/apiVersion"), str_at(owner, "/kind")) {
                    ("agents.x-k8s.io/v1beta1", "Sandbox") => "sandboxes",
                    ("extensions.agents.x-k8s.io/v1beta1", "SandboxClaim") => "sandboxclaims",
                    ("extensions.agents.x-k8s.io/v1beta1", "SandboxWarmPool") => "sandboxwarmpools",
                    ("extensions.agents.x-k8s.io/v1beta1", "SandboxTemplate") => "sandboxtemplates",
                    _ => continue,
                };
                let ns = str_at(&obj, "/metadata/namespace");
                let alive = self
                    .get(owner_plural, ns, str_at(owner, "/name"))
                    .is_some_and(|o| str_at(&o, "/metadata/uid") == str_at(owner, "/uid"));
                if !alive {
                    self.delete(plural, ns, str_at(&obj, "/metadata/name"));
                }
            }
        }
    }
}

/// Starts the controllers' loop: a pass after every store write (and when
/// a pass asks to look again), until the fake shuts down.
pub(crate) fn spawn(shared: Arc<Shared>) {
    let mut changed = shared.store.subscribe();
    let mut shutdown = shared.shutdown.clone();
    let controllers = Controllers { shared };
    tokio::spawn(async move {
        loop {
            let requeue = controllers.sync();
            let later = async move {
                match requeue {
                    Some(after) => tokio::time::sleep(after).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = changed.changed() => if r.is_err() { return },
                () = later => {}
                () = super::stopped(&mut shutdown) => return,
            }
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn name_hash_is_fnv1a_32() {
        // FNV-1a of "" is the offset basis; of "a" a known value.
        assert_eq!(super::name_hash(""), "811c9dc5");
        assert_eq!(super::name_hash("a"), "e40c292c");
    }
}
