//! A run's terminal output, chunk by chunk: the ledger rule is the
//! contract's ([`standby_protocol::log_chunk::accept`]); what is stored
//! stops at the run's log cap ([`super::RunBounds::log_cap`]), past which
//! chunks are acknowledged and counted.

use standby_protocol::log_chunk::{MAX_POSITION, Verdict, accept, in_range};

use super::{Rules, Step, Write};

/// Where a run's log stands, kept in memory while the run is and stored
/// with every chunk (so a restart and the log endpoint know it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogLedger {
    /// Bytes of the output stream accounted for: held, dropped by the
    /// agent (gaps), or over the cap ([`standby_protocol::log_chunk`]).
    pub received: u64,
    /// Bytes stored.
    pub held: u64,
    /// Bytes acknowledged but not stored: the log had reached its cap.
    pub over_cap: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// The chunk starts past the end of what was received, other than
    /// after exactly the gap it declares (`409` with `received`).
    #[error(
        "log chunk at offset {offset} (after {dropped} dropped bytes) does not follow the {received} bytes received"
    )]
    Conflict { offset: u64, dropped: u64, received: u64 },
    /// The chunk would carry the run's log past
    /// [`MAX_POSITION`], more than the store can count (`400` naming
    /// `field`): refused before anything of it is kept, so no input can
    /// make the store refuse a write and stop the engine.
    #[error("{field}: the chunk would carry the log past byte {max} of the stream", max = MAX_POSITION)]
    OutOfRange { field: &'static str },
}

impl Rules {
    /// A chunk of the run's log: `data` at stream `offset`, after `dropped`
    /// bytes the agent gave up on. The ledger rule is
    /// [`standby_protocol::log_chunk::accept`]; past the run's log cap the
    /// chunk is acknowledged and counted, not stored. A chunk for a run not
    /// in memory (finished and evicted, or unknown) is acknowledged and
    /// dropped. Returns the bytes accounted for, to acknowledge.
    pub(super) fn log(
        &mut self,
        run_id: &str,
        offset: u64,
        dropped: u64,
        data: &[u8],
    ) -> Result<(Step, u64), LogError> {
        let mut step = Step::default();
        let len = data.len() as u64;
        in_range(offset, dropped, len).map_err(|field| LogError::OutOfRange { field })?;
        if !self.runs.contains_key(run_id) {
            tracing::debug!(run_id, offset, len, "log chunk for a run not in memory acknowledged and dropped");
            return Ok((step, offset.saturating_add(len)));
        }
        let mut ledger = self.logs.get(run_id).copied().unwrap_or_default();
        let (gap, skip, end) = match accept(ledger.received, offset, dropped, len) {
            Verdict::Append { gap, skip, end } => (gap, skip, end),
            Verdict::Duplicate => return Ok((step, ledger.received)),
            Verdict::Conflict => return Err(LogError::Conflict { offset, dropped, received: ledger.received }),
        };
        let fresh = data.get(usize::try_from(skip).unwrap_or(usize::MAX)..).unwrap_or_default();
        let room = usize::try_from(self.config.bounds.log_cap.saturating_sub(ledger.held)).unwrap_or(usize::MAX);
        let kept = &fresh[..fresh.len().min(room)];
        if gap > 0 {
            tracing::warn!(run_id, gap, "the agent dropped output: gap recorded");
        }
        if kept.len() < fresh.len() && ledger.over_cap == 0 {
            tracing::warn!(run_id, cap = self.config.bounds.log_cap, "the run's log reached its cap: output dropped");
        }
        let start = end - fresh.len() as u64;
        ledger.received = end;
        ledger.held += kept.len() as u64;
        ledger.over_cap += (fresh.len() - kept.len()) as u64;
        self.logs.insert(run_id.to_owned(), ledger);
        step.writes.push(Write::Log { run_id: run_id.to_owned(), offset: start, data: kept.to_vec(), ledger });
        Ok((step, end))
    }

    #[cfg(test)]
    pub(super) fn log_ledger(&self, run_id: &str) -> LogLedger {
        self.logs.get(run_id).copied().unwrap_or_default()
    }
}
