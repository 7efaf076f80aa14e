//! Assignment to run start, by path and injected endpoint latency.
//!
//! For each injected latency, three servers run side by side on the same
//! generated workspace: warm with the parallel install plan (pool of one),
//! warm with `--install-plan sequential` (pool of one), and cold (pool of
//! zero: every run gets a sandbox created when it is submitted). Each
//! iteration submits one run to each, one at a time, in an order that
//! rotates every iteration, and only when all three are quiet (every
//! standby prepared, every finished sandbox gone), so no measurement shares
//! the CPU with a preparation. Ratios are taken per iteration.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result, anyhow, bail};
use serde::Serialize;
use serde_json::{Value, json};

use crate::fixture::Fixture;
use crate::server::ServerProc;
use crate::stats::{Summary, summarize};

/// The three ways a run can reach its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Path3 {
    WarmParallel,
    WarmSequential,
    Cold,
}

impl Path3 {
    pub const ALL: [Self; 3] = [Self::WarmParallel, Self::WarmSequential, Self::Cold];

    pub fn label(self) -> &'static str {
        match self {
            Self::WarmParallel => "warm, parallel",
            Self::WarmSequential => "warm, sequential",
            Self::Cold => "cold",
        }
    }
}

/// The install steps that call out of the sandbox (the server, or the git
/// remote for `refresh`), as the agent names them in its timing line.
const NETWORK_STEPS: [&str; 6] =
    ["secrets", "attachments", "metadata", "cloud_credentials", "git_credentials", "refresh"];

/// One run, as the agent and the server saw it.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Which build ran it, when builds are compared side by side.
    #[serde(skip_serializing_if = "str::is_empty")]
    pub build: &'static str,
    pub path: Path3,
    pub latency_ms: u64,
    pub iteration: usize,
    pub run_id: String,
    pub sandbox_id: String,
    /// Assignment accepted by the agent → run spawned on its terminal
    /// (the agent's `critical_path_ms`).
    pub assignment_to_start_ms: f64,
    /// `POST /v1/runs` sent → run spawned (the agent's log timestamp of
    /// "run started"; one clock, one machine).
    pub submit_to_start_ms: f64,
    pub confirm_ms: Option<f64>,
    /// The run's spawn on the prepared terminal (the agent's `spawn_ms`).
    pub spawn_ms: Option<f64>,
    /// Each install step's duration, as the agent logged it.
    pub steps: BTreeMap<String, f64>,
    /// Slowest network step + confirmation + terminal check (warm paths).
    pub bound_ms: Option<f64>,
    /// The plan's own critical path from the steps: the longest of the
    /// confirmation, check + slowest network branch + terminal, and the MCP
    /// restart (warm paths).
    pub model_ms: Option<f64>,
    /// The server's `durations_ms` of the run (its `started` is when the
    /// agent's event arrived, so it includes one injected latency).
    pub server_durations_ms: Value,
}

/// A path at one latency.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub path: Path3,
    pub latency_ms: u64,
    pub assignment_to_start: Option<Summary>,
    pub submit_to_start: Option<Summary>,
    pub bound: Option<Summary>,
    pub model: Option<Summary>,
    /// `median(assignment_to_start) / median(bound)`.
    pub p50_over_bound: Option<f64>,
    /// Median of each step's duration, and of `confirm`, `spawn` and
    /// `git_chain` (git credentials, then refresh).
    pub step_medians: BTreeMap<String, f64>,
}

/// Ratios of two paths, per iteration (same latency, consecutive runs).
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    pub latency_ms: u64,
    pub name: String,
    pub what: String,
    pub per_iteration: Option<Summary>,
    /// Ratio of the two medians.
    pub of_medians: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LatencyResults {
    pub runs_per_path: usize,
    pub warmup_iterations: usize,
    pub latencies_ms: Vec<u64>,
    pub repo_files: usize,
    pub repo_bytes: u64,
    pub cells: Vec<Cell>,
    pub ratios: Vec<Ratio>,
    pub samples: Vec<Sample>,
}

#[derive(Debug, Clone)]
pub struct LatencyOptions {
    pub runs: usize,
    pub warmup: usize,
    pub latencies_ms: Vec<u64>,
    pub heartbeat: Duration,
}

struct Side {
    build: &'static str,
    path: Path3,
    server: ServerProc,
}

/// Binaries to measure: the server and, through the fixture's wrappers,
/// the agent.
#[derive(Debug, Clone, Copy)]
pub struct Build<'a> {
    /// Empty when one build is measured.
    pub label: &'static str,
    pub fixture: &'a Fixture,
    pub server_bin: &'a Path,
}

impl Build<'_> {
    /// How its servers and directories are named.
    pub fn prefix(&self) -> String {
        if self.label.is_empty() { String::new() } else { format!("{} ", self.label) }
    }
}

fn server_args(fixture: &Fixture, path: Path3, latency_ms: u64, heartbeat: Duration) -> Vec<OsString> {
    let (pool, agent) = match path {
        Path3::WarmParallel => ("1", &fixture.agent_parallel),
        Path3::WarmSequential => ("1", &fixture.agent_sequential),
        Path3::Cold => ("0", &fixture.agent_parallel),
    };
    let mut args: Vec<OsString> = Vec::new();
    let mut push = |flag: &str, value: OsString| {
        args.push(flag.into());
        args.push(value);
    };
    push("--pool-size", pool.into());
    push("--agent-bin", agent.into());
    push("--spec", fixture.spec_path.clone().into());
    push("--inject-latency", format!("{latency_ms}ms").into());
    push("--heartbeat-interval", format!("{}ms", heartbeat.as_millis()).into());
    push("--linger", "20s".into());
    push("--stop-grace", "5s".into());
    push("--max-attempts", "1".into());
    args
}

/// The body of every benchmark run: every install call has something to
/// fetch (a secret, an attachment, metadata, cloud and git credentials).
pub fn submission(workspace: &Value, iteration: usize) -> Value {
    json!({
        "command": ["sh", "-c", "test -x .venv/bin/python"],
        "cwd": "app",
        "env": {"TASK_ID": format!("bench-{iteration}")},
        "secrets": {"API_TOKEN": format!("bench-secret-{iteration}-8c1f0e")},
        "cloud_env": {"CLOUD_SESSION_TOKEN": format!("bench-cloud-{iteration}-51d2aa")},
        "git_credentials": [{"protocol": "https", "host": "git.example", "username": "bench", "password": format!("bench-git-{iteration}-77e0")}],
        "metadata": {"task": "benchmark", "iteration": iteration},
        "attachments": [{"name": "task.md", "content": "# Task\nMeasure the start of this run.\n"}],
        "mcp_env": {"TASK_ID": format!("bench-{iteration}")},
        "workspace": workspace,
    })
}

/// Waits until every server is quiet: each warm pool has a ready
/// candidate, no sandbox is preparing, and every retired sandbox's agent
/// has exited and its directory is gone.
async fn wait_quiet(sides: &[Side], timeout: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let mut quiet = true;
        for side in sides {
            let sandboxes = side.server.sandboxes().await?;
            let candidates = sandboxes.iter().filter(|s| s["candidate"].as_bool() == Some(true)).count();
            let busy = sandboxes.iter().any(|s| {
                let retired = s["state"].as_str() == Some("retired");
                let gone = s["pid"].is_null() && s["dir"].as_str().is_none_or(|dir| !Path::new(dir).exists());
                if retired { !gone } else { s["candidate"].as_bool() != Some(true) }
            });
            let wanted = usize::from(side.path != Path3::Cold);
            if busy || candidates < wanted {
                quiet = false;
                break;
            }
        }
        if quiet {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            let mut logs = String::new();
            for side in sides {
                logs.push_str(&format!("--- {} ---\n{}\n", side.server.name, side.server.log_tail(15)));
            }
            bail!("the servers were not quiet within {timeout:?}\n{logs}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The agent's "run started" line of `run_id` in the sandbox's JSON log
/// (a thread's sandbox runs several turns, one agent each, one log).
fn run_started_line(logs: &Path, run_id: &str, sandbox_id: &str) -> Result<Value> {
    let path = logs.join(format!("{sandbox_id}.log"));
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|line| line["message"].as_str() == Some("run started") && line["execution_id"].as_str() == Some(run_id))
        .ok_or_else(|| anyhow!("no \"run started\" line for {run_id} in {}", path.display()))
}

/// `mcp=12ms check=0ms ...` as a map.
fn parse_steps(text: &str) -> BTreeMap<String, f64> {
    text.split_whitespace()
        .filter_map(|pair| {
            let (name, value) = pair.split_once('=')?;
            Some((name.to_owned(), value.strip_suffix("ms")?.parse::<f64>().ok()?))
        })
        .collect()
}

fn micros_since_epoch(at: SystemTime) -> f64 {
    at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_micros() as f64
}

fn bound_and_model(steps: &BTreeMap<String, f64>, confirm: f64) -> (f64, f64) {
    let step = |name: &str| steps.get(name).copied().unwrap_or(0.0);
    let slowest = NETWORK_STEPS.iter().map(|name| step(name)).fold(0.0, f64::max);
    let bound = slowest + confirm + step("terminal");
    let branches = ["secrets", "attachments", "metadata", "cloud_credentials"]
        .iter()
        .map(|name| step(name))
        .chain([step("git_credentials") + step("refresh")])
        .fold(0.0, f64::max);
    let model = confirm.max(step("check") + branches + step("terminal")).max(step("mcp"));
    (bound, model)
}

/// One run as the agent and the server saw it.
#[derive(Debug, Clone)]
pub struct Timed {
    pub run_id: String,
    pub sandbox_id: String,
    pub assignment_to_start_ms: f64,
    pub submit_to_start_ms: f64,
    pub confirm_ms: Option<f64>,
    pub spawn_ms: Option<f64>,
    pub steps: BTreeMap<String, f64>,
    pub server: Value,
}

/// Submits `body`, waits for the run to exit 0 on the `wanted_path`, and
/// reads the agent's own timing line.
pub async fn run_once(server: &ServerProc, agent_logs: &Path, body: &Value, wanted_path: &str) -> Result<Timed> {
    let submitted = SystemTime::now();
    let run = server.submit(body).await?;
    let run_id = run["id"].as_str().ok_or_else(|| anyhow!("no run id in {run}"))?.to_owned();
    let run = server.wait_run(&run_id, Duration::from_secs(600)).await?;
    if run["path"].as_str() != Some(wanted_path) {
        bail!("run {run_id} on {} took the {} path, not {wanted_path}: {run}", server.name, run["path"]);
    }
    let sandbox_id = run["attempts"]
        .as_array()
        .and_then(|attempts| attempts.last())
        .and_then(|attempt| attempt["sandbox_id"].as_str())
        .ok_or_else(|| anyhow!("no sandbox in the attempts of {run}"))?
        .to_owned();
    let line = run_started_line(agent_logs, &run_id, &sandbox_id)?;
    let started: jiff::Timestamp = line["timestamp"]
        .as_str()
        .ok_or_else(|| anyhow!("no timestamp in {line}"))?
        .parse()
        .context("parsing the agent's log timestamp")?;
    let critical =
        line["critical_path_ms"].as_f64().ok_or_else(|| anyhow!("no critical_path_ms in the agent's line {line}"))?;
    Ok(Timed {
        run_id,
        sandbox_id,
        assignment_to_start_ms: critical,
        submit_to_start_ms: (started.as_microsecond() as f64 - micros_since_epoch(submitted)) / 1000.0,
        confirm_ms: line["confirm_ms"].as_f64(),
        spawn_ms: line["spawn_ms"].as_f64(),
        steps: parse_steps(line["steps"].as_str().unwrap_or_default()),
        server: run,
    })
}

async fn measure(side: &Side, fixture: &Fixture, latency_ms: u64, iteration: usize) -> Result<Sample> {
    let body = submission(&fixture.workspace, iteration);
    let wanted_path = if side.path == Path3::Cold { "cold" } else { "warm" };
    let timed = run_once(&side.server, &fixture.agent_logs, &body, wanted_path).await?;
    let warm = side.path != Path3::Cold;
    let (bound, model) = bound_and_model(&timed.steps, timed.confirm_ms.unwrap_or(0.0));
    Ok(Sample {
        build: side.build,
        path: side.path,
        latency_ms,
        iteration,
        run_id: timed.run_id,
        sandbox_id: timed.sandbox_id,
        assignment_to_start_ms: timed.assignment_to_start_ms,
        submit_to_start_ms: timed.submit_to_start_ms,
        confirm_ms: timed.confirm_ms,
        spawn_ms: timed.spawn_ms,
        steps: timed.steps,
        bound_ms: warm.then_some(bound),
        model_ms: warm.then_some(model),
        server_durations_ms: timed.server["durations_ms"].clone(),
    })
}

pub fn progress(line: &str) {
    let mut stderr = std::io::stderr();
    let _ = writeln!(stderr, "{line}");
}

/// Runs the whole latency benchmark.
pub async fn run(
    options: &LatencyOptions,
    fixture: &Fixture,
    server_bin: &Path,
    work: &Path,
) -> Result<LatencyResults> {
    let builds = [Build { label: "", fixture, server_bin }];
    let samples = sample_paths(options, &builds, &Path3::ALL, work).await?;
    Ok(summarise(options, fixture, samples))
}

/// Runs `paths` of every build at each latency, one server per path and
/// build, one run at a time in rotating order.
pub async fn sample_paths(
    options: &LatencyOptions,
    builds: &[Build<'_>],
    paths: &[Path3],
    work: &Path,
) -> Result<Vec<Sample>> {
    let mut samples = Vec::new();
    for &latency_ms in &options.latencies_ms {
        let mut sides = Vec::new();
        for &path in paths {
            for build in builds {
                let name = format!("{}{}@{latency_ms}ms", build.prefix(), path.label());
                let dir: PathBuf = work.join(
                    format!("latency-{}{latency_ms}ms-{path:?}", build.prefix().replace(' ', "-")).to_lowercase(),
                );
                let args = server_args(build.fixture, path, latency_ms, options.heartbeat);
                let server = ServerProc::start(&name, build.server_bin, &dir, &args).await?;
                sides.push(Side { build: build.label, path, server });
            }
        }
        let fixture = builds.first().map(|build| build.fixture).ok_or_else(|| anyhow!("no build to measure"))?;
        let result = iterate(options, fixture, &sides, latency_ms, &mut samples).await;
        for side in sides {
            side.server.stop(Duration::from_secs(60)).await?;
        }
        result?;
    }
    Ok(samples)
}

async fn iterate(
    options: &LatencyOptions,
    fixture: &Fixture,
    sides: &[Side],
    latency_ms: u64,
    samples: &mut Vec<Sample>,
) -> Result<()> {
    let total = options.warmup + options.runs;
    for iteration in 0..total {
        let warmup = iteration < options.warmup;
        for k in 0..sides.len() {
            let side = &sides[(iteration + k) % sides.len()];
            wait_quiet(sides, Duration::from_secs(600)).await?;
            let sample = measure(side, fixture, latency_ms, iteration).await?;
            progress(&format!(
                "  {:>17} @ {latency_ms:>3} ms  run {:>2}/{}{}: assignment→start {:>7.1} ms, submit→start {:>8.1} ms",
                format!("{} {}", side.build, side.path.label()).trim_start(),
                iteration + 1,
                total,
                if warmup { " (warm-up)" } else { "" },
                sample.assignment_to_start_ms,
                sample.submit_to_start_ms
            ));
            if !warmup {
                samples.push(sample);
            }
        }
    }
    Ok(())
}

/// A run's install steps with the rest of its critical path: the
/// delivery confirmation, the spawn, and the git chain (credentials, then
/// the refresh that needs them).
pub fn critical_parts(sample: &Sample) -> BTreeMap<String, f64> {
    let mut parts = sample.steps.clone();
    if let Some(confirm) = sample.confirm_ms {
        parts.insert("confirm".into(), confirm);
    }
    if let Some(spawn) = sample.spawn_ms {
        parts.insert("spawn".into(), spawn);
    }
    if let (Some(git), Some(refresh)) = (sample.steps.get("git_credentials"), sample.steps.get("refresh")) {
        parts.insert("git_chain".into(), git + refresh);
    }
    parts
}

fn values(samples: &[&Sample], f: impl Fn(&Sample) -> Option<f64>) -> Vec<f64> {
    samples.iter().filter_map(|s| f(s)).collect()
}

fn summarise(options: &LatencyOptions, fixture: &Fixture, samples: Vec<Sample>) -> LatencyResults {
    let mut cells = Vec::new();
    let mut ratios = Vec::new();
    for &latency_ms in &options.latencies_ms {
        let of = |path: Path3| -> Vec<&Sample> {
            samples.iter().filter(|s| s.path == path && s.latency_ms == latency_ms).collect()
        };
        for path in Path3::ALL {
            let these = of(path);
            let a2s = summarize(&values(&these, |s| Some(s.assignment_to_start_ms)));
            let bound = summarize(&values(&these, |s| s.bound_ms));
            let parts: Vec<BTreeMap<String, f64>> = these.iter().map(|s| critical_parts(s)).collect();
            let mut step_names: Vec<String> = parts.iter().flat_map(|p| p.keys().cloned()).collect();
            step_names.sort();
            step_names.dedup();
            let step_medians = step_names
                .into_iter()
                .filter_map(|name| {
                    let of_name: Vec<f64> = parts.iter().filter_map(|p| p.get(&name).copied()).collect();
                    Some((name, summarize(&of_name)?.median))
                })
                .collect();
            cells.push(Cell {
                path,
                latency_ms,
                p50_over_bound: a2s.zip(bound).map(|(a, b)| a.median / b.median.max(1.0)),
                assignment_to_start: a2s,
                submit_to_start: summarize(&values(&these, |s| Some(s.submit_to_start_ms))),
                bound,
                model: summarize(&values(&these, |s| s.model_ms)),
                step_medians,
            });
        }
        let paired = |top: Path3, bottom: Path3, f: fn(&Sample) -> f64| -> (Option<Summary>, Option<f64>) {
            let (tops, bottoms) = (of(top), of(bottom));
            let per: Vec<f64> = tops
                .iter()
                .filter_map(|t| {
                    let b = bottoms.iter().find(|b| b.iteration == t.iteration)?;
                    Some(f(t) / f(b).max(0.5))
                })
                .collect();
            let median = |v: &[&Sample]| summarize(&v.iter().map(|s| f(s)).collect::<Vec<_>>()).map(|s| s.median);
            (summarize(&per), median(&tops).zip(median(&bottoms)).map(|(t, b)| t / b.max(0.5)))
        };
        for (name, what, top, bottom, f) in [
            (
                "sequential / parallel",
                "assignment → start",
                Path3::WarmSequential,
                Path3::WarmParallel,
                (|s: &Sample| s.assignment_to_start_ms) as fn(&Sample) -> f64,
            ),
            ("cold / warm", "submit → start", Path3::Cold, Path3::WarmParallel, |s: &Sample| s.submit_to_start_ms),
            ("cold / warm", "assignment → start", Path3::Cold, Path3::WarmParallel, |s: &Sample| {
                s.assignment_to_start_ms
            }),
        ] {
            let (per_iteration, of_medians) = paired(top, bottom, f);
            ratios.push(Ratio { latency_ms, name: name.into(), what: what.into(), per_iteration, of_medians });
        }
    }
    LatencyResults {
        runs_per_path: options.runs,
        warmup_iterations: options.warmup,
        latencies_ms: options.latencies_ms.clone(),
        repo_files: fixture.repo_files,
        repo_bytes: fixture.repo_bytes,
        cells,
        ratios,
        samples,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_parse_and_bound_follows_the_plan() {
        let steps = parse_steps(
            "check=0ms mcp=9ms secrets=201ms metadata=202ms cloud_credentials=200ms git_credentials=203ms attachments=405ms refresh=31ms terminal=1ms",
        );
        assert_eq!(steps.get("attachments"), Some(&405.0));
        let (bound, model) = bound_and_model(&steps, 4.0);
        assert_eq!(bound, 405.0 + 4.0 + 1.0);
        assert_eq!(model, 0.0 + 405.0 + 1.0);
    }
}
