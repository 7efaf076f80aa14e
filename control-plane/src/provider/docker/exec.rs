//! An agent start in a sandbox container: an Engine API exec of `standby`
//! with the contract's variables, and the standby credential written to the
//! exec's standard input (`STANDBY_TOKEN_FILE=/dev/stdin`, contract
//! amendment 3), then closed. The credential is in no image, no container
//! configuration and no exec configuration: only in the agent's memory.
//!
//! The exec's output (the agent's log) is appended to a file of the
//! server's; its end is the agent's end, and its exit code is read from
//! the engine then.

use std::path::PathBuf;
use std::time::Duration;

use bollard::Docker;
use bollard::exec::{CreateExecOptions, StartExecResults};
use futures::StreamExt as _;
use standby_protocol::vars;
use tokio::io::AsyncWriteExt as _;
use tokio::sync::{oneshot, watch};

use super::container::{docker_api_failed, name};
use crate::provider::{AgentLaunch, ProviderError};

/// The agent in the image (`Dockerfile.sandbox`).
pub const AGENT_PATH: &str = "/usr/local/bin/standby";
/// The workspace in the image.
const WORKSPACE: &str = "/workspace";
/// How often an agent's end is looked for once its output stream closed
/// before the engine says it ended (the engine's own connection dropped).
const EXIT_POLL: Duration = Duration::from_millis(200);

/// The contract's variables of an exec'd agent; never the credential.
pub(super) fn agent_env(launch: &AgentLaunch) -> Vec<String> {
    let mut env = vec![
        format!("{}={}", vars::SERVER_URL, launch.server_url),
        format!("{}=/dev/stdin", vars::TOKEN_FILE),
        format!("{}={WORKSPACE}", vars::WORKSPACE),
        format!("{}={}", vars::HEARTBEAT_INTERVAL, humantime::format_duration(launch.heartbeat_interval)),
        format!("{}={}", vars::LOG, launch.log_filter),
    ];
    if let Some(endpoint) = &launch.otlp_endpoint {
        env.push(format!("{}={endpoint}", vars::OTLP_ENDPOINT));
    }
    // The server is reached at its address on the sandboxes' own bridge
    // network, which is not loopback: plain http there is allowed only by
    // saying so (docs/deploy.md, "Docker provider").
    if launch.server_url.starts_with("http://") {
        env.push("STANDBY_INSECURE=true".to_owned());
    }
    env
}

/// A started agent: its exec id and the notices of its end.
#[derive(Debug)]
pub(super) struct Started {
    pub exec_id: String,
    pub done: watch::Receiver<bool>,
    pub exited: oneshot::Receiver<Option<i32>>,
}

/// Starts the agent in the (running) container and hands it `launch`'s
/// credential; its output goes to `log`.
pub(super) async fn start_agent(
    docker: &Docker,
    sandbox_id: &str,
    launch: &AgentLaunch,
    log: PathBuf,
) -> Result<Started, ProviderError> {
    let options = CreateExecOptions {
        cmd: Some(vec![AGENT_PATH.to_owned()]),
        env: Some(agent_env(launch)),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        working_dir: Some(WORKSPACE.to_owned()),
        ..Default::default()
    };
    let created = docker
        .create_exec(&name(sandbox_id), options)
        .await
        .map_err(docker_api_failed(sandbox_id, "create the agent's exec"))?;
    let started =
        docker.start_exec(&created.id, None).await.map_err(docker_api_failed(sandbox_id, "start the agent's exec"))?;
    let StartExecResults::Attached { mut output, mut input } = started else {
        return Err(ProviderError::Docker {
            sandbox: sandbox_id.to_owned(),
            action: "attach to the agent's exec",
            source: bollard::errors::Error::DockerResponseServerError {
                status_code: 0,
                message: "the exec started detached".to_owned(),
            },
        });
    };
    let io = |source| ProviderError::Io {
        sandbox: sandbox_id.to_owned(),
        action: "hand the credential to",
        path: PathBuf::from("/dev/stdin"),
        source,
    };
    input.write_all(launch.token.expose().as_bytes()).await.map_err(io)?;
    input.shutdown().await.map_err(io)?;
    drop(input);
    let (done_tx, done) = watch::channel(false);
    let (exit_tx, exited) = oneshot::channel();
    let exec_id = created.id.clone();
    let docker = docker.clone();
    let id = sandbox_id.to_owned();
    tokio::spawn(async move {
        let mut file = tokio::fs::OpenOptions::new().create(true).append(true).open(&log).await.ok();
        while let Some(chunk) = output.next().await {
            let Ok(chunk) = chunk else { break };
            if let Some(file) = file.as_mut() {
                let _ = file.write_all(&chunk.into_bytes()).await;
            }
        }
        let code = exit_code(&docker, &exec_id).await;
        tracing::info!(sandbox_id = %id, ?code, "agent exited");
        let _ = done_tx.send(true);
        let _ = exit_tx.send(code);
    });
    Ok(Started { exec_id: created.id, done, exited })
}

/// The exec's exit code once it has ended; `None` for a death by signal
/// (the engine reports 128 + the signal) or an exec the engine no longer
/// knows (its container was removed).
async fn exit_code(docker: &Docker, exec_id: &str) -> Option<i32> {
    loop {
        let inspected = docker.inspect_exec(exec_id).await.ok()?;
        if inspected.running != Some(true) {
            let code = i32::try_from(inspected.exit_code?).ok()?;
            return (code < 128).then_some(code);
        }
        tokio::time::sleep(EXIT_POLL).await;
    }
}

/// Whether an agent exec runs in the container: one this server started,
/// or one it finds there after a restart (adopted).
pub(super) async fn agent_running(docker: &Docker, sandbox_id: &str, exec_ids: &[String]) -> bool {
    for exec_id in exec_ids {
        let Ok(inspected) = docker.inspect_exec(exec_id).await else { continue };
        let agent = inspected.process_config.and_then(|config| config.entrypoint).is_some_and(|e| e == AGENT_PATH);
        if agent && inspected.running == Some(true) {
            tracing::debug!(sandbox_id, exec_id, "an agent runs in the container");
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use standby_protocol::Secret;

    #[test]
    fn the_agents_environment_has_the_contract_variables_and_no_credential() {
        let launch = AgentLaunch {
            server_url: "http://172.30.0.1:8080".into(),
            token: Secret::new("sby_secret_value"),
            heartbeat_interval: Duration::from_millis(500),
            log_filter: "info".into(),
            otlp_endpoint: None,
        };
        let env = agent_env(&launch);
        assert!(!env.iter().any(|entry| entry.starts_with("STANDBY_OTLP_ENDPOINT")), "only when traces are exported");
        let traced = AgentLaunch { otlp_endpoint: Some("http://collector:4318".into()), ..launch.clone() };
        assert!(agent_env(&traced).contains(&"STANDBY_OTLP_ENDPOINT=http://collector:4318".to_owned()));
        assert!(env.contains(&"STANDBY_SERVER_URL=http://172.30.0.1:8080".to_owned()));
        assert!(env.contains(&"STANDBY_TOKEN_FILE=/dev/stdin".to_owned()));
        assert!(env.contains(&"STANDBY_HEARTBEAT_INTERVAL=500ms".to_owned()));
        assert!(env.contains(&"STANDBY_INSECURE=true".to_owned()), "plain http off loopback, said so");
        assert!(!env.iter().any(|entry| entry.contains("sby_secret_value") || entry.starts_with("STANDBY_TOKEN=")));
        let tls = AgentLaunch { server_url: "https://standby.example".into(), ..launch };
        assert!(!agent_env(&tls).iter().any(|entry| entry.starts_with("STANDBY_INSECURE")));
    }
}
