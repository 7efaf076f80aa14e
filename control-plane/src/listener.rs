//! The accept loop: HTTP/1 connections (and the WebSocket upgrades on them)
//! with bounds a client without a key cannot get around.
//!
//! `axum::serve` keeps a connection that sends nothing open forever, and
//! accepts until the process runs out of file descriptors. Here:
//! - a connection must send a complete request head within the header
//!   timeout, the first one and every later one on a kept-alive connection
//!   (hyper's `header_read_timeout` restarts when a response is done), so an
//!   idle keep-alive connection is closed after it too;
//! - until its first byte arrives a connection is only a socket: hyper (and
//!   its 8 KiB read buffer) is given it once it is readable, so a flood of
//!   silent connections costs little memory;
//! - a request's body must arrive whole within the body timeout of its
//!   head ([`Deadline`]): a reader of it gets an error past that, answers,
//!   and the connection closes, so a head that promises a body and sends
//!   none holds nothing for long. Handlers authenticate a request from its
//!   head before they read its body (`app::read_body`);
//! - at most `max_connections` descriptors are held for connections at
//!   once: one per connection, upgraded control sockets included, and one
//!   more for each connection a call holds to another replica (a forwarded
//!   call, a relayed socket: [`ListenerStats::outgoing`]). At the cap the
//!   loop stops accepting: newer connections wait in the kernel's backlog (a
//!   client that waits is served as soon as a slot frees) instead of being
//!   refused, and the process never reaches its open-files limit.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use hyper::service::Service as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;

/// File descriptors left for everything but client connections (the store,
/// sandboxes' pipes and logs, outgoing calls) when the cap is derived from
/// the open-files limit: an eighth of it, at least this many.
const MIN_RESERVE: u64 = 256;
/// The cap is never derived below this.
const MIN_CAP: u64 = 16;

/// Bounds of the listener (`docs/operations.md`, "Listener limits").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// A request head (and, on a kept-alive connection, the next one) must
    /// arrive within this.
    pub header_timeout: Duration,
    /// A request's body must arrive whole within this of its head.
    pub body_timeout: Duration,
    /// Descriptors held for connections at once: every connection (control
    /// sockets included), and every connection a call holds to another
    /// replica.
    pub max_connections: usize,
    /// Control-socket upgrade requests being authenticated at once; more
    /// are answered `429` (`0`: every one is).
    pub max_pending_upgrades: usize,
}

impl ListenerLimits {
    /// The defaults: a 10 s header timeout, a 30 s body timeout, the cap
    /// derived from the open-files limit, 256 upgrades in flight.
    pub fn for_open_files(limit: u64) -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: default_max_connections(limit),
            max_pending_upgrades: 256,
        }
    }
}

/// The connection cap for an open-files limit: the limit minus a reserve
/// (an eighth, at least [`MIN_RESERVE`]).
pub fn default_max_connections(open_files: u64) -> usize {
    let reserve = (open_files / 8).max(MIN_RESERVE);
    usize::try_from(open_files.saturating_sub(reserve).max(MIN_CAP)).unwrap_or(usize::MAX)
}

/// The soft open-files limit of this process (1024 when it cannot be read).
pub fn open_files_limit() -> u64 {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).map_or(1024, |(soft, _)| soft)
}

/// Raises the soft open-files limit to the hard one and returns it: a
/// server is expected to hold many sockets, and the cap is derived from it.
pub fn raise_open_files_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(error) => {
                tracing::warn!(%error, soft, hard, "cannot raise the open-files limit; keeping the soft one");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(error) => {
            tracing::warn!(%error, "cannot read the open-files limit; assuming 1024");
            1024
        }
    }
}

/// Connections the kernel completes before they are accepted. Past it, a
/// client's handshake may complete on its side only (its final ACK
/// dropped): a connection the server never sees and so can never time out.
/// The kernel caps it at `net.core.somaxconn` (4096 by default).
const BACKLOG: u32 = 4096;

/// Binds the listener with a backlog that holds a burst of connections,
/// and those waiting at the cap.
pub fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Lets an event through at most once per period (time passed in).
#[derive(Debug)]
pub struct RateLimit {
    every: Duration,
    last: Mutex<Option<Instant>>,
}

impl RateLimit {
    pub fn new(every: Duration) -> Self {
        Self { every, last: Mutex::new(None) }
    }

    /// Whether an event at `now` may be reported.
    pub fn allow(&self, now: Instant) -> bool {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        match *last {
            Some(previous) if now.saturating_duration_since(previous) < self.every => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

/// Counters of the listener, for `/metrics`.
#[derive(Debug)]
pub struct ListenerStats {
    pub limits: ListenerLimits,
    /// Connections open now (control sockets included).
    pub open: AtomicUsize,
    /// Connections to another replica open now (under the same cap).
    pub outgoing: AtomicUsize,
    /// Times the accept loop found the cap reached and stopped accepting.
    pub cap_reached: AtomicU64,
    /// Connections closed for sending no complete request head in time.
    pub header_timeouts: AtomicU64,
    /// Request bodies that did not arrive whole within the body timeout.
    pub body_timeouts: AtomicU64,
    /// Calls refused because no slot was left for their connection to
    /// another replica.
    pub outgoing_refused: AtomicU64,
    /// Upgrade requests answered `429` because too many were in flight.
    pub upgrades_refused: AtomicU64,
    /// Bounds the upgrade requests being authenticated.
    pub(crate) upgrades: Arc<Semaphore>,
    /// One permit per descriptor a connection holds: the cap.
    slots: Arc<Semaphore>,
    cap_log: RateLimit,
}

impl ListenerStats {
    /// A place under the cap for a connection to another replica (a
    /// forwarded call, a relayed socket, a proof challenge): it holds a
    /// descriptor as a client's connection does. `None` at the cap: the
    /// caller answers `503` rather than wait, since the call it serves
    /// already holds a slot and waiting for another could deadlock the cap.
    pub(crate) fn outgoing(self: &Arc<Self>) -> Option<OutgoingSlot> {
        match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(permit) => {
                self.outgoing.fetch_add(1, Ordering::Relaxed);
                Some(OutgoingSlot { _permit: permit, stats: Arc::clone(self) })
            }
            Err(_) => {
                self.outgoing_refused.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }
}

impl ListenerStats {
    pub fn new(limits: ListenerLimits) -> Self {
        Self {
            limits,
            open: AtomicUsize::new(0),
            outgoing: AtomicUsize::new(0),
            cap_reached: AtomicU64::new(0),
            header_timeouts: AtomicU64::new(0),
            body_timeouts: AtomicU64::new(0),
            outgoing_refused: AtomicU64::new(0),
            upgrades_refused: AtomicU64::new(0),
            upgrades: Arc::new(Semaphore::new(limits.max_pending_upgrades)),
            slots: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            cap_log: RateLimit::new(Duration::from_secs(10)),
        }
    }
}

/// One connection's place under the cap. Every request of the connection
/// carries a clone (an extension), so a control socket upgraded from it
/// keeps the place until the socket closes.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionSlot {
    held: Arc<Held>,
}

/// A connection to another replica's place under the cap, freed (and
/// counted closed) on drop.
#[derive(Debug)]
pub(crate) struct OutgoingSlot {
    _permit: OwnedSemaphorePermit,
    stats: Arc<ListenerStats>,
}

impl Drop for OutgoingSlot {
    fn drop(&mut self) {
        self.stats.outgoing.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Frees the place and counts the connection closed when the last clone
/// goes.
#[derive(Debug)]
struct Held {
    _permit: OwnedSemaphorePermit,
    stats: Arc<ListenerStats>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts and serves until `shutdown` turns true, then lets each
/// connection finish its request in flight and returns.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    stats: Arc<ListenerStats>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let slots = Arc::clone(&stats.slots);
    let accept_errors = RateLimit::new(Duration::from_secs(10));
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let permit = match Arc::clone(&slots).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                stats.cap_reached.fetch_add(1, Ordering::Relaxed);
                if stats.cap_log.allow(Instant::now()) {
                    tracing::warn!(
                        max_connections = stats.limits.max_connections,
                        "connection cap reached: new connections wait in the backlog until one closes"
                    );
                }
                tokio::select! {
                    permit = Arc::clone(&slots).acquire_owned() => match permit {
                        Ok(permit) => permit,
                        Err(_) => break,
                    },
                    () = stopped(&mut shutdown) => break,
                }
            }
        };
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    if accept_errors.allow(Instant::now()) {
                        tracing::warn!(%error, "accept failed");
                    }
                    if !matches!(
                        error.kind(),
                        std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                    ) {
                        // Out of descriptors or memory: give closing
                        // connections a moment instead of spinning.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    continue;
                }
            },
            () = stopped(&mut shutdown) => break,
        };
        stats.open.fetch_add(1, Ordering::Relaxed);
        let slot = ConnectionSlot { held: Arc::new(Held { _permit: permit, stats: Arc::clone(&stats) }) };
        connections.spawn(connection(stream, slot, app.clone(), Arc::clone(&stats), shutdown.clone()));
    }
    drop(listener);
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Resolves once `shutdown` turns true (or its sender is gone).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

async fn connection(
    stream: TcpStream,
    slot: ConnectionSlot,
    app: Router,
    stats: Arc<ListenerStats>,
    mut shutdown: watch::Receiver<bool>,
) {
    let header_timeout = stats.limits.header_timeout;
    tokio::select! {
        readable = tokio::time::timeout(header_timeout, stream.readable()) => {
            if readable.is_err() {
                stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        () = stopped(&mut shutdown) => return,
    }
    // Boxed: the HTTP state machine is allocated only now, not while the
    // connection is silent.
    Box::pin(http(stream, slot, app, stats, shutdown)).await;
}

/// Serves HTTP/1 (and an upgrade) on a connection that sent something.
async fn http(
    stream: TcpStream,
    slot: ConnectionSlot,
    app: Router,
    stats: Arc<ListenerStats>,
    mut shutdown: watch::Receiver<bool>,
) {
    let header_timeout = stats.limits.header_timeout;
    let _ = stream.set_nodelay(true);
    let inner = TowerToHyperService::new(app);
    let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
        let (mut parts, body) = request.into_parts();
        parts.extensions.insert(slot.clone());
        let body = Deadline::new(body, Arc::clone(&slot.held.stats));
        inner.call(hyper::Request::from_parts(parts, axum::body::Body::new(body)))
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
    let serving = builder.serve_connection(TokioIo::new(stream), service).with_upgrades();
    tokio::pin!(serving);
    let result = tokio::select! {
        result = serving.as_mut() => result,
        () = stopped(&mut shutdown) => {
            serving.as_mut().graceful_shutdown();
            serving.await
        }
    };
    if let Err(error) = result {
        if error.is_timeout() {
            stats.header_timeouts.fetch_add(1, Ordering::Relaxed);
        } else {
            tracing::debug!(%error, "connection ended with an error");
        }
    }
}

/// A request body that must arrive whole within the body timeout of its
/// head: past it, the reader gets [`BodyTimedOut`] (the handler answers
/// `408` and hyper closes the connection, whose body was not read to its
/// end). The timer starts when the head is complete, not when a handler
/// first reads, so a handler that waits for the engine does not extend it.
#[derive(Debug)]
pub(crate) struct Deadline<B> {
    inner: B,
    expires: Pin<Box<tokio::time::Sleep>>,
    stats: Arc<ListenerStats>,
}

/// What a reader of a [`Deadline`] body gets once the body timeout passed.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?} of its head")]
pub struct BodyTimedOut(pub Duration);

impl<B> Deadline<B> {
    fn new(inner: B, stats: Arc<ListenerStats>) -> Self {
        let expires = Box::pin(tokio::time::sleep(stats.limits.body_timeout));
        Self { inner, expires, stats }
    }
}

impl<B> Body for Deadline<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        if this.expires.as_mut().poll(cx).is_ready() {
            this.stats.body_timeouts.fetch_add(1, Ordering::Relaxed);
            return Poll::Ready(Some(Err(BodyTimedOut(this.stats.limits.body_timeout).into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_a_reserve_of_an_eighth_and_at_least_256() {
        assert_eq!(default_max_connections(20_000), 17_500);
        assert_eq!(default_max_connections(1024), 768);
        assert_eq!(default_max_connections(100), 16, "never below the floor");
    }

    #[test]
    fn the_rate_limit_lets_one_event_through_per_period() {
        let limit = RateLimit::new(Duration::from_secs(10));
        let start = Instant::now();
        assert!(limit.allow(start));
        assert!(!limit.allow(start + Duration::from_secs(9)));
        assert!(limit.allow(start + Duration::from_secs(10)));
        assert!(!limit.allow(start + Duration::from_secs(11)));
    }
}
