//! What one run may cost the server, as rules of the pure machine: its log
//! cap (applied in [`super::logs`]), the events it records (applied in
//! [`super::events`]), and how long it stays in memory once finished
//! (`docs/operations.md`, "Per-run bounds").
//!
//! A finished run leaves memory `retention` after it ended; it stays in the
//! store, where the API reads it. Nothing the machine decides needs a
//! finished run: a thread's holder that is gone counts as finished, and an
//! event or a log chunk for a run no longer in memory is acknowledged and
//! dropped (its agent exited long before).

use std::time::Duration;

use super::{Histogram, Rules, StartTimes};
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
    /// How long an `Idempotency-Key` of `POST /v1/runs` is kept: a retry
    /// within it answers the run the key made.
    pub idempotency_window: Duration,
}

impl Default for RunBounds {
    fn default() -> Self {
        Self {
            log_cap: 64 * 1024 * 1024,
            retention: Duration::from_secs(600),
            idempotency_window: Duration::from_secs(24 * 3600),
        }
    }
}

/// What finished runs that left memory still count for `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct Evicted {
    pub runs: std::collections::BTreeMap<(RunState, Option<RunPath>), u64>,
    pub assignment_to_start: Histogram,
    pub requeues: u64,
    pub resume_fallbacks: u64,
    pub start_times: StartTimes,
}

impl Evicted {
    fn add(&mut self, run: &RunRecord) {
        *self.runs.entry((run.state, run.path())).or_default() += 1;
        self.start_times.observe(run);
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

impl Rules {
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
    #[cfg(test)]
    pub(super) fn runs_in_memory(&self) -> usize {
        self.runs.len()
    }
}
