//! An OTLP/HTTP trace receiver on loopback: what a collector would get
//! from `--otlp-endpoint` and `STANDBY_OTLP_ENDPOINT`, decoded from the
//! official protobuf (`opentelemetry-proto`'s `ExportTraceServiceRequest`)
//! with prost, so the tests read what any collector would read. And a
//! listener that accepts connections and never answers, for the endpoint
//! that must not slow anything down.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value;
use prost::Message as _;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// One span as received, flattened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedSpan {
    /// The resource's `service.name`.
    pub service: String,
    pub trace_id: Vec<u8>,
    pub span_id: Vec<u8>,
    /// Empty for a root.
    pub parent_span_id: Vec<u8>,
    pub name: String,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    /// String and integer attributes, as text.
    pub attributes: BTreeMap<String, String>,
    /// The status message (set on an error status).
    pub status_message: String,
}

impl ReceivedSpan {
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    pub fn duration_nanos(&self) -> u64 {
        self.end_unix_nanos.saturating_sub(self.start_unix_nanos)
    }
}

#[derive(Debug, Default)]
struct Received {
    requests: u64,
    /// Requests that were not `application/x-protobuf` or did not decode.
    malformed: u64,
    spans: Vec<ReceivedSpan>,
}

/// The receiver: `POST /v1/traces` on `127.0.0.1:<port 0>`.
#[derive(Debug)]
pub struct OtlpReceiver {
    address: SocketAddr,
    received: Arc<Mutex<Received>>,
    arrived: Arc<Notify>,
    task: JoinHandle<()>,
}

impl OtlpReceiver {
    pub async fn start() -> Self {
        let received: Arc<Mutex<Received>> = Arc::default();
        let arrived = Arc::new(Notify::new());
        let (kept, told) = (Arc::clone(&received), Arc::clone(&arrived));
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                let (kept, told) = (Arc::clone(&kept), Arc::clone(&told));
                async move {
                    let protobuf = headers.get("content-type").is_some_and(|v| v == "application/x-protobuf");
                    let decoded = ExportTraceServiceRequest::decode(body).ok().filter(|_| protobuf);
                    let status = {
                        let mut received = kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        received.requests += 1;
                        match decoded {
                            Some(request) => {
                                received.spans.extend(flatten(request));
                                StatusCode::OK
                            }
                            None => {
                                received.malformed += 1;
                                StatusCode::BAD_REQUEST
                            }
                        }
                    };
                    told.notify_waiters();
                    status
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the OTLP receiver");
        let address = listener.local_addr().expect("its address");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { address, received, arrived, task }
    }

    /// The endpoint to configure (`/v1/traces` is appended by the rule).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Received> {
        self.received.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Export requests received, decoded or not.
    pub fn requests(&self) -> u64 {
        self.lock().requests
    }

    /// Requests that were not protobuf, or did not decode.
    pub fn malformed(&self) -> u64 {
        self.lock().malformed
    }

    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.lock().spans.clone()
    }

    /// Waits until `check` of the spans received gives a value, woken by
    /// each request as it arrives; panics after `timeout`.
    pub async fn until<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&[ReceivedSpan]) -> Option<T>,
    ) -> T {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if let Some(value) = check(&self.lock().spans) {
                return value;
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                let names: Vec<String> = self.spans().iter().map(|s| format!("{}:{}", s.service, s.name)).collect();
                panic!("timed out waiting for {what}; received {names:?}");
            }
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn flatten(request: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let mut spans = Vec::new();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|resource| &resource.attributes)
            .find(|attribute| attribute.key == "service.name")
            .and_then(|attribute| text(attribute.value.as_ref()?.value.as_ref()?))
            .unwrap_or_default();
        for span in resource_spans.scope_spans.into_iter().flat_map(|scope| scope.spans) {
            let attributes = span
                .attributes
                .iter()
                .filter_map(|kv| Some((kv.key.clone(), text(kv.value.as_ref()?.value.as_ref()?)?)))
                .collect();
            spans.push(ReceivedSpan {
                service: service.clone(),
                trace_id: span.trace_id,
                span_id: span.span_id,
                parent_span_id: span.parent_span_id,
                name: span.name,
                start_unix_nanos: span.start_time_unix_nano,
                end_unix_nanos: span.end_time_unix_nano,
                attributes,
                status_message: span.status.map(|status| status.message).unwrap_or_default(),
            });
        }
    }
    spans
}

fn text(value: &any_value::Value) -> Option<String> {
    match value {
        any_value::Value::StringValue(text) => Some(text.clone()),
        any_value::Value::IntValue(number) => Some(number.to_string()),
        _ => None,
    }
}

/// A listener that accepts every connection and never answers: an OTLP
/// endpoint that hangs. Dropping it closes them all.
#[derive(Debug)]
pub struct SilentListener {
    address: SocketAddr,
    task: JoinHandle<()>,
}

impl SilentListener {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("its address");
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                held.push(stream);
            }
        });
        Self { address, task }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }
}

impl Drop for SilentListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}
