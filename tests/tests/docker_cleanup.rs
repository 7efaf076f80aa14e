//! Nothing left behind, on real containers: a clean stop with `--on-stop
//! remove` removes the instance's containers, archive images and the
//! network it made; with `keep` (the default) they stay and the next start
//! adopts them (a crash's leftovers are adopted too:
//! `docker_provider.rs`'s
//! `a_restarted_server_adopts_its_live_containers_and_removes_its_orphans`);
//! `standby-server prune` removes a stopped server's instance and nothing
//! of another's, and refuses the instance of a server running on its data
//! directory.
//!
//! Each test has its own data directory, instance and network, removed by
//! the `Cleanup` guard however the test ends. Under `CI=true` they fail
//! when no engine answers; elsewhere they are skipped, loudly.

use std::path::Path;
use std::process::{Command, Output};

use nix::sys::signal::Signal;
use standby_e2e::docker::{self, Cleanup, Server, inspect, sandbox_of};
use standby_e2e::server_process::server_bin;

/// Minutes of 1 s: a thread's sandbox, stopped at once after its turn,
/// is archived to an image a second later and never removed by age.
const ARCHIVING: [&str; 10] =
    ["--pool-size", "1", "--warm-idle", "0s", "--auto-archive", "1", "--auto-delete", "0", "--provider-minute", "1s"];

/// `standby-server prune ARGS`.
fn prune(args: &[&str]) -> Output {
    Command::new(server_bin())
        .arg("prune")
        .args(args)
        .env_remove("STANDBY_SERVER_DATA_DIR")
        .output()
        .expect("run prune")
}

fn text(output: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The images labelled with the instance (its archives).
fn images(cleanup: &Cleanup) -> Vec<String> {
    let filter = format!("label=standby.instance={}", cleanup.instance());
    docker::docker(&["images", "-q", "--filter", &filter]).unwrap_or_default().lines().map(str::to_owned).collect()
}

fn network_exists(network: &str) -> bool {
    docker::docker(&["network", "inspect", network]).is_some()
}

/// A thread's sandbox archived to its image, and a ready standby's
/// container running beside it: what a stop has to deal with.
async fn archive_and_standby(server: &Server) -> String {
    let first = server.turn("chat-cleanup", "echo note > note.txt").await;
    let archived = sandbox_of(&first);
    let image = format!("standby-archive:{archived}");
    server
        .until("the thread's sandbox archived to its image", async || {
            let gone = inspect(&archived, "{{.Id}}").is_none();
            (gone && docker::docker(&["image", "inspect", &image]).is_some()).then_some(())
        })
        .await;
    server.ready_standby().await
}

fn data(server: &Server) -> &Path {
    &server.cleanup.data
}

#[tokio::test]
async fn on_stop_remove_leaves_no_container_no_archive_image_and_no_network_it_made() {
    let mut args = ARCHIVING.to_vec();
    args.extend(["--on-stop", "remove"]);
    let Some(mut server) = Server::start("on-stop remove", &args).await else { return };
    let standby = archive_and_standby(&server).await;
    assert_eq!(inspect(&standby, "{{.State.Running}}").as_deref(), Some("true"));
    assert!(!images(&server.cleanup).is_empty(), "an archive image to remove");

    let process = server.process.take().expect("the server runs");
    let log = process.log_path().to_owned();
    let status = process.stop(Signal::SIGTERM).await;
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "standby-server exited {status}\n{}", logs());
    assert_eq!(server.cleanup.containers(), Vec::<String>::new(), "no container of the instance\n{}", logs());
    assert_eq!(images(&server.cleanup), Vec::<String>::new(), "no archive image of the instance\n{}", logs());
    assert!(!network_exists(&server.cleanup.network), "the network it made is removed\n{}", logs());
}

#[tokio::test]
async fn on_stop_keep_leaves_the_stopped_containers_and_images_for_the_next_start_to_adopt() {
    let Some(mut server) = Server::start("on-stop keep", &ARCHIVING).await else { return };
    let standby = archive_and_standby(&server).await;
    let archives = images(&server.cleanup);

    let status = server.process.take().expect("the server runs").stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status}");
    assert_eq!(inspect(&standby, "{{.State.Running}}").as_deref(), Some("false"), "stopped, kept");
    assert_eq!(images(&server.cleanup), archives, "the archive images kept");
    assert!(network_exists(&server.cleanup.network), "the network kept");

    // The next start on the same data directory is the same instance and
    // adopts them.
    server.process = Some(server.builder.start().await);
    server
        .until("the kept container adopted", async || {
            let log = std::fs::read_to_string(server.log_path()).unwrap_or_default();
            log.lines().any(|line| line.contains("adopted a container") && line.contains(&standby)).then_some(())
        })
        .await;
    assert_eq!(images(&server.cleanup), archives, "the archives are its own: not removed as orphans");
    server.stop().await;
}

#[tokio::test]
async fn prune_removes_a_stopped_servers_instance_and_nothing_of_anothers() {
    let Some(mut server) = Server::start("prune", &ARCHIVING).await else { return };
    archive_and_standby(&server).await;
    let status = server.process.take().expect("the server runs").stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status}");
    let instance = server.cleanup.instance();
    let network = server.cleanup.network.clone();
    let data_dir = data(&server).display().to_string();

    // Another instance's container, running (the guard removes it).
    let other = format!("someone-else-{}", &instance[..8]);
    let foreign = docker::docker(&[
        "run",
        "-d",
        "--label",
        &format!("standby.instance={other}"),
        "--label",
        &format!("standby.e2e={network}"),
        &docker::image(),
        "hold",
    ])
    .expect("a foreign container");

    let listed = prune(&["--list", "--data-dir", &data_dir]);
    assert!(listed.status.success(), "{}", text(&listed));
    let table = String::from_utf8_lossy(&listed.stdout).into_owned();
    let row = table.lines().find(|line| line.starts_with(&instance)).unwrap_or_else(|| panic!("{}", text(&listed)));
    assert!(row.contains("no server running on it"), "{row}");
    let counts: Vec<usize> = row.split_whitespace().skip(1).take(3).map(|n| n.parse().expect("a count")).collect();
    assert_eq!(counts[1], 0, "stopped: none running: {row}");
    assert!(counts[0] >= 1 && counts[2] >= 1, "its standby's container and an archive: {row}");
    assert!(table.lines().any(|line| line.starts_with(&other)), "{}", text(&listed));

    let dry = prune(&["--instance", &instance, "--data-dir", &data_dir, "--network", &network, "--dry-run"]);
    assert!(dry.status.success(), "{}", text(&dry));
    assert!(String::from_utf8_lossy(&dry.stdout).contains("would remove"), "{}", text(&dry));
    assert!(
        !server.cleanup.containers().is_empty() && !images(&server.cleanup).is_empty(),
        "a dry run removes nothing"
    );

    let pruned = prune(&["--instance", &instance, "--data-dir", &data_dir, "--network", &network]);
    assert!(pruned.status.success(), "{}", text(&pruned));
    let summary = String::from_utf8_lossy(&pruned.stdout).into_owned();
    assert!(
        summary.contains(&format!(
            "instance {instance}: removed {} container(s), {} image(s), network {network}",
            counts[0], counts[2]
        )),
        "{}",
        text(&pruned)
    );
    assert!(String::from_utf8_lossy(&pruned.stderr).contains("removed container standby-"), "{}", text(&pruned));
    assert_eq!(server.cleanup.containers(), Vec::<String>::new(), "{}", text(&pruned));
    assert_eq!(images(&server.cleanup), Vec::<String>::new(), "{}", text(&pruned));
    assert!(!network_exists(&network), "{}", text(&pruned));
    assert_eq!(
        docker::docker(&["inspect", "--format", "{{.State.Running}}", &foreign]).as_deref(),
        Some("true"),
        "another instance's container is left alone"
    );

    // That other instance is not --data-dir's: its server cannot be seen
    // from here, and its container runs.
    let refused = prune(&["--instance", &other, "--data-dir", &data_dir]);
    assert_eq!(refused.status.code(), Some(3), "{}", text(&refused));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--force"), "{}", text(&refused));
    assert!(docker::docker(&["inspect", &foreign]).is_some(), "refused: nothing removed");
}

#[tokio::test]
async fn prune_refuses_the_instance_of_the_server_running_on_its_data_directory() {
    let Some(mut server) = Server::start("prune refused", &["--pool-size", "1"]).await else { return };
    let standby = server.ready_standby().await;
    let instance = server.cleanup.instance();
    let data_dir = data(&server).display().to_string();
    for force in [false, true] {
        let mut args = vec!["--instance", instance.as_str(), "--data-dir", &data_dir];
        if force {
            args.push("--force");
        }
        let refused = prune(&args);
        assert_eq!(refused.status.code(), Some(3), "--force {force}: {}", text(&refused));
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains("refused") && stderr.contains(&instance), "{}", text(&refused));
        assert!(stderr.contains("its server is running"), "{}", text(&refused));
    }
    assert_eq!(inspect(&standby, "{{.State.Running}}").as_deref(), Some("true"), "nothing touched");
    let listed = prune(&["--list", "--data-dir", &data_dir]);
    let table = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert!(
        table.lines().any(|line| line.starts_with(&instance) && line.contains("its server is running")),
        "{}",
        text(&listed)
    );

    // Stopped, the same prune goes through.
    let status = server.process.take().expect("the server runs").stop(Signal::SIGTERM).await;
    assert!(status.success(), "standby-server exited {status}");
    let pruned = prune(&["--instance", &instance, "--data-dir", &data_dir]);
    assert!(pruned.status.success(), "{}", text(&pruned));
    assert_eq!(server.cleanup.containers(), Vec::<String>::new(), "{}", text(&pruned));
}
