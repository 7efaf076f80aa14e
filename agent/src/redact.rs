//! Streaming redaction of secret values from terminal output.
//!
//! The run's terminal output goes to the server, and the run sees its secrets
//! in its environment, so anything it prints may contain one. Programs rarely
//! print a secret only verbatim: it shows up inside URLs (`https://u:tok@…`,
//! query strings) and inside JSON (API bodies, structured logs), and a
//! multi-line one (a PEM key, a service-account document) goes through the
//! pseudo-terminal, which writes every `\n` as `\r\n`. Each secret is
//! therefore matched in these forms:
//!
//! - as is;
//! - URL-encoded: every byte outside the RFC 3986 unreserved set
//!   (`A-Z a-z 0-9 - . _ ~`) as `%XX`. RFC 3986 says producers should use
//!   upper-case hex, which is what common encoders (JavaScript's
//!   `encodeURIComponent`, Python's `quote`, Go's `url.QueryEscape`, curl) emit;
//!   a lower-case variant is matched too because it costs one more pattern and
//!   hand-rolled encoders produce it. Encoders that leave some reserved
//!   characters alone (`encodeURIComponent` keeps `!'()*`) or write a space as
//!   `+` produce yet other spellings, which are not matched;
//! - JSON-string-escaped, exactly as `serde_json` writes a string, without the
//!   surrounding quotes;
//! - as a terminal prints it: every `\n` as `\r\n` (the terminal's `ONLCR`
//!   output mode, on by default; a `\r\n` in the value so becomes `\r\r\n`);
//! - each line of a multi-line secret at least [`MIN_LINE_CHARS`] characters
//!   long, on its own (a trailing `\r` dropped): a program that prints one
//!   line of a key (`grep`, an error quoting it) must not leak that line.
//!   Shorter lines (`{`, `}`, blank ones) carry no secret alone and would
//!   redact ordinary output.
//!
//! Matching uses [`aho_corasick`], the well-kept multi-pattern matcher behind
//! the `regex` crate, with leftmost-longest semantics: where two secrets
//! overlap, the one starting first wins, and of those starting at the same
//! byte, the longest, so a secret that is a prefix of another never leaves the
//! other's tail behind.

use std::fmt;

use aho_corasick::{AhoCorasick, MatchKind};

/// What every occurrence of a secret becomes.
const MARKER: &str = "[REDACTED]";
/// The shortest line of a multi-line secret that is replaced on its own.
pub(crate) const MIN_LINE_CHARS: usize = 8;

/// Redacts secret values, either from a stream fed chunk by chunk or from one
/// whole string.
///
/// Streaming gives exactly the one-shot result of the concatenated stream,
/// however it is split: the bytes at the end of a chunk that could still grow
/// into a secret (at most `longest pattern - 1` of them) are held back until
/// the next chunk (or [`Redactor::finish`]) decides. Only those are held, so a
/// prompt waiting for input is not kept from the log.
pub struct Redactor {
    /// `None` without secrets: the output is then the input, nothing held back.
    matcher: Option<AhoCorasick>,
    /// Every form of every secret, sorted and deduplicated, to tell which
    /// chunk tails could still grow into a match.
    patterns: Vec<Vec<u8>>,
    /// Length of the longest pattern.
    longest: usize,
    /// Which hashes of a pattern's first [`PREFIX`] bytes occur, among
    /// patterns longer than that: a cheap test that rules out almost every
    /// position before the exact one ([`could_grow`]).
    prefixes: PrefixSet,
    /// Bytes not emitted yet, starting where the next match may start.
    pending: Vec<u8>,
}

impl fmt::Debug for Redactor {
    /// Counts only: the patterns are the secrets themselves.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redactor")
            .field("patterns", &self.matcher.as_ref().map_or(0, AhoCorasick::patterns_len))
            .field("pending_bytes", &self.pending.len())
            .finish()
    }
}

impl Redactor {
    /// A redactor for `secrets`; empty values are ignored (they would match
    /// everywhere).
    ///
    /// # Panics
    ///
    /// Only if the patterns exceed the matcher's internal limits (about two
    /// billion automaton states, that is gigabytes of secret values).
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a str>) -> Self {
        let mut patterns: Vec<Vec<u8>> = secrets.into_iter().filter(|s| !s.is_empty()).flat_map(forms).collect();
        patterns.sort_unstable();
        patterns.dedup();
        let longest = patterns.iter().map(Vec::len).max().unwrap_or(0);
        let prefixes = PrefixSet::of(&patterns);
        let matcher = (!patterns.is_empty()).then(|| {
            AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&patterns)
                .expect("secret values stay far below the matcher's size limits")
        });
        Self { matcher, patterns, longest, prefixes, pending: Vec::new() }
    }

    /// True when there is nothing to redact.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.matcher.is_none()
    }

    /// Feeds the next chunk; returns the redacted bytes that are safe to emit
    /// now. Holds back at most `longest pattern - 1` bytes, and only bytes
    /// that could still begin a secret, so that a secret split across chunks
    /// is still caught.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        let Some(matcher) = &self.matcher else {
            return chunk.to_vec();
        };
        self.pending.extend_from_slice(chunk);
        let end = self.pending.len();
        // Positions where more bytes could complete a pattern (or a longer
        // one): only the last `longest - 1` can be, as a longer tail holds
        // every pattern starting there.
        let open: Vec<usize> = (end.saturating_sub(self.longest - 1)..end)
            .filter(|&at| {
                self.prefixes.may_grow(&self.pending[at..]) && could_grow(&self.patterns, &self.pending[at..])
            })
            .collect();
        let next_open = |from: usize| open.iter().copied().find(|&at| at >= from).unwrap_or(end);
        let mut out = Vec::with_capacity(end);
        let mut emitted = 0;
        for found in matcher.find_iter(&self.pending) {
            // A match is final unless a position from here up to its start is
            // open: later bytes could then make a match start earlier, or
            // this one longer.
            if next_open(emitted) <= found.start() {
                break;
            }
            out.extend_from_slice(&self.pending[emitted..found.start()]);
            out.extend_from_slice(MARKER.as_bytes());
            emitted = found.end();
        }
        // No match starts before the next open position (it would have been
        // found above), so the bytes up to there are plain text.
        let safe = next_open(emitted);
        out.extend_from_slice(&self.pending[emitted..safe]);
        self.pending.drain(..safe);
        out
    }

    /// End of stream: the held-back tail, redacted.
    pub fn finish(&mut self) -> Vec<u8> {
        let tail = std::mem::take(&mut self.pending);
        match &self.matcher {
            Some(matcher) => {
                let mut out = Vec::with_capacity(tail.len());
                matcher.replace_all_with_bytes(&tail, &mut out, |_, _, out| {
                    out.extend_from_slice(MARKER.as_bytes());
                    true
                });
                out
            }
            None => tail,
        }
    }

    /// One-shot redaction of a whole string, independent of any stream
    /// being pushed: what the tests hold the patterns to.
    #[cfg(test)]
    pub(crate) fn redact_str(&self, text: &str) -> String {
        match &self.matcher {
            Some(matcher) => {
                let mut out = String::with_capacity(text.len());
                matcher.replace_all_with(text, &mut out, |_, _, out| {
                    out.push_str(MARKER);
                    true
                });
                out
            }
            None => text.to_owned(),
        }
    }
}

/// Every form of `secret` that is replaced (see the module's documentation).
fn forms(secret: &str) -> Vec<Vec<u8>> {
    let mut forms = vec![
        secret.as_bytes().to_vec(),
        url_encode(secret, b"0123456789ABCDEF").into_bytes(),
        url_encode(secret, b"0123456789abcdef").into_bytes(),
        json_escape(secret).into_bytes(),
    ];
    if secret.contains('\n') {
        forms.push(secret.replace('\n', "\r\n").into_bytes());
        forms.extend(
            secret
                .split('\n')
                .map(|line| line.strip_suffix('\r').unwrap_or(line))
                .filter(|line| line.chars().count() >= MIN_LINE_CHARS)
                .map(|line| line.as_bytes().to_vec()),
        );
    }
    forms
}

/// How many leading bytes [`PrefixSet`] hashes.
const PREFIX: usize = 4;

/// A set of hashed [`PREFIX`]-byte pattern prefixes, as a bitmap: 8 KiB.
/// The positions a chunk's tail could still grow from are looked for among
/// its last `longest pattern - 1` bytes, thousands for a PEM key in
/// percent-encoded form; this keeps that to a hash and a bit per position.
struct PrefixSet(Vec<u64>);

impl PrefixSet {
    const BITS: usize = 1 << 16;

    fn of(patterns: &[Vec<u8>]) -> Self {
        let mut bits = vec![0u64; Self::BITS / 64];
        for pattern in patterns.iter().filter(|p| p.len() > PREFIX) {
            let at = Self::hash(&pattern[..PREFIX]);
            bits[at / 64] |= 1 << (at % 64);
        }
        Self(bits)
    }

    fn hash(prefix: &[u8]) -> usize {
        let word = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]);
        usize::try_from(word.wrapping_mul(0x9E37_79B1) >> 16).unwrap_or(0)
    }

    /// False only if no pattern longer than `tail` starts with it (a tail
    /// shorter than the prefix is left to the exact test).
    fn may_grow(&self, tail: &[u8]) -> bool {
        if tail.len() < PREFIX {
            return true;
        }
        let at = Self::hash(&tail[..PREFIX]);
        self.0[at / 64] & (1 << (at % 64)) != 0
    }
}

/// Whether some pattern is longer than `tail` and starts with it. The
/// patterns starting with `tail` sort right after `tail` itself.
fn could_grow(patterns: &[Vec<u8>], tail: &[u8]) -> bool {
    let mut at = patterns.partition_point(|p| p.as_slice() < tail);
    if patterns.get(at).is_some_and(|p| p == tail) {
        at += 1;
    }
    patterns.get(at).is_some_and(|p| p.starts_with(tail))
}

/// Percent-encodes every byte outside the RFC 3986 unreserved set, with the
/// given hex digits (upper- or lower-case).
fn url_encode(value: &str, hex: &[u8; 16]) -> String {
    let mut out = String::with_capacity(value.len() * 3);
    for &byte in value.as_bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(hex[usize::from(byte >> 4)]));
            out.push(char::from(hex[usize::from(byte & 0x0f)]));
        }
    }
    out
}

/// The JSON string encoding of `value` (as `serde_json` writes it) without the
/// surrounding quotes.
fn json_escape(value: &str) -> String {
    let quoted = serde_json::Value::String(value.to_owned()).to_string();
    quoted[1..quoted.len() - 1].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::sample::Index;

    /// Pushes `chunks` one by one, then finishes.
    fn stream(redactor: &mut Redactor, chunks: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for chunk in chunks {
            out.extend(redactor.push(chunk));
        }
        out.extend(redactor.finish());
        out
    }

    fn redact_whole(secrets: &[&str], input: &[u8]) -> Vec<u8> {
        stream(&mut Redactor::new(secrets.iter().copied()), &[input])
    }

    #[test]
    fn plain_form() {
        let redactor = Redactor::new(["hunter2"]);
        assert_eq!(redactor.redact_str("pw=hunter2; again hunter2"), "pw=[REDACTED]; again [REDACTED]");
        assert_eq!(redact_whole(&["hunter2"], b"<hunter2>"), b"<[REDACTED]>");
    }

    #[test]
    fn url_encoded_forms() {
        let redactor = Redactor::new(["p@ss w/rd~"]);
        assert_eq!(
            redactor.redact_str("https://u:p%40ss%20w%2Frd~@host/ and ?t=p%40ss%20w%2frd~&x"),
            "https://u:[REDACTED]@host/ and ?t=[REDACTED]&x"
        );
        let non_ascii = Redactor::new(["é"]);
        assert_eq!(non_ascii.redact_str("a%C3%A9b a%c3%a9b"), "a[REDACTED]b a[REDACTED]b");
    }

    #[test]
    fn json_escaped_form() {
        let secret = "a\"b\\c\nd\u{1}e/é";
        let escaped = json_escape(secret);
        assert_eq!(escaped, "a\\\"b\\\\c\\nd\\u0001e/é");
        let body = serde_json::json!({ "token": secret }).to_string();
        assert_eq!(Redactor::new([secret]).redact_str(&body), r#"{"token":"[REDACTED]"}"#);
    }

    #[test]
    fn identical_forms_are_deduplicated() {
        let redactor = Redactor::new(["abc", "abc", ""]);
        assert_eq!(redactor.matcher.as_ref().map(AhoCorasick::patterns_len), Some(1));
        let redactor = Redactor::new(["a b"]);
        assert_eq!(redactor.matcher.as_ref().map(AhoCorasick::patterns_len), Some(2), "as is (= JSON), %20");
        let redactor = Redactor::new(["a/b"]);
        assert_eq!(redactor.matcher.as_ref().map(AhoCorasick::patterns_len), Some(3), "as is (= JSON), %2F, %2f");
    }

    #[test]
    fn no_secrets_means_no_redaction() {
        let mut redactor = Redactor::new([""]);
        assert!(redactor.is_empty());
        assert_eq!(redactor.push(b"a\xffb"), b"a\xffb");
        assert_eq!(redactor.finish(), b"");
        assert_eq!(redactor.redact_str("text"), "text");
        assert!(!Redactor::new(["x"]).is_empty());
    }

    #[test]
    fn debug_shows_no_secret() {
        let mut redactor = Redactor::new(["hunter2"]);
        redactor.push(b"xxhunt");
        let debug = format!("{redactor:?}");
        assert!(!debug.contains("hunt"), "{debug}");
        assert!(debug.contains("patterns: 1"), "{debug}");
    }

    #[test]
    fn a_secret_split_at_every_position_is_caught() {
        let input = b"before hunter2 after".as_slice();
        for split in 0..=input.len() {
            let mut redactor = Redactor::new(["hunter2"]);
            let out = stream(&mut redactor, &[&input[..split], &input[split..]]);
            assert_eq!(out, b"before [REDACTED] after", "split at {split}");
        }
    }

    #[test]
    fn holds_back_only_what_could_begin_a_secret() {
        let mut redactor = Redactor::new(["abcd"]);
        assert_eq!(redactor.push(b"0123456abc"), b"0123456");
        assert_eq!(redactor.push(b"x"), b"abcx");
        assert_eq!(redactor.push(b"Password: "), b"Password: ");
        assert_eq!(redactor.push(b"ab"), b"");
        assert_eq!(redactor.push(b"cd"), b"[REDACTED]");
        assert_eq!(redactor.finish(), b"");
        let mut redactor = Redactor::new(["ab", "abcd"]);
        assert_eq!(redactor.push(b"xab"), b"x", "\"ab\" could still become \"abcd\"");
        assert_eq!(redactor.push(b"c"), b"");
        assert_eq!(redactor.push(b"e"), b"[REDACTED]ce");
        let mut redactor = Redactor::new(["a%b"]);
        assert_eq!(redactor.push(b"a%"), b"", "a prefix of a%b and of a%25b");
        assert_eq!(redactor.push(b"2"), b"");
        assert_eq!(redactor.push(b"x"), b"a%2x");
    }

    #[test]
    fn overlapping_and_adjacent_secrets() {
        let secrets = ["abc", "cde"];
        assert_eq!(redact_whole(&secrets, b"abcde"), b"[REDACTED]de");
        assert_eq!(redact_whole(&secrets, b"xcdeabc"), b"x[REDACTED][REDACTED]");
        assert_eq!(redact_whole(&secrets, b"abcabc"), b"[REDACTED][REDACTED]");
        assert_eq!(Redactor::new(secrets).redact_str("abcde"), "[REDACTED]de");
    }

    #[test]
    fn a_secret_that_is_a_prefix_of_another() {
        let secrets = ["tok", "token123"];
        assert_eq!(redact_whole(&secrets, b"token123 tok token12"), b"[REDACTED] [REDACTED] [REDACTED]en12");
        let input = b"a token123 b".as_slice();
        for split in 0..=input.len() {
            let out = stream(&mut Redactor::new(secrets), &[&input[..split], &input[split..]]);
            assert_eq!(out, b"a [REDACTED] b", "split at {split}");
        }
    }

    #[test]
    fn bytes_that_are_not_secrets_survive_even_invalid_utf8() {
        let input = b"\xff\xfe hunter2 \xc3";
        let mut redactor = Redactor::new(["hunter2"]);
        let out = stream(&mut redactor, &[&input[..3], &input[3..9], &input[9..]]);
        assert_eq!(out, b"\xff\xfe [REDACTED] \xc3");
    }

    /// A key as a file holds it, and as the terminal prints it.
    const PEM: &str = "-----BEGIN KEY-----\nQmFzZTY0IGxpbmUgb25l\nbGluZSB0d28=\nend\n-----END KEY-----\n";

    #[test]
    fn a_multi_line_secret_as_the_terminal_prints_it() {
        let printed = PEM.replace('\n', "\r\n");
        let out = redact_whole(&[PEM], format!("key:\r\n{printed}done\r\n").as_bytes());
        assert_eq!(out, b"key:\r\n[REDACTED]done\r\n", "{}", String::from_utf8_lossy(&out));
        // A value that already holds `\r\n`: the terminal writes `\r\r\n`.
        let crlf = "first-line-1\r\nsecond-line-2";
        assert_eq!(redact_whole(&[crlf], b"<first-line-1\r\r\nsecond-line-2>"), b"<[REDACTED]>");
    }

    #[test]
    fn each_long_line_of_a_multi_line_secret_is_replaced_alone() {
        let redactor = Redactor::new([PEM]);
        assert_eq!(redactor.redact_str("line: bGluZSB0d28=\r\n"), "line: [REDACTED]\r\n");
        assert_eq!(redactor.redact_str("QmFzZTY0IGxpbmUgb25l"), "[REDACTED]");
        assert_eq!(redactor.redact_str("-----END KEY-----"), "[REDACTED]");
        assert_eq!(redactor.redact_str("the end"), "the end", "a line under 8 characters is left alone");
        let lines = Redactor::new(["ab\r\n12345678\r\n1234567"]);
        assert_eq!(
            lines.redact_str("12345678 1234567 ab"),
            "[REDACTED] 1234567 ab",
            "a trailing \\r is no part of a line"
        );
        assert_eq!(Redactor::new(["é234567\nx"]).redact_str("é234567"), "é234567", "characters, not bytes, count");
        assert_eq!(Redactor::new(["é2345678\nx"]).redact_str("é2345678"), "[REDACTED]");
    }

    #[test]
    fn a_printed_multi_line_secret_split_at_every_position_is_caught() {
        let input = format!("before {} after", PEM.replace('\n', "\r\n")).into_bytes();
        for split in 0..=input.len() {
            let out = stream(&mut Redactor::new([PEM]), &[&input[..split], &input[split..]]);
            assert_eq!(out, b"before [REDACTED] after", "split at {split}");
        }
    }

    /// Every form the redactor promises, built independently of it.
    fn all_forms(secret: &str) -> Vec<Vec<u8>> {
        let percent = |lower: bool| -> Vec<u8> {
            secret
                .bytes()
                .map(|b| match b {
                    b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => char::from(b).to_string(),
                    _ if lower => format!("%{b:02x}"),
                    _ => format!("%{b:02X}"),
                })
                .collect::<String>()
                .into_bytes()
        };
        let json = serde_json::to_string(secret).expect("a string serializes");
        let mut forms = vec![
            secret.as_bytes().to_vec(),
            percent(false),
            percent(true),
            json.as_bytes()[1..json.len() - 1].to_vec(),
        ];
        if secret.contains('\n') {
            forms.push(secret.replace('\n', "\r\n").into_bytes());
            for line in secret.split('\n').map(|line| line.strip_suffix('\r').unwrap_or(line)) {
                if line.chars().count() >= 8 {
                    forms.push(line.as_bytes().to_vec());
                }
            }
        }
        forms
    }

    /// Leftmost-longest replacement done the slow, obvious way.
    fn reference(secrets: &[String], input: &[u8]) -> Vec<u8> {
        let forms: Vec<Vec<u8>> = secrets.iter().flat_map(|s| all_forms(s)).collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < input.len() {
            let longest = forms.iter().filter(|f| input[i..].starts_with(f)).map(Vec::len).max();
            match longest {
                Some(len) => {
                    out.extend_from_slice(MARKER.as_bytes());
                    i += len;
                }
                None => {
                    out.push(input[i]);
                    i += 1;
                }
            }
        }
        out
    }

    /// `out` with every marker replaced by a 0 byte. A marker next to text
    /// can spell a secret ("[REDACTED]" + "x" contains "D]x"); such an
    /// occurrence leaks nothing, so markers become a byte no form contains
    /// before searching.
    fn mask_markers(out: &[u8]) -> Vec<u8> {
        let mut masked = Vec::new();
        let mut rest = out;
        while let Some(at) = rest.windows(MARKER.len()).position(|w| w == MARKER.as_bytes()) {
            masked.extend_from_slice(&rest[..at]);
            masked.push(0);
            rest = &rest[at + MARKER.len()..];
        }
        masked.extend_from_slice(rest);
        masked
    }

    /// Prints `text` with `cat` on a fresh pseudo-terminal (portable-pty,
    /// as the run's terminal is opened) and returns what its master side
    /// reads: the bytes as the terminal wrote them.
    fn printed_on_a_terminal(text: &[u8]) -> Vec<u8> {
        use portable_pty::{CommandBuilder, PtySize, native_pty_system};
        use std::io::Read;
        let file = tempfile::NamedTempFile::new().expect("a temporary file");
        std::fs::write(file.path(), text).expect("write the text");
        let size = PtySize { rows: 40, cols: 120, pixel_width: 0, pixel_height: 0 };
        let pair = native_pty_system().openpty(size).expect("a pseudo-terminal");
        let mut reader = pair.master.try_clone_reader().expect("a reader on the terminal");
        let mut command = CommandBuilder::new("cat");
        command.arg(file.path());
        let mut child = pair.slave.spawn_command(command).expect("cat starts on the terminal");
        // Only cat holds the slave side now: its exit ends the output, which
        // then reads as an error (EIO) after everything it wrote.
        drop(pair.slave);
        let mut printed = Vec::new();
        let _ = reader.read_to_end(&mut printed);
        assert!(child.wait().expect("cat can be waited for").success());
        printed
    }

    /// One to three multi-line secrets (base64-like lines, some shorter than
    /// 8 characters, sometimes a final line break) and a text printing them
    /// between lines of ordinary output.
    fn printed_secrets() -> impl Strategy<Value = (Vec<String>, Vec<u8>)> {
        let line = proptest::collection::vec(proptest::sample::select(b"ABCDEFabcdef0123456789+/=".to_vec()), 0..20)
            .prop_map(|b| String::from_utf8(b).expect("ASCII"));
        let secret = (proptest::collection::vec(line, 2..6), any::<bool>()).prop_map(|(lines, trailing)| {
            let mut secret = lines.join("\n");
            if trailing {
                secret.push('\n');
            }
            secret
        });
        let prose = proptest::collection::vec(proptest::sample::select(b"ghijk lmnop,.:\n".to_vec()), 0..30);
        (proptest::collection::vec(secret, 1..4), proptest::collection::vec((prose, any::<Index>()), 1..8)).prop_map(
            |(secrets, pieces)| {
                let mut text = Vec::new();
                for (prose, which) in pieces {
                    text.extend(prose);
                    text.extend_from_slice(which.get(&secrets).as_bytes());
                }
                (secrets, text)
            },
        )
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    /// Splits `input` at the given points (in any order, duplicates allowed).
    fn split<'a>(input: &'a [u8], points: &[Index]) -> Vec<&'a [u8]> {
        let mut cuts: Vec<usize> = points.iter().map(|p| p.index(input.len() + 1)).collect();
        cuts.sort_unstable();
        let mut chunks = Vec::new();
        let mut start = 0;
        for cut in cuts {
            chunks.push(&input[start..cut]);
            start = cut;
        }
        chunks.push(&input[start..]);
        chunks
    }

    /// Printable ASCII with now and then a line break (`\n`, sometimes
    /// `\r\n`), so that some secrets are multi-line.
    fn secret() -> impl Strategy<Value = String> {
        let byte = prop_oneof![12 => 0x20u8..0x7f, 1 => Just(b'\n'), 1 => Just(b'\r')];
        proptest::collection::vec(byte, 1..24).prop_map(|b| String::from_utf8(b).expect("ASCII"))
    }

    /// A stream of random bytes interleaved with secrets in their forms and
    /// with secret prefixes (which must be held back, then released).
    fn stream_of(secrets: Vec<String>) -> impl Strategy<Value = (Vec<String>, Vec<u8>)> {
        let piece = (
            proptest::collection::vec(any::<u8>(), 0..12),
            proptest::option::of((any::<Index>(), 0..8usize, any::<Index>())),
        );
        proptest::collection::vec(piece, 0..12).prop_map(move |pieces| {
            let mut input = Vec::new();
            for (text, secret) in pieces {
                input.extend(text);
                if let Some((which, form, cut)) = secret {
                    let secret = which.get(&secrets);
                    match all_forms(secret).get(form) {
                        Some(bytes) => input.extend_from_slice(bytes),
                        None => input.extend_from_slice(&secret.as_bytes()[..cut.index(secret.len())]),
                    }
                }
            }
            (secrets.clone(), input)
        })
    }

    /// One to three secrets; later ones often extend an earlier one, so that
    /// one secret is a prefix of another.
    fn secrets() -> impl Strategy<Value = Vec<String>> {
        proptest::collection::vec((secret(), proptest::option::of(any::<Index>())), 1..4).prop_map(|drawn| {
            let mut secrets: Vec<String> = Vec::new();
            for (secret, extends) in drawn {
                match extends.filter(|_| !secrets.is_empty()) {
                    Some(which) => {
                        let mut longer = which.get(&secrets).clone();
                        longer.push_str(&secret);
                        longer.truncate(23);
                        secrets.push(longer);
                    }
                    None => secrets.push(secret),
                }
            }
            secrets
        })
    }

    fn secrets_and_stream() -> impl Strategy<Value = (Vec<String>, Vec<u8>)> {
        secrets().prop_flat_map(stream_of)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn streamed_output_never_contains_a_secret(
            (secrets, input) in secrets_and_stream(),
            points in proptest::collection::vec(any::<Index>(), 0..10),
        ) {
            let mut redactor = Redactor::new(secrets.iter().map(String::as_str));
            let out = stream(&mut redactor, &split(&input, &points));
            let masked = mask_markers(&out);
            for secret in &secrets {
                for form in all_forms(secret) {
                    prop_assert!(!contains(&masked, &form), "a form of a secret survived");
                }
            }
        }

        #[test]
        fn streamed_output_equals_one_shot_redaction(
            (secrets, input) in secrets_and_stream(),
            points in proptest::collection::vec(any::<Index>(), 0..10),
        ) {
            let mut redactor = Redactor::new(secrets.iter().map(String::as_str));
            let streamed = stream(&mut redactor, &split(&input, &points));
            let whole = redact_whole(&secrets.iter().map(String::as_str).collect::<Vec<_>>(), &input);
            prop_assert_eq!(&streamed, &whole);
            prop_assert_eq!(&streamed, &reference(&secrets, &input));
            if let Ok(text) = std::str::from_utf8(&input) {
                prop_assert_eq!(streamed, redactor.redact_str(text).into_bytes());
            }
        }

        #[test]
        fn without_secrets_output_is_input(
            input in proptest::collection::vec(any::<u8>(), 0..256),
            points in proptest::collection::vec(any::<Index>(), 0..10),
            empties in 0..3usize,
        ) {
            let mut redactor = Redactor::new(std::iter::repeat_n("", empties));
            prop_assert_eq!(stream(&mut redactor, &split(&input, &points)), input);
        }
    }

    proptest! {
        // Each case starts a process on a terminal: fewer cases.
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn multi_line_secrets_printed_on_a_terminal_are_redacted(
            (secrets, text) in printed_secrets(),
            points in proptest::collection::vec(any::<Index>(), 0..10),
        ) {
            let printed = printed_on_a_terminal(&text);
            let mut expected = Vec::new();
            for &byte in &text {
                if byte == b'\n' {
                    expected.push(b'\r');
                }
                expected.push(byte);
            }
            prop_assert_eq!(&printed, &expected, "the terminal writes every \\n as \\r\\n");
            let mut redactor = Redactor::new(secrets.iter().map(String::as_str));
            let masked = mask_markers(&stream(&mut redactor, &split(&printed, &points)));
            for secret in &secrets {
                prop_assert!(!contains(&masked, secret.replace('\n', "\r\n").as_bytes()), "a printed secret survived");
                for line in secret.split('\n').filter(|line| line.len() >= MIN_LINE_CHARS) {
                    prop_assert!(!contains(&masked, line.as_bytes()), "a line of a secret survived: {:?}", line);
                }
            }
        }
    }
}
