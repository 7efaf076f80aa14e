//! The `local` provider: a sandbox is a directory plus a `standby` process
//! group on this machine. It does a sandbox's whole life for real:
//! - **stop** kills the sandbox's process group (and anything carrying its
//!   mark) and keeps its directory; **start** unpacks an archived one;
//!   launching an agent in the same directory resumes it;
//! - **idle auto-stop**: a running sandbox that saw no activity (a launch, or
//!   a heartbeat saying it is busy) for its auto-stop minutes is stopped
//!   (`0`: never);
//! - **sweeper**: a sandbox stopped for `auto_archive` minutes is archived
//!   (its workspace packed into `workspace.tar.gz`), for `auto_delete`
//!   minutes deleted: the backstop for sandboxes whose thread never returns.
//!
//! Each sandbox's provider settings (auto-stop, when it stopped) live in
//! `<sandbox>/sandbox.json`, outside the workspace, so they survive a
//! server restart.
//!
//! No process of a local sandbox outlives the sandbox or the server,
//! whatever the way it ends:
//! - the sandbox stops (its agent exits, or is stopped): everything in its
//!   containment is killed ([`crate::containment`]: its cgroup, or its PID
//!   namespace), and every process still carrying the sandbox's mark in its
//!   environment ([`SANDBOX_MARK`]);
//! - normal exit and SIGTERM: the server stops every sandbox it launched
//!   ([`SandboxProvider::stop_all`]): SIGTERM to the agent (which stops its
//!   run, MCP servers and shell), SIGKILL to its process group after a
//!   grace period, then the kills above;
//! - a crash or SIGKILL of the server: each agent is started through
//!   `setpriv --pdeathsig TERM`, so the kernel sends it SIGTERM when the
//!   server dies and it stops its own children. (Setting the parent-death
//!   signal directly needs `unsafe` code between fork and exec, which this
//!   workspace denies; `setpriv` is util-linux, present wherever Linux
//!   is.) The signal follows the *thread* that spawned the child, so
//!   agents are only ever spawned from tokio worker threads, which live as
//!   long as the runtime, never from the blocking pool. Where `setpriv` is
//!   missing a warning says so, and the next start of the server sweeps
//!   the orphans of the sandboxes it finds. With cgroup containment, the
//!   next start kills what is left in the dead server's cgroups; in a PID
//!   namespace the kernel kills it all at once.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use standby_protocol::vars;
use tokio::sync::{oneshot, watch};

use super::timers::{Retention, Timers};
use super::{
    AgentLaunch, Details, Found, Launched, ProviderError, SandboxProvider, ensure_sweeper, lock, stop_idle, wait_done,
};
use crate::containment::{Containment, ContainmentChoice, ContainmentError};
use crate::model::Millis;

/// Environment variable set on every process of a local sandbox (the
/// agent's children inherit it), naming the sandbox: the sweep finds
/// processes that escaped the agent's process group by it. It does not
/// start with `STANDBY_`, so nothing takes it for configuration.
pub const SANDBOX_MARK: &str = "LOCAL_SANDBOX_ID";

/// The provider's settings file in a local sandbox's directory.
const META_FILE: &str = "sandbox.json";
/// An archived local sandbox's workspace.
const ARCHIVE_FILE: &str = "workspace.tar.gz";

/// How the local provider counts time and sweeps stopped sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalOptions {
    /// How long a provider minute is: auto-stop, archive and delete are
    /// counted in them. A minute, except in tests.
    pub minute: Duration,
    /// Stopped for this many minutes: archived (`0`: never).
    pub auto_archive: u32,
    /// Stopped for this many minutes: deleted (`0`: never).
    pub auto_delete: u32,
    /// Between SIGTERM and SIGKILL when a sandbox is stopped.
    pub stop_grace: Duration,
    /// How every process of a sandbox is kept killable.
    pub containment: ContainmentChoice,
}

impl Default for LocalOptions {
    fn default() -> Self {
        Self {
            minute: Duration::from_secs(60),
            auto_archive: 0,
            auto_delete: 0,
            stop_grace: Duration::from_secs(10),
            containment: ContainmentChoice::Auto,
        }
    }
}

/// `<sandbox>/sandbox.json`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Meta {
    #[serde(default)]
    auto_stop_minutes: u32,
    /// When its agent last stopped (wall clock, so that a restart keeps it).
    #[serde(default)]
    stopped_at: Option<Millis>,
}

#[derive(Debug, Clone)]
struct Process {
    pid: u32,
    done: watch::Receiver<bool>,
}

/// The `local` provider: `<root>/<sandbox id>/` holds `workspace/` (the
/// agent's `STANDBY_WORKSPACE`), `agent.log` (its output) and
/// `sandbox.json` (the provider's settings).
#[derive(Debug, Clone)]
pub struct LocalProvider {
    inner: Arc<LocalInner>,
}

#[derive(Debug)]
struct LocalInner {
    root: PathBuf,
    agent_bin: PathBuf,
    setpriv: Option<PathBuf>,
    containment: Containment,
    base_env: Vec<(OsString, OsString)>,
    options: LocalOptions,
    processes: Mutex<HashMap<String, Process>>,
    /// Idle auto-stop and retention; its lock is held by whatever changes
    /// a stopped sandbox's files (start, archive, the sweeper's delete), so
    /// the sweeper never races a resume.
    timers: Arc<Timers>,
}

fn find_setpriv() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/bin")])
        .map(|dir| dir.join("setpriv"))
        .find(|candidate| candidate.is_file())
}

impl LocalProvider {
    /// Sandboxes under `root`, running `agent_bin`, with default options
    /// (no sweeper).
    pub fn new(root: PathBuf, agent_bin: PathBuf) -> Self {
        Self::with_options(root, agent_bin, LocalOptions::default())
    }

    /// Sandboxes contained as `options.containment` says, or with the
    /// process group only (an error logged) when the host does not allow it.
    pub fn with_options(root: PathBuf, agent_bin: PathBuf, options: LocalOptions) -> Self {
        let containment = Containment::probe(options.containment).unwrap_or_else(|error| {
            tracing::error!(%error, "falling back to process-group containment");
            Containment::ProcessGroup
        });
        Self::contained(root, agent_bin, options, containment)
    }

    /// As [`LocalProvider::with_options`], failing when the containment
    /// asked for is not available.
    pub fn try_with_options(
        root: PathBuf,
        agent_bin: PathBuf,
        options: LocalOptions,
    ) -> Result<Self, ContainmentError> {
        Ok(Self::contained(root, agent_bin, options, Containment::probe(options.containment)?))
    }

    fn contained(root: PathBuf, agent_bin: PathBuf, options: LocalOptions, containment: Containment) -> Self {
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
            inner: Arc::new(LocalInner {
                root,
                agent_bin,
                setpriv,
                containment,
                base_env,
                options,
                processes: Mutex::new(HashMap::new()),
                timers: Timers::new(options.minute, options.auto_archive, options.auto_delete),
            }),
        }
    }

    fn dir(&self, sandbox_id: &str) -> PathBuf {
        self.inner.root.join(sandbox_id)
    }

    fn process(&self, sandbox_id: &str) -> Option<Process> {
        lock(&self.inner.processes).get(sandbox_id).cloned()
    }

    fn io(sandbox_id: &str, action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ProviderError {
        let (sandbox, path) = (sandbox_id.to_owned(), path.to_owned());
        move |source| ProviderError::Io { sandbox, action, path, source }
    }

    fn read_meta(&self, sandbox_id: &str) -> Meta {
        std::fs::read(self.dir(sandbox_id).join(META_FILE))
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default()
    }

    /// Rewrites `sandbox.json`; fails (and writes nothing) when the
    /// sandbox's directory is gone.
    fn update_meta(&self, sandbox_id: &str, change: impl FnOnce(&mut Meta)) -> Result<(), ProviderError> {
        let dir = self.dir(sandbox_id);
        if !dir.is_dir() {
            return Err(ProviderError::Missing { sandbox: sandbox_id.to_owned(), path: dir });
        }
        let mut meta = self.read_meta(sandbox_id);
        change(&mut meta);
        let path = dir.join(META_FILE);
        let temporary = dir.join(format!(".{META_FILE}.tmp"));
        let text = serde_json::to_vec(&meta).unwrap_or_default();
        std::fs::write(&temporary, text)
            .and_then(|()| std::fs::rename(&temporary, &path))
            .map_err(Self::io(sandbox_id, "write", &path))
    }

    fn ensure_sweeper(&self) {
        ensure_sweeper(&self.inner, &self.inner.timers, |inner| async { LocalProvider { inner }.sweep_once().await });
    }

    fn archived(&self, sandbox_id: &str) -> bool {
        let dir = self.dir(sandbox_id);
        dir.join(ARCHIVE_FILE).is_file() && !dir.join("workspace").exists()
    }

    async fn tar(&self, sandbox_id: &str, args: &[&str]) -> Result<(), ProviderError> {
        let output = tokio::process::Command::new("tar")
            .args(args)
            .current_dir(self.dir(sandbox_id))
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|source| ProviderError::Spawn { sandbox: sandbox_id.to_owned(), program: "tar".into(), source })?;
        if output.status.success() {
            Ok(())
        } else {
            Err(ProviderError::Tar {
                sandbox: sandbox_id.to_owned(),
                args: args.join(" "),
                message: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            })
        }
    }

    /// Packs a stopped sandbox's workspace away (the sweeper).
    async fn archive(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        self.tar(sandbox_id, &["-czf", ARCHIVE_FILE, "workspace"]).await?;
        let workspace = self.dir(sandbox_id).join("workspace");
        tokio::fs::remove_dir_all(&workspace).await.map_err(Self::io(sandbox_id, "remove", &workspace))?;
        tracing::info!(sandbox_id, "stopped sandbox archived");
        Ok(())
    }

    async fn unarchive(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        self.tar(sandbox_id, &["-xzf", ARCHIVE_FILE]).await?;
        let archive = self.dir(sandbox_id).join(ARCHIVE_FILE);
        tokio::fs::remove_file(&archive).await.map_err(Self::io(sandbox_id, "remove", &archive))?;
        tracing::info!(sandbox_id, "archived sandbox unpacked");
        Ok(())
    }

    /// One round of the timers: the facts of each sandbox (running with
    /// its auto-stop; stopped since when, archived or not) fed to the
    /// shared rules, and what they decide carried out.
    async fn sweep_once(&self) {
        let timers = &self.inner.timers;
        let running: Vec<String> = lock(&self.inner.processes).keys().cloned().collect();
        let auto_stops = running.iter().map(|id| (id.clone(), self.read_meta(id).auto_stop_minutes));
        stop_idle(self, timers.idle(auto_stops, Instant::now()));
        if !timers.ages_stopped() {
            return;
        }
        let Ok(entries) = std::fs::read_dir(&self.inner.root) else { return };
        let ids: Vec<String> = entries
            .filter_map(|entry| entry.ok())
            .filter(|entry| entry.path().is_dir())
            .filter_map(|entry| entry.file_name().to_str().map(str::to_owned))
            .filter(|id| !id.starts_with('.') && !running.contains(id))
            .collect();
        for sandbox_id in ids {
            let _retaining = timers.retaining().await;
            let Some(stopped_at) = self.read_meta(&sandbox_id).stopped_at else { continue };
            if self.process(&sandbox_id).is_some() {
                continue;
            }
            let stopped_for = Duration::from_millis(Millis::now().since(stopped_at));
            match timers.retention(stopped_for, self.archived(&sandbox_id)) {
                Retention::Keep => {}
                Retention::Archive => {
                    if let Err(error) = self.archive(&sandbox_id).await {
                        tracing::warn!(%error, "the sweeper could not archive a stopped sandbox");
                    }
                }
                Retention::Delete => {
                    let minutes = self.inner.options.auto_delete;
                    tracing::info!(sandbox_id, minutes, "stopped sandbox deleted by the sweeper");
                    if let Err(error) = self.delete(&sandbox_id).await {
                        tracing::warn!(%error, "the sweeper could not delete a stopped sandbox");
                    }
                }
            }
        }
    }
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
        self.ensure_sweeper();
        let workspace = self.dir(sandbox_id).join("workspace");
        // Owner-only: the workspace receives the run's secrets files.
        tokio::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&workspace)
            .await
            .map_err(Self::io(sandbox_id, "create", &workspace))?;
        self.update_meta(sandbox_id, |meta| *meta = Meta::default())
    }

    async fn start(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        self.ensure_sweeper();
        let _starting = self.inner.timers.starting().await;
        let dir = self.dir(sandbox_id);
        if !tokio::fs::metadata(&dir).await.is_ok_and(|meta| meta.is_dir()) {
            return Err(ProviderError::Missing { sandbox: sandbox_id.to_owned(), path: dir });
        }
        if self.archived(sandbox_id) {
            self.unarchive(sandbox_id).await?;
        }
        self.update_meta(sandbox_id, |meta| meta.stopped_at = None)
    }

    async fn launch(&self, sandbox_id: &str, launch: AgentLaunch) -> Result<Launched, ProviderError> {
        let dir = self.dir(sandbox_id);
        let log_path = dir.join("agent.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)
            .map_err(Self::io(sandbox_id, "open", &log_path))?;
        let log_err = log.try_clone().map_err(Self::io(sandbox_id, "open", &log_path))?;
        let inner = &self.inner;
        let mut argv = inner.containment.wrap(sandbox_id, &inner.agent_bin).map_err(|source| ProviderError::Spawn {
            sandbox: sandbox_id.to_owned(),
            program: inner.agent_bin.clone(),
            source,
        })?;
        if let Some(setpriv) = &inner.setpriv {
            let signal = inner.containment.death_signal();
            argv.splice(0..0, [setpriv.into(), "--pdeathsig".into(), signal.into(), "--".into()]);
        }
        let mut command = tokio::process::Command::new(&argv[0]);
        command.args(&argv[1..]);
        command
            .env_clear()
            .envs(inner.base_env.iter().map(|(name, value)| (name, value)))
            .env(vars::SERVER_URL, &launch.server_url)
            .env(vars::TOKEN, launch.token.expose())
            .env(vars::WORKSPACE, dir.join("workspace"))
            .env(vars::HEARTBEAT_INTERVAL, humantime::format_duration(launch.heartbeat_interval).to_string())
            .env(vars::LOG, &launch.log_filter)
            .envs(launch.otlp_endpoint.as_ref().map(|endpoint| (vars::OTLP_ENDPOINT, endpoint)))
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
        lock(&inner.processes).insert(sandbox_id.to_owned(), Process { pid, done });
        inner.timers.active(sandbox_id, Instant::now());
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
            // The sandbox has stopped: nothing of it may outlive its agent.
            provider.inner.containment.kill(&id).await;
            sweep(&id);
            {
                let mut processes = lock(&provider.inner.processes);
                if processes.get(&id).is_some_and(|process| process.pid == pid) {
                    processes.remove(&id);
                    provider.inner.timers.forget(&id);
                }
            }
            // The sweeper counts from here; a deleted sandbox has no file
            // to write, and needs none.
            let _ = provider.update_meta(&id, |meta| meta.stopped_at = Some(Millis::now()));
            let _ = done_tx.send(true);
            let _ = exit_tx.send(code);
        });
        Ok(Launched { pid: Some(pid), exited })
    }

    async fn stop(&self, sandbox_id: &str) {
        let grace = self.inner.options.stop_grace;
        if let Some(process) = self.process(sandbox_id) {
            let pid = Pid::from_raw(i32::try_from(process.pid).unwrap_or(i32::MAX));
            let agent = self.inner.containment.agent_pid(process.pid);
            let _ = kill(Pid::from_raw(i32::try_from(agent).unwrap_or(i32::MAX)), Signal::SIGTERM);
            if !wait_done(process.done.clone(), grace).await {
                tracing::warn!(sandbox_id, pid = process.pid, "agent still running after the grace period: SIGKILL");
                let _ = killpg(pid, Signal::SIGKILL);
                wait_done(process.done, Duration::from_secs(5)).await;
            }
        }
        self.inner.containment.kill(sandbox_id).await;
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
        self.inner.timers.forget(sandbox_id);
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
        Ok(if tokio::fs::metadata(&dir).await.is_err() {
            Found::Missing
        } else if self.archived(sandbox_id) {
            Found::Archived
        } else {
            Found::NoAgent
        })
    }

    async fn stop_all(&self) {
        let ids: Vec<String> = lock(&self.inner.processes).keys().cloned().collect();
        futures::future::join_all(ids.iter().map(|id| self.stop(id))).await;
        self.inner.containment.kill_all().await;
    }

    fn details(&self, sandbox_id: &str) -> Details {
        Details { pid: self.process(sandbox_id).map(|process| process.pid), dir: Some(self.dir(sandbox_id)) }
    }

    async fn set_auto_stop(&self, sandbox_id: &str, minutes: u32) -> Result<(), ProviderError> {
        self.ensure_sweeper();
        self.update_meta(sandbox_id, |meta| meta.auto_stop_minutes = minutes)
    }

    async fn auto_stop(&self, sandbox_id: &str) -> Result<Option<u32>, ProviderError> {
        let dir = self.dir(sandbox_id);
        if !dir.is_dir() {
            return Err(ProviderError::Missing { sandbox: sandbox_id.to_owned(), path: dir });
        }
        Ok(Some(self.read_meta(sandbox_id).auto_stop_minutes))
    }

    fn touch(&self, sandbox_id: &str) {
        self.inner.timers.active(sandbox_id, Instant::now());
    }

    fn containment(&self) -> &'static str {
        self.inner.containment.name()
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

    /// An agent that records each start in its workspace and then waits.
    fn waiting_agent(dir: &Path) -> PathBuf {
        script(dir, "echo started >> \"$STANDBY_WORKSPACE/starts\"; while :; do sleep 1; done")
    }

    fn options(minute_ms: u64) -> LocalOptions {
        LocalOptions {
            minute: Duration::from_millis(minute_ms),
            stop_grace: Duration::from_secs(2),
            ..Default::default()
        }
    }

    async fn until(what: &str, mut check: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !check() {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn pid_alive(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z"))
    }

    #[tokio::test]
    async fn a_stopped_sandbox_keeps_its_files_and_starts_again_in_the_same_directory() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let provider =
            LocalProvider::with_options(dir.path().join("sandboxes"), waiting_agent(dir.path()), options(60_000));
        provider.create("sbx_s").await.expect("create");
        let first = provider.launch("sbx_s", AgentLaunch::unreachable()).await.expect("launch");
        let pid = first.pid.expect("a pid");
        let starts = dir.path().join("sandboxes/sbx_s/workspace/starts");
        until("the first start", || starts.is_file()).await;
        std::fs::write(dir.path().join("sandboxes/sbx_s/workspace/note"), "kept").expect("a file");
        provider.stop("sbx_s").await;
        assert_eq!(first.exited.await.expect("an exit"), None, "stopped by a signal");
        assert!(!pid_alive(pid), "no process is left");
        assert_eq!(provider.state("sbx_s").await.expect("state"), Found::NoAgent);
        provider.start("sbx_s").await.expect("start");
        let second = provider.launch("sbx_s", AgentLaunch::unreachable()).await.expect("launch again");
        until("the second start", || std::fs::read_to_string(&starts).is_ok_and(|t| t.lines().count() == 2)).await;
        let note = std::fs::read_to_string(dir.path().join("sandboxes/sbx_s/workspace/note")).expect("the file");
        assert_eq!(note, "kept");
        provider.stop("sbx_s").await;
        assert!(second.exited.await.is_ok());
    }

    #[tokio::test]
    async fn the_idle_auto_stop_stops_an_idle_sandbox_and_zero_means_never() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let provider =
            LocalProvider::with_options(dir.path().join("sandboxes"), waiting_agent(dir.path()), options(100));
        for id in ["sbx_idle", "sbx_never"] {
            provider.create(id).await.expect("create");
        }
        provider.set_auto_stop("sbx_idle", 2).await.expect("auto-stop of two minutes");
        assert_eq!(provider.auto_stop("sbx_idle").await.expect("read"), Some(2));
        assert_eq!(provider.auto_stop("sbx_never").await.expect("read"), Some(0), "never, by default");
        let idle = provider.launch("sbx_idle", AgentLaunch::unreachable()).await.expect("launch");
        let never = provider.launch("sbx_never", AgentLaunch::unreachable()).await.expect("launch");
        // Activity holds the auto-stop off.
        for _ in 0..6 {
            provider.touch("sbx_idle");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(provider.state("sbx_idle").await.expect("state"), Found::Running);
        let code = tokio::time::timeout(Duration::from_secs(20), idle.exited).await.expect("auto-stopped");
        assert_eq!(code.expect("an exit"), None);
        assert_eq!(provider.state("sbx_idle").await.expect("state"), Found::NoAgent, "the files are kept");
        assert_eq!(provider.state("sbx_never").await.expect("state"), Found::Running, "0 means never");
        provider.stop("sbx_never").await;
        assert!(never.exited.await.is_ok());
    }

    #[tokio::test]
    async fn the_sweeper_archives_then_deletes_a_sandbox_left_stopped() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let root = dir.path().join("sandboxes");
        let archive_only = LocalOptions { auto_archive: 2, ..options(100) };
        let provider = LocalProvider::with_options(root.clone(), waiting_agent(dir.path()), archive_only);
        provider.create("sbx_old").await.expect("create");
        let launched = provider.launch("sbx_old", AgentLaunch::unreachable()).await.expect("launch");
        std::fs::write(root.join("sbx_old/workspace/note"), "kept").expect("a file");
        provider.stop("sbx_old").await;
        assert!(launched.exited.await.is_ok());
        let archived = async {
            while provider.state("sbx_old").await.expect("state") != Found::Archived {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), archived).await.expect("archived");
        assert!(!root.join("sbx_old/workspace").exists());
        // An archived sandbox starts again, more slowly, with its files.
        provider.start("sbx_old").await.expect("start");
        assert_eq!(std::fs::read_to_string(root.join("sbx_old/workspace/note")).expect("unpacked"), "kept");
        assert_eq!(provider.state("sbx_old").await.expect("state"), Found::NoAgent);
        drop(provider);

        let delete = LocalOptions { auto_delete: 2, ..options(100) };
        let provider = LocalProvider::with_options(root.clone(), waiting_agent(dir.path()), delete);
        provider.update_meta("sbx_old", |meta| meta.stopped_at = Some(Millis::now())).expect("stopped now");
        provider.start("sbx_new").await.expect_err("no such sandbox");
        provider.create("sbx_new").await.expect("create: starts the sweeper");
        let deleted = async {
            while provider.state("sbx_old").await.expect("state") != Found::Missing {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), deleted).await.expect("deleted");
        assert_eq!(provider.state("sbx_new").await.expect("state"), Found::NoAgent, "never stopped: not swept");
    }

    #[tokio::test]
    async fn an_agent_gets_the_contract_variables_and_its_exit_is_reported() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let agent = script(dir.path(), "env > \"$STANDBY_WORKSPACE/../env.txt\"; exit 12");
        let provider = LocalProvider::new(dir.path().join("sandboxes"), agent);
        provider.create("sbx_a").await.expect("create");
        provider.start("sbx_a").await.expect("start");
        let launched = provider.launch("sbx_a", AgentLaunch::unreachable()).await.expect("launch");
        assert_eq!(launched.exited.await.expect("an exit"), Some(12));
        let env = std::fs::read_to_string(dir.path().join("sandboxes/sbx_a/env.txt")).expect("the env file");
        for expected in
            ["STANDBY_SERVER_URL=http://127.0.0.1:1", "STANDBY_TOKEN=sby_x_y", "STANDBY_HEARTBEAT_INTERVAL=500ms"]
        {
            assert!(env.contains(expected), "{expected} missing from\n{env}");
        }
        assert!(env.contains(&format!("{SANDBOX_MARK}=sbx_a")));
        assert_eq!(provider.state("sbx_a").await.expect("state"), Found::NoAgent);
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
        let grace = LocalOptions { stop_grace: Duration::from_millis(200), ..LocalOptions::default() };
        let provider = LocalProvider::with_options(dir.path().join("sandboxes"), agent, grace);
        provider.create("sbx_b").await.expect("create");
        let launched = provider.launch("sbx_b", AgentLaunch::unreachable()).await.expect("launch");
        let pid_file = dir.path().join("sandboxes/sbx_b/workspace/child.pid");
        let child = loop {
            if let Some(pid) = std::fs::read_to_string(&pid_file).ok().and_then(|t| t.trim().parse::<i32>().ok()) {
                break pid;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(provider.state("sbx_b").await.expect("state"), Found::Running);
        provider.stop("sbx_b").await;
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
