//! `standby-server serve --config FILE` and `standby-server config`: the
//! example file of docs/operations.md starts a server, a misspelled key
//! stops one at start naming the key, the file and the line, and `config`
//! shows the merged configuration with each value's source and the
//! secrets masked.
//!
//! Needs both binaries built (`cargo build --bins`).

use std::hash::{BuildHasher, RandomState};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::Signal;
use standby_e2e::server_process::{API_KEY, ServerBuilder, server_bin};
use standby_e2e::standby_bin;

/// Bound on a `standby-server` that is expected to exit by itself.
const EXIT: Duration = Duration::from_secs(60);

/// The ```toml block of docs/operations.md, "Configuration file".
fn documented_example() -> String {
    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/operations.md");
    let doc = std::fs::read_to_string(&doc).unwrap_or_else(|error| panic!("read {}: {error}", doc.display()));
    let start = doc.find("```toml\n").expect("a ```toml block in docs/operations.md") + "```toml\n".len();
    let end = doc[start..].find("```").expect("the block ends") + start;
    doc[start..end].to_owned()
}

/// A test's directory, with `text` written to `standby.toml` (mode 0600).
fn config_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new().prefix("standby-config-").tempdir().expect("a temp dir");
    let path = dir.path().join("standby.toml");
    std::fs::write(&path, text).expect("write the configuration file");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod the file");
    (dir, path)
}

fn mark() -> String {
    format!("config-{:016x}", RandomState::new().hash_one(std::process::id()))
}

/// `standby-server <args>` run to its end, with no `STANDBY_*` variable
/// but `env`: its exit status, stdout and stderr.
async fn run(args: &[&str], env: &[(&str, &str)]) -> (std::process::ExitStatus, String, String) {
    let mut command = tokio::process::Command::new(server_bin());
    for (name, _) in std::env::vars() {
        if name.starts_with("STANDBY_") || name == "RUST_LOG" {
            command.env_remove(name);
        }
    }
    command.args(args).envs(env.iter().copied()).env("NO_COLOR", "1").stdin(Stdio::null()).kill_on_drop(true);
    let output = tokio::time::timeout(EXIT, command.output()).await.expect("standby-server exits").expect("run it");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (output.status, text(&output.stdout), text(&output.stderr))
}

/// The documented example, as written, starts a server (the harness's
/// flags, a free port among them, override it) that answers.
#[tokio::test]
async fn the_documented_example_starts_a_server() {
    let (dir, path) = config_file(&documented_example());
    let server = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark())
        .args(&["--config", path.to_str().expect("a UTF-8 path")])
        .start()
        .await;
    let (status, body) = server.call(reqwest::Method::GET, "/healthz", None, None).await;
    assert_eq!((status, body.as_str()), (200, Some("ok")), "{}", server.logs());
    assert_eq!(server.get("/v1/runs").await["runs"], serde_json::json!([]));
    let status = server.stop(Signal::SIGTERM).await;
    assert!(status.success(), "SIGTERM stops it cleanly: {status}");
}

/// A value of the file applies where no flag gives one: the public URL
/// is the one on the listening line.
#[tokio::test]
async fn a_file_value_applies_where_no_flag_gives_one() {
    let example = documented_example()
        .replace("# public_url = \"https://standby.example.com\"", "public_url = \"http://127.0.0.1:9/from-the-file\"");
    let (dir, path) = config_file(&example);
    let server = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark())
        .args(&["--config", path.to_str().expect("a UTF-8 path"), "--pool-size", "0"])
        .start()
        .await;
    assert_eq!(server.public_url(), "http://127.0.0.1:9/from-the-file");
    server.stop(Signal::SIGTERM).await;
}

/// A misspelled key stops `serve` at start: exit 1, and stderr names the
/// key, the file and its line.
#[tokio::test]
async fn a_misspelled_key_stops_the_start_naming_the_key_the_file_and_the_line() {
    let example = documented_example();
    let line = example.lines().position(|line| line == "pool_size = 2").expect("pool_size in the example") + 1;
    let (dir, path) = config_file(&example.replace("pool_size = 2", "pool_sise = 2"));
    let data = dir.path().join("data");
    let path_text = path.to_str().expect("a UTF-8 path");
    let args = ["serve", "--config", path_text, "--api-key", API_KEY, "--listen", "127.0.0.1:0", "--data-dir"];
    let (status, stdout, stderr) = run(&[&args[..], &[data.to_str().expect("UTF-8")]].concat(), &[]).await;
    assert_eq!(status.code(), Some(1), "stdout: {stdout}\nstderr: {stderr}");
    let expected = format!("{path_text}:{line}: unknown key `pool_sise` in [pool]");
    assert!(stderr.contains(&expected), "stderr names the key, the file and the line ({expected}): {stderr}");
    assert!(!stdout.contains("listening"), "it never listened: {stdout}");
    assert!(!data.exists(), "nothing was made before the refusal");
}

/// Whether `config` printed `key = value` from `source`.
fn has(stdout: &str, key: &str, value: &str, source: &str) -> bool {
    stdout
        .lines()
        .any(|line| line.starts_with(&format!("{key} = {value} ")) && line.trim_end().ends_with(&format!("# {source}")))
}

/// `config` prints the merged configuration: each value's source (flag,
/// env, file:line, default) and the secrets masked.
#[tokio::test]
async fn config_shows_the_merged_result_with_sources_and_masked_secrets() {
    let example = documented_example();
    let line_of = |text: &str| example.lines().position(|line| line == text).expect("in the example") + 1;
    let (_dir, path) = config_file(&example);
    let path_text = path.to_str().expect("a UTF-8 path");
    let agent = standby_bin();
    let args = ["config", "--config", path_text, "--pool-size", "4", "--agent-bin", agent.to_str().expect("UTF-8")];
    let secret = "never-shown-key";
    let env = [("STANDBY_SERVER_API_KEY", secret), ("STANDBY_SERVER_STORE", "postgres://u:never-shown@db/x")];
    let (status, stdout, stderr) = run(&args, &env[..1]).await;
    assert!(status.success(), "stdout: {stdout}\nstderr: {stderr}");
    assert!(has(&stdout, "pool_size", "4", "flag --pool-size"), "{stdout}");
    assert!(has(&stdout, "api_key", "\"[REDACTED]\"", "env STANDBY_SERVER_API_KEY"), "{stdout}");
    let listen = format!("file {path_text}:{}", line_of("listen = \"127.0.0.1:8080\""));
    assert!(has(&stdout, "listen", "\"127.0.0.1:8080\"", &listen), "{stdout}");
    assert!(
        has(&stdout, "running_cap", "16", &format!("file {path_text}:{}", line_of("running_cap = 16"))),
        "{stdout}"
    );
    assert!(stdout.lines().any(|line| line.starts_with("# public_url ") && line.ends_with("# unset")), "{stdout}");
    assert!(!stdout.contains(secret) && !stderr.contains(secret), "the key is never shown: {stdout}{stderr}");
    // A PostgreSQL URL's password is masked too; without a cluster secret
    // `serve` would refuse it, and `config` says so after printing.
    let (status, stdout, stderr) = run(&args, &env).await;
    assert_eq!(status.code(), Some(1), "stdout: {stdout}\nstderr: {stderr}");
    assert!(has(&stdout, "store", "\"postgres://u:[REDACTED]@db/x\"", "env STANDBY_SERVER_STORE"), "{stdout}");
    assert!(!stdout.contains("never-shown") && !stderr.contains("never-shown"), "{stdout}{stderr}");
    assert!(stderr.contains("`serve` would refuse this configuration"), "{stderr}");
    assert!(stderr.contains("--cluster-secret-file"), "{stderr}");
}

/// `--help` explains `--config` and the `config` command.
#[tokio::test]
async fn help_explains_the_file_and_the_config_command() {
    let (status, stdout, _) = run(&["--help"], &[]).await;
    assert!(status.success());
    assert!(stdout.contains("Print the configuration `serve` would start with"), "{stdout}");
    let (status, stdout, _) = run(&["serve", "--help"], &[]).await;
    assert!(status.success());
    for needle in ["--config <FILE>", "STANDBY_SERVER_CONFIG", "pool_size", "Pool ([pool])"] {
        assert!(stdout.contains(needle), "serve --help mentions {needle}: {stdout}");
    }
    let (status, stdout, _) = run(&["config", "--help"], &[]).await;
    assert!(status.success());
    assert!(stdout.contains("secrets masked") && stdout.contains("--config <FILE>"), "{stdout}");
}
