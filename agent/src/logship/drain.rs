//! When the sender gives up on the rest of the log, without IO: the drain
//! bound is a bound on time **without progress** once the output has ended.
//!
//! A bound counted from the output's end alone cost a whole log to a server
//! restarted twice in a row (a few seconds each, 12 s apart): the sender
//! spent the bound on the two outages and gave up between them, though the
//! server acknowledged chunks in between and took the final event later.
//! Counting from the last sign of progress (a chunk acknowledged, or a `409`
//! telling the server's count) keeps shipping for as long as the server
//! keeps taking the log, and still gives up on an endpoint that never
//! answers: `bound` after the output ended, or after the last progress.

use std::time::Duration;

use tokio::time::Instant;

/// The drain clock: not running until the output ends, pushed back by
/// every sign of progress from then on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    bound: Duration,
    /// When the sender gives up, once the output has ended.
    by: Option<Instant>,
}

impl Drain {
    pub fn new(bound: Duration) -> Self {
        Self { bound, by: None }
    }

    /// The output ended at `now` (only the first call counts): the sender
    /// has `bound` to make progress.
    pub fn output_ended(&mut self, now: Instant) {
        if self.by.is_none() {
            self.by = Some(crate::time::after(now, self.bound));
        }
    }

    /// The server acknowledged a chunk or told its count at `now`: the
    /// sender has `bound` again. Before the output ends there is nothing
    /// to push back (the sender never gives up while the run still writes).
    pub fn progressed(&mut self, now: Instant) {
        if self.by.is_some() {
            self.by = Some(crate::time::after(now, self.bound));
        }
    }

    /// When the sender gives up unless it makes progress first; `None`
    /// while the output has not ended.
    pub fn deadline(&self) -> Option<Instant> {
        self.by
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: Duration = Duration::from_secs(30);

    #[test]
    fn no_deadline_while_the_output_goes_on_whatever_the_progress() {
        let start = Instant::now();
        let mut drain = Drain::new(BOUND);
        drain.progressed(start + Duration::from_secs(100));
        assert_eq!(drain.deadline(), None);
    }

    #[test]
    fn the_bound_counts_from_the_output_s_end_and_only_the_first_end() {
        let start = Instant::now();
        let mut drain = Drain::new(BOUND);
        drain.output_ended(start);
        drain.output_ended(start + Duration::from_secs(20));
        assert_eq!(drain.deadline(), Some(start + BOUND));
    }

    /// Two outages of a few seconds, 12 s apart, each eating most of a
    /// bound counted from the end, cost nothing: each acknowledgement in
    /// between starts the bound again.
    #[test]
    fn progress_pushes_the_deadline_back() {
        let start = Instant::now();
        let mut drain = Drain::new(BOUND);
        drain.output_ended(start);
        drain.progressed(start + Duration::from_secs(25));
        assert_eq!(drain.deadline(), Some(start + Duration::from_secs(55)));
        drain.progressed(start + Duration::from_secs(50));
        assert_eq!(drain.deadline(), Some(start + Duration::from_secs(80)));
    }

    #[test]
    fn a_huge_bound_saturates() {
        let start = Instant::now();
        let mut drain = Drain::new(Duration::MAX);
        drain.output_ended(start);
        drain.progressed(start);
        assert!(drain.deadline().is_some_and(|by| by > start));
    }
}
