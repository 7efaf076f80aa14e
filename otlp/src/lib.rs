//! A small OTLP/HTTP trace exporter: the server and the agent hand it
//! finished [`Span`]s, it sends them in batches as the official protobuf
//! `ExportTraceServiceRequest` to `<endpoint>/v1/traces`.
//!
//! Tracing never slows what it traces: [`Tracer::emit`] never waits. The
//! queue between the tracer and the one exporter task is bounded; a span
//! that finds it full is dropped and counted, and so is every span of a
//! batch whose export failed or took longer than its bound. Nothing is
//! retried and nothing is queued without bound. Without an endpoint none
//! of this exists: the callers hold an `Option<Exporter>`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

mod encode;
mod endpoint;

pub use encode::request;
pub use endpoint::{EndpointError, traces_url};

/// One finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// `None` for a trace's root.
    pub parent_span_id: Option<[u8; 8]>,
    /// The W3C `tracestate` the span was started under, if any.
    pub trace_state: Option<String>,
    pub name: &'static str,
    pub kind: SpanKind,
    /// Wall-clock start and end, nanoseconds since the Unix epoch.
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    /// Never a secret, a credential or a run's command.
    pub attributes: Vec<(&'static str, Value)>,
    /// Set when what the span covers failed: the status message.
    pub error: Option<String>,
}

/// What a span stands for (the protobuf's `SpanKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal,
    Server,
    Client,
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Str(String),
    Int(i64),
}

impl From<&str> for Value {
    fn from(value: &str) -> Self {
        Self::Str(value.to_owned())
    }
}

impl From<String> for Value {
    fn from(value: String) -> Self {
        Self::Str(value)
    }
}

impl From<i64> for Value {
    fn from(value: i64) -> Self {
        Self::Int(value)
    }
}

/// A fresh trace id (random, never all zero).
pub fn trace_id() -> [u8; 16] {
    loop {
        let id: [u8; 16] = rand::random();
        if id != [0; 16] {
            return id;
        }
    }
}

/// A fresh span id (random, never all zero).
pub fn span_id() -> [u8; 8] {
    loop {
        let id: [u8; 8] = rand::random();
        if id != [0; 8] {
            return id;
        }
    }
}

/// Nanoseconds since the Unix epoch of a wall-clock time (0 before it).
pub fn unix_nanos(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// How the exporter runs.
#[derive(Debug, Clone)]
pub struct ExporterConfig {
    /// Where batches are POSTed: [`traces_url`] of the endpoint.
    pub url: reqwest::Url,
    /// The resource's `service.name`.
    pub service_name: &'static str,
    /// Further resource attributes (never secret).
    pub resource: Vec<(&'static str, String)>,
    /// Spans the queue holds; one more is dropped.
    pub queue: usize,
    /// Spans per request.
    pub batch: usize,
    /// A batch not full is sent this long after its first span.
    pub interval: Duration,
    /// Bound on one request, connection included.
    pub timeout: Duration,
}

impl ExporterConfig {
    /// The defaults: a queue of [`QUEUE`] spans, batches of up to 512
    /// sent at least every second, each request bounded by 5 s.
    pub fn new(url: reqwest::Url, service_name: &'static str) -> Self {
        Self {
            url,
            service_name,
            resource: Vec::new(),
            queue: QUEUE,
            batch: 512,
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(5),
        }
    }
}

/// The default bound of the queue, in spans.
pub const QUEUE: usize = 2048;

/// The sending half: cheap to clone, never waits.
#[derive(Debug, Clone)]
pub struct Tracer {
    queue: mpsc::Sender<Span>,
    dropped: Arc<AtomicU64>,
}

impl Tracer {
    /// Queues `span` for export; drops and counts it when the queue is
    /// full (or the exporter has ended). Never waits.
    pub fn emit(&self, span: Span) {
        if self.queue.try_send(span).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Spans dropped so far: queue full, export failed or timed out.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// The exporter: its task, and the [`Tracer`] that feeds it.
#[derive(Debug)]
pub struct Exporter {
    tracer: Tracer,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Exporter {
    /// Starts the exporter task on the current runtime. `client` is the
    /// caller's (its TLS configuration is the caller's).
    pub fn spawn(client: reqwest::Client, config: ExporterConfig) -> Self {
        let (tracer, queue) = channel(config.queue);
        let (stop, stopped) = oneshot::channel();
        let dropped = Arc::clone(&tracer.dropped);
        let task = tokio::spawn(export_loop(client, config, queue, stopped, dropped));
        Self { tracer, stop, task }
    }

    pub fn tracer(&self) -> &Tracer {
        &self.tracer
    }

    /// Stops the task after one last flush of what is queued (bounded by
    /// the request timeout); returns the spans dropped in all.
    pub async fn shutdown(self) -> u64 {
        let Self { tracer, stop, task } = self;
        let _ = stop.send(());
        let _ = task.await;
        tracer.dropped()
    }
}

fn channel(capacity: usize) -> (Tracer, mpsc::Receiver<Span>) {
    let (queue, receiver) = mpsc::channel(capacity.max(1));
    (Tracer { queue, dropped: Arc::new(AtomicU64::new(0)) }, receiver)
}

/// Why a batch was not accepted.
#[derive(Debug, thiserror::Error)]
enum ExportError {
    #[error("{0}")]
    Send(String),
    #[error("the collector answered {0}")]
    Status(reqwest::StatusCode),
}

async fn export_loop(
    client: reqwest::Client,
    config: ExporterConfig,
    mut queue: mpsc::Receiver<Span>,
    mut stop: oneshot::Receiver<()>,
    dropped: Arc<AtomicU64>,
) {
    let mut out = Out { client, config, dropped, failures: 0 };
    let batch_size = out.config.batch.max(1);
    let mut batch: Vec<Span> = Vec::new();
    let mut due: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            biased;
            _ = &mut stop => break,
            span = queue.recv() => {
                let Some(span) = span else { break };
                batch.push(span);
                due.get_or_insert_with(|| tokio::time::Instant::now() + out.config.interval);
                if batch.len() < batch_size {
                    continue;
                }
            }
            () = sleep_until(due) => {}
        }
        due = None;
        // A stop while a batch is out: that batch and the last flush
        // share one request bound from then on.
        let count = batch.len() as u64;
        let bound = out.config.timeout;
        let counter = Arc::clone(&out.dropped);
        let mut stopped_by = None;
        {
            let sending = out.send(&mut batch, bound);
            tokio::pin!(sending);
            tokio::select! {
                biased;
                () = &mut sending => {}
                _ = &mut stop => {
                    let deadline = tokio::time::Instant::now() + bound;
                    stopped_by = Some(deadline);
                    if tokio::time::timeout_at(deadline, sending).await.is_err() {
                        counter.fetch_add(count, Ordering::Relaxed);
                    }
                }
            }
        }
        if let Some(deadline) = stopped_by {
            out.flush(&mut queue, Vec::new(), deadline).await;
            return;
        }
    }
    let deadline = tokio::time::Instant::now() + out.config.timeout;
    out.flush(&mut queue, batch, deadline).await;
}

/// The sending side of the exporter task.
struct Out {
    client: reqwest::Client,
    config: ExporterConfig,
    dropped: Arc<AtomicU64>,
    failures: u64,
}

impl Out {
    /// The last flush, bounded by `deadline`: `batch` and what is queued
    /// now, in batches; what the bound leaves unsent is counted.
    async fn flush(&mut self, queue: &mut mpsc::Receiver<Span>, mut batch: Vec<Span>, deadline: tokio::time::Instant) {
        queue.close();
        while let Ok(span) = queue.try_recv() {
            batch.push(span);
        }
        let batch_size = self.config.batch.max(1);
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(batch_size));
            let mut chunk = std::mem::replace(&mut batch, rest);
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                self.dropped.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                continue;
            }
            self.send(&mut chunk, left).await;
        }
    }

    /// Sends `batch` (emptied either way) within `bound`; its spans are
    /// counted dropped when the request fails. The first failure and every
    /// hundredth are logged at debug level, never one span: the count is
    /// what the callers report (the server's `/metrics`, the agent's last
    /// line).
    async fn send(&mut self, batch: &mut Vec<Span>, bound: Duration) {
        if batch.is_empty() {
            return;
        }
        let spans = std::mem::take(batch);
        let count = spans.len() as u64;
        let config = &self.config;
        let body = prost::Message::encode_to_vec(&request(config.service_name, &config.resource, spans));
        let result = async {
            let answer = self
                .client
                .post(config.url.clone())
                .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
                .timeout(bound)
                .body(body)
                .send()
                .await
                .map_err(|e| ExportError::Send(e.without_url().to_string()))?;
            if answer.status().is_success() { Ok(()) } else { Err(ExportError::Status(answer.status())) }
        };
        let outcome = match tokio::time::timeout(bound, result).await {
            Ok(outcome) => outcome,
            Err(_) => Err(ExportError::Send(format!("no answer within {bound:?}"))),
        };
        if let Err(error) = outcome {
            self.dropped.fetch_add(count, Ordering::Relaxed);
            if self.failures.is_multiple_of(100) {
                tracing::debug!(%error, spans = count, failures = self.failures + 1, "a batch of spans was not exported; dropped");
            }
            self.failures += 1;
        }
    }
}

async fn sleep_until(due: Option<tokio::time::Instant>) {
    match due {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
