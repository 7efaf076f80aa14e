//! [`Span`]s as the official protobuf messages.

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind as ProtoKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span as ProtoSpan, Status};

use crate::{Span, SpanKind, Value};

/// One request: one resource (`service.name` and `resource`), one scope,
/// the spans.
pub fn request(service_name: &str, resource: &[(&'static str, String)], spans: Vec<Span>) -> ExportTraceServiceRequest {
    let attributes = std::iter::once(("service.name", Value::from(service_name)))
        .chain(resource.iter().map(|(key, value)| (*key, Value::from(value.as_str()))))
        .map(key_value)
        .collect();
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource { attributes, ..Default::default() }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "standby".to_owned(),
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                    ..Default::default()
                }),
                spans: spans.into_iter().map(span).collect(),
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

fn span(span: Span) -> ProtoSpan {
    let kind = match span.kind {
        SpanKind::Internal => ProtoKind::Internal,
        SpanKind::Server => ProtoKind::Server,
        SpanKind::Client => ProtoKind::Client,
    };
    let status = match span.error {
        Some(message) => Status { message, code: StatusCode::Error as i32 },
        None => Status { message: String::new(), code: StatusCode::Unset as i32 },
    };
    ProtoSpan {
        trace_id: span.trace_id.to_vec(),
        span_id: span.span_id.to_vec(),
        trace_state: span.trace_state.unwrap_or_default(),
        parent_span_id: span.parent_span_id.map(|id| id.to_vec()).unwrap_or_default(),
        name: span.name.to_owned(),
        kind: kind as i32,
        start_time_unix_nano: span.start_unix_nanos,
        end_time_unix_nano: span.end_unix_nanos.max(span.start_unix_nanos),
        attributes: span.attributes.into_iter().map(key_value).collect(),
        status: Some(status),
        ..Default::default()
    }
}

fn key_value((key, value): (&'static str, Value)) -> KeyValue {
    let value = match value {
        Value::Str(text) => any_value::Value::StringValue(text),
        Value::Int(number) => any_value::Value::IntValue(number),
    };
    KeyValue { key: key.to_owned(), value: Some(AnyValue { value: Some(value) }), ..Default::default() }
}
