//! The SandboxTemplate and SandboxWarmPool controllers (agent-sandbox's
//! `extensions/controllers/sandbox{template,warmpool}_controller.go`):
//! a template's managed NetworkPolicy, a pool's unclaimed Sandboxes; and
//! what the claim controller shares with them.

use serde_json::{Value, json};

use super::super::store::Part;
use super::{
    CREATED_BY_LABEL, Controllers, LAUNCH_TYPE_LABEL, POD_TEMPLATE_HASH_LABEL, TEMPLATE_HASH_LABEL,
    TEMPLATE_REF_ANNOTATION, TEMPLATE_REF_HASH_LABEL, WARM_POOL_LABEL, controlled_by, deleting, find_condition,
    generation, map_at, name_hash, owner_ref, str_at,
};

pub(super) fn ready(sb: &Value) -> bool {
    find_condition(sb, "Ready").is_some_and(|c| str_at(c, "/status") == "True")
}

pub(super) fn has_ips(sb: &Value) -> bool {
    sb.pointer("/status/podIPs").and_then(Value::as_array).is_some_and(|ips| !ips.is_empty())
}

/// The NetworkPolicy rules of agent-sandbox's "secure default": ingress
/// only from the sandbox router, egress to the public internet only.
pub(super) fn default_network_policy_rules() -> (Value, Value) {
    let ingress = json!([{ "from": [{
        "namespaceSelector": { "matchLabels": { "kubernetes.io/metadata.name": "agent-sandbox-system" } },
        "podSelector": { "matchLabels": { "app": "sandbox-router" } },
    }] }]);
    let egress = json!([{ "to": [
        { "ipBlock": { "cidr": "0.0.0.0/0",
                       "except": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"] } },
        { "ipBlock": { "cidr": "::/0", "except": ["fc00::/7", "fe80::/10"] } },
    ] }]);
    (ingress, egress)
}

/// `ApplySandboxSecureDefaults`: no service account token unless asked for;
/// under the template's default NetworkPolicy, public DNS servers instead
/// of the cluster's (unless the template sets a `dnsPolicy`).
pub(super) fn apply_secure_defaults(template: &Value, spec: &mut Value) {
    if spec.get("automountServiceAccountToken").is_none_or(Value::is_null) {
        spec["automountServiceAccountToken"] = json!(false);
    }
    let management = str_at(template, "/spec/networkPolicyManagement");
    let secure_default =
        matches!(management, "" | "Managed") && template.pointer("/spec/networkPolicy").is_none_or(Value::is_null);
    if secure_default && str_at(spec, "/dnsPolicy").is_empty() {
        spec["dnsPolicy"] = json!("None");
        spec["dnsConfig"] = json!({ "nameservers": ["8.8.8.8", "1.1.1.1"] });
    }
}

/// The template's SandboxBlueprint: what a Sandbox's spec copies.
pub(super) fn blueprint(template: &Value) -> Value {
    let mut spec = json!({
        "podTemplate": template.pointer("/spec/podTemplate").cloned().unwrap_or_else(|| json!({ "spec": {} })),
    });
    for field in ["volumeClaimTemplates", "service"] {
        if let Some(v) = template.pointer(&format!("/spec/{field}")) {
            spec[field] = v.clone();
        }
    }
    spec
}

/// Adds `labels` to the `labels` of the metadata object at `meta`
/// (a JSON pointer), making the objects on the way.
pub(super) fn insert_labels(obj: &mut Value, meta: &str, labels: &[(&str, &str)]) {
    let mut cur = obj;
    for part in meta.split('/').filter(|p| !p.is_empty()).chain(["labels"]) {
        if !cur.is_object() {
            *cur = json!({});
        }
        cur = cur.as_object_mut().expect("made an object above").entry(part).or_insert_with(|| json!({}));
    }
    if !cur.is_object() {
        *cur = json!({});
    }
    for (k, v) in labels {
        cur[*k] = json!(v);
    }
}

impl Controllers {
    pub(super) fn sync_templates(&self) {
        for template in self.list("sandboxtemplates") {
            if deleting(&template) {
                continue;
            }
            let ns = str_at(&template, "/metadata/namespace").to_owned();
            let name = str_at(&template, "/metadata/name").to_owned();
            let hash = name_hash(&name);
            if map_at(&template, "/metadata/labels").get(TEMPLATE_REF_HASH_LABEL).and_then(Value::as_str)
                != Some(hash.as_str())
            {
                self.modify("sandboxtemplates", &template, Part::Main, |t| {
                    insert_labels(t, "/metadata", &[(TEMPLATE_REF_HASH_LABEL, &hash)]);
                });
            }
            let np_name = format!("{name}-network-policy");
            let existing = self.get("networkpolicies", &ns, &np_name);
            if str_at(&template, "/spec/networkPolicyManagement") == "Unmanaged" {
                if existing.is_some_and(|np| controlled_by(&np, &template)) {
                    self.delete("networkpolicies", &ns, &np_name);
                }
                continue;
            }
            let mut spec = json!({
                "podSelector": { "matchLabels": { TEMPLATE_REF_HASH_LABEL: hash } },
                "policyTypes": ["Ingress", "Egress"],
            });
            match template.pointer("/spec/networkPolicy").filter(|p| !p.is_null()) {
                None => {
                    let (ingress, egress) = default_network_policy_rules();
                    spec["ingress"] = ingress;
                    spec["egress"] = egress;
                }
                Some(custom) => {
                    for field in ["ingress", "egress"] {
                        if let Some(rules) = custom.get(field).filter(|r| r.as_array().is_some_and(|a| !a.is_empty())) {
                            spec[field] = rules.clone();
                        }
                    }
                }
            }
            match existing {
                None => {
                    let np = json!({
                        "metadata": { "name": np_name, "ownerReferences": [owner_ref(&template)] },
                        "spec": spec,
                    });
                    let _ = self.create("networkpolicies", &ns, np);
                }
                Some(np) if controlled_by(&np, &template) && np.get("spec") != Some(&spec) => {
                    self.modify("networkpolicies", &np, Part::Main, |np| np["spec"] = spec);
                }
                Some(_) => {}
            }
        }
    }

    pub(super) fn template_of_pool(&self, pool: &Value) -> Option<Value> {
        let name = str_at(pool, "/spec/sandboxTemplateRef/name");
        self.get("sandboxtemplates", str_at(pool, "/metadata/namespace"), name)
    }

    pub(super) fn sync_pools(&self) {
        for pool in self.list("sandboxwarmpools") {
            if deleting(&pool) {
                continue;
            }
            let ns = str_at(&pool, "/metadata/namespace").to_owned();
            let pool_name = str_at(&pool, "/metadata/name").to_owned();
            let pool_hash = name_hash(&pool_name);
            let members: Vec<Value> = self
                .list_in("sandboxes", &ns)
                .into_iter()
                .filter(|sb| {
                    str_at(sb, &format!("/metadata/labels/{}", WARM_POOL_LABEL.replace('/', "~1"))) == pool_hash
                })
                .filter(|sb| controlled_by(sb, &pool))
                .collect();
            let terminating = members.iter().filter(|sb| deleting(sb)).count();
            let mut active: Vec<Value> = members.into_iter().filter(|sb| !deleting(sb)).collect();
            let desired = pool.pointer("/spec/replicas").and_then(Value::as_u64).unwrap_or(1) as usize;
            let template = self.template_of_pool(&pool);
            if let Some(template) = &template
                && active.len() + terminating < desired
            {
                for _ in active.len() + terminating..desired {
                    let _ = self.create("sandboxes", &ns, self.pool_sandbox(&pool, template));
                }
            }
            if active.len() > desired {
                // Unready first, then the newest.
                active.sort_by(|a, b| {
                    ready(a).cmp(&ready(b)).then_with(|| {
                        str_at(b, "/metadata/creationTimestamp").cmp(str_at(a, "/metadata/creationTimestamp"))
                    })
                });
                for sb in &active[..active.len() - desired] {
                    self.delete("sandboxes", &ns, str_at(sb, "/metadata/name"));
                }
            }
            let mut status = pool.get("status").cloned().filter(Value::is_object).unwrap_or_else(|| json!({}));
            status["replicas"] = json!(active.len());
            status["readyReplicas"] = json!(active.iter().filter(|sb| ready(sb)).count());
            status["selector"] = json!(format!("{WARM_POOL_LABEL}={pool_hash}"));
            status["observedGeneration"] = json!(generation(&pool));
            self.set_status("sandboxwarmpools", &pool, status);
        }
    }

    /// `buildSandboxCR`: a pool member from the template.
    fn pool_sandbox(&self, pool: &Value, template: &Value) -> Value {
        let pool_name = str_at(pool, "/metadata/name");
        let template_name = str_at(template, "/metadata/name");
        let pool_hash = name_hash(pool_name);
        let ref_hash = name_hash(template_name);
        let pod_template = template.pointer("/spec/podTemplate").cloned().unwrap_or_default();
        // Not the real hashes (those hash Go's JSON encoding of the
        // structs), but hashes of the same content.
        let pod_template_hash = name_hash(&pod_template.to_string());
        let blueprint_hash = name_hash(&blueprint(template).to_string());
        let mut spec = blueprint(template);
        insert_labels(
            &mut spec,
            "/podTemplate/metadata",
            &[
                (WARM_POOL_LABEL, &pool_hash),
                (TEMPLATE_REF_HASH_LABEL, &ref_hash),
                (POD_TEMPLATE_HASH_LABEL, &pod_template_hash),
                (TEMPLATE_HASH_LABEL, &blueprint_hash),
            ],
        );
        apply_secure_defaults(template, &mut spec["podTemplate"]["spec"]);
        json!({
            "metadata": {
                "generateName": format!("{pool_name}-"),
                "labels": {
                    WARM_POOL_LABEL: pool_hash,
                    TEMPLATE_REF_HASH_LABEL: ref_hash,
                    LAUNCH_TYPE_LABEL: "warm",
                    POD_TEMPLATE_HASH_LABEL: pod_template_hash,
                    TEMPLATE_HASH_LABEL: blueprint_hash,
                    CREATED_BY_LABEL: "controller",
                },
                "annotations": { TEMPLATE_REF_ANNOTATION: template_name },
                "ownerReferences": [owner_ref(pool)],
            },
            "spec": spec,
        })
    }
}
