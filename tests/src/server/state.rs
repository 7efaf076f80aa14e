//! The server's state behind one lock, so that a decision and the records
//! it produces are never observed half-made: the credentials it issued and
//! where each stands, the standbys and executions, the live connections,
//! the faults a test asked for, and the records.
//!
//! The contract's rules come from `standby_protocol`: a credential is
//! answered by [`Standing::admits`], a log chunk by
//! [`log_chunk::accept`](standby_protocol::log_chunk::accept), an event's
//! order is checked by [`EventKind::may_follow`](standby_protocol::EventKind::may_follow).
//! What is left here is the server's own bookkeeping.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use axum::http::HeaderMap;
use standby_protocol::{
    AgentMessage, Assignment, Cancel, CredentialKind, Endpoint, PROTOCOL_HEADER, PROTOCOL_VERSION, Purpose, Retired,
    Secret, ServerMessage, Standing,
};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::calls::HttpAnswer;
use super::records::{CloseCause, ConnectionId, ConnectionRecord, ExecutionRecord, HeartbeatRecord, Records};
use super::records::{Revocation, UpgradeRecord};
use super::setup::{ExecutionSetup, Failure, Frame, ScriptedUpgrade, ServerError};

/// Prefix of the standby credentials this server mints. An unknown
/// credential with it is a standby the server no longer holds (its sandbox
/// is gone: `410`); anything else unknown is simply wrong (`401`).
pub const STANDBY_PREFIX: &str = "sby_";

/// The lock plus a change signal that waiters subscribe to.
#[derive(Debug)]
pub(crate) struct Shared {
    inner: Mutex<Inner>,
    changed: watch::Sender<u64>,
}

impl Shared {
    pub(crate) fn new() -> Self {
        Self { inner: Mutex::new(Inner::default()), changed: watch::Sender::new(0) }
    }

    /// Runs `f` under the lock and wakes every waiter afterwards.
    pub(crate) fn update<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let result = f(&mut self.inner.lock().unwrap_or_else(PoisonError::into_inner));
        self.changed.send_modify(|version| *version = version.wrapping_add(1));
        result
    }

    pub(crate) fn read<R>(&self, f: impl FnOnce(&Inner) -> R) -> R {
        f(&self.inner.lock().unwrap_or_else(PoisonError::into_inner))
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

/// Whose credential a request presents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Holder {
    /// A standby, by its credential.
    Standby(String),
    /// A run, by its execution id.
    Run(String),
}

impl Holder {
    pub(crate) fn kind(&self) -> CredentialKind {
        match self {
            Self::Standby(_) => CredentialKind::Standby,
            Self::Run(_) => CredentialKind::Run,
        }
    }
}

/// What a credential is presented for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Scope<'a> {
    Socket,
    Spec,
    /// A call of the execution named in the path.
    Execution(&'a str, Endpoint),
}

#[derive(Debug)]
struct Standby {
    standing: Standing,
    execution: Option<String>,
}

#[derive(Debug)]
pub(crate) struct Execution {
    pub(crate) setup: ExecutionSetup,
    run_credential: String,
    /// The assignment frame, sent live and replayed.
    assignment: String,
}

/// What the test asks a connection task to do.
#[derive(Debug)]
pub(crate) enum Command {
    Send(Frame),
    Drop,
    PingEvery(Option<Duration>),
}

#[derive(Debug)]
struct Live {
    sender: mpsc::UnboundedSender<Command>,
    standby_token: String,
    kind: CredentialKind,
}

/// What the test asked the server to do wrong.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    /// Answers to coming upgrades, given before any credential check.
    pub(crate) upgrades: VecDeque<ScriptedUpgrade>,
    /// Failing answers per endpoint, given after the credential check.
    pub(crate) failures: HashMap<Endpoint, Failure>,
    pub(crate) latency: HashMap<Endpoint, Duration>,
    /// Delay of every call of an execution without a latency of its own.
    pub(crate) execution_latency: Option<Duration>,
    /// Answered to a withdrawn run credential instead of the rule's status.
    pub(crate) withdrawn_run_status: Option<u16>,
    /// Pings every connection opened from now on.
    pub(crate) ping_interval: Option<Duration>,
}

impl Faults {
    pub(crate) fn latency(&self, endpoint: Endpoint) -> Option<Duration> {
        let of_execution = endpoint.credential() == CredentialKind::Run;
        self.latency.get(&endpoint).copied().or(self.execution_latency.filter(|_| of_execution))
    }

    /// The scripted failure of a call to `endpoint`, counted down.
    pub(crate) fn fail(&mut self, endpoint: Endpoint) -> Option<HttpAnswer> {
        let failure = self.failures.get_mut(&endpoint)?;
        match &mut failure.remaining {
            Some(0) => {
                self.failures.remove(&endpoint);
                return None;
            }
            Some(remaining) => *remaining -= 1,
            None => {}
        }
        Some(HttpAnswer::error(failure.status, "scripted failure").retry_after(failure.retry_after))
    }

    /// The upgrade answer scripted for a request with a credential of `kind`.
    fn scripted_upgrade(&mut self, kind: Option<CredentialKind>) -> Option<HttpAnswer> {
        let at = self.upgrades.iter().position(|script| script.credential.is_none() || script.credential == kind)?;
        let script = self.upgrades.remove(at)?;
        Some(HttpAnswer::error(script.status, "scripted answer").retry_after(script.retry_after))
    }
}

#[derive(Debug, Default)]
pub(crate) struct Inner {
    pub(crate) records: Records,
    pub(crate) faults: Faults,
    /// What `GET /v1/standby/spec` answers (`404` while `None`).
    pub(crate) spec: Option<serde_json::Value>,
    /// Of every `wait_*` call; `None`: 30 s.
    pub(crate) wait_timeout: Option<Duration>,
    pub(crate) executions: HashMap<String, Execution>,
    standbys: HashMap<String, Standby>,
    /// Run credential → execution id.
    run_credentials: HashMap<String, String>,
    live: BTreeMap<ConnectionId, Live>,
    next_connection: u64,
    next_serial: u64,
    random: RandomState,
}

impl Inner {
    fn mint(&mut self, prefix: &str) -> String {
        self.next_serial += 1;
        let noise = self.random.hash_one(self.next_serial);
        format!("{prefix}{}_{noise:016x}", self.next_serial)
    }

    pub(crate) fn violation(&mut self, message: String) {
        self.records.violations.push(message);
    }

    // ---- credentials -----------------------------------------------------

    fn holder(&self, token: &str) -> Option<Holder> {
        if self.standbys.contains_key(token) {
            Some(Holder::Standby(token.to_owned()))
        } else {
            self.run_credentials.get(token).map(|execution_id| Holder::Run(execution_id.clone()))
        }
    }

    fn run_standing(&self, execution_id: &str) -> Standing {
        self.records
            .executions
            .get(execution_id)
            .map_or(Standing::Unknown, |record| record.revoked.map_or(Standing::Active, Revocation::standing))
    }

    /// Where `token`, held by `holder`, stands for `scope`.
    fn standing(&self, holder: Option<&Holder>, token: &str, scope: Scope<'_>) -> Standing {
        match (holder, scope) {
            (Some(Holder::Standby(token)), Scope::Socket | Scope::Spec) => self.standbys[token].standing,
            (Some(Holder::Run(execution_id)), Scope::Socket) => self.run_standing(execution_id),
            (Some(Holder::Run(execution_id)), Scope::Execution(named, _)) if execution_id == named => {
                self.run_standing(execution_id)
            }
            (None, Scope::Socket | Scope::Spec) if token.starts_with(STANDBY_PREFIX) => Standing::Retired,
            _ => Standing::Unknown,
        }
    }

    /// Who a request's credential belongs to, and whether it is accepted
    /// for `scope`: without the protocol header or a credential the request
    /// is malformed (`400`); a credential is answered by
    /// [`Standing::admits`], or with the status the test set for a
    /// withdrawn run credential.
    pub(crate) fn check(&self, headers: &HeaderMap, scope: Scope<'_>) -> (Option<Holder>, Result<(), HttpAnswer>) {
        let token = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "))
            .filter(|token| !token.is_empty());
        let holder = token.and_then(|token| self.holder(token));
        let protocol = headers.get(PROTOCOL_HEADER).and_then(|value| value.to_str().ok());
        if protocol != Some(PROTOCOL_VERSION) {
            let reason = format!("header {PROTOCOL_HEADER}: {PROTOCOL_VERSION} missing (got {protocol:?})");
            return (holder, Err(HttpAnswer::error(400, &reason)));
        }
        let Some(token) = token else {
            return (holder, Err(HttpAnswer::error(400, "header Authorization: Bearer <credential> missing")));
        };
        let standing = self.standing(holder.as_ref(), token, scope);
        let purpose = match scope {
            Scope::Socket => Purpose::Socket,
            Scope::Spec => Purpose::Fetch,
            Scope::Execution(_, endpoint) => endpoint.purpose(),
        };
        let verdict = standing.admits(purpose).map_err(|refusal| {
            let status = match (&holder, self.faults.withdrawn_run_status) {
                (Some(Holder::Run(_)), Some(status)) if standing != Standing::Unknown => status,
                _ => refusal.status(),
            };
            HttpAnswer::error(status, &format!("a {standing:?} credential is refused for {purpose:?}"))
        });
        (holder, verdict)
    }

    // ---- standbys and executions -----------------------------------------

    pub(crate) fn add_standby(&mut self) -> String {
        let token = self.mint(STANDBY_PREFIX);
        self.standbys.insert(token.clone(), Standby { standing: Standing::Active, execution: None });
        token
    }

    fn active_standby(&mut self, token: &str, action: &'static str) -> Result<&mut Standby, ServerError> {
        let standby = self.standbys.get_mut(token).ok_or_else(|| ServerError::UnknownStandby(token.to_owned()))?;
        if standby.standing != Standing::Active {
            return Err(ServerError::StandbyNotActive { token: token.to_owned(), standing: standby.standing, action });
        }
        Ok(standby)
    }

    /// The standby `token`, when it is active and holds no assignment.
    fn idle_standby(&mut self, token: &str, action: &'static str) -> Result<&mut Standby, ServerError> {
        let standby = self.active_standby(token, action)?;
        if let Some(execution_id) = &standby.execution {
            return Err(ServerError::AlreadyAssigned { token: token.to_owned(), execution_id: execution_id.clone() });
        }
        Ok(standby)
    }

    /// Commit before tell: the run is bound to the sandbox and its
    /// credential minted before the frame leaves.
    pub(crate) fn assign(&mut self, token: &str, setup: ExecutionSetup) -> Result<String, ServerError> {
        self.idle_standby(token, "an assignment")?;
        let execution_id = setup.execution_id.clone().unwrap_or_else(|| {
            self.next_serial += 1;
            format!("exe_{}", self.next_serial)
        });
        if self.executions.contains_key(&execution_id) {
            return Err(ServerError::DuplicateExecution(execution_id));
        }
        let run_credential = self.mint("run_");
        let mut run = setup.run.clone();
        if setup.inline_attachments {
            run.attachments = Some(setup.listed_attachments(&execution_id));
        }
        let assignment = ServerMessage::Assignment(Box::new(Assignment {
            execution_id: execution_id.clone(),
            run_credential: Secret::new(run_credential.clone()),
            run,
            trace_context: None,
        }))
        .encode()
        .expect("an assignment always encodes");
        self.standbys.get_mut(token).expect("checked above").execution = Some(execution_id.clone());
        self.run_credentials.insert(run_credential.clone(), execution_id.clone());
        self.executions
            .insert(execution_id.clone(), Execution { setup, run_credential, assignment: assignment.clone() });
        let record = ExecutionRecord {
            execution_id: execution_id.clone(),
            standby_token: token.to_owned(),
            ..ExecutionRecord::default()
        };
        self.records.executions.insert(execution_id.clone(), record);
        self.send_to_standby(token, Some(CredentialKind::Standby), &assignment);
        Ok(execution_id)
    }

    pub(crate) fn assignment_frame(&self, execution_id: &str) -> Option<String> {
        self.executions.get(execution_id).map(|execution| execution.assignment.clone())
    }

    pub(crate) fn run_credential(&self, execution_id: &str) -> Option<String> {
        self.executions.get(execution_id).map(|execution| execution.run_credential.clone())
    }

    pub(crate) fn retire(&mut self, token: &str, reason: Option<&str>) -> Result<(), ServerError> {
        self.idle_standby(token, "retirement")?.standing = Standing::Retired;
        let frame = ServerMessage::Retired(Retired { reason: reason.map(str::to_owned) })
            .encode()
            .expect("a retired message always encodes");
        self.send_to_standby(token, Some(CredentialKind::Standby), &frame);
        Ok(())
    }

    pub(crate) fn expire(&mut self, token: &str) -> Result<(), ServerError> {
        self.active_standby(token, "expiry")?.standing = Standing::Retired;
        Ok(())
    }

    pub(crate) fn revoke_run(&mut self, execution_id: &str, why: Revocation) -> Result<String, ServerError> {
        let record = self.execution_record(execution_id)?;
        if record.revoked.is_some() {
            return Err(ServerError::AlreadyRevoked(execution_id.to_owned()));
        }
        record.revoked = Some(why);
        Ok(record.standby_token.clone())
    }

    /// Revokes first, so that a sandbox racing the cancel can no longer
    /// confirm delivery, then tells every live connection of the sandbox.
    pub(crate) fn cancel(&mut self, execution_id: &str) -> Result<(), ServerError> {
        let token = self.revoke_run(execution_id, Revocation::Cancelled)?;
        let frame = ServerMessage::Cancel(Cancel { execution_id: execution_id.to_owned() })
            .encode()
            .expect("a cancel message always encodes");
        self.send_to_standby(&token, None, &frame);
        Ok(())
    }

    pub(crate) fn execution_record(&mut self, execution_id: &str) -> Result<&mut ExecutionRecord, ServerError> {
        self.records
            .executions
            .get_mut(execution_id)
            .ok_or_else(|| ServerError::UnknownExecution(execution_id.to_owned()))
    }

    fn send_to_standby(&self, token: &str, only: Option<CredentialKind>, text: &str) {
        for live in self.live.values() {
            if live.standby_token == token && only.is_none_or(|kind| kind == live.kind) {
                // A connection whose task just ended has no receiver: it is
                // gone, and the frame is replayed on its successor.
                let _ = live.sender.send(Command::Send(Frame::Text(text.to_owned())));
            }
        }
    }

    // ---- the control socket ----------------------------------------------

    /// Answers an upgrade request and records it: a scripted answer first,
    /// then the credential. Admitting the run credential confirms delivery
    /// and revokes the standby credential, only when the request really is
    /// an upgrade.
    pub(crate) fn upgrade(&mut self, headers: &HeaderMap, is_upgrade: bool) -> Result<Holder, HttpAnswer> {
        let at = Instant::now();
        let (holder, checked) = self.check(headers, Scope::Socket);
        let kind = holder.as_ref().map(Holder::kind);
        let scripted = self.faults.scripted_upgrade(kind);
        let was_scripted = scripted.is_some();
        let answer = match scripted {
            Some(answer) => Err(answer),
            None => checked.and_then(|()| {
                holder.filter(|_| is_upgrade).ok_or_else(|| HttpAnswer::error(400, "not a WebSocket upgrade"))
            }),
        };
        let status = answer.as_ref().map_or_else(|refused| refused.status, |_| 101);
        self.records.upgrades.push(UpgradeRecord { at, credential: kind, status, scripted: was_scripted });
        if let Ok(Holder::Run(execution_id)) = &answer
            && let Some(record) = self.records.executions.get_mut(execution_id)
        {
            record.confirmed_at.get_or_insert(at);
            if let Some(standby) = self.standbys.get_mut(&record.standby_token) {
                standby.standing = Standing::Revoked;
            }
        }
        answer
    }

    /// Registers an admitted connection; returns its id and what it is sent
    /// first: the assignment while it is pending, replayed on a standby
    /// connection until the run credential connects and on every
    /// run-credential connection while that credential is in force.
    pub(crate) fn register(&mut self, holder: &Holder, sender: mpsc::UnboundedSender<Command>) -> ConnectionId {
        self.next_connection += 1;
        let id = ConnectionId(self.next_connection);
        let (standby_token, execution_id, pending) = match holder {
            Holder::Standby(token) => {
                let standby = &self.standbys[token];
                let pending = standby.execution.clone().filter(|_| standby.standing == Standing::Active);
                (token.clone(), None, pending)
            }
            Holder::Run(execution_id) => {
                let token = self.records.executions[execution_id].standby_token.clone();
                (token, Some(execution_id.clone()), Some(execution_id.clone()))
            }
        };
        if let Some(assignment) = pending
            .filter(|execution_id| self.run_standing(execution_id) == Standing::Active)
            .and_then(|execution_id| self.assignment_frame(&execution_id))
        {
            let _ = sender.send(Command::Send(Frame::Text(assignment)));
        }
        self.live.insert(id, Live { sender, standby_token: standby_token.clone(), kind: holder.kind() });
        self.records.connections.push(ConnectionRecord {
            id,
            credential: holder.kind(),
            standby_token,
            execution_id,
            opened_at: Instant::now(),
            closed_at: None,
            close: None,
            pongs: 0,
        });
        id
    }

    pub(crate) fn closed(&mut self, id: ConnectionId, cause: CloseCause) {
        self.live.remove(&id);
        if let Some(connection) = self.records.connections.iter_mut().find(|c| c.id == id) {
            connection.closed_at = Some(Instant::now());
            connection.close = Some(cause);
        }
    }

    pub(crate) fn pong(&mut self, id: ConnectionId) {
        if let Some(connection) = self.records.connections.iter_mut().find(|c| c.id == id) {
            connection.pongs += 1;
        }
    }

    /// The agent sends only heartbeats; anything else is a violation.
    pub(crate) fn text_received(&mut self, id: ConnectionId, text: &str) {
        let at = Instant::now();
        let Some(connection) = self.records.connection(id).cloned() else {
            return;
        };
        match serde_json::from_str::<AgentMessage>(text) {
            Ok(AgentMessage::Heartbeat { state, execution_id }) => {
                if let Some(named) = &execution_id
                    && self
                        .records
                        .executions
                        .get(named)
                        .is_none_or(|run| run.standby_token != connection.standby_token)
                {
                    self.violation(format!("heartbeat on {id} names execution {named:?}, not this sandbox's"));
                }
                let credential = connection.credential;
                self.records.heartbeats.push(HeartbeatRecord { connection: id, credential, state, execution_id, at });
            }
            Err(error) => self.violation(format!("{id} sent a text frame that is not a heartbeat ({error}): {text}")),
        }
    }

    pub(crate) fn send(&self, id: ConnectionId, command: Command) -> Result<(), ServerError> {
        let live = self.live.get(&id).ok_or(ServerError::NoSuchConnection(id))?;
        live.sender.send(command).map_err(|_| ServerError::NoSuchConnection(id))
    }

    pub(crate) fn shutdown(&mut self) {
        for live in self.live.values() {
            let _ = live.sender.send(Command::Drop);
        }
    }
}
