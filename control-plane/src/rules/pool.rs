//! The pool policy: `min_ready` standbys, the running cap, the standby TTL.
//!
//! - A sandbox costs compute from its launch until its agent's exit is
//!   seen, whatever its state (a retired sandbox lingering counts, a parked
//!   stopped one does not). Nothing is launched past the running cap.
//! - Runs come first: while a run waits for a slot no standby is made, and
//!   room is made for it by stopping the oldest parked-running sandbox
//!   (parked stopped, or released), and then, for runs that cannot take a
//!   standby, by retiring standbys.
//! - A standby past its jittered expiry has a replacement made; it stays a
//!   candidate until enough fresh standbys are ready, and is retired then,
//!   or at 95% of its TTL at the latest.

use std::time::Duration;

use super::sandboxes::Retirement;
use super::{Effect, Provision, Rules, Step};
use crate::model::{Millis, ParkMode, SandboxKind, SandboxState};
use crate::policy::{retire_at, ttl_schedule};

/// Standbys one step makes at most: a pool of tens of thousands fills over
/// ticks, each step one transaction of bounded size, so no commit holds
/// the lease row for long (a replica's lease claim waits on it: measured,
/// 45,000 standbys made in one step kept a claim waiting past its
/// statement timeout, and the leader was deposed).
pub const TOP_UP_BATCH: usize = 1_000;

impl Rules {
    /// Sandboxes costing compute now.
    pub(super) fn running_count(&self) -> usize {
        self.sandboxes.running()
    }

    pub(super) fn slot_free(&self) -> bool {
        let cap = self.config.pool_policy.running_cap;
        cap == 0 || self.running_count() < cap
    }

    pub(super) fn cap_reason(&self) -> String {
        format!("the running cap of {} sandboxes is reached", self.config.pool_policy.running_cap)
    }

    /// Keeps `pool_size` warm standbys with no run that are not expiring,
    /// within the running cap, unless runs wait for a slot or a run of
    /// launch failures put the pool in backoff.
    pub(super) fn top_up(&mut self, now: Millis, step: &mut Step) {
        if self.draining || now < self.pool_backoff_until || self.blocked > 0 {
            return;
        }
        let live = self.sandboxes.standbys_unexpired(now);
        let cap = self.config.pool_policy.running_cap;
        let room = if cap == 0 { usize::MAX } else { cap.saturating_sub(self.running_count()) };
        let preparing_room = match self.config.pool_policy.max_preparing {
            0 => usize::MAX,
            most => most.saturating_sub(self.preparing_count()),
        };
        for _ in 0..self.config.pool_size.saturating_sub(live).min(room).min(preparing_room).min(TOP_UP_BATCH) {
            let fingerprint = self.config.pool_fingerprint.clone();
            let (sandbox_id, credential_id, token) =
                self.create_sandbox(now, step, SandboxKind::Warm, None, fingerprint.clone());
            let schedule = ttl_schedule(&sandbox_id, now, self.config.pool_policy.standby_ttl);
            self.update_sandbox(step, &sandbox_id, |record| {
                record.expires_at = schedule.map(|s| s.expires_at);
                record.deadline = schedule.map(|s| s.deadline);
                record.auto_stop_minutes = Some(0);
            });
            step.effects.push(Effect::Launch {
                sandbox_id,
                credential_id,
                token,
                provision: Provision::Create,
                auto_stop: 0,
                fingerprint,
            });
        }
    }

    /// Pool standbys launched whose agent was never ready: preparing.
    fn preparing_count(&self) -> usize {
        self.sandboxes
            .standbys()
            .filter(|live| live.record.kind == SandboxKind::Warm && !live.exited && !live.ever_ready)
            .count()
    }

    pub(super) fn pool_failed(&mut self, now: Millis) {
        self.pool_failures = self.pool_failures.saturating_add(1);
        let exponent = self.pool_failures.saturating_sub(1).min(6);
        let delay = Duration::from_secs(1u64 << exponent).min(Duration::from_secs(60));
        self.pool_backoff_until = now.plus(delay);
    }

    /// Retires expired standbys, oldest expiry first, as long as
    /// `pool_size` ready standbys remain without them (their replacements
    /// are ready), and any standby at 95% of its TTL.
    pub(super) fn expire_standbys(&mut self, now: Millis, step: &mut Step) {
        if self.draining || !self.sandboxes.any_standby_expired(now) {
            return;
        }
        let mut ready = self.sandboxes.standbys().filter(|live| self.is_candidate(now, live)).count();
        let mut expired: Vec<(Millis, String, bool, bool)> = self
            .sandboxes
            .standbys()
            .filter_map(|live| {
                let expires_at = live.record.expires_at?;
                let hard = live.record.deadline.is_some_and(|d| now >= retire_at(live.record.created_at, d));
                let candidate = self.is_candidate(now, live);
                (now >= expires_at).then(|| (expires_at, live.record.id.clone(), hard, candidate))
            })
            .collect();
        expired.sort();
        for (_, sandbox_id, hard, candidate) in expired {
            let spare = if candidate { ready > self.config.pool_size } else { ready >= self.config.pool_size };
            if hard || spare {
                ready -= usize::from(candidate);
                let reason = if hard { "standby TTL: retired before its deadline" } else { "standby TTL: replaced" };
                let retirement = Retirement::new(reason).told().lingering(self.config.linger);
                self.retire_sandbox(now, step, &sandbox_id, retirement);
            }
        }
    }

    /// Makes room for the runs waiting for a running slot, beyond the
    /// sandboxes already on their way out.
    pub(super) fn make_room(&mut self, now: Millis, step: &mut Step) {
        if self.blocked == 0 {
            return;
        }
        let leaving = self
            .sandboxes
            .values()
            .filter(|live| !live.exited)
            .filter(|live| {
                live.record.state == SandboxState::Retired
                    || (live.record.state == SandboxState::Parked && live.park_mode() == Some(ParkMode::Stopped))
            })
            .count();
        let mut short = self.blocked.saturating_sub(leaving);
        let mut parked: Vec<(Millis, String)> = self
            .sandboxes
            .values()
            .filter(|live| live.record.state == SandboxState::Parked && live.park_mode() == Some(ParkMode::Running))
            .filter(|live| !live.exited)
            .map(|live| (live.record.park.as_ref().map_or(now, |park| park.since), live.record.id.clone()))
            .collect();
        parked.sort();
        for (_, sandbox_id) in parked.into_iter().take(short) {
            self.park_stopped_or_release(now, step, &sandbox_id, "the running cap is reached and runs wait for a slot");
            short -= 1;
        }
        let mut standbys: Vec<(Millis, String)> = self
            .sandboxes
            .values()
            .filter(|l| l.record.kind == SandboxKind::Warm && l.record.state == SandboxState::Standby && !l.exited)
            .map(|live| (live.record.created_at, live.record.id.clone()))
            .collect();
        standbys.sort();
        for (_, sandbox_id) in standbys.into_iter().take(short.min(self.blocked_cold)) {
            let reason = "retired to make room: the running cap is reached and runs that need a cold sandbox wait";
            self.retire_sandbox(now, step, &sandbox_id, Retirement::new(reason).told());
        }
    }
}
