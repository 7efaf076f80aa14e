//! The Kubernetes provider's timers, applied (the rules shared with
//! `local` and `docker`, in `provider/timers.rs`, decide): every quarter of
//! a provider minute, a running sandbox Pod idle for its auto-stop is
//! stopped (Tier 1: the Pod deleted, its claim kept), and a stopped
//! sandbox (a workspace claim without a Pod) is deleted once it has been
//! stopped for `auto_delete` minutes, counted from the claim's
//! `standby.dev/stopped-at` annotation (on the SandboxClaim in
//! agent-sandbox mode). There is nothing to archive a
//! claim into without a CSI snapshot class, so `auto_archive` keeps it as
//! it is (docs/deploy.md). The facts come from the watches' stores, not
//! from listing the API.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cache::PodState;
use super::{KubernetesInner, KubernetesProvider};
use crate::provider::timers::Retention;
use crate::provider::{SandboxProvider as _, stop_idle};

/// One round of the timers.
pub(super) async fn sweep_once(inner: Arc<KubernetesInner>) {
    let provider = KubernetesProvider { inner: Arc::clone(&inner) };
    stop_idle(&provider, inner.timers.idle(inner.timers.with_auto_stops(provider.running()), Instant::now()));
    if !inner.timers.ages_stopped() {
        return;
    }
    let now = jiff::Timestamp::now();
    for (id, stopped_at) in provider.stopped() {
        let Some(age) = stopped_for(stopped_at.as_deref(), now) else { continue };
        if inner.timers.retention(age, true) != Retention::Delete {
            continue;
        }
        let _retaining = inner.timers.retaining().await;
        if provider.pod_state(&id) != PodState::Absent {
            continue;
        }
        tracing::info!(sandbox_id = id, minutes = inner.options.auto_delete, "stopped sandbox deleted by age");
        if let Err(error) = provider.delete(&id).await {
            tracing::warn!(%error, "the sweeper could not delete a stopped sandbox");
        }
    }
}

/// How long ago `stopped_at` (RFC 3339) was, at `now`; `None` when it is
/// missing or unreadable (a claim whose sandbox never stopped).
pub(super) fn stopped_for(stopped_at: Option<&str>, now: jiff::Timestamp) -> Option<Duration> {
    let stopped: jiff::Timestamp = stopped_at?.parse().ok()?;
    Some(Duration::try_from(now.duration_since(stopped)).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claims_stop_annotation_is_read_as_an_age() {
        let now: jiff::Timestamp = "2026-12-03T13:00:00Z".parse().expect("a time");
        assert_eq!(stopped_for(Some("2026-12-03T12:59:30Z"), now), Some(Duration::from_secs(30)));
        assert_eq!(stopped_for(Some("2026-12-03T13:00:05Z"), now), Some(Duration::ZERO), "a clock step back");
        assert_eq!(stopped_for(Some("soon"), now), None);
        assert_eq!(stopped_for(None, now), None, "never stopped: not aged");
    }
}
