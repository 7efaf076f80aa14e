use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What a standby prepares before any run exists: `GET /v1/standby/spec` or
/// the file named by `STANDBY_SPEC`. Every field but `workspace` may be absent;
/// the default is the empty spec (no repos, no setup, no MCP servers).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Spec {
    pub workspace: Workspace,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_servers: Vec<McpServer>,
    /// **(1.2)** What the agent's MCP bridge declares to every stdio server
    /// it initializes, unless the server says otherwise
    /// ([`McpServer::client_capabilities`]). Absent: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp_client_capabilities: Option<Vec<McpClientCapability>>,
    /// The idle shell's command line; the agent picks a default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<Vec<String>>,
    /// RFC 3339 time after which a standby with no assignment exits 12.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
}

impl Spec {
    /// The MCP servers, each naming the client capabilities the bridge
    /// declares to it ([`McpServer::declared_capabilities`] with this
    /// spec's `mcp_client_capabilities`).
    pub fn mcp_servers_with_defaults(&self) -> Vec<McpServer> {
        let spec_default = self.mcp_client_capabilities.as_deref();
        self.mcp_servers
            .iter()
            .map(|server| McpServer {
                client_capabilities: Some(server.declared_capabilities(spec_default)),
                ..server.clone()
            })
            .collect()
    }
}

/// The prepared workspace. Its [`fingerprint`](crate::fingerprint) decides
/// whether a run may use a prepared sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Workspace {
    #[serde(default)]
    pub repos: Vec<Repo>,
    #[serde(default)]
    pub setup: Vec<SetupStep>,
}

/// A git repository cloned into `<workspace>/<path>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Repo {
    pub url: String,
    /// Relative to the workspace; a path that leaves it is refused.
    pub path: String,
    /// Branch, tag or commit to check out; the remote's default when absent.
    #[serde(default, rename = "ref")]
    pub git_ref: Option<String>,
    /// The commit a run needs; not part of the fingerprint.
    #[serde(default)]
    pub expected_sha: Option<String>,
}

/// One setup command, run in order after the clones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SetupStep {
    pub name: String,
    pub command: Vec<String>,
    /// Relative to the workspace; the workspace itself when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Seconds before the step is killed and preparation fails. A JSON
    /// number with no fraction (`900.0`) is the integer it names, as JSON
    /// Schema's `integer` says.
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schemars(range(max = u64::MAX))]
    pub timeout_s: Option<u64>,
    /// **(1.3)** Paths, relative to the workspace, that the step's result
    /// depends on (a lock file, a directory of them). On a sandbox made from
    /// a snapshot whose clones moved, the step runs again only when a file
    /// at or under one of them changed; absent, it runs again on any move.
    /// Left out of the canonical form when absent, so the fingerprints of
    /// specs written before 1.3 are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inputs: Option<Vec<String>>,
}

impl SetupStep {
    /// Whether the step runs again after a refresh moved a clone: `changed`
    /// lists the workspace-relative paths of the files that changed, `None`
    /// when they could not be listed. A step that declares no inputs, or
    /// whose changes are unknown, runs again; one that declares inputs runs
    /// again only when a changed file is one of them or lies under one.
    pub fn runs_again_after_a_move(&self, changed: Option<&[String]>) -> bool {
        let (Some(inputs), Some(changed)) = (&self.inputs, changed) else { return true };
        inputs.iter().any(|input| changed.iter().any(|path| input_covers(input, path)))
    }
}

/// Whether the declared input `input` (a file or a directory, `.` or empty
/// for the whole workspace) covers the changed file `path`. Both are
/// workspace-relative; `./` prefixes and trailing slashes do not matter.
fn input_covers(input: &str, path: &str) -> bool {
    let input = normalize(input);
    let path = normalize(path);
    input.is_empty() || path == input || path.strip_prefix(input).is_some_and(|rest| rest.starts_with('/'))
}

fn normalize(path: &str) -> &str {
    let mut path = path.trim_end_matches('/');
    while let Some(rest) = path.strip_prefix("./") {
        path = rest;
    }
    if path == "." { "" } else { path }
}

/// An optional non-negative integer, written as an integer or as a number
/// with no fractional part (`256.0`: JSON Schema counts it an integer, so a
/// client generated from the schema may send it).
fn whole_seconds<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    let Some(number) = Option::<serde_json::Number>::deserialize(deserializer)? else { return Ok(None) };
    if let Some(whole) = number.as_u64() {
        return Ok(Some(whole));
    }
    match number.as_f64() {
        // Below 2^64, so the conversion is exact for whole values.
        Some(value) if value.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&value) => {
            Ok(Some(value as u64))
        }
        _ => Err(serde::de::Error::custom(format!("expected a non-negative whole number of seconds, not {number}"))),
    }
}

/// How a run reaches an MCP server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpTransport {
    /// The server serves MCP over HTTP itself, at `url`.
    Http,
    /// The server speaks MCP on stdin/stdout; the agent bridges it to HTTP.
    Stdio,
}

/// An MCP server started during preparation and restarted with the run's
/// `mcp_env` at assignment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct McpServer {
    pub name: String,
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// `host:port` that accepts a TCP connection once the server is up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_tcp: Option<String>,
    /// Absent: a plain process, not listed in `mcp.json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<McpTransport>,
    /// Where an `http` server is reached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// **(1.2)** For a `stdio` server: the client capabilities the bridge
    /// declares in its `initialize`, so that a server that checks them
    /// offers the tools that need them. Absent: the spec's
    /// `mcp_client_capabilities`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_capabilities: Option<Vec<McpClientCapability>>,
    /// **(1.2)** For a `stdio` server: whether the bridge answers the
    /// server's `roots/list` with the workspace root when no client of the
    /// bridge declared roots. Absent: true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_root: Option<bool>,
}

/// What an MCP client may offer a server, which a run's harness serves
/// through the agent's bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum McpClientCapability {
    /// `sampling/createMessage`.
    Sampling,
    /// `roots/list`, and `notifications/roots/list_changed` from the client.
    Roots,
    /// `elicitation/create`.
    Elicitation,
}

impl McpClientCapability {
    /// Every capability: what is declared when the spec says nothing.
    pub const ALL: [Self; 3] = [Self::Sampling, Self::Roots, Self::Elicitation];
}

impl McpServer {
    /// The client capabilities the bridge declares to this server: its
    /// own list, else the spec's (`spec_default`), else all of them.
    pub fn declared_capabilities(&self, spec_default: Option<&[McpClientCapability]>) -> Vec<McpClientCapability> {
        let mut declared = match (&self.client_capabilities, spec_default) {
            (Some(own), _) => own.clone(),
            (None, Some(spec)) => spec.to_vec(),
            (None, None) => McpClientCapability::ALL.to_vec(),
        };
        declared.sort_unstable();
        declared.dedup();
        declared
    }

    /// Whether the bridge answers `roots/list` with the workspace root
    /// when no client can.
    pub fn answers_workspace_root(&self) -> bool {
        self.workspace_root.unwrap_or(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout(json: &str) -> Result<Option<u64>, String> {
        let step = format!(r#"{{"name":"deps","command":["true"]{json}}}"#);
        serde_json::from_str::<SetupStep>(&step).map(|step| step.timeout_s).map_err(|error| error.to_string())
    }

    fn step_with(inputs: Option<&[&str]>) -> SetupStep {
        SetupStep {
            name: "deps".into(),
            command: vec!["make".into()],
            cwd: None,
            timeout_s: None,
            inputs: inputs.map(|inputs| inputs.iter().map(|input| (*input).to_owned()).collect()),
        }
    }

    #[test]
    fn a_step_runs_again_only_when_a_declared_input_changed() {
        let changed = |paths: &[&str]| paths.iter().map(|path| (*path).to_owned()).collect::<Vec<_>>();
        let lock = step_with(Some(&["app/package-lock.json", "./app/patches/"]));
        assert!(lock.runs_again_after_a_move(Some(&changed(&["app/package-lock.json"]))));
        assert!(lock.runs_again_after_a_move(Some(&changed(&["README.md", "app/patches/a.diff"]))));
        assert!(!lock.runs_again_after_a_move(Some(&changed(&["app/src/main.js", "app/package-lock.json.bak"]))));
        assert!(!lock.runs_again_after_a_move(Some(&changed(&["app/patchesX/a.diff"]))));
        assert!(!lock.runs_again_after_a_move(Some(&[])));
        assert!(lock.runs_again_after_a_move(None), "unknown changes run the step");
        assert!(step_with(None).runs_again_after_a_move(Some(&[])), "no inputs: any move runs the step");
        assert!(!step_with(Some(&[])).runs_again_after_a_move(Some(&changed(&["a"]))), "no inputs declared");
        assert!(step_with(Some(&["."])).runs_again_after_a_move(Some(&changed(&["a/b"]))), "the whole workspace");
    }

    #[test]
    fn absent_inputs_stay_out_of_the_wire_form() {
        let json = serde_json::to_value(step_with(None)).expect("a step serialises");
        assert!(json.get("inputs").is_none(), "{json}");
        let json = serde_json::to_value(step_with(Some(&["a"]))).expect("a step serialises");
        assert_eq!(json["inputs"], serde_json::json!(["a"]));
    }

    #[test]
    fn declared_capabilities_are_the_servers_else_the_specs_else_all() {
        use McpClientCapability::{Elicitation, Roots, Sampling};
        let mut server: McpServer =
            serde_json::from_str(r#"{"name":"s","command":["s"],"transport":"stdio"}"#).expect("a server");
        assert_eq!(server.declared_capabilities(None), [Sampling, Roots, Elicitation]);
        assert_eq!(server.declared_capabilities(Some(&[Roots])), [Roots]);
        server.client_capabilities = Some(vec![Elicitation, Sampling, Sampling]);
        assert_eq!(server.declared_capabilities(Some(&[Roots])), [Sampling, Elicitation], "sorted, once each");
        server.client_capabilities = Some(Vec::new());
        assert_eq!(server.declared_capabilities(None), [], "none at all is a choice");
        assert!(server.answers_workspace_root());
        server.workspace_root = Some(false);
        assert!(!server.answers_workspace_root());
    }

    #[test]
    fn a_setup_timeout_is_a_whole_number_of_seconds_however_it_is_written() {
        assert_eq!(timeout(""), Ok(None));
        assert_eq!(timeout(r#","timeout_s":null"#), Ok(None));
        assert_eq!(timeout(r#","timeout_s":900"#), Ok(Some(900)));
        assert_eq!(timeout(r#","timeout_s":256.0"#), Ok(Some(256)), "an integer as JSON Schema counts one");
        assert_eq!(timeout(r#","timeout_s":1e3"#), Ok(Some(1000)));
        for refused in ["1.5", "-1", "-1.0", "1e30", "\"9\""] {
            let answer = timeout(&format!(r#","timeout_s":{refused}"#));
            assert!(answer.is_err(), "{refused}: {answer:?}");
        }
    }
}
