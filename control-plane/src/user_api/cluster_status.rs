//! `GET /v1/cluster`: what this replica knows of the replicated
//! deployment (each replica answers it itself, never forwarded).

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use super::authorize;
use super::documented::Unauthorized;
use crate::app::AppState;
use crate::problem::{PROBLEM_JSON, Problem};
use crate::store::ReplicaRow;

/// The replicated deployment as this replica sees it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ClusterInfo {
    /// This replica's id.
    replica_id: String,
    /// This replica's part: `candidate` (no answer from the database
    /// yet), `follower`, `leader` or `deposed` (exiting).
    role: String,
    /// The leader's id and advertised URL; absent while none holds a
    /// running lease.
    leader: Option<ReplicaInfo>,
    /// The lease's epoch: one more at each change of leader.
    epoch: u64,
    /// When the lease expires, by the database's clock (RFC 3339).
    lease_expires_at: Option<String>,
    /// Every replica that ever claimed the lease, most recently seen first.
    replicas: Vec<ReplicaInfo>,
}

/// A replica: its id, its advertised URL, when it last claimed the lease.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ReplicaInfo {
    id: String,
    url: String,
    /// RFC 3339; absent for the leader as named by the lease.
    seen_at: Option<String>,
}

/// `GET /v1/cluster`: the replicas, the leader, the epoch, the lease's expiry.
#[utoipa::path(
    get,
    path = "/v1/cluster",
    operation_id = "getCluster",
    tag = "server",
    responses(
        (status = 200, description = "The replicated deployment as this replica sees it", body = ClusterInfo),
        Unauthorized,
        (status = 404, description = "Not a replicated deployment (a SQLite store)", body = Problem, content_type = PROBLEM_JSON),
        (status = 503, description = "The database cannot be read", body = Problem, content_type = PROBLEM_JSON),
    ),
)]
pub(crate) async fn cluster(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, Problem> {
    authorize(&state, &headers)?;
    match info(&state).await? {
        Some(info) => Ok(Json(info).into_response()),
        None => Err(Problem::new(StatusCode::NOT_FOUND, "not a replicated deployment: the store is a SQLite file")),
    }
}

/// What `GET /v1/cluster` answers (the status page shows it too); `None`
/// when the deployment is not replicated.
pub(crate) async fn info(state: &AppState) -> Result<Option<ClusterInfo>, Problem> {
    let Some(cluster) = state.cluster.clone() else { return Ok(None) };
    let view = cluster.view.borrow().clone();
    let lease = std::sync::Arc::clone(&cluster.lease);
    let replicas = tokio::task::spawn_blocking(move || lease.replicas()).await.map_err(|join| {
        Problem::new(StatusCode::INTERNAL_SERVER_ERROR, format!("reading the replicas panicked: {join}"))
    })??;
    Ok(Some(ClusterInfo {
        replica_id: view.replica_id,
        role: view.role.as_str().to_owned(),
        leader: view.leader.map(|(id, url)| ReplicaInfo { id, url, seen_at: None }),
        epoch: view.epoch,
        lease_expires_at: view.expires_at.map(|at| at.rfc3339()),
        replicas: replicas
            .into_iter()
            .map(|ReplicaRow { id, url, seen_at }| ReplicaInfo { id, url, seen_at: Some(seen_at.rfc3339()) })
            .collect(),
    }))
}
