//! `/metrics` in the Prometheus text exposition format, rendered from the
//! state machine's records at scrape time: nothing to lose in a restart,
//! since the records are what the store keeps. The one exception is the
//! count of refused duplicate connections, kept in memory: a counter that
//! starts over with the process, as Prometheus counters may.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use crate::listener::ListenerStats;
use crate::model::{RunPath, RunState};
use crate::rules::{Histogram, MetricsSnapshot};

pub fn render(snapshot: &MetricsSnapshot) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = render_into(&mut out, snapshot);
    out
}

fn render_into(out: &mut String, snapshot: &MetricsSnapshot) -> std::fmt::Result {
    writeln!(out, "# HELP standby_runs Runs by state and by the path of their latest attempt (none: never bound).")?;
    writeln!(out, "# TYPE standby_runs gauge")?;
    for state in RunState::ALL {
        for path in std::iter::once(None).chain(RunPath::ALL.map(Some)) {
            let count = snapshot.runs.get(&(state, path)).copied().unwrap_or(0);
            let path = path.map_or("none", RunPath::as_str);
            writeln!(out, "standby_runs{{state=\"{}\",path=\"{path}\"}} {count}", state.as_str())?;
        }
    }
    writeln!(out, "# HELP standby_assignment_to_start_seconds From the assignment frame written to the run started.")?;
    writeln!(out, "# TYPE standby_assignment_to_start_seconds histogram")?;
    let seconds: Vec<f64> = snapshot.assignment_to_start_ms.iter().map(|ms| *ms as f64 / 1000.0).collect();
    let past = &snapshot.assignment_to_start_past;
    for (index, bound) in Histogram::BUCKETS.into_iter().enumerate() {
        let count = seconds.iter().filter(|s| **s <= bound).count() as u64 + past.cumulative(index);
        writeln!(out, "standby_assignment_to_start_seconds_bucket{{le=\"{bound}\"}} {count}")?;
    }
    let count = seconds.len() as u64 + past.count();
    let sum = seconds.iter().sum::<f64>() + past.sum_ms() as f64 / 1000.0;
    writeln!(out, "standby_assignment_to_start_seconds_bucket{{le=\"+Inf\"}} {count}")?;
    writeln!(out, "standby_assignment_to_start_seconds_sum {sum}")?;
    writeln!(out, "standby_assignment_to_start_seconds_count {count}")?;
    let scalars = [
        (
            "standby_connected_standbys",
            "gauge",
            "Sandboxes with a live control connection on their standby credential.",
            snapshot.connected_standbys,
        ),
        ("standby_sandboxes", "gauge", "Sandboxes not retired.", snapshot.sandboxes_live),
        (
            "standby_sandboxes_running",
            "gauge",
            "Sandboxes costing compute (a process exists or is being started): what the running cap bounds.",
            snapshot.sandboxes_running,
        ),
        ("standby_running_cap", "gauge", "The running cap (0: none).", snapshot.running_cap),
        (
            "standby_runs_in_memory",
            "gauge",
            "Runs held in memory: unfinished ones and those finished within the retention window.",
            snapshot.runs_in_memory,
        ),
        ("standby_parked_running", "gauge", "Sandboxes kept running for a thread (Tier 2).", snapshot.parked_running),
        ("standby_parked_stopped", "gauge", "Sandboxes kept stopped for a thread (Tier 1).", snapshot.parked_stopped),
        (
            "standby_resume_fallbacks_total",
            "counter",
            "Follow-up turns whose parked sandbox could not be used and that got a fresh one.",
            snapshot.resume_fallbacks,
        ),
        (
            "standby_duplicate_connections_refused_total",
            "counter",
            "Control socket upgrades refused (409) because their credential already had a live connection: a sign \
             the credential was copied. Counted since the server started.",
            snapshot.duplicate_connections_refused,
        ),
        (
            "standby_reconnects_total",
            "counter",
            "Control connections of a sandbox after its first.",
            snapshot.reconnects,
        ),
        (
            "standby_requeues_total",
            "counter",
            "Attempts released before the run started, the run requeued.",
            snapshot.requeues,
        ),
    ];
    for (name, kind, help, value) in scalars {
        writeln!(out, "# HELP {name} {help}")?;
        writeln!(out, "# TYPE {name} {kind}")?;
        writeln!(out, "{name} {value}")?;
    }
    Ok(())
}

/// The listener's bounds and counters, and the sandbox containment: facts
/// of this process, not of the records.
pub fn render_server(listener: &ListenerStats, containment: &str) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = render_server_into(&mut out, listener, containment);
    out
}

fn render_server_into(out: &mut String, listener: &ListenerStats, containment: &str) -> std::fmt::Result {
    let limits = listener.limits;
    let values = [
        ("standby_http_connections", "gauge", "Client connections open, control sockets included.", {
            listener.open.load(Ordering::Relaxed) as u64
        }),
        ("standby_http_connections_max", "gauge", "The connection cap (--max-connections).", {
            limits.max_connections as u64
        }),
        (
            "standby_http_outgoing_connections",
            "gauge",
            "Connections to the leader open now (a follower's forwarded calls and relayed sockets), under the cap too.",
            listener.outgoing.load(Ordering::Relaxed) as u64,
        ),
        (
            "standby_http_connection_cap_reached_total",
            "counter",
            "Times the cap was reached and new connections were left waiting in the backlog.",
            listener.cap_reached.load(Ordering::Relaxed),
        ),
        (
            "standby_http_header_timeouts_total",
            "counter",
            "Connections closed for sending no complete request head within the header timeout.",
            listener.header_timeouts.load(Ordering::Relaxed),
        ),
        (
            "standby_http_body_timeouts_total",
            "counter",
            "Request bodies that did not arrive whole within the body timeout of their head.",
            listener.body_timeouts.load(Ordering::Relaxed),
        ),
        (
            "standby_http_outgoing_refused_total",
            "counter",
            "Calls answered 503: no slot under the cap was left for their connection to the leader.",
            listener.outgoing_refused.load(Ordering::Relaxed),
        ),
        (
            "standby_ws_upgrades_refused_total",
            "counter",
            "Control-socket upgrade requests answered 429: too many were being authenticated.",
            listener.upgrades_refused.load(Ordering::Relaxed),
        ),
    ];
    for (name, kind, help, value) in values {
        writeln!(out, "# HELP {name} {help}")?;
        writeln!(out, "# TYPE {name} {kind}")?;
        writeln!(out, "{name} {value}")?;
    }
    writeln!(out, "# HELP standby_sandbox_containment How the provider keeps every process of a sandbox killable.")?;
    writeln!(out, "# TYPE standby_sandbox_containment gauge")?;
    writeln!(out, "standby_sandbox_containment{{kind=\"{containment}\"}} 1")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut snapshot = MetricsSnapshot { assignment_to_start_ms: vec![20, 700, 400_000], ..Default::default() };
        snapshot.runs.insert((RunState::Exited, Some(RunPath::Warm)), 2);
        let text = render(&snapshot);
        assert!(text.contains("standby_runs{state=\"exited\",path=\"warm\"} 2"));
        assert!(text.contains("standby_runs{state=\"queued\",path=\"none\"} 0"));
        assert!(text.contains("standby_runs{state=\"exited\",path=\"parked_stopped\"} 0"));
        assert!(text.contains("standby_runs{state=\"waiting\",path=\"none\"} 0"));
        assert!(text.contains("standby_assignment_to_start_seconds_bucket{le=\"0.025\"} 1"));
        assert!(text.contains("standby_assignment_to_start_seconds_bucket{le=\"1\"} 2"));
        assert!(text.contains("standby_assignment_to_start_seconds_bucket{le=\"300\"} 2"));
        assert!(text.contains("standby_assignment_to_start_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("standby_assignment_to_start_seconds_count 3"));
    }

    #[test]
    fn refused_duplicate_connections_are_a_counter() {
        let snapshot = MetricsSnapshot { duplicate_connections_refused: 4, ..Default::default() };
        let text = render(&snapshot);
        assert!(text.contains("# TYPE standby_duplicate_connections_refused_total counter"));
        assert!(text.contains("standby_duplicate_connections_refused_total 4"));
    }

    #[test]
    fn evicted_samples_add_to_the_buckets() {
        let mut past = Histogram::default();
        past.observe(20);
        past.observe(400_000);
        let snapshot =
            MetricsSnapshot { assignment_to_start_ms: vec![700], assignment_to_start_past: past, ..Default::default() };
        let text = render(&snapshot);
        assert!(text.contains("standby_assignment_to_start_seconds_bucket{le=\"0.025\"} 1"));
        assert!(text.contains("standby_assignment_to_start_seconds_bucket{le=\"1\"} 2"));
        assert!(text.contains("standby_assignment_to_start_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("standby_assignment_to_start_seconds_sum 400.7"));
    }
}
