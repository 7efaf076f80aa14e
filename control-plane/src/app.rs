//! What every HTTP handler shares: the application state, the error
//! answer, the bearer credential, JSON bodies and store reads. Handlers
//! (`agent_api`, `user_api`) depend on this module and the router
//! (`server`) on them; nothing here depends on a handler.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use hyper::body::Body as _;
use standby_protocol::Spec;

use crate::credential::TokenHash;
use crate::engine::{EngineGone, EngineHandle};
use crate::listener::{BodyTimedOut, ListenerStats};
use crate::problem::{FieldProblem, Problem, pointer};
use crate::store::{Store, StoreError};

#[derive(Clone)]
pub(crate) struct AppState {
    pub engine: EngineHandle,
    pub store: Arc<dyn Store>,
    pub api_key: Arc<TokenHash>,
    pub spec: Arc<Spec>,
    /// A control connection that sends nothing for this long is closed.
    pub idle_timeout: Duration,
    /// The listener's bounds and counters (`/metrics`, the upgrade bound).
    pub listener: Arc<ListenerStats>,
    /// Where spans go, when traces are exported (`/metrics` counts the
    /// dropped ones).
    pub tracer: Option<standby_otlp::Tracer>,
    /// How the provider contains a sandbox's processes (`/metrics`).
    pub containment: &'static str,
    /// The replicated deployment, when the store is shared.
    pub cluster: Option<crate::cluster::Cluster>,
    /// Its agents' links (`crate::link`), when the store is shared.
    pub link: Option<std::sync::Arc<crate::link::Link>>,
}

/// An error answer. The agent-facing contract shows it as
/// `{"error": "...", "field": "..."}` (`field` when one field is to
/// blame); the user API as a problem ([`Problem`]).
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    field: Option<String>,
    place: Place,
}

/// Where the field to blame is: the JSON body (the default), a query
/// parameter or a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Body,
    Query,
    Header,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), field: None, place: Place::Body }
    }

    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// The field to blame is a query parameter.
    pub fn in_query(mut self) -> Self {
        self.place = Place::Query;
        self
    }

    /// The field to blame is a header.
    pub fn in_header(mut self) -> Self {
        self.place = Place::Header;
        self
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn field(&self) -> Option<&str> {
        self.field.as_deref()
    }

    pub fn place(&self) -> Place {
        self.place
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = serde_json::json!({ "error": self.message });
        if let Some(field) = self.field {
            body["field"] = serde_json::Value::String(field);
        }
        (self.status, Json(body)).into_response()
    }
}

impl From<EngineGone> for ApiError {
    fn from(_: EngineGone) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down")
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        tracing::error!(%error, "store read failed");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "the store could not be read")
    }
}

impl From<ApiError> for Problem {
    fn from(error: ApiError) -> Self {
        let mut problem = Problem::new(error.status(), error.message());
        if let Some(field) = error.field() {
            let (pointer, parameter, header) = match error.place() {
                Place::Body => (Some(pointer(field)), None, None),
                Place::Query => (None, Some(field.to_owned()), None),
                Place::Header => (None, None, Some(field.to_owned())),
            };
            problem.errors.push(FieldProblem { detail: error.message().to_owned(), pointer, parameter, header });
            problem.field = Some(field.to_owned());
        }
        problem
    }
}

impl From<EngineGone> for Problem {
    fn from(gone: EngineGone) -> Self {
        ApiError::from(gone).into()
    }
}

impl From<StoreError> for Problem {
    fn from(error: StoreError) -> Self {
        ApiError::from(error).into()
    }
}

/// The credential of an `Authorization: Bearer …` header.
pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|token| !token.is_empty())
}

/// Why a request body was not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Unread {
    #[error("the request body is over this call's limit of {0} bytes")]
    TooLarge(usize),
    #[error("the request body did not arrive whole within the body timeout")]
    TimedOut,
    #[error("the request body could not be read")]
    Broken,
}

impl Unread {
    pub(crate) fn status(self) -> StatusCode {
        match self {
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::TimedOut => StatusCode::REQUEST_TIMEOUT,
            Self::Broken => StatusCode::BAD_REQUEST,
        }
    }
}

/// Reads a request's body of at most `limit` bytes. Handlers call it only
/// once the request is authenticated from its head, so a client without a
/// credential makes the server hold none of its body; one that declares
/// more than `limit` is refused before a byte is read. The listener bounds
/// how long the body may take (`listener::Deadline`).
pub(crate) async fn read_body(body: Body, limit: usize) -> Result<Bytes, Unread> {
    if body.size_hint().lower() > limit as u64 {
        return Err(Unread::TooLarge(limit));
    }
    let mut stream = body.into_data_stream();
    let mut read = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|error| {
            let timed_out = std::iter::successors(Some(&error as &(dyn std::error::Error + 'static)), |e| e.source())
                .any(|e| e.is::<BodyTimedOut>());
            if timed_out { Unread::TimedOut } else { Unread::Broken }
        })?;
        if read.len() + chunk.len() > limit {
            return Err(Unread::TooLarge(limit));
        }
        read.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(read))
}

/// A blocking store read, off the async threads.
pub(crate) async fn from_store<T: Send + 'static>(
    state: &AppState,
    call: impl FnOnce(&dyn Store) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    let store = Arc::clone(&state.store);
    match tokio::task::spawn_blocking(move || call(store.as_ref())).await {
        Ok(result) => Ok(result?),
        Err(join) => std::panic::resume_unwind(join.into_panic()),
    }
}

pub(crate) fn bad(field: impl Into<String>, problem: impl std::fmt::Display) -> ApiError {
    let field = field.into();
    ApiError::new(StatusCode::BAD_REQUEST, format!("{field}: {problem}")).with_field(field)
}

/// Parses a JSON body, naming the offending field on failure and never
/// quoting a value (it may be a secret).
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        let message = inner.to_string();
        let named =
            |prefix: &str| message.strip_prefix(prefix).and_then(|rest| rest.split('`').nth(1)).map(str::to_owned);
        if let Some(name) = named("missing field ") {
            let field = if path == "." { name.clone() } else { format!("{path}.{name}") };
            return bad(field, "missing");
        }
        if let Some(name) = named("unknown field ") {
            // The path already ends with the unknown field's name.
            return bad(if path == "." { name } else { path }, "unknown field");
        }
        if path == "." {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "the body is not a JSON object of the expected shape: {}",
                    standby_protocol::describe_json_error(&inner)
                ),
            );
        }
        // serde's "invalid type: <value>, expected <what>": keep only what
        // was expected.
        match message.rsplit_once(", expected ") {
            Some((_, expected)) => {
                bad(path, format!("expected {}", expected.split(" at line ").next().unwrap_or(expected)))
            }
            None => bad(path, "wrong type or value"),
        }
    })?;
    deserializer
        .end()
        .map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "trailing characters after the JSON body"))?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{INVALID, NOT_FOUND};

    #[test]
    fn an_api_error_becomes_a_problem_naming_where_the_field_is() {
        let body = Problem::from(bad("attachments[0].name", "is used by another attachment"));
        assert_eq!((body.status, body.kind, body.title), (400, INVALID, "Invalid request"));
        assert_eq!(body.errors[0].pointer.as_deref(), Some("/attachments/0/name"));
        assert_eq!(body.field.as_deref(), Some("attachments[0].name"));
        let query =
            Problem::from(ApiError::new(StatusCode::BAD_REQUEST, "limit: too big").with_field("limit").in_query());
        assert_eq!((query.errors[0].parameter.as_deref(), query.errors[0].pointer.as_deref()), (Some("limit"), None));
        let gone = Problem::new(StatusCode::NOT_FOUND, "no run `x`");
        assert_eq!((gone.kind, gone.errors.len(), gone.field), (NOT_FOUND, 0, None));
    }
}
