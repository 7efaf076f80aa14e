//! The credential and secret rules, each proven by a test: against the
//! real `standby-server` (with the test acting as the sandbox where the
//! rule is the server's, so the credentials it is handed can be replayed
//! exactly; with real agents where the whole system is under test), or
//! against the contract test server where the rule is the agent's.
//!
//! Rules proven elsewhere, not repeated here:
//! - the standby credential is refused once the run credential connected:
//!   `control_plane::the_standby_credential_is_refused_once_the_run_credential_connects`;
//!   a written-off sandbox's standby credential is refused (`401`, exit 11):
//!   `control_plane::a_committed_standby_that_dies_before_confirming_is_written_off`;
//! - path escapes refused by the agent: repo paths in
//!   `standby_phase::a_repo_path_leaving_the_workspace_is_refused` (and the
//!   two tests after it), `cwd` in
//!   `run_phase::a_cwd_leaving_the_workspace_fails_not_requeueable`,
//!   attachment names in
//!   `run_phase::a_path_traversing_attachment_name_fails_not_requeueable`;
//!   symbolic links that lead out: here;
//! - MCP servers never see secrets, credentials or the run's `env`:
//!   `run_phase::mcp_servers_see_no_secret`;
//! - the git credentials file is mode 0600:
//!   `run_phase::the_run_has_a_terminal_its_data_git_credentials_and_the_expected_commit`
//!   (every secret file: here);
//! - `ws://`/`http://` to a non-loopback host needs `--insecure`:
//!   `standby_phase::plain_http_to_a_non_loopback_host_is_refused_without_insecure`;
//! - an oversized frame closes the connection and the agent reconnects:
//!   `standby_phase::an_oversized_frame_drops_the_connection_and_the_agent_reconnects`
//!   (memory stays bounded: here);
//! - the run's log is redacted: `run_phase::secrets_are_redacted_across_batches_and_in_encoded_forms`.
//!
//! Needs `cargo build --bins`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::SinkExt;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use standby_e2e::harness::{assert_exit, write_json};
use standby_e2e::proxy::{ConnInfo, Direction, Fault, FaultPolicy, FaultProxy};
use standby_e2e::server::{ExecutionSetup, Frame};
use standby_e2e::server_process::{API_KEY, ServerBuilder, ServerProcess, free_addr, tail};
use standby_e2e::spooled::{
    Spooled, closed_by_server, heartbeat, next_assignment, next_assignment_frame, spooled, spooled_with,
};
use standby_e2e::{AgentBuilder, TestServer};
use standby_protocol::layout::StateDir;
use standby_protocol::{
    AgentState, Cause, Event, EventKind, ExitCode, LogChunk, PROTOCOL_HEADER, PROTOCOL_VERSION, SOCKET_PATH, SPEC_PATH,
    Stage, paths,
};
use tempfile::TempDir;

const WAIT: Duration = Duration::from_secs(60);

fn scratch(prefix: &str) -> TempDir {
    tempfile::Builder::new().prefix(prefix).tempdir().expect("a temp dir")
}

fn mark(dir: &TempDir) -> String {
    let name = dir.path().file_name().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default();
    format!("security-{name}")
}

/// The body of a `POST …/events` reporting `kind`.
fn event_body(kind: EventKind) -> String {
    serde_json::to_string(&Event::new(format!("e-{}", kind.name()), kind)).expect("an event serializes")
}

/// Every call the run credential makes, with a body where it is a `POST`.
fn execution_calls(id: &str) -> Vec<(reqwest::Method, String, Option<String>)> {
    let get = reqwest::Method::GET;
    let post = reqwest::Method::POST;
    let chunk = serde_json::to_string(&LogChunk::new(0, b"hi")).expect("a chunk serializes");
    vec![
        (get.clone(), paths::secrets(id), None),
        (get.clone(), paths::attachments(id), None),
        (get.clone(), paths::attachment(id, "notes.txt"), None),
        (post.clone(), paths::git_credentials(id), Some("{}".to_owned())),
        (get, paths::metadata(id), None),
        (post.clone(), paths::cloud_credentials(id), Some("{}".to_owned())),
        (post.clone(), paths::events(id), Some(event_body(EventKind::Started))),
        (post, paths::log(id), Some(chunk)),
    ]
}

fn run_with_secrets(secret: &str) -> Value {
    json!({
        "command": ["true"],
        "secrets": {"API_TOKEN": secret},
        "cloud_env": {"CLOUD_TOKEN": format!("{secret}-cloud")},
        "git_credentials": [{"protocol": "https", "host": "git.example", "username": "bot", "password": format!("{secret}-git")}],
        "metadata": {"ticket": 7},
        "attachments": [{"name": "notes.txt", "content": "notes"}],
    })
}

#[tokio::test]
async fn a_run_credential_is_refused_after_cancel() {
    let spooled = spooled(1).await;
    let token = spooled.tokens(1).await.remove(0);
    let mut standby = spooled.ready_standby(&token).await;
    let (id, credential) = spooled.assigned(&mut standby, &run_with_secrets("cancel-secret-1")).await;
    let (status, secrets) = spooled.agent_call(reqwest::Method::GET, &paths::secrets(&id), &credential, None).await;
    assert_eq!(status, 200, "valid before the cancel: {secrets}");
    let (status, run) =
        spooled.server.call(reqwest::Method::POST, &format!("/v1/runs/{id}/cancel"), Some(API_KEY), None).await;
    assert_eq!((status, run["state"].as_str()), (200, Some("cancelled")), "{run}");
    // The run is over: the socket and every call but the run's events and
    // log refuse it (410, withdrawn). Those two are accepted until the agent
    // is gone (amendment 8), and a spooled sandbox is gone as soon as it is
    // retired: see the next test for them.
    assert_eq!(spooled.server.upgrade_status(&credential).await, 410, "the control socket refuses it");
    for (method, path, body) in execution_calls(&id) {
        let (status, answer) = spooled.agent_call(method.clone(), &path, &credential, body.as_deref()).await;
        let reports = path == paths::events(&id) || path == paths::log(&id);
        assert!(status == 410 || (reports && status == 200), "{method} {path} after the cancel: {status} {answer}");
        assert!(!answer.to_string().contains("cancel-secret-1"), "a refusal leaked a secret: {answer}");
    }
    spooled.stop().await;
}

/// Amendment 8: after a cancel the run credential may still post the run's
/// events and log until the agent exits; every other call is refused. The
/// agent's `cancelled` is its last word.
#[tokio::test]
async fn after_a_cancel_the_run_credential_reports_the_end_and_nothing_else() {
    let spooled = spooled(1).await;
    let token = spooled.tokens(1).await.remove(0);
    let mut standby = spooled.ready_standby(&token).await;
    let (id, credential) = spooled.assigned(&mut standby, &run_with_secrets("cancel-secret-6")).await;
    let mut run_socket = spooled.server.upgrade(&credential).await.expect("the run credential connects");
    run_socket.send(heartbeat(AgentState::Running, Some(&id))).await.expect("a heartbeat");
    assert_eq!(next_assignment(&mut run_socket).await.0, id);
    let events = paths::events(&id);
    let started = event_body(EventKind::Started);
    assert_eq!(spooled.agent_call(reqwest::Method::POST, &events, &credential, Some(&started)).await.0, 200);
    let (status, run) =
        spooled.server.call(reqwest::Method::POST, &format!("/v1/runs/{id}/cancel"), Some(API_KEY), None).await;
    assert_eq!((status, run["state"].as_str()), (200, Some("cancelling")), "{run}");
    drop(run_socket);
    let log = paths::log(&id);
    let (status, answer) =
        spooled.agent_call(reqwest::Method::POST, &log, &credential, Some(r#"{"offset": 0, "data": "aGk="}"#)).await;
    assert_eq!(status, 200, "the run's log after the cancel: {answer}");
    for (method, path, body) in execution_calls(&id) {
        if path != paths::events(&id) && path != paths::log(&id) {
            let (status, answer) = spooled.agent_call(method.clone(), &path, &credential, body.as_deref()).await;
            assert_eq!(status, 410, "{method} {path} after the cancel: {answer}");
            assert!(!answer.to_string().contains("cancel-secret-6"), "a refusal leaked a secret: {answer}");
        }
    }
    assert_eq!(spooled.server.upgrade_status(&credential).await, 410, "the control socket refuses it");
    let cancelled = event_body(EventKind::Cancelled);
    let (status, answer) = spooled.agent_call(reqwest::Method::POST, &events, &credential, Some(&cancelled)).await;
    assert_eq!(status, 200, "the agent reports the cancel: {answer}");
    assert_eq!(spooled.server.run(&id).await["state"], "cancelled");
    refused_as_ended(&spooled, &id, &credential, "cancel-secret-6").await;
    assert_eq!(spooled.server.log(&id).await, b"hi");
    spooled.stop().await;
}

#[tokio::test]
async fn a_run_credential_is_refused_after_requeue() {
    let spooled = spooled(1).await;
    let token = spooled.tokens(1).await.remove(0);
    let mut standby = spooled.ready_standby(&token).await;
    let (id, credential) = spooled.assigned(&mut standby, &run_with_secrets("requeue-secret-2")).await;
    // Delivery confirmed on the run credential, then a requeueable failure.
    let mut run_socket = spooled.server.upgrade(&credential).await.expect("the run credential connects");
    run_socket.send(heartbeat(AgentState::Installing, Some(&id))).await.expect("a heartbeat");
    assert_eq!(next_assignment(&mut run_socket).await.0, id, "the replay confirms delivery");
    let failed = event_body(EventKind::install_failed(Stage::Secrets, Cause::Network, "probe"));
    let (status, _) = spooled.agent_call(reqwest::Method::POST, &paths::events(&id), &credential, Some(&failed)).await;
    assert_eq!(status, 200);
    let run = spooled.server.run(&id).await;
    assert_eq!(run["attempts"][0]["outcome"], "requeued", "{run}");
    assert_eq!(run["attempts"].as_array().map(Vec::len), Some(2), "requeued to a new attempt: {run}");
    assert_eq!(spooled.server.upgrade_status(&credential).await, 401, "the control socket refuses it");
    for (method, path, body) in execution_calls(&id) {
        let (status, answer) = spooled.agent_call(method.clone(), &path, &credential, body.as_deref()).await;
        assert_eq!(status, 401, "{method} {path} after the requeue: {answer}");
    }
    // The cold sandbox of the second attempt gets its own run credential.
    let cold = spooled.token_of(run["attempts"][1]["sandbox_id"].as_str().expect("a sandbox")).await;
    // As an agent does: the spec first, then the control socket.
    let (status, _) = spooled.agent_call(reqwest::Method::GET, SPEC_PATH, &cold, None).await;
    assert_eq!(status, 200);
    let mut cold_socket = spooled.server.upgrade(&cold).await.expect("the cold sandbox connects");
    cold_socket.send(heartbeat(AgentState::Preparing, None)).await.expect("a heartbeat");
    let (again, second) = next_assignment(&mut cold_socket).await;
    assert_eq!(again, id);
    assert_ne!(second, credential, "a new attempt has a new run credential");
    spooled.stop().await;
}

/// Every execution call (and the socket) refuses `credential` as an ended
/// run's, leaking nothing.
async fn refused_as_ended(spooled: &Spooled, id: &str, credential: &str, secret: &str) {
    assert_eq!(spooled.server.upgrade_status(credential).await, 410, "the control socket refuses it");
    for (method, path, body) in execution_calls(id) {
        let (status, answer) = spooled.agent_call(method.clone(), &path, credential, body.as_deref()).await;
        assert_eq!(status, 410, "{method} {path} after the run ended: {answer}");
        assert!(!answer.to_string().contains(secret), "a refusal leaked a secret: {answer}");
    }
}

/// Issue 14: a run credential outlived its run (secrets read, log and an
/// `exited` forged, `/ws` opened with the assignment replayed, minutes
/// later and after a restart). Once the run exited it is refused on every
/// call and on the socket, its live socket is closed, and it stays so
/// after a restart. The assignment names the pool spec's workspace
/// (amendment 1).
#[tokio::test]
async fn a_run_credential_is_refused_once_its_run_exited_and_after_a_restart() {
    let spooled = spooled(1).await;
    let token = spooled.tokens(1).await.remove(0);
    let (status, spec) = spooled.agent_call(reqwest::Method::GET, SPEC_PATH, &token, None).await;
    assert_eq!(status, 200, "{spec}");
    let mut standby = spooled.ready_standby(&token).await;
    let id = spooled.server.submit(&run_with_secrets("exited-secret-4")).await;
    let assignment = next_assignment_frame(&mut standby).await;
    assert_eq!(assignment.execution_id, id);
    let workspace = serde_json::to_value(&assignment.run.workspace).expect("serialisable");
    assert_eq!(workspace, spec["workspace"], "the assignment names the workspace the run expects");
    let credential = assignment.run_credential.expose().to_owned();
    let mut run_socket = spooled.server.upgrade(&credential).await.expect("the run credential connects");
    run_socket.send(heartbeat(AgentState::Running, Some(&id))).await.expect("a heartbeat");
    let replay = next_assignment_frame(&mut run_socket).await;
    assert_eq!(replay.run.workspace, assignment.run.workspace, "the replay names it too");
    // The agent's end: its last log chunk, then `exited`.
    let calls = [
        (paths::log(&id), r#"{"offset": 0, "data": "aGk="}"#.to_owned()),
        (paths::events(&id), event_body(EventKind::Started)),
        (paths::events(&id), event_body(EventKind::Exited { code: 0 })),
    ];
    for (path, body) in calls {
        let (status, answer) = spooled.agent_call(reqwest::Method::POST, &path, &credential, Some(&body)).await;
        assert_eq!(status, 200, "{path} {body}: {answer}");
    }
    assert_eq!(spooled.server.run(&id).await["state"], "exited");
    closed_by_server(&mut run_socket).await;
    refused_as_ended(&spooled, &id, &credential, "exited-secret-4").await;
    drop((standby, run_socket));
    let spooled = spooled.restart(1, "10s").await;
    refused_as_ended(&spooled, &id, &credential, "exited-secret-4").await;
    assert_eq!(spooled.server.log(&id).await, b"hi", "nothing was appended after the run ended");
    spooled.stop().await;
}

/// `/ws` with `token` as an agent would: the status and any `Retry-After`.
async fn upgrade_answer(server: &ServerProcess, token: &str) -> (u16, Option<String>) {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let url = format!("{}{SOCKET_PATH}", server.url().replacen("http", "ws", 1));
    let mut request = url.into_client_request().expect("a request");
    request.headers_mut().insert("Authorization", format!("Bearer {token}").parse().expect("a header"));
    request.headers_mut().insert(PROTOCOL_HEADER, PROTOCOL_VERSION.parse().expect("a header"));
    match tokio_tungstenite::connect_async(request).await {
        Ok(_) => (101, None),
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            let retry_after = response.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
            (response.status().as_u16(), retry_after)
        }
        Err(error) => panic!("the upgrade failed: {error}"),
    }
}

/// Issue 14: 500 sockets on one standby credential were all accepted, and
/// a run holding another agent's credential took that agent's assignment.
/// Now a credential has one live socket: a second upgrade is refused `409`
/// (with `Retry-After`) and counted; once the first misses its heartbeats
/// a new one is admitted, before the standby counts as silent, and the
/// assignment goes to it alone.
#[tokio::test]
async fn one_live_socket_per_credential_and_a_silent_one_is_replaced() {
    // Heartbeats every 2 s: a socket is live for 4 s, a standby silent after 6 s.
    let spooled = spooled_with(1, "2s").await;
    let token = spooled.tokens(1).await.remove(0);
    let mut first = spooled.ready_standby(&token).await;
    for _ in 0..2 {
        first.send(heartbeat(AgentState::Ready, None)).await.expect("a heartbeat");
        let (status, retry_after) = upgrade_answer(&spooled.server, &token).await;
        assert_eq!(status, 409, "a second socket on a live standby credential");
        assert!(retry_after.is_some_and(|s| s.parse::<u64>().is_ok_and(|s| (1..=5).contains(&s))), "Retry-After");
    }
    let metrics = spooled.server.call(reqwest::Method::GET, "/metrics", Some(API_KEY), None).await.1;
    let metrics = metrics.as_str().unwrap_or_default().to_owned();
    assert!(metrics.contains("standby_duplicate_connections_refused_total 2"), "{metrics}");
    // The first goes silent, its connection left open.
    let mut second = spooled
        .server
        .until("a socket admitted once the first missed its heartbeats", WAIT, async || {
            spooled.server.upgrade(&token).await.ok()
        })
        .await;
    second.send(heartbeat(AgentState::Ready, None)).await.expect("a heartbeat");
    closed_by_server(&mut first).await;
    // The claim took the first socket off the standby before the upgrade
    // was answered; the second counts once its connection task has
    // registered it. A run submitted in between goes cold (seen under load).
    spooled
        .server
        .until("the standby a candidate on its new socket", WAIT, async || {
            (spooled.candidates().await == 1).then_some(())
        })
        .await;
    // Exactly one socket, the new one, gets the assignment.
    let id = spooled.server.submit(&run_with_secrets("socket-secret-5")).await;
    let assignment = next_assignment_frame(&mut second).await;
    assert_eq!(assignment.execution_id, id, "the standby was kept and took the run");
    // The run credential has one socket too.
    let credential = assignment.run_credential.expose().to_owned();
    let mut run_socket = spooled.server.upgrade(&credential).await.expect("the run credential connects");
    run_socket.send(heartbeat(AgentState::Installing, Some(&id))).await.expect("a heartbeat");
    assert_eq!(next_assignment_frame(&mut run_socket).await.execution_id, id);
    assert_eq!(spooled.server.upgrade_status(&credential).await, 409, "a second socket on a live run credential");
    drop((second, run_socket));
    spooled.stop().await;
}

/// A real agent whose connection is cut (both sides reset, as a network
/// drop the server sees) is back at once: the server saw the old socket
/// close, so its reconnect is no duplicate, and the standby takes a run.
#[tokio::test]
async fn an_agent_whose_connection_is_cut_reconnects_and_takes_a_run() {
    let dir = scratch("standby-security-");
    let spec = dir.path().join("spec.json");
    write_json(&spec, &json!({"workspace": {}, "shell": ["/bin/sh"]}));
    let proxy = FaultProxy::start(free_addr()).await;
    let server = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark(&dir))
        .keep_agent_logs(&dir.path().join("agents"))
        .arg("--spec")
        .arg(&spec.display().to_string())
        .args(&["--public-url", &proxy.url(), "--pool-size", "1", "--heartbeat-interval", "1s"])
        .args(&["--linger", "2s", "--stop-grace", "2s", "--log", "debug", "--agent-log", "debug"])
        .start()
        .await;
    proxy.set_target(server.addr());
    let candidate = async || {
        server.sandboxes().await.into_iter().find(|sandbox| sandbox["candidate"] == true).map(|s| s["id"].clone())
    };
    let standby = server.until("a ready standby", WAIT, candidate).await;
    assert!(proxy.cut_all() >= 1, "the agent's socket goes through the proxy");
    let reconnected = server
        .until("the standby's agent to reconnect", WAIT, async || {
            let sandbox = server.sandbox(standby.as_str().unwrap_or_default()).await;
            (sandbox["connections"].as_u64() >= Some(2) && sandbox["candidate"] == true).then_some(sandbox)
        })
        .await;
    assert_eq!(reconnected["state"], "standby", "{reconnected}");
    let id = server.submit(&json!({"command": ["true"]})).await;
    let run = server.finished(&id, WAIT).await;
    assert_eq!((run["state"].as_str(), run["path"].as_str()), (Some("exited"), Some("warm")), "{run}");
    assert_eq!(run["attempts"][0]["sandbox_id"], standby, "the same standby took it: {run}");
    // Its run credential was withdrawn (its socket closed) with the run's
    // end: the agent still exits cleanly.
    let id = standby.as_str().unwrap_or_default();
    let exited = server
        .until("the agent to exit", WAIT, async || {
            Some(server.sandbox(id).await["exit_code"].clone()).filter(|c| !c.is_null())
        })
        .await;
    assert_eq!(exited, 0, "{}", server.logs());
    let status = server.stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status} on SIGTERM");
}

#[tokio::test]
async fn one_executions_credential_cannot_read_another_executions_data() {
    let spooled = spooled(2).await;
    let tokens = spooled.tokens(2).await;
    let mut first = spooled.ready_standby(&tokens[0]).await;
    let mut second = spooled.ready_standby(&tokens[1]).await;
    let (a, credential_a) =
        spooled.assigned_either(&mut first, &mut second, &run_with_secrets("isolation-secret-a")).await;
    let (b, credential_b) =
        spooled.assigned_either(&mut first, &mut second, &run_with_secrets("isolation-secret-b")).await;
    assert_ne!(a, b);
    let (status, own) = spooled.agent_call(reqwest::Method::GET, &paths::secrets(&a), &credential_a, None).await;
    assert_eq!(status, 200, "{own}");
    assert_eq!(own["secrets"]["API_TOKEN"], "isolation-secret-a");
    for (credential, other) in [(&credential_a, &b), (&credential_b, &a)] {
        for (method, path, body) in execution_calls(other) {
            let (status, answer) = spooled.agent_call(method.clone(), &path, credential, body.as_deref()).await;
            assert!(
                [401, 403].contains(&status),
                "{method} {path} with another execution's credential: {status} {answer}"
            );
            assert!(!answer.to_string().contains("isolation-secret"), "a refusal leaked a secret: {answer}");
        }
    }
    // A standby credential is no run credential either.
    let spare = spooled.new_token(&tokens).await;
    let (status, _) = spooled.agent_call(reqwest::Method::GET, &paths::secrets(&a), &spare, None).await;
    assert!([401, 403].contains(&status), "a standby credential read secrets: {status}");
    spooled.stop().await;
}

#[tokio::test]
async fn credentials_are_stored_only_as_hashes() {
    let spooled = spooled(1).await;
    let token = spooled.tokens(1).await.remove(0);
    let mut standby = spooled.ready_standby(&token).await;
    let (id, credential) = spooled.assigned(&mut standby, &run_with_secrets("hash-secret-3")).await;
    let mut run_socket = spooled.server.upgrade(&credential).await.expect("the run credential connects");
    run_socket.send(heartbeat(AgentState::Running, Some(&id))).await.expect("a heartbeat");
    assert_eq!(next_assignment(&mut run_socket).await.0, id);
    for kind in [EventKind::Started, EventKind::Exited { code: 0 }] {
        let body = event_body(kind);
        let path = paths::events(&id);
        assert_eq!(spooled.agent_call(reqwest::Method::POST, &path, &credential, Some(&body)).await.0, 200);
    }
    let replacement = spooled.new_token(std::slice::from_ref(&token)).await;
    drop((standby, run_socket));
    let data = spooled.dir.path().join("data");
    let dir = spooled.stop().await;
    let mut bytes = Vec::new();
    for suffix in ["", "-wal", "-shm"] {
        bytes.extend(std::fs::read(data.join(format!("standby.db{suffix}"))).unwrap_or_default());
    }
    assert!(!bytes.is_empty(), "the store exists");
    let text = String::from_utf8_lossy(&bytes);
    let secrets = [API_KEY, &token, &replacement, &credential];
    for secret in secrets {
        // `<kind>_<id>_<secret>`: the id is public, the rest must not be there.
        let private = secret.rsplit('_').next().unwrap_or(secret);
        assert!(!text.contains(secret) && !text.contains(private), "the store holds a raw credential");
    }
    drop(dir);
}

// ---- bodies the server refuses ------------------------------------------------------

#[tokio::test]
async fn path_escapes_are_refused_at_submission_naming_the_field() {
    let spooled = spooled(0).await;
    let cases = [
        (json!({"command": ["ls"], "cwd": "../outside"}), "cwd"),
        (json!({"command": ["ls"], "cwd": "/etc"}), "cwd"),
        (json!({"command": ["ls"], "cwd": "app/../../outside"}), "cwd"),
        (json!({"command": ["ls"], "attachments": [{"name": "../x", "content": ""}]}), "attachments[0].name"),
        (json!({"command": ["ls"], "attachments": [{"name": "a/b", "content": ""}]}), "attachments[0].name"),
        (json!({"command": ["ls"], "attachments": [{"name": "..", "content": ""}]}), "attachments[0].name"),
        (
            json!({"command": ["ls"], "workspace": {"repos": [{"url": "file:///r", "path": "../r"}]}}),
            "workspace.repos[0].path",
        ),
        (
            json!({"command": ["ls"], "workspace": {"repos": [{"url": "file:///r", "path": "/abs"}]}}),
            "workspace.repos[0].path",
        ),
        (
            json!({"command": ["ls"], "workspace": {"setup": [{"name": "s", "command": ["true"], "cwd": "../up"}]}}),
            "workspace.setup[0].cwd",
        ),
        (
            json!({"command": ["ls"], "workspace": {"setup": [{"name": "s", "command": ["true"], "inputs": ["a.lock", "/etc/passwd"]}]}}),
            "workspace.setup[0].inputs[1]",
        ),
    ];
    for (body, field) in cases {
        let (status, answer) = spooled.server.call(reqwest::Method::POST, "/v1/runs", Some(API_KEY), Some(&body)).await;
        assert_eq!((status, answer["field"].as_str()), (400, Some(field)), "{body}: {answer}");
    }
    assert_eq!(spooled.server.runs().await.len(), 0, "nothing was stored");
    spooled.stop().await;
}

#[tokio::test]
async fn malformed_bodies_get_400_naming_the_field() {
    let spooled = spooled(1).await;
    let user = [
        (r#"{"command": ["ls"], "secrets": {"K": 5}}"#, "secrets.K"),
        (r#"{"command": ["ls"], "cloud_env": []}"#, "cloud_env"),
        (
            r#"{"command": ["ls"], "git_credentials": [{"protocol": "https", "host": "", "username": "u", "password": "p"}]}"#,
            "git_credentials[0].host",
        ),
        (
            r#"{"command": ["ls"], "attachments": [{"name": "a", "content_base64": "%%%"}]}"#,
            "attachments[0].content_base64",
        ),
        (r#"{"command": ["ls"], "strict_mcp": "yes"}"#, "strict_mcp"),
        (r#"{"command": ["ls"], "mcp_env": {"": "x"}}"#, "mcp_env."),
        (r#"{"command": ["ls"], "thread_id": "a b"}"#, "thread_id"),
        (r#"{"command": [""]}"#, "command"),
    ];
    let client = reqwest::Client::new();
    for (body, field) in user {
        let response = client
            .post(format!("{}/v1/runs", spooled.server.url()))
            .bearer_auth(API_KEY)
            .header("Content-Type", "application/json")
            .body(body)
            .send()
            .await
            .expect("answered");
        let status = response.status().as_u16();
        let answer: Value = response.json().await.expect("a JSON error");
        assert_eq!((status, answer["field"].as_str()), (400, Some(field)), "{body}: {answer}");
        assert!(!answer.to_string().contains("%%%"), "the error quotes a value: {answer}");
    }
    // The agent-facing bodies, with a valid run credential.
    let token = spooled.tokens(1).await.remove(0);
    let mut standby = spooled.ready_standby(&token).await;
    let (id, credential) = spooled.assigned(&mut standby, &json!({"command": ["true"]})).await;
    let events = paths::events(&id);
    let log = paths::log(&id);
    let agent = [
        (&events, r#"{"type": "started"}"#, "event_id"),
        (&events, r#"{"event_id": 5, "type": "started"}"#, "event_id"),
        (&events, r#"{"event_id": "e1", "type": "exited"}"#, "code"),
        (&events, r#"{"event_id": "e2", "type": "exited", "code": "zero"}"#, "code"),
        (&log, r#"{"data": "aGk="}"#, "offset"),
        (&log, r#"{"offset": -1, "data": "aGk="}"#, "offset"),
        (&log, r#"{"offset": 0, "data": "not base64!"}"#, "data"),
    ];
    for (path, body, field) in agent {
        let (status, answer) = spooled.agent_call(reqwest::Method::POST, path, &credential, Some(body)).await;
        assert_eq!((status, answer["field"].as_str()), (400, Some(field)), "{path} {body}: {answer}");
    }
    let (status, answer) = spooled.agent_call(reqwest::Method::POST, &events, &credential, Some("{not json")).await;
    assert_eq!(status, 400, "{answer}");
    spooled.stop().await;
}

// ---- the agent's rules, against the contract test server ---------------------------------

fn env_of(pid: i32) -> Vec<u8> {
    std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

#[tokio::test]
async fn setup_commands_and_every_child_of_the_agent_never_see_the_standby_credential() {
    let server = TestServer::start().await;
    let dir = scratch("standby-security-");
    let dump = dir.path().join("setup-env");
    let spec = json!({
        "workspace": {"setup": [{"name": "dump", "command": ["sh", "-c", format!("env > '{}'", dump.display())]}]},
        "mcp_servers": [{"name": "idle", "command": ["sleep", "300"]}],
        "shell": ["/bin/sh"],
    });
    let spec_path = dir.path().join("spec.json");
    write_json(&spec_path, &spec);
    let token = server.add_standby();
    let mut agent = AgentBuilder::new(&server.url(), &token)
        .spec_file(&spec_path)
        .heartbeat_interval("200ms")
        .log_filter("trace")
        .spawn();
    agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Ready)).await;
    let setup_env = std::fs::read_to_string(&dump).expect("the setup step dumped its environment");
    assert!(setup_env.lines().any(|line| line.starts_with("PATH=")), "a real dump");
    assert!(!setup_env.contains(&token), "the setup step saw the standby credential");
    assert!(!setup_env.lines().any(|line| line.starts_with("STANDBY_TOKEN=")), "the setup step got STANDBY_TOKEN");
    let children = agent.descendants();
    assert!(children.len() >= 2, "the idle shell and the MCP server run: {children:?}");
    for pid in children {
        let environ = env_of(pid);
        assert!(!contains(&environ, token.as_bytes()), "child {pid} holds the standby credential");
        assert!(!contains(&environ, b"STANDBY_TOKEN="), "child {pid} got STANDBY_TOKEN");
    }
    server.retire(&token, None).expect("retire");
    let code = agent.wait_exit(WAIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the agent finished");
    agent.assert_output_lacks(&[&token]);
}

#[tokio::test]
async fn secret_files_are_mode_0600() {
    let server = TestServer::start().await;
    let dir = scratch("standby-security-");
    let workspace = dir.path().join("workspace");
    std::fs::create_dir(&workspace).expect("a workspace");
    let spec_path = dir.path().join("spec.json");
    write_json(&spec_path, &json!({"workspace": {}, "shell": ["/bin/sh"]}));
    let token = server.add_standby();
    let mut agent = AgentBuilder::new(&server.url(), &token)
        .spec_file(&spec_path)
        .workspace(&workspace)
        .heartbeat_interval("200ms")
        .spawn();
    agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Ready)).await;
    // The run reports the modes: its files are removed when it ends.
    let modes = dir.path().join("modes");
    let state = StateDir::of(&workspace);
    let files = [state.metadata_file(), state.git_credentials(), state.attachments_dir().join("spec.md")];
    let quoted: Vec<String> = files.iter().map(|file| format!("'{}'", file.display())).collect();
    let script = format!("stat -c '%a %n' {} > '{}'", quoted.join(" "), modes.display());
    let execution = ExecutionSetup::new(&["/bin/sh", "-c", &script])
        .secret("API_KEY", "mode-secret-4")
        .metadata(json!({"ticket": "t-4"}))
        .attachment("spec.md", b"# spec\n")
        .git_credential("https", "git.example", "bot", "mode-git-5");
    server.assign(&token, execution);
    let code = agent.wait_exit(WAIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    let modes = std::fs::read_to_string(&modes).unwrap_or_else(|e| panic!("{}: {e}", modes.display()));
    let listed: Vec<&str> = modes.lines().map(|line| line.split_once(' ').map_or(line, |(_, file)| file)).collect();
    let expected: Vec<String> = files.iter().map(|file| file.display().to_string()).collect();
    assert_eq!(listed, expected, "{modes}");
    for line in modes.lines() {
        assert!(line.starts_with("600 "), "not mode 0600: {line}");
    }
    // Secret values are in the run's environment only, never in a file.
    for entry in walk(&workspace) {
        let bytes = std::fs::read(&entry).unwrap_or_default();
        assert!(!contains(&bytes, b"mode-secret-4"), "{} holds a secret value", entry.display());
    }
}

/// Every regular file under `root`.
fn walk(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let Ok(kind) = entry.file_type() else { continue };
            if kind.is_dir() {
                dirs.push(entry.path());
            } else if kind.is_file() {
                files.push(entry.path());
            }
        }
    }
    files
}

#[tokio::test]
async fn a_cwd_through_a_symlink_leading_out_is_refused_and_nothing_is_fetched() {
    let server = TestServer::start().await;
    let dir = scratch("standby-security-");
    let workspace = dir.path().join("workspace");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&workspace).expect("a workspace");
    std::fs::create_dir_all(&outside).expect("a directory outside");
    std::os::unix::fs::symlink(&outside, workspace.join("escape")).expect("a symlink out");
    let spec_path = dir.path().join("spec.json");
    write_json(&spec_path, &json!({"workspace": {}, "shell": ["/bin/sh"]}));
    let token = server.add_standby();
    let mut agent = AgentBuilder::new(&server.url(), &token)
        .spec_file(&spec_path)
        .workspace(&workspace)
        .heartbeat_interval("200ms")
        .spawn();
    agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Ready)).await;
    let marker = outside.join("ran");
    let script = format!("touch '{}'", marker.display());
    let execution_id =
        server.assign(&token, ExecutionSetup::new(&["sh", "-c", &script]).cwd("escape").secret("K", "symlink-6"));
    let code = agent.wait_exit(WAIT).await;
    assert_exit(&agent, code, ExitCode::InstallFailed, "the install failed");
    let failures = server.install_failures(&execution_id);
    assert_eq!(failures.len(), 1, "{:?}", server.events(&execution_id));
    assert_eq!((failures[0].stage.as_str(), failures[0].requeueable), ("check", false), "{:?}", failures[0]);
    assert!(!marker.exists(), "the run ran outside the workspace");
    let fetched = server.http_calls().iter().any(|call| call.endpoint == standby_e2e::server::Endpoint::Secrets);
    assert!(!fetched, "secrets were fetched for a run that cannot start");
}

/// Resident memory of a live process, in KiB.
fn vm_rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the agent's status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .expect("a VmRSS line")
}

#[tokio::test]
async fn a_64_mib_frame_closes_the_connection_without_growing_the_agents_memory() {
    let server = TestServer::start().await;
    let dir = scratch("standby-security-");
    let spec_path = dir.path().join("spec.json");
    write_json(&spec_path, &json!({"workspace": {}, "shell": ["/bin/sh"]}));
    let token = server.add_standby();
    let mut agent = AgentBuilder::new(&server.url(), &token).spec_file(&spec_path).heartbeat_interval("200ms").spawn();
    let first = agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Ready)).await;
    let before = vm_rss_kib(agent.pid());
    let huge = format!(r#"{{"type":"retired","reason":"{}"}}"#, "x".repeat(64 << 20));
    server.send(first.connection, Frame::Text(huge)).expect("send the frame");
    agent.watch(server.wait_for_close(first.connection)).await;
    let second = agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.connection != first.connection)).await;
    let after = vm_rss_kib(agent.pid());
    assert!(
        after < before + 16 * 1024,
        "the agent's resident memory grew from {before} KiB to {after} KiB on a 64 MiB frame"
    );
    assert_eq!(second.state, AgentState::Ready, "the oversized `retired` was not acted on");
    server.retire(&token, None).expect("retire");
    let code = agent.wait_exit(WAIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the agent finished");
}

// ---- no secret in any log line ------------------------------------------------------------------

/// Records every credential that crosses the proxy: bearer tokens in
/// requests, run credentials in assignment frames. Injects nothing.
struct Tap(Arc<Mutex<BTreeSet<String>>>);

impl FaultPolicy for Tap {
    fn on_data(&mut self, _conn: &ConnInfo, direction: Direction, data: &[u8]) -> Option<Fault> {
        let text = String::from_utf8_lossy(data);
        let marker = match direction {
            Direction::ToServer => "Bearer ",
            Direction::ToClient => "\"run_credential\":\"",
        };
        let mut seen = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        for piece in text.split(marker).skip(1) {
            let token: String = piece.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if token.len() > 16 {
                seen.insert(token);
            }
        }
        None
    }
}

#[tokio::test]
async fn no_secret_or_credential_in_any_log_line_at_trace() {
    let dir = scratch("standby-security-");
    let spec = dir.path().join("spec.json");
    write_json(&spec, &json!({"workspace": {}, "shell": ["/bin/sh"]}));
    let agent_logs = dir.path().join("agents");
    let tokens = Arc::new(Mutex::new(BTreeSet::new()));
    let proxy = FaultProxy::start(free_addr()).await;
    proxy.set_policy(Tap(Arc::clone(&tokens)));
    let server_log = dir.path().join("server.log");
    let server = ServerBuilder::new(&dir.path().join("data"), &server_log, &mark(&dir))
        .keep_agent_logs(&agent_logs)
        .arg("--spec")
        .arg(&spec.display().to_string())
        .args(&["--public-url", &proxy.url(), "--pool-size", "1", "--heartbeat-interval", "300ms"])
        .args(&["--linger", "2s", "--stop-grace", "2s", "--log", "trace", "--agent-log", "trace"])
        .start()
        .await;
    proxy.set_target(server.addr());
    server
        .until("a ready standby", WAIT, async || {
            server.sandboxes().await.iter().any(|sandbox| sandbox["candidate"] == true).then_some(())
        })
        .await;
    let secrets = ["trace-secret-71", "trace-cloud-72", "trace-git-73"];
    let id = server
        .submit(&json!({
            "command": ["sh", "-c", "echo \"$API_TOKEN $CLOUD_TOKEN\"; git config --get-all credential.helper"],
            "secrets": {"API_TOKEN": secrets[0]},
            "cloud_env": {"CLOUD_TOKEN": secrets[1]},
            "git_credentials": [{"protocol": "https", "host": "git.example", "username": "bot", "password": secrets[2]}],
        }))
        .await;
    let run = server
        .until("the run to end", WAIT, async || {
            let run = server.run(&id).await;
            ["exited", "failed", "cancelled"].iter().any(|t| run["state"] == *t).then_some(run)
        })
        .await;
    assert_eq!((run["state"].as_str(), run["exit_code"].as_i64()), (Some("exited"), Some(0)), "{run}");
    // The replacement standby's credential is in play too.
    server
        .until("the replacement standby", WAIT, async || {
            server.sandboxes().await.iter().any(|sandbox| sandbox["candidate"] == true).then_some(())
        })
        .await;
    let status = server.stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status} on SIGTERM");
    let tokens: Vec<String> = tokens.lock().unwrap_or_else(PoisonError::into_inner).iter().cloned().collect();
    assert!(tokens.iter().filter(|t| t.starts_with("sby_")).count() >= 2, "standby credentials seen: {tokens:?}");
    assert!(tokens.iter().any(|t| t.starts_with("run_")), "a run credential seen");
    let mut logs = vec![(server_log.clone(), std::fs::read_to_string(&server_log).unwrap_or_default())];
    for entry in std::fs::read_dir(&agent_logs).into_iter().flatten().flatten() {
        if entry.path().extension().is_some_and(|ext| ext == "log") {
            logs.push((entry.path(), std::fs::read_to_string(entry.path()).unwrap_or_default()));
        }
    }
    assert!(logs.len() >= 3, "the server's and two agents' logs");
    assert!(logs[0].1.contains("DEBUG"), "the server logged at its most verbose level");
    let mut leaks = Vec::new();
    let needles: Vec<(&str, String)> = secrets
        .iter()
        .map(|secret| ("secret value", (*secret).to_owned()))
        .chain([("API key", API_KEY.to_owned())])
        .chain(tokens.iter().map(|token| ("credential", token.clone())))
        .chain(
            tokens.iter().map(|token| ("credential secret part", token.rsplit('_').next().unwrap_or(token).to_owned())),
        )
        .collect();
    for (path, text) in &logs {
        for (what, needle) in &needles {
            if let Some(line) = text.lines().find(|line| line.contains(needle.as_str())) {
                let shown: String = line.replace(needle.as_str(), "<HERE>").chars().take(300).collect();
                leaks.push(format!("{}: a {what}: {shown}", path.display()));
            }
        }
    }
    assert!(
        leaks.is_empty(),
        "{} leaks:\n{}\n(server log tail)\n{}",
        leaks.len(),
        leaks.join("\n"),
        tail(&server_log, 5)
    );
}
