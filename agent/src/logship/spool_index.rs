//! The log spool's books, without IO: which bytes of the run's redacted
//! output the server holds, which the spool holds and where, and which were
//! dropped.
//!
//! Two coordinates: a byte's **offset** in the run's output (what the
//! contract's `offset` counts, dropped bytes included) and its **position**
//! in the spool, a ring of `bound` bytes (a position is never reused for a
//! later byte until the earlier one is released; the store maps positions
//! to the ring). Bytes the server acknowledged stay in the ring until their
//! room is needed, so a `409` asking for bytes it lost can often be served
//! from the spool instead of becoming a gap.
//!
//! Overflow: when the bytes the server has not acknowledged fill the whole
//! bound, the **newest** bytes are dropped (what the spool holds stays a
//! contiguous continuation of what the server holds, and the oldest unsent
//! output is never overwritten while a chunk of it may be in flight). The
//! next chunk sent after a gap carries `dropped` = the bytes between what
//! the server holds and the chunk's true offset.

use std::collections::VecDeque;

/// A run of bytes contiguous both in the output and in the spool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    /// Offset of its first byte in the output.
    offset: u64,
    /// Spool position of its first byte.
    at: u64,
    len: u64,
}

impl Segment {
    fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// Where the bytes of one [`SpoolIndex::push`] go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Spool position of the first kept byte.
    pub at: u64,
    /// How many of the pushed bytes (a prefix) to write there.
    pub keep: u64,
    /// How many (the rest) were dropped: the spool is full of unsent bytes.
    pub dropped: u64,
}

/// The next chunk to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// The true offset of its first byte.
    pub offset: u64,
    /// Bytes between what the server holds and `offset`, given up on.
    pub dropped: u64,
    /// Spool position of its first byte.
    pub at: u64,
    /// Bytes of data; 0 for a chunk that only reports a gap at the end.
    pub len: u64,
}

/// The books of one run's output.
#[derive(Debug, Clone)]
pub struct SpoolIndex {
    bound: u64,
    /// Offset of the next byte the run produces.
    end: u64,
    /// Spool position of the next byte written.
    written: u64,
    /// What the server holds (as it last told us).
    acked: u64,
    /// Bytes below this offset are not sent again unless a resync asks for
    /// them: a chunk the server refused for good.
    floor: u64,
    /// What the spool holds, oldest first; retained acknowledged bytes,
    /// then unsent ones.
    segments: VecDeque<Segment>,
    /// Bytes dropped at the spool so far.
    overflowed: u64,
}

impl SpoolIndex {
    /// Empty books for a spool of `bound` bytes (at least 1).
    pub fn new(bound: u64) -> Self {
        Self { bound: bound.max(1), end: 0, written: 0, acked: 0, floor: 0, segments: VecDeque::new(), overflowed: 0 }
    }

    pub fn bound(&self) -> u64 {
        self.bound
    }

    /// Offset of the next byte the run produces: the output's length so far.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// What the server holds.
    #[cfg(test)]
    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// Bytes dropped because the spool was full.
    #[cfg(test)]
    pub fn overflowed(&self) -> u64 {
        self.overflowed
    }

    /// Bytes the spool occupies, acknowledged ones included.
    pub fn occupied(&self) -> u64 {
        self.segments.front().map_or(0, |first| self.written - first.at)
    }

    /// Bytes of the output the server does not hold yet (spooled or not).
    pub fn outstanding(&self) -> u64 {
        self.end.saturating_sub(self.acked)
    }

    /// Records `len` new bytes of output: room is made by releasing
    /// acknowledged bytes, oldest first; what still does not fit is dropped.
    pub fn push(&mut self, len: u64) -> Placement {
        let needed = len.min(self.bound);
        while self.bound - self.occupied() < needed && self.release_one_acked(needed - (self.bound - self.occupied())) {
        }
        let keep = len.min(self.bound - self.occupied());
        let placement = Placement { at: self.written, keep, dropped: len - keep };
        if keep > 0 {
            match self.segments.back_mut() {
                Some(last) if last.end() == self.end && last.at + last.len == self.written => last.len += keep,
                _ => self.segments.push_back(Segment { offset: self.end, at: self.written, len: keep }),
            }
        }
        self.written += keep;
        self.end += len;
        self.overflowed += placement.dropped;
        placement
    }

    /// Takes back the kept bytes of the last [`SpoolIndex::push`] (the spool
    /// could not store them): they count as dropped.
    pub fn unwrite(&mut self, placement: &Placement) {
        if placement.keep == 0 || self.written != placement.at + placement.keep {
            return;
        }
        if let Some(last) = self.segments.back_mut() {
            last.len -= placement.keep.min(last.len);
            if last.len == 0 {
                self.segments.pop_back();
            }
        }
        self.written = placement.at;
        self.overflowed += placement.keep;
    }

    /// Releases up to `wanted` acknowledged bytes from the oldest segment;
    /// false when there is none to release.
    fn release_one_acked(&mut self, wanted: u64) -> bool {
        let Some(first) = self.segments.front_mut() else { return false };
        let releasable = self.acked.max(self.floor).saturating_sub(first.offset).min(first.len).min(wanted);
        if releasable == 0 {
            return false;
        }
        first.offset += releasable;
        first.at += releasable;
        first.len -= releasable;
        if first.len == 0 {
            self.segments.pop_front();
        }
        true
    }

    /// The next chunk of at most `max` bytes to send, if the server lacks
    /// anything: the first spooled bytes at or after what it holds (with the
    /// gap before them as `dropped`), or, when none are spooled, an empty
    /// chunk reporting the gap up to the end of the output.
    pub fn next(&self, max: u64) -> Option<Chunk> {
        let from = self.acked.max(self.floor);
        let gap = |offset: u64| offset - self.acked;
        match self.segments.iter().find(|segment| segment.end() > from) {
            Some(segment) => {
                let offset = segment.offset.max(from);
                let len = (segment.end() - offset).min(max.max(1));
                Some(Chunk { offset, dropped: gap(offset), at: segment.at + (offset - segment.offset), len })
            }
            None if self.end > self.acked => {
                Some(Chunk { offset: self.end, dropped: gap(self.end), at: self.written, len: 0 })
            }
            None => None,
        }
    }

    /// The server acknowledged `chunk`: it now holds everything before the
    /// chunk's end.
    pub fn ack(&mut self, chunk: &Chunk) {
        self.acked = self.acked.max(chunk.offset + chunk.len);
    }

    /// The server refused `chunk` for good: it is not sent again, and the
    /// next chunk reports it as dropped.
    pub fn give_up(&mut self, chunk: &Chunk) {
        self.floor = self.floor.max(chunk.offset + chunk.len);
        if chunk.len == 0 {
            // Only a gap was to be reported, and it was refused: there is
            // nothing left to say about it.
            self.acked = self.acked.max(chunk.offset);
        }
    }

    /// The server says it holds `received` bytes (a `409`): sending resumes
    /// from there, from the spool where it still holds those bytes, else
    /// with the gap reported as `dropped`.
    pub fn resync(&mut self, received: u64) {
        self.acked = received;
        self.floor = self.floor.min(received);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn chunk(offset: u64, dropped: u64, at: u64, len: u64) -> Chunk {
        Chunk { offset, dropped, at, len }
    }

    #[test]
    fn sends_in_order_and_releases_nothing_until_room_is_needed() {
        let mut index = SpoolIndex::new(100);
        assert_eq!(index.next(10), None, "nothing to send");
        assert_eq!(index.push(30), Placement { at: 0, keep: 30, dropped: 0 });
        let first = index.next(20).expect("a chunk");
        assert_eq!(first, chunk(0, 0, 0, 20));
        index.ack(&first);
        assert_eq!(index.next(20), Some(chunk(20, 0, 20, 10)));
        assert_eq!(index.outstanding(), 10);
        assert_eq!(index.occupied(), 30, "acknowledged bytes are retained");
    }

    #[test]
    fn acknowledged_bytes_make_room_oldest_first() {
        let mut index = SpoolIndex::new(100);
        index.push(80);
        index.ack(&chunk(0, 0, 0, 50));
        assert_eq!(index.push(60), Placement { at: 80, keep: 60, dropped: 0 });
        assert_eq!(index.occupied(), 100, "40 of the 50 acknowledged bytes were released");
        assert_eq!(index.next(100), Some(chunk(50, 0, 50, 90)));
    }

    #[test]
    fn overflow_drops_the_newest_bytes_and_the_next_chunk_after_the_gap_carries_them() {
        let mut index = SpoolIndex::new(100);
        assert_eq!(index.push(70), Placement { at: 0, keep: 70, dropped: 0 });
        assert_eq!(index.push(50), Placement { at: 70, keep: 30, dropped: 20 });
        assert_eq!(index.push(5), Placement { at: 100, keep: 0, dropped: 5 });
        assert_eq!(index.overflowed(), 25);
        assert_eq!(index.end(), 125);
        let all = index.next(1000).expect("a chunk");
        assert_eq!(all, chunk(0, 0, 0, 100), "the spooled bytes are one run");
        index.ack(&all);
        // Room again: the next bytes start after the gap.
        assert_eq!(index.push(10), Placement { at: 100, keep: 10, dropped: 0 });
        assert_eq!(index.next(1000), Some(chunk(125, 25, 100, 10)));
    }

    #[test]
    fn a_gap_at_the_end_is_reported_by_an_empty_chunk() {
        let mut index = SpoolIndex::new(10);
        index.push(15);
        let data = index.next(100).expect("a chunk");
        index.ack(&data);
        let gap = index.next(100).expect("the gap");
        assert_eq!(gap, chunk(15, 5, 10, 0));
        index.ack(&gap);
        assert_eq!(index.next(100), None);
        assert_eq!(index.outstanding(), 0);
    }

    #[test]
    fn a_resync_to_retained_bytes_resends_them() {
        let mut index = SpoolIndex::new(100);
        index.push(60);
        index.ack(&chunk(0, 0, 0, 60));
        index.push(10);
        index.resync(25);
        assert_eq!(index.next(1000), Some(chunk(25, 0, 25, 45)), "from the spool, no gap");
    }

    #[test]
    fn a_resync_to_released_bytes_reports_the_gap() {
        let mut index = SpoolIndex::new(50);
        index.push(50);
        index.ack(&chunk(0, 0, 0, 50));
        index.push(40);
        assert_eq!(index.occupied(), 50, "40 acknowledged bytes were released");
        index.resync(20);
        assert_eq!(index.next(1000), Some(chunk(40, 20, 40, 50)), "the retained tail, after a gap");
    }

    #[test]
    fn a_resync_ahead_of_us_skips_what_the_server_has() {
        let mut index = SpoolIndex::new(100);
        index.push(40);
        index.resync(30);
        assert_eq!(index.next(1000), Some(chunk(30, 0, 30, 10)));
    }

    #[test]
    fn bytes_the_spool_could_not_store_become_a_gap() {
        let mut index = SpoolIndex::new(100);
        index.push(10);
        let failed = index.push(20);
        index.unwrite(&failed);
        index.push(5);
        assert_eq!(index.overflowed(), 20);
        let first = index.next(100).expect("a chunk");
        assert_eq!(first, chunk(0, 0, 0, 10));
        index.ack(&first);
        assert_eq!(index.next(100), Some(chunk(30, 20, 10, 5)));
    }

    #[test]
    fn a_refused_chunk_becomes_a_gap_for_the_next() {
        let mut index = SpoolIndex::new(100);
        index.push(30);
        let refused = index.next(10).expect("a chunk");
        index.give_up(&refused);
        let next = index.next(100).expect("the rest");
        assert_eq!(next, chunk(10, 10, 10, 20));
        index.ack(&next);
        assert_eq!(index.outstanding(), 0);
    }

    proptest! {
        /// Whatever the pushes, acknowledgements and resyncs, the spool never
        /// holds more than its bound, every chunk's offset is what the server
        /// holds plus `dropped`, a chunk's bytes are spooled, and spooled plus
        /// dropped bytes account for the whole output.
        #[test]
        fn the_books_balance(
            bound in 1u64..200,
            steps in proptest::collection::vec((0u8..4, 0u64..150), 1..60),
        ) {
            let mut index = SpoolIndex::new(bound);
            let mut kept = 0;
            for (kind, n) in steps {
                match kind {
                    0 | 1 => {
                        let placement = index.push(n);
                        prop_assert_eq!(placement.keep + placement.dropped, n);
                        kept += placement.keep;
                    }
                    2 => if let Some(chunk) = index.next(n.max(1)) {
                        prop_assert_eq!(chunk.offset - chunk.dropped, index.acked());
                        prop_assert!(chunk.len <= n.max(1));
                        prop_assert!(chunk.offset + chunk.len <= index.end());
                        let spooled = index.segments.iter().any(|s| {
                            chunk.len == 0 || (s.offset <= chunk.offset && chunk.offset + chunk.len <= s.end()
                                && s.at + (chunk.offset - s.offset) == chunk.at)
                        });
                        prop_assert!(spooled, "chunk {:?} not in {:?}", chunk, index.segments);
                        index.ack(&chunk);
                    },
                    _ => index.resync(n.min(index.end())),
                }
                prop_assert!(index.occupied() <= bound);
                prop_assert_eq!(kept + index.overflowed(), index.end());
                let mut previous_end = None;
                for segment in &index.segments {
                    if let Some(end) = previous_end {
                        prop_assert!(segment.offset >= end);
                    }
                    previous_end = Some(segment.end());
                }
            }
        }
    }
}
