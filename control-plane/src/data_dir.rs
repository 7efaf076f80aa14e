//! The data directory's guard: every `serve` holds a shared lock on
//! `<data dir>/serve.lock` for as long as it runs (shared: the replicas of
//! one deployment on one machine may share a data directory), and
//! `standby-server prune` takes it exclusively, without waiting, to learn
//! whether a server runs on the directory. The kernel drops a lock with
//! its process, so a crashed server holds none: the lock says "a server
//! runs here" without a pid file's stale-pid guesswork. A prune holds it
//! until it is done; a `serve` started meanwhile waits for it.
//!
//! The instance id (`<data dir>/instance-id`) labels everything the
//! Docker provider makes.

use std::fs::{File, TryLockError};
use std::io;
use std::path::{Path, PathBuf};

/// The lock file of a data directory.
pub const LOCK_FILE: &str = "serve.lock";
/// The file holding the data directory's instance id.
pub const INSTANCE_FILE: &str = "instance-id";

/// A lock on a data directory, released when dropped (or when the
/// process ends, however it ends).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

fn open(dir: &Path) -> io::Result<(File, PathBuf)> {
    let path = dir.join(LOCK_FILE);
    let file = File::options().create(true).truncate(false).write(true).open(&path)?;
    Ok((file, path))
}

/// `serve`'s lock: shared; when a prune holds the directory, waits for it
/// (calling `waiting` first).
pub fn lock_for_serve(dir: &Path, waiting: impl FnOnce(&Path)) -> io::Result<DirLock> {
    let (file, path) = open(dir)?;
    match file.try_lock_shared() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            waiting(&path);
            file.lock_shared()?;
        }
        Err(TryLockError::Error(error)) => return Err(error),
    }
    Ok(DirLock { _file: file })
}

/// A prune's look at the directory.
#[derive(Debug)]
pub enum Probe {
    /// No server runs on it; the lock is held until dropped, so none
    /// starts meanwhile.
    Free(DirLock),
    /// A `serve` holds it.
    Held,
    /// No such directory: no server of it can run.
    NoDirectory,
}

/// Takes the directory's lock exclusively, without waiting.
pub fn lock_for_prune(dir: &Path) -> io::Result<Probe> {
    if !dir.is_dir() {
        return Ok(Probe::NoDirectory);
    }
    let (file, _) = open(dir)?;
    match file.try_lock() {
        Ok(()) => Ok(Probe::Free(DirLock { _file: file })),
        Err(TryLockError::WouldBlock) => Ok(Probe::Held),
        Err(TryLockError::Error(error)) => Err(error),
    }
}

/// The directory's instance id, when it has one.
pub fn instance_id(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(INSTANCE_FILE)).ok()?;
    let id = text.trim();
    (!id.is_empty()).then(|| id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_running_serve_is_seen_by_a_prune_and_a_crashed_one_is_not() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let serve = lock_for_serve(dir.path(), |_| panic!("nothing to wait for")).expect("locked");
        let replica = lock_for_serve(dir.path(), |_| panic!("replicas share it")).expect("shared");
        assert!(matches!(lock_for_prune(dir.path()), Ok(Probe::Held)));
        drop(serve);
        assert!(matches!(lock_for_prune(dir.path()), Ok(Probe::Held)), "one replica still runs");
        drop(replica);
        let Ok(Probe::Free(prune)) = lock_for_prune(dir.path()) else { panic!("no server runs") };
        drop(prune);
        assert!(matches!(lock_for_prune(&dir.path().join("missing")), Ok(Probe::NoDirectory)));
    }

    #[test]
    fn the_instance_id_is_read_trimmed() {
        let dir = tempfile::tempdir().expect("a temp dir");
        assert_eq!(instance_id(dir.path()), None);
        std::fs::write(dir.path().join(INSTANCE_FILE), "00ab\n").expect("write");
        assert_eq!(instance_id(dir.path()).as_deref(), Some("00ab"));
    }
}
