//! What a server does with a chunk of a run's log: the log endpoint's
//! ledger rule (contract: `POST /v1/executions/{id}/log` and amendment 6),
//! shared by every server and by the agent's tests.
//!
//! A server keeps one number per run, `received`: how far into the run's
//! output stream it has accounted for, counting bytes it holds **and** gaps
//! it recorded (bytes the agent said it dropped). A chunk carries its true
//! stream `offset`, its length, and `dropped`: bytes the agent gave up on
//! just before it. [`accept`] says what to do with the chunk:
//!
//! | chunk | verdict |
//! |---|---|
//! | ends at or before `received` (a retry of bytes already held) | [`Verdict::Duplicate`] |
//! | starts at or before `received` and ends after it | [`Verdict::Append`], its first `skip` bytes already held |
//! | `dropped > 0` and `offset == received + dropped` | [`Verdict::Append`] after a `gap` of `dropped` bytes |
//! | anything else (starts past `received`) | [`Verdict::Conflict`]: answer `409` with `{"received": received}` |
//!
//! After an `Append`, `received` becomes [`Verdict::Append::end`]
//! (`offset + len`); `Duplicate` and `Conflict` leave it unchanged. The rule
//! is strict about gaps: only the agent says bytes were dropped, and only
//! exactly where the server's ledger ends, so a server never invents a gap
//! and an agent that is told `409` resumes from `received` (with `dropped`
//! set if it no longer has those bytes).
//!
//! Stream positions are at most [`MAX_POSITION`] (2^63 − 1, what a signed
//! 64-bit column holds): [`in_range`] names the field of a chunk that would
//! carry the ledger past it, and a server refuses such a chunk (`400`
//! naming the field) before the ledger rule is applied. No agent gets near
//! it (it is 8 EiB of output); a chunk that claims it is hostile.

/// The largest stream position a chunk may reach: its `offset` plus its
/// length, and `dropped`, are at most this.
pub const MAX_POSITION: u64 = i64::MAX as u64;

/// The field of a chunk of `len` bytes at `offset` after `dropped` bytes
/// that goes past [`MAX_POSITION`], if one does: `dropped` when it alone
/// does, else `offset` (its end, `offset + len`, is the position the chunk
/// would reach).
pub fn in_range(offset: u64, dropped: u64, len: u64) -> Result<(), &'static str> {
    if dropped > MAX_POSITION {
        return Err("dropped");
    }
    match offset.checked_add(len) {
        Some(end) if end <= MAX_POSITION => Ok(()),
        _ => Err("offset"),
    }
}

/// What a server does with one log chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Acknowledge with `end`, after recording a gap of `gap` bytes (zero:
    /// none) at the ledger's old end, then storing the chunk's bytes from
    /// `skip` on (a retry may overlap bytes already held).
    Append { gap: u64, skip: u64, end: u64 },
    /// Every byte of the chunk is already accounted for: acknowledge with
    /// the ledger's `received`, store nothing.
    Duplicate,
    /// The chunk would leave a gap the agent did not declare: answer `409`
    /// with `{"received": received}` (`crate::LogReceived`).
    Conflict,
}

impl Verdict {
    /// The bytes of a chunk that are new to the ledger, to store: those
    /// from `skip` on for an append, none otherwise.
    pub fn fresh(self, bytes: &[u8]) -> &[u8] {
        match self {
            Self::Append { skip, .. } => bytes.get(usize::try_from(skip).unwrap_or(usize::MAX)..).unwrap_or_default(),
            Self::Duplicate | Self::Conflict => &[],
        }
    }
}

/// The verdict on a chunk of `len` bytes at stream `offset`, following
/// `dropped` bytes the agent gave up on, when the server has accounted for
/// `received` bytes of the stream. Pure and total: no input panics, and an
/// `offset + len` past `u64::MAX` is a conflict.
pub fn accept(received: u64, offset: u64, dropped: u64, len: u64) -> Verdict {
    let Some(end) = offset.checked_add(len) else {
        return Verdict::Conflict;
    };
    if offset <= received {
        return if end <= received {
            Verdict::Duplicate
        } else {
            Verdict::Append { gap: 0, skip: received - offset, end }
        };
    }
    if dropped > 0 && offset - dropped == received {
        return Verdict::Append { gap: dropped, skip: 0, end };
    }
    Verdict::Conflict
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_chunk_is_appended() {
        assert_eq!(accept(0, 0, 0, 10), Verdict::Append { gap: 0, skip: 0, end: 10 });
        assert_eq!(accept(10, 10, 0, 5), Verdict::Append { gap: 0, skip: 0, end: 15 });
    }

    #[test]
    fn a_retry_is_a_duplicate_or_adds_only_what_is_new() {
        assert_eq!(accept(10, 0, 0, 10), Verdict::Duplicate);
        assert_eq!(accept(10, 4, 0, 6), Verdict::Duplicate);
        assert_eq!(accept(10, 4, 0, 10), Verdict::Append { gap: 0, skip: 6, end: 14 });
        assert_eq!(accept(10, 10, 0, 0), Verdict::Duplicate, "an empty chunk adds nothing");
    }

    #[test]
    fn only_an_append_has_bytes_to_store() {
        assert_eq!(accept(10, 4, 0, 10).fresh(b"0123456789"), b"6789");
        assert_eq!(accept(0, 0, 0, 3).fresh(b"abc"), b"abc");
        assert_eq!(accept(10, 0, 0, 10).fresh(b"0123456789"), b"");
        assert_eq!(accept(10, 11, 0, 1).fresh(b"x"), b"");
    }

    #[test]
    fn a_declared_gap_at_the_end_is_accepted_and_recorded() {
        assert_eq!(accept(10, 25, 15, 5), Verdict::Append { gap: 15, skip: 0, end: 30 });
        assert_eq!(accept(10, 25, 15, 0), Verdict::Append { gap: 15, skip: 0, end: 25 }, "a gap with no bytes");
        // Its retry, once accepted, is a duplicate: the gap is not recorded twice.
        assert_eq!(accept(30, 25, 15, 5), Verdict::Duplicate);
    }

    #[test]
    fn a_chunk_reaching_past_the_largest_position_names_its_field() {
        assert_eq!(in_range(0, 0, 10), Ok(()));
        assert_eq!(in_range(MAX_POSITION - 10, 0, 10), Ok(()), "ending exactly at the largest position");
        assert_eq!(in_range(MAX_POSITION, MAX_POSITION, 0), Ok(()));
        assert_eq!(in_range(MAX_POSITION - 9, 0, 10), Err("offset"), "its end is one past");
        assert_eq!(in_range(1 << 63, 1 << 63, 1), Err("dropped"), "the attack's chunk");
        assert_eq!(in_range(1 << 63, 0, 1), Err("offset"));
        assert_eq!(in_range(u64::MAX, 0, 1), Err("offset"), "an end past u64::MAX");
    }

    #[test]
    fn an_undeclared_or_misplaced_gap_is_a_conflict() {
        assert_eq!(accept(10, 11, 0, 5), Verdict::Conflict);
        assert_eq!(accept(10, 25, 14, 5), Verdict::Conflict, "the gap ends short of the ledger");
        assert_eq!(accept(10, 25, 16, 5), Verdict::Conflict, "the gap overlaps bytes held");
        assert_eq!(accept(10, u64::MAX, 0, 1), Verdict::Conflict, "an end past u64::MAX");
    }
}
