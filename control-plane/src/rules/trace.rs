//! One trace per run start (`--otlp-endpoint`): what the machine decides
//! of it, with no IO and no randomness.
//!
//! A run's trace id is derived from its id, and the delivery span of each
//! attempt from the run id and the attempt's number (the first bytes of a
//! SHA-256 of them): the assignment names its delivery span as the agent's
//! parent (`trace_context`) without a column in the store, a replay or a
//! restart names the same one, and every attempt of a requeued run is in
//! the same trace. The run's other spans are built at the IO edge
//! (`crate::telemetry`) from the record the machine hands over once, when
//! the run's `started` is recorded ([`Effect::Traced`](super::Effect)).

use sha2::{Digest, Sha256};
use standby_protocol::{TraceContext, TraceParent};

use super::{Effect, Rules, Step};

/// The trace id of `run_id`'s trace.
pub fn trace_id(run_id: &str) -> [u8; 16] {
    let digest = Sha256::new().chain_update(b"standby trace\0").chain_update(run_id.as_bytes()).finalize();
    let mut id = [0; 16];
    id.copy_from_slice(&digest[..16]);
    nonzero(id)
}

/// The span id of the delivery of attempt `attempt` of `run_id`: the
/// parent of that attempt's agent's spans.
pub fn delivery_span_id(run_id: &str, attempt: u32) -> [u8; 8] {
    let digest = Sha256::new()
        .chain_update(b"standby delivery\0")
        .chain_update(run_id.as_bytes())
        .chain_update(attempt.to_be_bytes())
        .finalize();
    let mut id = [0; 8];
    id.copy_from_slice(&digest[..8]);
    nonzero(id)
}

/// An all-zero id is invalid; SHA-256 makes one as likely as a collision.
fn nonzero<const N: usize>(mut id: [u8; N]) -> [u8; N] {
    if id == [0; N] {
        id[N - 1] = 1;
    }
    id
}

impl Rules {
    /// The trace context an assignment of attempt `attempt` of `run_id`
    /// carries: `None` when the server traces nothing.
    pub(super) fn trace_context(&self, run_id: &str, attempt: u32) -> Option<TraceContext> {
        self.config.trace.then(|| {
            let parent =
                TraceParent { trace_id: trace_id(run_id), parent_id: delivery_span_id(run_id, attempt), flags: 1 };
            TraceContext::new(parent, None)
        })
    }

    /// The run started: its trace is complete, hand it to the edge.
    pub(super) fn trace_start(&self, step: &mut Step, run_id: &str) {
        if !self.config.trace {
            return;
        }
        if let Some(run) = self.runs.get(run_id) {
            step.effects.push(Effect::Traced(Box::new(run.clone())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_per_run_and_attempt_and_differ_between_them() {
        assert_eq!(trace_id("exe_a"), trace_id("exe_a"));
        assert_ne!(trace_id("exe_a"), trace_id("exe_b"));
        assert_eq!(delivery_span_id("exe_a", 1), delivery_span_id("exe_a", 1));
        assert_ne!(delivery_span_id("exe_a", 1), delivery_span_id("exe_a", 2));
        assert_ne!(delivery_span_id("exe_a", 1), delivery_span_id("exe_b", 1));
        assert_ne!(trace_id("exe_a"), [0; 16]);
    }
}
