//! When the control socket connects again: the reconnect policy as a pure
//! type. It does no IO and reads no clock or random source: [`crate::control`]
//! tells it how each attempt or connection ended, with the time and a random
//! draw, and waits as it says.
//!
//! The rules:
//! - Delays grow exponentially from [`BACKOFF_MIN`], doubling up to
//!   [`BACKOFF_CAP`]; jitter adds up to as much again, so a fleet dropped at
//!   once (a server restart) does not come back at once.
//! - A connection that stayed up [`STABLE_AFTER`] resets the growth; a
//!   shorter one does not, so a server that accepts upgrades and then drops
//!   them meets a growing delay.
//! - A `Retry-After` longer than the delay drawn is honoured.
//! - A changed credential (standby → run) connects at once, from the first
//!   delay again: it is a new login, not a retry.
//! - A refused credential (`401`, `403`, `410`) is never retried: the agent
//!   waits for another one.

use std::time::Duration;

use tokio::time::Instant;

/// Upper bound of the reconnect backoff, before jitter.
pub const BACKOFF_CAP: Duration = Duration::from_secs(30);
/// First reconnect delay (before jitter, which adds up to as much again).
/// The 500 ms jitter window spreads a fleet dropped at once (a server
/// restart) so that about a fifth of it comes back in any 100 ms.
pub const BACKOFF_MIN: Duration = Duration::from_millis(500);
/// A connection that stayed up this long resets the backoff. A shorter one
/// does not: a server that accepts upgrades and then drops them must meet a
/// growing delay, not a reconnect every quarter second.
pub const STABLE_AFTER: Duration = Duration::from_secs(10);

/// How a connection attempt, or the connection it made, ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// No connection: no answer, or an answer that is not a refusal of the
    /// credential, with the server's `Retry-After` if it gave one.
    Failed { retry_after: Option<Duration> },
    /// The connection made last dropped.
    Dropped,
    /// The server refused the credential: it will not be accepted again.
    Refused,
}

/// What the control task does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Connect again after this delay, or at once if the credential changes
    /// meanwhile.
    After(Duration),
    /// Do not connect with this credential again; wait for another.
    AwaitCredential,
}

/// The reconnect policy's state: how far the backoff has grown, and when
/// the current connection was made.
#[derive(Debug, Default)]
pub(crate) struct Reconnect {
    /// Delays drawn since the last reset: the exponent of the next one.
    drawn: u32,
    connected_at: Option<Instant>,
}

impl Reconnect {
    /// A connection was made at `now`.
    pub(crate) fn connected(&mut self, now: Instant) {
        self.connected_at = Some(now);
    }

    /// The credential changed: connect at once, and start the backoff over.
    pub(crate) fn credential_changed(&mut self) {
        *self = Self::default();
    }

    /// What to do after `ended`, at `now`. `jitter` is a random draw from
    /// `[0, 1)`: the share of the delay added to it.
    pub(crate) fn next(&mut self, now: Instant, ended: Ended, jitter: f64) -> Next {
        let connected_at = self.connected_at.take();
        match ended {
            Ended::Refused => Next::AwaitCredential,
            Ended::Failed { retry_after } => Next::After(self.draw(jitter).max(retry_after.unwrap_or_default())),
            Ended::Dropped => {
                if connected_at.is_some_and(|at| now.saturating_duration_since(at) >= STABLE_AFTER) {
                    self.drawn = 0;
                }
                Next::After(self.draw(jitter))
            }
        }
    }

    /// The next delay: [`BACKOFF_MIN`] doubled once per delay drawn since
    /// the last reset, at most [`BACKOFF_CAP`], plus `jitter` of itself.
    fn draw(&mut self, jitter: f64) -> Duration {
        let doublings = 2u32.saturating_pow(self.drawn);
        let base = BACKOFF_MIN.saturating_mul(doublings).min(BACKOFF_CAP);
        self.drawn = self.drawn.saturating_add(1);
        let jitter = if jitter.is_finite() { jitter.clamp(0.0, 1.0) } else { 0.0 };
        base.saturating_add(base.mul_f64(jitter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn after(next: Next) -> Duration {
        match next {
            Next::After(delay) => delay,
            Next::AwaitCredential => panic!("expected a delay, got {next:?}"),
        }
    }

    const FAILED: Ended = Ended::Failed { retry_after: None };

    #[test]
    fn delays_double_from_the_minimum_to_the_cap() {
        let (mut policy, now) = (Reconnect::default(), Instant::now());
        let delays: Vec<u64> = (0..9).map(|_| after(policy.next(now, FAILED, 0.0)).as_millis() as u64).collect();
        assert_eq!(delays, [500, 1000, 2000, 4000, 8000, 16_000, 30_000, 30_000, 30_000]);
    }

    #[test]
    fn jitter_adds_up_to_the_delay_again() {
        let now = Instant::now();
        assert_eq!(after(Reconnect::default().next(now, FAILED, 0.5)), Duration::from_millis(750));
        let most = after(Reconnect::default().next(now, FAILED, 0.999_999));
        assert!(most >= BACKOFF_MIN && most < 2 * BACKOFF_MIN, "{most:?}");
        let mut capped = Reconnect { drawn: 40, connected_at: None };
        assert_eq!(after(capped.next(now, FAILED, 1.0)), 2 * BACKOFF_CAP, "jitter applies to the cap too");
        for wild in [-3.0, f64::NAN, f64::INFINITY, 7.0] {
            let delay = after(Reconnect::default().next(now, FAILED, wild));
            assert!(delay >= BACKOFF_MIN && delay <= 2 * BACKOFF_MIN, "{wild}: {delay:?}");
        }
    }

    #[test]
    fn a_connection_that_stayed_up_resets_the_backoff_a_short_one_does_not() {
        let (mut policy, start) = (Reconnect::default(), Instant::now());
        for _ in 0..4 {
            policy.next(start, FAILED, 0.0);
        }
        policy.connected(start);
        let short = after(policy.next(start + STABLE_AFTER - Duration::from_millis(1), Ended::Dropped, 0.0));
        assert_eq!(short, Duration::from_secs(8), "the growth goes on");

        policy.connected(start);
        let stable = after(policy.next(start + STABLE_AFTER, Ended::Dropped, 0.0));
        assert_eq!(stable, BACKOFF_MIN, "from the first delay again");
        assert_eq!(after(policy.next(start + STABLE_AFTER, FAILED, 0.0)), 2 * BACKOFF_MIN);
    }

    #[test]
    fn a_drop_with_no_connection_recorded_does_not_reset() {
        let (mut policy, now) = (Reconnect::default(), Instant::now());
        policy.next(now, FAILED, 0.0);
        assert_eq!(after(policy.next(now + STABLE_AFTER * 10, Ended::Dropped, 0.0)), 2 * BACKOFF_MIN);
    }

    #[test]
    fn a_longer_retry_after_is_honoured_a_shorter_one_is_not() {
        let now = Instant::now();
        let long = Ended::Failed { retry_after: Some(Duration::from_secs(42)) };
        assert_eq!(after(Reconnect::default().next(now, long, 0.0)), Duration::from_secs(42));
        let short = Ended::Failed { retry_after: Some(Duration::from_millis(10)) };
        assert_eq!(after(Reconnect::default().next(now, short, 0.0)), BACKOFF_MIN);
    }

    #[test]
    fn a_changed_credential_starts_the_backoff_over() {
        let (mut policy, now) = (Reconnect::default(), Instant::now());
        for _ in 0..5 {
            policy.next(now, FAILED, 0.0);
        }
        policy.credential_changed();
        assert_eq!(after(policy.next(now, FAILED, 0.0)), BACKOFF_MIN);
    }

    #[test]
    fn a_refused_credential_is_not_retried() {
        let (mut policy, now) = (Reconnect::default(), Instant::now());
        assert_eq!(policy.next(now, Ended::Refused, 0.5), Next::AwaitCredential);
        policy.credential_changed();
        assert_eq!(after(policy.next(now, FAILED, 0.0)), BACKOFF_MIN);
    }

    #[test]
    fn endless_failures_stay_at_the_cap() {
        let (mut policy, now) = (Reconnect::default(), Instant::now());
        for _ in 0..10_000 {
            assert!(after(policy.next(now, FAILED, 0.0)) <= BACKOFF_CAP);
        }
    }
}
