//! The MCP bridge through the real `standby` binary: the tests' fake stdio
//! MCP server ([`FAKE_MCP_SERVER`]) started in standby, served at the
//! URL `mcp.json` lists, restarted with the run's `mcp_env` at assignment,
//! and called by the run through that URL; an HTTP server listed by its
//! `url`; a server that never answers `initialize`; a server that crashes
//! while the run uses it.
//!
//! Needs the binaries: `cargo build --bins` first (or set `STANDBY_BIN`).

use std::path::Path;
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use serde_json::{Value, json};
use standby_e2e::harness::{FAKE_MCP_SERVER, assert_exit, event_kinds, ready_agent, write_json};
use standby_e2e::server::ExecutionSetup;
use standby_e2e::{AgentBuilder, AgentProcess, TestServer};
use standby_protocol::layout::StateDir;
use standby_protocol::{EventKind, ExitCode};
use tempfile::TempDir;

/// Bound on every wait for the agent; generous because the machine is
/// shared with compilers.
const EXIT: Duration = Duration::from_secs(60);

/// The run: reads `$STANDBY_MCP_CONFIG`, and for each `[server, tool,
/// arguments]` of `argv[3]` (JSON) posts `initialize` (once per server),
/// `notifications/initialized` and `tools/call` to the server's URL, with
/// nothing but the standard library, as a minimal harness would. Writes the
/// configuration and the answers to `argv[1]`, then waits for the file
/// `argv[2]` to exist (`-` for no wait).
const RUN_CLIENT: &str = r#"
import json, os, sys, time, urllib.request
out, gate, calls = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config = json.load(open(os.environ["STANDBY_MCP_CONFIG"]))
def post(url, body, session=None):
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if session:
        headers["Mcp-Session-Id"] = session
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
        return response.headers.get("Mcp-Session-Id"), (json.loads(text) if text else None)
sessions, answers = {}, []
for number, (server, tool, arguments) in enumerate(calls, start=1):
    url = config["mcpServers"][server]["url"]
    if server not in sessions:
        session, _ = post(url, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "run", "version": "1"}}})
        post(url, {"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
        sessions[server] = session
    _, answer = post(url, {"jsonrpc": "2.0", "id": number, "method": "tools/call",
                           "params": {"name": tool, "arguments": arguments}}, sessions[server])
    answers.append(answer)
with open(out + ".tmp", "w") as f:
    json.dump({"config": config, "answers": answers}, f)
os.rename(out + ".tmp", out)
while gate != "-" and not os.path.exists(gate):
    time.sleep(0.02)
"#;

/// An MCP server over HTTP answering `initialize` (and every request) with
/// JSON, on port `argv[1]`.
const HTTP_SERVER: &str = r#"
import http.server, json, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = json.dumps({"jsonrpc": "2.0", "id": request.get("id"), "result": {"protocolVersion": "2025-06-18",
                             "capabilities": {}, "serverInfo": {"name": "web", "version": "1"}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"#;

fn scratch() -> TempDir {
    TempDir::with_prefix("standby-e2e-mcp-").expect("create a scratch directory")
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("a bound listener has an address").port()
}

/// The fake stdio server as a spec entry.
fn stdio_server(name: &str, env: &Value) -> Value {
    json!({"name": name, "command": ["python3", FAKE_MCP_SERVER], "env": env, "transport": "stdio"})
}

/// A run of [`RUN_CLIENT`] making `calls`, writing to `out`, held by `gate`.
fn run_client(dir: &Path, out: &Path, gate: Option<&Path>, calls: &Value) -> ExecutionSetup {
    let script = dir.join("run-client.py");
    std::fs::write(&script, RUN_CLIENT).expect("write the run's client");
    let gate = gate.map_or_else(|| "-".to_owned(), |gate| gate.display().to_string());
    let (script, out, calls) = (script.display().to_string(), out.display().to_string(), calls.to_string());
    ExecutionSetup::new(&["python3", &script, &out, &gate, &calls])
}

fn mcp_config(agent: &AgentProcess) -> Value {
    let path = StateDir::of(agent.workspace()).mcp_config();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
    serde_json::from_str(&text).expect("mcp.json is JSON")
}

fn listed_url(config: &Value, name: &str) -> String {
    config["mcpServers"][name]["url"].as_str().unwrap_or_else(|| panic!("{name} is not listed: {config}")).to_owned()
}

/// Polls for a file the run writes (no event exists for it).
async fn read_when_written(path: &Path) -> Value {
    let deadline = tokio::time::Instant::now() + EXIT;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return serde_json::from_str(&text).expect("the run wrote JSON");
        }
        assert!(tokio::time::Instant::now() < deadline, "{} was never written", path.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The text a `tools/call` answer carries, or its error message.
fn answer_text(answer: &Value) -> Result<String, String> {
    match answer["result"]["content"][0]["text"].as_str() {
        Some(text) => Ok(text.to_owned()),
        None => Err(answer["error"]["message"].as_str().unwrap_or("(no message)").to_owned()),
    }
}

/// An rmcp client (the official SDK) of the bridge.
async fn sdk_client(url: &str) -> RunningService<RoleClient, ()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    ().serve(StreamableHttpClientTransport::from_uri(url)).await.expect("the SDK client initializes through the bridge")
}

async fn sdk_env(client: &RunningService<RoleClient, ()>, name: &str) -> String {
    let arguments = json!({"name": name}).as_object().cloned().expect("an object");
    let result = client
        .call_tool(CallToolRequestParams::new("env").with_arguments(arguments))
        .await
        .expect("the tool answers through the bridge");
    let text = result.content.first().and_then(|content| content.as_text()).expect("a text answer");
    text.text.clone()
}

#[tokio::test]
async fn a_stdio_server_keeps_its_url_and_session_and_gets_mcp_env_at_assignment() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let web_port = free_port();
    let web_script = dir.path().join("web.py");
    std::fs::write(&web_script, HTTP_SERVER).expect("write the HTTP server");
    let web_url = format!("http://127.0.0.1:{web_port}/mcp");
    let spec = json!({"workspace": {}, "mcp_servers": [
        stdio_server("probe", &json!({"WHO": "standby", "SPEC_VAR": "spec-value"})),
        {"name": "web", "command": ["python3", web_script.display().to_string(), web_port.to_string()],
         "transport": "http", "url": web_url},
    ]});
    let mut agent = ready_agent(&server, &token, dir.path(), &spec, |agent| agent).await;

    // In standby: mcp.json lists both servers, and the stdio one answers at
    // its URL, to the official SDK's client.
    let before = mcp_config(&agent);
    let url = listed_url(&before, "probe");
    assert!(url.starts_with("http://127.0.0.1:") && url.ends_with("/mcp/probe"), "{url}");
    assert_eq!(before["mcpServers"]["web"], json!({"type": "http", "url": web_url}), "listed by its url");
    assert_eq!(before["mcpServers"]["probe"]["type"], "http");
    let client = agent.watch(sdk_client(&url)).await;
    assert_eq!(agent.watch(sdk_env(&client, "WHO")).await, "standby");

    let (out, gate) = (dir.path().join("answers.json"), dir.path().join("gate"));
    let calls = json!([
        ["probe", "env", {"name": "WHO"}],
        ["probe", "env", {"name": "SPEC_VAR"}],
        ["probe", "env", {"name": "API_KEY"}],
        ["probe", "env", {"name": "RUN_VAR"}],
        ["probe", "env", {"name": "STANDBY_TOKEN"}],
    ]);
    let execution = run_client(dir.path(), &out, Some(&gate), &calls)
        .mcp_env("WHO", "run")
        .secret("API_KEY", "mcp-bridge-secret-81")
        .env("RUN_VAR", "mcp-bridge-run-env-82");
    let execution_id = server.assign(&token, execution);
    let run = agent.watch(read_when_written(&out)).await;

    assert_eq!(run["config"], before, "the run gets the same mcp.json, URLs included");
    let answers: Vec<Result<String, String>> =
        run["answers"].as_array().expect("answers").iter().map(answer_text).collect();
    let expected: Vec<Result<String, String>> =
        ["run", "spec-value", "", "", ""].iter().map(|value| Ok((*value).to_owned())).collect();
    assert_eq!(answers, expected, "the restarted server has mcp_env over its spec env, and no secret or run env");
    // The session opened in standby survives the restart.
    assert_eq!(agent.watch(sdk_env(&client, "WHO")).await, "run");
    std::fs::write(&gate, "").expect("open the gate");

    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
    let output = agent.output();
    // The agent's log may be coloured: only the words are looked for.
    let started = output.lines().find(|line| line.contains("run started") && line.contains("critical_path_ms"));
    let started = started.unwrap_or_else(|| panic!("no timing line\n{}", agent.output_tail()));
    assert!(started.contains(" mcp="), "the MCP restart is timed: {started}");
    agent.assert_output_lacks(&["mcp-bridge-secret-81"]);
    let _ = client.cancel().await;
    agent.wait_no_leftovers(EXIT).await;
    server.assert_no_violations();
}

#[tokio::test]
async fn a_stdio_server_that_never_answers_initialize_fails_preparation_naming_it() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let spec = json!({"workspace": {}, "mcp_servers": [
        stdio_server("fine", &json!({})),
        stdio_server("mute", &json!({"MODE": "silent"})),
    ]});
    let path = dir.path().join("spec.json");
    write_json(&path, &spec);
    let mut agent =
        AgentBuilder::new(&server.url(), &token).spec_file(&path).env("STANDBY_MCP_READY_TIMEOUT", "2s").spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::PrepareFailed, "an MCP server was not ready in time");
    let output = agent.output();
    // The error is logged as a quoted string: its own quotes are escaped.
    let error = r#"MCP server \"mute\" never became ready: it answered no MCP initialize on stdio within 2s"#;
    assert!(output.contains(error), "{}", agent.output_tail());
    assert!(output.contains("not answering on purpose"), "the server's stderr is quoted\n{}", agent.output_tail());
    agent.wait_no_leftovers(EXIT).await;
}

#[tokio::test]
async fn a_server_that_crashes_mid_run_does_not_take_the_agent_down() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let spec = json!({"workspace": {}, "mcp_servers": [
        stdio_server("crashy", &json!({"WHO": "crashy"})),
        stdio_server("steady", &json!({"WHO": "steady"})),
    ]});
    let mut agent = ready_agent(&server, &token, dir.path(), &spec, |agent| agent).await;
    let out = dir.path().join("answers.json");
    let calls = json!([
        ["crashy", "env", {"name": "WHO"}],
        ["crashy", "crash", {}],
        ["steady", "env", {"name": "WHO"}],
        ["crashy", "env", {"name": "WHO"}],
    ]);
    let execution_id = server.assign(&token, run_client(dir.path(), &out, None, &calls));
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(
        server.events(&execution_id).last().map(|event| event.kind.clone()),
        Some(EventKind::Exited { code: 0 })
    );

    let run = read_when_written(&out).await;
    let answers: Vec<Result<String, String>> =
        run["answers"].as_array().expect("answers").iter().map(answer_text).collect();
    assert_eq!(answers[0], Ok("crashy".to_owned()));
    let crashed = answers[1].as_ref().expect_err("the server died in the call");
    assert!(crashed.contains("stopped before it answered"), "{crashed}");
    assert_eq!(answers[2], Ok("steady".to_owned()), "the other server carries on");
    let gone = answers[3].as_ref().expect_err("the crashed server is not back");
    assert!(gone.contains("exited"), "{gone}");
    agent.wait_no_leftovers(EXIT).await;
    server.assert_no_violations();
}
