//! Time passing: sandboxes gone silent are written off or retired, parked
//! sandboxes and resumes are checked ([`super::threads`]), cancel graces
//! and standby TTLs expire, finished runs leave memory, and the queue and
//! the pool are looked at again.

use super::sandboxes::Retirement;
use super::{Live, Rules, Step};
use crate::model::{Millis, RunState, SandboxState};

/// A sandbox that stopped being heard from.
struct Silent {
    sandbox_id: String,
    state: SandboxState,
    run_id: Option<String>,
    reason: &'static str,
}

impl Rules {
    /// Time passed: write off silent committed sandboxes, retire silent
    /// standbys, refill the pool once its backoff expired.
    pub(super) fn tick(&mut self, now: Millis) -> Step {
        let mut step = Step::default();
        if self.draining {
            return step;
        }
        let silent: Vec<Silent> = self.sandboxes.active().filter_map(|live| self.silent(now, live)).collect();
        for Silent { sandbox_id, state, run_id, reason } in silent {
            if state == SandboxState::Standby {
                self.retire_sandbox(now, &mut step, &sandbox_id, Retirement::new(reason).told());
            } else {
                self.sandbox_lost(now, &mut step, &sandbox_id, state, run_id, reason);
            }
        }
        self.tick_threads(now, &mut step);
        self.expire_graces(now, &mut step);
        self.expire_standbys(now, &mut step);
        self.evict_finished(now);
        self.expire_idempotency(now, &mut step);
        self.place_and_top_up(now, &mut step);
        step
    }

    /// Whether `live` went silent: a standby (with its agent running) not
    /// heard from within the silence limit (counted from its snapshot's
    /// end when it was paused for one), or a sandbox bound to a run
    /// whose delivery is unconfirmed not heard from within it since the
    /// commit. A confirmed run is written off only after the far longer
    /// [`super::RulesConfig::run_silence`]: its agent may be busy
    /// starting it, or reconnecting.
    fn silent(&self, now: Millis, live: &Live) -> Option<Silent> {
        let record = &live.record;
        let silence = self.config.silence();
        let connect_by = live.launched_at.plus(self.config.launch_timeout);
        let lost = |reason| Silent { sandbox_id: record.id.clone(), state: record.state, run_id: None, reason };
        match record.state {
            SandboxState::Retired | SandboxState::Parked | SandboxState::Resuming => None,
            // Paused by the provider for its snapshot's commit, which can
            // outlast the silence limit (a large workspace): unheard, not
            // silent.
            SandboxState::Standby if live.snapshotting => None,
            SandboxState::Standby => {
                let silent = match &live.heartbeat {
                    Some(heartbeat) => {
                        now > heartbeat.at.max(live.snapshot_ended_at.unwrap_or(Millis(0))).plus(silence)
                    }
                    None => now > connect_by,
                };
                (silent && !live.exited).then(|| lost("no heartbeat within three intervals"))
            }
            SandboxState::Assigned => {
                let run = record.run_id.as_ref().and_then(|id| self.runs.get(id));
                let attempt = run.and_then(|run| run.current()).filter(|a| a.sandbox_id == record.id);
                let unconfirmed = run.is_some_and(|run| run.state == RunState::Committed) && attempt.is_some();
                let committed_at = run.and_then(|run| run.current()).map_or(Millis(0), |a| a.committed_at);
                let silent = match &live.heartbeat {
                    Some(heartbeat) => now > heartbeat.at.max(committed_at).plus(silence),
                    None => now > connect_by.max(committed_at.plus(self.config.launch_timeout)),
                };
                let heard_at = live.heartbeat.as_ref().map_or(live.launched_at, |h| h.at.max(live.launched_at));
                let lost_for_good = !unconfirmed && run.is_some() && now > heard_at.plus(self.config.run_silence);
                if unconfirmed && silent {
                    Some(Silent { run_id: record.run_id.clone(), ..lost("stopped heartbeating") })
                } else if lost_for_good && !live.exited {
                    Some(Silent {
                        run_id: record.run_id.clone(),
                        ..lost("unheard for longer than the run silence bound")
                    })
                } else {
                    None
                }
            }
        }
    }
}
