//! The warm pool's numeric rules as pure functions, kept apart so each is
//! tested as the relation it promises rather than through a whole server.
//!
//! - The **auto-stop floor**: a provider stops a sandbox after some idle
//!   minutes on its own. If that backstop fires inside the host's warm idle
//!   window (or at its edge), a follow-up turn meets a sandbox that is being
//!   stopped under it. So for a sandbox kept warm for a thread the provider's
//!   auto-stop is at least `ceil(warm idle / 1 minute) + 5` minutes: the
//!   host's own idle handling always comes first, with a margin.
//! - The **standby TTL schedule**: replacement starts at a jittered point
//!   before the deadline (the end of the TTL), so a pool made at once does
//!   not expire at once, and the old standby is retired before the
//!   deadline.

use std::time::Duration;

use crate::model::Millis;

/// The pool policy and the thread tiers.
#[derive(Debug, Clone)]
pub struct PoolPolicy {
    /// Most sandboxes costing compute at once; `0`: no cap.
    pub running_cap: usize,
    /// Most pool standbys preparing at once (launched, never ready yet);
    /// `0`: no bound.
    pub max_preparing: usize,
    /// A standby is replaced within this; zero: never.
    pub standby_ttl: Duration,
    /// Tier 2: how long a thread's sandbox stays running after a turn;
    /// zero: not at all.
    pub warm_idle: Duration,
    /// Tier 1: a thread's sandbox is kept stopped (after the warm idle
    /// window, or at once); otherwise it is released.
    pub park_stopped: bool,
    /// The provider's idle auto-stop, floored for sandboxes kept warm.
    pub auto_stop: AutoStop,
    /// How long a resumed sandbox's agent may take to be ready.
    pub resume_timeout: Duration,
}

impl Default for PoolPolicy {
    fn default() -> Self {
        Self {
            running_cap: 0,
            max_preparing: 0,
            standby_ttl: Duration::ZERO,
            warm_idle: Duration::from_secs(300),
            park_stopped: true,
            auto_stop: AutoStop::default(),
            resume_timeout: Duration::from_secs(60),
        }
    }
}

/// Minutes added to the warm idle window for the provider auto-stop floor.
pub const AUTO_STOP_MARGIN_MINUTES: u32 = 5;

/// The provider's idle auto-stop as configured: whole provider minutes
/// (`0`: never), and how long a provider minute is (a minute, but tests
/// shorten it so that nothing waits for minutes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutoStop {
    pub minutes: u32,
    pub minute: Duration,
}

impl Default for AutoStop {
    fn default() -> Self {
        Self { minutes: 15, minute: Duration::from_secs(60) }
    }
}

impl AutoStop {
    /// The auto-stop for a sandbox kept warm for a thread during
    /// `warm_idle`: the configured value, raised to the floor. `0` (never)
    /// and anything longer than the floor are kept as configured.
    pub fn effective(self, warm_idle: Duration) -> u32 {
        if self.minutes == 0 || warm_idle.is_zero() {
            return self.minutes;
        }
        self.minutes.max(floor_minutes(warm_idle, self.minute))
    }
}

/// `ceil(warm_idle / minute) + 5`.
pub fn floor_minutes(warm_idle: Duration, minute: Duration) -> u32 {
    let minute = minute.as_nanos().max(1);
    let whole = warm_idle.as_nanos().div_ceil(minute);
    u32::try_from(whole).unwrap_or(u32::MAX).saturating_add(AUTO_STOP_MARGIN_MINUTES)
}

/// What to set on resume, given the auto-stop the sandbox has now
/// (`None`: unknown) and the one it should have: a shorter one is raised,
/// `0` (never) and a longer one are left alone. `None`: leave it.
pub fn raised_auto_stop(current: Option<u32>, wanted: u32) -> Option<u32> {
    match current {
        Some(0) => None,
        Some(current) if wanted != 0 && current >= wanted => None,
        _ => Some(wanted),
    }
}

/// When a standby of the pool is replaced and retired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlSchedule {
    /// From here a replacement is made; the standby stays a candidate
    /// until the replacement is ready.
    pub expires_at: Millis,
    /// The end of its TTL; it is retired before it ([`retire_at`]).
    pub deadline: Millis,
}

/// Replacement starts between 60% and 80% of the TTL (jittered by the
/// sandbox id, so standbys made together spread out); retirement comes at
/// 95% at the latest, before the deadline at 100%.
pub fn ttl_schedule(sandbox_id: &str, created: Millis, ttl: Duration) -> Option<TtlSchedule> {
    if ttl.is_zero() {
        return None;
    }
    let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
    let fraction = 0.6 + 0.2 * jitter(sandbox_id);
    let expires_in = (ttl_ms as f64 * fraction) as i64;
    Some(TtlSchedule {
        expires_at: Millis(created.0.saturating_add(expires_in)),
        deadline: Millis(created.0.saturating_add(ttl_ms)),
    })
}

/// When a standby made at `created` is retired whether or not a
/// replacement is ready: 95% of the way to `deadline`.
pub fn retire_at(created: Millis, deadline: Millis) -> Millis {
    Millis(deadline.0 - deadline.0.saturating_sub(created.0) / 20)
}

/// A number in `[0, 1)` from the id (FNV-1a, then a 64-bit finaliser so
/// ids that differ in one character land far apart): deterministic, so the
/// state machine stays free of randomness.
fn jitter(id: &str) -> f64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in id.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^= hash >> 33;
    (hash >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn auto_stop(minutes: u32) -> AutoStop {
        AutoStop { minutes, minute: MINUTE }
    }

    /// How long `minutes` minutes of `auto_stop`'s provider are.
    fn duration(auto_stop: AutoStop, minutes: u32) -> Duration {
        auto_stop.minute.saturating_mul(minutes)
    }

    /// The relation the floor exists for: the provider's backstop fires
    /// after the host's warm idle window plus the margin, never inside it.
    #[test]
    fn auto_stop_is_at_least_the_warm_idle_window_plus_the_margin() {
        let margin = MINUTE * AUTO_STOP_MARGIN_MINUTES;
        for window_s in [125, 300, 900, 1_800] {
            let window = Duration::from_secs(window_s);
            for configured in [1, 5, 15] {
                let effective = auto_stop(configured).effective(window);
                assert!(
                    duration(auto_stop(configured), effective) >= window + margin,
                    "window {window_s} s, configured {configured} min: auto-stop {effective} min"
                );
                assert!(effective >= configured, "never lowered");
            }
        }
        // The staging case: a 15-minute window and the 15-minute default.
        assert_eq!(auto_stop(15).effective(Duration::from_secs(900)), 20);
    }

    #[test]
    fn an_explicit_never_and_a_longer_value_are_kept() {
        for window_s in [125, 300, 900, 1_800] {
            let window = Duration::from_secs(window_s);
            assert_eq!(auto_stop(0).effective(window), 0, "0 means never, and stays never");
            assert_eq!(auto_stop(120).effective(window), 120, "longer than the floor: kept");
        }
        assert_eq!(auto_stop(2).effective(Duration::ZERO), 2, "nothing is kept warm: no floor");
    }

    #[test]
    fn the_floor_follows_the_provider_minute() {
        // Tests shorten the minute: the relation holds in those units too.
        let scaled = AutoStop { minutes: 1, minute: Duration::from_millis(500) };
        let window = Duration::from_secs(3);
        let effective = scaled.effective(window);
        assert_eq!(effective, 11);
        assert!(duration(scaled, effective) >= window + duration(scaled, AUTO_STOP_MARGIN_MINUTES));
    }

    #[test]
    fn resume_raises_only_a_shorter_auto_stop() {
        assert_eq!(raised_auto_stop(Some(15), 20), Some(20));
        assert_eq!(raised_auto_stop(Some(20), 20), None);
        assert_eq!(raised_auto_stop(Some(60), 20), None, "a longer one is kept");
        assert_eq!(raised_auto_stop(Some(0), 20), None, "never is kept");
        assert_eq!(raised_auto_stop(Some(15), 0), Some(0), "never is longer than anything");
        assert_eq!(raised_auto_stop(None, 20), Some(20), "unknown: set it");
    }

    #[test]
    fn ttl_replacement_is_jittered_and_comes_before_the_deadline() {
        let ttl = Duration::from_secs(3_600);
        let created = Millis(1_000_000);
        let mut expiries = std::collections::BTreeSet::new();
        for n in 0..20 {
            let schedule = ttl_schedule(&format!("sbx_{n}"), created, ttl).expect("a schedule");
            assert!(schedule.expires_at >= created.plus(ttl * 6 / 10));
            assert!(schedule.expires_at < retire_at(created, schedule.deadline));
            assert!(retire_at(created, schedule.deadline) < schedule.deadline);
            assert_eq!(schedule.deadline, created.plus(ttl));
            expiries.insert(schedule.expires_at);
        }
        assert!(expiries.len() > 15, "a pool made at once does not expire at once: {expiries:?}");
        assert_eq!(ttl_schedule("sbx_1", created, Duration::ZERO), None);
    }
}
