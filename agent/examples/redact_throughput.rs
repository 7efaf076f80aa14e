//! Throughput of the log redactor: 50 secrets (40 single-line tokens, 5
//! PEM keys, 5 service-account JSON documents), 64 MiB of terminal output
//! with a secret every ~64 KiB, fed in the terminal reader's 16 KiB chunks.
//!
//! `cargo run --release -p standby-agent --example redact_throughput`
//! prints MB/s (10^6 bytes per second), the best of five passes.

use std::io::Write;
use std::time::Instant;

use standby_agent::redact::Redactor;

const OUTPUT_BYTES: usize = 64 << 20;
const CHUNK: usize = 16 * 1024;
const SECRET_EVERY: usize = 64 * 1024;
const PASSES: usize = 5;

/// A small deterministic generator, so every run measures the same input.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).expect("below n")
    }

    fn text(&mut self, alphabet: &[u8], len: usize) -> String {
        (0..len).map(|_| char::from(alphabet[self.below(alphabet.len())])).collect()
    }
}

const BASE64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const PROSE: &[u8] = b"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,:;-_=/()[]{}\"'";

fn pem(rng: &mut Rng) -> String {
    let body = rng.text(BASE64, 1600);
    let lines: Vec<&str> = body.as_bytes().chunks(64).map(|line| std::str::from_utf8(line).expect("ASCII")).collect();
    format!("-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n", lines.join("\n"))
}

fn service_account(rng: &mut Rng, n: usize) -> String {
    let key = pem(rng).replace('\n', "\\n");
    format!(
        "{{\n  \"type\": \"service_account\",\n  \"project_id\": \"project-{n}\",\n  \"private_key_id\": \"{}\",\n  \"private_key\": \"{key}\",\n  \"client_email\": \"bot-{n}@project-{n}.iam.example\"\n}}\n",
        rng.text(b"0123456789abcdef", 40)
    )
}

fn main() {
    let mut rng = Rng(0x5eed_cafe_f00d_d00d);
    let mut secrets: Vec<String> = (0..40)
        .map(|_| {
            let len = 20 + rng.below(40);
            rng.text(BASE64, len)
        })
        .collect();
    secrets.extend((0..5).map(|_| pem(&mut rng)));
    secrets.extend((0..5).map(|n| service_account(&mut rng, n)));

    // Terminal output: lines of prose ending in `\r\n`, and now and then a
    // secret as a terminal prints it.
    let mut output = Vec::with_capacity(OUTPUT_BYTES + 8192);
    let mut next_secret = SECRET_EVERY;
    while output.len() < OUTPUT_BYTES {
        let len = 20 + rng.below(100);
        output.extend_from_slice(rng.text(PROSE, len).as_bytes());
        output.extend_from_slice(b"\r\n");
        if output.len() >= next_secret {
            let secret = &secrets[rng.below(secrets.len())];
            output.extend_from_slice(secret.replace('\n', "\r\n").as_bytes());
            next_secret += SECRET_EVERY;
        }
    }

    let build = Instant::now();
    let mut redactor = Redactor::new(secrets.iter().map(String::as_str));
    let build = build.elapsed();
    let mut best = f64::MAX;
    let mut out_bytes = 0;
    for _ in 0..PASSES {
        let start = Instant::now();
        out_bytes = 0;
        for chunk in output.chunks(CHUNK) {
            out_bytes += redactor.push(chunk).len();
        }
        out_bytes += redactor.finish().len();
        best = best.min(start.elapsed().as_secs_f64());
    }
    let mb = output.len() as f64 / 1e6;
    // The result is this program's output (the workspace denies `println!`).
    writeln!(
        std::io::stdout(),
        "redactor: 50 secrets, {mb:.1} MB in {CHUNK}-byte chunks: {:.0} MB/s (best of {PASSES}; built in {build:.1?}; {} bytes out)",
        mb / best,
        out_bytes
    )
    .expect("stdout is writable");
}
