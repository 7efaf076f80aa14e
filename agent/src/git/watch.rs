//! An inotify watch of a clone from the end of preparation, so that the
//! warm run's clean check is a read of "nothing happened" instead of one
//! `lstat` per tracked file.
//!
//! What is watched is what [`super::Snapshot::still_clean`] looks at: every
//! directory holding a tracked path (from the index, the root included) and
//! the `.git` directory. An event counts when it names a tracked file or
//! directory, or `HEAD` or `index` in `.git`; an event about an untracked
//! name (a `__pycache__`, a log an MCP server writes, the agent's own
//! `.standby/`) does not, as untracked files do not count for the full
//! check either. The watch is armed *before* the full check that vouches for
//! the clone at the end of preparation, so a change in between is an event
//! too. At the refresh, the queue is drained without blocking, and
//! [`verdict`] says whether the clone is known unchanged or the full check
//! must run: on any counted event, an overflow of the kernel's queue, a
//! watch the kernel dropped (a directory removed or moved away, an unmount),
//! or a root or `.git` that is no longer the directory watched.
//!
//! What inotify does not report, and this watch therefore cannot see:
//! writes through a shared memory mapping, and writes through a hard link
//! whose name is outside the watched directories. Nothing of the agent's
//! does either; a process that does both after preparation defeats the
//! check. Directories are watched, not files, so a clone costs one watch
//! per tracked directory of the user's `max_user_watches`; more than
//! [`MAX_WATCHED_DIRS`], or a limit reached, and there is no watch: the full
//! check runs as before.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Mutex;

use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

/// A repository with more tracked directories than this is not watched.
pub(crate) const MAX_WATCHED_DIRS: usize = 4096;

/// Every change to a directory's entries or to a child's content or
/// attributes, and the watch's own end.
fn dir_mask() -> AddWatchFlags {
    AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
        | AddWatchFlags::IN_DONT_FOLLOW
}

/// The names of `.git` the clean check reads.
const GIT_FILES: [&[u8]; 2] = [b"HEAD", b"index"];

/// What one watch descriptor watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Watched {
    /// The clone's `.git` directory.
    GitDir,
    /// A tracked directory of the work tree, by its path relative to the
    /// root (empty for the root), `/`-separated as in the index.
    WorkDir(Vec<u8>),
}

/// The tracked paths of a clone, relative to its root, as the index names
/// them: the files, and every directory above one.
#[derive(Debug, Default)]
pub(crate) struct Tracked {
    files: HashSet<Vec<u8>>,
    dirs: HashSet<Vec<u8>>,
}

impl Tracked {
    pub(crate) fn new<'a>(paths: impl IntoIterator<Item = &'a str>) -> Self {
        let mut tracked = Self::default();
        for path in paths {
            let path = path.as_bytes();
            let mut end = path.len();
            while let Some(slash) = path[..end].iter().rposition(|&b| b == b'/') {
                if !tracked.dirs.insert(path[..slash].to_vec()) {
                    break;
                }
                end = slash;
            }
            tracked.files.insert(path.to_vec());
        }
        tracked
    }

    /// Every tracked directory, the root (empty) first.
    fn dirs(&self) -> impl Iterator<Item = &[u8]> {
        std::iter::once(&[][..]).chain(self.dirs.iter().map(Vec::as_slice))
    }

    fn contains(&self, path: &[u8]) -> bool {
        self.files.contains(path) || self.dirs.contains(path)
    }
}

/// What one event means for the clean check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Effect {
    /// About an untracked name: the full check would not look at it either.
    Irrelevant,
    /// A tracked path, `HEAD` or the index may have changed.
    Changed,
    /// The kernel's queue overflowed: events were lost.
    Overflowed,
    /// A watch ended (its directory removed, moved or unmounted), or an
    /// event came for a descriptor this watch does not know.
    Lost,
}

/// What an event of `mask` about `name` in `watched` means (pure).
pub(crate) fn effect(watched: Option<&Watched>, mask: AddWatchFlags, name: Option<&[u8]>, tracked: &Tracked) -> Effect {
    if mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
        return Effect::Overflowed;
    }
    let lost = AddWatchFlags::IN_IGNORED
        | AddWatchFlags::IN_UNMOUNT
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF;
    if mask.intersects(lost) {
        return Effect::Lost;
    }
    let Some(watched) = watched else { return Effect::Lost };
    // Without a name the event is about the watched directory itself: its
    // own attributes, which no clean check reads.
    let Some(name) = name else { return Effect::Irrelevant };
    let counts = match watched {
        Watched::GitDir => GIT_FILES.contains(&name),
        Watched::WorkDir(dir) if dir.is_empty() => tracked.contains(name),
        Watched::WorkDir(dir) => tracked.contains(&[dir.as_slice(), b"/", name].concat()),
    };
    if counts { Effect::Changed } else { Effect::Irrelevant }
}

/// What the watch has seen since it was armed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Facts {
    pub(crate) changed: bool,
    pub(crate) overflowed: bool,
    pub(crate) lost: bool,
    /// The clone's root or `.git` is no longer the directory watched (a
    /// parent renamed, the clone replaced), or the queue could not be read.
    pub(crate) moved: bool,
}

impl Facts {
    fn add(&mut self, effect: Effect) {
        match effect {
            Effect::Irrelevant => {}
            Effect::Changed => self.changed = true,
            Effect::Overflowed => self.overflowed = true,
            Effect::Lost => self.lost = true,
        }
    }
}

/// The clean check's answer from a watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FullCheck {
    #[error("the clone was not watched")]
    Unwatched,
    #[error("a tracked path, HEAD or the index changed since preparation")]
    Changed,
    #[error("the watch's event queue overflowed")]
    Overflowed,
    #[error("a watch was lost")]
    Lost,
    #[error("the clone is no longer the directory watched")]
    Moved,
}

/// Whether the facts of a watch (`None`: no watch) say the clone is
/// unchanged since it was armed, or the full check must decide (pure).
pub(crate) fn verdict(facts: Option<&Facts>) -> Result<(), FullCheck> {
    let Some(facts) = facts else { return Err(FullCheck::Unwatched) };
    if facts.overflowed {
        Err(FullCheck::Overflowed)
    } else if facts.lost {
        Err(FullCheck::Lost)
    } else if facts.moved {
        Err(FullCheck::Moved)
    } else if facts.changed {
        Err(FullCheck::Changed)
    } else {
        Ok(())
    }
}

/// A directory as `stat` names it.
type DirId = (u64, u64);

fn dir_id(path: &Path) -> Option<DirId> {
    std::fs::symlink_metadata(path).ok().filter(|m| m.is_dir()).map(|m| (m.dev(), m.ino()))
}

/// Why a clone is not watched; logged once, at preparation.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unwatched {
    #[error("it has {0} tracked directories, more than {MAX_WATCHED_DIRS} watched at most")]
    TooManyDirs(usize),
    #[error("the inotify limit of this user is reached ({0}); see fs.inotify.max_user_watches and max_user_instances")]
    Limit(Errno),
    #[error("{0}")]
    Failed(String),
}

/// A live watch of one clone. Reading its queue never blocks, and its
/// descriptor is not inherited by children (`IN_CLOEXEC`).
pub(crate) struct TreeWatch {
    /// `None` only while it is dropped.
    inotify: Option<Inotify>,
    watched: HashMap<WatchDescriptor, Watched>,
    tracked: Tracked,
    root: DirId,
    git_dir: DirId,
    facts: Mutex<Facts>,
}

impl std::fmt::Debug for TreeWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TreeWatch").field("watches", &self.watched.len()).finish_non_exhaustive()
    }
}

impl TreeWatch {
    /// Watches `dest`'s `.git` and every directory holding one of
    /// `tracked`. Every directory must exist: a missing one means the clone
    /// is not as its index says.
    pub(crate) fn arm(dest: &Path, tracked: Tracked) -> Result<Self, Unwatched> {
        let dirs = tracked.dirs.len() + 1;
        if dirs > MAX_WATCHED_DIRS {
            return Err(Unwatched::TooManyDirs(dirs));
        }
        let limit = |errno| match errno {
            Errno::ENOSPC | Errno::EMFILE => Unwatched::Limit(errno),
            other => Unwatched::Failed(format!("inotify: {other}")),
        };
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK).map_err(limit)?;
        let git_dir = dest.join(".git");
        let identity = |path: &Path| {
            dir_id(path).ok_or_else(|| Unwatched::Failed(format!("{} is not a directory", path.display())))
        };
        let (root, git_dir_id) = (identity(dest)?, identity(&git_dir)?);
        let mut watched = HashMap::with_capacity(dirs + 1);
        let wd = inotify.add_watch(&git_dir, dir_mask()).map_err(limit)?;
        watched.insert(wd, Watched::GitDir);
        for dir in tracked.dirs() {
            let path = dest.join(OsStr::from_bytes(dir));
            let wd = inotify.add_watch(&path, dir_mask()).map_err(|errno| match errno {
                Errno::ENOSPC | Errno::EMFILE => Unwatched::Limit(errno),
                other => Unwatched::Failed(format!("watching {}: {other}", path.display())),
            })?;
            // Two paths naming one directory (a symlink is not followed, so
            // only a bind mount) would make every event ambiguous.
            if watched.insert(wd, Watched::WorkDir(dir.to_vec())).is_some() {
                return Err(Unwatched::Failed(format!("{} is watched twice", path.display())));
            }
        }
        Ok(Self {
            inotify: Some(inotify),
            watched,
            tracked,
            root,
            git_dir: git_dir_id,
            facts: Mutex::new(Facts::default()),
        })
    }

    /// Drains the queue (never blocking) and says whether the clone in
    /// `dest` is unchanged since the watch was armed.
    pub(crate) fn unchanged(&self, dest: &Path) -> Result<(), FullCheck> {
        let mut facts = self.facts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(inotify) = &self.inotify else { return Err(FullCheck::Lost) };
        loop {
            match inotify.read_events() {
                Ok(events) if events.is_empty() => break,
                Ok(events) => {
                    for event in events {
                        let name = event.name.as_deref().map(OsStrExt::as_bytes);
                        facts.add(effect(self.watched.get(&event.wd), event.mask, name, &self.tracked));
                    }
                }
                Err(Errno::EAGAIN) => break,
                Err(Errno::EINTR) => {}
                Err(_) => {
                    facts.moved = true;
                    break;
                }
            }
        }
        if dir_id(dest) != Some(self.root) || dir_id(&dest.join(".git")) != Some(self.git_dir) {
            facts.moved = true;
        }
        verdict(Some(&facts))
    }
}

impl Drop for TreeWatch {
    /// Closing an inotify descriptor waits for the kernel to free its
    /// watches, an RCU grace period: 20 ms on this machine, more under
    /// load. The last holder of a watch is the install, just before the
    /// run starts, so the descriptor is closed on the blocking pool.
    fn drop(&mut self) {
        let Some(inotify) = self.inotify.take() else { return };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            drop(runtime.spawn_blocking(move || drop(inotify)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracked() -> Tracked {
        Tracked::new(["README", "src/lib.py", "src/deep/er/mod.py"])
    }

    #[test]
    fn the_tracked_set_holds_every_file_and_directory_above_one() {
        let tracked = tracked();
        for path in ["README", "src/lib.py", "src/deep/er/mod.py", "src", "src/deep", "src/deep/er"] {
            assert!(tracked.contains(path.as_bytes()), "{path}");
        }
        for path in ["", "sr", "src/lib", "src/deep/er/mod.py/x", "other"] {
            assert!(!tracked.contains(path.as_bytes()), "{path}");
        }
        let mut dirs: Vec<&[u8]> = tracked.dirs().collect();
        dirs.sort();
        assert_eq!(dirs, [&b""[..], b"src", b"src/deep", b"src/deep/er"]);
    }

    #[test]
    fn only_events_about_tracked_paths_head_or_the_index_count() {
        let tracked = tracked();
        let root = Watched::WorkDir(Vec::new());
        let src = Watched::WorkDir(b"src".to_vec());
        let modify = AddWatchFlags::IN_MODIFY;
        let of = |watched: &Watched, mask, name: &str| effect(Some(watched), mask, Some(name.as_bytes()), &tracked);
        assert_eq!(of(&src, modify, "lib.py"), Effect::Changed);
        assert_eq!(of(&src, AddWatchFlags::IN_ATTRIB, "lib.py"), Effect::Changed, "chmod, touch");
        assert_eq!(of(&src, AddWatchFlags::IN_DELETE, "lib.py"), Effect::Changed);
        assert_eq!(of(&src, AddWatchFlags::IN_MOVED_TO, "lib.py"), Effect::Changed, "replaced by a rename");
        assert_eq!(of(&root, AddWatchFlags::IN_MOVED_FROM | AddWatchFlags::IN_ISDIR, "src"), Effect::Changed);
        assert_eq!(of(&root, modify, "README"), Effect::Changed);
        assert_eq!(of(&src, AddWatchFlags::IN_CREATE, "new.py"), Effect::Irrelevant, "untracked");
        assert_eq!(of(&root, AddWatchFlags::IN_CREATE | AddWatchFlags::IN_ISDIR, ".standby"), Effect::Irrelevant);
        assert_eq!(of(&root, modify, "lib.py"), Effect::Irrelevant, "src/lib.py is not ./lib.py");
        assert_eq!(of(&Watched::GitDir, AddWatchFlags::IN_MOVED_TO, "index"), Effect::Changed);
        assert_eq!(of(&Watched::GitDir, modify, "HEAD"), Effect::Changed);
        assert_eq!(of(&Watched::GitDir, AddWatchFlags::IN_CREATE, "index.lock"), Effect::Irrelevant);
        assert_eq!(of(&Watched::GitDir, modify, "FETCH_HEAD"), Effect::Irrelevant);
        assert_eq!(effect(Some(&src), AddWatchFlags::IN_ATTRIB, None, &tracked), Effect::Irrelevant);
    }

    #[test]
    fn an_overflow_a_lost_watch_or_an_unknown_descriptor_is_never_irrelevant() {
        let tracked = tracked();
        let src = Watched::WorkDir(b"src".to_vec());
        assert_eq!(effect(None, AddWatchFlags::IN_Q_OVERFLOW, None, &tracked), Effect::Overflowed);
        for lost in [
            AddWatchFlags::IN_IGNORED,
            AddWatchFlags::IN_DELETE_SELF,
            AddWatchFlags::IN_MOVE_SELF,
            AddWatchFlags::IN_UNMOUNT,
        ] {
            assert_eq!(effect(Some(&src), lost, None, &tracked), Effect::Lost, "{lost:?}");
        }
        assert_eq!(effect(None, AddWatchFlags::IN_CREATE, Some(b"new.py"), &tracked), Effect::Lost);
    }

    #[test]
    fn only_a_watch_that_saw_nothing_spares_the_full_check() {
        assert_eq!(verdict(Some(&Facts::default())), Ok(()));
        assert_eq!(verdict(None), Err(FullCheck::Unwatched));
        let seen = |effect| {
            let mut facts = Facts::default();
            facts.add(Effect::Irrelevant);
            facts.add(effect);
            verdict(Some(&facts))
        };
        assert_eq!(seen(Effect::Irrelevant), Ok(()));
        assert_eq!(seen(Effect::Changed), Err(FullCheck::Changed));
        assert_eq!(seen(Effect::Overflowed), Err(FullCheck::Overflowed));
        assert_eq!(seen(Effect::Lost), Err(FullCheck::Lost));
        assert_eq!(verdict(Some(&Facts { moved: true, ..Facts::default() })), Err(FullCheck::Moved));
        let everything = Facts { changed: true, overflowed: true, lost: true, moved: true };
        assert_eq!(verdict(Some(&everything)), Err(FullCheck::Overflowed), "the first reason that holds");
    }
}
