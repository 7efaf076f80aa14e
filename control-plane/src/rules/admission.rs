//! Who may make which call with a credential, and how many control sockets
//! a credential may hold. Pure, like the rest of the machine: `now` is an
//! argument.
//!
//! A run credential belongs to one attempt of one execution, for that
//! attempt's life:
//! - `active` from the step that commits the attempt;
//! - `revoked` (`401`) when the attempt is fenced: requeued, written off,
//!   or its credential rotated after a restart;
//! - `finishing` after a cancel (amendment 8): the run's events and log are
//!   still accepted, every other call is refused (`410`). The grace ends
//!   when the agent reports the attempt's end, when the sandbox's agent
//!   exits, or `linger` plus the silence limit after the run ended,
//!   whichever comes first;
//! - `retired` (`410`) once its run is over (exited, failed, cancelled and
//!   the grace over), written in the same transaction as the terminal
//!   state, and its socket is closed.
//!
//! One control socket per credential: an upgrade with a credential whose
//! socket is live (heard from within [`SOCKET_WINDOW`] heartbeat
//! intervals) is refused `409` and counted: a second holder of a credential
//! is a sign it was copied. A socket that missed its heartbeats for longer
//! is closed and the new one admitted, so an agent whose old connection
//! died without the server seeing it close (a half-open TCP connection)
//! gets back in. The window is one interval shorter than the silence limit
//! ([`super::HEARTBEAT_WINDOW`] intervals) after which a standby is
//! retired or an unconfirmed sandbox written off, and the `409` says (as
//! `Retry-After`) when the old socket will count as gone, so such an agent
//! is back before its sandbox counts as silent. The socket is claimed at
//! the upgrade, before the `101`, so two concurrent upgrades cannot both
//! pass.

use std::collections::HashMap;
use std::time::Duration;

use axum::http::StatusCode;
use standby_protocol::{self as protocol, Standing};

use super::{ConnId, Effect, Rules, Step};
use crate::credential::{self, CredentialKind};
use crate::model::{CredentialState, Millis, RunState};

/// Heartbeat intervals within which a socket must be heard from to count
/// as live: it missed at least one heartbeat when it is not.
pub const SOCKET_WINDOW: u32 = super::HEARTBEAT_WINDOW - 1;

/// What a credential is presented for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// The control socket's upgrade.
    Socket,
    /// The spec, secrets, attachments, git and cloud credentials, metadata.
    Fetch,
    /// A run's events and log: still accepted in a run credential's cancel
    /// grace.
    Report,
}

impl Call {
    /// The contract's name for what the credential is presented for: its
    /// refusal rule is `standby_protocol::Standing::admits`.
    pub const fn purpose(self) -> protocol::Purpose {
        match self {
            Self::Socket => protocol::Purpose::Socket,
            Self::Fetch => protocol::Purpose::Fetch,
            Self::Report => protocol::Purpose::Report,
        }
    }
}

/// Who a presented credential is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    Standby { sandbox_id: String, credential_id: String },
    Run { sandbox_id: String, run_id: String, attempt: u32, credential_id: String },
}

impl Admission {
    pub fn credential_id(&self) -> &str {
        match self {
            Self::Standby { credential_id, .. } | Self::Run { credential_id, .. } => credential_id,
        }
    }
}

/// Why admission refuses a call or a control socket: the contract's two
/// refusals ([`AdmissionRefusal::contract`]) and the server's own reasons
/// behind them (a run that ended, a second socket).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionRefusal {
    /// `410`: an unknown or retired standby credential; the sandbox is gone.
    #[error("the standby credential is unknown or retired")]
    Gone,
    /// `401`: revoked, wrong, or not a credential at all.
    #[error("the credential is revoked or not valid")]
    Unauthorized,
    /// `410`: a run credential whose run is over (or, after a cancel, used
    /// for anything but the run's events and log).
    #[error("the run is over: its run credential is withdrawn")]
    Ended,
    /// `409`: a control socket upgrade with a credential whose socket is
    /// live; that socket counts as gone after `retry_after` unless it is
    /// heard from again.
    #[error("a live control connection already uses this credential")]
    Duplicate { retry_after: Duration },
}

impl AdmissionRefusal {
    /// The contract's refusal this is, which the agent reads from its
    /// status; `None` for a second socket, which refuses the connection,
    /// not the credential.
    pub const fn contract(self) -> Option<standby_protocol::Refusal> {
        match self {
            Self::Gone | Self::Ended => Some(standby_protocol::Refusal::Gone),
            Self::Unauthorized => Some(standby_protocol::Refusal::Unauthorized),
            Self::Duplicate { .. } => None,
        }
    }

    /// The HTTP status the server answers with.
    pub fn status(self) -> StatusCode {
        match self.contract() {
            // The contract's statuses are valid ones: the fallback is never taken.
            Some(refusal) => StatusCode::from_u16(refusal.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            None => StatusCode::CONFLICT,
        }
    }
}

/// The one control socket of a credential: admitted, or being upgraded.
#[derive(Debug, Clone, Copy)]
struct Socket {
    conn: ConnId,
    /// The claim, then every heartbeat on it.
    last_seen: Millis,
}

/// A run credential in its cancel grace.
#[derive(Debug, Clone)]
struct Grace {
    sandbox_id: String,
    /// When the grace ends at the latest; `None` while the run has not
    /// ended (a cancel of a running run: it ends with the run).
    until: Option<Millis>,
}

#[derive(Debug, Default)]
pub(super) struct Admissions {
    /// Credential id → its socket.
    sockets: HashMap<String, Socket>,
    /// Credential id → its grace.
    graces: HashMap<String, Grace>,
    /// Upgrades refused because the credential had a live socket.
    pub(super) duplicates_refused: u64,
}

impl Rules {
    /// Who `token` is for `call`, or why it is refused. Rules: a token of a
    /// shape this server never mints, a wrong secret or a revoked
    /// credential is `401`; an unknown or retired standby credential is
    /// `410`; a run credential whose run is over is `410`, and so is one in
    /// its cancel grace for anything but its run's events and log.
    pub(super) fn check(&self, token: &str, call: Call) -> Result<Admission, AdmissionRefusal> {
        let parsed = credential::parse(token).ok_or(AdmissionRefusal::Unauthorized)?;
        let record = self.credentials.get(parsed.id);
        let standing = match record {
            None => match parsed.kind {
                CredentialKind::Standby => Standing::Retired,
                CredentialKind::Run => Standing::Unknown,
            },
            Some(record) if record.kind != parsed.kind || !record.hash.matches(token) => Standing::Unknown,
            Some(record) => match record.state {
                CredentialState::Active => Standing::Active,
                CredentialState::Finishing => Standing::Finishing,
                CredentialState::Revoked => Standing::Revoked,
                CredentialState::Retired => Standing::Retired,
            },
        };
        standing.admits(call.purpose()).map_err(|refusal| match (refusal, parsed.kind) {
            (protocol::Refusal::Unauthorized, _) => AdmissionRefusal::Unauthorized,
            (protocol::Refusal::Gone, CredentialKind::Standby) => AdmissionRefusal::Gone,
            (protocol::Refusal::Gone, CredentialKind::Run) => AdmissionRefusal::Ended,
        })?;
        let Some(record) = record else { return Err(AdmissionRefusal::Unauthorized) };
        Ok(match (record.kind, &record.run_id, record.attempt) {
            (CredentialKind::Run, Some(run_id), Some(attempt)) => Admission::Run {
                sandbox_id: record.sandbox_id.clone(),
                run_id: run_id.clone(),
                attempt,
                credential_id: record.id.clone(),
            },
            (CredentialKind::Run, _, _) => return Err(AdmissionRefusal::Unauthorized),
            (CredentialKind::Standby, _, _) => {
                Admission::Standby { sandbox_id: record.sandbox_id.clone(), credential_id: record.id.clone() }
            }
        })
    }

    /// Who `token` is, or why it is refused, for anything but a run's
    /// events and log (see [`Rules::check`]).
    #[cfg(test)]
    pub(super) fn authenticate(&self, token: &str) -> Result<Admission, AdmissionRefusal> {
        self.check(token, Call::Fetch)
    }

    /// The upgrade of control connection `conn` with `token`: admitted (the
    /// socket claimed for it), or refused. A live socket of the same
    /// credential refuses it (`409`); a silent one is closed and replaced.
    pub(super) fn claim_socket(
        &mut self,
        now: Millis,
        conn: ConnId,
        token: &str,
    ) -> Result<(Admission, Step), AdmissionRefusal> {
        let admission = self.check(token, Call::Socket)?;
        let mut step = Step::default();
        let credential_id = admission.credential_id().to_owned();
        if let Some(existing) = self.admissions.sockets.get(&credential_id).copied() {
            let gone_after = existing.last_seen.plus(self.config.heartbeat_interval * SOCKET_WINDOW);
            if now <= gone_after {
                self.admissions.duplicates_refused += 1;
                let (kind, sandbox_id) = match &admission {
                    Admission::Standby { sandbox_id, .. } => ("standby", sandbox_id),
                    Admission::Run { sandbox_id, .. } => ("run", sandbox_id),
                };
                tracing::warn!(
                    sandbox_id,
                    credential = kind,
                    live_conn = existing.conn,
                    "a second control connection with a credential whose connection is live was refused (409): \
                     the credential may have been copied"
                );
                let retry_after = Duration::from_millis(gone_after.since(now) + 1);
                return Err(AdmissionRefusal::Duplicate { retry_after });
            }
            tracing::info!(conn = existing.conn, "a silent control connection was replaced by a new one");
            step.effects.push(Effect::Close { conn: existing.conn });
            self.disconnected(existing.conn);
        }
        self.admissions.sockets.insert(credential_id, Socket { conn, last_seen: now });
        Ok((admission, step))
    }

    /// Whether `conn` holds its credential's socket claim.
    pub(super) fn holds_socket(&self, conn: ConnId, credential_id: &str) -> bool {
        self.admissions.sockets.get(credential_id).is_some_and(|socket| socket.conn == conn)
    }

    /// `conn` was heard from: its socket stays live.
    pub(super) fn socket_heard(&mut self, now: Millis, conn: ConnId, credential_id: &str) {
        if let Some(socket) = self.admissions.sockets.get_mut(credential_id)
            && socket.conn == conn
        {
            socket.last_seen = now;
        }
    }

    /// `conn` is gone (or its upgrade never completed): its claim is freed.
    pub(super) fn socket_closed(&mut self, conn: ConnId, credential_id: Option<&str>) {
        match credential_id {
            Some(credential_id) => {
                if self.holds_socket(conn, credential_id) {
                    self.admissions.sockets.remove(credential_id);
                }
            }
            // A claim whose upgrade failed was never connected: only the
            // claims know its credential.
            None => self.admissions.sockets.retain(|_, socket| socket.conn != conn),
        }
    }

    /// Whether a heartbeat on a connection admitted with `credential_id`
    /// still counts: not once the credential is withdrawn (its socket is
    /// being closed).
    pub(super) fn credential_usable(&self, credential_id: &str) -> bool {
        self.credentials
            .get(credential_id)
            .is_some_and(|c| matches!(c.state, CredentialState::Active | CredentialState::Finishing))
    }

    /// A credential is withdrawn for good (`state`): written, and its
    /// socket closed after the frames queued before.
    pub(super) fn withdraw(&mut self, step: &mut Step, credential_id: &str, state: CredentialState) {
        self.set_credential(step, credential_id, state);
        self.admissions.graces.remove(credential_id);
        if let Some(socket) = self.admissions.sockets.get(credential_id) {
            step.effects.push(Effect::Close { conn: socket.conn });
        }
    }

    /// A cancel: the run credential of the current attempt of `run_id` may
    /// still report the run's events and log (amendment 8), nothing else.
    pub(super) fn begin_grace(&mut self, step: &mut Step, run_id: &str) {
        let Some(attempt) = self.runs.get(run_id).and_then(|run| run.current()).cloned() else { return };
        let active = self.credentials.get(&attempt.credential_id).is_some_and(|c| c.state == CredentialState::Active);
        if active {
            self.set_credential(step, &attempt.credential_id, CredentialState::Finishing);
            let grace = Grace { sandbox_id: attempt.sandbox_id, until: None };
            self.admissions.graces.insert(attempt.credential_id, grace);
        }
    }

    /// `run_id` reached terminal `state`: every run credential of it still
    /// usable is retired in the same step, but for a cancelled run the
    /// credential in its grace, which now ends at the latest `linger`
    /// plus the silence limit from now.
    pub(super) fn withdraw_run(&mut self, now: Millis, step: &mut Step, run_id: &str, state: RunState) {
        let Some(run) = self.runs.get(run_id) else { return };
        let credential_ids: Vec<String> = run.attempts.iter().map(|a| a.credential_id.clone()).collect();
        let until = now.plus(self.config.linger + self.config.silence());
        for credential_id in credential_ids {
            match self.credentials.get(&credential_id).map(|c| c.state) {
                Some(CredentialState::Finishing) if state == RunState::Cancelled => {
                    if let Some(grace) = self.admissions.graces.get_mut(&credential_id) {
                        grace.until = Some(until);
                    }
                }
                Some(CredentialState::Active | CredentialState::Finishing) => {
                    self.withdraw(step, &credential_id, CredentialState::Retired);
                }
                _ => {}
            }
        }
    }

    /// The agent's last event of `attempt` (anything but `started`) ends
    /// that credential's grace.
    pub(super) fn last_event(&mut self, step: &mut Step, run_id: &str, attempt: u32) {
        // A run not in memory has finished (evicted, or not loaded after a
        // restart): its grace is found among the graces.
        let credential_id = match self.runs.get(run_id) {
            Some(run) => run.attempts.iter().find(|a| a.number == attempt).map(|a| a.credential_id.clone()),
            None => self
                .admissions
                .graces
                .keys()
                .find(|id| {
                    self.credentials
                        .get(*id)
                        .is_some_and(|c| c.run_id.as_deref() == Some(run_id) && c.attempt == Some(attempt))
                })
                .cloned(),
        };
        if let Some(credential_id) = credential_id
            && self.admissions.graces.contains_key(&credential_id)
            && self.runs.get(run_id).is_none_or(|run| run.state.is_terminal())
        {
            self.withdraw(step, &credential_id, CredentialState::Retired);
        }
    }

    /// The agent of `sandbox_id` is gone: the graces of its credentials end.
    pub(super) fn end_graces_of(&mut self, step: &mut Step, sandbox_id: &str) {
        let ended: Vec<String> = self
            .admissions
            .graces
            .iter()
            .filter(|(_, grace)| grace.sandbox_id == sandbox_id)
            .map(|(id, _)| id.clone())
            .collect();
        for credential_id in ended {
            let over = self
                .credentials
                .get(&credential_id)
                .and_then(|c| c.run_id.as_ref())
                .is_none_or(|run_id| self.runs.get(run_id).is_none_or(|run| run.state.is_terminal()));
            if over {
                self.withdraw(step, &credential_id, CredentialState::Retired);
            }
        }
    }

    /// Time passed: graces past their end are over.
    pub(super) fn expire_graces(&mut self, now: Millis, step: &mut Step) {
        let expired: Vec<String> = self
            .admissions
            .graces
            .iter()
            .filter(|(_, grace)| grace.until.is_some_and(|until| now > until))
            .map(|(id, _)| id.clone())
            .collect();
        for credential_id in expired {
            self.withdraw(step, &credential_id, CredentialState::Retired);
        }
    }

    /// After a restart: a run credential still usable whose run is over is
    /// retired (a store written before this rule held them `active`), one
    /// of an attempt that is not its run's current one is revoked, and
    /// graces are taken up again with a fresh bound.
    pub(super) fn repair_credentials(&mut self, now: Millis, step: &mut Step) {
        let mut retire = Vec::new();
        let mut revoke = Vec::new();
        let until = now.plus(self.config.linger + self.config.silence());
        for record in self.credentials.values().filter(|c| c.kind == CredentialKind::Run) {
            if !matches!(record.state, CredentialState::Active | CredentialState::Finishing) {
                continue;
            }
            let Some(run) = record.run_id.as_ref().and_then(|run_id| self.runs.get(run_id)) else {
                // Finished runs are not loaded at start: the run is over.
                match record.state {
                    CredentialState::Finishing => {
                        let grace = Grace { sandbox_id: record.sandbox_id.clone(), until: Some(until) };
                        self.admissions.graces.insert(record.id.clone(), grace);
                    }
                    _ => retire.push(record.id.clone()),
                }
                continue;
            };
            let current = run.current().is_some_and(|a| a.credential_id == record.id);
            match run.state {
                _ if !current => revoke.push(record.id.clone()),
                state if state.is_terminal() && record.state == CredentialState::Active => {
                    retire.push(record.id.clone());
                }
                state if record.state == CredentialState::Finishing => {
                    let until = state.is_terminal().then_some(until);
                    let grace = Grace { sandbox_id: record.sandbox_id.clone(), until };
                    self.admissions.graces.insert(record.id.clone(), grace);
                }
                _ => {}
            }
        }
        for credential_id in retire {
            self.withdraw(step, &credential_id, CredentialState::Retired);
        }
        for credential_id in revoke {
            self.withdraw(step, &credential_id, CredentialState::Revoked);
        }
    }
}
