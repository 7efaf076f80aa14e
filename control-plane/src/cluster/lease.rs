//! What a replica makes of the lease row (pure: the row, our id, the
//! monotonic time of the claim's start and `now` in; a decision out).
//!
//! The rules, as Kubernetes' leader election has them, with one twist: a
//! leader that loses the lease does not step down in place, it is
//! [`Outcome::Deposed`] and the process exits, so "leader → follower" never
//! happens inside one process.
//! - A claim that took the lease while we held none: we lead at its epoch,
//!   until the claim's START plus the renew deadline (our clock: the
//!   database may have answered late, never early). The renew deadline is
//!   below the time to live ([`LeaseTimes::check`]), as in client-go's
//!   elector: a leader cut off stops acting before the lease it held can
//!   be taken by another replica.
//! - A claim that renewed it at our epoch: the deadline moves on, measured
//!   from that claim's start again.
//! - Another holds it (or it is ours at another epoch: it lapsed and was
//!   taken anew) while we led: deposed.
//! - A failed claim (database unreachable, timed out) changes nothing but
//!   the clock: a leader whose deadline passes is deposed, whatever the
//!   cause.
//! - A grant answered after half the time to live (the claim loop gives up
//!   on a claim then) counts as no grant: the database ends a claim after
//!   [`Lease::claim_bound`], so such an answer is one a replica may already
//!   have given up on, and its lease is mostly spent.
//!
//! The bounds the database enforces are set here too, so that failover
//! stays within the time to live plus one claim period whatever the old
//! leader does: a claim may wait on the lease row's lock, or run, for
//! [`Lease::claim_bound`]; a leader's write transaction may wait on a lock,
//! run a statement or sit idle between two for [`Lease::write_bound`], so a
//! leader frozen (SIGSTOP, a partition) inside one loses its session, and
//! with it the lock that holds every claim off, long before its lease ends.

use std::time::{Duration, Instant};

use crate::store::LeaseRow;

/// Why a leader stopped leading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deposition {
    /// Another replica holds the lease (at `epoch`).
    Taken { holder: String, epoch: u64 },
    /// Our lease expired and the claim took it anew at `epoch`: the
    /// machine in memory may be behind what another leader wrote between.
    Lapsed { epoch: u64 },
    /// No successful renew within the time to live, by our clock.
    DeadlinePassed,
}

impl std::fmt::Display for Deposition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Taken { holder, epoch } => write!(f, "replica `{holder}` holds the lease at epoch {epoch}"),
            Self::Lapsed { epoch } => write!(f, "our lease lapsed and was taken anew at epoch {epoch}"),
            Self::DeadlinePassed => f.write_str("no renew succeeded within the lease's time to live"),
        }
    }
}

/// What a claim (or the passing of time) means for this replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// We lead from now at `epoch`, until `deadline` unless renewed.
    Lead { epoch: u64, deadline: Instant },
    /// We still lead; the deadline moves to `deadline`.
    Renewed { deadline: Instant },
    /// Another leads (`leader`: its id and URL), or nobody does right now
    /// (`None`: expired, or held by an earlier process with our id).
    Follow { leader: Option<(String, String)>, epoch: u64 },
    /// The claim failed; nothing changes yet.
    Unchanged,
    /// We led and may no longer: the process exits.
    Deposed(Deposition),
}

/// How long a lease runs without a renew (`ttl`, by the database's clock),
/// and how long its leader goes on leading without one (`renew_deadline`,
/// by its own, from the start of its last successful claim).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTimes {
    pub ttl: Duration,
    pub renew_deadline: Duration,
}

/// Lease times a replica refuses to start with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseTimesError {
    #[error("--lease-ttl must be at least 300ms (it is renewed every third of it), not {0:?}")]
    TtlTooShort(Duration),
    #[error(
        "--renew-deadline {renew_deadline:?} must be below --lease-ttl {ttl:?} (a leader stops before its lease \
         can be taken) and above a third of it (the time between two claims)"
    )]
    RenewDeadline { ttl: Duration, renew_deadline: Duration },
}

impl LeaseTimes {
    /// `ttl` with the default renew deadline: four fifths of it. Claims
    /// come every third of the TTL, so two may fail in a row before the
    /// leader stops, and it stops a fifth of the TTL before the lease can
    /// be taken.
    pub fn with_ttl(ttl: Duration) -> Self {
        Self { ttl, renew_deadline: ttl * 4 / 5 }
    }

    /// Whether a replica may run with these times.
    pub fn check(self) -> Result<Self, LeaseTimesError> {
        if self.ttl < Duration::from_millis(300) {
            return Err(LeaseTimesError::TtlTooShort(self.ttl));
        }
        if self.renew_deadline >= self.ttl || self.renew_deadline <= self.ttl / 3 {
            return Err(LeaseTimesError::RenewDeadline { ttl: self.ttl, renew_deadline: self.renew_deadline });
        }
        Ok(self)
    }
}

/// A replica's side of the lease.
#[derive(Debug, Clone)]
pub struct Lease {
    me: String,
    ttl: Duration,
    renew_deadline: Duration,
    held: Option<(u64, Instant)>,
}

impl Lease {
    /// The lease of replica `me`.
    pub fn new(me: &str, times: LeaseTimes) -> Self {
        Self { me: me.to_owned(), ttl: times.ttl, renew_deadline: times.renew_deadline, held: None }
    }

    /// How often a claim is made: a third of the time to live, as
    /// Kubernetes renews (two claims may fail before the lease lapses).
    pub fn period(&self) -> Duration {
        self.ttl / 3
    }

    /// How long the database may work on one claim, waiting on the lease
    /// row's lock included (its `lock_timeout`, `statement_timeout` and
    /// `idle_in_transaction_session_timeout`): a quarter of the time to
    /// live, within the half the claim loop waits, so the database ends a
    /// claim before the replica gives up on it, and frees its connection.
    pub fn claim_bound(&self) -> Duration {
        self.ttl / 4
    }

    /// How long a leader's write transaction may wait on a lock, run one
    /// statement or sit idle between two (the same three timeouts), and
    /// how much of the lease must be left, by the database's clock, when it
    /// commits: a quarter of the time to live. So a frozen leader's
    /// transaction is ended by the database within a quarter of the TTL of
    /// its last statement, and a commit that passed the last check lands
    /// before the lease ends or not at all. A quarter is below the third
    /// between renews: one late renew does not stop the leader's writes.
    pub fn write_bound(&self) -> Duration {
        self.ttl / 4
    }

    /// The epoch a claim renews (`0`: we hold none).
    pub fn epoch(&self) -> u64 {
        self.held.map_or(0, |(epoch, _)| epoch)
    }

    /// When we stop leading unless renewed; `None` as a follower.
    pub fn deadline(&self) -> Option<Instant> {
        self.held.map(|(_, deadline)| deadline)
    }

    /// A claim started at `started` answered `answer` (`None`: it failed).
    pub fn observe(&mut self, started: Instant, answer: Option<&LeaseRow>, now: Instant) -> Outcome {
        let deadline = started + self.renew_deadline;
        let in_time = now < started + self.ttl / 2;
        let outcome = match (self.held, answer) {
            (_, None) => return self.tick(now).map_or(Outcome::Unchanged, Outcome::Deposed),
            (None, Some(row)) if row.ours => Outcome::Lead { epoch: row.epoch, deadline },
            (None, Some(row)) => {
                // Our own id without our claim: an earlier process of ours.
                let leads = row.remaining > Duration::ZERO && !row.holder.is_empty() && row.holder != self.me;
                Outcome::Follow {
                    leader: leads.then(|| (row.holder.clone(), row.holder_url.clone())),
                    epoch: row.epoch,
                }
            }
            (Some((epoch, _)), Some(row)) if row.ours && row.epoch == epoch => Outcome::Renewed { deadline },
            (Some(_), Some(row)) if row.ours => Outcome::Deposed(Deposition::Lapsed { epoch: row.epoch }),
            (Some(_), Some(row)) => {
                Outcome::Deposed(Deposition::Taken { holder: row.holder.clone(), epoch: row.epoch })
            }
        };
        // A grant answered late grants nothing: the lease stays as it was.
        match outcome {
            Outcome::Lead { epoch, deadline } if in_time => {
                self.held = Some((epoch, deadline));
                Outcome::Lead { epoch, deadline }
            }
            Outcome::Lead { epoch, .. } => Outcome::Follow { leader: None, epoch },
            Outcome::Renewed { deadline } if in_time => {
                self.held = self.held.map(|(epoch, _)| (epoch, deadline));
                Outcome::Renewed { deadline }
            }
            Outcome::Renewed { .. } => self.tick(now).map_or(Outcome::Unchanged, Outcome::Deposed),
            other => other,
        }
    }

    /// Whether the passing of time alone deposes us.
    pub fn tick(&self, now: Instant) -> Option<Deposition> {
        let (_, deadline) = self.held?;
        (now >= deadline).then_some(Deposition::DeadlinePassed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Millis;

    const TTL: Duration = Duration::from_secs(9);
    const RENEW: Duration = Duration::from_millis(7200);
    const TIMES: LeaseTimes = LeaseTimes { ttl: TTL, renew_deadline: RENEW };

    fn row(holder: &str, epoch: u64, ours: bool, remaining_s: u64) -> LeaseRow {
        LeaseRow {
            epoch,
            holder: holder.into(),
            holder_url: format!("http://{holder}"),
            ours,
            remaining: Duration::from_secs(remaining_s),
            expires_at: Millis(0),
        }
    }

    #[test]
    fn a_claim_that_takes_the_lease_leads_until_its_start_plus_the_renew_deadline() {
        let t0 = Instant::now();
        let mut lease = Lease::new("a", TIMES);
        assert_eq!(lease.period(), Duration::from_secs(3));
        let answered = t0 + Duration::from_secs(2);
        assert_eq!(
            lease.observe(t0, Some(&row("a", 4, true, 9)), answered),
            Outcome::Lead { epoch: 4, deadline: t0 + RENEW }
        );
        assert_eq!((lease.epoch(), lease.deadline()), (4, Some(t0 + RENEW)));
    }

    #[test]
    fn a_renew_moves_the_deadline_from_its_own_start() {
        let t0 = Instant::now();
        let mut lease = Lease::new("a", TIMES);
        lease.observe(t0, Some(&row("a", 4, true, 9)), t0);
        let t1 = t0 + Duration::from_secs(3);
        assert_eq!(lease.observe(t1, Some(&row("a", 4, true, 9)), t1), Outcome::Renewed { deadline: t1 + RENEW });
        assert_eq!(lease.tick(t1 + RENEW - Duration::from_millis(1)), None);
        assert_eq!(lease.tick(t1 + RENEW), Some(Deposition::DeadlinePassed));
    }

    #[test]
    fn a_leader_whose_lease_another_holds_or_that_was_taken_anew_is_deposed() {
        let t0 = Instant::now();
        let mut lease = Lease::new("a", TIMES);
        lease.observe(t0, Some(&row("a", 4, true, 9)), t0);
        let taken = lease.clone().observe(t0, Some(&row("b", 5, false, 9)), t0);
        assert_eq!(taken, Outcome::Deposed(Deposition::Taken { holder: "b".into(), epoch: 5 }));
        let anew = lease.observe(t0, Some(&row("a", 5, true, 9)), t0);
        assert_eq!(anew, Outcome::Deposed(Deposition::Lapsed { epoch: 5 }));
    }

    #[test]
    fn failed_claims_change_nothing_until_the_deadline_passes() {
        let t0 = Instant::now();
        let mut lease = Lease::new("a", TIMES);
        assert_eq!(lease.observe(t0, None, t0), Outcome::Unchanged, "a follower waits");
        lease.observe(t0, Some(&row("a", 4, true, 9)), t0);
        assert_eq!(lease.observe(t0, None, t0 + Duration::from_secs(7)), Outcome::Unchanged);
        assert_eq!(lease.observe(t0, None, t0 + RENEW), Outcome::Deposed(Deposition::DeadlinePassed));
    }

    #[test]
    fn an_answer_after_its_own_deadline_neither_leads_nor_renews() {
        let t0 = Instant::now();
        let late = t0 + TTL + Duration::from_secs(1);
        let mut lease = Lease::new("a", TIMES);
        assert_eq!(lease.observe(t0, Some(&row("a", 4, true, 9)), late), Outcome::Follow { leader: None, epoch: 4 });
        assert_eq!(lease.epoch(), 0);
        lease.observe(late, Some(&row("a", 4, true, 9)), late);
        let stale = lease.observe(late, Some(&row("a", 4, true, 9)), late + TTL);
        assert_eq!(stale, Outcome::Deposed(Deposition::DeadlinePassed));
    }

    /// Finding 15 of issue 25: claims queued on the lease row's lock were
    /// granted after their replica had given up on them. A grant answered
    /// after half the TTL (when the claim loop gives up) takes nothing and
    /// renews nothing; a renew answered late leaves the old deadline.
    #[test]
    fn a_grant_answered_after_half_the_ttl_does_not_count() {
        let t0 = Instant::now();
        let half = t0 + TTL / 2;
        let mut lease = Lease::new("a", TIMES);
        assert_eq!(lease.observe(t0, Some(&row("a", 4, true, 9)), half), Outcome::Follow { leader: None, epoch: 4 });
        assert_eq!((lease.epoch(), lease.deadline()), (0, None));
        let just_in_time = half - Duration::from_millis(1);
        assert!(matches!(lease.observe(t0, Some(&row("a", 4, true, 9)), just_in_time), Outcome::Lead { .. }));
        let t1 = t0 + Duration::from_secs(2);
        assert_eq!(lease.observe(t1, Some(&row("a", 4, true, 9)), t1 + TTL / 2), Outcome::Unchanged);
        assert_eq!(lease.deadline(), Some(t0 + RENEW), "the late renew moved nothing");
        assert_eq!(
            lease.observe(t1, Some(&row("a", 4, true, 9)), t0 + RENEW),
            Outcome::Deposed(Deposition::DeadlinePassed)
        );
    }

    #[test]
    fn the_database_ends_claims_and_writes_within_a_quarter_of_the_ttl() {
        let lease = Lease::new("a", TIMES);
        assert!(lease.claim_bound() < TTL / 2, "the database ends a claim before the loop gives up on it");
        assert!(lease.write_bound() < lease.period(), "one late renew does not stop the writes");
    }

    #[test]
    fn the_renew_deadline_is_below_the_ttl_and_above_the_time_between_claims() {
        assert_eq!(
            LeaseTimes::with_ttl(Duration::from_secs(10)).check().map(|t| t.renew_deadline),
            Ok(Duration::from_secs(8))
        );
        assert_eq!(TIMES.check(), Ok(TIMES));
        let refused = |ttl_ms: u64, renew_ms: u64| {
            let times =
                LeaseTimes { ttl: Duration::from_millis(ttl_ms), renew_deadline: Duration::from_millis(renew_ms) };
            times.check().expect_err("refused").to_string()
        };
        assert!(refused(200, 150).contains("--lease-ttl must be at least 300ms"));
        for (ttl, renew) in [(9000, 9000), (9000, 9500), (9000, 3000), (9000, 1000)] {
            let message = refused(ttl, renew);
            assert!(message.contains("--renew-deadline") && message.contains("--lease-ttl"), "{message}");
        }
    }

    #[test]
    fn a_follower_follows_a_running_lease_and_nobody_an_expired_one() {
        let t0 = Instant::now();
        let mut lease = Lease::new("a", TIMES);
        let leader = Some(("b".to_owned(), "http://b".to_owned()));
        assert_eq!(lease.observe(t0, Some(&row("b", 5, false, 4)), t0), Outcome::Follow { leader, epoch: 5 });
        assert_eq!(lease.observe(t0, Some(&row("b", 5, false, 0)), t0), Outcome::Follow { leader: None, epoch: 5 });
        assert_eq!(lease.observe(t0, Some(&row("", 0, false, 0)), t0), Outcome::Follow { leader: None, epoch: 0 });
        let earlier_self = lease.observe(t0, Some(&row("a", 6, false, 4)), t0);
        assert_eq!(earlier_self, Outcome::Follow { leader: None, epoch: 6 }, "an earlier process with our id");
        assert_eq!(lease.epoch(), 0);
    }
}
