//! What the API and `/metrics` read of the machine: runs, sandboxes (a
//! page at a time), threads, and the numbers of `/metrics`.

use std::collections::{BTreeMap, HashSet};

use standby_protocol::AgentState;

use super::{Live, Rules};
use crate::credential::CredentialKind;
use crate::model::{
    AttemptOutcome, Millis, ParkMode, RunPath, RunRecord, RunState, SandboxRecord, SandboxState, ThreadRecord,
};

/// A sandbox as the API shows it.
#[derive(Debug, Clone)]
pub struct LiveSandbox {
    pub record: SandboxRecord,
    pub last_heartbeat_at: Option<Millis>,
    pub last_state: Option<AgentState>,
    pub connected: bool,
    pub candidate: bool,
    /// A process of it exists or is being started: it counts against the
    /// running cap.
    pub running: bool,
}

/// Which sandboxes a page of [`Rules::sandbox_views`] holds.
#[derive(Debug, Clone, Default)]
pub struct SandboxPage {
    /// The last sandbox of the previous page (`created_at`, id).
    pub after: Option<(Millis, String)>,
    pub limit: usize,
    /// Only sandboxes in this state.
    pub state: Option<SandboxState>,
    /// Only sandboxes kept for (or last serving) this thread.
    pub thread_id: Option<String>,
}

/// Numbers for `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct MetricsSnapshot {
    /// `(state, path)` → count; path `None` for runs never bound.
    pub runs: BTreeMap<(RunState, Option<RunPath>), u64>,
    /// Assignment sent → started, per started attempt, in milliseconds.
    pub assignment_to_start_ms: Vec<u64>,
    pub connected_standbys: u64,
    pub reconnects: u64,
    pub requeues: u64,
    pub sandboxes_live: u64,
    /// Sandboxes counting against the running cap.
    pub sandboxes_running: u64,
    pub running_cap: u64,
    pub parked_running: u64,
    pub parked_stopped: u64,
    /// Resumes of a parked sandbox given up for a fresh sandbox.
    pub resume_fallbacks: u64,
    /// Control socket upgrades refused because their credential had a
    /// live socket (since this process started).
    pub duplicate_connections_refused: u64,
    /// Assignment sent → started of the finished runs no longer in memory.
    pub assignment_to_start_past: Histogram,
    /// Runs held in memory (the rest are only in the store).
    pub runs_in_memory: u64,
    /// Where the started runs' time to start went, by path and phase.
    pub start_times: StartTimes,
    /// Warm standbys a run could take now (what placement would pick).
    pub ready_standbys: u64,
    /// The pool's target: warm standbys kept ready (`pool_size`).
    pub pool_target: u64,
    /// Runs failed because their sandbox was lost once delivery was
    /// confirmed (since this process started).
    pub lost: LostRuns,
    /// Sandboxes in memory by their state (the status page's pool).
    pub sandbox_states: SandboxCounts,
}

/// Sandboxes in memory by [`SandboxState`], retired ones included (they
/// stay in memory for the API until evicted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SandboxCounts {
    pub standby: u64,
    pub assigned: u64,
    pub parked: u64,
    pub resuming: u64,
    pub retired: u64,
}

impl SandboxCounts {
    fn add(&mut self, state: SandboxState) {
        let slot = match state {
            SandboxState::Standby => &mut self.standby,
            SandboxState::Assigned => &mut self.assigned,
            SandboxState::Parked => &mut self.parked,
            SandboxState::Resuming => &mut self.resuming,
            SandboxState::Retired => &mut self.retired,
        };
        *slot += 1;
    }
}

/// Runs failed because their sandbox was lost after their delivery was
/// confirmed: never dispatched again (a second execution is worse than a
/// failure), so each is a run a user lost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LostRuns {
    /// Before the agent reported the start: it may or may not have run.
    pub before_start: u64,
    /// While it ran.
    pub after_start: u64,
}

/// A span of a run's way from submission to start: the run's
/// `durations_ms` in the API, which add up to `submit_to_start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Submitted → bound to a sandbox (committed).
    Queued,
    CommitToAssignmentSent,
    AssignmentSentToDeliveryConfirmed,
    DeliveryConfirmedToStarted,
}

impl Phase {
    pub const ALL: [Self; 4] = [
        Self::Queued,
        Self::CommitToAssignmentSent,
        Self::AssignmentSentToDeliveryConfirmed,
        Self::DeliveryConfirmedToStarted,
    ];

    /// The label value: the API's name of the duration.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::CommitToAssignmentSent => "commit_to_assignment_sent",
            Self::AssignmentSentToDeliveryConfirmed => "assignment_sent_to_delivery_confirmed",
            Self::DeliveryConfirmedToStarted => "delivery_confirmed_to_started",
        }
    }
}

/// The started runs' times to start, folded into histograms by the path of
/// the attempt that started them: what the machine keeps of evicted runs,
/// and what `/metrics` renders with the runs in memory added.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StartTimes {
    /// Submitted → started, by path; its count is the runs started.
    pub submit_to_start: BTreeMap<RunPath, Histogram>,
    /// Each phase of it, by path; a phase one of whose ends is unknown (a
    /// run started before it was recorded) is left out.
    pub phases: BTreeMap<(RunPath, Phase), Histogram>,
}

impl StartTimes {
    /// Adds `run` if its current attempt started; a run starts at most
    /// once, so each is counted once.
    pub fn observe(&mut self, run: &RunRecord) {
        let Some(attempt) = run.current() else { return };
        let Some(started) = attempt.started_at else { return };
        self.submit_to_start.entry(attempt.path).or_default().observe(started.since(run.submitted_at));
        let spans = [
            (Phase::Queued, Some(run.submitted_at), Some(attempt.committed_at)),
            (Phase::CommitToAssignmentSent, Some(attempt.committed_at), attempt.assignment_sent_at),
            (Phase::AssignmentSentToDeliveryConfirmed, attempt.assignment_sent_at, attempt.delivery_confirmed_at),
            (Phase::DeliveryConfirmedToStarted, attempt.delivery_confirmed_at, Some(started)),
        ];
        for (phase, from, to) in spans {
            if let (Some(from), Some(to)) = (from, to) {
                self.phases.entry((attempt.path, phase)).or_default().observe(to.since(from));
            }
        }
    }
}

/// Assignment-to-start samples folded into [`Histogram::BUCKETS`]: what
/// finished runs that left memory still count, in constant space. The
/// machine keeps it; `/metrics` renders it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Histogram {
    /// Samples at or under each bound (not cumulative).
    counts: [u64; Histogram::BUCKETS.len()],
    count: u64,
    sum_ms: u64,
}

impl Histogram {
    /// Upper bounds of the start-time histograms, in seconds: from a phase
    /// of a warm start (a millisecond) to a slow cold start (minutes).
    pub const BUCKETS: [f64; 17] =
        [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

    pub fn observe(&mut self, ms: u64) {
        let seconds = ms as f64 / 1000.0;
        if let Some(slot) = Self::BUCKETS.iter().position(|bound| seconds <= *bound) {
            self.counts[slot] += 1;
        }
        self.count += 1;
        self.sum_ms = self.sum_ms.saturating_add(ms);
    }

    /// Samples at or under `BUCKETS[index]`.
    pub fn cumulative(&self, index: usize) -> u64 {
        self.counts[..=index].iter().sum()
    }

    /// Samples observed.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of the samples, in milliseconds.
    pub fn sum_ms(&self) -> u64 {
        self.sum_ms
    }
}

impl Rules {
    pub(super) fn run(&self, run_id: &str) -> Option<&RunRecord> {
        self.runs.get(run_id)
    }

    #[cfg(test)]
    pub(super) fn runs(&self) -> impl Iterator<Item = &RunRecord> {
        self.runs.values()
    }

    pub(super) fn sandbox(&self, sandbox_id: &str) -> Option<&SandboxRecord> {
        self.sandboxes.get(sandbox_id).map(|live| &live.record)
    }

    /// Every sandbox.
    #[cfg(test)]
    pub(super) fn sandbox_views(&self, now: Millis) -> Vec<LiveSandbox> {
        self.sandbox_page(now, &SandboxPage { limit: usize::MAX, ..SandboxPage::default() })
    }

    /// A page of sandboxes in creation order (`created_at`, then id).
    pub(super) fn sandbox_page(&self, now: Millis, page: &SandboxPage) -> Vec<LiveSandbox> {
        let mut lives: Vec<&Live> = self
            .sandboxes
            .values()
            .filter(|live| {
                page.after.as_ref().is_none_or(|(at, id)| (live.record.created_at, &live.record.id) > (*at, id))
                    && page.state.is_none_or(|state| live.record.state == state)
                    && page.thread_id.as_ref().is_none_or(|thread| live.record.thread_id.as_ref() == Some(thread))
            })
            .collect();
        lives.sort_by(|a, b| (a.record.created_at, &a.record.id).cmp(&(b.record.created_at, &b.record.id)));
        lives.truncate(page.limit);
        lives
            .into_iter()
            .map(|live| LiveSandbox {
                record: live.record.clone(),
                last_heartbeat_at: live.heartbeat.as_ref().map(|h| h.at),
                last_state: live.heartbeat.as_ref().map(|h| h.state),
                connected: self.live_standby_conns(live).next().is_some() || self.run_conns(live).next().is_some(),
                candidate: self.is_candidate(now, live),
                running: !live.exited,
            })
            .collect()
    }

    pub(super) fn thread(&self, thread_id: &str) -> Option<&ThreadRecord> {
        self.threads.get(thread_id)
    }

    pub(super) fn metrics(&self, now: Millis) -> MetricsSnapshot {
        let mut snapshot = MetricsSnapshot { start_times: self.evicted.start_times.clone(), ..Default::default() };
        for run in self.runs.values() {
            *snapshot.runs.entry((run.state, run.path())).or_default() += 1;
            snapshot.start_times.observe(run);
            for attempt in &run.attempts {
                if let (Some(sent), Some(started)) = (attempt.assignment_sent_at, attempt.started_at) {
                    snapshot.assignment_to_start_ms.push(started.since(sent));
                }
                if attempt.outcome == Some(AttemptOutcome::Requeued) {
                    snapshot.requeues += 1;
                }
            }
        }
        let mut standbys: HashSet<&str> = HashSet::new();
        for conn in self.conns.values().filter(|conn| conn.kind == CredentialKind::Standby) {
            standbys.insert(&conn.sandbox_id);
        }
        snapshot.connected_standbys = standbys.len() as u64;
        for live in self.sandboxes.values() {
            snapshot.sandbox_states.add(live.record.state);
            snapshot.reconnects += u64::from(live.record.connections.saturating_sub(1));
            snapshot.reconnects += u64::from(live.record.run_connections.saturating_sub(1));
            if live.record.state != SandboxState::Retired {
                snapshot.sandboxes_live += 1;
            }
            if !live.exited {
                snapshot.sandboxes_running += 1;
            }
            if self.is_candidate(now, live) {
                snapshot.ready_standbys += 1;
            }
            if live.record.state == SandboxState::Parked {
                match live.park_mode() {
                    Some(ParkMode::Running) => snapshot.parked_running += 1,
                    Some(ParkMode::Stopped) => snapshot.parked_stopped += 1,
                    None => {}
                }
            }
        }
        snapshot.resume_fallbacks =
            self.runs.values().filter(|run| run.resume.as_ref().is_some_and(|r| r.fallback.is_some())).count() as u64;
        for (key, count) in &self.evicted.runs {
            *snapshot.runs.entry(*key).or_default() += count;
        }
        snapshot.assignment_to_start_past = self.evicted.assignment_to_start.clone();
        snapshot.requeues += self.evicted.requeues;
        snapshot.resume_fallbacks += self.evicted.resume_fallbacks;
        snapshot.runs_in_memory = self.runs.len() as u64;
        snapshot.running_cap = self.config.pool_policy.running_cap as u64;
        snapshot.duplicate_connections_refused = self.admissions.duplicates_refused;
        snapshot.pool_target = self.config.pool_size as u64;
        snapshot.lost = self.lost;
        snapshot
    }
}
