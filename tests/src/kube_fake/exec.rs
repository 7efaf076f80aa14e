//! `pods/{name}/exec` over a WebSocket, as kube's `Api::exec` speaks it:
//! subprotocol `v5.channel.k8s.io` (else `v4.channel.k8s.io`), binary
//! frames whose first byte is the channel (0 stdin, 1 stdout, 2 stderr,
//! 3 status, 4 resize), and on v5 the frame `[255, 0]` from the client for
//! stdin's end. The command runs in the pod's PID and mount namespaces
//! (`nsenter`), with the container's environment and working directory; it
//! dies with the pod's PID 1, and then the stream ends.
//!
//! The status goes on channel 3 only after stdout and stderr reached their
//! end, because kube stops reading at the status frame: anything sent after
//! it is lost. Then the socket closes.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::Shared;
use super::error::ApiError;
use super::process::{self, Plan, exit_code, map_binary};
use super::routes::{Params, flag, param};
use super::store::ObjKey;

const V5: &str = "v5.channel.k8s.io";
const V4: &str = "v4.channel.k8s.io";

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STATUS: u8 = 3;
const CLOSE: u8 = 255;

/// What one exec asked for.
#[derive(Debug)]
struct Request {
    command: Vec<String>,
    stdin: bool,
    stdout: bool,
    stderr: bool,
}

/// Checks the pod as the API server and kubelet do before upgrading (404
/// for a missing pod, 400 for one not running), then upgrades.
pub fn serve(shared: Arc<Shared>, key: &ObjKey, q: &Params, ws: WebSocketUpgrade) -> Result<Response, ApiError> {
    let pod = shared.store.get(key).ok_or_else(|| key.rt.not_found(&key.name))?;
    let phase = pod.pointer("/status/phase").and_then(Value::as_str).unwrap_or("Pending");
    if matches!(phase, "Succeeded" | "Failed") {
        return Err(ApiError::BadRequest(format!(
            "cannot exec into a container in a completed pod; current phase is {phase}"
        )));
    }
    let cname = pod.pointer("/spec/containers/0/name").and_then(Value::as_str).unwrap_or("");
    if let Some(asked) = param(q, "container")
        && asked != cname
    {
        return Err(ApiError::BadRequest(format!("container {asked} is not valid for pod {}", key.name)));
    }
    let command: Vec<String> = q.iter().filter(|(k, _)| k == "command").map(|(_, v)| v.clone()).collect();
    if command.is_empty() {
        return Err(ApiError::BadRequest("you must specify at least one command for the container".into()));
    }
    let uid = pod.pointer("/metadata/uid").and_then(Value::as_str).unwrap_or("");
    let (plan, pid1) = shared.kubelet.exec_target(&key.namespace, &key.name, uid).ok_or_else(|| {
        ApiError::BadRequest(format!("unable to upgrade connection: container not found (\"{cname}\")"))
    })?;
    let request = Request { command, stdin: flag(q, "stdin"), stdout: flag(q, "stdout"), stderr: flag(q, "stderr") };
    let ws = ws.protocols([V5, V4]);
    let v5 = ws.selected_protocol().is_some_and(|p| p == V5);
    Ok(ws.on_upgrade(move |socket| run(shared, socket, plan, pid1, request, v5)))
}

/// The status frame's object for an exit code (`AttachedProcess::take_status`).
fn exit_status(code: i32, command: &[String]) -> Value {
    if code == 0 {
        return json!({ "metadata": {}, "status": "Success" });
    }
    json!({
        "metadata": {},
        "status": "Failure",
        "message": format!(
            "command terminated with non-zero exit code: error executing command [{}], exit code {code}",
            command.join(" ")
        ),
        "reason": "NonZeroExitCode",
        "details": { "causes": [{ "reason": "ExitCode", "message": code.to_string() }] },
    })
}

fn frame(channel: u8, data: &[u8]) -> Message {
    let mut bytes = Vec::with_capacity(data.len() + 1);
    bytes.push(channel);
    bytes.extend_from_slice(data);
    Message::Binary(Bytes::from(bytes))
}

async fn finish(socket: &mut futures::stream::SplitSink<WebSocket, Message>, status: &Value) {
    let _ = socket.send(frame(STATUS, status.to_string().as_bytes())).await;
    let _ = socket.send(Message::Close(None)).await;
}

async fn run(shared: Arc<Shared>, socket: WebSocket, plan: Arc<Plan>, pid1: u32, request: Request, v5: bool) {
    let (mut sink, mut stream) = socket.split();
    let path = plan.env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.as_str()).unwrap_or(process::DEFAULT_PATH);
    let Some(host) = map_binary(&request.command[0], path, &shared.options.binaries) else {
        let status = json!({
            "metadata": {},
            "status": "Failure",
            "message": format!(
                "OCI runtime exec failed: exec failed: unable to start container process: exec: {:?}: executable file not found in $PATH: unknown",
                request.command[0]
            ),
            "reason": "InternalError",
            "code": 500,
        });
        finish(&mut sink, &status).await;
        return;
    };
    let mut argv = request.command.clone();
    argv[0] = host.display().to_string();
    for arg in argv.iter_mut().skip(1) {
        *arg = process::map_path(arg, &plan.mounts);
    }
    let mut cmd = process::exec_command(&plan, pid1, &argv);
    let piped = |on: bool| if on { std::process::Stdio::piped() } else { std::process::Stdio::null() };
    cmd.stdin(piped(request.stdin)).stdout(piped(request.stdout)).stderr(piped(request.stderr));
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => {
            let status = json!({ "metadata": {}, "status": "Failure", "message": format!("exec: {e}"),
                "reason": "InternalError", "code": 500 });
            finish(&mut sink, &status).await;
            return;
        }
    };
    let pid = child.id().unwrap_or(0);
    shared.kubelet.exec_started(pid);

    // stdin is written by a task of its own, so a process that does not read
    // it never stops us reading its output. Dropping the sender closes it.
    let (stdin_tx, mut stdin_rx) = mpsc::unbounded_channel::<Bytes>();
    let mut stdin_tx = Some(stdin_tx);
    if let Some(mut writer) = child.stdin.take() {
        tokio::spawn(async move {
            while let Some(bytes) = stdin_rx.recv().await {
                if writer.write_all(&bytes).await.is_err() {
                    return;
                }
            }
        });
    } else {
        stdin_tx = None;
    }
    let mut out = child.stdout.take();
    let mut err = child.stderr.take();
    let (mut out_buf, mut err_buf) = (vec![0u8; 32 << 10], vec![0u8; 32 << 10]);
    let mut shutdown = shared.shutdown.clone();
    let mut ws_open = true;
    let mut exit = None;
    while exit.is_none() || out.is_some() || err.is_some() {
        tokio::select! {
            msg = stream.next(), if ws_open => match msg {
                Some(Ok(Message::Binary(b))) => match (b.first(), b.get(1)) {
                    (Some(&STDIN), _) => {
                        if let Some(tx) = &stdin_tx {
                            let _ = tx.send(b.slice(1..));
                        }
                    }
                    (Some(&CLOSE), Some(&STDIN)) if v5 => stdin_tx = None,
                    _ => {}
                },
                Some(Ok(Message::Close(_)) | Err(_)) | None => {
                    ws_open = false;
                    stdin_tx = None;
                }
                Some(Ok(_)) => {}
            },
            n = async { out.as_mut().expect("guarded").read(&mut out_buf).await }, if out.is_some() => match n {
                Ok(n) if n > 0 => {
                    if ws_open && sink.send(frame(STDOUT, &out_buf[..n])).await.is_err() {
                        ws_open = false;
                    }
                }
                _ => out = None,
            },
            n = async { err.as_mut().expect("guarded").read(&mut err_buf).await }, if err.is_some() => match n {
                Ok(n) if n > 0 => {
                    if ws_open && sink.send(frame(STDERR, &err_buf[..n])).await.is_err() {
                        ws_open = false;
                    }
                }
                _ => err = None,
            },
            status = child.wait(), if exit.is_none() => exit = Some(status),
            () = super::stopped(&mut shutdown) => break,
        }
    }
    drop(stdin_tx);
    shared.kubelet.exec_ended(pid);
    let Some(Ok(status)) = exit else {
        // Shut down (the child is killed as it drops) or not waitable.
        let _ = sink.send(Message::Close(None)).await;
        return;
    };
    if ws_open {
        finish(&mut sink, &exit_status(exit_code(status), &request.command)).await;
    }
}
