//! The bridge's side of one stdio MCP server process: its stdin and stdout,
//! the `initialize` handshake, and the JSON-RPC traffic of every client
//! multiplexed onto it.
//!
//! Messages are forwarded as raw JSON objects, not through rmcp's typed
//! model: the bridge must be transparent, and rmcp's model is not lossless
//! for a proxy (its result types are an untagged union that drops fields it
//! does not know, and it adds or strips fields by protocol version). rmcp
//! frames the pipe (see [`super::framing`]) and types the handshake.
//!
//! Several clients share one server, so every request is sent under an id
//! of the bridge's own and answered under the client's id again; a
//! request's progress token is rewritten the same way, so that progress
//! reaches the client that asked for it. The server's own requests
//! (sampling, roots, elicitation) go the other way the same way: to the
//! session [`super::routing`] chooses, under an id of the bridge's own
//! ([`super::server_requests`] keeps the books).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use futures::SinkExt;
use rmcp::model::{
    ClientCapabilities, ClientJsonRpcMessage, ClientNotification, ClientRequest, Implementation, InitializeRequest,
    InitializeRequestParams, InitializeResult, InitializedNotification, ProtocolVersion, RequestId,
};
use rmcp::transport::async_rw::JsonRpcMessageCodec;
use serde_json::{Map, Value, json};
use standby_protocol::McpClientCapability;
use tokio::process::{ChildStdin, ChildStdout};
use tokio::sync::mpsc::OwnedPermit;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::codec::FramedWrite;
use tracing::{debug, warn};

use super::bridge::Backend;
use super::framing::{Frame, Frames};
use super::routing;
use super::server_requests::{Answered, ServerRequests};

/// Largest message accepted from a server (and from a client).
pub(super) const MAX_MESSAGE_BYTES: usize = 4 << 20;
/// Requests waiting for a server's answer, all clients together.
const MAX_IN_FLIGHT: usize = 256;
/// Server-to-client requests waiting for a client's answer.
pub(super) const MAX_SERVER_REQUESTS: usize = 256;
/// Messages queued for the server's stdin.
const OUTGOING_QUEUE: usize = 64;
/// JSON-RPC error code of the failures the bridge answers itself.
pub(super) const BRIDGE_ERROR: i64 = -32000;
/// JSON-RPC's "method not found": what a client that does not serve a
/// server's request answers, and so what the bridge answers for none.
const METHOD_NOT_FOUND: i64 = -32601;

/// A JSON-RPC message as it travels through the bridge.
pub(super) type Message = Map<String, Value>;

/// An `initialize` request declaring `capabilities`, built with rmcp's
/// types so that the handshake speaks the SDK's idea of the protocol.
pub(super) fn initialize_request(id: i64, capabilities: &[McpClientCapability]) -> Value {
    let params = InitializeRequestParams::new(
        client_capabilities(capabilities),
        Implementation::new("standby-mcp-bridge", env!("CARGO_PKG_VERSION")),
    )
    .with_protocol_version(ProtocolVersion::LATEST_WITH_INITIALIZE);
    let message = ClientJsonRpcMessage::request(
        ClientRequest::InitializeRequest(InitializeRequest::new(params)),
        RequestId::Number(id),
    );
    serde_json::to_value(message).unwrap_or(Value::Null)
}

/// MCP's `ClientCapabilities` declaring `declared`: each with no
/// sub-capability, but roots with `listChanged` (a client's
/// `notifications/roots/list_changed` is forwarded).
fn client_capabilities(declared: &[McpClientCapability]) -> ClientCapabilities {
    let declared: Map<String, Value> = declared
        .iter()
        .map(|capability| {
            let value = match capability {
                McpClientCapability::Roots => json!({"listChanged": true}),
                McpClientCapability::Sampling | McpClientCapability::Elicitation => json!({}),
            };
            (routing::name(*capability).to_owned(), value)
        })
        .collect();
    serde_json::from_value(Value::Object(declared)).unwrap_or_default()
}

fn initialized_notification() -> Value {
    let message = ClientJsonRpcMessage::notification(ClientNotification::InitializedNotification(
        InitializedNotification::default(),
    ));
    serde_json::to_value(message).unwrap_or(Value::Null)
}

/// Checks an answer to `initialize`: its result, or why it is not one.
pub(super) fn initialize_result(answer: &Message) -> Result<Message, String> {
    if let Some(error) = answer.get("error") {
        let message = error.get("message").and_then(Value::as_str).unwrap_or("no message");
        return Err(format!("it answered initialize with an error: {message}"));
    }
    let Some(Value::Object(result)) = answer.get("result") else {
        return Err("its answer to initialize has no result".to_owned());
    };
    serde_json::from_value::<InitializeResult>(Value::Object(result.clone()))
        .map_err(|error| format!("its answer to initialize is not an MCP InitializeResult: {error}"))?;
    Ok(result.clone())
}

/// A JSON-RPC error answer.
pub(super) fn error_answer(id: Option<Value>, code: i64, message: &str) -> Message {
    let mut answer = Message::new();
    answer.insert("jsonrpc".to_owned(), "2.0".into());
    answer.insert("id".to_owned(), id.unwrap_or(Value::Null));
    answer.insert("error".to_owned(), json!({"code": code, "message": message}));
    answer
}

/// A request sent to the server and not answered yet.
struct Pending {
    reply: oneshot::Sender<Message>,
    session: Option<String>,
    client_id: Value,
    progress_token: Option<Value>,
    sent_at: Instant,
}

/// The requests waiting for the server; none are taken once it is closed
/// (nothing would ever answer them).
#[derive(Default)]
struct PendingTable {
    closed: bool,
    entries: HashMap<u64, Pending>,
}

impl PendingTable {
    fn close(&mut self) {
        self.closed = true;
        self.entries.clear();
    }
}

/// The pipes of one running stdio server.
pub(super) struct Connection {
    server: String,
    outgoing: mpsc::Sender<Value>,
    pending: Mutex<PendingTable>,
    /// The server's requests handed to a client, waiting for its answer,
    /// each with the room its cancellation takes in the client's stream.
    server_requests: Mutex<ServerRequests<OwnedPermit<Value>>>,
    next_id: AtomicU64,
    /// The server's `InitializeResult`, once the handshake succeeded.
    initialized: OnceLock<Message>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Connection {
    /// Takes over a server's pipes: one task writes its stdin, one reads
    /// its stdout and routes what it says (answers to their requests,
    /// the rest through `backend` to the clients).
    pub(super) fn open(server: &str, stdin: ChildStdin, stdout: ChildStdout, backend: Weak<Backend>) -> Arc<Self> {
        let (outgoing, queue) = mpsc::channel(OUTGOING_QUEUE);
        let connection = Arc::new(Self {
            server: server.to_owned(),
            outgoing,
            pending: Mutex::new(PendingTable::default()),
            server_requests: Mutex::new(ServerRequests::new(MAX_SERVER_REQUESTS)),
            next_id: AtomicU64::new(1),
            initialized: OnceLock::new(),
            tasks: Mutex::new(Vec::new()),
        });
        let writer = tokio::spawn(write_loop(server.to_owned(), stdin, queue));
        let reader = tokio::spawn(read_loop(server.to_owned(), stdout, Arc::downgrade(&connection), backend));
        lock(&connection.tasks).extend([writer, reader]);
        connection
    }

    /// The `initialize` exchange declaring `capabilities`, then
    /// `notifications/initialized`.
    pub(super) async fn initialize(&self, capabilities: &[McpClientCapability]) -> Result<(), String> {
        let Value::Object(request) = initialize_request(0, capabilities) else {
            return Err("cannot build the initialize request".to_owned());
        };
        let answer = self.request(request, None).await?;
        let result = initialize_result(&answer)?;
        self.notify(initialized_notification()).await?;
        // Set once: the handshake is made once per process.
        let _ = self.initialized.set(result);
        Ok(())
    }

    /// The server's answer to the bridge's `initialize`.
    pub(super) fn initialize_result(&self) -> Option<Message> {
        self.initialized.get().cloned()
    }

    /// Sends a client's request under a bridge id and returns the server's
    /// answer under the client's id. Dropped before the answer (the client
    /// went away), the request is cancelled at the server.
    pub(super) async fn request(&self, mut request: Message, session: Option<&str>) -> Result<Message, String> {
        let client_id = request.get("id").cloned().unwrap_or(Value::Null);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        request.insert("id".to_owned(), id.into());
        let progress_token = request
            .get_mut("params")
            .and_then(|params| params.get_mut("_meta"))
            .and_then(|meta| meta.get_mut("progressToken"))
            .map(|token| std::mem::replace(token, id.into()));
        let (reply, answer) = oneshot::channel();
        {
            let mut pending = lock(&self.pending);
            if pending.closed {
                return Err(self.stopped());
            }
            if pending.entries.len() >= MAX_IN_FLIGHT {
                return Err(format!(
                    "MCP server {:?} has {MAX_IN_FLIGHT} requests in flight already; try again later",
                    self.server
                ));
            }
            let entry = Pending {
                reply,
                session: session.map(str::to_owned),
                client_id: client_id.clone(),
                progress_token,
                sent_at: Instant::now(),
            };
            pending.entries.insert(id, entry);
        }
        let mut guard = CancelOnDrop { connection: self, id, armed: true };
        if self.outgoing.send(Value::Object(request)).await.is_err() {
            return Err(self.stopped());
        }
        let mut answer = answer.await.map_err(|_| self.stopped())?;
        guard.armed = false;
        answer.insert("id".to_owned(), client_id);
        Ok(answer)
    }

    fn stopped(&self) -> String {
        format!("MCP server {:?} stopped before it answered (it exited or was restarted)", self.server)
    }

    /// Forwards a client's notification. A cancellation names the request
    /// by the client's id: it is translated, and the waiting request ends.
    pub(super) async fn client_notification(&self, mut notification: Message, session: Option<&str>) {
        let cancelled = notification.get("method").and_then(Value::as_str) == Some("notifications/cancelled");
        if cancelled {
            let client_id = notification.get("params").and_then(|params| params.get("requestId")).cloned();
            let Some(client_id) = client_id else { return };
            let found = {
                let mut pending = lock(&self.pending);
                let id = pending
                    .entries
                    .iter()
                    .find(|(_, entry)| entry.session.as_deref() == session && entry.client_id == client_id)
                    .map(|(id, _)| *id);
                id.and_then(|id| pending.entries.remove(&id).map(|entry| (id, entry)))
            };
            let Some((id, entry)) = found else { return };
            if let Some(params) = notification.get_mut("params").and_then(Value::as_object_mut) {
                params.insert("requestId".to_owned(), id.into());
            }
            let _ = entry.reply.send(error_answer(Some(client_id), BRIDGE_ERROR, "cancelled by the client"));
        }
        if self.notify(Value::Object(notification)).await.is_err() {
            debug!(server = %self.server, "notification dropped: the server is gone");
        }
    }

    /// Forwards a client's answer to a request the server made, under the
    /// server's id; an answer to no waiting request, or from another
    /// session than the one asked, is ignored.
    pub(super) async fn client_answer(&self, mut answer: Message, session: Option<&str>) {
        let id = answer.get("id").cloned().unwrap_or(Value::Null);
        let verdict = lock(&self.server_requests).answer(&id, session);
        match verdict {
            Answered::Forward(server_id) => {
                answer.insert("id".to_owned(), server_id);
                let _ = self.notify(Value::Object(answer)).await;
            }
            Answered::Unknown => debug!(
                server = %self.server,
                "an answer to no waiting request of this server was ignored (answered, cancelled, or its process is gone)"
            ),
            Answered::OtherSession => {
                debug!(server = %self.server, "an answer from a session the request was not sent to was ignored");
            }
        }
    }

    /// When each session's latest request in flight at this server was sent.
    fn in_flight(&self) -> HashMap<String, Instant> {
        let mut latest: HashMap<String, Instant> = HashMap::new();
        for entry in lock(&self.pending).entries.values() {
            if let Some(session) = &entry.session {
                let at = latest.entry(session.clone()).or_insert(entry.sent_at);
                *at = (*at).max(entry.sent_at);
            }
        }
        latest
    }

    /// A session ended: its client will never answer the server's requests
    /// it was given, so the server is answered with an error for each.
    pub(super) fn session_ended(&self, session: &str) {
        let abandoned = lock(&self.server_requests).session_ended(session);
        for server_id in abandoned {
            let why = "the client's session ended before it answered";
            let _ = self.outgoing.try_send(Value::Object(error_answer(Some(server_id), BRIDGE_ERROR, why)));
        }
    }

    /// The process is gone: its requests waiting at clients are dropped,
    /// and each client is told with a cancellation (its answer would be
    /// ignored).
    fn abandon_server_requests(&self) {
        let abandoned = lock(&self.server_requests).drain();
        for (bridge_id, room) in abandoned {
            room.send(json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {
                "requestId": bridge_id, "reason": "the MCP server stopped (it exited or was restarted)"}}));
        }
    }

    async fn notify(&self, message: Value) -> Result<(), String> {
        self.outgoing.send(message).await.map_err(|_| self.stopped())
    }

    /// Whether the server's stdout is closed (or the bridge let go of it).
    pub(super) fn is_closed(&self) -> bool {
        lock(&self.pending).closed
    }

    /// Stops reading and writing; every waiting request fails, and the
    /// server's requests waiting at clients are dropped.
    pub(super) fn close(&self) {
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
        lock(&self.pending).close();
        self.abandon_server_requests();
    }

    /// Routes one message from the server.
    fn dispatch(&self, mut message: Message, backend: &Backend) {
        let method = message.get("method").and_then(Value::as_str).map(str::to_owned);
        let id = message.get("id").cloned();
        match (method.as_deref(), id) {
            (Some("ping"), Some(id)) => {
                let _ = self.outgoing.try_send(json!({"jsonrpc": "2.0", "id": id, "result": {}}));
            }
            (Some(method), Some(id)) => self.server_request(method, &id, message, backend),
            (Some("notifications/cancelled"), None) => {
                let server_id = message.get("params").and_then(|params| params.get("requestId")).cloned();
                let found = server_id.and_then(|server_id| lock(&self.server_requests).cancelled(&server_id));
                let Some((bridge_id, room)) = found else {
                    debug!(server = %self.server, "a cancellation of no request handed to a client was dropped");
                    return;
                };
                if let Some(params) = message.get_mut("params").and_then(Value::as_object_mut) {
                    params.insert("requestId".to_owned(), bridge_id.into());
                }
                room.send(Value::Object(message));
            }
            (Some("notifications/progress"), None) => {
                let token =
                    message.get("params").and_then(|params| params.get("progressToken")).and_then(Value::as_u64);
                let route = token.and_then(|token| {
                    let pending = lock(&self.pending);
                    let entry = pending.entries.get(&token)?;
                    Some((entry.session.clone()?, entry.progress_token.clone()?))
                });
                let Some((session, original)) = route else { return };
                if let Some(params) = message.get_mut("params").and_then(Value::as_object_mut) {
                    params.insert("progressToken".to_owned(), original);
                }
                backend.deliver(&session, Value::Object(message));
            }
            (Some(_), None) => backend.broadcast(&Value::Object(message)),
            (None, Some(id)) => {
                let entry = id.as_u64().and_then(|id| lock(&self.pending).entries.remove(&id));
                match entry {
                    Some(entry) => {
                        let _ = entry.reply.send(message);
                    }
                    None => debug!(server = %self.server, "an answer to no pending request was dropped"),
                }
            }
            (None, None) => debug!(server = %self.server, "a JSON object that is no JSON-RPC message was dropped"),
        }
    }

    /// A request of the server's: handed to the session [`routing::route`]
    /// chooses under a bridge id, or answered here (the workspace root for
    /// `roots/list` when configured, else an error): never left waiting.
    fn server_request(&self, method: &str, id: &Value, mut message: Message, backend: &Backend) {
        let refuse = |code: i64, why: &str| {
            debug!(server = %self.server, method, why, "a request of the server was answered by the bridge");
            let _ = self.outgoing.try_send(Value::Object(error_answer(Some(id.clone()), code, why)));
        };
        let Some(capability) = routing::needs(method) else {
            return refuse(METHOD_NOT_FOUND, &format!("no client of the standby MCP bridge serves {method}"));
        };
        let Some(session) = backend.route(capability, &self.in_flight()) else {
            if let (McpClientCapability::Roots, Some(root)) = (capability, backend.workspace_root()) {
                let answer = json!({"jsonrpc": "2.0", "id": id, "result": {"roots": [root]}});
                let _ = self.outgoing.try_send(answer);
                return;
            }
            let name = routing::name(capability);
            return refuse(METHOD_NOT_FOUND, &format!("no client of the standby MCP bridge declared {name}"));
        };
        let Some((room, cancellation_room)) = backend.reserve(&session) else {
            return refuse(BRIDGE_ERROR, "the client's session ended, or its stream is full");
        };
        let bridge_id = backend.next_request_id();
        if !lock(&self.server_requests).admit(bridge_id, id.clone(), &session, cancellation_room) {
            let why =
                format!("{MAX_SERVER_REQUESTS} requests of MCP server {:?} already wait for clients", self.server);
            return refuse(BRIDGE_ERROR, &why);
        }
        message.insert("id".to_owned(), bridge_id.into());
        room.send(Value::Object(message));
    }

    /// Fails the request an unreadable answer was meant for; a line that
    /// answers no request of the bridge's was a request of the server's,
    /// which is refused.
    fn fail(&self, id: &Value, why: &str) {
        if let Some(entry) = id.as_u64().and_then(|id| lock(&self.pending).entries.remove(&id)) {
            let _ = entry.reply.send(error_answer(None, BRIDGE_ERROR, why));
        } else {
            let why = format!("a message over the size limit of {MAX_MESSAGE_BYTES} bytes");
            let _ = self.outgoing.try_send(Value::Object(error_answer(Some(id.clone()), BRIDGE_ERROR, &why)));
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.close();
    }
}

/// Removes a request the client stopped waiting for, and tells the server.
struct CancelOnDrop<'a> {
    connection: &'a Connection,
    id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed && lock(&self.connection.pending).entries.remove(&self.id).is_some() {
            let cancel = json!({
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": self.id, "reason": "the client went away"},
            });
            let _ = self.connection.outgoing.try_send(cancel);
        }
    }
}

async fn write_loop(server: String, stdin: ChildStdin, mut queue: mpsc::Receiver<Value>) {
    let mut stdin = FramedWrite::new(stdin, JsonRpcMessageCodec::<Value>::new());
    while let Some(message) = queue.recv().await {
        if let Err(error) = stdin.send(message).await {
            debug!(%server, %error, "cannot write to the MCP server's stdin");
            return;
        }
    }
}

async fn read_loop(server: String, stdout: ChildStdout, connection: Weak<Connection>, backend: Weak<Backend>) {
    let mut frames = Frames::new(stdout, MAX_MESSAGE_BYTES);
    let mut garbage = 0_u64;
    loop {
        let frame = match frames.next().await {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(error) => {
                warn!(%server, %error, "cannot read the MCP server's stdout");
                break;
            }
        };
        let (Some(connection), Some(backend)) = (connection.upgrade(), backend.upgrade()) else { return };
        match frame {
            Frame::Message(message) => connection.dispatch(message, &backend),
            Frame::Garbage => {
                garbage += 1;
                if garbage == 1 {
                    warn!(%server, "MCP server wrote a line that is no JSON-RPC message on stdout; skipped (more are logged at debug)");
                } else {
                    debug!(%server, lines = garbage, "MCP server wrote another line that is no JSON-RPC message");
                }
            }
            Frame::Oversized { bytes, id } => {
                warn!(%server, bytes, limit = MAX_MESSAGE_BYTES, "MCP server sent a message over the size limit; discarded");
                if let Some(id) = id {
                    connection
                        .fail(&id, &format!("MCP server {server:?} answered with more than {MAX_MESSAGE_BYTES} bytes"));
                }
            }
        }
    }
    if let (Some(connection), Some(backend)) = (connection.upgrade(), backend.upgrade()) {
        lock(&connection.pending).close();
        connection.abandon_server_requests();
        if backend.lost(&connection) {
            warn!(%server, "MCP server closed its stdout (it exited?); its endpoint answers errors until a restart");
        } else {
            debug!(%server, "MCP server closed its stdout");
        }
    }
}
