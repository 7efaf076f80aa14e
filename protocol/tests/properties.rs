//! Decoders never panic, whatever arrives: arbitrary text, arbitrary JSON,
//! and JSON shaped like the real messages with fields of the wrong types.

use proptest::prelude::*;
use serde_json::{Value, json};
use standby_protocol::{Event, LogChunk, ServerMessage, Spec};

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| json!(f)),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("type".to_owned()),
                    Just("execution_id".to_owned()),
                    Just("run".to_owned()),
                    Just("run_credential".to_owned()),
                    Just("command".to_owned()),
                    Just("workspace".to_owned()),
                    ".{0,8}"
                ],
                inner,
                0..6
            )
            .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// Messages of a known type whose other fields are arbitrary.
fn message_like() -> impl Strategy<Value = Value> {
    (prop_oneof![Just("assignment"), Just("retired"), Just("cancel"), Just("heartbeat")], json_value()).prop_map(
        |(kind, body)| {
            let mut object = match body {
                Value::Object(map) => map,
                other => [("run".to_owned(), other)].into_iter().collect(),
            };
            object.insert("type".into(), json!(kind));
            Value::Object(object)
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn server_message_decoder_never_panics_on_text(text in ".{0,256}") {
        let _ = ServerMessage::decode(&text);
    }

    #[test]
    fn server_message_decoder_never_panics_on_json(value in json_value()) {
        let _ = ServerMessage::decode(&value.to_string());
    }

    #[test]
    fn known_types_with_wrong_fields_are_errors_not_panics(value in message_like()) {
        let text = value.to_string();
        if let Err(error) = ServerMessage::decode(&text) {
            // The message names the problem, never a value from the frame.
            let shown = error.to_string();
            for string in string_values(&value) {
                if string.len() >= 4 && !FIELD_AND_TYPE_NAMES.contains(&string.as_str()) {
                    prop_assert!(!shown.contains(&string), "{shown:?} quotes {string:?}");
                }
            }
        }
    }

    #[test]
    fn spec_event_and_log_parsers_never_panic(value in json_value(), text in ".{0,128}") {
        for input in [value.to_string(), text] {
            let _ = serde_json::from_str::<Spec>(&input);
            let _ = serde_json::from_str::<Event>(&input);
            if let Ok(chunk) = serde_json::from_str::<LogChunk>(&input) {
                let _ = chunk.bytes();
            }
        }
    }

    #[test]
    fn log_chunks_round_trip_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512), offset in any::<u64>()) {
        let chunk = LogChunk::new(offset, &bytes);
        let decoded: LogChunk = serde_json::from_str(&serde_json::to_string(&chunk).expect("encodes")).expect("decodes");
        prop_assert_eq!(decoded.offset, offset);
        prop_assert_eq!(decoded.bytes().expect("base64"), bytes);
    }
}

/// Names an error may legitimately mention ("missing field `run`").
const FIELD_AND_TYPE_NAMES: &[&str] = &[
    "type",
    "assignment",
    "retired",
    "cancel",
    "heartbeat",
    "execution_id",
    "run",
    "run_credential",
    "command",
    "workspace",
];

/// Every string value (not key) in `value`: what an error must not echo.
fn string_values(value: &Value) -> Vec<String> {
    match value {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items.iter().flat_map(string_values).collect(),
        Value::Object(map) => map.values().flat_map(string_values).collect(),
        _ => Vec::new(),
    }
}

proptest! {
    /// The log ledger: `received` only grows, by exactly what an `Append`
    /// accounts for; a duplicate or conflict changes nothing; replaying any
    /// prefix of a stream of chunks (retries) never appends twice.
    #[test]
    fn the_log_ledger_never_double_counts(
        chunks in prop::collection::vec((0u64..64, 0u64..16, 0u64..32), 0..24),
    ) {
        use standby_protocol::log_chunk::{Verdict, accept};
        let (mut received, mut held, mut gaps) = (0u64, 0u64, 0u64);
        for (len, dropped, back) in chunks {
            // A chunk at the ledger's end, after a gap, or a retry from `back` bytes earlier.
            for (offset, dropped) in [(received + dropped, dropped), (received.saturating_sub(back), 0)] {
                match accept(received, offset, dropped, len) {
                    Verdict::Append { gap, skip, end } => {
                        prop_assert!(end > received || (gap > 0 && end >= received));
                        prop_assert_eq!(end, offset + len);
                        prop_assert!(skip <= len);
                        held += len - skip;
                        gaps += gap;
                        received = end;
                    }
                    Verdict::Duplicate => prop_assert!(offset + len <= received),
                    Verdict::Conflict => prop_assert!(offset > received),
                }
                prop_assert_eq!(held + gaps, received);
            }
        }
    }
}
