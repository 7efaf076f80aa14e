//! What `POST /v1/runs` accepts: the submission's shape and every check
//! of it, so that what the agent would refuse only after a sandbox (and an
//! attempt) was spent on it is refused at submit instead, naming the field.
//!
//! One of those checks is for NUL bytes. A NUL ends a C string, so an
//! argument, a path or an environment entry holding one fails only at the
//! agent. `metadata` is not checked: it reaches the run as a JSON file,
//! where a NUL is the escape `\u0000` and harmless. Attachment contents
//! are bytes.

use std::collections::{BTreeMap, HashSet};

use base64::Engine as _;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use standby_protocol::{GitCredential, Run, Secret, Workspace};
use utoipa::ToSchema;

use super::documented::ThreadId;
use super::openapi;
use crate::app::{ApiError, bad};
use crate::credential::hex;
use crate::model::{RunRequest, StoredAttachment};

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
        for (j, input) in step.inputs.iter().flatten().enumerate() {
            check_relative(&format!("workspace.setup[{i}].inputs[{j}]"), input)?;
        }
    }
    Ok(())
}

impl Submission {
    /// Everything `POST /v1/runs` checks: no NUL byte in any string, the
    /// thread id, then [`Self::validate`]. The run, what is fetched later,
    /// and the thread id.
    pub fn accept(mut self) -> Result<(Run, RunRequest, Option<String>), ApiError> {
        if let Some(field) = first_nul(&self) {
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

/// The path of the first string of `submission` holding a NUL byte, in the
/// API's field syntax (`env.NAME`, `command[2]`, `git_credentials[0].host`).
pub(crate) fn first_nul(submission: &Submission) -> Option<String> {
    let mut found = Found::default();
    for (i, arg) in submission.command.iter().enumerate() {
        found.check(|| format!("command[{i}]"), arg);
    }
    if let Some(cwd) = &submission.cwd {
        found.check(|| "cwd".into(), cwd);
    }
    found.map("env", submission.env.iter().map(|(k, v)| (k, v.as_str())));
    found.map("mcp_env", submission.mcp_env.iter().map(|(k, v)| (k, v.as_str())));
    found.map("secrets", secrets(&submission.secrets));
    found.map("cloud_env", secrets(&submission.cloud_env));
    for (i, credential) in submission.git_credentials.iter().enumerate() {
        found.check(|| format!("git_credentials[{i}].protocol"), &credential.protocol);
        found.check(|| format!("git_credentials[{i}].host"), &credential.host);
        found.check(|| format!("git_credentials[{i}].username"), &credential.username);
        found.check(|| format!("git_credentials[{i}].password"), credential.password.expose());
    }
    for (i, attachment) in submission.attachments.iter().enumerate() {
        found.check(|| format!("attachments[{i}].name"), &attachment.name);
    }
    if let Some(thread_id) = &submission.thread_id {
        found.check(|| "thread_id".into(), thread_id);
    }
    if let Some(workspace) = &submission.workspace {
        found.workspace(workspace);
    }
    found.0
}

fn secrets(map: &BTreeMap<String, Secret>) -> impl Iterator<Item = (&String, &str)> {
    map.iter().map(|(name, value)| (name, value.expose()))
}

/// The first offending field, once found.
#[derive(Debug, Default)]
struct Found(Option<String>);

impl Found {
    fn check(&mut self, field: impl FnOnce() -> String, value: &str) {
        if self.0.is_none() && value.contains('\0') {
            self.0 = Some(field());
        }
    }

    /// A map's names and values; a name holding a NUL is shown escaped.
    fn map<'a>(&mut self, field: &str, entries: impl Iterator<Item = (&'a String, &'a str)>) {
        for (name, value) in entries {
            let path = || format!("{field}.{}", name.replace('\0', "\\0"));
            self.check(path, name);
            self.check(path, value);
        }
    }

    fn workspace(&mut self, workspace: &Workspace) {
        for (i, repo) in workspace.repos.iter().enumerate() {
            self.check(|| format!("workspace.repos[{i}].url"), &repo.url);
            self.check(|| format!("workspace.repos[{i}].path"), &repo.path);
            if let Some(git_ref) = &repo.git_ref {
                self.check(|| format!("workspace.repos[{i}].ref"), git_ref);
            }
            if let Some(sha) = &repo.expected_sha {
                self.check(|| format!("workspace.repos[{i}].expected_sha"), sha);
            }
        }
        for (i, step) in workspace.setup.iter().enumerate() {
            self.check(|| format!("workspace.setup[{i}].name"), &step.name);
            for (j, arg) in step.command.iter().enumerate() {
                self.check(|| format!("workspace.setup[{i}].command[{j}]"), arg);
            }
            if let Some(cwd) = &step.cwd {
                self.check(|| format!("workspace.setup[{i}].cwd"), cwd);
            }
            for (j, input) in step.inputs.iter().flatten().enumerate() {
                self.check(|| format!("workspace.setup[{i}].inputs[{j}]"), input);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;
    use crate::app::parse_json;

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
            (
                format!(
                    r#"{{"command": ["ls"], "workspace": {{"setup": [{{"name": "s", "command": ["make"], "inputs": ["{nul}"]}}]}}}}"#
                ),
                "workspace.setup[0].inputs[0]",
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
