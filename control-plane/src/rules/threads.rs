//! Threads: a turn's sandbox is kept for the thread's next turn.
//!
//! - **Park**: when a turn ends, its sandbox is parked: running (Tier 2:
//!   once the turn's agent has exited, a fresh agent is launched in it with
//!   a new standby credential, until the warm idle window ends) or stopped
//!   (Tier 1: the provider stops it, its filesystem stays). A parked
//!   sandbox gets the provider auto-stop floored above the warm window.
//! - **Resume**: the next turn claims the parked sandbox, as
//!   [`super::resume`] decides: a running one whose agent is ready takes
//!   the run at once; otherwise the sandbox is started and the run bound
//!   once its agent is ready; a resume that cannot be done places the run
//!   like a new one.
//! - **Fenced pointer**: the thread's pointer names its sandbox and the turn
//!   holding it, and every write is compare-and-set on its generation. A
//!   turn takes the pointer when it is bound and gives it back when it ends;
//!   the next turn waits for that, so two turns never hold one sandbox. A
//!   turn whose end finds the pointer moved on (a stale writer) does not
//!   park: its sandbox is released.

use super::sandboxes::Retirement;
use super::{ConnId, Effect, Rules, Step, Write};
use crate::model::{CredentialState, Millis, Park, ParkMode, SandboxState, ThreadRecord};

/// A pointer write whose expected generation is not the current one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("thread `{thread_id}`: the pointer is at generation {found}, the writer expected {expected}")]
pub struct StalePointer {
    pub thread_id: String,
    pub expected: u64,
    pub found: u64,
}

impl Rules {
    // ---- the pointer -----------------------------------------------------------

    /// Compare-and-set of the thread's pointer: applied (and its generation
    /// bumped) only if the pointer is still at `expected` (`0`: none yet).
    /// The store checks the same condition in the step's transaction. The
    /// turn holding the pointer afterwards learns the new generation.
    pub(super) fn write_thread(
        &mut self,
        now: Millis,
        step: &mut Step,
        thread_id: &str,
        expected: u64,
        change: impl FnOnce(&mut ThreadRecord),
    ) -> Result<(), StalePointer> {
        let found = self.threads.get(thread_id).map_or(0, |thread| thread.generation);
        if found != expected {
            return Err(StalePointer { thread_id: thread_id.to_owned(), expected, found });
        }
        let mut record = self.threads.get(thread_id).cloned().unwrap_or_else(|| ThreadRecord {
            id: thread_id.to_owned(),
            generation: 0,
            sandbox_id: None,
            holder: None,
            updated_at: now,
        });
        change(&mut record);
        record.generation = expected + 1;
        record.updated_at = now;
        step.writes.push(Write::Thread { record: Box::new(record.clone()), expected });
        if let Some(holder) = record.holder.clone() {
            let generation = record.generation;
            self.update_run(step, &holder, |run| run.thread_generation = Some(generation));
        }
        self.threads.insert(thread_id.to_owned(), record);
        Ok(())
    }

    /// A write made on the pointer's current state (the machine is its
    /// only writer in this process); a failure is impossible here and
    /// would only be logged.
    fn write_current(&mut self, now: Millis, step: &mut Step, thread_id: &str, change: impl FnOnce(&mut ThreadRecord)) {
        let current = self.threads.get(thread_id).map_or(0, |thread| thread.generation);
        if let Err(stale) = self.write_thread(now, step, thread_id, current, change) {
            tracing::error!(%stale, "thread pointer write refused");
        }
    }

    /// The turn other than `run_id` that holds the thread, if one does.
    pub(super) fn thread_busy(&self, thread_id: &str, run_id: &str) -> Option<String> {
        let holder = self.threads.get(thread_id)?.holder.clone()?;
        let active = self.runs.get(&holder).is_some_and(|run| !run.state.is_terminal());
        (holder != run_id && active).then_some(holder)
    }

    /// `run_id` was bound to `sandbox_id`: the thread's pointer now names
    /// both, and the sandbox is the thread's.
    pub(super) fn claim_thread(&mut self, now: Millis, step: &mut Step, run_id: &str, sandbox_id: &str) {
        let Some(thread_id) = self.runs.get(run_id).and_then(|run| run.thread_id.clone()) else { return };
        self.write_current(now, step, &thread_id, |thread| {
            thread.sandbox_id = Some(sandbox_id.to_owned());
            thread.holder = Some(run_id.to_owned());
        });
        self.update_sandbox(step, sandbox_id, |record| record.thread_id = Some(thread_id));
    }

    /// `run_id` ended: if it still holds its thread, it lets go, leaving
    /// the pointer on the sandbox only if that sandbox was parked.
    pub(super) fn turn_over(&mut self, now: Millis, step: &mut Step, run_id: &str) {
        let Some(thread_id) = self.runs.get(run_id).and_then(|run| run.thread_id.clone()) else { return };
        let Some(thread) = self.threads.get(&thread_id) else { return };
        if thread.holder.as_deref() != Some(run_id) {
            return;
        }
        let kept = thread.sandbox_id.clone().filter(|sandbox_id| {
            self.sandboxes.get(sandbox_id).is_some_and(|live| live.record.state == SandboxState::Parked)
        });
        self.write_current(now, step, &thread_id, |thread| {
            thread.holder = None;
            thread.sandbox_id = kept;
        });
    }

    /// `sandbox_id` is retired: the pointer stops naming it.
    pub(super) fn forget_sandbox(&mut self, now: Millis, step: &mut Step, thread_id: &str, sandbox_id: &str) {
        let names = self.threads.get(thread_id).is_some_and(|t| t.sandbox_id.as_deref() == Some(sandbox_id));
        if names {
            self.write_current(now, step, thread_id, |thread| thread.sandbox_id = None);
        }
    }

    // ---- parking -----------------------------------------------------------------

    /// The run on `sandbox_id` ended (its agent exits next). A turn of a
    /// thread parks it, if the turn still holds the pointer; anything else
    /// retires it.
    pub(super) fn end_turn(&mut self, now: Millis, step: &mut Step, run_id: &str, sandbox_id: &str, reason: &str) {
        let linger = self.config.linger;
        let retire = |machine: &mut Self, step: &mut Step, reason: &str| {
            machine.retire_sandbox(now, step, sandbox_id, Retirement::new(reason).lingering(linger));
        };
        let Some(run) = self.runs.get(run_id) else { return };
        let Some(thread_id) = run.thread_id.clone() else {
            retire(self, step, reason);
            return;
        };
        let policy = &self.config.pool_policy;
        let mode = if !policy.warm_idle.is_zero() {
            ParkMode::Running
        } else if policy.park_stopped {
            ParkMode::Stopped
        } else {
            retire(
                self,
                step,
                &format!("{reason}; threads are not kept (no warm idle window, parking stopped is off)"),
            );
            return;
        };
        let until = (mode == ParkMode::Running).then(|| now.plus(policy.warm_idle));
        let auto_stop = policy.auto_stop.effective(policy.warm_idle);
        let expected = run.thread_generation.unwrap_or(0);
        let parked = self.write_thread(now, step, &thread_id, expected, |thread| {
            thread.sandbox_id = Some(sandbox_id.to_owned());
            thread.holder = None;
        });
        if let Err(stale) = parked {
            tracing::warn!(run_id, sandbox_id, %stale, "a turn ended after its thread moved on: sandbox released");
            retire(self, step, &format!("{reason}; not kept: {stale}"));
            return;
        }
        self.update_sandbox(step, sandbox_id, |record| {
            record.state = SandboxState::Parked;
            record.run_id = None;
            record.park = Some(Park { mode, since: now, until });
            record.auto_stop_minutes = Some(auto_stop);
        });
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            live.resume_after_exit = mode == ParkMode::Running;
            live.run_token = None;
        }
        step.effects.push(Effect::Park { sandbox_id: sandbox_id.to_owned(), linger, auto_stop, mode });
    }

    /// A parked sandbox's agent exited: the turn's agent (relaunch a fresh
    /// one while the window is open and no run waits for a slot), or the
    /// fresh one (it is parked stopped then).
    pub(super) fn parked_exited(&mut self, now: Millis, step: &mut Step, sandbox_id: &str, reason: &str) {
        let Some(live) = self.sandboxes.get(sandbox_id) else { return };
        let Some(park) = live.record.park.clone() else { return };
        if park.mode == ParkMode::Stopped {
            return;
        }
        let open = park.until.is_some_and(|until| now < until);
        if live.resume_after_exit && open && self.blocked == 0 {
            self.emit_resume(now, step, sandbox_id);
        } else if live.resume_after_exit && open {
            self.park_stopped_or_release(now, step, sandbox_id, "the running cap is reached and runs wait for a slot");
        } else if live.resume_after_exit {
            self.park_stopped_or_release(now, step, sandbox_id, "its warm idle window ended");
        } else {
            self.park_stopped_or_release(now, step, sandbox_id, &format!("its parked agent ended: {reason}"));
        }
    }

    /// Tier 1: stop the sandbox and keep its filesystem, or release it
    /// when parking stopped is off.
    pub(super) fn park_stopped_or_release(&mut self, now: Millis, step: &mut Step, sandbox_id: &str, reason: &str) {
        let Some(live) = self.sandboxes.get(sandbox_id) else { return };
        if !self.config.pool_policy.park_stopped {
            self.retire_sandbox(now, step, sandbox_id, Retirement::new(reason).told());
            return;
        }
        let running = !live.exited;
        let credential_id = live.record.standby_credential_id.clone();
        if self.credentials.get(&credential_id).is_some_and(|c| c.state == CredentialState::Active) {
            self.set_credential(step, &credential_id, CredentialState::Revoked);
        }
        tracing::info!(sandbox_id, reason, "parked sandbox stopped");
        self.update_sandbox(step, sandbox_id, |record| {
            record.park = Some(Park { mode: ParkMode::Stopped, since: now, until: None });
        });
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            live.resume_after_exit = false;
        }
        if running {
            let conns: Vec<ConnId> = self.all_conns(sandbox_id).collect();
            for conn in conns {
                step.effects.push(Effect::Close { conn });
            }
            step.effects.push(Effect::Stop { sandbox_id: sandbox_id.to_owned() });
        }
    }

    // ---- time ------------------------------------------------------------------------

    /// Warm idle windows that ended, parked agents gone silent, resumes
    /// that took too long.
    pub(super) fn tick_threads(&mut self, now: Millis, step: &mut Step) {
        let silence = self.config.silence();
        let launch_timeout = self.config.launch_timeout;
        let resume_timeout = self.config.pool_policy.resume_timeout;
        let mut to_stop = Vec::new();
        let mut too_slow = Vec::new();
        for live in self.sandboxes.active() {
            let record = &live.record;
            match (record.state, record.park.as_ref()) {
                (SandboxState::Parked, Some(park)) if park.mode == ParkMode::Running => {
                    if park.until.is_some_and(|until| now >= until) {
                        to_stop.push((record.id.clone(), "its warm idle window ended"));
                    } else if !live.exited && !live.resume_after_exit {
                        let silent = match &live.heartbeat {
                            Some(heartbeat) => now > heartbeat.at.plus(silence),
                            None => now > live.launched_at.plus(launch_timeout),
                        };
                        if silent {
                            to_stop.push((record.id.clone(), "its parked agent stopped heartbeating"));
                        }
                    }
                }
                (SandboxState::Resuming, _) => {
                    let began = record
                        .run_id
                        .as_ref()
                        .and_then(|id| self.runs.get(id))
                        .and_then(|run| run.resume.as_ref())
                        .map_or(now, |resume| resume.began_at);
                    if now > began.plus(resume_timeout) {
                        too_slow.push(record.id.clone());
                    }
                }
                _ => {}
            }
        }
        for (sandbox_id, reason) in to_stop {
            self.park_stopped_or_release(now, step, &sandbox_id, reason);
        }
        for sandbox_id in too_slow {
            let reason = format!("its agent was not ready within {}", humantime::format_duration(resume_timeout));
            self.resume_fallback(now, step, &sandbox_id, &reason);
        }
    }
}
