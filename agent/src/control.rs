//! The control socket: one task owns the WebSocket (reader and writer),
//! sends heartbeats, and reconnects with jittered exponential backoff.
//!
//! The task knows nothing of the lifecycle: it reports what happened as
//! [`ControlEvent`]s and takes two inputs, the credential to connect with
//! (a change closes the current connection and reconnects at once) and the
//! state each heartbeat reports.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::{SinkExt, StreamExt};
use reqwest::Url;
use standby_protocol::{AgentMessage, AgentState, PROTOCOL_HEADER, PROTOCOL_VERSION, Secret, ServerMessage};
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::{HeaderValue, header};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message};

use crate::api::{Class, classify_status, parse_retry_after};
use crate::lifecycle::Credential;

/// Largest server message accepted. An assignment carries a workspace
/// description and environment maps; 1 MiB is far above any real one, and a
/// larger frame closes the connection (then the agent reconnects) instead of
/// growing memory without bound.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// Upper bound of the reconnect backoff.
pub const BACKOFF_CAP: Duration = Duration::from_secs(30);
/// First reconnect delay (before jitter, which adds up to as much again).
/// The 500 ms jitter window spreads a fleet dropped at once (a server
/// restart) so that about a fifth of it comes back in any 100 ms.
pub const BACKOFF_MIN: Duration = Duration::from_millis(500);
/// A connection that stayed up this long resets the backoff. A shorter one
/// does not: a server that accepts upgrades and then drops them must meet a
/// growing delay, not a reconnect every quarter second.
pub const STABLE_AFTER: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub enum ControlEvent {
    Connected(Credential),
    Message {
        credential: Credential,
        /// Boxed: an assignment is far larger than the other events.
        message: Box<ServerMessage>,
    },
    /// `401`, `403` or `410`: this credential will not be retried; the task
    /// waits for another credential.
    Refused {
        credential: Credential,
        status: u16,
    },
}

/// The credential the task connects with.
#[derive(Debug, Clone)]
pub struct Login {
    pub kind: Credential,
    pub secret: Secret,
}

/// What each heartbeat says.
pub type Status = (AgentState, Option<String>);

#[derive(Debug, Clone)]
pub struct ControlConfig {
    pub socket_url: Url,
    pub heartbeat_interval: Duration,
}

/// Spawns the connection task. It ends when `shutdown` turns true (closing
/// the socket politely) or when `events` is dropped.
pub fn spawn(
    config: ControlConfig,
    login: watch::Receiver<Login>,
    status: watch::Receiver<Status>,
    events: mpsc::Sender<ControlEvent>,
    shutdown: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(config, login, status, events, shutdown))
}

/// The reconnect delays: exponential from [`BACKOFF_MIN`], capped at
/// [`BACKOFF_CAP`], each with jitter of up to the delay itself.
pub fn backoff() -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default()
        .with_min_delay(BACKOFF_MIN)
        .with_max_delay(BACKOFF_CAP)
        .with_jitter()
        .without_max_times()
        .build()
}

enum Attempt {
    Connected(Box<Socket>),
    Refused(u16),
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
    let mut delays = backoff();
    let mut attempts = 0u32;
    loop {
        if *shutdown.borrow() {
            return;
        }
        let current = login.borrow_and_update().clone();
        attempts += 1;
        let attempt = tokio::select! {
            attempt = connect(&config.socket_url, &current.secret) => attempt,
            _ = login.changed() => {
                delays = backoff();
                continue;
            }
            _ = shutdown.changed() => return,
        };
        let delay = match attempt {
            Attempt::Connected(socket) => {
                tracing::info!(credential = ?current.kind, attempts, "control socket connected");
                attempts = 0;
                if events.send(ControlEvent::Connected(current.kind)).await.is_err() {
                    return;
                }
                let since = Instant::now();
                let end =
                    session(*socket, &config, current.kind, &mut status, &events, &mut login, &mut shutdown).await;
                if since.elapsed() >= STABLE_AFTER {
                    delays = backoff();
                }
                match end {
                    SessionEnd::Shutdown => return,
                    SessionEnd::LoginChanged => {
                        delays = backoff();
                        continue;
                    }
                    SessionEnd::Dropped(reason) => {
                        tracing::warn!(credential = ?current.kind, reason, "control socket lost; reconnecting");
                        delays.next().unwrap_or(BACKOFF_CAP)
                    }
                }
            }
            Attempt::Refused(status) => {
                tracing::warn!(credential = ?current.kind, status, "control socket refused");
                if events.send(ControlEvent::Refused { credential: current.kind, status }).await.is_err() {
                    return;
                }
                tokio::select! {
                    _ = login.changed() => {
                        delays = backoff();
                        continue;
                    }
                    _ = shutdown.changed() => return,
                }
            }
            Attempt::Transient { error, retry_after } => {
                let delay = delays.next().unwrap_or(BACKOFF_CAP).max(retry_after.unwrap_or_default());
                tracing::warn!(credential = ?current.kind, attempt = attempts, error,
                    retry_in_ms = delay.as_millis() as u64, "control socket unavailable");
                delay
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = login.changed() => delays = backoff(),
            _ = shutdown.changed() => return,
        }
    }
}

async fn connect(url: &Url, secret: &Secret) -> Attempt {
    let mut request = match url.as_str().into_client_request() {
        Ok(request) => request,
        Err(e) => return Attempt::Transient { error: e.to_string(), retry_after: None },
    };
    let Ok(mut bearer) = HeaderValue::from_str(&format!("Bearer {}", secret.expose())) else {
        // A credential that cannot be a header value can never be accepted.
        return Attempt::Refused(401);
    };
    bearer.set_sensitive(true);
    request.headers_mut().insert(header::AUTHORIZATION, bearer);
    request.headers_mut().insert(PROTOCOL_HEADER, HeaderValue::from_static(PROTOCOL_VERSION));
    let config = WebSocketConfig::default()
        .read_buffer_size(16 * 1024)
        .write_buffer_size(0)
        .max_message_size(Some(MAX_MESSAGE_BYTES))
        .max_frame_size(Some(MAX_MESSAGE_BYTES));
    let connecting = tokio_tungstenite::connect_async_tls_with_config(request, Some(config), true, None);
    match tokio::time::timeout(Duration::from_secs(20), connecting).await {
        Err(_) => Attempt::Transient { error: "connect timed out after 20s".into(), retry_after: None },
        Ok(Ok((socket, _))) => Attempt::Connected(Box::new(socket)),
        Ok(Err(tungstenite::Error::Http(response))) => {
            let status = response.status();
            match classify_status(status) {
                Class::Unauthorized | Class::Gone => Attempt::Refused(status.as_u16()),
                Class::Transient | Class::Fatal => Attempt::Transient {
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
    kind: Credential,
    status: &mut watch::Receiver<Status>,
    events: &mpsc::Sender<ControlEvent>,
    login: &mut watch::Receiver<Login>,
    shutdown: &mut watch::Receiver<bool>,
) -> SessionEnd {
    let (mut writer, mut reader) = socket.split();
    let heartbeat = |status: &watch::Receiver<Status>| {
        let (state, execution_id) = status.borrow().clone();
        Message::text(AgentMessage::Heartbeat { state, execution_id }.encode())
    };
    if let Err(e) = writer.send(heartbeat(status)).await {
        return SessionEnd::Dropped(format!("sending the first heartbeat: {e}"));
    }
    let mut ticker = tokio::time::interval_at(Instant::now() + config.heartbeat_interval, config.heartbeat_interval);
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
