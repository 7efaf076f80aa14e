//! What a test hands the server: the data of an execution, scripted
//! answers and frames to send.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};
use standby_protocol::{
    Attachment, AttachmentsResponse, CloudCredentialsResponse, CredentialKind, Endpoint, GitCredential,
    GitCredentialsResponse, Run, Secret, SecretsResponse, Standing, Workspace, paths,
};

use super::calls::HttpAnswer;

/// One execution as the server commits it: the run sent in the assignment
/// and the data its HTTP calls answer with.
#[derive(Debug, Clone)]
pub struct ExecutionSetup {
    /// Minted (`exe_<n>`) when absent.
    pub execution_id: Option<String>,
    pub run: Run,
    pub secrets: BTreeMap<String, String>,
    pub attachments: Vec<AttachmentSetup>,
    pub git_credentials: Vec<GitCredential>,
    pub metadata: serde_json::Value,
    pub cloud_env: BTreeMap<String, String>,
    /// Lists the attachments in the assignment's `run.attachments`
    /// (amendment 5) as well as answering the attachments call.
    pub inline_attachments: bool,
}

impl ExecutionSetup {
    /// A run of `command` in the workspace root with no data.
    pub fn new(command: &[&str]) -> Self {
        Self {
            execution_id: None,
            run: Run { command: command.iter().map(|part| (*part).to_owned()).collect(), ..Run::default() },
            secrets: BTreeMap::new(),
            attachments: Vec::new(),
            git_credentials: Vec::new(),
            metadata: serde_json::json!({}),
            cloud_env: BTreeMap::new(),
            inline_attachments: false,
        }
    }

    pub fn execution_id(mut self, id: &str) -> Self {
        self.execution_id = Some(id.to_owned());
        self
    }

    pub fn cwd(mut self, cwd: &str) -> Self {
        self.run.cwd = Some(cwd.to_owned());
        self
    }

    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.run.env.insert(name.to_owned(), value.to_owned());
        self
    }

    pub fn mcp_env(mut self, name: &str, value: &str) -> Self {
        self.run.mcp_env.insert(name.to_owned(), value.to_owned());
        self
    }

    /// The workspace the run expects (checked against the prepared one).
    pub fn workspace(mut self, workspace: Workspace) -> Self {
        self.run.workspace = Some(workspace);
        self
    }

    pub fn strict_mcp(mut self, strict: bool) -> Self {
        self.run.strict_mcp = strict;
        self
    }

    pub fn secret(mut self, name: &str, value: &str) -> Self {
        self.secrets.insert(name.to_owned(), value.to_owned());
        self
    }

    /// A file served by this server at
    /// `/v1/executions/{id}/attachments/{name}` with its true SHA-256.
    pub fn attachment(mut self, name: &str, content: &[u8]) -> Self {
        self.attachments.push(AttachmentSetup::new(name, content));
        self
    }

    /// Sends the attachments inline in the assignment (amendment 5).
    pub fn inline_attachments(mut self) -> Self {
        self.inline_attachments = true;
        self
    }

    pub fn attachment_setup(mut self, attachment: AttachmentSetup) -> Self {
        self.attachments.push(attachment);
        self
    }

    pub fn git_credential(mut self, protocol: &str, host: &str, username: &str, password: &str) -> Self {
        self.git_credentials.push(GitCredential {
            protocol: protocol.to_owned(),
            host: host.to_owned(),
            username: username.to_owned(),
            password: Secret::new(password),
        });
        self
    }

    pub fn metadata(mut self, metadata: serde_json::Value) -> Self {
        self.metadata = metadata;
        self
    }

    pub fn cloud_env(mut self, name: &str, value: &str) -> Self {
        self.cloud_env.insert(name.to_owned(), value.to_owned());
        self
    }

    /// The attachments as the attachments call answers them (and an inline
    /// assignment lists them).
    pub(crate) fn listed_attachments(&self, execution_id: &str) -> Vec<Attachment> {
        let sha256 = |content: &[u8]| Sha256::digest(content).iter().map(|byte| format!("{byte:02x}")).collect();
        self.attachments
            .iter()
            .map(|attachment| Attachment {
                name: attachment.name.clone(),
                url: attachment.url.clone().unwrap_or_else(|| paths::attachment(execution_id, &attachment.name)),
                sha256: attachment.sha256.clone().unwrap_or_else(|| sha256(&attachment.content)),
            })
            .collect()
    }

    /// The answer to a call for this data: `attachment` names the file of
    /// an [`Endpoint::AttachmentFile`] call.
    pub(crate) fn answer(&self, execution_id: &str, endpoint: Endpoint, attachment: Option<&str>) -> HttpAnswer {
        let secrets = |map: &BTreeMap<String, String>| {
            map.iter().map(|(name, value)| (name.clone(), Secret::new(value.clone()))).collect()
        };
        match endpoint {
            Endpoint::Secrets => HttpAnswer::json(200, &SecretsResponse { secrets: secrets(&self.secrets) }),
            Endpoint::Attachments => {
                HttpAnswer::json(200, &AttachmentsResponse { attachments: self.listed_attachments(execution_id) })
            }
            Endpoint::AttachmentFile => {
                match self.attachments.iter().find(|file| Some(file.name.as_str()) == attachment) {
                    Some(file) => HttpAnswer::bytes(file.content.clone()),
                    None => HttpAnswer::error(404, "no such attachment"),
                }
            }
            Endpoint::GitCredentials => {
                HttpAnswer::json(200, &GitCredentialsResponse { credentials: self.git_credentials.clone() })
            }
            Endpoint::Metadata => HttpAnswer::json(200, &self.metadata),
            Endpoint::CloudCredentials => {
                HttpAnswer::json(200, &CloudCredentialsResponse { env: secrets(&self.cloud_env) })
            }
            Endpoint::Spec | Endpoint::Events | Endpoint::Log => HttpAnswer::error(404, "not a data call"),
        }
    }
}

/// An attachment, with overrides to make it lie about itself.
#[derive(Debug, Clone)]
pub struct AttachmentSetup {
    pub name: String,
    pub content: Vec<u8>,
    /// Listed instead of the true SHA-256 of `content`.
    pub sha256: Option<String>,
    /// Listed instead of this server's own path for the file.
    pub url: Option<String>,
}

impl AttachmentSetup {
    pub fn new(name: &str, content: &[u8]) -> Self {
        Self { name: name.to_owned(), content: content.to_vec(), sha256: None, url: None }
    }

    pub fn wrong_sha256(mut self, sha256: &str) -> Self {
        self.sha256 = Some(sha256.to_owned());
        self
    }

    pub fn url(mut self, url: &str) -> Self {
        self.url = Some(url.to_owned());
        self
    }
}

/// An answer to the next upgrade request, given before any credential check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptedUpgrade {
    pub status: u16,
    /// Seconds, sent as `Retry-After`.
    pub retry_after: Option<u64>,
    /// Only a request with this kind of credential consumes the answer.
    pub credential: Option<CredentialKind>,
}

impl ScriptedUpgrade {
    pub fn status(status: u16) -> Self {
        Self { status, retry_after: None, credential: None }
    }

    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    pub fn for_credential(mut self, kind: CredentialKind) -> Self {
        self.credential = Some(kind);
        self
    }
}

/// Failing answers of one HTTP endpoint, given after the credential check
/// (a glitching server still refuses a stranger first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub status: u16,
    /// How many calls fail before the endpoint answers normally again;
    /// `None` fails every call.
    pub remaining: Option<usize>,
    pub retry_after: Option<u64>,
}

impl Failure {
    pub fn times(status: u16, count: usize) -> Self {
        Self { status, remaining: Some(count), retry_after: None }
    }

    pub fn always(status: u16) -> Self {
        Self { status, remaining: None, retry_after: None }
    }

    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }
}

/// A frame the test sends on a live connection, legal or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Any text, including text that is not JSON.
    Text(String),
    Binary(Vec<u8>),
    Ping(Vec<u8>),
    Pong(Vec<u8>),
    /// A close frame; the server then waits for the agent's close reply.
    Close(Option<(u16, String)>),
}

/// A request of the test that the contract's state machine refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServerError {
    #[error("no standby credential {0:?}")]
    UnknownStandby(String),
    #[error("standby {token:?} is {standing:?} and cannot take {action}")]
    StandbyNotActive { token: String, standing: Standing, action: &'static str },
    #[error("standby {token:?} already holds execution {execution_id:?}")]
    AlreadyAssigned { token: String, execution_id: String },
    #[error("execution {0:?} already exists (one sandbox per execution)")]
    DuplicateExecution(String),
    #[error("no execution {0:?}")]
    UnknownExecution(String),
    #[error("the run credential of execution {0:?} is already revoked")]
    AlreadyRevoked(String),
    #[error("no live connection {0}")]
    NoSuchConnection(super::ConnectionId),
}
