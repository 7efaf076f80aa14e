//! Control sockets: a connection admitted, a heartbeat, a connection
//! gone; and delivery of the assignment on them. A standby connection is
//! told its sandbox's assignment once its agent has its spec; the run
//! credential connecting confirms delivery (the standby credential is
//! revoked first, then the assignment replayed).

use standby_protocol::{AgentState, Assignment, Secret, ServerMessage};

use super::{Conn, ConnId, Effect, Heartbeat, Live, Rules, Step};
use crate::credential::CredentialKind;
use crate::model::{CredentialState, Holder, Millis, RunState, SandboxKind, SandboxState};

impl Rules {
    /// A connection was admitted with `credential_id` (checked again here:
    /// it may have been revoked between the upgrade and now); `holder` is
    /// the replica that holds its socket, in a replicated deployment.
    pub(super) fn connected(
        &mut self,
        now: Millis,
        conn: ConnId,
        (credential_id, presented): (&str, &Secret),
        holder: Option<Holder>,
    ) -> Step {
        let mut step = Step::default();
        let Some(credential) = self.credentials.get(credential_id).cloned() else {
            step.effects.push(Effect::Close { conn });
            return step;
        };
        if credential.state != CredentialState::Active || !self.holds_socket(conn, credential_id) {
            step.effects.push(Effect::Close { conn });
            return step;
        }
        self.socket_heard(now, conn, credential_id);
        let sandbox_id = credential.sandbox_id.clone();
        self.conns.insert(
            conn,
            Conn { sandbox_id: sandbox_id.clone(), kind: credential.kind, credential_id: credential_id.to_owned() },
        );
        if let Some(mut live) = self.sandboxes.get_mut(&sandbox_id) {
            live.conns.insert(conn);
        }
        self.update_sandbox(&mut step, &sandbox_id, |record| {
            match credential.kind {
                CredentialKind::Standby => record.connections += 1,
                CredentialKind::Run => record.run_connections += 1,
            }
            if holder.is_some() {
                record.held_by = holder;
            }
        });
        let Some(run_id) = self.sandboxes.get(&sandbox_id).and_then(|live| live.record.run_id.clone()) else {
            return step;
        };
        match credential.kind {
            CredentialKind::Standby => {
                let unconfirmed = self.runs.get(&run_id).is_some_and(|run| {
                    run.state.is_pre_start() && run.current().is_some_and(|a| a.delivery_confirmed_at.is_none())
                });
                let may_assign = self.sandboxes.get(&sandbox_id).is_some_and(Live::may_assign);
                if unconfirmed && may_assign {
                    self.send_assignment(&mut step, conn, &run_id);
                } else if unconfirmed && let Some(mut live) = self.sandboxes.get_mut(&sandbox_id) {
                    live.assignment_withheld = true;
                }
            }
            CredentialKind::Run => {
                let unconfirmed = self.runs.get(&run_id).is_some_and(|run| {
                    run.state == RunState::Committed && run.current().is_some_and(|a| a.delivery_confirmed_at.is_none())
                });
                if unconfirmed {
                    self.confirm(now, &mut step, &run_id, &sandbox_id);
                }
                if let Some(message) = self.assignment(&run_id, presented.clone()) {
                    step.effects.push(Effect::Send { conn, message });
                }
            }
        }
        step
    }

    /// Delivery confirmed: the standby credential is revoked (written
    /// before the replay goes out) and the standby connections closed.
    fn confirm(&mut self, now: Millis, step: &mut Step, run_id: &str, sandbox_id: &str) {
        if let Some(credential_id) = self.sandboxes.get(sandbox_id).map(|l| l.record.standby_credential_id.clone()) {
            self.set_credential(step, &credential_id, CredentialState::Revoked);
        }
        self.update_run(step, run_id, |run| {
            run.state = RunState::Confirmed;
            if let Some(attempt) = run.current_mut() {
                attempt.delivery_confirmed_at = Some(now);
            }
        });
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            live.run_token = None;
        }
        let standby: Vec<ConnId> = self.standby_conns(sandbox_id).collect();
        for conn in standby {
            step.effects.push(Effect::Close { conn });
        }
    }

    /// Sends the assignment of `run_id` on a standby connection, minting a
    /// new run credential if the plaintext was lost in a restart.
    pub(super) fn send_assignment(&mut self, step: &mut Step, conn: ConnId, run_id: &str) {
        let Some(sandbox_id) = self.runs.get(run_id).and_then(|run| run.current()).map(|a| a.sandbox_id.clone()) else {
            return;
        };
        let token = match self.sandboxes.get(&sandbox_id).and_then(|live| live.run_token.clone()) {
            Some(token) => token,
            None => self.rotate_run_credential(step, run_id, &sandbox_id),
        };
        if let Some(message) = self.assignment(run_id, token) {
            step.effects.push(Effect::Send { conn, message });
        }
    }

    /// The assignment frame of `run_id`. It always names the workspace the
    /// run expects (amendment 1): the run's own, else the one its sandbox
    /// was prepared with, which for a pool standby is the pool spec's.
    fn assignment(&self, run_id: &str, run_credential: Secret) -> Option<ServerMessage> {
        let record = self.runs.get(run_id)?;
        let mut run = record.run.clone();
        if run.workspace.is_none() {
            let prepared = record
                .current()
                .and_then(|attempt| self.sandboxes.get(&attempt.sandbox_id))
                .and_then(|live| live.record.workspace.clone());
            run.workspace = Some(prepared.unwrap_or_else(|| self.config.pool_workspace.clone()));
        }
        let trace_context = record.current().and_then(|attempt| self.trace_context(run_id, attempt.number));
        Some(ServerMessage::Assignment(Box::new(Assignment {
            execution_id: run_id.to_owned(),
            run_credential,
            run,
            trace_context,
        })))
    }

    fn rotate_run_credential(&mut self, step: &mut Step, run_id: &str, sandbox_id: &str) -> Secret {
        let old = self.runs.get(run_id).and_then(|run| run.current()).map(|a| a.credential_id.clone());
        if let Some(old) = old {
            self.set_credential(step, &old, CredentialState::Revoked);
        }
        let number = self.runs.get(run_id).and_then(|run| run.current()).map_or(1, |a| a.number);
        let (credential_id, token) = self.new_credential(step, CredentialKind::Run, sandbox_id, Some((run_id, number)));
        self.update_run(step, run_id, |run| {
            if let Some(attempt) = run.current_mut() {
                attempt.credential_id = credential_id;
            }
        });
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            live.run_token = Some(token.clone());
        }
        token
    }

    /// The sandbox's agent was served its spec: a withheld assignment can
    /// go out now.
    pub(super) fn spec_served(&mut self, sandbox_id: &str) -> Step {
        let mut step = Step::default();
        let Some(mut live) = self.sandboxes.get_mut(sandbox_id) else { return step };
        live.spec_served = true;
        let withheld = live.assignment_withheld;
        drop(live);
        if withheld {
            self.send_withheld(&mut step, sandbox_id);
        }
        step
    }

    fn send_withheld(&mut self, step: &mut Step, sandbox_id: &str) {
        let Some(mut live) = self.sandboxes.get_mut(sandbox_id) else { return };
        live.assignment_withheld = false;
        let Some(run_id) = live.record.run_id.clone() else { return };
        drop(live);
        let unconfirmed = self.runs.get(&run_id).is_some_and(|run| {
            run.state == RunState::Committed
                && run.current().is_some_and(|a| a.sandbox_id == sandbox_id && a.delivery_confirmed_at.is_none())
        });
        if unconfirmed {
            let standby: Vec<ConnId> = self.standby_conns(sandbox_id).collect();
            for conn in standby {
                self.send_assignment(step, conn, &run_id);
            }
        }
    }

    pub(super) fn disconnected(&mut self, conn: ConnId) {
        let Some(gone) = self.conns.remove(&conn) else {
            self.socket_closed(conn, None);
            return;
        };
        self.socket_closed(conn, Some(&gone.credential_id));
        if let Some(mut live) = self.sandboxes.get_mut(&gone.sandbox_id) {
            live.conns.remove(&conn);
        }
    }

    /// The writer put an assignment on the wire.
    pub(super) fn assignment_sent(&mut self, now: Millis, run_id: &str) -> Step {
        let mut step = Step::default();
        let unsent =
            self.runs.get(run_id).and_then(|run| run.current()).is_some_and(|a| a.assignment_sent_at.is_none());
        if unsent {
            self.update_run(&mut step, run_id, |run| {
                if let Some(attempt) = run.current_mut() {
                    attempt.assignment_sent_at = Some(now);
                }
            });
        }
        step
    }

    pub(super) fn heartbeat(&mut self, now: Millis, conn: ConnId, state: AgentState) -> Step {
        let mut step = Step::default();
        let Some((sandbox_id, credential_id)) =
            self.conns.get(&conn).map(|c| (c.sandbox_id.clone(), c.credential_id.clone()))
        else {
            return step;
        };
        if !self.credential_usable(&credential_id) {
            // Withdrawn: its socket is being closed; it speaks for no one.
            return step;
        }
        self.socket_heard(now, conn, &credential_id);
        let Some(live) = self.sandboxes.get(&sandbox_id) else {
            return step;
        };
        let was_candidate = self.is_candidate(now, live);
        let Some(mut live) = self.sandboxes.get_mut(&sandbox_id) else {
            return step;
        };
        live.heartbeat = Some(Heartbeat { at: now, state });
        let withheld = live.assignment_withheld && live.may_assign();
        drop(live);
        if withheld {
            self.send_withheld(&mut step, &sandbox_id);
        }
        let Some(mut live) = self.sandboxes.get_mut(&sandbox_id) else {
            return step;
        };
        if state == AgentState::Ready {
            let first_ready = !live.ever_ready;
            live.ever_ready = true;
            let (kind, sandbox_state) = (live.record.kind, live.record.state);
            drop(live);
            if kind == SandboxKind::Warm && sandbox_state == SandboxState::Standby {
                self.pool_failures = 0;
                if first_ready {
                    self.snapshot_if_first(now, &mut step, &sandbox_id);
                }
            }
            match sandbox_state {
                SandboxState::Standby => {
                    self.dispatch_queued(now, &mut step);
                    // A new candidate may let an expired standby go; a
                    // candidate's routine heartbeat changes nothing the
                    // tick has not already weighed.
                    if !was_candidate {
                        self.expire_standbys(now, &mut step);
                    }
                }
                SandboxState::Resuming => self.resumed_ready(now, &mut step, &sandbox_id),
                _ => {}
            }
        } else {
            step.effects.push(Effect::Touch { sandbox_id });
        }
        step
    }

    /// Heartbeats another replica gathered for `conns`, each of the state
    /// its sandbox reported last; a connection that never reported one
    /// has its heartbeat forwarded, not gathered.
    pub(super) fn heard(&mut self, now: Millis, conns: &[ConnId]) -> Step {
        let mut step = Step::default();
        for &conn in conns {
            let state = self
                .conns
                .get(&conn)
                .and_then(|known| self.sandboxes.get(&known.sandbox_id))
                .and_then(|live| live.heartbeat.as_ref())
                .map(|heartbeat| heartbeat.state);
            if let Some(state) = state {
                let Step { writes, effects, .. } = self.heartbeat(now, conn, state);
                step.writes.extend(writes);
                step.effects.extend(effects);
            }
        }
        step
    }

    /// Connections of the sandbox's current standby credential.
    pub(super) fn standby_conns<'a>(&'a self, sandbox_id: &'a str) -> impl Iterator<Item = ConnId> + 'a {
        self.sandboxes.get(sandbox_id).into_iter().flat_map(|live| self.live_standby_conns(live))
    }

    pub(super) fn live_standby_conns<'a>(&'a self, live: &'a Live) -> impl Iterator<Item = ConnId> + 'a {
        let current = live.record.standby_credential_id.as_str();
        self.live_conns(live)
            .filter(move |(_, conn)| conn.kind == CredentialKind::Standby && conn.credential_id == current)
            .map(|(id, _)| id)
    }

    pub(super) fn run_conns<'a>(&'a self, live: &'a Live) -> impl Iterator<Item = ConnId> + 'a {
        self.live_conns(live).filter(|(_, conn)| conn.kind == CredentialKind::Run).map(|(id, _)| id)
    }

    /// Every connection of the sandbox, oldest first.
    pub(super) fn all_conns<'a>(&'a self, sandbox_id: &'a str) -> impl Iterator<Item = ConnId> + 'a {
        self.sandboxes.get(sandbox_id).into_iter().flat_map(|live| live.conns.iter().copied())
    }

    fn live_conns<'a>(&'a self, live: &'a Live) -> impl Iterator<Item = (ConnId, &'a Conn)> + 'a {
        live.conns.iter().filter_map(|id| self.conns.get(id).map(|conn| (*id, conn)))
    }
}
