//! The server over real HTTP and WebSocket on 127.0.0.1, with a fake
//! provider: the test plays the agent, with the credentials the server
//! launched its sandboxes with.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use standby_control_plane::api_bounds;
use standby_control_plane::provider::{AgentLaunch, Details, Found, Launched, ProviderError, SandboxProvider};
use standby_control_plane::rules::{Input, RunBounds};
use standby_control_plane::seal::SealKey;
use standby_control_plane::server::{RunningServer, ServerConfig, start};
use standby_control_plane::store::{SqliteStore, Store};
use standby_protocol::{LogChunk, LogReceived, Secret, ServerMessage, Spec};
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};

const KEY: &str = "test-api-key";
const WAIT: Duration = Duration::from_secs(10);

/// Launches nothing: it hands each launch's credential to the test, and
/// reports an exit when the test (or a stop) says so.
#[derive(Debug)]
struct FakeProvider {
    launches: mpsc::UnboundedSender<(String, Secret)>,
    running: Mutex<HashMap<String, oneshot::Sender<Option<i32>>>>,
    found: Found,
}

impl FakeProvider {
    fn exit(&self, sandbox_id: &str, code: Option<i32>) {
        if let Some(sender) = self.running.lock().unwrap_or_else(PoisonError::into_inner).remove(sandbox_id) {
            let _ = sender.send(code);
        }
    }
}

impl SandboxProvider for FakeProvider {
    async fn create(&self, _: &str) -> Result<(), ProviderError> {
        Ok(())
    }
    async fn start(&self, _: &str) -> Result<(), ProviderError> {
        Ok(())
    }
    async fn launch(&self, sandbox_id: &str, launch: AgentLaunch) -> Result<Launched, ProviderError> {
        let (sender, exited) = oneshot::channel();
        self.running.lock().unwrap_or_else(PoisonError::into_inner).insert(sandbox_id.to_owned(), sender);
        let _ = self.launches.send((sandbox_id.to_owned(), launch.token));
        Ok(Launched { pid: None, exited })
    }
    async fn stop(&self, sandbox_id: &str) {
        self.exit(sandbox_id, None);
    }
    async fn wait_exit(&self, sandbox_id: &str, _: Duration) -> bool {
        !self.running.lock().unwrap_or_else(PoisonError::into_inner).contains_key(sandbox_id)
    }
    async fn delete(&self, _: &str) -> Result<(), ProviderError> {
        Ok(())
    }
    async fn state(&self, _: &str) -> Result<Found, ProviderError> {
        Ok(self.found)
    }
    async fn stop_all(&self) {
        let ids: Vec<String> = self.running.lock().unwrap_or_else(PoisonError::into_inner).keys().cloned().collect();
        for id in ids {
            self.exit(&id, None);
        }
    }
    fn details(&self, _: &str) -> Details {
        Details::default()
    }
}

struct Harness {
    server: RunningServer<FakeProvider>,
    provider: Arc<FakeProvider>,
    launches: mpsc::UnboundedReceiver<(String, Secret)>,
    http: reqwest::Client,
}

async fn harness(pool_size: usize, store: Arc<dyn Store>, found: Found) -> Harness {
    harness_with(pool_size, store, found, Duration::from_secs(5)).await
}

async fn harness_with(pool_size: usize, store: Arc<dyn Store>, found: Found, heartbeat: Duration) -> Harness {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (tx, launches) = mpsc::unbounded_channel();
    let provider = Arc::new(FakeProvider { launches: tx, running: Mutex::new(HashMap::new()), found });
    let spec = Spec::default();
    let mut config = ServerConfig::new(Secret::new(KEY), spec);
    config.pool_size = pool_size;
    config.heartbeat_interval = heartbeat;
    config.linger = Duration::from_millis(100);
    let server = start(config, store, Arc::clone(&provider)).await.expect("the server starts");
    Harness { server, provider, launches, http: reqwest::Client::new() }
}

/// A harness with one standby whose server configuration `change` adjusts.
async fn configured(change: impl FnOnce(&mut ServerConfig)) -> Harness {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (tx, launches) = mpsc::unbounded_channel();
    let provider = Arc::new(FakeProvider { launches: tx, running: Mutex::new(HashMap::new()), found: Found::NoAgent });
    let spec = Spec::default();
    let mut config = ServerConfig::new(Secret::new(KEY), spec);
    config.pool_size = 1;
    change(&mut config);
    let store = Arc::new(SqliteStore::in_memory().expect("a store"));
    let server = start(config, store, Arc::clone(&provider)).await.expect("the server starts");
    Harness { server, provider, launches, http: reqwest::Client::new() }
}

async fn memory(pool_size: usize) -> Harness {
    harness(pool_size, Arc::new(SqliteStore::in_memory().expect("a store")), Found::NoAgent).await
}

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

impl Harness {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.server.url())
    }

    async fn next_launch(&mut self) -> (String, Secret) {
        tokio::time::timeout(WAIT, self.launches.recv()).await.expect("a launch in time").expect("a launch")
    }

    async fn api(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self.http.request(method, self.url(path)).bearer_auth(KEY);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("the request is answered");
        let status = response.status().as_u16();
        let text = response.text().await.expect("a body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    async fn agent(&self, method: reqwest::Method, path: &str, token: &Secret, body: Option<Value>) -> (u16, Value) {
        let mut request =
            self.http.request(method, self.url(path)).bearer_auth(token.expose()).header("Standby-Protocol", "1");
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("the request is answered");
        let status = response.status().as_u16();
        let text = response.text().await.expect("a body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// Upgrades `/ws` with `token`: the socket, or the refusal's status.
    async fn connect(&self, token: &str) -> Result<Socket, u16> {
        let url = self.url("/ws").replacen("http", "ws", 1);
        let mut request = url.into_client_request().expect("a request");
        request.headers_mut().insert("Authorization", format!("Bearer {token}").parse().expect("a header"));
        request.headers_mut().insert("Standby-Protocol", "1".parse().expect("a header"));
        match tokio_tungstenite::connect_async(request).await {
            Ok((socket, _)) => Ok(socket),
            Err(tungstenite::Error::Http(response)) => Err(response.status().as_u16()),
            Err(error) => panic!("the upgrade failed: {error}"),
        }
    }

    async fn run(&self, id: &str) -> Value {
        let (status, run) = self.api(reqwest::Method::GET, &format!("/v1/runs/{id}"), None).await;
        assert_eq!(status, 200, "{run}");
        run
    }

    /// Polls the run until `done` holds (the API raises no event).
    async fn wait_run(&self, id: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let run = self.run(id).await;
            if done(&run) {
                return run;
            }
            assert!(tokio::time::Instant::now() < deadline, "the run did not get there: {run}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn heartbeat(socket: &mut Socket, state: &str) {
    let frame = json!({"type": "heartbeat", "state": state, "execution_id": null}).to_string();
    socket.send(Message::Text(frame.into())).await.expect("a heartbeat is sent");
}

/// The next server message, skipping control frames.
async fn next_message(socket: &mut Socket) -> Option<ServerMessage> {
    loop {
        match tokio::time::timeout(WAIT, socket.next()).await.expect("a frame in time") {
            Some(Ok(Message::Text(text))) => {
                return Some(ServerMessage::decode(text.as_str()).expect("a server message"));
            }
            Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return None,
            Some(Ok(_)) => {}
        }
    }
}

/// A standby of the pool, connected and `ready`; its id, token and socket.
async fn ready_standby(harness: &mut Harness) -> (String, Secret, Socket) {
    let (sandbox_id, token) = harness.next_launch().await;
    let mut socket = harness.connect(token.expose()).await.expect("the standby connects");
    heartbeat(&mut socket, "ready").await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (_, listing) = harness.api(reqwest::Method::GET, "/v1/sandboxes", None).await;
        let candidate = listing["sandboxes"]
            .as_array()
            .is_some_and(|all| all.iter().any(|s| s["id"] == sandbox_id.as_str() && s["candidate"] == true));
        if candidate {
            return (sandbox_id, token, socket);
        }
        assert!(tokio::time::Instant::now() < deadline, "the standby never became a candidate: {listing}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn the_user_api_needs_the_key_and_names_bad_fields() {
    let harness = memory(0).await;
    let no_key = harness.http.get(harness.url("/v1/runs/exe_x")).send().await.expect("answered");
    assert_eq!(no_key.status().as_u16(), 401);
    let wrong = harness.http.get(harness.url("/v1/sandboxes")).bearer_auth("nope").send().await.expect("answered");
    assert_eq!(wrong.status().as_u16(), 401);
    let (status, body) = harness.api(reqwest::Method::GET, "/v1/runs/exe_nope", None).await;
    assert_eq!((status, body["detail"].as_str().is_some()), (404, true));
    assert_eq!(harness.api(reqwest::Method::POST, "/v1/runs/exe_nope/cancel", None).await.0, 404);
    assert_eq!(harness.api(reqwest::Method::GET, "/v1/runs/exe_nope/log", None).await.0, 404);
    for (body, field) in [
        (json!({"cwd": "app"}), "command"),
        (json!({"command": []}), "command"),
        (json!({"command": ["ls"], "strict_mcp": "yes"}), "strict_mcp"),
        (json!({"command": ["ls"], "attachments": [{"name": "a/b", "content": "x"}]}), "attachments[0].name"),
        (json!({"command": ["ls"], "bogus": 1}), "bogus"),
    ] {
        let (status, answer) = harness.api(reqwest::Method::POST, "/v1/runs", Some(body.clone())).await;
        assert_eq!(status, 400, "{body} → {answer}");
        assert_eq!(answer["field"], field, "{body} → {answer}");
        assert!(answer["detail"].as_str().is_some_and(|e| e.contains(field)), "{answer}");
    }
    let raw =
        harness.http.post(harness.url("/v1/runs")).bearer_auth(KEY).body("{not json").send().await.expect("answered");
    assert_eq!(raw.status().as_u16(), 400);
    let (_, runs) = harness.api(reqwest::Method::GET, "/v1/runs", None).await;
    assert_eq!(runs["runs"], json!([]), "nothing was half-written");
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn credentials_are_refused_with_410_or_401_as_the_contract_says() {
    let mut harness = memory(1).await;
    assert_eq!(harness.connect("sby_unknown_credential").await.err(), Some(410));
    assert_eq!(harness.connect("run_unknown_credential").await.err(), Some(401));
    assert_eq!(harness.connect("garbage").await.err(), Some(401));
    let (sandbox_id, token) = harness.next_launch().await;
    let id = token.expose().split('_').nth(1).expect("an id").to_owned();
    assert_eq!(harness.connect(&format!("sby_{id}_wrongsecret")).await.err(), Some(401));
    let (status, spec) = harness.agent(reqwest::Method::GET, "/v1/standby/spec", &token, None).await;
    assert_eq!(status, 200);
    assert_eq!(spec["workspace"], json!({"repos": [], "setup": []}));
    // A standby whose agent exited is retired: 410 from then on.
    harness.provider.exit(&sandbox_id, Some(15));
    let deadline = tokio::time::Instant::now() + WAIT;
    while harness.connect(token.expose()).await.err() != Some(410) {
        assert!(tokio::time::Instant::now() < deadline, "the exited standby is still admitted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn warm_path_over_the_socket_with_every_execution_call() {
    let mut harness = memory(1).await;
    let (sandbox_id, standby_token, mut standby) = ready_standby(&mut harness).await;
    let body = json!({
        "command": ["./agent.sh", "--task", "fix"],
        "cwd": "app",
        "env": {"TASK_ID": "t1"},
        "secrets": {"API_TOKEN": "s3cret"},
        "cloud_env": {"AWS_SECRET_ACCESS_KEY": "cl0ud"},
        "git_credentials": [{"protocol": "https", "host": "git.example", "username": "bot", "password": "pw"}],
        "metadata": {"ticket": 42},
        "attachments": [{"name": "spec.md", "content": "# the spec"}],
        "mcp_env": {"TASK_ID": "t1"},
        "strict_mcp": true,
    });
    let (status, created) = harness.api(reqwest::Method::POST, "/v1/runs", Some(body)).await;
    assert_eq!(status, 201, "{created}");
    let run_id = created["id"].as_str().expect("an id").to_owned();
    assert_eq!(created["path"], "warm");
    let Some(ServerMessage::Assignment(assignment)) = next_message(&mut standby).await else {
        panic!("no assignment on the standby socket");
    };
    assert_eq!(assignment.execution_id, run_id);
    assert_eq!(assignment.run.command, ["./agent.sh", "--task", "fix"]);
    assert!(assignment.run.strict_mcp);
    let run_token = assignment.run_credential.clone();

    // The run credential connects: the replay confirms delivery, the
    // standby credential is revoked and its socket closed.
    let mut run_socket = harness.connect(run_token.expose()).await.expect("the run credential connects");
    let Some(ServerMessage::Assignment(replay)) = next_message(&mut run_socket).await else {
        panic!("no replay on the run socket");
    };
    assert_eq!(replay, assignment);
    assert_eq!(next_message(&mut standby).await, None, "the standby socket is closed");
    assert_eq!(harness.connect(standby_token.expose()).await.err(), Some(401));
    assert_eq!(harness.agent(reqwest::Method::GET, "/v1/standby/spec", &standby_token, None).await.0, 401);
    let run = harness.wait_run(&run_id, |run| run["state"] == "confirmed").await;
    assert!(
        run["timestamps"]["delivery_confirmed"].is_string() && run["timestamps"]["assignment_sent"].is_string(),
        "{run}"
    );

    let exe = format!("/v1/executions/{run_id}");
    let get = reqwest::Method::GET;
    let post = reqwest::Method::POST;
    let (status, secrets) = harness.agent(get.clone(), &format!("{exe}/secrets"), &run_token, None).await;
    assert_eq!((status, secrets), (200, json!({"secrets": {"API_TOKEN": "s3cret"}})));
    let (_, cloud) = harness.agent(post.clone(), &format!("{exe}/cloud-credentials"), &run_token, None).await;
    assert_eq!(cloud, json!({"env": {"AWS_SECRET_ACCESS_KEY": "cl0ud"}}));
    let (_, git) = harness.agent(post.clone(), &format!("{exe}/git-credentials"), &run_token, None).await;
    assert_eq!(git["credentials"][0]["password"], "pw");
    let (_, metadata) = harness.agent(get.clone(), &format!("{exe}/metadata"), &run_token, None).await;
    assert_eq!(metadata, json!({"ticket": 42}));
    let (_, listing) = harness.agent(get.clone(), &format!("{exe}/attachments"), &run_token, None).await;
    let attachment = &listing["attachments"][0];
    assert_eq!(attachment["name"], "spec.md");
    assert_eq!(attachment["sha256"], sha256_hex(b"# the spec"));
    let url = attachment["url"].as_str().expect("a url");
    let content = harness.http.get(harness.url(url)).bearer_auth(run_token.expose()).send().await.expect("answered");
    assert_eq!(content.bytes().await.expect("bytes").as_ref(), b"# the spec");
    // The standby credential, another run's path, or nothing: 401.
    assert_eq!(harness.agent(get.clone(), &format!("{exe}/secrets"), &standby_token, None).await.0, 401);
    assert_eq!(harness.agent(get.clone(), "/v1/executions/exe_other/secrets", &run_token, None).await.0, 401);
    assert_eq!(
        harness.http.get(harness.url(&format!("{exe}/secrets"))).send().await.expect("answered").status().as_u16(),
        401
    );

    let started = json!({"event_id": "e1", "type": "started"});
    assert_eq!(harness.agent(post.clone(), &format!("{exe}/events"), &run_token, Some(started.clone())).await.0, 200);
    assert_eq!(
        harness.agent(post.clone(), &format!("{exe}/events"), &run_token, Some(started)).await.0,
        200,
        "a retry is acknowledged"
    );
    let unknown = json!({"event_id": "e9", "type": "progress", "percent": 50});
    assert_eq!(harness.agent(post.clone(), &format!("{exe}/events"), &run_token, Some(unknown)).await.0, 202);
    let chunk = |offset: u64, data: &[u8]| {
        use base64::Engine as _;
        json!({"offset": offset, "data": base64::engine::general_purpose::STANDARD.encode(data)})
    };
    let log = format!("{exe}/log");
    assert_eq!(
        harness.agent(post.clone(), &log, &run_token, Some(chunk(0, b"hello "))).await,
        (200, json!({"received": 6}))
    );
    assert_eq!(
        harness.agent(post.clone(), &log, &run_token, Some(chunk(0, b"hello "))).await,
        (200, json!({"received": 6}))
    );
    assert_eq!(harness.agent(post.clone(), &log, &run_token, Some(chunk(6, b"[REDACTED]\n"))).await.0, 200);
    let (status, gap) = harness.agent(post.clone(), &log, &run_token, Some(chunk(100, b"x"))).await;
    assert_eq!((status, gap["field"].as_str()), (409, Some("offset")));
    // The agent gave up on 5 bytes of output (contract 1.1 note 10).
    let exited = json!({"event_id": "e2", "type": "exited", "code": 3, "log_lost": 5});
    assert_eq!(harness.agent(post.clone(), &format!("{exe}/events"), &run_token, Some(exited)).await.0, 200);

    let run = harness.run(&run_id).await;
    assert_eq!(
        (run["state"].as_str(), run["exit_code"].as_i64(), run["path"].as_str()),
        (Some("exited"), Some(3), Some("warm"))
    );
    assert_eq!((&run["log_complete"], &run["log_lost_bytes"]), (&json!(false), &json!(5)), "{run}");
    for stamp in ["submitted", "committed", "assignment_sent", "delivery_confirmed", "started", "exited"] {
        assert!(run["timestamps"][stamp].is_string(), "{stamp} missing: {run}");
    }
    assert!(run["durations_ms"]["submit_to_start"].is_u64(), "{run}");
    let (_, events) = harness.api(get.clone(), &format!("/v1/runs/{run_id}/events"), None).await;
    assert_eq!(events["events"].as_array().map(Vec::len), Some(2), "{events}");
    let text = harness
        .http
        .get(harness.url(&format!("/v1/runs/{run_id}/log")))
        .bearer_auth(KEY)
        .send()
        .await
        .expect("answered");
    assert_eq!(text.text().await.expect("text"), "hello [REDACTED]\n");
    let (status, _) = harness.api(post, &format!("/v1/runs/{run_id}/cancel"), None).await;
    assert_eq!(status, 409, "a finished run cannot be cancelled");

    let (_, metrics) = harness.api(get, "/metrics", None).await;
    let metrics = metrics.as_str().expect("text").to_owned();
    assert!(metrics.contains("standby_runs{state=\"exited\",path=\"warm\"} 1"), "{metrics}");
    assert!(metrics.contains("standby_assignment_to_start_seconds_count 1"), "{metrics}");
    let _ = sandbox_id;
    drop(run_socket);
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn cancel_before_confirmation_withdraws_the_run_credential() {
    let mut harness = memory(1).await;
    let (sandbox_id, standby_token, mut standby) = ready_standby(&mut harness).await;
    let (_, created) = harness.api(reqwest::Method::POST, "/v1/runs", Some(json!({"command": ["true"]}))).await;
    let run_id = created["id"].as_str().expect("an id").to_owned();
    let Some(ServerMessage::Assignment(assignment)) = next_message(&mut standby).await else { panic!("no assignment") };
    let (status, cancelled) = harness.api(reqwest::Method::POST, &format!("/v1/runs/{run_id}/cancel"), None).await;
    assert_eq!((status, cancelled["state"].as_str()), (200, Some("cancelled")));
    assert!(matches!(next_message(&mut standby).await, Some(ServerMessage::Cancel(c)) if c.execution_id == run_id));
    // The run is over: its credential may only report (amendment 8), so
    // the socket refuses it as an ended run's (`410`, withdrawn: exit 14).
    assert_eq!(harness.connect(assignment.run_credential.expose()).await.err(), Some(410));
    assert_eq!(harness.connect(standby_token.expose()).await.err(), Some(410));
    let (_, listing) = harness.api(reqwest::Method::GET, "/v1/sandboxes", None).await;
    let sandbox =
        listing["sandboxes"].as_array().and_then(|all| all.iter().find(|s| s["id"] == sandbox_id.as_str()).cloned());
    assert_eq!(sandbox.map(|s| s["state"].clone()), Some(json!("retired")));
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn a_committed_standby_that_dies_is_written_off_and_the_run_goes_cold() {
    let mut harness = memory(1).await;
    let (sandbox_id, standby_token, mut standby) = ready_standby(&mut harness).await;
    let (_, created) = harness.api(reqwest::Method::POST, "/v1/runs", Some(json!({"command": ["true"]}))).await;
    let run_id = created["id"].as_str().expect("an id").to_owned();
    let Some(ServerMessage::Assignment(first)) = next_message(&mut standby).await else { panic!("no assignment") };
    harness.provider.exit(&sandbox_id, None);
    let run = harness.wait_run(&run_id, |run| run["attempts"].as_array().is_some_and(|a| a.len() == 2)).await;
    assert_eq!(run["attempts"][0]["outcome"], "requeued");
    assert_eq!(run["attempts"][1]["path"], "cold");
    assert_eq!(harness.connect(first.run_credential.expose()).await.err(), Some(401));
    assert_eq!(harness.connect(standby_token.expose()).await.err(), Some(401), "written off: revoked, not retired");
    // The cold sandbox was launched for the run; it gets the assignment as
    // soon as it connects, once it has fetched its spec.
    let (cold_id, cold_token) = loop {
        let (id, token) = harness.next_launch().await;
        if run["attempts"][1]["sandbox_id"] == id.as_str() {
            break (id, token);
        }
    };
    let (status, _) = harness.agent(reqwest::Method::GET, "/v1/standby/spec", &cold_token, None).await;
    assert_eq!(status, 200);
    let mut cold = harness.connect(cold_token.expose()).await.expect("the cold sandbox connects");
    let Some(ServerMessage::Assignment(second)) = next_message(&mut cold).await else { panic!("no assignment") };
    assert_eq!(second.execution_id, run_id);
    let _ = cold_id;
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn a_restart_keeps_runs_and_relaunches_standbys() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("standby.db");
    let key = SealKey::random();
    let open = |path: &Path| -> Arc<dyn Store> { Arc::new(SqliteStore::open(path, &key).expect("the store opens")) };
    let mut harness = harness(1, open(&path), Found::NoAgent).await;
    let (sandbox_id, old_token, _socket) = ready_standby(&mut harness).await;
    harness.server.engine().ask::<()>(Input::Drain).await.expect("draining");
    let (_, created) = harness.api(reqwest::Method::POST, "/v1/runs", Some(json!({"command": ["true"]}))).await;
    let run_id = created["id"].as_str().expect("an id").to_owned();
    assert_eq!(created["state"], "queued");
    harness.server.shutdown().await.expect("a clean shutdown");

    let mut harness = self::harness(1, open(&path), Found::NoAgent).await;
    // The queued run may get a cold sandbox before the probe of the
    // standby answers: launches come in either order.
    let new_token = loop {
        let (launched, token) = harness.next_launch().await;
        if launched == sandbox_id {
            break token;
        }
    };
    assert_ne!(new_token, old_token);
    assert_eq!(harness.connect(old_token.expose()).await.err(), Some(401));
    let run = harness.run(&run_id).await;
    assert_eq!(run["id"], run_id.as_str(), "the queued run survived");
    assert_ne!(run["state"], "queued", "and was dispatched after the restart: {run}");
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn a_silent_control_connection_is_closed() {
    let store = Arc::new(SqliteStore::in_memory().expect("a store"));
    let mut harness = harness_with(1, store, Found::NoAgent, Duration::from_millis(100)).await;
    let (_, token) = harness.next_launch().await;
    let mut socket = harness.connect(token.expose()).await.expect("admitted");
    // No heartbeat: the server closes the socket (after telling a silent
    // standby it is retired).
    while let Some(message) = next_message(&mut socket).await {
        assert!(matches!(message, ServerMessage::Retired(_)), "{message:?}");
    }
    harness.server.shutdown().await.expect("a clean shutdown");
}

/// A server that stops closes its control sockets with 1012 (service
/// restart): the agent reconnects, and a replica relaying the socket knows
/// to wait for the next leader rather than pass the close on.
#[tokio::test]
async fn a_stopping_server_closes_control_sockets_with_1012() {
    let mut harness = memory(1).await;
    let (_, _, mut socket) = ready_standby(&mut harness).await;
    let shutdown = tokio::spawn(harness.server.shutdown());
    let close = loop {
        match tokio::time::timeout(WAIT, socket.next()).await.expect("a frame in time") {
            Some(Ok(Message::Close(frame))) => break frame,
            Some(Ok(_)) => {}
            other => panic!("the socket ended without a close frame: {other:?}"),
        }
    };
    let code = close.map(|frame| u16::from(frame.code));
    assert_eq!(code, Some(1012), "the close code");
    shutdown.await.expect("no panic").expect("a clean shutdown");
}

// ---- per-run bounds ------------------------------------------------------------------

/// A server with `bounds`, no pool: runs go cold, and the test plays the
/// agent of each with the run credential the assignment carries.
async fn bounded(store: Arc<dyn Store>, bounds: RunBounds) -> Harness {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (tx, launches) = mpsc::unbounded_channel();
    let provider = Arc::new(FakeProvider { launches: tx, running: Mutex::new(HashMap::new()), found: Found::NoAgent });
    let spec = Spec::default();
    let mut config = ServerConfig::new(Secret::new(KEY), spec);
    config.pool_size = 0;
    config.linger = Duration::from_millis(100);
    config.bounds = bounds;
    let server = start(config, store, Arc::clone(&provider)).await.expect("the server starts");
    Harness { server, provider, launches, http: reqwest::Client::new() }
}

const BOUNDS: RunBounds = RunBounds {
    log_cap: 64 * 1024 * 1024,
    retention: Duration::from_secs(600),
    idempotency_window: Duration::from_secs(24 * 3600),
};

/// Submits a run and takes its assignment on its cold sandbox's standby
/// connection: the run's id and credential.
async fn assigned(harness: &mut Harness) -> (String, Secret) {
    let (_, created) = harness.api(reqwest::Method::POST, "/v1/runs", Some(json!({"command": ["true"]}))).await;
    let run_id = created["id"].as_str().expect("an id").to_owned();
    let (_, token) = harness.next_launch().await;
    let mut socket = harness.connect(token.expose()).await.expect("the cold sandbox connects");
    heartbeat(&mut socket, "ready").await;
    let Some(ServerMessage::Assignment(assignment)) = next_message(&mut socket).await else {
        panic!("no assignment");
    };
    (run_id, assignment.run_credential)
}

async fn post_log(harness: &Harness, run_id: &str, token: &Secret, chunk: &LogChunk) -> (u16, Value) {
    let body = serde_json::to_value(chunk).expect("a chunk");
    harness.agent(reqwest::Method::POST, &format!("/v1/executions/{run_id}/log"), token, Some(body)).await
}

/// `GET /v1/runs/{id}/log` with a query: the bytes and the received header.
async fn read_log(harness: &Harness, run_id: &str, query: &str) -> (Vec<u8>, u64) {
    let url = harness.url(&format!("/v1/runs/{run_id}/log{query}"));
    let response = harness.http.get(url).bearer_auth(KEY).send().await.expect("answered");
    assert_eq!(response.status(), 200);
    let received = response.headers()["standby-log-received"].to_str().expect("text").parse().expect("a number");
    (response.bytes().await.expect("the body").to_vec(), received)
}

async fn metric(harness: &Harness, name: &str) -> u64 {
    let (_, text) = harness.api(reqwest::Method::GET, "/metrics", None).await;
    let text = text.as_str().expect("text").to_owned();
    let line = text.lines().find(|line| line.starts_with(&format!("{name} "))).expect("the metric");
    line.rsplit(' ').next().and_then(|n| n.parse().ok()).expect("a number")
}

#[tokio::test]
async fn oversized_events_are_refused_naming_the_field_and_store_nothing() {
    let mut harness = bounded(Arc::new(SqliteStore::in_memory().expect("a store")), BOUNDS).await;
    let (run_id, token) = assigned(&mut harness).await;
    let path = format!("/v1/executions/{run_id}/events");
    for n in 0..60 {
        let event = json!({"event_id": format!("{n}{}", "x".repeat(1024)), "type": "started"});
        let (status, answer) = harness.agent(reqwest::Method::POST, &path, &token, Some(event)).await;
        assert_eq!((status, answer["field"].as_str()), (400, Some("event_id")), "{answer}");
    }
    let huge = json!({"event_id": "x".repeat(1 << 20), "type": "started"});
    let (status, answer) = harness.agent(reqwest::Method::POST, &path, &token, Some(huge)).await;
    assert_eq!((status, answer["field"].as_str()), (413, Some("body")), "{answer}");
    let long = json!({"event_id": "f1", "type": "install_failed", "requeueable": false, "stage": "secrets",
                      "message": "m".repeat(20_000)});
    assert_eq!(harness.agent(reqwest::Method::POST, &path, &token, Some(long)).await.0, 200);
    let (_, events) = harness.api(reqwest::Method::GET, &format!("/v1/runs/{run_id}/events"), None).await;
    let events = events["events"].as_array().expect("events").clone();
    assert_eq!(events.len(), 1, "only the bounded event was stored");
    assert!(events[0]["event"]["message"].as_str().expect("a message").len() <= 4096);
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn a_declared_gap_is_recorded_and_a_mismatched_offset_is_answered_409_with_the_count() {
    let mut harness = bounded(Arc::new(SqliteStore::in_memory().expect("a store")), BOUNDS).await;
    let (run_id, token) = assigned(&mut harness).await;
    assert_eq!(
        post_log(&harness, &run_id, &token, &LogChunk::new(0, b"before\n")).await,
        (200, json!({"received": 7}))
    );
    let (status, answer) = post_log(&harness, &run_id, &token, &LogChunk::new(20, b"after\n")).await;
    assert_eq!((status, serde_json::from_value::<LogReceived>(answer).ok()), (409, Some(LogReceived { received: 7 })));
    let (status, answer) = post_log(&harness, &run_id, &token, &LogChunk::after_gap(20, 13, b"after\n")).await;
    assert_eq!((status, answer), (200, json!({"received": 26})));
    let (log, received) = read_log(&harness, &run_id, "").await;
    assert_eq!(received, 26);
    let expected = format!("before\n{}after\n", api_bounds::gap_marker(13));
    assert_eq!(String::from_utf8(log).expect("text"), expected);
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn past_the_log_cap_chunks_are_acknowledged_and_the_log_ends_with_the_marker() {
    let bounds = RunBounds { log_cap: 1000, ..BOUNDS };
    let mut harness = bounded(Arc::new(SqliteStore::in_memory().expect("a store")), bounds).await;
    let (run_id, token) = assigned(&mut harness).await;
    let chunk = [b'x'; 700];
    for n in 0..4u64 {
        let (status, answer) = post_log(&harness, &run_id, &token, &LogChunk::new(n * 700, &chunk)).await;
        assert_eq!((status, answer), (200, json!({"received": (n + 1) * 700})), "acknowledged past the cap");
    }
    let (log, received) = read_log(&harness, &run_id, "").await;
    assert_eq!(received, 2800);
    let expected = format!("{}{}", "x".repeat(1000), api_bounds::cap_marker(1800));
    assert_eq!(String::from_utf8(log).expect("text"), expected);
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn log_ranges_of_a_large_log_are_its_bytes() {
    let mut harness = bounded(Arc::new(SqliteStore::in_memory().expect("a store")), BOUNDS).await;
    let (run_id, token) = assigned(&mut harness).await;
    // 40 chunks of 64 KiB: more than a page of stored pieces.
    let stream: Vec<u8> = (0..40 * 65_536u32).map(|n| b'a' + (n % 26) as u8).collect();
    for (n, chunk) in stream.chunks(65_536).enumerate() {
        assert_eq!(post_log(&harness, &run_id, &token, &LogChunk::new(n as u64 * 65_536, chunk)).await.0, 200);
    }
    let (whole, received) = read_log(&harness, &run_id, "").await;
    assert_eq!(received, stream.len() as u64);
    assert!(whole == stream, "the whole log, streamed");
    for (offset, limit) in [(0, 1), (65_535, 2), (100_000, 1_000_000), (2_621_000, 1_000), (3_000_000, 10)] {
        let (part, _) = read_log(&harness, &run_id, &format!("?offset={offset}&limit={limit}")).await;
        let end = (offset + limit).min(stream.len());
        assert!(part == stream[offset.min(end)..end], "offset {offset} limit {limit}");
    }
    let (status, answer) = harness.api(reqwest::Method::GET, &format!("/v1/runs/{run_id}/log?offset=x"), None).await;
    assert_eq!((status, answer["field"].as_str()), (400, Some("offset")));
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn paging_returns_every_run_exactly_once() {
    let harness = bounded(Arc::new(SqliteStore::in_memory().expect("a store")), BOUNDS).await;
    harness.server.engine().ask::<()>(Input::Drain).await.expect("draining: runs stay queued");
    let mut submitted = Vec::new();
    for _ in 0..25 {
        let (_, created) = harness.api(reqwest::Method::POST, "/v1/runs", Some(json!({"command": ["true"]}))).await;
        submitted.push(created["id"].as_str().expect("an id").to_owned());
    }
    let mut seen = Vec::new();
    let mut path = "/v1/runs?limit=7".to_owned();
    loop {
        let (status, page) = harness.api(reqwest::Method::GET, &path, None).await;
        assert_eq!(status, 200, "{page}");
        let runs = page["runs"].as_array().expect("runs");
        assert!(runs.len() <= 7);
        seen.extend(runs.iter().map(|run| run["id"].as_str().expect("an id").to_owned()));
        match page["next_cursor"].as_str() {
            Some(cursor) => path = format!("/v1/runs?limit=7&cursor={cursor}"),
            None => break,
        }
    }
    // Runs submitted in one millisecond are ordered by id: compare as sets.
    let unique: std::collections::BTreeSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "no run twice: {seen:?}");
    assert_eq!(unique, submitted.iter().collect(), "every run");
    let (_, queued) = harness.api(reqwest::Method::GET, "/v1/runs?state=queued&limit=1000", None).await;
    assert_eq!(queued["runs"].as_array().map(Vec::len), Some(25));
    for (query, field) in
        [("limit=0", "limit"), ("limit=1001", "limit"), ("cursor=%21", "cursor"), ("state=x", "state")]
    {
        let (status, answer) = harness.api(reqwest::Method::GET, &format!("/v1/runs?{query}"), None).await;
        assert_eq!((status, answer["field"].as_str()), (400, Some(field)), "{query}");
    }
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn a_finished_run_leaves_memory_after_the_window_and_a_restart_does_not_load_it() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("standby.db");
    let key = SealKey::random();
    let open = |path: &Path| -> Arc<dyn Store> { Arc::new(SqliteStore::open(path, &key).expect("the store opens")) };
    let bounds = RunBounds { retention: Duration::from_millis(200), ..BOUNDS };
    let mut harness = bounded(open(&path), bounds).await;
    let (run_id, token) = assigned(&mut harness).await;
    let events = format!("/v1/executions/{run_id}/events");
    let event = json!({"event_id": "s", "type": "started"});
    assert_eq!(harness.agent(reqwest::Method::POST, &events, &token, Some(event)).await.0, 200);
    // The agent's last chunk comes before its terminal event, which retires the credential.
    assert_eq!(post_log(&harness, &run_id, &token, &LogChunk::new(0, b"done\n")).await.0, 200);
    let event = json!({"event_id": "x", "type": "exited", "code": 0});
    assert_eq!(harness.agent(reqwest::Method::POST, &events, &token, Some(event)).await.0, 200);
    let deadline = tokio::time::Instant::now() + WAIT;
    while metric(&harness, "standby_runs_in_memory").await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the finished run was never evicted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let run = harness.run(&run_id).await;
    assert_eq!((run["state"].as_str(), run["exit_code"].as_i64()), (Some("exited"), Some(0)), "served from the store");
    assert_eq!(read_log(&harness, &run_id, "").await.0, b"done\n");
    let (status, _) = harness.api(reqwest::Method::POST, &format!("/v1/runs/{run_id}/cancel"), None).await;
    assert_eq!(status, 409, "a finished run cannot be cancelled, in memory or not");
    harness.server.shutdown().await.expect("a clean shutdown");

    let harness = bounded(open(&path), RunBounds { retention: Duration::from_secs(600), ..BOUNDS }).await;
    assert_eq!(metric(&harness, "standby_runs_in_memory").await, 0, "a restart loads no finished run");
    assert_eq!(harness.run(&run_id).await["state"], "exited");
    let (_, listing) = harness.api(reqwest::Method::GET, "/v1/runs", None).await;
    assert_eq!(listing["runs"][0]["id"], run_id.as_str());
    harness.server.shutdown().await.expect("a clean shutdown");
}

#[tokio::test]
async fn upgrades_beyond_the_bound_in_flight_are_answered_429_with_retry_after() {
    // A bound of zero: every upgrade is over it, before its credential is
    // looked at.
    let mut harness = configured(|config| config.listener.max_pending_upgrades = 0).await;
    let (_, token) = harness.next_launch().await;
    let url = harness.url("/ws").replacen("http", "ws", 1);
    let mut request = url.into_client_request().expect("a request");
    request.headers_mut().insert("Authorization", format!("Bearer {}", token.expose()).parse().expect("a header"));
    request.headers_mut().insert("Standby-Protocol", "1".parse().expect("a header"));
    match tokio_tungstenite::connect_async(request).await {
        Err(tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 429);
            assert_eq!(response.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
        }
        Ok(_) => panic!("an upgrade over the bound was admitted"),
        Err(error) => panic!("the upgrade failed otherwise: {error}"),
    }
    let response = harness.http.get(harness.url("/metrics")).bearer_auth(KEY).send().await.expect("metrics");
    let metrics = response.text().await.expect("a body");
    assert!(metrics.contains("standby_ws_upgrades_refused_total 1"), "{metrics}");
    harness.server.shutdown().await.expect("a clean shutdown");
}
