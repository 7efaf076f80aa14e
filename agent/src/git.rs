//! The `git` command line, driven for preparation (clone) and for the
//! post-assignment refresh.
//!
//! The CLI rather than a library: it honours the sandbox's own git
//! configuration, credential helpers and proxies exactly like the run's own
//! git calls will, so a workspace that prepares also works for the run.
//! Every checkout is detached at an exact commit, so what the run sees is
//! what `expected_sha` (or the ref's head at that moment) says, regardless of
//! local branches left over from preparation.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};

use standby_protocol::Repo;
use tokio::process::Command;

use crate::process::{child_env, register, unregister};

mod clean;
mod watch;

pub use clean::{Snapshot, StatCheck};

/// `http.lowSpeedLimit` (bytes per second) and `http.lowSpeedTime`
/// (seconds): a transfer slower than the limit for that long fails.
const LOW_SPEED_LIMIT: &str = "1";
const LOW_SPEED_TIME: &str = "60";

/// How many trailing lines of git's stderr an error keeps: enough for
/// git's "fatal:" line and its hint, without flooding a report.
const STDERR_LINES: usize = 5;

/// Variables that point git at another repository than the one it runs in;
/// inherited from a git hook or a wrapper they would make every call act on
/// the wrong repository.
const REPO_LOCATING_VARIABLES: &[&str] = &[
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_NAMESPACE",
];

/// A failed git operation. `url` is always stripped of userinfo
/// (`user:password@`), and so is git's stderr.
#[derive(Debug, thiserror::Error)]
pub enum GitError {
    #[error("git {op} of {url} in {path}: cannot run git: {source}")]
    Spawn { op: String, url: String, path: PathBuf, source: io::Error },
    #[error("git {op} of {url} in {path} failed with {status}: {stderr}")]
    Failed { op: String, url: String, path: PathBuf, status: String, stderr: String },
    #[error("cannot clone {url} into {path}: it exists, is not empty, and is not a clone of that repository")]
    NotThatRepo { url: String, path: PathBuf },
    #[error("cannot clone {url} into {path}: {source}")]
    Destination { url: String, path: PathBuf, source: io::Error },
    #[error("{what} of {url} is neither in {path} nor on origin: {detail}")]
    UnknownRevision { what: String, url: String, path: PathBuf, detail: String },
    #[error("expected_sha {sha:?} of {url} is not a commit SHA")]
    BadExpectedSha { sha: String, url: String },
    #[error("ref {name:?} of {url} starts with '-': git would read it as an option")]
    BadRef { name: String, url: String },
    #[error("git {op} of {url} in {path} printed {output:?}, not a commit SHA")]
    NotASha { op: String, url: String, path: PathBuf, output: String },
}

/// `url` without userinfo, query string and fragment, for logs and errors:
/// a token in a clone URL (`https://x-access-token:…@host/…`) must never
/// reach either. The one helper is [`crate::urls::describe_url`].
pub use crate::urls::describe_url as redact_url;

/// The userinfo of `url` (`user:password`), if it has one.
fn userinfo(url: &str) -> Option<&str> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    authority.rfind('@').map(|at| &authority[..at])
}

/// Removes every `credential.helper` entry of `dir`'s own repository
/// configuration whose value mentions `needle` (the path of a credential
/// store the agent wrote), so nothing points git at a removed file. Returns
/// how many were removed.
pub async fn unset_credential_helpers(repo: &Repo, dir: &Path, needle: &str) -> Result<usize, GitError> {
    let empty = BTreeMap::new();
    let git = Git { url: &repo.url, dir, extra_env: &empty };
    let Some(values) = git.query("config", &["config", "--local", "--get-all", "credential.helper"]).await? else {
        return Ok(0);
    };
    let mut removed = 0;
    for value in values.lines().filter(|value| value.contains(needle)) {
        git.run("config", &["config", "--local", "--fixed-value", "--unset-all", "credential.helper", value]).await?;
        removed += 1;
    }
    Ok(removed)
}

/// Describes how a process ended, the way errors name it:
/// `exit status 3` or `killed by signal 9`.
pub(crate) fn describe_status(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => status.to_string(),
    }
}

/// Runs git for one repository: the redacted URL for messages, the
/// directory it runs in, and the extra environment of the run (credential
/// configuration), never logged.
struct Git<'a> {
    url: &'a str,
    dir: &'a Path,
    extra_env: &'a BTreeMap<String, String>,
}

impl Git<'_> {
    fn redacted_url(&self) -> String {
        redact_url(self.url)
    }

    /// Runs `git <args>` in `self.dir`; its trimmed stdout on success.
    async fn run(&self, op: &str, args: &[&str]) -> Result<String, GitError> {
        let output = self.output(op, args).await?;
        if output.status.success() {
            return Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned());
        }
        Err(GitError::Failed {
            op: op.to_owned(),
            url: self.redacted_url(),
            path: self.dir.to_path_buf(),
            status: describe_status(output.status),
            stderr: self.stderr_tail(&output.stderr),
        })
    }

    /// Runs `git <args>` and says only whether it succeeded: for queries
    /// whose failure is an answer (`rev-parse --verify`).
    async fn query(&self, op: &str, args: &[&str]) -> Result<Option<String>, GitError> {
        let output = self.output(op, args).await?;
        Ok(output.status.success().then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned()))
    }

    async fn output(&self, op: &str, args: &[&str]) -> Result<std::process::Output, GitError> {
        let mut command = Command::new("git");
        command
            .args(args)
            .current_dir(self.dir)
            .env_clear()
            // A transfer with no progress for 60 s fails (the environment
            // may say otherwise); a server that never answers at all is
            // left to the preparation or install bound, which kills the
            // whole group.
            .env("GIT_HTTP_LOW_SPEED_LIMIT", LOW_SPEED_LIMIT)
            .env("GIT_HTTP_LOW_SPEED_TIME", LOW_SPEED_TIME)
            .envs(child_env())
            .env("GIT_TERMINAL_PROMPT", "0")
            .envs(self.extra_env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        for name in REPO_LOCATING_VARIABLES {
            command.env_remove(name);
        }
        let spawn_error = |source| GitError::Spawn {
            op: op.to_owned(),
            url: self.redacted_url(),
            path: self.dir.to_path_buf(),
            source,
        };
        let child = crate::process::spawn(command).await.map_err(spawn_error)?;
        let _registration = child.id().map(Registration::new);
        child.wait_with_output().await.map_err(spawn_error)
    }

    /// The last lines of git's stderr, on one line, with the URL's
    /// credentials removed wherever git repeated them.
    fn stderr_tail(&self, stderr: &[u8]) -> String {
        let mut text = String::from_utf8_lossy(stderr).replace(self.url, &self.redacted_url());
        if let Some(userinfo) = userinfo(self.url) {
            text = text.replace(&format!("{userinfo}@"), "");
            if let Some((_, password)) = userinfo.split_once(':')
                && !password.is_empty()
            {
                text = text.replace(password, "[REDACTED]");
            }
        }
        let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        let tail = &lines[lines.len().saturating_sub(STDERR_LINES)..];
        if tail.is_empty() { "no error output".to_owned() } else { tail.join("; ") }
    }

    /// A full commit SHA from `output`, or an error saying what git printed.
    fn sha(&self, op: &str, output: String) -> Result<String, GitError> {
        if is_full_sha(&output) {
            Ok(output)
        } else {
            Err(GitError::NotASha { op: op.to_owned(), url: self.redacted_url(), path: self.dir.to_path_buf(), output })
        }
    }

    /// The commit `rev` names locally, if any.
    async fn commit_of(&self, rev: &str) -> Result<Option<String>, GitError> {
        let peeled = format!("{rev}^{{commit}}");
        match self.query("rev-parse", &["rev-parse", "--verify", "--quiet", &peeled]).await? {
            Some(output) => self.sha("rev-parse", output).map(Some),
            None => Ok(None),
        }
    }

    /// Updates every remote branch and tag; tags are forced because a
    /// moved tag on the remote must win over the stale local one.
    async fn fetch_all(&self) -> Result<(), GitError> {
        self.run("fetch", &["fetch", "--force", "--tags", "--prune", "--quiet", "origin"]).await.map(drop)
    }

    /// The commit to check out: `expected_sha` if set, else the remote's
    /// `ref` (a branch, then a tag, then a commit), else origin's default
    /// branch. What the regular fetch did not bring (a commit or ref outside
    /// branches and tags) is fetched by name.
    async fn target(&self, repo: &Repo) -> Result<String, GitError> {
        if let Some(sha) = &repo.expected_sha {
            if !looks_like_sha(sha) {
                return Err(GitError::BadExpectedSha { sha: sha.clone(), url: self.redacted_url() });
            }
            return self.local_or_fetched(std::slice::from_ref(sha), sha, "commit").await;
        }
        if let Some(name) = &repo.git_ref {
            if name.starts_with('-') {
                return Err(GitError::BadRef { name: name.clone(), url: self.redacted_url() });
            }
            let mut candidates = vec![format!("refs/remotes/origin/{name}"), format!("refs/tags/{name}")];
            if looks_like_sha(name) {
                candidates.push(name.clone());
            }
            return self.local_or_fetched(&candidates, name, "ref").await;
        }
        let default = "refs/remotes/origin/HEAD";
        if let Some(sha) = self.commit_of(default).await? {
            return Ok(sha);
        }
        self.run("remote set-head", &["remote", "set-head", "origin", "--auto"]).await?;
        self.commit_of(default).await?.ok_or_else(|| GitError::UnknownRevision {
            what: "the default branch".to_owned(),
            url: self.redacted_url(),
            path: self.dir.to_path_buf(),
            detail: "origin has no HEAD".to_owned(),
        })
    }

    async fn local_or_fetched(&self, candidates: &[String], name: &str, kind: &str) -> Result<String, GitError> {
        for candidate in candidates {
            if let Some(sha) = self.commit_of(candidate).await? {
                return Ok(sha);
            }
        }
        let fetched = self.output("fetch", &["fetch", "--quiet", "origin", name]).await?;
        let detail = if fetched.status.success() {
            match self.commit_of("FETCH_HEAD").await? {
                Some(sha) => return Ok(sha),
                None => "the fetched object is not a commit".to_owned(),
            }
        } else {
            self.stderr_tail(&fetched.stderr)
        };
        Err(GitError::UnknownRevision {
            what: format!("{kind} {name:?}"),
            url: self.redacted_url(),
            path: self.dir.to_path_buf(),
            detail,
        })
    }

    /// Detached, forced checkout: the tracked files become exactly the
    /// commit's, while untracked and ignored files (what setup built) stay.
    async fn checkout(&self, sha: &str) -> Result<(), GitError> {
        self.run("checkout", &["checkout", "--quiet", "--force", "--detach", sha]).await.map(drop)
    }

    /// [`Git::checkout`] of `rev`, `false` where git refused it (an unknown
    /// commit, say): the caller falls back to fetching it.
    async fn try_checkout(&self, rev: &str) -> Result<bool, GitError> {
        Ok(self.query("checkout", &["checkout", "--quiet", "--force", "--detach", rev]).await?.is_some())
    }
}

/// Unregisters a child once its owner is done with it, also when the
/// owning future is dropped (`kill_on_drop` then kills it and tokio reaps
/// it), and kills its process group: git's transport helpers
/// (`git-remote-https`, `ssh`) die with it, and the reaper reaps them.
struct Registration(u32);

impl Registration {
    fn new(pid: u32) -> Self {
        register(pid);
        Self(pid)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(pgid) = i32::try_from(self.0) {
            // ESRCH: the group is already empty, which is the goal.
            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), nix::sys::signal::Signal::SIGKILL);
        }
        unregister(self.0);
    }
}

fn is_full_sha(text: &str) -> bool {
    matches!(text.len(), 40 | 64) && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether a ref may be an (abbreviated) commit SHA; only then is it looked
/// up as a revision by itself, so that a branch name never resolves to a
/// stale local branch.
fn looks_like_sha(text: &str) -> bool {
    (7..=64).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Clones `repo.url` into `dest` and checks out `repo.git_ref` (branch, tag
/// or commit; the remote's default branch when absent), detached.
///
/// A `dest` that already holds a clone of the same URL (a preparation
/// interrupted after the clone) is fetched and checked out instead of
/// failing; an empty directory is cloned into; anything else is refused.
pub async fn clone(repo: &Repo, dest: &Path) -> Result<(), GitError> {
    let no_env = BTreeMap::new();
    let destination_error =
        |source| GitError::Destination { url: redact_url(&repo.url), path: dest.to_path_buf(), source };
    let existing = match tokio::fs::symlink_metadata(dest).await {
        Ok(metadata) => Some(metadata),
        Err(error) if error.kind() == io::ErrorKind::NotFound => None,
        Err(error) => return Err(destination_error(error)),
    };
    let git = Git { url: &repo.url, dir: dest, extra_env: &no_env };
    let fresh = match existing {
        None => true,
        Some(metadata) if metadata.is_dir() => is_empty_dir(dest).await.map_err(destination_error)?,
        Some(_) => false,
    };
    if fresh {
        tokio::fs::create_dir_all(dest).await.map_err(destination_error)?;
        // Cloned into "." from inside `dest`: git runs there anyway, and a
        // relative `dest` would otherwise be taken relative to itself.
        git.run("clone", &["clone", "--quiet", "--no-checkout", "--", &repo.url, "."]).await?;
    } else if is_clone_of(&git, dest).await? {
        git.fetch_all().await?;
    } else {
        return Err(GitError::NotThatRepo { url: redact_url(&repo.url), path: dest.to_path_buf() });
    }
    let sha = git.target(repo).await?;
    git.checkout(&sha).await
}

async fn is_empty_dir(dir: &Path) -> io::Result<bool> {
    Ok(tokio::fs::read_dir(dir).await?.next_entry().await?.is_none())
}

/// Whether `dest` is the top of a work tree whose `origin` is exactly the
/// repo's URL. The top-level check keeps a workspace that itself sits inside
/// some other repository from being mistaken for a clone.
async fn is_clone_of(git: &Git<'_>, dest: &Path) -> Result<bool, GitError> {
    if tokio::fs::symlink_metadata(dest.join(".git")).await.is_err() {
        return Ok(false);
    }
    let Some(top) = git.query("rev-parse", &["rev-parse", "--show-toplevel"]).await? else {
        return Ok(false);
    };
    let same_dir = match (std::fs::canonicalize(&top), std::fs::canonicalize(dest)) {
        (Ok(top), Ok(dest)) => top == dest,
        _ => false,
    };
    if !same_dir {
        return Ok(false);
    }
    let origin = git.query("config", &["config", "--get", "remote.origin.url"]).await?;
    Ok(origin.as_deref() == Some(git.url))
}

/// Brings a prepared clone to what the run needs: checks out (detached)
/// `repo.expected_sha` if set, else the fetched head of `repo.git_ref`,
/// else of origin's default branch.
///
/// Origin is fetched first unless `expected_sha` is a full SHA already in
/// the clone: a pinned commit is the same wherever it came from, and the
/// usual run (submitted at the commit the pool was prepared at) then costs
/// no round trip to the remote on the critical path.
///
/// `extra_env` joins git's environment: the run's git credential
/// configuration (`GIT_CONFIG_COUNT`/`KEY`/`VALUE`). Returns the commit
/// checked out (a pinned SHA as it was given).
pub async fn refresh(repo: &Repo, dest: &Path, extra_env: &BTreeMap<String, String>) -> Result<String, GitError> {
    let git = Git { url: &repo.url, dir: dest, extra_env };
    // A pinned commit the clone has: one process, the checkout itself (it
    // fails when the commit is not here, and only then is it fetched). On
    // the usual warm run this is the refresh's whole cost.
    if let Some(sha) = repo.expected_sha.as_deref().filter(|sha| is_full_sha(sha))
        && git.try_checkout(&format!("{sha}^{{commit}}")).await?
    {
        return Ok(sha.to_owned());
    }
    git.fetch_all().await?;
    let sha = git.target(repo).await?;
    git.checkout(&sha).await?;
    Ok(sha)
}

/// Rewrites the index of the clone in `dest` with the files' current stat
/// data. A fresh clone's files are as new as its index, so git must treat
/// every one as possibly changed ("racily clean") and read them all on each
/// `checkout` until the index is written again from a later second: about
/// 50 ms per 20 MB on the run's critical path, spent here during
/// preparation instead.
pub async fn refresh_index(dest: &Path) -> Result<(), GitError> {
    let no_env = BTreeMap::new();
    let git = Git { url: "the checkout", dir: dest, extra_env: &no_env };
    git.run("update-index", &["update-index", "-q", "--refresh"]).await.map(drop)
}

/// Makes git in the clone in `dest` compare a file with its index entry by
/// size and whole-second modification time only (`core.checkStat
/// minimal`, `core.trustCtime false`). A clone copied into another
/// filesystem (a sandbox made from a snapshot image) has new inode
/// numbers and change times for every file: with git's default checks its
/// first `status` reads and hashes every file again (0.48 s for 2,000
/// files of 11 KB on the Engine's `fuse-overlayfs`, against 0.01 s
/// without), on the refresh that a cold run from the snapshot waits for,
/// and once per sandbox of a pool filling at once. Written to the clone's
/// own config, so that the run's git commands in it do not pay it either.
/// What git then no longer sees: a change that keeps a file's size and
/// the second of its modification time (git's check for files changed
/// within the index's own second still applies).
pub async fn trust_copied_files(dest: &Path) -> Result<(), GitError> {
    let no_env = BTreeMap::new();
    let git = Git { url: "the checkout", dir: dest, extra_env: &no_env };
    git.run("config", &["config", "core.checkStat", "minimal"]).await?;
    git.run("config", &["config", "core.trustCtime", "false"]).await.map(drop)
}

/// Whether the checkout in `dest` is still as a preparation left it: at
/// `sha`, with no tracked file changed (untracked files, such as a setup
/// step's output, do not count). `git status` also brings the index's stat
/// data up to date where it can write it, which a checkout made in another
/// container (other inode numbers, other change times) needs anyway.
pub async fn untouched_at(dest: &Path, sha: &str) -> Result<bool, GitError> {
    let no_env = BTreeMap::new();
    let git = Git { url: "the checkout", dir: dest, extra_env: &no_env };
    let head = git.run("rev-parse", &["rev-parse", "HEAD"]).await?;
    if git.sha("rev-parse", head)? != sha {
        return Ok(false);
    }
    let status = git.run("status", &["status", "--porcelain", "--untracked-files=no"]).await?;
    Ok(status.trim().is_empty())
}

/// The files that differ between the commits `from` and `to` of the clone
/// in `dest`, relative to the clone (a rename lists both names): which
/// declared setup inputs a refresh touched.
pub async fn changed_files(dest: &Path, from: &str, to: &str) -> Result<Vec<String>, GitError> {
    let no_env = BTreeMap::new();
    let git = Git { url: "the checkout", dir: dest, extra_env: &no_env };
    // NUL-separated and untrimmed: a file name may hold any other byte.
    let output = git.output("diff", &["diff", "--name-only", "--no-renames", "-z", from, to, "--"]).await?;
    if !output.status.success() {
        return Err(GitError::Failed {
            op: "diff".to_owned(),
            url: git.redacted_url(),
            path: dest.to_path_buf(),
            status: describe_status(output.status),
            stderr: git.stderr_tail(&output.stderr),
        });
    }
    let names = output.stdout.split(|byte| *byte == 0).filter(|name| !name.is_empty());
    Ok(names.map(|name| String::from_utf8_lossy(name).into_owned()).collect())
}

/// The commit checked out in `dest`.
pub async fn head_sha(dest: &Path) -> Result<String, GitError> {
    let no_env = BTreeMap::new();
    let git = Git { url: "the checkout", dir: dest, extra_env: &no_env };
    let output = git.run("rev-parse", &["rev-parse", "HEAD"]).await?;
    git.sha("rev-parse", output)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Runs git with a fixed identity and no global or system
    /// configuration, so the tests do not depend on the machine's.
    pub(crate) fn git(dir: &Path, args: &[&str]) -> String {
        let output = std::process::Command::new("git")
            .args(args)
            .current_dir(dir)
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_AUTHOR_NAME", "Standby Test")
            .env("GIT_AUTHOR_EMAIL", "test@standby.invalid")
            .env("GIT_COMMITTER_NAME", "Standby Test")
            .env("GIT_COMMITTER_EMAIL", "test@standby.invalid")
            .output()
            .expect("git runs");
        assert!(output.status.success(), "git {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// The files two commits differ in, both names of a rename among them;
    /// a commit the clone does not have is an error (the snapshot's refresh
    /// then runs every setup step again).
    #[tokio::test]
    async fn changed_files_lists_a_rename_by_both_names_and_fails_on_an_unknown_commit() {
        let upstream = Upstream::new();
        let before = upstream.commit("docs/a.md", "a");
        git(upstream.dir.path(), &["mv", "docs/a.md", "docs/b.md"]);
        git(upstream.dir.path(), &["commit", "--quiet", "-m", "renamed"]);
        let after = upstream.commit("deps.lock", "pinned");
        let mut changed = changed_files(upstream.dir.path(), &before, &after).await.expect("a diff");
        changed.sort();
        assert_eq!(changed, ["deps.lock", "docs/a.md", "docs/b.md"]);
        let unknown = "0".repeat(40);
        assert!(changed_files(upstream.dir.path(), &unknown, &after).await.is_err());
    }

    /// Amendment 4: a git transfer that makes no progress for 60 s fails.
    /// Every git the agent runs is told so (git's own low-speed bound).
    #[tokio::test]
    async fn every_git_fails_a_transfer_stalled_for_60_s() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let no_env = BTreeMap::new();
        let git = Git { url: "the checkout", dir: dir.path(), extra_env: &no_env };
        let env = git.run("env", &["-c", "alias.env=!env", "env"]).await.expect("git runs a shell alias");
        assert!(env.lines().any(|line| line == "GIT_HTTP_LOW_SPEED_LIMIT=1"), "{env}");
        assert!(env.lines().any(|line| line == "GIT_HTTP_LOW_SPEED_TIME=60"), "{env}");
    }

    /// A non-bare upstream repository with one commit on `main`, reached
    /// through a `file://` URL.
    pub(crate) struct Upstream {
        pub(crate) dir: tempfile::TempDir,
        pub(crate) url: String,
    }

    impl Upstream {
        pub(crate) fn new() -> Self {
            let dir = tempfile::tempdir().expect("a temporary directory");
            git(dir.path(), &["init", "--quiet", "--initial-branch=main"]);
            let url = format!("file://{}", dir.path().display());
            let upstream = Self { dir, url };
            upstream.commit("README", "first");
            upstream
        }

        /// Commits `content` into `file` on the current branch; its SHA.
        pub(crate) fn commit(&self, file: &str, content: &str) -> String {
            let path = self.dir.path().join(file);
            std::fs::create_dir_all(path.parent().expect("a file has a folder")).expect("writable");
            std::fs::write(path, content).expect("writable");
            git(self.dir.path(), &["add", file]);
            git(self.dir.path(), &["commit", "--quiet", "-m", content]);
            git(self.dir.path(), &["rev-parse", "HEAD"])
        }

        pub(crate) fn repo(&self, path: &str, git_ref: Option<&str>) -> Repo {
            Repo {
                url: self.url.clone(),
                path: path.to_owned(),
                git_ref: git_ref.map(str::to_owned),
                expected_sha: None,
            }
        }
    }

    fn read(dir: &Path, file: &str) -> String {
        std::fs::read_to_string(dir.join(file)).expect("a checked-out file")
    }

    #[test]
    fn urls_lose_their_userinfo() {
        assert_eq!(redact_url("https://user:hunter2@git.example/a.git"), "https://git.example/a.git");
        assert_eq!(redact_url("https://tok@en@git.example/a@b.git"), "https://git.example/a@b.git");
        assert_eq!(redact_url("file:///srv/a.git"), "file:///srv/a.git");
        assert_eq!(redact_url("git@host:a.git"), "git@host:a.git");
    }

    #[tokio::test]
    async fn clone_checks_out_the_default_branch() {
        let upstream = Upstream::new();
        let head = git(upstream.dir.path(), &["rev-parse", "HEAD"]);
        let work = tempfile::tempdir().expect("a temporary directory");
        let dest = work.path().join("app");
        clone(&upstream.repo("app", None), &dest).await.expect("clone");
        assert_eq!(head_sha(&dest).await.expect("a head"), head);
        assert_eq!(read(&dest, "README"), "first");
    }

    #[tokio::test]
    async fn clone_checks_out_a_branch_a_tag_or_a_commit() {
        let upstream = Upstream::new();
        let first = git(upstream.dir.path(), &["rev-parse", "HEAD"]);
        git(upstream.dir.path(), &["tag", "v1"]);
        git(upstream.dir.path(), &["checkout", "--quiet", "-b", "feature"]);
        let feature = upstream.commit("README", "feature");
        git(upstream.dir.path(), &["checkout", "--quiet", "main"]);
        upstream.commit("README", "second");
        let work = tempfile::tempdir().expect("a temporary directory");
        for (name, git_ref, expected) in
            [("branch", "feature", &feature), ("tag", "v1", &first), ("commit", first.as_str(), &first)]
        {
            let dest = work.path().join(name);
            clone(&upstream.repo(name, Some(git_ref)), &dest).await.expect(name);
            assert_eq!(&head_sha(&dest).await.expect("a head"), expected, "{name}");
        }
    }

    #[tokio::test]
    async fn clone_fetches_a_commit_outside_branches_and_tags() {
        let upstream = Upstream::new();
        git(upstream.dir.path(), &["checkout", "--quiet", "-b", "gone"]);
        let orphaned = upstream.commit("README", "orphaned");
        git(upstream.dir.path(), &["checkout", "--quiet", "main"]);
        git(upstream.dir.path(), &["update-ref", "refs/pull/1/head", &orphaned]);
        git(upstream.dir.path(), &["branch", "--quiet", "-D", "gone"]);
        let work = tempfile::tempdir().expect("a temporary directory");
        let dest = work.path().join("app");
        clone(&upstream.repo("app", Some("refs/pull/1/head")), &dest).await.expect("clone of a non-branch ref");
        assert_eq!(head_sha(&dest).await.expect("a head"), orphaned);
    }

    #[tokio::test]
    async fn clone_into_an_existing_clone_fetches_instead() {
        let upstream = Upstream::new();
        let work = tempfile::tempdir().expect("a temporary directory");
        let dest = work.path().join("app");
        let repo = upstream.repo("app", Some("main"));
        clone(&repo, &dest).await.expect("first clone");
        std::fs::write(dest.join("built"), "setup output").expect("writable");
        let second = upstream.commit("README", "second");
        clone(&repo, &dest).await.expect("second clone");
        assert_eq!(head_sha(&dest).await.expect("a head"), second);
        assert_eq!(read(&dest, "built"), "setup output");
    }

    #[tokio::test]
    async fn clone_refuses_a_foreign_directory() {
        let upstream = Upstream::new();
        let other = Upstream::new();
        let work = tempfile::tempdir().expect("a temporary directory");
        let dest = work.path().join("app");
        clone(&other.repo("app", None), &dest).await.expect("clone");
        let error = clone(&upstream.repo("app", None), &dest).await.expect_err("another repository");
        assert!(matches!(error, GitError::NotThatRepo { .. }), "{error}");
        assert!(error.to_string().contains(&dest.display().to_string()), "{error}");

        let plain = work.path().join("plain");
        std::fs::create_dir(&plain).expect("a directory");
        std::fs::write(plain.join("file"), "x").expect("writable");
        let error = clone(&upstream.repo("plain", None), &plain).await.expect_err("a non-empty directory");
        assert!(matches!(error, GitError::NotThatRepo { .. }), "{error}");
    }

    #[tokio::test]
    async fn clone_into_an_empty_directory() {
        let upstream = Upstream::new();
        let work = tempfile::tempdir().expect("a temporary directory");
        clone(&upstream.repo(".", None), work.path()).await.expect("clone into the empty directory");
        assert_eq!(read(work.path(), "README"), "first");
    }

    #[tokio::test]
    async fn refresh_checks_out_the_expected_sha() {
        let upstream = Upstream::new();
        let work = tempfile::tempdir().expect("a temporary directory");
        let dest = work.path().join("app");
        let mut repo = upstream.repo("app", Some("main"));
        clone(&repo, &dest).await.expect("clone");
        let wanted = upstream.commit("README", "second");
        upstream.commit("README", "third");
        repo.expected_sha = Some(wanted.clone());
        let sha = refresh(&repo, &dest, &BTreeMap::new()).await.expect("refresh");
        assert_eq!(sha, wanted);
        assert_eq!(head_sha(&dest).await.expect("a head"), wanted);
        assert_eq!(read(&dest, "README"), "second");
    }

    #[tokio::test]
    async fn refresh_fetches_an_expected_sha_outside_branches_and_tags() {
        let upstream = Upstream::new();
        let work = tempfile::tempdir().expect("a temporary directory");
        let dest = work.path().join("app");
        let mut repo = upstream.repo("app", Some("main"));
        clone(&repo, &dest).await.expect("clone");
        git(upstream.dir.path(), &["checkout", "--quiet", "-b", "pr"]);
        let wanted = upstream.commit("README", "pull request");
        git(upstream.dir.path(), &["checkout", "--quiet", "main"]);
        git(upstream.dir.path(), &["update-ref", "refs/pull/1/head", &wanted]);
        git(upstream.dir.path(), &["branch", "--quiet", "-D", "pr"]);
        repo.expected_sha = Some(wanted.clone());
        let sha = refresh(&repo, &dest, &BTreeMap::new()).await.expect("refresh");
        assert_eq!(sha, wanted);
        assert_eq!(read(&dest, "README"), "pull request");

        repo.expected_sha = Some("main".to_owned());
        let error = refresh(&repo, &dest, &BTreeMap::new()).await.expect_err("not a SHA");
        assert!(matches!(error, GitError::BadExpectedSha { .. }), "{error}");
    }

    #[tokio::test]
    async fn refresh_moves_to_the_new_head_of_the_ref() {
        let upstream = Upstream::new();
        let work = tempfile::tempdir().expect("a temporary directory");
        for (path, git_ref) in [("by-ref", Some("main")), ("by-default", None)] {
            clone(&upstream.repo(path, git_ref), &work.path().join(path)).await.expect("clone");
        }
        let new_head = upstream.commit("README", "second");
        for (path, git_ref) in [("by-ref", Some("main")), ("by-default", None)] {
            let dest = work.path().join(path);
            let sha = refresh(&upstream.repo(path, git_ref), &dest, &BTreeMap::new()).await.expect("refresh");
            assert_eq!(sha, new_head, "{path}");
            assert_eq!(read(&dest, "README"), "second", "{path}");
        }
    }

    #[tokio::test]
    async fn refresh_passes_the_extra_environment_to_git() {
        let upstream = Upstream::new();
        let work = tempfile::tempdir().expect("a temporary directory");
        let dest = work.path().join("app");
        let repo = upstream.repo("app", None);
        clone(&repo, &dest).await.expect("clone");
        // Forbidding the file transport through the environment proves
        // that the configuration reached git: the fetch then fails.
        let env = BTreeMap::from([
            ("GIT_CONFIG_COUNT".to_owned(), "1".to_owned()),
            ("GIT_CONFIG_KEY_0".to_owned(), "protocol.file.allow".to_owned()),
            ("GIT_CONFIG_VALUE_0".to_owned(), "never".to_owned()),
        ]);
        let error = refresh(&repo, &dest, &env).await.expect_err("a forbidden transport");
        assert!(matches!(error, GitError::Failed { .. }), "{error}");
        assert!(error.to_string().contains("git fetch"), "{error}");
        refresh(&repo, &dest, &BTreeMap::new()).await.expect("allowed without it");
    }

    /// A pinned commit the clone already has is checked out without a
    /// round trip to the remote: with the file transport forbidden, a
    /// fetch would fail.
    #[tokio::test]
    async fn refresh_to_a_pinned_commit_already_here_does_not_fetch() {
        let upstream = Upstream::new();
        let work = tempfile::tempdir().expect("a temporary directory");
        let dest = work.path().join("app");
        let mut repo = upstream.repo("app", None);
        clone(&repo, &dest).await.expect("clone");
        let prepared = head_sha(&dest).await.expect("a head");
        std::fs::write(dest.join("README"), "edited by setup").expect("writable");
        let offline = BTreeMap::from([
            ("GIT_CONFIG_COUNT".to_owned(), "1".to_owned()),
            ("GIT_CONFIG_KEY_0".to_owned(), "protocol.file.allow".to_owned()),
            ("GIT_CONFIG_VALUE_0".to_owned(), "never".to_owned()),
        ]);
        repo.expected_sha = Some(prepared.clone());
        let sha = refresh(&repo, &dest, &offline).await.expect("refresh without the remote");
        assert_eq!(sha, prepared);
        assert_eq!(read(&dest, "README"), "first", "tracked files are the commit's");

        let newer = upstream.commit("README", "second");
        repo.expected_sha = Some(newer);
        let error = refresh(&repo, &dest, &offline).await.expect_err("a commit it lacks needs the remote");
        assert!(error.to_string().contains("git fetch"), "{error}");
    }

    #[tokio::test]
    async fn unknown_refs_are_named() {
        let upstream = Upstream::new();
        let work = tempfile::tempdir().expect("a temporary directory");
        let dest = work.path().join("app");
        let error = clone(&upstream.repo("app", Some("no-such-branch")), &dest).await.expect_err("an unknown ref");
        assert!(matches!(error, GitError::UnknownRevision { .. }), "{error}");
        assert!(error.to_string().contains("no-such-branch"), "{error}");

        let error =
            clone(&upstream.repo("app", Some("--upload-pack=touch pwned")), &dest).await.expect_err("an option as ref");
        assert!(matches!(error, GitError::BadRef { .. }), "{error}");
    }

    #[tokio::test]
    async fn credentials_in_urls_stay_out_of_errors() {
        let work = tempfile::tempdir().expect("a temporary directory");
        let repo = Repo {
            url: "https://user:hunter2@127.0.0.1:1/app.git".to_owned(),
            path: "app".to_owned(),
            git_ref: None,
            expected_sha: None,
        };
        let error = clone(&repo, &work.path().join("app")).await.expect_err("nothing listens on port 1");
        let message = error.to_string();
        assert!(matches!(error, GitError::Failed { .. }), "{message}");
        assert!(!message.contains("hunter2"), "{message}");
        assert!(!message.contains("user:"), "{message}");
        assert!(message.contains("https://127.0.0.1:1/app.git"), "{message}");
        assert!(message.contains("exit status 128"), "{message}");
        assert!(format!("{error:?}").find("hunter2").is_none(), "{error:?}");
    }
}
