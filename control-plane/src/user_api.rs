//! The user API: submit, inspect and cancel runs, list sandboxes, metrics.
//! Every call needs `Authorization: Bearer <api key>`; every refusal is a
//! problem (`problem`). The reads (lists, logs, events) are in [`reads`],
//! what the answers hold in [`views`], the OpenAPI document that
//! describes them all in [`openapi`].

use std::collections::{BTreeMap, HashSet};

use axum::Json;
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use standby_protocol::{GitCredential, Run, Secret, Workspace};
use utoipa::{IntoParams, ToSchema};

pub(crate) mod cluster;
pub(crate) mod documented;
pub(crate) mod openapi;
pub(crate) mod problem;
pub(crate) mod reads;
pub(crate) mod views;

use self::documented::{NoSuchRun, ShuttingDown, StoreFailed, ThreadId, Unauthorized};
use self::problem::{PROBLEM_JSON, Problem};
use self::views::{RunView, ThreadView, view};
use crate::app::{ApiError, AppState, bad, bearer, from_store, parse_json, read_body};
use crate::credential::hex;
use crate::dispatch::{CancelError, IdempotencyKey, Input, KeyReused, Submitted};
use crate::model::{RunRecord, RunRequest, RunState, StoredAttachment, ThreadRecord};
use crate::store::Store;

/// `POST /v1/runs`: a run to start on a prepared sandbox.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Submission {
    /// The program and its arguments; the program must not be empty.
    #[schema(schema_with = openapi::command_schema)]
    pub command: Vec<String>,
    /// A relative path inside the workspace (no `..`).
    #[serde(default)]
    #[schema(schema_with = openapi::relative_path_schema)]
    pub cwd: Option<String>,
    /// Environment of the run. Names are not empty and hold no `=`.
    #[serde(default)]
    #[schema(schema_with = openapi::environment_schema)]
    pub env: BTreeMap<String, String>,
    /// Secrets the agent fetches at install time; redacted from the log.
    #[serde(default)]
    #[schema(schema_with = openapi::environment_schema)]
    pub secrets: BTreeMap<String, Secret>,
    /// Cloud credentials, as environment variables; never stored in clear.
    #[serde(default)]
    #[schema(schema_with = openapi::environment_schema)]
    pub cloud_env: BTreeMap<String, Secret>,
    /// Git credentials (the contract's `GitCredential`); `protocol` and
    /// `host` must not be empty.
    #[serde(default)]
    #[schema(schema_with = openapi::git_credentials_schema)]
    pub git_credentials: Vec<GitCredential>,
    /// Any JSON, handed to the run as a file.
    #[serde(default)]
    #[schema(schema_with = openapi::any_json_schema)]
    pub metadata: Option<serde_json::Value>,
    #[serde(default)]
    pub attachments: Vec<AttachmentInput>,
    /// Environment of the MCP servers for this run.
    #[serde(default)]
    #[schema(schema_with = openapi::environment_schema)]
    pub mcp_env: BTreeMap<String, String>,
    /// Fail the install when an MCP server does not come up.
    #[serde(default)]
    pub strict_mcp: bool,
    /// The workspace the run needs (the contract's `Workspace`); the pool
    /// spec's when absent.
    #[serde(default)]
    #[schema(schema_with = openapi::workspace_schema)]
    pub workspace: Option<Workspace>,
    /// The conversation the run is a turn of: the sandbox is kept for the
    /// thread's next turn.
    #[serde(default)]
    #[schema(value_type = Option<ThreadId>)]
    pub thread_id: Option<String>,
}

/// An attachment given inline: exactly one of UTF-8 `content` and
/// `content_base64`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AttachmentInput {
    /// A plain file name, unique among the run's attachments.
    #[schema(min_length = 1, max_length = 255, pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]*$")]
    pub name: String,
    #[serde(default)]
    pub content: Option<String>,
    /// Standard base64 (with padding, canonical), optionally between
    /// spaces, tabs and line ends.
    #[serde(default)]
    #[schema(
        pattern = r"^[ \t\r\n]*(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/][AQgw]==|[A-Za-z0-9+/]{2}[AEIMQUYcgkosw048]=)?[ \t\r\n]*$"
    )]
    pub content_base64: Option<String>,
}

fn check_relative(field: &str, path: &str) -> Result<(), ApiError> {
    let parts: Vec<&str> = path.split('/').collect();
    if path.is_empty() || path.starts_with('/') || parts.contains(&"..") {
        return Err(bad(field, "must be a relative path inside the workspace"));
    }
    Ok(())
}

fn check_names<'a>(field: &str, names: impl Iterator<Item = &'a String>) -> Result<(), ApiError> {
    for name in names {
        if name.is_empty() || name.contains('=') || name.contains('\0') {
            return Err(bad(format!("{field}.{name}"), "is not a valid environment variable name"));
        }
    }
    Ok(())
}

/// A thread id is shown in logs and URLs: short, plain characters, and
/// not a path segment of its own (`.`, `..`).
pub(crate) fn check_thread_id(thread_id: &str) -> Result<(), ApiError> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':');
    if thread_id.is_empty() || thread_id.len() > 128 || !thread_id.chars().all(plain) {
        return Err(bad("thread_id", "must be 1 to 128 letters, digits, `.`, `_`, `-` or `:`"));
    }
    if thread_id == "." || thread_id == ".." {
        return Err(bad("thread_id", "must not be `.` or `..`"));
    }
    Ok(())
}

/// What may surround an attachment's base64: what a line-wrapping encoder
/// or a text editor adds at its ends, and nothing the document's pattern
/// (on `content_base64`) does not say.
const BASE64_SPACE: [char; 4] = [' ', '\t', '\r', '\n'];

/// Longest attachment name: what a file name may be on the agent's side.
const MAX_ATTACHMENT_NAME: usize = 255;

fn check_workspace(workspace: &Workspace) -> Result<(), ApiError> {
    for (i, repo) in workspace.repos.iter().enumerate() {
        if repo.url.trim().is_empty() {
            return Err(bad(format!("workspace.repos[{i}].url"), "must not be empty"));
        }
        check_relative(&format!("workspace.repos[{i}].path"), &repo.path)?;
    }
    for (i, step) in workspace.setup.iter().enumerate() {
        if step.name.trim().is_empty() {
            return Err(bad(format!("workspace.setup[{i}].name"), "must not be empty"));
        }
        if step.command.first().is_none_or(|program| program.is_empty()) {
            return Err(bad(format!("workspace.setup[{i}].command"), "must name a program"));
        }
        if let Some(cwd) = &step.cwd {
            check_relative(&format!("workspace.setup[{i}].cwd"), cwd)?;
        }
    }
    Ok(())
}

impl Submission {
    /// Everything `POST /v1/runs` checks: no NUL byte in any string, the
    /// thread id, then [`Self::validate`]. The run, what is fetched later,
    /// and the thread id.
    pub fn accept(mut self) -> Result<(Run, RunRequest, Option<String>), ApiError> {
        if let Some(field) = crate::submit_checks::first_nul(&self) {
            return Err(bad(field, "must not contain a NUL byte"));
        }
        let thread_id = self.thread_id.take();
        if let Some(thread_id) = &thread_id {
            check_thread_id(thread_id)?;
        }
        let (run, request) = self.validate()?;
        Ok((run, request, thread_id))
    }

    /// Checks what the agent would otherwise refuse only after a sandbox
    /// was spent on it, and splits the run (sent in the assignment) from
    /// what is fetched later (secrets and the rest).
    pub fn validate(self) -> Result<(Run, RunRequest), ApiError> {
        if self.command.first().is_none_or(|program| program.is_empty()) {
            return Err(bad("command", "must name a program"));
        }
        if let Some(cwd) = &self.cwd {
            check_relative("cwd", cwd)?;
        }
        check_names("env", self.env.keys())?;
        check_names("mcp_env", self.mcp_env.keys())?;
        check_names("secrets", self.secrets.keys())?;
        check_names("cloud_env", self.cloud_env.keys())?;
        for (i, credential) in self.git_credentials.iter().enumerate() {
            if credential.protocol.is_empty() {
                return Err(bad(format!("git_credentials[{i}].protocol"), "must not be empty"));
            }
            if credential.host.is_empty() {
                return Err(bad(format!("git_credentials[{i}].host"), "must not be empty"));
            }
        }
        if let Some(workspace) = &self.workspace {
            check_workspace(workspace)?;
        }
        let mut names = HashSet::new();
        let mut attachments = Vec::new();
        for (i, attachment) in self.attachments.into_iter().enumerate() {
            let field = format!("attachments[{i}]");
            let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
            if attachment.name.is_empty() || attachment.name.starts_with('.') || !attachment.name.chars().all(plain) {
                return Err(bad(
                    format!("{field}.name"),
                    "must be a plain file name of letters, digits, `.`, `_` and `-`, not starting with `.`",
                ));
            }
            if attachment.name.len() > MAX_ATTACHMENT_NAME {
                return Err(bad(format!("{field}.name"), format!("must be at most {MAX_ATTACHMENT_NAME} bytes")));
            }
            if !names.insert(attachment.name.clone()) {
                return Err(bad(format!("{field}.name"), "is used by another attachment"));
            }
            let content = match (attachment.content, attachment.content_base64) {
                (Some(text), None) => text.into_bytes(),
                (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
                    .decode(encoded.trim_matches(BASE64_SPACE))
                    .map_err(|_| bad(format!("{field}.content_base64"), "is not valid base64"))?,
                _ => return Err(bad(field, "needs exactly one of `content` and `content_base64`")),
            };
            attachments.push(StoredAttachment {
                name: attachment.name,
                sha256: hex(&Sha256::digest(&content)),
                content_base64: base64::engine::general_purpose::STANDARD.encode(&content),
            });
        }
        let run = Run {
            command: self.command,
            cwd: self.cwd,
            env: self.env,
            mcp_env: self.mcp_env,
            workspace: self.workspace,
            strict_mcp: self.strict_mcp,
            attachments: None,
        };
        let request = RunRequest {
            secrets: self.secrets,
            cloud_env: self.cloud_env,
            git_credentials: self.git_credentials,
            metadata: self.metadata.unwrap_or_else(|| serde_json::json!({})),
            attachments,
        };
        Ok((run, request))
    }
}

// ---- handlers ---------------------------------------------------------------------

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
    let server = crate::metrics::render_server(&state.listener, state.containment);
    let text = match &state.cluster {
        // A follower runs no engine: its own gauges only.
        Some(cluster) if !cluster.leading() => server + &cluster.render_metrics(),
        Some(cluster) => {
            crate::metrics::render(&state.engine.ask(Input::Metrics).await?) + &server + &cluster.render_metrics()
        }
        None => crate::metrics::render(&state.engine.ask(Input::Metrics).await?) + &server,
    };
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn submit(body: &str) -> Result<(Run, RunRequest), ApiError> {
        parse_json::<Submission>(body.as_bytes())?.accept().map(|(run, request, _)| (run, request))
    }

    fn field(body: &str) -> String {
        let error = submit(body).expect_err("refused");
        assert_eq!(error.status(), StatusCode::BAD_REQUEST);
        error.field().unwrap_or_default().to_owned()
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(field("{}"), "command");
        assert_eq!(field(r#"{"command": []}"#), "command");
        assert_eq!(field(r#"{"command": "ls"}"#), "command");
        assert_eq!(field(r#"{"command": ["ls"], "comand": 1}"#), "comand");
        assert_eq!(field(r#"{"command": ["ls"], "cwd": "../x"}"#), "cwd");
        assert_eq!(field(r#"{"command": ["ls"], "env": {"A": 1}}"#), "env.A");
        assert_eq!(
            field(r#"{"command": ["ls"], "attachments": [{"name": "../x", "content": ""}]}"#),
            "attachments[0].name"
        );
        assert_eq!(field(r#"{"command": ["ls"], "attachments": [{"name": "a"}]}"#), "attachments[0]");
        assert_eq!(
            field(r#"{"command": ["ls"], "workspace": {"repos": [{"url": "u", "path": "/abs"}]}}"#),
            "workspace.repos[0].path"
        );
        assert_eq!(
            field(r#"{"command": ["ls"], "git_credentials": [{"protocol": "https", "host": "h", "username": "u"}]}"#),
            "git_credentials[0].password"
        );
    }

    /// Every gap that used to be accepted and then failed at the agent,
    /// spending sandboxes and attempts: each is a `400` naming its field.
    #[test]
    fn what_the_agent_would_refuse_is_refused_at_submit() {
        let nul = "a\\u0000b";
        let long_name = "n".repeat(256);
        let cases: Vec<(String, &str)> = vec![
            (format!(r#"{{"command": ["ls", "{nul}"]}}"#), "command[1]"),
            (format!(r#"{{"command": ["{nul}"]}}"#), "command[0]"),
            (format!(r#"{{"command": ["ls"], "cwd": "{nul}"}}"#), "cwd"),
            (format!(r#"{{"command": ["ls"], "env": {{"A": "{nul}"}}}}"#), "env.A"),
            (format!(r#"{{"command": ["ls"], "env": {{"{nul}": "v"}}}}"#), "env.a\\0b"),
            (format!(r#"{{"command": ["ls"], "mcp_env": {{"M": "{nul}"}}}}"#), "mcp_env.M"),
            (format!(r#"{{"command": ["ls"], "secrets": {{"S": "{nul}"}}}}"#), "secrets.S"),
            (format!(r#"{{"command": ["ls"], "secrets": {{"{nul}": "v"}}}}"#), "secrets.a\\0b"),
            (format!(r#"{{"command": ["ls"], "cloud_env": {{"C": "{nul}"}}}}"#), "cloud_env.C"),
            (
                format!(
                    r#"{{"command": ["ls"], "git_credentials": [{{"protocol": "https", "host": "h", "username": "u", "password": "{nul}"}}]}}"#
                ),
                "git_credentials[0].password",
            ),
            (
                format!(
                    r#"{{"command": ["ls"], "git_credentials": [{{"protocol": "https", "host": "{nul}", "username": "u", "password": "p"}}]}}"#
                ),
                "git_credentials[0].host",
            ),
            (
                format!(
                    r#"{{"command": ["ls"], "git_credentials": [{{"protocol": "https", "host": "h", "username": "{nul}", "password": "p"}}]}}"#
                ),
                "git_credentials[0].username",
            ),
            (
                format!(
                    r#"{{"command": ["ls"], "git_credentials": [{{"protocol": "{nul}", "host": "h", "username": "u", "password": "p"}}]}}"#
                ),
                "git_credentials[0].protocol",
            ),
            (
                format!(r#"{{"command": ["ls"], "attachments": [{{"name": "{nul}", "content": ""}}]}}"#),
                "attachments[0].name",
            ),
            (
                format!(r#"{{"command": ["ls"], "attachments": [{{"name": "{long_name}", "content": ""}}]}}"#),
                "attachments[0].name",
            ),
            (format!(r#"{{"command": ["ls"], "thread_id": "{nul}"}}"#), "thread_id"),
            (r#"{"command": ["ls"], "thread_id": "."}"#.to_owned(), "thread_id"),
            (r#"{"command": ["ls"], "thread_id": ".."}"#.to_owned(), "thread_id"),
            (
                format!(
                    r#"{{"command": ["ls"], "workspace": {{"repos": [{{"url": "u", "path": "p", "ref": "{nul}"}}]}}}}"#
                ),
                "workspace.repos[0].ref",
            ),
            (
                format!(
                    r#"{{"command": ["ls"], "workspace": {{"setup": [{{"name": "s", "command": ["make", "{nul}"]}}]}}}}"#
                ),
                "workspace.setup[0].command[1]",
            ),
        ];
        for (body, expected) in &cases {
            assert_eq!(field(body), *expected, "{body}");
        }
        // At the limit, and a NUL in metadata (a JSON file: harmless), pass.
        let at_limit = "n".repeat(255);
        let body = format!(
            r#"{{"command": ["ls"], "metadata": {{"k": "{nul}"}}, "attachments": [{{"name": "{at_limit}", "content": "x"}}]}}"#
        );
        assert!(submit(&body).is_ok());
        let error =
            submit(&format!(r#"{{"command": ["ls"], "secrets": {{"S": "x-{nul}-sekrit"}}}}"#)).expect_err("refused");
        assert!(!error.to_string().contains("sekrit"), "a refused value is never quoted: {error}");
    }

    #[test]
    fn thread_ids_are_plain() {
        for good in ["t1", "chat:42", "user.7_thread-3", "..."] {
            assert!(check_thread_id(good).is_ok(), "{good}");
        }
        for bad in ["", "a b", "../x", ".", "..", &"x".repeat(129)] {
            let error = check_thread_id(bad).expect_err("refused");
            assert_eq!(error.field(), Some("thread_id"));
        }
    }

    #[test]
    fn errors_do_not_quote_values() {
        let error = submit(r#"{"command": ["ls"], "secrets": {"K": 12345678}}"#).expect_err("refused");
        assert!(!error.to_string().contains("12345678"), "{error}");
        let error = submit(r#"{"command": "sekrit-value"}"#).expect_err("refused");
        assert!(!error.to_string().contains("sekrit"), "{error}");
    }

    #[test]
    fn attachments_are_stored_with_their_sha256() {
        let (run, request) = submit(r#"{"command": ["ls"], "attachments": [{"name": "a.txt", "content": "abc"}, {"name": "b", "content_base64": "AAE="}]}"#)
            .expect("valid");
        assert_eq!(run.command, ["ls"]);
        assert_eq!(request.attachments[0].sha256, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(request.attachments[1].content_base64, "AAE=");
        assert_eq!(request.metadata, serde_json::json!({}));
    }
}
