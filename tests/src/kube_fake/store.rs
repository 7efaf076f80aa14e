//! The object store: every object of every registered kind as JSON, one
//! global resource version (a counter, as etcd's revision), and the history
//! of changes a watch replays from.
//!
//! The store is also the hook for controllers (the fake kubelet, the
//! agent-sandbox controllers): [`Store::subscribe`] wakes a
//! subscriber on every write, and the subscriber re-reads the state it
//! cares about (level-triggered, as real controllers reconcile), so a
//! controller never depends on seeing each intermediate change.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Map, Value, json};
use tokio::sync::watch;

use super::error::ApiError;

/// One kind the server serves. Registering a custom resource is one line in
/// [`registry`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResourceType {
    /// "" for the core group.
    pub group: String,
    pub version: String,
    /// The plural, as in the path (`pods`).
    pub plural: String,
    /// The kind (`Pod`); a list is `PodList`.
    pub kind: String,
    pub namespaced: bool,
    /// Whether `status` is a subresource: then a PUT or PATCH of the object
    /// keeps the stored status, and only `/status` changes it.
    pub status_subresource: bool,
}

impl ResourceType {
    pub fn new(group: &str, version: &str, plural: &str, kind: &str, namespaced: bool) -> Self {
        Self {
            group: group.into(),
            version: version.into(),
            plural: plural.into(),
            kind: kind.into(),
            namespaced,
            status_subresource: true,
        }
    }

    /// The `apiVersion` of its objects: `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() { self.version.clone() } else { format!("{}/{}", self.group, self.version) }
    }

    pub fn not_found(&self, name: &str) -> ApiError {
        ApiError::NotFound { resource: self.plural.clone(), group: self.group.clone(), name: name.into() }
    }
}

/// Every kind the fake serves. A custom resource is one more
/// `ResourceType::new(...)` line here.
pub fn registry() -> Vec<Arc<ResourceType>> {
    let mut configmaps = ResourceType::new("", "v1", "configmaps", "ConfigMap", true);
    configmaps.status_subresource = false;
    let mut secrets = ResourceType::new("", "v1", "secrets", "Secret", true);
    secrets.status_subresource = false;
    let mut events = ResourceType::new("", "v1", "events", "Event", true);
    events.status_subresource = false;
    let mut network_policies = ResourceType::new("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", true);
    network_policies.status_subresource = false;
    // agent-sandbox's CRDs (kubernetes-sigs/agent-sandbox, v1beta1); a
    // SandboxTemplate has no status subresource there either.
    let mut templates =
        ResourceType::new("extensions.agents.x-k8s.io", "v1beta1", "sandboxtemplates", "SandboxTemplate", true);
    templates.status_subresource = false;
    [
        ResourceType::new("", "v1", "pods", "Pod", true),
        ResourceType::new("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", true),
        configmaps,
        secrets,
        events,
        network_policies,
        ResourceType::new("agents.x-k8s.io", "v1beta1", "sandboxes", "Sandbox", true),
        templates,
        ResourceType::new("extensions.agents.x-k8s.io", "v1beta1", "sandboxclaims", "SandboxClaim", true),
        ResourceType::new("extensions.agents.x-k8s.io", "v1beta1", "sandboxwarmpools", "SandboxWarmPool", true),
    ]
    .into_iter()
    .map(Arc::new)
    .collect()
}

/// Where an object lives. Cluster-scoped objects have an empty namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjKey {
    pub rt: Arc<ResourceType>,
    pub namespace: String,
    pub name: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

impl ChangeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One write, as a watch replays it. `old` is the object before the write,
/// so a watch with a selector can tell an object that stopped matching
/// (sent as DELETED, as the real server does).
#[derive(Debug, Clone)]
pub struct Change {
    pub rv: u64,
    pub key: ObjKey,
    pub kind: ChangeKind,
    pub old: Option<Value>,
    pub object: Value,
}

/// What a watch or controller reads at once: the changes after a version,
/// the version they bring the reader to, and the compaction epoch.
#[derive(Debug)]
pub struct Since {
    pub changes: Vec<Change>,
    pub current: u64,
    pub epoch: u64,
}

#[derive(Debug)]
struct Inner {
    rv: u64,
    objects: BTreeMap<ObjKey, Value>,
    history: VecDeque<Change>,
    /// Every change after this version is still in `history`.
    compacted: u64,
    /// Bumped by [`Store::compact_now`]; open watches end when it moves.
    epoch: u64,
}

/// The store. Cheap to share behind an `Arc`; every method takes the lock
/// for a short, non-async critical section.
#[derive(Debug)]
pub struct Store {
    inner: Mutex<Inner>,
    history_limit: usize,
    registry: Vec<Arc<ResourceType>>,
    /// (resource version, epoch) after the latest write.
    notify: watch::Sender<(u64, u64)>,
}

/// The server's clock, as Kubernetes writes times (RFC 3339, seconds).
pub fn now() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

fn random_uid() -> String {
    let n: u128 = rand::random();
    let h = format!("{n:032x}");
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5).map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char).collect()
}

/// `metadata.name` of an object, or "".
pub fn name_of(obj: &Value) -> &str {
    obj.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("")
}

pub fn rv_of(obj: &Value) -> Option<&str> {
    obj.pointer("/metadata/resourceVersion").and_then(Value::as_str)
}

fn metadata_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.is_object() {
        *obj = json!({});
    }
    let map = obj.as_object_mut().expect("made an object above");
    let meta = map.entry("metadata").or_insert_with(|| json!({}));
    if !meta.is_object() {
        *meta = json!({});
    }
    meta.as_object_mut().expect("made an object above")
}

/// Everything but `metadata` and `status`: what `generation` counts changes of.
fn spec_part(obj: &Value) -> Value {
    let mut v = obj.clone();
    if let Some(map) = v.as_object_mut() {
        map.remove("metadata");
        map.remove("status");
    }
    v
}

/// RFC 7386 JSON merge patch: objects merge key by key, `null` removes a
/// key, anything else replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(patch_map) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let target_map = target.as_object_mut().expect("made an object above");
    for (k, v) in patch_map {
        if v.is_null() {
            target_map.remove(k);
        } else {
            merge_patch(target_map.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

impl Store {
    pub fn new(history_limit: usize) -> Self {
        let (notify, _) = watch::channel((1, 0));
        Self {
            inner: Mutex::new(Inner {
                rv: 1,
                objects: BTreeMap::new(),
                history: VecDeque::new(),
                compacted: 1,
                epoch: 0,
            }),
            history_limit: history_limit.max(1),
            registry: registry(),
            notify,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn resource(&self, group: &str, version: &str, plural: &str) -> Option<Arc<ResourceType>> {
        self.registry.iter().find(|rt| rt.group == group && rt.version == version && rt.plural == plural).cloned()
    }

    pub fn resources(&self) -> &[Arc<ResourceType>] {
        &self.registry
    }

    /// Woken on every write (and on compaction): the controllers' hook.
    pub fn subscribe(&self) -> watch::Receiver<(u64, u64)> {
        self.notify.subscribe()
    }

    pub fn current(&self) -> (u64, u64) {
        let inner = self.lock();
        (inner.rv, inner.epoch)
    }

    fn record(&self, inner: &mut Inner, change: Change) {
        inner.history.push_back(change);
        while inner.history.len() > self.history_limit {
            if let Some(dropped) = inner.history.pop_front() {
                inner.compacted = dropped.rv;
            }
        }
        self.notify.send_replace((inner.rv, inner.epoch));
    }

    pub fn get(&self, key: &ObjKey) -> Option<Value> {
        self.lock().objects.get(key).cloned()
    }

    /// Every object of a kind, in one namespace or all, and the version the
    /// list is current at.
    pub fn list(&self, rt: &Arc<ResourceType>, namespace: Option<&str>) -> (Vec<Value>, u64) {
        let inner = self.lock();
        let items = inner
            .objects
            .iter()
            .filter(|(k, _)| &k.rt == rt && namespace.is_none_or(|ns| k.namespace == ns))
            .map(|(_, v)| v.clone())
            .collect();
        (items, inner.rv)
    }

    /// Creates an object: the server's metadata (uid, resourceVersion,
    /// creationTimestamp, generation), `generateName` honoured.
    pub fn create(&self, rt: &Arc<ResourceType>, namespace: &str, mut obj: Value) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let meta = metadata_mut(&mut obj);
        let mut name = meta.get("name").and_then(Value::as_str).unwrap_or("").to_owned();
        if name.is_empty() {
            let prefix = meta.get("generateName").and_then(Value::as_str).unwrap_or("").to_owned();
            if prefix.is_empty() {
                return Err(ApiError::Invalid(format!(
                    "{} \"\" is invalid: metadata.name: Required value: name or generateName is required",
                    rt.kind
                )));
            }
            loop {
                name = format!("{prefix}{}", random_suffix());
                let probe = ObjKey { rt: rt.clone(), namespace: namespace.into(), name: name.clone() };
                if !inner.objects.contains_key(&probe) {
                    break;
                }
            }
        }
        let key = ObjKey { rt: rt.clone(), namespace: namespace.into(), name: name.clone() };
        if inner.objects.contains_key(&key) {
            return Err(ApiError::AlreadyExists { resource: rt.plural.clone(), group: rt.group.clone(), name });
        }
        inner.rv += 1;
        meta.insert("name".into(), json!(name));
        if rt.namespaced {
            meta.insert("namespace".into(), json!(namespace));
        }
        meta.insert("uid".into(), json!(random_uid()));
        meta.insert("resourceVersion".into(), json!(inner.rv.to_string()));
        meta.insert("creationTimestamp".into(), json!(now()));
        meta.insert("generation".into(), json!(1));
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
        if let Some(map) = obj.as_object_mut() {
            map.insert("apiVersion".into(), json!(rt.api_version()));
            map.insert("kind".into(), json!(rt.kind));
        }
        inner.objects.insert(key.clone(), obj.clone());
        let change = Change { rv: inner.rv, key, kind: ChangeKind::Added, old: None, object: obj.clone() };
        self.record(&mut inner, change);
        Ok(obj)
    }

    /// Replaces an object as a PUT does: 404 if missing, 409 if `expect_rv`
    /// is given and is not the current version. Server-managed metadata is
    /// kept; `generation` moves when anything outside metadata and status
    /// changed. `part` chooses what the write may change (see [`Part`]).
    pub fn replace(&self, key: &ObjKey, obj: Value, part: Part) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        self.replace_in(&mut inner, key, obj, part)
    }

    /// Reads, changes and writes an object under one lock hold, so the
    /// kubelet's status writes never race a client's update. `f` may refuse.
    pub fn modify(
        &self,
        key: &ObjKey,
        part: Part,
        f: impl FnOnce(&mut Value) -> Result<(), ApiError>,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let Some(mut obj) = inner.objects.get(key).cloned() else {
            return Err(key.rt.not_found(&key.name));
        };
        f(&mut obj)?;
        let current = inner.objects.get(key).and_then(|o| rv_of(o)).map(str::to_owned);
        metadata_mut(&mut obj).insert("resourceVersion".into(), json!(current));
        self.replace_in(&mut inner, key, obj, part)
    }

    fn replace_in(&self, inner: &mut Inner, key: &ObjKey, mut obj: Value, part: Part) -> Result<Value, ApiError> {
        let Some(old) = inner.objects.get(key).cloned() else {
            return Err(key.rt.not_found(&key.name));
        };
        let sent_rv = obj.pointer("/metadata/resourceVersion").and_then(Value::as_str).map(str::to_owned);
        if let Some(sent) = sent_rv.filter(|s| !s.is_empty())
            && Some(sent.as_str()) != rv_of(&old)
        {
            return Err(ApiError::Conflict {
                resource: key.rt.plural.clone(),
                group: key.rt.group.clone(),
                name: key.name.clone(),
            });
        }
        match part {
            Part::Main if key.rt.status_subresource => match old.get("status") {
                Some(status) => obj["status"] = status.clone(),
                None => {
                    obj.as_object_mut().map(|m| m.remove("status"));
                }
            },
            Part::Status => {
                let status = obj.get("status").cloned();
                obj = old.clone();
                match status {
                    Some(status) => obj["status"] = status,
                    None => {
                        obj.as_object_mut().map(|m| m.remove("status"));
                    }
                }
            }
            Part::Main | Part::Internal => {}
        }
        let old_meta = old.get("metadata").cloned().unwrap_or_else(|| json!({}));
        let meta = metadata_mut(&mut obj);
        let managed: &[&str] = match part {
            Part::Internal => &["name", "namespace", "uid", "creationTimestamp"],
            _ => &["name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds"],
        };
        for field in managed {
            match old_meta.get(*field) {
                Some(v) => meta.insert((*field).into(), v.clone()),
                None => meta.remove(*field),
            };
        }
        let generation = old_meta.get("generation").and_then(Value::as_i64).unwrap_or(1);
        let bump = part == Part::Main && spec_part(&old) != spec_part(&obj);
        let meta = metadata_mut(&mut obj);
        meta.insert("generation".into(), json!(if bump { generation + 1 } else { generation }));
        if let Some(map) = obj.as_object_mut() {
            map.insert("apiVersion".into(), json!(key.rt.api_version()));
            map.insert("kind".into(), json!(key.rt.kind));
        }
        // A write that changes nothing is not a new version (as the real
        // server: a no-op update keeps the resourceVersion).
        metadata_mut(&mut obj).insert("resourceVersion".into(), old["metadata"]["resourceVersion"].clone());
        if obj == old {
            return Ok(old);
        }
        inner.rv += 1;
        metadata_mut(&mut obj).insert("resourceVersion".into(), json!(inner.rv.to_string()));
        inner.objects.insert(key.clone(), obj.clone());
        let change =
            Change { rv: inner.rv, key: key.clone(), kind: ChangeKind::Modified, old: Some(old), object: obj.clone() };
        self.record(inner, change);
        Ok(obj)
    }

    /// Removes an object now (a DELETED event whose object carries the
    /// deletion's version, as the real server's does).
    pub fn remove(&self, key: &ObjKey) -> Option<Value> {
        let mut inner = self.lock();
        let old = inner.objects.remove(key)?;
        inner.rv += 1;
        let mut obj = old.clone();
        metadata_mut(&mut obj).insert("resourceVersion".into(), json!(inner.rv.to_string()));
        let change = Change { rv: inner.rv, key: key.clone(), kind: ChangeKind::Deleted, old: Some(old), object: obj };
        self.record(&mut inner, change.clone());
        Some(change.object)
    }

    /// Removes an object if it is still the one `uid` names (not a new
    /// object of the same name).
    pub fn remove_if_uid(&self, key: &ObjKey, uid: &str) -> Option<Value> {
        let same = self.get(key).is_some_and(|o| o.pointer("/metadata/uid").and_then(Value::as_str) == Some(uid));
        if same { self.remove(key) } else { None }
    }

    /// Compacts the history to now: the version moves on (as other writes in
    /// etcd move it), every kept change is forgotten, and every open watch
    /// ends; a watch resumed from any earlier version gets 410.
    pub fn compact_now(&self) {
        let mut inner = self.lock();
        inner.rv += 1;
        inner.compacted = inner.rv;
        inner.history.clear();
        inner.epoch += 1;
        self.notify.send_replace((inner.rv, inner.epoch));
    }

    /// The changes after `rv`, or 410 if some of them were compacted away.
    pub fn since(&self, rv: u64) -> Result<Since, ApiError> {
        let inner = self.lock();
        if rv < inner.compacted {
            return Err(ApiError::Expired { requested: rv, oldest: inner.compacted });
        }
        let changes = inner.history.iter().filter(|c| c.rv > rv).cloned().collect();
        Ok(Since { changes, current: inner.rv, epoch: inner.epoch })
    }

    /// The matching objects and the version and epoch they are current at,
    /// read at once (a watch's synthetic ADDED events).
    pub fn snapshot(&self, rt: &Arc<ResourceType>, namespace: Option<&str>) -> (Vec<Value>, u64, u64) {
        let inner = self.lock();
        let items = inner
            .objects
            .iter()
            .filter(|(k, _)| &k.rt == rt && namespace.is_none_or(|ns| k.namespace == ns))
            .map(|(_, v)| v.clone())
            .collect();
        (items, inner.rv, inner.epoch)
    }
}

/// Which part of an object a write may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// A client's PUT/PATCH of the object: status kept if it is a subresource.
    Main,
    /// A client's write to `/status`: only status changes.
    Status,
    /// The fake's own controllers: anything, metadata included (the kubelet
    /// sets `deletionTimestamp` through this), generation untouched.
    Internal,
}
