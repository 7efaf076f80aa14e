//! The soak in Docker mode: the real `standby-server --provider docker` on a
//! network this test creates, a stream of runs, and the faults a real
//! engine and network make, injected through the engine (the `docker` CLI,
//! from the test only; the server never shells out):
//!
//! - a container killed (`docker kill`: its PID 1 and every agent die);
//! - a container frozen for longer than the silence limit, then thawed:
//!   every process in it but its PID 1 and a `runc init` stopped
//!   (`SIGSTOP`, sent from a `docker exec`), then continued: its agent
//!   comes back late. A `runc init` is an exec on its way in (the server
//!   launching an agent); stopped, it holds that exec and every later
//!   Engine call on the container, as a pause does (seen here: the freeze's
//!   own exec, the thaw and the server's stop hung). Not
//!   `docker pause`: on this Engine (docker.io 20.10.24) an exec into a
//!   container the cgroup freezer holds never returns, and the unpause
//!   then waits behind it, so the server's agent launch racing a pause
//!   hung that container's every Engine call (seen here: a local CI run
//!   hung until the stuck `runc exec` was killed);
//! - a container cut from its network (`docker network disconnect`), then
//!   connected again;
//! - the server SIGKILLed and restarted on the same store: it adopts its
//!   containers and their agents reconnect.
//!
//! The invariants are the local soak's (`soak_shared`): no run lost, none
//! run twice, no sandbox with two runs, every finished log complete, every
//! fenced attempt's credential revoked; and after a clean stop no
//! container of the server still runs. Each run's command reports its
//! marker line over TCP to the test (at the network's gateway: the
//! containers see no host path) before it does anything else, and fails
//! when it cannot. Under `CI=true` the test fails when no engine answers.
//! `STANDBY_SOAK_SEED` replays a run's random choices.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use standby_e2e::docker::{self, Cleanup};
use standby_e2e::harness::write_json;
use standby_e2e::proxy::{Rng, seed_from_env};
use standby_e2e::server_process::{API_KEY, ServerBuilder, free_fixed_port, wait_bindable};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

mod soak_shared;
use soak_shared::{
    Current, Journal, SeedGuard, check_credentials, check_runs, current, lock, maybe_cancel, outcomes, settle,
    sqlite_credentials, watcher,
};

/// Runs submitted, over how long, and how many faults of each kind: sized
/// for CI (about a minute on two shared cores).
const RUNS: usize = 36;
const SUBMIT_OVER: Duration = Duration::from_secs(30);
const RESTARTS: usize = 2;
/// Faults injected in turn: kill, freeze, disconnect.
const FAULTS: [&str; 3] = ["kill", "freeze", "disconnect"];
const FAULT_BUDGET: usize = 12;
const HEARTBEAT: Duration = Duration::from_millis(300);
/// How long a container stays frozen or disconnected: past the silence
/// limit (three heartbeat intervals).
const HOLD: Duration = Duration::from_millis(2500);
const SETTLE: Duration = Duration::from_secs(60);
const LINES: usize = 12;
const CANCEL_CHANCE: f64 = 0.05;

/// The freeze, run by bash in the container: SIGSTOP to each process
/// listed in its `/proc` but PID 1, the shell itself and a `runc init`
/// (named `runc:[2:INIT]` until it execs). A process that started after
/// the listing is left running.
const FREEZE: &str = r#"for p in /proc/[0-9]*; do
  n=${p#/proc/}
  if [ "$n" = 1 ] || [ "$n" = $$ ]; then continue; fi
  { read -r name < "$p/comm"; } 2>/dev/null || continue
  case "$name" in runc*) continue ;; esac
  kill -STOP "$n" 2>/dev/null
done
true"#;

/// How long one docker CLI call of the injector may take: an Engine that
/// does not answer must not hold the soak past its harness bound.
const CLI_BOUND: Duration = Duration::from_secs(30);

/// A docker CLI call; its stdout when it worked within [`CLI_BOUND`]. One
/// that did not is killed, named on stderr and counted as not done.
async fn docker_cli(args: Vec<String>) -> Option<String> {
    let mut command = tokio::process::Command::new("docker");
    command.args(&args).kill_on_drop(true).stdin(std::process::Stdio::null());
    match tokio::time::timeout(CLI_BOUND, command.output()).await {
        Ok(Ok(output)) if output.status.success() => Some(String::from_utf8_lossy(&output.stdout).trim().to_owned()),
        Ok(_) => None,
        Err(_) => {
            eprintln!("soak-docker: `docker {}` did not return in {CLI_BOUND:?}: killed", args.join(" "));
            None
        }
    }
}

/// Accepts the runs' marker lines: one line per connection, kept, then
/// answered `ok` (the run goes on only once its line is recorded). Each
/// line starts with its execution's nonce: a line sent again because the
/// answer was lost in a network cut is kept once, while a second execution
/// (another nonce) is kept again and seen.
async fn marker_server(listener: tokio::net::TcpListener, markers: Arc<Mutex<String>>) {
    let nonces: Arc<Mutex<HashSet<String>>> = Arc::default();
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let (markers, nonces) = (Arc::clone(&markers), Arc::clone(&nonces));
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            if BufReader::new(read).read_line(&mut line).await.is_ok() && line.ends_with('\n') {
                let (nonce, marker) = line.split_once(' ').unwrap_or(("", line.as_str()));
                if lock(&nonces).insert(nonce.to_owned()) {
                    lock(&markers).push_str(marker);
                }
                let _ = write.write_all(b"ok\n").await;
            }
        });
    }
}

/// The run's command: its marker line to `marker` (`host:port`) first,
/// sent again (same nonce) until answered, for a network cut can take the
/// line or its answer; then `LINES` numbered lines with a pause of a
/// second in the middle (so that faults find runs in flight).
fn run_command(host: &str, port: u16) -> Vec<String> {
    let script = format!(
        "n=\"$$-$RANDOM$RANDOM\"; ok=; for try in $(seq 30); do \
         if ( exec 3<>/dev/tcp/{host}/{port} && echo \"$n $SOAK_RUN $STANDBY_EXECUTION_ID $HOSTNAME\" >&3 \
         && read -r -t 5 ack <&3 ) 2>/dev/null; then ok=1; break; fi; sleep 1; done; [ -n \"$ok\" ] || exit 3; \
         i=1; while [ $i -le {LINES} ]; do \
         echo \"soak $SOAK_RUN line $i\"; if [ $i -eq {half} ]; then sleep 1; fi; i=$((i+1)); done",
        half = LINES / 2
    );
    vec!["bash".into(), "-c".into(), script]
}

/// Injects one fault after another (kill, freeze, disconnect in turn) into
/// a random container of the server's: one with a run when there is one
/// (three times in four), else a standby.
async fn injector(server: Current, network: String, journal: Arc<Mutex<Journal>>, mut rng: Rng, stop: Arc<AtomicBool>) {
    let mut injected = 0;
    while injected < FAULT_BUDGET && !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(rng.duration(Duration::from_millis(500), Duration::from_millis(2000))).await;
        let Some(server) = current(&server) else { continue };
        let Some((200, sandboxes)) = server.try_call(reqwest::Method::GET, "/v1/sandboxes", Some(API_KEY), None).await
        else {
            continue;
        };
        let of = |state: &str| -> Vec<String> {
            let sandboxes = sandboxes["sandboxes"].as_array().into_iter().flatten();
            let chosen = sandboxes.filter(|sandbox| sandbox["state"] == state);
            chosen.filter_map(|sandbox| sandbox["id"].as_str().map(|id| format!("standby-{id}"))).collect()
        };
        let (assigned, standbys) = (of("assigned"), of("standby"));
        let targets =
            if !assigned.is_empty() && (standbys.is_empty() || rng.below(4) != 0) { assigned } else { standbys };
        if targets.is_empty() {
            continue;
        }
        let container = targets[rng.below(targets.len() as u64) as usize].clone();
        let kind = FAULTS[injected % FAULTS.len()];
        let cli = |args: &[&str]| docker_cli(args.iter().map(|arg| (*arg).to_owned()).collect());
        let done = match kind {
            "kill" => cli(&["kill", &container]).await.is_some(),
            "freeze" => {
                // Every process of the container but its PID 1, this
                // shell and a `runc init` (the module's doc).
                let frozen = cli(&["exec", &container, "bash", "-c", FREEZE]).await.is_some();
                if frozen {
                    tokio::time::sleep(HOLD).await;
                }
                // Also after a freeze that failed: one killed past its
                // bound may still take effect in the Engine.
                cli(&["exec", &container, "bash", "-c", "kill -CONT -1"]).await;
                frozen
            }
            _ => {
                let cut = cli(&["network", "disconnect", &network, &container]).await.is_some();
                if cut {
                    tokio::time::sleep(HOLD).await;
                }
                cli(&["network", "connect", &network, &container]).await;
                cut
            }
        };
        if done {
            injected += 1;
            *lock(&journal).faults.entry(kind).or_default() += 1;
        }
    }
}

/// Kills the server of the moment when dropped, before [`Cleanup`] removes
/// its containers (on a failure, tasks still hold the server, which would
/// make new ones after the cleanup).
struct KillOnDrop(Current);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(server) = lock(&self.0).take() {
            let _ = kill(Pid::from_raw(server.pid()), Signal::SIGKILL);
        }
    }
}

/// The server log's lines naming `sandbox`, each ending in a newline.
fn lines_naming(log: &std::path::Path, sandbox: &str) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines().filter(|line| line.contains(sandbox)).map(|line| format!("{line}\n")).collect()
}

/// The server log's lines naming a run of a violation or its sandboxes.
fn lines_about(log: &std::path::Path, verdict: &soak_shared::Verdict) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut ids: Vec<String> = Vec::new();
    for problem in &verdict.problems {
        for id in problem.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("exe_")) {
            ids.push(id.to_owned());
            let attempts = verdict.runs.get(id).and_then(|run| run["attempts"].as_array().cloned()).unwrap_or_default();
            ids.extend(attempts.iter().filter_map(|a| a["sandbox_id"].as_str().map(str::to_owned)));
        }
    }
    let about = text.lines().filter(|line| ids.iter().any(|id| line.contains(id.as_str())));
    about.collect::<Vec<_>>().join("\n")
}

/// The soak in Docker mode. Run one seed again with `STANDBY_SOAK_SEED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_on_docker_with_killed_frozen_and_disconnected_containers_and_restarts_loses_nothing() {
    if !docker::available("soak-docker") {
        return;
    }
    let seed = seed_from_env("STANDBY_SOAK_SEED");
    let _guard = SeedGuard { var: "STANDBY_SOAK_SEED", seed };
    let mut rng = Rng::new(seed);
    let dir = tempfile::Builder::new().prefix("standby-soak-docker-").tempdir().expect("a temp dir");
    let spec = dir.path().join("spec.json");
    write_json(&spec, &json!({"workspace": {}, "shell": ["/bin/sh"]}));
    let data = dir.path().join("data");
    let network = format!("standby-soak-{:08x}-{}", seed >> 32, std::process::id());
    let cleanup = Cleanup { data: data.clone(), network: network.clone() };

    // The test's own network (inter-container traffic off, as the server
    // would make it); the markers come in at its gateway, opened to the
    // sandboxes by --sandbox-egress-allow.
    let label = format!("standby.e2e={network}");
    let icc_off = "com.docker.network.bridge.enable_icc=false";
    docker::docker(&["network", "create", "--label", &label, "-o", icc_off, &network]).expect("docker network create");
    let gateway = docker::docker(&["network", "inspect", "--format", "{{(index .IPAM.Config 0).Gateway}}", &network])
        .expect("the network's gateway");
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.expect("bind the marker listener");
    let marker_port = listener.local_addr().expect("an address").port();
    let markers = Arc::new(Mutex::new(String::new()));
    let marker_task = tokio::spawn(marker_server(listener, Arc::clone(&markers)));

    let listen = std::net::SocketAddr::from(([0, 0, 0, 0], free_fixed_port()));
    let heartbeat = format!("{}ms", HEARTBEAT.as_millis());
    let builder = ServerBuilder::new(&data, &dir.path().join("server.log"), &format!("soak-docker-{seed:016x}"))
        .listen(listen)
        .args(&["--provider", "docker", "--image", &docker::image(), "--docker-network", &network])
        .args(&["--sandbox-egress-allow", &format!("{gateway}:{marker_port}")])
        .args(&["--spec", &spec.display().to_string(), "--pool-size", "4", "--running-cap", "8"])
        .args(&["--heartbeat-interval", &heartbeat, "--max-attempts", "6", "--launch-timeout", "30s"])
        .args(&[
            "--linger",
            "2s",
            "--stop-grace",
            "2s",
            "--log",
            "debug,bollard=warn,hyper=info,tower_http=info",
            "--agent-log",
            "info",
        ]);
    // Each phase's time since the start goes to stderr: a slow machine's
    // log then shows where the time went.
    let began = std::time::Instant::now();
    let phase = |what: &str| eprintln!("soak-docker: [{:5.1} s] {what}", began.elapsed().as_secs_f64());
    let server: Current = Arc::new(Mutex::new(Some(Arc::new(builder.start().await))));
    phase("the server is up");
    let _kill = KillOnDrop(Arc::clone(&server));

    let journal = Arc::new(Mutex::new(Journal::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let injector = tokio::spawn(injector(
        Arc::clone(&server),
        network.clone(),
        Arc::clone(&journal),
        rng.fork(),
        Arc::clone(&stop),
    ));
    let watcher = tokio::spawn(watcher(Arc::clone(&server), Arc::clone(&journal), Arc::clone(&stop)));

    let gap = SUBMIT_OVER / RUNS as u32;
    let restart_at: Vec<usize> = (1..=RESTARTS).map(|k| k * RUNS / (RESTARTS + 1)).collect();
    let command = run_command(&gateway, marker_port);
    let mut cancels = tokio::task::JoinSet::new();
    for label in 0..RUNS {
        if restart_at.contains(&label) {
            let old = lock(&server).take().expect("a server");
            old.crash().await;
            drop(old);
            assert!(wait_bindable(listen, Duration::from_secs(30)).await, "port {listen} still taken after the crash");
            *lock(&server) = Some(Arc::new(builder.start().await));
            lock(&journal).restarts += 1;
            phase("the server was SIGKILLed and is up again");
        }
        let body = json!({"command": command, "env": {"SOAK_RUN": label.to_string()}});
        let id = current(&server).expect("a server").submit(&body).await;
        lock(&journal).submitted.push((label, id.clone()));
        maybe_cancel(&mut cancels, &server, &journal, &mut rng, (CANCEL_CHANCE, id));
        tokio::time::sleep(rng.duration(gap / 2, gap * 3 / 2)).await;
    }
    while cancels.join_next().await.is_some() {}
    phase("every run is submitted");

    let server_now = current(&server).expect("a server");
    let settled = settle(&server_now, &journal, SETTLE).await;
    stop.store(true, Ordering::Relaxed);
    let _ = injector.await;
    phase("the fault injector stopped");
    let _ = watcher.await;
    phase("the watcher stopped");

    // ---- invariants --------------------------------------------------------
    let journal = lock(&journal).clone();
    let marker_lines = lock(&markers).clone();
    let mut verdict = check_runs(&server_now, &journal, &settled, &marker_lines, LINES).await;
    drop(server_now);
    let final_server = lock(&server).take().expect("a server");
    let final_server = Arc::try_unwrap(final_server).expect("no other holder of the server");
    phase("the runs are checked; stopping the server");
    let status = final_server.stop(Signal::SIGTERM).await;
    phase("the server stopped");
    assert!(status.success(), "standby-server exited {status} on SIGTERM");
    marker_task.abort();
    let requeues = check_credentials(&mut verdict, &sqlite_credentials(&data.join("standby.db")));
    // A clean stop leaves none of the server's containers running.
    let filter = format!("label=standby.instance={}", cleanup.instance());
    let running = docker::docker(&["ps", "-q", "--filter", &filter]).unwrap_or_default();
    let mut about_containers = String::new();
    for id in running.lines() {
        let format = "{{.Name}} {{index .Config.Labels \"standby.sandbox\"}} {{.State.Status}} paused={{.State.Paused}} \
                      created={{.Created}} started={{.State.StartedAt}}";
        let state = docker::docker(&["inspect", "--format", format, id]).unwrap_or_default();
        verdict.problems.push(format!("a container still running after the server stopped: {id} ({state})"));
        if let Some(sandbox) = state.split_whitespace().nth(1) {
            about_containers.push_str(&lines_naming(&dir.path().join("server.log"), sandbox));
        }
    }

    // A fault that always failed would leave the soak claiming it.
    for kind in FAULTS {
        if !journal.faults.contains_key(kind) {
            verdict.problems.push(format!("no `{kind}` fault was injected"));
        }
    }

    // ---- summary -----------------------------------------------------------
    let (by_state, attempts) = outcomes(&verdict);
    eprintln!(
        "soak-docker: seed {seed}, {} runs submitted, {attempts} attempts, {requeues} requeues",
        verdict.runs.len()
    );
    eprintln!("soak-docker: runs by state/path: {by_state:?}");
    eprintln!(
        "soak-docker: container faults: {:?}; cancels: {}; server restarts (SIGKILL): {}",
        journal.faults, journal.cancels, journal.restarts
    );
    eprintln!("soak-docker: marker lines: {}; invariant violations: {}", verdict.marker_lines, verdict.problems.len());
    assert!(
        verdict.problems.is_empty(),
        "{} invariant violations (seed {seed}):\n{}\n--- the server's lines about them ---\n{}\n{}",
        verdict.problems.len(),
        verdict.problems.join("\n"),
        lines_about(&dir.path().join("server.log"), &verdict),
        about_containers
    );
}
