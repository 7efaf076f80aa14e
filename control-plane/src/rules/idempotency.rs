//! Idempotent submission: `POST /v1/runs` with an `Idempotency-Key`. The
//! first submission with a key makes a run and keeps the key with it, in
//! the same step (so in the same transaction: commit before tell); a retry
//! with the same key and the same body answers that run and makes none; a
//! retry with another body is refused. Keys are forgotten once the window
//! (`RunBounds::idempotency_window`) has passed.

use standby_protocol::Run;

use super::{Rules, Step, Write};
use crate::model::{IdempotencyRecord, Millis, RunRequest};

/// A submission's `Idempotency-Key` and the hash of its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    pub key: String,
    pub request_hash: String,
}

/// What a submission answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Submitted {
    /// A new run.
    New(String),
    /// The run an earlier submission with the same key and body made.
    Replayed(String),
}

impl Submitted {
    pub fn run_id(&self) -> &str {
        match self {
            Self::New(id) | Self::Replayed(id) => id,
        }
    }
}

/// The key was used with another body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the Idempotency-Key was used for run `{run_id}` with another body")]
pub struct KeyReused {
    pub run_id: String,
}

/// What a key seen before means for a submission with `request_hash`.
fn decide(kept: Option<&IdempotencyRecord>, request_hash: &str) -> Result<Option<String>, KeyReused> {
    match kept {
        None => Ok(None),
        Some(kept) if kept.request_hash == request_hash => Ok(Some(kept.run_id.clone())),
        Some(kept) => Err(KeyReused { run_id: kept.run_id.clone() }),
    }
}

impl Rules {
    /// Submits a run (a turn of `thread_id` when given), unless `key` was
    /// used before within the window: then the run it made, or
    /// [`KeyReused`] when the body differs.
    pub(super) fn submit_keyed(
        &mut self,
        now: Millis,
        run: Run,
        request: RunRequest,
        thread_id: Option<String>,
        key: Option<IdempotencyKey>,
    ) -> Result<(Step, Submitted), KeyReused> {
        let Some(key) = key else {
            let (step, id) = self.submit_turn(now, run, request, thread_id);
            return Ok((step, Submitted::New(id)));
        };
        let kept = self.idempotency.get(&key.key).filter(|kept| !self.key_expired(now, kept));
        if let Some(run_id) = decide(kept, &key.request_hash)? {
            return Ok((Step::default(), Submitted::Replayed(run_id)));
        }
        let (mut step, id) = self.submit_turn(now, run, request, thread_id);
        let record = IdempotencyRecord {
            key: key.key.clone(),
            request_hash: key.request_hash,
            run_id: id.clone(),
            created_at: now,
        };
        // The key goes in the same step as the run: one transaction.
        step.writes.push(Write::Idempotency(Box::new(record.clone())));
        self.idempotency.insert(key.key, record);
        Ok((step, Submitted::New(id)))
    }

    fn key_expired(&self, now: Millis, kept: &IdempotencyRecord) -> bool {
        now >= kept.created_at.plus(self.config.bounds.idempotency_window)
    }

    /// Forgets the keys whose window has passed, in memory and in the store.
    pub(super) fn expire_idempotency(&mut self, now: Millis, step: &mut Step) {
        let before = self.idempotency.len();
        let window = self.config.bounds.idempotency_window;
        self.idempotency.retain(|_, kept| now < kept.created_at.plus(window));
        if self.idempotency.len() < before {
            let through = Millis(now.0.saturating_sub(i64::try_from(window.as_millis()).unwrap_or(i64::MAX)));
            step.writes.push(Write::ForgetIdempotency { through });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(hash: &str) -> IdempotencyRecord {
        IdempotencyRecord { key: "k".into(), request_hash: hash.into(), run_id: "exe_1".into(), created_at: Millis(0) }
    }

    #[test]
    fn a_key_answers_its_run_for_the_same_body_and_refuses_another() {
        assert_eq!(decide(None, "h1"), Ok(None));
        assert_eq!(decide(Some(&kept("h1")), "h1"), Ok(Some("exe_1".into())));
        assert_eq!(decide(Some(&kept("h1")), "h2"), Err(KeyReused { run_id: "exe_1".into() }));
    }
}
