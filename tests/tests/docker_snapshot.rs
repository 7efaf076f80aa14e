//! Prepared snapshots on the Docker provider (docs/deploy.md, "Prepared
//! snapshots"), end to end: the real `standby-server --provider docker`,
//! real containers, the snapshot a real image on the Engine.
//!
//! - the first ready standby of a workspace is committed to
//!   `standby-snapshot:<fingerprint>-<base>`, labelled with what it holds;
//! - every layer of that image, and its configuration, is searched for
//!   anything shaped like a credential (`sby_…`, `run_…`) and for the
//!   exact secret and git credential bytes of runs submitted while it was
//!   being made: none is there;
//! - a cold sandbox starts from it, its agent refreshing the snapshot's
//!   workspace instead of setting it up again (the setup step's counter
//!   says one run, the snapshot's).
//!
//! Each test prepares a workspace of its own (its fingerprint, so its
//! snapshot, is its own). Under `CI=true` they fail when no engine answers;
//! elsewhere they are skipped, loudly.

use std::io::Read as _;

use serde_json::{Value, json};
use standby_e2e::docker::{self, Server, inspect, sandbox_of};

/// A spec whose fingerprint is this test's alone: its setup step counts
/// its runs in the workspace.
fn spec(test: &str) -> Value {
    json!({
        "workspace": {
            "repos": [],
            "setup": [{"name": test, "command": ["sh", "-c", "echo run >> .setup-runs"], "timeout_s": 60}]
        },
        "shell": ["/bin/sh"]
    })
}

/// The snapshot images of `spec`'s workspace grown from the image under
/// test: one a run of an earlier build left on the Engine is another's.
fn snapshots_of(spec: &Value) -> Vec<String> {
    let workspace: standby_protocol::Workspace =
        serde_json::from_value(spec["workspace"].clone()).expect("a workspace");
    let fingerprint = format!("label=standby.snapshot.fingerprint={}", standby_protocol::fingerprint(&workspace));
    let base = docker::docker(&["image", "inspect", "--format", "{{.Id}}", &docker::image()]).expect("the base image");
    let base = format!("label=standby.snapshot.base={base}");
    docker::docker(&["images", "--filter", &fingerprint, "--filter", &base, "--format", "{{.Repository}}:{{.Tag}}"])
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// What `bytes` hold that is shaped like a credential the server mints
/// (`sby_` or `run_`, an id of 16 letters and digits, `_`, then 43 of
/// them: `control-plane/src/credential.rs`) or is one of `exact`: the first
/// found. The lengths are exact: the agent's own binary holds names such
/// as `run_credential` next to other identifiers.
fn leaked(bytes: &[u8], exact: &[&str]) -> Option<String> {
    let patterns: Vec<&[u8]> = [b"sby_".as_slice(), b"run_".as_slice()]
        .into_iter()
        .chain(exact.iter().map(|needle| needle.as_bytes()))
        .collect();
    let searcher = aho_corasick::AhoCorasick::new(&patterns).expect("patterns");
    for found in searcher.find_overlapping_iter(bytes) {
        let start = found.start();
        if found.pattern().as_usize() >= 2 {
            return Some(String::from_utf8_lossy(&bytes[start..found.end()]).into_owned());
        }
        let rest = &bytes[found.end()..];
        let id_len = rest.iter().take_while(|b| b.is_ascii_alphanumeric()).count();
        let Some(after_id) = rest.get(id_len..) else { continue };
        if id_len != 16 || after_id.first() != Some(&b'_') {
            continue;
        }
        let secret_len = after_id[1..].iter().take_while(|b| b.is_ascii_alphanumeric()).count();
        if secret_len == 43 {
            let end = found.end() + id_len + 1 + secret_len;
            return Some(String::from_utf8_lossy(&bytes[start..end]).into_owned());
        }
    }
    None
}

/// Every layer and the configuration of `image`, as `docker save` writes
/// them (uncompressed tars, JSON), each entry's bytes with its name.
fn saved_entries(image: &str, dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let tar = dir.join("snapshot.tar");
    docker::docker(&["save", "-o", &tar.display().to_string(), image]).expect("docker save");
    let mut bytes = Vec::new();
    std::fs::File::open(&tar).expect("the saved image").read_to_end(&mut bytes).expect("readable");
    tar_entries(&bytes)
}

/// The regular files of a (ustar) tar archive, nested layer tars
/// included: a layer's files are searched one by one.
fn tar_entries(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut entries = Vec::new();
    let mut at = 0;
    while at + 512 <= bytes.len() {
        let header = &bytes[at..at + 512];
        if header.iter().all(|b| *b == 0) {
            break;
        }
        let name = String::from_utf8_lossy(header[..100].split(|b| *b == 0).next().unwrap_or_default()).into_owned();
        let size_field =
            String::from_utf8_lossy(&header[124..136]).trim_matches(|c: char| c == '\0' || c == ' ').to_owned();
        let size = usize::from_str_radix(&size_field, 8).unwrap_or(0);
        let data = bytes.get(at + 512..at + 512 + size).unwrap_or_default().to_vec();
        if matches!(header[156], b'0' | 0) {
            let nested = data.len() > 512 && data.get(257..262) == Some(b"ustar".as_slice());
            if nested {
                entries.extend(tar_entries(&data).into_iter().map(|(inner, data)| (format!("{name}:{inner}"), data)));
            } else {
                entries.push((name, data));
            }
        }
        at += 512 + size.div_ceil(512) * 512;
    }
    entries
}

#[tokio::test]
async fn a_prepared_standby_becomes_a_snapshot_that_holds_no_credential_or_secret() {
    let test = "snapshot-secrets";
    if !docker::available(test) {
        return;
    }
    let spec = spec(test);
    let server = Server::start_with_spec(&docker::image(), &spec, &["--pool-size", "1", "--snapshot-keep", "2"]).await;
    // Runs with secrets and git credentials submitted while the first
    // standby prepares and is committed: none may be placed on it then.
    let secret = "snapshot-test-secret-4f1d9a";
    let git_password = "snapshot-test-git-7c2e55";
    let body = json!({
        "command": ["sh", "-c", "echo ran"],
        "secrets": {"API_TOKEN": secret},
        "git_credentials": [{"protocol": "https", "host": "git.example", "username": "bot", "password": git_password}],
    });
    let early: Vec<String> = futures::future::join_all((0..2).map(|_| server.submit(&body))).await;
    let standby = server.ready_standby().await;
    let images = server.until("the snapshot image", async || Some(snapshots_of(&spec)).filter(|i| !i.is_empty())).await;
    assert_eq!(images.len(), 1, "one snapshot per workspace: {images:?}");
    let image = &images[0];
    assert!(image.starts_with("standby-snapshot:"), "{image}");
    for id in &early {
        let run = server.finished(id, docker::WAIT).await;
        assert_ne!(sandbox_of(&run), standby, "a run was placed on the standby being committed: {run}");
    }

    let base = docker::docker(&["image", "inspect", "--format", "{{.Id}}", &docker::image()]).expect("the base image");
    let label = |key: &str| {
        docker::docker(&["image", "inspect", "--format", &format!("{{{{index .Config.Labels \"{key}\"}}}}"), image])
    };
    assert_eq!(label("standby.snapshot.base"), Some(base));
    let env = docker::docker(&["image", "inspect", "--format", "{{json .Config.Env}}", image]).unwrap_or_default();
    let tag = image.trim_start_matches("standby-snapshot:");
    assert!(env.contains(&format!("STANDBY_SNAPSHOT={tag}")), "the agent is told: {env}");

    let entries = saved_entries(image, server.dir.path());
    assert!(entries.iter().any(|(name, _)| name.ends_with(".setup-runs")), "the prepared workspace is in a layer");
    for (name, data) in &entries {
        assert_eq!(leaked(data, &[secret, git_password]), None, "in {name} of {image}");
    }
    server.stop().await;
}

#[tokio::test]
async fn a_cold_sandbox_starts_from_the_snapshot_and_refreshes_instead_of_setting_up() {
    let test = "snapshot-cold";
    if !docker::available(test) {
        return;
    }
    let spec = spec(test);
    // The commit pauses the standby: heartbeats far enough apart that its
    // socket outlives a commit slowed by a loaded machine, as it does with
    // the default interval (15 s).
    let server = Server::start_with_spec(
        &docker::image(),
        &spec,
        &[
            "--pool-size",
            "1",
            "--snapshot-keep",
            "2",
            "--warm-idle",
            "0s",
            "--park-stopped",
            "false",
            "--heartbeat-interval",
            "2s",
        ],
    )
    .await;
    let images = server.until("the snapshot image", async || Some(snapshots_of(&spec)).filter(|i| !i.is_empty())).await;
    // The image is listed before the server has it as the snapshot of its
    // workspace; the standby it was made of is placed nowhere until then.
    let standby = server.ready_standby().await;

    // The pool's one standby takes the first run; the second is cold.
    let body = json!({"command": ["sh", "-c", "cat .setup-runs; sleep 3"]});
    let (first, second) = futures::join!(server.submit(&body), server.submit(&body));
    // The cold agent's log and its container's image are read while its
    // run sleeps: the server deletes both with the sandbox once the run
    // ended.
    let (refreshed, agent_log, made_from) = server
        .until("the cold sandbox's agent refreshing from the snapshot", async || {
            for id in [&first, &second] {
                let run = server.run(id).await;
                let Some(sandbox) = run["attempts"][0]["sandbox_id"].as_str().filter(|sandbox| *sandbox != standby)
                else {
                    continue;
                };
                let log = server.data_dir().join(format!("sandbox-logs/{sandbox}.log"));
                let log = std::fs::read_to_string(log).unwrap_or_default();
                if log.contains("refreshing it instead of cloning") {
                    return Some((sandbox.to_owned(), log, inspect(sandbox, "{{.Config.Image}}")));
                }
            }
            None
        })
        .await;
    let first = server.finished(&first, docker::WAIT).await;
    let second = server.finished(&second, docker::WAIT).await;
    let (warm, cold) = if first["path"] == "warm" { (first, second) } else { (second, first) };
    assert_eq!((warm["path"].as_str(), cold["path"].as_str()), (Some("warm"), Some("cold")), "{warm}\n{cold}");
    assert_eq!(sandbox_of(&warm), standby);
    let cold_sandbox = sandbox_of(&cold);
    assert_eq!(made_from.as_ref(), Some(&images[0]), "made from the snapshot");
    assert_eq!(server.text_log(&cold).await.trim(), "run", "the snapshot's setup, not run again");
    assert_eq!(refreshed, cold_sandbox, "the cold sandbox's agent refreshed from the snapshot:\n{agent_log}");
    server.stop().await;
}

/// A commit pauses the container it copies: a clean stop during one
/// leaves no container running once the commit has unpaused it.
#[tokio::test]
async fn a_clean_stop_during_a_snapshot_leaves_no_container_running() {
    let test = "snapshot-stop";
    if !docker::available(test) {
        return;
    }
    // 200 MiB of workspace: the commit takes seconds, time to stop
    // the server while the container is paused.
    let spec = json!({
        "workspace": {
            "repos": [],
            "setup": [{"name": test, "command": ["sh", "-c", "head -c 209715200 /dev/urandom > .weight"], "timeout_s": 120}]
        },
        "shell": ["/bin/sh"]
    });
    let mut server =
        Server::start_with_spec(&docker::image(), &spec, &["--pool-size", "1", "--snapshot-keep", "2"]).await;
    let instance = format!("label=standby.instance={}", server.cleanup.instance());
    let paused = server
        .until("the standby paused by its snapshot's commit", async || {
            docker::docker(&["ps", "-q", "--filter", &instance, "--filter", "status=paused"])
                .filter(|id| !id.is_empty())
        })
        .await;
    let process = server.process.take().expect("the server runs");
    let status = process.stop(nix::sys::signal::Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status} on SIGTERM");
    let running = docker::docker(&["ps", "-q", "--filter", &instance]).unwrap_or_default();
    let log = std::fs::read_to_string(server.dir.path().join("server.log")).unwrap_or_default();
    assert_eq!(running, "", "the container paused by the commit ({paused}) was left running; the server's log:\n{log}");
}

#[test]
fn the_credential_search_finds_what_the_server_mints() {
    let minted = format!("{}_{}_{}", "sby", "abc123def456GHIJ", "A".repeat(43));
    assert_eq!(leaked(format!("x{minted}\n").as_bytes(), &[]), Some(minted));
    assert_eq!(leaked(b"standby_x_short run_ nothing", &[]), None);
    let binary = b"run_credentialruntrace_contextAssignmentstateheartbeatAgentMessageinternally";
    assert_eq!(leaked(binary, &[]), None, "names in the agent's binary are not credentials");
    assert_eq!(leaked(b"API_TOKEN=hunter2", &["hunter2"]), Some("hunter2".to_owned()));
}
