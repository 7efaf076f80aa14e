//! The user API as a documented interface, over real HTTP on 127.0.0.1:
//! its OpenAPI document, its one error shape (RFC 9457 problems), the
//! `Idempotency-Key` of a submission, the lists' filters. The server runs
//! the `spool` provider: sandboxes are credential files, nothing launches.

use reqwest::Method;
use serde_json::{Value, json};
use standby_control_plane::provider::spool::SpoolProvider;
use standby_control_plane::server::RunningServer;

mod support;

const KEY: &str = "test-api-key";
const PROBLEM: &str = "application/problem+json";

struct Harness {
    server: RunningServer<SpoolProvider>,
    http: reqwest::Client,
    _spool: tempfile::TempDir,
}

struct Answer {
    status: u16,
    content_type: String,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

async fn harness(pool_size: usize) -> Harness {
    let (server, spool) = support::spool_server(KEY, pool_size).await;
    Harness { server, http: reqwest::Client::new(), _spool: spool }
}

impl Harness {
    async fn send(&self, request: reqwest::RequestBuilder) -> Answer {
        let response = request.send().await.expect("the request is answered");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let content_type = headers
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let text = response.text().await.expect("a body");
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Answer { status, content_type, headers, body }
    }

    fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, format!("{}{path}", self.server.url())).bearer_auth(KEY)
    }

    async fn get(&self, path: &str) -> Answer {
        self.send(self.request(Method::GET, path)).await
    }

    async fn submit(&self, key: Option<&str>, body: &str) -> Answer {
        let mut request =
            self.request(Method::POST, "/v1/runs").header("content-type", "application/json").body(body.to_owned());
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        self.send(request).await
    }
}

/// A problem (RFC 9457) of `status`, its type one of the server's.
fn assert_problem(answer: &Answer, status: u16) {
    assert_eq!((answer.status, answer.content_type.as_str()), (status, PROBLEM), "{}", answer.body);
    let body = &answer.body;
    assert!(body["type"].as_str().is_some_and(|kind| kind.starts_with("urn:standby:problem:")), "{body}");
    assert!(body["title"].as_str().is_some_and(|title| !title.is_empty()), "{body}");
    assert_eq!(body["status"], status, "{body}");
    assert!(body["detail"].is_string(), "{body}");
}

/// The first field a problem blames: (where, name).
fn blamed(answer: &Answer) -> (String, String) {
    let error = &answer.body["errors"][0];
    for place in ["pointer", "parameter", "header"] {
        if let Some(name) = error[place].as_str() {
            return (place.to_owned(), name.to_owned());
        }
    }
    panic!("no field blamed: {}", answer.body);
}

#[tokio::test]
async fn the_openapi_document_is_served_without_a_key_and_is_the_committed_one() {
    let harness = harness(0).await;
    let answer = harness.send(harness.http.get(format!("{}/openapi.json", harness.server.url()))).await;
    assert_eq!((answer.status, answer.content_type.as_str()), (200, "application/json"));
    let committed: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/openapi.json")).expect("committed"),
    )
    .expect("JSON");
    assert_eq!(answer.body, committed);
    assert_eq!(answer.body["openapi"], "3.1.0");
}

#[tokio::test]
async fn every_refusal_of_the_user_api_is_a_problem_naming_the_field() {
    let harness = harness(0).await;
    let unauthorized = harness.send(harness.http.get(format!("{}/v1/runs", harness.server.url()))).await;
    assert_problem(&unauthorized, 401);
    assert_eq!(unauthorized.headers.get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer"));

    let refused = harness
        .submit(
            None,
            r#"{"command": ["ls"], "attachments": [{"name": "a", "content": "x"}, {"name": "a", "content": "y"}]}"#,
        )
        .await;
    assert_problem(&refused, 400);
    assert_eq!(blamed(&refused), ("pointer".into(), "/attachments/1/name".into()));
    assert_eq!(refused.body["field"], "attachments[1].name", "the API's own name for it, as before");

    let env = harness.submit(None, r#"{"command": ["ls"], "env": {"A/B=": "x"}}"#).await;
    assert_eq!(blamed(&env), ("pointer".into(), "/env/A~1B=".into()));

    assert_problem(&harness.get("/v1/runs/exe_nope").await, 404);
    assert_problem(&harness.get("/v1/threads/nope").await, 404);
    for (path, parameter) in [
        ("/v1/runs?limit=0", "limit"),
        ("/v1/runs?state=asleep", "state"),
        ("/v1/runs?thread_id=..", "thread_id"),
        ("/v1/runs?cursor=!", "cursor"),
        ("/v1/sandboxes?state=asleep", "state"),
        ("/v1/sandboxes?thread_id=a%20b", "thread_id"),
        ("/v1/sandboxes?limit=1001", "limit"),
        ("/v1/runs?limt=5", "limt"),
        ("/v1/sandboxes?cursor=0%3A&=null", ""),
        ("/v1/runs/exe_nope/events?after=1", "after"),
        ("/v1/runs/exe_nope/log?start=0", "start"),
    ] {
        let answer = harness.get(path).await;
        assert_problem(&answer, 400);
        assert_eq!(blamed(&answer), ("parameter".into(), parameter.into()), "{path}");
    }

    let run = harness.submit(None, r#"{"command": ["ls"]}"#).await;
    assert_eq!(run.status, 201, "{}", run.body);
    let cancel = format!("/v1/runs/{}/cancel", run.body["id"].as_str().expect("an id"));
    assert_eq!(harness.send(harness.request(Method::POST, &cancel)).await.status, 200);
    // Cancelling a cancelled run is not a refusal.
    let again = harness.send(harness.request(Method::POST, &cancel)).await;
    assert_eq!((again.status, &again.body["state"]), (200, &json!("cancelled")));
}

#[tokio::test]
async fn an_idempotency_key_answers_its_run_and_refuses_another_body() {
    let harness = harness(0).await;
    let first = harness.submit(Some("retry-7"), r#"{"command": ["make", "test"], "env": {"A": "1", "B": "2"}}"#).await;
    assert_eq!(first.status, 201, "{}", first.body);
    // The same body, spaced and ordered differently.
    let again = harness.submit(Some("retry-7"), r#"{ "env": {"B": "2", "A": "1"}, "command": ["make","test"] }"#).await;
    assert_eq!((again.status, &again.body["id"]), (201, &first.body["id"]), "{}", again.body);
    let other = harness.submit(Some("retry-7"), r#"{"command": ["make", "lint"]}"#).await;
    assert_problem(&other, 422);
    assert_eq!(other.body["type"], "urn:standby:problem:idempotency-key-reused");
    assert_eq!(blamed(&other), ("header".into(), "Idempotency-Key".into()));
    let too_long = harness.submit(Some(&"k".repeat(256)), r#"{"command": ["ls"]}"#).await;
    assert_problem(&too_long, 400);
    assert_eq!(blamed(&too_long), ("header".into(), "Idempotency-Key".into()));
    // Without a key (or with another) the same body is a new run.
    let fresh = harness.submit(None, r#"{"command": ["make", "test"], "env": {"A": "1", "B": "2"}}"#).await;
    let other_key =
        harness.submit(Some("retry-8"), r#"{"command": ["make", "test"], "env": {"A": "1", "B": "2"}}"#).await;
    assert_ne!(fresh.body["id"], first.body["id"]);
    assert_ne!(other_key.body["id"], first.body["id"]);
    let runs = harness.get("/v1/runs").await;
    assert_eq!(runs.body["runs"].as_array().map(Vec::len), Some(3), "{}", runs.body);
}

#[tokio::test]
async fn sandboxes_and_runs_are_paged_and_filtered() {
    let harness = harness(2).await;
    // The pool's two standbys exist from the start (made by the restore).
    let standbys = harness.get("/v1/sandboxes?state=standby").await.body;
    let ids: Vec<&str> =
        standbys["sandboxes"].as_array().expect("a list").iter().filter_map(|s| s["id"].as_str()).collect();
    assert_eq!(ids.len(), 2, "{standbys}");
    let first = harness.get("/v1/sandboxes?state=standby&limit=1").await.body;
    let cursor = first["next_cursor"].as_str().expect("a next page");
    let second = harness.get(&format!("/v1/sandboxes?state=standby&limit=1&cursor={cursor}")).await.body;
    assert_eq!([&first["sandboxes"][0]["id"], &second["sandboxes"][0]["id"]], [ids[0], ids[1]]);
    assert_eq!(second["next_cursor"], Value::Null);
    assert_eq!(harness.get("/v1/sandboxes?state=retired").await.body["sandboxes"], json!([]));
    assert_eq!(harness.get("/v1/sandboxes?thread_id=t1").await.body["sandboxes"], json!([]));

    for thread in ["t1", "t2", "t1"] {
        let body = json!({"command": ["ls"], "thread_id": thread}).to_string();
        assert_eq!(harness.submit(None, &body).await.status, 201);
    }
    let t1 = harness.get("/v1/runs?thread_id=t1").await.body;
    assert_eq!(t1["runs"].as_array().map(Vec::len), Some(2), "{t1}");
    assert!(t1["runs"].as_array().expect("runs").iter().all(|run| run["thread_id"] == "t1"));
}

/// A query string that is not UTF-8 once decoded is refused as a problem,
/// not in the framework's plain text.
#[tokio::test]
async fn a_malformed_query_string_is_a_problem() {
    let harness = harness(0).await;
    for path in ["/v1/runs?limit=%FF", "/v1/sandboxes?state=%C3%28", "/v1/runs/exe_1/events?cursor=%FE"] {
        assert_problem(&harness.get(path).await, 400);
    }
}

/// A path segment that is not UTF-8 once decoded is refused as a problem,
/// not in the framework's plain text.
#[tokio::test]
async fn a_malformed_path_segment_is_a_problem() {
    let harness = harness(0).await;
    for path in ["/v1/runs/%FF", "/v1/runs/%FF/log", "/v1/threads/%C3%28"] {
        assert_problem(&harness.get(path).await, 400);
    }
}

/// A body over the server's limit is refused as a problem (413), not in
/// the framework's plain text.
#[tokio::test]
async fn a_body_over_the_limit_is_a_problem() {
    let harness = harness(0).await;
    let body = format!(r#"{{"command": ["ls"], "metadata": {{"x": "{}"}}}}"#, "x".repeat(3 * 1024 * 1024));
    assert_problem(&harness.submit(None, &body).await, 413);
}
