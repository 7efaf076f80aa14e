//! The Docker provider end to end: the real `standby-server --provider
//! docker`, the sandbox image built from `Dockerfile.sandbox` with the
//! `standby` under test, real containers on a network of the test's own.
//! Warm and cold runs, Tier 2 and Tier 1 follow-ups on containers, a
//! deleted container, a server restart that adopts its containers and
//! removes its orphans, and the auto-stop floor on a real container.
//!
//! Each test has its own data directory (so its own instance label) and
//! network, removed by a guard however the test ends. Under `CI=true` they
//! fail when no engine answers; elsewhere they are skipped, loudly.

use serde_json::json;
use standby_e2e::docker::{self, SPY_IMAGE, Server, WAIT, inspect, sandbox_of, spied_credentials};
use standby_protocol::{PROTOCOL_HEADER, PROTOCOL_VERSION, SPEC_PATH};

#[tokio::test]
async fn a_warm_run_takes_a_prepared_container_which_is_unprivileged_and_holds_no_credential() {
    let Some(server) = Server::start("warm", &["--pool-size", "1"]).await else { return };
    let standby = server.ready_standby().await;
    // The container as the engine has it.
    assert_eq!(inspect(&standby, "{{.Config.User}}").as_deref(), Some("10001:10001"));
    assert_eq!(inspect(&standby, "{{.HostConfig.Privileged}}").as_deref(), Some("false"));
    assert_eq!(inspect(&standby, "{{json .HostConfig.CapDrop}}").as_deref(), Some("[\"ALL\"]"));
    assert_eq!(inspect(&standby, "{{json .HostConfig.CapAdd}}").as_deref(), Some("null"));
    assert_eq!(inspect(&standby, "{{len .Mounts}}").as_deref(), Some("0"), "no host path mounted");
    let env = inspect(&standby, "{{json .Config.Env}}").unwrap_or_default();
    assert!(!env.contains("STANDBY_"), "no configuration or credential in the container's: {env}");
    assert_eq!(
        inspect(&standby, "{{index .Config.Labels \"standby.instance\"}}").as_deref(),
        Some(server.cleanup.instance().as_str())
    );
    assert_eq!(inspect(&standby, "{{json .Config.Cmd}}").as_deref(), Some("[\"hold\"]"));

    let run = server
        .run_to_end(json!({"command": ["sh", "-c", "id -u; cat .setup-runs; echo token=${STANDBY_TOKEN:-none}"]}))
        .await;
    assert_eq!(run["path"], "warm", "{run}");
    assert_eq!(sandbox_of(&run), standby);
    let log = server.text_log(&run).await;
    // The run's view says whether the agent reported its log whole: a
    // failure here shows it with the agents' own logs.
    let view = server.get(&format!("/v1/runs/{}", run["id"].as_str().expect("an id"))).await;
    assert!(
        log.contains("10001") && log.contains("run") && log.contains("token=none"),
        "{log}\nlog_complete {} log_lost_bytes {}\n{}",
        view["log_complete"],
        view["log_lost_bytes"],
        server.agent_logs()
    );
    server.stop().await;
}

#[tokio::test]
async fn a_cold_run_gets_a_fresh_container() {
    let Some(server) =
        Server::start("cold", &["--pool-size", "0", "--warm-idle", "0s", "--park-stopped", "false"]).await
    else {
        return;
    };
    let run = server.run_to_end(json!({"command": ["sh", "-c", "echo cold-ran; cat .setup-runs"]})).await;
    assert_eq!(run["path"], "cold", "{run}");
    let log = server.text_log(&run).await;
    assert!(log.contains("cold-ran"), "{log}");
    server.stop().await;
}

#[tokio::test]
async fn tier_2_a_follow_up_is_a_new_exec_in_the_running_container_without_a_restart() {
    let args = ["--pool-size", "0", "--warm-idle", "60s"];
    let Some(server) = Server::start("tier-2", &args).await else { return };
    let first = server
        .turn("chat-2", "echo note-from-turn-1 > note.txt; setsid sh -c 'exec sleep 1000' </dev/null >/dev/null 2>&1 &")
        .await;
    let sandbox_id = sandbox_of(&first);
    server.parked(&sandbox_id, "running").await;
    let started = inspect(&sandbox_id, "{{.State.StartedAt}}").expect("the container");
    assert_eq!(inspect(&sandbox_id, "{{.State.Running}}").as_deref(), Some("true"));

    let count =
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 1000' || true";
    let second =
        server.turn("chat-2", &format!("cat note.txt; echo sleepers=$({count}); cat .setup-runs | wc -l")).await;
    assert_eq!(second["path"], "parked_running", "{second}");
    assert_eq!(sandbox_of(&second), sandbox_id);
    let log = server.text_log(&second).await;
    assert!(log.contains("note-from-turn-1"), "the last turn's file: {log}");
    assert!(log.contains("sleepers=0"), "what the last turn left running was cleared: {log}");
    assert_eq!(
        inspect(&sandbox_id, "{{.State.StartedAt}}").as_deref(),
        Some(started.as_str()),
        "no container restart between the turns"
    );
    server.stop().await;
}

#[tokio::test]
async fn tier_1_a_follow_up_starts_the_stopped_container() {
    let Some(server) = Server::start("tier-1", &["--pool-size", "0", "--warm-idle", "0s"]).await else { return };
    let first = server.turn("chat-1", "echo note-from-turn-1 > note.txt").await;
    let sandbox_id = sandbox_of(&first);
    server.parked(&sandbox_id, "stopped").await;
    server
        .until("the container stopped", async || {
            (inspect(&sandbox_id, "{{.State.Running}}").as_deref() == Some("false")).then_some(())
        })
        .await;
    let stopped_at = inspect(&sandbox_id, "{{.State.StartedAt}}").expect("the container");

    let second = server.turn("chat-1", "cat note.txt; echo setup-runs=$(wc -l < .setup-runs)").await;
    // Without the start, the agent's exec fails in a stopped container and
    // the turn falls back to a cold sandbox.
    assert_eq!(second["path"], "parked_stopped", "{second}\n{}", server.agent_logs());
    assert_eq!(sandbox_of(&second), sandbox_id);
    assert!(second["resume"]["fallback"].is_null(), "{second}");
    let log = server.text_log(&second).await;
    assert!(log.contains("note-from-turn-1") && log.contains("setup-runs=1"), "{log}");
    assert_ne!(inspect(&sandbox_id, "{{.State.StartedAt}}"), Some(stopped_at), "the container was started again");
    server.stop().await;
}

#[tokio::test]
async fn a_resume_of_a_removed_container_falls_back_to_cold_with_the_reason() {
    let Some(server) = Server::start("removed", &["--pool-size", "0", "--warm-idle", "0s"]).await else { return };
    let first = server.turn("chat-3", "echo note > note.txt").await;
    let sandbox_id = sandbox_of(&first);
    server.parked(&sandbox_id, "stopped").await;
    docker::docker(&["rm", "-f", &format!("standby-{sandbox_id}")]).expect("docker rm");

    let second = server.turn("chat-3", "test ! -e note.txt && echo fresh").await;
    assert_eq!(second["path"], "cold", "{second}");
    assert_ne!(sandbox_of(&second), sandbox_id);
    let fallback = second["resume"]["fallback"].as_str().unwrap_or_default();
    assert!(fallback.contains("no longer exists"), "the reason is recorded: {second}");
    server.stop().await;
}

#[tokio::test]
async fn a_restarted_server_adopts_its_live_containers_and_removes_its_orphans() {
    let Some(mut server) = Server::start("restart", &["--pool-size", "1"]).await else { return };
    let standby = server.ready_standby().await;
    // An orphan: labelled with this server's instance, unknown to its store.
    let instance = server.cleanup.instance();
    let orphan_id = format!("sbx_orphan{}", &instance[..8]);
    let orphan = docker::docker(&[
        "run",
        "-d",
        "--name",
        &format!("standby-{orphan_id}"),
        "--label",
        &format!("standby.instance={instance}"),
        "--label",
        &format!("standby.sandbox={orphan_id}"),
        &docker::image(),
        "hold",
    ])
    .expect("an orphan container");
    // Another server's container is never touched.
    let test_label = format!("standby.e2e={}", server.cleanup.network);
    let foreign = docker::docker(&[
        "run",
        "-d",
        "--label",
        "standby.instance=someone-else",
        "--label",
        &test_label,
        &docker::image(),
        "hold",
    ])
    .expect("a foreign container");

    server.process.as_ref().expect("the server runs").crash().await;
    server.process = Some(server.builder.start().await);
    server.until("the orphan removed", async || docker::docker(&["inspect", &orphan]).is_none().then_some(())).await;
    assert!(docker::docker(&["inspect", &foreign]).is_some(), "another server's container is left alone");
    // The standby's container and agent were adopted: it reconnects to the
    // new server and takes a run, warm.
    let again = server.ready_standby().await;
    assert_eq!(again, standby, "the same standby, adopted\n{}", server.agent_logs());
    let run = server.run_to_end(json!({"command": ["sh", "-c", "echo adopted"]})).await;
    assert_eq!((run["path"].as_str(), sandbox_of(&run)), (Some("warm"), standby), "{run}");
    server.stop().await;
}

/// An adopted agent's end comes through no exec this server started: its
/// container killed under a run must still fail the run at once, not
/// after the run silence bound (five minutes here, past the wait).
#[tokio::test]
async fn a_run_on_an_adopted_container_that_is_killed_fails_without_waiting_out_the_silence_bound() {
    let Some(mut server) = Server::start("adopted-kill", &["--pool-size", "1", "--run-lost-after", "5m"]).await else {
        return;
    };
    let standby = server.ready_standby().await;
    server.process.as_ref().expect("the server runs").crash().await;
    server.process = Some(server.builder.start().await);
    assert_eq!(server.ready_standby().await, standby, "the standby adopted\n{}", server.agent_logs());
    let id = server.submit(&json!({"command": ["sleep", "300"]})).await;
    server
        .until("the run started on the adopted container", async || {
            let run = server.run(&id).await;
            (run["state"] == "running").then_some(())
        })
        .await;
    docker::docker(&["kill", &format!("standby-{standby}")]).expect("docker kill");
    let run = server.finished(&id, WAIT).await;
    assert_eq!(run["state"], "failed", "{run}\n{}", server.agent_logs());
    assert_eq!(sandbox_of(&run), standby, "{run}");
    server.stop().await;
}

#[tokio::test]
async fn the_auto_stop_floor_keeps_a_warm_container_running_through_its_window() {
    // One provider minute of 1 s: an auto-stop of two minutes alone would
    // stop the kept container inside its 4 s window; the floor
    // (ceil(4 s / 1 s) + 5 = 9 minutes) holds it off until the window ends
    // and the dispatcher parks it stopped itself.
    let args = ["--pool-size", "0", "--warm-idle", "4s", "--auto-stop", "2", "--provider-minute", "1s"];
    let Some(server) = Server::start("auto-stop", &args).await else { return };
    let first = server.turn("chat-4", "true").await;
    let sandbox_id = sandbox_of(&first);
    let parked = server.parked(&sandbox_id, "running").await;
    assert_eq!(parked["auto_stop_minutes"], 9, "{parked}");
    server.parked(&sandbox_id, "stopped").await;
    let log = std::fs::read_to_string(server.log_path()).expect("the server log");
    let ended = log.lines().position(|l| l.contains("warm idle window ended") && l.contains(&sandbox_id));
    let auto_stopped = log.lines().position(|l| l.contains("idle auto-stop") && l.contains(&sandbox_id));
    assert!(ended.is_some(), "the window ended first\n{}", server.agent_logs());
    assert!(auto_stopped.is_none_or(|at| Some(at) > ended), "the provider stopped it inside its window");
    // Parked stopped once its agent exited; the container's own stop (PID 1
    // within the stop grace) completes after that.
    server
        .until("the container stopped", async || {
            (inspect(&sandbox_id, "{{.State.Running}}").as_deref() == Some("false")).then_some(())
        })
        .await;
    server.stop().await;
}

#[tokio::test]
async fn an_adopted_container_gets_its_recorded_auto_stop_back_after_a_restart() {
    // A provider minute of 60 s: the kept container's auto-stop is the
    // floor ceil(60 s / 60 s) + 5 = 6 minutes, out of reach of the test.
    let args = ["--pool-size", "0", "--warm-idle", "60s", "--auto-stop", "1", "--provider-minute", "60s"];
    let Some(mut server) = Server::start("auto-stop-restart", &args).await else { return };
    let first = server.turn("chat-5", "true").await;
    let sandbox_id = sandbox_of(&first);
    let parked = server.parked(&sandbox_id, "running").await;
    assert_eq!(parked["auto_stop_minutes"], 6, "{parked}");

    // While the server is down, the kept container's waiting agent dies:
    // the restarted server finds the container running without an agent
    // and keeps it parked running until its window ends, 60 s on. It is
    // restarted with a minute of 1 s, so the recorded six minutes are 6 s:
    // only the provider's timer, given its minutes back from the store,
    // stops it before the window ends.
    server.process.as_ref().expect("the server runs").crash().await;
    let kill_agent = "for p in /proc/[0-9]*; do [ \"$(tr '\\0' ' ' < $p/cmdline)\" = '/usr/local/bin/standby ' ] && kill -9 ${p#/proc/}; done; true";
    // As the container's user: root there has no capability to signal it.
    docker::docker(&["exec", &format!("standby-{sandbox_id}"), "sh", "-c", kill_agent]).expect("kill the agent");
    server.builder = server.builder.clone().with_arg("--provider-minute", "1s");
    server.process = Some(server.builder.start().await);
    server
        .until("the adopted container auto-stopped", async || {
            (inspect(&sandbox_id, "{{.State.Running}}").as_deref() == Some("false")).then_some(())
        })
        .await;
    let log = std::fs::read_to_string(server.log_path()).expect("the server log");
    let line = |needle: &str| log.lines().any(|l| l.contains(needle) && l.contains(&sandbox_id));
    assert!(line("auto-stop restored from the store"), "{}", server.agent_logs());
    assert!(line("idle auto-stop"), "the provider's timer stopped it\n{}", server.agent_logs());
    assert!(!line("warm idle window ended"), "not the dispatcher's window");
    server.stop().await;
}

#[tokio::test]
async fn an_archived_sandbox_is_made_again_from_its_image_and_its_image_removed_by_age() {
    // Minutes of 1 s: archived 2 s after its stop, never removed until the
    // restart below (so that no load can let the age pass before the
    // resume), then removed 8 s after its stop.
    let args = [
        "--pool-size",
        "0",
        "--warm-idle",
        "0s",
        "--auto-archive",
        "2",
        "--auto-delete",
        "0",
        "--provider-minute",
        "1s",
    ];
    let Some(mut server) = Server::start("archive", &args).await else { return };
    let first = server.turn("chat-6", "echo note-from-turn-1 > note.txt").await;
    let sandbox_id = sandbox_of(&first);
    let image = format!("standby-archive:{sandbox_id}");
    let archived = async || {
        let image_there =
            docker::docker(&["image", "inspect", "--format", "{{index .Config.Labels \"standby.sandbox\"}}", &image]);
        let container_gone = inspect(&sandbox_id, "{{.Id}}").is_none();
        (container_gone && image_there.as_deref() == Some(sandbox_id.as_str())).then_some(())
    };
    server.until("the stopped container archived to its image", archived).await;

    // A Tier 1 resume makes the container again from the image.
    let second = server.turn("chat-6", "cat note.txt; echo setup-runs=$(wc -l < .setup-runs)").await;
    assert_eq!(second["path"], "parked_stopped", "{second}\n{}", server.agent_logs());
    assert_eq!(sandbox_of(&second), sandbox_id);
    let log = server.text_log(&second).await;
    assert!(log.contains("note-from-turn-1") && log.contains("setup-runs=1"), "the archived files: {log}");
    let server_log = std::fs::read_to_string(server.log_path()).expect("the server log");
    assert!(server_log.contains("made again from its image"), "{}", server.agent_logs());

    // Stopped again, archived again, then (by a server restarted with a
    // retention) removed by age: the next turn finds nothing and falls
    // back to cold with the reason.
    // The restart comes before the archive's removal, so that the
    // restarted server finds its kept sandbox and the removal is seen by
    // the next turn's resume, not by the restart's adoption.
    server.parked(&sandbox_id, "stopped").await;
    server.process.as_ref().expect("the server runs").crash().await;
    server.builder = server.builder.clone().with_arg("--auto-delete", "8");
    server.process = Some(server.builder.start().await);
    server.until("the sandbox archived again", archived).await;
    server
        .until("the archive image removed by age", async || {
            docker::docker(&["image", "inspect", &image]).is_none().then_some(())
        })
        .await;
    let third = server.turn("chat-6", "test ! -e note.txt && echo fresh").await;
    assert_eq!(third["path"], "cold", "{third}");
    let fallback = third["resume"]["fallback"].as_str().unwrap_or_default();
    assert!(fallback.contains("no longer exists"), "the reason is recorded: {third}");
    server.stop().await;
}

/// Every agent start gets a credential of its own: once the next agent of
/// a container has started, the previous one's is refused (a container
/// outlives its agents, so a credential left in it must be worthless).
#[tokio::test]
async fn a_previous_agent_starts_credential_is_refused_after_the_next_start() {
    if !docker::spy_available("previous credential") {
        return;
    }
    let server = Server::start_on(SPY_IMAGE, &["--pool-size", "0", "--warm-idle", "60s"]).await;
    let first = server.turn("chat-credentials", "true").await;
    let sandbox_id = sandbox_of(&first);
    server.parked(&sandbox_id, "running").await;
    let given = spied_credentials(&sandbox_id);
    assert_eq!(given.len(), 2, "the first agent and the next one, each with its credential: {given:?}");
    assert_ne!(given[0], given[1], "a fresh credential for the next start");

    let http = reqwest::Client::new();
    let spec = async |credential: &str| {
        let response = http
            .get(format!("{}{SPEC_PATH}", server.url()))
            .bearer_auth(credential)
            .header(PROTOCOL_HEADER, PROTOCOL_VERSION)
            .send()
            .await
            .expect("the server answers");
        response.status().as_u16()
    };
    assert_eq!(spec(&given[0]).await, 401, "the previous start's credential is refused");
    assert_eq!(spec(&given[1]).await, 200, "the current agent's is accepted");
    server.stop().await;
}
