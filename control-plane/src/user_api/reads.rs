//! The user API's reads that grow with history: the list of runs, a run's
//! log and events, the list of sandboxes. Each is paged or streamed, never
//! loaded whole (`docs/operations.md`, "Per-run bounds").

use std::collections::HashMap;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::{RunView, authorize, check_thread_id, find, view};
use crate::app::{ApiError, AppState, from_store};
use crate::bounds::{LogView, OutOfBounds, cursor, page_limit, parse_cursor};
use crate::dispatch::SandboxPage;
use crate::model::{Millis, RunState};
use crate::store::RunQuery;

/// Stored pieces of a log read per store call while streaming: at most 16
/// chunks (a megabyte for the agent's 64 KiB chunks) held at once.
const LOG_PAGE_ROWS: usize = 16;

/// The header of a log answer saying how many bytes of the run's output the
/// server has accounted for: the end of the log, to ask for the next range.
pub const LOG_RECEIVED_HEADER: &str = "standby-log-received";

type Params = Query<HashMap<String, String>>;

impl From<OutOfBounds> for ApiError {
    fn from(out: OutOfBounds) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, format!("{}: {}", out.field, out.problem)).with_field(out.field)
    }
}

fn refused(out: OutOfBounds) -> ApiError {
    out.into()
}

fn number(params: &HashMap<String, String>, field: &'static str) -> Result<Option<u64>, ApiError> {
    params
        .get(field)
        .map(|raw| raw.parse::<u64>())
        .transpose()
        .map_err(|_| refused(OutOfBounds { field, problem: "must be a whole number of bytes".into() }))
}

/// A page's `limit` and the `cursor` it starts after, from the query.
fn page(params: &HashMap<String, String>) -> Result<(usize, Option<(i64, String)>), ApiError> {
    let limit = page_limit(params.get("limit").map(String::as_str)).map_err(refused)?;
    let after = params.get("cursor").map(|raw| parse_cursor(raw)).transpose().map_err(refused)?;
    Ok((limit, after))
}

/// `GET /v1/runs?limit=&cursor=&state=&thread_id=`: runs in submission
/// order, a page at a time, from the store; `next_cursor` names the next
/// page (`null`: this was the last).
pub(crate) async fn list(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(params): Params,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let (limit, after) = page(&params)?;
    let run_state = params
        .get("state")
        .map(|raw| {
            RunState::ALL
                .into_iter()
                .find(|state| state.as_str() == raw)
                .ok_or_else(|| refused(OutOfBounds { field: "state", problem: "is not a run state".into() }))
        })
        .transpose()?;
    let thread_id = params.get("thread_id").cloned();
    if let Some(thread_id) = &thread_id {
        check_thread_id(thread_id)?;
    }
    let query =
        RunQuery { after: after.map(|(at, id)| (Millis(at), id)), limit: limit + 1, state: run_state, thread_id };
    let mut runs = from_store(&state, move |store| store.runs(&query)).await?;
    let next_cursor = (runs.len() > limit).then(|| {
        runs.truncate(limit);
        runs.last().map(|run| cursor(run.submitted_at.0, &run.id))
    });
    let views: Vec<RunView> = runs.iter().map(view).collect();
    Ok(Json(serde_json::json!({ "runs": views, "next_cursor": next_cursor.flatten() })).into_response())
}

/// `GET /v1/runs/{id}/log?offset=&limit=`: the bytes of the run's output
/// from stream offset `offset` (default 0), at most `limit` of them
/// (default: to the end), streamed from the store a page at a time. Gaps
/// the agent declared and bytes dropped past the cap show as marker lines.
/// The `Standby-Log-Received` header gives the end of the log.
pub(crate) async fn log(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(run_id): Path<String>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let from = number(&params, "offset")?.unwrap_or(0);
    let limit = number(&params, "limit")?;
    find(&state, &run_id).await?;
    let id = run_id.clone();
    let ledger = from_store(&state, move |store| store.log_ledger(&id)).await?.unwrap_or_default();
    let to = limit.map_or(ledger.received, |limit| ledger.received.min(from.saturating_add(limit)));
    let view = LogView::new(from, to, ledger.over_cap);
    let stream = futures::stream::unfold(Some((view, state, run_id)), |next| async move {
        let (mut view, state, run_id) = next?;
        if view.done() {
            return None;
        }
        let (id, position) = (run_id.clone(), view.position());
        match from_store(&state, move |store| store.log_pieces(&id, position, LOG_PAGE_ROWS)).await {
            Ok(pieces) if pieces.is_empty() => Some((Ok(Bytes::from(view.finish())), Some((view, state, run_id)))),
            Ok(pieces) => Some((Ok(Bytes::from(view.feed(&pieces))), Some((view, state, run_id)))),
            Err(error) => Some((Err(std::io::Error::other(error.to_string())), None)),
        }
    });
    Ok((
        [
            (header::CONTENT_TYPE, "text/plain; charset=utf-8".to_owned()),
            (header::HeaderName::from_static(LOG_RECEIVED_HEADER), ledger.received.to_string()),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// `GET /v1/runs/{id}/events?limit=&cursor=`: the run's events in arrival
/// order, a page at a time.
pub(crate) async fn events(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(run_id): Path<String>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let (limit, after) = page(&params)?;
    let after = u64::try_from(after.map_or(0, |(seq, _)| seq)).unwrap_or(0);
    find(&state, &run_id).await?;
    let mut events = from_store(&state, move |store| store.events(&run_id, after, limit + 1)).await?;
    let next_cursor = (events.len() > limit).then(|| {
        events.truncate(limit);
        events.last().map(|(seq, _)| cursor(i64::try_from(*seq).unwrap_or(i64::MAX), ""))
    });
    let views: Vec<serde_json::Value> = events
        .into_iter()
        .map(|(_, stored)| {
            serde_json::json!({
                "attempt": stored.attempt,
                "received_at": stored.received_at.rfc3339(),
                "event": stored.event,
            })
        })
        .collect();
    Ok(Json(serde_json::json!({ "events": views, "next_cursor": next_cursor.flatten() })).into_response())
}

/// `GET /v1/sandboxes?limit=&cursor=`: sandboxes in creation order, a page
/// at a time.
pub(crate) async fn sandboxes(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(params): Params,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let (limit, after) = page(&params)?;
    let page = SandboxPage { after: after.map(|(at, id)| (Millis(at), id)), limit: limit + 1 };
    let mut sandboxes = state.engine.sandboxes(page).await?;
    let next_cursor = (sandboxes.len() > limit).then(|| {
        sandboxes.truncate(limit);
        sandboxes.last().map(|(view, _)| cursor(view.record.created_at.0, &view.record.id))
    });
    let views: Vec<serde_json::Value> = sandboxes
        .into_iter()
        .map(|(view, details)| {
            let record = view.record;
            serde_json::json!({
                "id": record.id,
                "kind": record.kind,
                "state": record.state.as_str(),
                "run_id": record.run_id,
                "created_at": record.created_at.rfc3339(),
                "connected": view.connected,
                "candidate": view.candidate,
                "running": view.running,
                "thread_id": record.thread_id,
                "park": record.park.as_ref().map(|park| serde_json::json!({
                    "mode": park.mode.as_str(),
                    "since": park.since.rfc3339(),
                    "until": park.until.map(Millis::rfc3339),
                })),
                "expires_at": record.expires_at.map(Millis::rfc3339),
                "deadline": record.deadline.map(Millis::rfc3339),
                "auto_stop_minutes": record.auto_stop_minutes,
                "last_heartbeat_at": view.last_heartbeat_at.map(Millis::rfc3339),
                "last_state": view.last_state,
                "connections": record.connections,
                "run_connections": record.run_connections,
                "fingerprint": record.fingerprint,
                "retired_at": record.retired_at.map(Millis::rfc3339),
                "retire_reason": record.retire_reason,
                "exit_code": record.exit_code,
                "pid": details.pid,
                "dir": details.dir,
            })
        })
        .collect();
    Ok(Json(serde_json::json!({ "sandboxes": views, "next_cursor": next_cursor.flatten() })).into_response())
}
