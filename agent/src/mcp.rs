//! The spec's MCP servers: started during preparation so a run finds them
//! up, restarted at assignment with the run's `mcp_env`, stopped at the end.
//!
//! A server's environment is the agent's (minus its credentials), then the
//! spec's `env`, then after a restart the run's `mcp_env`, and nothing
//! else: a server is a program the run talks to, not the run, so it never
//! sees the run's secrets, credentials or `env`. Each runs in the workspace
//! root in a process group of its own (so stopping it stops what it
//! started), with stdin closed and its output appended to
//! `<workspace>/.standby/mcp-<name>.log`, whose tail explains a server that
//! never came up.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use futures::future::{join_all, try_join_all};
use nix::sys::signal::Signal;
use serde_json::json;
use standby_protocol::{McpServer, McpTransport};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tracing::{debug, info, warn};

use crate::git::describe_status;
use crate::process::{child_env, register, unregister};
use crate::reaper::signal_group;

/// The agent's own directory inside the workspace.
const STATE_DIR: &str = ".standby";
/// The file that lists the HTTP-reachable servers for the run.
const CONFIG_FILE: &str = "mcp.json";
/// How often `ready_tcp` is tried.
const READY_POLL: Duration = Duration::from_millis(50);
/// Bound on one connection attempt to `ready_tcp` (a host that drops
/// packets would otherwise stall the polling).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a server has to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// Lines of a server's log quoted in an error.
const TAIL_LINES: usize = 20;
/// How far back from the end of a log those lines are looked for.
const TAIL_BYTES: u64 = 16 * 1024;
/// Longest server name accepted: it becomes part of a file name.
const MAX_NAME_LEN: usize = 64;

/// Why a server could not be started, made ready, restarted or listed;
/// each names the server (and the log that explains it).
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error(
        "MCP server name {name:?} is not a safe file name \
         (up to 64 letters, digits, '-', '_' or '.', not starting with '.')"
    )]
    BadName { name: String },
    #[error("MCP server {name:?} is listed twice")]
    Duplicate { name: String },
    #[error("MCP server {server:?} has an empty command")]
    EmptyCommand { server: String },
    #[error("MCP server {server:?}: ready_tcp {addr:?} is not a usable address: {source}")]
    ReadyAddress { server: String, addr: String, source: io::Error },
    #[error("MCP server {server:?}: cannot {action} {}: {source}", path.display())]
    Io { server: String, action: &'static str, path: PathBuf, source: io::Error },
    #[error("MCP server {server:?}: cannot start {program:?}: {source}")]
    Spawn { server: String, program: String, source: io::Error },
    #[error(
        "MCP server {server:?} never became ready: {addr} accepted no connection within {}; \
         last lines of {}:\n{tail}",
        humantime::format_duration(*timeout),
        log.display()
    )]
    NeverReady { server: String, addr: String, timeout: Duration, log: PathBuf, tail: String },
    #[error(
        "MCP server {server:?} exited before it was ready ({status}); last lines of {}:\n{tail}",
        log.display()
    )]
    ExitedEarly { server: String, status: String, log: PathBuf, tail: String },
    #[error("MCP server {server:?}: cannot wait for it: {source}")]
    Wait { server: String, source: io::Error },
    #[error("cannot write the MCP configuration {}: {source}", path.display())]
    Config { path: PathBuf, source: io::Error },
}

/// The spec's MCP servers and the processes running them.
pub struct McpSupervisor {
    workspace: PathBuf,
    ready_timeout: Duration,
    servers: Vec<Supervised>,
}

struct Supervised {
    spec: McpServer,
    /// `None` once stopped, or after a failed restart.
    running: Option<Running>,
}

impl fmt::Debug for McpSupervisor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let servers: BTreeMap<&str, Option<u32>> = self
            .servers
            .iter()
            .map(|server| {
                let pid = server.running.as_ref().map(|running| running.pid);
                (server.spec.name.as_str(), pid)
            })
            .collect();
        f.debug_struct("McpSupervisor")
            .field("workspace", &self.workspace)
            .field("servers", &servers)
            .finish_non_exhaustive()
    }
}

impl McpSupervisor {
    /// Starts every server at once and waits until each is ready: its
    /// `ready_tcp` accepts a connection within `ready_timeout`, or at once
    /// without one. A server that exits first fails at once. On any
    /// failure the servers already started are killed and the first error
    /// is returned.
    pub async fn start(servers: &[McpServer], workspace: &Path, ready_timeout: Duration) -> Result<Self, McpError> {
        check_servers(servers)?;
        if let Some(first) = servers.first() {
            let dir = workspace.join(STATE_DIR);
            std::fs::create_dir_all(&dir).map_err(|source| McpError::Io {
                server: first.name.clone(),
                action: "create the log directory",
                path: dir,
                source,
            })?;
        }
        // On the first error the other launches are dropped, which kills
        // their servers (see `Running`'s `Drop`).
        let running = try_join_all(servers.iter().map(|server| launch(server, workspace, None, ready_timeout))).await?;
        Ok(Self {
            workspace: workspace.to_path_buf(),
            ready_timeout,
            servers: servers
                .iter()
                .cloned()
                .zip(running)
                .map(|(spec, running)| Supervised { spec, running: Some(running) })
                .collect(),
        })
    }

    /// Restarts every server at once with `mcp_env` overlaid on its spec
    /// `env`: stop (SIGTERM to its group, SIGKILL after 2 s), start, wait
    /// until ready. Returns the failures, empty when all restarted; a
    /// server that failed stays stopped.
    pub async fn restart(&mut self, mcp_env: &BTreeMap<String, String>) -> Vec<McpError> {
        let workspace = &self.workspace;
        let ready_timeout = self.ready_timeout;
        let results = join_all(self.servers.iter_mut().map(|server| async move {
            if let Some(running) = server.running.take() {
                running.stop().await;
            }
            match launch(&server.spec, workspace, Some(mcp_env), ready_timeout).await {
                Ok(running) => {
                    server.running = Some(running);
                    None
                }
                Err(error) => {
                    warn!(server = %server.spec.name, %error, "MCP server failed to restart");
                    Some(error)
                }
            }
        }))
        .await;
        results.into_iter().flatten().collect()
    }

    /// Stops every server and reaps it. Idempotent.
    pub async fn stop(&mut self) {
        join_all(self.servers.iter_mut().filter_map(|server| server.running.take()).map(Running::stop)).await;
    }

    /// The pids of the running servers.
    pub fn pids(&self) -> Vec<u32> {
        self.servers.iter().filter_map(|server| server.running.as_ref().map(|running| running.pid)).collect()
    }

    /// Writes `<workspace>/.standby/mcp.json`, listing the servers with
    /// transport `http` and a `url` as `{"mcpServers": {"<name>": {"type":
    /// "http", "url": "…"}}}`, atomically (a reader never sees half a
    /// file). Returns its path, or `None` (and removes a stale file) when no
    /// server qualifies. Stdio servers are not listed until the agent
    /// bridges them to HTTP.
    pub fn write_config(&self, workspace: &Path) -> Result<Option<PathBuf>, McpError> {
        let listed: serde_json::Map<String, serde_json::Value> = self
            .servers
            .iter()
            .filter(|server| server.spec.transport == Some(McpTransport::Http))
            .filter_map(|server| {
                let url = server.spec.url.as_ref()?;
                Some((server.spec.name.clone(), json!({"type": "http", "url": url})))
            })
            .collect();
        let dir = workspace.join(STATE_DIR);
        let path = dir.join(CONFIG_FILE);
        let config_error = |source| McpError::Config { path: path.clone(), source };
        if listed.is_empty() {
            return match std::fs::remove_file(&path) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => Err(config_error(error)),
                _ => Ok(None),
            };
        }
        let mut bytes = serde_json::to_vec_pretty(&json!({ "mcpServers": listed }))
            .map_err(|error| config_error(io::Error::other(error)))?;
        bytes.push(b'\n');
        std::fs::create_dir_all(&dir).map_err(config_error)?;
        let temp = dir.join(format!(".{CONFIG_FILE}.{}.tmp", std::process::id()));
        let written = write_synced(&temp, &bytes).and_then(|()| std::fs::rename(&temp, &path));
        if let Err(error) = written {
            // Best effort: the write already failed.
            let _ = std::fs::remove_file(&temp);
            return Err(config_error(error));
        }
        Ok(Some(path))
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// Refuses names that are unsafe in a file name, duplicates, and empty
/// commands, before anything starts.
fn check_servers(servers: &[McpServer]) -> Result<(), McpError> {
    let mut seen = HashSet::new();
    for server in servers {
        let name = &server.name;
        let safe = !name.is_empty()
            && name.len() <= MAX_NAME_LEN
            && !name.starts_with('.')
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !safe {
            return Err(McpError::BadName { name: name.clone() });
        }
        if !seen.insert(name.as_str()) {
            return Err(McpError::Duplicate { name: name.clone() });
        }
        if server.command.is_empty() {
            return Err(McpError::EmptyCommand { server: name.clone() });
        }
    }
    Ok(())
}

/// Starts one server and waits until it is ready; on failure it is killed
/// and reaped before the error (with its log's tail) is returned.
async fn launch(
    spec: &McpServer,
    workspace: &Path,
    mcp_env: Option<&BTreeMap<String, String>>,
    ready_timeout: Duration,
) -> Result<Running, McpError> {
    let name = &spec.name;
    let Some((program, args)) = spec.command.split_first() else {
        return Err(McpError::EmptyCommand { server: name.clone() });
    };
    let ready_addrs = match &spec.ready_tcp {
        Some(addr) => Some(resolve(name, addr).await?),
        None => None,
    };
    let log_path = workspace.join(STATE_DIR).join(format!("mcp-{name}.log"));
    let log_error = |action| io_error(name, action, &log_path);
    let log = OpenOptions::new().create(true).append(true).open(&log_path).map_err(log_error("open its log"))?;
    let log_start = log.metadata().map_err(log_error("read the size of its log"))?.len();
    let stderr = log.try_clone().map_err(log_error("share its log"))?;

    let mut env = child_env();
    env.extend(spec.env.clone());
    if let Some(mcp_env) = mcp_env {
        env.extend(mcp_env.clone());
    }
    let child = Command::new(program)
        .args(args)
        .env_clear()
        .envs(&env)
        .current_dir(workspace)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(stderr)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| McpError::Spawn { server: name.clone(), program: program.clone(), source })?;
    let Some(pid) = child.id() else {
        return Err(McpError::Wait {
            server: name.clone(),
            source: io::Error::other("it has no pid right after it started"),
        });
    };
    register(pid);
    let mut running = Running { name: name.clone(), pid, child: Some(child) };
    debug!(server = %name, pid, "MCP server started");

    let Some(addrs) = ready_addrs else {
        info!(server = %name, pid, "MCP server started (no readiness check)");
        return Ok(running);
    };
    let addr = spec.ready_tcp.clone().unwrap_or_default();
    let tail = || log_tail(&log_path, log_start);
    match running.wait_ready(&addrs, ready_timeout).await {
        Ready::Yes => {
            info!(server = %name, pid, "MCP server ready");
            Ok(running)
        }
        Ready::TimedOut => {
            running.kill().await;
            Err(McpError::NeverReady {
                server: name.clone(),
                addr,
                timeout: ready_timeout,
                log: log_path.clone(),
                tail: tail(),
            })
        }
        Ready::Exited(status) => {
            running.exited();
            Err(McpError::ExitedEarly {
                server: name.clone(),
                status: describe_status(status),
                log: log_path.clone(),
                tail: tail(),
            })
        }
        Ready::WaitFailed(source) => {
            running.kill().await;
            Err(McpError::Wait { server: name.clone(), source })
        }
    }
}

fn io_error(server: &str, action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> McpError {
    let server = server.to_owned();
    let path = path.to_path_buf();
    move |source| McpError::Io { server, action, path, source }
}

/// Resolves `ready_tcp` once, before the server starts: an address that
/// cannot work should not cost a process and a timeout.
async fn resolve(server: &str, addr: &str) -> Result<Vec<SocketAddr>, McpError> {
    let address_error = |source| McpError::ReadyAddress { server: server.to_owned(), addr: addr.to_owned(), source };
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr).await.map_err(address_error)?.collect();
    if addrs.is_empty() {
        return Err(address_error(io::Error::other("it resolves to no address")));
    }
    Ok(addrs)
}

/// The last [`TAIL_LINES`] lines the server wrote to its log since
/// `start` (where this launch began).
fn log_tail(path: &Path, start: u64) -> String {
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        let end = file.metadata()?.len();
        let from = start.max(end.saturating_sub(TAIL_BYTES));
        file.seek(SeekFrom::Start(from))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let mut lines: Vec<&str> = text.lines().collect();
        if from > start && !lines.is_empty() {
            // The read began mid-line.
            lines.remove(0);
        }
        let skip = lines.len().saturating_sub(TAIL_LINES);
        Ok(lines[skip..].join("\n"))
    };
    match read() {
        Ok(tail) if tail.trim().is_empty() => "(no output)".to_owned(),
        Ok(tail) => tail,
        Err(error) => format!("(the log cannot be read: {error})"),
    }
}

enum Ready {
    Yes,
    TimedOut,
    Exited(ExitStatus),
    WaitFailed(io::Error),
}

/// A started server. Dropped while still running (a cancelled start), its
/// process group is killed; tokio reaps the leader.
struct Running {
    name: String,
    pid: u32,
    /// `None` once the server is reaped.
    child: Option<Child>,
}

impl Running {
    fn pgid(&self) -> i32 {
        i32::try_from(self.pid).unwrap_or(i32::MAX)
    }

    async fn wait_ready(&mut self, addrs: &[SocketAddr], timeout: Duration) -> Ready {
        let Some(child) = self.child.as_mut() else {
            return Ready::WaitFailed(io::Error::other("the server is already reaped"));
        };
        tokio::select! {
            status = child.wait() => match status {
                Ok(status) => Ready::Exited(status),
                Err(error) => Ready::WaitFailed(error),
            },
            accepted = tokio::time::timeout(timeout, accepts(addrs)) => match accepted {
                Ok(()) => Ready::Yes,
                Err(_) => Ready::TimedOut,
            },
        }
    }

    /// SIGTERM to the group, SIGKILL after [`STOP_GRACE`], reap; then
    /// SIGKILL to whatever of the group outlived its leader.
    async fn stop(mut self) {
        if let Some(mut child) = self.child.take() {
            signal_group(self.pgid(), Signal::SIGTERM);
            let status = match tokio::time::timeout(STOP_GRACE, child.wait()).await {
                Ok(status) => status,
                Err(_) => {
                    debug!(server = %self.name, pid = self.pid, "MCP server ignored SIGTERM; killing it");
                    signal_group(self.pgid(), Signal::SIGKILL);
                    child.wait().await
                }
            };
            self.reaped(status);
        }
        signal_group(self.pgid(), Signal::SIGKILL);
    }

    /// SIGKILL to the group and reap: for a server that failed to come up.
    async fn kill(mut self) {
        if let Some(mut child) = self.child.take() {
            signal_group(self.pgid(), Signal::SIGKILL);
            let status = child.wait().await;
            self.reaped(status);
        }
    }

    /// The leader exited by itself (and `wait` reaped it): the rest of its
    /// group goes too.
    fn exited(mut self) {
        if self.child.take().is_some() {
            unregister(self.pid);
        }
        signal_group(self.pgid(), Signal::SIGKILL);
    }

    fn reaped(&self, status: io::Result<ExitStatus>) {
        unregister(self.pid);
        match status {
            Ok(status) => {
                info!(server = %self.name, pid = self.pid, status = %describe_status(status), "MCP server stopped");
            }
            Err(error) => warn!(server = %self.name, pid = self.pid, %error, "cannot reap MCP server"),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.child.take().is_some() {
            signal_group(self.pgid(), Signal::SIGKILL);
            unregister(self.pid);
        }
    }
}

/// Resolves once one of `addrs` accepts a TCP connection.
async fn accepts(addrs: &[SocketAddr]) {
    loop {
        for addr in addrs {
            if let Ok(Ok(_)) = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
                return;
            }
        }
        tokio::time::sleep(READY_POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;
    use crate::reaper::{OWN_PROCESS, processes, run_in_own_process};

    /// A server that dumps its environment to `argv[1]`, starts a sleeping
    /// child in its group, then listens on port `argv[2]` (unless `MODE`
    /// is `broken`, then it fails).
    const SERVER: &str = r#"
import json, os, socket, subprocess, sys
with open(sys.argv[1], "w") as f:
    json.dump(dict(os.environ), f)
if os.environ.get("MODE") == "broken":
    sys.exit("broken on purpose")
subprocess.Popen(["sleep", "300"])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[2])))
s.listen(16)
while True:
    s.accept()[0].close()
"#;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").and_then(|listener| listener.local_addr()).expect("a free port").port()
    }

    fn server(name: &str, command: &[&str]) -> McpServer {
        McpServer {
            name: name.to_owned(),
            command: command.iter().map(|word| (*word).to_owned()).collect(),
            env: BTreeMap::new(),
            ready_tcp: None,
            transport: None,
            url: None,
        }
    }

    /// A [`SERVER`] dumping its environment to `dump`, ready on `port`.
    fn python_server(name: &str, dump: &Path, port: u16) -> McpServer {
        let dump = dump.display().to_string();
        let port_arg = port.to_string();
        let mut spec = server(name, &["python3", "-c", SERVER, &dump, &port_arg]);
        spec.ready_tcp = Some(format!("127.0.0.1:{port}"));
        spec
    }

    fn read_env(path: &Path) -> BTreeMap<String, String> {
        let text = std::fs::read_to_string(path).expect("the server dumped its environment");
        serde_json::from_str(&text).expect("the dump is JSON")
    }

    fn live_in_group(pgid: u32) -> Vec<i32> {
        processes()
            .into_iter()
            .filter(|process| u32::try_from(process.pgrp) == Ok(pgid) && process.state != 'Z')
            .map(|process| process.pid)
            .collect()
    }

    /// Live processes whose command line contains `token`.
    fn live_with_arg(token: &str) -> Vec<i32> {
        processes()
            .into_iter()
            .filter(|process| process.state != 'Z')
            .filter(|process| {
                std::fs::read(format!("/proc/{}/cmdline", process.pid))
                    .is_ok_and(|cmdline| String::from_utf8_lossy(&cmdline).contains(token))
            })
            .map(|process| process.pid)
            .collect()
    }

    /// Polls `condition` every 10 ms, for at most 10 s.
    async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    const TIMEOUT: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn start_waits_until_ready_and_stop_leaves_nothing() {
        let dir = tempfile::tempdir().expect("a workspace");
        let port = free_port();
        let spec = python_server("files", &dir.path().join("env.json"), port);
        let mut supervisor = McpSupervisor::start(&[spec], dir.path(), TIMEOUT).await.expect("starts");
        std::net::TcpStream::connect(("127.0.0.1", port)).expect("ready means listening");
        let pids = supervisor.pids();
        assert_eq!(pids.len(), 1);
        wait_until("the server's child runs", || live_in_group(pids[0]).len() == 2).await;
        assert!(dir.path().join(".standby/mcp-files.log").is_file());

        supervisor.stop().await;
        assert!(supervisor.pids().is_empty());
        wait_until("the server's group is gone", || live_in_group(pids[0]).is_empty()).await;
        supervisor.stop().await;
    }

    #[tokio::test]
    async fn env_is_the_agents_then_the_specs_then_mcp_env() {
        let dir = tempfile::tempdir().expect("a workspace");
        let dump = dir.path().join("env.json");
        let mut spec = python_server("envdump", &dump, free_port());
        spec.env =
            BTreeMap::from([("SPEC_VAR".to_owned(), "spec".to_owned()), ("SHARED".to_owned(), "spec".to_owned())]);
        let mut supervisor = McpSupervisor::start(&[spec], dir.path(), TIMEOUT).await.expect("starts");
        let first_pid = supervisor.pids()[0];
        let env = read_env(&dump);
        assert_eq!(env.get("SPEC_VAR").map(String::as_str), Some("spec"));
        assert_eq!(env.get("SHARED").map(String::as_str), Some("spec"));
        assert_eq!(env.get("HOME"), std::env::var("HOME").ok().as_ref());
        assert!(!env.contains_key("MCP_VAR"));
        assert!(!env.contains_key("STANDBY_TOKEN"));

        let mcp_env =
            BTreeMap::from([("SHARED".to_owned(), "run".to_owned()), ("MCP_VAR".to_owned(), "mcp".to_owned())]);
        let failures = supervisor.restart(&mcp_env).await;
        assert!(failures.is_empty(), "{failures:?}");
        let second_pid = supervisor.pids()[0];
        assert_ne!(first_pid, second_pid, "a restart is a new process");
        wait_until("the old server is gone", || live_in_group(first_pid).is_empty()).await;
        let env = read_env(&dump);
        assert_eq!(env.get("SPEC_VAR").map(String::as_str), Some("spec"));
        assert_eq!(env.get("SHARED").map(String::as_str), Some("run"));
        assert_eq!(env.get("MCP_VAR").map(String::as_str), Some("mcp"));
        assert!(!env.contains_key("STANDBY_TOKEN"));
        supervisor.stop().await;
    }

    #[test]
    fn servers_never_see_the_standby_token() {
        run_in_own_process(
            "mcp::tests::servers_never_see_the_standby_token_in_own_process",
            &[("STANDBY_TOKEN", "standby-credential")],
        );
    }

    #[tokio::test]
    #[ignore = "run by `servers_never_see_the_standby_token` in a process of its own"]
    async fn servers_never_see_the_standby_token_in_own_process() {
        if std::env::var_os(OWN_PROCESS).is_none() {
            return;
        }
        assert!(std::env::var_os("STANDBY_TOKEN").is_some(), "the agent has it");
        let dir = tempfile::tempdir().expect("a workspace");
        let dump = dir.path().join("env.json");
        let spec = python_server("envdump", &dump, free_port());
        let mut supervisor = McpSupervisor::start(&[spec], dir.path(), TIMEOUT).await.expect("starts");
        assert!(!read_env(&dump).contains_key("STANDBY_TOKEN"));
        let failures = supervisor.restart(&BTreeMap::new()).await;
        assert!(failures.is_empty(), "{failures:?}");
        assert!(!read_env(&dump).contains_key("STANDBY_TOKEN"));
        supervisor.stop().await;
    }

    #[tokio::test]
    async fn a_server_that_never_becomes_ready_fails_with_its_log_tail() {
        let dir = tempfile::tempdir().expect("a workspace");
        let token = format!("never-ready-{}", rand::random::<u64>());
        let script = "import sys, time\n\
                      for i in range(30): print(f'line {i}', file=sys.stderr)\n\
                      print('cannot bind: address in use', file=sys.stderr, flush=True)\n\
                      time.sleep(300)";
        let mut spec = server("stuck", &["python3", "-c", script, &token]);
        let port = free_port();
        spec.ready_tcp = Some(format!("127.0.0.1:{port}"));
        let error = McpSupervisor::start(&[spec], dir.path(), Duration::from_secs(2)).await.expect_err("never ready");
        assert!(matches!(error, McpError::NeverReady { .. }), "{error:?}");
        let message = error.to_string();
        assert!(message.starts_with("MCP server \"stuck\" never became ready"), "{message}");
        assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
        assert!(message.contains("within 2s"), "{message}");
        assert!(message.contains("mcp-stuck.log"), "{message}");
        assert!(message.ends_with("line 29\ncannot bind: address in use"), "{message}");
        assert!(message.contains("line 11\n"), "{message}");
        assert!(!message.contains("line 10\n"), "only the last 20 lines: {message}");
        assert!(live_with_arg(&token).is_empty(), "the server is stopped");
    }

    #[tokio::test]
    async fn a_server_that_exits_before_ready_fails_at_once_and_stops_the_others() {
        let dir = tempfile::tempdir().expect("a workspace");
        let token = format!("bystander-{}", rand::random::<u64>());
        let bystander = server("bystander", &["sh", "-c", "sleep 300; :", &token]);
        let mut failing = server("failing", &["python3", "-c", "import sys; sys.exit('fatal: no config')"]);
        failing.ready_tcp = Some(format!("127.0.0.1:{}", free_port()));
        // Were the exit not noticed, the start would wait for the timeout.
        let error = McpSupervisor::start(&[bystander, failing], dir.path(), Duration::from_secs(600))
            .await
            .expect_err("the server exits");
        let McpError::ExitedEarly { server, status, tail, .. } = &error else { panic!("{error:?}") };
        assert_eq!(server, "failing");
        assert_eq!(status, "exit status 1");
        assert_eq!(tail, "fatal: no config");
        assert!(error.to_string().starts_with("MCP server \"failing\" exited before it was ready"));
        wait_until("the other server is stopped", || live_with_arg(&token).is_empty()).await;
    }

    #[tokio::test]
    async fn a_failed_restart_is_reported_and_leaves_the_server_stopped() {
        let dir = tempfile::tempdir().expect("a workspace");
        let spec = python_server("flaky", &dir.path().join("env.json"), free_port());
        let mut supervisor = McpSupervisor::start(&[spec], dir.path(), TIMEOUT).await.expect("starts");
        let pid = supervisor.pids()[0];
        let mcp_env = BTreeMap::from([("MODE".to_owned(), "broken".to_owned())]);
        let failures = supervisor.restart(&mcp_env).await;
        assert_eq!(failures.len(), 1, "{failures:?}");
        let message = failures[0].to_string();
        assert!(message.starts_with("MCP server \"flaky\" exited before it was ready"), "{message}");
        assert!(message.ends_with("broken on purpose"), "{message}");
        assert!(supervisor.pids().is_empty());
        wait_until("the old server is gone", || live_in_group(pid).is_empty()).await;
        supervisor.stop().await;
    }

    #[tokio::test]
    async fn unsafe_or_duplicate_names_are_refused_before_anything_starts() {
        let dir = tempfile::tempdir().expect("a workspace");
        let long = "x".repeat(65);
        for name in ["", "../evil", "a/b", ".hidden", "sp ace", &long] {
            let error = McpSupervisor::start(&[server(name, &["sleep", "300"])], dir.path(), TIMEOUT)
                .await
                .expect_err("refused");
            assert!(matches!(error, McpError::BadName { .. }), "{name:?}: {error:?}");
        }
        let twice = [server("a", &["sleep", "300"]), server("a", &["sleep", "300"])];
        let error = McpSupervisor::start(&twice, dir.path(), TIMEOUT).await.expect_err("refused");
        assert_eq!(error.to_string(), "MCP server \"a\" is listed twice");
        let error = McpSupervisor::start(&[server("empty", &[])], dir.path(), TIMEOUT).await.expect_err("refused");
        assert_eq!(error.to_string(), "MCP server \"empty\" has an empty command");
        assert!(!dir.path().join(STATE_DIR).exists(), "nothing was started");
    }

    #[tokio::test]
    async fn write_config_lists_the_http_servers() {
        let dir = tempfile::tempdir().expect("a workspace");
        let mut http = server("web", &["sleep", "300"]);
        http.transport = Some(McpTransport::Http);
        http.url = Some("http://127.0.0.1:7001/mcp".to_owned());
        let plain = server("plain", &["sleep", "300"]);
        let mut stdio = server("stdio", &["sleep", "300"]);
        stdio.transport = Some(McpTransport::Stdio);
        let mut supervisor =
            McpSupervisor::start(&[http, plain.clone(), stdio], dir.path(), TIMEOUT).await.expect("starts");
        let path = supervisor.write_config(dir.path()).expect("written").expect("one server is listed");
        assert_eq!(path, dir.path().join(".standby/mcp.json"));
        let config: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).expect("readable")).expect("JSON");
        assert_eq!(config, json!({"mcpServers": {"web": {"type": "http", "url": "http://127.0.0.1:7001/mcp"}}}));
        let mut names: Vec<String> = std::fs::read_dir(dir.path().join(STATE_DIR))
            .expect("listable")
            .map(|entry| entry.expect("an entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["mcp-plain.log", "mcp-stdio.log", "mcp-web.log", "mcp.json"]);
        supervisor.stop().await;

        let mut unlisted = McpSupervisor::start(&[plain], dir.path(), TIMEOUT).await.expect("starts");
        assert_eq!(unlisted.write_config(dir.path()).expect("nothing to write"), None);
        assert!(!path.exists(), "no file when no server is listed");
        unlisted.stop().await;
    }
}
