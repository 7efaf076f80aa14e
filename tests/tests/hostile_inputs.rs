//! Inputs an attacker with a run credential can send, against the real
//! `standby-server` on both stores: none of them stops the server, and each
//! is refused naming its field.
//!
//! Needs `cargo build --bins`; the PostgreSQL cases need
//! `STANDBY_TEST_POSTGRES` (skipped loudly without it, failing under
//! `CI=true`).

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use standby_e2e::postgres::TestSchema;
use standby_e2e::spooled::{Spooled, next_assignment, spooled_on};
use standby_protocol::log_chunk::MAX_POSITION;
use standby_protocol::paths;

/// A chunk of `data` at `offset` after `dropped` bytes, as JSON text (the
/// numbers written out, as an attacker would, past what `i64` holds).
fn chunk(offset: u64, dropped: u64, data: &[u8]) -> String {
    let data = base64_encode(data);
    format!(r#"{{"offset":{offset},"dropped":{dropped},"data":"{data}"}}"#)
}

fn base64_encode(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

async fn post_log(spooled: &Spooled, id: &str, credential: &str, body: &str) -> (u16, Value) {
    spooled.agent_call(reqwest::Method::POST, &paths::log(id), credential, Some(body)).await
}

/// Issue 25, finding 1: two chunks at 2^63 were accepted, clamped by the
/// store to the same key, and the second stopped the engine (the server
/// exited 1), and every leader after it once it loaded the ledger. Now
/// both are refused `400` naming the field; a chunk ending exactly at the
/// largest position is kept and the one after it refused (the rule is
/// checked before the ledger is read, so a ledger a restart loads there
/// refuses it too); the server serves throughout.
async fn log_positions_past_the_store_are_refused_and_the_server_keeps_serving(store: Option<String>) {
    let spooled = spooled_on(store, 1, "10s").await;
    let token = spooled.tokens(1).await.remove(0);
    let mut standby = spooled.ready_standby(&token).await;
    let (id, credential) = spooled.assigned(&mut standby, &json!({"command": ["true"]})).await;
    let mut run_socket = spooled.server.upgrade(&credential).await.expect("the run credential connects");
    assert_eq!(next_assignment(&mut run_socket).await.0, id, "the replay confirms delivery");

    let attack = chunk(1 << 63, 1 << 63, b"x");
    for _ in 0..2 {
        let (status, body) = post_log(&spooled, &id, &credential, &attack).await;
        assert_eq!((status, body["field"].as_str()), (400, Some("dropped")), "{body}");
    }
    let (status, body) = post_log(&spooled, &id, &credential, &chunk((1 << 63) + 1, 0, b"x")).await;
    assert_eq!((status, body["field"].as_str()), (400, Some("offset")), "{body}");

    let (status, body) = post_log(&spooled, &id, &credential, &chunk(0, 0, b"a")).await;
    assert_eq!((status, body["received"].as_u64()), (200, Some(1)), "the ledger did not move: {body}");
    let last = chunk(MAX_POSITION - 1, MAX_POSITION - 2, b"z");
    let (status, body) = post_log(&spooled, &id, &credential, &last).await;
    assert_eq!((status, body["received"].as_u64()), (200, Some(MAX_POSITION)), "up to the largest: {body}");
    let past = chunk(MAX_POSITION, 0, b"!");
    let (status, body) = post_log(&spooled, &id, &credential, &past).await;
    assert_eq!((status, body["field"].as_str()), (400, Some("offset")), "{body}");
    let (status, body) = post_log(&spooled, &id, &credential, &last).await;
    assert_eq!((status, body["received"].as_u64()), (200, Some(MAX_POSITION)), "a retry is a duplicate: {body}");

    let run = spooled.server.get(&format!("/v1/runs/{id}")).await;
    assert_eq!(run["id"], id, "the API answers: {run}");
    assert!(!spooled.server.logs().contains("store failure"), "{}", spooled.server.logs());
    let status = spooled.server.stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status} on SIGTERM");
}

#[tokio::test]
async fn log_positions_past_the_store_are_refused_on_sqlite() {
    log_positions_past_the_store_are_refused_and_the_server_keeps_serving(None).await;
}

#[tokio::test]
async fn log_positions_past_the_store_are_refused_on_postgres() {
    let Some(schema) = TestSchema::create("log_positions_past_the_store") else { return };
    log_positions_past_the_store_are_refused_and_the_server_keeps_serving(Some(schema.url())).await;
}
