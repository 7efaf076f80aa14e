//! A follow-up turn on its thread's parked sandbox: bound at once to a
//! ready agent (Tier 2), or the sandbox started and the run bound once its
//! agent is ready (Tier 1, or a Tier 2 sandbox whose agent is gone).
//!
//! A resume that fails (the sandbox is gone, the provider refuses to start
//! it, its agent is not ready in time or ends first) retires the sandbox,
//! records why on the run, and places the run like a new one: a run never
//! fails for the lifecycle's sake.

use super::placement::{Need, Placement, SlotQueue};
use super::sandboxes::Retirement;
use super::{Dispatch, Effect, Live, Step};
use crate::credential::CredentialKind;
use crate::model::{CredentialState, Millis, Park, ParkMode, Resume, RunPath, RunState, SandboxState};

impl Dispatch {
    /// Binds `run_id` to its thread's parked sandbox, or starts making it
    /// ready; `None` when there is nothing to resume (or it cannot be, for
    /// a reason now recorded on the run) and the run is placed like a new
    /// one.
    pub(super) fn place_on_thread(
        &mut self,
        now: Millis,
        step: &mut Step,
        run_id: &str,
        thread_id: &str,
        slots: SlotQueue,
    ) -> Option<Placement> {
        let sandbox_id = self.threads.get(thread_id)?.sandbox_id.clone()?;
        let live = self.sandboxes.get(&sandbox_id)?;
        if live.record.state != SandboxState::Parked {
            return None;
        }
        let from = live.park_mode()?;
        if let Some(why) = self.fingerprint_changed(run_id, live) {
            let resume = Resume { sandbox_id: sandbox_id.clone(), from, began_at: now, ready_at: None, fallback: None };
            self.update_run(step, run_id, |run| run.resume = Some(resume));
            self.give_up_resume(now, step, run_id, &sandbox_id, &why);
            return None;
        }
        if from == ParkMode::Running && self.parked_ready(now, live) {
            let resume =
                Resume { sandbox_id: sandbox_id.clone(), from, began_at: now, ready_at: Some(now), fallback: None };
            self.update_run(step, run_id, |run| run.resume = Some(resume));
            self.commit(now, step, run_id, &sandbox_id, RunPath::ParkedRunning);
            self.claim_thread(now, step, run_id, &sandbox_id);
            self.tell_standby(step, run_id, &sandbox_id);
            return Some(Placement::Placed);
        }
        let exited = live.exited;
        if exited && !self.may_take_slot(slots) {
            return Some(Placement::Wait { reason: self.cap_reason(), needs: Need::ColdSlot });
        }
        let resume = Resume { sandbox_id: sandbox_id.clone(), from, began_at: now, ready_at: None, fallback: None };
        self.update_run(step, run_id, |run| {
            run.state = RunState::Resuming;
            run.wait = None;
            run.resume = Some(resume);
        });
        self.claim_thread(now, step, run_id, &sandbox_id);
        self.update_sandbox(step, &sandbox_id, |record| {
            record.state = SandboxState::Resuming;
            record.run_id = Some(run_id.to_owned());
        });
        if exited {
            self.emit_resume(now, step, &sandbox_id);
        } else if from == ParkMode::Stopped
            && let Some(live) = self.sandboxes.get_mut(&sandbox_id)
        {
            // Still being stopped: start it again once it is.
            live.resume_after_exit = true;
        }
        Some(Placement::Placed)
    }

    /// A parked-running sandbox whose fresh agent is ready and connected.
    fn parked_ready(&self, now: Millis, live: &Live) -> bool {
        !live.exited
            && !live.resume_after_exit
            && live.heartbeat.as_ref().is_some_and(|h| {
                h.state == standby_protocol::AgentState::Ready && now <= h.at.plus(self.config.silence())
            })
            && self.live_standby_conns(live).next().is_some()
    }

    /// Starts a kept sandbox's agent with a new standby credential.
    pub(super) fn emit_resume(&mut self, now: Millis, step: &mut Step, sandbox_id: &str) {
        let Some(live) = self.sandboxes.get(sandbox_id) else { return };
        let old = live.record.standby_credential_id.clone();
        if self.credentials.get(&old).is_some_and(|c| c.state == CredentialState::Active) {
            self.set_credential(step, &old, CredentialState::Revoked);
        }
        let policy = &self.config.pool_policy;
        let auto_stop = policy.auto_stop.effective(policy.warm_idle);
        let (credential_id, token) = self.new_credential(step, CredentialKind::Standby, sandbox_id, None);
        self.update_sandbox(step, sandbox_id, |record| {
            record.standby_credential_id = credential_id;
            record.exit_code = None;
            record.auto_stop_minutes = Some(auto_stop);
        });
        if let Some(live) = self.sandboxes.get_mut(sandbox_id) {
            live.exited = false;
            live.launched_at = now;
            live.heartbeat = None;
            live.ever_ready = false;
            live.resume_after_exit = false;
            live.run_token = None;
            live.spec_served = false;
            live.assignment_withheld = false;
        }
        step.effects.push(Effect::Resume { sandbox_id: sandbox_id.to_owned(), token, auto_stop });
    }

    /// Why the run cannot use this sandbox: the workspace it was prepared
    /// with is not the one the run names, or not the pool's any more.
    fn fingerprint_changed(&self, run_id: &str, live: &Live) -> Option<String> {
        let record = &live.record;
        if record.workspace.is_none() && record.fingerprint != self.config.pool_fingerprint {
            return Some(format!(
                "the pool spec changed since the sandbox was prepared (fingerprint {} then, {} now)",
                record.fingerprint, self.config.pool_fingerprint
            ));
        }
        let wanted = self.runs.get(run_id)?.fingerprint.clone()?;
        (wanted != record.fingerprint).then(|| {
            format!(
                "the run's workspace has fingerprint {wanted}, the sandbox was prepared with {}",
                record.fingerprint
            )
        })
    }

    /// A resuming sandbox's agent said `ready`: the run is bound and told.
    pub(super) fn resumed_ready(&mut self, now: Millis, step: &mut Step, sandbox_id: &str) {
        let Some(run_id) = self.sandboxes.get(sandbox_id).and_then(|live| live.record.run_id.clone()) else { return };
        let Some(run) = self.runs.get(&run_id).filter(|run| run.state == RunState::Resuming) else { return };
        let path = match run.resume.as_ref().map(|resume| resume.from) {
            Some(ParkMode::Running) => RunPath::ParkedRunning,
            _ => RunPath::ParkedStopped,
        };
        self.update_run(step, &run_id, |run| {
            if let Some(resume) = run.resume.as_mut() {
                resume.ready_at = Some(now);
            }
        });
        self.commit(now, step, &run_id, sandbox_id, path);
        self.tell_standby(step, &run_id, sandbox_id);
    }

    /// A resuming sandbox's agent exited: the old one (start it again
    /// now), or the resumed one before it was ready (give up).
    pub(super) fn resuming_exited(&mut self, now: Millis, step: &mut Step, sandbox_id: &str, reason: &str) {
        let pending = self.sandboxes.get(sandbox_id).is_some_and(|live| live.resume_after_exit);
        if pending {
            self.emit_resume(now, step, sandbox_id);
        } else {
            self.resume_fallback(now, step, sandbox_id, &format!("its agent ended before it was ready: {reason}"));
        }
    }

    /// The resume of `sandbox_id` failed: the sandbox is retired, the run
    /// goes back to the head of the queue with the reason recorded.
    pub(super) fn resume_fallback(&mut self, now: Millis, step: &mut Step, sandbox_id: &str, reason: &str) {
        let Some(run_id) = self.sandboxes.get(sandbox_id).and_then(|live| live.record.run_id.clone()) else { return };
        self.give_up_resume(now, step, &run_id, sandbox_id, reason);
        let resuming = self.runs.get(&run_id).is_some_and(|run| run.state == RunState::Resuming);
        if resuming {
            self.update_run(step, &run_id, |run| run.state = RunState::Queued);
            self.queue.push_front(run_id);
        }
    }

    fn give_up_resume(&mut self, now: Millis, step: &mut Step, run_id: &str, sandbox_id: &str, reason: &str) {
        tracing::info!(run_id, sandbox_id, reason, "resume given up: the run gets a fresh sandbox");
        self.update_run(step, run_id, |run| {
            if let Some(resume) = run.resume.as_mut() {
                resume.fallback = Some(reason.to_owned());
            }
        });
        let retirement = Retirement::new(format!("resume failed: {reason}")).revoking().telling("not resumed");
        self.retire_sandbox(now, step, sandbox_id, retirement);
    }

    /// The provider could not make `sandbox_id` run again (`gone`: it does
    /// not exist any more).
    pub fn resume_failed(&mut self, now: Millis, sandbox_id: &str, reason: &str, gone: bool) -> Step {
        let mut step = Step::default();
        let Some(live) = self.sandboxes.get_mut(sandbox_id) else { return step };
        live.exited = true;
        match live.record.state {
            SandboxState::Resuming => self.resume_fallback(now, &mut step, sandbox_id, reason),
            SandboxState::Parked if gone => {
                let retirement = Retirement::new(format!("a parked sandbox could not be started: {reason}"));
                self.retire_sandbox(now, &mut step, sandbox_id, retirement.revoking());
            }
            SandboxState::Parked => {
                let reason = format!("its fresh agent could not be started: {reason}");
                self.park_stopped_or_release(now, &mut step, sandbox_id, &reason);
            }
            _ => {}
        }
        self.place_and_top_up(now, &mut step);
        step
    }

    /// A resuming run was cancelled: its sandbox is parked again.
    pub(super) fn unclaim_resume(&mut self, now: Millis, step: &mut Step, run_id: &str) {
        let Some(sandbox_id) = self.runs.get(run_id).and_then(|run| run.resume.as_ref()).map(|r| r.sandbox_id.clone())
        else {
            return;
        };
        let claimed = self.sandboxes.get(&sandbox_id).is_some_and(|live| {
            live.record.state == SandboxState::Resuming && live.record.run_id.as_deref() == Some(run_id)
        });
        if !claimed {
            return;
        }
        let warm_idle = self.config.pool_policy.warm_idle;
        let park = Park { mode: ParkMode::Running, since: now, until: Some(now.plus(warm_idle)) };
        self.update_sandbox(step, &sandbox_id, |record| {
            record.state = SandboxState::Parked;
            record.run_id = None;
            record.park = Some(park);
        });
        if warm_idle.is_zero() {
            self.park_stopped_or_release(now, step, &sandbox_id, "its resume was cancelled");
        }
    }
}
