//! Measures the MCP bridge (run it through `scripts/bench-mcp-bridge`):
//!
//! 1. the overhead of a tool call through the bridge against a direct stdio
//!    call: one agent in standby serves the tests' fake MCP server
//!    ([`FAKE_MCP_SERVER`], run with `python3`) at its bridge
//!    URL; the official SDK's client (rmcp) calls the server's `env` tool
//!    `--calls` times through that URL (streamable HTTP, one session) and
//!    as many times over the stdio of a second copy of the same server it
//!    spawned itself, alternating one call of each so that both see the
//!    same machine; prints the median and percentiles of both;
//! 2. the time of a stdio server's restart at assignment: `--restarts`
//!    agents are each assigned a run, and the `mcp` step of their `run
//!    started` log line (stop, start, `initialize` handshake) is collected.
//!
//! `STANDBY_BIN` names the agent (required).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use serde_json::{Value, json};
use standby_e2e::harness::{FAKE_MCP_SERVER, write_json};
use standby_e2e::server::ExecutionSetup;
use standby_e2e::{AgentBuilder, TestServer};
use standby_protocol::AgentState;

type Client = RunningService<RoleClient, ()>;

const WARM_UP: usize = 100;
const WAIT: Duration = Duration::from_secs(120);

fn option(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|arg| arg == name)
        .and_then(|at| args.get(at + 1))
        .map_or(default, |value| value.parse().unwrap_or_else(|_| panic!("{name} takes a number, not {value:?}")))
}

async fn call(client: &Client) -> Duration {
    let arguments = json!({"name": "WHO"}).as_object().cloned().expect("an object");
    let start = Instant::now();
    let result = client.call_tool(CallToolRequestParams::new("env").with_arguments(arguments)).await;
    let took = start.elapsed();
    result.expect("the call succeeds");
    took
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[rank]
}

fn micros(duration: Duration) -> String {
    format!("{:>8.1} µs", duration.as_secs_f64() * 1e6)
}

fn spec_file(dir: &Path) -> PathBuf {
    let path = dir.join("spec.json");
    let spec = json!({"workspace": {}, "mcp_servers": [{
        "name": "probe", "command": ["python3", FAKE_MCP_SERVER], "env": {"WHO": "standby"}, "transport": "stdio",
    }]});
    write_json(&path, &spec);
    path
}

/// The `mcp=<n>ms` step of the agent's JSON `run started` line.
fn mcp_step(output: &str) -> Option<Duration> {
    output.lines().filter_map(|line| serde_json::from_str::<Value>(line).ok()).find_map(|line| {
        if line["message"] != "run started" {
            return None;
        }
        let steps = line["steps"].as_str()?;
        let millis = steps.split(' ').find_map(|step| step.strip_prefix("mcp="))?.strip_suffix("ms")?;
        millis.parse().ok().map(Duration::from_millis)
    })
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let calls = option(&args, "--calls", 1000);
    let restarts = option(&args, "--restarts", 5);
    assert!(std::env::var_os("STANDBY_BIN").is_some(), "set STANDBY_BIN to the agent (scripts/bench-mcp-bridge does)");
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut out = std::io::stdout().lock();
    let server = TestServer::start().await;
    let dir = tempfile::tempdir().expect("a scratch directory");
    let spec = spec_file(dir.path());

    // 1. Tool calls, bridged and direct, side by side.
    let token = server.add_standby();
    let mut agent =
        AgentBuilder::new(&server.url(), &token).spec_file(&spec).log_filter("info").log_format("json").spawn();
    agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Ready)).await;
    let config: Value = serde_json::from_slice(
        &std::fs::read(agent.workspace().join(".standby/mcp.json")).expect("mcp.json is written in standby"),
    )
    .expect("mcp.json is JSON");
    let url = config["mcpServers"]["probe"]["url"].as_str().expect("the probe is listed").to_owned();
    let bridged = ().serve(StreamableHttpClientTransport::from_uri(url.as_str())).await.expect("bridged client");
    let mut command = tokio::process::Command::new("python3");
    command.arg(FAKE_MCP_SERVER);
    command.env("WHO", "direct");
    // What the server writes to stderr (the capabilities it was given) is
    // not the benchmark's output.
    command.stderr(std::process::Stdio::null());
    let direct = ().serve(TokioChildProcess::new(command).expect("spawn the server")).await.expect("direct client");
    for _ in 0..WARM_UP {
        call(&bridged).await;
        call(&direct).await;
    }
    let (mut through_bridge, mut over_stdio) = (Vec::with_capacity(calls), Vec::with_capacity(calls));
    for i in 0..calls {
        if i % 2 == 0 {
            through_bridge.push(call(&bridged).await);
            over_stdio.push(call(&direct).await);
        } else {
            over_stdio.push(call(&direct).await);
            through_bridge.push(call(&bridged).await);
        }
    }
    through_bridge.sort();
    over_stdio.sort();
    let _ = bridged.cancel().await;
    let _ = direct.cancel().await;
    agent.signal(nix::sys::signal::Signal::SIGTERM);
    agent.wait_exit(WAIT).await;

    writeln!(out, "tool call `env`, {calls} calls each, alternating (after {WARM_UP} warm-up calls each):").ok();
    writeln!(out, "{:<22}{:>11}{:>11}{:>11}", "", "p50", "p90", "p99").ok();
    for (name, sorted) in [("through the bridge", &through_bridge), ("direct stdio", &over_stdio)] {
        writeln!(
            out,
            "{name:<22}{}{}{}",
            micros(percentile(sorted, 0.5)),
            micros(percentile(sorted, 0.9)),
            micros(percentile(sorted, 0.99))
        )
        .ok();
    }
    let overhead = percentile(&through_bridge, 0.5).saturating_sub(percentile(&over_stdio, 0.5));
    writeln!(out, "{:<22}{}", "overhead (p50)", micros(overhead)).ok();

    // 2. The restart at assignment.
    let mut steps = Vec::with_capacity(restarts);
    for _ in 0..restarts {
        let token = server.add_standby();
        let mut agent =
            AgentBuilder::new(&server.url(), &token).spec_file(&spec).log_filter("info").log_format("json").spawn();
        agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Ready)).await;
        server.assign(&token, ExecutionSetup::new(&["true"]).mcp_env("WHO", "run"));
        let code = agent.wait_exit(WAIT).await;
        assert_eq!(code, 0, "{}", agent.output_tail());
        steps.push(mcp_step(&agent.output()).unwrap_or_else(|| panic!("no mcp step\n{}", agent.output_tail())));
    }
    steps.sort();
    let list: Vec<String> = steps.iter().map(|step| format!("{}ms", step.as_millis())).collect();
    writeln!(
        out,
        "stdio server restart at assignment (install step `mcp`), {restarts} agents: median {}ms [{}]",
        percentile(&steps, 0.5).as_millis(),
        list.join(", ")
    )
    .ok();
}
