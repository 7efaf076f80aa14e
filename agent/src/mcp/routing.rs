//! Which client session a stdio server's request goes to: a pure decision
//! over what the bridge knows, tested without IO.
//!
//! A server's request (sampling, roots, elicitation) carries no mark of the
//! client request that caused it: on stdio, every client's requests arrive
//! on one pipe under the bridge's ids. So the bridge routes by what it
//! knows of each session: which capabilities its client declared, whether
//! it has a request in flight at this server, when that request was sent,
//! whether its event stream is open, and when it was last active. The rule
//! is written out in docs/protocol.md ("Requests from a server").

use serde_json::Value;
use standby_protocol::McpClientCapability;

/// The client capability a server's request needs, by its method; `None`
/// for a method no client of the bridge is known to serve (the bridge
/// answers it with "method not found" rather than guess a client).
pub(super) fn needs(method: &str) -> Option<McpClientCapability> {
    match method {
        "sampling/createMessage" => Some(McpClientCapability::Sampling),
        "roots/list" => Some(McpClientCapability::Roots),
        "elicitation/create" => Some(McpClientCapability::Elicitation),
        _ => None,
    }
}

/// The capabilities a client declared in its `initialize` params (a
/// capability is declared by any non-null value under its name).
pub(super) fn declared_by(initialize_params: Option<&Value>) -> Vec<McpClientCapability> {
    let capabilities = initialize_params.and_then(|params| params.get("capabilities"));
    McpClientCapability::ALL
        .into_iter()
        .filter(|capability| {
            capabilities.and_then(|caps| caps.get(name(*capability))).is_some_and(|value| !value.is_null())
        })
        .collect()
}

/// A capability's name in MCP's `ClientCapabilities`.
pub(super) fn name(capability: McpClientCapability) -> &'static str {
    match capability {
        McpClientCapability::Sampling => "sampling",
        McpClientCapability::Roots => "roots",
        McpClientCapability::Elicitation => "elicitation",
    }
}

/// What the bridge knows of one session when a server's request arrives;
/// `T` is a point in time.
#[derive(Debug, Clone)]
pub(super) struct Candidate<K, T> {
    pub(super) session: K,
    /// Whether its client declared the capability the request needs.
    pub(super) declared: bool,
    /// When its latest request still in flight at this server was sent.
    pub(super) in_flight_since: Option<T>,
    /// Whether its event stream is open (a request for a session without
    /// one waits in its queue until the client opens it).
    pub(super) stream_open: bool,
    pub(super) last_used: T,
}

/// The session a server's request goes to, or `None` when no session
/// declared the capability it needs (the bridge then answers the server
/// itself). Among the sessions that declared it:
///
/// 1. one with a request in flight at this server comes before any with
///    nothing in flight (the request most likely serves a call being
///    made); among several, the one whose in-flight request was sent last;
/// 2. then one whose stream is open;
/// 3. then the most recently active.
///
/// A session that did not declare the capability is never chosen, however
/// recently it was active.
pub(super) fn route<K: Clone, T: Ord + Copy>(candidates: &[Candidate<K, T>]) -> Option<K> {
    candidates
        .iter()
        .filter(|candidate| candidate.declared)
        .max_by_key(|candidate| {
            (candidate.in_flight_since.is_some(), candidate.in_flight_since, candidate.stream_open, candidate.last_used)
        })
        .map(|candidate| candidate.session.clone())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn candidate(
        session: &'static str,
        declared: bool,
        in_flight_since: Option<u32>,
        last_used: u32,
    ) -> Candidate<&'static str, u32> {
        Candidate { session, declared, in_flight_since, stream_open: true, last_used }
    }

    #[test]
    fn the_session_with_a_request_in_flight_wins_over_a_more_recently_active_one() {
        // The case: A calls a tool that samples later; meanwhile B
        // (which declared nothing) makes a request and is the most recent.
        let a = candidate("a", true, Some(10), 10);
        let b = candidate("b", false, None, 20);
        assert_eq!(route(&[a.clone(), b.clone()]), Some("a"));
        // Even when B declared the capability and is active later, A's call
        // in flight decides.
        let b = Candidate { declared: true, ..b };
        assert_eq!(route(&[b, a]), Some("a"));
    }

    #[test]
    fn a_session_that_did_not_declare_the_capability_is_never_chosen() {
        let busy = candidate("busy", false, Some(30), 30);
        let idle = candidate("idle", false, None, 40);
        assert_eq!(route(&[busy, idle]), None, "nobody declared it: the bridge answers");
        assert_eq!(route::<&str, u32>(&[]), None, "no session at all");
    }

    #[test]
    fn among_several_in_flight_the_latest_sent_request_wins() {
        let early = candidate("early", true, Some(5), 50);
        let late = candidate("late", true, Some(9), 9);
        let idle = candidate("idle", true, None, 60);
        assert_eq!(route(&[early, late, idle]), Some("late"));
    }

    #[test]
    fn with_nothing_in_flight_an_open_stream_then_the_most_recently_active_wins() {
        let recent_without_stream = Candidate { stream_open: false, ..candidate("recent", true, None, 9) };
        let older_with_stream = candidate("older", true, None, 5);
        let oldest_with_stream = candidate("oldest", true, None, 1);
        assert_eq!(route(&[oldest_with_stream, recent_without_stream.clone(), older_with_stream]), Some("older"));
        assert_eq!(route(&[recent_without_stream]), Some("recent"), "it waits for its stream");
        // A session whose request is in flight is chosen even before it
        // opened its stream (its client opens it right after initialize).
        let streamless_caller = Candidate { stream_open: false, ..candidate("caller", true, Some(3), 3) };
        assert_eq!(route(&[candidate("other", true, None, 8), streamless_caller]), Some("caller"));
    }

    #[test]
    fn methods_map_to_the_capability_they_need() {
        assert_eq!(needs("sampling/createMessage"), Some(McpClientCapability::Sampling));
        assert_eq!(needs("roots/list"), Some(McpClientCapability::Roots));
        assert_eq!(needs("elicitation/create"), Some(McpClientCapability::Elicitation));
        assert_eq!(needs("standby/unknown"), None);
        assert_eq!(needs("ping"), None, "the bridge answers pings itself, before routing");
    }

    #[test]
    fn a_capability_is_declared_by_any_value_but_null() {
        use McpClientCapability::{Elicitation, Roots, Sampling};
        let params = json!({"capabilities": {"sampling": {}, "roots": {"listChanged": true}, "elicitation": null}});
        assert_eq!(declared_by(Some(&params)), [Sampling, Roots]);
        assert_eq!(declared_by(Some(&json!({"capabilities": {"elicitation": {"form": {}}}}))), [Elicitation]);
        assert_eq!(declared_by(Some(&json!({"capabilities": {}}))), []);
        assert_eq!(declared_by(Some(&json!({}))), [], "no capabilities at all");
        assert_eq!(declared_by(None), []);
    }
}
