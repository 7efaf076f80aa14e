//! The real `standby` binary against the test server, from the assignment
//! to the end of the run: delivery confirmation, withdrawal, the install and
//! its failures, MCP restarts, the run's world, redaction of its output,
//! cancel, SIGTERM, exit codes, the install's overlap and event retries.
//!
//! Needs the binary: `cargo build --bins` first (or set `STANDBY_BIN`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use standby_e2e::harness::{assert_exit, event_kinds, read_pid_file, ready_agent, wait_group_gone};
use standby_e2e::server::{
    ConnectionId, CredentialKind, Endpoint, ExecutionSetup, Failure, InstallFailed, Records, Revocation,
    ScriptedUpgrade,
};
use standby_e2e::{AgentBuilder, AgentProcess, GitRepo, TestServer};
use standby_protocol::{AgentState, EventKind, ExitCode, Spec, Stage, Workspace};
use tempfile::TempDir;

/// Bound on every wait for the agent; generous because the machine is
/// shared with compilers.
const EXIT: Duration = Duration::from_secs(30);

/// The calls of the install's network group.
const INSTALL_ENDPOINTS: [Endpoint; 6] = [
    Endpoint::Secrets,
    Endpoint::Attachments,
    Endpoint::AttachmentFile,
    Endpoint::GitCredentials,
    Endpoint::Metadata,
    Endpoint::CloudCredentials,
];

/// An MCP server that dumps its environment into `$PROBE_DUMP_DIR` (when
/// set) as `env-<pid>.json`, fails at once when `PROBE_FAIL` is set, and
/// otherwise listens on port `argv[1]` (its `ready_tcp`).
const PROBE: &str = r#"
import json, os, socket, sys
dump_dir = os.environ.get("PROBE_DUMP_DIR")
if dump_dir:
    path = os.path.join(dump_dir, "env-%d.json" % os.getpid())
    with open(path + ".tmp", "w") as f:
        json.dump(dict(os.environ), f)
    os.rename(path + ".tmp", path)
if os.environ.get("PROBE_FAIL"):
    sys.exit("failing on purpose")
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(16)
while True:
    s.accept()[0].close()
"#;

fn scratch() -> TempDir {
    TempDir::with_prefix("standby-e2e-run-").expect("create a scratch directory")
}

fn sh(script: &str) -> Vec<String> {
    vec!["/bin/sh".to_owned(), "-c".to_owned(), script.to_owned()]
}

fn setup(script: &str) -> ExecutionSetup {
    let argv = sh(script);
    ExecutionSetup::new(&argv.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Appends a line to `marker`: the run's only trace, so a test can prove it
/// never ran (or ran once).
fn mark(marker: &Path) -> String {
    format!("echo ran >> '{}'", marker.display())
}

/// Blocks until `gate` exists: the test opens it when it has seen what it
/// wanted while the run was running.
fn wait_gate(gate: &Path) -> String {
    format!("while [ ! -e '{}' ]; do sleep 0.02; done", gate.display())
}

fn line_count(path: &Path) -> usize {
    std::fs::read_to_string(path).map(|text| text.lines().count()).unwrap_or(0)
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("a bound listener has an address").port()
}

/// An MCP server running [`PROBE`] on a fresh port, with `env` as its spec env.
fn probe_server(dir: &Path, name: &str, env: &Value) -> Value {
    let script = dir.join("probe.py");
    std::fs::write(&script, PROBE).expect("write the probe server");
    let port = free_port();
    json!({
        "name": name,
        "command": ["python3", script.display().to_string(), port.to_string()],
        "env": env,
        "ready_tcp": format!("127.0.0.1:{port}"),
    })
}

fn workspace(value: &Value) -> Workspace {
    serde_json::from_value(value.clone()).expect("a workspace")
}

/// Statuses of the upgrade attempts made with the run credential.
fn run_upgrades(server: &TestServer) -> Vec<u16> {
    server
        .upgrades()
        .iter()
        .filter(|upgrade| upgrade.credential == Some(CredentialKind::Run))
        .map(|upgrade| upgrade.status)
        .collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

fn count(haystack: &[u8], needle: &[u8]) -> usize {
    haystack.windows(needle.len()).filter(|window| *window == needle).count()
}

// ---- delivery confirmation -------------------------------------------------

#[tokio::test]
async fn the_run_starts_exactly_once_under_replays_on_both_connections() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent).await;
    let (marker, gate) = (dir.path().join("marker"), dir.path().join("gate"));
    // Holds the install, so that replays also arrive while installing.
    server.set_endpoint_latency(Endpoint::Secrets, Duration::from_millis(1500));
    let standby_connection = server.connections()[0].id;
    let execution_id =
        server.assign(&token, setup(&format!("{}; {}", mark(&marker), wait_gate(&gate))).secret("API_KEY", "k-1"));
    let frame = server.assignment_frame(&execution_id).expect("the execution exists");
    // Queued right behind the assignment on the standby connection. The
    // agent may close that connection (it switches to the run credential at
    // once) before it reads them: the lifecycle's unit tests cover replays
    // on the standby connection; what matters here is that none starts a
    // second run.
    for _ in 0..3 {
        let _ = server.send_text(standby_connection, &frame);
    }

    // The first run-credential connection after `after` that sent a heartbeat.
    let on_run = |records: &Records, after: ConnectionId| {
        records
            .heartbeats
            .iter()
            .find(|heartbeat| heartbeat.credential == CredentialKind::Run && heartbeat.connection > after)
            .map(|heartbeat| heartbeat.connection)
    };
    let first =
        agent.watch(server.wait_until("a run-credential connection", |records| on_run(records, ConnectionId(0)))).await;
    for _ in 0..3 {
        server.send_text(first, &frame).expect("replay on the run connection");
    }
    // A reconnect is replayed the assignment by the server itself.
    server.drop_connection(first).expect("drop the run connection");
    let second =
        agent.watch(server.wait_until("a second run-credential connection", |records| on_run(records, first))).await;
    for _ in 0..2 {
        server.send_text(second, &frame).expect("replay on the new run connection");
    }

    agent.watch(server.wait_for_event(&execution_id, |kind| *kind == EventKind::Started)).await;
    for _ in 0..3 {
        let _ = server.send_text(second, &frame);
    }
    server.drop_connection(second).expect("drop the run connection while running");
    let third =
        agent.watch(server.wait_until("a third run-credential connection", |records| on_run(records, second))).await;
    for _ in 0..3 {
        server.send_text(third, &frame).expect("replay while running");
    }
    // No event exists for "the agent has read the replays": two heartbeats
    // on the connection after them are the best available sign.
    let sent = server.records().heartbeats_on(third).len();
    agent
        .watch(server.wait_until("two heartbeats after the replays", |records| {
            (records.heartbeats_on(third).len() >= sent + 2).then_some(())
        }))
        .await;
    std::fs::write(&gate, "").expect("open the gate");

    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(
        event_kinds(&server, &execution_id),
        [EventKind::Started, EventKind::Exited { code: 0 }],
        "{}",
        server.records().summary()
    );
    assert_eq!(line_count(&marker), 1, "the run's command ran more than once (or never)");
    server.assert_no_violations();
}

/// How the run credential is refused when the agent presents it.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    /// Revoked (the run was superseded) between a first, scripted `503`
    /// upgrade and the retry, so the retry meets the revocation whatever
    /// the timing; the server answers a revoked credential with this status.
    Revoked(u16),
    /// The first upgrade is answered with this status.
    Scripted(u16),
}

/// Events posts the server received, accepted or refused: the server
/// refuses a withdrawn run's credential, so a refused report is not among
/// the events it recorded.
fn event_posts(server: &TestServer) -> usize {
    server.http_calls().iter().filter(|call| call.endpoint == Endpoint::Events).count()
}

async fn revoke_when_attempted(server: &TestServer, execution_id: &str) {
    server
        .wait_until("a first upgrade with the run credential", |records| {
            records.upgrades.iter().any(|upgrade| upgrade.credential == Some(CredentialKind::Run)).then_some(())
        })
        .await;
    server.revoke_run(execution_id, Revocation::Superseded).expect("revoke the run credential");
}

async fn assert_withdrawn(refusal: Refusal) {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent).await;
    // The install's calls are held so that the socket's refusal, not a
    // refused install call, is what the agent meets first.
    for endpoint in INSTALL_ENDPOINTS {
        server.set_endpoint_latency(endpoint, Duration::from_secs(3));
    }
    let (first, refused) = match refusal {
        Refusal::Revoked(status) => {
            server.set_revoked_run_status(status);
            (503, status)
        }
        Refusal::Scripted(status) => (status, status),
    };
    server.script_upgrade(ScriptedUpgrade::status(first).for_credential(CredentialKind::Run));
    let marker = dir.path().join("marker");
    let execution_id = server.assign(&token, setup(&mark(&marker)).secret("API_KEY", "withdrawn-secret-1"));
    if let Refusal::Revoked(_) = refusal {
        agent.watch(revoke_when_attempted(&server, &execution_id)).await;
    }
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Withdrawn, "the run credential was refused");
    assert!(
        server.events(&execution_id).is_empty() && event_posts(&server) == 0,
        "a withdrawn run reports nothing: {:?}",
        server.events(&execution_id)
    );
    assert!(!marker.exists(), "a withdrawn run never starts");
    let expected: &[u16] = if first == refused { &[refused] } else { &[first, refused] };
    assert_eq!(run_upgrades(&server), expected, "{}", server.records().summary());
    server.assert_no_violations();
}

#[tokio::test]
async fn a_run_credential_revoked_with_401_withdraws_the_run() {
    assert_withdrawn(Refusal::Revoked(401)).await;
}

#[tokio::test]
async fn a_run_credential_revoked_with_410_withdraws_the_run() {
    assert_withdrawn(Refusal::Revoked(410)).await;
}

#[tokio::test]
async fn a_run_credential_answered_403_withdraws_the_run() {
    assert_withdrawn(Refusal::Scripted(403)).await;
}

#[tokio::test]
async fn a_run_credential_refused_on_an_install_call_withdraws_the_run() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent).await;
    // The socket only ever meets transient answers, so only the install's
    // calls (held until the revocation is in place) can tell the agent that
    // its credential was revoked.
    for _ in 0..40 {
        server.script_upgrade(ScriptedUpgrade::status(503).for_credential(CredentialKind::Run));
    }
    for endpoint in INSTALL_ENDPOINTS {
        server.set_endpoint_latency(endpoint, Duration::from_millis(500));
    }
    let marker = dir.path().join("marker");
    let execution_id = server.assign(&token, setup(&mark(&marker)).secret("API_KEY", "withdrawn-secret-2"));
    agent.watch(revoke_when_attempted(&server, &execution_id)).await;
    let code = agent.wait_exit(EXIT).await;
    assert!(!marker.exists(), "a withdrawn run never starts");
    assert!(!event_kinds(&server, &execution_id).contains(&EventKind::Started));
    let reported: Vec<InstallFailed> = server.install_failures(&execution_id);
    assert!(reported.is_empty(), "a withdrawn run is reported as a failed install, to be requeued: {reported:?}");
    assert_eq!(event_posts(&server), 0, "a withdrawn run reports nothing, not even refused");
    assert_exit(&agent, code, ExitCode::Withdrawn, "the run credential was refused on an install call");
    server.assert_no_violations();
}

#[tokio::test]
async fn delivery_is_confirmed_after_two_503s() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent).await;
    for _ in 0..2 {
        server.script_upgrade(ScriptedUpgrade::status(503).for_credential(CredentialKind::Run));
    }
    let marker = dir.path().join("marker");
    let execution_id = server.assign(&token, setup(&mark(&marker)));
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(run_upgrades(&server), [503, 503, 101]);
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
    assert_eq!(line_count(&marker), 1);
    // The server flags a `started` before its confirmation as a violation.
    server.assert_no_violations();
}

#[tokio::test]
async fn unconfirmed_delivery_fails_the_install_at_the_confirm_timeout() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent =
        ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent.confirm_timeout("1s")).await;
    for _ in 0..50 {
        server.script_upgrade(ScriptedUpgrade::status(503).for_credential(CredentialKind::Run));
    }
    let marker = dir.path().join("marker");
    let execution_id = server.assign(&token, setup(&mark(&marker)));
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::InstallFailed, "no confirmation within STANDBY_CONFIRM_TIMEOUT");
    let failures = server.install_failures(&execution_id);
    assert_eq!(failures.len(), 1, "{:?}", server.events(&execution_id));
    assert_eq!((failures[0].stage.as_str(), failures[0].requeueable), (Stage::Confirm.name(), true));
    assert!(matches!(event_kinds(&server, &execution_id)[..], [EventKind::InstallFailed { .. }]));
    assert!(!marker.exists(), "an unconfirmed run never starts");
    assert!(run_upgrades(&server).iter().all(|status| *status == 503));
    server.assert_no_violations();
}

// ---- install failures ----------------------------------------------------

/// One install that must fail before the run starts.
struct FailingInstall<'a> {
    spec: Value,
    configure: &'a dyn Fn(AgentBuilder) -> AgentBuilder,
    /// Builds the execution; its argument is the run's marker command.
    execution: &'a dyn Fn(&str) -> ExecutionSetup,
    arrange: &'a dyn Fn(&TestServer),
    stages: &'a [Stage],
    requeueable: bool,
    /// Something the message must name.
    names: Option<&'a str>,
}

async fn assert_install_fails(dir: &TempDir, case: FailingInstall<'_>) -> (TestServer, String) {
    let server = TestServer::start().await;
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &case.spec, case.configure).await;
    (case.arrange)(&server);
    let marker = dir.path().join("marker");
    let execution_id = server.assign(&token, (case.execution)(&mark(&marker)));
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::InstallFailed, "the install failed");
    let failures = server.install_failures(&execution_id);
    assert_eq!(failures.len(), 1, "one install_failed: {:?}", server.events(&execution_id));
    let failure = &failures[0];
    assert!(
        case.stages.iter().any(|stage| stage.name() == failure.stage),
        "stage {:?}, expected one of {:?}",
        failure.stage,
        case.stages
    );
    assert_eq!(failure.requeueable, case.requeueable, "requeueable of {failure:?}");
    if let Some(needle) = case.names {
        assert!(failure.message.contains(needle), "the message does not name {needle:?}: {:?}", failure.message);
    }
    assert!(matches!(event_kinds(&server, &execution_id)[..], [EventKind::InstallFailed { .. }]));
    assert!(!marker.exists(), "the run's command ran although the install failed");
    server.assert_no_violations();
    (server, execution_id)
}

fn no_secrets_fetched(server: &TestServer) {
    let fetched = server.http_calls().iter().any(|call| call.endpoint == Endpoint::Secrets);
    assert!(!fetched, "a sandbox that cannot take the run fetched its secrets");
}

#[tokio::test]
async fn a_fingerprint_mismatch_fails_requeueable() {
    let dir = scratch();
    let step = |name: &str| json!({"setup": [{"name": name, "command": ["true"]}]});
    let (server, _) = assert_install_fails(
        &dir,
        FailingInstall {
            spec: json!({"workspace": step("prepared")}),
            configure: &|agent| agent,
            execution: &|run| setup(run).workspace(workspace(&step("other"))).secret("API_KEY", "fp-secret-1"),
            arrange: &|_| {},
            stages: &[Stage::SamePreparation],
            requeueable: true,
            names: Some("fingerprint"),
        },
    )
    .await;
    no_secrets_fetched(&server);
}

#[tokio::test]
async fn a_failing_secrets_endpoint_fails_requeueable_within_the_install_timeout() {
    let dir = scratch();
    assert_install_fails(
        &dir,
        FailingInstall {
            spec: json!(Spec::default()),
            configure: &|agent| agent.install_timeout("1s"),
            execution: &|run| setup(run).secret("API_KEY", "never-served-1"),
            arrange: &|server| server.fail(Endpoint::Secrets, Failure::always(500)),
            stages: &[Stage::Secrets, Stage::Install],
            requeueable: true,
            names: None,
        },
    )
    .await;
}

#[tokio::test]
async fn a_strict_mcp_server_that_fails_to_restart_fails_requeueable() {
    let dir = scratch();
    let server = probe_server(dir.path(), "flaky", &json!({}));
    assert_install_fails(
        &dir,
        FailingInstall {
            spec: json!({"workspace": {}, "mcp_servers": [server]}),
            configure: &|agent| agent,
            execution: &|run| setup(run).mcp_env("PROBE_FAIL", "1").strict_mcp(true),
            arrange: &|_| {},
            stages: &[Stage::Mcp],
            requeueable: true,
            names: Some("flaky"),
        },
    )
    .await;
}

/// The contract lists a refused shell among the requeueable failures: a
/// cold sandbox's idle shell would be idle.
#[tokio::test]
async fn a_busy_idle_shell_is_refused_requeueable() {
    let dir = scratch();
    // An interactive shell with job control puts its job in the foreground;
    // the job writes its pid once it runs there (bash hands it the terminal
    // before its exec). The agent reports ready as soon as the shell is
    // started, so the test awaits the job before assigning.
    let job_pid = dir.path().join("job.pid");
    let job = format!("sh -c 'echo $$ > \"{}\"; exec sleep 1000'; true", job_pid.display());
    let shell = json!(["/bin/bash", "--norc", "--noprofile", "-i", "-c", job]);
    let in_foreground = || {
        let deadline = std::time::Instant::now() + EXIT;
        while std::fs::read_to_string(&job_pid).map_or(true, |text| text.trim().is_empty()) {
            assert!(std::time::Instant::now() < deadline, "the shell's job never started");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    assert_install_fails(
        &dir,
        FailingInstall {
            spec: json!({"workspace": {}, "shell": shell}),
            configure: &|agent| agent,
            execution: &setup,
            arrange: &|_| in_foreground(),
            stages: &[Stage::Terminal],
            requeueable: true,
            names: Some("foreground job"),
        },
    )
    .await;
}

#[tokio::test]
async fn a_path_traversing_attachment_name_fails_not_requeueable() {
    let dir = scratch();
    let (server, _) = assert_install_fails(
        &dir,
        FailingInstall {
            spec: json!(Spec::default()),
            configure: &|agent| agent,
            execution: &|run| setup(run).attachment("../x", b"escaped"),
            arrange: &|_| {},
            stages: &[Stage::Attachments],
            requeueable: false,
            names: Some("../x"),
        },
    )
    .await;
    let downloaded = server.http_calls().iter().any(|call| call.endpoint == Endpoint::AttachmentFile);
    assert!(!downloaded, "an attachment with a bad name was downloaded");
}

#[tokio::test]
async fn an_empty_command_fails_not_requeueable() {
    let dir = scratch();
    let (server, _) = assert_install_fails(
        &dir,
        FailingInstall {
            spec: json!(Spec::default()),
            configure: &|agent| agent,
            execution: &|_| ExecutionSetup::new(&[]).secret("API_KEY", "empty-cmd-1"),
            arrange: &|_| {},
            stages: &[Stage::Check],
            requeueable: false,
            names: Some("command"),
        },
    )
    .await;
    no_secrets_fetched(&server);
}

#[tokio::test]
async fn a_cwd_leaving_the_workspace_fails_not_requeueable() {
    let dir = scratch();
    let (server, _) = assert_install_fails(
        &dir,
        FailingInstall {
            spec: json!(Spec::default()),
            configure: &|agent| agent,
            execution: &|run| setup(run).cwd("../outside").secret("API_KEY", "cwd-1"),
            arrange: &|_| {},
            stages: &[Stage::Check],
            requeueable: false,
            names: Some("../outside"),
        },
    )
    .await;
    no_secrets_fetched(&server);
}

#[tokio::test]
async fn a_missing_cwd_fails_not_requeueable() {
    let dir = scratch();
    assert_install_fails(
        &dir,
        FailingInstall {
            spec: json!(Spec::default()),
            configure: &|agent| agent,
            execution: &|run| setup(run).cwd("no-such-dir"),
            arrange: &|_| {},
            stages: &[Stage::Check],
            requeueable: false,
            names: Some("no-such-dir"),
        },
    )
    .await;
}

// ---- MCP servers ---------------------------------------------------------

#[tokio::test]
async fn a_non_strict_mcp_failure_degrades_the_run_which_still_starts() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let spec = json!({"workspace": {}, "mcp_servers": [probe_server(dir.path(), "flaky", &json!({}))]});
    let mut agent = ready_agent(&server, &token, dir.path(), &spec, |agent| agent).await;
    let marker = dir.path().join("marker");
    let execution_id = server.assign(&token, setup(&mark(&marker)).mcp_env("PROBE_FAIL", "1"));
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "a degraded run still runs");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
    assert_eq!(server.events(&execution_id)[1].kind, EventKind::Exited { code: 0 });
    assert_eq!(line_count(&marker), 1);
    server.assert_no_violations();
}

fn read_dumps(dir: &Path) -> Vec<BTreeMap<String, String>> {
    let mut dumps = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read the dump directory") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|extension| extension == "json") {
            let text = std::fs::read_to_string(&path).expect("read a dump");
            dumps.push(serde_json::from_str(&text).expect("a dump is a JSON object of strings"));
        }
    }
    dumps
}

#[tokio::test]
async fn mcp_servers_see_no_secret() {
    let server = TestServer::start().await;
    let dir = scratch();
    let dumps = dir.path().join("dumps");
    std::fs::create_dir(&dumps).expect("create the dump directory");
    let token = server.add_standby();
    let probe = probe_server(
        dir.path(),
        "probe",
        &json!({"PROBE_DUMP_DIR": dumps.display().to_string(), "SPEC_VAR": "spec-value", "SHARED": "from-spec"}),
    );
    let spec = json!({"workspace": {}, "mcp_servers": [probe]});
    let mut agent = ready_agent(&server, &token, dir.path(), &spec, |agent| agent).await;
    let secrets = [
        ("API_KEY", "mcp-secret-value-71"),
        ("CLOUD_TOKEN", "mcp-cloud-value-72"),
        ("RUN_VAR", "mcp-run-env-value-73"),
    ];
    let git_password = "mcp-git-password-74";
    let execution = ExecutionSetup::new(&["true"])
        .secret(secrets[0].0, secrets[0].1)
        .cloud_env(secrets[1].0, secrets[1].1)
        .env(secrets[2].0, secrets[2].1)
        .git_credential("https", "git.example", "bot", git_password)
        .mcp_env("MCP_VAR", "mcp-value")
        .mcp_env("SHARED", "from-run");
    let execution_id = server.assign(&token, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    let run_credential = server.run_credential(&execution_id).expect("minted");

    let all = read_dumps(&dumps);
    assert_eq!(all.len(), 2, "one dump at preparation, one after the restart");
    let (restarted, prepared): (Vec<_>, Vec<_>) = all.into_iter().partition(|env| env.contains_key("MCP_VAR"));
    assert_eq!((restarted.len(), prepared.len()), (1, 1), "exactly one start saw the run's mcp_env");
    let env = &restarted[0];
    assert_eq!(env.get("SPEC_VAR").map(String::as_str), Some("spec-value"));
    assert_eq!(env.get("MCP_VAR").map(String::as_str), Some("mcp-value"));
    assert_eq!(env.get("SHARED").map(String::as_str), Some("from-run"), "mcp_env overlays the spec's env");
    assert_eq!(prepared[0].get("SHARED").map(String::as_str), Some("from-spec"));
    let forbidden: Vec<&str> = secrets
        .iter()
        .map(|(_, value)| *value)
        .chain([git_password, run_credential.as_str(), token.as_str()])
        .collect();
    for dump in [&restarted[0], &prepared[0]] {
        for (name, value) in dump {
            for secret in &forbidden {
                assert!(!value.contains(secret), "the MCP server's {name} holds a secret or credential");
            }
        }
        for name in ["API_KEY", "CLOUD_TOKEN", "RUN_VAR", "STANDBY_TOKEN"] {
            assert!(!dump.contains_key(name), "the MCP server received {name}");
        }
    }
    server.assert_no_violations();
}

// ---- the run's world -----------------------------------------------------

/// `KEY=value` lines of an `env` dump.
fn parse_env(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|line| line.split_once('='))
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|error| panic!("read {}: {error}", path.display()))
}

/// A standby prepared with a clone of a one-file repository at `app`: its
/// workspace, the repository, the commit cloned, and the ready agent.
struct ClonedStandby {
    server: TestServer,
    dir: TempDir,
    ws: std::path::PathBuf,
    origin: GitRepo,
    cloned: String,
    token: String,
    agent: AgentProcess,
}

/// The workspace naming the repository at `app`, pinned to `sha` if given.
fn app_repo(origin: &GitRepo, sha: Option<&str>) -> Value {
    json!({"repos": [{"url": origin.url(), "path": "app", "ref": "main", "expected_sha": sha}]})
}

async fn cloned_standby() -> ClonedStandby {
    cloned_standby_with(json!([]), |agent| agent).await
}

/// A setup step that outlasts git's racy second, so preparation rewrites
/// the index, the clone is known clean and the agent watches it.
fn settling_setup() -> Value {
    json!([{"name": "settle", "command": ["sleep", "1.1"]}])
}

/// `workspace` with `setup`.
fn with_setup(mut workspace: Value, setup: &Value) -> Value {
    workspace["setup"] = setup.clone();
    workspace
}

async fn cloned_standby_with(setup: Value, configure: impl FnOnce(AgentBuilder) -> AgentBuilder) -> ClonedStandby {
    let server = TestServer::start().await;
    let dir = scratch();
    let ws = dir.path().join("workspace");
    std::fs::create_dir(&ws).expect("create the workspace");
    let origin = GitRepo::new(&[("README.md", "hello\n"), ("src/lib.py", "x = 1\n")]);
    let cloned = origin.head();
    let token = server.add_standby();
    let spec = json!({"workspace": with_setup(app_repo(&origin, None), &setup)});
    let agent = ready_agent(&server, &token, dir.path(), &spec, |agent| configure(agent.workspace(&ws))).await;
    ClonedStandby { server, dir, ws, origin, cloned, token, agent }
}

#[tokio::test]
async fn the_run_has_a_terminal_its_data_git_credentials_and_the_expected_commit() {
    let ClonedStandby { server, dir: _dir, ws, origin, cloned, token, mut agent } = cloned_standby().await;
    // After the clone: the run needs the middle one of two new commits.
    let expected = origin.commit(&[("NEW.md", "new\n")]);
    let later = origin.commit(&[("LATER.md", "later\n")]);
    assert_ne!(cloned, expected);

    let out = ws.join("findings");
    let script = format!(
        r#"out='{out}'
mkdir -p "$out"
if test -t 0 && test -t 1; then echo yes > "$out/tty"; else echo no > "$out/tty"; fi
env > "$out/env"
cp "$STANDBY_METADATA_FILE" "$out/metadata.json"
cp "$STANDBY_ATTACHMENTS_DIR/spec.md" "$out/spec.md"
printf 'protocol=https\nhost=git.example\n\n' | git credential fill > "$out/credential" 2> "$out/credential.err"
git config --get-all credential.helper > "$out/helper"
store=$(sed -n 's/^store --file=//p' "$out/helper" | tail -n 1)
stat -c %a "$store" > "$out/store-mode"
git rev-parse HEAD > "$out/head"
pwd -P > "$out/pwd"
echo findings written"#,
        out = out.display()
    );
    let attachment: &[u8] = b"# Spec\n\x00\x01\xfe\xff binary tail\n";
    let metadata = json!({"task": {"id": "t-1", "tags": ["a", "b"]}, "attempt": 3, "note": "caf\u{e9}"});
    let execution = setup(&script)
        .cwd("app")
        .workspace(workspace(&app_repo(&origin, Some(&expected))))
        .env("TASK_ID", "t1")
        .env("GIT_TERMINAL_PROMPT", "0")
        .secret("API_KEY", "world-secret-81")
        .cloud_env("CLOUD_TOKEN", "world-cloud-82")
        .git_credential("https", "git.example", "x-access-token", "world-git-pass-83")
        .metadata(metadata.clone())
        .attachment("spec.md", attachment);
    let execution_id = server.assign(&token, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
    assert_eq!(server.events(&execution_id)[1].kind, EventKind::Exited { code: 0 });
    assert!(contains(&server.log(&execution_id), b"findings written"), "the run's output is shipped");

    assert_eq!(read(&out.join("tty")).trim(), "yes", "the run's stdin and stdout are a terminal");
    let env = parse_env(&read(&out.join("env")));
    let get = |name: &str| env.get(name).map(String::as_str);
    assert_eq!(get("API_KEY"), Some("world-secret-81"), "secrets are in the run's environment");
    assert_eq!(get("CLOUD_TOKEN"), Some("world-cloud-82"), "cloud credentials are in the run's environment");
    assert_eq!(get("TASK_ID"), Some("t1"), "the run's env is in its environment");
    assert_eq!(get("STANDBY_EXECUTION_ID"), Some(execution_id.as_str()));
    assert_eq!(get("STANDBY_TOKEN"), None, "the run never gets the standby credential");
    let run_credential = server.run_credential(&execution_id).expect("minted");
    assert!(
        env.values().all(|value| !value.contains(&run_credential)),
        "the run's environment holds the run credential"
    );

    let written: Value = serde_json::from_str(&read(&out.join("metadata.json"))).expect("the metadata file is JSON");
    assert_eq!(written, metadata, "STANDBY_METADATA_FILE holds the metadata");
    assert_eq!(std::fs::read(out.join("spec.md")).expect("the attachment copy"), attachment);

    let credential = read(&out.join("credential"));
    assert!(
        credential.lines().any(|line| line == "username=x-access-token")
            && credential.lines().any(|line| line == "password=world-git-pass-83"),
        "git credential fill did not return the credentials: {credential:?}; stderr: {:?}",
        read(&out.join("credential.err"))
    );
    let helper = read(&out.join("helper"));
    let store = helper
        .lines()
        .find_map(|line| line.strip_prefix("store --file="))
        .unwrap_or_else(|| panic!("no credential store among the helpers: {helper:?}"));
    // Observed by the run: the store is removed when the run ends.
    assert!(!Path::new(store.trim()).exists(), "the credential store outlived the run");
    let mode = read(&out.join("store-mode"));
    assert_eq!(mode.trim(), "600", "the git credentials file is mode {mode}");

    assert_eq!(read(&out.join("head")).trim(), expected, "the repo is at expected_sha");
    assert_ne!(expected, later);
    let app = ws.join("app").canonicalize().expect("the repo exists");
    assert_eq!(Path::new(read(&out.join("pwd")).trim()), app, "the run runs in <workspace>/<cwd>");
    assert!(
        ws.join("app/NEW.md").is_file() && !ws.join("app/LATER.md").exists(),
        "the checkout is expected_sha, not the head"
    );
    agent.assert_output_lacks(&["world-secret-81", "world-cloud-82", "world-git-pass-83", &run_credential, &token]);
    server.assert_no_violations();
}

/// A warm run at the commit the pool was prepared at skips git only while
/// the clone is exactly as preparation left it: a tracked file changed
/// since (a file of the image, a previous turn) is checked out again.
#[tokio::test]
async fn a_clone_changed_after_preparation_is_checked_out_again_at_the_prepared_commit() {
    let ClonedStandby { server, dir: _dir, ws, origin, cloned, token, mut agent } = cloned_standby().await;
    std::fs::write(ws.join("app/README.md"), "HELLO\n").expect("change a tracked file");

    let out = ws.join("findings");
    let script = format!(
        r#"out='{out}'; mkdir -p "$out"; cat README.md > "$out/readme"; git rev-parse HEAD > "$out/head""#,
        out = out.display()
    );
    let execution = setup(&script).cwd("app").workspace(workspace(&app_repo(&origin, Some(&cloned))));
    let execution_id = server.assign(&token, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
    assert_eq!(read(&out.join("head")).trim(), cloned, "the repo is at expected_sha");
    assert_eq!(read(&out.join("readme")), "hello\n", "the changed file is the commit's again");
    server.assert_no_violations();
}

/// The same with the clone watched since preparation: an untouched clone
/// is vouched for by the watch alone, a tracked file changed in a
/// subdirectory sends the refresh to reading the files, and then to git.
#[tokio::test]
async fn a_watched_clone_is_vouched_for_by_its_watch_until_a_tracked_file_changes() {
    for change in [false, true] {
        let debug = |agent: AgentBuilder| agent.env("STANDBY_LOG", "standby_agent::install=debug,info");
        let ClonedStandby { server, dir: _dir, ws, origin, cloned, token, mut agent } =
            cloned_standby_with(settling_setup(), debug).await;
        if change {
            std::fs::write(ws.join("app/src/lib.py"), "x = 2\n").expect("change a tracked file");
        }
        let out = ws.join("findings");
        let script = format!(
            r#"out='{out}'; mkdir -p "$out"; cat src/lib.py > "$out/lib"; git rev-parse HEAD > "$out/head""#,
            out = out.display()
        );
        let workspace_value = with_setup(app_repo(&origin, Some(&cloned)), &settling_setup());
        let execution = setup(&script).cwd("app").workspace(workspace(&workspace_value));
        let execution_id = server.assign(&token, execution);
        let code = agent.wait_exit(EXIT).await;
        assert_exit(&agent, code, ExitCode::Success, "the run finished");
        assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
        assert_eq!(read(&out.join("head")).trim(), cloned, "the repo is at expected_sha");
        assert_eq!(read(&out.join("lib")), "x = 1\n", "the file is the commit's");
        let output = agent.output();
        let vouched = output.contains("unchanged since preparation: no git");
        let read_files = output.contains("the watch cannot vouch for the clone");
        assert_eq!((vouched, read_files), (!change, change), "changed: {change}\n{}", agent.output_tail());
        server.assert_no_violations();
    }
}

// ---- redaction -----------------------------------------------------------

fn percent_encode(text: &str, upper: bool) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => char::from(byte).to_string(),
            _ if upper => format!("%{byte:02X}"),
            _ => format!("%{byte:02x}"),
        })
        .collect()
}

fn json_escape(text: &str) -> String {
    let quoted = serde_json::to_string(text).expect("a string serializes");
    quoted[1..quoted.len() - 1].to_owned()
}

#[tokio::test]
async fn secrets_are_redacted_across_batches_and_in_encoded_forms() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent.log_filter("trace")).await;
    // A quote, a backslash and reserved characters make every form differ.
    let secret = "r3d\"act\\me/n0w+ok";
    let (half1, half2) = secret.split_at(8);
    let cloud = "redact-cloud-v4lue-55";
    let git_password = "redact-git-p4ss-56";
    let forms = [percent_encode(secret, true), percent_encode(secret, false), json_escape(secret)];
    assert!(forms.iter().all(|form| form != secret) && forms[0] != forms[1] && forms[1] != forms[2]);
    const FILLER: usize = 65_530;
    let script = format!(
        r#"head -c {FILLER} /dev/zero | tr '\000' x
printf '%s' "$API_KEY"
printf '\n<1:%s:1>\n' "$API_KEY"
printf '<2:%s' "$HALF1"; sleep 0.3; printf '%s:2>\n' "$HALF2"
printf '<3:%s:3>\n' "$FORM_URL_UPPER"
printf '<4:%s:4>\n' "$FORM_URL_LOWER"
printf '<5:%s:5>\n' "$FORM_JSON"
printf '<6:%s:6>\n' "$CLOUD_TOKEN"
printf '<7:%s:7>\n' "$GIT_PASSWORD_COPY"
echo end-of-run"#
    );
    let execution = setup(&script)
        .secret("API_KEY", secret)
        .cloud_env("CLOUD_TOKEN", cloud)
        .git_credential("https", "git.example", "bot", git_password)
        .env("HALF1", half1)
        .env("HALF2", half2)
        .env("FORM_URL_UPPER", &forms[0])
        .env("FORM_URL_LOWER", &forms[1])
        .env("FORM_JSON", &forms[2])
        .env("GIT_PASSWORD_COPY", git_password);
    let execution_id = server.assign(&token, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(
        server.events(&execution_id).last().map(|event| event.kind.clone()),
        Some(EventKind::Exited { code: 0 })
    );

    let log = server.log(&execution_id);
    let text = String::from_utf8_lossy(&log);
    let mut expected_start = "x".repeat(FILLER);
    expected_start.push_str("[REDACTED]\r\n");
    assert!(text.starts_with(&expected_start), "the secret after 64 KiB of filler is not redacted in place");
    for i in 1..=7 {
        let redacted = format!("<{i}:[REDACTED]:{i}>\r\n");
        assert!(text.contains(&redacted), "form {i} is not redacted in place; log tail: {:?}", &text[FILLER..]);
    }
    assert!(text.ends_with("end-of-run\r\n"), "the log is incomplete: {:?}", &text[FILLER..]);
    assert_eq!(count(&log, b"[REDACTED]"), 8);
    let credential = server.run_credential(&execution_id).expect("minted");
    let mut leaked: Vec<&str> = vec![secret, cloud, git_password, &credential, &token];
    leaked.extend(forms.iter().map(String::as_str));
    for value in &leaked {
        assert!(!contains(&log, value.as_bytes()), "the stored log holds a secret form ({} bytes)", value.len());
    }

    let record = server.execution(&execution_id).expect("recorded");
    assert!(record.log_chunks.len() >= 2, "the output fit one batch: nothing crossed a boundary");
    let mut end = 0_u64;
    for (offset, length) in &record.log_chunks {
        assert!(*offset <= end, "a gap in the log at offset {offset} after {end} bytes: {:?}", record.log_chunks);
        end = end.max(offset + *length as u64);
    }
    assert_eq!(end, log.len() as u64);
    agent.assert_output_lacks(&leaked);
    server.assert_no_violations();
}

// ---- cancel and SIGTERM ----------------------------------------------------

#[tokio::test]
async fn cancel_before_the_run_starts_means_it_never_starts() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent).await;
    server.set_endpoint_latency(Endpoint::Secrets, Duration::from_secs(2));
    let marker = dir.path().join("marker");
    let execution_id = server.assign(&token, setup(&mark(&marker)).secret("API_KEY", "cancelled-1"));
    agent
        .watch(server.wait_for_heartbeat(|heartbeat| {
            heartbeat.credential == CredentialKind::Run && heartbeat.state == AgentState::Installing
        }))
        .await;
    server.cancel(&execution_id).expect("cancel");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "cancelled before the start");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Cancelled]);
    assert!(!marker.exists(), "a run cancelled before its start ran");
    agent.wait_no_leftovers(EXIT).await;
    server.assert_no_violations();
}

/// Starts `script` (which writes its pid to the returned path first) and
/// waits until it runs.
async fn running(
    server: &TestServer,
    dir: &Path,
    script: &str,
    configure: impl FnOnce(AgentBuilder) -> AgentBuilder,
) -> (AgentProcess, String, i32) {
    let token = server.add_standby();
    let mut agent = ready_agent(server, &token, dir, &Spec::default(), configure).await;
    let pid_file = dir.join("run.pid");
    let script = script.replace("PIDFILE", &format!("'{}'", pid_file.display()));
    let execution_id = server.assign(&token, setup(&script));
    agent.watch(server.wait_for_event(&execution_id, |kind| *kind == EventKind::Started)).await;
    let pid = agent.watch(read_pid_file(&pid_file, EXIT)).await;
    agent.descendants();
    (agent, execution_id, pid)
}

#[tokio::test]
async fn cancel_during_the_run_terminates_its_process_group() {
    let server = TestServer::start().await;
    let dir = scratch();
    let signalled = dir.path().join("signalled");
    let script = format!("trap 'echo TERM > \"{}\"; exit 143' TERM; echo $$ > PIDFILE; sleep 100", signalled.display());
    let (mut agent, execution_id, pid) = running(&server, dir.path(), &script, |agent| agent).await;
    server.cancel(&execution_id).expect("cancel");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "cancelled during the run");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Cancelled]);
    assert_eq!(read(&signalled).trim(), "TERM", "the run got SIGTERM first");
    wait_group_gone(pid, EXIT).await;
    agent.wait_no_leftovers(EXIT).await;
    server.assert_no_violations();
}

#[tokio::test]
async fn a_run_ignoring_sigterm_is_killed_after_the_cancel_grace() {
    let server = TestServer::start().await;
    let dir = scratch();
    let script = "trap '' TERM; echo $$ > PIDFILE; sleep 100";
    let (mut agent, execution_id, pid) =
        running(&server, dir.path(), script, |agent| agent.env("STANDBY_CANCEL_GRACE", "500ms")).await;
    server.cancel(&execution_id).expect("cancel");
    // Without the SIGKILL the run would live for 100 s, past this wait.
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "cancelled during the run");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Cancelled]);
    wait_group_gone(pid, EXIT).await;
    agent.wait_no_leftovers(EXIT).await;
    server.assert_no_violations();
}

#[tokio::test]
async fn sigterm_during_the_run_is_forwarded_and_the_exit_reported() {
    let server = TestServer::start().await;
    let dir = scratch();
    let script = "trap 'echo got-term; exit 42' TERM; echo $$ > PIDFILE; while :; do sleep 0.05; done";
    let (mut agent, execution_id, pid) = running(&server, dir.path(), script, |agent| agent).await;
    agent.signal(Signal::SIGTERM);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "SIGTERM during the run");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 42 }]);
    assert!(contains(&server.log(&execution_id), b"got-term"), "the run's trap output is shipped");
    wait_group_gone(pid, EXIT).await;
    agent.wait_no_leftovers(EXIT).await;
    server.assert_no_violations();
}

// ---- the end of a run ------------------------------------------------------

#[tokio::test]
async fn the_exit_code_is_reported_and_the_log_is_complete_and_in_order() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent).await;
    let execution_id = server.assign(&token, setup("seq 1 20000; exit 7"));
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished (with 7)");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 7 }]);
    let expected: String = (1..=20_000).map(|n| format!("{n}\r\n")).collect();
    let log = server.log(&execution_id);
    assert!(
        log == expected.as_bytes(),
        "the log is not the run's output ({} bytes, expected {})",
        log.len(),
        expected.len()
    );
    server.assert_no_violations();
}

// ---- the install's plan ----------------------------------------------------

async fn install_with_latency(plan: Option<&str>) -> (TestServer, String) {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| match plan {
        Some(plan) => agent.arg("--install-plan").arg(plan),
        None => agent,
    })
    .await;
    for endpoint in INSTALL_ENDPOINTS {
        server.set_endpoint_latency(endpoint, Duration::from_millis(250));
    }
    let execution = ExecutionSetup::new(&["true"])
        .secret("API_KEY", "plan-secret-1")
        .attachment("spec.md", b"spec")
        .git_credential("https", "git.example", "bot", "plan-git-2")
        .metadata(json!({"k": "v"}))
        .cloud_env("CLOUD_TOKEN", "plan-cloud-3");
    let execution_id = server.assign(&token, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    let called: std::collections::BTreeSet<Endpoint> = server
        .http_calls()
        .iter()
        .filter(|call| call.endpoint.is_install() && call.status == 200)
        .map(|call| call.endpoint)
        .collect();
    assert_eq!(called.len(), 6, "every install endpoint answered once: {called:?}");
    (server, execution_id)
}

#[tokio::test]
async fn install_calls_overlap() {
    let (server, execution_id) = install_with_latency(None).await;
    let overlap = server
        .max_concurrency(|call| call.endpoint.is_install() && call.execution_id.as_deref() == Some(&execution_id));
    assert!(overlap >= 3, "at most {overlap} install calls were in flight at once\n{}", server.records().summary());
    server.assert_no_violations();
}

#[tokio::test]
async fn the_sequential_plan_makes_one_install_call_at_a_time() {
    let (server, execution_id) = install_with_latency(Some("sequential")).await;
    let overlap = server
        .max_concurrency(|call| call.endpoint.is_install() && call.execution_id.as_deref() == Some(&execution_id));
    assert_eq!(overlap, 1, "install calls overlapped under --install-plan sequential\n{}", server.records().summary());
    server.assert_no_violations();
}

// ---- events ----------------------------------------------------------------

#[tokio::test]
async fn a_retried_event_keeps_its_event_id() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent).await;
    let gate = dir.path().join("gate");
    server.fail(Endpoint::Events, Failure::times(503, 2));
    let execution_id = server.assign(&token, setup(&wait_gate(&gate)));
    let started = agent.watch(server.wait_for_event(&execution_id, |kind| *kind == EventKind::Started)).await;
    // `exited` waits for the gate, so the two failures met `started` only.
    std::fs::write(&gate, "").expect("open the gate");
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");

    let posts: Vec<(Option<String>, u16)> = server
        .http_calls()
        .iter()
        .filter(|call| call.endpoint == Endpoint::Events)
        .map(|call| (call.event_id.clone(), call.status))
        .collect();
    let of_started: Vec<u16> = posts
        .iter()
        .filter(|(event_id, _)| event_id.as_deref() == Some(started.event_id.as_str()))
        .map(|(_, status)| *status)
        .collect();
    assert_eq!(of_started, [503, 503, 202], "the retries of `started` changed its event_id: {posts:?}");
    assert!(posts.iter().all(|(event_id, _)| event_id.is_some()), "an event without event_id: {posts:?}");
    assert_eq!(
        event_kinds(&server, &execution_id),
        [EventKind::Started, EventKind::Exited { code: 0 }],
        "one event per report"
    );
    server.assert_no_violations();
}
