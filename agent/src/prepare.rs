//! Workspace preparation: the clones and setup commands a standby runs
//! before any run exists, so that an assignment finds everything in place.
//!
//! Preparation is recorded in `<workspace>/.standby/state.json` only once it
//! has completed, under the workspace's fingerprint: an agent restarted on
//! the same workspace (same spec) skips straight past the slow part, and one
//! that crashed half-way, or was given another spec, starts over.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use standby_protocol::layout::StateDir;
use standby_protocol::{Fingerprint, Repo, SetupStep, Workspace, fingerprint};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;
use tracing::{info, warn};

use crate::git::{self, GitError, describe_status, redact_url};
use crate::paths::{PathError, resolve_inside, write_atomic};
use crate::process::{child_env, register, unregister};

/// Files written less than this before their index is written are racy
/// to git (whole-second timestamps).
const RACY_GIT_WINDOW: Duration = Duration::from_secs(1);

/// A prepared workspace.
#[derive(Debug, Clone)]
pub struct PreparedWorkspace {
    /// The fingerprint the workspace was prepared under.
    pub fingerprint: Fingerprint,
    /// Whether an earlier, completed preparation was found and clone and
    /// setup were skipped.
    pub skipped: bool,
    /// Each fresh clone as this preparation left it, by repo path, so the
    /// run's refresh to the same commit can skip git (see
    /// [`git::Snapshot`]). Empty when preparation was skipped: an earlier
    /// turn may have staged changes the snapshot cannot see.
    pub checkouts: BTreeMap<String, git::Snapshot>,
}

/// Why preparation failed; each names the repo, step or path involved.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("{what}: {source}")]
    Path { what: String, source: PathError },
    #[error(transparent)]
    Git(#[from] GitError),
    #[error("setup step {name:?} has an empty command")]
    SetupEmpty { name: String },
    #[error("setup step {name:?}: cannot start {program:?}: {source}")]
    SetupSpawn { name: String, program: String, source: io::Error },
    #[error("setup step {name:?} failed with {status} (its output is in {})", log.display())]
    SetupFailed { name: String, status: String, log: PathBuf },
    #[error("setup step {name:?} did not finish within {timeout_s} s and was killed")]
    SetupTimedOut { name: String, timeout_s: u64 },
    #[error("{what} {}: {source}", path.display())]
    Io { what: String, path: PathBuf, source: io::Error },
}

impl PrepareError {
    fn io(what: impl Into<String>, path: &Path) -> impl FnOnce(io::Error) -> Self {
        let (what, path) = (what.into(), path.to_path_buf());
        move |source| Self::Io { what, path, source }
    }
}

/// What `state.json` holds. Written only after preparation completed, so
/// its presence with `status: prepared` means exactly that.
#[derive(Debug, Serialize, Deserialize)]
struct State {
    fingerprint: Fingerprint,
    prepared_at_unix_ms: u64,
    repos: Vec<RepoState>,
    status: Status,
    /// The snapshot (`STANDBY_SNAPSHOT`) this workspace was last refreshed
    /// for: a sandbox made from a snapshot of a prepared one refreshes its
    /// workspace once, and its later agents use it as it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    snapshot: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct RepoState {
    path: String,
    sha: String,
}

/// The only status there is: a record exists only for a completed
/// preparation. Spelled out in the file so that a reader (or a later version
/// adding other statuses) never has to infer it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Status {
    Prepared,
}

/// Prepares `workspace` under `root`: clones every repo, runs every setup
/// step, records the result. Skips both when `root` already holds a
/// completed preparation of the same fingerprint; when that preparation
/// came with the sandbox's filesystem from `snapshot` (`STANDBY_SNAPSHOT`)
/// and was not refreshed for it yet, refreshes it instead
/// ([`refresh_snapshot`]).
pub async fn prepare(
    root: &Path,
    workspace: &Workspace,
    snapshot: Option<&str>,
) -> Result<PreparedWorkspace, PrepareError> {
    let fingerprint = fingerprint(workspace);
    let state_dir = StateDir::of(root);
    tokio::fs::create_dir_all(state_dir.path()).await.map_err(PrepareError::io("cannot create", state_dir.path()))?;
    let state_path = state_dir.state_file();

    if let Some(state) = read_state(&state_path).await {
        if state.fingerprint == fingerprint {
            if clones_present(root, workspace).await {
                if let Some(snapshot) = snapshot.filter(|id| state.snapshot.as_deref() != Some(*id)) {
                    return refresh_snapshot(root, workspace, state, snapshot, &state_path).await;
                }
                info!(%fingerprint, "workspace already prepared: clone and setup are skipped");
                return Ok(PreparedWorkspace { fingerprint, skipped: true, checkouts: BTreeMap::new() });
            }
            info!("workspace was prepared, but a clone is missing: preparing again");
        } else {
            info!("workspace was prepared for another spec: preparing again");
        }
    }
    // Removed before anything changes, so that a crash from here on never
    // leaves a record that matches a half-prepared workspace.
    match tokio::fs::remove_file(&state_path).await {
        Err(error) if error.kind() != io::ErrorKind::NotFound => {
            return Err(PrepareError::io("cannot remove the stale record", &state_path)(error));
        }
        _ => {}
    }

    let mut repos = Vec::with_capacity(workspace.repos.len());
    for repo in &workspace.repos {
        let url = redact_url(&repo.url);
        let dest = resolve_inside(root, &repo.path)
            .map_err(|source| PrepareError::Path { what: format!("path of repo {url}"), source })?;
        info!("cloning {url} into {}", dest.display());
        let started = Instant::now();
        git::clone(repo, &dest).await?;
        let sha = git::head_sha(&dest).await?;
        info!("cloned {url} into {} at {sha} in {:.1?}", dest.display(), started.elapsed());
        repos.push(RepoState { path: repo.path.clone(), sha });
    }

    let cloned_at = Instant::now();
    let log = state_dir.setup_log();
    for step in &workspace.setup {
        run_step(root, step, &log).await?;
    }
    refresh_indexes(root, workspace, cloned_at).await;
    // Last: setup has written what it writes. A full check per clone, so off the runtime.
    let checkouts = {
        let (root, workspace) = (root.to_path_buf(), workspace.clone());
        crate::process::off_runtime(move || snapshots(&root, &workspace, git::StatCheck::Full))
            .await
            .unwrap_or_default()
    };

    let state = State {
        fingerprint: fingerprint.clone(),
        prepared_at_unix_ms: unix_ms(SystemTime::now()),
        repos,
        status: Status::Prepared,
        snapshot: snapshot.map(str::to_owned),
    };
    write_state(&state_path, &state).await?;
    Ok(PreparedWorkspace { fingerprint, skipped: false, checkouts })
}

/// A workspace prepared in another sandbox, whose filesystem this one was
/// made from (a provider's snapshot): every clone still as its preparation
/// left it is fetched and moved to the head of its ref, so the pool serves
/// today's commit and not the snapshot's; when a commit changed, the setup
/// steps run again (their output may depend on any file). A clone that was
/// changed since is left as it is: it is no longer the snapshot's.
async fn refresh_snapshot(
    root: &Path,
    workspace: &Workspace,
    mut state: State,
    snapshot: &str,
    state_path: &Path,
) -> Result<PreparedWorkspace, PrepareError> {
    info!(snapshot, "workspace prepared in a snapshot of another sandbox: refreshing it instead of cloning");
    let started = Instant::now();
    let no_env = BTreeMap::new();
    let mut moved = false;
    // What the moves changed, workspace-relative; `None` once a diff failed
    // (every step then runs again).
    let mut changed = Some(Vec::new());
    for repo in &workspace.repos {
        let url = redact_url(&repo.url);
        let dest = resolve_inside(root, &repo.path)
            .map_err(|source| PrepareError::Path { what: format!("path of repo {url}"), source })?;
        let Some(recorded) = state.repos.iter_mut().find(|r| r.path == repo.path) else { continue };
        git::trust_copied_files(&dest).await?;
        if !git::untouched_at(&dest, &recorded.sha).await? {
            info!(path = repo.path, "a clone changed since the snapshot: left as it is");
            continue;
        }
        let head = Repo { expected_sha: None, ..repo.clone() };
        let sha = git::refresh(&head, &dest, &no_env).await?;
        if sha != recorded.sha {
            info!(path = repo.path, from = recorded.sha, to = sha, "clone moved to its ref's head");
            match git::changed_files(&dest, &recorded.sha, &sha).await {
                Ok(files) => {
                    let prefix = repo.path.trim_end_matches('/');
                    let in_workspace = |file: String| {
                        if prefix.is_empty() || prefix == "." { file } else { format!("{prefix}/{file}") }
                    };
                    if let Some(changed) = changed.as_mut() {
                        changed.extend(files.into_iter().map(in_workspace));
                    }
                }
                Err(error) => {
                    warn!(path = repo.path, %error, "cannot list what the move changed: every setup step runs again");
                    changed = None;
                }
            }
            recorded.sha = sha;
            moved = true;
        }
    }
    let setup_from = Instant::now();
    let mut steps_again = 0;
    if moved {
        let log = StateDir::of(root).setup_log();
        for step in &workspace.setup {
            if step.runs_again_after_a_move(changed.as_deref()) {
                run_step(root, step, &log).await?;
                steps_again += 1;
            } else {
                info!(step = step.name, "none of the step's declared inputs changed: not run again");
            }
        }
    }
    refresh_indexes(root, workspace, setup_from).await;
    let checkouts = {
        let (root, workspace) = (root.to_path_buf(), workspace.clone());
        crate::process::off_runtime(move || snapshots(&root, &workspace, git::StatCheck::SizeAndSecond))
            .await
            .unwrap_or_default()
    };
    state.snapshot = Some(snapshot.to_owned());
    state.prepared_at_unix_ms = unix_ms(SystemTime::now());
    write_state(state_path, &state).await?;
    info!(snapshot, steps_again, "workspace refreshed from the snapshot in {:.1?}", started.elapsed());
    Ok(PreparedWorkspace { fingerprint: state.fingerprint, skipped: false, checkouts })
}

async fn write_state(path: &Path, state: &State) -> Result<(), PrepareError> {
    let record_error = PrepareError::io("cannot write the preparation record", path);
    let bytes = serde_json::to_vec_pretty(state).map_err(|e| record_error(io::Error::other(e)))?;
    write_atomic(path, &bytes, 0o644).await.map_err(PrepareError::io("cannot write the preparation record", path))
}

/// Refreshes every clone's index (see [`git::refresh_index`]) if the clock
/// has moved past the second the clones were written in: git compares
/// timestamps in whole seconds, and an index written in the same second
/// leaves the files racy. Setup steps usually take longer than that; without
/// them preparation is not made slower to wait for it, and the run's
/// checkout reads the files instead. A failure only costs the run that time,
/// so it is logged, not fatal.
async fn refresh_indexes(root: &Path, workspace: &Workspace, cloned_at: Instant) {
    if cloned_at.elapsed() < RACY_GIT_WINDOW {
        return;
    }
    for repo in &workspace.repos {
        let Ok(dest) = resolve_inside(root, &repo.path) else { continue };
        if let Err(error) = git::refresh_index(&dest).await {
            warn!(path = repo.path, %error, "refreshing the index failed; the run's checkout will read every file");
        }
    }
}

/// Every clone of `workspace` that [`git::Snapshot::take`] can record,
/// watched from now on where it can be ([`git::Snapshot::watched`]), its
/// files compared by `check` (as git compares them in these clones).
fn snapshots(root: &Path, workspace: &Workspace, check: git::StatCheck) -> BTreeMap<String, git::Snapshot> {
    workspace
        .repos
        .iter()
        .filter_map(|repo| {
            let dest = resolve_inside(root, &repo.path).ok()?;
            Some((repo.path.clone(), git::Snapshot::watched(&dest, check)?))
        })
        .collect()
}

/// The fingerprint recorded by a completed preparation of `root`, if any.
#[cfg(test)]
fn recorded_fingerprint(root: &Path) -> Option<Fingerprint> {
    let bytes = std::fs::read(StateDir::of(root).state_file()).ok()?;
    let state: State = serde_json::from_slice(&bytes).ok()?;
    Some(state.fingerprint)
}

/// The record in `path`; an unreadable one counts as none (it is stale and
/// will be replaced).
async fn read_state(path: &Path) -> Option<State> {
    let bytes = tokio::fs::read(path).await.ok()?;
    match serde_json::from_slice(&bytes) {
        Ok(state) => Some(state),
        Err(error) => {
            info!(path = %path.display(), %error, "ignoring an unreadable preparation record");
            None
        }
    }
}

/// Whether every repo of `workspace` still has a checkout: a record is
/// worth nothing if someone removed what it describes.
async fn clones_present(root: &Path, workspace: &Workspace) -> bool {
    for repo in &workspace.repos {
        let Ok(dest) = resolve_inside(root, &repo.path) else {
            return false;
        };
        if tokio::fs::symlink_metadata(dest.join(".git")).await.is_err() {
            return false;
        }
    }
    true
}

fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Runs one setup step to completion: no shell, its own process group (so
/// a timeout kills everything it started), output appended to `log`.
async fn run_step(root: &Path, step: &SetupStep, log: &Path) -> Result<(), PrepareError> {
    let name = &step.name;
    let Some((program, args)) = step.command.split_first() else {
        return Err(PrepareError::SetupEmpty { name: name.clone() });
    };
    let cwd = match &step.cwd {
        Some(cwd) => resolve_inside(root, cwd)
            .map_err(|source| PrepareError::Path { what: format!("cwd of setup step {name:?}"), source })?,
        None => root.to_path_buf(),
    };
    let cwd_what = format!("working directory of setup step {name:?}");
    let metadata = tokio::fs::metadata(&cwd).await.map_err(PrepareError::io(cwd_what.clone(), &cwd))?;
    if !metadata.is_dir() {
        let error = io::Error::new(io::ErrorKind::NotADirectory, "not a directory");
        return Err(PrepareError::io(cwd_what, &cwd)(error));
    }

    let log_error = || PrepareError::io("cannot write the setup log", log);
    let mut log_file = tokio::fs::OpenOptions::new().create(true).append(true).open(log).await.map_err(log_error())?;
    let header = format!(
        "==> {} setup step {name:?} in {}: {:?}\n",
        humantime::format_rfc3339_seconds(SystemTime::now()),
        cwd.display(),
        step.command
    );
    log_file.write_all(header.as_bytes()).await.map_err(log_error())?;
    log_file.flush().await.map_err(log_error())?;
    let log_file = log_file.into_std().await;
    let stdout = log_file.try_clone().map_err(log_error())?;
    let stderr = log_file.try_clone().map_err(log_error())?;

    info!("setup step {name:?} started");
    let started = Instant::now();
    let mut command = Command::new(program);
    command
        .args(args)
        .current_dir(&cwd)
        .env_clear()
        .envs(child_env())
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .process_group(0)
        .kill_on_drop(true);
    let mut child = crate::process::spawn(command).await.map_err(|source| PrepareError::SetupSpawn {
        name: name.clone(),
        program: program.clone(),
        source,
    })?;
    let group = child.id().map(ProcessGroup::new);

    let wait_error = || PrepareError::io(format!("cannot wait for setup step {name:?} in"), &cwd);
    let waited = match step.timeout_s {
        Some(timeout_s) => tokio::time::timeout(Duration::from_secs(timeout_s), child.wait()).await.ok(),
        None => Some(child.wait().await),
    };
    let status = match waited {
        Some(status) => status.map_err(wait_error())?,
        None => {
            if let Some(group) = &group {
                group.kill();
            }
            child.wait().await.map_err(wait_error())?;
            append_footer(log_file, name, "timed out and was killed", started).await;
            return Err(PrepareError::SetupTimedOut {
                name: name.clone(),
                timeout_s: step.timeout_s.unwrap_or_default(),
            });
        }
    };
    drop(group);
    let described = describe_status(status);
    append_footer(log_file, name, &described, started).await;
    info!("setup step {name:?} ended with {described} after {:.1?}", started.elapsed());
    if status.success() {
        Ok(())
    } else {
        Err(PrepareError::SetupFailed { name: name.clone(), status: described, log: log.to_path_buf() })
    }
}

/// Closes a step's section of the setup log. Best effort: the step's outcome
/// is already decided and reported, a missing footer only makes the log
/// less tidy.
async fn append_footer(log_file: std::fs::File, name: &str, outcome: &str, started: Instant) {
    let footer = format!("==> setup step {name:?}: {outcome} after {:.1?}\n", started.elapsed());
    let mut log_file = tokio::fs::File::from_std(log_file);
    // tokio writes in the background: without the flush the footer could
    // still be in flight when the file is dropped.
    let _ = async {
        log_file.write_all(footer.as_bytes()).await?;
        log_file.flush().await
    }
    .await;
}

/// The process group of a setup step, led by the step's process.
///
/// Killed when it goes out of scope: on timeout, when the preparation is
/// abandoned, and after the step exits, so that nothing a step left running
/// in the background outlives it (long-running helpers are MCP servers'
/// job, not setup's). The step's pid is registered as waited for by us
/// while the group lives.
struct ProcessGroup(u32);

impl ProcessGroup {
    fn new(pid: u32) -> Self {
        register(pid);
        Self(pid)
    }

    fn kill(&self) {
        if let Ok(pgid) = i32::try_from(self.0) {
            // ESRCH: the group is already empty, which is the goal.
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill();
        unregister(self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::git::tests::Upstream;
    use standby_protocol::Repo;

    fn step(name: &str, script: &str) -> SetupStep {
        SetupStep {
            name: name.to_owned(),
            command: vec!["sh".to_owned(), "-c".to_owned(), script.to_owned()],
            cwd: None,
            timeout_s: None,
            inputs: None,
        }
    }

    fn workspace(repos: Vec<Repo>, setup: Vec<SetupStep>) -> Workspace {
        Workspace { repos, setup }
    }

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).expect("a readable file")
    }

    #[tokio::test]
    async fn clones_runs_setup_in_order_and_records_the_state() {
        let upstream = Upstream::new();
        let root = tempfile::tempdir().expect("a temporary directory");
        let mut second = step("second", "echo second >> order; echo on-stderr >&2");
        second.cwd = Some("app".to_owned());
        let mut first = step("first", "echo first >> app/order; echo on-stdout");
        first.timeout_s = Some(60);
        let ws = workspace(vec![upstream.repo("app", Some("main"))], vec![first, second]);

        let prepared = prepare(root.path(), &ws, None).await.expect("prepared");
        assert!(!prepared.skipped);
        assert_eq!(prepared.fingerprint, fingerprint(&ws));
        assert_eq!(read(&root.path().join("app/order")), "first\nsecond\n");
        assert_eq!(read(&root.path().join("app/README")), "first");

        let log = read(&root.path().join(".standby/setup.log"));
        let first_header = log.find("setup step \"first\"").expect("first header");
        let second_header = log.find("setup step \"second\"").expect("second header");
        assert!(first_header < second_header, "{log}");
        assert!(log.contains("on-stdout") && log.contains("on-stderr"), "{log}");
        assert!(log.contains("exit status 0"), "{log}");

        let state: serde_json::Value =
            serde_json::from_str(&read(&root.path().join(".standby/state.json"))).expect("JSON");
        let head = crate::git::tests::git(upstream.dir.path(), &["rev-parse", "HEAD"]);
        assert_eq!(state["status"], "prepared");
        assert_eq!(state["fingerprint"], fingerprint(&ws).as_str());
        assert_eq!(state["repos"][0]["path"], "app");
        assert_eq!(state["repos"][0]["sha"], head.as_str());
        assert!(state["prepared_at_unix_ms"].as_u64().is_some_and(|ms| ms > 0));
        assert_eq!(recorded_fingerprint(root.path()), Some(fingerprint(&ws)));
    }

    /// After a setup step that outlasts the clone's second, the index is
    /// written from a later second than every tracked file, so the run's
    /// checkout need not read them.
    #[tokio::test]
    async fn the_index_is_rewritten_after_a_setup_step_so_no_file_is_racy() {
        use std::os::unix::fs::MetadataExt as _;
        let upstream = Upstream::new();
        let root = tempfile::tempdir().expect("a temporary directory");
        let ws = workspace(vec![upstream.repo("app", Some("main"))], vec![step("slow", "sleep 1.2")]);
        let prepared = prepare(root.path(), &ws, None).await.expect("prepared");
        let app = root.path().join("app");
        let index = std::fs::metadata(app.join(".git/index")).expect("an index").mtime();
        let readme = std::fs::metadata(app.join("README")).expect("a tracked file").mtime();
        assert!(index > readme, "index written at {index}, README at {readme}: racy");
        let snapshot = prepared.checkouts.get("app").expect("the fresh clone is recorded");
        assert_eq!(snapshot.still_clean(&app), Ok(()), "the run's refresh needs no git");
        assert_eq!(snapshot.unchanged(&app), Ok(()), "watched since preparation: no file is read either");
    }

    #[tokio::test]
    async fn a_second_preparation_is_skipped() {
        let upstream = Upstream::new();
        let root = tempfile::tempdir().expect("a temporary directory");
        let ws = workspace(vec![upstream.repo("app", None)], vec![step("count", "echo run >> runs")]);
        assert!(!prepare(root.path(), &ws, None).await.expect("first").skipped);
        let again = prepare(root.path(), &ws, None).await.expect("second");
        assert!(again.skipped);
        assert!(again.checkouts.is_empty(), "an earlier turn may have staged changes: git decides");
        assert_eq!(again.fingerprint, fingerprint(&ws));
        assert_eq!(read(&root.path().join("runs")), "run\n");
    }

    #[tokio::test]
    async fn a_missing_clone_means_preparing_again() {
        let upstream = Upstream::new();
        let root = tempfile::tempdir().expect("a temporary directory");
        let ws = workspace(vec![upstream.repo("app", None)], vec![step("count", "echo run >> runs")]);
        prepare(root.path(), &ws, None).await.expect("first");
        std::fs::remove_dir_all(root.path().join("app")).expect("removable");
        assert!(!prepare(root.path(), &ws, None).await.expect("second").skipped);
        assert_eq!(read(&root.path().join("runs")), "run\nrun\n");
    }

    /// A sandbox made from a snapshot of a prepared one: its clone moves to
    /// the ref's head once, with the setup again since a commit changed;
    /// its later agents skip as before.
    #[tokio::test]
    async fn a_workspace_from_a_snapshot_is_refreshed_once() {
        let upstream = Upstream::new();
        let root = tempfile::tempdir().expect("a temporary directory");
        let ws = workspace(vec![upstream.repo("app", Some("main"))], vec![step("count", "echo run >> runs")]);
        prepare(root.path(), &ws, None).await.expect("prepared in the snapshot's sandbox");
        let newer = upstream.commit("NEWS", "since the snapshot");

        let refreshed = prepare(root.path(), &ws, Some("snap-1")).await.expect("refreshed");
        assert!(!refreshed.skipped);
        assert_eq!(crate::git::tests::git(&root.path().join("app"), &["rev-parse", "HEAD"]), newer);
        assert_eq!(read(&root.path().join("runs")), "run\nrun\n", "the setup ran again for the new commit");
        let state: serde_json::Value =
            serde_json::from_str(&read(&root.path().join(".standby/state.json"))).expect("JSON");
        assert_eq!(state["snapshot"], "snap-1");
        assert_eq!(state["repos"][0]["sha"], newer.as_str());
        let snapshot = refreshed.checkouts.get("app").expect("the refreshed clone is recorded");
        assert_eq!(snapshot.sha(), newer);

        assert!(prepare(root.path(), &ws, Some("snap-1")).await.expect("a later agent").skipped);
        assert!(prepare(root.path(), &ws, None).await.expect("a later agent").skipped);
        assert_eq!(read(&root.path().join("runs")), "run\nrun\n");
    }

    #[tokio::test]
    async fn a_snapshot_at_the_ref_s_head_runs_no_setup_again() {
        let upstream = Upstream::new();
        let root = tempfile::tempdir().expect("a temporary directory");
        let ws = workspace(vec![upstream.repo("app", None)], vec![step("count", "echo run >> runs")]);
        prepare(root.path(), &ws, None).await.expect("prepared in the snapshot's sandbox");
        let refreshed = prepare(root.path(), &ws, Some("snap-1")).await.expect("refreshed");
        assert!(!refreshed.skipped);
        assert_eq!(read(&root.path().join("runs")), "run\n");
        let head = crate::git::tests::git(&root.path().join("app"), &["rev-parse", "HEAD"]);
        assert_eq!(refreshed.checkouts.get("app").map(|s| s.sha().to_owned()), Some(head), "recorded for the run");
    }

    /// (1.3) A step that declares its inputs runs again only when the move
    /// changed one of them; a step that declares none runs on any move.
    #[tokio::test]
    async fn a_snapshot_runs_again_only_the_steps_whose_inputs_changed() {
        let upstream = Upstream::new();
        let root = tempfile::tempdir().expect("a temporary directory");
        let with_inputs = |name: &str, inputs: &[&str]| SetupStep {
            inputs: Some(inputs.iter().map(|input| (*input).to_owned()).collect()),
            ..step(name, &format!("echo {name} >> runs"))
        };
        let ws = workspace(
            vec![upstream.repo("app", Some("main"))],
            vec![
                with_inputs("deps", &["app/deps.lock"]),
                with_inputs("docs", &["./app/docs/"]),
                step("any", "echo any >> runs"),
            ],
        );
        prepare(root.path(), &ws, None).await.expect("prepared in the snapshot's sandbox");
        assert_eq!(read(&root.path().join("runs")), "deps\ndocs\nany\n");

        upstream.commit("docs/guide.md", "a new page");
        prepare(root.path(), &ws, Some("snap-1")).await.expect("refreshed");
        assert_eq!(read(&root.path().join("runs")), "deps\ndocs\nany\ndocs\nany\n", "deps.lock did not change");

        upstream.commit("deps.lock", "pinned");
        prepare(root.path(), &ws, Some("snap-2")).await.expect("refreshed again");
        assert_eq!(read(&root.path().join("runs")), "deps\ndocs\nany\ndocs\nany\ndeps\nany\n");
    }

    #[tokio::test]
    async fn a_clone_changed_since_the_snapshot_is_left_as_it_is() {
        let upstream = Upstream::new();
        let root = tempfile::tempdir().expect("a temporary directory");
        let ws = workspace(vec![upstream.repo("app", None)], vec![step("count", "echo run >> runs")]);
        prepare(root.path(), &ws, None).await.expect("prepared");
        let app = root.path().join("app");
        let before = crate::git::tests::git(&app, &["rev-parse", "HEAD"]);
        std::fs::write(app.join("README"), "a turn's change").expect("writable");
        upstream.commit("NEWS", "since the snapshot");
        prepare(root.path(), &ws, Some("snap-1")).await.expect("refreshed");
        assert_eq!(crate::git::tests::git(&app, &["rev-parse", "HEAD"]), before);
        assert_eq!(read(&app.join("README")), "a turn's change");
        assert_eq!(read(&root.path().join("runs")), "run\n");
    }

    /// A snapshot's files reach the new sandbox with other inode numbers
    /// and change times (here: `cp -a`): the clone is taken as untouched
    /// without git reading every file again, and a change of a file's size
    /// is still seen.
    #[tokio::test]
    async fn a_copied_clone_is_compared_by_size_and_time_and_a_change_is_still_seen() {
        let upstream = Upstream::new();
        let made = tempfile::tempdir().expect("a temporary directory");
        let ws = workspace(vec![upstream.repo("app", None)], vec![step("count", "echo run >> runs")]);
        prepare(made.path(), &ws, None).await.expect("prepared in the snapshot's sandbox");
        let copy = |changed: Option<&str>| {
            let to = copied_sandbox(made.path());
            if let Some(text) = changed {
                std::fs::write(to.path().join("app/README"), text).expect("writable");
            }
            to
        };
        let upstream_head = upstream.commit("NEWS", "since the snapshot");

        let untouched = copy(None);
        let app = untouched.path().join("app");
        prepare(untouched.path(), &ws, Some("snap-1")).await.expect("refreshed");
        assert_eq!(crate::git::tests::git(&app, &["config", "core.checkStat"]), "minimal");
        assert_eq!(crate::git::tests::git(&app, &["config", "core.trustCtime"]), "false");
        assert_eq!(crate::git::tests::git(&app, &["rev-parse", "HEAD"]), upstream_head, "taken as untouched: moved");

        let changed = copy(Some("a turn's change, longer than the file was"));
        let app = changed.path().join("app");
        let before = crate::git::tests::git(&app, &["rev-parse", "HEAD"]);
        prepare(changed.path(), &ws, Some("snap-1")).await.expect("refreshed");
        assert_eq!(crate::git::tests::git(&app, &["rev-parse", "HEAD"]), before, "the changed clone is left");
        assert_eq!(read(&app.join("README")), "a turn's change, longer than the file was");
    }

    /// A copy of the workspace `made` as a sandbox made from its snapshot
    /// finds it: the same contents and modification times, other inode
    /// numbers and change times.
    fn copied_sandbox(made: &Path) -> tempfile::TempDir {
        let to = tempfile::tempdir().expect("a temporary directory");
        let copied = std::process::Command::new("cp")
            .args(["-a", &format!("{}/.", made.display()), &to.path().display().to_string()])
            .status()
            .expect("run cp");
        assert!(copied.success());
        to
    }

    /// The copy's other inode numbers and change times stay in its index
    /// (git no longer compares them there): the run's clean check does not
    /// either, and the clone is watched from the refresh on, as a fresh
    /// one is.
    #[tokio::test]
    async fn a_clone_copied_from_a_snapshot_is_known_clean_without_git() {
        let upstream = Upstream::new();
        let made = tempfile::tempdir().expect("a temporary directory");
        let ws = workspace(vec![upstream.repo("app", None)], vec![]);
        prepare(made.path(), &ws, None).await.expect("prepared in the snapshot's sandbox");
        // A snapshot is older than the sandboxes made from it: its files
        // were written seconds before its index, none of them racy.
        let files = crate::git::tests::git(&made.path().join("app"), &["ls-files"]);
        let touched = std::process::Command::new("touch")
            .current_dir(made.path().join("app"))
            .args(["-h", "-d", "@1700000000"])
            .args(files.lines())
            .status()
            .expect("run touch");
        assert!(touched.success());
        crate::git::tests::git(&made.path().join("app"), &["update-index", "--refresh"]);
        let copy = copied_sandbox(made.path());

        let refreshed = prepare(copy.path(), &ws, Some("snap-1")).await.expect("refreshed");
        let app = copy.path().join("app");
        let snapshot = refreshed.checkouts.get("app").expect("the refreshed clone is recorded");
        assert_eq!(snapshot.still_clean(&app), Ok(()), "the run's refresh needs no git");
        assert_eq!(snapshot.unchanged(&app), Ok(()), "watched since the refresh: no file is read either");
        let full = crate::git::Snapshot::take(&app, crate::git::StatCheck::Full).expect("a detached clone");
        assert!(full.still_clean(&app).is_err(), "every field compared: the copy's inode numbers differ");
    }

    #[tokio::test]
    async fn a_stale_record_is_removed_before_preparing() {
        let root = tempfile::tempdir().expect("a temporary directory");
        let old = workspace(vec![], vec![step("old", "true")]);
        prepare(root.path(), &old, None).await.expect("first");
        assert_eq!(recorded_fingerprint(root.path()), Some(fingerprint(&old)));

        let checking = workspace(vec![], vec![step("new", "test ! -e .standby/state.json")]);
        prepare(root.path(), &checking, None).await.expect("the record is gone while setup runs");
        assert_eq!(recorded_fingerprint(root.path()), Some(fingerprint(&checking)));

        let state = root.path().join(".standby/state.json");
        let record = read(&state).replace("\"prepared\"", "\"preparing\"");
        std::fs::write(&state, record).expect("writable");
        assert_eq!(recorded_fingerprint(root.path()), None);
        let count = workspace(vec![], vec![step("count", "echo run >> runs")]);
        std::fs::write(&state, "not JSON").expect("writable");
        assert!(!prepare(root.path(), &count, None).await.expect("an unreadable record").skipped);
        assert!(prepare(root.path(), &count, None).await.expect("recorded again").skipped);
        assert_eq!(read(&root.path().join("runs")), "run\n");

        let broken = workspace(vec![], vec![step("broken", "exit 1")]);
        prepare(root.path(), &broken, None).await.expect_err("fails");
        assert_eq!(recorded_fingerprint(root.path()), None);
        assert!(!root.path().join(".standby/state.json").exists());
    }

    #[tokio::test]
    async fn a_failed_step_is_named_with_its_status() {
        let root = tempfile::tempdir().expect("a temporary directory");
        let ws = workspace(vec![], vec![step("deps", "exit 3"), step("never", "touch never")]);
        let error = prepare(root.path(), &ws, None).await.expect_err("fails");
        assert!(
            matches!(&error, PrepareError::SetupFailed { name, status, .. }
                if name == "deps" && status == "exit status 3"),
            "{error}"
        );
        let message = error.to_string();
        assert!(message.contains("\"deps\"") && message.contains("exit status 3"), "{message}");
        assert!(!root.path().join("never").exists());

        let ws = workspace(vec![], vec![step("signalled", "kill -9 $$")]);
        let error = prepare(root.path(), &ws, None).await.expect_err("killed");
        assert!(error.to_string().contains("killed by signal 9"), "{error}");
    }

    #[tokio::test]
    async fn a_timed_out_step_has_its_whole_group_killed() {
        let root = tempfile::tempdir().expect("a temporary directory");
        let mut slow = step("slow", "sleep 1000 & echo $! > bg.pid; wait");
        slow.timeout_s = Some(1);
        // Bounded so that a regression (the step's group left alive, the
        // wait never returning) fails instead of hanging the suite.
        let ws = workspace(vec![], vec![slow]);
        let error = tokio::time::timeout(Duration::from_secs(30), prepare(root.path(), &ws, None))
            .await
            .expect("prepare returns once the group is killed")
            .expect_err("times out");
        assert!(matches!(&error, PrepareError::SetupTimedOut { name, timeout_s: 1 } if name == "slow"), "{error}");
        let pid = read(&root.path().join("bg.pid"));
        let stat = format!("/proc/{}/stat", pid.trim());
        // The orphaned sleep is reaped by init, not by us: poll for it.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match std::fs::read_to_string(&stat) {
                Err(_) => break,
                Ok(stat) if stat.contains(") Z ") => break,
                Ok(stat) => {
                    assert!(Instant::now() < deadline, "still running: {stat}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        let log = read(&root.path().join(".standby/setup.log"));
        assert!(log.contains("timed out"), "{log}");
    }

    #[tokio::test]
    async fn a_step_that_cannot_start_is_named() {
        let root = tempfile::tempdir().expect("a temporary directory");
        let ws = workspace(
            vec![],
            vec![SetupStep {
                name: "missing".to_owned(),
                command: vec!["/nonexistent/standby-setup".to_owned()],
                cwd: None,
                timeout_s: None,
                inputs: None,
            }],
        );
        let error = prepare(root.path(), &ws, None).await.expect_err("no such program");
        let message = error.to_string();
        assert!(matches!(error, PrepareError::SetupSpawn { .. }), "{message}");
        assert!(message.contains("/nonexistent/standby-setup"), "{message}");

        let mut empty = step("empty", "");
        empty.command.clear();
        let error = prepare(root.path(), &workspace(vec![], vec![empty]), None).await.expect_err("an empty command");
        assert!(matches!(error, PrepareError::SetupEmpty { .. }), "{error}");
    }

    #[tokio::test]
    async fn paths_leaving_the_workspace_are_refused() {
        let upstream = Upstream::new();
        let root = tempfile::tempdir().expect("a temporary directory");
        let error = prepare(root.path(), &workspace(vec![upstream.repo("../x", None)], vec![]), None)
            .await
            .expect_err("a repo outside");
        assert!(matches!(error, PrepareError::Path { .. }), "{error}");
        assert!(error.to_string().contains("../x"), "{error}");

        let mut outside = step("outside", "true");
        outside.cwd = Some("/etc".to_owned());
        let error = prepare(root.path(), &workspace(vec![], vec![outside]), None).await.expect_err("a cwd outside");
        assert!(matches!(error, PrepareError::Path { .. }), "{error}");
        assert!(error.to_string().contains("\"outside\""), "{error}");

        let mut missing = step("missing-cwd", "true");
        missing.cwd = Some("nowhere".to_owned());
        let error = prepare(root.path(), &workspace(vec![], vec![missing]), None).await.expect_err("a missing cwd");
        assert!(matches!(error, PrepareError::Io { .. }), "{error}");
        assert!(error.to_string().contains("nowhere"), "{error}");
    }
}
