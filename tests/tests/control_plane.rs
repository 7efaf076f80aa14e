//! The reference control plane end to end: the real `standby-server`
//! binary with its local provider, launching real `standby` agents on
//! real `file://` git repositories, everything on 127.0.0.1.
//!
//! Needs both binaries built (`cargo build --bins`); `STANDBY_SERVER_BIN`
//! and `STANDBY_BIN` override where they are looked for.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use standby_e2e::harness::{describe, process_alive, write_json};
use standby_e2e::{AgentBuilder, GitRepo, standby_bin};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_tungstenite::tungstenite::{self, client::IntoClientRequest};

const KEY: &str = "e2e-api-key";
const WAIT: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(50);
/// Set on the server; the local provider passes it on to every agent, and
/// the agents to their children, so a test finds every process it caused.
const MARK: &str = "E2E_CONTROL_PLANE_MARK";

fn server_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("STANDBY_SERVER_BIN") {
        return PathBuf::from(path);
    }
    let bin = standby_bin().with_file_name("standby-server");
    assert!(bin.is_file(), "{} is missing: run `cargo build --bins` first", bin.display());
    bin
}

/// Processes whose environment holds `MARK=mark`.
fn marked(mark: &str) -> Vec<i32> {
    let needle = format!("{MARK}={mark}");
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| process_alive(*pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|entry| entry == needle.as_bytes()))
        })
        .collect()
}

/// A variable of a live process's initial environment.
fn environ_var(pid: i32, name: &str) -> String {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("read the agent's environment");
    let prefix = format!("{name}=");
    environ
        .split(|b| *b == 0)
        .find_map(|entry| entry.strip_prefix(prefix.as_bytes()))
        .map(|value| String::from_utf8_lossy(value).into_owned())
        .unwrap_or_else(|| panic!("{name} is not in the environment of {pid}"))
}

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

/// One `standby-server serve` process on a data directory that outlives it.
struct Server {
    child: tokio::process::Child,
    url: String,
    mark: String,
    data: PathBuf,
    stderr: PathBuf,
    http: reqwest::Client,
}

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
        let data = self.dir.path().join("data");
        let stderr = self.dir.path().join(format!(
            "server-{}.log",
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
        ));
        let mut command = tokio::process::Command::new(server_bin());
        for (name, _) in std::env::vars_os() {
            if let Some(name) = name.to_str()
                && (name.starts_with("STANDBY_") || name == "RUST_LOG")
            {
                command.env_remove(name);
            }
        }
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--api-key", KEY, "--linger", "3s", "--stop-grace", "5s"])
            .args(["--pool-size", &pool_size.to_string(), "--heartbeat-interval", heartbeat])
            .arg("--data-dir")
            .arg(&data)
            .arg("--spec")
            .arg(self.dir.path().join("spec.json"))
            .arg("--agent-bin")
            .arg(standby_bin())
            .args(["--log", "debug", "--agent-log", "debug"])
            .env(MARK, &self.mark)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("create the server log"));
        let mut child = command.spawn().expect("start standby-server");
        let stdout = child.stdout.take().expect("a piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .unwrap_or_else(|_| {
                panic!("standby-server did not start\n{}", std::fs::read_to_string(&stderr).unwrap_or_default())
            })
            .expect("read the server's stdout")
            .unwrap_or_else(|| {
                panic!("standby-server exited\n{}", std::fs::read_to_string(&stderr).unwrap_or_default())
            });
        let url = line.strip_prefix("standby-server listening on ").expect("the listening line").trim().to_owned();
        let _ = rustls::crypto::ring::default_provider().install_default();
        Server { child, url, mark: self.mark.clone(), data, stderr, http: reqwest::Client::new() }
    }
}

impl Server {
    fn logs(&self) -> String {
        let mut text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        text = lines[lines.len().saturating_sub(80)..].join("\n");
        for entry in std::fs::read_dir(self.data.join("sandboxes")).into_iter().flatten().flatten() {
            if let Ok(log) = std::fs::read_to_string(entry.path().join("agent.log")) {
                let lines: Vec<&str> = log.lines().collect();
                text.push_str(&format!(
                    "\n--- {} ---\n{}",
                    entry.path().display(),
                    lines[lines.len().saturating_sub(30)..].join("\n")
                ));
            }
        }
        text
    }

    async fn call(&self, method: reqwest::Method, path: &str, key: Option<&str>, body: Option<Value>) -> (u16, Value) {
        let mut request = self.http.request(method, format!("{}{path}", self.url));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("the server answers");
        let status = response.status().as_u16();
        let text = response.text().await.expect("a body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn get(&self, path: &str) -> Value {
        let (status, body) = self.call(reqwest::Method::GET, path, Some(KEY), None).await;
        assert_eq!(status, 200, "GET {path}: {body}");
        body
    }

    async fn submit(&self, body: Value) -> String {
        let (status, created) = self.call(reqwest::Method::POST, "/v1/runs", Some(KEY), Some(body)).await;
        assert_eq!(status, 201, "{created}");
        created["id"].as_str().expect("a run id").to_owned()
    }

    async fn sandboxes(&self) -> Vec<Value> {
        self.get("/v1/sandboxes").await["sandboxes"].as_array().cloned().unwrap_or_default()
    }

    /// Polls until `check` gives a value (a cross-process condition raises
    /// no event here); panics with the logs on timeout.
    async fn until<T>(&self, what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(value) = check().await {
                return value;
            }
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}\n{}", self.logs());
            tokio::time::sleep(POLL).await;
        }
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

    async fn sandbox(&self, id: &str) -> Value {
        self.sandboxes().await.into_iter().find(|s| s["id"] == id).unwrap_or_else(|| panic!("no sandbox {id}"))
    }

    async fn run(&self, id: &str) -> Value {
        self.get(&format!("/v1/runs/{id}")).await
    }

    async fn wait_run(&self, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        self.until(what, async || Some(self.run(id).await).filter(|run| done(run))).await
    }

    async fn finished(&self, id: &str) -> Value {
        self.wait_run(id, "the run to finish", |run| {
            matches!(run["state"].as_str(), Some("exited" | "failed" | "cancelled"))
        })
        .await
    }

    /// Upgrades `/ws` with `token`; the status of a refusal, 101 when admitted.
    async fn upgrade_status(&self, token: &str) -> u16 {
        let url = format!("{}/ws", self.url.replacen("http", "ws", 1));
        let mut request = url.into_client_request().expect("a request");
        request.headers_mut().insert("Authorization", format!("Bearer {token}").parse().expect("a header"));
        request.headers_mut().insert("Standby-Protocol", "1".parse().expect("a header"));
        match tokio_tungstenite::connect_async(request).await {
            Ok(_) => 101,
            Err(tungstenite::Error::Http(response)) => response.status().as_u16(),
            Err(error) => panic!("the upgrade failed: {error}"),
        }
    }

    fn pid(&self) -> i32 {
        self.child.id().and_then(|pid| i32::try_from(pid).ok()).expect("the server runs")
    }

    /// Stops the server with `signal` and waits until neither it nor any
    /// process it caused is left.
    async fn stop(mut self, signal: Signal) {
        let _ = kill(Pid::from_raw(self.pid()), signal);
        let status = tokio::time::timeout(WAIT, self.child.wait()).await.expect("the server exits").expect("wait");
        if signal == Signal::SIGTERM {
            assert!(status.success(), "standby-server exited {status} on SIGTERM\n{}", self.logs());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let left = marked(&self.mark);
            if left.is_empty() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "orphans after the server exited: {}\n{}",
                describe(&left),
                self.logs()
            );
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            let _ = kill(Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX)), Signal::SIGKILL);
        }
        for pid in marked(&self.mark) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

fn agent_pid(sandbox: &Value) -> i32 {
    sandbox["pid"].as_i64().and_then(|pid| i32::try_from(pid).ok()).expect("a local sandbox has a pid")
}

fn kinds(events: &Value) -> BTreeSet<String> {
    events["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["event"]["type"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn warm_path_end_to_end_and_metrics_reflect_it() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(1, "500ms").await;
    let ready = server.ready(1).await;
    let id = server
        .submit(json!({
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
    let log = server.call(reqwest::Method::GET, &format!("/v1/runs/{id}/log"), Some(KEY), None).await.1;
    let log = log.as_str().expect("the log is text").to_owned();
    assert!(log.contains("built ") && log.contains("task=t-1"), "{log}");
    assert!(!log.contains("hunter2-very-secret") && log.contains("[REDACTED]"), "{log}");
    let events = server.get(&format!("/v1/runs/{id}/events")).await;
    assert_eq!(kinds(&events), BTreeSet::from(["started".to_owned(), "exited".to_owned()]));
    let metrics = server.call(reqwest::Method::GET, "/metrics", Some(KEY), None).await.1;
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
        server.submit(json!({"command": ["sh", "-c", "cat built.txt"], "cwd": "app", "workspace": workspace})).await;
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
    let metrics = server.call(reqwest::Method::GET, "/metrics", Some(KEY), None).await.1;
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
    let id = server.submit(json!({"command": ["sh", "-c", "touch started.txt"], "cwd": "app"})).await;
    let run = server.run(&id).await;
    assert_eq!((run["state"].as_str(), run["path"].as_str()), (Some("committed"), Some("warm")), "{run}");
    let (status, cancelled) =
        server.call(reqwest::Method::POST, &format!("/v1/runs/{id}/cancel"), Some(KEY), None).await;
    assert_eq!((status, cancelled["state"].as_str()), (200, Some("cancelled")), "{cancelled}");
    kill(Pid::from_raw(pid), Signal::SIGCONT).expect("continue the agent");
    server.until("the cancelled standby to exit", async || (!process_alive(pid)).then_some(())).await;
    let run = server.run(&id).await;
    assert_eq!(run["state"], "cancelled");
    assert!(run["timestamps"]["started"].is_null(), "{run}");
    assert!(!kinds(&server.get(&format!("/v1/runs/{id}/events")).await).contains("started"));
    let sandbox = server.sandbox(&standby).await;
    assert_eq!(sandbox["state"], "retired", "{sandbox}");
    assert!(!server.data.join("sandboxes").join(&standby).join("workspace/app/started.txt").exists());
    server.stop(Signal::SIGTERM).await;
}

#[tokio::test]
async fn a_committed_standby_that_dies_before_confirming_is_written_off() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(1, "1s").await;
    let standby = server.ready(1).await.remove(0);
    let pid = agent_pid(&server.sandbox(&standby).await);
    let token = environ_var(pid, "STANDBY_TOKEN");
    kill(Pid::from_raw(pid), Signal::SIGSTOP).expect("stop the agent");
    let id = server.submit(json!({"command": ["sh", "-c", "cat built.txt"], "cwd": "app"})).await;
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
    let mut relaunched = AgentBuilder::new(&server.url, &token).workspace(workspace.path()).spawn();
    assert_eq!(relaunched.wait_exit(WAIT).await, 11, "{}", relaunched.output_tail());
    relaunched.assert_output_lacks(&[&token]);
    server.stop(Signal::SIGTERM).await;
}

#[tokio::test]
async fn the_standby_credential_is_refused_once_the_run_credential_connects() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(1, "500ms").await;
    let standby = server.ready(1).await.remove(0);
    let token = environ_var(agent_pid(&server.sandbox(&standby).await), "STANDBY_TOKEN");
    assert_eq!(server.upgrade_status(&token).await, 101, "admitted while a standby");
    let id = server.submit(json!({"command": ["true"]})).await;
    server.wait_run(&id, "delivery confirmation", |run| run["timestamps"]["delivery_confirmed"].is_string()).await;
    assert_eq!(server.upgrade_status(&token).await, 401);
    let spec =
        server.http.get(format!("{}/v1/standby/spec", server.url)).bearer_auth(&token).send().await.expect("answered");
    assert_eq!(spec.status().as_u16(), 401);
    assert_eq!(server.finished(&id).await["state"], "exited");
    server.stop(Signal::SIGTERM).await;
}

#[tokio::test]
async fn a_server_restart_mid_pool_loses_nothing_and_standbys_reconnect() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(2, "500ms").await;
    server.ready(2).await;
    let id = server.submit(json!({"command": ["sh", "-c", "echo before the restart; exit 4"]})).await;
    let before = server.finished(&id).await;
    assert_eq!(before["exit_code"], 4);
    let log_before = server.call(reqwest::Method::GET, &format!("/v1/runs/{id}/log"), Some(KEY), None).await.1;
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
    let log_after = server.call(reqwest::Method::GET, &format!("/v1/runs/{id}/log"), Some(KEY), None).await.1;
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
    let metrics = server.call(reqwest::Method::GET, "/metrics", Some(KEY), None).await.1;
    let reconnects = metrics
        .as_str()
        .and_then(|m| m.lines().find_map(|line| line.strip_prefix("standby_reconnects_total ")))
        .and_then(|n| n.trim().parse::<u64>().ok());
    assert!(reconnects.is_some_and(|n| n >= 2), "{metrics}");
    let next = server.submit(json!({"command": ["true"]})).await;
    assert_eq!(server.finished(&next).await["path"], "warm");
    server.stop(Signal::SIGTERM).await;
}

#[tokio::test]
async fn api_errors_name_the_field_and_refuse_unknown_runs_and_missing_keys() {
    let repo = sample_repo();
    let setup = Setup::new(&repo);
    let server = setup.start(0, "500ms").await;
    let post = reqwest::Method::POST;
    let (status, body) = server.call(post.clone(), "/v1/runs", Some(KEY), Some(json!({"command": "ls"}))).await;
    assert_eq!((status, body["field"].as_str()), (400, Some("command")), "{body}");
    let (status, body) =
        server.call(post.clone(), "/v1/runs", Some(KEY), Some(json!({"command": ["ls"], "env": {"A": 1}}))).await;
    assert_eq!((status, body["field"].as_str()), (400, Some("env.A")), "{body}");
    assert_eq!(server.call(reqwest::Method::GET, "/v1/runs/exe_missing", Some(KEY), None).await.0, 404);
    assert_eq!(server.call(post.clone(), "/v1/runs/exe_missing/cancel", Some(KEY), None).await.0, 404);
    assert_eq!(server.call(post.clone(), "/v1/runs", None, Some(json!({"command": ["ls"]}))).await.0, 401);
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
    let left = marked(&mark);
    assert!(left.is_empty(), "the demo left processes running: {}", describe(&left));
}
