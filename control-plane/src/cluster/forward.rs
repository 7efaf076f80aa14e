//! A follower forwards: every HTTP call but the replica's own
//! ([`LOCAL_PATHS`]) goes to the leader's advertised URL as it came
//! (method, path, headers, streamed body), and its answer comes back as the
//! leader gave it (status, headers such as `Retry-After`, streamed body).
//! An agent's control socket is relayed frame by frame instead
//! ([`super::relay`]), so that it outlives the leader.
//!
//! Each forwarded call is a connection of its own to the leader; a relayed
//! socket holds one on the leader for as long as it lives (the capacity
//! cost of a follower's sockets, `docs/operations.md`).

use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

use super::{Cluster, Role};

/// What every replica answers itself.
pub const LOCAL_PATHS: &[&str] = &["/healthz", "/v1/cluster", "/metrics", "/openapi.json"];

/// The header a forwarded call carries (the forwarding replica's id): a
/// replica that does not lead answers it `503` instead of forwarding it
/// again, so a call never loops between replicas that disagree.
pub const FORWARDED_BY: &str = "standby-forwarded-by";

/// The middleware: lead → handle here; follow → forward; else `503`.
pub async fn route(State(cluster): State<Cluster>, request: Request, next: Next) -> Response {
    if LOCAL_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let view = cluster.view.borrow().clone();
    match (view.role, view.leader) {
        (Role::Leader, _) => next.run(request).await,
        (Role::Follower, Some((_, url)))
            if request.uri().path() == standby_protocol::SOCKET_PATH
                && request.headers().contains_key(header::UPGRADE)
                && !request.headers().contains_key(FORWARDED_BY) =>
        {
            super::relay::socket(cluster.clone(), url, view.epoch, request).await
        }
        (Role::Follower, Some((_, url))) if !request.headers().contains_key(FORWARDED_BY) => {
            cluster.stats.forwarded_requests.fetch_add(1, Ordering::Relaxed);
            forward(&view.replica_id, &url, request).await.unwrap_or_else(|problem| unavailable(&problem))
        }
        (role, _) => unavailable(&format!("this replica is {} and knows no leader right now", role.as_str())),
    }
}

/// `503` with `Retry-After: 1`: the caller retries, by then a leader is
/// known (or the load balancer picked another replica).
pub(super) fn unavailable(detail: &str) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": "Service Unavailable",
        "status": 503,
        "detail": detail,
    });
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::CONTENT_TYPE, "application/problem+json"), (header::RETRY_AFTER, "1")],
        body.to_string(),
    )
        .into_response()
}

async fn forward(me: &str, leader: &str, request: Request) -> Result<Response, String> {
    let target: Uri = leader.parse().map_err(|_| format!("the leader's URL `{leader}` is not a URL"))?;
    if target.scheme_str() != Some("http") {
        return Err(format!("the leader's URL `{leader}` is not http://: only plain HTTP is forwarded"));
    }
    let authority = target.authority().ok_or_else(|| format!("the leader's URL `{leader}` has no host"))?.clone();
    let port = authority.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((authority.host().trim_matches(['[', ']']), port))
        .await
        .map_err(|error| format!("cannot reach the leader at {leader}: {error}"))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|error| format!("cannot talk to the leader at {leader}: {error}"))?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "a forwarded connection ended");
        }
    });
    let (mut parts, body) = request.into_parts();
    parts.uri = parts.uri.path_and_query().map_or_else(|| Uri::from_static("/"), |path| Uri::from(path.clone()));
    if let Ok(value) = HeaderValue::from_str(me) {
        parts.headers.insert(FORWARDED_BY, value);
    }
    let response = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .map_err(|error| format!("the leader at {leader} did not answer: {error}"))?;
    Ok(response.map(Body::new))
}
