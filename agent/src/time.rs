//! Saturating time arithmetic. Durations come from settings, the spec and
//! `Retry-After` headers, none of which the agent controls: adding one to an
//! instant must never panic. Anything beyond [`FOREVER`] means "not in this
//! agent's life".

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

/// A deadline as configured: absolute, or relative to the agent's start;
/// [`deadline_instant`] says when it falls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deadline {
    At(SystemTime),
    After(Duration),
}

/// A century: later than any sandbox lives, and far enough inside the
/// range of a monotonic clock that adding it cannot overflow.
pub const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `at + wait`, saturating at `at + FOREVER`.
pub fn after(at: Instant, wait: Duration) -> Instant {
    // `checked_add` of at most a century to a clock reading fails on no
    // supported platform; falling back to `at` only keeps this total.
    at.checked_add(wait.min(FOREVER)).unwrap_or(at)
}

/// When a configured deadline falls: `start + after`, or the wall-clock
/// time `at` seen from `now` (`now_wall` on the wall clock), both saturating.
/// A time already past is `now`.
pub fn deadline_instant(deadline: Deadline, start: Instant, now: Instant, now_wall: SystemTime) -> Instant {
    match deadline {
        Deadline::After(wait) => after(start, wait),
        Deadline::At(at) => after(now, at.duration_since(now_wall).unwrap_or_default()),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::api::parse_retry_after;

    pub(crate) fn any_duration() -> impl Strategy<Value = Duration> {
        prop_oneof![
            Just(Duration::MAX),
            Just(Duration::from_secs(u64::MAX)),
            (any::<u64>(), 0..1_000_000_000u32).prop_map(|(secs, nanos)| Duration::new(secs, nanos)),
            (0..1_000_000u64).prop_map(Duration::from_millis),
        ]
    }

    /// Any time from year 0 to 9999, as an offset from the epoch.
    fn any_wall_time() -> impl Strategy<Value = SystemTime> {
        (-62_167_219_200i64..253_402_300_799).prop_map(|secs| {
            let offset = Duration::from_secs(secs.unsigned_abs());
            if secs < 0 { SystemTime::UNIX_EPOCH - offset } else { SystemTime::UNIX_EPOCH + offset }
        })
    }

    #[test]
    fn extremes() {
        let now = Instant::now();
        assert_eq!(after(now, Duration::MAX), now + FOREVER);
        assert_eq!(after(now, Duration::from_secs(3)), now + Duration::from_secs(3));
        let wall = SystemTime::now();
        assert_eq!(deadline_instant(Deadline::At(SystemTime::UNIX_EPOCH), now, now, wall), now, "past: now");
        let year_9999 = crate::config::parse_time("9999-12-30T00:00:00Z").expect("a valid time");
        assert_eq!(deadline_instant(Deadline::At(year_9999), now, now, wall), now + FOREVER);
        let retry = parse_retry_after("18446744073709551615", wall).expect("delay-seconds");
        assert_eq!(after(now, retry), now + FOREVER);
        let retry = parse_retry_after("Thu, 30 Dec 9999 00:00:00 GMT", wall).expect("an HTTP date");
        assert_eq!(after(now, retry), now + FOREVER);
    }

    proptest! {
        #[test]
        fn absurd_durations_and_times_never_panic(
            wait in any_duration(),
            at in any_wall_time(),
            wall in any_wall_time(),
            seconds in any::<u64>(),
        ) {
            let now = Instant::now();
            let later = after(now, wait);
            prop_assert!(later >= now && later <= now + FOREVER);
            let deadline = deadline_instant(Deadline::After(wait), now, now, wall);
            prop_assert!(deadline >= now);
            let deadline = deadline_instant(Deadline::At(at), now, now, wall);
            prop_assert!(deadline >= now && deadline <= now + FOREVER);
            let printer = jiff::fmt::rfc2822::DateTimePrinter::new();
            let date = jiff::Timestamp::try_from(at).ok().and_then(|t| printer.timestamp_to_rfc9110_string(&t).ok());
            for header in [seconds.to_string(), date.unwrap_or_default()] {
                if let Some(retry) = parse_retry_after(&header, wall) {
                    prop_assert!(after(now, retry) >= now);
                }
            }
        }
    }
}
