//! Sandboxes as the provider reports them: created, their agent exited,
//! a launch failed, what a probe found after a restart; and how a sandbox
//! leaves: lost (its run written off or failed) or retired.

use std::time::Duration;

use standby_protocol::{ExitCode, Fingerprint, Retired, Secret, ServerMessage, Workspace};

use super::runs::{Retry, SandboxFate};
use super::{Agent, Effect, Live, Provision, Rules, Step, Write};
use crate::credential::CredentialKind;
use crate::model::{
    AttemptOutcome, CredentialState, Millis, RunRecord, RunState, SandboxKind, SandboxRecord, SandboxState,
};
use crate::provider::Found;

/// How a sandbox is retired: why, what its standby credential becomes,
/// whether its agent is told, and how long it has to exit on its own.
#[derive(Debug, Clone)]
pub(super) struct Retirement {
    /// Recorded on the sandbox.
    reason: String,
    /// What its standby credential becomes if it is still active.
    standby: CredentialState,
    /// Told to its agent in a `retired` frame.
    notice: Option<String>,
    linger: Duration,
}

impl Retirement {
    /// Retired for `reason`: its standby credential retired (`410`: the
    /// sandbox is gone), its agent not told, stopped at once.
    pub(super) fn new(reason: impl Into<String>) -> Self {
        Self { reason: reason.into(), standby: CredentialState::Retired, notice: None, linger: Duration::ZERO }
    }

    /// Its standby credential revoked (`401`) instead: the sandbox must
    /// never be admitted again, not even as a standby.
    pub(super) fn revoking(self) -> Self {
        Self { standby: CredentialState::Revoked, ..self }
    }

    /// Its agent told the reason, in a `retired` frame.
    pub(super) fn told(self) -> Self {
        let notice = Some(self.reason.clone());
        Self { notice, ..self }
    }

    /// Its agent told `notice`, in a `retired` frame.
    pub(super) fn telling(self, notice: impl Into<String>) -> Self {
        Self { notice: Some(notice.into()), ..self }
    }

    /// Its agent given `linger` to exit on its own before it is stopped.
    pub(super) fn lingering(self, linger: Duration) -> Self {
        Self { linger, ..self }
    }
}

impl Rules {
    /// The sandbox's agent process ended.
    pub(super) fn sandbox_exited(&mut self, now: Millis, sandbox_id: &str, code: Option<i32>) -> Step {
        let mut step = Step::default();
        let Some(mut live) = self.sandboxes.get_mut(sandbox_id) else {
            return step;
        };
        if live.exited {
            // Already counted (a stop of a sandbox whose agent was gone).
            return step;
        }
        live.exited = true;
        let ever_ready = live.ever_ready;
        let kind = live.record.kind;
        let state = live.record.state;
        let run_id = live.record.run_id.clone();
        drop(live);
        if self.draining {
            // The server is stopping its own sandboxes: their state stays as
            // it is, to be probed and resumed by the next start.
            self.update_sandbox(&mut step, sandbox_id, |record| record.exit_code = code);
            return step;
        }
        self.end_graces_of(&mut step, sandbox_id);
        let reason = ExitCode::describe(code);
        match state {
            SandboxState::Parked => self.parked_exited(now, &mut step, sandbox_id, &reason),
            SandboxState::Resuming => self.resuming_exited(now, &mut step, sandbox_id, &reason),
            _ => self.sandbox_lost(now, &mut step, sandbox_id, state, run_id, &reason),
        }
        self.update_sandbox(&mut step, sandbox_id, |record| record.exit_code = code);
        if kind == SandboxKind::Warm && state == SandboxState::Standby && !ever_ready {
            self.pool_failed(now);
        }
        self.place_and_top_up(now, &mut step);
        step
    }

    /// A sandbox can no longer serve: retire it, and write off its run if
    /// the run had not started, or fail it if it had.
    pub(super) fn sandbox_lost(
        &mut self,
        now: Millis,
        step: &mut Step,
        sandbox_id: &str,
        state: SandboxState,
        run_id: Option<String>,
        reason: &str,
    ) {
        let run_id = match (state, run_id) {
            (SandboxState::Retired, _) => return,
            (SandboxState::Resuming, _) => {
                self.resume_fallback(now, step, sandbox_id, reason);
                return;
            }
            (SandboxState::Assigned, Some(run_id)) => run_id,
            _ => {
                self.retire_sandbox(now, step, sandbox_id, Retirement::new(reason));
                return;
            }
        };
        let on_this = |run: &&RunRecord| run.current().is_some_and(|a| a.sandbox_id == sandbox_id);
        match self.runs.get(&run_id).filter(on_this).map(|run| run.state) {
            Some(RunState::Committed) => {
                let why = format!("sandbox {sandbox_id} written off before delivery was confirmed: {reason}");
                self.release(now, step, &run_id, Retry::Allowed, SandboxFate::WriteOff, why);
            }
            // Once delivery is confirmed the agent may start the run at any
            // moment, and reports `started` concurrently: its death cannot
            // be told from one before the start. At most once: the run
            // fails rather than run a second time.
            Some(RunState::Confirmed) => {
                let why = format!(
                    "sandbox {sandbox_id} ended after delivery was confirmed, before the run was reported started \
                     (it may have started it, so it is not run again): {reason}"
                );
                self.lost.before_start += 1;
                self.release(now, step, &run_id, Retry::Never, SandboxFate::WriteOff, why);
            }
            Some(RunState::Running | RunState::Cancelling) => {
                let error = format!("sandbox {sandbox_id} ended without reporting the run's end: {reason}");
                self.lost.after_start += 1;
                self.end_run(now, step, &run_id, RunState::Failed, None, Some(error.clone()));
                self.finish_attempt(now, step, &run_id, AttemptOutcome::Finished, error);
                self.retire_sandbox(now, step, sandbox_id, Retirement::new(reason));
            }
            _ => self.retire_sandbox(now, step, sandbox_id, Retirement::new(reason)),
        }
    }

    /// Launching a sandbox failed.
    pub(super) fn launch_failed(&mut self, now: Millis, sandbox_id: &str, error: &str) -> Step {
        let mut step = Step::default();
        let Some(live) = self.sandboxes.get(sandbox_id) else {
            return step;
        };
        let (state, run_id, kind) = (live.record.state, live.record.run_id.clone(), live.record.kind);
        let reason = format!("launch failed: {error}");
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            live.exited = true;
        }
        self.sandbox_lost(now, &mut step, sandbox_id, state, run_id, &reason);
        if kind == SandboxKind::Warm && state == SandboxState::Standby {
            self.pool_failed(now);
        }
        self.place_and_top_up(now, &mut step);
        step
    }

    /// What the provider found of a sandbox after a restart. A standby
    /// with no agent is started again (its workspace is kept, so its agent skips
    /// the clone and setup) with a new standby credential: only the hash
    /// of the old one was kept. A sandbox that held a run is written off.
    pub(super) fn probed(&mut self, now: Millis, sandbox_id: &str, found: Found) -> Step {
        let mut step = Step::default();
        let Some(mut live) = self.sandboxes.get_mut(sandbox_id) else {
            return step;
        };
        if found != Found::Running {
            live.exited = true;
            drop(live);
            self.end_graces_of(&mut step, sandbox_id);
        } else {
            drop(live);
        }
        let Some(live) = self.sandboxes.get(sandbox_id) else {
            return step;
        };
        let (state, run_id) = (live.record.state, live.record.run_id.clone());
        let expired = live
            .record
            .deadline
            .is_some_and(|deadline| now >= crate::policy::retire_at(live.record.created_at, deadline));
        let (resume_after_exit, old) = (live.resume_after_exit, live.record.standby_credential_id.clone());
        let live_fingerprint = live.record.fingerprint.clone();
        match (found, state) {
            (_, SandboxState::Retired) => {}
            (Found::Running, SandboxState::Parked | SandboxState::Resuming) => {
                // Not this process's agent: its exit would never be seen.
                // Stop it; the sandbox stays parked stopped.
                step.effects.push(Effect::Stop { sandbox_id: sandbox_id.to_owned() });
                if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
                    live.exited = true;
                }
            }
            (Found::Running, _) => {}
            (Found::NoAgent | Found::Archived, SandboxState::Parked | SandboxState::Resuming) => {
                // A turn claimed it before the probe answered: start it now.
                if resume_after_exit && !self.draining {
                    self.emit_resume(now, &mut step, sandbox_id);
                }
            }
            (Found::NoAgent, SandboxState::Standby) if !self.draining && !expired => {
                self.set_credential(&mut step, &old, CredentialState::Revoked);
                let (credential_id, token) = self.new_credential(&mut step, CredentialKind::Standby, sandbox_id, None);
                self.update_sandbox(&mut step, sandbox_id, |record| {
                    record.standby_credential_id = credential_id.clone();
                    record.exit_code = None;
                });
                if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
                    live.launched_at = now;
                    live.exited = false;
                }
                let fingerprint = live_fingerprint;
                let sandbox_id = sandbox_id.to_owned();
                let provision = Provision::Start;
                step.effects.push(Effect::Launch {
                    sandbox_id,
                    credential_id,
                    token,
                    provision,
                    auto_stop: 0,
                    fingerprint,
                });
            }
            (Found::NoAgent | Found::Archived | Found::Missing, _) => {
                let reason = match found {
                    Found::Missing => "the sandbox was missing after a server restart",
                    _ if expired => "its standby TTL ran out while the server was down",
                    _ => "the sandbox stopped while the server was down",
                };
                self.sandbox_lost(now, &mut step, sandbox_id, state, run_id, reason);
            }
        }
        self.place_and_top_up(now, &mut step);
        step
    }

    /// A new sandbox record, prepared with `workspace` (`None`: the pool
    /// spec's) and with its own standby credential (its id and token are
    /// returned after the sandbox's); the caller launches it.
    pub(super) fn create_sandbox(
        &mut self,
        now: Millis,
        step: &mut Step,
        kind: SandboxKind,
        workspace: Option<Workspace>,
        fingerprint: Fingerprint,
    ) -> (String, String, Secret) {
        let sandbox_id = self.mint.id("sbx");
        let (credential_id, token) = self.new_credential(step, CredentialKind::Standby, &sandbox_id, None);
        let record =
            SandboxRecord::standby(sandbox_id.clone(), kind, now, credential_id.clone(), (workspace, fingerprint));
        step.writes.push(Write::Sandbox(Box::new(record.clone())));
        self.sandboxes.insert(sandbox_id.clone(), Live::new(record, now, Agent::Running));
        (sandbox_id, credential_id, token)
    }

    /// Retires a sandbox as `retirement` says: its standby credential
    /// withdrawn, the record retired, its thread's pointer let go of it,
    /// its agent told (when it says so) and the provider told to stop and
    /// delete it once its agent had `linger` to exit.
    pub(super) fn retire_sandbox(&mut self, now: Millis, step: &mut Step, sandbox_id: &str, retirement: Retirement) {
        let Some(live) = self.sandboxes.get(sandbox_id) else { return };
        if live.record.state == SandboxState::Retired {
            return;
        }
        let Retirement { reason, standby, notice, linger } = retirement;
        let credential_id = live.record.standby_credential_id.clone();
        let thread_id = live.record.thread_id.clone();
        if self.credentials.get(&credential_id).is_some_and(|c| c.state == CredentialState::Active) {
            self.set_credential(step, &credential_id, standby);
        }
        self.update_sandbox(step, sandbox_id, |record| {
            record.state = SandboxState::Retired;
            record.retired_at = Some(now);
            record.retire_reason = Some(reason);
            record.park = None;
        });
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            live.resume_after_exit = false;
        }
        if let Some(thread_id) = thread_id {
            self.forget_sandbox(now, step, &thread_id, sandbox_id);
        }
        if let Some(notice) = notice {
            let message = ServerMessage::Retired(Retired { reason: Some(notice) });
            for conn in self.all_conns(sandbox_id) {
                step.effects.push(Effect::Send { conn, message: message.clone() });
            }
        }
        step.effects.push(Effect::Retire { sandbox_id: sandbox_id.to_owned(), linger });
    }
}
