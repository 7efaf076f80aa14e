//! What a client may offer a server (sampling, roots, elicitation) through
//! the real `standby` binary's MCP bridge, with the official SDKs at both
//! ends: an MCP server written with the Python SDK (`tests/mcp_py/server.py`,
//! which checks its client's capabilities as the specification asks),
//! started by the agent in standby; the Python SDK's client as the run's
//! harness (`tests/mcp_py/client.py`); rmcp, the Rust SDK, as a second
//! client that serves all three, as a client that declares none, and as one
//! that never answers.
//!
//! Needs the binaries (`cargo build --bins` first, or set `STANDBY_BIN`) and
//! the Python SDK (`export STANDBY_TEST_MCP_PYTHON="$(scripts/mcp-py)"`):
//! without it the tests skip, loudly, and fail under `CI=true`.

// Sampling and roots are deprecated by the 2026-07-28 protocol (SEP-2577),
// which the bridge does not speak; they are what this file tests.
#![allow(deprecated)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, ClientConfig, CreateMessageRequestParams, CreateMessageResult, ElicitRequestParams,
    ElicitResult, ErrorCode, ListRootsResult,
};
use rmcp::service::{RequestContext, RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{ClientHandler, ErrorData, ServiceExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use standby_e2e::harness::{MCP_PY_DIR, assert_exit, event_kinds, mcp_python, ready_agent};
use standby_e2e::server::ExecutionSetup;
use standby_e2e::{AgentProcess, TestServer};
use standby_protocol::layout::StateDir;
use standby_protocol::{EventKind, ExitCode};
use tempfile::TempDir;
use tokio::sync::watch;

/// Bound on every wait; generous because the machine is shared with
/// compilers and each Python SDK process takes a second to start.
const WAIT: Duration = Duration::from_secs(120);

/// The tools the SDK server lists to a client that declared all three.
const ALL_TOOLS: [&str; 6] = ["ask_unknown", "echo", "elicit", "flood", "roots", "sample"];

fn scratch() -> TempDir {
    TempDir::with_prefix("standby-e2e-mcp-sdk-").expect("create a scratch directory")
}

/// The SDK server as a spec entry, with `extra` fields.
fn sdk_server(python: &Path, name: &str, extra: &Value) -> Value {
    let mut server =
        json!({"name": name, "command": [python, format!("{MCP_PY_DIR}/server.py")], "transport": "stdio"});
    if let (Some(server), Some(extra)) = (server.as_object_mut(), extra.as_object()) {
        server.extend(extra.clone());
    }
    server
}

fn listed_url(agent: &AgentProcess, name: &str) -> String {
    let path = StateDir::of(agent.workspace()).mcp_config();
    let config: Value = serde_json::from_slice(&std::fs::read(&path).expect("mcp.json is written")).expect("JSON");
    config["mcpServers"][name]["url"].as_str().unwrap_or_else(|| panic!("{name} is not listed: {config}")).to_owned()
}

fn typed<T: DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value).expect("an rmcp type")
}

/// What an rmcp client does with a server's requests.
#[derive(Clone, Copy, PartialEq)]
enum Answers {
    /// Declares all three and answers with canned answers naming itself.
    Canned,
    /// Declares none (rmcp then refuses them itself).
    Nothing,
    /// Declares sampling and never answers: waits until the request is
    /// cancelled.
    Never,
}

/// An rmcp client's handler: records the prompts it is asked to sample,
/// and how many of them were cancelled before an answer.
#[derive(Clone)]
struct Harness {
    name: &'static str,
    answers: Answers,
    prompts: Arc<Mutex<Vec<String>>>,
    cancelled: Arc<watch::Sender<usize>>,
}

impl Harness {
    fn new(name: &'static str, answers: Answers) -> Self {
        Self { name, answers, prompts: Arc::default(), cancelled: Arc::new(watch::Sender::new(0)) }
    }

    fn prompts(&self) -> Vec<String> {
        self.prompts.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Waits until `count` requests were cancelled; how many were, at most
    /// [`WAIT`] later.
    async fn wait_cancelled(&self, count: usize) -> usize {
        let mut cancelled = self.cancelled.subscribe();
        let _ = tokio::time::timeout(WAIT, cancelled.wait_for(|cancelled| *cancelled >= count)).await;
        *cancelled.borrow()
    }
}

impl ClientHandler for Harness {
    fn get_info(&self) -> ClientConfig {
        let capabilities = match self.answers {
            Answers::Canned => json!({"sampling": {}, "roots": {"listChanged": true}, "elicitation": {}}),
            Answers::Nothing => json!({}),
            Answers::Never => json!({"sampling": {}}),
        };
        typed(json!({"protocolVersion": "2025-11-25", "capabilities": capabilities,
                     "clientInfo": {"name": self.name, "version": "1"}}))
    }

    async fn create_message(
        &self,
        params: CreateMessageRequestParams,
        context: RequestContext<RoleClient>,
    ) -> Result<CreateMessageResult, ErrorData> {
        let params = serde_json::to_value(params).expect("params serialize");
        let prompt = params["messages"][0]["content"]["text"].as_str().unwrap_or_default().to_owned();
        self.prompts.lock().unwrap_or_else(PoisonError::into_inner).push(prompt.clone());
        match self.answers {
            Answers::Canned => Ok(typed(json!({"model": "canned", "role": "assistant",
                "content": {"type": "text", "text": format!("{} completes: {prompt}", self.name)}}))),
            Answers::Never => {
                context.ct.cancelled().await;
                self.cancelled.send_modify(|cancelled| *cancelled += 1);
                Err(ErrorData::new(ErrorCode::INTERNAL_ERROR, "cancelled", None))
            }
            Answers::Nothing => Err(ErrorData::new(ErrorCode::METHOD_NOT_FOUND, "not declared", None)),
        }
    }

    async fn list_roots(&self, _context: RequestContext<RoleClient>) -> Result<ListRootsResult, ErrorData> {
        Ok(typed(json!({"roots": [{"uri": format!("file:///harness/{}", self.name), "name": self.name}]})))
    }

    async fn create_elicitation(
        &self,
        _request: ElicitRequestParams,
        _context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
        Ok(typed(json!({"action": "accept", "content": {"answer": format!("{} says yes", self.name)}})))
    }
}

type Client = RunningService<RoleClient, Harness>;

async fn rmcp_client(url: &str, harness: Harness) -> Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    harness.serve(StreamableHttpClientTransport::from_uri(url)).await.expect("rmcp initializes through the bridge")
}

async fn tools(client: &Client) -> Vec<String> {
    let mut names: Vec<String> = client
        .list_all_tools()
        .await
        .expect("tools/list through the bridge")
        .into_iter()
        .map(|tool| tool.name.into_owned())
        .collect();
    names.sort();
    names
}

/// The text a tool answered (the SDK server answers its own failures as text).
async fn call(client: &Client, tool: &'static str, arguments: Value) -> String {
    let arguments = arguments.as_object().cloned().expect("arguments are an object");
    let result = client
        .call_tool(CallToolRequestParams::new(tool).with_arguments(arguments))
        .await
        .unwrap_or_else(|error| panic!("{tool} through the bridge: {error}"));
    let text = result.content.first().and_then(|content| content.as_text()).expect("a text answer");
    text.text.clone()
}

/// Polls for a file (no event exists for it).
async fn wait_for_file(path: &Path) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !path.exists() {
        assert!(tokio::time::Instant::now() < deadline, "{} never appeared", path.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The Python SDK's client as the run: `steps` against `server`, declaring
/// `capabilities`, its results written to `out`.
fn python_run(
    python: &Path,
    out: &Path,
    server: &str,
    name: &str,
    capabilities: &str,
    steps: &Value,
) -> ExecutionSetup {
    let (python, client) = (python.display().to_string(), format!("{MCP_PY_DIR}/client.py"));
    let (out, steps) = (out.display().to_string(), steps.to_string());
    ExecutionSetup::new(&[&python, &client, &out, server, name, capabilities, &steps])
}

fn python() -> Option<PathBuf> {
    mcp_python(std::thread::current().name().unwrap_or("mcp_bridge_sdk"))
}

#[tokio::test]
async fn sampling_roots_and_elicitation_reach_the_client_that_declared_them() {
    let Some(python) = python() else { return };
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let spec = json!({"workspace": {}, "mcp_servers": [
        sdk_server(&python, "caps", &json!({})),
        sdk_server(&python, "none", &json!({"client_capabilities": [], "workspace_root": false})),
    ]});
    let mut agent = ready_agent(&server, &token, dir.path(), &spec, |agent| agent).await;
    let url = listed_url(&agent, "caps");

    // The bridge declares all three by default: a server that checks lists
    // every tool, even to a client that declared none; told of none, it
    // hides them.
    let bare = Harness::new("bare", Answers::Nothing);
    let bare_client = agent.watch(rmcp_client(&url, bare.clone())).await;
    assert_eq!(agent.watch(tools(&bare_client)).await, ALL_TOOLS);
    let none_client = agent.watch(rmcp_client(&listed_url(&agent, "none"), bare.clone())).await;
    assert_eq!(agent.watch(tools(&none_client)).await, ["ask_unknown", "echo"]);

    // A client that declared none: the server gets the specification's
    // error; its roots/list gets the workspace root, unless turned off.
    let refusals = [
        (
            "sample",
            json!({"prompt": "bare's prompt"}),
            "error -32601: no client of the standby MCP bridge declared sampling",
        ),
        ("elicit", json!({"question": "q"}), "error -32601: no client of the standby MCP bridge declared elicitation"),
        ("ask_unknown", json!({}), "error -32601: no client of the standby MCP bridge serves standby/unknown"),
    ];
    for (tool, arguments, expected) in refusals {
        assert_eq!(agent.watch(call(&bare_client, tool, arguments)).await, expected, "{tool}");
    }
    let workspace = std::path::absolute(agent.workspace()).expect("an absolute workspace");
    let root = format!("roots: file://{}", workspace.display());
    assert_eq!(agent.watch(call(&bare_client, "roots", json!({}))).await, root);
    assert_eq!(
        agent.watch(call(&none_client, "roots", json!({}))).await,
        "error -32601: no client of the standby MCP bridge declared roots"
    );

    // rmcp serving all three, as a second client of the same server.
    let rmcp = Harness::new("rmcp", Answers::Canned);
    let rmcp_client = agent.watch(rmcp_client(&url, rmcp.clone())).await;
    let answers = [
        ("sample", json!({"prompt": "rmcp's prompt"}), "sampled: rmcp completes: rmcp's prompt"),
        ("roots", json!({}), "roots: file:///harness/rmcp"),
        ("elicit", json!({"question": "q"}), r#"elicited: accept {"answer": "rmcp says yes"}"#),
    ];
    for (tool, arguments, expected) in answers {
        assert_eq!(agent.watch(call(&rmcp_client, tool, arguments)).await, expected, "{tool}");
    }

    // The run's harness, the Python SDK's client, serving all three: its
    // sampling is asked for while another client (which declared nothing)
    // is the most recently active one, and an idle one (rmcp) declared it.
    let (out, gate) = (dir.path().join("run.json"), dir.path().join("gate"));
    let steps = json!([
        ["tools"],
        ["call", "sample", {"prompt": "the run's prompt", "gate": gate.display().to_string()}],
        ["call", "roots", {}],
        ["call", "elicit", {"question": "q"}],
        ["roots_changed"],
        ["call", "echo", {"text": "done"}],
    ]);
    let run = python_run(&python, &out, "caps", "python", "sampling,roots,elicitation", &steps);
    let execution_id = server.assign(&token, run);
    let mut waiting = gate.clone().into_os_string();
    waiting.push(".waiting");
    agent.watch(wait_for_file(Path::new(&waiting))).await;
    assert_eq!(agent.watch(call(&bare_client, "echo", json!({"text": "meanwhile"}))).await, "meanwhile");
    std::fs::write(&gate, "").expect("open the gate");
    let code = agent.wait_exit(WAIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);

    let written: Value =
        serde_json::from_slice(&std::fs::read(&out).expect("the run wrote its results")).expect("JSON");
    assert_eq!(
        written["results"],
        json!([
            ALL_TOOLS,
            "sampled: python completes: the run's prompt",
            "roots: file:///harness/python",
            r#"elicited: accept {"answer": "python says yes"}"#,
            "sent",
            "done",
        ])
    );
    assert_eq!(written["prompts"], json!(["the run's prompt"]), "the run's harness got its own prompt");
    assert_eq!(rmcp.prompts(), ["rmcp's prompt"], "rmcp got its own prompt only");
    assert_eq!(bare.prompts(), Vec::<String>::new(), "the client that declared nothing was asked nothing");
    let log = std::fs::read_to_string(StateDir::of(agent.workspace()).mcp_log("caps")).expect("the server's log");
    assert!(log.contains("roots changed"), "the client's roots/list_changed reached the server: {log}");
    for client in [bare_client, none_client] {
        let _ = client.cancel().await;
    }
    let _ = rmcp_client.cancel().await;
    agent.wait_no_leftovers(WAIT).await;
    server.assert_no_violations();
}

#[tokio::test]
async fn a_client_that_never_answers_and_a_flood_of_requests_are_bounded() {
    let Some(python) = python() else { return };
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let spec = json!({"workspace": {}, "mcp_servers": [sdk_server(&python, "caps", &json!({}))]});
    let mut agent = ready_agent(&server, &token, dir.path(), &spec, |agent| agent).await;
    let url = listed_url(&agent, "caps");
    let silent = Harness::new("silent", Answers::Never);
    let client = agent.watch(rmcp_client(&url, silent.clone())).await;

    // Each request is given up by the server after 1 s (the SDK then
    // cancels it); the bridge holds none of them beyond: a second flood
    // finds room again.
    for round in 1..=2 {
        let outcome = agent.watch(call(&client, "flood", json!({"count": 300, "timeout": 1}))).await;
        eprintln!("flood round {round}, the server's outcomes: {outcome}");
        let counts: serde_json::Map<String, Value> = serde_json::from_str(&outcome).expect("counts");
        let count = |key: &str| counts.get(key).and_then(Value::as_u64).unwrap_or(0);
        let (timed_out, refused) = (count("error -32001"), count("error -32000"));
        assert_eq!(timed_out + refused, 300, "round {round}: every request answered: {outcome}");
        assert!(refused >= 300 - 256, "round {round}: at most 256 wait at clients: {outcome}");
        assert!(timed_out >= 1, "round {round}: the bridge had room: {outcome}");
    }
    let handed = silent.prompts().len();
    assert!(handed <= 2 * 256, "the client was handed no more than the bound");
    // Every request the server gave up reaches the client as a
    // cancellation. Waiting for them is also what lets the client close:
    // rmcp's transport, closed while messages still stream in, waits on
    // its full queue to the handler forever.
    let cancelled = silent.wait_cancelled(handed).await;
    assert_eq!(cancelled, handed, "the requests handed to the client that were cancelled");
    assert_eq!(agent.watch(call(&client, "echo", json!({"text": "still here"}))).await, "still here");
    let _ = client.cancel().await;
    agent.signal(nix::sys::signal::Signal::SIGTERM);
    agent.wait_exit(WAIT).await;
    agent.wait_no_leftovers(WAIT).await;
}
