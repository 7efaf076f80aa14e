//! A follower forwards: every HTTP call but the replica's own
//! ([`LOCAL_PATHS`]) goes to the leader's advertised URL as it came
//! (method, path, headers, streamed body), and its answer comes back as the
//! leader gave it (status, headers such as `Retry-After`, streamed body).
//! An agent's control socket is not forwarded: this replica holds it and
//! speaks for it to the leader over its one link ([`super::link`]).
//!
//! Nothing is sent to a leader before it proved the cluster secret for its
//! id, epoch and URL ([`super::trust`]): the lease row is not trusted.
//!
//! Every step is bounded: a leader that stops answering (paused, cut off)
//! holds a call at most [`answer_bound`], and less once another replica
//! leads: the call is then tried once on the new leader, when sending it
//! again is safe ([`Replay`]), else answered `503` with `Retry-After`. The
//! caller never sees the leader's internal URL or an OS error: those are
//! logged.
//!
//! Each forwarded call is a connection of its own to the leader.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody as _};
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::sync::watch;

use super::trust::{self, TOKEN_HEADER, Target};
use super::{Cluster, ClusterView, Role};
use crate::problem::Problem;

/// What every replica answers itself.
pub const LOCAL_PATHS: &[&str] = &["/healthz", "/v1/cluster", "/metrics", "/openapi.json"];

/// The header a forwarded call carries (the forwarding replica's id): a
/// replica that does not lead answers it `503` instead of forwarding it
/// again, so a call never loops between replicas that disagree. Honoured
/// only with a valid [`TOKEN_HEADER`].
pub const FORWARDED_BY: &str = "standby-forwarded-by";

/// Connecting to the leader and the HTTP handshake: a live leader on the
/// network of its replicas answers far sooner.
pub(super) const CONNECT_BOUND: Duration = Duration::from_secs(2);

/// How long a forwarded call waits for the head of the leader's answer:
/// three lease times, as long as a relay waits for a new leader. By then a
/// leader that stopped answering has lost its lease, and its successor is
/// known unless the database is gone too. A successor known earlier ends
/// the wait at once.
pub fn answer_bound(ttl: Duration) -> Duration {
    ttl * 3
}

/// Bodies a call may be sent again with are kept in memory up to this
/// (the agent's log chunks are at most 1 MiB); a larger one is streamed
/// and sent once.
const REPLAY_MAX: u64 = 2 << 20;

/// The middleware: proof challenges answered; lead → handle here; follow
/// → forward; else `503`.
pub async fn route(State(cluster): State<Cluster>, mut request: Request, next: Next) -> Response {
    if request.uri().path() == trust::PROOF_PATH {
        return trust::answer(&cluster, &request);
    }
    // Who forwarded a call is believed only on the cluster secret's word:
    // both headers are gone before any handler sees the call.
    let token = request.headers_mut().remove(TOKEN_HEADER);
    let forwarded = request.headers_mut().remove(FORWARDED_BY).is_some();
    let meant_for = trust::forwarded_by_replica(&cluster, token.as_ref());
    if forwarded && meant_for.is_none() {
        tracing::warn!(
            path = request.uri().path(),
            "a call claiming to be forwarded does not prove the cluster secret"
        );
        return Problem::new(StatusCode::FORBIDDEN, "a forwarded call must come from a replica of this deployment")
            .into_response();
    }
    if request.uri().path() == super::LINK_PATH && !forwarded {
        // Only a replica links: never forwarded for an outside caller.
        return Problem::new(StatusCode::FORBIDDEN, "only a replica of this deployment links to the leader")
            .into_response();
    }
    if LOCAL_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let meant_for = meant_for.filter(|_| forwarded);
    let view = cluster.view.borrow().clone();
    match (view.role, view.leader.clone()) {
        // A call forwarded to the leader of another epoch is not ours to
        // answer (a restarted replica of the same id): the caller retries.
        (Role::Leader, _) if forwarded && meant_for.as_ref().map(|by| by.epoch) != Some(view.epoch) => {
            unavailable("the call was forwarded to a former leader: retry")
        }
        // A leader whose lease's local deadline passed (it was paused, and
        // has not yet noticed it is deposed) answers nothing from its
        // memory: another replica may lead by now (seen: a paused leader,
        // woken, told a new cold sandbox's agent its credential was gone).
        (Role::Leader, _) if cluster.leadership.lapsed(std::time::Instant::now()) => {
            unavailable("this replica's lease lapsed: retry")
        }
        (Role::Leader, _) => {
            if let Some(by) = meant_for {
                request.extensions_mut().insert(by);
            }
            next.run(request).await
        }
        (Role::Follower, Some((id, url))) if !forwarded => {
            if request.uri().path() == standby_protocol::SOCKET_PATH && request.headers().contains_key(header::UPGRADE)
            {
                // Held here, not forwarded: the socket's handler speaks for
                // it over this replica's link (`crate::link`).
                return next.run(request).await;
            }
            let target = Target { id, url, epoch: view.epoch };
            cluster.stats.forwarded_requests.fetch_add(1, Ordering::Relaxed);
            forward(&cluster, &view, target, request, next).await
        }
        (role, _) => {
            tracing::debug!(role = role.as_str(), forwarded, "no leader to forward to");
            unavailable("no leader is reachable right now: retry")
        }
    }
}

/// `503` with `Retry-After: 1` in the API's problem format: the caller
/// retries, by then a leader is known (or the load balancer picked another
/// replica). `detail` names nothing internal.
pub(crate) fn unavailable(detail: &'static str) -> Response {
    let mut response = Problem::new(StatusCode::SERVICE_UNAVAILABLE, detail).into_response();
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// Why an attempt at the leader failed; logged, never shown to the caller.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Failure {
    #[error("the leader does not prove the cluster secret: {0}")]
    Untrusted(String),
    #[error("cannot connect to the leader: {0}")]
    Connect(String),
    #[error("the leader did not answer within {0:?}")]
    Silent(Duration),
    #[error("another replica leads now")]
    Superseded,
    #[error("the leader's connection failed: {0}")]
    Broken(String),
    #[error("no slot is left under the connection cap for a connection to the leader")]
    AtCap,
}

/// A call's body as sending it again allows.
enum Replay {
    /// Kept: the call may be sent again (a safe method, an
    /// `Idempotency-Key`, or an agent call, which the contract makes
    /// idempotent: events by id, log chunks by offset).
    Kept(Bytes),
    /// Streamed, once; `None` once sent.
    Once(Option<Body>),
}

impl Replay {
    async fn of(parts: &Parts, body: Body) -> Self {
        let idempotent = matches!(parts.method, Method::GET | Method::HEAD | Method::OPTIONS)
            || parts.headers.contains_key("idempotency-key")
            || parts.uri.path().starts_with("/v1/executions/");
        let small = body.size_hint().upper().is_some_and(|upper| upper <= REPLAY_MAX);
        if !(idempotent && small) {
            return Self::Once(Some(body));
        }
        match axum::body::to_bytes(body, REPLAY_MAX as usize).await {
            Ok(bytes) => Self::Kept(bytes),
            // The caller's upload failed: nothing to forward.
            Err(_) => Self::Once(Some(Body::empty())),
        }
    }

    /// The body for the next attempt; `None` when it was sent already.
    fn take(&mut self) -> Option<Body> {
        match self {
            Self::Kept(bytes) => Some(Body::from(bytes.clone())),
            Self::Once(body) => body.take(),
        }
    }
}

/// Forwards `request` to `target`; when that fails and another replica
/// leads by then, once more to it (or handles it here, when this replica
/// took the lease), if the call can be sent again.
async fn forward(cluster: &Cluster, view: &ClusterView, target: Target, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let mut body = Replay::of(&parts, body).await;
    let failure = match attempt(cluster, &view.replica_id, &target, &parts, &mut body).await {
        Ok(response) => return response,
        Err(Failure::AtCap) => return unavailable("this replica holds all the connections it may: retry"),
        Err(failure) => failure,
    };
    tracing::warn!(leader = target.id, url = target.url, epoch = target.epoch, %failure, "forwarding a call failed");
    let now = cluster.view.borrow().clone();
    if now.epoch <= target.epoch {
        return unavailable("the leader did not answer: retry");
    }
    let Some(body) = body.take() else {
        return unavailable("the leader changed while the call was under way: retry");
    };
    match (now.role, now.leader) {
        (Role::Leader, _) => next.run(Request::from_parts(parts, body)).await,
        (Role::Follower, Some((id, url))) => {
            let next_target = Target { id, url, epoch: now.epoch };
            let mut body = Replay::Once(Some(body));
            match attempt(cluster, &now.replica_id, &next_target, &parts, &mut body).await {
                Ok(response) => response,
                Err(failure) => {
                    tracing::warn!(leader = next_target.id, url = next_target.url, %failure, "forwarding a call to the new leader failed");
                    unavailable("the leader did not answer: retry")
                }
            }
        }
        _ => unavailable("no leader is reachable right now: retry"),
    }
}

/// One try at `target`: proven, connected, sent, and its answer's head
/// back within the bounds, unless another replica takes the lease first.
async fn attempt(
    cluster: &Cluster,
    me: &str,
    target: &Target,
    parts: &Parts,
    body: &mut Replay,
) -> Result<Response, Failure> {
    trust::verify(cluster, target).await?;
    let mut sender = connect(cluster, &target.url).await?;
    let mut request = Request::builder()
        .method(parts.method.clone())
        .uri(parts.uri.path_and_query().map_or_else(|| Uri::from_static("/"), |path| Uri::from(path.clone())))
        .version(parts.version)
        .body(body.take().unwrap_or_default())
        .map_err(|error| Failure::Broken(error.to_string()))?;
    *request.headers_mut() = parts.headers.clone();
    trust::sign(cluster, me, target, request.headers_mut());
    let bound = answer_bound(cluster.ttl);
    let mut view = cluster.view.clone();
    tokio::select! {
        answer = tokio::time::timeout(bound, sender.send_request(request)) => match answer {
            Ok(Ok(response)) => Ok(response.map(Body::new)),
            Ok(Err(error)) => Err(Failure::Broken(error.to_string())),
            Err(_) => Err(Failure::Silent(bound)),
        },
        () = superseded(&mut view, target.epoch) => Err(Failure::Superseded),
    }
}

/// Resolves once a leader of a newer epoch than `epoch` is known (this
/// replica included).
pub(super) async fn superseded(view: &mut watch::Receiver<ClusterView>, epoch: u64) {
    if view.wait_for(|view| view.epoch > epoch && view.leader.is_some()).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// An HTTP/1 connection to `url` (plain `http://`), within
/// [`CONNECT_BOUND`], counted under the listener's cap for as long as it is
/// open: it holds a descriptor as a client's connection does.
pub(super) async fn connect(cluster: &Cluster, url: &str) -> Result<SendRequest<Body>, Failure> {
    let slot = cluster.listener.outgoing().ok_or(Failure::AtCap)?;
    let target: Uri = url.parse().map_err(|_| Failure::Connect("the URL is not a URL".into()))?;
    if target.scheme_str() != Some("http") {
        return Err(Failure::Connect("the URL is not http://: only plain HTTP is forwarded".into()));
    }
    let authority = target.authority().ok_or_else(|| Failure::Connect("the URL has no host".into()))?.clone();
    let port = authority.port_u16().unwrap_or(80);
    let open = async {
        let stream = tokio::net::TcpStream::connect((authority.host().trim_matches(['[', ']']), port))
            .await
            .map_err(|error| Failure::Connect(error.to_string()))?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|error| Failure::Connect(error.to_string()))?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "a forwarded connection ended");
            }
            drop(slot);
        });
        Ok(sender)
    };
    tokio::time::timeout(CONNECT_BOUND, open).await.map_err(|_| Failure::Silent(CONNECT_BOUND))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_a_call_safe_to_send_again_keeps_its_body() {
        let parts = |method: Method, path: &str, key: bool| {
            let mut request = Request::builder().method(method).uri(path);
            if key {
                request = request.header("idempotency-key", "k");
            }
            request.body(()).expect("a request").into_parts().0
        };
        let kept = |replay: &Replay| matches!(replay, Replay::Kept(_));
        assert!(kept(&Replay::of(&parts(Method::GET, "/v1/runs", false), Body::empty()).await));
        assert!(kept(&Replay::of(&parts(Method::POST, "/v1/runs", true), Body::from("{}")).await));
        assert!(kept(&Replay::of(&parts(Method::POST, "/v1/executions/r/log", false), Body::from("x")).await));
        assert!(!kept(&Replay::of(&parts(Method::POST, "/v1/runs", false), Body::from("{}")).await));
        assert!(!kept(&Replay::of(&parts(Method::POST, "/v1/runs/r/cancel", false), Body::empty()).await));
        let mut once = Replay::of(&parts(Method::POST, "/v1/runs", false), Body::from("{}")).await;
        assert!(once.take().is_some() && once.take().is_none(), "a streamed body is sent once");
    }
}
