//! The SandboxClaim controller (agent-sandbox's
//! `extensions/controllers/sandboxclaim_controller.go`): a claim adopts an
//! unclaimed warm Sandbox of its pool, or makes a cold one from the pool's
//! template, and mirrors its Sandbox's readiness.

use std::time::Duration;

use serde_json::{Map, Value, json};

use super::super::store::Part;
use super::extensions::{apply_secure_defaults, blueprint, has_ips, insert_labels, ready};
use super::{
    ASSIGNED_SANDBOX_ANNOTATION, CLAIM_UID_LABEL, CREATED_BY_LABEL, Controllers, EXT_GROUP, LAUNCH_TYPE_LABEL,
    POD_NAME_ANNOTATION, POD_TEMPLATE_HASH_LABEL, TEMPLATE_HASH_LABEL, TEMPLATE_REF_ANNOTATION,
    TEMPLATE_REF_HASH_LABEL, WARM_POOL_LABEL, condition, conditions_of, controlled_by, controller_of, deleting,
    find_condition, generation, map_at, name_hash, owner_ref, set_condition, str_at,
};

/// How long a new claim waits for a warm candidate to get a pod IP before
/// it starts a cold Sandbox (the real `warmCandidateGracePeriod`), and how
/// often it looks again meanwhile.
const WARM_CANDIDATE_GRACE: Duration = Duration::from_secs(2);
const WARM_CANDIDATE_RETRY: Duration = Duration::from_millis(500);

/// What a claim should do for want of a Sandbox of its own.
enum Candidate {
    Adopt(Value),
    /// Candidates exist but have no pod IP yet: look again in a while.
    Wait(Duration),
    Cold,
}

impl Controllers {
    /// Returns when to look again (a claim waiting for a warm candidate).
    pub(super) fn sync_claims(&self) -> Option<Duration> {
        let mut requeue: Option<Duration> = None;
        for claim in self.list("sandboxclaims") {
            if deleting(&claim) {
                continue;
            }
            let (sandbox, error) = match self.claim_sandbox(&claim) {
                Ok(Some(sb)) => (Some(sb), None),
                Ok(None) => continue,
                Err(ClaimError::Wait(after)) => {
                    requeue = Some(requeue.map_or(after, |r| r.min(after)));
                    continue;
                }
                Err(ClaimError::Failed { reason, message }) => (None, Some((reason, message))),
            };
            let generation = generation(&claim);
            let ready = match (&sandbox, &error) {
                (_, Some((reason, message))) => condition("Ready", false, reason, message, generation),
                (Some(sb), None) => match find_condition(sb, "Ready") {
                    Some(c) => {
                        let mut c = c.clone();
                        c["observedGeneration"] = json!(generation);
                        c
                    }
                    None => condition("Ready", false, "SandboxNotReady", "Sandbox is not ready", generation),
                },
                (None, None) => condition("Ready", false, "SandboxMissing", "Sandbox does not exist", generation),
            };
            let mut conditions = conditions_of(&claim);
            set_condition(&mut conditions, ready);
            let mut status = claim.get("status").cloned().filter(Value::is_object).unwrap_or_else(|| json!({}));
            status["conditions"] = json!(conditions);
            if let Some(sb) = &sandbox {
                let mut s = json!({ "name": str_at(sb, "/metadata/name") });
                if let Some(ips) =
                    sb.pointer("/status/podIPs").filter(|ips| ips.as_array().is_some_and(|a| !a.is_empty()))
                {
                    s["podIPs"] = ips.clone();
                }
                status["sandbox"] = s;
            }
            self.set_status("sandboxclaims", &claim, status);
        }
        requeue
    }

    /// The claim's Sandbox: the one it owns, else a warm one adopted, else
    /// a cold one made. `Ok(None)`: written something, look again.
    fn claim_sandbox(&self, claim: &Value) -> Result<Option<Value>, ClaimError> {
        let ns = str_at(claim, "/metadata/namespace").to_owned();
        let claim_name = str_at(claim, "/metadata/name").to_owned();
        let assigned =
            str_at(claim, &format!("/metadata/annotations/{}", ASSIGNED_SANDBOX_ANNOTATION.replace('/', "~1")));
        // The real controller finds its cold Sandbox by the status it wrote in
        // the same pass; the fake finds it by name (the claim's).
        for name in [str_at(claim, "/status/sandbox/name"), assigned, &claim_name] {
            if name.is_empty() {
                continue;
            }
            if let Some(sb) = self.get("sandboxes", &ns, name) {
                if controlled_by(&sb, claim) {
                    return Ok(Some(sb));
                }
                if name == assigned && adoptable(&sb) {
                    // An adoption begun and not finished: finish it.
                    self.complete_adoption(claim, &sb);
                    return Ok(None);
                }
            }
        }
        let pool_name = str_at(claim, "/spec/warmPoolRef/name");
        let pool = self.get("sandboxwarmpools", &ns, pool_name);
        let cold_only = claim.pointer("/spec/env").and_then(Value::as_array).is_some_and(|e| !e.is_empty())
            || claim.pointer("/spec/volumeClaimTemplates").and_then(Value::as_array).is_some_and(|v| !v.is_empty());
        let candidate = if cold_only { Candidate::Cold } else { self.candidate(claim, pool_name) };
        match candidate {
            Candidate::Adopt(sb) => {
                self.modify("sandboxclaims", claim, Part::Main, |c| {
                    let mut annotations = map_at(c, "/metadata/annotations");
                    annotations.insert(ASSIGNED_SANDBOX_ANNOTATION.into(), json!(str_at(&sb, "/metadata/name")));
                    c["metadata"]["annotations"] = json!(annotations);
                });
                self.complete_adoption(claim, &sb);
                Ok(None)
            }
            Candidate::Wait(after) => Err(ClaimError::Wait(after)),
            Candidate::Cold => {
                let Some(pool) = pool else {
                    return Err(ClaimError::failed(
                        "WarmPoolNotFound",
                        format!("SandboxWarmPool {pool_name:?} not found"),
                    ));
                };
                let Some(template) = self.template_of_pool(&pool) else {
                    return Err(ClaimError::failed(
                        "TemplateNotFound",
                        format!("SandboxTemplate {:?} not found", str_at(&pool, "/spec/sandboxTemplateRef/name")),
                    ));
                };
                let sandbox = cold_sandbox(claim, &template)?;
                match self.create("sandboxes", &ns, sandbox) {
                    Ok(_) => Ok(None),
                    Err(_) => Err(ClaimError::failed(
                        "SandboxCreatePending",
                        format!("Sandbox {claim_name:?} already exists and is not this claim's"),
                    )),
                }
            }
        }
    }

    /// `getCandidate`: an unclaimed member of the pool with a pod IP, a
    /// Ready one first; if some have no IP yet, a claim younger than the
    /// grace waits for them.
    fn candidate(&self, claim: &Value, pool_name: &str) -> Candidate {
        let ns = str_at(claim, "/metadata/namespace");
        let pool_hash = name_hash(pool_name);
        let mut members: Vec<Value> = self
            .list_in("sandboxes", ns)
            .into_iter()
            .filter(|sb| str_at(sb, &format!("/metadata/labels/{}", WARM_POOL_LABEL.replace('/', "~1"))) == pool_hash)
            .filter(adoptable)
            .collect();
        members.sort_by(|a, b| {
            str_at(a, "/metadata/creationTimestamp")
                .cmp(str_at(b, "/metadata/creationTimestamp"))
                .then_with(|| str_at(a, "/metadata/name").cmp(str_at(b, "/metadata/name")))
        });
        if let Some(sb) = members.iter().find(|sb| has_ips(sb) && ready(sb)) {
            return Candidate::Adopt(sb.clone());
        }
        if let Some(sb) = members.iter().find(|sb| has_ips(sb)) {
            return Candidate::Adopt(sb.clone());
        }
        if !members.is_empty() {
            let created = str_at(claim, "/metadata/creationTimestamp");
            let age = humantime::parse_rfc3339(created).ok().and_then(|t| t.elapsed().ok()).unwrap_or(Duration::MAX);
            if age < WARM_CANDIDATE_GRACE {
                return Candidate::Wait(WARM_CANDIDATE_RETRY.min(WARM_CANDIDATE_GRACE - age));
            }
        }
        Candidate::Cold
    }

    /// `completeAdoption`: the warm Sandbox becomes the claim's.
    fn complete_adoption(&self, claim: &Value, sb: &Value) {
        let ns = str_at(claim, "/metadata/namespace");
        let claim_uid = str_at(claim, "/metadata/uid").to_owned();
        let claim_created_by = map_at(claim, "/metadata/labels").get(CREATED_BY_LABEL).cloned();
        let template = self
            .get("sandboxwarmpools", ns, str_at(claim, "/spec/warmPoolRef/name"))
            .and_then(|pool| self.template_of_pool(&pool));
        let owner = owner_ref(claim);
        self.modify("sandboxes", sb, Part::Main, |sb| {
            let name = str_at(sb, "/metadata/name").to_owned();
            let mut labels = map_at(sb, "/metadata/labels");
            let mut ref_hash = labels.get(TEMPLATE_REF_HASH_LABEL).and_then(Value::as_str).unwrap_or("").to_owned();
            if ref_hash.is_empty()
                && let Some(t) = &template
            {
                ref_hash = name_hash(str_at(t, "/metadata/name"));
            }
            for key in [WARM_POOL_LABEL, POD_TEMPLATE_HASH_LABEL, TEMPLATE_HASH_LABEL] {
                labels.remove(key);
            }
            labels.insert(LAUNCH_TYPE_LABEL.into(), json!("warm"));
            let identity = |labels: &mut Map<String, Value>| {
                labels.insert(CLAIM_UID_LABEL.into(), json!(claim_uid));
                match &claim_created_by {
                    Some(v) if v.as_str() != Some("") => labels.insert(CREATED_BY_LABEL.into(), v.clone()),
                    _ => labels.remove(CREATED_BY_LABEL),
                };
            };
            identity(&mut labels);
            if !ref_hash.is_empty() {
                labels.insert(TEMPLATE_REF_HASH_LABEL.into(), json!(ref_hash));
            }
            sb["metadata"]["labels"] = json!(labels);
            sb["metadata"]["ownerReferences"] = json!([owner]);
            let mut annotations = map_at(sb, "/metadata/annotations");
            annotations.insert(POD_NAME_ANNOTATION.into(), json!(name));
            sb["metadata"]["annotations"] = json!(annotations);
            let mut meta = match &template {
                Some(t) => t.pointer("/spec/podTemplate/metadata").cloned().unwrap_or_else(|| json!({})),
                None => sb.pointer("/spec/podTemplate/metadata").cloned().unwrap_or_else(|| json!({})),
            };
            let mut pod_labels = map_at(&meta, "/labels");
            identity(&mut pod_labels);
            if !ref_hash.is_empty() {
                pod_labels.insert(TEMPLATE_REF_HASH_LABEL.into(), json!(ref_hash));
            }
            meta["labels"] = json!(pod_labels);
            sb["spec"]["podTemplate"]["metadata"] = meta;
        });
    }
}

/// `isAdoptable`: a live member of a warm pool, controlled by a
/// SandboxWarmPool, with the template-ref hash label.
fn adoptable(sb: &Value) -> bool {
    let labels = map_at(sb, "/metadata/labels");
    !deleting(sb)
        && labels.contains_key(WARM_POOL_LABEL)
        && labels.contains_key(TEMPLATE_REF_HASH_LABEL)
        && controller_of(sb).is_some_and(|r| {
            str_at(r, "/kind") == "SandboxWarmPool" && str_at(r, "/apiVersion").split('/').next() == Some(EXT_GROUP)
        })
}

enum ClaimError {
    Wait(Duration),
    Failed { reason: String, message: String },
}

impl ClaimError {
    fn failed(reason: &str, message: String) -> Self {
        Self::Failed { reason: reason.into(), message }
    }
}

/// `createSandbox`: a cold Sandbox named as the claim, from the template.
fn cold_sandbox(claim: &Value, template: &Value) -> Result<Value, ClaimError> {
    let claim_uid = str_at(claim, "/metadata/uid");
    let template_name = str_at(template, "/metadata/name");
    let ref_hash = name_hash(template_name);
    let mut spec = blueprint(template);
    if let Some(vcts) =
        claim.pointer("/spec/volumeClaimTemplates").filter(|v| v.as_array().is_some_and(|a| !a.is_empty()))
    {
        // Only the merge's simplest case: the claim's templates are added.
        let mut merged = spec.get("volumeClaimTemplates").and_then(Value::as_array).cloned().unwrap_or_default();
        merged.extend(vcts.as_array().into_iter().flatten().cloned());
        spec["volumeClaimTemplates"] = json!(merged);
    }
    let mut labels =
        json!({ CLAIM_UID_LABEL: claim_uid, LAUNCH_TYPE_LABEL: "cold", TEMPLATE_REF_HASH_LABEL: ref_hash });
    let mut pod_labels = vec![(CLAIM_UID_LABEL, claim_uid), (TEMPLATE_REF_HASH_LABEL, ref_hash.as_str())];
    let created_by = str_at(claim, &format!("/metadata/labels/{}", CREATED_BY_LABEL.replace('/', "~1")));
    if !created_by.is_empty() {
        labels[CREATED_BY_LABEL] = json!(created_by);
        pod_labels.push((CREATED_BY_LABEL, created_by));
    }
    insert_labels(&mut spec, "/podTemplate/metadata", &pod_labels);
    let env: Vec<Value> = claim.pointer("/spec/env").and_then(Value::as_array).cloned().unwrap_or_default();
    if !env.is_empty() {
        let policy = str_at(template, "/spec/envVarsInjectionPolicy");
        if !matches!(policy, "Allowed" | "Overrides") {
            return Err(ClaimError::failed(
                "EnvVarsInjectionRejected",
                "environment variable injection rejected: environment variable injection is not allowed by the template policy".into(),
            ));
        }
        let containers = spec["podTemplate"]["spec"]["containers"].as_array_mut();
        for (i, c) in containers.into_iter().flatten().enumerate() {
            let cname = str_at(c, "/name").to_owned();
            let mut list = c.get("env").and_then(Value::as_array).cloned().unwrap_or_default();
            for e in env.iter().filter(|e| {
                let target = str_at(e, "/containerName");
                target == cname || (target.is_empty() && i == 0)
            }) {
                let name = str_at(e, "/name");
                match list.iter_mut().find(|x| str_at(x, "/name") == name) {
                    Some(_) if policy == "Allowed" => {
                        return Err(ClaimError::failed(
                            "EnvVarsInjectionRejected",
                            format!("environment variable {name:?} is already defined by the template"),
                        ));
                    }
                    Some(existing) => *existing = json!({ "name": name, "value": str_at(e, "/value") }),
                    None => list.push(json!({ "name": name, "value": str_at(e, "/value") })),
                }
            }
            c["env"] = json!(list);
        }
    }
    apply_secure_defaults(template, &mut spec["podTemplate"]["spec"]);
    Ok(json!({
        "metadata": {
            "name": str_at(claim, "/metadata/name"),
            "labels": labels,
            "annotations": { TEMPLATE_REF_ANNOTATION: template_name },
            "ownerReferences": [owner_ref(claim)],
        },
        "spec": spec,
    }))
}
