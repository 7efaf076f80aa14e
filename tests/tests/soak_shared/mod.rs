//! What the soak tests (`soak.rs`: the local provider behind a fault
//! proxy; `soak_docker.rs`: real containers killed, paused and cut from
//! their network; `soak_replicas.rs`: three replicas on PostgreSQL, the
//! leader and a follower killed) share: the journal of what the test did,
//! the watcher of terminal states, and the invariants checked at the end.
//! Each soak's runs report one marker line `<label> <run id> <sandbox>`
//! when their command starts, by whatever way its sandboxes can reach the
//! test.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{Value, json};
use standby_e2e::proxy::Rng;
use standby_e2e::server_process::{API_KEY, ServerProcess};
use standby_protocol::{Event, EventKind};

pub fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Prints how to replay a failed run: on a panic, the seed is the one
/// thing needed to reproduce it.
pub struct SeedGuard {
    pub var: &'static str,
    pub seed: u64,
}

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("FAILED with seed {}: replay with {}={}", self.seed, self.var, self.seed);
        }
    }
}

/// What the test did and saw, for the invariants and the summary.
#[derive(Debug, Default, Clone)]
pub struct Journal {
    /// Label → run id, in submission order.
    pub submitted: Vec<(usize, String)>,
    /// Run id → the first terminal state seen, and every later state that
    /// differed from it (must stay empty).
    pub terminal: HashMap<String, String>,
    pub flips: Vec<String>,
    /// Faults injected, by kind (agents killed by point, containers
    /// killed, paused, disconnected).
    pub faults: BTreeMap<&'static str, u64>,
    pub cancels: u64,
    pub restarts: u64,
}

/// The server of the moment: replaced on every restart.
pub type Current = Arc<Mutex<Option<Arc<ServerProcess>>>>;

pub fn current(server: &Current) -> Option<Arc<ServerProcess>> {
    lock(server).clone()
}

pub const TERMINAL: [&str; 3] = ["exited", "failed", "cancelled"];

/// With probability `chance`, cancels run `id` after a random delay of up
/// to 800 ms (a task in `cancels`), counted in the journal when the
/// server took it.
pub fn maybe_cancel(
    cancels: &mut tokio::task::JoinSet<()>,
    server: &Current,
    journal: &Arc<Mutex<Journal>>,
    rng: &mut Rng,
    (chance, id): (f64, String),
) {
    if !rng.chance(chance) {
        return;
    }
    let delay = rng.duration(Duration::ZERO, Duration::from_millis(800));
    let (server, journal) = (Arc::clone(server), Arc::clone(journal));
    cancels.spawn(async move {
        tokio::time::sleep(delay).await;
        if let Some(server) = current(&server)
            && let Some((200 | 409, _)) =
                server.try_call(reqwest::Method::POST, &format!("/v1/runs/{id}/cancel"), Some(API_KEY), None).await
        {
            lock(&journal).cancels += 1;
        }
    });
}

/// Polls every run's state: the first terminal state of each is kept, and
/// any later change is a violation.
pub async fn watcher(server: Current, journal: Arc<Mutex<Journal>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        // Every page of the list (a server may be restarted between two).
        let mut path = "/v1/runs?limit=1000".to_owned();
        while let Some(server) = current(&server)
            && let Some((200, body)) = server.try_call(reqwest::Method::GET, &path, Some(API_KEY), None).await
        {
            observe(&journal, &body);
            let Some(cursor) = body["next_cursor"].as_str() else { break };
            path = format!("/v1/runs?limit=1000&cursor={cursor}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub fn observe(journal: &Mutex<Journal>, runs: &Value) {
    let mut journal = lock(journal);
    for run in runs["runs"].as_array().into_iter().flatten() {
        let (Some(id), Some(state)) = (run["id"].as_str(), run["state"].as_str()) else { continue };
        match journal.terminal.get(id).cloned() {
            Some(first) if first != state => journal.flips.push(format!("{id}: {first} then {state}")),
            Some(_) => {}
            None if TERMINAL.contains(&state) => {
                journal.terminal.insert(id.to_owned(), state.to_owned());
            }
            None => {}
        }
    }
}

/// Waits (up to `settle`) until every submitted run reached a terminal
/// state; the runs then. On a timeout, names the runs still open.
pub async fn settle(server: &ServerProcess, journal: &Mutex<Journal>, settle: Duration) -> Vec<Value> {
    let submitted = lock(journal).submitted.len();
    let deadline = tokio::time::Instant::now() + settle;
    loop {
        let runs = server.runs().await;
        let open: Vec<String> = runs
            .iter()
            .filter(|run| !TERMINAL.iter().any(|t| run["state"] == *t))
            .map(|run| format!("{} {} attempts {}", run["id"], run["state"], run["attempts"]))
            .collect();
        if open.is_empty() && runs.len() >= submitted {
            observe(journal, &json!({ "runs": runs }));
            let took = settle.saturating_sub(deadline.saturating_duration_since(tokio::time::Instant::now()));
            eprintln!("soak: every run settled {:.1} s after the last submission", took.as_secs_f64());
            return runs;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "runs still open {} s after the last submission:\n{}\n{}",
            settle.as_secs(),
            open.join("\n"),
            server.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The runs at the end and what is wrong with them.
pub struct Verdict {
    pub runs: HashMap<String, Value>,
    pub problems: Vec<String>,
    /// Run id → the attempts that reported `started`.
    pub started_attempts: HashMap<String, Vec<u64>>,
    pub marker_lines: usize,
}

/// The invariants over the settled runs, their events and logs, and the
/// marker lines: nothing lost, one terminal state each, at most one start
/// and one end, no command executed twice or in a sandbox that ran
/// another, every finished log complete and in order (`lines` lines of
/// `soak <label> line <n>`).
pub async fn check_runs(
    server: &ServerProcess,
    journal: &Journal,
    settled: &[Value],
    markers: &str,
    lines: usize,
) -> Verdict {
    let runs: HashMap<String, Value> =
        settled.iter().filter_map(|run| Some((run["id"].as_str()?.to_owned(), run.clone()))).collect();
    let mut problems = Vec::new();

    // Nothing lost: every submitted run is there, and nothing else.
    assert_eq!(runs.len(), journal.submitted.len(), "runs in the server vs runs submitted");
    for (_, id) in &journal.submitted {
        if !runs.contains_key(id) {
            problems.push(format!("run {id} was lost"));
        }
    }
    // Exactly one terminal state.
    problems.extend(journal.flips.iter().map(|flip| format!("terminal state changed: {flip}")));
    for (id, run) in &runs {
        let state = run["state"].as_str().unwrap_or_default();
        if !TERMINAL.contains(&state) {
            problems.push(format!("run {id} is {state}"));
        }
        if journal.terminal.get(id).is_some_and(|first| first != state) {
            problems.push(format!("run {id} ended {} and is now {state}", journal.terminal[id]));
        }
        if state == "exited" && run["exit_code"].is_null() {
            problems.push(format!("run {id} exited without an exit code"));
        }
        // The agent's own word on the log (contract 1.1 note 10): no run
        // gave up on any output, and every exit says so.
        if !run["log_lost_bytes"].is_null() || (state == "exited" && run["log_complete"] != true) {
            problems.push(format!(
                "run {id} ({state}) says log_complete {} log_lost_bytes {}",
                run["log_complete"], run["log_lost_bytes"]
            ));
        }
    }
    // Events: at most one start and one end per run.
    let mut started_attempts: HashMap<String, Vec<u64>> = HashMap::new();
    for id in runs.keys() {
        let events = server.get(&format!("/v1/runs/{id}/events")).await;
        let events = events["events"].as_array().cloned().unwrap_or_default();
        let kind = |e: &Value| serde_json::from_value::<Event>(e["event"].clone()).ok().map(|event| event.kind);
        let started: Vec<&Value> = events.iter().filter(|e| kind(e) == Some(EventKind::Started)).collect();
        let ends = events.iter().filter(|e| matches!(kind(e), Some(EventKind::Exited { .. } | EventKind::Cancelled)));
        let ends = ends.count();
        if started.len() > 1 || ends > 1 {
            problems.push(format!("run {id} has {} started and {ends} end events", started.len()));
        }
        started_attempts.insert(id.clone(), started.iter().filter_map(|e| e["attempt"].as_u64()).collect());
    }
    // Markers: no command ran twice, no sandbox ran two runs.
    let mut ran: HashMap<String, Vec<String>> = HashMap::new();
    let mut sandboxes: HashMap<String, Vec<String>> = HashMap::new();
    for line in markers.lines() {
        let mut parts = line.splitn(3, ' ');
        let (Some(label), Some(id), Some(sandbox)) = (parts.next(), parts.next(), parts.next()) else {
            problems.push(format!("malformed marker line {line:?}"));
            continue;
        };
        ran.entry(id.to_owned()).or_default().push(label.to_owned());
        sandboxes.entry(sandbox.to_owned()).or_default().push(id.to_owned());
    }
    for (label, id) in &journal.submitted {
        let executions = ran.get(id).map_or(0, Vec::len);
        if executions > 1 {
            problems.push(format!("run {id} (label {label}) executed {executions} times"));
        }
        if ran.get(id).is_some_and(|labels| labels.iter().any(|l| *l != label.to_string())) {
            problems.push(format!("run {id} executed another run's command"));
        }
        if runs.get(id).is_some_and(|run| run["state"] == "exited") && executions != 1 {
            problems.push(format!("run {id} exited but its command executed {executions} times"));
        }
    }
    for (sandbox, ids) in &sandboxes {
        if ids.len() > 1 {
            problems.push(format!("sandbox {sandbox} ran {ids:?}"));
        }
    }
    let mut sandbox_runs: HashMap<String, Vec<String>> = HashMap::new();
    for (id, run) in &runs {
        for attempt in run["attempts"].as_array().into_iter().flatten() {
            if let Some(sandbox) = attempt["sandbox_id"].as_str() {
                sandbox_runs.entry(sandbox.to_owned()).or_default().push(id.clone());
            }
        }
    }
    for (sandbox, ids) in &sandbox_runs {
        if ids.len() > 1 {
            problems.push(format!("sandbox {sandbox} was bound to {ids:?}"));
        }
    }
    // Logs: complete and in order for every run that exited 0, an in-order
    // prefix for every other run that exited.
    for (label, id) in &journal.submitted {
        let Some(run) = runs.get(id) else { continue };
        if run["state"] != "exited" {
            continue;
        }
        let log = String::from_utf8_lossy(&server.log(id).await).into_owned();
        let ours = format!("soak {label} line ");
        let numbers: Vec<usize> =
            log.lines().filter_map(|line| line.trim_end_matches('\r').strip_prefix(&ours)?.parse().ok()).collect();
        let foreign = log.lines().filter(|line| line.starts_with("soak ") && !line.starts_with(&ours)).count();
        let expected: Vec<usize> = (1..=lines).collect();
        let complete = run["exit_code"] == 0;
        let in_order = numbers.iter().copied().eq(1..=numbers.len());
        if foreign > 0 || !in_order || (complete && numbers != expected) {
            problems.push(format!(
                "run {id} (label {label}, exit {}, log_complete {}, log_lost_bytes {}) logged lines {numbers:?}",
                run["exit_code"], run["log_complete"], run["log_lost_bytes"]
            ));
        }
    }
    Verdict { runs, problems, started_attempts, marker_lines: markers.lines().count() }
}

/// Reads credential records from a SQLite store file (read-only).
#[allow(dead_code, reason = "soak_replicas reads its credentials from PostgreSQL")]
pub fn sqlite_credentials(path: &Path) -> Vec<Value> {
    let connection = rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        .unwrap_or_else(|error| panic!("open the store {} read-only: {error}", path.display()));
    let mut statement = connection.prepare("SELECT doc FROM credentials").expect("query credentials");
    statement
        .query_map([], |row| row.get::<_, String>(0))
        .expect("read credentials")
        .map(|doc| serde_json::from_str(&doc.expect("a credential row")).expect("a credential document"))
        .collect()
}

/// From the store's credential records (read after the servers stopped):
/// every requeued (or otherwise ended before the start) attempt's run
/// credential is revoked, and no such attempt started. The number of
/// requeues.
pub fn check_credentials(verdict: &mut Verdict, credentials: &[Value]) -> u64 {
    let mut requeues = 0;
    for (id, run) in &verdict.runs {
        for attempt in run["attempts"].as_array().into_iter().flatten() {
            let outcome = attempt["outcome"].as_str().unwrap_or_default();
            // Fenced: released before the run started on it.
            let fenced = match outcome {
                "requeued" | "cancelled" => true,
                "failed" => attempt["started_at"].is_null(),
                _ => false,
            };
            if !fenced {
                continue;
            }
            requeues += u64::from(outcome == "requeued");
            let number = attempt["number"].as_u64().unwrap_or_default();
            let revoked = credentials.iter().any(|credential| {
                credential["run_id"] == id.as_str()
                    && credential["attempt"] == number
                    && credential["kind"] == "run"
                    && credential["state"] != "active"
            });
            let active = credentials.iter().any(|credential| {
                credential["run_id"] == id.as_str()
                    && credential["attempt"] == number
                    && credential["state"] == "active"
            });
            if !revoked || active {
                verdict
                    .problems
                    .push(format!("run {id} attempt {number} ({outcome}): its run credential is still active"));
            }
            // A cancel races the agent's start: the run may have started
            // just before the cancel reached it, and amendment 8 lets the
            // agent report that until it exits (the markers prove it ran
            // at most once). A requeued or failed attempt never starts.
            let started = verdict.started_attempts.get(id).is_some_and(|started| started.contains(&number));
            if outcome != "cancelled" && started {
                verdict.problems.push(format!("run {id} attempt {number} ({outcome}) reported started"));
            }
        }
    }
    requeues
}

/// Runs by `state/path`, and the number of attempts.
pub fn outcomes(verdict: &Verdict) -> (BTreeMap<String, u64>, usize) {
    let mut by_state: BTreeMap<String, u64> = BTreeMap::new();
    for run in verdict.runs.values() {
        let key = format!("{}/{}", run["state"].as_str().unwrap_or("?"), run["path"].as_str().unwrap_or("none"));
        *by_state.entry(key).or_default() += 1;
    }
    let attempts = verdict.runs.values().map(|run| run["attempts"].as_array().map_or(0, Vec::len)).sum();
    (by_state, attempts)
}
