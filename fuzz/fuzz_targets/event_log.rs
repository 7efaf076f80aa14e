//! Event and log bodies: parse, decode the base64, re-encode.
#![no_main]

use libfuzzer_sys::fuzz_target;
use standby_protocol::{Event, LogChunk};

fuzz_target!(|data: &[u8]| {
    if let Ok(event) = serde_json::from_slice::<Event>(data) {
        let encoded = serde_json::to_vec(&event).expect("an event encodes");
        assert_eq!(serde_json::from_slice::<Event>(&encoded).expect("re-parses"), event);
    }
    if let Ok(chunk) = serde_json::from_slice::<LogChunk>(data) {
        if let Ok(bytes) = chunk.bytes() {
            assert_eq!(LogChunk::new(chunk.offset, &bytes).bytes().expect("round trip"), bytes);
        }
    }
});
