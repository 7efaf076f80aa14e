//! Traces (`--otlp-endpoint`, docs/operations.md, "Traces"): the
//! exporter, when an endpoint is configured, and the spans of a started
//! run, built from its record at the IO edge (the machine hands the record
//! over once, as `Effect::Traced`, when the run's `started` is recorded).
//!
//! A run's trace: `submit` (the root: submitted → started), `placement`
//! (submitted → bound to its sandbox), `resume` (a parked sandbox made
//! ready for a follow-up turn), and one `delivery` per attempt (bound →
//! started; an earlier attempt's ends when it was released, with an error
//! status), whose children are `confirmation` (assignment sent → the run
//! credential connected), `start` (confirmed → the agent's `started`) and
//! every span of that attempt's agent. Times are the record's, in
//! milliseconds, so each span's duration is the API's `durations_ms`.
//! No span holds a command, a secret or an agent's message.

use standby_otlp::{EndpointError, Exporter, ExporterConfig, Span, SpanKind, Value, span_id, traces_url};

use crate::model::{Attempt, AttemptOutcome, Millis, RunRecord};
use crate::rules::trace::{delivery_span_id, trace_id};

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("--otlp-endpoint: {0}")]
    Endpoint(#[from] EndpointError),
    #[error("the OTLP client: {0}")]
    Client(String),
}

/// The exporter of `endpoint`; without one, `None`: nothing is spawned
/// and nothing allocated.
pub fn exporter(endpoint: Option<&str>) -> Result<Option<Exporter>, TelemetryError> {
    let Some(endpoint) = endpoint else { return Ok(None) };
    let url = traces_url(endpoint)?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .user_agent(concat!("standby-server/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| TelemetryError::Client(e.to_string()))?;
    let mut config = ExporterConfig::new(url, "standby-server");
    config.resource.push(("service.version", env!("CARGO_PKG_VERSION").to_owned()));
    tracing::info!(url = %config.url, "exporting traces over OTLP/HTTP");
    Ok(Some(Exporter::spawn(client, config)))
}

fn nanos(at: Millis) -> u64 {
    u64::try_from(at.0).unwrap_or(0).saturating_mul(1_000_000)
}

/// The spans of `run`'s way to its start; none if it has not started.
pub fn run_spans(run: &RunRecord) -> Vec<Span> {
    let Some(current) = run.current() else { return Vec::new() };
    let Some(started) = current.started_at else { return Vec::new() };
    let trace_id = trace_id(&run.id);
    let root = span_id();
    let span = |name, parent, from: Millis, to: Millis, attributes| Span {
        trace_id,
        span_id: span_id(),
        parent_span_id: Some(parent),
        trace_state: None,
        name,
        kind: SpanKind::Internal,
        start_unix_nanos: nanos(from),
        end_unix_nanos: nanos(to),
        attributes,
        error: None,
    };
    let run_id = || ("standby.run_id", Value::from(run.id.as_str()));
    let mut spans = vec![
        Span {
            span_id: root,
            parent_span_id: None,
            kind: SpanKind::Server,
            ..span(
                "submit",
                root,
                run.submitted_at,
                started,
                vec![
                    run_id(),
                    ("standby.path", current.path.as_str().into()),
                    ("standby.attempts", i64::from(current.number).into()),
                ],
            )
        },
        span("placement", root, run.submitted_at, current.committed_at, vec![run_id()]),
    ];
    if let Some(resume) = &run.resume
        && let Some(ready) = resume.ready_at
    {
        spans.push(span("resume", root, resume.began_at, ready, vec![run_id()]));
    }
    for attempt in &run.attempts {
        let is_current = attempt.number == current.number;
        let end = if is_current { started } else { ended(attempt) };
        let attributes = vec![
            run_id(),
            ("standby.attempt", i64::from(attempt.number).into()),
            ("standby.path", attempt.path.as_str().into()),
            ("standby.sandbox_id", attempt.sandbox_id.as_str().into()),
        ];
        let delivery = Span {
            span_id: delivery_span_id(&run.id, attempt.number),
            error: (!is_current).then(|| format!("attempt {}", outcome(attempt.outcome))),
            ..span("delivery", root, attempt.committed_at, end, attributes)
        };
        let parent = delivery.span_id;
        spans.push(delivery);
        if let (Some(sent), Some(confirmed)) = (attempt.assignment_sent_at, attempt.delivery_confirmed_at) {
            spans.push(span("confirmation", parent, sent, confirmed, vec![run_id()]));
        }
        if is_current && let Some(confirmed) = attempt.delivery_confirmed_at {
            spans.push(span("start", parent, confirmed, started, vec![run_id()]));
        }
    }
    spans
}

/// When an earlier attempt ended: its end, else the last thing known of it.
fn ended(attempt: &Attempt) -> Millis {
    attempt.ended_at.or(attempt.delivery_confirmed_at).or(attempt.assignment_sent_at).unwrap_or(attempt.committed_at)
}

fn outcome(outcome: Option<AttemptOutcome>) -> &'static str {
    match outcome {
        Some(AttemptOutcome::Requeued) => "requeued",
        Some(AttemptOutcome::Failed) => "failed",
        Some(AttemptOutcome::Cancelled) => "cancelled",
        Some(AttemptOutcome::Finished) => "finished",
        None => "released",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{RunPath, RunState};

    #[test]
    fn no_endpoint_no_exporter() {
        assert!(exporter(None).expect("nothing to refuse").is_none());
    }

    #[test]
    fn a_bad_endpoint_is_named() {
        let error = exporter(Some("grpc://collector:4317")).expect_err("not http").to_string();
        assert!(error.contains("--otlp-endpoint") && error.contains("grpc://collector:4317"), "{error}");
    }

    fn attempt(number: u32, at: i64) -> Attempt {
        Attempt {
            number,
            sandbox_id: format!("sbx_{number}"),
            path: if number == 1 { RunPath::Warm } else { RunPath::Cold },
            credential_id: "c".into(),
            committed_at: Millis(at),
            assignment_sent_at: Some(Millis(at + 5)),
            delivery_confirmed_at: Some(Millis(at + 30)),
            started_at: None,
            ended_at: None,
            outcome: None,
            reason: None,
            install_us: None,
        }
    }

    #[test]
    fn a_requeued_run_is_one_trace_with_a_delivery_per_attempt() {
        let mut first = attempt(1, 1_010);
        (first.ended_at, first.outcome) = (Some(Millis(1_100)), Some(AttemptOutcome::Requeued));
        let mut second = attempt(2, 1_200);
        second.started_at = Some(Millis(1_290));
        let run = RunRecord {
            state: RunState::Running,
            attempts: vec![first, second],
            ..RunRecord::queued("exe_t".into(), Millis(1_000), Default::default(), None)
        };
        let spans = run_spans(&run);
        assert!(spans.iter().all(|span| span.trace_id == trace_id("exe_t")));
        let named = |name: &str| spans.iter().filter(|span| span.name == name).collect::<Vec<_>>();
        let ms = |span: &Span| (span.end_unix_nanos - span.start_unix_nanos) / 1_000_000;
        let root = named("submit")[0];
        assert_eq!((root.parent_span_id, ms(root)), (None, 290));
        assert_eq!(ms(named("placement")[0]), 200, "queued: submitted to the current attempt's commit");
        let deliveries = named("delivery");
        assert_eq!(deliveries.len(), 2);
        assert_eq!(deliveries[0].span_id, delivery_span_id("exe_t", 1));
        assert_eq!((ms(deliveries[0]), deliveries[0].error.as_deref()), (90, Some("attempt requeued")));
        assert_eq!((ms(deliveries[1]), deliveries[1].error.as_deref()), (90, None));
        assert_eq!(named("confirmation").len(), 2);
        let start = named("start");
        assert_eq!((start.len(), start[0].parent_span_id, ms(start[0])), (1, Some(deliveries[1].span_id), 60));
        assert!(spans.iter().filter(|span| span.name != "submit").all(|span| span.parent_span_id.is_some()));
    }
}
