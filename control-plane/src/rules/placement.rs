//! Binding queued runs, in order: to their thread's parked sandbox
//! ([`super::resume`]), to a ready standby (one warm attempt per run), or
//! to a cold sandbox created for them, within the running cap. A run bound
//! to a sandbox is committed before anyone is told: the caller's effects
//! follow the step's writes.

use std::collections::VecDeque;

use standby_protocol::AgentState;

use super::{ConnId, Effect, Live, Provision, Rules, Step};
use crate::credential::CredentialKind;
use crate::model::{Attempt, Millis, RunPath, RunState, SandboxKind, SandboxState, Wait};

/// What became of a queued run in one dispatch.
#[derive(Debug)]
pub(super) enum Placement {
    Placed,
    /// Not bound, for `reason`, until what it `needs` is there.
    Wait {
        reason: String,
        needs: Need,
    },
}

/// What a waiting run waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Need {
    /// Its thread's sandbox, held by an earlier turn.
    Thread,
    /// A new running slot (a ready standby would do as well).
    Slot,
    /// A new running slot that a standby cannot stand in for: the run had
    /// its warm attempt, or resumes its thread's sandbox.
    ColdSlot,
}

/// Where a run stands among the runs waiting for a running slot in this
/// dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotQueue {
    /// No earlier run waits for one: it may take a free slot.
    Clear,
    /// An earlier run waits for one: it does not take one before it.
    BehindWaiting,
}

impl Rules {
    pub(super) fn is_candidate(&self, now: Millis, live: &Live) -> bool {
        live.record.kind == SandboxKind::Warm
            && live.record.state == SandboxState::Standby
            && !live.exited
            && !live.snapshotting
            && live
                .heartbeat
                .as_ref()
                .is_some_and(|h| h.state == AgentState::Ready && now <= h.at.plus(self.config.silence()))
            && self.live_standby_conns(live).next().is_some()
    }

    fn candidate(&self, now: Millis) -> Option<String> {
        // Oldest first: the first ready one is the oldest ready one.
        self.sandboxes.standbys().find(|live| self.is_candidate(now, live)).map(|live| live.record.id.clone())
    }

    /// Whether a run at `queue` may have a new running slot now.
    pub(super) fn may_take_slot(&self, queue: SlotQueue) -> bool {
        queue == SlotQueue::Clear && self.slot_free()
    }

    /// Places queued runs in order. A run that needs a new running slot at
    /// the cap waits, and so does every later run that needs one (they
    /// wait in order); later runs that need no new slot (a ready standby,
    /// their thread's running sandbox) go on. Then parked-running sandboxes
    /// (and, for runs that cannot take one, standbys) are stopped to make
    /// room for the runs that wait.
    pub(super) fn dispatch_queued(&mut self, now: Millis, step: &mut Step) {
        if self.draining {
            return;
        }
        let queue = std::mem::take(&mut self.queue);
        let mut kept = VecDeque::new();
        let (mut blocked, mut blocked_cold) = (0, 0);
        for run_id in queue {
            let Some(run) = self.runs.get(&run_id) else { continue };
            if !matches!(run.state, RunState::Queued | RunState::Waiting) {
                continue;
            }
            let slots = if blocked > 0 { SlotQueue::BehindWaiting } else { SlotQueue::Clear };
            match self.place(now, step, &run_id, slots) {
                Placement::Placed => {}
                Placement::Wait { reason, needs } => {
                    if needs != Need::Thread {
                        blocked += 1;
                        blocked_cold += usize::from(needs == Need::ColdSlot);
                    }
                    self.set_waiting(now, step, &run_id, reason, needs);
                    kept.push_back(run_id);
                }
            }
        }
        // Anything queued while placing comes after the runs already waiting.
        kept.extend(std::mem::take(&mut self.queue));
        self.queue = kept;
        self.blocked = blocked;
        self.blocked_cold = blocked_cold;
        self.make_room(now, step);
    }

    /// Binds `run_id` if it can be: to its thread's parked sandbox, a ready
    /// standby, or a new cold sandbox (given a running slot, and no earlier
    /// run waiting for one).
    fn place(&mut self, now: Millis, step: &mut Step, run_id: &str, slots: SlotQueue) -> Placement {
        let Some(run) = self.runs.get(run_id) else { return Placement::Placed };
        let prepared_before = run.had_prepared_attempt();
        if let Some(thread_id) = run.thread_id.clone() {
            if let Some(holder) = self.thread_busy(&thread_id, run_id) {
                let reason = format!("turn {holder} of thread {thread_id} holds the thread's sandbox");
                return Placement::Wait { reason, needs: Need::Thread };
            }
            if !prepared_before && let Some(placement) = self.place_on_thread(now, step, run_id, &thread_id, slots) {
                return placement;
            }
        }
        let warm = if prepared_before { None } else { self.candidate(now) };
        if let Some(sandbox_id) = warm {
            self.commit(now, step, run_id, &sandbox_id, RunPath::Warm);
            self.claim_thread(now, step, run_id, &sandbox_id);
            self.tell_standby(step, run_id, &sandbox_id);
            return Placement::Placed;
        }
        if !self.may_take_slot(slots) {
            let needs = if prepared_before { Need::ColdSlot } else { Need::Slot };
            return Placement::Wait { reason: self.cap_reason(), needs };
        }
        if let Some(sandbox_id) = self.commit_cold(now, step, run_id) {
            self.claim_thread(now, step, run_id, &sandbox_id);
        }
        Placement::Placed
    }

    fn set_waiting(&mut self, now: Millis, step: &mut Step, run_id: &str, reason: String, needs: Need) {
        let unchanged = self
            .runs
            .get(run_id)
            .is_some_and(|run| run.state == RunState::Waiting && run.wait.as_ref().is_some_and(|w| w.reason == reason));
        if unchanged {
            return;
        }
        self.update_run(step, run_id, |run| {
            let since = run.wait.as_ref().filter(|_| run.state == RunState::Waiting).map_or(now, |w| w.since);
            run.state = RunState::Waiting;
            run.wait = Some(Wait { reason, since, for_slot: needs != Need::Thread });
        });
    }

    /// Sends the assignment of `run_id`, just bound to `sandbox_id`, on the
    /// sandbox's standby connections.
    pub(super) fn tell_standby(&mut self, step: &mut Step, run_id: &str, sandbox_id: &str) {
        let standby: Vec<ConnId> = self.standby_conns(sandbox_id).collect();
        for conn in standby {
            self.send_assignment(step, conn, run_id);
        }
    }

    /// Binds `run_id` to `sandbox_id` with a new run credential. The caller
    /// tells the sandbox after this, in effects that follow these writes.
    pub(super) fn commit(&mut self, now: Millis, step: &mut Step, run_id: &str, sandbox_id: &str, path: RunPath) {
        let number = self.runs.get(run_id).map_or(1, |run| run.attempts.len() as u32 + 1);
        let (credential_id, token) = self.new_credential(step, CredentialKind::Run, sandbox_id, Some((run_id, number)));
        self.update_run(step, run_id, |run| {
            run.state = RunState::Committed;
            run.wait = None;
            run.attempts.push(Attempt {
                number,
                sandbox_id: sandbox_id.to_owned(),
                path,
                credential_id,
                committed_at: now,
                assignment_sent_at: None,
                delivery_confirmed_at: None,
                started_at: None,
                ended_at: None,
                outcome: None,
                reason: None,
                install_us: None,
            });
        });
        self.update_sandbox(step, sandbox_id, |record| {
            record.state = SandboxState::Assigned;
            record.run_id = Some(run_id.to_owned());
            record.park = None;
        });
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            live.run_token = Some(token);
        }
    }

    /// Creates a sandbox for `run_id`, prepared with the run's workspace
    /// (the pool's when it names none), binds the run to it, then launches
    /// it: the assignment is waiting before its agent ever connects.
    fn commit_cold(&mut self, now: Millis, step: &mut Step, run_id: &str) -> Option<String> {
        let run = self.runs.get(run_id)?;
        let workspace = run.run.workspace.clone();
        let fingerprint = run.fingerprint.clone().unwrap_or_else(|| self.config.pool_fingerprint.clone());
        let (sandbox_id, credential_id, token) =
            self.create_sandbox(now, step, SandboxKind::Cold, workspace, fingerprint.clone());
        let auto_stop = self.config.pool_policy.auto_stop.minutes;
        self.update_sandbox(step, &sandbox_id, |record| record.auto_stop_minutes = Some(auto_stop));
        self.commit(now, step, run_id, &sandbox_id, RunPath::Cold);
        let launch = Effect::Launch {
            sandbox_id: sandbox_id.clone(),
            credential_id,
            token,
            provision: Provision::Create,
            auto_stop,
            fingerprint,
        };
        step.effects.push(launch);
        Some(sandbox_id)
    }
}
