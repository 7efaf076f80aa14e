//! The reference control plane end to end: the real `standby-server`
//! binary with its local provider, launching real `standby` agents on
//! real `file://` git repositories, everything on 127.0.0.1.
//!
//! Needs both binaries built (`cargo build --bins`); `STANDBY_SERVER_BIN`
//! and `STANDBY_BIN` override where they are looked for.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::ops::Deref;
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use standby_e2e::harness::{assert_exit, describe, process_alive, write_json};
use standby_e2e::server_process::{API_KEY, MARK, ServerBuilder, ServerProcess, environ_var, marked, server_bin};
use standby_e2e::{AgentBuilder, GitRepo, standby_bin};
use standby_protocol::{Event, EventKind, ExitCode};

const WAIT: Duration = Duration::from_secs(60);

/// The spec of a repository prepared with one setup step.
fn spec(repo: &GitRepo) -> Value {
    json!({
        "workspace": {
            "repos": [{"url": repo.url(), "path": "app", "ref": "main"}],
            "setup": [{"name": "build", "command": ["sh", "setup.sh"], "cwd": "app", "timeout_s": 60}]
        },
        "shell": ["/bin/sh"]
    })
}

fn sample_repo() -> GitRepo {
    GitRepo::new(&[
        ("setup.sh", "echo \"built $(git rev-parse --short HEAD)\" > built.txt\n"),
        ("README.md", "sample\n"),
    ])
}

/// A test's directory (the spec, the server's data and log), which
/// outlives the servers started on it, and its mark.
struct Setup {
    dir: tempfile::TempDir,
    mark: String,
}

impl Setup {
    fn new(repo: &GitRepo) -> Self {
        let dir = tempfile::Builder::new().prefix("standby-cp-e2e-").tempdir().expect("a temp dir");
        write_json(&dir.path().join("spec.json"), &spec(repo));
        let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir.path())));
        Self { dir, mark }
    }

    async fn start(&self, pool_size: usize, heartbeat: &str) -> Server {
        let spec = self.dir.path().join("spec.json");
        let process =
            ServerBuilder::new(&self.dir.path().join("data"), &self.dir.path().join("server.log"), &self.mark)
                .args(&["--linger", "3s", "--stop-grace", "5s", "--log", "debug", "--agent-log", "debug"])
                .args(&["--pool-size", &pool_size.to_string(), "--heartbeat-interval", heartbeat])
                .args(&["--spec", &spec.display().to_string()])
                .start()
                .await;
        Server { process }
    }
}

/// A [`ServerProcess`] with what these tests ask of it.
struct Server {
    process: ServerProcess,
}

impl Deref for Server {
    type Target = ServerProcess;

    fn deref(&self) -> &ServerProcess {
        &self.process
    }
}

impl Server {
    async fn until<T>(&self, what: &str, check: impl AsyncFnMut() -> Option<T>) -> T {
        self.process.until(what, WAIT, check).await
    }

    /// Waits until `n` standbys are candidates; their sandbox ids.
    async fn ready(&self, n: usize) -> Vec<String> {
        self.until(&format!("{n} ready standbys"), async || {
            let ready: Vec<String> = self
                .sandboxes()
                .await
                .iter()
                .filter(|s| s["candidate"] == true)
                .filter_map(|s| s["id"].as_str().map(str::to_owned))
                .collect();
            (ready.len() >= n).then_some(ready)
        })
        .await
    }

    async fn wait_run(&self, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        self.until(what, async || Some(self.run(id).await).filter(|run| done(run))).await
    }

    async fn finished(&self, id: &str) -> Value {
        self.process.finished(id, WAIT).await
    }

    /// Stops the server with `signal` and waits until neither it nor any
    /// process it caused is left.
    async fn stop(self, signal: Signal) {
        self.process.stop_leaving_nothing(signal).await;
    }
}

fn agent_pid(sandbox: &Value) -> i32 {
    sandbox["pid"].as_i64().and_then(|pid| i32::try_from(pid).ok()).expect("a local sandbox has a pid")
}

/// The kinds of a run's events, as its `events` list holds them.
fn kinds(events: &Value) -> Vec<EventKind> {
    let listed = events["events"].as_array().into_iter().flatten();
    listed.map(|e| serde_json::from_value::<Event>(e["event"].clone()).expect("an event").kind).collect()
}

#[tokio::test]
async fn warm_path_end_to_end_and_metrics_reflect_it() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(1, "500ms").await;
    let ready = server.ready(1).await;
    let id = server
        .submit(&json!({
            "command": ["sh", "-c", "cat built.txt; echo \"token=$API_TOKEN task=$TASK_ID\"; exit 3"],
            "cwd": "app",
            "env": {"TASK_ID": "t-1"},
            "secrets": {"API_TOKEN": "hunter2-very-secret"},
        }))
        .await;
    let run = server.finished(&id).await;
    assert_eq!(run["state"], "exited", "{run}\n{}", server.logs());
    assert_eq!((run["exit_code"].as_i64(), run["path"].as_str()), (Some(3), Some("warm")), "{run}");
    assert_eq!(run["attempts"].as_array().map(Vec::len), Some(1));
    assert_eq!(run["attempts"][0]["sandbox_id"], ready[0].as_str());
    for stamp in ["submitted", "committed", "assignment_sent", "delivery_confirmed", "started", "exited"] {
        assert!(run["timestamps"][stamp].is_string(), "no {stamp}: {run}");
    }
    let log = server.call(reqwest::Method::GET, &format!("/v1/runs/{id}/log"), Some(API_KEY), None).await.1;
    let log = log.as_str().expect("the log is text").to_owned();
    assert!(log.contains("built ") && log.contains("task=t-1"), "{log}");
    assert!(!log.contains("hunter2-very-secret") && log.contains("[REDACTED]"), "{log}");
    let events = server.get(&format!("/v1/runs/{id}/events")).await;
    assert_eq!(kinds(&events), [EventKind::Started, EventKind::Exited { code: 3 }]);
    let metrics = server.call(reqwest::Method::GET, "/metrics", Some(API_KEY), None).await.1;
    let metrics = metrics.as_str().expect("text").to_owned();
    assert!(metrics.contains("standby_runs{state=\"exited\",path=\"warm\"} 1"), "{metrics}");
    assert!(metrics.contains("standby_assignment_to_start_seconds_count 1"), "{metrics}");
    assert!(metrics.contains("standby_requeues_total 0"), "{metrics}");
    // The pool replaced the standby the run used.
    let replacement = server.ready(1).await;
    assert_ne!(replacement, ready);
    server.stop(Signal::SIGTERM).await;
}

#[tokio::test]
async fn requeue_to_cold_after_a_requeueable_failure_with_one_warm_attempt() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(1, "500ms").await;
    server.ready(1).await;
    // The run names a workspace the pool was not prepared with: the warm
    // standby's agent fails `same_preparation`, requeueable.
    let mut workspace = spec(&repo)["workspace"].clone();
    workspace["setup"][0]["name"] = json!("build-for-this-run");
    let id =
        server.submit(&json!({"command": ["sh", "-c", "cat built.txt"], "cwd": "app", "workspace": workspace})).await;
    let run = server.finished(&id).await;
    assert_eq!(
        (run["state"].as_str(), run["exit_code"].as_i64()),
        (Some("exited"), Some(0)),
        "{run}\n{}",
        server.logs()
    );
    let attempts = run["attempts"].as_array().expect("attempts");
    assert_eq!(attempts.len(), 2, "{run}");
    assert_eq!((attempts[0]["path"].as_str(), attempts[0]["outcome"].as_str()), (Some("warm"), Some("requeued")));
    assert!(attempts[0]["reason"].as_str().is_some_and(|r| r.contains("same_preparation")), "{run}");
    assert_eq!(attempts[1]["path"], "cold");
    assert_eq!(run["path"], "cold");
    assert_eq!(attempts.iter().filter(|a| a["path"] == "warm").count(), 1, "exactly one pre-warmed attempt");
    let first = server.sandbox(attempts[0]["sandbox_id"].as_str().expect("an id")).await;
    assert_eq!(first["state"], "retired");
    let metrics = server.call(reqwest::Method::GET, "/metrics", Some(API_KEY), None).await.1;
    assert!(metrics.as_str().is_some_and(|m| m.contains("standby_requeues_total 1")), "{metrics}");
    server.stop(Signal::SIGTERM).await;
}

#[tokio::test]
async fn cancel_before_confirmation_the_run_never_starts_and_the_sandbox_is_retired() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(1, "1s").await;
    let standby = server.ready(1).await.remove(0);
    let pid = agent_pid(&server.sandbox(&standby).await);
    // Frozen, the agent holds the assignment unread: it cannot confirm.
    kill(Pid::from_raw(pid), Signal::SIGSTOP).expect("stop the agent");
    let id = server.submit(&json!({"command": ["sh", "-c", "touch started.txt"], "cwd": "app"})).await;
    let run = server.run(&id).await;
    assert_eq!((run["state"].as_str(), run["path"].as_str()), (Some("committed"), Some("warm")), "{run}");
    let (status, cancelled) =
        server.call(reqwest::Method::POST, &format!("/v1/runs/{id}/cancel"), Some(API_KEY), None).await;
    assert_eq!((status, cancelled["state"].as_str()), (200, Some("cancelled")), "{cancelled}");
    kill(Pid::from_raw(pid), Signal::SIGCONT).expect("continue the agent");
    server.until("the cancelled standby to exit", async || (!process_alive(pid)).then_some(())).await;
    let run = server.run(&id).await;
    assert_eq!(run["state"], "cancelled");
    assert!(run["timestamps"]["started"].is_null(), "{run}");
    assert!(!kinds(&server.get(&format!("/v1/runs/{id}/events")).await).contains(&EventKind::Started));
    let sandbox = server.sandbox(&standby).await;
    assert_eq!(sandbox["state"], "retired", "{sandbox}");
    assert!(!server.sandbox_dir(&standby).join("workspace/app/started.txt").exists());
    server.stop(Signal::SIGTERM).await;
}

#[tokio::test]
async fn a_committed_standby_that_dies_before_confirming_is_written_off() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(1, "1s").await;
    let standby = server.ready(1).await.remove(0);
    let pid = agent_pid(&server.sandbox(&standby).await);
    let token = environ_var(pid, "STANDBY_TOKEN").expect("the agent's credential");
    kill(Pid::from_raw(pid), Signal::SIGSTOP).expect("stop the agent");
    let id = server.submit(&json!({"command": ["sh", "-c", "cat built.txt"], "cwd": "app"})).await;
    assert_eq!(server.run(&id).await["attempts"][0]["sandbox_id"], standby.as_str());
    kill(Pid::from_raw(pid), Signal::SIGKILL).expect("kill the agent");
    let run = server.finished(&id).await;
    assert_eq!(
        (run["state"].as_str(), run["path"].as_str()),
        (Some("exited"), Some("cold")),
        "{run}\n{}",
        server.logs()
    );
    assert_eq!(run["attempts"][0]["outcome"], "requeued", "{run}");
    assert!(run["attempts"][0]["reason"].as_str().is_some_and(|r| r.contains("written off")), "{run}");
    // The dead sandbox, relaunched by hand with its credential, is refused
    // with 401: it exits 11 and can never start the run.
    assert_eq!(server.upgrade_status(&token).await, 401);
    let workspace = tempfile::tempdir().expect("a workspace");
    let mut relaunched = AgentBuilder::new(&server.url(), &token).workspace(workspace.path()).spawn();
    let code = relaunched.wait_exit(WAIT).await;
    assert_exit(&relaunched, code, ExitCode::Unauthorized, "the standby credential was refused");
    relaunched.assert_output_lacks(&[&token]);
    server.stop(Signal::SIGTERM).await;
}

#[tokio::test]
async fn the_standby_credential_is_refused_once_the_run_credential_connects() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(1, "500ms").await;
    let standby = server.ready(1).await.remove(0);
    let token =
        environ_var(agent_pid(&server.sandbox(&standby).await), "STANDBY_TOKEN").expect("the agent's credential");
    // Valid while a standby: recognised on the socket, where the agent's own
    // live connection makes a second one a duplicate (409), and on the spec.
    assert_eq!(server.upgrade_status(&token).await, 409, "a second socket on a live standby credential");
    let (status, _) = server.call(reqwest::Method::GET, "/v1/standby/spec", Some(&token), None).await;
    assert_eq!(status, 200, "admitted while a standby");
    let id = server.submit(&json!({"command": ["true"]})).await;
    server.wait_run(&id, "delivery confirmation", |run| run["timestamps"]["delivery_confirmed"].is_string()).await;
    assert_eq!(server.upgrade_status(&token).await, 401);
    let (status, _) = server.call(reqwest::Method::GET, "/v1/standby/spec", Some(&token), None).await;
    assert_eq!(status, 401);
    assert_eq!(server.finished(&id).await["state"], "exited");
    server.stop(Signal::SIGTERM).await;
}

#[tokio::test]
async fn a_server_restart_mid_pool_loses_nothing_and_standbys_reconnect() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(2, "500ms").await;
    server.ready(2).await;
    let id = server.submit(&json!({"command": ["sh", "-c", "echo before the restart; exit 4"]})).await;
    let before = server.finished(&id).await;
    assert_eq!(before["exit_code"], 4);
    let log_before = server.call(reqwest::Method::GET, &format!("/v1/runs/{id}/log"), Some(API_KEY), None).await.1;
    let pool = server.ready(2).await;
    // The hard way: SIGKILL. The agents die with the server (parent-death
    // signal) and nothing is left running.
    server.stop(Signal::SIGKILL).await;

    let server = setup.start(2, "500ms").await;
    let after = server.run(&id).await;
    assert_eq!(
        (after["state"].clone(), after["exit_code"].clone()),
        (before["state"].clone(), before["exit_code"].clone())
    );
    assert_eq!(after["attempts"], before["attempts"]);
    let log_after = server.call(reqwest::Method::GET, &format!("/v1/runs/{id}/log"), Some(API_KEY), None).await.1;
    assert_eq!(log_after, log_before);
    assert!(log_after.as_str().is_some_and(|l| l.contains("before the restart")));
    assert_eq!(kinds(&server.get(&format!("/v1/runs/{id}/events")).await).len(), 2);
    // The same standbys come back: started again on their workspaces, with
    // new credentials, they reconnect.
    let back = server.ready(2).await;
    assert_eq!(back.iter().collect::<BTreeSet<_>>(), pool.iter().collect::<BTreeSet<_>>(), "{}", server.logs());
    for id in &back {
        assert!(server.sandbox(id).await["connections"].as_u64().is_some_and(|n| n >= 2));
    }
    let metrics = server.call(reqwest::Method::GET, "/metrics", Some(API_KEY), None).await.1;
    let reconnects = metrics
        .as_str()
        .and_then(|m| m.lines().find_map(|line| line.strip_prefix("standby_reconnects_total ")))
        .and_then(|n| n.trim().parse::<u64>().ok());
    assert!(reconnects.is_some_and(|n| n >= 2), "{metrics}");
    let next = server.submit(&json!({"command": ["true"]})).await;
    assert_eq!(server.finished(&next).await["path"], "warm");
    server.stop(Signal::SIGTERM).await;
}

#[tokio::test]
async fn api_errors_name_the_field_and_refuse_unknown_runs_and_missing_keys() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(0, "500ms").await;
    let post = reqwest::Method::POST;
    let (status, body) = server.call(post.clone(), "/v1/runs", Some(API_KEY), Some(&json!({"command": "ls"}))).await;
    assert_eq!((status, body["field"].as_str()), (400, Some("command")), "{body}");
    let (status, body) =
        server.call(post.clone(), "/v1/runs", Some(API_KEY), Some(&json!({"command": ["ls"], "env": {"A": 1}}))).await;
    assert_eq!((status, body["field"].as_str()), (400, Some("env.A")), "{body}");
    assert_eq!(server.call(reqwest::Method::GET, "/v1/runs/exe_missing", Some(API_KEY), None).await.0, 404);
    assert_eq!(server.call(post.clone(), "/v1/runs/exe_missing/cancel", Some(API_KEY), None).await.0, 404);
    assert_eq!(server.call(post.clone(), "/v1/runs", None, Some(&json!({"command": ["ls"]}))).await.0, 401);
    assert_eq!(server.call(reqwest::Method::GET, "/v1/sandboxes", None, None).await.0, 401);
    assert_eq!(server.call(reqwest::Method::GET, "/metrics", Some("wrong"), None).await.0, 401);
    assert_eq!(server.get("/v1/runs").await["runs"], json!([]), "nothing was half-written");
    server.stop(Signal::SIGTERM).await;
}

/// The demo runs on its own and prints both paths.
#[tokio::test]
async fn the_demo_prints_a_warm_and_a_cold_run() {
    let mark = format!("demo-{:016x}", RandomState::new().hash_one(std::process::id()));
    let output = tokio::process::Command::new(server_bin())
        .args(["demo", "--agent-bin"])
        .arg(standby_bin())
        .env_remove("RUST_LOG")
        .env(MARK, &mark)
        .stdin(Stdio::null())
        .output();
    let output =
        tokio::time::timeout(Duration::from_secs(180), output).await.expect("the demo ends").expect("run the demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let rows: Vec<&str> = stdout.lines().filter(|line| line.starts_with("exe_")).collect();
    assert!(rows.iter().any(|row| row.split_whitespace().nth(1) == Some("warm")), "{stdout}");
    assert!(rows.iter().any(|row| row.split_whitespace().nth(1) == Some("cold")), "{stdout}");
    assert!(stdout.lines().any(|line| line.starts_with("cold / warm: ")), "the demo prints the ratio: {stdout}");
    assert!(stdout.contains("in a virtual environment"), "the setup step built the sample's venv: {stdout}");
    let left = marked(&mark);
    assert!(left.is_empty(), "the demo left processes running: {}", describe(&left));
}
