//! What one run may cost the server, as rules of the pure machine: the log
//! ledger and its per-run cap, the events a run records, and how long a
//! finished run stays in memory (`docs/operations.md`, "Per-run bounds").
//!
//! A finished run leaves memory `retention` after it ended; it stays in the
//! store, where the API reads it. Nothing the machine decides needs a
//! finished run: a thread's holder that is gone counts as finished, and an
//! event or a log chunk for a run no longer in memory is acknowledged and
//! dropped (its agent exited long before).

use std::time::Duration;

use standby_protocol::log_ledger::{Verdict, accept};

use super::{Dispatch, LogError, Step, Write};
use crate::metrics::Histogram;
use crate::model::{AttemptOutcome, Millis, RunPath, RunRecord, RunState};

/// Distinct events a run records. An agent sends a handful per attempt;
/// beyond this an event still acts on the run but is not stored.
pub const MAX_EVENTS_PER_RUN: usize = 64;

/// Per-run bounds, from flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunBounds {
    /// Bytes of a run's log stored; beyond it chunks are acknowledged and
    /// counted, not stored.
    pub log_cap: u64,
    /// How long a finished run stays in memory.
    pub retention: Duration,
}

impl Default for RunBounds {
    fn default() -> Self {
        Self { log_cap: 64 * 1024 * 1024, retention: Duration::from_secs(600) }
    }
}

/// Where a run's log stands, kept in memory while the run is and stored
/// with every chunk (so a restart and the log endpoint know it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogLedger {
    /// Bytes of the output stream accounted for: held, dropped by the
    /// agent (gaps), or over the cap ([`standby_protocol::log_ledger`]).
    pub received: u64,
    /// Bytes stored.
    pub held: u64,
    /// Bytes acknowledged but not stored: the log had reached its cap.
    pub over_cap: u64,
}

/// What finished runs that left memory still count for `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct Evicted {
    pub runs: std::collections::BTreeMap<(RunState, Option<RunPath>), u64>,
    pub assignment_to_start: Histogram,
    pub requeues: u64,
    pub resume_fallbacks: u64,
}

impl Evicted {
    fn add(&mut self, run: &RunRecord) {
        *self.runs.entry((run.state, run.path())).or_default() += 1;
        for attempt in &run.attempts {
            if let (Some(sent), Some(started)) = (attempt.assignment_sent_at, attempt.started_at) {
                self.assignment_to_start.observe(started.since(sent));
            }
            if attempt.outcome == Some(AttemptOutcome::Requeued) {
                self.requeues += 1;
            }
        }
        if run.resume.as_ref().is_some_and(|resume| resume.fallback.is_some()) {
            self.resume_fallbacks += 1;
        }
    }
}

impl Dispatch {
    /// A chunk of the run's log: `data` at stream `offset`, after `dropped`
    /// bytes the agent gave up on. The ledger rule is
    /// [`standby_protocol::log_ledger::accept`]; past the run's log cap the
    /// chunk is acknowledged and counted, not stored. A chunk for a run not
    /// in memory (finished and evicted, or unknown) is acknowledged and
    /// dropped. Returns the bytes accounted for, to acknowledge.
    pub fn log(&mut self, run_id: &str, offset: u64, dropped: u64, data: &[u8]) -> Result<(Step, u64), LogError> {
        let mut step = Step::default();
        let len = data.len() as u64;
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

    pub fn log_ledger(&self, run_id: &str) -> LogLedger {
        self.logs.get(run_id).copied().unwrap_or_default()
    }

    /// Records the event `event_id` of `run_id` as seen; `false` when the
    /// run already recorded [`MAX_EVENTS_PER_RUN`] events (it is not
    /// recorded then).
    pub(super) fn remember_event(&mut self, run_id: &str, event_id: &str) -> bool {
        let seen = self.events_seen.entry(run_id.to_owned()).or_default();
        if seen.len() >= MAX_EVENTS_PER_RUN {
            return false;
        }
        seen.insert(event_id.to_owned())
    }

    pub(super) fn event_seen(&self, run_id: &str, event_id: &str) -> bool {
        self.events_seen.get(run_id).is_some_and(|seen| seen.contains(event_id))
    }

    /// Drops from memory the runs that finished `retention` ago or more,
    /// with what is kept per run (events seen, log ledger); their counts
    /// stay in `/metrics`.
    pub(super) fn evict_finished(&mut self, now: Millis) {
        let retention = self.config.bounds.retention;
        let expired: Vec<String> = self
            .runs
            .values()
            .filter(|run| run.state.is_terminal() && now >= run.ended_at.unwrap_or(run.submitted_at).plus(retention))
            .map(|run| run.id.clone())
            .collect();
        for run_id in expired {
            if let Some(run) = self.runs.remove(&run_id) {
                self.evicted.add(&run);
            }
            self.events_seen.remove(&run_id);
            self.logs.remove(&run_id);
            self.queue.retain(|queued| *queued != run_id);
            tracing::debug!(run_id, "finished run evicted from memory");
        }
    }

    /// Runs held in memory (unfinished ones, and finished ones within the
    /// retention window).
    pub fn runs_in_memory(&self) -> usize {
        self.runs.len()
    }
}
