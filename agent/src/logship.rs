//! Ships the run's terminal output to `POST /v1/executions/{id}/log`
//! without ever holding the run up, and without losing output silently.
//!
//! A spooler thread reads the output as the terminal delivers it, redacts
//! it and appends it to a spool: a ring of `bound` bytes in an unlinked
//! file (default [`SPOOL_BOUND`], 64 MiB). It waits on nothing but the disk,
//! so the terminal is drained at the run's pace whatever the server does.
//! A sender posts chunks from the spool one at a time, strictly in order,
//! retrying transient failures with backoff for as long as it takes.
//! [`spool_index::SpoolIndex`] keeps the books (offsets, spool positions, gaps);
//! this module does the IO around it.
//!
//! - Spool full of unsent bytes: the newest bytes are dropped; the next
//!   chunk carries `dropped` and its true `offset` (amendment 6).
//! - `409` with `{"received": n}`: sending resumes from `n`, from the spool
//!   if it still holds those bytes, else with the gap as `dropped`.
//! - `401`/`403`/`410`: the credential was revoked; nothing more is sent.
//! - Any other refusal: that chunk is given up; the next reports it as
//!   `dropped`.
//! - Once the output has ended, the sender gives up when `drain` (default
//!   [`DRAIN_BOUND`], 30 s) passes without progress (a chunk acknowledged,
//!   or a `409` telling the server's count; [`drain::Drain`]): a dead log
//!   endpoint cannot hold the run's final event forever, and a server that
//!   restarts (even twice) while the rest drains still gets the whole log.
//!   What was never acknowledged is counted in the report's `lost_bytes`,
//!   which the final event carries as `log_lost`.
//! - A chunk unanswered for `attempt` (default [`ATTEMPT_BOUND`], 10 s) is
//!   sent again on a new connection (a client with a pool of its own,
//!   [`Api::fresh`]: another idle connection of the old pool may be as
//!   dead): one that died without a reset (the
//!   sandbox's network was cut and came back, as a container's can) would
//!   otherwise hold it until the client's read timeout, past the drain
//!   bound, and the end of the output would be lost though the server is
//!   reachable again.

mod drain;
mod spool_index;
mod store;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use backon::BackoffBuilder;
use standby_protocol::{Answer, LogChunk, LogReceived, Secret, paths};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use self::drain::Drain;
use self::spool_index::{Chunk, SpoolIndex};
use self::store::Store;
use crate::api::{self, Api};
use crate::redact::Redactor;

/// Largest chunk of output per request (before base64): few requests for a
/// chatty run, and a retry re-sends little.
pub const MAX_BATCH: usize = 64 * 1024;

/// How long the first unsent byte waits for more before a chunk goes out
/// anyway, so a quiet run's output still shows up promptly.
pub const FLUSH_AFTER: Duration = Duration::from_millis(100);

/// Default spool bound: output the server has not acknowledged beyond this
/// is dropped (and reported as `dropped`).
pub const SPOOL_BOUND: u64 = 64 * 1024 * 1024;

/// Default time the sender may go without progress, once the output
/// ended, before it gives up on the rest and the run's final event is
/// reported anyway.
pub const DRAIN_BOUND: Duration = Duration::from_secs(30);

/// Default time one chunk's request may go unanswered before the chunk is
/// sent again on a new connection.
pub const ATTEMPT_BOUND: Duration = Duration::from_secs(10);

/// Where and how much to spool, how long to drain, and how long one
/// request may take.
#[derive(Debug, Clone)]
pub struct ShipConfig {
    /// Directory of the spool file (the workspace's `.standby/`).
    pub spool_dir: PathBuf,
    pub bound: u64,
    pub drain: Duration,
    pub attempt: Duration,
}

/// What happened to the run's output.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShipReport {
    /// Bytes of the redacted output the server acknowledged.
    pub bytes: u64,
    /// Chunks the server acknowledged.
    pub chunks: u64,
    /// Bytes of the redacted output the server never got: dropped at the
    /// spool, refused, or unsent when shipping ended.
    pub lost_bytes: u64,
    /// `409` answers that moved the sender to the server's count.
    pub resyncs: u64,
}

/// The spool and its books, shared by the spooler and the sender.
struct Spool {
    index: SpoolIndex,
    store: Store,
    /// The output has ended.
    closed: bool,
    /// When the oldest unsent byte arrived.
    pending_since: Option<Instant>,
    /// Dropping at the spool right now (logged once per episode).
    overflowing: bool,
}

struct Shared {
    spool: Mutex<Spool>,
    /// Wakes the sender: new output, or its end.
    wake: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Spool> {
        self.spool.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Reads `output` until it closes, redacted with `redactor`, and ships it
/// as described in the module documentation. Returns once everything was
/// acknowledged or given up on.
pub async fn ship(
    api: Api,
    credential: Secret,
    execution_id: String,
    output: mpsc::Receiver<Vec<u8>>,
    redactor: Redactor,
    config: ShipConfig,
) -> ShipReport {
    let store =
        Store::open(&config.spool_dir, &format!("log-spool-{execution_id}-{}", std::process::id()), config.bound);
    let shared = Arc::new(Shared {
        spool: Mutex::new(Spool {
            index: SpoolIndex::new(config.bound),
            store,
            closed: false,
            pending_since: None,
            overflowing: false,
        }),
        wake: Notify::new(),
    });
    let spooler = {
        let (shared, execution_id) = (Arc::clone(&shared), execution_id.clone());
        tokio::task::spawn_blocking(move || spool_output(output, redactor, &shared, &execution_id))
    };
    let sender = Sender { path: paths::log(&execution_id), api, credential, execution_id, shared };
    let report = sender.run(config.drain, config.attempt).await;
    // The spooler ends with the output; after a give-up it only drops.
    drop(spooler);
    report
}

/// The spooler: reads the output until it closes and appends it, redacted.
fn spool_output(mut output: mpsc::Receiver<Vec<u8>>, mut redactor: Redactor, shared: &Shared, execution_id: &str) {
    while let Some(data) = output.blocking_recv() {
        append(shared, &redactor.push(&data), execution_id);
    }
    append(shared, &redactor.finish(), execution_id);
    shared.lock().closed = true;
    shared.wake.notify_one();
}

fn append(shared: &Shared, data: &[u8], execution_id: &str) {
    if data.is_empty() {
        return;
    }
    let mut guard = shared.lock();
    let spool = &mut *guard;
    let placement = spool.index.push(data.len() as u64);
    if placement.keep > 0 {
        let kept = &data[..usize::try_from(placement.keep).unwrap_or(data.len())];
        if let Err(error) = spool.store.write(placement.at, kept) {
            tracing::warn!(execution_id, %error, bytes = kept.len(), "cannot spool the run's output; these bytes are dropped");
            spool.index.unwrite(&placement);
        }
    }
    match (placement.dropped > 0, spool.overflowing) {
        (true, false) => {
            spool.overflowing = true;
            tracing::warn!(
                execution_id,
                bound = spool.index.bound(),
                at = spool.index.end() - placement.dropped,
                "the log spool is full of output the server has not acknowledged; dropping the newest output"
            );
        }
        (false, true) => spool.overflowing = false,
        _ => {}
    }
    if spool.pending_since.is_none() {
        spool.pending_since = Some(Instant::now());
    }
    drop(guard);
    shared.wake.notify_one();
}

/// What the sender does next.
enum Step {
    /// Nothing due: wait for more output, or until `Some(at)`.
    Wait(Option<Instant>),
    Send(Chunk, Vec<u8>),
    Done,
}

/// Posts chunks from the spool, in order, and keeps the report.
struct Sender {
    api: Api,
    credential: Secret,
    execution_id: String,
    path: String,
    shared: Arc<Shared>,
}

impl Sender {
    async fn run(&self, drain_bound: Duration, attempt_bound: Duration) -> ShipReport {
        let mut report = ShipReport::default();
        let mut gaps = 0;
        let mut delays = api::call_backoff().build();
        let mut drain = Drain::new(drain_bound);
        let mut revoked = false;
        // Replaced by one with a pool of its own after an unanswered try.
        let mut api = self.api.clone();
        let execution_id = self.execution_id.as_str();
        loop {
            let step = self.step(revoked, &mut drain);
            let (chunk, data) = match step {
                Step::Done => break,
                Step::Wait(at) => {
                    tokio::select! {
                        () = self.shared.wake.notified() => {}
                        () = sleep_until(at) => {}
                    }
                    continue;
                }
                Step::Send(chunk, data) => (chunk, data),
            };
            let body = LogChunk::after_gap(chunk.offset, chunk.dropped, &data);
            let attempt = api.post_or_conflict::<_, LogReceived>(&self.credential, &self.path, &body);
            let Some(answered) = within(drain.deadline(), tokio::time::timeout(attempt_bound, attempt)).await else {
                break;
            };
            // Dropping the request closes its connection: the next try
            // opens another.
            let Ok(result) = answered else {
                tracing::info!(execution_id, offset = chunk.offset, bound = ?attempt_bound, "a log chunk was not answered in time; sent again");
                api = api.fresh();
                continue;
            };
            match result {
                Ok(None) => {
                    let mut spool = self.shared.lock();
                    spool.index.ack(&chunk);
                    if spool.index.next(1).is_none() {
                        spool.pending_since = None;
                    }
                    drop(spool);
                    drain.progressed(Instant::now());
                    report.chunks += 1;
                    report.bytes += chunk.len;
                    gaps += chunk.dropped;
                    delays = api::call_backoff().build();
                }
                Ok(Some(LogReceived { received })) if received == chunk.offset - chunk.dropped => {
                    // The server agrees with our count and still refuses.
                    tracing::warn!(
                        execution_id,
                        offset = chunk.offset,
                        received,
                        "the server refused a chunk at its own count; it is reported as dropped"
                    );
                    self.shared.lock().index.give_up(&chunk);
                }
                Ok(Some(LogReceived { received })) => {
                    tracing::info!(
                        execution_id,
                        offset = chunk.offset,
                        received,
                        "the server holds another part of the log; resuming from its count"
                    );
                    self.shared.lock().index.resync(received);
                    drain.progressed(Instant::now());
                    report.resyncs += 1;
                }
                Err(error) => match error.answer() {
                    Answer::Transient => {
                        let delay = delays.next().unwrap_or(Duration::from_secs(5));
                        tracing::debug!(execution_id, offset = chunk.offset, %error, ?delay, "log chunk not acknowledged; retrying");
                        if within(drain.deadline(), tokio::time::sleep(delay)).await.is_none() {
                            break;
                        }
                    }
                    Answer::Refused(_) => {
                        tracing::warn!(execution_id, offset = chunk.offset, %error, "the run credential was refused; discarding the rest of the run's output");
                        revoked = true;
                    }
                    Answer::Success | Answer::Fatal => {
                        tracing::warn!(execution_id, offset = chunk.offset, bytes = chunk.len, %error, "the server refused a chunk of the run's output; it is reported as dropped");
                        self.shared.lock().index.give_up(&chunk);
                    }
                },
            }
        }
        let index = &self.shared.lock().index;
        report.lost_bytes = gaps + index.outstanding();
        if index.outstanding() > 0 && !revoked {
            tracing::warn!(
                execution_id,
                unsent = index.outstanding(),
                bound = ?drain_bound,
                "the log made no progress for the drain bound; the rest is given up"
            );
        }
        tracing::debug!(
            execution_id,
            bytes = report.bytes,
            chunks = report.chunks,
            lost_bytes = report.lost_bytes,
            resyncs = report.resyncs,
            "run output shipped"
        );
        report
    }

    /// Decides the next step under the lock; reads a due chunk's bytes.
    fn step(&self, revoked: bool, drain: &mut Drain) -> Step {
        let mut spool = self.shared.lock();
        let now = Instant::now();
        if spool.closed {
            drain.output_ended(now);
        }
        if revoked {
            return if spool.closed { Step::Done } else { Step::Wait(None) };
        }
        let Some(chunk) = spool.index.next(MAX_BATCH as u64) else {
            return if spool.closed { Step::Done } else { Step::Wait(None) };
        };
        let flush_at = spool.pending_since.map(|since| since + FLUSH_AFTER);
        let due = spool.closed || chunk.len >= MAX_BATCH as u64 || flush_at.is_none_or(|at| now >= at);
        if !due {
            return Step::Wait(flush_at);
        }
        match spool.store.read(chunk.at, usize::try_from(chunk.len).unwrap_or(MAX_BATCH)) {
            Ok(data) => Step::Send(chunk, data),
            Err(error) => {
                tracing::warn!(execution_id = self.execution_id, %error, offset = chunk.offset, "cannot read the log spool; the chunk is reported as dropped");
                spool.index.give_up(&chunk);
                Step::Wait(Some(now))
            }
        }
    }
}

/// `future`, cut off at `deadline` when there is one (`None` then).
async fn within<F: Future>(deadline: Option<Instant>, future: F) -> Option<F::Output> {
    match deadline {
        Some(at) => tokio::time::timeout_at(at, future).await.ok(),
        None => Some(future.await),
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use axum::Json;
    use axum::extract::{ConnectInfo, Path, State};
    use axum::http::{HeaderMap, StatusCode, header};
    use axum::response::{IntoResponse, Response};
    use standby_protocol::log_chunk::{self, Verdict};
    use standby_protocol::{PROTOCOL_HEADER, PROTOCOL_VERSION};

    use super::*;

    const TOKEN: &str = "run-token";
    const EXECUTION: &str = "exe_1";

    /// A status forced on request number `n` (from 0) carrying `chunk`,
    /// instead of the log's own rules.
    type Fault = dyn Fn(usize, &LogChunk) -> Option<StatusCode> + Send + Sync;

    #[derive(Default)]
    struct Received {
        /// Every request that passed the checks, in arrival order.
        requests: Vec<LogChunk>,
        /// The ones appended.
        accepted: Vec<LogChunk>,
        /// The log's bytes, gaps left out.
        log: Vec<u8>,
        /// The log's length, gaps included: what a `409` reports.
        length: u64,
        /// `(offset, dropped)` of every recorded gap.
        gaps: Vec<(u64, u64)>,
        /// Requests with the wrong credential, header or execution.
        malformed: usize,
    }

    /// Whether request number `n` (from 0, every arrival counted) is left
    /// unanswered forever (a dead connection).
    type Stall = dyn Fn(usize) -> bool + Send + Sync;

    #[derive(Clone)]
    struct Server {
        received: Arc<Mutex<Received>>,
        fault: Arc<Fault>,
        stall: Arc<Stall>,
        /// Requests that arrived, stalled ones included.
        arrivals: Arc<AtomicUsize>,
        /// Every client connection seen, and those whose requests go
        /// unanswered from now on (a connection whose packets are dropped).
        peers: Arc<Mutex<HashSet<SocketAddr>>>,
        dead: Arc<Mutex<HashSet<SocketAddr>>>,
        /// Empty chunks at offset 0 wait here until `WARM` of them are in,
        /// so each holds a pooled connection of its own.
        warm: Arc<tokio::sync::Barrier>,
    }

    /// Connections [`warm_pool`] leaves idle in the client's pool.
    const WARM: usize = 6;

    /// The contract's log endpoint: every chunk judged by the ledger rule
    /// every server shares (`log_chunk::accept`, amendment 6).
    async fn receive(
        State(server): State<Server>,
        ConnectInfo(peer): ConnectInfo<SocketAddr>,
        Path(execution): Path<String>,
        headers: HeaderMap,
        Json(chunk): Json<LogChunk>,
    ) -> Response {
        server.peers.lock().expect("lock is not poisoned").insert(peer);
        if server.dead.lock().expect("lock is not poisoned").contains(&peer) {
            return std::future::pending().await;
        }
        if chunk.offset == 0 && chunk.data.is_empty() {
            server.warm.wait().await;
            return StatusCode::OK.into_response();
        }
        if (server.stall)(server.arrivals.fetch_add(1, Ordering::SeqCst)) {
            return std::future::pending().await;
        }
        let mut received = server.received.lock().expect("lock is not poisoned");
        let bearer = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        let protocol = headers.get(PROTOCOL_HEADER).and_then(|v| v.to_str().ok());
        if bearer != Some(&format!("Bearer {TOKEN}")) || protocol != Some(PROTOCOL_VERSION) || execution != EXECUTION {
            received.malformed += 1;
            return StatusCode::BAD_REQUEST.into_response();
        }
        let fault = (server.fault)(received.requests.len(), &chunk);
        received.requests.push(chunk.clone());
        if let Some(status) = fault {
            return status.into_response();
        }
        let data = chunk.bytes().expect("base64 data");
        match log_chunk::accept(received.length, chunk.offset, chunk.dropped, data.len() as u64) {
            Verdict::Append { gap, skip, end } => {
                if gap > 0 {
                    let at = received.length;
                    received.gaps.push((at, gap));
                }
                received.log.extend(&data[usize::try_from(skip).expect("a chunk's length fits")..]);
                received.length = end;
                received.accepted.push(chunk);
                StatusCode::OK.into_response()
            }
            Verdict::Duplicate => StatusCode::OK.into_response(),
            Verdict::Conflict => {
                (StatusCode::CONFLICT, Json(LogReceived { received: received.length })).into_response()
            }
        }
    }

    /// A log endpoint on 127.0.0.1, and an `Api` pointing at it.
    async fn serve(fault: impl Fn(usize, &LogChunk) -> Option<StatusCode> + Send + Sync + 'static) -> (Api, Server) {
        serve_stalling(fault, |_| false).await
    }

    /// [`serve`], leaving the requests `stall` picks unanswered.
    async fn serve_stalling(
        fault: impl Fn(usize, &LogChunk) -> Option<StatusCode> + Send + Sync + 'static,
        stall: impl Fn(usize) -> bool + Send + Sync + 'static,
    ) -> (Api, Server) {
        // reqwest is built without a default crypto provider; the agent's
        // main installs one, tests do it here (a second install is refused,
        // which is fine).
        crate::api::install_tls_provider();
        let server = Server {
            received: Arc::default(),
            fault: Arc::new(fault),
            stall: Arc::new(stall),
            arrivals: Arc::default(),
            peers: Arc::default(),
            dead: Arc::default(),
            warm: Arc::new(tokio::sync::Barrier::new(WARM)),
        };
        let app = axum::Router::new().route(paths::LOG_ROUTE, axum::routing::post(receive)).with_state(server.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
        let address = listener.local_addr().expect("bound address");
        tokio::spawn(
            async move { axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await },
        );
        let base = reqwest::Url::parse(&format!("http://{address}")).expect("a valid URL");
        // The agent's own trust store, built once: a fresh client (after an
        // unanswered try) reuses it, as in the agent, instead of loading the
        // system's roots again.
        let tls = crate::tls::client_config(None).expect("the system's trust store");
        (Api::with_tls(&base, tls, false).expect("an HTTP client"), server)
    }

    /// Feeds `items` into an output channel holding at most one item, as
    /// the run's terminal would, and closes it. The task ends when every
    /// item was taken.
    fn produce(items: Vec<Vec<u8>>) -> (mpsc::Receiver<Vec<u8>>, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(1);
        let producer = tokio::spawn(async move {
            for item in items {
                tx.send(item).await.expect("the shipper reads until the output closes");
            }
        });
        (rx, producer)
    }

    fn config(dir: &tempfile::TempDir, bound: u64, drain: Duration) -> ShipConfig {
        ShipConfig { spool_dir: dir.path().to_path_buf(), bound, drain, attempt: ATTEMPT_BOUND }
    }

    async fn ship_items(api: Api, items: Vec<Vec<u8>>, secrets: &[&str], config: ShipConfig) -> ShipReport {
        let redactor = Redactor::new(secrets.iter().copied());
        ship(api, Secret::new(TOKEN), EXECUTION.into(), produce(items).0, redactor, config).await
    }

    fn tempdir() -> tempfile::TempDir {
        tempfile::tempdir().expect("a temporary directory")
    }

    fn received(server: &Server) -> std::sync::MutexGuard<'_, Received> {
        server.received.lock().expect("lock is not poisoned")
    }

    #[tokio::test]
    async fn ships_the_redacted_output_in_order() {
        let (api, server) = serve(|_, _| None).await;
        let big: Vec<u8> =
            (0..150_000u32).map(|i| if i % 5000 == 7 { b'\xff' } else { b'a' + (i % 26) as u8 }).collect();
        let items = vec![
            b"login with hun".to_vec(),
            b"ter2 now\r\n".to_vec(),
            big,
            b"token=hunter2&x".to_vec(),
            b"{\"pw\":\"hunter2\"} end hun".to_vec(),
        ];
        let input = items.concat();
        let dir = tempdir();
        let report = ship_items(api, items, &["hunter2"], config(&dir, SPOOL_BOUND, DRAIN_BOUND)).await;

        let received = received(&server);
        assert_eq!(received.malformed, 0, "every request has the bearer credential and protocol header");
        assert!(received.gaps.is_empty());
        let log = &received.log;
        let mut redactor = Redactor::new(["hunter2"]);
        let mut expected = redactor.push(&input);
        expected.extend(redactor.finish());
        assert_eq!(log, &expected);
        assert!(log.starts_with(b"login with [REDACTED] now\r\n"), "the secret split across two items is redacted");
        assert!(!log.windows(7).any(|w| w == b"hunter2"));
        assert!(log.ends_with(b"end hun"), "the held-back tail is sent at the end");
        assert!(received.accepted.len() >= 3, "150 KB need three chunks of 64 KiB");
        assert!(received.accepted.iter().all(|c| c.bytes().expect("base64").len() <= MAX_BATCH));
        assert_eq!(
            report,
            ShipReport { bytes: log.len() as u64, chunks: received.accepted.len() as u64, lost_bytes: 0, resyncs: 0 }
        );
    }

    #[tokio::test]
    async fn a_retried_chunk_keeps_its_offset() {
        let (api, server) = serve(|n, _| (n < 2).then_some(StatusCode::SERVICE_UNAVAILABLE)).await;
        let items = vec![vec![b'x'; MAX_BATCH], b"tail".to_vec()];
        let dir = tempdir();
        let report = ship_items(api, items.clone(), &[], config(&dir, SPOOL_BOUND, DRAIN_BOUND)).await;

        let received = received(&server);
        assert_eq!(received.log, items.concat());
        let first = &received.requests[..3];
        assert!(first.iter().all(|c| c == &first[0]), "two retries of the first chunk, with its offset and data");
        assert_eq!(first[0].offset, 0);
        assert_eq!(report.bytes, MAX_BATCH as u64 + 4);
        assert_eq!(report.lost_bytes, 0);
    }

    /// The run's output is taken at once while the server fails, and
    /// everything arrives once it recovers: the terminal never waits for
    /// the log.
    #[tokio::test]
    async fn an_outage_never_holds_the_output_back_and_loses_nothing() {
        let outage = Arc::new(AtomicBool::new(true));
        let (api, server) = serve({
            let outage = Arc::clone(&outage);
            move |_, _| outage.load(Ordering::SeqCst).then_some(StatusCode::SERVICE_UNAVAILABLE)
        })
        .await;
        let items: Vec<Vec<u8>> = (0..64u8).map(|i| vec![b'a' + i % 26; MAX_BATCH]).collect();
        let expected = items.concat();
        let (output, producer) = produce(items);
        let dir = tempdir();
        let shipping = tokio::spawn(ship(
            api,
            Secret::new(TOKEN),
            EXECUTION.into(),
            output,
            Redactor::new(std::iter::empty()),
            config(&dir, SPOOL_BOUND, DRAIN_BOUND),
        ));
        producer.await.expect("the producer does not panic");
        assert!(received(&server).accepted.is_empty(), "4 MiB were taken while the server accepted nothing");
        outage.store(false, Ordering::SeqCst);
        let report = shipping.await.expect("shipping does not panic");
        let received = received(&server);
        assert!(received.log == expected, "the log is complete and in order ({} bytes)", received.log.len());
        assert_eq!(report.lost_bytes, 0);
    }

    #[tokio::test]
    async fn a_chunk_left_unanswered_is_sent_again_and_the_log_arrives_whole_within_the_drain_bound() {
        let (api, server) = serve_stalling(|_, _| None, |n| n == 0).await;
        let dir = tempdir();
        let items = vec![b"first line\n".to_vec(), b"second line\n".to_vec()];
        // Without the attempt bound the first request would hold the chunk
        // until the drain bound ended the shipping, the output lost.
        let config = ShipConfig { attempt: Duration::from_millis(200), ..config(&dir, SPOOL_BOUND, DRAIN_BOUND) };
        let report = ship_items(api, items.clone(), &[], config).await;
        assert!(received(&server).log == items.concat(), "the whole output arrived");
        assert_eq!(report.lost_bytes, 0);
    }

    /// A server that goes away twice while the rest of the log drains (a
    /// restart, a short success, another restart), for longer in all than
    /// the drain bound but each time for less, still gets the whole log:
    /// the bound counts time without progress. Each outage is `STALLS`
    /// requests left unanswered for the attempt bound: at least 1.2 s,
    /// 2.4 s in all, past the 2 s bound.
    #[tokio::test]
    async fn two_outages_longer_in_all_than_the_drain_bound_lose_nothing() {
        const STALLS: usize = 6;
        // Requests 0..6 stall, 6 is answered (the first chunk), 7..13
        // stall, the rest are answered.
        let (api, server) =
            serve_stalling(|_, _| None, |n| n < STALLS || (STALLS + 1..2 * STALLS + 1).contains(&n)).await;
        let dir = tempdir();
        let items = vec![vec![b'a'; MAX_BATCH], vec![b'b'; MAX_BATCH], b"the end\n".to_vec()];
        let config =
            ShipConfig { attempt: Duration::from_millis(200), ..config(&dir, SPOOL_BOUND, Duration::from_secs(2)) };
        let report = ship_items(api, items.clone(), &[], config).await;
        assert!(server.arrivals.load(Ordering::SeqCst) > 2 * STALLS + 1, "both outages were sat out");
        assert!(received(&server).log == items.concat(), "the whole output arrived");
        assert_eq!(report.lost_bytes, 0);
    }

    /// Leaves [`WARM`] idle connections in `api`'s pool (requests held
    /// until all of them arrived, so none is reused by another).
    async fn warm_pool(api: &Api) {
        let empty = LogChunk::new(0, b"");
        let (path, token) = (paths::log(EXECUTION), Secret::new(TOKEN));
        let posts = (0..WARM).map(|_| api.post_or_conflict::<_, LogReceived>(&token, &path, &empty));
        for answer in futures::future::join_all(posts).await {
            answer.expect("a warm-up request is answered");
        }
    }

    /// The client's idle pooled connections all die silently (a sandbox
    /// cut from its network and connected again): more of them than the
    /// drain bound has attempt bounds. The chunk unanswered on the first is
    /// sent again on a new connection, not on the next dead one, and the
    /// whole log arrives.
    #[tokio::test]
    async fn a_pool_of_dead_connections_costs_one_attempt_not_the_log() {
        let (api, server) = serve(|_, _| None).await;
        warm_pool(&api).await;
        let peers = server.peers.lock().expect("lock is not poisoned").clone();
        assert_eq!(peers.len(), WARM, "one connection per warm-up request");
        *server.dead.lock().expect("lock is not poisoned") = peers;
        let dir = tempdir();
        let items = vec![b"first line\n".to_vec(), b"second line\n".to_vec()];
        // Six dead connections at 300 ms each outlast the 1 s bound.
        let config =
            ShipConfig { attempt: Duration::from_millis(300), ..config(&dir, SPOOL_BOUND, Duration::from_secs(1)) };
        let report = ship_items(api, items.clone(), &[], config).await;
        assert!(received(&server).log == items.concat(), "the whole output arrived");
        assert_eq!(report.lost_bytes, 0);
    }

    #[tokio::test]
    async fn a_dead_endpoint_is_given_up_after_the_drain_bound() {
        let (api, server) = serve(|_, _| Some(StatusCode::SERVICE_UNAVAILABLE)).await;
        let dir = tempdir();
        let items = vec![vec![b'x'; MAX_BATCH + 100]];
        let report = ship_items(api, items, &[], config(&dir, SPOOL_BOUND, Duration::from_millis(300))).await;
        assert!(received(&server).requests.len() >= 2, "the chunk was retried");
        assert_eq!(report, ShipReport { bytes: 0, chunks: 0, lost_bytes: MAX_BATCH as u64 + 100, resyncs: 0 });
    }

    #[tokio::test]
    async fn an_overflowing_spool_drops_the_newest_bytes_and_reports_the_gap() {
        let outage = Arc::new(AtomicBool::new(true));
        let (api, server) = serve({
            let outage = Arc::clone(&outage);
            move |_, _| outage.load(Ordering::SeqCst).then_some(StatusCode::SERVICE_UNAVAILABLE)
        })
        .await;
        let bound = 100_000u64;
        let items: Vec<Vec<u8>> = (0..30u8).map(|i| vec![b'a' + i % 26; 10_000]).collect();
        let expected = items.concat();
        let (output_tx, output) = mpsc::channel(1);
        let dir = tempdir();
        let shipping = tokio::spawn(ship(
            api,
            Secret::new(TOKEN),
            EXECUTION.into(),
            output,
            Redactor::new(std::iter::empty()),
            config(&dir, bound, DRAIN_BOUND),
        ));
        for item in items {
            output_tx.send(item).await.expect("the shipper reads");
        }
        outage.store(false, Ordering::SeqCst);
        // The spooled bytes are acknowledged, then more output comes.
        while received(&server).length < bound {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let tail = b"after the outage".to_vec();
        output_tx.send(tail.clone()).await.expect("the shipper reads");
        drop(output_tx);
        let report = shipping.await.expect("shipping does not panic");

        let received = received(&server);
        let lost = expected.len() as u64 - bound;
        assert_eq!(received.gaps, [(bound, lost)], "one gap, where the spool was full");
        let mut log = expected[..bound as usize].to_vec();
        log.extend(&tail);
        assert!(received.log == log, "the oldest output and what came after the gap arrived");
        assert_eq!(received.length, expected.len() as u64 + tail.len() as u64, "offsets are the true ones");
        assert_eq!(report.lost_bytes, lost);
    }

    #[tokio::test]
    async fn a_409_resyncs_from_the_spool() {
        let (api, server) = serve(|_, _| None).await;
        let dir = tempdir();
        let (output_tx, output) = mpsc::channel(1);
        let shipping = tokio::spawn(ship(
            api,
            Secret::new(TOKEN),
            EXECUTION.into(),
            output,
            Redactor::new(std::iter::empty()),
            config(&dir, SPOOL_BOUND, DRAIN_BOUND),
        ));
        let first: Vec<u8> = (0..10_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        output_tx.send(first.clone()).await.expect("the shipper reads");
        while received(&server).length < first.len() as u64 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        {
            // The server loses the last 4000 bytes it acknowledged.
            let mut received = received(&server);
            received.log.truncate(6000);
            received.length = 6000;
        }
        output_tx.send(b"second part".to_vec()).await.expect("the shipper reads");
        drop(output_tx);
        let report = shipping.await.expect("shipping does not panic");

        let received = received(&server);
        let mut expected = first;
        expected.extend(b"second part");
        assert!(received.log == expected, "the lost bytes were sent again from the spool");
        assert!(received.gaps.is_empty());
        assert_eq!(report.resyncs, 1);
        assert_eq!(report.lost_bytes, 0);
    }

    #[tokio::test]
    async fn a_409_past_the_spool_reports_a_gap() {
        let (api, server) = serve(|_, _| None).await;
        let dir = tempdir();
        let (output_tx, output) = mpsc::channel(1);
        let bound = 1000;
        let shipping = tokio::spawn(ship(
            api,
            Secret::new(TOKEN),
            EXECUTION.into(),
            output,
            Redactor::new(std::iter::empty()),
            config(&dir, bound, DRAIN_BOUND),
        ));
        // Two rounds fill the spool; the third makes room by releasing the
        // first, which the sender acknowledged before it sent the second.
        for round in 0..3u8 {
            output_tx.send(vec![b'a' + round; 500]).await.expect("the shipper reads");
            while received(&server).length < 500 * (u64::from(round) + 1) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        {
            // The server loses everything but the first 200 bytes, which
            // the spool no longer holds.
            let mut received = received(&server);
            received.log.truncate(200);
            received.length = 200;
        }
        output_tx.send(b"end".to_vec()).await.expect("the shipper reads");
        drop(output_tx);
        let report = shipping.await.expect("shipping does not panic");

        let received = received(&server);
        // Making room for "end" released the 3 oldest spooled bytes too.
        assert_eq!(received.gaps, [(200, 303)], "the bytes no longer spooled are reported as dropped");
        let mut expected = vec![b'a'; 200];
        expected.extend(vec![b'b'; 497]);
        expected.extend(vec![b'c'; 500]);
        expected.extend(b"end");
        assert!(received.log == expected);
        assert_eq!(received.length, 1503);
        assert_eq!(report.resyncs, 1);
    }

    #[tokio::test]
    async fn a_refused_credential_stops_shipping() {
        let (api, server) = serve(|_, _| Some(StatusCode::UNAUTHORIZED)).await;
        // Many items through a channel of one: the shipper must keep reading
        // after the refusal, or the producer would never finish.
        let items = vec![vec![b'y'; 8 * 1024]; 40];
        let dir = tempdir();
        let report = ship_items(api, items, &[], config(&dir, SPOOL_BOUND, DRAIN_BOUND)).await;

        assert_eq!(received(&server).requests.len(), 1, "nothing is sent after the 401");
        assert_eq!(report, ShipReport { bytes: 0, chunks: 0, lost_bytes: 40 * 8 * 1024, resyncs: 0 });
    }

    #[tokio::test]
    async fn a_gone_execution_stops_shipping_after_what_was_acknowledged() {
        let (api, server) = serve(|n, _| (n > 0).then_some(StatusCode::GONE)).await;
        let items = vec![vec![b'z'; MAX_BATCH]; 5];
        let dir = tempdir();
        let report = ship_items(api, items, &[], config(&dir, SPOOL_BOUND, DRAIN_BOUND)).await;

        assert_eq!(received(&server).requests.len(), 2, "one acknowledged, one refused, then nothing");
        let acknowledged = received(&server).length;
        assert_eq!(report.bytes, acknowledged);
        assert_eq!(report.lost_bytes, 5 * MAX_BATCH as u64 - acknowledged);
    }
}
