//! Reliability under faults, end to end: the real `standby-server` with
//! its local provider launching real `standby` agents, every agent talking
//! to the server through a [`FaultProxy`].
//!
//! - **Soak**: eight standbys, runs submitted over time, random network
//!   faults at every phase of a run (waiting, assignment in flight,
//!   confirmation, install, run, event reporting), agents SIGKILLed at
//!   random points, a few runs cancelled, every connection cut once, and
//!   the server SIGKILLed and restarted twice on the same store. At the end:
//!   every run reached exactly one terminal state; no run's command executed
//!   twice (each run appends one line to a marker file); no sandbox ran two
//!   runs; every requeued attempt's run credential was revoked (read from
//!   the store) and never started anything; every finished run's log is
//!   complete and in order; nothing the server started is left running.
//!   CI-sized by default; `STANDBY_SOAK=long` runs a longer one.
//! - **Reconnect storm**: 1,000 standby connections (a generator using the
//!   agent's own backoff policy against `--provider spool`) cut at once;
//!   the reconnects must spread (the busiest 100 ms window holds less than
//!   half of them).
//! - **At most once at the worst moment**: an agent killed after it started
//!   the run and before the server heard `started` (held on the way); the
//!   command must not execute again elsewhere.
//!
//! Every random choice comes from one printed seed: `STANDBY_SOAK_SEED`
//! (`STANDBY_STORM_SEED`) replays it. Needs `cargo build --bins`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::{SinkExt, StreamExt};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use standby_agent::control::{BACKOFF_CAP, BACKOFF_MIN, STABLE_AFTER};
use standby_e2e::harness::{describe, write_json};
use standby_e2e::proxy::{
    ConnId, ConnInfo, Direction, Fault, FaultPolicy, FaultProxy, RandomFaults, Rng, seed_from_env,
};
use standby_e2e::server_process::{API_KEY, ServerBuilder, ServerProcess, marked, tail};
use standby_protocol::{AgentMessage, AgentState, PROTOCOL_HEADER, PROTOCOL_VERSION, SOCKET_PATH};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::{self, Message, client::IntoClientRequest};

mod soak_shared;
use soak_shared::{
    Current, Journal, SeedGuard, TERMINAL, check_credentials, check_runs, current, lock, maybe_cancel, outcomes,
    settle, sqlite_credentials, watcher,
};

// ---- the soak's size ---------------------------------------------------------

#[derive(Debug, Clone)]
struct Profile {
    runs: usize,
    /// Runs are submitted over about this long.
    submit_over: Duration,
    restarts: usize,
    kills: usize,
    /// Agents killed the moment their run's command starts (seen in the
    /// marker file), before the server may have heard `started`.
    start_kills: usize,
    cancel_probability: f64,
    /// Bound on waiting for every run to end after the last submission.
    settle: Duration,
    /// Lines each run prints (its log must hold all of them, in order).
    lines: usize,
}

impl Profile {
    /// CI-sized (under a minute), or `STANDBY_SOAK=long`: about 11 minutes,
    /// past nextest's bound in `.config/nextest.toml`, so run it with
    /// `STANDBY_SOAK=long cargo test -p standby-e2e --test soak soak_with -- --nocapture`.
    fn from_env() -> Self {
        match std::env::var("STANDBY_SOAK").as_deref() {
            Ok("long") => Self {
                runs: 1000,
                submit_over: Duration::from_secs(600),
                restarts: 6,
                kills: 80,
                start_kills: 20,
                cancel_probability: 0.05,
                settle: Duration::from_secs(300),
                lines: 40,
            },
            _ => Self {
                runs: 200,
                submit_over: Duration::from_secs(40),
                restarts: 2,
                kills: 16,
                start_kills: 4,
                cancel_probability: 0.04,
                settle: Duration::from_secs(40),
                lines: 12,
            },
        }
    }
}

// ---- faults by phase -------------------------------------------------------------

/// The phases of a run as the proxy can tell them from the bytes.
const PHASES: [&str; 6] = ["waiting", "assignment", "confirmation", "install", "run", "events"];

/// Random faults, with a probability per chunk that depends on the phase
/// of the connection it travels on (read from its first request and the
/// frames: the upgrade's credential kind, assignment frames, the agent's
/// heartbeat state, the HTTP path).
struct PhaseFaults {
    rng: Rng,
    faults: RandomFaults,
    /// Probability per chunk, in the order of [`PHASES`].
    probability: [f64; 6],
    /// The path of the request in flight on each HTTP connection.
    requests: HashMap<ConnId, String>,
    counts: Arc<Mutex<BTreeMap<(&'static str, &'static str), u64>>>,
}

impl PhaseFaults {
    fn new(seed: u64, counts: Arc<Mutex<BTreeMap<(&'static str, &'static str), u64>>>) -> Self {
        let mut rng = Rng::new(seed);
        let faults = RandomFaults::new(rng.next_u64(), 0.0).weights(4, 3, 3, 1);
        Self { rng, faults, probability: [0.004, 0.12, 0.03, 0.012, 0.012, 0.02], requests: HashMap::new(), counts }
    }

    fn phase(&mut self, conn: &ConnInfo, direction: Direction, data: &[u8]) -> Option<usize> {
        let head = String::from_utf8_lossy(&conn.head);
        let first_path = head.split_whitespace().nth(1).unwrap_or_default();
        let index = |name: &str| PHASES.iter().position(|phase| *phase == name);
        if first_path.ends_with(SOCKET_PATH) {
            let run = head.contains("Bearer run_");
            let text = match direction {
                Direction::ToClient => String::from_utf8_lossy(data).into_owned(),
                Direction::ToServer => client_text(data).unwrap_or_default(),
            };
            let phase = if text.contains("\"assignment\"") {
                if run { "confirmation" } else { "assignment" }
            } else if text.contains("\"running\"") {
                "run"
            } else if text.contains("\"finishing\"") {
                "events"
            } else if run {
                "confirmation"
            } else {
                "waiting"
            };
            return index(phase);
        }
        if direction == Direction::ToServer
            && let Some(path) = request_path(data)
        {
            self.requests.insert(conn.id, path.to_owned());
        }
        let path = self.requests.get(&conn.id).map_or(first_path, String::as_str);
        if !path.starts_with("/v1/executions/") {
            // The spec fetch: preparation, while waiting.
            return index("waiting");
        }
        let phase = match path.rsplit('/').next().unwrap_or_default() {
            "log" => "run",
            "events" => "events",
            _ => "install",
        };
        index(phase)
    }
}

impl FaultPolicy for PhaseFaults {
    fn on_data(&mut self, conn: &ConnInfo, direction: Direction, data: &[u8]) -> Option<Fault> {
        let phase = self.phase(conn, direction, data)?;
        if !self.rng.chance(self.probability[phase]) {
            return None;
        }
        let fault = self.faults.pick();
        *lock(&self.counts).entry((PHASES[phase], fault.kind())).or_default() += 1;
        Some(fault)
    }
}

/// The path of an HTTP request starting at the beginning of `data`.
fn request_path(data: &[u8]) -> Option<&str> {
    let line = data.split(|b| *b == b'\r').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split(' ');
    let method = parts.next()?;
    if !["GET", "POST", "PUT", "DELETE"].contains(&method) {
        return None;
    }
    parts.next()
}

/// The text of a masked WebSocket text frame at the start of `data` (the
/// client's frames are masked, so their JSON is not visible as is).
fn client_text(data: &[u8]) -> Option<String> {
    let (&first, rest) = data.split_first()?;
    let (&second, rest) = rest.split_first()?;
    if first & 0x0f != 1 || second & 0x80 == 0 {
        return None;
    }
    let (len, rest) = match second & 0x7f {
        126 => {
            let (len, rest) = rest.split_at_checked(2)?;
            (usize::from(u16::from_be_bytes([len[0], len[1]])), rest)
        }
        127 => return None,
        len => (usize::from(len), rest),
    };
    let (key, payload) = rest.split_at_checked(4)?;
    let payload = &payload[..len.min(payload.len())];
    let clear: Vec<u8> = payload.iter().enumerate().map(|(i, byte)| byte ^ key[i % 4]).collect();
    Some(String::from_utf8_lossy(&clear).into_owned())
}

// ---- the soak -------------------------------------------------------------------------

fn run_command(marker: &Path, lines: usize) -> Vec<String> {
    let half = lines / 2;
    let script = format!(
        "echo \"$SOAK_RUN $STANDBY_EXECUTION_ID $(pwd)\" >> '{marker}'; i=1; while [ $i -le {lines} ]; do \
         echo \"soak $SOAK_RUN line $i\"; if [ $i -eq {half} ]; then sleep 0.2; fi; i=$((i+1)); done",
        marker = marker.display()
    );
    vec!["/bin/sh".into(), "-c".into(), script]
}

/// Kills agents at random points: a standby waiting, a sandbox whose run
/// is committed, confirmed (installing) or running.
async fn killer(server: Current, journal: Arc<Mutex<Journal>>, mut rng: Rng, budget: usize, stop: Arc<AtomicBool>) {
    const CATEGORIES: [&str; 4] = ["waiting", "committed", "confirmed", "running"];
    let mut killed = 0;
    while killed < budget && !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(rng.duration(Duration::from_millis(300), Duration::from_millis(2500))).await;
        let Some(server) = current(&server) else { continue };
        let category = CATEGORIES[rng.below(CATEGORIES.len() as u64) as usize];
        let (Some((200, sandboxes)), Some((200, runs))) = (
            server.try_call(reqwest::Method::GET, "/v1/sandboxes", Some(API_KEY), None).await,
            server.try_call(reqwest::Method::GET, "/v1/runs", Some(API_KEY), None).await,
        ) else {
            continue;
        };
        let run_states: HashMap<&str, &str> = runs["runs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|run| Some((run["id"].as_str()?, run["state"].as_str()?)))
            .collect();
        let targets: Vec<i32> = sandboxes["sandboxes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|sandbox| match category {
                "waiting" => sandbox["state"] == "standby" && sandbox["last_state"] == "ready",
                state => {
                    sandbox["state"] == "assigned"
                        && sandbox["run_id"].as_str().and_then(|id| run_states.get(id)) == Some(&state)
                }
            })
            .filter_map(|sandbox| sandbox["pid"].as_i64().and_then(|pid| i32::try_from(pid).ok()))
            .collect();
        if targets.is_empty() {
            continue;
        }
        let pid = targets[rng.below(targets.len() as u64) as usize];
        if kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
            killed += 1;
            *lock(&journal).faults.entry(category).or_default() += 1;
        }
    }
}

/// Kills the agent of a run the moment its command starts (its marker
/// line appears), with probability one in `one_in`, up to `budget` times.
async fn start_killer(
    server: Current,
    journal: Arc<Mutex<Journal>>,
    marker: std::path::PathBuf,
    mut rng: Rng,
    (budget, one_in): (usize, u64),
    stop: Arc<AtomicBool>,
) {
    let (mut seen, mut killed) = (0, 0);
    while killed < budget && !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let text = std::fs::read_to_string(&marker).unwrap_or_default();
        let fresh: Vec<String> = text.lines().skip(seen).map(str::to_owned).collect();
        seen += fresh.len();
        for line in fresh {
            // `<label> <run id> <sandboxes>/<sandbox id>/workspace`
            let sandbox_id = line.rsplit('/').nth(1).unwrap_or_default().to_owned();
            if killed >= budget || rng.below(one_in) != 0 {
                continue;
            }
            let Some(server) = current(&server) else { continue };
            let Some((200, sandboxes)) =
                server.try_call(reqwest::Method::GET, "/v1/sandboxes", Some(API_KEY), None).await
            else {
                continue;
            };
            let pid = sandboxes["sandboxes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|sandbox| sandbox["id"] == sandbox_id.as_str())
                .and_then(|sandbox| sandbox["pid"].as_i64())
                .and_then(|pid| i32::try_from(pid).ok());
            if let Some(pid) = pid
                && kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok()
            {
                killed += 1;
                *lock(&journal).faults.entry("starting").or_default() += 1;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_faults_kills_and_restarts_loses_nothing_and_runs_nothing_twice() {
    let seed = seed_from_env("STANDBY_SOAK_SEED");
    let _guard = SeedGuard { var: "STANDBY_SOAK_SEED", seed };
    let profile = Profile::from_env();
    let mut rng = Rng::new(seed);
    let dir = tempfile::Builder::new().prefix("standby-soak-").tempdir().expect("a temp dir");
    let marker = dir.path().join("marker");
    let spec = dir.path().join("spec.json");
    write_json(&spec, &json!({"workspace": {}, "shell": ["/bin/sh"]}));
    let data = dir.path().join("data");
    let mark = format!("soak-{seed:016x}");
    let agent_logs = dir.path().join("agents");

    // The proxy's target is set once the server listens.
    let proxy = FaultProxy::start(standby_e2e::server_process::free_addr()).await;
    let builder = ServerBuilder::new(&data, &dir.path().join("server.log"), &mark)
        .keep_agent_logs(&agent_logs)
        .arg("--spec")
        .arg(&spec.display().to_string())
        .args(&["--public-url", &proxy.url(), "--pool-size", "8", "--running-cap", "16"])
        .args(&["--heartbeat-interval", "200ms", "--max-attempts", "6", "--launch-timeout", "20s"])
        .args(&["--linger", "2s", "--stop-grace", "2s", "--log", "info", "--agent-log", "info"]);
    let first = builder.start().await;
    proxy.set_target(first.addr());
    let server: Current = Arc::new(Mutex::new(Some(Arc::new(first))));
    let fault_counts = Arc::new(Mutex::new(BTreeMap::new()));
    proxy.set_policy(PhaseFaults::new(rng.next_u64(), Arc::clone(&fault_counts)));

    let journal = Arc::new(Mutex::new(Journal::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let killer =
        tokio::spawn(killer(Arc::clone(&server), Arc::clone(&journal), rng.fork(), profile.kills, Arc::clone(&stop)));
    let start_killer = tokio::spawn(start_killer(
        Arc::clone(&server),
        Arc::clone(&journal),
        marker.clone(),
        rng.fork(),
        (profile.start_kills, 10),
        Arc::clone(&stop),
    ));
    let watcher = tokio::spawn(watcher(Arc::clone(&server), Arc::clone(&journal), Arc::clone(&stop)));
    let mut cancels = tokio::task::JoinSet::new();

    let gap = profile.submit_over / profile.runs as u32;
    let restart_at: Vec<usize> = (1..=profile.restarts).map(|k| k * profile.runs / (profile.restarts + 1)).collect();
    let cut_at = profile.runs / 2 + profile.runs / (4 * (profile.restarts + 1));
    for label in 0..profile.runs {
        if restart_at.contains(&label) {
            let old = lock(&server).take().expect("a server");
            old.crash().await;
            drop(old);
            let next = builder.start().await;
            proxy.set_target(next.addr());
            *lock(&server) = Some(Arc::new(next));
            lock(&journal).restarts += 1;
        }
        if label == cut_at {
            proxy.cut_all();
            *lock(&journal).faults.entry("cut-all").or_default() += 1;
        }
        let body = json!({"command": run_command(&marker, profile.lines), "env": {"SOAK_RUN": label.to_string()}});
        let id = current(&server).expect("a server").submit(&body).await;
        lock(&journal).submitted.push((label, id.clone()));
        maybe_cancel(&mut cancels, &server, &journal, &mut rng, (profile.cancel_probability, id));
        tokio::time::sleep(rng.duration(gap / 2, gap * 3 / 2)).await;
    }
    while cancels.join_next().await.is_some() {}

    // Every run ends.
    let server_now = current(&server).expect("a server");
    let settled = settle(&server_now, &journal, profile.settle).await;
    stop.store(true, Ordering::Relaxed);
    let _ = killer.await;
    let _ = start_killer.await;
    let _ = watcher.await;
    proxy.clear_policy();

    // ---- invariants --------------------------------------------------------
    let journal = lock(&journal).clone();
    let markers = std::fs::read_to_string(&marker).unwrap_or_default();
    let mut verdict = check_runs(&server_now, &journal, &settled, &markers, profile.lines).await;
    drop(server_now);
    let final_server = lock(&server).take().expect("a server");
    let final_server = Arc::try_unwrap(final_server).expect("no other holder of the server");
    let status = final_server.stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status} on SIGTERM");
    let requeues = check_credentials(&mut verdict, &sqlite_credentials(&data.join("standby.db")));
    // No ghost: nothing the servers started is still running.
    if let Err(left) = ServerProcess::wait_no_marked(&mark, Duration::from_secs(30)).await {
        verdict.problems.push(format!("processes left running after the server stopped: {}", describe(&left)));
    }

    // ---- summary -----------------------------------------------------------
    let (by_state, attempts) = outcomes(&verdict);
    let faults = lock(&fault_counts).clone();
    eprintln!("soak: seed {seed}, {} runs submitted, {attempts} attempts, {requeues} requeues", verdict.runs.len());
    eprintln!("soak: runs by state/path: {by_state:?}");
    eprintln!("soak: proxy: {}", proxy.stats());
    eprintln!("soak: injected faults by (phase, kind): {faults:?}");
    eprintln!(
        "soak: agents SIGKILLed by point, and connections cut at once: {:?}; cancels: {}; server restarts (SIGKILL): {}",
        journal.faults, journal.cancels, journal.restarts
    );
    eprintln!("soak: marker lines: {}; invariant violations: {}", verdict.marker_lines, verdict.problems.len());
    assert!(
        verdict.problems.is_empty(),
        "{} invariant violations (seed {seed}):\n{}\n--- server log ---\n{}",
        verdict.problems.len(),
        verdict.problems.join("\n"),
        tail(&dir.path().join("server.log"), 40)
    );
}

// ---- the reconnect storm -------------------------------------------------------------

/// One connection per standby credential, reconnecting exactly as the
/// agent's control task does: on a drop, wait the next delay of the
/// agent's backoff (500 ms doubling to 30 s, jitter adding up to the delay
/// again, reset after a connection that stayed up `STABLE_AFTER`).
struct Storm {
    ws_url: String,
    /// When each connection's session began (index = connection).
    sessions: Mutex<Vec<Vec<Instant>>>,
    /// When each connection attempt began, all connections together.
    attempts: Mutex<Vec<Instant>>,
    /// When each reconnect was due by the backoff: the moment the failure
    /// was seen plus the delay drawn. The policy's own spread, whatever the
    /// generator's CPU (1,000 handshakes at once keep a debug build on two
    /// shared cores busy longer than the backoff's window, which bunches
    /// the attempts it starts late).
    due: Mutex<Vec<Instant>>,
    live: AtomicUsize,
    refused: AtomicUsize,
    stop: AtomicBool,
}

/// The storm's heartbeat interval (the server's and the generator's): long,
/// so that the test measures the reconnects rather than a steady heartbeat
/// load.
const STORM_HEARTBEAT: Duration = Duration::from_secs(120);

fn agent_backoff(seed: u64) -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(BACKOFF_MIN)
        .with_max_delay(BACKOFF_CAP)
        .with_jitter()
        .with_jitter_seed(seed)
        .without_max_times()
        .build()
}

async fn storm_connection(storm: Arc<Storm>, index: usize, token: String, seed: u64) {
    let mut delays = agent_backoff(seed);
    // `preparing`, not `ready`: the server's engine does O(sandboxes x
    // connections) work for each `ready` heartbeat of a standby
    // (`expire_standbys` calls `is_candidate` for every sandbox, which scans
    // every connection in `standby_conns`); at 1,000 standbys in a debug
    // build that alone takes it tens of seconds to digest one storm, which
    // is what this test would then measure.
    let heartbeat =
        Message::text(AgentMessage::Heartbeat { state: AgentState::Preparing, execution_id: None }.encode());
    while !storm.stop.load(Ordering::Relaxed) {
        lock(&storm.attempts).push(Instant::now());
        let mut request = storm.ws_url.as_str().into_client_request().expect("a request");
        request.headers_mut().insert("Authorization", format!("Bearer {token}").parse().expect("a header"));
        request.headers_mut().insert(PROTOCOL_HEADER, PROTOCOL_VERSION.parse().expect("a header"));
        let delay = match tokio_tungstenite::connect_async(request).await {
            Ok((socket, _)) => {
                let since = Instant::now();
                lock(&storm.sessions)[index].push(since);
                storm.live.fetch_add(1, Ordering::SeqCst);
                let (mut write, mut read) = socket.split();
                let mut ticker = tokio::time::interval(STORM_HEARTBEAT);
                loop {
                    tokio::select! {
                        _ = ticker.tick() => if write.send(heartbeat.clone()).await.is_err() { break },
                        frame = read.next() => match frame {
                            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break,
                            Some(Ok(_)) => {}
                        },
                    }
                }
                storm.live.fetch_sub(1, Ordering::SeqCst);
                if since.elapsed() >= STABLE_AFTER {
                    delays = agent_backoff(seed.wrapping_add(1));
                }
                delays.next().unwrap_or(BACKOFF_CAP)
            }
            Err(tungstenite::Error::Http(response)) if [401, 403, 410].contains(&response.status().as_u16()) => {
                storm.refused.fetch_add(1, Ordering::SeqCst);
                return;
            }
            Err(_) => delays.next().unwrap_or(BACKOFF_CAP),
        };
        lock(&storm.due).push(Instant::now() + delay);
        tokio::time::sleep(delay).await;
    }
}

/// The largest number of `times` within any window of `window`.
fn peak_in_window(times: &[Instant], window: Duration) -> usize {
    let mut sorted = times.to_vec();
    sorted.sort_unstable();
    let mut start = 0;
    let mut peak = 0;
    for end in 0..sorted.len() {
        while sorted[end] - sorted[start] >= window {
            start += 1;
        }
        peak = peak.max(end - start + 1);
    }
    peak
}

/// Raises the open-files limit to the hard limit when it is below `needed`
/// (with util-linux `prlimit`, as `setpriv` is used for the agents).
fn ensure_open_files(needed: u64) {
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let soft_hard = limits.lines().find(|line| line.starts_with("Max open files")).map(|line| {
        let numbers: Vec<u64> = line.split_whitespace().filter_map(|word| word.parse().ok()).collect();
        (numbers.first().copied().unwrap_or(0), numbers.get(1).copied().unwrap_or(0))
    });
    let Some((soft, hard)) = soft_hard else { return };
    if soft >= needed {
        return;
    }
    assert!(hard >= needed, "the open-files hard limit {hard} is below the {needed} this test needs");
    let status = std::process::Command::new("prlimit")
        .arg(format!("--pid={}", std::process::id()))
        .arg(format!("--nofile={hard}:{hard}"))
        .status();
    assert!(status.is_ok_and(|s| s.success()), "cannot raise the open-files limit from {soft} to {needed} (prlimit)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_storm_of_a_thousand_standbys_spreads_with_the_agents_backoff() {
    const CONNECTIONS: usize = 1000;
    let seed = seed_from_env("STANDBY_STORM_SEED");
    let _guard = SeedGuard { var: "STANDBY_STORM_SEED", seed };
    let mut rng = Rng::new(seed);
    // The generator and both sides of the proxy, plus some room.
    ensure_open_files(4 * CONNECTIONS as u64 + 512);
    let dir = tempfile::Builder::new().prefix("standby-storm-").tempdir().expect("a temp dir");
    let spool = dir.path().join("spool");
    let mark = format!("storm-{seed:016x}");
    let server = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark)
        .args(&["--provider", "spool", "--spool-dir", &spool.display().to_string()])
        .args(&["--pool-size", &CONNECTIONS.to_string(), "--running-cap", "0", "--heartbeat-interval", "120s"])
        .args(&["--launch-timeout", "1h", "--log", "warn"])
        .start()
        .await;
    let proxy = FaultProxy::start(server.addr()).await;
    let tokens: Vec<String> = server
        .until("the server to spool every standby credential", Duration::from_secs(60), async || {
            let tokens: Vec<String> = std::fs::read_dir(&spool)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|entry| entry.path().extension().is_some_and(|ext| ext == "token"))
                .filter_map(|entry| std::fs::read_to_string(entry.path()).ok())
                .map(|token| token.trim().to_owned())
                .collect();
            (tokens.len() >= CONNECTIONS).then_some(tokens)
        })
        .await;
    let storm = Arc::new(Storm {
        ws_url: format!("ws://{}{SOCKET_PATH}", proxy.addr()),
        sessions: Mutex::new(vec![Vec::new(); tokens.len()]),
        attempts: Mutex::new(Vec::new()),
        due: Mutex::new(Vec::new()),
        live: AtomicUsize::new(0),
        refused: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
    });
    let mut tasks = tokio::task::JoinSet::new();
    let connect_started = Instant::now();
    for (index, token) in tokens.into_iter().enumerate() {
        tasks.spawn(storm_connection(Arc::clone(&storm), index, token, rng.next_u64()));
    }
    server
        .until("every standby to connect", Duration::from_secs(90), async || {
            (storm.live.load(Ordering::SeqCst) >= CONNECTIONS).then_some(())
        })
        .await;

    eprintln!("storm: all {CONNECTIONS} connected after {:?}", connect_started.elapsed());
    let cut = Instant::now();
    assert_eq!(proxy.cut_all(), CONNECTIONS, "every standby connection goes through the proxy");
    let back = server
        .until("every standby to reconnect", Duration::from_secs(90), async || {
            let sessions = lock(&storm.sessions);
            let firsts: Vec<Instant> =
                sessions.iter().filter_map(|times| times.iter().copied().find(|at| *at >= cut)).collect();
            (firsts.len() >= CONNECTIONS).then_some(firsts)
        })
        .await;
    // Reconnects as the backoff schedules them, as the generator starts
    // them, and as the other end sees them (accepted by the proxy).
    let since_cut =
        |times: &Mutex<Vec<Instant>>| -> Vec<Instant> { lock(times).iter().copied().filter(|at| *at >= cut).collect() };
    let (due, attempts, accepted) = (since_cut(&storm.due), since_cut(&storm.attempts), proxy.accepted_since(cut));
    let window = Duration::from_millis(100);
    let peak = peak_in_window(&due, window);
    let recovered = back.iter().map(|at| *at - cut).max().unwrap_or_default();
    let first = due.iter().map(|at| *at - cut).min().unwrap_or_default();
    eprintln!(
        "storm: {CONNECTIONS} connections cut at once: {} reconnects due, the first {first:?} after the cut; \
         peak {peak} due in a 100 ms window ({:.1}% of {CONNECTIONS}); started: peak {}, accepted by the proxy: \
         peak {}; all back {recovered:?} after the cut; refused {}",
        due.len(),
        100.0 * peak as f64 / CONNECTIONS as f64,
        peak_in_window(&attempts, window),
        peak_in_window(&accepted, window),
        storm.refused.load(Ordering::SeqCst)
    );
    storm.stop.store(true, Ordering::SeqCst);
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    assert_eq!(storm.refused.load(Ordering::SeqCst), 0, "no standby credential was refused");
    assert!(
        peak * 2 < CONNECTIONS,
        "the reconnects were not spread: {peak} of {CONNECTIONS} in one 100 ms window (seed {seed})"
    );
    let status = server.stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status} on SIGTERM");
    assert!(marked(&mark).is_empty());
}

// ---- at most once, at the worst moment --------------------------------------------

/// Holds every `started` event on its way to the server (a stall that
/// never ends): the run is running, and the server does not know it.
struct HoldStarted;

impl FaultPolicy for HoldStarted {
    fn on_data(&mut self, _conn: &ConnInfo, direction: Direction, data: &[u8]) -> Option<Fault> {
        let started = data.windows(9).any(|window| window == b"\"started\"");
        (direction == Direction::ToServer && started).then_some(Fault::Stall(None))
    }
}

fn line_count(path: &Path) -> usize {
    std::fs::read_to_string(path).map(|text| text.lines().count()).unwrap_or(0)
}

/// The window the soak's random kills rarely hit: the agent dies after it
/// started the run and before the server heard `started` (the event is
/// posted concurrently with the spawn; here it is held on the way). The
/// server cannot tell this from a death before the start, so it must fail
/// the run: sending it to another sandbox would execute its command a
/// second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_agent_dies_after_starting_it_is_never_executed_again() {
    let dir = tempfile::Builder::new().prefix("standby-once-").tempdir().expect("a temp dir");
    let marker = dir.path().join("marker");
    let spec = dir.path().join("spec.json");
    write_json(&spec, &json!({"workspace": {}, "shell": ["/bin/sh"]}));
    let mark = format!("once-{}", std::process::id());
    let proxy = FaultProxy::start(standby_e2e::server_process::free_addr()).await;
    let server = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark)
        .keep_agent_logs(&dir.path().join("agents"))
        .arg("--spec")
        .arg(&spec.display().to_string())
        .args(&["--public-url", &proxy.url(), "--pool-size", "1", "--heartbeat-interval", "200ms"])
        .args(&["--linger", "2s", "--stop-grace", "2s"])
        .start()
        .await;
    proxy.set_target(server.addr());
    proxy.set_policy(HoldStarted);
    server
        .until("a ready standby", Duration::from_secs(60), async || {
            server.sandboxes().await.iter().any(|sandbox| sandbox["candidate"] == true).then_some(())
        })
        .await;
    let script = format!("echo \"$STANDBY_EXECUTION_ID $(pwd)\" >> '{}'; sleep 30", marker.display());
    let id = server.submit(&json!({"command": ["/bin/sh", "-c", script]})).await;
    server
        .until("the run's command to start", Duration::from_secs(60), async || (line_count(&marker) >= 1).then_some(()))
        .await;
    let run = server.run(&id).await;
    assert_eq!(run["state"], "confirmed", "the server has not heard `started`: {run}");
    let sandbox_id = run["attempts"][0]["sandbox_id"].as_str().expect("a sandbox").to_owned();
    let sandbox = server.sandboxes().await.into_iter().find(|s| s["id"] == sandbox_id.as_str()).expect("the sandbox");
    let pid = sandbox["pid"].as_i64().and_then(|pid| i32::try_from(pid).ok()).expect("the agent's pid");
    kill(Pid::from_raw(pid), Signal::SIGKILL).expect("kill the agent");
    let run = server
        .until("the run to end or to run again", Duration::from_secs(60), async || {
            let run = server.run(&id).await;
            (TERMINAL.iter().any(|t| run["state"] == *t) || line_count(&marker) > 1).then_some(run)
        })
        .await;
    let executions = line_count(&marker);
    let markers = std::fs::read_to_string(&marker).unwrap_or_default();
    let status = server.stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status} on SIGTERM");
    assert_eq!(executions, 1, "the run's command executed {executions} times:\n{markers}\nthe run: {run}");
    assert_eq!(run["state"], "failed", "{run}");
}
