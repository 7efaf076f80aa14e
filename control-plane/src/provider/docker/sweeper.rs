//! The Docker provider's timers, applied: every quarter of a provider
//! minute, the containers labelled with this server's instance are listed;
//! a running one idle for its auto-stop is stopped, a stopped one older
//! than `auto_archive` is archived to an image and one older than
//! `auto_delete` removed, and so is an archive image past `auto_delete`
//! ([`crate::provider::timers`] decides). Only containers and images carrying this
//! instance's label are ever touched.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use bollard::query_parameters::ListContainersOptions;

use super::{DockerInner, DockerProvider, archive, container, lock};
use crate::provider::SandboxProvider as _;
use crate::provider::timers::{self, Retention};

/// One container of this instance.
#[derive(Debug, Clone)]
pub(super) struct Own {
    pub sandbox_id: String,
    pub running: bool,
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
                Some(Own { sandbox_id, running: state == "running", exited: state == "exited" })
            })
            .collect(),
        Err(error) => {
            tracing::warn!(%error, "listing this server's containers failed");
            Vec::new()
        }
    }
}

pub(super) async fn sweep_once(inner: Arc<DockerInner>) {
    let options = inner.options.clone();
    let provider = DockerProvider { inner: Arc::clone(&inner) };
    let now = Instant::now();
    for own in own_containers(&inner).await {
        let id = own.sandbox_id;
        if own.running {
            let minutes = lock(&inner.auto_stop).get(&id).copied().unwrap_or(0);
            // A container first seen now (adopted) is idle from now.
            let since = *lock(&inner.activity).entry(id.clone()).or_insert(now);
            if !timers::idle_stop(minutes, now.duration_since(since), options.minute) {
                continue;
            }
            if !lock(&inner.stopping).insert(id.clone()) {
                continue;
            }
            tracing::info!(sandbox_id = id, minutes, "idle auto-stop: no activity for its auto-stop minutes");
            let provider = provider.clone();
            tokio::spawn(async move {
                provider.stop(&id, options.stop_grace).await;
                lock(&provider.inner.stopping).remove(&id);
            });
        } else if own.exited && (options.auto_archive > 0 || options.auto_delete > 0) {
            age_stopped(&provider, &id).await;
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
    let _retention = inner.retention.write().await;
    let Ok(inspected) = inner.docker.inspect_container(&container::name(id), None).await else { return };
    let state = inspected.state.unwrap_or_default();
    if state.running.unwrap_or(false) {
        return;
    }
    let Some(finished) = state.finished_at else { return };
    let Some(age) = timers::stopped_for(Some(&finished), jiff::Timestamp::now()) else { return };
    match timers::retention((options.auto_archive, options.auto_delete), age, false, options.minute) {
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
        let Some(age) = timers::stopped_for(found.stopped_at.as_deref(), now) else { continue };
        let limits = (options.auto_archive, options.auto_delete);
        if timers::retention(limits, age, true, options.minute) != Retention::Delete {
            continue;
        }
        let _retention = inner.retention.write().await;
        tracing::info!(sandbox_id = found.sandbox_id, minutes = options.auto_delete, "archive image removed by age");
        if let Err(error) = provider.delete(&found.sandbox_id).await {
            tracing::warn!(%error, "the sweeper could not remove an archive image");
        }
    }
}
