//! `GET /ws`: the upgrade decision and one task per accepted connection.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, rejection::WebSocketUpgradeRejection};
use axum::http::HeaderMap;
use axum::response::Response;
use tokio::sync::mpsc;
use tokio::time::{Instant, Interval, MissedTickBehavior};

use super::calls::HttpAnswer;
use super::http::respond;
use super::records::CloseCause;
use super::setup::Frame;
use super::state::{Command, Holder, Shared};

/// Server messages are a few hundred bytes (an assignment carries a run and
/// a workspace) and heartbeats less than one hundred, so a small read buffer
/// is plenty.
const READ_BUFFER: usize = 16 * 1024;
/// Anything the agent may legally send is far below this; a larger message
/// fails the connection instead of making the test server hold it.
const MAX_MESSAGE: usize = 256 * 1024;
/// How long the server waits for the agent to answer its close frame before
/// it drops the connection, as a production server would.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

pub(crate) async fn upgrade(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    match (shared.update(|inner| inner.upgrade(&headers, upgrade.is_ok())), upgrade) {
        (Err(refused), _) => respond(refused),
        (Ok(holder), Ok(upgrade)) => {
            let failed = Arc::clone(&shared);
            upgrade
                .read_buffer_size(READ_BUFFER)
                // Written at once: a test that sends a frame expects it on the
                // wire, not in a buffer waiting for more.
                .write_buffer_size(0)
                .max_message_size(MAX_MESSAGE)
                .max_frame_size(MAX_MESSAGE)
                .on_failed_upgrade(move |error| {
                    failed.update(|inner| inner.violation(format!("WebSocket upgrade failed: {error}")));
                })
                .on_upgrade(move |socket| connection(shared, socket, holder))
        }
        (Ok(_), Err(rejection)) => respond(HttpAnswer::error(400, &rejection.to_string())),
    }
}

fn to_message(frame: Frame) -> Message {
    match frame {
        Frame::Text(text) => Message::Text(text.into()),
        Frame::Binary(bytes) => Message::Binary(Bytes::from(bytes)),
        Frame::Ping(bytes) => Message::Ping(Bytes::from(bytes)),
        Frame::Pong(bytes) => Message::Pong(Bytes::from(bytes)),
        Frame::Close(frame) => Message::Close(frame.map(|(code, reason)| CloseFrame { code, reason: reason.into() })),
    }
}

fn pinger(every: Option<Duration>) -> Option<Interval> {
    every.map(|every| {
        let mut interval = tokio::time::interval_at(Instant::now() + every, every);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        interval
    })
}

async fn tick(pinger: &mut Option<Interval>) {
    match pinger {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

async fn connection(shared: Arc<Shared>, mut socket: WebSocket, holder: Holder) {
    let (sender, mut commands) = mpsc::unbounded_channel();
    let (id, ping) = shared.update(|inner| (inner.register(&holder, sender), inner.faults.ping_interval));
    let mut pinger = pinger(ping);
    // Set by the first close frame either side sends; the loop then keeps
    // reading so the close handshake completes.
    let mut closing: Option<CloseCause> = None;
    let mut failed: Option<String> = None;
    let mut close_deadline: Option<Instant> = None;
    while failed.is_none() {
        tokio::select! {
            incoming = socket.recv() => match incoming {
                None => break,
                Some(Err(error)) => failed = Some(error.to_string()),
                Some(Ok(Message::Text(text))) => shared.update(|inner| inner.text_received(id, text.as_str())),
                Some(Ok(Message::Binary(bytes))) => shared.update(|inner| {
                    inner.violation(format!("{id} sent a binary frame of {} bytes", bytes.len()));
                }),
                // tungstenite answers pings itself.
                Some(Ok(Message::Ping(_))) => {}
                Some(Ok(Message::Pong(_))) => shared.update(|inner| inner.pong(id)),
                Some(Ok(Message::Close(frame))) => {
                    closing.get_or_insert(CloseCause::ClientClose(frame.map(|frame| frame.code)));
                }
            },
            command = commands.recv() => match command {
                None => {
                    closing = Some(CloseCause::ServerShutdown);
                    break;
                }
                Some(Command::Drop) => {
                    closing = Some(CloseCause::ServerDrop);
                    break;
                }
                Some(Command::PingEvery(every)) => pinger = self::pinger(every),
                Some(Command::Send(frame)) => {
                    let is_close = matches!(frame, Frame::Close(_));
                    match socket.send(to_message(frame)).await {
                        Ok(()) if is_close => {
                            closing.get_or_insert(CloseCause::ServerClose);
                            close_deadline = Some(Instant::now() + CLOSE_GRACE);
                        }
                        Ok(()) => {}
                        Err(error) => failed = Some(error.to_string()),
                    }
                }
            },
            () = sleep_until(close_deadline) => break,
            () = tick(&mut pinger) => {
                if let Err(error) = socket.send(Message::Ping(Bytes::new())).await {
                    failed = Some(error.to_string());
                }
            }
        }
    }
    let cause = closing.unwrap_or_else(|| {
        CloseCause::ClientGone(failed.unwrap_or_else(|| "stream ended without a close frame".to_owned()))
    });
    shared.update(|inner| inner.closed(id, cause));
}
