//! Per-run bounds of the real `standby-server` with real `standby` agents:
//! a run that prints past the server's log cap goes on and exits 0, and
//! its stored log ends with a line naming how many bytes were dropped.
//!
//! Needs both binaries built (`cargo build --bins`).

use std::hash::{BuildHasher, RandomState};
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::json;
use standby_e2e::harness::write_json;
use standby_e2e::server_process::{API_KEY, ServerBuilder};

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_run_printing_past_the_log_cap_goes_on_and_its_log_ends_with_the_marker() {
    let dir = tempfile::Builder::new().prefix("standby-bounds-e2e-").tempdir().expect("a temp dir");
    let spec = dir.path().join("spec.json");
    write_json(&spec, &json!({"workspace": {"repos": [], "setup": []}, "shell": ["/bin/sh"]}));
    let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir.path())));
    let server = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark)
        .args(&["--pool-size", "1", "--heartbeat-interval", "1s", "--linger", "3s", "--stop-grace", "5s"])
        .args(&["--log-cap", "64KiB", "--spec", &spec.display().to_string()])
        .start()
        .await;
    // 300 KB of output, then a last line the cap keeps out of the store.
    let script = "head -c 300000 /dev/zero | tr '\\0' x; echo; echo the-end";
    let run_id = server.submit(&json!({"command": ["sh", "-c", script]})).await;
    let run = server.finished(&run_id, WAIT).await;
    assert_eq!((run["state"].as_str(), run["exit_code"].as_i64()), (Some("exited"), Some(0)), "{run}");

    let response = reqwest::Client::new()
        .get(format!("{}/v1/runs/{run_id}/log", server.url()))
        .bearer_auth(API_KEY)
        .send()
        .await
        .expect("the server answers");
    assert_eq!(response.status().as_u16(), 200);
    let received: u64 = response.headers()["standby-log-received"].to_str().expect("text").parse().expect("a count");
    let log = String::from_utf8(response.bytes().await.expect("the log").to_vec()).expect("text");
    assert!(received > 300_000, "every byte was acknowledged: {received}");
    let (kept, marker) = log.split_at(64 * 1024);
    assert!(kept.bytes().all(|b| b == b'x'), "the first 64 KiB are stored");
    let dropped = received - 64 * 1024;
    assert_eq!(
        marker,
        format!("\n[standby: the log reached its cap: {dropped} more bytes of output were dropped]\n"),
        "the log ends with the marker"
    );
    assert!(!log.contains("the-end"));
    let (part, _) = log.split_at(10);
    let range = reqwest::Client::new()
        .get(format!("{}/v1/runs/{run_id}/log?offset=5&limit=5", server.url()))
        .bearer_auth(API_KEY)
        .send()
        .await
        .expect("the server answers");
    assert_eq!(range.text().await.expect("text"), part[5..]);
    server.stop_leaving_nothing(Signal::SIGTERM).await;
}
