//! Where sandboxes come from: the [`SandboxProvider`] trait, and the
//! `local` provider, where a sandbox is a directory plus a `standby`
//! process group on this machine.
//!
//! No process of a local sandbox outlives the server, whatever the way it
//! ends:
//! - normal exit and SIGTERM: the server stops every sandbox it launched
//!   ([`SandboxProvider::stop_all`]): SIGTERM to the agent (which stops its
//!   run, MCP servers and shell), SIGKILL to its process group after a
//!   grace period, then a sweep that kills any process still carrying the
//!   sandbox's mark in its environment ([`SANDBOX_MARK`]);
//! - a crash or SIGKILL of the server: each agent is started through
//!   `setpriv --pdeathsig TERM`, so the kernel sends it SIGTERM when the
//!   server dies and it stops its own children. (Setting the parent-death
//!   signal directly needs `unsafe` code between fork and exec, which this
//!   workspace denies; `setpriv` is util-linux, present wherever Linux
//!   is.) The signal follows the *thread* that spawned the child, so
//!   agents are only ever spawned from tokio worker threads, which live as
//!   long as the runtime, never from the blocking pool. Where `setpriv` is
//!   missing a warning says so, and the next start of the server sweeps
//!   the orphans of the sandboxes it finds.

use std::collections::HashMap;
use std::ffi::OsString;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use standby_protocol::Secret;
use tokio::sync::{oneshot, watch};

use crate::dispatch::Found;

/// Environment variable set on every process of a local sandbox (the
/// agent's children inherit it), naming the sandbox: the sweep finds
/// processes that escaped the agent's process group by it. It does not
/// start with `STANDBY_`, so nothing takes it for configuration.
pub const SANDBOX_MARK: &str = "LOCAL_SANDBOX_ID";

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("sandbox {sandbox}: cannot {action} {path}: {source}")]
    Io {
        sandbox: String,
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox {sandbox}: cannot start the agent {program}: {source}")]
    Spawn {
        sandbox: String,
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox {sandbox} does not exist (no directory {path})")]
    Missing { sandbox: String, path: PathBuf },
}

/// What the agent of a sandbox is started with: the contract's variables.
#[derive(Debug, Clone)]
pub struct AgentLaunch {
    /// `STANDBY_SERVER_URL`.
    pub server_url: String,
    /// `STANDBY_TOKEN`: the sandbox's standby credential.
    pub token: Secret,
    /// `STANDBY_HEARTBEAT_INTERVAL`.
    pub heartbeat_interval: Duration,
    /// `STANDBY_LOG`.
    pub log_filter: String,
}

/// A launched agent: its pid where the provider knows one, and its exit
/// code (`None` for death by signal) once it ends.
#[derive(Debug)]
pub struct Launched {
    pub pid: Option<u32>,
    pub exited: oneshot::Receiver<Option<i32>>,
}

/// Provider-specific facts about a sandbox, for `GET /v1/sandboxes`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Details {
    pub pid: Option<u32>,
    pub dir: Option<PathBuf>,
}

/// Creates, starts, stops and deletes sandboxes, and launches the agent in
/// them. The engine calls these from tasks, never while holding state.
pub trait SandboxProvider: Send + Sync + 'static {
    /// Allocates a new sandbox.
    fn create(&self, sandbox_id: &str) -> impl Future<Output = Result<(), ProviderError>> + Send;
    /// Makes an existing sandbox runnable again (resuming a stopped one).
    fn start(&self, sandbox_id: &str) -> impl Future<Output = Result<(), ProviderError>> + Send;
    /// Starts the `standby` agent in a started sandbox.
    fn launch(
        &self,
        sandbox_id: &str,
        launch: AgentLaunch,
    ) -> impl Future<Output = Result<Launched, ProviderError>> + Send;
    /// Stops the sandbox's processes: SIGTERM, then after `grace` SIGKILL.
    fn stop(&self, sandbox_id: &str, grace: Duration) -> impl Future<Output = ()> + Send;
    /// Waits up to `timeout` for the agent to exit on its own; whether it did.
    fn wait_exit(&self, sandbox_id: &str, timeout: Duration) -> impl Future<Output = bool> + Send;
    /// Removes a stopped sandbox for good.
    fn delete(&self, sandbox_id: &str) -> impl Future<Output = Result<(), ProviderError>> + Send;
    /// Whether the sandbox exists and its agent runs.
    fn state(&self, sandbox_id: &str) -> impl Future<Output = Result<Found, ProviderError>> + Send;
    /// Stops every sandbox this process launched (server shutdown).
    fn stop_all(&self, grace: Duration) -> impl Future<Output = ()> + Send;
    fn details(&self, sandbox_id: &str) -> Details;
}

#[derive(Debug, Clone)]
struct Process {
    pid: u32,
    done: watch::Receiver<bool>,
}

/// The `local` provider: `<root>/<sandbox id>/` holds `workspace/` (the
/// agent's `STANDBY_WORKSPACE`) and `agent.log` (its output).
#[derive(Debug, Clone)]
pub struct LocalProvider {
    inner: Arc<LocalInner>,
}

#[derive(Debug)]
struct LocalInner {
    root: PathBuf,
    agent_bin: PathBuf,
    setpriv: Option<PathBuf>,
    base_env: Vec<(OsString, OsString)>,
    processes: Mutex<HashMap<String, Process>>,
}

fn find_setpriv() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/bin")])
        .map(|dir| dir.join("setpriv"))
        .find(|candidate| candidate.is_file())
}

impl LocalProvider {
    /// Sandboxes under `root`, running `agent_bin`.
    pub fn new(root: PathBuf, agent_bin: PathBuf) -> Self {
        let setpriv = find_setpriv();
        if setpriv.is_none() {
            tracing::warn!(
                "`setpriv` (util-linux) not found: local sandboxes will not be stopped if the server is killed with SIGKILL"
            );
        }
        // The server's own configuration (STANDBY_*) must not configure the
        // agents, nor its log filter theirs.
        let base_env = std::env::vars_os()
            .filter(|(name, _)| {
                let name = name.to_string_lossy();
                !name.starts_with("STANDBY_") && name != "RUST_LOG" && name != SANDBOX_MARK
            })
            .collect();
        Self {
            inner: Arc::new(LocalInner { root, agent_bin, setpriv, base_env, processes: Mutex::new(HashMap::new()) }),
        }
    }

    fn dir(&self, sandbox_id: &str) -> PathBuf {
        self.inner.root.join(sandbox_id)
    }

    fn process(&self, sandbox_id: &str) -> Option<Process> {
        self.inner.processes.lock().unwrap_or_else(PoisonError::into_inner).get(sandbox_id).cloned()
    }

    fn io(sandbox_id: &str, action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ProviderError {
        let (sandbox, path) = (sandbox_id.to_owned(), path.to_owned());
        move |source| ProviderError::Io { sandbox, action, path, source }
    }
}

async fn wait_done(mut done: watch::Receiver<bool>, timeout: Duration) -> bool {
    tokio::time::timeout(timeout, done.wait_for(|done| *done)).await.is_ok_and(|result| result.is_ok())
}

/// Every live process whose environment holds `SANDBOX_MARK=<sandbox_id>`.
fn marked_processes(sandbox_id: &str) -> Vec<i32> {
    let needle = format!("{SANDBOX_MARK}={sandbox_id}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|environ| environ.split(|b| *b == 0).any(|entry| entry == needle.as_bytes()))
        })
        .collect()
}

fn sweep(sandbox_id: &str) {
    for pid in marked_processes(sandbox_id) {
        tracing::warn!(sandbox_id, pid, "killing a leftover process of the sandbox");
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

impl SandboxProvider for LocalProvider {
    async fn create(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        let workspace = self.dir(sandbox_id).join("workspace");
        tokio::fs::create_dir_all(&workspace).await.map_err(Self::io(sandbox_id, "create", &workspace))
    }

    async fn start(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        let dir = self.dir(sandbox_id);
        if tokio::fs::metadata(&dir).await.is_ok_and(|meta| meta.is_dir()) {
            Ok(())
        } else {
            Err(ProviderError::Missing { sandbox: sandbox_id.to_owned(), path: dir })
        }
    }

    async fn launch(&self, sandbox_id: &str, launch: AgentLaunch) -> Result<Launched, ProviderError> {
        let dir = self.dir(sandbox_id);
        let log_path = dir.join("agent.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(Self::io(sandbox_id, "open", &log_path))?;
        let log_err = log.try_clone().map_err(Self::io(sandbox_id, "open", &log_path))?;
        let inner = &self.inner;
        let mut command = match &inner.setpriv {
            Some(setpriv) => {
                let mut command = tokio::process::Command::new(setpriv);
                command.args(["--pdeathsig", "TERM", "--"]).arg(&inner.agent_bin);
                command
            }
            None => tokio::process::Command::new(&inner.agent_bin),
        };
        command
            .env_clear()
            .envs(inner.base_env.iter().map(|(name, value)| (name, value)))
            .env("STANDBY_SERVER_URL", &launch.server_url)
            .env("STANDBY_TOKEN", launch.token.expose())
            .env("STANDBY_WORKSPACE", dir.join("workspace"))
            .env("STANDBY_HEARTBEAT_INTERVAL", humantime::format_duration(launch.heartbeat_interval).to_string())
            .env("STANDBY_LOG", &launch.log_filter)
            .env(SANDBOX_MARK, sandbox_id)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0)
            .kill_on_drop(false);
        let mut child = command.spawn().map_err(|source| ProviderError::Spawn {
            sandbox: sandbox_id.to_owned(),
            program: inner.agent_bin.clone(),
            source,
        })?;
        let pid = child.id().unwrap_or_default();
        let (done_tx, done) = watch::channel(false);
        let (exit_tx, exited) = oneshot::channel();
        inner
            .processes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sandbox_id.to_owned(), Process { pid, done });
        tracing::info!(sandbox_id, pid, "agent launched");
        let provider = self.clone();
        let id = sandbox_id.to_owned();
        tokio::spawn(async move {
            let code = match child.wait().await {
                Ok(status) => status.code(),
                Err(error) => {
                    tracing::error!(sandbox_id = %id, %error, "waiting for the agent failed");
                    None
                }
            };
            tracing::info!(sandbox_id = %id, pid, ?code, "agent exited");
            {
                let mut processes = provider.inner.processes.lock().unwrap_or_else(PoisonError::into_inner);
                if processes.get(&id).is_some_and(|process| process.pid == pid) {
                    processes.remove(&id);
                }
            }
            let _ = done_tx.send(true);
            let _ = exit_tx.send(code);
        });
        Ok(Launched { pid: Some(pid), exited })
    }

    async fn stop(&self, sandbox_id: &str, grace: Duration) {
        if let Some(process) = self.process(sandbox_id) {
            let pid = Pid::from_raw(i32::try_from(process.pid).unwrap_or(i32::MAX));
            let _ = kill(pid, Signal::SIGTERM);
            if !wait_done(process.done.clone(), grace).await {
                tracing::warn!(sandbox_id, pid = process.pid, "agent still running after the grace period: SIGKILL");
                let _ = killpg(pid, Signal::SIGKILL);
                wait_done(process.done, Duration::from_secs(5)).await;
            }
        }
        sweep(sandbox_id);
    }

    async fn wait_exit(&self, sandbox_id: &str, timeout: Duration) -> bool {
        match self.process(sandbox_id) {
            Some(process) => wait_done(process.done, timeout).await,
            None => true,
        }
    }

    async fn delete(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        let dir = self.dir(sandbox_id);
        match tokio::fs::remove_dir_all(&dir).await {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                Err(Self::io(sandbox_id, "delete", &dir)(error))
            }
            _ => Ok(()),
        }
    }

    async fn state(&self, sandbox_id: &str) -> Result<Found, ProviderError> {
        if self.process(sandbox_id).is_some_and(|process| !*process.done.borrow()) {
            return Ok(Found::Running);
        }
        // Not launched by this process: anything still running with its mark
        // is an orphan of a server that died without stopping it.
        sweep(sandbox_id);
        let dir = self.dir(sandbox_id);
        Ok(if tokio::fs::metadata(&dir).await.is_ok() { Found::Stopped } else { Found::Missing })
    }

    async fn stop_all(&self, grace: Duration) {
        let ids: Vec<String> =
            self.inner.processes.lock().unwrap_or_else(PoisonError::into_inner).keys().cloned().collect();
        futures::future::join_all(ids.iter().map(|id| self.stop(id, grace))).await;
    }

    fn details(&self, sandbox_id: &str) -> Details {
        Details { pid: self.process(sandbox_id).map(|process| process.pid), dir: Some(self.dir(sandbox_id)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn script(dir: &Path, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("fake-agent");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write the script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    fn launch() -> AgentLaunch {
        AgentLaunch {
            server_url: "http://127.0.0.1:1".into(),
            token: Secret::new("sby_x_y"),
            heartbeat_interval: Duration::from_millis(500),
            log_filter: "info".into(),
        }
    }

    #[tokio::test]
    async fn an_agent_gets_the_contract_variables_and_its_exit_is_reported() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let agent = script(dir.path(), "env > \"$STANDBY_WORKSPACE/../env.txt\"; exit 12");
        let provider = LocalProvider::new(dir.path().join("sandboxes"), agent);
        provider.create("sbx_a").await.expect("create");
        provider.start("sbx_a").await.expect("start");
        let launched = provider.launch("sbx_a", launch()).await.expect("launch");
        assert_eq!(launched.exited.await.expect("an exit"), Some(12));
        let env = std::fs::read_to_string(dir.path().join("sandboxes/sbx_a/env.txt")).expect("the env file");
        for expected in
            ["STANDBY_SERVER_URL=http://127.0.0.1:1", "STANDBY_TOKEN=sby_x_y", "STANDBY_HEARTBEAT_INTERVAL=500ms"]
        {
            assert!(env.contains(expected), "{expected} missing from\n{env}");
        }
        assert!(env.contains(&format!("{SANDBOX_MARK}=sbx_a")));
        assert_eq!(provider.state("sbx_a").await.expect("state"), Found::Stopped);
        provider.delete("sbx_a").await.expect("delete");
        assert_eq!(provider.state("sbx_a").await.expect("state"), Found::Missing);
        assert!(provider.start("sbx_a").await.is_err());
    }

    #[tokio::test]
    async fn stop_kills_the_group_and_marked_processes_after_the_grace_period() {
        let dir = tempfile::tempdir().expect("a temp dir");
        // Ignores SIGTERM, and leaves a child in another session.
        let agent = script(
            dir.path(),
            "trap '' TERM; setsid sleep 300 & echo $! > \"$STANDBY_WORKSPACE/child.pid\"; while :; do sleep 1; done",
        );
        let provider = LocalProvider::new(dir.path().join("sandboxes"), agent);
        provider.create("sbx_b").await.expect("create");
        let launched = provider.launch("sbx_b", launch()).await.expect("launch");
        let pid_file = dir.path().join("sandboxes/sbx_b/workspace/child.pid");
        let child = loop {
            if let Some(pid) = std::fs::read_to_string(&pid_file).ok().and_then(|t| t.trim().parse::<i32>().ok()) {
                break pid;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(provider.state("sbx_b").await.expect("state"), Found::Running);
        provider.stop("sbx_b", Duration::from_millis(200)).await;
        assert_eq!(launched.exited.await.expect("an exit"), None, "killed by a signal");
        // The child was SIGKILLed by the sweep; wait for the kernel to reap it.
        let gone = async {
            while std::fs::read_to_string(format!("/proc/{child}/stat")).is_ok_and(|s| !s.contains(") Z")) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), gone).await.expect("the escaped child is gone");
    }
}
