//! The spec's MCP servers: started during preparation so a run finds them
//! up, restarted at assignment with the run's `mcp_env`, stopped at the end.
//!
//! A server's environment is the agent's (minus its credentials), then the
//! spec's `env`, then after a restart the run's `mcp_env`, and nothing
//! else: a server is a program the run talks to, not the run, so it never
//! sees the run's secrets, credentials or `env`. Each runs in the workspace
//! root in a process group of its own (so stopping it stops what it
//! started), with its stderr appended to `<workspace>/.standby/mcp-<name>.log`,
//! whose tail explains a server that never came up.
//!
//! How a server is reached decides how it is started and when it is ready:
//!
//! - `transport: "stdio"`: the agent holds its stdin and stdout and serves
//!   it to the run over MCP streamable HTTP at a loopback URL that survives
//!   restarts ([`bridge`]); ready once the MCP `initialize` exchange
//!   succeeds (and `ready_tcp` accepts, when given).
//! - `transport: "http"`: ready when `ready_tcp` accepts a connection, or
//!   without one, when its `url` answers an MCP `initialize`.
//! - no transport: a plain process, stdin closed and stdout in the log;
//!   ready when `ready_tcp` accepts, or at once.
//!
//! The first two are listed for the run in `<workspace>/.standby/mcp.json`.

mod bridge;
mod connection;
mod framing;
mod routing;
mod server_requests;

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::future::{join_all, try_join_all};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use standby_protocol::layout::StateDir;
use standby_protocol::{McpServer, McpTransport};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tracing::{debug, info, warn};

use self::bridge::{Backend, Bridge, ServerOptions};
use self::connection::{Connection, MAX_MESSAGE_BYTES, Message, initialize_request, initialize_result};
use crate::git::describe_status;
use crate::process::{child_env, register, unregister};
use crate::reaper::signal_group;

/// How often `ready_tcp` (or an HTTP server's `url`) is tried.
const READY_POLL: Duration = Duration::from_millis(50);
/// Bound on one connection attempt to `ready_tcp` or `url` (a host that
/// drops packets would otherwise stall the polling).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Bound on one `initialize` attempt at an HTTP server's `url`.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a server has to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// Lines of a server's log quoted in an error.
const TAIL_LINES: usize = 20;
/// How far back from the end of a log those lines are looked for.
const TAIL_BYTES: u64 = 16 * 1024;
/// Longest server name accepted: it becomes part of a file name and a URL.
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
    #[error("MCP server {server:?} has transport \"http\" but no url")]
    NoUrl { server: String },
    #[error("MCP server {server:?}: url {url:?} is not an http:// or https:// URL")]
    BadUrl { server: String, url: String },
    #[error("MCP server {server:?}: ready_tcp {addr:?} is not a usable address: {source}")]
    ReadyAddress { server: String, addr: String, source: io::Error },
    #[error("MCP server {server:?}: cannot {action} {}: {source}", path.display())]
    Io { server: String, action: &'static str, path: PathBuf, source: io::Error },
    #[error("MCP server {server:?}: cannot start {program:?}: {source}")]
    Spawn { server: String, program: String, source: io::Error },
    #[error(
        "MCP server {server:?} never became ready: {waited_for} within {}; last lines of {}:\n{tail}",
        humantime::format_duration(*timeout),
        log.display()
    )]
    NeverReady { server: String, waited_for: String, timeout: Duration, log: PathBuf, tail: String },
    #[error("MCP server {server:?} failed the MCP handshake: {reason}; last lines of {}:\n{tail}", log.display())]
    Handshake { server: String, reason: String, log: PathBuf, tail: String },
    #[error(
        "MCP server {server:?} exited before it was ready ({status}); last lines of {}:\n{tail}",
        log.display()
    )]
    ExitedEarly { server: String, status: String, log: PathBuf, tail: String },
    #[error("MCP server {server:?}: cannot wait for it: {source}")]
    Wait { server: String, source: io::Error },
    #[error("cannot open the MCP bridge on 127.0.0.1: {source}")]
    Bridge { source: io::Error },
    #[error("cannot write the MCP configuration {}: {source}", path.display())]
    Config { path: PathBuf, source: io::Error },
}

/// The spec's MCP servers, the processes running them, and the bridge that
/// serves the stdio ones.
pub struct McpSupervisor {
    workspace: PathBuf,
    ready_timeout: Duration,
    servers: Vec<Supervised>,
    /// `Some` when a server has transport `stdio`.
    bridge: Option<Bridge>,
}

struct Supervised {
    spec: McpServer,
    /// `None` once stopped, or after a failed restart.
    running: Option<Running>,
    /// The server's place in the bridge, for a stdio server.
    backend: Option<Arc<Backend>>,
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
            .field("bridge", &self.bridge)
            .finish_non_exhaustive()
    }
}

impl McpSupervisor {
    /// Opens the bridge when a server speaks stdio, starts every server at
    /// once and waits until each is ready (see the module's documentation),
    /// each within `ready_timeout`; then writes `mcp.json`. A server that
    /// exits first fails at once. On any failure the servers already
    /// started are killed and the first error is returned.
    pub async fn start(servers: &[McpServer], workspace: &Path, ready_timeout: Duration) -> Result<Self, McpError> {
        check_servers(servers)?;
        if let Some(first) = servers.first() {
            let dir = StateDir::of(workspace).path().to_path_buf();
            std::fs::create_dir_all(&dir).map_err(|source| McpError::Io {
                server: first.name.clone(),
                action: "create the log directory",
                path: dir,
                source,
            })?;
        }
        let root = workspace_root(workspace);
        let stdio: Vec<(&str, ServerOptions)> = servers
            .iter()
            .filter(|server| is_stdio(server))
            .map(|server| {
                let options = ServerOptions {
                    declared: server.declared_capabilities(None),
                    workspace_root: server.answers_workspace_root().then(|| root.clone()),
                };
                (server.name.as_str(), options)
            })
            .collect();
        let bridge = if stdio.is_empty() {
            None
        } else {
            // A request may wait out a whole restart: the stop, then the start.
            let wait = STOP_GRACE + ready_timeout;
            Some(Bridge::open(stdio, wait).await.map_err(|source| McpError::Bridge { source })?)
        };
        let backends: Vec<Option<Arc<Backend>>> = servers
            .iter()
            .map(|server| bridge.as_ref().filter(|_| is_stdio(server)).and_then(|bridge| bridge.backend(&server.name)))
            .collect();
        // On the first error the other launches are dropped, which kills
        // their servers (see `Running`'s `Drop`).
        let running = try_join_all(
            servers
                .iter()
                .zip(&backends)
                .map(|(server, backend)| launch(server, workspace, None, ready_timeout, backend.as_ref())),
        )
        .await?;
        let supervisor = Self {
            workspace: workspace.to_path_buf(),
            ready_timeout,
            servers: servers
                .iter()
                .cloned()
                .zip(running)
                .zip(backends)
                .map(|((spec, running), backend)| Supervised { spec, running: Some(running), backend })
                .collect(),
            bridge,
        };
        supervisor.write_config(workspace)?;
        Ok(supervisor)
    }

    /// Restarts every server at once with `mcp_env` overlaid on its spec
    /// `env`: stop (SIGTERM to its group, SIGKILL after 2 s), start, wait
    /// until ready. Returns the failures, empty when all restarted; a
    /// server that failed stays stopped, and its bridge endpoint answers
    /// requests with an error. Requests to a stdio server's endpoint wait
    /// while it restarts.
    pub async fn restart(&mut self, mcp_env: &BTreeMap<String, String>) -> Vec<McpError> {
        let workspace = &self.workspace;
        let ready_timeout = self.ready_timeout;
        let results = join_all(self.servers.iter_mut().map(|server| async move {
            if let Some(backend) = &server.backend {
                backend.starting();
            }
            if let Some(running) = server.running.take() {
                running.stop().await;
            }
            match launch(&server.spec, workspace, Some(mcp_env), ready_timeout, server.backend.as_ref()).await {
                Ok(running) => {
                    server.running = Some(running);
                    None
                }
                Err(error) => {
                    if let Some(backend) = &server.backend {
                        backend.down(format!("MCP server {:?} failed to restart", server.spec.name));
                    }
                    warn!(server = %server.spec.name, %error, "MCP server failed to restart");
                    Some(error)
                }
            }
        }))
        .await;
        results.into_iter().flatten().collect()
    }

    /// Stops every server and reaps it, then the bridge. Idempotent.
    pub async fn stop(&mut self) {
        for server in &self.servers {
            if let Some(backend) = &server.backend {
                backend.down(format!("MCP server {:?} is stopped: the agent is shutting down", server.spec.name));
            }
        }
        join_all(self.servers.iter_mut().filter_map(|server| server.running.take()).map(Running::stop)).await;
        if let Some(bridge) = self.bridge.as_mut() {
            bridge.close().await;
        }
    }

    /// The pids of the running servers.
    #[cfg(test)]
    pub fn pids(&self) -> Vec<u32> {
        self.servers.iter().filter_map(|server| server.running.as_ref().map(|running| running.pid)).collect()
    }

    /// Writes `<workspace>/.standby/mcp.json`, listing the servers with
    /// transport `http` at their `url` and those with transport `stdio` at
    /// their bridge URL, as `{"mcpServers": {"<name>": {"type": "http",
    /// "url": "…"}}}`, atomically (a reader never sees half a file), and
    /// only when its content changes. Returns its path, or `None` (and
    /// removes a stale file) when no server qualifies.
    pub fn write_config(&self, workspace: &Path) -> Result<Option<PathBuf>, McpError> {
        let listed: serde_json::Map<String, Value> = self
            .servers
            .iter()
            .filter_map(|server| {
                let url = match server.spec.transport? {
                    McpTransport::Http => server.spec.url.clone()?,
                    McpTransport::Stdio => self.bridge.as_ref()?.url(&server.spec.name),
                };
                Some((server.spec.name.clone(), json!({"type": "http", "url": url})))
            })
            .collect();
        let state_dir = StateDir::of(workspace);
        let (dir, path) = (state_dir.path(), state_dir.mcp_config());
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
        if std::fs::read(&path).is_ok_and(|existing| existing == bytes) {
            return Ok(Some(path));
        }
        std::fs::create_dir_all(dir).map_err(config_error)?;
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let temp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let written = write_file(&temp, &bytes).and_then(|()| std::fs::rename(&temp, &path));
        if let Err(error) = written {
            // Best effort: the write already failed.
            let _ = std::fs::remove_file(&temp);
            return Err(config_error(error));
        }
        Ok(Some(path))
    }
}

fn is_stdio(server: &McpServer) -> bool {
    server.transport == Some(McpTransport::Stdio)
}

/// The MCP root naming the workspace, which answers a server's
/// `roots/list` when no client of the bridge declared roots.
fn workspace_root(workspace: &Path) -> Value {
    let absolute = std::path::absolute(workspace).unwrap_or_else(|_| workspace.to_path_buf());
    let name = absolute.file_name().map_or_else(|| "workspace".to_owned(), |name| name.to_string_lossy().into_owned());
    json!({"uri": file_uri(&absolute), "name": name})
}

/// A `file://` URI of an absolute path, its bytes outside RFC 3986's
/// unreserved set (and `/`) percent-encoded.
fn file_uri(path: &Path) -> String {
    use std::fmt::Write as _;
    use std::os::unix::ffi::OsStrExt;
    let mut uri = String::from("file://");
    for &byte in path.as_os_str().as_bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'/' | b'-' | b'.' | b'_' | b'~') {
            uri.push(char::from(byte));
        } else {
            let _ = write!(uri, "%{byte:02X}");
        }
    }
    uri
}

/// Not synced: `mcp.json` is a run's file, rewritten by each install and
/// worth nothing after a crash; an fsync would sit on the critical path.
fn write_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = File::create(path)?;
    file.write_all(bytes)
}

/// Refuses names that are unsafe in a file name, duplicates, empty
/// commands and HTTP servers without a usable URL, before anything starts.
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
        if server.transport == Some(McpTransport::Http) {
            let Some(url) = &server.url else { return Err(McpError::NoUrl { server: name.clone() }) };
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(McpError::BadUrl { server: name.clone(), url: url.clone() });
            }
        }
    }
    Ok(())
}

/// Why a server is not ready, short of a timeout or an exit.
enum NotReady {
    /// It answered the handshake, but not as it should.
    Refused(String),
    /// It closed its stdout before answering: it is probably exiting.
    Closed(String),
}

/// Starts one server and waits until it is ready; on failure it is killed
/// and reaped before the error (with its log's tail) is returned. A stdio
/// server is started with its pipes held by the bridge, which `backend`
/// serves once the server is ready.
async fn launch(
    spec: &McpServer,
    workspace: &Path,
    mcp_env: Option<&BTreeMap<String, String>>,
    ready_timeout: Duration,
    backend: Option<&Arc<Backend>>,
) -> Result<Running, McpError> {
    let name = &spec.name;
    let Some((program, args)) = spec.command.split_first() else {
        return Err(McpError::EmptyCommand { server: name.clone() });
    };
    let ready_addrs = match &spec.ready_tcp {
        Some(addr) => Some(resolve(name, addr).await?),
        None => None,
    };
    let log_path = StateDir::of(workspace).mcp_log(name);
    let log_error = |action| io_error(name, action, &log_path);
    let log = OpenOptions::new().create(true).append(true).open(&log_path).map_err(log_error("open its log"))?;
    let log_start = log.metadata().map_err(log_error("read the size of its log"))?.len();
    let stderr = log.try_clone().map_err(log_error("share its log"))?;

    let mut env = child_env();
    env.extend(spec.env.clone());
    if let Some(mcp_env) = mcp_env {
        env.extend(mcp_env.clone());
    }
    let mut command = Command::new(program);
    command.args(args).env_clear().envs(&env).current_dir(workspace).stderr(stderr).process_group(0).kill_on_drop(true);
    if backend.is_some() {
        command.stdin(Stdio::piped()).stdout(Stdio::piped());
    } else {
        command.stdin(Stdio::null()).stdout(log);
    }
    let mut child = crate::process::spawn(command).await.map_err(|source| McpError::Spawn {
        server: name.clone(),
        program: program.clone(),
        source,
    })?;
    let Some(pid) = child.id() else {
        return Err(McpError::Wait {
            server: name.clone(),
            source: io::Error::other("it has no pid right after it started"),
        });
    };
    register(pid);
    let pipes = (child.stdin.take(), child.stdout.take());
    let connection = match (backend, pipes) {
        (Some(backend), (Some(stdin), Some(stdout))) => {
            Some(Connection::open(name, stdin, stdout, Arc::downgrade(backend)))
        }
        _ => None,
    };
    let mut running = Running { name: name.clone(), pid, child: Some(child), connection: connection.clone() };
    debug!(server = %name, pid, "MCP server started");

    let http_url = spec.url.as_deref().filter(|_| spec.transport == Some(McpTransport::Http));
    if connection.is_none() && ready_addrs.is_none() && http_url.is_none() {
        info!(server = %name, pid, "MCP server started (no readiness check)");
        return Ok(running);
    }
    let waited_for = Mutex::new(String::new());
    let readiness = async {
        if let Some(connection) = &connection {
            set(&waited_for, "it answered no MCP initialize on stdio".to_owned());
            let declared = backend.map(|backend| backend.declared().to_vec()).unwrap_or_default();
            if let Err(reason) = connection.initialize(&declared).await {
                return Err(if connection.is_closed() { NotReady::Closed(reason) } else { NotReady::Refused(reason) });
            }
        }
        if let Some(addrs) = &ready_addrs {
            let addr = spec.ready_tcp.as_deref().unwrap_or_default();
            set(&waited_for, format!("{addr} accepted no connection"));
            accepts(addrs).await;
        } else if let Some(url) = http_url {
            set(&waited_for, format!("{url} answered no MCP initialize"));
            answers_initialize(url, &waited_for).await;
        }
        Ok(())
    };
    let ready = running.wait_ready(readiness, ready_timeout).await;
    let tail = || log_tail(&log_path, log_start);
    match ready {
        Ready::Yes => {
            if let (Some(backend), Some(connection)) = (backend, connection) {
                backend.up(connection);
            }
            info!(server = %name, pid, "MCP server ready");
            Ok(running)
        }
        Ready::TimedOut => {
            running.kill().await;
            Err(McpError::NeverReady {
                server: name.clone(),
                waited_for: waited_for.into_inner().unwrap_or_else(PoisonError::into_inner),
                timeout: ready_timeout,
                log: log_path.clone(),
                tail: tail(),
            })
        }
        Ready::Refused(reason) => {
            running.kill().await;
            Err(McpError::Handshake { server: name.clone(), reason, log: log_path.clone(), tail: tail() })
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

fn set(slot: &Mutex<String>, value: String) {
    *slot.lock().unwrap_or_else(PoisonError::into_inner) = value;
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
    Refused(String),
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
    /// The bridge's hold on a stdio server's pipes.
    connection: Option<Arc<Connection>>,
}

impl Running {
    fn pgid(&self) -> i32 {
        i32::try_from(self.pid).unwrap_or(i32::MAX)
    }

    /// Waits for `readiness` within `timeout`, unless the server exits
    /// first. A server that closed its stdout during the handshake is given
    /// [`STOP_GRACE`] to exit, so that its exit status is what is reported.
    async fn wait_ready(&mut self, readiness: impl Future<Output = Result<(), NotReady>>, timeout: Duration) -> Ready {
        let Some(child) = self.child.as_mut() else {
            return Ready::WaitFailed(io::Error::other("the server is already reaped"));
        };
        let outcome = tokio::select! {
            status = child.wait() => return match status {
                Ok(status) => Ready::Exited(status),
                Err(error) => Ready::WaitFailed(error),
            },
            outcome = tokio::time::timeout(timeout, readiness) => outcome,
        };
        match outcome {
            Err(_) => Ready::TimedOut,
            Ok(Ok(())) => Ready::Yes,
            Ok(Err(NotReady::Refused(reason))) => Ready::Refused(reason),
            Ok(Err(NotReady::Closed(reason))) => match tokio::time::timeout(STOP_GRACE, child.wait()).await {
                Ok(Ok(status)) => Ready::Exited(status),
                _ => Ready::Refused(reason),
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
        if let Some(connection) = self.connection.take() {
            connection.close();
        }
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

/// Resolves once `url` answers an MCP `initialize`, keeping the reason of
/// the last failed attempt in `waited_for`.
async fn answers_initialize(url: &str, waited_for: &Mutex<String>) {
    crate::api::install_tls_provider();
    let client = match reqwest::Client::builder().connect_timeout(CONNECT_TIMEOUT).timeout(PROBE_TIMEOUT).build() {
        Ok(client) => client,
        Err(error) => {
            set(waited_for, format!("{url} answered no MCP initialize (no HTTP client: {error})"));
            return std::future::pending().await;
        }
    };
    loop {
        match probe_initialize(&client, url).await {
            Ok(()) => return,
            Err(why) => set(waited_for, format!("{url} answered no MCP initialize (last attempt: {why})")),
        }
        tokio::time::sleep(READY_POLL).await;
    }
}

/// One `initialize` at an HTTP server; the session it opened is ended.
async fn probe_initialize(client: &reqwest::Client, url: &str) -> Result<(), String> {
    let response = client
        .post(url)
        .header(reqwest::header::ACCEPT, "application/json, text/event-stream")
        .json(&initialize_request(0, &[]))
        .send()
        .await
        .map_err(|error| error.to_string())?;
    let status = response.status();
    if !status.is_success() {
        return Err(format!("HTTP status {status}"));
    }
    let session = response.headers().get("mcp-session-id").cloned();
    let events = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/event-stream"));
    let answer = read_answer(response, events).await?;
    initialize_result(&answer)?;
    if let Some(session) = session {
        // Best effort: the server forgets the probe's session.
        let _ = client.delete(url).header("mcp-session-id", session).send().await;
    }
    Ok(())
}

/// The JSON-RPC answer in a response body: the body itself, or the first
/// answer among its server-sent events.
async fn read_answer(mut response: reqwest::Response, events: bool) -> Result<Message, String> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|error| error.to_string())? {
        body.extend_from_slice(&chunk);
        if body.len() > MAX_MESSAGE_BYTES {
            return Err(format!("the answer is larger than {MAX_MESSAGE_BYTES} bytes"));
        }
        if events && let Some(answer) = event_answer(&body, false) {
            return Ok(answer);
        }
    }
    if events {
        return event_answer(&body, true).ok_or_else(|| "the event stream holds no answer".to_owned());
    }
    match serde_json::from_slice(&body) {
        Ok(Value::Object(answer)) => Ok(answer),
        Ok(_) => Err("the answer is not a JSON object".to_owned()),
        Err(error) => Err(format!("the answer is not JSON: {error}")),
    }
}

/// The first JSON-RPC answer among the complete server-sent events of
/// `body` (all of them once the body `ended`).
fn event_answer(body: &[u8], ended: bool) -> Option<Message> {
    let text = String::from_utf8_lossy(body).replace("\r\n", "\n");
    let mut events: Vec<&str> = text.split("\n\n").collect();
    if !ended {
        // The last piece may be an event still arriving.
        events.pop();
    }
    events.into_iter().find_map(|event| {
        let data: Vec<&str> = event
            .lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .map(|data| data.strip_prefix(' ').unwrap_or(data))
            .collect();
        match serde_json::from_str(&data.join("\n")) {
            Ok(Value::Object(message)) if message.contains_key("result") || message.contains_key("error") => {
                Some(message)
            }
            _ => None,
        }
    })
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
            client_capabilities: None,
            workspace_root: None,
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
        assert!(StateDir::of(dir.path()).mcp_log("files").is_file());

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
        assert!(!StateDir::of(dir.path()).path().exists(), "nothing was started");
    }

    /// The fake MCP server of every test (`mcp/fake_server.py`; its modes
    /// and tools are described there).
    const STDIO_SERVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/mcp/fake_server.py");

    /// A [`STDIO_SERVER`] named `name`.
    fn stdio_server(name: &str) -> McpServer {
        let mut spec = server(name, &["python3", STDIO_SERVER]);
        spec.transport = Some(McpTransport::Stdio);
        spec
    }

    fn read_config(workspace: &Path) -> serde_json::Value {
        let path = StateDir::of(workspace).mcp_config();
        serde_json::from_slice(&std::fs::read(&path).expect("mcp.json is written")).expect("mcp.json is JSON")
    }

    /// The URL `mcp.json` lists for `name`.
    fn listed_url(workspace: &Path, name: &str) -> String {
        let config = read_config(workspace);
        config["mcpServers"][name]["url"].as_str().expect("the server is listed with a url").to_owned()
    }

    /// A streamable-HTTP client of the bridge, as a harness would be one.
    struct Client {
        http: reqwest::Client,
        url: String,
        session: Option<String>,
    }

    impl Client {
        fn new(url: &str) -> Self {
            crate::api::install_tls_provider();
            Self { http: reqwest::Client::new(), url: url.to_owned(), session: None }
        }

        /// A client with a session: `initialize` answered, `initialized` sent.
        async fn connect(url: &str) -> Self {
            Self::connect_declaring(url, json!({})).await
        }

        /// A client with a session, declaring `capabilities`.
        async fn connect_declaring(url: &str, capabilities: Value) -> Self {
            let mut client = Self::new(url);
            let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": capabilities,
                "clientInfo": {"name": "test", "version": "1"}}});
            let (status, headers, answer) = client.post(&initialize).await;
            assert_eq!(status, 200, "{answer}");
            assert_eq!(answer["id"], 1, "{answer}");
            assert_eq!(answer["result"]["serverInfo"]["name"], "probe", "the server's own result: {answer}");
            let session = headers.get("mcp-session-id").expect("a session id").to_str().expect("ASCII");
            client.session = Some(session.to_owned());
            let (status, _, _) = client.post(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await;
            assert_eq!(status, 202);
            client
        }

        fn request(&self, method: reqwest::Method) -> reqwest::RequestBuilder {
            let request = self.http.request(method, &self.url).header("accept", "application/json, text/event-stream");
            match &self.session {
                Some(session) => request.header("mcp-session-id", session),
                None => request,
            }
        }

        async fn post(&self, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
            let response = self.request(reqwest::Method::POST).json(body).send().await.expect("the bridge answers");
            let status = response.status().as_u16();
            let headers = response.headers().clone();
            let text = response.text().await.expect("a body");
            (status, headers, serde_json::from_str(&text).unwrap_or(Value::String(text)))
        }

        /// `tools/call` of `tool`: the text it returned, or the error's message.
        async fn call(&self, id: u64, tool: &str, arguments: Value) -> Result<String, String> {
            let call = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
                              "params": {"name": tool, "arguments": arguments}});
            let (status, _, answer) = self.post(&call).await;
            assert_eq!(status, 200, "{answer}");
            assert_eq!(answer["id"], id, "answered under the client's id: {answer}");
            match answer["result"]["content"][0]["text"].as_str() {
                Some(text) => Ok(text.to_owned()),
                None => Err(answer["error"]["message"].as_str().expect("an error message").to_owned()),
            }
        }
    }

    #[tokio::test]
    async fn write_config_lists_the_http_and_stdio_servers() {
        let dir = tempfile::tempdir().expect("a workspace");
        let mut http = server("web", &["sleep", "300"]);
        http.transport = Some(McpTransport::Http);
        http.url = Some("http://127.0.0.1:7001/mcp".to_owned());
        let plain = server("plain", &["sleep", "300"]);
        let stdio = stdio_server("stdio");
        // Ready at once: the HTTP server's readiness is tried on a port that
        // accepts (the test's own listener).
        let listener = TcpListener::bind("127.0.0.1:0").expect("a listener");
        http.ready_tcp = Some(listener.local_addr().expect("bound").to_string());
        let mut supervisor =
            McpSupervisor::start(&[http, plain.clone(), stdio], dir.path(), TIMEOUT).await.expect("starts");
        let path = StateDir::of(dir.path()).mcp_config();
        let written = std::fs::metadata(&path).and_then(|meta| meta.modified()).expect("written at start");
        assert_eq!(supervisor.write_config(dir.path()).expect("written"), Some(path.clone()));
        let rewritten = std::fs::metadata(&path).and_then(|meta| meta.modified()).expect("still there");
        assert_eq!(written, rewritten, "an unchanged configuration is not rewritten");
        let url = listed_url(dir.path(), "stdio");
        assert!(url.starts_with("http://127.0.0.1:") && url.ends_with("/mcp/stdio"), "{url}");
        assert_eq!(
            read_config(dir.path()),
            json!({"mcpServers": {
                "web": {"type": "http", "url": "http://127.0.0.1:7001/mcp"},
                "stdio": {"type": "http", "url": url},
            }})
        );
        let mut names: Vec<String> = std::fs::read_dir(StateDir::of(dir.path()).path())
            .expect("listable")
            .map(|entry| entry.expect("an entry").file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".log") || name.ends_with(".json"))
            .collect();
        names.sort();
        assert_eq!(names, ["mcp-plain.log", "mcp-stdio.log", "mcp-web.log", "mcp.json"]);
        supervisor.stop().await;

        let mut unlisted = McpSupervisor::start(&[plain], dir.path(), TIMEOUT).await.expect("starts");
        assert!(!path.exists(), "no file when no server is listed");
        assert_eq!(unlisted.write_config(dir.path()).expect("nothing to write"), None);
        unlisted.stop().await;
    }

    #[tokio::test]
    async fn an_http_server_without_ready_tcp_is_ready_when_its_url_answers_initialize() {
        // Refuses the first two attempts, then answers as an MCP server
        // that streams its answer as server-sent events.
        let script = r#"
import http.server, json, sys
attempts = 0
class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        global attempts
        attempts += 1
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if attempts < 3:
            self.send_response(503); self.end_headers(); return
        answer = {"jsonrpc": "2.0", "id": request["id"], "result": {"protocolVersion": "2025-06-18",
                  "capabilities": {}, "serverInfo": {"name": "web", "version": "1"}}}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Mcp-Session-Id", "s1")
        self.end_headers()
        self.wfile.write(b"event: message\r\ndata: " + json.dumps(answer).encode() + b"\r\n\r\n")
    def do_DELETE(self):
        print("session ended:", self.headers["Mcp-Session-Id"], file=sys.stderr, flush=True)
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"#;
        let dir = tempfile::tempdir().expect("a workspace");
        let port = free_port();
        let mut spec = server("web", &["python3", "-c", script, &port.to_string()]);
        spec.transport = Some(McpTransport::Http);
        spec.url = Some(format!("http://127.0.0.1:{port}/mcp"));
        let mut supervisor = McpSupervisor::start(&[spec], dir.path(), TIMEOUT).await.expect("ready");
        let log = StateDir::of(dir.path()).mcp_log("web");
        wait_until("the probe's session is ended", || {
            std::fs::read_to_string(&log).is_ok_and(|log| log.contains("session ended: s1"))
        })
        .await;
        assert_eq!(listed_url(dir.path(), "web"), format!("http://127.0.0.1:{port}/mcp"));
        supervisor.stop().await;

        let silent = format!("http://127.0.0.1:{}/mcp", free_port());
        let mut spec = server("mute", &["sleep", "300"]);
        spec.transport = Some(McpTransport::Http);
        spec.url = Some(silent.clone());
        let error = McpSupervisor::start(&[spec], dir.path(), Duration::from_secs(1)).await.expect_err("never ready");
        let message = error.to_string();
        assert!(
            message
                .starts_with(&format!("MCP server \"mute\" never became ready: {silent} answered no MCP initialize")),
            "{message}"
        );
        assert!(message.contains("last attempt:"), "{message}");
    }

    #[tokio::test]
    async fn a_stdio_server_is_served_at_its_url_and_keeps_it_across_restarts() {
        let dir = tempfile::tempdir().expect("a workspace");
        let mut spec = stdio_server("probe");
        spec.env = BTreeMap::from([("MODE_OF_RUN".to_owned(), "standby".to_owned())]);
        let mut supervisor = McpSupervisor::start(&[spec], dir.path(), TIMEOUT).await.expect("starts");
        let url = listed_url(dir.path(), "probe");
        let client = Client::connect(&url).await;
        assert_eq!(client.call(2, "env", json!({"name": "MODE_OF_RUN"})).await, Ok("standby".to_owned()));
        // A sessionless client (a script) is served too.
        assert_eq!(Client::new(&url).call(3, "env", json!({"name": "MODE_OF_RUN"})).await, Ok("standby".to_owned()));

        // The new process holds its handshake until the gate opens, so the
        // request below is made while the server restarts.
        let gate = dir.path().join("gate");
        let mcp_env = BTreeMap::from([
            ("MODE_OF_RUN".to_owned(), "run".to_owned()),
            ("GATE".to_owned(), gate.display().to_string()),
        ]);
        let old = supervisor.pids()[0];
        let backend = supervisor.servers[0].backend.clone().expect("a stdio server has a backend");
        let during = async {
            wait_until("the old server is gone", || live_in_group(old).is_empty()).await;
            let call = tokio::spawn({
                let client = Client { http: client.http.clone(), url: url.clone(), session: client.session.clone() };
                async move { client.call(4, "env", json!({"name": "MODE_OF_RUN"})).await }
            });
            wait_until("the request waits for the restart", || backend.waiting() == 1).await;
            std::fs::write(&gate, "").expect("open the gate");
            call.await.expect("the call task")
        };
        let (failures, answer) = tokio::join!(supervisor.restart(&mcp_env), during);
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(answer, Ok("run".to_owned()), "the request waited for the restarted server");
        assert_eq!(listed_url(dir.path(), "probe"), url, "the URL survives the restart");
        assert_eq!(client.call(5, "env", json!({"name": "MODE_OF_RUN"})).await, Ok("run".to_owned()));
        supervisor.stop().await;
        let after = client.request(reqwest::Method::POST).json(&json!({"jsonrpc": "2.0", "id": 6, "method": "ping"}));
        assert!(after.send().await.is_err(), "nothing is served once stopped");
    }

    #[tokio::test]
    async fn bad_output_and_crashes_are_isolated() {
        let dir = tempfile::tempdir().expect("a workspace");
        let specs = [stdio_server("flaky"), stdio_server("steady")];
        let mut supervisor = McpSupervisor::start(&specs, dir.path(), TIMEOUT).await.expect("starts");
        let flaky = Client::connect(&listed_url(dir.path(), "flaky")).await;
        let steady = Client::connect(&listed_url(dir.path(), "steady")).await;

        assert_eq!(flaky.call(1, "garbage", json!({})).await, Ok("garbage".to_owned()), "garbage is stepped over");
        let error = flaky.call(2, "big", json!({"bytes": MAX_MESSAGE_BYTES})).await.expect_err("too big");
        assert!(error.contains("answered with more than 4194304 bytes"), "{error}");
        assert_eq!(flaky.call(3, "big", json!({"bytes": 10})).await, Ok("xxxxxxxxxx".to_owned()));

        let error = flaky.call(4, "crash", json!({})).await.expect_err("the server died mid-call");
        assert!(error.contains("stopped before it answered"), "{error}");
        let error = flaky.call(5, "env", json!({"name": "HOME"})).await.expect_err("the server is gone");
        assert!(error.contains("exited"), "{error}");
        assert_eq!(steady.call(6, "garbage", json!({})).await, Ok("garbage".to_owned()), "the other server carries on");

        let failures = supervisor.restart(&BTreeMap::new()).await;
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(flaky.call(7, "env", json!({"name": "MODE"})).await, Ok(String::new()), "back after a restart");
        supervisor.stop().await;
    }

    #[tokio::test]
    async fn sessions_streams_progress_and_cancellation() {
        let dir = tempfile::tempdir().expect("a workspace");
        let mut supervisor = McpSupervisor::start(&[stdio_server("probe")], dir.path(), TIMEOUT).await.expect("starts");
        let url = listed_url(dir.path(), "probe");
        let client = Client::connect(&url).await;

        let mut stream = client.request(reqwest::Method::GET).send().await.expect("a stream");
        assert_eq!(stream.status(), 200);
        let call = json!({"jsonrpc": "2.0", "id": "c-1", "method": "tools/call",
                          "params": {"name": "progress", "arguments": {}, "_meta": {"progressToken": "mine"}}});
        let (_, _, answer) = client.post(&call).await;
        assert_eq!(answer["result"]["content"][0]["text"], "progress", "{answer}");
        assert_eq!(client.call(2, "notify", json!({})).await, Ok("notify".to_owned()));
        let mut events = String::new();
        while !(events.contains("notifications/progress") && events.contains("notifications/message")) {
            let chunk = tokio::time::timeout(TIMEOUT, stream.chunk()).await.expect("an event").expect("a chunk");
            events.push_str(&String::from_utf8_lossy(&chunk.expect("the stream is open")));
        }
        assert!(events.contains(r#""progressToken":"mine""#), "the client's own token: {events}");

        // A client that stops waiting cancels its request at the server.
        let hang = json!({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "hang"}});
        let gave_up = tokio::time::timeout(Duration::from_millis(300), client.post(&hang)).await;
        assert!(gave_up.is_err(), "the server never answers");
        let log = StateDir::of(dir.path()).mcp_log("probe");
        wait_until("the server hears of the cancellation", || {
            std::fs::read_to_string(&log)
                .is_ok_and(|log| log.contains("cancelled {") && log.contains("\"requestId\": "))
        })
        .await;

        // A client's cancellation ends its request and reaches the server.
        let hang = json!({"jsonrpc": "2.0", "id": 10, "method": "tools/call", "params": {"name": "hang"}});
        let waiting = tokio::spawn({
            let client = Client { http: client.http.clone(), url: url.clone(), session: client.session.clone() };
            async move { client.post(&hang).await.2 }
        });
        let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 10}});
        let log_lines = || std::fs::read_to_string(&log).map(|log| log.matches("cancelled {").count()).unwrap_or(0);
        // No event says the request reached the bridge: the cancellation is
        // repeated (one for no pending request is dropped) until it lands.
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        while !waiting.is_finished() {
            assert!(tokio::time::Instant::now() < deadline, "the cancellation never ended the request");
            assert_eq!(client.post(&cancel).await.0, 202);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let answer = waiting.await.expect("the request task");
        assert_eq!(
            (answer["id"].clone(), answer["error"]["message"].clone()),
            (json!(10), json!("cancelled by the client"))
        );
        wait_until("the server hears of the second cancellation", || log_lines() == 2).await;

        let (status, _, _) = Client { session: Some("nope".to_owned()), ..Client::new(&url) }.post(&call).await;
        assert_eq!(status, 404, "an unknown session must initialize again");
        let ended = client.request(reqwest::Method::DELETE).send().await.expect("an answer");
        assert_eq!(ended.status(), 200);
        assert_eq!(client.post(&call).await.0, 404, "the session is ended");
        let foreign =
            Client::new(&url).request(reqwest::Method::POST).header("origin", "http://evil.example").json(&call);
        assert_eq!(foreign.send().await.expect("an answer").status(), 403);
        let batch = Client::new(&url).post(&json!([call])).await;
        assert_eq!((batch.0, batch.2["error"]["code"].clone()), (400, json!(-32600)));
        let elsewhere = Client::new(&url.replace("/mcp/probe", "/mcp/other")).post(&call).await;
        assert_eq!(elsewhere.0, 404);
        supervisor.stop().await;
    }

    #[tokio::test]
    async fn a_stdio_server_that_fails_its_handshake_fails_with_its_name_and_log() {
        let dir = tempfile::tempdir().expect("a workspace");
        let mut silent = stdio_server("silent");
        silent.env = BTreeMap::from([("MODE".to_owned(), "silent".to_owned())]);
        let error = McpSupervisor::start(&[silent], dir.path(), Duration::from_secs(1)).await.expect_err("never ready");
        assert!(matches!(error, McpError::NeverReady { .. }), "{error:?}");
        let message = error.to_string();
        assert!(
            message.starts_with(
                "MCP server \"silent\" never became ready: it answered no MCP initialize on stdio within 1s"
            ),
            "{message}"
        );
        assert!(message.ends_with("mcp-silent.log:\nnot answering on purpose"), "{message}");

        let mut refusing = stdio_server("refusing");
        refusing.env = BTreeMap::from([("MODE".to_owned(), "refuse".to_owned())]);
        let error = McpSupervisor::start(&[refusing], dir.path(), TIMEOUT).await.expect_err("refused");
        let message = error.to_string();
        assert!(
            message.starts_with(
                "MCP server \"refusing\" failed the MCP handshake: it answered initialize with an error: refused on purpose"
            ),
            "{message}"
        );

        let mut exiting = stdio_server("exiting");
        exiting.env = BTreeMap::from([("MODE".to_owned(), "exit".to_owned())]);
        let error = McpSupervisor::start(&[exiting], dir.path(), TIMEOUT).await.expect_err("exits");
        let McpError::ExitedEarly { server, status, tail, .. } = &error else { panic!("{error:?}") };
        assert_eq!(
            (server.as_str(), status.as_str(), tail.as_str()),
            ("exiting", "exit status 1", "exiting on purpose")
        );
    }

    /// A client's event stream, message by message.
    struct Events {
        response: reqwest::Response,
        buffer: String,
    }

    impl Events {
        async fn open(client: &Client) -> Self {
            let response = client.request(reqwest::Method::GET).send().await.expect("a stream");
            assert_eq!(response.status(), 200);
            Self { response, buffer: String::new() }
        }

        /// The next JSON-RPC message on the stream (keep-alives skipped).
        async fn next(&mut self) -> Value {
            loop {
                if let Some(end) = self.buffer.find("\n\n") {
                    let event: String = self.buffer.drain(..end + 2).collect();
                    let data: String =
                        event.lines().filter_map(|line| line.strip_prefix("data:")).map(str::trim_start).collect();
                    if !data.is_empty() {
                        return serde_json::from_str(&data).expect("an event is JSON");
                    }
                    continue;
                }
                let chunk = tokio::time::timeout(TIMEOUT, self.response.chunk()).await.expect("an event in time");
                let chunk = chunk.expect("a chunk").expect("the stream is open");
                self.buffer.push_str(&String::from_utf8_lossy(&chunk));
            }
        }
    }

    fn ask(method: &str, deferred: bool) -> Value {
        json!({"method": method, "params": {"messages": [], "maxTokens": 1}, "deferred": deferred})
    }

    /// A call's task, for a call that waits on something the test does next.
    fn spawn_call(
        client: &Client,
        id: u64,
        tool: &'static str,
        arguments: Value,
    ) -> tokio::task::JoinHandle<Result<String, String>> {
        let client = Client { http: client.http.clone(), url: client.url.clone(), session: client.session.clone() };
        tokio::spawn(async move { client.call(id, tool, arguments).await })
    }

    fn log_of(workspace: &Path, server: &str) -> String {
        std::fs::read_to_string(StateDir::of(workspace).mcp_log(server)).unwrap_or_default()
    }

    #[tokio::test]
    async fn a_servers_request_reaches_the_session_whose_call_is_in_flight_under_a_bridge_id() {
        let dir = tempfile::tempdir().expect("a workspace");
        let mut supervisor = McpSupervisor::start(&[stdio_server("probe")], dir.path(), TIMEOUT).await.expect("starts");
        let url = listed_url(dir.path(), "probe");
        let log = log_of(dir.path(), "probe");
        assert!(
            log.contains(r#"capabilities {"elicitation": {}, "roots": {"listChanged": true}, "sampling": {}}"#),
            "the bridge declares every capability by default: {log}"
        );
        let a = Client::connect_declaring(&url, json!({"sampling": {}})).await;
        let b = Client::connect_declaring(&url, json!({})).await;
        let (mut a_events, mut b_events) = (Events::open(&a).await, Events::open(&b).await);

        // A's call makes the server ask for sampling when B's call arrives:
        // B, which declared nothing, is then the most recently active.
        let asking = spawn_call(&a, 2, "ask", ask("sampling/createMessage", true));
        wait_until("the server holds A's request", || log_of(dir.path(), "probe").contains("deferred q0")).await;
        assert_eq!(b.call(3, "env", json!({"name": "NOPE"})).await, Ok(String::new()));
        let request = a_events.next().await;
        assert_eq!(request["method"], "sampling/createMessage", "{request}");
        let bridge_id = request["id"].as_u64().expect("a bridge id, not the server's \"q0\"");

        // B cannot answer A's request; A can, once.
        let forged = json!({"jsonrpc": "2.0", "id": bridge_id, "result": {"from": "b"}});
        assert_eq!(b.post(&forged).await.0, 202);
        let answer = json!({"jsonrpc": "2.0", "id": bridge_id, "result": {"from": "a"}});
        assert_eq!(a.post(&answer).await.0, 202);
        assert_eq!(asking.await.expect("the call task"), Ok(r#"{"from": "a"}"#.to_owned()));
        assert_eq!(a.post(&answer).await.0, 202, "a second answer is taken and ignored");
        assert_eq!(a.call(4, "notify", json!({})).await, Ok("notify".to_owned()));
        assert!(!log_of(dir.path(), "probe").contains("answer to no request"), "only A's answer reached the server");
        let first = b_events.next().await;
        assert_eq!(first["method"], "notifications/message", "B got nothing before the broadcast: {first}");
        supervisor.stop().await;
    }

    #[tokio::test]
    async fn a_request_no_client_can_take_is_answered_by_the_bridge() {
        let dir = tempfile::tempdir().expect("a workspace");
        let mut bare = stdio_server("bare");
        bare.client_capabilities = Some(Vec::new());
        bare.workspace_root = Some(false);
        let mut supervisor =
            McpSupervisor::start(&[stdio_server("probe"), bare], dir.path(), TIMEOUT).await.expect("starts");
        assert!(log_of(dir.path(), "bare").contains("capabilities {}"), "{}", log_of(dir.path(), "bare"));
        let probe = Client::connect(&listed_url(dir.path(), "probe")).await;
        let _events = Events::open(&probe).await;
        let answer = |text: Result<String, String>| -> Value {
            serde_json::from_str(&text.expect("the tool answers")).expect("JSON")
        };
        let refused = answer(probe.call(2, "ask", ask("sampling/createMessage", false)).await);
        assert_eq!(
            refused,
            json!({"code": -32601, "message": "no client of the standby MCP bridge declared sampling"})
        );
        let refused = answer(probe.call(3, "ask", ask("elicitation/create", false)).await);
        assert_eq!(refused["code"], -32601, "{refused}");
        let refused = answer(probe.call(4, "ask", ask("standby/unknown", false)).await);
        assert_eq!(
            refused,
            json!({"code": -32601, "message": "no client of the standby MCP bridge serves standby/unknown"})
        );
        let roots = answer(probe.call(5, "ask", ask("roots/list", false)).await);
        let name = dir.path().file_name().expect("a name").to_string_lossy().into_owned();
        assert_eq!(roots, json!({"roots": [{"uri": format!("file://{}", dir.path().display()), "name": name}]}));

        // One over the size limit is discarded, and refused.
        let mut big = ask("roots/list", false);
        big["pad"] = json!(MAX_MESSAGE_BYTES);
        let refused = answer(probe.call(8, "ask", big).await);
        assert_eq!(refused, json!({"code": -32000, "message": "a message over the size limit of 4194304 bytes"}));

        let bare = Client::connect(&listed_url(dir.path(), "bare")).await;
        let refused = answer(bare.call(6, "ask", ask("roots/list", false)).await);
        assert_eq!(refused, json!({"code": -32601, "message": "no client of the standby MCP bridge declared roots"}));

        // A client's roots/list_changed reaches a server told of roots only.
        let changed = json!({"jsonrpc": "2.0", "method": "notifications/roots/list_changed"});
        for client in [&probe, &bare] {
            assert_eq!(client.post(&changed).await.0, 202);
            assert_eq!(client.call(7, "env", json!({"name": "NOPE"})).await, Ok(String::new()));
        }
        assert!(log_of(dir.path(), "probe").contains("notification notifications/roots/list_changed"));
        assert!(!log_of(dir.path(), "bare").contains("notification notifications/roots/list_changed"));
        supervisor.stop().await;
    }

    #[tokio::test]
    async fn a_servers_request_does_not_outlive_its_process_or_its_session() {
        let dir = tempfile::tempdir().expect("a workspace");
        let mut supervisor = McpSupervisor::start(&[stdio_server("probe")], dir.path(), TIMEOUT).await.expect("starts");
        let url = listed_url(dir.path(), "probe");
        let client = Client::connect_declaring(&url, json!({"elicitation": {}})).await;
        let mut events = Events::open(&client).await;

        let asking = spawn_call(&client, 2, "ask", ask("elicitation/create", false));
        let before = events.next().await;
        assert_eq!(before["method"], "elicitation/create", "{before}");
        let failures = supervisor.restart(&BTreeMap::new()).await;
        assert!(failures.is_empty(), "{failures:?}");
        let error = asking.await.expect("the call task").expect_err("its process is gone");
        assert!(error.contains("stopped before it answered"), "{error}");
        let cancelled = events.next().await;
        assert_eq!(
            (cancelled["method"].clone(), cancelled["params"]["requestId"].clone()),
            (json!("notifications/cancelled"), before["id"].clone()),
            "the client is told: {cancelled}"
        );

        // The new process asks again under its own id "q0"; the late answer
        // to the old request reaches nobody.
        let late = json!({"jsonrpc": "2.0", "id": before["id"], "result": {"action": "decline"}});
        assert_eq!(client.post(&late).await.0, 202);
        let asking = spawn_call(&client, 3, "ask", ask("elicitation/create", false));
        let again = events.next().await;
        assert_ne!(again["id"], before["id"], "a new bridge id: {again}");
        let answer = json!({"jsonrpc": "2.0", "id": again["id"], "result": {"action": "accept"}});
        assert_eq!(client.post(&answer).await.0, 202);
        assert_eq!(asking.await.expect("the call task"), Ok(r#"{"action": "accept"}"#.to_owned()));
        assert!(!log_of(dir.path(), "probe").contains("answer to no request"), "the late answer was ignored");

        // A session that ends leaves no request of the server waiting.
        let asking = spawn_call(&client, 4, "ask", ask("elicitation/create", false));
        assert_eq!(events.next().await["method"], "elicitation/create");
        assert_eq!(client.request(reqwest::Method::DELETE).send().await.expect("an answer").status(), 200);
        let answer: Value =
            serde_json::from_str(&asking.await.expect("the call task").expect("answered")).expect("JSON");
        assert_eq!(answer, json!({"code": -32000, "message": "the client's session ended before it answered"}));

        // So does one ended by the bound on sessions (the least recently
        // used goes when a 65th begins).
        let oldest = Client::connect_declaring(&url, json!({"elicitation": {}})).await;
        let mut oldest_events = Events::open(&oldest).await;
        let asking = spawn_call(&oldest, 5, "ask", ask("elicitation/create", false));
        assert_eq!(oldest_events.next().await["method"], "elicitation/create");
        for _ in 0..64 {
            Client::connect(&url).await;
        }
        let answer: Value =
            serde_json::from_str(&asking.await.expect("the call task").expect("answered")).expect("JSON");
        assert_eq!(answer, json!({"code": -32000, "message": "the client's session ended before it answered"}));
        supervisor.stop().await;
    }

    #[test]
    fn the_workspace_root_is_a_file_uri() {
        assert_eq!(file_uri(Path::new("/work/my repo/ü")), "file:///work/my%20repo/%C3%BC");
        assert_eq!(workspace_root(Path::new("/srv/app")), json!({"uri": "file:///srv/app", "name": "app"}));
    }

    #[tokio::test]
    async fn an_http_server_needs_a_url() {
        let dir = tempfile::tempdir().expect("a workspace");
        let mut spec = server("web", &["sleep", "300"]);
        spec.transport = Some(McpTransport::Http);
        let error = McpSupervisor::start(&[spec.clone()], dir.path(), TIMEOUT).await.expect_err("no url");
        assert_eq!(error.to_string(), "MCP server \"web\" has transport \"http\" but no url");
        spec.url = Some("ftp://127.0.0.1/mcp".to_owned());
        let error = McpSupervisor::start(&[spec], dir.path(), TIMEOUT).await.expect_err("not http");
        assert_eq!(
            error.to_string(),
            "MCP server \"web\": url \"ftp://127.0.0.1/mcp\" is not an http:// or https:// URL"
        );
    }
}
