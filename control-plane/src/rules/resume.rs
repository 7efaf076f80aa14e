//! A follow-up turn on its thread's parked sandbox: what it does is a
//! pure decision ([`follow_up`], a table tested row by row), carried out
//! here; so is what the engine does with the provider to make the sandbox
//! run again ([`ResumeStart::for_found`]).
//!
//! | workspace | parked | its agent | running slot | the turn |
//! |---|---|---|---|---|
//! | changed | any | any | any | [`FollowUp::Fallback`]: the sandbox retired, the run placed like a new one |
//! | same | running (Tier 2) | ready | any | [`FollowUp::BindNow`] |
//! | same | any | exited | taken | [`FollowUp::WaitForSlot`] |
//! | same | any | exited | free | [`FollowUp::Resume`]: start it, bind once its agent is ready |
//! | same | stopped (Tier 1) | still running (being stopped) | any | [`FollowUp::ResumeAfterExit`] |
//! | same | running (Tier 2) | starting | any | [`FollowUp::AwaitReady`] |
//!
//! A resume that fails (the sandbox is gone, the provider refuses to start
//! it, its agent is not ready in time or ends first) retires the sandbox,
//! records why on the run, and places the run like a new one: a run never
//! fails for the lifecycle's sake.

use super::placement::{Need, Placement, SlotQueue};
use super::sandboxes::Retirement;
use super::{Effect, Live, Rules, Step};
use crate::credential::CredentialKind;
use crate::model::{CredentialState, Millis, Park, ParkMode, Resume, RunPath, RunState, SandboxState};
use crate::provider::Found;

/// Whether the sandbox was prepared with the workspace the turn expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Preparation {
    Same,
    /// The run names another workspace, or the pool spec changed since.
    Changed,
}

/// The agent of a parked sandbox, as a follow-up turn finds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ParkedAgent {
    /// A fresh agent is running, connected, and said `ready` within the
    /// silence limit.
    Ready,
    /// An agent is running but not ready: the last turn's agent is still
    /// exiting, a fresh one is starting, or the sandbox is being stopped.
    Starting,
    /// No agent is running.
    Exited,
}

/// Whether a new running slot is free for the turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Slot {
    Free,
    /// At the cap, or an earlier run waits for one.
    Taken,
}

/// What a follow-up turn finds of its thread's parked sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Parked {
    pub(super) preparation: Preparation,
    pub(super) mode: ParkMode,
    pub(super) agent: ParkedAgent,
    pub(super) slot: Slot,
}

/// What a follow-up turn does with its thread's parked sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FollowUp {
    /// The sandbox is retired and the run placed like a new one.
    Fallback,
    /// Tier 2: the ready agent takes the run at once.
    BindNow,
    /// Start the sandbox's agent (the provider starts a stopped sandbox
    /// first) and bind the run once it is ready.
    Resume,
    /// As [`FollowUp::Resume`], once the agent being stopped has exited.
    ResumeAfterExit,
    /// A fresh agent is on its way: bind the run once it is ready.
    AwaitReady,
    /// Starting the sandbox needs a running slot: wait for one.
    WaitForSlot,
}

/// The decision table of the module documentation.
pub(super) fn follow_up(parked: Parked) -> FollowUp {
    use {ParkedAgent as Agent, Preparation::Changed};
    match parked {
        Parked { preparation: Changed, .. } => FollowUp::Fallback,
        Parked { mode: ParkMode::Running, agent: Agent::Ready, .. } => FollowUp::BindNow,
        Parked { agent: Agent::Exited, slot: Slot::Taken, .. } => FollowUp::WaitForSlot,
        Parked { agent: Agent::Exited, slot: Slot::Free, .. } => FollowUp::Resume,
        Parked { mode: ParkMode::Stopped, .. } => FollowUp::ResumeAfterExit,
        Parked { mode: ParkMode::Running, .. } => FollowUp::AwaitReady,
    }
}

/// How the engine makes a kept sandbox run again before it launches a
/// fresh agent in it, by what the provider says of the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeStart {
    /// No agent (stopped, or a container kept between agents) or
    /// archived: start it.
    Start,
    /// Still running (an agent this server does not watch, or processes
    /// left behind): stop it, then start it.
    StopFirst,
}

impl ResumeStart {
    /// The table: `running` → stop first; `no agent`, `archived` → start;
    /// `missing` → the resume fails, the sandbox gone.
    pub fn for_found(found: Found) -> Result<Self, ResumeFailure> {
        match found {
            Found::NoAgent | Found::Archived => Ok(Self::Start),
            Found::Running => Ok(Self::StopFirst),
            Found::Missing => Err(ResumeFailure::Gone),
        }
    }
}

/// Why a kept sandbox could not be made to run again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResumeFailure {
    #[error("the sandbox no longer exists (deleted by the provider)")]
    Gone,
    /// The provider failed or did not answer in time, or the agent could
    /// not be launched: the message says which.
    #[error("{0}")]
    Failed(String),
}

impl Rules {
    /// Binds `run_id` to its thread's parked sandbox, or starts making it
    /// ready, as [`follow_up`] decides; `None` when there is nothing to
    /// resume (or it cannot be, for a reason now recorded on the run) and
    /// the run is placed like a new one.
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
        let mode = live.park_mode()?;
        let changed = self.fingerprint_changed(run_id, live);
        let agent = if live.exited {
            ParkedAgent::Exited
        } else if self.parked_ready(now, live) {
            ParkedAgent::Ready
        } else {
            ParkedAgent::Starting
        };
        let parked = Parked {
            preparation: if changed.is_some() { Preparation::Changed } else { Preparation::Same },
            mode,
            agent,
            slot: if self.may_take_slot(slots) { Slot::Free } else { Slot::Taken },
        };
        let resume =
            |ready_at| Resume { sandbox_id: sandbox_id.clone(), from: mode, began_at: now, ready_at, fallback: None };
        match follow_up(parked) {
            FollowUp::Fallback => {
                self.update_run(step, run_id, |run| run.resume = Some(resume(None)));
                let why = changed.unwrap_or_default();
                self.give_up_resume(now, step, run_id, &sandbox_id, &why);
                None
            }
            FollowUp::BindNow => {
                self.update_run(step, run_id, |run| run.resume = Some(resume(Some(now))));
                self.commit(now, step, run_id, &sandbox_id, RunPath::ParkedRunning);
                self.claim_thread(now, step, run_id, &sandbox_id);
                self.tell_standby(step, run_id, &sandbox_id);
                Some(Placement::Placed)
            }
            FollowUp::WaitForSlot => Some(Placement::Wait { reason: self.cap_reason(), needs: Need::ColdSlot }),
            FollowUp::Resume => {
                self.claim_for_resume(now, step, run_id, &sandbox_id, resume(None));
                self.emit_resume(now, step, &sandbox_id);
                Some(Placement::Placed)
            }
            FollowUp::ResumeAfterExit => {
                self.claim_for_resume(now, step, run_id, &sandbox_id, resume(None));
                if let Some(mut live) = self.sandboxes.get_mut(&sandbox_id) {
                    live.resume_after_exit = true;
                }
                Some(Placement::Placed)
            }
            FollowUp::AwaitReady => {
                self.claim_for_resume(now, step, run_id, &sandbox_id, resume(None));
                Some(Placement::Placed)
            }
        }
    }

    /// `run_id` claims its thread's parked `sandbox_id`, to be bound once
    /// the sandbox's agent is ready.
    fn claim_for_resume(&mut self, now: Millis, step: &mut Step, run_id: &str, sandbox_id: &str, resume: Resume) {
        self.update_run(step, run_id, |run| {
            run.state = RunState::Resuming;
            run.wait = None;
            run.resume = Some(resume);
        });
        self.claim_thread(now, step, run_id, sandbox_id);
        self.update_sandbox(step, sandbox_id, |record| {
            record.state = SandboxState::Resuming;
            record.run_id = Some(run_id.to_owned());
        });
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
            record.standby_credential_id = credential_id.clone();
            record.exit_code = None;
            record.auto_stop_minutes = Some(auto_stop);
        });
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            live.exited = false;
            live.launched_at = now;
            live.heartbeat = None;
            live.ever_ready = false;
            live.resume_after_exit = false;
            live.run_token = None;
            live.spec_served = false;
            live.assignment_withheld = false;
        }
        step.effects.push(Effect::Resume { sandbox_id: sandbox_id.to_owned(), credential_id, token, auto_stop });
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

    /// The provider could not make `sandbox_id` run again.
    pub(super) fn resume_failed(&mut self, now: Millis, sandbox_id: &str, failure: &ResumeFailure) -> Step {
        let mut step = Step::default();
        let Some(mut live) = self.sandboxes.get_mut(sandbox_id) else { return step };
        live.exited = true;
        let state = live.record.state;
        drop(live);
        match (state, failure) {
            (SandboxState::Resuming, _) => self.resume_fallback(now, &mut step, sandbox_id, &failure.to_string()),
            (SandboxState::Parked, ResumeFailure::Gone) => {
                let retirement = Retirement::new(format!("a parked sandbox could not be started: {failure}"));
                self.retire_sandbox(now, &mut step, sandbox_id, retirement.revoking());
            }
            (SandboxState::Parked, ResumeFailure::Failed(_)) => {
                let reason = format!("its fresh agent could not be started: {failure}");
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
