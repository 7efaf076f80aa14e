//! The Kubernetes provider end to end: the real `standby-server --provider
//! kubernetes` through the real `kube` client against the tests' fake API
//! server (`standby_e2e::kube_fake`), whose fake kubelet runs each Pod's
//! container as processes of their own PID namespace with the real
//! `standby`. Warm and cold runs, Tier 2 and Tier 1 follow-ups, a resume
//! whose claim is gone, a server restart that adopts its Pods and deletes
//! its orphans, a Pod deleted or evicted under a run, watches that expire,
//! and the API calls of each path, compared with the deployment's Role.
//!
//! What the fake does not model is listed in docs/deploy.md ("What CI
//! proves"); the `real_cluster_*` tests, `#[ignore]`d, run the paths the
//! fake is not needed for against a real cluster when
//! `STANDBY_TEST_KUBECONFIG` names one (`kubernetes_support`).

mod kubernetes_support;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, PostParams};
use kubernetes_support::{IMAGE, NAMESPACE, Server, WAIT, counted, pod_name, sandbox_of, uid};
use serde_json::json;
use standby_e2e::kube_fake::Call;
use standby_e2e::kustomize;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_run_takes_a_prepared_pod_which_is_strict_and_holds_no_credential() {
    a_warm_run_takes_a_prepared_pod_which_is_strict_and_holds_no_credential_on(
        Server::start(&["--pool-size", "1"]).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real cluster: STANDBY_TEST_KUBECONFIG (docs/deploy.md, \"What CI proves\")"]
async fn real_cluster_a_warm_run_takes_a_prepared_pod_which_is_strict_and_holds_no_credential() {
    if let Some(server) = Server::start_real(&["--pool-size", "1"]).await {
        a_warm_run_takes_a_prepared_pod_which_is_strict_and_holds_no_credential_on(server).await;
    }
}

async fn a_warm_run_takes_a_prepared_pod_which_is_strict_and_holds_no_credential_on(server: Server) {
    let standby = server.ready_standby().await;
    let pod = server.pod(&standby).await.expect("the standby's Pod");
    let text = serde_json::to_string(&pod).expect("json");
    assert!(!text.contains("sby_"), "no credential anywhere in the Pod: {text}");
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("standby.dev/sandbox"), Some(&standby));
    assert_eq!(labels.get("standby.dev/instance"), Some(&server.instance));
    assert_eq!(labels.get("team").map(String::as_str), Some("e2e"), "the template's own label");
    let spec = pod.spec.as_ref().expect("a spec");
    assert_eq!(spec.automount_service_account_token, Some(false));
    assert_eq!(spec.enable_service_links, Some(false));
    let container = &spec.containers[0];
    assert_eq!(container.args, Some(vec!["hold".to_owned()]));
    let env: Vec<&str> = container.env.iter().flatten().map(|var| var.name.as_str()).collect();
    assert_eq!(env, ["TEAM_NOTE"], "only the template's own variable");
    let security = container.security_context.as_ref().expect("a security context");
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert!(server.claim(&standby).await.is_some(), "its workspace claim");

    let run = server
        .run_to_end(
            json!({"command": ["sh", "-c", "cat .setup-runs; echo token=${STANDBY_TOKEN:-none} note=$TEAM_NOTE"]}),
        )
        .await;
    assert_eq!(run["path"], "warm", "{run}");
    assert_eq!(sandbox_of(&run), standby);
    let log = server.text_log(&run).await;
    assert!(
        log.contains("run") && log.contains("token=none") && log.contains("note=from-the-template"),
        "{log}\n{}",
        server.agent_logs()
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_run_gets_a_fresh_pod() {
    a_cold_run_gets_a_fresh_pod_on(
        Server::start(&["--pool-size", "0", "--warm-idle", "0s", "--park-stopped", "false"]).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real cluster: STANDBY_TEST_KUBECONFIG (docs/deploy.md, \"What CI proves\")"]
async fn real_cluster_a_cold_run_gets_a_fresh_pod() {
    if let Some(server) =
        Server::start_real(&["--pool-size", "0", "--warm-idle", "0s", "--park-stopped", "false"]).await
    {
        a_cold_run_gets_a_fresh_pod_on(server).await;
    }
}

async fn a_cold_run_gets_a_fresh_pod_on(server: Server) {
    let run = server.run_to_end(json!({"command": ["sh", "-c", "echo cold-ran; cat .setup-runs"]})).await;
    assert_eq!(run["path"], "cold", "{run}");
    assert!(server.text_log(&run).await.contains("cold-ran"));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_2_a_follow_up_is_a_new_exec_in_the_running_pod_which_was_cleared() {
    tier_2_a_follow_up_is_a_new_exec_in_the_running_pod_which_was_cleared_on(
        Server::start(&["--pool-size", "0", "--warm-idle", "60s"]).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real cluster: STANDBY_TEST_KUBECONFIG (docs/deploy.md, \"What CI proves\")"]
async fn real_cluster_tier_2_a_follow_up_is_a_new_exec_in_the_running_pod_which_was_cleared() {
    if let Some(server) = Server::start_real(&["--pool-size", "0", "--warm-idle", "60s"]).await {
        tier_2_a_follow_up_is_a_new_exec_in_the_running_pod_which_was_cleared_on(server).await;
    }
}

async fn tier_2_a_follow_up_is_a_new_exec_in_the_running_pod_which_was_cleared_on(server: Server) {
    let first = server
        .turn("chat-2", "echo note-from-turn-1 > note.txt; setsid sh -c 'exec sleep 1000' </dev/null >/dev/null 2>&1 &")
        .await;
    let sandbox_id = sandbox_of(&first);
    server.parked(&sandbox_id, "running").await;
    let before = server.pod(&sandbox_id).await.expect("the Pod");

    let count =
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 1000' || true";
    let second =
        server.turn("chat-2", &format!("cat note.txt; echo sleepers=$({count}); cat .setup-runs | wc -l")).await;
    assert_eq!(second["path"], "parked_running", "{second}");
    assert_eq!(sandbox_of(&second), sandbox_id);
    let log = server.text_log(&second).await;
    assert!(log.contains("note-from-turn-1"), "the last turn's file: {log}");
    assert!(log.contains("sleepers=0"), "what the last turn left running was cleared: {log}\n{}", server.agent_logs());
    let after = server.pod(&sandbox_id).await.expect("the Pod");
    assert_eq!(uid(&after), uid(&before), "the same Pod, not made again");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_1_deletes_the_pod_keeps_the_claim_and_a_resume_makes_a_new_pod_on_it() {
    tier_1_deletes_the_pod_keeps_the_claim_and_a_resume_makes_a_new_pod_on_it_on(
        Server::start(&["--pool-size", "0", "--warm-idle", "0s"]).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real cluster: STANDBY_TEST_KUBECONFIG (docs/deploy.md, \"What CI proves\")"]
async fn real_cluster_tier_1_deletes_the_pod_keeps_the_claim_and_a_resume_makes_a_new_pod_on_it() {
    if let Some(server) = Server::start_real(&["--pool-size", "0", "--warm-idle", "0s"]).await {
        tier_1_deletes_the_pod_keeps_the_claim_and_a_resume_makes_a_new_pod_on_it_on(server).await;
    }
}

async fn tier_1_deletes_the_pod_keeps_the_claim_and_a_resume_makes_a_new_pod_on_it_on(server: Server) {
    let first = server.turn("chat-1", "echo note-from-turn-1 > note.txt").await;
    let sandbox_id = sandbox_of(&first);
    server.parked(&sandbox_id, "stopped").await;
    server.until("the Pod deleted", async || server.pod(&sandbox_id).await.is_none().then_some(())).await;
    let claim = server.claim(&sandbox_id).await.expect("the claim is kept");
    let annotations = claim.metadata.annotations.unwrap_or_default();
    assert!(annotations.contains_key("standby.dev/stopped-at"), "the stop time, for the retention: {annotations:?}");

    let second = server.turn("chat-1", "cat note.txt; echo setup-runs=$(wc -l < .setup-runs)").await;
    assert_eq!(second["path"], "parked_stopped", "{second}\n{}", server.agent_logs());
    assert_eq!(sandbox_of(&second), sandbox_id);
    assert!(second["resume"]["fallback"].is_null(), "{second}");
    let log = server.text_log(&second).await;
    assert!(log.contains("note-from-turn-1") && log.contains("setup-runs=1"), "{log}");
    if server.cluster.is_fake() {
        let made = |calls: Vec<Call>| calls.iter().filter(|c| c.verb == "create" && c.resource == "pods").count();
        assert_eq!(made(server.cluster.fake().calls()), 2, "the cold start's Pod, then a new one on the same claim");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_whose_claim_is_gone_falls_back_to_cold_with_the_reason() {
    a_resume_whose_claim_is_gone_falls_back_to_cold_with_the_reason_on(
        Server::start(&["--pool-size", "0", "--warm-idle", "0s"]).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real cluster: STANDBY_TEST_KUBECONFIG (docs/deploy.md, \"What CI proves\")"]
async fn real_cluster_a_resume_whose_claim_is_gone_falls_back_to_cold_with_the_reason() {
    if let Some(server) = Server::start_real(&["--pool-size", "0", "--warm-idle", "0s"]).await {
        a_resume_whose_claim_is_gone_falls_back_to_cold_with_the_reason_on(server).await;
    }
}

async fn a_resume_whose_claim_is_gone_falls_back_to_cold_with_the_reason_on(server: Server) {
    let first = server.turn("chat-3", "echo note > note.txt").await;
    let sandbox_id = sandbox_of(&first);
    server.parked(&sandbox_id, "stopped").await;
    server.until("the Pod deleted", async || server.pod(&sandbox_id).await.is_none().then_some(())).await;
    let claim = format!("{}-workspace", pod_name(&sandbox_id));
    server.claims_api().await.delete(&claim, &DeleteParams::default()).await.expect("delete the claim");

    let second = server.turn("chat-3", "test ! -e note.txt && echo fresh").await;
    assert_eq!(second["path"], "cold", "{second}");
    assert_ne!(sandbox_of(&second), sandbox_id);
    let fallback = second["resume"]["fallback"].as_str().unwrap_or_default();
    assert!(fallback.contains("no longer exists"), "the reason is recorded: {second}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_adopts_its_live_pods_and_deletes_its_orphans() {
    a_restarted_server_adopts_its_live_pods_and_deletes_its_orphans_on(Server::start(&["--pool-size", "1"]).await)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real cluster: STANDBY_TEST_KUBECONFIG (docs/deploy.md, \"What CI proves\")"]
async fn real_cluster_a_restarted_server_adopts_its_live_pods_and_deletes_its_orphans() {
    if let Some(server) = Server::start_real(&["--pool-size", "1"]).await {
        a_restarted_server_adopts_its_live_pods_and_deletes_its_orphans_on(server).await;
    }
}

async fn a_restarted_server_adopts_its_live_pods_and_deletes_its_orphans_on(mut server: Server) {
    let standby = server.ready_standby().await;
    let pods = server.pods_api().await;
    let orphan_id = "sbx_orphan0000001";
    let labels = BTreeMap::from([
        ("standby.dev/sandbox".to_owned(), orphan_id.to_owned()),
        ("standby.dev/instance".to_owned(), server.instance.clone()),
    ]);
    let orphan: Pod = serde_json::from_value(json!({
        "metadata": {"name": pod_name(orphan_id), "labels": labels},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "sandbox", "image": IMAGE, "args": ["hold"]}]}
    }))
    .expect("a pod");
    pods.create(&PostParams::default(), &orphan).await.expect("an orphan Pod");
    let foreign: Pod = serde_json::from_value(json!({
        "metadata": {"name": "someone-elses", "labels": {"standby.dev/instance": "someone-else", "standby.dev/sandbox": "sbx_x"}},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "sandbox", "image": IMAGE, "args": ["hold"]}]}
    }))
    .expect("a pod");
    pods.create(&PostParams::default(), &foreign).await.expect("a foreign Pod");

    server.process.as_ref().expect("the server runs").crash().await;
    server.process = Some(server.builder.start().await);
    server.until("the orphan deleted", async || server.pod(orphan_id).await.is_none().then_some(())).await;
    assert!(
        pods.get_opt("someone-elses").await.expect("the fake").is_some(),
        "another control plane's Pod is left alone"
    );
    let again = server.ready_standby().await;
    assert_eq!(again, standby, "the same standby, adopted\n{}", server.agent_logs());
    let run = server.run_to_end(json!({"command": ["sh", "-c", "echo adopted"]})).await;
    assert_eq!((run["path"].as_str(), sandbox_of(&run)), (Some("warm"), standby), "{run}");
    server.stop().await;
}

/// A Pod deleted, evicted or lost with its node under a started run: the watch tells the
/// provider, the agent's end is reported at once, and the run fails by the
/// contract's rule (it had started), long before the silence bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_evicted_or_lost_under_a_run_fails_it_without_waiting_out_the_silence_bound() {
    let server = Server::start(&["--pool-size", "2", "--run-lost-after", "5m"]).await;
    for how in ["deleted", "evicted", "its node lost"] {
        let id = server.submit(&json!({"command": ["sleep", "300"]})).await;
        let run = server
            .until("the run started", async || {
                let run = server.run(&id).await;
                (run["state"] == "running").then_some(run)
            })
            .await;
        let sandbox_id = sandbox_of(&run);
        match how {
            "deleted" => {
                let params = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
                server.pods_api().await.delete(&pod_name(&sandbox_id), &params).await.expect("delete the Pod");
            }
            "evicted" => server.cluster.fake().evict(&pod_name(&sandbox_id)).await,
            _ => server.cluster.fake().lose_node().await,
        }
        let run = server.finished(&id, WAIT).await;
        assert_eq!(run["state"], "failed", "{how}: {run}\n{}", server.agent_logs());
    }
    server.stop().await;
}

/// Watches that expire (the API server's 410 Gone for a version too old)
/// are listed again: a Pod deleted meanwhile is still seen gone, and a
/// Tier 1 resume still finds its claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_that_expire_are_listed_again_and_nothing_is_missed() {
    let server = Server::start(&["--pool-size", "0", "--warm-idle", "0s"]).await;
    let first = server.turn("chat-7", "echo kept > note.txt").await;
    let sandbox_id = sandbox_of(&first);
    server.cluster.fake().expire_watches().await;
    server.parked(&sandbox_id, "stopped").await;
    server.cluster.fake().expire_watches().await;
    let second = server.turn("chat-7", "cat note.txt").await;
    assert_eq!(second["path"], "parked_stopped", "{second}\n{}", server.agent_logs());
    assert!(server.text_log(&second).await.contains("kept"));
    let watches = server.cluster.fake().calls().into_iter().filter(|call| call.verb == "watch").count();
    assert!(watches >= 4, "the watches started again after each expiry: {watches}");
    server.stop().await;
}

/// What the provider asks of the API on each path (warm, Tier 2, cold,
/// Tier 1, retire), counted, and compared with the deployment's Role both
/// ways: a call the Role does not grant fails in a real cluster, a grant
/// no call uses is one too many.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_providers_calls_on_each_path_are_exactly_what_the_role_grants() {
    let mut paths: Vec<(&str, Vec<Call>)> = Vec::new();
    let since = |server: &Server, at: usize| server.cluster.fake().calls()[at..].to_vec();

    let warm = Server::start(&["--pool-size", "1", "--warm-idle", "60s"]).await;
    let standby = warm.ready_standby().await;
    paths.push(("start, one standby made and its agent started", warm.cluster.fake().calls()));
    let at = warm.cluster.fake().calls().len();
    let run = warm.turn("chat-8", "echo one > note.txt").await;
    assert_eq!((run["path"].as_str(), sandbox_of(&run)), (Some("warm"), standby.clone()));
    warm.parked(&standby, "running").await;
    paths.push(("warm run, then parked running (cleared) and the pool refilled", since(&warm, at)));
    let at = warm.cluster.fake().calls().len();
    let run = warm.turn("chat-8", "cat note.txt").await;
    assert_eq!(run["path"], "parked_running");
    warm.parked(&standby, "running").await;
    paths.push(("Tier 2 follow-up", since(&warm, at)));

    let args = ["--pool-size", "0", "--warm-idle", "0s", "--auto-delete", "8", "--provider-minute", "1s"];
    let cold = Server::start(&args).await;
    let at = cold.cluster.fake().calls().len();
    let run = cold.turn("chat-9", "echo one > note.txt").await;
    assert_eq!(run["path"], "cold");
    let sandbox_id = sandbox_of(&run);
    cold.parked(&sandbox_id, "stopped").await;
    paths.push(("cold run, then parked stopped (Tier 1)", since(&cold, at)));
    let at = cold.cluster.fake().calls().len();
    let run = cold.turn("chat-9", "cat note.txt").await;
    assert_eq!(run["path"], "parked_stopped", "{run}\n{}", cold.agent_logs());
    cold.parked(&sandbox_id, "stopped").await;
    paths.push(("Tier 1 resume, then parked stopped", since(&cold, at)));
    let at = cold.cluster.fake().calls().len();
    // Watched on the fake's disk: a call of the test's own would count.
    let claim_dir = cold.cluster.fake().pvc_dir(&format!("{}-workspace", pod_name(&sandbox_id)));
    assert!(claim_dir.exists(), "{}", claim_dir.display());
    cold.until("the stopped sandbox deleted by age", async || (!claim_dir.exists()).then_some(())).await;
    paths.push(("retired by age (--auto-delete)", since(&cold, at)));

    let mut used = BTreeSet::new();
    for (path, calls) in &paths {
        eprintln!("calls on the path `{path}`: {:?}", counted(calls));
        for call in calls {
            assert_eq!(call.namespace.as_deref(), Some(NAMESPACE), "{call:?}: only its own namespace");
            used.insert((call.group.clone(), call.resource.clone(), call.verb.clone()));
        }
    }
    // An exec is a WebSocket upgrade: a GET the API server authorizes as
    // `get` (and, from Kubernetes 1.35, as `create` too); the fake records
    // it as `create`, and the Role grants both.
    let mut role =
        kustomize::role_grants(&kustomize::render(&kustomize::deploy_dir()).expect("the deployment renders"));
    assert!(role.remove(&(String::new(), "pods/exec".to_owned(), "get".to_owned())), "exec's GET granted: {role:?}");
    assert_eq!(used, role, "the provider's calls (left) and the Role's grants (right) differ");
    warm.stop().await;
    cold.stop().await;
}

/// The image's `standby` as a wrapper that keeps every credential an
/// agent start is given (in `dir/creds`) and runs the real one; `hold`,
/// `clear` and `busy` pass through. A test's alone: it writes credentials.
fn spying_agent(dir: &std::path::Path) -> std::path::PathBuf {
    let wrapper = dir.join("standby-spy");
    let script = format!(
        "#!/bin/sh\ncase \"$1\" in hold|clear|busy) exec {real} \"$@\";; esac\ncopy={dir}/creds.$$\ncat > \"$copy\"\nexec {real} \"$@\" < \"$copy\"\n",
        real = standby_e2e::harness::standby_bin().display(),
        dir = dir.display(),
    );
    std::fs::write(&wrapper, script).expect("write the spy");
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod the spy");
    wrapper
}

/// Every agent start gets a credential of its own: once the next agent of
/// a Pod has started, the previous one's is refused (a Pod outlives its
/// agents, so a credential left in it must be worthless).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_agent_starts_credential_is_refused_after_the_next_start() {
    let spy_dir = tempfile::tempdir().expect("a temp dir");
    let mut options = kubernetes_support::fake_options();
    options.binaries.insert(kubernetes_support::AGENT_PATH.to_owned(), spying_agent(spy_dir.path()));
    let server = Server::start_with(options, &["--pool-size", "0", "--warm-idle", "60s"]).await;
    let first = server.turn("chat-credentials", "true").await;
    let sandbox_id = sandbox_of(&first);
    server.parked(&sandbox_id, "running").await;
    let mut given: Vec<(std::time::SystemTime, String)> = std::fs::read_dir(spy_dir.path())
        .expect("the spy's directory")
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("creds."))
        .map(|entry| {
            let modified = entry.metadata().and_then(|meta| meta.modified()).expect("a time");
            (modified, std::fs::read_to_string(entry.path()).expect("a credential").trim().to_owned())
        })
        .collect();
    given.sort();
    assert_eq!(given.len(), 2, "the first agent and the next one, each with its credential: {given:?}");
    assert_ne!(given[0].1, given[1].1, "a fresh credential for the next start");
    let http = reqwest::Client::new();
    let spec = async |credential: &str| {
        let response = http
            .get(format!("{}{}", server.url(), standby_protocol::SPEC_PATH))
            .bearer_auth(credential)
            .header(standby_protocol::PROTOCOL_HEADER, standby_protocol::PROTOCOL_VERSION)
            .send()
            .await
            .expect("the server answers");
        response.status().as_u16()
    };
    assert_eq!(spec(&given[0].1).await, 401, "the previous start's credential is refused");
    assert_eq!(spec(&given[1].1).await, 200, "the current agent's is accepted");
    server.stop().await;
}

/// The provider's own timer: a kept Pod idle past its auto-stop is
/// stopped by the sweeper (its Pod deleted, its claim kept), and the
/// auto-stop floor holds it off through its warm window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_auto_stop_floor_keeps_a_warm_pod_running_through_its_window() {
    let args = ["--pool-size", "0", "--warm-idle", "4s", "--auto-stop", "2", "--provider-minute", "1s"];
    let server = Server::start(&args).await;
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
    server.until("the Pod deleted", async || server.pod(&sandbox_id).await.is_none().then_some(())).await;
    assert!(server.claim(&sandbox_id).await.is_some(), "its claim kept");
    server.stop().await;
}

/// An adopted Pod gets its recorded auto-stop back after a restart, and
/// the provider's sweeper stops it when it is idle past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_pod_gets_its_recorded_auto_stop_back_and_the_sweeper_stops_it() {
    // A provider minute of 60 s: the kept Pod's auto-stop is the floor
    // ceil(60 s / 60 s) + 5 = 6 minutes, out of reach of the test.
    let args = ["--pool-size", "0", "--warm-idle", "60s", "--auto-stop", "1", "--provider-minute", "60s"];
    let mut options = kubernetes_support::fake_options();
    options.binaries.insert("/bin/sh".to_owned(), "/bin/sh".into());
    let mut server = Server::start_with(options, &args).await;
    let first = server.turn("chat-5", "true").await;
    let sandbox_id = sandbox_of(&first);
    let parked = server.parked(&sandbox_id, "running").await;
    assert_eq!(parked["auto_stop_minutes"], 6, "{parked}");

    // While the server is down, the kept Pod's waiting agent dies: the
    // restarted server finds the Pod running without an agent and keeps it
    // parked running until its window ends, 60 s on. Restarted with a
    // minute of 1 s, the recorded six minutes are 6 s: only the provider's
    // timer, given its minutes back from the store, stops it before. (The
    // pattern is bracketed so that the killing shell does not match it.)
    server.process.as_ref().expect("the server runs").crash().await;
    let kill_agent = "for p in /proc/[0-9]*; do case \"$(tr '\\0' ' ' < $p/cmdline)\" in *--server-[u]rl*) kill -9 ${p#/proc/};; esac; done; true";
    let params = kube::api::AttachParams::default().stdout(true).stderr(false);
    let mut killed = server
        .pods_api()
        .await
        .exec(&pod_name(&sandbox_id), ["/bin/sh", "-c", kill_agent], &params)
        .await
        .expect("exec");
    let mut output = killed.stdout().expect("its stdout");
    let status = killed.take_status().expect("a status");
    let mut sink = tokio::io::sink();
    let (_, status) = tokio::join!(tokio::io::copy(&mut output, &mut sink), status);
    assert_eq!(status.and_then(|status| status.status).as_deref(), Some("Success"));
    server.builder = server.builder.clone().with_arg("--provider-minute", "1s");
    server.process = Some(server.builder.start().await);
    server.until("the adopted Pod auto-stopped", async || server.pod(&sandbox_id).await.is_none().then_some(())).await;
    let log = std::fs::read_to_string(server.log_path()).expect("the server log");
    let line = |needle: &str| log.lines().any(|l| l.contains(needle) && l.contains(&sandbox_id));
    assert!(line("auto-stop restored from the store"), "{}", server.agent_logs());
    assert!(line("idle auto-stop"), "the provider's timer stopped it\n{}", server.agent_logs());
    assert!(!line("warm idle window ended"), "not the dispatcher's window");
    assert!(server.claim(&sandbox_id).await.is_some(), "its claim kept");
    server.stop().await;
}
