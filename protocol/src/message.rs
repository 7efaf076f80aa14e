use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{Attachment, Secret, TraceContext, Workspace};

/// The agent's lifecycle state, as reported in every heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AgentState {
    Preparing,
    Ready,
    Installing,
    Confirming,
    Running,
    Finishing,
}

/// Agent → server. Text frames only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AgentMessage {
    Heartbeat { state: AgentState, execution_id: Option<String> },
}

impl AgentMessage {
    pub fn encode(&self) -> String {
        // A heartbeat holds only strings and enums: serialization cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// Server → agent. [`ServerMessage::decode`] maps a `type` it does not know
/// to [`ServerMessage::Unknown`] instead of failing, so a newer server can
/// add message types without breaking older agents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMessage {
    // Boxed: an assignment is many times the size of the other messages.
    Assignment(Box<Assignment>),
    Retired(Retired),
    Cancel(Cancel),
    /// A message of a type this version does not know; never encoded.
    #[serde(skip)]
    Unknown {
        type_name: String,
    },
}

/// Why a text frame could not be turned into a [`ServerMessage`].
///
/// Messages never quote the frame's content (it may hold a credential): see
/// [`describe_json_error`](crate::describe_json_error).
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("frame is not JSON: {0}")]
    NotJson(String),
    #[error("frame has no string field `type`")]
    NoType,
    #[error("`{type_name}` message is malformed: {problem}")]
    Malformed { type_name: String, problem: String },
}

impl ServerMessage {
    const KNOWN: [&'static str; 3] = ["assignment", "retired", "cancel"];

    pub fn decode(text: &str) -> Result<Self, DecodeError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| DecodeError::NotJson(crate::describe_json_error(&e)))?;
        let type_name = value
            .as_object()
            .and_then(|object| object.get("type"))
            .and_then(|t| t.as_str())
            .ok_or(DecodeError::NoType)?
            .to_owned();
        if !Self::KNOWN.contains(&type_name.as_str()) {
            return Ok(Self::Unknown { type_name });
        }
        serde_json::from_value(value)
            .map_err(|e| DecodeError::Malformed { type_name, problem: crate::describe_json_error(&e) })
    }

    /// The JSON text of a known message; `None` for [`ServerMessage::Unknown`].
    pub fn encode(&self) -> Option<String> {
        serde_json::to_string(self).ok()
    }
}

/// A run committed to this sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Assignment {
    pub execution_id: String,
    pub run_credential: Secret,
    pub run: Run,
    /// The server's trace of this run's start (1.3): the agent's spans are
    /// children of its `traceparent`. Absent when the server traces
    /// nothing; a value of another shape decodes as absent, and a
    /// malformed `traceparent` is ignored ([`TraceContext::parent`]).
    #[serde(default, deserialize_with = "crate::trace::lenient", skip_serializing_if = "Option::is_none")]
    pub trace_context: Option<TraceContext>,
}

/// What to run and with what.
// The default has no command (an invalid run): it is a base for
// `Run { command, ..Run::default() }`, not a run to send.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Run {
    /// Empty is an invalid run: it fails the install, not requeueable.
    #[serde(default)]
    pub command: Vec<String>,
    /// Relative to the workspace; the workspace itself when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Overlaid on each MCP server's spec env when it is restarted.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mcp_env: BTreeMap<String, String>,
    /// The workspace the run expects; its fingerprint must match the
    /// prepared one. Servers always send it (amendment 1); an agent that
    /// receives none from an older server treats the run as expecting the
    /// prepared workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace: Option<Workspace>,
    #[serde(default)]
    pub strict_mcp: bool,
    /// Inline attachments (amendment 5): the same list the attachments call
    /// answers. When present the agent does not make that call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachments: Option<Vec<Attachment>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Retired {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Cancel {
    pub execution_id: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_type_keeps_its_name() {
        let message = ServerMessage::decode(r#"{"type":"resize","rows":3}"#).expect("decodes");
        assert_eq!(message, ServerMessage::Unknown { type_name: "resize".into() });
    }

    #[test]
    fn malformed_frames_are_errors() {
        assert!(matches!(ServerMessage::decode("not json"), Err(DecodeError::NotJson(_))));
        assert!(matches!(ServerMessage::decode("[1,2]"), Err(DecodeError::NoType)));
        assert!(matches!(ServerMessage::decode(r#"{"type":7}"#), Err(DecodeError::NoType)));
        assert!(matches!(ServerMessage::decode(r#"{"type":"cancel"}"#), Err(DecodeError::Malformed { .. })));
    }

    #[test]
    fn malformed_error_does_not_echo_the_credential() {
        let text = r#"{"type":"assignment","execution_id":"e","run_credential":"sekrit","run":7}"#;
        let error = ServerMessage::decode(text).expect_err("run is not an object");
        assert!(!format!("{error} {error:?}").contains("sekrit"));
    }

    #[test]
    fn wrong_types_do_not_echo_values() {
        let text = r#"{"type":"assignment","execution_id":"e","run_credential":"c","run":{"command":"sekrit"}}"#;
        let error = ServerMessage::decode(text).expect_err("command is not a list");
        assert!(!format!("{error} {error:?}").contains("sekrit"), "{error}");
        let error = ServerMessage::decode(r#"{"type":"cancel"}"#).expect_err("no execution_id");
        assert!(error.to_string().contains("missing field `execution_id`"), "{error}");
    }

    #[test]
    fn heartbeat_encodes_null_execution_id() {
        let heartbeat = AgentMessage::Heartbeat { state: AgentState::Preparing, execution_id: None };
        assert_eq!(heartbeat.encode(), r#"{"type":"heartbeat","state":"preparing","execution_id":null}"#);
    }

    #[test]
    fn unknown_fields_are_ignored() {
        let message = ServerMessage::decode(r#"{"type":"retired","reason":"r","extra":1}"#).expect("decodes");
        assert_eq!(message, ServerMessage::Retired(Retired { reason: Some("r".into()) }));
    }
}
