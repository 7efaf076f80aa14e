//! The user API: submit, inspect and cancel runs, list sandboxes, metrics.
//! Every call needs `Authorization: Bearer <api key>`; every refusal is a
//! problem ([`crate::problem`]). What a submission may hold is in [`submission`],
//! the reads (lists, logs, events) in [`reads`], what the answers hold in
//! [`views`], the OpenAPI document that describes them all in [`openapi`].

use axum::Json;
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::IntoParams;

pub(crate) mod cluster_status;
pub(crate) mod documented;
pub(crate) mod openapi;
pub(crate) mod reads;
pub(crate) mod submission;
pub(crate) mod views;

use self::documented::{NoSuchRun, ShuttingDown, StoreFailed, Unauthorized};
use self::submission::Submission;
use self::views::{RunView, ThreadView, view};
use crate::app::{ApiError, AppState, bearer, from_store, parse_json, read_body};
use crate::model::{RunRecord, RunState, ThreadRecord};
use crate::problem::{self, PROBLEM_JSON, Problem};
use crate::rules::{CancelError, IdempotencyKey, Input, KeyReused, Submitted};
use crate::store::Store;

pub(crate) fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), Problem> {
    match bearer(headers) {
        Some(key) if state.api_key.matches(key) => Ok(()),
        Some(_) => Err(Problem::new(StatusCode::UNAUTHORIZED, "the API key is not valid")),
        None => Err(Problem::new(StatusCode::UNAUTHORIZED, "missing `Authorization: Bearer <api key>`")),
    }
}

/// The header that makes a submission idempotent.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Longest `Idempotency-Key`.
pub const IDEMPOTENCY_KEY_MAX: usize = 255;

/// The submission's `Idempotency-Key` (1 to 255 visible ASCII characters),
/// if it has one, with the store's keyed digest of the body it came with.
fn idempotency_key(store: &dyn Store, headers: &HeaderMap, body: &[u8]) -> Result<Option<IdempotencyKey>, ApiError> {
    let Some(value) = headers.get(IDEMPOTENCY_KEY) else { return Ok(None) };
    let refused = || {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("Idempotency-Key: must be 1 to {IDEMPOTENCY_KEY_MAX} visible ASCII characters"),
        )
        .with_field("Idempotency-Key")
        .in_header()
    };
    let key = value.to_str().map_err(|_| refused())?;
    if key.is_empty() || key.len() > IDEMPOTENCY_KEY_MAX || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(refused());
    }
    // The body as parsed JSON (already known to parse), so that key order
    // and spacing do not make another body.
    let canonical =
        serde_json::from_slice::<serde_json::Value>(body).map(|value| value.to_string()).unwrap_or_default();
    Ok(Some(IdempotencyKey { key: key.to_owned(), request_hash: store.digest(canonical.as_bytes()) }))
}

/// The largest submission body: a run with its inline attachments.
pub const SUBMIT_BODY_MAX: usize = 2 * 1024 * 1024;

/// `POST /v1/runs`: queues a run and places it on a prepared sandbox at
/// once when one is ready.
#[utoipa::path(
    post,
    path = "/v1/runs",
    operation_id = "submitRun",
    tag = "runs",
    request_body(content = Submission, content_type = "application/json"),
    params(
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = "^[!-~]+$",
            description = "Makes the submission idempotent: a retry with the same key and the same body within the \
                idempotency window (`--idempotency-window`, 24 h by default) answers the run the first made, and \
                starts nothing; with another body it is refused (422)."),
    ),
    responses(
        (status = 201, description = "The run (new, or the one this `Idempotency-Key` made)", body = RunView,
            links(
                ("GetRun" = (operation_id = "getRun", parameters(("id" = "$response.body#/id")))),
                ("GetRunLog" = (operation_id = "getRunLog", parameters(("id" = "$response.body#/id")))),
                ("ListRunEvents" = (operation_id = "listRunEvents", parameters(("id" = "$response.body#/id")))),
                ("CancelRun" = (operation_id = "cancelRun", parameters(("id" = "$response.body#/id")))),
            )),
        (status = 400, description = "A field, the body or the `Idempotency-Key` is refused: `errors` names it", body = Problem, content_type = PROBLEM_JSON),
        Unauthorized,
        (status = 408, description = "The body did not arrive whole within the body timeout", body = Problem, content_type = PROBLEM_JSON),
        (status = 413, description = "The body is over the server's limit (2 MiB)", body = Problem, content_type = PROBLEM_JSON),
        (status = 422, description = "The `Idempotency-Key` was used with another body", body = Problem, content_type = PROBLEM_JSON),
        StoreFailed, ShuttingDown,
    ),
)]
pub(crate) async fn submit(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Result<Response, Problem> {
    authorize(&state, &headers)?;
    let body =
        read_body(body, SUBMIT_BODY_MAX).await.map_err(|unread| Problem::new(unread.status(), unread.to_string()))?;
    let submission: Submission = parse_json(&body)?;
    let key = idempotency_key(state.store.as_ref(), &headers, &body)?;
    let (run, request, thread_id) = submission.accept()?;
    let submit = Input::Submit { run: Box::new(run), request: Box::new(request), thread_id, key };
    let submitted: Result<(Submitted, Option<RunRecord>), KeyReused> = state.engine.ask(submit).await?;
    let (submitted, record) = submitted.map_err(|reused| {
        Problem::of_type(problem::KEY_REUSED, StatusCode::UNPROCESSABLE_ENTITY, reused.to_string())
            .with_header("Idempotency-Key")
    })?;
    let record = match record {
        Some(record) => record,
        None => find(&state, submitted.run_id()).await?,
    };
    match submitted {
        Submitted::New(_) => tracing::info!(run_id = %record.id, state = %record.state, "run submitted"),
        Submitted::Replayed(_) => tracing::info!(run_id = %record.id, "run submitted again under its idempotency key"),
    }
    Ok((StatusCode::CREATED, Json(view(&record))).into_response())
}

/// `{id}` of a call under `/v1/runs/{id}`: the path its handler reads, and
/// the parameter the document states.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct RunPath {
    /// The run's id
    id: String,
}

/// The run, from memory or (finished and evicted) from the store.
pub(crate) async fn find(state: &AppState, run_id: &str) -> Result<RunRecord, Problem> {
    if let Some(run) = state.engine.ask::<Option<RunRecord>>(Input::Run { run_id: run_id.to_owned() }).await? {
        return Ok(run);
    }
    let id = run_id.to_owned();
    from_store(state, move |store| store.run(&id))
        .await?
        .ok_or_else(|| Problem::new(StatusCode::NOT_FOUND, format!("no run `{run_id}`")))
}

/// `GET /v1/runs/{id}`: a run.
#[utoipa::path(
    get,
    path = "/v1/runs/{id}",
    operation_id = "getRun",
    tag = "runs",
    params(RunPath),
    responses(
        (status = 200, description = "The run", body = RunView),
        Unauthorized, NoSuchRun, StoreFailed, ShuttingDown,
    ),
)]
pub(crate) async fn get(
    State(state): State<AppState>,
    headers: HeaderMap,
    run_id: Result<Path<RunPath>, PathRejection>,
) -> Result<Response, Problem> {
    authorize(&state, &headers)?;
    let Path(RunPath { id: run_id }) = run_id?;
    Ok(Json(view(&find(&state, &run_id).await?)).into_response())
}

/// `POST /v1/runs/{id}/cancel`: before the run starts it never does; once
/// started, its sandbox is told and the run ends when the agent reports.
#[utoipa::path(
    post,
    path = "/v1/runs/{id}/cancel",
    operation_id = "cancelRun",
    tag = "runs",
    params(RunPath),
    responses(
        (status = 200, description = "The run, cancelled or cancelling", body = RunView),
        Unauthorized, NoSuchRun,
        (status = 409, description = "The run is finished (exited or failed)", body = Problem, content_type = PROBLEM_JSON),
        StoreFailed, ShuttingDown,
    ),
)]
pub(crate) async fn cancel(
    State(state): State<AppState>,
    headers: HeaderMap,
    run_id: Result<Path<RunPath>, PathRejection>,
) -> Result<Response, Problem> {
    authorize(&state, &headers)?;
    let Path(RunPath { id: run_id }) = run_id?;
    match state.engine.ask::<Result<RunState, CancelError>>(Input::Cancel { run_id: run_id.clone() }).await? {
        Ok(_) => Ok(Json(view(&find(&state, &run_id).await?)).into_response()),
        // Not in memory: finished and evicted, or unknown.
        Err(CancelError::NotFound(_)) => {
            let run = find(&state, &run_id).await?;
            let error = CancelError::Finished { run_id, state: run.state };
            Err(Problem::new(StatusCode::CONFLICT, error.to_string()))
        }
        Err(error @ CancelError::Finished { .. }) => Err(Problem::new(StatusCode::CONFLICT, error.to_string())),
    }
}

/// `GET /v1/threads/{id}`: the thread's pointer.
#[utoipa::path(
    get,
    path = "/v1/threads/{id}",
    operation_id = "getThread",
    tag = "runs",
    params(("id" = String, Path, description = "The thread's id (a run's `thread_id`)")),
    responses(
        (status = 200, description = "The thread's pointer", body = ThreadView),
        Unauthorized,
        (status = 404, description = "No thread with this id", body = Problem, content_type = PROBLEM_JSON),
        ShuttingDown,
    ),
)]
pub(crate) async fn thread(
    State(state): State<AppState>,
    headers: HeaderMap,
    thread_id: Result<Path<String>, PathRejection>,
) -> Result<Response, Problem> {
    authorize(&state, &headers)?;
    let Path(thread_id) = thread_id?;
    let thread: ThreadRecord = state
        .engine
        .ask::<Option<ThreadRecord>>(Input::Thread { thread_id: thread_id.clone() })
        .await?
        .ok_or_else(|| Problem::new(StatusCode::NOT_FOUND, format!("no thread `{thread_id}`")))?;
    Ok(Json(ThreadView::from(thread)).into_response())
}

/// `GET /metrics`: Prometheus text.
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "getMetrics",
    tag = "server",
    responses(
        (status = 200, description = "Prometheus text exposition (0.0.4)", body = String, content_type = "text/plain; version=0.0.4"),
        Unauthorized, ShuttingDown,
    ),
)]
pub(crate) async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, Problem> {
    authorize(&state, &headers)?;
    let dropped_spans = state.tracer.as_ref().map_or(0, standby_otlp::Tracer::dropped);
    let server = crate::metrics::render_server(&state.listener, state.containment, dropped_spans);
    let text = match &state.cluster {
        // A follower runs no engine: its own gauges only.
        Some(cluster) if !cluster.leading() => server + &cluster.render_metrics(),
        Some(cluster) => {
            crate::metrics::render(&state.engine.ask(Input::Metrics).await?) + &server + &cluster.render_metrics()
        }
        None => {
            crate::metrics::render(&state.engine.ask(Input::Metrics).await?) + &server + crate::metrics::LEADING_ALONE
        }
    };
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}
