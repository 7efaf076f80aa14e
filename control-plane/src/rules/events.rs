//! Lifecycle events from the agent holding a run credential: `started`,
//! `exited`, `cancelled` and `install_failed`. Each is recorded once (by
//! its `event_id`, up to [`MAX_EVENTS_PER_RUN`] a run) and acts only on the
//! current attempt of a run that has not ended.

use standby_protocol::{Event, EventKind};

use super::runs::{Retry, SandboxFate};
use super::{MAX_EVENTS_PER_RUN, Rules, Step, Write};
use crate::model::{AttemptOutcome, Millis, RunState, StoredEvent};

impl Rules {
    /// An event arrived with the credential of `attempt`. Duplicates (same
    /// `event_id`) are acknowledged and ignored. The agent's last event
    /// (anything but `started`) ends that credential's cancel grace.
    pub(super) fn event(&mut self, now: Millis, run_id: &str, attempt: u32, event: Event) -> Step {
        let last = event.kind.is_terminal();
        let mut step = self.record_event(now, run_id, attempt, event);
        if last {
            self.last_event(&mut step, run_id, attempt);
        }
        step
    }

    fn record_event(&mut self, now: Millis, run_id: &str, attempt: u32, event: Event) -> Step {
        let mut step = Step::default();
        if !self.runs.contains_key(run_id) {
            tracing::debug!(run_id, "event for a run not in memory acknowledged and dropped");
            return step;
        }
        if self.event_seen(run_id, &event.event_id) {
            return step;
        }
        if self.remember_event(run_id, &event.event_id) {
            step.writes.push(Write::Event(Box::new(StoredEvent {
                run_id: run_id.to_owned(),
                attempt,
                received_at: now,
                event: event.clone(),
            })));
        } else {
            tracing::warn!(run_id, "a run's event past its event bound acts but is not recorded");
        }
        let Some(run) = self.runs.get(run_id) else {
            return step;
        };
        let current = run.current().is_some_and(|a| a.number == attempt);
        let log_lost = event.log_outcome();
        let state = run.state;
        let sandbox_id = run.current().map(|a| a.sandbox_id.clone());
        if !current || state.is_terminal() {
            tracing::debug!(run_id, attempt, "event for a finished run or a past attempt recorded only");
            return step;
        }
        let install_us = event.install_timing().cloned();
        match event.kind {
            EventKind::Started => {
                let first = self.runs.get(run_id).and_then(|run| run.current()).is_some_and(|a| a.started_at.is_none());
                self.update_run(&mut step, run_id, |run| {
                    if run.state.is_pre_start() {
                        run.state = RunState::Running;
                    }
                    if let Some(attempt) = run.current_mut() {
                        attempt.started_at.get_or_insert(now);
                        if attempt.install_us.is_none() {
                            attempt.install_us = install_us;
                        }
                    }
                });
                if first {
                    self.trace_start(&mut step, run_id);
                }
            }
            EventKind::Exited { code } => {
                self.record_log_lost(run_id, log_lost);
                self.finish_attempt(now, &mut step, run_id, AttemptOutcome::Finished, format!("exited {code}"));
                if let Some(sandbox_id) = sandbox_id {
                    self.end_turn(now, &mut step, run_id, &sandbox_id, "its run finished");
                }
                self.end_run(now, &mut step, run_id, RunState::Exited, Some(code), None);
            }
            EventKind::Cancelled => {
                self.record_log_lost(run_id, log_lost);
                let outcome = if state.is_pre_start() { AttemptOutcome::Cancelled } else { AttemptOutcome::Finished };
                self.finish_attempt(now, &mut step, run_id, outcome, "cancelled".into());
                if let Some(sandbox_id) = sandbox_id {
                    self.end_turn(now, &mut step, run_id, &sandbox_id, "its run was cancelled");
                }
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
            }
            EventKind::InstallFailed { requeueable, stage, message } if state.is_pre_start() => {
                let reason = format!("install failed at {stage}: {message}");
                let retry = Retry::from_requeueable(requeueable);
                self.release(now, &mut step, run_id, retry, SandboxFate::Retire, reason);
            }
            EventKind::InstallFailed { .. } => {
                tracing::warn!(run_id, "install_failed after the run started ignored");
            }
        }
        self.place_and_top_up(now, &mut step);
        step
    }

    /// Keeps what the final event said of the log on the run; it is
    /// written with the run's end, which follows in the same step.
    fn record_log_lost(&mut self, run_id: &str, log_lost: Option<u64>) {
        if let Some(run) = self.runs.get_mut(run_id) {
            run.log_lost = log_lost;
        }
        if let Some(lost) = log_lost.filter(|&lost| lost > 0) {
            tracing::warn!(run_id, lost, "the run's agent gave up on part of its log");
        }
    }

    /// Records the event `event_id` of `run_id` as seen; `false` when the
    /// run already recorded [`MAX_EVENTS_PER_RUN`] events (it is not
    /// recorded then).
    fn remember_event(&mut self, run_id: &str, event_id: &str) -> bool {
        let seen = self.events_seen.entry(run_id.to_owned()).or_default();
        if seen.len() >= MAX_EVENTS_PER_RUN {
            return false;
        }
        seen.insert(event_id.to_owned())
    }

    fn event_seen(&self, run_id: &str, event_id: &str) -> bool {
        self.events_seen.get(run_id).is_some_and(|seen| seen.contains(event_id))
    }
}
