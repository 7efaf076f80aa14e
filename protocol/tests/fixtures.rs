//! Every fixture decodes into its type and encodes back to the same JSON;
//! every checked-in schema equals the one generated from the types.
//!
//! Run with `STANDBY_BLESS=1` to rewrite `schema/` after changing a type.

use std::path::{Path, PathBuf};

use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;
use standby_protocol::*;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read_fixture(name: &str) -> Value {
    let path = crate_dir().join("fixtures").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn round_trip<T: Serialize + DeserializeOwned>(name: &str) -> T {
    let original = read_fixture(name);
    let typed: T = serde_json::from_value(original.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let encoded = serde_json::to_value(&typed).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(encoded, original, "{name} does not survive a decode/encode round trip");
    typed
}

#[test]
fn every_fixture_round_trips() {
    round_trip::<AgentMessage>("heartbeat.json");
    round_trip::<Spec>("spec.json");
    round_trip::<SecretsResponse>("secrets_response.json");
    round_trip::<AttachmentsResponse>("attachments_response.json");
    round_trip::<GitCredentialsResponse>("git_credentials_response.json");
    round_trip::<CloudCredentialsResponse>("cloud_credentials_response.json");
    round_trip::<Event>("event_started.json");
    let timed = round_trip::<Event>("event_started_timed.json");
    assert_eq!(timed.install_timing().and_then(|timing| timing.get("critical_path")), Some(&7400));
    round_trip::<Event>("event_exited.json");
    let lost = round_trip::<Event>("event_exited_log_lost.json");
    assert_eq!((lost.log_lost, lost.log_outcome()), (Some(4096), Some(4096)));
    round_trip::<Event>("event_cancelled.json");
    round_trip::<Event>("event_install_failed.json");
    round_trip::<serde_json::Value>("metadata.json");
    let chunk = round_trip::<LogChunk>("log_chunk.json");
    assert_eq!(chunk.bytes().expect("base64"), b"hello [REDACTED]\n");
    assert_eq!(chunk.dropped, 0, "a chunk with no gap says nothing of one");
    let after_gap = round_trip::<LogChunk>("log_chunk_dropped.json");
    assert_eq!((after_gap.offset, after_gap.dropped), (4096, 1024));
    assert_eq!(round_trip::<LogReceived>("log_received.json").received, 3072);
}

#[test]
fn server_message_fixtures_decode_through_the_codec() {
    for name in [
        "assignment.json",
        "assignment_inline_attachments.json",
        "assignment_trace_context.json",
        "retired.json",
        "cancel.json",
    ] {
        let original = read_fixture(name);
        let message = ServerMessage::decode(&original.to_string()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!matches!(message, ServerMessage::Unknown { .. }), "{name}");
        let encoded: Value = serde_json::from_str(&message.encode().expect("known")).expect("json");
        assert_eq!(encoded, original, "{name}");
    }
}

/// The 1.3 trace context: the fixture's `traceparent` is well formed, and
/// an assignment whose context is malformed or of another shape still
/// decodes (tracing never fails a run).
#[test]
fn the_trace_context_never_fails_an_assignment() {
    let text = read_fixture("assignment_trace_context.json").to_string();
    let ServerMessage::Assignment(assignment) = ServerMessage::decode(&text).expect("decodes") else {
        panic!("not an assignment");
    };
    let context = assignment.trace_context.expect("carried");
    let parent = context.parent().expect("well formed");
    assert_eq!(parent.to_string(), context.traceparent);
    assert_eq!(context.valid_tracestate(), Some("standby=run"));
    for odd in [serde_json::json!("00-zz"), serde_json::json!(7), serde_json::json!({"traceparent": "nonsense"})] {
        let mut value = read_fixture("assignment_trace_context.json");
        value["trace_context"] = odd.clone();
        let ServerMessage::Assignment(assignment) = ServerMessage::decode(&value.to_string()).expect("decodes") else {
            panic!("not an assignment");
        };
        assert!(assignment.trace_context.is_none_or(|context| context.parent().is_err()), "{odd}");
    }
}

#[test]
fn every_fixture_is_covered() {
    let dir = crate_dir().join("fixtures");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("fixtures dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let source = include_str!("fixtures.rs");
    for name in names {
        assert!(source.contains(&format!("\"{name}\"")), "fixture {name} is not exercised");
    }
}

fn schemas() -> Vec<(&'static str, schemars::Schema)> {
    use schemars::schema_for;
    vec![
        ("agent-message", schema_for!(AgentMessage)),
        ("server-message", schema_for!(ServerMessage)),
        ("spec", schema_for!(Spec)),
        ("event", schema_for!(Event)),
        ("log-chunk", schema_for!(LogChunk)),
        ("log-received", schema_for!(LogReceived)),
        ("secrets-response", schema_for!(SecretsResponse)),
        ("attachments-response", schema_for!(AttachmentsResponse)),
        ("git-credentials-response", schema_for!(GitCredentialsResponse)),
        ("cloud-credentials-response", schema_for!(CloudCredentialsResponse)),
        ("error-body", schema_for!(ErrorBody)),
    ]
}

fn schema_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.schema.json"))
}

#[test]
fn checked_in_schema_is_fresh() {
    let dir = crate_dir().join("schema");
    let bless = std::env::var_os("STANDBY_BLESS").is_some();
    for (name, schema) in schemas() {
        let generated = serde_json::to_string_pretty(&schema).expect("schema serializes") + "\n";
        let path = schema_path(&dir, name);
        if bless {
            std::fs::write(&path, &generated).expect("write schema");
            continue;
        }
        let stored = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            stored == generated,
            "{} is stale: run `STANDBY_BLESS=1 cargo test -p standby-protocol` and commit",
            path.display()
        );
    }
}
