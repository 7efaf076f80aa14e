//! The standby wire contract, version 1, as typed values.
//!
//! This crate does no IO and reads no clock: it turns bytes into values and
//! values into bytes, so both halves of the contract (and servers written in
//! other languages, through `schema/` and `fixtures/`) agree on one shape.

mod endpoint;
mod exit;
mod fingerprint;
mod http;
mod install;
pub mod layout;
pub mod log_chunk;
mod message;
mod refusal;
mod secret;
mod spec;
mod trace;
pub mod vars;

pub use endpoint::{Endpoint, Method};
pub use exit::ExitCode;
pub use fingerprint::{Fingerprint, fingerprint};
pub use http::{
    Attachment, AttachmentsResponse, CloudCredentialsResponse, ErrorBody, Event, EventKind, GitCredential,
    GitCredentialsResponse, LogChunk, LogReceived, OutOfOrder, SecretsResponse,
};
pub use install::{Cause, Stage};
pub use message::{AgentMessage, AgentState, Assignment, Cancel, DecodeError, Retired, Run, ServerMessage};
pub use refusal::{Answer, CredentialKind, Purpose, Refusal, Standing};
pub use secret::Secret;
pub use spec::{McpClientCapability, McpServer, McpTransport, Repo, SetupStep, Spec, Workspace};
pub use trace::{TRACESTATE_MAX, TRACESTATE_MEMBERS_MAX, TraceContext, TraceError, TraceParent};

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
/// The `*_ROUTE` constants are the same paths as a router's patterns.
pub mod paths {
    /// Route pattern of [`secrets`].
    pub const SECRETS_ROUTE: &str = "/v1/executions/{id}/secrets";
    /// Route pattern of [`attachments`].
    pub const ATTACHMENTS_ROUTE: &str = "/v1/executions/{id}/attachments";
    /// Route pattern of [`attachment`].
    pub const ATTACHMENT_ROUTE: &str = "/v1/executions/{id}/attachments/{name}";
    /// Route pattern of [`git_credentials`].
    pub const GIT_CREDENTIALS_ROUTE: &str = "/v1/executions/{id}/git-credentials";
    /// Route pattern of [`metadata`].
    pub const METADATA_ROUTE: &str = "/v1/executions/{id}/metadata";
    /// Route pattern of [`cloud_credentials`].
    pub const CLOUD_CREDENTIALS_ROUTE: &str = "/v1/executions/{id}/cloud-credentials";
    /// Route pattern of [`events`].
    pub const EVENTS_ROUTE: &str = "/v1/executions/{id}/events";
    /// Route pattern of [`log`].
    pub const LOG_ROUTE: &str = "/v1/executions/{id}/log";

    /// `GET`: the run's secrets.
    pub fn secrets(execution_id: &str) -> String {
        format!("/v1/executions/{execution_id}/secrets")
    }
    /// `GET`: the list of attachments.
    pub fn attachments(execution_id: &str) -> String {
        format!("/v1/executions/{execution_id}/attachments")
    }
    /// `GET`: one attachment's content, as the reference server serves it
    /// (the contract lets a server name any URL in the list).
    pub fn attachment(execution_id: &str, name: &str) -> String {
        format!("/v1/executions/{execution_id}/attachments/{name}")
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

#[cfg(test)]
mod tests {
    use super::paths;

    #[test]
    fn every_path_matches_its_route() {
        let cases = [
            (paths::secrets("x"), paths::SECRETS_ROUTE),
            (paths::attachments("x"), paths::ATTACHMENTS_ROUTE),
            (paths::attachment("x", "n"), paths::ATTACHMENT_ROUTE),
            (paths::git_credentials("x"), paths::GIT_CREDENTIALS_ROUTE),
            (paths::metadata("x"), paths::METADATA_ROUTE),
            (paths::cloud_credentials("x"), paths::CLOUD_CREDENTIALS_ROUTE),
            (paths::events("x"), paths::EVENTS_ROUTE),
            (paths::log("x"), paths::LOG_ROUTE),
        ];
        for (path, route) in cases {
            assert_eq!(path, route.replace("{id}", "x").replace("{name}", "n"));
        }
    }
}
