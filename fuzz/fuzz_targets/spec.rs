//! The spec parser and the fingerprint over whatever it accepts.
#![no_main]

use libfuzzer_sys::fuzz_target;
use standby_protocol::{Spec, fingerprint};

fuzz_target!(|data: &[u8]| {
    if let Ok(spec) = serde_json::from_slice::<Spec>(data) {
        let _ = fingerprint(&spec.workspace);
        let encoded = serde_json::to_vec(&spec).expect("a parsed spec encodes");
        let again: Spec = serde_json::from_slice(&encoded).expect("re-parses");
        assert_eq!(again, spec);
    }
});
