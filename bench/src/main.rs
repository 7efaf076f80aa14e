//! `standby-bench`: the benchmarks of `docs/benchmarks.md`, run against the
//! real `standby` and `standby-server` release binaries on loopback.
//! `scripts/bench` builds them, raises the open-files limit, runs this and
//! draws the chart; see there for the one command.
//!
//! Results go to `<out>/results.json` (every sample) and `<out>/summary.md`
//! (the tables, also printed on stdout). Benchmarks are not tests: nothing
//! here asserts a duration; the targets are reported, met or not.

mod burst;
mod capacity;
mod compare;
mod fixture;
mod followups;
mod idle;
mod latency;
mod procfs;
mod replicas;
mod report;
mod server;
mod spread;
mod spread_capacity;
mod stats;
mod worker;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, ValueEnum};

use crate::fixture::{RepoSize, SetupKind};
use crate::report::{Meta, Results};

/// Benchmarks of standby: assignment to run start by path and injected
/// latency, the idle footprint of a waiting agent, and the server's
/// capacity under thousands of standby connections.
#[derive(Debug, Parser)]
#[command(name = "standby-bench", version, about)]
struct Cli {
    /// Fewer runs, a lighter setup step, shorter windows, 1,000 connections
    /// only: for CI.
    #[arg(long)]
    quick: bool,
    /// Where `results.json`, `summary.md` and the working files go.
    #[arg(long, default_value = "target/bench", value_name = "DIR")]
    out: PathBuf,
    /// The directory holding the `standby` and `standby-server` binaries
    /// (`scripts/bench` builds the `dist` profile, what ships).
    #[arg(long, default_value = "target/dist", value_name = "DIR")]
    bin_dir: PathBuf,
    /// The directory of a baseline build's `standby` and `standby-server`
    /// (e.g. a build of `main`), for `--only compare`.
    #[arg(long, value_name = "DIR")]
    baseline_bin_dir: Option<PathBuf>,
    /// `--only compare` on the warm parallel path alone: no cold runs, no
    /// follow-up turns (a change to the warm start, measured in minutes).
    #[arg(long)]
    compare_warm_only: bool,
    /// Run only these parts (comma-separated); `compare` (needs
    /// `--baseline-bin-dir`) is never run unless named.
    #[arg(long, value_delimiter = ',', value_name = "PART")]
    only: Vec<Part>,
    /// Runs per path and latency, and follow-up turns per tier (default 20, quick 2).
    #[arg(long, value_name = "N")]
    runs: Option<usize>,
    /// Injected latencies in milliseconds (default 0,50,200, quick 0,200).
    #[arg(long, value_delimiter = ',', value_name = "MS")]
    latencies: Option<Vec<u64>>,
    /// Connection counts of the capacity test (default 1000,5000,10000, quick 1000).
    #[arg(long, value_delimiter = ',', value_name = "N")]
    connections: Option<Vec<usize>>,
    /// Spread the capacity test's standbys round-robin over this many
    /// replicas on one PostgreSQL schema (`--store`, else
    /// `STANDBY_TEST_POSTGRES`) and over load-generator processes.
    #[arg(long, value_name = "N")]
    replicas: Option<usize>,
    /// Load-generator processes of the spread capacity test (default: as
    /// few as hold the connections under each one's open-files limit).
    #[arg(long, value_name = "N")]
    workers: Option<usize>,
    /// The spread capacity test's store: a `postgres://` URL (a fresh
    /// schema is made on it and dropped after); one replica without it runs
    /// on SQLite.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// Runs submitted per connection count (default 200, quick 50).
    #[arg(long, value_name = "N")]
    dispatches: Option<usize>,
    /// Runs submitted at once onto as many ready standbys (default 1000, quick 200).
    #[arg(long, value_name = "N")]
    burst_runs: Option<usize>,
    /// `POST /v1/runs` requests in flight during the burst.
    #[arg(long, default_value_t = 64, value_name = "N")]
    burst_concurrency: usize,
    /// Seconds the waiting agent is watched (default 60, quick 10).
    #[arg(long, value_name = "SECONDS")]
    idle_window: Option<u64>,
    /// Keep `<out>/work` (the workspace, server data, agent logs) afterwards.
    #[arg(long)]
    keep_work: bool,
    /// Only generate the latency benchmark's workspace under `<out>/work`
    /// and print its `workspace` JSON: `scripts/bench-docker` serves that
    /// repository to its containers, so both benchmarks clone the same one.
    #[arg(long)]
    fixture_only: bool,
}

/// The endpoint latency follow-up turns are measured at: a server in the
/// same region.
const FOLLOW_UP_LATENCY_MS: u64 = 50;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Part {
    Latency,
    FollowUps,
    Idle,
    Capacity,
    Burst,
    Compare,
}

fn git_commit() -> Option<String> {
    let output = std::process::Command::new("git").args(["rev-parse", "HEAD"]).output().ok()?;
    output.status.success().then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn binary(dir: &Path, name: &str) -> Result<PathBuf> {
    let path = std::path::absolute(dir.join(name)).with_context(|| format!("resolving {}", dir.display()))?;
    if !path.is_file() {
        bail!("{} is missing: build it with `cargo build --profile dist --bins` (scripts/bench does)", path.display());
    }
    Ok(path)
}

async fn run(cli: Cli) -> Result<()> {
    let started = Instant::now();
    let started_at = jiff::Timestamp::now().to_string();
    let load_before = procfs::load_average();
    let parts = if cli.only.is_empty() {
        vec![Part::Latency, Part::FollowUps, Part::Idle, Part::Capacity, Part::Burst]
    } else {
        cli.only.clone()
    };
    let server = binary(&cli.bin_dir, "standby-server")?;
    std::fs::create_dir_all(&cli.out).with_context(|| format!("creating {}", cli.out.display()))?;
    let out = std::path::absolute(&cli.out).context("resolving the output directory")?;
    let work = out.join("work");
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    }
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;

    let mut results = Results {
        meta: Meta {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            quick: cli.quick,
            started_at,
            duration_s: 0.0,
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            load_average_before: load_before,
            load_average_after: load_before,
            git_commit: git_commit(),
            setup: None,
        },
        latency: None,
        follow_ups: None,
        idle: None,
        capacity: None,
        spread: None,
        burst: None,
        compare: None,
    };
    let needs_fixture = cli.fixture_only || parts.iter().any(|part| !matches!(part, Part::Capacity | Part::Burst));
    let fixture = if needs_fixture {
        let size = RepoSize { files: 2000, bytes_per_file: 10 * 1024 };
        let light = cli.quick && fixture::pip_installs_elsewhere(&fixture::python()?);
        let setup = if light { SetupKind::Light } else { SetupKind::Full };
        say(&format!("generating the workspace ({} files, {setup:?} setup)", size.files));
        results.meta.setup = Some(format!("{setup:?}"));
        // Only the fixture needs the agent: the capacity parts run without it.
        let standby = binary(&cli.bin_dir, "standby")?;
        Some(fixture::generate(&work.join("fixture"), size, setup, &standby)?)
    } else {
        None
    };
    if let (true, Some(fixture)) = (cli.fixture_only, &fixture) {
        writeln!(std::io::stdout(), "{}", fixture.workspace).context("writing to stdout")?;
        return Ok(());
    }
    let heartbeat = Duration::from_millis(500);
    if let (true, Some(fixture)) = (parts.contains(&Part::Latency), &fixture) {
        let options = latency::LatencyOptions {
            runs: cli.runs.unwrap_or(if cli.quick { 2 } else { 20 }),
            warmup: if cli.quick { 0 } else { 1 },
            latencies_ms: cli.latencies.clone().unwrap_or(if cli.quick { vec![0, 200] } else { vec![0, 50, 200] }),
            heartbeat,
        };
        say("assignment to run start");
        results.latency = Some(latency::run(&options, fixture, &server, &work).await?);
    }
    if let (true, Some(fixture)) = (parts.contains(&Part::FollowUps), &fixture) {
        let turns = cli.runs.unwrap_or(if cli.quick { 2 } else { 20 });
        say("follow-up turns");
        results.follow_ups =
            Some(followups::run(fixture, &server, &work, turns, FOLLOW_UP_LATENCY_MS, heartbeat).await?);
    }
    if let (true, Some(fixture)) = (parts.contains(&Part::Idle), &fixture) {
        let window = Duration::from_secs(cli.idle_window.unwrap_or(if cli.quick { 10 } else { 60 }));
        say(&format!("idle footprint ({} s)", window.as_secs()));
        results.idle = Some(idle::run(fixture, &server, &work, window).await?);
    }
    let spread = cli.replicas.is_some() || cli.workers.is_some() || cli.store.is_some();
    if parts.contains(&Part::Capacity) && spread {
        let replicas = cli.replicas.unwrap_or(1).max(1);
        let store = cli.store.clone().or_else(|| {
            (replicas > 1).then(|| std::env::var("STANDBY_TEST_POSTGRES").ok()).flatten().filter(|url| !url.is_empty())
        });
        let options = spread_capacity::SpreadOptions {
            levels: cli.connections.clone().unwrap_or(if cli.quick { vec![1000] } else { vec![10000] }),
            replicas,
            workers: cli.workers,
            store,
            dispatches: cli.dispatches.unwrap_or(if cli.quick { 50 } else { 200 }),
            burst_runs: cli.burst_runs.unwrap_or(if cli.quick { 200 } else { 1000 }),
            burst_concurrency: cli.burst_concurrency,
            heartbeat: Duration::from_secs(10),
            cpu_window: Duration::from_secs(if cli.quick { 10 } else { 30 }),
            dispatch_budget: Duration::from_secs(if cli.quick { 30 } else { 300 }),
        };
        say(&format!("server capacity over {replicas} replica(s)"));
        results.spread = Some(spread_capacity::run(&options, &server, &work).await?);
    } else if parts.contains(&Part::Capacity) {
        let options = capacity::CapacityOptions {
            levels: cli.connections.clone().unwrap_or(if cli.quick { vec![1000] } else { vec![1000, 5000, 10000] }),
            dispatches: cli.dispatches.unwrap_or(if cli.quick { 50 } else { 200 }),
            heartbeat: Duration::from_secs(10),
            cpu_window: Duration::from_secs(if cli.quick { 10 } else { 30 }),
            dispatch_budget: Duration::from_secs(if cli.quick { 30 } else { 300 }),
        };
        say("server capacity");
        results.capacity = Some(capacity::run(&options, &server, &work).await?);
    }
    if let (true, Some(fixture)) = (parts.contains(&Part::Compare), &fixture) {
        let dir = cli.baseline_bin_dir.as_deref().context("--only compare needs --baseline-bin-dir")?;
        let baseline_standby = binary(dir, "standby")?;
        let baseline_fixture = fixture.with_agent(&baseline_standby, "baseline")?;
        let options = latency::LatencyOptions {
            runs: cli.runs.unwrap_or(if cli.quick { 2 } else { 20 }),
            warmup: if cli.quick { 0 } else { 1 },
            latencies_ms: cli.latencies.clone().unwrap_or(if cli.quick { vec![0, 200] } else { vec![0, 50, 200] }),
            heartbeat,
        };
        let builds = compare::Builds {
            fixture,
            server_bin: &server,
            baseline_fixture: &baseline_fixture,
            baseline_server_bin: &binary(dir, "standby-server")?,
            baseline_bin_dir: dir,
        };
        say(&format!("side by side with {}", dir.display()));
        let follow_ups = (!cli.compare_warm_only).then_some(FOLLOW_UP_LATENCY_MS);
        results.compare = Some(compare::run(&options, &builds, &work, follow_ups).await?);
    }
    if parts.contains(&Part::Burst) {
        let options = burst::BurstOptions {
            runs: cli.burst_runs.unwrap_or(if cli.quick { 200 } else { 1000 }),
            concurrency: cli.burst_concurrency,
            heartbeat: Duration::from_secs(10),
        };
        say(&format!("server burst ({} runs)", options.runs));
        results.burst = Some(burst::run(&options, &server, &work).await?);
    }
    results.meta.load_average_after = procfs::load_average();
    results.meta.duration_s = started.elapsed().as_secs_f64();

    let json = serde_json::to_string_pretty(&results).context("encoding the results")?;
    let json_path = out.join("results.json");
    std::fs::write(&json_path, json).with_context(|| format!("writing {}", json_path.display()))?;
    let summary = report::markdown(&results);
    let summary_path = out.join("summary.md");
    std::fs::write(&summary_path, &summary).with_context(|| format!("writing {}", summary_path.display()))?;
    if !cli.keep_work {
        std::fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    }
    let mut stdout = std::io::stdout();
    write!(stdout, "{summary}").context("writing to stdout")?;
    writeln!(stdout, "results: {}\nsummary: {}", json_path.display(), summary_path.display())
        .context("writing to stdout")?;
    Ok(())
}

fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "standby-bench: {line}");
}

/// A load-generator worker of the spread capacity test
/// (`standby-bench capacity-worker HEARTBEAT_MS`, started by the bench).
fn worker_main(heartbeat_ms: Option<&str>) -> Result<()> {
    let heartbeat_ms: u64 = heartbeat_ms.unwrap_or_default().parse().context("the heartbeat in ms")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("the async runtime")?;
    runtime.block_on(worker::run(Duration::from_millis(heartbeat_ms)))
}

fn main() -> ExitCode {
    // reqwest is built with rustls and no default provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some(worker::SUBCOMMAND) {
        return match worker_main(args.next().as_deref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                say(&format!("worker failed: {error:#}"));
                ExitCode::FAILURE
            }
        };
    }
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            say(&format!("cannot start the async runtime: {error}"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            say(&format!("failed: {error:#}"));
            ExitCode::FAILURE
        }
    }
}
