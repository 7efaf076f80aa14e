//! Server capacity: a load generator holding thousands of standby
//! connections that speak the contract, against `standby-server serve
//! --provider spool` (the server mints a standby credential per sandbox
//! and writes it to a file instead of launching an agent).
//!
//! Each connection ([`standby`]) upgrades `/ws` with its standby
//! credential, sends a `ready` heartbeat at once and then every heartbeat
//! interval. When assigned a run it does what an agent does: connects with
//! the run credential, awaits the replay, reports `started` and `exited`,
//! so the server retires the sandbox and tops the pool up with a new
//! credential, which the generator connects.
//!
//! The plain capacity test ([`run`]) is the spread one
//! ([`crate::spread_capacity`]) over a single replica on SQLite, reported
//! per server against an empty one.

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
use crate::spread_capacity::{self, SpreadLevel, SpreadOptions};
use crate::stats::Summary;

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

/// The plain capacity test is the spread one with one replica on SQLite,
/// one load-generator process (as few as hold the connections) and no
/// burst, with an empty server measured first as the reference point.
pub async fn run(options: &CapacityOptions, server_bin: &Path, work: &Path) -> Result<CapacityResults> {
    let dir = work.join("capacity-empty");
    let empty =
        ServerProc::start("capacity-empty", server_bin, &dir, &spool_args(0, options.heartbeat, &dir.join("spool")))
            .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let empty_sample = procfs::sample(empty.pid)?;
    empty.stop(Duration::from_secs(30)).await?;
    let spread = SpreadOptions {
        levels: options.levels.clone(),
        replicas: 1,
        workers: None,
        store: None,
        dispatches: options.dispatches,
        burst_runs: 0,
        burst_concurrency: 1,
        heartbeat: options.heartbeat,
        cpu_window: options.cpu_window,
        dispatch_budget: options.dispatch_budget,
    };
    let measured = spread_capacity::run(&spread, server_bin, work).await?;
    Ok(CapacityResults {
        heartbeat_s: options.heartbeat.as_secs_f64(),
        rss_empty_kib: empty_sample.rss_kib,
        rss_anon_empty_kib: empty_sample.rss_anon_kib,
        levels: measured.levels.into_iter().map(|level| Level::of(level, &empty_sample, options.heartbeat)).collect(),
    })
}

impl Level {
    /// The one server's figures of a spread level, with those relative to
    /// the empty server.
    fn of(spread: SpreadLevel, empty: &ProcSample, heartbeat: Duration) -> Self {
        let mut level = Self {
            connections: spread.connections,
            error: spread.error,
            connect_s: spread.connect_s,
            connect_failures: spread.connect_failures,
            lost: spread.lost,
            dispatch_ms: spread.dispatch_ms,
            dispatches: spread.dispatches,
            ..Self::default()
        };
        // A level that ended before its idle window has no server figures.
        if let Some(server) = spread.servers.into_iter().next() {
            let connections = level.connections as f64;
            let rss_median = server.rss_connected_kib.map_or(0.0, |s| s.median);
            level.rss_minted_kib = server.rss_minted_kib;
            level.rss_connected_kib = server.rss_connected_kib;
            level.rss_anon_minted_kib = server.rss_anon_minted_kib;
            level.rss_anon_connected_kib = server.rss_anon_connected_kib;
            level.kib_per_connection = server.kib_per_connection;
            level.kib_per_standby = (rss_median - empty.rss_kib as f64) / connections;
            level.server_threads = server.threads;
            level.idle_window_s = spread.idle_window_s;
            level.idle_cpu_percent_of_core = server.idle_cpu_percent_of_core;
            level.heartbeats_per_s = connections / heartbeat.as_secs_f64();
            level.rss_after_dispatch_kib = server.rss_after_dispatch_kib;
        }
        level
    }
}
