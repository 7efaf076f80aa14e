//! `/metrics` in the Prometheus text exposition format, rendered from the
//! state machine's records at scrape time: nothing to lose in a restart,
//! since the records are what the store keeps. The one exception is the
//! count of refused duplicate connections, kept in memory: a counter that
//! starts over with the process, as Prometheus counters may.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use crate::listener::ListenerStats;
use crate::model::{RunPath, RunState};
use crate::rules::{Histogram, MetricsSnapshot, Phase};

/// What a server without a cluster (a SQLite store) says of leadership: it
/// decides alone, so it leads, and a rule that counts leaders across
/// deployments reads every server the same way. A replica says it from its
/// lease (`Cluster::render_metrics`).
pub const LEADING_ALONE: &str = "# HELP standby_leader Whether this replica leads (1) or not (0).\n\
                                 # TYPE standby_leader gauge\nstandby_leader 1\n";

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
    let submitted: u64 = snapshot.runs.values().sum();
    writeln!(out, "# HELP standby_runs_submitted_total Runs submitted: the arrivals.")?;
    writeln!(out, "# TYPE standby_runs_submitted_total counter")?;
    writeln!(out, "standby_runs_submitted_total {submitted}")?;
    let times = &snapshot.start_times;
    writeln!(out, "# HELP standby_runs_started_total Runs started, by the path of the attempt that started them.")?;
    writeln!(out, "# TYPE standby_runs_started_total counter")?;
    for path in RunPath::ALL {
        let count = times.submit_to_start.get(&path).map_or(0, Histogram::count);
        writeln!(out, "standby_runs_started_total{{path=\"{}\"}} {count}", path.as_str())?;
    }
    writeln!(out, "# HELP standby_submit_to_start_seconds From a run's submission to its start, by path.")?;
    writeln!(out, "# TYPE standby_submit_to_start_seconds histogram")?;
    for path in RunPath::ALL {
        let labels = format!("path=\"{}\"", path.as_str());
        let histogram = times.submit_to_start.get(&path).cloned().unwrap_or_default();
        write_histogram(out, "standby_submit_to_start_seconds", &labels, &histogram)?;
    }
    writeln!(
        out,
        "# HELP standby_run_phase_seconds Each phase of a started run's way to its start (the run's durations_ms), \
         by path."
    )?;
    writeln!(out, "# TYPE standby_run_phase_seconds histogram")?;
    for path in RunPath::ALL {
        for phase in Phase::ALL {
            let labels = format!("path=\"{}\",phase=\"{}\"", path.as_str(), phase.as_str());
            let histogram = times.phases.get(&(path, phase)).cloned().unwrap_or_default();
            write_histogram(out, "standby_run_phase_seconds", &labels, &histogram)?;
        }
    }
    writeln!(
        out,
        "# HELP standby_runs_lost_total Runs failed because their sandbox was lost after delivery was confirmed, by \
         the run's state then (confirmed: it may have started; running). Counted since the server started."
    )?;
    writeln!(out, "# TYPE standby_runs_lost_total counter")?;
    writeln!(out, "standby_runs_lost_total{{state=\"confirmed\"}} {}", snapshot.lost.before_start)?;
    writeln!(out, "standby_runs_lost_total{{state=\"running\"}} {}", snapshot.lost.after_start)?;
    let scalars = [
        (
            "standby_ready_standbys",
            "gauge",
            "Warm standbys a run could take now: ready, connected, heard from within the silence bound.",
            snapshot.ready_standbys,
        ),
        ("standby_pool_target", "gauge", "Warm standbys the pool keeps (--pool-size).", snapshot.pool_target),
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

/// One histogram's series, `labels` inside each sample's braces.
fn write_histogram(out: &mut String, name: &str, labels: &str, histogram: &Histogram) -> std::fmt::Result {
    for (index, bound) in Histogram::BUCKETS.into_iter().enumerate() {
        writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {}", histogram.cumulative(index))?;
    }
    let (count, sum) = (histogram.count(), histogram.sum_ms() as f64 / 1000.0);
    writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}")?;
    writeln!(out, "{name}_sum{{{labels}}} {sum}")?;
    writeln!(out, "{name}_count{{{labels}}} {count}")
}

/// The listener's bounds and counters, the sandbox containment and the
/// spans dropped (`dropped_spans`, 0 when nothing is traced): facts of
/// this process, not of the records.
pub fn render_server(listener: &ListenerStats, containment: &str, dropped_spans: u64) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = render_server_into(&mut out, listener, containment, dropped_spans);
    out
}

fn render_server_into(
    out: &mut String,
    listener: &ListenerStats,
    containment: &str,
    dropped_spans: u64,
) -> std::fmt::Result {
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
        (
            "standby_trace_spans_dropped_total",
            "counter",
            "Spans not exported (--otlp-endpoint): the bounded queue was full, or their batch failed or timed out.",
            dropped_spans,
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
    fn start_times_are_histograms_by_path_and_phase_and_runs_count_up() {
        let mut snapshot = MetricsSnapshot::default();
        snapshot.runs.insert((RunState::Exited, Some(RunPath::Warm)), 2);
        snapshot.runs.insert((RunState::Queued, None), 1);
        let mut warm = Histogram::default();
        warm.observe(40);
        warm.observe(3_000);
        snapshot.start_times.submit_to_start.insert(RunPath::Warm, warm);
        let mut confirm = Histogram::default();
        confirm.observe(2);
        snapshot.start_times.phases.insert((RunPath::Warm, Phase::AssignmentSentToDeliveryConfirmed), confirm);
        snapshot.lost.before_start = 1;
        let text = render(&snapshot);
        assert!(text.contains("# TYPE standby_runs_submitted_total counter\nstandby_runs_submitted_total 3\n"));
        assert!(text.contains("standby_runs_started_total{path=\"warm\"} 2\n"));
        assert!(text.contains("standby_runs_started_total{path=\"cold\"} 0\n"), "every path, started or not");
        assert!(text.contains("standby_submit_to_start_seconds_bucket{path=\"warm\",le=\"0.05\"} 1\n"));
        assert!(text.contains("standby_submit_to_start_seconds_bucket{path=\"warm\",le=\"5\"} 2\n"));
        assert!(text.contains("standby_submit_to_start_seconds_bucket{path=\"warm\",le=\"+Inf\"} 2\n"));
        assert!(text.contains("standby_submit_to_start_seconds_sum{path=\"warm\"} 3.04\n"));
        assert!(text.contains("standby_submit_to_start_seconds_count{path=\"cold\"} 0\n"));
        let phase = "standby_run_phase_seconds_bucket{path=\"warm\",phase=\"assignment_sent_to_delivery_confirmed\"";
        assert!(text.contains(&format!("{phase},le=\"0.001\"}} 0\n")));
        assert!(text.contains(&format!("{phase},le=\"0.0025\"}} 1\n")));
        assert!(text.contains("standby_run_phase_seconds_count{path=\"cold\",phase=\"queued\"} 0\n"));
        assert!(text.contains("standby_runs_lost_total{state=\"confirmed\"} 1\n"));
        assert!(text.contains("standby_runs_lost_total{state=\"running\"} 0\n"));
    }

    #[test]
    fn every_sample_has_a_type_and_a_name_prometheus_accepts() {
        let text = render(&MetricsSnapshot::default()) + LEADING_ALONE;
        let mut typed = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap_or_default();
                assert!(typed.insert(name.to_owned()), "{name} typed twice");
                let counter = rest.ends_with(" counter");
                assert_eq!(counter, name.ends_with("_total"), "{name}: `_total` is for counters and only them");
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap_or_default();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| name.strip_suffix(suffix).filter(|base| typed.contains(*base)))
                    .unwrap_or(name);
                assert!(typed.contains(family), "{name} has no TYPE line before it");
                assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "{name}");
            }
        }
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
