//! The control socket's decoder: any text frame is a message, an unknown
//! type or an error, never a panic; a decoded known message re-encodes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use standby_protocol::ServerMessage;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(message) = ServerMessage::decode(text) {
        if !matches!(message, ServerMessage::Unknown { .. }) {
            let encoded = message.encode().expect("a known message encodes");
            assert_eq!(ServerMessage::decode(&encoded).expect("re-decodes"), message);
        }
    }
});
