//! Running the real `standby` binary, and the fixtures it works on: real
//! processes, real `file://` git repositories in temporary directories.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::os::unix::process::ExitStatusExt;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures::FutureExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use standby_protocol::{EventKind, ExitCode};
use tempfile::TempDir;

/// The agent's configuration variables, as the contract names them.
pub use standby_protocol::vars;

/// Name of the variable that marks every process descended from one agent.
/// Children inherit the agent's environment (minus its credentials), so the
/// mark finds them even after they were reparented away from the agent.
/// It deliberately does not start with `STANDBY_`.
const MARK: &str = "E2E_AGENT_MARK";

/// The fake MCP server of every test: a stdio server speaking JSON-RPC by
/// hand (so the agent's own tests can make it misbehave), run with
/// `python3`; its modes and tools are described in the file.
pub const FAKE_MCP_SERVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../agent/src/mcp/fake_server.py");

/// The variable naming the Python interpreter that has the official MCP
/// SDK (`scripts/mcp-py` makes it and prints its path; `.ci/run` and
/// `scripts/test` export it).
pub const MCP_PYTHON_VAR: &str = "STANDBY_TEST_MCP_PYTHON";

/// The MCP server and client written with the official Python SDK that the
/// bridge's SDK tests run (`tests/mcp_py/`).
pub const MCP_PY_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/mcp_py");

/// The Python of `$STANDBY_TEST_MCP_PYTHON`, or `None` (after a loud
/// message) where it is not set up outside CI. Panics under `CI=true`,
/// where `.ci/run` installs it.
pub fn mcp_python(test: &str) -> Option<PathBuf> {
    let python = std::env::var_os(MCP_PYTHON_VAR).map(PathBuf::from).filter(|path| path.is_file());
    if python.is_none() {
        let why = format!("{MCP_PYTHON_VAR} does not name a Python interpreter");
        if std::env::var("CI").is_ok_and(|ci| ci == "true") {
            panic!("{test} needs the official MCP Python SDK, which CI installs (.ci/run, scripts/mcp-py): {why}");
        }
        eprintln!(
            "\n*** SKIPPED {test}: it needs the official MCP Python SDK and {why}.\n*** Run `export \
             {MCP_PYTHON_VAR}=\"$(scripts/mcp-py)\"` to run it; under CI=true it fails instead.\n"
        );
    }
    python
}

/// A program of a Debian package a test needs: `name` on `PATH` (or
/// `/usr/bin`, where Debian puts it). `None`, after a loud line, when it is
/// missing and the test is to be skipped; under `CI=true`, where `.ci/run`
/// installs `package`, a missing one fails the test instead.
pub fn system_tool(name: &str, package: &str, test: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file());
    if found.is_none() {
        let why = format!("no `{name}` on PATH (Debian: apt-get install {package})");
        assert!(!std::env::var("CI").is_ok_and(|value| value == "true"), "{test}: {why} (CI=true: it must run)");
        eprintln!("*** {test}: SKIPPED: {why} ***");
    }
    found
}

/// The `standby` binary under test: `$STANDBY_BIN`, else `standby` next to
/// the test executable's `deps/` directory (`target/<profile>/standby`).
pub fn standby_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("STANDBY_BIN") {
        let path = PathBuf::from(path);
        assert!(path.is_file(), "STANDBY_BIN={} is not a file", path.display());
        return path;
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile_dir = exe
        .parent()
        .filter(|dir| dir.ends_with("deps"))
        .and_then(Path::parent)
        .or_else(|| exe.parent())
        .expect("the test executable lives in a directory");
    let bin = profile_dir.join("standby");
    assert!(
        bin.is_file(),
        "the standby binary is missing at {}: run `cargo build --bins` first (or set STANDBY_BIN)",
        bin.display()
    );
    bin
}

/// Configures one agent run through the contract's environment variables
/// only (plus any extra variables and arguments).
#[derive(Debug, Clone)]
pub struct AgentBuilder {
    env: BTreeMap<String, String>,
    removed: BTreeSet<String>,
    args: Vec<String>,
    workspace: Option<PathBuf>,
    /// `(uid, gid)` to run the agent as, when not the test's own.
    user: Option<(u32, u32)>,
}

impl AgentBuilder {
    /// An agent pointed at `server_url` with the standby credential
    /// `token`, logging at `debug` so that tests that grep the output for
    /// secrets see as much as possible.
    pub fn new(server_url: &str, token: &str) -> Self {
        Self::bare().env(vars::SERVER_URL, server_url).env(vars::TOKEN, token).env(vars::LOG, "debug")
    }

    /// No configuration at all, for tests of configuration errors.
    pub fn bare() -> Self {
        Self { env: BTreeMap::new(), removed: BTreeSet::new(), args: Vec::new(), workspace: None, user: None }
    }

    /// The workspace directory; a fresh temporary one when never set.
    pub fn workspace(mut self, path: &Path) -> Self {
        self.workspace = Some(path.to_owned());
        self
    }

    pub fn spec_file(self, path: &Path) -> Self {
        self.env(vars::SPEC, &path.display().to_string())
    }

    pub fn heartbeat_interval(self, interval: &str) -> Self {
        self.env(vars::HEARTBEAT_INTERVAL, interval)
    }

    pub fn deadline(self, deadline: &str) -> Self {
        self.env(vars::DEADLINE, deadline)
    }

    pub fn confirm_timeout(self, timeout: &str) -> Self {
        self.env(vars::CONFIRM_TIMEOUT, timeout)
    }

    pub fn install_timeout(self, timeout: &str) -> Self {
        self.env(vars::INSTALL_TIMEOUT, timeout)
    }

    pub fn log_filter(self, filter: &str) -> Self {
        self.env(vars::LOG, filter)
    }

    pub fn log_format(self, format: &str) -> Self {
        self.env(vars::LOG_FORMAT, format)
    }

    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.removed.remove(name);
        self.env.insert(name.to_owned(), value.to_owned());
        self
    }

    /// Unsets a variable, including one this builder set.
    pub fn env_remove(mut self, name: &str) -> Self {
        self.env.remove(name);
        self.removed.insert(name.to_owned());
        self
    }

    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.to_owned());
        self
    }

    /// Runs the agent as `uid`/`gid` (with no supplementary groups). Tests
    /// run as root, and root passes checks an ordinary user meets (reading
    /// another process's `/proc` files); an unprivileged agent makes them
    /// meaningful. The workspace (a fresh one, or the one given) is handed
    /// to that user; everything else the agent reads (a spec file, a token
    /// file) must be readable by it.
    pub fn user(mut self, uid: u32, gid: u32) -> Self {
        self.user = Some((uid, gid));
        self
    }

    /// Starts the agent in its own process group, stdout and stderr going
    /// to files in a temporary directory.
    pub fn spawn(self) -> AgentProcess {
        let logs = TempDir::with_prefix("standby-agent-logs-").expect("create a log directory");
        let (workspace, workspace_dir) = match self.workspace {
            Some(path) => (path, None),
            None => {
                let dir = TempDir::with_prefix("standby-workspace-").expect("create a workspace");
                (dir.path().to_owned(), Some(dir))
            }
        };
        if let Some((uid, gid)) = self.user {
            let (uid, gid) = (Some(nix::unistd::Uid::from_raw(uid)), Some(nix::unistd::Gid::from_raw(gid)));
            nix::unistd::chown(&workspace, uid, gid).expect("hand the workspace to the agent's user");
        }
        let mark = format!("{:016x}", RandomState::new().hash_one(std::process::id()));
        let stdout = File::create(logs.path().join("stdout")).expect("create the stdout file");
        let stderr = File::create(logs.path().join("stderr")).expect("create the stderr file");
        let mut command = tokio::process::Command::new(standby_bin());
        // Nothing from the test's own environment may configure the agent.
        for (name, _) in std::env::vars_os() {
            if let Some(name) = name.to_str()
                && (name.starts_with("STANDBY_") || name == "RUST_LOG")
            {
                command.env_remove(name);
            }
        }
        if !self.removed.contains(vars::WORKSPACE) {
            command.env(vars::WORKSPACE, &workspace);
        }
        command
            .envs(&self.env)
            .env(MARK, &mark)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0);
        for name in &self.removed {
            command.env_remove(name);
        }
        if let Some((uid, gid)) = self.user {
            command.uid(uid).gid(gid);
        }
        let child = command.spawn().expect("spawn the standby binary");
        let pid = child.id().and_then(|pid| i32::try_from(pid).ok()).expect("a running child has a pid");
        AgentProcess {
            child,
            pid,
            mark,
            logs,
            workspace,
            _workspace_dir: workspace_dir,
            exit: None,
            seen: Mutex::new(BTreeSet::new()),
        }
    }
}

/// A running (or finished) agent. Dropping it terminates the agent and
/// every process it left behind.
#[derive(Debug)]
pub struct AgentProcess {
    child: tokio::process::Child,
    pid: i32,
    mark: String,
    logs: TempDir,
    workspace: PathBuf,
    _workspace_dir: Option<TempDir>,
    exit: Option<i32>,
    /// Every descendant ever observed, to check later that it is gone.
    seen: Mutex<BTreeSet<i32>>,
}

/// Exit code, or `128 + n` for death by signal `n`, as a shell reports it.
fn exit_code(status: ExitStatus) -> i32 {
    status.code().or_else(|| status.signal().map(|signal| 128 + signal)).unwrap_or(-1)
}

impl AgentProcess {
    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn workspace(&self) -> &Path {
        &self.workspace
    }

    pub fn stdout_path(&self) -> PathBuf {
        self.logs.path().join("stdout")
    }

    pub fn stderr_path(&self) -> PathBuf {
        self.logs.path().join("stderr")
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(self.stdout_path()).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.stderr_path()).unwrap_or_default()
    }

    /// Everything the agent wrote, stdout then stderr.
    pub fn output(&self) -> String {
        format!("{}{}", self.stdout(), self.stderr())
    }

    /// The last lines of both streams, for failure messages.
    pub fn output_tail(&self) -> String {
        let tail = |text: String| {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(60)..].join("\n")
        };
        format!("--- stdout (tail) ---\n{}\n--- stderr (tail) ---\n{}", tail(self.stdout()), tail(self.stderr()))
    }

    /// Panics if any of `values` (credentials, secrets) appears in the
    /// agent's output.
    pub fn assert_output_lacks(&self, values: &[&str]) {
        let output = self.output();
        for value in values {
            assert!(!output.contains(value), "the agent's output contains a secret value ({} bytes long)", value.len());
        }
    }

    /// Waits for the agent to exit; its code (`128 + n` for signal `n`).
    /// Panics with the tail of its output on timeout.
    pub async fn wait_exit(&mut self, timeout: Duration) -> i32 {
        if let Some(code) = self.exit {
            return code;
        }
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => {
                let code = exit_code(status.expect("wait for the agent"));
                self.exit = Some(code);
                code
            }
            Err(_) => panic!("the agent did not exit within {timeout:?}\n{}", self.output_tail()),
        }
    }

    /// Runs `wait` (typically a server `wait_*`) while the agent runs.
    /// Panics at once, with the agent's output, if the agent exits first or
    /// if `wait` panics (a timeout), so a failure shows why the agent did
    /// not do what was awaited.
    pub async fn watch<F: Future>(&mut self, wait: F) -> F::Output {
        let running = self.exit.is_none();
        let outcome = tokio::select! {
            // Checked first: what the agent did just before exiting counts.
            biased;
            outcome = AssertUnwindSafe(wait).catch_unwind() => outcome,
            status = self.child.wait(), if running => {
                let code = exit_code(status.expect("wait for the agent"));
                self.exit = Some(code);
                panic!("the agent exited with {code} while the test was waiting\n{}", self.output_tail());
            }
        };
        outcome.unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a wait panicked");
            panic!("{message}\n{}", self.output_tail())
        })
    }

    /// The exit code if the agent has exited.
    pub fn try_exit(&mut self) -> Option<i32> {
        if self.exit.is_none()
            && let Ok(Some(status)) = self.child.try_wait()
        {
            self.exit = Some(exit_code(status));
        }
        self.exit
    }

    pub fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.pid), signal).expect("signal the agent");
    }

    /// Polls the output until it contains `needle` (no event exists for a
    /// line written to a file).
    pub async fn wait_for_output(&self, needle: &str, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.output().contains(needle) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the agent's output did not contain {needle:?} within {timeout:?}\n{}",
                self.output_tail()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// The agent's live descendants now (remembered for
    /// [`AgentProcess::leftovers`]).
    pub fn descendants(&self) -> Vec<i32> {
        let found = descendants(self.pid);
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).extend(&found);
        found
    }

    /// Live processes other than the agent itself that descend from it:
    /// those that carry its mark in their environment, and every descendant
    /// seen by [`AgentProcess::descendants`] that is still alive.
    pub fn leftovers(&self) -> Vec<i32> {
        let mut left: BTreeSet<i32> = marked_processes(MARK, &self.mark).into_iter().collect();
        left.extend(self.seen.lock().unwrap_or_else(PoisonError::into_inner).iter().filter(|pid| process_alive(**pid)));
        left.remove(&self.pid);
        left.into_iter().collect()
    }

    /// Waits until no process of this agent is left (polling: the exit of
    /// an unrelated process raises no event here). Panics naming them.
    pub async fn wait_no_leftovers(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = self.leftovers();
            if left.is_empty() {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "processes of the agent still running after {timeout:?}: {}\n{}",
                describe(&left),
                self.output_tail()
            );
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if self.try_exit().is_none() {
            self.descendants();
            let _ = kill(Pid::from_raw(self.pid), Signal::SIGTERM);
            for _ in 0..250 {
                if self.try_exit().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if self.try_exit().is_none() {
                let _ = nix::sys::signal::killpg(Pid::from_raw(self.pid), Signal::SIGKILL);
                let _ = self.child.start_kill();
            }
        }
        for pid in self.leftovers() {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

const POLL: Duration = Duration::from_millis(20);

/// One line of `/proc/<pid>/stat`.
#[derive(Debug, Clone, Copy)]
struct ProcStat {
    pid: i32,
    state: char,
    ppid: i32,
    pgrp: i32,
}

fn proc_stat(pid: i32) -> Option<ProcStat> {
    proc_stat_at(&format!("/proc/{pid}/stat"), pid)
}

fn proc_stat_at(path: &str, pid: i32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(path).ok()?;
    // The command name is in parentheses and may contain anything.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some(ProcStat { pid, state, ppid, pgrp })
}

fn all_processes() -> Vec<ProcStat> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok()).filter_map(proc_stat).collect()
}

/// Whether `pid` is a live process: one of its threads has not exited. A
/// zombie counts as gone (it runs nothing, and its reaper may be a
/// container init that never reaps). Its main thread turns zombie before
/// the other threads end, and the process's files (a listening socket)
/// are released only with the last one: so every thread is looked at.
pub fn process_alive(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.filter_map(|task| task.ok()?.file_name().to_str()?.parse::<i32>().ok()).any(|tid| {
        proc_stat_at(&format!("/proc/{pid}/task/{tid}/stat"), tid).is_some_and(|stat| !matches!(stat.state, 'Z' | 'X'))
    })
}

/// Live members of process group `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    all_processes()
        .into_iter()
        .filter(|stat| stat.pgrp == pgid && !matches!(stat.state, 'Z' | 'X'))
        .map(|stat| stat.pid)
        .collect()
}

/// Live descendants of `pid`, found through parent links.
pub fn descendants(pid: i32) -> Vec<i32> {
    let table = all_processes();
    let mut found = Vec::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for stat in table.iter().filter(|stat| stat.ppid == parent) {
            frontier.push(stat.pid);
            if !matches!(stat.state, 'Z' | 'X') {
                found.push(stat.pid);
            }
        }
    }
    found
}

/// Live processes whose environment holds `name=value`.
fn marked_processes(name: &str, value: &str) -> Vec<i32> {
    let needle = format!("{name}={value}");
    all_processes()
        .into_iter()
        .filter(|stat| !matches!(stat.state, 'Z' | 'X'))
        .filter(|stat| {
            std::fs::read(format!("/proc/{}/environ", stat.pid))
                .is_ok_and(|environ| environ.split(|byte| *byte == 0).any(|entry| entry == needle.as_bytes()))
        })
        .map(|stat| stat.pid)
        .collect()
}

/// `pid (command line)` for each process, for failure messages.
pub fn describe(pids: &[i32]) -> String {
    pids.iter()
        .map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            format!("{pid} ({})", cmdline.trim())
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Waits until none of `pids` is alive; panics naming the survivors.
pub async fn wait_processes_gone(pids: &[i32], timeout: Duration) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let alive: Vec<i32> = pids.iter().copied().filter(|pid| process_alive(*pid)).collect();
        if alive.is_empty() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "still running after {timeout:?}: {}", describe(&alive));
        tokio::time::sleep(POLL).await;
    }
}

/// Waits until process group `pgid` has no live member.
pub async fn wait_group_gone(pgid: i32, timeout: Duration) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let members = group_members(pgid);
        if members.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "process group {pgid} still has members after {timeout:?}: {}",
            describe(&members)
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Reads a pid a fixture process wrote (`echo $$ > file`), polling until
/// the file holds one: the process writes it on its own schedule.
pub async fn read_pid_file(path: &Path, timeout: Duration) -> i32 {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(pid) = std::fs::read_to_string(path).ok().and_then(|text| text.trim().parse().ok()) {
            return pid;
        }
        assert!(tokio::time::Instant::now() < deadline, "no pid in {} after {timeout:?}", path.display());
        tokio::time::sleep(POLL).await;
    }
}

/// Spawns an agent on `spec` (written to `spec.json` in `dir`) with a
/// 200 ms heartbeat, after `configure`, and waits until it reports ready.
pub async fn ready_agent(
    server: &crate::TestServer,
    token: &str,
    dir: &Path,
    spec: &impl serde::Serialize,
    configure: impl FnOnce(AgentBuilder) -> AgentBuilder,
) -> AgentProcess {
    let path = dir.join("spec.json");
    write_json(&path, spec);
    let builder = AgentBuilder::new(&server.url(), token).spec_file(&path).heartbeat_interval("200ms");
    let mut agent = configure(builder).spawn();
    agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == standby_protocol::AgentState::Ready)).await;
    agent
}

/// Asserts the agent's exit code, showing the end of its output otherwise.
pub fn assert_exit(agent: &AgentProcess, code: i32, expected: ExitCode, what: &str) {
    assert_eq!(code, i32::from(expected.code()), "{what}: exit {code}, expected {expected}\n{}", agent.output_tail());
}

/// The kinds of the events the test server received for `execution_id`, in order.
pub fn event_kinds(server: &crate::TestServer, execution_id: &str) -> Vec<EventKind> {
    server.events(execution_id).into_iter().map(|event| event.kind).collect()
}

/// Writes `value` as JSON (a spec file, for instance).
pub fn write_json(path: &Path, value: &impl serde::Serialize) {
    std::fs::write(path, serde_json::to_vec_pretty(value).expect("JSON serializes"))
        .unwrap_or_else(|error| panic!("write {}: {error}", path.display()));
}

/// A real git repository in a temporary directory, on branch `main`, with
/// author and committer set through the environment so that no global
/// configuration is read or written.
#[derive(Debug)]
pub struct GitRepo {
    dir: TempDir,
}

impl GitRepo {
    /// A repository whose first commit holds `files` (`(path, content)`).
    pub fn new(files: &[(&str, &str)]) -> Self {
        let repo = Self { dir: TempDir::with_prefix("standby-git-").expect("create a repository directory") };
        repo.git(&["init", "--quiet", "--initial-branch=main"]);
        repo.commit(files);
        repo
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `file://` URL of the repository.
    pub fn url(&self) -> String {
        format!("file://{}", self.dir.path().display())
    }

    /// Writes `files` and commits them (an empty commit when none); the
    /// new commit's SHA.
    pub fn commit(&self, files: &[(&str, &str)]) -> String {
        for (path, content) in files {
            let path = self.dir.path().join(path);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).expect("create the file's directory");
            }
            std::fs::write(&path, content).unwrap_or_else(|error| panic!("write {}: {error}", path.display()));
        }
        self.git(&["add", "--all"]);
        self.git(&["commit", "--quiet", "--allow-empty", "--message", "fixture commit"]);
        self.head()
    }

    /// SHA of the current commit.
    pub fn head(&self) -> String {
        self.git(&["rev-parse", "HEAD"]).trim().to_owned()
    }

    /// Runs git in the repository; its stdout. Panics on failure.
    pub fn git(&self, args: &[&str]) -> String {
        let output = std::process::Command::new("git")
            .args(args)
            .current_dir(self.dir.path())
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_AUTHOR_NAME", "Standby Tests")
            .env("GIT_AUTHOR_EMAIL", "tests@standby.invalid")
            .env("GIT_COMMITTER_NAME", "Standby Tests")
            .env("GIT_COMMITTER_EMAIL", "tests@standby.invalid")
            .output()
            .expect("run git");
        assert!(output.status.success(), "git {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }
}
