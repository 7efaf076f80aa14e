//! The Kubernetes provider in agent-sandbox mode end to end: the real
//! `standby-server --provider kubernetes --kubernetes-api agent-sandbox`
//! against the tests' fake API server and its fake of agent-sandbox's
//! controllers (`standby_e2e::kube_fake`). The server applies its
//! SandboxTemplate and SandboxWarmPool; a standby is a SandboxClaim that
//! carries no env, bound to a warm Sandbox; a run's credential arrives over
//! standby's socket after the adoption; Tier 1 suspends the Sandbox and a
//! resume runs it again on its claim; the calls are the overlay's Role.

mod kubernetes_support;

use std::collections::BTreeSet;

use kube::Api;
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind};
use kubernetes_support::{Server, WAIT, counted, sandbox_of};
use serde_json::{Value, json};
use standby_e2e::kube_fake::Call;
use standby_e2e::kustomize;

const MODE: [&str; 2] = ["--kubernetes-api", "agent-sandbox"];

fn resource(group: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, "v1beta1", kind), plural)
}

async fn api(server: &Server, group: &str, kind: &str, plural: &str) -> Api<DynamicObject> {
    Api::namespaced_with(server.cluster.client().await, &server.namespace, &resource(group, kind, plural))
}

async fn start(args: &[&str]) -> Server {
    let mut all = MODE.to_vec();
    all.extend_from_slice(args);
    Server::start(&all).await
}

fn claim_name(sandbox_id: &str) -> String {
    format!("standby-{}", sandbox_id.replace('_', "-"))
}

/// The SandboxClaim of a sandbox, as JSON.
async fn claim(server: &Server, sandbox_id: &str) -> Option<Value> {
    let claims = api(server, "extensions.agents.x-k8s.io", "SandboxClaim", "sandboxclaims").await;
    let found = claims.get_opt(&claim_name(sandbox_id)).await.expect("the fake answers")?;
    Some(serde_json::to_value(found).expect("json"))
}

/// The Sandbox (and Pod) a sandbox's claim was bound to.
async fn bound(server: &Server, sandbox_id: &str) -> String {
    server
        .until("the claim bound", async || {
            let claim = claim(server, sandbox_id).await?;
            claim.pointer("/status/sandbox/name")?.as_str().filter(|name| !name.is_empty()).map(str::to_owned)
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_run_takes_a_claimed_warm_sandbox_whose_claim_carries_nothing() {
    let server = start(&["--pool-size", "1"]).await;
    let standby = server.ready_standby().await;
    let claim = claim(&server, &standby).await.expect("the standby's SandboxClaim");
    let pool = format!("standby-{}", server.instance);
    assert_eq!(claim["spec"], json!({"warmPoolRef": {"name": pool}}), "no env, nothing but the pool: {claim}");
    let sandbox = bound(&server, &standby).await;
    let pods = server.pods_api().await;
    let pod = pods.get(&sandbox).await.expect("the Sandbox's Pod");
    let text = serde_json::to_string(&pod).expect("json");
    assert!(!text.contains("sby_"), "no credential anywhere in the Pod: {text}");
    let labels = pod.metadata.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("standby.dev/instance"), Some(&server.instance), "{labels:?}");
    assert_eq!(pod.spec.as_ref().and_then(|spec| spec.containers[0].args.clone()), Some(vec!["hold".to_owned()]));

    let templates = api(&server, "extensions.agents.x-k8s.io", "SandboxTemplate", "sandboxtemplates").await;
    let template = serde_json::to_value(templates.get(&pool).await.expect("the template")).expect("json");
    assert_eq!(template["spec"]["envVarsInjectionPolicy"], "Disallowed", "{template}");
    let egress = &template["spec"]["networkPolicy"]["egress"];
    let port = server.url().rsplit(':').next().and_then(|port| port.parse::<u64>().ok()).expect("a port");
    assert_eq!(egress[0]["ports"][0]["port"], port, "the agents reach the server's port: {egress}");

    let run = server
        .run_to_end(
            json!({"command": ["sh", "-c", "cat .setup-runs; echo token=${STANDBY_TOKEN:-none} note=$TEAM_NOTE"]}),
        )
        .await;
    assert_eq!((run["path"].as_str(), sandbox_of(&run)), (Some("warm"), standby.clone()), "{run}");
    let log = server.text_log(&run).await;
    assert!(log.contains("run") && log.contains("token=none") && log.contains("note=from-the-template"), "{log}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_2_and_tier_1_keep_the_workspace_and_tier_1_suspends_the_sandbox() {
    let server = start(&["--pool-size", "0", "--warm-idle", "2s"]).await;
    let first = server
        .turn("chat-a", "echo note-from-turn-1 > note.txt; setsid sh -c 'exec sleep 1000' </dev/null >/dev/null 2>&1 &")
        .await;
    let sandbox_id = sandbox_of(&first);
    let sandbox = bound(&server, &sandbox_id).await;
    server.parked(&sandbox_id, "running").await;
    let count =
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 1000' || true";
    let second = server.turn("chat-a", &format!("cat note.txt; echo sleepers=$({count})")).await;
    assert_eq!(second["path"], "parked_running", "{second}");
    let log = server.text_log(&second).await;
    assert!(log.contains("note-from-turn-1") && log.contains("sleepers=0"), "{log}\n{}", server.agent_logs());

    // The warm window ends: the Sandbox is suspended, its Pod deleted.
    server.parked(&sandbox_id, "stopped").await;
    let sandboxes = api(&server, "agents.x-k8s.io", "Sandbox", "sandboxes").await;
    let suspended = serde_json::to_value(sandboxes.get(&sandbox).await.expect("the Sandbox")).expect("json");
    assert_eq!(suspended["spec"]["operatingMode"], "Suspended", "{suspended}");
    let pods = server.pods_api().await;
    server.until("the Pod deleted", async || pods.get_opt(&sandbox).await.ok()?.is_none().then_some(())).await;
    let stamped = claim(&server, &sandbox_id).await.expect("the claim is kept");
    assert!(stamped["metadata"]["annotations"]["standby.dev/stopped-at"].is_string(), "{stamped}");

    let third = server.turn("chat-a", "cat note.txt; echo setup-runs=$(wc -l < .setup-runs)").await;
    assert_eq!(third["path"], "parked_stopped", "{third}\n{}", server.agent_logs());
    assert_eq!(sandbox_of(&third), sandbox_id);
    let log = server.text_log(&third).await;
    assert!(log.contains("note-from-turn-1") && log.contains("setup-runs=1"), "the workspace kept: {log}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_deleted_under_a_run_fails_it_and_a_retired_sandbox_releases_its_claim() {
    let server = start(&["--pool-size", "1", "--run-lost-after", "5m"]).await;
    let id = server.submit(&json!({"command": ["sleep", "300"]})).await;
    let run = server
        .until("the run started", async || {
            let run = server.run(&id).await;
            (run["state"] == "running").then_some(run)
        })
        .await;
    let sandbox_id = sandbox_of(&run);
    let sandbox = bound(&server, &sandbox_id).await;
    let params = DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    server.pods_api().await.delete(&sandbox, &params).await.expect("delete the Pod");
    let run = server.finished(&id, WAIT).await;
    assert_eq!(run["state"], "failed", "{run}\n{}", server.agent_logs());
    server
        .until("the failed run's sandbox retired", async || claim(&server, &sandbox_id).await.is_none().then_some(()))
        .await;
    server.stop().await;
}

/// Agent-sandbox mode's calls on its paths, counted, and compared with the
/// agent-sandbox overlay's Role both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_calls_of_agent_sandbox_mode_are_exactly_what_its_role_grants() {
    let server =
        start(&["--pool-size", "1", "--warm-idle", "1s", "--auto-delete", "6", "--provider-minute", "1s"]).await;
    let mut paths: Vec<(&str, Vec<Call>)> = Vec::new();
    let calls = |server: &Server| server.cluster.fake().calls();
    let standby = server.ready_standby().await;
    paths.push(("start: template and pool applied, one standby claimed and its agent started", calls(&server)));
    let at = calls(&server).len();
    let run = server.turn("chat-b", "echo one > note.txt").await;
    assert_eq!((run["path"].as_str(), sandbox_of(&run)), (Some("warm"), standby.clone()));
    server.parked(&standby, "stopped").await;
    paths.push(("warm run, Tier 2 then Tier 1 (suspended), the pool refilled", calls(&server)[at..].to_vec()));
    let at = calls(&server).len();
    let run = server.turn("chat-b", "cat note.txt").await;
    assert_eq!(run["path"], "parked_stopped", "{run}\n{}", server.agent_logs());
    server.parked(&standby, "stopped").await;
    paths.push(("Tier 1 resume, then suspended again", calls(&server)[at..].to_vec()));
    // Watched in the fake's record: a call of the test's own would count.
    let at = calls(&server).len();
    let released = |call: &Call| call.verb == "delete" && call.resource == "sandboxclaims";
    server
        .until("the stopped sandbox released by age", async || calls(&server)[at..].iter().any(released).then_some(()))
        .await;
    paths.push(("retired by age (--auto-delete)", calls(&server)[at..].to_vec()));

    let mut used = BTreeSet::new();
    for (path, calls) in &paths {
        eprintln!("calls on the path `{path}`: {:?}", counted(calls));
        for call in calls {
            used.insert((call.group.clone(), call.resource.clone(), call.verb.clone()));
        }
    }
    // An apply that makes the object is authorized as `create` as well as
    // `patch`; the fake records the `patch`.
    for resource in ["sandboxtemplates", "sandboxwarmpools"] {
        used.insert(("extensions.agents.x-k8s.io".to_owned(), resource.to_owned(), "create".to_owned()));
    }
    let overlay = kustomize::deploy_dir().join("overlays/agent-sandbox");
    let mut role = kustomize::role_grants(&kustomize::render(&overlay).expect("the overlay renders"));
    assert!(role.remove(&(String::new(), "pods/exec".to_owned(), "get".to_owned())), "exec's GET granted: {role:?}");
    assert_eq!(used, role, "agent-sandbox mode's calls (left) and its Role's grants (right) differ");
    server.stop().await;
}
