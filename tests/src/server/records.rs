//! What the server saw, kept so that tests assert on the wire traffic the
//! agent really produced instead of on the agent's own claims.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use standby_protocol::{AgentState, Event, EventKind};
use tokio::time::Instant;

/// Which kind of credential a request or connection carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CredentialKind {
    Standby,
    Run,
}

/// Server-assigned number of an accepted WebSocket connection, in order of
/// acceptance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(pub u64);

impl fmt::Display for ConnectionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// One `GET /ws` request and the status it was answered with.
#[derive(Debug, Clone)]
pub struct UpgradeRecord {
    pub at: Instant,
    /// `None` when the credential was missing or matched nothing.
    pub credential: Option<CredentialKind>,
    pub status: u16,
    /// The answer came from [`ScriptedUpgrade`](super::ScriptedUpgrade).
    pub scripted: bool,
}

/// How a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseCause {
    /// The agent sent a close frame (with its code, if any).
    ClientClose(Option<u16>),
    /// The stream ended or failed without a close frame.
    ClientGone(String),
    /// The test asked the server to close it with a close frame.
    ServerClose,
    /// The test asked the server to drop it without a close frame.
    ServerDrop,
    /// The server shut down.
    ServerShutdown,
}

/// One accepted WebSocket connection.
#[derive(Debug, Clone)]
pub struct ConnectionRecord {
    pub id: ConnectionId,
    pub credential: CredentialKind,
    /// The standby credential of the sandbox the connection belongs to.
    pub standby_token: String,
    /// Set for run-credential connections.
    pub execution_id: Option<String>,
    pub opened_at: Instant,
    pub closed_at: Option<Instant>,
    pub close: Option<CloseCause>,
    pub pongs: usize,
}

impl ConnectionRecord {
    pub fn is_open(&self) -> bool {
        self.closed_at.is_none()
    }
}

/// One heartbeat received.
#[derive(Debug, Clone)]
pub struct HeartbeatRecord {
    pub connection: ConnectionId,
    pub credential: CredentialKind,
    pub state: AgentState,
    pub execution_id: Option<String>,
    pub at: Instant,
}

/// The HTTP endpoints of the contract, for scripting and for records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoint {
    Spec,
    Secrets,
    Attachments,
    AttachmentFile,
    GitCredentials,
    Metadata,
    CloudCredentials,
    Events,
    Log,
}

impl Endpoint {
    /// The calls of the install's network group (step 3 of the contract),
    /// whose concurrency tests measure.
    pub fn is_install(self) -> bool {
        matches!(
            self,
            Self::Secrets
                | Self::Attachments
                | Self::AttachmentFile
                | Self::GitCredentials
                | Self::Metadata
                | Self::CloudCredentials
        )
    }

    /// Everything under `/v1/executions/{id}/`.
    pub fn is_execution(self) -> bool {
        !matches!(self, Self::Spec)
    }
}

/// One HTTP request, from arrival to answer.
#[derive(Debug, Clone)]
pub struct HttpCallRecord {
    pub endpoint: Endpoint,
    pub method: String,
    pub path: String,
    /// The execution named in the path.
    pub execution_id: Option<String>,
    /// The kind of credential presented, when it matched one.
    pub credential: Option<CredentialKind>,
    pub status: u16,
    pub started: Instant,
    pub ended: Instant,
    /// For `POST .../events`: the `event_id` of the body, whatever the
    /// answer, so a test sees retries of an event that were refused.
    pub event_id: Option<String>,
}

/// Why a run credential was revoked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revocation {
    Cancelled,
    Superseded,
    Requeued,
}

/// Everything reported against one execution.
#[derive(Debug, Clone)]
pub struct ExecutionRecord {
    pub execution_id: String,
    pub standby_token: String,
    /// Distinct events, deduplicated by `event_id`, in order of first receipt.
    pub events: Vec<Event>,
    /// Every accepted `POST .../events`, duplicates included.
    pub event_posts: usize,
    /// The run's output as reassembled from the log chunks.
    pub log: Vec<u8>,
    /// Every accepted `POST .../log`, retries included.
    pub log_posts: usize,
    /// `(offset, length)` of every accepted log chunk, in order of receipt.
    pub log_chunks: Vec<(u64, usize)>,
    /// The log's length in bytes of the run's output, recorded gaps
    /// included: what a `409` reports as `received`.
    pub log_received: u64,
    /// `(offset, dropped)` of every gap the agent reported (amendment 6).
    pub log_gaps: Vec<(u64, u64)>,
    /// The test made the server forget part of the log: the agent's next
    /// chunk may be a mismatch (answered `409`) without breaching anything.
    pub log_forgotten: bool,
    /// When the run credential first connected (delivery confirmed).
    pub confirmed_at: Option<Instant>,
    pub revoked: Option<Revocation>,
}

impl ExecutionRecord {
    pub fn has_event(&self, type_name: &str) -> bool {
        self.events.iter().any(|event| event_type(&event.kind) == type_name)
    }
}

/// The contract's `type` of an event kind.
pub fn event_type(kind: &EventKind) -> &'static str {
    match kind {
        EventKind::Started => "started",
        EventKind::Exited { .. } => "exited",
        EventKind::Cancelled => "cancelled",
        EventKind::InstallFailed { .. } => "install_failed",
    }
}

/// The details of an `install_failed` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallFailed {
    pub event_id: String,
    pub requeueable: bool,
    pub stage: String,
    pub message: String,
}

/// All observations of one server.
#[derive(Debug, Clone)]
pub struct Records {
    /// When the server started; the origin of the times in [`Records::summary`].
    pub started: Instant,
    pub upgrades: Vec<UpgradeRecord>,
    pub connections: Vec<ConnectionRecord>,
    pub heartbeats: Vec<HeartbeatRecord>,
    pub http_calls: Vec<HttpCallRecord>,
    pub executions: BTreeMap<String, ExecutionRecord>,
    /// Breaches of the contract by the client: a frame that is not a
    /// heartbeat, a malformed body, a log gap, a run started before its
    /// delivery was confirmed, ...
    pub violations: Vec<String>,
}

impl Records {
    pub(crate) fn new() -> Self {
        Self {
            started: Instant::now(),
            upgrades: Vec::new(),
            connections: Vec::new(),
            heartbeats: Vec::new(),
            http_calls: Vec::new(),
            executions: BTreeMap::new(),
            violations: Vec::new(),
        }
    }

    pub fn connection(&self, id: ConnectionId) -> Option<&ConnectionRecord> {
        self.connections.iter().find(|connection| connection.id == id)
    }

    /// Heartbeats received on one connection, in order.
    pub fn heartbeats_on(&self, id: ConnectionId) -> Vec<&HeartbeatRecord> {
        self.heartbeats.iter().filter(|heartbeat| heartbeat.connection == id).collect()
    }

    /// Largest number of calls accepted by `filter` that were in flight at
    /// the same instant.
    pub fn max_concurrency(&self, filter: impl Fn(&HttpCallRecord) -> bool) -> usize {
        max_overlap(self.http_calls.iter().filter(|call| filter(call)).map(|call| (call.started, call.ended)))
    }

    /// A readable dump for timeout panics: everything, with times in
    /// milliseconds since the server started.
    pub fn summary(&self) -> String {
        let ms = |at: Instant| at.saturating_duration_since(self.started).as_millis();
        let mut out = String::new();
        let _ = writeln!(out, "upgrades ({}):", self.upgrades.len());
        for upgrade in tail(&self.upgrades) {
            let _ = writeln!(
                out,
                "  +{}ms {:?} -> {}{}",
                ms(upgrade.at),
                upgrade.credential,
                upgrade.status,
                if upgrade.scripted { " (scripted)" } else { "" }
            );
        }
        let _ = writeln!(out, "connections ({}):", self.connections.len());
        for connection in tail(&self.connections) {
            let _ = writeln!(
                out,
                "  {} {:?} exec={:?} opened +{}ms closed {:?} ({:?}) pongs={}",
                connection.id,
                connection.credential,
                connection.execution_id,
                ms(connection.opened_at),
                connection.closed_at.map(|at| format!("+{}ms", ms(at))),
                connection.close,
                connection.pongs
            );
        }
        let _ = writeln!(out, "heartbeats ({}):", self.heartbeats.len());
        for heartbeat in tail(&self.heartbeats) {
            let _ = writeln!(
                out,
                "  +{}ms on {} {:?} {:?} exec={:?}",
                ms(heartbeat.at),
                heartbeat.connection,
                heartbeat.credential,
                heartbeat.state,
                heartbeat.execution_id
            );
        }
        let _ = writeln!(out, "http calls ({}):", self.http_calls.len());
        for call in tail(&self.http_calls) {
            let _ = writeln!(
                out,
                "  +{}ms..+{}ms {} {} {:?} -> {}",
                ms(call.started),
                ms(call.ended),
                call.method,
                call.path,
                call.credential,
                call.status
            );
        }
        for execution in self.executions.values() {
            let _ = writeln!(
                out,
                "execution {}: confirmed={} revoked={:?} events={:?} event_posts={} log={}B in {} posts",
                execution.execution_id,
                execution.confirmed_at.is_some(),
                execution.revoked,
                execution.events,
                execution.event_posts,
                execution.log.len(),
                execution.log_posts
            );
        }
        let _ = writeln!(out, "violations: {:?}", self.violations);
        out
    }
}

/// The last entries of a list: a timeout message stays readable even after
/// thousands of heartbeats.
fn tail<T>(items: &[T]) -> &[T] {
    const SHOWN: usize = 30;
    &items[items.len().saturating_sub(SHOWN)..]
}

/// Sweep over interval ends; an interval that ends exactly when another
/// starts does not overlap it.
pub(crate) fn max_overlap(intervals: impl Iterator<Item = (Instant, Instant)>) -> usize {
    let mut edges: Vec<(Instant, i32)> = Vec::new();
    for (start, end) in intervals {
        edges.push((start, 1));
        edges.push((end, -1));
    }
    edges.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut current = 0_i32;
    let mut max = 0_i32;
    for (_, delta) in edges {
        current += delta;
        max = max.max(current);
    }
    usize::try_from(max).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn overlap_counts_intervals_in_flight_together() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let intervals = [(at(0), at(10)), (at(5), at(15)), (at(6), at(7)), (at(15), at(20))];
        assert_eq!(max_overlap(intervals.into_iter()), 3);
        assert_eq!(max_overlap([(at(0), at(5)), (at(5), at(9))].into_iter()), 1);
        assert_eq!(max_overlap(std::iter::empty()), 0);
    }
}
