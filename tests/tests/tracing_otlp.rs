//! One trace per run start, end to end: a real `standby-server` (local
//! provider) with `--otlp-endpoint` and the real agents it launches, which
//! it gives `STANDBY_OTLP_ENDPOINT`, export to an OTLP/HTTP receiver on
//! loopback that decodes the official protobuf (`standby_e2e::otlp`).
//!
//! Held: each run start is exactly one trace; the server's spans are
//! there and each lasts what the run's `durations_ms` says; every span of
//! the agent is a child of the server's delivery span and lies within it.
//! Without an endpoint nothing is sent; an endpoint that never answers
//! does not keep runs from starting, and its spans are counted dropped.
//! No timing is asserted (that is the benchmarks' job).
//!
//! Needs both binaries of the workspace built (`cargo build --bins`).

use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use standby_e2e::harness::write_json;
use standby_e2e::otlp::{OtlpReceiver, ReceivedSpan, SilentListener};
use standby_e2e::server_process::{ServerBuilder, ServerProcess, environ_var};

const WAIT: Duration = Duration::from_secs(90);
const MS: u64 = 1_000_000;

/// How far an agent's span may reach past the server's delivery span, in
/// nanoseconds. The server's times are whole milliseconds (each up to
/// 1 ms early), and the agent places its monotonic measurements on the
/// wall clock by one reading taken at the install: on one host the two
/// agree to well under a millisecond. 2 ms covers both.
const SLACK: u64 = 2 * MS;

const SERVER_SPANS: [&str; 5] = ["submit", "placement", "delivery", "confirmation", "start"];

/// A server whose second run goes cold: the setup step takes a second,
/// so the pool's replacement for the standby the first run took is not
/// ready when the second comes.
async fn server(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> ServerProcess {
    let spec = json!({
        "workspace": {"repos": [], "setup": [{"name": "build", "command": ["sleep", "1"], "timeout_s": 60}]},
        "shell": ["/bin/sh"]
    });
    let spec_path = dir.join("spec.json");
    write_json(&spec_path, &spec);
    let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir)));
    let mut builder = ServerBuilder::new(&dir.join("data"), &dir.join("server.log"), &mark)
        .args(&["--spec", &spec_path.display().to_string(), "--pool-size", "1"])
        .args(&["--heartbeat-interval", "200ms", "--linger", "3s", "--stop-grace", "3s"])
        .args(extra);
    for (name, value) in env {
        builder = builder.env(name, value);
    }
    builder.start().await
}

/// A warm run, then a cold one, both finished: their records.
async fn warm_and_cold(server: &ServerProcess) -> Vec<Value> {
    server
        .until("a ready standby", WAIT, async || {
            server.sandboxes().await.into_iter().any(|sandbox| sandbox["candidate"] == true).then_some(())
        })
        .await;
    let run = json!({"command": ["sh", "-c", "echo hello"]});
    let ids = [server.submit(&run).await, server.submit(&run).await];
    let mut runs = Vec::new();
    for id in &ids {
        let run = server.finished(id, WAIT).await;
        assert_eq!(run["state"], "exited", "{run}\n{}", server.logs());
        runs.push(run);
    }
    let paths: Vec<&str> = runs.iter().map(|run| run["path"].as_str().unwrap_or_default()).collect();
    assert_eq!(paths, ["warm", "cold"], "one run took the standby, the other went cold");
    runs
}

/// The spans of run `id`: the server's (by `standby.run_id`) and its
/// agent's (by `standby.execution_id`).
fn of_run<'a>(spans: &'a [ReceivedSpan], id: &str) -> (Vec<&'a ReceivedSpan>, Vec<&'a ReceivedSpan>) {
    let server = spans.iter().filter(|s| s.service == "standby-server" && s.attribute("standby.run_id") == Some(id));
    let agent =
        spans.iter().filter(|s| s.service == "standby-agent" && s.attribute("standby.execution_id") == Some(id));
    (server.collect(), agent.collect())
}

/// Every span a started run's trace should hold has arrived.
fn complete(spans: &[ReceivedSpan], id: &str) -> bool {
    let (server, agent) = of_run(spans, id);
    SERVER_SPANS.iter().all(|name| server.iter().any(|s| s.name == *name)) && agent.iter().any(|s| s.name == "spawn")
}

/// The pids of the agents of sandboxes not retired (a standby waits).
async fn waiting_agents(server: &ServerProcess) -> Vec<i32> {
    let waiting: Vec<i32> = server
        .sandboxes()
        .await
        .iter()
        .filter(|sandbox| sandbox["retired_at"].is_null())
        .filter_map(|sandbox| sandbox["pid"].as_i64().and_then(|pid| i32::try_from(pid).ok()))
        .collect();
    assert!(!waiting.is_empty(), "a standby waits");
    waiting
}

fn named<'a>(spans: &[&'a ReceivedSpan], name: &str) -> Vec<&'a ReceivedSpan> {
    spans.iter().copied().filter(|span| span.name == name).collect()
}

fn ms(run: &Value, duration: &str) -> u64 {
    run["durations_ms"][duration].as_u64().unwrap_or_else(|| panic!("no durations_ms.{duration} in {run}"))
}

#[tokio::test]
async fn each_run_start_is_one_trace_that_the_agents_install_spans_join() {
    let dir = tempfile::Builder::new().prefix("standby-otlp-e2e-").tempdir().expect("a temp dir");
    let receiver = OtlpReceiver::start().await;
    let server = server(dir.path(), &["--otlp-endpoint", &receiver.endpoint()], &[]).await;
    let runs = warm_and_cold(&server).await;
    let ids: Vec<&str> = runs.iter().map(|run| run["id"].as_str().expect("an id")).collect();
    let spans = receiver
        .until("both runs' traces, the agents' spans included", WAIT, |spans| {
            ids.iter().all(|id| complete(spans, id)).then(|| spans.to_vec())
        })
        .await;
    assert_eq!(receiver.malformed(), 0, "every export was protobuf and decoded");

    let mut traces = BTreeSet::new();
    for run in &runs {
        let id = run["id"].as_str().expect("an id");
        let (server_spans, agent_spans) = of_run(&spans, id);
        let trace: BTreeSet<&[u8]> = server_spans.iter().chain(&agent_spans).map(|s| s.trace_id.as_slice()).collect();
        assert_eq!(trace.len(), 1, "{id}: one trace for the run's start");
        traces.extend(trace);

        let submit = named(&server_spans, "submit");
        assert_eq!(submit.len(), 1, "{id}: one root");
        let submit = submit[0];
        assert!(submit.parent_span_id.is_empty(), "{id}: submit is the root");
        let delivery = named(&server_spans, "delivery");
        assert_eq!(delivery.len(), 1, "{id}: one attempt, one delivery");
        let delivery = delivery[0];
        for name in ["placement", "delivery"] {
            assert!(named(&server_spans, name).iter().all(|s| s.parent_span_id == submit.span_id), "{id}: {name}");
        }
        for name in ["confirmation", "start"] {
            assert!(named(&server_spans, name).iter().all(|s| s.parent_span_id == delivery.span_id), "{id}: {name}");
        }

        // The server's spans are the API's durations, to the millisecond:
        // both are made of the run's recorded times.
        let one = |name: &str| named(&server_spans, name)[0].duration_nanos();
        assert_eq!(one("submit"), ms(run, "submit_to_start") * MS, "{id}: submit");
        assert_eq!(one("placement"), ms(run, "queued") * MS, "{id}: placement");
        assert_eq!(one("confirmation"), ms(run, "assignment_sent_to_delivery_confirmed") * MS, "{id}: confirmation");
        assert_eq!(one("start"), ms(run, "delivery_confirmed_to_started") * MS, "{id}: start");
        let delivered =
            ["commit_to_assignment_sent", "assignment_sent_to_delivery_confirmed", "delivery_confirmed_to_started"];
        assert_eq!(one("delivery"), delivered.iter().map(|d| ms(run, d)).sum::<u64>() * MS, "{id}: delivery");

        // The agent's spans: children of the delivery span, within it.
        let names: BTreeSet<&str> = agent_spans.iter().map(|s| s.name.as_str()).collect();
        for expected in ["install.confirm", "install.check", "install.secrets", "install.terminal", "spawn"] {
            assert!(names.contains(expected), "{id}: the agent's {expected} span; got {names:?}");
        }
        for span in &agent_spans {
            assert_eq!(span.parent_span_id, delivery.span_id, "{id}: {} is a child of the delivery span", span.name);
            assert!(
                span.start_unix_nanos + SLACK >= delivery.start_unix_nanos,
                "{id}: {} begins after the binding",
                span.name
            );
            assert!(span.end_unix_nanos <= delivery.end_unix_nanos + SLACK, "{id}: {} ends by the start", span.name);
        }
        let confirm = named(&agent_spans, "install.confirm")[0];
        let confirmed = named(&server_spans, "confirmation")[0];
        assert!(
            confirm.end_unix_nanos + SLACK >= confirmed.end_unix_nanos,
            "{id}: the agent has its replay only after the server confirmed"
        );
    }
    assert_eq!(traces.len(), 2, "two runs, two traces");
    for pid in waiting_agents(&server).await {
        let given = environ_var(pid, "STANDBY_OTLP_ENDPOINT");
        assert_eq!(given, Some(receiver.endpoint()), "the agent {pid} was given the endpoint");
    }
}

/// Without `--otlp-endpoint` nothing is exported, and the agents are not
/// given an endpoint either: the server's own `STANDBY_OTLP_ENDPOINT` (an
/// agent's variable) does not reach them.
#[tokio::test]
async fn without_an_endpoint_nothing_is_sent() {
    let dir = tempfile::Builder::new().prefix("standby-otlp-off-e2e-").tempdir().expect("a temp dir");
    let receiver = OtlpReceiver::start().await;
    let server = server(dir.path(), &[], &[("STANDBY_OTLP_ENDPOINT", &receiver.endpoint())]).await;
    let runs = warm_and_cold(&server).await;
    // The runs' agents have exited (so would have flushed any span), and
    // the standby waiting now was started without an endpoint.
    let sandboxes: Vec<&str> = runs.iter().filter_map(|run| run["attempts"][0]["sandbox_id"].as_str()).collect();
    assert_eq!(sandboxes.len(), 2);
    server
        .until("the runs' agents to exit", WAIT, async || {
            let all = server.sandboxes().await;
            let exited = |id: &&str| all.iter().any(|s| s["id"] == **id && !s["exit_code"].is_null());
            sandboxes.iter().all(exited).then_some(())
        })
        .await;
    for pid in waiting_agents(&server).await {
        assert_eq!(environ_var(pid, "STANDBY_OTLP_ENDPOINT"), None, "the agent {pid} was given no endpoint");
    }
    let metrics = server.get("/metrics").await;
    let metrics = metrics.as_str().expect("text");
    assert!(metrics.contains("\nstandby_trace_spans_dropped_total 0\n"), "{metrics}");
    let ids: Vec<&Value> = runs.iter().map(|run| &run["id"]).collect();
    assert_eq!(receiver.requests(), 0, "nothing was sent for {ids:?}");
}

fn dropped(metrics: &Value) -> u64 {
    metrics
        .as_str()
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix("standby_trace_spans_dropped_total "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0)
}

/// An endpoint that accepts connections and never answers: runs still
/// start and finish, and the server counts the spans it dropped.
#[tokio::test]
async fn an_endpoint_that_never_answers_drops_and_counts() {
    let dir = tempfile::Builder::new().prefix("standby-otlp-silent-e2e-").tempdir().expect("a temp dir");
    let silent = SilentListener::start().await;
    let server = server(dir.path(), &["--otlp-endpoint", &silent.endpoint()], &[]).await;
    warm_and_cold(&server).await;
    let count = server
        .until("spans counted dropped", WAIT, async || {
            let count = dropped(&server.get("/metrics").await);
            (count > 0).then_some(count)
        })
        .await;
    assert!(count >= SERVER_SPANS.len() as u64, "a started run's spans were dropped whole: {count}");
}

/// A run whose warm attempt fails `same_preparation` (it names a workspace
/// the pool was not prepared with) and starts cold is still one trace:
/// one `delivery` per attempt, the first with an error status, and the
/// agent's spans under the attempt that started.
#[tokio::test]
async fn a_requeued_run_is_one_trace_with_a_delivery_per_attempt() {
    let dir = tempfile::Builder::new().prefix("standby-otlp-requeue-e2e-").tempdir().expect("a temp dir");
    let receiver = OtlpReceiver::start().await;
    let server = server(dir.path(), &["--otlp-endpoint", &receiver.endpoint()], &[]).await;
    server
        .until("a ready standby", WAIT, async || {
            server.sandboxes().await.into_iter().any(|sandbox| sandbox["candidate"] == true).then_some(())
        })
        .await;
    let workspace = json!({"repos": [], "setup": [{"name": "another", "command": ["true"], "timeout_s": 60}]});
    let id = server.submit(&json!({"command": ["sh", "-c", "echo hello"], "workspace": workspace})).await;
    let run = server.finished(&id, WAIT).await;
    assert_eq!(run["state"], "exited", "{run}\n{}", server.logs());
    let outcomes: Vec<&str> =
        run["attempts"].as_array().expect("attempts").iter().filter_map(|a| a["outcome"].as_str()).collect();
    assert_eq!((run["path"].as_str(), outcomes.first().copied()), (Some("cold"), Some("requeued")), "{run}");
    let spans = receiver
        .until("the requeued run's trace", WAIT, |spans| {
            let (server_spans, _) = of_run(spans, &id);
            (complete(spans, &id) && named(&server_spans, "delivery").len() == 2).then(|| spans.to_vec())
        })
        .await;
    let (server_spans, agent_spans) = of_run(&spans, &id);
    let trace: BTreeSet<&[u8]> = server_spans.iter().chain(&agent_spans).map(|s| s.trace_id.as_slice()).collect();
    assert_eq!(trace.len(), 1, "one trace for the run's start, both attempts in it");
    assert_eq!(named(&server_spans, "submit").len(), 1);
    let delivery = |attempt: &str| {
        let found =
            named(&server_spans, "delivery").into_iter().find(|s| s.attribute("standby.attempt") == Some(attempt));
        found.unwrap_or_else(|| panic!("no delivery span of attempt {attempt}"))
    };
    let (first, second) = (delivery("1"), delivery("2"));
    assert_eq!((first.status_message.as_str(), second.status_message.as_str()), ("attempt requeued", ""));
    assert_eq!(named(&server_spans, "start")[0].parent_span_id, second.span_id);
    assert!(!agent_spans.is_empty());
    for span in &agent_spans {
        assert_eq!(span.parent_span_id, second.span_id, "{}: under the attempt that started", span.name);
    }
    let queued = ms(&run, "queued") * MS;
    assert_eq!(
        named(&server_spans, "placement")[0].duration_nanos(),
        queued,
        "submitted to the cold attempt's binding"
    );
}
