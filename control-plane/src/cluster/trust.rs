//! How replicas recognise each other ([`super::secret`] has the proofs).
//!
//! The lease row names the leader and its URL, but whoever may write the
//! database (the server's own role included) may rewrite it. So before a
//! follower forwards a call or relays a socket to the leader the row names,
//! it challenges that URL with a fresh nonce ([`verify`]); only a process
//! holding the cluster secret can answer it for that leader's id, epoch
//! and that very URL ([`answer`]). The challenge carries nothing secret,
//! and a proven target is kept until the view names another, so a call
//! costs one challenge per leader and epoch, not one each.
//!
//! The other way, a forwarded call carries the follower's token
//! ([`sign`]), which the leader checks ([`forwarded_by_replica`]) before
//! it takes the call as forwarded.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::forward::{CONNECT_BOUND, FORWARDED_BY, Failure, connect};
use super::{Cluster, Role};

/// The challenge's route, answered by every replica itself (the leader
/// with a proof, any other with `503`).
pub const PROOF_PATH: &str = "/v1/cluster/proof";
/// The follower's nonce (hex), on the challenge.
pub const NONCE_HEADER: &str = "standby-cluster-nonce";
/// The leader's proof (hex), on its answer.
pub const PROOF_HEADER: &str = "standby-cluster-proof";
/// The follower's token, on every forwarded call and relayed socket.
pub const TOKEN_HEADER: &str = "standby-cluster-token";

/// A nonce longer than this is not ours.
const NONCE_MAX: usize = 128;

/// A leader as the view names it: its id, its URL, its epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub id: String,
    pub url: String,
    pub epoch: u64,
}

/// The last target that proved the secret.
#[derive(Debug, Default)]
pub struct Proven(tokio::sync::Mutex<Option<Target>>);

/// Challenges `target` unless it proved itself already. One challenge at a
/// time: the calls arriving meanwhile wait for its outcome.
pub(crate) async fn verify(cluster: &Cluster, target: &Target) -> Result<(), Failure> {
    let mut proven = cluster.proven.0.lock().await;
    if proven.as_ref() == Some(target) {
        return Ok(());
    }
    let nonce = crate::credential::hex(&rand::random::<[u8; 32]>());
    let answered = tokio::time::timeout(CONNECT_BOUND * 2, challenge(cluster, &target.url, &nonce)).await;
    let proof = answered.map_err(|_| Failure::Silent(CONNECT_BOUND * 2))??;
    if !cluster.secret.verify_leader(&proof, &nonce, &target.id, target.epoch, &target.url) {
        tracing::error!(
            leader = target.id,
            url = target.url,
            epoch = target.epoch,
            "the URL the lease names for the leader does not prove the cluster secret for it: nothing is sent \
             there (a rewritten lease row, or replicas with different secrets)"
        );
        return Err(Failure::Untrusted("a wrong proof".into()));
    }
    tracing::info!(leader = target.id, url = target.url, epoch = target.epoch, "the leader proved the cluster secret");
    *proven = Some(target.clone());
    Ok(())
}

/// `GET {url}/v1/cluster/proof` with `nonce`: the proof the answer carries.
async fn challenge(cluster: &Cluster, url: &str, nonce: &str) -> Result<String, Failure> {
    let mut sender = connect(cluster, url).await?;
    let request = Request::get(PROOF_PATH)
        .header(NONCE_HEADER, nonce)
        .body(Body::empty())
        .map_err(|error| Failure::Broken(error.to_string()))?;
    let response = sender.send_request(request).await.map_err(|error| Failure::Broken(error.to_string()))?;
    if response.status() != StatusCode::OK {
        return Err(Failure::Untrusted(format!("the challenge was answered {}", response.status())));
    }
    let proof = response.headers().get(PROOF_HEADER).and_then(|value| value.to_str().ok());
    proof.map(str::to_owned).ok_or_else(|| Failure::Untrusted("the challenge was answered without a proof".into()))
}

/// The answer to a challenge: the proof when this replica leads, else `503`.
pub(super) fn answer(cluster: &Cluster, request: &Request) -> Response {
    let view = cluster.view.borrow().clone();
    let nonce = request.headers().get(NONCE_HEADER).and_then(|value| value.to_str().ok());
    let Some(nonce) = nonce.filter(|nonce| !nonce.is_empty() && nonce.len() <= NONCE_MAX) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    if view.role != Role::Leader {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    let proof = cluster.secret.leader_proof(nonce, &view.replica_id, view.epoch, &cluster.url);
    (StatusCode::OK, [(PROOF_HEADER, proof)]).into_response()
}

/// Marks a call or socket of replica `me` to `target` as forwarded.
pub(crate) fn sign(cluster: &Cluster, me: &str, target: &Target, headers: &mut HeaderMap) {
    if let Ok(value) = HeaderValue::from_str(me) {
        headers.insert(FORWARDED_BY, value);
    }
    let token = cluster.secret.follower_token(me, &target.id, target.epoch);
    if let Ok(mut value) = HeaderValue::from_str(&token) {
        value.set_sensitive(true);
        headers.insert(TOKEN_HEADER, value);
    }
}

/// The replica that forwarded a call and the epoch it was meant for, when
/// its token is a replica's (made for this one).
pub(super) fn forwarded_by_replica(cluster: &Cluster, token: Option<&HeaderValue>) -> Option<Forwarded> {
    let token = token?.to_str().ok()?;
    let me = cluster.view.borrow().replica_id.clone();
    let (by, epoch) = cluster.secret.verify_follower(token, &me)?;
    Some(Forwarded { by: by.to_owned(), epoch })
}

/// A call another replica of this deployment forwarded (its token
/// checked): a request extension, for the handlers that serve replicas
/// only (the agents' link, [`super::link`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forwarded {
    pub by: String,
    /// The epoch of the leader it was meant for.
    pub epoch: u64,
}
