//! An agent start in a sandbox Pod: a `pods/exec` of `standby` beside the
//! Pod's PID 1, with the contract's settings as its flags and the standby
//! credential written to its standard input (`--token-file /dev/stdin`),
//! then closed (the v5 channel protocol's close of stdin, Kubernetes 1.30
//! and later). The credential is in no Pod spec, no environment, no
//! annotation and no Secret: only in the agent's memory, as on Docker.
//!
//! Tier 2's clearing and the question whether an adopted Pod has an agent
//! are execs too (`standby clear`, `standby busy`, `agent/src/hold.rs`):
//! Kubernetes has no call that signals a container.
//!
//! The exec's output (the agent's log) is appended to a file of the
//! server's; the stream's end is the agent's end, with the exit code the
//! API server reports on the status channel.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use kube::Api;
use kube::api::AttachParams;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt as _};
use tokio::sync::{oneshot, watch};

use crate::provider::docker::AGENT_PATH;
use crate::provider::{AgentLaunch, ProviderError};

use super::pod::WORKSPACE;

/// The agent's argv: the contract's settings as flags, never the credential.
pub(super) fn agent_argv(launch: &AgentLaunch) -> Vec<String> {
    let mut argv = vec![
        AGENT_PATH.to_owned(),
        "--server-url".to_owned(),
        launch.server_url.clone(),
        "--token-file".to_owned(),
        "/dev/stdin".to_owned(),
        "--workspace".to_owned(),
        WORKSPACE.to_owned(),
        "--heartbeat-interval".to_owned(),
        humantime::format_duration(launch.heartbeat_interval).to_string(),
        "--log".to_owned(),
        launch.log_filter.clone(),
    ];
    if let Some(endpoint) = &launch.otlp_endpoint {
        argv.extend(["--otlp-endpoint".to_owned(), endpoint.clone()]);
    }
    // The server is reached at a cluster address, not loopback: plain http
    // there is allowed only by saying so (docs/deploy.md, "Kubernetes").
    if launch.server_url.starts_with("http://") {
        argv.push("--insecure".to_owned());
    }
    argv
}

/// A started agent: the notices of its end, and the way to end its watch
/// of the stream when its Pod is lost.
#[derive(Debug)]
pub(super) struct Started {
    pub done: watch::Receiver<bool>,
    pub exited: oneshot::Receiver<Option<i32>>,
    /// Sent when the Pod is gone under the agent: the stream of an exec on
    /// a lost node may never end by itself.
    pub lost: oneshot::Sender<String>,
}

fn failed(sandbox_id: &str, action: &'static str) -> impl FnOnce(kube::Error) -> ProviderError {
    let sandbox = sandbox_id.to_owned();
    move |source| ProviderError::Kubernetes { sandbox, action, source: Box::new(source) }
}

/// Starts the agent in the (running) Pod and hands it `launch`'s
/// credential; its output goes to `log`.
pub(super) async fn start_agent(
    pods: &Api<Pod>,
    pod: &str,
    sandbox_id: &str,
    launch: &AgentLaunch,
    log: PathBuf,
) -> Result<Started, ProviderError> {
    let params = AttachParams::default().stdin(true).stdout(true).stderr(true);
    let mut process =
        pods.exec(pod, agent_argv(launch), &params).await.map_err(failed(sandbox_id, "exec the agent in its Pod"))?;
    let io = |source| ProviderError::Io {
        sandbox: sandbox_id.to_owned(),
        action: "hand the credential to",
        path: PathBuf::from("/dev/stdin"),
        source,
    };
    let mut stdin = process.stdin().ok_or_else(|| io(std::io::Error::other("the exec has no stdin")))?;
    stdin.write_all(launch.token.expose().as_bytes()).await.map_err(io)?;
    stdin.shutdown().await.map_err(io)?;
    drop(stdin);
    let (stdout, stderr) = (process.stdout(), process.stderr());
    let status = process.take_status();
    let (done_tx, done) = watch::channel(false);
    let (exit_tx, exited) = oneshot::channel();
    let (lost, lost_rx) = oneshot::channel::<String>();
    let id = sandbox_id.to_owned();
    tokio::spawn(async move {
        let copy = copy_output(stdout, stderr, Some(log));
        let code = tokio::select! {
            status = async { copy.await; match status { Some(status) => status.await, None => None } } => exit_code(status.as_ref()),
            Ok(why) = lost_rx => {
                tracing::warn!(sandbox_id = %id, why, "the agent's Pod is gone: its exec is abandoned");
                process.abort();
                None
            }
        };
        tracing::info!(sandbox_id = %id, ?code, "agent exited");
        let _ = done_tx.send(true);
        let _ = exit_tx.send(code);
    });
    Ok(Started { done, exited, lost })
}

/// Reads both output streams to their end, appending them to `log`
/// (discarded without one, or when it cannot be opened: an unread stream
/// stalls the exec's message loop, and its status with it).
async fn copy_output(
    stdout: Option<impl AsyncRead + Unpin>,
    stderr: Option<impl AsyncRead + Unpin>,
    log: Option<PathBuf>,
) {
    let (mut out_file, mut err_file) = (writer(log.as_deref()).await, writer(log.as_deref()).await);
    let out = async {
        if let Some(mut stdout) = stdout {
            let _ = tokio::io::copy(&mut stdout, &mut out_file).await;
        }
    };
    let err = async {
        if let Some(mut stderr) = stderr {
            let _ = tokio::io::copy(&mut stderr, &mut err_file).await;
        }
    };
    tokio::join!(out, err);
}

/// `log` opened for appending; a sink without one.
async fn writer(log: Option<&std::path::Path>) -> Box<dyn AsyncWrite + Unpin + Send> {
    let Some(path) = log else { return Box::new(tokio::io::sink()) };
    match tokio::fs::OpenOptions::new().create(true).append(true).open(path).await {
        Ok(file) => Box::new(file),
        Err(_) => Box::new(tokio::io::sink()),
    }
}

/// The exit code of an exec from its status: 0 on success, the
/// `ExitCode` cause on `NonZeroExitCode`, `None` when unknown.
pub(super) fn exit_code(status: Option<&Status>) -> Option<i32> {
    let status = status?;
    if status.status.as_deref() == Some("Success") {
        return Some(0);
    }
    status.details.as_ref()?.causes.iter().flatten().find_map(|cause| {
        (cause.reason.as_deref() == Some("ExitCode")).then(|| cause.message.as_deref()?.parse().ok()).flatten()
    })
}

/// Runs `standby WORD` in the Pod; its exit code (`None`: killed or
/// unknown), within `timeout`.
pub(super) async fn run_word(
    pods: &Api<Pod>,
    pod: &str,
    sandbox_id: &str,
    word: &str,
    timeout: Duration,
) -> Result<Option<i32>, ProviderError> {
    let params = AttachParams::default().stdin(false).stdout(false).stderr(true);
    let action = if word == "clear" { "clear its Pod" } else { "ask its Pod whether an agent runs" };
    let run = async {
        let mut process = pods.exec(pod, [AGENT_PATH, word], &params).await.map_err(failed(sandbox_id, action))?;
        // Its stderr is read to its end: an unread stream stalls the exec's
        // message loop, and its status with it.
        let drained = copy_output(None::<tokio::io::Empty>, process.stderr(), None);
        let status = async {
            match process.take_status() {
                Some(status) => status.await,
                None => None,
            }
        };
        let ((), status) = tokio::join!(drained, status);
        Ok(exit_code(status.as_ref()))
    };
    tokio::time::timeout(timeout, run).await.unwrap_or(Ok(None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_is_started_with_the_contracts_settings_and_never_its_credential() {
        let launch = AgentLaunch::unreachable();
        let argv = agent_argv(&launch);
        assert_eq!(argv[0], AGENT_PATH);
        let joined = argv.join(" ");
        assert!(joined.contains("--token-file /dev/stdin"), "{joined}");
        assert!(joined.contains("--server-url http://127.0.0.1:1"), "{joined}");
        assert!(joined.contains("--workspace /workspace"), "{joined}");
        assert!(joined.contains("--heartbeat-interval 500ms"), "{joined}");
        assert!(argv.last().is_some_and(|flag| flag == "--insecure"), "plain http said so: {joined}");
        assert!(!joined.contains(launch.token.expose()), "no credential in an exec's command");
        assert!(!joined.contains("--otlp-endpoint"), "only when traces are exported");
        let traced = AgentLaunch { otlp_endpoint: Some("http://collector:4318".into()), ..launch };
        assert!(agent_argv(&traced).join(" ").contains("--otlp-endpoint http://collector:4318"));
    }

    #[test]
    fn an_execs_status_gives_its_exit_code() {
        let status = |json: serde_json::Value| serde_json::from_value::<Status>(json).expect("a status");
        assert_eq!(exit_code(Some(&status(serde_json::json!({"status": "Success"})))), Some(0));
        let failed = serde_json::json!({
            "status": "Failure", "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": "3"}]}
        });
        assert_eq!(exit_code(Some(&status(failed))), Some(3));
        assert_eq!(exit_code(Some(&status(serde_json::json!({"status": "Failure"})))), None);
        assert_eq!(exit_code(None), None);
    }
}
