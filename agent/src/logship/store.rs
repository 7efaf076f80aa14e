//! Where the spooled output lives: a ring of `bound` bytes in an unlinked
//! file (so nothing is left behind, whatever ends the agent), in memory
//! only when no file can be created.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

/// The spool's bytes, addressed by the spool index's positions (taken modulo
/// the bound).
#[derive(Debug)]
pub(super) enum Store {
    File { file: File, bound: u64 },
    Memory { ring: Vec<u8>, bound: u64 },
}

impl Store {
    /// An unlinked file in `dir`, else in the system's temporary directory,
    /// else memory (grown as used, up to `bound`).
    pub(super) fn open(dir: &Path, name: &str, bound: u64) -> Self {
        let bound = bound.max(1);
        for dir in [dir.to_path_buf(), std::env::temp_dir()] {
            match unlinked_file(&dir, name) {
                Ok(file) => return Self::File { file, bound },
                Err(error) => {
                    tracing::warn!(dir = %dir.display(), %error, "cannot create the log spool file here");
                }
            }
        }
        tracing::warn!("the log spool is kept in memory");
        Self::Memory { ring: Vec::new(), bound }
    }

    pub(super) fn write(&mut self, at: u64, data: &[u8]) -> io::Result<()> {
        for (index, range) in self.pieces(at, data.len()) {
            let piece = &data[range];
            match self {
                Self::File { file, .. } => file.write_all_at(piece, index)?,
                Self::Memory { ring, .. } => {
                    let start = usize::try_from(index).map_err(io::Error::other)?;
                    if ring.len() < start + piece.len() {
                        ring.resize(start + piece.len(), 0);
                    }
                    ring[start..start + piece.len()].copy_from_slice(piece);
                }
            }
        }
        Ok(())
    }

    pub(super) fn read(&self, at: u64, len: usize) -> io::Result<Vec<u8>> {
        let mut data = vec![0; len];
        for (index, range) in self.pieces(at, len) {
            let piece = &mut data[range];
            match self {
                Self::File { file, .. } => file.read_exact_at(piece, index)?,
                Self::Memory { ring, .. } => {
                    let start = usize::try_from(index).map_err(io::Error::other)?;
                    let stored = ring
                        .get(start..start + piece.len())
                        .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the spooled bytes"))?;
                    piece.copy_from_slice(stored);
                }
            }
        }
        Ok(data)
    }

    /// `len` bytes from position `at`, as (ring index, range of the
    /// caller's buffer): one piece, or two where they wrap around.
    fn pieces(&self, at: u64, len: usize) -> Vec<(u64, std::ops::Range<usize>)> {
        let bound = match self {
            Self::File { bound, .. } | Self::Memory { bound, .. } => *bound,
        };
        let mut pieces = Vec::with_capacity(2);
        let mut done = 0;
        while done < len {
            let index = (at + done as u64) % bound;
            let room = usize::try_from(bound - index).unwrap_or(usize::MAX);
            let take = room.min(len - done);
            pieces.push((index, done..done + take));
            done += take;
        }
        pieces
    }
}

/// Creates `dir/name` readable by its owner only, then unlinks it: the open
/// descriptor is the only way to it.
fn unlinked_file(dir: &Path, name: &str) -> io::Result<File> {
    let path = dir.join(name);
    let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
    std::fs::remove_file(&path)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_wrap_around_the_ring_in_a_file_and_in_memory() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let file = Store::open(dir.path(), "spool", 10);
        assert!(matches!(file, Store::File { .. }));
        assert_eq!(std::fs::read_dir(dir.path()).expect("readable").count(), 0, "the file is unlinked");
        let memory = Store::Memory { ring: Vec::new(), bound: 10 };
        for mut store in [file, memory] {
            store.write(0, b"0123456789").expect("written");
            store.write(13, b"abcdefgh").expect("written across the wrap");
            assert_eq!(store.read(13, 8).expect("read"), b"abcdefgh");
            assert_eq!(store.read(10, 3).expect("read"), b"h12", "positions are taken modulo the bound");
        }
    }
}
