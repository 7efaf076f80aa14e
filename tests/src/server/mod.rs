//! `TestServer`: the server half of the contract over real HTTP and
//! WebSocket on 127.0.0.1, as a recorder and a fault injector.
//!
//! It records what the agent sent (upgrades, connections, heartbeats,
//! calls, events, log bytes) and breaches of the contract in
//! [`Records::violations`]; it injects the faults a test asks for (statuses,
//! delays, dropped connections, any frame, refusals). Everything else it
//! answers by the contract's rules as `standby_protocol` states them, so a
//! test passes only if the agent behaves against a real server.

mod calls;
mod http;
mod records;
mod setup;
mod socket;
mod state;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub use records::{
    CloseCause, ConnectionId, ConnectionRecord, ExecutionRecord, HeartbeatRecord, HttpCallRecord, InstallFailed,
    Records, Revocation, UpgradeRecord,
};
pub use setup::{AttachmentSetup, ExecutionSetup, Failure, Frame, ScriptedUpgrade, ServerError};
pub use standby_protocol::{CredentialKind, Endpoint};
use standby_protocol::{Event, EventKind, Spec};
pub use state::STANDBY_PREFIX;
use state::{Command, Shared};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A running contract server. Dropping it stops accepting and drops every
/// live connection.
#[derive(Debug)]
pub struct TestServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    serve: JoinHandle<()>,
}

impl TestServer {
    /// Binds 127.0.0.1:0 and serves on the current tokio runtime.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("a bound listener has an address");
        let shared = Arc::new(Shared::new());
        let router = http::router(Arc::clone(&shared));
        let serve = tokio::spawn(async move {
            // The server runs until the test drops it; an accept error here
            // would surface as the agent failing to connect.
            let _ = axum::serve(listener, router).await;
        });
        Self { addr, shared, serve }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL the agent is given (`STANDBY_SERVER_URL`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The control socket's URL.
    pub fn ws_url(&self) -> String {
        format!("ws://{}{}", self.addr, standby_protocol::SOCKET_PATH)
    }

    // ---- standbys and the spec ------------------------------------------

    /// Mints an active standby credential (`sby_…`).
    pub fn add_standby(&self) -> String {
        self.shared.update(|inner| inner.add_standby())
    }

    /// Sends `retired` on the standby's live connections; its credential is
    /// then answered `410`. Refused once the standby holds an assignment.
    pub fn retire(&self, token: &str, reason: Option<&str>) -> Result<(), ServerError> {
        self.shared.update(|inner| inner.retire(token, reason))
    }

    /// The standby credential expires: answered `410` from now on.
    pub fn expire(&self, token: &str) -> Result<(), ServerError> {
        self.shared.update(|inner| inner.expire(token))
    }

    /// What `GET /v1/standby/spec` answers (`404` until set).
    pub fn set_spec(&self, spec: &Spec) {
        self.set_spec_json(serde_json::to_value(spec).expect("a spec serializes"));
    }

    /// Like [`TestServer::set_spec`], for a spec the types cannot express.
    pub fn set_spec_json(&self, spec: serde_json::Value) {
        self.shared.update(|inner| inner.spec = Some(spec));
    }

    // ---- executions -----------------------------------------------------

    /// Commits a run to the standby and tells it: see [`TestServer::assign`].
    pub fn try_assign(&self, token: &str, setup: ExecutionSetup) -> Result<String, ServerError> {
        self.shared.update(|inner| inner.assign(token, setup))
    }

    /// Binds a new execution to the standby, mints its run credential, then
    /// sends the assignment on the standby's live connection and replays it
    /// on each later standby connection until the run credential connects.
    /// Returns the execution id. Panics where the contract forbids it.
    pub fn assign(&self, token: &str, setup: ExecutionSetup) -> String {
        self.try_assign(token, setup).unwrap_or_else(|error| panic!("assign: {error}"))
    }

    /// The assignment frame of an execution, exactly as the server sends
    /// and replays it, for a test that replays it again.
    pub fn assignment_frame(&self, execution_id: &str) -> Option<String> {
        self.shared.read(|inner| inner.assignment_frame(execution_id))
    }

    pub fn run_credential(&self, execution_id: &str) -> Option<String> {
        self.shared.read(|inner| inner.run_credential(execution_id))
    }

    /// Revokes the run credential first, then sends `cancel` on every live
    /// connection of the sandbox.
    pub fn cancel(&self, execution_id: &str) -> Result<(), ServerError> {
        self.shared.update(|inner| inner.cancel(execution_id))
    }

    /// Revokes the run credential without telling the sandbox (the run was
    /// superseded or requeued).
    pub fn revoke_run(&self, execution_id: &str, why: Revocation) -> Result<(), ServerError> {
        self.shared.update(|inner| inner.revoke_run(execution_id, why).map(drop))
    }

    // ---- fault injection ------------------------------------------------

    /// The status a withdrawn (revoked or cancelled) run credential is
    /// answered, on the upgrade and on every call it is refused, instead of
    /// the one [`standby_protocol::Standing::admits`] gives.
    pub fn set_revoked_run_status(&self, status: u16) {
        self.shared.update(|inner| inner.faults.withdrawn_run_status = Some(status));
    }

    /// Queues an answer for a coming upgrade request, consumed before any
    /// credential check by the first request it applies to.
    pub fn script_upgrade(&self, answer: ScriptedUpgrade) {
        self.shared.update(|inner| inner.faults.upgrades.push_back(answer));
    }

    /// Delay before answering every `/v1/executions/…` call.
    pub fn set_latency(&self, latency: Duration) {
        self.shared.update(|inner| inner.faults.execution_latency = Some(latency));
    }

    /// Delay before answering one endpoint; overrides [`TestServer::set_latency`].
    pub fn set_endpoint_latency(&self, endpoint: Endpoint, latency: Duration) {
        self.shared.update(|inner| inner.faults.latency.insert(endpoint, latency));
    }

    /// Makes an endpoint fail (after the credential check) as `failure` says.
    pub fn fail(&self, endpoint: Endpoint, failure: Failure) {
        self.shared.update(|inner| inner.faults.failures.insert(endpoint, failure));
    }

    pub fn clear_failures(&self) {
        self.shared.update(|inner| inner.faults.failures.clear());
    }

    /// Forgets all but the first `keep` bytes of an execution's log (as a
    /// server restored from a snapshot would): the agent's next chunk is
    /// answered `409` with `{"received": keep}`.
    pub fn forget_log(&self, execution_id: &str, keep: u64) -> Result<(), ServerError> {
        self.shared.update(|inner| inner.forget_log(execution_id, keep))
    }

    /// Pings every connection opened from now on every `every`.
    pub fn set_ping_interval(&self, every: Option<Duration>) {
        self.shared.update(|inner| inner.faults.ping_interval = every);
    }

    /// Pings one live connection every `every` (`None` stops).
    pub fn ping_every(&self, connection: ConnectionId, every: Option<Duration>) -> Result<(), ServerError> {
        self.shared.read(|inner| inner.send(connection, Command::PingEvery(every)))
    }

    /// Sends any frame, legal or not, on a live connection.
    pub fn send(&self, connection: ConnectionId, frame: Frame) -> Result<(), ServerError> {
        self.shared.read(|inner| inner.send(connection, Command::Send(frame)))
    }

    pub fn send_text(&self, connection: ConnectionId, text: &str) -> Result<(), ServerError> {
        self.send(connection, Frame::Text(text.to_owned()))
    }

    /// Drops a live connection without a close frame.
    pub fn drop_connection(&self, connection: ConnectionId) -> Result<(), ServerError> {
        self.shared.read(|inner| inner.send(connection, Command::Drop))
    }

    // ---- observations ---------------------------------------------------

    /// A copy of everything observed so far.
    pub fn records(&self) -> Records {
        self.shared.read(|inner| inner.records.clone())
    }

    pub fn heartbeats(&self) -> Vec<HeartbeatRecord> {
        self.shared.read(|inner| inner.records.heartbeats.clone())
    }

    pub fn connections(&self) -> Vec<ConnectionRecord> {
        self.shared.read(|inner| inner.records.connections.clone())
    }

    pub fn upgrades(&self) -> Vec<UpgradeRecord> {
        self.shared.read(|inner| inner.records.upgrades.clone())
    }

    pub fn http_calls(&self) -> Vec<HttpCallRecord> {
        self.shared.read(|inner| inner.records.http_calls.clone())
    }

    pub fn violations(&self) -> Vec<String> {
        self.shared.read(|inner| inner.records.violations.clone())
    }

    /// Panics with the records when the agent breached the contract.
    pub fn assert_no_violations(&self) {
        let records = self.records();
        assert!(records.violations.is_empty(), "contract violations:\n{}", records.summary());
    }

    pub fn execution(&self, execution_id: &str) -> Option<ExecutionRecord> {
        self.shared.read(|inner| inner.records.executions.get(execution_id).cloned())
    }

    /// Distinct events of an execution, in order of first receipt.
    pub fn events(&self, execution_id: &str) -> Vec<Event> {
        self.execution(execution_id).map(|record| record.events).unwrap_or_default()
    }

    /// The run's output as reassembled from log chunks.
    pub fn log(&self, execution_id: &str) -> Vec<u8> {
        self.execution(execution_id).map(|record| record.log).unwrap_or_default()
    }

    pub fn install_failures(&self, execution_id: &str) -> Vec<InstallFailed> {
        self.events(execution_id)
            .into_iter()
            .filter_map(|event| match event.kind {
                EventKind::InstallFailed { requeueable, stage, message } => {
                    Some(InstallFailed { event_id: event.event_id, requeueable, stage, message })
                }
                _ => None,
            })
            .collect()
    }

    /// Largest number of calls accepted by `filter` in flight at once.
    pub fn max_concurrency(&self, filter: impl Fn(&HttpCallRecord) -> bool) -> usize {
        self.shared.read(|inner| inner.records.max_concurrency(filter))
    }

    // ---- waiting --------------------------------------------------------

    /// Timeout of every `wait_*` call (default 30 s).
    pub fn set_wait_timeout(&self, timeout: Duration) {
        self.shared.update(|inner| inner.wait_timeout = Some(timeout));
    }

    /// Waits until `check` finds what it looks for in the records, woken by
    /// every change instead of polling. Panics after the wait timeout with
    /// `what` and a summary of everything observed. `check` runs under the
    /// server's lock: it must not call back into the server.
    pub async fn wait_until<T>(&self, what: &str, mut check: impl FnMut(&Records) -> Option<T>) -> T {
        let mut changed = self.shared.subscribe();
        let timeout = self.shared.read(|inner| inner.wait_timeout).unwrap_or(Duration::from_secs(30));
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(found) = self.shared.read(|inner| check(&inner.records)) {
                return found;
            }
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => panic!("test server state dropped while waiting for {what}"),
                Err(_) => {
                    let summary = self.shared.read(|inner| inner.records.summary());
                    panic!("timed out after {timeout:?} waiting for {what}; the server saw:\n{summary}");
                }
            }
        }
    }

    /// The first heartbeat (already received or to come) matching `matches`.
    pub async fn wait_for_heartbeat(&self, matches: impl Fn(&HeartbeatRecord) -> bool) -> HeartbeatRecord {
        self.wait_until("a matching heartbeat", |records| {
            records.heartbeats.iter().find(|heartbeat| matches(heartbeat)).cloned()
        })
        .await
    }

    /// The first `count` heartbeats matching `matches`.
    pub async fn wait_for_heartbeats(
        &self,
        count: usize,
        matches: impl Fn(&HeartbeatRecord) -> bool,
    ) -> Vec<HeartbeatRecord> {
        self.wait_until(&format!("{count} matching heartbeats"), |records| {
            let found: Vec<_> =
                records.heartbeats.iter().filter(|heartbeat| matches(heartbeat)).take(count).cloned().collect();
            (found.len() == count).then_some(found)
        })
        .await
    }

    /// The first connection (open or closed) matching `matches`.
    pub async fn wait_for_connection(&self, matches: impl Fn(&ConnectionRecord) -> bool) -> ConnectionRecord {
        self.wait_until("a matching connection", |records| {
            records.connections.iter().find(|connection| matches(connection)).cloned()
        })
        .await
    }

    /// The `count`-th connection (1-based), in order of acceptance.
    pub async fn wait_for_connections(&self, count: usize) -> Vec<ConnectionRecord> {
        self.wait_until(&format!("{count} connections"), |records| {
            (records.connections.len() >= count).then(|| records.connections[..count].to_vec())
        })
        .await
    }

    /// Waits until a connection has ended.
    pub async fn wait_for_close(&self, connection: ConnectionId) -> ConnectionRecord {
        self.wait_until(&format!("connection {connection} to close"), |records| {
            records.connection(connection).filter(|record| !record.is_open()).cloned()
        })
        .await
    }

    /// The first event reported for the execution whose kind matches
    /// `matches` (`|kind| matches!(kind, EventKind::Exited { .. })`).
    pub async fn wait_for_event(&self, execution_id: &str, matches: impl Fn(&EventKind) -> bool) -> Event {
        self.wait_until(&format!("a matching event for {execution_id}"), |records| {
            records.executions.get(execution_id)?.events.iter().find(|event| matches(&event.kind)).cloned()
        })
        .await
    }

    /// Waits until the execution's log contains `needle`; returns the log.
    pub async fn wait_for_log(&self, execution_id: &str, needle: &[u8]) -> Vec<u8> {
        let what = format!("{:?} in the log of {execution_id}", String::from_utf8_lossy(needle));
        self.wait_until(&what, |records| {
            let log = &records.executions.get(execution_id)?.log;
            (needle.is_empty() || log.windows(needle.len()).any(|window| window == needle)).then(|| log.clone())
        })
        .await
    }

    /// The first HTTP call matching `matches`, answered.
    pub async fn wait_for_http_call(&self, matches: impl Fn(&HttpCallRecord) -> bool) -> HttpCallRecord {
        self.wait_until("a matching HTTP call", |records| records.http_calls.iter().find(|call| matches(call)).cloned())
            .await
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.serve.abort();
        self.shared.update(|inner| inner.shutdown());
    }
}
