//! What the status page computes from the records: the last hour's
//! arrivals, cold-path share and submit→start percentiles, and the phases
//! of one run as a waterfall. Pure, with the time passed in, so that the
//! page's numbers are tested to the millisecond.

use serde::Serialize;

use crate::model::{Millis, RunPath, RunRecord};

/// The window of [`HourStats`].
pub(crate) const HOUR_MS: i64 = 3_600_000;

/// The last hour, as the page shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct HourStats {
    /// Runs submitted in the window.
    pub arrivals: u64,
    /// Of those, runs placed on a sandbox (their latest attempt's path is known).
    pub placed: u64,
    /// Of the placed, those whose latest attempt went cold (a sandbox
    /// made for the run: no standby was ready).
    pub cold: u64,
    /// `cold / placed`; `null` when none was placed.
    pub cold_share: Option<f64>,
    /// Of the arrivals, runs that started: the percentiles' samples.
    pub started: u64,
    pub submit_to_start_p50_ms: Option<u64>,
    pub submit_to_start_p99_ms: Option<u64>,
    /// More runs arrived than the page reads at once: the figures are of
    /// the latest ones only.
    pub truncated: bool,
}

/// The `q` quantile (0 < q ≤ 1) of `sorted` by the nearest-rank method:
/// a sample that was observed, never an interpolation between two.
pub(crate) fn nearest_rank(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// The figures of the runs submitted in the hour before `now`. `runs` may
/// hold others (they are left out); `truncated` says whether the caller
/// read fewer runs than the window holds.
pub(crate) fn hour_stats(runs: &[RunRecord], now: Millis, truncated: bool) -> HourStats {
    let since = Millis(now.0.saturating_sub(HOUR_MS));
    let recent: Vec<&RunRecord> =
        runs.iter().filter(|run| run.submitted_at > since && run.submitted_at <= now).collect();
    let placed: Vec<RunPath> = recent.iter().filter_map(|run| run.path()).collect();
    let cold = placed.iter().filter(|path| **path == RunPath::Cold).count() as u64;
    let mut starts: Vec<u64> = recent
        .iter()
        .filter_map(|run| run.current()?.started_at.map(|started| started.since(run.submitted_at)))
        .collect();
    starts.sort_unstable();
    HourStats {
        arrivals: recent.len() as u64,
        placed: placed.len() as u64,
        cold,
        cold_share: (!placed.is_empty()).then(|| cold as f64 / placed.len() as f64),
        started: starts.len() as u64,
        submit_to_start_p50_ms: nearest_rank(&starts, 0.50),
        submit_to_start_p99_ms: nearest_rank(&starts, 0.99),
        truncated,
    }
}

/// One bar of a run's waterfall.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Segment {
    /// `queued`, `commit_to_assignment_sent`,
    /// `assignment_sent_to_delivery_confirmed` or
    /// `delivery_confirmed_to_started`: the API's `durations_ms` names.
    pub phase: &'static str,
    pub ms: u64,
    /// Still under way: it ends `now`, and grows at the next update.
    pub open: bool,
}

/// The phases of `run`'s way from submission to start, in order, each
/// from its latest attempt's timestamps (earlier attempts are in
/// `queued`, as in the API). A live run's current phase is open, to
/// `now`; a phase whose end was never recorded (the run failed or was
/// cancelled before it) ends the waterfall. The install steps run inside
/// `delivery_confirmed_to_started` (and overlap `assignment_sent_to_
/// delivery_confirmed`): the agent reports no step's time to the server.
pub(crate) fn waterfall(run: &RunRecord, now: Millis) -> Vec<Segment> {
    let attempt = run.current();
    let live = !run.state.is_terminal() && attempt.is_none_or(|attempt| attempt.ended_at.is_none());
    let marks = [
        ("queued", Some(run.submitted_at)),
        ("commit_to_assignment_sent", attempt.map(|a| a.committed_at)),
        ("assignment_sent_to_delivery_confirmed", attempt.and_then(|a| a.assignment_sent_at)),
        ("delivery_confirmed_to_started", attempt.and_then(|a| a.delivery_confirmed_at)),
        ("started", attempt.and_then(|a| a.started_at)),
    ];
    let mut segments = Vec::new();
    for pair in marks.windows(2) {
        let ((phase, from), (_, to)) = (pair[0], pair[1]);
        let Some(from) = from else { break };
        match to {
            Some(to) => segments.push(Segment { phase, ms: to.since(from), open: false }),
            None => {
                if live {
                    segments.push(Segment { phase, ms: now.since(from), open: true });
                }
                break;
            }
        }
    }
    segments
}

/// One step of a start as the agent timed it (contract 1.3,
/// `install_us`), each from the assignment's arrival at the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct InstallStep {
    pub name: String,
    pub us: u64,
}

/// The agent's timing of the latest attempt's start, as the page draws it
/// under the waterfall: the confirmation first, then the install steps
/// (they run in parallel) slowest first, then the spawn, then the critical
/// path (assignment to start) that they add up to. Empty when the agent
/// reported none (an agent older than 1.3, or no start yet).
pub(crate) fn install_steps(run: &RunRecord) -> Vec<InstallStep> {
    let Some(timing) = run.current().and_then(|attempt| attempt.install_us.as_ref()) else { return Vec::new() };
    const LAST: [&str; 2] = ["spawn", "critical_path"];
    let step = |name: &str, us: u64| InstallStep { name: name.to_owned(), us };
    let mut steps: Vec<InstallStep> = timing
        .iter()
        .filter(|(name, _)| name.as_str() != "confirm" && !LAST.contains(&name.as_str()))
        .map(|(name, us)| step(name, *us))
        .collect();
    steps.sort_by(|a, b| b.us.cmp(&a.us).then_with(|| a.name.cmp(&b.name)));
    let first = timing.get("confirm").map(|us| step("confirm", *us));
    let last = LAST.iter().filter_map(|name| timing.get(*name).map(|us| step(name, *us)));
    first.into_iter().chain(steps).chain(last).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Attempt, RunState};

    fn run(id: &str, submitted: i64, state: RunState) -> RunRecord {
        let run = serde_json::from_value(serde_json::json!({"command": ["true"]})).expect("a run");
        RunRecord { state, ..RunRecord::queued(id.to_owned(), Millis(submitted), run, None) }
    }

    fn attempt(path: RunPath, committed: i64, times: [Option<i64>; 3]) -> Attempt {
        Attempt {
            number: 1,
            sandbox_id: "sbx_1".into(),
            path,
            credential_id: "c".into(),
            committed_at: Millis(committed),
            assignment_sent_at: times[0].map(Millis),
            delivery_confirmed_at: times[1].map(Millis),
            started_at: times[2].map(Millis),
            ended_at: None,
            outcome: None,
            reason: None,
            install_us: None,
        }
    }

    #[test]
    fn the_agents_timing_is_drawn_confirmation_first_slowest_step_next_critical_path_last() {
        let mut started = run("timed", 0, RunState::Running);
        started.attempts.push(attempt(RunPath::Warm, 1, [Some(2), Some(8), Some(12)]));
        assert!(install_steps(&started).is_empty(), "an agent that reported none");
        let timing =
            [("secrets", 3_000), ("critical_path", 9_000), ("refresh", 4_000), ("confirm", 5_000), ("spawn", 900)];
        started.attempts[0].install_us = Some(timing.iter().map(|(name, us)| ((*name).to_owned(), *us)).collect());
        let drawn: Vec<(String, u64)> = install_steps(&started).into_iter().map(|s| (s.name, s.us)).collect();
        let expected =
            [("confirm", 5_000), ("refresh", 4_000), ("secrets", 3_000), ("spawn", 900), ("critical_path", 9_000)];
        assert_eq!(drawn, expected.map(|(name, us)| (name.to_owned(), us)));
    }

    #[test]
    fn nearest_rank_takes_an_observed_sample() {
        assert_eq!(nearest_rank(&[], 0.5), None);
        assert_eq!(nearest_rank(&[7], 0.99), Some(7));
        let hundred: Vec<u64> = (1..=100).collect();
        assert_eq!(nearest_rank(&hundred, 0.50), Some(50));
        assert_eq!(nearest_rank(&hundred, 0.99), Some(99));
        assert_eq!(nearest_rank(&[10, 20, 30], 0.5), Some(20));
        assert_eq!(nearest_rank(&[10, 20], 0.99), Some(20));
    }

    #[test]
    fn the_hour_counts_arrivals_cold_share_and_start_percentiles_of_its_runs_only() {
        let now = Millis(10 * HOUR_MS);
        let mut runs = Vec::new();
        // Out of the window: too old, or (a clock step) in the future.
        let mut old = run("old", now.0 - HOUR_MS, RunState::Exited);
        old.attempts.push(attempt(RunPath::Cold, now.0 - HOUR_MS, [None, None, Some(now.0 - HOUR_MS + 1)]));
        runs.push(old);
        runs.push(run("future", now.0 + 1, RunState::Queued));
        // In it: three warm starts of 100, 200, 300 ms, one cold of 9 s,
        // one cold still installing, one queued.
        for (n, (path, start)) in
            [(RunPath::Warm, 100), (RunPath::Warm, 200), (RunPath::Warm, 300), (RunPath::Cold, 9_000)]
                .into_iter()
                .enumerate()
        {
            let submitted = now.0 - 60_000 * (n as i64 + 1);
            let mut started = run(&format!("r{n}"), submitted, RunState::Exited);
            started.attempts.push(attempt(path, submitted + 10, [None, None, Some(submitted + start)]));
            runs.push(started);
        }
        let mut installing = run("installing", now.0 - 1_000, RunState::Confirmed);
        installing.attempts.push(attempt(RunPath::Cold, now.0 - 900, [Some(now.0 - 800), Some(now.0 - 700), None]));
        runs.push(installing);
        runs.push(run("queued", now.0 - 10, RunState::Queued));
        let stats = hour_stats(&runs, now, false);
        assert_eq!((stats.arrivals, stats.placed, stats.cold, stats.started), (6, 5, 2, 4));
        assert_eq!(stats.cold_share, Some(0.4));
        assert_eq!((stats.submit_to_start_p50_ms, stats.submit_to_start_p99_ms), (Some(200), Some(9_000)));
        let empty = hour_stats(&[], now, true);
        assert_eq!((empty.arrivals, empty.cold_share, empty.submit_to_start_p50_ms), (0, None, None));
        assert!(empty.truncated);
    }

    #[test]
    fn a_started_run_has_every_phase_closed_and_a_live_one_its_current_phase_open() {
        let now = Millis(50_000);
        let mut started = run("s", 1_000, RunState::Exited);
        started.attempts.push(attempt(RunPath::Warm, 1_500, [Some(1_520), Some(1_600), Some(1_900)]));
        let phases: Vec<(&str, u64, bool)> =
            waterfall(&started, now).into_iter().map(|s| (s.phase, s.ms, s.open)).collect();
        assert_eq!(
            phases,
            [
                ("queued", 500, false),
                ("commit_to_assignment_sent", 20, false),
                ("assignment_sent_to_delivery_confirmed", 80, false),
                ("delivery_confirmed_to_started", 300, false),
            ]
        );
        let queued = run("q", 45_000, RunState::Queued);
        assert_eq!(waterfall(&queued, now), [Segment { phase: "queued", ms: 5_000, open: true }]);
        let mut confirmed = run("c", 40_000, RunState::Confirmed);
        confirmed.attempts.push(attempt(RunPath::Cold, 41_000, [Some(41_010), Some(49_000), None]));
        let last = waterfall(&confirmed, now).pop().expect("segments");
        assert_eq!(last, Segment { phase: "delivery_confirmed_to_started", ms: 1_000, open: true });
    }

    #[test]
    fn a_run_that_ended_before_starting_stops_at_its_last_recorded_phase() {
        let now = Millis(50_000);
        let mut failed = run("f", 1_000, RunState::Failed);
        failed.attempts.push(attempt(RunPath::Cold, 2_000, [Some(2_010), None, None]));
        let phases: Vec<&str> = waterfall(&failed, now).into_iter().map(|s| s.phase).collect();
        assert_eq!(phases, ["queued", "commit_to_assignment_sent"], "no open phase: it is over");
        let cancelled = run("c", 1_000, RunState::Cancelled);
        assert!(waterfall(&cancelled, now).is_empty(), "cancelled while queued: its wait is not a phase");
    }
}
