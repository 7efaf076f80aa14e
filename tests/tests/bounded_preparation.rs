//! Preparation is bounded (amendment 4): the real `standby` binary whose
//! clone hangs on a server that accepts connections and never answers,
//! with `STANDBY_PREPARE_TIMEOUT=2s`. Without an assignment it exits 15;
//! with one held it reports `install_failed` (stage `prepare`,
//! requeueable) and exits 13. Either way git is killed and reaped.
//!
//! Needs the binary: `cargo build --bins` first (or set `STANDBY_BIN`).

use std::net::TcpListener;
use std::path::Path;
use std::time::Duration;

use serde_json::json;
use standby_e2e::harness::{assert_exit, write_json};
use standby_e2e::server::ExecutionSetup;
use standby_e2e::{AgentBuilder, AgentProcess, TestServer};
use standby_protocol::{AgentState, ExitCode, Stage};
use tempfile::TempDir;

/// Bound on every wait for the agent; generous because the machine is
/// shared with compilers.
const EXIT: Duration = Duration::from_secs(30);

/// A listener whose connections complete (the kernel accepts them into its
/// backlog) and are never answered.
fn silent_server() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0")
}

/// An agent preparing a clone from `silent`, bounded to 2 s.
fn hanging_agent(server: &TestServer, token: &str, dir: &Path, silent: &TcpListener) -> AgentProcess {
    let port = silent.local_addr().expect("a bound listener has an address").port();
    let spec = json!({"workspace": {"repos": [{"url": format!("http://127.0.0.1:{port}/app.git"), "path": "app", "ref": "main"}]}});
    let path = dir.join("spec.json");
    write_json(&path, &spec);
    AgentBuilder::new(&server.url(), token)
        .spec_file(&path)
        .heartbeat_interval("200ms")
        .env("STANDBY_PREPARE_TIMEOUT", "2s")
        .spawn()
}

fn scratch() -> TempDir {
    TempDir::with_prefix("standby-e2e-prepare-").expect("create a scratch directory")
}

#[tokio::test]
async fn a_clone_that_never_answers_ends_preparation_with_exit_15() {
    let server = TestServer::start().await;
    let silent = silent_server();
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = hanging_agent(&server, &token, dir.path(), &silent);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::PrepareFailed, "preparation failed");
    assert!(agent.output().contains("STANDBY_PREPARE_TIMEOUT"), "the log names the bound\n{}", agent.output_tail());
    assert!(agent.leftovers().is_empty(), "git outlived the agent: {:?}", agent.leftovers());
    assert!(
        !server.heartbeats().iter().any(|heartbeat| heartbeat.state == AgentState::Ready),
        "the agent claimed to be ready"
    );
    server.assert_no_violations();
}

#[tokio::test]
async fn a_clone_that_never_answers_fails_a_held_assignment_requeueable() {
    let server = TestServer::start().await;
    let silent = silent_server();
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = hanging_agent(&server, &token, dir.path(), &silent);
    agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Preparing)).await;
    let marker = dir.path().join("ran");
    let execution_id =
        server.assign(&token, ExecutionSetup::new(&["/bin/sh", "-c", &format!("touch '{}'", marker.display())]));
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::InstallFailed, "the install failed");
    let failures = server.install_failures(&execution_id);
    assert_eq!(failures.len(), 1, "one install_failed: {:?}", server.events(&execution_id));
    assert_eq!(failures[0].stage, Stage::Prepare.name());
    assert!(failures[0].requeueable, "{:?}", failures[0]);
    assert!(failures[0].message.contains("preparation did not finish within 2s"), "{:?}", failures[0].message);
    assert!(!marker.exists(), "the run started");
    assert!(agent.leftovers().is_empty(), "git outlived the agent: {:?}", agent.leftovers());
    server.assert_no_violations();
}
