//! Three `standby-server serve` replicas on one PostgreSQL store (the
//! `spool` provider: the test starts a real `standby` agent for each
//! standby credential the leader spools), agents reaching the replicas
//! through a small round-robin TCP balancer, so their sockets spread over
//! the replicas and those on followers are relayed to the leader.
//!
//! Each run appends its own marker to one file: a run executed twice would
//! show there, whatever the servers believe.
//!
//! Needs PostgreSQL (`STANDBY_TEST_POSTGRES`, see `scripts/postgres`): each
//! test gets a schema of its own; under `CI=true` a missing one fails it.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use standby_e2e::cluster::{Balancer, SpooledAgents, submit_once};
use standby_e2e::postgres::TestSchema;
use standby_e2e::server_process::{API_KEY, ServerBuilder, ServerProcess, free_addr, keygen, tail};

const WAIT: Duration = Duration::from_secs(90);
/// Short enough for a quick failover, long enough for two loaded cores.
const LEASE_TTL: &str = "3s";
/// The deposed leader's exit code (`standby-server serve --help`).
const DEPOSED: i32 = 3;

struct Cluster {
    replicas: Vec<Option<ServerProcess>>,
    logs: Vec<PathBuf>,
    builders: Vec<ServerBuilder>,
    marks: PathBuf,
    agents: SpooledAgents,
    _balancer: Balancer,
    _dir: tempfile::TempDir,
    schema: TestSchema,
}

/// A failed test shows every replica's log: the one that led may be gone.
impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for log in &self.logs {
                eprintln!("--- {} ---\n{}", log.display(), tail(log, 80));
            }
        }
    }
}

impl Cluster {
    async fn start(test: &str, pool_size: usize) -> Option<Self> {
        Self::start_agents(test, pool_size, true).await
    }

    /// `balanced`: agents go through the balancer; else they wait for the
    /// test to [`SpooledAgents::pin`] a URL.
    async fn start_agents(test: &str, pool_size: usize, balanced: bool) -> Option<Self> {
        let schema = TestSchema::create(&format!("replicas::{test}"))?;
        let dir = tempfile::Builder::new().prefix("standby-replicas-").tempdir().expect("a temp dir");
        let spool = dir.path().join("spool");
        std::fs::create_dir_all(&spool).expect("the spool");
        let url = schema.url();
        let key = dir.path().join("secret.key");
        keygen(&key);
        let builders: Vec<ServerBuilder> = (0..3)
            .map(|index| {
                let mark = format!("replicas-{}-{index}-{}", std::process::id(), schema.name());
                ServerBuilder::new(
                    &dir.path().join(format!("data{index}")),
                    &dir.path().join(format!("r{index}.log")),
                    &mark,
                )
                .args(&["--provider", "spool", "--spool-dir", &spool.display().to_string(), "--store", &url])
                // A restarted replica keeps its port: the balancer's list holds.
                .listen(free_addr())
                .args(&["--lease-ttl", LEASE_TTL, "--replica-id", &format!("r{index}")])
                // Every replica opens what any of them sealed.
                .args(&["--secret-key-file", &key.display().to_string()])
                .args(&[
                    "--pool-size",
                    &pool_size.to_string(),
                    "--heartbeat-interval",
                    "500ms",
                    "--linger",
                    "2s",
                ])
            })
            .collect();
        let logs = (0..3).map(|index| dir.path().join(format!("r{index}.log"))).collect();
        let mut replicas = Vec::new();
        for builder in &builders {
            replicas.push(Some(builder.start().await));
        }
        let balancer = Balancer::start(replicas.iter().flatten().map(ServerProcess::addr).collect()).await;
        let agents = SpooledAgents::start(spool, balanced.then(|| balancer.url()), "500ms");
        let marks = dir.path().join("marks");
        Some(Self { replicas, logs, builders, marks, agents, _balancer: balancer, _dir: dir, schema })
    }

    fn replica(&self, index: usize) -> &ServerProcess {
        self.replicas[index].as_ref().expect("a live replica")
    }

    fn live(&self) -> impl Iterator<Item = (usize, &ServerProcess)> {
        self.replicas.iter().enumerate().filter_map(|(index, replica)| Some((index, replica.as_ref()?)))
    }

    /// The leader's index and epoch once every live replica names the same
    /// live one (other than `not`) and it says it leads.
    async fn leader(&self, not: Option<usize>) -> (usize, u64) {
        let (_, any) = self.live().next().expect("a live replica");
        any.until("the replicas to agree on a leader", WAIT, async || {
            let mut named = HashSet::new();
            let mut epoch = 0;
            for (index, replica) in self.live() {
                let view = replica.get("/v1/cluster").await;
                let leader: usize = view["leader"]["id"].as_str()?.strip_prefix('r')?.parse().ok()?;
                if leader == index && view["role"] != "leader" {
                    return None;
                }
                named.insert(leader);
                epoch = view["epoch"].as_u64()?;
            }
            let leader = *named.iter().next()?;
            let live = self.replicas.get(leader).is_some_and(Option::is_some);
            (named.len() == 1 && live && Some(leader) != not).then_some((leader, epoch))
        })
        .await
    }

    /// A run whose command appends `marker` to the marks file.
    fn run_body(&self, marker: &str) -> Value {
        let line = format!("echo {marker} >> {}", self.marks.display());
        json!({"command": ["sh", "-c", line]})
    }

    /// How many times each marker was executed.
    fn executions(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for line in std::fs::read_to_string(&self.marks).unwrap_or_default().lines() {
            *counts.entry(line.trim().to_owned()).or_insert(0) += 1;
        }
        counts
    }

    /// Submits through replica `index` under `key`, retrying through the
    /// next live replicas (as a client would, with the same key) until one
    /// answers `201`; the run's id.
    async fn submit(&self, index: usize, key: &str, body: &Value) -> String {
        let any = self.live().next().expect("a live replica").1;
        any.until("a submission to be accepted", WAIT, async || {
            let live: Vec<(usize, &ServerProcess)> = self.live().collect();
            let first = live.iter().position(|(at, _)| *at >= index).unwrap_or(0);
            for offset in 0..live.len() {
                let (_, replica) = live[(first + offset) % live.len()];
                if let Some(id) = submit_once(&replica.url(), key, body).await {
                    return Some(id);
                }
            }
            None
        })
        .await
    }

    /// Waits for every run to finish (read through any live replica, a
    /// `503` of an election under way read again); their final records.
    async fn finished(&self, ids: &[String]) -> Vec<Value> {
        let mut done = Vec::new();
        for id in ids {
            let (_, any) = self.live().next().expect("a live replica");
            let path = format!("/v1/runs/{id}");
            let run = any
                .until("the run to finish", WAIT, async || {
                    let (status, run) = any.try_call(reqwest::Method::GET, &path, Some(API_KEY), None).await?;
                    let over = matches!(run["state"].as_str(), Some("exited" | "failed" | "cancelled"));
                    (status == 200 && over).then_some(run)
                })
                .await;
            done.push(run);
        }
        done
    }

    /// Every run exited 0 and was executed exactly once; its `started`
    /// events, one per run.
    async fn assert_once(&self, markers: &BTreeMap<String, String>, runs: &[Value]) {
        for run in runs {
            assert_eq!((run["state"].as_str(), run["exit_code"].as_i64()), (Some("exited"), Some(0)), "{run}");
        }
        let executions = self.executions();
        for (marker, id) in markers {
            assert_eq!(executions.get(marker), Some(&1), "run {id} ({marker}) executed once: {executions:?}");
            let (_, any) = self.live().next().expect("a live replica");
            let events = any.get(&format!("/v1/runs/{id}/events")).await;
            let started = events["events"]
                .as_array()
                .map_or(0, |events| events.iter().filter(|event| event["event"]["type"] == "started").count());
            assert_eq!(started, 1, "one start of {id}: {events}");
        }
        assert_eq!(executions.len(), markers.len(), "nothing else ran: {executions:?}");
    }
}

#[tokio::test]
async fn runs_submitted_through_every_replica_start_exactly_once() {
    let Some(cluster) = Cluster::start("through_every_replica", 3).await else { return };
    let (leader, _) = cluster.leader(None).await;
    let mut markers = BTreeMap::new();
    for round in 0..3 {
        for index in 0..3 {
            let marker = format!("m-{round}-{index}");
            let id = cluster.submit(index, &marker, &cluster.run_body(&marker)).await;
            markers.insert(marker, id);
        }
    }
    let ids: Vec<String> = markers.values().cloned().collect();
    let runs = cluster.finished(&ids).await;
    cluster.assert_once(&markers, &runs).await;

    let metrics = cluster.replica((leader + 1) % 3).call(reqwest::Method::GET, "/metrics", Some(API_KEY), None).await;
    let text = metrics.1.as_str().unwrap_or_default().to_owned();
    assert!(text.contains("standby_leader 0"), "a follower's metrics: {text}");
    let forwarded: u64 = text
        .lines()
        .find_map(|line| line.strip_prefix("standby_forwarded_requests_total "))
        .and_then(|count| count.parse().ok())
        .unwrap_or(0);
    assert!(forwarded > 0, "the follower forwarded calls: {text}");
    let health = cluster.replica(leader).call(reqwest::Method::GET, "/healthz", None, None).await;
    assert_eq!(health.1, Value::String(format!("ok leader r{leader}")));
}

#[tokio::test]
async fn a_killed_leader_is_replaced_and_a_burst_loses_nothing_and_runs_nothing_twice() {
    let Some(mut cluster) = Cluster::start("killed_leader", 3).await else { return };
    let (leader, epoch) = cluster.leader(None).await;
    let mut markers = BTreeMap::new();
    for n in 0..12 {
        if n == 4 {
            cluster.replica(leader).crash().await;
            cluster.replicas[leader] = None;
        }
        let marker = format!("burst-{n}");
        let id = cluster.submit(n % 3, &marker, &cluster.run_body(&marker)).await;
        markers.insert(marker, id);
    }
    let (next, next_epoch) = cluster.leader(Some(leader)).await;
    assert!(next != leader && next_epoch > epoch, "r{next} leads at epoch {next_epoch} after r{leader} at {epoch}");
    let ids: Vec<String> = markers.values().cloned().collect();
    let runs = cluster.finished(&ids).await;
    cluster.assert_once(&markers, &runs).await;
    // The killed replica comes back as a follower.
    let restarted = cluster.builders[leader].start().await;
    cluster.replicas[leader] = Some(restarted);
    assert_eq!(cluster.leader(None).await.0, next, "the leader stays");
}

/// A replica's metric `name`.
async fn metric(replica: &ServerProcess, name: &str) -> Option<u64> {
    let (_, text) = replica.try_call(reqwest::Method::GET, "/metrics", Some(API_KEY), None).await?;
    let prefix = format!("{name} ");
    text.as_str()?.lines().find_map(|line| line.strip_prefix(&prefix)?.parse().ok())
}

/// An agent connected to a follower keeps its socket when the leader is
/// SIGKILLed: the follower's relay waits for the next leader, re-dials it
/// and replays the agent's heartbeat; the agent connected once only, and
/// a run submitted afterwards starts warm on its sandbox.
#[tokio::test]
async fn an_agent_on_a_follower_keeps_its_socket_when_the_leader_is_killed() {
    let Some(mut cluster) = Cluster::start_agents("relayed_socket_survives", 1, false).await else { return };
    let (leader, epoch) = cluster.leader(None).await;
    let follower = (leader + 1) % 3;
    cluster.agents.pin(&cluster.replica(follower).url());
    let standby = cluster
        .replica(leader)
        .until("the standby relayed by the follower to connect", WAIT, async || {
            let page = cluster.replica(leader).get("/v1/sandboxes?state=standby").await;
            let connected = metric(cluster.replica(follower), "standby_relayed_sockets").await? == 1;
            (connected && page["sandboxes"][0]["connected"] == true).then(|| page["sandboxes"][0]["id"].clone())
        })
        .await;

    cluster.replica(leader).crash().await;
    cluster.replicas[leader] = None;
    let (next, next_epoch) = cluster.leader(Some(leader)).await;
    assert!(next_epoch > epoch, "r{next} leads at epoch {next_epoch} after r{leader} at {epoch}");
    cluster
        .replica(follower)
        .until("the follower to re-dial the new leader", WAIT, async || {
            (metric(cluster.replica(follower), "standby_relay_redials_total").await? >= 1).then_some(())
        })
        .await;

    let marker = "after-failover";
    let id = cluster.submit(follower, marker, &cluster.run_body(marker)).await;
    let runs = cluster.finished(std::slice::from_ref(&id)).await;
    cluster.assert_once(&BTreeMap::from([(marker.to_owned(), id)]), &runs).await;
    let attempt = &runs[0]["attempts"][0];
    assert_eq!((&attempt["sandbox_id"], attempt["path"].as_str()), (&standby, Some("warm")), "{}", runs[0]);
    let output = cluster.agents.first_output().expect("the agent");
    // One standby connection (the run's credential then opens its own).
    let standby_connections = output.matches("control socket connected credential=Standby").count();
    assert_eq!(standby_connections, 1, "one standby control connection: {output}");
}

/// A leader paused past its lease (SIGSTOP: its socket still accepts, the
/// kernel buffers what arrives) wakes up after another took over: the
/// submit it was sent meanwhile is neither committed nor answered `201`,
/// and it exits with the deposed code.
#[tokio::test]
async fn a_paused_leader_woken_after_a_takeover_commits_and_sends_nothing_and_exits_deposed() {
    let Some(mut cluster) = Cluster::start("paused_leader", 2).await else { return };
    let (leader, epoch) = cluster.leader(None).await;
    // A run before the pause: the agents are connected and ready.
    let mut markers = BTreeMap::new();
    let id = cluster.submit(leader, "before", &cluster.run_body("before")).await;
    markers.insert("before".to_owned(), id);
    cluster.finished(&markers.values().cloned().collect::<Vec<_>>()).await;

    let paused = cluster.replicas[leader].take().expect("the leader");
    kill(Pid::from_raw(paused.pid()), Signal::SIGSTOP).expect("SIGSTOP");
    let (next, next_epoch) = cluster.leader(Some(leader)).await;
    assert!(next_epoch > epoch);
    // The paused leader's kernel accepts this and buffers it.
    let body = cluster.run_body("while-paused");
    let url = format!("{}/v1/runs", paused.url());
    let sent = tokio::spawn(async move {
        let response = reqwest::Client::new()
            .post(url)
            .bearer_auth(API_KEY)
            .json(&body)
            .timeout(Duration::from_secs(60))
            .send()
            .await;
        response.map(|response| response.status().as_u16())
    });
    // Give the request time to reach the paused process's socket buffer:
    // no event can tell that it arrived in a stopped process.
    tokio::time::sleep(Duration::from_millis(500)).await;
    kill(Pid::from_raw(paused.pid()), Signal::SIGCONT).expect("SIGCONT");
    let status = paused.exited(WAIT).await;
    assert_eq!(status.code(), Some(DEPOSED), "the woken leader exits deposed: {status}");
    let answer = sent.await.expect("no panic");
    assert!(!matches!(answer, Ok(201)), "the paused leader accepted a run: {answer:?}");
    let committed = cluster.schema.query_text("SELECT id FROM runs WHERE doc LIKE '%while-paused%'");
    assert!(committed.is_empty(), "the paused leader committed {committed:?}");

    // The new leader carries on: a run through it starts once.
    let id = cluster.submit(next, "after", &cluster.run_body("after")).await;
    markers.insert("after".to_owned(), id);
    let runs = cluster.finished(&markers.values().cloned().collect::<Vec<_>>()).await;
    cluster.assert_once(&markers, &runs).await;
}

/// Findings 13, 14 and 15 of issue 25: a leader frozen (SIGSTOP) inside
/// one of its write transactions, which holds the lease row `FOR SHARE`.
/// The test makes the leader's write wait on a lock of its own, freezes
/// the leader, then lets the write through: the leader's session sits idle
/// in its transaction, as a leader frozen mid-transaction leaves it. The
/// database ends that transaction (the leader's bounds), so a follower
/// takes over within the TTL plus a claim period (before: claims queued on
/// the lock as long as the leader stayed frozen, and pooled connections
/// with them); the followers answer `GET /v1/cluster` throughout; and the
/// woken leader commits nothing of the submit it was making.
#[tokio::test]
async fn a_leader_frozen_inside_a_write_transaction_is_replaced_within_the_ttl_and_commits_nothing() {
    let Some(mut cluster) = Cluster::start("frozen_in_transaction", 1).await else { return };
    let (leader, epoch) = cluster.leader(None).await;
    let schema = cluster.schema.name().to_owned();
    let held = cluster.schema.hold("LOCK TABLE runs IN SHARE MODE");
    let body = cluster.run_body("frozen");
    let url = format!("{}/v1/runs", cluster.replica(leader).url());
    let submit = tokio::spawn(async move {
        let request = reqwest::Client::new().post(url).bearer_auth(API_KEY).json(&body);
        request.timeout(Duration::from_secs(60)).send().await.map(|response| response.status().as_u16())
    });
    // The leader's write waits on the test's lock, holding the lease row.
    let waiting = format!(
        "SELECT l.pid::text FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
         WHERE c.relname = 'runs' AND c.relnamespace = '{schema}'::regnamespace AND NOT l.granted"
    );
    cluster
        .replica(leader)
        .until("the leader's write to wait on the lock", WAIT, async || {
            (!cluster.schema.query_text(&waiting).is_empty()).then_some(())
        })
        .await;
    let frozen = cluster.replicas[leader].take().expect("the leader");
    kill(Pid::from_raw(frozen.pid()), Signal::SIGSTOP).expect("SIGSTOP");
    let stopped = std::time::Instant::now();
    drop(held);
    // The frozen leader's session now sits idle in its transaction,
    // holding the lease row (until the database ends it).
    let idle_holding = format!(
        "SELECT a.state FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
         JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE c.relname = 'cluster_lease' AND c.relnamespace = '{schema}'::regnamespace AND l.granted
           AND a.state = 'idle in transaction'"
    );
    cluster
        .replica((leader + 1) % 3)
        .until("the frozen leader's session to sit idle holding the lease row", WAIT, async || {
            (!cluster.schema.query_text(&idle_holding).is_empty()).then_some(())
        })
        .await;

    let followers: Vec<usize> = cluster.live().map(|(index, _)| index).collect();
    let took_over = 'polls: loop {
        for &index in &followers {
            let asked = cluster.replica(index).try_call(reqwest::Method::GET, "/v1/cluster", Some(API_KEY), None);
            let answer = tokio::time::timeout(Duration::from_secs(2), asked).await;
            let Ok(Some((200, view))) = answer else {
                panic!("r{index} did not answer GET /v1/cluster within 2 s: {answer:?}");
            };
            if view["role"] == "leader" && view["epoch"].as_u64() > Some(epoch) {
                break 'polls stopped.elapsed();
            }
        }
        assert!(stopped.elapsed() < Duration::from_secs(20), "no replica leads 20 s after the leader froze");
        // Polled: the test watches from outside, as an operator would.
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("a leader frozen inside a write transaction: a follower led {took_over:?} after the SIGSTOP");
    // TTL 3 s: the lease runs out at most a TTL after the last renew, and
    // a follower claims every third of it.
    assert!(took_over < Duration::from_secs(5), "a follower led only {took_over:?} after the SIGSTOP");

    kill(Pid::from_raw(frozen.pid()), Signal::SIGCONT).expect("SIGCONT");
    let status = frozen.exited(WAIT).await;
    assert!(!status.success(), "the woken leader exits: {status}");
    let answer = submit.await.expect("no panic");
    assert!(!matches!(answer, Ok(201)), "the frozen leader accepted a run: {answer:?}");
    let committed = cluster.schema.query_text("SELECT id FROM runs WHERE doc LIKE '%frozen%'");
    assert!(committed.is_empty(), "the woken leader committed {committed:?}");
}

/// The epoch fence on its own: the lease moves to another holder (as a
/// takeover by a replica whose clock ran ahead would) while the leader runs
/// and its own lease has not lapsed by its clock. Its next write, a submit,
/// fails on the epoch: no `201`, nothing committed, and it exits deposed.
#[tokio::test]
async fn a_leader_whose_epoch_moved_on_commits_nothing_and_exits_deposed() {
    let Some(mut cluster) = Cluster::start("epoch_moved", 1).await else { return };
    let (leader, _) = cluster.leader(None).await;
    cluster.schema.execute(
        "UPDATE cluster_lease SET epoch = epoch + 1, holder = 'intruder', holder_url = 'http://127.0.0.1:9', \
         expires_at = now() + interval '1 hour'",
    );
    // The fenced leader may exit before it answers: no answer is no 201.
    let answer = cluster
        .replica(leader)
        .try_call(reqwest::Method::POST, "/v1/runs", Some(API_KEY), Some(&cluster.run_body("fenced")))
        .await;
    assert!(!matches!(answer, Some((201, _))), "a leader at an old epoch accepted a run: {answer:?}");
    let deposed = cluster.replicas[leader].take().expect("the leader");
    let exit = deposed.exited(WAIT).await;
    assert_eq!(exit.code(), Some(DEPOSED), "the fenced leader exits deposed: {exit}");
    let committed = cluster.schema.query_text("SELECT id FROM runs WHERE doc LIKE '%fenced%'");
    assert!(committed.is_empty(), "the fenced leader committed {committed:?}");
}

/// The failover benchmark (`scripts/bench-replicas`, not a test: ignored
/// by default): ten times, SIGKILL the leader with a standby ready, submit
/// at once through a survivor, and measure from the kill to the new
/// leader's dispatch of that run (its `assignment_sent`, by the server's
/// clock on this machine); the killed replica is restarted each round.
#[tokio::test]
#[ignore = "a benchmark: scripts/bench-replicas"]
async fn bench_failover_from_a_leader_kill_to_the_next_dispatch() {
    let Some(mut cluster) = Cluster::start("bench_failover", 2).await else { return };
    let rounds: usize = std::env::var("BENCH_ROUNDS").ok().and_then(|n| n.parse().ok()).unwrap_or(10);
    let mut times = Vec::new();
    for round in 0..rounds {
        let (leader, _) = cluster.leader(None).await;
        let (_, any) = cluster.live().next().expect("a live replica");
        any.until("a ready standby", WAIT, async || {
            let sandboxes = cluster.replica(leader).get("/v1/sandboxes").await;
            let ready = sandboxes["sandboxes"].as_array()?.iter().any(|sandbox| sandbox["candidate"] == true);
            ready.then_some(())
        })
        .await;
        let killed_at = std::time::SystemTime::now();
        cluster.replica(leader).crash().await;
        cluster.replicas[leader] = None;
        let marker = format!("failover-{round}");
        let id = cluster.submit((leader + 1) % 3, &marker, &cluster.run_body(&marker)).await;
        let run = cluster.finished(std::slice::from_ref(&id)).await.remove(0);
        let sent = run["timestamps"]["assignment_sent"].as_str().expect("dispatched");
        let sent = humantime::parse_rfc3339(sent).expect("an RFC 3339 time");
        times.push(sent.duration_since(killed_at).unwrap_or_default());
        cluster.replicas[leader] = Some(cluster.builders[leader].start().await);
    }
    times.sort();
    let median = times[times.len() / 2];
    let max = times[times.len() - 1];
    eprintln!(
        "failover (leader SIGKILL → first dispatch by the new leader), lease TTL {LEASE_TTL}, {rounds} rounds: \
         p50 {median:?}, max {max:?}; all: {times:?}"
    );
}
