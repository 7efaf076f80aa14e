//! Server capacity: a load generator holding thousands of standby
//! connections that speak the contract, against `standby-server serve
//! --provider spool` (the server mints a standby credential per sandbox
//! and writes it to a file instead of launching an agent).
//!
//! Each connection upgrades `/ws` with its standby credential, sends a
//! `ready` heartbeat at once and then every heartbeat interval. Once all
//! are connected and a heartbeat round has passed, the server's memory
//! and idle CPU are read from `/proc`; then runs are submitted one at a
//! time and the dispatch latency is taken from just before `POST /v1/runs`
//! to the moment the chosen connection reads the assignment frame (one
//! process, one monotonic clock). The chosen connection then does what an
//! agent does: connects with the run credential, awaits the replay,
//! reports `started` and `exited`, so the server retires the sandbox and
//! tops the pool up with a new credential, which the generator connects.

use std::collections::HashSet;
use std::ffi::OsString;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use futures::{SinkExt as _, StreamExt as _};
use serde::Serialize;
use serde_json::json;
use standby_protocol::{AgentMessage, AgentState, Assignment, ServerMessage};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::procfs::{self, ProcSample};
use crate::server::{ServerProc, http_client};
use crate::stats::{Summary, summarize};

#[derive(Debug, Clone)]
pub struct CapacityOptions {
    pub levels: Vec<usize>,
    pub dispatches: usize,
    pub heartbeat: Duration,
    /// How long server CPU is measured while only heartbeats flow.
    pub cpu_window: Duration,
    /// Dispatching stops after this long, with the runs measured so far.
    pub dispatch_budget: Duration,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Level {
    pub connections: usize,
    /// Why this level could not be measured to the end (what was measured
    /// before is kept).
    pub error: Option<String>,
    pub connect_s: f64,
    pub connect_failures: usize,
    /// Connections the server closed or dropped before the end.
    pub lost: usize,
    /// Server RSS with every credential minted, before any connection.
    pub rss_minted_kib: u64,
    pub rss_connected_kib: Option<Summary>,
    pub rss_anon_minted_kib: u64,
    pub rss_anon_connected_kib: Option<Summary>,
    /// `(median RSS connected - RSS minted) / connections`.
    pub kib_per_connection: f64,
    /// `(median RSS connected - RSS of an empty server) / connections`: the
    /// connection plus the sandbox and credential records behind it.
    pub kib_per_standby: f64,
    pub server_threads: u64,
    pub idle_window_s: f64,
    pub idle_cpu_percent_of_core: f64,
    pub heartbeats_per_s: f64,
    pub dispatch_ms: Option<Summary>,
    pub dispatches: usize,
    pub rss_after_dispatch_kib: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CapacityResults {
    pub heartbeat_s: f64,
    pub rss_empty_kib: u64,
    pub rss_anon_empty_kib: u64,
    pub levels: Vec<Level>,
}

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// What every connection task shares.
pub struct Shared {
    ws_url: String,
    base_url: String,
    heartbeat: Duration,
    http: reqwest::Client,
    handshakes: Semaphore,
    connected: AtomicUsize,
    failed: AtomicUsize,
    lost: AtomicUsize,
    assignments: mpsc::UnboundedSender<(String, Instant)>,
}

impl Shared {
    /// For standbys of `server`, each reporting the assignment frame it
    /// reads (the run id and when) on `assignments`.
    pub fn new(
        server: &ServerProc,
        heartbeat: Duration,
        assignments: mpsc::UnboundedSender<(String, Instant)>,
    ) -> Result<Self> {
        Self::for_url(&server.url, heartbeat, assignments)
    }

    /// For standbys of the server at `url` (its `http://` base).
    pub fn for_url(
        url: &str,
        heartbeat: Duration,
        assignments: mpsc::UnboundedSender<(String, Instant)>,
    ) -> Result<Self> {
        Ok(Self {
            ws_url: format!("{}{}", url.replacen("http", "ws", 1), standby_protocol::SOCKET_PATH),
            base_url: url.to_owned(),
            heartbeat,
            http: http_client()?,
            handshakes: Semaphore::new(64),
            connected: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            lost: AtomicUsize::new(0),
            assignments,
        })
    }

    /// Standbys connected and not yet assigned.
    pub fn connected(&self) -> usize {
        self.connected.load(Ordering::Relaxed)
    }

    /// Standbys whose upgrade failed.
    pub fn failed(&self) -> usize {
        self.failed.load(Ordering::Relaxed)
    }

    /// Standbys the server closed before an assignment.
    pub fn lost(&self) -> usize {
        self.lost.load(Ordering::Relaxed)
    }
}

/// Small buffers, as the agent itself would use: ten thousand sockets in
/// one process.
fn socket_config() -> WebSocketConfig {
    WebSocketConfig::default().read_buffer_size(4096).write_buffer_size(0).max_message_size(Some(1 << 20))
}

async fn connect(shared: &Shared, credential: &str) -> Result<Socket> {
    let mut request = shared.ws_url.as_str().into_client_request().context("building the upgrade request")?;
    let headers = request.headers_mut();
    headers.insert("Authorization", format!("Bearer {credential}").parse().context("the credential header")?);
    headers.insert(standby_protocol::PROTOCOL_HEADER, standby_protocol::PROTOCOL_VERSION.parse()?);
    let mut delay = Duration::from_millis(100);
    let mut attempt = 0;
    loop {
        attempt += 1;
        match tokio_tungstenite::connect_async_with_config(request.clone(), Some(socket_config()), false).await {
            Ok((socket, _)) => return Ok(socket),
            Err(error) if attempt >= 20 => return Err(anyhow!("upgrading {}: {error}", shared.ws_url)),
            Err(_) => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

fn heartbeat(state: AgentState, execution_id: Option<&str>) -> Message {
    Message::text(AgentMessage::Heartbeat { state, execution_id: execution_id.map(str::to_owned) }.encode())
}

/// One standby: connect, heartbeat until an assignment (then act the run
/// out) or until the server ends the connection.
pub async fn standby(shared: Arc<Shared>, credential: String) {
    let socket = {
        let Ok(_permit) = shared.handshakes.acquire().await else { return };
        match connect(&shared, &credential).await {
            Ok(socket) => socket,
            Err(_) => {
                shared.failed.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    };
    shared.connected.fetch_add(1, Ordering::Relaxed);
    let (mut write, mut read) = socket.split();
    let mut alive = write.send(heartbeat(AgentState::Ready, None)).await.is_ok();
    let start = tokio::time::Instant::now() + shared.heartbeat;
    let mut ticker = tokio::time::interval_at(start, shared.heartbeat);
    let mut assigned = None;
    while alive {
        tokio::select! {
            _ = ticker.tick() => alive = write.send(heartbeat(AgentState::Ready, None)).await.is_ok(),
            frame = read.next() => match frame {
                Some(Ok(Message::Text(text))) => {
                    if let Ok(ServerMessage::Assignment(assignment)) = ServerMessage::decode(text.as_str()) {
                        let _ = shared.assignments.send((assignment.execution_id.clone(), Instant::now()));
                        assigned = Some(assignment);
                        break;
                    }
                }
                Some(Ok(Message::Close(_)) | Err(_)) | None => alive = false,
                Some(Ok(_)) => {}
            },
        }
    }
    shared.connected.fetch_sub(1, Ordering::Relaxed);
    match assigned {
        Some(assignment) => {
            let _ = write.send(Message::Close(None)).await;
            if let Err(error) = act_out(&shared, &assignment).await {
                let _ = writeln!(
                    std::io::stderr(),
                    "  the run {} could not be acted out: {error:#}",
                    assignment.execution_id
                );
            }
        }
        None => {
            shared.lost.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What an agent does with an assignment, minus the work: confirm delivery
/// on the run credential, then report `started` and `exited`.
async fn act_out(shared: &Shared, assignment: &Assignment) -> Result<()> {
    let credential = assignment.run_credential.expose();
    let id = &assignment.execution_id;
    let socket = connect(shared, credential).await?;
    let (mut write, mut read) = socket.split();
    write.send(heartbeat(AgentState::Confirming, Some(id))).await?;
    let replay = async {
        while let Some(frame) = read.next().await {
            if let Message::Text(text) = frame?
                && matches!(ServerMessage::decode(text.as_str()), Ok(ServerMessage::Assignment(a)) if &a.execution_id == id)
            {
                return Ok(());
            }
        }
        Err(anyhow!("the run connection closed before the replay"))
    };
    tokio::time::timeout(Duration::from_secs(30), replay).await.map_err(|_| anyhow!("no replay within 30 s"))??;
    for (kind, event) in [("started", json!({"type": "started"})), ("exited", json!({"type": "exited", "code": 0}))] {
        let mut body = event;
        body["event_id"] = json!(format!("{id}-{kind}-bench"));
        let response = shared
            .http
            .post(format!("{}{}", shared.base_url, standby_protocol::paths::events(id)))
            .bearer_auth(credential)
            .header(standby_protocol::PROTOCOL_HEADER, standby_protocol::PROTOCOL_VERSION)
            .json(&body)
            .send()
            .await?;
        if !response.status().is_success() {
            bail!("the {kind} event was answered {}", response.status());
        }
    }
    let _ = write.send(Message::Close(None)).await;
    Ok(())
}

/// Connects every credential in the spool not connected before.
pub fn connect_new(shared: &Arc<Shared>, spool: &Path, seen: &mut HashSet<PathBuf>, tasks: &mut JoinSet<()>) -> usize {
    let mut added = 0;
    for entry in std::fs::read_dir(spool).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|ext| ext != "token") || seen.contains(&path) {
            continue;
        }
        if let Ok(credential) = std::fs::read_to_string(&path) {
            seen.insert(path);
            tasks.spawn(standby(Arc::clone(shared), credential.trim().to_owned()));
            added += 1;
        }
    }
    added
}

pub fn progress(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

pub fn spool_args(pool: usize, heartbeat: Duration, spool: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = Vec::new();
    for (flag, value) in [
        ("--provider", OsString::from("spool")),
        ("--spool-dir", spool.as_os_str().to_owned()),
        ("--pool-size", pool.to_string().into()),
        ("--heartbeat-interval", format!("{}s", heartbeat.as_secs()).into()),
        ("--launch-timeout", "1h".into()),
        // Every standby is held for the whole test: no cap on sandboxes
        // costing compute, no replacement by age.
        ("--running-cap", "0".into()),
        ("--standby-ttl", "0s".into()),
        ("--linger", "1s".into()),
        ("--max-attempts", "1".into()),
    ] {
        args.push(flag.into());
        args.push(value);
    }
    args
}

pub async fn wait_for(what: &str, timeout: Duration, mut done: impl AsyncFnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !done().await? {
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

pub async fn run(options: &CapacityOptions, server_bin: &Path, work: &Path) -> Result<CapacityResults> {
    // The reference point: a server with no sandbox at all.
    let dir = work.join("capacity-empty");
    let empty =
        ServerProc::start("capacity-empty", server_bin, &dir, &spool_args(0, options.heartbeat, &dir.join("spool")))
            .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let empty_sample = procfs::sample(empty.pid)?;
    empty.stop(Duration::from_secs(30)).await?;
    let mut levels = Vec::new();
    for &connections in &options.levels {
        levels.push(level(options, server_bin, work, connections, &empty_sample).await?);
    }
    Ok(CapacityResults {
        heartbeat_s: options.heartbeat.as_secs_f64(),
        rss_empty_kib: empty_sample.rss_kib,
        rss_anon_empty_kib: empty_sample.rss_anon_kib,
        levels,
    })
}

async fn level(
    options: &CapacityOptions,
    server_bin: &Path,
    work: &Path,
    connections: usize,
    empty: &ProcSample,
) -> Result<Level> {
    let dir = work.join(format!("capacity-{connections}"));
    let spool = dir.join("spool");
    let name = format!("capacity-{connections}");
    let server =
        ServerProc::start(&name, server_bin, &dir, &spool_args(connections, options.heartbeat, &spool)).await?;
    let (sender, receiver) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared::new(&server, options.heartbeat, sender)?);
    let mut tasks = JoinSet::new();
    let mut level = Level { connections, ..Level::default() };
    let result = drive(options, &server, &shared, &spool, empty, receiver, &mut tasks, &mut level).await;
    let stopped = server.stop(Duration::from_secs(60)).await;
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    if let Err(error) = result {
        // A level the server cannot hold is a result, not the end of the
        // benchmark: the next level and the report still run.
        progress(&format!("  {connections} standbys: not measured to the end: {error:#}"));
        level.error = Some(format!("{error:#}"));
    }
    stopped?;
    Ok(level)
}

/// Measures one level into `level`, phase by phase.
#[allow(clippy::too_many_arguments)]
async fn drive(
    options: &CapacityOptions,
    server: &ServerProc,
    shared: &Arc<Shared>,
    spool: &Path,
    empty: &ProcSample,
    mut assignments: mpsc::UnboundedReceiver<(String, Instant)>,
    tasks: &mut JoinSet<()>,
    level: &mut Level,
) -> Result<()> {
    let connections = level.connections;
    progress(&format!("  {connections} standbys: minting credentials"));
    wait_for("the spooled credentials", Duration::from_secs(600), async || {
        Ok(procfs::count_entries(spool, ".token") >= connections)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let minted = procfs::sample(server.pid)?;
    level.rss_minted_kib = minted.rss_kib;
    level.rss_anon_minted_kib = minted.rss_anon_kib;

    progress(&format!("  {connections} standbys: connecting"));
    let connecting = Instant::now();
    let mut seen = HashSet::new();
    connect_new(shared, spool, &mut seen, tasks);
    let mut registered = 0;
    wait_for("every standby to connect", Duration::from_secs(300), async || {
        let settled = shared.connected.load(Ordering::Relaxed) + shared.failed.load(Ordering::Relaxed);
        registered = server.metric("standby_connected_standbys").await? as usize;
        Ok(settled >= connections && registered >= shared.connected.load(Ordering::Relaxed))
    })
    .await
    .with_context(|| {
        format!(
            "{} of {connections} upgraded, {registered} registered by the server",
            shared.connected.load(Ordering::Relaxed)
        )
    })?;
    level.connect_s = connecting.elapsed().as_secs_f64();
    let failures = shared.failed.load(Ordering::Relaxed);
    level.connect_failures = failures;
    if failures > 0 {
        bail!("{failures} of {connections} standbys could not connect:\n{}", server.log_tail(20));
    }

    // One whole heartbeat round, so every connection has settled.
    tokio::time::sleep(options.heartbeat + Duration::from_secs(2)).await;
    progress(&format!("  {connections} standbys: idle for {:?}", options.cpu_window));
    let window_start = Instant::now();
    let first = procfs::sample(server.pid)?;
    let mut readings = vec![first];
    while window_start.elapsed() < options.cpu_window {
        tokio::time::sleep(Duration::from_secs(1)).await;
        readings.push(procfs::sample(server.pid)?);
    }
    let window = window_start.elapsed().as_secs_f64();
    let last = *readings.last().unwrap_or(&first);
    let ticks = procfs::clock_ticks() as f64;
    let cpu_ms = (last.cpu_ticks.saturating_sub(first.cpu_ticks) as f64 * 1000.0 / ticks)
        .max(last.cpu_ns.saturating_sub(first.cpu_ns) as f64 / 1e6);
    let rss = summarize(&readings.iter().map(|r| r.rss_kib as f64).collect::<Vec<_>>());
    let rss_median = rss.map_or(0.0, |s| s.median);
    level.rss_connected_kib = rss;
    level.rss_anon_connected_kib = summarize(&readings.iter().map(|r| r.rss_anon_kib as f64).collect::<Vec<_>>());
    level.kib_per_connection = (rss_median - minted.rss_kib as f64) / connections as f64;
    level.kib_per_standby = (rss_median - empty.rss_kib as f64) / connections as f64;
    level.server_threads = last.threads;
    level.idle_window_s = window;
    level.idle_cpu_percent_of_core = cpu_ms / (window * 1000.0) * 100.0;
    level.heartbeats_per_s = connections as f64 / options.heartbeat.as_secs_f64();
    level.lost = shared.lost.load(Ordering::Relaxed);

    progress(&format!("  {connections} standbys: {} dispatches", options.dispatches));
    let mut latencies = Vec::new();
    let budget = Instant::now() + options.dispatch_budget;
    for _ in 0..options.dispatches {
        if Instant::now() > budget {
            level.error = Some(format!(
                "dispatching stopped after {} of {} runs: the {:?} budget ran out",
                latencies.len(),
                options.dispatches,
                options.dispatch_budget
            ));
            break;
        }
        let submitted = Instant::now();
        let run = server.submit(&json!({"command": ["true"]})).await?;
        let id = run["id"].as_str().ok_or_else(|| anyhow!("no run id in {run}"))?.to_owned();
        let received = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some((execution_id, at)) = assignments.recv().await {
                if execution_id == id {
                    return Some(at);
                }
            }
            None
        })
        .await
        .map_err(|_| anyhow!("run {id}: no assignment frame within 60 s"))?
        .ok_or_else(|| anyhow!("the load generator stopped"))?;
        latencies.push(received.duration_since(submitted).as_secs_f64() * 1000.0);
        level.dispatch_ms = summarize(&latencies);
        level.dispatches = latencies.len();
        server.wait_run(&id, Duration::from_secs(60)).await?;
        // The pool was topped up with a new credential: connect it, so the
        // server keeps holding as many standbys.
        wait_for("the replacement credential", Duration::from_secs(30), async || {
            Ok(connect_new(shared, spool, &mut seen, tasks) > 0)
        })
        .await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    level.rss_after_dispatch_kib = procfs::sample(server.pid)?.rss_kib;
    Ok(())
}
