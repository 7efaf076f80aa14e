//! The server's state machine: credentials, standbys, executions, and the
//! rules that decide every answer. All of it sits behind one lock so that a
//! decision and the records it produces are never observed half-made.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use axum::http::HeaderMap;
use sha2::{Digest, Sha256};
use standby_protocol::log_ledger::{self, Verdict};
use standby_protocol::{
    AgentMessage, Assignment, Attachment, AttachmentsResponse, Cancel, CloudCredentialsResponse, Event, EventKind,
    GitCredentialsResponse, LogChunk, LogReceived, PROTOCOL_HEADER, PROTOCOL_VERSION, Retired, Secret, SecretsResponse,
    ServerMessage,
};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::records::{
    CloseCause, ConnectionId, ConnectionRecord, CredentialKind, Endpoint, ExecutionRecord, HeartbeatRecord,
    HttpCallRecord, Records, Revocation, UpgradeRecord, event_type,
};
use super::setup::{ExecutionSetup, Failure, Frame, ScriptedUpgrade, ServerError};

/// Prefix of the standby credentials this server mints. An unknown
/// credential with it is a standby the server forgot (`410`); anything else
/// unknown is simply wrong (`401`).
pub const STANDBY_PREFIX: &str = "sby_";

/// The lock plus a change signal that waiters subscribe to.
#[derive(Debug)]
pub(crate) struct Shared {
    inner: Mutex<Inner>,
    changed: watch::Sender<u64>,
}

impl Shared {
    pub(crate) fn new() -> Self {
        Self { inner: Mutex::new(Inner::new()), changed: watch::Sender::new(0) }
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StandbyStatus {
    Active,
    Retired,
    Expired,
    /// The run credential of its assignment connected.
    Revoked,
}

impl StandbyStatus {
    fn name(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Retired => "retired",
            Self::Expired => "expired",
            Self::Revoked => "revoked",
        }
    }
}

#[derive(Debug)]
struct Standby {
    status: StandbyStatus,
    execution: Option<String>,
}

#[derive(Debug)]
struct Execution {
    setup: ExecutionSetup,
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
}

/// Who a bearer credential belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Credential {
    Standby(String),
    Run(String),
    Unknown,
}

impl Credential {
    fn kind(&self) -> Option<CredentialKind> {
        match self {
            Self::Standby(_) => Some(CredentialKind::Standby),
            Self::Run(_) => Some(CredentialKind::Run),
            Self::Unknown => None,
        }
    }
}

/// The answer to an upgrade request.
#[derive(Debug)]
pub(crate) enum Admission {
    Reject { status: u16, retry_after: Option<u64>, reason: String },
    Admit { credential: CredentialKind, standby_token: String, execution_id: Option<String> },
}

/// An HTTP request, reduced to what the rules look at.
#[derive(Debug)]
pub(crate) struct HttpRequest<'a> {
    pub endpoint: Endpoint,
    pub method: &'a str,
    pub path: &'a str,
    pub execution_id: Option<&'a str>,
    pub attachment: Option<&'a str>,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
}

/// An HTTP answer before it becomes an axum response.
#[derive(Debug)]
pub(crate) struct HttpAnswer {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub retry_after: Option<u64>,
}

impl HttpAnswer {
    fn json(status: u16, value: &impl serde::Serialize) -> Self {
        Self {
            status,
            content_type: "application/json",
            body: serde_json::to_vec(value).unwrap_or_default(),
            retry_after: None,
        }
    }

    fn error(status: u16, message: &str) -> Self {
        Self::json(status, &serde_json::json!({ "error": message }))
    }
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) records: Records,
    standbys: HashMap<String, Standby>,
    executions: HashMap<String, Execution>,
    /// Run credential → execution id.
    run_credentials: HashMap<String, String>,
    live: BTreeMap<ConnectionId, Live>,
    upgrade_script: VecDeque<ScriptedUpgrade>,
    failures: HashMap<Endpoint, Failure>,
    latency: HashMap<Endpoint, Duration>,
    execution_latency: Option<Duration>,
    spec: Option<serde_json::Value>,
    pub(crate) ping_interval: Option<Duration>,
    revoked_run_status: u16,
    reports_after_revocation: bool,
    next_connection: u64,
    next_serial: u64,
    random: RandomState,
    pub(crate) wait_timeout: Duration,
}

impl Inner {
    fn new() -> Self {
        Self {
            records: Records::new(),
            standbys: HashMap::new(),
            executions: HashMap::new(),
            run_credentials: HashMap::new(),
            live: BTreeMap::new(),
            upgrade_script: VecDeque::new(),
            failures: HashMap::new(),
            latency: HashMap::new(),
            execution_latency: None,
            spec: None,
            ping_interval: None,
            revoked_run_status: 401,
            reports_after_revocation: true,
            next_connection: 0,
            next_serial: 0,
            random: RandomState::new(),
            wait_timeout: Duration::from_secs(30),
        }
    }

    fn mint(&mut self, prefix: &str) -> String {
        self.next_serial += 1;
        let noise = self.random.hash_one(self.next_serial);
        format!("{prefix}{}_{noise:016x}", self.next_serial)
    }

    fn identify(&self, token: &str) -> Credential {
        if self.standbys.contains_key(token) {
            Credential::Standby(token.to_owned())
        } else if let Some(execution_id) = self.run_credentials.get(token) {
            Credential::Run(execution_id.clone())
        } else {
            Credential::Unknown
        }
    }

    // ---- configuration -------------------------------------------------

    pub(crate) fn add_standby(&mut self, token: Option<&str>) -> String {
        let token = token.map_or_else(|| self.mint(STANDBY_PREFIX), str::to_owned);
        self.standbys.insert(token.clone(), Standby { status: StandbyStatus::Active, execution: None });
        token
    }

    pub(crate) fn set_spec(&mut self, spec: Option<serde_json::Value>) {
        self.spec = spec;
    }

    pub(crate) fn script_upgrade(&mut self, answer: ScriptedUpgrade) {
        self.upgrade_script.push_back(answer);
    }

    pub(crate) fn set_failure(&mut self, endpoint: Endpoint, failure: Option<Failure>) {
        match failure {
            Some(failure) => self.failures.insert(endpoint, failure),
            None => self.failures.remove(&endpoint),
        };
    }

    pub(crate) fn clear_failures(&mut self) {
        self.failures.clear();
    }

    pub(crate) fn set_latency(&mut self, endpoint: Option<Endpoint>, latency: Option<Duration>) {
        match (endpoint, latency) {
            (None, latency) => self.execution_latency = latency,
            (Some(endpoint), Some(latency)) => {
                self.latency.insert(endpoint, latency);
            }
            (Some(endpoint), None) => {
                self.latency.remove(&endpoint);
            }
        }
    }

    pub(crate) fn latency(&self, endpoint: Endpoint) -> Option<Duration> {
        self.latency.get(&endpoint).copied().or(if endpoint.is_execution() { self.execution_latency } else { None })
    }

    pub(crate) fn set_revoked_run_status(&mut self, status: u16) {
        self.revoked_run_status = status;
    }

    pub(crate) fn set_reports_after_revocation(&mut self, accept: bool) {
        self.reports_after_revocation = accept;
    }

    // ---- the standby / execution state machine -------------------------

    fn active_standby(&mut self, token: &str, action: &'static str) -> Result<&mut Standby, ServerError> {
        let standby = self.standbys.get_mut(token).ok_or_else(|| ServerError::UnknownStandby(token.to_owned()))?;
        if standby.status != StandbyStatus::Active {
            return Err(ServerError::StandbyNotActive {
                token: token.to_owned(),
                status: standby.status.name(),
                action,
            });
        }
        Ok(standby)
    }

    /// Commit before tell: the run is bound to the sandbox and its
    /// credential minted before the frame leaves.
    pub(crate) fn assign(&mut self, token: &str, setup: ExecutionSetup) -> Result<String, ServerError> {
        let standby = self.active_standby(token, "an assignment")?;
        if let Some(execution_id) = &standby.execution {
            return Err(ServerError::AlreadyAssigned { token: token.to_owned(), execution_id: execution_id.clone() });
        }
        let execution_id = match &setup.execution_id {
            Some(id) => id.clone(),
            None => {
                self.next_serial += 1;
                format!("exe_{}", self.next_serial)
            }
        };
        if self.executions.contains_key(&execution_id) {
            return Err(ServerError::DuplicateExecution(execution_id));
        }
        let run_credential = self.mint("run_");
        let mut run = setup.run.clone();
        if setup.inline_attachments {
            run.attachments = Some(listed_attachments(&execution_id, &setup));
        }
        let assignment = ServerMessage::Assignment(Assignment {
            execution_id: execution_id.clone(),
            run_credential: Secret::new(run_credential.clone()),
            run,
        })
        .encode()
        .expect("an assignment always encodes");
        self.standbys.get_mut(token).expect("checked above").execution = Some(execution_id.clone());
        self.run_credentials.insert(run_credential.clone(), execution_id.clone());
        self.executions
            .insert(execution_id.clone(), Execution { setup, run_credential, assignment: assignment.clone() });
        self.records.executions.insert(
            execution_id.clone(),
            ExecutionRecord {
                execution_id: execution_id.clone(),
                standby_token: token.to_owned(),
                events: Vec::new(),
                event_posts: 0,
                log: Vec::new(),
                log_posts: 0,
                log_chunks: Vec::new(),
                log_received: 0,
                log_gaps: Vec::new(),
                log_forgotten: false,
                confirmed_at: None,
                revoked: None,
            },
        );
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
        let standby = self.active_standby(token, "retirement")?;
        if let Some(execution_id) = &standby.execution {
            return Err(ServerError::AlreadyAssigned { token: token.to_owned(), execution_id: execution_id.clone() });
        }
        standby.status = StandbyStatus::Retired;
        let frame = ServerMessage::Retired(Retired { reason: reason.map(str::to_owned) })
            .encode()
            .expect("a retired message always encodes");
        self.send_to_standby(token, Some(CredentialKind::Standby), &frame);
        Ok(())
    }

    pub(crate) fn expire(&mut self, token: &str) -> Result<(), ServerError> {
        self.active_standby(token, "expiry")?.status = StandbyStatus::Expired;
        Ok(())
    }

    pub(crate) fn revoke_run(&mut self, execution_id: &str, why: Revocation) -> Result<String, ServerError> {
        let record = self
            .records
            .executions
            .get_mut(execution_id)
            .ok_or_else(|| ServerError::UnknownExecution(execution_id.to_owned()))?;
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

    fn send_to_standby(&self, token: &str, only: Option<CredentialKind>, text: &str) {
        for (id, live) in &self.live {
            let kind = self.records.connection(*id).map(|connection| connection.credential);
            if live.standby_token == token && (only.is_none() || kind == only) {
                // A connection whose task just ended has no receiver: it is
                // gone, and the frame is replayed on its successor.
                let _ = live.sender.send(Command::Send(Frame::Text(text.to_owned())));
            }
        }
    }

    // ---- the control socket --------------------------------------------

    /// Decides an upgrade request. Scripted answers come first; side
    /// effects of an admission (revoking the standby credential) happen
    /// only when the request really is an upgrade.
    pub(crate) fn admit(&mut self, headers: &HeaderMap, is_upgrade: bool) -> Admission {
        let at = Instant::now();
        let bearer = bearer(headers);
        let credential = bearer.as_ref().map_or(Credential::Unknown, |token| self.identify(token));
        let kind = credential.kind();
        let admission = self.decide(well_formed(headers, bearer.as_ref()), &credential, is_upgrade, at);
        let (status, scripted) = match &admission {
            (Admission::Reject { status, .. }, scripted) => (*status, *scripted),
            (Admission::Admit { .. }, _) => (101, false),
        };
        self.records.upgrades.push(UpgradeRecord { at, credential: kind, status, scripted });
        admission.0
    }

    fn decide(
        &mut self,
        bearer: Result<String, String>,
        credential: &Credential,
        is_upgrade: bool,
        at: Instant,
    ) -> (Admission, bool) {
        let kind = credential.kind();
        if let Some(position) =
            self.upgrade_script.iter().position(|script| script.credential.is_none() || script.credential == kind)
        {
            let script = self.upgrade_script.remove(position).expect("position is in range");
            let reject = Admission::Reject {
                status: script.status,
                retry_after: script.retry_after,
                reason: "scripted answer".to_owned(),
            };
            return (reject, true);
        }
        let reject = |status: u16, reason: &str| {
            (Admission::Reject { status, retry_after: None, reason: reason.to_owned() }, false)
        };
        let token = match bearer {
            Ok(token) => token,
            Err(reason) => return reject(400, &reason),
        };
        match credential {
            Credential::Unknown if token.starts_with(STANDBY_PREFIX) => reject(410, "unknown standby"),
            Credential::Unknown => reject(401, "unknown credential"),
            Credential::Standby(token) => {
                let status = self.standbys.get(token).map(|standby| standby.status);
                match status {
                    Some(StandbyStatus::Active) if !is_upgrade => reject(400, "not a WebSocket upgrade"),
                    Some(StandbyStatus::Active) => (
                        Admission::Admit {
                            credential: CredentialKind::Standby,
                            standby_token: token.clone(),
                            execution_id: None,
                        },
                        false,
                    ),
                    Some(StandbyStatus::Revoked) => reject(401, "standby credential revoked"),
                    Some(StandbyStatus::Retired | StandbyStatus::Expired) | None => {
                        reject(410, "standby retired or expired")
                    }
                }
            }
            Credential::Run(execution_id) => {
                let Some(record) = self.records.executions.get_mut(execution_id) else {
                    return reject(401, "unknown execution");
                };
                if record.revoked.is_some() {
                    let status = self.revoked_run_status;
                    return reject(status, "run credential revoked");
                }
                if !is_upgrade {
                    return reject(400, "not a WebSocket upgrade");
                }
                record.confirmed_at.get_or_insert(at);
                let standby_token = record.standby_token.clone();
                if let Some(standby) = self.standbys.get_mut(&standby_token) {
                    standby.status = StandbyStatus::Revoked;
                }
                (
                    Admission::Admit {
                        credential: CredentialKind::Run,
                        standby_token,
                        execution_id: Some(execution_id.clone()),
                    },
                    false,
                )
            }
        }
    }

    /// Registers an upgraded connection and returns what it is sent first:
    /// the pending assignment, replayed.
    pub(crate) fn register(
        &mut self,
        credential: CredentialKind,
        standby_token: &str,
        execution_id: Option<String>,
        sender: mpsc::UnboundedSender<Command>,
    ) -> (ConnectionId, Option<String>) {
        self.next_connection += 1;
        let id = ConnectionId(self.next_connection);
        let replay = match credential {
            CredentialKind::Standby => self
                .standbys
                .get(standby_token)
                .filter(|standby| standby.status == StandbyStatus::Active)
                .and_then(|standby| standby.execution.as_ref())
                .filter(|execution_id| {
                    self.records
                        .executions
                        .get(*execution_id)
                        .is_some_and(|record| record.revoked.is_none() && record.confirmed_at.is_none())
                })
                .and_then(|execution_id| self.executions.get(execution_id)),
            CredentialKind::Run => execution_id
                .as_ref()
                .filter(|execution_id| {
                    self.records.executions.get(*execution_id).is_some_and(|record| record.revoked.is_none())
                })
                .and_then(|execution_id| self.executions.get(execution_id)),
        }
        .map(|execution| execution.assignment.clone());
        self.live.insert(id, Live { sender, standby_token: standby_token.to_owned() });
        self.records.connections.push(ConnectionRecord {
            id,
            credential,
            standby_token: standby_token.to_owned(),
            execution_id,
            opened_at: Instant::now(),
            closed_at: None,
            close: None,
            pongs: 0,
        });
        (id, replay)
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

    pub(crate) fn violation(&mut self, message: String) {
        self.records.violations.push(message);
    }

    /// The agent sends only heartbeats; anything else is a violation.
    pub(crate) fn text_received(&mut self, id: ConnectionId, text: &str) {
        let at = Instant::now();
        let Some(connection) = self.records.connection(id).cloned() else {
            return;
        };
        match serde_json::from_str::<AgentMessage>(text) {
            Ok(AgentMessage::Heartbeat { state, execution_id }) => {
                if let Some(named) = &execution_id {
                    let belongs = self
                        .records
                        .executions
                        .get(named)
                        .is_some_and(|record| record.standby_token == connection.standby_token);
                    if !belongs {
                        self.violation(format!("heartbeat on {id} names execution {named:?}, not this sandbox's"));
                    }
                }
                self.records.heartbeats.push(HeartbeatRecord {
                    connection: id,
                    credential: connection.credential,
                    state,
                    execution_id,
                    at,
                });
            }
            Err(error) => self.violation(format!("{id} sent a text frame that is not a heartbeat ({error}): {text}")),
        }
    }

    pub(crate) fn send(&self, id: ConnectionId, command: Command) -> Result<(), ServerError> {
        self.live
            .get(&id)
            .ok_or(ServerError::NoSuchConnection(id))?
            .sender
            .send(command)
            .map_err(|_| ServerError::NoSuchConnection(id))
    }

    pub(crate) fn live_connections(&self) -> Vec<ConnectionId> {
        self.live.keys().copied().collect()
    }

    pub(crate) fn shutdown(&mut self) {
        for live in self.live.values() {
            let _ = live.sender.send(Command::Drop);
        }
    }

    // ---- HTTP --------------------------------------------------------------

    /// Answers one HTTP call and records it.
    pub(crate) fn http(&mut self, request: &HttpRequest<'_>, started: Instant) -> HttpAnswer {
        let bearer = bearer(request.headers);
        let credential = bearer.as_ref().map_or(Credential::Unknown, |token| self.identify(token));
        let answer = match well_formed(request.headers, bearer.as_ref()) {
            Err(reason) => HttpAnswer::error(400, &reason),
            Ok(token) => match self.authorize(request, &token, &credential) {
                Err(status) => HttpAnswer::error(status, "credential refused"),
                Ok(()) => self.scripted_failure(request.endpoint).unwrap_or_else(|| self.answer(request)),
            },
        };
        self.records.http_calls.push(HttpCallRecord {
            endpoint: request.endpoint,
            method: request.method.to_owned(),
            path: request.path.to_owned(),
            execution_id: request.execution_id.map(str::to_owned),
            credential: credential.kind(),
            status: answer.status,
            started,
            ended: Instant::now(),
            event_id: (request.endpoint == Endpoint::Events).then(|| event_id(request.body)).flatten(),
        });
        answer
    }

    fn authorize(&self, request: &HttpRequest<'_>, token: &str, credential: &Credential) -> Result<(), u16> {
        match (request.endpoint, credential) {
            (Endpoint::Spec, Credential::Standby(token)) => {
                match self.standbys.get(token).map(|standby| standby.status) {
                    Some(StandbyStatus::Active) => Ok(()),
                    Some(StandbyStatus::Revoked) => Err(401),
                    _ => Err(410),
                }
            }
            (Endpoint::Spec, Credential::Unknown) if token.starts_with(STANDBY_PREFIX) => Err(410),
            (Endpoint::Spec, _) => Err(401),
            (endpoint, Credential::Run(execution_id)) if Some(execution_id.as_str()) == request.execution_id => {
                let revoked = self.records.executions.get(execution_id).is_some_and(|r| r.revoked.is_some());
                let report = matches!(endpoint, Endpoint::Events | Endpoint::Log);
                if revoked && !(report && self.reports_after_revocation) {
                    Err(self.revoked_run_status)
                } else {
                    Ok(())
                }
            }
            _ => Err(401),
        }
    }

    fn scripted_failure(&mut self, endpoint: Endpoint) -> Option<HttpAnswer> {
        let failure = self.failures.get_mut(&endpoint)?;
        match &mut failure.remaining {
            Some(0) => {
                self.failures.remove(&endpoint);
                return None;
            }
            Some(remaining) => *remaining -= 1,
            None => {}
        }
        let mut answer = HttpAnswer::error(failure.status, "scripted failure");
        answer.retry_after = failure.retry_after;
        Some(answer)
    }

    fn answer(&mut self, request: &HttpRequest<'_>) -> HttpAnswer {
        if request.endpoint == Endpoint::Spec {
            return match &self.spec {
                Some(spec) => HttpAnswer::json(200, spec),
                None => HttpAnswer::error(404, "no spec configured"),
            };
        }
        let execution_id = request.execution_id.unwrap_or_default().to_owned();
        let Some(execution) = self.executions.get(&execution_id) else {
            return HttpAnswer::error(404, "no such execution");
        };
        let setup = &execution.setup;
        let secrets = |map: &BTreeMap<String, String>| {
            map.iter().map(|(name, value)| (name.clone(), Secret::new(value.clone()))).collect()
        };
        match request.endpoint {
            Endpoint::Secrets => HttpAnswer::json(200, &SecretsResponse { secrets: secrets(&setup.secrets) }),
            Endpoint::Attachments => {
                HttpAnswer::json(200, &AttachmentsResponse { attachments: listed_attachments(&execution_id, setup) })
            }
            Endpoint::AttachmentFile => {
                match setup.attachments.iter().find(|attachment| Some(attachment.name.as_str()) == request.attachment) {
                    Some(attachment) => HttpAnswer {
                        status: 200,
                        content_type: "application/octet-stream",
                        body: attachment.content.clone(),
                        retry_after: None,
                    },
                    None => HttpAnswer::error(404, "no such attachment"),
                }
            }
            Endpoint::GitCredentials => {
                HttpAnswer::json(200, &GitCredentialsResponse { credentials: setup.git_credentials.clone() })
            }
            Endpoint::Metadata => HttpAnswer::json(200, &setup.metadata),
            Endpoint::CloudCredentials => {
                HttpAnswer::json(200, &CloudCredentialsResponse { env: secrets(&setup.cloud_env) })
            }
            Endpoint::Events => self.event(&execution_id, request.body),
            Endpoint::Log => self.log_chunk(&execution_id, request.body),
            Endpoint::Spec => HttpAnswer::error(404, "unreachable"),
        }
    }

    fn event(&mut self, execution_id: &str, body: &[u8]) -> HttpAnswer {
        let event: Event = match serde_json::from_slice(body) {
            Ok(event) => event,
            Err(error) => {
                self.violation(format!(
                    "malformed event for {execution_id} ({error}): {}",
                    String::from_utf8_lossy(body)
                ));
                return HttpAnswer::error(400, "malformed event");
            }
        };
        let mut violations = Vec::new();
        let Some(record) = self.records.executions.get_mut(execution_id) else {
            return HttpAnswer::error(404, "no such execution");
        };
        record.event_posts += 1;
        if let Some(known) = record.events.iter().find(|known| known.event_id == event.event_id) {
            if *known != event {
                violations.push(format!(
                    "event_id {:?} of {execution_id} reused for a different event: {known:?} then {event:?}",
                    event.event_id
                ));
            }
        } else {
            let kind = event_type(&event.kind);
            let started = record.has_event("started");
            let finished = record.has_event("exited") || record.has_event("install_failed");
            match &event.kind {
                EventKind::Started if record.confirmed_at.is_none() => {
                    violations.push(format!("{execution_id} started before its delivery was confirmed"));
                }
                EventKind::Started if started => violations.push(format!("{execution_id} started twice")),
                EventKind::Exited { .. } if !started => {
                    violations.push(format!("{execution_id} reported exited without started"));
                }
                EventKind::InstallFailed { .. } if started => {
                    violations.push(format!("{execution_id} reported install_failed after started"));
                }
                _ => {}
            }
            if finished {
                violations.push(format!("{execution_id} reported {kind} after its end"));
            }
            record.events.push(event);
        }
        for violation in violations {
            self.violation(violation);
        }
        HttpAnswer::json(202, &serde_json::json!({}))
    }

    /// Takes a chunk by the contract's ledger rule
    /// ([`log_ledger::accept`], amendment 6): appended after any declared
    /// gap, a retry acknowledged without storing its bytes twice, anything
    /// else answered `409` with `{"received": n}`, a violation unless the
    /// test made the server forget part of the log. A retry whose bytes
    /// differ from those received is a violation too.
    fn log_chunk(&mut self, execution_id: &str, body: &[u8]) -> HttpAnswer {
        let chunk = serde_json::from_slice::<LogChunk>(body)
            .map_err(|error| error.to_string())
            .and_then(|chunk| chunk.bytes().map(|bytes| (chunk, bytes)).map_err(|error| error.to_string()));
        let (chunk, bytes) = match chunk {
            Ok(chunk) => chunk,
            Err(error) => {
                self.violation(format!("malformed log chunk for {execution_id}: {error}"));
                return HttpAnswer::error(400, "malformed log chunk");
            }
        };
        let Some(record) = self.records.executions.get_mut(execution_id) else {
            return HttpAnswer::error(404, "no such execution");
        };
        let (offset, dropped, received) = (chunk.offset, chunk.dropped, record.log_received);
        let len = bytes.len() as u64;
        let verdict = log_ledger::accept(received, offset, dropped, len);
        // Stored bytes since the last gap map one to one onto offsets: a
        // retry's bytes that are already held must be the same ones.
        let gap_end = record.log_gaps.last().map_or(0, |(at, dropped)| at + dropped);
        let overlap = usize::try_from(received.saturating_sub(offset).min(len)).unwrap_or(usize::MAX);
        let held = usize::try_from(received.saturating_sub(offset))
            .ok()
            .and_then(|back| record.log.len().checked_sub(back))
            .and_then(|start| record.log.get(start..start + overlap));
        let problem = match verdict {
            Verdict::Conflict => Some(format!(
                "log chunk of {execution_id} at offset {offset} (dropped {dropped}) does not follow the {received} bytes received"
            )),
            _ if offset >= gap_end && held.is_some_and(|held| held != &bytes[..overlap]) => {
                Some(format!("log chunk of {execution_id} at offset {offset} rewrites bytes already received"))
            }
            Verdict::Append { gap, skip, end } => {
                if gap > 0 {
                    record.log_gaps.push((received, gap));
                }
                record.log.extend_from_slice(&bytes[usize::try_from(skip).unwrap_or(usize::MAX).min(bytes.len())..]);
                record.log_received = end;
                None
            }
            Verdict::Duplicate => None,
        };
        let conflict = |record: &ExecutionRecord| HttpAnswer::json(409, &LogReceived { received: record.log_received });
        if let Some(problem) = problem {
            let answer = conflict(record);
            if !record.log_forgotten {
                self.violation(problem);
            }
            return answer;
        }
        record.log_posts += 1;
        record.log_chunks.push((offset, bytes.len()));
        HttpAnswer::json(200, &serde_json::json!({ "offset": record.log_received }))
    }

    /// Forgets all but the first `keep` bytes of an execution's log, as a
    /// server restored from an older snapshot would.
    pub(crate) fn forget_log(&mut self, execution_id: &str, keep: u64) -> Result<(), ServerError> {
        let record = self
            .records
            .executions
            .get_mut(execution_id)
            .ok_or_else(|| ServerError::UnknownExecution(execution_id.to_owned()))?;
        let keep = keep.min(record.log_received);
        record.log_gaps.retain(|(at, _)| *at < keep);
        let in_gaps: u64 = record.log_gaps.iter().map(|(at, dropped)| (*dropped).min(keep - at)).sum();
        record.log.truncate(usize::try_from(keep - in_gaps).unwrap_or(usize::MAX));
        record.log_received = keep;
        record.log_forgotten = true;
        Ok(())
    }
}

/// The attachments of an execution as the attachments call answers them
/// (and an inline assignment lists them).
fn listed_attachments(execution_id: &str, setup: &ExecutionSetup) -> Vec<Attachment> {
    setup
        .attachments
        .iter()
        .map(|attachment| Attachment {
            name: attachment.name.clone(),
            url: attachment.url.clone().unwrap_or_else(|| {
                format!("{}/{}", standby_protocol::paths::attachments(execution_id), attachment.name)
            }),
            sha256: attachment.sha256.clone().unwrap_or_else(|| sha256_hex(&attachment.content)),
        })
        .collect()
}

/// The bearer credential, if the request carries one.
fn bearer(headers: &HeaderMap) -> Option<String> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .filter(|token| !token.is_empty())
        .map(str::to_owned)
}

/// The `event_id` of an event body, if it has one.
fn event_id(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    value.get("event_id")?.as_str().map(str::to_owned)
}

/// The credential of a well-formed request, or why it is malformed (`400`).
fn well_formed(headers: &HeaderMap, bearer: Option<&String>) -> Result<String, String> {
    let protocol = headers.get(PROTOCOL_HEADER).and_then(|value| value.to_str().ok());
    if protocol != Some(PROTOCOL_VERSION) {
        return Err(format!("header {PROTOCOL_HEADER}: {PROTOCOL_VERSION} missing (got {protocol:?})"));
    }
    bearer.cloned().ok_or_else(|| "header Authorization: Bearer <credential> missing".to_owned())
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|byte| format!("{byte:02x}")).collect()
}
