//! The Docker provider under gVisor (`--sandbox-runtime runsc`): each
//! sandbox container runs on gVisor's own kernel (its ptrace platform on
//! these machines), and the paths users wait on work there as under runc:
//! a warm run, a cold run, a Tier 1 resume. The isolation tests run under
//! it too (`docker_isolation.rs`). `.ci/run` installs Debian's `runsc` and
//! registers it with the Engine; under `CI=true` a missing runtime fails
//! the tests, elsewhere they are skipped, loudly.

use serde_json::json;
use standby_e2e::docker::{self, GVISOR, Server, inspect, sandbox_of};
use standby_e2e::server_process::ServerBuilder;

#[tokio::test]
async fn under_gvisor_a_warm_run_a_cold_run_and_a_tier_1_resume_work() {
    if !docker::gvisor_available("gVisor: warm, cold, Tier 1") {
        return;
    }
    let args = ["--sandbox-runtime", GVISOR, "--pool-size", "1", "--warm-idle", "0s"];
    let server = Server::start_on(&docker::image(), &args).await;
    let standby = server.ready_standby().await;
    assert_eq!(inspect(&standby, "{{.HostConfig.Runtime}}").as_deref(), Some(GVISOR));

    // Warm: gVisor's kernel answers `uname` (the host's is another).
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("the host's kernel");
    let run = server.run_to_end(json!({"command": ["sh", "-c", "echo kernel=$(uname -r); id -u"]})).await;
    assert_eq!(run["path"], "warm", "{run}");
    assert_eq!(sandbox_of(&run), standby);
    let log = server.text_log(&run).await;
    assert!(log.contains("kernel=") && !log.contains(&format!("kernel={}", host_kernel.trim())), "{log}");
    assert!(log.contains("10001"), "{log}");

    // Cold: two at once while at most one standby is ready.
    let ids = [
        server.submit(&json!({"command": ["sh", "-c", "echo first"]})).await,
        server.submit(&json!({"command": ["sh", "-c", "echo second"]})).await,
    ];
    let mut paths = Vec::new();
    for id in &ids {
        let run = server.finished(id, docker::WAIT).await;
        assert_eq!((run["state"].as_str(), run["exit_code"].as_i64()), (Some("exited"), Some(0)), "{run}");
        paths.push(run["path"].as_str().unwrap_or_default().to_owned());
    }
    assert!(paths.iter().any(|path| path == "cold"), "a cold run among {paths:?}");

    // Tier 1: the thread's container stopped after its turn, started again
    // for the next.
    let first = server.turn("chat-gvisor", "echo note-from-turn-1 > note.txt").await;
    let sandbox_id = sandbox_of(&first);
    server.parked(&sandbox_id, "stopped").await;
    let second = server.turn("chat-gvisor", "cat note.txt").await;
    assert_eq!(second["path"], "parked_stopped", "{second}\n{}", server.agent_logs());
    assert_eq!(sandbox_of(&second), sandbox_id);
    let log = server.text_log(&second).await;
    assert!(log.contains("note-from-turn-1"), "{log}");
    assert_eq!(inspect(&sandbox_id, "{{.HostConfig.Runtime}}").as_deref(), Some(GVISOR));
    server.stop().await;
}

#[tokio::test]
async fn a_runtime_the_engine_does_not_know_is_refused_naming_the_ones_it_knows() {
    if !docker::available("an unknown runtime") {
        return;
    }
    let dir = tempfile::tempdir().expect("a temp dir");
    let network = format!("standby-e2e-runtime-{}", std::process::id());
    let _cleanup = docker::Cleanup { data: dir.path().join("data"), network: network.clone() };
    let builder = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("log"), "runtime")
        .listen(std::net::SocketAddr::from(([0, 0, 0, 0], 0)))
        .args(&["--provider", "docker", "--image", &docker::image(), "--docker-network", &network])
        .args(&["--sandbox-runtime", "no-such-runtime"]);
    let Err(error) = builder.try_start().await else { panic!("the server started with an unknown runtime") };
    assert!(
        error.contains("--sandbox-runtime `no-such-runtime` is not a runtime of the Docker Engine")
            && error.contains("runc"),
        "{error}"
    );
}
