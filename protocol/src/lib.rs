//! The standby wire contract, version 1, as typed values.
//!
//! This crate does no IO and reads no clock: it turns bytes into values and
//! values into bytes, so both halves of the contract (and servers written in
//! other languages, through `schema/` and `fixtures/`) agree on one shape.

mod fingerprint;
mod http;
pub mod log_ledger;
mod message;
mod secret;
mod spec;

pub use fingerprint::{Fingerprint, fingerprint};
pub use http::{
    Attachment, AttachmentsResponse, CloudCredentialsResponse, ErrorBody, Event, EventKind, GitCredential,
    GitCredentialsResponse, LogChunk, LogReceived, SecretsResponse,
};
pub use message::{AgentMessage, AgentState, Assignment, Cancel, DecodeError, Retired, Run, ServerMessage};
pub use secret::Secret;
pub use spec::{McpServer, McpTransport, Repo, SetupStep, Spec, Workspace};

/// Describes a JSON error without quoting the input: serde_json's own
/// messages echo offending values ("invalid type: string \"…\""), and the
/// value may be a credential or a secret.
pub fn describe_json_error(error: &serde_json::Error) -> String {
    let message = error.to_string();
    if message.starts_with("missing field") || message.starts_with("duplicate field") {
        return message;
    }
    let kind = match error.classify() {
        serde_json::error::Category::Io => "read error",
        serde_json::error::Category::Syntax => "syntax error",
        serde_json::error::Category::Data => "wrong type or value",
        serde_json::error::Category::Eof => "unexpected end of input",
    };
    if error.line() == 0 {
        kind.to_owned()
    } else {
        format!("{kind} at line {} column {}", error.line(), error.column())
    }
}

/// Value of the `Standby-Protocol` header every request carries.
pub const PROTOCOL_VERSION: &str = "1";
/// Name of the header that carries [`PROTOCOL_VERSION`].
pub const PROTOCOL_HEADER: &str = "Standby-Protocol";
/// Path of the spec endpoint, appended to the server's base URL.
pub const SPEC_PATH: &str = "/v1/standby/spec";
/// Path of the control socket, appended to the server's base URL.
pub const SOCKET_PATH: &str = "/ws";

/// Paths of the per-execution HTTP calls, appended to the server's base URL.
pub mod paths {
    /// `GET`: the run's secrets.
    pub fn secrets(execution_id: &str) -> String {
        format!("/v1/executions/{execution_id}/secrets")
    }
    /// `GET`: the list of attachments.
    pub fn attachments(execution_id: &str) -> String {
        format!("/v1/executions/{execution_id}/attachments")
    }
    /// `POST`: git credentials.
    pub fn git_credentials(execution_id: &str) -> String {
        format!("/v1/executions/{execution_id}/git-credentials")
    }
    /// `GET`: run metadata (any JSON).
    pub fn metadata(execution_id: &str) -> String {
        format!("/v1/executions/{execution_id}/metadata")
    }
    /// `POST`: cloud credentials, as environment variables.
    pub fn cloud_credentials(execution_id: &str) -> String {
        format!("/v1/executions/{execution_id}/cloud-credentials")
    }
    /// `POST`: lifecycle events.
    pub fn events(execution_id: &str) -> String {
        format!("/v1/executions/{execution_id}/events")
    }
    /// `POST`: terminal output.
    pub fn log(execution_id: &str) -> String {
        format!("/v1/executions/{execution_id}/log")
    }
}
