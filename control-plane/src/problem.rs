//! The user API's one error shape: a problem (RFC 9457) served as
//! `application/problem+json`, with `type`, `title`, `status`, `detail`
//! and, when a field is to blame, where it is: a JSON pointer into the body
//! (`/attachments/0/name`), a query parameter or a header. The agent-facing
//! contract keeps its own shape (`app::ApiError`'s `{"error", "field"}`,
//! which `app.rs` turns into a problem for the user API).
//!
//! It depends on no other module of the server, so that the follower's
//! forwarding (`cluster::forward`) answers in it without depending on the
//! handlers.

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

/// The media type of every 4xx and 5xx answer of the user API.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The problem types this server answers with: each `type` URI, its
/// title, and what it means.
pub const TYPES: [(&str, &str, &str); 9] = [
    (INVALID, "Invalid request", "a parameter, header or body field is refused: `errors` says which"),
    (UNAUTHORIZED, "Unauthorized", "no `Authorization: Bearer <api key>`, or not the server's key"),
    (NOT_FOUND, "Not found", "no run or thread with that id"),
    (CONFLICT, "Conflict", "the run is finished: it cannot be cancelled"),
    (TOO_LARGE, "Request too large", "the body is over the server's limit"),
    (KEY_REUSED, "Idempotency key reused", "the `Idempotency-Key` was used with another body"),
    (INTERNAL, "Internal error", "the server failed (its log says why)"),
    (
        UNAVAILABLE,
        "Unavailable",
        "the server is shutting down, or no leader answers right now: retry after `Retry-After`",
    ),
    (OTHER, "Error", "any other refusal"),
];

pub(crate) const INVALID: &str = "urn:standby:problem:invalid-request";
const UNAUTHORIZED: &str = "urn:standby:problem:unauthorized";
pub(crate) const NOT_FOUND: &str = "urn:standby:problem:not-found";
const CONFLICT: &str = "urn:standby:problem:conflict";
const TOO_LARGE: &str = "urn:standby:problem:too-large";
/// `POST /v1/runs` with an `Idempotency-Key` already used for another body.
pub const KEY_REUSED: &str = "urn:standby:problem:idempotency-key-reused";
const INTERNAL: &str = "urn:standby:problem:internal";
const UNAVAILABLE: &str = "urn:standby:problem:unavailable";
const OTHER: &str = "urn:standby:problem:error";

/// An error answer of the user API (RFC 9457).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Problem {
    /// What kind of problem: one of the `urn:standby:problem:…` URIs
    /// listed in the API's description.
    #[serde(rename = "type")]
    #[schema(pattern = "^urn:standby:problem:[a-z-]+$")]
    pub kind: &'static str,
    /// The kind's short, fixed summary.
    pub title: &'static str,
    /// The HTTP status, repeated.
    #[schema(minimum = 400, maximum = 599)]
    pub status: u16,
    /// What went wrong with this request. Never quotes a submitted value
    /// (it may be a secret).
    pub detail: String,
    /// The field to blame in the API's own syntax (`attachments[0].name`,
    /// `env.NAME`, a parameter or header name), when one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The fields to blame, for a refused request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<FieldProblem>,
}

/// One field of a refused request, and what is wrong with it. Exactly one
/// of `pointer`, `parameter` and `header` says where it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct FieldProblem {
    pub detail: String,
    /// A JSON pointer (RFC 6901) into the request body.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pointer: Option<String>,
    /// A query parameter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameter: Option<String>,
    /// A request header.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
}

impl Problem {
    /// A problem of `status`, its type chosen by the status.
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        let kind = match status {
            StatusCode::BAD_REQUEST => INVALID,
            StatusCode::UNAUTHORIZED => UNAUTHORIZED,
            StatusCode::NOT_FOUND => NOT_FOUND,
            StatusCode::CONFLICT => CONFLICT,
            StatusCode::PAYLOAD_TOO_LARGE => TOO_LARGE,
            StatusCode::INTERNAL_SERVER_ERROR => INTERNAL,
            StatusCode::SERVICE_UNAVAILABLE => UNAVAILABLE,
            _ => OTHER,
        };
        Self::of_type(kind, status, detail)
    }

    /// A problem of an explicit type.
    pub fn of_type(kind: &'static str, status: StatusCode, detail: impl Into<String>) -> Self {
        let title = TYPES.iter().find(|(uri, ..)| *uri == kind).map_or("Error", |(_, title, _)| title);
        Self { kind, title, status: status.as_u16(), detail: detail.into(), field: None, errors: Vec::new() }
    }

    /// Blames the request header `name`.
    pub fn with_header(mut self, name: &str) -> Self {
        let detail = self.detail.clone();
        self.errors.push(FieldProblem { detail, pointer: None, parameter: None, header: Some(name.to_owned()) });
        self.field = Some(name.to_owned());
        self
    }

    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl From<QueryRejection> for Problem {
    fn from(rejection: QueryRejection) -> Self {
        Problem::new(StatusCode::BAD_REQUEST, format!("the query string is refused: {}", rejection.body_text()))
    }
}

impl From<PathRejection> for Problem {
    fn from(rejection: PathRejection) -> Self {
        Problem::new(StatusCode::BAD_REQUEST, format!("the path is refused: {}", rejection.body_text()))
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, Json(self)).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Submission fields whose members are named by the caller: what follows
/// `env.` is one name, whatever it holds.
const MAPS: [&str; 4] = ["env", "mcp_env", "secrets", "cloud_env"];

/// The JSON pointer (RFC 6901) of a field in the API's syntax:
/// `workspace.repos[0].url` → `/workspace/repos/0/url`, `env.A.B` →
/// `/env/A.B`.
pub fn pointer(field: &str) -> String {
    let mut tokens: Vec<String> = Vec::new();
    let (head, map_key) = match field.split_once('.') {
        Some((head, rest)) if MAPS.contains(&head) => (head, Some(rest)),
        _ => (field, None),
    };
    let path = if map_key.is_some() { head } else { field };
    for part in path.split('.') {
        let (name, indices) = part.split_once('[').map_or((part, ""), |(name, rest)| (name, rest));
        tokens.push(name.to_owned());
        for index in indices.split('[').filter(|index| !index.is_empty()) {
            tokens.push(index.trim_end_matches(']').to_owned());
        }
    }
    tokens.extend(map_key.map(str::to_owned));
    tokens.iter().map(|token| format!("/{}", token.replace('~', "~0").replace('/', "~1"))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_become_json_pointers() {
        let cases = [
            ("command", "/command"),
            ("command[2]", "/command/2"),
            ("attachments[0].name", "/attachments/0/name"),
            ("workspace.setup[1].command[0]", "/workspace/setup/1/command/0"),
            ("env.A.B", "/env/A.B"),
            ("secrets.x/y~z", "/secrets/x~1y~0z"),
            ("thread_id", "/thread_id"),
        ];
        for (field, expected) in cases {
            assert_eq!(pointer(field), expected, "{field}");
        }
    }

    #[test]
    fn every_type_has_a_title() {
        for (uri, title, _) in TYPES {
            assert!(uri.starts_with("urn:standby:problem:") && !title.is_empty());
        }
        assert_eq!(Problem::of_type(KEY_REUSED, StatusCode::UNPROCESSABLE_ENTITY, "x").title, "Idempotency key reused");
    }
}
