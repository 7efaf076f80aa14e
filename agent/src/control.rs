//! The control socket: one task owns the WebSocket (reader and writer),
//! sends heartbeats, and reconnects when [`crate::reconnect`]'s policy says.
//!
//! The task knows nothing of the lifecycle: it reports what happened as
//! [`ControlEvent`]s and takes two inputs, the credential to connect with
//! (a change closes the current connection and reconnects at once) and the
//! state each heartbeat reports (a change is sent at once, so the server
//! can claim a standby the moment it is ready instead of at the next tick).

use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use reqwest::Url;
use standby_protocol::{
    AgentMessage, AgentState, Answer, CredentialKind, PROTOCOL_HEADER, PROTOCOL_VERSION, Refusal, Secret, ServerMessage,
};
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::{HeaderValue, header};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message};

use crate::api::parse_retry_after;
/// The reconnect policy's bounds, where the soak test's simulated fleet
/// reads them.
pub use crate::reconnect::{BACKOFF_CAP, BACKOFF_MIN, STABLE_AFTER};
use crate::reconnect::{Ended, Next, Reconnect};

/// Largest server message accepted. An assignment carries a workspace
/// description and environment maps; 1 MiB is far above any real one, and a
/// larger frame closes the connection (then the agent reconnects) instead of
/// growing memory without bound.
const MAX_MESSAGE_BYTES: usize = 1 << 20;

#[derive(Debug)]
pub(crate) enum ControlEvent {
    Connected(CredentialKind),
    Message {
        credential: CredentialKind,
        /// Boxed: an assignment is far larger than the other events.
        message: Box<ServerMessage>,
    },
    /// `401`, `403` or `410`: this credential will not be retried; the task
    /// waits for another credential.
    Refused {
        credential: CredentialKind,
        refusal: Refusal,
    },
}

/// The credential the task connects with.
#[derive(Debug, Clone)]
pub(crate) struct Login {
    pub(crate) kind: CredentialKind,
    pub(crate) secret: Secret,
}

/// What each heartbeat says.
pub(crate) type Status = (AgentState, Option<String>);

#[derive(Debug, Clone)]
pub(crate) struct ControlConfig {
    pub(crate) socket_url: Url,
    pub(crate) heartbeat_interval: Duration,
    /// The agent's one trust store, shared with its HTTP calls.
    pub(crate) tls: Arc<rustls::ClientConfig>,
}

/// Spawns the connection task. It ends when `shutdown` turns true (closing
/// the socket politely) or when `events` is dropped.
pub(crate) fn spawn(
    config: ControlConfig,
    login: watch::Receiver<Login>,
    status: watch::Receiver<Status>,
    events: mpsc::Sender<ControlEvent>,
    shutdown: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(config, login, status, events, shutdown))
}

enum Attempt {
    Connected(Box<Socket>),
    Refused { refusal: Refusal, why: String },
    Transient { error: String, retry_after: Option<Duration> },
}

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

enum SessionEnd {
    Dropped(String),
    LoginChanged,
    Shutdown,
}

async fn run(
    config: ControlConfig,
    mut login: watch::Receiver<Login>,
    mut status: watch::Receiver<Status>,
    events: mpsc::Sender<ControlEvent>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut policy = Reconnect::default();
    let mut attempts = 0u32;
    loop {
        if *shutdown.borrow() {
            return;
        }
        let current = login.borrow_and_update().clone();
        attempts += 1;
        let attempt = tokio::select! {
            attempt = connect(&config.socket_url, &config.tls, &current.secret) => attempt,
            _ = login.changed() => {
                policy.credential_changed();
                continue;
            }
            _ = shutdown.changed() => return,
        };
        let (ended, why) = match attempt {
            Attempt::Connected(socket) => {
                tracing::info!(credential = ?current.kind, attempts, "control socket connected");
                attempts = 0;
                if events.send(ControlEvent::Connected(current.kind)).await.is_err() {
                    return;
                }
                policy.connected(Instant::now());
                match session(*socket, &config, current.kind, &mut status, &events, &mut login, &mut shutdown).await {
                    SessionEnd::Shutdown => return,
                    SessionEnd::LoginChanged => {
                        policy.credential_changed();
                        continue;
                    }
                    SessionEnd::Dropped(reason) => (Ended::Dropped, format!("control socket lost: {reason}")),
                }
            }
            Attempt::Refused { refusal, why } => {
                if events.send(ControlEvent::Refused { credential: current.kind, refusal }).await.is_err() {
                    return;
                }
                (Ended::Refused, format!("control socket refused: {why}"))
            }
            Attempt::Transient { error, retry_after } => {
                (Ended::Failed { retry_after }, format!("control socket unavailable: {error}"))
            }
        };
        let delay = match policy.next(Instant::now(), ended, rand::random()) {
            Next::After(delay) => {
                tracing::warn!(credential = ?current.kind, attempt = attempts, retry_in_ms = delay.as_millis() as u64, "{why}");
                Some(delay)
            }
            Next::AwaitCredential => {
                tracing::warn!(credential = ?current.kind, "{why}; waiting for another credential");
                None
            }
        };
        tokio::select! {
            _ = sleep(delay) => {}
            _ = login.changed() => policy.credential_changed(),
            _ = shutdown.changed() => return,
        }
    }
}

/// Sleeps for `delay`; never wakes when there is none.
async fn sleep(delay: Option<Duration>) {
    match delay {
        Some(delay) => tokio::time::sleep(delay).await,
        None => std::future::pending().await,
    }
}

async fn connect(url: &Url, tls: &Arc<rustls::ClientConfig>, secret: &Secret) -> Attempt {
    let mut request = match url.as_str().into_client_request() {
        Ok(request) => request,
        Err(e) => return Attempt::Transient { error: e.to_string(), retry_after: None },
    };
    let Ok(mut bearer) = HeaderValue::from_str(&format!("Bearer {}", secret.expose())) else {
        // A credential that cannot be a header value can never be accepted.
        let why = "the credential cannot be sent in a header".to_owned();
        return Attempt::Refused { refusal: Refusal::Unauthorized, why };
    };
    bearer.set_sensitive(true);
    request.headers_mut().insert(header::AUTHORIZATION, bearer);
    request.headers_mut().insert(PROTOCOL_HEADER, HeaderValue::from_static(PROTOCOL_VERSION));
    let config = WebSocketConfig::default()
        .read_buffer_size(16 * 1024)
        .write_buffer_size(0)
        .max_message_size(Some(MAX_MESSAGE_BYTES))
        .max_frame_size(Some(MAX_MESSAGE_BYTES));
    let connector = tokio_tungstenite::Connector::Rustls(Arc::clone(tls));
    let connecting = tokio_tungstenite::connect_async_tls_with_config(request, Some(config), true, Some(connector));
    match tokio::time::timeout(Duration::from_secs(20), connecting).await {
        Err(_) => Attempt::Transient { error: "connect timed out after 20s".into(), retry_after: None },
        Ok(Ok((socket, _))) => Attempt::Connected(Box::new(socket)),
        Ok(Err(tungstenite::Error::Http(response))) => {
            let status = response.status();
            match Answer::of(status.as_u16()) {
                Answer::Refused(refusal) => Attempt::Refused { refusal, why: format!("upgrade answered {status}") },
                Answer::Success | Answer::Transient | Answer::Fatal => Attempt::Transient {
                    error: format!("upgrade answered {status}"),
                    retry_after: response
                        .headers()
                        .get(header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| parse_retry_after(v, std::time::SystemTime::now())),
                },
            }
        }
        Ok(Err(e)) => Attempt::Transient { error: e.to_string(), retry_after: None },
    }
}

async fn session(
    socket: Socket,
    config: &ControlConfig,
    kind: CredentialKind,
    status: &mut watch::Receiver<Status>,
    events: &mpsc::Sender<ControlEvent>,
    login: &mut watch::Receiver<Login>,
    shutdown: &mut watch::Receiver<bool>,
) -> SessionEnd {
    let (mut writer, mut reader) = socket.split();
    // Marks the state seen: a change is sent once, by whichever heartbeat
    // comes first.
    let heartbeat = |status: &mut watch::Receiver<Status>| {
        let (state, execution_id) = status.borrow_and_update().clone();
        Message::text(AgentMessage::Heartbeat { state, execution_id }.encode())
    };
    if let Err(e) = writer.send(heartbeat(status)).await {
        return SessionEnd::Dropped(format!("sending the first heartbeat: {e}"));
    }
    let mut ticker = tokio::time::interval_at(
        crate::time::after(Instant::now(), config.heartbeat_interval),
        config.heartbeat_interval,
    );
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => {
                let _ = writer.send(Message::Close(None)).await;
                return SessionEnd::Shutdown;
            }
            _ = login.changed() => {
                let _ = writer.send(Message::Close(None)).await;
                return SessionEnd::LoginChanged;
            }
            _ = ticker.tick() => {
                if let Err(e) = writer.send(heartbeat(status)).await {
                    return SessionEnd::Dropped(format!("sending a heartbeat: {e}"));
                }
            }
            // The agent's state changed (it became ready, say): tell the
            // server now rather than at the next tick. An ended sender
            // (the agent shutting down) disables the branch.
            Ok(()) = status.changed() => {
                if let Err(e) = writer.send(heartbeat(status)).await {
                    return SessionEnd::Dropped(format!("sending a heartbeat on a change of state: {e}"));
                }
            }
            frame = reader.next() => match frame {
                None => return SessionEnd::Dropped("connection closed".into()),
                Some(Err(e)) => return SessionEnd::Dropped(e.to_string()),
                Some(Ok(Message::Text(text))) => match ServerMessage::decode(&text) {
                    Ok(ServerMessage::Unknown { type_name }) => {
                        tracing::debug!(type_name, "message of unknown type skipped");
                    }
                    Ok(message) => {
                        if events.send(ControlEvent::Message { credential: kind, message: Box::new(message) }).await.is_err() {
                            return SessionEnd::Shutdown;
                        }
                    }
                    Err(error) => tracing::debug!(%error, "malformed text frame skipped"),
                },
                Some(Ok(Message::Close(frame))) => {
                    let reason = frame.map(|f| format!("close frame {} {}", f.code, f.reason)).unwrap_or_else(|| "close frame".into());
                    return SessionEnd::Dropped(reason);
                }
                Some(Ok(other)) => tracing::trace!(kind = frame_kind(&other), "non-text frame skipped"),
            },
        }
    }
}

fn frame_kind(message: &Message) -> &'static str {
    match message {
        Message::Ping(_) => "ping",
        Message::Pong(_) => "pong",
        Message::Binary(_) => "binary",
        Message::Text(_) => "text",
        Message::Close(_) => "close",
        Message::Frame(_) => "raw",
    }
}
