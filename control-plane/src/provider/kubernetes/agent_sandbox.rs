//! Agent-sandbox mode (`--kubernetes-api agent-sandbox`): the sandboxes
//! are kubernetes-sigs/agent-sandbox's (v1beta1). At its start the server
//! applies a SandboxTemplate of the operator's completed pod template and a
//! SandboxWarmPool of it; each standby sandbox is then a SandboxClaim of
//! that pool that carries no environment: the claim adopts a warm Sandbox
//! (its Pod already started) and the server binds the run's credential and
//! environment over its own socket after adoption, as for any standby. The
//! warm start with per-run secrets that agent-sandbox alone cannot give
//! (a claim with env is cold-started, and has no run-scoped credential).
//!
//! - the Sandbox's Pod is named after the Sandbox (the claim's
//!   `status.sandbox.name`); every agent start is an exec in it, as with
//!   plain Pods;
//! - Tier 1 is the Sandbox's `operatingMode: Suspended` (its Pod deleted,
//!   its workspace claim kept) and a resume sets it `Running` again;
//! - a retired sandbox's SandboxClaim is deleted, and the Sandbox with it;
//! - the template forbids env injection by claims, and its managed
//!   NetworkPolicy allows what an agent needs: the server's port in this
//!   namespace, DNS, and the internet but for private and link-local
//!   addresses (agent-sandbox's default blocks private addresses, which
//!   would cut agents off an in-cluster control plane).

use k8s_openapi::api::core::v1::PodTemplateSpec;
use kube::Api;
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::pod::{self, WORKSPACE_VOLUME};

const GROUP: &str = "agents.x-k8s.io";
const EXTENSIONS: &str = "extensions.agents.x-k8s.io";
const VERSION: &str = "v1beta1";
/// The field manager of what the server applies.
const MANAGER: &str = "standby-server";
/// The address ranges a sandbox may not reach: private, link-local (cloud
/// metadata) and their IPv6 counterparts.
const PRIVATE_V4: [&str; 4] = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"];
const PRIVATE_V6: [&str; 2] = ["fc00::/7", "fe80::/10"];

fn resource(group: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, VERSION, kind), plural)
}

/// The SandboxClaims, which the provider watches.
pub(super) fn claims_resource() -> ApiResource {
    resource(EXTENSIONS, "SandboxClaim", "sandboxclaims")
}

/// The names of what one control plane applies: one template, one pool.
pub(super) fn pool_name(instance: &str) -> String {
    format!("standby-{instance}")
}

/// The SandboxTemplate: the completed pod template, a workspace claim
/// template, no env injection by claims, and the NetworkPolicy an agent
/// needs.
pub(super) fn template_object(
    name: &str,
    completed: &PodTemplateSpec,
    instance: &str,
    claim: (&str, Option<&str>),
    server_port: u16,
) -> Value {
    let (size, storage_class) = claim;
    let metadata = completed.metadata.clone().unwrap_or_default();
    json!({
        "apiVersion": format!("{EXTENSIONS}/{VERSION}"),
        "kind": "SandboxTemplate",
        "metadata": {"name": name, "labels": pod::instance_labels(instance)},
        "spec": {
            "podTemplate": {
                "metadata": {"labels": metadata.labels, "annotations": metadata.annotations},
                "spec": completed.spec,
            },
            "volumeClaimTemplates": [{
                "metadata": {"name": WORKSPACE_VOLUME, "labels": pod::instance_labels(instance)},
                "spec": pod::claim_spec(size, storage_class),
            }],
            "envVarsInjectionPolicy": "Disallowed",
            "networkPolicyManagement": "Managed",
            "networkPolicy": {"ingress": [], "egress": egress(server_port)},
        },
    })
}

/// What a sandbox may reach: the server's port on this namespace's Pods
/// (sandboxes take no ingress, so only the server answers there), the
/// cluster's DNS, and public addresses.
fn egress(server_port: u16) -> Value {
    json!([
        {"to": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": server_port}]},
        {
            "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
        },
        {"to": [
            {"ipBlock": {"cidr": "0.0.0.0/0", "except": PRIVATE_V4}},
            {"ipBlock": {"cidr": "::/0", "except": PRIVATE_V6}}
        ]}
    ])
}

/// The SandboxWarmPool of `replicas` Sandboxes of the template.
pub(super) fn pool_object(name: &str, instance: &str, replicas: u32) -> Value {
    json!({
        "apiVersion": format!("{EXTENSIONS}/{VERSION}"),
        "kind": "SandboxWarmPool",
        "metadata": {"name": name, "labels": pod::instance_labels(instance)},
        "spec": {"replicas": replicas, "sandboxTemplateRef": {"name": name}},
    })
}

/// A sandbox's claim: of the pool, labelled, and without any env.
pub(super) fn claim_object(sandbox_id: &str, instance: &str, pool: &str) -> Value {
    json!({
        "apiVersion": format!("{EXTENSIONS}/{VERSION}"),
        "kind": "SandboxClaim",
        "metadata": {"name": pod::pod_name(sandbox_id), "labels": pod::labels(sandbox_id, instance)},
        "spec": {"warmPoolRef": {"name": pool}},
    })
}

/// The Sandbox a claim was bound to (its Pod has its name).
pub(super) fn bound_sandbox(claim: &DynamicObject) -> Option<String> {
    let name = claim.data.pointer("/status/sandbox/name")?.as_str()?;
    (!name.is_empty()).then(|| name.to_owned())
}

/// The agent-sandbox objects of one control plane.
#[derive(Debug)]
pub(super) struct AgentSandbox {
    claims: Api<DynamicObject>,
    sandboxes: Api<DynamicObject>,
    pool: String,
}

impl AgentSandbox {
    /// Applies the template and the pool (server-side apply: a restarted
    /// server or another replica applies the same).
    pub(super) async fn apply(
        client: &kube::Client,
        namespace: &str,
        instance: &str,
        template: Value,
        replicas: u32,
    ) -> Result<Self, kube::Error> {
        let name = pool_name(instance);
        let apply = PatchParams::apply(MANAGER).force();
        let templates: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            namespace,
            &resource(EXTENSIONS, "SandboxTemplate", "sandboxtemplates"),
        );
        templates.patch(&name, &apply, &Patch::Apply(&template)).await?;
        let pools: Api<DynamicObject> = Api::namespaced_with(
            client.clone(),
            namespace,
            &resource(EXTENSIONS, "SandboxWarmPool", "sandboxwarmpools"),
        );
        pools.patch(&name, &apply, &Patch::Apply(&pool_object(&name, instance, replicas))).await?;
        Ok(Self {
            claims: Api::namespaced_with(client.clone(), namespace, &claims_resource()),
            sandboxes: Api::namespaced_with(client.clone(), namespace, &resource(GROUP, "Sandbox", "sandboxes")),
            pool: name,
        })
    }

    /// Claims a Sandbox of the pool for `sandbox_id`; an existing claim is fine.
    pub(super) async fn claim(&self, sandbox_id: &str, instance: &str) -> Result<(), kube::Error> {
        let claim: DynamicObject =
            serde_json::from_value(claim_object(sandbox_id, instance, &self.pool)).map_err(kube::Error::SerdeError)?;
        match self.claims.create(&PostParams::default(), &claim).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// Sets a Sandbox's `operatingMode` (`Running`, `Suspended`).
    pub(super) async fn set_mode(&self, sandbox: &str, mode: &str) -> Result<(), kube::Error> {
        let patch = json!({"spec": {"operatingMode": mode}});
        self.sandboxes.patch(sandbox, &PatchParams::default(), &Patch::Merge(&patch)).await.map(drop)
    }

    /// Stamps a sandbox's claim with the time it stopped.
    pub(super) async fn stamp_stopped(&self, sandbox_id: &str, now: &str) -> Result<(), kube::Error> {
        let patch = json!({"metadata": {"annotations": {pod::STOPPED_AT: now}}});
        match self.claims.patch(&pod::pod_name(sandbox_id), &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// Deletes a sandbox's claim; the Sandbox it owns goes with it.
    pub(super) async fn release(&self, sandbox_id: &str) -> Result<(), kube::Error> {
        match self.claims.delete(&pod::pod_name(sandbox_id), &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(error) => Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_forbids_env_from_claims_and_lets_agents_reach_the_server_but_no_private_address() {
        let template = pod::sandbox_template(&pod::default_template("img"), "inst", 10);
        let object = template_object("standby-inst", &template, "inst", ("5Gi", None), 8080);
        let spec = &object["spec"];
        assert_eq!(spec["envVarsInjectionPolicy"], "Disallowed");
        assert_eq!(spec["podTemplate"]["spec"]["containers"][0]["args"], json!(["hold"]));
        assert_eq!(spec["podTemplate"]["metadata"]["labels"]["standby.dev/instance"], "inst");
        assert!(spec["podTemplate"]["spec"]["volumes"].is_null(), "the workspace volume comes from the claim template");
        assert_eq!(spec["volumeClaimTemplates"][0]["metadata"]["name"], WORKSPACE_VOLUME);
        let egress = &spec["networkPolicy"]["egress"];
        assert_eq!(egress[0]["ports"][0]["port"], 8080, "the server's port");
        let public = &egress[2]["to"][0]["ipBlock"];
        assert_eq!(public["cidr"], "0.0.0.0/0");
        assert_eq!(public["except"], json!(PRIVATE_V4), "no private or metadata address");
        assert_eq!(spec["networkPolicy"]["ingress"], json!([]), "nothing reaches a sandbox");
    }

    #[test]
    fn a_claim_carries_no_env_and_names_its_sandbox() {
        let claim = claim_object("sbx_ab", "inst", "standby-inst");
        assert_eq!(claim["metadata"]["name"], "standby-sbx-ab");
        assert_eq!(claim["metadata"]["labels"]["standby.dev/sandbox"], "sbx_ab");
        assert_eq!(claim["spec"], json!({"warmPoolRef": {"name": "standby-inst"}}), "nothing but the pool");
        let bound: DynamicObject =
            serde_json::from_value(json!({"apiVersion": "extensions.agents.x-k8s.io/v1beta1", "kind": "SandboxClaim",
                "metadata": {"name": "c"}, "status": {"sandbox": {"name": "standby-inst-x7"}}}))
            .expect("a claim");
        assert_eq!(bound_sandbox(&bound).as_deref(), Some("standby-inst-x7"));
    }
}
