//! The timers of a provider that has none of its own (local, Docker): the
//! idle auto-stop and the retention of stopped sandboxes (archive, then
//! delete), as pure decisions with time passed in, and what a sweeper
//! remembers between its rounds ([`Timers`]). Each provider's sweeper only
//! gathers facts (which sandboxes run, their auto-stop, how long each
//! stopped one has been stopped, whether it is archived) and carries out
//! what these rules decide; a new provider feeds the same rules, it does
//! not write them again.
//!
//! The auto-stop minutes arrive already floored by
//! [`crate::policy::AutoStop::effective`] (seed 004: `ceil(warm idle / 1
//! min) + 5` for a sandbox kept warm); the rule lives there, once.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::lock;

/// Whether a running sandbox idle for `idle_for` is stopped, with an
/// auto-stop of `minutes` provider minutes of `minute` each (`0`: never).
pub(crate) fn idle_stop(minutes: u32, idle_for: Duration, minute: Duration) -> bool {
    minutes > 0 && idle_for >= minute.saturating_mul(minutes)
}

/// Whether a sandbox stopped for `stopped_for` is deleted, with a
/// retention of `auto_delete` provider minutes (`0`: never).
pub(crate) fn delete_stopped(auto_delete: u32, stopped_for: Duration, minute: Duration) -> bool {
    auto_delete > 0 && stopped_for >= minute.saturating_mul(auto_delete)
}

/// What becomes of a sandbox stopped for `stopped_for` (counted from its
/// stop, also once it is archived).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retention {
    Keep,
    /// Packed away, the files kept in less room (a local workspace into a
    /// tarball, a container into an image); a start unpacks it (slower).
    Archive,
    /// Removed for good, archived or not.
    Delete,
}

/// The retention of a stopped sandbox: deleted past `auto_delete`, else
/// archived past `auto_archive` unless it is already (minutes of `minute`
/// each; `0`: never). Deletion wins when both are due: an archive that is
/// removed at once is work for nothing.
pub(crate) fn retention(
    (auto_archive, auto_delete): (u32, u32),
    stopped_for: Duration,
    archived: bool,
    minute: Duration,
) -> Retention {
    if delete_stopped(auto_delete, stopped_for, minute) {
        Retention::Delete
    } else if !archived && auto_archive > 0 && stopped_for >= minute.saturating_mul(auto_archive) {
        Retention::Archive
    } else {
        Retention::Keep
    }
}

/// What a provider's sweeper remembers between its rounds, and the rules
/// it applies, with that provider's limits: one per provider, shared by
/// its operations (a launch or a heartbeat is activity, a start holds off
/// the retention) and its sweeper.
#[derive(Debug)]
pub(crate) struct Timers {
    /// How long a provider minute is: every limit counts in them.
    minute: Duration,
    /// Stopped for this many minutes: archived (`0`: never).
    auto_archive: u32,
    /// Stopped for this many minutes: deleted (`0`: never).
    auto_delete: u32,
    /// Last activity of each running sandbox, for the idle auto-stop.
    activity: Mutex<HashMap<String, Instant>>,
    /// Auto-stop minutes of each sandbox, for a provider whose platform
    /// keeps none (Docker, Kubernetes): memory; after a restart the
    /// dispatcher sets them again from the store.
    auto_stops: Mutex<HashMap<String, u32>>,
    /// Sandboxes the auto-stop is stopping: a stop outlasts a round (its
    /// grace period), and one stop each is enough.
    stopping: Mutex<HashSet<String>>,
    /// Held for reading by a start, for writing by the sweeper while it
    /// archives or deletes a stopped sandbox: a resume never starts a
    /// sandbox being packed away or removed under it.
    retention: RwLock<()>,
    /// The sweeper is started once, on the provider's first use.
    pub(super) sweeper: Once,
}

/// A sandbox the idle auto-stop claimed: no later round claims it again
/// until this is dropped, once its stop has ended.
#[derive(Debug)]
pub(crate) struct IdleStop {
    timers: Arc<Timers>,
    pub sandbox_id: String,
    /// Its auto-stop, for the log.
    pub minutes: u32,
}

impl Drop for IdleStop {
    fn drop(&mut self) {
        lock(&self.timers.stopping).remove(&self.sandbox_id);
    }
}

impl Timers {
    pub(crate) fn new(minute: Duration, auto_archive: u32, auto_delete: u32) -> Arc<Self> {
        Arc::new(Self {
            minute,
            auto_archive,
            auto_delete,
            activity: Mutex::new(HashMap::new()),
            auto_stops: Mutex::new(HashMap::new()),
            stopping: Mutex::new(HashSet::new()),
            retention: RwLock::new(()),
            sweeper: Once::new(),
        })
    }

    /// How often the sweeper runs: four times per provider minute, within
    /// bounds that keep a test's short minute from spinning and a long one
    /// from lagging.
    pub(crate) fn period(&self) -> Duration {
        (self.minute / 4).clamp(Duration::from_millis(25), Duration::from_secs(15))
    }

    /// The sandbox was busy at `now` (an agent launched, a heartbeat said
    /// so): its idle clock starts over.
    pub(crate) fn active(&self, sandbox_id: &str, now: Instant) {
        lock(&self.activity).insert(sandbox_id.to_owned(), now);
    }

    /// The sandbox stopped or went away: it has no idle clock.
    pub(crate) fn forget(&self, sandbox_id: &str) {
        lock(&self.activity).remove(sandbox_id);
    }

    /// Remembers the sandbox's auto-stop minutes.
    pub(crate) fn set_auto_stop(&self, sandbox_id: &str, minutes: u32) {
        lock(&self.auto_stops).insert(sandbox_id.to_owned(), minutes);
    }

    /// The sandbox's remembered auto-stop minutes; `None` when none was set.
    pub(crate) fn auto_stop(&self, sandbox_id: &str) -> Option<u32> {
        lock(&self.auto_stops).get(sandbox_id).copied()
    }

    /// The running sandboxes with their remembered auto-stop minutes
    /// (`0`, never, when none was set), for [`Timers::idle`].
    pub(crate) fn with_auto_stops(&self, running: impl IntoIterator<Item = String>) -> Vec<(String, u32)> {
        running.into_iter().map(|id| (id.clone(), self.auto_stop(&id).unwrap_or(0))).collect()
    }

    /// The sandbox was deleted: nothing of it is remembered.
    pub(crate) fn deleted(&self, sandbox_id: &str) {
        self.forget(sandbox_id);
        lock(&self.auto_stops).remove(sandbox_id);
    }

    /// Of the running sandboxes, each with its auto-stop minutes, those the
    /// idle auto-stop stops at `now`, each claimed. One first seen now (a
    /// container adopted after a restart) is idle from now.
    pub(crate) fn idle(
        self: &Arc<Self>,
        running: impl IntoIterator<Item = (String, u32)>,
        now: Instant,
    ) -> Vec<IdleStop> {
        let mut due = Vec::new();
        for (sandbox_id, minutes) in running {
            let since = *lock(&self.activity).entry(sandbox_id.clone()).or_insert(now);
            if idle_stop(minutes, now.duration_since(since), self.minute)
                && lock(&self.stopping).insert(sandbox_id.clone())
            {
                due.push(IdleStop { timers: Arc::clone(self), sandbox_id, minutes });
            }
        }
        due
    }

    /// Whether stopped sandboxes age at all (archive or delete set).
    pub(crate) fn ages_stopped(&self) -> bool {
        self.auto_archive > 0 || self.auto_delete > 0
    }

    /// What becomes of a sandbox stopped for `stopped_for`, [`retention`]
    /// with this provider's limits.
    pub(crate) fn retention(&self, stopped_for: Duration, archived: bool) -> Retention {
        retention((self.auto_archive, self.auto_delete), stopped_for, archived, self.minute)
    }

    /// Held by a start while it makes a stopped sandbox runnable again.
    pub(crate) async fn starting(&self) -> RwLockReadGuard<'_, ()> {
        self.retention.read().await
    }

    /// Held by the sweeper from its look at a stopped sandbox until it is
    /// archived or deleted: no start meanwhile.
    pub(crate) async fn retaining(&self) -> RwLockWriteGuard<'_, ()> {
        self.retention.write().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn idle_auto_stop_counts_provider_minutes_and_zero_means_never() {
        assert!(!idle_stop(0, Duration::from_secs(1 << 30), MINUTE), "0: never");
        assert!(!idle_stop(7, 7 * MINUTE - Duration::from_millis(1), MINUTE));
        assert!(idle_stop(7, 7 * MINUTE, MINUTE));
        let short = Duration::from_millis(100);
        assert!(idle_stop(7, Duration::from_millis(700), short), "a test's short minute");
    }

    #[test]
    fn the_floor_of_seed_004_reaches_the_timer_unchanged() {
        // A warm idle window of 2 min 1 s: the floor is ceil(2.02) + 5 = 8.
        let auto_stop = crate::policy::AutoStop { minutes: 1, minute: MINUTE };
        let minutes = auto_stop.effective(Duration::from_secs(121));
        assert_eq!(minutes, 8);
        assert!(!idle_stop(minutes, 7 * MINUTE, MINUTE), "not before the floor");
        assert!(idle_stop(minutes, 8 * MINUTE, MINUTE));
    }

    #[test]
    fn a_stopped_container_is_deleted_by_age() {
        assert!(!delete_stopped(0, Duration::from_secs(1 << 30), MINUTE), "0: never");
        assert!(!delete_stopped(1440, 1439 * MINUTE, MINUTE));
        assert!(delete_stopped(1440, 1440 * MINUTE, MINUTE));
    }

    #[test]
    fn a_stopped_sandbox_is_archived_then_deleted_by_age() {
        let both = (60, 1440);
        assert_eq!(retention(both, 59 * MINUTE, false, MINUTE), Retention::Keep);
        assert_eq!(retention(both, 60 * MINUTE, false, MINUTE), Retention::Archive);
        assert_eq!(retention(both, 60 * MINUTE, true, MINUTE), Retention::Keep, "archived once");
        assert_eq!(retention(both, 1440 * MINUTE, true, MINUTE), Retention::Delete, "an archive is deleted too");
        assert_eq!(retention(both, 1440 * MINUTE, false, MINUTE), Retention::Delete, "deletion wins");
        assert_eq!(retention((0, 1440), 1000 * MINUTE, false, MINUTE), Retention::Keep, "0: never archived");
        assert_eq!(retention((60, 0), 100_000 * MINUTE, true, MINUTE), Retention::Keep, "0: never deleted");
    }

    #[test]
    fn the_idle_clock_starts_at_the_last_activity_and_a_stop_is_claimed_once() {
        let minute = Duration::from_millis(100);
        let timers = Timers::new(minute, 0, 0);
        let start = Instant::now();
        timers.active("sbx_a", start);
        let running = || [("sbx_a".to_owned(), 2), ("sbx_never".to_owned(), 0)];
        assert!(timers.idle(running(), start + 2 * minute - Duration::from_millis(1)).is_empty());
        timers.active("sbx_a", start + minute);
        assert!(timers.idle(running(), start + 2 * minute).is_empty(), "activity holds the auto-stop off");
        let due = timers.idle(running(), start + 3 * minute);
        assert_eq!(due.iter().map(|stop| (stop.sandbox_id.as_str(), stop.minutes)).collect::<Vec<_>>(), [("sbx_a", 2)]);
        assert!(timers.idle(running(), start + 4 * minute).is_empty(), "claimed: not stopped twice");
        drop(due);
        assert_eq!(timers.idle(running(), start + 4 * minute).len(), 1, "claimable again once its stop ended");
        assert!(timers.idle(running(), start + 100 * minute).iter().all(|stop| stop.sandbox_id != "sbx_never"));
    }

    #[test]
    fn a_sandbox_first_seen_running_is_idle_from_then_and_a_forgotten_one_too() {
        let minute = Duration::from_millis(100);
        let timers = Timers::new(minute, 0, 0);
        let seen = Instant::now();
        assert!(timers.idle([("sbx_adopted".to_owned(), 1)], seen).is_empty(), "adopted: idle from now");
        assert_eq!(timers.idle([("sbx_adopted".to_owned(), 1)], seen + minute).len(), 1);
        timers.active("sbx_b", seen);
        timers.forget("sbx_b");
        let later = seen + 10 * minute;
        assert!(timers.idle([("sbx_b".to_owned(), 1)], later).is_empty(), "stopped: its old activity is gone");
    }

    #[test]
    fn the_providers_limits_reach_the_retention_rule_and_the_sweep_period() {
        let timers = Timers::new(MINUTE, 60, 1440);
        assert!(timers.ages_stopped());
        assert_eq!(timers.retention(60 * MINUTE, false), Retention::Archive);
        assert_eq!(timers.retention(1440 * MINUTE, false), Retention::Delete);
        assert!(!Timers::new(MINUTE, 0, 0).ages_stopped());
        assert_eq!(timers.period(), Duration::from_secs(15));
        assert_eq!(Timers::new(Duration::from_millis(100), 0, 0).period(), Duration::from_millis(25));
        assert_eq!(Timers::new(Duration::from_millis(400), 0, 0).period(), Duration::from_millis(100));
    }
}
