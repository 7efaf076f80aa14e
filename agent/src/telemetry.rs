//! The agent's spans (`STANDBY_OTLP_ENDPOINT`, contract 1.3): one per
//! install step, the delivery confirmation and the spawn of the run, as
//! children of the span the assignment's `trace_context` names (the
//! server's delivery span), so they join the server's trace of the run.
//!
//! They are made of the same measurements as the `run started` log line
//! (`Installed::steps`, the confirmation and spawn instants), placed on
//! the wall clock by one anchor taken when the assignment was accepted.
//! An assignment without a usable context (none, or a malformed
//! `traceparent`: ignored, never an error) gets a trace of the agent's
//! own. Without an endpoint nothing here is made.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use standby_otlp::{Exporter, ExporterConfig, Span, SpanKind, Value};
use standby_protocol::{Stage, TraceContext};
use tokio::time::Instant;

use crate::install::Timed;

/// Bound on one export: a collector that never answers delays the agent's
/// exit by at most this, once.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(2);

/// The exporter of `endpoint` (already a traces URL), sending with the
/// agent's one TLS configuration.
pub(crate) fn exporter(endpoint: &reqwest::Url, tls: &Arc<rustls::ClientConfig>) -> Result<Exporter, String> {
    crate::api::install_tls_provider();
    let client = reqwest::Client::builder()
        .tls_backend_preconfigured(rustls::ClientConfig::clone(tls))
        .user_agent(concat!("standby/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("the OTLP client: {e}"))?;
    let mut config = ExporterConfig::new(endpoint.clone(), "standby-agent");
    config.resource.push(("service.version", env!("CARGO_PKG_VERSION").to_owned()));
    config.timeout = EXPORT_TIMEOUT;
    Ok(Exporter::spawn(client, config))
}

/// Where one run's spans go in its trace.
#[derive(Debug, Clone)]
pub(crate) struct RunTrace {
    trace_id: [u8; 16],
    /// The server's delivery span; `None` for a trace of the agent's own.
    parent: Option<[u8; 8]>,
    trace_state: Option<String>,
    execution_id: String,
    /// One instant and the wall-clock time it was.
    anchor: (Instant, SystemTime),
}

/// What the agent measured of one run's way to its start.
#[derive(Debug)]
pub(crate) struct Measured<'a> {
    /// Assignment accepted → replay received on the run credential.
    pub confirm: Option<(Instant, Instant)>,
    pub steps: &'a [Timed],
    /// The spawn on the prepared terminal: began, the run's process exists.
    pub spawn: (Instant, Instant),
}

impl RunTrace {
    /// The trace of `execution_id`, joined to `context` when it names a
    /// parent well formed.
    pub(crate) fn new(execution_id: &str, context: Option<&TraceContext>, anchor: (Instant, SystemTime)) -> Self {
        let joined = context.and_then(|context| match context.parent() {
            Ok(parent) => Some((parent, context.valid_tracestate().map(str::to_owned))),
            Err(error) => {
                tracing::debug!(%error, "the assignment's trace context is ignored");
                None
            }
        });
        let (trace_id, parent, trace_state) = match joined {
            Some((parent, state)) => (parent.trace_id, Some(parent.parent_id), state),
            None => (standby_otlp::trace_id(), None, None),
        };
        Self { trace_id, parent, trace_state, execution_id: execution_id.to_owned(), anchor }
    }

    fn nanos(&self, at: Instant) -> u64 {
        let (instant, wall) = self.anchor;
        let at = if at >= instant { wall + (at - instant) } else { wall - (instant - at) };
        standby_otlp::unix_nanos(at)
    }

    fn span(&self, name: &'static str, stage: &'static str, (from, to): (Instant, Instant)) -> Span {
        Span {
            trace_id: self.trace_id,
            span_id: standby_otlp::span_id(),
            parent_span_id: self.parent,
            trace_state: self.trace_state.clone(),
            name,
            kind: SpanKind::Internal,
            start_unix_nanos: self.nanos(from),
            end_unix_nanos: self.nanos(to),
            attributes: vec![
                ("standby.execution_id", Value::from(self.execution_id.as_str())),
                ("standby.stage", stage.into()),
            ],
            error: None,
        }
    }

    /// The spans of a started run.
    pub(crate) fn spans(&self, measured: &Measured<'_>) -> Vec<Span> {
        let confirm = measured.confirm.map(|span| self.span("install.confirm", Stage::Confirm.name(), span));
        let steps = measured.steps.iter().map(|timed| {
            self.span(step_name(timed.stage), timed.stage.name(), (timed.start, timed.start + timed.took))
        });
        let spawn = self.span("spawn", Stage::Start.name(), measured.spawn);
        confirm.into_iter().chain(steps).chain([spawn]).collect()
    }
}

fn step_name(stage: Stage) -> &'static str {
    match stage {
        Stage::Confirm => "install.confirm",
        Stage::Mcp => "install.mcp",
        Stage::Check => "install.check",
        Stage::SamePreparation => "install.same_preparation",
        Stage::Secrets => "install.secrets",
        Stage::Attachments => "install.attachments",
        Stage::Metadata => "install.metadata",
        Stage::CloudCredentials => "install.cloud_credentials",
        Stage::GitCredentials => "install.git_credentials",
        Stage::Refresh => "install.refresh",
        Stage::Terminal => "install.terminal",
        Stage::Start => "spawn",
        Stage::Prepare | Stage::Install | Stage::Terminated => "install",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn measured_at(at: Instant) -> (Vec<Timed>, (Instant, Instant)) {
        let ms = Duration::from_millis;
        let steps = vec![
            Timed { stage: Stage::Check, start: at + ms(2), took: ms(1) },
            Timed { stage: Stage::Secrets, start: at + ms(3), took: ms(20) },
        ];
        (steps, (at + ms(30), at + ms(35)))
    }

    #[test]
    fn spans_are_children_of_the_servers_delivery_with_the_measured_durations() {
        let at = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let context = TraceContext { traceparent: PARENT.into(), tracestate: Some("k=v".into()) };
        let trace = RunTrace::new("exe_1", Some(&context), (at, wall));
        let (steps, spawn) = measured_at(at);
        let spans =
            trace.spans(&Measured { confirm: Some((at, at + Duration::from_millis(12))), steps: &steps, spawn });
        let names: Vec<_> = spans.iter().map(|span| span.name).collect();
        assert_eq!(names, ["install.confirm", "install.check", "install.secrets", "spawn"]);
        let parent = context.parent().expect("well formed");
        for span in &spans {
            assert_eq!((span.trace_id, span.parent_span_id), (parent.trace_id, Some(parent.parent_id)));
            assert_eq!(span.trace_state.as_deref(), Some("k=v"));
        }
        let ms = |span: &Span| (span.end_unix_nanos - span.start_unix_nanos) / 1_000_000;
        assert_eq!(spans.iter().map(ms).collect::<Vec<_>>(), [12, 1, 20, 5]);
        assert_eq!(spans[1].start_unix_nanos, 1_000_002_000_000, "placed on the wall clock by the anchor");
    }

    #[test]
    fn a_malformed_or_missing_context_makes_a_trace_of_its_own() {
        let at = Instant::now();
        let bad = TraceContext { traceparent: "00-nonsense".into(), tracestate: Some("k=v".into()) };
        for context in [Some(&bad), None] {
            let trace = RunTrace::new("exe_1", context, (at, SystemTime::now()));
            let (steps, spawn) = measured_at(at);
            let spans = trace.spans(&Measured { confirm: None, steps: &steps, spawn });
            assert_eq!(spans.len(), 3);
            assert!(spans.iter().all(|span| span.parent_span_id.is_none() && span.trace_state.is_none()));
            assert!(spans.iter().all(|span| span.trace_id == spans[0].trace_id && span.trace_id != [0; 16]));
        }
    }
}
