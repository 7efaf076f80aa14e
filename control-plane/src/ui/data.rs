//! What the status page polls, as JSON, each behind the session: the
//! summary (pool, runs by state, the last hour, the replicas), the latest
//! runs with their waterfalls, and a page of sandboxes. Each reads what
//! the API reads (the machine's numbers, the store, the sandboxes' pages)
//! and answers with the API's own views, so the page and the API cannot
//! disagree.

use std::collections::{BTreeMap, HashMap};

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::status::{HOUR_MS, HourStats, InstallStep, Segment, hour_stats, install_steps, waterfall};
use super::{UiState, no_session};
use crate::api_bounds::{OutOfBounds, cursor, page_limit, parse_cursor};
use crate::app::{ApiError, from_store};
use crate::model::{Millis, RunRecord, RunState, SandboxState};
use crate::problem::Problem;
use crate::rules::{Input, MetricsSnapshot, SandboxPage};
use crate::store::RunQuery;
use crate::user_api::cluster_status::{ClusterInfo, info};
use crate::user_api::views::{RunView, SandboxView, SandboxesPage, view};

/// The runs the page lists, newest first.
pub(crate) const LATEST_RUNS: usize = 100;

/// Most runs of the last hour read for its figures; past it the figures
/// are of the first this many and say so (`truncated`).
pub(crate) const HOUR_READ_MAX: usize = 5_000;

/// Sandboxes per page unless the page asks for another size.
const SANDBOX_PAGE_DEFAULT: usize = 50;

/// The pool against its targets.
#[derive(Debug, Serialize)]
struct Pool {
    /// Standbys (no run bound), ready or still preparing.
    standby: u64,
    /// Warm standbys a run could take now, against `pool_target`.
    ready: u64,
    pool_target: u64,
    /// Sandboxes with a run bound.
    assigned: u64,
    /// Sandboxes with a process, against `running_cap` (0: none).
    running: u64,
    running_cap: u64,
    /// Kept for their thread's next turn, running (Tier 2) or stopped
    /// (Tier 1; the provider may have archived a stopped one by now: the
    /// server learns that only when it starts it again).
    parked_running: u64,
    parked_stopped: u64,
    resuming: u64,
    /// Done, still in memory (the API lists them).
    retired: u64,
}

impl From<&MetricsSnapshot> for Pool {
    fn from(snapshot: &MetricsSnapshot) -> Self {
        let states = snapshot.sandbox_states;
        Self {
            standby: states.standby,
            ready: snapshot.ready_standbys,
            pool_target: snapshot.pool_target,
            assigned: states.assigned,
            running: snapshot.sandboxes_running,
            running_cap: snapshot.running_cap,
            parked_running: snapshot.parked_running,
            parked_stopped: snapshot.parked_stopped,
            resuming: states.resuming,
            retired: states.retired,
        }
    }
}

/// `GET /ui/api/summary`.
#[derive(Debug, Serialize)]
struct Summary {
    /// When it was read (RFC 3339).
    now: String,
    pool: Pool,
    /// Every run this server knows, by state (every state named, 0 too).
    runs_by_state: BTreeMap<&'static str, u64>,
    last_hour: HourStats,
    /// The replicated deployment; `null` for a server on its own.
    cluster: Option<ClusterInfo>,
}

fn answer(result: Result<Response, Problem>) -> Response {
    result.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /ui/api/summary`: the pool, the runs by state, the last hour and
/// the replicas.
pub(super) async fn summary(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    if !ui.signed_in(&headers) {
        return no_session();
    }
    answer(read_summary(&ui).await.map(|summary| Json(summary).into_response()))
}

async fn read_summary(ui: &UiState) -> Result<Summary, Problem> {
    let snapshot: MetricsSnapshot = ui.app.engine.ask(Input::Metrics).await?;
    let now = Millis::now();
    let since = Millis(now.0.saturating_sub(HOUR_MS));
    let query = RunQuery { after: Some((since, String::new())), limit: HOUR_READ_MAX + 1, ..RunQuery::default() };
    let mut recent = from_store(&ui.app, move |store| store.runs(&query)).await?;
    let truncated = recent.len() > HOUR_READ_MAX;
    recent.truncate(HOUR_READ_MAX);
    let mut runs_by_state: BTreeMap<&'static str, u64> = RunState::ALL.iter().map(|s| (s.as_str(), 0)).collect();
    for ((state, _), count) in &snapshot.runs {
        *runs_by_state.entry(state.as_str()).or_default() += count;
    }
    Ok(Summary {
        now: now.rfc3339(),
        pool: Pool::from(&snapshot),
        runs_by_state,
        last_hour: hour_stats(&recent, now, truncated),
        cluster: info(&ui.app).await?,
    })
}

/// A run as the page lists it: the API's view, its waterfall and the
/// agent's own timing of its start.
#[derive(Debug, Serialize)]
struct RunRow {
    #[serde(flatten)]
    run: RunView,
    waterfall: Vec<Segment>,
    install_steps: Vec<InstallStep>,
}

/// `GET /ui/api/runs`: the latest runs, newest first.
#[derive(Debug, Serialize)]
struct LatestRuns {
    runs: Vec<RunRow>,
}

fn rows(runs: &[RunRecord], now: Millis) -> Vec<RunRow> {
    runs.iter()
        .map(|run| RunRow { run: view(run), waterfall: waterfall(run, now), install_steps: install_steps(run) })
        .collect()
}

/// `GET /ui/api/runs`: the [`LATEST_RUNS`] latest runs, newest first.
pub(super) async fn runs(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    if !ui.signed_in(&headers) {
        return no_session();
    }
    let query = RunQuery { limit: LATEST_RUNS, newest_first: true, ..RunQuery::default() };
    answer(
        from_store(&ui.app, move |store| store.runs(&query))
            .await
            .map(|runs| Json(LatestRuns { runs: rows(&runs, Millis::now()) }).into_response())
            .map_err(Problem::from),
    )
}

fn refused(out: OutOfBounds) -> Problem {
    ApiError::from(out).into()
}

/// `GET /ui/api/sandboxes?limit=&cursor=&state=`: a page of sandboxes in
/// creation order, as `GET /v1/sandboxes` pages them (its cursors).
pub(super) async fn sandboxes(
    State(ui): State<UiState>,
    headers: HeaderMap,
    params: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Response {
    if !ui.signed_in(&headers) {
        return no_session();
    }
    answer(read_sandboxes(&ui, params).await)
}

async fn read_sandboxes(
    ui: &UiState,
    params: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    let Query(params) = params?;
    let limit = match params.get("limit") {
        None => SANDBOX_PAGE_DEFAULT,
        Some(raw) => page_limit(Some(raw)).map_err(refused)?,
    };
    let after = params.get("cursor").map(|raw| parse_cursor(raw)).transpose().map_err(refused)?;
    let state = match params.get("state").map(String::as_str) {
        None | Some("") => None,
        Some(raw) => Some(
            SandboxState::ALL
                .into_iter()
                .find(|state| state.as_str() == raw)
                .ok_or_else(|| Problem::new(StatusCode::BAD_REQUEST, "state: is not a sandbox state".to_owned()))?,
        ),
    };
    let page = SandboxPage { after: after.map(|(at, id)| (Millis(at), id)), limit: limit + 1, state, thread_id: None };
    let mut sandboxes = ui.app.engine.sandboxes(page).await?;
    let next_cursor = (sandboxes.len() > limit).then(|| {
        sandboxes.truncate(limit);
        sandboxes.last().map(|(live, _)| cursor(live.record.created_at.0, &live.record.id))
    });
    let sandboxes = sandboxes.into_iter().map(|(live, details)| SandboxView::new(live, details)).collect();
    Ok(Json(SandboxesPage { sandboxes, next_cursor: next_cursor.flatten() }).into_response())
}
