//! The router: one route per call of the contract, by the protocol's table
//! of them ([`Endpoint`]).

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, get, on};
use standby_protocol::{Endpoint, Method as ContractMethod, SOCKET_PATH};
use tokio::time::Instant;

use super::calls::{HttpAnswer, HttpRequest};
use super::socket;
use super::state::Shared;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Endpoint::ALL
        .into_iter()
        .fold(Router::new().route(SOCKET_PATH, get(socket::upgrade)), |router, endpoint| {
            let handler =
                move |State(shared): State<Arc<Shared>>,
                      Path(params): Path<Vec<String>>,
                      method: Method,
                      uri: Uri,
                      headers: HeaderMap,
                      body: Bytes| call(shared, endpoint, params, method, uri, headers, body);
            let method = match endpoint.method() {
                ContractMethod::Get => MethodFilter::GET,
                ContractMethod::Post => MethodFilter::POST,
            };
            router.route(endpoint.route(), on(method, handler).fallback(unexpected))
        })
        .fallback(unexpected)
        .with_state(shared)
}

pub(crate) fn respond(answer: HttpAnswer) -> Response {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, answer.body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(answer.content_type));
    if let Some(seconds) = answer.retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

/// One call: `params` are the route's, in order (the execution id, then
/// an attachment's name).
async fn call(
    shared: Arc<Shared>,
    endpoint: Endpoint,
    params: Vec<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let started = Instant::now();
    if let Some(latency) = shared.read(|inner| inner.faults.latency(endpoint)) {
        tokio::time::sleep(latency).await;
    }
    let request = HttpRequest {
        endpoint,
        method: method.as_str(),
        path: uri.path(),
        execution_id: params.first().map(String::as_str),
        attachment: params.get(1).map(String::as_str),
        headers: &headers,
        body: &body,
    };
    respond(shared.update(|inner| inner.http(&request, started)))
}

/// A request the contract does not define: answered `404` and recorded as
/// a violation, since the agent has no business making it.
async fn unexpected(State(shared): State<Arc<Shared>>, method: Method, uri: Uri) -> Response {
    shared.update(|inner| inner.violation(format!("unexpected request {method} {uri}")));
    respond(HttpAnswer::error(404, "not part of the contract"))
}
