//! `standby-server demo --provider docker` end to end: the real binary on
//! the sandbox image built with the `standby` under test, on a network of
//! the test's own. It must show warm, cold, Tier 2 and Tier 1 on
//! containers and leave no container and no network behind. Under
//! `CI=true` it fails when no engine answers; elsewhere it is skipped,
//! loudly.

use std::hash::{BuildHasher, RandomState};
use std::process::Stdio;
use std::time::Duration;

use standby_e2e::docker;
use standby_e2e::harness::standby_bin;
use standby_e2e::server_process::server_bin;

#[tokio::test]
async fn the_demo_on_docker_shows_every_path_on_containers_and_removes_them() {
    if !docker::available("demo on docker") {
        return;
    }
    let network = format!("standby-demo-e2e-{:08x}", RandomState::new().hash_one(std::process::id()) as u32);
    let output = tokio::process::Command::new(server_bin())
        .args([
            "demo",
            "--provider",
            "docker",
            "--image",
            &docker::image(),
            "--docker-network",
            &network,
            "--agent-bin",
        ])
        .arg(standby_bin())
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output =
        tokio::time::timeout(Duration::from_secs(240), output).await.expect("the demo ends").expect("run the demo");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let path_of = |line: &str| line.split_whitespace().nth(1).map(str::to_owned);
    let runs: Vec<String> = stdout.lines().filter(|line| line.starts_with("exe_")).filter_map(path_of).collect();
    assert!(runs.iter().any(|path| path == "warm"), "{stdout}");
    assert!(runs.iter().any(|path| path == "cold"), "{stdout}");
    assert!(stdout.lines().any(|line| line.starts_with("cold / warm: ")), "the demo prints the ratio: {stdout}");
    let follow_ups: Vec<String> = stdout.lines().filter(|line| line.starts_with("1 ")).filter_map(path_of).collect();
    assert_eq!(follow_ups, ["parked_running", "parked_stopped"], "{stdout}");
    let left = docker::docker(&["ps", "-aq", "--filter", &format!("network={network}")]).unwrap_or_default();
    assert!(left.is_empty(), "the demo left containers on its network: {left}");
    let networks = docker::docker(&["network", "ls", "-q", "--filter", &format!("name=^{network}$")]);
    assert_eq!(networks.as_deref(), Some(""), "the demo removed the network it made");
}
