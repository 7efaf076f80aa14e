//! The status page (`/ui`) over real HTTP on 127.0.0.1, without a
//! browser: what a request without a session gets (a redirect or `401`,
//! never the page or data), the sign-in's refusal (no detail, slowed), the
//! session cookie's attributes, sign-out, the headers of every answer, the
//! data's agreement with the API, and the assets' hygiene (no inline
//! script, no markup built from data). The browser's view is
//! `tests/tests/status_page.rs`. The server runs the `spool` provider:
//! sandboxes are credential files, nothing launches.

use std::time::{Duration, Instant};

use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};
use reqwest::{Method, redirect};
use serde_json::Value;
use standby_control_plane::provider::spool::SpoolProvider;
use standby_control_plane::server::RunningServer;

mod support;

const KEY: &str = "status-page-test-key";

struct Harness {
    server: RunningServer<SpoolProvider>,
    http: reqwest::Client,
    _spool: tempfile::TempDir,
}

struct Answer {
    status: u16,
    headers: HeaderMap,
    text: String,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).and_then(|value| value.to_str().ok()).unwrap_or_default()
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|error| panic!("not JSON ({error}): {}", self.text))
    }
}

async fn harness(pool_size: usize) -> Harness {
    let (server, spool) = support::spool_server(KEY, pool_size).await;
    // Redirects are what is tested: never followed.
    let http = reqwest::Client::builder().redirect(redirect::Policy::none()).build().expect("a client");
    Harness { server, http, _spool: spool }
}

impl Harness {
    async fn send(&self, request: reqwest::RequestBuilder) -> Answer {
        let response = request.send().await.expect("the request is answered");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.expect("a body");
        Answer { status, headers, text }
    }

    fn request(&self, method: Method, path: &str, cookie: Option<&str>) -> reqwest::RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.server.url()));
        match cookie {
            Some(cookie) => request.header("cookie", cookie),
            None => request,
        }
    }

    async fn get(&self, path: &str, cookie: Option<&str>) -> Answer {
        self.send(self.request(Method::GET, path, cookie)).await
    }

    async fn sign_in(&self, body: &str) -> Answer {
        let request = self
            .request(Method::POST, "/ui/sign-in", None)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body.to_owned());
        self.send(request).await
    }

    /// Signs in with the key: the `name=value` of the session cookie.
    async fn session(&self) -> String {
        let answer = self.sign_in(&format!("key={KEY}")).await;
        assert_eq!((answer.status, answer.header("location")), (303, "/ui"), "{}", answer.text);
        let set = answer.header("set-cookie");
        set.split(';').next().expect("a cookie").to_owned()
    }

    async fn submit(&self, body: &str) -> Value {
        let request = self
            .http
            .post(format!("{}/v1/runs", self.server.url()))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(body.to_owned());
        let answer = self.send(request).await;
        assert_eq!(answer.status, 201, "{}", answer.text);
        answer.json()
    }

    async fn api(&self, path: &str) -> Value {
        let answer = self.send(self.http.get(format!("{}{path}", self.server.url())).bearer_auth(KEY)).await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.text);
        answer.json()
    }
}

/// What every `/ui` answer carries, whatever its status.
fn assert_guarded(answer: &Answer, what: &str) {
    let csp = answer.header("content-security-policy");
    for directive in ["default-src 'none'", "script-src 'self'", "frame-ancestors 'none'", "form-action 'self'"] {
        assert!(csp.contains(directive), "{what}: CSP `{csp}` lacks {directive}");
    }
    assert!(!csp.contains("unsafe"), "{what}: {csp}");
    assert_eq!(answer.header("x-content-type-options"), "nosniff", "{what}");
    assert_eq!(answer.header("cache-control"), "no-store", "{what}");
    assert_eq!(answer.header("referrer-policy"), "no-referrer", "{what}");
    assert_eq!(answer.header("x-frame-options"), "DENY", "{what}");
}

#[tokio::test]
async fn without_a_session_the_page_sends_to_sign_in_and_no_data_is_served() {
    let harness = harness(1).await;
    for path in ["/ui", "/ui/"] {
        for cookie in [None, Some("standby_session=forged"), Some("other=1")] {
            let answer = harness.get(path, cookie).await;
            assert_eq!((answer.status, answer.header("location")), (303, "/ui/sign-in"), "{path} {cookie:?}");
            assert!(answer.text.is_empty(), "{path}: nothing of the page: {}", answer.text);
            assert_guarded(&answer, path);
        }
    }
    for path in ["/ui/api/summary", "/ui/api/runs", "/ui/api/sandboxes", "/ui/runs/exe_x/log"] {
        for cookie in [None, Some("standby_session=forged")] {
            let answer = harness.get(path, cookie).await;
            assert_eq!(answer.status, 401, "{path} {cookie:?}: {}", answer.text);
            assert_eq!(answer.header("content-type"), "application/problem+json", "{path}");
            assert!(!answer.text.contains("pool") && !answer.text.contains("sbx_"), "{path}: {}", answer.text);
            assert_guarded(&answer, path);
        }
        // The API key as a bearer opens the API, not the page's data.
        let bearer = harness.send(harness.request(Method::GET, path, None).bearer_auth(KEY)).await;
        assert_eq!(bearer.status, 401, "{path} with a bearer");
    }
    let form = harness.get("/ui/sign-in", None).await;
    assert_eq!(form.status, 200);
    assert!(form.text.contains(r#"method="post""#) && form.text.contains(r#"name="key""#), "{}", form.text);
    assert_guarded(&form, "the sign-in form");
    harness.server.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn a_wrong_key_is_refused_slowly_and_without_saying_more() {
    let harness = harness(1).await;
    let mut bodies = Vec::new();
    for body in ["key=wrong", &format!("key={KEY}x"), "", &format!("other={KEY}")] {
        let started = Instant::now();
        let answer = harness.sign_in(body).await;
        assert_eq!(answer.status, 401, "{body}");
        assert!(started.elapsed() >= Duration::from_millis(900), "{body}: answered in {:?}", started.elapsed());
        assert!(answer.headers.get(SET_COOKIE).is_none(), "{body}: no cookie");
        assert!(answer.text.contains("Sign-in failed."), "{body}: {}", answer.text);
        assert!(!answer.text.contains("wrong") && !answer.text.contains(KEY), "{body}: nothing echoed");
        assert_guarded(&answer, "a refused sign-in");
        bodies.push(answer.text);
    }
    bodies.dedup();
    assert_eq!(bodies.len(), 1, "every refusal says the same");
    let form = harness.get("/ui/sign-in", None).await;
    assert!(form.text.contains(r#"<p id="failed" role="alert" hidden>"#), "the form alone says nothing failed");
    let huge = harness.sign_in(&format!("key={}", "k".repeat(8192))).await;
    assert_eq!(huge.status, 413, "the form's body is bounded");
    harness.server.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn the_session_cookie_is_http_only_strict_scoped_and_secure_over_https_and_sign_out_ends_it() {
    let harness = harness(1).await;
    let answer = harness.sign_in(&format!("key={KEY}")).await;
    assert_eq!((answer.status, answer.header("location")), (303, "/ui"));
    assert_guarded(&answer, "a sign-in");
    let cookie = answer.header("set-cookie").to_owned();
    let attributes: Vec<&str> = cookie.split(';').map(str::trim).collect();
    assert!(attributes[0].starts_with("standby_session=") && attributes[0].len() > 40, "{cookie}");
    assert!(!attributes[0].contains(KEY), "the cookie is not the key");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/ui"] {
        assert!(attributes.contains(&attribute), "{cookie}: {attribute}");
    }
    assert!(!attributes.contains(&"Secure"), "plain HTTP: a Secure cookie would never come back");
    let session = attributes[0].to_owned();

    // Behind a proxy terminating TLS.
    let proxied = harness
        .request(Method::POST, "/ui/sign-in", None)
        .header("content-type", "application/x-www-form-urlencoded")
        .header("x-forwarded-proto", "https")
        .body(format!("key={KEY}"));
    let proxied = harness.send(proxied).await;
    assert!(proxied.header("set-cookie").split(';').any(|a| a.trim() == "Secure"), "{}", proxied.header("set-cookie"));

    let page = harness.get("/ui", Some(&session)).await;
    assert_eq!(page.status, 200);
    assert_eq!(page.header("content-type"), "text/html; charset=utf-8");
    assert!(page.text.contains(r#"<script src="/ui/app.js" defer></script>"#));
    assert_guarded(&page, "the page");
    let signed_in_form = harness.get("/ui/sign-in", Some(&session)).await;
    assert_eq!((signed_in_form.status, signed_in_form.header("location")), (303, "/ui"));
    for path in ["/ui/app.js", "/ui/app.css", "/ui/api/summary"] {
        let answer = harness.get(path, Some(&session)).await;
        assert_eq!(answer.status, 200, "{path}");
        assert_guarded(&answer, path);
    }

    // From another site (the browser says so): refused.
    let forged = harness.request(Method::POST, "/ui/sign-out", Some(&session)).header("sec-fetch-site", "cross-site");
    assert_eq!(harness.send(forged).await.status, 403);
    assert_eq!(harness.get("/ui", Some(&session)).await.status, 200, "still signed in");

    let out = harness
        .send(harness.request(Method::POST, "/ui/sign-out", Some(&session)).header("sec-fetch-site", "same-origin"))
        .await;
    assert_eq!((out.status, out.header("location")), (303, "/ui/sign-in"));
    let cleared = out.header("set-cookie");
    assert!(cleared.starts_with("standby_session=;") && cleared.contains("Max-Age=0"), "{cleared}");
    // The server forgot it too: the old cookie opens nothing.
    assert_eq!(harness.get("/ui", Some(&session)).await.header("location"), "/ui/sign-in");
    assert_eq!(harness.get("/ui/api/runs", Some(&session)).await.status, 401);
    assert!(out.headers.get(LOCATION).is_some());
    harness.server.shutdown().await.expect("shutdown");
}

#[tokio::test]
async fn the_data_is_what_the_api_answers_and_sandboxes_come_a_page_at_a_time() {
    let harness = harness(3).await;
    let session = harness.session().await;
    let command = r#"{"command": ["sh", "-c", "echo '<b>bold</b>'"], "thread_id": "t-1"}"#;
    let run = harness.submit(command).await;
    let id = run["id"].as_str().expect("an id").to_owned();
    harness.submit(r#"{"command": ["true"]}"#).await;

    let summary = harness.get("/ui/api/summary", Some(&session)).await.json();
    let api_runs = harness.api("/v1/runs").await;
    let mut by_state = std::collections::BTreeMap::<String, u64>::new();
    for run in api_runs["runs"].as_array().expect("runs") {
        *by_state.entry(run["state"].as_str().expect("a state").to_owned()).or_default() += 1;
    }
    for (state, count) in summary["runs_by_state"].as_object().expect("runs by state") {
        assert_eq!(count.as_u64(), Some(by_state.get(state).copied().unwrap_or(0)), "{state}: {summary}");
    }
    assert_eq!(summary["last_hour"]["arrivals"], 2, "{summary}");
    assert_eq!(summary["pool"]["pool_target"], 3);
    assert_eq!(summary["cluster"], Value::Null, "not replicated");

    let latest = harness.get("/ui/api/runs", Some(&session)).await.json();
    let rows = latest["runs"].as_array().expect("runs");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["id"], id.as_str(), "newest first");
    assert_eq!(rows[1]["command"], run["command"], "as the API has it, unescaped: the page escapes");
    assert_eq!(rows[1]["thread_id"], "t-1");
    let api_run = harness.api(&format!("/v1/runs/{id}")).await;
    assert_eq!(rows[1]["state"], api_run["state"]);
    let segments = rows[1]["waterfall"].as_array().expect("a waterfall");
    assert!(!segments.is_empty() && segments.last().expect("one")["open"] == true, "a live run: {segments:?}");

    // Every sandbox, two to a page, with the API's cursors.
    let api = harness.api("/v1/sandboxes").await;
    let every: Vec<Value> = api["sandboxes"].as_array().expect("sandboxes").iter().map(|s| s["id"].clone()).collect();
    assert!(every.len() >= 3, "{api}");
    let (mut paged, mut cursor, mut pages) = (Vec::new(), String::new(), 0);
    loop {
        let query = if cursor.is_empty() { String::new() } else { format!("&cursor={cursor}") };
        let page = harness.get(&format!("/ui/api/sandboxes?limit=2{query}"), Some(&session)).await.json();
        let ids: Vec<Value> = page["sandboxes"].as_array().expect("a page").iter().map(|s| s["id"].clone()).collect();
        assert!(ids.len() <= 2);
        paged.extend(ids);
        pages += 1;
        match page["next_cursor"].as_str() {
            Some(next) => cursor = next.to_owned(),
            None => break,
        }
    }
    assert_eq!(paged, every);
    assert_eq!(pages, every.len().div_ceil(2));
    let retired = harness.get("/ui/api/sandboxes?state=retired", Some(&session)).await.json();
    assert_eq!(retired["sandboxes"].as_array().map(Vec::len), Some(0));
    assert_eq!(harness.get("/ui/api/sandboxes?limit=0", Some(&session)).await.status, 400);
    assert_eq!(harness.get("/ui/api/sandboxes?cursor=x", Some(&session)).await.status, 400);
    assert_eq!(harness.get("/ui/api/sandboxes?state=nope", Some(&session)).await.status, 400);
    let log = harness.get(&format!("/ui/runs/{id}/log"), Some(&session)).await;
    assert_eq!((log.status, log.header("content-type")), (200, "text/plain; charset=utf-8"));
    assert_guarded(&log, "a log");
    assert_eq!(harness.get("/ui/runs/exe_nope/log", Some(&session)).await.status, 404);
    harness.server.shutdown().await.expect("shutdown");
}

#[test]
fn the_assets_hold_no_inline_script_and_build_no_markup_from_data() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ui");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).expect("an asset");
    for page in ["index.html", "signin.html"] {
        let text = read(page);
        let lower = text.to_ascii_lowercase();
        for (at, _) in lower.match_indices("<script") {
            let tag = &lower[at..at + lower[at..].find('>').expect("a tag's end")];
            assert!(tag.contains("src=\"/ui/"), "{page}: an inline script: {tag}");
        }
        assert!(!inline_handler(&lower), "{page}: an inline event handler");
        assert!(!lower.contains("style=\""), "{page}: an inline style");
    }
    let script = read("app.js");
    for sink in ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"] {
        assert!(!script.contains(sink), "app.js uses {sink}");
    }
}

/// Whether an HTML text holds an attribute `on…=` (an inline handler).
fn inline_handler(lower: &str) -> bool {
    lower.split(|c: char| c.is_whitespace() || c == '<').any(|word| {
        word.split_once('=').is_some_and(|(name, _)| {
            name.len() > 2 && name.starts_with("on") && name.bytes().all(|b| b.is_ascii_lowercase())
        })
    })
}

/// With 10,000 sandboxes the page's answers stay small and quick: the
/// summary holds counts, not sandboxes, and the sandboxes come 50 to a
/// page (the page never asks for more), however many there are.
#[tokio::test]
async fn ten_thousand_sandboxes_are_counts_and_pages_never_one_table() {
    const SANDBOXES: usize = 10_000;
    let harness = harness(SANDBOXES).await;
    let session = harness.session().await;
    let started = Instant::now();
    loop {
        let summary = harness.get("/ui/api/summary", Some(&session)).await.json();
        if summary["pool"]["standby"].as_u64() == Some(SANDBOXES as u64) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(120), "the pool never filled: {summary}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let timed = Instant::now();
    let summary = harness.get("/ui/api/summary", Some(&session)).await;
    let summary_took = timed.elapsed();
    assert!(summary.text.len() < 4096, "the summary is counts: {} bytes", summary.text.len());
    let timed = Instant::now();
    let page = harness.get("/ui/api/sandboxes", Some(&session)).await;
    let page_took = timed.elapsed();
    let body = page.json();
    assert_eq!(body["sandboxes"].as_array().map(Vec::len), Some(50), "a page, not the table");
    let cursor = body["next_cursor"].as_str().expect("more pages");
    let next = harness.get(&format!("/ui/api/sandboxes?cursor={cursor}"), Some(&session)).await.json();
    assert_eq!(next["sandboxes"].as_array().map(Vec::len), Some(50));
    assert_ne!(next["sandboxes"][0]["id"], body["sandboxes"][0]["id"]);
    eprintln!("10,000 sandboxes: summary {summary_took:?} ({} bytes), a page {page_took:?}", summary.text.len());
    // Generous for a debug build on a busy machine: the point is that
    // neither grows with a table of 10,000 rows sent to the browser.
    assert!(summary_took < Duration::from_secs(5) && page_took < Duration::from_secs(5));
    let script = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ui/app.js"))
        .expect("app.js");
    assert!(script.contains("const SANDBOX_PAGE = 50;"), "the page asks for 50 at a time");
    harness.server.shutdown().await.expect("shutdown");
}
