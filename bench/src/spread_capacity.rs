//! Capacity spread over replicas and load-generator processes: the
//! standbys of [`crate::capacity`], held by several worker processes
//! ([`crate::worker`], each under its own open-files limit) and dialling
//! one or more replicas round-robin ([`crate::spread::place`]).
//!
//! Per level: the servers start ([`Replicas`]) and the leader spools a
//! credential per standby; each replica's memory is read, every standby
//! connects, and each replica's memory, open sockets and idle CPU are read
//! again over a window of heartbeats only. Then runs are submitted one at
//! a time through the replicas in turn (dispatch: `POST /v1/runs` sent →
//! the assignment frame read, both on `CLOCK_MONOTONIC`), and last a burst
//! of runs is submitted at once through all of them (runs/s: the burst
//! over the span from its first request sent to its last frame read).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;

use crate::burst::warm_up;
use crate::capacity::{progress, wait_for};
use crate::procfs::{self, ProcSample};
use crate::replicas::Replicas;
use crate::server::API_KEY;
use crate::spread::{self, Event};
use crate::stats::{Summary, summarize};
use crate::worker;

#[derive(Debug, Clone)]
pub struct SpreadOptions {
    pub levels: Vec<usize>,
    pub replicas: usize,
    /// Load-generator processes; `None`: as few as their limits allow.
    pub workers: Option<usize>,
    /// A `postgres://` URL (a fresh schema is made on it); `None`: SQLite.
    pub store: Option<String>,
    pub dispatches: usize,
    pub burst_runs: usize,
    pub burst_concurrency: usize,
    pub heartbeat: Duration,
    pub cpu_window: Duration,
    pub dispatch_budget: Duration,
}

/// One replica's figures at one level.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplicaFigures {
    pub id: String,
    pub role: String,
    /// Standbys that dialled this replica.
    pub standbys: usize,
    pub rss_minted_kib: u64,
    pub rss_connected_kib: Option<Summary>,
    /// `(median RSS connected - RSS minted) / standbys dialled here`.
    pub kib_per_connection: f64,
    /// Open descriptors before and after the standbys connected: the
    /// sockets dialled to the replica (and, on the leader, one link per
    /// replica).
    pub fds_minted: usize,
    pub fds_connected: usize,
    /// `(median RSS connected - RSS minted) / descriptors added`.
    pub kib_per_socket: f64,
    pub threads: u64,
    pub idle_cpu_percent_of_core: f64,
    /// Read for the plain capacity test's table, not in the spread's.
    #[serde(skip)]
    pub rss_anon_minted_kib: u64,
    #[serde(skip)]
    pub rss_anon_connected_kib: Option<Summary>,
    #[serde(skip)]
    pub rss_after_dispatch_kib: u64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct SpreadLevel {
    pub connections: usize,
    pub replicas: usize,
    pub workers: usize,
    pub store: String,
    /// Why this level could not be measured to the end (what was measured
    /// before is kept).
    pub error: Option<String>,
    pub connect_s: f64,
    pub connect_failures: usize,
    pub lost: usize,
    pub servers: Vec<ReplicaFigures>,
    pub dispatch_ms: Option<Summary>,
    pub dispatches: usize,
    pub burst_runs: usize,
    pub burst_assigned: usize,
    pub burst_runs_per_s: Option<f64>,
    pub burst_submit_to_frame_ms: Option<Summary>,
    /// The machine's 1, 5 and 15 minute load averages at the end of the idle window.
    pub load_average: [f64; 3],
    /// The idle window's length, for the plain capacity test's table.
    #[serde(skip)]
    pub idle_window_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpreadResults {
    pub heartbeat_s: f64,
    pub open_files_limit: u64,
    pub levels: Vec<SpreadLevel>,
}

/// Descriptors a worker keeps aside from its standbys' sockets (the run
/// connections it opens when acting runs out, stdio, the runtime).
const WORKER_RESERVE: usize = 1000;

pub async fn run(options: &SpreadOptions, server_bin: &Path, work: &Path) -> Result<SpreadResults> {
    let open_files_limit = procfs::raise_open_files_limit();
    let mut levels = Vec::new();
    for &connections in &options.levels {
        levels.push(level(options, server_bin, work, connections, open_files_limit).await?);
    }
    Ok(SpreadResults { heartbeat_s: options.heartbeat.as_secs_f64(), open_files_limit, levels })
}

/// The worker processes and what they report.
struct Workers {
    children: Vec<Child>,
    stdins: Vec<ChildStdin>,
    /// Each worker's last counts: connected, failed, lost.
    counts: Arc<Mutex<Vec<(usize, usize, usize)>>>,
}

impl Workers {
    async fn start(count: usize, heartbeat: Duration, assigned: mpsc::UnboundedSender<(String, u64)>) -> Result<Self> {
        let exe = std::env::current_exe().context("locating standby-bench")?;
        let counts = Arc::new(Mutex::new(vec![(0, 0, 0); count]));
        let (mut children, mut stdins) = (Vec::new(), Vec::new());
        for index in 0..count {
            let mut child = Command::new(&exe)
                .arg(worker::SUBCOMMAND)
                .arg(heartbeat.as_millis().to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .context("starting a load-generator worker")?;
            stdins.push(child.stdin.take().ok_or_else(|| anyhow!("no stdin of a worker"))?);
            let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout of a worker"))?;
            let (counts, assigned) = (Arc::clone(&counts), assigned.clone());
            tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    match Event::decode(&line) {
                        Some(Event::Counts { connected, failed, lost }) => {
                            if let Ok(mut counts) = counts.lock() {
                                counts[index] = (connected, failed, lost);
                            }
                        }
                        Some(Event::Assigned { id, monotonic_ns }) => {
                            let _ = assigned.send((id, monotonic_ns));
                        }
                        None => {}
                    }
                }
            });
            children.push(child);
        }
        Ok(Self { children, stdins, counts })
    }

    /// Connected, failed and lost standbys over every worker.
    fn totals(&self) -> (usize, usize, usize) {
        self.counts
            .lock()
            .map_or((0, 0, 0), |counts| counts.iter().fold((0, 0, 0), |sum, c| (sum.0 + c.0, sum.1 + c.1, sum.2 + c.2)))
    }

    async fn stop(mut self) {
        self.stdins.clear();
        for child in &mut self.children {
            if tokio::time::timeout(Duration::from_secs(10), child.wait()).await.is_err() {
                let _ = child.kill().await;
            }
        }
    }
}

/// Hands every credential of the spool not handed out before to a worker,
/// dialling the replica [`spread::place`] says.
struct Spreader {
    spool: PathBuf,
    urls: Vec<String>,
    seen: HashSet<PathBuf>,
    placed: usize,
    per_replica: Vec<usize>,
}

impl Spreader {
    async fn connect_new(&mut self, workers: &mut Workers) -> Result<usize> {
        let mut added = 0;
        for entry in std::fs::read_dir(&self.spool).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|ext| ext != "token") || self.seen.contains(&path) {
                continue;
            }
            let Ok(credential) = std::fs::read_to_string(&path) else { continue };
            self.seen.insert(path);
            let (replica, worker) = spread::place(self.placed, self.urls.len(), workers.stdins.len());
            self.placed += 1;
            self.per_replica[replica] += 1;
            let line =
                spread::Command::Connect { url: self.urls[replica].clone(), credential: credential.trim().into() };
            workers.stdins[worker]
                .write_all(format!("{}\n", line.encode()).as_bytes())
                .await
                .context("handing a standby to a worker")?;
            added += 1;
        }
        Ok(added)
    }
}

async fn level(
    options: &SpreadOptions,
    server_bin: &Path,
    work: &Path,
    connections: usize,
    open_files_limit: u64,
) -> Result<SpreadLevel> {
    let dir = work.join(format!("spread-{connections}x{}", options.replicas));
    let per_worker = usize::try_from(open_files_limit).unwrap_or(usize::MAX).saturating_sub(WORKER_RESERVE);
    let worker_count = options.workers.unwrap_or_else(|| spread::workers_needed(connections, per_worker));
    let mut level = SpreadLevel {
        connections,
        replicas: options.replicas,
        workers: worker_count,
        store: if options.store.is_some() { "postgres" } else { "sqlite" }.to_owned(),
        ..SpreadLevel::default()
    };
    progress(&format!(
        "  {connections} standbys over {} replica(s) ({}), {worker_count} worker process(es)",
        options.replicas, level.store
    ));
    let replicas =
        Replicas::start(options.replicas, options.store.as_deref(), server_bin, &dir, connections, options.heartbeat)
            .await?;
    let (sender, receiver) = mpsc::unbounded_channel();
    let workers = Workers::start(worker_count, options.heartbeat, sender).await;
    let result = match workers {
        Ok(mut workers) => {
            let result = drive(options, &replicas, &dir, &mut workers, receiver, &mut level).await;
            workers.stop().await;
            result
        }
        Err(error) => Err(error),
    };
    let stopped = replicas.stop().await;
    if let Err(error) = result {
        // A level the servers cannot hold is a result, not the end of the
        // benchmark: the next level and the report still run.
        progress(&format!("  {connections} standbys: not measured to the end: {error:#}"));
        level.error = Some(format!("{error:#}"));
    }
    stopped?;
    Ok(level)
}

/// Measures one level into `level`, phase by phase.
async fn drive(
    options: &SpreadOptions,
    replicas: &Replicas,
    dir: &Path,
    workers: &mut Workers,
    mut assigned: mpsc::UnboundedReceiver<(String, u64)>,
    level: &mut SpreadLevel,
) -> Result<()> {
    let connections = level.connections;
    let spool = dir.join("spool");
    progress(&format!("  {connections} standbys: minting credentials"));
    wait_for("the spooled credentials", Duration::from_secs(900), async || {
        replicas.check_alive()?;
        Ok(procfs::count_entries(&spool, ".token") >= connections)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let leader = replicas.leader().await?;
    let roles = replicas.roles().await?;
    let minted: Vec<ProcSample> =
        replicas.servers.iter().map(|server| procfs::sample(server.pid)).collect::<Result<_>>()?;
    let fds_minted: Vec<usize> = replicas.servers.iter().map(|server| procfs::open_fds(server.pid)).collect();

    progress(&format!("  {connections} standbys: connecting"));
    let connecting = Instant::now();
    let mut spreader = Spreader {
        spool: spool.clone(),
        urls: replicas.servers.iter().map(|server| server.url.clone()).collect(),
        seen: HashSet::new(),
        placed: 0,
        per_replica: vec![0; replicas.servers.len()],
    };
    spreader.connect_new(workers).await?;
    let per_replica = spreader.per_replica.clone();
    let mut registered = 0;
    let settled = wait_for("every standby to connect", Duration::from_secs(900), async || {
        replicas.check_alive()?;
        let (connected, failed, _) = workers.totals();
        registered = replicas.servers[leader].metric("standby_connected_standbys").await? as usize;
        Ok(connected + failed >= connections && registered >= connected)
    })
    .await;
    let (connected, failed, _) = workers.totals();
    level.connect_failures = failed;
    settled.with_context(|| format!("{connected} of {connections} upgraded, {registered} registered by the leader"))?;
    level.connect_s = connecting.elapsed().as_secs_f64();
    if failed > 0 {
        bail!(
            "{failed} of {connections} standbys could not connect; the leader's log:\n{}",
            replicas.servers[leader].log_tail(20)
        );
    }

    // One whole heartbeat round, so every connection has settled.
    tokio::time::sleep(options.heartbeat + Duration::from_secs(2)).await;
    progress(&format!("  {connections} standbys: idle for {:?}", options.cpu_window));
    idle(options, replicas, &roles, &per_replica, &minted, &fds_minted, level).await?;
    level.lost = workers.totals().2;

    progress(&format!("  {connections} standbys: {} dispatches", options.dispatches));
    let mut early: HashMap<String, u64> = HashMap::new();
    let mut latencies = Vec::new();
    let budget = Instant::now() + options.dispatch_budget;
    for index in 0..options.dispatches {
        if Instant::now() > budget {
            level.error = Some(format!(
                "dispatching stopped after {} of {} runs: the {:?} budget ran out",
                latencies.len(),
                options.dispatches,
                options.dispatch_budget
            ));
            break;
        }
        let server = &replicas.servers[index % replicas.servers.len()];
        let submitted = procfs::monotonic_ns();
        let run = server.submit(&json!({"command": ["true"]})).await?;
        let id = run["id"].as_str().ok_or_else(|| anyhow!("no run id in {run}"))?.to_owned();
        let frame = frame_of(&id, &mut assigned, &mut early, Duration::from_secs(60)).await?;
        latencies.push(frame.saturating_sub(submitted) as f64 / 1e6);
        level.dispatch_ms = summarize(&latencies);
        level.dispatches = latencies.len();
        server.wait_run(&id, Duration::from_secs(60)).await?;
        // The pool was topped up with a new credential: connect it, so the
        // servers keep holding as many standbys.
        wait_for("the replacement credential", Duration::from_secs(30), async || {
            Ok(spreader.connect_new(workers).await? > 0)
        })
        .await?;
    }
    for (figures, server) in level.servers.iter_mut().zip(&replicas.servers) {
        figures.rss_after_dispatch_kib = procfs::sample(server.pid)?.rss_kib;
    }
    burst(options, replicas, &mut assigned, &mut early, level).await
}

/// The assignment frame of run `id`: from those read before, or the next
/// ones (keeping the others for later).
async fn frame_of(
    id: &str,
    assigned: &mut mpsc::UnboundedReceiver<(String, u64)>,
    early: &mut HashMap<String, u64>,
    timeout: Duration,
) -> Result<u64> {
    if let Some(at) = early.remove(id) {
        return Ok(at);
    }
    tokio::time::timeout(timeout, async {
        while let Some((other, at)) = assigned.recv().await {
            if other == id {
                return Ok(at);
            }
            early.insert(other, at);
        }
        Err(anyhow!("the load generator stopped"))
    })
    .await
    .map_err(|_| anyhow!("run {id}: no assignment frame within {timeout:?}"))?
}

/// Each replica's memory and CPU over the idle window.
async fn idle(
    options: &SpreadOptions,
    replicas: &Replicas,
    roles: &[String],
    per_replica: &[usize],
    minted: &[ProcSample],
    fds_minted: &[usize],
    level: &mut SpreadLevel,
) -> Result<()> {
    let started = Instant::now();
    let sample_all = || replicas.servers.iter().map(|server| procfs::sample(server.pid)).collect::<Result<Vec<_>>>();
    let mut readings = vec![sample_all()?];
    while started.elapsed() < options.cpu_window {
        tokio::time::sleep(Duration::from_secs(1)).await;
        readings.push(sample_all()?);
    }
    let window = started.elapsed().as_secs_f64();
    let ticks = procfs::clock_ticks() as f64;
    level.load_average = procfs::load_average();
    level.idle_window_s = window;
    for (index, server) in replicas.servers.iter().enumerate() {
        let (first, last) = (readings[0][index], readings[readings.len() - 1][index]);
        let cpu_ms = (last.cpu_ticks.saturating_sub(first.cpu_ticks) as f64 * 1000.0 / ticks)
            .max(last.cpu_ns.saturating_sub(first.cpu_ns) as f64 / 1e6);
        let rss = summarize(&readings.iter().map(|r| r[index].rss_kib as f64).collect::<Vec<_>>());
        let grown = rss.map_or(0.0, |s| s.median) - minted[index].rss_kib as f64;
        let fds_connected = procfs::open_fds(server.pid);
        let sockets = fds_connected.saturating_sub(fds_minted[index]);
        level.servers.push(ReplicaFigures {
            id: server.name.clone(),
            role: roles.get(index).cloned().unwrap_or_default(),
            standbys: per_replica[index],
            rss_minted_kib: minted[index].rss_kib,
            rss_connected_kib: rss,
            kib_per_connection: grown / per_replica[index].max(1) as f64,
            fds_minted: fds_minted[index],
            fds_connected,
            kib_per_socket: grown / sockets.max(1) as f64,
            threads: last.threads,
            idle_cpu_percent_of_core: cpu_ms / (window * 1000.0) * 100.0,
            rss_anon_minted_kib: minted[index].rss_anon_kib,
            rss_anon_connected_kib: summarize(
                &readings.iter().map(|r| r[index].rss_anon_kib as f64).collect::<Vec<_>>(),
            ),
            rss_after_dispatch_kib: 0,
        });
    }
    Ok(())
}

/// `burst_runs` submitted at once through the replicas in turn.
async fn burst(
    options: &SpreadOptions,
    replicas: &Replicas,
    assigned: &mut mpsc::UnboundedReceiver<(String, u64)>,
    early: &mut HashMap<String, u64>,
    level: &mut SpreadLevel,
) -> Result<()> {
    let runs = options.burst_runs.min(level.connections);
    if runs == 0 {
        return Ok(());
    }
    level.burst_runs = runs;
    progress(&format!("  {} standbys: a burst of {runs} runs", level.connections));
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(options.burst_concurrency)
        .build()
        .context("building the HTTP client")?;
    for server in &replicas.servers {
        warm_up(&http, &server.url, options.burst_concurrency.div_ceil(replicas.servers.len())).await?;
    }
    let gate = Arc::new(Semaphore::new(options.burst_concurrency));
    let mut submits = JoinSet::new();
    let first_sent = procfs::monotonic_ns();
    for index in 0..runs {
        let url = format!("{}/v1/runs", replicas.servers[index % replicas.servers.len()].url);
        let (http, gate) = (http.clone(), Arc::clone(&gate));
        submits.spawn(async move {
            let _permit = gate.acquire_owned().await.map_err(|_| anyhow!("the submission gate closed"))?;
            let sent = procfs::monotonic_ns();
            let response = http.post(&url).bearer_auth(API_KEY).json(&json!({"command": ["true"]})).send().await?;
            let status = response.status();
            let body: Value = response.json().await?;
            if !status.is_success() {
                bail!("POST /v1/runs: {status}: {body}");
            }
            let id = body["id"].as_str().ok_or_else(|| anyhow!("no run id in {body}"))?.to_owned();
            Ok::<_, anyhow::Error>((id, sent))
        });
    }
    let mut sent = HashMap::with_capacity(runs);
    while let Some(joined) = submits.join_next().await {
        let (id, at) = joined.context("a submission task")??;
        sent.insert(id, at);
    }
    let mut frames = HashMap::with_capacity(runs);
    for (id, at) in early.drain() {
        if sent.contains_key(&id) {
            frames.insert(id, at);
        }
    }
    let collected = tokio::time::timeout(Duration::from_secs(120), async {
        while frames.len() < runs {
            let Some((id, at)) = assigned.recv().await else { break };
            if sent.contains_key(&id) {
                frames.insert(id, at);
            }
        }
    })
    .await;
    level.burst_assigned = frames.len();
    let last = frames.values().max().copied().unwrap_or(first_sent);
    level.burst_runs_per_s = spread::runs_per_s(frames.len(), first_sent, last);
    level.burst_submit_to_frame_ms = summarize(
        &frames.iter().filter_map(|(id, at)| Some(at.saturating_sub(*sent.get(id)?) as f64 / 1e6)).collect::<Vec<_>>(),
    );
    if collected.is_err() {
        bail!("{} of {runs} assignment frames read within 120 s", frames.len());
    }
    Ok(())
}
