//! The test server on its own, driven by a plain WebSocket and HTTP client:
//! proves that it answers by the protocol's rules, records what it is sent
//! and injects the faults that the end-to-end tests rely on, without the
//! agent.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use standby_e2e::TestServer;
use standby_e2e::server::{
    CloseCause, CredentialKind, Endpoint, ExecutionSetup, Failure, Frame, Revocation, STANDBY_PREFIX, ScriptedUpgrade,
    ServerError,
};
use standby_protocol::{
    AgentMessage, AgentState, Assignment, Cancel, Cause, Event, EventKind, LogChunk, PROTOCOL_HEADER, PROTOCOL_VERSION,
    SPEC_PATH, ServerMessage, Spec, Stage, paths,
};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream, connect_async};

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

const WAIT: Duration = Duration::from_secs(10);

/// Upgrade with `credential` (and the protocol header unless `protocol` is
/// false); the status of a refused upgrade.
async fn connect_with(server: &TestServer, credential: Option<&str>, protocol: bool) -> Result<Ws, u16> {
    let mut request = server.ws_url().into_client_request().expect("a valid ws URL");
    if let Some(credential) = credential {
        request
            .headers_mut()
            .insert("Authorization", format!("Bearer {credential}").parse().expect("a valid header value"));
    }
    if protocol {
        request.headers_mut().insert(PROTOCOL_HEADER, HeaderValue::from_static(PROTOCOL_VERSION));
    }
    match connect_async(request).await {
        Ok((ws, response)) => {
            assert_eq!(response.status().as_u16(), 101);
            Ok(ws)
        }
        Err(tungstenite::Error::Http(response)) => Err(response.status().as_u16()),
        Err(error) => panic!("upgrade failed below HTTP: {error}"),
    }
}

async fn connect(server: &TestServer, credential: &str) -> Result<Ws, u16> {
    connect_with(server, Some(credential), true).await
}

/// The next text frame as a server message, skipping pings.
async fn next_message(ws: &mut Ws) -> ServerMessage {
    loop {
        match next_frame(ws).await {
            Message::Text(text) => return ServerMessage::decode(text.as_str()).expect("the server sends messages"),
            Message::Ping(_) | Message::Pong(_) => {}
            other => panic!("expected a text frame, got {other:?}"),
        }
    }
}

async fn next_assignment(ws: &mut Ws) -> Assignment {
    match next_message(ws).await {
        ServerMessage::Assignment(assignment) => *assignment,
        other => panic!("expected an assignment, got {other:?}"),
    }
}

async fn next_frame(ws: &mut Ws) -> Message {
    tokio::time::timeout(WAIT, ws.next())
        .await
        .expect("a frame within the timeout")
        .expect("the stream is open")
        .expect("a valid frame")
}

fn http() -> reqwest::Client {
    // reqwest is built without a default TLS provider; these tests speak
    // plain HTTP but the client still wants one installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

async fn call(
    server: &TestServer,
    method: reqwest::Method,
    path: &str,
    credential: &str,
    body: Option<Value>,
) -> (u16, Vec<u8>) {
    let mut request = http()
        .request(method, format!("{}{path}", server.url()))
        .bearer_auth(credential)
        .header(PROTOCOL_HEADER, PROTOCOL_VERSION);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    (status, response.bytes().await.expect("a body").to_vec())
}

async fn get_json(server: &TestServer, path: &str, credential: &str) -> (u16, Value) {
    let (status, body) = call(server, reqwest::Method::GET, path, credential, None).await;
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

async fn post_event(server: &TestServer, execution_id: &str, credential: &str, kind: EventKind) -> u16 {
    let body = json!(Event::new(format!("e-{}", kind.name()), kind));
    call(server, reqwest::Method::POST, &paths::events(execution_id), credential, Some(body)).await.0
}

/// A standby with a live connection that has received its assignment.
async fn assigned(server: &TestServer, setup: ExecutionSetup) -> (String, String, String, Ws) {
    let token = server.add_standby();
    let mut ws = connect(server, &token).await.expect("standby connects");
    let execution_id = server.assign(&token, setup);
    let assignment = next_assignment(&mut ws).await;
    let credential = server.run_credential(&execution_id).expect("a run credential");
    assert_eq!(assignment.run_credential.expose(), credential);
    (token, execution_id, credential, ws)
}

#[tokio::test]
async fn upgrade_answers_follow_the_credential_rules() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    let never_issued = format!("{STANDBY_PREFIX}never_issued");
    assert_eq!(connect(&server, &never_issued).await.err(), Some(410), "unknown standby credential");
    assert_eq!(connect(&server, "garbage").await.err(), Some(401), "wrong credential");
    assert_eq!(connect_with(&server, Some(&token), false).await.err(), Some(400), "no protocol header");
    assert_eq!(connect_with(&server, None, true).await.err(), Some(400), "no credential");
    let ws = connect(&server, &token).await.expect("known standby credential");
    drop(ws);

    let retired = server.add_standby();
    server.retire(&retired, Some("pool shrunk")).expect("an idle standby retires");
    assert_eq!(connect(&server, &retired).await.err(), Some(410), "retired standby credential");
    let expired = server.add_standby();
    server.expire(&expired).expect("an idle standby expires");
    assert_eq!(connect(&server, &expired).await.err(), Some(410), "expired standby credential");

    let statuses: Vec<(Option<CredentialKind>, u16)> =
        server.upgrades().iter().map(|upgrade| (upgrade.credential, upgrade.status)).collect();
    assert_eq!(
        statuses,
        [
            (None, 410),
            (None, 401),
            (Some(CredentialKind::Standby), 400),
            (None, 400),
            (Some(CredentialKind::Standby), 101),
            (Some(CredentialKind::Standby), 410),
            (Some(CredentialKind::Standby), 410),
        ]
    );
}

#[tokio::test]
async fn heartbeats_are_recorded_and_anything_else_is_a_violation() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    let mut ws = connect(&server, &token).await.expect("connects");
    let heartbeat = AgentMessage::Heartbeat { state: AgentState::Ready, execution_id: None };
    ws.send(Message::text(heartbeat.encode())).await.expect("send a heartbeat");
    let heartbeat = server.wait_for_heartbeat(|_| true).await;
    assert_eq!(heartbeat.credential, CredentialKind::Standby);
    assert_eq!(heartbeat.execution_id, None);
    assert_eq!(server.connections()[0].id, heartbeat.connection);

    ws.send(Message::text("not json")).await.expect("send junk");
    ws.send(Message::binary(vec![1, 2, 3])).await.expect("send binary");
    server.wait_until("two violations", |records| (records.violations.len() == 2).then_some(())).await;
    ws.close(None).await.expect("close");
    let closed = server.wait_for_close(heartbeat.connection).await;
    assert_eq!(closed.close, Some(CloseCause::ClientClose(None)));
}

#[tokio::test]
async fn assignment_is_sent_live_and_replayed_until_the_run_credential_connects() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    let mut first = connect(&server, &token).await.expect("standby connects");
    let execution_id = server.assign(&token, ExecutionSetup::new(&["true"]).env("TASK_ID", "t1"));
    let credential = server.run_credential(&execution_id).expect("a run credential");

    let live = next_assignment(&mut first).await;
    assert_eq!(live.execution_id, execution_id);
    assert_eq!(live.run_credential.expose(), credential);
    assert_eq!(live.run.command, ["true"]);
    assert_eq!(live.run.env["TASK_ID"], "t1");

    drop(first);
    let mut second = connect(&server, &token).await.expect("the standby credential still connects");
    assert_eq!(next_assignment(&mut second).await, live, "replayed on a later standby connection");

    let mut run = connect(&server, &credential).await.expect("the run credential connects");
    assert_eq!(next_assignment(&mut run).await, live, "replayed on the run-credential connection");
    assert!(server.execution(&execution_id).expect("recorded").confirmed_at.is_some());
    assert_eq!(connect(&server, &token).await.err(), Some(401), "the standby credential is revoked");

    drop(run);
    let mut again = connect(&server, &credential).await.expect("the run credential reconnects");
    assert_eq!(next_assignment(&mut again).await, live, "replayed on every run-credential connection");
    drop(second);
}

#[tokio::test]
async fn cancel_revokes_the_run_credential_then_tells_the_sandbox() {
    let server = TestServer::start().await;
    let (_, execution_id, credential, _standby) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    let mut run = connect(&server, &credential).await.expect("run connects");
    next_assignment(&mut run).await;

    server.cancel(&execution_id).expect("cancel a live execution");
    let cancel = ServerMessage::Cancel(Cancel { execution_id: execution_id.clone() });
    assert_eq!(next_message(&mut run).await, cancel);
    assert_eq!(connect(&server, &credential).await.err(), Some(410), "a cancelled run's credential is gone");
    assert_eq!(server.cancel(&execution_id), Err(ServerError::AlreadyRevoked(execution_id.clone())));
    let (status, _) = get_json(&server, &paths::secrets(&execution_id), &credential).await;
    assert_eq!(status, 410, "a cancelled run's credential fetches nothing");
    assert_eq!(post_event(&server, &execution_id, &credential, EventKind::Cancelled).await, 202, "but still reports");

    server.set_revoked_run_status(401);
    assert_eq!(connect(&server, &credential).await.err(), Some(401), "the answer the test set");
    assert_eq!(get_json(&server, &paths::secrets(&execution_id), &credential).await.0, 401);
}

#[tokio::test]
async fn a_cancelled_run_credential_never_confirms_delivery() {
    let server = TestServer::start().await;
    let (token, execution_id, credential, mut standby) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    server.cancel(&execution_id).expect("cancel before delivery");
    assert!(matches!(next_message(&mut standby).await, ServerMessage::Cancel(_)));
    assert_eq!(connect(&server, &credential).await.err(), Some(410));
    let record = server.execution(&execution_id).expect("recorded");
    assert!(record.confirmed_at.is_none());
    let mut later = connect(&server, &token).await.expect("the standby credential was never revoked");
    let id = server.wait_for_connections(2).await[1].id;
    server.send(id, Frame::Text(r#"{"type":"probe"}"#.into())).expect("send");
    let probe = ServerMessage::Unknown { type_name: "probe".into() };
    assert_eq!(next_message(&mut later).await, probe, "no replay of a cancelled assignment");
}

#[tokio::test]
async fn illegal_transitions_are_refused() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    let execution_id = server.assign(&token, ExecutionSetup::new(&["true"]).execution_id("exe_1"));
    assert_eq!(
        server.try_assign(&token, ExecutionSetup::new(&["true"])),
        Err(ServerError::AlreadyAssigned { token: token.clone(), execution_id: execution_id.clone() }),
        "at most one assignment per sandbox"
    );
    let other = server.add_standby();
    assert_eq!(
        server.try_assign(&other, ExecutionSetup::new(&["true"]).execution_id("exe_1")),
        Err(ServerError::DuplicateExecution("exe_1".into())),
        "one sandbox per execution"
    );
    assert!(matches!(server.retire(&token, None), Err(ServerError::AlreadyAssigned { .. })));
    server.retire(&other, None).expect("an idle standby retires");
    assert!(matches!(
        server.try_assign(&other, ExecutionSetup::new(&["true"])),
        Err(ServerError::StandbyNotActive { .. })
    ));
    assert!(matches!(
        server.try_assign(&format!("{STANDBY_PREFIX}nobody"), ExecutionSetup::new(&["true"])),
        Err(ServerError::UnknownStandby(_))
    ));
    assert!(matches!(server.cancel("exe_nothing"), Err(ServerError::UnknownExecution(_))));
}

#[tokio::test]
async fn execution_endpoints_require_that_executions_current_run_credential() {
    let server = TestServer::start().await;
    let setup = ExecutionSetup::new(&["true"]).secret("API_KEY", "s3cret");
    let (token, execution_id, credential, _ws) = assigned(&server, setup).await;
    let (_, other_execution, other_credential, _other) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    let secrets = paths::secrets(&execution_id);

    assert_eq!(get_json(&server, &secrets, &credential).await.0, 200);
    assert_eq!(get_json(&server, &secrets, &token).await.0, 401, "standby credential");
    assert_eq!(get_json(&server, &secrets, &other_credential).await.0, 401, "another execution's credential");
    assert_eq!(get_json(&server, &secrets, "garbage").await.0, 401, "wrong credential");
    let bare = http().get(format!("{}{secrets}", server.url())).bearer_auth(&credential).send().await.expect("answer");
    assert_eq!(bare.status().as_u16(), 400, "no protocol header");

    server.revoke_run(&other_execution, Revocation::Requeued).expect("revoke");
    let other_secrets = paths::secrets(&other_execution);
    assert_eq!(get_json(&server, &other_secrets, &other_credential).await.0, 401, "revoked credential");
    let report = post_event(&server, &other_execution, &other_credential, EventKind::Cancelled).await;
    assert_eq!(report, 401, "a requeued run's credential no longer reports either");
    let nothing = format!("/v1/executions/{execution_id}/nothing"); // not a call of the contract
    let (status, _) = call(&server, reqwest::Method::GET, &nothing, &credential, None).await;
    assert_eq!(status, 404);
    assert_eq!(server.violations().len(), 1, "a call outside the contract is a violation");
}

#[tokio::test]
async fn execution_data_is_served() {
    let server = TestServer::start().await;
    let setup = ExecutionSetup::new(&["true"])
        .secret("API_KEY", "s3cret")
        .attachment("spec.md", b"# the spec\n")
        .git_credential("https", "git.example", "bot", "hunter2")
        .metadata(json!({"team": "core"}))
        .cloud_env("AWS_SESSION_TOKEN", "tok");
    let (_, id, credential, _ws) = assigned(&server, setup).await;

    let (_, secrets) = get_json(&server, &paths::secrets(&id), &credential).await;
    assert_eq!(secrets, json!({"secrets": {"API_KEY": "s3cret"}}));
    let (_, list) = get_json(&server, &paths::attachments(&id), &credential).await;
    let attachment = &list["attachments"][0];
    assert_eq!(attachment["name"], "spec.md");
    let url = attachment["url"].as_str().expect("a url");
    assert_eq!(url, paths::attachment(&id, "spec.md"));
    let (status, content) = call(&server, reqwest::Method::GET, url, &credential, None).await;
    assert_eq!((status, content.as_slice()), (200, b"# the spec\n".as_slice()));
    let sha: String = Sha256::digest(&content).iter().map(|byte| format!("{byte:02x}")).collect();
    assert_eq!(attachment["sha256"], sha.as_str());
    let (status, git) = call(&server, reqwest::Method::POST, &paths::git_credentials(&id), &credential, None).await;
    assert_eq!(status, 200);
    let git: Value = serde_json::from_slice(&git).expect("JSON");
    assert_eq!(git["credentials"][0]["password"], "hunter2");
    assert_eq!(get_json(&server, &paths::metadata(&id), &credential).await.1, json!({"team": "core"}));
    let (_, cloud) = call(&server, reqwest::Method::POST, &paths::cloud_credentials(&id), &credential, None).await;
    assert_eq!(serde_json::from_slice::<Value>(&cloud).expect("JSON"), json!({"env": {"AWS_SESSION_TOKEN": "tok"}}));
    assert!(server.http_calls().iter().all(|call| call.credential == Some(CredentialKind::Run)));
}

#[tokio::test]
async fn log_chunks_are_placed_by_offset() {
    let server = TestServer::start().await;
    let (_, id, credential, _ws) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    let path = paths::log(&id);
    let chunk = |offset: u64, data: &[u8]| Some(json!(LogChunk::new(offset, data)));
    let post = |body| call(&server, reqwest::Method::POST, &path, &credential, body);
    assert_eq!(post(chunk(0, b"abc")).await.0, 200);
    assert_eq!(post(chunk(0, b"abc")).await.0, 200, "a retried chunk is acknowledged");
    assert_eq!(post(chunk(3, b"def")).await.0, 200);
    assert_eq!(post(chunk(10, b"xyz")).await.0, 409, "a gap is refused");
    assert_eq!(server.violations().len(), 1, "an undeclared gap is a violation");
    // By the ledger a chunk within received bytes is a retry, acknowledged;
    // that its bytes differ from those held is the agent's violation.
    assert_eq!(post(chunk(4, b"zz")).await.0, 200, "a chunk within received bytes is a duplicate");
    assert_eq!(server.violations().len(), 2, "a chunk rewriting received bytes is a violation");
    let record = server.execution(&id).expect("recorded");
    assert_eq!(record.log, b"abcdef");
    assert_eq!(record.log_posts, 4);
}

#[tokio::test]
async fn events_are_deduplicated_by_event_id() {
    let server = TestServer::start().await;
    let (_, id, credential, _ws) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    let mut run = connect(&server, &credential).await.expect("confirm delivery");
    next_assignment(&mut run).await;
    let path = paths::events(&id);
    let post = |body: Value| call(&server, reqwest::Method::POST, &path, &credential, Some(body));
    let event = |event_id: &str, kind| json!(Event::new(event_id, kind));
    assert_eq!(post(event("a", EventKind::Started)).await.0, 202);
    assert_eq!(post(event("a", EventKind::Started)).await.0, 202);
    assert_eq!(post(event("b", EventKind::Exited { code: 3 })).await.0, 202);
    assert_eq!(post(json!({"event_id": "c"})).await.0, 400);
    let record = server.execution(&id).expect("recorded");
    assert_eq!(record.events.len(), 2);
    assert_eq!(record.event_posts, 3);
    let exited = server.wait_for_event(&id, |kind| matches!(kind, EventKind::Exited { .. })).await;
    assert_eq!(exited.event_id, "b");
    assert_eq!(server.violations().len(), 1, "only the malformed event");
}

#[tokio::test]
async fn started_before_delivery_confirmation_is_a_violation() {
    let server = TestServer::start().await;
    let (_, id, credential, _ws) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    assert_eq!(post_event(&server, &id, &credential, EventKind::Started).await, 202);
    let violations = server.violations();
    assert!(violations[0].contains("before its delivery was confirmed"), "{violations:?}");
}

#[tokio::test]
async fn events_out_of_the_contracts_order_are_violations() {
    let server = TestServer::start().await;
    let (_, id, credential, _ws) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    let mut run = connect(&server, &credential).await.expect("confirm delivery");
    next_assignment(&mut run).await;
    assert_eq!(post_event(&server, &id, &credential, EventKind::Exited { code: 0 }).await, 202);
    assert_eq!(post_event(&server, &id, &credential, EventKind::Started).await, 202);
    let violations = server.violations();
    assert_eq!(violations.len(), 2, "{violations:?}");
    assert!(violations[0].contains("before `started`") && violations[1].contains("after"), "{violations:?}");
    assert_eq!(server.events(&id).len(), 2, "both are recorded");
}

#[tokio::test]
async fn install_failures_are_exposed() {
    let server = TestServer::start().await;
    let (_, id, credential, _ws) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    let failed = EventKind::install_failed(Stage::Secrets, Cause::Network, "503");
    post_event(&server, &id, &credential, failed).await;
    let failures = server.install_failures(&id);
    assert_eq!(failures.len(), 1);
    assert!(failures[0].requeueable);
    assert_eq!(failures[0].stage, Stage::Secrets.name());
}

#[tokio::test]
async fn scripted_upgrade_answers_come_first() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    server.script_upgrade(ScriptedUpgrade::status(503).retry_after(7));
    server.script_upgrade(ScriptedUpgrade::status(429).for_credential(CredentialKind::Run));

    let mut request = server.ws_url().into_client_request().expect("a valid URL");
    request.headers_mut().insert("Authorization", format!("Bearer {token}").parse().expect("header"));
    request.headers_mut().insert(PROTOCOL_HEADER, HeaderValue::from_static(PROTOCOL_VERSION));
    match connect_async(request).await {
        Err(tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 503);
            assert_eq!(response.headers()["retry-after"], "7");
        }
        other => panic!("expected a scripted 503, got {:?}", other.map(|_| ())),
    }
    assert!(connect(&server, &token).await.is_ok(), "the run-only script is not consumed by a standby");
    let upgrades = server.upgrades();
    assert!(upgrades[0].scripted && !upgrades[1].scripted);
}

#[tokio::test]
async fn scripted_endpoint_failures_then_recovery() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    server.set_spec(&Spec::default());
    server.fail(Endpoint::Spec, Failure::times(503, 2).retry_after(1));
    assert_eq!(get_json(&server, SPEC_PATH, &token).await.0, 503);
    assert_eq!(get_json(&server, SPEC_PATH, &token).await.0, 503);
    assert_eq!(get_json(&server, SPEC_PATH, &token).await, (200, json!(Spec::default())));

    let (_, id, credential, _ws) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    server.fail(Endpoint::Metadata, Failure::always(500));
    for _ in 0..3 {
        assert_eq!(get_json(&server, &paths::metadata(&id), &credential).await.0, 500);
    }
    assert_eq!(get_json(&server, &paths::metadata(&id), "garbage").await.0, 401, "auth first");
    server.clear_failures();
    assert_eq!(get_json(&server, &paths::metadata(&id), &credential).await.0, 200);
}

#[tokio::test]
async fn spec_endpoint_needs_an_active_standby_credential() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    assert_eq!(get_json(&server, SPEC_PATH, &token).await.0, 404, "no spec configured");
    server.set_spec(&Spec::default());
    assert_eq!(get_json(&server, SPEC_PATH, &token).await.0, 200);
    assert_eq!(get_json(&server, SPEC_PATH, &format!("{STANDBY_PREFIX}gone")).await.0, 410);
    assert_eq!(get_json(&server, SPEC_PATH, "garbage").await.0, 401);
    let (_, _, credential, _ws) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    assert_eq!(get_json(&server, SPEC_PATH, &credential).await.0, 401, "a run credential");
}

#[tokio::test]
async fn latency_makes_concurrent_calls_overlap() {
    let server = TestServer::start().await;
    let (_, id, credential, _ws) = assigned(&server, ExecutionSetup::new(&["true"])).await;
    server.set_latency(Duration::from_millis(300));
    let secrets = paths::secrets(&id);
    let metadata = paths::metadata(&id);
    let (a, b) = tokio::join!(get_json(&server, &secrets, &credential), get_json(&server, &metadata, &credential));
    assert_eq!((a.0, b.0), (200, 200));
    assert_eq!(server.max_concurrency(|call| call.endpoint.is_install()), 2);
    get_json(&server, &secrets, &credential).await;
    assert_eq!(server.max_concurrency(|call| call.endpoint == Endpoint::Secrets), 1);
}

#[tokio::test]
async fn frames_of_every_kind_reach_a_live_connection() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    let mut ws = connect(&server, &token).await.expect("connects");
    let id = server.wait_for_connection(|_| true).await.id;

    server.send(id, Frame::Binary(vec![0, 159, 146, 150])).expect("send");
    assert_eq!(next_frame(&mut ws).await, Message::binary(vec![0, 159, 146, 150]));
    server.send(id, Frame::Ping(b"p".to_vec())).expect("send");
    assert_eq!(next_frame(&mut ws).await, Message::Ping(b"p".to_vec().into()));
    server.send_text(id, "{not json").expect("send");
    assert_eq!(next_frame(&mut ws).await, Message::text("{not json"));
    server.ping_every(id, Some(Duration::from_millis(20))).expect("ping");
    for _ in 0..3 {
        assert!(matches!(next_frame(&mut ws).await, Message::Ping(_)));
    }
    server.wait_until("pongs", |records| (records.connections[0].pongs >= 2).then_some(())).await;
    server.ping_every(id, None).expect("stop pinging");
    server.send(id, Frame::Close(Some((4000, "bye".into())))).expect("send");
    loop {
        if let Message::Close(frame) = next_frame(&mut ws).await {
            assert_eq!(frame.map(|frame| u16::from(frame.code)), Some(4000));
            break;
        }
    }
    // Reading on lets the client's close reply go out.
    assert!(tokio::time::timeout(WAIT, ws.next()).await.expect("the stream ends").is_none());
    assert_eq!(server.wait_for_close(id).await.close, Some(CloseCause::ServerClose));
}

#[tokio::test]
async fn a_dropped_connection_ends_without_a_close_frame() {
    let server = TestServer::start().await;
    let token = server.add_standby();
    let mut ws = connect(&server, &token).await.expect("connects");
    let id = server.wait_for_connection(|_| true).await.id;
    server.drop_connection(id).expect("drop");
    let end = tokio::time::timeout(WAIT, ws.next()).await.expect("the stream ends");
    assert!(!matches!(end, Some(Ok(Message::Close(_)))), "no close frame on a dropped connection, got {end:?}");
    assert_eq!(server.wait_for_close(id).await.close, Some(CloseCause::ServerDrop));
    assert_eq!(server.send_text(id, "x"), Err(ServerError::NoSuchConnection(id)));
}

#[tokio::test]
async fn server_wide_pings_reach_new_connections() {
    let server = TestServer::start().await;
    server.set_ping_interval(Some(Duration::from_millis(20)));
    let token = server.add_standby();
    let mut ws = connect(&server, &token).await.expect("connects");
    assert!(matches!(next_frame(&mut ws).await, Message::Ping(_)));
}

#[tokio::test]
#[should_panic(expected = "timed out after 200ms waiting for a matching heartbeat")]
async fn a_wait_that_times_out_says_what_it_saw() {
    let server = TestServer::start().await;
    server.set_wait_timeout(Duration::from_millis(200));
    server.wait_for_heartbeat(|_| true).await;
}
