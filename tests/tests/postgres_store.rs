//! The real `standby-server serve --store postgres://…` with its local
//! provider and real agents: a run goes warm, the server is killed, and a
//! new one on the same database has every record of it.
//!
//! Needs PostgreSQL (`STANDBY_TEST_POSTGRES`, see `scripts/postgres`): each
//! test gets a schema of its own; under `CI=true` a missing one fails it.

use std::hash::{BuildHasher, RandomState};
use std::os::unix::fs::PermissionsExt as _;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use standby_e2e::GitRepo;
use standby_e2e::harness::write_json;
use standby_e2e::postgres::TestSchema;
use standby_e2e::server_process::{ServerBuilder, ServerProcess, keygen, server_bin};

const WAIT: Duration = Duration::from_secs(60);

async fn ready(server: &ServerProcess, n: usize) -> Vec<String> {
    server
        .until(&format!("{n} ready standbys"), WAIT, async || {
            let ready: Vec<String> = server
                .sandboxes()
                .await
                .iter()
                .filter(|sandbox| sandbox["candidate"] == true)
                .filter_map(|sandbox| sandbox["id"].as_str().map(str::to_owned))
                .collect();
            (ready.len() >= n).then_some(ready)
        })
        .await
}

/// Waits until the server leads (its `/healthz` says so).
async fn leading(server: &ServerProcess) {
    server
        .until("the server to lead", WAIT, async || {
            let (_, health) = server.try_call(reqwest::Method::GET, "/healthz", None, None).await?;
            health.as_str().is_some_and(|text| text.starts_with("ok leader")).then_some(())
        })
        .await;
}

/// The password of a `scheme://user:password@host/…` URL, if it has one.
fn password(url: &str) -> Option<&str> {
    let (_, rest) = url.split_once("://")?;
    let (user_info, _) = rest.split_once('?').map_or(rest, |(location, _)| location).rsplit_once('@')?;
    user_info.split_once(':').map(|(_, password)| password)
}

#[tokio::test]
async fn a_server_on_postgres_runs_warm_and_a_restart_keeps_every_record() {
    let Some(schema) =
        TestSchema::create("postgres_store::a_server_on_postgres_runs_warm_and_a_restart_keeps_every_record")
    else {
        return;
    };
    let repo = GitRepo::new(&[("README.md", "sample\n")]);
    let dir = tempfile::Builder::new().prefix("standby-pg-e2e-").tempdir().expect("a temp dir");
    let spec = dir.path().join("spec.json");
    write_json(
        &spec,
        &json!({"workspace": {"repos": [{"url": repo.url(), "path": "app", "ref": "main"}]}, "shell": ["/bin/sh"]}),
    );
    let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir.path())));
    let data = dir.path().join("data");
    let url = schema.url();
    let key = dir.path().join("secret.key");
    keygen(&key);
    let builder = ServerBuilder::new(&data, &dir.path().join("server.log"), &mark)
        .args(&["--secret-key-file", &key.display().to_string()])
        .args(&["--linger", "3s", "--stop-grace", "5s", "--pool-size", "1", "--heartbeat-interval", "500ms"])
        .args(&["--spec", &spec.display().to_string(), "--store", &url])
        // A server on PostgreSQL is a replica: a restarted one leads once
        // the killed one's lease has lapsed.
        .args(&["--lease-ttl", "1s"])
        .cluster_secret(&dir.path().join("cluster.secret"));

    let server = builder.start().await;
    leading(&server).await;
    ready(&server, 1).await;
    let id = server.submit(&json!({"command": ["sh", "-c", "echo kept in postgres; exit 3"]})).await;
    let before = server.finished(&id, WAIT).await;
    assert_eq!((before["state"].as_str(), before["exit_code"].as_i64()), (Some("exited"), Some(3)), "{before}");
    assert_eq!(before["path"], "warm", "{before}");
    let log_before = server.log(&id).await;
    assert!(String::from_utf8_lossy(&log_before).contains("kept in postgres"));
    let events_before: Value = server.get(&format!("/v1/runs/{id}/events")).await;
    // The standby that replaced the one the run took.
    let pool = ready(&server, 1).await;
    // The hard way: SIGKILL, nothing flushed on the way out.
    server.stop_leaving_nothing(Signal::SIGKILL).await;

    assert!(!data.join("standby.db").exists(), "no SQLite file beside the PostgreSQL store");
    assert_eq!(schema.query_text(&format!("SELECT state FROM runs WHERE id = '{id}'")), ["exited"]);

    let server = builder.start().await;
    leading(&server).await;
    let after = server.run(&id).await;
    for field in ["state", "exit_code", "path", "attempts", "timestamps"] {
        assert_eq!(after[field], before[field], "{field} after the restart");
    }
    assert_eq!(server.log(&id).await, log_before, "the log after the restart");
    assert_eq!(server.get(&format!("/v1/runs/{id}/events")).await, events_before, "the events after the restart");
    let back = ready(&server, 1).await;
    assert_eq!(back, pool, "the same standby, relaunched on its workspace");
    let next = server.submit(&json!({"command": ["true"]})).await;
    assert_eq!(server.finished(&next, WAIT).await["path"], "warm");
    let logs = server.logs();
    server.stop_leaving_nothing(Signal::SIGTERM).await;

    assert!(logs.contains("[REDACTED]@"), "the store is named, without its password:\n{logs}");
    if let Some(password) = password(&url) {
        assert!(!logs.contains(&format!(":{password}@")), "the password is in the server's log:\n{logs}");
    }
}

/// `standby-server serve` on `store` with `args`, which must refuse to
/// start; its stderr.
async fn refused_start(dir: &std::path::Path, store: &str, args: &[&str]) -> String {
    let api_key = dir.join("api.key");
    std::fs::write(&api_key, "k-1\n").expect("the API key file");
    std::fs::set_permissions(&api_key, std::fs::Permissions::from_mode(0o600)).expect("chmod the API key file");
    let secret = dir.join("cluster.secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef").expect("the cluster secret");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod the cluster secret");
    let mut command = tokio::process::Command::new(server_bin());
    command.env("STANDBY_SERVER_CLUSTER_SECRET_FILE", &secret);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(|name| name.starts_with("STANDBY_")) {
            command.env_remove(name);
        }
    }
    let output = command
        .args(["serve", "--listen", "127.0.0.1:0", "--provider", "spool", "--store", store, "--api-key-file"])
        .arg(&api_key)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(args)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(WAIT, output).await.expect("it stops at once").expect("it runs");
    assert!(!output.status.success(), "it started: {}", String::from_utf8_lossy(&output.stdout));
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Finding 8 of issue 25: replicas that each generated a key of their own
/// opened nothing the others sealed. On PostgreSQL a server generates no
/// key (a missing file stops it, naming `keygen`), and one whose key is
/// not the store's (the first server's) refuses to start, naming its key
/// file and the store.
#[tokio::test]
async fn a_server_on_postgres_generates_no_key_and_refuses_another_replicas_key() {
    let Some(schema) = TestSchema::create("postgres_store::a_server_on_postgres_refuses_another_key") else {
        return;
    };
    let dir = tempfile::Builder::new().prefix("standby-pg-key-").tempdir().expect("a temp dir");
    let url = schema.url();
    let generated = dir.path().join("data").join("secret.key");
    let stderr = refused_start(dir.path(), &url, &[]).await;
    assert!(stderr.contains(&generated.display().to_string()) && stderr.contains("standby-server keygen"), "{stderr}");
    assert!(!generated.exists(), "no key was generated");

    let first = dir.path().join("first.key");
    keygen(&first);
    let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir.path())));
    let server = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark)
        .args(&["--provider", "spool", "--store", &url, "--secret-key-file", &first.display().to_string()])
        .cluster_secret(&dir.path().join("cluster.secret"))
        .start()
        .await;
    let other = dir.path().join("other.key");
    keygen(&other);
    let other = other.display().to_string();
    let stderr = refused_start(dir.path(), &url, &["--secret-key-file", &other]).await;
    assert!(stderr.contains(&other) && stderr.contains("is not the store's"), "{stderr}");
    assert!(stderr.contains("[REDACTED]@"), "names the store: {stderr}");
    server.stop_leaving_nothing(Signal::SIGTERM).await;
}

/// Finding 11 of issue 25: at `debug`, `tokio_postgres` printed every
/// statement's parameters: run records with their env and command (user
/// data), log bytes, credential hashes. It is capped at `info` like the
/// other dependencies, whatever the filter names, a more specific target
/// included.
#[tokio::test]
async fn a_debug_log_holds_no_sql_parameters() {
    let Some(schema) = TestSchema::create("postgres_store::a_debug_log_holds_no_sql_parameters") else { return };
    let dir = tempfile::Builder::new().prefix("standby-pg-log-").tempdir().expect("a temp dir");
    let key = dir.path().join("secret.key");
    keygen(&key);
    let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir.path())));
    let server = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark)
        .args(&["--provider", "spool", "--pool-size", "1", "--store", &schema.url()])
        .cluster_secret(&dir.path().join("cluster.secret"))
        .args(&["--secret-key-file", &key.display().to_string(), "--lease-ttl", "1s"])
        .args(&["--log", "debug,tokio_postgres::query=trace,deadpool_postgres=trace"])
        .start()
        .await;
    leading(&server).await;
    let body = json!({"command": ["echo", "command-value-41c7"], "env": {"RUN_ENV": "env-value-9f3a"}});
    let id = server.submit(&body).await;
    assert_eq!(schema.query_text(&format!("SELECT id FROM runs WHERE id = '{id}'")), [id], "written");
    // A socket of the spooled standby: the server's own debug line shows
    // the filter is at debug.
    let spool = dir.path().join("data").join("spool");
    let token = server
        .until("a spooled standby credential", WAIT, async || {
            let entry = std::fs::read_dir(&spool).ok()?.flatten().next()?;
            std::fs::read_to_string(entry.path()).ok().map(|token| token.trim().to_owned())
        })
        .await;
    let socket = server.upgrade(&token).await.expect("the standby connects");
    server
        .until("the debug line of the socket", WAIT, async || {
            server.logs().contains("control connection open").then_some(())
        })
        .await;
    drop(socket);
    let logs = server.logs();
    server.stop_leaving_nothing(Signal::SIGTERM).await;
    for value in ["command-value-41c7", "env-value-9f3a"] {
        assert!(!logs.contains(value), "the debug log holds `{value}`:\n{logs}");
    }
}

/// `standby-server <args>` with `STANDBY_SERVER_STORE=store` and nothing
/// else of the test's environment: its exit code and stderr.
async fn server_command(args: &[&str], store: &str, dir: &std::path::Path) -> (Option<i32>, String) {
    let key = dir.join("api.key");
    std::fs::write(&key, "e2e-api-key").expect("the API key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod the API key");
    let mut command = tokio::process::Command::new(standby_e2e::server_process::server_bin());
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(|name| name.starts_with("STANDBY_")) {
            command.env_remove(name);
        }
    }
    command.args(args).env("STANDBY_SERVER_STORE", store).stdin(std::process::Stdio::null());
    if args.first() == Some(&"serve") {
        let secret = dir.join("cluster.secret");
        std::fs::write(&secret, "0123456789abcdef0123456789abcdef").expect("the cluster secret");
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).expect("chmod");
        command.env("STANDBY_SERVER_CLUSTER_SECRET_FILE", &secret);
        let sealing = dir.join("secret.key");
        if !sealing.exists() {
            keygen(&sealing);
        }
        command.arg("--secret-key-file").arg(&sealing);
        command.arg("--api-key-file").arg(&key).arg("--data-dir").arg(dir.join("data"));
        command.args(["--provider", "spool", "--listen", "127.0.0.1:0"]);
    }
    let output = tokio::time::timeout(WAIT, command.kill_on_drop(true).output())
        .await
        .expect("standby-server exits")
        .expect("run standby-server");
    (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
}

/// Issue 25, finding 7 (the database half): the schema's owner runs
/// `standby-server migrate`; `serve` then runs under a role granted only
/// the rows of its tables (no `CREATE`, so no table, function or trigger
/// of its own: it cannot rewrite the lease row behind the replicas'
/// backs), leads and commits. Before `migrate`, that role is refused at
/// start, naming the migration it lacks and the command.
#[tokio::test]
async fn serve_runs_under_a_role_that_may_not_create_once_migrate_ran() {
    let test = "postgres_store::serve_under_a_runtime_role";
    let Some(schema) = TestSchema::create(test) else { return };
    let Some(runtime) = schema.runtime_url(test) else { return };
    let dir = tempfile::Builder::new().prefix("standby-pg-role-").tempdir().expect("a temp dir");
    schema.execute(&format!("GRANT USAGE ON SCHEMA {} TO standby_test_app", schema.name()));

    let (code, stderr) = server_command(&["serve"], &runtime, dir.path()).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("needs migration 1") && stderr.contains("standby-server migrate"), "{stderr}");

    let (code, stderr) = server_command(&["migrate"], &schema.url(), dir.path()).await;
    assert_eq!(code, Some(0), "{stderr}");
    schema.execute(&format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO standby_test_app",
        schema.name()
    ));

    let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir.path())));
    let server = ServerBuilder::new(&dir.path().join("served"), &dir.path().join("server.log"), &mark)
        .args(&["--provider", "spool", "--pool-size", "0", "--store", &runtime, "--lease-ttl", "1s"])
        .args(&["--secret-key-file", &dir.path().join("secret.key").display().to_string()])
        .cluster_secret(&dir.path().join("cluster.secret"))
        .start()
        .await;
    leading(&server).await;
    let id = server.submit(&json!({"command": ["true"]})).await;
    assert_eq!(server.run(&id).await["id"], id.as_str(), "the run was committed");
    let privileges = schema.query_text(
        "SELECT privilege_type::text FROM information_schema.table_privileges \
         WHERE grantee = 'standby_test_app' AND privilege_type NOT IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE')",
    );
    assert!(privileges.is_empty(), "the runtime role holds {privileges:?}");
    server.stop_leaving_nothing(Signal::SIGTERM).await;
}
