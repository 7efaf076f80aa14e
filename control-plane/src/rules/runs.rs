//! A user's inputs, a run submitted (alone or as a turn of a thread) and a
//! run cancelled, and how a run's attempt ends: fenced, released from a
//! sandbox that did not start it, or ended with the run.

use standby_protocol::{Cancel, Run, ServerMessage};

use super::sandboxes::Retirement;
use super::{ConnId, Effect, Rules, Step, Write};
use crate::model::{AttemptOutcome, CredentialState, Millis, RunRecord, RunRequest, RunState};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CancelError {
    #[error("no run `{0}`")]
    NotFound(String),
    #[error("run `{run_id}` already {state}")]
    Finished { run_id: String, state: RunState },
}

/// Whether a run released before it started may run again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retry {
    /// Requeued while attempts remain: a fresh cold sandbox may succeed.
    Allowed,
    /// Failed now: the run is invalid wherever it goes, or it may have
    /// started already and must not run twice.
    Never,
}

impl Retry {
    /// As the agent's `requeueable` of an `install_failed` event says.
    pub(super) fn from_requeueable(requeueable: bool) -> Self {
        if requeueable { Self::Allowed } else { Self::Never }
    }
}

/// What becomes of the sandbox a run is released from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SandboxFate {
    /// Retired: its agent, which reported the failure, has the linger
    /// window to exit on its own.
    Retire,
    /// Written off: it exited or went silent while it held the run. Its
    /// standby credential is revoked too, so it can never come back as a
    /// standby, its connections are closed and it is stopped at once.
    WriteOff,
}

/// What becomes of a fenced attempt's run credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fence {
    /// Revoked (`401`) in the step's first writes.
    Revoke,
    /// A cancel: it may still report the run's events and log, nothing else
    /// (amendment 8).
    Grace,
}

impl Rules {
    /// Queues a run and dispatches it at once if it can be.
    #[cfg(test)]
    pub(super) fn submit(&mut self, now: Millis, run: Run, request: RunRequest) -> (Step, String) {
        self.submit_turn(now, run, request, None)
    }

    /// Queues a run, as a turn of `thread_id` when given, and dispatches it
    /// at once if it can be.
    pub(super) fn submit_turn(
        &mut self,
        now: Millis,
        run: Run,
        request: RunRequest,
        thread_id: Option<String>,
    ) -> (Step, String) {
        let mut step = Step::default();
        let id = self.mint.id("exe");
        // Inline attachments (amendment 5): the list the attachments call
        // would answer rides in the assignment, so the agent makes no call
        // for it and a warm start at a distance is one round trip. Names,
        // hashes and URLs only: the contents stay sealed with the request.
        let mut run = run;
        run.attachments = Some(request.attachments.iter().map(|stored| stored.listed(&id)).collect());
        let record = RunRecord::queued(id.clone(), now, run, thread_id);
        step.writes.push(Write::NewRun(Box::new(record.clone()), Box::new(request)));
        self.runs.insert(id.clone(), record);
        self.queue.push_back(id.clone());
        self.dispatch_queued(now, &mut step);
        (step, id)
    }

    /// Cancels a run. Before it starts: its credential is revoked first, the
    /// run never starts, its sandbox is told and retired. Once started: the
    /// sandbox is told and the run ends when the agent reports it.
    pub(super) fn cancel(&mut self, now: Millis, run_id: &str) -> Result<(Step, RunState), CancelError> {
        let mut step = Step::default();
        let run = self.runs.get(run_id).ok_or_else(|| CancelError::NotFound(run_id.to_owned()))?;
        match run.state {
            RunState::Queued | RunState::Waiting => {
                self.queue.retain(|queued| queued != run_id);
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
            }
            RunState::Resuming => {
                self.queue.retain(|queued| queued != run_id);
                self.unclaim_resume(now, &mut step, run_id);
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
            }
            RunState::Committed | RunState::Confirmed => {
                // The agent may still report the run's end (amendment 8).
                if let Some(sandbox_id) = self.fence(&mut step, run_id, Fence::Grace) {
                    self.finish_attempt(now, &mut step, run_id, AttemptOutcome::Cancelled, "cancelled".into());
                    self.tell_cancel(&mut step, run_id, &sandbox_id);
                    // The agent never starts the run and exits: a thread's
                    // sandbox is kept all the same, with the files of the
                    // turns before.
                    self.end_turn(now, &mut step, run_id, &sandbox_id, "its run was cancelled");
                }
                self.end_run(now, &mut step, run_id, RunState::Cancelled, None, Some("cancelled".into()));
            }
            RunState::Running => {
                let sandbox_id = run.current().map(|attempt| attempt.sandbox_id.clone());
                self.update_run(&mut step, run_id, |run| run.state = RunState::Cancelling);
                self.begin_grace(&mut step, run_id);
                if let Some(sandbox_id) = sandbox_id {
                    self.tell_cancel(&mut step, run_id, &sandbox_id);
                }
            }
            RunState::Cancelling | RunState::Cancelled => {}
            state @ (RunState::Exited | RunState::Failed) => {
                return Err(CancelError::Finished { run_id: run_id.to_owned(), state });
            }
        }
        let state = self.runs.get(run_id).map_or(RunState::Cancelled, |run| run.state);
        self.place_and_top_up(now, &mut step);
        Ok((step, state))
    }

    /// Sends `cancel` for `run_id` on every connection of its sandbox.
    fn tell_cancel(&self, step: &mut Step, run_id: &str, sandbox_id: &str) {
        let cancel = ServerMessage::Cancel(Cancel { execution_id: run_id.to_owned() });
        for conn in self.all_conns(sandbox_id) {
            step.effects.push(Effect::Send { conn, message: cancel.clone() });
        }
    }

    /// Fencing: the current attempt's run credential is revoked or put in
    /// its cancel grace, as `fence` says, before anything else the step
    /// writes about the attempt. Returns the attempt's sandbox; `None` when
    /// the run has no attempt.
    fn fence(&mut self, step: &mut Step, run_id: &str, fence: Fence) -> Option<String> {
        let attempt = self.runs.get(run_id).and_then(|run| run.current()).cloned()?;
        match fence {
            Fence::Grace => self.begin_grace(step, run_id),
            Fence::Revoke => self.withdraw(step, &attempt.credential_id, CredentialState::Revoked),
        }
        if let Some(mut live) = self.sandboxes.get_mut(&attempt.sandbox_id) {
            live.run_token = None;
        }
        Some(attempt.sandbox_id)
    }

    /// Releases a run that did not start from its sandbox: fence, retire
    /// the sandbox as `fate` says, then requeue the run while attempts
    /// remain (and `retry` allows it), or fail it.
    pub(super) fn release(
        &mut self,
        now: Millis,
        step: &mut Step,
        run_id: &str,
        retry: Retry,
        fate: SandboxFate,
        reason: String,
    ) {
        let attempts = self.runs.get(run_id).map_or(0, |run| run.attempts.len() as u32);
        let requeue = retry == Retry::Allowed && attempts < self.config.max_attempts;
        let outcome = if requeue { AttemptOutcome::Requeued } else { AttemptOutcome::Failed };
        let Some(sandbox_id) = self.fence(step, run_id, Fence::Revoke) else {
            return;
        };
        self.finish_attempt(now, step, run_id, outcome, reason.clone());
        let retirement = match fate {
            SandboxFate::Retire => Retirement::new("its run was released").lingering(self.config.linger),
            SandboxFate::WriteOff => Retirement::new("written off").revoking(),
        };
        self.retire_sandbox(now, step, &sandbox_id, retirement);
        if fate == SandboxFate::WriteOff {
            let conns: Vec<ConnId> = self.all_conns(&sandbox_id).collect();
            for conn in conns {
                step.effects.push(Effect::Close { conn });
            }
        }
        if requeue {
            self.update_run(step, run_id, |run| run.state = RunState::Queued);
            self.queue.push_back(run_id.to_owned());
        } else {
            let error = match retry {
                Retry::Allowed => format!("gave up after {attempts} attempts; last: {reason}"),
                Retry::Never => reason,
            };
            self.end_run(now, step, run_id, RunState::Failed, None, Some(error));
        }
    }

    pub(super) fn finish_attempt(
        &mut self,
        now: Millis,
        step: &mut Step,
        run_id: &str,
        outcome: AttemptOutcome,
        reason: String,
    ) {
        self.update_run(step, run_id, |run| {
            if let Some(attempt) = run.current_mut()
                && attempt.outcome.is_none()
            {
                attempt.ended_at = Some(now);
                attempt.outcome = Some(outcome);
                attempt.reason = Some(reason);
            }
        });
    }

    /// The run reached its terminal `state`: its credentials are withdrawn
    /// in the same step, and its thread let go.
    pub(super) fn end_run(
        &mut self,
        now: Millis,
        step: &mut Step,
        run_id: &str,
        state: RunState,
        exit_code: Option<i32>,
        error: Option<String>,
    ) {
        self.update_run(step, run_id, |run| {
            run.state = state;
            run.exit_code = exit_code;
            run.ended_at = Some(now);
            run.wait = None;
            if state != RunState::Exited {
                run.error = error;
            }
        });
        self.withdraw_run(now, step, run_id, state);
        self.turn_over(now, step, run_id);
    }
}
