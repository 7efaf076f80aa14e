//! The Docker provider's timers, applied: every quarter of a provider
//! minute, the containers labelled with this server's instance are listed;
//! a running one idle for its auto-stop is stopped, a stopped one older
//! than `auto_archive` is archived to an image and one older than
//! `auto_delete` removed, and so is an archive image past `auto_delete`
//! (the rules shared with `local`, in `provider/timers.rs`, decide). Only
//! containers and images carrying this instance's label are ever touched.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bollard::query_parameters::ListContainersOptions;

use super::{DockerInner, DockerProvider, archive, container};
use crate::provider::timers::Retention;
use crate::provider::{SandboxProvider as _, stop_idle};

/// One container of this instance.
#[derive(Debug, Clone)]
pub(super) struct Own {
    pub sandbox_id: String,
    pub running: bool,
    /// Running, paused (a snapshot's commit pauses it) or restarting: a
    /// container whose processes a clean stop must end.
    pub live: bool,
    /// Stopped after having run (not one being created).
    pub exited: bool,
}

/// Every container labelled with this server's instance id, running or not.
pub(super) async fn own_containers(inner: &DockerInner) -> Vec<Own> {
    let label = format!("{}={}", container::INSTANCE_LABEL, inner.options.instance);
    let options = ListContainersOptions {
        all: true,
        filters: Some(HashMap::from([("label".to_owned(), vec![label])])),
        ..Default::default()
    };
    match inner.docker.list_containers(Some(options)).await {
        Ok(containers) => containers
            .into_iter()
            .filter_map(|summary| {
                let sandbox_id = summary.labels.as_ref()?.get(container::SANDBOX_LABEL)?.clone();
                let state = summary.state.map(|state| state.to_string()).unwrap_or_default();
                let live = matches!(state.as_str(), "running" | "paused" | "restarting");
                Some(Own { sandbox_id, running: state == "running", live, exited: state == "exited" })
            })
            .collect(),
        Err(error) => {
            tracing::warn!(%error, "listing this server's containers failed");
            Vec::new()
        }
    }
}

/// One round of the timers: the facts of this instance's containers
/// (running with their auto-stop; stopped since the engine's `FinishedAt`)
/// fed to the shared rules, and what they decide carried out.
pub(super) async fn sweep_once(inner: Arc<DockerInner>) {
    let provider = DockerProvider { inner: Arc::clone(&inner) };
    let options = &inner.options;
    let own = own_containers(&inner).await;
    let running = own.iter().filter(|own| own.running).map(|own| own.sandbox_id.clone());
    stop_idle(&provider, inner.timers.idle(inner.timers.with_auto_stops(running), Instant::now()));
    if inner.timers.ages_stopped() {
        for own in own.iter().filter(|own| own.exited) {
            age_stopped(&provider, &own.sandbox_id).await;
        }
    }
    if options.auto_delete > 0 {
        age_archives(&provider).await;
    }
}

/// Archives or removes a stopped container by its age, under the
/// retention lock (no start meanwhile) and after looking again that it is
/// still stopped.
async fn age_stopped(provider: &DockerProvider, id: &str) {
    let inner = &provider.inner;
    let options = &inner.options;
    let _retaining = inner.timers.retaining().await;
    let Ok(inspected) = inner.docker.inspect_container(&container::name(id), None).await else { return };
    let state = inspected.state.unwrap_or_default();
    if state.running.unwrap_or(false) {
        return;
    }
    let Some(finished) = state.finished_at else { return };
    let Some(age) = stopped_for(Some(&finished), jiff::Timestamp::now()) else { return };
    match inner.timers.retention(age, false) {
        Retention::Keep => {}
        Retention::Archive => match archive::archive(&inner.docker, id, &options.instance, &finished).await {
            Ok(()) => tracing::info!(sandbox_id = id, minutes = options.auto_archive, "stopped container archived"),
            Err(error) => tracing::warn!(%error, "the sweeper could not archive a stopped container"),
        },
        Retention::Delete => {
            tracing::info!(sandbox_id = id, minutes = options.auto_delete, "stopped container removed by the sweeper");
            if let Err(error) = provider.delete(id).await {
                tracing::warn!(%error, "the sweeper could not remove a stopped container");
            }
        }
    }
}

/// Removes archive images (of sandboxes without a container) past
/// `auto_delete`, counted from when their container stopped.
async fn age_archives(provider: &DockerProvider) {
    let inner = &provider.inner;
    let options = &inner.options;
    let containers: HashSet<String> = own_containers(inner).await.into_iter().map(|own| own.sandbox_id).collect();
    for found in archive::own(&inner.docker, &options.instance).await {
        if containers.contains(&found.sandbox_id) {
            continue;
        }
        let now = jiff::Timestamp::now();
        let Some(age) = stopped_for(found.stopped_at.as_deref(), now) else { continue };
        if inner.timers.retention(age, true) != Retention::Delete {
            continue;
        }
        let _retaining = inner.timers.retaining().await;
        tracing::info!(sandbox_id = found.sandbox_id, minutes = options.auto_delete, "archive image removed by age");
        if let Err(error) = provider.delete(&found.sandbox_id).await {
            tracing::warn!(%error, "the sweeper could not remove an archive image");
        }
    }
}

/// How long ago the engine's `FinishedAt` (RFC 3339) was, at `now`; `None`
/// when it is missing, unreadable, or the engine's zero time
/// (`0001-01-01T00:00:00Z`: a container created and never stopped, which
/// is being started, not aged).
fn stopped_for(finished_at: Option<&str>, now: jiff::Timestamp) -> Option<Duration> {
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
