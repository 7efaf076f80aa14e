//! The user API's reads that grow with history: the list of runs, a run's
//! log and events, the list of sandboxes. Each is paged or streamed, never
//! loaded whole (`docs/operations.md`, "Per-run bounds").

use std::collections::HashMap;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use utoipa::IntoParams;

use super::documented::{BadParameter, NoSuchRun, ShuttingDown, StoreFailed, ThreadId, Unauthorized};
use super::submission::check_thread_id;
use super::views::{EventView, EventsPage, RunsPage, SandboxView, SandboxesPage, view};
use super::{RunPath, authorize, find};
use crate::api_bounds::{LogView, OutOfBounds, cursor, page_limit, parse_cursor};
use crate::app::{ApiError, AppState, from_store};
use crate::model::{Millis, RunState, SandboxState};
use crate::problem::Problem;
use crate::rules::SandboxPage;
use crate::store::RunQuery;

/// Stored pieces of a log read per store call while streaming: at most 16
/// chunks (a megabyte for the agent's 64 KiB chunks) held at once.
const LOG_PAGE_ROWS: usize = 16;

/// The header of a log answer saying how many bytes of the run's output the
/// server has accounted for: the end of the log, to ask for the next range.
pub const LOG_RECEIVED_HEADER: &str = "standby-log-received";

/// The query string, as name → value (a malformed one is a problem too).
type Params = Result<Query<HashMap<String, String>>, QueryRejection>;

impl From<OutOfBounds> for ApiError {
    fn from(out: OutOfBounds) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, format!("{}: {}", out.field, out.problem))
            .with_field(out.field)
            .in_query()
    }
}

fn refused(out: OutOfBounds) -> Problem {
    ApiError::from(out).into()
}

/// The query, refusing a parameter the call does not take, as a body's
/// unknown field is: a misspelt `limit` would otherwise answer a default
/// page as if asked for, and no request the document does not describe is
/// taken.
fn query(params: Params, known: &[&str]) -> Result<HashMap<String, String>, Problem> {
    let Query(params) = params?;
    match params.keys().find(|name| !known.contains(&name.as_str())) {
        Some(name) => Err(ApiError::new(StatusCode::BAD_REQUEST, format!("{name}: is not a parameter of this call"))
            .with_field(name.clone())
            .in_query()
            .into()),
        None => Ok(params),
    }
}

/// A whole number of bytes: any run of ASCII digits, as the document's
/// unbounded `integer` says; one past `u64::MAX` means what `u64::MAX`
/// does (past any log's end, or to its end).
fn number(params: &HashMap<String, String>, field: &'static str) -> Result<Option<u64>, Problem> {
    let Some(raw) = params.get(field) else { return Ok(None) };
    if raw.is_empty() || !raw.bytes().all(|b| b.is_ascii_digit()) {
        return Err(refused(OutOfBounds { field, problem: "must be a whole number of bytes".into() }));
    }
    Ok(Some(raw.parse::<u64>().unwrap_or(u64::MAX)))
}

/// The page a list's query asks for: what its handler reads, and the
/// parameters the document states.
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct Page {
    /// Entries per page (default 100)
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    limit: usize,
    /// The `next_cursor` of the previous page
    #[param(value_type = Option<String>, pattern = r"^[0-9]{1,18}:[A-Za-z0-9_-]{0,128}$")]
    cursor: Option<(i64, String)>,
}

/// A page's `limit` and the `cursor` it starts after, from the query.
fn page(params: &HashMap<String, String>) -> Result<Page, Problem> {
    let limit = page_limit(params.get("limit").map(String::as_str)).map_err(refused)?;
    let cursor = params.get("cursor").map(|raw| parse_cursor(raw)).transpose().map_err(refused)?;
    Ok(Page { limit, cursor })
}

/// `state` of a list: one of `names`' states.
fn state_param<S: Copy>(
    params: &HashMap<String, String>,
    all: impl IntoIterator<Item = S>,
    name: impl Fn(S) -> &'static str,
    what: &str,
) -> Result<Option<S>, Problem> {
    let Some(raw) = params.get("state") else { return Ok(None) };
    all.into_iter()
        .find(|state| name(*state) == raw)
        .map(Some)
        .ok_or_else(|| refused(OutOfBounds { field: "state", problem: format!("is not a {what} state") }))
}

/// `thread_id` of a list, checked as a submission's is.
fn thread_param(params: &HashMap<String, String>) -> Result<Option<String>, Problem> {
    let thread_id = params.get("thread_id").cloned();
    if let Some(thread_id) = &thread_id {
        check_thread_id(thread_id).map_err(|error| Problem::from(error.in_query()))?;
    }
    Ok(thread_id)
}

/// `GET /v1/runs?limit=&cursor=&state=&thread_id=`: runs in submission
/// order, a page at a time, from the store; `next_cursor` names the next
/// page (`null`: this was the last).
#[utoipa::path(
    get,
    path = "/v1/runs",
    operation_id = "listRuns",
    tag = "runs",
    params(
        Page,
        ("state" = Option<RunState>, Query, description = "Only runs in this state"),
        ("thread_id" = Option<ThreadId>, Query, description = "Only turns of this thread"),
    ),
    responses(
        (status = 200, description = "A page of runs, oldest submission first", body = RunsPage),
        BadParameter, Unauthorized, StoreFailed,
    ),
)]
pub(crate) async fn list(
    State(state): State<AppState>,
    headers: HeaderMap,
    params: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers)?;
    let params = query(params, &["limit", "cursor", "state", "thread_id"])?;
    let Page { limit, cursor: after } = page(&params)?;
    let run_state = state_param(&params, RunState::ALL, RunState::as_str, "run")?;
    let thread_id = thread_param(&params)?;
    let query = RunQuery {
        after: after.map(|(at, id)| (Millis(at), id)),
        limit: limit + 1,
        state: run_state,
        thread_id,
        newest_first: false,
    };
    let mut runs = from_store(&state, move |store| store.runs(&query)).await?;
    let next_cursor = (runs.len() > limit).then(|| {
        runs.truncate(limit);
        runs.last().map(|run| cursor(run.submitted_at.0, &run.id))
    });
    Ok(Json(RunsPage { runs: runs.iter().map(view).collect(), next_cursor: next_cursor.flatten() }).into_response())
}

/// `GET /v1/runs/{id}/log?offset=&limit=`: the bytes of the run's output
/// from stream offset `offset` (default 0), at most `limit` of them
/// (default: to the end), streamed from the store a page at a time. Gaps
/// the agent declared and bytes dropped past the cap show as marker lines.
/// The `Standby-Log-Received` header gives the end of the log.
#[utoipa::path(
    get,
    path = "/v1/runs/{id}/log",
    operation_id = "getRunLog",
    tag = "runs",
    params(
        RunPath,
        ("offset" = Option<u64>, Query, minimum = 0, description = "Stream offset to start at (default 0)"),
        ("limit" = Option<u64>, Query, minimum = 0, description = "Most bytes of output (default: to the end)"),
    ),
    responses(
        (status = 200, description = "The run's output (redacted by its agent), with marker lines for gaps and \
            bytes over the cap", body = String, content_type = "text/plain; charset=utf-8",
            headers(("Standby-Log-Received" = u64, description = "Bytes of output the server has accounted for"))),
        BadParameter, Unauthorized, NoSuchRun, StoreFailed,
    ),
)]
pub(crate) async fn log(
    State(state): State<AppState>,
    headers: HeaderMap,
    run_id: Result<Path<RunPath>, PathRejection>,
    params: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers)?;
    let (Path(RunPath { id: run_id }), params) = (run_id?, query(params, &["offset", "limit"])?);
    let from = number(&params, "offset")?.unwrap_or(0);
    let limit = number(&params, "limit")?;
    log_answer(state, run_id, from, limit).await
}

/// The answer of a log read from `from`, at most `limit` bytes (the status
/// page's log link reads it too, whole).
pub(crate) async fn log_answer(
    state: AppState,
    run_id: String,
    from: u64,
    limit: Option<u64>,
) -> Result<Response, Problem> {
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
#[utoipa::path(
    get,
    path = "/v1/runs/{id}/events",
    operation_id = "listRunEvents",
    tag = "runs",
    params(
        RunPath, Page,
    ),
    responses(
        (status = 200, description = "A page of the run's events, in arrival order", body = EventsPage),
        BadParameter, Unauthorized, NoSuchRun, StoreFailed,
    ),
)]
pub(crate) async fn events(
    State(state): State<AppState>,
    headers: HeaderMap,
    run_id: Result<Path<RunPath>, PathRejection>,
    params: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers)?;
    let (Path(RunPath { id: run_id }), params) = (run_id?, query(params, &["limit", "cursor"])?);
    let Page { limit, cursor: after } = page(&params)?;
    let after = u64::try_from(after.map_or(0, |(seq, _)| seq)).unwrap_or(0);
    find(&state, &run_id).await?;
    let mut events = from_store(&state, move |store| store.events(&run_id, after, limit + 1)).await?;
    let next_cursor = (events.len() > limit).then(|| {
        events.truncate(limit);
        events.last().map(|(seq, _)| cursor(i64::try_from(*seq).unwrap_or(i64::MAX), ""))
    });
    let events = events.into_iter().map(|(_, stored)| EventView::from(stored)).collect();
    Ok(Json(EventsPage { events, next_cursor: next_cursor.flatten() }).into_response())
}

/// `GET /v1/sandboxes?limit=&cursor=&state=&thread_id=`: sandboxes in
/// creation order, a page at a time.
#[utoipa::path(
    get,
    path = "/v1/sandboxes",
    operation_id = "listSandboxes",
    tag = "sandboxes",
    params(
        Page,
        ("state" = Option<SandboxState>, Query, description = "Only sandboxes in this state"),
        ("thread_id" = Option<ThreadId>, Query, description = "Only sandboxes kept for (or that served) this thread"),
    ),
    responses(
        (status = 200, description = "A page of sandboxes, oldest first", body = SandboxesPage),
        BadParameter, Unauthorized, ShuttingDown,
    ),
)]
pub(crate) async fn sandboxes(
    State(state): State<AppState>,
    headers: HeaderMap,
    params: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers)?;
    let params = query(params, &["limit", "cursor", "state", "thread_id"])?;
    let Page { limit, cursor: after } = page(&params)?;
    let page = SandboxPage {
        after: after.map(|(at, id)| (Millis(at), id)),
        limit: limit + 1,
        state: state_param(&params, SandboxState::ALL, SandboxState::as_str, "sandbox")?,
        thread_id: thread_param(&params)?,
    };
    let mut sandboxes = state.engine.sandboxes(page).await?;
    let next_cursor = (sandboxes.len() > limit).then(|| {
        sandboxes.truncate(limit);
        sandboxes.last().map(|(view, _)| cursor(view.record.created_at.0, &view.record.id))
    });
    let sandboxes = sandboxes.into_iter().map(|(live, details)| SandboxView::new(live, details)).collect();
    Ok(Json(SandboxesPage { sandboxes, next_cursor: next_cursor.flatten() }).into_response())
}
