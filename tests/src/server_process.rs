//! The real `standby-server serve` as a child process, and its user API:
//! for tests of the whole system (the control plane launching real agents,
//! or handing credentials to a load generator).
//!
//! Every process a server causes carries a mark in its environment (the
//! local provider passes the server's environment on to its agents, and
//! agents to their children), so a test can find, check and kill all of
//! them, including after the server itself was killed.

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use standby_protocol::{PROTOCOL_HEADER, PROTOCOL_VERSION, SOCKET_PATH};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_tungstenite::tungstenite::{self, client::IntoClientRequest as _};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::harness::{describe, process_alive, standby_bin};

/// The user API key every test server is started with.
pub const API_KEY: &str = "e2e-api-key";
/// The environment variable that marks the processes of one test's servers.
pub const MARK: &str = "E2E_SERVER_MARK";
/// Bound on a server's start.
const START: Duration = Duration::from_secs(60);

/// `standby-server` next to `standby` (`$STANDBY_SERVER_BIN` overrides).
pub fn server_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("STANDBY_SERVER_BIN") {
        return PathBuf::from(path);
    }
    let bin = standby_bin().with_file_name("standby-server");
    assert!(bin.is_file(), "{} is missing: run `cargo build --bins` first", bin.display());
    bin
}

/// `standby-server keygen path`: the secret key replicas on one
/// PostgreSQL store share, made before any of them starts (they never
/// generate one).
pub fn keygen(path: &Path) {
    let output = std::process::Command::new(server_bin()).arg("keygen").arg(path).output().expect("run keygen");
    assert!(output.status.success(), "keygen {}: {}", path.display(), String::from_utf8_lossy(&output.stderr));
}

/// Live processes whose environment holds `MARK=mark`.
pub fn marked(mark: &str) -> Vec<i32> {
    let needle = format!("{MARK}={mark}");
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| process_alive(*pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|entry| entry == needle.as_bytes()))
        })
        .collect()
}

/// A variable of a live process's initial environment.
pub fn environ_var(pid: i32, name: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{name}=");
    environ
        .split(|b| *b == 0)
        .find_map(|entry| entry.strip_prefix(prefix.as_bytes()))
        .map(|value| String::from_utf8_lossy(value).into_owned())
}

/// How to start a server: `serve` with the data directory, the API key
/// and the mark; everything else is the test's.
#[derive(Debug, Clone)]
pub struct ServerBuilder {
    data: PathBuf,
    log: PathBuf,
    mark: String,
    server_bin: PathBuf,
    /// `--agent-bin`; `None` for a server launching no agents (the spool
    /// provider of the benchmarks), or one given it among its arguments.
    agent_bin: Option<PathBuf>,
    listen: Option<SocketAddr>,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

/// A free port on 127.0.0.1 (bound, then released for the server to take).
pub fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("a bound listener has an address")
}

/// A free port on every address, below the kernel's ephemeral range: a
/// server restarted on it (same port, so that its agents find it again)
/// cannot find it taken meanwhile as some connection's source port, as a
/// port from [`free_addr`] can be on a busy machine.
pub fn free_fixed_port() -> u16 {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let low: u16 = range.split_whitespace().next().and_then(|low| low.parse().ok()).unwrap_or(32768);
    let seed = u64::from(std::process::id()) ^ std::time::UNIX_EPOCH.elapsed().map_or(0, |d| d.as_nanos() as u64);
    let span = u64::from(low.saturating_sub(10_000).max(1));
    (0..span)
        .map(|step| 10_000 + ((seed.wrapping_mul(2_654_435_761).wrapping_add(step * 7919)) % span) as u16)
        .find(|port| std::net::TcpListener::bind(("0.0.0.0", *port)).is_ok())
        .expect("a free port below the ephemeral range")
}

/// Waits (up to `timeout`) until `addr` can be bound again: after a
/// crash, the kernel may hold the port a moment longer while connections
/// to frozen or cut-off peers (paused containers) close. `false` when it
/// stayed taken.
pub async fn wait_bindable(addr: SocketAddr, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let socket = tokio::net::TcpSocket::new_v4().and_then(|socket| {
            socket.set_reuseaddr(true)?;
            socket.bind(addr)
        });
        if socket.is_ok() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl ServerBuilder {
    /// A server on `data` (kept across restarts), its stderr appended to
    /// `log`, its processes marked with `mark`.
    pub fn new(data: &Path, log: &Path, mark: &str) -> Self {
        Self { agent_bin: Some(standby_bin()), ..Self::of(&server_bin(), data, log, mark) }
    }

    /// [`ServerBuilder::new`] of the binary `server_bin` (the benchmarks
    /// measure a given build) and without `--agent-bin`.
    pub fn of(server_bin: &Path, data: &Path, log: &Path, mark: &str) -> Self {
        Self {
            data: data.to_owned(),
            log: log.to_owned(),
            mark: mark.to_owned(),
            server_bin: server_bin.to_owned(),
            agent_bin: None,
            listen: None,
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// Keeps each agent's output in `dir/<sandbox id>.log`: the local
    /// provider deletes a retired sandbox's directory, `agent.log` with it.
    /// The agent is started through a wrapper script (written to `dir`)
    /// that sends its output there and then execs the real `standby`.
    pub fn keep_agent_logs(mut self, dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap_or_else(|error| panic!("create {}: {error}", dir.display()));
        let wrapper = dir.join("standby-wrapper.sh");
        let script =
            "#!/bin/sh\nexec >>\"$E2E_AGENT_LOG_DIR/$LOCAL_SANDBOX_ID.log\" 2>&1\nexec \"$E2E_REAL_AGENT\" \"$@\"\n";
        std::fs::write(&wrapper, script).expect("write the agent wrapper");
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))
            .expect("make the wrapper executable");
        self.env.push(("E2E_AGENT_LOG_DIR".into(), dir.display().to_string()));
        self.env.push(("E2E_REAL_AGENT".into(), standby_bin().display().to_string()));
        self.agent_bin = Some(wrapper);
        self
    }

    /// Listens on `addr` (every start, so a restart keeps the port)
    /// instead of a free port of 127.0.0.1; the test calls it on loopback.
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = Some(addr);
        self
    }

    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.to_owned());
        self
    }

    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|arg| (*arg).to_owned()));
        self
    }

    /// `defaults`, each flag and its value, for every flag `given` does not
    /// name; then `given`.
    pub fn args_over_defaults(mut self, defaults: &[(&str, &str)], given: &[&str]) -> Self {
        for (flag, value) in defaults {
            if !given.contains(flag) {
                self = self.args(&[flag, value]);
            }
        }
        self.args(given)
    }

    /// The same server with `flag`'s value replaced by `value` (a restart
    /// with another setting).
    pub fn with_arg(mut self, flag: &str, value: &str) -> Self {
        match self.args.iter().position(|arg| arg == flag) {
            Some(at) if at + 1 < self.args.len() => self.args[at + 1] = value.to_owned(),
            _ => self.args.extend([flag.to_owned(), value.to_owned()]),
        }
        self
    }

    /// The cluster secret of a replicated deployment (a PostgreSQL store):
    /// `path` is written (mode 0600) when missing, so every replica given
    /// the same path shares it. Passed through its variable, as a
    /// supervisor would.
    pub fn cluster_secret(self, path: &Path) -> Self {
        if !path.exists() {
            std::fs::write(path, format!("{:064x}\n", rand_seed()))
                .unwrap_or_else(|error| panic!("write {}: {error}", path.display()));
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod the cluster secret");
        }
        self.env("STANDBY_SERVER_CLUSTER_SECRET_FILE", &path.display().to_string())
    }

    /// An environment variable of the server (and so of its agents).
    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Starts the server on a free port of 127.0.0.1 and waits for its
    /// "listening" line.
    pub async fn start(&self) -> ServerProcess {
        self.try_start().await.unwrap_or_else(|problem| panic!("{problem}"))
    }

    /// [`ServerBuilder::start`] that reports a server that did not start
    /// instead of panicking: a benchmark records it and goes on.
    pub async fn try_start(&self) -> Result<ServerProcess, String> {
        let bind = self.listen.unwrap_or_else(free_addr);
        let addr = if bind.ip().is_unspecified() { SocketAddr::from(([127, 0, 0, 1], bind.port())) } else { bind };
        let mut command = tokio::process::Command::new(&self.server_bin);
        for (name, _) in std::env::vars_os() {
            if let Some(name) = name.to_str()
                && (name.starts_with("STANDBY_") || name == "RUST_LOG")
            {
                command.env_remove(name);
            }
        }
        if let Some(parent) = self.log.parent() {
            std::fs::create_dir_all(parent).map_err(|error| format!("create {}: {error}", parent.display()))?;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|error| format!("open {}: {error}", self.log.display()))?;
        // The key from a file, as operators are told to pass it: a command
        // line is readable by every local user.
        let key_file = self.data.with_extension("api-key");
        std::fs::write(&key_file, format!("{API_KEY}\n"))
            .and_then(|()| std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)))
            .map_err(|error| format!("write {}: {error}", key_file.display()))?;
        command
            .arg("serve")
            .args(["--listen", &bind.to_string(), "--api-key-file"])
            .arg(&key_file)
            .args(self.agent_bin.iter().flat_map(|bin| [OsStr::new("--agent-bin"), bin.as_os_str()]))
            .arg("--data-dir")
            .arg(&self.data)
            .args(&self.args)
            .envs(self.env.iter().map(|(name, value)| (name, value)))
            .env(MARK, &self.mark)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        let mut child = command.spawn().map_err(|error| format!("start {}: {error}", self.server_bin.display()))?;
        let stdout = child.stdout.take().ok_or("no piped stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let tail = || tail(&self.log, 40);
        let line = tokio::time::timeout(START, lines.next_line())
            .await
            .map_err(|_| format!("standby-server did not start within {START:?}\n{}", tail()))?
            .map_err(|error| format!("read the server's stdout: {error}"))?
            .ok_or_else(|| format!("standby-server exited\n{}", tail()))?;
        let url = line
            .strip_prefix("standby-server listening on ")
            .ok_or_else(|| format!("not the listening line: {line}"))?
            .trim()
            .to_owned();
        // Nothing else is printed on stdout; keep reading so it never blocks.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let _ = rustls::crypto::ring::default_provider().install_default();
        Ok(ServerProcess {
            child,
            addr,
            public_url: url,
            mark: self.mark.clone(),
            data: self.data.clone(),
            log: self.log.clone(),
            http: reqwest::Client::new(),
        })
    }
}

/// A test value for a cluster secret: unpredictable enough for a test.
fn rand_seed() -> u128 {
    use std::hash::{BuildHasher as _, RandomState};
    let state = RandomState::new();
    (u128::from(state.hash_one(1u8)) << 64) | u128::from(state.hash_one(2u8))
}

/// The last `lines` lines of a file, for failure messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A control WebSocket to the server.
pub type ControlSocket = WebSocketStream<MaybeTlsStream<tokio::net::TcpStream>>;

/// The end of a server's log and of every present sandbox's `agent.log`.
fn logs(log: &Path, data: &Path) -> String {
    let mut text = tail(log, 60);
    for entry in std::fs::read_dir(data.join("sandboxes")).into_iter().flatten().flatten() {
        let agent_log = entry.path().join("agent.log");
        if agent_log.is_file() {
            text.push_str(&format!("\n--- {} ---\n{}", entry.path().display(), tail(&agent_log, 30)));
        }
    }
    text
}

/// A running `standby-server`. Dropping it kills it and every process
/// carrying its mark.
#[derive(Debug)]
pub struct ServerProcess {
    child: tokio::process::Child,
    addr: SocketAddr,
    public_url: String,
    mark: String,
    data: PathBuf,
    log: PathBuf,
    http: reqwest::Client,
}

impl ServerProcess {
    /// Its data directory.
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<address>`: where the test calls the API, directly.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The base URL it gives agents (`--public-url` when given).
    pub fn public_url(&self) -> &str {
        &self.public_url
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The mark every process it caused carries.
    pub fn mark(&self) -> &str {
        &self.mark
    }

    /// A local sandbox's directory (its workspace, `agent.log`, settings).
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.data.join("sandboxes").join(id)
    }

    /// For failure messages: the end of the server's log and of every
    /// present sandbox's `agent.log`.
    pub fn logs(&self) -> String {
        logs(&self.log, &self.data)
    }

    pub fn pid(&self) -> i32 {
        self.child.id().and_then(|pid| i32::try_from(pid).ok()).expect("the server runs")
    }

    /// One call to the server's API: the status and the body (JSON, or a string when it is not JSON).
    /// `None` when the server did not answer (it is down).
    pub async fn try_call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: Option<&str>,
        body: Option<&Value>,
    ) -> Option<(u16, Value)> {
        let mut request = self.http.request(method, format!("{}{path}", self.url())).timeout(Duration::from_secs(30));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.ok()?;
        let status = response.status().as_u16();
        let text = response.text().await.ok()?;
        Some((status, serde_json::from_str(&text).unwrap_or(Value::String(text))))
    }

    /// [`ServerProcess::try_call`] that must be answered.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: Option<&str>,
        body: Option<&Value>,
    ) -> (u16, Value) {
        let method_name = method.to_string();
        self.try_call(method, path, key, body)
            .await
            .unwrap_or_else(|| panic!("{method_name} {path}: no answer\n{}", tail(&self.log, 40)))
    }

    /// A `GET` with the API key that must answer `200`.
    pub async fn get(&self, path: &str) -> Value {
        let (status, body) = self.call(reqwest::Method::GET, path, Some(API_KEY), None).await;
        assert_eq!(status, 200, "GET {path}: {body}");
        body
    }

    /// Submits a run; its id.
    pub async fn submit(&self, body: &Value) -> String {
        let (status, created) = self.call(reqwest::Method::POST, "/v1/runs", Some(API_KEY), Some(body)).await;
        assert_eq!(status, 201, "{created}");
        created["id"].as_str().expect("a run id").to_owned()
    }

    /// Every run, following the pages of `GET /v1/runs`.
    pub async fn runs(&self) -> Vec<Value> {
        self.every("/v1/runs", "runs").await
    }

    /// Every item of a paged list (`next_cursor`), `key` naming the items.
    async fn every(&self, path: &str, key: &str) -> Vec<Value> {
        let mut items = Vec::new();
        let mut page = self.get(&format!("{path}?limit=1000")).await;
        loop {
            items.extend(page[key].as_array().cloned().unwrap_or_default());
            let Some(cursor) = page["next_cursor"].as_str() else { return items };
            page = self.get(&format!("{path}?limit=1000&cursor={cursor}")).await;
        }
    }

    pub async fn run(&self, id: &str) -> Value {
        self.get(&format!("/v1/runs/{id}")).await
    }

    /// Every sandbox, following the pages of `GET /v1/sandboxes`.
    pub async fn sandboxes(&self) -> Vec<Value> {
        self.every("/v1/sandboxes", "sandboxes").await
    }

    pub async fn sandbox(&self, id: &str) -> Value {
        self.sandboxes().await.into_iter().find(|s| s["id"] == id).unwrap_or_else(|| panic!("no sandbox {id}"))
    }

    /// Waits until the run is in a final state; the run.
    pub async fn finished(&self, id: &str, timeout: Duration) -> Value {
        self.until("the run to finish", timeout, async || {
            let run = self.run(id).await;
            matches!(run["state"].as_str(), Some("exited" | "failed" | "cancelled")).then_some(run)
        })
        .await
    }

    /// The run's stored log, as bytes.
    pub async fn log(&self, id: &str) -> Vec<u8> {
        let response = self
            .http
            .get(format!("{}/v1/runs/{id}/log", self.url()))
            .bearer_auth(API_KEY)
            .send()
            .await
            .expect("the server answers");
        assert_eq!(response.status().as_u16(), 200, "GET /v1/runs/{id}/log");
        response.bytes().await.expect("a body").to_vec()
    }

    /// Upgrades `/ws` with `token` as an agent would: the socket, or the
    /// refusal's status.
    pub async fn upgrade(&self, token: &str) -> Result<ControlSocket, u16> {
        let mut request = format!("ws://{}{SOCKET_PATH}", self.addr).into_client_request().expect("a request");
        request.headers_mut().insert("Authorization", format!("Bearer {token}").parse().expect("a header"));
        request.headers_mut().insert(PROTOCOL_HEADER, PROTOCOL_VERSION.parse().expect("a header"));
        match tokio_tungstenite::connect_async(request).await {
            Ok((socket, _)) => Ok(socket),
            Err(tungstenite::Error::Http(response)) => Err(response.status().as_u16()),
            Err(error) => panic!("the upgrade failed: {error}"),
        }
    }

    /// [`ServerProcess::upgrade`]'s status: 101 when admitted.
    pub async fn upgrade_status(&self, token: &str) -> u16 {
        self.upgrade(token).await.map_or_else(|status| status, |_| 101)
    }

    /// Polls until `check` gives a value (a cross-process condition raises
    /// no event here); panics with the server's log on timeout.
    pub async fn until<T>(&self, what: &str, timeout: Duration, check: impl AsyncFnMut() -> Option<T>) -> T {
        poll(what, timeout, Duration::from_millis(50), check, || self.logs()).await
    }

    /// SIGKILL, without waiting for anything but the process to be gone:
    /// a crash. Usable while other tasks still hold the server.
    pub async fn crash(&self) {
        let pid = self.pid();
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        let deadline = tokio::time::Instant::now() + START;
        while process_alive(pid) {
            assert!(tokio::time::Instant::now() < deadline, "the server survived SIGKILL");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits (up to `timeout`) for the server to exit on its own; its exit
    /// status.
    pub async fn exited(mut self, timeout: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("the server did not exit within {timeout:?}\n{}", tail(&self.log, 40)))
            .expect("wait for the server")
    }

    /// Sends `signal` and waits for the server to exit; its exit status.
    pub async fn stop(self, signal: Signal) -> std::process::ExitStatus {
        self.try_stop(signal, START).await.unwrap_or_else(|problem| panic!("{problem}"))
    }

    /// Sends `signal` and waits up to `grace` for the server to exit; one
    /// that does not is killed and reported (a benchmark goes on).
    pub async fn try_stop(mut self, signal: Signal, grace: Duration) -> Result<std::process::ExitStatus, String> {
        if let Some(pid) = self.child.id().and_then(|pid| i32::try_from(pid).ok()) {
            let _ = kill(Pid::from_raw(pid), signal);
        }
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => status.map_err(|error| format!("wait for the server: {error}")),
            Err(_) => {
                let _ = self.child.kill().await;
                Err(format!("the server did not exit within {grace:?} on {signal}: killed\n{}", tail(&self.log, 40)))
            }
        }
    }

    /// Sends `signal`, waits for the server to exit (with 0 on SIGTERM) and
    /// then until no process it caused is left.
    pub async fn stop_leaving_nothing(self, signal: Signal) {
        let (mark, log, data) = (self.mark.clone(), self.log.clone(), self.data.clone());
        let status = self.stop(signal).await;
        if signal == Signal::SIGTERM {
            assert!(status.success(), "standby-server exited {status} on SIGTERM\n{}", logs(&log, &data));
        }
        if let Err(left) = Self::wait_no_marked(&mark, Duration::from_secs(30)).await {
            panic!("processes left after the server exited: {}\n{}", describe(&left), logs(&log, &data));
        }
    }

    /// Waits until no process carrying the server's mark is left.
    pub async fn wait_no_marked(mark: &str, timeout: Duration) -> Result<(), Vec<i32>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = marked(mark);
            if left.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(left);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for ServerProcess {
    /// A server still running when dropped (a test that failed) is killed
    /// with everything it caused; one that was stopped is left to the test,
    /// which checks what it left behind.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait()
            && let Some(pid) = self.child.id()
        {
            let _ = kill(Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX)), Signal::SIGKILL);
            for pid in marked(&self.mark) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
    }
}

/// Polls `check` every `every` until it gives a value; after `timeout`,
/// panics naming `what`, with `context()` (a log) for the failure.
pub async fn poll<T>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut check: impl AsyncFnMut() -> Option<T>,
    context: impl Fn() -> String,
) -> T {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}\n{}", context());
        tokio::time::sleep(every).await;
    }
}
