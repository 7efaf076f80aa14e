//! The agent-facing half of the contract: the control socket, the spec,
//! and the per-execution calls made with the run credential.

use axum::Json;
use axum::body::Body;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade, rejection::WebSocketUpgradeRejection};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use standby_protocol::{
    AgentMessage, AttachmentsResponse, CloudCredentialsResponse, Event, EventKind, GitCredentialsResponse, LogChunk,
    LogReceived, Secret, SecretsResponse, Spec,
};
use tokio::sync::mpsc;

use crate::api_bounds::{EVENT_BODY_MAX, LOG_BODY_MAX, agent_socket, bound_event};
use crate::app::{ApiError, AppState, Unread, bearer, from_store, parse_json, read_body};
use crate::cluster::Role;
use crate::engine::{ConnWriter, EngineHandle, Outbound};
use crate::listener::ConnectionSlot;
use crate::model::{Holder, RunRequest, SandboxRecord};
use crate::rules::{Admission, AdmissionRefusal, Call, ConnId, Input, LogError};

fn check_protocol(headers: &HeaderMap) -> Result<(), ApiError> {
    match headers.get(standby_protocol::PROTOCOL_HEADER) {
        Some(value) if value.as_bytes() != standby_protocol::PROTOCOL_VERSION.as_bytes() => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!(
                "unsupported {} version; this server speaks {}",
                standby_protocol::PROTOCOL_HEADER,
                standby_protocol::PROTOCOL_VERSION
            ),
        )
        .with_field(standby_protocol::PROTOCOL_HEADER)),
        _ => Ok(()),
    }
}

fn refused(refusal: AdmissionRefusal) -> ApiError {
    match refusal {
        AdmissionRefusal::Gone => ApiError::new(refusal.status(), "the standby credential is unknown or retired"),
        AdmissionRefusal::Unauthorized => ApiError::new(refusal.status(), "the credential is revoked or not valid"),
        AdmissionRefusal::Ended => ApiError::new(
            refusal.status(),
            "the run is over: its run credential is withdrawn (after a cancel only the run's events and log are \
             accepted)",
        ),
        AdmissionRefusal::Duplicate { .. } => {
            ApiError::new(refusal.status(), "a live control connection already uses this credential")
        }
    }
}

/// The credential an agent's call presents, once its protocol header is
/// one this server speaks.
fn presented(headers: &HeaderMap) -> Result<&str, ApiError> {
    check_protocol(headers)?;
    bearer(headers).ok_or_else(|| {
        ApiError::new(AdmissionRefusal::Unauthorized.status(), "missing `Authorization: Bearer <credential>`")
    })
}

async fn admit(state: &AppState, headers: &HeaderMap, call: Call) -> Result<Admission, ApiError> {
    let token = Secret::new(presented(headers)?.to_owned());
    state.engine.ask::<Result<Admission, AdmissionRefusal>>(Input::Check { token, call }).await?.map_err(refused)
}

/// Admits only the run credential of execution `execution_id`. A standby
/// credential, even a retired one, is simply not a run credential here
/// (`401`, never the standby's `410`).
async fn admit_run(
    state: &AppState,
    headers: &HeaderMap,
    execution_id: &str,
    call: Call,
) -> Result<(String, u32), ApiError> {
    let wrong = || {
        ApiError::new(
            AdmissionRefusal::Unauthorized.status(),
            format!("the credential is not a run credential of `{execution_id}`"),
        )
    };
    let token = Secret::new(presented(headers)?.to_owned());
    match state.engine.ask(Input::Check { token, call }).await? {
        Ok(Admission::Run { run_id, attempt, .. }) if run_id == execution_id => Ok((run_id, attempt)),
        Ok(_) | Err(AdmissionRefusal::Gone) => Err(wrong()),
        Err(refusal) => Err(refused(refusal)),
    }
}

/// The answer to an upgrade whose socket claim was refused (here or, for
/// a follower's agent, by the leader over the link).
fn socket_refused(refusal: AdmissionRefusal) -> Response {
    match refusal {
        AdmissionRefusal::Duplicate { retry_after } => {
            // When the live socket counts as gone if it stays silent: an
            // agent whose old connection died unseen comes back then.
            let seconds = retry_after.as_millis().div_ceil(1000).to_string();
            ([(header::RETRY_AFTER, seconds)], refused(refusal)).into_response()
        }
        refusal => refused(refusal).into_response(),
    }
}

/// An admitted upgrade's claim on its credential's one socket: freed if
/// the upgrade never completes (the connection task frees it otherwise).
struct Claim {
    engine: EngineHandle,
    conn: ConnId,
    armed: bool,
}

impl Claim {
    /// The connection task owns the claim from here on.
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.armed
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let (engine, conn) = (self.engine.clone(), self.conn);
            runtime.spawn(async move { engine.disconnect(conn).await });
        }
    }
}

async fn request(state: &AppState, run_id: &str) -> Result<RunRequest, ApiError> {
    let id = run_id.to_owned();
    from_store(state, move |store| store.request(&id))
        .await?
        // Only a terminal run's request is gone (deleted with its terminal
        // state), and its credential is revoked by then: a late call.
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("run `{run_id}` has ended: what it was submitted with is deleted"),
            )
        })
}

// ---- the control socket ---------------------------------------------------------

pub(crate) async fn socket(
    State(state): State<AppState>,
    headers: HeaderMap,
    slot: Option<Extension<ConnectionSlot>>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    // Authenticating is a round trip to the engine: a flood of upgrade
    // requests with made-up credentials may not queue without bound.
    let Ok(_authenticating) = Arc::clone(&state.listener.upgrades).try_acquire_owned() else {
        state.listener.upgrades_refused.fetch_add(1, Ordering::Relaxed);
        let busy = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too many control-socket upgrades in flight");
        return (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, "1")], busy).into_response();
    };
    let token = match presented(&headers) {
        Ok(token) => Secret::new(token.to_owned()),
        Err(error) => return error.into_response(),
    };
    let upgrade = match upgrade {
        Ok(upgrade) => upgrade,
        Err(rejection) => return ApiError::new(StatusCode::BAD_REQUEST, rejection.body_text()).into_response(),
    };
    // A follower holds the socket and speaks for it over its link.
    if let (Some(cluster), Some(link)) = (&state.cluster, &state.link)
        && cluster.view.borrow().role == Role::Follower
    {
        return crate::link::follower::socket(Arc::clone(link), token, upgrade).await.unwrap_or_else(socket_refused);
    }
    let conn = state.engine.next_conn_id();
    let admission = match state.engine.ask(Input::ClaimSocket { conn, token: token.clone() }).await {
        Ok(Ok(admission)) => admission,
        Ok(Err(refusal)) => return socket_refused(refusal),
        Err(gone) => return ApiError::from(gone).into_response(),
    };
    let mut claim = Claim { engine: state.engine.clone(), conn, armed: true };
    agent_socket(upgrade).on_upgrade(move |socket| {
        claim.disarm();
        async move {
            // The socket keeps its connection's place under the cap.
            let _slot = slot;
            connection(state, socket, conn, admission, token).await;
        }
    })
}

/// One task per socket: it alone writes to it (frames the engine queued)
/// and reads from it (heartbeats for the engine).
async fn connection(state: AppState, mut socket: WebSocket, conn: ConnId, admission: Admission, presented: Secret) {
    let engine = state.engine.clone();
    let (sender, mut outbound) = mpsc::unbounded_channel();
    // In a replicated deployment, the leader holds this socket itself.
    let holder = state.cluster.as_ref().map(|cluster| {
        let view = cluster.view.borrow();
        Holder { replica: view.replica_id.clone(), epoch: view.epoch }
    });
    engine.connect(conn, ConnWriter::local(sender), (admission.credential_id(), presented), holder).await;
    tracing::debug!(conn, ?admission, "control connection open");
    // A peer that vanished without closing (a half-open TCP connection)
    // sends nothing more: past the idle timeout the socket is dropped.
    let idle = tokio::time::sleep(state.idle_timeout);
    tokio::pin!(idle);
    loop {
        tokio::select! {
            () = &mut idle => {
                tracing::info!(conn, "control connection silent past the idle timeout: closed");
                break;
            }
            incoming = socket.recv() => match incoming {
                None | Some(Err(_)) | Some(Ok(Message::Close(_))) => break,
                Some(Ok(Message::Text(text))) => {
                    idle.as_mut().reset(tokio::time::Instant::now() + state.idle_timeout);
                    match serde_json::from_str::<AgentMessage>(text.as_str()) {
                    Ok(AgentMessage::Heartbeat { state, .. }) => engine.tell(Input::Heartbeat { conn, state }).await,
                        Err(error) => {
                            tracing::debug!(conn, problem = %standby_protocol::describe_json_error(&error), "frame skipped");
                        }
                    }
                }
                // tungstenite answers pings; binary frames mean nothing here.
                Some(Ok(_)) => {}
            },
            command = outbound.recv() => match command {
                // The engine ended: the server stops, or a replica's lease
                // was lost. 1012 (service restart): reconnect, to the next
                // leader if need be.
                None => {
                    let frame = axum::extract::ws::CloseFrame {
                        code: axum::extract::ws::close_code::RESTART,
                        reason: "the server is restarting".into(),
                    };
                    let _ = socket.send(Message::Close(Some(frame))).await;
                    break;
                }
                Some(Outbound::Close) => {
                    let _ = socket.send(Message::Close(None)).await;
                    break;
                }
                Some(Outbound::Frame { text, assignment_of }) => {
                    if socket.send(Message::Text(text.into())).await.is_err() {
                        break;
                    }
                    if let Some(run_id) = assignment_of {
                        engine.tell(Input::AssignmentSent { run_id }).await;
                    }
                }
            },
        }
    }
    engine.disconnect(conn).await;
    tracing::debug!(conn, "control connection closed");
}

// ---- HTTP calls -------------------------------------------------------------------

/// `GET /v1/standby/spec`: the pool spec, with the workspace of the run a
/// cold sandbox was created for.
pub(crate) async fn spec(State(state): State<AppState>, headers: HeaderMap) -> Result<Json<Spec>, ApiError> {
    let admission = admit(&state, &headers, Call::Fetch).await?;
    let Admission::Standby { sandbox_id, .. } = admission else {
        return Err(ApiError::new(AdmissionRefusal::Unauthorized.status(), "the spec is for standby credentials"));
    };
    let sandbox = state
        .engine
        .ask::<Option<SandboxRecord>>(Input::Sandbox { sandbox_id: sandbox_id.clone() })
        .await?
        .ok_or_else(|| ApiError::new(AdmissionRefusal::Gone.status(), "the sandbox is gone"))?;
    let mut spec = (*state.spec).clone();
    if let Some(workspace) = sandbox.workspace {
        spec.workspace = workspace;
    }
    // The credential was checked: a run bound to the sandbox may be told now.
    state.engine.tell(Input::SpecServed { sandbox_id }).await;
    Ok(Json(spec))
}

pub(crate) async fn secrets(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<SecretsResponse>, ApiError> {
    let (run_id, _) = admit_run(&state, &headers, &id, Call::Fetch).await?;
    Ok(Json(SecretsResponse { secrets: request(&state, &run_id).await?.secrets }))
}

pub(crate) async fn attachments(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<AttachmentsResponse>, ApiError> {
    let (run_id, _) = admit_run(&state, &headers, &id, Call::Fetch).await?;
    let attachments = request(&state, &run_id).await?.attachments.iter().map(|stored| stored.listed(&run_id)).collect();
    Ok(Json(AttachmentsResponse { attachments }))
}

pub(crate) async fn attachment(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((id, name)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let (run_id, _) = admit_run(&state, &headers, &id, Call::Fetch).await?;
    let stored = request(&state, &run_id)
        .await?
        .attachments
        .into_iter()
        .find(|attachment| attachment.name == name)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no attachment `{name}`")))?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(&stored.content_base64).map_err(|_| {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("attachment `{name}` is corrupt in the store"))
    })?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
}

pub(crate) async fn git_credentials(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<GitCredentialsResponse>, ApiError> {
    let (run_id, _) = admit_run(&state, &headers, &id, Call::Fetch).await?;
    Ok(Json(GitCredentialsResponse { credentials: request(&state, &run_id).await?.git_credentials }))
}

pub(crate) async fn metadata(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let (run_id, _) = admit_run(&state, &headers, &id, Call::Fetch).await?;
    Ok(Json(request(&state, &run_id).await?.metadata))
}

pub(crate) async fn cloud_credentials(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<CloudCredentialsResponse>, ApiError> {
    let (run_id, _) = admit_run(&state, &headers, &id, Call::Fetch).await?;
    Ok(Json(CloudCredentialsResponse { env: request(&state, &run_id).await?.cloud_env }))
}

/// The field to blame in an event body that did not parse, when serde could
/// not say: an event is an internally tagged enum, which serde buffers
/// before it reads the fields, so its type errors carry no path.
fn event_field(value: &serde_json::Value) -> Option<&'static str> {
    let is_text = |name: &str| value.get(name).is_some_and(serde_json::Value::is_string);
    if !is_text("event_id") {
        return Some("event_id");
    }
    match value.get("type").and_then(serde_json::Value::as_str) {
        None => Some("type"),
        Some("exited") => {
            let code = value.get("code").and_then(serde_json::Value::as_i64);
            code.is_none_or(|code| i32::try_from(code).is_err()).then_some("code")
        }
        Some("install_failed") => {
            let flag = value.get("requeueable").is_some_and(serde_json::Value::is_boolean);
            (!flag).then_some("requeueable").or_else(|| ["stage", "message"].into_iter().find(|name| !is_text(name)))
        }
        Some(_) => None,
    }
}

/// The body of an admitted call, of at most `limit` bytes: over it `413`,
/// not whole within the body timeout `408` (field `body`).
async fn body(body: Body, limit: usize) -> Result<axum::body::Bytes, ApiError> {
    read_body(body, limit).await.map_err(|unread| {
        let message = match unread {
            Unread::TooLarge(_) => {
                format!("{unread} (see docs/operations.md, \"Per-run bounds\")")
            }
            Unread::TimedOut | Unread::Broken => unread.to_string(),
        };
        ApiError::new(unread.status(), message).with_field("body")
    })
}

/// `POST /v1/executions/{id}/events`: acknowledged once stored; a repeat of
/// an `event_id` is acknowledged and ignored; a type this server does not
/// know is acknowledged (`202`) and dropped. An `event_id` or `stage` over
/// its bound is refused (`400`, naming it); a long `install_failed`
/// message is cut.
pub(crate) async fn events(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Body,
) -> Result<Response, ApiError> {
    let (run_id, attempt) = admit_run(&state, &headers, &id, Call::Report).await?;
    let body = body(raw, EVENT_BODY_MAX).await?;
    let event: Event = match parse_json(&body) {
        Ok(event) => event,
        Err(error) => {
            let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let unknown = value.get("type").and_then(|t| t.as_str()).is_some_and(|t| !EventKind::NAMES.contains(&t));
            if unknown && value.get("event_id").is_some_and(serde_json::Value::is_string) {
                tracing::info!(run_id, "event of an unknown type acknowledged and dropped");
                return Ok((StatusCode::ACCEPTED, Json(serde_json::json!({}))).into_response());
            }
            if error.field().is_none()
                && let Some(field) = event_field(&value)
            {
                return Err(ApiError::new(StatusCode::BAD_REQUEST, format!("{field}: missing or of the wrong type"))
                    .with_field(field));
            }
            return Err(error);
        }
    };
    let event = bound_event(event)?;
    tracing::info!(run_id, attempt, event_id = %event.event_id, kind = ?event.kind, "event");
    state.engine.ask::<()>(Input::Event { run_id, attempt, event }).await?;
    Ok(Json(serde_json::json!({})).into_response())
}

/// `POST /v1/executions/{id}/log`: `200 {"received": n}`; `409
/// {"received": n}` when the chunk does not follow what the server holds
/// (amendment 6: a chunk after exactly the gap it declares in `dropped`
/// is accepted and the gap recorded). The rule is
/// [`standby_protocol::log_chunk::accept`].
pub(crate) async fn log(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    raw: Body,
) -> Result<Response, ApiError> {
    let (run_id, _) = admit_run(&state, &headers, &id, Call::Report).await?;
    let chunk: LogChunk = parse_json(&body(raw, LOG_BODY_MAX).await?)?;
    let data = chunk
        .bytes()
        .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "data: not valid base64").with_field("data"))?;
    let input = Input::Log { run_id, offset: chunk.offset, dropped: chunk.dropped, data };
    match state.engine.ask(input).await? {
        Ok(received) => Ok(Json(LogReceived { received }).into_response()),
        Err(error @ LogError::Conflict { received, .. }) => {
            let body = serde_json::json!({ "received": received, "error": error.to_string(), "field": "offset" });
            Ok((StatusCode::CONFLICT, Json(body)).into_response())
        }
        Err(error @ LogError::OutOfRange { field }) => {
            Err(ApiError::new(StatusCode::BAD_REQUEST, error.to_string()).with_field(field))
        }
    }
}
