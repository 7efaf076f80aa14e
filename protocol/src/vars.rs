//! The environment variables of the contract: the agent's configuration
//! (docs/contract.md, "Configuration") and what the agent sets for the run.
//!
//! The agent reads them, a provider sets them when it launches an agent,
//! and the tests' harness sets them: one spelling for all three.

/// Base URL of the server.
pub const SERVER_URL: &str = "STANDBY_SERVER_URL";
/// The standby credential.
pub const TOKEN: &str = "STANDBY_TOKEN";
/// Path of a file holding the standby credential (amendment 3).
pub const TOKEN_FILE: &str = "STANDBY_TOKEN_FILE";
/// Directory the workspace is prepared in.
pub const WORKSPACE: &str = "STANDBY_WORKSPACE";
/// Path of a spec file; the spec is fetched from the server when unset.
pub const SPEC: &str = "STANDBY_SPEC";
/// The heartbeat cadence.
pub const HEARTBEAT_INTERVAL: &str = "STANDBY_HEARTBEAT_INTERVAL";
/// No assignment by then: exit 12.
pub const DEADLINE: &str = "STANDBY_DEADLINE";
/// How long delivery confirmation retries transient failures.
pub const CONFIRM_TIMEOUT: &str = "STANDBY_CONFIRM_TIMEOUT";
/// Bound on installing the run, retries included.
pub const INSTALL_TIMEOUT: &str = "STANDBY_INSTALL_TIMEOUT";
/// Bound on the whole preparation (amendment 4).
pub const PREPARE_TIMEOUT: &str = "STANDBY_PREPARE_TIMEOUT";
/// (1.3) The snapshot a sandbox's filesystem was made from, set by a
/// provider that makes sandboxes from a snapshot of a prepared one.
pub const SNAPSHOT: &str = "STANDBY_SNAPSHOT";
/// The agent's log filter.
pub const LOG: &str = "STANDBY_LOG";
/// The agent's log format, `text` or `json`.
pub const LOG_FORMAT: &str = "STANDBY_LOG_FORMAT";
/// The OTLP/HTTP endpoint the agent's spans go to (1.3); unset: none.
pub const OTLP_ENDPOINT: &str = "STANDBY_OTLP_ENDPOINT";

/// Set for the run: its execution id.
pub const EXECUTION_ID: &str = "STANDBY_EXECUTION_ID";
/// Set for the run: the file holding the run's metadata.
pub const METADATA_FILE: &str = "STANDBY_METADATA_FILE";
/// Set for the run: the directory holding the run's attachments.
pub const ATTACHMENTS_DIR: &str = "STANDBY_ATTACHMENTS_DIR";
/// Set for the run where MCP servers are listed: their configuration file.
pub const MCP_CONFIG: &str = "STANDBY_MCP_CONFIG";

/// The variables that carry the standby credential: the agent's alone,
/// never passed to anything it starts.
pub const CREDENTIAL: [&str; 2] = [TOKEN, TOKEN_FILE];
