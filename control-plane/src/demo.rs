//! `standby-server demo`: the whole system on this machine, with no
//! external service. It generates a sample git repository (with a real
//! setup step and an MCP server), starts the server with the local
//! provider on 127.0.0.1 and a pool of two standbys, submits three runs at
//! once so that two take the warm path and one the cold path, prints what
//! each took, and removes everything it made.
//!
//! It builds nothing: it runs the `standby` binary it is given (by default
//! the one next to its own executable).
//!
//! `--threads` shows follow-up turns instead: for a few rounds, a turn of a
//! thread, then its follow-up on each path — the sandbox still running
//! (Tier 2), the sandbox stopped and started again (Tier 1), and no kept
//! sandbox at all (cold) — and the median submit-to-start time of each.

mod docker;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use standby_protocol::{McpServer, Repo, Secret, SetupStep, Spec, Workspace};

use standby_control_plane::provider::SandboxProvider;
use standby_control_plane::provider::local::LocalProvider;
use standby_control_plane::seal::SealKey;
use standby_control_plane::server::{RunningServer, ServerConfig, ServerError, start};
use standby_control_plane::store::{SqliteStore, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("the agent binary {0} does not exist: build it first with `cargo build --bins`, or pass --agent-bin")]
    NoAgent(PathBuf),
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("git {args} failed in {dir}: {message}")]
    Git { args: String, dir: PathBuf, message: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("HTTP call {call} failed: {message}")]
    Http { call: String, message: String },
    #[error("timed out after {seconds} s waiting for {what}\n{logs}")]
    Timeout { what: String, seconds: u64, logs: String },
    #[error("the demo did not go as expected: {0}")]
    Unexpected(String),
    #[error(transparent)]
    Docker(#[from] standby_control_plane::provider::docker::DockerError),
    #[error("the Docker Engine failed to {action}: {source}")]
    Engine {
        action: String,
        #[source]
        source: bollard::errors::Error,
    },
    #[error(
        "the sandbox image `{image}` is not in the Docker Engine and cannot be built here: {why}; \
         build it with `scripts/build-image {image}` from the repository"
    )]
    NoImage { image: String, why: String },
}

/// How the demo runs.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub agent_bin: PathBuf,
    /// Standbys kept ready (at least one run more than this goes cold).
    pub pool_size: usize,
    /// Bound on each wait (standbys ready, runs finished).
    pub timeout: Duration,
    /// Added to the sample's setup step (a `sleep`), standing in for a
    /// dependency install: what a cold sandbox pays and a kept one skips.
    pub setup_cost: Duration,
    pub sandboxes: Sandboxes,
}

/// Where the demo's sandboxes are made.
#[derive(Debug, Clone)]
pub enum Sandboxes {
    /// Directories and process groups on this machine (the default).
    Local,
    /// Containers of the Docker Engine: from `image`, on `network` (made
    /// when missing, removed at the end when the demo made it).
    Docker { image: String, network: String },
}

/// One row of the demo's table.
#[derive(Debug, Clone)]
pub struct DemoRow {
    pub run_id: String,
    pub path: String,
    pub submit_to_start_ms: Option<u64>,
    pub queued_ms: Option<u64>,
    pub commit_to_sent_ms: Option<u64>,
    pub sent_to_confirmed_ms: Option<u64>,
    pub confirmed_to_started_ms: Option<u64>,
    pub exit_code: Option<i64>,
    pub output: String,
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> DemoError {
    let path = path.to_owned();
    move |source| DemoError::Io { action, path, source }
}

fn git(dir: &Path, args: &[&str]) -> Result<(), DemoError> {
    let output = std::process::Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_AUTHOR_NAME", "Standby Demo")
        .env("GIT_AUTHOR_EMAIL", "demo@standby.invalid")
        .env("GIT_COMMITTER_NAME", "Standby Demo")
        .env("GIT_COMMITTER_EMAIL", "demo@standby.invalid")
        .output()
        .map_err(io("run git in", dir))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(DemoError::Git {
            args: args.join(" "),
            dir: dir.to_owned(),
            message: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

/// The sample's setup step where python3 can make a virtual environment:
/// what `pip install -r requirements.txt`, `npm ci` or `cargo build` is in a
/// real repository, seconds of real work that a cold sandbox pays after the
/// run was submitted and a standby paid before. A virtual environment with
/// its own pip (ensurepip), and the repository's package installed into it
/// by a `.pth` file, as an editable install does, so nothing is fetched.
const SETUP_VENV: &str = r#"#!/bin/sh
set -e
python3 -m venv .venv
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd > "$site/sample_pkg.pth"
.venv/bin/python -m compileall -q sample_pkg
mkdir -p build
.venv/bin/python -c 'import sample_pkg; sample_pkg.build()' > build/info.txt
"#;

/// The sample's setup step without python3's `venv`: a stand-in build.
const SETUP_PLAIN: &str = "#!/bin/sh
set -e
mkdir -p build
echo \"built from $(git rev-parse --short HEAD)\" > build/info.txt
";

/// The sample repository's package, installed by [`SETUP_VENV`].
const SAMPLE_PACKAGE: &str = r#""""The sample repository's package, installed by its setup step."""
import subprocess


def build():
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    print(f"built from {head.stdout.strip()} in a virtual environment")
"#;

const TASK: &str = "#!/bin/sh
# The sample's run: reads what setup built.
echo \"task $1: $(cat build/info.txt), DEMO_TASK=$DEMO_TASK\"
";

/// A tiny TCP server standing in for an MCP server: it accepts and answers
/// one line per connection. It listens on a port of its own choosing, since
/// every local sandbox shares this machine's ports.
const MCP_SERVER: &str = "import socket
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(('127.0.0.1', 0))
server.listen()
while True:
    connection, _ = server.accept()
    connection.sendall(b'{\"jsonrpc\":\"2.0\",\"result\":\"demo notes\"}\\n')
    connection.close()
";

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Whether `python3` can make a virtual environment with its own pip
/// (Debian splits `venv` and `ensurepip` into python3-venv).
fn python_venv() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import venv, ensurepip"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// What the sample's standbys have: an MCP server (python3 on the PATH),
/// and a setup step that builds a Python virtual environment.
#[derive(Debug, Clone, Copy)]
struct Sample {
    mcp: bool,
    venv: bool,
}

/// The sample repository and the spec that prepares it. In a container
/// (`in_container`) there is no python3 (the sandbox image has git and a
/// shell), so no MCP server and the stand-in build.
fn sample(dir: &Path, setup_cost: Duration, in_container: bool) -> Result<(Spec, Sample), DemoError> {
    let python = !in_container && on_path("python3");
    let venv = python && python_venv();
    let base = if venv { SETUP_VENV } else { SETUP_PLAIN };
    let setup =
        if setup_cost.is_zero() { base.to_owned() } else { format!("{base}sleep {:.3}\n", setup_cost.as_secs_f64()) };
    let repo = dir.join("sample-repo");
    std::fs::create_dir_all(repo.join("sample_pkg")).map_err(io("create", &repo))?;
    for (name, content) in [
        ("README.md", "# Sample\nA repository the demo's standbys prepare.\n"),
        (".gitignore", ".venv/\nbuild/\n__pycache__/\n"),
        ("setup.sh", &setup),
        ("task.sh", TASK),
        ("sample_pkg/__init__.py", SAMPLE_PACKAGE),
    ] {
        let path = repo.join(name);
        std::fs::write(&path, content).map_err(io("write", &path))?;
    }
    git(&repo, &["init", "--quiet", "--initial-branch=main"])?;
    git(&repo, &["add", "--all"])?;
    git(&repo, &["commit", "--quiet", "--message", "sample"])?;
    let mut mcp_servers = Vec::new();
    if python {
        let script = dir.join("mcp_notes.py");
        std::fs::write(&script, MCP_SERVER).map_err(io("write", &script))?;
        mcp_servers.push(McpServer {
            name: "notes".into(),
            command: vec!["python3".into(), script.display().to_string()],
            env: [("NOTES_MODE".to_owned(), "read-only".to_owned())].into(),
            ready_tcp: None,
            transport: None,
            url: None,
        });
    }
    let spec = Spec {
        workspace: Workspace {
            repos: vec![Repo {
                url: format!("file://{}", repo.display()),
                path: "app".into(),
                git_ref: Some("main".into()),
                expected_sha: None,
            }],
            setup: vec![SetupStep {
                name: "build".into(),
                command: vec!["sh".into(), "setup.sh".into()],
                cwd: Some("app".into()),
                timeout_s: Some(120),
            }],
        },
        mcp_servers,
        shell: Some(vec!["/bin/sh".into()]),
        deadline: None,
    };
    Ok((spec, Sample { mcp: python, venv }))
}

/// A line on stderr that says what the demo waits for, rewritten in place
/// on a terminal.
struct Progress {
    terminal: bool,
    last: String,
}

impl Progress {
    fn new() -> Self {
        Self { terminal: std::io::stderr().is_terminal(), last: String::new() }
    }

    fn show(&mut self, line: &str) {
        if line == self.last {
            return;
        }
        let mut stderr = std::io::stderr();
        let _ = if self.terminal { write!(stderr, "\r\x1b[2K{line}") } else { writeln!(stderr, "{line}") };
        let _ = stderr.flush();
        self.last = line.to_owned();
    }

    fn done(&mut self) {
        if self.terminal && !self.last.is_empty() {
            let _ = writeln!(std::io::stderr());
        }
        self.last.clear();
    }
}

struct Client {
    http: reqwest::Client,
    base: String,
    key: Secret,
}

impl Client {
    fn new(base: &str, key: &Secret) -> Result<Self, DemoError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| DemoError::Http { call: "client".into(), message: e.to_string() })?;
        Ok(Self { http, base: base.to_owned(), key: key.clone() })
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Result<Value, DemoError> {
        let call = format!("{method} {path}");
        let failed = |message: String| DemoError::Http { call: call.clone(), message };
        let mut request =
            self.http.request(method.clone(), format!("{}{path}", self.base)).bearer_auth(self.key.expose());
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.map_err(|e| failed(e.to_string()))?;
        let status = response.status();
        let text = response.text().await.map_err(|e| failed(e.to_string()))?;
        if !status.is_success() {
            return Err(failed(format!("{status}: {text}")));
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn get(&self, path: &str) -> Result<Value, DemoError> {
        self.call(reqwest::Method::GET, path, None).await
    }
}

/// The tail of every agent log, for a failure message: `<id>/agent.log`
/// of the local provider, `<id>.log` of the Docker provider.
fn agent_logs(root: &Path) -> String {
    let mut logs = String::new();
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let path = entry.path();
        let path = if path.is_dir() { path.join("agent.log") } else { path };
        if let Ok(text) = std::fs::read_to_string(&path) {
            let lines: Vec<&str> = text.lines().collect();
            logs.push_str(&format!(
                "--- {} ---\n{}\n",
                path.display(),
                lines[lines.len().saturating_sub(15)..].join("\n")
            ));
        }
    }
    logs
}

/// Runs the demo, writing the table to `out`; the rows (with `--provider
/// docker`, the warm and cold rows; its follow-ups are printed after them).
pub async fn run(options: &DemoOptions, out: &mut impl Write) -> Result<Vec<DemoRow>, DemoError> {
    if let Sandboxes::Docker { image, network } = &options.sandboxes {
        return docker::run(options, image, network, out).await;
    }
    let scene = Scene::new(options)?;
    let provider = Arc::new(LocalProvider::new(scene.logs.clone(), options.agent_bin.clone()));
    let serve = Serve { pool_size: options.pool_size, heartbeat: Duration::from_millis(500), listen: None };
    with_server(
        &scene,
        provider,
        serve,
        |_| {},
        async |server, key| drive(options, server, key, &scene.logs, scene.sample, out).await,
    )
    .await
}

/// The demo's temporary directory, its sample repository and the spec
/// that prepares it; removed when dropped.
struct Scene {
    dir: tempfile::TempDir,
    spec: Spec,
    sample: Sample,
    /// Where the provider keeps its sandboxes' agent logs.
    logs: PathBuf,
}

impl Scene {
    fn new(options: &DemoOptions) -> Result<Self, DemoError> {
        if !options.agent_bin.is_file() {
            return Err(DemoError::NoAgent(options.agent_bin.clone()));
        }
        let dir =
            tempfile::Builder::new().prefix("standby-demo-").tempdir().map_err(io("create", &std::env::temp_dir()))?;
        let in_container = matches!(options.sandboxes, Sandboxes::Docker { .. });
        let (spec, sample) = sample(dir.path(), options.setup_cost, in_container)?;
        let logs = dir.path().join("sandboxes");
        Ok(Self { dir, spec, sample, logs })
    }
}

/// How the demo's server is started.
#[derive(Debug, Clone, Copy)]
struct Serve {
    pool_size: usize,
    heartbeat: Duration,
    /// Where it listens; 127.0.0.1 on a free port when unset.
    listen: Option<SocketAddr>,
}

/// Starts the server on the scene's spec with `provider`, runs `body`, and
/// stops the server.
async fn with_server<P: SandboxProvider, T>(
    scene: &Scene,
    provider: Arc<P>,
    serve: Serve,
    configure: impl FnOnce(&mut ServerConfig),
    body: impl AsyncFnOnce(&RunningServer<P>, &Secret) -> Result<T, DemoError>,
) -> Result<T, DemoError> {
    let store = Arc::new(SqliteStore::open(&scene.dir.path().join("standby.db"), &SealKey::random())?);
    let key = Secret::new(format!("demo-{:032x}", rand::random::<u128>()));
    let mut config = ServerConfig::new(key.clone(), scene.spec.clone());
    if let Some(listen) = serve.listen {
        config.listen = listen;
    }
    config.pool_size = serve.pool_size;
    config.heartbeat_interval = serve.heartbeat;
    config.linger = Duration::from_secs(5);
    config.stop_grace = Duration::from_secs(5);
    config.launch_timeout = Duration::from_secs(60);
    configure(&mut config);
    let server = start(config, store, provider).await?;
    let result = body(&server, &key).await;
    server.shutdown().await?;
    result
}

/// One follow-up turn of the threads demo.
#[derive(Debug, Clone)]
pub struct FollowUp {
    pub round: usize,
    /// `parked_running` (Tier 2), `parked_stopped` (Tier 1) or `cold`.
    pub path: String,
    pub submit_to_start_ms: u64,
}

/// How long a thread's sandbox stays running in the threads demo (its
/// Tier 1 follow-ups wait for the end of it).
const DEMO_WARM_IDLE: Duration = Duration::from_secs(2);

/// Every follow-up path, in the order the threads demo takes them.
const FOLLOW_UP_PATHS: [&str; 3] = ["parked_running", "parked_stopped", "cold"];

/// The threads demo's pool policy: threads' sandboxes kept running for
/// [`DEMO_WARM_IDLE`], then stopped and kept.
fn park_threads(config: &mut ServerConfig) {
    config.pool_policy.warm_idle = DEMO_WARM_IDLE;
    config.pool_policy.park_stopped = true;
}

/// `demo --threads`: follow-up turns on each path, `rounds` times, and the
/// median submit-to-start time of each.
pub async fn run_threads(
    options: &DemoOptions,
    rounds: usize,
    out: &mut impl Write,
) -> Result<Vec<FollowUp>, DemoError> {
    let scene = Scene::new(options)?;
    let provider = Arc::new(LocalProvider::new(scene.logs.clone(), options.agent_bin.clone()));
    let serve = Serve { pool_size: 0, heartbeat: Duration::from_millis(250), listen: None };
    with_server(&scene, provider, serve, park_threads, async |server, key| {
        let threads = Threads { title: "standby demo --threads", rounds, paths: &FOLLOW_UP_PATHS };
        drive_threads(options, threads, server, key, &scene.logs, out).await
    })
    .await
}

/// Which follow-ups the threads demo takes.
#[derive(Debug, Clone, Copy)]
struct Threads<'a> {
    /// What the first line calls this part of the demo.
    title: &'a str,
    rounds: usize,
    paths: &'a [&'a str],
}

async fn drive_threads<P: SandboxProvider>(
    options: &DemoOptions,
    threads: Threads<'_>,
    server: &RunningServer<P>,
    key: &Secret,
    sandboxes: &Path,
    out: &mut impl Write,
) -> Result<Vec<FollowUp>, DemoError> {
    let Threads { title, rounds, paths } = threads;
    let client = Client::new(server.url(), key)?;
    let wrote = |e: std::io::Error| DemoError::Io { action: "write", path: "stdout".into(), source: e };
    writeln!(
        out,
        "{}: server at {}, warm idle window {}, heartbeat 250ms, {rounds} rounds",
        title,
        server.url(),
        humantime::format_duration(DEMO_WARM_IDLE)
    )
    .map_err(wrote)?;
    let mut progress = Progress::new();
    let mut rows = Vec::new();
    for round in 1..=rounds {
        for &path in paths {
            progress.show(&format!("round {round}/{rounds}: a follow-up turn on the {path} path"));
            let thread = format!("demo-{path}-{round}");
            let first = turn(&client, &thread, options.timeout, sandboxes).await?;
            let sandbox_id = first["attempts"][0]["sandbox_id"].as_str().unwrap_or_default().to_owned();
            let follow_thread = match path {
                "parked_running" => {
                    wait_parked(&client, &sandbox_id, "running", options.timeout, sandboxes).await?;
                    thread
                }
                "parked_stopped" => {
                    wait_parked(&client, &sandbox_id, "stopped", options.timeout, sandboxes).await?;
                    thread
                }
                // Nothing kept for it: what every follow-up costs without
                // the lifecycle.
                _ => format!("{thread}-fresh"),
            };
            let second = turn(&client, &follow_thread, options.timeout, sandboxes).await?;
            if path != "cold" {
                // The turn's sandbox is kept again with a fresh agent: let it
                // settle, so that the end of the demo never stops a sandbox
                // while its next agent is being started.
                wait_parked(&client, &sandbox_id, "running", options.timeout, sandboxes).await?;
            }
            let taken = second["path"].as_str().unwrap_or("-").to_owned();
            if taken != path {
                progress.done();
                return Err(DemoError::Unexpected(format!(
                    "a follow-up meant for the {path} path took {taken}: {second}"
                )));
            }
            let submit_to_start_ms = second["durations_ms"]["submit_to_start"].as_u64().unwrap_or_default();
            rows.push(FollowUp { round, path: taken, submit_to_start_ms });
        }
    }
    progress.done();
    print_follow_ups(out, &rows).map_err(wrote)?;
    Ok(rows)
}

/// Submits a turn of `thread` and waits until it exited 0; its view.
async fn turn(client: &Client, thread: &str, timeout: Duration, sandboxes: &Path) -> Result<Value, DemoError> {
    let script = "cat build/info.txt >> turns.txt; wc -l < turns.txt";
    let body = json!({"command": ["sh", "-c", script], "cwd": "app", "thread_id": thread});
    let created = client.call(reqwest::Method::POST, "/v1/runs", Some(body)).await?;
    let id = created["id"].as_str().unwrap_or_default().to_owned();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let run = client.get(&format!("/v1/runs/{id}")).await?;
        match run["state"].as_str() {
            Some("exited") if run["exit_code"] == 0 => return Ok(run),
            Some("exited" | "failed" | "cancelled") => {
                return Err(DemoError::Unexpected(format!("turn {id} of {thread} did not exit 0: {run}")));
            }
            _ => {}
        }
        if tokio::time::Instant::now() > deadline {
            return Err(DemoError::Timeout {
                what: format!("turn {id} of {thread}"),
                seconds: timeout.as_secs(),
                logs: agent_logs(sandboxes),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the sandbox is parked `mode` and settled: its fresh agent
/// ready (`running`), or its processes gone (`stopped`).
async fn wait_parked(
    client: &Client,
    sandbox_id: &str,
    mode: &str,
    timeout: Duration,
    sandboxes: &Path,
) -> Result<(), DemoError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let listing = client.get("/v1/sandboxes").await?;
        let settled = listing["sandboxes"].as_array().into_iter().flatten().any(|s| {
            s["id"] == sandbox_id
                && s["state"] == "parked"
                && s["park"]["mode"] == mode
                && if mode == "running" { s["last_state"] == "ready" } else { s["running"] == false }
        });
        if settled {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(DemoError::Timeout {
                what: format!("sandbox {sandbox_id} to be parked {mode}"),
                seconds: timeout.as_secs(),
                logs: agent_logs(sandboxes),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn median(mut values: Vec<u64>) -> Option<u64> {
    values.sort_unstable();
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => values.get(n / 2).copied(),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2),
    }
}

fn print_follow_ups(out: &mut impl Write, rows: &[FollowUp]) -> std::io::Result<()> {
    writeln!(out)?;
    writeln!(out, "{:<6} {:<16} {:>13}", "round", "path", "submit→start")?;
    for row in rows {
        writeln!(out, "{:<6} {:<16} {:>13}", row.round, row.path, seconds(Some(row.submit_to_start_ms)))?;
    }
    writeln!(out)?;
    for (path, meaning) in [
        ("parked_running", "Tier 2: the thread's sandbox still running, a fresh agent ready in it"),
        ("parked_stopped", "Tier 1: the thread's sandbox stopped, started again for the turn"),
        ("cold", "nothing kept: a sandbox created for the turn"),
    ] {
        let times: Vec<u64> = rows.iter().filter(|r| r.path == path).map(|r| r.submit_to_start_ms).collect();
        if times.is_empty() {
            continue;
        }
        writeln!(out, "median {path:<15} {:>8}  ({} turns; {meaning})", seconds(median(times.clone())), times.len())?;
    }
    Ok(())
}

async fn drive<P: SandboxProvider>(
    options: &DemoOptions,
    server: &RunningServer<P>,
    key: &Secret,
    sandboxes: &Path,
    sample: Sample,
    out: &mut impl Write,
) -> Result<Vec<DemoRow>, DemoError> {
    let client = Client::new(server.url(), key)?;
    let mut progress = Progress::new();
    let wrote = |e: std::io::Error| DemoError::Io { action: "write", path: "stdout".into(), source: e };
    writeln!(out, "standby demo: server at {}, pool of {} standbys", server.url(), options.pool_size).map_err(wrote)?;
    if !sample.mcp {
        writeln!(out, "(python3 not found: the standbys run without the sample MCP server)").map_err(wrote)?;
    } else if !sample.venv {
        writeln!(out, "(python3 cannot make a virtual environment: the setup step is a stand-in build)")
            .map_err(wrote)?;
    }

    let deadline = tokio::time::Instant::now() + options.timeout;
    loop {
        let listing = client.get("/v1/sandboxes").await?;
        let ready =
            listing["sandboxes"].as_array().map_or(0, |all| all.iter().filter(|s| s["candidate"] == true).count());
        progress.show(&format!(
            "waiting for {} standbys to prepare (clone, setup step{}{}): {ready}/{} ready",
            options.pool_size,
            if sample.venv { " building a Python virtual environment" } else { "" },
            if sample.mcp { ", MCP server" } else { "" },
            options.pool_size
        ));
        if ready >= options.pool_size {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            progress.done();
            return Err(DemoError::Timeout {
                what: "the standbys to be ready".into(),
                seconds: options.timeout.as_secs(),
                logs: agent_logs(sandboxes),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    progress.done();

    let runs = options.pool_size + 1;
    let mut ids = Vec::new();
    for n in 1..=runs {
        let body = json!({
            "command": ["sh", "task.sh", n.to_string()],
            "cwd": "app",
            "mcp_env": {"DEMO_TASK": format!("task-{n}")},
            "env": {"DEMO_TASK": format!("task-{n}")},
        });
        let created = client.call(reqwest::Method::POST, "/v1/runs", Some(body)).await?;
        ids.push(created["id"].as_str().unwrap_or_default().to_owned());
    }
    writeln!(out, "submitted {runs} runs at once: {}", ids.join(", ")).map_err(wrote)?;

    let deadline = tokio::time::Instant::now() + options.timeout;
    let finished = loop {
        let mut views = Vec::new();
        for id in &ids {
            views.push(client.get(&format!("/v1/runs/{id}")).await?);
        }
        let pending: Vec<String> = views
            .iter()
            .filter(|v| !matches!(v["state"].as_str(), Some("exited" | "failed" | "cancelled")))
            .map(|v| {
                format!(
                    "{} {} ({})",
                    v["id"].as_str().unwrap_or("?"),
                    v["state"].as_str().unwrap_or("?"),
                    v["path"].as_str().unwrap_or("-")
                )
            })
            .collect();
        if pending.is_empty() {
            break views;
        }
        progress.show(&format!("waiting for runs to finish: {}", pending.join(", ")));
        if tokio::time::Instant::now() > deadline {
            progress.done();
            return Err(DemoError::Timeout {
                what: "the runs to finish".into(),
                seconds: options.timeout.as_secs(),
                logs: agent_logs(sandboxes),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    progress.done();

    let mut rows = Vec::new();
    for run in &finished {
        let id = run["id"].as_str().unwrap_or_default().to_owned();
        let log = client.call(reqwest::Method::GET, &format!("/v1/runs/{id}/log"), None).await?;
        let output = log
            .as_str()
            .unwrap_or_default()
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or_default()
            .to_owned();
        let ms = |name: &str| run["durations_ms"][name].as_u64();
        rows.push(DemoRow {
            run_id: id,
            path: run["path"].as_str().unwrap_or("-").to_owned(),
            submit_to_start_ms: ms("submit_to_start"),
            queued_ms: ms("queued"),
            commit_to_sent_ms: ms("commit_to_assignment_sent"),
            sent_to_confirmed_ms: ms("assignment_sent_to_delivery_confirmed"),
            confirmed_to_started_ms: ms("delivery_confirmed_to_started"),
            exit_code: run["exit_code"].as_i64(),
            output,
        });
    }
    print_table(out, &rows, sample).map_err(wrote)?;
    for run in &finished {
        if run["state"] != "exited" || run["exit_code"] != 0 {
            return Err(DemoError::Unexpected(format!(
                "run {} ended {} (exit code {}, error {})",
                run["id"], run["state"], run["exit_code"], run["error"]
            )));
        }
    }
    for path in ["warm", "cold"] {
        if !rows.iter().any(|row| row.path == path) {
            return Err(DemoError::Unexpected(format!("no run took the {path} path")));
        }
    }
    Ok(rows)
}

fn seconds(ms: Option<u64>) -> String {
    ms.map_or_else(|| "-".to_owned(), |ms| format!("{:.2}s", ms as f64 / 1000.0))
}

fn print_table(out: &mut impl Write, rows: &[DemoRow], sample: Sample) -> std::io::Result<()> {
    writeln!(out)?;
    writeln!(
        out,
        "{:<18} {:<5} {:>13} {:>8} {:>13} {:>16} {:>17} {:>5}",
        "run", "path", "submit→start", "queued", "commit→sent", "sent→confirmed", "confirmed→start", "exit"
    )?;
    for row in rows {
        writeln!(
            out,
            "{:<18} {:<5} {:>13} {:>8} {:>13} {:>16} {:>17} {:>5}",
            row.run_id,
            row.path,
            seconds(row.submit_to_start_ms),
            seconds(row.queued_ms),
            seconds(row.commit_to_sent_ms),
            seconds(row.sent_to_confirmed_ms),
            seconds(row.confirmed_to_started_ms),
            row.exit_code.map_or_else(|| "-".to_owned(), |c| c.to_string()),
        )?;
    }
    writeln!(out)?;
    let mcp = if sample.mcp { " and started its MCP server" } else { "" };
    writeln!(out, "warm: the run was bound to a standby that had already cloned and set up{mcp};")?;
    writeln!(
        out,
        "cold: no standby was free, so a sandbox was created for the run and prepared after it was submitted."
    )?;
    if let Some((cold, warm, ratio)) = cold_over_warm(rows) {
        writeln!(
            out,
            "cold / warm: {ratio:.0}× (submit→start, medians: cold {}, warm {})",
            seconds(Some(cold)),
            seconds(Some(warm))
        )?;
    }
    for row in rows {
        writeln!(out, "{} output: {}", row.run_id, row.output)?;
    }
    Ok(())
}

/// The medians of the cold and the warm runs' submit-to-start times, and
/// how many times longer cold took: the wait a standby removed.
fn cold_over_warm(rows: &[DemoRow]) -> Option<(u64, u64, f64)> {
    let times = |path: &str| rows.iter().filter(|r| r.path == path).filter_map(|r| r.submit_to_start_ms).collect();
    let (cold, warm) = (median(times("cold"))?, median(times("warm"))?);
    Some((cold, warm, cold as f64 / warm.max(1) as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(path: &str, ms: Option<u64>) -> DemoRow {
        DemoRow {
            run_id: "exe_x".into(),
            path: path.into(),
            submit_to_start_ms: ms,
            queued_ms: None,
            commit_to_sent_ms: None,
            sent_to_confirmed_ms: None,
            confirmed_to_started_ms: None,
            exit_code: Some(0),
            output: String::new(),
        }
    }

    #[test]
    fn cold_over_warm_divides_the_medians() {
        let rows = [row("warm", Some(40)), row("warm", Some(60)), row("cold", Some(5000)), row("cold", None)];
        assert_eq!(cold_over_warm(&rows), Some((5000, 50, 100.0)));
    }

    #[test]
    fn cold_over_warm_needs_both_paths_and_never_divides_by_zero() {
        assert_eq!(cold_over_warm(&[row("warm", Some(40))]), None);
        assert_eq!(cold_over_warm(&[row("cold", Some(40))]), None);
        assert_eq!(cold_over_warm(&[row("cold", Some(40)), row("warm", Some(0))]), Some((40, 0, 40.0)));
    }
}
