use std::sync::Mutex;

use axum::body::Bytes;
use axum::http::HeaderMap;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message;

use super::*;

fn span(name: &'static str) -> Span {
    Span {
        trace_id: trace_id(),
        span_id: span_id(),
        parent_span_id: None,
        trace_state: None,
        name,
        kind: SpanKind::Internal,
        start_unix_nanos: 1_000,
        end_unix_nanos: 2_000,
        attributes: vec![("standby.attempt", Value::Int(1))],
        error: None,
    }
}

/// reqwest is built without a TLS provider of its own: the callers
/// install ring, as the tests do here.
fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

fn config(url: &str) -> ExporterConfig {
    let mut config = ExporterConfig::new(traces_url(url).expect("url"), "standby-test");
    config.interval = Duration::from_millis(10);
    config.timeout = Duration::from_millis(300);
    config
}

/// A full queue drops and counts: `emit` is not async, so it cannot wait
/// on the queue, and nothing past the bound is kept.
#[test]
fn a_full_queue_drops_and_counts() {
    let (tracer, mut queue) = channel(2);
    for _ in 0..5 {
        tracer.emit(span("s"));
    }
    assert_eq!(tracer.dropped(), 3);
    assert!(queue.try_recv().is_ok() && queue.try_recv().is_ok());
    assert!(queue.try_recv().is_err(), "nothing past the bound was kept");
    drop(queue);
    tracer.emit(span("after the exporter ended"));
    assert_eq!(tracer.dropped(), 4);
}

type Received = Arc<Mutex<Vec<(Option<String>, ExportTraceServiceRequest)>>>;

async fn receiver() -> (String, Received) {
    let received: Received = Arc::default();
    let kept = Arc::clone(&received);
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let kept = Arc::clone(&kept);
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("protobuf");
                let content_type = headers.get("content-type").and_then(|v| v.to_str().ok()).map(str::to_owned);
                kept.lock().expect("lock").push((content_type, request));
                ""
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{address}"), received)
}

#[tokio::test]
async fn spans_arrive_as_the_official_protobuf() {
    let (url, received) = receiver().await;
    let exporter = Exporter::spawn(client(), config(&url));
    let mut root = span("root");
    root.error = Some("requeued".into());
    let child = Span { parent_span_id: Some(root.span_id), trace_state: Some("a=b".into()), ..span("child") };
    exporter.tracer().emit(root.clone());
    exporter.tracer().emit(child.clone());
    assert_eq!(exporter.shutdown().await, 0);
    let received = received.lock().expect("lock");
    let spans: Vec<_> = received
        .iter()
        .inspect(|(content_type, _)| assert_eq!(content_type.as_deref(), Some("application/x-protobuf")))
        .flat_map(|(_, request)| &request.resource_spans)
        .flat_map(|resource| &resource.scope_spans)
        .flat_map(|scope| &scope.spans)
        .collect();
    assert_eq!(spans.len(), 2);
    assert_eq!((spans[0].name.as_str(), spans[0].trace_id.as_slice()), ("root", root.trace_id.as_slice()));
    assert!(spans[0].parent_span_id.is_empty());
    assert_eq!(spans[0].status.as_ref().map(|s| s.message.as_str()), Some("requeued"));
    assert_eq!(spans[1].parent_span_id, root.span_id.to_vec());
    assert_eq!((spans[1].trace_state.as_str(), spans[1].start_time_unix_nano), ("a=b", 1_000));
    let resource = received[0].1.resource_spans[0].resource.as_ref().expect("resource");
    assert_eq!(resource.attributes[0].key, "service.name");
}

/// A refused connection and a collector that never answers both drop
/// the batch and count it; the exporter ends all the same.
#[tokio::test]
async fn failed_exports_are_counted() {
    let refused = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("address")
    };
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let silent_address = silent.local_addr().expect("address");
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            open.push(stream);
        }
    });
    for address in [refused, silent_address] {
        let exporter = Exporter::spawn(client(), config(&format!("http://{address}")));
        for _ in 0..3 {
            exporter.tracer().emit(span("lost"));
        }
        assert_eq!(exporter.shutdown().await, 3, "{address}");
    }
    held.abort();
}

/// A stop while a batch is out to a collector that never answers: the
/// batch gets what is left of one request bound, then is counted, and the
/// spans queued behind it too; the exporter ends.
#[tokio::test]
async fn a_stop_while_a_batch_is_out_counts_it_and_ends() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = silent.local_addr().expect("address");
    let accepted = Arc::new(tokio::sync::Notify::new());
    let told = Arc::clone(&accepted);
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            open.push(stream);
            told.notify_one();
        }
    });
    let mut config = config(&format!("http://{address}"));
    config.batch = 2;
    let exporter = Exporter::spawn(client(), config);
    exporter.tracer().emit(span("out"));
    exporter.tracer().emit(span("out"));
    accepted.notified().await;
    exporter.tracer().emit(span("queued behind"));
    assert_eq!(exporter.shutdown().await, 3);
    held.abort();
}
