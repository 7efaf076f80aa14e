//! The user API: submit, inspect and cancel runs, list sandboxes, metrics.
//! Every call needs `Authorization: Bearer <api key>`. The reads (lists,
//! logs, events) are in [`reads`].

use std::collections::{BTreeMap, HashSet};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use standby_protocol::{GitCredential, Run, Secret, Workspace};

pub(crate) mod reads;

use crate::app::{ApiError, AppState, bad, bearer, from_store, parse_json};
use crate::credential::hex;
use crate::dispatch::CancelError;
use crate::model::{Attempt, Millis, Resume, RunRecord, RunRequest, RunState, StoredAttachment, ThreadRecord};

/// `POST /v1/runs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Submission {
    pub command: Vec<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub secrets: BTreeMap<String, Secret>,
    #[serde(default)]
    pub cloud_env: BTreeMap<String, Secret>,
    #[serde(default)]
    pub git_credentials: Vec<GitCredential>,
    #[serde(default)]
    pub metadata: Option<serde_json::Value>,
    #[serde(default)]
    pub attachments: Vec<AttachmentInput>,
    #[serde(default)]
    pub mcp_env: BTreeMap<String, String>,
    #[serde(default)]
    pub strict_mcp: bool,
    #[serde(default)]
    pub workspace: Option<Workspace>,
    /// The conversation the run is a turn of: the sandbox is kept for the
    /// thread's next turn.
    #[serde(default)]
    pub thread_id: Option<String>,
}

/// An attachment given inline: UTF-8 `content` or `content_base64`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttachmentInput {
    pub name: String,
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
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
                    .decode(encoded.trim())
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

// ---- views ---------------------------------------------------------------------

#[derive(Debug, Serialize)]
struct AttemptView {
    number: u32,
    sandbox_id: String,
    path: &'static str,
    committed_at: String,
    assignment_sent_at: Option<String>,
    delivery_confirmed_at: Option<String>,
    started_at: Option<String>,
    ended_at: Option<String>,
    outcome: Option<crate::model::AttemptOutcome>,
    reason: Option<String>,
}

impl From<&Attempt> for AttemptView {
    fn from(attempt: &Attempt) -> Self {
        Self {
            number: attempt.number,
            sandbox_id: attempt.sandbox_id.clone(),
            path: attempt.path.as_str(),
            committed_at: attempt.committed_at.rfc3339(),
            assignment_sent_at: attempt.assignment_sent_at.map(Millis::rfc3339),
            delivery_confirmed_at: attempt.delivery_confirmed_at.map(Millis::rfc3339),
            started_at: attempt.started_at.map(Millis::rfc3339),
            ended_at: attempt.ended_at.map(Millis::rfc3339),
            outcome: attempt.outcome,
            reason: attempt.reason.clone(),
        }
    }
}

/// The run's timeline: the submission, then its latest attempt.
#[derive(Debug, Serialize)]
struct Timestamps {
    submitted: String,
    committed: Option<String>,
    assignment_sent: Option<String>,
    delivery_confirmed: Option<String>,
    started: Option<String>,
    exited: Option<String>,
    ended: Option<String>,
}

/// Submit to start, and its parts, in milliseconds.
#[derive(Debug, Serialize)]
struct Durations {
    submit_to_start: Option<u64>,
    /// Submitted → committed to the attempt that ran (earlier attempts included).
    queued: Option<u64>,
    commit_to_assignment_sent: Option<u64>,
    assignment_sent_to_delivery_confirmed: Option<u64>,
    delivery_confirmed_to_started: Option<u64>,
    /// A follow-up turn's resume: claimed → its sandbox's agent ready.
    resume: Option<u64>,
}

#[derive(Debug, Serialize)]
struct WaitView {
    reason: String,
    since: String,
}

#[derive(Debug, Serialize)]
struct ResumeView {
    sandbox_id: String,
    from: &'static str,
    began_at: String,
    ready_at: Option<String>,
    /// Why the resume was given up and the run placed like a new one.
    fallback: Option<String>,
}

impl From<&Resume> for ResumeView {
    fn from(resume: &Resume) -> Self {
        Self {
            sandbox_id: resume.sandbox_id.clone(),
            from: resume.from.as_str(),
            began_at: resume.began_at.rfc3339(),
            ready_at: resume.ready_at.map(Millis::rfc3339),
            fallback: resume.fallback.clone(),
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct RunView {
    id: String,
    state: RunState,
    path: Option<&'static str>,
    command: Vec<String>,
    thread_id: Option<String>,
    /// Why it is `waiting`.
    wait: Option<WaitView>,
    resume: Option<ResumeView>,
    attempts: Vec<AttemptView>,
    exit_code: Option<i32>,
    error: Option<String>,
    timestamps: Timestamps,
    durations_ms: Durations,
}

fn span(from: Option<Millis>, to: Option<Millis>) -> Option<u64> {
    Some(to?.since(from?))
}

pub(crate) fn view(run: &RunRecord) -> RunView {
    let current = run.current();
    let at = |f: fn(&Attempt) -> Option<Millis>| current.and_then(f);
    let committed = current.map(|a| a.committed_at);
    let sent = at(|a| a.assignment_sent_at);
    let confirmed = at(|a| a.delivery_confirmed_at);
    let started = at(|a| a.started_at);
    RunView {
        id: run.id.clone(),
        state: run.state,
        path: run.path().map(|path| path.as_str()),
        command: run.run.command.clone(),
        thread_id: run.thread_id.clone(),
        wait: run
            .wait
            .as_ref()
            .filter(|_| run.state == RunState::Waiting)
            .map(|wait| WaitView { reason: wait.reason.clone(), since: wait.since.rfc3339() }),
        resume: run.resume.as_ref().map(ResumeView::from),
        attempts: run.attempts.iter().map(AttemptView::from).collect(),
        exit_code: run.exit_code,
        error: run.error.clone(),
        timestamps: Timestamps {
            submitted: run.submitted_at.rfc3339(),
            committed: committed.map(Millis::rfc3339),
            assignment_sent: sent.map(Millis::rfc3339),
            delivery_confirmed: confirmed.map(Millis::rfc3339),
            started: started.map(Millis::rfc3339),
            exited: run.ended_at.filter(|_| run.state == RunState::Exited).map(Millis::rfc3339),
            ended: run.ended_at.map(Millis::rfc3339),
        },
        durations_ms: Durations {
            submit_to_start: span(Some(run.submitted_at), started),
            queued: span(Some(run.submitted_at), committed),
            commit_to_assignment_sent: span(committed, sent),
            assignment_sent_to_delivery_confirmed: span(sent, confirmed),
            delivery_confirmed_to_started: span(confirmed, started),
            resume: run.resume.as_ref().and_then(|resume| span(Some(resume.began_at), resume.ready_at)),
        },
    }
}

// ---- handlers ---------------------------------------------------------------------

pub(crate) fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    match bearer(headers) {
        Some(key) if state.api_key.matches(key) => Ok(()),
        Some(_) => Err(ApiError::new(StatusCode::UNAUTHORIZED, "the API key is not valid")),
        None => Err(ApiError::new(StatusCode::UNAUTHORIZED, "missing `Authorization: Bearer <api key>`")),
    }
}

pub(crate) async fn submit(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let submission: Submission = parse_json(&body)?;
    let (run, request, thread_id) = submission.accept()?;
    let record = state.engine.submit_turn(run, request, thread_id).await?;
    tracing::info!(run_id = %record.id, state = %record.state, "run submitted");
    Ok((StatusCode::CREATED, Json(view(&record))).into_response())
}

/// The run, from memory or (finished and evicted) from the store.
pub(crate) async fn find(state: &AppState, run_id: &str) -> Result<RunRecord, ApiError> {
    if let Some(run) = state.engine.run(run_id).await? {
        return Ok(run);
    }
    let id = run_id.to_owned();
    from_store(state, move |store| store.run(&id))
        .await?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no run `{run_id}`")))
}

pub(crate) async fn get(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(run_id): Path<String>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    Ok(Json(view(&find(&state, &run_id).await?)).into_response())
}

pub(crate) async fn cancel(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(run_id): Path<String>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    match state.engine.cancel(&run_id).await? {
        Ok(_) => Ok(Json(view(&find(&state, &run_id).await?)).into_response()),
        // Not in memory: finished and evicted, or unknown.
        Err(CancelError::NotFound(_)) => {
            let run = find(&state, &run_id).await?;
            let error = CancelError::Finished { run_id, state: run.state };
            Err(ApiError::new(StatusCode::CONFLICT, error.to_string()))
        }
        Err(error @ CancelError::Finished { .. }) => Err(ApiError::new(StatusCode::CONFLICT, error.to_string())),
    }
}

/// `GET /v1/threads/{id}`: the thread's pointer.
pub(crate) async fn thread(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(thread_id): Path<String>,
) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let thread: ThreadRecord = state
        .engine
        .thread(&thread_id)
        .await?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no thread `{thread_id}`")))?;
    Ok(Json(serde_json::json!({
        "id": thread.id,
        "generation": thread.generation,
        "sandbox_id": thread.sandbox_id,
        "holder": thread.holder,
        "updated_at": thread.updated_at.rfc3339(),
    }))
    .into_response())
}

pub(crate) async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    authorize(&state, &headers)?;
    let snapshot = state.engine.metrics().await?;
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        crate::metrics::render(&snapshot) + &crate::metrics::render_server(&state.listener, state.containment),
    )
        .into_response())
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
