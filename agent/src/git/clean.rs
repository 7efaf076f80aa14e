//! Whether a clone is still exactly as preparation left it, answered
//! without running git: the warm run's refresh to the commit the pool was
//! prepared at then costs no process at all.
//!
//! Preparation ends with a fresh clone whose index git itself wrote from
//! the checked-out commit, so at that moment the index *is* the commit's
//! tree. [`Snapshot::take`] records that moment: the detached `HEAD` and
//! the index file's identity. At the refresh, [`Snapshot::still_clean`]
//! holds when `HEAD` still names the same commit, the index file is the
//! same file untouched (git replaces it by rename on every write, so any
//! `git add`, checkout or reset changes its identity), and every tracked
//! file's `lstat` matches what the index recorded, the check git makes
//! itself. Anything unusual (an index format other than 2 or 3, a
//! submodule, a conflict, skip-worktree or intent-to-add entries, a file
//! written in the same second as the index) answers "not known clean" and
//! the caller runs git as before: the shortcut may only ever be skipped,
//! never taken wrongly.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use super::watch::{FullCheck, Tracked, TreeWatch};

/// The index format's fixed part of an entry before the object id: ten
/// 32-bit stat fields.
const STAT_LEN: usize = 40;
/// Flags after the object id: the name length and the entry's state.
const FLAG_ASSUME_VALID: u16 = 0x8000;
const FLAG_EXTENDED: u16 = 0x4000;
const FLAG_STAGE: u16 = 0x3000;
const NAME_MASK: u16 = 0x0fff;
const MODE_TYPE: u32 = 0o170000;
const MODE_FILE: u32 = 0o100000;
const MODE_SYMLINK: u32 = 0o120000;

/// The stat data git records for a file, and the file's as `lstat` reads
/// it; both truncated to the index's 32 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stat {
    ctime: (u32, u32),
    mtime: (u32, u32),
    ino: u32,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u32,
}

impl Stat {
    fn of(meta: &Metadata) -> Self {
        // The index keeps the low 32 bits of each field; so does this.
        Self {
            ctime: (meta.ctime() as u32, meta.ctime_nsec() as u32),
            mtime: (meta.mtime() as u32, meta.mtime_nsec() as u32),
            ino: meta.ino() as u32,
            mode: meta.mode(),
            uid: meta.uid(),
            gid: meta.gid(),
            size: meta.size() as u32,
        }
    }
}

/// One tracked path of the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) path: String,
    stat: Stat,
}

/// Why an index cannot be judged without git.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unjudgeable {
    Malformed(&'static str),
    Version(u32),
    /// A submodule, a conflict, or an entry git treats specially.
    Special(String),
}

/// The entries of an index file (versions 2 and 3), with `oid_len` the
/// repository's object id length (20 for SHA-1, 32 for SHA-256).
pub(crate) fn parse_index(bytes: &[u8], oid_len: usize) -> Result<Vec<Entry>, Unjudgeable> {
    let u32_at = |at: usize| -> Result<u32, Unjudgeable> {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or(Unjudgeable::Malformed("truncated"))
    };
    if bytes.get(..4) != Some(b"DIRC".as_slice()) {
        return Err(Unjudgeable::Malformed("no DIRC signature"));
    }
    let version = u32_at(4)?;
    if !matches!(version, 2 | 3) {
        return Err(Unjudgeable::Version(version));
    }
    let count = u32_at(8)? as usize;
    let mut entries = Vec::with_capacity(count.min(bytes.len() / 62));
    let mut at = 12;
    for _ in 0..count {
        let start = at;
        let field = |i: usize| u32_at(start + 4 * i);
        let stat = Stat {
            ctime: (field(0)?, field(1)?),
            mtime: (field(2)?, field(3)?),
            ino: field(5)?,
            mode: field(6)?,
            uid: field(7)?,
            gid: field(8)?,
            size: field(9)?,
        };
        at = start + STAT_LEN + oid_len;
        let flags = bytes
            .get(at..at + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
            .ok_or(Unjudgeable::Malformed("truncated"))?;
        at += 2;
        if flags & FLAG_EXTENDED != 0 {
            // Skip-worktree and intent-to-add live here: entries whose file
            // is not meant to match.
            return Err(Unjudgeable::Special("an entry with extended flags".to_owned()));
        }
        let name_len = usize::from(flags & NAME_MASK);
        let name = bytes.get(at..).ok_or(Unjudgeable::Malformed("truncated"))?;
        let name_len = if name_len < usize::from(NAME_MASK) {
            name_len
        } else {
            name.iter().position(|&b| b == 0).ok_or(Unjudgeable::Malformed("unterminated name"))?
        };
        let path = std::str::from_utf8(name.get(..name_len).ok_or(Unjudgeable::Malformed("truncated"))?)
            .map_err(|_| Unjudgeable::Special("a path that is not UTF-8".to_owned()))?
            .to_owned();
        if flags & (FLAG_ASSUME_VALID | FLAG_STAGE) != 0 || stat.mode & MODE_TYPE == 0o160000 {
            return Err(Unjudgeable::Special(path));
        }
        // The entry is padded with 1 to 8 NULs to a multiple of 8 bytes.
        let unpadded = at + name_len - start;
        at = start + (unpadded + 8) / 8 * 8;
        entries.push(Entry { path, stat });
    }
    Ok(entries)
}

/// Which stat fields git compares in a clone to take a tracked file as
/// unchanged, by the clone's `core.checkStat` and `core.trustCtime`: the
/// agent's own check asks no more of a file than git would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatCheck {
    /// git's default: every field the index records.
    Full,
    /// `core.checkStat minimal` and `core.trustCtime false`, which
    /// [`crate::git::trust_copied_files`] sets in a clone copied from a
    /// snapshot: the size and the whole second of the modification time.
    /// The copy's new inode numbers and change times do not count, and git
    /// does not write them into the index either, so a check of every
    /// field would never find such a clone clean.
    SizeAndSecond,
}

/// Whether the file's `lstat` says it is what the index recorded, by the
/// fields `check` compares (the kind and the executable bit always). A
/// file modified in the same second as the index was written or later is
/// "racily clean" to git, which then reads its content: here it is simply
/// not known clean.
pub(crate) fn matches(entry: &Stat, file: &Stat, index_mtime: (u32, u32), check: StatCheck) -> bool {
    let same_kind = match entry.mode & MODE_TYPE {
        MODE_FILE => file.mode & MODE_TYPE == MODE_FILE && (entry.mode & 0o100 == file.mode & 0o100),
        MODE_SYMLINK => file.mode & MODE_TYPE == MODE_SYMLINK,
        _ => false,
    };
    let racy = entry.mtime.0 >= index_mtime.0;
    let same_fields = match check {
        StatCheck::Full => {
            entry.mtime == file.mtime
                && entry.ctime == file.ctime
                && entry.ino == file.ino
                && entry.uid == file.uid
                && entry.gid == file.gid
        }
        StatCheck::SizeAndSecond => entry.mtime.0 == file.mtime.0,
    };
    same_kind && !racy && same_fields && entry.size == file.size
}

/// The index file as a file: git replaces it on every write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileIdentity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileIdentity {
    fn of(meta: &Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// A clone as preparation left it: detached at `sha`, its index untouched,
/// and, when it could be armed, a watch of it since then.
#[derive(Debug, Clone)]
pub struct Snapshot {
    sha: String,
    index: FileIdentity,
    /// Armed before the full check that vouched for the clone (see
    /// [`Snapshot::watched`]).
    watch: Option<Arc<TreeWatch>>,
    /// The fields a tracked file is compared by, as git compares them.
    check: StatCheck,
}

impl Snapshot {
    /// Records the clone in `dest` (a `.git` directory, detached `HEAD`);
    /// `None` when it is not such a clone.
    pub fn take(dest: &Path, check: StatCheck) -> Option<Self> {
        let git_dir = dest.join(".git");
        let sha = detached_head(&git_dir)?;
        let index = FileIdentity::of(&std::fs::metadata(git_dir.join("index")).ok()?);
        Some(Self { sha, index, watch: None, check })
    }

    /// Records the clone as [`Snapshot::take`] does, then watches it: the
    /// watch is armed first and the full check made after, so the clone is
    /// known clean when the check passes and every change from then on is
    /// an event. Without a watch (too many directories, the user's inotify
    /// limit, a clone not known clean) the snapshot is `take`'s, and why is
    /// logged.
    pub fn watched(dest: &Path, check: StatCheck) -> Option<Self> {
        let mut snapshot = Self::take(dest, check)?;
        let armed = snapshot
            .entries(dest)
            .map_err(|why| why.to_string())
            .and_then(|(entries, _)| {
                TreeWatch::arm(dest, Tracked::new(entries.iter().map(|e| e.path.as_str()))).map_err(|e| e.to_string())
            })
            .and_then(|watch| snapshot.still_clean(dest).map(|()| watch).map_err(|why| why.to_string()));
        match armed {
            Ok(watch) => snapshot.watch = Some(Arc::new(watch)),
            Err(why) => tracing::info!(
                dest = %dest.display(),
                why,
                "the clone is not watched: the run's clean check will read every tracked file"
            ),
        }
        Some(snapshot)
    }

    /// The commit the clone was detached at.
    pub fn sha(&self) -> &str {
        &self.sha
    }

    /// Whether the clone in `dest` is known unchanged since it was
    /// watched, in constant time: the watch saw nothing that counts, and
    /// `HEAD` and the index file are as recorded. An error says why the
    /// full check ([`Snapshot::still_clean`]) must decide.
    pub(crate) fn unchanged(&self, dest: &Path) -> Result<(), FullCheck> {
        self.watch.as_deref().ok_or(FullCheck::Unwatched)?.unchanged(dest)?;
        let git_dir = dest.join(".git");
        let index = std::fs::metadata(git_dir.join("index")).map(|meta| FileIdentity::of(&meta));
        if detached_head(&git_dir).as_deref() != Some(self.sha.as_str()) || index.ok() != Some(self.index) {
            return Err(FullCheck::Changed);
        }
        Ok(())
    }

    /// Whether the clone in `dest` is still detached at the recorded
    /// commit with every tracked file as the index recorded it. Reads
    /// `HEAD`, the index and one `lstat` per tracked file: no process.
    pub fn still_clean(&self, dest: &Path) -> Result<(), NotClean> {
        let (entries, index_mtime) = self.entries(dest)?;
        for entry in &entries {
            let file =
                std::fs::symlink_metadata(dest.join(&entry.path)).map_err(|_| NotClean::File(entry.path.clone()))?;
            if !matches(&entry.stat, &Stat::of(&file), index_mtime, self.check) {
                return Err(NotClean::File(entry.path.clone()));
            }
        }
        Ok(())
    }

    /// The index's entries and its mtime, if `HEAD` and the index file are
    /// as recorded.
    fn entries(&self, dest: &Path) -> Result<(Vec<Entry>, (u32, u32)), NotClean> {
        let git_dir = dest.join(".git");
        if detached_head(&git_dir).as_deref() != Some(self.sha.as_str()) {
            return Err(NotClean::Head);
        }
        let index_path = git_dir.join("index");
        let bytes = std::fs::read(&index_path).map_err(|_| NotClean::Index)?;
        let meta = std::fs::metadata(&index_path).map_err(|_| NotClean::Index)?;
        if FileIdentity::of(&meta) != self.index {
            return Err(NotClean::Index);
        }
        let index_mtime = (meta.mtime() as u32, meta.mtime_nsec() as u32);
        // A SHA-256 repository names its commits with 64 hex digits.
        let oid_len = self.sha.len() / 2;
        let entries = parse_index(&bytes, oid_len).map_err(NotClean::Unjudgeable)?;
        Ok((entries, index_mtime))
    }
}

/// Why [`Snapshot::still_clean`] said no: logged, then git decides.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotClean {
    #[error("HEAD moved")]
    Head,
    #[error("the index was rewritten")]
    Index,
    #[error("the index cannot be judged without git: {0:?}")]
    Unjudgeable(Unjudgeable),
    #[error("{0} changed or is racily clean")]
    File(String),
}

/// The commit a detached `HEAD` names; `None` for a symbolic `HEAD` (on a
/// branch) or anything unreadable.
fn detached_head(git_dir: &Path) -> Option<String> {
    let head = std::fs::read_to_string(git_dir.join("HEAD")).ok()?;
    let sha = head.trim_end_matches('\n');
    (matches!(sha.len(), 40 | 64) && sha.bytes().all(|b| b.is_ascii_hexdigit())).then(|| sha.to_owned())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::git::tests::{Upstream, git};
    use crate::git::watch::MAX_WATCHED_DIRS;
    use crate::git::{clone, refresh_index};

    fn stat(mtime: u32) -> Stat {
        Stat { ctime: (mtime, 5), mtime: (mtime, 5), ino: 7, mode: 0o100644, uid: 10001, gid: 10001, size: 12 }
    }

    /// An index entry as git writes it (version 2, SHA-1).
    fn entry_bytes(stat: &Stat, flags: u16, name: &str) -> Vec<u8> {
        let mut out = Vec::new();
        for field in [
            stat.ctime.0,
            stat.ctime.1,
            stat.mtime.0,
            stat.mtime.1,
            0,
            stat.ino,
            stat.mode,
            stat.uid,
            stat.gid,
            stat.size,
        ] {
            out.extend_from_slice(&field.to_be_bytes());
        }
        out.extend_from_slice(&[0xab; 20]);
        out.extend_from_slice(&(flags | name.len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        let padded = (out.len() + 8) / 8 * 8;
        out.resize(padded, 0);
        out
    }

    fn index_bytes(entries: &[Vec<u8>]) -> Vec<u8> {
        let mut out = b"DIRC".to_vec();
        out.extend_from_slice(&2u32.to_be_bytes());
        out.extend_from_slice(&(entries.len() as u32).to_be_bytes());
        for entry in entries {
            out.extend_from_slice(entry);
        }
        out
    }

    #[test]
    fn a_version_2_index_is_read_entry_by_entry() {
        let (a, b) = (stat(100), stat(200));
        let bytes = index_bytes(&[entry_bytes(&a, 0, "README"), entry_bytes(&b, 0, "src/a-longer-name.py")]);
        let entries = parse_index(&bytes, 20).expect("parses");
        assert_eq!(
            entries,
            vec![Entry { path: "README".into(), stat: a }, Entry { path: "src/a-longer-name.py".into(), stat: b }]
        );
    }

    #[test]
    fn special_entries_and_other_versions_are_left_to_git() {
        let conflicted = index_bytes(&[entry_bytes(&stat(1), 0x1000, "x")]);
        assert!(matches!(parse_index(&conflicted, 20), Err(Unjudgeable::Special(_))));
        let extended = index_bytes(&[entry_bytes(&stat(1), FLAG_EXTENDED, "x")]);
        assert!(matches!(parse_index(&extended, 20), Err(Unjudgeable::Special(_))));
        let submodule = index_bytes(&[entry_bytes(&Stat { mode: 0o160000, ..stat(1) }, 0, "sub")]);
        assert!(matches!(parse_index(&submodule, 20), Err(Unjudgeable::Special(_))));
        let mut v4 = index_bytes(&[]);
        v4[7] = 4;
        assert_eq!(parse_index(&v4, 20), Err(Unjudgeable::Version(4)));
        let truncated = index_bytes(&[entry_bytes(&stat(1), 0, "x")]);
        assert!(matches!(parse_index(&truncated[..30], 20), Err(Unjudgeable::Malformed(_))));
    }

    #[test]
    fn a_file_matches_only_with_the_same_stat_data_and_written_before_the_index() {
        let recorded = stat(100);
        let full = StatCheck::Full;
        assert!(matches(&recorded, &recorded, (101, 0), full));
        assert!(!matches(&recorded, &recorded, (100, 900), full), "same second as the index: racy");
        assert!(!matches(&recorded, &Stat { size: 13, ..recorded }, (101, 0), full));
        assert!(!matches(&recorded, &Stat { mtime: (100, 6), ..recorded }, (101, 0), full));
        assert!(!matches(&recorded, &Stat { ino: 8, ..recorded }, (101, 0), full));
        assert!(!matches(&recorded, &Stat { ctime: (100, 6), ..recorded }, (101, 0), full));
        assert!(!matches(&recorded, &Stat { mode: 0o100755, ..recorded }, (101, 0), full), "the executable bit");
        assert!(!matches(&recorded, &Stat { mode: 0o120777, ..recorded }, (101, 0), full), "a symlink now");
    }

    /// A clone copied from a snapshot: git compares sizes and whole
    /// seconds of modification times there, and so does the agent.
    #[test]
    fn a_copied_clone_s_file_matches_by_size_and_second() {
        let recorded = stat(100);
        let copied = Stat { ino: 8, ctime: (250, 1), uid: 1000, gid: 1000, mtime: (100, 6), ..recorded };
        let minimal = StatCheck::SizeAndSecond;
        assert!(matches(&recorded, &copied, (101, 0), minimal));
        assert!(!matches(&recorded, &copied, (101, 0), StatCheck::Full));
        assert!(!matches(&recorded, &copied, (100, 900), minimal), "same second as the index: racy");
        assert!(!matches(&recorded, &Stat { size: 13, ..copied }, (101, 0), minimal));
        assert!(!matches(&recorded, &Stat { mtime: (99, 5), ..copied }, (101, 0), minimal));
        assert!(!matches(&recorded, &Stat { mode: 0o100755, ..copied }, (101, 0), minimal), "the executable bit");
        assert!(!matches(&recorded, &Stat { mode: 0o120777, ..copied }, (101, 0), minimal), "a symlink now");
    }

    /// A clone whose index was written a second after its files.
    async fn prepared_clone() -> (Upstream, tempfile::TempDir, PathBuf) {
        let upstream = Upstream::new();
        std::fs::create_dir_all(upstream.dir.path().join("src")).expect("writable");
        upstream.commit("src/lib.py", "x = 1\n");
        let work = tempfile::tempdir().expect("a temporary directory");
        let dest = work.path().join("app");
        clone(&upstream.repo("app", None), &dest).await.expect("clone");
        // Files and index in the same second are racy: move the files'
        // times a few seconds back, as time passing would.
        for path in ["README", "src/lib.py"] {
            let file = std::fs::File::options().write(true).open(dest.join(path)).expect("a tracked file");
            let past = std::time::SystemTime::now() - std::time::Duration::from_secs(5);
            file.set_times(std::fs::FileTimes::new().set_modified(past)).expect("settable");
        }
        refresh_index(&dest).await.expect("index written");
        (upstream, work, dest)
    }

    #[tokio::test]
    async fn a_prepared_clone_is_clean_until_a_tracked_file_head_or_index_changes() {
        let (_upstream, _work, dest) = prepared_clone().await;
        let snapshot = Snapshot::take(&dest, StatCheck::Full).expect("a detached clone");
        assert_eq!(snapshot.sha(), git(&dest, &["rev-parse", "HEAD"]));
        assert_eq!(snapshot.still_clean(&dest), Ok(()));

        std::fs::write(dest.join("untracked.txt"), "setup output").expect("writable");
        assert_eq!(snapshot.still_clean(&dest), Ok(()), "untracked files do not matter");

        std::fs::write(dest.join("src/lib.py"), "x = 2\n").expect("writable");
        assert_eq!(snapshot.still_clean(&dest), Err(NotClean::File("src/lib.py".into())));
        git(&dest, &["checkout", "--quiet", "--force", "--detach", "HEAD"]);
        assert_eq!(snapshot.still_clean(&dest), Err(NotClean::Index), "git rewrote the index");

        let (_upstream, _work, dest) = prepared_clone().await;
        let snapshot = Snapshot::take(&dest, StatCheck::Full).expect("a detached clone");
        std::fs::remove_file(dest.join("README")).expect("removable");
        assert_eq!(snapshot.still_clean(&dest), Err(NotClean::File("README".into())));

        let (upstream, _work, dest) = prepared_clone().await;
        let snapshot = Snapshot::take(&dest, StatCheck::Full).expect("a detached clone");
        let newer = upstream.commit("README", "second");
        git(&dest, &["fetch", "--quiet", "origin"]);
        std::fs::write(dest.join(".git/HEAD"), format!("{newer}\n")).expect("writable");
        assert_eq!(snapshot.still_clean(&dest), Err(NotClean::Head));
    }

    /// A tracked file changed after the watch was armed: the watch sends
    /// the check to the full one, which finds what changed.
    async fn after(change: impl FnOnce(&Path)) -> (Result<(), FullCheck>, Result<(), NotClean>) {
        let (_upstream, _work, dest) = prepared_clone().await;
        let snapshot = Snapshot::watched(&dest, StatCheck::Full).expect("a detached clone");
        assert_eq!(snapshot.unchanged(&dest), Ok(()), "armed, and nothing happened");
        change(&dest);
        (snapshot.unchanged(&dest), snapshot.still_clean(&dest))
    }

    #[tokio::test]
    async fn a_watched_clone_is_known_unchanged_without_reading_its_files() {
        let (_upstream, _work, dest) = prepared_clone().await;
        assert_eq!(
            Snapshot::take(&dest, StatCheck::Full).expect("a detached clone").unchanged(&dest),
            Err(FullCheck::Unwatched)
        );
        let snapshot = Snapshot::watched(&dest, StatCheck::Full).expect("a detached clone");
        assert_eq!(snapshot.unchanged(&dest), Ok(()));
        // What the full check ignores, the watch ignores too.
        std::fs::write(dest.join("src/untracked.txt"), "setup output").expect("writable");
        std::fs::create_dir(dest.join("src/__pycache__")).expect("writable");
        std::fs::write(dest.join("src/__pycache__/lib.pyc"), "bytecode").expect("writable");
        std::fs::create_dir_all(dest.join(".standby")).expect("writable");
        std::fs::write(dest.join(".standby/metadata.json"), "{}").expect("writable");
        let _ = std::fs::read(dest.join("src/lib.py")).expect("readable");
        assert_eq!(snapshot.unchanged(&dest), Ok(()), "untracked files and reads do not count");
        assert_eq!(snapshot.still_clean(&dest), Ok(()));
        assert_eq!(snapshot.clone().unchanged(&dest), Ok(()), "a clone of the snapshot shares the watch");
    }

    #[tokio::test]
    async fn a_tracked_file_modified_removed_replaced_or_chmodded_falls_back_to_the_full_check() {
        let changed = |path: &str| Err(NotClean::File(path.into()));
        let (watch, full) = after(|dest| std::fs::write(dest.join("src/lib.py"), "x = 2\n").expect("writable")).await;
        assert_eq!((watch, full), (Err(FullCheck::Changed), changed("src/lib.py")));

        let (watch, full) = after(|dest| std::fs::remove_file(dest.join("src/lib.py")).expect("removable")).await;
        assert_eq!((watch, full), (Err(FullCheck::Changed), changed("src/lib.py")));

        let replace = |dest: &Path| {
            std::fs::write(dest.join("src/new.py"), "x = 1\n").expect("writable");
            std::fs::rename(dest.join("src/new.py"), dest.join("src/lib.py")).expect("renamable");
        };
        let (watch, full) = after(replace).await;
        assert_eq!((watch, full), (Err(FullCheck::Changed), changed("src/lib.py")), "same content, another file");

        let chmod = |dest: &Path| {
            use std::os::unix::fs::PermissionsExt as _;
            let path = dest.join("src/lib.py");
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        };
        let (watch, full) = after(chmod).await;
        assert_eq!((watch, full), (Err(FullCheck::Changed), changed("src/lib.py")));

        let (watch, full) = after(|dest| {
            std::fs::rename(dest.join("src"), dest.join("elsewhere")).expect("renamable");
            std::fs::create_dir(dest.join("src")).expect("writable");
        })
        .await;
        assert_eq!((watch, full), (Err(FullCheck::Lost), changed("src/lib.py")), "a tracked directory moved away");
    }

    #[tokio::test]
    async fn head_the_index_or_the_clone_itself_changing_falls_back_to_the_full_check() {
        let (watch, full) =
            after(|dest| drop(git(dest, &["checkout", "--quiet", "--force", "--detach", "HEAD"]))).await;
        assert_eq!((watch, full), (Err(FullCheck::Changed), Err(NotClean::Index)), "git rewrote the index");

        let (watch, full) = after(|dest| drop(git(dest, &["checkout", "--quiet", "-B", "work"]))).await;
        assert_eq!((watch, full), (Err(FullCheck::Changed), Err(NotClean::Head)));

        let (watch, _) = after(|dest| std::fs::rename(dest, dest.with_file_name("moved")).expect("renamable")).await;
        assert_eq!(watch, Err(FullCheck::Lost), "the clone itself moved away");

        // A parent moved: the path names another clone, and no event
        // reaches the old one's watch.
        let (upstream, work, dest) = prepared_clone().await;
        let snapshot = Snapshot::watched(&dest, StatCheck::Full).expect("a detached clone");
        let moved = work.path().with_extension("moved");
        std::fs::rename(work.path(), &moved).expect("renamable");
        std::fs::create_dir(work.path()).expect("writable");
        clone(&upstream.repo("app", None), &dest).await.expect("clone");
        assert_eq!(snapshot.unchanged(&dest), Err(FullCheck::Moved));
        std::fs::remove_dir_all(moved).expect("removable");
    }

    #[test]
    fn a_repository_with_too_many_directories_is_not_watched() {
        let paths: Vec<String> = (0..=MAX_WATCHED_DIRS).map(|i| format!("d{i}/f")).collect();
        let tracked = Tracked::new(paths.iter().map(String::as_str));
        let why = TreeWatch::arm(Path::new("/nonexistent"), tracked).expect_err("too many");
        assert!(matches!(why, super::super::watch::Unwatched::TooManyDirs(n) if n == MAX_WATCHED_DIRS + 2), "{why}");
    }

    #[tokio::test]
    async fn a_clone_on_a_branch_has_no_snapshot() {
        let (_upstream, _work, dest) = prepared_clone().await;
        git(&dest, &["checkout", "--quiet", "-B", "work"]);
        assert!(Snapshot::take(&dest, StatCheck::Full).is_none());
    }
}
