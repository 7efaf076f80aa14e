//! Per-turn hygiene: the files that hold one run's data are removed when
//! the run ends (exited, cancelled, failed), and again when the standby is
//! ready, before any run can be installed (a previous agent on the
//! workspace may have been killed before it could clean up), so a
//! follow-up turn in the same sandbox never sees an earlier turn's data.
//!
//! Removed: the attachments directory, `metadata.json`, the git credential
//! store, and every `credential.helper` entry in a prepared repo's own
//! configuration that points at that store. Cloud credentials and secrets
//! are only ever in the run's environment, which ends with the run.

use std::io::{self, ErrorKind};
use std::path::Path;

use standby_protocol::Repo;
use standby_protocol::layout::StateDir;

use crate::paths::resolve_inside;

/// Removes one run's files from the workspace at `root`, whose repos are
/// `repos`. Best effort: a file that cannot be removed is logged (by path,
/// never by content) and the rest are still removed.
pub(crate) async fn remove_run_files(root: &Path, repos: &[Repo]) {
    let owned = root.to_path_buf();
    let _ = crate::process::off_runtime(move || remove_files(&owned)).await;
    let needle = StateDir::of(root).git_credentials().display().to_string();
    for repo in repos {
        let Ok(dest) = resolve_inside(root, &repo.path) else {
            continue;
        };
        if !dest.join(".git").exists() {
            continue;
        }
        match crate::git::unset_credential_helpers(repo, &dest, &needle).await {
            Ok(0) => {}
            Ok(removed) => {
                tracing::info!(path = repo.path, removed, "credential helpers pointing at the run's store removed")
            }
            Err(e) => tracing::warn!(path = repo.path, error = %e, "cannot clean the repository's credential helpers"),
        }
    }
}

/// `.standby/` as a run must find it: ignored by git, and without an
/// earlier run's files. Blocking; called when preparation ends, because
/// done after the assignment it held back every install call by about a
/// millisecond (docs/benchmarks.md).
pub(crate) fn ready_state_dir(root: &Path) -> io::Result<()> {
    // `.standby/` holds credentials; a repo checked out at the workspace
    // root must never pick them up with `git add -A`. Written only when it
    // is not already so (an earlier turn left it).
    let gitignore = StateDir::of(root).gitignore();
    if std::fs::read(&gitignore).ok().as_deref() != Some(b"*\n".as_slice()) {
        crate::paths::write_run_file_now(&gitignore, b"*\n", 0o644)?;
    }
    // Only the files, to keep git out of preparation's end: a helper entry
    // left behind points at the next run's store or at nothing.
    remove_files(root);
    Ok(())
}

/// The files of [`remove_run_files`], without the repos' configuration:
/// blocking, for a caller already off the runtime.
fn remove_files(root: &Path) {
    let state_dir = StateDir::of(root);
    for file in [state_dir.metadata_file(), state_dir.git_credentials()] {
        match std::fs::remove_file(&file) {
            Ok(()) => tracing::debug!(file = %file.display(), "run file removed"),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(file = %file.display(), error = %e, "cannot remove a run file"),
        }
    }
    let dir = state_dir.attachments_dir();
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => tracing::debug!(dir = %dir.display(), "attachments removed"),
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "cannot remove the attachments"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn git(dir: &Path, args: &[&str]) -> String {
        let output = std::process::Command::new("git").args(args).current_dir(dir).output().expect("git runs");
        assert!(output.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    #[tokio::test]
    async fn a_runs_files_and_helpers_pointing_at_its_store_are_removed() {
        let root = tempfile::tempdir().expect("a temporary directory");
        let root = root.path();
        let app = root.join("app");
        std::fs::create_dir_all(&app).expect("create the repo");
        git(&app, &["init", "-q"]);
        let state_dir = StateDir::of(root);
        let store = state_dir.git_credentials();
        std::fs::create_dir_all(state_dir.attachments_dir()).expect("create the attachments dir");
        std::fs::write(state_dir.attachments_dir().join("spec.md"), "spec").expect("write");
        std::fs::write(state_dir.metadata_file(), "{}").expect("write");
        std::fs::write(&store, "https://u:turn1@git.example\n").expect("write");
        git(&app, &["config", "--local", "--add", "credential.helper", &format!("store --file={}", store.display())]);
        git(&app, &["config", "--local", "--add", "credential.helper", "cache"]);

        let repo =
            Repo { url: "https://git.example/app.git".into(), path: "app".into(), git_ref: None, expected_sha: None };
        remove_run_files(root, std::slice::from_ref(&repo)).await;

        assert!(!state_dir.attachments_dir().exists() && !state_dir.metadata_file().exists() && !store.exists());
        assert_eq!(git(&app, &["config", "--local", "--get-all", "credential.helper"]).trim(), "cache");
        // Nothing left: a second pass is a no-op.
        remove_run_files(root, &[repo]).await;
    }

    #[test]
    fn a_ready_state_dir_is_ignored_by_git_and_holds_no_earlier_runs_files() {
        let root = tempfile::tempdir().expect("a temporary directory");
        let root = root.path();
        let state_dir = StateDir::of(root);
        std::fs::create_dir_all(state_dir.attachments_dir()).expect("create the attachments dir");
        std::fs::write(state_dir.attachments_dir().join("spec.md"), "spec").expect("write");
        std::fs::write(state_dir.metadata_file(), "{}").expect("write");
        std::fs::write(state_dir.git_credentials(), "https://u:turn1@git.example\n").expect("write");
        // A `.gitignore` someone changed is written again.
        std::fs::write(state_dir.gitignore(), "metadata.json\n").expect("write");

        ready_state_dir(root).expect("the state directory is made ready");

        assert_eq!(std::fs::read_to_string(state_dir.gitignore()).expect("read"), "*\n");
        assert!(!state_dir.attachments_dir().exists());
        assert!(!state_dir.metadata_file().exists() && !state_dir.git_credentials().exists());
        // Ready already: a second pass changes nothing and does not fail.
        ready_state_dir(root).expect("ready again");
        assert_eq!(std::fs::read_to_string(state_dir.gitignore()).expect("read"), "*\n");
    }
}
