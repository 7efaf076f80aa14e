//! The MCP bridge: every stdio server served over MCP streamable HTTP on
//! one loopback listener, at `http://127.0.0.1:<port>/mcp/<name>`.
//!
//! The listener is bound once, when the servers are first started, so a
//! server's URL never changes: a restart replaces the process behind it,
//! not the endpoint. Sessions belong to the bridge, not to a process: the
//! bridge makes the `initialize` handshake with each process itself and
//! answers a client's `initialize` with the server's own result, so a
//! client's session outlives restarts. While a server restarts, requests
//! wait for it (see [`Backend::connection`]); requests in flight when its
//! process goes away fail with a JSON-RPC error, never silently.
//!
//! rmcp has a streamable-HTTP server, but it serves a typed
//! `ServerHandler`, i.e. it terminates the protocol: a proxy built on it
//! would re-encode every message through rmcp's model, which is not
//! lossless (see [`super::connection`]). The HTTP side is therefore this
//! module's, kept to what the transport requires: `POST` answers a request
//! with `application/json`, and accepts notifications and answers with
//! `202`; `GET` opens the session's stream for what the server says on its
//! own (notifications, progress, requests); `DELETE` ends a session.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::Value;
use standby_protocol::McpClientCapability;
use tokio::sync::mpsc::OwnedPermit;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::connection::{BRIDGE_ERROR, Connection, MAX_MESSAGE_BYTES, MAX_SERVER_REQUESTS, Message, error_answer};
use super::routing::{self, Candidate};

/// Sessions kept per server; the least recently used goes first.
const MAX_SESSIONS: usize = 64;
/// Messages queued for one session's stream, beyond the room kept for the
/// cancellations of the server requests it holds; more are refused.
const STREAM_QUEUE: usize = 64 + MAX_SERVER_REQUESTS;
/// How long closing waits for open HTTP connections to finish.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
const SESSION_HEADER: &str = "mcp-session-id";

/// What stands behind a server's endpoint.
#[derive(Clone)]
enum Serving {
    /// Being started or restarted: requests wait.
    Starting,
    Up(Arc<Connection>),
    /// Requests fail at once, with this reason.
    Down(String),
}

struct Session {
    last_used: Instant,
    /// What its client declared it serves (sampling, roots, elicitation).
    declared: Vec<McpClientCapability>,
    /// The queue of its event stream. Until the client opens the stream,
    /// its receiving end waits in `parked`, so that a server's request for
    /// a client that has not opened it yet (it does so right after
    /// `initialize`, while already calling tools) waits for it.
    outbox: mpsc::Sender<Value>,
    parked: Option<mpsc::Receiver<Value>>,
}

impl Session {
    fn new(declared: Vec<McpClientCapability>) -> Self {
        let (outbox, parked) = mpsc::channel(STREAM_QUEUE);
        Self { last_used: Instant::now(), declared, outbox, parked: Some(parked) }
    }

    fn stream_open(&self) -> bool {
        self.parked.is_none() && !self.outbox.is_closed()
    }

    /// The stream's queue, for what reaches only an open stream.
    fn stream(&self) -> Option<&mpsc::Sender<Value>> {
        self.stream_open().then_some(&self.outbox)
    }
}

/// How the bridge stands in for a client to one server (from the spec).
#[derive(Debug, Clone, Default)]
pub(super) struct ServerOptions {
    /// The client capabilities its `initialize` declares.
    pub(super) declared: Vec<McpClientCapability>,
    /// The root (`{"uri", "name"}`) that answers its `roots/list` when no
    /// client declared roots; `None` to answer with an error instead.
    pub(super) workspace_root: Option<Value>,
}

/// One stdio server as the bridge serves it: its current process, if any,
/// and the clients' sessions.
pub(super) struct Backend {
    name: String,
    state: watch::Sender<Serving>,
    sessions: Mutex<HashMap<String, Session>>,
    /// How long a request waits for a restarting server.
    wait: Duration,
    options: ServerOptions,
    /// The next id a server's request reaches a client under: unique for
    /// the endpoint's life, so an answer meant for a process that is gone
    /// never matches a request of the next one.
    next_request: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Backend {
    fn new(name: &str, wait: Duration, options: ServerOptions) -> Self {
        Self {
            name: name.to_owned(),
            state: watch::Sender::new(Serving::Starting),
            sessions: Mutex::default(),
            wait,
            options,
            next_request: AtomicU64::new(1),
        }
    }

    /// The client capabilities the bridge declares to the server.
    pub(super) fn declared(&self) -> &[McpClientCapability] {
        &self.options.declared
    }

    /// The root that answers `roots/list` when no client can, if any.
    pub(super) fn workspace_root(&self) -> Option<Value> {
        self.options.workspace_root.clone()
    }

    pub(super) fn next_request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// The process serving requests now, without waiting for one.
    fn current(&self) -> Option<Arc<Connection>> {
        match &*self.state.borrow() {
            Serving::Up(connection) => Some(Arc::clone(connection)),
            Serving::Starting | Serving::Down(_) => None,
        }
    }

    /// A restart begins: requests wait from now on.
    pub(super) fn starting(&self) {
        self.state.send_replace(Serving::Starting);
    }

    /// `connection` made its handshake: requests go to it.
    pub(super) fn up(&self, connection: Arc<Connection>) {
        self.state.send_replace(Serving::Up(connection));
    }

    /// Requests fail with `reason` until the next start.
    pub(super) fn down(&self, reason: String) {
        self.state.send_replace(Serving::Down(reason));
    }

    /// The connection's server went away. Whether it was the one serving
    /// requests (rather than one being replaced).
    pub(super) fn lost(&self, connection: &Arc<Connection>) -> bool {
        self.state.send_if_modified(|state| match state {
            Serving::Up(current) if Arc::ptr_eq(current, connection) => {
                *state = Serving::Down(format!("MCP server {:?} exited; it runs again after a restart", self.name));
                true
            }
            _ => false,
        })
    }

    /// How many requests wait for the server to start.
    #[cfg(test)]
    pub(super) fn waiting(&self) -> usize {
        // Each waiting request holds one receiver (see `connection`).
        self.state.receiver_count()
    }

    /// The live connection, waiting up to `wait` for one being started.
    async fn connection(&self) -> Result<Arc<Connection>, String> {
        let mut state = self.state.subscribe();
        let settled =
            tokio::time::timeout(self.wait, state.wait_for(|state| !matches!(state, Serving::Starting))).await;
        match settled {
            Err(_) => Err(format!(
                "MCP server {:?} is still starting after {}",
                self.name,
                humantime::format_duration(self.wait)
            )),
            Ok(Err(_)) => Err(format!("MCP server {:?} is gone", self.name)),
            Ok(Ok(state)) => match &*state {
                Serving::Up(connection) => Ok(Arc::clone(connection)),
                Serving::Down(reason) => Err(reason.clone()),
                Serving::Starting => Err(format!("MCP server {:?} is still starting", self.name)),
            },
        }
    }

    /// A new session for a client that declared `declared`; beyond
    /// [`MAX_SESSIONS`], the least recently used one ends.
    fn new_session(&self, declared: Vec<McpClientCapability>) -> String {
        let id = format!("{:032x}", rand::random::<u128>());
        let evicted = {
            let mut sessions = lock(&self.sessions);
            let oldest = (sessions.len() >= MAX_SESSIONS)
                .then(|| sessions.iter().min_by_key(|(_, session)| session.last_used).map(|(id, _)| id.clone()))
                .flatten();
            let evicted = oldest.filter(|oldest| sessions.remove(oldest).is_some());
            sessions.insert(id.clone(), Session::new(declared));
            evicted
        };
        if let Some(evicted) = evicted {
            debug!(server = %self.name, "too many MCP sessions; the least recently used one is ended");
            self.session_ended(&evicted);
        }
        id
    }

    /// Ends a session; false when there is no such session.
    fn end_session(&self, id: &str) -> bool {
        let ended = lock(&self.sessions).remove(id).is_some();
        if ended {
            self.session_ended(id);
        }
        ended
    }

    /// The server's requests the session was given will not be answered.
    fn session_ended(&self, id: &str) {
        if let Some(connection) = self.current() {
            connection.session_ended(id);
        }
    }

    /// Marks a session used; false when there is no such session.
    fn touch(&self, id: &str) -> bool {
        lock(&self.sessions).get_mut(id).map(|session| session.last_used = Instant::now()).is_some()
    }

    /// A message for one session's stream; dropped when it has none or
    /// its queue is full (a slow client must not hold the server up).
    pub(super) fn deliver(&self, session: &str, message: Value) {
        let sessions = lock(&self.sessions);
        if let Some(stream) = sessions.get(session).and_then(Session::stream)
            && stream.try_send(message).is_err()
        {
            debug!(server = %self.name, "a message for an MCP session was dropped: its stream is full or closed");
        }
    }

    /// A message for every open stream.
    pub(super) fn broadcast(&self, message: &Value) {
        for stream in lock(&self.sessions).values().filter_map(Session::stream) {
            let _ = stream.try_send(message.clone());
        }
    }

    /// The session a server's request that needs `capability` goes to
    /// ([`routing::route`]), given when each session's latest request in
    /// flight at the server was sent.
    pub(super) fn route(
        &self,
        capability: McpClientCapability,
        in_flight: &HashMap<String, Instant>,
    ) -> Option<String> {
        let sessions = lock(&self.sessions);
        let candidates: Vec<Candidate<&str, Instant>> = sessions
            .iter()
            .map(|(id, session)| Candidate {
                session: id.as_str(),
                declared: session.declared.contains(&capability),
                in_flight_since: in_flight.get(id).copied(),
                stream_open: session.stream_open(),
                last_used: session.last_used,
            })
            .collect();
        routing::route(&candidates).map(str::to_owned)
    }

    /// Room in one session's queue for a server's request and for its
    /// cancellation later, reserved together so that the client is always
    /// told of a request the server gave up; queued even before the client
    /// opened its stream. `None` when there is no such session, or its
    /// queue is closed or has no room for both.
    pub(super) fn reserve(&self, session: &str) -> Option<(OwnedPermit<Value>, OwnedPermit<Value>)> {
        let outbox = lock(&self.sessions).get(session).map(|session| session.outbox.clone());
        let reserved =
            outbox.and_then(|outbox| outbox.clone().try_reserve_owned().ok().zip(outbox.try_reserve_owned().ok()));
        if reserved.is_none() {
            debug!(server = %self.name, "a server's request for an MCP session was not taken: its queue is full or closed");
        }
        reserved
    }

    /// Answers a client's request, or says why it cannot be answered.
    async fn request(&self, request: Message, session: Option<&str>) -> Message {
        let id = request.get("id").cloned();
        let answer = async { self.connection().await?.request(request, session).await };
        answer.await.unwrap_or_else(|reason| error_answer(id, BRIDGE_ERROR, &reason))
    }
}

/// The loopback listener and the servers behind it.
pub(super) struct Bridge {
    addr: SocketAddr,
    backends: HashMap<String, Arc<Backend>>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Bridge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bridge").field("addr", &self.addr).finish_non_exhaustive()
    }
}

#[derive(Clone)]
struct Routes {
    backends: Arc<HashMap<String, Arc<Backend>>>,
}

impl Bridge {
    /// Binds `127.0.0.1` on a free port and serves `servers` there; a
    /// request waits up to `wait` for a server being (re)started.
    pub(super) async fn open<'a>(
        servers: impl IntoIterator<Item = (&'a str, ServerOptions)>,
        wait: Duration,
    ) -> io::Result<Self> {
        let backends: HashMap<String, Arc<Backend>> = servers
            .into_iter()
            .map(|(name, options)| (name.to_owned(), Arc::new(Backend::new(name, wait, options))))
            .collect();
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let routes = Routes { backends: Arc::new(backends.clone()) };
        let app = Router::new()
            .route("/mcp/{name}", post(post_message).get(open_stream).delete(end_session))
            .layer(DefaultBodyLimit::max(MAX_MESSAGE_BYTES))
            .with_state(routes);
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = stop.await;
            });
            if let Err(error) = served.await {
                warn!(%error, "the MCP bridge stopped serving");
            }
        });
        info!(%addr, "MCP bridge listening");
        Ok(Self { addr, backends, shutdown: Some(shutdown), task: Some(task) })
    }

    pub(super) fn url(&self, name: &str) -> String {
        format!("http://{}/mcp/{name}", self.addr)
    }

    pub(super) fn backend(&self, name: &str) -> Option<Arc<Backend>> {
        self.backends.get(name).cloned()
    }

    /// Ends every session and stops serving, letting open HTTP exchanges
    /// finish for a moment.
    pub(super) async fn close(&mut self) {
        for backend in self.backends.values() {
            backend.down(format!("MCP server {:?} is stopped", backend.name));
            lock(&backend.sessions).clear();
        }
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(mut task) = self.task.take()
            && tokio::time::timeout(CLOSE_GRACE, &mut task).await.is_err()
        {
            task.abort();
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// An HTTP-level refusal (the JSON-RPC message is not even looked at).
struct Refusal(StatusCode, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.0, self.1).into_response()
    }
}

/// Only loopback names are served: a web page the run opens must not reach
/// the servers through DNS rebinding.
fn check_host(headers: &HeaderMap) -> Result<(), Refusal> {
    let loopback = |authority: &str| {
        let host = match authority.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => host,
            _ => authority,
        };
        matches!(host, "127.0.0.1" | "localhost" | "[::1]")
    };
    let host_ok = headers.get(header::HOST).and_then(|value| value.to_str().ok()).is_none_or(loopback);
    let origin_ok = headers.get(header::ORIGIN).and_then(|value| value.to_str().ok()).is_none_or(|origin| {
        origin.strip_prefix("http://").or_else(|| origin.strip_prefix("https://")).is_some_and(loopback)
    });
    if host_ok && origin_ok {
        Ok(())
    } else {
        Err(Refusal(StatusCode::FORBIDDEN, "only loopback hosts and origins are served".to_owned()))
    }
}

fn json_answer(status: StatusCode, answer: Message) -> Response {
    (status, axum::Json(Value::Object(answer))).into_response()
}

fn backend_for(routes: &Routes, name: &str, headers: &HeaderMap) -> Result<Arc<Backend>, Refusal> {
    check_host(headers)?;
    routes
        .backends
        .get(name)
        .cloned()
        .ok_or_else(|| Refusal(StatusCode::NOT_FOUND, format!("no MCP server named {name:?} is bridged here")))
}

/// The request's session: `Ok(None)` without the header, an error answer
/// for a session that does not exist (the client must initialize again).
fn session_of(backend: &Backend, headers: &HeaderMap) -> Result<Option<String>, Refusal> {
    let Some(value) = headers.get(SESSION_HEADER) else { return Ok(None) };
    let id = value.to_str().unwrap_or_default();
    if backend.touch(id) {
        Ok(Some(id.to_owned()))
    } else {
        Err(Refusal(StatusCode::NOT_FOUND, "no such MCP session: initialize again".to_owned()))
    }
}

async fn post_message(
    State(routes): State<Routes>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let backend = match backend_for(&routes, &name, &headers) {
        Ok(backend) => backend,
        Err(refusal) => return refusal.into_response(),
    };
    let message = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(message)) => message,
        Ok(Value::Array(_)) => {
            return json_answer(
                StatusCode::BAD_REQUEST,
                error_answer(None, -32600, "JSON-RPC batches are not supported"),
            );
        }
        Ok(_) => return json_answer(StatusCode::BAD_REQUEST, error_answer(None, -32600, "not a JSON-RPC message")),
        Err(error) => {
            return json_answer(StatusCode::BAD_REQUEST, error_answer(None, -32700, &format!("parse error: {error}")));
        }
    };
    let method = message.get("method").and_then(Value::as_str).map(str::to_owned);
    let is_answer = message.contains_key("result") || message.contains_key("error");
    match (method.as_deref(), message.get("id").cloned()) {
        // The bridge made the handshake with the server itself.
        (Some("notifications/initialized"), None) => StatusCode::ACCEPTED.into_response(),
        // A new session, answered with what the server said to the bridge.
        (Some("initialize"), Some(id)) => {
            let result = backend.connection().await.and_then(|connection| {
                connection.initialize_result().ok_or_else(|| format!("MCP server {name:?} is not initialized"))
            });
            match result {
                Ok(result) => {
                    let session = backend.new_session(routing::declared_by(message.get("params")));
                    let mut answer = Message::new();
                    answer.insert("jsonrpc".to_owned(), "2.0".into());
                    answer.insert("id".to_owned(), id);
                    answer.insert("result".to_owned(), Value::Object(result));
                    let mut response = json_answer(StatusCode::OK, answer);
                    if let Ok(value) = HeaderValue::from_str(&session) {
                        response.headers_mut().insert(SESSION_HEADER, value);
                    }
                    response
                }
                Err(reason) => json_answer(StatusCode::OK, error_answer(Some(id), BRIDGE_ERROR, &reason)),
            }
        }
        (Some(_), Some(_)) => {
            let session = match session_of(&backend, &headers) {
                Ok(session) => session,
                Err(refusal) => return refusal.into_response(),
            };
            json_answer(StatusCode::OK, backend.request(message, session.as_deref()).await)
        }
        (Some(method), None) => {
            let session = match session_of(&backend, &headers) {
                Ok(session) => session,
                Err(refusal) => return refusal.into_response(),
            };
            if method == "notifications/roots/list_changed" && !backend.declared().contains(&McpClientCapability::Roots)
            {
                debug!(server = %name, "a client's roots/list_changed was dropped: the server was not told of roots");
                return StatusCode::ACCEPTED.into_response();
            }
            if let Ok(connection) = backend.connection().await {
                connection.client_notification(message, session.as_deref()).await;
            }
            StatusCode::ACCEPTED.into_response()
        }
        (None, Some(_)) if is_answer => {
            let session = match session_of(&backend, &headers) {
                Ok(session) => session,
                Err(refusal) => return refusal.into_response(),
            };
            // Not waited for: a restart drops the requests being answered.
            match backend.current() {
                Some(connection) => connection.client_answer(message, session.as_deref()).await,
                None => debug!(server = %name, "an answer to a server's request was ignored: the server is not up"),
            }
            StatusCode::ACCEPTED.into_response()
        }
        _ => json_answer(StatusCode::BAD_REQUEST, error_answer(None, -32600, "not a JSON-RPC message")),
    }
}

async fn open_stream(State(routes): State<Routes>, Path(name): Path<String>, headers: HeaderMap) -> Response {
    let backend = match backend_for(&routes, &name, &headers) {
        Ok(backend) => backend,
        Err(refusal) => return refusal.into_response(),
    };
    let accepts_events = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .any(|value| value.contains("text/event-stream") || value.contains("*/*"));
    if !accepts_events {
        return (StatusCode::NOT_ACCEPTABLE, "a stream is text/event-stream").into_response();
    }
    let session = match session_of(&backend, &headers) {
        Ok(Some(session)) => session,
        Ok(None) => return (StatusCode::BAD_REQUEST, "a stream needs an Mcp-Session-Id").into_response(),
        Err(refusal) => return refusal.into_response(),
    };
    let receiver = {
        let mut sessions = lock(&backend.sessions);
        let Some(entry) = sessions.get_mut(&session) else {
            return (StatusCode::NOT_FOUND, "no such MCP session: initialize again").into_response();
        };
        entry.parked.take().unwrap_or_else(|| {
            // A second stream replaces the first, which ends.
            let (outbox, receiver) = mpsc::channel(STREAM_QUEUE);
            entry.outbox = outbox;
            receiver
        })
    };
    let events = futures::stream::unfold(receiver, |mut receiver| async move {
        let message = receiver.recv().await?;
        Some((Ok::<_, Infallible>(Event::default().data(message.to_string())), receiver))
    });
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

async fn end_session(State(routes): State<Routes>, Path(name): Path<String>, headers: HeaderMap) -> Response {
    let backend = match backend_for(&routes, &name, &headers) {
        Ok(backend) => backend,
        Err(refusal) => return refusal.into_response(),
    };
    let id = headers.get(SESSION_HEADER).and_then(|value| value.to_str().ok()).unwrap_or_default();
    if backend.end_session(id) {
        StatusCode::OK.into_response()
    } else {
        (StatusCode::NOT_FOUND, "no such MCP session").into_response()
    }
}
