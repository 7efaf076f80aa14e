//! The real `standby` binary against the test server, from start to the
//! assignment: configuration, exit codes, heartbeats, frames, reconnects,
//! signals, retirement, preparation and its fingerprint.
//!
//! Needs the binary: `cargo build --bins` first (or set `STANDBY_BIN`).

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use standby_e2e::harness::event_kinds;
use standby_e2e::harness::{assert_exit, read_pid_file, wait_processes_gone, write_json};
use standby_e2e::server::{
    CredentialKind, Endpoint, ExecutionSetup, Failure, Frame, HeartbeatRecord, STANDBY_PREFIX, ScriptedUpgrade,
};
use standby_e2e::{AgentBuilder, AgentProcess, GitRepo, TestServer};
use standby_protocol::layout::StateDir;
use standby_protocol::{AgentState, EventKind, ExitCode, Spec, Stage};
use tempfile::TempDir;

/// Bound on every wait for the agent; generous because the machine is
/// shared with compilers.
const EXIT: Duration = Duration::from_secs(30);

fn scratch() -> TempDir {
    TempDir::with_prefix("standby-e2e-").expect("create a scratch directory")
}

fn write_spec(dir: &Path, spec: &impl serde::Serialize) -> PathBuf {
    let path = dir.join("spec.json");
    write_json(&path, spec);
    path
}

fn sh(script: &str) -> Value {
    json!(["/bin/sh", "-c", script])
}

/// A setup step that blocks until `gate` exists: the test opens the gate
/// when it has seen what it wanted during preparation.
fn gated_step(gate: &Path) -> Value {
    json!({"name": "gate", "command": sh(&format!("while [ ! -e '{}' ]; do sleep 0.02; done", gate.display()))})
}

/// An MCP server and an idle shell that write their pids into `dir`.
fn with_processes(dir: &Path) -> Value {
    json!({
        "workspace": {},
        "mcp_servers": [{"name": "sleeper", "command": sh(&format!("echo $$ > '{}/mcp.pid'; exec sleep 1000", dir.display()))}],
        "shell": sh(&format!("echo $$ > '{}/shell.pid'; exec /bin/sh", dir.display())),
    })
}

/// An agent on `server` with a spec file holding an empty workspace.
fn agent(server: &TestServer, token: &str, dir: &Path) -> AgentBuilder {
    AgentBuilder::new(&server.url(), token).spec_file(&write_spec(dir, &Spec::default()))
}

async fn wait_ready(server: &TestServer) -> HeartbeatRecord {
    server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Ready).await
}

fn line_count(path: &Path) -> usize {
    std::fs::read_to_string(path).map(|text| text.lines().count()).unwrap_or(0)
}

// ---- exit codes of the standby credential --------------------------------

async fn assert_unavailable(server: &TestServer, token: &str) {
    let dir = scratch();
    let mut agent = agent(server, token, dir.path()).spawn();
    let code = agent.wait_exit(EXIT).await;
    // The number itself, as a supervisor reads it: what a 410 on the
    // standby credential means on the wire.
    assert_eq!(code, 10, "410 on the standby credential: exit {code}\n{}", agent.output_tail());
    let upgrades = server.upgrades();
    assert_eq!(upgrades.len(), 1, "410 is not retried:\n{}", server.records().summary());
    assert_eq!(upgrades[0].status, 410);
    agent.assert_output_lacks(&[token]);
}

#[tokio::test]
async fn unknown_standby_credential_exits_10_without_retry() {
    let server = TestServer::start().await;
    assert_unavailable(&server, &format!("{STANDBY_PREFIX}never_issued_0123456789")).await;
}

#[tokio::test]
async fn retired_standby_credential_exits_10_without_retry() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    server.retire(&token, Some("pool shrunk")).expect("retire an idle standby");
    assert_unavailable(&server, &token).await;
}

#[tokio::test]
async fn expired_standby_credential_exits_10_without_retry() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    server.expire(&token).expect("expire an idle standby");
    assert_unavailable(&server, &token).await;
}

#[tokio::test]
async fn wrong_standby_credential_exits_11() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = "not-a-credential-5f2e9";
    let mut agent = agent(&server, token, dir.path()).spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Unauthorized, "401 on the standby credential");
    assert_eq!(server.upgrades().len(), 1, "401 is not retried");
    agent.assert_output_lacks(&[token]);
}

#[tokio::test]
async fn forbidden_standby_credential_exits_11() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    server.script_upgrade(ScriptedUpgrade::status(403));
    let mut agent = agent(&server, &token, dir.path()).spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Unauthorized, "403 on the standby credential");
    assert_eq!(server.upgrades().len(), 1, "403 is not retried");
}

#[tokio::test]
async fn deadline_as_a_duration_exits_12() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = agent(&server, &token, dir.path()).heartbeat_interval("200ms").deadline("2s").spawn();
    agent.watch(wait_ready(&server)).await;
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::DeadlinePassed, "deadline with no assignment");
}

#[tokio::test]
async fn deadline_as_an_rfc3339_time_exits_12() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let deadline = humantime::format_rfc3339_seconds(SystemTime::now() + Duration::from_secs(3)).to_string();
    let mut agent = agent(&server, &token, dir.path()).deadline(&deadline).spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::DeadlinePassed, "STANDBY_DEADLINE as RFC 3339 with no assignment");
}

#[tokio::test]
async fn deadline_from_the_served_spec_exits_12() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    let deadline = humantime::format_rfc3339_seconds(SystemTime::now() + Duration::from_secs(3)).to_string();
    server.set_spec(&Spec { deadline: Some(deadline), ..Spec::default() });
    let mut agent = AgentBuilder::new(&server.url(), &token).spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::DeadlinePassed, "the spec's deadline with no assignment");
}

// ---- configuration -------------------------------------------------------

#[tokio::test]
async fn bad_heartbeat_interval_exits_2_naming_the_setting_and_value() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = agent(&server, &token, dir.path()).heartbeat_interval("abc").spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Usage, "unparsable STANDBY_HEARTBEAT_INTERVAL");
    let stderr = agent.stderr();
    assert!(
        stderr.contains("abc")
            && (stderr.contains("STANDBY_HEARTBEAT_INTERVAL") || stderr.contains("heartbeat-interval")),
        "stderr names neither the setting nor the value:\n{stderr}"
    );
    assert!(server.upgrades().is_empty(), "a bad configuration connects nowhere");
}

#[tokio::test]
async fn missing_server_url_exits_2() {
    let mut agent = AgentBuilder::bare().env("STANDBY_TOKEN", "sby_x").spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Usage, "no STANDBY_SERVER_URL");
}

#[tokio::test]
async fn missing_token_exits_2() {
    let server = TestServer::start().await;
    let mut agent = AgentBuilder::new(&server.url(), "unused").env_remove("STANDBY_TOKEN").spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Usage, "no STANDBY_TOKEN");
    assert!(server.upgrades().is_empty());
}

#[tokio::test]
async fn plain_http_to_a_non_loopback_host_is_refused_without_insecure() {
    let dir = scratch();
    // TEST-NET-1: never routed, so nothing could answer anyway.
    let mut agent =
        AgentBuilder::new("http://192.0.2.1:9", "sby_x").spec_file(&write_spec(dir.path(), &Spec::default())).spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Usage, "plain http to a non-loopback host");
    let stderr = agent.stderr();
    assert!(stderr.contains("192.0.2.1") && stderr.contains("insecure"), "stderr does not explain:\n{stderr}");
}

#[tokio::test]
async fn plain_http_to_a_non_loopback_host_is_allowed_with_insecure() {
    let dir = scratch();
    let mut agent = AgentBuilder::new("http://192.0.2.1:9", "sby_x")
        .spec_file(&write_spec(dir.path(), &Spec::default()))
        .arg("--insecure")
        .deadline("2s")
        .spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::DeadlinePassed, "accepted with --insecure; nothing answers until the deadline");
}

// ---- heartbeats and frames -----------------------------------------------

#[tokio::test]
async fn a_heartbeat_is_sent_at_once_on_every_connection() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    // With an interval of an hour, any heartbeat seen is the one sent on
    // connection.
    let mut agent = agent(&server, &token, dir.path()).heartbeat_interval("1h").spawn();
    let first = agent.watch(server.wait_for_heartbeat(|_| true)).await;
    assert_eq!(first.credential, CredentialKind::Standby);
    assert_eq!(first.execution_id, None);
    server.drop_connection(first.connection).expect("drop the first connection");
    let second = agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.connection != first.connection)).await;
    assert_eq!(second.credential, CredentialKind::Standby);
    server.assert_no_violations();
}

#[tokio::test]
async fn heartbeats_follow_the_interval_from_preparing_to_ready() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let gate = dir.path().join("gate");
    let spec = write_spec(dir.path(), &json!({"workspace": {"setup": [gated_step(&gate)]}}));
    let mut agent = AgentBuilder::new(&server.url(), &token).spec_file(&spec).heartbeat_interval("200ms").spawn();

    let preparing =
        agent.watch(server.wait_for_heartbeats(3, |heartbeat| heartbeat.state == AgentState::Preparing)).await;
    assert!(
        preparing.iter().all(|heartbeat| heartbeat.connection == preparing[0].connection),
        "three heartbeats on one connection while preparing"
    );
    std::fs::write(&gate, "").expect("open the gate");
    agent.watch(wait_ready(&server)).await;
    agent.watch(server.wait_for_heartbeats(2, |heartbeat| heartbeat.state == AgentState::Ready)).await;

    let states: Vec<AgentState> = server.heartbeats().iter().map(|heartbeat| heartbeat.state).collect();
    let first_ready = states.iter().position(|state| *state == AgentState::Ready).expect("a ready heartbeat");
    assert!(
        states[..first_ready].iter().all(|state| *state == AgentState::Preparing)
            && states[first_ready..].iter().all(|state| *state == AgentState::Ready),
        "states go from preparing to ready once: {states:?}"
    );
    assert_eq!(server.connections().len(), 1);
    server.retire(&token, None).expect("retire");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "retired");
    server.assert_no_violations();
}

/// Readiness is sent when it happens, not at the next tick: with an
/// interval of an hour, the only heartbeats on the connection are the one
/// sent on connection (preparing, the gate still closed) and the one sent
/// when the state changes, so a ready heartbeat arrives only if the change
/// is sent at once.
#[tokio::test]
async fn a_change_of_state_is_sent_at_once() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let gate = dir.path().join("gate");
    let spec = write_spec(dir.path(), &json!({"workspace": {"setup": [gated_step(&gate)]}}));
    let mut agent = AgentBuilder::new(&server.url(), &token).spec_file(&spec).heartbeat_interval("1h").spawn();

    let first = agent.watch(server.wait_for_heartbeat(|_| true)).await;
    assert_eq!(first.state, AgentState::Preparing, "the gate holds preparation until the first heartbeat is seen");
    std::fs::write(&gate, "").expect("open the gate");
    let ready = agent.watch(wait_ready(&server)).await;
    assert_eq!(ready.connection, first.connection, "on the same connection, not a reconnect");
    let states: Vec<AgentState> = server.heartbeats().iter().map(|heartbeat| heartbeat.state).collect();
    assert_eq!(states, [AgentState::Preparing, AgentState::Ready], "one heartbeat per state");
    server.retire(&token, None).expect("retire");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "retired");
    server.assert_no_violations();
}

#[tokio::test]
async fn server_pings_cause_no_reconnect() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    server.set_ping_interval(Some(Duration::from_millis(50)));
    let mut agent = agent(&server, &token, dir.path()).heartbeat_interval("200ms").spawn();
    // Eight heartbeats at 200 ms: well over twenty pings.
    agent.watch(server.wait_for_heartbeats(8, |_| true)).await;
    let records = server.records();
    assert_eq!(records.connections.len(), 1, "pings made the agent reconnect:\n{}", records.summary());
    assert_eq!(records.upgrades.len(), 1);
    assert!(records.connections[0].is_open());
    assert!(records.connections[0].pongs > 0, "pings must be answered (RFC 6455 5.5.2)");
    server.assert_no_violations();
}

#[tokio::test]
async fn binary_unknown_and_malformed_frames_are_skipped() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = agent(&server, &token, dir.path()).heartbeat_interval("200ms").spawn();
    let first = agent.watch(server.wait_for_heartbeat(|_| true)).await;
    let connection = first.connection;
    let frames = [
        Frame::Binary(vec![0xde, 0xad, 0xbe, 0xef]),
        Frame::Pong(b"unsolicited".to_vec()),
        Frame::Text(r#"{"type":"resize","rows":40}"#.into()),
        Frame::Text("this is not JSON".into()),
        Frame::Text("[1,2,3]".into()),
        Frame::Text(r#"{"kind":"assignment"}"#.into()),
        Frame::Text(r#"{"type":7}"#.into()),
        Frame::Text(r#"{"type":"cancel"}"#.into()),
        Frame::Text(r#"{"type":"assignment","execution_id":"exe_bogus"}"#.into()),
    ];
    for frame in frames {
        server.send(connection, frame).expect("send to the live connection");
    }
    let sent = server.heartbeats().len();
    server
        .wait_until("three heartbeats after the junk", |records| {
            (records.heartbeats_on(connection).len() >= sent + 3).then_some(())
        })
        .await;
    assert_eq!(server.connections().len(), 1, "junk frames made the agent reconnect");
    server.retire(&token, Some("still listening?")).expect("retire");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "retired after the junk frames");
    server.assert_no_violations();
}

// ---- reconnecting --------------------------------------------------------

/// Milliseconds from each connection's end to the next upgrade attempt.
fn reconnect_gaps(server: &TestServer) -> Vec<u128> {
    let records = server.records();
    records
        .connections
        .iter()
        .filter_map(|connection| {
            let closed = connection.closed_at?;
            let next = records.upgrades.iter().find(|upgrade| upgrade.at > closed)?;
            Some(next.at.duration_since(closed).as_millis())
        })
        .collect()
}

#[tokio::test]
async fn reconnects_after_close_frames_and_dropped_connections_with_growing_backoff() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = agent(&server, &token, dir.path()).heartbeat_interval("1h").spawn();
    let first = agent.watch(server.wait_for_heartbeat(|_| true)).await.connection;
    server.send(first, Frame::Close(Some((1001, "going away".into())))).expect("close");
    agent.watch(server.wait_for_close(first)).await;
    for round in 2..=5 {
        let heartbeat = agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.connection.0 >= round)).await;
        if round < 5 {
            server.drop_connection(heartbeat.connection).expect("drop");
            agent.watch(server.wait_for_close(heartbeat.connection)).await;
        }
    }
    let gaps = reconnect_gaps(&server);
    assert_eq!(gaps.len(), 4, "{gaps:?}");
    assert!(
        gaps[3] > gaps[0],
        "the reconnect delay must grow while connections keep dropping; gaps in ms: {gaps:?}\n{}",
        server.records().summary()
    );
    server.retire(&token, None).expect("retire");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "retired");
}

#[tokio::test]
async fn transient_upgrade_failures_back_off_exponentially() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    for status in [503, 502, 500, 429] {
        server.script_upgrade(ScriptedUpgrade::status(status));
    }
    let mut agent = agent(&server, &token, dir.path()).spawn();
    agent.watch(server.wait_for_heartbeat(|_| true)).await;
    let upgrades = server.upgrades();
    let statuses: Vec<u16> = upgrades.iter().map(|upgrade| upgrade.status).collect();
    assert_eq!(statuses, [503, 502, 500, 429, 101]);
    let gaps: Vec<u128> = upgrades.windows(2).map(|pair| pair[1].at.duration_since(pair[0].at).as_millis()).collect();
    assert!(gaps[3] > gaps[0], "backoff must grow; gaps in ms: {gaps:?}");
}

#[tokio::test]
async fn retry_after_is_honoured() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    server.script_upgrade(ScriptedUpgrade::status(503).retry_after(3));
    server.script_upgrade(ScriptedUpgrade::status(429).retry_after(2));
    let mut agent = agent(&server, &token, dir.path()).spawn();
    agent.watch(server.wait_for_heartbeat(|_| true)).await;
    let upgrades = server.upgrades();
    assert_eq!(upgrades.len(), 3);
    // Lower bounds only: the agent may wait longer, never shorter.
    assert!(upgrades[1].at.duration_since(upgrades[0].at) >= Duration::from_secs(3), "Retry-After: 3 ignored");
    assert!(upgrades[2].at.duration_since(upgrades[1].at) >= Duration::from_secs(2), "Retry-After: 2 ignored");
}

// ---- stopping ------------------------------------------------------------

async fn started_with_processes(server: &TestServer, token: &str, dir: &Path) -> (AgentProcess, Vec<i32>) {
    let spec = write_spec(dir, &with_processes(dir));
    let mut agent = AgentBuilder::new(&server.url(), token).spec_file(&spec).heartbeat_interval("200ms").spawn();
    agent.watch(wait_ready(server)).await;
    let mcp = agent.watch(read_pid_file(&dir.join("mcp.pid"), EXIT)).await;
    let shell = agent.watch(read_pid_file(&dir.join("shell.pid"), EXIT)).await;
    let descendants = agent.descendants();
    for pid in [mcp, shell] {
        assert!(descendants.contains(&pid), "{pid} is not a descendant of the agent: {descendants:?}");
    }
    (agent, vec![mcp, shell])
}

#[tokio::test]
async fn sigterm_while_waiting_exits_0_and_leaves_no_process() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let (mut agent, pids) = started_with_processes(&server, &token, dir.path()).await;
    agent.signal(Signal::SIGTERM);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "SIGTERM while waiting");
    wait_processes_gone(&pids, EXIT).await;
    agent.wait_no_leftovers(EXIT).await;
}

#[tokio::test]
async fn retired_exits_0_and_stops_mcp_servers_and_the_shell() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let (mut agent, pids) = started_with_processes(&server, &token, dir.path()).await;
    server.retire(&token, Some("pool shrunk")).expect("retire");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "retired");
    wait_processes_gone(&pids, EXIT).await;
    agent.wait_no_leftovers(EXIT).await;
    server.assert_no_violations();
}

// ---- preparation ---------------------------------------------------------

fn counting_spec(repo: &GitRepo, log: &Path, timeout_s: u64) -> Value {
    json!({"workspace": {
        "repos": [{"url": repo.url(), "path": "app", "ref": "main"}],
        "setup": [{"name": "count", "command": sh(&format!("echo ran >> '{}'", log.display())),
                   "cwd": "app", "timeout_s": timeout_s}],
    }})
}

/// Runs one agent on `workspace` until ready, then retires it.
async fn prepare_once(server: &TestServer, workspace: &Path, spec: &Path) -> AgentProcess {
    let token = server.add_standby();
    let mut agent = AgentBuilder::new(&server.url(), &token)
        .workspace(workspace)
        .spec_file(spec)
        .heartbeat_interval("200ms")
        .spawn();
    let ready = server.wait_until("this agent's ready heartbeat", |records| {
        records
            .heartbeats
            .iter()
            .filter(|heartbeat| heartbeat.state == AgentState::Ready)
            .find(|heartbeat| {
                records.connection(heartbeat.connection).is_some_and(|connection| connection.standby_token == token)
            })
            .map(drop)
    });
    agent.watch(ready).await;
    server.retire(&token, None).expect("retire");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "retired after preparing");
    agent
}

#[tokio::test]
async fn restart_on_a_prepared_workspace_skips_clone_and_setup() {
    let server = TestServer::start().await;
    let dir = scratch();
    let workspace = dir.path().join("workspace");
    std::fs::create_dir(&workspace).expect("create the workspace");
    let repo = GitRepo::new(&[("README.md", "hello\n")]);
    let log = dir.path().join("setup.log");
    let spec = write_spec(dir.path(), &counting_spec(&repo, &log, 60));

    prepare_once(&server, &workspace, &spec).await;
    assert_eq!(line_count(&log), 1, "the setup step ran once");
    assert_eq!(std::fs::read_to_string(workspace.join("app/README.md")).expect("cloned"), "hello\n");
    assert!(StateDir::of(&workspace).state_file().is_file(), "the fingerprint is recorded");

    // A new commit upstream would show if the second agent cloned again.
    repo.commit(&[("NEW.md", "new\n")]);
    prepare_once(&server, &workspace, &spec).await;
    assert_eq!(line_count(&log), 1, "a matching fingerprint skips setup");
    assert!(!workspace.join("app/NEW.md").exists(), "a matching fingerprint skips the clone");
}

#[tokio::test]
async fn a_changed_workspace_spec_prepares_again() {
    let server = TestServer::start().await;
    let dir = scratch();
    let workspace = dir.path().join("workspace");
    std::fs::create_dir(&workspace).expect("create the workspace");
    let repo = GitRepo::new(&[("README.md", "hello\n")]);
    let log = dir.path().join("setup.log");

    prepare_once(&server, &workspace, &write_spec(dir.path(), &counting_spec(&repo, &log, 60))).await;
    prepare_once(&server, &workspace, &write_spec(dir.path(), &counting_spec(&repo, &log, 61))).await;
    assert_eq!(line_count(&log), 2, "another fingerprint runs setup again");
}

async fn assert_path_refused(repo_path: &str) {
    let server = TestServer::start().await;
    let dir = scratch();
    let workspace = dir.path().join("workspace");
    std::fs::create_dir(&workspace).expect("create the workspace");
    let repo = GitRepo::new(&[("README.md", "hello\n")]);
    let spec = json!({"workspace": {"repos": [{"url": repo.url(), "path": repo_path}]}});
    let token = server.add_standby();
    let mut agent = AgentBuilder::new(&server.url(), &token)
        .workspace(&workspace)
        .spec_file(&write_spec(dir.path(), &spec))
        .spawn();
    let code = agent.wait_exit(EXIT).await;
    // 15: preparation failed with no assignment held (the agent's own code;
    // the contract leaves it open).
    assert_exit(&agent, code, ExitCode::PrepareFailed, "a repo path leaving the workspace");
    assert!(agent.output().contains(repo_path), "the refusal does not name {repo_path:?}\n{}", agent.output_tail());
    assert!(!dir.path().join("escape").exists(), "something was written outside the workspace");
}

#[tokio::test]
async fn a_repo_path_leaving_the_workspace_is_refused() {
    assert_path_refused("../escape").await;
}

#[tokio::test]
async fn a_repo_path_leaving_the_workspace_through_a_subdirectory_is_refused() {
    assert_path_refused("app/../../escape").await;
}

#[tokio::test]
async fn an_absolute_repo_path_is_refused() {
    let dir = scratch();
    assert_path_refused(&dir.path().join("escape").display().to_string()).await;
}

#[tokio::test]
async fn the_spec_is_fetched_from_the_server_without_a_spec_file() {
    let server = TestServer::start().await;
    let dir = scratch();
    let marker = dir.path().join("marker");
    server.set_spec_json(json!({"workspace": {"setup": [
        {"name": "mark", "command": sh(&format!("echo served > '{}'", marker.display()))}
    ]}}));
    server.fail(Endpoint::Spec, Failure::times(503, 2));
    let token = server.add_standby();
    let mut agent = AgentBuilder::new(&server.url(), &token).heartbeat_interval("200ms").spawn();
    agent.watch(wait_ready(&server)).await;
    assert_eq!(std::fs::read_to_string(&marker).expect("the served spec's setup ran"), "served\n");
    let spec_calls: Vec<u16> = server
        .http_calls()
        .iter()
        .filter(|call| call.endpoint == Endpoint::Spec)
        .map(|call| {
            assert_eq!(
                call.credential,
                Some(CredentialKind::Standby),
                "the spec is fetched with the standby credential"
            );
            call.status
        })
        .collect();
    assert_eq!(spec_calls, [503, 503, 200], "transient failures of the spec fetch are retried");
    server.retire(&token, None).expect("retire");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "retired");
}

#[tokio::test]
async fn an_assignment_during_preparation_is_held_then_installed() {
    let server = TestServer::start().await;
    let dir = scratch();
    let gate = dir.path().join("gate");
    server.set_spec_json(json!({"workspace": {"setup": [gated_step(&gate)]}}));
    let token = server.add_standby();
    let mut agent = AgentBuilder::new(&server.url(), &token).heartbeat_interval("200ms").spawn();
    agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Preparing)).await;

    let setup = ExecutionSetup::new(&["/bin/sh", "-c", "echo run-output"]).secret("API_KEY", "s3cr3t-value-91");
    let execution_id = server.assign(&token, setup);
    let held = agent
        .watch(server.wait_for_heartbeat(|heartbeat| heartbeat.execution_id.as_deref() == Some(&execution_id)))
        .await;
    assert_eq!(held.state, AgentState::Preparing, "the assignment is held while preparing");

    // Delivery may be confirmed at once; the install waits for preparation.
    let opened = tokio::time::Instant::now();
    std::fs::write(&gate, "").expect("open the gate");
    agent.watch(server.wait_for_connection(|connection| connection.credential == CredentialKind::Run)).await;
    let exited =
        agent.watch(server.wait_for_event(&execution_id, |kind| matches!(kind, EventKind::Exited { .. }))).await;
    assert_eq!(exited.kind, EventKind::Exited { code: 0 });
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");

    let early: Vec<String> = server
        .http_calls()
        .iter()
        .filter(|call| call.endpoint.is_install() && call.started < opened)
        .map(|call| call.path.clone())
        .collect();
    assert!(early.is_empty(), "the install ran before preparation finished: {early:?}");
    assert!(
        server.http_calls().iter().any(|call| call.endpoint == Endpoint::Secrets),
        "the held assignment was installed"
    );
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
    let credential = server.run_credential(&execution_id).expect("minted");
    agent.assert_output_lacks(&[&token, &credential, "s3cr3t-value-91"]);
    server.assert_no_violations();
}

// ---- bounds, log format, usage ---------------------------------------------

#[tokio::test]
async fn an_oversized_frame_drops_the_connection_and_the_agent_reconnects() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = agent(&server, &token, dir.path()).heartbeat_interval("200ms").spawn();
    let first = agent.watch(server.wait_for_heartbeat(|_| true)).await;
    // Just over the documented 1 MiB bound, in a frame that is otherwise valid.
    let padding = "x".repeat(1 << 20);
    let oversized = format!(r#"{{"type":"retired","reason":"{padding}"}}"#);
    server.send(first.connection, Frame::Text(oversized)).expect("send to the live connection");
    agent.watch(server.wait_for_close(first.connection)).await;
    let second = agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.connection != first.connection)).await;
    assert_ne!(second.connection, first.connection);
    // The oversized `retired` was never acted on; a normal one still is.
    server.retire(&token, None).expect("retire");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "retired after reconnecting");
}

#[tokio::test]
async fn json_log_format_writes_one_json_object_per_line() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent =
        agent(&server, &token, dir.path()).heartbeat_interval("200ms").log_format("json").log_filter("debug").spawn();
    agent.watch(wait_ready(&server)).await;
    server.retire(&token, None).expect("retire");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "retired");
    let stderr = agent.stderr();
    let lines: Vec<&str> = stderr.lines().filter(|line| !line.trim().is_empty()).collect();
    assert!(lines.len() > 3, "too few log lines:\n{stderr}");
    for line in lines {
        let value: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(value.get("level").is_some() && value.get("message").is_some(), "{line}");
    }
    agent.assert_output_lacks(&[&token]);
}

#[tokio::test]
async fn help_and_version_exit_0_and_explain_the_settings() {
    for (arg, needles) in [
        ("--help", &["STANDBY_SERVER_URL", "STANDBY_HEARTBEAT_INTERVAL", "Exit codes", "14"][..]),
        ("--version", &["standby "][..]),
    ] {
        let output = std::process::Command::new(standby_e2e::harness::standby_bin())
            .arg(arg)
            .env("STANDBY_TOKEN", "never-printed")
            .output()
            .expect("run standby");
        assert!(output.status.success(), "{arg}: {:?}", output.status);
        let text = String::from_utf8_lossy(&output.stdout);
        for needle in needles {
            assert!(text.contains(needle), "{arg} lacks {needle:?}:\n{text}");
        }
        assert!(!text.contains("never-printed"), "{arg} printed the token");
    }
}

#[tokio::test]
async fn a_failing_setup_step_exits_15_naming_the_step_and_its_status() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let spec = json!({"workspace": {"setup": [
        {"name": "fine", "command": ["true"]},
        {"name": "deps", "command": sh("echo installing; exit 3")},
        {"name": "never", "command": sh(&format!("touch '{}/never-ran'", dir.path().display()))},
    ]}});
    let mut agent = AgentBuilder::new(&server.url(), &token).spec_file(&write_spec(dir.path(), &spec)).spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::PrepareFailed, "a setup step failed");
    let output = agent.output();
    assert!(output.contains("\"deps\"") && output.contains("exit status 3"), "{}", agent.output_tail());
    assert!(!dir.path().join("never-ran").exists(), "a later step ran after the failure");
    let log = std::fs::read_to_string(StateDir::of(agent.workspace()).setup_log()).expect("setup.log");
    assert!(log.contains("installing"), "the step's output is kept in setup.log:\n{log}");
}

#[tokio::test]
async fn a_refused_spec_fetch_exits_like_a_refused_socket() {
    for (status, expected) in
        [(401, ExitCode::Unauthorized), (403, ExitCode::Unauthorized), (410, ExitCode::Unavailable)]
    {
        let server = TestServer::start().await;
        let token = server.add_standby();
        server.set_spec(&Spec::default());
        server.fail(Endpoint::Spec, Failure::always(status));
        let mut agent = AgentBuilder::new(&server.url(), &token).spawn();
        let code = agent.wait_exit(EXIT).await;
        assert_exit(&agent, code, expected, &format!("spec answered {status}"));
    }
}

#[tokio::test]
async fn an_unreadable_or_malformed_spec_file_exits_2_naming_it() {
    let dir = scratch();
    let malformed = dir.path().join("malformed.json");
    std::fs::write(&malformed, r#"{"workspace": {"repos": "not a list"}}"#).expect("write");
    for (path, needle) in [(dir.path().join("missing.json"), "missing.json"), (malformed.clone(), "malformed.json")] {
        let mut agent = AgentBuilder::new("http://127.0.0.1:9", "token-x").spec_file(&path).spawn();
        let code = agent.wait_exit(EXIT).await;
        assert_exit(&agent, code, ExitCode::Usage, "bad spec file");
        let stderr = agent.stderr();
        assert!(stderr.contains("STANDBY_SPEC") && stderr.contains(needle), "{stderr}");
    }
}

#[tokio::test]
async fn a_spec_still_unfetched_when_the_assignment_arrives_fails_the_install_instead_of_hanging() {
    // A cold sandbox can be assigned before it has its spec. The switch to
    // the run credential waits for the spec (a standby call); a spec that
    // never comes fails the install at the confirm timeout, requeueable,
    // and the spec is never asked for with the run credential.
    let server = TestServer::start().await;
    let token = server.add_standby();
    server.set_spec(&Spec::default());
    server.fail(Endpoint::Spec, Failure::always(503));
    let mut agent = AgentBuilder::new(&server.url(), &token).heartbeat_interval("200ms").confirm_timeout("2s").spawn();
    agent.watch(server.wait_for_http_call(|call| call.endpoint == Endpoint::Spec && call.status == 503)).await;
    let execution_id = server.assign(&token, ExecutionSetup::new(&["true"]));
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::InstallFailed, "the spec could not be fetched after the assignment");
    let failures = server.install_failures(&execution_id);
    assert_eq!(failures.len(), 1, "{}", server.records().summary());
    assert_eq!(failures[0].stage, Stage::Confirm.name());
    assert!(failures[0].requeueable);
    let run_credential_tried = server
        .http_calls()
        .iter()
        .any(|call| call.endpoint == Endpoint::Spec && call.credential == Some(CredentialKind::Run));
    assert!(!run_credential_tried, "the spec fetch presented the run credential");
}
