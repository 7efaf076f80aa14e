//! Ships the run's terminal output to `POST /v1/executions/{id}/log`.
//!
//! Two halves run concurrently in one task: a batcher reads the output,
//! redacts it and cuts it into batches, and a sender posts the batches one at
//! a time, strictly in order. Between them sits a queue of `QUEUE` batches,
//! so output keeps being read into the next batch while a POST is in flight,
//! but when the server is slower than the run, the batcher waits on the full
//! queue, stops reading, and the run's output channel fills up: the producer
//! feels the backpressure instead of the agent buffering without limit.
//! Memory held here is bounded by about `QUEUE + 2` batches (the queue, the
//! one in flight, the one being filled) plus one output item and its
//! redacted copy.

use std::time::Duration;

use standby_protocol::{LogChunk, Secret};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::SendError;
use tokio::time::Instant;

use crate::api::{self, Api, ApiError, Class};
use crate::redact::Redactor;

/// Largest chunk of output per request (before base64): few requests for a
/// chatty run, and a retry re-sends little.
pub const MAX_BATCH: usize = 64 * 1024;

/// How long the first byte of a batch waits for more before the batch goes
/// out anyway, so a quiet run's output still shows up promptly.
pub const FLUSH_AFTER: Duration = Duration::from_millis(100);

/// Batches waiting for the sender besides the one in flight.
const QUEUE: usize = 2;

/// What happened to the run's output.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShipReport {
    /// Bytes of the redacted stream the server acknowledged.
    pub bytes: u64,
    /// Chunks the server acknowledged.
    pub chunks: u64,
    /// Bytes of the redacted stream given up on: chunks that kept failing,
    /// and everything after the credential was refused.
    pub lost_bytes: u64,
}

/// [`ship`] running in a task of its own, so the agent can start shipping
/// when the run starts and collect the report once the run's output closed.
///
/// Dropping the handle does not stop shipping: the task still ends when the
/// output closes, which is what keeps the run's producer from blocking on a
/// channel nobody reads.
#[derive(Debug)]
pub struct LogShipper {
    task: tokio::task::JoinHandle<ShipReport>,
}

impl LogShipper {
    /// Starts [`ship`] on the current runtime.
    pub fn spawn(
        api: Api,
        credential: Secret,
        execution_id: String,
        output: mpsc::Receiver<Vec<u8>>,
        redactor: Redactor,
        chunk_timeout: Duration,
    ) -> Self {
        Self { task: tokio::spawn(ship(api, credential, execution_id, output, redactor, chunk_timeout)) }
    }

    /// Waits until the output closed and every chunk was acknowledged or
    /// given up on. A panic in shipping is resumed here.
    pub async fn finish(self) -> ShipReport {
        match self.task.await {
            Ok(report) => report,
            Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
            Err(error) => {
                tracing::warn!(%error, "log shipping was cancelled before it finished");
                ShipReport::default()
            }
        }
    }
}

/// Reads `output` until it closes; redacts with `redactor`; batches up to
/// [`MAX_BATCH`] bytes, flushing a batch once [`FLUSH_AFTER`] passed since its
/// first byte or when full; sends chunks one at a time strictly in order, as
/// [`LogChunk`] with `offset` = bytes of the redacted stream already sent.
///
/// Each chunk is retried with [`api::retry`] and [`api::call_backoff`] while
/// the error is transient, for at most `chunk_timeout` in all. A chunk that
/// still fails is dropped and counted in `lost_bytes`, with a warning naming
/// the execution and the byte range; the offset still advances past it, so
/// the server does not take the next chunk for a retry of this one. A
/// `401`/`403`/`410` means the run credential was revoked: nothing more is
/// sent, and the rest of the output is read (so the run never blocks on it)
/// and counted as lost.
pub async fn ship(
    api: Api,
    credential: Secret,
    execution_id: String,
    output: mpsc::Receiver<Vec<u8>>,
    redactor: Redactor,
    chunk_timeout: Duration,
) -> ShipReport {
    let (queue, batches) = mpsc::channel(QUEUE);
    let sender = Sender {
        path: format!("/v1/executions/{execution_id}/log"),
        api,
        credential,
        execution_id,
        chunk_timeout,
        offset: 0,
        report: ShipReport::default(),
        revoked: false,
    };
    // The batcher only fails when the sender's queue is gone, and the sender
    // reads it until it closes: that result carries nothing.
    let (_, report) = tokio::join!(batch(output, redactor, queue), sender.run(batches));
    report
}

/// Reads `output` until it closes, redacts it and cuts the redacted stream
/// into batches for `queue`. While `queue` is full it does not read `output`:
/// that is the backpressure.
async fn batch(
    mut output: mpsc::Receiver<Vec<u8>>,
    mut redactor: Redactor,
    queue: mpsc::Sender<Vec<u8>>,
) -> Result<(), SendError<Vec<u8>>> {
    let mut batcher = Batcher { batch: Vec::new(), flush_at: None, queue };
    loop {
        let chunk = match batcher.flush_at {
            Some(at) => tokio::select! {
                chunk = output.recv() => chunk,
                () = tokio::time::sleep_until(at) => {
                    batcher.flush().await?;
                    continue;
                }
            },
            None => output.recv().await,
        };
        let Some(chunk) = chunk else { break };
        batcher.add(&redactor.push(&chunk)).await?;
    }
    batcher.add(&redactor.finish()).await?;
    batcher.flush().await
}

/// The batch being filled.
struct Batcher {
    batch: Vec<u8>,
    /// When the batch goes out even if not full; set by its first byte.
    flush_at: Option<Instant>,
    queue: mpsc::Sender<Vec<u8>>,
}

impl Batcher {
    async fn add(&mut self, mut data: &[u8]) -> Result<(), SendError<Vec<u8>>> {
        while !data.is_empty() {
            if self.batch.is_empty() {
                self.flush_at = Some(Instant::now() + FLUSH_AFTER);
            }
            let (now, rest) = data.split_at(data.len().min(MAX_BATCH - self.batch.len()));
            self.batch.extend_from_slice(now);
            data = rest;
            if self.batch.len() == MAX_BATCH {
                self.flush().await?;
            }
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), SendError<Vec<u8>>> {
        self.flush_at = None;
        if self.batch.is_empty() {
            return Ok(());
        }
        self.queue.send(std::mem::take(&mut self.batch)).await
    }
}

/// Posts batches in order and keeps the books.
struct Sender {
    api: Api,
    credential: Secret,
    execution_id: String,
    path: String,
    chunk_timeout: Duration,
    /// Bytes of the redacted stream before the next batch, sent or lost.
    offset: u64,
    report: ShipReport,
    /// The credential was refused: every further batch is lost.
    revoked: bool,
}

/// Why a chunk was given up on.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("no acknowledgement within {0:?}")]
    TimedOut(Duration),
}

impl Sender {
    async fn run(mut self, mut batches: mpsc::Receiver<Vec<u8>>) -> ShipReport {
        while let Some(batch) = batches.recv().await {
            let len = batch.len() as u64;
            if self.revoked {
                self.report.lost_bytes += len;
            } else {
                match self.send(&batch).await {
                    Ok(()) => {
                        self.report.bytes += len;
                        self.report.chunks += 1;
                    }
                    Err(failure) => {
                        self.report.lost_bytes += len;
                        self.revoked = matches!(
                            &failure,
                            Failure::Api(error) if matches!(error.class(), Class::Unauthorized | Class::Gone)
                        );
                        let (from, to) = (self.offset, self.offset + len);
                        let execution_id = self.execution_id.as_str();
                        if self.revoked {
                            tracing::warn!(
                                execution_id, from, error = %failure,
                                "the run credential was refused; discarding the rest of the run's output"
                            );
                        } else {
                            tracing::warn!(execution_id, from, to, error = %failure, "dropped a chunk of the run's output");
                        }
                    }
                }
            }
            self.offset += len;
        }
        tracing::debug!(
            execution_id = self.execution_id,
            bytes = self.report.bytes,
            chunks = self.report.chunks,
            lost_bytes = self.report.lost_bytes,
            "run output shipped"
        );
        self.report
    }

    /// Sends one chunk, retrying transient failures until `chunk_timeout`.
    async fn send(&self, batch: &[u8]) -> Result<(), Failure> {
        let chunk = LogChunk::new(self.offset, batch);
        let call = format!("POST {}", self.path);
        let deadline = crate::time::after(Instant::now(), self.chunk_timeout);
        // `retry` only checks its deadline between attempts; the outer bound
        // also cuts an attempt that hangs.
        let attempts =
            api::retry(&call, deadline, api::call_backoff(), || self.api.post(&self.credential, &self.path, &chunk));
        match tokio::time::timeout_at(deadline, attempts).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(Failure::TimedOut(self.chunk_timeout)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use axum::Json;
    use axum::extract::{Path, State};
    use axum::http::{HeaderMap, StatusCode, header};
    use standby_protocol::{PROTOCOL_HEADER, PROTOCOL_VERSION};

    use super::*;

    const TOKEN: &str = "run-token";
    const EXECUTION: &str = "exe_1";

    /// Decides the answer to request number `n` (from 0) carrying `chunk`.
    type Answer = dyn Fn(usize, &LogChunk) -> StatusCode + Send + Sync;

    #[derive(Default)]
    struct Received {
        /// Every request that passed the checks, in arrival order.
        requests: Vec<LogChunk>,
        /// The ones answered `2xx`.
        accepted: Vec<LogChunk>,
        /// Requests with the wrong credential, header or execution.
        malformed: usize,
    }

    #[derive(Clone)]
    struct Server {
        received: Arc<Mutex<Received>>,
        answer: Arc<Answer>,
    }

    async fn receive(
        State(server): State<Server>,
        Path(execution): Path<String>,
        headers: HeaderMap,
        Json(chunk): Json<LogChunk>,
    ) -> StatusCode {
        let mut received = server.received.lock().expect("lock is not poisoned");
        let bearer = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        let protocol = headers.get(PROTOCOL_HEADER).and_then(|v| v.to_str().ok());
        if bearer != Some(&format!("Bearer {TOKEN}")) || protocol != Some(PROTOCOL_VERSION) || execution != EXECUTION {
            received.malformed += 1;
            return StatusCode::BAD_REQUEST;
        }
        let status = (server.answer)(received.requests.len(), &chunk);
        received.requests.push(chunk.clone());
        if status.is_success() {
            received.accepted.push(chunk);
        }
        status
    }

    /// A log endpoint on 127.0.0.1, and an `Api` pointing at it.
    async fn serve(answer: impl Fn(usize, &LogChunk) -> StatusCode + Send + Sync + 'static) -> (Api, Server) {
        // reqwest is built without a default crypto provider; the agent's
        // main installs one, tests do it here (a second install is refused,
        // which is fine).
        crate::api::install_tls_provider();
        let server = Server { received: Arc::default(), answer: Arc::new(answer) };
        let app = axum::Router::new()
            .route("/v1/executions/{id}/log", axum::routing::post(receive))
            .with_state(server.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a loopback port");
        let address = listener.local_addr().expect("bound address");
        tokio::spawn(async move { axum::serve(listener, app).await });
        let base = reqwest::Url::parse(&format!("http://{address}")).expect("a valid URL");
        (Api::new(&base).expect("an HTTP client"), server)
    }

    /// Feeds `items` into an output channel holding at most one item, as
    /// the run's terminal would, and closes it.
    fn produce(items: Vec<Vec<u8>>) -> mpsc::Receiver<Vec<u8>> {
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            for item in items {
                tx.send(item).await.expect("the shipper reads until the output closes");
            }
        });
        rx
    }

    async fn ship_items(api: Api, items: Vec<Vec<u8>>, secrets: &[&str], chunk_timeout: Duration) -> ShipReport {
        let redactor = Redactor::new(secrets.iter().copied());
        ship(api, Secret::new(TOKEN), EXECUTION.into(), produce(items), redactor, chunk_timeout).await
    }

    /// The accepted chunks' data, checking each starts where the previous
    /// one ended.
    fn reassemble(chunks: &[LogChunk]) -> Vec<u8> {
        let mut log = Vec::new();
        for chunk in chunks {
            assert_eq!(chunk.offset, log.len() as u64, "offsets are contiguous");
            let data = chunk.bytes().expect("base64 data");
            assert!(!data.is_empty() && data.len() <= MAX_BATCH, "chunk of {} bytes", data.len());
            log.extend(data);
        }
        log
    }

    fn received(server: &Server) -> std::sync::MutexGuard<'_, Received> {
        server.received.lock().expect("lock is not poisoned")
    }

    #[tokio::test]
    async fn ships_the_redacted_output_in_order() {
        let (api, server) = serve(|_, _| StatusCode::OK).await;
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
        let output = produce(items);
        let shipper = LogShipper::spawn(
            api,
            Secret::new(TOKEN),
            EXECUTION.into(),
            output,
            Redactor::new(["hunter2"]),
            Duration::from_secs(10),
        );
        let report = shipper.finish().await;

        let received = received(&server);
        assert_eq!(received.malformed, 0, "every request has the bearer credential and protocol header");
        let log = reassemble(&received.accepted);
        let mut redactor = Redactor::new(["hunter2"]);
        let mut expected = redactor.push(&input);
        expected.extend(redactor.finish());
        assert_eq!(log, expected);
        assert!(log.starts_with(b"login with [REDACTED] now\r\n"), "the secret split across two items is redacted");
        assert!(!log.windows(7).any(|w| w == b"hunter2"));
        assert!(log.ends_with(b"end hun"), "the held-back tail is sent at the end");
        assert!(received.accepted.len() >= 3, "150 KB need three chunks of 64 KiB");
        assert_eq!(
            report,
            ShipReport { bytes: log.len() as u64, chunks: received.accepted.len() as u64, lost_bytes: 0 }
        );
    }

    #[tokio::test]
    async fn a_retried_chunk_keeps_its_offset() {
        let (api, server) = serve(|n, _| if n < 2 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK }).await;
        let items = vec![vec![b'x'; MAX_BATCH], b"tail".to_vec()];
        let report = ship_items(api, items.clone(), &[], Duration::from_secs(30)).await;

        let received = received(&server);
        assert_eq!(reassemble(&received.accepted), items.concat());
        let first = &received.requests[..3];
        assert!(first.iter().all(|c| c == &first[0]), "two retries of the first chunk, with its offset and data");
        assert_eq!(first[0].offset, 0);
        assert_eq!(report, ShipReport { bytes: MAX_BATCH as u64 + 4, chunks: 2, lost_bytes: 0 });
    }

    #[tokio::test]
    async fn a_chunk_that_keeps_failing_is_dropped_and_the_offset_advances() {
        let (api, server) =
            serve(|_, chunk| if chunk.offset == 0 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK }).await;
        let items = vec![vec![b'x'; MAX_BATCH + 100]];
        let report = ship_items(api, items, &[], Duration::from_millis(400)).await;

        let received = received(&server);
        assert!(received.requests.iter().filter(|c| c.offset == 0).count() >= 2, "the first chunk was retried");
        assert_eq!(received.accepted.len(), 1);
        assert_eq!(received.accepted[0].offset, MAX_BATCH as u64, "the next chunk is not taken for a retry");
        assert_eq!(received.accepted[0].bytes().expect("base64 data"), vec![b'x'; 100]);
        assert_eq!(report, ShipReport { bytes: 100, chunks: 1, lost_bytes: MAX_BATCH as u64 });
    }

    #[tokio::test]
    async fn a_refused_credential_stops_shipping() {
        let (api, server) = serve(|_, _| StatusCode::UNAUTHORIZED).await;
        // Many items through a channel of one: the shipper must keep reading
        // after the refusal, or the producer would never finish.
        let items = vec![vec![b'y'; 8 * 1024]; 40];
        let report = ship_items(api, items, &[], Duration::from_secs(30)).await;

        assert_eq!(received(&server).requests.len(), 1, "nothing is sent after the 401");
        assert_eq!(report, ShipReport { bytes: 0, chunks: 0, lost_bytes: 40 * 8 * 1024 });
    }

    #[tokio::test]
    async fn a_gone_execution_stops_shipping_after_what_was_acknowledged() {
        let (api, server) = serve(|n, _| if n == 0 { StatusCode::OK } else { StatusCode::GONE }).await;
        let items = vec![vec![b'z'; MAX_BATCH]; 5];
        let report = ship_items(api, items, &[], Duration::from_secs(30)).await;

        assert_eq!(received(&server).requests.len(), 2, "one acknowledged, one refused, then nothing");
        let batch = MAX_BATCH as u64;
        assert_eq!(report, ShipReport { bytes: batch, chunks: 1, lost_bytes: 4 * batch });
    }

    #[tokio::test(start_paused = true)]
    async fn a_partial_batch_goes_out_after_the_flush_delay() {
        let (output, rx) = mpsc::channel(1);
        let (queue, mut batches) = mpsc::channel(QUEUE);
        let batching = tokio::spawn(batch(rx, Redactor::new(["secret"]), queue));
        output.send(b"prompt> sec".to_vec()).await.expect("the batcher is reading");
        assert_eq!(batches.recv().await, Some(b"prompt> ".to_vec()), "sent while the output is still open");
        drop(output);
        assert_eq!(batches.recv().await, Some(b"sec".to_vec()), "the held-back tail, at the end");
        assert_eq!(batches.recv().await, None);
        batching.await.expect("the batcher does not panic").expect("the queue stays open");
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_sender_holds_back_the_output() {
        let (output, rx) = mpsc::channel(1);
        let (queue, mut batches) = mpsc::channel(QUEUE);
        let batching = tokio::spawn(batch(rx, Redactor::new(std::iter::empty()), queue));
        let sent = Arc::new(AtomicUsize::new(0));
        let producer = tokio::spawn({
            let sent = Arc::clone(&sent);
            async move {
                for _ in 0..64 {
                    output.send(vec![b'x'; MAX_BATCH]).await.expect("the batcher is reading");
                    sent.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        // Nothing signals "every task is blocked"; with the clock paused this
        // sleep ends only once the runtime is idle, i.e. once the batcher and
        // the producer both wait.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let in_flight = sent.load(Ordering::SeqCst);
        // The queue, the batch the batcher holds, the item in the channel.
        assert!(in_flight <= QUEUE + 2, "{in_flight} items taken while nobody sent anything");

        let mut total = 0;
        while let Some(batch) = batches.recv().await {
            total += batch.len();
        }
        assert_eq!(total, 64 * MAX_BATCH);
        producer.await.expect("the producer does not panic");
        batching.await.expect("the batcher does not panic").expect("the queue stays open");
    }
}
