//! The Docker provider's timers as pure decisions: Docker has no idle
//! auto-stop and no retention of its own, so the server's sweeper applies
//! them, with time passed in. The auto-stop minutes arrive already floored
//! by [`crate::policy::AutoStop::effective`] (seed 004: `ceil(warm idle /
//! 1 min) + 5` for a sandbox kept warm); the rule lives there, once.

use std::time::Duration;

/// Whether a running container idle for `idle_for` is stopped, with an
/// auto-stop of `minutes` provider minutes of `minute` each (`0`: never).
pub(super) fn idle_stop(minutes: u32, idle_for: Duration, minute: Duration) -> bool {
    minutes > 0 && idle_for >= minute.saturating_mul(minutes)
}

/// Whether a container stopped for `stopped_for` is removed, with a
/// retention of `auto_delete` provider minutes (`0`: never).
pub(super) fn delete_stopped(auto_delete: u32, stopped_for: Duration, minute: Duration) -> bool {
    auto_delete > 0 && stopped_for >= minute.saturating_mul(auto_delete)
}

/// What becomes of a sandbox stopped for `stopped_for` (counted from the
/// container's stop, also once it is archived).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retention {
    Keep,
    /// Committed to an image and the container removed: a stopped
    /// container holds its writable layer and an entry in the engine; an
    /// image holds the same files, and the container is made again from
    /// it on a resume (slower).
    Archive,
    /// Removed for good (the container, or the archive's image).
    Delete,
}

/// The retention of a stopped sandbox: deleted past `auto_delete`, else
/// archived past `auto_archive` unless it is already (minutes of `minute`
/// each; `0`: never). Deletion wins when both are due, as for the local
/// provider: an archive that is removed at once is work for nothing.
pub(super) fn retention(
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

/// How long ago the engine's `FinishedAt` (RFC 3339) was, at `now`; `None`
/// when it is missing, unreadable, or the engine's zero time
/// (`0001-01-01T00:00:00Z`: a container created and never stopped, which
/// is being started, not aged).
pub(super) fn stopped_for(finished_at: Option<&str>, now: jiff::Timestamp) -> Option<Duration> {
    let finished: jiff::Timestamp = finished_at?.parse().ok()?;
    if finished <= jiff::Timestamp::UNIX_EPOCH {
        return None;
    }
    let span = now.duration_since(finished);
    Some(Duration::try_from(span).unwrap_or(Duration::ZERO))
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
    fn the_engines_finished_at_is_read_as_an_age() {
        let now: jiff::Timestamp = "2026-12-01T20:00:00Z".parse().expect("a time");
        assert_eq!(stopped_for(Some("2026-12-01T19:59:00.5Z"), now), Some(Duration::from_millis(59_500)));
        assert_eq!(stopped_for(Some("2026-12-01T20:00:01Z"), now), Some(Duration::ZERO), "a clock step back");
        assert_eq!(stopped_for(Some("0001-01-01T00:00:00Z"), now), None, "created, never stopped: not aged");
        assert_eq!(stopped_for(Some("yesterday"), now), None);
        assert_eq!(stopped_for(None, now), None);
    }
}
