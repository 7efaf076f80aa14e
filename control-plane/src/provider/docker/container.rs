//! One container per sandbox: its specification (pure, tested) and the
//! Engine API calls that create, start, stop and remove it.
//!
//! What a sandbox container is, and why:
//! - the image's entrypoint (`standby`) with the argument `hold`: the
//!   container's PID 1 keeps it alive between agents and reaps orphans
//!   (`agent/src/hold.rs`); each agent is an exec;
//! - the user 10001 (the image's `standby`), never privileged, every
//!   capability dropped and none added (the agent, its shell and its runs
//!   need none as a non-root user), `no-new-privileges`;
//! - no host path mounted, no port published, nothing in its environment:
//!   the credential comes with each exec, on its standard input;
//! - on the server's user-defined network, where the server is reached at
//!   the network's gateway address;
//! - limits from `--sandbox-cpus`, `--sandbox-memory` (and as much swap
//!   again: none beyond it) and `--sandbox-pids`;
//! - labelled with the sandbox id and the server's instance id, by which
//!   the server finds its own containers after a restart and never
//!   touches another's.

use std::collections::HashMap;
use std::time::Duration;

use bollard::Docker;
use bollard::errors::Error as DockerApiError;
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptions, RemoveContainerOptions, StartContainerOptions, StopContainerOptions,
};

use crate::provider::ProviderError;

/// Label naming the sandbox a container is.
pub const SANDBOX_LABEL: &str = "standby.sandbox";
/// Label naming the server instance that made it.
pub const INSTANCE_LABEL: &str = "standby.instance";
/// The uid:gid every sandbox runs as: the image's `standby` user.
pub const SANDBOX_USER: &str = "10001:10001";

/// Resource limits of each sandbox container (`None`: the engine's default,
/// none).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    /// CPUs (`--sandbox-cpus`, may be fractional).
    pub cpus: Option<f64>,
    /// Bytes of memory (`--sandbox-memory`).
    pub memory: Option<u64>,
    /// Processes and threads (`--sandbox-pids`).
    pub pids: Option<u64>,
}

/// The container name of a sandbox.
pub(super) fn name(sandbox_id: &str) -> String {
    format!("standby-{sandbox_id}")
}

/// What every sandbox container of a server shares.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape<'a> {
    pub network: &'a str,
    pub instance: &'a str,
    pub limits: Limits,
    /// The OCI runtime (`--sandbox-runtime`); the Engine's default when
    /// `None`.
    pub runtime: Option<&'a str>,
}

/// The specification of a sandbox's container.
pub(super) fn spec(image: &str, sandbox_id: &str, shape: Shape<'_>) -> ContainerCreateBody {
    let Shape { network, instance, limits, runtime } = shape;
    let labels = HashMap::from([
        (SANDBOX_LABEL.to_owned(), sandbox_id.to_owned()),
        (INSTANCE_LABEL.to_owned(), instance.to_owned()),
    ]);
    let memory = limits.memory.map(|bytes| i64::try_from(bytes).unwrap_or(i64::MAX));
    ContainerCreateBody {
        image: Some(image.to_owned()),
        cmd: Some(vec!["hold".to_owned()]),
        user: Some(SANDBOX_USER.to_owned()),
        labels: Some(labels),
        stop_signal: Some("SIGTERM".to_owned()),
        host_config: Some(HostConfig {
            privileged: Some(false),
            cap_drop: Some(vec!["ALL".to_owned()]),
            security_opt: Some(vec!["no-new-privileges".to_owned()]),
            network_mode: Some(network.to_owned()),
            nano_cpus: limits.cpus.map(|cpus| (cpus * 1e9).round() as i64),
            memory,
            memory_swap: memory,
            pids_limit: limits.pids.map(|pids| i64::try_from(pids).unwrap_or(i64::MAX)),
            init: Some(false),
            runtime: runtime.map(str::to_owned),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Whether a Docker API error is "no such container".
pub(super) fn not_found(error: &DockerApiError) -> bool {
    matches!(error, DockerApiError::DockerResponseServerError { status_code: 404, .. })
}

/// Whether a Docker API error is "already in that state" (start of a running
/// container, stop of a stopped one).
fn not_modified(error: &DockerApiError) -> bool {
    matches!(error, DockerApiError::DockerResponseServerError { status_code: 304, .. })
}

/// A failed Docker API call as a provider error naming the sandbox and what
/// could not be done.
pub(super) fn docker_api_failed(
    sandbox_id: &str,
    action: &'static str,
) -> impl FnOnce(DockerApiError) -> ProviderError {
    let sandbox = sandbox_id.to_owned();
    move |source| ProviderError::Docker { sandbox, action, source }
}

/// Creates the container (not started).
pub(super) async fn create(docker: &Docker, sandbox_id: &str, body: ContainerCreateBody) -> Result<(), ProviderError> {
    let options = CreateContainerOptions { name: Some(name(sandbox_id)), ..Default::default() };
    docker
        .create_container(Some(options), body)
        .await
        .map_err(docker_api_failed(sandbox_id, "create its container"))?;
    Ok(())
}

/// Starts the container; a running one is left as it is.
pub(super) async fn start(docker: &Docker, sandbox_id: &str) -> Result<(), ProviderError> {
    match docker.start_container(&name(sandbox_id), None::<StartContainerOptions>).await {
        Ok(()) => Ok(()),
        Err(error) if not_modified(&error) => Ok(()),
        Err(error) => Err(docker_api_failed(sandbox_id, "start its container")(error)),
    }
}

/// Stops the container: SIGTERM to its PID 1 (which passes it on), SIGKILL
/// after `grace`. Its filesystem is kept. A stopped or missing one is fine.
pub(super) async fn stop(docker: &Docker, sandbox_id: &str, grace: Duration) -> Result<(), ProviderError> {
    let t = i32::try_from(grace.as_secs_f64().ceil() as u64).unwrap_or(i32::MAX);
    match docker.stop_container(&name(sandbox_id), Some(StopContainerOptions { t: Some(t), signal: None })).await {
        Ok(()) => Ok(()),
        Err(error) if not_modified(&error) || not_found(&error) => Ok(()),
        Err(error) => Err(docker_api_failed(sandbox_id, "stop its container")(error)),
    }
}

/// Removes the container, running or not; a missing one is fine.
pub(super) async fn remove(docker: &Docker, sandbox_id: &str) -> Result<(), ProviderError> {
    let options = RemoveContainerOptions { force: true, v: true, ..Default::default() };
    match docker.remove_container(&name(sandbox_id), Some(options)).await {
        Ok(()) => Ok(()),
        Err(error) if not_found(&error) => Ok(()),
        Err(error) => Err(docker_api_failed(sandbox_id, "remove its container")(error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_container_is_unprivileged_unmounted_limited_and_labelled() {
        let limits = Limits { cpus: Some(1.5), memory: Some(512 << 20), pids: Some(256) };
        let shape = Shape { network: "standby-net", instance: "inst_a", limits, runtime: None };
        let body = spec("standby-sandbox:dev", "sbx_1", shape);
        assert_eq!(body.image.as_deref(), Some("standby-sandbox:dev"));
        assert_eq!(body.cmd, Some(vec!["hold".to_owned()]), "the image's entrypoint, as PID 1 between agents");
        assert_eq!(body.entrypoint, None, "the image's own entrypoint");
        assert_eq!(body.user.as_deref(), Some("10001:10001"));
        assert_eq!(body.env, None, "nothing, and no credential, in its configuration");
        let labels = body.labels.as_ref().expect("labels");
        assert_eq!(labels.get(SANDBOX_LABEL).map(String::as_str), Some("sbx_1"));
        assert_eq!(labels.get(INSTANCE_LABEL).map(String::as_str), Some("inst_a"));
        let host = body.host_config.as_ref().expect("a host config");
        assert_eq!(host.privileged, Some(false));
        assert_eq!(host.cap_drop, Some(vec!["ALL".to_owned()]));
        assert_eq!(host.cap_add, None, "no capability added back");
        assert_eq!(host.security_opt, Some(vec!["no-new-privileges".to_owned()]));
        assert!(host.binds.is_none() && host.mounts.is_none() && host.volumes_from.is_none(), "no host path");
        assert!(host.port_bindings.is_none() && host.publish_all_ports.is_none(), "no port published");
        assert_eq!(host.network_mode.as_deref(), Some("standby-net"));
        assert_eq!(host.nano_cpus, Some(1_500_000_000));
        assert_eq!(host.memory, Some(512 << 20));
        assert_eq!(host.memory_swap, Some(512 << 20), "no swap beyond the memory limit");
        assert_eq!(host.pids_limit, Some(256));
        assert_eq!(host.runtime, None, "the Engine's default runtime");
    }

    #[test]
    fn a_named_runtime_is_the_containers() {
        let shape = Shape { network: "n", instance: "i", limits: Limits::default(), runtime: Some("runsc") };
        let host = spec("image", "sbx_3", shape).host_config.expect("a host config");
        assert_eq!(host.runtime.as_deref(), Some("runsc"));
    }

    #[test]
    fn without_limits_the_engine_defaults_apply() {
        let shape = Shape { network: "n", instance: "inst", limits: Limits::default(), runtime: None };
        let body = spec("i", "sbx_2", shape);
        let host = body.host_config.expect("a host config");
        assert_eq!((host.nano_cpus, host.memory, host.pids_limit), (None, None, None));
        assert_eq!(name("sbx_2"), "standby-sbx_2");
    }
}
