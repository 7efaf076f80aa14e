//! What the server saw, kept so that tests assert on the wire traffic the
//! agent really produced instead of on the agent's own claims.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use standby_protocol::{AgentState, CredentialKind, Endpoint, Event, Standing};
use tokio::time::Instant;

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

impl Revocation {
    /// Where the run credential stands after it: a cancelled run still
    /// reports (1.1); a superseded or requeued one is fenced.
    pub fn standing(self) -> Standing {
        match self {
            Self::Cancelled => Standing::Finishing,
            Self::Superseded | Self::Requeued => Standing::Revoked,
        }
    }
}

/// Everything reported against one execution.
#[derive(Debug, Clone, Default)]
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

impl Default for Records {
    fn default() -> Self {
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
}

impl Records {
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
        section(&mut out, "upgrades", &self.upgrades, |upgrade| {
            let scripted = if upgrade.scripted { " (scripted)" } else { "" };
            format!("+{}ms {:?} -> {}{scripted}", ms(upgrade.at), upgrade.credential, upgrade.status)
        });
        section(&mut out, "connections", &self.connections, |connection| {
            format!(
                "{} {:?} exec={:?} opened +{}ms closed {:?} ({:?}) pongs={}",
                connection.id,
                connection.credential,
                connection.execution_id,
                ms(connection.opened_at),
                connection.closed_at.map(|at| format!("+{}ms", ms(at))),
                connection.close,
                connection.pongs
            )
        });
        section(&mut out, "heartbeats", &self.heartbeats, |heartbeat| {
            let HeartbeatRecord { connection, credential, state, execution_id, at } = heartbeat;
            format!("+{}ms on {connection} {credential:?} {state:?} exec={execution_id:?}", ms(*at))
        });
        section(&mut out, "http calls", &self.http_calls, |call| {
            let (start, end) = (ms(call.started), ms(call.ended));
            format!("+{start}ms..+{end}ms {} {} {:?} -> {}", call.method, call.path, call.credential, call.status)
        });
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

/// A titled list of the last entries of `items`, one line each: a timeout
/// message stays readable even after thousands of heartbeats.
fn section<T>(out: &mut String, title: &str, items: &[T], line: impl Fn(&T) -> String) {
    const SHOWN: usize = 30;
    let _ = writeln!(out, "{title} ({}):", items.len());
    for item in &items[items.len().saturating_sub(SHOWN)..] {
        let _ = writeln!(out, "  {}", line(item));
    }
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
