//! Paths that come from the server (repo paths, working directories,
//! attachment names) must stay inside the workspace: a spec or run that
//! names `../etc` or a symbolic link out of the sandbox's workspace must fail
//! loudly instead of writing elsewhere.

use std::io::{self, ErrorKind};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;

/// Why a path or file name from the server was refused.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("path is empty")]
    Empty,
    #[error("path {path:?} contains a NUL byte")]
    Nul { path: String },
    #[error("path {path:?} is absolute; it must be relative to the workspace")]
    Absolute { path: String },
    #[error("path {path:?} leaves the workspace")]
    Escapes { path: String },
    #[error("path {path:?} cannot be resolved at {at}: {source}")]
    Unresolvable { path: String, at: PathBuf, source: io::Error },
    #[error("{name:?} is not a plain file name: {reason}")]
    BadFileName { name: String, reason: &'static str },
}

/// Joins `relative` (a repo path, a setup or run `cwd`) onto the workspace
/// `root`, refusing anything that would leave it.
///
/// The check is first lexical (absolute paths and `..` components that climb
/// above the root are refused; `.` and `a/..` are fine), then physical: the
/// deepest part of the joined path that already exists is canonicalized and
/// must still lie under the canonicalized root, so a symbolic link inside the
/// workspace that points out of it is refused too. A path that resolves to
/// the root itself (`.`) is allowed.
pub fn resolve_inside(root: &Path, relative: &str) -> Result<PathBuf, PathError> {
    if relative.is_empty() {
        return Err(PathError::Empty);
    }
    let refuse = |make: fn(String) -> PathError| Err(make(relative.to_owned()));
    if relative.contains('\0') {
        return refuse(|path| PathError::Nul { path });
    }
    let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
    for component in Path::new(relative).components() {
        match component {
            Component::Prefix(_) | Component::RootDir => {
                return refuse(|path| PathError::Absolute { path });
            }
            Component::CurDir => {}
            Component::ParentDir => {
                if parts.pop().is_none() {
                    return refuse(|path| PathError::Escapes { path });
                }
            }
            Component::Normal(part) => parts.push(part),
        }
    }
    let joined: PathBuf = parts.iter().fold(root.to_path_buf(), |p, c| p.join(c));
    check_physically_inside(root, relative, &parts)?;
    Ok(joined)
}

/// Canonicalizes the deepest existing prefix of `root/parts...` and checks
/// it is under the canonical root. A prefix that exists but cannot be
/// canonicalized (a dangling symbolic link) is refused: where it would lead
/// cannot be checked.
fn check_physically_inside(root: &Path, relative: &str, parts: &[&std::ffi::OsStr]) -> Result<(), PathError> {
    for depth in (1..=parts.len()).rev() {
        let prefix = parts[..depth].iter().fold(root.to_path_buf(), |p, c| p.join(c));
        match std::fs::symlink_metadata(&prefix) {
            Err(error) if error.kind() == ErrorKind::NotFound => continue,
            Err(source) => return Err(unresolvable(relative, prefix, source)),
            Ok(_) => {}
        }
        let real = std::fs::canonicalize(&prefix).map_err(|source| unresolvable(relative, prefix.clone(), source))?;
        let real_root =
            std::fs::canonicalize(root).map_err(|source| unresolvable(relative, root.to_path_buf(), source))?;
        if !real.starts_with(&real_root) {
            return Err(PathError::Escapes { path: relative.to_owned() });
        }
        return Ok(());
    }
    Ok(())
}

fn unresolvable(relative: &str, at: PathBuf, source: io::Error) -> PathError {
    PathError::Unresolvable { path: relative.to_owned(), at, source }
}

/// Checks an attachment name is a plain file name.
///
/// Refused: empty, `.`, `..`, any `/` or `\`, a NUL byte, and any name that
/// contains `..` anywhere (`a..b` too). The contract fails the install for "a
/// name with a path separator or `..`"; refusing the substring is the
/// strictest reading, costs nothing real, and keeps the rule one line long
/// for server authors.
pub fn check_file_name(name: &str) -> Result<(), PathError> {
    let reason = if name.is_empty() {
        "it is empty"
    } else if name == "." {
        "it names the directory itself"
    } else if name.contains('/') || name.contains('\\') {
        "it contains a path separator"
    } else if name.contains("..") {
        "it contains `..`"
    } else if name.contains('\0') {
        "it contains a NUL byte"
    } else {
        return Ok(());
    };
    Err(PathError::BadFileName { name: name.to_owned(), reason })
}

/// Distinguishes temporary files of concurrent writes within this process;
/// the pid distinguishes processes.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Replaces `path` with `bytes` so that a reader (or a restart after a
/// crash) sees either the old content or the new one, never a torn file.
///
/// The temporary file lives in the same directory (a rename across file
/// systems is not atomic), is created `0o600` so nothing else can read it
/// while it is written, gets `mode` and an fsync before the rename, and the
/// directory is fsynced after it so the rename itself survives a crash.
pub async fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    replace_file(path, bytes, mode, Durability::Synced).await
}

/// [`write_atomic`] without the fsyncs, for a run's files (metadata, the
/// git credential store): they are worth nothing after a crash, which ends
/// the agent and with it the run, and each fsync would sit on the run's
/// critical path. Readers still never see a torn file.
pub async fn write_run_file(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    replace_file(path, bytes, mode, Durability::Volatile).await
}

/// [`write_run_file`], blocking: for a caller already off the runtime.
pub fn write_run_file_now(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    replace_file_now(path, bytes, mode, Durability::Volatile)
}

/// Whether a replaced file must survive a crash of the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durability {
    Synced,
    Volatile,
}

/// One trip to the blocking pool for the whole replacement: each
/// `tokio::fs` call is a trip of its own, and on the run's critical path
/// five of them per file cost more than the writing.
async fn replace_file(path: &Path, bytes: &[u8], mode: u32, durability: Durability) -> io::Result<()> {
    let (path, bytes) = (path.to_path_buf(), bytes.to_vec());
    tokio::task::spawn_blocking(move || replace_file_now(&path, &bytes, mode, durability))
        .await
        .unwrap_or_else(|error| Err(io::Error::other(format!("the task writing the file failed: {error}"))))
}

fn replace_file_now(path: &Path, bytes: &[u8], mode: u32, durability: Durability) -> io::Result<()> {
    let (dir, name) = match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => (dir, name),
        _ => {
            return Err(io::Error::new(ErrorKind::InvalidInput, format!("{} does not name a file", path.display())));
        }
    };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let temp = dir.join(format!(
        ".{}.{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = write_then_rename(&temp, path, bytes, mode, durability);
    if result.is_err() {
        // Best effort: the write already failed, and a leftover temp file
        // is harmless (its name never collides with a later one).
        let _ = std::fs::remove_file(&temp);
    }
    result?;
    match durability {
        Durability::Synced => std::fs::File::open(dir)?.sync_all(),
        Durability::Volatile => Ok(()),
    }
}

fn write_then_rename(temp: &Path, path: &Path, bytes: &[u8], mode: u32, durability: Durability) -> io::Result<()> {
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(temp)?;
    file.write_all(bytes)?;
    // Set explicitly: the mode given at creation is reduced by the umask.
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    if durability == Durability::Synced {
        file.sync_all()?;
    }
    drop(file);
    std::fs::rename(temp, path)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn root() -> tempfile::TempDir {
        tempfile::tempdir().expect("a temporary directory")
    }

    #[test]
    fn relative_paths_join_onto_the_root() {
        let dir = root();
        let root = dir.path();
        assert_eq!(resolve_inside(root, "app").expect("inside"), root.join("app"));
        assert_eq!(resolve_inside(root, "./a/b/../c/").expect("inside"), root.join("a/c"));
        assert_eq!(resolve_inside(root, ".").expect("the root"), root);
    }

    #[test]
    fn escapes_are_refused() {
        let dir = root();
        for path in ["../x", "a/../../b", "..", "a/b/../../../c"] {
            let error = resolve_inside(dir.path(), path).expect_err(path);
            assert!(matches!(error, PathError::Escapes { .. }), "{path}: {error}");
            assert!(error.to_string().contains(path), "{error}");
        }
    }

    #[test]
    fn absolute_and_empty_paths_are_refused() {
        let dir = root();
        let error = resolve_inside(dir.path(), "/etc").expect_err("absolute");
        assert!(matches!(error, PathError::Absolute { .. }), "{error}");
        assert!(error.to_string().contains("/etc"), "{error}");
        assert!(matches!(resolve_inside(dir.path(), ""), Err(PathError::Empty)));
        assert!(matches!(resolve_inside(dir.path(), "a\0b"), Err(PathError::Nul { .. })));
    }

    #[test]
    fn symlink_escapes_are_refused() {
        let dir = root();
        let outside = root();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("out")).expect("a symlink");
        for path in ["out", "out/app", "out/a/b"] {
            let error = resolve_inside(dir.path(), path).expect_err(path);
            assert!(matches!(error, PathError::Escapes { .. }), "{path}: {error}");
        }
        std::os::unix::fs::symlink("/nonexistent/standby", dir.path().join("dangling")).expect("a symlink");
        let error = resolve_inside(dir.path(), "dangling/x").expect_err("dangling");
        assert!(matches!(error, PathError::Unresolvable { .. }), "{error}");
    }

    #[test]
    fn symlinks_within_the_root_are_fine() {
        let dir = root();
        std::fs::create_dir(dir.path().join("real")).expect("a directory");
        std::os::unix::fs::symlink("real", dir.path().join("link")).expect("a symlink");
        assert_eq!(resolve_inside(dir.path(), "link/x").expect("inside"), dir.path().join("link/x"));
    }

    #[test]
    fn plain_file_names_pass() {
        for name in ["spec.md", ".env", "a.b.c", "with space"] {
            check_file_name(name).expect(name);
        }
    }

    #[test]
    fn bad_file_names_are_refused() {
        for name in ["", ".", "..", "a/b", "../x", "a\\b", "..hidden", "a..b", "a\0b"] {
            let error = check_file_name(name).expect_err(name);
            assert!(matches!(error, PathError::BadFileName { .. }), "{error}");
        }
        let error = check_file_name("x/../y").expect_err("separator");
        assert!(error.to_string().contains("x/../y"), "{error}");
    }

    #[tokio::test]
    async fn write_atomic_replaces_content_and_sets_mode() {
        let dir = root();
        let path = dir.path().join("state.json");
        write_atomic(&path, b"one", 0o600).await.expect("first write");
        write_atomic(&path, b"two", 0o644).await.expect("second write");
        assert_eq!(std::fs::read(&path).expect("readable"), b"two");
        let mode = std::fs::metadata(&path).expect("metadata").permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("listable")
            .map(|entry| entry.expect("an entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);
    }

    #[tokio::test]
    async fn write_atomic_fails_in_a_missing_directory() {
        let dir = root();
        let path = dir.path().join("missing/state.json");
        let error = write_atomic(&path, b"x", 0o600).await.expect_err("no dir");
        assert_eq!(error.kind(), ErrorKind::NotFound);
    }
}
