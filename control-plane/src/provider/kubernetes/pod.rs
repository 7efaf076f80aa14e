//! What a sandbox is on Kubernetes, without IO: the operator's pod
//! template, checked and completed; the Pod and the workspace's
//! PersistentVolumeClaim made from it; their names and labels.
//!
//! The template is the operator's (`--kubernetes-pod-template`, a
//! PodTemplateSpec in YAML or JSON): the image, resources, node placement,
//! tolerations, its own non-secret environment. The server adds what the
//! contract needs and refuses what would weaken the sandbox:
//! - one container, run as `hold` (the image's `standby` as PID 1, between
//!   agents; every agent is an exec beside it, `exec.rs`);
//! - nothing secret: no `secretKeyRef`, no `envFrom` of a Secret, no
//!   Secret or projected volume, no service-account token
//!   (`automountServiceAccountToken: false`), no service links; the
//!   standby credential comes with each exec, on its standard input;
//! - at least as strict as a Docker sandbox: non-root, never privileged,
//!   every capability dropped and none added, no privilege escalation,
//!   seccomp `RuntimeDefault` (or a `Localhost` profile), no host
//!   namespace or host path;
//! - the workspace at [`WORKSPACE`] on a PersistentVolumeClaim of its own
//!   (Tier 1 deletes the Pod and keeps the claim);
//! - `restartPolicy: Never`: a sandbox whose PID 1 died is not restarted
//!   under a run; the server makes a new Pod on the same claim.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, Pod,
    PodSecurityContext, PodSpec, PodTemplateSpec, SeccompProfile, SecurityContext, Volume, VolumeMount,
    VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// Label naming the sandbox a Pod or claim is.
pub const SANDBOX_LABEL: &str = "standby.dev/sandbox";
/// Label naming the control plane that made it (every replica shares it).
pub const INSTANCE_LABEL: &str = "standby.dev/instance";
/// Label every sandbox Pod carries, for NetworkPolicies.
pub const ROLE_LABEL: &str = "standby.dev/role";
/// Annotation on a workspace claim: when its sandbox was stopped (RFC
/// 3339), the age the retention counts from.
pub const STOPPED_AT: &str = "standby.dev/stopped-at";
/// The workspace in every sandbox (the image's, as on Docker).
pub const WORKSPACE: &str = "/workspace";
/// The name of the workspace volume (and of agent-sandbox's claim
/// template); a template may not use it.
pub const WORKSPACE_VOLUME: &str = "workspace";
/// The uid and gid a template that sets none runs as: the image's `standby`.
const SANDBOX_UID: i64 = 10001;

/// Why a pod template is refused.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("cannot read the pod template {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the pod template {path} is not a PodTemplateSpec: {message}")]
    Parse { path: String, message: String },
    #[error("the pod template {path}: {problem}")]
    Refused { path: String, problem: String },
}

/// The Pod name of a sandbox: `standby-` and its id in DNS-1123 letters.
pub fn pod_name(sandbox_id: &str) -> String {
    format!("standby-{}", sandbox_id.to_ascii_lowercase().replace('_', "-"))
}

/// The workspace claim's name of a sandbox.
pub fn claim_name(sandbox_id: &str) -> String {
    format!("{}-workspace", pod_name(sandbox_id))
}

/// The default template: `image`, and nothing else of the operator's.
pub fn default_template(image: &str) -> PodTemplateSpec {
    PodTemplateSpec {
        metadata: None,
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "sandbox".to_owned(),
                image: Some(image.to_owned()),
                ..Default::default()
            }],
            ..Default::default()
        }),
    }
}

/// Reads a template file (YAML, of which JSON is a part) and checks it.
pub fn load_template(path: &Path, image: Option<&str>) -> Result<PodTemplateSpec, TemplateError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| TemplateError::Read { path: shown.clone(), source })?;
    let mut template: PodTemplateSpec = serde_saphyr::from_str(&text)
        .map_err(|error| TemplateError::Parse { path: shown.clone(), message: error.to_string() })?;
    if let Some(image) = image
        && let Some(container) = template.spec.as_mut().and_then(|spec| spec.containers.first_mut())
    {
        container.image = Some(image.to_owned());
    }
    check_template(&template).map_err(|problem| TemplateError::Refused { path: shown, problem })?;
    Ok(template)
}

/// Every refusal of a template, the first found; `Ok` when the server can
/// complete it into a sandbox at least as strict as a Docker one.
pub fn check_template(template: &PodTemplateSpec) -> Result<(), String> {
    let spec = template.spec.as_ref().ok_or("it has no `spec`")?;
    let [container] = spec.containers.as_slice() else {
        return Err(format!("it has {} containers; a sandbox is exactly one", spec.containers.len()));
    };
    if container.image.as_deref().is_none_or(str::is_empty) {
        return Err("its container has no `image` (or pass --image)".into());
    }
    if !spec.init_containers.as_ref().is_none_or(Vec::is_empty)
        || !spec.ephemeral_containers.as_ref().is_none_or(Vec::is_empty)
    {
        return Err("init and ephemeral containers are not supported in a sandbox".into());
    }
    if spec.host_network == Some(true) || spec.host_pid == Some(true) || spec.host_ipc == Some(true) {
        return Err("a sandbox may not share the node's network, PID or IPC namespace".into());
    }
    if spec.automount_service_account_token == Some(true) {
        return Err("`automountServiceAccountToken: true`: a sandbox holds no Kubernetes credential".into());
    }
    for volume in spec.volumes.iter().flatten() {
        if volume.name == WORKSPACE_VOLUME {
            return Err(format!("the volume name `{WORKSPACE_VOLUME}` is the server's (the workspace claim)"));
        }
        if volume.secret.is_some() || volume.projected.is_some() {
            return Err(format!("volume `{}`: no Secret or projected volume in a sandbox", volume.name));
        }
        if volume.host_path.is_some() {
            return Err(format!("volume `{}`: no host path in a sandbox", volume.name));
        }
    }
    for env in container.env.iter().flatten() {
        if standby_protocol::vars::CREDENTIAL.contains(&env.name.as_str()) {
            return Err(format!("env `{}`: the credential comes with each agent start, never in the spec", env.name));
        }
        if env.value_from.as_ref().is_some_and(|from| from.secret_key_ref.is_some()) {
            return Err(format!("env `{}`: no Secret in a sandbox's environment", env.name));
        }
    }
    if container.env_from.iter().flatten().any(|from| from.secret_ref.is_some()) {
        return Err("envFrom: no Secret in a sandbox's environment".into());
    }
    check_security(spec.security_context.as_ref(), container.security_context.as_ref())
}

fn check_security(pod: Option<&PodSecurityContext>, container: Option<&SecurityContext>) -> Result<(), String> {
    let root = |uid: Option<i64>| uid == Some(0);
    if let Some(pod) = pod {
        if pod.run_as_non_root == Some(false) || root(pod.run_as_user) {
            return Err("the pod's securityContext runs as root; a sandbox is non-root".into());
        }
        seccomp_allowed(pod.seccomp_profile.as_ref())?;
    }
    let Some(container) = container else { return Ok(()) };
    if container.privileged == Some(true) {
        return Err("a privileged container; a sandbox never is".into());
    }
    if container.allow_privilege_escalation == Some(true) {
        return Err("`allowPrivilegeEscalation: true`; a sandbox may not gain privileges".into());
    }
    if container.run_as_non_root == Some(false) || root(container.run_as_user) {
        return Err("the container's securityContext runs as root; a sandbox is non-root".into());
    }
    if let Some(capabilities) = &container.capabilities
        && !capabilities.add.as_ref().is_none_or(Vec::is_empty)
    {
        return Err("capabilities added; a sandbox has none".into());
    }
    seccomp_allowed(container.seccomp_profile.as_ref())
}

fn seccomp_allowed(profile: Option<&SeccompProfile>) -> Result<(), String> {
    match profile.map(|profile| profile.type_.as_str()) {
        None | Some("RuntimeDefault" | "Localhost") => Ok(()),
        Some(other) => Err(format!("seccomp profile `{other}`; a sandbox runs under RuntimeDefault or Localhost")),
    }
}

/// The labels of everything a sandbox is made of.
pub fn labels(sandbox_id: &str, instance: &str) -> BTreeMap<String, String> {
    let mut labels = instance_labels(instance);
    labels.insert(SANDBOX_LABEL.to_owned(), sandbox_id.to_owned());
    labels
}

/// The selector of everything this control plane made.
pub fn instance_selector(instance: &str) -> String {
    format!("{INSTANCE_LABEL}={instance}")
}

/// The labels of everything of this control plane's, before a sandbox
/// is known (agent-sandbox's warm Pods are made before any claim).
pub fn instance_labels(instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(INSTANCE_LABEL.to_owned(), instance.to_owned()), (ROLE_LABEL.to_owned(), "sandbox".to_owned())])
}

/// A checked template completed into every sandbox's Pod template: the
/// instance's labels, `hold`, the workspace mount (its volume is the
/// caller's: a claim of the sandbox's own, or agent-sandbox's claim
/// template of the same name) and the strict settings.
pub fn sandbox_template(template: &PodTemplateSpec, instance: &str, stop_grace_s: i64) -> PodTemplateSpec {
    let mut metadata = template.metadata.clone().unwrap_or_default();
    metadata.name = None;
    metadata.namespace = None;
    metadata.generate_name = None;
    metadata.labels.get_or_insert_with(BTreeMap::new).extend(instance_labels(instance));
    let mut spec = template.spec.clone().unwrap_or_default();
    spec.restart_policy = Some("Never".to_owned());
    spec.automount_service_account_token = Some(false);
    spec.enable_service_links = Some(false);
    spec.termination_grace_period_seconds = Some(stop_grace_s);
    let pod_security = spec.security_context.get_or_insert_with(Default::default);
    pod_security.run_as_non_root = Some(true);
    pod_security.run_as_user.get_or_insert(SANDBOX_UID);
    pod_security.run_as_group.get_or_insert(SANDBOX_UID);
    pod_security.fs_group.get_or_insert(SANDBOX_UID);
    pod_security.seccomp_profile.get_or_insert_with(runtime_default);
    if let Some(container) = spec.containers.first_mut() {
        container.args = Some(vec!["hold".to_owned()]);
        container.working_dir = Some(WORKSPACE.to_owned());
        container.stdin = Some(false);
        container.tty = Some(false);
        container.volume_mounts.get_or_insert_with(Vec::new).push(VolumeMount {
            name: WORKSPACE_VOLUME.to_owned(),
            mount_path: WORKSPACE.to_owned(),
            ..Default::default()
        });
        let security = container.security_context.get_or_insert_with(Default::default);
        security.privileged = Some(false);
        security.allow_privilege_escalation = Some(false);
        security.run_as_non_root = Some(true);
        let capabilities = security.capabilities.get_or_insert_with(Capabilities::default);
        capabilities.add = None;
        capabilities.drop = Some(vec!["ALL".to_owned()]);
    }
    PodTemplateSpec { metadata: Some(metadata), spec: Some(spec) }
}

/// The Pod of a sandbox from a checked template, on its own claim.
pub fn pod(template: &PodTemplateSpec, sandbox_id: &str, instance: &str, stop_grace_s: i64) -> Pod {
    let completed = sandbox_template(template, instance, stop_grace_s);
    let mut metadata = completed.metadata.unwrap_or_default();
    metadata.name = Some(pod_name(sandbox_id));
    metadata.labels.get_or_insert_with(BTreeMap::new).extend(labels(sandbox_id, instance));
    let mut spec = completed.spec.unwrap_or_default();
    spec.volumes.get_or_insert_with(Vec::new).push(Volume {
        name: WORKSPACE_VOLUME.to_owned(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: claim_name(sandbox_id),
            read_only: None,
        }),
        ..Default::default()
    });
    Pod { metadata, spec: Some(spec), status: None }
}

/// The workspace claim's spec: `size`, ReadWriteOnce, of `storage_class`
/// (the cluster's default when `None`).
pub fn claim_spec(size: &str, storage_class: Option<&str>) -> PersistentVolumeClaimSpec {
    PersistentVolumeClaimSpec {
        access_modes: Some(vec!["ReadWriteOnce".to_owned()]),
        storage_class_name: storage_class.map(str::to_owned),
        resources: Some(VolumeResourceRequirements {
            requests: Some(BTreeMap::from([("storage".to_owned(), Quantity(size.to_owned()))])),
            limits: None,
        }),
        ..Default::default()
    }
}

fn runtime_default() -> SeccompProfile {
    SeccompProfile { type_: "RuntimeDefault".to_owned(), localhost_profile: None }
}

/// The workspace claim of a sandbox.
pub fn claim(sandbox_id: &str, instance: &str, size: &str, storage_class: Option<&str>) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(claim_name(sandbox_id)),
            labels: Some(labels(sandbox_id, instance)),
            ..Default::default()
        },
        spec: Some(claim_spec(size, storage_class)),
        status: None,
    }
}

/// The sandbox a labelled object belongs to.
pub fn sandbox_of(metadata: &ObjectMeta) -> Option<&str> {
    metadata.labels.as_ref()?.get(SANDBOX_LABEL).map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(yaml: &str) -> PodTemplateSpec {
        serde_saphyr::from_str(yaml).expect("a template")
    }

    const PLAIN: &str = "spec:\n  containers:\n    - name: sandbox\n      image: standby-sandbox:1\n";

    #[test]
    fn a_sandbox_pod_is_strict_holds_no_credential_and_mounts_its_claim() {
        let pod = pod(&template(PLAIN), "sbx_ab12", "inst", 10);
        let meta = &pod.metadata;
        assert_eq!(meta.name.as_deref(), Some("standby-sbx-ab12"));
        let labels = meta.labels.as_ref().expect("labels");
        assert_eq!(labels.get(SANDBOX_LABEL).map(String::as_str), Some("sbx_ab12"));
        assert_eq!(labels.get(INSTANCE_LABEL).map(String::as_str), Some("inst"));
        assert_eq!(labels.get(ROLE_LABEL).map(String::as_str), Some("sandbox"));
        assert!(meta.annotations.is_none(), "nothing in annotations");
        let spec = pod.spec.as_ref().expect("a spec");
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.automount_service_account_token, Some(false));
        assert_eq!(spec.enable_service_links, Some(false));
        assert_eq!(spec.termination_grace_period_seconds, Some(10));
        let pod_security = spec.security_context.as_ref().expect("a pod security context");
        assert_eq!(pod_security.run_as_non_root, Some(true));
        assert_eq!(pod_security.run_as_user, Some(10001));
        assert_eq!(pod_security.seccomp_profile.as_ref().map(|p| p.type_.as_str()), Some("RuntimeDefault"));
        let container = &spec.containers[0];
        assert_eq!(container.args, Some(vec!["hold".to_owned()]));
        assert_eq!(container.env, None, "no environment of the server's, no credential");
        let security = container.security_context.as_ref().expect("a container security context");
        assert_eq!(security.privileged, Some(false));
        assert_eq!(security.allow_privilege_escalation, Some(false));
        let capabilities = security.capabilities.as_ref().expect("capabilities");
        assert_eq!(capabilities.drop, Some(vec!["ALL".to_owned()]));
        assert_eq!(capabilities.add, None);
        let volume = &spec.volumes.as_ref().expect("volumes")[0];
        let claim = volume.persistent_volume_claim.as_ref().expect("the workspace claim");
        assert_eq!(claim.claim_name, "standby-sbx-ab12-workspace");
        assert_eq!(container.volume_mounts.as_ref().expect("mounts")[0].mount_path, WORKSPACE);
    }

    #[test]
    fn the_operators_choices_are_kept_and_an_explicit_uid_wins() {
        let yaml = "metadata:\n  labels: {team: a}\nspec:\n  nodeSelector: {pool: sandboxes}\n  securityContext: {runAsUser: 2000}\n  containers:\n    - name: box\n      image: img\n      env: [{name: GOFLAGS, value: -mod=mod}]\n      resources: {limits: {memory: 2Gi}}\n";
        let pod = pod(&template(yaml), "sbx_1", "i", 30);
        assert_eq!(pod.metadata.labels.as_ref().and_then(|l| l.get("team")).map(String::as_str), Some("a"));
        let spec = pod.spec.expect("a spec");
        assert!(spec.node_selector.is_some());
        assert_eq!(spec.security_context.and_then(|s| s.run_as_user), Some(2000));
        let container = &spec.containers[0];
        assert_eq!(container.env.as_ref().map(Vec::len), Some(1));
        assert!(container.resources.is_some());
    }

    #[test]
    fn a_template_weaker_than_a_docker_sandbox_is_refused_naming_why() {
        let refused = |yaml: &str| check_template(&template(yaml)).expect_err(yaml);
        let with =
            |container_extra: &str| format!("spec:\n  containers:\n    - name: c\n      image: i\n{container_extra}");
        assert!(refused(&with("      securityContext: {privileged: true}\n")).contains("privileged"));
        assert!(refused(&with("      securityContext: {allowPrivilegeEscalation: true}\n")).contains("Escalation"));
        assert!(refused(&with("      securityContext: {runAsUser: 0}\n")).contains("root"));
        assert!(refused(&with("      securityContext: {capabilities: {add: [NET_ADMIN]}}\n")).contains("capabilities"));
        assert!(refused(&with("      securityContext: {seccompProfile: {type: Unconfined}}\n")).contains("Unconfined"));
        let secret_env = "      env: [{name: K, valueFrom: {secretKeyRef: {name: s, key: k}}}]\n";
        assert!(refused(&with(secret_env)).contains("Secret"));
        assert!(refused(&with("      env: [{name: STANDBY_TOKEN, value: x}]\n")).contains("credential"));
        assert!(refused(&with("      envFrom: [{secretRef: {name: s}}]\n")).contains("Secret"));
        let two = "spec:\n  containers:\n    - {name: a, image: i}\n    - {name: b, image: i}\n";
        assert!(refused(two).contains("2 containers"));
        let host = "spec:\n  hostNetwork: true\n  containers: [{name: a, image: i}]\n";
        assert!(refused(host).contains("namespace"));
        let token = "spec:\n  automountServiceAccountToken: true\n  containers: [{name: a, image: i}]\n";
        assert!(refused(token).contains("credential"));
        let secret_volume =
            "spec:\n  volumes: [{name: v, secret: {secretName: s}}]\n  containers: [{name: a, image: i}]\n";
        assert!(refused(secret_volume).contains("Secret"));
        let workspace = "spec:\n  volumes: [{name: workspace, emptyDir: {}}]\n  containers: [{name: a, image: i}]\n";
        assert!(refused(workspace).contains("server's"));
        assert!(refused("spec:\n  containers: [{name: a}]\n").contains("image"));
    }

    #[test]
    fn a_claim_asks_for_its_size_once_for_its_sandbox() {
        let claim = claim("sbx_1", "i", "5Gi", Some("fast"));
        assert_eq!(claim.metadata.name.as_deref(), Some("standby-sbx-1-workspace"));
        let spec = claim.spec.expect("a spec");
        assert_eq!(spec.access_modes, Some(vec!["ReadWriteOnce".to_owned()]));
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        let requests = spec.resources.and_then(|r| r.requests).expect("requests");
        assert_eq!(requests.get("storage"), Some(&Quantity("5Gi".to_owned())));
        assert_eq!(sandbox_of(&claim.metadata), Some("sbx_1"));
    }
}
