//! Routing of the contract's HTTP calls into the state machine.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use standby_protocol::{SOCKET_PATH, SPEC_PATH};
use tokio::time::Instant;

use super::records::Endpoint;
use super::socket;
use super::state::{HttpAnswer, HttpRequest, Shared};

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route(SOCKET_PATH, get(socket::upgrade))
        .route(SPEC_PATH, any(spec))
        .route("/v1/executions/{id}/{*rest}", any(execution))
        .fallback(unexpected)
        .with_state(shared)
}

pub(crate) fn error_response(status: u16, retry_after: Option<u64>, message: &str) -> Response {
    respond(HttpAnswer {
        status,
        content_type: "application/json",
        body: serde_json::to_vec(&serde_json::json!({ "error": message })).unwrap_or_default(),
        retry_after,
    })
}

fn respond(answer: HttpAnswer) -> Response {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, answer.body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(answer.content_type));
    if let Some(seconds) = answer.retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

/// Which endpoint a method and path under `/v1/executions/{id}/` name.
fn endpoint(method: &Method, rest: &str) -> Option<(Endpoint, Option<String>)> {
    let get = method == Method::GET;
    let post = method == Method::POST;
    let endpoint = match rest {
        "secrets" if get => Endpoint::Secrets,
        "attachments" if get => Endpoint::Attachments,
        "git-credentials" if post => Endpoint::GitCredentials,
        "metadata" if get => Endpoint::Metadata,
        "cloud-credentials" if post => Endpoint::CloudCredentials,
        "events" if post => Endpoint::Events,
        "log" if post => Endpoint::Log,
        _ => {
            let name = rest.strip_prefix("attachments/").filter(|_| get)?;
            return Some((Endpoint::AttachmentFile, Some(name.to_owned())));
        }
    };
    Some((endpoint, None))
}

async fn call(shared: Arc<Shared>, request: HttpRequest<'_>) -> Response {
    let started = Instant::now();
    if let Some(latency) = shared.read(|inner| inner.latency(request.endpoint)) {
        tokio::time::sleep(latency).await;
    }
    respond(shared.update(|inner| inner.http(&request, started)))
}

async fn spec(State(shared): State<Arc<Shared>>, method: Method, uri: Uri, headers: HeaderMap) -> Response {
    if method != Method::GET {
        return unexpected(State(shared), method, uri).await;
    }
    let request = HttpRequest {
        endpoint: Endpoint::Spec,
        method: method.as_str(),
        path: uri.path(),
        execution_id: None,
        attachment: None,
        headers: &headers,
        body: &[],
    };
    call(shared, request).await
}

async fn execution(
    State(shared): State<Arc<Shared>>,
    Path((execution_id, rest)): Path<(String, String)>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match endpoint(&method, &rest) {
        Some((endpoint, attachment)) => {
            let request = HttpRequest {
                endpoint,
                method: method.as_str(),
                path: uri.path(),
                execution_id: Some(&execution_id),
                attachment: attachment.as_deref(),
                headers: &headers,
                body: &body,
            };
            call(shared, request).await
        }
        None => unexpected(State(shared), method, uri).await,
    }
}

/// A request the contract does not define: answered `404` and recorded as
/// a violation, since the agent has no business making it.
async fn unexpected(State(shared): State<Arc<Shared>>, method: Method, uri: Uri) -> Response {
    shared.update(|inner| inner.violation(format!("unexpected request {method} {uri}")));
    error_response(404, None, "not part of the contract")
}
