//! The redactor: for any secrets, stream and split into chunks, streaming
//! equals one-shot redaction and no secret survives.
//!
//! Input layout: `secrets 0xFF stream 0xFF chunk sizes`; secrets are
//! separated by 0xFE (at most four, empty ones ignored).
#![no_main]

use libfuzzer_sys::fuzz_target;
use standby_agent::redact::Redactor;

fuzz_target!(|data: &[u8]| {
    let mut parts = data.splitn(3, |b| *b == 0xFF);
    let (Some(secrets), Some(stream)) = (parts.next(), parts.next()) else { return };
    let sizes = parts.next().unwrap_or(&[]);
    let secrets: Vec<&str> = secrets
        .split(|b| *b == 0xFE)
        .filter_map(|s| std::str::from_utf8(s).ok())
        .filter(|s| !s.is_empty())
        .take(4)
        .collect();

    let mut whole = Redactor::new(secrets.iter().copied());
    let mut expected = whole.push(stream);
    expected.extend(whole.finish());

    let mut streaming = Redactor::new(secrets.iter().copied());
    let mut output = Vec::new();
    let mut rest = stream;
    for size in sizes.iter().map(|s| usize::from(*s) + 1) {
        if rest.is_empty() {
            break;
        }
        let (chunk, tail) = rest.split_at(size.min(rest.len()));
        output.extend(streaming.push(chunk));
        rest = tail;
    }
    output.extend(streaming.push(rest));
    output.extend(streaming.finish());
    assert_eq!(output, expected, "streaming differs from one-shot redaction");

    // Markers become NUL so marker text next to plain text cannot spell a secret.
    let marked = String::from_utf8_lossy(&output).replace("[REDACTED]", "\0");
    let unmarked_input = String::from_utf8_lossy(stream);
    for secret in &secrets {
        if !unmarked_input.contains("[REDACTED]") && !secret.contains(['\u{FFFD}', '\0']) {
            assert!(!marked.contains(secret), "a secret survived redaction");
        }
    }
});
