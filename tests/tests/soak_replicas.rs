//! The soak, replicated: three `standby-server serve` replicas on one
//! PostgreSQL schema (the `spool` provider: the test starts a real
//! `standby` agent for each standby credential the leader spools, so the
//! sandboxes outlive any replica), agents reaching the replicas through a
//! [`FaultProxy`] in front of a round-robin TCP [`Balancer`], so their
//! sockets spread over the replicas, each holding its own.
//!
//! Runs are submitted over time through random replicas (a `503` of an
//! election under way, or no answer from a dead replica, is retried with
//! the same `Idempotency-Key` through another), with random network faults
//! on the agents' connections, agents SIGKILLed, waiting or running (see [`killer`]), a few
//! runs cancelled, the leader SIGKILLed twice and a follower once, and
//! the follower holding the socket of the standby a run was just placed
//! on SIGKILLed while the assignment is under way ([`holder_of`]); each
//! killed replica restarted a few submissions later. At the end, the local
//! soak's invariants (`soak_shared`): no run lost, none run twice, no
//! sandbox with two runs, every finished log complete and in order, every
//! fenced attempt's run credential revoked (read from the store).
//!
//! Every random choice comes from one printed seed: `STANDBY_SOAK_SEED`
//! replays it. Needs `cargo build --bins` and PostgreSQL
//! (`STANDBY_TEST_POSTGRES`, see `scripts/postgres`); under `CI=true` a
//! missing one fails it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use standby_e2e::cluster::{Balancer, SpooledAgents, submit_once};
use standby_e2e::harness::process_alive;
use standby_e2e::postgres::TestSchema;
use standby_e2e::proxy::{ConnInfo, Direction, Fault, FaultPolicy, FaultProxy, RandomFaults, Rng, seed_from_env};
use standby_e2e::server_process::{API_KEY, ServerBuilder, ServerProcess, free_addr, keygen, tail};
use tokio::time::Instant;

mod soak_shared;
use soak_shared::{
    Current, Journal, SeedGuard, check_credentials, check_runs, current, lock, maybe_cancel, outcomes, settle, watcher,
};

const RUNS: usize = 60;
/// Runs are submitted over about this long.
const SUBMIT_OVER: Duration = Duration::from_secs(30);
const AGENT_KILLS: usize = 8;
const CANCEL_CHANCE: f64 = 0.04;
/// Probability of a network fault per chunk on an agent's connection.
const NETWORK_FAULT_CHANCE: f64 = 0.01;
/// Probability of a network fault on an assignment sent to an agent.
const ASSIGNMENT_FAULT_CHANCE: f64 = 0.25;
/// Submissions after which a killed replica is started again.
const RESTART_AFTER: usize = 4;
/// Bound on waiting for every run to end after the last submission.
const SETTLE: Duration = Duration::from_secs(45);
/// Bound on one submission's retries, and on an election.
const WAIT: Duration = Duration::from_secs(60);
/// From this submission on, the first run placed on a standby a follower
/// holds has that follower SIGKILLed.
const HOLDER_KILL_FROM: usize = 5 * RUNS / 8;
/// Lines each run prints (its log must hold all of them, in order).
const LINES: usize = 12;
/// Short enough for a quick failover, long enough for two loaded cores.
const LEASE_TTL: &str = "3s";
const HEARTBEAT: &str = "500ms";

/// Each run appends `<label> <run id> <workspace>` to the marker file when
/// its command starts (each agent has a workspace of its own), then prints
/// its lines.
fn run_command(marker: &Path) -> Vec<String> {
    let script = format!(
        "echo \"$SOAK_RUN $STANDBY_EXECUTION_ID $(pwd)\" >> '{marker}'; i=1; while [ $i -le {LINES} ]; do \
         echo \"soak $SOAK_RUN line $i\"; if [ $i -eq {half} ]; then sleep 0.2; fi; i=$((i+1)); done",
        marker = marker.display(),
        half = LINES / 2
    );
    vec!["/bin/sh".into(), "-c".into(), script]
}

/// Random network faults, counted by (phase, kind): on any chunk with
/// [`NETWORK_FAULT_CHANCE`], and on an assignment on its way to an agent
/// (the server's frames are not masked) with [`ASSIGNMENT_FAULT_CHANCE`],
/// the window where a lost delivery must be requeued and never run twice.
struct CountedFaults {
    faults: RandomFaults,
    counts: Arc<Mutex<BTreeMap<(&'static str, &'static str), u64>>>,
}

impl FaultPolicy for CountedFaults {
    fn on_data(&mut self, _conn: &ConnInfo, direction: Direction, data: &[u8]) -> Option<Fault> {
        let assignment = direction == Direction::ToClient && data.windows(12).any(|w| w == b"\"assignment\"");
        let (phase, chance) =
            if assignment { ("assignment", ASSIGNMENT_FAULT_CHANCE) } else { ("any", NETWORK_FAULT_CHANCE) };
        let fault = self.faults.roll(chance)?;
        *lock(&self.counts).entry((phase, fault.kind())).or_default() += 1;
        Some(fault)
    }
}

/// The three replicas: each restarted on its own port and data directory.
struct Replicas {
    builders: Vec<ServerBuilder>,
    live: Vec<Option<Arc<ServerProcess>>>,
    logs: Vec<PathBuf>,
}

/// A failed soak shows every replica's log (the one that led may be gone)
/// and keeps them whole outside its temporary directory.
impl Drop for Replicas {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let kept = std::env::temp_dir().join(format!("standby-soak-replicas-failed-{}", std::process::id()));
            let _ = std::fs::create_dir_all(&kept);
            for log in &self.logs {
                eprintln!("--- {} ---\n{}", log.display(), tail(log, 60));
                if let Some(name) = log.file_name() {
                    let _ = std::fs::copy(log, kept.join(name));
                }
            }
            eprintln!("the replicas' logs are kept in {}", kept.display());
        }
    }
}

impl Replicas {
    fn live(&self) -> Vec<(usize, Arc<ServerProcess>)> {
        self.live
            .iter()
            .enumerate()
            .filter_map(|(index, replica)| Some((index, Arc::clone(replica.as_ref()?))))
            .collect()
    }

    /// The leader's index and epoch once every live replica names the same
    /// live one and it says it leads.
    async fn leader(&self) -> (usize, u64) {
        let live = self.live();
        let (_, any) = live.first().expect("a live replica");
        any.until("the replicas to agree on a leader", WAIT, async || {
            let (mut named, mut epoch) = (None, 0);
            for (index, replica) in &live {
                let (200, view) = replica.try_call(reqwest::Method::GET, "/v1/cluster", Some(API_KEY), None).await?
                else {
                    return None;
                };
                let leader: usize = view["leader"]["id"].as_str()?.strip_prefix('r')?.parse().ok()?;
                if (leader == *index && view["role"] != "leader") || named.is_some_and(|named| named != leader) {
                    return None;
                }
                named = Some(leader);
                epoch = view["epoch"].as_u64()?;
            }
            let leader = named?;
            self.live.get(leader).is_some_and(Option::is_some).then_some((leader, epoch))
        })
        .await
    }

    async fn kill(&mut self, index: usize) {
        let replica = self.live[index].take().expect("a live replica");
        replica.crash().await;
    }

    async fn restart(&mut self, index: usize) {
        self.live[index] = Some(Arc::new(self.builders[index].start().await));
    }

    /// Replicas that exited on their own (a leader deposed by a missed
    /// lease renewal exits, as it must): restarted, as a supervisor would;
    /// the last line each one logged.
    async fn restart_exited(&mut self) -> Vec<String> {
        let mut exited = Vec::new();
        for index in 0..self.live.len() {
            if self.live[index].as_ref().is_some_and(|replica| !process_alive(replica.pid())) {
                self.live[index] = None;
                exited.push(format!("r{index}: {}", tail(&self.logs[index], 1).trim()));
                self.restart(index).await;
            }
        }
        exited
    }

    /// Submits through random live replicas under `key` until one answers
    /// `201` (as a client would, with the same key); the run's id and the
    /// number of retries.
    async fn submit(&self, rng: &mut Rng, key: &str, body: &Value) -> (String, u64) {
        let deadline = Instant::now() + WAIT;
        let mut retries = 0;
        loop {
            let live = self.live();
            let (_, replica) = &live[rng.below(live.len() as u64) as usize];
            if let Some(id) = submit_once(&replica.url(), key, body).await {
                return (id, retries);
            }
            assert!(Instant::now() < deadline, "submission {key} not accepted within {WAIT:?}");
            retries += 1;
            // A replica answers again once an election ended: polled.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Kills agents at random times, waiting or running a run, the server's
/// view read through the replica of the moment. The `spool` provider
/// reports no exit: a killed standby is retired for silence, and a run
/// whose agent dies after confirming delivery is failed once it has been
/// unheard for `--run-lost-after` (short here), as an adopted sandbox's
/// is after a failover.
async fn killer(
    server: Current,
    agents: Arc<SpooledAgents>,
    journal: Arc<Mutex<Journal>>,
    mut rng: Rng,
    stop: Arc<AtomicBool>,
) {
    let mut killed = 0;
    while killed < AGENT_KILLS && !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(rng.duration(Duration::from_millis(500), Duration::from_millis(3000))).await;
        let Some(server) = current(&server) else { continue };
        let Some((200, sandboxes)) =
            server.try_call(reqwest::Method::GET, "/v1/sandboxes?limit=1000", Some(API_KEY), None).await
        else {
            continue;
        };
        let targets: Vec<(i32, &str)> = sandboxes["sandboxes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|sandbox| sandbox["state"] == "assigned" || sandbox["last_state"] == "ready")
            .filter_map(|sandbox| {
                let kind = if sandbox["state"] == "assigned" { "agent-running" } else { "agent-waiting" };
                Some((agents.pid(sandbox["id"].as_str()?)?, kind))
            })
            .filter(|(pid, _)| process_alive(*pid))
            .collect();
        if targets.is_empty() {
            continue;
        }
        let (pid, kind) = targets[rng.below(targets.len() as u64) as usize];
        if kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
            killed += 1;
            *lock(&journal).faults.entry(kind).or_default() += 1;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_soak_with_faults_agent_and_replica_kills_loses_nothing_and_runs_nothing_twice() {
    let began = Instant::now();
    let Some(schema) = TestSchema::create("soak_replicas") else { return };
    let seed = seed_from_env("STANDBY_SOAK_SEED");
    let _guard = SeedGuard { var: "STANDBY_SOAK_SEED", seed };
    let mut rng = Rng::new(seed);
    let dir = tempfile::Builder::new().prefix("standby-soak-replicas-").tempdir().expect("a temp dir");
    let marker = dir.path().join("marker");
    let spool = dir.path().join("spool");
    std::fs::create_dir_all(&spool).expect("the spool");

    let key = dir.path().join("secret.key");
    keygen(&key);
    let builders: Vec<ServerBuilder> = (0..3)
        .map(|index| {
            let mark = format!("soak-replicas-{seed:016x}-{index}");
            ServerBuilder::new(
                &dir.path().join(format!("data{index}")),
                &dir.path().join(format!("r{index}.log")),
                &mark,
            )
            .args(&["--provider", "spool", "--spool-dir", &spool.display().to_string(), "--store", &schema.url()])
            // A restarted replica keeps its port: the balancer's list holds.
            .listen(free_addr())
            .args(&["--lease-ttl", LEASE_TTL, "--replica-id", &format!("r{index}")])
            // Every replica opens what any of them sealed, and proves
            // itself to the others with one cluster secret.
            .args(&["--secret-key-file", &key.display().to_string()])
            .cluster_secret(&dir.path().join("cluster.secret"))
            .args(&["--pool-size", "6", "--running-cap", "12", "--heartbeat-interval", HEARTBEAT])
            .args(&["--max-attempts", "6", "--launch-timeout", "20s", "--linger", "2s", "--log", "info"])
            .args(&["--run-lost-after", "5s"])
        })
        .collect();
    let logs = (0..3).map(|index| dir.path().join(format!("r{index}.log"))).collect();
    let mut replicas = Replicas { builders, live: vec![None, None, None], logs };
    for index in 0..3 {
        replicas.restart(index).await;
    }
    let balancer = Balancer::start(replicas.live().iter().map(|(_, replica)| replica.addr()).collect()).await;
    let proxy = FaultProxy::start(balancer.addr()).await;
    let network_faults = Arc::new(Mutex::new(BTreeMap::new()));
    proxy.set_policy(CountedFaults {
        faults: RandomFaults::new(rng.next_u64(), NETWORK_FAULT_CHANCE).weights(4, 3, 3, 1),
        counts: Arc::clone(&network_faults),
    });
    let agents = Arc::new(SpooledAgents::start(spool, Some(proxy.url()), HEARTBEAT));
    let (first_leader, first_epoch) = replicas.leader().await;

    // The observers (watcher, cancels, killer) read through a follower,
    // moved to another live replica when theirs is killed.
    let server: Current = Arc::new(Mutex::new(Some(replicas.live()[(first_leader + 1) % 3].1.clone())));
    let journal = Arc::new(Mutex::new(Journal::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let killer = tokio::spawn(killer(
        Arc::clone(&server),
        Arc::clone(&agents),
        Arc::clone(&journal),
        rng.fork(),
        Arc::clone(&stop),
    ));
    let watcher = tokio::spawn(watcher(Arc::clone(&server), Arc::clone(&journal), Arc::clone(&stop)));
    let mut cancels = tokio::task::JoinSet::new();

    // The leader killed at a quarter and three quarters, a follower at half.
    let kills = [(RUNS / 4, "leader"), (RUNS / 2, "follower"), (3 * RUNS / 4, "leader")];
    let mut restarts: Vec<(usize, usize)> = Vec::new();
    let (mut submit_retries, mut exited, mut holder_killed) = (0, Vec::new(), false);
    let gap = SUBMIT_OVER / RUNS as u32;
    for label in 0..RUNS {
        exited.extend(replicas.restart_exited().await);
        for (_, index) in restarts.iter().filter(|(at, _)| *at == label) {
            replicas.restart(*index).await;
        }
        if let Some((_, role)) = kills.iter().find(|(at, _)| *at == label) {
            let (leader, _) = replicas.leader().await;
            let followers: Vec<usize> =
                replicas.live().into_iter().map(|(index, _)| index).filter(|index| *index != leader).collect();
            let index = match *role {
                "follower" if !followers.is_empty() => followers[rng.below(followers.len() as u64) as usize],
                _ => leader,
            };
            replicas.kill(index).await;
            restarts.push((label + RESTART_AFTER, index));
            // One or two are left: a follower killed for holding a
            // placed standby may not be back yet.
            let live = replicas.live();
            let survivor = live[rng.below(live.len() as u64) as usize].1.clone();
            *lock(&server) = Some(survivor);
            *lock(&journal)
                .faults
                .entry(if *role == "leader" { "replica-leader" } else { "replica-follower" })
                .or_default() += 1;
            lock(&journal).restarts += 1;
        }
        let body = json!({"command": run_command(&marker), "env": {"SOAK_RUN": label.to_string()}});
        let (id, retries) = replicas.submit(&mut rng, &format!("soak-{seed}-{label}"), &body).await;
        submit_retries += retries;
        if label >= HOLDER_KILL_FROM && !holder_killed {
            // The follower holding the standby this run was placed on,
            // killed while the assignment is under way (once one is).
            let (leader, _) = replicas.leader().await;
            let holder = match replicas.live[leader].clone() {
                Some(leader_now) => holder_of(&leader_now, &id).await.filter(|index| *index != leader),
                None => None,
            };
            if let Some(index) = holder.filter(|index| replicas.live[*index].is_some()) {
                replicas.kill(index).await;
                holder_killed = true;
                restarts.push((label + RESTART_AFTER, index));
                // One or two are left: a follower killed for holding a
                // placed standby may not be back yet.
                let live = replicas.live();
                let survivor = live[rng.below(live.len() as u64) as usize].1.clone();
                *lock(&server) = Some(survivor);
                *lock(&journal).faults.entry("replica-holding-the-assigned-standby").or_default() += 1;
                lock(&journal).restarts += 1;
            }
        }
        lock(&journal).submitted.push((label, id.clone()));
        maybe_cancel(&mut cancels, &server, &journal, &mut rng, (CANCEL_CHANCE, id));
        tokio::time::sleep(rng.duration(gap / 2, gap * 3 / 2)).await;
    }
    for (_, index) in restarts.iter().filter(|(at, _)| *at >= RUNS) {
        replicas.restart(*index).await;
    }
    while cancels.join_next().await.is_some() {}

    // Every run ends, read through the leader of a settled cluster.
    exited.extend(replicas.restart_exited().await);
    let (leader, _) = replicas.leader().await;
    let leader_now = replicas.live[leader].clone().expect("the leader");
    *lock(&server) = Some(Arc::clone(&leader_now));
    let settled = settle(&leader_now, &journal, SETTLE).await;
    stop.store(true, Ordering::Relaxed);
    let _ = killer.await;
    let _ = watcher.await;
    proxy.clear_policy();

    // ---- invariants --------------------------------------------------------
    let journal = lock(&journal).clone();
    let markers = std::fs::read_to_string(&marker).unwrap_or_default();
    let mut verdict = check_runs(&leader_now, &journal, &settled, &markers, LINES).await;
    let (_, last_epoch) = replicas.leader().await;
    drop(leader_now);
    *lock(&server) = None;
    // Followers first, so that the leader's stop elects nobody.
    let mut order: Vec<usize> = (0..3).filter(|index| *index != leader).collect();
    order.push(leader);
    for index in order {
        let replica = replicas.live[index].take().expect("a live replica");
        let replica = Arc::try_unwrap(replica).unwrap_or_else(|_| panic!("r{index} is still shared"));
        let status = replica.stop(Signal::SIGTERM).await;
        assert!(status.success(), "r{index} exited {status} on SIGTERM");
    }
    let credentials: Vec<Value> = schema
        .query_text("SELECT doc FROM credentials")
        .iter()
        .map(|doc| serde_json::from_str(doc).expect("a credential document"))
        .collect();
    let requeues = check_credentials(&mut verdict, &credentials);
    // No replica panicked (a deposed one exits cleanly, with its own code).
    for log in &replicas.logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        for (at, line) in lines.iter().enumerate().filter(|(_, line)| line.contains("panicked at")) {
            let message = lines.get(at + 1).unwrap_or(&"");
            verdict.problems.push(format!("{} panicked: {line} {message}", log.display()));
        }
    }

    // ---- summary -----------------------------------------------------------
    let (by_state, attempts) = outcomes(&verdict);
    eprintln!(
        "soak-replicas: seed {seed}, {} runs submitted, {attempts} attempts, {requeues} requeues",
        verdict.runs.len()
    );
    eprintln!("soak-replicas: runs by state/path: {by_state:?}");
    eprintln!("soak-replicas: proxy: {}; network faults by (phase, kind): {:?}", proxy.stats(), lock(&network_faults));
    eprintln!(
        "soak-replicas: agents SIGKILLed by point and replicas SIGKILLed by role: {:?}; agents started: {}; \
         cancels: {}; replicas that exited on their own: {exited:?}; submissions retried: {submit_retries}",
        journal.faults,
        agents.count(),
        journal.cancels
    );
    eprintln!(
        "soak-replicas: leadership changes: {} (epoch {first_epoch} to {last_epoch}); wall time {:?}",
        last_epoch - first_epoch,
        began.elapsed()
    );
    eprintln!(
        "soak-replicas: marker lines: {}; invariant violations: {}",
        verdict.marker_lines,
        verdict.problems.len()
    );
    assert!(
        verdict.problems.is_empty(),
        "{} invariant violations (seed {seed}):\n{}",
        verdict.problems.len(),
        verdict.problems.join("\n")
    );
}

/// The index of the replica holding the socket of the standby run `id` was
/// placed on, read from `leader` (`held_by` of the sandbox page); `None`
/// while the run is queued or its sandbox holds no socket.
async fn holder_of(leader: &ServerProcess, id: &str) -> Option<usize> {
    let (200, run) = leader.try_call(reqwest::Method::GET, &format!("/v1/runs/{id}"), Some(API_KEY), None).await?
    else {
        return None;
    };
    let sandbox = run["attempts"].as_array()?.last()?["sandbox_id"].as_str()?.to_owned();
    let (200, page) = leader.try_call(reqwest::Method::GET, "/v1/sandboxes?limit=500", Some(API_KEY), None).await?
    else {
        return None;
    };
    let held = page["sandboxes"].as_array()?.iter().find(|view| view["id"] == sandbox.as_str())?;
    held["held_by"]["replica"].as_str()?.strip_prefix('r')?.parse().ok()
}
