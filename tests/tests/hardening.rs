//! The agent's hardening (issue 13), each rule proven with the real
//! binary against the contract test server:
//!
//! - a multi-line secret printed through the terminal (`\n` written as
//!   `\r\n`) is redacted whole, and each of its lines alone;
//! - a log filter naming dependencies cannot widen them past their caps:
//!   no credential and no frame reaches the agent's output;
//! - `STANDBY_TOKEN_FILE` in place of `STANDBY_TOKEN`, exactly one of them;
//! - the agent is not dumpable: a run of the same (unprivileged) user cannot
//!   read the agent's environment, while the run and the MCP servers stay
//!   ordinary processes;
//! - absurd durations and `Retry-After` values never panic it.
//!
//! Needs `cargo build --bins`.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use serde_json::json;
use standby_e2e::harness::{assert_exit, read_pid_file, vars, write_json};
use standby_e2e::server::{Endpoint, ExecutionSetup, Failure};
use standby_e2e::{AgentBuilder, AgentProcess, TestServer};
use standby_protocol::{AgentState, ExitCode, Spec, Stage};
use tempfile::TempDir;

const WAIT: Duration = Duration::from_secs(30);
/// `nobody`: an unprivileged user, so `/proc` access checks apply.
const NOBODY: u32 = 65534;

/// A scratch directory every user can read (the agent may run as another).
fn scratch() -> TempDir {
    let dir = TempDir::with_prefix("standby-e2e-hardening-").expect("a scratch directory");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod the scratch directory");
    dir
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

fn run(script: &str) -> ExecutionSetup {
    ExecutionSetup::new(&["sh", "-c", script])
}

async fn ready_agent(
    server: &TestServer,
    builder: AgentBuilder,
    dir: &Path,
    spec: &impl serde::Serialize,
) -> AgentProcess {
    let path = dir.join("spec.json");
    write_json(&path, spec);
    let mut agent = builder.spec_file(&path).heartbeat_interval("200ms").spawn();
    agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Ready)).await;
    agent
}

/// A PEM private key as a key file holds it: 64 base64 characters a line.
fn pem(seed: u8) -> String {
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let body: Vec<u8> =
        (0..640u32).map(|i| alphabet[usize::try_from((i * 7 + u32::from(seed) * 13) % 64).expect("small")]).collect();
    let lines: Vec<&str> = body.chunks(64).map(|line| std::str::from_utf8(line).expect("ASCII")).collect();
    format!("-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n", lines.join("\n"))
}

// ---- redaction of what a terminal prints ---------------------------------------------

#[tokio::test]
async fn a_multi_line_secret_printed_on_the_terminal_leaves_none_of_its_lines_in_the_log() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, AgentBuilder::new(&server.url(), &token), dir.path(), &Spec::default()).await;
    let key = pem(1);
    let service_account = "{\n  \"type\": \"service_account\",\n  \"client_id\": \"4242424242\"\n}\n".to_owned();
    // The whole key as `cat` prints it, one line of it alone (grep), the
    // service account document, and the key inside other output.
    let script = r#"printf 'key follows\n%s' "$PEM_KEY"
printf '%s' "$PEM_KEY" | sed -n 4p
printf '%s' "$SA_JSON"
printf 'before %s after\n' "$PEM_KEY"
echo end-of-run"#;
    let execution_id =
        server.assign(&token, run(script).secret("PEM_KEY", &key).cloud_env("SA_JSON", &service_account));
    let code = agent.wait_exit(WAIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the agent finished");
    let log = server.log(&execution_id);
    let text = String::from_utf8_lossy(&log);
    assert!(text.starts_with("key follows\r\n[REDACTED]"), "{text}");
    assert!(text.contains("before [REDACTED] after\r\n"), "{text}");
    assert!(text.ends_with("end-of-run\r\n"), "{text}");
    for line in key.lines().chain(service_account.lines()).filter(|line| line.chars().count() >= 8) {
        assert!(!contains(&log, line.as_bytes()), "a line of a secret reached the log: {line:?}\n{text}");
    }
    assert!(!contains(&log, key.as_bytes()) && !contains(&log, key.replace('\n', "\r\n").as_bytes()));
}

// ---- log filter caps -----------------------------------------------------------------

#[tokio::test]
async fn a_log_filter_naming_dependencies_does_not_widen_them() {
    let server = TestServer::start().await;
    let dir = scratch();
    // Every way of naming a capped dependency: the crate, a module of it, a
    // sibling crate, and a span directive that enables whatever runs inside.
    let filter = "info,tungstenite=trace,tokio_tungstenite=trace,tungstenite::protocol=trace,\
                  hyper=trace,hyper_util::client=trace,h2=trace,reqwest=trace,reqwest::connect=trace,\
                  rustls=trace,[{credential}]=trace";
    for (builder, what) in [
        (AgentBuilder::new(&server.url(), "set below").log_filter(filter), "STANDBY_LOG"),
        (AgentBuilder::new(&server.url(), "set below").env_remove(vars::LOG).env("RUST_LOG", filter), "RUST_LOG"),
    ] {
        let token = server.add_standby();
        let builder = builder.env(vars::TOKEN, &token);
        let mut agent = ready_agent(&server, builder, dir.path(), &Spec::default()).await;
        let secret = format!("caps-secret-{what}-7f3a9");
        let execution_id = server.assign(&token, run("echo ran").secret("API_KEY", &secret));
        let code = agent.wait_exit(WAIT).await;
        assert_exit(&agent, code, ExitCode::Success, what);
        let credential = server.run_credential(&execution_id).expect("minted");
        let stderr = agent.output();
        assert!(stderr.contains("standby starting"), "{what}: the agent logged: {stderr}");
        agent.assert_output_lacks(&[&token, &credential, &secret]);
        // Frame payloads and request headers (as the dependencies print them).
        for frame in ["\"type\":\"heartbeat\"", "\"type\":\"assignment\"", "run_credential", "Bearer", "authorization"]
        {
            assert!(!stderr.contains(frame), "{what}: a frame or header reached the log ({frame}):\n{stderr}");
        }
    }
}

// ---- STANDBY_TOKEN_FILE --------------------------------------------------------------

#[tokio::test]
async fn the_standby_credential_can_come_from_a_file() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let path = dir.path().join("token");
    std::fs::write(&path, format!("{token}\n")).expect("write the token file");
    let builder = AgentBuilder::new(&server.url(), "unused")
        .env_remove(vars::TOKEN)
        .env(vars::TOKEN_FILE, &path.display().to_string());
    let mut agent = ready_agent(&server, builder, dir.path(), &Spec::default()).await;
    server.retire(&token, None).expect("retire");
    let code = agent.wait_exit(WAIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the agent finished");
    agent.assert_output_lacks(&[&token]);
}

#[tokio::test]
async fn exactly_one_of_the_token_and_the_token_file_is_accepted() {
    let dir = scratch();
    let good = dir.path().join("token");
    std::fs::write(&good, "from-a-file\n").expect("write");
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n").expect("write");
    let missing = dir.path().join("missing");
    let url = "http://127.0.0.1:9";
    let cases = [
        (AgentBuilder::bare().env(vars::SERVER_URL, url), vec!["STANDBY_TOKEN", vars::TOKEN_FILE]),
        (
            AgentBuilder::bare()
                .env(vars::SERVER_URL, url)
                .env(vars::TOKEN, "t")
                .env(vars::TOKEN_FILE, &good.display().to_string()),
            vec!["STANDBY_TOKEN", vars::TOKEN_FILE],
        ),
        (
            AgentBuilder::bare().env(vars::SERVER_URL, url).env(vars::TOKEN_FILE, &missing.display().to_string()),
            vec![vars::TOKEN_FILE, "missing"],
        ),
        (
            AgentBuilder::bare().env(vars::SERVER_URL, url).env(vars::TOKEN_FILE, &empty.display().to_string()),
            vec![vars::TOKEN_FILE, "empty"],
        ),
    ];
    for (builder, named) in cases {
        let mut agent = builder.spawn();
        let code = agent.wait_exit(WAIT).await;
        let stderr = agent.stderr();
        assert_exit(&agent, code, ExitCode::Usage, "bad configuration");
        for name in named {
            assert!(stderr.contains(name), "the message does not name {name}: {stderr}");
        }
        assert!(!stderr.contains("from-a-file"), "{stderr}");
    }
}

// ---- not dumpable ---------------------------------------------------------------------

/// The owner of a process's `/proc` files: root for a process that is not
/// dumpable, the process's own user otherwise.
/// The owner of `pid`'s `/proc` files (root's for a process that is not
/// dumpable); `None` once it is gone.
fn proc_owner(pid: i32) -> Option<u32> {
    std::fs::metadata(format!("/proc/{pid}/environ")).ok().map(|metadata| metadata.uid())
}

#[tokio::test]
async fn a_run_of_the_same_user_cannot_read_the_agents_environment_or_memory() {
    let server = TestServer::start().await;
    let dir = scratch();
    // The MCP server and the idle shell write their pids once they run
    // their own program: a child is the agent's copy, not dumpable, from
    // its fork until the kernel's exec makes it dumpable, and the agent may
    // report ready before that last step of its exec (the pid file is
    // written after it). Sampled before, a child would be caught in that
    // window; sampled after, every child the agent started is an ordinary
    // process or the product has a bug.
    let pids = dir.path().join("pids");
    std::fs::create_dir(&pids).expect("create the pid directory");
    std::fs::set_permissions(&pids, std::fs::Permissions::from_mode(0o777)).expect("chmod the pid directory");
    let (mcp_pid, shell_pid) = (pids.join("mcp.pid"), pids.join("shell.pid"));
    let token = server.add_standby();
    let spec = json!({
        "workspace": {},
        "mcp_servers": [{"name": "idle", "command": ["sh", "-c", format!("echo $$ > '{}'; exec sleep 300", mcp_pid.display())]}],
        "shell": ["sh", "-c", format!("echo $$ > '{}'; exec /bin/sh", shell_pid.display())],
    });
    let builder = AgentBuilder::new(&server.url(), &token).user(NOBODY, NOBODY);
    let mut agent = ready_agent(&server, builder, dir.path(), &spec).await;
    let started = [read_pid_file(&mcp_pid, WAIT).await, read_pid_file(&shell_pid, WAIT).await];
    let agent_owner = proc_owner(agent.pid());
    // Every live descendant (a short-lived one may be gone by the time its
    // owner is read: skipped).
    let children: Vec<(i32, u32)> =
        agent.descendants().into_iter().filter_map(|pid| proc_owner(pid).map(|owner| (pid, owner))).collect();
    // The run's parent is the agent. Reading its environment, its memory
    // map or its memory must fail; the run's own child can read the run's
    // environment (the run is dumpable).
    let script = r#"
for file in environ maps mem; do
  if head -c 1 /proc/$PPID/$file >/dev/null 2>&1; then echo "agent-$file-readable"; else echo "agent-$file-denied"; fi
done
sh -c 'tr "\0" "\n" < /proc/$PPID/environ' | grep -c '^STANDBY_EXECUTION_ID=' | sed 's/^/run-environ-lines-/'
echo end-of-run"#;
    let execution_id = server.assign(&token, run(script));
    let code = agent.wait_exit(WAIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the agent finished");
    let log = String::from_utf8_lossy(&server.log(&execution_id)).into_owned();
    assert!(log.contains("end-of-run"), "{log}");
    for file in ["environ", "maps", "mem"] {
        assert!(log.contains(&format!("agent-{file}-denied")), "the run could read the agent's {file}:\n{log}");
    }
    assert!(log.contains("run-environ-lines-1"), "the run is not an ordinary process:\n{log}");
    assert_eq!(agent_owner, Some(0), "the agent's /proc files are root's: it is not dumpable");
    for pid in started {
        assert!(
            children.iter().any(|(child, _)| *child == pid),
            "{pid} (the idle shell or the MCP server) ran: {children:?}"
        );
    }
    for (pid, owner) in children {
        assert_eq!(owner, NOBODY, "child {pid} of the agent is an ordinary, dumpable process");
    }
    agent.assert_output_lacks(&[&token]);
}

// ---- no panic on any input --------------------------------------------------------------

#[tokio::test]
async fn absurd_durations_and_retry_after_never_panic() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let forever = u64::MAX.to_string();
    let mut builder = AgentBuilder::new(&server.url(), &token);
    for setting in [
        "STANDBY_DEADLINE",
        "STANDBY_CONFIRM_TIMEOUT",
        "STANDBY_INSTALL_TIMEOUT",
        "STANDBY_CANCEL_GRACE",
        "STANDBY_EVENT_TIMEOUT",
        "STANDBY_MCP_READY_TIMEOUT",
    ] {
        builder = builder.env(setting, &format!("{forever}s"));
    }
    let mut agent = ready_agent(&server, builder, dir.path(), &Spec::default()).await;
    // "Retry after 584 billion years": past the install's bound, so the
    // install gives up at once instead of overflowing the deadline.
    server.fail(Endpoint::Secrets, Failure::times(503, 1).retry_after(u64::MAX));
    let execution_id = server.assign(&token, run("echo never").secret("API_KEY", "absurd-secret-1"));
    let code = agent.wait_exit(WAIT).await;
    assert_exit(&agent, code, ExitCode::InstallFailed, "the install failed");
    let failures = server.install_failures(&execution_id);
    assert!(
        failures.iter().any(|failure| failure.stage == Stage::Secrets.name() && failure.requeueable),
        "{failures:?}\n{}",
        agent.output_tail()
    );
    assert!(!agent.stderr().contains("panicked"), "{}", agent.output_tail());
}
