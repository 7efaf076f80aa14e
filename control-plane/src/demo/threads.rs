//! `demo --threads`: follow-up turns of a thread on each path (Tier 2,
//! Tier 1, cold) and the median submit-to-start time of each.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use standby_control_plane::provider::SandboxProvider;
use standby_control_plane::server::{RunningServer, ServerConfig};
use standby_protocol::Secret;

use super::client::{Client, Progress, agent_logs};
use super::{DemoError, DemoOptions, Scene, Serve, median, seconds, with_server};

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
pub(super) const DEMO_WARM_IDLE: Duration = Duration::from_secs(2);

/// Every follow-up path, in the order the threads demo takes them.
const FOLLOW_UP_PATHS: [&str; 3] = ["parked_running", "parked_stopped", "cold"];

/// The threads demo's pool policy: threads' sandboxes kept running for
/// [`DEMO_WARM_IDLE`], then stopped and kept.
pub(super) fn park_threads(config: &mut ServerConfig) {
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
    let provider = Arc::new(super::local_provider(&scene, options));
    let serve = Serve { pool_size: 0, heartbeat: Duration::from_millis(250), listen: None };
    with_server(&scene, provider, serve, park_threads, async |server, key| {
        let threads = Threads { title: "standby demo --threads", rounds, paths: &FOLLOW_UP_PATHS };
        drive_threads(options, threads, server, key, &scene.logs, out).await
    })
    .await
}

/// Which follow-ups the threads demo takes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Threads<'a> {
    /// What the first line calls this part of the demo.
    pub(super) title: &'a str,
    pub(super) rounds: usize,
    pub(super) paths: &'a [&'a str],
}

pub(super) async fn drive_threads<P: SandboxProvider>(
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
