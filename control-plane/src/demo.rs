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

mod client;
mod docker;
mod sample;
mod threads;

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use standby_protocol::{Secret, Spec};

use standby_control_plane::provider::SandboxProvider;
use standby_control_plane::provider::local::{LocalOptions, LocalProvider};
use standby_control_plane::seal::SealKey;
use standby_control_plane::server::{RunningServer, ServerConfig, ServerError, start};
use standby_control_plane::store::{SqliteStore, StoreError};

use self::client::{Client, Progress, agent_logs};
use self::sample::{Sample, sample};
pub use self::threads::run_threads;

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
    DockerApi {
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

/// The demo's local sandboxes, stopped within five seconds.
fn local_provider(scene: &Scene, options: &DemoOptions) -> LocalProvider {
    let stop_grace = Duration::from_secs(5);
    let options_local = LocalOptions { stop_grace, ..LocalOptions::default() };
    LocalProvider::with_options(scene.logs.clone(), options.agent_bin.clone(), options_local)
}

/// Runs the demo, writing the table to `out`; the rows (with `--provider
/// docker`, the warm and cold rows; its follow-ups are printed after them).
pub async fn run(options: &DemoOptions, out: &mut impl Write) -> Result<Vec<DemoRow>, DemoError> {
    if let Sandboxes::Docker { image, network } = &options.sandboxes {
        return docker::run(options, image, network, out).await;
    }
    let scene = Scene::new(options)?;
    let provider = Arc::new(local_provider(&scene, options));
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
    config.launch_timeout = Duration::from_secs(60);
    configure(&mut config);
    let server = start(config, store, provider).await?;
    let result = body(&server, &key).await;
    server.shutdown().await?;
    result
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

fn median(mut values: Vec<u64>) -> Option<u64> {
    values.sort_unstable();
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => values.get(n / 2).copied(),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2),
    }
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
