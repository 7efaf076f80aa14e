//! What the real `standby-server` keeps on disk: run requests sealed while
//! the run lives and gone once it ends, every file and directory readable
//! by the server's user only, and the keys read from files (a missing or
//! malformed one stops the start, naming it).

use std::hash::{BuildHasher, RandomState};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::json;
use standby_e2e::server_process::{ServerBuilder, server_bin};

/// Bound on each wait for the server.
const WAIT: Duration = Duration::from_secs(60);

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap_or_else(|error| panic!("{}: {error}", path.display())).permissions().mode() & 0o777
}

/// The bytes of the store and its companions.
fn store_bytes(data: &Path) -> Vec<u8> {
    let mut bytes = Vec::new();
    for name in ["standby.db", "standby.db-wal", "standby.db-shm"] {
        bytes.extend(std::fs::read(data.join(name)).unwrap_or_default());
    }
    bytes
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle.as_bytes())
}

#[tokio::test]
async fn a_runs_secrets_are_sealed_while_it_lives_and_gone_once_it_ends() {
    let dir = tempfile::Builder::new().prefix("standby-at-rest-").tempdir().expect("a temp dir");
    let data = dir.path().join("data");
    let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir.path())));
    let server = ServerBuilder::new(&data, &dir.path().join("server.log"), &mark)
        .args(&["--pool-size", "1", "--heartbeat-interval", "500ms", "--linger", "3s", "--stop-grace", "5s"])
        .start()
        .await;
    let gate = dir.path().join("gate");
    let values = [
        "secret-value-e2e-7f3a",
        "cloud-value-e2e-c91e",
        "git-password-e2e-5d2b",
        "attachment-content-e2e-88aa",
        "metadata-value-e2e-4e0f",
    ];
    // The run copies out what it was given (the command itself is stored
    // in clear, so it names no value), then waits for the gate.
    let out = dir.path().join("out");
    std::fs::create_dir(&out).expect("the output directory");
    let script = format!(
        "cd {} && printf %s \"$TOKEN\" > token && printf %s \"$CLOUD_SECRET\" > cloud \
         && cp \"$STANDBY_ATTACHMENTS_DIR/a.txt\" attachment && cp \"$STANDBY_METADATA_FILE\" metadata || exit 9; \
         while [ ! -e {} ]; do sleep 0.05; done",
        out.display(),
        gate.display()
    );
    let id = server
        .submit(&json!({
            "command": ["sh", "-c", script],
            "secrets": {"TOKEN": values[0]},
            "cloud_env": {"CLOUD_SECRET": values[1]},
            "git_credentials": [{"protocol": "https", "host": "git.example", "username": "bot", "password": values[2]}],
            "attachments": [{"name": "a.txt", "content": values[3]}],
            "metadata": {"ticket": values[4]},
        }))
        .await;
    let running = server
        .until("the run to start", WAIT, async || {
            let run = server.run(&id).await;
            (run["state"] == "running").then_some(run)
        })
        .await;
    let sandbox_id = running["attempts"][0]["sandbox_id"].as_str().expect("a sandbox").to_owned();

    // While it lives: stored, sealed, and owner-only everywhere.
    let bytes = store_bytes(&data);
    for value in values {
        assert!(!contains(&bytes, value), "`{value}` is in clear in the store");
    }
    assert_eq!(mode(&data), 0o700, "the data directory");
    for name in ["standby.db", "standby.db-wal", "standby.db-shm", "secret.key"] {
        assert_eq!(mode(&data.join(name)), 0o600, "{name}");
    }
    assert_eq!(mode(&data.join("sandboxes")), 0o700, "the sandboxes directory");
    let sandbox = server.sandbox_dir(&sandbox_id);
    assert_eq!(mode(&sandbox), 0o700, "the sandbox directory");
    assert_eq!(mode(&sandbox.join("workspace")), 0o700, "the workspace");
    assert_eq!(mode(&sandbox.join("agent.log")), 0o600, "agent.log");
    let key = std::fs::read_to_string(data.join("secret.key")).expect("the generated key");
    let log = std::fs::read_to_string(server.log_path()).expect("the server log");
    assert!(log.contains("generated the secret key") && log.contains(&data.join("secret.key").display().to_string()));
    assert!(!log.contains(key.trim()), "the key itself is never logged");

    std::fs::write(&gate, "").expect("open the gate");
    let run = server.finished(&id, WAIT).await;
    assert_eq!((run["state"].as_str(), run["exit_code"].as_i64()), (Some("exited"), Some(0)), "{run}");
    let given = |name: &str| std::fs::read_to_string(out.join(name)).unwrap_or_default();
    assert_eq!((given("token").as_str(), given("cloud").as_str()), (values[0], values[1]), "the run got its secrets");
    assert_eq!(given("attachment"), values[3]);
    assert!(given("metadata").contains(values[4]), "{}", given("metadata"));
    server.stop_leaving_nothing(Signal::SIGTERM).await;
    let bytes = store_bytes(&data);
    assert!(!bytes.is_empty());
    for value in values {
        assert!(!contains(&bytes, value), "`{value}` is left in the store after the run ended");
    }
    assert!(!contains(&bytes, "sealed1:"), "no sealed request is kept either");
}

/// Starts `serve` with `args` (port 0, spool provider: nothing launched)
/// and expects it to refuse to start; its stderr.
async fn refused_start(data: &Path, args: &[&str]) -> String {
    let mut command = tokio::process::Command::new(server_bin());
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(|name| name.starts_with("STANDBY_")) {
            command.env_remove(name);
        }
    }
    let output = command
        .args(["serve", "--listen", "127.0.0.1:0", "--provider", "spool", "--data-dir"])
        .arg(data)
        .args(args)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(WAIT, output).await.expect("it stops at once").expect("it runs");
    assert!(!output.status.success(), "it started: {}", String::from_utf8_lossy(&output.stdout));
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test]
async fn missing_or_malformed_key_files_stop_the_start_naming_the_file() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let data = dir.path().join("data");
    let api_key = dir.path().join("api.key");
    std::fs::write(&api_key, "k-1\n").expect("the API key file");
    std::fs::set_permissions(&api_key, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let world_readable = api_key.display().to_string();
    // Issue 25, finding 12: a key file every user can read was taken silently.
    let stderr = refused_start(&data, &["--api-key-file", &world_readable]).await;
    assert!(stderr.contains(&world_readable) && stderr.contains("readable by every user"), "{stderr}");
    std::fs::set_permissions(&api_key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let api_key = api_key.display().to_string();

    let missing = dir.path().join("no-such.key").display().to_string();
    let stderr = refused_start(&data, &["--api-key-file", &missing]).await;
    assert!(stderr.contains(&missing) && stderr.contains("API key file"), "{stderr}");

    let short = dir.path().join("short.key");
    std::fs::write(&short, "0123abcd\n").expect("a short key");
    let short = short.display().to_string();
    let stderr = refused_start(&data, &["--api-key-file", &api_key, "--secret-key-file", &short]).await;
    assert!(stderr.contains(&short) && stderr.contains("64 hexadecimal digits"), "{stderr}");

    let stderr = refused_start(&data, &[]).await;
    assert!(stderr.contains("--api-key-file"), "no key at all names the flag: {stderr}");
}
