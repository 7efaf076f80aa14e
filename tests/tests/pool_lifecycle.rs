//! The warm pool's lifecycle end to end: the real `standby-server` with its
//! local provider and real `standby` agents on real `file://` repositories.
//! Follow-up turns of a thread on a parked sandbox (Tier 1 stopped, Tier 2
//! running), a resume that cannot be done, the running cap under a burst,
//! and standby TTL replacement.
//!
//! Durations are short (`--provider-minute`, `--warm-idle`, `--standby-ttl`
//! in seconds) so that nothing waits for minutes. Needs both binaries built
//! (`cargo build --bins`); `STANDBY_SERVER_BIN` and `STANDBY_BIN` override
//! where they are looked for.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::ops::Deref;
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use standby_e2e::GitRepo;
use standby_e2e::harness::{process_alive, write_json};
use standby_e2e::provider_runs::sandbox_of;
use standby_e2e::server_process::{ServerBuilder, ServerProcess, environ_var, marked};

const WAIT: Duration = Duration::from_secs(60);
/// What the local provider marks each sandbox's processes with.
const SANDBOX_MARK: &str = "LOCAL_SANDBOX_ID";

/// The sandboxes that have a live process, from the processes themselves.
fn sandboxes_with_processes(mark: &str) -> BTreeSet<String> {
    marked(mark).into_iter().filter_map(|pid| environ_var(pid, SANDBOX_MARK)).collect()
}

fn repo() -> GitRepo {
    GitRepo::new(&[
        // Counts its runs: a resumed sandbox must not run it again.
        ("setup.sh", "echo run >> .setup-runs\necho built > built.txt\n"),
        ("README.md", "sample\n"),
    ])
}

fn repo_spec(repo: &GitRepo) -> Value {
    json!({
        "workspace": {
            "repos": [{"url": repo.url(), "path": "app", "ref": "main"}],
            "setup": [{"name": "build", "command": ["sh", "setup.sh"], "cwd": "app", "timeout_s": 60}]
        },
        "shell": ["/bin/sh"]
    })
}

/// Nothing to clone or set up: standbys are ready at once.
fn empty_spec() -> Value {
    json!({"workspace": {"repos": [], "setup": []}, "shell": ["/bin/sh"]})
}

/// A `standby-server` on a spec of the test's, with short defaults for
/// what the test does not set, in a directory that lives as long as it.
struct Server {
    process: ServerProcess,
    _dir: tempfile::TempDir,
}

impl Deref for Server {
    type Target = ServerProcess;

    fn deref(&self) -> &ServerProcess {
        &self.process
    }
}

impl Server {
    async fn start(spec: &Value, args: &[&str]) -> Self {
        let dir = tempfile::Builder::new().prefix("standby-pool-e2e-").tempdir().expect("a temp dir");
        let spec_path = dir.path().join("spec.json");
        write_json(&spec_path, spec);
        let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir.path())));
        let builder = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark).args(&[
            "--log",
            "debug",
            "--agent-log",
            "debug",
            "--spec",
            &spec_path.display().to_string(),
        ]);
        let defaults = [("--linger", "3s"), ("--stop-grace", "3s"), ("--heartbeat-interval", "200ms")];
        Self { process: builder.args_over_defaults(&defaults, args).start().await, _dir: dir }
    }

    async fn log(&self, id: &str) -> String {
        String::from_utf8_lossy(&self.process.log(id).await).into_owned()
    }

    async fn until<T>(&self, what: &str, check: impl AsyncFnMut() -> Option<T>) -> T {
        self.process.until(what, WAIT, check).await
    }

    /// Runs one turn of `thread` to its end; the run, which exited 0.
    async fn turn(&self, thread: &str, script: &str) -> Value {
        let id = self.submit(&json!({"command": ["sh", "-c", script], "cwd": "app", "thread_id": thread})).await;
        let run = self.finished(&id, WAIT).await;
        assert_eq!(
            (run["state"].as_str(), run["exit_code"].as_i64()),
            (Some("exited"), Some(0)),
            "{run}\n{}",
            self.logs()
        );
        run
    }

    async fn stop(self) {
        self.process.stop_leaving_nothing(Signal::SIGTERM).await;
    }
}

fn count(text: &str, needle: &str) -> usize {
    text.matches(needle).count()
}

fn provider_settings(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("sandbox.json")).expect("sandbox.json")).expect("JSON")
}

#[tokio::test]
async fn tier_1_a_follow_up_resumes_the_stopped_sandbox_which_skips_preparation() {
    let repo = repo();
    let server = Server::start(&repo_spec(&repo), &["--pool-size", "0", "--warm-idle", "0s"]).await;
    let first = server.turn("chat-1", "echo note-from-turn-1 > note.txt").await;
    let sandbox_id = sandbox_of(&first);
    let parked = server.parked(&sandbox_id, "stopped").await;
    assert!(parked["pid"].is_null(), "{parked}");
    assert_eq!(parked["thread_id"], "chat-1");
    // Stopped: no process of the sandbox is left; its files are.
    let alive = sandboxes_with_processes(server.mark());
    assert!(!alive.contains(&sandbox_id), "processes of {sandbox_id} are left: {alive:?}");
    let dir = server.sandbox_dir(&sandbox_id);
    assert!(dir.join("workspace/app/note.txt").is_file());

    let second = server.turn("chat-1", "cat note.txt; echo setup-runs=$(wc -l < .setup-runs)").await;
    assert_eq!(second["path"], "parked_stopped", "{second}");
    assert_eq!(sandbox_of(&second), sandbox_id, "the same sandbox");
    assert_eq!(second["attempts"].as_array().map(Vec::len), Some(1));
    let resume = &second["resume"];
    assert_eq!((resume["from"].as_str(), resume["fallback"].is_null()), (Some("stopped"), true), "{second}");
    assert!(resume["ready_at"].is_string(), "bound once its agent was ready: {second}");
    let log = server.log(second["id"].as_str().expect("an id")).await;
    assert!(log.contains("note-from-turn-1"), "the previous turn's file: {log}");
    assert!(log.contains("setup-runs=1"), "setup ran once: {log}");
    let agent_log = std::fs::read_to_string(dir.join("agent.log")).expect("the agent log");
    assert_eq!(count(&agent_log, "clone and setup are skipped"), 1, "the resumed agent skipped preparation");
    let pointer = server.get("/v1/threads/chat-1").await;
    assert_eq!(pointer["sandbox_id"], sandbox_id.as_str());
    assert!(pointer["generation"].as_u64().is_some_and(|g| g >= 4), "{pointer}");
    server.stop().await;
}

#[tokio::test]
async fn tier_2_a_follow_up_in_the_warm_window_takes_the_running_sandbox_without_a_stop() {
    let repo = repo();
    // A provider auto-stop of one (half-second) minute would stop the kept
    // sandbox inside its 30 s window: the floor raises it above the window.
    let args = ["--pool-size", "0", "--warm-idle", "30s", "--auto-stop", "1", "--provider-minute", "500ms"];
    let server = Server::start(&repo_spec(&repo), &args).await;
    let first = server.turn("chat-2", "echo note-from-turn-1 > note.txt").await;
    let sandbox_id = sandbox_of(&first);
    let parked = server.parked(&sandbox_id, "running").await;
    let pid = parked["pid"].as_i64().and_then(|pid| i32::try_from(pid).ok()).expect("a fresh agent");
    // ceil(30 s / 0.5 s) + 5 provider minutes, in the provider's own settings.
    let dir = server.sandbox_dir(&sandbox_id);
    assert_eq!(provider_settings(&dir)["auto_stop_minutes"], 65);
    // Past several configured auto-stop periods the parked agent still runs.
    // (Asserting that something does not happen takes waiting.)
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(process_alive(pid), "the kept sandbox was stopped inside its warm window\n{}", server.logs());

    let second = server.turn("chat-2", "cat note.txt").await;
    assert_eq!(second["path"], "parked_running", "{second}");
    assert_eq!(sandbox_of(&second), sandbox_id);
    assert_eq!(second["resume"]["from"], "running");
    let log = server.log(second["id"].as_str().expect("an id")).await;
    assert!(log.contains("note-from-turn-1"), "{log}");
    let server_log = std::fs::read_to_string(server.log_path()).expect("the server log");
    let stopped = server_log.lines().any(|line| line.contains("parked sandbox stopped") && line.contains(&sandbox_id));
    assert!(!stopped, "no stop between the turns");
    // The turn ran in the kept agent: after it a fresh agent is started
    // again. Once that one is ready, each of the two fresh agents skipped
    // preparation and only the first turn's cold agent cloned.
    server
        .until("a third agent in the kept sandbox", async || {
            let sandbox = server.sandbox(&sandbox_id).await;
            let fresh = sandbox["pid"].as_i64().is_some_and(|other| other != i64::from(pid));
            (sandbox["park"]["mode"] == "running" && sandbox["last_state"] == "ready" && fresh).then_some(())
        })
        .await;
    let agent_log = std::fs::read_to_string(dir.join("agent.log")).expect("the agent log");
    assert_eq!(count(&agent_log, "clone and setup are skipped"), 2, "{agent_log}");
    assert_eq!(count(&agent_log, "cloning "), 1, "{agent_log}");
    server.stop().await;
}

#[tokio::test]
async fn a_resume_of_a_deleted_sandbox_falls_back_to_cold_and_the_run_goes_on() {
    let repo = repo();
    let server = Server::start(&repo_spec(&repo), &["--pool-size", "0", "--warm-idle", "0s"]).await;
    let first = server.turn("chat-3", "echo note > note.txt").await;
    let sandbox_id = sandbox_of(&first);
    server.parked(&sandbox_id, "stopped").await;
    delete_behind_the_servers_back(&server.sandbox_dir(&sandbox_id));

    let second = server.turn("chat-3", "test ! -e note.txt && echo fresh").await;
    assert_eq!(second["path"], "cold", "{second}");
    assert_ne!(sandbox_of(&second), sandbox_id);
    let fallback = second["resume"]["fallback"].as_str().unwrap_or_default();
    assert!(fallback.contains("no longer exists"), "the reason is recorded: {second}");
    let old = server.sandbox(&sandbox_id).await;
    assert_eq!(old["state"], "retired", "{old}");
    // The thread goes on from the new sandbox.
    let pointer = server.get("/v1/threads/chat-3").await;
    assert_eq!(pointer["sandbox_id"], sandbox_of(&second).as_str());
    server.stop().await;
}

/// Deletes a parked sandbox's directory. The provider may still be
/// finishing its own write into it (its record, through a temporary file)
/// when the API already shows the sandbox parked: a removal that meets a
/// file created meanwhile is tried again, a bounded number of times.
fn delete_behind_the_servers_back(dir: &std::path::Path) {
    for _ in 0..100 {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => return,
            Err(error) if error.kind() == std::io::ErrorKind::DirectoryNotEmpty => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(error) => panic!("delete {}: {error}", dir.display()),
        }
    }
    panic!("{} kept being written to", dir.display());
}

#[tokio::test]
async fn a_burst_of_50_submissions_never_exceeds_the_running_cap_and_every_run_completes() {
    const CAP: usize = 3;
    let args = ["--pool-size", "1", "--running-cap", "3", "--warm-idle", "0s", "--linger", "1s"];
    let server = Server::start(&empty_spec(), &args).await;
    let sampling = tokio::sync::watch::channel(true);
    let (stop_sampling, mut sampling_on) = sampling;
    let mark = server.mark().to_owned();
    // Samples the processes themselves, throughout.
    let sampler = tokio::task::spawn_blocking(move || {
        let mut samples = 0usize;
        let mut most = 0usize;
        while *sampling_on.borrow_and_update() {
            let alive = sandboxes_with_processes(&mark);
            assert!(alive.len() <= CAP, "{} sandboxes have processes: {alive:?}", alive.len());
            most = most.max(alive.len());
            samples += 1;
            std::thread::sleep(Duration::from_millis(10));
        }
        (samples, most)
    });
    let mut ids = Vec::new();
    for _ in 0..50 {
        ids.push(server.submit(&json!({"command": ["true"]})).await);
    }
    let waiting = server.run(ids.last().expect("a run")).await;
    if waiting["state"] == "waiting" {
        let reason = waiting["wait"]["reason"].as_str().unwrap_or_default();
        assert!(reason.contains("running cap of 3"), "the wait is visible: {waiting}");
    }
    let mut most_running = 0;
    for id in &ids {
        let run = server
            .until("the run to finish", async || {
                let sandboxes = server.sandboxes().await;
                let running = sandboxes.iter().filter(|s| s["running"] == true).count();
                assert!(running <= CAP, "the server counts {running} running sandboxes");
                most_running = most_running.max(running);
                let run = server.run(id).await;
                matches!(run["state"].as_str(), Some("exited" | "failed" | "cancelled")).then_some(run)
            })
            .await;
        assert_eq!((run["state"].as_str(), run["exit_code"].as_i64()), (Some("exited"), Some(0)), "{run}");
    }
    let _ = stop_sampling.send(false);
    let (samples, most) = sampler.await.expect("the sampler");
    assert!(samples > 10 && most >= 2, "sampled {samples} times, at most {most} sandboxes with processes");
    let runs = server.get("/v1/runs").await;
    let waited =
        runs["runs"].as_array().into_iter().flatten().filter(|r| r["durations_ms"]["queued"].as_u64() > Some(0));
    assert!(waited.count() > 0, "some runs waited for a slot");
    server.stop().await;
}

#[tokio::test]
async fn ttl_replacement_keeps_min_ready_standbys_ready() {
    // Room for both replacements at once (the cap is min_ready + 2): two
    // standbys made together may expire close together.
    let args = ["--pool-size", "2", "--running-cap", "4", "--standby-ttl", "10s", "--heartbeat-interval", "500ms"];
    let server = Server::start(&empty_spec(), &args).await;
    let first: BTreeSet<String> = server
        .until("two ready standbys", async || {
            let ready: BTreeSet<String> = server
                .sandboxes()
                .await
                .iter()
                .filter(|s| s["candidate"] == true)
                .filter_map(|s| s["id"].as_str().map(str::to_owned))
                .collect();
            (ready.len() == 2).then_some(ready)
        })
        .await;
    // From now on, at every sample, two standbys are ready, until both
    // first standbys were replaced.
    let mut samples = 0;
    server
        .until("the first standbys replaced", async || {
            let sandboxes = server.sandboxes().await;
            let ready = sandboxes.iter().filter(|s| s["candidate"] == true).count();
            assert!(ready >= 2, "{ready} ready standbys: {sandboxes:#?}\n{}", server.logs());
            samples += 1;
            let replaced = sandboxes
                .iter()
                .filter(|s| first.contains(s["id"].as_str().unwrap_or_default()))
                .filter(|s| s["state"] == "retired")
                .map(|s| s["retire_reason"].as_str().unwrap_or_default().to_owned())
                .collect::<Vec<_>>();
            (replaced.len() == 2).then_some(replaced)
        })
        .await
        .iter()
        .for_each(|reason| assert_eq!(reason, "standby TTL: replaced"));
    assert!(samples > 20, "sampled {samples} times");
    server.stop().await;
}
